//! The wire form of server messages.

use protocol::{
    encode, parse_server_message, parse_ts, Chunk, ErrorCode, ErrorMessage, ExecStatus, Load,
    OutputChunk, OutputEncoding, Pong, Reason, RequestError, ResourceUsage, ResultMessage,
    ServerMessage, Utf8Chunker,
};
use serde_json::{json, Value};

fn wire(msg: &ServerMessage) -> Value {
    let text = encode(msg);
    assert!(
        text.starts_with(&format!(r#"{{"v":1,"type":"{}""#, msg.type_name())),
        "{text}"
    );
    assert_eq!(&parse_server_message(&text).unwrap(), msg, "{text}");
    serde_json::from_str(&text).unwrap()
}

fn result(reason: Reason, exit_code: Option<i32>, signal: Option<&str>) -> ResultMessage {
    ResultMessage {
        exit_code,
        duration_ms: 12,
        resource_usage: ResourceUsage {
            peak_memory_mb: 3,
            cpu_time_ms: 4,
        },
        signal: signal.map(str::to_owned),
        stdout_bytes: 5,
        stderr_bytes: 6,
        ..ResultMessage::new("exec_1", reason)
    }
}

/// `YYYY-MM-DDTHH:MM:SS.mmmZ`, checked character by character.
fn assert_ts_shape(ts: &str) {
    let pattern = "dddd-dd-ddTdd:dd:dd.dddZ";
    assert_eq!(ts.len(), pattern.len(), "{ts}");
    for (c, p) in ts.chars().zip(pattern.chars()) {
        if p == 'd' {
            assert!(c.is_ascii_digit(), "{ts}");
        } else {
            assert_eq!(c, p, "{ts}");
        }
    }
    parse_ts(ts).unwrap();
}

#[test]
fn every_message_has_v_and_a_utc_millisecond_ts() {
    let messages = [
        ServerMessage::Ack {
            id: "exec_1".into(),
            limits: None,
            queued: Some(true),
            environment_fingerprint: None,
            environment: None,
        },
        ServerMessage::Status {
            id: "exec_1".into(),
            status: ExecStatus::Running,
        },
        ServerMessage::Result(result(Reason::Exited, Some(0), None)),
        ServerMessage::Error(ErrorMessage::overloaded("exec_1")),
        ServerMessage::Pong(Pong {
            load: Load::default(),
            capabilities: None,
        }),
    ];
    for msg in &messages {
        let value = wire(msg);
        assert_eq!(value["v"], 1);
        assert_ts_shape(value["ts"].as_str().unwrap());
    }
    let before = time::OffsetDateTime::now_utc() - time::Duration::seconds(1);
    let ts = wire(&messages[0])["ts"].as_str().unwrap().to_owned();
    assert!(parse_ts(&ts).unwrap() >= before);
}

#[test]
fn exit_code_is_null_when_signaled() {
    let value = wire(&ServerMessage::Result(result(
        Reason::Signaled,
        None,
        Some("SIGKILL"),
    )));
    assert_eq!(value.get("exit_code"), Some(&Value::Null));
    assert_eq!(value["signal"], "SIGKILL");
    assert_eq!(value["reason"], "signaled");
    assert_eq!(
        value["resource_usage"],
        json!({"peak_memory_mb":3,"cpu_time_ms":4})
    );

    let value = wire(&ServerMessage::Result(result(
        Reason::Exited,
        Some(3),
        None,
    )));
    assert_eq!(value["exit_code"], 3);
    for absent in ["signal", "artifacts", "environment_fingerprint"] {
        assert!(value.get(absent).is_none(), "{absent} present: {value}");
    }
    for (key, want) in [
        ("stdout_bytes", json!(5)),
        ("stderr_bytes", json!(6)),
        ("truncated", json!(false)),
    ] {
        assert_eq!(value[key], want);
    }
}

#[test]
fn reasons_and_terminal_statuses() {
    let cases = [
        (Reason::Exited, Some(0), ExecStatus::Completed, "exited"),
        (Reason::Exited, Some(1), ExecStatus::Failed, "exited"),
        (Reason::Signaled, None, ExecStatus::Failed, "signaled"),
        (Reason::Timeout, None, ExecStatus::Timeout, "timeout"),
        (Reason::Oom, None, ExecStatus::Oom, "oom"),
        (
            Reason::OutputLimit,
            None,
            ExecStatus::Failed,
            "output_limit",
        ),
        (Reason::Cancelled, None, ExecStatus::Cancelled, "cancelled"),
    ];
    for (reason, exit_code, status, name) in cases {
        assert_eq!(ExecStatus::terminal(reason, exit_code), status);
        assert!(status.is_terminal());
        assert_eq!(reason.as_str(), name);
        assert_eq!(
            wire(&ServerMessage::Result(result(reason, exit_code, None)))["reason"],
            name
        );
    }
    assert!(!ExecStatus::Running.is_terminal());
}

#[test]
fn output_encoding_is_omitted_for_utf8() {
    let mut chunker = Utf8Chunker::new();
    let text = chunker.push("héllo\n".as_bytes()).unwrap();
    let value = wire(&ServerMessage::Stdout(OutputChunk::new("exec_1", text)));
    assert_eq!(value["data"], "héllo\n");
    assert!(value.get("encoding").is_none(), "{value}");

    let binary = chunker.push(&[0xFF, 0xFE]).unwrap();
    let msg = ServerMessage::Stderr(OutputChunk::new("exec_1", binary));
    let value = wire(&msg);
    assert_eq!(value["type"], "stderr");
    assert_eq!(value["encoding"], "base64");
    assert_eq!(value["data"], "//4=");
    let ServerMessage::Stderr(chunk) = msg else {
        panic!()
    };
    assert_eq!(chunk.decode().unwrap(), [0xFF, 0xFE]);

    let chunk = Chunk {
        data: "x".into(),
        encoding: OutputEncoding::Utf8,
        raw_len: 1,
    };
    assert_eq!(OutputChunk::new("a", chunk).encoding, None);
}

#[test]
fn error_retryable_follows_the_code() {
    for code in ErrorCode::ALL {
        let value = wire(&ServerMessage::Error(ErrorMessage::new(
            Some("exec_1".into()),
            code,
            "Something",
        )));
        assert_eq!(value["code"], code.as_str());
        assert_eq!(value["retryable"], code.retryable());
        assert!(value.get("supported_versions").is_none());
    }
    let expected_retryable: Vec<ErrorCode> = ErrorCode::ALL
        .into_iter()
        .filter(|c| c.retryable())
        .collect();
    assert_eq!(
        expected_retryable,
        [
            ErrorCode::SandboxOverloaded,
            ErrorCode::InternalError,
            ErrorCode::NetworkError
        ]
    );
    assert!(ErrorMessage::internal("exec_1", "Lost the process").retryable);
}

#[test]
fn error_from_request_error() {
    let err = protocol::parse_client_message(r#"{"v":2,"type":"ping","ts":"..."}"#).unwrap_err();
    let value = wire(&ServerMessage::from(err));
    assert!(value.get("id").is_none(), "{value}");
    assert_eq!(value["code"], "INVALID_REQUEST");
    assert_eq!(value["retryable"], false);
    assert_eq!(value["supported_versions"], json!([1]));

    let value = wire(&RequestError::unknown_execution("exec_9").into());
    assert_eq!(value["id"], "exec_9");
    assert_eq!(value["code"], "UNKNOWN_EXECUTION");
}

#[test]
fn ack_omits_what_it_does_not_know() {
    let value = wire(&ServerMessage::Ack {
        id: "exec_1".into(),
        limits: None,
        queued: None,
        environment_fingerprint: None,
        environment: None,
    });
    assert_eq!(value.as_object().unwrap().len(), 4, "{value}");
    assert_eq!(value["id"], "exec_1");
}

#[test]
fn terminal_messages() {
    assert!(ServerMessage::Result(result(Reason::Exited, Some(0), None)).is_terminal());
    assert!(ServerMessage::Error(ErrorMessage::internal("exec_1", "Boom")).is_terminal());
    assert!(
        !ServerMessage::Error(ErrorMessage::new(None, ErrorCode::InvalidRequest, "Bad"))
            .is_terminal()
    );
    assert!(!ServerMessage::Status {
        id: "a".into(),
        status: ExecStatus::Completed
    }
    .is_terminal());
}

#[test]
fn server_parse_refuses_a_bad_envelope() {
    for text in [
        r#"{"type":"pong","ts":"...","load":{"active_executions":0,"queue_depth":0}}"#,
        r#"{"v":2,"type":"pong","ts":"...","load":{"active_executions":0,"queue_depth":0}}"#,
        r#"{"v":1,"type":"pong","load":{"active_executions":0,"queue_depth":0}}"#,
        r#"{"v":1,"type":"nope","ts":"..."}"#,
        r#"[1]"#,
    ] {
        assert!(parse_server_message(text).is_err(), "{text}");
    }
    // Unknown fields from a newer server are ignored.
    let text = r#"{"v":1,"type":"pong","ts":"...","load":{"active_executions":0,"queue_depth":0,"x":1},"y":2}"#;
    assert!(matches!(
        parse_server_message(text),
        Ok(ServerMessage::Pong(_))
    ));
}

#[test]
fn environment_fingerprint_is_the_documented_hash_of_every_part() {
    use sha2::Digest;
    let env = protocol::Environment {
        image: "python".into(),
        image_digest: format!("sha256:{}", "ab".repeat(32)),
        sandboxd_version: "0.1.0".into(),
        seccomp_profile: format!("sha256:{}", "cd".repeat(32)),
    };
    let limits = protocol::Limits {
        timeout_ms: 1000,
        memory_mb: 64,
        cpu_shares: 512,
        max_output_bytes: 1 << 20,
        pids_max: 64,
        disk_mb: 64,
        cpu_cores: protocol::CpuCores::new(2.0),
    };
    let text = format!(
        "image={};sandboxd=0.1.0;seccomp={};limits={}",
        env.image_digest,
        env.seccomp_profile,
        serde_json::to_string(&limits).unwrap()
    );
    let want = format!("sha256:{:x}", sha2::Sha256::digest(text.as_bytes()));
    assert_eq!(env.fingerprint(&limits), want);
    // Every part counts (the image's local name does not: the digest identifies it).
    let mut other = env.clone();
    other.image = "py".into();
    assert_eq!(other.fingerprint(&limits), want);
    for change in [
        |e: &mut protocol::Environment| e.image_digest.push('0'),
        |e: &mut protocol::Environment| e.sandboxd_version.push('0'),
        |e: &mut protocol::Environment| e.seccomp_profile.push('0'),
    ] {
        let mut e = env.clone();
        change(&mut e);
        assert_ne!(e.fingerprint(&limits), want);
    }
    let mut l = limits;
    l.disk_mb += 1;
    assert_ne!(env.fingerprint(&l), want);
}

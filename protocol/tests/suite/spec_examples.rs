//! Every JSON example of `docs/spec/fsp-v1.md` and of the original FSP v1.0 text it starts from ("Dimension 21, Gap 4",
//! quoted here as `SEED_*`), copied literally. The `"..."` placeholders are kept: the parser does not check `ts`, and
//! `"..."` is valid UTF-8 file content and a valid env value.

use protocol::{
    encode_with_ts, parse_client_message, parse_server_envelope, parse_ts, ClientMessage,
    ErrorCode, ExecStatus, FileEncoding, Language, Reason, RequestedLimits, ServerMessage,
};
use serde_json::Value;

/// `fsp-v1.md` section 3, `execute`.
const SPEC_EXECUTE: &str = r#"{"v":1,"type":"execute","id":"exec_a1","ts":"...","language":"python","code":"print('hi')",
 "stdin":null,"env":{"K":"V"},
 "limits":{"timeout_ms":30000,"memory_mb":256,"cpu_shares":512,"max_output_bytes":1048576,
           "pids_max":64,"disk_mb":64},
 "files":[{"path":"data/in.csv","content":"...","encoding":"utf8"}],
 "artifacts":{"paths":["out/**"]}}"#;

/// `fsp-v1.md` section 3, `cancel`.
const SPEC_CANCEL: &str = r#"{"v":1,"type":"cancel","id":"exec_a1","ts":"..."}"#;

/// `fsp-v1.md` section 3, `ping`.
const SPEC_PING: &str = r#"{"v":1,"type":"ping","ts":"..."}"#;

const SEED_EXECUTE: &str = r#"{
  "v": 1,
  "type": "execute",
  "id": "exec_a1b2c3d4",
  "ts": "2025-12-27T11:30:00.000Z",
  "language": "python",
  "code": "print('hello world')",
  "stdin": null,
  "env": {
    "API_KEY": "..."
  },
  "limits": {
    "timeout_ms": 30000,
    "memory_mb": 256,
    "cpu_shares": 512,
    "max_output_bytes": 1048576
  }
}"#;

const SEED_CANCEL: &str = r#"{
  "v": 1,
  "type": "cancel",
  "id": "exec_a1b2c3d4",
  "ts": "2025-12-27T11:30:05.000Z"
}"#;

const SEED_PING: &str = r#"{
  "v": 1,
  "type": "ping",
  "ts": "2025-12-27T11:30:00.000Z"
}"#;

const SEED_ACK: &str = r#"{
  "v": 1,
  "type": "ack",
  "id": "exec_a1b2c3d4",
  "ts": "2025-12-27T11:30:00.001Z"
}"#;

const SEED_STATUS: &str = r#"{
  "v": 1,
  "type": "status",
  "id": "exec_a1b2c3d4",
  "ts": "2025-12-27T11:30:00.010Z",
  "status": "running"
}"#;

const SEED_STDOUT: &str = r#"{
  "v": 1,
  "type": "stdout",
  "id": "exec_a1b2c3d4",
  "ts": "2025-12-27T11:30:00.100Z",
  "data": "hello world\n"
}"#;

const SEED_RESULT: &str = r#"{
  "v": 1,
  "type": "result",
  "id": "exec_a1b2c3d4",
  "ts": "2025-12-27T11:30:01.500Z",
  "exit_code": 0,
  "duration_ms": 1500,
  "resource_usage": {
    "peak_memory_mb": 45,
    "cpu_time_ms": 120
  }
}"#;

const SEED_ERROR: &str = r#"{
  "v": 1,
  "type": "error",
  "id": "exec_a1b2c3d4",
  "ts": "2025-12-27T11:30:00.500Z",
  "code": "LANGUAGE_NOT_SUPPORTED",
  "message": "Language 'rust' is not available in this sandbox",
  "retryable": false
}"#;

const SEED_PONG: &str = r#"{
  "v": 1,
  "type": "pong",
  "ts": "2025-12-27T11:30:00.001Z",
  "load": {
    "active_executions": 3,
    "queue_depth": 0
  }
}"#;

/// The manifest example of `artifact-manifest.md`, as `result.artifacts`.
const MANIFEST: &str = r#"{"manifest_id":"am_01J...","execution_id":"exec_a1","generated_at":"2026-01-20T12:34:56.000Z",
 "environment_fingerprint":"sha256:<hash of image digest + runtime version + seccomp profile + config limits>",
 "artifacts":[{"type":"file","path":"out/report.md","ref":"artifact://sha256/ab12...",
               "checksum":"sha256:ab12...","size_bytes":1234,"mime_type":"text/markdown",
               "preview":"first 512 bytes if text"}],
 "skipped":[{"path":"out/link","reason":"symlink"}]}"#;

fn json(text: &str) -> Value {
    serde_json::from_str(text).unwrap()
}

/// A client message survives serialization: the wire form parses back to the same message.
fn assert_client_round_trip(msg: &ClientMessage) {
    let text = serde_json::to_string(msg).unwrap();
    assert!(
        text.starts_with(&format!(r#"{{"v":1,"type":"{}""#, msg.type_name())),
        "{text}"
    );
    assert_eq!(&parse_client_message(&text).unwrap(), msg, "{text}");
}

#[test]
fn spec_execute() {
    let ClientMessage::Execute(req) = parse_client_message(SPEC_EXECUTE).unwrap() else {
        panic!("not execute")
    };
    assert_eq!(req.id, "exec_a1");
    assert_eq!(req.ts, "...");
    assert_eq!(req.language, Language::Python);
    assert_eq!(req.code, "print('hi')");
    assert_eq!(req.stdin, None);
    assert_eq!(req.env.get("K").map(String::as_str), Some("V"));
    assert_eq!(
        req.limits,
        RequestedLimits {
            timeout_ms: 30000,
            memory_mb: 256,
            cpu_shares: Some(512),
            max_output_bytes: Some(1048576),
            pids_max: Some(64),
            disk_mb: Some(64),
            cpu_cores: None,
        }
    );
    assert_eq!(req.files.len(), 1);
    assert_eq!(req.files[0].path, "data/in.csv");
    assert_eq!(req.files[0].encoding, FileEncoding::Utf8);
    assert_eq!(req.files[0].decoded().unwrap(), b"...");
    assert_eq!(req.artifacts.as_ref().unwrap().paths, ["out/**"]);
    assert_client_round_trip(&ClientMessage::Execute(req));
}

#[test]
fn spec_cancel_and_ping() {
    let cancel = parse_client_message(SPEC_CANCEL).unwrap();
    let ClientMessage::Cancel(req) = &cancel else {
        panic!("not cancel")
    };
    assert_eq!((req.id.as_str(), req.ts.as_str()), ("exec_a1", "..."));
    assert_client_round_trip(&cancel);

    let ping = parse_client_message(SPEC_PING).unwrap();
    assert!(matches!(&ping, ClientMessage::Ping(p) if p.ts == "..."));
    assert_eq!(ping.id(), None);
    assert_client_round_trip(&ping);
}

#[test]
fn seed_client_messages() {
    let ClientMessage::Execute(req) = parse_client_message(SEED_EXECUTE).unwrap() else {
        panic!("not execute")
    };
    assert_eq!(req.id, "exec_a1b2c3d4");
    assert_eq!(req.code, "print('hello world')");
    assert_eq!(req.limits.pids_max, None);
    assert_eq!(req.env.len(), 1);
    assert!(req.files.is_empty());
    assert!(req.artifacts.is_none());
    parse_ts(&req.ts).unwrap();
    assert_client_round_trip(&ClientMessage::Execute(req));

    for text in [SEED_CANCEL, SEED_PING] {
        let msg = parse_client_message(text).unwrap();
        parse_ts(msg.ts()).unwrap();
        // Exact round trip of the original text.
        assert_eq!(serde_json::to_value(&msg).unwrap(), json(text));
    }
}

/// Parses a server example and checks that re-encoding with its `ts` gives back the same JSON.
fn assert_server_round_trip(text: &str) -> ServerMessage {
    let envelope = parse_server_envelope(text).unwrap();
    assert_eq!(envelope.v, 1);
    let again = encode_with_ts(&envelope.message, &envelope.ts);
    assert_eq!(json(&again), json(text), "re-encoded: {again}");
    envelope.message
}

#[test]
fn seed_server_messages_round_trip() {
    for text in [SEED_ACK, SEED_STATUS, SEED_STDOUT, SEED_ERROR, SEED_PONG] {
        let envelope = parse_server_envelope(text).unwrap();
        parse_ts(&envelope.ts).unwrap();
        assert_server_round_trip(text);
    }
    let ServerMessage::Status { status, .. } = assert_server_round_trip(SEED_STATUS) else {
        panic!()
    };
    assert_eq!(status, ExecStatus::Running);
    let ServerMessage::Stdout(chunk) = assert_server_round_trip(SEED_STDOUT) else {
        panic!()
    };
    assert_eq!(chunk.decode().unwrap(), b"hello world\n");
    let ServerMessage::Error(error) = assert_server_round_trip(SEED_ERROR) else {
        panic!()
    };
    assert_eq!(error.code, ErrorCode::LanguageNotSupported);
    assert!(!error.retryable);
    let ServerMessage::Pong(pong) = assert_server_round_trip(SEED_PONG) else {
        panic!()
    };
    assert_eq!((pong.load.active_executions, pong.load.queue_depth), (3, 0));
    assert_eq!(pong.capabilities, None);
}

#[test]
fn seed_result_parses_and_keeps_its_fields() {
    let envelope = parse_server_envelope(SEED_RESULT).unwrap();
    let ServerMessage::Result(result) = &envelope.message else {
        panic!("not result")
    };
    assert_eq!(result.exit_code, Some(0));
    assert_eq!(result.duration_ms, 1500);
    assert_eq!(
        (
            result.resource_usage.peak_memory_mb,
            result.resource_usage.cpu_time_ms
        ),
        (45, 120)
    );
    // FSP v1.0 has no `reason`: inferred from a non-null exit code.
    assert_eq!(result.reason, Reason::Exited);
    // Re-encoding adds the sandboxd fields and keeps every field of the original.
    let again = json(&encode_with_ts(&envelope.message, &envelope.ts));
    for (key, value) in json(SEED_RESULT).as_object().unwrap() {
        assert_eq!(&again[key], value, "{key}");
    }
    assert_eq!(again["reason"], "exited");
}

/// The sandboxd forms of section 4, with every addition filled in; they round-trip exactly.
#[test]
fn sandboxd_server_messages_round_trip() {
    let ack = r#"{"v":1,"type":"ack","id":"exec_a1","limits":{"timeout_ms":30000,"memory_mb":256,"cpu_shares":512,
        "max_output_bytes":1048576,"pids_max":64,"disk_mb":64},"queued":false,"ts":"2026-01-20T12:34:56.000Z"}"#;
    let ServerMessage::Ack { limits, queued, .. } = assert_server_round_trip(ack) else {
        panic!()
    };
    assert_eq!(limits.map(|l| l.disk_mb), Some(64));
    assert_eq!(queued, Some(false));

    for status in [
        "running",
        "completed",
        "failed",
        "timeout",
        "oom",
        "cancelled",
    ] {
        let text =
            format!(r#"{{"v":1,"type":"status","id":"exec_a1","status":"{status}","ts":"..."}}"#);
        let ServerMessage::Status { status: parsed, .. } = assert_server_round_trip(&text) else {
            panic!()
        };
        assert_eq!(parsed.as_str(), status);
        assert_eq!(parsed.is_terminal(), status != "running");
    }

    let stderr =
        r#"{"v":1,"type":"stderr","id":"exec_a1","data":"/w==","encoding":"base64","ts":"..."}"#;
    let ServerMessage::Stderr(chunk) = assert_server_round_trip(stderr) else {
        panic!()
    };
    assert_eq!(chunk.decode().unwrap(), [0xFF]);

    let result = format!(
        r#"{{"v":1,"type":"result","id":"exec_a1","exit_code":null,"duration_ms":30001,
        "resource_usage":{{"peak_memory_mb":12,"cpu_time_ms":29000}},"reason":"timeout","signal":"SIGKILL",
        "stdout_bytes":10,"stderr_bytes":0,"truncated":false,"artifacts":{MANIFEST},
        "environment_fingerprint":"sha256:abc","ts":"2026-01-20T12:34:56.000Z"}}"#
    );
    let ServerMessage::Result(parsed) = assert_server_round_trip(&result) else {
        panic!()
    };
    assert_eq!(parsed.reason, Reason::Timeout);
    assert_eq!(parsed.exit_code, None);
    assert_eq!(parsed.artifacts.unwrap()["skipped"][0]["reason"], "symlink");

    let error = r#"{"v":1,"type":"error","code":"INVALID_REQUEST","message":"Field v: unsupported protocol version 2",
        "retryable":false,"supported_versions":[1],"ts":"..."}"#;
    let ServerMessage::Error(parsed) = assert_server_round_trip(error) else {
        panic!()
    };
    assert_eq!(parsed.id, None);
    assert_eq!(parsed.supported_versions, Some(vec![1]));

    let pong = r#"{"v":1,"type":"pong","load":{"active_executions":1,"queue_depth":2},"capabilities":{
        "languages":["python","javascript","shell","elixir"],
        "max_limits":{"timeout_ms":300000,"memory_mb":2048,"cpu_shares":1024,"max_output_bytes":16777216,
                      "pids_max":256,"disk_mb":1024},
        "extensions":["files","artifacts","base64_output"],
        "isolation":{"namespaces":["mount","pid","net","ipc","uts","user","cgroup"],"cgroup_version":"v2",
                     "seccomp":true,"landlock_abi":4,"user_namespace":true,"network":"none"}},"ts":"..."}"#;
    let ServerMessage::Pong(parsed) = assert_server_round_trip(pong) else {
        panic!()
    };
    let caps = parsed.capabilities.unwrap();
    assert_eq!(caps.languages, Language::ALL);
    assert_eq!(caps.max_limits.memory_mb, 2048);
    assert_eq!(caps.isolation.landlock_abi, Some(4));
}

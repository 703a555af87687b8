//! Refused input: frames that are not JSON objects, unsupported `v`, unknown types and fields, missing fields,
//! limits above the maximum, escaping file paths, unsupported languages, oversized frames. After each, the
//! connection must still work (spec sections 1, 2 and 3).

use protocol::{ErrorCode, ServerMessage};
use serde_json::{json, Value};
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;
use tokio_tungstenite::tungstenite::Message;

use super::harness::{assert_error, exec_json, privileged, with, Client, Daemon, DaemonOpts};

/// Sends `frame`, expects one `error` with `code` and `id`, whose message contains every one of `names`; then the
/// connection still answers `ping`.
async fn refused(
    c: &mut Client,
    frame: Message,
    code: ErrorCode,
    id: Option<&str>,
    names: &[&str],
) -> Value {
    let shown = format!("{frame:?}");
    c.send(frame).await;
    let (e, raw) = c.take_error().await;
    assert_error(&e, &raw, code, id);
    for n in names {
        assert!(
            e.message.contains(n),
            "the error for {shown} names {n:?}: {raw}"
        );
    }
    c.assert_usable().await;
    raw
}

fn text(v: &Value) -> Message {
    Message::text(v.to_string())
}

/// The connection still runs code.
async fn still_executes(c: &mut Client, id: &str) {
    let r = c
        .run_completed(exec_json(id, "shell", "echo alive", 20_000, 64))
        .await;
    assert_eq!(r.stdout_text(), "alive\n");
}

#[tokio::test]
async fn frames_that_are_not_json_objects() {
    let Some(_g) = privileged("frames_that_are_not_json_objects").await else {
        return;
    };
    let d = Daemon::start(DaemonOpts::default()).await;
    let mut c = Client::connect(&d).await;
    let binary = Message::binary(
        exec_json("bin", "shell", "echo x", 1000, 64)
            .to_string()
            .into_bytes(),
    );
    refused(&mut c, binary, ErrorCode::InvalidRequest, None, &[]).await;
    for t in ["[]", "not json", "42", "\"execute\"", "null", "{\"v\":1,"] {
        refused(
            &mut c,
            Message::text(t),
            ErrorCode::InvalidRequest,
            None,
            &[],
        )
        .await;
    }
    still_executes(&mut c, "after-bad-frames").await;
}

#[tokio::test]
async fn envelope_errors() {
    let Some(_g) = privileged("envelope_errors").await else {
        return;
    };
    let d = Daemon::start(DaemonOpts::default()).await;
    let mut c = Client::connect(&d).await;

    // Unsupported v: supported_versions [1], id echoed when the message has one.
    let raw = refused(
        &mut c,
        text(&json!({"v": 2, "type": "ping", "ts": protocol::now_ts()})),
        ErrorCode::InvalidRequest,
        None,
        &[],
    )
    .await;
    assert_eq!(raw["supported_versions"], json!([1]), "{raw}");
    let raw = refused(
        &mut c,
        text(&with(
            exec_json("v2-exec", "shell", "echo x", 1000, 64),
            json!({"v": 2}),
        )),
        ErrorCode::InvalidRequest,
        Some("v2-exec"),
        &[],
    )
    .await;
    assert_eq!(raw["supported_versions"], json!([1]), "{raw}");

    // Unknown type.
    refused(
        &mut c,
        text(&json!({"v": 1, "type": "launch", "id": "t-1", "ts": protocol::now_ts()})),
        ErrorCode::InvalidRequest,
        Some("t-1"),
        &["type"],
    )
    .await;
    refused(
        &mut c,
        text(&json!({"v": 1, "type": "launch", "ts": protocol::now_ts()})),
        ErrorCode::InvalidRequest,
        None,
        &["type"],
    )
    .await;
    // Missing ts, missing type, wrong type of id.
    refused(
        &mut c,
        text(&with(
            exec_json("no-ts", "shell", "echo x", 1000, 64),
            json!({"ts": null}),
        )),
        ErrorCode::InvalidRequest,
        Some("no-ts"),
        &["ts"],
    )
    .await;
    refused(
        &mut c,
        text(&json!({"v": 1, "id": "no-type", "ts": protocol::now_ts()})),
        ErrorCode::InvalidRequest,
        Some("no-type"),
        &["type"],
    )
    .await;
    // Unusable ids: not echoed, and the message names the field.
    let long = "x".repeat(129);
    for bad in [
        json!(7),
        json!("bad id!"),
        json!(""),
        json!(long),
        json!("a/b"),
    ] {
        refused(
            &mut c,
            text(&with(
                exec_json("x", "shell", "echo x", 1000, 64),
                json!({"id": bad}),
            )),
            ErrorCode::InvalidRequest,
            None,
            &["id"],
        )
        .await;
    }
    refused(
        &mut c,
        text(&json!({"v": 1, "type": "cancel", "ts": protocol::now_ts()})),
        ErrorCode::InvalidRequest,
        None,
        &["id"],
    )
    .await;
    // The longest id and every allowed character work.
    let longest = format!("{}{}", "a.b:c-d_E9", "z".repeat(118));
    still_executes(&mut c, &longest).await;
    still_executes(&mut c, "after-envelope-errors").await;
}

#[tokio::test]
async fn execute_field_errors_name_the_field() {
    let Some(_g) = privileged("execute_field_errors_name_the_field").await else {
        return;
    };
    let d = Daemon::start(DaemonOpts::default()).await;
    let mut c = Client::connect(&d).await;
    let base = || exec_json("f-1", "shell", "echo x", 1000, 64);
    let cases: Vec<(Value, &[&str])> = vec![
        // Missing required fields.
        (with(base(), json!({"limits": null})), &["limits"]),
        (
            with(base(), json!({"limits": {"memory_mb": null}})),
            &["memory_mb"],
        ),
        (
            with(base(), json!({"limits": {"timeout_ms": null}})),
            &["timeout_ms"],
        ),
        (with(base(), json!({"code": null})), &["code"]),
        (with(base(), json!({"language": null})), &["language"]),
        // Wrong types.
        (
            with(base(), json!({"limits": {"timeout_ms": "soon"}})),
            &["timeout_ms"],
        ),
        (with(base(), json!({"env": {"K": 1}})), &["env"]),
        (with(base(), json!({"stdin": 5})), &["stdin"]),
        // Unknown fields, refused rather than ignored.
        (with(base(), json!({"priority": 5})), &["priority"]),
        (
            with(base(), json!({"limits": {"gpu_count": 1}})),
            &["gpu_count"],
        ),
        (
            with(
                base(),
                json!({"files": [{"path": "a.txt", "content": "x", "mode": 493}]}),
            ),
            &["mode"],
        ),
        (
            with(
                base(),
                json!({"files": [{"path": "a.txt", "content": "x", "encoding": "rot13"}]}),
            ),
            &["encoding"],
        ),
        (
            with(
                base(),
                json!({"artifacts": {"paths": ["out/**"], "keep": true}}),
            ),
            &["keep"],
        ),
        // Values execve cannot take.
        (with(base(), json!({"env": {"A=B": "x"}})), &["env"]),
        (with(base(), json!({"env": {"K": "nul\0byte"}})), &["env"]),
        (with(base(), json!({"code": "echo a\0b"})), &["code"]),
    ];
    for (exec, names) in cases {
        refused(
            &mut c,
            text(&exec),
            ErrorCode::InvalidRequest,
            Some("f-1"),
            names,
        )
        .await;
    }
    still_executes(&mut c, "after-field-errors").await;
}

#[tokio::test]
async fn limits_above_the_maximum_are_refused_not_clamped() {
    let Some(_g) = privileged("limits_above_the_maximum_are_refused_not_clamped").await else {
        return;
    };
    let d = Daemon::start(DaemonOpts::default()).await;
    let mut c = Client::connect(&d).await;
    for (limits, name, max) in [
        (json!({"memory_mb": 4096}), "memory_mb", "1024"),
        (json!({"timeout_ms": 60_001}), "timeout_ms", "60000"),
        (json!({"pids_max": 100_000}), "pids_max", "256"),
        (json!({"disk_mb": 257}), "disk_mb", "256"),
        (json!({"cpu_shares": 1025}), "cpu_shares", "1024"),
        (json!({"cpu_cores": 2.5}), "limits.cpu_cores 2.5", "2"),
        (
            json!({"cpu_cores": 0.001}),
            "limits.cpu_cores",
            "at least 0.01",
        ),
        (
            json!({"max_output_bytes": 16_777_217}),
            "max_output_bytes",
            "16777216",
        ),
    ] {
        let exec = with(
            exec_json("lim-1", "shell", "echo x", 1000, 64),
            json!({"limits": limits}),
        );
        refused(
            &mut c,
            text(&exec),
            ErrorCode::InvalidRequest,
            Some("lim-1"),
            &[name, max],
        )
        .await;
    }
    // The maximum itself is accepted and in effect as asked.
    let exec = with(
        exec_json("lim-max", "shell", "echo x", 60_000, 1024),
        json!({"limits": {"pids_max": 256, "disk_mb": 256, "cpu_shares": 1024, "max_output_bytes": 16_777_216,
                          "cpu_cores": 2.0}}),
    );
    let r = c.run_completed(exec).await;
    assert_eq!(r.ack().0, Some(super::harness::MAX_LIMITS), "{}", r.dump());
}

#[tokio::test]
async fn file_paths_must_stay_in_the_workspace() {
    let Some(_g) = privileged("file_paths_must_stay_in_the_workspace").await else {
        return;
    };
    let d = Daemon::start(DaemonOpts::default()).await;
    let mut c = Client::connect(&d).await;
    for path in [
        "../x",
        "/etc/passwd",
        "a/../../x",
        "a/../../../etc/shadow",
        "",
    ] {
        let exec = with(
            exec_json("path-1", "shell", "echo x", 1000, 64),
            json!({"files": [{"path": path, "content": "pwned"}]}),
        );
        refused(
            &mut c,
            text(&exec),
            ErrorCode::InvalidRequest,
            Some("path-1"),
            &["files"],
        )
        .await;
    }
    // Bad base64 is refused too.
    let exec = with(
        exec_json("b64-1", "shell", "echo x", 1000, 64),
        json!({"files": [{"path": "x.bin", "content": "%%%not base64", "encoding": "base64"}]}),
    );
    refused(
        &mut c,
        text(&exec),
        ErrorCode::InvalidRequest,
        Some("b64-1"),
        &["files"],
    )
    .await;
    still_executes(&mut c, "after-paths").await;
}

#[tokio::test]
async fn unsupported_language() {
    let Some(_g) = privileged("unsupported_language").await else {
        return;
    };
    let d = Daemon::start(DaemonOpts::default()).await;
    let mut c = Client::connect(&d).await;
    let exec = exec_json("rust-1", "rust", "fn main() {}", 1000, 64);
    refused(
        &mut c,
        text(&exec),
        ErrorCode::LanguageNotSupported,
        Some("rust-1"),
        &[],
    )
    .await;
    // A language FSP/1 knows but this server does not list in its capabilities is refused the same way.
    let caps = c.ping().await.capabilities.expect("capabilities");
    if !caps.languages.iter().any(|l| l.as_str() == "elixir") {
        let exec = exec_json("ex-1", "elixir", "IO.puts(1)", 1000, 64);
        refused(
            &mut c,
            text(&exec),
            ErrorCode::LanguageNotSupported,
            Some("ex-1"),
            &[],
        )
        .await;
    }
    still_executes(&mut c, "after-language").await;
}

#[tokio::test]
async fn oversized_frame_closes_with_1009_and_the_daemon_goes_on() {
    let Some(_g) = privileged("oversized_frame_closes_with_1009_and_the_daemon_goes_on").await
    else {
        return;
    };
    let d = Daemon::start(DaemonOpts {
        max_frame_bytes: 65536,
        ..DaemonOpts::default()
    })
    .await;
    let mut c = Client::connect(&d).await;

    // Just under the limit: accepted.
    let padding = "#".repeat(60_000);
    c.run_completed(exec_json(
        "near-limit",
        "shell",
        &format!("echo under\n{padding}"),
        20_000,
        64,
    ))
    .await;

    // Over it: the connection is closed with 1009.
    let padding = "#".repeat(100_000);
    c.send_json(&exec_json(
        "too-big",
        "shell",
        &format!("echo over\n{padding}"),
        20_000,
        64,
    ))
    .await;
    let close = loop {
        match c.next_frame(std::time::Duration::from_secs(10)).await {
            None => panic!("the connection was not closed after a frame over max_frame_bytes"),
            Some(Ok(Message::Close(frame))) => break frame,
            Some(Ok(Message::Text(t))) => {
                let (m, raw) = Client::parse(t.as_str());
                assert!(
                    !matches!(m, ServerMessage::Ack { .. }),
                    "the oversized execute must not be accepted: {raw}"
                );
            }
            Some(other) => panic!("expected a close frame with code 1009, got {other:?}"),
        }
    };
    let code = close.as_ref().map(|f| f.code);
    assert_eq!(code, Some(CloseCode::Size), "close code 1009: {close:?}");

    // The daemon keeps serving new connections.
    let mut c2 = Client::connect(&d).await;
    c2.assert_usable().await;
    still_executes(&mut c2, "after-oversized").await;
}

#[tokio::test]
async fn files_larger_than_the_scratch_space_are_refused() {
    let Some(_g) = privileged("files_larger_than_the_scratch_space_are_refused").await else {
        return;
    };
    let d = Daemon::start(DaemonOpts::default()).await;
    let mut c = Client::connect(&d).await;
    use base64::Engine as _;
    let two_mib = base64::engine::general_purpose::STANDARD.encode(vec![7u8; 2 << 20]);
    let exec = with(
        exec_json("big-files", "shell", "echo x", 10_000, 64),
        json!({"limits": {"disk_mb": 1}, "files": [{"path": "big.bin", "content": two_mib, "encoding": "base64"}]}),
    );
    refused(
        &mut c,
        text(&exec),
        ErrorCode::InvalidRequest,
        Some("big-files"),
        &["files"],
    )
    .await;
    still_executes(&mut c, "after-big-files").await;
}

/// `artifacts` is an extension: a server that does not list it in its capabilities must refuse a request that
/// asks for it (never accept and ignore it); one that lists it must return a manifest.
#[tokio::test]
async fn artifacts_are_refused_unless_advertised() {
    let Some(_g) = privileged("artifacts_are_refused_unless_advertised").await else {
        return;
    };
    let d = Daemon::start(DaemonOpts::default()).await;
    let mut c = Client::connect(&d).await;
    let caps = c.ping().await.capabilities.expect("capabilities");
    let exec = with(
        exec_json(
            "art-1",
            "shell",
            "mkdir -p out; echo report > out/r.txt",
            20_000,
            64,
        ),
        json!({"artifacts": {"paths": ["out/**"]}}),
    );
    if caps.extensions.iter().any(|e| e == "artifacts") {
        let r = c.run_completed(exec).await;
        assert!(
            r.result().artifacts.is_some(),
            "a manifest when artifacts were requested: {}",
            r.dump()
        );
    } else {
        refused(
            &mut c,
            text(&exec),
            ErrorCode::InvalidRequest,
            Some("art-1"),
            &["artifacts"],
        )
        .await;
    }
}

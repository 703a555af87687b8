//! Extension `network` against a scripted fake server: the request's `network` reaches the server as sent, the
//! proxy's counters come back in `ExecutionResult::network`, a server without the extension refuses the request
//! and the connection goes on; `sandboxctl exec --allow/--egress-bytes` sends it and prints the counters.

use std::process::Output;
use std::sync::Arc;

use client::{
    ClientError, ConnectOptions, Connection, Execute, ExecuteRequest, Language, NetworkRequest,
    NetworkUsage, RequestedLimits,
};
use protocol::ErrorCode;
use serde_json::{json, Value};

use super::daemon::require_sandboxctl;
use super::fake::{self, FakeServer, Reply};
use super::sandboxctl::ctl_env;

/// The counters the fake reports for every execution that asked for `network`.
const USAGE: NetworkUsage = NetworkUsage {
    connections: 3,
    upstream_connections: 2,
    refused: 1,
    bytes_sent: 517,
    bytes_received: 4096,
};

/// A fake that runs an execute asking for `network` (its result carries [`USAGE`]) when `enabled`, and refuses
/// it as sandboxd does without the extension otherwise; everything else gets the standard answers.
async fn server(enabled: bool) -> FakeServer {
    FakeServer::start(Arc::new(move |_, msg| {
        let id = msg["id"].as_str().unwrap_or("?");
        match (msg["type"].as_str(), msg.get("network")) {
            (Some("execute"), Some(_)) if enabled => {
                let mut replies = fake::success(id, "through the proxy\n");
                if let Some(Reply::Json(result)) = replies.last_mut() {
                    result["network"] = serde_json::to_value(USAGE).unwrap_or_default();
                }
                replies
            }
            (Some("execute"), Some(_)) => vec![Reply::Json(json!({
                "v": 1, "type": "error", "id": id, "code": "INVALID_REQUEST", "retryable": false,
                "message": "Field network: this server does not offer the network extension", "ts": fake::ts(),
            }))],
            _ => fake::standard(msg),
        }
    }))
    .await
}

fn request(id: &str) -> ExecuteRequest {
    ExecuteRequest::new(
        id,
        Language::Python,
        "print(1)",
        RequestedLimits::new(5_000, 64),
    )
}

#[tokio::test]
async fn the_network_request_is_sent_and_the_counters_come_back() {
    let server = server(true).await;
    let conn = Connection::connect(ConnectOptions::new(server.url()))
        .await
        .unwrap();
    let mut asked = request("net-a");
    asked.network = Some(NetworkRequest {
        allow: vec!["pypi.org:443".into(), "*.pythonhosted.org:443".into()],
        egress_bytes: Some(1 << 20),
    });
    let r = conn.execute(asked).await.unwrap();
    assert_eq!(r.network, Some(USAGE));
    assert_eq!(r.stdout_text(), "through the proxy\n");

    // Without `network`, none is sent and none comes back.
    let r = conn.execute(request("net-b")).await.unwrap();
    assert_eq!(r.network, None);

    let sent = server.received_of("execute");
    assert_eq!(
        sent[0]["network"],
        json!({"allow": ["pypi.org:443", "*.pythonhosted.org:443"], "egress_bytes": 1_048_576})
    );
    assert!(sent[1].get("network").is_none(), "{}", sent[1]);
}

#[tokio::test]
async fn a_server_without_network_refuses_and_the_connection_goes_on() {
    let server = server(false).await;
    let conn = Connection::connect(ConnectOptions::new(server.url()))
        .await
        .unwrap();
    let mut asked = request("net-refused");
    asked.network = Some(NetworkRequest::allow(["example.com:443"]));
    let err = conn.execute(asked).await.unwrap_err();
    match &err {
        ClientError::Server { id, code, message } => {
            assert_eq!(id.as_deref(), Some("net-refused"));
            assert_eq!(*code, ErrorCode::InvalidRequest);
            assert!(message.starts_with("Field network:"), "{message}");
        }
        other => panic!("expected the server's refusal, got {other:?}"),
    }
    assert!(!err.is_retryable());
    let r = conn.execute(request("net-after")).await.unwrap();
    assert!(r.success());
    assert_eq!(r.network, None);
}

/// The execute messages a fake received, as JSON.
fn executes(server: &FakeServer) -> Vec<Value> {
    server.received_of("execute")
}

fn show(o: &Output) -> String {
    format!(
        "exit {:?}\nstdout: {}\nstderr: {}",
        o.status.code(),
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

#[tokio::test]
async fn sandboxctl_sends_allow_and_prints_the_counters() {
    if !require_sandboxctl("sandboxctl_sends_allow_and_prints_the_counters") {
        return;
    }
    let server = server(true).await;
    let url = server.url();
    let env = [("SANDBOXD_URL", url.as_str())];
    let args = [
        "exec",
        "-l",
        "python",
        "--code",
        "print(1)",
        "--allow",
        "pypi.org:443",
        "--allow",
        "files.pythonhosted.org",
        "--egress-bytes",
        "65536",
    ];
    let o = ctl_env(&args, None, &env).await;
    assert_eq!(o.status.code(), Some(0), "{}", show(&o));
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(
        stderr.contains(
            "network: 3 connections (2 upstream), 1 refused, 517 bytes sent, 4096 bytes received"
        ),
        "{}",
        show(&o)
    );
    assert_eq!(
        executes(&server)[0]["network"],
        json!({"allow": ["pypi.org:443", "files.pythonhosted.org"], "egress_bytes": 65536})
    );

    // --json: the result line carries the counters, and nothing else is printed about them.
    let mut json_args = args.to_vec();
    json_args.push("--json");
    let o = ctl_env(&json_args, None, &env).await;
    assert_eq!(o.status.code(), Some(0), "{}", show(&o));
    let stdout = String::from_utf8_lossy(&o.stdout);
    let result: Value = stdout
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .find(|v| v["type"] == "result")
        .unwrap_or_else(|| panic!("no result line: {}", show(&o)));
    assert_eq!(result["network"]["refused"], 1, "{result}");
    assert!(!String::from_utf8_lossy(&o.stderr).contains("network:"));

    // Without --allow: no network asked, none printed.
    let o = ctl_env(&["exec", "-l", "python", "--code", "print(1)"], None, &env).await;
    assert_eq!(o.status.code(), Some(0), "{}", show(&o));
    assert!(!String::from_utf8_lossy(&o.stderr).contains("network"));
    assert!(executes(&server)[2].get("network").is_none());
}

#[tokio::test]
async fn sandboxctl_reports_a_refused_network_request_as_65() {
    if !require_sandboxctl("sandboxctl_reports_a_refused_network_request_as_65") {
        return;
    }
    let server = server(false).await;
    let url = server.url();
    let env = [("SANDBOXD_URL", url.as_str())];
    let args = [
        "exec",
        "-l",
        "shell",
        "--code",
        "true",
        "--allow",
        "example.com",
    ];
    let o = ctl_env(&args, None, &env).await;
    assert_eq!(o.status.code(), Some(65), "{}", show(&o));
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("Field network:"),
        "{}",
        show(&o)
    );
    // --egress-bytes alone is a usage error; an empty entry is refused before it is sent.
    let o = ctl_env(
        &[
            "exec",
            "-l",
            "shell",
            "--code",
            "true",
            "--egress-bytes",
            "9",
        ],
        None,
        &env,
    )
    .await;
    assert_eq!(o.status.code(), Some(2), "{}", show(&o));
    let o = ctl_env(
        &["exec", "-l", "shell", "--code", "true", "--allow", ""],
        None,
        &env,
    )
    .await;
    assert_eq!(o.status.code(), Some(65), "{}", show(&o));
    assert_eq!(
        executes(&server).len(),
        1,
        "only the first execute was sent"
    );
}

//! A faulty server: malformed messages fail the executions they concern with non-retryable errors; a dropped
//! connection fails them with retryable ones.

use std::sync::Arc;
use std::time::Duration;

use client::{
    ClientError, ConnectOptions, Connection, ConnectionStatus, ErrorKind, Execute, ExecuteRequest,
    Language, Pool, RequestedLimits,
};
use serde_json::json;

use super::daemon::wait_until;
use super::fake::{self, FakeServer, Reply};

fn req(id: &str) -> ExecuteRequest {
    ExecuteRequest::new(
        id,
        Language::Python,
        "print(1)",
        RequestedLimits::new(5000, 64),
    )
}

#[tokio::test]
async fn a_frame_that_is_not_json_fails_every_execution_in_flight_non_retryable() {
    let server = FakeServer::start(Arc::new(|_, msg| match msg["type"].as_str() {
        Some("execute") if msg["id"] == "nj-a" => vec![Reply::Json(
            json!({"v":1,"type":"ack","id":"nj-a","ts":fake::ts()}),
        )],
        Some("execute") => vec![
            Reply::Json(json!({"v":1,"type":"ack","id":msg["id"],"ts":fake::ts()})),
            Reply::Text("{this is not json".into()),
        ],
        _ => fake::standard(msg),
    }))
    .await;
    let log = captured_log();
    let conn = Connection::connect(ConnectOptions::new(server.url()))
        .await
        .unwrap();
    // Two executions multiplexed on one connection; the garbage cannot be attributed, so both fail.
    let a = conn.execute_stream(req("nj-a")).await.unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    let b = conn.execute_stream(req("nj-b")).await.unwrap();
    for (name, ex) in [("nj-a", a), ("nj-b", b)] {
        let e = tokio::time::timeout(Duration::from_secs(5), ex.result())
            .await
            .unwrap()
            .unwrap_err();
        assert!(matches!(e, ClientError::Malformed { .. }), "{name}: {e:?}");
        assert!(!e.is_retryable(), "{name}: {e}");
        assert_eq!(e.kind(), ErrorKind::Sandbox);
    }
    // Both are cancelled on the server, and the connection stays up.
    wait_until("two cancels", Duration::from_secs(5), || async {
        let n = server.received_of("cancel").len();
        if n == 2 {
            Ok(())
        } else {
            Err(format!("{n} cancels"))
        }
    })
    .await;
    assert_eq!(conn.status(), ConnectionStatus::Connected);
    conn.ping(Duration::from_secs(1)).await.unwrap();
    // Logged as an error, with the frame and the executions it failed.
    let log = log.text();
    let line = log
        .lines()
        .find(|l| l.contains("malformed message from the sandbox") && l.contains("nj-a"))
        .unwrap_or_else(|| panic!("no log line for the malformed frame:\n{log}"));
    assert!(line.contains("ERROR"), "{line}");
    assert!(line.contains("{this is not json"), "{line}");
    assert!(line.contains("\"nj-b\""), "{line}");
}

/// The log of this test process: a global subscriber writing into memory, installed once. (A scoped subscriber
/// misses events when other test threads hit the same callsite first.)
fn captured_log() -> &'static CapturedLog {
    static LOG: std::sync::LazyLock<CapturedLog> = std::sync::LazyLock::new(|| {
        let log = CapturedLog::default();
        let _ = tracing_subscriber::fmt()
            .with_writer(log.clone())
            .with_ansi(false)
            .with_max_level(tracing::Level::WARN)
            .try_init();
        log
    });
    &LOG
}

/// A `tracing` writer into memory.
#[derive(Clone, Default)]
struct CapturedLog(Arc<std::sync::Mutex<Vec<u8>>>);

impl CapturedLog {
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
    }
}

impl std::io::Write for CapturedLog {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for CapturedLog {
    type Writer = CapturedLog;

    fn make_writer(&'a self) -> CapturedLog {
        self.clone()
    }
}

#[tokio::test]
async fn a_malformed_message_with_an_id_fails_only_that_execution() {
    // "good" is acknowledged and runs; the answer to "bad" is a status the spec does not know, then the rest of
    // "good" arrives.
    let server = FakeServer::start(Arc::new(|_, msg| match msg["type"].as_str() {
        Some("execute") if msg["id"] == "good" => vec![
            Reply::Json(json!({"v":1,"type":"ack","id":"good","ts":fake::ts()})),
            Reply::Json(
                json!({"v":1,"type":"status","id":"good","status":"running","ts":fake::ts()}),
            ),
        ],
        Some("execute") if msg["id"] == "bad" => {
            let mut replies = vec![Reply::Json(
                json!({"v":1,"type":"status","id":"bad","status":"exploded","ts":fake::ts()}),
            )];
            replies.extend(fake::success("good", "fine\n").into_iter().skip(2));
            replies
        }
        _ => fake::standard(msg),
    }))
    .await;
    let conn = Connection::connect(ConnectOptions::new(server.url()))
        .await
        .unwrap();
    let mut good = conn.execute_stream(req("good")).await.unwrap();
    // "good" is running before "bad" is sent.
    for _ in 0..2 {
        good.next().await.unwrap().unwrap();
    }
    let good = tokio::spawn(good.result());
    let bad = conn.execute_stream(req("bad")).await.unwrap();
    let e = bad.result().await.unwrap_err();
    assert!(matches!(e, ClientError::Malformed { .. }), "{e:?}");
    assert!(!e.is_retryable());
    let r = good.await.unwrap().unwrap();
    assert_eq!(r.stdout_text(), "fine\n");
    assert_eq!(r.status, client::ExecStatus::Completed);
}

#[tokio::test]
async fn malformed_messages_through_the_pool_are_non_retryable() {
    for garbage in [
        "not json at all",
        "[1, 2, 3]",
        r#"{"v":1,"type":"result","ts":"x"}"#,
        r#"{"v":2,"type":"pong","load":{"active_executions":0,"queue_depth":0},"ts":"x"}"#,
    ] {
        let server = FakeServer::start(Arc::new(move |_, msg| match msg["type"].as_str() {
            Some("execute") => vec![Reply::Text(garbage.to_owned())],
            _ => fake::standard(msg),
        }))
        .await;
        let pool = Pool::builder(server.url()).build().unwrap();
        let e = pool
            .execute(client::ExecuteRequest::new(
                client::new_execution_id(),
                Language::Shell,
                "true",
                RequestedLimits::new(1000, 64),
            ))
            .await
            .unwrap_err();
        assert!(
            matches!(e, ClientError::Malformed { .. }),
            "{garbage}: {e:?}"
        );
        assert!(!e.is_retryable(), "{garbage}: {e}");
    }
}

#[tokio::test]
async fn output_beyond_max_output_bytes_is_a_protocol_violation() {
    let server = FakeServer::start(Arc::new(|_, msg| match msg["type"].as_str() {
        Some("execute") => {
            let id = msg["id"].clone();
            vec![
                Reply::Json(json!({"v":1,"type":"ack","id":id,"ts":fake::ts(),
                    "limits":{"timeout_ms":1000,"memory_mb":64,"cpu_shares":512,"max_output_bytes":4,
                              "pids_max":64,"disk_mb":64}})),
                Reply::Json(json!({"v":1,"type":"stdout","id":id,"data":"12345","ts":fake::ts()})),
            ]
        }
        _ => fake::standard(msg),
    }))
    .await;
    let conn = Connection::connect(ConnectOptions::new(server.url()))
        .await
        .unwrap();
    let e = conn.execute(req("x")).await.unwrap_err();
    assert!(matches!(e, ClientError::Protocol { .. }), "{e:?}");
    assert!(!e.is_retryable());
}

#[tokio::test]
async fn a_dropped_connection_fails_in_flight_executions_retryable_and_reconnects() {
    let server = FakeServer::start(Arc::new(|n, msg| match msg["type"].as_str() {
        Some("execute") if n == 1 => vec![
            Reply::Json(json!({"v":1,"type":"ack","id":msg["id"],"ts":fake::ts()})),
            Reply::Json(
                json!({"v":1,"type":"status","id":msg["id"],"status":"running","ts":fake::ts()}),
            ),
            Reply::Drop,
        ],
        _ => fake::standard(msg),
    }))
    .await;
    let conn = Connection::connect(ConnectOptions::new(server.url()))
        .await
        .unwrap();
    let e = conn.execute(req("x")).await.unwrap_err();
    assert!(matches!(e, ClientError::Disconnected { .. }), "{e:?}");
    assert!(e.is_retryable());
    // The first retry is immediate: the connection is back at once.
    let mut status = conn.watch_status();
    tokio::time::timeout(
        Duration::from_secs(2),
        status.wait_for(|s| *s == ConnectionStatus::Connected),
    )
    .await
    .unwrap()
    .unwrap();
    let r = conn.execute(req("y")).await.unwrap();
    assert_eq!(r.stdout_text(), "hi\n");
    assert_eq!(
        server.connections.load(std::sync::atomic::Ordering::SeqCst),
        2
    );
}

#[tokio::test]
async fn dropping_a_stream_early_cancels_the_execution_on_the_server() {
    let server = FakeServer::start(Arc::new(|_, msg| match msg["type"].as_str() {
        Some("execute") => vec![Reply::Json(
            json!({"v":1,"type":"ack","id":msg["id"],"ts":fake::ts()}),
        )],
        _ => fake::standard(msg),
    }))
    .await;
    let conn = Connection::connect(ConnectOptions::new(server.url()))
        .await
        .unwrap();
    let mut ex = conn.execute_stream(req("early")).await.unwrap();
    let ack = ex.next().await.unwrap().unwrap();
    assert_eq!(ack.message.type_name(), "ack");
    drop(ex);
    wait_until("the cancel", Duration::from_secs(5), || async {
        let cancels = server.received_of("cancel");
        match cancels.first() {
            Some(c) if c["id"] == "early" => Ok(()),
            _ => Err(format!("{cancels:?}")),
        }
    })
    .await;
    assert_eq!(conn.in_flight(), 0);
}

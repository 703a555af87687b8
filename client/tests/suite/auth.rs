//! Authentication: static tokens, a provider asked on every (re)connect, and refused tokens.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use client::{Auth, ClientError, ConnectOptions, Connection, ConnectionStatus, Execute};
use serde_json::json;

use super::fake::{self, FakeServer, Reply};

#[tokio::test]
async fn a_refused_token_is_unauthorized_and_not_retryable() {
    let server = FakeServer::start_on(
        "127.0.0.1:0".parse().unwrap(),
        Arc::new(|_, m| fake::standard(m)),
        Some("right-token".into()),
        None,
    )
    .await;
    let e = Connection::connect(ConnectOptions::new(server.url()).token("wrong-token"))
        .await
        .unwrap_err();
    assert!(matches!(e, ClientError::Unauthorized), "{e:?}");
    assert!(!e.is_retryable());
    let conn = Connection::connect(ConnectOptions::new(server.url()).token("right-token"))
        .await
        .unwrap();
    conn.ping(Duration::from_secs(1)).await.unwrap();
    let headers = server.auth_headers.lock().unwrap().clone();
    assert_eq!(headers, ["Bearer wrong-token", "Bearer right-token"]);
}

#[tokio::test]
async fn the_token_provider_is_asked_on_every_connect_and_reconnect() {
    // The server drops connection 1 on its first execute; the reconnect must carry the refreshed token.
    let server = FakeServer::start(Arc::new(|n, m| match m["type"].as_str() {
        Some("execute") if n == 1 => vec![
            Reply::Json(json!({"v":1,"type":"ack","id":m["id"],"ts":fake::ts()})),
            Reply::Drop,
        ],
        _ => fake::standard(m),
    }))
    .await;
    let calls = Arc::new(AtomicU32::new(0));
    let provider = {
        let calls = calls.clone();
        move || {
            let n = calls.fetch_add(1, Ordering::SeqCst) + 1;
            async move { Ok::<_, client::BoxError>(format!("token-{n}")) }
        }
    };
    let conn =
        Connection::connect(ConnectOptions::new(server.url()).auth(Auth::provider(provider)))
            .await
            .unwrap();
    let req = |id: &str| {
        client::ExecuteRequest::new(
            id,
            client::Language::Shell,
            "true",
            client::RequestedLimits::new(1000, 64),
        )
    };
    let e = conn.execute(req("a")).await.unwrap_err();
    assert!(e.is_retryable(), "{e:?}");
    let mut status = conn.watch_status();
    tokio::time::timeout(
        Duration::from_secs(2),
        status.wait_for(|s| *s == ConnectionStatus::Connected),
    )
    .await
    .unwrap()
    .unwrap();
    conn.execute(req("b")).await.unwrap();
    let headers = server.auth_headers.lock().unwrap().clone();
    assert_eq!(headers, ["Bearer token-1", "Bearer token-2"]);
    assert_eq!(calls.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn a_failing_provider_is_a_retryable_token_error() {
    let server = FakeServer::start(Arc::new(|_, m| fake::standard(m))).await;
    let auth =
        Auth::provider(|| async { Err::<String, _>(client::BoxError::from("vault is down")) });
    let e = Connection::connect(ConnectOptions::new(server.url()).auth(auth))
        .await
        .unwrap_err();
    assert!(matches!(e, ClientError::Token { .. }), "{e:?}");
    assert!(e.is_retryable());
    assert_eq!(
        std::error::Error::source(&e).map(|s| s.to_string()),
        Some("vault is down".to_owned())
    );
}

//! `wss://` with rustls, against a fake server with a self-signed certificate.

use std::sync::Arc;
use std::time::Duration;

use client::{ClientError, ConnectOptions, Connection, Execute, Pool};

use super::fake::{self, FakeServer};

async fn tls_server() -> (FakeServer, rustls::pki_types::CertificateDer<'static>) {
    let (acceptor, cert_der, _) = fake::self_signed("localhost");
    let server = FakeServer::start_on(
        "127.0.0.1:0".parse().unwrap(),
        Arc::new(|_, m| fake::standard(m)),
        Some("tls-token".into()),
        Some(acceptor),
    )
    .await;
    (server, cert_der)
}

#[tokio::test]
async fn wss_works_with_a_trusted_certificate() {
    let (server, cert) = tls_server().await;
    let url = format!("wss://localhost:{}/ws", server.addr.port());
    let tls = client::tls::config_trusting([cert]).unwrap();
    let pool = Pool::builder(url)
        .token("tls-token")
        .tls_config(tls)
        .build()
        .unwrap();
    let r = pool
        .execute(client::ExecuteRequest::new(
            "over-tls",
            client::Language::Shell,
            "echo hi",
            client::RequestedLimits::new(1000, 64),
        ))
        .await
        .unwrap();
    assert_eq!(r.stdout_text(), "hi\n");
    pool.ping().await.unwrap();
}

#[tokio::test]
async fn wss_refuses_an_untrusted_certificate() {
    let (server, _) = tls_server().await;
    let url = format!("wss://localhost:{}/ws", server.addr.port());
    // Default roots (webpki): a self-signed certificate is not trusted.
    let e = Connection::connect(
        ConnectOptions::new(url)
            .token("tls-token")
            .connect_timeout(Duration::from_secs(5)),
    )
    .await
    .unwrap_err();
    assert!(matches!(e, ClientError::Connect { .. }), "{e:?}");
    let source = std::error::Error::source(&e)
        .map(|s| s.to_string())
        .unwrap_or_default();
    assert!(
        source.to_lowercase().contains("certificate"),
        "the failure names the certificate: {source}"
    );
}

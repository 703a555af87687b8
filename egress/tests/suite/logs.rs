//! Refusals are logged at info level with their reason.

use std::io::Write;
use std::sync::{Arc, Mutex};

use egress::{AddressPolicy, ProxyLimits, StaticResolver};

use super::common::*;

struct Captured(Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

// A current-thread runtime: the proxy's tasks run on this thread, under the subscriber set here.
#[tokio::test(flavor = "current_thread")]
async fn refusals_are_logged_at_info_with_their_reason() {
    let logs: Arc<Mutex<Vec<u8>>> = Arc::default();
    let sink = logs.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::INFO)
        .with_ansi(false)
        .with_writer(move || Captured(sink.clone()))
        .finish();
    let _guard = tracing::subscriber::set_default(subscriber);

    let server = tls_server().await;
    let port = server.addr.port();
    let allow = vec![
        format!("allowed.test:{port}"),
        format!("rebound.test:{port}"),
    ];
    let resolver = StaticResolver::new()
        .with("allowed.test", [LOCALHOST])
        .with("rebound.test", ["169.254.169.254".parse().unwrap()]);
    let policy = AddressPolicy::new().exempt_for_tests(server.addr);
    let proxy = start_proxy(&allow, policy, resolver, ProxyLimits::default()).await;

    assert_eq!(
        connect(proxy.addr, &format!("denied.test:{port}"), "")
            .await
            .unwrap()
            .0,
        403
    );
    assert_eq!(
        connect(proxy.addr, &format!("rebound.test:{port}"), "")
            .await
            .unwrap()
            .0,
        403
    );
    let (status, stream) = connect(proxy.addr, &format!("allowed.test:{port}"), "")
        .await
        .unwrap();
    assert_eq!(status, 200);
    assert!(tls_over(stream, &server.cert, "other.test").await.is_err());

    let text = String::from_utf8(logs.lock().unwrap().clone()).unwrap();
    let refusals: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("egress refused"))
        .collect();
    assert_eq!(refusals.len(), 3, "{text}");
    assert!(refusals.iter().all(|l| l.contains(" INFO ")), "{text}");
    assert!(
        refusals[0].contains(&format!("denied.test:{port} is not on the allowlist")),
        "{text}"
    );
    assert!(
        refusals[1]
            .contains("rebound.test resolves only to refused addresses (link-local address)"),
        "{text}"
    );
    assert!(
        refusals[2]
            .contains("SNI Some(\"other.test\") does not match the CONNECT host allowed.test"),
        "{text}"
    );
}

/// A request head that is not HTTP gets the proxy's own refusal (a 400 with its reason), counted in `refused` and
/// logged in the span the proxy serves in (the daemon's names the execution); a later head of a kept-alive
/// connection that hyper cannot parse is counted and logged too (hyper answers it).
#[tokio::test(flavor = "current_thread")]
async fn a_malformed_request_is_refused_counted_and_logged_with_the_execution() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tracing::Instrument;

    let logs: Arc<Mutex<Vec<u8>>> = Arc::default();
    let sink = logs.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::INFO)
        .with_ansi(false)
        .with_writer(move || Captured(sink.clone()))
        .finish();
    let _guard = tracing::subscriber::set_default(subscriber);

    let origin = origin().await;
    let host = format!("origin.test:{}", origin.addr.port());
    let listener = tokio::net::TcpListener::bind((LOCALHOST, 0)).await.unwrap();
    let addr = listener.local_addr().unwrap();
    let proxy = egress::Proxy::new(
        egress::Allowlist::parse(std::slice::from_ref(&host)).unwrap(),
        AddressPolicy::new().exempt_for_tests(origin.addr),
        Arc::new(StaticResolver::new().with("origin.test", [LOCALHOST])),
        ProxyLimits::default(),
    );
    let serving = proxy.clone();
    let span = tracing::info_span!("egress", execution = "exec_m1");
    tokio::spawn(async move { serving.serve(listener).await }.instrument(span));

    let not_http = raw(addr, "THIS IS NOT HTTP\r\n\r\n").await.unwrap();
    assert!(
        not_http.starts_with("HTTP/1.1 400 Bad Request\r\n"),
        "{not_http:?}"
    );
    assert!(
        not_http.ends_with(
            "\r\n\r\negress refused: malformed proxy request: not an HTTP/1.x request line (invalid HTTP version)\n"
        ),
        "{not_http:?}"
    );
    // A TLS ClientHello sent to the proxy itself (an `https://` proxy URL).
    let tls = raw(addr, "\u{16}\u{3}\u{1}\u{2}\u{0}\u{1}").await.unwrap();
    assert!(tls.starts_with("HTTP/1.1 400 "), "{tls:?}");
    assert!(
        tls.contains("egress refused: malformed proxy request"),
        "{tls:?}"
    );
    assert_eq!(proxy.stats().refused, 2);

    // A good request, then garbage on the same connection.
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let get = format!("GET http://{host}/ HTTP/1.1\r\nHost: {host}\r\n\r\n");
    stream.write_all(get.as_bytes()).await.unwrap();
    let head = read_head(&mut stream).await.unwrap();
    assert_eq!(status_of(&head).unwrap(), 200, "{head}");
    let mut body = [0u8; 17];
    stream.read_exact(&mut body).await.unwrap();
    stream
        .write_all(b"GET\x01 / HTTP/1.1\r\n\r\n")
        .await
        .unwrap();
    let mut rest = Vec::new();
    tokio::time::timeout(TIMEOUT, stream.read_to_end(&mut rest))
        .await
        .unwrap()
        .unwrap();
    let rest = String::from_utf8_lossy(&rest);
    assert!(rest.starts_with("HTTP/1.1 400 "), "{rest:?}");
    assert_eq!(proxy.stats().refused, 3);

    let text = String::from_utf8(logs.lock().unwrap().clone()).unwrap();
    let refusals: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("egress refused"))
        .collect();
    assert_eq!(refusals.len(), 3, "{text}");
    for line in &refusals {
        assert!(
            line.contains(" INFO ") && line.contains("execution=\"exec_m1\""),
            "{text}"
        );
        assert!(line.contains("malformed proxy request"), "{text}");
    }
    assert!(refusals[0].contains("invalid HTTP version"), "{text}");
}

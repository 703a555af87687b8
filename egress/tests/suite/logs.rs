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

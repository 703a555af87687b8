//! The byte limit and the run-time swap of the allowlist.

use std::sync::atomic::Ordering;

use egress::{AddressPolicy, Allowlist, ProxyLimits, StaticResolver};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::common::*;

#[tokio::test]
async fn the_byte_limit_closes_a_tunnel_and_refuses_new_connections() {
    let server = tls_server().await;
    let target = format!("allowed.test:{}", server.addr.port());
    let resolver = StaticResolver::new().with("allowed.test", [LOCALHOST]);
    let limits = ProxyLimits {
        egress_bytes: Some(100_000),
        ..ProxyLimits::default()
    };
    let policy = AddressPolicy::new().exempt_for_tests(server.addr);
    let proxy = start_proxy(std::slice::from_ref(&target), policy, resolver, limits).await;
    let (status, stream) = connect(proxy.addr, &target, "").await.unwrap();
    assert_eq!(status, 200);
    let mut tls = tls_over(stream, &server.cert, "allowed.test")
        .await
        .unwrap();
    tls.write_all(b"big").await.unwrap();
    // The server sends 2 MiB; the tunnel closes after about 100 kB.
    let mut got = 0usize;
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        match tokio::time::timeout(TIMEOUT, tls.read(&mut buf))
            .await
            .unwrap()
        {
            Ok(0) | Err(_) => break,
            Ok(n) => got += n,
        }
    }
    assert!(
        got < 100_000,
        "read {got} bytes through a 100000-byte limit"
    );
    let stats = proxy.proxy.stats();
    assert!(
        stats.bytes_sent + stats.bytes_received <= 100_000,
        "{stats:?}"
    );
    let (status, _) = connect(proxy.addr, &target, "").await.unwrap();
    assert_eq!(status, 403);
    assert_eq!(server.accepted.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn the_byte_limit_cuts_a_plain_http_response() {
    let limits = ProxyLimits {
        egress_bytes: Some(50_000),
        ..ProxyLimits::default()
    };
    let (_origin, proxy, host) = origin_behind_proxy(limits).await;
    let request =
        format!("GET http://{host}/big HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n");
    let response = raw(proxy.addr, &request).await.unwrap();
    assert!(
        response.len() < 50_000,
        "{} bytes through a 50000-byte limit",
        response.len()
    );
    let stats = proxy.proxy.stats();
    assert!(stats.bytes_received <= 50_000, "{stats:?}");
}

#[tokio::test]
async fn a_swapped_allowlist_applies_to_new_connections() {
    let (origin, proxy, host) = origin_behind_proxy(ProxyLimits::default()).await;
    let other = format!("other.test:{}", origin.addr.port());
    let get =
        |h: &str| format!("GET http://{h}/ HTTP/1.1\r\nHost: {h}\r\nConnection: close\r\n\r\n");
    assert_eq!(
        status_of(&raw(proxy.addr, &get(&host)).await.unwrap()).unwrap(),
        200
    );
    assert_eq!(
        status_of(&raw(proxy.addr, &get(&other)).await.unwrap()).unwrap(),
        403
    );

    proxy
        .proxy
        .set_allowlist(Allowlist::parse(std::slice::from_ref(&other)).unwrap());
    assert_eq!(
        status_of(&raw(proxy.addr, &get(&host)).await.unwrap()).unwrap(),
        403
    );
    assert_eq!(
        status_of(&raw(proxy.addr, &get(&other)).await.unwrap()).unwrap(),
        200
    );

    proxy.proxy.set_allowlist(Allowlist::default());
    assert_eq!(
        status_of(&raw(proxy.addr, &get(&other)).await.unwrap()).unwrap(),
        403
    );
    assert_eq!(origin.seen.lock().unwrap().len(), 2);
}

#[tokio::test]
async fn allow_max_refuses_a_wider_requested_list() {
    let max = Allowlist::parse(&["*.pythonhosted.org:443", "pypi.org:443"]).unwrap();
    assert!(Allowlist::parse_within(&["pypi.org:443", "files.pythonhosted.org:443"], &max).is_ok());
    let err = Allowlist::parse_within(&["pypi.org:443", "pypi.org"], &max).unwrap_err();
    assert_eq!(err, egress::AllowlistError::NotCovered("pypi.org".into()));
    let err = Allowlist::parse_within(&["*.org:443"], &max).unwrap_err();
    assert_eq!(err, egress::AllowlistError::NotCovered("*.org:443".into()));
}

#[tokio::test]
async fn a_silent_client_and_a_silent_tunnel_are_closed() {
    let server = tls_server().await;
    let target = format!("allowed.test:{}", server.addr.port());
    let resolver = StaticResolver::new().with("allowed.test", [LOCALHOST]);
    let limits = ProxyLimits {
        hello_timeout: std::time::Duration::from_millis(200),
        ..ProxyLimits::default()
    };
    let policy = AddressPolicy::new().exempt_for_tests(server.addr);
    let proxy = start_proxy(std::slice::from_ref(&target), policy, resolver, limits).await;
    let mut silent = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
    silent.write_all(b"CONNECT allowed.test").await.unwrap();
    let mut rest = Vec::new();
    let read = tokio::time::timeout(TIMEOUT, silent.read_to_end(&mut rest)).await;
    assert!(read.is_ok(), "a half-sent request head was kept open");
    let (status, mut tunnel) = connect(proxy.addr, &target, "").await.unwrap();
    assert_eq!(status, 200);
    let read = tokio::time::timeout(TIMEOUT, tunnel.read_to_end(&mut rest)).await;
    assert!(read.is_ok(), "a tunnel without a ClientHello was kept open");
    assert_eq!(proxy.proxy.stats().bytes_sent, 0);
}

#[tokio::test]
async fn connections_beyond_max_connections_wait_until_one_ends() {
    let server = tls_server().await;
    let target = format!("allowed.test:{}", server.addr.port());
    let resolver = StaticResolver::new().with("allowed.test", [LOCALHOST]);
    let limits = ProxyLimits {
        max_connections: 2,
        ..ProxyLimits::default()
    };
    let policy = AddressPolicy::new().exempt_for_tests(server.addr);
    let proxy = start_proxy(std::slice::from_ref(&target), policy, resolver, limits).await;
    // Two open tunnels hold both slots.
    let (s1, t1) = connect(proxy.addr, &target, "").await.unwrap();
    let (s2, _t2) = connect(proxy.addr, &target, "").await.unwrap();
    assert_eq!((s1, s2), (200, 200));
    // A third connection is not served while they are open...
    let third = tokio::spawn({
        let target = target.clone();
        async move { connect(proxy.addr, &target, "").await.map(|(s, _)| s) }
    });
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    assert!(
        !third.is_finished(),
        "a third connection was served beside two open tunnels"
    );
    // ... and is once one of them closes.
    drop(t1);
    let status = tokio::time::timeout(TIMEOUT, third)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(status, 200);
}

/// Reservations as a ledger records them.
#[derive(Default)]
struct Recorded(std::sync::Mutex<Vec<u64>>);

impl egress::Reserve for Recorded {
    fn reserve(&self, total: u64) -> std::io::Result<()> {
        self.0.lock().unwrap().push(total);
        Ok(())
    }
}

/// A plain proxy like [`origin_behind_proxy`]'s (allowing `host`, permitting `origin`), with a ledger.
async fn ledgered(
    origin: &Origin,
    host: &str,
    limits: ProxyLimits,
    ledger: egress::Ledger,
) -> TestProxy {
    let listener = tokio::net::TcpListener::bind((LOCALHOST, 0)).await.unwrap();
    let addr = listener.local_addr().unwrap();
    let proxy = egress::Proxy::with_ledger(
        Allowlist::parse(&[host]).unwrap(),
        AddressPolicy::new().exempt_for_tests(origin.addr),
        std::sync::Arc::new(StaticResolver::new().with("origin.test", [LOCALHOST])),
        limits,
        ledger,
    );
    let serving = proxy.clone();
    tokio::spawn(async move { serving.serve(listener).await });
    TestProxy { proxy, addr }
}

/// With a ledger, bytes are reserved (recorded) a chunk at a time before they cross, never fewer than crossed, and
/// a proxy made again from what was reserved (a daemon's restart) counts it as spent: its limit is what is left.
#[tokio::test]
async fn a_ledger_reserves_before_bytes_cross_and_carries_the_limit_over() {
    let (origin, _plain, host) = origin_behind_proxy(ProxyLimits::default()).await;
    let limits = ProxyLimits {
        egress_bytes: Some(50_000),
        ..ProxyLimits::default()
    };
    let book = std::sync::Arc::new(Recorded::default());
    let ledger = |spent| egress::Ledger {
        spent,
        chunk: 4096,
        reserve: book.clone(),
    };
    let get = |path: &str| {
        format!("GET http://{host}{path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n")
    };
    let first = ledgered(&origin, &host, limits.clone(), ledger(0)).await;
    let small = raw(first.addr, &get("/")).await.unwrap();
    assert_eq!(status_of(&small).unwrap(), 200);
    let stats = first.proxy.stats();
    let moved = stats.bytes_sent + stats.bytes_received;
    let reserved = *book.0.lock().unwrap().last().expect("a reservation");
    assert!(
        moved > 0 && moved <= reserved && reserved <= moved + 4096,
        "moved {moved}, reserved {reserved}"
    );
    // Cut off there (the daemon killed), the next proxy starts from the reservation: of 50 000 bytes, what is left.
    let second = ledgered(&origin, &host, limits.clone(), ledger(reserved)).await;
    let big = raw(second.addr, &get("/big")).await.unwrap();
    let left = 50_000 - reserved as usize;
    assert!(
        big.len() <= left,
        "{} bytes through what was left, {left}",
        big.len()
    );
    let reservations = book.0.lock().unwrap().clone();
    assert!(
        reservations.windows(2).all(|w| w[0] < w[1]) && reservations.iter().all(|&r| r <= 50_000),
        "{reservations:?}"
    );
    // Used up: a third proxy from the last reservation refuses at once.
    let last = *reservations.last().unwrap();
    assert_eq!(last, 50_000, "the reservations end at the limit");
    let third = ledgered(&origin, &host, limits, ledger(last)).await;
    let refused = raw(third.addr, &get("/")).await.unwrap();
    assert_eq!(status_of(&refused).unwrap(), 403, "{refused:?}");
}

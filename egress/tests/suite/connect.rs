//! CONNECT: tunnels to allowed names, and every refusal (names, IP literals, ports, rebinding, SNI, bodies).

use std::sync::atomic::Ordering;
use std::time::Duration;

use egress::{AddressPolicy, ProxyLimits, StaticResolver};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::common::*;

async fn read_some<R: tokio::io::AsyncRead + Unpin>(stream: &mut R) -> Vec<u8> {
    let mut buf = vec![0u8; 1024];
    let n = tokio::time::timeout(TIMEOUT, stream.read(&mut buf))
        .await
        .unwrap()
        .unwrap();
    buf.truncate(n);
    buf
}

/// A CONNECT to the server's `allowed.test`, answered 200.
async fn open_tunnel(server: &TlsServer, proxy: &TestProxy) -> tokio::net::TcpStream {
    let target = format!("allowed.test:{}", server.addr.port());
    let (status, stream) = connect(proxy.addr, &target, "").await.unwrap();
    assert_eq!(status, 200);
    stream
}

/// The TLS server, and a proxy allowing `allowed.test` on its port, resolving it to 127.0.0.1, permitting exactly
/// the server's address.
async fn setup() -> (TlsServer, TestProxy) {
    let server = tls_server().await;
    let allow = vec![format!("allowed.test:{}", server.addr.port())];
    let resolver = StaticResolver::new()
        .with("allowed.test", [LOCALHOST])
        .with("denied.test", [LOCALHOST]);
    let policy = AddressPolicy::new().exempt_for_tests(server.addr);
    let proxy = start_proxy(&allow, policy, resolver, ProxyLimits::default()).await;
    (server, proxy)
}

#[tokio::test]
async fn an_allowed_connect_tunnels_tls_both_ways() {
    let (server, proxy) = setup().await;
    let stream = open_tunnel(&server, &proxy).await;
    let mut tls = tls_over(stream, &server.cert, "allowed.test")
        .await
        .unwrap();
    assert_eq!(read_some(&mut tls).await, b"hello\n");
    tls.write_all(b"ping").await.unwrap();
    assert_eq!(read_some(&mut tls).await, b"echo:ping");
    let stats = proxy.proxy.stats();
    assert_eq!(
        (stats.connections, stats.upstream_connections, stats.refused),
        (1, 1, 0)
    );
    assert!(
        stats.bytes_sent > 4 && stats.bytes_received > 15,
        "{stats:?}"
    );
}

#[tokio::test]
async fn a_trailing_dot_and_upper_case_name_is_the_same_name() {
    let (server, proxy) = setup().await;
    let (status, stream) = connect(
        proxy.addr,
        &format!("ALLOWED.test.:{}", server.addr.port()),
        "",
    )
    .await
    .unwrap();
    assert_eq!(status, 200);
    let mut tls = tls_over(stream, &server.cert, "allowed.test")
        .await
        .unwrap();
    assert_eq!(read_some(&mut tls).await, b"hello\n");
}

#[tokio::test]
async fn a_denied_name_is_refused_with_403() {
    let (server, proxy) = setup().await;
    let (status, _) = connect(
        proxy.addr,
        &format!("denied.test:{}", server.addr.port()),
        "",
    )
    .await
    .unwrap();
    assert_eq!(status, 403);
    assert_eq!(server.accepted.load(Ordering::SeqCst), 0);
    assert_eq!(proxy.proxy.stats().refused, 1);
}

#[tokio::test]
async fn connect_to_an_ip_literal_is_refused() {
    let (server, proxy) = setup().await;
    let port = server.addr.port();
    for target in [
        format!("127.0.0.1:{port}"),
        format!("[::1]:{port}"),
        format!("[::ffff:127.0.0.1]:{port}"),
        format!("2130706433:{port}"),
        format!("0x7f.1:{port}"),
    ] {
        let (status, _) = connect(proxy.addr, &target, "").await.unwrap();
        assert!(status == 403 || status == 400, "{target}: {status}");
    }
    assert_eq!(server.accepted.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn another_port_is_refused() {
    let (server, proxy) = setup().await;
    let other = tls_server().await;
    let (status, _) = connect(
        proxy.addr,
        &format!("allowed.test:{}", other.addr.port()),
        "",
    )
    .await
    .unwrap();
    assert_eq!(status, 403);
    let (status, _) = connect(proxy.addr, "allowed.test:443", "").await.unwrap();
    assert_eq!(status, 403);
    assert_eq!(
        server.accepted.load(Ordering::SeqCst) + other.accepted.load(Ordering::SeqCst),
        0
    );
}

#[tokio::test]
async fn a_name_resolving_to_refused_addresses_is_refused_by_default() {
    let server = tls_server().await;
    let port = server.addr.port();
    let allow = vec![
        format!("allowed.test:{port}"),
        format!("private.test:{port}"),
        format!("metadata.test:{port}"),
    ];
    let resolver = StaticResolver::new()
        .with("allowed.test", [LOCALHOST])
        .with(
            "private.test",
            [
                "10.0.0.1".parse().unwrap(),
                "::ffff:192.168.1.1".parse().unwrap(),
            ],
        )
        .with(
            "metadata.test",
            [
                "169.254.169.254".parse().unwrap(),
                "fe80::1".parse().unwrap(),
            ],
        );
    // The production default: no exemption.
    let proxy = start_proxy(
        &allow,
        AddressPolicy::new(),
        resolver,
        ProxyLimits::default(),
    )
    .await;
    for (name, reason) in [
        ("allowed.test", "loopback"),
        ("private.test", "private"),
        ("metadata.test", "link-local"),
    ] {
        let mut stream = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
        let target = format!("{name}:{port}");
        stream
            .write_all(
                format!("CONNECT {target} HTTP/1.1\r\nHost: {target}\r\nConnection: close\r\n\r\n")
                    .as_bytes(),
            )
            .await
            .unwrap();
        let mut response = String::new();
        stream.read_to_string(&mut response).await.unwrap();
        assert_eq!(status_of(&response).unwrap(), 403, "{name}");
        assert!(response.contains(reason), "{name}: {response}");
    }
    assert_eq!(server.accepted.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn a_test_exemption_permits_only_its_own_server() {
    let (server, _) = setup().await;
    let neighbour = tls_server().await;
    let allow = vec![format!("allowed.test:{}", neighbour.addr.port())];
    let resolver = StaticResolver::new().with("allowed.test", [LOCALHOST]);
    let policy = AddressPolicy::new().exempt_for_tests(server.addr);
    let proxy = start_proxy(&allow, policy, resolver, ProxyLimits::default()).await;
    let (status, _) = connect(
        proxy.addr,
        &format!("allowed.test:{}", neighbour.addr.port()),
        "",
    )
    .await
    .unwrap();
    assert_eq!(status, 403);
    assert_eq!(neighbour.accepted.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn an_sni_other_than_the_connect_host_closes_the_tunnel() {
    let (server, proxy) = setup().await;
    let stream = open_tunnel(&server, &proxy).await;
    // other.test is on the server's certificate: only the proxy can stop this handshake.
    assert!(tls_over(stream, &server.cert, "other.test").await.is_err());
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(server.handshakes.load(Ordering::SeqCst), 0);
    assert_eq!(proxy.proxy.stats().bytes_sent, 0);
    assert_eq!(proxy.proxy.stats().refused, 1);
}

#[tokio::test]
async fn a_tunnel_with_neither_tls_nor_http_is_closed() {
    let (server, proxy) = setup().await;
    let mut stream = open_tunnel(&server, &proxy).await;
    stream
        .write_all(b"SSH-2.0-OpenSSH_9.6\r\n\r\n")
        .await
        .unwrap();
    let mut rest = Vec::new();
    let read = tokio::time::timeout(TIMEOUT, stream.read_to_end(&mut rest))
        .await
        .unwrap();
    // hyper may answer the unparsable head with a bare 400 before closing; nothing comes from the server.
    assert!(
        read.is_err() || rest.is_empty() || rest.starts_with(b"HTTP/1.1 400"),
        "{rest:?}"
    );
    let stats = proxy.proxy.stats();
    assert_eq!((stats.bytes_sent, stats.refused), (0, 1), "{stats:?}");
}

#[tokio::test]
async fn a_connect_with_a_body_is_refused() {
    let (server, proxy) = setup().await;
    let target = format!("allowed.test:{}", server.addr.port());
    for extra in ["Content-Length: 5\r\n", "Transfer-Encoding: chunked\r\n"] {
        let (status, _) = connect(proxy.addr, &target, extra).await.unwrap();
        assert_eq!(status, 400, "{extra}");
    }
    assert_eq!(server.accepted.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn a_client_hello_without_sni_closes_the_tunnel() {
    let (server, proxy) = setup().await;
    let stream = open_tunnel(&server, &proxy).await;
    assert!(tls_over_with(stream, &server.cert, "allowed.test", false)
        .await
        .is_err());
    assert_eq!(server.handshakes.load(Ordering::SeqCst), 0);
    assert_eq!(proxy.proxy.stats().bytes_sent, 0);
}

#[tokio::test]
async fn the_proxy_serves_a_unix_listener() {
    let server = tls_server().await;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("egress.sock");
    let listener = tokio::net::UnixListener::bind(&path).unwrap();
    let target = format!("allowed.test:{}", server.addr.port());
    let proxy = egress::Proxy::new(
        egress::Allowlist::parse(std::slice::from_ref(&target)).unwrap(),
        AddressPolicy::new().exempt_for_tests(server.addr),
        std::sync::Arc::new(StaticResolver::new().with("allowed.test", [LOCALHOST])),
        ProxyLimits::default(),
    );
    let serving = proxy.clone();
    tokio::spawn(async move { serving.serve(listener).await });
    let mut stream = tokio::net::UnixStream::connect(&path).await.unwrap();
    stream
        .write_all(format!("CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n").as_bytes())
        .await
        .unwrap();
    assert_eq!(
        status_of(&read_head(&mut stream).await.unwrap()).unwrap(),
        200
    );
    let mut tls = tls_over(stream, &server.cert, "allowed.test")
        .await
        .unwrap();
    assert_eq!(read_some(&mut tls).await, b"hello\n");
    tls.write_all(b"over unix").await.unwrap();
    assert_eq!(read_some(&mut tls).await, b"echo:over unix");
    assert_eq!(proxy.stats().connections, 1);
}

/// The case: a service of the host listening on every address (here on a port of its own), and an allowed
/// name resolving to one of the host's interface addresses. The address is one the ranges permit (with
/// `allow_private`, a private one), so only its being the host's own refuses it.
#[tokio::test]
async fn a_name_resolving_to_the_hosts_own_address_is_refused() {
    let host = egress::HostAddresses::read().unwrap();
    let Some(ip) = host
        .iter()
        .find(|&ip| egress::classify(ip).is_none_or(|r| r == egress::AddressRefusal::Private))
    else {
        eprintln!("SKIPPED: this host has no interface address outside the special ranges but loopback's: {host:?}");
        return;
    };
    let any: std::net::IpAddr = match ip {
        std::net::IpAddr::V4(_) => std::net::Ipv4Addr::UNSPECIFIED.into(),
        std::net::IpAddr::V6(_) => std::net::Ipv6Addr::UNSPECIFIED.into(),
    };
    let service = tokio::net::TcpListener::bind((any, 0)).await.unwrap();
    let port = service.local_addr().unwrap().port();
    let target = format!("self.test:{port}");
    let resolver = StaticResolver::new().with("self.test", [ip]);
    let policy = AddressPolicy::new().allow_private(true);
    let proxy = start_proxy(
        std::slice::from_ref(&target),
        policy,
        resolver,
        ProxyLimits::default(),
    )
    .await;
    let (status, mut stream) = connect(proxy.addr, &target, "").await.unwrap();
    assert_eq!(status, 403, "{ip}");
    let body = String::from_utf8(read_some(&mut stream).await).unwrap();
    assert!(
        body.contains("self.test resolves only to refused addresses (the host's own address)"),
        "{body}"
    );
    // Nothing reached the host's service.
    let accepted = tokio::time::timeout(Duration::from_millis(100), service.accept()).await;
    assert!(accepted.is_err(), "the host's service was reached");
}

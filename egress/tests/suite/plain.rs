//! Plain HTTP: absolute-form requests forwarded once; Host mismatches, origin-form requests and ambiguous framing
//! refused. Plain HTTP inside a CONNECT tunnel (as undici sends it): served request by request, each checked.

use std::sync::atomic::Ordering;

use egress::ProxyLimits;

use super::common::*;

async fn setup() -> (Origin, TestProxy, String) {
    origin_behind_proxy(ProxyLimits::default()).await
}

#[tokio::test]
async fn an_allowed_host_is_forwarded_in_origin_form() {
    let (origin, proxy, host) = setup().await;
    let request = format!(
        "POST http://{host}/path?q=1 HTTP/1.1\r\nHost: {host}\r\nProxy-Authorization: Basic eDp5\r\nContent-Length: 4\r\nConnection: close\r\n\r\nbody"
    );
    let response = raw(proxy.addr, &request).await.unwrap();
    assert_eq!(status_of(&response).unwrap(), 200, "{response}");
    assert!(response.ends_with("hello from origin"), "{response}");
    let seen = origin.seen.lock().unwrap().clone();
    assert_eq!(seen.len(), 1);
    assert_eq!(
        (seen[0].method.as_str(), seen[0].uri.as_str()),
        ("POST", "/path?q=1")
    );
    assert_eq!(seen[0].host.as_deref(), Some(host.as_str()));
    assert_eq!(seen[0].body, b"body");
    assert!(!seen[0].proxy_authorization);
    assert_eq!(proxy.proxy.stats().upstream_connections, 1);
}

#[tokio::test]
async fn a_redirect_is_relayed_not_followed() {
    let (origin, proxy, host) = setup().await;
    let request =
        format!("GET http://{host}/redirect HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n");
    let response = raw(proxy.addr, &request).await.unwrap();
    assert_eq!(status_of(&response).unwrap(), 302);
    assert!(response
        .to_ascii_lowercase()
        .contains("location: http://denied.test/"));
    assert_eq!(origin.seen.lock().unwrap().len(), 1);
}

#[tokio::test]
async fn a_host_header_mismatch_is_refused() {
    let (origin, proxy, host) = setup().await;
    let port = origin.addr.port();
    for header in [
        "denied.test".to_string(),
        format!("denied.test:{port}"),
        "origin.test:1".to_string(),
    ] {
        let request =
            format!("GET http://{host}/ HTTP/1.1\r\nHost: {header}\r\nConnection: close\r\n\r\n");
        let response = raw(proxy.addr, &request).await.unwrap();
        assert_eq!(status_of(&response).unwrap(), 403, "{header}: {response}");
    }
    assert_eq!(origin.accepted.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn a_denied_host_and_origin_form_requests_are_refused() {
    let (origin, proxy, _) = setup().await;
    let port = origin.addr.port();
    let cases = [
        (format!("GET http://denied.test:{port}/ HTTP/1.1\r\nHost: denied.test:{port}\r\nConnection: close\r\n\r\n"), 403),
        (format!("GET http://127.0.0.1:{port}/ HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n\r\n"), 403),
        (format!("GET / HTTP/1.1\r\nHost: origin.test:{port}\r\nConnection: close\r\n\r\n"), 400),
        (format!("GET https://origin.test:{port}/ HTTP/1.1\r\nHost: origin.test:{port}\r\nConnection: close\r\n\r\n"), 400),
    ];
    for (request, want) in cases {
        let response = raw(proxy.addr, &request).await.unwrap();
        assert_eq!(status_of(&response).unwrap(), want, "{request}");
    }
    assert_eq!(origin.accepted.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn content_length_with_transfer_encoding_is_not_smuggled() {
    let (origin, proxy, host) = setup().await;
    // A front end reading Content-Length would pass the second request through inside the body; one reading
    // Transfer-Encoding would send it to the origin as a request of its own. hyper reads the chunked body (empty)
    // and drops Content-Length.
    let smuggled =
        "GET http://denied.test/ HTTP/1.1\r\nHost: denied.test\r\nConnection: close\r\n\r\n";
    let request = format!(
        "POST http://{host}/ HTTP/1.1\r\nHost: {host}\r\nContent-Length: {}\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n{smuggled}",
        5 + smuggled.len()
    );
    let response = raw(proxy.addr, &request).await.unwrap();
    let statuses: Vec<u16> = response
        .match_indices("HTTP/1.1 ")
        .map(|(i, _)| status_of(&response[i..]).unwrap())
        .collect();
    // hyper answers the chunked (empty) POST and closes the connection, as RFC 9112 6.3 asks of a request framed
    // both ways: the bytes after it are never read as a request.
    assert_eq!(statuses, [200], "{response}");
    let seen = origin.seen.lock().unwrap().clone();
    assert_eq!(seen.len(), 1, "{seen:?}");
    assert_eq!(
        (seen[0].method.as_str(), seen[0].host.as_deref()),
        ("POST", Some(host.as_str()))
    );
    assert!(seen[0].body.is_empty(), "{seen:?}");
    assert_eq!(origin.accepted.load(Ordering::SeqCst), 1);
    assert_eq!(proxy.proxy.stats().refused, 0);
}

#[tokio::test]
async fn two_content_lengths_are_refused() {
    let (origin, proxy, host) = setup().await;
    let request = format!(
        "POST http://{host}/ HTTP/1.1\r\nHost: {host}\r\nContent-Length: 4\r\nContent-Length: 40\r\nConnection: close\r\n\r\nbody"
    );
    let response = raw(proxy.addr, &request).await.unwrap();
    assert_eq!(status_of(&response).unwrap(), 400, "{response}");
    assert_eq!(origin.accepted.load(Ordering::SeqCst), 0);
}

/// Reads one response with a Content-Length body: its status and body.
async fn read_response(stream: &mut tokio::net::TcpStream) -> (u16, String) {
    use tokio::io::AsyncReadExt;
    let head = read_head(stream).await.unwrap();
    let length: usize = head
        .lines()
        .find_map(|l| {
            l.to_ascii_lowercase()
                .strip_prefix("content-length:")
                .map(|v| v.trim().parse().unwrap())
        })
        .unwrap_or(0);
    let mut body = vec![0u8; length];
    tokio::time::timeout(TIMEOUT, stream.read_exact(&mut body))
        .await
        .unwrap()
        .unwrap();
    (status_of(&head).unwrap(), String::from_utf8(body).unwrap())
}

#[tokio::test]
async fn plain_http_inside_a_tunnel_is_served_request_by_request() {
    use tokio::io::AsyncWriteExt;
    let (origin, proxy, host) = setup().await;
    let (status, mut tunnel) = connect(proxy.addr, &host, "").await.unwrap();
    assert_eq!(status, 200);
    for path in ["/one", "/two"] {
        let request =
            format!("GET {path} HTTP/1.1\r\nHost: {host}\r\nProxy-Connection: keep-alive\r\n\r\n");
        tunnel.write_all(request.as_bytes()).await.unwrap();
        assert_eq!(
            read_response(&mut tunnel).await,
            (200, "hello from origin".to_string())
        );
    }
    let seen = origin.seen.lock().unwrap().clone();
    let uris: Vec<_> = seen
        .iter()
        .map(|s| (s.uri.as_str(), s.host.as_deref()))
        .collect();
    assert_eq!(
        uris,
        [("/one", Some(host.as_str())), ("/two", Some(host.as_str()))]
    );
    let stats = proxy.proxy.stats();
    assert_eq!(
        (stats.upstream_connections, stats.refused),
        (1, 0),
        "{stats:?}"
    );
}

#[tokio::test]
async fn inside_a_tunnel_another_host_or_form_is_refused_and_reaches_nothing() {
    use tokio::io::AsyncWriteExt;
    let (origin, proxy, host) = setup().await;
    let port = origin.addr.port();
    let cases = [
        (
            format!("GET / HTTP/1.1\r\nHost: denied.test:{port}\r\n\r\n"),
            403,
        ),
        (
            "GET / HTTP/1.1\r\nHost: origin.test:1\r\n\r\n".to_string(),
            403,
        ),
        (
            format!("GET http://denied.test:{port}/ HTTP/1.1\r\nHost: denied.test:{port}\r\n\r\n"),
            400,
        ),
        ("GET / HTTP/1.0\r\n\r\n".to_string(), 400),
    ];
    for (request, expected) in &cases {
        let (status, mut tunnel) = connect(proxy.addr, &host, "").await.unwrap();
        assert_eq!(status, 200);
        tunnel.write_all(request.as_bytes()).await.unwrap();
        let head = read_head(&mut tunnel).await.unwrap();
        assert_eq!(status_of(&head).unwrap(), *expected, "{request:?}: {head}");
    }
    assert!(origin.seen.lock().unwrap().is_empty());
    assert!(proxy.proxy.stats().refused >= 2);

    // A second request smuggled behind Content-Length and Transfer-Encoding: hyper reads the chunked body, drops
    // the Content-Length and closes after the answer, so the smuggled request is never read.
    let (_, mut tunnel) = connect(proxy.addr, &host, "").await.unwrap();
    let smuggle = format!(
        "POST / HTTP/1.1\r\nHost: {host}\r\nContent-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n\
         0\r\n\r\nGET / HTTP/1.1\r\nHost: denied.test:{port}\r\n\r\n"
    );
    tunnel.write_all(smuggle.as_bytes()).await.unwrap();
    let mut answers = Vec::new();
    let read = tokio::io::AsyncReadExt::read_to_end(&mut tunnel, &mut answers);
    let _ = tokio::time::timeout(TIMEOUT, read).await;
    let answers = String::from_utf8_lossy(&answers);
    assert!(answers.matches("HTTP/1.1").count() <= 1, "{answers}");
    let seen = origin.seen.lock().unwrap().clone();
    assert!(
        seen.iter()
            .all(|s| s.host.as_deref() == Some(host.as_str())),
        "{seen:?}"
    );
}

#[tokio::test]
async fn a_tunnel_stops_serving_plain_http_once_its_host_leaves_the_list() {
    use tokio::io::AsyncWriteExt;
    let (origin, proxy, host) = setup().await;
    let (status, mut tunnel) = connect(proxy.addr, &host, "").await.unwrap();
    assert_eq!(status, 200);
    let request = format!("GET / HTTP/1.1\r\nHost: {host}\r\n\r\n");
    tunnel.write_all(request.as_bytes()).await.unwrap();
    assert_eq!(read_response(&mut tunnel).await.0, 200);
    proxy
        .proxy
        .set_allowlist(egress::Allowlist::parse(&["other.test:80"]).unwrap());
    tunnel.write_all(request.as_bytes()).await.unwrap();
    assert_eq!(read_response(&mut tunnel).await.0, 403);
    assert_eq!(origin.seen.lock().unwrap().len(), 1);
}

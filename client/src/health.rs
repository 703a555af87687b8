//! `GET /healthz` of the daemon behind a WebSocket endpoint: `ws://host:port/ws` → `http://host:port/healthz`
//! (`wss://` → `https://`). One request on one connection (`Connection: close`, body capped), spoken by hyper's
//! HTTP/1.1 client over a TCP or rustls stream.

use std::sync::Arc;
use std::time::Duration;

use http_body_util::{BodyExt, Empty, Limited};
use hyper::body::Bytes;
use hyper::client::conn::http1;
use hyper_util::rt::TokioIo;
use rustls::pki_types::ServerName;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;
use tokio_tungstenite::tungstenite::http::Uri;

use crate::error::ClientError;
use crate::tls;

/// The largest `/healthz` response body read.
const MAX_RESPONSE_BYTES: usize = 1 << 20;

/// The answer of `GET /healthz`.
#[derive(Debug, Clone, PartialEq)]
pub struct Health {
    /// The HTTP status (sandboxd: 200 when healthy, 503 when its helper is gone).
    pub status: u16,
    /// The JSON body (version, uptime, load, languages, isolation), or `Null` when it is not JSON.
    pub body: serde_json::Value,
}

impl Health {
    /// 200 and `"status": "ok"`.
    pub fn is_healthy(&self) -> bool {
        self.status == 200 && self.body["status"] == "ok"
    }
}

/// The `/healthz` URL of a WebSocket endpoint.
pub fn healthz_url(ws_url: &str) -> Result<String, ClientError> {
    let target = Target::parse(ws_url)?;
    Ok(format!(
        "{}://{}:{}/healthz",
        if target.tls { "https" } else { "http" },
        target.host_for_url(),
        target.port
    ))
}

/// `GET /healthz` of the daemon serving `ws_url`, within `timeout` (connect, TLS, request and body together).
/// `tls_config` is used for `wss://` endpoints (default: webpki roots). Every failure, the timeout included, is
/// [`ClientError::Http`] naming the `/healthz` URL; an answer with any status is a [`Health`].
pub async fn health(
    ws_url: &str,
    tls_config: Option<Arc<rustls::ClientConfig>>,
    timeout: Duration,
) -> Result<Health, ClientError> {
    let target = Target::parse(ws_url)?;
    let url = healthz_url(ws_url)?;
    let (status, body) = get(
        &target,
        "/healthz",
        None,
        tls_config,
        timeout,
        MAX_RESPONSE_BYTES,
    )
    .await
    .map_err(|reason| ClientError::Http { url, reason })?;
    let body = serde_json::from_slice(&body).unwrap_or(serde_json::Value::Null);
    Ok(Health { status, body })
}

/// One `GET path_and_query` of `target` within `timeout` (connect, TLS, request and body together), with an
/// optional bearer token; `tls_config` is used for TLS targets (default: webpki roots). The status and body (at
/// most `max_bytes`) of any answer; a failure is a reason.
pub(crate) async fn get(
    target: &Target,
    path_and_query: &str,
    bearer: Option<&str>,
    tls_config: Option<Arc<rustls::ClientConfig>>,
    timeout: Duration,
    max_bytes: usize,
) -> Result<(u16, Bytes), String> {
    let host = target.host_header();
    let exchange = async {
        let tcp = TcpStream::connect((target.host.as_str(), target.port))
            .await
            .map_err(|e| format!("connect: {e}"))?;
        if target.tls {
            let config = match tls_config {
                Some(c) => c,
                None => tls::default_config().map_err(|e| e.to_string())?,
            };
            let name = ServerName::try_from(target.host.clone())
                .map_err(|e| format!("server name: {e}"))?;
            let stream = tokio_rustls::TlsConnector::from(config)
                .connect(name, tcp)
                .await
                .map_err(|e| format!("TLS: {e}"))?;
            get_once(stream, path_and_query, &host, bearer, max_bytes).await
        } else {
            get_once(tcp, path_and_query, &host, bearer, max_bytes).await
        }
    };
    tokio::time::timeout(timeout, exchange)
        .await
        .map_err(|_| format!("no answer within {timeout:?}"))?
}

/// One GET over `stream`: hyper drives the connection in this task (nothing outlives the call), reads the head,
/// and decodes the body whatever its framing (content-length, chunked or to close) up to `max_bytes`.
async fn get_once<S>(
    stream: S,
    path_and_query: &str,
    host: &str,
    bearer: Option<&str>,
    max_bytes: usize,
) -> Result<(u16, Bytes), String>
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let (mut sender, connection) = http1::handshake::<_, Empty<Bytes>>(TokioIo::new(stream))
        .await
        .map_err(|e| format!("HTTP handshake: {e}"))?;
    let mut request = hyper::Request::get(path_and_query)
        .header(hyper::header::HOST, host)
        .header(hyper::header::ACCEPT, "application/json")
        .header(hyper::header::CONNECTION, "close");
    if let Some(token) = bearer {
        request = request.header(hyper::header::AUTHORIZATION, format!("Bearer {token}"));
    }
    let request = request
        .body(Empty::new())
        .map_err(|e| format!("request: {e}"))?;
    let exchange = async move {
        let response = sender
            .send_request(request)
            .await
            .map_err(|e| format!("send: {e}"))?;
        let status = response.status().as_u16();
        let body = Limited::new(response.into_body(), max_bytes)
            .collect()
            .await
            .map_err(|e| format!("read: {e}"))?
            .to_bytes();
        Ok((status, body))
    };
    // The connection ends once the response is read (`Connection: close`); its own error, if any, is the one the
    // exchange already reports.
    let (answer, _) = tokio::join!(exchange, connection);
    answer
}

/// Host, port and scheme of a `ws://`, `wss://`, `http://` or `https://` URL.
pub(crate) struct Target {
    pub(crate) tls: bool,
    host: String,
    port: u16,
}

impl Target {
    /// A `ws://` or `wss://` URL.
    pub(crate) fn parse(ws_url: &str) -> Result<Target, ClientError> {
        Target::parse_with(ws_url, ["ws", "wss"])
    }

    /// An `http://` or `https://` URL (its path is ignored).
    pub(crate) fn parse_http(url: &str) -> Result<Target, ClientError> {
        Target::parse_with(url, ["http", "https"])
    }

    /// A URL whose scheme is `schemes[0]` (plain) or `schemes[1]` (TLS).
    fn parse_with(url: &str, schemes: [&str; 2]) -> Result<Target, ClientError> {
        let bad = |why: &str| ClientError::Config(format!("URL {url:?}: {why}"));
        let uri: Uri = url.parse().map_err(|_| bad("not a URL"))?;
        let tls = match uri.scheme_str() {
            Some(s) if s.eq_ignore_ascii_case(schemes[0]) => false,
            Some(s) if s.eq_ignore_ascii_case(schemes[1]) => true,
            _ => {
                return Err(bad(&format!(
                    "the scheme must be {} or {}",
                    schemes[0], schemes[1]
                )))
            }
        };
        let host = uri.host().ok_or_else(|| bad("no host"))?;
        let host = host
            .trim_start_matches('[')
            .trim_end_matches(']')
            .to_owned();
        let port = uri.port_u16().unwrap_or(if tls { 443 } else { 80 });
        Ok(Target { tls, host, port })
    }

    fn host_for_url(&self) -> String {
        if self.host.contains(':') {
            format!("[{}]", self.host)
        } else {
            self.host.clone()
        }
    }

    fn host_header(&self) -> String {
        format!("{}:{}", self.host_for_url(), self.port)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls() {
        assert_eq!(
            healthz_url("ws://127.0.0.1:7070/ws").unwrap(),
            "http://127.0.0.1:7070/healthz"
        );
        assert_eq!(
            healthz_url("wss://sandbox.example.com/ws").unwrap(),
            "https://sandbox.example.com:443/healthz"
        );
        assert_eq!(
            healthz_url("ws://[::1]:9/ws").unwrap(),
            "http://[::1]:9/healthz"
        );
        assert!(healthz_url("http://x/").is_err());
    }

    /// Serves `raw` as the answer to one request on a loopback port and returns what [`health`] made of it.
    async fn answer(raw: &'static [u8]) -> Result<Health, ClientError> {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let server = tokio::spawn(async move {
            let (mut tcp, _) = listener.accept().await.unwrap();
            let mut head = Vec::new();
            let mut byte = [0u8; 1];
            while !head.ends_with(b"\r\n\r\n") {
                if tcp.read(&mut byte).await.unwrap() == 0 {
                    break;
                }
                head.push(byte[0]);
            }
            tcp.write_all(raw).await.unwrap();
            tcp.shutdown().await.unwrap();
            String::from_utf8(head).unwrap()
        });
        let got = health(
            &format!("ws://127.0.0.1:{port}/ws"),
            None,
            Duration::from_secs(5),
        )
        .await;
        let request = server.await.unwrap();
        assert!(
            request.starts_with("GET /healthz HTTP/1.1\r\n"),
            "{request}"
        );
        assert!(
            request.contains(&format!("host: 127.0.0.1:{port}\r\n")),
            "{request}"
        );
        got
    }

    #[tokio::test]
    async fn responses() {
        let r = answer(
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 15\r\n\r\n{\"status\":\"ok\"}",
        )
        .await
        .unwrap();
        assert!(r.is_healthy());
        let r = answer(
            b"HTTP/1.1 503 Service Unavailable\r\ntransfer-encoding: chunked\r\n\r\n7\r\n{\"statu\r\n\
              f\r\ns\":\"unhealthy\"}\r\n0\r\n\r\n",
        )
        .await
        .unwrap();
        assert_eq!(r.status, 503);
        assert_eq!(r.body["status"], "unhealthy");
        assert!(!r.is_healthy());
        let r = answer(b"HTTP/1.1 200 OK\r\n\r\nnot json").await.unwrap();
        assert_eq!(r.body, serde_json::Value::Null);
        assert!(!r.is_healthy());
        assert!(matches!(
            answer(b"garbage").await,
            Err(ClientError::Http { .. })
        ));
    }

    #[tokio::test]
    async fn no_answer_is_a_timeout() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let err = health(
            &format!("ws://127.0.0.1:{port}/ws"),
            None,
            Duration::from_millis(200),
        )
        .await
        .unwrap_err();
        let ClientError::Http { url, reason } = err else {
            panic!("not an HTTP error: {err:?}");
        };
        assert_eq!(url, format!("http://127.0.0.1:{port}/healthz"));
        assert!(reason.starts_with("no answer within"), "{reason}");
        drop(listener);
    }
}

//! `GET /healthz` of the daemon behind a WebSocket endpoint: `ws://host:port/ws` → `http://host:port/healthz`
//! (`wss://` → `https://`). A minimal HTTP/1.1 client (one request, `Connection: close`, body capped), so the
//! crate needs no HTTP stack for one call.

use std::sync::Arc;
use std::time::Duration;

use rustls::pki_types::ServerName;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_tungstenite::tungstenite::http::Uri;

use crate::error::ClientError;
use crate::tls;

/// The largest `/healthz` response read.
const MAX_RESPONSE_BYTES: u64 = 1 << 20;

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

/// `GET /healthz` of the daemon serving `ws_url`, within `timeout`. `tls` is used for `wss://` endpoints
/// (default: webpki roots).
pub async fn health(
    ws_url: &str,
    tls_config: Option<Arc<rustls::ClientConfig>>,
    timeout: Duration,
) -> Result<Health, ClientError> {
    let target = Target::parse(ws_url)?;
    let url = healthz_url(ws_url)?;
    let fail = |reason: String| ClientError::Http {
        url: url.clone(),
        reason,
    };
    let request = format!(
        "GET /healthz HTTP/1.1\r\nHost: {}\r\nAccept: application/json\r\nConnection: close\r\n\r\n",
        target.host_header()
    );
    let exchange = async {
        let tcp = TcpStream::connect((target.host.as_str(), target.port))
            .await
            .map_err(|e| fail(format!("connect: {e}")))?;
        if target.tls {
            let config = match tls_config {
                Some(c) => c,
                None => tls::default_config()?,
            };
            let name = ServerName::try_from(target.host.clone())
                .map_err(|e| fail(format!("server name: {e}")))?;
            let stream = tokio_rustls::TlsConnector::from(config)
                .connect(name, tcp)
                .await
                .map_err(|e| fail(format!("TLS: {e}")))?;
            round_trip(stream, &request).await.map_err(fail)
        } else {
            round_trip(tcp, &request).await.map_err(fail)
        }
    };
    let raw = tokio::time::timeout(timeout, exchange)
        .await
        .map_err(|_| fail(format!("no answer within {timeout:?}")))??;
    parse_response(&raw).map_err(fail)
}

async fn round_trip<S: AsyncRead + AsyncWrite + Unpin>(
    mut stream: S,
    request: &str,
) -> Result<Vec<u8>, String> {
    stream
        .write_all(request.as_bytes())
        .await
        .map_err(|e| format!("send: {e}"))?;
    let mut raw = Vec::new();
    stream
        .take(MAX_RESPONSE_BYTES)
        .read_to_end(&mut raw)
        .await
        .map_err(|e| format!("read: {e}"))?;
    Ok(raw)
}

/// Status and body of a raw HTTP/1.1 response (content-length, chunked, or read to close).
fn parse_response(raw: &[u8]) -> Result<Health, String> {
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or("no end of headers in the response")?;
    let head = String::from_utf8_lossy(&raw[..split]);
    let mut body = &raw[split + 4..];
    let mut lines = head.lines();
    let status = lines
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|c| c.parse::<u16>().ok())
        .ok_or("not an HTTP response")?;
    let mut chunked = false;
    for line in lines {
        let Some((name, value)) = line.split_once(':') else {
            continue;
        };
        let (name, value) = (name.trim(), value.trim());
        if name.eq_ignore_ascii_case("content-length") {
            let n: usize = value.parse().map_err(|_| "bad content-length")?;
            body = body.get(..n).unwrap_or(body);
        } else if name.eq_ignore_ascii_case("transfer-encoding")
            && value.eq_ignore_ascii_case("chunked")
        {
            chunked = true;
        }
    }
    let body = if chunked {
        dechunk(body)?
    } else {
        body.to_vec()
    };
    let body = serde_json::from_slice(&body).unwrap_or(serde_json::Value::Null);
    Ok(Health { status, body })
}

fn dechunk(mut raw: &[u8]) -> Result<Vec<u8>, String> {
    let mut out = Vec::new();
    loop {
        let eol = raw
            .windows(2)
            .position(|w| w == b"\r\n")
            .ok_or("truncated chunked body")?;
        let size_text = String::from_utf8_lossy(&raw[..eol]);
        let size_text = size_text.split(';').next().unwrap_or("").trim();
        let size = usize::from_str_radix(size_text, 16).map_err(|_| "bad chunk size")?;
        raw = &raw[eol + 2..];
        if size == 0 {
            return Ok(out);
        }
        let chunk = raw.get(..size).ok_or("truncated chunk")?;
        out.extend_from_slice(chunk);
        raw = raw.get(size + 2..).ok_or("truncated chunk")?;
    }
}

/// Host, port and scheme of a `ws://` or `wss://` URL.
struct Target {
    tls: bool,
    host: String,
    port: u16,
}

impl Target {
    fn parse(ws_url: &str) -> Result<Target, ClientError> {
        let bad = |why: &str| ClientError::Config(format!("URL {ws_url:?}: {why}"));
        let uri: Uri = ws_url.parse().map_err(|_| bad("not a URL"))?;
        let tls = match uri.scheme_str() {
            Some(s) if s.eq_ignore_ascii_case("ws") => false,
            Some(s) if s.eq_ignore_ascii_case("wss") => true,
            _ => return Err(bad("the scheme must be ws or wss")),
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

    #[test]
    fn responses() {
        let r = parse_response(
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 15\r\n\r\n{\"status\":\"ok\"}",
        )
        .unwrap();
        assert!(r.is_healthy());
        let r = parse_response(
            b"HTTP/1.1 503 Service Unavailable\r\ntransfer-encoding: chunked\r\n\r\n7\r\n{\"statu\r\n\
              f\r\ns\":\"unhealthy\"}\r\n0\r\n\r\n",
        )
        .unwrap();
        assert_eq!(r.status, 503);
        assert_eq!(r.body["status"], "unhealthy");
        assert!(!r.is_healthy());
        assert!(parse_response(b"garbage").is_err());
    }
}

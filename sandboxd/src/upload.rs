//! Eager artifact upload (`artifact-manifest.md`, "Storage"): when an upload endpoint is configured, every
//! collected artifact is POSTed to it right after collection, with its bearer token, `Content-Hash: sha256:<hex>`
//! and `Content-Length`; the `backendUri` of the JSON answer replaces the manifest's `artifact://` ref. Failures are
//! retried with exponential backoff and, when every attempt failed, reported on the artifact (`upload_error`): the
//! content stays in the local store and is never dropped.
//!
//! Plain `http://` only: a `https://` endpoint is refused at configuration time rather than sent in clear text.

use std::path::Path;
use std::time::Duration;

use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

/// Where and how to upload.
#[derive(Debug, Clone, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UploadConfig {
    /// `http://host:port/path` receiving `POST`s.
    pub url: String,
    /// Bearer token sent with each upload.
    pub token: String,
    /// Attempts per artifact (first try included).
    #[serde(default = "default_attempts")]
    pub attempts: u32,
    /// First retry delay, doubled each time.
    #[serde(default = "default_backoff_ms")]
    pub backoff_ms: u64,
}

fn default_attempts() -> u32 {
    4
}

fn default_backoff_ms() -> u64 {
    100
}

impl UploadConfig {
    /// Checks the URL; returns why it is unusable.
    pub fn validate(&self) -> Result<(), String> {
        let uri: hyper::Uri = self.url.parse().map_err(|e| format!("not a URL: {e}"))?;
        match uri.scheme_str() {
            Some("http") => {}
            Some("https") => {
                return Err(
                    "https upload endpoints are not supported yet; use a local TLS proxy".into(),
                )
            }
            _ => return Err("the URL must start with http://".into()),
        }
        if uri.host().is_none() {
            return Err("the URL has no host".into());
        }
        if self.attempts == 0 {
            return Err("attempts must be at least 1".into());
        }
        Ok(())
    }
}

/// Uploads one blob; returns the backend URI, or the last error after every attempt failed.
pub async fn upload(
    cfg: &UploadConfig,
    blob: &Path,
    hex: &str,
    content_type: &str,
) -> Result<String, String> {
    let content = tokio::fs::read(blob)
        .await
        .map_err(|e| format!("cannot read the blob: {e}"))?;
    let client: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new()).build_http();
    let body = Bytes::from(content);
    let mut delay = Duration::from_millis(cfg.backoff_ms);
    let mut last = String::new();
    for attempt in 1..=cfg.attempts {
        let req = hyper::Request::post(&cfg.url)
            .header("authorization", format!("Bearer {}", cfg.token))
            .header("content-type", content_type)
            .header("content-hash", format!("sha256:{hex}"))
            .header("x-size-bytes", body.len().to_string())
            .body(Full::new(body.clone()))
            .map_err(|e| e.to_string())?;
        let outcome = tokio::time::timeout(Duration::from_secs(30), async {
            let resp = client
                .request(req)
                .await
                .map_err(|e| format!("request failed: {e}"))?;
            let status = resp.status();
            let bytes = resp
                .into_body()
                .collect()
                .await
                .map_err(|e| format!("reading the answer failed: {e}"))?
                .to_bytes();
            if !status.is_success() {
                return Err(format!("HTTP {status}"));
            }
            let v: serde_json::Value =
                serde_json::from_slice(&bytes).map_err(|e| format!("answer is not JSON: {e}"))?;
            v["backendUri"]
                .as_str()
                .map(str::to_owned)
                .ok_or_else(|| "answer has no backendUri".to_owned())
        })
        .await
        .unwrap_or_else(|_| Err("timed out after 30 s".into()));
        match outcome {
            Ok(uri) => return Ok(uri),
            Err(e) => {
                tracing::warn!(attempt, error = %e, hex, "artifact upload failed");
                last = e;
            }
        }
        if attempt < cfg.attempts {
            tokio::time::sleep(delay).await;
            delay *= 2;
        }
    }
    Err(format!("{} attempts failed, last: {last}", cfg.attempts))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(url: &str) -> UploadConfig {
        UploadConfig {
            url: url.into(),
            token: "t".into(),
            attempts: 3,
            backoff_ms: 1,
        }
    }

    #[test]
    fn only_plain_http_urls_with_a_host() {
        assert!(cfg("http://127.0.0.1:9/upload").validate().is_ok());
        assert!(cfg("https://example.invalid/u")
            .validate()
            .unwrap_err()
            .contains("https"));
        assert!(cfg("ftp://x/y").validate().is_err());
        assert!(cfg("not a url").validate().is_err());
    }

    /// A server that fails the first attempt and then answers: the upload succeeds with its URI; a server that
    /// always fails yields the last error after every attempt.
    #[tokio::test]
    async fn retries_with_backoff_then_reports() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let server = tokio::spawn(async move {
            let mut seen = Vec::new();
            for i in 0..2 {
                let (mut s, _) = listener.accept().await.unwrap();
                let mut buf = vec![0u8; 65536];
                let n = s.read(&mut buf).await.unwrap();
                seen.push(String::from_utf8_lossy(&buf[..n]).into_owned());
                let answer = if i == 0 {
                    "HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\nconnection: close\r\n\r\n".to_owned()
                } else {
                    let body = r#"{"backendUri":"s3://bucket/abc"}"#;
                    format!(
                        "HTTP/1.1 200 OK\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                        body.len()
                    )
                };
                s.write_all(answer.as_bytes()).await.unwrap();
            }
            seen
        });
        let dir = tempfile::tempdir().unwrap();
        let blob = dir.path().join("b");
        std::fs::write(&blob, b"content").unwrap();
        let uri = upload(
            &cfg(&format!("http://127.0.0.1:{port}/up")),
            &blob,
            "abc",
            "text/plain",
        )
        .await
        .unwrap();
        assert_eq!(uri, "s3://bucket/abc");
        let seen = server.await.unwrap();
        assert!(
            seen[1].contains("content-hash: sha256:abc")
                && seen[1].contains("authorization: Bearer t")
        );
        assert!(seen[1].ends_with("content"));
        // Nothing listens here: every attempt fails and the error says so.
        let dead = format!("http://127.0.0.1:{}/up", {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap().port()
        });
        let err = upload(&cfg(&dead), &blob, "abc", "text/plain")
            .await
            .unwrap_err();
        assert!(err.starts_with("3 attempts failed"), "{err}");
    }
}

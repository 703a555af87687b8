//! Eager artifact upload (`artifact-manifest.md`, "Storage"): when an upload endpoint is configured, every
//! collected artifact is POSTed to it right after collection, with its bearer token, `Content-Hash: sha256:<hex>`
//! and `Content-Length`; the `backendUri` of the JSON answer replaces the manifest's `artifact://` ref. Failures are
//! retried with exponential backoff and, when every attempt failed, reported on the artifact (`upload_error`): the
//! content stays in the local store and is never dropped.
//!
//! Plain `http://` only: a `https://` endpoint is refused at configuration time rather than sent in clear text.
//!
//! [`post_json`] is the one HTTP client of sandboxd's backend calls: the uploads here and the agents' token renewal
//! (`agents::backend`, through [`crate::agent_host`]) both go through it.

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

/// Why an upload configuration (or a bootstrap endpoint) is unusable.
#[derive(Debug, thiserror::Error)]
pub enum InvalidEndpoint {
    /// The URL does not parse.
    #[error("Not a URL")]
    Url(#[source] hyper::http::uri::InvalidUri),
    /// TLS is not implemented: the token would travel in clear text.
    #[error("https upload endpoints are not supported yet; use a local TLS proxy")]
    Https,
    /// Another scheme, or none.
    #[error("The URL must start with http://")]
    Scheme,
    /// No host to connect to.
    #[error("The URL has no host")]
    NoHost,
    /// Zero attempts would never upload.
    #[error("Attempts must be at least 1")]
    NoAttempts,
}

impl UploadConfig {
    /// Checks the URL and the attempts.
    pub fn validate(&self) -> Result<(), InvalidEndpoint> {
        let uri: hyper::Uri = self.url.parse().map_err(InvalidEndpoint::Url)?;
        match uri.scheme_str() {
            Some("http") => {}
            Some("https") => return Err(InvalidEndpoint::Https),
            _ => return Err(InvalidEndpoint::Scheme),
        }
        if uri.host().is_none() {
            return Err(InvalidEndpoint::NoHost);
        }
        if self.attempts == 0 {
            return Err(InvalidEndpoint::NoAttempts);
        }
        Ok(())
    }
}

/// How long one request to the backend may take, answer included.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);

/// Why one `POST` to the backend failed.
#[derive(Debug, thiserror::Error)]
pub enum HttpError {
    /// The request could not be built (a header value the URL or token makes invalid).
    #[error("Cannot build the request")]
    Build(#[source] hyper::http::Error),
    /// Connecting or sending failed.
    #[error("Request failed")]
    Send(#[source] hyper_util::client::legacy::Error),
    /// The answer's body could not be read.
    #[error("Reading the answer failed")]
    Read(#[source] hyper::Error),
    /// The backend answered with an error status.
    #[error("HTTP {0}")]
    Status(hyper::StatusCode),
    /// The answer is not JSON.
    #[error("The answer is not JSON")]
    Json(#[source] serde_json::Error),
    /// No complete answer within [`REQUEST_TIMEOUT`].
    #[error("Timed out after {} s", REQUEST_TIMEOUT.as_secs())]
    Timeout,
}

impl HttpError {
    /// The backend refused the token.
    pub fn is_unauthorized(&self) -> bool {
        matches!(self, Self::Status(s) if *s == hyper::StatusCode::UNAUTHORIZED)
    }
}

/// A `POST` with a bearer token: the JSON of a successful answer, or why there is none. Shared by the artifact
/// upload and the agents' token renewal.
pub async fn post_json(
    url: &str,
    token: &str,
    headers: &[(&str, String)],
    body: Bytes,
) -> Result<serde_json::Value, HttpError> {
    let client: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new()).build_http();
    let mut req = hyper::Request::post(url).header("authorization", format!("Bearer {token}"));
    for (name, value) in headers {
        req = req.header(*name, value);
    }
    let req = req.body(Full::new(body)).map_err(HttpError::Build)?;
    tokio::time::timeout(REQUEST_TIMEOUT, async {
        let resp = client.request(req).await.map_err(HttpError::Send)?;
        let status = resp.status();
        let bytes = resp
            .into_body()
            .collect()
            .await
            .map_err(HttpError::Read)?
            .to_bytes();
        if !status.is_success() {
            return Err(HttpError::Status(status));
        }
        serde_json::from_slice(&bytes).map_err(HttpError::Json)
    })
    .await
    .unwrap_or(Err(HttpError::Timeout))
}

/// Why an artifact was not uploaded.
#[derive(Debug, thiserror::Error)]
pub enum UploadError {
    /// The stored blob could not be read.
    #[error("Cannot read the blob {}", .path.display())]
    Blob {
        /// The blob's path in the store.
        path: std::path::PathBuf,
        /// The read error.
        #[source]
        source: std::io::Error,
    },
    /// The backend answered without a `backendUri`.
    #[error("The answer has no backendUri")]
    NoUri,
    /// Every attempt failed; the last one's error is the source.
    #[error("{attempts} attempts failed")]
    Exhausted {
        /// How many attempts were made.
        attempts: u32,
        /// What the last one ran into.
        #[source]
        last: Box<UploadError>,
    },
    /// The request failed.
    #[error(transparent)]
    Http(#[from] HttpError),
}

impl UploadError {
    /// The backend refused the token (on the last attempt).
    pub fn is_unauthorized(&self) -> bool {
        match self {
            Self::Http(e) => e.is_unauthorized(),
            Self::Exhausted { last, .. } => last.is_unauthorized(),
            Self::Blob { .. } | Self::NoUri => false,
        }
    }
}

/// Uploads one blob; returns the backend URI, or the last error after every attempt failed.
pub async fn upload(
    cfg: &UploadConfig,
    blob: &Path,
    hex: &str,
    content_type: &str,
) -> Result<String, UploadError> {
    let content = tokio::fs::read(blob)
        .await
        .map_err(|source| UploadError::Blob {
            path: blob.to_owned(),
            source,
        })?;
    let body = Bytes::from(content);
    let headers = [
        ("content-type", content_type.to_owned()),
        ("content-hash", format!("sha256:{hex}")),
        ("x-size-bytes", body.len().to_string()),
    ];
    let mut delay = Duration::from_millis(cfg.backoff_ms);
    let mut last = UploadError::NoUri;
    for attempt in 1..=cfg.attempts {
        let outcome = post_json(&cfg.url, &cfg.token, &headers, body.clone())
            .await
            .map_err(UploadError::from)
            .and_then(|v| {
                v["backendUri"]
                    .as_str()
                    .map(str::to_owned)
                    .ok_or(UploadError::NoUri)
            });
        match outcome {
            Ok(uri) => return Ok(uri),
            // The same request would be as malformed next time.
            Err(e @ UploadError::Http(HttpError::Build(_))) => return Err(e),
            Err(e) => {
                tracing::warn!(attempt, error = %runtime::error::Chain(&e), hex, "artifact upload failed");
                last = e;
            }
        }
        if attempt < cfg.attempts {
            tokio::time::sleep(delay).await;
            delay *= 2;
        }
    }
    Err(UploadError::Exhausted {
        attempts: cfg.attempts,
        last: Box::new(last),
    })
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
            .to_string()
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
        let text = runtime::error::Chain(&err).to_string();
        assert!(
            text.starts_with("3 attempts failed: Request failed"),
            "{text}"
        );
        assert!(!err.is_unauthorized());
    }
}

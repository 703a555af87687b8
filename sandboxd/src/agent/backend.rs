//! The sandbox-to-backend calls sandboxd makes on an agent's behalf: eager artifact upload (an `ArtifactEvent`'s
//! file is read from the workspace, stored, uploaded, and its `uri` rewritten to the returned `backendUri`) and
//! token renewal at 80% of the token's lifetime (and at once when an upload is refused with 401, before one more
//! attempt). The token never reaches the agent and is never logged.

use std::os::fd::AsRawFd;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use nix::fcntl::OFlag;
use protocol::agent::SandboxBootstrap;
use serde_json::{Map, Value};
use time::format_description::well_known::Rfc3339;
use time::OffsetDateTime;

use crate::store::Store;
use crate::upload::UploadConfig;

/// The bootstrap of a sandbox, with a token that renewal replaces.
pub struct Backend {
    bootstrap: Mutex<SandboxBootstrap>,
    /// When the current token was received.
    issued: Mutex<OffsetDateTime>,
    attempts: u32,
}

impl Backend {
    /// Wraps a checked bootstrap.
    pub fn new(bootstrap: SandboxBootstrap, attempts: u32) -> Arc<Self> {
        Arc::new(Self {
            bootstrap: Mutex::new(bootstrap),
            issued: Mutex::new(OffsetDateTime::now_utc()),
            attempts,
        })
    }

    fn get(&self) -> SandboxBootstrap {
        self.bootstrap
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    fn upload_config(&self) -> UploadConfig {
        let b = self.get();
        UploadConfig {
            url: b.artifact_upload_endpoint,
            token: b.backend_token,
            attempts: self.attempts,
            backoff_ms: 100,
        }
    }

    /// Checks a bootstrap at sandbox creation: plain-http endpoints and an RFC 3339 expiry.
    pub fn check(b: &SandboxBootstrap) -> Result<(), String> {
        let upload = UploadConfig {
            url: b.artifact_upload_endpoint.clone(),
            token: String::new(),
            attempts: 1,
            backoff_ms: 1,
        };
        upload
            .validate()
            .map_err(|e| format!("bootstrap.artifactUploadEndpoint: {e}"))?;
        let renew = UploadConfig {
            url: renew_url(&b.backend_url),
            ..upload
        };
        renew
            .validate()
            .map_err(|e| format!("bootstrap.backendUrl: {e}"))?;
        OffsetDateTime::parse(&b.token_expires_at, &Rfc3339)
            .map_err(|e| format!("bootstrap.tokenExpiresAt: not RFC 3339: {e}"))?;
        if b.agent_id.is_empty() {
            return Err("bootstrap.agentId is empty".into());
        }
        Ok(())
    }

    /// When the token should be renewed: 80% into its lifetime (counted from when it was received).
    fn renew_at(&self) -> OffsetDateTime {
        let issued = *self.issued.lock().unwrap_or_else(|p| p.into_inner());
        let expires =
            OffsetDateTime::parse(&self.get().token_expires_at, &Rfc3339).unwrap_or(issued);
        let ttl = expires - issued;
        if ttl.is_negative() {
            return issued;
        }
        issued + ttl * 0.8
    }

    /// Renews the token forever (until the task is aborted): at 80% of its lifetime, then with exponential backoff
    /// (1 s doubling to 60 s) while the backend refuses or is unreachable.
    pub async fn renew_loop(self: Arc<Self>) {
        let mut backoff = Duration::from_secs(1);
        loop {
            let wait = self.renew_at() - OffsetDateTime::now_utc();
            if wait.is_positive() {
                tokio::time::sleep(wait.unsigned_abs()).await;
            }
            match self.renew_once().await {
                Ok(()) => {
                    backoff = Duration::from_secs(1);
                    tracing::info!("backend token renewed");
                }
                Err(e) => {
                    tracing::warn!(error = %e, "backend token renewal failed; retrying");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(60));
                }
            }
        }
    }

    async fn renew_once(&self) -> Result<(), String> {
        let b = self.get();
        let body = serde_json::json!({"agentId": b.agent_id, "currentToken": b.backend_token});
        let client: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new()).build_http();
        let req = hyper::Request::post(renew_url(&b.backend_url))
            .header("authorization", format!("Bearer {}", b.backend_token))
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(body.to_string())))
            .map_err(|e| e.to_string())?;
        let resp = tokio::time::timeout(Duration::from_secs(30), client.request(req))
            .await
            .map_err(|_| "timed out".to_owned())?
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
        let v: Value =
            serde_json::from_slice(&bytes).map_err(|e| format!("answer is not JSON: {e}"))?;
        let (Some(token), Some(expires)) =
            (v["backendToken"].as_str(), v["tokenExpiresAt"].as_str())
        else {
            return Err("answer lacks backendToken or tokenExpiresAt".into());
        };
        OffsetDateTime::parse(expires, &Rfc3339)
            .map_err(|e| format!("tokenExpiresAt is not RFC 3339: {e}"))?;
        {
            let mut g = self.bootstrap.lock().unwrap_or_else(|p| p.into_inner());
            g.backend_token = token.to_owned();
            g.token_expires_at = expires.to_owned();
        }
        *self.issued.lock().unwrap_or_else(|p| p.into_inner()) = OffsetDateTime::now_utc();
        Ok(())
    }

    /// Uploads the file an `ArtifactEvent` names and rewrites the event: `uri` becomes the backend's URI,
    /// `contentHash` (sha256 hex) and `sizeBytes` are set, `provenance.sourcePath` keeps the sandbox path. On
    /// failure `uri` is removed (the bus never sees a sandbox path) and the error is returned.
    pub async fn upload_artifact(
        &self,
        store: &Arc<Store>,
        workspace: &Path,
        max_bytes: u64,
        event: &mut Map<String, Value>,
    ) -> Result<(), String> {
        let Some(uri) = event.get("uri").and_then(Value::as_str).map(str::to_owned) else {
            return Ok(());
        };
        let Some(rel) = uri
            .strip_prefix(runtime::rootfs::WORKDIR)
            .and_then(|r| r.strip_prefix('/'))
            .filter(|r| !r.is_empty())
            .map(str::to_owned)
        else {
            if uri.starts_with('/') {
                event.remove("uri");
                return Err(format!("{uri} is not under /workspace"));
            }
            // Already a backend or content URI: nothing to upload.
            return Ok(());
        };
        let mime = event
            .get("mimeType")
            .and_then(Value::as_str)
            .map(str::to_owned)
            .unwrap_or_else(|| {
                mime_guess::from_path(&rel)
                    .first()
                    .map(|m| m.essence_str().to_owned())
                    .unwrap_or_else(|| "application/octet-stream".into())
            });
        let (store2, ws, rel2, mime2) = (
            store.clone(),
            workspace.to_owned(),
            rel.clone(),
            mime.clone(),
        );
        let stored =
            tokio::task::spawn_blocking(move || -> Result<crate::store::Stored, String> {
                let dir = std::fs::File::open(&ws).map_err(|e| format!("workspace: {e}"))?;
                let fd =
                    runtime::sys::open_beneath(dir.as_raw_fd(), rel2.as_ref(), OFlag::O_RDONLY)
                        .map_err(|e| format!("cannot open /workspace/{rel2}: {e}"))?;
                let mut file = std::fs::File::from(fd);
                let md = file.metadata().map_err(|e| e.to_string())?;
                if !md.is_file() {
                    return Err(format!("/workspace/{rel2} is not a regular file"));
                }
                if md.len() > max_bytes {
                    return Err(format!(
                        "/workspace/{rel2} is larger than {max_bytes} bytes"
                    ));
                }
                let _w = store2.writing();
                let staged = store2
                    .stage(&mut file, max_bytes, |_| mime2)
                    .map_err(|e| format!("cannot store: {e}"))?;
                let mut v = store2
                    .commit(vec![staged])
                    .map_err(|e| format!("cannot store: {e}"))?;
                v.pop().ok_or_else(|| "nothing stored".to_owned())
            })
            .await
            .map_err(|e| format!("store task failed: {e}"))
            .and_then(|r| r);
        let stored = match stored {
            Ok(s) => s,
            Err(e) => {
                event.remove("uri");
                return Err(e);
            }
        };
        let Some(blob) = store.blob(&stored.hex) else {
            event.remove("uri");
            return Err("stored content vanished".into());
        };
        let mut outcome =
            crate::upload::upload(&self.upload_config(), &blob, &stored.hex, &mime).await;
        // A refused token (expired before its renewal): renew now and try once more.
        if outcome.as_ref().is_err_and(|e| e.contains("HTTP 401")) {
            match self.renew_once().await {
                Ok(()) => {
                    outcome =
                        crate::upload::upload(&self.upload_config(), &blob, &stored.hex, &mime)
                            .await;
                }
                Err(e) => tracing::warn!(error = %e, "token renewal after a refused upload failed"),
            }
        }
        match outcome {
            Ok(backend_uri) => {
                event.insert("uri".into(), backend_uri.into());
                event.insert("contentHash".into(), stored.hex.clone().into());
                event.insert("sizeBytes".into(), stored.size.into());
                event.entry("mimeType").or_insert_with(|| mime.into());
                if let Some(Value::Object(p)) = event.get_mut("provenance") {
                    p.entry("sourcePath").or_insert_with(|| uri.clone().into());
                }
                Ok(())
            }
            Err(e) => {
                event.remove("uri");
                event.insert("contentHash".into(), stored.hex.into());
                event.insert("sizeBytes".into(), stored.size.into());
                Err(format!("upload failed: {e}"))
            }
        }
    }
}

/// `{backendUrl}/api/token/renew`.
fn renew_url(backend: &str) -> String {
    format!("{}/api/token/renew", backend.trim_end_matches('/'))
}

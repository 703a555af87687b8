//! The sandbox-to-backend calls sandboxd makes on an agent's behalf: eager artifact upload (an `ArtifactEvent`'s
//! file is read from the workspace, stored, uploaded, and its `uri` rewritten to the returned `backendUri`) and
//! token renewal at 80% of the token's lifetime (and at once when an upload is refused with 401, before one more
//! attempt). The token never reaches the agent and is never logged.

use std::os::fd::AsRawFd;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use agent_api::SandboxBootstrap;
use nix::fcntl::OFlag;
use serde_json::{Map, Value};
use time::format_description::well_known::Rfc3339;
use time::OffsetDateTime;

use crate::host::{ArtifactStore, BoxError, HttpFailure, StoredArtifact, Upload, Uploads};

/// Why a sandbox's bootstrap is refused at creation.
#[derive(Debug, thiserror::Error)]
pub enum BootstrapError {
    /// The artifact upload endpoint is unusable.
    #[error("bootstrap.artifactUploadEndpoint is unusable")]
    UploadEndpoint(#[source] BoxError),
    /// The backend URL (token renewal) is unusable.
    #[error("bootstrap.backendUrl is unusable")]
    BackendUrl(#[source] BoxError),
    /// The token's expiry does not parse.
    #[error("bootstrap.tokenExpiresAt is not RFC 3339")]
    Expiry(#[source] time::error::Parse),
    /// No agent id.
    #[error("bootstrap.agentId is empty")]
    NoAgentId,
}

/// Why the token was not renewed.
#[derive(Debug, thiserror::Error)]
pub enum RenewError {
    /// The request failed.
    #[error(transparent)]
    Http(#[from] HttpFailure),
    /// The answer lacks a field.
    #[error("The answer lacks backendToken or tokenExpiresAt")]
    Incomplete,
    /// The new expiry does not parse.
    #[error("tokenExpiresAt is not RFC 3339")]
    Expiry(#[source] time::error::Parse),
}

/// Why an artifact event's file was not uploaded. In every case the event's sandbox path is removed.
#[derive(Debug, thiserror::Error)]
pub enum ArtifactError {
    /// The event names a path outside the workspace.
    #[error("{0} is not under /workspace")]
    OutsideWorkspace(String),
    /// The workspace could not be opened.
    #[error("Cannot open the workspace")]
    Workspace(#[source] std::io::Error),
    /// The file could not be opened beneath the workspace (missing, or through a symlink).
    #[error("Cannot open /workspace/{path}")]
    Open {
        /// Path relative to the workspace.
        path: String,
        /// The errno.
        #[source]
        source: nix::Error,
    },
    /// The file's metadata could not be read.
    #[error("Cannot stat /workspace/{path}")]
    Stat {
        /// Path relative to the workspace.
        path: String,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// Not a regular file.
    #[error("/workspace/{0} is not a regular file")]
    NotRegular(String),
    /// Over the size limit.
    #[error("/workspace/{path} is larger than {max} bytes")]
    TooLarge {
        /// Path relative to the workspace.
        path: String,
        /// The limit.
        max: u64,
    },
    /// The local store refused the content.
    #[error("Cannot store the artifact")]
    Store(#[source] std::io::Error),
    /// The store task panicked or was cancelled.
    #[error("The store task failed")]
    Task(#[source] tokio::task::JoinError),
    /// The store committed nothing, or the content was gone before the upload.
    #[error("The stored content vanished")]
    Vanished,
    /// The upload failed; the event keeps `contentHash` and `sizeBytes`.
    #[error("Upload failed")]
    Upload(#[source] HttpFailure),
}

/// The bootstrap of a sandbox, with a token that renewal replaces.
pub struct Backend {
    bootstrap: Mutex<SandboxBootstrap>,
    /// When the current token was received.
    issued: Mutex<OffsetDateTime>,
    attempts: u32,
    uploads: Arc<dyn Uploads>,
}

impl Backend {
    /// Wraps a checked bootstrap.
    pub fn new(bootstrap: SandboxBootstrap, attempts: u32, uploads: Arc<dyn Uploads>) -> Arc<Self> {
        Arc::new(Self {
            bootstrap: Mutex::new(bootstrap),
            issued: Mutex::new(OffsetDateTime::now_utc()),
            attempts,
            uploads,
        })
    }

    /// The credentials as last renewed.
    pub fn bootstrap(&self) -> SandboxBootstrap {
        self.get()
    }

    fn get(&self) -> SandboxBootstrap {
        self.bootstrap
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Uploads stored content with the current token.
    async fn upload(&self, blob: &Path, hex: &str, mime: &str) -> Result<String, HttpFailure> {
        let b = self.get();
        let upload = Upload {
            url: &b.artifact_upload_endpoint,
            token: &b.backend_token,
            attempts: self.attempts,
            blob,
            hex,
            mime,
        };
        self.uploads.upload(upload).await
    }

    /// Checks a bootstrap at sandbox creation: usable endpoints (as `uploads` sees them) and an RFC 3339 expiry.
    pub fn check(b: &SandboxBootstrap, uploads: &dyn Uploads) -> Result<(), BootstrapError> {
        uploads
            .check_endpoint(&b.artifact_upload_endpoint)
            .map_err(BootstrapError::UploadEndpoint)?;
        uploads
            .check_endpoint(&renew_url(&b.backend_url))
            .map_err(BootstrapError::BackendUrl)?;
        OffsetDateTime::parse(&b.token_expires_at, &Rfc3339).map_err(BootstrapError::Expiry)?;
        if b.agent_id.is_empty() {
            return Err(BootstrapError::NoAgentId);
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
    /// `renewed` is called after each renewal (the sandbox's record keeps the new token).
    pub async fn renew_loop(self: Arc<Self>, renewed: impl Fn() + Send + 'static) {
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
                    renewed();
                }
                Err(e) => {
                    tracing::warn!(error = %runtime::error::Chain(&e), "backend token renewal failed; retrying");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(60));
                }
            }
        }
    }

    async fn renew_once(&self) -> Result<(), RenewError> {
        let b = self.get();
        let body = serde_json::json!({"agentId": b.agent_id, "currentToken": b.backend_token});
        let v = self
            .uploads
            .post_json(
                &renew_url(&b.backend_url),
                &b.backend_token,
                body.to_string(),
            )
            .await?;
        let (Some(token), Some(expires)) =
            (v["backendToken"].as_str(), v["tokenExpiresAt"].as_str())
        else {
            return Err(RenewError::Incomplete);
        };
        OffsetDateTime::parse(expires, &Rfc3339).map_err(RenewError::Expiry)?;
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
        store: &Arc<dyn ArtifactStore>,
        workspace: &Path,
        max_bytes: u64,
        event: &mut Map<String, Value>,
    ) -> Result<(), ArtifactError> {
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
                return Err(ArtifactError::OutsideWorkspace(uri));
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
        let stored = store_from_workspace(store, workspace, &rel, &mime, max_bytes).await;
        let (stored, blob) = match stored.and_then(|s| match store.path(&s.hex) {
            Some(blob) => Ok((s, blob)),
            None => Err(ArtifactError::Vanished),
        }) {
            Ok(s) => s,
            Err(e) => {
                event.remove("uri");
                return Err(e);
            }
        };
        let mut outcome = self.upload(&blob, &stored.hex, &mime).await;
        // A refused token (expired before its renewal): renew now and try once more.
        if outcome.as_ref().is_err_and(|e| e.unauthorized) {
            match self.renew_once().await {
                Ok(()) => outcome = self.upload(&blob, &stored.hex, &mime).await,
                Err(e) => tracing::warn!(
                    error = %runtime::error::Chain(&e),
                    "token renewal after a refused upload failed"
                ),
            }
        }
        event.insert("contentHash".into(), stored.hex.clone().into());
        event.insert("sizeBytes".into(), stored.size.into());
        match outcome {
            Ok(backend_uri) => {
                event.insert("uri".into(), backend_uri.into());
                event.entry("mimeType").or_insert_with(|| mime.into());
                if let Some(Value::Object(p)) = event.get_mut("provenance") {
                    p.entry("sourcePath").or_insert_with(|| uri.clone().into());
                }
                Ok(())
            }
            Err(e) => {
                event.remove("uri");
                Err(ArtifactError::Upload(e))
            }
        }
    }
}

/// Reads `/workspace/<rel>` beneath the workspace (never through a symlink), checks it is a regular file within
/// `max_bytes`, and stores it in the local content store.
async fn store_from_workspace(
    store: &Arc<dyn ArtifactStore>,
    workspace: &Path,
    rel: &str,
    mime: &str,
    max_bytes: u64,
) -> Result<StoredArtifact, ArtifactError> {
    let (store, ws, rel, mime) = (
        store.clone(),
        workspace.to_owned(),
        rel.to_owned(),
        mime.to_owned(),
    );
    tokio::task::spawn_blocking(move || {
        let dir = std::fs::File::open(&ws).map_err(ArtifactError::Workspace)?;
        // O_NONBLOCK: a FIFO (or a device) named by the agent must not block the open, it is refused just below
        // (on a regular file the flag changes nothing); open_beneath adds O_NOFOLLOW and refuses symlinks.
        let flags = OFlag::O_RDONLY | OFlag::O_NONBLOCK;
        let fd =
            runtime::sys::open_beneath(dir.as_raw_fd(), rel.as_ref(), flags).map_err(|source| {
                ArtifactError::Open {
                    path: rel.clone(),
                    source,
                }
            })?;
        let mut file = std::fs::File::from(fd);
        let md = file.metadata().map_err(|source| ArtifactError::Stat {
            path: rel.clone(),
            source,
        })?;
        if !md.is_file() {
            return Err(ArtifactError::NotRegular(rel));
        }
        if md.len() > max_bytes {
            return Err(ArtifactError::TooLarge {
                path: rel,
                max: max_bytes,
            });
        }
        store
            .store(&mut file, max_bytes, &mime)
            .map_err(ArtifactError::Store)
    })
    .await
    .map_err(ArtifactError::Task)?
}

/// `{backendUrl}/api/token/renew`.
fn renew_url(backend: &str) -> String {
    format!("{}/api/token/renew", backend.trim_end_matches('/'))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_host::FakeUploads;

    fn bootstrap() -> SandboxBootstrap {
        serde_json::from_value(serde_json::json!({
            "agentId": "a1",
            "backendUrl": "http://127.0.0.1:9/",
            "backendToken": "t",
            "tokenExpiresAt": "2030-01-01T00:00:00Z",
            "artifactUploadEndpoint": "http://127.0.0.1:9/api/artifacts"
        }))
        .unwrap()
    }

    #[test]
    fn a_bootstrap_is_refused_naming_the_field_and_why() {
        let check = |b: &SandboxBootstrap| Backend::check(b, &FakeUploads::default());
        check(&bootstrap()).unwrap();
        let mut b = bootstrap();
        b.artifact_upload_endpoint = "https://x.invalid/a".into();
        let e = check(&b).unwrap_err();
        assert!(matches!(e, BootstrapError::UploadEndpoint(_)));
        assert_eq!(
            runtime::error::Chain(&e).to_string(),
            "bootstrap.artifactUploadEndpoint is unusable: The URL must start with http://"
        );
        let mut b = bootstrap();
        b.backend_url = "ftp://x".into();
        assert!(matches!(check(&b), Err(BootstrapError::BackendUrl(_))));
        let mut b = bootstrap();
        b.token_expires_at = "tomorrow".into();
        assert!(matches!(check(&b), Err(BootstrapError::Expiry(_))));
        let mut b = bootstrap();
        b.agent_id.clear();
        assert!(matches!(check(&b), Err(BootstrapError::NoAgentId)));
    }
}

//! Artifacts of an execution: the requested files collected from the working directory into the store, the
//! manifest, and the eager upload to a configured endpoint.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use protocol::{Artifact, ArtifactManifest, DroppedArtifacts, SkippedArtifact};
use tracing::{debug, warn};

use super::error::ArtifactError;
use super::{Engine, ExecError};

impl Engine {
    /// Collects the requested artifacts (blocking work on a blocking thread), uploads them when an endpoint is
    /// configured, and returns the manifest for the result.
    pub(super) async fn artifacts(
        self: &Arc<Self>,
        wanted: &protocol::ArtifactsRequest,
        workspace: PathBuf,
        exec_id: &str,
        fingerprint: &str,
    ) -> Result<ArtifactManifest, ExecError> {
        let engine = self.clone();
        let wanted = wanted.clone();
        let (id, fp) = (exec_id.to_owned(), fingerprint.to_owned());
        let t0 = Instant::now();
        let mut manifest = tokio::task::spawn_blocking(move || {
            engine.collect_artifacts(&wanted, &workspace, &id, &fp)
        })
        .await
        .map_err(ExecError::ArtifactsPanicked)?
        .map_err(ExecError::Artifacts)?;
        debug!(ms = t0.elapsed().as_millis() as u64, "artifacts collected");
        if let Some(cfg) = &self.config().artifacts.upload {
            self.upload_artifacts(cfg, &mut manifest).await;
        }
        Ok(manifest)
    }

    /// Collects the requested files from the working directory into the store and returns the manifest.
    fn collect_artifacts(
        &self,
        wanted: &protocol::ArtifactsRequest,
        workspace: &std::path::Path,
        exec_id: &str,
        fingerprint: &str,
    ) -> Result<ArtifactManifest, ArtifactError> {
        let cfg = &self.config().artifacts;
        let patterns = runtime::artifacts::Patterns::new(
            &wanted.paths,
            &wanted.types.clone().unwrap_or_default(),
        )
        .map_err(ArtifactError::Patterns)?;
        let limits = runtime::artifacts::CollectLimits {
            max_files: cfg.max_files,
            max_file_bytes: cfg.max_file_bytes,
            max_total_bytes: cfg.max_total_bytes,
            max_listed_skips: 256,
        };
        let collection = runtime::artifacts::collect(workspace, &patterns, limits)
            .map_err(ArtifactError::Collect)?;
        let _writing = self.daemon.store().writing();
        let mut skipped: Vec<SkippedArtifact> = collection
            .skipped
            .iter()
            .map(|s| SkippedArtifact {
                path: s.path.clone(),
                reason: s.reason.clone(),
            })
            .collect();
        let mut staged = Vec::with_capacity(collection.found.len());
        for mut f in collection.found {
            let path = f.path.clone();
            match self
                .daemon
                .store()
                .stage(&mut f.file, f.size, |head| content_type(&path, head))
            {
                Ok(st) => staged.push((f.path, f.artifact_type, st)),
                Err(e) => {
                    warn!(path = %f.path, error = %e, "artifact not stored");
                    skipped.push(SkippedArtifact {
                        path: f.path,
                        reason: "unreadable".into(),
                    });
                }
            }
        }
        let (meta, blobs): (Vec<_>, Vec<_>) =
            staged.into_iter().map(|(p, t, s)| ((p, t), s)).unzip();
        let stored = self
            .daemon
            .store()
            .commit(blobs)
            .map_err(ArtifactError::Store)?;
        let artifacts = meta
            .into_iter()
            .zip(stored)
            .map(|((path, artifact_type), st)| Artifact {
                artifact_type,
                mime_type: content_type(&path, &st.head),
                preview: preview(&st.head),
                path,
                reference: format!("artifact://sha256/{}", st.hex),
                checksum: format!("sha256:{}", st.hex),
                size_bytes: st.size,
                uploaded: None,
                upload_error: None,
            })
            .collect();
        let listed = skipped.len() as u64;
        let total_skipped: u64 = collection.skipped_counts.values().sum();
        let dropped =
            (total_skipped > listed || collection.walk_truncated).then(|| DroppedArtifacts {
                by_reason: collection.skipped_counts,
                not_listed: total_skipped.saturating_sub(listed),
                walk_truncated: collection.walk_truncated,
            });
        let manifest = ArtifactManifest {
            manifest_id: format!("am_{:x}{:08x}", unix_millis(), rand::random::<u32>()),
            execution_id: exec_id.to_owned(),
            generated_at: protocol::now_ts(),
            environment_fingerprint: fingerprint.to_owned(),
            artifacts,
            skipped,
            dropped,
            upload_failures: None,
        };
        self.daemon
            .store()
            .save_manifest(&manifest.manifest_id, &manifest.to_value())
            .map_err(ArtifactError::Manifest)?;
        Ok(manifest)
    }

    /// Uploads every artifact of a manifest eagerly; the returned URI replaces the ref, a failure is reported on the
    /// artifact and the content stays in the local store. The manifest is saved again with the outcome.
    async fn upload_artifacts(
        &self,
        cfg: &crate::storage::upload::UploadConfig,
        manifest: &mut ArtifactManifest,
    ) {
        let mut failures = 0u64;
        for a in &mut manifest.artifacts {
            let Some(hex) = a.sha256_hex().map(str::to_owned) else {
                continue;
            };
            let Some(blob) = self.daemon.store().blob(&hex) else {
                continue;
            };
            match crate::storage::upload::upload(cfg, &blob, &hex, &a.mime_type).await {
                Ok(uri) => {
                    a.reference = uri;
                    a.uploaded = Some(true);
                }
                Err(e) => {
                    failures += 1;
                    a.upload_error = Some(runtime::error::Chain(&e).to_string());
                }
            }
        }
        if failures > 0 {
            manifest.upload_failures = Some(failures);
        }
        let (store, id, m) = (
            self.daemon.store().clone(),
            manifest.manifest_id.clone(),
            manifest.to_value(),
        );
        let saved = tokio::task::spawn_blocking(move || store.save_manifest(&id, &m)).await;
        if !matches!(saved, Ok(Ok(()))) {
            warn!("the manifest could not be saved again after the upload");
        }
    }
}

fn unix_millis() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis())
        .unwrap_or(0)
}

/// The content type of an artifact: from its name, else text or binary by its first bytes.
fn content_type(path: &str, head: &[u8]) -> String {
    match mime_guess::from_path(path).first() {
        Some(m) => m.essence_str().to_owned(),
        None if preview(head).is_some() => "text/plain".into(),
        None => "application/octet-stream".into(),
    }
}

/// The first bytes as text, if they are text (valid UTF-8 up to a cut character, no NUL).
fn preview(head: &[u8]) -> Option<String> {
    if head.contains(&0) {
        return None;
    }
    let valid = match std::str::from_utf8(head) {
        Ok(s) => s,
        Err(e) if e.error_len().is_none() => std::str::from_utf8(&head[..e.valid_up_to()]).ok()?,
        Err(_) => return None,
    };
    Some(valid.to_owned())
}

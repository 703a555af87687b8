//! The daemon's side of agent sandboxes, faked for this crate's tests: a content-addressed store in a directory,
//! uploads that succeed without a network, a bearer token, and workspaces on the container seam's fake backend
//! (the agents' runs are plain child processes), so the sandboxes' lifecycle is tested without root.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use containers::agent::{BoxFuture, Workspace};
use containers::fake::{Call, FakeBackend, Recorder};
use containers::image::RootImage;
use containers::{ContainerBackend, WorkspacePlan};
use serde_json::Value;
use sha2::Digest;

use crate::host::{
    ArtifactStore, Authorizer, BoxError, Containers, HttpFailure, StoredArtifact, Upload, Uploads,
    WorkspaceError, WorkspaceRequest,
};

/// Workspaces of the fake backend on its one image, `host`; at most `max` at once, as the daemon's host uids for
/// sandboxes allow (a workspace counts until the backend was asked to remove it).
pub(crate) struct FakeContainers {
    backend: FakeBackend,
    recorder: Arc<Recorder>,
    image: Arc<RootImage>,
    max: usize,
}

impl FakeContainers {
    /// Workspaces under `root`, at most `max`, every call recorded in `recorder`.
    pub(crate) fn new(root: &std::path::Path, recorder: Arc<Recorder>, max: usize) -> Self {
        Self {
            backend: FakeBackend::new(root, recorder.clone()),
            recorder,
            image: containers::fake::shell().image,
            max,
        }
    }

    fn live(&self) -> usize {
        let calls = self.recorder.calls();
        let count = |f: fn(&Call) -> bool| calls.iter().filter(|c| f(c)).count();
        count(|c| matches!(c, Call::CreateWorkspace(_)))
            - count(|c| matches!(c, Call::RemoveWorkspace(_)))
    }
}

impl Containers for FakeContainers {
    fn image_environment(&self, image: &str) -> Option<BTreeMap<String, String>> {
        (image == "host").then(|| containers::image::base_environment(&self.image))
    }

    fn create_workspace<'a>(
        &'a self,
        req: WorkspaceRequest<'a>,
    ) -> BoxFuture<'a, Result<Arc<dyn Workspace>, WorkspaceError>> {
        Box::pin(async move {
            if req.image != "host" {
                return Err(WorkspaceError::NoImage(req.image.to_owned()));
            }
            if self.live() >= self.max {
                return Err(WorkspaceError::Full(self.max));
            }
            let plan = WorkspacePlan {
                id: req.id,
                parent: req.parent,
                host_id: nix::unistd::getuid().as_raw(),
                image: &self.image,
                disk_mb: req.disk_mb,
                snapshot: req.snapshot,
                subvolume: req.subvolume,
                root_layer: req.root_layer,
            };
            let made = self.backend.create_workspace(plan).await;
            made.map_err(|e| WorkspaceError::Failed(Box::new(e)))
        })
    }
}

/// Content-addressed files in a directory.
pub(crate) struct DirStore(pub(crate) PathBuf);

impl ArtifactStore for DirStore {
    fn store(
        &self,
        file: &mut std::fs::File,
        _max_bytes: u64,
        _mime: &str,
    ) -> std::io::Result<StoredArtifact> {
        let mut content = Vec::new();
        std::io::Read::read_to_end(file, &mut content)?;
        let hex = format!("{:x}", sha2::Sha256::digest(&content));
        std::fs::write(self.0.join(&hex), &content)?;
        Ok(StoredArtifact {
            hex,
            size: content.len() as u64,
        })
    }

    fn path(&self, hex: &str) -> Option<PathBuf> {
        Some(self.0.join(hex)).filter(|p| p.exists())
    }
}

/// Uploads that succeed with `artifact://backend/<hash>`, counted; no other call succeeds. Endpoints are checked
/// as the daemon's are: only `http://` ones.
#[derive(Default)]
pub(crate) struct FakeUploads(pub(crate) AtomicUsize);

impl Uploads for FakeUploads {
    fn check_endpoint(&self, url: &str) -> Result<(), BoxError> {
        match url.starts_with("http://") {
            true => Ok(()),
            false => Err("The URL must start with http://".into()),
        }
    }

    fn post_json<'a>(
        &'a self,
        _url: &'a str,
        _token: &'a str,
        _body: String,
    ) -> BoxFuture<'a, Result<Value, HttpFailure>> {
        Box::pin(async {
            Err(HttpFailure {
                unauthorized: false,
                error: "no backend in these tests".into(),
            })
        })
    }

    fn upload<'a>(&'a self, upload: Upload<'a>) -> BoxFuture<'a, Result<String, HttpFailure>> {
        self.0.fetch_add(1, Ordering::SeqCst);
        let uri = format!("artifact://backend/{}", upload.hex);
        Box::pin(async move { Ok(uri) })
    }
}

/// The bearer token the routes accept (`None`: none).
pub(crate) struct Bearer(pub(crate) Option<&'static str>);

impl Authorizer for Bearer {
    fn authorized(&self, headers: &axum::http::HeaderMap) -> bool {
        let given = headers.get("authorization").and_then(|v| v.to_str().ok());
        self.0
            .is_some_and(|t| given == Some(&format!("Bearer {t}")))
    }
}

//! What agent sandboxes need from the daemon that hosts them, as narrow traits the daemon implements: containers
//! of the long-lived kind on a named image ([`Containers`]), the artifact store ([`ArtifactStore`]), the HTTP calls
//! to the agent's backend ([`Uploads`]), the bearer-token check ([`Authorizer`]) and, when the operator enabled
//! it, the egress proxy's settings ([`Network`]). Together with [`Settings`] (configuration values) they make a
//! [`Host`]. Nothing here knows the daemon's engine, pool or server.

use std::collections::BTreeMap;
use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use axum::http::HeaderMap;
use egress::{Allowlist, AllowlistError, Proxy};
use serde_json::Value;

use crate::config::AgentsConfig;
use containers::agent::{BoxFuture, InitIdentity, Workspace};

/// Any error, boxed (from the daemon's side of a trait).
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// What an agent sandbox's workspace is created for.
#[derive(Debug, Clone, Copy)]
pub struct WorkspaceRequest<'a> {
    /// Its id (the directory's name under `parent`).
    pub id: &'a str,
    /// The directory it is created in (`<state_dir>/agents`).
    pub parent: &'a Path,
    /// The image its runs start on (a name [`Containers::image_environment`] knows).
    pub image: &'a str,
    /// Size of `/workspace` and `/tmp`, MiB.
    pub disk_mb: u64,
    /// A snapshot's layer (files owned by 0) that `/workspace` starts from, as an overlay's lower layer: nothing
    /// copied, shown as owned by the sandbox's root.
    pub snapshot: Option<&'a Path>,
    /// A workspace of the copy-on-write store ([`crate::cow::CowStore::create`]) that is `/workspace` (not with
    /// `snapshot`).
    pub subvolume: Option<&'a Path>,
    /// A snapshot's root layer (files owned by 0 or by nobody) that the root's upper layer starts as a copy of,
    /// the files it owns shown as owned by the sandbox's root. Only on the image the snapshot was taken on.
    pub root_layer: Option<&'a Path>,
}

/// A workspace could not be created.
#[derive(Debug, thiserror::Error)]
pub enum WorkspaceError {
    /// Every host uid for sandboxes is taken (`agents.max_sandboxes`); retry later.
    #[error("{0} agent sandboxes exist, the maximum (agents.max_sandboxes)")]
    Full(usize),
    /// No such image.
    #[error("No image {0:?}")]
    NoImage(String),
    /// The container layer failed; nothing of the workspace is left.
    #[error("Cannot prepare the sandbox")]
    Failed(#[source] BoxError),
}

/// Containers of the long-lived kind, and the images they start on.
pub trait Containers: Send + Sync + 'static {
    /// The environment every program on image `image` starts with (sandboxd's base, then the image's), or `None`
    /// when the daemon has no such image.
    fn image_environment(&self, image: &str) -> Option<BTreeMap<String, String>>;

    /// Creates a workspace (with a host uid of its own, given back at its removal).
    fn create_workspace<'a>(
        &'a self,
        req: WorkspaceRequest<'a>,
    ) -> BoxFuture<'a, Result<Arc<dyn Workspace>, WorkspaceError>>;

    /// Takes back the workspace a previous daemon left mounted (live restore), with the host uid it had.
    fn adopt_workspace<'a>(
        &'a self,
        req: WorkspaceRequest<'a>,
        host_id: u32,
    ) -> BoxFuture<'a, Result<Arc<dyn Workspace>, WorkspaceError>> {
        let _ = (req, host_id);
        Box::pin(async {
            Err(WorkspaceError::Failed(
                "workspaces cannot be adopted here".into(),
            ))
        })
    }

    /// Ends a kept run of a previous daemon that is not taken back (its sandbox is not, or its workspace cannot
    /// be): its init is killed if it is still the recorded process, and what holds its container (a frozen cgroup
    /// included) is removed, so nothing of it lingers. Without a backend of its own, the init alone is killed.
    fn end_kept_run<'a>(&'a self, cid: &'a str, init: InitIdentity) -> BoxFuture<'a, ()> {
        let _ = cid;
        Box::pin(async move { crate::restore::kill_init(init) })
    }
}

/// An artifact in the store.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredArtifact {
    /// Lowercase hex sha256.
    pub hex: String,
    /// Size in bytes.
    pub size: u64,
}

/// The daemon's content-addressed artifact store.
pub trait ArtifactStore: Send + Sync + 'static {
    /// Stores the rest of `file` (at most `max_bytes`) with content type `mime` (blocking work).
    fn store(
        &self,
        file: &mut std::fs::File,
        max_bytes: u64,
        mime: &str,
    ) -> std::io::Result<StoredArtifact>;

    /// Where stored content `hex` is, if it is there.
    fn path(&self, hex: &str) -> Option<PathBuf>;
}

/// An HTTP call to the backend failed.
#[derive(Debug)]
pub struct HttpFailure {
    /// The backend refused the token (`401`).
    pub unauthorized: bool,
    /// Why.
    pub error: BoxError,
}

impl fmt::Display for HttpFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.error.fmt(f)
    }
}

impl std::error::Error for HttpFailure {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.error.source()
    }
}

/// One upload of stored content.
#[derive(Debug, Clone, Copy)]
pub struct Upload<'a> {
    /// The endpoint.
    pub url: &'a str,
    /// Bearer token.
    pub token: &'a str,
    /// Attempts (first try included).
    pub attempts: u32,
    /// The stored content.
    pub blob: &'a Path,
    /// Its sha256, hex.
    pub hex: &'a str,
    /// Its content type.
    pub mime: &'a str,
}

/// The HTTP calls sandboxd makes to an agent's backend.
pub trait Uploads: Send + Sync + 'static {
    /// Whether `url` can be posted to (plain `http://` with a host).
    fn check_endpoint(&self, url: &str) -> Result<(), BoxError>;

    /// A JSON `POST` with a bearer token: the JSON answer.
    fn post_json<'a>(
        &'a self,
        url: &'a str,
        token: &'a str,
        body: String,
    ) -> BoxFuture<'a, Result<Value, HttpFailure>>;

    /// Uploads stored content with retries: the `backendUri` of the answer.
    fn upload<'a>(&'a self, upload: Upload<'a>) -> BoxFuture<'a, Result<String, HttpFailure>>;
}

/// The daemon's bearer-token check.
pub trait Authorizer: Send + Sync + 'static {
    /// True if the request carries an accepted token.
    fn authorized(&self, headers: &HeaderMap) -> bool;
}

/// The daemon's `network` extension: the operator's bound and limits, and the proxies built under them. A
/// sandbox created with `network` gets one [`Proxy`] for its whole life, served inside each run's container at
/// [`Network::address`].
pub trait Network: Send + Sync + 'static {
    /// `allow` as an allowlist, each entry within the operator's bound (`network.allow_max`).
    fn allowlist(&self, allow: &[String]) -> Result<Allowlist, AllowlistError>;

    /// The byte limit for a sandbox that asked for `asked` (`None`: the daemon's maximum); `Err(maximum)` when
    /// `asked` is above it.
    fn egress_bytes(&self, asked: Option<u64>) -> Result<u64, u64>;

    /// A proxy with `allowlist` and a limit of `egress_bytes` (serving nothing yet), kept in `ledger` when given
    /// (live restore: the limit outlives the daemon).
    fn proxy(
        &self,
        allowlist: Allowlist,
        egress_bytes: u64,
        ledger: Option<egress::Ledger>,
    ) -> Proxy;

    /// Where the proxy listens inside each container.
    fn address(&self) -> SocketAddr;

    /// The environment that points a program's HTTP clients at the proxy (`HTTP_PROXY` and its relatives).
    fn environment(&self) -> Vec<(String, String)>;
}

/// Configuration values agent sandboxes use.
#[derive(Debug, Clone)]
pub struct Settings {
    /// `agents:`.
    pub agents: AgentsConfig,
    /// Where sandboxes live: `<state_dir>/agents`.
    pub state_dir: PathBuf,
    /// Largest artifact file.
    pub max_artifact_bytes: u64,
    /// The daemon's listen address (endpoint URLs when a request has no `Host`).
    pub listen: SocketAddr,
}

/// Everything agent sandboxes use of the daemon.
#[derive(Clone)]
pub struct Host {
    /// Configuration values.
    pub settings: Arc<Settings>,
    /// Containers and images.
    pub containers: Arc<dyn Containers>,
    /// The artifact store.
    pub store: Arc<dyn ArtifactStore>,
    /// Backend calls.
    pub uploads: Arc<dyn Uploads>,
    /// Bearer tokens.
    pub auth: Arc<dyn Authorizer>,
    /// The egress proxy (`None`: the `network` extension is off, and a request with `network` is refused).
    pub network: Option<Arc<dyn Network>>,
    /// Volumes' filesystems (`None`: no volumes; the endpoints and volume mounts are refused).
    pub disks: Option<Arc<dyn crate::volumes::Disks>>,
    /// Whether workspaces can start from snapshots on this host (idmapped overlay layers under
    /// `<state_dir>/snapshots`); the reason when not (the snapshot routes and `fromSnapshot` are refused).
    pub snapshots: Result<(), String>,
    /// The copy-on-write store of workspaces (`None`: workspaces are tmpfs, snapshots copies).
    pub cow: Option<Arc<dyn crate::cow::CowStore>>,
}

//! What the daemon gives agent sandboxes (the `agents` crate): its [`agents::host`] traits implemented over the
//! daemon's parts. Containers come from the pool's factory (the container seam's long-lived kind) with a host uid
//! of their own from the range after the executions' (`uid_base + uid_count()`, `agents.max_sandboxes` of them);
//! images are the languages' images by name; artifacts go to the store; backend calls go through [`crate::storage::upload`];
//! tokens are checked by [`crate::auth`]; the egress proxy's settings are the `network` extension's
//! ([`crate::extensions::egress`]), when it is on. This is the one place that reads the engine for agent sandboxes.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use agents::host::{
    ArtifactStore, Authorizer, BoxError, Containers, Host, HttpFailure, Network, Settings,
    StoredArtifact, Upload, Uploads, WorkspaceError, WorkspaceRequest,
};
use axum::http::HeaderMap;
use containers::agent::{
    AdoptedRun, BoxFuture, InitIdentity, LongLivedError, RunContainer, RunPlan, Workspace,
};
use hyper::body::Bytes;
use runtime::rootfs::InputFile;
use serde_json::Value;

use crate::exec::engine::Engine;
use crate::exec::pool::{Factory, Uids};
use crate::extensions::egress::Egress;
use crate::storage::store::Store;
use crate::storage::upload::{UploadConfig, UploadError};
use containers::image::RootImage;
use containers::WorkspacePlan;

/// The host of the daemon's agent sandboxes. A workspace store that is configured and cannot be opened is the
/// error (fail closed: its quotas are the sandboxes' disk limits).
pub fn host(engine: &Arc<Engine>) -> anyhow::Result<Host> {
    let cfg = engine.daemon().config();
    let cow = match cfg.agents.workspace_store {
        agents::config::WorkspaceStore::Tmpfs => None,
        agents::config::WorkspaceStore::Btrfs => {
            let dir = cfg.state_dir.join("workspaces");
            let store = crate::storage::cow::BtrfsStore::open(&dir, cfg.agents.workspace_store_mb)
                .map_err(|e| {
                    anyhow::anyhow!(
                        "agents.workspace_store: btrfs: cannot open the store in {}: {e}",
                        dir.display()
                    )
                })?;
            Some(Arc::new(store) as Arc<dyn agents::cow::CowStore>)
        }
    };
    let images = engine
        .languages()
        .values()
        .map(|l| (l.image.name.clone(), l.image.clone()))
        .collect();
    let range = cfg.agent_uids();
    let uids = Uids::new(range.start, range.end - range.start);
    Ok(Host {
        settings: Arc::new(Settings {
            agents: cfg.agents.clone(),
            state_dir: cfg.state_dir.clone(),
            max_artifact_bytes: cfg.artifacts.max_file_bytes,
            listen: cfg.listen,
        }),
        containers: Arc::new(AgentContainers::new(
            engine.pool().factory().clone(),
            images,
            uids,
        )),
        store: Arc::new(StoreArtifacts(engine.daemon().store().clone())),
        uploads: Arc::new(HttpUploads),
        auth: Arc::new(Tokens(Arc::new(cfg.auth.tokens.clone()))),
        network: engine
            .egress()
            .map(|e| Arc::new(EgressNetwork(e.clone())) as Arc<dyn Network>),
        disks: match crate::storage::volumes::Ext4Disks::probe() {
            Ok(d) => Some(Arc::new(d) as Arc<dyn agents::volumes::Disks>),
            Err(why) => {
                tracing::warn!(reason = %why, "no volumes on this host (POST /volumes: 422 capability_unsupported)");
                None
            }
        },
        snapshots: runtime::rootfs::probe_workspace_from(
            &cfg.state_dir.join("snapshots"),
            cfg.sandbox.uid_base,
        )
        .map_err(|e| {
            let why = runtime::error::Chain(&e).to_string();
            tracing::warn!(reason = %why, "no snapshots on this host (POST /sandboxes/<id>/snapshot: 422 capability_unsupported)");
            why
        }),
        cow,
    })
}

/// Workspaces through the factory, on the daemon's images, with host uids of their own.
pub struct AgentContainers {
    factory: Arc<Factory>,
    images: BTreeMap<String, Arc<RootImage>>,
    uids: Arc<Uids>,
    max: usize,
}

impl AgentContainers {
    /// Over `factory`, with `images` by name and `uids` for the workspaces.
    pub fn new(
        factory: Arc<Factory>,
        images: BTreeMap<String, Arc<RootImage>>,
        uids: Uids,
    ) -> Self {
        Self {
            factory,
            images,
            max: uids.available(),
            uids: Arc::new(uids),
        }
    }
}

impl Containers for AgentContainers {
    fn image_environment(&self, image: &str) -> Option<BTreeMap<String, String>> {
        self.images
            .get(image)
            .map(|i| containers::image::base_environment(i))
    }

    fn create_workspace<'a>(
        &'a self,
        req: WorkspaceRequest<'a>,
    ) -> BoxFuture<'a, Result<Arc<dyn Workspace>, WorkspaceError>> {
        Box::pin(async move {
            let host_id = self.uids.try_take().ok_or(WorkspaceError::Full(self.max))?;
            self.with_uid(req, host_id, false).await
        })
    }

    fn adopt_workspace<'a>(
        &'a self,
        req: WorkspaceRequest<'a>,
        host_id: u32,
    ) -> BoxFuture<'a, Result<Arc<dyn Workspace>, WorkspaceError>> {
        Box::pin(async move {
            if !self.uids.take_exact(host_id) {
                return Err(WorkspaceError::Failed(
                    format!("host uid {host_id} is not one for agent sandboxes, or is taken")
                        .into(),
                ));
            }
            self.with_uid(req, host_id, true).await
        })
    }

    fn end_kept_run<'a>(&'a self, cid: &'a str, init: InitIdentity) -> BoxFuture<'a, ()> {
        Box::pin(self.factory.end_kept_run(cid, init))
    }
}

impl AgentContainers {
    /// The workspace `req` asks for on host uid `host_id` (taken: given back on failure), created or `adopted`
    /// from a previous daemon.
    async fn with_uid(
        &self,
        req: WorkspaceRequest<'_>,
        host_id: u32,
        adopted: bool,
    ) -> Result<Arc<dyn Workspace>, WorkspaceError> {
        let Some(image) = self.images.get(req.image) else {
            self.uids.give_back(host_id);
            return Err(WorkspaceError::NoImage(req.image.to_owned()));
        };
        let plan = WorkspacePlan {
            id: req.id,
            parent: req.parent,
            host_id,
            image,
            disk_mb: req.disk_mb,
            snapshot: req.snapshot,
            subvolume: req.subvolume,
            root_layer: req.root_layer,
        };
        let made = match adopted {
            true => self.factory.adopt_workspace(plan).await,
            false => self.factory.create_workspace(plan).await,
        };
        match made {
            Ok(inner) => Ok(Arc::new(UidWorkspace {
                inner,
                uid: Mutex::new(Some(host_id)),
                uids: self.uids.clone(),
            }) as Arc<dyn Workspace>),
            Err(e) => {
                self.uids.give_back(host_id);
                Err(WorkspaceError::Failed(Box::new(e)))
            }
        }
    }
}

/// A workspace that gives its host uid back once it is removed.
struct UidWorkspace {
    inner: Arc<dyn Workspace>,
    /// `None` once given back.
    uid: Mutex<Option<u32>>,
    uids: Arc<Uids>,
}

impl Workspace for UidWorkspace {
    fn dir(&self) -> &Path {
        self.inner.dir()
    }

    fn workspace(&self) -> PathBuf {
        self.inner.workspace()
    }

    fn host_id(&self) -> u32 {
        self.inner.host_id()
    }

    fn host_workspace(&self) -> (PathBuf, u32) {
        self.inner.host_workspace()
    }

    fn root_upper(&self) -> Option<PathBuf> {
        self.inner.root_upper()
    }

    fn write_inputs(&self, name: &str, content: &[u8], files: &[InputFile]) -> runtime::Result<()> {
        self.inner.write_inputs(name, content, files)
    }

    fn create_run<'a>(
        &'a self,
        plan: RunPlan<'a>,
    ) -> BoxFuture<'a, Result<Arc<dyn RunContainer>, LongLivedError>> {
        self.inner.create_run(plan)
    }

    fn adopt_run<'a>(
        &'a self,
        cid: &'a str,
        init: InitIdentity,
    ) -> BoxFuture<'a, Result<AdoptedRun, LongLivedError>> {
        self.inner.adopt_run(cid, init)
    }

    fn adopt_serving_run<'a>(
        &'a self,
        cid: &'a str,
        init: InitIdentity,
    ) -> BoxFuture<'a, Result<containers::agent::AdoptedServingRun, LongLivedError>> {
        self.inner.adopt_serving_run(cid, init)
    }

    fn leave(&self) {
        self.inner.leave();
    }

    fn remove(&self) -> BoxFuture<'_, ()> {
        Box::pin(async move {
            self.inner.remove().await;
            let uid = self.uid.lock().unwrap_or_else(|p| p.into_inner()).take();
            if let Some(uid) = uid {
                self.uids.give_back(uid);
            }
        })
    }
}

/// The artifact store.
pub struct StoreArtifacts(pub Arc<Store>);

impl ArtifactStore for StoreArtifacts {
    fn store(
        &self,
        file: &mut std::fs::File,
        max_bytes: u64,
        mime: &str,
    ) -> std::io::Result<StoredArtifact> {
        let _w = self.0.writing();
        let mime = mime.to_owned();
        let staged = self.0.stage(file, max_bytes, |_| mime)?;
        let stored = self.0.commit(vec![staged])?.pop().ok_or_else(|| {
            std::io::Error::new(std::io::ErrorKind::NotFound, "nothing was committed")
        })?;
        Ok(StoredArtifact {
            hex: stored.hex,
            size: stored.size,
        })
    }

    fn path(&self, hex: &str) -> Option<PathBuf> {
        self.0.blob(hex)
    }
}

/// Backend calls over plain HTTP ([`crate::storage::upload`]).
pub struct HttpUploads;

impl Uploads for HttpUploads {
    fn check_endpoint(&self, url: &str) -> Result<(), BoxError> {
        let cfg = UploadConfig {
            url: url.to_owned(),
            token: String::new(),
            attempts: 1,
            backoff_ms: 1,
        };
        cfg.validate().map_err(|e| Box::new(e) as BoxError)
    }

    fn post_json<'a>(
        &'a self,
        url: &'a str,
        token: &'a str,
        body: String,
    ) -> BoxFuture<'a, Result<Value, HttpFailure>> {
        Box::pin(async move {
            let headers = [("content-type", "application/json".to_owned())];
            crate::storage::upload::post_json(url, token, &headers, Bytes::from(body))
                .await
                .map_err(|e| HttpFailure {
                    unauthorized: e.is_unauthorized(),
                    error: Box::new(e),
                })
        })
    }

    fn upload<'a>(&'a self, upload: Upload<'a>) -> BoxFuture<'a, Result<String, HttpFailure>> {
        Box::pin(async move {
            let cfg = UploadConfig {
                url: upload.url.to_owned(),
                token: upload.token.to_owned(),
                attempts: upload.attempts,
                backoff_ms: 100,
            };
            crate::storage::upload::upload(&cfg, upload.blob, upload.hex, upload.mime)
                .await
                .map_err(|e: UploadError| HttpFailure {
                    unauthorized: e.is_unauthorized(),
                    error: Box::new(e),
                })
        })
    }
}

/// The `network` extension's settings: the same bound, limits, address policy and resolver as executions'.
pub struct EgressNetwork(pub Arc<Egress>);

impl Network for EgressNetwork {
    fn allowlist(&self, allow: &[String]) -> Result<egress::Allowlist, egress::AllowlistError> {
        self.0.allowlist(allow)
    }

    fn egress_bytes(&self, asked: Option<u64>) -> Result<u64, u64> {
        self.0.egress_bytes(asked)
    }

    fn proxy(
        &self,
        allowlist: egress::Allowlist,
        egress_bytes: u64,
        ledger: Option<egress::Ledger>,
    ) -> egress::Proxy {
        self.0.proxy(allowlist, egress_bytes, ledger)
    }

    fn address(&self) -> SocketAddr {
        crate::extensions::egress::PROXY_ADDRESS
    }

    fn environment(&self) -> Vec<(String, String)> {
        crate::extensions::egress::proxy_env()
    }
}

/// The daemon's bearer tokens.
pub struct Tokens(pub Arc<Vec<String>>);

impl Authorizer for Tokens {
    fn authorized(&self, headers: &HeaderMap) -> bool {
        crate::auth::authorized(headers, &self.0)
    }
}

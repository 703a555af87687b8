//! The registry of a daemon's agent sandboxes: provisioning (`POST /sandboxes`: the request checked, its egress
//! proxy made when it asks for `network`, a workspace created, the agent's manifest and template files written), lookup, removal, and at start the removal of what a
//! previous daemon left under `<state_dir>/agents`.

use std::collections::HashMap;
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use agent_api::{AgentTemplate, CreateSandboxRequest, PluginError, SandboxCapability};
use runtime::error::Chain;
use runtime::rootfs::InputFile;
use tracing::{info, warn};

use crate::backend::Backend;
use crate::events::{Budgets, Hub};
use crate::host::{Host, WorkspaceError, WorkspaceRequest};
use crate::network::SandboxEgress;
use crate::sandbox::{Limits, Sandbox, CONTROL_SOCKET};
use crate::snapshots::{SnapshotError, Snapshots};
use crate::volumes::{Mounted, Volumes};
use containers::agent::Workspace;

/// A refused `POST /sandboxes`: its HTTP status and body.
#[derive(Debug)]
pub struct Refusal {
    /// HTTP status.
    pub status: u16,
    /// The body.
    pub error: PluginError,
}

impl From<PluginError> for Refusal {
    /// A request found invalid is 400; any other refusal has its own status.
    fn from(error: PluginError) -> Self {
        let status = match error {
            PluginError::InvalidState { .. } => 400,
            _ => error.status(),
        };
        Self { status, error }
    }
}

/// Capabilities a sandbox may ask for: a shell and git come with the image; the network is loopback-only, and
/// sandbox-to-backend traffic (uploads, renewal) is made by sandboxd itself.
const SUPPORTED: &[SandboxCapability] = &[
    SandboxCapability::Terminal,
    SandboxCapability::Git,
    SandboxCapability::NetworkInternalOnly,
];

/// Every agent sandbox of the daemon.
pub struct Agents {
    host: Host,
    dir: PathBuf,
    sandboxes: Mutex<HashMap<String, Arc<Sandbox>>>,
    volumes: Option<Arc<Volumes>>,
    /// `Err`: why this host has none.
    snapshots: Result<Arc<Snapshots>, String>,
    nonce: String,
    seq: AtomicU64,
}

impl Agents {
    /// The registry, with `<state_dir>/agents` emptied of a previous daemon's leftovers (with live restore, what
    /// a previous daemon recorded stays for [`Self::restore`]).
    pub fn new(host: Host) -> std::io::Result<Arc<Self>> {
        let dir = host.settings.state_dir.join("agents");
        if !host.settings.agents.live_restore {
            remove_leftovers(&dir)?;
        }
        match std::fs::DirBuilder::new().mode(0o711).create(&dir) {
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            made => made?,
        }
        let settings = &host.settings;
        // The volume mounts of the sandboxes a previous daemon left, which `restore` takes back.
        let held = match settings.agents.live_restore {
            true => crate::restore::held_volumes(&dir),
            false => Vec::new(),
        };
        let volumes = host
            .disks
            .clone()
            .map(|disks| {
                Volumes::open(
                    settings.state_dir.join("volumes"),
                    disks,
                    (settings.agents.volume_max_mb, settings.agents.max_volumes),
                    &held,
                )
            })
            .transpose()?;
        let snapshots = match &host.snapshots {
            Ok(()) => Ok(Snapshots::open(
                settings.state_dir.join("snapshots"),
                settings.agents.max_snapshots,
                host.cow.clone(),
            )?),
            Err(why) => Err(why.clone()),
        };
        Ok(Arc::new(Self {
            host,
            dir,
            sandboxes: Mutex::new(HashMap::new()),
            volumes,
            snapshots,
            nonce: format!("{:08x}", rand::random::<u32>()),
            seq: AtomicU64::new(0),
        }))
    }

    fn map(&self) -> std::sync::MutexGuard<'_, HashMap<String, Arc<Sandbox>>> {
        self.sandboxes.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A sandbox by id.
    pub fn get(&self, id: &str) -> Option<Arc<Sandbox>> {
        self.map().get(id).cloned()
    }

    /// What the daemon provides.
    pub fn host(&self) -> &Host {
        &self.host
    }

    /// The volumes, when the host has them.
    pub fn volumes(&self) -> Option<&Arc<Volumes>> {
        self.volumes.as_ref()
    }

    /// The snapshots, or [`SnapshotError::Unsupported`] with why this host has none.
    pub fn snapshots(&self) -> Result<&Arc<Snapshots>, SnapshotError> {
        self.snapshots
            .as_ref()
            .map_err(|why| SnapshotError::Unsupported(why.clone()))
    }

    /// `POST /sandboxes/<id>/snapshot`: `None` if there is no such sandbox.
    pub async fn snapshot(
        &self,
        id: &str,
    ) -> Option<Result<agent_api::Snapshot, crate::snapshots::SnapshotError>> {
        self.snapshot_as(id, false).await
    }

    /// [`Self::snapshot`]; with `later`, the digest of a snapshot in the copy-on-write store is computed after
    /// the return ([`Snapshots::finish`]).
    async fn snapshot_as(
        &self,
        id: &str,
        later: bool,
    ) -> Option<Result<agent_api::Snapshot, crate::snapshots::SnapshotError>> {
        let sb = self.get(id)?;
        let store = match self.snapshots() {
            Ok(s) => s,
            Err(e) => return Some(Err(e)),
        };
        Some(
            sb.snapshot(store, self.host.settings.agents.disk_mb << 20, later)
                .await,
        )
    }

    /// `POST /sandboxes/<id>/fork`: a snapshot of sandbox `id` and a sandbox created from it with `req` (which
    /// must not name a snapshot of its own). When the creation is refused, the snapshot is deleted again.
    pub async fn fork(
        &self,
        id: &str,
        mut req: CreateSandboxRequest,
    ) -> Result<(agent_api::Snapshot, Arc<Sandbox>), Refusal> {
        if req.from_snapshot.is_some() {
            return Err(PluginError::invalid(
                "fromSnapshot: a fork starts from the snapshot it takes; leave it out",
            )
            .into());
        }
        let snapshot = match self.snapshot_as(id, true).await {
            None => {
                return Err(Refusal {
                    status: 404,
                    error: PluginError::invalid("No such sandbox"),
                })
            }
            Some(Err(e)) => {
                let (status, error) = e.plugin();
                return Err(Refusal { status, error });
            }
            Some(Ok(s)) => s,
        };
        req.from_snapshot = Some(snapshot.id.clone());
        let store = self.snapshots().map_err(|e| {
            let (status, error) = e.plugin();
            Refusal { status, error }
        })?;
        match self.create(req).await {
            Ok(sb) => Ok((store.get(&snapshot.id).unwrap_or(snapshot), sb)),
            Err(r) => {
                if let Err(e) = store.delete(&snapshot.id).await {
                    warn!(snapshot = %snapshot.id, error = %e, "cannot delete the snapshot of a refused fork");
                }
                Err(r)
            }
        }
    }

    fn resolve_limits(&self, req: &CreateSandboxRequest) -> Result<Limits, PluginError> {
        let max = &self.host.settings.agents;
        let asked = req
            .workspace_requirements
            .resource_limits
            .unwrap_or_default();
        let over = |field: &str, v: String, m: String| {
            PluginError::invalid(format!(
                "workspaceRequirements.resourceLimits.{field} {v} is over this daemon's maximum {m}"
            ))
        };
        let cpu_cores = asked.cpu_cores.unwrap_or(max.cpu_cores);
        if !(cpu_cores.is_finite() && cpu_cores >= 0.01) {
            return Err(PluginError::invalid(
                "workspaceRequirements.resourceLimits.cpuCores must be at least 0.01",
            ));
        }
        if cpu_cores > max.cpu_cores {
            return Err(over(
                "cpuCores",
                cpu_cores.to_string(),
                max.cpu_cores.to_string(),
            ));
        }
        let pick = |field: &str, v: Option<u64>, m: u64| match v {
            Some(0) => Err(PluginError::invalid(format!(
                "workspaceRequirements.resourceLimits.{field} must be at least 1"
            ))),
            Some(v) if v > m => Err(over(field, v.to_string(), m.to_string())),
            Some(v) => Ok(v),
            None => Ok(m),
        };
        Ok(Limits {
            cpu_cores,
            memory_mb: pick("memoryMb", asked.memory_mb, max.memory_mb)?,
            disk_mb: pick("diskMb", asked.disk_mb, max.disk_mb)?,
            timeout_ms: pick("timeoutMs", asked.timeout_ms, max.timeout_ms)?,
        })
    }

    /// `POST /sandboxes`.
    #[tracing::instrument(name = "agent_create", skip_all, fields(sandbox = tracing::field::Empty))]
    pub async fn create(&self, req: CreateSandboxRequest) -> Result<Arc<Sandbox>, Refusal> {
        let (limits, image, template, files) = self.admit(&req)?;
        // A volume's mount point is made by the daemon through the workspace's paths, which in a snapshot are the
        // agent's (a directory there may be a link out of it): not both.
        if req.from_snapshot.is_some() && !req.workspace_requirements.mounts.is_empty() {
            return Err(PluginError::invalid(
                "workspaceRequirements.mounts: not with fromSnapshot (a snapshot's paths are an earlier agent's)",
            )
            .into());
        }
        let names: Vec<&str> = files.iter().map(|f| f.path.as_str()).collect();
        let mounts = crate::volumes::plan(
            &req.workspace_requirements.mounts,
            self.volumes.is_some(),
            &names,
        )?;
        let id = format!(
            "ags-{}-{}",
            self.nonce,
            self.seq.fetch_add(1, Ordering::Relaxed)
        );
        // With live restore the egress is kept in the sandbox's directory for the next daemon.
        let keep = self
            .host
            .settings
            .agents
            .live_restore
            .then(|| self.dir.join(&id));
        let network = req
            .network
            .as_ref()
            .map(|n| SandboxEgress::create(self.host.network.as_ref(), n, keep.as_deref()))
            .transpose()
            .map_err(|e| PluginError::invalid(e.to_string()))?;
        tracing::Span::current().record("sandbox", id.as_str());
        let refusal = |e: SnapshotError| {
            let (status, error) = e.plugin();
            Refusal { status, error }
        };
        // A snapshot's root layer is copied into the new root's upper layer, on the snapshot's image only; the
        // snapshot is held until then.
        let (root_layer, _copying) = match &req.from_snapshot {
            Some(snapshot) => self
                .snapshots()
                .and_then(|s| s.root_layer(snapshot, (&id, &image), limits.disk_mb << 20))
                .map_err(refusal)?
                .unzip(),
            None => (None, None),
        };
        // With the copy-on-write store, a workspace of its own (a writable copy of a snapshot there); else a tmpfs,
        // with a snapshot's layer under it.
        let cow_from = match (&req.from_snapshot, &self.host.cow) {
            (Some(snapshot), Some(_)) => self
                .snapshots()
                .and_then(|s| s.cow_source(snapshot, limits.disk_mb << 20))
                .map_err(refusal)?
                .map(Some),
            (None, Some(_)) => Some(None),
            (_, None) => None,
        };
        let layer = match (&req.from_snapshot, &cow_from) {
            (Some(snapshot), None) => Some(
                self.snapshots()
                    .and_then(|s| s.acquire(snapshot, &id))
                    .map_err(refusal)?,
            ),
            _ => None,
        };
        let subvolume = match cow_from {
            Some(from) => match self.make_subvolume(&id, limits.disk_mb, from).await {
                Ok(path) => Some(path),
                Err(e) => {
                    if let Ok(s) = &self.snapshots {
                        s.release(&id);
                    }
                    return Err(e.into());
                }
            },
            None => None,
        };
        let made = self
            .create_as(
                &id,
                req,
                (limits, image, template, files),
                (mounts, network),
                (layer, subvolume.clone(), root_layer),
            )
            .await;
        if made.is_err() {
            if let Ok(s) = &self.snapshots {
                s.release(&id);
            }
            if let Some(path) = subvolume {
                self.destroy_subvolume(&id, path).await;
            }
        }
        made
    }

    /// Makes sandbox `id`'s workspace in the copy-on-write store: empty, or a copy of the snapshot at `from`.
    async fn make_subvolume(
        &self,
        id: &str,
        disk_mb: u64,
        from: Option<PathBuf>,
    ) -> Result<PathBuf, PluginError> {
        let Some(cow) = self.host.cow.clone() else {
            return Err(PluginError::invalid("no workspace store"));
        };
        let id = id.to_owned();
        tokio::task::spawn_blocking(move || cow.create(&id, disk_mb << 20, from.as_deref()))
            .await
            .unwrap_or_else(|e| Err(e.to_string().into()))
            .map_err(|e| PluginError::ProviderUnavailable {
                message: format!("Cannot make the workspace in the workspace store: {e}"),
                retryable: false,
            })
    }

    /// Removes sandbox `id`'s workspace from the copy-on-write store (once its container no longer holds it);
    /// errors are logged.
    async fn destroy_subvolume(&self, id: &str, path: PathBuf) {
        let Some(cow) = self.host.cow.clone() else {
            return;
        };
        let destroyed = tokio::task::spawn_blocking(move || cow.destroy(&path))
            .await
            .unwrap_or_else(|e| Err(e.to_string().into()));
        if let Err(e) = destroyed {
            warn!(sandbox = %id, error = %e, "cannot remove the sandbox's workspace from the workspace store");
        }
    }

    /// Removes the copy-on-write store's workspaces that no sandbox of this daemon has (what an earlier daemon
    /// left).
    async fn sweep_subvolumes(&self) {
        let Some(cow) = self.host.cow.clone() else {
            return;
        };
        let live: std::collections::BTreeSet<String> = self.map().keys().cloned().collect();
        let _ = tokio::task::spawn_blocking(move || {
            for id in cow.list().0 {
                if live.contains(&id) {
                    continue;
                }
                warn!(sandbox = %id, "removing a workspace no sandbox has from the workspace store");
                if let Err(e) = cow.destroy(&cow.workspace(&id)) {
                    warn!(sandbox = %id, error = %e, "cannot remove a leftover workspace");
                }
            }
        })
        .await;
    }

    /// [`Self::create`] once its id is chosen and its snapshot (if any) acquired, or its workspace made in the
    /// copy-on-write store.
    async fn create_as(
        &self,
        id: &str,
        req: CreateSandboxRequest,
        (limits, image, template, files): (Limits, String, AgentTemplate, Vec<InputFile>),
        (mounts, network): (Vec<Mounted>, Option<SandboxEgress>),
        (layer, subvolume, root_layer): (
            Option<(PathBuf, String)>,
            Option<PathBuf>,
            Option<PathBuf>,
        ),
    ) -> Result<Arc<Sandbox>, Refusal> {
        let id = id.to_owned();
        let from_snapshot = req.from_snapshot.clone();
        let manifest = serde_json::json!({
            "sandboxId": id,
            "agentId": req.bootstrap.agent_id,
            "controlSocket": format!("{}/{}", runtime::rootfs::CODE_DIR, CONTROL_SOCKET),
        })
        .to_string();
        let (workspace, hub) = self
            .prepare(
                (&id, &req.bootstrap.agent_id),
                (
                    &image,
                    layer.as_ref().map(|(l, _)| l.as_path()),
                    subvolume.as_deref(),
                    root_layer.as_deref(),
                ),
                limits.disk_mb,
                manifest,
                files,
            )
            .await?;
        if let Some(Err(e)) = network.as_ref().map(SandboxEgress::save) {
            hub.close();
            workspace.remove().await;
            return Err(PluginError::ProviderUnavailable {
                message: format!("Cannot keep the sandbox's network for live restore: {e}"),
                retryable: true,
            }
            .into());
        }
        let mounts = match self.attach_volumes(&id, &workspace, mounts).await {
            Ok(m) => m,
            Err((e, attached)) => {
                hub.close();
                // The binds go with the workspace's tmpfs.
                workspace.remove().await;
                if let Some(volumes) = &self.volumes {
                    for m in attached {
                        volumes.release(&m.volume, &id, &m.path, m.read_only).await;
                    }
                }
                return Err(e);
            }
        };
        let agent_id = req.bootstrap.agent_id.clone();
        let settings = &self.host.settings;
        let backend = Backend::new(
            req.bootstrap,
            settings.agents.upload_attempts,
            self.host.uploads.clone(),
        );
        let sb = Sandbox::new(
            id.clone(),
            agent_id,
            limits,
            template,
            image,
            backend,
            hub,
            workspace,
            network,
            self.volumes.clone().map(|v| (v, mounts)),
            (from_snapshot, subvolume.is_some(), self.host.clone()),
        );
        sb.start_tasks();
        sb.persist();
        self.map().insert(id.clone(), sb.clone());
        info!(sandbox = %id, "agent sandbox created");
        Ok(sb)
    }

    /// Checks a creation request: bootstrap, capabilities, limits, image and template files (decoded).
    #[allow(clippy::type_complexity)]
    fn admit(
        &self,
        req: &CreateSandboxRequest,
    ) -> Result<(Limits, String, AgentTemplate, Vec<InputFile>), PluginError> {
        Backend::check(&req.bootstrap, &*self.host.uploads)
            .map_err(|e| PluginError::invalid(Chain(&e).to_string()))?;
        let wr = &req.workspace_requirements;
        if let Some(c) = wr.capabilities.iter().find(|c| !SUPPORTED.contains(c)) {
            return Err(PluginError::CapabilityUnsupported {
                capability: c.as_str().into(),
            });
        }
        let limits = self.resolve_limits(req)?;
        // A sandbox started from a snapshot runs on the snapshot's image unless told otherwise (an unknown snapshot
        // is refused when it is acquired).
        let from = req
            .from_snapshot
            .as_deref()
            .and_then(|s| self.snapshots().ok()?.get(s).ok())
            .map(|s| s.image);
        let image = wr
            .base_image
            .as_deref()
            .or(from.as_deref())
            .unwrap_or("host");
        if self.host.containers.image_environment(image).is_none() {
            return Err(PluginError::invalid(format!(
                "workspaceRequirements.baseImage {image:?} is not an image of this daemon (host or one a language runs on)",
            )));
        }
        let image = image.to_owned();
        let template = req.template.clone().unwrap_or_default();
        let mut files = Vec::with_capacity(template.files.len());
        for (i, f) in template.files.iter().enumerate() {
            protocol::validate_relative_path(&f.path)
                .map_err(|e| PluginError::invalid(format!("template.files: {}: {e}", f.path)))?;
            if template.files[..i].iter().any(|g| g.path == f.path) {
                return Err(PluginError::invalid(format!(
                    "template.files: {}: listed twice",
                    f.path
                )));
            }
            let content = f
                .decoded()
                .map_err(|e| PluginError::invalid(format!("template.files: {}: {e}", f.path)))?;
            files.push(InputFile {
                path: f.path.clone(),
                content,
            });
        }
        Ok((limits, image, template, files))
    }

    /// The sandbox's workspace (its tmpfs and root, a host uid of its own), its input files with `agent.json`, and
    /// its event hub (whose own warnings name the agent). On error nothing of it is left.
    async fn prepare(
        &self,
        (id, agent_id): (&str, &str),
        (image, snapshot, subvolume, root_layer): (
            &str,
            Option<&Path>,
            Option<&Path>,
            Option<&Path>,
        ),
        disk_mb: u64,
        manifest: String,
        files: Vec<InputFile>,
    ) -> Result<(Arc<dyn Workspace>, Arc<Hub>), PluginError> {
        let req = WorkspaceRequest {
            id,
            parent: &self.dir,
            image,
            disk_mb,
            snapshot,
            subvolume,
            root_layer,
        };
        let workspace = self
            .host
            .containers
            .create_workspace(req)
            .await
            .map_err(|e| match e {
                // Beyond max_sandboxes the caller retries later.
                WorkspaceError::Full(_) => PluginError::ProviderUnavailable {
                    message: e.to_string(),
                    retryable: true,
                },
                e => PluginError::ProviderUnavailable {
                    message: Chain(&e).to_string(),
                    retryable: false,
                },
            })?;
        let (ws, agent_id) = (workspace.clone(), agent_id.to_owned());
        let budgets = Budgets::from_config(&self.host.settings.agents);
        let made = tokio::task::spawn_blocking(move || -> runtime::Result<Arc<Hub>> {
            ws.write_inputs("agent.json", manifest.as_bytes(), &files)?;
            Hub::with_budgets(ws.dir().join("events"), &agent_id, budgets)
                .map_err(|e| runtime::Error::io(ws.dir(), e))
        })
        .await;
        let err = match made {
            Ok(Ok(hub)) => return Ok((workspace, hub)),
            Ok(Err(runtime::Error::InputFile { path, reason })) => {
                PluginError::invalid(format!("template.files: {path}: {reason}"))
            }
            Ok(Err(e)) => PluginError::ProviderUnavailable {
                message: format!("Cannot prepare the sandbox: {}", Chain(&e)),
                retryable: false,
            },
            Err(e) => PluginError::ProviderUnavailable {
                message: format!("Preparation failed: {e}"),
                retryable: false,
            },
        };
        workspace.remove().await;
        Err(err)
    }

    /// Mounts each planned volume at its place in the new workspace (the mount point made, owned by the
    /// sandbox); on failure, the refusal and the ones already mounted (released once the workspace is removed).
    async fn attach_volumes(
        &self,
        id: &str,
        workspace: &Arc<dyn Workspace>,
        mut mounts: Vec<Mounted>,
    ) -> Result<Vec<Mounted>, (Refusal, Vec<Mounted>)> {
        let Some(volumes) = &self.volumes else {
            return Ok(mounts);
        };
        let host_id = workspace.host_id();
        let (written, owner) = workspace.host_workspace();
        for i in 0..mounts.len() {
            // The mount point is made where the daemon writes, the volume bound where the sandbox sees it.
            let target = workspace.workspace().join(&mounts[i].rel);
            let t = written.join(&mounts[i].rel);
            let made = tokio::task::spawn_blocking(move || mount_point(&t, owner)).await;
            let attached = match made {
                Ok(Ok(())) => {
                    let m = &mounts[i];
                    volumes
                        .attach(&m.volume, id, (&target, &m.path), host_id, m.read_only)
                        .await
                        .map_err(|e| {
                            let (status, error) = e.plugin();
                            Refusal { status, error }
                        })
                }
                Ok(Err(e)) => Err(PluginError::ProviderUnavailable {
                    message: format!("Cannot make the mount point {}: {e}", mounts[i].path),
                    retryable: false,
                }
                .into()),
                Err(e) => Err(PluginError::ProviderUnavailable {
                    message: format!("Mount point creation failed: {e}"),
                    retryable: false,
                }
                .into()),
            };
            if let Err(e) = attached {
                mounts.truncate(i);
                return Err((e, mounts));
            }
        }
        Ok(mounts)
    }

    /// `DELETE /sandboxes/<id>`: `false` if there is no such sandbox.
    pub async fn delete(&self, id: &str) -> bool {
        self.remove(id, "deleted").await
    }

    async fn remove(&self, id: &str, reason: &str) -> bool {
        let Some(sb) = self.map().remove(id) else {
            return false;
        };
        sb.destroy(reason).await;
        // Its workspace (and the snapshot's layer under it) is unmounted now.
        if let Ok(s) = &self.snapshots {
            s.release(id);
        }
        if let (true, Some(cow)) = (sb.cow(), &self.host.cow) {
            self.destroy_subvolume(id, cow.workspace(id)).await;
        }
        info!(sandbox = %id, "agent sandbox removed");
        true
    }

    /// Takes back what a previous daemon recorded (live restore; nothing without it): each sandbox with its live
    /// run, or, when that cannot be, removed. Anything else under `<state_dir>/agents` is a leftover and removed.
    /// Returns what was done, one line per sandbox, for the log.
    pub async fn restore(&self) -> Vec<String> {
        let report = self.restore_recorded().await;
        self.sweep_subvolumes().await;
        report
    }

    /// [`Self::restore`] of every recorded sandbox.
    async fn restore_recorded(&self) -> Vec<String> {
        if !self.host.settings.agents.live_restore {
            return Vec::new();
        }
        let mut report = Vec::new();
        let recorded = crate::restore::recorded(&self.dir);
        for dir in &recorded {
            let name = dir
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default();
            match self.adopt(dir).await {
                Ok((sb, None)) => {
                    let status = serde_json::to_string(&sb.handle().status).unwrap_or_default();
                    report.push(format!("{name}: taken back ({})", status.trim_matches('"')))
                }
                Ok((_, Some(why))) => {
                    report.push(format!("{name}: taken back, its run ended: {why}"))
                }
                Err(why) => {
                    remove_leftover(dir);
                    report.push(format!("{name}: removed: {why}"));
                }
            }
        }
        if let Ok(entries) = std::fs::read_dir(&self.dir) {
            for e in entries.flatten() {
                if e.path().is_dir() && !recorded.contains(&e.path()) {
                    remove_leftover(&e.path());
                    report.push(format!(
                        "{}: removed: no record",
                        e.file_name().to_string_lossy()
                    ));
                }
            }
        }
        report
    }

    /// One recorded sandbox taken back: its workspace, snapshot use, event log, credentials and live run (`Some`
    /// with why when the run could not be taken back and ended as a crash).
    async fn adopt(&self, dir: &Path) -> Result<(Arc<Sandbox>, Option<String>), String> {
        let record = crate::restore::load(dir).map_err(|e| format!("unreadable record: {e}"))?;
        // Not taken back: its run is ended (its mounts, volume binds included, go with the leftover directory).
        let refused = if !crate::restore::adoptable(&record) {
            Some("an earlier daemon's record of its network or volume mounts is not taken back")
        } else if crate::restore::lost(dir) {
            Some("its mounts were not carried over from the previous daemon")
        } else if !record.volumes.is_empty() && self.volumes.is_none() {
            Some(match &self.host.disks {
                Some(_) => "its volumes cannot be opened by this daemon",
                None => "this daemon has no volumes (agents volumes are off on this host)",
            })
        } else if record.cow && self.host.cow.is_none() {
            Some("its workspace is in the btrfs workspace store, which is off on this daemon (agents.workspace_store)")
        } else {
            None
        };
        if let Some(why) = refused {
            if let Some(run) = &record.run {
                self.host.containers.end_kept_run(&run.cid, run.init).await;
            }
            return Err(why.into());
        }
        let adopted = self.adopt_held(dir, &record).await;
        if adopted.is_err() {
            // The volumes counted it as holding its mounts: they are given back, and the ones it wrote scanned as
            // a lost writer's.
            self.drop_volumes(&record).await;
        }
        adopted
    }

    /// [`Self::adopt`] of a sandbox whose mounts were carried over.
    async fn adopt_held(
        &self,
        dir: &Path,
        record: &crate::restore::Record,
    ) -> Result<(Arc<Sandbox>, Option<String>), String> {
        let subvolume = match (record.cow, &self.host.cow) {
            (true, Some(cow)) => Some(cow.workspace(&record.id)),
            _ => None,
        };
        let req = WorkspaceRequest {
            id: &record.id,
            parent: &self.dir,
            image: &record.image,
            disk_mb: record.disk_mb,
            snapshot: None,
            subvolume: subvolume.as_deref(),
            root_layer: None,
        };
        let workspace = match self
            .host
            .containers
            .adopt_workspace(req, record.host_id)
            .await
        {
            Ok(w) => w,
            Err(e) => {
                if let Some(run) = &record.run {
                    self.host.containers.end_kept_run(&run.cid, run.init).await;
                }
                return Err(format!("its workspace cannot be taken back: {}", Chain(&e)));
            }
        };
        let refuse = |why: String| async {
            if let Some(run) = &record.run {
                if let Ok((c, _)) = workspace.adopt_run(&run.cid, run.init).await {
                    c.remove().await;
                } else {
                    self.host.containers.end_kept_run(&run.cid, run.init).await;
                }
            }
            workspace.remove().await;
            // Its snapshot, if it was acquired (given back once its workspace is unmounted).
            if let Ok(s) = &self.snapshots {
                s.release(&record.id);
            }
            Err(why)
        };
        // Its quota as its record says, whatever happened to the store meanwhile.
        if let (Some(subvolume), Some(cow)) = (&subvolume, &self.host.cow) {
            let (cow, id, bytes) = (cow.clone(), record.id.clone(), record.disk_mb << 20);
            let set = tokio::task::spawn_blocking(move || cow.set_limit(&id, bytes))
                .await
                .unwrap_or_else(|e| Err(e.to_string().into()));
            if let Err(e) = set {
                return refuse(format!("its quota in {}: {e}", subvolume.display())).await;
            }
        }
        // A workspace in the copy-on-write store holds nothing of its snapshot.
        if let (Some(snapshot), false) = (&record.from_snapshot, record.cow) {
            let acquired = self
                .snapshots()
                .and_then(|s| s.acquire(snapshot, &record.id));
            if let Err(e) = acquired {
                return refuse(format!("its snapshot {snapshot}: {e}")).await;
            }
        }
        let budgets = Budgets::from_config(&self.host.settings.agents);
        let hub = match Hub::reopen(dir.join("events"), &record.agent_id, budgets) {
            Ok(h) => h,
            Err(e) => {
                return refuse(format!("its event log: {e}")).await;
            }
        };
        let backend = Backend::new(
            record.bootstrap.clone(),
            self.host.settings.agents.upload_attempts,
            self.host.uploads.clone(),
        );
        let network = match record.network {
            true => match SandboxEgress::restore(self.host.network.as_ref(), dir) {
                Ok(n) => Some(n),
                Err(e) => {
                    hub.close();
                    return refuse(format!("its network: {e}")).await;
                }
            },
            false => None,
        };
        let volumes = self.volumes.clone().map(|v| (v, record.volumes.clone()));
        let sb = Sandbox::restore(
            record,
            (backend, hub),
            workspace,
            (network, volumes),
            self.host.clone(),
        );
        let ended = match record.run.clone() {
            Some(run) => sb.adopt_run(run).await.err(),
            None => None,
        };
        sb.start_tasks();
        sb.persist();
        self.map().insert(record.id.clone(), sb.clone());
        info!(sandbox = %record.id, "agent sandbox taken back from a previous daemon");
        Ok((sb, ended))
    }

    /// The volume mounts of a recorded sandbox that could not be taken back ([`Volumes::drop_held`]).
    async fn drop_volumes(&self, record: &crate::restore::Record) {
        let Some(volumes) = &self.volumes else {
            return;
        };
        for m in &record.volumes {
            volumes.drop_held(&record.id, m).await;
        }
    }

    /// Daemon shutdown: removes every sandbox, or with live restore leaves them running for the next daemon (their
    /// records written).
    pub async fn shutdown(&self) {
        if self.host.settings.agents.live_restore {
            let sandboxes: Vec<Arc<Sandbox>> = self.map().values().cloned().collect();
            for sb in &sandboxes {
                sb.leave();
            }
            info!(
                count = sandboxes.len(),
                "agent sandboxes left running for the next daemon (agents.live_restore)"
            );
            return;
        }
        let ids: Vec<String> = self.map().keys().cloned().collect();
        for id in ids {
            self.remove(&id, "shutdown").await;
        }
    }
}

/// Makes the directory `target` and its missing parents in a fresh workspace, owned by the sandbox's root.
fn mount_point(target: &Path, host_id: u32) -> std::io::Result<()> {
    let mut missing = Vec::new();
    let mut p = target;
    while std::fs::symlink_metadata(p).is_err() {
        missing.push(p.to_owned());
        match p.parent() {
            Some(parent) => p = parent,
            None => break,
        }
    }
    for d in missing.iter().rev() {
        std::fs::DirBuilder::new().mode(0o755).create(d)?;
        std::os::unix::fs::lchown(d, Some(host_id), Some(host_id))?;
    }
    if std::fs::symlink_metadata(target)?.is_dir() {
        Ok(())
    } else {
        Err(std::io::Error::other("not a directory"))
    }
}

/// Removes a sandbox directory a previous daemon left, unmounting what is mounted under it first.
fn remove_leftover(dir: &Path) {
    warn!(path = %dir.display(), "removing a leftover agent sandbox");
    if let Err(e) = runtime::rootfs::detach_mounts_under(dir) {
        warn!(path = %dir.display(), error = %Chain(&e), "cannot unmount a leftover agent sandbox");
        return;
    }
    if let Err(e) = std::fs::remove_dir_all(dir) {
        warn!(path = %dir.display(), error = %e, "cannot remove a leftover agent sandbox");
    }
}

fn remove_leftovers(dir: &Path) -> std::io::Result<()> {
    match std::fs::read_dir(dir) {
        Ok(entries) => {
            for e in entries.flatten() {
                warn!(path = %e.path().display(), "removing a leftover agent sandbox");
            }
            std::fs::remove_dir_all(dir)
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests;

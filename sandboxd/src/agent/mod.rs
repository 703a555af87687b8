//! Agent sandboxes: long-lived sandboxes for AI agents behind the adapter-shim HTTP/WebSocket endpoints
//! (`docs/spec/agent-sandboxes.md`).
//!
//! - [`Agents`]: the registry: provisioning (`POST /sandboxes`), the sandbox limit, host uids, removal, and the
//!   removal of what a previous daemon left under `<state_dir>/agents` at start.
//! - [`sandbox`]: one sandbox and its agent runs (spawn, pause/resume through the cgroup freezer, kill with grace,
//!   commands over the control channel, crash detection, health).
//! - [`events`]: stamping, the rolling replay log, the gateway queue with backpressure.
//! - [`backend`]: eager artifact upload and token renewal.
//! - [`container`]: every call into the container helper.
//! - [`routes`]: the axum routes, bearer auth and bounded bodies.

pub mod backend;
pub mod container;
pub mod events;
pub mod routes;
pub mod sandbox;

use std::collections::HashMap;
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use agent_api::{AgentTemplate, CreateSandboxRequest, PluginError, SandboxCapability};
use runtime::error::Chain;
use runtime::rootfs::{InputFile, RootSource, Scratch};
use tracing::{info, warn};

use self::backend::Backend;
use self::events::{Budgets, Hub};
use self::sandbox::{Limits, Sandbox};
use crate::engine::Engine;
use crate::images::{RootImage, RootKind};

pub use routes::{router, AgentState};

/// Capabilities a sandbox may ask for: a shell and git come with the image; the network is loopback-only, and
/// sandbox-to-backend traffic (uploads, renewal) is made by sandboxd itself.
const SUPPORTED: &[SandboxCapability] = &[
    SandboxCapability::Terminal,
    SandboxCapability::Git,
    SandboxCapability::NetworkInternalOnly,
];

/// Every agent sandbox of the daemon.
pub struct Agents {
    engine: Arc<Engine>,
    dir: PathBuf,
    sandboxes: Mutex<HashMap<String, Arc<Sandbox>>>,
    /// Which host uid indexes are taken (`max_sandboxes` of them).
    uids: Mutex<Vec<bool>>,
    nonce: String,
    seq: AtomicU64,
}

impl Agents {
    /// The registry, with `<state_dir>/agents` emptied of a previous daemon's leftovers.
    pub fn new(engine: Arc<Engine>) -> std::io::Result<Arc<Self>> {
        let dir = engine.daemon().config().state_dir.join("agents");
        remove_leftovers(&dir)?;
        std::fs::DirBuilder::new().mode(0o711).create(&dir)?;
        let max = engine.daemon().config().agents.max_sandboxes;
        Ok(Arc::new(Self {
            engine,
            dir,
            sandboxes: Mutex::new(HashMap::new()),
            uids: Mutex::new(vec![false; max]),
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

    fn image(&self, name: Option<&str>) -> Option<Arc<RootImage>> {
        let name = name.unwrap_or("host");
        self.engine
            .languages()
            .values()
            .map(|l| l.image.clone())
            .find(|i| i.name == name)
    }

    fn resolve_limits(&self, req: &CreateSandboxRequest) -> Result<Limits, PluginError> {
        let max = &self.engine.daemon().config().agents;
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
    pub async fn create(&self, req: CreateSandboxRequest) -> Result<Arc<Sandbox>, PluginError> {
        let (limits, image, template, files) = self.admit(&req)?;
        // A host uid of its own; beyond max_sandboxes the caller retries later.
        let index = self.take_uid()?;
        let cfg = &self.engine.daemon().config();
        let host_id = cfg.sandbox.uid_base + cfg.uid_count() as u32 + index as u32;
        let id = format!(
            "ags-{}-{}",
            self.nonce,
            self.seq.fetch_add(1, Ordering::Relaxed)
        );
        let manifest = serde_json::json!({
            "sandboxId": id,
            "agentId": req.bootstrap.agent_id,
            "controlSocket": format!("{}/{}", runtime::rootfs::CODE_DIR, sandbox::CONTROL_SOCKET),
        })
        .to_string();
        let disk_bytes = limits.disk_mb << 20;
        let (scratch, hub) = match self
            .prepare(
                (&id, &req.bootstrap.agent_id),
                &image,
                disk_bytes,
                host_id,
                manifest,
                files,
            )
            .await
        {
            Ok(x) => x,
            Err(e) => {
                self.release_uid(index);
                return Err(e);
            }
        };
        let agent_id = req.bootstrap.agent_id.clone();
        let backend = Backend::new(req.bootstrap, cfg.agents.upload_attempts);
        let sb = Sandbox::new(
            id.clone(),
            agent_id,
            index,
            host_id,
            limits,
            template,
            image,
            backend,
            hub,
            scratch,
            self.engine.clone(),
        );
        sb.start_tasks();
        self.map().insert(id.clone(), sb.clone());
        info!(sandbox = %id, host_id, "agent sandbox created");
        Ok(sb)
    }

    /// Checks a creation request: bootstrap, capabilities, limits, image and template files (decoded).
    #[allow(clippy::type_complexity)]
    fn admit(
        &self,
        req: &CreateSandboxRequest,
    ) -> Result<(Limits, Arc<RootImage>, AgentTemplate, Vec<InputFile>), PluginError> {
        Backend::check(&req.bootstrap).map_err(|e| PluginError::invalid(Chain(&e).to_string()))?;
        let wr = &req.workspace_requirements;
        if let Some(c) = wr.capabilities.iter().find(|c| !SUPPORTED.contains(c)) {
            return Err(PluginError::CapabilityUnsupported {
                capability: c.as_str().into(),
            });
        }
        if !wr.mounts.is_empty() {
            return Err(PluginError::CapabilityUnsupported {
                capability: "mounts".into(),
            });
        }
        let limits = self.resolve_limits(req)?;
        let image = self.image(wr.base_image.as_deref()).ok_or_else(|| {
            PluginError::invalid(format!(
                "workspaceRequirements.baseImage {:?} is not an image of this daemon (host or one a language runs on)",
                wr.base_image.as_deref().unwrap_or("host")
            ))
        })?;
        let template = req.template.clone().unwrap_or_default();
        let mut files = Vec::with_capacity(template.files.len());
        for f in &template.files {
            protocol::validate_relative_path(&f.path)
                .map_err(|e| PluginError::invalid(format!("template.files: {}: {e}", f.path)))?;
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

    /// Takes a free host uid index, or refuses (retryably) at `agents.max_sandboxes`.
    fn take_uid(&self) -> Result<usize, PluginError> {
        let mut uids = self.uids.lock().unwrap_or_else(|p| p.into_inner());
        let Some(i) = uids.iter().position(|used| !used) else {
            return Err(PluginError::ProviderUnavailable {
                message: format!(
                    "{} agent sandboxes exist, the maximum (agents.max_sandboxes)",
                    uids.len()
                ),
                retryable: true,
            });
        };
        uids[i] = true;
        Ok(i)
    }

    fn release_uid(&self, i: usize) {
        if let Some(u) = self
            .uids
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get_mut(i)
        {
            *u = false;
        }
    }

    /// The sandbox's scratch space (workspace tmpfs, root), its input files with `agent.json`, and its event hub
    /// (whose own warnings name the agent).
    async fn prepare(
        &self,
        (id, agent_id): (&str, &str),
        image: &Arc<RootImage>,
        disk_bytes: u64,
        host_id: u32,
        manifest: String,
        files: Vec<InputFile>,
    ) -> Result<(Scratch, Arc<Hub>), PluginError> {
        let (dir, id2, image2) = (self.dir.clone(), id.to_owned(), image.clone());
        let agent_id = agent_id.to_owned();
        let budgets = Budgets::from_config(&self.engine.daemon().config().agents);
        let made = tokio::task::spawn_blocking(move || -> runtime::Result<(Scratch, Arc<Hub>)> {
            let root = match &image2.kind {
                RootKind::Host(_) => RootSource::Shared,
                RootKind::Oci { lowers } => RootSource::Overlay(lowers),
            };
            let scratch = Scratch::create(&dir, &id2, disk_bytes, host_id, root)?;
            scratch
                .inputs()
                .write("agent.json", manifest.as_bytes(), &files)?;
            let hub = Hub::with_budgets(scratch.dir().join("events"), &agent_id, budgets)
                .map_err(|e| runtime::Error::io(scratch.dir(), e))?;
            Ok((scratch, hub))
        })
        .await;
        match made {
            Ok(Ok(x)) => Ok(x),
            Ok(Err(runtime::Error::InputFile { path, reason })) => Err(PluginError::invalid(
                format!("template.files: {path}: {reason}"),
            )),
            Ok(Err(e)) => Err(PluginError::ProviderUnavailable {
                message: format!("Cannot prepare the sandbox: {}", Chain(&e)),
                retryable: false,
            }),
            Err(e) => Err(PluginError::ProviderUnavailable {
                message: format!("Preparation failed: {e}"),
                retryable: false,
            }),
        }
    }

    /// `DELETE /sandboxes/<id>`: `false` if there is no such sandbox.
    pub async fn delete(&self, id: &str) -> bool {
        let Some(sb) = self.map().remove(id) else {
            return false;
        };
        sb.destroy().await;
        self.release_uid(sb.uid_index);
        info!(sandbox = %id, "agent sandbox removed");
        true
    }

    /// Removes every sandbox (daemon shutdown).
    pub async fn shutdown(&self) {
        let ids: Vec<String> = self.map().keys().cloned().collect();
        for id in ids {
            self.delete(&id).await;
        }
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

//! Provisioning (`POST /sandboxes`): the request checked against this daemon's limits and capabilities, its egress
//! proxy made when it asks for `network`, its workspace created (a tmpfs, a snapshot's layer under one, or a
//! workspace of the copy-on-write store), volumes attached, the agent's manifest and template files written.

use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::Arc;

use agent_api::{AgentTemplate, CreateSandboxRequest, PluginError};
use protocol::CpuCores;
use runtime::error::Chain;
use runtime::rootfs::InputFile;
use tracing::{info, warn};

use crate::backend::Backend;
use crate::events::{Budgets, Hub};
use crate::host::{WorkspaceError, WorkspaceRequest};
use crate::network::SandboxEgress;
use crate::sandbox::{Parts, Sandbox, SandboxLimits, CONTROL_SOCKET};
use crate::volumes::Mounted;
use containers::agent::Workspace;

use super::{Agents, Refusal, SUPPORTED};

impl Agents {
    pub(super) fn resolve_limits(
        &self,
        req: &CreateSandboxRequest,
    ) -> Result<SandboxLimits, PluginError> {
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
        // The protocol's rule for a number of cores (finite, at least CpuCores::MIN), under this daemon's maximum.
        let cpu_cores =
            CpuCores::new(asked.cpu_cores.unwrap_or(max.cpu_cores)).ok_or_else(|| {
                PluginError::invalid(format!(
                    "workspaceRequirements.resourceLimits.cpuCores must be at least {}",
                    CpuCores::MIN
                ))
            })?;
        if cpu_cores.get() > max.cpu_cores {
            return Err(over(
                "cpuCores",
                cpu_cores.get().to_string(),
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
        Ok(SandboxLimits {
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
        // A snapshot's root layer is copied into the new root's upper layer, on the snapshot's image only; the
        // snapshot is held until then.
        let (root_layer, _copying) = match &req.from_snapshot {
            Some(snapshot) => self
                .snapshots()
                .and_then(|s| s.root_layer(snapshot, (&id, &image), limits.disk_mb << 20))?
                .unzip(),
            None => (None, None),
        };
        // With the copy-on-write store, a workspace of its own (a writable copy of a snapshot there); else a tmpfs,
        // with a snapshot's layer under it.
        let cow_from = match (&req.from_snapshot, &self.host.cow) {
            (Some(snapshot), Some(_)) => self
                .snapshots()
                .and_then(|s| s.cow_source(snapshot, limits.disk_mb << 20))?
                .map(Some),
            (None, Some(_)) => Some(None),
            (_, None) => None,
        };
        let layer = match (&req.from_snapshot, &cow_from) {
            (Some(snapshot), None) => {
                Some(self.snapshots().and_then(|s| s.acquire(snapshot, &id))?)
            }
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
    pub(super) async fn make_subvolume(
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
    pub(super) async fn destroy_subvolume(&self, id: &str, path: PathBuf) {
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
    pub(super) async fn sweep_subvolumes(&self) {
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
    pub(super) async fn create_as(
        &self,
        id: &str,
        req: CreateSandboxRequest,
        (limits, image, template, files): (SandboxLimits, String, AgentTemplate, Vec<InputFile>),
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
        let sb = Sandbox::new(Parts {
            id: id.clone(),
            agent_id,
            limits,
            template,
            image,
            backend,
            hub,
            workspace,
            network,
            volumes: self.volumes.clone().map(|v| (v, mounts)),
            from_snapshot,
            cow: subvolume.is_some(),
            host: self.host.clone(),
        });
        sb.start_tasks();
        sb.persist();
        self.map().insert(id.clone(), sb.clone());
        info!(sandbox = %id, "agent sandbox created");
        Ok(sb)
    }

    /// Checks a creation request: bootstrap, capabilities, limits, image and template files (decoded).
    #[allow(clippy::type_complexity)]
    pub(super) fn admit(
        &self,
        req: &CreateSandboxRequest,
    ) -> Result<(SandboxLimits, String, AgentTemplate, Vec<InputFile>), PluginError> {
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
    pub(super) async fn prepare(
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
    pub(super) async fn attach_volumes(
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
                        .map_err(Refusal::from)
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
}

/// Makes the directory `target` and its missing parents in a fresh workspace, owned by the sandbox's root.
pub(super) fn mount_point(target: &Path, host_id: u32) -> std::io::Result<()> {
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

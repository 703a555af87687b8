//! The registry of a daemon's agent sandboxes: lookup, removal, shutdown, and at start the removal of what a
//! previous daemon left under `<state_dir>/agents`. By concern, in its folder: [`provision`] (`POST /sandboxes`),
//! [`fork`] (snapshots and forks), [`adopt`] (live restore); its lifecycle tests run on the container seam's fake.

use std::collections::HashMap;
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};

use agent_api::{PluginError, SandboxCapability};
use runtime::error::Chain;
use tracing::{info, warn};

use crate::host::Host;
use crate::sandbox::Sandbox;
use crate::snapshots::{SnapshotError, Snapshots};
use crate::volumes::Volumes;

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

impl From<SnapshotError> for Refusal {
    /// The snapshot error's own status.
    fn from(e: SnapshotError) -> Self {
        let (status, error) = e.plugin();
        Self { status, error }
    }
}

impl From<crate::volumes::VolumeError> for Refusal {
    /// The volume error's own status.
    fn from(e: crate::volumes::VolumeError) -> Self {
        let (status, error) = e.plugin();
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

mod adopt;
mod fork;
mod provision;
#[cfg(test)]
mod tests;

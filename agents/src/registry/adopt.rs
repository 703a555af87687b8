//! Live restore (`agents.live_restore`): the sandboxes a previous daemon recorded, taken back with their
//! workspaces, volumes and kept runs; what cannot be taken back is removed.

use std::path::Path;
use std::sync::Arc;

use runtime::error::Chain;
use tracing::info;

use crate::backend::Backend;
use crate::events::{Budgets, Hub};
use crate::host::WorkspaceRequest;
use crate::network::SandboxEgress;
use crate::sandbox::Sandbox;

use super::{remove_leftover, Agents};

impl Agents {
    /// Takes back what a previous daemon recorded (live restore; nothing without it): each sandbox with its live
    /// run, or, when that cannot be, removed. Anything else under `<state_dir>/agents` is a leftover and removed.
    /// Returns what was done, one line per sandbox, for the log.
    pub async fn restore(&self) -> Vec<String> {
        let report = self.restore_recorded().await;
        self.sweep_subvolumes().await;
        report
    }

    /// [`Self::restore`] of every recorded sandbox.
    pub(super) async fn restore_recorded(&self) -> Vec<String> {
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
    pub(super) async fn adopt(&self, dir: &Path) -> Result<(Arc<Sandbox>, Option<String>), String> {
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
    pub(super) async fn adopt_held(
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
    pub(super) async fn drop_volumes(&self, record: &crate::restore::Record) {
        let Some(volumes) = &self.volumes else {
            return;
        };
        for m in &record.volumes {
            volumes.drop_held(&record.id, m).await;
        }
    }
}

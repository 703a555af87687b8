//! Snapshots of a sandbox's workspace (`POST /sandboxes/<id>/snapshot`) and forks: a snapshot and a sandbox
//! created from it (`POST /sandboxes/<id>/fork`).

use std::sync::Arc;

use agent_api::{CreateSandboxRequest, PluginError};
use tracing::warn;

use crate::sandbox::Sandbox;

use super::{Agents, Refusal};

impl Agents {
    /// `POST /sandboxes/<id>/snapshot`: `None` if there is no such sandbox.
    pub async fn snapshot(
        &self,
        id: &str,
    ) -> Option<Result<agent_api::Snapshot, crate::snapshots::SnapshotError>> {
        self.snapshot_as(id, false).await
    }

    /// [`Self::snapshot`]; with `later`, the digest of a snapshot in the copy-on-write store is computed after
    /// the return ([`Snapshots::finish`]).
    pub(super) async fn snapshot_as(
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
            Some(Err(e)) => return Err(e.into()),
            Some(Ok(s)) => s,
        };
        req.from_snapshot = Some(snapshot.id.clone());
        let store = self.snapshots()?;
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
}

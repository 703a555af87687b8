//! Pause and resume: a paused agent's container is frozen (the cgroup freezer: every process stopped where it is,
//! no CPU used) and thawed on resume; a resume with no agent running starts a new run from a stored state instead.
//! A snapshot freezes a running agent the same way while its workspace is copied, and thaws it after (a paused one
//! stays paused).

use std::sync::Arc;

use agent_api::{
    lifecycle_event, AgentBrief, AgentHandle, AgentStatus, PluginError, SerializedAgentState,
    SerializedBy,
};
use runtime::error::Chain;
use serde_json::Value;

use super::{unavailable, Sandbox};
use crate::snapshots::{RootUpper, SnapshotError, Snapshots};

/// How long a snapshot waits for an ended run's container to be removed.
const RUN_END_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

impl Sandbox {
    /// The live run is frozen: the sandbox says it is paused (the status it had comes back at the resume), keeps
    /// that, and tells the gateway (`paused`, with `reason` when it was not asked for).
    pub(super) fn mark_paused(&self, reason: Option<&str>) {
        let run_id = {
            let mut sh = self.shared();
            sh.before_pause = sh.status;
            sh.status = Some(AgentStatus::Paused);
            sh.run_id.clone()
        };
        self.persist();
        self.hub
            .emit(&run_id, lifecycle_event(&self.agent_id, "paused", reason));
    }

    /// `POST /pause`: freezes the agent's cgroup.
    #[tracing::instrument(name = "agent_pause", skip_all, fields(sandbox = %self.id))]
    pub async fn pause(&self) -> Result<SerializedAgentState, PluginError> {
        let ops = self.ops.lock().await;
        let Some(run) = Self::live(&ops) else {
            return Err(self.invalid("No agent is running in this sandbox"));
        };
        let status = self.status();
        if !matches!(
            status,
            Some(AgentStatus::Running | AgentStatus::WaitingOnHuman)
        ) {
            return Err(self.invalid("The agent is not running"));
        }
        run.container
            .freeze()
            .await
            .map_err(|e| unavailable(Chain(&e).to_string(), false))?;
        self.mark_paused(None);
        Ok(self.serialize(SerializedBy::Pause))
    }

    /// `POST /resume`: thaws a paused agent; with no agent running, starts a new run from the state's brief
    /// snapshot and hands the agent its checkpoint (`resume` in the brief line).
    #[tracing::instrument(name = "agent_resume", skip_all, fields(sandbox = %self.id))]
    pub async fn resume(
        self: &Arc<Self>,
        state: SerializedAgentState,
    ) -> Result<AgentHandle, PluginError> {
        let mut ops = self.ops.lock().await;
        if Self::live(&ops).is_none() || self.shared().last_exit.is_some() {
            let brief: AgentBrief =
                serde_json::from_value(state.brief_snapshot.clone()).map_err(|e| {
                    PluginError::invalid(format!(
                        "No agent is running and the state's briefSnapshot is not a brief: {e}"
                    ))
                })?;
            if brief.agent_id != self.agent_id {
                return Err(PluginError::invalid(format!(
                    "The state is for agent {:?}, this sandbox runs {:?}",
                    brief.agent_id, self.agent_id
                )));
            }
            let checkpoint = state
                .checkpoint
                .get("agent")
                .cloned()
                .unwrap_or(Value::Null);
            let h = self.spawn_locked(&mut ops, brief, Some(checkpoint)).await?;
            self.hub.emit(
                &h.session_id,
                lifecycle_event(
                    &self.agent_id,
                    "resumed",
                    Some("new run from a stored state"),
                ),
            );
            return Ok(h);
        }
        let Some(run) = Self::live(&ops) else {
            return Err(self.invalid("No agent is running in this sandbox"));
        };
        if self.status() != Some(AgentStatus::Paused) {
            return Err(self.invalid("The agent is not paused"));
        }
        run.container
            .thaw()
            .await
            .map_err(|e| unavailable(Chain(&e).to_string(), false))?;
        let run_id = {
            let mut sh = self.shared();
            sh.status = Some(sh.before_pause.take().unwrap_or(AgentStatus::Running));
            sh.run_id.clone()
        };
        self.persist();
        self.hub
            .emit(&run_id, lifecycle_event(&self.agent_id, "resumed", None));
        Ok(self.handle())
    }

    /// `POST /snapshot`: copies the workspace (and the root's upper layer, when its root is an image's overlay)
    /// into `store`, with a running agent frozen meanwhile (and thawed after) so that the copy is of one moment; a
    /// paused agent stays paused. Refused (409) when the workspace
    /// holds more than `max_bytes`. A workspace in the copy-on-write store is snapshot there while the agent is
    /// frozen, and walked for its digest after the thaw (with `later`, after the return).
    #[tracing::instrument(name = "agent_snapshot", skip_all, fields(sandbox = %self.id))]
    pub async fn snapshot(
        &self,
        store: &Arc<Snapshots>,
        max_bytes: u64,
        later: bool,
    ) -> Result<agent_api::Snapshot, SnapshotError> {
        let ops = self.ops.lock().await;
        let status = self.status();
        let ended = matches!(
            status,
            Some(AgentStatus::Paused | AgentStatus::Completed | AgentStatus::Error)
        );
        let frozen = match Self::live(&ops) {
            // The agent has ended and its run's end is being handled (`session_end` may be out before its
            // container is removed): what is left of the container may still run, and the copy is a walk by
            // path. It waits until the container is removed, which a freeze would race.
            Some(run) if matches!(status, Some(AgentStatus::Completed | AgentStatus::Error)) => {
                let mut done = run.done.clone();
                if tokio::time::timeout(RUN_END_WAIT, done.wait_for(|d| *d))
                    .await
                    .is_err()
                {
                    let why =
                        "the agent's run is still ending (its container is being removed); retry";
                    return Err(SnapshotError::Freeze(why.into()));
                }
                None
            }
            Some(run) if !ended => {
                if let Err(e) = run.container.freeze().await {
                    // A freeze may have been half done: nothing stays frozen behind a refusal.
                    let _ = run.container.thaw().await;
                    return Err(SnapshotError::Freeze(Chain(&e).to_string()));
                }
                Some(run)
            }
            _ => None,
        };
        let root = self.workspace.root_upper().map(|upper| RootUpper {
            upper,
            host_id: self.workspace.host_id(),
        });
        let taken = match (self.cow, &self.host.cow) {
            (true, Some(cow)) => store
                .capture(
                    (cow.workspace(&self.id), root),
                    (&self.image, &self.id),
                    max_bytes,
                )
                .await
                .map(Err),
            _ => store
                .take(
                    (self.workspace.workspace(), root),
                    &self.image,
                    &self.id,
                    max_bytes,
                )
                .await
                .map(Ok),
        };
        if let Some(run) = frozen {
            if let Err(e) = run.container.thaw().await {
                // Still frozen: it says so, and `resume` thaws it again.
                tracing::error!(sandbox = %self.id, error = %Chain(&e), "cannot thaw the agent after a snapshot; it is paused");
                self.mark_paused(Some("not thawed after a snapshot"));
            }
        }
        // The walk of a copy-on-write snapshot reads its files, not the sandbox: the sandbox's other operations
        // (a kill, its expiry) need not wait for it.
        drop(ops);
        match taken? {
            Ok(copied) => Ok(copied),
            Err(captured) => store.finish(captured, later).await,
        }
    }
}

//! One agent sandbox: its workspace (a tmpfs of `diskMb` under `<state_dir>/agents/<id>/` that outlives each agent
//! run), its event hub, its backend credentials, its egress proxy when it was created with `network`
//! ([`crate::network`]: served inside every run, its allowlist changed by `POST /network`), and at most one agent
//! run at a time: a container started by `POST /spawn` whose program talks to sandboxd over the control socket
//! `/sandbox/control.sock`.
//!
//! Operations on a sandbox are serialized by one async lock; the run's supervisor task owns the container and the
//! control connection and detects the end of the run (container exit or control socket drop: a crash unless the
//! agent exited with status 0 or was killed). The agent's lines are read (at most `agents.max_line_bytes` each; a
//! longer one is skipped with a warning) and turned into stamped events by two tasks of their own, one line in
//! flight between them, so neither a slow upload nor a file that blocks on open can stall the supervisor: a kill
//! or a removal is always served.

//!
//! The parts: [`lifecycle`] (spawn, the run's supervisor and its end, kill with grace, the lifetime limit,
//! removal, and a run taken back from a previous daemon), [`control`] (the control channel: the agent's lines in,
//! commands out), `spool` (the lines read and not processed yet, on disk, for live restore) and [`freezer`] (pause
//! and resume). Here: the sandbox's state, the commands forwarded to a live agent, its saved state and health.

pub mod control;
pub mod freezer;
pub mod lifecycle;
mod spool;
#[cfg(test)]
mod tests;

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use agent_api::{
    AgentCommand, AgentHandle, AgentStatus, AgentTemplate, ContextInjection, HealthStatus,
    PluginError, ResolveRequest, SandboxHealthResponse, SandboxResourceUsage, SerializedAgentState,
    SerializedBy,
};
use protocol::CpuCores;
use runtime::init::ProgramExit;
use serde_json::{Map, Value};
use tokio::sync::{mpsc, watch};

use crate::backend::Backend;
use crate::events::Hub;
use crate::host::Host;
use crate::network::{NetworkError, SandboxEgress};
use crate::restore::{Record, RunRecord};
use crate::volumes::{Mounted, Volumes};
use containers::agent::{RunContainer, Workspace};

/// Name of the control socket in the code directory (`/sandbox` inside).
pub const CONTROL_SOCKET: &str = "control.sock";
/// Commands queued for the agent before callers are told to retry.
const COMMAND_QUEUE: usize = 64;
/// The plugin name in handles and states.
pub const PLUGIN_NAME: &str = "sandboxd";

/// Resolved resource limits.
#[derive(Debug, Clone, Copy)]
pub struct SandboxLimits {
    /// CPU quota, cores.
    pub cpu_cores: CpuCores,
    /// Memory, MiB.
    pub memory_mb: u64,
    /// Workspace tmpfs, MiB.
    pub disk_mb: u64,
    /// Sandbox lifetime, ms.
    pub timeout_ms: u64,
}

/// What readers outside the operation lock see.
#[derive(Default)]
struct Shared {
    status: Option<AgentStatus>,
    /// Status to return to on resume.
    before_pause: Option<AgentStatus>,
    run_id: String,
    /// The run's container while it exists.
    container: Option<Arc<dyn RunContainer>>,
    pending_decisions: BTreeSet<String>,
    checkpoint: Option<(Value, Option<String>)>,
    uploads: u64,
    last_exit: Option<ProgramExit>,
    cpu_sample: Option<(Instant, u64)>,
    expired: bool,
    /// The live run when it is kept (live restore).
    kept: Option<RunRecord>,
    /// The brief of the last run, as `update-brief` changed it.
    brief: Option<Map<String, Value>>,
}

/// A live run, as operations see it.
struct Run {
    commands: mpsc::Sender<String>,
    done: watch::Receiver<bool>,
    killing: Arc<AtomicBool>,
    container: Arc<dyn RunContainer>,
}

#[derive(Default)]
struct Ops {
    run: Option<Run>,
}

/// One agent sandbox.
pub struct Sandbox {
    /// Sandbox id.
    pub id: String,
    /// The agent (from the bootstrap).
    pub agent_id: String,
    limits: SandboxLimits,
    template: AgentTemplate,
    /// The image its runs start on.
    image: String,
    /// Backend credentials.
    pub backend: Arc<Backend>,
    /// Events.
    pub hub: Arc<Hub>,
    dir: PathBuf,
    workspace: Arc<dyn Workspace>,
    /// The egress proxy, when the sandbox was created with `network`.
    network: Option<SandboxEgress>,
    /// The volumes mounted into it (emptied at its removal).
    volumes: Option<Arc<Volumes>>,
    mounts: Mutex<Vec<Mounted>>,
    ops: tokio::sync::Mutex<Ops>,
    shared: Mutex<Shared>,
    tasks: Mutex<Vec<tokio::task::JoinHandle<()>>>,
    runs: AtomicU64,
    created: Instant,
    /// When it was created, Unix ms (kept across daemons).
    created_unix_ms: u64,
    /// The snapshot its workspace started from.
    from_snapshot: Option<String>,
    /// Its workspace is in the copy-on-write store.
    cow: bool,
    /// The record last written (live restore), so an unchanged one is not written again.
    written: Mutex<Vec<u8>>,
    host: Host,
}

fn unavailable(message: impl Into<String>, retryable: bool) -> PluginError {
    PluginError::ProviderUnavailable {
        message: message.into(),
        retryable,
    }
}

/// The volumes a sandbox mounts, with the daemon's volumes (`None` when the daemon has none).
pub type SandboxVolumes = Option<(Arc<Volumes>, Vec<Mounted>)>;

/// What a sandbox is assembled from ([`Sandbox::new`]): what it is (id, agent, limits, template, image, the
/// snapshot it started from, whether its workspace is in the copy-on-write store) and the parts made for it (its
/// backend, events, workspace, egress proxy and volumes, and the host).
pub(crate) struct Parts {
    pub(crate) id: String,
    pub(crate) agent_id: String,
    pub(crate) limits: SandboxLimits,
    pub(crate) template: AgentTemplate,
    pub(crate) image: String,
    pub(crate) backend: Arc<Backend>,
    pub(crate) hub: Arc<Hub>,
    pub(crate) workspace: Arc<dyn Workspace>,
    pub(crate) network: Option<SandboxEgress>,
    pub(crate) volumes: SandboxVolumes,
    pub(crate) from_snapshot: Option<String>,
    pub(crate) cow: bool,
    pub(crate) host: Host,
}

impl Sandbox {
    /// Assembles a sandbox around its prepared workspace.
    pub(crate) fn new(parts: Parts) -> Arc<Self> {
        Arc::new(Self::assemble(parts))
    }

    fn assemble(p: Parts) -> Self {
        let (volumes, mounts) = match p.volumes {
            Some((v, m)) => (Some(v), m),
            None => (None, Vec::new()),
        };
        Self {
            id: p.id,
            agent_id: p.agent_id,
            limits: p.limits,
            template: p.template,
            image: p.image,
            backend: p.backend,
            hub: p.hub,
            dir: p.workspace.dir().to_owned(),
            workspace: p.workspace,
            network: p.network,
            volumes,
            mounts: Mutex::new(mounts),
            ops: tokio::sync::Mutex::new(Ops::default()),
            shared: Mutex::new(Shared::default()),
            tasks: Mutex::new(Vec::new()),
            runs: AtomicU64::new(0),
            created: Instant::now(),
            created_unix_ms: unix_ms(),
            from_snapshot: p.from_snapshot,
            cow: p.cow,
            written: Mutex::new(Vec::new()),
            host: p.host,
        }
    }

    /// A sandbox a previous daemon left (live restore), around its adopted workspace and reopened hub, in the
    /// state its record gives. Its live run, if any, is adopted next ([`Self::adopt_run`]).
    pub fn restore(
        record: &Record,
        (backend, hub): (Arc<Backend>, Arc<Hub>),
        workspace: Arc<dyn Workspace>,
        (network, volumes): (Option<SandboxEgress>, SandboxVolumes),
        host: Host,
    ) -> Arc<Self> {
        let mut sb = Self::assemble(Parts {
            id: record.id.clone(),
            agent_id: record.agent_id.clone(),
            limits: SandboxLimits {
                cpu_cores: record.cpu_cores,
                memory_mb: record.memory_mb,
                disk_mb: record.disk_mb,
                timeout_ms: record.timeout_ms,
            },
            template: record.template.clone(),
            image: record.image.clone(),
            backend,
            hub,
            workspace,
            network,
            volumes,
            from_snapshot: record.from_snapshot.clone(),
            cow: record.cow,
            host,
        });
        let age = Duration::from_millis(unix_ms().saturating_sub(record.created_unix_ms));
        sb.created = Instant::now().checked_sub(age).unwrap_or_else(Instant::now);
        sb.created_unix_ms = record.created_unix_ms;
        sb.runs = AtomicU64::new(record.runs);
        sb.shared = Mutex::new(Shared {
            status: record.status,
            before_pause: record.before_pause,
            run_id: record.run_id.clone(),
            pending_decisions: record.pending_decisions.clone(),
            checkpoint: record.checkpoint.clone(),
            last_exit: record.last_exit,
            expired: record.expired,
            brief: record.brief.clone(),
            ..Shared::default()
        });
        Arc::new(sb)
    }

    /// Whether its workspace is in the copy-on-write store (removed from there after the sandbox).
    pub fn cow(&self) -> bool {
        self.cow
    }

    /// What a daemon after this one needs to take the sandbox back.
    pub fn record(&self) -> Record {
        let mounts = self
            .mounts
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let sh = self.shared();
        Record {
            version: crate::restore::VERSION,
            id: self.id.clone(),
            agent_id: self.agent_id.clone(),
            cpu_cores: self.limits.cpu_cores,
            memory_mb: self.limits.memory_mb,
            disk_mb: self.limits.disk_mb,
            timeout_ms: self.limits.timeout_ms,
            template: self.template.clone(),
            image: self.image.clone(),
            host_id: self.workspace.host_id(),
            created_unix_ms: self.created_unix_ms,
            bootstrap: self.backend.bootstrap(),
            from_snapshot: self.from_snapshot.clone(),
            cow: self.cow,
            mounts: !mounts.is_empty(),
            volumes: mounts,
            network: self.network.is_some(),
            egress: self.network.as_ref().is_some_and(SandboxEgress::kept),
            runs: self.runs.load(std::sync::atomic::Ordering::Relaxed),
            status: sh.status,
            before_pause: sh.before_pause,
            run_id: sh.run_id.clone(),
            pending_decisions: sh.pending_decisions.clone(),
            checkpoint: sh.checkpoint.clone(),
            last_exit: sh.last_exit,
            expired: sh.expired,
            brief: sh.brief.clone(),
            run: sh.kept.clone(),
        }
    }

    /// Writes the record when live restore is on and it changed (errors are logged: the sandbox goes on, a later
    /// daemon may not find it as it is now).
    pub fn persist(&self) {
        if !self.host.settings.agents.live_restore {
            return;
        }
        // Built under the lock: of two callers, the later state is written last.
        let mut written = self.written.lock().unwrap_or_else(|p| p.into_inner());
        let Ok(bytes) = serde_json::to_vec(&self.record()) else {
            return;
        };
        if *written == bytes {
            return;
        }
        match crate::restore::save_bytes(&self.dir, &bytes) {
            Ok(()) => *written = bytes,
            Err(e) => {
                tracing::warn!(sandbox = %self.id, error = %e, "cannot write the sandbox's record")
            }
        }
    }

    /// Daemon exit with live restore: the record written, the workspace left mounted, the runs left running (their
    /// supervisors end with the daemon's tasks; nothing removes them).
    pub fn leave(&self) {
        self.persist();
        self.workspace.leave();
    }

    /// The kept run cannot be taken back by a later daemon (its init could not hold the control connection): the
    /// record says it has no run, so the next daemon ends it with the rest of what it does not know.
    fn forget_kept(&self) {
        self.shared().kept = None;
        self.persist();
    }

    /// The kept run's agent has its brief (a later daemon does not send it again).
    fn persist_connected(&self) {
        if let Some(k) = self.shared().kept.as_mut() {
            k.connected = true;
        }
        self.persist();
    }

    fn shared(&self) -> std::sync::MutexGuard<'_, Shared> {
        self.shared.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn status(&self) -> Option<AgentStatus> {
        self.shared().status
    }

    /// The agent's handle (status `completed` before the first spawn).
    pub fn handle(&self) -> AgentHandle {
        let sh = self.shared();
        AgentHandle {
            id: self.agent_id.clone(),
            plugin_name: PLUGIN_NAME.into(),
            status: sh.status.unwrap_or(AgentStatus::Completed),
            session_id: sh.run_id.clone(),
            pending_brief_changes: None,
        }
    }

    fn invalid(&self, message: impl Into<String>) -> PluginError {
        PluginError::InvalidState {
            message: message.into(),
            handle: Some(Box::new(self.handle())),
        }
    }

    fn live(ops: &Ops) -> Option<&Run> {
        ops.run.as_ref().filter(|r| !*r.done.borrow())
    }

    fn send(&self, ops: &Ops, cmd: &AgentCommand) -> Result<(), PluginError> {
        let Some(run) = Self::live(ops) else {
            return Err(self.invalid("No agent is running in this sandbox"));
        };
        run.commands.try_send(line(cmd)).map_err(|_| {
            unavailable(
                "The agent is not reading its control channel; retry later",
                true,
            )
        })
    }

    /// `POST /resolve`.
    pub async fn resolve(&self, req: ResolveRequest) -> Result<(), PluginError> {
        let ops = self.ops.lock().await;
        if Self::live(&ops).is_none() {
            return Err(self.invalid("No agent is running in this sandbox"));
        }
        if !self.shared().pending_decisions.contains(&req.decision_id) {
            return Err(PluginError::DecisionNotFound {
                decision_id: req.decision_id,
            });
        }
        self.send(
            &ops,
            &AgentCommand::Resolve {
                decision_id: req.decision_id.clone(),
                resolution: req.resolution,
            },
        )?;
        let mut sh = self.shared();
        sh.pending_decisions.remove(&req.decision_id);
        if sh.pending_decisions.is_empty() && sh.status == Some(AgentStatus::WaitingOnHuman) {
            sh.status = Some(AgentStatus::Running);
        }
        if sh.pending_decisions.is_empty() && sh.before_pause == Some(AgentStatus::WaitingOnHuman) {
            sh.before_pause = Some(AgentStatus::Running);
        }
        Ok(())
    }

    /// `POST /inject-context`.
    pub async fn inject(&self, injection: ContextInjection) -> Result<(), PluginError> {
        let ops = self.ops.lock().await;
        self.send(&ops, &AgentCommand::InjectContext { injection })
    }

    /// `POST /update-brief`: forwarded to the running agent (hot update) and applied to the brief snapshot.
    pub async fn update_brief(&self, changes: Map<String, Value>) -> Result<(), PluginError> {
        let ops = self.ops.lock().await;
        if changes.contains_key("agentId") {
            return Err(PluginError::invalid("update-brief cannot change agentId"));
        }
        self.send(
            &ops,
            &AgentCommand::UpdateBrief {
                changes: changes.clone(),
            },
        )?;
        if let Some(b) = self.shared().brief.as_mut() {
            b.extend(changes);
        }
        self.persist();
        Ok(())
    }

    fn serialize(&self, by: SerializedBy) -> SerializedAgentState {
        let sh = self.shared();
        let (agent_checkpoint, summary) = sh.checkpoint.clone().unzip();
        let mut state = SerializedAgentState {
            agent_id: self.agent_id.clone(),
            plugin_name: PLUGIN_NAME.into(),
            session_id: sh.run_id.clone(),
            checkpoint: serde_json::json!({
                "sdk": PLUGIN_NAME,
                "sandboxId": self.id,
                "runId": sh.run_id,
                "frozen": by == SerializedBy::Pause,
                "agent": agent_checkpoint,
            }),
            brief_snapshot: sh.brief.clone().map(Value::Object).unwrap_or(Value::Null),
            conversation_summary: summary.flatten(),
            pending_decision_ids: sh.pending_decisions.iter().cloned().collect(),
            last_sequence: self.hub.last_sequence(),
            serialized_at: protocol::now_ts(),
            serialized_by: by,
            estimated_size_bytes: 0,
        };
        drop(sh);
        state.estimated_size_bytes = serde_json::to_vec(&state)
            .map(|v| v.len() as u64)
            .unwrap_or(0);
        state
    }

    /// `POST /network`: the new allowlist, in force for every request from now on (tunnels already open stay);
    /// the list in force.
    pub fn set_network(&self, allow: Vec<String>) -> Result<Vec<String>, NetworkError> {
        let network = self.network.as_ref().ok_or(NetworkError::NotCreatedWith)?;
        let allow = network.set_allow(allow)?;
        tracing::info!(sandbox = %self.id, allow = ?allow, "sandbox allowlist changed");
        Ok(allow)
    }

    /// `GET /health`.
    pub fn health(&self) -> SandboxHealthResponse {
        let (status, container) = {
            let sh = self.shared();
            (sh.status, sh.container.clone())
        };
        let mut degraded = self.hub.dropping();
        let (mut cpu_percent, mut memory_mb) = (0.0, 0.0);
        if let Some(c) = &container {
            match c.usage() {
                Ok(u) => {
                    memory_mb = u.memory_bytes as f64 / (1u64 << 20) as f64;
                    let now = Instant::now();
                    let mut sh = self.shared();
                    if let Some((t, ns)) = sh.cpu_sample {
                        let wall = now.duration_since(t).as_nanos() as f64;
                        if wall > 0.0 {
                            cpu_percent = u.cpu_time_ns.saturating_sub(ns) as f64 * 100.0 / wall;
                        }
                    }
                    sh.cpu_sample = Some((now, u.cpu_time_ns));
                }
                Err(_) => degraded = true,
            }
        }
        // A workspace of the copy-on-write store is a quota group of a filesystem every sandbox shares.
        let used = match (self.cow, &self.host.cow) {
            (true, Some(cow)) => cow.used_bytes(&self.id).map(|b| b as f64),
            _ => nix::sys::statvfs::statvfs(&self.workspace.workspace())
                .ok()
                .map(|s| {
                    s.blocks().saturating_sub(s.blocks_free()) as f64 * s.fragment_size() as f64
                }),
        };
        let disk_mb = used.unwrap_or(0.0) / (1u64 << 20) as f64;
        let agent_status = status.unwrap_or(AgentStatus::Completed);
        SandboxHealthResponse {
            status: if agent_status == AgentStatus::Error {
                HealthStatus::Unhealthy
            } else if degraded {
                HealthStatus::Degraded
            } else {
                HealthStatus::Healthy
            },
            agent_status,
            uptime_ms: self.created.elapsed().as_millis() as u64,
            resource_usage: SandboxResourceUsage {
                cpu_percent,
                memory_mb,
                disk_mb,
                collected_at: protocol::now_ts(),
            },
            pending_event_buffer_size: self.hub.pending() as u64,
            network: self.network.as_ref().map(SandboxEgress::usage),
        }
    }
}

fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

fn line(cmd: &AgentCommand) -> String {
    let mut s = serde_json::to_string(cmd).unwrap_or_default();
    s.push('\n');
    s
}

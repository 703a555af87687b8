//! One agent sandbox: its workspace (a tmpfs of `diskMb` under `<state_dir>/agents/<id>/` that outlives each agent
//! run), its event hub, its backend credentials, and at most one agent run at a time: a container started by
//! `POST /spawn` whose program talks to sandboxd over the control socket `/sandbox/control.sock`.
//!
//! Operations on a sandbox are serialized by one async lock; the run's supervisor task owns the container and the
//! control connection and detects the end of the run (container exit or control socket drop: a crash unless the
//! agent exited with status 0 or was killed). The agent's lines are read (at most `agents.max_line_bytes` each; a
//! longer one is skipped with a warning) and turned into stamped events by two tasks of their own, one line in
//! flight between them, so neither a slow upload nor a file that blocks on open can stall the supervisor: a kill
//! or a removal is always served.

use std::collections::BTreeSet;
use std::os::fd::AsFd;
use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use protocol::agent::{
    error_event, lifecycle_event, parse_agent_line, AgentBrief, AgentCommand, AgentHandle,
    AgentLine, AgentStatus, AgentTemplate, ContextInjection, HealthStatus, KillRequest,
    KillResponse, PluginError, ResolveRequest, SandboxHealthResponse, SandboxResourceUsage,
    SerializedAgentState, SerializedBy, DEFAULT_GRACE_TIMEOUT_MS,
};
use runtime::error::Chain;
use runtime::init::ProgramExit;
use runtime::rootfs::CODE_DIR;
use serde_json::{Map, Value};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt};
use tokio::sync::{mpsc, watch};
use tracing::{info, warn, Instrument};

use super::backend::Backend;
use super::events::Hub;
use crate::containers::long_lived::{Ended, RunContainer, RunPlan, Workspace};
use crate::engine::Engine;
use crate::images::RootImage;

/// Name of the control socket in the code directory (`/sandbox` inside).
pub const CONTROL_SOCKET: &str = "control.sock";
/// Commands queued for the agent before callers are told to retry.
const COMMAND_QUEUE: usize = 64;
/// How long a dropped control connection may precede the container's exit before the run counts as crashed and
/// is killed.
const EOF_GRACE: Duration = Duration::from_millis(500);
/// How long after the container's exit its last lines may still be read and processed (uploads included) before
/// the run ends without them (also what a descriptor leaked past the exit costs).
const DRAIN_GRACE: Duration = Duration::from_secs(5);
/// The plugin name in handles and states.
pub const PLUGIN_NAME: &str = "sandboxd";

/// Resolved resource limits.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// CPU quota, cores.
    pub cpu_cores: f64,
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
    brief: Option<Map<String, Value>>,
}

/// One agent sandbox.
pub struct Sandbox {
    /// Sandbox id.
    pub id: String,
    /// The agent (from the bootstrap).
    pub agent_id: String,
    /// Its host uid (given back at removal).
    pub host_id: u32,
    limits: Limits,
    template: AgentTemplate,
    image: Arc<RootImage>,
    /// Backend credentials.
    pub backend: Arc<Backend>,
    /// Events.
    pub hub: Arc<Hub>,
    dir: PathBuf,
    workspace: Arc<dyn Workspace>,
    ops: tokio::sync::Mutex<Ops>,
    shared: Mutex<Shared>,
    tasks: Mutex<Vec<tokio::task::JoinHandle<()>>>,
    runs: AtomicU64,
    created: Instant,
    engine: Arc<Engine>,
}

fn unavailable(message: impl Into<String>, retryable: bool) -> PluginError {
    PluginError::ProviderUnavailable {
        message: message.into(),
        retryable,
    }
}

impl Sandbox {
    /// Assembles a sandbox around its prepared workspace.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        id: String,
        agent_id: String,
        host_id: u32,
        limits: Limits,
        template: AgentTemplate,
        image: Arc<RootImage>,
        backend: Arc<Backend>,
        hub: Arc<Hub>,
        workspace: Arc<dyn Workspace>,
        engine: Arc<Engine>,
    ) -> Arc<Self> {
        let dir = workspace.dir().to_owned();
        Arc::new(Self {
            id,
            agent_id,
            host_id,
            limits,
            template,
            image,
            backend,
            hub,
            dir,
            workspace,
            ops: tokio::sync::Mutex::new(Ops::default()),
            shared: Mutex::new(Shared::default()),
            tasks: Mutex::new(Vec::new()),
            runs: AtomicU64::new(0),
            created: Instant::now(),
            engine,
        })
    }

    fn shared(&self) -> std::sync::MutexGuard<'_, Shared> {
        self.shared.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Starts the sandbox's background tasks: token renewal and the lifetime limit.
    pub fn start_tasks(self: &Arc<Self>) {
        let renew = tokio::spawn(self.backend.clone().renew_loop());
        let me = Arc::downgrade(self);
        let lifetime = Duration::from_millis(self.limits.timeout_ms);
        let expire = tokio::spawn(async move {
            tokio::time::sleep(lifetime).await;
            if let Some(sb) = me.upgrade() {
                sb.expire().await;
            }
        });
        let mut t = self.tasks.lock().unwrap_or_else(|p| p.into_inner());
        t.push(renew);
        t.push(expire);
    }

    async fn expire(self: Arc<Self>) {
        info!(sandbox = %self.id, "sandbox lifetime over");
        self.shared().expired = true;
        let mut ops = self.ops.lock().await;
        if ops.run.as_ref().is_some_and(|r| !*r.done.borrow()) {
            let _ = self
                .stop_run(
                    &mut ops,
                    KillRequest {
                        grace: false,
                        grace_timeout_ms: None,
                    },
                    "timeout",
                )
                .await;
        }
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

    /// `POST /spawn`.
    pub async fn spawn(self: &Arc<Self>, brief: AgentBrief) -> Result<AgentHandle, PluginError> {
        let mut ops = self.ops.lock().await;
        self.spawn_locked(&mut ops, brief, None).await
    }

    /// Starts a run; `resume` is the agent's checkpoint from a stored state (handed to it in the brief line).
    async fn spawn_locked(
        self: &Arc<Self>,
        ops: &mut Ops,
        brief: AgentBrief,
        resume: Option<Value>,
    ) -> Result<AgentHandle, PluginError> {
        let command = self.spawnable(ops, &brief).await?;
        let n = self.runs.fetch_add(1, Ordering::Relaxed) + 1;
        let cid = format!("{}-{n}", self.id);
        let run_id = uuid::Uuid::now_v7().to_string();
        let listener = self.control_socket()?;
        let c = self.start_container(&cid, command).await?;
        info!(sandbox = %self.id, container = %c.cid(), run = %run_id, "agent started");

        ops.brief = match serde_json::to_value(&brief) {
            Ok(Value::Object(m)) => Some(m),
            _ => None,
        };
        {
            let mut sh = self.shared();
            sh.status = Some(AgentStatus::Running);
            sh.before_pause = None;
            sh.run_id = run_id.clone();
            sh.container = Some(c.clone());
            sh.pending_decisions.clear();
            sh.checkpoint = None;
            sh.last_exit = None;
            sh.cpu_sample = None;
        }
        let brief_line = line(&AgentCommand::Brief {
            brief,
            run_id: run_id.clone(),
            sandbox_id: self.id.clone(),
            resume,
        });
        self.hub
            .emit(&run_id, lifecycle_event(&self.agent_id, "started", None));
        let (commands, commands_rx) = mpsc::channel(COMMAND_QUEUE);
        let (done_tx, done) = watch::channel(false);
        let killing = Arc::new(AtomicBool::new(false));
        ops.run = Some(Run {
            commands,
            done,
            killing: killing.clone(),
            container: c.clone(),
        });
        let span = tracing::info_span!("agent", sandbox = %self.id, run = %run_id);
        tokio::spawn(
            self.clone()
                .supervise(
                    c,
                    listener,
                    brief_line,
                    commands_rx,
                    run_id,
                    killing,
                    done_tx,
                )
                .instrument(span),
        );
        Ok(self.handle())
    }

    /// Whether a run may start now, and the agent's command (the brief's, else the template's).
    async fn spawnable(&self, ops: &Ops, brief: &AgentBrief) -> Result<Vec<String>, PluginError> {
        if self.shared().expired {
            return Err(self.invalid("The sandbox's lifetime (resourceLimits.timeoutMs) is over"));
        }
        // A run that has ended (its exit is processed and its last events are out) may still be removing its
        // container: wait for that rather than refuse.
        let ending = self.shared().last_exit.is_some();
        if let Some(run) = Self::live(ops).filter(|_| ending) {
            let mut done = run.done.clone();
            let _ = tokio::time::timeout(Duration::from_secs(30), done.wait_for(|d| *d)).await;
        }
        if Self::live(ops).is_some() {
            return Err(self.invalid("An agent is already running in this sandbox"));
        }
        let command = brief
            .command()
            .or_else(|| (!self.template.command.is_empty()).then(|| self.template.command.clone()))
            .ok_or_else(|| {
                PluginError::invalid(
                    "No agent command: set providerConfig.command in the brief or template.command at creation",
                )
            })?;
        if command.first().is_none_or(|p| !p.starts_with('/')) {
            return Err(PluginError::invalid(
                "The agent command's program must be an absolute path",
            ));
        }
        Ok(command)
    }

    /// The control socket, connectable only by the sandbox's uid.
    fn control_socket(&self) -> Result<tokio::net::UnixListener, PluginError> {
        let sock_path = self.dir.join("code").join(CONTROL_SOCKET);
        let _ = std::fs::remove_file(&sock_path);
        let listener = tokio::net::UnixListener::bind(&sock_path)
            .map_err(|e| unavailable(format!("Cannot create the control socket: {e}"), false))?;
        let owner = self.workspace.host_id();
        let uid = Some(nix::unistd::Uid::from_raw(owner));
        let gid = Some(nix::unistd::Gid::from_raw(owner));
        nix::unistd::chown(&sock_path, uid, gid)
            .map_err(|e| unavailable(format!("Cannot chown the control socket: {e}"), false))?;
        std::fs::set_permissions(&sock_path, std::fs::Permissions::from_mode(0o600))
            .map_err(|e| unavailable(format!("Cannot chmod the control socket: {e}"), false))?;
        Ok(listener)
    }

    /// Creates the run's container (stdin `/dev/null`, output to the agent log), sets its cpu quota and launches
    /// the agent. On error nothing of the container is left.
    async fn start_container(
        &self,
        cid: &str,
        args: Vec<String>,
    ) -> Result<Arc<dyn RunContainer>, PluginError> {
        let stdin = std::fs::File::open("/dev/null")
            .map_err(|e| unavailable(format!("/dev/null: {e}"), false))?;
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join("scratch/agent.log"))
            .map_err(|e| unavailable(format!("Cannot open the agent log: {e}"), false))?;
        let plan = RunPlan {
            cid,
            args,
            env: self.environment(),
            memory_mb: self.limits.memory_mb,
            pids_max: self.engine.config.agents.pids_max,
            shm_bytes: (self.limits.disk_mb << 20).min(64 << 20),
        };
        let c = self
            .workspace
            .create_run(plan)
            .await
            .map_err(|e| unavailable(Chain(&e).to_string(), true))?;
        let started = c
            .set_cpu_quota(self.limits.cpu_cores)
            .and_then(|()| c.launch([stdin.as_fd(), log.as_fd(), log.as_fd()]));
        if let Err(e) = started {
            c.signal(Signal::SIGKILL);
            c.remove().await;
            return Err(unavailable(Chain(&e).to_string(), true));
        }
        Ok(c)
    }

    /// The agent's environment: the image's base, the template's, and where its control socket is.
    fn environment(&self) -> Vec<String> {
        let mut env = crate::engine::base_environment(&self.image);
        env.extend(self.template.env.clone());
        env.insert(
            "SANDBOXD_CONTROL_SOCKET".into(),
            format!("{CODE_DIR}/{CONTROL_SOCKET}"),
        );
        env.insert("SANDBOXD_SANDBOX_ID".into(), self.id.clone());
        env.insert("SANDBOXD_AGENT_ID".into(), self.agent_id.clone());
        env.into_iter().map(|(k, v)| format!("{k}={v}")).collect()
    }

    /// The run's supervisor: accepts the agent's control connection, sends it the brief and the commands, turns its
    /// lines into events, and ends the run when the container exits.
    #[allow(clippy::too_many_arguments)]
    async fn supervise(
        self: Arc<Self>,
        c: Arc<dyn RunContainer>,
        listener: tokio::net::UnixListener,
        brief_line: String,
        commands_rx: mpsc::Receiver<String>,
        run_id: String,
        killing: Arc<AtomicBool>,
        done_tx: watch::Sender<bool>,
    ) {
        let end = self
            .watch_run(&*c, listener, brief_line, commands_rx, &run_id, &killing)
            .await;
        let killed = killing.load(Ordering::SeqCst);
        let crashed = crash_reason(killed, end.crash, &end.ended);
        {
            let mut sh = self.shared();
            sh.last_exit = Some(end.ended.exit);
            sh.status = Some(if crashed.is_some() {
                AgentStatus::Error
            } else {
                AgentStatus::Completed
            });
        }
        match &crashed {
            Some(why) => {
                warn!(reason = %why, "agent crashed");
                self.hub.emit(
                    &run_id,
                    lifecycle_event(&self.agent_id, "crashed", Some(why)),
                );
                self.hub.emit(
                    &run_id,
                    error_event(
                        &self.agent_id,
                        "high",
                        &format!("The agent crashed: {why}"),
                        false,
                        Some("agent_crashed"),
                        "internal",
                    ),
                );
            }
            None if !killed => {
                self.hub.emit(
                    &run_id,
                    lifecycle_event(&self.agent_id, "session_end", None),
                );
            }
            None => {}
        }
        c.remove().await;
        let _ = std::fs::remove_file(self.dir.join("code").join(CONTROL_SOCKET));
        self.shared().container = None;
        let _ = done_tx.send(true);
    }

    /// Serves the run until the container has exited and the control connection's last line is processed (or
    /// never opened, or [`DRAIN_GRACE`] past the exit). A connection that drops while the agent keeps running kills
    /// the container and is the crash reason.
    async fn watch_run(
        self: &Arc<Self>,
        c: &dyn RunContainer,
        listener: tokio::net::UnixListener,
        brief_line: String,
        commands_rx: mpsc::Receiver<String>,
        run_id: &str,
        killing: &AtomicBool,
    ) -> RunEnd {
        let (processed_tx, mut processed_rx) = mpsc::channel::<()>(1);
        let mut commands_rx = Some(commands_rx);
        let mut connected = false;
        let mut helpers: Vec<tokio::task::JoinHandle<()>> = Vec::new();
        let mut ended: Option<Ended> = None;
        let mut crash = None;
        let mut eof = false;
        let mut eof_deadline: Option<tokio::time::Instant> = None;
        let mut drain_deadline: Option<tokio::time::Instant> = None;
        loop {
            if ended.is_some() && (eof || !connected) {
                break;
            }
            tokio::select! {
                end = c.ended(), if ended.is_none() => {
                    ended = Some(end);
                    drain_deadline = Some(tokio::time::Instant::now() + DRAIN_GRACE);
                }
                acc = listener.accept(), if !connected => match acc {
                    Ok((stream, _)) => {
                        connected = true;
                        let (r, w) = stream.into_split();
                        // One line in flight: the reader waits while the processor works (backpressure).
                        let (line_tx, line_rx) = mpsc::channel::<Incoming>(1);
                        let max = self.engine.config.agents.max_line_bytes;
                        helpers.push(tokio::spawn(read_lines(r, line_tx, max)));
                        helpers.push(tokio::spawn(self.clone().process_lines(
                            run_id.to_owned(), line_rx, processed_tx.clone(),
                        ).in_current_span()));
                        if let Some(rx) = commands_rx.take() {
                            helpers.push(tokio::spawn(write_lines(w, brief_line.clone(), rx)));
                        }
                    }
                    Err(e) => warn!(error = %e, "control socket accept failed"),
                },
                _ = processed_rx.recv(), if connected && !eof => {
                    eof = true;
                    if ended.is_none() && !killing.load(Ordering::SeqCst) {
                        eof_deadline = Some(tokio::time::Instant::now() + EOF_GRACE);
                    }
                }
                _ = sleep_until(eof_deadline), if eof_deadline.is_some() && ended.is_none() => {
                    eof_deadline = None;
                    crash.get_or_insert_with(|| "the control connection dropped while the agent kept running".into());
                    c.signal(Signal::SIGKILL);
                }
                _ = sleep_until(drain_deadline), if drain_deadline.is_some() => {
                    // The container is gone but its last lines are still being read or processed (a slow upload,
                    // a leaked descriptor): the run ends without them.
                    warn!("the agent's last control lines were not all processed in time");
                    break;
                }
            }
        }
        for h in helpers {
            h.abort();
        }
        RunEnd {
            // The loop ends only once the container has ended.
            ended: ended.unwrap_or(Ended {
                exit: ProgramExit::Signal(libc::SIGKILL),
                setup_error: None,
            }),
            crash,
        }
    }

    /// Turns the agent's lines into events one at a time, artifact uploads included; says when the connection's
    /// last line is processed.
    async fn process_lines(
        self: Arc<Self>,
        run_id: String,
        mut lines: mpsc::Receiver<Incoming>,
        processed: mpsc::Sender<()>,
    ) {
        while let Some(msg) = lines.recv().await {
            match msg {
                Incoming::Line(bytes) => self.handle_line(&run_id, &bytes).await,
                Incoming::TooLong(n) => {
                    let max = self.engine.config.agents.max_line_bytes;
                    self.hub.emit(
                        &run_id,
                        error_event(
                            &self.agent_id,
                            "warning",
                            &format!(
                                "A control line of {n} bytes was skipped: over agents.max_line_bytes ({max})"
                            ),
                            true,
                            Some("control_line_too_long"),
                            "internal",
                        ),
                    );
                }
                Incoming::Eof => break,
            }
        }
        let _ = processed.send(()).await;
    }

    async fn handle_line(&self, run_id: &str, bytes: &[u8]) {
        match parse_agent_line(bytes) {
            Err(why) => {
                let why: String = why.chars().take(200).collect();
                self.hub.emit(
                    run_id,
                    error_event(
                        &self.agent_id,
                        "warning",
                        &format!("Malformed control line dropped: {why}"),
                        true,
                        Some("malformed_event"),
                        "internal",
                    ),
                );
            }
            Ok(AgentLine::State {
                checkpoint,
                conversation_summary,
            }) => {
                self.shared().checkpoint = Some((checkpoint, conversation_summary));
            }
            Ok(AgentLine::Event(mut event)) => {
                let kind = event
                    .get("type")
                    .and_then(Value::as_str)
                    .unwrap_or_default()
                    .to_owned();
                if kind == "decision" {
                    if let Some(d) = event.get("decisionId").and_then(Value::as_str) {
                        let mut sh = self.shared();
                        sh.pending_decisions.insert(d.to_owned());
                        if sh.status == Some(AgentStatus::Running) {
                            sh.status = Some(AgentStatus::WaitingOnHuman);
                        }
                    }
                }
                let mut failure = None;
                if kind == "artifact" {
                    match self
                        .backend
                        .upload_artifact(
                            &self.engine.store,
                            &self.workspace.workspace(),
                            self.engine.config.artifacts.max_file_bytes,
                            &mut event,
                        )
                        .await
                    {
                        Ok(()) => {
                            if event.contains_key("contentHash") {
                                self.shared().uploads += 1;
                            }
                        }
                        Err(e) => failure = Some(e),
                    }
                }
                self.hub.emit(run_id, event);
                if let Some(e) = failure {
                    self.hub.emit(
                        run_id,
                        error_event(
                            &self.agent_id,
                            "medium",
                            &format!("Artifact not uploaded: {}", Chain(&e)),
                            true,
                            Some("artifact_upload_failed"),
                            "tool",
                        ),
                    );
                }
            }
        }
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
        let mut ops = self.ops.lock().await;
        if changes.contains_key("agentId") {
            return Err(PluginError::invalid("update-brief cannot change agentId"));
        }
        self.send(
            &ops,
            &AgentCommand::UpdateBrief {
                changes: changes.clone(),
            },
        )?;
        if let Some(b) = ops.brief.as_mut() {
            b.extend(changes);
        }
        Ok(())
    }

    fn serialize(&self, ops: &Ops, by: SerializedBy) -> SerializedAgentState {
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
            brief_snapshot: ops.brief.clone().map(Value::Object).unwrap_or(Value::Null),
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

    /// `POST /pause`: freezes the agent's cgroup.
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
        {
            let mut sh = self.shared();
            sh.before_pause = status;
            sh.status = Some(AgentStatus::Paused);
        }
        let run_id = self.shared().run_id.clone();
        self.hub
            .emit(&run_id, lifecycle_event(&self.agent_id, "paused", None));
        Ok(self.serialize(&ops, SerializedBy::Pause))
    }

    /// `POST /resume`: thaws a paused agent.
    /// `POST /resume`: thaws a paused agent; with no agent running, starts a new run from the state's brief
    /// snapshot and hands the agent its checkpoint (`resume` in the brief line).
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
        self.hub
            .emit(&run_id, lifecycle_event(&self.agent_id, "resumed", None));
        Ok(self.handle())
    }

    /// `POST /kill`.
    pub async fn kill(&self, req: KillRequest) -> Result<KillResponse, PluginError> {
        let mut ops = self.ops.lock().await;
        if Self::live(&ops).is_none() {
            return Err(self.invalid("No agent is running in this sandbox"));
        }
        self.stop_run(&mut ops, req, "kill").await
    }

    /// Stops the live run: with grace, a `shutdown` line and SIGTERM, then SIGKILL after the grace period.
    async fn stop_run(
        &self,
        ops: &mut Ops,
        req: KillRequest,
        reason: &str,
    ) -> Result<KillResponse, PluginError> {
        let Some(run) = Self::live(ops) else {
            return Err(self.invalid("No agent is running in this sandbox"));
        };
        let (c, mut done, killing) = (run.container.clone(), run.done.clone(), run.killing.clone());
        killing.store(true, Ordering::SeqCst);
        let uploads_before = self.shared().uploads;
        if self.status() == Some(AgentStatus::Paused) {
            // Frozen tasks cannot act on signals (v1 cannot even die): thaw first.
            if let Err(e) = c.thaw().await {
                warn!(sandbox = %self.id, error = %Chain(&e), "thaw before the kill failed");
            }
        }
        let mut clean = false;
        if req.grace {
            let grace =
                Duration::from_millis(req.grace_timeout_ms.unwrap_or(DEFAULT_GRACE_TIMEOUT_MS));
            let _ = run.commands.try_send(line(&AgentCommand::Shutdown {
                grace_timeout_ms: grace.as_millis() as u64,
            }));
            c.signal(Signal::SIGTERM);
            if tokio::time::timeout(grace, done.wait_for(|d| *d))
                .await
                .is_ok()
            {
                clean = self.shared().last_exit == Some(ProgramExit::Code(0));
            }
        }
        if !*done.borrow() {
            c.signal(Signal::SIGKILL);
            if tokio::time::timeout(Duration::from_secs(10), done.wait_for(|d| *d))
                .await
                .is_err()
            {
                return Err(unavailable(
                    "The agent did not stop within 10 s of SIGKILL",
                    true,
                ));
            }
        }
        let state = (req.grace && self.shared().checkpoint.is_some())
            .then(|| self.serialize(ops, SerializedBy::KillGrace));
        let artifacts_extracted = self.shared().uploads - uploads_before;
        let run_id = self.shared().run_id.clone();
        self.hub.emit(
            &run_id,
            lifecycle_event(&self.agent_id, "killed", Some(reason)),
        );
        Ok(KillResponse {
            state,
            artifacts_extracted,
            clean_shutdown: clean,
        })
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
        let disk_mb = nix::sys::statvfs::statvfs(&self.workspace.workspace())
            .map(|s| {
                (s.blocks().saturating_sub(s.blocks_free()) as f64 * s.fragment_size() as f64)
                    / (1u64 << 20) as f64
            })
            .unwrap_or(0.0);
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
        }
    }

    /// Kills the run (if any), stops the tasks and removes the workspace. Idempotent.
    pub async fn destroy(&self) {
        let mut ops = self.ops.lock().await;
        if Self::live(&ops).is_some() {
            if let Err(e) = self
                .stop_run(
                    &mut ops,
                    KillRequest {
                        grace: false,
                        grace_timeout_ms: None,
                    },
                    "deleted",
                )
                .await
            {
                warn!(sandbox = %self.id, error = %e, "agent not stopped at removal");
            }
        }
        ops.run = None;
        for t in self
            .tasks
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .drain(..)
        {
            t.abort();
        }
        self.hub.close();
        self.workspace.remove().await;
    }
}

/// How a run's watch ended.
struct RunEnd {
    /// How the container ended.
    ended: Ended,
    /// Why sandboxd stopped the run, if it did.
    crash: Option<String>,
}

/// Why a run counts as crashed, if it does: not when it was killed on request; otherwise sandboxd's own reason,
/// the init's setup failure, or any end but exit status 0.
fn crash_reason(killed: bool, crash: Option<String>, ended: &Ended) -> Option<String> {
    if killed {
        None
    } else if let Some(why) = crash {
        Some(why)
    } else if let Some(setup) = &ended.setup_error {
        Some(format!("the sandbox setup failed: {setup}"))
    } else {
        match ended.exit {
            ProgramExit::Code(0) => None,
            e => Some(format!("the agent ended: {}", e.describe())),
        }
    }
}

fn line(cmd: &AgentCommand) -> String {
    let mut s = serde_json::to_string(cmd).unwrap_or_default();
    s.push('\n');
    s
}

enum Incoming {
    Line(Vec<u8>),
    /// A line over the limit, skipped: its length.
    TooLong(u64),
    Eof,
}

/// Reads the agent's lines (at most `max` bytes each; a longer one is skipped to its newline) and hands them to the
/// processor one at a time.
async fn read_lines(r: tokio::net::unix::OwnedReadHalf, tx: mpsc::Sender<Incoming>, max: u64) {
    let mut reader = tokio::io::BufReader::new(r);
    loop {
        let mut buf = Vec::new();
        let n = (&mut reader)
            .take(max + 1)
            .read_until(b'\n', &mut buf)
            .await
            .unwrap_or_default();
        if n == 0 {
            break;
        }
        if buf.last() != Some(&b'\n') && buf.len() as u64 > max {
            let len = buf.len() as u64;
            drop(buf);
            let skipped = len + skip_line(&mut reader).await;
            if tx.send(Incoming::TooLong(skipped)).await.is_err() {
                return;
            }
            continue;
        }
        while buf.last().is_some_and(|b| *b == b'\n' || *b == b'\r') {
            buf.pop();
        }
        if buf.is_empty() {
            continue;
        }
        if tx.send(Incoming::Line(buf)).await.is_err() {
            return;
        }
    }
    let _ = tx.send(Incoming::Eof).await;
}

/// Discards the rest of a line without keeping it; returns how many bytes that was (with the newline).
async fn skip_line(r: &mut tokio::io::BufReader<tokio::net::unix::OwnedReadHalf>) -> u64 {
    let mut skipped = 0u64;
    loop {
        let buf = match r.fill_buf().await {
            Ok(b) if !b.is_empty() => b,
            _ => return skipped,
        };
        match buf.iter().position(|b| *b == b'\n') {
            Some(i) => {
                r.consume(i + 1);
                return skipped + i as u64 + 1;
            }
            None => {
                let n = buf.len();
                r.consume(n);
                skipped += n as u64;
            }
        }
    }
}

async fn write_lines(
    mut w: tokio::net::unix::OwnedWriteHalf,
    first: String,
    mut rx: mpsc::Receiver<String>,
) {
    if w.write_all(first.as_bytes()).await.is_err() {
        return;
    }
    while let Some(l) = rx.recv().await {
        if w.write_all(l.as_bytes()).await.is_err() {
            return;
        }
    }
}

async fn sleep_until(at: Option<tokio::time::Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_run_is_a_crash_unless_killed_or_exited_zero() {
        let why = |killed, crash: Option<&str>, exit, setup: Option<&str>| {
            let ended = Ended {
                exit,
                setup_error: setup.map(str::to_owned),
            };
            crash_reason(killed, crash.map(str::to_owned), &ended)
        };
        // A kill on request is never a crash, whatever the exit or reason.
        assert_eq!(
            why(true, Some("x"), ProgramExit::Signal(9), Some("landlock")),
            None
        );
        assert_eq!(why(false, None, ProgramExit::Code(0), None), None);
        // sandboxd's own reason wins over the setup error and the exit.
        assert_eq!(
            why(
                false,
                Some("control line too long"),
                ProgramExit::Code(0),
                Some("landlock")
            )
            .as_deref(),
            Some("control line too long")
        );
        assert_eq!(
            why(false, None, ProgramExit::Signal(9), Some("landlock")).as_deref(),
            Some("the sandbox setup failed: landlock")
        );
        assert_eq!(
            why(false, None, ProgramExit::Code(3), None).as_deref(),
            Some("the agent ended: exit status 3")
        );
        assert_eq!(
            why(false, None, ProgramExit::Signal(9), None).as_deref(),
            Some("the agent ended: killed by SIGKILL")
        );
    }
}

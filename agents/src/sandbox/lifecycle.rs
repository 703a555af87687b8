//! A sandbox's runs from start to end: spawn (one run at a time: the control socket, the run's container with the
//! agent's command and environment, its CPU quota, the sandbox's egress proxy served inside it, the launch), the
//! supervisor that turns the container's end into `session_end` or `crashed`, kill with grace (a `shutdown` line
//! and `SIGTERM`, then `SIGKILL`), the lifetime limit, and removal.

use std::os::fd::AsFd;
use std::os::unix::fs::PermissionsExt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use agent_api::{
    error_event, lifecycle_event, AgentBrief, AgentCommand, AgentHandle, AgentStatus, KillRequest,
    KillResponse, PluginError, SerializedBy, DEFAULT_GRACE_TIMEOUT_MS,
};
use nix::sys::signal::Signal;
use runtime::error::Chain;
use runtime::init::ProgramExit;
use runtime::rootfs::CODE_DIR;
use serde_json::Value;
use tokio::sync::{mpsc, watch};
use tracing::{info, warn, Instrument};

use super::control::First;
use super::spool::Spool;
use super::{line, unavailable, Ops, Run, Sandbox, COMMAND_QUEUE, CONTROL_SOCKET};
use crate::network::Serving;
use crate::restore::RunRecord;
use crate::volumes::{Mounted, Volumes};
use containers::agent::{BoxFuture, Ended, RunContainer, RunPlan};

impl Sandbox {
    /// Starts the sandbox's background tasks: token renewal and the lifetime limit.
    pub fn start_tasks(self: &Arc<Self>) {
        let me = Arc::downgrade(self);
        let renew = tokio::spawn(self.backend.clone().renew_loop(move || {
            if let Some(sb) = me.upgrade() {
                sb.persist();
            }
        }));
        let me = Arc::downgrade(self);
        // What is left of it (a sandbox taken back from a previous daemon has lived a while).
        let lifetime =
            Duration::from_millis(self.limits.timeout_ms).saturating_sub(self.created.elapsed());
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

    /// `POST /spawn`.
    #[tracing::instrument(name = "agent_spawn", skip_all, fields(sandbox = %self.id))]
    pub async fn spawn(self: &Arc<Self>, brief: AgentBrief) -> Result<AgentHandle, PluginError> {
        let mut ops = self.ops.lock().await;
        self.spawn_locked(&mut ops, brief, None).await
    }

    /// Starts a run; `resume` is the agent's checkpoint from a stored state (handed to it in the brief line).
    pub(super) async fn spawn_locked(
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
        let keep = self.host.settings.agents.live_restore;
        let control = keep.then(|| listener.as_fd());
        let (c, serving) = self.start_container(&cid, command, control).await?;
        info!(sandbox = %self.id, container = %c.cid(), run = %run_id, "agent started");

        let brief_map = match serde_json::to_value(&brief) {
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
        {
            let mut sh = self.shared();
            sh.brief = brief_map;
            sh.kept = c.init().map(|init| RunRecord {
                cid: cid.clone(),
                init,
                brief_line: brief_line.clone(),
                connected: false,
            });
            if keep && sh.kept.is_none() {
                warn!(sandbox = %self.id, "the run's init is not known: a later daemon cannot take this run back");
            }
        }
        self.hub
            .emit(&run_id, lifecycle_event(&self.agent_id, "started", None));
        self.persist();
        // A kept run's lines are spooled until processed, for a daemon after this one.
        let spool = match keep {
            true => match Spool::create(&self.dir) {
                Ok(s) => Some((s, Vec::new(), 0)),
                Err(e) => {
                    warn!(sandbox = %self.id, error = %e, "no control spool: lines read when the daemon dies may be lost");
                    None
                }
            },
            false => None,
        };
        let first = First {
            pre: None,
            brief: brief_line,
            spool,
        };
        self.supervised(ops, (c, serving), listener, first, run_id);
        Ok(self.handle())
    }

    /// Takes back the live run a previous daemon recorded (live restore): its container, its control socket and
    /// the agent's connection from the run's init, and a supervisor as a spawn would start. A run that cannot be
    /// taken back (its init is gone) ends as a crash, with why; its cgroups were removed as leftovers at start.
    pub async fn adopt_run(self: &Arc<Self>, run: RunRecord) -> Result<(), String> {
        let mut ops = self.ops.lock().await;
        let run_id = self.shared().run_id.clone();
        let adopted = self.workspace.adopt_run(&run.cid, run.init).await;
        let (c, io) = match adopted {
            Ok(a) => a,
            Err(e) => return Err(self.not_taken_back(&run_id, Chain(&e).to_string())),
        };
        self.thaw_unless_paused(&*c).await;
        // Its egress proxy is served again at the same address in its network namespace (the previous daemon's
        // listener went with it).
        let serving = match self.network.as_ref().map(|n| n.serve_in(&*c)).transpose() {
            Ok(s) => s,
            Err(e) => {
                c.signal(Signal::SIGKILL);
                c.remove().await;
                let why = format!("its egress proxy cannot be served in it: {}", Chain(&e));
                return Err(self.not_taken_back(&run_id, why));
            }
        };
        let listener = std::os::unix::net::UnixListener::from(io.control);
        let pre = io.conn.map(std::os::unix::net::UnixStream::from);
        let tokio_io = listener
            .set_nonblocking(true)
            .and_then(|()| tokio::net::UnixListener::from_std(listener))
            .and_then(|l| {
                let pre = pre
                    .map(|p| {
                        p.set_nonblocking(true)?;
                        tokio::net::UnixStream::from_std(p)
                    })
                    .transpose()?;
                Ok((l, pre))
            });
        let (listener, pre) = match tokio_io {
            Ok(x) => x,
            Err(e) => {
                c.signal(Signal::SIGKILL);
                c.remove().await;
                return Err(format!("the run's control socket cannot be served: {e}"));
            }
        };
        let spool = match Spool::reopen(&self.dir) {
            Ok(s) => Some(s),
            Err(e) => {
                warn!(sandbox = %self.id, error = %e, "the control spool cannot be read: the lines the previous daemon read and did not process are lost");
                None
            }
        };
        // An agent whose brief the record does not say is out gets it from this daemon (when it connects, or now if
        // it connected to a daemon that died before the brief was written: twice rather than never).
        let first = if run.connected {
            String::new()
        } else {
            run.brief_line.clone()
        };
        {
            let mut sh = self.shared();
            sh.container = Some(c.clone());
            sh.kept = Some(run);
        }
        info!(sandbox = %self.id, container = %c.cid(), run = %run_id, "agent run taken back");
        let first = First {
            pre,
            brief: first,
            spool,
        };
        self.supervised(&mut ops, (c, serving), listener, first, run_id);
        Ok(())
    }

    /// A daemon that died during a snapshot or a fork left a running agent frozen: it is thawed, since only a
    /// pause keeps an agent frozen. One that cannot be thawed is said to be paused (a resume thaws it again).
    async fn thaw_unless_paused(&self, c: &dyn RunContainer) {
        if self.status() == Some(AgentStatus::Paused) {
            return;
        }
        if let Err(e) = c.thaw().await {
            warn!(sandbox = %self.id, error = %Chain(&e), "cannot thaw the agent taken back; it is paused");
            self.mark_paused(Some("not thawed after a daemon restart"));
        }
    }

    /// A kept run that could not be taken back (`why`): it ends as a crash with the reason, and the sandbox
    /// stays. Returns the reason.
    fn not_taken_back(&self, run_id: &str, why: String) -> String {
        let why = format!("the run could not be taken back after a daemon restart: {why}");
        {
            let mut sh = self.shared();
            sh.kept = None;
            sh.status = Some(AgentStatus::Error);
            sh.before_pause = None;
        }
        self.hub.emit(
            run_id,
            lifecycle_event(&self.agent_id, "crashed", Some(&why)),
        );
        self.persist();
        why
    }

    /// Makes `c` the live run and starts its supervisor in the run's span: a child of the spawn (or resume, or
    /// restore) that started it, open until the run has ended, with how it ended (`completed`, `killed` or
    /// `crashed`, the last an error).
    fn supervised(
        self: &Arc<Self>,
        ops: &mut Ops,
        (c, serving): (Arc<dyn RunContainer>, Option<Serving>),
        listener: tokio::net::UnixListener,
        first: First,
        run_id: String,
    ) {
        let (commands, commands_rx) = mpsc::channel(COMMAND_QUEUE);
        let (done_tx, done) = watch::channel(false);
        let killing = Arc::new(AtomicBool::new(false));
        ops.run = Some(Run {
            commands,
            done,
            killing: killing.clone(),
            container: c.clone(),
        });
        let span = tracing::info_span!(
            "agent",
            sandbox = %self.id,
            run = %run_id,
            outcome = tracing::field::Empty,
            otel.status_code = tracing::field::Empty,
        );
        tokio::spawn(
            self.clone()
                .supervise(
                    (c, serving),
                    listener,
                    first,
                    commands_rx,
                    run_id,
                    killing,
                    done_tx,
                )
                .instrument(span),
        );
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

    /// Creates the run's container (stdin `/dev/null`, output to the agent log), sets its cpu quota, serves the
    /// sandbox's egress proxy inside it (when it has one) and launches the agent. On error nothing of the
    /// container is left.
    async fn start_container(
        &self,
        cid: &str,
        args: Vec<String>,
        control: Option<std::os::fd::BorrowedFd<'_>>,
    ) -> Result<(Arc<dyn RunContainer>, Option<Serving>), PluginError> {
        let stdin = std::fs::File::open("/dev/null")
            .map_err(|e| unavailable(format!("/dev/null: {e}"), false))?;
        let log = open_agent_log(&self.dir.join("scratch/agent.log"))
            .map_err(|e| unavailable(format!("Cannot open the agent log: {e}"), false))?;
        let plan = RunPlan {
            cid,
            args,
            env: self.environment(),
            memory_mb: self.limits.memory_mb,
            pids_max: self.host.settings.agents.pids_max,
            shm_bytes: (self.limits.disk_mb << 20).min(64 << 20),
            keep: control.is_some(),
            home: None,
        };
        let c = self
            .workspace
            .create_run(plan)
            .await
            .map_err(|e| unavailable(Chain(&e).to_string(), true))?;
        let started = c.set_cpu_quota(self.limits.cpu_cores.get()).and_then(|()| {
            let serving = self.network.as_ref().map(|n| n.serve_in(&*c)).transpose()?;
            c.launch([stdin.as_fd(), log.as_fd(), log.as_fd()], control)?;
            Ok(serving)
        });
        match started {
            Ok(serving) => Ok((c, serving)),
            Err(e) => {
                c.signal(Signal::SIGKILL);
                c.remove().await;
                Err(unavailable(Chain(&e).to_string(), true))
            }
        }
    }

    /// The agent's environment: the image's base, the template's, the egress proxy's (when the sandbox has one),
    /// and where its control socket is.
    fn environment(&self) -> Vec<String> {
        let mut env = self
            .host
            .containers
            .image_environment(&self.image)
            .unwrap_or_default();
        env.extend(self.template.env.clone());
        if let Some(network) = &self.network {
            env.extend(network.environment());
        }
        env.insert(
            "SANDBOXD_CONTROL_SOCKET".into(),
            format!("{CODE_DIR}/{CONTROL_SOCKET}"),
        );
        env.insert("SANDBOXD_SANDBOX_ID".into(), self.id.clone());
        env.insert("SANDBOXD_AGENT_ID".into(), self.agent_id.clone());
        env.into_iter().map(|(k, v)| format!("{k}={v}")).collect()
    }

    /// The run's supervisor: accepts the agent's control connection, sends it the brief and the commands, turns its
    /// lines into events, and ends the run when the container exits (the egress proxy stops serving it then).
    #[allow(clippy::too_many_arguments)]
    pub(super) async fn supervise(
        self: Arc<Self>,
        (c, serving): (Arc<dyn RunContainer>, Option<Serving>),
        listener: tokio::net::UnixListener,
        first: First,
        commands_rx: mpsc::Receiver<String>,
        run_id: String,
        killing: Arc<AtomicBool>,
        done_tx: watch::Sender<bool>,
    ) {
        let end = self
            .watch_run(&*c, listener, first, commands_rx, &run_id, &killing)
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
            sh.kept = None;
        }
        self.persist();
        let span = tracing::Span::current();
        span.record(
            "outcome",
            match (&crashed, killed) {
                (Some(_), _) => "crashed",
                (None, true) => "killed",
                (None, false) => "completed",
            },
        );
        match &crashed {
            Some(why) => {
                span.record("otel.status_code", "ERROR");
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
        drop(serving);
        c.remove().await;
        let _ = std::fs::remove_file(self.dir.join("code").join(CONTROL_SOCKET));
        self.shared().container = None;
        let _ = done_tx.send(true);
    }

    /// `POST /kill`.
    #[tracing::instrument(name = "agent_kill", skip_all, fields(sandbox = %self.id))]
    pub async fn kill(&self, req: KillRequest) -> Result<KillResponse, PluginError> {
        let mut ops = self.ops.lock().await;
        if Self::live(&ops).is_none() {
            return Err(self.invalid("No agent is running in this sandbox"));
        }
        self.stop_run(&mut ops, req, "kill").await
    }

    /// Stops the live run: with grace, a `shutdown` line and SIGTERM, then SIGKILL after the grace period.
    pub(super) async fn stop_run(
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
            .then(|| self.serialize(SerializedBy::KillGrace));
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

    /// Kills the run (if any), stops the tasks, closes the egress proxy, scans the volumes it wrote (`reason`:
    /// `deleted` or `shutdown`), removes the workspace and frees its volumes. Idempotent.
    #[tracing::instrument(name = "agent_destroy", skip_all, fields(sandbox = %self.id))]
    pub async fn destroy(&self, reason: &str) {
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
        if let Some(network) = &self.network {
            network.close();
        }
        self.hub.close();
        let mounts = std::mem::take(&mut *self.mounts.lock().unwrap_or_else(|p| p.into_inner()));
        self.scan_volumes(&mounts, reason).await;
        // The volumes' binds go with the workspace's tmpfs; only then are they free for another writer.
        self.workspace.remove().await;
        if let Some(volumes) = &self.volumes {
            for m in mounts {
                volumes
                    .release(&m.volume, &self.id, &m.path, m.read_only)
                    .await;
            }
        }
    }

    /// Scans each volume it wrote (a failed upload is retried with its credentials).
    async fn scan_volumes(&self, mounts: &[Mounted], reason: &str) {
        let Some(volumes) = &self.volumes else {
            return;
        };
        for m in mounts {
            if !m.read_only {
                let reupload = |rel: String| -> BoxFuture<'_, bool> {
                    let uri = format!("{}/{rel}", m.path);
                    Box::pin(async move {
                        let mut event = serde_json::Map::new();
                        event.insert("type".into(), "artifact".into());
                        event.insert("uri".into(), uri.into());
                        let uploaded = self.upload_artifact(&mut event).await;
                        uploaded.is_ok() && event.contains_key("uri")
                    })
                };
                volumes
                    .recover(&m.volume, &self.id, reason, &reupload)
                    .await;
            }
        }
    }

    /// Uploads the file an `ArtifactEvent` names from this sandbox's workspace ([`Backend::upload_artifact`]).
    pub(super) async fn upload_artifact(
        &self,
        event: &mut serde_json::Map<String, Value>,
    ) -> Result<(), crate::backend::ArtifactError> {
        self.backend
            .upload_artifact(
                &self.host.store,
                &self.workspace.workspace(),
                self.host.settings.max_artifact_bytes,
                event,
            )
            .await
    }

    /// The volume a sandbox path lies in (written by this sandbox) and its path there.
    pub(super) fn written_volume(&self, uri: &str) -> Option<(Arc<Volumes>, String, String)> {
        let volumes = self.volumes.clone()?;
        let mounts = self.mounts.lock().unwrap_or_else(|p| p.into_inner());
        mounts
            .iter()
            .filter(|m| !m.read_only)
            .find_map(|m| Some((volumes.clone(), m.volume.clone(), m.inside(uri)?)))
    }
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

/// Opens (creates) the agent log for appending. It lies in the sandbox's scratch space, which the sandbox's uid
/// owns: a link there is never followed, a FIFO never waited on, and only a regular file is written.
fn open_agent_log(path: &std::path::Path) -> std::io::Result<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt;
    let f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)?;
    if !f.metadata()?.is_file() {
        return Err(std::io::Error::other("not a regular file"));
    }
    // The agent's output goes to it as it would to any file: blocking.
    let fd = std::os::fd::AsRawFd::as_raw_fd(&f);
    let flags = nix::fcntl::OFlag::from_bits_retain(nix::fcntl::fcntl(fd, nix::fcntl::F_GETFL)?);
    nix::fcntl::fcntl(
        fd,
        nix::fcntl::F_SETFL(flags - nix::fcntl::OFlag::O_NONBLOCK),
    )?;
    Ok(f)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The agent log is opened only as a regular file: a link the sandbox put there is not followed, a FIFO not
    /// waited on; the file is written blocking.
    #[test]
    fn the_agent_log_is_a_regular_file_or_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("host-file");
        std::fs::write(&target, "the host's").unwrap();
        let link = dir.path().join("link.log");
        std::os::unix::fs::symlink(&target, &link).unwrap();
        assert!(open_agent_log(&link).is_err());
        assert_eq!(std::fs::read_to_string(&target).unwrap(), "the host's");
        let fifo = dir.path().join("fifo.log");
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
        assert!(open_agent_log(&fifo).is_err());
        let log = dir.path().join("agent.log");
        let f = open_agent_log(&log).unwrap();
        let flags =
            nix::fcntl::fcntl(std::os::fd::AsRawFd::as_raw_fd(&f), nix::fcntl::F_GETFL).unwrap();
        assert_eq!(flags & libc::O_NONBLOCK, 0);
        assert!(log.is_file());
    }

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

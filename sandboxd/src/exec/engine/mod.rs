//! The execution engine: turns one accepted `execute` into a container run and a stream of protocol messages.
//!
//! One task per execution. It waits for a slot, takes a container (a ready one from the [`crate::exec::pool`], or one
//! created on the spot), writes the code and input files and the request's cgroup limits into it, launches the
//! program over the container's launch channel, streams stdout/stderr with the output limit enforced to the byte,
//! enforces the wall-clock timeout, obeys cancel and disconnect, reads how the program ended from the init's status
//! pipe and the usage from the cgroup, then reports the terminal status and the result. The container is removed
//! in the background afterwards; every path out of [`Engine::run`] that took a container hands it to the removal.
//!
//! Parts: [`streams`] (stdio and output), [`outcome`] (why it ended: a pure function), [`artifacts`] (collection,
//! manifest, upload).

mod artifacts;
mod error;
pub mod outcome;
mod streams;

use std::collections::{BTreeMap, VecDeque};
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use protocol::{
    Capabilities, ErrorCode, ErrorMessage, ExecStatus, ExecuteRequest, Isolation, Language, Limits,
    Load, Pong, Reason, ResourceUsage, ResultMessage, ServerMessage,
};
use runtime::cgroups::{CgroupLimits, CpuQuota};
use runtime::init::{ProgramExit, Report};
use runtime::launch::Launch;
use runtime::rootfs::{InputFile, CODE_DIR};
use tokio::sync::mpsc::error::SendError;
use tokio::sync::{mpsc, watch};
use tracing::{debug, error, info, warn, Instrument};

pub use self::error::ExecError;
use self::outcome::KillReason;
use self::streams::{make_stdio, Stdio, Streams};
use crate::config::Config;
use crate::daemon::{Daemon, Drained};
use crate::exec::capacity::{Admission, Capacity, Slot};
use crate::exec::pool::{Container, Pool};
use crate::exec::registry::{Control, Registration};
use containers::image::LanguageRuntime;
use containers::{ContainerHandle, EndRecord, PrepareError, VolumeBind};
use runtime::error::Chain;

/// Executions so far (keys of their metrics).
static EXECUTIONS: AtomicU64 = AtomicU64::new(0);
/// How long output may keep flowing after the init exited (the pipes close when the pid namespace is gone).
const DRAIN_AFTER_EXIT: Duration = Duration::from_secs(2);
/// Messages an execution buffers while the connection is slow before it stops reading the program's output.
const MAX_PENDING: usize = 4;

/// Everything executions share: the daemon's context, the containers, the languages and admission.
pub struct Engine {
    /// The daemon's context (configuration, store, drain).
    daemon: Arc<Daemon>,
    /// Containers: the warm pool and the cold path.
    pool: Arc<Pool>,
    /// Languages, each with its image and interpreter.
    languages: BTreeMap<Language, LanguageRuntime>,
    /// Admission control.
    capacity: Capacity,
    /// Isolation layers in effect.
    isolation: Isolation,
    /// sha256 of the seccomp profile in force (part of every environment fingerprint).
    seccomp_digest: String,
    /// The `network` extension, when the operator enabled it.
    egress: Option<Arc<crate::extensions::egress::Egress>>,
    /// The `volumes` extension: the volumes agent sandboxes share (set once, before the server listens, when the
    /// host can make them).
    volumes: std::sync::OnceLock<Arc<agents::volumes::Volumes>>,
    /// The agent sandboxes' snapshots (extension `snapshots`), set once the agent registry exists.
    snapshots: std::sync::OnceLock<Arc<agents::snapshots::Snapshots>>,
}

/// What an execution's body hands back: the messages to send (or the error), and the container to remove.
type Finished = (Option<Container>, Result<Vec<ServerMessage>, Failure>);

impl Engine {
    /// Assembles the engine.
    pub fn new(
        daemon: Arc<Daemon>,
        pool: Arc<Pool>,
        languages: BTreeMap<Language, LanguageRuntime>,
        isolation: Isolation,
        seccomp_digest: String,
        egress: Option<crate::extensions::egress::Egress>,
    ) -> Self {
        let c = &daemon.config().capacity;
        let capacity = Capacity::new(c.max_concurrent, c.max_queue);
        Self {
            daemon,
            pool,
            languages,
            capacity,
            isolation,
            seccomp_digest,
            egress: egress.map(Arc::new),
            volumes: std::sync::OnceLock::new(),
            snapshots: std::sync::OnceLock::new(),
        }
    }

    /// Whether the request's mounts can be served: the extension is there and each volume exists (a second
    /// writer is only known when the volume is claimed, after the `ack`).
    pub fn check_mounts(&self, req: &ExecuteRequest) -> Result<(), String> {
        if req.mounts.is_empty() {
            return Ok(());
        }
        let Some(volumes) = self.volumes.get() else {
            return Err("Field mounts: this server has no volumes (extension volumes)".into());
        };
        match req.mounts.iter().position(|m| !volumes.contains(&m.volume)) {
            Some(i) => Err(format!(
                "Field mounts[{i}]: No volume {:?}",
                req.mounts[i].volume
            )),
            None => Ok(()),
        }
    }

    /// Gives executions the volumes (extension `volumes`); once, before the server listens.
    pub fn set_volumes(&self, volumes: Arc<agents::volumes::Volumes>) {
        let _ = self.volumes.set(volumes);
    }

    /// Whether the request's snapshot can be served: the extension is there and the snapshot exists.
    pub fn check_snapshot(&self, req: &ExecuteRequest) -> Result<(), String> {
        let Some(id) = &req.snapshot else {
            return Ok(());
        };
        match self.snapshots.get() {
            None => {
                Err("Field snapshot: this server has no snapshots (extension snapshots)".into())
            }
            Some(s) if !s.contains(id) => Err(format!("Field snapshot: No snapshot {id:?}")),
            Some(_) => Ok(()),
        }
    }

    /// Gives executions the agent sandboxes' snapshots (extension `snapshots`); once, before the server listens.
    pub fn set_snapshots(&self, snapshots: Arc<agents::snapshots::Snapshots>) {
        let _ = self.snapshots.set(snapshots);
    }

    /// The `network` extension, when enabled.
    pub fn egress(&self) -> Option<&Arc<crate::extensions::egress::Egress>> {
        self.egress.as_ref()
    }

    /// The daemon's context.
    pub fn daemon(&self) -> &Arc<Daemon> {
        &self.daemon
    }

    /// The configuration in force.
    fn config(&self) -> &Config {
        self.daemon.config()
    }

    /// The containers: the warm pool and the factory behind it.
    pub fn pool(&self) -> &Arc<Pool> {
        &self.pool
    }

    /// The runtime of `language`, if this daemon runs it.
    pub fn language(&self, language: Language) -> Option<&LanguageRuntime> {
        self.languages.get(&language)
    }

    /// Every language this daemon runs, with its runtime.
    pub fn languages(&self) -> &BTreeMap<Language, LanguageRuntime> {
        &self.languages
    }

    /// The configured maximum of every limit.
    pub fn max_limits(&self) -> Limits {
        self.config().limits.max
    }

    /// Whether the container layer can still create and run containers (every helper process alive).
    pub fn healthy(&self) -> bool {
        self.pool.factory().alive()
    }

    /// Executions running and queued.
    pub fn load(&self) -> Load {
        Load {
            active_executions: self.capacity.active() as u64,
            queue_depth: self.capacity.queued() as u64,
        }
    }

    /// `GET /healthz`: whether the daemon is healthy, and what it reports.
    pub fn health(&self) -> (bool, serde_json::Value) {
        let healthy = self.healthy();
        let c = &self.config().capacity;
        let body = serde_json::json!({
            "status": if healthy { "ok" } else { "unhealthy" },
            "version": env!("CARGO_PKG_VERSION"),
            "uptime_s": self.daemon.uptime().as_secs(),
            "active_executions": self.capacity.active(),
            "queue_depth": self.capacity.queued(),
            "max_concurrent": c.max_concurrent,
            "max_queue": c.max_queue,
            "languages": self.languages.keys().collect::<Vec<_>>(),
            // Which image each language runs on, by manifest digest (what `environment.image_digest` says).
            "images": self
                .languages
                .iter()
                .map(|(l, r)| (l.as_str().to_owned(), serde_json::json!({"image": r.image.name, "digest": r.image.digest})))
                .collect::<serde_json::Map<String, serde_json::Value>>(),
            "isolation": self.isolation,
            "pool": self.pool.status(),
            "helpers": self.pool.factory().helper_count(),
        });
        (healthy, body)
    }

    /// Stops admitting executions (queued ones are refused) and drains the running ones within `grace`, killing
    /// what is left at its end.
    pub async fn drain(&self, grace: Duration) -> Drained {
        self.capacity.close();
        self.daemon.drain(grace).await
    }

    /// Protocol extensions this server implements.
    pub fn extensions(&self) -> Vec<String> {
        let mut extensions: Vec<String> = protocol::SANDBOXD_EXTENSIONS
            .iter()
            .map(|e| (*e).to_owned())
            .collect();
        if self.egress.is_some() {
            extensions.push("network".to_owned());
        }
        if self.volumes.get().is_some() {
            extensions.push("volumes".to_owned());
        }
        if self.snapshots.get().is_some() {
            extensions.push("snapshots".to_owned());
        }
        extensions
    }

    /// The `pong` for a `ping`.
    pub fn pong(&self) -> Pong {
        Pong {
            load: self.load(),
            capabilities: Some(Capabilities {
                languages: self.languages.keys().copied().collect(),
                max_limits: self.max_limits(),
                extensions: self.extensions(),
                isolation: self.isolation.clone(),
            }),
        }
    }

    /// Admission for a new execution (decided at once).
    pub fn admit(&self) -> Admission {
        self.capacity.admit()
    }

    /// Runs one accepted execution to its end. `out` is the connection's ordered message queue for executions,
    /// `control` tells of a cancel; a dropped `control` sender means the client is gone.
    pub async fn run(
        self: Arc<Self>,
        req: ExecuteRequest,
        limits: Limits,
        admission: Admission,
        out: mpsc::Sender<ServerMessage>,
        mut control: watch::Receiver<Control>,
        registration: Registration,
    ) {
        let id = req.id.clone();
        let timer = crate::observe::metrics::ExecutionTimer::begin(req.language);
        let queued = matches!(admission, Admission::Queued(_));
        let environment = self
            .languages
            .get(&req.language)
            .map(|l| Box::new(l.environment(&self.seccomp_digest)));
        let _ = out
            .send(ServerMessage::Ack {
                id: id.clone(),
                limits: Some(limits),
                queued: Some(queued),
                environment_fingerprint: environment.as_ref().map(|e| e.fingerprint(&limits)),
                environment,
            })
            .await;
        let slot = match admission {
            Admission::Run(slot) => slot,
            Admission::Queued(ticket) => {
                tokio::select! {
                    slot = ticket.wait().instrument(tracing::info_span!("queue_wait")) => match slot {
                        Some(s) => s,
                        None => {
                            registration.release();
                            timer.ended_without_slot("error");
                            let _ = out.send(ServerMessage::Error(internal_error(&id, &ExecError::ShuttingDown))).await;
                            return;
                        }
                    },
                    _ = cancelled(&mut control) => {
                        // Cancelled (or the client left) while queued: it never ran.
                        registration.release();
                        timer.ended_without_slot("cancelled");
                        for m in cancelled_before_start(&id) {
                            let _ = out.send(m).await;
                        }
                        return;
                    }
                }
            }
            Admission::Overloaded => {
                registration.release();
                timer.ended_without_slot("overloaded");
                let _ = out
                    .send(ServerMessage::Error(ErrorMessage::overloaded(&id)))
                    .await;
                return;
            }
        };
        let key = format!("x{}", EXECUTIONS.fetch_add(1, Ordering::Relaxed));
        timer.slot_acquired(&key);
        let span = tracing::info_span!("execution", slot = slot.index());
        self.run_in_slot(req, limits, slot, key, out, control, registration)
            .instrument(span)
            .await
    }

    #[allow(clippy::too_many_arguments)] // one call site; every argument is a distinct part of the execution
    async fn run_in_slot(
        self: Arc<Self>,
        req: ExecuteRequest,
        limits: Limits,
        slot: Slot,
        key: String,
        out: mpsc::Sender<ServerMessage>,
        control: watch::Receiver<Control>,
        registration: Registration,
    ) {
        let tool_inbox = registration.tool_inbox();
        let (container, outcome) = self
            .clone()
            .execute(&req, &limits, &key, &out, control, tool_inbox)
            .await;
        // The result does not wait for the container's removal, which starts in the background once the result is
        // queued for the client (so the client's wake-up does not queue behind the removal's work). One that
        // mounted volumes or started from a snapshot is removed before the result, so that they are free (for the
        // next writer, or to delete) when the client learns that the execution ended.
        let background = match container {
            Some(c) if c.holds_shared_storage() => {
                self.pool.factory().remove(c).await;
                None
            }
            other => other,
        };
        registration.release();
        match outcome {
            Ok(messages) => {
                for m in messages {
                    let _ = out.send(m).await;
                }
            }
            Err(Failure::Refused(message)) => {
                let _ = out.send(ServerMessage::Error(message)).await;
            }
            Err(Failure::Internal(e)) => {
                let _ = out
                    .send(ServerMessage::Error(internal_error(&req.id, &e)))
                    .await;
            }
        }
        if let Some(c) = background {
            self.pool.factory().remove_in_background(c);
        }
        crate::observe::metrics::finished(&key);
        debug!(id = %req.id, "execution finished");
        drop(slot);
        self.pool.replenish(req.language);
    }

    /// The body of an execution: the final messages (terminal status and result) or the error to send, and the
    /// container to remove.
    async fn execute(
        self: Arc<Self>,
        req: &ExecuteRequest,
        limits: &Limits,
        key: &str,
        out: &mpsc::Sender<ServerMessage>,
        control: watch::Receiver<Control>,
        tool_inbox: crate::extensions::tools::Inbox,
    ) -> Finished {
        let id = req.id.as_str();
        let Some(lang) = self.languages.get(&req.language).cloned() else {
            let refusal = ErrorMessage::new(
                Some(id.into()),
                ErrorCode::LanguageNotSupported,
                "Language not available",
            );
            return (None, Err(Failure::Refused(refusal)));
        };
        let t0 = Instant::now();
        let files = match decode_files(req) {
            Ok(f) => f,
            Err(e) => return (None, Err(Failure::Refused(e))),
        };
        // Never abandoned half-way: a container being created would be left behind.
        let container = match self
            .take(req, &lang, limits)
            .instrument(tracing::info_span!("container_take"))
            .await
        {
            Ok(c) => c,
            Err(e) => return (None, Err(*e)),
        };
        let taken = t0.elapsed();
        crate::observe::metrics::created(key);
        if *control.borrow() == Control::Cancel || control.has_changed().is_err() {
            // Cancelled while the container was being taken: the program never runs.
            return (Some(container), Ok(cancelled_before_start(id)));
        }
        // The tool broker (tool_calls extension) serves /sandbox/tools.sock until the execution is over (Drop).
        let tools = match crate::extensions::tools::Broker::start(
            req,
            &container.handle.dir().join("code"),
            container.host_id,
            req.resolve_tool_timeout(self.config().tools.max_call_timeout_ms)
                .unwrap_or(protocol::DEFAULT_TOOL_TIMEOUT_MS),
            &self.config().tools,
            out.clone(),
            tool_inbox,
        ) {
            Ok(b) => b,
            Err(e) => return (Some(container), Err(ExecError::Tools(e).into())),
        };
        // The egress proxy (network extension) serves inside the container until the execution is over (Drop).
        let network = match self.start_egress(req, &container) {
            Ok(n) => n,
            Err(e) => return (Some(container), Err(*e)),
        };
        let launched = match self
            .launch(req, limits, &lang, files, &container)
            .instrument(tracing::info_span!("launch"))
            .await
        {
            Ok(launched) => launched,
            Err(e) => return (Some(container), Err(e)),
        };
        let launch_us = (t0.elapsed() - taken).as_micros() as u64;
        let run = Run {
            req,
            limits,
            lang: &lang,
            container: &container,
            tools: tools.as_ref(),
            network: network.as_ref(),
            key,
            out,
        };
        let finished = self
            .supervise(&run, launched, control)
            .instrument(tracing::info_span!("run"))
            .await;
        debug!(
            container = %container.cid,
            warm = container.warm,
            take_us = taken.as_micros() as u64,
            launch_us,
            total_us = t0.elapsed().as_micros() as u64,
            "execution timings"
        );
        (Some(container), finished)
    }

    /// A container for the request: from the pool, or (extension `volumes`) one created with the request's
    /// volumes claimed and bound, which it holds until it is removed.
    async fn take(
        &self,
        req: &ExecuteRequest,
        lang: &LanguageRuntime,
        limits: &Limits,
    ) -> Result<Container, Box<Failure>> {
        if req.mounts.is_empty() && req.snapshot.is_none() {
            return self
                .pool
                .take(req.language, lang, limits)
                .await
                .map_err(|e| Box::new(ExecError::Create(e).into()));
        }
        let refuse = |message: String| {
            Box::new(Failure::Refused(ErrorMessage::new(
                Some(req.id.clone()),
                ErrorCode::InvalidRequest,
                message,
            )))
        };
        let holder = format!("execution:{}", req.id);
        let claims = self.claim_volumes(req, &holder).await.map_err(refuse)?;
        let snapshot = match &req.snapshot {
            None => None,
            Some(id) => {
                let Some(snapshots) = self.snapshots.get() else {
                    return Err(refuse(
                        "Field snapshot: this server has no snapshots (extension snapshots)".into(),
                    ));
                };
                let held = snapshots.hold(id, &holder).map_err(|e| {
                    refuse(format!("Field snapshot: {}", runtime::error::Chain(&e)))
                })?;
                Some(held)
            }
        };
        let binds: Vec<VolumeBind> = req
            .mounts
            .iter()
            .zip(&claims)
            .map(|(m, c)| VolumeBind {
                source: c.source().to_owned(),
                rel: m.relative().to_owned(),
                read_only: m.read_only,
            })
            .collect();
        let layer = snapshot.as_ref().map(|(l, _)| l.as_path());
        let mut container = self
            .pool
            .take_with_volumes(lang, limits, (&binds, layer))
            .await
            .map_err(|e| Box::new(ExecError::Create(e).into()))?;
        container.claims = claims;
        container.snapshot = snapshot.map(|(_, h)| h);
        Ok(container)
    }

    /// Claims each volume of `req.mounts` for `holder`; the refusal's message names the field.
    async fn claim_volumes(
        &self,
        req: &ExecuteRequest,
        holder: &str,
    ) -> Result<Vec<agents::volumes::Claim>, String> {
        if req.mounts.is_empty() {
            return Ok(Vec::new());
        }
        let Some(volumes) = self.volumes.get() else {
            return Err("Field mounts: this server has no volumes (extension volumes)".into());
        };
        let mut claims = Vec::with_capacity(req.mounts.len());
        for (i, m) in req.mounts.iter().enumerate() {
            match volumes.claim(&m.volume, holder, &m.path, m.read_only).await {
                Ok(c) => claims.push(c),
                Err(e) => return Err(format!("Field mounts[{i}]: {}", runtime::error::Chain(&e))),
            }
        }
        Ok(claims)
    }

    /// The request's egress proxy, listening inside the container; `None` without `network`.
    fn start_egress(
        &self,
        req: &ExecuteRequest,
        container: &Container,
    ) -> Result<Option<crate::extensions::egress::Running>, Box<Failure>> {
        let (Some(egress), Some(_)) = (&self.egress, &req.network) else {
            return Ok(None);
        };
        // Checked when the request arrived; checked again here against the same bound.
        // Boxed: the failure is rare, and large beside the proxy.
        let Some(admitted) = egress
            .check(req)
            .map_err(|e| Box::new(Failure::Refused(e)))?
        else {
            return Ok(None);
        };
        let internal = |e| Box::new(Failure::from(ExecError::Egress(e)));
        let listener = container
            .handle
            .listen_inside(crate::extensions::egress::PROXY_ADDRESS)
            .map_err(internal)?;
        let running = egress
            .start(admitted, listener, &req.id)
            .map_err(internal)?;
        Ok(Some(running))
    }

    /// Writes the inputs and the limits into the container and launches the program. Returns its output pipes.
    async fn launch(
        &self,
        req: &ExecuteRequest,
        limits: &Limits,
        lang: &LanguageRuntime,
        files: Vec<InputFile>,
        container: &Container,
    ) -> Result<Launched, Failure> {
        let id = req.id.as_str();
        let cpu_quota = match limits.cpu_cores {
            Some(cores) => Some(
                CpuQuota::from_cores(cores.get())
                    .map_err(|e| ExecError::Prepare(runtime::Error::Cgroup(e)))?,
            ),
            None => None,
        };
        let cgroup_limits = CgroupLimits {
            memory_bytes: limits.memory_mb << 20,
            pids_max: limits.pids_max,
            cpu_shares: limits.cpu_shares,
            cpu_quota,
        };
        let code = req.code.clone().into_bytes();
        let t0 = Instant::now();
        let written = container
            .handle
            .prepare(cgroup_limits, lang.file_name, code, files)
            .await;
        let inputs_done = t0.elapsed();
        match written {
            Ok(()) => {}
            Err(PrepareError::Failed(runtime::Error::InputFile { path, reason })) => {
                return Err(Failure::Refused(ErrorMessage::new(
                    Some(id.into()),
                    ErrorCode::InvalidRequest,
                    format!("Field files: {path}: {reason}"),
                )))
            }
            Err(PrepareError::Panicked(e)) => return Err(ExecError::PreparePanicked(e).into()),
            Err(PrepareError::Failed(e)) => return Err(ExecError::Prepare(e).into()),
        }
        // Stdio: stdin is a memfd holding the whole input (read to EOF, never blocks the daemon); stdout and
        // stderr are pipes the daemon reads.
        let Stdio {
            stdin,
            stdout_r,
            stderr_r,
            stdout_w,
            stderr_w,
        } = make_stdio(req.stdin.as_deref().unwrap_or("").as_bytes()).map_err(ExecError::Pipes)?;
        let mut args = command(lang);
        let mut env = environment(lang, req);
        // With tools, the code runs inside the SDK's runner, which finds the SDK on its path.
        crate::extensions::tools::adjust_command(req, &mut args, &mut env);
        let mut launch = Launch::program(
            args,
            env.into_iter().map(|(k, v)| format!("{k}={v}")).collect(),
        );
        launch.warm = container.interpreter
            && crate::exec::warm::wanted(req)
            && (req.tools.is_empty() || crate::exec::warm::takes_tools(req.language, lang))
            && crate::exec::warm::fits_exec(&launch);
        let sent_ns = runtime::init::monotonic_ns();
        container
            .handle
            .launch(&launch, [stdin.as_fd(), stdout_w.as_fd(), stderr_w.as_fd()])
            .map_err(ExecError::Launch)?;
        // The init holds its own copies now; ours would keep the pipes from ever closing.
        drop((stdin, stdout_w, stderr_w));
        debug!(
            inputs_us = inputs_done.as_micros() as u64,
            sent_us = t0.elapsed().as_micros() as u64,
            "launch timings"
        );
        Ok(Launched {
            stdout: stdout_r,
            stderr: stderr_r,
            sent_ns,
        })
    }

    /// From launch to the end: output, timeout, cancel, disconnect, shutdown; then the outcome and the result.
    async fn supervise(
        self: &Arc<Self>,
        run: &Run<'_>,
        launched: Launched,
        mut control: watch::Receiver<Control>,
    ) -> Result<Vec<ServerMessage>, Failure> {
        let (id, out) = (run.req.id.as_str(), run.out);
        let started = Instant::now();
        info!(language = run.req.language.as_str(), container = %run.container.cid, "program started");
        let _ = out
            .send(ServerMessage::Status {
                id: id.into(),
                status: ExecStatus::Running,
            })
            .await;
        if let Some(b) = run.tools {
            // Calls are forwarded only after `status: running`.
            b.started();
        }
        let mut status_rx = run.container.handle.watch_end().map_err(ExecError::Watch)?;
        let mut s = Supervision::new(
            &*run.container.handle,
            Streams::new(
                id,
                launched.stdout,
                launched.stderr,
                run.limits.max_output_bytes,
            ),
            started,
        );
        let deadline = tokio::time::sleep(Duration::from_millis(run.limits.timeout_ms));
        tokio::pin!(deadline);
        let killed = self.daemon.killed();
        tokio::pin!(killed);
        while !s.finished() {
            let want_output = s.pending.len() < MAX_PENDING && !s.stream.done();
            let running = s.kill_reason.is_none() && s.exited.is_none();
            tokio::select! {
                biased;
                record = &mut status_rx, if s.exited.is_none() => s.ended(record.unwrap_or_default()),
                permit = out.reserve(), if !s.pending.is_empty() && !s.client_gone => s.forward(permit),
                _ = &mut deadline, if running => s.kill_for(KillReason::Timeout),
                _ = cancelled(&mut control), if running => s.kill_for(KillReason::Cancelled),
                _ = &mut killed, if !s.shut_down && s.exited.is_none() => s.shut_down(),
                // The guard keeps this branch off until there is a deadline (the `now` is never polled).
                _ = tokio::time::sleep_until(s.drain_deadline.unwrap_or_else(tokio::time::Instant::now)), if s.drain_deadline.is_some() && !s.stream.done() => {
                    warn!("output pipes still open after the container exited; closing them");
                    let rest = s.stream.close();
                    s.pending.extend(rest);
                },
                msgs = s.stream.read(), if want_output => s.output(msgs),
            }
            s.after_event();
            if let Some(b) = run
                .tools
                .filter(|_| s.kill_reason.is_some() || s.exited.is_some() || s.shut_down)
            {
                // Decided or over: waiting and queued tool calls get `closed`, none is forwarded from now on.
                b.close();
            }
        }
        let drained = started.elapsed();
        let messages = self.conclude(run, s, launched.sent_ns).await?;
        debug!(
            drained_us = drained.as_micros() as u64,
            result_us = started.elapsed().as_micros() as u64,
            "supervision timings"
        );
        Ok(messages)
    }

    /// After the end: the init's report, the usage, the outcome, the artifacts; the last messages to send.
    async fn conclude(
        self: &Arc<Self>,
        run: &Run<'_>,
        s: Supervision<'_>,
        sent_ns: u64,
    ) -> Result<Vec<ServerMessage>, Failure> {
        let (id, limits) = (run.req.id.as_str(), run.limits);
        if s.shut_down {
            return Err(ExecError::ShutDown.into());
        }
        let Some((record, wall, eof_ns)) = s.exited else {
            return Err(ExecError::NoExitRecord.into());
        };
        let report = Report::decode(&record);
        let since_launch: Vec<String> = report
            .marks
            .iter()
            .chain(std::iter::once(&("ended".to_owned(), eof_ns)))
            .map(|(name, ns)| format!("{name}={}", ns.saturating_sub(sent_ns) / 1000))
            .collect();
        debug!(marks_us = %since_launch.join(","), exit_us = wall.as_micros() as u64, "container timing marks");
        if let Some(e) = report.setup_error {
            return Err(ExecError::Setup(e).into());
        }
        let usage = match run.container.handle.usage() {
            Ok(u) => u,
            Err(e) => {
                error!(error = %Chain(&e), "cgroup usage unreadable; reporting zeros");
                Default::default()
            }
        };
        let resource_usage = ResourceUsage {
            peak_memory_mb: usage.peak_memory_bytes.div_ceil(1 << 20),
            cpu_time_ms: usage.cpu_time_ns / 1_000_000,
        };
        let duration_ms = wall.as_millis() as u64;
        let o = outcome::classify(s.kill_reason, report.exit, usage.oom_kills)
            .map_err(ExecError::Unexplained)?;
        crate::observe::metrics::exited(run.key, o.reason, wall);
        let bytes = crate::observe::metrics::ExecutionBytes {
            tool_calls: run.tools.map_or(0, |b| b.calls()),
            tool_result_bytes: run.tools.map_or(0, |b| b.result_bytes()),
            output_bytes: s.stream.sent[0]
                + s.stream.sent[1]
                + run.tools.map_or(0, |b| b.return_value_bytes()),
        };
        crate::observe::metrics::concluded(run.key, bytes);
        info!(
            reason = o.reason.as_str(),
            exit = ?o.exit,
            duration_ms,
            peak_memory_mb = resource_usage.peak_memory_mb,
            cpu_time_ms = resource_usage.cpu_time_ms,
            tool_calls = bytes.tool_calls,
            tool_result_bytes = bytes.tool_result_bytes,
            output_bytes = bytes.output_bytes,
            "program ended"
        );
        let environment = run.lang.environment(&self.seccomp_digest);
        let fingerprint = environment.fingerprint(limits);
        let artifacts = match (&run.req.artifacts, o.reason) {
            // A cancelled execution's files are not collected (artifact-manifest.md).
            (Some(_), Reason::Cancelled) | (None, _) => None,
            (Some(wanted), _) => Some(
                self.artifacts(wanted, run.container.handle.workspace(), id, &fingerprint)
                    .instrument(tracing::info_span!("artifacts"))
                    .await?,
            ),
        };
        let mut messages: Vec<ServerMessage> = if s.client_gone {
            Vec::new()
        } else {
            s.pending.into_iter().collect()
        };
        messages.push(ServerMessage::Status {
            id: id.into(),
            status: o.status,
        });
        let mut res = result(
            id,
            Some(o.exit),
            o.reason,
            duration_ms,
            resource_usage,
            [s.stream.sent[0], s.stream.sent[1]],
            s.stream.truncated,
        );
        res.artifacts = artifacts.as_ref().map(protocol::ArtifactManifest::to_value);
        res.environment_fingerprint = Some(fingerprint);
        res.environment = Some(Box::new(environment));
        if let Some(b) = run.tools {
            res.tool_calls = Some(b.calls());
            res.return_value = b.return_value().map(Box::new);
        }
        res.network = run.network.map(|n| Box::new(n.usage()));
        messages.push(ServerMessage::Result(res));
        Ok(messages)
    }
}

impl crate::observe::metrics::Source for Engine {
    fn gauges(&self) -> crate::observe::metrics::Gauges {
        crate::observe::metrics::Gauges {
            queue_depth: self.capacity.queued(),
            slots_in_use: self.capacity.active(),
            slots: self.config().capacity.max_concurrent,
            pool_size: self.pool.ready(),
        }
    }

    fn tokens(&self) -> &[String] {
        &self.config().auth.tokens
    }
}

/// What a launched execution's supervision works on.
struct Run<'a> {
    req: &'a ExecuteRequest,
    limits: &'a Limits,
    lang: &'a LanguageRuntime,
    container: &'a Container,
    tools: Option<&'a crate::extensions::tools::Broker>,
    /// The egress proxy (extension `network`).
    network: Option<&'a crate::extensions::egress::Running>,
    /// The execution's metrics key.
    key: &'a str,
    out: &'a mpsc::Sender<ServerMessage>,
}

/// A launched program's output pipes, and when the launch was sent (`CLOCK_MONOTONIC`).
struct Launched {
    stdout: OwnedFd,
    stderr: OwnedFd,
    sent_ns: u64,
}

/// The state of one execution's supervision loop; each event of the loop is one method.
struct Supervision<'a> {
    handle: &'a dyn ContainerHandle,
    stream: Streams,
    started: Instant,
    /// Why the daemon killed the program (the first reason wins).
    kill_reason: Option<KillReason>,
    /// The init's record, the wall time and the `CLOCK_MONOTONIC` time of the end.
    exited: Option<(String, Duration, u64)>,
    /// After the end, output may keep flowing this long.
    drain_deadline: Option<tokio::time::Instant>,
    /// Messages read but not yet accepted by the connection.
    pending: VecDeque<ServerMessage>,
    client_gone: bool,
    shut_down: bool,
}

impl<'a> Supervision<'a> {
    fn new(handle: &'a dyn ContainerHandle, stream: Streams, started: Instant) -> Self {
        Self {
            handle,
            stream,
            started,
            kill_reason: None,
            exited: None,
            drain_deadline: None,
            pending: VecDeque::new(),
            client_gone: false,
            shut_down: false,
        }
    }

    /// The program ended, its output is read and everything read is handed to the connection.
    fn finished(&self) -> bool {
        self.exited.is_some() && self.stream.done() && self.pending.is_empty()
    }

    fn kill(&self) {
        self.handle.kill(Signal::SIGKILL);
    }

    /// Kills the program for `reason` (the caller checked that it still runs and no kill was decided yet).
    fn kill_for(&mut self, reason: KillReason) {
        self.kill_reason = Some(reason);
        self.kill();
    }

    /// The container ended: output may still drain for a while.
    fn ended(&mut self, (record, eof_ns): EndRecord) {
        self.exited = Some((record, self.started.elapsed(), eof_ns));
        self.drain_deadline = Some(tokio::time::Instant::now() + DRAIN_AFTER_EXIT);
    }

    /// The connection has room for the next pending message (or is gone).
    fn forward(&mut self, permit: Result<mpsc::Permit<'_, ServerMessage>, SendError<()>>) {
        match permit {
            Ok(p) => {
                if let Some(m) = self.pending.pop_front() {
                    p.send(m)
                }
            }
            Err(_) => {
                self.client_gone = true;
                self.pending.clear();
            }
        }
    }

    /// The end of the shutdown grace period: the program is killed whatever else happened.
    fn shut_down(&mut self) {
        self.shut_down = true;
        self.kill_reason.get_or_insert(KillReason::Cancelled);
        self.kill();
    }

    /// Output read; over the limit, the program is killed.
    fn output(&mut self, (msgs, over): (Vec<ServerMessage>, bool)) {
        self.pending.extend(msgs);
        if over && self.kill_reason.is_none() && self.exited.is_none() {
            self.kill_for(KillReason::OutputLimit);
        }
    }

    /// After every event: a gone client's output is dropped and its program killed.
    fn after_event(&mut self) {
        if self.client_gone {
            // Nobody will read it: keep draining the pipes (so the program is not blocked) but drop the output.
            self.pending.clear();
            if self.kill_reason.is_none() && self.exited.is_none() {
                self.kill_for(KillReason::Cancelled);
            }
        }
    }
}

/// Why an execution failed.
enum Failure {
    /// The request cannot run as given (sent as is).
    Refused(ErrorMessage),
    /// The daemon failed: `INTERNAL_ERROR`, logged with its chain.
    Internal(ExecError),
}

impl From<ExecError> for Failure {
    fn from(e: ExecError) -> Self {
        Failure::Internal(e)
    }
}

/// The `INTERNAL_ERROR` for `e`, logged with its whole chain; the message carries the chain too.
fn internal_error(id: &str, e: &ExecError) -> ErrorMessage {
    let chain = Chain(e).to_string();
    error!(error = %chain, "execution failed: INTERNAL_ERROR");
    ErrorMessage::internal(id, chain)
}

/// The program and its arguments: the language's command and the code file.
fn command(lang: &LanguageRuntime) -> Vec<String> {
    let mut args = lang.command.clone();
    args.push(format!("{CODE_DIR}/{}", lang.file_name));
    args
}

/// The program's environment: sandboxd's base, then the image's, then the request's, then (extension `network`)
/// the proxy settings.
fn environment(lang: &LanguageRuntime, req: &ExecuteRequest) -> BTreeMap<String, String> {
    let mut env = containers::image::base_environment(&lang.image);
    env.extend(req.env.clone());
    if req.network.is_some() {
        env.extend(crate::extensions::egress::proxy_env());
    }
    env
}

/// The request's files, decoded; a bad one is `INVALID_REQUEST` before any container is taken.
fn decode_files(req: &ExecuteRequest) -> Result<Vec<InputFile>, ErrorMessage> {
    req.files
        .iter()
        .map(|f| {
            f.decoded()
                .map(|content| InputFile {
                    path: f.path.clone(),
                    content,
                })
                .map_err(|e| {
                    ErrorMessage::new(
                        Some(req.id.clone()),
                        ErrorCode::InvalidRequest,
                        format!("Field files: {}: {e}", f.path),
                    )
                })
        })
        .collect()
}

/// The terminal status and result of an execution cancelled before its program started.
fn cancelled_before_start(id: &str) -> Vec<ServerMessage> {
    vec![
        ServerMessage::Status {
            id: id.into(),
            status: ExecStatus::Cancelled,
        },
        ServerMessage::Result(result(
            id,
            None,
            Reason::Cancelled,
            0,
            ResourceUsage::default(),
            [0, 0],
            false,
        )),
    ]
}

fn result(
    id: &str,
    exit: Option<ProgramExit>,
    reason: Reason,
    duration_ms: u64,
    resource_usage: ResourceUsage,
    sent: [u64; 2],
    truncated: bool,
) -> ResultMessage {
    let (exit_code, signal) = match exit {
        Some(ProgramExit::Code(c)) => (Some(c), None),
        Some(ProgramExit::Signal(s)) => (None, Some(runtime::init::signal_name(s))),
        None => (None, None),
    };
    ResultMessage {
        exit_code,
        duration_ms,
        resource_usage,
        signal,
        stdout_bytes: sent[0],
        stderr_bytes: sent[1],
        truncated,
        ..ResultMessage::new(id, reason)
    }
}

/// Resolves when the client cancels or goes away.
async fn cancelled(control: &mut watch::Receiver<Control>) {
    loop {
        if *control.borrow_and_update() == Control::Cancel {
            return;
        }
        if control.changed().await.is_err() {
            return;
        }
    }
}

#[cfg(test)]
mod tests;

//! The execution engine: turns one accepted `execute` into a container run and a stream of protocol messages.
//!
//! One task per execution. It waits for a slot, takes a container (a ready one from the [`crate::pool`], or one
//! created on the spot), writes the code and input files and the request's cgroup limits into it, launches the
//! program over the container's launch channel, streams stdout/stderr with the output limit enforced to the byte,
//! enforces the wall-clock timeout, obeys cancel and disconnect, reads how the program ended from the init's status
//! pipe and the usage from the cgroup, then reports the terminal status and the result. The container is removed
//! in the background afterwards; every path out of [`Engine::run`] that took a container hands it to the removal.
//!
//! Parts: [`streams`] (stdio and output), [`outcome`] (why it ended: a pure function), [`artifacts`] (collection,
//! manifest, upload).

mod artifacts;
pub mod outcome;
mod streams;

use std::collections::{BTreeMap, VecDeque};
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use protocol::{
    Capabilities, ErrorCode, ErrorMessage, ExecStatus, ExecuteRequest, Isolation, Language, Limits,
    Load, Pong, Reason, ResourceUsage, ResultMessage, ServerMessage,
};
use runtime::cgroups::{CgroupLimits, Cgroups};
use runtime::init::Report;
use runtime::launch::Launch;
use runtime::rootfs::{InputFile, CODE_DIR, WORKDIR};
use tokio::io::AsyncReadExt;
use tokio::sync::{mpsc, oneshot, watch};
use tracing::{debug, error, info, warn, Instrument};

use self::outcome::{Exit, KillReason};
use self::streams::{make_stdio, Stdio, Streams};
use crate::capacity::{Admission, Capacity, Slot};
use crate::config::Config;
use crate::images::LanguageRuntime;
use crate::pool::{Container, Pool};
use crate::server::Registration;
use crate::store::Store;

/// Executions so far (keys of their metrics).
static EXECUTIONS: AtomicU64 = AtomicU64::new(0);
/// How long output may keep flowing after the init exited (the pipes close when the pid namespace is gone).
const DRAIN_AFTER_EXIT: Duration = Duration::from_secs(2);
/// Messages an execution buffers while the connection is slow before it stops reading the program's output.
const MAX_PENDING: usize = 4;

/// Sent by the connection to a running execution.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Control {
    /// Keep going.
    Run,
    /// The client asked to cancel.
    Cancel,
}

/// Everything executions share.
pub struct Engine {
    /// The configuration in force.
    pub config: Config,
    /// Containers: the warm pool and the cold path.
    pub pool: Arc<Pool>,
    /// Cgroup setup.
    pub cgroups: Cgroups,
    /// Languages, each with its image and interpreter.
    pub languages: BTreeMap<Language, LanguageRuntime>,
    /// Admission control.
    pub capacity: Capacity,
    /// Isolation layers in effect.
    pub isolation: Isolation,
    /// When the daemon started.
    pub started: Instant,
    /// Set at the end of the shutdown grace period: every running execution is killed.
    pub kill_all: watch::Sender<bool>,
    /// The artifact store.
    pub store: Arc<Store>,
    /// sha256 of the seccomp profile in force (part of every environment fingerprint).
    pub seccomp_digest: String,
}

/// What an execution's body hands back: the messages to send (or the error), and the container to remove.
type Finished = (Option<Container>, Result<Vec<ServerMessage>, ErrorMessage>);

impl Engine {
    /// Assembles the engine.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        config: Config,
        pool: Arc<Pool>,
        cgroups: Cgroups,
        languages: BTreeMap<Language, LanguageRuntime>,
        isolation: Isolation,
        store: Arc<Store>,
        seccomp_digest: String,
    ) -> Self {
        let capacity = Capacity::new(config.capacity.max_concurrent, config.capacity.max_queue);
        Self {
            config,
            pool,
            cgroups,
            languages,
            capacity,
            isolation,
            started: Instant::now(),
            kill_all: watch::channel(false).0,
            store,
            seccomp_digest,
        }
    }

    /// The configured maximum of every limit.
    pub fn max_limits(&self) -> Limits {
        self.config.limits.max.to_limits()
    }

    /// Protocol extensions this server implements.
    pub fn extensions(&self) -> Vec<String> {
        vec![
            "files".into(),
            "base64_output".into(),
            "artifacts".into(),
            "tool_calls".into(),
        ]
    }

    /// The `pong` for a `ping`.
    pub fn pong(&self) -> Pong {
        Pong {
            load: Load {
                active_executions: self.capacity.active() as u64,
                queue_depth: self.capacity.queued() as u64,
            },
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
        let timer = crate::metrics::ExecutionTimer::begin(req.language);
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
                    slot = ticket.wait() => match slot {
                        Some(s) => s,
                        None => {
                            registration.release();
                            timer.ended_without_slot("error");
                            let _ = out.send(ServerMessage::Error(ErrorMessage::internal(&id, "The daemon is shutting down"))).await;
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
        // The container goes first (in the background): the result does not wait for its removal.
        if let Some(c) = container {
            self.pool.factory().remove_in_background(c);
        }
        registration.release();
        match outcome {
            Ok(messages) => {
                for m in messages {
                    let _ = out.send(m).await;
                }
            }
            Err(message) => {
                let _ = out.send(ServerMessage::Error(message)).await;
            }
        }
        crate::metrics::finished(&key);
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
        tool_inbox: crate::tools::Inbox,
    ) -> Finished {
        let id = req.id.as_str();
        let internal = |m: String| ErrorMessage::internal(id, m);
        let Some(lang) = self.languages.get(&req.language).cloned() else {
            return (
                None,
                Err(ErrorMessage::new(
                    Some(id.into()),
                    ErrorCode::LanguageNotSupported,
                    "Language not available",
                )),
            );
        };
        let t0 = Instant::now();
        let files = match decode_files(req) {
            Ok(f) => f,
            Err(e) => return (None, Err(e)),
        };
        // Never abandoned half-way: a container being created would be left behind.
        let container = match self.pool.take(req.language, &lang, limits).await {
            Ok(c) => c,
            Err(e) => {
                error!(error = %e, "cannot create a container");
                return (
                    None,
                    Err(internal(format!("Cannot create the container: {e}"))),
                );
            }
        };
        let taken = t0.elapsed();
        crate::metrics::created(key);
        if *control.borrow() == Control::Cancel || control.has_changed().is_err() {
            // Cancelled while the container was being taken: the program never runs.
            return (Some(container), Ok(cancelled_before_start(id)));
        }
        // The tool broker (tool_calls extension) serves /sandbox/tools.sock until the execution is over (Drop).
        let tools = match crate::tools::Broker::start(
            req,
            &container.scratch.dir().join("code"),
            container.host_id,
            req.resolve_tool_timeout(self.config.tools.max_call_timeout_ms)
                .unwrap_or(protocol::DEFAULT_TOOL_TIMEOUT_MS),
            &self.config.tools,
            out.clone(),
            tool_inbox,
        ) {
            Ok(b) => b,
            Err(e) => return (Some(container), Err(internal(e.describe()))),
        };
        match self.launch(req, limits, &lang, files, &container).await {
            Ok(launched) => {
                let launch_us = (t0.elapsed() - taken).as_micros() as u64;
                let finished = self
                    .supervise(
                        req,
                        limits,
                        &lang,
                        &container,
                        launched,
                        tools.as_ref(),
                        key,
                        out,
                        control,
                    )
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
            Err(e) => (Some(container), Err(e)),
        }
    }

    /// Writes the inputs and the limits into the container and launches the program. Returns its output pipes.
    async fn launch(
        &self,
        req: &ExecuteRequest,
        limits: &Limits,
        lang: &LanguageRuntime,
        files: Vec<InputFile>,
        container: &Container,
    ) -> Result<(OwnedFd, OwnedFd, u64), ErrorMessage> {
        let id = req.id.as_str();
        let internal = |m: String| ErrorMessage::internal(id, m);
        let cgroup_limits = CgroupLimits {
            memory_bytes: limits.memory_mb << 20,
            pids_max: limits.pids_max,
            cpu_shares: limits.cpu_shares,
        };
        let code = req.code.clone().into_bytes();
        let file_name = lang.file_name;
        let inputs = container.scratch.inputs();
        let (cgroups, cid) = (self.cgroups.clone(), container.cid.clone());
        let t0 = Instant::now();
        let written = tokio::task::spawn_blocking(move || {
            cgroups.set_limits(&cid, &cgroup_limits)?;
            inputs.write(file_name, &code, &files)
        })
        .await
        .map_err(|e| internal(format!("Preparation panicked: {e}")))?;
        let inputs_done = t0.elapsed();
        match written {
            Ok(()) => {}
            Err(runtime::Error::InputFile { path, reason }) => {
                return Err(ErrorMessage::new(
                    Some(id.into()),
                    ErrorCode::InvalidRequest,
                    format!("Field files: {path}: {reason}"),
                ))
            }
            Err(e) => return Err(internal(format!("Cannot prepare the sandbox: {e}"))),
        }
        // Stdio: stdin is a memfd holding the whole input (read to EOF, never blocks the daemon); stdout and
        // stderr are pipes the daemon reads.
        let Stdio {
            stdin,
            stdout_r,
            stderr_r,
            stdout_w,
            stderr_w,
        } = make_stdio(req.stdin.as_deref().unwrap_or("").as_bytes())
            .map_err(|e| internal(format!("Cannot create pipes: {e}")))?;
        let mut args = command(lang);
        let mut env = environment(lang, req);
        // With tools, the code runs inside the SDK's runner, which finds the SDK on its path.
        crate::tools::adjust_command(req, &mut args, &mut env);
        let launch = Launch {
            args,
            env: env.into_iter().map(|(k, v)| format!("{k}={v}")).collect(),
        };
        let sent_ns = runtime::init::monotonic_ns();
        runtime::launch::send(
            container.created.launch.as_fd(),
            &launch,
            [stdin.as_fd(), stdout_w.as_fd(), stderr_w.as_fd()],
        )
        .map_err(|e| match setup_error(&container.created.status) {
            // The init refused to run anything: a restriction could not be applied (fail closed).
            Some(setup) => {
                error!(error = %setup, "sandbox setup failed; the program did not run");
                internal(format!("Sandbox setup failed: {setup}"))
            }
            None => internal(format!("Cannot launch the program: {e}")),
        })?;
        // The init holds its own copies now; ours would keep the pipes from ever closing.
        drop((stdin, stdout_w, stderr_w));
        debug!(
            inputs_us = inputs_done.as_micros() as u64,
            sent_us = t0.elapsed().as_micros() as u64,
            "launch timings"
        );
        Ok((stdout_r, stderr_r, sent_ns))
    }

    /// From launch to the end: output, timeout, cancel, disconnect, shutdown; then the outcome and the result.
    #[allow(clippy::too_many_arguments)] // one call site; every argument is a distinct part of the execution
    async fn supervise(
        self: &Arc<Self>,
        req: &ExecuteRequest,
        limits: &Limits,
        lang: &LanguageRuntime,
        container: &Container,
        (stdout_r, stderr_r, sent_ns): (OwnedFd, OwnedFd, u64),
        tools: Option<&crate::tools::Broker>,
        key: &str,
        out: &mpsc::Sender<ServerMessage>,
        mut control: watch::Receiver<Control>,
    ) -> Result<Vec<ServerMessage>, ErrorMessage> {
        let id = req.id.as_str();
        let internal = |m: String| ErrorMessage::internal(id, m);
        let started = Instant::now();
        info!(language = req.language.as_str(), container = %container.cid, "program started");
        let _ = out
            .send(ServerMessage::Status {
                id: id.into(),
                status: ExecStatus::Running,
            })
            .await;
        if let Some(b) = tools {
            // Calls are forwarded only after `status: running`.
            b.started();
        }
        let mut status_rx = watch_end(&container.created.pidfd, &container.created.status)
            .map_err(|e| internal(format!("Cannot watch the container: {e}")))?;
        let pidfd = container.created.pidfd.as_fd();
        let kill = || {
            if let Err(e) =
                runtime::sys::pidfd_send_signal(pidfd, nix::sys::signal::Signal::SIGKILL)
            {
                debug!(error = %e, "kill of the container's init failed (already gone?)");
            }
        };

        let mut stream = Streams::new(id, stdout_r, stderr_r, limits.max_output_bytes);
        let deadline = tokio::time::sleep(Duration::from_millis(limits.timeout_ms));
        tokio::pin!(deadline);
        let mut kill_reason: Option<KillReason> = None;
        let mut exited: Option<(String, Duration, u64)> = None;
        let mut drain_deadline: Option<tokio::time::Instant> = None;
        let mut pending: VecDeque<ServerMessage> = VecDeque::new();
        let mut client_gone = false;
        let mut kill_all = self.kill_all.subscribe();
        let mut shut_down = false;

        loop {
            if exited.is_some() && stream.done() && pending.is_empty() {
                break;
            }
            let want_output = pending.len() < MAX_PENDING && !stream.done();
            tokio::select! {
                biased;
                record = &mut status_rx, if exited.is_none() => {
                    let (record, eof_ns) = record.unwrap_or_default();
                    exited = Some((record, started.elapsed(), eof_ns));
                    drain_deadline = Some(tokio::time::Instant::now() + DRAIN_AFTER_EXIT);
                },
                permit = out.reserve(), if !pending.is_empty() && !client_gone => match permit {
                    Ok(p) => { if let Some(m) = pending.pop_front() { p.send(m) } }
                    Err(_) => { client_gone = true; pending.clear(); }
                },
                _ = &mut deadline, if kill_reason.is_none() && exited.is_none() => {
                    kill_reason = Some(KillReason::Timeout);
                    kill();
                },
                _ = cancelled(&mut control), if kill_reason.is_none() && exited.is_none() => {
                    kill_reason = Some(KillReason::Cancelled);
                    kill();
                },
                _ = killed(&mut kill_all), if !shut_down && exited.is_none() => {
                    shut_down = true;
                    kill_reason.get_or_insert(KillReason::Cancelled);
                    kill();
                },
                _ = sleep_until(drain_deadline), if drain_deadline.is_some() && !stream.done() => {
                    warn!("output pipes still open after the container exited; closing them");
                    pending.extend(stream.close());
                },
                msgs = stream.read(), if want_output => {
                    let (msgs, over) = msgs;
                    pending.extend(msgs);
                    if over && kill_reason.is_none() && exited.is_none() {
                        kill_reason = Some(KillReason::OutputLimit);
                        kill();
                    }
                },
            }
            if client_gone {
                // Nobody will read it: keep draining the pipes (so the program is not blocked) but drop the output.
                pending.clear();
            }
            if client_gone && kill_reason.is_none() && exited.is_none() {
                kill_reason = Some(KillReason::Cancelled);
                kill();
            }
        }
        let drained = started.elapsed();
        if shut_down {
            return Err(internal(
                "The daemon shut down before the execution finished".into(),
            ));
        }
        let Some((record, wall, eof_ns)) = exited else {
            return Err(internal("No exit record".into()));
        };
        let report = Report::decode(&record);
        let since_launch: Vec<String> = report
            .marks
            .iter()
            .chain(std::iter::once(&("ended".to_owned(), eof_ns)))
            .map(|(name, ns)| format!("{name}={}", ns.saturating_sub(sent_ns) / 1000))
            .collect();
        debug!(marks_us = %since_launch.join(","), "container timing marks");
        if let Some(e) = report.setup_error {
            error!(error = %e, "sandbox setup failed; the program did not run");
            return Err(internal(format!("Sandbox setup failed: {e}")));
        }
        let usage = match self.cgroups.usage(&container.cid) {
            Ok(u) => u,
            Err(e) => {
                error!(error = %e, "cgroup usage unreadable; reporting zeros");
                Default::default()
            }
        };
        let resource_usage = ResourceUsage {
            peak_memory_mb: usage.peak_memory_bytes.div_ceil(1 << 20),
            cpu_time_ms: usage.cpu_time_ns / 1_000_000,
        };
        let duration_ms = wall.as_millis() as u64;
        let reason_known = |r| crate::metrics::exited(key, r, wall);
        let o = outcome::classify(kill_reason, report.exit, usage.oom_kills).map_err(|e| {
            error!(error = %e, "unexplained end of an execution");
            internal(e)
        })?;
        reason_known(o.reason);
        info!(
            reason = o.reason.as_str(),
            exit = ?o.exit,
            duration_ms,
            peak_memory_mb = resource_usage.peak_memory_mb,
            "program ended"
        );
        let environment = lang.environment(&self.seccomp_digest);
        let fingerprint = environment.fingerprint(limits);
        let artifacts = match (&req.artifacts, o.reason) {
            // A cancelled execution's files are not collected (artifact-manifest.md).
            (Some(_), Reason::Cancelled) | (None, _) => None,
            (Some(wanted), _) => Some(
                self.artifacts(wanted, container.scratch.workspace(), id, &fingerprint)
                    .await?,
            ),
        };
        let mut messages: Vec<ServerMessage> = pending.into_iter().collect();
        if client_gone {
            messages.clear();
        }
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
            [stream.sent[0], stream.sent[1]],
            stream.truncated,
        );
        res.artifacts = artifacts;
        res.environment_fingerprint = Some(fingerprint);
        res.environment = Some(Box::new(environment));
        if let Some(b) = tools {
            res.tool_calls = Some(b.calls());
            res.return_value = b.return_value().map(Box::new);
        }
        messages.push(ServerMessage::Result(res));
        debug!(
            exit_us = wall.as_micros() as u64,
            drained_us = drained.as_micros() as u64,
            result_us = started.elapsed().as_micros() as u64,
            "supervision timings"
        );
        Ok(messages)
    }
}

/// The program and its arguments: the language's command and the code file.
fn command(lang: &LanguageRuntime) -> Vec<String> {
    let mut args = lang.command.clone();
    args.push(format!("{CODE_DIR}/{}", lang.file_name));
    args
}

/// The program's environment: sandboxd's base, then the image's, then the request's.
fn environment(lang: &LanguageRuntime, req: &ExecuteRequest) -> BTreeMap<String, String> {
    let mut env = base_environment(&lang.image);
    env.extend(req.env.clone());
    env
}

/// Every program's environment before its request's (or sandbox template's) own: sandboxd's base, then the
/// image's.
pub fn base_environment(image: &crate::images::RootImage) -> BTreeMap<String, String> {
    let mut env: BTreeMap<String, String> = [
        ("PATH", "/usr/local/bin:/usr/bin:/bin"),
        ("HOME", WORKDIR),
        ("TMPDIR", "/tmp"),
        ("LANG", "C.UTF-8"),
        ("PYTHONUNBUFFERED", "1"),
        ("PYTHONDONTWRITEBYTECODE", "1"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v.to_owned()))
    .collect();
    env.extend(image.env.iter().cloned());
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

/// Waits in a task of its own until the container's init has ended, then reads its status pipe. The end is the
/// pidfd turning readable, which the kernel signals only once the init is a zombie, that is after every other
/// process of its pid namespace is gone too: when the result is computed (usage, artifacts), nothing of the
/// program can still run or write. The receiver gets the record (empty when the init died without writing) and
/// the `CLOCK_MONOTONIC` time of the end.
fn watch_end(
    pidfd: &OwnedFd,
    status: &OwnedFd,
) -> std::io::Result<oneshot::Receiver<(String, u64)>> {
    let pidfd = pidfd.try_clone()?;
    // SAFETY: the OwnedFd moves into the AsyncFd, which keeps it open and unchanged for its whole lifetime.
    let pidfd = unsafe {
        tokio::io::unix::AsyncFd::register_with_interest(pidfd, tokio::io::Interest::READABLE)
    }?;
    let mut pipe = tokio::net::unix::pipe::Receiver::from_owned_fd(status.try_clone()?)?;
    let (tx, rx) = oneshot::channel();
    tokio::spawn(async move {
        let ended = match pidfd.readable().await {
            Ok(_) => runtime::init::monotonic_ns(),
            Err(e) => {
                warn!(error = %e, "waiting on the container's pidfd failed");
                runtime::init::monotonic_ns()
            }
        };
        let mut record = Vec::new();
        if let Err(e) = pipe.read_to_end(&mut record).await {
            warn!(error = %e, "reading the container's status pipe failed");
        }
        let _ = tx.send((String::from_utf8_lossy(&record).into_owned(), ended));
    });
    Ok(rx)
}

/// What an init that is gone before its launch wrote on its status pipe, if it failed to set up (read without
/// blocking: a live init has written nothing).
fn setup_error(status: &OwnedFd) -> Option<String> {
    use std::io::Read;
    let fd = status.try_clone().ok()?;
    let flags = nix::fcntl::fcntl(fd.as_raw_fd(), nix::fcntl::FcntlArg::F_GETFL).ok()?;
    let flags = nix::fcntl::OFlag::from_bits_truncate(flags) | nix::fcntl::OFlag::O_NONBLOCK;
    nix::fcntl::fcntl(fd.as_raw_fd(), nix::fcntl::FcntlArg::F_SETFL(flags)).ok()?;
    let mut record = String::new();
    let _ = std::fs::File::from(fd).read_to_string(&mut record);
    Report::decode(&record).setup_error
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
    exit: Option<Exit>,
    reason: Reason,
    duration_ms: u64,
    resource_usage: ResourceUsage,
    sent: [u64; 2],
    truncated: bool,
) -> ResultMessage {
    let (exit_code, signal) = match exit {
        Some(Exit::Code(c)) => (Some(c), None),
        Some(Exit::Signal(s)) => (None, Some(signal_name(s))),
        None => (None, None),
    };
    ResultMessage {
        id: id.to_owned(),
        exit_code,
        duration_ms,
        resource_usage,
        reason,
        signal,
        stdout_bytes: sent[0],
        stderr_bytes: sent[1],
        truncated,
        artifacts: None,
        environment_fingerprint: None,
        environment: None,
        tool_calls: None,
        return_value: None,
    }
}

/// `SIGKILL` for 9; `SIG<n>` for numbers nix has no name for.
pub fn signal_name(sig: i32) -> String {
    nix::sys::signal::Signal::try_from(sig)
        .map(|s| s.as_str().to_owned())
        .unwrap_or_else(|_| format!("SIG{sig}"))
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

/// Resolves when the daemon kills every execution (end of the shutdown grace period).
async fn killed(kill_all: &mut watch::Receiver<bool>) {
    let _ = kill_all.wait_for(|k| *k).await;
}

async fn sleep_until(at: Option<tokio::time::Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

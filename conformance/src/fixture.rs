//! A deliberately faulty FSP/1 server, to show that the suite can fail.
//!
//! With no fault it implements FSP/1 well enough to pass the whole suite: it runs programs as plain host
//! processes (`/bin/sh`, and `python3` when the host has it), each in its own process group and working
//! directory, enforces `timeout_ms`, `max_output_bytes` (to the byte), `memory_mb` (by sampling the program's
//! resident memory), the file size part of `disk_mb` (`RLIMIT_FSIZE`), cancel and disconnect (the whole process
//! tree, found by an environment tag every descendant inherits), capacity and queueing. It isolates nothing, and
//! says so: its `pong` announces no namespaces, no seccomp, no Landlock and host network, so that isolation
//! cases skip, and posture cases it cannot meet (capabilities, `no_new_privs`, `pids_max`) honestly fail as
//! SHOULD. Each [`Fault`] breaks one requirement on purpose.

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::net::SocketAddr;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures_util::{SinkExt, StreamExt};
use nix::sys::signal::Signal;
use nix::unistd::Pid;
use protocol::{
    Capabilities, ClientMessage, ErrorCode, ErrorMessage, ExecStatus, ExecuteRequest, Isolation,
    Language, Limits, Load, OutputChunk, Pong, Reason, RequestError, ResourceUsage, ResultMessage,
    ServerMessage, Utf8Chunker,
};
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch, OwnedSemaphorePermit, Semaphore};
use tokio_tungstenite::tungstenite::handshake::server::{ErrorResponse, Request, Response};
use tokio_tungstenite::tungstenite::http::StatusCode;
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;
use tokio_tungstenite::tungstenite::protocol::{CloseFrame, WebSocketConfig};
use tokio_tungstenite::tungstenite::{self, Message};

pub use crate::fault::Fault;

/// How the fixture is configured.
#[derive(Debug, Clone)]
pub struct FixtureConfig {
    /// The accepted bearer token.
    pub token: String,
    /// Executions run at once.
    pub max_concurrent: usize,
    /// Executions waiting beyond those.
    pub max_queue: usize,
    /// The largest limits an execute may ask for.
    pub max_limits: Limits,
    /// Frames larger than this close the connection with 1009.
    pub max_frame_bytes: usize,
    /// The faults switched on.
    pub faults: BTreeSet<Fault>,
}

impl Default for FixtureConfig {
    fn default() -> Self {
        FixtureConfig {
            token: "fixture-token-0123456789".into(),
            max_concurrent: 3,
            max_queue: 2,
            max_limits: Limits {
                timeout_ms: 120_000,
                memory_mb: 2048,
                cpu_shares: 1024,
                max_output_bytes: 64 << 20,
                pids_max: 1024,
                disk_mb: 1024,
                // The fixture does not announce the `cpu_cores` extension.
                cpu_cores: None,
            },
            max_frame_bytes: 16 << 20,
            faults: BTreeSet::new(),
        }
    }
}

/// A running fixture; stopped when dropped.
pub struct Fixture {
    /// The address it listens on.
    pub addr: SocketAddr,
    task: tokio::task::JoinHandle<()>,
    _root: tempfile::TempDir,
}

impl Fixture {
    /// `ws://ADDR/ws`.
    pub fn endpoint(&self) -> String {
        format!("ws://{}/ws", self.addr)
    }
}

impl Drop for Fixture {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Starts a fixture on `listen` (e.g. `127.0.0.1:0`).
pub async fn start(config: FixtureConfig, listen: &str) -> std::io::Result<Fixture> {
    let listener = TcpListener::bind(listen).await?;
    let addr = listener.local_addr()?;
    let root = tempfile::Builder::new().prefix("fsp-fixture-").tempdir()?;
    let mut languages = vec![(Language::Shell, PathBuf::from("/bin/sh"), "main.sh")];
    if Path::new("/usr/bin/python3").exists() {
        languages.push((
            Language::Python,
            PathBuf::from("/usr/bin/python3"),
            "main.py",
        ));
    }
    let shared = Arc::new(Shared {
        slots: Arc::new(Semaphore::new(config.max_concurrent)),
        queued: Mutex::new(0),
        seq: AtomicU64::new(0),
        root: root.path().to_owned(),
        languages,
        config,
        agents: Arc::new(crate::fixture_agents::Agents::default()),
    });
    let task = tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let _ = stream.set_nodelay(true);
            tokio::spawn(connection(shared.clone(), stream));
        }
    });
    Ok(Fixture {
        addr,
        task,
        _root: root,
    })
}

struct Shared {
    config: FixtureConfig,
    slots: Arc<Semaphore>,
    queued: Mutex<usize>,
    seq: AtomicU64,
    root: PathBuf,
    languages: Vec<(Language, PathBuf, &'static str)>,
    /// Agent sandboxes (`/sandboxes...`).
    agents: Arc<crate::fixture_agents::Agents>,
}

impl Shared {
    fn has(&self, f: Fault) -> bool {
        self.config.faults.contains(&f)
    }

    fn queued(&self) -> std::sync::MutexGuard<'_, usize> {
        self.queued.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A slot, else a place in the queue (counted here), for a new execution. While anything waits, a new
    /// execution queues behind it even if a slot just freed.
    fn admit(&self) -> Admission {
        let mut q = self.queued();
        if *q == 0 {
            if let Ok(p) = self.slots.clone().try_acquire_owned() {
                return Admission::Slot(p);
            }
        }
        if *q < self.config.max_queue {
            *q += 1;
            Admission::Queued
        } else {
            Admission::Full
        }
    }

    fn pong(&self) -> Pong {
        let active = (self.config.max_concurrent - self.slots.available_permits()) as u64;
        let load = if self.has(Fault::LoadLies) {
            Load::default()
        } else {
            Load {
                active_executions: active,
                queue_depth: *self.queued() as u64,
            }
        };
        Pong {
            load,
            capabilities: Some(Capabilities {
                languages: self.languages.iter().map(|l| l.0).collect(),
                max_limits: self.config.max_limits,
                extensions: vec!["files".into(), "base64_output".into(), "tool_calls".into()],
                isolation: Isolation {
                    namespaces: Vec::new(),
                    cgroup_version: "none".into(),
                    seccomp: false,
                    landlock_abi: None,
                    user_namespace: false,
                    network: "host".into(),
                },
            }),
        }
    }
}

/// A queued outgoing frame (the message boxed: it is much larger than a close).
enum Out {
    Msg(Box<ServerMessage>),
    Close(u16),
}

/// Sent to a running execution by its connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ctl {
    Run,
    Cancel,
}

type Registry = Arc<Mutex<HashMap<String, watch::Sender<Ctl>>>>;

/// The request target of the connection's first request line, read without consuming it.
async fn request_target(stream: &TcpStream) -> Option<String> {
    let mut buf = [0u8; 512];
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let n = stream.peek(&mut buf).await.ok()?;
        if n == 0 {
            return None;
        }
        if buf[..n].contains(&b'\n') || n == buf.len() || Instant::now() > deadline {
            let line = String::from_utf8_lossy(&buf[..n]);
            return line.split_whitespace().nth(1).map(str::to_owned);
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

fn status_response(code: StatusCode, body: String) -> ErrorResponse {
    let mut r = ErrorResponse::new(Some(body));
    *r.status_mut() = code;
    r
}

/// One connection: agent-sandbox routes go to their own module; `/ws` is upgraded and its frames handled one by
/// one, while a writer task sends what the connection and its executions queue.
#[allow(
    clippy::result_large_err,
    reason = "the handshake callback's error type is tungstenite's"
)]
async fn connection(shared: Arc<Shared>, stream: TcpStream) {
    // Agent sandboxes (`/sandboxes...`) are served by their own module; it has no volumes nor snapshots
    // (`/volumes...` and `/snapshots...` get 404, and the V and S cases skip).
    if let Some(path) = request_target(&stream).await {
        if ["/sandboxes", "/volumes", "/snapshots"]
            .iter()
            .any(|p| path.starts_with(p))
        {
            let is_ws = path.ends_with("/events");
            let (token, faults) = (shared.config.token.clone(), shared.config.faults.clone());
            shared
                .agents
                .clone()
                .serve(stream, &token, &faults, is_ws)
                .await;
            return;
        }
    }
    let s = shared.clone();
    let check = move |req: &Request, resp: Response| check_handshake(&s, req, resp);
    let config = WebSocketConfig::default()
        .max_message_size(Some(shared.config.max_frame_bytes))
        .max_frame_size(Some(shared.config.max_frame_bytes));
    let Ok(ws) = tokio_tungstenite::accept_hdr_async_with_config(stream, check, Some(config)).await
    else {
        return;
    };
    let (sink, mut source) = ws.split();
    let (prio_tx, prio_rx) = mpsc::unbounded_channel::<Out>();
    let (exec_tx, exec_rx) = mpsc::channel::<ServerMessage>(256);
    let hold_pongs = shared.has(Fault::NoPongDuringFlood);
    let writer = tokio::spawn(write_frames(sink, prio_rx, exec_rx, hold_pongs));
    let conn = Conn {
        shared,
        prio: prio_tx,
        exec: exec_tx,
        registry: Arc::new(Mutex::new(HashMap::new())),
        waiters: crate::fixture_tools::Waiters::default(),
    };
    while let Some(frame) = source.next().await {
        let text = match frame {
            Ok(Message::Text(t)) => t.as_str().to_owned(),
            Ok(Message::Binary(_)) => {
                conn.reply(RequestError::binary_frame().into());
                continue;
            }
            Ok(Message::Close(_)) => break,
            Ok(_) => continue,
            Err(tungstenite::Error::Capacity(_)) => {
                let _ = conn.prio.send(Out::Close(1009));
                break;
            }
            Err(_) => break,
        };
        conn.on_text(text);
    }
    // Executions of this connection see their control channel close.
    conn.registry
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .clear();
    drop(conn);
    let _ = writer.await;
}

/// The upgrade's checks: path, bearer token, `X-Protocol-Version`.
#[allow(
    clippy::result_large_err,
    reason = "the handshake callback's error type is tungstenite's"
)]
fn check_handshake(s: &Shared, req: &Request, resp: Response) -> Result<Response, ErrorResponse> {
    if req.uri().path() != "/ws" {
        return Err(status_response(StatusCode::NOT_FOUND, "not found\n".into()));
    }
    let auth = req
        .headers()
        .get("authorization")
        .and_then(|v| v.to_str().ok());
    let ok = auth.and_then(|a| a.strip_prefix("Bearer ")) == Some(s.config.token.as_str());
    if !ok && !s.has(Fault::AcceptsBadToken) {
        return Err(status_response(
            StatusCode::UNAUTHORIZED,
            "unauthorized\n".into(),
        ));
    }
    if let Some(v) = req.headers().get("x-protocol-version") {
        if v.to_str().ok().map(str::trim) != Some("1") && !s.has(Fault::IgnoresVersionHeader) {
            return Err(status_response(
                StatusCode::BAD_REQUEST,
                "{\"error\":\"unsupported protocol version\",\"supported_versions\":[1]}".into(),
            ));
        }
    }
    Ok(resp)
}

type Sink = futures_util::stream::SplitSink<tokio_tungstenite::WebSocketStream<TcpStream>, Message>;

/// The connection's writer: the connection's own frames (`prio`) before the executions' messages; with fault
/// `NoPongDuringFlood` (`hold_pongs`), pongs wait until output has paused for 2 s.
async fn write_frames(
    mut sink: Sink,
    mut prio: mpsc::UnboundedReceiver<Out>,
    mut exec: mpsc::Receiver<ServerMessage>,
    hold_pongs: bool,
) {
    let mut held: VecDeque<ServerMessage> = VecDeque::new();
    let mut last_output = Instant::now() - Duration::from_secs(60);
    let mut tick = tokio::time::interval(Duration::from_millis(50));
    loop {
        let out = tokio::select! {
            biased;
            m = prio.recv() => match m { Some(m) => m, None => break },
            m = exec.recv() => match m { Some(m) => Out::Msg(Box::new(m)), None => break },
            _ = tick.tick() => {
                if last_output.elapsed() > Duration::from_secs(2) {
                    while let Some(p) = held.pop_front() {
                        if sink.send(Message::text(protocol::encode(&p))).await.is_err() {
                            return;
                        }
                    }
                }
                continue;
            }
        };
        let frame = match out {
            Out::Close(code) => {
                let _ = sink
                    .send(Message::Close(Some(CloseFrame {
                        code: CloseCode::from(code),
                        reason: "message too big".into(),
                    })))
                    .await;
                break;
            }
            Out::Msg(m) => {
                let m = *m;
                if matches!(m, ServerMessage::Stdout(_) | ServerMessage::Stderr(_)) {
                    last_output = Instant::now();
                }
                if hold_pongs
                    && matches!(m, ServerMessage::Pong(_))
                    && last_output.elapsed() < Duration::from_secs(2)
                {
                    held.push_back(m);
                    continue;
                }
                Message::text(protocol::encode(&m))
            }
        };
        if sink.send(frame).await.is_err() {
            break;
        }
    }
}

/// An upgraded connection: where its messages go, and its executions.
struct Conn {
    shared: Arc<Shared>,
    /// The connection's own answers (errors, pongs, close), sent before any execution's messages.
    prio: mpsc::UnboundedSender<Out>,
    /// Given to each execution for its messages.
    exec: mpsc::Sender<ServerMessage>,
    registry: Registry,
    waiters: crate::fixture_tools::Waiters,
}

/// What capacity has for a new execution.
enum Admission {
    /// A free slot: it runs at once.
    Slot(OwnedSemaphorePermit),
    /// No free slot, but room in the queue.
    Queued,
    /// Neither.
    Full,
}

impl Conn {
    fn reply(&self, mut e: ErrorMessage) {
        if self.shared.has(Fault::ErrorWithoutId) {
            e.id = None;
        }
        let _ = self.prio.send(Out::Msg(Box::new(ServerMessage::Error(e))));
    }

    /// One text frame from the client.
    fn on_text(&self, text: String) {
        let text = if self.shared.has(Fault::IgnoresUnknownFields) {
            strip_unknown(&text)
        } else {
            text
        };
        match protocol::parse_client_message(&text) {
            Err(e) => self.reply(e.into()),
            Ok(ClientMessage::Ping(_)) => {
                let _ = self
                    .prio
                    .send(Out::Msg(Box::new(ServerMessage::Pong(self.shared.pong()))));
            }
            Ok(ClientMessage::Cancel(c)) => self.on_cancel(&c.id),
            Ok(ClientMessage::ToolResult(r)) => self.waiters.deliver(r),
            Ok(ClientMessage::Execute(req)) => self.on_execute(req),
        }
    }

    fn on_cancel(&self, id: &str) {
        let found = self
            .registry
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(id)
            .cloned();
        match found {
            Some(tx) => {
                if !self.shared.has(Fault::IgnoresCancel) {
                    tx.send_replace(Ctl::Cancel);
                }
            }
            None if self.shared.has(Fault::WrongErrorCode) => self.reply(ErrorMessage::new(
                Some(id.to_owned()),
                ErrorCode::InvalidRequest,
                "No such execution",
            )),
            None => self.reply(RequestError::unknown_execution(id).into()),
        }
    }

    /// Refuses the request, or starts its execution (running or queued).
    fn on_execute(&self, req: ExecuteRequest) {
        if let Some(e) = admit_request(&self.shared, &self.registry, &req) {
            self.reply(e);
            return;
        }
        let limits = match resolve(&self.shared, &req) {
            Ok(l) => l,
            Err(e) => {
                self.reply(e);
                return;
            }
        };
        let permit = match self.shared.admit() {
            Admission::Slot(p) => Some(p),
            Admission::Queued => None,
            Admission::Full => {
                self.refuse_overloaded(&req.id);
                return;
            }
        };
        let (ctl_tx, ctl_rx) = watch::channel(Ctl::Run);
        self.registry
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(req.id.clone(), ctl_tx);
        let exec = Execution {
            shared: self.shared.clone(),
            registry: self.registry.clone(),
            out: self.exec.clone(),
            req,
            limits,
            waiters: self.waiters.clone(),
        };
        tokio::spawn(exec.run(permit, ctl_rx));
    }

    /// `SANDBOX_OVERLOADED`, as the faults have it.
    fn refuse_overloaded(&self, id: &str) {
        let mut e = ErrorMessage::overloaded(id);
        if self.shared.has(Fault::OverloadNotRetryable) {
            e.retryable = false;
        }
        if self.shared.has(Fault::ErrorWithoutId) {
            e.id = None;
        }
        if self.shared.has(Fault::SlowOverload) {
            let tx = self.prio.clone();
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_secs(3)).await;
                let _ = tx.send(Out::Msg(Box::new(ServerMessage::Error(e))));
            });
        } else {
            let _ = self.prio.send(Out::Msg(Box::new(ServerMessage::Error(e))));
        }
    }
}

/// Removes the fields of an execute (and its limits) that FSP/1 does not define (fault `IgnoresUnknownFields`).
fn strip_unknown(text: &str) -> String {
    let Ok(mut v) = serde_json::from_str::<Value>(text) else {
        return text.to_owned();
    };
    if v["type"] == "execute" {
        if let Some(o) = v.as_object_mut() {
            let known = [
                "v",
                "type",
                "id",
                "ts",
                "language",
                "code",
                "stdin",
                "env",
                "limits",
                "files",
                "artifacts",
                "tools",
                "tool_timeout_ms",
            ];
            o.retain(|k, _| known.contains(&k.as_str()));
            if let Some(l) = o.get_mut("limits").and_then(Value::as_object_mut) {
                l.retain(|k, _| crate::wire::LIMIT_NAMES.contains(&k.as_str()));
            }
        }
    }
    v.to_string()
}

/// Refusals before limits: language, artifacts and network (extensions it does not implement), duplicate id.
fn admit_request(
    shared: &Shared,
    registry: &Registry,
    req: &ExecuteRequest,
) -> Option<ErrorMessage> {
    if !shared.languages.iter().any(|l| l.0 == req.language) {
        return Some(RequestError::language_not_supported(&req.id, req.language.as_str()).into());
    }
    if req.artifacts.is_some() {
        return Some(ErrorMessage::new(
            Some(req.id.clone()),
            ErrorCode::InvalidRequest,
            "Field artifacts: this server does not implement the artifacts extension",
        ));
    }
    if req.network.is_some() {
        return Some(ErrorMessage::new(
            Some(req.id.clone()),
            ErrorCode::InvalidRequest,
            "Field network: this server does not implement the network extension",
        ));
    }
    if registry
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .contains_key(&req.id)
    {
        return Some(RequestError::duplicate_execution(&req.id).into());
    }
    None
}

fn resolve(shared: &Shared, req: &ExecuteRequest) -> Result<Limits, ErrorMessage> {
    let max = shared.config.max_limits;
    if shared.has(Fault::ClampsLimits) {
        let l = req.limits;
        let d = Limits::DEFAULTS;
        return Ok(Limits {
            timeout_ms: l.timeout_ms.min(max.timeout_ms),
            memory_mb: l.memory_mb.min(max.memory_mb),
            cpu_shares: l.cpu_shares.unwrap_or(d.cpu_shares).min(max.cpu_shares),
            max_output_bytes: l
                .max_output_bytes
                .unwrap_or(d.max_output_bytes)
                .min(max.max_output_bytes),
            pids_max: l.pids_max.unwrap_or(d.pids_max).min(max.pids_max),
            disk_mb: l.disk_mb.unwrap_or(d.disk_mb).min(max.disk_mb),
            cpu_cores: None,
        });
    }
    req.resolve_limits(&max).map_err(ErrorMessage::from)
}

struct Execution {
    shared: Arc<Shared>,
    registry: Registry,
    out: mpsc::Sender<ServerMessage>,
    req: ExecuteRequest,
    limits: Limits,
    waiters: crate::fixture_tools::Waiters,
}

/// Why the fixture ended a program.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kill {
    Timeout,
    Oom,
    OutputLimit,
    Cancelled,
    Gone,
}

impl Execution {
    fn has(&self, f: Fault) -> bool {
        self.shared.has(f)
    }

    async fn send(&self, m: ServerMessage) {
        let _ = self.out.send(m).await;
    }

    fn release(&self) {
        self.registry
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&self.req.id);
    }

    async fn finish(&self, status: ExecStatus, result: ResultMessage) {
        self.release();
        let status = ServerMessage::Status {
            id: self.req.id.clone(),
            status,
        };
        let result = ServerMessage::Result(result);
        if self.has(Fault::NoResultAfterTimeout) && status_is(&status, ExecStatus::Timeout) {
            self.send(status).await;
        } else if self.has(Fault::ResultBeforeStatus) {
            self.send(result).await;
            self.send(status).await;
        } else {
            self.send(status).await;
            self.send(result).await;
        }
    }

    #[allow(
        clippy::too_many_arguments,
        reason = "one field per argument of the result"
    )]
    fn result(
        &self,
        exit_code: Option<i32>,
        signal: Option<String>,
        reason: Reason,
        duration: Duration,
        usage: ResourceUsage,
        sent: [u64; 2],
        truncated: bool,
    ) -> ResultMessage {
        ResultMessage {
            exit_code,
            duration_ms: duration.as_millis() as u64,
            resource_usage: usage,
            signal,
            stdout_bytes: sent[0],
            stderr_bytes: sent[1],
            truncated,
            ..ResultMessage::new(self.req.id.clone(), reason)
        }
    }

    async fn run(self, permit: Option<OwnedSemaphorePermit>, mut ctl: watch::Receiver<Ctl>) {
        let id = self.req.id.clone();
        if !self.has(Fault::NoAck) {
            self.send(ServerMessage::Ack {
                id: id.clone(),
                limits: Some(self.limits),
                queued: Some(permit.is_none()),
                environment_fingerprint: None,
                environment: None,
            })
            .await;
        }
        let permit = match permit {
            Some(p) => p,
            None => {
                let slots = self.shared.slots.clone();
                let got = tokio::select! {
                    p = slots.acquire_owned() => p.ok(),
                    _ = cancelled(&mut ctl) => None,
                };
                *self.shared.queued() -= 1;
                match got {
                    Some(p) => p,
                    None => {
                        if ctl.has_changed().is_ok() || *ctl.borrow() == Ctl::Cancel {
                            let r = self.result(
                                None,
                                None,
                                Reason::Cancelled,
                                Duration::ZERO,
                                ResourceUsage::default(),
                                [0, 0],
                                false,
                            );
                            self.finish(ExecStatus::Cancelled, r).await;
                        } else {
                            self.release();
                        }
                        return;
                    }
                }
            }
        };
        self.run_in_slot(ctl).await;
        drop(permit);
    }

    /// Runs the program in a slot: start it, watch it to its end, report.
    async fn run_in_slot(&self, ctl: watch::Receiver<Ctl>) {
        let mut program = match self.start() {
            Ok(p) => p,
            Err(message) => {
                self.release();
                self.send(ServerMessage::Error(ErrorMessage::internal(
                    &self.req.id,
                    message,
                )))
                .await;
                return;
            }
        };
        let Some(mut watch) = self.supervise(&mut program, ctl).await else {
            // Fault LeavesProcessAfterDisconnect: the program stays, and so do its directories.
            return;
        };
        let duration = program.started.elapsed();
        let _ = self.cleanup(&program.dir, &program.code_path);
        if watch.gone || watch.kill == Some(Kill::Gone) {
            self.release();
            return;
        }
        for (which, chunker) in watch.chunkers.iter_mut().enumerate() {
            if let Some(c) = chunker.finish() {
                self.send(output(&self.req.id, which, c)).await;
            }
        }
        self.report(&watch, duration, program.broker.take()).await;
    }

    /// Prepares the execution's directories and starts its program; the error is the message of an
    /// `INTERNAL_ERROR`.
    fn start(&self) -> Result<Program, String> {
        let n = self.shared.seq.fetch_add(1, Ordering::Relaxed);
        // Unique across every fixture of this process, so that one fixture never kills another one's programs.
        let tag = format!(
            "{}-{}",
            std::process::id(),
            TAGS.fetch_add(1, Ordering::Relaxed)
        );
        let dir = if self.has(Fault::SharedWorkdir) {
            self.shared.root.join("shared")
        } else {
            self.shared.root.join(format!("exec-{n}"))
        };
        let work = dir.join("work");
        let tmp = dir.join("tmp");
        let Some((_, interpreter, file_name)) = self
            .shared
            .languages
            .iter()
            .find(|l| l.0 == self.req.language)
            .cloned()
        else {
            return Err("Language vanished".into());
        };
        let code_path = self.shared.root.join(format!("code-{n}")).join(file_name);
        self.prepare(&work, &tmp, &code_path)
            .map_err(|e| format!("Cannot prepare the working directory: {e}"))?;
        let mut cmd = tokio::process::Command::new(&interpreter);
        // Extension tool_calls: the SDK's runner before the code, its socket in the execution's directory.
        let broker = if self.req.tools.is_empty() {
            None
        } else {
            let b = crate::fixture_tools::Broker::start(
                &self.req,
                &dir.join("tools"),
                self.out.clone(),
                self.waiters.clone(),
                self.has(Fault::ForwardsUnlistedTools),
            )
            .map_err(|e| format!("Cannot set up the tool socket: {e}"))?;
            cmd.arg(&b.runner);
            Some(b)
        };
        self.configure(&mut cmd, &code_path, &work, &tmp, &tag);
        if let Some(b) = &broker {
            cmd.envs(b.env.clone());
        }
        let started = Instant::now();
        let child = cmd
            .spawn()
            .map_err(|e| format!("Cannot start the program: {e}"))?;
        let pid = child.id().map(|p| p as i32).unwrap_or(0);
        Ok(Program {
            child,
            pid,
            tag,
            dir,
            code_path,
            broker,
            started,
        })
    }

    /// The program's arguments after the interpreter's, its environment, stdio, process group and file size
    /// limit.
    fn configure(
        &self,
        cmd: &mut tokio::process::Command,
        code_path: &Path,
        work: &Path,
        tmp: &Path,
        tag: &str,
    ) {
        cmd.arg(code_path)
            .current_dir(work)
            .env_clear()
            .env("PATH", "/usr/local/bin:/usr/bin:/bin")
            .env("HOME", work)
            .env("TMPDIR", tmp)
            .env("LANG", "C.UTF-8")
            .env("PYTHONUNBUFFERED", "1")
            .env("PYTHONDONTWRITEBYTECODE", "1")
            .envs(&self.req.env)
            .env(TAG_VAR, tag)
            .stdin(if self.req.stdin.is_some() {
                Stdio::piped()
            } else {
                Stdio::null()
            })
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .process_group(0);
        let fsize = self.limits.disk_mb << 20;
        // SAFETY: the closure runs in the forked child before exec and only calls setrlimit(2), which is
        // async-signal-safe; it allocates nothing and touches no lock.
        unsafe {
            cmd.pre_exec(move || {
                nix::sys::resource::setrlimit(
                    nix::sys::resource::Resource::RLIMIT_FSIZE,
                    fsize,
                    fsize,
                )
                .map_err(std::io::Error::from)
            });
        }
    }

    /// Streams the program's output and enforces its limits (time, memory, output), cancel and disconnect, until
    /// it has exited and its pipes are drained. `None` when the fault `LeavesProcessAfterDisconnect` abandons it.
    async fn supervise(
        &self,
        program: &mut Program,
        mut ctl: watch::Receiver<Ctl>,
    ) -> Option<Watch> {
        self.send(ServerMessage::Status {
            id: self.req.id.clone(),
            status: ExecStatus::Running,
        })
        .await;
        if let (Some(mut stdin), Some(input)) = (program.child.stdin.take(), self.req.stdin.clone())
        {
            tokio::spawn(async move {
                let _ = stdin.write_all(input.as_bytes()).await;
            });
        }
        let mut w = Watch::new(&mut program.child);
        let (pid, tag) = (program.pid, program.tag.as_str());
        let mut drain_until: Option<tokio::time::Instant> = None;
        let deadline = tokio::time::Instant::now() + Duration::from_millis(self.limits.timeout_ms);
        let mut tick = tokio::time::interval(Duration::from_millis(5));
        let memory = self.limits.memory_mb << 20;
        loop {
            if w.exit.is_some() && w.pipes.iter().all(Option::is_none) {
                break;
            }
            let [p0, p1] = &mut w.pipes;
            let [b0, b1] = &mut w.bufs;
            tokio::select! {
                r = read_pipe(p0, b0) => self.on_output(0, r, &mut w, pid, tag).await,
                r = read_pipe(p1, b1) => self.on_output(1, r, &mut w, pid, tag).await,
                st = program.child.wait(), if w.exit.is_none() => {
                    w.exit = Some(st.unwrap_or_else(|_| std::process::ExitStatus::from_raw(9)));
                    // Nothing of the execution outlives it.
                    kill_tree(pid, tag);
                    drain_until = Some(tokio::time::Instant::now() + Duration::from_secs(2));
                }
                _ = tokio::time::sleep_until(deadline), if w.kill.is_none() && w.exit.is_none() => {
                    w.kill = Some(Kill::Timeout);
                    kill_tree(pid, tag);
                }
                c = ctl.changed(), if !w.gone && w.exit.is_none() => match c {
                    Ok(()) => {
                        if *ctl.borrow() == Ctl::Cancel && w.kill.is_none() {
                            w.kill = Some(Kill::Cancelled);
                            kill_tree(pid, tag);
                        }
                    }
                    Err(_) => {
                        w.gone = true;
                        if self.has(Fault::LeavesProcessAfterDisconnect) {
                            return None;
                        }
                        w.kill.get_or_insert(Kill::Gone);
                        kill_tree(pid, tag);
                    }
                },
                _ = tick.tick(), if w.exit.is_none() => {
                    if let Some((rss, peak, cpu)) = proc_usage(pid) {
                        w.usage.peak_memory_mb = w.usage.peak_memory_mb.max(peak.div_ceil(1 << 20));
                        w.usage.cpu_time_ms = cpu;
                        if rss > memory && w.kill.is_none() {
                            w.kill = Some(Kill::Oom);
                            kill_tree(pid, tag);
                        }
                    }
                }
                _ = sleep_opt(drain_until) => {
                    w.pipes = [None, None];
                }
            }
        }
        Some(w)
    }

    /// One read of stdout (`which` 0) or stderr (1): sent as output up to `max_output_bytes`; beyond it, the
    /// program is killed and its pipes dropped.
    async fn on_output(
        &self,
        which: usize,
        r: std::io::Result<usize>,
        w: &mut Watch,
        pid: i32,
        tag: &str,
    ) {
        let n = match r {
            Ok(0) | Err(_) => {
                w.pipes[which] = None;
                return;
            }
            Ok(n) => n,
        };
        let room = if self.has(Fault::OutputBeyondLimit) {
            u64::MAX
        } else {
            self.limits
                .max_output_bytes
                .saturating_sub(w.sent[0] + w.sent[1])
        };
        let take = (n as u64).min(room) as usize;
        w.sent[which] += take as u64;
        if take > 0 && !w.gone {
            let bytes = &w.bufs[which][..take];
            let chunk = if self.has(Fault::SplitsUtf8) {
                Some(split_chunk(bytes))
            } else {
                w.chunkers[which].push(bytes)
            };
            if let Some(c) = chunk {
                self.send(output(&self.req.id, which, c)).await;
            }
        }
        if take < n {
            w.truncated = true;
            if w.kill.is_none() {
                w.kill = Some(Kill::OutputLimit);
                kill_tree(pid, tag);
            }
            for (which, c) in w.chunkers.iter_mut().enumerate() {
                if let Some(c) = c.finish() {
                    if !w.gone {
                        self.send(output(&self.req.id, which, c)).await;
                    }
                }
            }
            w.pipes = [None, None];
        }
    }

    /// The terminal status and `result` of a program that ran to its end (or was ended by the fixture).
    async fn report(
        &self,
        w: &Watch,
        duration: Duration,
        broker: Option<crate::fixture_tools::Broker>,
    ) {
        let st = w
            .exit
            .unwrap_or_else(|| std::process::ExitStatus::from_raw(9));
        let (status, reason, exit_code, signal) = self.verdict(st, w.kill);
        let mut r = self.result(
            exit_code,
            signal,
            reason,
            duration,
            w.usage,
            w.sent,
            w.truncated,
        );
        if let Some(b) = broker {
            r.tool_calls = Some(b.calls());
            r.return_value = b.return_value().map(Box::new);
        }
        self.finish(status, r).await;
    }

    /// Status, reason, exit code and signal name from how the program exited and why the fixture killed it.
    fn verdict(
        &self,
        st: std::process::ExitStatus,
        kill: Option<Kill>,
    ) -> (ExecStatus, Reason, Option<i32>, Option<String>) {
        let signal = st.signal();
        let exit_code = match (st.code(), signal) {
            (Some(c), _) => Some(c),
            (None, Some(s)) if self.has(Fault::ExitCodeOnSignal) => Some(128 + s),
            _ => None,
        };
        let signame = signal.map(|s| {
            Signal::try_from(s)
                .map(|s| s.as_str().to_owned())
                .unwrap_or_else(|_| format!("SIG{s}"))
        });
        let (status, reason, exit_code) = match kill {
            Some(Kill::Timeout) => (
                ExecStatus::Timeout,
                Reason::Timeout,
                exit_code.filter(|_| self.has(Fault::ExitCodeOnSignal)),
            ),
            Some(Kill::Oom) => (ExecStatus::Oom, Reason::Oom, None),
            Some(Kill::OutputLimit) => (ExecStatus::Failed, Reason::OutputLimit, None),
            Some(Kill::Cancelled) | Some(Kill::Gone) => {
                (ExecStatus::Cancelled, Reason::Cancelled, None)
            }
            None => match exit_code {
                Some(0) if signal.is_none() => (ExecStatus::Completed, Reason::Exited, Some(0)),
                Some(c) if signal.is_none() => (ExecStatus::Failed, Reason::Exited, Some(c)),
                c => (ExecStatus::Failed, Reason::Signaled, c),
            },
        };
        let signame = if exit_code.is_none() || self.has(Fault::ExitCodeOnSignal) {
            signame
        } else {
            None
        };
        (status, reason, exit_code, signame)
    }

    fn prepare(&self, work: &Path, tmp: &Path, code_path: &Path) -> std::io::Result<()> {
        std::fs::create_dir_all(work)?;
        std::fs::create_dir_all(tmp)?;
        if let Some(p) = code_path.parent() {
            std::fs::create_dir_all(p)?;
        }
        std::fs::write(code_path, self.req.code.as_bytes())?;
        for f in &self.req.files {
            let content = f
                .decoded()
                .map_err(|e| std::io::Error::other(e.to_string()))?;
            let path = work.join(&f.path);
            if let Some(p) = path.parent() {
                std::fs::create_dir_all(p)?;
            }
            std::fs::write(path, content)?;
        }
        Ok(())
    }

    fn cleanup(&self, dir: &Path, code_path: &Path) -> std::io::Result<()> {
        if let Some(p) = code_path.parent() {
            std::fs::remove_dir_all(p)?;
        }
        if !self.has(Fault::SharedWorkdir) {
            std::fs::remove_dir_all(dir)?;
        }
        Ok(())
    }
}

/// An execution's program once started, and what lives as long as it.
struct Program {
    child: tokio::process::Child,
    /// Its pid, which is also its process group's.
    pid: i32,
    /// The value of [`TAG_VAR`] in its processes.
    tag: String,
    /// The execution's directory (working directory, temporary directory, tool socket).
    dir: PathBuf,
    /// The code, outside the working directory.
    code_path: PathBuf,
    /// Extension `tool_calls`: the tool socket's server.
    broker: Option<crate::fixture_tools::Broker>,
    started: Instant,
}

/// What the fixture keeps track of while a program runs: its output pipes and what was sent of them, and how it
/// ended.
struct Watch {
    /// stdout and stderr, `None` once at their end or abandoned.
    pipes: [Option<Pipe>; 2],
    bufs: [Vec<u8>; 2],
    chunkers: [Utf8Chunker; 2],
    /// Bytes of stdout and stderr sent.
    sent: [u64; 2],
    truncated: bool,
    /// Why the fixture killed the program, if it did.
    kill: Option<Kill>,
    exit: Option<std::process::ExitStatus>,
    /// The connection closed.
    gone: bool,
    usage: ResourceUsage,
}

impl Watch {
    /// Takes the child's stdout and stderr.
    fn new(child: &mut tokio::process::Child) -> Watch {
        Watch {
            pipes: [
                child.stdout.take().map(Pipe::Out),
                child.stderr.take().map(Pipe::Err),
            ],
            bufs: [vec![0u8; 65536], vec![0u8; 65536]],
            chunkers: [Utf8Chunker::new(), Utf8Chunker::new()],
            sent: [0; 2],
            truncated: false,
            kill: None,
            exit: None,
            gone: false,
            usage: ResourceUsage::default(),
        }
    }
}

/// One read as one chunk, UTF-8 sequences split at its edges or not (fault `SplitsUtf8`): text if the read
/// happens to be valid UTF-8, base64 otherwise.
fn split_chunk(bytes: &[u8]) -> protocol::Chunk {
    match std::str::from_utf8(bytes) {
        Ok(t) => protocol::Chunk {
            data: t.to_owned(),
            encoding: protocol::OutputEncoding::Utf8,
            raw_len: bytes.len(),
        },
        Err(_) => {
            use base64::Engine as _;
            protocol::Chunk {
                data: base64::engine::general_purpose::STANDARD.encode(bytes),
                encoding: protocol::OutputEncoding::Base64,
                raw_len: bytes.len(),
            }
        }
    }
}

fn status_is(m: &ServerMessage, s: ExecStatus) -> bool {
    matches!(m, ServerMessage::Status { status, .. } if *status == s)
}

fn output(id: &str, which: usize, c: protocol::Chunk) -> ServerMessage {
    let chunk = OutputChunk::new(id.to_owned(), c);
    if which == 0 {
        ServerMessage::Stdout(chunk)
    } else {
        ServerMessage::Stderr(chunk)
    }
}

/// The environment variable every process of an execution inherits; how the fixture finds the whole tree.
const TAG_VAR: &str = "FSP_FIXTURE_EXEC";

/// Execution tags handed out in this process.
static TAGS: AtomicU64 = AtomicU64::new(0);

enum Pipe {
    Out(tokio::process::ChildStdout),
    Err(tokio::process::ChildStderr),
}

async fn read_pipe(p: &mut Option<Pipe>, buf: &mut [u8]) -> std::io::Result<usize> {
    match p {
        Some(Pipe::Out(o)) => o.read(buf).await,
        Some(Pipe::Err(e)) => e.read(buf).await,
        None => std::future::pending().await,
    }
}

async fn sleep_opt(at: Option<tokio::time::Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

async fn cancelled(ctl: &mut watch::Receiver<Ctl>) {
    loop {
        if *ctl.borrow_and_update() == Ctl::Cancel {
            return;
        }
        if ctl.changed().await.is_err() {
            return;
        }
    }
}

/// Kills the program's process group and every process carrying the execution's tag.
fn kill_tree(pid: i32, tag: &str) {
    if pid > 0 {
        let _ = nix::sys::signal::killpg(Pid::from_raw(pid), Signal::SIGKILL);
    }
    let needle = format!("{TAG_VAR}={tag}\0");
    for _ in 0..5 {
        let mut found = false;
        if let Ok(entries) = std::fs::read_dir("/proc") {
            for e in entries.flatten() {
                let Some(p) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
                    continue;
                };
                if let Ok(env) = std::fs::read(format!("/proc/{p}/environ")) {
                    if env.windows(needle.len()).any(|w| w == needle.as_bytes()) {
                        let _ = nix::sys::signal::kill(Pid::from_raw(p), Signal::SIGKILL);
                        found = true;
                    }
                }
            }
        }
        if !found {
            break;
        }
    }
}

/// Resident memory, peak resident memory (bytes) and cpu time (ms) of a process.
fn proc_usage(pid: i32) -> Option<(u64, u64, u64)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let kb = |name: &str| -> u64 {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0)
            * 1024
    };
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .map(|(_, t)| t.split_whitespace().collect())
        .unwrap_or_default();
    let ticks = |i: usize| {
        fields
            .get(i)
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0)
    };
    // After the command name: state is field 0, utime 11, stime 12 (clock ticks, 100 per second).
    Some((kb("VmRSS:"), kb("VmHWM:"), (ticks(11) + ticks(12)) * 10))
}

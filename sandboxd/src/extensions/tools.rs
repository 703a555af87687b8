//! The tool-call broker of the `tool_calls` extension (`docs/spec/tool-calls.md`).
//!
//! When an `execute` lists `tools`, the daemon writes the SDK next to the code file (`/sandbox/sandbox_tools.py`,
//! `/sandbox/sandbox_tools.js`, their runners, and `/sandbox/sandbox_tools.json` with the tool list and the
//! socket's limits), binds a unix socket at `/sandbox/tools.sock` (host side: `<scratch>/code/tools.sock`, owned
//! by the execution's uid, mode 0600) before the program starts, and serves it until the execution ends:
//!
//! - The sandbox speaks JSON lines: `{"op":"call","name":..,"args":{..},"timeout_ms"?:n}` or
//!   `{"op":"return","value":..}`; each line gets exactly one reply line, `{"ok":true,"result":..}` or
//!   `{"ok":false,"error":{"code":..,"message":..}}`, in order. A line that is not a request (not JSON, not UTF-8)
//!   gets `invalid` and the next line is served. One request is served at a time per connection, and at most
//!   [`ToolsConfig::max_connections`] connections are served at once, so at most that many calls are in flight; a
//!   longer line than [`ToolsConfig::max_line_bytes`] gets `invalid` and closes the connection.
//! - Memory: lines are read as bytes ([`lines`]) and the arguments stay JSON text ([`protocol::RawArgs`]), never a
//!   JSON tree; every request's bytes are charged to the execution's budget
//!   ([`ToolsConfig::max_memory_bytes`]) from the moment they are read until the reply is written (a return value
//!   until the execution ends). A request that does not fit gets `limit`.
//! - A tool the request did not list is refused inside the sandbox (`not_allowed`), never forwarded. A listed one
//!   becomes a `tool_call` on the connection's ordered execution queue (bounded: a flooding program waits, the
//!   WebSocket's priority queue still answers `ping`), and the `tool_result` the connection routes back through
//!   [`Inbox::deliver`] is the reply. No answer within the per-call timeout: `timeout`.
//! - Once the execution ends ([`Broker::close`]: timeout, cancel, kill or exit), every waiting and every new call
//!   gets `closed`; a call is put on the client's queue before the end is decided or never.
//! - Dropping the [`Broker`] ends every task (the accept loop owns the connection tasks), forgets pending calls and
//!   removes the socket file.

mod lines;

use std::collections::{HashMap, HashSet};
use std::os::fd::AsRawFd;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use protocol::{
    ExecuteRequest, Language, RawArgs, ServerMessage, ToolCall, ToolRequest, ToolResult,
};
use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::{json, Value};
use tokio::io::AsyncWriteExt;
use tokio::net::UnixListener;
use tokio::sync::{mpsc, oneshot, watch, Semaphore};
use tokio::task::JoinSet;
use tracing::{debug, warn, Instrument};

use self::lines::{Budget, Frame, Lease, Lines};

/// The socket's name in the code directory.
pub const SOCKET_NAME: &str = "tools.sock";
/// The socket's path inside the container.
pub const SANDBOX_SOCKET: &str = "/sandbox/tools.sock";

const PY_SDK: &str = include_str!("../../sdk/sandbox_tools.py");
const PY_RUN: &str = include_str!("../../sdk/sandbox_tools_run.py");
const JS_SDK: &str = include_str!("../../sdk/sandbox_tools.js");
const JS_RUN: &str = include_str!("../../sdk/sandbox_tools_run.js");

/// `tools:` in the daemon's configuration.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ToolsConfig {
    /// The largest `tool_timeout_ms` a request may ask for.
    pub max_call_timeout_ms: u64,
    /// Connections to the tool socket served at once per execution (= calls in flight at most).
    pub max_connections: usize,
    /// Requests (calls, refused or not, and returns) one execution may make.
    pub max_calls: u64,
    /// The longest request line from the sandbox, bytes.
    pub max_line_bytes: usize,
    /// Bytes of requests one execution's broker holds at most at once (read and not yet answered, plus the
    /// return value); at least `max_line_bytes`. Each connection also holds an 8 KiB read buffer.
    pub max_memory_bytes: usize,
}

impl Default for ToolsConfig {
    fn default() -> Self {
        Self {
            max_call_timeout_ms: 600_000,
            max_connections: 8,
            max_calls: 10_000,
            max_line_bytes: 1 << 20,
            max_memory_bytes: 16 << 20,
        }
    }
}

/// A broker that could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum ToolsError {
    /// Writing the SDK or binding the socket failed.
    #[error("Cannot set up the tool socket at {path}")]
    Io {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> ToolsError + '_ {
    move |source| ToolsError::Io {
        path: path.to_owned(),
        source,
    }
}

/// The calls of one execution waiting for their `tool_result`, by `call_id`. The connection's registry holds one
/// per execution and hands it every `tool_result` for that execution.
#[derive(Clone, Default)]
pub struct Inbox {
    pending: Arc<Mutex<HashMap<String, oneshot::Sender<ToolResult>>>>,
}

impl Inbox {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, oneshot::Sender<ToolResult>>> {
        self.pending.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Hands `result` to the call waiting for it; `false` if none waits (timed out, or never made). Never blocks.
    pub fn deliver(&self, result: ToolResult) -> bool {
        match self.lock().remove(&result.call_id) {
            Some(tx) => tx.send(result).is_ok(),
            None => false,
        }
    }

    fn expect(&self, call_id: &str) -> oneshot::Receiver<ToolResult> {
        let (tx, rx) = oneshot::channel();
        self.lock().insert(call_id.to_owned(), tx);
        rx
    }

    fn forget(&self, call_id: &str) {
        self.lock().remove(call_id);
    }
}

/// Makes the interpreter run the SDK's runner for an execution with tools: for python
/// `python3 /sandbox/sandbox_tools_run.py /sandbox/main.py` with `PYTHONPATH=/sandbox`, for javascript the same with
/// `NODE_PATH=/sandbox`. Leaves executions without tools alone.
pub fn adjust_command(
    req: &ExecuteRequest,
    args: &mut Vec<String>,
    env: &mut std::collections::BTreeMap<String, String>,
) {
    if req.tools.is_empty() {
        return;
    }
    let (runner, var) = match req.language {
        Language::Python => ("sandbox_tools_run.py", "PYTHONPATH"),
        Language::Javascript => ("sandbox_tools_run.js", "NODE_PATH"),
        // Refused by the protocol's validation.
        Language::Shell | Language::Elixir => return,
    };
    if let Some(code) = args.pop() {
        args.push(format!("{}/{runner}", runtime::rootfs::CODE_DIR));
        args.push(code);
    }
    env.insert(var.into(), runtime::rootfs::CODE_DIR.into());
    env.insert("SANDBOX_TOOLS_SOCKET".into(), SANDBOX_SOCKET.into());
}

/// What one execution's broker shares with its tasks.
struct Shared {
    exec_id: String,
    allowed: HashSet<String>,
    timeout_ms: u64,
    max_calls: u64,
    out: mpsc::Sender<ServerMessage>,
    inbox: Inbox,
    seq: AtomicU64,
    requests: AtomicU64,
    forwarded: AtomicU64,
    /// Bytes of the reply lines of calls that succeeded: what the tools returned into the sandbox.
    result_bytes: AtomicU64,
    budget: Budget,
    /// The return value and the lease holding its bytes.
    return_value: Mutex<Option<(Box<RawValue>, Lease)>>,
    /// Set once `status: running` is queued: no `tool_call` may come before it.
    running: watch::Receiver<bool>,
    /// Set when the execution ends: no `tool_call` may come after it.
    closed: watch::Receiver<bool>,
    /// The execution's span, the parent of each call's span (the connection tasks run outside it).
    span: tracing::Span,
}

/// One execution's tool socket and its tasks; dropping it tears everything down.
pub struct Broker {
    shared: Arc<Shared>,
    running: watch::Sender<bool>,
    closed: watch::Sender<bool>,
    socket: PathBuf,
    accept: tokio::task::JoinHandle<()>,
}

/// How putting a `tool_call` on the client's queue went.
enum Sent {
    Queued,
    ClientGone,
    Ended,
}

impl Broker {
    /// Writes the SDK into `code_dir`, binds `code_dir/tools.sock` for the container user `host_id` and starts
    /// serving it. `None` when the request lists no tools. Must be called inside the tokio runtime.
    pub fn start(
        req: &ExecuteRequest,
        code_dir: &Path,
        host_id: u32,
        timeout_ms: u64,
        config: &ToolsConfig,
        out: mpsc::Sender<ServerMessage>,
        inbox: Inbox,
    ) -> Result<Option<Broker>, ToolsError> {
        if req.tools.is_empty() {
            return Ok(None);
        }
        write_sdk(req, code_dir, config)?;
        let socket = code_dir.join(SOCKET_NAME);
        let listener = bind(code_dir, &socket, host_id)?;
        let (running, running_rx) = watch::channel(false);
        let (closed, closed_rx) = watch::channel(false);
        let shared = Arc::new(Shared {
            exec_id: req.id.clone(),
            allowed: req.tools.iter().map(|t| t.name.clone()).collect(),
            timeout_ms,
            max_calls: config.max_calls,
            out,
            inbox,
            seq: AtomicU64::new(0),
            requests: AtomicU64::new(0),
            forwarded: AtomicU64::new(0),
            result_bytes: AtomicU64::new(0),
            budget: Budget::new(config.max_memory_bytes),
            return_value: Mutex::new(None),
            running: running_rx,
            closed: closed_rx,
            span: tracing::Span::current(),
        });
        let accept = tokio::spawn(accept_loop(
            listener,
            shared.clone(),
            config.max_connections.max(1),
            config.max_line_bytes,
        ));
        Ok(Some(Broker {
            shared,
            running,
            closed,
            socket,
            accept,
        }))
    }

    /// The execution's `status: running` is queued: calls may be forwarded from now on (a program that calls at
    /// once may otherwise get its `tool_call` ahead of it).
    pub fn started(&self) {
        self.running.send_replace(true);
    }

    /// The execution ended (timeout, cancel, kill or exit): waiting calls get `closed` now, and so does every
    /// later request; no `tool_call` is queued after this returns.
    pub fn close(&self) {
        if *self.closed.borrow() {
            return;
        }
        // Waits for a call that is putting its `tool_call` on the queue right now (it holds the flag's read lock).
        self.closed.send_replace(true);
        self.shared.inbox.lock().clear();
    }

    /// Calls forwarded to the client as `tool_call`.
    pub fn calls(&self) -> u64 {
        self.shared.forwarded.load(Ordering::Relaxed)
    }

    /// Bytes of the successful tool results the code received (their reply lines).
    pub fn result_bytes(&self) -> u64 {
        self.shared.result_bytes.load(Ordering::Relaxed)
    }

    /// Bytes of the return value's JSON; 0 when the code returned nothing.
    pub fn return_value_bytes(&self) -> u64 {
        let kept = self
            .shared
            .return_value
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        kept.as_ref().map_or(0, |(raw, _)| raw.get().len() as u64)
    }

    /// The value the code returned, if it returned one.
    pub fn return_value(&self) -> Option<Value> {
        let kept = self
            .shared
            .return_value
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        kept.as_ref()
            .and_then(|(raw, _)| serde_json::from_str(raw.get()).ok())
    }
}

impl Drop for Broker {
    fn drop(&mut self) {
        self.accept.abort();
        self.shared.inbox.lock().clear();
        if let Err(e) = std::fs::remove_file(&self.socket) {
            if e.kind() != std::io::ErrorKind::NotFound {
                warn!(error = %e, "cannot remove the tool socket");
            }
        }
    }
}

/// The SDK files: the tool list as JSON, the SDK and the runner of the request's language. Read-only for the
/// container (the directory is bind-mounted read-only too).
fn write_sdk(
    req: &ExecuteRequest,
    code_dir: &Path,
    config: &ToolsConfig,
) -> Result<(), ToolsError> {
    let tools: Vec<Value> = req
        .tools
        .iter()
        .map(|t| {
            json!({
                "name": t.name,
                "description": t.description.clone().unwrap_or_default(),
                "params": t.parameters(),
            })
        })
        .collect();
    // The SDKs use at most `max_connections` connections and check a request's size before sending it.
    let list = serde_json::to_string(&json!({
        "tools": tools,
        "max_connections": config.max_connections.max(1),
        "max_line_bytes": config.max_line_bytes,
    }))
    .unwrap_or_default();
    let mut files = vec![("sandbox_tools.json", list.as_str())];
    match req.language {
        Language::Python => files.extend([
            ("sandbox_tools.py", PY_SDK),
            ("sandbox_tools_run.py", PY_RUN),
        ]),
        Language::Javascript => files.extend([
            ("sandbox_tools.js", JS_SDK),
            ("sandbox_tools_run.js", JS_RUN),
        ]),
        Language::Shell | Language::Elixir => {}
    }
    for (name, text) in files {
        let path = code_dir.join(name);
        std::fs::write(&path, text).map_err(io_err(&path))?;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o444))
            .map_err(io_err(&path))?;
    }
    Ok(())
}

/// Binds the socket and gives it to the container user. A unix socket path holds at most 107 bytes and the
/// scratch directory may be deeper, so the bind goes through `/proc/self/fd/<dir>/tools.sock`.
fn bind(code_dir: &Path, socket: &Path, host_id: u32) -> Result<UnixListener, ToolsError> {
    let dir = std::fs::File::open(code_dir).map_err(io_err(code_dir))?;
    let short = PathBuf::from(format!("/proc/self/fd/{}/{SOCKET_NAME}", dir.as_raw_fd()));
    let listener = std::os::unix::net::UnixListener::bind(&short).map_err(io_err(socket))?;
    drop(dir);
    let owner = Some(nix::unistd::Uid::from_raw(host_id));
    let group = Some(nix::unistd::Gid::from_raw(host_id));
    nix::unistd::chown(socket, owner, group).map_err(|e| ToolsError::Io {
        path: socket.to_owned(),
        source: e.into(),
    })?;
    std::fs::set_permissions(socket, std::fs::Permissions::from_mode(0o600))
        .map_err(io_err(socket))?;
    listener.set_nonblocking(true).map_err(io_err(socket))?;
    UnixListener::from_std(listener).map_err(io_err(socket))
}

async fn accept_loop(
    listener: UnixListener,
    shared: Arc<Shared>,
    max_connections: usize,
    max_line: usize,
) {
    let slots = Arc::new(Semaphore::new(max_connections));
    // Owned here: aborting this task drops the set, which aborts every connection task.
    let mut connections = JoinSet::new();
    loop {
        // Wait for a free slot before accepting: extra connections wait in the kernel's backlog.
        let permit = tokio::select! {
            p = slots.clone().acquire_owned() => match p { Ok(p) => p, Err(_) => return },
            Some(_) = connections.join_next(), if !connections.is_empty() => continue,
        };
        let stream = tokio::select! {
            s = listener.accept() => match s {
                Ok((s, _)) => s,
                Err(e) => {
                    warn!(error = %e, "tool socket accept failed");
                    return;
                }
            },
            Some(_) = connections.join_next(), if !connections.is_empty() => continue,
        };
        let shared = shared.clone();
        connections.spawn(async move {
            serve(stream, &shared, max_line).await;
            drop(permit);
        });
    }
}

/// Serves one connection: one request at a time, each line answered by one line.
async fn serve(stream: tokio::net::UnixStream, shared: &Shared, max_line: usize) {
    let (read, mut write) = stream.into_split();
    let mut lines = Lines::new(read, max_line, shared.budget.clone());
    loop {
        let frame = match lines.next().await {
            Ok(Some(frame)) => frame,
            Ok(None) => return,
            Err(e) => {
                debug!(error = %e, "tool connection read failed");
                return;
            }
        };
        let mut called = None;
        let (reply, last) = match frame {
            Frame::Line(line, lease) => {
                let (reply, call) = shared.handle(line, lease).await;
                called = call;
                (reply, false)
            }
            Frame::OverBudget => (
                refusal(
                    "limit",
                    &format!(
                        "The tool requests of this execution may hold at most {} bytes at once",
                        shared.budget.max()
                    ),
                ),
                false,
            ),
            Frame::TooLong => (
                refusal(
                    "invalid",
                    &format!("A request line is longer than {max_line} bytes"),
                ),
                true,
            ),
        };
        let mut text = reply.to_string();
        text.push('\n');
        if let Some(call) = called {
            shared.record(call, &reply, text.len());
        }
        if write.write_all(text.as_bytes()).await.is_err() || last {
            return;
        }
    }
}

fn refusal(code: &str, message: &str) -> Value {
    json!({"ok": false, "error": {"code": code, "message": message}})
}

fn ending() -> Value {
    refusal("closed", "The execution is ending")
}

/// A tool call being answered: what its log line, metrics and span need.
struct Called {
    name: String,
    listed: bool,
    args_bytes: usize,
    started: Instant,
    /// `tool_call`, a child of the execution's span; ends when this is dropped, after [`Shared::record`].
    span: tracing::Span,
}

impl Shared {
    fn ended(&self) -> bool {
        *self.closed.borrow()
    }

    /// A call got `reply` (`reply_bytes` on the wire): counted, its result bytes added up, and logged at debug.
    fn record(&self, call: Called, reply: &Value, reply_bytes: usize) {
        let took = call.started.elapsed();
        let outcome = reply["error"]["code"].as_str().unwrap_or("ok");
        let result_bytes = if outcome == "ok" { reply_bytes } else { 0 };
        self.result_bytes
            .fetch_add(result_bytes as u64, Ordering::Relaxed);
        crate::observe::metrics::tool_call(
            call.listed.then_some(call.name.as_str()),
            outcome,
            took,
        );
        call.span.record("result_bytes", result_bytes);
        call.span.record("outcome", outcome);
        if outcome != "ok" {
            call.span.record("otel.status_code", "ERROR");
        }
        debug!(
            id = %self.exec_id,
            tool = %call.name,
            args_bytes = call.args_bytes,
            result_bytes,
            duration_us = took.as_micros() as u64,
            outcome,
            "tool call"
        );
    }

    /// Answers one line, and says which tool it called if it was a call; `lease` holds its bytes until the reply
    /// (a call: until its tool_call message is dropped).
    async fn handle(&self, line: Vec<u8>, mut lease: Lease) -> (Value, Option<Called>) {
        let started = Instant::now();
        if self.ended() {
            return (ending(), None);
        }
        let n = self.requests.fetch_add(1, Ordering::Relaxed);
        if n >= self.max_calls {
            let message = format!(
                "This execution may make at most {} tool requests",
                self.max_calls
            );
            return (refusal("limit", &message), None);
        }
        let request = match protocol::parse_tool_request(&line) {
            Ok(r) => r,
            Err(e) => return (refusal("invalid", &e.to_string()), None),
        };
        match request {
            ToolRequest::Return { value } => {
                let value = value.map(RawValue::to_owned);
                drop(line);
                lease.shrink_to(value.as_ref().map_or(0, |v| v.get().len()));
                *self.return_value.lock().unwrap_or_else(|p| p.into_inner()) =
                    value.map(|v| (v, lease));
                (json!({"ok": true, "result": null}), None)
            }
            ToolRequest::Call {
                name,
                args,
                timeout_ms,
            } => {
                drop(line);
                let args_bytes = args.get().len();
                let span = tracing::info_span!(
                    parent: &self.span,
                    "tool_call",
                    tool = %name,
                    args_bytes,
                    result_bytes = tracing::field::Empty,
                    outcome = tracing::field::Empty,
                    otel.status_code = tracing::field::Empty,
                );
                let called = Called {
                    listed: self.allowed.contains(&name),
                    name: name.clone(),
                    args_bytes,
                    started,
                    span,
                };
                lease.shrink_to(called.args_bytes);
                // The charge for the arguments goes with them: given back once the tool_call message holding them
                // is sent (or dropped), not when this call returns; a call that timed out while its message still
                // waits in the execution's queue keeps its bytes counted.
                let args = args.holding(std::sync::Arc::new(lease));
                let reply = self
                    .call(name, args, timeout_ms)
                    .instrument(called.span.clone())
                    .await;
                (reply, Some(called))
            }
        }
    }

    async fn call(&self, name: String, args: RawArgs, timeout_ms: Option<u64>) -> Value {
        if !self.allowed.contains(&name) {
            let mut offered: Vec<&str> = self.allowed.iter().map(String::as_str).collect();
            offered.sort_unstable();
            return refusal(
                "not_allowed",
                &format!(
                    "Tool {name:?} is not offered to this execution (offered: {})",
                    offered.join(", ")
                ),
            );
        }
        // A call may ask for less time than the execution's per-call timeout, never more.
        let timeout_ms = timeout_ms
            .filter(|t| *t > 0)
            .map_or(self.timeout_ms, |t| t.min(self.timeout_ms));
        let call_id = format!("c{}", self.seq.fetch_add(1, Ordering::Relaxed) + 1);
        let answer = self.inbox.expect(&call_id);
        let deadline = tokio::time::Instant::now() + Duration::from_millis(timeout_ms);
        let message = ServerMessage::ToolCall(ToolCall::raw(
            self.exec_id.clone(),
            call_id.clone(),
            name.clone(),
            args,
            Some(timeout_ms),
        ));
        // The ordered execution queue is bounded: a client that does not read makes the call wait, within its
        // timeout. Nothing goes before `status: running` or after the end.
        let mut running = self.running.clone();
        let mut closed = self.closed.clone();
        let send = async {
            if running.wait_for(|r| *r).await.is_err() {
                return Sent::Ended;
            }
            match self.out.reserve().await {
                Ok(permit) => self.queue_unless_ended(permit, message),
                Err(_) => Sent::ClientGone,
            }
        };
        let sent = tokio::select! {
            biased;
            _ = closed.wait_for(|c| *c) => Sent::Ended,
            sent = tokio::time::timeout_at(deadline, send) => match sent {
                Ok(sent) => sent,
                Err(_) => {
                    self.inbox.forget(&call_id);
                    return refusal(
                        "timeout",
                        &format!("Tool {name:?} could not be sent to the client within {timeout_ms} ms"),
                    );
                }
            },
        };
        match sent {
            Sent::Queued => {}
            Sent::ClientGone => {
                self.inbox.forget(&call_id);
                return refusal("closed", "The client is gone");
            }
            Sent::Ended => {
                self.inbox.forget(&call_id);
                return ending();
            }
        }
        self.forwarded.fetch_add(1, Ordering::Relaxed);
        let answered = tokio::select! {
            biased;
            _ = closed.wait_for(|c| *c) => Ok(Err(())),
            answer = tokio::time::timeout_at(deadline, answer) => answer.map(|a| a.map_err(|_| ())),
        };
        match answered {
            Ok(Ok(result)) if result.ok => {
                json!({"ok": true, "result": result.result.unwrap_or(Value::Null)})
            }
            Ok(Ok(result)) => refusal("tool_error", result.error.as_deref().unwrap_or("")),
            Ok(Err(())) => {
                self.inbox.forget(&call_id);
                ending()
            }
            Err(_) => {
                self.inbox.forget(&call_id);
                refusal(
                    "timeout",
                    &format!("Tool {name:?} did not answer within {timeout_ms} ms"),
                )
            }
        }
    }

    /// Queues `message` unless the execution ended, under the end flag's read lock: [`Broker::close`] waits for
    /// it, so a `tool_call` is on the queue before the end is decided, or never.
    fn queue_unless_ended(
        &self,
        permit: mpsc::Permit<'_, ServerMessage>,
        message: ServerMessage,
    ) -> Sent {
        let ended = self.closed.borrow();
        if *ended {
            return Sent::Ended;
        }
        permit.send(message);
        Sent::Queued
    }
}

#[cfg(test)]
mod tests {
    use protocol::{Language, RequestedLimits, ToolSpec};
    use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
    use tokio::net::UnixStream;

    use super::*;

    fn request() -> ExecuteRequest {
        let mut req = ExecuteRequest::new(
            "exec_u",
            Language::Python,
            "1",
            RequestedLimits::new(1000, 64),
        );
        req.tools = vec![ToolSpec::new("echo")];
        req
    }

    struct Setup {
        _dir: tempfile::TempDir,
        socket: PathBuf,
        broker: Broker,
        calls: tokio::sync::mpsc::Receiver<ServerMessage>,
        inbox: Inbox,
    }

    fn setup(config: &ToolsConfig, timeout_ms: u64) -> Setup {
        setup_with(&request(), config, timeout_ms)
    }

    fn setup_with(req: &ExecuteRequest, config: &ToolsConfig, timeout_ms: u64) -> Setup {
        let dir = tempfile::tempdir().unwrap();
        let (tx, calls) = mpsc::channel(4);
        let inbox = Inbox::default();
        let uid = nix::unistd::getuid().as_raw();
        let broker = Broker::start(req, dir.path(), uid, timeout_ms, config, tx, inbox.clone())
            .unwrap()
            .unwrap();
        broker.started();
        Setup {
            socket: dir.path().join(SOCKET_NAME),
            _dir: dir,
            broker,
            calls,
            inbox,
        }
    }

    async fn ask(conn: &mut BufReader<UnixStream>, line: &str) -> Value {
        conn.get_mut().write_all(line.as_bytes()).await.unwrap();
        let mut reply = String::new();
        conn.read_line(&mut reply).await.unwrap();
        serde_json::from_str(&reply).unwrap()
    }

    /// A log sink for a test's subscriber.
    #[derive(Clone, Default)]
    struct Captured(Arc<Mutex<Vec<u8>>>);

    impl std::io::Write for Captured {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for Captured {
        type Writer = Captured;
        fn make_writer(&'a self) -> Captured {
            self.clone()
        }
    }

    #[tokio::test]
    async fn each_call_is_counted_timed_and_logged_with_the_execution_id() {
        // A current-thread runtime: the broker's tasks log on this thread, into this subscriber.
        let logs = Captured::default();
        let subscriber = tracing_subscriber::fmt()
            .with_max_level(tracing::Level::DEBUG)
            .with_ansi(false)
            .with_writer(logs.clone())
            .finish();
        // tracing caches each callsite's interest process-wide, computed by whichever thread
        // hits it first: while at most one dispatcher is registered, a sibling test thread with
        // no subscriber computes it against nothing and pins `tool call` to never. A second,
        // inert dispatcher held for the test makes every registration ask all registered
        // dispatchers (this one included), and the rebuild re-asks what was cached before.
        let _anchor = tracing::Dispatch::new(tracing_subscriber::registry());
        let _log = tracing::subscriber::set_default(subscriber);
        tracing::callsite::rebuild_interest_cache();
        // A tool name no other test uses: the metrics are process-wide.
        let mut req = request();
        req.id = "exec_m".into();
        req.tools = vec![ToolSpec::new("metrics_probe")];
        let mut s = setup_with(&req, &ToolsConfig::default(), 5000);
        let mut conn = BufReader::new(UnixStream::connect(&s.socket).await.unwrap());
        let inbox = s.inbox.clone();
        let answer = tokio::spawn(async move {
            for ok in [true, false] {
                let Some(ServerMessage::ToolCall(call)) = s.calls.recv().await else {
                    panic!("no tool_call");
                };
                let result = if ok {
                    ToolResult::success("exec_m", &call.call_id, json!("x".repeat(100)))
                } else {
                    ToolResult::failure("exec_m", &call.call_id, "broken")
                };
                assert!(inbox.deliver(result));
            }
        });
        // Again just before the calls: a registration that began before the anchor existed and
        // landed after the first rebuild is re-asked here.
        tracing::callsite::rebuild_interest_cache();
        let ok = ask(&mut conn, "{\"op\":\"call\",\"name\":\"metrics_probe\"}\n").await;
        assert_eq!(ok["ok"], true, "{ok}");
        let failed = ask(&mut conn, "{\"op\":\"call\",\"name\":\"metrics_probe\"}\n").await;
        assert_eq!(failed["error"]["code"], "tool_error", "{failed}");
        let unlisted = ask(&mut conn, "{\"op\":\"call\",\"name\":\"nope\"}\n").await;
        assert_eq!(unlisted["error"]["code"], "not_allowed", "{unlisted}");
        ask(&mut conn, "{\"op\":\"return\",\"value\":\"short\"}\n").await;
        answer.await.unwrap();

        assert_eq!(s.broker.calls(), 2);
        // The successful call's reply line: {"ok":true,"result":"xxx..."} and its newline.
        let ok_line = json!({"ok": true, "result": "x".repeat(100)})
            .to_string()
            .len()
            + 1;
        assert_eq!(s.broker.result_bytes(), ok_line as u64);
        assert_eq!(s.broker.return_value_bytes(), "\"short\"".len() as u64);

        let text = crate::observe::metrics::get()
            .encode(crate::observe::metrics::Gauges::default())
            .unwrap();
        for series in [
            "sandboxd_tool_calls_total{tool=\"metrics_probe\",outcome=\"ok\"} 1",
            "sandboxd_tool_calls_total{tool=\"metrics_probe\",outcome=\"tool_error\"} 1",
            "sandboxd_tool_call_seconds_count{tool=\"metrics_probe\"} 2",
            "sandboxd_tool_calls_total{tool=\"_unlisted\",outcome=\"not_allowed\"}",
        ] {
            assert!(text.contains(series), "{series} missing from:\n{text}");
        }
        let logs = String::from_utf8(logs.0.lock().unwrap().clone()).unwrap();
        let lines: Vec<&str> = logs
            .lines()
            .filter(|l| l.contains("tool call") && l.contains("DEBUG"))
            .collect();
        assert_eq!(lines.len(), 3, "one debug line per call:\n{logs}");
        for (line, tool, outcome) in [
            (lines[0], "metrics_probe", "ok"),
            (lines[1], "metrics_probe", "tool_error"),
            (lines[2], "nope", "not_allowed"),
        ] {
            assert!(
                line.contains("id=exec_m")
                    && line.contains(&format!("tool={tool}"))
                    && line.contains(&format!("outcome=\"{outcome}\"")),
                "{line}"
            );
        }
        assert!(
            lines[0].contains(&format!("result_bytes={ok_line}")),
            "{}",
            lines[0]
        );
    }

    #[tokio::test]
    async fn forwards_listed_calls_refuses_others_and_times_out() {
        let mut s = setup(&ToolsConfig::default(), 300);
        for name in [
            "sandbox_tools.json",
            "sandbox_tools.py",
            "sandbox_tools_run.py",
        ] {
            assert!(s._dir.path().join(name).is_file(), "{name}");
        }
        let meta = std::fs::metadata(&s.socket).unwrap();
        assert_eq!(meta.permissions().mode() & 0o777, 0o600);
        let mut conn = BufReader::new(UnixStream::connect(&s.socket).await.unwrap());

        let refused = ask(&mut conn, "{\"op\":\"call\",\"name\":\"other\"}\n").await;
        assert_eq!(refused["error"]["code"], "not_allowed", "{refused}");
        let bad = ask(&mut conn, "nonsense\n").await;
        assert_eq!(bad["error"]["code"], "invalid", "{bad}");

        // Answered.
        let inbox = s.inbox.clone();
        let answer = tokio::spawn(async move {
            let Some(ServerMessage::ToolCall(call)) = s.calls.recv().await else {
                panic!("no tool_call");
            };
            let args: Value = serde_json::from_str(call.raw_args.as_ref().unwrap().get()).unwrap();
            assert_eq!((call.name.as_str(), args), ("echo", json!({"a": 1})));
            assert!(inbox.deliver(ToolResult::success("exec_u", &call.call_id, json!(2))));
            // The next one is never answered.
            let Some(ServerMessage::ToolCall(late)) = s.calls.recv().await else {
                panic!("no second tool_call");
            };
            late
        });
        let ok = ask(
            &mut conn,
            "{\"op\":\"call\",\"name\":\"echo\",\"args\":{\"a\":1}}\n",
        )
        .await;
        assert_eq!(ok, json!({"ok": true, "result": 2}));
        let t0 = std::time::Instant::now();
        let timeout = ask(&mut conn, "{\"op\":\"call\",\"name\":\"echo\"}\n").await;
        assert_eq!(timeout["error"]["code"], "timeout", "{timeout}");
        assert!(t0.elapsed() >= Duration::from_millis(300));
        let late = answer.await.unwrap();
        // A late answer finds nobody.
        assert!(!s
            .inbox
            .deliver(ToolResult::success("exec_u", &late.call_id, json!(0))));

        let ret = ask(&mut conn, "{\"op\":\"return\",\"value\":[1,\"x\"]}\n").await;
        assert_eq!(ret["ok"], true);
        assert_eq!(s.broker.calls(), 2);
        assert_eq!(s.broker.return_value(), Some(json!([1, "x"])));

        // Torn down: the socket file is gone, and the connection ends.
        let socket = s.socket.clone();
        drop(s.broker);
        assert!(!socket.exists());
        let mut rest = String::new();
        let n = tokio::time::timeout(Duration::from_secs(5), conn.read_line(&mut rest))
            .await
            .unwrap()
            .unwrap_or(0);
        assert_eq!(n, 0, "{rest}");
    }

    #[tokio::test]
    async fn a_long_line_closes_the_connection_and_requests_are_bounded() {
        let config = ToolsConfig {
            max_line_bytes: 1024,
            max_calls: 3,
            ..ToolsConfig::default()
        };
        let s = setup(&config, 1000);
        let mut conn = BufReader::new(UnixStream::connect(&s.socket).await.unwrap());
        let long = format!("{}\n", "x".repeat(4096));
        let reply = ask(&mut conn, &long).await;
        assert_eq!(reply["error"]["code"], "invalid", "{reply}");
        let mut rest = String::new();
        assert_eq!(conn.read_line(&mut rest).await.unwrap_or(0), 0);

        let mut conn = BufReader::new(UnixStream::connect(&s.socket).await.unwrap());
        // The over-long line was no request; three are allowed, the fourth is over the limit.
        for _ in 0..3 {
            let r = ask(&mut conn, "{\"op\":\"call\",\"name\":\"nope\"}\n").await;
            assert_eq!(r["error"]["code"], "not_allowed");
        }
        let r = ask(&mut conn, "{\"op\":\"call\",\"name\":\"nope\"}\n").await;
        assert_eq!(r["error"]["code"], "limit", "{r}");
    }

    /// The reply to a line, within a bound (a reply that never comes fails the test instead of hanging it).
    async fn reply(conn: &mut BufReader<UnixStream>) -> Value {
        let mut reply = String::new();
        let n = tokio::time::timeout(Duration::from_secs(20), conn.read_line(&mut reply))
            .await
            .expect("no reply line")
            .unwrap();
        assert!(n > 0, "the connection closed without a reply");
        serde_json::from_str(&reply).unwrap()
    }

    #[tokio::test]
    async fn a_line_that_is_not_utf8_gets_invalid_and_the_next_line_is_served() {
        let s = setup(&ToolsConfig::default(), 1000);
        let mut conn = BufReader::new(UnixStream::connect(&s.socket).await.unwrap());
        conn.get_mut()
            .write_all(b"{\"op\":\"call\",\"name\":\"\xff\xfe\"}\n\xc3\n{\"op\":\"call\",\"name\":\"nope\"}\n")
            .await
            .unwrap();
        for _ in 0..2 {
            let bad = reply(&mut conn).await;
            assert_eq!(bad["error"]["code"], "invalid", "{bad}");
        }
        let next = reply(&mut conn).await;
        assert_eq!(next["error"]["code"], "not_allowed", "{next}");
    }

    /// Calls the client does not answer hold their bytes; beyond `max_memory_bytes` a request gets `limit`, and
    /// the bytes come back once the calls are answered.
    #[tokio::test]
    async fn requests_beyond_the_memory_budget_get_limit() {
        let config = ToolsConfig {
            max_line_bytes: 16 << 10,
            max_memory_bytes: 64 << 10,
            ..ToolsConfig::default()
        };
        let mut s = setup(&config, 60_000);
        let line = format!(
            "{{\"op\":\"call\",\"name\":\"echo\",\"args\":{{\"x\":\"{}\"}}}}\n",
            "y".repeat(12 << 10)
        );
        let mut conns = Vec::new();
        for _ in 0..8 {
            let mut c = BufReader::new(UnixStream::connect(&s.socket).await.unwrap());
            c.get_mut().write_all(line.as_bytes()).await.unwrap();
            conns.push(c);
        }
        // At most 5 lines of 12 KiB fit in 64 KiB: the others are refused at once.
        let mut forwarded = Vec::new();
        let mut refused = 0;
        let mut waiting: Vec<_> = conns.iter_mut().map(|c| Box::pin(reply(c))).collect();
        while forwarded.len() + refused < 8 {
            tokio::select! {
                Some(m) = s.calls.recv() => forwarded.push(m),
                (r, i, _) = futures_util::future::select_all(waiting.iter_mut()) => {
                    assert_eq!(r["error"]["code"], "limit", "{r}");
                    drop(waiting.remove(i));
                    refused += 1;
                }
            }
        }
        assert!(refused >= 3, "{refused} refused");
        for m in &forwarded {
            let ServerMessage::ToolCall(call) = m else {
                panic!("{m:?}")
            };
            assert!(s
                .inbox
                .deliver(ToolResult::success("exec_u", &call.call_id, json!(1))));
        }
        for r in futures_util::future::join_all(waiting).await {
            assert_eq!(r, json!({"ok": true, "result": 1}));
        }
        // The forwarded messages still hold their arguments: counted until they are dropped.
        assert!(s.broker.shared.budget.used() > 0);
        drop(forwarded);
        assert_eq!(s.broker.shared.budget.used(), 0);
        drop(conns);
        // Answered: the bytes are free again.
        let mut c = BufReader::new(UnixStream::connect(&s.socket).await.unwrap());
        c.get_mut().write_all(line.as_bytes()).await.unwrap();
        let Some(ServerMessage::ToolCall(call)) = s.calls.recv().await else {
            panic!("no tool_call");
        };
        assert!(s
            .inbox
            .deliver(ToolResult::success("exec_u", &call.call_id, json!(2))));
        assert_eq!(reply(&mut c).await, json!({"ok": true, "result": 2}));
    }

    /// A call that timed out while its tool_call still waits in the client's queue keeps its arguments' bytes
    /// counted until the message leaves the queue: a program cannot fill the queue with calls it gave up on.
    #[tokio::test]
    async fn a_timed_out_call_still_queued_keeps_its_bytes_counted() {
        let mut s = setup(&ToolsConfig::default(), 60_000);
        let line = format!(
            "{{\"op\":\"call\",\"name\":\"echo\",\"timeout_ms\":1,\"args\":{{\"x\":\"{}\"}}}}\n",
            "y".repeat(8 << 10)
        );
        let mut c = BufReader::new(UnixStream::connect(&s.socket).await.unwrap());
        c.get_mut().write_all(line.as_bytes()).await.unwrap();
        assert_eq!(reply(&mut c).await["error"]["code"], "timeout");
        assert!(
            s.broker.shared.budget.used() >= 8 << 10,
            "{} bytes counted while the call waits in the queue",
            s.broker.shared.budget.used()
        );
        let Some(ServerMessage::ToolCall(call)) = s.calls.recv().await else {
            panic!("no tool_call");
        };
        assert_eq!(
            s.broker.shared.budget.used(),
            call.raw_args.as_ref().map_or(0, |a| a.get().len())
        );
        drop(call);
        assert_eq!(s.broker.shared.budget.used(), 0);
    }

    /// Once the execution ended, a call waiting for room in the client's queue, a call waiting for its answer and
    /// a new call all get `closed`, and none of them reaches the client after the end.
    #[tokio::test]
    async fn after_the_end_calls_get_closed_and_are_never_forwarded() {
        let mut s = setup(&ToolsConfig::default(), 60_000);
        let call = "{\"op\":\"call\",\"name\":\"echo\"}\n";
        // The client's queue holds 4 messages and nobody reads it: 4 calls fill it, the others wait for room.
        let mut conns = Vec::new();
        for _ in 0..6 {
            let mut c = BufReader::new(UnixStream::connect(&s.socket).await.unwrap());
            c.get_mut().write_all(call.as_bytes()).await.unwrap();
            conns.push(c);
        }
        while s.calls.len() < 4 {
            tokio::task::yield_now().await;
        }
        s.broker.close();
        for c in &mut conns {
            let r = reply(c).await;
            assert_eq!(r["error"]["code"], "closed", "{r}");
        }
        let mut late = BufReader::new(UnixStream::connect(&s.socket).await.unwrap());
        let r = ask(&mut late, call).await;
        assert_eq!(r["error"]["code"], "closed", "{r}");
        let mut seen = 0;
        while let Ok(m) = s.calls.try_recv() {
            assert!(matches!(m, ServerMessage::ToolCall(_)), "{m:?}");
            seen += 1;
        }
        assert_eq!(
            seen, 4,
            "only the calls queued before the end reached the client"
        );
        assert_eq!(s.broker.calls(), 4);
    }
}

//! `SANDBOXD_SOAK_SECS=1800 cargo bench -p sandboxd --bench soak`: one release daemon under mixed load for a long
//! time, sampled every 10 s for what would show a leak, then stopped and checked for leftovers. A soak, not a CI
//! test: it runs for as long as it is told (default 1800 s).
//!
//! The daemon has its own state dir, cgroup parent and uid range, `max_concurrent: 8`, the default warm pool and
//! `agents.max_sandboxes: 4`. Only loopback is used. The load, [`EXEC_WORKERS`] + [`AGENT_WORKERS`] tasks until
//! the time is up, every request bounded by [`REQUEST_DEADLINE`]:
//! - executions, shell and python: short ones that complete or fail, ones that time out, hit the memory limit (OOM)
//!   or the output limit; python ones calling tools the bench answers (one of them fails); cancels of a running
//!   execution; WebSocket connections reset (TCP RST, no close frame) while their execution runs; each worker
//!   also replaces its connection now and then;
//! - agent sandboxes (the client tests' scripted `fake_agent.py`): created, an agent spawned that floods events and
//!   announces artifacts (uploaded to a fake backend on loopback), paused and resumed, killed (with and without
//!   grace), sometimes spawned again, deleted; the gateway's event stream is there in some cycles and not in
//!   others, and is reset mid-flood in some.
//!
//! Every [`SAMPLE_EVERY`] a row: RSS, open fds and threads of the daemon and its helper processes (from /proc),
//! cgroup directories under the daemon's cgroup parent in every hierarchy, mounts under the state dir in the
//! daemon's mount namespace (it unshares one, so `/proc/<daemon>/mountinfo`, not the bench's own), processes
//! running as the daemon's sandbox uids, executions done and executions per second in the last interval, and the
//! executions done so far by outcome ([`OUTCOME_COLUMNS`]).
//!
//! Verdict (exit status 1 when it fails):
//! - flat: the first [`WARMUP_FRACTION`] of the samples are warm-up and left out; the rest is cut in thirds. For
//!   RSS, fds, threads, cgroup dirs and mounts, the last third's median may exceed the middle third's by at most
//!   [`TOLERANCE`] plus a small absolute slack (per metric, see [`METRICS`]), and the trend over the whole window
//!   (Theil-Sen slope, robust to spikes, times the window's length) may grow by at most the same amount;
//! - drained, the daemon still running: no execution active or queued, the pool full again, the container cgroup
//!   leaves, mounts and sandbox processes back to exactly what they were with the full pool before the load, open
//!   fds and threads of the daemon and helpers within [`DRAINED_FDS_SLACK`] / [`DRAINED_THREADS_SLACK`] of it, no
//!   sandbox directory left, and the daemon's only children its helpers (RSS is shown, not judged: the allocator
//!   keeps freed memory);
//! - stopped (SIGTERM): the daemon exits within its grace period, and nothing is left: no cgroup dir under its
//!   parent, no mount under its state dir, no process in its uid range or in its cgroups;
//! - no request went unanswered past [`REQUEST_DEADLINE`] and the daemon never died.
//!
//! Executions that end otherwise than their kind expects (e.g. an OOM case that completes) and agent cycles that
//! fail a step are counted and shown (the first few verbatim), but do not fail the verdict: they are a functional
//! matter for the tests. A request stuck past [`REQUEST_DEADLINE`] does fail it.
//!
//! Needs root (the daemon creates containers).

#![allow(missing_docs, clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use agent_api::{AgentBrief, CreateSandboxRequest, KillRequest};
use client::gateway::{EventStream, Gateway, GatewayError, SandboxClient};
use client::{
    ClientError, ConnectOptions, Connection, ExecStatus, Execute, ExecuteRequest, Language,
    RequestedLimits, ServerMessage, ToolSpec,
};
use futures_util::{SinkExt, StreamExt};
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::Message;

const TOKEN: &str = "soak-token-0123456789abcdef";
const FAKE_AGENT: &str = include_str!("../../client/tests/agents/fake_agent.py");
const DEFAULT_SECS: u64 = 1800;
const SAMPLE_EVERY: Duration = Duration::from_secs(10);
const MAX_CONCURRENT: usize = 8;
const MAX_SANDBOXES: usize = 4;
/// Execution workers: with the agents, a little more than `max_concurrent`, so the queue is used too.
const EXEC_WORKERS: usize = 7;
const AGENT_WORKERS: usize = 2;
/// Longest wait for any one request (an execution, an HTTP call, an event read) before it counts as stuck.
const REQUEST_DEADLINE: Duration = Duration::from_secs(90);
/// Upper bound on the iterations of any one worker loop (besides the time bound).
const MAX_ITERATIONS: u64 = 1_000_000;
/// Samples left out of the flatness check at the start.
const WARMUP_FRACTION: f64 = 0.2;
/// Allowed relative growth, last third against the middle third, and over the trend.
const TOLERANCE: f64 = 0.10;
/// Drained, the daemon and its helpers may hold this many more fds than before the load (lingering keep-alive
/// sockets), and this many more threads (tokio's blocking pool keeps idle threads for 10 s).
const DRAINED_FDS_SLACK: u64 = 4;
const DRAINED_THREADS_SLACK: u64 = 4;
/// The host uids of the daemon's sandboxes lie in `uid_base .. uid_base + UID_SPAN`.
const UID_SPAN: u32 = 1024;

/// One sample of the daemon's footprint.
#[derive(Debug, Clone, Default)]
struct Sample {
    at: Duration,
    rss_kib: u64,
    /// The helpers' share of `rss_kib`.
    helpers_rss_kib: u64,
    fds: u64,
    threads: u64,
    cgroup_dirs: u64,
    mounts: u64,
    sandbox_procs: u64,
    done: u64,
    /// Executions done so far by outcome, in the order of [`OUTCOME_COLUMNS`].
    outcomes: [u64; 8],
}

/// The per-sample outcome columns: heading and the labels counted in it (the last column: everything else).
const OUTCOME_COLUMNS: [(&str, &[&str]); 8] = [
    ("ok", &["completed", "tools ok"]),
    ("fail", &["failed"]),
    ("tmo", &["timeout"]),
    ("oom", &["oom"]),
    ("olim", &["output_limit"]),
    ("canc", &["cancelled"]),
    ("drop", &["dropped"]),
    ("other", &[]),
];

/// The metrics judged for flatness: name, accessor, absolute slack (noise a busy daemon shows without leaking).
type Metric = (&'static str, fn(&Sample) -> f64, f64);

const METRICS: [Metric; 5] = [
    ("rss KiB", |s| s.rss_kib as f64, 4.0 * 1024.0),
    ("fds", |s| s.fds as f64, 16.0),
    ("threads", |s| s.threads as f64, 4.0),
    ("cgroup dirs", |s| s.cgroup_dirs as f64, 20.0),
    ("mounts", |s| s.mounts as f64, 20.0),
];

/// What happened, counted by label; unexpected endings kept verbatim (the first few).
#[derive(Default)]
struct Tally {
    execs: BTreeMap<String, u64>,
    agents: BTreeMap<String, u64>,
    unexpected: u64,
    examples: Vec<String>,
    stuck: Vec<String>,
}

#[derive(Clone, Default)]
struct Stats(Arc<Mutex<Tally>>);

impl Stats {
    fn exec(&self, label: &str) {
        *self
            .0
            .lock()
            .unwrap()
            .execs
            .entry(label.to_owned())
            .or_default() += 1;
    }

    fn agent(&self, label: &str) {
        *self
            .0
            .lock()
            .unwrap()
            .agents
            .entry(label.to_owned())
            .or_default() += 1;
    }

    fn unexpected(&self, what: String) {
        let mut t = self.0.lock().unwrap();
        t.unexpected += 1;
        if t.examples.len() < 8 {
            t.examples.push(what);
        }
    }

    fn stuck(&self, what: String) {
        let mut t = self.0.lock().unwrap();
        if t.stuck.len() < 100 {
            t.stuck.push(what);
        }
    }

    /// Executions that reached an end (any outcome, errors included).
    fn done(&self) -> u64 {
        self.0.lock().unwrap().execs.values().sum()
    }

    /// Executions done by outcome, in the order of [`OUTCOME_COLUMNS`]; the last counts every other label
    /// (errors, stuck, endings no kind expects).
    fn outcomes(&self) -> [u64; 8] {
        let t = self.0.lock().unwrap();
        let mut out = [0u64; 8];
        for (label, n) in &t.execs {
            let col = OUTCOME_COLUMNS[..7]
                .iter()
                .position(|(_, labels)| labels.contains(&label.as_str()))
                .unwrap_or(7);
            out[col] += n;
        }
        out
    }
}

struct Daemon {
    child: Child,
    port: u16,
    dir: tempfile::TempDir,
    parent: String,
    uid_base: u32,
    helpers: Vec<i32>,
}

impl Daemon {
    fn start() -> Self {
        let dir = tempfile::Builder::new()
            .prefix("sandboxd-soak-")
            .tempdir()
            .unwrap();
        let port = common::free_port();
        let pid = std::process::id();
        let parent = format!("sandboxd-soak-{pid}");
        // Apart from the tests' ranges (1,000,000 and 200,000,000 up) and the latency bench's (400,000 up).
        let uid_base = 600_000_000 + (pid % 100_000) * UID_SPAN;
        let config = dir.path().join("config.yaml");
        std::fs::write(
            &config,
            format!(
                "listen: 127.0.0.1:{port}\nstate_dir: {}\nauth: {{tokens: [\"{TOKEN}\"]}}\n\
                 capacity: {{max_concurrent: {MAX_CONCURRENT}, max_queue: 64}}\nshutdown_grace_ms: 5000\n\
                 sandbox: {{cgroup_parent: {parent}, uid_base: {uid_base}}}\n\
                 agents: {{max_sandboxes: {MAX_SANDBOXES}}}\n",
                dir.path().join("state").display(),
            ),
        )
        .unwrap();
        let log = std::fs::File::create(dir.path().join("daemon.log")).unwrap();
        let child = Command::new(env!("CARGO_BIN_EXE_sandboxd"))
            .arg("--config")
            .arg(&config)
            .env(
                "SANDBOXD_LOG",
                "warn,libcgroups=error,libcontainer::process::init=error",
            )
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("start sandboxd");
        let mut d = Self {
            child,
            port,
            dir,
            parent,
            uid_base,
            helpers: Vec::new(),
        };
        let deadline = Instant::now() + Duration::from_secs(120);
        while d.healthz().is_none() {
            assert!(
                Instant::now() < deadline,
                "sandboxd did not become ready: {}",
                d.log_tail()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        d.helpers = children_of(d.pid());
        d
    }

    fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    fn state_dir(&self) -> PathBuf {
        self.dir.path().join("state")
    }

    fn alive(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    fn healthz(&self) -> Option<Value> {
        common::healthz(self.port)
    }

    fn log_tail(&self) -> String {
        let log = std::fs::read_to_string(self.dir.path().join("daemon.log")).unwrap_or_default();
        let lines: Vec<&str> = log.lines().collect();
        lines[lines.len().saturating_sub(20)..].join("\n")
    }

    fn sample(&self, at: Duration, stats: &Stats) -> Sample {
        let mut s = Sample {
            at,
            done: stats.done(),
            outcomes: stats.outcomes(),
            ..Sample::default()
        };
        for pid in std::iter::once(self.pid()).chain(self.helpers.iter().copied()) {
            let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
            let rss = status_field(&status, "VmRSS:");
            s.rss_kib += rss;
            if pid != self.pid() {
                s.helpers_rss_kib += rss;
            }
            s.threads += status_field(&status, "Threads:");
            s.fds += std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, |d| d.count() as u64);
        }
        s.cgroup_dirs = cgroup_dirs(&self.parent).len() as u64;
        s.mounts = mounts_under(
            &format!("/proc/{}/mountinfo", self.pid()),
            &self.state_dir(),
        )
        .len() as u64;
        s.sandbox_procs = uid_processes(self.uid_base).len() as u64;
        s
    }

    /// SIGTERM and wait (bounded); returns how it ended.
    fn stop(&mut self) -> Result<std::process::ExitStatus, String> {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(self.pid()),
            nix::sys::signal::Signal::SIGTERM,
        );
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            match self.child.try_wait() {
                Ok(Some(st)) => return Ok(st),
                Ok(None) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(50))
                }
                Ok(None) => {
                    let _ = self.child.kill();
                    let _ = self.child.wait();
                    return Err("did not exit within 60 s of SIGTERM (killed)".into());
                }
                Err(e) => return Err(e.to_string()),
            }
        }
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if self.alive() {
            let _ = self.stop();
        }
        test_support::cgroups::remove_cgroup_parent(&self.parent);
    }
}

fn status_field(status: &str, key: &str) -> u64 {
    status
        .lines()
        .find_map(|l| l.strip_prefix(key))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// Every process (pid, ppid) on the host.
fn processes() -> Vec<(i32, i32)> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(e.path().join("stat")) else {
            continue;
        };
        // pid (comm) state ppid ...: comm may hold spaces and parentheses, the last ')' ends it.
        let ppid = stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().nth(1))
            .and_then(|p| p.parse().ok())
            .unwrap_or(0);
        out.push((pid, ppid));
    }
    out
}

fn children_of(pid: i32) -> Vec<i32> {
    let mut c: Vec<i32> = processes()
        .into_iter()
        .filter(|&(_, pp)| pp == pid)
        .map(|(p, _)| p)
        .collect();
    c.sort_unstable();
    c
}

/// Processes whose real uid is in the daemon's sandbox range: (pid, command line).
fn uid_processes(uid_base: u32) -> Vec<(i32, String)> {
    let mut out = Vec::new();
    for (pid, _) in processes() {
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
        let uid = status_field(&status, "Uid:") as u32;
        if (uid_base..uid_base + UID_SPAN).contains(&uid) {
            let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            out.push((pid, String::from_utf8_lossy(&cmd).replace('\0', " ")));
        }
    }
    out
}

/// Processes in a cgroup under `parent` (any hierarchy), from /proc/<pid>/cgroup.
fn cgroup_processes(parent: &str) -> Vec<i32> {
    let needle = format!(":/{parent}/");
    processes()
        .into_iter()
        .filter(|&(pid, _)| {
            std::fs::read_to_string(format!("/proc/{pid}/cgroup"))
                .is_ok_and(|c| c.lines().any(|l| l.contains(&needle)))
        })
        .map(|(p, _)| p)
        .collect()
}

/// Every directory under `parent` (not the parent itself), in every hierarchy, at any depth.
fn cgroup_dirs(parent: &str) -> Vec<PathBuf> {
    fn walk(d: &Path, out: &mut Vec<PathBuf>) {
        for e in std::fs::read_dir(d).into_iter().flatten().flatten() {
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                out.push(e.path());
                walk(&e.path(), out);
            }
        }
    }
    let mut out = Vec::new();
    for p in test_support::cgroups::cgroup_parent_dirs(parent) {
        walk(&p, &mut out);
    }
    out
}

/// Mount points under `dir` in a mountinfo file.
fn mounts_under(mountinfo: &str, dir: &Path) -> Vec<String> {
    let d = format!("{}/", dir.display());
    std::fs::read_to_string(mountinfo)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.split_whitespace().nth(4))
        .filter(|m| m.starts_with(&d) || *m == d.trim_end_matches('/'))
        .map(str::to_owned)
        .collect()
}

// ---------------------------------------------------------------------------------------------------------------
// Executions.

/// The kinds of execution in the mix, each with the ending it should have.
#[derive(Debug, Clone, Copy)]
enum Kind {
    ShellOk,
    PythonOk,
    Failed,
    Timeout,
    Oom,
    OutputLimit,
    Tools,
    Cancel,
    Drop,
}

/// One worker's round: 16 slots, the short successful ones most often.
const MIX: [Kind; 16] = [
    Kind::ShellOk,
    Kind::PythonOk,
    Kind::Tools,
    Kind::ShellOk,
    Kind::Timeout,
    Kind::PythonOk,
    Kind::Cancel,
    Kind::Failed,
    Kind::ShellOk,
    Kind::Oom,
    Kind::Tools,
    Kind::PythonOk,
    Kind::OutputLimit,
    Kind::ShellOk,
    Kind::Drop,
    Kind::PythonOk,
];

const TOOLS_CODE: &str = "s = 0\nfor i in range(5):\n    s = add(s, i)\ntry:\n    fail('on purpose')\n    r = 'no error'\n\
                          except ToolError as e:\n    r = e.code\nprint(s, r)\nreturn [s, r]\n";

fn request(kind: Kind, id: String) -> ExecuteRequest {
    let (lang, code, timeout_ms, memory_mb) = match kind {
        Kind::ShellOk => (
            Language::Shell,
            "echo soak; i=0; while [ $i -lt 50 ]; do i=$((i+1)); done\n",
            10_000,
            64,
        ),
        Kind::PythonOk => (
            Language::Python,
            "import json\nprint(json.dumps({'n': sum(range(1000))}))\n",
            10_000,
            64,
        ),
        Kind::Failed => (Language::Shell, "echo failing >&2; exit 3\n", 10_000, 64),
        Kind::Timeout => (Language::Shell, "sleep 30\n", 400, 64),
        Kind::Oom => (
            Language::Python,
            "chunks = []\nwhile True:\n    chunks.append(b'y' * (1 << 20))\n",
            30_000,
            48,
        ),
        Kind::OutputLimit => (Language::Shell, "yes soak\n", 30_000, 64),
        Kind::Tools => (Language::Python, TOOLS_CODE, 30_000, 128),
        Kind::Cancel | Kind::Drop => (Language::Shell, "echo started; sleep 30\n", 60_000, 64),
    };
    let mut limits = RequestedLimits::new(timeout_ms, memory_mb);
    if matches!(kind, Kind::OutputLimit) {
        limits.max_output_bytes = Some(64 << 10);
    }
    let mut r = ExecuteRequest::new(id, lang, code, limits);
    if matches!(kind, Kind::Tools) {
        let tool = |name: &str, args: &[&str]| ToolSpec {
            name: name.to_owned(),
            description: None,
            schema: Some(json!({"type": "object", "required": args,
                "properties": args.iter().map(|a| (a.to_string(), json!({}))).collect::<serde_json::Map<_, _>>()})),
        };
        r.tools = vec![tool("add", &["a", "b"]), tool("fail", &["why"])];
        r.tool_timeout_ms = Some(10_000);
    }
    r
}

/// The label an execution of `kind` should end with.
fn expected(kind: Kind) -> &'static str {
    match kind {
        Kind::ShellOk | Kind::PythonOk => "completed",
        Kind::Failed => "failed",
        Kind::Timeout => "timeout",
        Kind::Oom => "oom",
        Kind::OutputLimit => "output_limit",
        Kind::Tools => "tools ok",
        Kind::Cancel => "cancelled",
        Kind::Drop => "dropped",
    }
}

fn error_label(e: &ClientError) -> String {
    match e.code() {
        Some(c) => format!(
            "error {}",
            serde_json::to_value(c)
                .unwrap_or_default()
                .as_str()
                .unwrap_or("?")
        ),
        None => format!("error {:?}", e.kind()).to_lowercase(),
    }
}

/// Runs one execution of `kind`; returns its label and a description for an unexpected ending.
async fn run_exec(conn: &Connection, port: u16, kind: Kind, id: String) -> (String, String) {
    match kind {
        Kind::Cancel => return cancel(conn, id).await,
        Kind::Drop => return drop_mid_run(port, id).await,
        _ => {}
    }
    let req = request(kind, id);
    let r = if matches!(kind, Kind::Tools) {
        conn.execute_with_tools(req, |call| async move {
            match call.name.as_str() {
                "add" => Ok(json!(
                    call.args["a"].as_i64().unwrap_or(0) + call.args["b"].as_i64().unwrap_or(0)
                )),
                _ => Err("this tool always fails".to_owned()),
            }
        })
        .await
    } else {
        conn.execute(req).await
    };
    match r {
        Err(e) => (error_label(&e), e.to_string()),
        Ok(r) => {
            let reason = serde_json::to_value(r.reason).unwrap_or_default();
            let reason = reason.as_str().unwrap_or("?");
            let label = match (kind, r.status) {
                (Kind::Tools, ExecStatus::Completed)
                    if r.return_value == Some(json!([10, "tool_error"])) =>
                {
                    "tools ok".to_owned()
                }
                (_, ExecStatus::Completed) => "completed".to_owned(),
                (_, ExecStatus::Failed) if reason == "output_limit" => "output_limit".to_owned(),
                (_, st) => serde_json::to_value(st)
                    .unwrap_or_default()
                    .as_str()
                    .unwrap_or("?")
                    .to_owned(),
            };
            let why = format!(
                "status {:?} reason {reason} exit {:?} return {:?} stderr {:?}",
                r.status,
                r.exit_code,
                r.return_value,
                String::from_utf8_lossy(&r.stderr[..r.stderr.len().min(200)])
            );
            (label, why)
        }
    }
}

/// Starts a long execution, cancels it once it runs, reads it to its end.
async fn cancel(conn: &Connection, id: String) -> (String, String) {
    let mut ex = match conn.execute_stream(request(Kind::Cancel, id)).await {
        Ok(ex) => ex,
        Err(e) => return (error_label(&e), e.to_string()),
    };
    let mut cancelled = false;
    let mut end = None;
    while let Some(m) = ex.next().await {
        let m = match m {
            Ok(m) => m.message,
            Err(e) => return (error_label(&e), e.to_string()),
        };
        match m {
            ServerMessage::Stdout(_) if !cancelled => {
                cancelled = true;
                if let Err(e) = ex.cancel().await {
                    return (error_label(&e), e.to_string());
                }
            }
            ServerMessage::Status { status, .. } if status != ExecStatus::Running => {
                end = Some(status)
            }
            _ => {}
        }
    }
    let label = end.map_or("no terminal status".to_owned(), |s| {
        serde_json::to_value(s)
            .unwrap_or_default()
            .as_str()
            .unwrap_or("?")
            .to_owned()
    });
    (label.clone(), format!("cancel ended with {label}"))
}

/// Opens a connection of its own, starts a long execution and, once it prints, resets the TCP connection (no
/// close frame). The daemon must kill and remove it; the samples show whether it does.
async fn drop_mid_run(port: u16, id: String) -> (String, String) {
    let mut req = format!("ws://127.0.0.1:{port}/ws")
        .into_client_request()
        .unwrap();
    req.headers_mut()
        .insert("Authorization", format!("Bearer {TOKEN}").parse().unwrap());
    let mut ws = match tokio_tungstenite::connect_async(req).await {
        Ok((ws, _)) => ws,
        Err(e) => return ("error connect".into(), e.to_string()),
    };
    let msg =
        serde_json::to_string(&protocol::ClientMessage::Execute(request(Kind::Drop, id))).unwrap();
    if let Err(e) = ws.send(Message::Text(msg.into())).await {
        return ("error send".into(), e.to_string());
    }
    while let Some(m) = ws.next().await {
        let Ok(Message::Text(t)) = m else { continue };
        let v: Value = serde_json::from_str(&t).unwrap_or_default();
        match v["type"].as_str() {
            Some("stdout") => {
                if let tokio_tungstenite::MaybeTlsStream::Plain(tcp) = ws.get_ref() {
                    // A zero linger: close sends RST at once.
                    #[allow(deprecated)]
                    let _ = tcp.set_linger(Some(Duration::ZERO));
                }
                drop(ws);
                return ("dropped".into(), String::new());
            }
            Some("result" | "error") => return ("ended before the drop".into(), t.to_string()),
            _ => {}
        }
    }
    ("closed by the daemon".into(), String::new())
}

async fn connect(port: u16) -> Option<Connection> {
    Connection::connect(ConnectOptions::new(format!("ws://127.0.0.1:{port}/ws")).token(TOKEN))
        .await
        .ok()
}

/// One execution worker: its own connection (replaced every 40 executions), executions from [`MIX`] until `stop`.
async fn exec_worker(w: usize, port: u16, stop: Instant, stats: Stats) {
    let mut conn = None;
    for i in 0..MAX_ITERATIONS {
        if Instant::now() >= stop {
            break;
        }
        if i % 40 == 0 {
            if let Some(c) = conn.take() {
                Connection::close(&c);
            }
        }
        if conn.is_none() {
            conn = connect(port).await;
        }
        let Some(c) = conn.as_ref() else {
            stats.exec("error connect");
            tokio::time::sleep(Duration::from_secs(1)).await;
            continue;
        };
        let kind = MIX[(w * 5 + i as usize) % MIX.len()];
        let id = format!("soak-{w}-{i}");
        match tokio::time::timeout(REQUEST_DEADLINE, run_exec(c, port, kind, id.clone())).await {
            Ok((label, why)) => {
                if label != expected(kind) {
                    stats.unexpected(format!("{id} {kind:?}: {label}: {why}"));
                    if label.starts_with("error") {
                        // The connection may be the problem: start over with a new one.
                        conn = None;
                    }
                }
                stats.exec(&label);
            }
            Err(_) => {
                stats.exec("stuck");
                stats.stuck(format!(
                    "execution {id} ({kind:?}) unanswered after {REQUEST_DEADLINE:?}"
                ));
                conn = None;
            }
        }
    }
    if let Some(c) = conn {
        c.close();
    }
}

// ---------------------------------------------------------------------------------------------------------------
// Agent sandboxes.

/// A fake backend on loopback: `POST /api/artifacts` answers a `backendUri`, anything else a renewed token.
async fn backend() -> u16 {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move {
        let mut n = 0u64;
        while let Ok((mut s, _)) = listener.accept().await {
            n += 1;
            tokio::spawn(async move {
                let _ = tokio::time::timeout(Duration::from_secs(30), async {
                    let mut buf = Vec::new();
                    let mut chunk = [0u8; 16384];
                    let head_end = loop {
                        let k = s.read(&mut chunk).await.unwrap_or(0);
                        if k == 0 {
                            return;
                        }
                        buf.extend_from_slice(&chunk[..k]);
                        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                            break i + 4;
                        }
                    };
                    let head = String::from_utf8_lossy(&buf[..head_end]).to_lowercase();
                    let len: usize = head
                        .lines()
                        .find_map(|l| l.strip_prefix("content-length:"))
                        .and_then(|v| v.trim().parse().ok())
                        .unwrap_or(0);
                    while buf.len() < head_end + len {
                        let k = s.read(&mut chunk).await.unwrap_or(0);
                        if k == 0 {
                            break;
                        }
                        buf.extend_from_slice(&chunk[..k]);
                    }
                    let answer = if head.contains("/api/artifacts") {
                        json!({"backendUri": format!("artifact://soak/{n}"), "version": n,
                               "storedAt": "2026-01-01T00:00:00Z", "sizeBytes": len})
                    } else {
                        json!({"backendToken": format!("soak-renewed-{n}"), "tokenExpiresAt": expires_in(3600)})
                    };
                    let text = answer.to_string();
                    let resp = format!(
                        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\
                         connection: close\r\n\r\n{text}",
                        text.len()
                    );
                    let _ = s.write_all(resp.as_bytes()).await;
                })
                .await;
            });
        }
    });
    port
}

fn expires_in(secs: i64) -> String {
    (time::OffsetDateTime::now_utc() + time::Duration::seconds(secs))
        .format(&time::format_description::well_known::Rfc3339)
        .unwrap()
}

fn create_request(backend: u16) -> CreateSandboxRequest {
    serde_json::from_value(json!({
        "workspaceRequirements": {
            "mounts": [], "capabilities": ["terminal", "network_internal_only"],
            "resourceLimits": {"cpuCores": 1, "memoryMb": 256, "diskMb": 32, "timeoutMs": 600000}
        },
        "bootstrap": {
            "backendUrl": format!("http://127.0.0.1:{backend}"),
            "backendToken": "soak-backend-token",
            // Renewal is due at 80%: within the longer cycles.
            "tokenExpiresAt": expires_in(30),
            "agentId": "soak-agent",
            "artifactUploadEndpoint": format!("http://127.0.0.1:{backend}/api/artifacts"),
        },
        "template": {
            "command": ["/usr/bin/python3", "/workspace/fake_agent.py"],
            "files": [{"path": "fake_agent.py", "content": FAKE_AGENT}],
        }
    }))
    .unwrap()
}

/// The agent's script: an event flood, files announced as artifacts, a slower stream of events, then it waits for
/// commands (and answers `shutdown` with its state).
fn brief(cycle: u64) -> AgentBrief {
    let mut script = vec![json!({"emit_many": 300, "every_ms": 0})];
    for k in 0..3 {
        let path = format!("out/c{cycle}-{k}.txt");
        script.push(json!({"write": {"path": path, "content": format!("artifact {k} of cycle {cycle}\n").repeat(200)}}));
        script.push(json!({"artifact": {"path": path, "artifactId": format!("a{cycle}-{k}")}}));
    }
    script.push(json!({"emit_many": 200, "every_ms": 5}));
    serde_json::from_value(json!({
        "agentId": "soak-agent", "role": "Soak Agent", "workstream": "soak",
        "providerConfig": {"script": script}
    }))
    .unwrap()
}

/// Reads events for up to `for_how_long` (or `max` of them); returns how many were read.
async fn read_events(
    events: &mut EventStream,
    for_how_long: Duration,
    max: usize,
) -> Result<usize, String> {
    let end = Instant::now() + for_how_long;
    let mut n = 0;
    while n < max {
        let left = end.saturating_duration_since(Instant::now());
        if left.is_zero() {
            break;
        }
        match tokio::time::timeout(left, events.next()).await {
            Ok(Ok(_)) => n += 1,
            Ok(Err(e)) => return Err(e.to_string()),
            Err(_) => break,
        }
    }
    Ok(n)
}

/// Bounds one gateway call; a call past [`REQUEST_DEADLINE`] is reported as stuck.
async fn bounded<T>(
    what: &str,
    stats: &Stats,
    f: impl std::future::Future<Output = Result<T, GatewayError>>,
) -> Result<T, String> {
    match tokio::time::timeout(REQUEST_DEADLINE, f).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => {
            stats.agent(&format!("error {what}"));
            Err(format!("{what}: {e}"))
        }
        Err(_) => {
            stats.agent("stuck");
            stats.stuck(format!(
                "agent {what} unanswered after {REQUEST_DEADLINE:?}"
            ));
            Err(format!("{what}: stuck"))
        }
    }
}

/// One sandbox's life. `cycle` decides the variations: gateway present or not, reset mid-flood, kill with grace or
/// not, a second run.
async fn agent_cycle(gw: &Gateway, backend: u16, cycle: u64, stats: &Stats) -> Result<(), String> {
    let sb = match tokio::time::timeout(REQUEST_DEADLINE, gw.create(&create_request(backend))).await
    {
        Ok(Ok(sb)) => sb,
        Ok(Err(e)) if e.is_retryable() => {
            stats.agent("create refused (capacity)");
            tokio::time::sleep(Duration::from_millis(500)).await;
            return Ok(());
        }
        Ok(Err(e)) => return Err(format!("create: {e}")),
        Err(_) => return Err("create: stuck".into()),
    };
    stats.agent("created");
    let r = agent_runs(&sb, cycle, stats).await;
    let deleted = bounded("delete", stats, gw.delete(sb.id())).await;
    if deleted.is_ok() {
        stats.agent("deleted");
    }
    r.and(deleted)
}

async fn agent_runs(sb: &SandboxClient, cycle: u64, stats: &Stats) -> Result<(), String> {
    // The gateway: absent in one cycle of three (events buffer in the daemon), reset mid-flood in another.
    let mut events = (!cycle.is_multiple_of(3)).then(|| sb.events(0));
    bounded("spawn", stats, sb.spawn(&brief(cycle))).await?;
    stats.agent("spawned");
    if let Some(ev) = events.as_mut() {
        let n = read_events(ev, Duration::from_secs(2), 150).await?;
        stats.agent_events(n);
        if cycle % 3 == 1 {
            ev.drop_connection();
            stats.agent("gateway reset");
        }
        let n = read_events(ev, Duration::from_secs(2), 10_000).await?;
        stats.agent_events(n);
    } else {
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
    let state = bounded("pause", stats, sb.pause()).await?;
    stats.agent("paused");
    tokio::time::sleep(Duration::from_millis(300)).await;
    bounded("resume", stats, sb.resume(&state)).await?;
    stats.agent("resumed");
    if let Some(ev) = events.as_mut() {
        let n = read_events(ev, Duration::from_secs(1), 10_000).await?;
        stats.agent_events(n);
    }
    let grace = cycle.is_multiple_of(2);
    let kill = KillRequest {
        grace,
        grace_timeout_ms: grace.then_some(2000),
    };
    bounded("kill", stats, sb.kill(&kill)).await?;
    stats.agent(if grace { "killed (grace)" } else { "killed" });
    if cycle % 4 == 3 {
        // A second run in the same sandbox, killed at once.
        bounded("respawn", stats, sb.spawn(&brief(cycle))).await?;
        tokio::time::sleep(Duration::from_millis(500)).await;
        bounded(
            "kill",
            stats,
            sb.kill(&KillRequest {
                grace: false,
                grace_timeout_ms: None,
            }),
        )
        .await?;
        stats.agent("second run killed");
    }
    let _ = bounded("health", stats, sb.health()).await;
    Ok(())
}

impl Stats {
    fn agent_events(&self, n: usize) {
        *self
            .0
            .lock()
            .unwrap()
            .agents
            .entry("events read".to_owned())
            .or_default() += n as u64;
    }
}

async fn agent_worker(w: usize, port: u16, backend: u16, stop: Instant, stats: Stats) {
    let gw = Gateway::new(&format!("http://127.0.0.1:{port}"), TOKEN);
    for i in 0..MAX_ITERATIONS {
        if Instant::now() >= stop {
            break;
        }
        let cycle = i * AGENT_WORKERS as u64 + w as u64;
        if let Err(e) = agent_cycle(&gw, backend, cycle, &stats).await {
            stats.unexpected(format!("agent cycle {cycle}: {e}"));
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }
}

// ---------------------------------------------------------------------------------------------------------------
// Verdict.

fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    if v.is_empty() {
        return 0.0;
    }
    let m = v.len() / 2;
    if v.len() % 2 == 1 {
        v[m]
    } else {
        (v[m - 1] + v[m]) / 2.0
    }
}

/// Theil-Sen slope: the median of the slopes between every pair of points (per second).
fn theil_sen(t: &[f64], y: &[f64]) -> f64 {
    let mut slopes = Vec::new();
    for i in 0..t.len() {
        for j in i + 1..t.len() {
            if t[j] > t[i] {
                slopes.push((y[j] - y[i]) / (t[j] - t[i]));
            }
        }
    }
    median(&slopes)
}

/// Judges one metric over the samples after warm-up; returns (line to print, passed).
fn judge(name: &str, get: fn(&Sample) -> f64, slack: f64, window: &[Sample]) -> (String, bool) {
    let third = window.len() / 3;
    let y: Vec<f64> = window.iter().map(get).collect();
    let t: Vec<f64> = window.iter().map(|s| s.at.as_secs_f64()).collect();
    let (mid, last) = (median(&y[third..2 * third]), median(&y[2 * third..]));
    let allowed = mid * TOLERANCE + slack;
    let slope = theil_sen(&t, &y);
    let span = t.last().unwrap_or(&0.0) - t.first().unwrap_or(&0.0);
    let trend = slope * span;
    let ok = last - mid <= allowed && trend <= allowed;
    (
        format!(
            "{:<12} middle third median {mid:>10.1}, last third median {last:>10.1} ({:+.1}), trend {trend:+.1} \
             over {span:.0} s ({:+.3}/min); allowed +{allowed:.1}: {}",
            name,
            last - mid,
            slope * 60.0,
            if ok { "flat" } else { "GROWS" }
        ),
        ok,
    )
}

fn print_row(s: &Sample, prev: Option<&Sample>) {
    let rate = prev.map_or(s.done as f64 / s.at.as_secs_f64().max(0.001), |p| {
        (s.done - p.done) as f64 / (s.at - p.at).as_secs_f64().max(0.001)
    });
    print!(
        "{:>7.0} {:>10.1} {:>12.1} {:>6} {:>8} {:>8} {:>7} {:>7} {:>9} {:>8.1}",
        s.at.as_secs_f64(),
        s.rss_kib as f64 / 1024.0,
        s.helpers_rss_kib as f64 / 1024.0,
        s.fds,
        s.threads,
        s.cgroup_dirs,
        s.mounts,
        s.sandbox_procs,
        s.done,
        rate
    );
    for n in s.outcomes {
        print!(" {n:>6}");
    }
    println!();
}

fn header() {
    print!(
        "{:>7} {:>10} {:>12} {:>6} {:>8} {:>8} {:>7} {:>7} {:>9} {:>8}",
        "t (s)",
        "RSS MiB",
        "helpers MiB",
        "fds",
        "threads",
        "cgroups",
        "mounts",
        "sbx ps",
        "done",
        "exec/s"
    );
    for (heading, _) in OUTCOME_COLUMNS {
        print!(" {heading:>6}");
    }
    println!();
}

/// Waits (bounded) until the warm pool is full.
fn wait_pool_full(d: &Daemon) -> bool {
    let deadline = Instant::now() + Duration::from_secs(120);
    while Instant::now() < deadline {
        if let Some(h) = d.healthz() {
            let full = h["pool"]["per_language"].as_u64().unwrap_or(0)
                * h["languages"].as_array().map_or(0, |l| l.len() as u64);
            if h["pool"]["ready"].as_u64().unwrap_or(0) >= full && h["active_executions"] == 0 {
                return true;
            }
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    false
}

/// The checks with the daemon drained but running: everything back to the baseline taken with the full pool.
fn check_drained(d: &Daemon, baseline: &Sample, failures: &mut Vec<String>) {
    if !wait_pool_full(d) {
        failures.push(format!(
            "drained: the pool did not refill / executions still active within 120 s: {:?}",
            d.healthz()
        ));
    }
    // Removal runs after the result: give it a moment, bounded.
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut s = d.sample(Duration::ZERO, &Stats::default());
    let back = |s: &Sample| {
        (s.cgroup_dirs, s.mounts, s.sandbox_procs)
            == (
                baseline.cgroup_dirs,
                baseline.mounts,
                baseline.sandbox_procs,
            )
            && s.fds <= baseline.fds + DRAINED_FDS_SLACK
            && s.threads <= baseline.threads + DRAINED_THREADS_SLACK
    };
    while !back(&s) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(200));
        s = d.sample(Duration::ZERO, &Stats::default());
    }
    println!(
        "drained (daemon running, pool full): cgroup dirs {} (before the load {}), mounts {} ({}), sandbox \
         processes {} ({}), RSS {:.1} MiB ({:.1}), fds {} ({}), threads {} ({})",
        s.cgroup_dirs,
        baseline.cgroup_dirs,
        s.mounts,
        baseline.mounts,
        s.sandbox_procs,
        baseline.sandbox_procs,
        s.rss_kib as f64 / 1024.0,
        baseline.rss_kib as f64 / 1024.0,
        s.fds,
        baseline.fds,
        s.threads,
        baseline.threads
    );
    if s.cgroup_dirs != baseline.cgroup_dirs {
        failures.push(format!(
            "drained: {} cgroup dirs under the parent, {} before the load: {:?}",
            s.cgroup_dirs,
            baseline.cgroup_dirs,
            cgroup_dirs(&d.parent)
        ));
    }
    if s.mounts != baseline.mounts {
        failures.push(format!(
            "drained: {} mounts under the state dir, {} before the load",
            s.mounts, baseline.mounts
        ));
    }
    if s.sandbox_procs != baseline.sandbox_procs {
        failures.push(format!(
            "drained: {} sandbox processes, {} before the load: {:?}",
            s.sandbox_procs,
            baseline.sandbox_procs,
            uid_processes(d.uid_base)
        ));
    }
    if s.fds > baseline.fds + DRAINED_FDS_SLACK {
        failures.push(format!(
            "drained: {} open fds (daemon and helpers), {} before the load (allowed +{DRAINED_FDS_SLACK})",
            s.fds, baseline.fds
        ));
    }
    if s.threads > baseline.threads + DRAINED_THREADS_SLACK {
        failures.push(format!(
            "drained: {} threads (daemon and helpers), {} before the load (allowed +{DRAINED_THREADS_SLACK})",
            s.threads, baseline.threads
        ));
    }
    let children = children_of(d.pid());
    if children != d.helpers {
        failures.push(format!(
            "drained: the daemon's children are {children:?}, its helpers {:?}",
            d.helpers
        ));
    }
    let agents = std::fs::read_dir(d.state_dir().join("agents")).map_or(0, |r| r.count());
    if agents != 0 {
        failures.push(format!(
            "drained: {agents} sandbox directories left under state/agents"
        ));
    }
}

/// The checks after SIGTERM: the daemon exits cleanly and nothing of it is left.
fn check_stopped(d: &mut Daemon, failures: &mut Vec<String>) {
    let t0 = Instant::now();
    match d.stop() {
        Ok(st) if st.success() => println!(
            "stopped: SIGTERM, exited in {:.2} s",
            t0.elapsed().as_secs_f64()
        ),
        Ok(st) => failures.push(format!(
            "stopped: the daemon exited with {st}: {}",
            d.log_tail()
        )),
        Err(e) => failures.push(format!("stopped: {e}")),
    }
    // The helpers leave with it; give the kernel a moment to reap and remove.
    let deadline = Instant::now() + Duration::from_secs(10);
    let leftovers = || {
        let dirs = cgroup_dirs(&d.parent);
        let parents = test_support::cgroups::cgroup_parent_dirs(&d.parent);
        let mounts = mounts_under("/proc/self/mountinfo", &d.state_dir());
        let procs = uid_processes(d.uid_base);
        let in_cgroups = cgroup_processes(&d.parent);
        let helpers: Vec<i32> = d
            .helpers
            .iter()
            .copied()
            .filter(|p| Path::new(&format!("/proc/{p}")).exists())
            .collect();
        (dirs, parents, mounts, procs, in_cgroups, helpers)
    };
    let mut l = leftovers();
    while Instant::now() < deadline
        && !(l.0.is_empty() && l.2.is_empty() && l.3.is_empty() && l.4.is_empty() && l.5.is_empty())
    {
        std::thread::sleep(Duration::from_millis(100));
        l = leftovers();
    }
    let (dirs, parents, mounts, procs, in_cgroups, helpers) = l;
    println!(
        "stopped: cgroup dirs under the parent {}, parent dirs left {}, mounts under the state dir {}, sandbox \
         processes {}, processes in its cgroups {}, helpers alive {}",
        dirs.len(),
        parents.len(),
        mounts.len(),
        procs.len(),
        in_cgroups.len(),
        helpers.len()
    );
    let mut fail = |what: &str, v: String| failures.push(format!("stopped: {what} left: {v}"));
    if !dirs.is_empty() {
        fail("cgroup dirs", format!("{dirs:?}"));
    }
    if !parents.is_empty() {
        fail("cgroup parent dirs", format!("{parents:?}"));
    }
    if !mounts.is_empty() {
        fail("mounts", format!("{mounts:?}"));
    }
    if !procs.is_empty() {
        fail("sandbox processes", format!("{procs:?}"));
    }
    if !in_cgroups.is_empty() {
        fail("processes in its cgroups", format!("{in_cgroups:?}"));
    }
    if !helpers.is_empty() {
        fail("helper processes", format!("{helpers:?}"));
    }
}

/// Prints the outcome counts; returns the executions done.
fn print_outcomes(stats: &Stats, load: Duration) -> u64 {
    let t = stats.0.lock().unwrap();
    let done: u64 = t.execs.values().sum();
    println!();
    println!(
        "executions: {done} in {:.0} s = {:.1} exec/s",
        load.as_secs_f64(),
        done as f64 / load.as_secs_f64().max(0.001)
    );
    for (k, v) in &t.execs {
        println!("  {k:<28} {v:>8}");
    }
    println!("agent sandboxes:");
    for (k, v) in &t.agents {
        println!("  {k:<28} {v:>8}");
    }
    println!(
        "unexpected endings (not part of the verdict): {}",
        t.unexpected
    );
    for e in &t.examples {
        println!("  {e}");
    }
    done
}

/// Runs the load for `secs`, sampling; returns the samples and whether the daemon stayed alive.
fn soak(
    d: &mut Daemon,
    rt: &tokio::runtime::Runtime,
    secs: u64,
    stats: &Stats,
) -> (Vec<Sample>, bool) {
    let t0 = Instant::now();
    let stop = t0 + Duration::from_secs(secs);
    let port = d.port;
    let backend = rt.block_on(backend());
    let mut tasks = Vec::new();
    for w in 0..EXEC_WORKERS {
        tasks.push(rt.spawn(exec_worker(w, port, stop, stats.clone())));
    }
    for w in 0..AGENT_WORKERS {
        tasks.push(rt.spawn(agent_worker(w, port, backend, stop, stats.clone())));
    }
    header();
    let mut samples: Vec<Sample> = Vec::new();
    let mut alive = true;
    let mut next = t0 + SAMPLE_EVERY;
    loop {
        let now = Instant::now();
        if now >= stop {
            break;
        }
        std::thread::sleep(next.min(stop) - now);
        if Instant::now() < next {
            break; // the end came before the next sample
        }
        next += SAMPLE_EVERY;
        if !d.alive() {
            println!("the daemon died: {}", d.log_tail());
            alive = false;
            break;
        }
        let s = d.sample(t0.elapsed(), stats);
        print_row(&s, samples.last());
        samples.push(s);
    }
    // Every worker ends within one request deadline of `stop` (each request is bounded).
    let joined = rt.block_on(async {
        tokio::time::timeout(REQUEST_DEADLINE * 2, futures_util::future::join_all(tasks)).await
    });
    if joined.is_err() {
        stats.stuck("workers did not end within two request deadlines of the end".into());
    }
    let s = d.sample(t0.elapsed(), stats);
    println!(
        "load stopped after {:.0} s; after the workers ended:",
        t0.elapsed().as_secs_f64()
    );
    print_row(&s, samples.last());
    (samples, alive && d.alive())
}

fn main() {
    if !test_support::require_root("soak bench", "it starts a daemon, which creates containers") {
        return;
    }
    // `cargo bench` passes --bench; a filter argument is accepted and ignored.
    let secs = std::env::var("SANDBOXD_SOAK_SECS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(DEFAULT_SECS);
    let mut d = Daemon::start();
    let mut failures = Vec::new();
    if !wait_pool_full(&d) {
        failures.push("the warm pool did not fill within 120 s of the start".to_owned());
    }
    let baseline = d.sample(Duration::ZERO, &Stats::default());
    println!(
        "soak: {secs} s, {EXEC_WORKERS} execution workers + {AGENT_WORKERS} agent workers, max_concurrent \
         {MAX_CONCURRENT}, agents.max_sandboxes {MAX_SANDBOXES}; daemon pid {}, helpers {:?}, cgroup parent {}, \
         state {}",
        d.pid(),
        d.helpers,
        d.parent,
        d.state_dir().display()
    );
    println!(
        "before the load (pool full): RSS {:.1} MiB, fds {}, threads {}, cgroup dirs {}, mounts {}, sandbox \
         processes {}",
        baseline.rss_kib as f64 / 1024.0,
        baseline.fds,
        baseline.threads,
        baseline.cgroup_dirs,
        baseline.mounts,
        baseline.sandbox_procs
    );
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let stats = Stats::default();
    let t0 = Instant::now();
    let (samples, alive) = soak(&mut d, &rt, secs, &stats);
    let load = t0.elapsed();
    print_outcomes(&stats, load);
    if !alive {
        failures.push("the daemon died during the load".to_owned());
    }
    judge_flat(&samples, &mut failures);
    if alive {
        check_drained(&d, &baseline, &mut failures);
        check_stopped(&mut d, &mut failures);
    }
    let stuck = stats.0.lock().unwrap().stuck.clone();
    if !stuck.is_empty() {
        failures.push(format!(
            "{} requests stuck: {:?}",
            stuck.len(),
            &stuck[..stuck.len().min(10)]
        ));
    }
    println!();
    if failures.is_empty() {
        println!("verdict: PASS");
    } else {
        println!("verdict: FAIL");
        for f in &failures {
            println!("  - {f}");
        }
        drop(d);
        std::process::exit(1);
    }
}

fn judge_flat(samples: &[Sample], failures: &mut Vec<String>) {
    let skip = (samples.len() as f64 * WARMUP_FRACTION).ceil() as usize;
    let window = &samples[skip.min(samples.len())..];
    println!();
    if window.len() < 6 {
        failures.push(format!(
            "flat: only {} samples after warm-up, at least 6 are needed (run longer)",
            window.len()
        ));
        return;
    }
    println!(
        "flatness over {} samples after {skip} of warm-up: last third's median at most the middle third's + {:.0}% \
         + slack, and the Theil-Sen trend over the window at most the same",
        window.len(),
        TOLERANCE * 100.0
    );
    for (name, get, slack) in METRICS {
        let (line, ok) = judge(name, get, slack, window);
        println!("  {line}");
        if !ok {
            failures.push(format!("flat: {line}"));
        }
    }
}

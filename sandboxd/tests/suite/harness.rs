//! The harness: a real daemon per test ([`Daemon`]), an FSP/1 client ([`Client`]) that collects an execution's
//! messages ([`Collected`]) and checks their order, and probes of the host (processes, cgroups, the daemon's
//! mounts).
//!
//! Rules every test follows: waits are deadline-polled loops ([`wait_until`]), never fixed sleeps used as
//! assertions; a daemon never shares its port, state directory, cgroup parent or uid range with another one; a
//! test that needs root calls [`privileged`] first.

use std::collections::VecDeque;
use std::fmt::Write as _;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use futures_util::{SinkExt, StreamExt};
use nix::sys::signal::Signal;
use nix::unistd::Pid;
use protocol::{
    ErrorCode, ErrorMessage, ExecStatus, Limits, OutputChunk, OutputEncoding, Pong, ResultMessage,
    ServerMessage,
};
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::{RwLock, RwLockReadGuard, RwLockWriteGuard};
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::http::HeaderValue;
use tokio_tungstenite::tungstenite::{self, Message};
use tokio_tungstenite::{MaybeTlsStream, WebSocketStream};

/// The first line of the warm python and node stubs (`sandboxd/warm/python.py`, `sandboxd/warm/node.js`), which
/// their command lines hold.
pub const WARM_STUB_MARKS: [&str; 2] = [
    "# sandboxd's warm python stub",
    "// sandboxd's warm node stub",
];

/// The daemon binary under test.
pub const SANDBOXD: &str = env!("CARGO_BIN_EXE_sandboxd");

/// How long a daemon may take to answer `/healthz` after it was started (its start-up runs one self-test execution
/// per language: a few seconds here, 20-40 s in an emulated guest, tests/vm under TCG).
const READY_DEADLINE: Duration = Duration::from_secs(60);
/// Default deadline of one client wait (a message, an execution's end).
const CLIENT_DEADLINE: Duration = Duration::from_secs(30);

// ---------------------------------------------------------------------------------------------------------------
// Privilege and test-wide serialization
// ---------------------------------------------------------------------------------------------------------------

/// Tests hold this shared; the one test with a timing bound (ping during a flood) holds it exclusively, so its
/// 1 s bound is measured on a machine that is not also running the rest of the suite.
static QUIET: RwLock<()> = RwLock::const_new(());

/// Held for the whole test (declare it first so it is dropped last).
pub struct Guard {
    _shared: Option<RwLockReadGuard<'static, ()>>,
    _exclusive: Option<RwLockWriteGuard<'static, ()>>,
}

pub use test_support::{cannot_run, on_ci};

/// For a test that needs root: `None` (after saying so loudly) when not root; panics instead on CI.
pub async fn privileged(test: &str) -> Option<Guard> {
    if !test_support::require_root(test, "") {
        return None;
    }
    Some(Guard {
        _shared: Some(QUIET.read().await),
        _exclusive: None,
    })
}

/// Like [`privileged`], but no other test of this binary runs at the same time.
pub async fn privileged_alone(test: &str) -> Option<Guard> {
    if !test_support::require_root(test, "") {
        return None;
    }
    Some(Guard {
        _shared: None,
        _exclusive: Some(QUIET.write().await),
    })
}

// ---------------------------------------------------------------------------------------------------------------
// Polling
// ---------------------------------------------------------------------------------------------------------------

/// Polls `check` every 50 ms until it returns `Ok`, or panics after `deadline` with its last `Err` (what was still
/// wrong).
pub async fn wait_until<T, F, Fut>(what: &str, deadline: Duration, check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, String>>,
{
    daemon::poll_until(what, deadline, Duration::from_millis(50), check).await
}

/// A string unique to this test process and call (for markers in command lines and file names).
pub fn unique_marker() -> String {
    let n = MARKERS.fetch_add(1, Ordering::SeqCst);
    format!(
        "{}{:04}{:06}",
        std::process::id(),
        n,
        rand::random::<u32>() % 1_000_000
    )
}

static MARKERS: AtomicU32 = AtomicU32::new(0);

/// Daemons started by this process (names their cgroup parents and uid ranges).
static NEXT: AtomicU32 = AtomicU32::new(0);

// ---------------------------------------------------------------------------------------------------------------
// Host probes
// ---------------------------------------------------------------------------------------------------------------

pub use test_support::cgroups::{
    cgroup_children, cgroup_parent_dirs, remove_cgroup_parent, CgroupParentGuard,
};

pub use test_support::procs::{
    children_of, proc_info, processes_with_arg, processes_with_uid, ProcInfo,
};

/// A minimal HTTP/1.1 GET: status code and body.
pub async fn http_get(port: u16, path: &str) -> std::io::Result<(u16, String)> {
    let fut = async {
        let mut s = TcpStream::connect(("127.0.0.1", port)).await?;
        s.write_all(
            format!("GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n\r\n")
                .as_bytes(),
        )
        .await?;
        let mut buf = Vec::new();
        s.read_to_end(&mut buf).await?;
        let text = String::from_utf8_lossy(&buf).into_owned();
        let code = text
            .split_whitespace()
            .nth(1)
            .and_then(|c| c.parse().ok())
            .ok_or_else(|| std::io::Error::other(format!("not an HTTP response: {text:?}")))?;
        let body = text
            .split_once("\r\n\r\n")
            .map(|(_, b)| b.to_owned())
            .unwrap_or_default();
        Ok((code, body))
    };
    tokio::time::timeout(Duration::from_secs(5), fut)
        .await
        .unwrap_or_else(|_| Err(std::io::Error::other("HTTP GET timed out")))
}

pub use test_support::daemon::free_port;
use test_support::daemon::{self, DaemonConfig};

// ---------------------------------------------------------------------------------------------------------------
// The daemon
// ---------------------------------------------------------------------------------------------------------------

/// What a test's daemon is configured with; the defaults match the suite's standard config.
#[derive(Debug, Clone)]
pub struct DaemonOpts {
    /// `capacity.max_concurrent`.
    pub max_concurrent: usize,
    /// `capacity.max_queue`.
    pub max_queue: usize,
    /// `max_frame_bytes`.
    pub max_frame_bytes: usize,
    /// `shutdown_grace_ms`.
    pub shutdown_grace_ms: u64,
    /// `limits.max`.
    pub max_limits: Limits,
    /// Reuse this cgroup parent (crash recovery); default: a fresh one.
    pub cgroup_parent: Option<String>,
    /// Reuse this state directory (crash recovery, stored images); default: a fresh one.
    pub state_dir: Option<PathBuf>,
    /// Merged into the config last (e.g. `images`, `languages`).
    pub extra_config: Option<Value>,
    /// `pool.size`: containers kept ready, split over the languages (the suite runs with a small warm pool).
    pub pool_size: usize,
}

/// The suite's standard `limits.max`.
pub const MAX_LIMITS: Limits = Limits {
    timeout_ms: 60_000,
    memory_mb: 1024,
    cpu_shares: 1024,
    max_output_bytes: 16 << 20,
    pids_max: 256,
    disk_mb: 256,
    cpu_cores: Some(protocol::CpuCores::from_const(2.0)),
};

impl Default for DaemonOpts {
    fn default() -> Self {
        Self {
            max_concurrent: 4,
            max_queue: 4,
            max_frame_bytes: 16 << 20,
            shutdown_grace_ms: 2000,
            max_limits: MAX_LIMITS,
            cgroup_parent: None,
            state_dir: None,
            extra_config: None,
            pool_size: 2,
        }
    }
}

/// Runs the daemon with `config` and waits (polling) for it to exit; panics if it is still running at `deadline`.
pub async fn run_until_exit(
    config: &std::path::Path,
    deadline: Duration,
) -> (std::process::ExitStatus, String) {
    let mut child = Command::new(SANDBOXD)
        .arg("--config")
        .arg(config)
        .env_remove("SANDBOXD_TOKEN")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let start = std::time::Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if start.elapsed() > deadline {
            let _ = child.kill();
            panic!(
                "sandboxd with {} did not exit within {deadline:?}",
                config.display()
            );
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let out = child.wait_with_output().unwrap();
    (status, String::from_utf8_lossy(&out.stderr).into_owned())
}

/// A running `sandboxd`. Dropping it stops it (SIGTERM, then SIGKILL after 15 s) and removes its files; when the
/// test is failing, its log is printed.
pub struct Daemon {
    child: Child,
    /// Its command-line arguments (for [`Daemon::restart`]).
    args: Vec<String>,
    /// The daemon's listen port on 127.0.0.1.
    pub port: u16,
    token: String,
    dir: tempfile::TempDir,
    /// `state_dir`.
    pub state_dir: PathBuf,
    /// `sandbox.cgroup_parent`.
    pub cgroup_parent: String,
    /// `sandbox.uid_base`.
    pub uid_base: u32,
    /// `capacity.max_concurrent`.
    pub max_concurrent: usize,
    /// `pool.size` in force.
    pub pool_size: usize,
    /// Remove what is left under the cgroup parent when dropped (off once another daemon owns the parent).
    clean_cgroups: bool,
}

/// How a daemon is launched (internal to the harness).
pub struct Launch {
    /// Command-line arguments.
    pub args: Vec<String>,
    /// Listen port.
    pub port: u16,
    /// Token (may be empty when the daemon generates one).
    pub token: String,
    /// Scratch directory of the harness (config, logs).
    pub dir: tempfile::TempDir,
    /// State directory.
    pub state_dir: PathBuf,
    /// Cgroup parent.
    pub cgroup_parent: String,
    /// uid base.
    pub uid_base: u32,
    /// Concurrency.
    pub max_concurrent: usize,
    /// `pool.size` in force (the daemon's default is `max_concurrent`).
    pub pool_size: usize,
}

impl Daemon {
    /// Starts a daemon with a fresh port, state directory, cgroup parent and uid range, and waits until
    /// `/healthz` answers 200.
    pub async fn start(opts: DaemonOpts) -> Daemon {
        let n = NEXT.fetch_add(1, Ordering::SeqCst);
        let pid = std::process::id();
        let cgroup_parent = opts
            .cgroup_parent
            .clone()
            .unwrap_or_else(|| format!("sandboxd-test-{pid}-{n}"));
        // A distinct uid range per daemon, also across concurrently running test processes.
        let uid_base = daemon::uid_base(1_000_000, n);
        assert!(
            2 * opts.max_concurrent + opts.pool_size + 4 <= 64,
            "uid ranges are 64 wide"
        );
        let token = format!("test-token-{pid}-{n}-{:016x}", rand::random::<u64>());
        Daemon::launch_on_free_port(|port| {
            let dir = tempfile::Builder::new()
                .prefix("sandboxd-test-")
                .tempdir()
                .expect("tempdir");
            let state_dir = opts
                .state_dir
                .clone()
                .unwrap_or_else(|| dir.path().join("state"));
            let config = DaemonConfig {
                port,
                state_dir: state_dir.clone(),
                token: token.clone(),
                max_concurrent: opts.max_concurrent,
                max_queue: opts.max_queue,
                max_limits: opts.max_limits,
                shutdown_grace_ms: opts.shutdown_grace_ms,
                cgroup_parent: cgroup_parent.clone(),
                uid_base,
                pool_size: opts.pool_size,
            };
            let mut config = with(
                config.to_json(),
                json!({"max_frame_bytes": opts.max_frame_bytes}),
            );
            if let Some(extra) = &opts.extra_config {
                merge(&mut config, extra.clone());
            }
            let config_path = daemon::write_config(dir.path(), &config);
            Launch {
                args: vec!["--config".into(), config_path.display().to_string()],
                port,
                token: token.clone(),
                dir,
                state_dir,
                cgroup_parent: cgroup_parent.clone(),
                uid_base,
                max_concurrent: opts.max_concurrent,
                pool_size: opts.pool_size,
            }
        })
        .await
    }

    /// Spawns the binary as `launch` says and waits until it is healthy.
    pub async fn launch(launch: Launch) -> Daemon {
        let mut d = Daemon::spawn(launch);
        if let Err(e) = d.wait_ready().await {
            panic!("{e}");
        }
        d
    }

    /// [`launch`](Self::launch) on a free port: `make` builds the launch for a port. A free port may be taken by
    /// someone else before the daemon binds it; then another one is tried (five times at most).
    pub async fn launch_on_free_port(make: impl Fn(u16) -> Launch) -> Daemon {
        daemon::launch_on_free_port(async |port| {
            let mut d = Daemon::spawn(make(port));
            let ready = d.wait_ready().await;
            (d, ready)
        })
        .await
    }

    fn spawn(launch: Launch) -> Daemon {
        let child = daemon::spawn(Path::new(SANDBOXD), &launch.args, launch.dir.path());
        Daemon {
            child,
            args: launch.args,
            port: launch.port,
            token: launch.token,
            dir: launch.dir,
            state_dir: launch.state_dir,
            cgroup_parent: launch.cgroup_parent,
            uid_base: launch.uid_base,
            max_concurrent: launch.max_concurrent,
            pool_size: launch.pool_size,
            clean_cgroups: true,
        }
    }

    /// Waits until `/healthz` answers 200 and, unless the daemon generates its own token, the token is accepted
    /// (so it is this daemon that answers, not another server that took the port).
    async fn wait_ready(&mut self) -> Result<(), String> {
        let (port, token, url) = (self.port, self.token.clone(), self.url());
        daemon::wait_serving(
            &mut self.child,
            self.dir.path(),
            READY_DEADLINE,
            Duration::from_millis(50),
            async || {
                matches!(http_get(port, "/healthz").await, Ok((200, _)))
                    && (token.is_empty()
                        || Client::try_connect(&url, Some(&token), &[]).await.is_ok())
            },
        )
        .await
    }

    /// The daemon's process id.
    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    /// `ws://127.0.0.1:PORT/ws`.
    pub fn url(&self) -> String {
        format!("ws://127.0.0.1:{}/ws", self.port)
    }

    /// A token the daemon accepts.
    pub fn token(&self) -> &str {
        &self.token
    }

    /// Sets the token (for a daemon that generated its own).
    pub fn set_token(&mut self, token: &str) {
        self.token = token.to_owned();
    }

    /// The harness's scratch directory of this daemon.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// The uids container root maps to: one per container that may exist at once (running, being removed, or
    /// ready in the pool), `uid_base .. uid_base + 2 x max_concurrent + pool size + 4`.
    pub fn uid_range(&self) -> std::ops::Range<u32> {
        let rounding = if self.pool_size > 0 { 4 } else { 0 };
        self.uid_base..self.uid_base + (2 * self.max_concurrent + self.pool_size + rounding) as u32
    }

    /// `Ok` once nothing of any execution is left: the only containers are the pool's ready ones, the pool is
    /// full (so no creation is half-way), and each ready container is exactly one process of a sandbox uid (two
    /// with a waiting warm interpreter), one cgroup leaf per hierarchy, one scratch mount and two state entries.
    /// With `pool.size: 0`, nothing at all.
    pub async fn leftovers(&self) -> Result<(), String> {
        let (_, h) = self.healthz().await;
        let languages = h["languages"].as_array().map_or(0, Vec::len);
        let ready = h["pool"]["ready"].as_u64().unwrap_or(u64::MAX) as usize;
        let full = self.pool_size.div_ceil(languages.max(1)) * languages;
        let procs = processes_with_uid(self.uid_range());
        let cgroups = self.cgroup_leftovers();
        let leaves: std::collections::BTreeSet<_> =
            cgroups.iter().filter_map(|p| p.file_name()).collect();
        let mounts = self.scratch_mounts();
        let files = self.state_leftovers();
        // One scratch directory per ready container, and on the libcontainer start also its state directory.
        let scratch = files
            .iter()
            .filter(|p| {
                p.parent()
                    .and_then(|d| d.file_name())
                    .is_some_and(|n| n == "run")
            })
            .count();
        let state = files.len() - scratch;
        // A ready python or javascript container also holds its waiting interpreter: the init's child, running the
        // warm stub.
        let waiting = procs
            .iter()
            .filter(|p| {
                WARM_STUB_MARKS.iter().any(|m| p.cmdline.contains(m))
                    && procs.iter().any(|init| init.pid == p.ppid)
            })
            .count();
        if ready == full
            && procs.len() == ready + waiting
            && waiting <= ready
            && leaves.len() == ready
            && mounts == ready
            && scratch == ready
            && (state == 0 || state == ready)
        {
            Ok(())
        } else {
            Err(format!(
                "pool ready {ready} of {full}; {} processes {:?}, cgroup leaves {leaves:?}, {mounts} scratch mounts, state {files:?}",
                procs.len(),
                procs.iter().take(8).collect::<Vec<_>>()
            ))
        }
    }

    /// What the daemon wrote to stderr (its log) so far.
    pub fn log(&self) -> String {
        daemon::log(self.dir.path())
    }

    /// What the daemon wrote to stdout so far.
    pub fn stdout(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("stdout.log")).unwrap_or_default()
    }

    /// `GET /healthz`: status code and JSON body.
    pub async fn healthz(&self) -> (u16, Value) {
        let (code, body) = http_get(self.port, "/healthz")
            .await
            .unwrap_or_else(|e| panic!("GET /healthz: {e}"));
        (code, serde_json::from_str(&body).unwrap_or(Value::Null))
    }

    /// Container cgroups under this daemon's parent, in every hierarchy.
    pub fn cgroup_leftovers(&self) -> Vec<PathBuf> {
        cgroup_children(&self.cgroup_parent)
    }

    /// Mounts of per-execution scratch space (source `sandboxd-scratch`) in the daemon's mount namespace.
    pub fn scratch_mounts(&self) -> usize {
        let info = std::fs::read_to_string(format!("/proc/{}/mountinfo", self.pid()))
            .unwrap_or_else(|e| panic!("cannot read the daemon's mountinfo: {e}"));
        info.lines()
            .filter(|l| {
                l.split_once(" - ").is_some_and(|(_, tail)| {
                    tail.split_whitespace().nth(1) == Some("sandboxd-scratch")
                })
            })
            .count()
    }

    /// Per-execution state left in the daemon's run directory (seen through its mount namespace): every entry of
    /// `<state_dir>/run` but the helper's `containers`, and every entry of `containers`.
    pub fn state_leftovers(&self) -> Vec<PathBuf> {
        let run = PathBuf::from(format!("/proc/{}/root", self.pid()))
            .join(self.state_dir.strip_prefix("/").unwrap_or(&self.state_dir))
            .join("run");
        let list = |dir: &Path| -> Vec<PathBuf> {
            std::fs::read_dir(dir)
                .map(|rd| rd.flatten().map(|e| e.path()).collect())
                .unwrap_or_default()
        };
        let mut out: Vec<PathBuf> = list(&run)
            .into_iter()
            .filter(|p| p.file_name().is_some_and(|n| n != "containers"))
            .collect();
        out.extend(list(&run.join("containers")));
        out
    }

    /// Sends `sig` to the daemon.
    pub fn signal(&self, sig: Signal) {
        let _ = nix::sys::signal::kill(Pid::from_raw(self.pid()), sig);
    }

    /// Waits (polling) for the daemon to exit; `None` if it is still running after `deadline`.
    pub fn wait_exit(&mut self, deadline: Duration) -> Option<ExitStatus> {
        daemon::wait_exit(&mut self.child, deadline)
    }

    /// SIGKILLs the daemon and reaps it. The cgroup parent is left alone from now on (another daemon may take
    /// it over).
    pub fn kill_hard(&mut self) {
        self.clean_cgroups = false;
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Starts the daemon again after [`Self::kill_hard`], with the same configuration and state, and waits until
    /// it is healthy; it owns the cgroup parent again.
    pub async fn restart(&mut self) {
        self.child = daemon::spawn(Path::new(SANDBOXD), &self.args, self.dir.path());
        self.clean_cgroups = true;
        if let Err(e) = self.wait_ready().await {
            panic!("{e}");
        }
    }

    /// A summary for assertion messages.
    pub fn describe(&self) -> String {
        format!(
            "sandboxd pid {} port {} cgroup parent {} state {}",
            self.pid(),
            self.port,
            self.cgroup_parent,
            self.state_dir.display()
        )
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        daemon::stop(&mut self.child);
        daemon::print_log_if_failing(&self.describe(), self.dir.path());
        if self.clean_cgroups {
            remove_cgroup_parent(&self.cgroup_parent);
        }
        // With live restore, a test that failed before deleting its sandboxes leaves the daemon's mount namespace
        // pinned in ours (the daemon keeps it for a next one): released here, as a daemon with no sandbox would.
        let pin_dir = self.state_dir.join("mntns");
        for pin in [pin_dir.join("ns"), pin_dir.join("ns.next"), pin_dir] {
            while nix::mount::umount2(&pin, nix::mount::MntFlags::MNT_DETACH).is_ok() {}
        }
        // The tempdir removes itself (best effort).
    }
}

// ---------------------------------------------------------------------------------------------------------------
// Messages
// ---------------------------------------------------------------------------------------------------------------

pub use test_support::fsp::{
    cancel as cancel_json, execute as exec_json, merge, ping as ping_json, with,
};

/// A short description of a message, e.g. `status:running`, `error:INVALID_REQUEST`.
pub fn kind(m: &ServerMessage) -> String {
    match m {
        ServerMessage::Status { status, .. } => format!("status:{}", status.as_str()),
        ServerMessage::Error(e) => format!("error:{}", e.code),
        other => other.type_name().to_owned(),
    }
}

/// Everything one execution produced, in order.
#[derive(Debug, Clone)]
pub struct Collected {
    /// The execution id.
    pub id: String,
    /// Its messages, in arrival order.
    pub messages: Vec<ServerMessage>,
    /// The same messages as JSON, for checks on the wire form.
    pub raw: Vec<Value>,
}

impl Collected {
    /// An empty collection for `id`.
    pub fn new(id: &str) -> Self {
        Self {
            id: id.to_owned(),
            messages: Vec::new(),
            raw: Vec::new(),
        }
    }

    /// Adds a message that arrived for this execution.
    pub fn push(&mut self, m: ServerMessage, raw: Value) {
        self.messages.push(m);
        self.raw.push(raw);
    }

    /// Whether the last message is the execution's terminal one.
    pub fn is_done(&self) -> bool {
        self.messages.last().is_some_and(ServerMessage::is_terminal)
    }

    /// Kinds of the messages, with runs of `stdout` (and of `stderr`) folded into one.
    pub fn kinds(&self) -> Vec<String> {
        let mut out: Vec<String> = Vec::new();
        for m in &self.messages {
            let k = kind(m);
            if (k == "stdout" || k == "stderr") && out.last() == Some(&k) {
                continue;
            }
            out.push(k);
        }
        out
    }

    /// The `ack`'s limits and `queued`.
    pub fn ack(&self) -> (Option<Limits>, Option<bool>) {
        self.messages
            .iter()
            .find_map(|m| match m {
                ServerMessage::Ack { limits, queued, .. } => Some((*limits, *queued)),
                _ => None,
            })
            .unwrap_or_else(|| panic!("no ack: {}", self.dump()))
    }

    /// Every `status`, in order.
    pub fn statuses(&self) -> Vec<ExecStatus> {
        self.messages
            .iter()
            .filter_map(|m| match m {
                ServerMessage::Status { status, .. } => Some(*status),
                _ => None,
            })
            .collect()
    }

    /// The terminal status, if any.
    pub fn terminal_status(&self) -> Option<ExecStatus> {
        self.statuses().into_iter().find(|s| s.is_terminal())
    }

    /// The `stdout` chunks.
    pub fn stdout_chunks(&self) -> Vec<&OutputChunk> {
        self.messages
            .iter()
            .filter_map(|m| match m {
                ServerMessage::Stdout(c) => Some(c),
                _ => None,
            })
            .collect()
    }

    /// The `stderr` chunks.
    pub fn stderr_chunks(&self) -> Vec<&OutputChunk> {
        self.messages
            .iter()
            .filter_map(|m| match m {
                ServerMessage::Stderr(c) => Some(c),
                _ => None,
            })
            .collect()
    }

    /// All stdout bytes (base64 chunks decoded).
    pub fn stdout(&self) -> Vec<u8> {
        decode_all(&self.stdout_chunks())
    }

    /// All stderr bytes (base64 chunks decoded).
    pub fn stderr(&self) -> Vec<u8> {
        decode_all(&self.stderr_chunks())
    }

    /// Stdout as text (lossy).
    pub fn stdout_text(&self) -> String {
        String::from_utf8_lossy(&self.stdout()).into_owned()
    }

    /// The `result`, or a panic with everything that arrived.
    pub fn result(&self) -> &ResultMessage {
        self.messages
            .iter()
            .find_map(|m| match m {
                ServerMessage::Result(r) => Some(r),
                _ => None,
            })
            .unwrap_or_else(|| panic!("expected a result: {}", self.dump()))
    }

    /// The `result` as JSON.
    pub fn result_raw(&self) -> &Value {
        self.raw
            .iter()
            .find(|v| v["type"] == "result")
            .unwrap_or_else(|| panic!("expected a result: {}", self.dump()))
    }

    /// Everything that arrived, for assertion messages (long output shortened).
    pub fn dump(&self) -> String {
        let mut s = format!("execution {:?}: {:?}", self.id, self.kinds());
        if let Some(r) = self.messages.iter().find_map(|m| match m {
            ServerMessage::Result(r) => Some(r),
            _ => None,
        }) {
            let _ = write!(s, "; result {r:?}");
        }
        if let Some(e) = self.messages.iter().find_map(|m| match m {
            ServerMessage::Error(e) => Some(e),
            _ => None,
        }) {
            let _ = write!(s, "; error {e:?}");
        }
        let short = |b: Vec<u8>| {
            let t = String::from_utf8_lossy(&b).into_owned();
            if t.len() > 2000 {
                format!(
                    "{}... ({} bytes)",
                    t.chars().take(2000).collect::<String>(),
                    t.len()
                )
            } else {
                t
            }
        };
        let _ = write!(
            s,
            "; stdout {:?}; stderr {:?}",
            short(self.stdout()),
            short(self.stderr())
        );
        s
    }

    /// Checks the order of the messages ([`check_sequence`](Self::check_sequence)) and that the program ran to
    /// completion, with the whole exchange on failure.
    pub fn check_completed(&self) {
        self.check_sequence();
        assert_eq!(
            self.terminal_status(),
            Some(ExecStatus::Completed),
            "{}",
            self.dump()
        );
    }

    /// Checks the order of spec section 5: `ack` once and first; `status:running` at most once, right after it;
    /// output only while running; exactly one terminal status, followed at once by `result`, the last message;
    /// or an `error` as the last message (alone when the request was refused).
    pub fn check_sequence(&self) {
        let kinds: Vec<String> = self.messages.iter().map(kind).collect();
        let fail = |why: &str| -> ! {
            panic!(
                "execution {:?}: message order breaks spec section 5 ({why}): {kinds:?}; {}",
                self.id,
                self.dump()
            )
        };
        if self.messages.is_empty() {
            fail("no messages");
        }
        let terminal: Vec<usize> = (0..self.messages.len())
            .filter(|&i| self.messages[i].is_terminal())
            .collect();
        if terminal != [self.messages.len() - 1] {
            fail("exactly one terminal message (result or error), and it is the last");
        }
        for m in &self.messages {
            if m.id() != Some(self.id.as_str()) {
                fail("a message for another id");
            }
        }
        if let ServerMessage::Error(_) = self.messages[self.messages.len() - 1] {
            if self.messages.len() == 1 {
                return;
            }
        }
        if kinds[0] != "ack" {
            fail("ack first");
        }
        if kinds.iter().filter(|k| *k == "ack").count() != 1 {
            fail("exactly one ack");
        }
        let running: Vec<usize> = (0..kinds.len())
            .filter(|&i| kinds[i] == "status:running")
            .collect();
        if running.len() > 1 || running.first().is_some_and(|&i| i != 1) {
            fail("status:running at most once, right after the ack");
        }
        let statuses: Vec<usize> = (0..kinds.len())
            .filter(|&i| kinds[i].starts_with("status:") && kinds[i] != "status:running")
            .collect();
        let is_output = |k: &String| k == "stdout" || k == "stderr" || k == "tool_call";
        match &self.messages[self.messages.len() - 1] {
            ServerMessage::Result(_) => {
                if statuses.len() != 1 || statuses[0] != kinds.len() - 2 {
                    fail("exactly one terminal status, right before the result");
                }
                for (i, k) in kinds.iter().enumerate() {
                    if is_output(k) && (running.is_empty() || i < running[0] || i > statuses[0]) {
                        fail("output only between status:running and the terminal status");
                    }
                }
            }
            _ => {
                if !statuses.is_empty() {
                    fail("an execution that ends with an error has no terminal status");
                }
                for (i, k) in kinds.iter().enumerate() {
                    if is_output(k) && (running.is_empty() || i < running[0]) {
                        fail("output only after status:running");
                    }
                }
            }
        }
    }
}

fn decode_all(chunks: &[&OutputChunk]) -> Vec<u8> {
    let mut out = Vec::new();
    for c in chunks {
        out.extend(
            c.decode()
                .unwrap_or_else(|e| panic!("chunk {c:?} does not decode: {e}")),
        );
    }
    out
}

/// Whether a chunk was sent base64-encoded.
pub fn is_base64(c: &OutputChunk) -> bool {
    c.encoding == Some(OutputEncoding::Base64)
}

// ---------------------------------------------------------------------------------------------------------------
// The client
// ---------------------------------------------------------------------------------------------------------------

type Ws = WebSocketStream<MaybeTlsStream<TcpStream>>;

/// An FSP/1 client. Messages read while waiting for something else are kept, in order, for later calls.
pub struct Client {
    ws: Ws,
    stash: VecDeque<(ServerMessage, Value)>,
    /// Deadline of one wait.
    pub deadline: Duration,
}

impl Client {
    /// Connects to `d` with its token.
    pub async fn connect(d: &Daemon) -> Client {
        Client::try_connect(&d.url(), Some(d.token()), &[])
            .await
            .unwrap_or_else(|e| panic!("cannot connect to {}: {e}", d.describe()))
    }

    /// Connects with the given bearer token (none: no `Authorization`) and extra upgrade headers.
    pub async fn try_connect(
        url: &str,
        token: Option<&str>,
        headers: &[(&'static str, &str)],
    ) -> Result<Client, tungstenite::Error> {
        let mut req = url.into_client_request()?;
        if let Some(t) = token {
            req.headers_mut().insert(
                "Authorization",
                HeaderValue::from_str(&format!("Bearer {t}")).unwrap(),
            );
        }
        for (k, v) in headers {
            req.headers_mut()
                .insert(*k, HeaderValue::from_str(v).unwrap());
        }
        let (ws, _) = tokio::time::timeout(
            Duration::from_secs(10),
            // No Nagle: frames sent back to back must not wait for the server's delayed ACK.
            tokio_tungstenite::connect_async_with_config(req, None, true),
        )
        .await
        .map_err(|_| tungstenite::Error::Io(std::io::Error::other("connect timed out")))??;
        Ok(Client {
            ws,
            stash: VecDeque::new(),
            deadline: CLIENT_DEADLINE,
        })
    }

    /// Sends a JSON message as one text frame.
    pub async fn send_json(&mut self, v: &Value) {
        self.send(Message::text(v.to_string())).await;
    }

    /// Sends any frame.
    pub async fn send(&mut self, m: Message) {
        self.ws.send(m).await.expect("send a frame");
    }

    /// Sends several JSON messages in one write, so the server reads them together.
    pub async fn send_all(&mut self, msgs: &[Value]) {
        for m in msgs {
            self.ws
                .feed(Message::text(m.to_string()))
                .await
                .expect("queue a frame");
        }
        self.ws.flush().await.expect("send frames");
    }

    /// Sends a `cancel`.
    pub async fn cancel(&mut self, id: &str) {
        self.send_json(&cancel_json(id)).await;
    }

    /// The next WebSocket frame (WebSocket-level pings and pongs skipped), or `None` after `within`. A closed
    /// connection gives `Some(Err(ConnectionClosed))` or `Some(Ok(Close))`.
    pub async fn next_frame(
        &mut self,
        within: Duration,
    ) -> Option<Result<Message, tungstenite::Error>> {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            match tokio::time::timeout_at(deadline, self.ws.next()).await {
                Err(_) => return None,
                Ok(None) => return Some(Err(tungstenite::Error::ConnectionClosed)),
                Ok(Some(Ok(Message::Ping(_) | Message::Pong(_)))) => continue,
                Ok(Some(r)) => return Some(r),
            }
        }
    }

    /// Parses one server text frame, checking the envelope (spec section 2: `v` 1, `ts` UTC with milliseconds).
    pub fn parse(text: &str) -> (ServerMessage, Value) {
        let env = protocol::parse_server_envelope(text)
            .unwrap_or_else(|e| panic!("server frame does not parse ({e}): {text}"));
        assert_eq!(env.v, 1, "v of {text}");
        if let Err(e) = protocol::parse_ts(&env.ts) {
            panic!("ts of a server message is not UTC ISO 8601 with milliseconds ({e}): {text}");
        }
        let raw: Value = serde_json::from_str(text).unwrap();
        check_vocabulary(&raw);
        (env.message, raw)
    }

    async fn read(&mut self, deadline: tokio::time::Instant, what: &str) -> (ServerMessage, Value) {
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        match self.next_frame(left).await {
            None => panic!(
                "timed out waiting for {what}; unclaimed messages: {:?}",
                self.stash.iter().map(|(m, _)| m).collect::<Vec<_>>()
            ),
            Some(Ok(Message::Text(t))) => Client::parse(t.as_str()),
            Some(other) => panic!(
                "expected a text frame while waiting for {what}, got {other:?}; unclaimed messages: {:?}",
                self.stash.iter().map(|(m, _)| m).collect::<Vec<_>>()
            ),
        }
    }

    /// The next message (kept ones first).
    pub async fn next(&mut self) -> ServerMessage {
        self.next_raw().await.0
    }

    /// The next message with its JSON.
    pub async fn next_raw(&mut self) -> (ServerMessage, Value) {
        if let Some(m) = self.stash.pop_front() {
            return m;
        }
        let deadline = tokio::time::Instant::now() + self.deadline;
        self.read(deadline, "the next message").await
    }

    /// Messages kept so far and not claimed.
    pub fn unclaimed(&self) -> Vec<ServerMessage> {
        self.stash.iter().map(|(m, _)| m.clone()).collect()
    }

    /// Waits until a message matching `pred` has arrived and returns a copy; it stays kept (a later
    /// [`collect`](Self::collect) still sees it in order).
    pub async fn observe(
        &mut self,
        what: &str,
        pred: impl Fn(&ServerMessage) -> bool,
    ) -> ServerMessage {
        if let Some((m, _)) = self.stash.iter().find(|(m, _)| pred(m)) {
            return m.clone();
        }
        let deadline = tokio::time::Instant::now() + self.deadline;
        loop {
            let (m, raw) = self.read(deadline, what).await;
            let hit = pred(&m);
            self.stash.push_back((m.clone(), raw));
            if hit {
                return m;
            }
        }
    }

    /// Waits until a message matching `pred` has arrived and removes it from the kept ones.
    pub async fn take(
        &mut self,
        what: &str,
        pred: impl Fn(&ServerMessage) -> bool,
    ) -> (ServerMessage, Value) {
        if let Some(i) = self.stash.iter().position(|(m, _)| pred(m)) {
            return self.stash.remove(i).unwrap();
        }
        let deadline = tokio::time::Instant::now() + self.deadline;
        loop {
            let (m, raw) = self.read(deadline, what).await;
            if pred(&m) {
                return (m, raw);
            }
            self.stash.push_back((m, raw));
        }
    }

    /// Takes the next `error` (with any id or none).
    pub async fn take_error(&mut self) -> (ErrorMessage, Value) {
        match self
            .take("an error", |m| matches!(m, ServerMessage::Error(_)))
            .await
        {
            (ServerMessage::Error(e), raw) => (e, raw),
            _ => unreachable!(),
        }
    }

    /// Sends a `ping` and waits for the `pong`.
    pub async fn ping(&mut self) -> Pong {
        self.send_json(&ping_json()).await;
        match self
            .take("pong", |m| matches!(m, ServerMessage::Pong(_)))
            .await
        {
            (ServerMessage::Pong(p), _) => p,
            _ => unreachable!(),
        }
    }

    /// Collects execution `id` (kept messages first) until its terminal message.
    pub async fn collect(&mut self, id: &str) -> Collected {
        let mut c = Collected::new(id);
        self.collect_into(&mut c).await;
        c
    }

    /// Goes on collecting into `c` (kept messages first) until its terminal message.
    pub async fn collect_into(&mut self, c: &mut Collected) {
        let id = c.id.clone();
        let id = id.as_str();
        if c.is_done() {
            return;
        }
        let mut i = 0;
        while i < self.stash.len() {
            if self.stash[i].0.id() == Some(id) {
                let (m, raw) = self.stash.remove(i).unwrap();
                c.push(m, raw);
                if c.is_done() {
                    return;
                }
            } else {
                i += 1;
            }
        }
        let deadline = tokio::time::Instant::now() + self.deadline;
        loop {
            let what = format!("the end of execution {id:?} (so far: {:?})", c.kinds());
            let (m, raw) = self.read(deadline, &what).await;
            if m.id() == Some(id) {
                c.push(m, raw);
                if c.is_done() {
                    return;
                }
            } else {
                self.stash.push_back((m, raw));
            }
        }
    }

    /// Sends `exec`, collects it to the end and checks the order of its messages.
    pub async fn run(&mut self, exec: Value) -> Collected {
        let c = self.send_and_collect(exec).await;
        c.check_sequence();
        c
    }

    /// [`run`](Self::run), asserting that the program ran to completion (with the whole exchange on failure):
    /// [`Collected::check_completed`].
    pub async fn run_completed(&mut self, exec: Value) -> Collected {
        let c = self.send_and_collect(exec).await;
        c.check_completed();
        c
    }

    /// Sends `exec` and collects it to the end.
    async fn send_and_collect(&mut self, exec: Value) -> Collected {
        let id = exec["id"].as_str().expect("execute has an id").to_owned();
        self.send_json(&exec).await;
        self.collect(&id).await
    }

    /// The connection is still usable: a `ping` gets its `pong`.
    pub async fn assert_usable(&mut self) {
        let _ = self.ping().await;
    }
}

/// Predicate: a message of execution `id` of the given kind (see [`kind`]).
pub fn is(id: &str, k: &str) -> impl Fn(&ServerMessage) -> bool {
    let id = id.to_owned();
    let k = k.to_owned();
    move |m| m.id() == Some(id.as_str()) && kind(m) == k
}

/// Predicate: stdout of execution `id` (so far, in this one chunk) containing `needle`.
pub fn stdout_contains(id: &str, needle: &str) -> impl Fn(&ServerMessage) -> bool {
    let id = id.to_owned();
    let needle = needle.to_owned();
    move |m| match m {
        ServerMessage::Stdout(c) => {
            c.id == id && String::from_utf8_lossy(&c.decode().unwrap_or_default()).contains(&needle)
        }
        _ => false,
    }
}

/// Checks the wire spelling of a server message against the spec's words (section 4), independently of the
/// protocol crate (which both writes and reads them, so a misspelling there would go unnoticed).
pub fn check_vocabulary(raw: &Value) {
    let word = |field: &str, allowed: &[&str]| {
        let v = raw[field]
            .as_str()
            .unwrap_or_else(|| panic!("{field} is a string: {raw}"));
        assert!(
            allowed.contains(&v),
            "{field} {v:?} is not one of the spec's {allowed:?}: {raw}"
        );
    };
    word(
        "type",
        &[
            "ack",
            "status",
            "stdout",
            "stderr",
            "result",
            "error",
            "pong",
            // extension tool_calls
            "tool_call",
        ],
    );
    match raw["type"].as_str() {
        Some("status") => word(
            "status",
            &[
                "running",
                "completed",
                "failed",
                "timeout",
                "oom",
                "cancelled",
            ],
        ),
        Some("result") => {
            word(
                "reason",
                &[
                    "exited",
                    "signaled",
                    "timeout",
                    "oom",
                    "output_limit",
                    "cancelled",
                ],
            );
            assert!(
                raw.get("exit_code").is_some(),
                "result always carries exit_code: {raw}"
            );
        }
        Some("error") => word(
            "code",
            &[
                "INVALID_REQUEST",
                "LANGUAGE_NOT_SUPPORTED",
                "UNKNOWN_EXECUTION",
                "TIMEOUT",
                "OOM",
                "OUTPUT_LIMIT",
                "SANDBOX_OVERLOADED",
                "INTERNAL_ERROR",
                "NETWORK_ERROR",
            ],
        ),
        Some("stdout" | "stderr") => {
            assert!(raw["data"].is_string(), "{raw}");
            if let Some(enc) = raw.get("encoding") {
                assert!(enc == "base64" || enc == "utf8", "{raw}");
            }
        }
        _ => {}
    }
    if raw["type"] != "pong" && raw["type"] != "error" {
        assert!(
            raw["id"].is_string(),
            "execution messages carry an id: {raw}"
        );
    }
}

/// The `retryable` column of the spec's error table (section 4), written out here rather than taken from the
/// protocol crate, so a wrong table there is caught.
pub fn spec_retryable(code: ErrorCode) -> bool {
    match code {
        ErrorCode::InvalidRequest
        | ErrorCode::LanguageNotSupported
        | ErrorCode::UnknownExecution
        | ErrorCode::Timeout
        | ErrorCode::Oom
        | ErrorCode::OutputLimit => false,
        ErrorCode::SandboxOverloaded | ErrorCode::InternalError | ErrorCode::NetworkError => true,
    }
}

/// Asserts an `error` is `code`, with `retryable` as the spec's table says, and echoes `id` (or has none).
pub fn assert_error(e: &ErrorMessage, raw: &Value, code: ErrorCode, id: Option<&str>) {
    assert_eq!(e.code, code, "error code: {raw}");
    assert_eq!(
        e.retryable,
        spec_retryable(code),
        "retryable of {code}: {raw}"
    );
    assert_eq!(raw["retryable"], spec_retryable(code), "{raw}");
    assert_eq!(e.id.as_deref(), id, "error id: {raw}");
    if id.is_none() {
        assert!(
            raw.get("id").is_none(),
            "an error about a frame without usable id has none: {raw}"
        );
    }
    assert!(!e.message.is_empty(), "error message: {raw}");
}

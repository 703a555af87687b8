//! What the harnesses that run real `sandboxd` processes share: a free port, the config every test daemon starts
//! from, starting the binary with its output in log files, waiting until it serves (and trying another port
//! when the chosen one was taken meanwhile), stopping it, and polling a condition against a deadline.
//!
//! Each harness keeps its own `Daemon` type (what it asks of a daemon differs: the client's tests restart one on
//! the same port, the daemon's suite inspects its mounts and state); those types are built from these pieces.

use std::ffi::OsStr;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use nix::unistd::Pid;
use protocol::Limits;
use serde_json::{json, Value};

/// How often [`wait_until`] checks.
pub const POLL_INTERVAL: Duration = Duration::from_millis(20);
/// How long [`stop`] waits after SIGTERM before it kills.
pub const EXIT_DEADLINE: Duration = Duration::from_secs(15);
/// How many ports [`launch_on_free_port`] tries.
const PORT_ATTEMPTS: u32 = 5;

/// A TCP port nothing listens on right now.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .unwrap_or_else(|e| panic!("bind 127.0.0.1:0: {e}"))
        .port()
}

/// Polls `check` every [`POLL_INTERVAL`] until it returns `Ok`, or panics after `deadline` with its last `Err` (what
/// was still wrong).
pub async fn wait_until<T, F, Fut>(what: &str, deadline: Duration, check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, String>>,
{
    poll_until(what, deadline, POLL_INTERVAL, check).await
}

/// [`wait_until`], checking every `every`.
pub async fn poll_until<T, F, Fut>(
    what: &str,
    deadline: Duration,
    every: Duration,
    mut check: F,
) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, String>>,
{
    let start = Instant::now();
    loop {
        match check().await {
            Ok(v) => return v,
            Err(last) => {
                if start.elapsed() > deadline {
                    panic!("timed out after {deadline:?} waiting for {what}; last state: {last}");
                }
            }
        }
        tokio::time::sleep(every).await;
    }
}

/// The uid base of the `n`th daemon of this test process in a region starting at `region`: 64 uids per daemon,
/// apart from those of other daemons of this process (128 of them) and of other test processes running at once.
pub fn uid_base(region: u32, n: u32) -> u32 {
    region + (std::process::id() % 20_000) * 8192 + (n % 128) * 64
}

/// The settings every test daemon's config has.
#[derive(Debug, Clone)]
pub struct DaemonConfig {
    /// Listen port on 127.0.0.1.
    pub port: u16,
    /// `state_dir`.
    pub state_dir: PathBuf,
    /// The one token in `auth.tokens`.
    pub token: String,
    /// `capacity.max_concurrent`.
    pub max_concurrent: usize,
    /// `capacity.max_queue`.
    pub max_queue: usize,
    /// `limits.max`.
    pub max_limits: Limits,
    /// `shutdown_grace_ms`.
    pub shutdown_grace_ms: u64,
    /// `sandbox.cgroup_parent`.
    pub cgroup_parent: String,
    /// `sandbox.uid_base`.
    pub uid_base: u32,
    /// `pool.size`.
    pub pool_size: usize,
}

impl DaemonConfig {
    /// The config as JSON (add to it with [`crate::fsp::merge`]).
    pub fn to_json(&self) -> Value {
        json!({
            "listen": format!("127.0.0.1:{}", self.port),
            "state_dir": self.state_dir,
            "auth": {"tokens": [self.token]},
            "capacity": {"max_concurrent": self.max_concurrent, "max_queue": self.max_queue},
            "limits": {"max": self.max_limits},
            "shutdown_grace_ms": self.shutdown_grace_ms,
            "sandbox": {"cgroup_parent": self.cgroup_parent, "uid_base": self.uid_base},
            "pool": {"size": self.pool_size},
        })
    }
}

/// Writes `config` to `dir/config.yaml` (YAML is a superset of JSON) and returns its path.
pub fn write_config(dir: &Path, config: &Value) -> PathBuf {
    let path = dir.join("config.yaml");
    std::fs::write(&path, format!("{config:#}"))
        .unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
    path
}

/// Starts `binary` with `args`, stdin closed and stdout and stderr appended to `stdout.log` and `stderr.log` in
/// `log_dir`; `SANDBOXD_TOKEN` and `SANDBOXD_LOG` of the test's environment are not passed on.
pub fn spawn(binary: &Path, args: &[impl AsRef<OsStr>], log_dir: &Path) -> Child {
    let log = |name: &str| {
        let path = log_dir.join(name);
        std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .unwrap_or_else(|e| panic!("open {}: {e}", path.display()))
    };
    Command::new(binary)
        .args(args)
        .env_remove("SANDBOXD_TOKEN")
        .env_remove("SANDBOXD_LOG")
        .stdin(Stdio::null())
        .stdout(log("stdout.log"))
        .stderr(log("stderr.log"))
        .spawn()
        .unwrap_or_else(|e| panic!("spawn {}: {e}", binary.display()))
}

/// What a daemon started by [`spawn`] wrote to stderr (its log) so far.
pub fn log(log_dir: &Path) -> String {
    std::fs::read_to_string(log_dir.join("stderr.log")).unwrap_or_default()
}

/// Waits until `serving` says the daemon serves: `Err` with its log when it exits first or does not serve within
/// `deadline`. `serving` is asked every `every`.
pub async fn wait_serving(
    child: &mut Child,
    log_dir: &Path,
    deadline: Duration,
    every: Duration,
    mut serving: impl AsyncFnMut() -> bool,
) -> Result<(), String> {
    let start = Instant::now();
    loop {
        if let Ok(Some(status)) = child.try_wait() {
            return Err(format!(
                "sandboxd exited during start-up with {status}; log:\n{}",
                log(log_dir)
            ));
        }
        if serving().await {
            return Ok(());
        }
        if start.elapsed() > deadline {
            return Err(format!(
                "sandboxd not serving within {deadline:?}; log:\n{}",
                log(log_dir)
            ));
        }
        tokio::time::sleep(every).await;
    }
}

/// Starts a daemon on a free port: `launch` starts one on the port it is given and waits until it serves (`Err`
/// with its log when it does not). A free port may be taken by someone else before the daemon binds it; then the
/// daemon is dropped and another port tried, five at most. Any other failure panics.
pub async fn launch_on_free_port<D>(
    mut launch: impl AsyncFnMut(u16) -> (D, Result<(), String>),
) -> D {
    let mut attempt = 0;
    loop {
        attempt += 1;
        let port = free_port();
        match launch(port).await {
            (d, Ok(())) => return d,
            (_, Err(e)) if attempt < PORT_ATTEMPTS && e.contains("cannot listen") => {
                eprintln!("test daemon: port {port} was taken; trying another one");
            }
            (_, Err(e)) => panic!("{e}"),
        }
    }
}

/// Waits (polling) for `child` to exit; `None` if it is still running after `deadline`.
pub fn wait_exit(child: &mut Child, deadline: Duration) -> Option<ExitStatus> {
    let start = Instant::now();
    loop {
        if let Ok(Some(s)) = child.try_wait() {
            return Some(s);
        }
        if start.elapsed() > deadline {
            return None;
        }
        std::thread::sleep(POLL_INTERVAL);
    }
}

/// Stops a running daemon: SIGTERM, then SIGKILL when it has not exited within [`EXIT_DEADLINE`] (said on
/// stderr). Reaps it either way; does nothing to one that already exited.
pub fn stop(child: &mut Child) {
    if !matches!(child.try_wait(), Ok(None)) {
        return;
    }
    let pid = child.id() as i32;
    let _ = nix::sys::signal::kill(Pid::from_raw(pid), Signal::SIGTERM);
    if wait_exit(child, EXIT_DEADLINE).is_none() {
        eprintln!("test daemon: sandboxd {pid} ignored SIGTERM for {EXIT_DEADLINE:?}; killing it");
        let _ = child.kill();
        let _ = child.wait();
    }
}

/// When the test is failing (unwinding), prints the daemon's log, headed by `what` (which daemon).
pub fn print_log_if_failing(what: &str, log_dir: &Path) {
    if std::thread::panicking() {
        eprintln!(
            "----- {what} log -----\n{}----- end of log -----",
            log(log_dir)
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_takes_extra_settings() {
        let c = DaemonConfig {
            port: 7,
            state_dir: PathBuf::from("/s"),
            token: "t".into(),
            max_concurrent: 2,
            max_queue: 3,
            max_limits: Limits {
                timeout_ms: 1,
                memory_mb: 2,
                cpu_shares: 3,
                max_output_bytes: 4,
                pids_max: 5,
                disk_mb: 6,
                cpu_cores: protocol::CpuCores::new(0.25),
            },
            shutdown_grace_ms: 1000,
            cgroup_parent: "p".into(),
            uid_base: 5,
            pool_size: 0,
        };
        let v = crate::fsp::with(
            c.to_json(),
            json!({"pool": {"size": 1}, "agents": {"max_sandboxes": 4}}),
        );
        assert_eq!(v["listen"], "127.0.0.1:7");
        assert_eq!(v["auth"]["tokens"], json!(["t"]));
        assert_eq!(v["pool"]["size"], 1);
        assert_eq!(v["agents"]["max_sandboxes"], 4);
        assert_eq!(
            v["limits"]["max"],
            json!({"timeout_ms": 1, "memory_mb": 2, "cpu_shares": 3, "max_output_bytes": 4, "pids_max": 5,
                   "disk_mb": 6, "cpu_cores": 0.25})
        );
    }

    #[test]
    fn spawn_logs_and_stop_reaps() {
        let dir = std::env::temp_dir().join(format!("test-support-spawn-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut child = spawn(
            Path::new("sh"),
            &["-c", "echo started >&2; exec sleep 30"],
            &dir,
        );
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap();
        let logged = rt.block_on(wait_serving(
            &mut child,
            &dir,
            Duration::from_secs(10),
            POLL_INTERVAL,
            async || log(&dir).contains("started"),
        ));
        stop(&mut child);
        let exited = child.try_wait().unwrap();
        let mut quick = spawn(Path::new("sh"), &["-c", "echo bye >&2; exit 3"], &dir);
        let early = rt.block_on(wait_serving(
            &mut quick,
            &dir,
            Duration::from_secs(10),
            POLL_INTERVAL,
            async || false,
        ));
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(logged, Ok(()));
        assert!(exited.is_some_and(|s| !s.success()), "{exited:?}");
        let early = early.unwrap_err();
        assert!(
            early.contains("exited during start-up") && early.contains("bye"),
            "{early}"
        );
    }
}

//! Real sandboxd daemons for the client's tests and bench: each with its own temp config, port, state directory,
//! cgroup parent and uid range (the approach of `sandboxd/tests/suite/harness.rs`), killable with SIGKILL and
//! restartable on the same port and state.
//!
//! The daemon binary is `$SANDBOXD_BIN`, else `sandboxd` in the target profile directory of the running
//! executable (`target/debug/sandboxd` for tests; `cargo test --workspace` builds it, `cargo build -p sandboxd`
//! does too). When it is missing, or when not root, a test says `SKIPPED` loudly, and fails when `CI` is set.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Child;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use nix::unistd::Pid;
use protocol::Limits;
use serde_json::json;
use test_support::daemon::{self, DaemonConfig};
use test_support::procs;

/// How long a daemon may take to become healthy.
const READY_DEADLINE: Duration = Duration::from_secs(30);

static NEXT: AtomicU32 = AtomicU32::new(0);

pub use test_support::cannot_run;
pub use test_support::cgroups::remove_cgroup_parent;
// The benches include this file too, and use neither.
#[allow(unused_imports)]
pub use test_support::daemon::{free_port, wait_until};

/// The sandboxd binary, if it exists.
pub fn sandboxd_binary() -> Result<PathBuf, String> {
    workspace_binary("sandboxd", "SANDBOXD_BIN")
}

/// The `sandboxctl` binary (its own crate, so not a `CARGO_BIN_EXE_` of this one): `$SANDBOXCTL_BIN`, else next
/// to the running test. A test that needs it has a daemon already, so a missing one is a failure, not a skip.
pub fn sandboxctl() -> PathBuf {
    workspace_binary("sandboxctl", "SANDBOXCTL_BIN").unwrap_or_else(|e| panic!("{e}"))
}

/// For a test of `sandboxctl` against a fake server (no daemon): whether the binary is there, after saying why not
/// (panics on CI, where `cargo test --workspace` builds it).
pub fn require_sandboxctl(test: &str) -> bool {
    match workspace_binary("sandboxctl", "SANDBOXCTL_BIN") {
        Ok(_) => true,
        Err(e) => {
            cannot_run(test, &e);
            false
        }
    }
}

/// Binary `name` of this workspace: `$env_var`, else in the target profile directory of the running executable.
fn workspace_binary(name: &str, env_var: &str) -> Result<PathBuf, String> {
    if let Some(p) = std::env::var_os(env_var) {
        let p = PathBuf::from(p);
        return if p.is_file() {
            Ok(p)
        } else {
            Err(format!("{env_var}={} does not exist", p.display()))
        };
    }
    let exe = std::env::current_exe().map_err(|e| format!("current_exe: {e}"))?;
    // target/<profile>/deps/<test> or target/<profile>/examples/<example> or target/<profile>/<bench>.
    let mut dirs = Vec::new();
    if let Some(parent) = exe.parent() {
        dirs.push(parent.to_owned());
        if let Some(grand) = parent.parent() {
            dirs.push(grand.to_owned());
        }
    }
    for dir in &dirs {
        let candidate = dir.join(name);
        if candidate.is_file() {
            return Ok(candidate);
        }
    }
    Err(format!(
        "no {name} binary next to {} (run `cargo build -p {name}` first, or `cargo test --workspace`, \
         which builds it; or set {env_var})",
        exe.display()
    ))
}

/// For a test that needs a real daemon: the binary, or `None` after saying why (panics on CI).
pub fn require_daemon(test: &str) -> Option<PathBuf> {
    if !test_support::require_root(test, "") {
        return None;
    }
    match sandboxd_binary() {
        Ok(p) => Some(p),
        Err(e) => {
            cannot_run(test, &e);
            None
        }
    }
}

/// A daemon's configuration knobs.
#[derive(Debug, Clone)]
pub struct DaemonOpts {
    /// `capacity.max_concurrent` (at most 64: the uid range per daemon).
    pub max_concurrent: usize,
    /// `capacity.max_queue`.
    pub max_queue: usize,
    /// `limits.max.max_output_bytes`.
    pub max_output_bytes: u64,
    /// `limits.max.timeout_ms`.
    pub max_timeout_ms: u64,
    /// `agents.max_sandboxes` (with `max_concurrent`, at most 64: the uid range per daemon).
    pub max_sandboxes: usize,
    /// Run the daemon in this network namespace (`/run/netns/<name>`, entered with `nsenter --net`, so its mount
    /// namespace and cgroups stay the host's), listening on `host`.
    pub netns: Option<String>,
    /// The listen address (default 127.0.0.1).
    pub host: String,
    /// The accepted token (default: a fresh one per daemon).
    pub token: Option<String>,
    /// `pool.size`: warm containers (default 0: every process of the uid range belongs to a running execution,
    /// which some tests rely on; the daemon's own suite covers the pool).
    pub pool_size: usize,
    /// `agents.live_restore`.
    pub live_restore: bool,
    /// Start the daemon in a mount namespace of its own (`unshare --mount --propagation slave`), as a systemd unit
    /// with `ProtectSystem=` or `PrivateTmp=` does.
    pub private_mounts: bool,
    /// Merged into the configuration last (see [`test_support::fsp::merge`]).
    pub extra: Option<serde_json::Value>,
}

impl Default for DaemonOpts {
    fn default() -> Self {
        DaemonOpts {
            max_concurrent: 8,
            max_queue: 32,
            max_output_bytes: 16 << 20,
            max_timeout_ms: 120_000,
            max_sandboxes: 16,
            netns: None,
            host: "127.0.0.1".into(),
            token: None,
            pool_size: 0,
            live_restore: false,
            private_mounts: false,
            extra: None,
        }
    }
}

/// A running sandboxd. Dropping it stops it and removes its cgroups.
pub struct Daemon {
    binary: PathBuf,
    child: Option<Child>,
    dir: tempfile::TempDir,
    config: PathBuf,
    netns: Option<String>,
    private_mounts: bool,
    /// Listen address.
    pub host: String,
    /// Listen port.
    pub port: u16,
    /// An accepted token.
    pub token: String,
    /// `sandbox.cgroup_parent`.
    pub cgroup_parent: String,
    /// `sandbox.uid_base`.
    pub uid_base: u32,
    /// `capacity.max_concurrent`.
    pub max_concurrent: usize,
    starts: u32,
}

impl Daemon {
    /// Starts a daemon and waits until it serves.
    pub async fn start(binary: &Path, opts: DaemonOpts) -> Daemon {
        assert!(
            2 * opts.max_concurrent + opts.pool_size + 4 + opts.max_sandboxes <= 64,
            "uid ranges are 64 wide (2 per slot, 1 per pooled container, 4 spare, 1 per sandbox)"
        );
        let n = NEXT.fetch_add(1, Ordering::SeqCst);
        let pid = std::process::id();
        // A uid region apart from the daemon's own suite (which starts at 1,000,000).
        let uid_base = daemon::uid_base(200_000_000, n);
        let cgroup_parent = format!("sandboxd-client-test-{pid}-{n}");
        let token = opts
            .token
            .clone()
            .unwrap_or_else(|| format!("client-test-{pid}-{n}-{:016x}", rand::random::<u64>()));
        daemon::launch_on_free_port(async |port| {
            let dir = tempfile::Builder::new()
                .prefix("sandboxd-client-test-")
                .tempdir()
                .expect("tempdir");
            let config = DaemonConfig {
                port,
                state_dir: dir.path().join("state"),
                token: token.clone(),
                max_concurrent: opts.max_concurrent,
                max_queue: opts.max_queue,
                max_limits: Limits {
                    timeout_ms: opts.max_timeout_ms,
                    memory_mb: 1024,
                    cpu_shares: 1024,
                    max_output_bytes: opts.max_output_bytes,
                    pids_max: 256,
                    disk_mb: 256,
                    cpu_cores: protocol::CpuCores::new(2.0),
                },
                shutdown_grace_ms: 1000,
                cgroup_parent: cgroup_parent.clone(),
                uid_base,
                pool_size: opts.pool_size,
            };
            let mut config = test_support::fsp::with(
                config.to_json(),
                json!({"agents": {"max_sandboxes": opts.max_sandboxes,
                                  "live_restore": opts.live_restore},
                       "listen": format!("{}:{port}", opts.host)}),
            );
            if let Some(extra) = &opts.extra {
                test_support::fsp::merge(&mut config, extra.clone());
            }
            let config_path = daemon::write_config(dir.path(), &config);
            let mut d = Daemon {
                binary: binary.to_owned(),
                child: None,
                dir,
                config: config_path,
                netns: opts.netns.clone(),
                private_mounts: opts.private_mounts,
                host: opts.host.clone(),
                port,
                token: token.clone(),
                cgroup_parent: cgroup_parent.clone(),
                uid_base,
                max_concurrent: opts.max_concurrent,
                starts: 0,
            };
            d.spawn();
            let ready = d.wait_ready().await;
            (d, ready)
        })
        .await
    }

    fn spawn(&mut self) {
        self.starts += 1;
        self.child = Some(match &self.netns {
            // nsenter execs the daemon: the child's pid is the daemon's.
            Some(netns) => {
                let net = PathBuf::from(format!("--net=/run/netns/{netns}"));
                let args = [&net, &self.binary, Path::new("--config"), &self.config];
                daemon::spawn(Path::new("nsenter"), &args, self.dir.path())
            }
            // unshare execs the daemon too.
            None if self.private_mounts => {
                let args = [
                    Path::new("--mount"),
                    Path::new("--propagation"),
                    Path::new("slave"),
                    &self.binary,
                    Path::new("--config"),
                    &self.config,
                ];
                daemon::spawn(Path::new("unshare"), &args, self.dir.path())
            }
            None => {
                let args = [Path::new("--config"), &self.config];
                daemon::spawn(&self.binary, &args, self.dir.path())
            }
        });
    }

    /// Waits until `/healthz` answers 200 and the token is accepted (so it is this daemon that answers).
    async fn wait_ready(&mut self) -> Result<(), String> {
        let (url, token) = (self.url(), self.token.clone());
        let Some(child) = &mut self.child else {
            return Err("sandboxd is not running".to_owned());
        };
        daemon::wait_serving(
            child,
            self.dir.path(),
            READY_DEADLINE,
            daemon::POLL_INTERVAL,
            async || {
                let healthy = client::health(&url, None, Duration::from_secs(2))
                    .await
                    .is_ok_and(|h| h.status == 200);
                let options = client::ConnectOptions::new(url.clone()).token(token.clone());
                healthy && client::Connection::connect(options).await.is_ok()
            },
        )
        .await
    }

    /// `<tempdir>/state`.
    pub fn state_dir(&self) -> PathBuf {
        self.dir.path().join("state")
    }

    /// `http://HOST:PORT`.
    pub fn http_base(&self) -> String {
        format!("http://{}:{}", self.host, self.port)
    }

    /// `ws://HOST:PORT/ws`.
    pub fn url(&self) -> String {
        format!("ws://{}:{}/ws", self.host, self.port)
    }

    /// The daemon's pid, while it runs.
    pub fn pid(&self) -> Option<i32> {
        self.child.as_ref().map(|c| c.id() as i32)
    }

    /// The uids container processes run as.
    pub fn uid_range(&self) -> std::ops::Range<u32> {
        self.uid_base..self.uid_base + 2 * self.max_concurrent as u32
    }

    /// Runs `sandboxctl` against this daemon (its URL and token) with `args`: exit code, stdout, stderr.
    pub fn sandboxctl(&self, args: &[&str]) -> (Option<i32>, String, String) {
        let out = std::process::Command::new(sandboxctl())
            .args(["--url", &self.url(), "--token", &self.token])
            .args(args)
            .output()
            .unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    }

    /// The daemon's log so far (every start).
    pub fn log(&self) -> String {
        daemon::log(self.dir.path())
    }

    /// SIGKILLs the daemon (a crash), reaps it, and waits until its helper, which dies with it, is gone. A helper
    /// that outlives its daemon for 5 s is reported and killed.
    pub fn kill_hard(&mut self) {
        let Some(mut child) = self.child.take() else {
            return;
        };
        let pid = child.id() as i32;
        let helpers: Vec<i32> = children_of(pid);
        let _ = nix::sys::signal::kill(Pid::from_raw(pid), Signal::SIGKILL);
        let _ = child.wait();
        let start = Instant::now();
        while helpers.iter().any(|h| procs::is_alive(*h)) {
            if start.elapsed() > Duration::from_secs(5) {
                eprintln!(
                    "daemon: helper(s) {helpers:?} outlived their SIGKILLed daemon {pid} by 5 s; killing them"
                );
                for h in &helpers {
                    let _ = nix::sys::signal::kill(Pid::from_raw(*h), Signal::SIGKILL);
                }
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Starts the daemon again on the same port, state directory, cgroup parent, uid range and token; waits until
    /// it serves.
    pub async fn restart(&mut self) {
        assert!(self.child.is_none(), "restart a daemon that is not running");
        self.spawn();
        if let Err(e) = self.wait_ready().await {
            panic!("restart: {e}");
        }
    }

    /// Spawns the daemon again without waiting for it.
    pub fn respawn(&mut self) {
        assert!(self.child.is_none(), "respawn a daemon that is not running");
        self.spawn();
    }

    /// Waits until a respawned daemon serves.
    pub async fn wait_serving(&mut self) {
        if let Err(e) = self.wait_ready().await {
            panic!("{e}");
        }
    }

    /// Stops the daemon with SIGTERM (SIGKILL if it ignores it) and reaps it.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            daemon::stop(&mut child);
        }
    }

    /// Merges `extra` into the configuration of the next (re)start (see [`test_support::fsp::merge`]).
    pub fn patch_config(&mut self, extra: serde_json::Value) {
        let text = std::fs::read_to_string(&self.config).unwrap();
        let mut config: serde_json::Value = serde_json::from_str(&text).unwrap();
        test_support::fsp::merge(&mut config, extra);
        daemon::write_config(self.dir.path(), &config);
    }

    /// Starts the daemon again and waits for it to exit (a start it refuses): its exit status.
    pub fn start_refused(&mut self) -> std::process::ExitStatus {
        assert!(self.child.is_none(), "a daemon is running");
        self.spawn();
        let mut child = self.child.take().unwrap();
        let start = Instant::now();
        loop {
            if let Some(status) = child.try_wait().unwrap() {
                return status;
            }
            if start.elapsed() > READY_DEADLINE {
                self.child = Some(child);
                panic!("the daemon did not refuse to start");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Runs `binary` from the next (re)start on: an upgrade.
    pub fn set_binary(&mut self, binary: &Path) {
        self.binary = binary.to_owned();
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        self.stop();
        daemon::print_log_if_failing(
            &format!("sandboxd ({}:{})", self.host, self.port),
            self.dir.path(),
        );
        remove_cgroup_parent(&self.cgroup_parent);
        // A daemon with live restore pins its mount namespace in the state directory: unpinned, or the directory
        // could not be removed.
        let pin = self.state_dir().join("mntns");
        let _ = nix::mount::umount2(&pin.join("ns"), nix::mount::MntFlags::MNT_DETACH);
        while nix::mount::umount2(&pin, nix::mount::MntFlags::MNT_DETACH).is_ok() {}
    }
}

/// Direct children of `pid`.
pub fn children_of(pid: i32) -> Vec<i32> {
    procs::children_of(pid).iter().map(|p| p.pid).collect()
}

/// Live processes whose real uid is in `uids`.
pub fn processes_with_uid(uids: std::ops::Range<u32>) -> Vec<i32> {
    procs::processes_with_uid(uids)
        .iter()
        .filter(|p| p.is_alive())
        .map(|p| p.pid)
        .collect()
}

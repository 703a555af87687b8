//! The runner of the adversarial suite: every attack goes through a real daemon over FSP/1 as an
//! ordinary execution, while a second connection pings the daemon every 100 ms from its own thread and records how
//! long each `pong` took. After each attack the [`Arena`] checks that the host is unchanged (digests of host files,
//! a canary file outside any sandbox, the daemon binary), that nothing of the execution is left (processes with a
//! uid of the daemon's range, cgroups, scratch mounts, per-execution state), that the daemon is alive, and that a
//! plain `echo ok` still works. The caller then checks that the attack itself was contained (an errno, a status,
//! what the program saw).
//!
//! Denied syscalls are tried from python with `ctypes` ([`PY_SYSCALL`]); the numbers are x86_64's, so the
//! syscall cases say `SKIPPED` elsewhere ([`x86_64_only`]).

use std::fmt::Write as _;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use protocol::ExecStatus;
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

use super::harness::{
    exec_json, proc_info, unique_marker, wait_until, with, Client, Collected, Daemon, DaemonOpts,
};

/// The issue's bound on a `pong` while an attack runs.
pub const PONG_BOUND: Duration = Duration::from_millis(500);
/// How often the watcher pings.
pub const PING_EVERY: Duration = Duration::from_millis(100);
/// How long the execution's leftovers may take to disappear after its `result`.
const CLEANUP_DEADLINE: Duration = Duration::from_secs(15);

/// Python helpers for raw syscalls: `sc(nr, *args)` returns `(return value, errno)`; `errname(e)` the symbol.
pub const PY_SYSCALL: &str = r#"
import ctypes, errno, json, os, sys
_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
def _arg(a):
    return ctypes.c_long(a) if isinstance(a, int) else a
def sc(nr, *args):
    ctypes.set_errno(0)
    r = _libc.syscall(ctypes.c_long(nr), *[_arg(a) for a in args])
    return r, (ctypes.get_errno() if r == -1 else 0)
def errname(e):
    return errno.errorcode.get(e, str(e)) if e else "OK"
"#;

/// Says `SKIPPED` loudly and returns false when not on x86_64: the syscall numbers (and the `int 0x80` machine code)
/// of these attacks are x86_64's. Not a failure on CI ([`test_support::not_applicable`]): the other groups still
/// run there.
pub fn x86_64_only(test: &str) -> bool {
    if cfg!(target_arch = "x86_64") {
        return true;
    }
    test_support::not_applicable(
        test,
        "the syscall numbers of these attacks are x86_64's; add this architecture's",
    );
    false
}

// ---------------------------------------------------------------------------------------------------------------
// Ping watcher
// ---------------------------------------------------------------------------------------------------------------

/// Pings the daemon every [`PING_EVERY`] on its own connection, from its own thread (so the test's own work, e.g.
/// parsing a flood, never delays a measurement).
pub struct PingWatch {
    stop: Arc<AtomicBool>,
    thread: std::thread::JoinHandle<Result<Vec<Duration>, String>>,
}

/// What the watcher measured.
#[derive(Debug, Clone)]
pub struct PingStats {
    /// Pongs received.
    pub count: usize,
    /// The slowest one.
    pub max: Duration,
}

impl PingWatch {
    /// Connects and waits for the first `pong` before returning, so the watch covers the whole attack.
    pub async fn start(d: &Daemon) -> PingWatch {
        let url = d.url();
        let token = d.token().to_owned();
        let stop = Arc::new(AtomicBool::new(false));
        let (ready_tx, ready_rx) = tokio::sync::oneshot::channel::<Result<(), String>>();
        let stop2 = stop.clone();
        let thread = std::thread::Builder::new()
            .name("ping-watch".into())
            .spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .map_err(|e| format!("ping watcher runtime: {e}"))?;
                rt.block_on(watch(url, token, stop2, ready_tx))
            })
            .expect("spawn the ping watcher");
        match tokio::time::timeout(Duration::from_secs(15), ready_rx).await {
            Ok(Ok(Ok(()))) => {}
            Ok(Ok(Err(e))) => panic!("the ping watcher could not start: {e}"),
            Ok(Err(_)) => panic!("the ping watcher died while starting"),
            Err(_) => panic!("the ping watcher got no first pong within 15 s"),
        }
        PingWatch { stop, thread }
    }

    /// Stops the watcher and asserts every `pong` came within [`PONG_BOUND`].
    pub fn finish(self, case: &str) -> PingStats {
        self.stop.store(true, Ordering::SeqCst);
        let lat = match self.thread.join() {
            Ok(Ok(lat)) => lat,
            Ok(Err(e)) => {
                panic!("{case}: the daemon stopped answering ping during the attack: {e}")
            }
            Err(_) => panic!("{case}: the ping watcher panicked"),
        };
        let max = lat.iter().copied().max().unwrap_or_default();
        let slow: Vec<_> = lat.iter().filter(|l| **l > PONG_BOUND).collect();
        assert!(
            slow.is_empty(),
            "{case}: {} of {} pongs took longer than {PONG_BOUND:?} during the attack (slowest {max:?}): {slow:?}",
            slow.len(),
            lat.len()
        );
        PingStats {
            count: lat.len(),
            max,
        }
    }
}

async fn watch(
    url: String,
    token: String,
    stop: Arc<AtomicBool>,
    ready: tokio::sync::oneshot::Sender<Result<(), String>>,
) -> Result<Vec<Duration>, String> {
    let mut ready = Some(ready);
    let fail = |ready: &mut Option<tokio::sync::oneshot::Sender<Result<(), String>>>, e: String| {
        if let Some(r) = ready.take() {
            let _ = r.send(Err(e.clone()));
        }
        Err(e)
    };
    let mut c = match Client::try_connect(&url, Some(&token), &[]).await {
        Ok(c) => c,
        Err(e) => return fail(&mut ready, format!("cannot connect: {e}")),
    };
    let mut lat = Vec::new();
    loop {
        let t0 = tokio::time::Instant::now();
        // A pong that takes 5 s is a failure anyway; give up on it then, so the thread ends.
        match tokio::time::timeout(Duration::from_secs(5), c.ping()).await {
            Ok(_) => lat.push(t0.elapsed()),
            Err(_) => {
                return fail(
                    &mut ready,
                    format!("no pong within 5 s (after {} pongs)", lat.len()),
                )
            }
        }
        if let Some(r) = ready.take() {
            let _ = r.send(Ok(()));
        }
        if stop.load(Ordering::SeqCst) {
            return Ok(lat);
        }
        tokio::time::sleep_until(t0 + PING_EVERY).await;
    }
}

// ---------------------------------------------------------------------------------------------------------------
// The host
// ---------------------------------------------------------------------------------------------------------------

/// Identity of a file cheap enough to take after every attack: a write changes `mtime` (and an attacker able to
/// reset it could write the file, which the full digests at the arena's end catch). Not `ctime`: cargo re-links
/// the binaries of a shared target directory, which changes their link count and so their `ctime`.
#[derive(Debug, Clone, PartialEq, Eq)]
struct FileId {
    dev: u64,
    ino: u64,
    size: u64,
    mtime_ns: (i64, i64),
    mode: u32,
    uid: u32,
}

fn file_id(p: &Path) -> Option<FileId> {
    let m = std::fs::metadata(p).ok()?;
    Some(FileId {
        dev: m.dev(),
        ino: m.ino(),
        size: m.size(),
        mtime_ns: (m.mtime(), m.mtime_nsec()),
        mode: m.mode(),
        uid: m.uid(),
    })
}

/// `sha256sum` of a file (the coreutils binary: the daemon binary is large, and sha2 in a debug build is slow).
pub fn sha256_file(p: &Path) -> String {
    let out = std::process::Command::new("sha256sum")
        .arg(p)
        .output()
        .unwrap_or_else(|e| panic!("sha256sum {}: {e}", p.display()));
    assert!(out.status.success(), "sha256sum {}: {out:?}", p.display());
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .next()
        .unwrap_or_default()
        .to_owned()
}

fn sha256_small(p: &Path) -> Option<String> {
    std::fs::read(p).ok().map(|b| sha256_hex(&b))
}

/// Hex sha256 of bytes.
pub fn sha256_hex(b: &[u8]) -> String {
    format!("{:x}", Sha256::digest(b))
}

/// Host files an escape would go for: small ones hashed after every attack, large binaries identified by
/// metadata after every attack and hashed when the arena starts and ends.
#[derive(Debug, Clone, PartialEq, Eq)]
struct HostState {
    small: Vec<(PathBuf, Option<String>)>,
    large: Vec<(PathBuf, Option<FileId>)>,
    canary: Option<String>,
    host_name: String,
}

/// Host files hashed after every attack.
const SMALL_HOST_FILES: &[&str] = &[
    "/etc/passwd",
    "/etc/group",
    "/etc/shadow",
    "/etc/hostname",
    "/etc/hosts",
    "/etc/resolv.conf",
];

/// Large host binaries (also hashed in full at the start and end of each arena): the running daemon's own binary
/// (through `/proc/<pid>/exe`, so a rebuild of the target directory during the test does not count), python, sh
/// and node.
fn large_host_files(daemon: i32) -> Vec<PathBuf> {
    let mut v = vec![PathBuf::from(format!("/proc/{daemon}/exe"))];
    for p in ["/usr/bin/python3", "/bin/sh", "/usr/bin/node"] {
        if let Ok(real) = std::fs::canonicalize(p) {
            if !v.contains(&real) {
                v.push(real);
            }
        }
    }
    v
}

impl HostState {
    fn take(canary: &Path, daemon: i32) -> Self {
        HostState {
            small: SMALL_HOST_FILES
                .iter()
                .map(|p| (PathBuf::from(p), sha256_small(Path::new(p))))
                .collect(),
            large: large_host_files(daemon)
                .into_iter()
                .map(|p| {
                    let id = file_id(&p);
                    (p, id)
                })
                .collect(),
            canary: std::fs::read_to_string(canary).ok(),
            host_name: nix::unistd::gethostname()
                .map(|h| h.to_string_lossy().into_owned())
                .unwrap_or_default(),
        }
    }
}

fn full_digests(daemon: i32) -> Vec<(PathBuf, String)> {
    large_host_files(daemon)
        .into_iter()
        .map(|p| {
            let h = sha256_file(&p);
            (p, h)
        })
        .collect()
}

/// Resident memory of a process, KiB (`VmRSS` of `/proc/<pid>/status`); `None` once it is gone.
pub fn vm_rss_kib(pid: i32) -> Option<u64> {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
}

// ---------------------------------------------------------------------------------------------------------------
// The arena
// ---------------------------------------------------------------------------------------------------------------

/// A daemon, a client, and the host as it was before the first attack.
pub struct Arena {
    /// The daemon under attack.
    pub d: Daemon,
    /// The attacker's connection.
    pub c: Client,
    /// The group of attacks (for messages).
    pub group: &'static str,
    /// A file outside any sandbox that no attack may change; its path is given to the attacks that look for it.
    pub canary: PathBuf,
    host: HostState,
    digests: Vec<(PathBuf, String)>,
    next_id: u32,
    /// Cases that were tried and found contained, for the closing summary.
    pub contained: Vec<String>,
    /// Pongs received during attacks, and the slowest.
    pongs: PingStats,
}

impl Arena {
    /// Starts a daemon with `opts` and records the host.
    pub async fn start(group: &'static str, opts: DaemonOpts) -> Arena {
        let d = Daemon::start(opts).await;
        let c = Client::connect(&d).await;
        let canary = d.dir().join(format!("canary-{}", unique_marker()));
        std::fs::write(&canary, format!("canary {}\n", unique_marker())).unwrap();
        let host = HostState::take(&canary, d.pid());
        assert!(host.canary.is_some());
        let digests = full_digests(d.pid());
        Arena {
            d,
            c,
            group,
            canary,
            host,
            digests,
            next_id: 0,
            contained: Vec::new(),
            pongs: PingStats {
                count: 0,
                max: Duration::ZERO,
            },
        }
    }

    /// A fresh execution id for `case`.
    pub fn id(&mut self, case: &str) -> String {
        self.next_id += 1;
        let clean: String = case
            .chars()
            .map(|ch| if ch.is_ascii_alphanumeric() { ch } else { '-' })
            .take(100)
            .collect();
        format!("{clean}-{}", self.next_id)
    }

    /// Starts watching `ping` latency.
    pub async fn watch(&self) -> PingWatch {
        PingWatch::start(&self.d).await
    }

    /// Stops `watch`, asserting every pong came in time, and adds its figures to the arena's.
    pub fn watched(&mut self, watch: PingWatch, case: &str) {
        let s = watch.finish(case);
        self.pongs.count += s.count;
        self.pongs.max = self.pongs.max.max(s.max);
    }

    /// Runs one attack execution (built by `exec` from a fresh id) under the ping watch, then checks the host
    /// ([`Arena::after`]). Returns what the execution produced, for the caller's containment checks.
    pub async fn attack(&mut self, case: &str, exec: impl FnOnce(&str) -> Value) -> Collected {
        let id = self.id(case);
        let watch = self.watch().await;
        let r = self.c.run(exec(&id)).await;
        self.watched(watch, case);
        self.after(case).await;
        r
    }

    /// [`Arena::attack`] of a python program that prints one JSON object; asserts it completed and returns the
    /// object.
    pub async fn attack_py(&mut self, case: &str, code: &str, limits: Value) -> Value {
        let r = self
            .attack(case, |id| {
                with(
                    exec_json(id, "python", code, 60_000, 256),
                    json!({ "limits": limits }),
                )
            })
            .await;
        let out = json_of(case, &r);
        eprintln!("{case}: {out}");
        out
    }

    /// After an attack: every process with a uid of the daemon's range, the execution's cgroups, scratch mounts and
    /// state are gone; host files and the canary are unchanged; the daemon is alive and a plain `echo ok` runs.
    pub async fn after(&mut self, case: &str) {
        let d = &self.d;
        wait_until(
            &format!("{case}: the execution's processes, cgroups, mounts and state to be gone"),
            CLEANUP_DEADLINE,
            || d.leftovers(),
        )
        .await;
        self.assert_host_unchanged(case);
        assert!(
            proc_info(self.d.pid()).is_some_and(|p| p.state != 'Z'),
            "{case}: the daemon died: {}",
            self.d.describe()
        );
        let id = self.id("echo-after");
        let r = self
            .c
            .run(exec_json(&id, "shell", "echo ok", 30_000, 64))
            .await;
        assert_eq!(
            (r.terminal_status(), r.stdout_text().as_str()),
            (Some(ExecStatus::Completed), "ok\n"),
            "{case}: the next execution does not work: {}",
            r.dump()
        );
    }

    /// The host files, the canary and the host name are as they were when the arena started.
    pub fn assert_host_unchanged(&self, case: &str) {
        let now = HostState::take(&self.canary, self.d.pid());
        let mut diff = String::new();
        for ((p, a), (_, b)) in self.host.small.iter().zip(&now.small) {
            if a != b {
                let _ = write!(diff, "\n  {} sha256 {a:?} -> {b:?}", p.display());
            }
        }
        for ((p, a), (_, b)) in self.host.large.iter().zip(&now.large) {
            if a != b {
                let _ = write!(diff, "\n  {} {a:?} -> {b:?}", p.display());
            }
        }
        if self.host.canary != now.canary {
            let _ = write!(
                diff,
                "\n  canary {} {:?} -> {:?}",
                self.canary.display(),
                self.host.canary,
                now.canary
            );
        }
        if self.host.host_name != now.host_name {
            let _ = write!(
                diff,
                "\n  hostname {:?} -> {:?}",
                self.host.host_name, now.host_name
            );
        }
        assert!(diff.is_empty(), "{case}: the host changed:{diff}");
    }

    /// The large binaries hash as they did when the arena started.
    pub fn assert_binaries_unchanged(&self, case: &str) {
        assert_eq!(
            full_digests(self.d.pid()),
            self.digests,
            "{case}: a host binary changed"
        );
    }

    /// Records a contained case.
    pub fn contained(&mut self, case: &str) {
        self.contained.push(case.to_owned());
    }

    /// Final checks (binaries hashed in full) and a one-line summary on stderr.
    pub fn finish(self) {
        self.assert_binaries_unchanged(&format!("{} (end)", self.group));
        eprintln!(
            "attacks {}: {} cases contained ({} pongs during the attacks, slowest {:?}): {:?}",
            self.group,
            self.contained.len(),
            self.pongs.count,
            self.pongs.max,
            self.contained
        );
    }
}

/// The single JSON object a program printed on stdout (the last line that parses), after asserting it completed.
pub fn json_of(case: &str, r: &Collected) -> Value {
    assert_eq!(
        r.terminal_status(),
        Some(ExecStatus::Completed),
        "{case}: the probe did not complete: {}",
        r.dump()
    );
    r.stdout_text()
        .lines()
        .rev()
        .find_map(|l| serde_json::from_str::<Value>(l).ok())
        .unwrap_or_else(|| panic!("{case}: no JSON on stdout: {}", r.dump()))
}

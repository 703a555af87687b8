//! `cargo bench -p sandboxd`: latency and throughput of real daemons over the real protocol on loopback, against a
//! bare `std::process::Command` spawn of the same program, and against crun and bwrap when installed, all measured
//! in the same run, interleaved sample by sample.
//!
//! Two daemons run side by side: one with the warm pool (`pool.size` = `max_concurrent`, the default) and one with
//! `pool.size: 0`, where every execution creates its container when it starts (the cold path, also what an
//! execution gets when the pool is exhausted). Tables:
//! 1. execute→result p50/p95 for shell `true` and python `pass`, and the time to the first stdout byte, with the
//!    project's Rust client: warm, cold, bare, crun, bwrap;
//! 2. the same daemon through a client that is not the project's own (`benches/plain_client.py`, Python
//!    `websockets`), next to the Rust client's figures;
//! 3. executions per second of shell `true` at 1, 4 and 16 in flight, warm and cold, with the pool's hits and
//!    misses (a miss is the cold path taken because no ready container was there), against the bare spawn;
//! 4. the floor of a container per execution: the same spawn in fresh namespaces of its own, then with the seccomp
//!    filters, then with a cgroup leaf too, and nothing else.
//!
//! Needs root (the daemons create containers). Figures, not assertions: nothing here fails on a slow machine.

#![allow(missing_docs, clippy::unwrap_used, clippy::expect_used)]

mod common;
mod floor;
mod sustained;
mod warm;

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use futures_util::{SinkExt, StreamExt};
use serde_json::{json, Value};
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::Message;

const TOKEN: &str = "bench-token-0123456789abcdef";
const SAMPLES: usize = 100;
const THROUGHPUT_RUNS: usize = 400;
const SPARSE_SAMPLES: usize = 30;
const PLAIN_CLIENT_SAMPLES: usize = 80;

struct Daemon {
    /// Stopped when the bench drops it.
    _child: common::Stopped,
    port: u16,
    _dir: tempfile::TempDir,
    /// The cpuacct groups whose usage adds up to the daemon's CPU time: the daemon's own (made here) and its
    /// containers' parent (made by the daemon); `None` without a cgroup v1 cpuacct hierarchy.
    cpu: Option<CpuMeter>,
}

/// CPU time of a daemon, its helpers and all its containers (cgroup v1 `cpuacct.usage`, hierarchical, so a
/// removed container's time stays counted in its parent). On 2 cores throughput is bound by it: 2 s of CPU per
/// second of wall time at most.
struct CpuMeter {
    /// `cpuacct/<parent>-daemon`: the daemon and the helpers it forks.
    daemon: PathBuf,
    /// `cpuacct/<parent>`: the containers.
    containers: PathBuf,
}

impl CpuMeter {
    const ROOT: &'static str = "/sys/fs/cgroup/cpuacct";

    fn new(parent: &str) -> Option<Self> {
        let root = Path::new(Self::ROOT);
        if !root.join("cpuacct.usage").is_file() {
            println!(
                "cpu per execution: left out, no cgroup v1 cpuacct hierarchy at {}",
                Self::ROOT
            );
            return None;
        }
        let daemon = root.join(format!("{parent}-daemon"));
        std::fs::create_dir(&daemon).ok()?;
        Some(Self {
            daemon,
            containers: root.join(parent),
        })
    }

    /// Nanoseconds used so far.
    fn used(&self) -> u64 {
        let read = |d: &Path| -> u64 {
            std::fs::read_to_string(d.join("cpuacct.usage"))
                .ok()
                .and_then(|s| s.trim().parse().ok())
                .unwrap_or(0)
        };
        read(&self.daemon) + read(&self.containers)
    }
}

impl Drop for CpuMeter {
    fn drop(&mut self) {
        // The daemon is stopped first; its helpers leave with it, within moments. The cgroup is ours to remove.
        for _ in 0..100 {
            if std::fs::remove_dir(&self.daemon).is_ok() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        eprintln!("cannot remove {}", self.daemon.display());
    }
}

impl Daemon {
    /// Starts a daemon; `extra` is appended to its config, `n` keeps cgroup parents and uid ranges apart.
    fn start(n: u32, extra: &str) -> Self {
        Self::start_binary(Path::new(env!("CARGO_BIN_EXE_sandboxd")), n, extra, "")
    }

    /// [`start`](Self::start) with another sandboxd binary (`SANDBOXD_BENCH_BASELINE`).
    /// `sandbox` is added to the `sandbox:` section (`, start: libcontainer`).
    fn start_binary(binary: &Path, n: u32, extra: &str, sandbox: &str) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let port = common::free_port();
        let config = dir.path().join("config.yaml");
        let parent = format!("sandboxd-bench-{}-{n}", std::process::id());
        let cpu = CpuMeter::new(&parent);
        // 16 at once unless `extra` sets the capacity itself.
        let capacity = if extra.contains("capacity:") {
            ""
        } else {
            "capacity: {max_concurrent: 16, max_queue: 256}\n"
        };
        std::fs::write(
            &config,
            format!(
                "listen: 127.0.0.1:{port}\nstate_dir: {}\nauth: {{tokens: [\"{TOKEN}\"]}}\n{capacity}\
                 sandbox: {{cgroup_parent: {parent}, uid_base: {}{sandbox}}}\n{extra}",
                dir.path().join("state").display(),
                400_000 + n * 1000,
            ),
        )
        .unwrap();
        let mut cmd = Command::new(binary);
        cmd.arg("--config").arg(&config).env(
            "SANDBOXD_LOG",
            "warn,libcgroups=error,libcontainer::process::init=error",
        );
        if let Some(meter) = &cpu {
            let procs = std::ffi::CString::new(
                meter
                    .daemon
                    .join("cgroup.procs")
                    .as_os_str()
                    .as_encoded_bytes(),
            )
            .unwrap();
            use std::os::unix::process::CommandExt as _;
            // SAFETY: between fork and exec the closure only calls async-signal-safe functions (open, write,
            // close) on memory prepared before the fork.
            unsafe {
                cmd.pre_exec(move || {
                    let fd = libc::open(procs.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
                    if fd < 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    // "0" moves the writing process: the daemon-to-be, before it forks its helpers.
                    let written = libc::write(fd, b"0".as_ptr().cast(), 1);
                    libc::close(fd);
                    if written != 1 {
                        return Err(std::io::Error::last_os_error());
                    }
                    Ok(())
                });
            }
        }
        let child = cmd.spawn().expect("start sandboxd");
        let d = Self {
            _child: common::Stopped(child),
            port,
            _dir: dir,
            cpu,
        };
        let deadline = Instant::now() + Duration::from_secs(120);
        while d.healthz().is_none() {
            assert!(Instant::now() < deadline, "sandboxd did not become ready");
            std::thread::sleep(Duration::from_millis(50));
        }
        d
    }

    fn healthz(&self) -> Option<Value> {
        common::healthz(self.port)
    }

    /// The pool's (ready, hits, misses).
    fn pool(&self) -> (u64, u64, u64) {
        let p = &self.healthz().unwrap()["pool"];
        let n = |k: &str| p[k].as_u64().unwrap_or(0);
        (n("ready"), n("hits"), n("misses"))
    }

    /// CPU time used so far by the daemon, its helpers and its containers (ns).
    fn cpu_used(&self) -> Option<u64> {
        self.cpu.as_ref().map(CpuMeter::used)
    }

    /// Waits until the only containers left are the pool's ready ones (removal runs after the result).
    fn wait_removed(&self) {
        let Some(meter) = &self.cpu else { return };
        let deadline = Instant::now() + Duration::from_secs(60);
        let leaves = || {
            std::fs::read_dir(&meter.containers).map_or(0, |d| {
                d.filter(|e| e.as_ref().is_ok_and(|e| e.path().is_dir()))
                    .count()
            })
        };
        while leaves() > self.pool().0 as usize && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Waits until the pool is full again (after a burst drained it).
    fn wait_refilled(&self) {
        let h = self.healthz().unwrap();
        let full = h["pool"]["per_language"].as_u64().unwrap_or(0)
            * h["languages"].as_array().map_or(0, |l| l.len() as u64);
        let deadline = Instant::now() + Duration::from_secs(60);
        while self.pool().0 < full && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

type Ws =
    tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>;

async fn connect(port: u16) -> Ws {
    let mut req = format!("ws://127.0.0.1:{port}/ws")
        .into_client_request()
        .unwrap();
    req.headers_mut()
        .insert("Authorization", format!("Bearer {TOKEN}").parse().unwrap());
    tokio_tungstenite::connect_async_with_config(req, None, true)
        .await
        .unwrap()
        .0
}

/// One execution; returns (time to result, time to first stdout byte).
async fn execute(
    ws: &mut Ws,
    id: &str,
    language: &str,
    code: &str,
) -> (Duration, Option<Duration>) {
    execute_with(ws, id, language, code, &json!({})).await
}

/// [`execute`] with more fields of the `execute` message (`extra`'s, e.g. `tools`).
async fn execute_with(
    ws: &mut Ws,
    id: &str,
    language: &str,
    code: &str,
    extra: &Value,
) -> (Duration, Option<Duration>) {
    let mut msg = json!({"v":1,"type":"execute","id":id,"ts":"2026-01-01T00:00:00.000Z","language":language,
                     "code":code,"limits":{"timeout_ms":30000,"memory_mb":256}});
    if let (Some(msg), Some(extra)) = (msg.as_object_mut(), extra.as_object()) {
        msg.extend(extra.clone());
    }
    let t0 = Instant::now();
    ws.send(Message::Text(msg.to_string().into()))
        .await
        .unwrap();
    let mut first = None;
    loop {
        let m = ws.next().await.unwrap().unwrap();
        let Message::Text(t) = m else { continue };
        let v: Value = serde_json::from_str(&t).unwrap();
        if v["id"] != id {
            continue;
        }
        match v["type"].as_str().unwrap() {
            "stdout" if first.is_none() => first = Some(t0.elapsed()),
            "result" => {
                assert_eq!(v["exit_code"], 0, "{v}");
                return (t0.elapsed(), first);
            }
            "error" => panic!("execution failed: {v}"),
            _ => {}
        }
    }
}

/// Runs `cmd` with stdout piped; returns (time to exit, time to first stdout byte).
fn timed(mut cmd: Command) -> (Duration, Option<Duration>) {
    let t0 = Instant::now();
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .stdin(Stdio::null())
        .spawn()
        .unwrap();
    let mut out = child.stdout.take().unwrap();
    let mut first = None;
    let mut buf = [0u8; 4096];
    loop {
        let n = out.read(&mut buf).unwrap();
        if n == 0 {
            break;
        }
        first.get_or_insert_with(|| t0.elapsed());
    }
    let status = child.wait().unwrap();
    assert!(status.success(), "{cmd:?}: {status}");
    (t0.elapsed(), first)
}

fn bare(program: &str, ext: &str, code: &str, dir: &Path) -> (Duration, Option<Duration>) {
    let file = dir.join(format!("main.{ext}"));
    std::fs::write(&file, code).unwrap();
    let mut cmd = Command::new(program);
    cmd.arg(&file);
    timed(cmd)
}

/// Another isolating runtime, run per sample on the same program file.
trait Peer {
    fn name(&self) -> &'static str;
    fn run(&self, program: &str, code_file: &Path, seq: usize) -> (Duration, Option<Duration>);
}

/// bubblewrap: namespaces and a read-only /usr, no limits (it has none).
struct Bwrap;

impl Peer for Bwrap {
    fn name(&self) -> &'static str {
        "bwrap"
    }
    fn run(&self, program: &str, code_file: &Path, _seq: usize) -> (Duration, Option<Duration>) {
        let mut cmd = Command::new("bwrap");
        cmd.args([
            "--unshare-all",
            "--die-with-parent",
            "--ro-bind",
            "/usr",
            "/usr",
        ]);
        for l in ["bin", "sbin", "lib", "lib64"] {
            if let Ok(t) = std::fs::read_link(format!("/{l}")) {
                cmd.arg("--symlink").arg(t).arg(format!("/{l}"));
            }
        }
        cmd.args(["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp"])
            .arg("--ro-bind")
            .arg(code_file.parent().unwrap())
            .arg("/sandbox")
            .args([program, &format!("/sandbox/{}", file_name(code_file))]);
        timed(cmd)
    }
}

/// crun: an OCI bundle with the same namespaces as sandboxd (user namespace included), memory and pids limits,
/// a read-only root with the host's /usr; `crun run` creates, starts, waits and deletes.
struct Crun {
    bundle: tempfile::TempDir,
    parent: String,
}

impl Crun {
    fn new() -> Option<Self> {
        Command::new("crun").arg("--version").output().ok()?;
        let bundle = tempfile::tempdir().unwrap();
        let root = bundle.path().join("rootfs");
        for d in ["usr", "proc", "dev", "tmp", "sandbox", "etc"] {
            std::fs::create_dir_all(root.join(d)).unwrap();
        }
        for l in ["bin", "sbin", "lib", "lib64"] {
            if let Ok(t) = std::fs::read_link(format!("/{l}")) {
                std::os::unix::fs::symlink(t, root.join(l)).unwrap();
            }
        }
        std::fs::create_dir_all(bundle.path().join("code")).unwrap();
        // Everything the container's unprivileged root must reach.
        let mode = std::os::unix::fs::PermissionsExt::from_mode(0o755);
        std::fs::set_permissions(bundle.path(), mode).unwrap();
        Some(Self {
            bundle,
            parent: format!("sandboxd-bench-crun-{}", std::process::id()),
        })
    }

    fn config(&self, program: &str, file: &str, seq: usize) -> Value {
        let ns = |t: &str| json!({"type": t});
        let bind = |src: &str, dst: &str, ro: bool| {
            json!({"destination": dst, "type": "bind", "source": src,
                   "options": ["rbind", "nosuid", "nodev", if ro {"ro"} else {"rw"}]})
        };
        json!({
            "ociVersion": "1.0.2",
            "process": {"terminal": false, "user": {"uid": 0, "gid": 0},
                        "args": [program, format!("/sandbox/{file}")],
                        "env": ["PATH=/usr/bin:/bin"], "cwd": "/tmp", "noNewPrivileges": true,
                        "capabilities": {"bounding": [], "effective": [], "permitted": [], "inheritable": [], "ambient": []}},
            "root": {"path": "rootfs", "readonly": true},
            "hostname": "sandbox",
            "mounts": [
                {"destination": "/proc", "type": "proc", "source": "proc", "options": ["nosuid", "noexec", "nodev"]},
                {"destination": "/dev", "type": "tmpfs", "source": "tmpfs", "options": ["nosuid", "mode=755", "size=65536k"]},
                {"destination": "/tmp", "type": "tmpfs", "source": "tmpfs", "options": ["nosuid", "nodev", "size=64m"]},
                bind("/usr", "/usr", true),
                bind(self.bundle.path().join("code").to_str().unwrap(), "/sandbox", true),
            ],
            "linux": {
                "namespaces": [ns("pid"), ns("mount"), ns("ipc"), ns("uts"), ns("network"), ns("cgroup"), ns("user")],
                "uidMappings": [{"containerID": 0, "hostID": 390_000, "size": 1}],
                "gidMappings": [{"containerID": 0, "hostID": 390_000, "size": 1}],
                "cgroupsPath": format!("/{}/c{seq}", self.parent),
                "resources": {"memory": {"limit": 268_435_456i64, "swap": 268_435_456i64}, "pids": {"limit": 64},
                              "cpu": {"shares": 512}},
                "maskedPaths": ["/proc/kcore", "/proc/keys", "/proc/timer_list", "/sys/firmware"],
                "readonlyPaths": ["/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger"]
            }
        })
    }
}

impl Crun {
    /// One run of `true`, with crun's own error when it fails (crun refuses some cgroup setups outright).
    fn probe(&self, tmp: &Path) -> Result<(), String> {
        let file = tmp.join("probe.sh");
        std::fs::write(&file, "true\n").unwrap();
        std::fs::copy(&file, self.bundle.path().join("code/probe.sh")).unwrap();
        std::fs::write(
            self.bundle.path().join("config.json"),
            self.config("/bin/sh", "probe.sh", 0).to_string(),
        )
        .unwrap();
        let out = Command::new("crun")
            .args(["run", "--bundle"])
            .arg(self.bundle.path())
            .arg(format!("bench-{}-probe", std::process::id()))
            .stdin(Stdio::null())
            .output()
            .map_err(|e| e.to_string())?;
        if out.status.success() {
            Ok(())
        } else {
            Err(format!(
                "{} ({})",
                String::from_utf8_lossy(&out.stderr).trim(),
                out.status
            ))
        }
    }
}

impl Peer for Crun {
    fn name(&self) -> &'static str {
        "crun"
    }
    fn run(&self, program: &str, code_file: &Path, seq: usize) -> (Duration, Option<Duration>) {
        let file = file_name(code_file);
        std::fs::copy(code_file, self.bundle.path().join("code").join(&file)).unwrap();
        std::fs::write(
            self.bundle.path().join("config.json"),
            self.config(program, &file, seq).to_string(),
        )
        .unwrap();
        let mut cmd = Command::new("crun");
        cmd.args(["run", "--bundle"])
            .arg(self.bundle.path())
            .arg(format!("bench-{}-{seq}", std::process::id()));
        timed(cmd)
    }
}

impl Drop for Crun {
    fn drop(&mut self) {
        // crun removes each container's leaf; the parent it made in every hierarchy is ours to remove.
        if let Ok(entries) = std::fs::read_dir("/sys/fs/cgroup") {
            for e in entries.flatten() {
                let _ = std::fs::remove_dir(e.path().join(&self.parent));
            }
        }
    }
}

fn file_name(p: &Path) -> String {
    p.file_name().unwrap().to_string_lossy().into_owned()
}

fn pct(v: &[Duration], p: f64) -> f64 {
    let mut v = v.to_vec();
    v.sort();
    let i = ((v.len() as f64 - 1.0) * p).round() as usize;
    v[i].as_secs_f64() * 1000.0
}

fn median_ms(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    v[(v.len() - 1) / 2]
}

struct Case {
    name: &'static str,
    lang: &'static str,
    program: &'static str,
    ext: &'static str,
    code: &'static str,
    first_byte: bool,
}

const CASES: [Case; 4] = [
    Case {
        name: "shell `true`",
        lang: "shell",
        program: "/bin/sh",
        ext: "sh",
        code: "true\n",
        first_byte: false,
    },
    Case {
        name: "python `pass`",
        lang: "python",
        program: "/usr/bin/python3",
        ext: "py",
        code: "pass\n",
        first_byte: false,
    },
    Case {
        name: "shell first stdout byte",
        lang: "shell",
        program: "/bin/sh",
        ext: "sh",
        code: "echo x\n",
        first_byte: true,
    },
    Case {
        name: "python first stdout byte",
        lang: "python",
        program: "/usr/bin/python3",
        ext: "py",
        code: "print('x')\n",
        first_byte: true,
    },
];

fn main() {
    if !test_support::require_root(
        "latency bench",
        "it starts daemons, which create containers",
    ) {
        return;
    }
    // `cargo bench` passes --bench; a filter argument is accepted and ignored.
    let warm = Daemon::start(0, "");
    let cold = Daemon::start(1, "pool: {size: 0}\n");
    let tmp = tempfile::tempdir().unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let mut peers: Vec<Box<dyn Peer>> = Vec::new();
    match Crun::new() {
        Some(c) => match c.probe(tmp.path()) {
            Ok(()) => peers.push(Box::new(c)),
            Err(why) => println!("crun: left out, it cannot run on this host: {why}"),
        },
        None => println!("crun: not installed (apt-get install crun); its column is left out"),
    }
    if Command::new("bwrap").arg("--version").output().is_ok() {
        peers.push(Box::new(Bwrap));
    } else {
        println!("bwrap: not installed (apt-get install bubblewrap); its column is left out");
    }

    // SANDBOXD_BENCH_BASELINE=/path/to/an/older/sandboxd: its warm daemon joins the warm interpreters' table and
    // the throughput table, run for run.
    let baseline_bin = std::env::var_os("SANDBOXD_BENCH_BASELINE").map(PathBuf::from);
    let baseline = baseline_bin.as_ref().map(|bin| {
        println!("baseline: {}", bin.display());
        Daemon::start_binary(bin, 3, "", "")
    });
    // SANDBOXD_BENCH_ONLY=throughput runs the throughput table alone (for quick iterations on the hot path); =warm
    // the warm interpreters' rows and the throughput table.
    let only = std::env::var("SANDBOXD_BENCH_ONLY").unwrap_or_default();
    // =load keeps the warm daemon at 16 in flight for SANDBOXD_BENCH_LOAD_SECS (default 30), to profile it
    // (`perf record -a -g` meanwhile); it prints each run's figures and nothing else.
    if only == "load" {
        let secs = std::env::var("SANDBOXD_BENCH_LOAD_SECS")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(30);
        let end = Instant::now() + Duration::from_secs(secs);
        while Instant::now() < end {
            let r = measure(&rt, &warm, 16, "p");
            println!(
                "load: {:.1} exec/s, {} CPU ms/exec",
                r.per_s,
                r.cpu_ms_per_exec()
            );
        }
        return;
    }
    // =sustained: executions back to back on the default capacity, and python at 16 in flight, this daemon and
    // the baseline in turns.
    if only == "sustained" {
        sustained::run(
            &rt,
            (&warm, baseline.as_ref()),
            baseline_bin.as_deref(),
            tmp.path(),
        );
        return;
    }
    if only.is_empty() {
        latency_table(&rt, &warm, &cold, &peers, tmp.path());
        plain_client(&rt, &warm, tmp.path());
        if let Ok(spec) = std::env::var("SANDBOXD_BENCH_IMAGES") {
            images(&rt, &warm, &spec);
        }
    }
    if only.is_empty() || only == "warm" {
        warm::table(&rt, &warm, baseline.as_ref(), tmp.path());
        let this = Path::new(env!("CARGO_BIN_EXE_sandboxd"));
        warm::memory_row(this, 5, "python", "waiting python interpreter", "");
        warm::memory_row(
            this,
            6,
            "python",
            "waiting init only (pool.warm: false)",
            ", warm: false",
        );
        warm::memory_row(this, 9, "javascript", "waiting node interpreter", "");
        if let Some(layout) = std::env::var_os("SANDBOXD_BENCH_DATA_IMAGE") {
            warm::preload_table(&rt, Path::new(&layout));
        }
    }
    // The same binary and pool with libcontainer starting the containers: the direct start's baseline. Only in a
    // build with it (`cargo bench -p sandboxd --features libcontainer`).
    let libcontainer = cfg!(feature = "libcontainer").then(|| {
        Daemon::start_binary(
            Path::new(env!("CARGO_BIN_EXE_sandboxd")),
            4,
            "",
            ", start: libcontainer",
        )
    });
    throughput(
        &rt,
        &warm,
        &cold,
        libcontainer.as_ref(),
        baseline.as_ref(),
        tmp.path(),
    );
}

fn latency_table(
    rt: &tokio::runtime::Runtime,
    warm: &Daemon,
    cold: &Daemon,
    peers: &[Box<dyn Peer>],
    tmp: &Path,
) {
    // Per case: warm, cold, bare, then one column per peer.
    let mut rows: Vec<(String, Vec<Vec<Duration>>)> = Vec::new();
    let pick =
        |r: (Duration, Option<Duration>), first: bool| if first { r.1.unwrap() } else { r.0 };
    rt.block_on(async {
        let mut ww = connect(warm.port).await;
        let mut cw = connect(cold.port).await;
        let mut seq = 0usize;
        for c in &CASES {
            let code_file = tmp.join(format!("main.{}", c.ext));
            std::fs::write(&code_file, c.code).unwrap();
            let shell_only = c.lang == "shell";
            let mut cols: Vec<Vec<Duration>> = vec![Vec::new(); 3 + peers.len()];
            for i in 0..5 + SAMPLES {
                let keep = i >= 5; // the first five warm up the page cache and the pools
                let id = format!("{}-{i}", c.name).replace([' ', '`'], "_");
                let r = execute(&mut ww, &format!("w-{id}"), c.lang, c.code).await;
                let s = [
                    pick(r, c.first_byte),
                    pick(
                        execute(&mut cw, &format!("c-{id}"), c.lang, c.code).await,
                        c.first_byte,
                    ),
                    pick(bare(c.program, c.ext, c.code, tmp), c.first_byte),
                ];
                for (col, v) in s.into_iter().enumerate() {
                    if keep {
                        cols[col].push(v);
                    }
                }
                if shell_only {
                    for (k, p) in peers.iter().enumerate() {
                        seq += 1;
                        let v = pick(p.run(c.program, &code_file, seq), c.first_byte);
                        if keep {
                            cols[3 + k].push(v);
                        }
                    }
                }
            }
            rows.push((c.name.to_string(), cols));
        }
        // Sparse traffic, the usual agent pattern: 200 ms idle before each execution (cold caches, idle CPUs).
        let mut cols: Vec<Vec<Duration>> = vec![Vec::new(); 3];
        for i in 0..SPARSE_SAMPLES {
            tokio::time::sleep(Duration::from_millis(200)).await;
            cols[0].push(
                execute(&mut ww, &format!("sw-{i}"), "shell", "true\n")
                    .await
                    .0,
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
            cols[1].push(
                execute(&mut cw, &format!("sc-{i}"), "shell", "true\n")
                    .await
                    .0,
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
            cols[2].push(bare("/bin/sh", "sh", "true\n", tmp).0);
        }
        rows.push(("shell `true`, 200 ms idle".into(), cols));
    });

    println!();
    println!(
        "sandboxd bench: {SAMPLES} samples per column, interleaved sample by sample; times in ms (p50 / p95)"
    );
    print!(
        "{:<26} {:>15} {:>15} {:>15}",
        "case", "warm pool", "cold (no pool)", "bare spawn"
    );
    for p in peers {
        print!(" {:>15}", p.name());
    }
    println!(" | {:>13} {:>13}", "warm-bare p50", "cold-bare p50");
    for (name, cols) in &rows {
        print!("{name:<26}");
        for col in cols {
            if col.is_empty() {
                print!(" {:>15}", "-");
            } else {
                print!(" {:>7.2} / {:>5.2}", pct(col, 0.5), pct(col, 0.95));
            }
        }
        for _ in cols.len()..3 + peers.len() {
            print!(" {:>15}", "-");
        }
        let b = pct(&cols[2], 0.5);
        println!(
            " | {:>10.2} ms {:>10.2} ms",
            pct(&cols[0], 0.5) - b,
            pct(&cols[1], 0.5) - b
        );
    }
    // Ratios against the peers, shell `true` (p50).
    let shell = &rows[0].1;
    for (k, p) in peers.iter().enumerate() {
        let peer = pct(&shell[3 + k], 0.5);
        println!(
            "shell `true` p50: warm pool / {} = {:.2}, cold / {} = {:.2}",
            p.name(),
            pct(&shell[0], 0.5) / peer,
            p.name(),
            pct(&shell[1], 0.5) / peer
        );
    }
}

/// The same daemon through Python's `websockets` (benches/plain_client.py), next to the Rust client.
fn plain_client(rt: &tokio::runtime::Runtime, warm: &Daemon, tmp: &Path) {
    println!();
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("benches/plain_client.py");
    let python = "/usr/bin/python3";
    let ok = Command::new(python)
        .args(["-c", "import websockets"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !ok {
        println!("plain client: SKIPPED, {python} has no `websockets` (apt-get install python3-websockets)");
        return;
    }
    warm.wait_refilled();
    let out = Command::new(python)
        .arg(&script)
        .arg(warm.port.to_string())
        .arg(TOKEN)
        .arg(PLAIN_CLIENT_SAMPLES.to_string())
        .output()
        .expect("run plain_client.py");
    assert!(
        out.status.success(),
        "plain_client.py failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: Value = serde_json::from_slice(&out.stdout).expect("plain_client.py output");
    // The Rust client right after, on the same daemon, interleaved with its own bare spawns.
    warm.wait_refilled();
    let mut rust = Vec::new();
    rt.block_on(async {
        let mut ws = connect(warm.port).await;
        for c in CASES.iter().take(3) {
            let (mut s, mut b) = (Vec::new(), Vec::new());
            for i in 0..PLAIN_CLIENT_SAMPLES {
                let r = execute(&mut ws, &format!("rc-{}-{i}", c.ext), c.lang, c.code).await;
                s.push(if c.first_byte { r.1.unwrap() } else { r.0 });
                let r = bare(c.program, c.ext, c.code, tmp);
                b.push(if c.first_byte { r.1.unwrap() } else { r.0 });
            }
            rust.push((c.name, s, b));
        }
    });
    println!(
        "the same warm daemon through two clients, {PLAIN_CLIENT_SAMPLES} samples each with a bare spawn \
         interleaved; p50 ms ({})",
        report["client"].as_str().unwrap_or("python")
    );
    println!(
        "{:<26} {:>12} {:>10} {:>10} | {:>12} {:>10} {:>10}",
        "case", "python sbx", "bare", "overhead", "rust sbx", "bare", "overhead"
    );
    for (name, s, b) in rust {
        let case = &report["cases"][name];
        let nums = |k: &str| -> Vec<f64> {
            case[k]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_f64().unwrap())
                .collect()
        };
        let (ps, pb) = (median_ms(&nums("sandbox_ms")), median_ms(&nums("bare_ms")));
        let (rs, rb) = (pct(&s, 0.5), pct(&b, 0.5));
        println!(
            "{name:<26} {ps:>12.2} {pb:>10.2} {:>10.2} | {rs:>12.2} {rb:>10.2} {:>10.2}",
            ps - pb,
            rs - rb
        );
    }
    println!(
        "python client throughput, shell `true`, {} in flight: {:.1} exec/s",
        report["throughput"]["concurrency"],
        report["throughput"]["exec_per_s"].as_f64().unwrap_or(0.0)
    );
}

/// One throughput run against a daemon.
struct Run {
    /// Executions per second.
    per_s: f64,
    /// CPU time of the daemon, its helpers and containers, counted until the pool is full again and the removals
    /// are done.
    cpu_ns: Option<u64>,
    /// Pool hits and misses during the run.
    hits: u64,
    misses: u64,
    /// Fraction of the host's CPU time spent idle during the run.
    idle: f64,
}

impl Run {
    fn cpu_ms_per_exec(&self) -> String {
        self.cpu_ns.map_or("n/a".to_owned(), |ns| {
            format!("{:.2}", ns as f64 / 1e6 / THROUGHPUT_RUNS as f64)
        })
    }
}

fn measure(rt: &tokio::runtime::Runtime, d: &Daemon, conc: usize, tag: &str) -> Run {
    d.wait_refilled();
    let (_, h0, m0) = d.pool();
    let cpu0 = d.cpu_used();
    let idle0 = HostCpu::now();
    let per_s = run_throughput(rt, d.port, conc, tag);
    let idle = HostCpu::now().idle_since(&idle0);
    let (_, h1, m1) = d.pool();
    d.wait_refilled();
    d.wait_removed();
    Run {
        per_s,
        cpu_ns: d.cpu_used().zip(cpu0).map(|(b, a)| b - a),
        hits: h1 - h0,
        misses: m1 - m0,
        idle,
    }
}

/// Executions per second of a bare spawn of shell `true`, `conc` at once.
fn bare_throughput(conc: usize, tmp: &Path) -> f64 {
    let t0 = Instant::now();
    std::thread::scope(|s| {
        for w in 0..conc {
            let dir = tmp.join(format!("w{w}"));
            std::fs::create_dir_all(&dir).unwrap();
            s.spawn(move || {
                for _ in (w..THROUGHPUT_RUNS).step_by(conc) {
                    bare("/bin/sh", "sh", "true\n", &dir);
                }
            });
        }
    });
    THROUGHPUT_RUNS as f64 / t0.elapsed().as_secs_f64()
}

/// A floor row: in flight, the warm daemon's and the bare spawn's executions/s, and each step's executions/s and
/// CPU ms per execution.
type FloorRow = (usize, f64, f64, Result<Vec<(f64, f64)>, String>);

/// Prints the floor's table ([`floor`]) from the rows measured after each throughput row.
fn floor_table(rows: Vec<FloorRow>) {
    println!();
    println!(
        "the floor of a container per execution, measured right after each row above: `sh main.sh` cloned raw, \
         then in fresh namespaces (ns), with the daemon's seccomp filters (+sc), with a cgroup leaf (+cg), and \
         nothing else; exec/s (CPU ms/exec of the whole host: /proc/stat, steal left out, the kernel's deferred \
         tear-down included) and the share of the bare spawn; warm and bare as above"
    );
    print!("{:<12}", "in flight");
    for step in floor::Step::ALL {
        print!(" {:>22}", step.name());
    }
    println!(" {:>10} {:>10} {:>16}", "bare", "warm", "warm / ns+sc+cg");
    for (conc, warm, bare, steps) in rows {
        print!("{conc:<12}");
        match steps {
            Ok(steps) => {
                for (per_s, cpu) in &steps {
                    print!(
                        " {:>22}",
                        format!("{per_s:.1} ({cpu:.2}) {:.2}", per_s / bare)
                    );
                }
                let last = steps.last().map_or(f64::NAN, |s| s.0);
                println!(" {bare:>10.1} {warm:>10.1} {:>16.2}", warm / last);
            }
            Err(why) => println!(" failed: {why}"),
        }
    }
}

/// Warm, cold, the baseline binary's warm daemon when there is one, and a bare spawn, interleaved per row; then the
/// floor ([`floor`]), each row's measured right after it.
fn throughput(
    rt: &tokio::runtime::Runtime,
    warm: &Daemon,
    cold: &Daemon,
    libcontainer: Option<&Daemon>,
    baseline: Option<&Daemon>,
    tmp: &Path,
) {
    println!();
    println!(
        "throughput, shell `true`, {THROUGHPUT_RUNS} executions per run (one connection per worker); \
         pool hits/misses during the warm run"
    );
    println!(
        "(CPU ms/exec: daemon, helpers and containers, from cpuacct; the warm figure includes refilling the pool; \
         2 cores give at most 2000 / (CPU ms/exec) exec/s)"
    );
    println!(
        "{:<12} {:>12} {:>12} {:>12} {:>14} {:>12} {:>14} {:>14} {:>10}",
        "in flight",
        "warm exec/s",
        "cold exec/s",
        "bare exec/s",
        "warm / bare",
        "hits/misses",
        "warm CPU ms",
        "cold CPU ms",
        "warm idle"
    );
    let layers = floor::Layers::new();
    let mut floor_rows = Vec::new();
    let mut base_rows = Vec::new();
    let mut lc_rows = Vec::new();
    for conc in [1usize, 4, 16] {
        let w = measure(rt, warm, conc, "w");
        if let Some(lc) = libcontainer {
            lc_rows.push((
                conc,
                measure(rt, lc, conc, "l"),
                w.per_s,
                w.cpu_ms_per_exec(),
            ));
        }
        if let Some(base) = baseline {
            base_rows.push((conc, measure(rt, base, conc, "b")));
        }
        let c = measure(rt, cold, conc, "c");
        let b = bare_throughput(conc, tmp);
        if let Ok(layers) = &layers {
            let steps: Result<Vec<_>, String> = floor::Step::ALL
                .iter()
                .map(|step| floor::throughput(conc, tmp, *step, layers))
                .collect();
            floor_rows.push((conc, w.per_s, b, steps));
        }
        println!(
            "{:<12} {:>12.1} {:>12.1} {:>12.1} {:>14.2} {:>12} {:>14} {:>14} {:>9.0}%",
            conc,
            w.per_s,
            c.per_s,
            b,
            w.per_s / b,
            format!("{}/{}", w.hits, w.misses),
            w.cpu_ms_per_exec(),
            c.cpu_ms_per_exec(),
            w.idle * 100.0
        );
    }
    match &layers {
        Ok(_) => floor_table(floor_rows),
        Err(why) => println!("the floor: left out, its layers cannot be had here: {why}"),
    }
    drop(layers);
    if libcontainer.is_some() {
        println!("the same warm pool with `sandbox.start: libcontainer`, measured right after each warm run:");
    } else {
        println!("libcontainer start: not in this build (`cargo bench -p sandboxd --features libcontainer`)");
    }
    for (conc, r, direct_per_s, direct_cpu) in lc_rows {
        println!(
            "libcontainer start, {conc} in flight: {:.1} exec/s, {} CPU ms/exec, hits/misses {}/{}; \
             direct / libcontainer: {:.2}x exec/s, CPU ms/exec {} vs {}",
            r.per_s,
            r.cpu_ms_per_exec(),
            r.hits,
            r.misses,
            direct_per_s / r.per_s,
            direct_cpu,
            r.cpu_ms_per_exec()
        );
    }
    for (conc, r) in base_rows {
        println!(
            "baseline warm daemon, {conc} in flight: {:.1} exec/s, {} CPU ms/exec, hits/misses {}/{}",
            r.per_s,
            r.cpu_ms_per_exec(),
            r.hits,
            r.misses
        );
    }
}

/// The host's CPU time counters (`/proc/stat`, all CPUs), to tell whether a run was bound by CPU.
struct HostCpu {
    idle: u64,
    /// user, nice, system, irq and softirq: the time the CPUs ran something (steal left out).
    busy: u64,
    total: u64,
}

impl HostCpu {
    fn now() -> Self {
        let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
        let fields: Vec<u64> = stat
            .lines()
            .next()
            .unwrap_or_default()
            .split_whitespace()
            .skip(1)
            .filter_map(|f| f.parse().ok())
            .collect();
        // user nice system idle iowait irq softirq steal ...
        let field = |i: usize| fields.get(i).copied().unwrap_or(0);
        Self {
            idle: field(3) + field(4),
            busy: [0, 1, 2, 5, 6].into_iter().map(field).sum(),
            total: fields.iter().take(8).sum(),
        }
    }

    /// CPU time (all CPUs) spent running something since `before`, in ms.
    fn busy_ms_since(&self, before: &HostCpu) -> f64 {
        // SAFETY: sysconf has no preconditions.
        let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
        self.busy.saturating_sub(before.busy) as f64 * 1000.0 / hz
    }

    /// Waits (1 s at most) until the host is quiet, less than a tenth of one CPU busy over 20 ms, so that a run's
    /// deferred work (the network namespaces' tear-down) is counted in that run.
    fn settle() {
        for _ in 0..50 {
            let before = HostCpu::now();
            std::thread::sleep(Duration::from_millis(20));
            if HostCpu::now().busy_ms_since(&before) < 2.0 {
                return;
            }
        }
    }

    /// The fraction of CPU time spent idle since `before`.
    fn idle_since(&self, before: &HostCpu) -> f64 {
        let total = self.total.saturating_sub(before.total).max(1);
        self.idle.saturating_sub(before.idle) as f64 / total as f64
    }
}

fn run_throughput(rt: &tokio::runtime::Runtime, port: u16, conc: usize, tag: &str) -> f64 {
    run_in_flight(rt, port, (conc, THROUGHPUT_RUNS), ("shell", "true\n"), tag)
}

/// Executions per second of `runs` executions of `(language, code)`, `conc` at once (one connection per worker,
/// each sending its next execution after the previous result).
fn run_in_flight(
    rt: &tokio::runtime::Runtime,
    port: u16,
    (conc, runs): (usize, usize),
    (lang, code): (&'static str, &'static str),
    tag: &str,
) -> f64 {
    let t0 = Instant::now();
    rt.block_on(async {
        let mut tasks = Vec::new();
        for w in 0..conc {
            let tag = tag.to_owned();
            tasks.push(tokio::spawn(async move {
                let mut ws = connect(port).await;
                let mut i = w;
                while i < runs {
                    execute(&mut ws, &format!("tp-{tag}-{conc}-{i}"), lang, code).await;
                    i += conc;
                }
            }));
        }
        for t in tasks {
            t.await.unwrap();
        }
    });
    runs as f64 / t0.elapsed().as_secs_f64()
}

/// `SANDBOXD_BENCH_IMAGES=shell=DIR,python=DIR` (OCI layouts from `images/build.sh`): the same programs on a third
/// daemon whose languages run on those images, interleaved with the host-image daemon.
fn images(rt: &tokio::runtime::Runtime, host: &Daemon, spec: &str) {
    let mut extra = String::from("images:\n");
    let mut langs = String::from("languages:\n");
    let mut cases = Vec::new();
    for item in spec.split(',').filter(|s| !s.is_empty()) {
        let (lang, dir) = item.split_once('=').expect("lang=DIR");
        let (program, code) = match lang {
            "shell" => ("/bin/sh", "true\n"),
            "python" => ("/usr/bin/python3", "pass\n"),
            "javascript" => ("/usr/bin/node", "\n"),
            other => panic!("no bench case for {other}"),
        };
        let dir = std::fs::canonicalize(dir).expect("layout dir");
        extra.push_str(&format!("  {lang}: {{layout: {}}}\n", dir.display()));
        langs.push_str(&format!(
            "  {lang}: {{image: {lang}, command: [{program}]}}\n"
        ));
        cases.push((lang.to_owned(), code));
    }
    let image = Daemon::start(2, &format!("{extra}{langs}"));
    let mut rows = Vec::new();
    rt.block_on(async {
        let mut hw = connect(host.port).await;
        let mut iw = connect(image.port).await;
        for (lang, code) in &cases {
            for i in 0..5 {
                execute(&mut hw, &format!("warm-h-{lang}-{i}"), lang, code).await;
                execute(&mut iw, &format!("warm-i-{lang}-{i}"), lang, code).await;
            }
            let (mut h, mut m) = (Vec::new(), Vec::new());
            for i in 0..SAMPLES {
                h.push(
                    execute(&mut hw, &format!("h-{lang}-{i}"), lang, code)
                        .await
                        .0,
                );
                m.push(
                    execute(&mut iw, &format!("i-{lang}-{i}"), lang, code)
                        .await
                        .0,
                );
            }
            rows.push((lang.clone(), h, m));
        }
    });
    println!();
    println!("OCI image vs host image (both warm pools), {SAMPLES} samples each, interleaved; times in ms");
    println!(
        "{:<10} {:>10} {:>10} {:>10} {:>10} {:>12} {:>7}",
        "language", "host p50", "host p95", "image p50", "image p95", "p50 diff", "ratio"
    );
    for (lang, h, m) in rows {
        let (h50, m50) = (pct(&h, 0.5), pct(&m, 0.5));
        println!(
            "{:<10} {:>10.2} {:>10.2} {:>10.2} {:>10.2} {:>9.2} ms {:>7.2}",
            lang,
            h50,
            pct(&h, 0.95),
            m50,
            pct(&m, 0.95),
            m50 - h50,
            m50 / h50
        );
    }
}

//! `cargo bench -p sandboxd --bench snapshots`: snapshots and forks of an agent sandbox whose workspace holds
//! 1 000 files of 100 KiB (about 100 MB), with its agent alive (so every snapshot freezes and thaws it). Prints the
//! median of `SNAPSHOT_BENCH_ROUNDS` (5) rounds, each figure with its baseline measured in the same run:
//! - `POST /sandboxes/<id>/snapshot`, against `cp -a` of the same workspace to the same state disk;
//! - `POST /sandboxes/<id>/fork` (a snapshot and a creation), and `POST /sandboxes {fromSnapshot}` against a fresh
//!   `POST /sandboxes`;
//! - the time from `POST /spawn` to the agent's first event, in a sandbox from the snapshot against a fresh one;
//! - what a sandbox from the snapshot holds in its own tmpfs (nothing copied), against the snapshot's bytes.
//!
//! Each with `/workspace` on a tmpfs (the default) and in the btrfs workspace store (`agents.workspace_store:
//! btrfs`, where a snapshot and a fork copy nothing), then the fork of the one against the other's.
//! `SNAPSHOT_BENCH_STORES=tmpfs` (or `btrfs`) measures one. `SNAPSHOT_BENCH_WRITER=1` runs another writer on the
//! state disk throughout (a thread rewriting a 1 GiB file there, never syncing it), as another tenant's dirty data:
//! a snapshot's durability should not wait for it.
//!
//! Needs root. Figures, not assertions.

#![allow(missing_docs, clippy::unwrap_used, clippy::expect_used)]

// Only the free port and the stopping daemon are used here.
#[allow(dead_code)]
mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use agent_api::{AgentBrief, CreateSandboxRequest};
use client::gateway::{Gateway, SandboxClient};
use serde_json::json;

const TOKEN: &str = "bench-token-0123456789abcdef";
const FILES: usize = 1000;
const FILE_BYTES: u64 = 100 << 10;

struct Daemon {
    child: common::Stopped,
    port: u16,
    state: PathBuf,
    _dir: tempfile::TempDir,
}

impl Daemon {
    fn start(binary: &Path, store: &str) -> Self {
        // The state disk, as a daemon has it (not /tmp, which may be a tmpfs).
        let dir = tempfile::tempdir_in("/var/tmp").unwrap();
        let port = common::free_port();
        let config = dir.path().join("config.yaml");
        let state = dir.path().join("state");
        let parent = format!("sandboxd-snapbench-{}", std::process::id());
        std::fs::write(
            &config,
            format!(
                "listen: 127.0.0.1:{port}\nstate_dir: {}\nauth: {{tokens: [\"{TOKEN}\"]}}\n\
                 sandbox: {{cgroup_parent: {parent}, uid_base: 560000}}\n\
                 agents: {{workspace_store: {store}, workspace_store_mb: 65536}}\n",
                state.display(),
            ),
        )
        .unwrap();
        let child = Command::new(binary)
            .arg("--config")
            .arg(&config)
            .env("SANDBOXD_LOG", "error")
            .stdout(Stdio::null())
            .spawn()
            .expect("start sandboxd");
        let d = Self {
            child: common::Stopped(child),
            port,
            state,
            _dir: dir,
        };
        let deadline = Instant::now() + Duration::from_secs(120);
        while common::healthz(d.port).is_none() {
            assert!(Instant::now() < deadline, "sandboxd did not become ready");
            std::thread::sleep(Duration::from_millis(100));
        }
        d
    }

    /// A path of the daemon's mount namespace (where the workspaces' tmpfs mounts are).
    fn inside(&self, path: &Path) -> PathBuf {
        PathBuf::from(format!("/proc/{}/root{}", self.child.pid(), path.display()))
    }

    fn workspace(&self, id: &str) -> PathBuf {
        self.inside(&self.state.join("agents").join(id).join("scratch/workspace"))
    }
}

fn request() -> CreateSandboxRequest {
    common::agent_request(256)
}

fn brief(script: serde_json::Value) -> AgentBrief {
    serde_json::from_value(json!({
        "agentId": "bench-agent", "role": "bench", "workstream": "w",
        "providerConfig": {"script": script}
    }))
    .unwrap()
}

/// Spawns `script` and waits for the status `until`; the time to the first event.
async fn spawn(sb: &SandboxClient, script: serde_json::Value, until: &str) -> Duration {
    let mut events = sb.events(0);
    let t0 = Instant::now();
    sb.spawn(&brief(script)).await.unwrap();
    let mut first = None;
    loop {
        let e = tokio::time::timeout(Duration::from_secs(300), events.next())
            .await
            .expect("an event within 300 s")
            .unwrap();
        first.get_or_insert_with(|| t0.elapsed());
        if e.event.get("message").and_then(|m| m.as_str()) == Some(until) {
            return first.unwrap();
        }
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

fn used(path: &Path) -> u64 {
    let st = nix::sys::statvfs::statvfs(path).unwrap();
    (st.blocks() - st.blocks_free()) * st.fragment_size()
}

/// Bytes sandbox `id` holds of its own: its tmpfs, or with the btrfs store what the store's filesystem holds
/// (committed) beyond `before`.
fn held_by(d: &Daemon, id: &str, store: &str, before: u64) -> u64 {
    match store {
        "btrfs" => store_used(d).saturating_sub(before),
        _ => used(&d.inside(&d.state.join("agents").join(id).join("scratch"))),
    }
}

/// The btrfs store's filesystem in use, after a commit.
fn store_used(d: &Daemon) -> u64 {
    let mnt = d.inside(&d.state.join("workspaces/mnt"));
    let f = std::fs::File::open(&mnt).unwrap();
    nix::unistd::syncfs(std::os::fd::AsRawFd::as_raw_fd(&f)).unwrap();
    used(&mnt)
}

fn row(what: &str, v: f64, base_what: &str, base: f64) {
    println!(
        "{what:<44} {v:>9.1} ms   {base_what:<28} {base:>9.1} ms   ratio {:.2}",
        v / base
    );
}

fn main() {
    if !nix::unistd::geteuid().is_root() {
        println!("SKIPPED (needs root): snapshots bench");
        return;
    }
    let rounds: usize = std::env::var("SNAPSHOT_BENCH_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(5);
    let stores = std::env::var("SNAPSHOT_BENCH_STORES").unwrap_or_else(|_| "tmpfs,btrfs".into());
    let mut forks = Vec::new();
    for store in stores.split(',') {
        forks.push((store.to_owned(), pass(store, rounds)));
    }
    if let [(a, fa), (b, fb)] = &forks[..] {
        row(
            &format!("POST /fork, {b} store"),
            *fb,
            &format!("{a} store"),
            *fa,
        );
    }
}

/// Another writer on the state disk: a thread rewriting a 1 GiB file, never syncing it, until dropped.
struct Writer {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
    path: PathBuf,
}

impl Writer {
    fn start(path: &Path) -> Writer {
        use std::io::{Seek, Write};
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (flag, file) = (stop.clone(), path.to_owned());
        let thread = std::thread::spawn(move || {
            let mut f = std::fs::File::create(&file).unwrap();
            let chunk = vec![7u8; 1 << 20];
            while !flag.load(std::sync::atomic::Ordering::Relaxed) {
                for _ in 0..1024 {
                    if flag.load(std::sync::atomic::Ordering::Relaxed) {
                        return;
                    }
                    f.write_all(&chunk).unwrap();
                }
                f.rewind().unwrap();
            }
        });
        println!("another writer on the state disk: {}", path.display());
        Writer {
            stop,
            thread: Some(thread),
            path: path.to_owned(),
        }
    }
}

impl Drop for Writer {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        let _ = std::fs::remove_file(&self.path);
    }
}

/// One daemon with `/workspace` in `store`: its rows; the fork's median.
fn pass(store: &str, rounds: usize) -> f64 {
    let d = Daemon::start(Path::new(env!("CARGO_BIN_EXE_sandboxd")), store);
    let _writer = (std::env::var("SNAPSHOT_BENCH_WRITER").as_deref() == Ok("1"))
        .then(|| Writer::start(&d.state.join("other-tenant.bin")));
    let rt = tokio::runtime::Runtime::new().unwrap();
    let gw = Gateway::new(&format!("http://127.0.0.1:{}", d.port), TOKEN);
    rt.block_on(async {
        // The source: 1 000 files of 100 KiB, and its agent alive (waiting for commands).
        let a = gw.create(&request()).await.unwrap();
        let mut script: Vec<_> = (0..FILES)
            .map(|i| json!({"fill": {"path": format!("d{}/f{i}.bin", i % 10), "bytes": FILE_BYTES}}))
            .collect();
        script.push(json!({"emit": {"type": "status", "message": "filled"}}));
        spawn(&a, json!(script), "filled").await;

        let (mut snap, mut cp, mut fork, mut from, mut fresh) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let (mut first_from, mut first_fresh, mut held) = (Vec::new(), Vec::new(), 0u64);
        let mut bytes = 0;
        for round in 0..rounds {
            // A snapshot of the working sandbox, and cp -a of the same tree to the same disk.
            let t = Instant::now();
            let s = gw.snapshot(a.id()).await.unwrap();
            snap.push(ms(t.elapsed()));
            bytes = s.bytes;
            let to = d.state.join(format!("cp-{round}"));
            let t = Instant::now();
            let ok = Command::new("cp")
                .arg("-a")
                .arg(d.workspace(a.id()))
                .arg(&to)
                .status()
                .unwrap()
                .success();
            // cp's data is durable only after a sync, as the snapshot's is.
            let synced = Command::new("sync").arg("-f").arg(&to).status().unwrap().success();
            assert!(ok && synced);
            cp.push(ms(t.elapsed()));
            std::fs::remove_dir_all(&to).unwrap();

            // A fork, then a creation from the snapshot against a fresh creation.
            let before = if store == "btrfs" { store_used(&d) } else { 0 };
            let t = Instant::now();
            let (fs, f) = gw.fork(a.id(), &request()).await.unwrap();
            fork.push(ms(t.elapsed()));
            let mut req = request();
            req.from_snapshot = Some(s.id.clone());
            let t = Instant::now();
            let b = gw.create(&req).await.unwrap();
            from.push(ms(t.elapsed()));
            held = held.max(held_by(&d, b.id(), store, before));
            let t = Instant::now();
            let c = gw.create(&request()).await.unwrap();
            fresh.push(ms(t.elapsed()));

            // The first event (the daemon's `started`, once the run's container is up), from the snapshot and
            // fresh, in turns first.
            let done = json!([{"emit": {"type": "status", "message": "up"}}]);
            if round % 2 == 0 {
                first_from.push(ms(spawn(&b, done.clone(), "up").await));
                first_fresh.push(ms(spawn(&c, done, "up").await));
            } else {
                first_fresh.push(ms(spawn(&c, done.clone(), "up").await));
                first_from.push(ms(spawn(&b, done, "up").await));
            }
            for sb in [&f, &b, &c] {
                gw.delete(sb.id()).await.unwrap();
            }
            for id in [&s.id, &fs.id] {
                gw.delete_snapshot(id).await.unwrap();
            }
        }
        println!(
            "snapshots bench, /workspace on {store}: a workspace of {FILES} files, {:.1} MB, its agent alive; medians of {rounds} rounds",
            bytes as f64 / 1e6
        );
        let snap = median(snap);
        let what = match store {
            "btrfs" => "POST /snapshot (freeze, snapshot, thaw, hash)",
            _ => "POST /snapshot (freeze, copy, hash, thaw)",
        };
        row(what, snap, "cp -a + sync -f", median(cp));
        let fork = median(fork);
        row("POST /fork (snapshot + create)", fork, "POST /snapshot", snap);
        row("POST /sandboxes {fromSnapshot}", median(from), "POST /sandboxes (fresh)", median(fresh));
        row("first event, sandbox from the snapshot", median(first_from), "fresh sandbox", median(first_fresh));
        println!(
            "a sandbox from the snapshot and a fork hold {:.2} MB of their own ({}), the snapshot {:.1} MB",
            held as f64 / 1e6,
            if store == "btrfs" { "the store's growth" } else { "the sandbox's tmpfs" },
            bytes as f64 / 1e6
        );
        gw.delete(a.id()).await.unwrap();
        fork
    })
}

//! `cargo bench -p sandboxd --bench live_restore`: what a daemon restart costs agent sandboxes with
//! `agents.live_restore`. Two daemons with live restore: one holds `LIVE_RESTORE_BENCH_SANDBOXES` (8) sandboxes whose
//! agents tick every 10 ms, the other none (the baseline). Each of `LIVE_RESTORE_BENCH_ROUNDS` (5) rounds SIGKILLs
//! and restarts both, alternating which goes first, and prints the medians:
//! - from the SIGKILL to `/healthz` answering (start-up checks and self-tests included), against the empty daemon;
//! - from the SIGKILL until every agent's sandbox answers `running` again (taken back);
//! - the ticks lost and repeated across all restarts (read back with `/replay`), and how many were read back.
//!
//! Needs root. Figures, not assertions.

#![allow(missing_docs, clippy::unwrap_used, clippy::expect_used)]

#[allow(dead_code)]
mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use agent_api::{AgentStatus, CreateSandboxRequest};
use client::gateway::{Gateway, SandboxClient};
use serde_json::json;

const TOKEN: &str = "bench-token-0123456789abcdef";

struct Daemon {
    binary: PathBuf,
    config: PathBuf,
    child: Option<common::Stopped>,
    port: u16,
    _dir: tempfile::TempDir,
}

impl Daemon {
    fn start(binary: &Path, n: u32) -> Self {
        let dir = tempfile::tempdir_in("/var/tmp").unwrap();
        let port = common::free_port();
        let config = dir.path().join("config.yaml");
        let parent = format!("sandboxd-restorebench-{}-{n}", std::process::id());
        std::fs::write(
            &config,
            format!(
                "listen: 127.0.0.1:{port}\nstate_dir: {}\nauth: {{tokens: [\"{TOKEN}\"]}}\n\
                 sandbox: {{cgroup_parent: {parent}, uid_base: {}}}\nagents: {{live_restore: true}}\n",
                dir.path().join("state").display(),
                580_000 + n * 100_000,
            ),
        )
        .unwrap();
        let mut d = Self {
            binary: binary.to_owned(),
            config,
            child: None,
            port,
            _dir: dir,
        };
        d.spawn();
        d
    }

    /// Starts the daemon; the time until `/healthz` answers.
    fn spawn(&mut self) -> Duration {
        let t0 = Instant::now();
        let child = Command::new(&self.binary)
            .arg("--config")
            .arg(&self.config)
            .env("SANDBOXD_LOG", "error")
            .stdout(Stdio::null())
            .spawn()
            .expect("start sandboxd");
        self.child = Some(common::Stopped(child));
        let deadline = Instant::now() + Duration::from_secs(120);
        while common::healthz(self.port).is_none() {
            assert!(Instant::now() < deadline, "sandboxd did not become ready");
            std::thread::sleep(Duration::from_millis(5));
        }
        t0.elapsed()
    }

    /// SIGKILLs the daemon (its agents live on) and starts it again; the time from the kill to `/healthz`.
    fn crash_and_restart(&mut self) -> (Instant, Duration) {
        let mut child = self.child.take().unwrap();
        let t0 = Instant::now();
        let _ = child.0.kill();
        let _ = child.0.wait();
        std::mem::forget(child);
        let up = self.spawn();
        (t0, t0.elapsed().max(up))
    }
}

fn request() -> CreateSandboxRequest {
    common::agent_request(64)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// Waits until every sandbox answers `running`.
async fn all_running(sandboxes: &[SandboxClient]) {
    for sb in sandboxes {
        loop {
            if let Ok(h) = sb.health().await {
                if h.agent_status == AgentStatus::Running {
                    break;
                }
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
}

/// Ticks of a sandbox's agent, read back in sequence order: (lost, repeated, ticks seen).
async fn tick_gaps(sb: &SandboxClient) -> (u64, u64, u64) {
    let r = sb.replay(1, u64::MAX / 2).await.unwrap();
    let ticks: Vec<u64> = r
        .events
        .iter()
        .filter_map(|e| {
            e.event
                .get("message")?
                .as_str()?
                .strip_prefix("tick ")?
                .parse()
                .ok()
        })
        .collect();
    let lost = ticks
        .windows(2)
        .map(|w| w[1].saturating_sub(w[0] + 1))
        .sum();
    let repeated = ticks.windows(2).filter(|w| w[1] <= w[0]).count() as u64;
    (lost, repeated, ticks.len() as u64)
}

fn main() {
    if !nix::unistd::geteuid().is_root() {
        println!("SKIPPED (needs root): live_restore bench");
        return;
    }
    let env = |k: &str, d: usize| {
        std::env::var(k)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(d)
    };
    let rounds = env("LIVE_RESTORE_BENCH_ROUNDS", 5);
    let n = env("LIVE_RESTORE_BENCH_SANDBOXES", 8);
    let bin = Path::new(env!("CARGO_BIN_EXE_sandboxd"));
    let mut full = Daemon::start(bin, 0);
    let mut empty = Daemon::start(bin, 1);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let gw = Gateway::new(&format!("http://127.0.0.1:{}", full.port), TOKEN);
    let sandboxes: Vec<SandboxClient> = rt.block_on(async {
        let mut v = Vec::new();
        for _ in 0..n {
            let sb = gw.create(&request()).await.unwrap();
            let script = json!([{"emit_many": 100_000_000, "every_ms": 10}]);
            let b = serde_json::from_value(json!({
                "agentId": "bench-agent", "role": "bench", "workstream": "w",
                "providerConfig": {"script": script}
            }))
            .unwrap();
            sb.spawn(&b).await.unwrap();
            v.push(sb);
        }
        all_running(&v).await;
        v
    });
    let (mut up_full, mut up_empty, mut back) = (Vec::new(), Vec::new(), Vec::new());
    for r in 0..rounds {
        std::thread::sleep(Duration::from_millis(500));
        let mut one = |d: &mut Daemon, with_agents: bool| {
            let (t0, up) = d.crash_and_restart();
            if with_agents {
                up_full.push(ms(up));
                rt.block_on(all_running(&sandboxes));
                back.push(ms(t0.elapsed()));
            } else {
                up_empty.push(ms(up));
            }
        };
        if r % 2 == 0 {
            one(&mut full, true);
            one(&mut empty, false);
        } else {
            one(&mut empty, false);
            one(&mut full, true);
        }
    }
    std::thread::sleep(Duration::from_millis(500));
    let (mut lost, mut repeated, mut ticks) = (0, 0, 0);
    rt.block_on(async {
        for sb in &sandboxes {
            let (l, r, t) = tick_gaps(sb).await;
            lost += l;
            repeated += r;
            ticks += t;
        }
        for sb in &sandboxes {
            gw.delete(sb.id()).await.unwrap();
        }
    });
    println!(
        "live restore: {n} sandboxes with agents ticking every 10 ms, {rounds} SIGKILLs (medians)"
    );
    let (f, e) = (median(up_full), median(up_empty));
    println!(
        "{:<46} {f:>8.1} ms   empty daemon {e:>8.1} ms   ratio {:.2}",
        "SIGKILL to /healthz, with the sandboxes",
        f / e
    );
    println!(
        "{:<46} {:>8.1} ms",
        "SIGKILL to every agent running again",
        median(back)
    );
    println!("ticks across the restarts: {lost} lost, {repeated} repeated, of {ticks} read back");
}

//! `cargo bench -p sandboxd --bench agent_flood`: 16 agent sandboxes whose agents flood the daemon at full speed
//! with maximum-size control lines (1 MiB, `agents.max_line_bytes`) and artifacts, once with no gateway connected
//! and once with a gateway reading every sandbox's `WS /events`; then, with `agents.live_restore` on (every change
//! of a sandbox's record written), two more floods with no gateway: decisions (each line a `decision` event with a
//! new id of nearly 1 MiB, then as many ids of 64 bytes as the agent can send) and forgeries (what only sandboxd
//! may say: `lifecycle` events, its error codes, artifact events with a made-up backend `uri` and `contentHash`,
//! another agent's id). Every second it samples the daemon's RSS
//! (`VmRSS`), its helpers' (its direct children), and the state directory's bytes (`du -sxb`, the workspace
//! tmpfs mounts left out; the replay logs also on their own), then prints peak and median against the budget the
//! configuration reference (`docs/configuration.md`) states for the defaults.
//!
//! Environment: `AGENT_FLOOD_SECONDS` (60) per phase; `SANDBOXD_BENCH_BINARY` another daemon binary (an older
//! build, which gets the same load with its own defaults); `AGENT_FLOOD_RSS_CAP_MB` (3072) and
//! `AGENT_FLOOD_DISK_CAP_MB` (8192) end a phase early, so that a daemon without budgets cannot take the machine
//! down (the table says so). Needs root. Figures, not assertions.

#![allow(missing_docs, clippy::unwrap_used, clippy::expect_used)]

// Only the free port is used here.
#[allow(dead_code)]
mod common;

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use serde_json::{json, Value};
use tokio_tungstenite::tungstenite::client::IntoClientRequest;

const TOKEN: &str = "bench-token-0123456789abcdef";
const SANDBOXES: usize = 16;
/// The agent's lines: the default `agents.max_line_bytes` less a margin for the JSON around the padding.
const LINE_BYTES: usize = (1 << 20) - 1024;
/// An artifact (the same content each time: the store keeps one copy) after every this many lines.
const ARTIFACT_EVERY: u64 = 16;
const ARTIFACT_BYTES: usize = 256 << 10;
/// The budgets `docs/configuration.md` states for the defaults (16 sandboxes).
const RSS_BUDGET_MB: f64 = 192.0;
const STATE_BUDGET_MB: f64 = 512.0;

const AGENT: &str = r#"
import json, os, socket, time
sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
sock.connect(os.environ["SANDBOXD_CONTROL_SOCKET"])
cfg = json.loads(sock.makefile("rb").readline())["brief"]["providerConfig"]
aid = os.environ["SANDBOXD_AGENT_ID"]
end, n = time.time() + cfg["seconds"], 0
if cfg["mode"] == "decisions":
    # New ids all the time: nearly 1 MiB each for the first half of the flood, 64 bytes after.
    def decision(n, size):
        did = ("%d-" % n).ljust(size, "d")
        return (json.dumps({"type": "decision", "agentId": aid, "subtype": "tool_approval", "decisionId": did,
                            "toolName": "rm", "toolArgs": {}}) + "\n").encode()
    half = time.time() + cfg["seconds"] / 2
    while time.time() < end:
        n += 1
        sock.sendall(decision(n, cfg["lineBytes"] - 1024 if time.time() < half else 64))
    time.sleep(3600)
if cfg["mode"] == "forgeries":
    lines = [
        {"type": "lifecycle", "agentId": aid, "action": "session_end"},
        {"type": "lifecycle", "agentId": "another-agent", "action": "killed", "reason": "timeout"},
        {"type": "error", "agentId": aid, "errorCode": "agent_crashed", "message": "forged"},
        {"type": "status", "agentId": "another-agent", "message": "forged"},
        {"type": "artifact", "agentId": aid, "artifactId": "f", "name": "f", "kind": "other", "workstream": "w",
         "status": "draft", "qualityScore": 1, "uri": "artifact://backend/forged",
         "contentHash": "sha256:" + "0" * 64,
         "provenance": {"createdBy": "sandboxd", "createdAt": "2026-01-01T00:00:00Z"}},
    ]
    batch = b"".join((json.dumps(l) + "\n").encode() for l in lines) * 64
    while time.time() < end:
        sock.sendall(batch)
    time.sleep(3600)
pad = cfg["lineBytes"] - len(json.dumps({"type": "status", "agentId": aid, "message": ""}))
line = (json.dumps({"type": "status", "agentId": aid, "message": "x" * pad}) + "\n").encode()
with open("/workspace/art.bin", "wb") as f:
    f.write(b"a" * cfg["artifactBytes"])
art = (json.dumps({"type": "artifact", "agentId": aid, "artifactId": "a", "name": "art.bin", "kind": "other",
                   "workstream": "w", "status": "draft", "qualityScore": 1,
                   "provenance": {"createdBy": aid, "createdAt": "2026-01-01T00:00:00Z"},
                   "uri": "/workspace/art.bin"}) + "\n").encode()
while time.time() < end:
    sock.sendall(line)
    n += 1
    if n % cfg["artifactEvery"] == 0:
        sock.sendall(art)
time.sleep(3600)
"#;

struct Daemon {
    child: common::Stopped,
    port: u16,
    state: PathBuf,
    _dir: tempfile::TempDir,
}

impl Daemon {
    fn start(binary: &Path, n: u32, live_restore: bool) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let port = common::free_port();
        let config = dir.path().join("config.yaml");
        let state = dir.path().join("state");
        let parent = format!("sandboxd-flood-{}-{n}", std::process::id());
        std::fs::write(
            &config,
            format!(
                "listen: 127.0.0.1:{port}\nstate_dir: {}\nauth: {{tokens: [\"{TOKEN}\"]}}\n\
                 sandbox: {{cgroup_parent: {parent}, uid_base: {}}}\nagents: {{live_restore: {live_restore}}}\n",
                state.display(),
                500_000 + n * 1000,
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
        while http(d.port, "GET", "/healthz", b"").0 != 200 {
            assert!(Instant::now() < deadline, "sandboxd did not become ready");
            std::thread::sleep(Duration::from_millis(100));
        }
        d
    }

    fn pid(&self) -> i32 {
        self.child.pid()
    }
}

/// One HTTP/1.1 request with the bench token: (status, body).
fn http(port: u16, method: &str, path: &str, body: &[u8]) -> (u16, Vec<u8>) {
    let Ok(mut s) = std::net::TcpStream::connect(("127.0.0.1", port)) else {
        return (0, Vec::new());
    };
    let head = format!(
        "{method} {path} HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\nauthorization: Bearer {TOKEN}\r\n\
         content-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
        body.len()
    );
    if s.write_all(head.as_bytes()).is_err() || s.write_all(body).is_err() {
        return (0, Vec::new());
    }
    let mut r = Vec::new();
    let _ = s.read_to_end(&mut r);
    let Some(end) = r.windows(4).position(|w| w == b"\r\n\r\n") else {
        return (0, Vec::new());
    };
    let status = String::from_utf8_lossy(&r[..end])
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    (status, r[end + 4..].to_vec())
}

/// A backend that answers every upload with a `backendUri` (and every renewal with a token).
fn backend(rt: &tokio::runtime::Runtime) -> u16 {
    let listener = rt
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .unwrap();
    let port = listener.local_addr().unwrap().port();
    rt.spawn(async move {
        loop {
            let Ok((s, _)) = listener.accept().await else {
                return;
            };
            tokio::spawn(serve_upload(s));
        }
    });
    port
}

async fn serve_upload(mut s: tokio::net::TcpStream) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut buf = Vec::new();
    let mut chunk = vec![0u8; 64 << 10];
    let (head_end, len) = loop {
        let k = s.read(&mut chunk).await.unwrap_or(0);
        if k == 0 {
            return;
        }
        buf.extend_from_slice(&chunk[..k]);
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&buf[..i]).to_lowercase();
            let len = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length:"))
                .and_then(|v| v.trim().parse::<usize>().ok())
                .unwrap_or(0);
            break (i + 4, len);
        }
    };
    let mut got = buf.len() - head_end;
    while got < len {
        let k = s.read(&mut chunk).await.unwrap_or(0);
        if k == 0 {
            return;
        }
        got += k;
    }
    let text = json!({"backendUri": "artifact://bench/a", "backendToken": "t",
                      "tokenExpiresAt": "2099-01-01T00:00:00Z"})
    .to_string();
    let resp = format!(
        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{text}",
        text.len()
    );
    let _ = s.write_all(resp.as_bytes()).await;
}

fn create(port: u16, backend: u16) -> String {
    let req = json!({
        "workspaceRequirements": {
            "mounts": [], "capabilities": ["terminal"],
            "resourceLimits": {"cpuCores": 1, "memoryMb": 256, "diskMb": 64}
        },
        "bootstrap": {
            "backendUrl": format!("http://127.0.0.1:{backend}"),
            "backendToken": "bench-backend-token",
            "tokenExpiresAt": "2099-01-01T00:00:00Z",
            "agentId": "flood-agent",
            "artifactUploadEndpoint": format!("http://127.0.0.1:{backend}/api/artifacts"),
        },
        "template": {
            "command": ["/usr/bin/python3", "/workspace/flood.py"],
            "files": [{"path": "flood.py", "content": AGENT}],
        }
    });
    let (status, body) = http(port, "POST", "/sandboxes", req.to_string().as_bytes());
    assert_eq!(status, 201, "{}", String::from_utf8_lossy(&body));
    let v: Value = serde_json::from_slice(&body).unwrap();
    v["id"].as_str().unwrap().to_owned()
}

fn spawn(port: u16, id: &str, (mode, seconds): (Mode, u64)) {
    let brief = json!({"agentId": "flood-agent", "role": "flood", "workstream": "w",
        "providerConfig": {"mode": mode.name(), "lineBytes": LINE_BYTES, "seconds": seconds,
                           "artifactEvery": ARTIFACT_EVERY, "artifactBytes": ARTIFACT_BYTES}});
    let (status, body) = http(
        port,
        "POST",
        &format!("/sandboxes/{id}/spawn"),
        brief.to_string().as_bytes(),
    );
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
}

/// A gateway on `/events` of sandbox `id`, counting the bytes it reads.
fn gateway(rt: &tokio::runtime::Runtime, port: u16, id: &str, read: Arc<AtomicU64>) {
    let mut req = format!("ws://127.0.0.1:{port}/sandboxes/{id}/events")
        .into_client_request()
        .unwrap();
    req.headers_mut()
        .insert("authorization", format!("Bearer {TOKEN}").parse().unwrap());
    let (mut ws, _) = rt
        .block_on(tokio_tungstenite::connect_async(req))
        .expect("events");
    rt.spawn(async move {
        while let Some(Ok(m)) = ws.next().await {
            read.fetch_add(m.len() as u64, Ordering::Relaxed);
        }
    });
}

fn kib_field(pid: i32, field: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

/// Direct children of `pid` (the container helpers).
fn children(pid: i32) -> Vec<i32> {
    let mut out = Vec::new();
    for t in std::fs::read_dir(format!("/proc/{pid}/task"))
        .into_iter()
        .flatten()
        .flatten()
    {
        let s = std::fs::read_to_string(t.path().join("children")).unwrap_or_default();
        out.extend(s.split_whitespace().filter_map(|c| c.parse::<i32>().ok()));
    }
    out
}

fn du_bytes(dir: &Path) -> u64 {
    let out = Command::new("du").arg("-sxb").arg(dir).output();
    out.ok()
        .and_then(|o| {
            String::from_utf8_lossy(&o.stdout)
                .split_whitespace()
                .next()?
                .parse()
                .ok()
        })
        .unwrap_or(0)
}

/// Bytes of every sandbox's replay log (`<state>/agents/*/events`).
fn log_bytes(state: &Path) -> u64 {
    let mut total = 0;
    for sb in std::fs::read_dir(state.join("agents"))
        .into_iter()
        .flatten()
        .flatten()
    {
        for f in std::fs::read_dir(sb.path().join("events"))
            .into_iter()
            .flatten()
            .flatten()
        {
            total += f.metadata().map(|m| m.len()).unwrap_or(0);
        }
    }
    total
}

struct Sample {
    daemon_mb: f64,
    helpers_mb: f64,
    state_mb: f64,
    logs_mb: f64,
}

fn sample(d: &Daemon) -> Sample {
    let mb = |kib: u64| kib as f64 / 1024.0;
    let helpers: u64 = children(d.pid())
        .iter()
        .map(|c| kib_field(*c, "VmRSS:"))
        .sum();
    Sample {
        daemon_mb: mb(kib_field(d.pid(), "VmRSS:")),
        helpers_mb: mb(helpers),
        state_mb: du_bytes(&d.state) as f64 / (1u64 << 20) as f64,
        logs_mb: log_bytes(&d.state) as f64 / (1u64 << 20) as f64,
    }
}

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

struct Phase {
    samples: Vec<Sample>,
    stopped: Option<String>,
    gateway_mb: f64,
    seconds: f64,
}

/// What the agents flood the daemon with.
#[derive(Clone, Copy, PartialEq)]
enum Mode {
    /// Status lines of `LINE_BYTES` and an artifact every `ARTIFACT_EVERY` lines.
    Lines,
    /// Decisions with new ids.
    Decisions,
    /// Events only sandboxd may write.
    Forgeries,
}

impl Mode {
    fn name(self) -> &'static str {
        match self {
            Mode::Lines => "lines",
            Mode::Decisions => "decisions",
            Mode::Forgeries => "forgeries",
        }
    }
}

/// One phase on a fresh daemon: 16 sandboxes, their gateways if `with_gateway`, the flood, a sample a second.
/// The decision and forgery floods run with live restore on (every record change written).
fn phase(
    rt: &tokio::runtime::Runtime,
    binary: &Path,
    (n, mode): (u32, Mode),
    with_gateway: bool,
) -> Phase {
    let seconds = env_u64("AGENT_FLOOD_SECONDS", 60);
    let (rss_cap, disk_cap) = (
        env_u64("AGENT_FLOOD_RSS_CAP_MB", 3072) as f64,
        env_u64("AGENT_FLOOD_DISK_CAP_MB", 8192) as f64,
    );
    let d = Daemon::start(binary, n, mode != Mode::Lines);
    let backend = backend(rt);
    let ids: Vec<String> = (0..SANDBOXES).map(|_| create(d.port, backend)).collect();
    let read = Arc::new(AtomicU64::new(0));
    if with_gateway {
        for id in &ids {
            gateway(rt, d.port, id, read.clone());
        }
    }
    for id in &ids {
        spawn(d.port, id, (mode, seconds));
    }
    let t0 = Instant::now();
    let mut samples = Vec::new();
    let mut stopped = None;
    // The flood, then a few seconds for the queues and logs to settle.
    while t0.elapsed() < Duration::from_secs(seconds + 5) {
        std::thread::sleep(Duration::from_secs(1));
        let s = sample(&d);
        if s.daemon_mb > rss_cap || s.state_mb > disk_cap {
            stopped = Some(format!(
                "stopped after {:.0} s: daemon RSS {:.0} MiB / state {:.0} MiB over the bench's cap",
                t0.elapsed().as_secs_f64(),
                s.daemon_mb,
                s.state_mb
            ));
            samples.push(s);
            break;
        }
        samples.push(s);
    }
    let seconds = t0.elapsed().as_secs_f64();
    // Deleted before the daemon stops: with live restore a stopped daemon leaves its agents running.
    for id in &ids {
        let (status, body) = http(d.port, "DELETE", &format!("/sandboxes/{id}"), b"");
        if status != 204 {
            eprintln!(
                "DELETE /sandboxes/{id}: {status} {}",
                String::from_utf8_lossy(&body)
            );
        }
    }
    drop(d);
    Phase {
        samples,
        stopped,
        gateway_mb: read.load(Ordering::Relaxed) as f64 / (1u64 << 20) as f64,
        seconds,
    }
}

fn peak_median(v: &mut [f64]) -> (f64, f64) {
    v.sort_by(|a, b| a.total_cmp(b));
    (
        v.last().copied().unwrap_or(0.0),
        v.get(v.len() / 2).copied().unwrap_or(0.0),
    )
}

fn report(name: &str, p: &Phase) {
    let col = |f: fn(&Sample) -> f64| {
        let mut v: Vec<f64> = p.samples.iter().map(f).collect();
        peak_median(&mut v)
    };
    let (dp, dm) = col(|s| s.daemon_mb);
    let (hp, hm) = col(|s| s.helpers_mb);
    let (sp, sm) = col(|s| s.state_mb);
    let (lp, lm) = col(|s| s.logs_mb);
    println!(
        "| {name} | {dp:.0} / {dm:.0} | {hp:.0} / {hm:.0} | {sp:.0} / {sm:.0} | {lp:.0} / {lm:.0} | {:.0} MiB in {:.0} s | {} |",
        p.gateway_mb,
        p.seconds,
        p.stopped.as_deref().unwrap_or("-")
    );
}

fn main() {
    if !test_support::require_root(
        "agent flood bench",
        "it starts daemons, which create containers",
    ) {
        return;
    }
    let binary = std::env::var_os("SANDBOXD_BENCH_BINARY")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_sandboxd")));
    let rt = tokio::runtime::Runtime::new().unwrap();
    println!(
        "agent flood: {SANDBOXES} sandboxes, {LINE_BYTES}-byte lines and a {ARTIFACT_BYTES}-byte artifact every \
         {ARTIFACT_EVERY} lines, {} s a phase; daemon {}",
        env_u64("AGENT_FLOOD_SECONDS", 60),
        binary.display()
    );
    let without = phase(&rt, &binary, (0, Mode::Lines), false);
    let with = phase(&rt, &binary, (1, Mode::Lines), true);
    let decisions = phase(&rt, &binary, (2, Mode::Decisions), false);
    let forgeries = phase(&rt, &binary, (3, Mode::Forgeries), false);
    println!(
        "budget for the defaults (docs/configuration.md): daemon RSS <= {RSS_BUDGET_MB:.0} MiB, state <= {STATE_BUDGET_MB:.0} MiB \
         (replay logs) + the artifact store"
    );
    println!("| phase | daemon RSS MiB peak / median | helpers RSS MiB | state dir MiB (du -x) | replay logs MiB | read by gateways | note |");
    println!("|---|---|---|---|---|---|---|");
    report("no gateway", &without);
    report("gateway connected", &with);
    report("decisions (live restore)", &decisions);
    report("forgeries (live restore)", &forgeries);
}

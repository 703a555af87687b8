//! Live restore (`agents.live_restore`) against a real daemon: agent sandboxes outlive a daemon that is SIGKILLed,
//! stopped with SIGTERM and upgraded to another binary. After each restart the agents never stopped (no tick of
//! theirs is lost or repeated), the gateway's event stream reconnects and replays with no gap in the sequence
//! numbers, a paused agent is still paused, commands reach the agents, a sandbox without a run can spawn one, and a
//! run whose init died while the daemon was away ends as a crash with the reason. Lines the killed daemon had read
//! but not processed are processed by the next one. A sandbox with a volume is taken back with the volume's own
//! mount (mounted once); when its mounts cannot be carried over, its run ends before the volume is mounted again. The daemon runs in a mount namespace of its own, as under a
//! systemd unit with `ProtectSystem=`. Deleted at the end, nothing is left: no process, cgroup, mount
//! or pin of the mount namespace.

use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use agent_api::{AdapterEvent, AgentStatus, KillRequest};
use client::gateway::{EventStream, Gateway, SandboxClient};
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::agents::{brief, container_pids, create_request, mounts_under, until, Backend};
use super::daemon::{require_daemon, Daemon, DaemonOpts};

/// The tick number of a `tick N` status event.
fn tick(e: &AdapterEvent) -> Option<u64> {
    let m = e.event.get("message")?.as_str()?;
    m.strip_prefix("tick ")?.parse().ok()
}

fn action(e: &AdapterEvent) -> Option<&str> {
    e.event.get("action")?.as_str()
}

/// A sandbox's ticking agent, and where its event stream is.
struct Ticker {
    sb: SandboxClient,
    events: EventStream,
    /// The last sequence seen.
    seq: u64,
    /// The tick expected next.
    next: u64,
}

impl Ticker {
    /// A sandbox whose agent ticks every `every_ms`, once its first tick was seen.
    async fn start(gw: &Gateway, backend: &Backend, every_ms: u64) -> Ticker {
        let sb = gw
            .create(&create_request(backend.port, 3600))
            .await
            .unwrap();
        Self::spawned(sb, json!([{"emit_many": 1_000_000, "every_ms": every_ms}])).await
    }

    /// `sb`'s agent running `script`, which ends in ticks, once its first tick was seen.
    async fn spawned(sb: SandboxClient, script: serde_json::Value) -> Ticker {
        let mut events = sb.events(0);
        sb.spawn(&brief(script)).await.unwrap();
        let seen = until(
            &mut events,
            "the first tick",
            Duration::from_secs(30),
            |e| tick(e) == Some(0),
        )
        .await;
        let seq = seen.last().map_or(0, |e| e.source_sequence);
        Ticker {
            sb,
            events,
            seq,
            next: 1,
        }
    }

    /// Reads events for `window` and checks them: sequence numbers follow with no gap or repeat, and so do the
    /// tick numbers. Returns how many ticks came.
    async fn go_on(&mut self, window: Duration) -> u64 {
        let end = tokio::time::Instant::now() + window;
        let mut n = 0;
        while let Ok(r) = tokio::time::timeout_at(end, self.events.next()).await {
            let e = r.expect("the event stream reconnects and replays");
            assert_eq!(e.source_sequence, self.seq + 1, "a gap or a repeat: {e:?}");
            self.seq = e.source_sequence;
            if let Some(t) = tick(&e) {
                assert_eq!(t, self.next, "a tick lost or repeated: {e:?}");
                self.next += 1;
                n += 1;
            }
        }
        n
    }
}

/// Whether the daemon's mount namespace is pinned in `state` (seen from the host's namespace).
fn pinned(state: &Path) -> bool {
    let ns = state.join("mntns/ns");
    std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap_or_default()
        .lines()
        .any(|l| l.split(' ').nth(4) == ns.to_str())
}

/// A daemon with live restore; with `private_mounts`, started in a mount namespace of its own (as a systemd unit
/// with `ProtectSystem=` starts it), so its pin must go to init's namespace to outlive it.
async fn live_daemon(what: &str, private_mounts: bool) -> Option<(Daemon, Gateway)> {
    let bin = require_daemon(what)?;
    let opts = DaemonOpts {
        live_restore: true,
        private_mounts,
        ..DaemonOpts::default()
    };
    let d = Daemon::start(&bin, opts).await;
    let gw = Gateway::new(&d.http_base(), &d.token);
    assert!(d.state_dir().join("mntns").exists() && pinned(&d.state_dir()));
    Some((d, gw))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agents_outlive_a_daemon_killed_stopped_and_upgraded() {
    let Some((mut d, gw)) = live_daemon("live restore", true).await else {
        return;
    };
    let backend = Backend::start().await;
    let state = d.state_dir();

    // Three sandboxes: a ticking agent, a paused one, and one with no run yet.
    let mut a = Ticker::start(&gw, &backend, 20).await;
    let mut b = Ticker::start(&gw, &backend, 20).await;
    let paused = b.sb.pause().await.unwrap();
    b.go_on(Duration::from_millis(300)).await;
    let c = gw
        .create(&create_request(backend.port, 3600))
        .await
        .unwrap();
    let a_cid = format!("{}-1", a.sb.id());
    let a_pids = container_pids(&d.cgroup_parent, &a_cid);
    assert!(!a_pids.is_empty(), "the agent's container runs");

    for (round, how) in ["SIGKILL", "SIGTERM", "an upgrade"].iter().enumerate() {
        assert!(a.go_on(Duration::from_millis(300)).await > 0, "{how}");
        match round {
            0 => d.kill_hard(),
            _ => d.stop(),
        }
        // The daemon is gone: the agents are not.
        let pids = container_pids(&d.cgroup_parent, &a_cid);
        assert_eq!(pids, a_pids, "{how}: the agent outlives the daemon");
        tokio::time::sleep(Duration::from_millis(500)).await;
        if round == 2 {
            let upgraded = state.parent().unwrap().join("sandboxd-upgraded");
            std::fs::copy(require_daemon("live restore").unwrap(), &upgraded).unwrap();
            d.set_binary(&upgraded);
        }
        d.restart().await;
        let log = d.log();
        assert!(log.contains("taken back"), "{how}: the log says so:\n{log}");

        // The same agent, still ticking: what it wrote while the daemon was away arrives, in order, nothing lost;
        // the stream reconnected by itself and replayed.
        let pids = container_pids(&d.cgroup_parent, &a_cid);
        assert_eq!(pids, a_pids, "{how}");
        let n = a.go_on(Duration::from_millis(1500)).await;
        assert!(n >= 20, "{how}: the agent's ticks go on ({n})");
        assert!(
            a.events.reconnects > 0 && a.events.evicted.is_empty(),
            "{how}"
        );
        let health = a.sb.health().await.unwrap();
        assert_eq!(health.agent_status, AgentStatus::Running, "{how}");

        // The paused agent stays paused.
        assert_eq!(
            b.go_on(Duration::from_millis(300)).await,
            0,
            "{how}: it ran"
        );
        let health = b.sb.health().await.unwrap();
        assert_eq!(health.agent_status, AgentStatus::Paused, "{how}");
    }

    // Commands reach the adopted agents: resume, and kill with grace.
    b.sb.resume(&paused).await.unwrap();
    assert!(b.go_on(Duration::from_millis(1500)).await > 0, "resumed");
    let grace = KillRequest {
        grace: true,
        grace_timeout_ms: Some(2000),
    };
    b.sb.kill(&grace).await.unwrap();
    until(&mut b.events, "b killed", Duration::from_secs(10), |e| {
        action(e) == Some("killed")
    })
    .await;

    a_run_whose_init_died_meanwhile_ends_as_a_crash(&mut d, &c).await;
    assert!(a.go_on(Duration::from_millis(300)).await > 0);

    // Deleted, and the daemon stopped: nothing is left.
    for sb in [&a.sb, &b.sb, &c] {
        gw.delete(sb.id()).await.unwrap();
    }
    let left = mounts_under(d.pid().unwrap(), &state.join("agents"));
    assert!(left.is_empty(), "{left:#?}");
    assert!(container_pids(&d.cgroup_parent, &a_cid).is_empty());
    d.stop();
    assert!(!pinned(&state), "no sandbox is left: the pin is removed");
    assert!(!state.join("mntns").exists());
}

/// A status event's message.
fn message(e: &AdapterEvent) -> Option<&str> {
    e.event.get("message")?.as_str()
}

/// Sends `sb`'s agent `step` to run (an `update_brief` the fake agent runs as a script step) and waits for the
/// status message that starts with `answer`.
async fn agent_step(
    sb: &SandboxClient,
    events: &mut EventStream,
    step: serde_json::Value,
    answer: &str,
) {
    let mut changes = serde_json::Map::new();
    changes.insert("step".into(), step);
    sb.update_brief(changes).await.unwrap();
    until(events, answer, Duration::from_secs(15), |e| {
        message(e).is_some_and(|m| m.starts_with(answer))
    })
    .await;
}

/// Freezes container `cid`'s cgroup, as a daemon killed during a snapshot or a fork leaves it.
fn freeze(parent: &str, cid: &str) {
    let v1 = format!("/sys/fs/cgroup/freezer/{parent}/{cid}/freezer.state");
    let (file, value) = if Path::new(&v1).exists() {
        (v1, "FROZEN")
    } else {
        (format!("/sys/fs/cgroup/{parent}/{cid}/cgroup.freeze"), "1")
    };
    std::fs::write(&file, value).unwrap_or_else(|e| panic!("{file}: {e}"));
}

/// An agent on the host image keeps its files across a SIGKILL and a SIGTERM restart: it reads what it wrote
/// before, in `/workspace` and in its volume, and writes and reads new files there, on commands that still reach
/// it. (The next daemon brings the host image up to date in place: one made again detached the container's mounts
/// and left the agent an empty `/`; a stopped daemon shut the agent's connection down.) An agent a killed daemon
/// left frozen, as during a snapshot, is thawed by the next: it ticks again and `/health` says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agents_keep_their_files_and_their_commands_across_restarts() {
    let Some((mut d, gw)) = live_daemon("live restore (files)", true).await else {
        return;
    };
    let backend = Backend::start().await;
    let volume = gw
        .create_volume(&agent_api::CreateVolumeRequest {
            size_mb: 16,
            name: None,
        })
        .await;
    let (mounts, dirs) = match &volume {
        Ok(v) => (
            json!([{"volume": v.id, "path": "/workspace/data"}]),
            vec!["", "data/"],
        ),
        Err(e) => {
            eprintln!("SKIPPED the volume's part: this host has no volumes (mkfs.ext4 and loop devices): {e}");
            (json!([]), vec![""])
        }
    };
    let sb = super::volumes::sandbox(&gw, &backend, mounts)
        .await
        .unwrap();
    let mut events = sb.events(0);
    let mut script: Vec<_> = dirs
        .iter()
        .map(|dir| json!({"write": {"path": format!("{dir}before.txt"), "content": "kept"}}))
        .collect();
    script.push(json!({"emit": {"type": "status", "message": "written"}}));
    sb.spawn(&brief(json!(script))).await.unwrap();
    until(&mut events, "written", Duration::from_secs(30), |e| {
        message(e) == Some("written")
    })
    .await;
    let mut ticker = Ticker::start(&gw, &backend, 20).await;
    let ticker_cid = format!("{}-1", ticker.sb.id());

    for how in ["SIGKILL", "SIGTERM", "SIGKILL with the agent frozen"] {
        match how {
            "SIGTERM" => d.stop(),
            _ => d.kill_hard(),
        }
        if how.ends_with("frozen") {
            freeze(&d.cgroup_parent, &ticker_cid);
        }
        d.restart().await;
        for dir in &dirs {
            let before = format!("{dir}before.txt");
            let answer = format!("read {before}: kept uid ");
            agent_step(&sb, &mut events, json!({"read": before}), &answer).await;
            let name = format!("{dir}{}.txt", how.replace(' ', "-"));
            let write = json!({"write": {"path": name, "content": how}});
            agent_step(&sb, &mut events, write, "command ").await;
            let answer = format!("read {name}: {how} uid ");
            agent_step(&sb, &mut events, json!({"read": name}), &answer).await;
        }
        let n = ticker.go_on(Duration::from_millis(1500)).await;
        assert!(n >= 20, "{how}: the agent ticks on ({n})");
        let health = ticker.sb.health().await.unwrap();
        assert_eq!(health.agent_status, AgentStatus::Running, "{how}");
    }

    for id in [sb.id(), ticker.sb.id()] {
        gw.delete(id).await.unwrap();
    }
    if let Ok(v) = volume {
        gw.delete_volume(&v.id).await.unwrap();
    }
    d.stop();
    assert!(!pinned(&d.state_dir()));
}

/// Sandbox `c` (no run yet) spawns one; the daemon is killed and so is the run's whole container; the next daemon
/// reports the run crashed, with why.
async fn a_run_whose_init_died_meanwhile_ends_as_a_crash(d: &mut Daemon, c: &SandboxClient) {
    let mut events = c.events(0);
    c.spawn(&brief(json!([{"emit_many": 1_000_000, "every_ms": 50}])))
        .await
        .unwrap();
    until(
        &mut events,
        "c's first tick",
        Duration::from_secs(30),
        |e| tick(e) == Some(0),
    )
    .await;
    let cid = format!("{}-1", c.id());
    d.kill_hard();
    for pid in container_pids(&d.cgroup_parent, &cid) {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid),
            nix::sys::signal::Signal::SIGKILL,
        );
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    d.restart().await;
    let crashed = until(
        &mut events,
        "c's run to end as a crash",
        Duration::from_secs(30),
        |e| action(e) == Some("crashed"),
    )
    .await;
    let why = serde_json::to_string(&crashed.last().unwrap().event).unwrap();
    assert!(why.contains("could not be taken back"), "{why}");
}

/// A backend whose first connection is held and never answered (an upload in progress when the daemon dies); the
/// later ones get an artifact's `backendUri`. Returns its port and how many connections it got.
async fn stalling_backend() -> (u16, Arc<AtomicUsize>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let count = Arc::new(AtomicUsize::new(0));
    let n = count.clone();
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((mut s, _)) = listener.accept().await {
            if n.fetch_add(1, Ordering::SeqCst) == 0 {
                held.push(s);
                continue;
            }
            tokio::spawn(async move {
                let mut buf = vec![0u8; 1 << 16];
                let _ = tokio::time::timeout(Duration::from_millis(200), s.read(&mut buf)).await;
                let body = r#"{"backendUri":"artifact://x/1","version":1,"storedAt":"2026-01-01T00:00:00Z","sizeBytes":1}"#;
                let resp = format!(
                    "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = s.write_all(resp.as_bytes()).await;
            });
        }
    });
    (port, count)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lines_read_and_not_processed_when_the_daemon_dies_are_processed_by_the_next() {
    let Some((mut d, gw)) = live_daemon("live restore (control spool)", false).await else {
        return;
    };
    let (port, uploads) = stalling_backend().await;
    let sb = gw.create(&create_request(port, 3600)).await.unwrap();
    let mut events = sb.events(0);
    // An artifact (its upload stalls), then five ticks at once, then nothing: the daemon reads the ticks while
    // it waits for the upload.
    let script = json!([
        {"write": {"path": "a.txt", "content": "x"}},
        {"artifact": {"path": "a.txt", "artifactId": "a1"}},
        {"emit_many": 5, "every_ms": 0},
        {"sleep_ms": 600_000}
    ]);
    sb.spawn(&brief(script)).await.unwrap();
    let waited = tokio::time::timeout(Duration::from_secs(30), async {
        while uploads.load(Ordering::SeqCst) == 0 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    assert!(waited.is_ok(), "the upload started");
    tokio::time::sleep(Duration::from_millis(300)).await;
    d.kill_hard();
    d.restart().await;
    let seen = until(&mut events, "tick 4", Duration::from_secs(30), |e| {
        tick(e) == Some(4)
    })
    .await;
    let ticks: Vec<u64> = seen.iter().filter_map(tick).collect();
    assert_eq!(ticks, [0, 1, 2, 3, 4], "each tick once: {seen:#?}");
    let artifacts: Vec<&AdapterEvent> = seen
        .iter()
        .filter(|e| e.event.get("type").and_then(|t| t.as_str()) == Some("artifact"))
        .collect();
    assert_eq!(artifacts.len(), 1, "{seen:#?}");
    assert_eq!(
        artifacts[0].event["uri"], "artifact://x/1",
        "uploaded by the next daemon"
    );
    for w in seen.windows(2) {
        assert_eq!(w[1].source_sequence, w[0].source_sequence + 1, "{seen:#?}");
    }
    gw.delete(sb.id()).await.unwrap();
    d.stop();
    assert!(!pinned(&d.state_dir()));
}

/// A sandbox whose agent writes a volume and then ticks every 20 ms, once its first tick was seen.
async fn volume_ticker(gw: &Gateway, backend: &Backend, volume: &str, file: &str) -> Ticker {
    let mounts = json!([{"volume": volume, "path": "/workspace/data"}]);
    let sb = super::volumes::sandbox(gw, backend, mounts).await.unwrap();
    let script = json!([
        {"write": {"path": format!("data/{file}"), "content": "written"}},
        {"emit_many": 1_000_000, "every_ms": 20}
    ]);
    Ticker::spawned(sb, script).await
}

/// A sandbox writing a volume is taken back like any other: the volume's own mount is carried over with it (one
/// loop device, never a second mount of the file), the agent writes on and ticks on with no gap, the volume lists
/// it as its writer and scans nothing at the restart (a second writer and a deletion are refused); deleting the
/// sandbox scans what it wrote. When its mounts cannot be carried over (the previous daemon's namespace is no
/// longer pinned), its run is ended before the volume is mounted again, once, and the volume gets the lost
/// writer's scan.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sandbox_with_a_volume_is_taken_back_and_its_volume_mounted_once() {
    let Some((mut d, gw)) = live_daemon("live restore (a volume)", false).await else {
        return;
    };
    let Ok(v) = gw
        .create_volume(&agent_api::CreateVolumeRequest {
            size_mb: 16,
            name: None,
        })
        .await
    else {
        eprintln!("SKIPPED: this host has no volumes (mkfs.ext4 and loop devices)");
        return;
    };
    let backend = Backend::start().await;
    let mut a = volume_ticker(&gw, &backend, &v.id, "x.txt").await;
    let cid = format!("{}-1", a.sb.id());
    let pids = container_pids(&d.cgroup_parent, &cid);
    assert!(!pids.is_empty());
    // The daemon logs each mount(8) of a volume's file: one so far, at its creation.
    let mounted = |d: &Daemon| {
        d.log()
            .lines()
            .filter(|l| l.contains("volume filesystem mounted") && l.contains(v.id.as_str()))
            .count()
    };
    assert_eq!(mounted(&d), 1);
    d.kill_hard();
    d.restart().await;
    assert_eq!(
        container_pids(&d.cgroup_parent, &cid),
        pids,
        "the agent runs on"
    );
    let loops = super::volumes::loop_devices_on(&d.state_dir());
    assert_eq!(loops.len(), 1, "the volume is mounted once: {loops:?}");
    assert_eq!(mounted(&d), 1, "the mount was carried over, not made again");
    assert!(
        a.go_on(Duration::from_millis(1000)).await >= 10,
        "it ticks on"
    );
    let log = d.log();
    assert!(log.contains("taken back (running)"), "{log}");
    let after = gw.volume(&v.id).await.unwrap();
    assert!(
        after.recovery.is_none(),
        "no scan at the restart: {after:?}"
    );
    let writers: Vec<_> = after
        .attachments
        .iter()
        .map(|m| (m.sandbox_id.as_str(), m.read_only))
        .collect();
    assert_eq!(writers, [(a.sb.id(), false)]);
    let second = super::volumes::sandbox(
        &gw,
        &backend,
        json!([{"volume": v.id, "path": "/workspace/data"}]),
    )
    .await;
    assert_eq!(super::agents::plugin_err(second).0, 409, "one writer");
    assert!(gw.delete_volume(&v.id).await.is_err(), "in use");
    // Its deletion scans the volume as written by it: the file it wrote before the restart is there.
    gw.delete(a.sb.id()).await.unwrap();
    let after = gw.volume(&v.id).await.unwrap();
    let recovery = after.recovery.clone().expect("the writer's scan");
    assert_eq!(
        (recovery.sandbox_id.as_str(), recovery.reason.as_str()),
        (a.sb.id(), "deleted")
    );
    assert_eq!(recovery.orphans, ["x.txt"], "{recovery:?}");
    assert!(after.attachments.is_empty(), "{after:?}");

    // Mounts that cannot be carried over: the previous namespace is unpinned while no daemon runs.
    let b = volume_ticker(&gw, &backend, &v.id, "y.txt").await;
    let cid = format!("{}-1", b.sb.id());
    assert!(!container_pids(&d.cgroup_parent, &cid).is_empty());
    d.kill_hard();
    let pin = d.state_dir().join("mntns/ns");
    let unpinned = std::process::Command::new("umount")
        .arg("-l")
        .arg(&pin)
        .status()
        .unwrap();
    assert!(unpinned.success() && !pinned(&d.state_dir()));
    d.restart().await;
    assert!(
        container_pids(&d.cgroup_parent, &cid).is_empty(),
        "the run is ended"
    );
    let loops = super::volumes::loop_devices_on(&d.state_dir());
    assert_eq!(loops.len(), 1, "the volume is mounted once: {loops:?}");
    let log = d.log();
    assert!(log.contains("its mounts were not carried over"), "{log}");
    assert_eq!(super::agents::plugin_err(b.sb.health().await).0, 404);
    let after = gw.volume(&v.id).await.unwrap();
    let recovery = after.recovery.clone().expect("the lost writer's scan");
    assert_eq!(
        (recovery.sandbox_id.as_str(), recovery.reason.as_str()),
        (b.sb.id(), "restart")
    );
    assert!(
        recovery.orphans.contains(&"y.txt".to_owned()),
        "{recovery:?}"
    );
    assert!(after.attachments.is_empty(), "{after:?}");
    gw.delete_volume(&v.id).await.unwrap();
    d.stop();
    assert!(!pinned(&d.state_dir()));
}

/// The settings the agent sandboxes' host uids derive from changed between daemons: the next daemon refuses to
/// start, naming them, and the agent keeps running; with the settings back, it is taken back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_start_whose_agent_uids_moved_is_refused_and_the_agents_keep_running() {
    let Some((mut d, gw)) = live_daemon("live restore (uid settings)", false).await else {
        return;
    };
    let backend = Backend::start().await;
    let mut a = Ticker::start(&gw, &backend, 20).await;
    let cid = format!("{}-1", a.sb.id());
    let pids = container_pids(&d.cgroup_parent, &cid);
    assert!(!pids.is_empty());
    d.kill_hard();
    // Two more execution uids: the agents' range starts two higher, past the sandbox's uid.
    d.patch_config(json!({"capacity": {"max_concurrent": d.max_concurrent + 1}}));
    let status = d.start_refused();
    assert!(!status.success(), "{status:?}");
    let log = d.log();
    assert!(
        log.contains("outside this configuration's agent sandbox uids")
            && log.contains("capacity.max_concurrent"),
        "{log}"
    );
    assert_eq!(
        container_pids(&d.cgroup_parent, &cid),
        pids,
        "the agent runs on"
    );
    d.patch_config(json!({"capacity": {"max_concurrent": d.max_concurrent}}));
    d.restart().await;
    assert_eq!(container_pids(&d.cgroup_parent, &cid), pids);
    assert!(
        a.go_on(Duration::from_millis(1000)).await >= 10,
        "it ticks on"
    );
    gw.delete(a.sb.id()).await.unwrap();
    d.stop();
    assert!(!pinned(&d.state_dir()));
}

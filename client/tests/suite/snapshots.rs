//! Snapshots against a real daemon: a sandbox's `/workspace` kept and started from by other sandboxes without a
//! copy (their tmpfs stays empty until they write), owned by their own root, never changed by them; taken while the
//! agent works (frozen for the copy, running again after) and while it is paused (still paused after); a fork;
//! kept across a daemon killed and started again; not deleted while a sandbox uses it; every refusal.

use std::time::Duration;

use agent_api::AdapterEvent;
use client::gateway::{EventStream, Gateway, SandboxClient};
use serde_json::json;

use super::agents::{
    brief, create_request, mounts_under, plugin_err, start, start_with_sandbox, until, Backend,
};
use super::volumes::{run, said};

/// Bytes in use on sandbox `id`'s tmpfs (`/workspace` and `/tmp`), seen through the daemon's mount namespace.
fn tmpfs_used(d: &super::daemon::Daemon, id: &str) -> u64 {
    let path = format!(
        "/proc/{}/root{}",
        d.pid().unwrap(),
        d.state_dir()
            .join("agents")
            .join(id)
            .join("scratch")
            .display()
    );
    let st = nix::sys::statvfs::statvfs(path.as_str()).unwrap();
    (st.blocks() - st.blocks_free()) * st.fragment_size()
}

/// Sandbox `sb` reads `data/a.txt` ("one") as its own root's, writes "two" there and reads that back.
pub(super) async fn rewrites_a_txt(sb: &SandboxClient) {
    let read = run(
        sb,
        json!([
            {"read": "data/a.txt"},
            {"write": {"path": "data/a.txt", "content": "two"}},
            {"read": "data/a.txt"}
        ]),
    )
    .await;
    assert_eq!(
        read.iter()
            .filter(|m| m.starts_with("read"))
            .collect::<Vec<_>>(),
        ["read data/a.txt: one uid 0", "read data/a.txt: two uid 0"]
    );
}

/// Ticks the fake agent emitted among `events`.
fn ticks(events: &[AdapterEvent]) -> usize {
    events
        .iter()
        .filter(|e| {
            e.event["type"] == "status"
                && e.event["message"]
                    .as_str()
                    .is_some_and(|m| m.starts_with("tick"))
        })
        .count()
}

/// Events that arrive within `window`.
async fn during(events: &mut EventStream, window: Duration) -> Vec<AdapterEvent> {
    let mut seen = Vec::new();
    let end = tokio::time::Instant::now() + window;
    while let Ok(Ok(e)) = tokio::time::timeout_at(end, events.next()).await {
        seen.push(e);
    }
    seen
}

/// A sandbox whose agent ticks every 20 ms, once its first tick was seen.
async fn ticking(gw: &Gateway, backend: &Backend) -> (SandboxClient, EventStream) {
    let sb = gw
        .create(&create_request(backend.port, 3600))
        .await
        .unwrap();
    let mut events = sb.events(0);
    sb.spawn(&brief(json!([{"emit_many": 100_000, "every_ms": 20}])))
        .await
        .unwrap();
    until(&mut events, "a tick", Duration::from_secs(30), |e| {
        ticks(std::slice::from_ref(e)) == 1
    })
    .await;
    (sb, events)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_snapshot_starts_sandboxes_without_a_copy_and_outlives_the_daemon() {
    let Some((mut d, gw, backend, a)) = start_with_sandbox().await else {
        return;
    };
    let wrote = run(
        &a,
        json!([
            {"write": {"path": "data/a.txt", "content": "one"}},
            {"fill": {"path": "data/big.bin", "bytes": 8 << 20}},
            {"mkfifo": "pipe"}
        ]),
    )
    .await;
    assert_eq!(said(&wrote, "fill"), "fill data/big.bin: wrote 8388608: ok");
    let s = gw.snapshot(a.id()).await.unwrap();
    assert!(
        s.id.starts_with("snap-") && s.digest.starts_with("sha256:"),
        "{s:?}"
    );
    assert_eq!((s.source.as_str(), s.image.as_str()), (a.id(), "host"));
    // fake_agent.py, data, data/a.txt, data/big.bin (the FIFO is left out and listed).
    assert_eq!(s.files, 4, "{s:?}");
    assert!(s.bytes >= (8 << 20) + 3, "{s:?}");
    assert_eq!(s.skipped, ["pipe (not a file, directory or link)"]);
    assert_eq!(gw.snapshots().await.unwrap(), vec![s.clone()]);

    // A sandbox from it: the files are there, its root's, and its tmpfs holds none of them.
    let mut req = create_request(backend.port, 3600);
    req.from_snapshot = Some(s.id.clone());
    let b = gw.create(&req).await.unwrap();
    let used = tmpfs_used(&d, b.id());
    assert!(
        used < 1 << 20,
        "the new sandbox's tmpfs holds {used} bytes: a copy"
    );
    rewrites_a_txt(&b).await;
    // What it changed stays in its own tmpfs: the snapshot and its source still say "one".
    let layer = d.state_dir().join("snapshots").join(&s.id).join("layer");
    assert_eq!(
        std::fs::read_to_string(layer.join("data/a.txt")).unwrap(),
        "one"
    );
    let in_a = format!(
        "/proc/{}/root{}",
        d.pid().unwrap(),
        d.state_dir()
            .join("agents")
            .join(a.id())
            .join("scratch/workspace/data/a.txt")
            .display()
    );
    assert_eq!(std::fs::read_to_string(in_a).unwrap(), "one");

    // Not deleted while b uses it.
    assert_eq!(gw.snapshot_info(&s.id).await.unwrap().used_by, [b.id()]);
    let (status, e) = plugin_err(gw.delete_snapshot(&s.id).await);
    assert_eq!(status, 409, "{e:?}");
    assert!(e.to_string().contains("used by 1 sandbox"), "{e}");

    // The daemon killed and started again: the snapshot is kept (no sandbox uses it any more).
    d.kill_hard();
    d.restart().await;
    let kept = gw.snapshot_info(&s.id).await.unwrap();
    assert_eq!(
        (kept.digest.as_str(), kept.used_by.len()),
        (s.digest.as_str(), 0)
    );
    let c = gw.create(&req).await.unwrap();
    let read = run(&c, json!([{"read": "data/a.txt"}])).await;
    assert_eq!(said(&read, "read"), "read data/a.txt: one uid 0");
    gw.delete(c.id()).await.unwrap();
    assert!(gw.snapshot_info(&s.id).await.unwrap().used_by.is_empty());
    gw.delete_snapshot(&s.id).await.unwrap();
    assert_eq!(plugin_err(gw.snapshot_info(&s.id).await).0, 404);
    assert!(!d.state_dir().join("snapshots").join(&s.id).exists());
    let left = mounts_under(d.pid().unwrap(), &d.state_dir().join("agents"));
    assert!(left.is_empty(), "{left:#?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn snapshots_of_a_working_and_a_paused_agent_and_a_fork() {
    let Some((d, gw)) = start().await else {
        return;
    };
    let backend = Backend::start().await;

    // A working agent: frozen for the copy, ticking again after it.
    let (a, mut events) = ticking(&gw, &backend).await;
    let s = gw.snapshot(a.id()).await.unwrap();
    assert_eq!(s.files, 1, "fake_agent.py: {s:?}");
    let after = during(&mut events, Duration::from_millis(500)).await;
    assert!(
        ticks(&after) >= 5,
        "the agent did not run again after the snapshot: {after:?}"
    );

    // A fork while it works: the new sandbox has the workspace, the source goes on.
    let (fs, f) = gw
        .fork(a.id(), &create_request(backend.port, 3600))
        .await
        .unwrap();
    assert_eq!(fs.used_by, [f.id()]);
    assert_eq!(fs.digest, s.digest, "the same workspace, the same digest");
    let read = run(&f, json!([{"read": "fake_agent.py"}])).await;
    assert!(said(&read, "read").ends_with(" uid 0"), "{read:?}");
    let after = during(&mut events, Duration::from_millis(500)).await;
    assert!(
        ticks(&after) >= 5,
        "the source stopped after the fork: {after:?}"
    );

    // A paused agent stays paused through a snapshot, and resumes after.
    let state = a.pause().await.unwrap();
    let _ = during(&mut events, Duration::from_millis(200)).await;
    gw.snapshot(a.id()).await.unwrap();
    let meanwhile = during(&mut events, Duration::from_millis(500)).await;
    assert_eq!(ticks(&meanwhile), 0, "a paused agent ran: {meanwhile:?}");
    a.resume(&state).await.unwrap();
    let after = during(&mut events, Duration::from_millis(500)).await;
    assert!(ticks(&after) >= 5, "the agent did not resume: {after:?}");

    // Refusals.
    let mut req = create_request(backend.port, 3600);
    req.from_snapshot = Some(s.id.clone());
    req.workspace_requirements.mounts =
        serde_json::from_value(json!([{"volume": "vol-x", "path": "/workspace/data"}])).unwrap();
    let (status, e) = plugin_err(gw.create(&req).await);
    assert_eq!(status, 400, "{e:?}");
    assert!(e.to_string().contains("not with fromSnapshot"), "{e}");
    let mut req = create_request(backend.port, 3600);
    req.from_snapshot = Some("snap-none".into());
    let (status, e) = plugin_err(gw.create(&req).await);
    assert_eq!(status, 404, "{e:?}");
    assert!(e.to_string().contains("snap-none"), "{e}");
    let (status, _) = plugin_err(gw.fork(a.id(), &req).await);
    assert_eq!(status, 400, "a fork names no snapshot of its own");
    assert_eq!(plugin_err(gw.snapshot("ags-none").await).0, 404);
    let plain = create_request(backend.port, 3600);
    assert_eq!(plugin_err(gw.fork("ags-none", &plain).await).0, 404);
    assert_eq!(plugin_err(gw.snapshot_info("snap-none").await).0, 404);
    assert_eq!(plugin_err(gw.delete_snapshot("snap-none").await).0, 404);
    let raw = gw
        .raw(
            "POST",
            &format!("/sandboxes/{}/snapshot", a.id()),
            b"{\"x\":1}".to_vec(),
            Some(&d.token),
        )
        .await
        .unwrap();
    assert_eq!(raw.status, 400, "an unknown field");
    for (method, path) in [
        ("GET", "/snapshots".to_owned()),
        ("POST", format!("/sandboxes/{}/snapshot", a.id())),
    ] {
        let raw = gw.raw(method, &path, Vec::new(), None).await.unwrap();
        assert_eq!(raw.status, 401, "{method} {path} without a token");
    }
    // Neither a refused fork nor a refused creation left a snapshot or a use behind.
    let all = gw.snapshots().await.unwrap();
    assert_eq!(all.len(), 3, "{all:#?}");
    assert!(
        all.iter().all(|x| x.used_by.iter().all(|u| u == f.id())),
        "{all:#?}"
    );
}

/// A link the agent left where the next sandbox's template writes a file: the link is replaced, its target (a host
/// file) is untouched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_template_file_replaces_a_link_the_snapshot_holds() {
    let Some((_d, gw, backend, a)) = start_with_sandbox().await else {
        return;
    };
    let host = tempfile::tempdir().unwrap();
    let victim = host.path().join("victim");
    std::fs::write(&victim, "host file").unwrap();
    run(
        &a,
        json!([{"symlink": {"target": victim.to_str().unwrap(), "path": "planted.txt"}}]),
    )
    .await;
    let s = gw.snapshot(a.id()).await.unwrap();
    let mut req = create_request(backend.port, 3600);
    req.from_snapshot = Some(s.id.clone());
    req.template.as_mut().unwrap().files.push(
        serde_json::from_value(json!({"path": "planted.txt", "content": "from the template"}))
            .unwrap(),
    );
    let b = gw.create(&req).await.unwrap();
    let read = run(&b, json!([{"read": "planted.txt"}])).await;
    assert_eq!(
        said(&read, "read"),
        "read planted.txt: from the template uid 0"
    );
    assert_eq!(std::fs::read_to_string(&victim).unwrap(), "host file");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sandboxctl_snapshot_and_fork_commands() {
    let Some((d, _gw, backend, a)) = start_with_sandbox().await else {
        return;
    };
    let ctl = |args: &[&str]| d.sandboxctl(args);
    let (code, out, err) = ctl(&["sandbox", "snapshot", a.id()]);
    assert_eq!(code, Some(0), "{err}");
    let s: agent_api::Snapshot = serde_json::from_str(&out).unwrap();
    assert_eq!(s.source, a.id());
    let request = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(
        request.path(),
        serde_json::to_vec(&create_request(backend.port, 3600)).unwrap(),
    )
    .unwrap();
    let path = request.path().to_str().unwrap();
    let (code, out, err) = ctl(&["sandbox", "fork", a.id(), "--request", path]);
    assert_eq!(code, Some(0), "{err}");
    let fork: agent_api::ForkResponse = serde_json::from_str(&out).unwrap();
    assert_eq!(fork.snapshot.used_by, [fork.sandbox.id.as_str()]);
    let (code, out, err) = ctl(&["snapshot", "ls"]);
    assert_eq!(code, Some(0), "{err}");
    assert_eq!(out.lines().count(), 2, "{out}");
    let (code, out, err) = ctl(&["snapshot", "show", &fork.snapshot.id]);
    assert_eq!(code, Some(0), "{err}");
    let shown: agent_api::Snapshot = serde_json::from_str(&out).unwrap();
    assert_eq!(shown.id, fork.snapshot.id);
    // Refusals: exit 65 and the daemon's reason.
    let (code, _, err) = ctl(&["snapshot", "rm", &fork.snapshot.id]);
    assert_eq!(code, Some(65), "{err}");
    assert!(err.contains("used by 1 sandbox"), "{err}");
    let (code, _, err) = ctl(&["snapshot", "rm", "snap-nope"]);
    assert_eq!(code, Some(65), "{err}");
    assert!(err.contains("No snapshot"), "{err}");
    let (code, _, err) = ctl(&["sandbox", "snapshot", "ags-nope"]);
    assert_eq!(code, Some(65), "{err}");
    assert_eq!(ctl(&["sandbox", "rm", &fork.sandbox.id]).0, Some(0));
    for id in [&s.id, &fork.snapshot.id] {
        let (code, _, err) = ctl(&["snapshot", "rm", id]);
        assert_eq!(code, Some(0), "{err}");
    }
    let (code, out, _) = ctl(&["snapshot", "ls"]);
    assert_eq!((code, out.as_str()), (Some(0), ""));
}

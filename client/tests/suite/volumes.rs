//! Volumes against a real daemon: files that outlive the sandbox that wrote them and the daemon itself (killed,
//! then started again), the recovery scan after a deletion and after a crash, the quota (`ENOSPC` inside, the
//! state disk holding no more than the volume's size), read-only mounts, one writer at a time, no deletion while
//! mounted, unknown ids, and nothing left behind.

use std::os::unix::fs::MetadataExt;
use std::time::Duration;

use agent_api::{AdapterEvent, CreateVolumeRequest, Volume};
use client::gateway::{Gateway, GatewayError, SandboxClient};
use client::Execute as _;
use serde_json::{json, Value};

use super::agents::{
    brief, create_request, mounts_under, plugin_err, start, status_contains, until, Backend,
};

/// A sandbox with `mounts` (`workspaceRequirements.mounts`).
pub(super) async fn sandbox(
    gw: &Gateway,
    backend: &Backend,
    mounts: Value,
) -> Result<SandboxClient, GatewayError> {
    let mut req = create_request(backend.port, 3600);
    req.workspace_requirements.mounts = serde_json::from_value(mounts).unwrap();
    gw.create(&req).await
}

/// Runs the fake agent's `script` in `sb` (its first run) and returns the status messages it produced.
pub(super) async fn run(sb: &SandboxClient, script: Value) -> Vec<String> {
    // Markers of this run's own: the events are read from the first, so a second run on the same sandbox does not
    // take the first one's for its own.
    static RUNS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = RUNS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let (start, done) = (format!("script {n} start"), format!("script {n} done"));
    let mut events = sb.events(0);
    let mut steps = vec![json!({"emit": {"type": "status", "message": start}})];
    steps.extend(script.as_array().unwrap().iter().cloned());
    steps.push(json!({"emit": {"type": "status", "message": done}}));
    sb.spawn(&brief(Value::Array(steps))).await.unwrap();
    let seen = until(&mut events, &done, Duration::from_secs(30), |e| {
        status_contains(e, &done)
    })
    .await;
    let first = seen
        .iter()
        .position(|e| status_contains(e, &start))
        .unwrap_or(0);
    let seen = &seen[first..];
    sb.kill(&agent_api::KillRequest {
        grace: false,
        grace_timeout_ms: None,
    })
    .await
    .unwrap();
    seen.iter().filter_map(message).collect()
}

fn message(e: &AdapterEvent) -> Option<String> {
    (e.event["type"] == "status")
        .then(|| e.event["message"].as_str().unwrap_or_default().to_owned())
}

pub(super) fn said<'a>(messages: &'a [String], prefix: &str) -> &'a str {
    messages
        .iter()
        .find(|m| m.starts_with(prefix))
        .unwrap_or_else(|| panic!("no status {prefix:?} in {messages:#?}"))
}

pub(super) async fn volume(gw: &Gateway, size_mb: u64) -> Volume {
    gw.create_volume(&CreateVolumeRequest {
        size_mb,
        name: Some("test-data".into()),
    })
    .await
    .unwrap()
}

/// The backing files under `state` of the loop devices attached now.
pub(super) fn loop_devices_on(state: &std::path::Path) -> Vec<String> {
    let state = state.display().to_string();
    std::fs::read_dir("/sys/block")
        .unwrap()
        .flatten()
        .filter_map(|dev| std::fs::read_to_string(dev.path().join("loop/backing_file")).ok())
        .filter(|backing| backing.contains(&state))
        .collect()
}

/// No volume nor sandbox mount is left in the daemon's mount namespace, and no loop device on a volume's file.
fn nothing_mounted(d: &super::daemon::Daemon) {
    let pid = d.pid().unwrap();
    for dir in ["volumes", "agents"] {
        let left = mounts_under(pid, &d.state_dir().join(dir));
        assert!(left.is_empty(), "{left:#?}");
    }
    // The loop device goes with its last mount (autoclear), possibly a moment after the unmount.
    let attached = || loop_devices_on(&d.state_dir());
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while !attached().is_empty() && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(
        attached().is_empty(),
        "loop devices still attached: {:?}",
        attached()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_volume_outlives_its_sandboxes_and_the_daemon() {
    let Some((mut d, gw)) = start().await else {
        return;
    };
    let backend = Backend::start().await;
    let v = volume(&gw, 16).await;
    assert_eq!((v.size_bytes, v.attachments.len()), (16 << 20, 0));

    // The writer: an artifact uploaded, a file never reported.
    let a = sandbox(
        &gw,
        &backend,
        json!([{"volume": v.id, "path": "/workspace/data"}]),
    )
    .await
    .unwrap();
    let said_a = run(
        &a,
        json!([
            {"write": {"path": "data/out/a.txt", "content": "kept"}},
            {"artifact": {"path": "data/out/a.txt", "artifactId": "art-a"}},
            {"write": {"path": "data/orphan.txt", "content": "never reported"}},
            {"read": "data/out/a.txt"}
        ]),
    )
    .await;
    // The sandbox's root owns what it wrote.
    assert_eq!(
        said(&said_a, "read data/out/a.txt"),
        "read data/out/a.txt: kept uid 0"
    );
    let listed = gw.volume(&v.id).await.unwrap();
    assert_eq!(listed.attachments.len(), 1);
    assert_eq!(listed.attachments[0].sandbox_id, a.id());
    assert!(listed.used_bytes > 0);
    gw.delete(a.id()).await.unwrap();
    let r = gw.volume(&v.id).await.unwrap();
    assert!(r.attachments.is_empty());
    let rec = r
        .recovery
        .expect("a recovery report after the writer's deletion");
    assert_eq!(
        (rec.reason.as_str(), rec.sandbox_id.as_str()),
        ("deleted", a.id())
    );
    assert_eq!((rec.files, rec.uploaded), (2, 1), "{rec:?}");
    assert_eq!(rec.orphans, ["orphan.txt"]);
    assert_eq!(
        backend
            .seen()
            .iter()
            .filter(|s| s.path == "/api/artifacts")
            .count(),
        1
    );

    // A new writer sees the files, and the daemon dies under it.
    let b = sandbox(
        &gw,
        &backend,
        json!([{"volume": v.id, "path": "/workspace/data"}]),
    )
    .await
    .unwrap();
    let said_b = run(
        &b,
        json!([{"read": "data/out/a.txt"}, {"write": {"path": "data/late.txt", "content": "x"}}]),
    )
    .await;
    assert_eq!(
        said(&said_b, "read data/out/a.txt"),
        "read data/out/a.txt: kept uid 0"
    );
    d.kill_hard();
    d.restart().await;
    let r = gw.volume(&v.id).await.unwrap();
    assert_eq!(
        (r.name.as_deref(), r.size_bytes),
        (Some("test-data"), 16 << 20)
    );
    assert!(r.attachments.is_empty());
    let rec = r
        .recovery
        .expect("a recovery report after the daemon's restart");
    assert_eq!(
        (rec.reason.as_str(), rec.sandbox_id.as_str()),
        ("restart", b.id())
    );
    assert_eq!(rec.orphans, ["late.txt", "orphan.txt"]);
    let c = sandbox(
        &gw,
        &backend,
        json!([{"volume": v.id, "path": "/workspace/v", "readOnly": true}]),
    )
    .await
    .unwrap();
    let said_c = run(&c, json!([{"read": "v/out/a.txt"}, {"read": "v/late.txt"}])).await;
    assert_eq!(
        said(&said_c, "read v/out/a.txt"),
        "read v/out/a.txt: kept uid 0"
    );
    assert_eq!(said(&said_c, "read v/late.txt"), "read v/late.txt: x uid 0");
    gw.delete(c.id()).await.unwrap();

    // Deleted, nothing is left: no directory, no mount in the daemon's namespace.
    gw.delete_volume(&v.id).await.unwrap();
    assert_eq!(plugin_err(gw.volume(&v.id).await).0, 404);
    assert!(gw.volumes().await.unwrap().is_empty());
    assert_eq!(
        std::fs::read_dir(d.state_dir().join("volumes"))
            .unwrap()
            .count(),
        0
    );
    nothing_mounted(&d);
}

/// Bad sizes and names, no token, unknown ids (also in a sandbox's mounts), a `hostPath` mount.
async fn refusals_without_a_volume(d: &super::daemon::Daemon, gw: &Gateway, backend: &Backend) {
    for (body, status, says) in [
        (json!({"sizeMb": 1}), 400, "sizeMb"),
        (json!({"sizeMb": 1_000_000}), 400, "agents.volume_max_mb"),
        (json!({"sizeMb": 8, "name": "no spaces"}), 400, "name"),
        (json!({"sizeMb": 8, "extra": 1}), 400, "extra"),
    ] {
        let a = gw
            .raw(
                "POST",
                "/volumes",
                body.to_string().into_bytes(),
                Some(&d.token),
            )
            .await
            .unwrap();
        let text = String::from_utf8_lossy(&a.body).to_string();
        assert_eq!(a.status, status, "{body}: {text}");
        assert!(
            text.contains(says) && text.contains("invalid_state"),
            "{body}: {text}"
        );
    }
    let a = gw.raw("GET", "/volumes", Vec::new(), None).await.unwrap();
    assert_eq!(a.status, 401);
    for r in [
        gw.volume("vol-nope").await.map(drop),
        gw.delete_volume("vol-nope").await,
    ] {
        assert_eq!(plugin_err(r).0, 404);
    }
    assert_eq!(
        plugin_err(
            sandbox(
                gw,
                backend,
                json!([{"volume": "vol-nope", "path": "/workspace/x"}])
            )
            .await
        )
        .0,
        404
    );
    let (status, e) = plugin_err(
        sandbox(
            gw,
            backend,
            json!([{"hostPath": "./src", "path": "/workspace/src"}]),
        )
        .await,
    );
    assert_eq!(status, 422, "{e:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn volume_quotas_writers_and_refusals() {
    let Some((d, gw)) = start().await else {
        return;
    };
    let backend = Backend::start().await;
    refusals_without_a_volume(&d, &gw, &backend).await;

    let v = volume(&gw, 16).await;
    let w = sandbox(
        &gw,
        &backend,
        json!([{"volume": v.id, "path": "/workspace/data"}]),
    )
    .await
    .unwrap();
    // A second writer is refused; a reader is not.
    let (status, e) = plugin_err(
        sandbox(
            &gw,
            &backend,
            json!([{"volume": v.id, "path": "/workspace/data"}]),
        )
        .await,
    );
    assert_eq!(status, 409, "{e:?}");
    assert!(e.to_string().contains(w.id()), "{e}");
    let r = sandbox(
        &gw,
        &backend,
        json!([{"volume": v.id, "path": "/workspace/data", "readOnly": true}]),
    )
    .await
    .unwrap();
    assert_eq!(plugin_err(gw.delete_volume(&v.id).await).0, 409);

    // The quota: 16 MiB of filesystem; 64 MiB asked for ends with ENOSPC inside.
    let said_w = run(
        &w,
        json!([{"fill": {"path": "data/big", "bytes": 64 << 20}}]),
    )
    .await;
    let fill = said(&said_w, "fill data/big");
    assert!(fill.ends_with(": ENOSPC"), "{fill}");
    let wrote: u64 = fill
        .split(": wrote ")
        .nth(1)
        .unwrap()
        .split(':')
        .next()
        .unwrap()
        .parse()
        .unwrap();
    assert!(wrote > 4 << 20 && wrote < 16 << 20, "{fill}");
    let img = d.state_dir().join("volumes").join(&v.id).join("disk.img");
    let md = std::fs::metadata(&img).unwrap();
    assert_eq!(md.len(), 16 << 20);
    assert!(
        md.blocks() * 512 <= 16 << 20,
        "the image holds {} bytes",
        md.blocks() * 512
    );
    // Read-only: the reader cannot write.
    let said_r = run(
        &r,
        json!([{"fill": {"path": "data/x", "bytes": 1}}, {"read": "data/big"}]),
    )
    .await;
    assert_eq!(said(&said_r, "fill data/x"), "fill data/x: wrote 0: EROFS");

    gw.delete(w.id()).await.unwrap();
    gw.delete(r.id()).await.unwrap();
    gw.delete_volume(&v.id).await.unwrap();
    nothing_mounted(&d);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sandboxctl_volume_commands() {
    let Some((d, _gw)) = start().await else {
        return;
    };
    let ctl = |args: &[&str]| d.sandboxctl(args);
    let (code, out, err) = ctl(&["volume", "create", "--size-mb", "8", "--name", "ctl"]);
    assert_eq!(code, Some(0), "{err}");
    let v: Volume = serde_json::from_str(&out).unwrap();
    assert_eq!((v.size_bytes, v.name.as_deref()), (8 << 20, Some("ctl")));
    let (code, out, err) = ctl(&["volume", "ls"]);
    assert_eq!(code, Some(0), "{err}");
    let listed: Vec<Volume> = out
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].id, v.id);
    let (code, out, err) = ctl(&["volume", "show", &v.id]);
    assert_eq!(code, Some(0), "{err}");
    assert_eq!(serde_json::from_str::<Volume>(&out).unwrap().id, v.id);
    // Refusals: exit 65 and the daemon's reason.
    let (code, _, err) = ctl(&["volume", "create", "--size-mb", "1"]);
    assert_eq!(code, Some(65), "{err}");
    assert!(err.contains("sizeMb"), "{err}");
    let (code, _, err) = ctl(&["volume", "rm", "vol-nope"]);
    assert_eq!(code, Some(65), "{err}");
    assert!(err.contains("No volume"), "{err}");
    let (code, _, err) = ctl(&["volume", "rm", &v.id]);
    assert_eq!(code, Some(0), "{err}");
    let (code, out, _) = ctl(&["volume", "ls"]);
    assert_eq!((code, out.as_str()), (Some(0), ""));
}

fn execution(code: &str, mounts: Value) -> client::ExecuteRequest {
    let mut req = client::ExecuteRequest::new(
        client::new_execution_id(),
        client::Language::Shell,
        code,
        client::RequestedLimits::new(20_000, 128),
    );
    req.mounts = serde_json::from_value(mounts).unwrap();
    req
}

/// Executions (extension `volumes`): a file written by one read-write execution is read by the next, as the
/// container's own root's; a read-only mount refuses writes; a writer is refused while a sandbox writes the
/// volume; unknown volumes and bad paths are `INVALID_REQUEST`; the volume is free once the execution is over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn executions_mount_volumes() {
    let Some((d, gw)) = start().await else {
        return;
    };
    let pool = client::Pool::builder(d.url())
        .token(d.token.clone())
        .build()
        .unwrap();
    let v = volume(&gw, 16).await;
    let rw = json!([{"volume": v.id, "path": "/workspace/data"}]);
    let ro = json!([{"volume": v.id, "path": "/workspace/ref", "read_only": true}]);

    let r = pool
        .execute(execution(
            "echo kept > data/f && stat -c %u data/f && ls",
            rw.clone(),
        ))
        .await
        .unwrap();
    assert_eq!(r.exit_code, Some(0), "{r:?}");
    assert!(r.stdout_text().starts_with("0\n"), "{r:?}");
    let r = pool
        .execute(execution(
            "cat ref/f; echo x > ref/g || echo refused",
            ro.clone(),
        ))
        .await
        .unwrap();
    assert_eq!(r.stdout_text(), "kept\nrefused\n", "{r:?}");
    assert!(r.stderr_text().contains("Read-only file system"), "{r:?}");

    // While a sandbox writes the volume, an execution may read it but not write it.
    let backend = Backend::start().await;
    let sb = sandbox(
        &gw,
        &backend,
        json!([{"volume": v.id, "path": "/workspace/data"}]),
    )
    .await
    .unwrap();
    let e = pool
        .execute(execution("true", rw.clone()))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Some(protocol::ErrorCode::InvalidRequest), "{e}");
    assert!(e.to_string().contains(sb.id()), "{e}");
    let r = pool.execute(execution("cat ref/f", ro)).await.unwrap();
    assert_eq!(r.stdout_text(), "kept\n", "{r:?}");
    gw.delete(sb.id()).await.unwrap();

    for (mounts, says) in [
        (
            json!([{"volume": "vol-nope", "path": "/workspace/x"}]),
            "No volume",
        ),
        (
            json!([{"volume": v.id, "path": "/etc"}]),
            "not under /workspace",
        ),
        (
            json!([{"volume": v.id, "path": "/workspace/a"}, {"volume": v.id, "path": "/workspace/b"}]),
            "overlaps",
        ),
    ] {
        let e = pool
            .execute(execution("true", mounts.clone()))
            .await
            .unwrap_err();
        assert_eq!(
            e.code(),
            Some(protocol::ErrorCode::InvalidRequest),
            "{mounts}: {e}"
        );
        assert!(e.to_string().contains(says), "{mounts}: {e}");
    }
    // Released once the executions are over (removal runs in the background).
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let held = gw.volume(&v.id).await.unwrap().attachments;
        if held.is_empty() {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "still held: {held:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    gw.delete_volume(&v.id).await.unwrap();
    nothing_mounted(&d);
}

//! The btrfs workspace store (`agents.workspace_store: btrfs`) against a real daemon: each `/workspace` a
//! subvolume with the sandbox's `diskMb` as its quota (`EDQUOT` past it, the other sandboxes unaffected), a
//! snapshot and a fork that copy nothing (the fork's digest computed after it returned, the same as the
//! snapshot's), files owned by each sandbox's own root, a fork that holds nothing of its snapshot, the store
//! carried over a daemon killed with live restore (mounted once), and nothing left in it once the sandboxes and
//! snapshots are deleted.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use client::gateway::{Gateway, SandboxClient};
use serde_json::json;

use super::agents::{create_request, mounts_under, plugin_err, Backend};
use super::daemon::{require_daemon, Daemon, DaemonOpts};
use super::volumes::{run, said};

/// `<state_dir>/workspaces/mnt/<sub>` as the daemon sees it.
fn in_store(d: &Daemon, sub: &str) -> PathBuf {
    PathBuf::from(format!(
        "/proc/{}/root{}",
        d.pid().unwrap(),
        d.state_dir().join("workspaces/mnt").join(sub).display()
    ))
}

fn names(dir: &std::path::Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

/// A daemon with live restore whose workspaces are in the btrfs store; `None` (with why) where btrfs or its tools
/// are missing.
async fn cow_daemon() -> Option<(Daemon, Gateway)> {
    let bin = require_daemon("the btrfs workspace store")?;
    let usable = std::fs::read_to_string("/proc/filesystems")
        .is_ok_and(|f| f.lines().any(|l| l.trim_end().ends_with("btrfs")))
        && [
            "/usr/sbin/mkfs.btrfs",
            "/sbin/mkfs.btrfs",
            "/usr/bin/mkfs.btrfs",
        ]
        .iter()
        .any(|p| std::path::Path::new(p).exists());
    if !usable {
        test_support::cannot_run(
            "the btrfs workspace store",
            "no btrfs in /proc/filesystems or no mkfs.btrfs (apt install btrfs-progs)",
        );
        return None;
    }
    let opts = DaemonOpts {
        live_restore: true,
        ..DaemonOpts::default()
    };
    let mut d = Daemon::start(&bin, opts).await;
    d.stop();
    d.patch_config(json!({"agents": {"workspace_store": "btrfs", "workspace_store_mb": 65536}}));
    d.restart().await;
    let gw = Gateway::new(&d.http_base(), &d.token);
    Some((d, gw))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_btrfs_store_snapshots_and_forks_without_a_copy_and_keeps_each_quota() {
    let Some((mut d, gw)) = cow_daemon().await else {
        return;
    };
    let backend = Backend::start().await;
    let a = gw
        .create(&create_request(backend.port, 3600))
        .await
        .unwrap();
    assert_eq!(names(&in_store(&d, "ws")), [a.id()]);
    let wrote = run(
        &a,
        json!([
            {"write": {"path": "data/a.txt", "content": "one"}},
            {"fill": {"path": "data/big.bin", "bytes": 8 << 20}},
            {"read": "data/a.txt"},
            {"subvolume": "sub"}
        ]),
    )
    .await;
    assert_eq!(said(&wrote, "fill"), "fill data/big.bin: wrote 8388608: ok");
    // A subvolume of its own would have no quota: both creation calls are refused by the seccomp profile.
    assert_eq!(said(&wrote, "subvolume"), "subvolume sub: EPERM EPERM");
    assert_eq!(said(&wrote, "read"), "read data/a.txt: one uid 0");
    // On disk the files are owned by 0 (the idmapped bind), whatever host uid the sandbox has.
    let on_disk = in_store(&d, "ws").join(a.id()).join("data/a.txt");
    assert_eq!(
        std::os::unix::fs::MetadataExt::uid(&std::fs::metadata(&on_disk).unwrap()),
        0
    );

    let s = gw.snapshot(a.id()).await.unwrap();
    assert!(s.digest.starts_with("sha256:"), "{s:?}");
    // fake_agent.py, data, data/a.txt, data/big.bin.
    assert_eq!(s.files, 4, "{s:?}");
    assert_eq!(names(&in_store(&d, "snap")), std::slice::from_ref(&s.id));

    // A fork: its snapshot's digest comes after the return, the same as the first snapshot's (the same files).
    let (fs, f) = gw
        .fork(a.id(), &create_request(backend.port, 3600))
        .await
        .unwrap();
    assert_eq!(fs.files, 4, "{fs:?}");
    assert!(
        fs.used_by.is_empty(),
        "a workspace of the store holds nothing of its snapshot: {fs:?}"
    );
    let start = Instant::now();
    let digest = loop {
        let now = gw.snapshot_info(&fs.id).await.unwrap();
        if !now.digest.is_empty() || start.elapsed() > Duration::from_secs(30) {
            break now.digest;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(digest, s.digest, "the same files, the same digest");
    // The fork reads the files as its own root's, changes them, and neither the source nor the snapshot sees it.
    super::snapshots::rewrites_a_txt(&f).await;
    let in_a = run(&a, json!([{"read": "data/a.txt"}])).await;
    assert_eq!(said(&in_a, "read"), "read data/a.txt: one uid 0");
    let snap_file = in_store(&d, "snap").join(&s.id).join("data/a.txt");
    assert_eq!(std::fs::read_to_string(&snap_file).unwrap(), "one");
    // The snapshots can go while the fork lives: it holds nothing of them.
    gw.delete_snapshot(&fs.id).await.unwrap();

    quotas(&d, &a, &f).await;

    // Killed and started again: the store's mount is carried over (mounted once in all), the fork's files are
    // there.
    d.kill_hard();
    d.restart().await;
    let mounted = d.log().matches("workspace store mounted").count();
    assert_eq!(mounted, 1, "the store was mounted again at the restart");
    let again = run(&f, json!([{"read": "data/a.txt"}])).await;
    assert_eq!(said(&again, "read"), "read data/a.txt: two uid 0");
    assert_eq!(gw.snapshot_info(&s.id).await.unwrap().digest, s.digest);

    refusals(&gw, &backend, &s.id).await;

    // Deleted: nothing is left in the store or mounted.
    gw.delete(a.id()).await.unwrap();
    gw.delete(f.id()).await.unwrap();
    gw.delete_snapshot(&s.id).await.unwrap();
    assert!(names(&in_store(&d, "ws")).is_empty());
    assert!(names(&in_store(&d, "snap")).is_empty());
    let left = mounts_under(d.pid().unwrap(), &d.state_dir().join("agents"));
    assert!(left.is_empty(), "{left:#?}");
}

/// The quota: diskMb 64, counting the 8 MiB the fork `f` started with; 2 x 40 MiB ends with EDQUOT there, and the
/// source `a` still writes. Health reports each one's quota group.
async fn quotas(d: &Daemon, a: &SandboxClient, f: &SandboxClient) {
    let filled = run(
        f,
        json!([
            {"fill": {"path": "x1", "bytes": 40 << 20}},
            {"fill": {"path": "x2", "bytes": 40 << 20}}
        ]),
    )
    .await;
    assert_eq!(said(&filled, "fill x1"), "fill x1: wrote 41943040: ok");
    let fill = said(&filled, "fill x2");
    assert!(fill.ends_with(": EDQUOT"), "{fill}");
    let more = run(a, json!([{"fill": {"path": "y", "bytes": 16 << 20}}])).await;
    assert_eq!(said(&more, "fill y"), "fill y: wrote 16777216: ok");
    // Health reports each one's quota group, not the store's filesystem: the fork near its 64 MiB, the source at
    // its 8 + 16 MiB (as of the store's last commit, made here).
    let store = std::fs::File::open(in_store(d, "ws")).unwrap();
    nix::unistd::syncfs(std::os::fd::AsRawFd::as_raw_fd(&store)).unwrap();
    let (hf, ha) = (f.health().await.unwrap(), a.health().await.unwrap());
    let (used_f, used_a) = (hf.resource_usage.disk_mb, ha.resource_usage.disk_mb);
    assert!(
        used_f > 48.0 && used_f <= 64.5,
        "the fork uses {used_f} MiB"
    );
    assert!(
        used_a > 23.0 && used_a < 30.0,
        "the source uses {used_a} MiB"
    );
}

/// What is refused: an unknown snapshot; a sandbox from snapshot `snap` (8 MiB) with a quota below it; a snapshot
/// of a sparse file past `agents.disk_mb` (a snapshot's size is its files' sizes, not the blocks they take, as for
/// a copy: its digest reads every byte), which leaves nothing behind.
async fn refusals(gw: &Gateway, backend: &Backend, snap: &str) {
    let mut req = create_request(backend.port, 3600);
    req.from_snapshot = Some("snap-none".into());
    assert_eq!(plugin_err(gw.create(&req).await).0, 404);
    let mut req = create_request(backend.port, 3600);
    req.from_snapshot = Some(snap.into());
    if let Some(l) = req.workspace_requirements.resource_limits.as_mut() {
        l.disk_mb = Some(4);
    }
    let (status, e) = plugin_err(gw.create(&req).await);
    assert_eq!(status, 409, "{e:?}");
    assert!(
        e.to_string().contains("more than the sandbox's diskMb"),
        "{e}"
    );
    let g = gw
        .create(&create_request(backend.port, 3600))
        .await
        .unwrap();
    // 20 x 60 MiB, each under the file size limit (diskMb), 1.2 GiB in all: more than agents.disk_mb (1 GiB).
    let holes: Vec<_> = (0..20)
        .map(|i| json!({"sparse": {"path": format!("hole{i}"), "bytes": 60u64 << 20}}))
        .collect();
    let made = run(&g, json!(holes)).await;
    assert_eq!(said(&made, "sparse hole19"), "sparse hole19: ok");
    let before = gw.snapshots().await.unwrap();
    let (status, e) = plugin_err(gw.snapshot(g.id()).await);
    assert_eq!(status, 409, "{e:?}");
    let (status, _) = plugin_err(gw.fork(g.id(), &create_request(backend.port, 3600)).await);
    assert_eq!(status, 409);
    assert_eq!(gw.snapshots().await.unwrap(), before);
    gw.delete(g.id()).await.unwrap();
}

//! The volume registry on directories (no mounts, no privilege): quotas and names checked, one writer at a time,
//! no deletion while mounted, volumes and a lost writer's recovery scan across a restart, the scan's
//! classification and re-upload, mount plans.

use std::sync::Mutex;

use agent_api::WorkspaceMount;

use super::*;

/// Directories for filesystems; attachments only noted.
#[derive(Default)]
struct FakeDisks {
    attached: Mutex<Vec<(PathBuf, u32, bool)>>,
    /// Mounts fail (a host that lost its loop devices).
    broken: std::sync::atomic::AtomicBool,
}

impl Disks for FakeDisks {
    fn create(&self, dir: &Path, _bytes: u64) -> Result<(), BoxError> {
        Ok(std::fs::create_dir(dir.join("mnt"))?)
    }
    fn mount(&self, _dir: &Path) -> Result<(), BoxError> {
        match self.broken.load(std::sync::atomic::Ordering::SeqCst) {
            true => Err("no loop devices".into()),
            false => Ok(()),
        }
    }
    fn unmount(&self, _dir: &Path) -> Result<(), BoxError> {
        Ok(())
    }
    fn attach(&self, _dir: &Path, target: &Path, host_id: u32, ro: bool) -> Result<(), BoxError> {
        self.attached
            .lock()
            .unwrap()
            .push((target.to_owned(), host_id, ro));
        Ok(())
    }
    fn used_bytes(&self, _dir: &Path) -> u64 {
        0
    }
}

fn open(dir: &Path, disks: &Arc<FakeDisks>) -> Arc<Volumes> {
    open_holding(dir, disks, &[])
}

/// [`open`] with the mounts of sandboxes taken back.
fn open_holding(dir: &Path, disks: &Arc<FakeDisks>, held: &[(String, Mounted)]) -> Arc<Volumes> {
    Volumes::open(dir.join("volumes"), disks.clone(), (64, 2), held).unwrap()
}

fn held(sandbox: &str, volume: &str, path: &str, read_only: bool) -> (String, Mounted) {
    (
        sandbox.to_owned(),
        Mounted {
            volume: volume.to_owned(),
            path: path.to_owned(),
            rel: path
                .trim_start_matches("/workspace")
                .trim_start_matches('/')
                .to_owned(),
            read_only,
        },
    )
}

fn req(size_mb: u64, name: Option<&str>) -> CreateVolumeRequest {
    CreateVolumeRequest {
        size_mb,
        name: name.map(str::to_owned),
    }
}

#[tokio::test]
async fn volumes_are_created_listed_refused_and_deleted() {
    let tmp = tempfile::tempdir().unwrap();
    let vols = open(tmp.path(), &Arc::default());
    for (size, name, what) in [
        (4, None, "sizeMb"),
        (65, None, "sizeMb"),
        (8, Some("a b"), "name"),
        (8, Some(""), "name"),
    ] {
        match vols.create(req(size, name)).await {
            Err(e @ VolumeError::Invalid(_)) => {
                assert!(e.to_string().contains(what), "{e}");
                assert_eq!(e.plugin().0, 400);
            }
            other => panic!("{size} {name:?}: {other:?}"),
        }
    }
    let a = vols.create(req(8, Some("data-1"))).await.unwrap();
    assert!(a.id.starts_with("vol-"), "{}", a.id);
    assert_eq!((a.size_bytes, a.name.as_deref()), (8 << 20, Some("data-1")));
    let b = vols.create(req(64, None)).await.unwrap();
    match vols.create(req(8, None)).await {
        Err(e @ VolumeError::Full(2)) => assert_eq!(e.plugin().0, 503),
        other => panic!("a third volume: {other:?}"),
    }
    assert_eq!(vols.list().len(), 2);
    assert_eq!(vols.get(&b.id).unwrap().id, b.id);
    vols.delete(&a.id).await.unwrap();
    assert!(!tmp.path().join("volumes").join(&a.id).exists());
    for e in [
        vols.get(&a.id).unwrap_err(),
        vols.delete(&a.id).await.unwrap_err(),
    ] {
        assert!(matches!(e, VolumeError::NotFound(_)), "{e}");
        assert_eq!(e.plugin().0, 404);
    }
    assert_eq!(vols.list().len(), 1);
}

#[tokio::test]
async fn one_writer_at_a_time_and_no_deletion_while_mounted() {
    let tmp = tempfile::tempdir().unwrap();
    let disks = Arc::new(FakeDisks::default());
    let vols = open(tmp.path(), &disks);
    let v = vols.create(req(8, None)).await.unwrap().id;
    let (ta, tb, tc) = (
        tmp.path().join("a"),
        tmp.path().join("b"),
        tmp.path().join("c"),
    );
    vols.attach(&v, "sb-a", (&ta, "/workspace/data"), 7, false)
        .await
        .unwrap();
    let e = vols
        .attach(&v, "sb-b", (&tb, "/workspace"), 8, false)
        .await
        .unwrap_err();
    assert!(
        matches!(&e, VolumeError::Busy { writer, .. } if writer == "sb-a"),
        "{e}"
    );
    assert_eq!(e.plugin().0, 409);
    // Readers alongside the writer.
    vols.attach(&v, "sb-c", (&tc, "/workspace/ro"), 9, true)
        .await
        .unwrap();
    assert_eq!(
        *disks.attached.lock().unwrap(),
        vec![(ta.clone(), 7, false), (tc.clone(), 9, true)]
    );
    let e = vols.delete(&v).await.unwrap_err();
    assert!(matches!(e, VolumeError::InUse { sandboxes: 2, .. }), "{e}");
    let listed = vols.get(&v).unwrap().attachments;
    assert_eq!(listed.len(), 2);
    assert_eq!(
        (listed[0].sandbox_id.as_str(), listed[0].read_only),
        ("sb-a", false)
    );
    vols.release(&v, "sb-a", "/workspace/data", false).await;
    vols.attach(&v, "sb-b", (&tb, "/workspace"), 8, false)
        .await
        .unwrap();
    vols.release(&v, "sb-b", "/workspace", false).await;
    vols.release(&v, "sb-c", "/workspace/ro", true).await;
    assert!(vols.get(&v).unwrap().attachments.is_empty());
    vols.delete(&v).await.unwrap();
}

/// Files of a volume written by `sandbox`: `a` uploaded, `b` whose upload failed, `c` never reported,
/// `lost+found` ignored.
async fn write_and_record(vols: &Arc<Volumes>, dir: &Path, id: &str, sandbox: &str) {
    let mnt = dir.join("volumes").join(id).join("mnt");
    std::fs::create_dir_all(mnt.join("out/deep")).unwrap();
    std::fs::create_dir_all(mnt.join("lost+found")).unwrap();
    for f in ["out/a.txt", "out/deep/b.txt", "c.txt", "lost+found/x"] {
        std::fs::write(mnt.join(f), f).unwrap();
    }
    vols.record_artifact(id, sandbox, "out/a.txt".into(), true)
        .await;
    vols.record_artifact(id, sandbox, "out/deep/b.txt".into(), false)
        .await;
}

#[tokio::test]
async fn a_writer_lost_with_the_daemon_is_scanned_at_the_next_start() {
    let tmp = tempfile::tempdir().unwrap();
    let disks = Arc::new(FakeDisks::default());
    let vols = open(tmp.path(), &disks);
    let id = vols.create(req(8, Some("keep"))).await.unwrap().id;
    let target = tmp.path().join("t");
    vols.attach(&id, "sb-lost", (&target, "/workspace/data"), 7, false)
        .await
        .unwrap();
    write_and_record(&vols, tmp.path(), &id, "sb-lost").await;
    // An unfinished creation of the previous daemon, a stray file and a volume whose metadata is garbled: the
    // first is removed, the others left as they are (logged), and the daemon starts.
    std::fs::create_dir_all(tmp.path().join("volumes/vol-unfinished/mnt")).unwrap();
    std::fs::write(tmp.path().join("volumes/stray"), "x").unwrap();
    std::fs::create_dir_all(tmp.path().join("volumes/vol-garbled")).unwrap();
    std::fs::write(tmp.path().join("volumes/vol-garbled/volume.json"), "{").unwrap();
    drop(vols);

    let vols = open(tmp.path(), &disks);
    assert!(!tmp.path().join("volumes/vol-unfinished").exists());
    assert!(tmp.path().join("volumes/vol-garbled/volume.json").exists());
    assert_eq!(vols.list().len(), 1);
    let v = vols.get(&id).unwrap();
    assert_eq!(v.name.as_deref(), Some("keep"));
    assert!(v.attachments.is_empty());
    let r = v.recovery.unwrap();
    assert_eq!(
        (r.sandbox_id.as_str(), r.reason.as_str()),
        ("sb-lost", "restart")
    );
    assert_eq!((r.files, r.uploaded), (3, 1));
    assert_eq!(r.not_uploaded, ["out/deep/b.txt"]);
    assert_eq!(r.orphans, ["c.txt"]);
    assert!(r.reuploaded.is_empty());
    // The writer is no longer recorded: another may mount it read-write, and a third start scans nothing.
    vols.attach(&id, "sb-next", (&target, "/workspace"), 8, false)
        .await
        .unwrap();
    vols.release(&id, "sb-next", "/workspace", false).await;
    drop(vols);
    let vols = open(tmp.path(), &disks);
    assert_eq!(
        vols.get(&id).unwrap().recovery.unwrap().sandbox_id,
        "sb-lost"
    );
}

/// A writer taken back by the next daemon (live restore) is not a lost writer: its volume is not scanned, it and
/// its readers are the volume's attachments (a second writer and a deletion are refused), and its removal scans
/// as usual. A writer the next daemon does not take back is scanned as lost, even when a reader is held.
#[tokio::test]
async fn a_writer_taken_back_by_the_next_daemon_keeps_its_volume() {
    let tmp = tempfile::tempdir().unwrap();
    let disks = Arc::new(FakeDisks::default());
    let vols = open(tmp.path(), &disks);
    let id = vols.create(req(8, None)).await.unwrap().id;
    let other = vols.create(req(8, None)).await.unwrap().id;
    let target = tmp.path().join("t");
    for (v, sb) in [(&id, "sb-kept"), (&other, "sb-gone")] {
        vols.attach(v, sb, (&target, "/workspace/data"), 7, false)
            .await
            .unwrap();
        write_and_record(&vols, tmp.path(), v, sb).await;
    }
    vols.attach(&id, "sb-reader", (&target, "/workspace/ro"), 9, true)
        .await
        .unwrap();
    drop(vols);

    let kept = [
        held("sb-kept", &id, "/workspace/data", false),
        held("sb-reader", &id, "/workspace/ro", true),
        held("sb-reader2", &other, "/workspace/ro", true),
    ];
    let vols = open_holding(tmp.path(), &disks, &kept);
    let v = vols.get(&id).unwrap();
    assert!(v.recovery.is_none(), "no scan: {:?}", v.recovery);
    let seen: Vec<_> = v
        .attachments
        .iter()
        .map(|a| (a.sandbox_id.as_str(), a.read_only))
        .collect();
    assert_eq!(seen, [("sb-kept", false), ("sb-reader", true)]);
    let e = vols
        .attach(&id, "sb-b", (&target, "/workspace"), 8, false)
        .await
        .unwrap_err();
    assert!(
        matches!(&e, VolumeError::Busy { writer, .. } if writer == "sb-kept"),
        "{e}"
    );
    assert!(matches!(
        vols.delete(&id).await,
        Err(VolumeError::InUse { .. })
    ));
    // The other volume's writer was not taken back: scanned as lost, its held reader attached.
    let o = vols.get(&other).unwrap();
    assert_eq!(o.recovery.map(|r| r.sandbox_id), Some("sb-gone".to_owned()));
    assert_eq!(o.attachments.len(), 1);
    // The kept writer's removal scans its files, then frees the volume.
    let none = |_: String| -> BoxFuture<'_, bool> { Box::pin(async { false }) };
    vols.recover(&id, "sb-kept", "deleted", &none).await;
    vols.release(&id, "sb-kept", "/workspace/data", false).await;
    let r = vols.get(&id).unwrap().recovery.unwrap();
    assert_eq!(
        (r.sandbox_id.as_str(), r.reason.as_str(), r.files),
        ("sb-kept", "deleted", 3)
    );
    vols.attach(&id, "sb-b", (&target, "/workspace"), 8, false)
        .await
        .unwrap();
}

/// A held mount whose sandbox is not taken back after all: the writer's volume is scanned as a lost writer's and
/// freed; a reader's mount is only given back; a writer's volume that could not be mounted keeps its writer for
/// the scan of a start that can mount it.
#[tokio::test]
async fn a_held_mount_not_taken_back_is_scanned_and_given_back() {
    let tmp = tempfile::tempdir().unwrap();
    let disks = Arc::new(FakeDisks::default());
    let vols = open(tmp.path(), &disks);
    let id = vols.create(req(8, None)).await.unwrap().id;
    let target = tmp.path().join("t");
    vols.attach(&id, "sb-w", (&target, "/workspace/data"), 7, false)
        .await
        .unwrap();
    write_and_record(&vols, tmp.path(), &id, "sb-w").await;
    drop(vols);
    let kept = [
        held("sb-w", &id, "/workspace/data", false),
        held("sb-r", &id, "/workspace/ro", true),
    ];
    let vols = open_holding(tmp.path(), &disks, &kept);
    vols.drop_held("sb-r", &kept[1].1).await;
    let v = vols.get(&id).unwrap();
    assert_eq!(v.attachments.len(), 1);
    assert!(v.recovery.is_none());
    vols.drop_held("sb-w", &kept[0].1).await;
    let v = vols.get(&id).unwrap();
    assert!(v.attachments.is_empty());
    let r = v.recovery.unwrap();
    assert_eq!(
        (r.sandbox_id.as_str(), r.reason.as_str()),
        ("sb-w", "restart")
    );
    vols.attach(&id, "sb-next", (&target, "/workspace"), 8, false)
        .await
        .unwrap();
    vols.release(&id, "sb-next", "/workspace", false).await;

    // Unmountable at the start: the writer stays for a later scan.
    vols.attach(&id, "sb-w2", (&target, "/workspace/data"), 7, false)
        .await
        .unwrap();
    drop(vols);
    disks
        .broken
        .store(true, std::sync::atomic::Ordering::SeqCst);
    let kept = [held("sb-w2", &id, "/workspace/data", false)];
    let vols = open_holding(tmp.path(), &disks, &kept);
    vols.drop_held("sb-w2", &kept[0].1).await;
    let v = vols.get(&id).unwrap();
    assert!(v.attachments.is_empty());
    assert_eq!(
        v.recovery.unwrap().sandbox_id,
        "sb-w",
        "no scan of an unmounted volume"
    );
    drop(vols);
    disks
        .broken
        .store(false, std::sync::atomic::Ordering::SeqCst);
    let vols = open(tmp.path(), &disks);
    let r = vols.get(&id).unwrap().recovery.unwrap();
    assert_eq!(
        (r.sandbox_id.as_str(), r.reason.as_str()),
        ("sb-w2", "restart")
    );
}

#[tokio::test]
async fn the_scan_after_a_deletion_retries_failed_uploads() {
    let tmp = tempfile::tempdir().unwrap();
    let vols = open(tmp.path(), &Arc::default());
    let id = vols.create(req(8, None)).await.unwrap().id;
    let target = tmp.path().join("t");
    vols.attach(&id, "sb", (&target, "/workspace/data"), 7, false)
        .await
        .unwrap();
    write_and_record(&vols, tmp.path(), &id, "sb").await;
    let asked = Mutex::new(Vec::new());
    let reupload = |path: String| -> BoxFuture<'_, bool> {
        asked.lock().unwrap().push(path);
        Box::pin(async { true })
    };
    vols.recover(&id, "sb", "deleted", &reupload).await;
    vols.release(&id, "sb", "/workspace/data", false).await;
    assert_eq!(*asked.lock().unwrap(), ["out/deep/b.txt"]);
    let r = vols.get(&id).unwrap().recovery.unwrap();
    assert_eq!(r.reason, "deleted");
    assert_eq!(r.reuploaded, ["out/deep/b.txt"]);
    assert!(r.not_uploaded.is_empty());
    assert_eq!(r.orphans, ["c.txt"]);
    // The history, compacted to the files there, counts for the next writer: what is uploaded stays uploaded, a
    // file that went is forgotten, and another writer's failed upload is not retried with this one's credentials.
    let mnt = tmp.path().join("volumes").join(&id).join("mnt");
    std::fs::remove_file(mnt.join("c.txt")).unwrap();
    std::fs::remove_file(mnt.join("out/a.txt")).unwrap();
    vols.attach(&id, "sb2", (&target, "/workspace/data"), 8, false)
        .await
        .unwrap();
    vols.record_artifact(&id, "sb-old", "out/deep/e.txt".into(), false)
        .await;
    std::fs::write(mnt.join("out/deep/e.txt"), "e").unwrap();
    asked.lock().unwrap().clear();
    vols.recover(&id, "sb2", "deleted", &reupload).await;
    assert!(asked.lock().unwrap().is_empty());
    let r = vols.get(&id).unwrap().recovery.unwrap();
    assert_eq!((r.files, r.uploaded), (2, 1));
    assert_eq!(r.not_uploaded, ["out/deep/e.txt"]);
    assert!(r.orphans.is_empty() && r.reuploaded.is_empty());
    let records =
        std::fs::read_to_string(tmp.path().join("volumes").join(&id).join(RECORDS)).unwrap();
    assert_eq!(records.lines().count(), 2, "{records}");

    // A path's last record counts: uploaded, then changed and its new upload failed, it is listed again.
    vols.record_artifact(&id, "sb2", "out/deep/b.txt".into(), false)
        .await;
    vols.recover(&id, "sb2", "deleted", &reupload).await;
    assert_eq!(*asked.lock().unwrap(), ["out/deep/b.txt"]);
    // A scan that could not see every file keeps the records it did not reach.
    vols.record_artifact(&id, "sb2", "gone-from-view/x".into(), true)
        .await;
    std::fs::create_dir(mnt.join("locked")).unwrap();
    std::fs::write(mnt.join("locked/f"), "f").unwrap();
    std::fs::set_permissions(
        mnt.join("locked"),
        std::os::unix::fs::PermissionsExt::from_mode(0o000),
    )
    .unwrap();
    let unreadable = std::fs::read_dir(mnt.join("locked")).is_err();
    vols.recover(&id, "sb2", "deleted", &reupload).await;
    std::fs::set_permissions(
        mnt.join("locked"),
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();
    let records =
        std::fs::read_to_string(tmp.path().join("volumes").join(&id).join(RECORDS)).unwrap();
    // As root the directory stays readable (and the scan complete): then the record goes.
    assert_eq!(
        records.contains("gone-from-view/x"),
        unreadable,
        "{records}"
    );
}

fn mount(volume: Option<&str>, host: Option<&str>, path: &str, ro: bool) -> WorkspaceMount {
    WorkspaceMount {
        host_path: host.map(str::to_owned),
        volume: volume.map(str::to_owned),
        sandbox_path: path.into(),
        read_only: ro,
    }
}

#[test]
fn mount_plans_are_checked() {
    let ok = plan(
        &[
            mount(Some("v1"), None, "/workspace/data", false),
            mount(Some("v2"), None, "/workspace/ref/x", true),
        ],
        true,
        &["agent.py", "data2/f"],
    )
    .unwrap();
    assert_eq!((ok[0].rel.as_str(), ok[1].rel.as_str()), ("data", "ref/x"));
    assert_eq!(
        ok[0].inside("/workspace/data/out/a.txt").as_deref(),
        Some("out/a.txt")
    );
    assert_eq!(ok[0].inside("/workspace/data2/a"), None);
    assert_eq!(ok[0].inside("/workspace/data"), None);
    let whole = plan(&[mount(Some("v"), None, "/workspace", false)], true, &[]).unwrap();
    assert_eq!(whole[0].rel, "");
    assert_eq!(whole[0].inside("/workspace/a").as_deref(), Some("a"));

    let refused =
        |mounts: &[WorkspaceMount], files: &[&str]| plan(mounts, true, files).unwrap_err();
    assert!(matches!(
        refused(&[mount(None, Some("./src"), "/workspace/src", true)], &[]),
        PluginError::CapabilityUnsupported { capability } if capability == "mounts"
    ));
    assert!(matches!(
        plan(&[mount(Some("v"), None, "/workspace/a", false)], false, &[]).unwrap_err(),
        PluginError::CapabilityUnsupported { capability } if capability == "volumes"
    ));
    for (mounts, files, says) in [
        (
            vec![mount(Some("v"), Some("x"), "/workspace/a", false)],
            vec![],
            "exclude",
        ),
        (
            vec![mount(Some("v"), None, "/etc", false)],
            vec![],
            "not at or under",
        ),
        (
            vec![mount(Some("v"), None, "/workspaces", false)],
            vec![],
            "not at or under",
        ),
        (
            vec![mount(Some("v"), None, "/workspace/../etc", false)],
            vec![],
            "sandboxPath",
        ),
        (
            vec![mount(Some("v"), None, "/workspace/a/", false)],
            vec![],
            "sandboxPath",
        ),
        (
            vec![
                mount(Some("v"), None, "/workspace/a", false),
                mount(Some("w"), None, "/workspace/a/b", true),
            ],
            vec![],
            "overlaps",
        ),
        (
            vec![
                mount(Some("v"), None, "/workspace/a", true),
                mount(Some("v"), None, "/workspace/b", true),
            ],
            vec![],
            "overlaps",
        ),
        (
            vec![mount(Some("v"), None, "/workspace/a", false)],
            vec!["a/f.txt"],
            "template.files: a/f.txt",
        ),
        (
            vec![mount(Some("v"), None, "/workspace", false)],
            vec!["f.txt"],
            "template.files",
        ),
    ] {
        let e = refused(&mounts, &files).to_string();
        assert!(e.contains(says), "{mounts:?} {files:?}: {e}");
    }
}

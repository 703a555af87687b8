use std::os::unix::fs::{MetadataExt, PermissionsExt};

use super::*;

/// A workspace with a file, a nested directory, an executable with set-id bits, a link out of the tree and a FIFO.
fn workspace(root: &Path) -> PathBuf {
    let ws = root.join("ws");
    std::fs::create_dir_all(ws.join("src/deep")).unwrap();
    std::fs::write(ws.join("a.txt"), b"alpha").unwrap();
    std::fs::write(ws.join("src/deep/b.bin"), vec![7u8; 3 << 20]).unwrap();
    std::fs::write(ws.join("run.sh"), b"#!/bin/sh\n").unwrap();
    std::fs::set_permissions(ws.join("run.sh"), std::fs::Permissions::from_mode(0o6755)).unwrap();
    std::os::unix::fs::symlink("/etc/passwd", ws.join("out")).unwrap();
    nix::unistd::mkfifo(
        &ws.join("pipe"),
        nix::sys::stat::Mode::from_bits_truncate(0o644),
    )
    .unwrap();
    ws
}

#[test]
fn a_copy_keeps_files_dirs_links_modes_and_times_and_leaves_out_the_rest() {
    let t = tempfile::tempdir().unwrap();
    let ws = workspace(t.path());
    let old = nix::sys::time::TimeSpec::new(1_000_000_000, 0);
    nix::sys::stat::utimensat(
        None,
        &ws.join("a.txt"),
        &old,
        &old,
        nix::sys::stat::UtimensatFlags::NoFollowSymlink,
    )
    .unwrap();
    let out = t.path().join("copy");
    let c = copy_tree(&ws, &out, u64::MAX).unwrap();
    assert_eq!(std::fs::read(out.join("a.txt")).unwrap(), b"alpha");
    assert_eq!(
        std::fs::read(out.join("src/deep/b.bin")).unwrap().len(),
        3 << 20
    );
    assert_eq!(c.bytes, 5 + (3 << 20) + 10);
    // a.txt, src, src/deep, src/deep/b.bin, run.sh, out: the FIFO is listed instead.
    assert_eq!(c.files, 6, "{c:?}");
    assert_eq!(
        c.skipped,
        vec!["pipe (not a file, directory or link)".to_owned()]
    );
    let link = std::fs::symlink_metadata(out.join("out")).unwrap();
    assert!(link.file_type().is_symlink());
    assert_eq!(
        std::fs::read_link(out.join("out")).unwrap(),
        Path::new("/etc/passwd")
    );
    let run = std::fs::metadata(out.join("run.sh")).unwrap();
    assert_eq!(run.mode() & 0o7777, 0o755, "set-id bits are dropped");
    assert_eq!(
        std::fs::metadata(out.join("a.txt")).unwrap().mtime(),
        1_000_000_000
    );
    assert!(
        c.digest.starts_with("sha256:") && c.digest.len() == 71,
        "{}",
        c.digest
    );
}

#[test]
fn the_digest_follows_the_content_and_nothing_else() {
    let t = tempfile::tempdir().unwrap();
    let ws = workspace(t.path());
    let d1 = copy_tree(&ws, &t.path().join("c1"), u64::MAX)
        .unwrap()
        .digest;
    let d2 = copy_tree(&ws, &t.path().join("c2"), u64::MAX)
        .unwrap()
        .digest;
    assert_eq!(d1, d2, "the same files, the same digest");
    // A copy of the copy (made at another time, by another walk) has the same digest too.
    let d3 = copy_tree(&t.path().join("c1"), &t.path().join("c3"), u64::MAX)
        .unwrap()
        .digest;
    assert_eq!(d1, d3);
    std::fs::write(ws.join("src/deep/b.bin"), b"changed").unwrap();
    let d4 = copy_tree(&ws, &t.path().join("c4"), u64::MAX)
        .unwrap()
        .digest;
    assert_ne!(d1, d4, "other content, another digest");
    std::fs::rename(ws.join("a.txt"), ws.join("z.txt")).unwrap();
    let d5 = copy_tree(&ws, &t.path().join("c5"), u64::MAX)
        .unwrap()
        .digest;
    assert_ne!(d4, d5, "another name, another digest");
}

#[tokio::test]
async fn snapshots_are_kept_across_opens_and_not_deleted_while_used() {
    let t = tempfile::tempdir().unwrap();
    let ws = workspace(t.path());
    let dir = t.path().join("snapshots");
    let store = Snapshots::open(dir.clone(), 2, None).unwrap();
    let s = store
        .take((ws.clone(), None), "host", "ags-1", u64::MAX)
        .await
        .unwrap();
    assert!(s.id.starts_with("snap-"), "{}", s.id);
    assert_eq!((s.image.as_str(), s.source.as_str()), ("host", "ags-1"));
    let (layer, image) = store.acquire(&s.id, "ags-2").unwrap();
    assert_eq!(image, "host");
    assert_eq!(std::fs::read(layer.join("a.txt")).unwrap(), b"alpha");
    assert_eq!(store.get(&s.id).unwrap().used_by, vec!["ags-2".to_owned()]);
    let e = store.delete(&s.id).await.unwrap_err();
    assert!(
        matches!(e, SnapshotError::InUse { sandboxes: 1, .. }),
        "{e}"
    );
    assert_eq!(e.plugin().0, 409);
    // The maximum counts every snapshot.
    let s2 = store
        .take((ws.clone(), None), "host", "ags-1", u64::MAX)
        .await
        .unwrap();
    let e = store
        .take((ws.clone(), None), "host", "ags-1", u64::MAX)
        .await
        .unwrap_err();
    assert!(matches!(e, SnapshotError::Full(2)), "{e}");
    assert_eq!(e.plugin().0, 503);
    assert_eq!(s2.digest, s.digest, "the same workspace, the same digest");
    // An unfinished one (no snapshot.json) is removed at the next open; finished ones are there again.
    std::fs::create_dir_all(dir.join("snap-unfinished.partial/layer")).unwrap();
    drop(store);
    let store = Snapshots::open(dir.clone(), 2, None).unwrap();
    assert!(!dir.join("snap-unfinished.partial").exists());
    let ids: Vec<String> = store.list().into_iter().map(|s| s.id).collect();
    assert_eq!(ids.len(), 2, "{ids:?}");
    assert!(ids.contains(&s.id) && ids.contains(&s2.id));
    assert!(
        store.get(&s.id).unwrap().used_by.is_empty(),
        "no sandbox survives a restart"
    );
    let (_, _) = store.acquire(&s.id, "ags-3").unwrap();
    store.release("ags-3");
    store.delete(&s.id).await.unwrap();
    assert!(!dir.join(&s.id).exists());
    assert!(matches!(store.get(&s.id), Err(SnapshotError::NotFound(_))));
    assert!(matches!(
        store.acquire(&s.id, "x"),
        Err(SnapshotError::NotFound(_))
    ));
    assert_eq!(store.delete(&s.id).await.unwrap_err().plugin().0, 404);
}

#[tokio::test]
async fn a_failed_copy_leaves_nothing() {
    let t = tempfile::tempdir().unwrap();
    let dir = t.path().join("snapshots");
    let store = Snapshots::open(dir.clone(), 4, None).unwrap();
    let e = store
        .take((t.path().join("missing"), None), "host", "ags-1", u64::MAX)
        .await
        .unwrap_err();
    assert_eq!(e.plugin().0, 503, "{e}");
    assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0);
    assert!(store.list().is_empty());
    // Over the size limit: refused, nothing left either.
    let ws = workspace(t.path());
    let e = store
        .take((ws.clone(), None), "host", "ags-1", 1 << 20)
        .await
        .unwrap_err();
    assert!(matches!(e, SnapshotError::TooLarge(_)), "{e}");
    assert_eq!(e.plugin().0, 409);
    assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0);
    // The failed ones no longer count against the maximum.
    for _ in 0..4 {
        store
            .take((ws.clone(), None), "host", "ags-1", u64::MAX)
            .await
            .unwrap();
    }
}

#[test]
fn a_walk_without_a_copy_gives_the_copys_digest_and_sizes() {
    let t = tempfile::tempdir().unwrap();
    let ws = workspace(t.path());
    let copied = copy_tree(&ws, &t.path().join("copy"), u64::MAX).unwrap();
    let walked = walk_tree(&ws, None, u64::MAX, true).unwrap();
    assert_eq!(walked.digest, copied.digest);
    assert_eq!(
        (walked.bytes, walked.files, &walked.skipped),
        (copied.bytes, copied.files, &copied.skipped)
    );
    // Nothing was written beside the tree.
    assert_eq!(std::fs::read_dir(t.path()).unwrap().count(), 2);
    // Without the content's hash: the same sizes, another digest; a changed byte changes only the hashed one.
    let sized = walk_tree(&ws, None, u64::MAX, false).unwrap();
    assert_eq!((sized.bytes, sized.files), (copied.bytes, copied.files));
    assert_ne!(sized.digest, copied.digest);
    std::fs::write(ws.join("a.txt"), b"alphb").unwrap();
    assert_ne!(
        walk_tree(&ws, None, u64::MAX, true).unwrap().digest,
        copied.digest
    );
    assert_eq!(
        walk_tree(&ws, None, u64::MAX, false).unwrap().digest,
        sized.digest
    );
}

/// A snapshot with a root layer: taken with the workspace within one bound, kept with its owners mapped, handed to
/// a sandbox on its image only and of a size that fits, and held (not deletable) until the sandbox's copy is made.
#[tokio::test]
async fn a_root_layer_is_bounded_with_the_workspace_and_held_while_it_is_copied() {
    let test = "a_root_layer_is_bounded_with_the_workspace_and_held_while_it_is_copied";
    if !test_support::require_root(test, "a layer's owners are set with chown") {
        return;
    }
    let t = tempfile::tempdir().unwrap();
    let ws = t.path().join("ws");
    std::fs::create_dir(&ws).unwrap();
    std::fs::write(ws.join("w"), vec![1u8; 6000]).unwrap();
    let upper = t.path().join("upper");
    std::fs::create_dir_all(upper.join("var/tmp")).unwrap();
    std::fs::create_dir(upper.join("tmp")).unwrap();
    std::fs::write(upper.join("var/tmp/r"), vec![2u8; 6000]).unwrap();
    std::os::unix::fs::lchown(upper.join("var/tmp/r"), Some(4242), Some(4242)).unwrap();
    let root = || {
        Some(RootUpper {
            upper: upper.clone(),
            host_id: 4242,
        })
    };
    let store = Snapshots::open(t.path().join("snapshots"), 4, None).unwrap();
    let s = store
        .take((ws.clone(), root()), "bb", "ags-1", 1 << 20)
        .await
        .unwrap();
    let layer = s.root.clone().expect("a root layer");
    assert_eq!(
        (layer.files, layer.bytes),
        (3, 6000),
        "var, var/tmp, r; tmp left out"
    );
    let kept = t.path().join("snapshots").join(&s.id).join("root");
    let owner = |p: &str| std::fs::metadata(kept.join(p)).unwrap().uid();
    assert_eq!(
        (owner("var/tmp/r"), owner("var")),
        (0, runtime::tree::NOBODY)
    );
    // The workspace (6000 + 4096 for nothing else) and the layer (6000 + 2 x 4096) in one bound.
    let e = store
        .take((ws.clone(), root()), "bb", "ags-1", 20_000)
        .await
        .unwrap_err();
    assert!(matches!(e, SnapshotError::TooLarge(20_000)), "{e}");
    assert_eq!(e.plugin().0, 409);
    assert_eq!(store.list().len(), 1, "a refused snapshot is not kept");

    let e = store
        .root_layer(&s.id, ("ags-2", "host"), 1 << 20)
        .unwrap_err();
    assert!(matches!(e, SnapshotError::OtherImage { .. }), "{e}");
    let e = store
        .root_layer(&s.id, ("ags-2", "bb"), 10_000)
        .unwrap_err();
    assert!(
        matches!(e, SnapshotError::Larger { bytes: 14192, .. }),
        "{e}"
    );
    assert_eq!(e.plugin().0, 409);
    let (path, hold) = store
        .root_layer(&s.id, ("ags-2", "bb"), 1 << 20)
        .unwrap()
        .unwrap();
    assert_eq!(path, kept);
    assert_eq!(
        store.get(&s.id).unwrap().used_by,
        vec!["ags-2:creating".to_owned()]
    );
    assert_eq!(store.delete(&s.id).await.unwrap_err().plugin().0, 409);
    drop(hold);
    store.delete(&s.id).await.unwrap();
    assert!(!kept.exists());
}

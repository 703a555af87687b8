//! End-to-end and hostile-input tests of the image modules: layers built in memory (with raw tar headers, so that
//! names `tar::Header::set_path` refuses survive), unpacked with [`unpack`], mounted as a real overlay, imported
//! through the [`ImageStore`] from layouts written by [`pack`].
//!
//! Tests that need root (device nodes for whiteouts, `trusted.*` xattrs, mounts) go through
//! [`test_support::require_root`]: without root they say `SKIPPED` and return, and fail instead on CI.

use std::collections::BTreeSet;
use std::ffi::CString;
use std::fs;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use tar::{EntryType, Header};

use super::layout;
use super::pack::{pack, PackOptions};
use super::store::ImageStore;
use super::unpack::{unpack, UnpackStats};
use super::{Compression, ImageError, Sha256};

// ---------------------------------------------------------------------------------------------------------------
// Building archives
// ---------------------------------------------------------------------------------------------------------------

/// One tar entry, written with raw header fields.
#[derive(Clone)]
struct Entry {
    path: Vec<u8>,
    kind: EntryType,
    mode: u32,
    mtime: u64,
    owner: u64,
    link: Vec<u8>,
    data: Vec<u8>,
    device: (u32, u32),
    /// PAX records written in an `x` header before the entry.
    pax: Vec<(String, Vec<u8>)>,
    /// Written as a GNU long name (`L`) entry before the entry, whose own header gets a harmless short name.
    long_name: bool,
}

/// The raw helper: path and link name bytes go into the header as they are.
fn raw(
    path: impl AsRef<[u8]>,
    kind: EntryType,
    mode: u32,
    link: impl AsRef<[u8]>,
    data: &[u8],
) -> Entry {
    Entry {
        path: path.as_ref().to_vec(),
        kind,
        mode,
        mtime: 1_000_000,
        owner: 0,
        link: link.as_ref().to_vec(),
        data: data.to_vec(),
        device: (0, 0),
        pax: Vec::new(),
        long_name: false,
    }
}

fn file(path: impl AsRef<[u8]>, mode: u32, data: &[u8]) -> Entry {
    raw(path, EntryType::Regular, mode, "", data)
}

fn dir(path: impl AsRef<[u8]>, mode: u32) -> Entry {
    raw(path, EntryType::Directory, mode, "", b"")
}

fn symlink(path: impl AsRef<[u8]>, target: impl AsRef<[u8]>) -> Entry {
    raw(path, EntryType::Symlink, 0o777, target, b"")
}

fn hardlink(path: impl AsRef<[u8]>, target: impl AsRef<[u8]>) -> Entry {
    raw(path, EntryType::Link, 0o644, target, b"")
}

fn device(path: &str, kind: EntryType, major: u32, minor: u32) -> Entry {
    Entry {
        device: (major, minor),
        ..raw(path, kind, 0o666, "", b"")
    }
}

impl Entry {
    fn mtime(mut self, t: u64) -> Self {
        self.mtime = t;
        self
    }

    fn owner(mut self, id: u64) -> Self {
        self.owner = id;
        self
    }

    fn pax(mut self, key: &str, value: &[u8]) -> Self {
        self.pax.push((key.to_owned(), value.to_vec()));
        self
    }

    fn long_name(mut self) -> Self {
        self.long_name = true;
        self
    }
}

fn header(path: &[u8], kind: EntryType, mode: u32, size: u64) -> Header {
    assert!(path.len() <= 100, "use long_name() for {path:?}");
    let mut h = Header::new_gnu();
    h.as_old_mut().name[..path.len()].copy_from_slice(path);
    h.set_entry_type(kind);
    h.set_mode(mode);
    h.set_size(size);
    h.set_mtime(1_000_000);
    h.set_uid(0);
    h.set_gid(0);
    h
}

/// `"<len> key=value\n"`, where len counts the whole record.
fn pax_record(out: &mut Vec<u8>, key: &str, value: &[u8]) {
    let base = key.len() + value.len() + 3;
    let mut len = base + base.to_string().len();
    if len.to_string().len() != base.to_string().len() {
        len += 1;
    }
    out.extend_from_slice(format!("{len} {key}=").as_bytes());
    out.extend_from_slice(value);
    out.push(b'\n');
}

fn tar(entries: &[Entry]) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    for e in entries {
        if !e.pax.is_empty() {
            let mut data = Vec::new();
            for (k, v) in &e.pax {
                pax_record(&mut data, k, v);
            }
            let mut h = header(
                b"PaxHeaders.0/entry",
                EntryType::XHeader,
                0o644,
                data.len() as u64,
            );
            h.set_cksum();
            b.append(&h, &data[..]).unwrap();
        }
        let short: &[u8] = if e.long_name {
            let mut name = e.path.clone();
            name.push(0);
            let mut h = header(
                b"././@LongLink",
                EntryType::GNULongName,
                0o644,
                name.len() as u64,
            );
            h.set_cksum();
            b.append(&h, &name[..]).unwrap();
            b"short-name"
        } else {
            &e.path
        };
        let mut h = header(short, e.kind, e.mode, e.data.len() as u64);
        h.set_mtime(e.mtime);
        h.set_uid(e.owner);
        h.set_gid(e.owner);
        assert!(e.link.len() <= 100);
        h.as_old_mut().linkname[..e.link.len()].copy_from_slice(&e.link);
        if matches!(e.kind, EntryType::Char | EntryType::Block) {
            h.set_device_major(e.device.0).unwrap();
            h.set_device_minor(e.device.1).unwrap();
        }
        h.set_cksum();
        b.append(&h, &e.data[..]).unwrap();
    }
    b.into_inner().unwrap()
}

fn digest_of_layer() -> Sha256 {
    Sha256::of(b"the layer blob")
}

/// Unpacks an uncompressed tar with its correct diff_id.
fn unpack_tar(bytes: &[u8], dest: &Path) -> Result<UnpackStats, ImageError> {
    let diff_id = Sha256::of(bytes);
    unpack(
        bytes,
        Compression::None,
        &digest_of_layer(),
        Some(&diff_id),
        dest,
    )
}

/// `(entry, reason)` of a layer error, or a description of what came instead.
fn layer_error(r: Result<UnpackStats, ImageError>) -> Result<(String, String), String> {
    match r {
        Err(ImageError::Layer {
            digest,
            entry,
            reason,
        }) => {
            if digest != digest_of_layer().as_str() {
                return Err(format!("layer error names digest {digest}"));
            }
            Ok((entry, reason))
        }
        Err(e) => Err(format!("expected a layer error, got {e:?}")),
        Ok(s) => Err(format!("expected a layer error, the layer unpacked: {s:?}")),
    }
}

// ---------------------------------------------------------------------------------------------------------------
// Inspecting the result
// ---------------------------------------------------------------------------------------------------------------

/// Every path under `root` (not following symlinks), relative, with its type and, for files, content.
fn tree(root: &Path) -> BTreeSet<String> {
    fn walk(root: &Path, dir: &Path, out: &mut BTreeSet<String>) {
        for e in fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            let rel = p.strip_prefix(root).unwrap().display().to_string();
            let md = fs::symlink_metadata(&p).unwrap();
            if md.is_dir() {
                out.insert(format!("{rel}/ {:o}", md.mode() & 0o7777));
                walk(root, &p, out);
            } else if md.is_symlink() {
                out.insert(format!("{rel} -> {}", fs::read_link(&p).unwrap().display()));
            } else if md.is_file() {
                let content = String::from_utf8_lossy(&fs::read(&p).unwrap()).into_owned();
                out.insert(format!(
                    "{rel} {:o} nlink={} {content:?}",
                    md.mode() & 0o7777,
                    md.nlink()
                ));
            } else {
                out.insert(format!("{rel} special {:o} rdev={}", md.mode(), md.rdev()));
            }
        }
    }
    let mut out = BTreeSet::new();
    walk(root, root, &mut out);
    out
}

fn names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

fn get_xattr(path: &Path, name: &str) -> Option<Vec<u8>> {
    let p = CString::new(path.as_os_str().as_bytes()).unwrap();
    let n = CString::new(name).unwrap();
    let mut buf = [0u8; 256];
    // SAFETY: both strings are NUL-terminated and `buf` is valid for writes of its length.
    let r = unsafe { libc::getxattr(p.as_ptr(), n.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
    usize::try_from(r).ok().map(|n| buf[..n].to_vec())
}

fn lmeta(p: &Path) -> fs::Metadata {
    fs::symlink_metadata(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

/// Unmounts (lazily) on drop, whatever the test did.
struct MountGuard(PathBuf);

impl Drop for MountGuard {
    fn drop(&mut self) {
        if let Err(e) = nix::mount::umount2(&self.0, nix::mount::MntFlags::MNT_DETACH) {
            eprintln!("cannot unmount {}: {e}", self.0.display());
        }
    }
}

// ---------------------------------------------------------------------------------------------------------------
// 1. A good two-layer image
// ---------------------------------------------------------------------------------------------------------------

const TOOL: &[u8] = b"#!/bin/sh\necho tool\n";

fn good_layer1() -> Vec<Entry> {
    vec![
        dir("./", 0o755),
        dir("./usr/", 0o755).mtime(1000),
        dir("./usr/bin/", 0o755).mtime(1100),
        file("./usr/bin/tool", 0o755, TOOL).mtime(1_600_000_000),
        file("./usr/bin/su", 0o6755, b"su\n"),
        hardlink("usr/bin/tool-link", "./usr/bin/tool"),
        file("usr/share/doc/readme", 0o644, b"readme\n"),
        symlink("bin", "usr/bin"),
        dir("etc/", 0o755).mtime(1200),
        symlink("etc/alt", "/usr/bin/tool"),
        file("etc/owned", 0o640, b"x").owner(1000),
        // Repeated: the later entry wins, mode and mtime.
        dir("etc", 0o750).mtime(2000),
        file("somefile", 0o644, b"lower\n"),
        dir("d/", 0o755),
        file("d/old1", 0o644, b"1"),
        file("d/old2", 0o644, b"2"),
        dir("sgid/", 0o2775),
        dir("tmp/", 0o1777),
        // Extended attributes are ignored, file capabilities and overlay's own included.
        file("caps", 0o755, b"caps")
            .pax(
                "SCHILY.xattr.security.capability",
                &[1, 0, 0, 2, 0xff, 0xff, 0xff, 0xff, 0, 0, 0, 0],
            )
            .pax("SCHILY.xattr.user.smuggled", b"1"),
        dir("d2/", 0o755)
            .pax("SCHILY.xattr.trusted.overlay.opaque", b"y")
            .pax("SCHILY.xattr.trusted.overlay.redirect", b"/etc"),
        file("d2/kept", 0o644, b"kept"),
    ]
}

fn good_layer2() -> Vec<Entry> {
    vec![
        file(".wh.somefile", 0o644, b""),
        file("d/.wh..wh..opq", 0o644, b""),
        file("d/new", 0o644, b"new\n"),
        dir("r/", 0o755),
        file("r/child", 0o644, b"c"),
        // A file replacing a directory of the same layer.
        file("r", 0o600, b"now a file\n"),
        file("d2/.wh.kept", 0o644, b""),
    ]
}

#[test]
fn good_layers_unpack_exactly_and_overlay_as_expected() {
    if !test_support::require_root(
        "good_layers_unpack_exactly_and_overlay_as_expected",
        "whiteouts are device nodes, opaque directories trusted xattrs, and the overlay a mount",
    ) {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let (l1, l2) = (tmp.path().join("l1"), tmp.path().join("l2"));
    fs::create_dir(&l1).unwrap();
    fs::create_dir(&l2).unwrap();

    let s1 = unpack_tar(&tar(&good_layer1()), &l1).unwrap();
    let bytes1 = (TOOL.len() + 3 + 7 + 1 + 6 + 1 + 1 + 4 + 4) as u64;
    assert_eq!(
        s1,
        UnpackStats {
            entries: 20,
            bytes: bytes1,
            whiteouts: 0,
            setid_dropped: 2,
        }
    );
    let s2 = unpack_tar(&tar(&good_layer2()), &l2).unwrap();
    assert_eq!(
        s2,
        UnpackStats {
            entries: 7,
            bytes: 4 + 1 + 11,
            whiteouts: 3,
            setid_dropped: 0,
        }
    );

    check_good_layer1(&l1);
    check_good_layer2(&l2);
    check_good_overlay(tmp.path(), &l1, &l2);
}

/// Layer 1 of [`good_layer1`] as unpacked in `l1`, exactly: the tree, hard links, modes, mtimes; no owners, no
/// extended attributes.
fn check_good_layer1(l1: &Path) {
    let expected1: BTreeSet<String> = [
        "bin -> usr/bin",
        "caps 755 nlink=1 \"caps\"",
        "d/ 755",
        "d/old1 644 nlink=1 \"1\"",
        "d/old2 644 nlink=1 \"2\"",
        "d2/ 755",
        "d2/kept 644 nlink=1 \"kept\"",
        "etc/ 750",
        "etc/alt -> /usr/bin/tool",
        "etc/owned 640 nlink=1 \"x\"",
        "sgid/ 775",
        "somefile 644 nlink=1 \"lower\\n\"",
        "tmp/ 1777",
        "usr/ 755",
        "usr/bin/ 755",
        "usr/bin/su 755 nlink=1 \"su\\n\"",
        "usr/bin/tool 755 nlink=2 \"#!/bin/sh\\necho tool\\n\"",
        "usr/bin/tool-link 755 nlink=2 \"#!/bin/sh\\necho tool\\n\"",
        "usr/share/ 755",
        "usr/share/doc/ 755",
        "usr/share/doc/readme 644 nlink=1 \"readme\\n\"",
    ]
    .into_iter()
    .map(String::from)
    .collect();
    assert_eq!(tree(l1), expected1);
    let tool = lmeta(&l1.join("usr/bin/tool"));
    assert!(tool.file_type().is_file());
    assert_eq!((tool.mtime(), tool.mtime_nsec()), (1_600_000_000, 0));
    assert_eq!(tool.ino(), lmeta(&l1.join("usr/bin/tool-link")).ino());
    assert_eq!(lmeta(&l1.join("usr/bin/su")).mode() & 0o7777, 0o755);
    assert!(lmeta(&l1.join("bin")).file_type().is_symlink());
    assert_eq!(fs::read_link(l1.join("bin")).unwrap(), Path::new("usr/bin"));
    assert_eq!(
        fs::read_link(l1.join("etc/alt")).unwrap(),
        Path::new("/usr/bin/tool")
    );
    // Directory mtimes are applied last, and the later of two entries wins.
    assert_eq!(lmeta(&l1.join("usr")).mtime(), 1000);
    assert_eq!(lmeta(&l1.join("usr/bin")).mtime(), 1100);
    assert_eq!(
        lmeta(&l1.join("etc")).mtime(),
        2000,
        "the repeated entry's mtime"
    );
    // Owners are not applied.
    let owned = lmeta(&l1.join("etc/owned"));
    assert_eq!((owned.uid(), owned.gid()), (0, 0));
    // Extended attributes from the archive are not applied.
    for (p, x) in [
        ("caps", "security.capability"),
        ("caps", "user.smuggled"),
        ("d2", "trusted.overlay.opaque"),
        ("d2", "trusted.overlay.redirect"),
    ] {
        assert_eq!(get_xattr(&l1.join(p), x), None, "{p} {x}");
    }
}

/// Layer 2 of [`good_layer2`] as unpacked in `l2`, exactly: whiteouts as overlayfs's device nodes and opaque
/// directories as its xattr.
fn check_good_layer2(l2: &Path) {
    let expected2: BTreeSet<String> = [
        "d/ 755",
        "d/new 644 nlink=1 \"new\\n\"",
        "d2/ 755",
        "d2/kept special 20000 rdev=0",
        "r 600 nlink=1 \"now a file\\n\"",
        "somefile special 20000 rdev=0",
    ]
    .into_iter()
    .map(String::from)
    .collect();
    assert_eq!(tree(l2), expected2);
    let wh = lmeta(&l2.join("somefile"));
    assert!(wh.file_type().is_char_device());
    assert_eq!(wh.rdev(), 0);
    assert_eq!(
        get_xattr(&l2.join("d"), "trusted.overlay.opaque"),
        Some(b"y".to_vec())
    );
    assert_eq!(get_xattr(&l2.join("d2"), "trusted.overlay.opaque"), None);
}

/// The merged view of a real overlay of `l2` over `l1`, mounted under `tmp`.
fn check_good_overlay(tmp: &Path, l1: &Path, l2: &Path) {
    let merged = tmp.join("merged");
    fs::create_dir(&merged).unwrap();
    let data = format!("lowerdir={}:{}", l2.display(), l1.display());
    nix::mount::mount(
        Some("sandboxd-test"),
        &merged,
        Some("overlay"),
        nix::mount::MsFlags::MS_RDONLY,
        Some(data.as_str()),
    )
    .unwrap();
    let _guard = MountGuard(merged.clone());
    assert_eq!(
        names(&merged),
        ["bin", "caps", "d", "d2", "etc", "r", "sgid", "tmp", "usr"]
    );
    assert_eq!(
        fs::symlink_metadata(merged.join("somefile"))
            .unwrap_err()
            .kind(),
        std::io::ErrorKind::NotFound
    );
    assert_eq!(names(&merged.join("d")), ["new"]);
    assert!(names(&merged.join("d2")).is_empty());
    assert_eq!(fs::read(merged.join("r")).unwrap(), b"now a file\n");
    let su = lmeta(&merged.join("usr/bin/su"));
    assert_eq!(su.mode() & 0o7777, 0o755);
    assert_eq!(su.permissions().mode() & 0o6000, 0);
    assert_eq!(fs::read(merged.join("bin/tool")).unwrap(), TOOL);
    assert_eq!(
        fs::read_link(merged.join("etc/alt")).unwrap(),
        Path::new("/usr/bin/tool")
    );
    assert_eq!(lmeta(&merged.join("sgid")).mode() & 0o7777, 0o775);
}

// ---------------------------------------------------------------------------------------------------------------
// 2. Hostile layers
// ---------------------------------------------------------------------------------------------------------------

/// A scratch area: `dest` four levels down (so that `../../..` still lands in it) and `outside/victim`, a file
/// that nothing may touch.
struct Arena {
    _tmp: tempfile::TempDir,
    work: PathBuf,
    dest: PathBuf,
    outside: PathBuf,
}

impl Arena {
    fn new() -> Self {
        let tmp = tempfile::tempdir().unwrap();
        let work = tmp.path().to_path_buf();
        let dest = work.join("a/b/c/dest");
        let outside = work.join("outside");
        fs::create_dir_all(&dest).unwrap();
        fs::create_dir_all(&outside).unwrap();
        fs::write(outside.join("victim"), b"original").unwrap();
        fs::set_permissions(outside.join("victim"), fs::Permissions::from_mode(0o644)).unwrap();
        Self {
            _tmp: tmp,
            work,
            dest,
            outside,
        }
    }

    /// Everything but the destination's content.
    fn outside_dest(&self) -> BTreeSet<String> {
        let dest_rel = "a/b/c/dest/";
        tree(&self.work)
            .into_iter()
            .filter(|p| !p.starts_with(dest_rel) || p.starts_with(&format!("{dest_rel} ")))
            .collect()
    }
}

/// A hostile layer: its entries (given the outside directory) and the refusal expected: the entry named (with
/// `{outside}` and `{long_escape}` standing for [`Arena::outside`] and [`long_escape`]) and a reason substring.
struct Hostile {
    case: &'static str,
    build: fn(&str) -> Vec<Entry>,
    entry: &'static str,
    reason: &'static str,
}

/// A GNU long name that climbs out of the layer after 30 harmless levels.
fn long_escape() -> String {
    format!("{}{}escape", "a/".repeat(30), "../".repeat(40))
}

static HOSTILE: &[Hostile] = &[
    Hostile {
        case: "dotdot",
        build: |_| vec![file("../escape", 0o644, b"x")],
        entry: "../escape",
        reason: "path escapes the layer (..)",
    },
    Hostile {
        case: "dotdot inside",
        build: |_| vec![file("a/../../x", 0o644, b"x")],
        entry: "a/../../x",
        reason: "path escapes the layer (..)",
    },
    Hostile {
        case: "dotdot deep",
        build: |_| {
            vec![
                dir("a/", 0o755),
                file("a/../../../../../outside/new", 0o644, b"x"),
            ]
        },
        entry: "a/../../../../../outside/new",
        reason: "path escapes the layer (..)",
    },
    Hostile {
        case: "absolute",
        build: |o| vec![file(format!("{o}/abs"), 0o644, b"x")],
        entry: "{outside}/abs",
        reason: "absolute path",
    },
    Hostile {
        case: "absolute dir",
        build: |o| vec![dir(format!("{o}/"), 0o777)],
        entry: "{outside}/",
        reason: "absolute path",
    },
    Hostile {
        case: "dotdot in a GNU long name",
        build: |_| vec![file(long_escape().as_bytes(), 0o644, b"x").long_name()],
        entry: "{long_escape}",
        reason: "path escapes the layer (..)",
    },
    Hostile {
        case: "dotdot in a PAX path",
        build: |_| vec![file("benign", 0o644, b"x").pax("path", b"../../../../outside/pax")],
        entry: "../../../../outside/pax",
        reason: "path escapes the layer (..)",
    },
    Hostile {
        case: "NUL in a PAX path",
        build: |_| vec![file("benign", 0o644, b"x").pax("path", b"a\0b")],
        entry: "a\0b",
        reason: "NUL byte in path",
    },
    Hostile {
        case: "char device",
        build: |_| vec![device("mem", EntryType::Char, 1, 1)],
        entry: "mem",
        reason: "device nodes are refused",
    },
    Hostile {
        case: "char device posing as a whiteout's target",
        build: |_| vec![device("null", EntryType::Char, 0, 0)],
        entry: "null",
        reason: "device nodes are refused",
    },
    Hostile {
        case: "block device",
        build: |_| {
            vec![
                dir("dev/", 0o755),
                device("dev/sda", EntryType::Block, 8, 0),
            ]
        },
        entry: "dev/sda",
        reason: "device nodes are refused",
    },
    Hostile {
        case: "fifo",
        build: |_| vec![raw("fifo", EntryType::Fifo, 0o644, "", b"")],
        entry: "fifo",
        reason: "FIFOs are refused",
    },
    Hostile {
        case: "unknown entry type",
        build: |_| vec![raw("odd", EntryType::new(b'Z'), 0o644, "", b"")],
        entry: "odd",
        reason: "unsupported entry type",
    },
    Hostile {
        case: "file through a symlink to outside",
        build: |o| vec![symlink("link", o), file("link/pwned", 0o644, b"pwned")],
        entry: "link/pwned",
        reason: "goes through the symlink link",
    },
    Hostile {
        case: "file replacing the victim through a symlinked dir",
        build: |o| vec![symlink("link", o), file("./link/victim", 0o644, b"pwned")],
        entry: "./link/victim",
        reason: "goes through the symlink link",
    },
    Hostile {
        case: "dir through a symlink to outside",
        build: |o| vec![symlink("link", o), dir("link/sub/", 0o755)],
        entry: "link/sub/",
        reason: "goes through the symlink link",
    },
    Hostile {
        case: "relative escaping symlink",
        build: |_| vec![symlink("up", "../../.."), file("up/x", 0o644, b"x")],
        entry: "up/x",
        reason: "goes through the symlink up",
    },
    Hostile {
        case: "symlink nested in the path",
        build: |o| {
            vec![
                dir("a/", 0o755),
                symlink("a/up", o),
                file("a/up/b/c", 0o644, b"x"),
            ]
        },
        entry: "a/up/b/c",
        reason: "goes through the symlink a/up",
    },
    Hostile {
        case: "symlink pointing inside the layer",
        build: |_| {
            vec![
                dir("real/", 0o755),
                symlink("in", "real"),
                file("in/f", 0o644, b"x"),
            ]
        },
        entry: "in/f",
        reason: "goes through the symlink in",
    },
    Hostile {
        case: "whiteout through a symlink",
        build: |o| vec![symlink("wl", o), file("wl/.wh.victim", 0o644, b"")],
        entry: "wl/.wh.victim",
        reason: "goes through the symlink wl",
    },
    Hostile {
        case: "opaque marker through a symlink",
        build: |o| vec![symlink("ol", o), file("ol/.wh..wh..opq", 0o644, b"")],
        entry: "ol/.wh..wh..opq",
        reason: "goes through the symlink ol",
    },
    Hostile {
        case: "hard link through a symlink",
        build: |o| vec![symlink("sl", o), hardlink("sl/new", "etc")],
        entry: "sl/new",
        reason: "goes through the symlink sl",
    },
    Hostile {
        case: "file below a file",
        build: |_| vec![file("f", 0o644, b"x"), file("f/x", 0o644, b"x")],
        entry: "f/x",
        reason: "f is not a directory",
    },
    Hostile {
        case: "hard link to an absolute path",
        build: |o| vec![hardlink("hl", format!("{o}/victim"))],
        entry: "hl",
        reason: "hard link target: absolute path",
    },
    Hostile {
        case: "hard link to /etc/shadow",
        build: |_| vec![hardlink("hl", "/etc/shadow")],
        entry: "hl",
        reason: "hard link target: absolute path",
    },
    Hostile {
        case: "hard link with ..",
        build: |_| vec![hardlink("hl", "../../../../outside/victim")],
        entry: "hl",
        reason: "hard link target: path escapes the layer (..)",
    },
    Hostile {
        case: "hard link with .. in a PAX linkpath",
        build: |_| vec![hardlink("hl", "benign").pax("linkpath", b"../../../../outside/victim")],
        entry: "hl",
        reason: "hard link target: path escapes the layer (..)",
    },
    Hostile {
        case: "hard link to a file the layer does not hold",
        build: |_| vec![hardlink("hl", "etc/passwd")],
        entry: "hl",
        reason: "hard link to etc/passwd, which this layer does not hold",
    },
    Hostile {
        case: "hard link to a file that comes later",
        build: |_| vec![hardlink("hl", "later"), file("later", 0o644, b"x")],
        entry: "hl",
        reason: "hard link to later, which this layer does not hold",
    },
    Hostile {
        case: "hard link through a symlinked directory",
        build: |o| vec![symlink("sl", o), hardlink("hl", "sl/victim")],
        entry: "hl",
        reason: "hard link to sl/victim, which this layer does not hold",
    },
    Hostile {
        case: "hard link to a symlink",
        build: |o| vec![symlink("s", format!("{o}/victim")), hardlink("hl", "s")],
        entry: "hl",
        reason: "hard link to s, which is not a regular file",
    },
    Hostile {
        case: "hard link to a directory",
        build: |_| vec![dir("dd/", 0o755), hardlink("hl", "dd")],
        entry: "hl",
        reason: "hard link to dd, which is not a regular file",
    },
    Hostile {
        case: "hard link to the root",
        build: |_| vec![hardlink("hl", "./")],
        entry: "hl",
        reason: "hard link to the layer's root",
    },
    Hostile {
        case: "symlink without a target",
        build: |_| vec![symlink("s", "")],
        entry: "s",
        reason: "symlink without a target",
    },
    Hostile {
        case: "proc as a symlink",
        build: |_| vec![symlink("proc", "/")],
        entry: "proc",
        reason: "a runtime mount point must be a directory",
    },
    Hostile {
        case: "tmp as a regular file",
        build: |_| vec![file("./tmp", 0o644, b"x")],
        entry: "./tmp",
        reason: "a runtime mount point must be a directory",
    },
    Hostile {
        case: "dev as a hard link",
        build: |_| vec![file("f", 0o644, b"x"), hardlink("dev", "f")],
        entry: "dev",
        reason: "a runtime mount point must be a directory",
    },
    Hostile {
        case: "sys replacing a directory with a symlink",
        build: |_| vec![dir("sys/", 0o755), symlink("sys", "/")],
        entry: "sys",
        reason: "a runtime mount point must be a directory",
    },
    Hostile {
        case: "workspace as a symlink to outside",
        build: |o| vec![symlink("workspace/", o)],
        entry: "workspace/",
        reason: "a runtime mount point must be a directory",
    },
    Hostile {
        case: "sandbox as a FIFO",
        build: |_| vec![raw("sandbox", EntryType::Fifo, 0o644, "", b"")],
        entry: "sandbox",
        reason: "a runtime mount point must be a directory",
    },
    Hostile {
        case: "whiteout .wh.",
        build: |_| vec![file(".wh.", 0o644, b"")],
        entry: ".wh.",
        reason: "malformed whiteout",
    },
    Hostile {
        case: "whiteout .wh...",
        build: |_| vec![file(".wh...", 0o644, b"")],
        entry: ".wh...",
        reason: "malformed whiteout",
    },
    Hostile {
        case: "whiteout d/.wh..",
        build: |_| vec![file("d/.wh..", 0o644, b"")],
        entry: "d/.wh..",
        reason: "malformed whiteout",
    },
    Hostile {
        case: "whiteout of a whiteout",
        build: |_| vec![file(".wh..wh.x", 0o644, b"")],
        entry: ".wh..wh.x",
        reason: "malformed whiteout",
    },
];

#[test]
fn hostile_entries_are_refused_and_touch_nothing_outside() {
    let mut failures = Vec::new();
    for &Hostile {
        case,
        build,
        entry,
        reason,
    } in HOSTILE
    {
        let arena = Arena::new();
        let before = arena.outside_dest();
        let outside = arena.outside.display().to_string();
        let bytes = tar(&build(&outside));
        let result = layer_error(unpack_tar(&bytes, &arena.dest));
        let expected_entry = entry
            .replace("{outside}", &outside)
            .replace("{long_escape}", &long_escape());
        match result {
            Ok((e, r)) if e == expected_entry && r.contains(reason) => {}
            Ok((e, r)) => failures.push(format!(
                "{case}: refused with entry {e:?}, reason {r:?}; expected entry {expected_entry:?}, reason ~ {reason:?}"
            )),
            Err(e) => failures.push(format!("{case}: {e}")),
        }
        let after = arena.outside_dest();
        if after != before {
            failures.push(format!(
                "{case}: outside the destination changed:\n  before {before:?}\n  after  {after:?}"
            ));
        }
        if get_xattr(&arena.outside, "trusted.overlay.opaque").is_some() {
            failures.push(format!("{case}: the outside directory was marked opaque"));
        }
    }
    assert!(
        failures.is_empty(),
        "{} case(s) failed:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

/// Entries that replace a symlink replace the link itself, never what it points to.
#[test]
fn entries_replace_symlinks_without_following_them() {
    let arena = Arena::new();
    let o = arena.outside.display().to_string();
    let mut entries = vec![
        symlink("f", format!("{o}/victim")),
        file("f", 0o666, b"pwned"),
        symlink("d", &o),
        dir("d", 0o777),
        file("src", 0o644, b"src"),
        symlink("h", format!("{o}/victim")),
        hardlink("h", "src"),
        symlink("s", format!("{o}/victim")),
        symlink("s", "elsewhere"),
    ];
    let root = test_support::require_root(
        "entries_replace_symlinks_without_following_them (whiteout part)",
        "whiteouts are device nodes (mknod)",
    );
    if root {
        entries.push(symlink("w", format!("{o}/victim")));
        entries.push(file(".wh.w", 0o644, b""));
    }
    let before = arena.outside_dest();
    let stats = unpack_tar(&tar(&entries), &arena.dest).unwrap();
    assert_eq!(stats.entries, entries.len() as u64);
    assert_eq!(arena.outside_dest(), before);
    assert_eq!(fs::read(arena.outside.join("victim")).unwrap(), b"original");
    assert_eq!(lmeta(&arena.outside.join("victim")).nlink(), 1);
    let mut expected: BTreeSet<String> = [
        "d/ 777",
        "f 666 nlink=1 \"pwned\"",
        "h 644 nlink=2 \"src\"",
        "s -> elsewhere",
        "src 644 nlink=2 \"src\"",
    ]
    .into_iter()
    .map(String::from)
    .collect();
    if root {
        expected.insert("w special 20000 rdev=0".into());
    }
    assert_eq!(tree(&arena.dest), expected);
}

/// A damaged or mislabelled archive: the bytes, how they claim to be compressed, the diff_id the image config
/// would give, and the reason substring of the refusal (the entry named is always `archive`).
struct Damaged {
    case: &'static str,
    bytes: Vec<u8>,
    compression: Compression,
    diff_id: Option<Sha256>,
    reason: String,
}

/// The archive [`damaged_cases`] damages: a directory, a 4 KiB file and a file after it.
fn good_archive() -> Vec<u8> {
    tar(&[
        dir("usr/", 0o755),
        file("usr/big", 0o644, &[7u8; 4096]),
        file("after", 0o644, b"x"),
    ])
}

/// `good` (from [`good_archive`]) gzipped: a good stream.
fn gzipped(good: &[u8]) -> Vec<u8> {
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    std::io::Write::write_all(&mut gz, good).unwrap();
    gz.finish().unwrap()
}

fn damaged_cases(good: &[u8]) -> Vec<Damaged> {
    let damaged =
        |case, bytes: &[u8], compression, diff_id: Option<Sha256>, reason: &str| Damaged {
            case,
            bytes: bytes.to_vec(),
            compression,
            diff_id,
            reason: reason.to_owned(),
        };
    let right = Sha256::of(good);
    let wrong = Sha256::of(b"something else");
    // Cut in the middle of usr/big's data.
    let cut = &good[..512 * 3 + 1000];
    let mut garbage = good.to_vec();
    garbage[10] ^= 0x55; // the first header's checksum no longer matches
    vec![
        damaged(
            "truncated",
            cut,
            Compression::None,
            Some(Sha256::of(cut)),
            "damaged archive",
        ),
        damaged(
            "truncated, no diff_id",
            cut,
            Compression::None,
            None,
            "damaged archive",
        ),
        damaged(
            "wrong diff_id",
            good,
            Compression::None,
            Some(wrong.clone()),
            &format!("uncompressed content has digest {right}, the image config says {wrong}"),
        ),
        damaged(
            "gzip that is not gzip",
            good,
            Compression::Gzip,
            Some(right.clone()),
            "damaged archive",
        ),
        damaged(
            "zstd that is not zstd",
            good,
            Compression::Zstd,
            Some(right),
            "damaged archive",
        ),
        damaged(
            "bad header checksum",
            &garbage,
            Compression::None,
            None,
            "damaged archive",
        ),
        // Compressed layers with a good stream and the wrong diff_id are refused too.
        damaged(
            "gzip with the wrong diff_id",
            &gzipped(good),
            Compression::Gzip,
            Some(wrong),
            "uncompressed content has digest",
        ),
    ]
}

#[test]
fn damaged_and_mislabelled_archives_are_refused() {
    let good = good_archive();
    let d = digest_of_layer();
    let mut failures = Vec::new();
    for Damaged {
        case,
        bytes,
        compression,
        diff_id,
        reason,
    } in damaged_cases(&good)
    {
        let t = tempfile::tempdir().unwrap();
        match layer_error(unpack(
            bytes.as_slice(),
            compression,
            &d,
            diff_id.as_ref(),
            t.path(),
        )) {
            Ok((e, r)) if e == "archive" && r.contains(&reason) => {}
            Ok((e, r)) => failures.push(format!(
                "{case}: entry {e:?}, reason {r:?}, expected archive / {reason:?}"
            )),
            Err(e) => failures.push(format!("{case}: {e}")),
        }
    }
    // And the gzip stream with the right diff_id unpacks.
    let t = tempfile::tempdir().unwrap();
    let s = unpack(
        gzipped(&good).as_slice(),
        Compression::Gzip,
        &d,
        Some(&Sha256::of(&good)),
        t.path(),
    )
    .unwrap();
    assert_eq!((s.entries, s.bytes), (3, 4097));
    assert_eq!(fs::read(t.path().join("usr/big")).unwrap(), vec![7u8; 4096]);

    assert!(
        failures.is_empty(),
        "{} case(s) failed:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

// ---------------------------------------------------------------------------------------------------------------
// 3. The store
// ---------------------------------------------------------------------------------------------------------------

fn base_layer() -> Vec<u8> {
    base_layer_with(b"ID=test\n")
}

fn base_layer_with(os_release: &[u8]) -> Vec<u8> {
    tar(&[
        dir("usr/", 0o755),
        dir("usr/bin/", 0o755),
        file("usr/bin/python3", 0o755, b"#!python\n"),
        symlink("usr/bin/python", "python3"),
        dir("etc/", 0o755),
        file("etc/os-release", 0o644, os_release),
    ])
}

fn extra_layer(name: &str) -> Vec<u8> {
    tar(&[
        dir("opt/", 0o755),
        file(format!("opt/{name}"), 0o644, name.as_bytes()),
    ])
}

/// Writes the tars to files and packs them (bottom first) into `<dir>/<name>`.
fn make_layout(
    dir: &Path,
    name: &str,
    layers: &[Vec<u8>],
    compression: Compression,
) -> (PathBuf, Sha256) {
    let tars = dir.join(format!("{name}-tars"));
    fs::create_dir_all(&tars).unwrap();
    let paths: Vec<PathBuf> = layers
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let p = tars.join(format!("{i}.tar"));
            fs::write(&p, t).unwrap();
            p
        })
        .collect();
    let out = dir.join(name);
    let opts = PackOptions {
        compression,
        env: vec!["PATH=/usr/bin".into(), "LANG=C.UTF-8".into()],
        cmd: vec!["python3".into()],
        created: Some(1_700_000_000),
    };
    let digest = pack(&out, &paths, &opts).unwrap();
    (out, digest)
}

fn flip_byte(path: &Path, at: usize) {
    let mut b = fs::read(path).unwrap();
    b[at] ^= 0x01;
    fs::write(path, b).unwrap();
}

/// Names in `refs/`, `layers/` and `tmp/` of the store.
fn store_content(store: &ImageStore) -> (Vec<String>, Vec<String>, Vec<String>) {
    let r = store.root();
    (
        names(&r.join("refs")),
        names(&r.join("layers")),
        names(&r.join("tmp")),
    )
}

fn hexes(digests: &[&Sha256]) -> Vec<String> {
    let mut v: Vec<String> = digests.iter().map(|d| d.hex().to_owned()).collect();
    v.sort();
    v
}

#[test]
fn store_imports_lists_and_caches() {
    let tmp = tempfile::tempdir().unwrap();
    let (dir, manifest) = make_layout(
        tmp.path(),
        "py",
        &[base_layer(), extra_layer("a")],
        Compression::Gzip,
    );
    let lay = layout::open(&dir).unwrap();
    let store = ImageStore::open(&tmp.path().join("state/images/oci")).unwrap();

    let r = store.import(&dir, "py").unwrap();
    assert_eq!((r.layers_unpacked, r.layers_cached), (2, 0));
    assert_eq!(r.stats.entries, 8);
    assert_eq!(r.stats.bytes, 9 + 8 + 1);
    assert_eq!(r.image.name, "py");
    assert_eq!(r.image.manifest_digest, manifest);
    assert_eq!(r.image.config_digest, lay.config_digest);
    assert_eq!(r.image.layers, lay.layers);
    assert_eq!(r.image.run.env, ["PATH=/usr/bin", "LANG=C.UTF-8"]);
    assert_eq!(r.image.run.cmd, ["python3"]);
    assert_eq!(r.image.unpacked_bytes, 18);
    assert_eq!(r.image.source, fs::canonicalize(&dir).unwrap());

    assert_eq!(store.get("py").unwrap(), r.image);
    assert_eq!(store.list().unwrap(), vec![r.image.clone()]);
    let lowers = store.lower_dirs(&r.image);
    assert_eq!(
        lowers,
        [
            store.layer_dir(&lay.layers[1].digest),
            store.layer_dir(&lay.layers[0].digest)
        ],
        "top first"
    );
    assert_eq!(fs::read(lowers[0].join("opt/a")).unwrap(), b"a");
    assert_eq!(
        fs::read(lowers[1].join("usr/bin/python3")).unwrap(),
        b"#!python\n"
    );
    assert_eq!(
        fs::read_link(lowers[1].join("usr/bin/python")).unwrap(),
        Path::new("python3")
    );
    assert_eq!(
        store_content(&store),
        (
            vec!["py.json".into()],
            hexes(&[&lay.layers[0].digest, &lay.layers[1].digest]),
            vec![]
        )
    );

    // Again, and under a second name: nothing is unpacked twice.
    let again = store.import(&dir, "py").unwrap();
    assert_eq!((again.layers_unpacked, again.layers_cached), (0, 2));
    assert_eq!(again.image.unpacked_bytes, 18);
    assert_eq!(again.stats, UnpackStats::default());
    let second = store.import(&dir, "py2").unwrap();
    assert_eq!((second.layers_unpacked, second.layers_cached), (0, 2));
    let listed: Vec<String> = store.list().unwrap().into_iter().map(|i| i.name).collect();
    assert_eq!(listed, ["py", "py2"]);

    imports_reuse_cached_layers(&store, tmp.path());
    names_are_checked(&store, &dir);
}

/// After [`store_imports_lists_and_caches`]'s imports into `store`: a cached layer is not unpacked again, and a
/// layer listed twice in one image is unpacked and mounted once.
fn imports_reuse_cached_layers(store: &ImageStore, tmp: &Path) {
    // A single-layer image whose layer is cached.
    let (one, _) = make_layout(tmp, "one", &[base_layer()], Compression::Gzip);
    let r = store.import(&one, "one").unwrap();
    assert_eq!((r.layers_unpacked, r.layers_cached), (0, 1));
    assert_eq!(r.image.unpacked_bytes, 17);

    // A new layer listed twice in one image is unpacked once.
    let (twice, _) = make_layout(
        tmp,
        "twice",
        &[extra_layer("t"), extra_layer("t")],
        Compression::Gzip,
    );
    let r = store.import(&twice, "twice").unwrap();
    assert_eq!((r.layers_unpacked, r.layers_cached), (1, 1));
    assert_eq!((r.stats.entries, r.image.unpacked_bytes), (2, 2));
    assert_eq!(r.image.layers.len(), 2);
    // ...and mounted once: overlayfs refuses a repeated lower directory.
    assert_eq!(
        store.lower_dirs(&r.image),
        vec![store.layer_dir(&r.image.layers[0].digest)]
    );
    assert_eq!(names(&store.root().join("tmp")), Vec::<String>::new());
    assert_eq!(store_content(store).1.len(), 3);
    assert!(matches!(store.remove("twice"), Ok(1)));
}

/// Unknown and invalid names are refused, and refused imports leave no reference behind.
fn names_are_checked(store: &ImageStore, dir: &Path) {
    assert!(matches!(store.get("nope"), Err(ImageError::NotFound(n)) if n == "nope"));
    assert!(matches!(store.get("Bad"), Err(ImageError::InvalidName(_))));
    assert!(matches!(
        store.import(dir, "host"),
        Err(ImageError::InvalidName(_))
    ));
    assert!(matches!(
        store.import(dir, "../x"),
        Err(ImageError::InvalidName(_))
    ));
    assert_eq!(
        names(&store.root().join("refs")),
        ["one.json", "py.json", "py2.json"]
    );
}

/// Imports `dir` as `name` expecting a blob error naming `digest` with `reason` in it, and a store left as it was.
fn expect_blob_error(store: &ImageStore, dir: &Path, name: &str, digest: &Sha256, reason: &str) {
    let before = store_content(store);
    match store.import(dir, name) {
        Err(ImageError::Blob {
            digest: d,
            reason: r,
        }) => {
            assert_eq!(d, digest.as_str(), "{r}");
            assert!(r.contains(reason), "{r:?} does not contain {reason:?}");
        }
        other => panic!("expected a blob error, got {other:?}"),
    }
    assert!(matches!(store.get(name), Err(ImageError::NotFound(_))));
    assert_eq!(store_content(store), before);
    assert!(store_content(store).2.is_empty());
}

#[test]
fn store_refuses_tampered_blobs_and_keeps_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let store = ImageStore::open(&tmp.path().join("store")).unwrap();
    for compression in [Compression::None, Compression::Gzip, Compression::Zstd] {
        let name = format!("{compression:?}").to_lowercase();
        let (dir, manifest) = make_layout(
            tmp.path(),
            &name,
            &[base_layer(), extra_layer(&name)],
            compression,
        );
        let lay = layout::open(&dir).unwrap();
        let top = &lay.layers[1];
        let blob = layout::blob_path(&dir, &top.digest);
        let original = fs::read(&blob).unwrap();

        // One byte flipped, same size.
        flip_byte(&blob, original.len() / 2);
        expect_blob_error(&store, &dir, &name, &top.digest, "modified or is corrupt");
        // Truncated.
        fs::write(&blob, &original[..original.len() - 10]).unwrap();
        expect_blob_error(
            &store,
            &dir,
            &name,
            &top.digest,
            &format!(
                "size is {} bytes, the descriptor says {}",
                original.len() - 10,
                original.len()
            ),
        );
        // Trailing bytes.
        let mut longer = original.clone();
        longer.extend_from_slice(b"\0\0\0\0");
        fs::write(&blob, &longer).unwrap();
        expect_blob_error(&store, &dir, &name, &top.digest, "the descriptor says");
        // A symlink to a good copy.
        let copy = tmp.path().join(format!("{name}-copy"));
        fs::write(&copy, &original).unwrap();
        fs::remove_file(&blob).unwrap();
        std::os::unix::fs::symlink(&copy, &blob).unwrap();
        expect_blob_error(&store, &dir, &name, &top.digest, "cannot open");
        fs::remove_file(&blob).unwrap();
        // Missing.
        expect_blob_error(&store, &dir, &name, &top.digest, "cannot open");
        fs::write(&blob, &original).unwrap();

        // The manifest and the config blobs.
        for (what, digest) in [("manifest", &manifest), ("config", &lay.config_digest)] {
            let p = layout::blob_path(&dir, digest);
            let original = fs::read(&p).unwrap();
            let at = original.iter().position(|b| *b == b':').unwrap() + 1;
            flip_byte(&p, at);
            expect_blob_error(&store, &dir, &name, digest, "modified or is corrupt");
            assert!(
                matches!(layout::open(&dir), Err(ImageError::Blob { digest: d, .. }) if d == digest.as_str()),
                "{what}"
            );
            fs::write(&p, &original).unwrap();
        }

        // Restored, it imports.
        let r = store.import(&dir, &name).unwrap();
        assert_eq!(r.image.manifest_digest, manifest);
    }
    assert_eq!(
        names(&store.root().join("refs")),
        ["gzip.json", "none.json", "zstd.json"]
    );
}

#[test]
fn store_rechecks_blobs_of_cached_layers() {
    let tmp = tempfile::tempdir().unwrap();
    let store = ImageStore::open(&tmp.path().join("store")).unwrap();
    let (dir, _) = make_layout(tmp.path(), "img", &[base_layer()], Compression::Gzip);
    let lay = layout::open(&dir).unwrap();
    store.import(&dir, "first").unwrap();
    let blob = layout::blob_path(&dir, &lay.layers[0].digest);
    flip_byte(&blob, 40);
    expect_blob_error(
        &store,
        &dir,
        "second",
        &lay.layers[0].digest,
        "modified or is corrupt",
    );
    assert_eq!(names(&store.root().join("refs")), ["first.json"]);
}

/// Imports expecting a layer error naming `digest`, `entry` and `reason`.
fn expect_layer_error(
    store: &ImageStore,
    dir: &Path,
    name: &str,
    digest: &Sha256,
    entry: &str,
    reason: &str,
) {
    match store.import(dir, name) {
        Err(ImageError::Layer {
            digest: d,
            entry: e,
            reason: r,
        }) => {
            assert_eq!((d.as_str(), e.as_str()), (digest.as_str(), entry), "{r}");
            assert!(r.contains(reason), "{r:?} does not contain {reason:?}");
        }
        other => panic!("expected a layer error, got {other:?}"),
    }
}

#[test]
fn store_refuses_hostile_layers_and_keeps_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let store = ImageStore::open(&tmp.path().join("store")).unwrap();
    let hostile = tar(&[
        dir("dev/", 0o755),
        device("dev/sda", EntryType::Block, 8, 0),
    ]);

    let (one, _) = make_layout(
        tmp.path(),
        "one",
        std::slice::from_ref(&hostile),
        Compression::Gzip,
    );
    let lay = layout::open(&one).unwrap();
    expect_layer_error(
        &store,
        &one,
        "one",
        &lay.layers[0].digest,
        "dev/sda",
        "device nodes are refused",
    );
    assert_eq!(store_content(&store), (vec![], vec![], vec![]));

    // A good layer below a hostile one: the good one does not stay behind either.
    let (two, _) = make_layout(
        tmp.path(),
        "two",
        &[base_layer(), hostile],
        Compression::Zstd,
    );
    let lay = layout::open(&two).unwrap();
    expect_layer_error(
        &store,
        &two,
        "two",
        &lay.layers[1].digest,
        "dev/sda",
        "device nodes are refused",
    );
    assert_eq!(store_content(&store), (vec![], vec![], vec![]));

    // A layer whose diff_id does not match (the config lies about the uncompressed content).
    let (lying, _) = make_layout(tmp.path(), "lying", &[base_layer()], Compression::None);
    let lay = layout::open(&lying).unwrap();
    let blob = layout::blob_path(&lying, &lay.layers[0].digest);
    let other = base_layer_with(b"ID=evil\n");
    assert_eq!(
        other.len(),
        fs::metadata(&blob).unwrap().len() as usize,
        "same size"
    );
    // Replace the layer blob and its descriptor digest, keeping the config (and its diff_id) as it was.
    let new_digest = Sha256::of(&other);
    fs::write(layout::blob_path(&lying, &new_digest), &other).unwrap();
    let manifest_path = layout::blob_path(&lying, &lay.manifest_digest);
    let manifest = fs::read_to_string(&manifest_path)
        .unwrap()
        .replace(lay.layers[0].digest.as_str(), new_digest.as_str());
    let manifest_digest = Sha256::of(manifest.as_bytes());
    fs::write(layout::blob_path(&lying, &manifest_digest), &manifest).unwrap();
    let index = fs::read_to_string(lying.join("index.json"))
        .unwrap()
        .replace(lay.manifest_digest.as_str(), manifest_digest.as_str());
    fs::write(lying.join("index.json"), index).unwrap();
    expect_layer_error(
        &store,
        &lying,
        "lying",
        &new_digest,
        "archive",
        "the image config says",
    );
    assert_eq!(store_content(&store), (vec![], vec![], vec![]));
}

#[test]
fn store_remove_waits_for_users_and_keeps_shared_layers() {
    let tmp = tempfile::tempdir().unwrap();
    let store = ImageStore::open(&tmp.path().join("store")).unwrap();
    let (a, _) = make_layout(
        tmp.path(),
        "a",
        &[base_layer(), extra_layer("a")],
        Compression::Gzip,
    );
    let (b, _) = make_layout(
        tmp.path(),
        "b",
        &[base_layer(), extra_layer("b")],
        Compression::Gzip,
    );
    let (la, lb) = (layout::open(&a).unwrap(), layout::open(&b).unwrap());
    assert_eq!(la.layers[0], lb.layers[0], "the base layer is shared");
    let (base, only_a, only_b) = (
        &la.layers[0].digest,
        &la.layers[1].digest,
        &lb.layers[1].digest,
    );
    store.import(&a, "a").unwrap();
    assert_eq!(store.import(&b, "b").unwrap().layers_cached, 1);
    assert_eq!(store_content(&store).1, hexes(&[base, only_a, only_b]));

    let guard = store.lock_shared().unwrap();
    match store.remove("a") {
        Err(ImageError::Busy(p)) => assert_eq!(p, store.root()),
        other => panic!("expected Busy, got {other:?}"),
    }
    assert!(store.get("a").is_ok());
    assert_eq!(store_content(&store).1, hexes(&[base, only_a, only_b]));
    // A second holder (another daemon) shares the lock.
    let guard2 = store.lock_shared().unwrap();
    drop(guard);
    assert!(matches!(store.remove("a"), Err(ImageError::Busy(_))));
    drop(guard2);

    assert_eq!(store.remove("a").unwrap(), 1);
    assert!(matches!(store.get("a"), Err(ImageError::NotFound(_))));
    assert!(store.get("b").is_ok());
    assert_eq!(
        store_content(&store),
        (vec!["b.json".into()], hexes(&[base, only_b]), vec![])
    );
    assert!(matches!(store.remove("a"), Err(ImageError::NotFound(n)) if n == "a"));

    assert_eq!(store.remove("b").unwrap(), 2);
    assert_eq!(store_content(&store), (vec![], vec![], vec![]));
}

#[test]
fn store_remove_refuses_names_outside_refs() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("state/images/oci");
    let store = ImageStore::open(&root).unwrap();
    let victim = tmp.path().join("state/images/victim.json");
    fs::write(&victim, b"{}").unwrap();
    let in_root = root.join("lock.json");
    fs::write(&in_root, b"{}").unwrap();
    for name in ["../../victim", "../lock", "/etc/passwd", "Bad", "host"] {
        assert!(
            matches!(store.remove(name), Err(ImageError::InvalidName(n)) if n == name),
            "{name}"
        );
    }
    assert!(victim.exists());
    assert!(in_root.exists());
}

// ---------------------------------------------------------------------------------------------------------------
// 4. pack
// ---------------------------------------------------------------------------------------------------------------

fn all_files(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut out: Vec<(String, Vec<u8>)> = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else {
                let rel = p.strip_prefix(dir).unwrap().display().to_string();
                out.push((rel, fs::read(&p).unwrap()));
            }
        }
    }
    out.sort();
    out
}

#[test]
fn pack_is_deterministic_and_labels_compression() {
    let tmp = tempfile::tempdir().unwrap();
    let layer = base_layer();
    let tar_path = tmp.path().join("layer.tar");
    fs::write(&tar_path, &layer).unwrap();
    let mut manifests = BTreeSet::new();
    for compression in [Compression::None, Compression::Gzip, Compression::Zstd] {
        let opts = PackOptions {
            compression,
            ..PackOptions::default()
        };
        let (one, two) = (
            tmp.path().join(format!("{compression:?}-1")),
            tmp.path().join(format!("{compression:?}-2")),
        );
        let d1 = pack(&one, std::slice::from_ref(&tar_path), &opts).unwrap();
        let d2 = pack(&two, std::slice::from_ref(&tar_path), &opts).unwrap();
        assert_eq!(d1, d2, "{compression:?}");
        let files = all_files(&one);
        assert_eq!(
            files,
            all_files(&two),
            "{compression:?}: byte-identical layouts"
        );
        assert_eq!(
            files.len(),
            5,
            "oci-layout, index.json, manifest, config, layer"
        );
        assert!(!files.iter().any(|(n, _)| n.contains(".tmp")));
        manifests.insert(d1.clone());

        let lay = layout::open(&one).unwrap();
        assert_eq!(lay.manifest_digest, d1);
        assert_eq!(lay.layers.len(), 1);
        let l = &lay.layers[0];
        assert_eq!(l.compression, compression);
        assert_eq!(l.diff_id, Sha256::of(&layer));
        let blob = fs::read(layout::blob_path(&one, &l.digest)).unwrap();
        assert_eq!(l.size, blob.len() as u64);
        assert_eq!(l.digest, Sha256::of(&blob));
        match compression {
            Compression::None => assert_eq!(blob, layer),
            Compression::Gzip => assert_eq!(blob[..2], [0x1f, 0x8b]),
            Compression::Zstd => assert_eq!(blob[..4], [0x28, 0xb5, 0x2f, 0xfd]),
        }
        layout::verify_blob(&one, &l.digest, l.size).unwrap();
        // The blob unpacks to the tar's content under its diff_id.
        let dest = tmp.path().join(format!("{compression:?}-unpacked"));
        fs::create_dir(&dest).unwrap();
        let file = layout::open_blob(&one, &l.digest, l.size).unwrap();
        let s = unpack(file, l.compression, &l.digest, Some(&l.diff_id), &dest).unwrap();
        assert_eq!((s.entries, s.bytes), (6, 17));
        assert_eq!(fs::read(dest.join("etc/os-release")).unwrap(), b"ID=test\n");
    }
    assert_eq!(manifests.len(), 3, "each compression gives its own image");

    // `created` is part of the identity; two layers keep their order.
    let extra = tmp.path().join("extra.tar");
    fs::write(&extra, extra_layer("x")).unwrap();
    let with = |created, out: &str| {
        let opts = PackOptions {
            created,
            ..PackOptions::default()
        };
        pack(
            &tmp.path().join(out),
            &[tar_path.clone(), extra.clone()],
            &opts,
        )
        .unwrap()
    };
    assert_eq!(
        with(Some(1_700_000_000), "c1"),
        with(Some(1_700_000_000), "c2")
    );
    assert_ne!(with(Some(1_700_000_000), "c3"), with(None, "c4"));
    let lay = layout::open(&tmp.path().join("c1")).unwrap();
    assert_eq!(
        lay.layers
            .iter()
            .map(|l| l.diff_id.clone())
            .collect::<Vec<_>>(),
        [Sha256::of(&layer), Sha256::of(&extra_layer("x"))]
    );
}

#[test]
fn deep_or_long_paths_are_refused_and_aufs_metadata_is_skipped() {
    let tmp = tempfile::tempdir().unwrap();
    // 129 directories deep: removal holds a descriptor per level, so depth is bounded.
    let deep = "d/".repeat(129) + "f";
    let dest = tmp.path().join("deep");
    fs::create_dir(&dest).unwrap();
    let (entry, reason) = layer_error(unpack_tar(
        &tar(&[file(&deep, 0o644, b"x").long_name()]),
        &dest,
    ))
    .unwrap();
    assert_eq!(entry, deep);
    assert!(reason.contains("deeper than 128"), "{reason}");
    assert_eq!(names(&dest), Vec::<String>::new(), "nothing was created");
    // 128 deep is fine.
    let ok = "d/".repeat(127) + "f";
    let dest = tmp.path().join("ok");
    fs::create_dir(&dest).unwrap();
    unpack_tar(&tar(&[file(&ok, 0o644, b"x").long_name()]), &dest).unwrap();
    // Longer than PATH_MAX.
    let long = "x".repeat(200) + "/" + &"y".repeat(200);
    let long = (0..11).map(|_| long.as_str()).collect::<Vec<_>>().join("/");
    let dest = tmp.path().join("long");
    fs::create_dir(&dest).unwrap();
    let (_, reason) = layer_error(unpack_tar(
        &tar(&[file(&long, 0o644, b"x").long_name()]),
        &dest,
    ))
    .unwrap();
    assert!(reason.contains("longer than 4096"), "{reason}");
    // aufs bookkeeping is skipped, not refused and not created.
    let dest = tmp.path().join("aufs");
    fs::create_dir(&dest).unwrap();
    let stats = unpack_tar(
        &tar(&[
            dir(".wh..wh.plnk", 0o700),
            file(".wh..wh.plnk/1234.5678", 0o644, b"x"),
            file(".wh..wh.aufs", 0o600, b""),
            dir(".wh..wh.orph", 0o700),
            file("kept", 0o644, b"k"),
        ]),
        &dest,
    )
    .unwrap();
    assert_eq!(stats.entries, 1);
    assert_eq!(names(&dest), vec!["kept".to_owned()]);
}

#[test]
fn store_upkeep_survives_crash_leftovers_and_refuses_to_guess() {
    if !test_support::require_root(
        "store_upkeep_survives_crash_leftovers_and_refuses_to_guess",
        "whiteouts",
    ) {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("state/images/oci");
    let (dir, _) = make_layout(
        tmp.path(),
        "a",
        &[base_layer(), extra_layer("a")],
        Compression::Zstd,
    );
    let (dir_b, _) = make_layout(
        tmp.path(),
        "b",
        &[base_layer(), extra_layer("b")],
        Compression::Zstd,
    );
    {
        let store = ImageStore::open(&root).unwrap();
        store.import(&dir, "a").unwrap();
        store.import(&dir_b, "b").unwrap();
    }
    // What a killed import or rm leaves: an unfinished unpack, a layer on its way out, a record being written.
    fs::create_dir_all(root.join("tmp/deadbeef.123.456/usr")).unwrap();
    fs::write(root.join("tmp/deadbeef.123.456/usr/half"), b"x").unwrap();
    fs::write(root.join("refs/a.json.tmp.999"), b"{\"half\":").unwrap();
    let store = ImageStore::open(&root).unwrap();
    assert_eq!(
        names(&root.join("tmp")),
        Vec::<String>::new(),
        "open clears tmp/"
    );
    assert_eq!(
        store.list().unwrap().len(),
        2,
        "a half-written record is not an image"
    );

    // rm: the layers only "a" uses leave layers/ in one rename each; the shared base stays.
    let before = names(&root.join("layers"));
    assert_eq!(before.len(), 3);
    assert_eq!(store.remove("a").unwrap(), 1);
    assert_eq!(names(&root.join("layers")).len(), 2);
    assert_eq!(names(&root.join("tmp")), Vec::<String>::new());

    // A record that does not parse stops collection instead of losing the layers it may name.
    fs::write(root.join("refs/broken.json"), b"not json").unwrap();
    let e = store.remove("b").unwrap_err();
    assert!(
        e.to_string().contains("broken.json") && e.to_string().contains("does not parse"),
        "{e}"
    );
    assert_eq!(
        names(&root.join("layers")).len(),
        2,
        "nothing was collected"
    );
}

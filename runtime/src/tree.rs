//! Copies and walks of a directory tree with a digest of what it holds: a snapshot's copy of a workspace
//! ([`copy_tree`]), the walk of one already copied ([`walk_tree`]), and an overlay's upper layer carried from one
//! container's root to another's ([`copy_layer`]: its whiteouts and opaque directories kept, its owners mapped).
//! A copy to keep on disk ([`copy_tree_durable`], [`copy_layer_durable`]) is durable when it returns through fsyncs
//! of its own files and directories only: how long that takes does not depend on what else the filesystem holds
//! unwritten, as a `syncfs` would.
//!
//! Written here by hand: the copy must never follow a link a sandbox made, must leave out what is mounted into the
//! tree and must not keep set-id bits, and no crate does that with a digest of the result in one pass.

use std::ffi::{CString, OsString};
use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use sha2::{Digest, Sha256};

/// Entries a copy's `skipped` lists at most.
const MAX_SKIPPED: usize = 100;
/// The owner an entry of a layer gets when its owner is not the one mapped (`nobody`, the kernel's overflow id).
pub const NOBODY: u32 = 65534;
/// The extended attribute that makes an upper directory opaque (what is below it hidden).
const OPAQUE: &str = "trusted.overlay.opaque";
/// The one a renamed lower directory's upper directory has.
const REDIRECT: &str = "trusted.overlay.redirect";

/// How [`copy_layer`] gives owners: an entry owned (user and group) by `from` gets `to`; any other owner becomes
/// [`NOBODY`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LayerOwners {
    /// The id that is the container's root where the layer comes from.
    pub from: u32,
    /// The one that is its root where the layer goes.
    pub to: u32,
}

impl LayerOwners {
    fn map(self, id: u32) -> u32 {
        if id == self.from {
            self.to
        } else {
            NOBODY
        }
    }
}

/// What a layer copy does beyond a plain copy.
#[derive(Clone, Copy)]
struct LayerMode<'a> {
    owners: LayerOwners,
    /// Top-level names left out (the runtime's mount points, which the next root makes again).
    leave_out: &'a [&'a str],
}

impl LayerMode<'_> {
    /// Whether entry `name` of directory `rel` is left out (a top-level name in `leave_out`).
    fn leaves_out(&self, rel: &Path, name: &std::ffi::OsStr) -> bool {
        rel.as_os_str().is_empty()
            && self
                .leave_out
                .iter()
                .any(|n| name.as_bytes() == n.as_bytes())
    }
}

/// What [`copy_tree`] copied.
#[derive(Debug, Default)]
pub struct Copied {
    /// `sha256:<hex>` over every entry (kind, stored mode, size, path, content hash or link target) in walk order.
    pub digest: String,
    /// Bytes of file content.
    pub bytes: u64,
    /// Files, directories and links (the top directory not counted).
    pub files: u64,
    /// Paths left out (at most [`MAX_SKIPPED`]), with why.
    pub skipped: Vec<String>,
    /// What it was charged against its bound: file content, and [`ENTRY_BYTES`] per other entry.
    pub charged: u64,
}

/// Bytes a directory or a link is charged against a snapshot's size (a block of the state disk).
const ENTRY_BYTES: u64 = 4096;
/// Bytes of paths a copy keeps at once (the directories still to walk, and those whose modes are set last).
const MAX_PATH_BYTES: usize = 64 << 20;
/// Files (or directories) a durable copy keeps open until they are synced, at most: synced a batch at a time.
const SYNC_BATCH: usize = 256;
/// Threads a durable copy syncs a batch on. Each fsync waits for its file's writeback, the write of its metadata (a
/// journal commit, on a filesystem with a journal) and a flush of the disk's cache; those in flight together share
/// the commit, and the block layer merges their flushes, so that a batch takes a few flushes' time rather than one
/// per file (1 000 files of 100 KiB on an ext4: about 25 ms on 16 threads, 70 to 145 ms on one).
pub const SYNC_THREADS: usize = 16;

/// Copies the tree at `src` into the new directory `dst` (blocking): regular files, directories and symbolic links
/// (as links: never followed), each owned by the caller (0), with its permission bits (set-id bits dropped) and
/// modification time; anything else, and any directory on another filesystem (a mount), is left out and listed.
/// `src` must not change meanwhile. More than `max_bytes` (file content, and [`ENTRY_BYTES`] per directory and
/// link), more entries than a tmpfs of `max_bytes` holds, or a tree whose paths would take more than
/// [`MAX_PATH_BYTES`] to walk, is an error of kind `FileTooLarge`. The digest covers each entry in the walk's order
/// (a directory's entries sorted by name, depth first), each field length-prefixed.
pub fn copy_tree(src: &Path, dst: &Path, max_bytes: u64) -> std::io::Result<Copied> {
    walk(src, Some(dst), max_bytes, (true, false), None)
}

/// [`copy_tree`], with the copy durable when it returns: each file, and each directory once its entries are in it,
/// is fsynced (`fsync(2)` of the copy's own files, not `syncfs(2)`, so that it waits for none of what else is being
/// written to the same filesystem). Each file's writeback is started as soon as it is written, and the files are
/// synced a batch at a time on [`SYNC_THREADS`] threads (their flushes merged by the block layer); links and
/// whiteouts are durable through their directory's fsync.
pub fn copy_tree_durable(src: &Path, dst: &Path, max_bytes: u64) -> std::io::Result<Copied> {
    walk(src, Some(dst), max_bytes, (true, true), None)
}

/// [`copy_tree`]'s walk, which copies into `dst` when there is one and hashes the content when `hash` (without, the
/// digest is of the sizes and names only): the same digest for the same tree, copied or not.
pub fn walk_tree(
    src: &Path,
    dst: Option<&Path>,
    max_bytes: u64,
    hash: bool,
) -> std::io::Result<Copied> {
    walk(src, dst, max_bytes, (hash, false), None)
}

/// Copies the upper layer of an overlay at `src` into the new directory `dst` (blocking), as [`copy_tree`] does
/// with three differences: each entry gets its owner through `owners` (the top directory keeps the caller's); a
/// whiteout (a character device 0:0) is copied as one, and a directory's opaque mark with it; the top-level names
/// in `leave_out` are left out (not listed). The digest also covers each entry's owner and mark. `src` must not
/// change meanwhile (its overlay's container frozen, or not mounted).
pub fn copy_layer(
    src: &Path,
    dst: &Path,
    (owners, leave_out): (LayerOwners, &[&str]),
    max_bytes: u64,
) -> std::io::Result<Copied> {
    let mode = LayerMode { owners, leave_out };
    walk(src, Some(dst), max_bytes, (true, false), Some(mode))
}

/// [`copy_layer`], with the copy durable when it returns, as [`copy_tree_durable`] makes it.
pub fn copy_layer_durable(
    src: &Path,
    dst: &Path,
    (owners, leave_out): (LayerOwners, &[&str]),
    max_bytes: u64,
) -> std::io::Result<Copied> {
    let mode = LayerMode { owners, leave_out };
    walk(src, Some(dst), max_bytes, (true, true), Some(mode))
}

/// Makes the tree at `dir`, written by a copy that was not durable, durable (blocking): every regular file and
/// directory in it fsynced, as [`copy_tree_durable`] syncs its copy (links are not followed; they, and any other
/// entry, are durable through their directory's fsync).
pub fn sync_tree(dir: &Path) -> std::io::Result<()> {
    let mut sync = Syncer::default();
    let (mut dirs, mut todo) = (Vec::new(), vec![dir.to_owned()]);
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d)? {
            let e = e?;
            let ft = e.file_type()?;
            if ft.is_dir() {
                todo.push(e.path());
            } else if ft.is_file() {
                let f = std::fs::OpenOptions::new()
                    .read(true)
                    .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
                    .open(e.path())?;
                sync.written(f)?;
            }
        }
        dirs.push(d);
    }
    sync.finish(dirs.iter().map(PathBuf::as_path))
}

/// The walk of [`walk_tree`] and the copies: `dst` durable on return with `durable`.
fn walk(
    src: &Path,
    dst: Option<&Path>,
    max_bytes: u64,
    (hash, durable): (bool, bool),
    layer: Option<LayerMode<'_>>,
) -> std::io::Result<Copied> {
    let top = std::fs::symlink_metadata(src)?;
    if !top.is_dir() {
        return Err(std::io::Error::other(format!(
            "{} is not a directory",
            src.display()
        )));
    }
    let dev = top.dev();
    let max_entries = crate::spec::inodes_for(max_bytes);
    if let Some(dst) = dst {
        std::fs::DirBuilder::new().mode(0o700).create(dst)?;
    }
    let too_large = || std::io::Error::from(std::io::ErrorKind::FileTooLarge);
    let (mut out, mut charged, mut path_bytes) = (Copied::default(), 0u64, 0usize);
    let mut h = Sha256::new();
    // Directories get their modes and times last (after their entries were written).
    let mut dirs: Vec<(PathBuf, std::fs::Metadata)> = Vec::new();
    if let Some(dst) = dst {
        dirs.push((dst.to_owned(), top));
    }
    let mut todo: Vec<PathBuf> = vec![PathBuf::new()];
    let mut buf = vec![0u8; 1 << 20];
    let mut sync = (durable && dst.is_some()).then(Syncer::default);
    while let Some(rel) = todo.pop() {
        let mut names: Vec<OsString> = std::fs::read_dir(src.join(&rel))?
            .map(|e| e.map(|e| e.file_name()))
            .collect::<std::io::Result<_>>()?;
        names.sort();
        // Pushed in reverse, so that they are walked in name order.
        let mut subdirs = Vec::new();
        for name in names {
            if layer.is_some_and(|l| l.leaves_out(&rel, &name)) {
                continue;
            }
            let rel = rel.join(&name);
            let (from, to) = (src.join(&rel), dst.map(|d| d.join(&rel)));
            let md = std::fs::symlink_metadata(&from)?;
            let ft = md.file_type();
            let size = if ft.is_file() { md.len() } else { ENTRY_BYTES };
            charged = charged.saturating_add(size);
            if charged > max_bytes || out.files >= max_entries {
                return Err(too_large());
            }
            let mkdir = |mode: u32| match &to {
                Some(to) => std::fs::DirBuilder::new().mode(mode).create(to),
                None => Ok(()),
            };
            let mut written = None;
            let (kind, mode, detail) = if ft.is_dir() && md.dev() != dev {
                skip(&mut out, &rel, "a mount");
                mkdir(0o755)?;
                (b'd', 0o755, Vec::new())
            } else if ft.is_dir() {
                mkdir(0o700)?;
                path_bytes += 2 * rel.as_os_str().len();
                if path_bytes > MAX_PATH_BYTES {
                    return Err(too_large());
                }
                if let Some(to) = &to {
                    dirs.push((to.clone(), md.clone()));
                }
                subdirs.push(rel.clone());
                (b'd', md.mode() & 0o1777, Vec::new())
            } else if ft.is_file() {
                let content;
                (content, written) = regular(&from, to.as_deref(), &md, hash, &mut buf)?;
                out.bytes += md.len();
                (b'f', md.mode() & 0o777, content)
            } else if ft.is_symlink() {
                let target = std::fs::read_link(&from)?;
                if let Some(to) = &to {
                    std::os::unix::fs::symlink(&target, to)?;
                }
                (b'l', 0o777, target.as_os_str().as_bytes().to_vec())
            } else if layer.is_some() && is_whiteout(&md) {
                if let Some(to) = &to {
                    mknod_whiteout(to)?;
                }
                (b'w', 0, Vec::new())
            } else {
                skip(&mut out, &rel, "not a file, directory or link");
                continue;
            };
            out.files += 1;
            let owned = match layer {
                Some(l) => {
                    carry_owner_and_mark(&from, to.as_deref(), &md, l.owners, &mut out, &rel)?
                }
                None => Vec::new(),
            };
            // Synced once its owner is set too.
            if let (Some(sync), Some(file)) = (&mut sync, written) {
                sync.written(file)?;
            }
            let size = if kind == b'f' { md.len() } else { 0 };
            hash_entry(
                &mut h,
                (kind, mode, size),
                [rel.as_os_str().as_bytes(), &detail, &owned],
            );
        }
        todo.extend(subdirs.into_iter().rev());
    }
    finish_dirs(&dirs, sync)?;
    out.digest = format!("sha256:{}", hex(&h.finalize()));
    out.charged = charged;
    Ok(out)
}

/// A copy's directories, once their entries are in: their modes and times (deepest first), then with `sync` the
/// files it has left and the directories synced.
fn finish_dirs(dirs: &[(PathBuf, std::fs::Metadata)], sync: Option<Syncer>) -> std::io::Result<()> {
    for (dir, md) in dirs.iter().rev() {
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(md.mode() & 0o1777))?;
        set_mtime(dir, md)?;
    }
    match sync {
        Some(sync) => sync.finish(dirs.iter().rev().map(|(dir, _)| dir.as_path())),
        None => Ok(()),
    }
}

/// Adds one entry to a walk's digest: its kind, stored mode and size, then each field length-prefixed; an empty
/// last field (a plain copy's owner part) adds nothing at all, so that a plain copy's digest is what it was before
/// layers had one.
fn hash_entry(h: &mut Sha256, (kind, mode, size): (u8, u32, u64), fields: [&[u8]; 3]) {
    h.update([kind]);
    h.update(mode.to_le_bytes());
    h.update(size.to_le_bytes());
    for (i, field) in fields.into_iter().enumerate() {
        if i == 2 && field.is_empty() {
            break;
        }
        h.update((field.len() as u64).to_le_bytes());
        h.update(field);
    }
}

/// Whether a layer's entry is a whiteout (a character device 0:0: what is below it is removed).
fn is_whiteout(md: &std::fs::Metadata) -> bool {
    use std::os::unix::fs::FileTypeExt;
    md.file_type().is_char_device() && md.rdev() == 0
}

fn mknod_whiteout(to: &Path) -> std::io::Result<()> {
    nix::sys::stat::mknod(
        to,
        nix::sys::stat::SFlag::S_IFCHR,
        nix::sys::stat::Mode::empty(),
        0,
    )
    .map_err(std::io::Error::from)
}

/// A layer's entry `from` copied to `to` (if any): its owner through `owners`, and a directory's opaque mark (a
/// renamed image directory's redirect is not carried: listed). What the digest covers of it: owner, group, mark.
fn carry_owner_and_mark(
    from: &Path,
    to: Option<&Path>,
    md: &std::fs::Metadata,
    owners: LayerOwners,
    out: &mut Copied,
    rel: &Path,
) -> std::io::Result<Vec<u8>> {
    let (uid, gid) = (owners.map(md.uid()), owners.map(md.gid()));
    let opaque = md.is_dir() && xattr(from, OPAQUE)?.is_some_and(|v| v == b"y");
    if md.is_dir() && xattr(from, REDIRECT)?.is_some() {
        skip(
            out,
            rel,
            "a renamed image directory: what the image had in it is not kept",
        );
    }
    if let Some(to) = to {
        if opaque {
            set_xattr(to, OPAQUE, b"y")?;
        }
        nix::unistd::fchownat(
            None,
            to,
            Some(uid.into()),
            Some(gid.into()),
            nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW,
        )
        .map_err(std::io::Error::from)?;
    }
    let mut owned = Vec::with_capacity(9);
    owned.extend(uid.to_le_bytes());
    owned.extend(gid.to_le_bytes());
    owned.push(u8::from(opaque));
    Ok(owned)
}

/// The value of extended attribute `name` of `path` (not followed), `None` when it has none.
fn xattr(path: &Path, name: &str) -> std::io::Result<Option<Vec<u8>>> {
    let (p, n) = (
        c_path(path)?,
        CString::new(name).map_err(std::io::Error::other)?,
    );
    let mut buf = [0u8; 256];
    // SAFETY: both strings are NUL-terminated and outlive the call; `buf` is writable for its whole length.
    let r = unsafe { libc::lgetxattr(p.as_ptr(), n.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
    if r < 0 {
        let e = std::io::Error::last_os_error();
        return match e.raw_os_error() {
            Some(libc::ENODATA) | Some(libc::ENOTSUP) => Ok(None),
            // A longer value than either attribute's meaningful one ("y", a short path): there, but not read.
            Some(libc::ERANGE) => Ok(Some(Vec::new())),
            _ => Err(e),
        };
    }
    Ok(Some(buf[..r as usize].to_vec()))
}

fn set_xattr(path: &Path, name: &str, value: &[u8]) -> std::io::Result<()> {
    let (p, n) = (
        c_path(path)?,
        CString::new(name).map_err(std::io::Error::other)?,
    );
    // SAFETY: both strings are NUL-terminated and outlive the call; `value` is readable for its whole length.
    let r = unsafe {
        libc::lsetxattr(
            p.as_ptr(),
            n.as_ptr(),
            value.as_ptr().cast(),
            value.len(),
            0,
        )
    };
    if r < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

fn c_path(path: &Path) -> std::io::Result<CString> {
    CString::new(path.as_os_str().as_bytes()).map_err(std::io::Error::other)
}

fn skip(out: &mut Copied, rel: &Path, why: &str) {
    if out.skipped.len() < MAX_SKIPPED {
        out.skipped
            .push(format!("{} ({why})", rel.to_string_lossy()));
    }
}

/// A regular file of a walk, `from` with metadata `md`: copied to `to` if there is one (with its mode and
/// modification time), hashed if copied or `hash`. Its content's sha256 (lowercase hex, or nothing when not hashed)
/// and the copy, open.
fn regular(
    from: &Path,
    to: Option<&Path>,
    md: &std::fs::Metadata,
    hash: bool,
    buf: &mut [u8],
) -> std::io::Result<(Vec<u8>, Option<std::fs::File>)> {
    match (to, hash) {
        (Some(to), _) => {
            let (hash, file) = copy_file(from, Some((to, md.mode() & 0o777)), buf)?;
            set_mtime(to, md)?;
            Ok((hash, file))
        }
        (None, true) => copy_file(from, None, buf),
        (None, false) => Ok((Vec::new(), None)),
    }
}

/// Copies one regular file (opened without following a link) to the new file `to` with its mode, if there is one;
/// its content's sha256, lowercase hex, and the copy, open.
fn copy_file(
    from: &Path,
    to: Option<(&Path, u32)>,
    buf: &mut [u8],
) -> std::io::Result<(Vec<u8>, Option<std::fs::File>)> {
    let mut src = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(from)?;
    let mut dst = match to {
        Some((to, mode)) => Some((
            std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(mode)
                .open(to)?,
            mode,
        )),
        None => None,
    };
    let mut h = Sha256::new();
    loop {
        let n = src.read(buf)?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
        if let Some((dst, _)) = &mut dst {
            dst.write_all(&buf[..n])?;
        }
    }
    let hash = hex(&h.finalize()).into_bytes();
    let Some((dst, mode)) = dst else {
        return Ok((hash, None));
    };
    // The creation mode went through the umask.
    dst.set_permissions(std::fs::Permissions::from_mode(mode))?;
    Ok((hash, Some(dst)))
}

/// What makes a copy durable: each file's writeback started as soon as it is written, the files fsynced a batch
/// ([`SYNC_BATCH`]) at a time, and the directories last, once their entries, modes and times are set.
#[derive(Default)]
struct Syncer {
    /// Written (or, at the end, directories opened) and not yet synced.
    open: Vec<std::fs::File>,
}

impl Syncer {
    /// A file of the copy, written: its writeback starts now (the disk busy with it while the copy goes on, or the
    /// next files are opened), and it is synced with its batch.
    fn written(&mut self, file: std::fs::File) -> std::io::Result<()> {
        // SAFETY: `file` is open for the whole call; offset 0 and length 0 are the whole file, the flag a valid one.
        let r =
            unsafe { libc::sync_file_range(file.as_raw_fd(), 0, 0, libc::SYNC_FILE_RANGE_WRITE) };
        if r != 0 {
            return Err(std::io::Error::last_os_error());
        }
        self.push(file)
    }

    fn push(&mut self, file: std::fs::File) -> std::io::Result<()> {
        self.open.push(file);
        if self.open.len() >= SYNC_BATCH {
            sync_all(&std::mem::take(&mut self.open))?;
        }
        Ok(())
    }

    /// Syncs the files left, then the directories `dirs`.
    fn finish<'a>(mut self, dirs: impl Iterator<Item = &'a Path>) -> std::io::Result<()> {
        sync_all(&std::mem::take(&mut self.open))?;
        for dir in dirs {
            let d = std::fs::OpenOptions::new()
                .read(true)
                .custom_flags(libc::O_DIRECTORY | libc::O_NOFOLLOW)
                .open(dir)?;
            self.push(d)?;
        }
        sync_all(&self.open)
    }
}

/// fsyncs each of `files`, on up to [`SYNC_THREADS`] threads (this one among them).
fn sync_all(files: &[std::fs::File]) -> std::io::Result<()> {
    let next = AtomicUsize::new(0);
    let work = || -> std::io::Result<()> {
        while let Some(f) = files.get(next.fetch_add(1, Ordering::Relaxed)) {
            f.sync_all()?;
        }
        Ok(())
    };
    std::thread::scope(|s| {
        // As many as can be started: with none, this thread syncs them all.
        let helpers: Vec<_> = (1..SYNC_THREADS.min(files.len()))
            .map_while(|_| {
                std::thread::Builder::new()
                    .name("tree-sync".into())
                    .spawn_scoped(s, work)
                    .ok()
            })
            .collect();
        let mine = work();
        helpers
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(std::io::Error::other("A sync thread panicked")))
            })
            .fold(mine, Result::and)
    })
}

fn set_mtime(path: &Path, md: &std::fs::Metadata) -> std::io::Result<()> {
    let t = nix::sys::time::TimeSpec::new(md.mtime(), md.mtime_nsec());
    nix::sys::stat::utimensat(
        None,
        path,
        &nix::sys::time::TimeSpec::UTIME_OMIT,
        &t,
        nix::sys::stat::UtimensatFlags::NoFollowSymlink,
    )
    .map_err(std::io::Error::from)
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(p: &Path, text: &str, owner: u32) {
        std::fs::write(p, text).unwrap();
        std::os::unix::fs::lchown(p, Some(owner), Some(owner)).unwrap();
    }

    /// A durable copy of more files than a sync batch holds, in nested directories with a link, is what a plain
    /// copy is (digest, sizes, contents, modes and times, entries' order and all); `sync_tree` syncs a plain copy.
    #[test]
    fn a_durable_copy_is_the_plain_copy_synced_in_batches() {
        let t = tempfile::tempdir().unwrap();
        let src = t.path().join("src");
        for i in 0..(2 * SYNC_BATCH + 7) {
            let dir = src.join(format!("d{}/e{}", i % 5, i % 3));
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::write(dir.join(format!("f{i}")), format!("file {i}")).unwrap();
        }
        std::fs::set_permissions(src.join("d0/e0/f0"), std::fs::Permissions::from_mode(0o751))
            .unwrap();
        std::os::unix::fs::symlink("d0/e0/f0", src.join("link")).unwrap();
        let old = nix::sys::time::TimeSpec::new(1_000_000_000, 0);
        nix::sys::stat::utimensat(
            None,
            &src.join("d1"),
            &old,
            &old,
            nix::sys::stat::UtimensatFlags::NoFollowSymlink,
        )
        .unwrap();

        let (plain, durable) = (t.path().join("plain"), t.path().join("durable"));
        let p = copy_tree(&src, &plain, u64::MAX).unwrap();
        let d = copy_tree_durable(&src, &durable, u64::MAX).unwrap();
        assert_eq!((&d.digest, d.bytes, d.files), (&p.digest, p.bytes, p.files));
        assert_eq!(
            walk_tree(&durable, None, u64::MAX, true).unwrap().digest,
            p.digest
        );
        let md = |p: &Path| std::fs::symlink_metadata(p).unwrap();
        assert_eq!(md(&durable.join("d0/e0/f0")).mode() & 0o777, 0o751);
        assert_eq!(md(&durable.join("d1")).mtime(), 1_000_000_000);
        assert_eq!(
            std::fs::read_link(durable.join("link")).unwrap(),
            Path::new("d0/e0/f0")
        );
        assert_eq!(
            std::fs::read_to_string(durable.join("d4/e1/f4")).unwrap(),
            "file 4"
        );

        sync_tree(&plain).unwrap();
        assert!(sync_tree(&t.path().join("missing")).is_err());
    }

    /// An upper layer as an overlay leaves it (a whiteout, an opaque directory, files of the container's root and of
    /// another owner, a link, a mount point's directory) copied to a snapshot's layer and from there to another
    /// container's upper layer: mounted over the same lower layer, the second overlay shows what the first did,
    /// owned by the second container's root; the layer's digest is the same as the copy's of it.
    #[test]
    fn a_layer_carries_whiteouts_opaque_directories_and_owners_into_another_overlay() {
        let test = "a_layer_carries_whiteouts_opaque_directories_and_owners_into_another_overlay";
        if !test_support::require_root(
            test,
            "whiteouts, trusted xattrs, owners and an overlay mount",
        ) {
            return;
        }
        let t = tempfile::tempdir().unwrap();
        let (lower, upper) = (t.path().join("lower"), t.path().join("upper"));
        for d in [
            &lower,
            &lower.join("d"),
            &upper,
            &upper.join("d"),
            &upper.join("tmp"),
        ] {
            std::fs::create_dir(d).unwrap();
        }
        write(&lower.join("gone"), "image", 0);
        write(&lower.join("d/old"), "image", 0);
        write(&lower.join("kept"), "image", 0);
        mknod_whiteout(&upper.join("gone")).unwrap();
        set_xattr(&upper.join("d"), OPAQUE, b"y").unwrap();
        write(&upper.join("d/new"), "mine", 1234);
        write(&upper.join("other"), "theirs", 4321);
        write(&upper.join("tmp/left-out"), "x", 1234);
        std::os::unix::fs::symlink("kept", upper.join("link")).unwrap();

        let layer = t.path().join("layer");
        let to_snapshot = LayerOwners { from: 1234, to: 0 };
        let c = copy_layer(&upper, &layer, (to_snapshot, &["tmp"]), u64::MAX).unwrap();
        assert_eq!(c.files, 5, "gone, d, d/new, link, other: {c:?}");
        assert!(!layer.join("tmp").exists(), "a left-out name was copied");
        let md = |p: &Path| std::fs::symlink_metadata(p).unwrap();
        assert_eq!(
            (
                md(&layer.join("d/new")).uid(),
                md(&layer.join("other")).uid()
            ),
            (0, NOBODY)
        );
        assert!(is_whiteout(&md(&layer.join("gone"))));
        assert_eq!(
            xattr(&layer.join("d"), OPAQUE).unwrap().as_deref(),
            Some(&b"y"[..])
        );
        let again = copy_layer(
            &layer,
            &t.path().join("again"),
            (LayerOwners { from: 0, to: 0 }, &[]),
            u64::MAX,
        );
        assert_eq!(
            again.unwrap().digest,
            c.digest,
            "the same layer gives the same digest"
        );
        let small = copy_layer(&layer, &t.path().join("small"), (to_snapshot, &[]), 4);
        assert_eq!(small.unwrap_err().kind(), std::io::ErrorKind::FileTooLarge);

        let (upper2, work, merged) = (
            t.path().join("upper2"),
            t.path().join("work"),
            t.path().join("merged"),
        );
        copy_layer(
            &layer,
            &upper2,
            (LayerOwners { from: 0, to: 5678 }, &[]),
            u64::MAX,
        )
        .unwrap();
        std::fs::create_dir(&work).unwrap();
        std::fs::create_dir(&merged).unwrap();
        let data = format!(
            "lowerdir={},upperdir={},workdir={}",
            lower.display(),
            upper2.display(),
            work.display()
        );
        nix::mount::mount(
            Some("test"),
            &merged,
            Some("overlay"),
            nix::mount::MsFlags::empty(),
            Some(data.as_str()),
        )
        .unwrap();
        let seen = (
            merged.join("gone").exists(),
            merged.join("d/old").exists(),
            std::fs::read_to_string(merged.join("d/new")).ok(),
            std::fs::metadata(merged.join("d/new"))
                .map(|m| m.uid())
                .ok(),
            std::fs::metadata(merged.join("other"))
                .map(|m| m.uid())
                .ok(),
            std::fs::read_to_string(merged.join("link")).ok(),
        );
        nix::mount::umount(&merged).unwrap();
        assert_eq!(
            seen,
            (
                false,
                false,
                Some("mine".into()),
                Some(5678),
                Some(NOBODY),
                Some("image".into())
            )
        );
    }
}

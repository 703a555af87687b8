//! Unpacking one layer into a directory in overlayfs' on-disk format.
//!
//! Written by hand on top of the `tar` crate's entry reader because `tar::Archive::unpack` has no notion of OCI
//! whiteouts, follows symlinked parent directories that stay inside the destination, creates device nodes, and keeps
//! setuid bits. Here every entry is applied relative to directory descriptors opened with `openat2(RESOLVE_BENEATH |
//! RESOLVE_NO_SYMLINKS)`, one component at a time, so nothing an archive writes can land outside the layer:
//!
//! - paths with `..` or a leading `/` are refused, as is any entry whose parent path goes through a symlink (even
//!   one pointing inside the layer: no legitimate layer writes through a link);
//! - character and block devices and FIFOs are refused; the only device nodes in a layer are the 0/0 whiteouts
//!   written here;
//! - a hard link must name a regular file that this layer already holds;
//! - symlinks are created as they are (`/usr/bin/python3` is a fine target: it resolves inside the container's
//!   root at run time), but are never followed while unpacking;
//! - setuid and setgid bits are dropped, owners are not applied (everything belongs to root on the host, which the
//!   container's user namespace does not map), and extended attributes (file capabilities included) are ignored;
//! - `.wh.NAME` becomes a 0/0 character device `NAME`, `.wh..wh..opq` marks its directory opaque
//!   (`trusted.overlay.opaque=y`);
//! - the runtime's mount points ([`super::MOUNT_POINTS`]) must be directories if the layer has them.
//!
//! The uncompressed stream is hashed on the way and must match the config's `diff_id` when one is given.

use std::ffi::{CString, OsStr, OsString};
use std::io::{self, Read};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use nix::fcntl::OFlag;
use nix::sys::stat::{Mode, SFlag};
use nix::sys::time::TimeSpec;
use tar::EntryType;

use super::layout::HashingReader;
use super::{Compression, ImageError, Result, Sha256, MOUNT_POINTS};

/// Longest entry path accepted (Linux's `PATH_MAX`).
const MAX_PATH_BYTES: usize = 4096;
/// Deepest entry accepted: removing a tree (replacing a directory, discarding a refused layer, `images rm`) holds
/// one descriptor per level, so depth must stay far below `RLIMIT_NOFILE` and the stack.
const MAX_DEPTH: usize = 128;

/// What one unpack did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct UnpackStats {
    /// Entries applied (whiteouts included).
    pub entries: u64,
    /// Bytes of regular file content written.
    pub bytes: u64,
    /// Whiteouts and opaque markers written.
    pub whiteouts: u64,
    /// Files and directories whose setuid or setgid bit was dropped.
    pub setid_dropped: u64,
}

/// Unpacks the layer read from `blob` into `dest`, an empty directory the caller created and removes again on error.
/// `digest` names the layer in errors; `diff_id`, when given, must equal the sha256 of the uncompressed tar.
pub fn unpack(
    blob: impl Read,
    compression: Compression,
    digest: &Sha256,
    diff_id: Option<&Sha256>,
    dest: &Path,
) -> Result<UnpackStats> {
    let archive_err = |reason: String| ImageError::Layer {
        digest: digest.to_string(),
        entry: "archive".into(),
        reason,
    };
    let decompressed: Box<dyn Read> = match compression {
        Compression::None => Box::new(blob),
        Compression::Gzip => Box::new(flate2::read::GzDecoder::new(blob)),
        Compression::Zstd => Box::new(
            zstd::stream::read::Decoder::new(blob)
                .map_err(|e| archive_err(format!("zstd: {e}")))?,
        ),
    };
    let mut hashing = HashingReader::new(decompressed);
    let root = open_dir(dest).map_err(|e| ImageError::io(dest, e))?;
    let mut unpacker = Unpacker {
        root,
        digest,
        cached: None,
        dirs: Vec::new(),
        stats: UnpackStats::default(),
    };
    {
        let mut archive = tar::Archive::new(&mut hashing);
        let entries = archive
            .entries()
            .map_err(|e| archive_err(format!("not a tar archive: {e}")))?;
        for entry in entries {
            let entry = entry.map_err(|e| archive_err(format!("damaged archive: {e}")))?;
            unpacker.apply(entry)?;
        }
    }
    // The end-of-archive blocks and any padding belong to the digest too.
    io::copy(&mut hashing, &mut io::sink())
        .map_err(|e| archive_err(format!("damaged archive: {e}")))?;
    let actual = hashing.digest();
    if let Some(expected) = diff_id {
        if &actual != expected {
            return Err(archive_err(format!(
                "uncompressed content has digest {actual}, the image config says {expected}"
            )));
        }
    }
    unpacker.finish_dirs();
    Ok(unpacker.stats)
}

/// Why the parent directories of an entry could not be opened; becomes the reason of an
/// [`ImageError::Layer`] (lower case, as the other reasons: it follows the entry's name). Only ever shown as that
/// text, so the errno is part of the message rather than a `#[source]`.
#[derive(Debug, thiserror::Error)]
enum WalkError {
    #[error("cannot duplicate the layer's root descriptor: {0}")]
    Dup(nix::Error),
    #[error("mkdir {path}: {errno}")]
    Mkdir { path: String, errno: nix::Error },
    #[error("{path}: {errno}")]
    Open { path: String, errno: nix::Error },
    #[error("the path goes through the symlink {0} (writing through links is refused)")]
    Symlink(String),
    #[error("{0} is not a directory")]
    NotDir(String),
}

/// Where an entry goes: its parent directory (opened), the parent's components, its name, and its path as the
/// archive wrote it (for errors).
struct At<'a> {
    parent: RawFd,
    parents: &'a [&'a OsStr],
    name: &'a OsStr,
    shown: &'a str,
}

struct Unpacker<'a> {
    root: OwnedFd,
    digest: &'a Sha256,
    /// The last parent directory opened, by its components.
    cached: Option<(Vec<OsString>, OwnedFd)>,
    /// Directories whose mtime is set at the end (creating children changes it).
    dirs: Vec<(Vec<OsString>, i64)>,
    stats: UnpackStats,
}

impl Unpacker<'_> {
    fn refuse(&self, entry: &str, reason: impl Into<String>) -> ImageError {
        ImageError::Layer {
            digest: self.digest.to_string(),
            entry: entry.to_owned(),
            reason: reason.into(),
        }
    }

    /// Applies one archive entry below the root; bookkeeping entries (pax headers, aufs' hard-link directories) are
    /// skipped.
    fn apply<R: Read>(&mut self, mut entry: tar::Entry<'_, R>) -> Result<()> {
        let raw_path = entry.path_bytes().into_owned();
        let shown = String::from_utf8_lossy(&raw_path).into_owned();
        let header = entry.header();
        let kind = header.entry_type();
        if matches!(
            kind,
            EntryType::XGlobalHeader | EntryType::XHeader | EntryType::GNULongName
        ) {
            return Ok(());
        }
        let comps = components(&raw_path).map_err(|r| self.refuse(&shown, r.to_string()))?;
        // aufs bookkeeping (`.wh..wh.plnk/…`, `.wh..wh.aufs`, `.wh..wh.orph/…`): not content, skipped as
        // containerd does.
        if comps.iter().any(|c| {
            [&b".wh..wh.plnk"[..], b".wh..wh.aufs", b".wh..wh.orph"].contains(&c.as_bytes())
        }) {
            return Ok(());
        }
        let Some((name, parents)) = comps.split_last() else {
            // The layer's root directory itself: nothing to create.
            return Ok(());
        };
        let mode = header
            .mode()
            .map_err(|e| self.refuse(&shown, e.to_string()))?;
        let mtime = header.mtime().unwrap_or(0).min(i64::MAX as u64) as i64;
        if parents.is_empty()
            && MOUNT_POINTS.iter().any(|m| m.as_bytes() == name.as_bytes())
            && kind != EntryType::Directory
        {
            return Err(self.refuse(
                &shown,
                "a runtime mount point must be a directory (the runtime mounts over it)",
            ));
        }
        let at = At {
            parent: self.parent(parents, true, &shown)?,
            parents,
            name,
            shown: &shown,
        };
        if let Some(hidden) = name.as_bytes().strip_prefix(b".wh.") {
            self.whiteout(&at, hidden)?;
            self.stats.whiteouts += 1;
            self.stats.entries += 1;
            return Ok(());
        }
        let perm = mode & 0o1777;
        if mode & 0o6000 != 0 {
            self.stats.setid_dropped += 1;
        }
        match kind {
            EntryType::Regular | EntryType::Continuous => {
                self.regular(&at, &mut entry, perm, mtime)?
            }
            EntryType::Directory => {
                self.directory(&at, perm)?;
                self.dirs
                    .push((comps.iter().map(|c| c.to_os_string()).collect(), mtime));
            }
            EntryType::Symlink => self.symlink(&at, &entry, mtime)?,
            EntryType::Link => self.hard_link(&at, &entry)?,
            EntryType::Char | EntryType::Block => {
                return Err(self.refuse(&shown, "device nodes are refused"))
            }
            EntryType::Fifo => return Err(self.refuse(&shown, "FIFOs are refused")),
            other => return Err(self.refuse(&shown, format!("unsupported entry type {other:?}"))),
        }
        self.stats.entries += 1;
        Ok(())
    }

    /// `.wh..wh..opq` marks the parent opaque; `.wh.NAME` replaces `NAME` with a 0/0 character device.
    fn whiteout(&mut self, at: &At<'_>, hidden: &[u8]) -> Result<()> {
        if hidden == b".wh..opq" {
            return set_opaque(at.parent)
                .map_err(|e| self.refuse(at.shown, format!("opaque marker: {e}")));
        }
        if hidden.is_empty() || hidden == b"." || hidden == b".." || hidden.starts_with(b".wh.") {
            return Err(self.refuse(at.shown, "malformed whiteout"));
        }
        let hidden = OsStr::from_bytes(hidden);
        self.clear(at.parent, hidden, false, at.shown)?;
        nix::sys::stat::mknodat(
            Some(at.parent),
            hidden,
            SFlag::S_IFCHR,
            Mode::empty(),
            nix::sys::stat::makedev(0, 0),
        )
        .map_err(|e| self.refuse(at.shown, format!("whiteout: {e}")))
    }

    /// A regular file: created exclusively (never through an existing name), filled, then mode and mtime set.
    fn regular(
        &mut self,
        at: &At<'_>,
        content: &mut impl Read,
        perm: u32,
        mtime: i64,
    ) -> Result<()> {
        self.clear(at.parent, at.name, false, at.shown)?;
        let fd = nix::fcntl::openat(
            Some(at.parent),
            at.name,
            OFlag::O_WRONLY | OFlag::O_CREAT | OFlag::O_EXCL | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
            Mode::from_bits_truncate(0o600),
        )
        .map_err(|e| self.refuse(at.shown, format!("create: {e}")))?;
        // SAFETY: openat returned a new descriptor that nothing else owns.
        let mut file = std::fs::File::from(unsafe { OwnedFd::from_raw_fd(fd) });
        let n = io::copy(content, &mut file)
            .map_err(|e| self.refuse(at.shown, format!("write: {e}")))?;
        self.stats.bytes += n;
        nix::sys::stat::fchmod(file.as_raw_fd(), Mode::from_bits_truncate(perm))
            .map_err(|e| self.refuse(at.shown, format!("chmod: {e}")))?;
        let t = TimeSpec::new(mtime, 0);
        nix::sys::stat::futimens(file.as_raw_fd(), &t, &t)
            .map_err(|e| self.refuse(at.shown, format!("set mtime: {e}")))
    }

    /// A directory: an existing one is kept (its mode replaced); its mtime is set by [`Self::finish_dirs`].
    fn directory(&self, at: &At<'_>, perm: u32) -> Result<()> {
        self.clear(at.parent, at.name, true, at.shown)?;
        match nix::sys::stat::mkdirat(Some(at.parent), at.name, Mode::from_bits_truncate(0o700)) {
            Ok(()) | Err(nix::Error::EEXIST) => {}
            Err(e) => return Err(self.refuse(at.shown, format!("mkdir: {e}"))),
        }
        nix::sys::stat::fchmodat(
            Some(at.parent),
            at.name,
            Mode::from_bits_truncate(perm),
            nix::sys::stat::FchmodatFlags::FollowSymlink,
        )
        .map_err(|e| self.refuse(at.shown, format!("chmod: {e}")))
    }

    /// A symlink, created as it is (never followed here).
    fn symlink<R: Read>(&self, at: &At<'_>, entry: &tar::Entry<'_, R>, mtime: i64) -> Result<()> {
        let target = entry
            .link_name_bytes()
            .ok_or_else(|| self.refuse(at.shown, "symlink without a target"))?
            .into_owned();
        if target.is_empty() || target.contains(&0) {
            return Err(self.refuse(at.shown, "symlink with an empty or invalid target"));
        }
        self.clear(at.parent, at.name, false, at.shown)?;
        nix::unistd::symlinkat(OsStr::from_bytes(&target), Some(at.parent), at.name)
            .map_err(|e| self.refuse(at.shown, format!("symlink: {e}")))?;
        let t = TimeSpec::new(mtime, 0);
        let _ = nix::sys::stat::utimensat(
            Some(at.parent),
            at.name,
            &t,
            &t,
            nix::sys::stat::UtimensatFlags::NoFollowSymlink,
        );
        Ok(())
    }

    /// A hard link, only to a regular file this layer already holds.
    fn hard_link<R: Read>(&mut self, at: &At<'_>, entry: &tar::Entry<'_, R>) -> Result<()> {
        let shown = at.shown;
        let target = entry
            .link_name_bytes()
            .ok_or_else(|| self.refuse(shown, "hard link without a target"))?
            .into_owned();
        let tcomps = components(&target)
            .map_err(|r| self.refuse(shown, format!("hard link target: {r}")))?;
        let Some((tname, tparents)) = tcomps.split_last() else {
            return Err(self.refuse(shown, "hard link to the layer's root"));
        };
        let tshown = String::from_utf8_lossy(&target).into_owned();
        let outside = || {
            self.refuse(
                shown,
                format!("hard link to {tshown}, which this layer does not hold (links outside the layer are refused)"),
            )
        };
        let tparent = match self.walk(tparents, false) {
            Ok(fd) => fd,
            Err(_) => return Err(outside()),
        };
        let st = nix::sys::stat::fstatat(
            Some(tparent.as_raw_fd()),
            *tname,
            nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW,
        )
        .map_err(|_| outside())?;
        if SFlag::from_bits_truncate(st.st_mode) & SFlag::S_IFMT != SFlag::S_IFREG {
            return Err(self.refuse(
                shown,
                format!("hard link to {tshown}, which is not a regular file"),
            ));
        }
        // The parent may have been the cached one; reopen it (walk() above replaced nothing in the cache).
        let parent = self.parent(at.parents, true, shown)?;
        self.clear(parent, at.name, false, shown)?;
        nix::unistd::linkat(
            Some(tparent.as_raw_fd()),
            *tname,
            Some(parent),
            at.name,
            nix::fcntl::AtFlags::empty(),
        )
        .map_err(|e| self.refuse(shown, format!("link: {e}")))
    }

    /// The directory holding an entry, opened beneath the root without following symlinks; missing directories are
    /// created (0755) when `create`.
    fn parent(&mut self, parents: &[&OsStr], create: bool, shown: &str) -> Result<RawFd> {
        let hit = matches!(&self.cached, Some((p, _)) if p.len() == parents.len() && p.iter().zip(parents).all(|(a, b)| a == b));
        if !hit {
            let fd = self
                .walk(parents, create)
                .map_err(|e| self.refuse(shown, e.to_string()))?;
            self.cached = Some((parents.iter().map(|c| c.to_os_string()).collect(), fd));
        }
        match &self.cached {
            Some((_, fd)) => Ok(fd.as_raw_fd()),
            None => Err(self.refuse(shown, "internal: no parent directory")),
        }
    }

    fn walk(&self, parents: &[&OsStr], create: bool) -> std::result::Result<OwnedFd, WalkError> {
        let mut cur = nix::unistd::dup(self.root.as_raw_fd()).map_err(WalkError::Dup)?;
        // SAFETY: dup returned a new descriptor that nothing else owns.
        let mut cur_fd = unsafe { OwnedFd::from_raw_fd(cur) };
        for (i, comp) in parents.iter().enumerate() {
            let so_far = || {
                parents[..=i]
                    .iter()
                    .map(|c| c.to_string_lossy())
                    .collect::<Vec<_>>()
                    .join("/")
            };
            let next = match open_beneath(cur, comp) {
                Ok(fd) => fd,
                Err(nix::Error::ENOENT) if create => {
                    nix::sys::stat::mkdirat(Some(cur), *comp, Mode::from_bits_truncate(0o755))
                        .map_err(|errno| WalkError::Mkdir {
                            path: so_far(),
                            errno,
                        })?;
                    open_beneath(cur, comp).map_err(|errno| WalkError::Open {
                        path: so_far(),
                        errno,
                    })?
                }
                // O_DIRECTORY | O_NOFOLLOW on a symlink fails with ENOTDIR: say which it was.
                Err(e)
                    if matches!(e, nix::Error::ELOOP | nix::Error::EXDEV)
                        || (e == nix::Error::ENOTDIR && is_symlink(cur, comp)) =>
                {
                    return Err(WalkError::Symlink(so_far()))
                }
                Err(nix::Error::ENOTDIR) => return Err(WalkError::NotDir(so_far())),
                Err(errno) => {
                    return Err(WalkError::Open {
                        path: so_far(),
                        errno,
                    })
                }
            };
            cur = next.as_raw_fd();
            cur_fd = next;
        }
        Ok(cur_fd)
    }

    /// Makes room for a new entry `name` in `parent`: an existing directory stays when the new entry is a directory
    /// too, anything else is removed (tar semantics: the later entry wins).
    fn clear(&self, parent: RawFd, name: &OsStr, keep_dir: bool, shown: &str) -> Result<()> {
        let st = match nix::sys::stat::fstatat(
            Some(parent),
            name,
            nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW,
        ) {
            Ok(st) => st,
            Err(nix::Error::ENOENT) => return Ok(()),
            Err(e) => return Err(self.refuse(shown, format!("stat: {e}"))),
        };
        let is_dir = SFlag::from_bits_truncate(st.st_mode) & SFlag::S_IFMT == SFlag::S_IFDIR;
        if is_dir && keep_dir {
            return Ok(());
        }
        if is_dir {
            // The cached directory is `parent` itself, never under `name`: it stays valid.
            remove_tree(parent, name)
                .map_err(|e| self.refuse(shown, format!("replace directory: {e}")))?;
        } else {
            nix::unistd::unlinkat(Some(parent), name, nix::unistd::UnlinkatFlags::NoRemoveDir)
                .map_err(|e| self.refuse(shown, format!("replace: {e}")))?;
        }
        Ok(())
    }

    /// Directory mtimes, last (creating entries changed them), in archive order so that the later of two entries
    /// for a directory wins. Directories replaced since are skipped.
    fn finish_dirs(&mut self) {
        self.cached = None;
        let dirs = std::mem::take(&mut self.dirs);
        for (comps, mtime) in &dirs {
            let comps: Vec<&OsStr> = comps.iter().map(|c| c.as_os_str()).collect();
            if let Ok(fd) = self.walk(&comps, false) {
                let t = TimeSpec::new(*mtime, 0);
                let _ = nix::sys::stat::futimens(fd.as_raw_fd(), &t, &t);
            }
        }
    }
}

/// Why an archive path is refused; becomes the reason of an [`ImageError::Layer`].
#[derive(Debug, thiserror::Error)]
enum PathError {
    #[error("path longer than {MAX_PATH_BYTES} bytes")]
    TooLong,
    #[error("absolute path (layer paths are relative to the root)")]
    Absolute,
    #[error("NUL byte in path")]
    Nul,
    #[error("path escapes the layer (..)")]
    DotDot,
    #[error("path deeper than {MAX_DEPTH} directories")]
    TooDeep,
}

/// The components of an archive path: `.` and empty ones dropped; `..` and absolute paths refused.
fn components(raw: &[u8]) -> std::result::Result<Vec<&OsStr>, PathError> {
    if raw.len() > MAX_PATH_BYTES {
        return Err(PathError::TooLong);
    }
    if raw.first() == Some(&b'/') {
        return Err(PathError::Absolute);
    }
    if raw.contains(&0) {
        return Err(PathError::Nul);
    }
    let mut out = Vec::new();
    for c in raw.split(|b| *b == b'/') {
        match c {
            b"" | b"." => {}
            b".." => return Err(PathError::DotDot),
            c => out.push(OsStr::from_bytes(c)),
        }
    }
    if out.len() > MAX_DEPTH {
        return Err(PathError::TooDeep);
    }
    Ok(out)
}

fn open_dir(path: &Path) -> io::Result<OwnedFd> {
    let fd = nix::fcntl::open(
        path,
        OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC | OFlag::O_NOFOLLOW,
        Mode::empty(),
    )?;
    // SAFETY: open returned a new descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Whether `name` in `dir` is a symlink (not following it).
fn is_symlink(dir: RawFd, name: &OsStr) -> bool {
    nix::sys::stat::fstatat(Some(dir), name, nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW)
        .is_ok_and(|st| SFlag::from_bits_truncate(st.st_mode) & SFlag::S_IFMT == SFlag::S_IFLNK)
}

/// Opens the directory `name`, one path component, in `dir` without following a symlink. For a single component
/// that is not `.` or `..`, `openat` with `O_NOFOLLOW` is as strict as `openat2`'s `RESOLVE_BENEATH |
/// RESOLVE_NO_SYMLINKS` (nothing to resolve but the name itself) and works on every kernel; anything longer is
/// refused (`EINVAL`): the unpacker walks one component at a time.
fn open_beneath(dir: RawFd, name: &OsStr) -> nix::Result<OwnedFd> {
    let b = name.as_bytes();
    if b.is_empty() || b.contains(&b'/') || b == b"." || b == b".." {
        return Err(nix::Error::EINVAL);
    }
    let fd = nix::fcntl::openat(
        Some(dir),
        name,
        OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC | OFlag::O_NOFOLLOW,
        Mode::empty(),
    )?;
    // SAFETY: openat returned a new descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Removes `name` (a directory) in `parent` with everything under it, never following a symlink.
fn remove_tree(parent: RawFd, name: &OsStr) -> nix::Result<()> {
    let dir = open_beneath(parent, name)?;
    let mut children = Vec::new();
    {
        let d = nix::dir::Dir::from_fd(nix::unistd::dup(dir.as_raw_fd())?)?;
        let mut d = d;
        for e in d.iter() {
            let e = e?;
            let n = e.file_name().to_bytes();
            if n != b"." && n != b".." {
                children.push((OsString::from(OsStr::from_bytes(n)), e.file_type()));
            }
        }
    }
    for (child, ty) in children {
        let is_dir = match ty {
            Some(t) => t == nix::dir::Type::Directory,
            None => {
                let st = nix::sys::stat::fstatat(
                    Some(dir.as_raw_fd()),
                    child.as_os_str(),
                    nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW,
                )?;
                SFlag::from_bits_truncate(st.st_mode) & SFlag::S_IFMT == SFlag::S_IFDIR
            }
        };
        if is_dir {
            remove_tree(dir.as_raw_fd(), &child)?;
        } else {
            nix::unistd::unlinkat(
                Some(dir.as_raw_fd()),
                child.as_os_str(),
                nix::unistd::UnlinkatFlags::NoRemoveDir,
            )?;
        }
    }
    nix::unistd::unlinkat(Some(parent), name, nix::unistd::UnlinkatFlags::RemoveDir)
}

fn set_opaque(dir: RawFd) -> io::Result<()> {
    let name = CString::new("trusted.overlay.opaque").map_err(io::Error::other)?;
    // SAFETY: `dir` is an open descriptor, `name` is NUL-terminated and the value buffer is valid for 1 byte.
    let r = unsafe { libc::fsetxattr(dir, name.as_ptr(), b"y".as_ptr().cast(), 1, 0) };
    if r == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

//! File calls resolved beneath the sandbox's own root, never the host's.
//!
//! The daemon is root on the host and works on files for a caller whose sandbox is hostile: its tenant owns every
//! file under the sandbox's root, plants symlinks (absolute, relative, `..`-laden, to `/proc/self/root`) and races
//! renames. So no path is ever joined onto a host path. [`Root`] holds a directory fd of the sandbox's root (in
//! production `/proc/<init pid>/root`, whose walk follows the container's own mounts) and every path is resolved
//! beneath it by `openat2(2)` with `RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS`: an absolute symlink or a `..` climbs
//! no higher than the sandbox's `/`, and `/proc/<pid>/fd`-style magic links are refused. Every operation then works
//! on the fds obtained that way: `*at` calls on a parent fd with a single final component, `O_NOFOLLOW` where the
//! call is about the entry itself (stat, remove, rename, listing, recursive removal), `fstat` on the opened fd.
//!
//! Reads and writes follow a symlink in the final component, as envd does, but only inside the root (the kernel
//! resolves it with `RESOLVE_IN_ROOT`); a write creates a new file only with `O_EXCL`, so the daemon never chowns
//! an entry it did not create. FIFOs and devices are refused (opened with `O_NONBLOCK`, so a FIFO cannot hang the
//! daemon). Listing and recursive removal never descend through symlinks and are bounded ([`MAX_ENTRIES`],
//! [`MAX_NESTING`]). New files and directories belong to the sandbox's user (`owner` in [`Root::new`]).
//!
//! Every call blocks: the HTTP layer runs them on `spawn_blocking`.

use std::ffi::{OsStr, OsString};
use std::fs::File;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use nix::dir::Dir;
use nix::errno::Errno;
use nix::fcntl::{self, FcntlArg, OFlag, OpenHow, ResolveFlag};
use nix::sys::stat::{self, FileStat, Mode, SFlag};
use nix::unistd::{self, Gid, Uid, UnlinkatFlags};

use crate::engine::HOME;

/// The most entries one [`Root::list`] returns; a larger tree is refused ([`FileError::Invalid`]).
pub const MAX_ENTRIES: usize = 100_000;

/// The deepest nesting [`Root::list`] and [`Root::remove`] walk below the path they were given: each level holds
/// one fd open, so a hostile tree thousands of levels deep is refused rather than exhausting the daemon's fds.
pub const MAX_NESTING: usize = 256;

/// How many names a recursive removal reads from a directory at a time.
const REMOVE_BATCH: usize = 4096;

/// How many batches a recursive removal reads from one directory before it gives up on a directory the tenant
/// keeps refilling.
const REMOVE_ROUNDS: u32 = 1024;

/// How many times `openat2` is retried when the kernel asks for it (`EAGAIN`: a rename raced a `..` resolution).
const OPEN_RETRIES: u32 = 16;

/// Mode of the directories the daemon creates.
const DIR_MODE: u32 = 0o755;

/// Mode of the files the daemon creates.
const FILE_MODE: u32 = 0o644;

/// What an entry is (never followed: a symlink is reported as a symlink).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EntryKind {
    /// A regular file.
    File,
    /// A directory.
    Directory,
    /// A symbolic link ([`Entry::symlink_target`] holds its target).
    Symlink,
    /// Anything else: a FIFO, a socket, a device.
    Other,
}

/// One entry as E2B's `EntryInfo` describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    /// Its name (the last component of [`Entry::path`]; `/` for the root).
    pub name: String,
    /// What it is.
    pub kind: EntryKind,
    /// Its absolute path inside the sandbox, as the caller named it (never a resolved target, never a host path).
    pub path: String,
    /// Its size in bytes.
    pub size: u64,
    /// Its permission bits only, e.g. `0o644`.
    pub mode: u32,
    /// `ls`-style permissions with the type character: `-rw-r--r--`, `drwxr-xr-x`, `lrwxrwxrwx`.
    pub permissions: String,
    /// Its owner as the sandbox sees it: `user` for the sandbox's user, `root`, else the uid.
    pub owner: String,
    /// Its group as the sandbox sees it: `user` for the sandbox's user's group, `root`, else the gid.
    pub group: String,
    /// When its content last changed.
    pub modified: SystemTime,
    /// Where it points, for a symlink.
    pub symlink_target: Option<String>,
}

/// Why a file call failed. Messages name the path inside the sandbox, never a host path.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FileError {
    /// The path (or one of its parents) does not exist.
    #[error("No such file or directory: {0}")]
    NotFound(String),
    /// The path already exists.
    #[error("File exists: {0}")]
    AlreadyExists(String),
    /// A component that must be a directory is not one.
    #[error("Not a directory: {0}")]
    NotADirectory(String),
    /// The path is a directory where a file was expected.
    #[error("Is a directory: {0}")]
    IsADirectory(String),
    /// The call is refused: a NUL byte, a FIFO or a device, a symlink loop, a move across mounts, a tree too large.
    #[error("{0}")]
    Invalid(String),
    /// The sandbox's disk or quota is full.
    #[error("No space left on device")]
    NoSpace,
    /// Anything else the kernel refused.
    #[error("{0}")]
    Io(String),
}

/// A sandbox's root: every path is resolved beneath it, and new entries belong to its user.
#[derive(Debug)]
pub struct Root {
    /// A directory fd (`O_PATH` is enough) of the sandbox's `/`.
    fd: OwnedFd,
    /// Host uid and gid of the sandbox's user: owner of what the daemon creates, reported as `user`.
    owner: (u32, u32),
}

impl Root {
    /// As the sandbox's user (stat)
    pub fn stat(&self, path: &str) -> Result<Entry, FileError> {
        as_owner(self.owner, || self.stat_as_owner(path))
    }

    /// As the sandbox's user (list)
    pub fn list(&self, path: &str, depth: u32) -> Result<Vec<Entry>, FileError> {
        as_owner(self.owner, || self.list_as_owner(path, depth))
    }

    /// As the sandbox's user (make_dir)
    pub fn make_dir(&self, path: &str) -> Result<Entry, FileError> {
        as_owner(self.owner, || self.make_dir_as_owner(path))
    }

    /// As the sandbox's user (rename)
    pub fn rename(&self, from: &str, to: &str) -> Result<Entry, FileError> {
        as_owner(self.owner, || self.rename_as_owner(from, to))
    }

    /// As the sandbox's user (remove)
    pub fn remove(&self, path: &str) -> Result<(), FileError> {
        as_owner(self.owner, || self.remove_as_owner(path))
    }

    /// As the sandbox's user (open_read)
    pub fn open_read(&self, path: &str) -> Result<File, FileError> {
        as_owner(self.owner, || self.open_read_as_owner(path))
    }

    /// As the sandbox's user (create_write)
    pub fn create_write(&self, path: &str) -> Result<File, FileError> {
        as_owner(self.owner, || self.create_write_as_owner(path))
    }

    /// A root over `root`, a directory fd of the sandbox's `/` (in production `/proc/<init pid>/root`); files and
    /// directories created through it are chowned to `owner` (host uid, gid).
    pub fn new(root: OwnedFd, owner: (u32, u32)) -> Self {
        Self { fd: root, owner }
    }

    /// The caller's path made absolute inside the sandbox: a relative path is taken under [`HOME`] (`""` is
    /// [`HOME`], `~` and `~/…` expand to it), `.` components and repeated `/` are dropped, and `..` is kept for the
    /// kernel to resolve inside the root (a lexical `..` would be wrong across symlinks). A NUL byte is refused.
    pub fn absolute(path: &str) -> Result<String, FileError> {
        if path.contains('\0') {
            return Err(FileError::Invalid("Path contains a NUL byte".to_owned()));
        }
        let full = if path.starts_with('/') {
            path.to_owned()
        } else if path == "~" {
            HOME.to_owned()
        } else if let Some(rest) = path.strip_prefix("~/") {
            format!("{HOME}/{rest}")
        } else {
            format!("{HOME}/{path}")
        };
        let mut out = String::with_capacity(full.len());
        for component in full.split('/') {
            if component.is_empty() || component == "." {
                continue;
            }
            out.push('/');
            out.push_str(component);
        }
        if out.is_empty() {
            out.push('/');
        }
        Ok(out)
    }

    /// The entry at `path` itself: a symlink in the final component is reported as a symlink with its target.
    fn stat_as_owner(&self, path: &str) -> Result<Entry, FileError> {
        let abs = Self::absolute(path)?;
        let fd = self
            .open(&abs, OFlag::O_PATH | OFlag::O_NOFOLLOW)
            .map_err(|e| map_errno(e, &abs))?;
        self.entry(fd.as_fd(), &abs, base_name(&abs))
    }

    /// The entries under the directory `path` (a symlink to a directory is followed, inside the root), `depth`
    /// levels deep (1: its children; 0 counts as 1), sorted by name depth-first. Symlinked directories are
    /// reported, never entered. More than [`MAX_ENTRIES`] entries, or a tree nested deeper than [`MAX_NESTING`],
    /// is refused.
    fn list_as_owner(&self, path: &str, depth: u32) -> Result<Vec<Entry>, FileError> {
        /// A directory being listed: its names are read up front, then opened one by one.
        struct Frame {
            dir: OwnedFd,
            names: std::vec::IntoIter<OsString>,
            path: String,
            level: u32,
        }

        let abs = Self::absolute(path)?;
        let depth = depth.max(1);
        let top = self
            .open(&abs, OFlag::O_PATH | OFlag::O_DIRECTORY)
            .map_err(|e| map_errno(e, &abs))?;
        let mut budget = MAX_ENTRIES;
        let names = read_names(top.as_fd(), Some(&mut budget), usize::MAX, &abs)?;
        let mut stack = vec![Frame {
            dir: top,
            names: names.into_iter(),
            path: abs,
            level: 1,
        }];
        let mut out = Vec::new();
        while let Some(frame) = stack.last_mut() {
            let Some(name) = frame.names.next() else {
                stack.pop();
                continue;
            };
            let display = name.to_string_lossy().into_owned();
            let child_path = join(&frame.path, &display);
            let fd = match open_beneath(frame.dir.as_fd(), &name, OFlag::O_PATH | OFlag::O_NOFOLLOW)
            {
                Ok(fd) => fd,
                // Removed while we list it: it is simply not there any more.
                Err(Errno::ENOENT) => continue,
                Err(e) => return Err(map_errno(e, &child_path)),
            };
            let entry = self.entry(fd.as_fd(), &child_path, &display)?;
            let descend = entry.kind == EntryKind::Directory && frame.level < depth;
            let level = frame.level + 1;
            out.push(entry);
            if !descend {
                continue;
            }
            if stack.len() >= MAX_NESTING {
                return Err(FileError::Invalid(format!(
                    "Directory tree is nested deeper than {MAX_NESTING} levels: {child_path}"
                )));
            }
            // `fd` is the very inode just stat'ed as a directory (opened with O_NOFOLLOW): its names are read
            // through a fresh open of its ".", so a rename racing us cannot swap a symlink in.
            let names = read_names(fd.as_fd(), Some(&mut budget), usize::MAX, &child_path)?;
            stack.push(Frame {
                dir: fd,
                names: names.into_iter(),
                path: child_path,
                level,
            });
        }
        Ok(out)
    }

    /// Creates the directory `path` (mode 0o755, owned by the sandbox's user) and its missing parents;
    /// [`FileError::AlreadyExists`] if `path` exists (whatever it is, a dangling symlink included).
    fn make_dir_as_owner(&self, path: &str) -> Result<Entry, FileError> {
        let abs = Self::absolute(path)?;
        let Some((parent, name)) = split(&abs) else {
            return Err(FileError::AlreadyExists(abs));
        };
        let parent_fd = self.ensure_dirs(parent)?;
        let fd = self
            .make_child_dir(parent_fd.as_fd(), OsStr::new(name))
            .map_err(|e| map_errno(e, &abs))?;
        self.entry(fd.as_fd(), &abs, name)
    }

    /// Moves `from` to `to`, replacing `to` if the kernel allows it (a file, or an empty directory over a
    /// directory), and creates `to`'s missing parents as envd does. Neither final component is followed: a symlink
    /// is moved as a link. Returns the entry at `to`.
    fn rename_as_owner(&self, from: &str, to: &str) -> Result<Entry, FileError> {
        let from_abs = Self::absolute(from)?;
        let to_abs = Self::absolute(to)?;
        let (from_parent, from_name) = removable(&from_abs)?;
        let (to_parent, to_name) = removable(&to_abs)?;
        let from_dir = self
            .open(from_parent, OFlag::O_PATH | OFlag::O_DIRECTORY)
            .map_err(|e| map_errno(e, &from_abs))?;
        let to_dir = self.ensure_dirs(to_parent)?;
        fcntl::renameat(
            Some(from_dir.as_raw_fd()),
            from_name,
            Some(to_dir.as_raw_fd()),
            to_name,
        )
        .map_err(|e| match e {
            Errno::ENOENT => FileError::NotFound(from_abs.clone()),
            Errno::EINVAL => {
                FileError::Invalid(format!("Cannot move {from_abs} into itself: {to_abs}"))
            }
            Errno::EXDEV => FileError::Invalid(format!(
                "Cannot move {from_abs} to {to_abs}: they are on different mounts"
            )),
            e => map_errno(e, &to_abs),
        })?;
        let fd = open_beneath(
            to_dir.as_fd(),
            OsStr::new(to_name),
            OFlag::O_PATH | OFlag::O_NOFOLLOW,
        )
        .map_err(|e| map_errno(e, &to_abs))?;
        self.entry(fd.as_fd(), &to_abs, to_name)
    }

    /// Removes `path`: a file or a symlink (the link, never its target), or a directory with everything under it,
    /// walked with fds and never through a symlink. The sandbox's `/` cannot be removed.
    fn remove_as_owner(&self, path: &str) -> Result<(), FileError> {
        let abs = Self::absolute(path)?;
        let (parent, name) = removable(&abs)?;
        let parent_fd = self
            .open(parent, OFlag::O_PATH | OFlag::O_DIRECTORY)
            .map_err(|e| map_errno(e, &abs))?;
        let name = OsStr::new(name);
        match unistd::unlinkat(
            Some(parent_fd.as_raw_fd()),
            name,
            UnlinkatFlags::NoRemoveDir,
        ) {
            Ok(()) => Ok(()),
            // Linux answers EISDIR when unlink(2) meets a directory.
            Err(Errno::EISDIR) => remove_tree(parent_fd.as_fd(), name, &abs),
            Err(e) => Err(map_errno(e, &abs)),
        }
    }

    /// Opens the regular file at `path` for reading. A symlink is followed, inside the root; a directory is
    /// [`FileError::IsADirectory`], a FIFO, socket or device [`FileError::Invalid`].
    fn open_read_as_owner(&self, path: &str) -> Result<File, FileError> {
        let abs = Self::absolute(path)?;
        let fd = self
            .open(&abs, OFlag::O_RDONLY | OFlag::O_NONBLOCK | OFlag::O_NOCTTY)
            .map_err(|e| map_errno(e, &abs))?;
        regular_file(fd, &abs)
    }

    /// Opens `path` for writing from its start, truncated, creating it (mode 0o644, owned by the sandbox's user)
    /// and its missing parents. A symlink in the final component is followed, inside the root, as envd does; a
    /// dangling one is refused, as are directories, FIFOs and devices.
    fn create_write_as_owner(&self, path: &str) -> Result<File, FileError> {
        let abs = Self::absolute(path)?;
        let Some((parent, _)) = split(&abs) else {
            return Err(FileError::IsADirectory(abs));
        };
        drop(self.ensure_dirs(parent)?);
        let flags = OFlag::O_WRONLY | OFlag::O_NONBLOCK | OFlag::O_NOCTTY;
        // A new file is created with O_EXCL (which never follows a final symlink), so it is certainly ours to
        // chown; an existing one is opened, following a symlink inside the root, and keeps its owner.
        for _ in 0..3 {
            match self.create(&abs, flags | OFlag::O_CREAT | OFlag::O_EXCL) {
                Ok(fd) => {
                    let ids = (
                        Some(Uid::from_raw(self.owner.0)),
                        Some(Gid::from_raw(self.owner.1)),
                    );
                    unistd::fchown(fd.as_raw_fd(), ids.0, ids.1).map_err(|e| map_errno(e, &abs))?;
                    stat::fchmod(fd.as_raw_fd(), Mode::from_bits_truncate(FILE_MODE))
                        .map_err(|e| map_errno(e, &abs))?;
                    return regular_file(fd, &abs);
                }
                Err(Errno::EEXIST) => {}
                Err(e) => return Err(map_errno(e, &abs)),
            }
            match self.open(&abs, flags | OFlag::O_TRUNC) {
                Ok(fd) => return regular_file(fd, &abs),
                // Removed since, or a dangling symlink: try again, then give up.
                Err(Errno::ENOENT) => {}
                // A FIFO nobody reads.
                Err(Errno::ENXIO) => {
                    return Err(FileError::Invalid(format!("Not a regular file: {abs}")))
                }
                Err(e) => return Err(map_errno(e, &abs)),
            }
        }
        Err(FileError::Invalid(format!(
            "Is a dangling symbolic link: {abs}"
        )))
    }

    /// Opens `path` beneath the root (`RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS`).
    fn open(&self, path: &str, flags: OFlag) -> Result<OwnedFd, Errno> {
        openat2(self.fd.as_fd(), OsStr::new(path), flags, 0)
    }

    /// Creates `path` beneath the root with mode 0o644 (`flags` holds `O_CREAT`).
    fn create(&self, path: &str, flags: OFlag) -> Result<OwnedFd, Errno> {
        openat2(self.fd.as_fd(), OsStr::new(path), flags, FILE_MODE)
    }

    /// A directory fd of `path`, creating it and its missing parents (each with mkdirat on its parent's fd).
    fn ensure_dirs(&self, path: &str) -> Result<OwnedFd, FileError> {
        let dir_flags = OFlag::O_PATH | OFlag::O_DIRECTORY;
        match self.open(path, dir_flags) {
            Ok(fd) => return Ok(fd),
            Err(Errno::ENOENT) => {}
            Err(e) => return Err(map_errno(e, path)),
        }
        let mut current = self.open("/", dir_flags).map_err(|e| map_errno(e, "/"))?;
        let mut prefix = String::with_capacity(path.len());
        for component in path.split('/').filter(|c| !c.is_empty()) {
            prefix.push('/');
            prefix.push_str(component);
            // Each prefix is resolved from the root again, so a symlink or `..` in it means what it means in the
            // sandbox; only a missing component is created, in the directory its prefix resolved to.
            current = match self.open(&prefix, dir_flags) {
                Ok(fd) => fd,
                Err(Errno::ENOENT) => {
                    match self.make_child_dir(current.as_fd(), OsStr::new(component)) {
                        Ok(fd) => fd,
                        // Created meanwhile by someone else: use theirs.
                        Err(Errno::EEXIST) => self
                            .open(&prefix, dir_flags)
                            .map_err(|e| map_errno(e, &prefix))?,
                        Err(e) => return Err(map_errno(e, &prefix)),
                    }
                }
                Err(e) => return Err(map_errno(e, &prefix)),
            };
        }
        Ok(current)
    }

    /// Creates the directory `name` in `parent` (mode 0o755, owned by the sandbox's user) and returns its fd.
    fn make_child_dir(&self, parent: BorrowedFd<'_>, name: &OsStr) -> Result<OwnedFd, Errno> {
        stat::mkdirat(
            Some(parent.as_raw_fd()),
            name,
            Mode::from_bits_truncate(DIR_MODE),
        )?;
        // O_NOFOLLOW: if the tenant swapped a symlink in since, we refuse rather than chown its target.
        let fd = open_beneath(
            parent,
            name,
            OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW,
        )?;
        unistd::fchown(
            fd.as_raw_fd(),
            Some(Uid::from_raw(self.owner.0)),
            Some(Gid::from_raw(self.owner.1)),
        )?;
        // The daemon's umask must not narrow the mode.
        stat::fchmod(fd.as_raw_fd(), Mode::from_bits_truncate(DIR_MODE))?;
        Ok(fd)
    }

    /// The entry for the open `fd` (an `O_PATH | O_NOFOLLOW` fd of the entry itself), reported at `path`.
    fn entry(&self, fd: BorrowedFd<'_>, path: &str, name: &str) -> Result<Entry, FileError> {
        let st = stat::fstat(fd.as_raw_fd()).map_err(|e| map_errno(e, path))?;
        let kind = kind_of(&st);
        let symlink_target = if kind == EntryKind::Symlink {
            // An empty path reads the link the O_PATH fd itself refers to.
            let target =
                fcntl::readlinkat(Some(fd.as_raw_fd()), "").map_err(|e| map_errno(e, path))?;
            Some(target.to_string_lossy().into_owned())
        } else {
            None
        };
        Ok(Entry {
            name: name.to_owned(),
            kind,
            path: path.to_owned(),
            size: u64::try_from(st.st_size).unwrap_or(0),
            mode: st.st_mode & 0o777,
            permissions: permissions(kind, &st),
            owner: id_name(st.st_uid, self.owner.0),
            group: id_name(st.st_gid, self.owner.1),
            modified: modified(&st),
            symlink_target,
        })
    }
}

/// How the sandbox names the host uid or gid `id`, `user` being its user's.
fn id_name(id: u32, user: u32) -> String {
    if id == user {
        "user".to_owned()
    } else if id == 0 {
        "root".to_owned()
    } else {
        id.to_string()
    }
}

/// `openat2(dir, path, flags | O_CLOEXEC)` resolved with `dir` as the root (`RESOLVE_IN_ROOT`) and no magic
/// links; `mode` only with `O_CREAT`. Retried when the kernel asks (`EAGAIN`) or a signal interrupts it.
fn openat2(dir: BorrowedFd<'_>, path: &OsStr, flags: OFlag, mode: u32) -> Result<OwnedFd, Errno> {
    let mut how = OpenHow::new()
        .flags(flags | OFlag::O_CLOEXEC)
        .resolve(ResolveFlag::RESOLVE_IN_ROOT | ResolveFlag::RESOLVE_NO_MAGICLINKS);
    if flags.contains(OFlag::O_CREAT) {
        how = how.mode(Mode::from_bits_truncate(mode));
    }
    let mut result = Err(Errno::EAGAIN);
    for _ in 0..OPEN_RETRIES {
        result = fcntl::openat2(dir.as_raw_fd(), path, how);
        match result {
            Err(Errno::EAGAIN | Errno::EINTR) => continue,
            _ => break,
        }
    }
    let raw = result?;
    // SAFETY: openat2 just returned `raw`, a new open fd that nothing else owns or will close.
    Ok(unsafe { OwnedFd::from_raw_fd(raw) })
}

/// Opens the single component `name` (never `..`: it comes from readdir or a split path) in `dir`.
fn open_beneath(dir: BorrowedFd<'_>, name: &OsStr, flags: OFlag) -> Result<OwnedFd, Errno> {
    openat2(dir, name, flags, 0)
}

/// Keeps `fd` only if it is a regular file, then makes it blocking again.
fn regular_file(fd: OwnedFd, path: &str) -> Result<File, FileError> {
    let st = stat::fstat(fd.as_raw_fd()).map_err(|e| map_errno(e, path))?;
    match kind_of(&st) {
        EntryKind::File => {}
        EntryKind::Directory => return Err(FileError::IsADirectory(path.to_owned())),
        EntryKind::Symlink | EntryKind::Other => {
            return Err(FileError::Invalid(format!("Not a regular file: {path}")))
        }
    }
    let flags = fcntl::fcntl(fd.as_raw_fd(), FcntlArg::F_GETFL).map_err(|e| map_errno(e, path))?;
    let flags = OFlag::from_bits_truncate(flags) - OFlag::O_NONBLOCK;
    fcntl::fcntl(fd.as_raw_fd(), FcntlArg::F_SETFL(flags)).map_err(|e| map_errno(e, path))?;
    Ok(File::from(fd))
}

/// The names in the directory `dir` (without `.` and `..`), at most `limit`, sorted, read through a fresh open of
/// its `.` so each call starts from the beginning. With a `budget`, each name spends one and running out is
/// [`FileError::Invalid`].
fn read_names(
    dir: BorrowedFd<'_>,
    mut budget: Option<&mut usize>,
    limit: usize,
    path: &str,
) -> Result<Vec<OsString>, FileError> {
    let fd = open_beneath(dir, OsStr::new("."), OFlag::O_RDONLY | OFlag::O_DIRECTORY)
        .map_err(|e| map_errno(e, path))?;
    let mut reader = Dir::from(fd).map_err(|e| map_errno(e, path))?;
    let mut names = Vec::new();
    for item in reader.iter() {
        let item = item.map_err(|e| map_errno(e, path))?;
        let name = item.file_name().to_bytes();
        if name == b"." || name == b".." {
            continue;
        }
        if let Some(budget) = budget.as_deref_mut() {
            *budget = budget.checked_sub(1).ok_or_else(|| {
                FileError::Invalid(format!(
                    "More than {MAX_ENTRIES} entries under {path}: list fewer levels"
                ))
            })?;
        }
        names.push(OsStr::from_bytes(name).to_os_string());
        if names.len() >= limit {
            break;
        }
    }
    names.sort();
    Ok(names)
}

/// Removes the directory `name` in `parent` and everything under it: each subdirectory is opened with
/// `O_NOFOLLOW | O_DIRECTORY` from its parent's fd and emptied with unlinkat, so no symlink is ever followed.
fn remove_tree(parent: BorrowedFd<'_>, name: &OsStr, path: &str) -> Result<(), FileError> {
    /// A directory being emptied.
    struct Frame {
        dir: OwnedFd,
        name: OsString,
        path: String,
        pending: Vec<OsString>,
        rounds: u32,
    }

    let dir_flags = OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW;
    let top = match open_beneath(parent, name, dir_flags) {
        Ok(fd) => fd,
        // Swapped for a symlink or a file since unlink said it was a directory: unlink that instead.
        Err(Errno::ELOOP | Errno::ENOTDIR) => {
            return unistd::unlinkat(Some(parent.as_raw_fd()), name, UnlinkatFlags::NoRemoveDir)
                .map_err(|e| map_errno(e, path))
        }
        Err(e) => return Err(map_errno(e, path)),
    };
    let mut stack = vec![Frame {
        dir: top,
        name: name.to_owned(),
        path: path.to_owned(),
        pending: vec![],
        rounds: 0,
    }];
    while let Some(frame) = stack.last_mut() {
        if frame.pending.is_empty() {
            if frame.rounds >= REMOVE_ROUNDS {
                return Err(FileError::Io(format!(
                    "Directory keeps changing while it is removed: {}",
                    frame.path
                )));
            }
            frame.rounds += 1;
            frame.pending = read_names(frame.dir.as_fd(), None, REMOVE_BATCH, &frame.path)?;
            frame.pending.reverse();
            if frame.pending.is_empty() {
                let done = stack.pop();
                let parent_fd = stack.last().map_or(parent, |f| f.dir.as_fd());
                if let Some(done) = done {
                    match unistd::unlinkat(
                        Some(parent_fd.as_raw_fd()),
                        done.name.as_os_str(),
                        UnlinkatFlags::RemoveDir,
                    ) {
                        Ok(()) | Err(Errno::ENOENT) => {}
                        Err(e) => return Err(map_errno(e, &done.path)),
                    }
                }
                continue;
            }
        }
        let Some(child) = frame.pending.pop() else {
            continue;
        };
        let child_path = join(&frame.path, &child.to_string_lossy());
        match unistd::unlinkat(
            Some(frame.dir.as_raw_fd()),
            child.as_os_str(),
            UnlinkatFlags::NoRemoveDir,
        ) {
            Ok(()) | Err(Errno::ENOENT) => continue,
            Err(Errno::EISDIR) => {}
            Err(e) => return Err(map_errno(e, &child_path)),
        }
        let sub = match open_beneath(frame.dir.as_fd(), &child, dir_flags) {
            Ok(fd) => fd,
            Err(Errno::ENOENT) => continue,
            // Swapped for a symlink or a file meanwhile: unlink it as it now is.
            Err(Errno::ELOOP | Errno::ENOTDIR) => {
                match unistd::unlinkat(
                    Some(frame.dir.as_raw_fd()),
                    child.as_os_str(),
                    UnlinkatFlags::NoRemoveDir,
                ) {
                    Ok(()) | Err(Errno::ENOENT) => continue,
                    Err(e) => return Err(map_errno(e, &child_path)),
                }
            }
            Err(e) => return Err(map_errno(e, &child_path)),
        };
        if stack.len() >= MAX_NESTING {
            return Err(FileError::Invalid(format!(
                "Directory tree is nested deeper than {MAX_NESTING} levels: {child_path}"
            )));
        }
        stack.push(Frame {
            dir: sub,
            name: child,
            path: child_path,
            pending: vec![],
            rounds: 0,
        });
    }
    Ok(())
}

/// `abs` split into its parent and final component; `None` for `/`.
fn split(abs: &str) -> Option<(&str, &str)> {
    let slash = abs.rfind('/')?;
    let name = &abs[slash + 1..];
    if name.is_empty() {
        return None;
    }
    Some((if slash == 0 { "/" } else { &abs[..slash] }, name))
}

/// `abs` split for a call that unlinks or renames its final component: not `/`, not a `..`.
fn removable(abs: &str) -> Result<(&str, &str), FileError> {
    match split(abs) {
        Some((_, "..")) | None => Err(FileError::Invalid(format!("Cannot remove or move {abs}"))),
        Some(parts) => Ok(parts),
    }
}

/// The last component of `abs` (`/` for the root).
fn base_name(abs: &str) -> &str {
    split(abs).map_or("/", |(_, name)| name)
}

/// `name` under the absolute directory `dir`.
fn join(dir: &str, name: &str) -> String {
    if dir == "/" {
        format!("/{name}")
    } else {
        format!("{dir}/{name}")
    }
}

/// What `st` describes.
fn kind_of(st: &FileStat) -> EntryKind {
    let format = SFlag::from_bits_truncate(st.st_mode & SFlag::S_IFMT.bits());
    if format == SFlag::S_IFREG {
        EntryKind::File
    } else if format == SFlag::S_IFDIR {
        EntryKind::Directory
    } else if format == SFlag::S_IFLNK {
        EntryKind::Symlink
    } else {
        EntryKind::Other
    }
}

/// `ls`-style permissions: the type character, then `rwx` for owner, group and others.
fn permissions(kind: EntryKind, st: &FileStat) -> String {
    let format = SFlag::from_bits_truncate(st.st_mode & SFlag::S_IFMT.bits());
    let type_char = match kind {
        EntryKind::File => '-',
        EntryKind::Directory => 'd',
        EntryKind::Symlink => 'l',
        EntryKind::Other if format == SFlag::S_IFIFO => 'p',
        EntryKind::Other if format == SFlag::S_IFSOCK => 's',
        EntryKind::Other if format == SFlag::S_IFCHR => 'c',
        EntryKind::Other if format == SFlag::S_IFBLK => 'b',
        EntryKind::Other => '?',
    };
    let mut out = String::with_capacity(10);
    out.push(type_char);
    for shift in [6, 3, 0] {
        let bits = (st.st_mode >> shift) & 0o7;
        out.push(if bits & 0o4 != 0 { 'r' } else { '-' });
        out.push(if bits & 0o2 != 0 { 'w' } else { '-' });
        out.push(if bits & 0o1 != 0 { 'x' } else { '-' });
    }
    out
}

/// When `st`'s content last changed.
fn modified(st: &FileStat) -> SystemTime {
    let nanos = Duration::from_nanos(u64::try_from(st.st_mtime_nsec).unwrap_or(0));
    let seconds = Duration::from_secs(st.st_mtime.unsigned_abs());
    let base = if st.st_mtime >= 0 {
        UNIX_EPOCH.checked_add(seconds)
    } else {
        UNIX_EPOCH.checked_sub(seconds)
    };
    base.and_then(|t| t.checked_add(nanos))
        .unwrap_or(UNIX_EPOCH)
}

/// The error for `errno` met on the in-sandbox `path`.
fn map_errno(errno: Errno, path: &str) -> FileError {
    match errno {
        Errno::ENOENT => FileError::NotFound(path.to_owned()),
        Errno::EEXIST => FileError::AlreadyExists(path.to_owned()),
        Errno::ENOTDIR => FileError::NotADirectory(path.to_owned()),
        Errno::EISDIR => FileError::IsADirectory(path.to_owned()),
        Errno::ENOSPC | Errno::EDQUOT => FileError::NoSpace,
        Errno::ELOOP => FileError::Invalid(format!(
            "Too many levels of symbolic links, or a symbolic link where none is allowed: {path}"
        )),
        Errno::EXDEV => FileError::Invalid(format!(
            "Crosses a mount point or leaves the sandbox: {path}"
        )),
        Errno::EINVAL => FileError::Invalid(format!("Invalid argument: {path}")),
        Errno::ENAMETOOLONG => FileError::Invalid(format!("File name too long: {path}")),
        e => FileError::Io(format!("{}: {path}", e.desc())),
    }
}

/// Runs `f` on this thread with the file-system uid and gid of the sandbox's user (`owner`, host ids), then puts
/// root's back: the kernel checks every access `f` makes as that user's, so the daemon can read or write nothing
/// in the sandbox's root its user could not (a host file bound read-only into the root, owned by the host's
/// root, stays unreadable), and what it creates belongs to that user. `setfsuid` is per thread, and the
/// capabilities that bypass file permissions leave the effective set while the ids are not 0.
fn as_owner<T>(
    owner: (u32, u32),
    f: impl FnOnce() -> Result<T, FileError>,
) -> Result<T, FileError> {
    struct Restore(nix::unistd::Uid, nix::unistd::Gid);
    impl Drop for Restore {
        fn drop(&mut self) {
            nix::unistd::setfsuid(self.0);
            nix::unistd::setfsgid(self.1);
        }
    }
    let gid = nix::unistd::setfsgid(nix::unistd::Gid::from_raw(owner.1));
    let uid = nix::unistd::setfsuid(nix::unistd::Uid::from_raw(owner.0));
    let _restore = Restore(uid, gid);
    f()
}

#[cfg(test)]
mod tests {
    use std::fs;
    use std::io::{Read, Write};
    use std::os::unix::fs::{lchown, symlink, MetadataExt, PermissionsExt};
    use std::path::Path;
    use std::time::Instant;

    use super::*;

    const OWNER: (u32, u32) = (12345, 12346);

    /// A tempdir laid out as a sandbox's root, with `/home/user` and a `Root` over it.
    fn sandbox() -> (tempfile::TempDir, Root) {
        assert!(
            unistd::geteuid().is_root(),
            "the files tests chown to other users: run them as root (CI does)"
        );
        let dir = tempfile::tempdir().expect("tempdir");
        fs::create_dir_all(dir.path().join("home/user")).expect("home");
        // The sandbox's user owns its root and home, as in a container: the calls run with its ids.
        for p in [
            dir.path().to_owned(),
            dir.path().join("home"),
            dir.path().join("home/user"),
        ] {
            std::os::unix::fs::chown(&p, Some(OWNER.0), Some(OWNER.1)).expect("chown");
        }
        let fd = nix::fcntl::open(
            dir.path(),
            OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
            Mode::empty(),
        )
        .expect("open root");
        // SAFETY: `open` just returned this fd, owned by nothing else.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        (dir, Root::new(fd, OWNER))
    }

    /// Gives everything under `dir` (itself included, symlinks as links, never followed) to the sandbox's user:
    /// fixtures the test made as root become the sandbox's own files, as in a real sandbox.
    fn give(dir: &Path) {
        lchown(dir, Some(OWNER.0), Some(OWNER.1)).expect("lchown");
        if fs::symlink_metadata(dir).expect("lstat").is_dir() {
            for entry in fs::read_dir(dir).expect("read_dir") {
                give(&entry.expect("dir entry").path());
            }
        }
    }

    /// The calling thread's file-system uid and gid (the fourth field of `Uid:` and `Gid:` in its status).
    fn fs_ids() -> (u32, u32) {
        let status = fs::read_to_string("/proc/thread-self/status").expect("status");
        let field = |key: &str| -> u32 {
            let line = status
                .lines()
                .find(|l| l.starts_with(key))
                .expect("status line");
            line.split_whitespace()
                .nth(4)
                .expect("fs id")
                .parse()
                .expect("number")
        };
        (field("Uid:"), field("Gid:"))
    }

    fn read_all(mut file: File) -> String {
        let mut s = String::new();
        file.read_to_string(&mut s).expect("read");
        s
    }

    #[test]
    fn files_absolute_normalises() {
        assert_eq!(Root::absolute("").unwrap(), "/home/user");
        assert_eq!(Root::absolute("a/./b//c/").unwrap(), "/home/user/a/b/c");
        assert_eq!(Root::absolute("~/x").unwrap(), "/home/user/x");
        assert_eq!(Root::absolute("/").unwrap(), "/");
        assert_eq!(Root::absolute("//./").unwrap(), "/");
        assert_eq!(Root::absolute("../../etc").unwrap(), "/home/user/../../etc");
        assert!(matches!(Root::absolute("a\0b"), Err(FileError::Invalid(_))));
    }

    #[test]
    fn files_nul_byte_is_invalid_everywhere() {
        let (_dir, root) = sandbox();
        assert!(matches!(root.stat("/a\0"), Err(FileError::Invalid(_))));
        assert!(matches!(
            root.create_write("a\0b"),
            Err(FileError::Invalid(_))
        ));
        assert!(matches!(root.remove("\0"), Err(FileError::Invalid(_))));
    }

    #[test]
    fn files_write_read_stat_and_list() {
        let (dir, root) = sandbox();
        let mut f = root.create_write("notes/a.txt").unwrap();
        f.write_all(b"hello").unwrap();
        drop(f);
        root.make_dir("notes/sub/deeper").unwrap();
        root.create_write("notes/sub/b.txt").unwrap();

        assert_eq!(
            read_all(root.open_read("/home/user/notes/a.txt").unwrap()),
            "hello"
        );
        let st = root.stat("notes/a.txt").unwrap();
        assert_eq!(st.kind, EntryKind::File);
        assert_eq!(st.name, "a.txt");
        assert_eq!(st.path, "/home/user/notes/a.txt");
        assert_eq!(st.size, 5);
        assert_eq!(st.mode, 0o644);
        assert_eq!(st.permissions, "-rw-r--r--");
        assert_eq!((st.owner.as_str(), st.group.as_str()), ("user", "user"));
        assert!(st.modified > UNIX_EPOCH);

        // Owner and mode on the host side, and on the created parents.
        let meta = fs::metadata(dir.path().join("home/user/notes/a.txt")).unwrap();
        assert_eq!(
            (meta.uid(), meta.gid(), meta.permissions().mode() & 0o777),
            (12345, 12346, 0o644)
        );
        let meta = fs::metadata(dir.path().join("home/user/notes/sub")).unwrap();
        assert_eq!(
            (meta.uid(), meta.gid(), meta.permissions().mode() & 0o777),
            (12345, 12346, 0o755)
        );

        let one = root.list("notes", 1).unwrap();
        let paths: Vec<_> = one.iter().map(|e| e.path.as_str()).collect();
        assert_eq!(paths, ["/home/user/notes/a.txt", "/home/user/notes/sub"]);
        assert_eq!(one[1].kind, EntryKind::Directory);
        assert_eq!(one[1].permissions, "drwxr-xr-x");

        let two = root.list("/home/user/notes", 2).unwrap();
        let paths: Vec<_> = two.iter().map(|e| e.path.as_str()).collect();
        assert_eq!(
            paths,
            [
                "/home/user/notes/a.txt",
                "/home/user/notes/sub",
                "/home/user/notes/sub/b.txt",
                "/home/user/notes/sub/deeper",
            ]
        );
        assert_eq!(root.list("notes", 0).unwrap().len(), 2);
        assert!(matches!(
            root.list("notes/a.txt", 1),
            Err(FileError::NotADirectory(_))
        ));
        assert!(
            matches!(root.list("missing", 1), Err(FileError::NotFound(p)) if p == "/home/user/missing")
        );
        assert!(matches!(
            root.open_read("notes"),
            Err(FileError::IsADirectory(_))
        ));
        assert!(matches!(
            root.create_write("notes"),
            Err(FileError::IsADirectory(_))
        ));

        let slash = root.stat("/").unwrap();
        assert_eq!(
            (slash.name.as_str(), slash.kind),
            ("/", EntryKind::Directory)
        );
        assert_eq!(slash.owner, "user");
        // A `/` owned by root, as in a real sandbox, is reported as root's.
        lchown(dir.path(), Some(0), Some(0)).unwrap();
        let slash = root.stat("/").unwrap();
        assert_eq!(
            (slash.owner.as_str(), slash.group.as_str()),
            ("root", "root")
        );
    }

    #[test]
    fn files_absolute_symlink_to_shadow_stays_in_root() {
        let (dir, root) = sandbox();
        symlink("/etc/shadow", dir.path().join("home/user/evil")).unwrap();

        let st = root.stat("/home/user/evil").unwrap();
        assert_eq!(st.kind, EntryKind::Symlink);
        assert_eq!(st.symlink_target.as_deref(), Some("/etc/shadow"));
        assert!(st.permissions.starts_with('l'));

        // No etc/shadow in the sandbox: not found, never the host's.
        assert!(
            matches!(root.open_read("evil"), Err(FileError::NotFound(p)) if p == "/home/user/evil")
        );
        assert!(matches!(
            root.open_read("/etc/shadow"),
            Err(FileError::NotFound(_))
        ));

        fs::create_dir(dir.path().join("etc")).unwrap();
        fs::write(dir.path().join("etc/shadow"), "decoy shadow").unwrap();
        give(dir.path());
        assert_eq!(read_all(root.open_read("evil").unwrap()), "decoy shadow");

        // Writing through it writes the decoy, not the host's file.
        root.create_write("evil")
            .unwrap()
            .write_all(b"overwritten")
            .unwrap();
        assert_eq!(
            fs::read_to_string(dir.path().join("etc/shadow")).unwrap(),
            "overwritten"
        );
    }

    #[test]
    fn files_dotdot_and_proc_links_stay_in_root() {
        let (dir, root) = sandbox();
        assert!(matches!(
            root.open_read("../../../../etc/passwd"),
            Err(FileError::NotFound(_))
        ));
        fs::create_dir(dir.path().join("etc")).unwrap();
        fs::write(dir.path().join("etc/passwd"), "decoy passwd").unwrap();
        give(dir.path());
        assert_eq!(
            read_all(root.open_read("../../../../etc/passwd").unwrap()),
            "decoy passwd"
        );
        assert_eq!(
            read_all(root.open_read("/../../etc/passwd").unwrap()),
            "decoy passwd"
        );

        // A relative symlink climbing out, and one through /proc/self/root: both resolve in the root.
        symlink(
            "../../../../../../etc/passwd",
            dir.path().join("home/user/up"),
        )
        .unwrap();
        assert_eq!(read_all(root.open_read("up").unwrap()), "decoy passwd");
        symlink(
            "/proc/self/root/etc/hostname",
            dir.path().join("home/user/proc"),
        )
        .unwrap();
        give(dir.path());
        assert!(matches!(
            root.open_read("proc"),
            Err(FileError::NotFound(_))
        ));
        assert!(root.stat("/home/user/../../../..").unwrap().kind == EntryKind::Directory);
    }

    #[test]
    fn files_magic_links_are_refused() {
        // A root with a real procfs under it (the host's `/`, only read here): a magic link never resolves.
        let fd = nix::fcntl::open(
            "/",
            OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
            Mode::empty(),
        )
        .expect("open /");
        // SAFETY: `open` just returned this fd, owned by nothing else.
        let root = Root::new(unsafe { OwnedFd::from_raw_fd(fd) }, OWNER);
        assert!(root.open_read("/proc/self/status").is_ok());
        let result = root.open_read("/proc/self/root/etc/hostname");
        assert!(matches!(result, Err(FileError::Invalid(_))), "{result:?}");
        let result = root.list("/proc/self/cwd", 1);
        assert!(matches!(result, Err(FileError::Invalid(_))), "{result:?}");
    }

    #[test]
    fn files_symlinked_parent_writes_inside_root() {
        let (dir, root) = sandbox();
        symlink("/", dir.path().join("home/user/d")).unwrap();
        give(dir.path());
        root.create_write("/home/user/d/written")
            .unwrap()
            .write_all(b"x")
            .unwrap();
        assert_eq!(fs::read_to_string(dir.path().join("written")).unwrap(), "x");
        assert_eq!(
            fs::metadata(dir.path().join("written")).unwrap().uid(),
            12345
        );
        // And the parents it creates go inside the root too.
        root.create_write("d/new/dir/f").unwrap();
        assert!(dir.path().join("new/dir/f").is_file());
        root.make_dir("d/made").unwrap();
        assert!(dir.path().join("made").is_dir());
    }

    #[test]
    fn files_list_never_descends_symlinked_dirs() {
        let (dir, root) = sandbox();
        fs::create_dir(dir.path().join("home/user/real")).unwrap();
        fs::write(dir.path().join("home/user/real/f"), "").unwrap();
        symlink("/", dir.path().join("home/user/d")).unwrap();
        symlink("real", dir.path().join("home/user/r")).unwrap();
        give(dir.path());
        let entries = root.list("/home/user", 5).unwrap();
        let paths: Vec<_> = entries.iter().map(|e| e.path.as_str()).collect();
        assert_eq!(
            paths,
            [
                "/home/user/d",
                "/home/user/r",
                "/home/user/real",
                "/home/user/real/f"
            ]
        );
        assert_eq!(entries[0].kind, EntryKind::Symlink);
        assert_eq!(entries[0].symlink_target.as_deref(), Some("/"));

        // Listing a symlink itself follows it (inside the root) but reports the caller's path.
        let via = root.list("d", 1).unwrap();
        assert!(via.iter().any(|e| e.path == "/home/user/d/home"));
    }

    #[test]
    fn files_list_is_bounded() {
        let (dir, root) = sandbox();
        let big = dir.path().join("home/user/big");
        fs::create_dir(&big).unwrap();
        for i in 0..=MAX_ENTRIES {
            fs::File::create(big.join(i.to_string())).unwrap();
        }
        give(dir.path());
        assert!(matches!(root.list("big", 1), Err(FileError::Invalid(_))));
        root.remove("big").unwrap();
        assert!(!big.exists());
    }

    #[test]
    fn files_deep_trees_are_bounded() {
        let (dir, root) = sandbox();
        let mut deep = dir.path().join("home/user/deep");
        for _ in 0..MAX_NESTING + 5 {
            deep.push("d");
        }
        fs::create_dir_all(&deep).unwrap();
        give(dir.path());
        assert_eq!(root.list("deep", 3).unwrap().len(), 3);
        assert!(matches!(
            root.list("deep", u32::MAX),
            Err(FileError::Invalid(_))
        ));
        assert!(matches!(root.remove("deep"), Err(FileError::Invalid(_))));
        // A tree within the bound goes entirely.
        let mut shallow = dir.path().join("home/user/shallow");
        for _ in 0..MAX_NESTING - 2 {
            shallow.push("d");
        }
        fs::create_dir_all(&shallow).unwrap();
        give(dir.path());
        assert_eq!(
            root.list("shallow", u32::MAX).unwrap().len(),
            MAX_NESTING - 2
        );
        root.remove("shallow").unwrap();
        assert!(!dir.path().join("home/user/shallow").exists());
    }

    #[test]
    fn files_remove_symlink_to_dir_removes_the_link_only() {
        let (dir, root) = sandbox();
        fs::create_dir_all(dir.path().join("keep/inner")).unwrap();
        fs::write(dir.path().join("keep/inner/f"), "stay").unwrap();
        symlink("/keep", dir.path().join("home/user/link")).unwrap();
        give(dir.path());
        root.remove("link").unwrap();
        assert!(fs::symlink_metadata(dir.path().join("home/user/link")).is_err());
        assert!(dir.path().join("keep/inner/f").exists());

        // A tree holding symlinks out: the links go, their targets stay.
        let tree = dir.path().join("home/user/tree");
        fs::create_dir_all(tree.join("a/b")).unwrap();
        fs::write(tree.join("a/b/file"), "").unwrap();
        symlink("/keep", tree.join("a/to_keep")).unwrap();
        symlink("../../../../keep/inner", tree.join("a/b/rel")).unwrap();
        give(dir.path());
        root.remove("tree").unwrap();
        assert!(!tree.exists());
        assert_eq!(
            fs::read_to_string(dir.path().join("keep/inner/f")).unwrap(),
            "stay"
        );

        assert!(matches!(root.remove("tree"), Err(FileError::NotFound(_))));
        assert!(matches!(root.remove("/"), Err(FileError::Invalid(_))));
        assert!(matches!(
            root.remove("/home/.."),
            Err(FileError::Invalid(_))
        ));
        assert!(dir.path().join("home").exists());
    }

    #[test]
    fn files_fifo_is_refused_without_hanging() {
        let (dir, root) = sandbox();
        unistd::mkfifo(
            &dir.path().join("home/user/fifo"),
            Mode::from_bits_truncate(0o666),
        )
        .unwrap();
        symlink("/home/user/fifo", dir.path().join("home/user/to_fifo")).unwrap();
        give(dir.path());
        let start = Instant::now();
        assert!(matches!(root.open_read("fifo"), Err(FileError::Invalid(_))));
        assert!(matches!(
            root.open_read("to_fifo"),
            Err(FileError::Invalid(_))
        ));
        assert!(matches!(
            root.create_write("fifo"),
            Err(FileError::Invalid(_))
        ));
        assert!(start.elapsed() < Duration::from_secs(2));
        let st = root.stat("fifo").unwrap();
        assert_eq!(st.kind, EntryKind::Other);
        assert!(st.permissions.starts_with('p'));
    }

    #[test]
    fn files_create_write_truncates_and_keeps_owner() {
        let (dir, root) = sandbox();
        let path = dir.path().join("home/user/existing");
        fs::write(&path, "long old content").unwrap();
        // Someone else's file the sandbox's user may write: truncating it must not take it over.
        unistd::chown(&path, Some(Uid::from_raw(0)), Some(Gid::from_raw(0))).unwrap();
        fs::set_permissions(&path, fs::Permissions::from_mode(0o666)).unwrap();
        root.create_write("existing")
            .unwrap()
            .write_all(b"new")
            .unwrap();
        assert_eq!(fs::read_to_string(&path).unwrap(), "new");
        assert_eq!(fs::metadata(&path).unwrap().uid(), 0);
        // A dangling symlink is refused rather than followed into a file we would create blind.
        symlink("/nowhere/x", dir.path().join("home/user/dangling")).unwrap();
        lchown(
            dir.path().join("home/user/dangling"),
            Some(OWNER.0),
            Some(OWNER.1),
        )
        .unwrap();
        assert!(matches!(
            root.create_write("dangling"),
            Err(FileError::Invalid(_))
        ));
        // A file where a parent should be.
        assert!(matches!(
            root.create_write("existing/child"),
            Err(FileError::NotADirectory(_))
        ));
    }

    #[test]
    fn files_rename_across_dirs() {
        let (dir, root) = sandbox();
        root.create_write("src/file")
            .unwrap()
            .write_all(b"moved")
            .unwrap();
        let entry = root.rename("src/file", "/tmp/dest/renamed").unwrap();
        assert_eq!(entry.path, "/tmp/dest/renamed");
        assert_eq!(entry.name, "renamed");
        assert_eq!(entry.kind, EntryKind::File);
        assert_eq!(
            fs::read_to_string(dir.path().join("tmp/dest/renamed")).unwrap(),
            "moved"
        );
        assert!(!dir.path().join("home/user/src/file").exists());

        // A symlink is moved as a link; overwrite replaces.
        symlink("/etc", dir.path().join("home/user/l")).unwrap();
        give(dir.path());
        root.create_write("target").unwrap();
        let entry = root.rename("l", "target").unwrap();
        assert_eq!(entry.kind, EntryKind::Symlink);
        assert_eq!(entry.symlink_target.as_deref(), Some("/etc"));

        assert!(
            matches!(root.rename("missing", "x"), Err(FileError::NotFound(p)) if p == "/home/user/missing")
        );
        assert!(matches!(root.rename("/", "x"), Err(FileError::Invalid(_))));
        root.make_dir("a/b").unwrap();
        assert!(matches!(
            root.rename("a", "a/b/c"),
            Err(FileError::Invalid(_))
        ));
    }

    #[test]
    fn files_make_dir_twice_already_exists() {
        let (dir, root) = sandbox();
        let entry = root.make_dir("x/y/z").unwrap();
        assert_eq!(entry.path, "/home/user/x/y/z");
        assert_eq!(entry.kind, EntryKind::Directory);
        assert_eq!(entry.mode, 0o755);
        assert_eq!(
            fs::metadata(dir.path().join("home/user/x")).unwrap().uid(),
            12345
        );
        assert!(
            matches!(root.make_dir("x/y/z"), Err(FileError::AlreadyExists(p)) if p == "/home/user/x/y/z")
        );
        assert!(matches!(
            root.make_dir("/"),
            Err(FileError::AlreadyExists(_))
        ));
        symlink("/nowhere", dir.path().join("home/user/dl")).unwrap();
        give(dir.path());
        assert!(matches!(
            root.make_dir("dl"),
            Err(FileError::AlreadyExists(_))
        ));
        root.create_write("file").unwrap();
        assert!(matches!(
            root.make_dir("file/sub"),
            Err(FileError::NotADirectory(_))
        ));
    }

    #[test]
    fn files_a_file_only_root_may_read_stays_unreadable() {
        // Like a host /etc/shadow bound into the root: owned by root, mode 0600, in a root-owned 0755 directory.
        let (dir, root) = sandbox();
        let etc = dir.path().join("etc");
        fs::create_dir(&etc).unwrap();
        fs::set_permissions(&etc, fs::Permissions::from_mode(0o755)).unwrap();
        let shadow = etc.join("shadow");
        fs::write(&shadow, "root:secret").unwrap();
        fs::set_permissions(&shadow, fs::Permissions::from_mode(0o600)).unwrap();
        // The sandbox's user's own symlink to it.
        let link = dir.path().join("home/user/shadow");
        symlink("/etc/shadow", &link).unwrap();
        lchown(&link, Some(OWNER.0), Some(OWNER.1)).unwrap();
        assert_eq!(fs::metadata(&shadow).unwrap().uid(), 0);
        assert_eq!(fs::metadata(&etc).unwrap().uid(), 0);

        for path in ["/etc/shadow", "shadow", "/home/user/../../etc/shadow"] {
            let result = root.open_read(path);
            assert!(
                matches!(&result, Err(FileError::Io(m)) if m.starts_with("Permission denied")),
                "{path}: {result:?}"
            );
            assert_eq!(fs_ids(), (0, 0), "fs ids restored after {path}");
        }
        // Not written through either: neither the file itself nor through the link, nor a new file beside it.
        for path in ["/etc/shadow", "shadow"] {
            let result = root.create_write(path);
            assert!(
                matches!(&result, Err(FileError::Io(m)) if m.starts_with("Permission denied")),
                "{path}: {result:?}"
            );
        }
        let result = root.create_write("/etc/new");
        assert!(
            matches!(&result, Err(FileError::Io(m)) if m.starts_with("Permission denied")),
            "{result:?}"
        );
        assert!(!etc.join("new").exists());
        assert!(root.make_dir("/etc/sub").is_err());
        assert!(!etc.join("sub").exists());
        assert!(root.remove("/etc/shadow").is_err());
        assert!(root.rename("/etc/shadow", "stolen").is_err());
        assert!(!dir.path().join("home/user/stolen").exists());
        // Its entry may still be seen (the directory is searchable), as the user would see it.
        assert_eq!(root.stat("/etc/shadow").unwrap().owner, "root");

        // Back to root's ids on this very thread: the root-only file, under a 0700 root the sandbox's user owns,
        // reads as root again, untouched.
        assert_eq!(fs_ids(), (0, 0));
        assert_eq!(fs::read_to_string(&shadow).unwrap(), "root:secret");
        assert_eq!(fs::metadata(&shadow).unwrap().uid(), 0);
        // And a call that succeeds restores them too.
        root.create_write("mine").unwrap();
        assert_eq!(fs_ids(), (0, 0));
        assert_eq!(fs::read_to_string(&shadow).unwrap(), "root:secret");
    }

    #[test]
    fn files_errors_name_sandbox_paths() {
        let (dir, root) = sandbox();
        let host = dir.path().to_string_lossy().into_owned();
        for err in [
            root.stat("nope").unwrap_err(),
            root.open_read("/a/b").unwrap_err(),
            root.list("x", 1).unwrap_err(),
        ] {
            assert!(!err.to_string().contains(&host), "{err}");
        }
        assert_eq!(
            root.stat("nope").unwrap_err().to_string(),
            "No such file or directory: /home/user/nope"
        );
    }
}

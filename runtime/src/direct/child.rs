//! The cloned init's half of the direct start, from the helper's go to the waiting init. Everything here runs in
//! the clone of the single-threaded helper, in the new namespaces; a failed step is sent to the helper as text
//! (`<step>: <error>`) and ends the process. Each step fails closed: nothing is skipped but a masked or read-only
//! path the kernel does not have.

use std::ffi::{CStr, CString};
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Component, Path};

use caps::CapSet;
use nix::fcntl::{OFlag, OpenHow, ResolveFlag};
use nix::mount::{MntFlags, MsFlags};
use nix::sched::CloneFlags;
use nix::sys::signal::Signal;
use nix::sys::stat::Mode;
use nix::sys::statvfs::FsFlags;
use nix::unistd::{Gid, Uid};

use super::handshake::{GO, OK, REPORT_MAX};
use super::plan::{Blueprint, MountKind, MountStep};
use crate::init::InitExecutor;
use crate::ipc;
use crate::sys;

/// The host device nodes bound into the container's `/dev` (the OCI default set).
const DEVICES: [&str; 6] = ["null", "zero", "full", "random", "urandom", "tty"];
/// The symlinks of the container's `/dev`.
const DEV_LINKS: [(&str, &str); 5] = [
    ("fd", "/proc/self/fd"),
    ("stdin", "/proc/self/fd/0"),
    ("stdout", "/proc/self/fd/1"),
    ("stderr", "/proc/self/fd/2"),
    ("ptmx", "pts/ptmx"),
];

/// A failed step: what, and the kernel's answer.
struct Failed(String);

fn step<T>(what: impl std::fmt::Display, r: nix::Result<T>) -> Result<T, Failed> {
    r.map_err(|e| Failed(format!("{what}: {e}")))
}

/// Runs the init: waits for go, sets the container up, reports, and becomes the waiting init. Never returns.
pub(super) fn run(sock: OwnedFd, blueprint: &Blueprint, init: &InitExecutor) -> ! {
    // Die with the helper from now on (unless told to outlive it); before go, a helper that died also closes the
    // socket.
    if !blueprint.outlives_helper {
        let _ = crate::sys::set_parent_death_signal(Signal::SIGKILL);
    }
    let mut buf = [0u8; 8];
    let go = matches!(ipc::recv(sock.as_fd(), &mut buf), Ok(Some((n, _))) if &buf[..n] == GO);
    if !go {
        // SAFETY: ends the clone without running the helper's destructors.
        unsafe { libc::_exit(1) }
    }
    match set_up(blueprint) {
        // A helper that cannot hear the report is gone or gave up on this container: nothing may wait on.
        Ok(()) if ipc::send(sock.as_fd(), OK, &[]).is_ok() => {
            drop(sock);
            init.run_or_report()
        }
        Ok(()) => {
            // SAFETY: as above.
            unsafe { libc::_exit(1) }
        }
        Err(Failed(mut what)) => {
            // The helper reads one datagram of at most REPORT_MAX bytes.
            if what.len() > REPORT_MAX {
                let mut end = REPORT_MAX;
                while !what.is_char_boundary(end) {
                    end -= 1;
                }
                what.truncate(end);
            }
            let _ = ipc::send(sock.as_fd(), what.as_bytes(), &[]);
            // SAFETY: as above.
            unsafe { libc::_exit(1) }
        }
    }
}

/// Every step between go and the waiting init, in order.
fn set_up(bp: &Blueprint) -> Result<(), Failed> {
    step("setsid", nix::unistd::setsid())?;
    // The helper moved us into our leaves: the new cgroup namespace is rooted there.
    step(
        "unshare(cgroup)",
        nix::sched::unshare(CloneFlags::CLONE_NEWCGROUP),
    )?;
    let root_id = (Uid::from_raw(0), Gid::from_raw(0));
    step(
        "setresgid",
        nix::unistd::setresgid(root_id.1, root_id.1, root_id.1),
    )?;
    step("setgroups", nix::unistd::setgroups(&[]))?;
    step(
        "setresuid",
        nix::unistd::setresuid(root_id.0, root_id.0, root_id.0),
    )?;
    // The kernel clears the parent death signal when the ids change: set it again, or a helper dying from here on
    // would leave this init behind (one that died before is caught by the report it can no longer receive).
    if !bp.outlives_helper {
        crate::sys::set_parent_death_signal(Signal::SIGKILL)
            .map_err(|e| Failed(crate::error::Chain(&e).to_string()))?;
    }
    mount_root(bp)?;
    own_stdio_is_null()?;
    step("sethostname", nix::unistd::sethostname(&bp.hostname))?;
    step("chdir(cwd)", nix::unistd::chdir(bp.cwd.as_c_str()))?;
    for &(resource, soft, hard) in &bp.rlimits {
        step(
            format_args!("setrlimit({resource:?})"),
            nix::sys::resource::setrlimit(resource, soft, hard),
        )?;
    }
    loopback_up()?;
    drop_privileges()
}

/// Mounts: private propagation, the root bound onto itself, the spec's mounts inside it, `/dev`, pivot, masked
/// and read-only paths, and the root's final flags.
fn mount_root(bp: &Blueprint) -> Result<(), Failed> {
    let none: Option<&str> = None;
    step(
        "make mounts private",
        nix::mount::mount(none, "/", none, MsFlags::MS_REC | MsFlags::MS_PRIVATE, none),
    )?;
    step(
        format_args!("bind {}", bp.root.display()),
        nix::mount::mount(
            Some(&bp.root),
            &bp.root,
            none,
            MsFlags::MS_BIND | MsFlags::MS_REC,
            none,
        ),
    )?;
    // Opened after the bind, so it is the new mount's root; every destination resolves inside it.
    let root = step(
        "open the root",
        nix::fcntl::open(
            &bp.root,
            OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
            Mode::empty(),
        )
        .map(|fd| {
            // SAFETY: open returned a new descriptor nothing else owns.
            unsafe { OwnedFd::from_raw_fd(fd) }
        }),
    )?;
    for m in &bp.mounts {
        mount_one(&root, m)?;
    }
    if bp.mounts.iter().any(|m| m.destination == Path::new("/dev")) {
        fill_dev(&root)?;
    }
    step("fchdir(root)", nix::unistd::fchdir(root.as_raw_fd()))?;
    drop(root);
    step("pivot_root", nix::unistd::pivot_root(".", "."))?;
    step(
        "detach the old root",
        nix::mount::umount2(".", MntFlags::MNT_DETACH),
    )?;
    step("chdir(/)", nix::unistd::chdir("/"))?;
    for p in &bp.masked {
        mask(p)?;
    }
    for p in &bp.readonly {
        make_readonly(p)?;
    }
    let mut flags = MsFlags::MS_NOSUID | MsFlags::MS_NODEV;
    if bp.root_readonly {
        flags |= MsFlags::MS_RDONLY;
    }
    remount(Path::new("/"), flags)
}

/// `/proc/self/fd/N`: mounting on it mounts on what descriptor N resolved to.
fn fd_path(fd: &OwnedFd) -> String {
    format!("/proc/self/fd/{}", fd.as_raw_fd())
}

/// Opens `path` (absolute in the container) inside `root` without leaving it, whatever symlinks an image holds
/// (`RESOLVE_IN_ROOT`); a missing last component (and missing parents) is created, as a directory or, for a file
/// bind, an empty file.
fn resolve(root: &OwnedFd, path: &Path, file: bool) -> Result<OwnedFd, Failed> {
    let how = OpenHow::new()
        .flags(OFlag::O_PATH | OFlag::O_CLOEXEC)
        .resolve(ResolveFlag::RESOLVE_IN_ROOT | ResolveFlag::RESOLVE_NO_MAGICLINKS);
    match nix::fcntl::openat2(root.as_raw_fd(), path, how) {
        // SAFETY: openat2 returned a new descriptor nothing else owns.
        Ok(fd) => return Ok(unsafe { OwnedFd::from_raw_fd(fd) }),
        Err(nix::Error::ENOENT) => {}
        Err(e) => return Err(Failed(format!("resolve {}: {e}", path.display()))),
    }
    let (Some(parent), Some(Component::Normal(name))) =
        (path.parent(), path.components().next_back())
    else {
        return Err(Failed(format!("resolve {}: no such path", path.display())));
    };
    let dir = resolve(root, parent, false)?;
    let created = if file {
        nix::fcntl::openat(
            Some(dir.as_raw_fd()),
            name,
            OFlag::O_CREAT | OFlag::O_EXCL | OFlag::O_WRONLY | OFlag::O_CLOEXEC,
            Mode::from_bits_truncate(0o644),
        )
        .map(|fd| {
            // SAFETY: openat returned a new descriptor nothing else owns; it is closed right away.
            drop(unsafe { OwnedFd::from_raw_fd(fd) })
        })
    } else {
        nix::sys::stat::mkdirat(Some(dir.as_raw_fd()), name, Mode::from_bits_truncate(0o755))
    };
    step(format_args!("create {}", path.display()), created)?;
    resolve(root, path, file)
}

/// [`resolve`] for a mount point that must be a plain directory: its last component may not be a symlink (an
/// image's `/proc -> elsewhere` would put proc, and so the masked and read-only paths, where the image chose) nor
/// anything but a directory.
fn resolve_plain_dir(root: &OwnedFd, path: &Path) -> Result<OwnedFd, Failed> {
    // Creates a missing directory (and parents); an existing entry is checked below.
    drop(resolve(root, path, false)?);
    let how = OpenHow::new()
        .flags(OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC)
        .resolve(ResolveFlag::RESOLVE_IN_ROOT | ResolveFlag::RESOLVE_NO_MAGICLINKS);
    match nix::fcntl::openat2(root.as_raw_fd(), path, how) {
        // SAFETY: openat2 returned a new descriptor nothing else owns.
        Ok(fd) => Ok(unsafe { OwnedFd::from_raw_fd(fd) }),
        // O_PATH | O_NOFOLLOW on a symlink opens the link itself, which O_DIRECTORY refuses.
        Err(nix::Error::ENOTDIR | nix::Error::ELOOP) => Err(Failed(format!(
            "mount {}: not a plain directory in the image (a symlink or a file)",
            path.display()
        ))),
        Err(e) => Err(Failed(format!("resolve {}: {e}", path.display()))),
    }
}

fn mount_one(root: &OwnedFd, m: &MountStep) -> Result<(), Failed> {
    let what = format_args!("mount {}", m.destination.display()).to_string();
    match &m.kind {
        MountKind::Fresh { fstype, source } => {
            let target = resolve_plain_dir(root, &m.destination)?;
            let data = (!m.data.is_empty()).then_some(m.data.as_str());
            step(
                what,
                nix::mount::mount(
                    Some(source.as_str()),
                    fd_path(&target).as_str(),
                    Some(*fstype),
                    m.flags,
                    data,
                ),
            )
        }
        MountKind::Bind { source } => {
            let target = resolve(root, &m.destination, !source.is_dir())?;
            let attrs = mount_attrs(m.flags).map_err(|f| Failed(format!("{what}: {f}")))?;
            let source = path_cstring(source)?;
            bind_tree(libc::AT_FDCWD, &source, attrs, &target, &what)
        }
    }
}

/// A path as the C string a syscall takes.
fn path_cstring(path: &Path) -> Result<CString, Failed> {
    CString::new(path.as_os_str().as_bytes())
        .map_err(|_| Failed(format!("a NUL in {}", path.display())))
}

/// `MOUNT_ATTR_*` to set (and the atime bits to clear first) for the mount flags of a bind; the flags a bind may
/// have are the ones [`super::plan`] reads from the spec.
fn mount_attrs(flags: MsFlags) -> Result<(u64, u64), String> {
    let mut set = 0;
    let mut clear = 0;
    let mut rest = flags;
    for (ms, attr) in [
        (MsFlags::MS_RDONLY, libc::MOUNT_ATTR_RDONLY),
        (MsFlags::MS_NOSUID, libc::MOUNT_ATTR_NOSUID),
        (MsFlags::MS_NODEV, libc::MOUNT_ATTR_NODEV),
        (MsFlags::MS_NOEXEC, libc::MOUNT_ATTR_NOEXEC),
    ] {
        if flags.contains(ms) {
            set |= attr;
            rest.remove(ms);
        }
    }
    // At most one atime mode; it replaces the source's.
    for (ms, attr) in [
        (MsFlags::MS_NOATIME, libc::MOUNT_ATTR_NOATIME),
        (MsFlags::MS_STRICTATIME, libc::MOUNT_ATTR_STRICTATIME),
        (MsFlags::MS_RELATIME, libc::MOUNT_ATTR_RELATIME),
    ] {
        if flags.contains(ms) {
            if clear != 0 {
                return Err("more than one atime mode".into());
            }
            set |= attr;
            clear = libc::MOUNT_ATTR__ATIME;
            rest.remove(ms);
        }
    }
    if rest.is_empty() {
        Ok((set, clear))
    } else {
        Err(format!("bind flags without a mount attribute: {rest:?}"))
    }
}

/// Binds the whole mount tree at `source` (relative to `dirfd`) onto `target` with `attrs` (set, clear) in force
/// before it is attached: `open_tree` makes a detached copy of the tree, `mount_setattr` changes every mount of
/// that copy, which nothing can reach, and only then does `move_mount` attach it. No bind is ever visible
/// writable or with set-uid bits, and every submount of the source gets the same flags (a remount after a
/// recursive bind changes the top mount only). Flags the kernel locked on a copied mount are only ever added to.
fn bind_tree(
    dirfd: RawFd,
    source: &CStr,
    attrs: (u64, u64),
    target: &OwnedFd,
    what: &str,
) -> Result<(), Failed> {
    let tree = step(
        format_args!("{what}: open_tree"),
        sys::open_tree(dirfd, source),
    )?;
    step(
        format_args!("{what}: mount_setattr"),
        sys::set_tree_attrs(&tree, attrs, None),
    )?;
    step(
        format_args!("{what}: move_mount"),
        sys::move_mount_onto(&tree, target),
    )
}

/// Remounts a bind mount with `flags` added to the flags it must keep: a mount copied from the helper's
/// namespace is locked, and the kernel refuses a remount that would clear its `nosuid`, `nodev`, `noexec`,
/// `ro` or atime flags.
fn remount(path: &Path, flags: MsFlags) -> Result<(), Failed> {
    let none: Option<&str> = None;
    let have = step(
        format_args!("statvfs {}", path.display()),
        nix::sys::statvfs::statvfs(path),
    )?
    .flags();
    let keep = [
        (FsFlags::ST_RDONLY, MsFlags::MS_RDONLY),
        (FsFlags::ST_NOSUID, MsFlags::MS_NOSUID),
        (FsFlags::ST_NODEV, MsFlags::MS_NODEV),
        (FsFlags::ST_NOEXEC, MsFlags::MS_NOEXEC),
        (FsFlags::ST_NOATIME, MsFlags::MS_NOATIME),
        (FsFlags::ST_NODIRATIME, MsFlags::MS_NODIRATIME),
        (FsFlags::ST_RELATIME, MsFlags::MS_RELATIME),
    ]
    .into_iter()
    .filter(|(st, _)| have.contains(*st))
    .fold(MsFlags::empty(), |acc, (_, ms)| acc | ms);
    step(
        format_args!("remount {}", path.display()),
        nix::mount::mount(
            none,
            path,
            none,
            MsFlags::MS_BIND | MsFlags::MS_REMOUNT | flags | keep,
            none,
        ),
    )
}

/// The OCI default device nodes (bound from the host: a user namespace cannot `mknod`) and symlinks.
fn fill_dev(root: &OwnedFd) -> Result<(), Failed> {
    let none: Option<&str> = None;
    for name in DEVICES {
        let target = resolve(root, &Path::new("/dev").join(name), true)?;
        let host = format!("/dev/{name}");
        step(
            format_args!("bind {host}"),
            nix::mount::mount(
                Some(host.as_str()),
                fd_path(&target).as_str(),
                none,
                MsFlags::MS_BIND,
                none,
            ),
        )?;
    }
    let dev = resolve(root, Path::new("/dev"), false)?;
    for (name, target) in DEV_LINKS {
        step(
            format_args!("symlink /dev/{name}"),
            nix::unistd::symlinkat(target, Some(dev.as_raw_fd()), name),
        )?;
    }
    Ok(())
}

/// Hides `path`: a directory under an empty read-only tmpfs, anything else under `/dev/null`. A path the kernel
/// does not have needs no hiding.
fn mask(path: &Path) -> Result<(), Failed> {
    let none: Option<&str> = None;
    let meta = match std::fs::symlink_metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(Failed(format!("stat {}: {e}", path.display()))),
    };
    let r = if meta.is_dir() {
        nix::mount::mount(Some("tmpfs"), path, Some("tmpfs"), MsFlags::MS_RDONLY, none)
    } else {
        nix::mount::mount(Some("/dev/null"), path, none, MsFlags::MS_BIND, none)
    };
    step(format_args!("mask {}", path.display()), r)
}

/// Makes `path` read-only (a bind of itself, read-only before it is attached, [`bind_tree`]); a path the kernel
/// does not have is skipped.
fn make_readonly(path: &Path) -> Result<(), Failed> {
    let target = match nix::fcntl::open(
        path,
        OFlag::O_PATH | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
        Mode::empty(),
    ) {
        // SAFETY: open returned a new descriptor nothing else owns.
        Ok(fd) => unsafe { OwnedFd::from_raw_fd(fd) },
        Err(nix::Error::ENOENT) => return Ok(()),
        Err(e) => return Err(Failed(format!("open {}: {e}", path.display()))),
    };
    let attrs = libc::MOUNT_ATTR_RDONLY
        | libc::MOUNT_ATTR_NOSUID
        | libc::MOUNT_ATTR_NODEV
        | libc::MOUNT_ATTR_NOEXEC;
    bind_tree(
        target.as_raw_fd(),
        c"",
        (attrs, 0),
        &target,
        &format!("bind {}", path.display()),
    )
}

/// Raises `lo` in the container's own network namespace (it starts down; the container owns the namespace).
fn loopback_up() -> Result<(), Failed> {
    crate::sys::set_loopback_up().map_err(|e| Failed(crate::error::Chain(&e).to_string()))
}

/// The init's own stdio becomes the container's `/dev/null`: the clone inherited the helper's (the daemon's log),
/// which a pooled init must not keep open. The program gets its own stdio with the launch.
fn own_stdio_is_null() -> Result<(), Failed> {
    let null = step(
        "open /dev/null",
        nix::fcntl::open("/dev/null", OFlag::O_RDWR | OFlag::O_CLOEXEC, Mode::empty()).map(|fd| {
            // SAFETY: open returned a new descriptor nothing else owns.
            unsafe { OwnedFd::from_raw_fd(fd) }
        }),
    )?;
    for target in 0..=2 {
        // SAFETY: dup2 onto 0..=2, which this process uses only as stdio; `null` is open.
        let rc = unsafe { libc::dup2(null.as_raw_fd(), target) };
        step("dup2 /dev/null", nix::errno::Errno::result(rc))?;
    }
    Ok(())
}

/// Empties every capability set, the bounding set first (that needs `CAP_SETPCAP`), and sets `no_new_privs`:
/// nothing the program executes can gain a privilege back.
fn drop_privileges() -> Result<(), Failed> {
    let failed = |what: &str, e: caps::errors::CapsError| Failed(format!("{what}: {e}"));
    // Every capability the kernel knows (`cap_last_cap`), not the crate's list: one newer than the crate must go
    // too, and one the kernel lacks must not fail the start.
    let last: libc::c_ulong = std::fs::read_to_string("/proc/sys/kernel/cap_last_cap")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .ok_or_else(|| Failed("read /proc/sys/kernel/cap_last_cap".into()))?;
    for cap in 0..=last {
        // SAFETY: prctl(PR_CAPBSET_DROP, n) takes no pointers.
        let rc = unsafe { libc::prctl(libc::PR_CAPBSET_DROP, cap, 0, 0, 0) };
        step(
            format_args!("drop capability {cap} from the bounding set"),
            nix::errno::Errno::result(rc),
        )?;
    }
    for set in [
        CapSet::Ambient,
        CapSet::Inheritable,
        CapSet::Effective,
        CapSet::Permitted,
    ] {
        caps::clear(None, set).map_err(|e| failed("clear a capability set", e))?;
    }
    // SAFETY: prctl(PR_SET_NO_NEW_PRIVS, 1) takes no pointers.
    let rc = unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) };
    step("no_new_privs", nix::errno::Errno::result(rc))?;
    Ok(())
}

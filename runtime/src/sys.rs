//! The few raw system calls nix does not wrap, each checked and with its `SAFETY` argument.

use std::ffi::CStr;
use std::ffi::OsStr;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};

use nix::fcntl::{OFlag, OpenHow, ResolveFlag};

use crate::error::{Error, Result};

/// Closes every descriptor in `first..=last` (`close_range(2)`).
pub fn close_range(first: RawFd, last: RawFd) -> Result<()> {
    if first > last {
        return Ok(());
    }
    // SAFETY: close_range takes plain integers and touches only this process's descriptor table; closing
    // descriptors that Rust objects still own is avoided by the callers, which only call it in the container's
    // init right before it stops using anything but the descriptors it keeps.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_close_range,
            first as libc::c_uint,
            last as libc::c_uint,
            0u32,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(Error::sys("close_range", nix::Error::last()))
    }
}

/// A pidfd for process `pid` (`pidfd_open(2)`, close-on-exec by the kernel's default).
///
/// The helper opens one for each container init while the init is its unreaped child, so the descriptor can only
/// ever refer to that process: the daemon then signals the init through it without going through the helper and
/// without any risk of hitting a reused pid.
pub fn pidfd_open(pid: nix::unistd::Pid) -> Result<OwnedFd> {
    // SAFETY: pidfd_open takes a pid and a flags word, allocates a new descriptor and touches no memory of ours.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid.as_raw(), 0u32) };
    if fd < 0 {
        return Err(Error::sys("pidfd_open", nix::Error::last()));
    }
    // SAFETY: the kernel just returned this descriptor to us; nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

/// Sends `signal` to the process a pidfd refers to (`pidfd_send_signal(2)`). A process that already ended is
/// `ESRCH`.
pub fn pidfd_send_signal(
    pidfd: std::os::fd::BorrowedFd<'_>,
    signal: nix::sys::signal::Signal,
) -> nix::Result<()> {
    use std::os::fd::AsRawFd;
    // SAFETY: pidfd_send_signal reads a descriptor, a signal number, a null siginfo pointer (allowed: the kernel
    // fills in a default) and a flags word; the descriptor is borrowed and stays open for the call.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_pidfd_send_signal,
            pidfd.as_raw_fd(),
            signal as libc::c_int,
            std::ptr::null::<libc::siginfo_t>(),
            0u32,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(nix::Error::last())
    }
}

/// `pidfd_getfd(pidfd, fd, 0)`: a copy (close-on-exec) of descriptor `fd` of the process behind `pidfd`. Needs
/// ptrace rights over it (root has them) but nothing from the process itself, which may be stopped or frozen.
pub fn pidfd_getfd(pidfd: BorrowedFd<'_>, fd: RawFd) -> nix::Result<OwnedFd> {
    // SAFETY: pidfd_getfd takes two descriptor numbers and a flags word and touches no memory of ours.
    let got = unsafe { libc::syscall(libc::SYS_pidfd_getfd, pidfd.as_raw_fd(), fd, 0u32) };
    let got = nix::errno::Errno::result(got)?;
    let got = RawFd::try_from(got).map_err(|_| nix::Error::EBADF)?;
    // SAFETY: pidfd_getfd returned a new descriptor nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(got) })
}

/// When process `pid` started (`/proc/<pid>/stat` field 22, clock ticks after boot): with its pid, what tells one
/// process from a later one that got the same pid. `None` when there is no such process.
pub fn start_time(pid: i32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) is in parentheses and may hold anything: count from the last `)`.
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(19)?.parse().ok()
}

/// Asks the kernel to send `signal` to this process when its parent dies (`PR_SET_PDEATHSIG`).
pub fn set_parent_death_signal(signal: nix::sys::signal::Signal) -> Result<()> {
    nix::sys::prctl::set_pdeathsig(signal).map_err(|e| Error::sys("prctl(PR_SET_PDEATHSIG)", e))
}

/// Marks this process non-dumpable, so processes of the same uid cannot ptrace it or read its `/proc` files.
pub fn set_not_dumpable() -> Result<()> {
    nix::sys::prctl::set_dumpable(false).map_err(|e| Error::sys("prctl(PR_SET_DUMPABLE)", e))
}

/// The Landlock ABI version the running kernel supports (0 when Landlock is not built in or not enabled).
pub fn landlock_abi() -> i32 {
    const LANDLOCK_CREATE_RULESET_VERSION: libc::c_uint = 1;
    // SAFETY: with a null attribute pointer, size 0 and the VERSION flag, landlock_create_ruleset only returns the
    // ABI version (or -1 with errno); it reads no memory and creates no descriptor.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_landlock_create_ruleset,
            std::ptr::null::<libc::c_void>(),
            0usize,
            LANDLOCK_CREATE_RULESET_VERSION,
        )
    };
    if rc < 0 {
        0
    } else {
        rc as i32
    }
}

/// Sets `lo` up in the network namespace of process `pid` (a created container's init, not yet started).
///
/// A new network namespace has only `lo`, and it is down; "loopback only" means programs can still talk to
/// themselves over 127.0.0.1. The container has no capabilities, so the helper (root in the initial user namespace)
/// enters the namespace, raises the flag and returns. The helper is single-threaded, so nothing else runs in the
/// borrowed namespace meanwhile.
pub fn bring_up_loopback(pid: nix::unistd::Pid) -> Result<()> {
    use nix::sched::{setns, CloneFlags};

    let ns_path = format!("/proc/{pid}/ns/net");
    let target = std::fs::File::open(&ns_path).map_err(|e| Error::io(&ns_path, e))?;
    let own =
        std::fs::File::open("/proc/self/ns/net").map_err(|e| Error::io("/proc/self/ns/net", e))?;
    setns(&target, CloneFlags::CLONE_NEWNET).map_err(|e| Error::sys("setns(container net)", e))?;
    let result = set_loopback_up();
    // Always return to our own namespace, even when raising the flag failed.
    setns(&own, CloneFlags::CLONE_NEWNET).map_err(|e| Error::sys("setns(back to own net)", e))?;
    result
}

/// Sets `lo` up in the calling process's network namespace (the direct start's init does this for its own).
pub fn set_loopback_up() -> Result<()> {
    use std::os::fd::AsRawFd;

    let sock = nix::sys::socket::socket(
        nix::sys::socket::AddressFamily::Inet,
        nix::sys::socket::SockType::Datagram,
        nix::sys::socket::SockFlag::SOCK_CLOEXEC,
        None,
    )
    .map_err(|e| Error::sys("socket for SIOCSIFFLAGS", e))?;
    // SAFETY: an all-zero ifreq is a valid value; the name is copied below within its bounds.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    for (dst, src) in req.ifr_name.iter_mut().zip(b"lo\0") {
        *dst = *src as libc::c_char;
    }
    // SAFETY: SIOCGIFFLAGS reads the interface name from `req` and writes the flags into its union; `req`
    // lives for the whole call and the descriptor is a socket.
    if unsafe { libc::ioctl(sock.as_raw_fd(), libc::SIOCGIFFLAGS, &mut req) } < 0 {
        return Err(Error::sys("ioctl(SIOCGIFFLAGS lo)", nix::Error::last()));
    }
    // SAFETY: the union was just filled by SIOCGIFFLAGS, so reading ifru_flags reads initialised data.
    unsafe { req.ifr_ifru.ifru_flags |= (libc::IFF_UP | libc::IFF_RUNNING) as libc::c_short };
    // SAFETY: as above; SIOCSIFFLAGS reads the name and flags from `req`.
    if unsafe { libc::ioctl(sock.as_raw_fd(), libc::SIOCSIFFLAGS, &req) } < 0 {
        return Err(Error::sys("ioctl(SIOCSIFFLAGS lo)", nix::Error::last()));
    }
    Ok(())
}

/// Opens a child of `dir` (`O_CLOEXEC | O_NOFOLLOW` added to `flags`) without following any symlink and without
/// leaving `dir`: `openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS)`.
pub fn open_beneath(dir: RawFd, name: &OsStr, flags: OFlag) -> nix::Result<OwnedFd> {
    let how = OpenHow::new()
        .flags(flags | OFlag::O_CLOEXEC | OFlag::O_NOFOLLOW)
        .resolve(ResolveFlag::RESOLVE_BENEATH | ResolveFlag::RESOLVE_NO_SYMLINKS);
    let fd = match nix::fcntl::openat2(dir, name, how) {
        Ok(fd) => fd,
        // Kernels before 5.6: O_NOFOLLOW is as strict for a single component; for a longer path it would follow
        // `..` and symlinks in the middle, so that is refused.
        Err(nix::Error::ENOSYS) if !single_component(name) => return Err(nix::Error::ENOSYS),
        Err(nix::Error::ENOSYS) => nix::fcntl::openat(
            Some(dir),
            name,
            flags | OFlag::O_CLOEXEC | OFlag::O_NOFOLLOW,
            nix::sys::stat::Mode::empty(),
        )?,
        Err(e) => return Err(e),
    };
    // SAFETY: openat2/openat returned a new descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Whether `name` is one plain path component (no `/`, not `.` or `..`).
fn single_component(name: &OsStr) -> bool {
    let b = name.as_encoded_bytes();
    !b.is_empty() && !b.contains(&b'/') && b != b"." && b != b".."
}

/// The kernel's `struct sigaction` for `rt_sigaction(2)` (x86_64 and arm64 share this layout).
#[repr(C)]
struct KernelSigaction {
    handler: libc::sighandler_t,
    flags: libc::c_ulong,
    restorer: libc::sighandler_t,
    mask: u64,
}

/// Puts every signal but `SIGKILL` and `SIGSTOP` back to its default disposition, real-time ones included: glibc
/// keeps two of them (32 and 33) for itself, and its `sigaction` refuses to touch them, so an `SIG_IGN` on them
/// (which survives `execve`) can only be undone with the raw system call. For a process about to `execve`.
pub fn default_all_signals() -> Result<()> {
    reset_all_signals().map_err(|(sig, e)| Error::sys(format!("rt_sigaction({sig}, SIG_DFL)"), e))
}

/// [`default_all_signals`] without allocating (for a child that shares its parent's memory): the failed signal.
pub fn reset_all_signals() -> std::result::Result<(), (i32, nix::Error)> {
    let default = KernelSigaction {
        handler: libc::SIG_DFL,
        flags: 0,
        restorer: 0,
        mask: 0,
    };
    for sig in 1..=64 {
        if sig == libc::SIGKILL || sig == libc::SIGSTOP {
            continue;
        }
        // SAFETY: `default` is a valid kernel sigaction that installs no handler; the old action is not asked
        // for; the size is the kernel's sigset size (8 bytes).
        let rc = unsafe {
            libc::syscall(
                libc::SYS_rt_sigaction,
                sig,
                &default as *const KernelSigaction,
                std::ptr::null_mut::<KernelSigaction>(),
                std::mem::size_of::<u64>(),
            )
        };
        if rc != 0 {
            return Err((sig, nix::Error::last()));
        }
    }
    Ok(())
}

/// A TCP listener bound to `address` inside the network namespace of the process `pidfd` refers to (a
/// container's init), returned to the caller's namespace.
///
/// A socket belongs to the namespace it was created in for its whole life, so the daemon can accept connections
/// that programs in the container make to `address` on their own loopback, with nothing of its own running
/// inside. The socket is created on a short-lived thread that enters the namespace through the pidfd (Linux 5.8+;
/// no pid can be reused meanwhile), so no other thread of the caller ever runs in the borrowed namespace.
pub fn tcp_listener_in_netns(
    pidfd: std::os::fd::BorrowedFd<'_>,
    address: std::net::SocketAddr,
) -> std::io::Result<std::net::TcpListener> {
    let pidfd = pidfd.try_clone_to_owned()?;
    std::thread::Builder::new()
        .name("netns-listen".into())
        .spawn(move || {
            nix::sched::setns(&pidfd, nix::sched::CloneFlags::CLONE_NEWNET)
                .map_err(std::io::Error::from)?;
            let listener = std::net::TcpListener::bind(address)?;
            listener.set_nonblocking(true)?;
            Ok(listener)
        })?
        .join()
        .unwrap_or_else(|_| Err(std::io::Error::other("the netns-listen thread panicked")))
}

/// `open_tree(dirfd, path, OPEN_TREE_CLONE | AT_RECURSIVE | OPEN_TREE_CLOEXEC)`: a detached copy of the mount
/// tree at `path` (at `dirfd` itself for an empty path).
pub fn open_tree(dirfd: RawFd, path: &CStr) -> nix::Result<OwnedFd> {
    let mut flags =
        libc::OPEN_TREE_CLONE | libc::OPEN_TREE_CLOEXEC | libc::AT_RECURSIVE as libc::c_uint;
    if path.is_empty() {
        // The mount `dirfd` itself.
        flags |= libc::AT_EMPTY_PATH as libc::c_uint;
    }
    // SAFETY: `path` is a NUL-terminated string that outlives the call; the kernel only reads it.
    let fd = unsafe { libc::syscall(libc::SYS_open_tree, dirfd, path.as_ptr(), flags) };
    let fd = nix::errno::Errno::result(fd)?;
    let fd = RawFd::try_from(fd).map_err(|_| nix::Error::EBADF)?;
    // SAFETY: open_tree returned a new descriptor nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// `mount_setattr(tree, "", AT_EMPTY_PATH | AT_RECURSIVE)`: sets (and clears) attributes on every mount of the
/// detached tree; with `userns`, also `MOUNT_ATTR_IDMAP` with that user namespace's mapping.
pub fn set_tree_attrs(
    tree: &OwnedFd,
    (set, clear): (u64, u64),
    userns: Option<BorrowedFd<'_>>,
) -> nix::Result<()> {
    let attr = libc::mount_attr {
        attr_set: set | userns.map_or(0, |_| libc::MOUNT_ATTR_IDMAP),
        attr_clr: clear,
        propagation: 0,
        userns_fd: userns.map_or(0, |fd| fd.as_raw_fd() as u64),
    };
    // SAFETY: `attr` is a valid `struct mount_attr` of the size passed and the empty path a NUL-terminated string;
    // both outlive the call and the kernel only reads them (the user namespace's descriptor is borrowed for it).
    let rc = unsafe {
        libc::syscall(
            libc::SYS_mount_setattr,
            tree.as_raw_fd(),
            c"".as_ptr(),
            libc::AT_EMPTY_PATH | libc::AT_RECURSIVE,
            &attr as *const libc::mount_attr,
            std::mem::size_of::<libc::mount_attr>(),
        )
    };
    nix::errno::Errno::result(rc).map(drop)
}

/// `move_mount(tree, "", target, "", MOVE_MOUNT_F_EMPTY_PATH | MOVE_MOUNT_T_EMPTY_PATH)`: attaches the detached
/// tree on what `target` names.
pub fn move_mount_onto(tree: &OwnedFd, target: &OwnedFd) -> nix::Result<()> {
    // SAFETY: both paths are the empty NUL-terminated string, which the kernel only reads; the descriptors are
    // open for the whole call.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_move_mount,
            tree.as_raw_fd(),
            c"".as_ptr(),
            target.as_raw_fd(),
            c"".as_ptr(),
            libc::MOVE_MOUNT_F_EMPTY_PATH | libc::MOVE_MOUNT_T_EMPTY_PATH,
        )
    };
    nix::errno::Errno::result(rc).map(drop)
}

/// Detaches the calling process (and the helper it forks later) from the host's mount propagation: mounts sandboxd
/// makes are invisible on the host and disappear with the daemon, while host mounts still propagate in.
pub fn unshare_mount_namespace() -> Result<()> {
    nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNS)
        .map_err(|e| Error::sys("unshare(CLONE_NEWNS)", e))?;
    nix::mount::mount(
        None::<&str>,
        "/",
        None::<&str>,
        nix::mount::MsFlags::MS_REC | nix::mount::MsFlags::MS_SLAVE,
        None::<&str>,
    )
    .map_err(|e| Error::sys("mount --make-rslave /", e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_start_time_tells_this_process_and_none_for_a_missing_one() {
        let me = std::process::id() as i32;
        let t = start_time(me).expect("our own start time");
        assert_eq!(start_time(me), Some(t), "stable");
        assert!(start_time(i32::MAX).is_none());
    }

    #[test]
    fn only_a_plain_name_may_use_the_openat_fallback() {
        for (name, single) in [
            ("a.txt", true),
            ("..a", true),
            ("l/etc/shadow", false),
            ("..", false),
            (".", false),
            ("", false),
            ("a/", false),
        ] {
            assert_eq!(single_component(OsStr::new(name)), single, "{name:?}");
        }
    }
}

//! The direct container start: sandboxd's own path from an OCI spec to a waiting init, in place of libcontainer's.
//!
//! Why: on a throughput run, libcontainer's two processes per container (intermediate and init) took half of the
//! CPU per execution. On cgroup v1 its manager reads `/proc/self/mountinfo` once per controller (fourteen reads a
//! container) and creates and removes the container's cgroup in every mounted hierarchy, not only the ones
//! sandboxd limits; it also writes a state directory nobody reads back. The direct start does what sandboxd's spec
//! asks for ([`plan::Blueprint`] refuses anything else) and nothing more:
//!
//! 1. The helper creates the cgroup leaves sandboxd uses ([`Cgroups::joined_leaves`]) with the spec's limits.
//! 2. `clone3` makes the init in new user, mount, pid, ipc, uts and net namespaces. It waits on a socket.
//! 3. The helper writes the one-id uid and gid maps, moves the init into the leaves and says go.
//! 4. The init ([`child`]) enters a new cgroup namespace (rooted at its leaf), drops supplementary groups,
//!    makes its mounts private, bind-mounts the root, mounts the spec's filesystems at paths resolved inside the
//!    root (fresh filesystems only on plain directories; binds as `open_tree` copies whose flags
//!    `mount_setattr` sets on the whole tree before `move_mount` attaches them), fills `/dev`, pivots, masks and write-protects the OCI default paths, remounts the root, sets the
//!    hostname, rlimits and loopback, drops every capability (bounding set included) and sets `no_new_privs`.
//! 5. It reports `ok` (or the step that failed) and becomes the waiting init ([`InitExecutor::run`]), which
//!    checks the capability sets empty again and installs landlock and seccomp itself, as on the libcontainer
//!    path.
//!
//! Not done, on purpose: no devices cgroup. The container runs in a user namespace, so it cannot `mknod`; every
//! filesystem it mounts is `nodev` by the kernel's rule for user namespaces, the root is remounted `nodev`, and
//! image layers cannot hold device nodes (the image store, `sandboxd-image-store`, refuses them). The only device
//! nodes it can open are the six bound into `/dev` and its own `devpts`.

mod child;
mod handshake;
pub mod plan;

use std::os::fd::{AsFd, OwnedFd};
use std::path::PathBuf;
use std::time::Duration;

use nix::poll::{PollFd, PollFlags, PollTimeout};
use nix::sys::signal::Signal;
use nix::unistd::{Gid, Pid, Uid};

use handshake::{GO, OK, REPORT_MAX};
pub use plan::Blueprint;

use crate::cgroups::Cgroups;
pub use crate::error::StartError;
use crate::error::{Error, Result};
use crate::init::InitExecutor;
use crate::ipc;

/// How long the helper waits for a cloned init to report its set-up.
const SETUP_TIMEOUT: Duration = Duration::from_secs(10);

/// `struct clone_args` of `clone3(2)` (the first version, 64 bytes, plus `set_tid` and `cgroup`).
#[repr(C)]
#[derive(Default)]
struct CloneArgs {
    flags: u64,
    pidfd: u64,
    child_tid: u64,
    parent_tid: u64,
    exit_signal: u64,
    stack: u64,
    stack_size: u64,
    tls: u64,
    set_tid: u64,
    set_tid_size: u64,
    cgroup: u64,
}

/// Creates container `id` from `blueprint` and returns its init's pid once the init waits for the launch message.
///
/// Must be called from a single-threaded process (the helper): the clone runs ordinary Rust. The cgroup leaves
/// are created first and left in place when this fails (the helper removes them with the container); a cloned
/// init is killed and reaped before an error is returned.
pub fn start(
    id: &str,
    blueprint: &Blueprint,
    cgroups: &Cgroups,
    init: &InitExecutor,
) -> Result<Pid> {
    cgroups.create_leaf(id, &blueprint.limits)?;
    let (ours, theirs) = ipc::pair()?;
    let flags = libc::CLONE_NEWUSER
        | libc::CLONE_NEWNS
        | libc::CLONE_NEWPID
        | libc::CLONE_NEWIPC
        | libc::CLONE_NEWUTS
        | libc::CLONE_NEWNET;
    let args = CloneArgs {
        flags: flags as u64,
        exit_signal: libc::SIGCHLD as u64,
        ..CloneArgs::default()
    };
    let rc = clone_owned_by(blueprint.host_uid, blueprint.host_gid, &args)?;
    match rc {
        0 => {
            drop(ours);
            // A panic must not unwind through the helper's (and the daemon's) frames in this process.
            let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                child::run(theirs, blueprint, init)
            }));
            // SAFETY: ends the clone without running the helper's destructors.
            unsafe { libc::_exit(1) }
        }
        pid => {
            drop(theirs);
            let pid = Pid::from_raw(pid as i32);
            release(id, pid, blueprint, cgroups, &ours).inspect_err(|_| {
                // Our own unreaped child: the pid is still this init's.
                let _ = nix::sys::signal::kill(pid, Signal::SIGKILL);
                let _ = nix::sys::wait::waitpid(pid, None);
            })?;
            Ok(pid)
        }
    }
}

/// `clone3` with `args` while this process's effective ids are the container's host ids, so the new user
/// namespace is owned by the container's host uid; the helper's own ids are back when this returns in it.
///
/// Why: the kernel charges a user namespace's per-user counters (inotify instances and watches, POSIX message
/// queue bytes, queued signals, processes, locked memory) to the namespace's *owner* at every level above it. A
/// namespace created by root would charge every container's use to host root, so one container holding all of
/// `fs.inotify.max_user_instances` would leave the host's own root (systemd, journald, udev) without any. Owned by
/// the container's own host uid (no two containers share one), a container exhausts only its own share.
///
/// The effective capability set, which the kernel empties when the effective uid leaves 0, is raised again from
/// the permitted set (kept: the real and saved uids stay 0), so creating the namespaces needs no unprivileged
/// user namespaces on the host. The kernel clears the parent death signal and the dumpable flag when the
/// effective ids change: both are put back. In the child, nothing is restored (its ids are its own, set by
/// [`child`] once the maps are written).
fn clone_owned_by(uid: u32, gid: u32, args: &CloneArgs) -> Result<libc::c_long> {
    let owner = |step: &'static str| {
        move |e: nix::Error| StartError::Owner {
            step,
            source: e.into(),
        }
    };
    let ids = nix::unistd::getresuid().map_err(owner("getresuid"))?;
    let gids = nix::unistd::getresgid().map_err(owner("getresgid"))?;
    let dumpable = nix::sys::prctl::get_dumpable().map_err(owner("prctl(PR_GET_DUMPABLE)"))?;
    let pdeath = nix::sys::prctl::get_pdeathsig().map_err(owner("prctl(PR_GET_PDEATHSIG)"))?;
    // -1: leave that id as it is.
    let keep = Uid::from_raw(u32::MAX);
    let keep_gid = Gid::from_raw(u32::MAX);
    nix::unistd::setresgid(keep_gid, Gid::from_raw(gid), keep_gid)
        .map_err(owner("setresgid(container gid)"))?;
    let cloned = nix::unistd::setresuid(keep, Uid::from_raw(uid), keep)
        .map_err(owner("setresuid(container uid)"))
        .and_then(|()| {
            let raised = ::caps::read(None, ::caps::CapSet::Permitted)
                .and_then(|permitted| ::caps::set(None, ::caps::CapSet::Effective, &permitted));
            raised.map_err(|e| StartError::Owner {
                step: "raise the effective capabilities",
                source: std::io::Error::other(e.to_string()),
            })
        })
        .map_err(Error::from)
        .and_then(|()| {
            // SAFETY: clone3 without CLONE_VM and without a stack behaves like fork: the child gets a copy of
            // this single-threaded process and returns 0 on its own copy of the stack. `args` is a valid
            // clone_args of the size passed.
            let rc = unsafe {
                libc::syscall(
                    libc::SYS_clone3,
                    args as *const CloneArgs,
                    std::mem::size_of::<CloneArgs>(),
                )
            };
            match rc {
                -1 => Err(StartError::Clone(nix::Error::last()).into()),
                rc => Ok(rc),
            }
        });
    if matches!(cloned, Ok(0)) {
        return cloned;
    }
    // The helper's own ids, capabilities (copied from permitted when the effective uid is 0 again), parent death
    // signal and dumpable flag. A helper that cannot get them back must not go on creating containers.
    let restored = nix::unistd::setresuid(keep, ids.effective, keep)
        .and_then(|()| nix::unistd::setresgid(keep_gid, gids.effective, keep_gid))
        .and_then(|()| nix::sys::prctl::set_dumpable(dumpable))
        .and_then(|()| match pdeath {
            Some(signal) => nix::sys::prctl::set_pdeathsig(signal),
            None => Ok(()),
        });
    if let Err(e) = restored {
        tracing::error!(error = %e, "the helper cannot restore its own ids after a clone; it exits");
        // SAFETY: ends the helper at once: it cannot go on with the wrong credentials. The daemon sees it gone.
        unsafe { libc::_exit(1) }
    }
    cloned
}

/// The helper's half of the set-up: id maps, cgroups, go; then waits for the init's report.
fn release(
    id: &str,
    pid: Pid,
    blueprint: &Blueprint,
    cgroups: &Cgroups,
    sock: &OwnedFd,
) -> Result<()> {
    for (file, host) in [
        ("uid_map", blueprint.host_uid),
        ("gid_map", blueprint.host_gid),
    ] {
        let path = PathBuf::from(format!("/proc/{pid}/{file}"));
        std::fs::write(&path, format!("0 {host} 1\n"))
            .map_err(|source| StartError::IdMap { path, source })?;
    }
    cgroups.attach(id, pid.as_raw())?;
    ipc::send(sock.as_fd(), GO, &[]).map_err(|_| StartError::Gone)?;
    let mut fds = [PollFd::new(sock.as_fd(), PollFlags::POLLIN)];
    let deadline = std::time::Instant::now() + SETUP_TIMEOUT;
    loop {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        let timeout = PollTimeout::try_from(left).unwrap_or(PollTimeout::MAX);
        match nix::poll::poll(&mut fds, timeout) {
            Ok(0) => return Err(StartError::Timeout(SETUP_TIMEOUT).into()),
            Ok(_) => break,
            Err(nix::Error::EINTR) => continue,
            Err(e) => return Err(Error::sys("poll the init's set-up report", e)),
        }
    }
    let mut buf = vec![0u8; REPORT_MAX + 1];
    match ipc::recv(sock.as_fd(), &mut buf) {
        Ok(Some((n, _))) if &buf[..n] == OK => Ok(()),
        Ok(Some((n, _))) => {
            Err(StartError::Setup(String::from_utf8_lossy(&buf[..n]).into_owned()).into())
        }
        Ok(None) | Err(_) => Err(StartError::Gone.into()),
    }
}

//! Idmapped binds: a directory bound elsewhere with its files' owner 0 shown as one host uid (and that uid's
//! files written as 0), so a filesystem outlives the containers that use it whatever host uid each of them runs as.
//! The mapping comes from a user namespace made for it (a forked child that unshares one; the daemon is
//! multi-threaded and may not unshare a user namespace itself), applied by `mount_setattr(MOUNT_ATTR_IDMAP)` to a
//! detached copy of the source before it is attached ([`crate::sys::open_tree`]).

use std::ffi::CString;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use nix::fcntl::OFlag;
use nix::sys::stat::Mode;
use nix::sys::wait::waitpid;
use nix::unistd::{fork, pipe2, ForkResult};

use crate::error::{Error, Result};
use crate::sys;

/// A user namespace whose uid and gid 0 are `host_id` (one id each): as a mount's idmapping, it shows files owned
/// by 0 as `host_id` and writes `host_id`'s files as 0.
pub fn user_namespace(host_id: u32) -> Result<OwnedFd> {
    let (ready_r, ready_w) = pipe2(OFlag::O_CLOEXEC).map_err(|e| Error::sys("pipe2", e))?;
    // SAFETY: the child makes only async-signal-safe system calls (unshare, write, pause) on a descriptor it
    // inherited, allocates nothing and never returns into Rust code.
    match unsafe { fork() }.map_err(|e| Error::sys("fork", e))? {
        ForkResult::Child => {
            // SAFETY: plain system calls on an inherited descriptor and a stack buffer; the loop never ends (the
            // parent kills the child once it has opened the namespace).
            unsafe {
                let ok = [u8::from(libc::unshare(libc::CLONE_NEWUSER) == 0)];
                libc::write(ready_w.as_raw_fd(), ok.as_ptr().cast(), 1);
                loop {
                    libc::pause();
                }
            }
        }
        ForkResult::Parent { child } => {
            drop(ready_w);
            let ns = map_child(child, host_id, &ready_r);
            // Our own unreaped child: its pid cannot have been reused.
            let _ = nix::sys::signal::kill(child, nix::sys::signal::Signal::SIGKILL);
            let _ = waitpid(child, None);
            ns
        }
    }
}

/// Waits for the child's new user namespace, writes its maps and opens it.
fn map_child(child: nix::unistd::Pid, host_id: u32, ready: &OwnedFd) -> Result<OwnedFd> {
    let mut ok = [0u8];
    match nix::unistd::read(ready.as_raw_fd(), &mut ok) {
        Ok(1) if ok[0] == 1 => {}
        Ok(_) => return Err(Error::sys("unshare(CLONE_NEWUSER)", nix::Error::EPERM)),
        Err(e) => return Err(Error::sys("read", e)),
    }
    let proc = format!("/proc/{child}");
    for map in ["uid_map", "gid_map"] {
        let path = format!("{proc}/{map}");
        std::fs::write(&path, format!("0 {host_id} 1\n")).map_err(|e| Error::io(&path, e))?;
    }
    let path = format!("{proc}/ns/user");
    nix::fcntl::open(
        path.as_str(),
        OFlag::O_RDONLY | OFlag::O_CLOEXEC,
        Mode::empty(),
    )
    // SAFETY: open returned a new descriptor nothing else owns.
    .map(|fd| unsafe { std::os::fd::FromRawFd::from_raw_fd(fd) })
    .map_err(|e| Error::sys(format!("open {path}"), e))
}

/// Binds `source` (with its submounts) onto the directory `target`, owner 0 shown as `host_id` (see
/// [`user_namespace`]), `nosuid`, `nodev`, and read-only when asked, all in force before the bind is attached.
pub fn bind(source: &Path, target: &Path, host_id: u32, read_only: bool) -> Result<()> {
    let what = |step: &str| format!("{step} {} at {}", source.display(), target.display());
    let c_source = CString::new(source.as_os_str().as_bytes())
        .map_err(|_| Error::sys(what("bind"), nix::Error::EINVAL))?;
    let tree =
        sys::open_tree(libc::AT_FDCWD, &c_source).map_err(|e| Error::sys(what("open_tree"), e))?;
    let userns = user_namespace(host_id)?;
    let mut set = libc::MOUNT_ATTR_NOSUID | libc::MOUNT_ATTR_NODEV;
    if read_only {
        set |= libc::MOUNT_ATTR_RDONLY;
    }
    sys::set_tree_attrs(&tree, (set, 0), Some(userns.as_fd()))
        .map_err(|e| Error::sys(what("idmap (mount_setattr)"), e))?;
    let target_fd = nix::fcntl::open(
        target,
        OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| Error::sys(what("open target"), e))?;
    // SAFETY: open returned a new descriptor nothing else owns.
    let target_fd: OwnedFd = unsafe { std::os::fd::FromRawFd::from_raw_fd(target_fd) };
    sys::move_mount_onto(&tree, &target_fd).map_err(|e| Error::sys(what("move_mount"), e))
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::MetadataExt;

    use super::*;

    #[test]
    fn a_bind_shows_owner_zero_as_the_host_id_and_read_only_refuses_writes() {
        const TEST: &str = "idmap::a_bind_shows_owner_zero_as_the_host_id";
        if !test_support::require_root(TEST, "mounts") {
            return;
        }
        // Everything in a thread of its own, in a mount namespace of its own (the daemon's): it goes with the thread.
        std::thread::spawn(|| {
            crate::sys::unshare_mount_namespace().unwrap();
            let dir = tempfile::tempdir().unwrap();
            let (src, rw, ro) = (
                dir.path().join("src"),
                dir.path().join("rw"),
                dir.path().join("ro"),
            );
            for d in [&src, &rw, &ro] {
                std::fs::create_dir(d).unwrap();
            }
            std::fs::write(src.join("f"), "x").unwrap();
            assert_eq!(std::fs::metadata(src.join("f")).unwrap().uid(), 0);
            bind(&src, &rw, 54_321, false).unwrap();
            bind(&src, &ro, 54_321, true).unwrap();
            let md = std::fs::metadata(rw.join("f")).unwrap();
            assert_eq!((md.uid(), md.gid()), (54_321, 54_321));
            // Root of the host is no id of the mapping: it may not create files through it.
            let e = std::fs::write(rw.join("g"), "y").unwrap_err();
            assert_eq!(e.raw_os_error(), Some(libc::EOVERFLOW), "{e}");
            let e = std::fs::OpenOptions::new()
                .append(true)
                .open(ro.join("f"))
                .unwrap_err();
            assert_eq!(e.raw_os_error(), Some(libc::EROFS), "{e}");
            // The source itself is unchanged.
            assert_eq!(std::fs::metadata(src.join("f")).unwrap().uid(), 0);
        })
        .join()
        .unwrap();
    }
}

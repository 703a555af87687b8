//! The init's forked program: its stdio, signal state and capabilities made ready, then `execve`; and the status
//! pipe's failure and timing lines the init and the program both write.

use std::ffi::CString;
use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd};

use nix::sys::signal::{SigSet, SigmaskHow};

use crate::error::{Chain, InitError};
use crate::sys;

/// Exit code of the child when `execve` of the program failed (as shells do).
pub const EXEC_FAILED: i32 = 127;
/// Exit code of the child when a restriction could not be applied (the status pipe says which).
pub const SETUP_FAILED: i32 = 125;

/// The forked child: the launch's descriptors become its stdio, signal mask and dispositions go back to the
/// defaults, the capability sets are checked empty once more, and the program is executed. Never returns.
/// `inherit`: one more descriptor the program keeps open across `execve` (the warm interpreter's channel).
pub(super) fn run_program(
    status: BorrowedFd<'_>,
    stdio: [OwnedFd; 3],
    inherit: Option<BorrowedFd<'_>>,
    program: &CString,
    args: &[CString],
    env: &[CString],
) -> ! {
    // The status pipe stays open (close-on-exec) so a failed restriction can be reported on it.
    // The launch's descriptors become 0, 1 and 2 (dup2 clears close-on-exec on the copies).
    for (target, fd) in stdio.iter().enumerate() {
        // SAFETY: dup2 onto 0..=2, which this process only uses as stdio; `fd` is open.
        if unsafe { libc::dup2(fd.as_raw_fd(), target as libc::c_int) } < 0 {
            setup_failed(
                status,
                format_args!("dup2 of stdio: {}", nix::Error::last()),
            );
        }
    }
    drop(stdio);
    if let Some(fd) = inherit {
        let kept = nix::fcntl::fcntl(
            fd.as_raw_fd(),
            nix::fcntl::FcntlArg::F_SETFD(nix::fcntl::FdFlag::empty()),
        );
        if let Err(e) = kept {
            setup_failed(status, format_args!("keep the warm channel open: {e}"));
        }
    }
    // The program starts with the default signal mask and dispositions, whatever the helper had: an ignored
    // signal survives execve (the Rust runtime ignores SIGPIPE, a background shell SIGINT).
    let _ = nix::sys::signal::sigprocmask(SigmaskHow::SIG_SETMASK, Some(&SigSet::empty()), None);
    if let Err(e) = sys::default_all_signals() {
        setup_failed(status, Chain(&e));
    }
    // Inherited from the init, checked again where it matters: no capabilities at exec.
    if let Err(e) = crate::caps::ensure_none() {
        setup_failed(status, Chain(&e));
    }
    if inherit.is_none() {
        mark(status, "exec");
    }
    let err = nix::unistd::execve(program, args, env).err();
    let msg = format!(
        "sandboxd: cannot execute {}: {}\n",
        program.to_string_lossy(),
        err.map(|e| e.desc()).unwrap_or("unknown error")
    );
    let _ = nix::unistd::write(std::io::stderr(), msg.as_bytes());
    // SAFETY: _exit ends the forked child without running the parent's atexit handlers or destructors.
    unsafe { libc::_exit(EXEC_FAILED) }
}

/// Reports a restriction that could not be applied (`setup <what>` on the status pipe) and ends the process with
/// [`SETUP_FAILED`], without unwinding into libcontainer or running destructors.
pub(super) fn setup_failed(status: BorrowedFd<'_>, what: impl std::fmt::Display) -> ! {
    let line = format!("setup {}\n", what.to_string().replace('\n', " "));
    let _ = nix::unistd::write(status, line.as_bytes());
    // SAFETY: _exit ends the process without running destructors; nothing here expects a return.
    unsafe { libc::_exit(SETUP_FAILED) }
}

/// `CLOCK_MONOTONIC` in nanoseconds (the same clock in every pid namespace: sandboxd creates no time namespace).
pub fn monotonic_ns() -> u64 {
    nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC)
        .map(|t| t.tv_sec() as u64 * 1_000_000_000 + t.tv_nsec() as u64)
        .unwrap_or(0)
}

/// Writes a timing mark (`t <name> <monotonic ns>`) on the status pipe: where the time between launch and exit
/// goes, for the daemon's debug log. [`Report::decode`] collects them.
pub(super) fn mark(status: BorrowedFd<'_>, name: &str) {
    let _ = nix::unistd::write(status, format!("t {name} {}\n", monotonic_ns()).as_bytes());
}

pub(super) fn to_cstrings(v: &[String]) -> Result<Vec<CString>, InitError> {
    v.iter()
        .map(|s| CString::new(s.as_bytes()).map_err(|_| InitError::InvalidArg))
        .collect()
}

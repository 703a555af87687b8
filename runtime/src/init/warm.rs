//! The warm interpreter: a program the init starts before the launch arrives, which waits for it on a channel.
//!
//! Interpreters spend most of a short program's time starting (python: site and its imports, about 10 ms), so a
//! pooled container's init starts the interpreter ahead of time, with a small stub as its program
//! (`sandboxd`'s `warm` module has them). It is forked and executed exactly as a launched program is
//! ([`super::program::run_program`]): after the init confined itself (no capabilities, landlock, seccomp, `no_new_privs`),
//! inside the container's namespaces, cgroup and rlimits, with default signal dispositions. It differs from a
//! launched program only in what it runs first and in its stdio, which until the launch are placeholders of the
//! kinds the daemon passes (stdin a memfd, stdout and stderr pipes), so the interpreter sets its streams up the same
//! way. The daemon writes the request's cgroup limits before it sends the launch, so they are in force before any of
//! the request's code runs.
//!
//! At the launch the init passes it on unchanged over the channel ([`crate::launch::send`]: stdio and the
//! arguments and environment in a memfd), closes its end, and reaps the interpreter as the program. A launch that
//! does not ask for it (or an interpreter that is gone) gets the interpreter killed and reaped, and a forked
//! program as usual. Nothing outlives the container: an init whose launch channel closes exits, and the kernel
//! kills the waiting interpreter with the pid namespace.

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};

use nix::sys::signal::Signal;
use nix::unistd::{ForkResult, Pid};

use super::program::{run_program, to_cstrings};
use crate::error::InitError;
use crate::launch::Launch;

/// A started interpreter that waits for its launch.
pub(super) struct Warm {
    pid: Pid,
    /// The init's end of the channel.
    channel: OwnedFd,
    /// The read end of the placeholder pipe (the interpreter's stdout and stderr until the launch): held so an
    /// early write does not fail.
    _placeholder: OwnedFd,
}

/// Forks and executes `interpreter` with placeholder stdio and the channel's other end, whose descriptor number
/// is appended to its arguments.
pub(super) fn start(status: BorrowedFd<'_>, interpreter: &Launch) -> Result<Warm, InitError> {
    let sys = |call: &'static str| move |source: nix::Error| InitError::Sys { call, source };
    let (channel, theirs) = crate::ipc::pair().map_err(|e| InitError::Become(Box::new(e)))?;
    let stdin = nix::sys::memfd::memfd_create(
        c"sandboxd-warm-stdin",
        nix::sys::memfd::MemFdCreateFlag::MFD_CLOEXEC,
    )
    .map_err(sys("memfd_create"))?;
    let (placeholder, out) =
        nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).map_err(sys("pipe2"))?;
    let err = out.try_clone().map_err(|e| InitError::Sys {
        call: "dup",
        source: nix::Error::from_raw(e.raw_os_error().unwrap_or(libc::EBADF)),
    })?;
    let mut args = interpreter.args.clone();
    args.push(theirs.as_raw_fd().to_string());
    let args = to_cstrings(&args)?;
    let env = to_cstrings(&interpreter.env)?;
    let program = args.first().cloned().ok_or(InitError::InvalidArg)?;
    // SAFETY: the init is single-threaded (cloned from the single-threaded helper), so the child may run
    // arbitrary code until it execs.
    match unsafe { nix::unistd::fork() }.map_err(sys("fork"))? {
        ForkResult::Child => {
            drop((channel, placeholder));
            run_program(
                status,
                [stdin, out, err],
                Some(theirs.as_fd()),
                &program,
                &args,
                &env,
            )
        }
        ForkResult::Parent { child } => Ok(Warm {
            pid: child,
            channel,
            _placeholder: placeholder,
        }),
    }
}

impl Warm {
    /// Passes the launch and its stdio to the interpreter, which becomes the program; returns its pid. When it
    /// is gone (the send fails), it is reaped and the stdio comes back for a forked program.
    pub(super) fn hand_over(
        self,
        launch: &Launch,
        stdio: [OwnedFd; 3],
    ) -> Result<Pid, [OwnedFd; 3]> {
        let [a, b, c] = &stdio;
        match crate::launch::send(
            self.channel.as_fd(),
            launch,
            [a.as_fd(), b.as_fd(), c.as_fd()],
        ) {
            Ok(()) => Ok(self.pid),
            Err(_) => {
                self.discard();
                Err(stdio)
            }
        }
    }

    /// Kills and reaps the interpreter (the launch asked for a new program).
    pub(super) fn discard(self) {
        // Our own unreaped child: the pid is still the interpreter's.
        let _ = nix::sys::signal::kill(self.pid, Signal::SIGKILL);
        while let Err(nix::Error::EINTR) = nix::sys::wait::waitpid(self.pid, None) {}
    }
}

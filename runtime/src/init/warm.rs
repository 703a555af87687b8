//! The warm interpreter: a program the init starts before the launch arrives, which waits for it on a channel.
//!
//! Interpreters spend most of a short program's time starting (python: site and its imports, about 10 ms), so a
//! pooled container's init starts the interpreter ahead of time, with a small stub as its program
//! (`sandboxd`'s `warm` module has them). It is started and executed exactly as a launched program is
//! ([`super::program::start_program`]): after the init confined itself (no capabilities, landlock, seccomp, `no_new_privs`),
//! inside the container's namespaces, cgroup and rlimits, with default signal dispositions. It differs from a
//! launched program only in what it runs first and in its stdio, which until the launch are placeholders of the
//! kinds the daemon passes (stdin a memfd, stdout and stderr pipes), so the interpreter sets its streams up the same
//! way. The daemon writes the request's cgroup limits before it sends the launch, so they are in force before any of
//! the request's code runs.
//!
//! At the launch the init passes it on over the channel ([`crate::launch::send_strings`]: stdio and the
//! arguments and environment in a memfd), and watches the interpreter as the program, which reports its
//! program's end before its own exit does ([`super::ending`]). A launch that
//! does not ask for it (or an interpreter that is gone) gets the interpreter killed and reaped, and a forked
//! program as usual. Nothing outlives the container: an init whose launch channel closes exits, and the kernel
//! kills the waiting interpreter with the pid namespace.

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};

use nix::sys::signal::Signal;
use nix::unistd::Pid;

use super::program::{start_program, to_cstrings};
use crate::error::InitError;
use crate::launch::Launch;

/// A started interpreter that waits for its launch.
pub(super) struct Warm {
    pid: Pid,
    /// The init's end of the channel.
    channel: OwnedFd,
    /// The read ends of the placeholder pipes (the interpreter's stdout and stderr; one pipe for both unless the
    /// interpreter is relayed): held so an early write does not fail, and relayed after the launch.
    placeholder: [Option<OwnedFd>; 2],
    /// A relayed interpreter's stdin, which takes the launch's content ([`Launch::relay`]).
    relay_stdin: Option<OwnedFd>,
    /// Where an interpreter that is not relayed reports its end ([`super::ending::END_SOCKET`]).
    end: Option<super::ending::Report>,
}

/// After the hand-over: the program's pid, the channel its end is reported on, and for a relayed interpreter the
/// pipes to relay.
pub(super) struct Handed {
    pub(super) pid: Pid,
    pub(super) report: Option<super::ending::Report>,
    pub(super) relay: Option<super::relay::Relay>,
}

/// Starts and executes `interpreter` with placeholder stdio and the channel's other end, whose descriptor number
/// is appended to its arguments. The channel is a seqpacket socket pair, or for a relayed interpreter a stream
/// socket pair it reads the launch from until end of file and then reports its end on (one that is not relayed
/// reports to [`super::ending::END_SOCKET`]).
pub(super) fn start(status: BorrowedFd<'_>, interpreter: &Launch) -> Result<Warm, InitError> {
    // Only a shortcut: without it the interpreter is reaped as any program is.
    let end = match interpreter.relay {
        true => None,
        false => super::ending::Report::bind().ok(),
    };
    let (channel, theirs) = if interpreter.relay {
        nix::sys::socket::socketpair(
            nix::sys::socket::AddressFamily::Unix,
            nix::sys::socket::SockType::Stream,
            None,
            nix::sys::socket::SockFlag::SOCK_CLOEXEC,
        )
        .map_err(sys("socketpair"))?
    } else {
        crate::ipc::pair().map_err(|e| InitError::Become(Box::new(e)))?
    };
    let stdin = nix::sys::memfd::memfd_create(
        c"sandboxd-warm-stdin",
        nix::sys::memfd::MemFdCreateFlag::MFD_CLOEXEC,
    )
    .map_err(sys("memfd_create"))?;
    let relay_stdin = match interpreter.relay {
        true => Some(dup(&stdin)?),
        false => None,
    };
    let (out_r, out) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).map_err(sys("pipe2"))?;
    let (err_r, err) = match interpreter.relay {
        true => {
            let (r, w) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).map_err(sys("pipe2"))?;
            (Some(r), w)
        }
        false => (None, dup(&out)?),
    };
    let mut args = interpreter.args.clone();
    args.push(theirs.as_raw_fd().to_string());
    let args = to_cstrings(&args)?;
    let env = to_cstrings(&interpreter.env)?;
    let program = args.first().cloned().ok_or(InitError::InvalidArg)?;
    // Started as a launched program is, with the channel kept open across `execve`: the init's copy is closed
    // when this returns, before anything else is started.
    nix::fcntl::fcntl(
        theirs.as_raw_fd(),
        nix::fcntl::FcntlArg::F_SETFD(nix::fcntl::FdFlag::empty()),
    )
    .map_err(sys("fcntl"))?;
    let pid = start_program(
        status,
        [stdin, out, err],
        (&program, &args, &env, None),
        |_| {},
    )?;
    Ok(Warm {
        pid,
        channel,
        placeholder: [Some(out_r), err_r],
        relay_stdin,
        end,
    })
}

fn sys(call: &'static str) -> impl Fn(nix::Error) -> InitError {
    move |source| InitError::Sys { call, source }
}

fn dup(fd: &OwnedFd) -> Result<OwnedFd, InitError> {
    fd.try_clone().map_err(|e| InitError::Sys {
        call: "dup",
        source: nix::Error::from_raw(e.raw_os_error().unwrap_or(libc::EBADF)),
    })
}

impl Warm {
    /// Passes the launch and its stdio to the interpreter, which becomes the program. When it is gone (the send
    /// fails), it is reaped and the stdio comes back for a forked program.
    pub(super) fn hand_over(
        mut self,
        launch: &Launch,
        stdio: [OwnedFd; 3],
    ) -> Result<Handed, [OwnedFd; 3]> {
        if let Some(stdin) = self.relay_stdin.take() {
            return self.hand_over_relayed(launch, stdin, stdio);
        }
        let [a, b, c] = &stdio;
        match crate::launch::send_strings(
            self.channel.as_fd(),
            launch,
            [a.as_fd(), b.as_fd(), c.as_fd()],
        ) {
            Ok(()) => Ok(Handed {
                pid: self.pid,
                report: self.end,
                relay: None,
            }),
            Err(_) => {
                self.discard();
                Err(stdio)
            }
        }
    }

    /// The relayed interpreter: the launch's stdin content goes into the interpreter's own stdin (a memfd it has
    /// not read), the launch through the pipe, and its stdout and stderr pipes are relayed to the launch's.
    fn hand_over_relayed(
        mut self,
        launch: &Launch,
        own_stdin: OwnedFd,
        stdio: [OwnedFd; 3],
    ) -> Result<Handed, [OwnedFd; 3]> {
        let sent = super::relay::copy_file(&stdio[0], &own_stdin).and_then(|()| {
            let bytes = serde_json::to_vec(launch).map_err(|_| nix::Error::EINVAL)?;
            super::relay::write_all(&self.channel, &bytes)
        });
        let (Ok(()), [Some(out), Some(err)]) = (
            sent,
            [self.placeholder[0].take(), self.placeholder[1].take()],
        ) else {
            self.discard();
            return Err(stdio);
        };
        let [_, stdout, stderr] = stdio;
        // End of file tells the interpreter the launch is complete; the other direction carries its report.
        let _ =
            nix::sys::socket::shutdown(self.channel.as_raw_fd(), nix::sys::socket::Shutdown::Write);
        Ok(Handed {
            pid: self.pid,
            report: super::ending::Report::on_channel(self.channel),
            relay: Some(super::relay::Relay::new([out, err], [stdout, stderr])),
        })
    }

    /// Kills and reaps the interpreter (the launch asked for a new program).
    pub(super) fn discard(&self) {
        // Our own unreaped child: the pid is still the interpreter's.
        let _ = nix::sys::signal::kill(self.pid, Signal::SIGKILL);
        while let Err(nix::Error::EINTR) = nix::sys::wait::waitpid(self.pid, None) {}
    }
}

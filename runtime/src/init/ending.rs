//! How the init learns that a warm interpreter's program has ended: the interpreter's report, or its reaping.
//!
//! A process's exit frees its address space before it closes its descriptors and becomes a zombie, and for an
//! interpreter that is most of the end (python about 0.5-1.5 ms, node 2-3 ms, kernel time spent after the last
//! line of the program ran). So a warm interpreter whose program ended the ordinary way (what the stubs in
//! `sandboxd`'s `warm` module call an exit the interpreter's own would match) writes `exit N\n` on its channel
//! right before it exits, after its output is written. The init then ends it (`SIGKILL`: what follows the report is
//! the interpreter's own tear-down), and when the interpreter is the only process left in the container
//! ([`left_besides`]) it reports that end on the status pipe as the program's, with nothing else left, at
//! once; otherwise it waits for the interpreter to be reaped as it waits for any program, and reports the code the
//! interpreter gave.
//!
//! Where the report arrives: an interpreter that takes descriptors over a socket (python) closes its channel once
//! it has the launch, and reports in a datagram to [`END_SOCKET`], an abstract unix socket the init bound in the
//! container's own network namespace before the interpreter started (so nothing of the program could take the name
//! first): the program keeps no descriptor it did not have in a plain start. A relayed one (node, which has no
//! datagram sockets and no synchronous way to connect one) keeps its channel, a stream socket, and reports on it.
//! Either way the init takes only what the interpreter's own process wrote (the sender's pid, passed by the kernel
//! with [`SO_PASSCRED`](libc::SO_PASSCRED)): what another process of the container writes (python's socket can be
//! found by its name) is dropped.
//!
//! The report comes from the program's own process, so the program can write one itself, at any moment: it ends
//! the program, as `os._exit(N)` would, and nothing more. A report that is not `exit N` with `N` in `0..=255` is
//! ignored, and the channel with it.

use std::os::fd::{AsFd, AsRawFd, OwnedFd};

use nix::errno::Errno;
use nix::fcntl::{fcntl, FcntlArg, OFlag};
use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
use nix::unistd::Pid;

use super::relay::Relay;

/// How often children are reaped while nothing else wakes the init.
const REAP_INTERVAL_MS: u16 = 100;
/// The longest report: `exit 255\n`.
const MAX_REPORT: usize = 9;
/// Messages read from the report's socket per wake-up at most.
const MAX_READS: usize = 64;

/// How the program ended, as the init learnt it.
pub(super) enum Ended<T> {
    /// It was reaped (how it ended).
    Reaped(T),
    /// The interpreter reported this exit code (it may still be exiting).
    Reported(i32),
}

/// The abstract unix socket name (without its leading NUL) a warm interpreter that closed its channel reports to.
pub const END_SOCKET: &str = "sandboxd-warm-end";

/// Where the init waits for a warm interpreter's report of its end.
pub(super) struct Report {
    fd: OwnedFd,
    kind: Kind,
    got: Vec<u8>,
}

enum Kind {
    /// The interpreter's channel (a stream socket): whatever arrives on it.
    Stream,
    /// [`END_SOCKET`]: datagrams whose sender is the interpreter.
    Datagram,
}

/// What reading the report gave.
enum Read {
    /// A complete, valid report.
    Code(i32),
    /// Nothing complete yet.
    Partial,
    /// End of file, an error or anything but a report: the channel is no longer watched.
    Gone,
}

impl Report {
    /// Watches the init's end of a relayed interpreter's channel (made non-blocking, with the writers' credentials
    /// passed) for the report; `None` when the socket refuses that.
    pub(super) fn on_channel(fd: OwnedFd) -> Option<Report> {
        fcntl(fd.as_raw_fd(), FcntlArg::F_SETFL(OFlag::O_NONBLOCK)).ok()?;
        nix::sys::socket::setsockopt(&fd, nix::sys::socket::sockopt::PassCred, &true).ok()?;
        Some(Report {
            fd,
            kind: Kind::Stream,
            got: Vec::with_capacity(MAX_REPORT),
        })
    }

    /// Binds [`END_SOCKET`] in the container's network namespace, before the interpreter starts.
    pub(super) fn bind() -> nix::Result<Report> {
        use nix::sys::socket::{
            bind, setsockopt, socket, sockopt, AddressFamily, SockFlag, SockType, UnixAddr,
        };
        let fd = socket(
            AddressFamily::Unix,
            SockType::Datagram,
            SockFlag::SOCK_CLOEXEC | SockFlag::SOCK_NONBLOCK,
            None,
        )?;
        setsockopt(&fd, sockopt::PassCred, &true)?;
        bind(
            fd.as_raw_fd(),
            &UnixAddr::new_abstract(END_SOCKET.as_bytes())?,
        )?;
        Ok(Report {
            fd,
            kind: Kind::Datagram,
            got: Vec::new(),
        })
    }

    /// Reads what arrived (at most [`MAX_READS`] messages a wake-up, so a flood from the program's children cannot
    /// keep the init from its other work). Only the interpreter's own bytes count: a stream socket that passes
    /// credentials never returns two writers' bytes in one read, and a datagram is one writer's.
    fn read(&mut self, program: Pid) -> Read {
        use nix::sys::socket::{recvmsg, ControlMessageOwned, MsgFlags};
        for _ in 0..MAX_READS {
            let mut buf = [0u8; MAX_REPORT + 1];
            let mut cmsg = nix::cmsg_space!(libc::ucred);
            let mut iov = [std::io::IoSliceMut::new(&mut buf)];
            let (len, sender) = match recvmsg::<()>(
                self.fd.as_raw_fd(),
                &mut iov,
                Some(&mut cmsg),
                MsgFlags::MSG_CMSG_CLOEXEC,
            ) {
                Ok(msg) => {
                    let sender = msg.cmsgs().ok().and_then(|mut c| {
                        c.find_map(|c| match c {
                            ControlMessageOwned::ScmCredentials(cred) => Some(cred.pid()),
                            _ => None,
                        })
                    });
                    (msg.bytes, sender)
                }
                Err(Errno::EINTR) => continue,
                Err(Errno::EAGAIN) => return Read::Partial,
                Err(_) => return Read::Gone,
            };
            match self.kind {
                // End of file: the interpreter (and every copy of its end) is gone.
                Kind::Stream if len == 0 => return Read::Gone,
                _ if sender != Some(program.as_raw()) => continue,
                Kind::Datagram => {
                    return match buf[..len].strip_suffix(b"\n").and_then(parse) {
                        Some(code) => Read::Code(code),
                        None => Read::Gone,
                    }
                }
                Kind::Stream => self.got.extend_from_slice(&buf[..len]),
            }
            if let Some(end) = self.got.iter().position(|&b| b == b'\n') {
                return match parse(&self.got[..end]) {
                    Some(code) if end + 1 == self.got.len() => Read::Code(code),
                    _ => Read::Gone,
                };
            }
            if self.got.len() >= MAX_REPORT {
                return Read::Gone;
            }
        }
        Read::Partial
    }
}

/// `exit N` with `N` in `0..=255`.
fn parse(line: &[u8]) -> Option<i32> {
    let digits = line.strip_prefix(b"exit ")?;
    if digits.is_empty() || digits.len() > 3 || !digits.iter().all(u8::is_ascii_digit) {
        return None;
    }
    let code: i32 = std::str::from_utf8(digits).ok()?.parse().ok()?;
    (code <= 255).then_some(code)
}

/// Waits until `program` is reaped or (with a `report`) reports its end, copying the relayed output meanwhile.
/// `reaped` is called on every wake-up, and at least every [`REAP_INTERVAL_MS`]: it reaps the children that ended
/// (so orphans do not pile up as zombies) and says how the program ended once it is among them.
pub(super) fn watch<T>(
    program: Pid,
    mut relay: Option<&mut Relay>,
    report: Option<Report>,
    mut reaped: impl FnMut() -> Option<T>,
) -> Ended<T> {
    let mut report = report;
    // Without a pidfd (it cannot fail for our own unreaped child) the watch still ends: it reaps on a timer.
    let pidfd = crate::sys::pidfd_open(program).ok();
    loop {
        if let Some(exit) = reaped() {
            return Ended::Reaped(exit);
        }
        // Which descriptor each poll entry is: the pidfd, the report, or relay pipe `i`.
        enum Source {
            Pidfd,
            Report,
            Pipe(usize),
        }
        let mut fds: Vec<PollFd<'_>> = Vec::with_capacity(4);
        let mut which = Vec::with_capacity(4);
        if let Some(p) = &pidfd {
            fds.push(PollFd::new(p.as_fd(), PollFlags::POLLIN));
            which.push(Source::Pidfd);
        }
        if let Some(r) = &report {
            fds.push(PollFd::new(r.fd.as_fd(), PollFlags::POLLIN));
            which.push(Source::Report);
        }
        if let Some(relay) = relay.as_deref() {
            for (i, fd) in relay.open() {
                fds.push(PollFd::new(fd, PollFlags::POLLIN));
                which.push(Source::Pipe(i));
            }
        }
        match poll(&mut fds, PollTimeout::from(REAP_INTERVAL_MS)) {
            Ok(_) | Err(Errno::EINTR) => {}
            // Cannot happen with valid descriptors; reaping on each turn keeps the watch from hanging.
            Err(_) => continue,
        }
        let ready: Vec<&Source> = fds
            .iter()
            .zip(&which)
            .filter(|(fd, _)| fd.revents().is_some_and(|r| !r.is_empty()))
            .map(|(_, s)| s)
            .collect();
        drop(fds);
        for source in ready {
            match source {
                Source::Pidfd => {}
                Source::Report => match report.as_mut().map(|r| r.read(program)) {
                    Some(Read::Code(code)) => return Ended::Reported(code),
                    Some(Read::Partial) | None => {}
                    Some(Read::Gone) => report = None,
                },
                Source::Pipe(i) => {
                    if let Some(relay) = relay.as_deref_mut() {
                        relay.copy(*i);
                    }
                }
            }
        }
    }
}

/// What is left in the container's pid namespace besides the init, after `program` reported its end and was killed.
pub(super) struct Left {
    /// Nothing but the program (ended, or killed: it can start nothing more).
    pub(super) alone: bool,
    /// The program was reaped on the way.
    pub(super) reaped: bool,
}

/// Reaps the children that ended (the program too, if it has), then reads what is left from the container's
/// `/proc`, which lists exactly its pid namespace: the program's children, and the orphans the init inherited.
/// Anything unreadable counts as not alone.
pub(super) fn left_besides(program: Pid) -> Left {
    let mut reaped = false;
    loop {
        match waitpid(None, Some(WaitPidFlag::WNOHANG)) {
            Err(Errno::ECHILD) => {
                return Left {
                    alone: true,
                    reaped,
                }
            }
            Ok(WaitStatus::StillAlive) => break,
            Ok(WaitStatus::Exited(pid, _) | WaitStatus::Signaled(pid, _, _)) if pid == program => {
                reaped = true
            }
            Ok(_) | Err(Errno::EINTR) => continue,
            Err(_) => {
                return Left {
                    alone: false,
                    reaped,
                }
            }
        }
    }
    Left {
        alone: only_listed(&[nix::unistd::getpid(), program]),
        reaped,
    }
}

/// Whether `/proc` lists no process but `pids`.
fn only_listed(pids: &[Pid]) -> bool {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return false;
    };
    for entry in dir {
        let Ok(entry) = entry else {
            return false;
        };
        let pid = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<i32>().ok());
        if pid.is_some_and(|p| !pids.contains(&Pid::from_raw(p))) {
            return false;
        }
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_plain_exit_code_is_a_report() {
        assert_eq!(parse(b"exit 0"), Some(0));
        assert_eq!(parse(b"exit 255"), Some(255));
        for bad in [
            &b"exit 256"[..],
            b"exit -1",
            b"exit",
            b"exit ",
            b"exit 1 ",
            b"exit +1",
            b"exit 0001",
            b"signal 9",
            b"",
        ] {
            assert_eq!(parse(bad), None, "{:?}", String::from_utf8_lossy(bad));
        }
    }
}

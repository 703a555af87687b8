//! The serving init: a container that runs many programs, one per launch, for a long-lived sandbox whose caller
//! starts processes as it goes (E2B's `commands.run`).
//!
//! A [`Launch::serve`](crate::launch::Launch::serve) launch turns the init into this loop instead of forking a
//! program. The init is confined already (no capabilities, landlock, seccomp), so every program it starts
//! inherits all of it and lives in the container's namespaces and cgroup, as an agent run's program does; all of
//! them share the one pid namespace (a program can signal another by the pid it was told). On the launch channel,
//! one datagram each way:
//!
//! | from the daemon | the init's answer |
//! |---|---|
//! | a launch ([`crate::launch::send`]: stdio, payload) | `started <pid>` or `refused <why>` |
//! | `signal <pid> <signo>` | `signalled`, or `no such process` when `pid` is not a running program it started |
//!
//! Answers come in the order of the requests. Between them, whenever a program it started ends, the init sends
//! `exited <pid> <record>` ([`ProgramExit::encode`] without its newline); it reaps orphans silently. A pid is
//! signalled only while it is the init's unreaped child, so a recycled pid is never hit. When the daemon closes
//! the channel, the init kills everything in the container and exits. The daemon's side is
//! [`crate::processes::Processes`].
//!
//! A kept serving launch (live restore: the container outlives the daemon) hands the init the daemon's own end of
//! the channel and the status pipe's read end, which it holds at fixed numbers ([`CHANNEL_FD`],
//! [`keeper::STATUS_FD`](super::keeper::STATUS_FD)) and never reads: the channel stays open through the daemon's
//! death, with the init's reports queued in it, and the next daemon takes a copy with `pidfd_getfd(2)`. A kept
//! program launch likewise hands it the daemon's ends of the program's pipes (stdin's write end, stdout's and
//! stderr's read ends), held until the program ends, so the program's output waits in its pipes instead of
//! killing it with `SIGPIPE`; `list` says where they are. Then:
//!
//! | from the daemon | the init's answer |
//! |---|---|
//! | `sync <n>` | `synced <n>` (a new daemon skips the answers meant for the one before, up to it) |
//! | `list` | `running <pid> <stdin> <stdout> <stderr>` per running program (`-1`: not held), then `listed` |

use std::collections::BTreeMap;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};

use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::sys::signal::{kill, SigSet, Signal};
use nix::sys::signalfd::{SfdFlags, SignalFd};
use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
use nix::unistd::Pid;

use super::program::{setup_failed, start_program, to_cstrings, ProgramExit};
use crate::error::Chain;
use crate::ipc;
use crate::launch::{self, Launch};

/// Prefix of a signal request.
pub const SIGNAL: &str = "signal ";
/// Prefix of the answer to a started launch.
pub const STARTED: &str = "started ";
/// Prefix of the answer to a refused launch.
pub const REFUSED: &str = "refused ";
/// The answer to a signal delivered.
pub const SIGNALLED: &str = "signalled";
/// The answer to a signal for a pid that is not a running program of the init.
pub const NO_SUCH_PROCESS: &str = "no such process";
/// Prefix of the report of a program's end.
pub const EXITED: &str = "exited ";
/// Prefix of a synchronisation request, and of its answer.
pub const SYNC: &str = "sync ";
/// Prefix of the answer to a synchronisation request.
pub const SYNCED: &str = "synced ";
/// The request for the running programs.
pub const LIST: &str = "list";
/// Prefix of one running program in the answer to [`LIST`].
pub const RUNNING: &str = "running ";
/// The end of the answer to [`LIST`].
pub const LISTED: &str = "listed";
/// Where a kept serving init holds the daemon's end of the channel.
pub const CHANNEL_FD: RawFd = 63;

/// What the init holds of a running program for a later daemon: the daemon's ends of its stdin, stdout and
/// stderr.
type Held = Option<[OwnedFd; 3]>;

/// Serves launches on `sock` until the daemon closes it; never returns. `kept`: a kept serving launch's
/// descriptors (the daemon's end of the channel, the status pipe's read end, and one unused), held for a later
/// daemon.
pub(super) fn run(status: BorrowedFd<'_>, sock: OwnedFd, kept: Vec<OwnedFd>) -> ! {
    let _held = match kept.len() {
        0 => Vec::new(),
        _ => match hold(kept) {
            Some(h) => h,
            None => setup_failed(status, "cannot hold a kept serving launch's descriptors"),
        },
    };
    // SIGCHLD is read from a descriptor beside the channel; the programs start with an empty mask
    // (`program::start_program`), so blocking it here is the init's alone.
    let mut mask = SigSet::empty();
    mask.add(Signal::SIGCHLD);
    if let Err(e) = mask.thread_block() {
        setup_failed(status, format_args!("block SIGCHLD: {e}"));
    }
    let children = match SignalFd::with_flags(&mask, SfdFlags::SFD_NONBLOCK | SfdFlags::SFD_CLOEXEC)
    {
        Ok(fd) => fd,
        Err(e) => setup_failed(status, format_args!("signalfd: {e}")),
    };
    let mut running: BTreeMap<i32, Held> = BTreeMap::new();
    loop {
        let mut fds = [
            PollFd::new(sock.as_fd(), PollFlags::POLLIN),
            PollFd::new(children.as_fd(), PollFlags::POLLIN),
        ];
        match poll(&mut fds, PollTimeout::NONE) {
            Ok(_) | Err(nix::Error::EINTR) => {}
            Err(_) => end(status),
        }
        let [request, child] = fds.map(|f| f.revents().unwrap_or(PollFlags::empty()));
        if !child.is_empty() {
            while let Ok(Some(_)) = children.read_signal() {}
            reap(sock.as_fd(), &mut running);
        }
        if !request.is_empty() && !answer(status, sock.as_fd(), &mut running) {
            end(status);
        }
    }
}

/// The kept serving launch's descriptors at their fixed numbers: the channel's daemon end at [`CHANNEL_FD`], the
/// status pipe's read end at the keeper's `STATUS_FD`.
fn hold(kept: Vec<OwnedFd>) -> Option<Vec<OwnedFd>> {
    let [channel, status, _unused]: [OwnedFd; 3] = kept.try_into().ok()?;
    Some(vec![
        super::keeper::hold_at(channel, CHANNEL_FD)?,
        super::keeper::hold_at(status, super::keeper::STATUS_FD)?,
    ])
}

/// Reaps every child that ended; reports the programs among them (and closes what it held of them).
fn reap(sock: BorrowedFd<'_>, running: &mut BTreeMap<i32, Held>) {
    loop {
        let (pid, exit) = match waitpid(None, Some(WaitPidFlag::WNOHANG)) {
            Ok(WaitStatus::Exited(pid, code)) => (pid, ProgramExit::Code(code)),
            Ok(WaitStatus::Signaled(pid, sig, _)) => (pid, ProgramExit::Signal(sig as i32)),
            Ok(WaitStatus::StillAlive) | Err(nix::Error::ECHILD) => return,
            Ok(_) | Err(_) => continue,
        };
        if running.remove(&pid.as_raw()).is_some() {
            let record = exit.encode();
            say(sock, &format!("{EXITED}{} {}", pid, record.trim_end()));
        }
    }
}

/// Reads one request and answers it; `false` when the channel is closed.
fn answer(status: BorrowedFd<'_>, sock: BorrowedFd<'_>, running: &mut BTreeMap<i32, Held>) -> bool {
    let mut buf = [0u8; 64];
    let (n, fds) = match ipc::recv(sock, &mut buf) {
        Ok(Some(m)) => m,
        Ok(None) => return false,
        Err(nix::Error::EINTR | nix::Error::EAGAIN) => return true,
        Err(_) => return false,
    };
    let message = &buf[..n];
    let reply = if launch::is_launch(message) {
        match launch::parse(message, fds) {
            Ok((l, stdio, kept)) if !l.serve => match start(status, &l, stdio) {
                Ok(pid) => {
                    let held: Held = kept.try_into().ok();
                    let fds = numbers(&held);
                    running.insert(pid.as_raw(), held);
                    format!("{STARTED}{pid} {fds}")
                }
                Err(why) => format!("{REFUSED}{why}"),
            },
            Ok(_) => format!("{REFUSED}a serving launch in a serving container"),
            Err(e) => format!("{REFUSED}{}", Chain(&e)),
        }
    } else if message == LIST.as_bytes() {
        for (pid, held) in running.iter() {
            say(sock, &format!("{RUNNING}{pid} {}", numbers(held)));
        }
        LISTED.to_owned()
    } else if let Some(n) = message.strip_prefix(SYNC.as_bytes()) {
        format!("{SYNCED}{}", String::from_utf8_lossy(n))
    } else {
        match std::str::from_utf8(message)
            .ok()
            .and_then(|m| m.strip_prefix(SIGNAL))
            .and_then(parse_signal)
        {
            Some((pid, sig)) if running.contains_key(&pid.as_raw()) => match kill(pid, sig) {
                Ok(()) => SIGNALLED.to_owned(),
                Err(_) => NO_SUCH_PROCESS.to_owned(),
            },
            Some(_) => NO_SUCH_PROCESS.to_owned(),
            None => format!("{REFUSED}malformed request"),
        }
    };
    say(sock, &reply);
    true
}

/// `<stdin> <stdout> <stderr>`: the numbers of what the init holds of a program, `-1 -1 -1` for nothing.
fn numbers(held: &Held) -> String {
    match held {
        Some([a, b, c]) => format!("{} {} {}", a.as_raw_fd(), b.as_raw_fd(), c.as_raw_fd()),
        None => "-1 -1 -1".to_owned(),
    }
}

/// `<pid> <signo>` of a signal request.
fn parse_signal(text: &str) -> Option<(Pid, Signal)> {
    let (pid, sig) = text.split_once(' ')?;
    let pid: i32 = pid.parse().ok().filter(|p| *p > 1)?;
    let sig = Signal::try_from(sig.parse::<i32>().ok()?).ok()?;
    Some((Pid::from_raw(pid), sig))
}

/// Starts one launch's program; its pid, or why not.
fn start(status: BorrowedFd<'_>, launch: &Launch, stdio: [OwnedFd; 3]) -> Result<Pid, String> {
    let invalid =
        || "a NUL byte in the program, an argument, the environment or the directory".to_owned();
    let args = to_cstrings(&launch.args).map_err(|_| invalid())?;
    let env = to_cstrings(&launch.env).map_err(|_| invalid())?;
    let cwd = launch
        .cwd
        .as_deref()
        .map(|c| std::ffi::CString::new(c).map_err(|_| invalid()))
        .transpose()?;
    let program = args.first().ok_or("no program")?;
    start_program(status, stdio, (program, &args, &env, cwd.as_ref()), |_| {})
        .map_err(|e| Chain(&e).to_string())
}

/// Sends one datagram to the daemon; a gone daemon is noticed on the next read.
fn say(sock: BorrowedFd<'_>, text: &str) {
    let _ = ipc::send(sock, text.as_bytes(), &[]);
}

/// The daemon is gone: everything in the container is killed, the init's end is recorded and it exits.
fn end(status: BorrowedFd<'_>) -> ! {
    // Pid 1 is spared by kill(-1); the kernel ends whatever is left when it exits.
    let _ = kill(Pid::from_raw(-1), Signal::SIGKILL);
    let _ = nix::unistd::write(status, ProgramExit::Code(0).encode().as_bytes());
    // SAFETY: end the init without unwinding into its caller, which expects no return.
    unsafe { libc::_exit(0) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signal_requests_name_a_pid_and_a_signal() {
        assert_eq!(
            parse_signal("12 9"),
            Some((Pid::from_raw(12), Signal::SIGKILL))
        );
        assert_eq!(parse_signal("1 9"), None, "never the init itself");
        assert_eq!(parse_signal("-1 9"), None, "never every process");
        assert_eq!(parse_signal("12 99"), None);
        assert_eq!(parse_signal("12"), None);
    }
}

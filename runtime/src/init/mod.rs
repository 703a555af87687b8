//! The container's pid 1: an init that forks the program instead of becoming it (run by the direct start, or as
//! libcontainer's executor with the `libcontainer` feature).
//!
//! A program running as pid 1 of a pid namespace ignores every signal it has no handler for, even from itself
//! (`os.kill(os.getpid(), SIGKILL)` would do nothing), and nobody reaps its orphans. So the container's init stays
//! a small reaper: it drops the last privileges (capabilities checked empty, landlock, seccomp: the program inherits
//! them), waits for the launch message ([`crate::launch`]: the program, its environment and its stdio),
//! starts a child (cloned sharing the init's memory until its `execve`, [`program::spawn_program`]; a plain fork
//! when that fails), the child applies the last restrictions and `execve`s the program, and the parent reaps everything until
//! the program itself ends, passing `SIGTERM`, `SIGINT` and `SIGHUP` from outside the container on to it. Then it writes how the program ended
//! (exit code or signal) to a status pipe the daemon holds the other end of, and exits; the kernel then kills
//! whatever else is left in the pid namespace (double-forked daemons included).
//!
//! A pooled container's init may also start an interpreter ahead of time, confined the same way, and hand it the
//! launch instead of forking a program ([`warm`]); such an interpreter reports its program's end before its own
//! exit is done, and with nothing else left the init takes that as the end ([`ending`]).
//!
//! An agent run's init may be kept: it outlives the helper and the daemon, and holds the run's control socket and
//! status pipe for the next daemon, which takes the run back ([`keeper`]).
//!
//! Everything here runs in the forked container process, which is single-threaded (the helper is).

use std::os::fd::{AsFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicI32, Ordering};

use nix::sys::signal::{sigaction, SaFlags, SigAction, SigHandler, SigSet, Signal};
use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
use nix::unistd::Pid;

use crate::error::{Chain, InitError};
use crate::launch::Launch;
use crate::sys;

mod ending;
pub mod keeper;
mod program;
mod relay;
pub mod serve;
mod warm;

use self::program::{mark, setup_failed, to_cstrings};
pub use self::program::{monotonic_ns, signal_name, ProgramExit, EXEC_FAILED, SETUP_FAILED};

/// The line the init writes before its record when no other process is left in the container (see [`ended_alone`]).
const ALONE: &str = "alone\n";

/// Whether `status` (what the status pipe gave so far) ends with the init's record after its [`ALONE`] line: the
/// program has ended, nothing else of the container runs, and the init writes nothing more. Its reader need not
/// wait for the init's own exit (the namespaces' tear-down) to know the execution is over. After a warm
/// interpreter's report ([`ending`]) the interpreter may still be exiting: it was killed before the record was
/// written, and the kernel may still be freeing its memory.
pub fn ended_alone(status: &[u8]) -> bool {
    let Some(text) = status.strip_suffix(b"\n") else {
        return false;
    };
    let mut lines = text.rsplit(|&b| b == b'\n');
    let record = lines.next().and_then(|l| std::str::from_utf8(l).ok());
    record.and_then(ProgramExit::decode).is_some()
        && lines.next() == Some(ALONE.trim_end().as_bytes())
}

/// What the init reported on the status pipe.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Report {
    /// The last restrictions could not be applied: the program never ran.
    pub setup_error: Option<String>,
    /// How the program ended.
    pub exit: Option<ProgramExit>,
    /// Timing marks (name, `CLOCK_MONOTONIC` ns): `received` (launch read), `exec` (right before `execve`),
    /// `reaped` (the program ended) or `reported` (a warm interpreter's report taken as its end).
    pub marks: Vec<(String, u64)>,
}

impl Report {
    /// Parses every line the init and its child wrote.
    pub fn decode(text: &str) -> Self {
        let mut r = Report::default();
        for line in text.lines() {
            if let Some(msg) = line.strip_prefix("setup ") {
                r.setup_error.get_or_insert_with(|| msg.to_owned());
            } else if let Some((name, ns)) = line.strip_prefix("t ").and_then(|m| m.split_once(' '))
            {
                if let Ok(ns) = ns.parse() {
                    r.marks.push((name.to_owned(), ns));
                }
            } else if let Some(e) = ProgramExit::decode(line) {
                r.exit = Some(e);
            }
        }
        r
    }
}

/// The container's init, started by the direct start (or as libcontainer's executor once the container is
/// started). It waits for the launch message ([`crate::launch`]) before it runs anything, so containers can be
/// created ahead of time.
#[derive(Clone)]
pub struct InitExecutor {
    /// Write end of the status pipe, inherited from the helper under this number.
    pub status_fd: RawFd,
    /// The init's end of the launch channel, inherited from the helper under this number.
    pub launch_fd: RawFd,
    /// The syscall filters, installed right before `execve`.
    pub seccomp: crate::seccomp::Profile,
    /// The filesystem access policy, applied right before the filters.
    pub landlock: crate::landlock::Policy,
    /// An interpreter to start ahead of time, confined like any program, that waits for the launch ([`warm`]).
    pub warm: Option<Launch>,
    /// Outlive the helper (no parent death signal): an agent run that a restarted daemon adopts. Its launch
    /// hands it the descriptors it keeps for that daemon ([`keeper`]).
    pub outlives_helper: bool,
}

/// The program's pid, for the signal forwarder (0 while there is none).
static PROGRAM: AtomicI32 = AtomicI32::new(0);

/// Passes a polite stop signal (`SIGTERM`, `SIGINT`, `SIGHUP`) from outside the container on to the program. As
/// pid 1 of its namespace the init would ignore them, and a long-lived program needs the chance to finish its work
/// before `SIGKILL`. A signal from inside the container (the program signalling pid 1) has a non-zero `si_pid` and
/// is ignored, as it was before: only a sender in an ancestor pid namespace shows as pid 0.
extern "C" fn forward(sig: libc::c_int, info: *mut libc::siginfo_t, _ctx: *mut libc::c_void) {
    // SAFETY: the kernel passes a valid siginfo to an SA_SIGINFO handler; si_pid is valid for kill/sigqueue.
    let sender = unsafe { (*info).si_pid() };
    let pid = PROGRAM.load(Ordering::SeqCst);
    if sender == 0 && pid > 0 {
        // SAFETY: kill(2) is async-signal-safe; `pid` is our own unreaped child (it is reset after it is reaped).
        unsafe { libc::kill(pid, sig) };
    }
}

impl InitExecutor {
    /// Becomes the container's init: confines itself, waits for the launch, forks the program and reaps until it
    /// ends, then ends the process. Returns only when it could not get that far. The direct start
    /// ([`crate::direct`]) calls it in the cloned process; libcontainer through its executor's `exec`.
    pub fn run(&self) -> Result<(), InitError> {
        self.become_init()?;
        // SAFETY: `status_fd` is inherited from the helper, kept open by `become_init` and owned by no Rust object
        // in this process; it stays open until the process ends.
        let status = unsafe { BorrowedFd::borrow_raw(self.status_fd) };
        self.confine(status);
        // Started after the confinement, so the interpreter inherits all of it, as a forked program does.
        let warm = match &self.warm {
            Some(w) => Some(warm::start(status, w)?),
            None => None,
        };
        let (sock, (launch, stdio, kept)) = self.receive(status);
        mark(status, "received");
        if launch.serve {
            if let Some(w) = warm {
                w.discard();
            }
            drop(stdio);
            if launch.keep && !self.outlives_helper {
                setup_failed(
                    status,
                    "a kept launch in a container that dies with the helper",
                );
            }
            serve::run(status, sock, kept);
        }
        drop(sock);
        let mut keeper = match launch.keep {
            true if self.outlives_helper => match keeper::Keeper::new(kept) {
                Some(k) => Some(k),
                None => setup_failed(status, "a kept launch without its descriptors"),
            },
            true => setup_failed(
                status,
                "a kept launch in a container that dies with the helper",
            ),
            false => None,
        };
        let program = match warm {
            Some(w) if launch.warm => w.hand_over(&launch, stdio),
            Some(w) => {
                w.discard();
                Err(stdio)
            }
            None => Err(stdio),
        };
        let (program, handed) = match program {
            Ok(handed) => {
                mark(status, "exec");
                (handed.pid, Some((handed.report, handed.relay)))
            }
            Err(stdio) => (self.fork_program(status, &launch, stdio)?, None),
        };
        PROGRAM.store(program.as_raw(), Ordering::SeqCst);
        let exit = match (handed, keeper.as_mut()) {
            (Some((report, relay)), _) => Self::watch_warm(status, program, report, relay),
            (None, Some(k)) => k.run_until(program, || reap_ended(program)),
            (None, None) => reap_until(program),
        };
        PROGRAM.store(0, Ordering::SeqCst);
        let mut record = exit.encode();
        if alone() {
            record.insert_str(0, ALONE);
        }
        mark(status, "reaped");
        let _ = nix::unistd::write(status, record.as_bytes());
        if let Some(k) = keeper {
            k.hand_over(keeper::LINGER, || {
                alone();
            });
        }
        // SAFETY: end the init without unwinding into its caller, which expects no return.
        unsafe { libc::_exit(0) }
    }

    /// Watches a warm interpreter's program until it ends ([`ending`]). When the interpreter reports its end and
    /// nothing else is left in the container, that end is written on the status pipe (with the [`ALONE`] line) and
    /// the init exits without waiting for the interpreter's exit; otherwise returns the end, once it is reaped.
    fn watch_warm(
        status: BorrowedFd<'_>,
        program: Pid,
        report: Option<ending::Report>,
        mut relay: Option<relay::Relay>,
    ) -> ProgramExit {
        let exit = match ending::watch(program, relay.as_mut(), report, || reap_ended(program)) {
            ending::Ended::Reaped(exit) => exit,
            ending::Ended::Reported(code) => {
                // What follows the report is the interpreter's own tear-down; after this kill it can start nothing
                // more, so what the check finds is final.
                let _ = nix::sys::signal::kill(program, Signal::SIGKILL);
                PROGRAM.store(0, Ordering::SeqCst);
                let exit = ProgramExit::Code(code);
                let left = ending::left_besides(program);
                if left.alone {
                    if let Some(relay) = relay {
                        relay.finish_reported();
                    }
                    mark(status, "reported");
                    let record = format!("{ALONE}{}", exit.encode());
                    let _ = nix::unistd::write(status, record.as_bytes());
                    // SAFETY: end the init without unwinding into its caller, which expects no return.
                    unsafe { libc::_exit(0) }
                }
                // Others are left (which the program started): it is waited for as any program is, and its end is
                // the one it reported.
                if !left.reaped {
                    let _ = ending::watch(program, relay.as_mut(), None, || reap_ended(program));
                }
                exit
            }
        };
        if let Some(relay) = relay {
            relay.finish();
        }
        exit
    }

    /// Starts the child that becomes the program ([`program::start_program`]); returns its pid.
    fn fork_program(
        &self,
        status: BorrowedFd<'_>,
        launch: &Launch,
        stdio: [OwnedFd; 3],
    ) -> Result<Pid, InitError> {
        let args = to_cstrings(&launch.args)?;
        let env = to_cstrings(&launch.env)?;
        let program = args.first().cloned().ok_or(InitError::InvalidArg)?;
        let cwd = launch
            .cwd
            .as_deref()
            .map(|c| std::ffi::CString::new(c).map_err(|_| InitError::InvalidArg))
            .transpose()?;
        mark(status, "exec");
        // The program holds the only copies of the stdio the container needs: the daemon sees end of file on the
        // output pipes when the program (and whatever it started) is gone.
        let started = |pid: Pid| PROGRAM.store(pid.as_raw(), Ordering::SeqCst);
        program::start_program(
            status,
            stdio,
            (&program, &args, &env, cwd.as_ref()),
            started,
        )
    }

    /// [`Self::run`] for a caller with nobody to return to (the direct start's cloned init): a failure is
    /// reported on the status pipe, as a failed restriction is, and ends the process.
    pub fn run_or_report(&self) -> ! {
        let e = match self.run() {
            Ok(()) => InitError::Returned,
            Err(e) => e,
        };
        // SAFETY: `status_fd` is inherited from the helper and stays open until the process ends.
        setup_failed(unsafe { BorrowedFd::borrow_raw(self.status_fd) }, Chain(&e))
    }

    /// Keeps only stdio, the status pipe and the launch channel, dies with the helper, refuses ptrace, and forwards
    /// polite stop signals to the program.
    fn become_init(&self) -> Result<(), InitError> {
        let other = |e: crate::Error| InitError::Become(Box::new(e));
        // libcontainer marks the helper's other descriptors close-on-exec, but this process never execs, and
        // holding another container's pipe would keep that pipe from closing.
        let (status_fd, launch_fd) = (self.status_fd, self.launch_fd);
        let (lo, hi) = (status_fd.min(launch_fd), status_fd.max(launch_fd));
        sys::close_range(3, lo - 1).map_err(other)?;
        sys::close_range(lo + 1, hi - 1).map_err(other)?;
        sys::close_range(hi + 1, RawFd::MAX).map_err(other)?;
        // Die with the helper (unless told to outlive it); and let no process in the container ptrace or inspect
        // the init.
        if !self.outlives_helper {
            sys::set_parent_death_signal(Signal::SIGKILL).map_err(other)?;
        }
        sys::set_not_dumpable().map_err(other)?;
        let handler = SigAction::new(
            SigHandler::SigAction(forward),
            SaFlags::SA_RESTART | SaFlags::SA_SIGINFO,
            SigSet::empty(),
        );
        for sig in [Signal::SIGTERM, Signal::SIGINT, Signal::SIGHUP] {
            // SAFETY: `forward` only reads its siginfo and an atomic and calls kill(2): async-signal-safe.
            unsafe { sigaction(sig, &handler) }.map_err(|source| InitError::Sys {
                call: "sigaction",
                source,
            })?;
        }
        Ok(())
    }

    /// Fails closed, and before anything is launched: no capabilities, then landlock, then seccomp (landlock needs
    /// syscalls the filter refuses). The init confines itself, so the program it forks inherits all three and the
    /// launch costs only a fork and an exec; the init needs nothing the program may not do (receive, fork, wait,
    /// write, kill its child, exit). A failure is reported on the status pipe and ends the init: the daemon finds
    /// the launch channel closed and reads why.
    fn confine(&self, status: BorrowedFd<'_>) {
        if let Err(e) = crate::caps::ensure_none()
            .and_then(|()| self.landlock.restrict_self())
            .and_then(|()| self.seccomp.install())
        {
            setup_failed(status, Chain(&e))
        }
    }

    /// Waits for the launch message (and returns the channel with it). The daemon dropping the container before using it ends the init quietly
    /// (nothing ran, nothing to report); a malformed launch is reported as a setup failure.
    fn receive(&self, status: BorrowedFd<'_>) -> (OwnedFd, crate::launch::Received) {
        // SAFETY: `launch_fd` is inherited from the helper and owned by nothing else in this process.
        let launch_sock = unsafe { OwnedFd::from_raw_fd(self.launch_fd) };
        match crate::launch::recv(launch_sock.as_fd()) {
            Ok(Some(l)) => (launch_sock, l),
            // SAFETY: end the init without unwinding into its caller, which expects no return.
            Ok(None) => unsafe { libc::_exit(0) },
            Err(e) => setup_failed(status, Chain(&e)),
        }
    }
}

/// Reaps every child that ended, without waiting; `Some` once `program` is among them.
fn reap_ended(program: Pid) -> Option<ProgramExit> {
    reap(program, Some(WaitPidFlag::WNOHANG))
}

/// Whether the init is the last process of its pid namespace: every process there is its descendant (orphans are
/// reparented to it), so none is left when it has no child (after reaping the ones that have ended).
fn alone() -> bool {
    loop {
        match waitpid(None, Some(WaitPidFlag::WNOHANG)) {
            Err(nix::Error::ECHILD) => return true,
            Ok(WaitStatus::StillAlive) | Err(_) => return false,
            Ok(_) => continue,
        }
    }
}

/// Reaps every child until `program` ends; returns how it ended.
fn reap_until(program: Pid) -> ProgramExit {
    // Without WNOHANG, waitpid never reports StillAlive: `reap` returns only with the program's end.
    reap(program, None).unwrap_or(ProgramExit::Signal(Signal::SIGKILL as i32))
}

/// Reaps children (`flags`: waiting for one or not) until `program` is reaped (`Some`), or none has ended (`None`).
fn reap(program: Pid, flags: Option<WaitPidFlag>) -> Option<ProgramExit> {
    loop {
        match waitpid(None, flags) {
            Ok(WaitStatus::Exited(pid, code)) if pid == program => {
                return Some(ProgramExit::Code(code))
            }
            Ok(WaitStatus::Signaled(pid, sig, _)) if pid == program => {
                return Some(ProgramExit::Signal(sig as i32))
            }
            Ok(WaitStatus::StillAlive) => return None,
            Ok(_) | Err(nix::Error::EINTR) => continue,
            // ECHILD: nothing left, which cannot happen before the program is reaped; report a kill.
            Err(_) => return Some(ProgramExit::Signal(Signal::SIGKILL as i32)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_records_round_trip() {
        for e in [
            ProgramExit::Code(0),
            ProgramExit::Code(137),
            ProgramExit::Signal(9),
        ] {
            assert_eq!(ProgramExit::decode(&e.encode()), Some(e));
        }
        assert_eq!(ProgramExit::decode(""), None);
        assert!(ended_alone(b"t reaped 5\nalone\nexit 0\n"));
        assert!(ended_alone(b"alone\nsignal 9\n"));
        assert!(!ended_alone(b"t reaped 5\nexit 0\n"), "others were left");
        assert!(
            !ended_alone(b"alone\nexit 0"),
            "the record is not whole yet"
        );
        assert!(!ended_alone(b"alone\n"));
        assert!(!ended_alone(b""));
        assert_eq!(ProgramExit::decode("exit x"), None);
        assert_eq!(ProgramExit::decode("boom 1"), None);
    }

    #[test]
    fn a_setup_failure_wins_over_the_exit_record() {
        let r = Report::decode("setup landlock: not enforced\nt exec 12\nexit 125\n");
        assert_eq!(r.marks, vec![("exec".to_owned(), 12)]);
        assert_eq!(r.setup_error.as_deref(), Some("landlock: not enforced"));
        assert_eq!(r.exit, Some(ProgramExit::Code(125)));
        assert_eq!(
            Report::decode("signal 9\n"),
            Report {
                setup_error: None,
                exit: Some(ProgramExit::Signal(9)),
                marks: Vec::new(),
            }
        );
    }
}

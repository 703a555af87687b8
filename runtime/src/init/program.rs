//! The init's forked program: its stdio, signal state and capabilities made ready, then `execve`; and the status
//! pipe's failure and timing lines the init and the program both write.

use std::ffi::CString;
use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd, RawFd};

use nix::sys::signal::{SigSet, SigmaskHow, Signal};
use nix::unistd::ForkResult;

use crate::error::{Chain, InitError};
use crate::sys;

/// Exit code of the child when `execve` of the program failed (as shells do).
pub const EXEC_FAILED: i32 = 127;
/// Exit code of the child when a restriction could not be applied (the status pipe says which).
pub const SETUP_FAILED: i32 = 125;

/// The forked child of [`start_program`]'s fallback: the launch's descriptors become its stdio, signal mask and
/// dispositions go back to the defaults, the capability sets are checked empty once more, and the program is
/// executed. Never returns.
fn run_program(
    status: BorrowedFd<'_>,
    stdio: [OwnedFd; 3],
    (program, args, env, cwd): Command<'_>,
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
    if let Some(dir) = cwd {
        if let Err(e) = nix::unistd::chdir(dir.as_c_str()) {
            let msg = format!(
                "sandboxd: cannot change to directory {}: {}\n",
                dir.to_string_lossy(),
                e.desc()
            );
            let _ = nix::unistd::write(std::io::stderr(), msg.as_bytes());
            // SAFETY: _exit ends the forked child without running the parent's atexit handlers or destructors.
            unsafe { libc::_exit(EXEC_FAILED) }
        }
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

/// Starts the program (or a warm interpreter) as a child of the init and returns its pid: spawned
/// ([`spawn_program`]), or forked ([`run_program`]) when no child could be spawned, so that a failure is reported as
/// a forked child reports it. The stdio is the child's alone afterwards (the init's copies are closed);
/// descriptors the program keeps must not be close-on-exec. `started` gets the spawned child's pid while the
/// init's signals are blocked.
pub(super) fn start_program(
    status: BorrowedFd<'_>,
    stdio: [OwnedFd; 3],
    command: Command<'_>,
    started: impl FnOnce(nix::unistd::Pid),
) -> Result<nix::unistd::Pid, InitError> {
    if let Ok(pid) = spawn_program(status, &stdio, command, started) {
        return Ok(pid);
    }
    // SAFETY: the init is single-threaded (cloned from the single-threaded helper), so the child may run
    // arbitrary code until it execs.
    match unsafe { nix::unistd::fork() }.map_err(|source| InitError::Sys {
        call: "fork",
        source,
    })? {
        ForkResult::Child => run_program(status, stdio, command),
        ForkResult::Parent { child } => Ok(child),
    }
}

/// What the child of [`spawn_program`] uses, all of it prepared before the clone: the child shares the init's
/// memory, so it only reads this and makes system calls.
struct Spawn {
    stdio: [RawFd; 3],
    status: RawFd,
    program: *const libc::c_char,
    argv: *const *const libc::c_char,
    envp: *const *const libc::c_char,
    /// The working directory, or null for the init's.
    cwd: *const libc::c_char,
    /// `sandboxd: cannot execute <program>: ` (the error's description and a newline follow).
    failed: Vec<u8>,
    /// `sandboxd: cannot change to directory <cwd>: ` (likewise).
    no_cwd: Vec<u8>,
}

/// What a child runs: the program, its arguments (the program first), its environment and its working directory
/// (the init's when `None`).
pub(super) type Command<'a> = (
    &'a CString,
    &'a [CString],
    &'a [CString],
    Option<&'a CString>,
);

/// Stack of the child of [`spawn_program`] (it calls nothing but system calls).
const SPAWN_STACK: usize = 32 << 10;

/// Starts the program as [`run_program`] in a forked child does, without the fork's cost: the child is cloned
/// with `CLONE_VM | CLONE_VFORK` (it shares the init's memory and runs on a stack of its own until its `execve`,
/// while the init waits), so the init's page tables are not copied nor its pages faulted in again (0.2-0.3 ms of a
/// shell `true`, and about 5 % of an execution's CPU). The child makes the launch's descriptors 0, 1 and 2, puts
/// every signal back to its default disposition (glibc's own two included, which `posix_spawn(3)` would leave
/// ignored) with an empty mask, and executes the program; when `execve` fails it says so on the program's stderr
/// and exits with [`EXEC_FAILED`], as the forked child does. The capability sets are the init's, checked empty
/// here. Written by hand because `posix_spawn` cannot reset glibc's signals and std's `Command` resets only
/// `SIGPIPE`. `started` gets the child's pid while every signal is still blocked in the init (so a stop signal
/// that arrived meanwhile finds the program to forward to). `Err`: no child was made (the caller forks instead).
fn spawn_program(
    status: BorrowedFd<'_>,
    stdio: &[OwnedFd; 3],
    (program, args, env, cwd): Command<'_>,
    started: impl FnOnce(nix::unistd::Pid),
) -> Result<nix::unistd::Pid, nix::Error> {
    crate::caps::ensure_none().map_err(|_| nix::Error::EPERM)?;
    let argv = null_terminated(args);
    let envp = null_terminated(env);
    let spawn = Spawn {
        stdio: [0, 1, 2].map(|i| stdio[i].as_raw_fd()),
        status: status.as_raw_fd(),
        program: program.as_ptr(),
        argv: argv.as_ptr(),
        envp: envp.as_ptr(),
        cwd: cwd.map_or(std::ptr::null(), |c| c.as_ptr()),
        failed: format!("sandboxd: cannot execute {}: ", program.to_string_lossy()).into_bytes(),
        no_cwd: format!(
            "sandboxd: cannot change to directory {}: ",
            cwd.map(|c| c.to_string_lossy()).unwrap_or_default()
        )
        .into_bytes(),
    };
    // Not zeroed: the child faults in only the pages it uses.
    let mut stack = Vec::<u8>::with_capacity(SPAWN_STACK);
    // SAFETY: the stack grows down from the end of the allocation, aligned to 16 bytes as the ABI asks; `stack`
    // outlives the child's use of it (CLONE_VFORK: clone returns once the child has executed or exited).
    let top = unsafe { stack.as_mut_ptr().add(SPAWN_STACK) };
    let top = (top as usize & !15) as *mut libc::c_void;
    // Every signal blocked across the clone (glibc's two included: its sigprocmask leaves them out), so no
    // handler of the init runs in the child on shared memory; the child unblocks them once their dispositions are
    // the defaults.
    let mut old = 0u64;
    set_mask(!0, Some(&mut old))?;
    // SAFETY: `spawned_child` only reads `spawn` (alive until clone returns, see above) and makes system calls;
    // with CLONE_VFORK the init is suspended until the child's execve or exit, so nothing else touches the shared
    // memory meanwhile.
    let pid = unsafe {
        libc::clone(
            spawned_child,
            top,
            libc::CLONE_VM | libc::CLONE_VFORK | libc::SIGCHLD,
            &spawn as *const Spawn as *mut libc::c_void,
        )
    };
    let cloned = nix::Error::result(pid).map(nix::unistd::Pid::from_raw);
    if let Ok(pid) = cloned {
        started(pid);
    }
    let _ = set_mask(old, None);
    drop((stack, argv, envp));
    cloned
}

/// Sets the calling thread's signal mask with the raw system call (every signal, glibc's own included); the old
/// one into `old`.
fn set_mask(mask: u64, old: Option<&mut u64>) -> Result<(), nix::Error> {
    let old = old.map_or(std::ptr::null_mut(), |o| o as *mut u64);
    // SAFETY: `mask` and `old` are kernel signal sets of the kernel's size (8 bytes); `old` is null or writable.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_rt_sigprocmask,
            libc::SIG_SETMASK,
            &mask as *const u64,
            old,
            8usize,
        )
    };
    nix::Error::result(rc).map(drop)
}

/// The child of [`spawn_program`]: system calls only (it runs on the init's memory).
extern "C" fn spawned_child(arg: *mut libc::c_void) -> libc::c_int {
    // SAFETY: `arg` is the `Spawn` that spawn_program keeps alive until this child has executed or exited.
    let spawn = unsafe { &*(arg as *const Spawn) };
    let write = |fd: RawFd, bytes: &[u8]| {
        // SAFETY: writes `bytes`, a live slice, to a descriptor; the result is not needed.
        unsafe { libc::write(fd, bytes.as_ptr().cast(), bytes.len()) };
    };
    // As `setup_failed`, without formatting: `setup <what>: <why>` on the status pipe, then exit.
    let give_up = |what: &[u8], why: nix::Error| -> ! {
        for part in [b"setup ", what, b": ", why.desc().as_bytes(), b"\n"] {
            write(spawn.status, part);
        }
        // SAFETY: _exit ends the child without touching the shared memory.
        unsafe { libc::_exit(SETUP_FAILED) }
    };
    for (target, &fd) in spawn.stdio.iter().enumerate() {
        // SAFETY: dup2 onto 0..=2 of this child (its descriptor table is its own: no CLONE_FILES).
        if unsafe { libc::dup2(fd, target as libc::c_int) } < 0 {
            give_up(b"dup2 of stdio", nix::Error::last());
        }
    }
    if let Err((_, e)) = sys::reset_all_signals() {
        give_up(b"rt_sigaction(SIG_DFL)", e);
    }
    if let Err(e) = set_mask(0, None) {
        give_up(b"rt_sigprocmask", e);
    }
    // SAFETY: `cwd` is null or a null-terminated string that outlives the call.
    if !spawn.cwd.is_null() && unsafe { libc::chdir(spawn.cwd) } < 0 {
        let why = nix::Error::last().desc();
        write(2, &spawn.no_cwd);
        write(2, why.as_bytes());
        write(2, b"\n");
        // SAFETY: _exit ends the child without touching the shared memory.
        unsafe { libc::_exit(EXEC_FAILED) }
    }
    // SAFETY: program, argv and envp point at null-terminated strings and arrays that outlive the call.
    unsafe { libc::execve(spawn.program, spawn.argv, spawn.envp) };
    let why = nix::Error::last().desc();
    write(2, &spawn.failed);
    write(2, why.as_bytes());
    write(2, b"\n");
    // SAFETY: as above.
    unsafe { libc::_exit(EXEC_FAILED) }
}

/// `v`'s pointers, then a null one (argv and envp for `execve`).
fn null_terminated(v: &[CString]) -> Vec<*const libc::c_char> {
    v.iter()
        .map(|s| s.as_ptr())
        .chain(std::iter::once(std::ptr::null()))
        .collect()
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

/// How the program ended, as the init reports it on the status pipe.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind", content = "value")]
pub enum ProgramExit {
    /// `exit(code)`.
    Code(i32),
    /// Killed by this signal number.
    Signal(i32),
}

impl ProgramExit {
    /// The record written on the status pipe: `exit N\n` or `signal N\n`.
    pub fn encode(self) -> String {
        match self {
            Self::Code(c) => format!("exit {c}\n"),
            Self::Signal(s) => format!("signal {s}\n"),
        }
    }

    /// `exit status N` or `killed by SIGX`.
    pub fn describe(self) -> String {
        match self {
            Self::Code(c) => format!("exit status {c}"),
            Self::Signal(s) => format!("killed by {}", signal_name(s)),
        }
    }

    /// Parses a record; anything else (empty: the init died before writing) is `None`.
    pub fn decode(record: &str) -> Option<Self> {
        let mut it = record.trim_end_matches('\n').splitn(2, ' ');
        let kind = it.next()?;
        let value: i32 = it.next()?.parse().ok()?;
        match kind {
            "exit" => Some(Self::Code(value)),
            "signal" => Some(Self::Signal(value)),
            _ => None,
        }
    }
}

/// `SIGKILL` for 9; `SIG<n>` for numbers nix has no name for.
pub fn signal_name(sig: i32) -> String {
    Signal::try_from(sig)
        .map(|s| s.as_str().to_owned())
        .unwrap_or_else(|_| format!("SIG{sig}"))
}

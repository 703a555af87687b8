//! The floor of a container per execution: the bare spawn's `sh main.sh` started with one more of a container's
//! layers at each step, and nothing else (no id maps, mounts, `pivot_root`, capabilities dropped, landlock, init,
//! pool or protocol):
//! - [`Step::Raw`]: cloned as `posix_spawn` clones (`CLONE_VM | CLONE_VFORK`, so the spawner's size does not count);
//! - [`Step::Namespaces`]: the first process of fresh user, mount, pid, ipc, uts and net namespaces, as the direct
//!   start's `clone3` makes them, which then unshares its cgroup namespace, as the container's init does;
//! - [`Step::Seccomp`]: there, the daemon's seccomp profile installed (its two filters chained), as the init installs it;
//! - [`Step::Cgroup`]: and a cgroup leaf, made with limits by `Cgroups::create_leaf` (the direct start's code),
//!   joined through each leaf's `cgroup.procs` and removed by `Cgroups::remove_leaf` (the helper's code).
//!
//! Each step's executions per second and the host's CPU per execution (`/proc/stat`, all CPUs, steal left out, the
//! kernel's deferred network namespace tear-down included) show what the layers alone cost on this kernel.

use std::ffi::CString;
use std::path::Path;
use std::time::Instant;

use runtime::cgroups::{CgroupLimits, Cgroups};

use super::{HostCpu, THROUGHPUT_RUNS};

/// One step of the floor.
#[derive(Clone, Copy, Debug)]
pub enum Step {
    Raw,
    Namespaces,
    Seccomp,
    Cgroup,
}

impl Step {
    pub const ALL: [Step; 4] = [Step::Raw, Step::Namespaces, Step::Seccomp, Step::Cgroup];

    pub fn name(self) -> &'static str {
        match self {
            Step::Raw => "raw",
            Step::Namespaces => "ns",
            Step::Seccomp => "ns+sc",
            Step::Cgroup => "ns+sc+cg",
        }
    }
}

/// The namespaces of the direct start's `clone3` (the init unshares the cgroup namespace itself).
const CLONE_NAMESPACES: libc::c_int = libc::CLONE_NEWUSER
    | libc::CLONE_NEWNS
    | libc::CLONE_NEWPID
    | libc::CLONE_NEWIPC
    | libc::CLONE_NEWUTS
    | libc::CLONE_NEWNET;

/// The limits the cgroup step writes: an execution's defaults.
const LIMITS: CgroupLimits = CgroupLimits {
    memory_bytes: 256 << 20,
    pids_max: 64,
    cpu_shares: 1024,
    cpu_quota: None,
};

/// The compiled seccomp profile and a cgroup parent of the bench's own (removed on drop).
pub struct Layers {
    cgroups: Cgroups,
    profile: runtime::seccomp::Profile,
}

impl Layers {
    /// Compiles the profile, then makes the parent; why not, when either cannot be had here.
    pub fn new() -> Result<Self, String> {
        let (profile_text, arch) = runtime::seccomp::native_profile().map_err(text)?;
        let profile = runtime::seccomp::compile(profile_text, arch).map_err(text)?;
        let parent = format!("sandboxd-bench-{}-floor", std::process::id());
        let cgroups =
            Cgroups::detect(Path::new(runtime::cgroups::DEFAULT_ROOT), &parent).map_err(text)?;
        cgroups.ensure_parent().map_err(text)?;
        Ok(Self { cgroups, profile })
    }

    /// The profile's program as `seccomp(2)` takes it (one: both filters chained, as the init installs it).
    /// seccompiler's `sock_filter` has the kernel's layout (`repr(C)`: u16, u8, u8, u32), as libc's does.
    fn filters(&self) -> Vec<libc::sock_fprog> {
        [&self.profile.program]
            .into_iter()
            .map(|prog| libc::sock_fprog {
                len: u16::try_from(prog.len()).expect("a filter of at most 65535 instructions"),
                filter: prog.as_ptr() as *mut libc::sock_filter,
            })
            .collect()
    }
}

impl Drop for Layers {
    fn drop(&mut self) {
        if let Err(e) = self.cgroups.remove_parent() {
            eprintln!("cannot remove the floor's cgroup parent: {e}");
        }
    }
}

/// What the child of [`spawn`] does before its `execve`, all prepared before the clone.
struct Child {
    path: *const libc::c_char,
    argv: [*const libc::c_char; 3],
    envp: [*const libc::c_char; 1],
    /// `cgroup.procs` of each leaf to join.
    join: Vec<CString>,
    cgroup_namespace: bool,
    filters: Vec<libc::sock_fprog>,
}

/// The child's exit codes for a failed step.
const FAILED_JOIN: i32 = 121;
const FAILED_UNSHARE: i32 = 122;
const FAILED_NO_NEW_PRIVS: i32 = 123;
const FAILED_SECCOMP: i32 = 124;
const FAILED_EXEC: i32 = 127;

extern "C" fn child(arg: *mut libc::c_void) -> libc::c_int {
    // SAFETY: `arg` is the `Child` that `spawn` passed, alive until this child's `execve` or `_exit` (the parent
    // sleeps until then, CLONE_VFORK). The child shares the parent's memory (CLONE_VM), so it allocates nothing,
    // takes no lock and only makes system calls (open, write, close, unshare, prctl, seccomp, execve, _exit) on
    // memory prepared before the clone: C strings and filters that outlive the call.
    unsafe {
        let c = &*(arg as *const Child);
        for procs in &c.join {
            let fd = libc::open(procs.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
            if fd < 0 || libc::write(fd, b"0".as_ptr().cast(), 1) != 1 {
                libc::_exit(FAILED_JOIN);
            }
            libc::close(fd);
        }
        if c.cgroup_namespace && libc::unshare(libc::CLONE_NEWCGROUP) != 0 {
            libc::_exit(FAILED_UNSHARE);
        }
        if !c.filters.is_empty() && libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 {
            libc::_exit(FAILED_NO_NEW_PRIVS);
        }
        for f in &c.filters {
            let rc = libc::syscall(
                libc::SYS_seccomp,
                libc::SECCOMP_SET_MODE_FILTER,
                0,
                f as *const libc::sock_fprog,
            );
            if rc != 0 {
                libc::_exit(FAILED_SECCOMP);
            }
        }
        libc::execve(c.path, c.argv.as_ptr(), c.envp.as_ptr());
        libc::_exit(FAILED_EXEC)
    }
}

/// Clones `child` with `flags` (plus `CLONE_VM | CLONE_VFORK`) on `stack` and waits for it; an error names what
/// failed.
fn spawn(flags: libc::c_int, c: &Child, stack: &mut [u128]) -> Result<(), String> {
    let top = stack.as_mut_ptr_range().end.cast::<libc::c_void>();
    // SAFETY: `top` is the 16-byte aligned end (u128 elements) of a stack the child uses until its execve or _exit,
    // while this thread sleeps (CLONE_VFORK); `child` only makes system calls on `c`, which outlives the call.
    let pid = unsafe {
        libc::clone(
            child,
            top,
            flags | libc::CLONE_VM | libc::CLONE_VFORK | libc::SIGCHLD,
            c as *const Child as *mut libc::c_void,
        )
    };
    if pid < 0 {
        return Err(format!("clone: {}", std::io::Error::last_os_error()));
    }
    let mut status = 0;
    // SAFETY: waits for the child just cloned; `status` is a valid int.
    if unsafe { libc::waitpid(pid, &mut status, 0) } != pid {
        return Err(format!("waitpid: {}", std::io::Error::last_os_error()));
    }
    match (libc::WIFEXITED(status), libc::WEXITSTATUS(status)) {
        (true, 0) => Ok(()),
        (true, FAILED_JOIN) => Err("joining the cgroup leaf failed".into()),
        (true, FAILED_UNSHARE) => Err("unshare(CLONE_NEWCGROUP) failed".into()),
        (true, FAILED_NO_NEW_PRIVS) => Err("PR_SET_NO_NEW_PRIVS failed".into()),
        (true, FAILED_SECCOMP) => Err("installing the seccomp filters failed".into()),
        _ => Err(format!("sh ended with status {status:#x}")),
    }
}

/// Executions per second of shell `true` at `conc` at once, started as `step` says, and the host's CPU ms per
/// execution.
pub fn throughput(
    conc: usize,
    tmp: &Path,
    step: Step,
    layers: &Layers,
) -> Result<(f64, f64), String> {
    let before = HostCpu::now();
    let t0 = Instant::now();
    let results: Vec<Result<(), String>> = std::thread::scope(|s| {
        let workers: Vec<_> = (0..conc)
            .map(|w| s.spawn(move || worker(w, conc, tmp, step, layers)))
            .collect();
        workers
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|_| Err("a worker panicked".into())))
            .collect()
    });
    let per_s = THROUGHPUT_RUNS as f64 / t0.elapsed().as_secs_f64();
    results.into_iter().collect::<Result<(), String>>()?;
    HostCpu::settle();
    let cpu_ms = HostCpu::now().busy_ms_since(&before) / THROUGHPUT_RUNS as f64;
    Ok((per_s, cpu_ms))
}

/// Worker `w` of `conc`: every `conc`-th of the runs.
fn worker(w: usize, conc: usize, tmp: &Path, step: Step, layers: &Layers) -> Result<(), String> {
    let dir = tmp.join(format!("w{w}"));
    std::fs::create_dir_all(&dir).map_err(text)?;
    let file = dir.join("main.sh");
    std::fs::write(&file, "true\n").map_err(text)?;
    let sh = c"/bin/sh";
    let path = CString::new(file.as_os_str().as_encoded_bytes()).map_err(text)?;
    let mut c = Child {
        path: sh.as_ptr(),
        argv: [sh.as_ptr(), path.as_ptr(), std::ptr::null()],
        envp: [std::ptr::null()],
        join: Vec::new(),
        cgroup_namespace: !matches!(step, Step::Raw),
        filters: match step {
            Step::Seccomp | Step::Cgroup => layers.filters(),
            Step::Raw | Step::Namespaces => Vec::new(),
        },
    };
    let flags = match step {
        Step::Raw => 0,
        Step::Namespaces | Step::Seccomp | Step::Cgroup => CLONE_NAMESPACES,
    };
    let mut stack = vec![0u128; 4096];
    for i in (w..THROUGHPUT_RUNS).step_by(conc) {
        match step {
            Step::Cgroup => {
                let id = format!("floor-{w}-{i}");
                let cg = &layers.cgroups;
                cg.create_leaf(&id, &LIMITS).map_err(text)?;
                // The leaf is removed whether the spawn worked or not.
                let spawned = procs_files(cg, &id).and_then(|join| {
                    c.join = join;
                    spawn(flags, &c, &mut stack)
                });
                cg.remove_leaf(&id).map_err(text)?;
                spawned?;
            }
            Step::Raw | Step::Namespaces | Step::Seccomp => spawn(flags, &c, &mut stack)?,
        }
    }
    Ok(())
}

/// The `cgroup.procs` file of each of execution `id`'s leaves, as the child opens them.
fn procs_files(cg: &Cgroups, id: &str) -> Result<Vec<CString>, String> {
    cg.joined_leaves(id)
        .map_err(text)?
        .iter()
        .map(|leaf| {
            CString::new(leaf.join("cgroup.procs").as_os_str().as_encoded_bytes()).map_err(text)
        })
        .collect()
}

/// An error as the table prints it.
fn text(e: impl std::fmt::Display) -> String {
    e.to_string()
}

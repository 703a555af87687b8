//! What the fake backend records and shares between its two kinds (tests only): every call ([`Call`]), the
//! scripted usage ([`Script`]), the recorder the test reads, and a program's process group ([`Program`]).

use std::sync::{Mutex, MutexGuard};

use nix::sys::signal::Signal;
use nix::unistd::Pid;
use std::time::Duration;

use runtime::cgroups::CgroupLimits;

/// One call into the backend, by container id.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Call {
    /// A container was created.
    Create(String),
    /// The request's cgroup limits were written (with the inputs).
    SetLimits(String, CgroupLimits),
    /// The program was launched.
    Launch(String),
    /// A signal was sent to the container.
    Kill(String, Signal),
    /// The container was removed.
    Remove(String),
    /// An agent sandbox's workspace was created.
    CreateWorkspace(String),
    /// An agent sandbox's workspace was removed.
    RemoveWorkspace(String),
    /// A run's container was frozen.
    Freeze(String),
    /// A run's container was thawed.
    Thaw(String),
    /// A run's container got a CPU quota (millicores).
    CpuQuota(String, u64),
}

/// What the fake containers created from now on report.
#[derive(Debug, Clone, Copy, Default)]
pub struct Script {
    /// The "kernel" OOM-kills the program this long after its launch.
    pub oom_after: Option<Duration>,
    /// Reported peak memory.
    pub peak_memory_bytes: u64,
    /// Reported CPU time.
    pub cpu_time_ns: u64,
}

/// The calls made so far and the script; shared by the backend, its containers and the test.
#[derive(Debug, Default)]
pub struct Recorder {
    calls: Mutex<Vec<Call>>,
    pub(super) script: Mutex<Script>,
}

pub(super) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Recorder {
    pub(super) fn record(&self, call: Call) {
        lock(&self.calls).push(call);
    }

    /// Every call so far, in order.
    pub fn calls(&self) -> Vec<Call> {
        lock(&self.calls).clone()
    }

    /// The calls about container `cid`.
    pub fn calls_of(&self, cid: &str) -> Vec<Call> {
        self.calls()
            .into_iter()
            .filter(|c| match c {
                Call::Create(id)
                | Call::SetLimits(id, _)
                | Call::Launch(id)
                | Call::Kill(id, _)
                | Call::Remove(id)
                | Call::CreateWorkspace(id)
                | Call::RemoveWorkspace(id)
                | Call::Freeze(id)
                | Call::Thaw(id)
                | Call::CpuQuota(id, _) => id == cid,
            })
            .collect()
    }

    /// Ids of the containers created so far.
    pub fn created(&self) -> Vec<String> {
        self.calls()
            .into_iter()
            .filter_map(|c| match c {
                Call::Create(id) => Some(id),
                _ => None,
            })
            .collect()
    }

    /// Sets the script of containers created from now on.
    pub fn script(&self, script: Script) {
        *lock(&self.script) = script;
    }
}

/// The program's process group while it runs.
#[derive(Debug, Default)]
pub(super) struct Program {
    /// Its process group (the child's pid); `None` before the launch and once it is reaped.
    pub(super) group: Option<Pid>,
}

impl Program {
    /// Starts tracking the process group led by `leader`.
    pub(super) fn start(leader: Pid) -> Self {
        Self {
            group: Some(leader),
        }
    }

    /// Signals the whole group, if it still runs: the lock is held from the check to the signal, and the reaper
    /// clears `group` under the same lock, so a reused pid is never signalled.
    pub(super) fn signal(&self, signal: Signal) {
        if let Some(group) = self.group {
            let _ = nix::sys::signal::killpg(group, signal);
        }
    }
}

/// A fake container's or run's "inside" listener: the fakes have no network namespace of their own, so it is on
/// the host at `address`'s IP, on a port the kernel picks (the requested one may be taken).
pub(super) fn loopback_listener(
    address: std::net::SocketAddr,
) -> std::io::Result<std::net::TcpListener> {
    let listener = std::net::TcpListener::bind((address.ip(), 0))?;
    listener.set_nonblocking(true)?;
    Ok(listener)
}

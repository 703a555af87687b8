//! What the facade needs from the daemon: live sandboxes that run many processes ([`Engine`], [`LiveSandbox`]).
//! The HTTP layer ([`crate::api`], [`crate::envd`]) speaks E2B's wire and calls these; the daemon's
//! implementation ([`crate::sandboxes`]) builds them on the agents' container seam. Unit tests use a fake.

use std::collections::BTreeMap;
use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use nix::sys::signal::Signal;
use tokio::sync::mpsc;

pub use containers::agent::BoxFuture;

/// Why a call on the engine failed.
#[derive(Debug, Clone, thiserror::Error)]
pub enum EngineError {
    /// No such sandbox (never was, killed, or expired).
    #[error("sandbox {0} was not found")]
    SandboxNotFound(String),
    /// No such process in the sandbox (never started, or ended).
    #[error("process with pid {0} not found")]
    ProcessNotFound(u32),
    /// The request asks for something the engine refuses (a field out of range, an unknown template).
    #[error("{0}")]
    Invalid(String),
    /// The sandbox is paused: it runs nothing until it is resumed (`connect`).
    #[error("sandbox {0} is paused")]
    Paused(String),
    /// The host is full (the sandbox limit).
    #[error("{0}")]
    Full(String),
    /// The process could not be started in the sandbox (the program is missing, the directory does not exist, the
    /// pids limit).
    #[error("{0}")]
    Start(String),
    /// Anything else: the host could not do it.
    #[error("{0}")]
    Internal(String),
}

/// What `POST /v2/sandboxes` asks for, checked by the HTTP layer.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct CreateSpec {
    /// The template (an image name; `base` is the default image).
    pub template: String,
    /// How long the sandbox lives before it is killed.
    pub timeout: Duration,
    /// The caller's metadata, returned by `get_info` and matched by `list`'s filter.
    pub metadata: BTreeMap<String, String>,
    /// Environment of every process of the sandbox (a process's own `envs` win).
    pub env_vars: BTreeMap<String, String>,
    /// Hosts the sandbox may reach through its egress proxy (`network.allowOut`, or `*` for
    /// `allow_internet_access: true` where the daemon's network allows it). Empty: no network.
    pub allow_out: Vec<String>,
}

/// A sandbox's state as E2B names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SandboxState {
    /// Running.
    Running,
    /// Frozen (`pause`): its processes run nothing until it is resumed.
    Paused,
}

/// What the facade reports about a sandbox.
#[derive(Debug, Clone, PartialEq)]
pub struct SandboxInfo {
    /// Its id (`sandboxID`).
    pub id: String,
    /// The template it was created from.
    pub template: String,
    /// The caller's metadata.
    pub metadata: BTreeMap<String, String>,
    /// When it was created.
    pub started_at: SystemTime,
    /// When it will be killed unless its timeout is changed.
    pub end_at: SystemTime,
    /// Running or paused.
    pub state: SandboxState,
    /// The token every sandbox-plane call must carry (`X-Access-Token`), and the key of signed `/files` URLs.
    pub access_token: String,
    /// CPU cores it may use.
    pub cpu_count: u32,
    /// Memory limit, MiB.
    pub memory_mb: u64,
    /// Disk limit, MiB.
    pub disk_mb: u64,
}

/// What a process runs (`process.ProcessConfig`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ProcessSpec {
    /// The program (a path, or a name looked up in `PATH`).
    pub cmd: String,
    /// Its arguments (without the program).
    pub args: Vec<String>,
    /// Its own environment, merged over the sandbox's `env_vars`.
    pub envs: BTreeMap<String, String>,
    /// Its working directory (absolute; the home `/home/user` when unset).
    pub cwd: Option<String>,
    /// Give it a stdin the caller can write to (`SendInput`, `CloseStdin`); otherwise `/dev/null`.
    pub stdin: bool,
    /// The caller's tag, shown by `List`.
    pub tag: Option<String>,
}

/// A running process as `List` shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcessInfo {
    /// Its pid inside the sandbox.
    pub pid: u32,
    /// What it runs.
    pub spec: ProcessSpec,
}

/// How a process ended (`process.ProcessEvent.EndEvent`, with Go's conventions as envd reports them).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcessEnd {
    /// The exit code; `-1` when a signal ended it.
    pub exit_code: i32,
    /// Whether it exited (rather than being killed by a signal).
    pub exited: bool,
    /// `exit status N` or `signal: killed`.
    pub status: String,
    /// Why it could not run, when it could not.
    pub error: Option<String>,
}

/// What a process's reader receives, in order: output as it is written, then its end (then nothing).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ProcessEvent {
    /// Bytes it wrote to stdout.
    Stdout(bytes::Bytes),
    /// Bytes it wrote to stderr.
    Stderr(bytes::Bytes),
    /// It ended; the channel closes after this.
    End(ProcessEnd),
}

/// A reader of one process: its pid, and its events from the moment of attaching. The process runs on when the
/// reader is dropped; a slow reader slows the process's output (the pipe fills), it never loses it.
#[derive(Debug)]
pub struct Attached {
    /// The process's pid inside the sandbox.
    pub pid: u32,
    /// Its events.
    pub events: mpsc::Receiver<ProcessEvent>,
}

/// The sandboxes of this host.
pub trait Engine: Send + Sync + 'static {
    /// Creates a sandbox and starts its container.
    fn create(&self, spec: CreateSpec) -> BoxFuture<'_, Result<SandboxInfo, EngineError>>;

    /// One sandbox, or `None`.
    fn get(&self, id: &str) -> Option<Arc<dyn LiveSandbox>>;

    /// Every sandbox (in creation order).
    fn list(&self) -> Vec<Arc<dyn LiveSandbox>>;

    /// Kills a sandbox and removes everything of it; `false` when there was none.
    fn kill<'a>(&'a self, id: &'a str) -> BoxFuture<'a, bool>;
}

/// One live sandbox: its processes and its files.
pub trait LiveSandbox: Send + Sync + 'static {
    /// What it is now.
    fn info(&self) -> SandboxInfo;

    /// Sets its end to `timeout` from now (shorter or longer).
    fn set_timeout(&self, timeout: Duration);

    /// Pauses it (the cgroup freezer); `Ok(false)` when it was paused already.
    fn pause(&self) -> BoxFuture<'_, Result<bool, EngineError>>;

    /// Resumes it if paused.
    fn resume(&self) -> BoxFuture<'_, Result<(), EngineError>>;

    /// Starts a process and attaches to it.
    fn start(&self, spec: ProcessSpec) -> BoxFuture<'_, Result<Attached, EngineError>>;

    /// Attaches one more reader to a running process.
    fn attach(&self, pid: u32) -> Result<Attached, EngineError>;

    /// Its running processes (started through [`Self::start`]).
    fn processes(&self) -> Vec<ProcessInfo>;

    /// Sends a signal to one of its processes (delivered when this resolves); `ProcessNotFound` when there is none
    /// with that pid.
    fn signal(&self, pid: u32, signal: Signal) -> BoxFuture<'_, Result<(), EngineError>>;

    /// Writes to a process's stdin (started with `stdin: true`).
    fn send_input<'a>(&'a self, pid: u32, data: &'a [u8])
        -> BoxFuture<'a, Result<(), EngineError>>;

    /// Closes a process's stdin.
    fn close_stdin(&self, pid: u32) -> Result<(), EngineError>;

    /// A directory descriptor of the sandbox's root as its processes see it (mounts included), for the file calls
    /// ([`crate::files`]): every path is resolved beneath it.
    fn root(&self) -> Result<OwnedFd, EngineError>;

    /// The host uid and gid files the daemon makes in the sandbox get (its processes' user).
    fn owner(&self) -> (u32, u32);

    /// Memory and CPU use now: (memory bytes, cpu time ns).
    fn usage(&self) -> Result<(u64, u64), EngineError>;
}

/// The home of the sandbox's user, and the directory relative paths resolve against.
pub const HOME: &str = "/home/user";

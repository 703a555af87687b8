//! The long-lived kind of container, what agent sandboxes run on: a [`Workspace`] (the sandbox's scratch space:
//! `/workspace` and `/tmp` on a tmpfs, the code directory `/sandbox`, the root) that outlives its runs, and in it
//! one [`RunContainer`] per agent run, created from a [`RunPlan`] and launched once with its stdio. Unlike an
//! execution's container, a run can be signalled (`SIGTERM`, `SIGINT` and `SIGHUP` are passed on to the agent by
//! the init; `SIGKILL` ends the whole container), frozen and thawed, given a hard CPU quota, and measured while it
//! runs.
//!
//! The agents crate drives these traits; both of the seam's backends implement them (the helper processes, and the
//! fake the agents' and the daemon's tests run on).

use std::future::Future;
use std::net::SocketAddr;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;

use nix::sys::signal::Signal;
use runtime::init::ProgramExit;
use runtime::rootfs::InputFile;

/// A boxed, sendable future.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// A long-lived container could not be created, launched or controlled.
#[derive(Debug, thiserror::Error)]
pub enum LongLivedError {
    /// The container (or its bundle) could not be created; nothing of it is left.
    #[error("Cannot create the container")]
    Create(#[source] Box<dyn std::error::Error + Send + Sync>),
    /// The init refused to run anything: a restriction could not be applied (fail closed). Its report's text.
    #[error("Sandbox setup failed: {0}")]
    Setup(String),
    /// The launch message could not be sent.
    #[error("Cannot launch the agent")]
    Launch(#[source] Box<dyn std::error::Error + Send + Sync>),
    /// The egress proxy's listener could not be created inside the container.
    #[error("Cannot listen for the egress proxy inside the container")]
    Listen(#[source] std::io::Error),
    /// A cgroup operation failed (`what`: freeze, thaw, the CPU quota, usage).
    #[error("Cannot {what}")]
    Cgroup {
        /// What was asked.
        what: &'static str,
        /// Why it failed.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
}

/// How a run's container ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ended {
    /// How the agent ended (`SIGKILL` when the init itself was killed and wrote nothing).
    pub exit: ProgramExit,
    /// What the init reported when it could not confine itself (the agent never ran).
    pub setup_error: Option<String>,
}

/// What a run's container uses now.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RunUsage {
    /// Memory charged to it, bytes.
    pub memory_bytes: u64,
    /// CPU time so far, ns.
    pub cpu_time_ns: u64,
}

/// What a run's container is created for. Its root, binds and landlock policy are the workspace's.
#[derive(Debug, Clone)]
pub struct RunPlan<'a> {
    /// Its id (the container's and the cgroup leaf's).
    pub cid: &'a str,
    /// The agent's command (absolute program path first).
    pub args: Vec<String>,
    /// The agent's environment, `KEY=value`.
    pub env: Vec<String>,
    /// Memory limit, MiB.
    pub memory_mb: u64,
    /// Processes and threads.
    pub pids_max: u64,
    /// Size of `/dev/shm`, bytes.
    pub shm_bytes: u64,
    /// The run outlives the daemon (live restore): its init holds the control socket for a later daemon, which
    /// adopts it ([`Workspace::adopt_run`]).
    pub keep: bool,
    /// `/workspace` is mounted at this path too (an E2B sandbox's home, `/home/user`).
    pub home: Option<&'a str>,
}

/// Which process a kept run's init is: its pid and its start time (`/proc/<pid>/stat`, clock ticks since boot),
/// so a recycled pid is never taken for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct InitIdentity {
    /// Host pid.
    pub pid: i32,
    /// Start time, clock ticks after boot.
    pub start: u64,
}

/// A run taken back from a previous daemon, and what its init held.
pub type AdoptedRun = (Arc<dyn RunContainer>, Adopted);

/// A kept serving run taken back, and a copy of the daemon's end of its channel.
pub type AdoptedServingRun = (Arc<dyn RunContainer>, OwnedFd);

/// What an adopted run's init held for the daemon.
#[derive(Debug)]
pub struct Adopted {
    /// The control socket's listener.
    pub control: OwnedFd,
    /// The agent's control connection, if it had connected.
    pub conn: Option<OwnedFd>,
}

/// An agent sandbox's workspace.
pub trait Workspace: Send + Sync + 'static {
    /// Its directory on the host: `code/` is `/sandbox` inside (the control socket goes there, read-only to the
    /// agent); other files there (the agent's log, the event log) are out of the agent's reach.
    fn dir(&self) -> &Path;

    /// `/workspace` as the host sees it.
    fn workspace(&self) -> PathBuf;

    /// The host uid that is root in its containers (the control socket's owner).
    fn host_id(&self) -> u32;

    /// Where the daemon writes into `/workspace` (mount points, files) and the owner it gives what it makes there:
    /// [`Self::workspace`] and [`Self::host_id`], except for a workspace of the copy-on-write store, which is
    /// written directly (owner 0 on disk, shown as the sandbox's root).
    fn host_workspace(&self) -> (PathBuf, u32) {
        (self.workspace(), self.host_id())
    }

    /// The upper layer of its root (an image's overlay) as the host sees it: what its runs wrote outside
    /// `/workspace` and `/tmp`. `None` when its root is the shared read-only host image.
    fn root_upper(&self) -> Option<PathBuf>;

    /// Writes `code/<name>` (read-only to the agent) and the input files into `/workspace` (blocking work). A file
    /// the request got wrong is [`runtime::Error::InputFile`].
    fn write_inputs(&self, name: &str, content: &[u8], files: &[InputFile]) -> runtime::Result<()>;

    /// Creates a run's container; its init waits for [`RunContainer::launch`]. On failure nothing of it is left.
    fn create_run<'a>(
        &'a self,
        plan: RunPlan<'a>,
    ) -> BoxFuture<'a, Result<Arc<dyn RunContainer>, LongLivedError>>;

    /// Takes back a kept serving run ([`RunContainer::serve`] on a [`RunPlan::keep`] run) whose init is `init`,
    /// from a daemon that is gone, with a copy of the daemon's end of its channel (for
    /// [`runtime::processes::Processes::adopt`]).
    fn adopt_serving_run<'a>(
        &'a self,
        cid: &'a str,
        init: InitIdentity,
    ) -> BoxFuture<'a, Result<AdoptedServingRun, LongLivedError>> {
        let _ = (cid, init);
        Box::pin(async {
            Err(LongLivedError::Create(
                "serving runs cannot be adopted on this backend".into(),
            ))
        })
    }

    /// Removes the workspace (its runs must be removed first). Idempotent; errors are logged.
    fn remove(&self) -> BoxFuture<'_, ()>;

    /// Leaves the workspace as it is for a later daemon (live restore at the daemon's exit): nothing of it is
    /// removed when it is dropped.
    fn leave(&self) {}

    /// Takes back a kept run (see [`RunPlan::keep`]) whose init is `init`, from a daemon that is gone.
    fn adopt_run<'a>(
        &'a self,
        cid: &'a str,
        init: InitIdentity,
    ) -> BoxFuture<'a, Result<AdoptedRun, LongLivedError>> {
        let _ = (cid, init);
        Box::pin(async {
            Err(LongLivedError::Create(
                "runs cannot be adopted on this backend".into(),
            ))
        })
    }
}

/// One run's container.
pub trait RunContainer: Send + Sync + 'static {
    /// Its id.
    fn cid(&self) -> &str;

    /// Launches the agent with its stdin, stdout and stderr (the init holds its own copies after). A kept run
    /// ([`RunPlan::keep`]) gets the control socket's listener too, which its init holds for a later daemon.
    fn launch(
        &self,
        stdio: [BorrowedFd<'_>; 3],
        control: Option<BorrowedFd<'_>>,
    ) -> Result<(), LongLivedError>;

    /// Launches no program but turns the run's init into a process server ([`runtime::init::serve`]): each
    /// [`runtime::processes::Processes::start`] starts one more program in the container, all of them in its one
    /// pid namespace, with its limits and confinement. Instead of [`Self::launch`]. A kept run's init holds the
    /// channel for a later daemon ([`Workspace::adopt_serving_run`]).
    fn serve(&self) -> Result<runtime::processes::Processes, LongLivedError> {
        Err(LongLivedError::Launch(
            "this backend cannot serve processes".into(),
        ))
    }

    /// A directory descriptor of the container's root as its processes see it (`/proc/<init>/root`, its mounts
    /// included), for file calls resolved beneath it.
    fn root_dir(&self) -> std::io::Result<OwnedFd> {
        Err(std::io::Error::from(std::io::ErrorKind::Unsupported))
    }

    /// A copy of descriptor `fd` of the run's init (`pidfd_getfd`): what a kept serving init holds of its programs.
    fn init_fd(&self, fd: i32) -> std::io::Result<OwnedFd> {
        let _ = fd;
        Err(std::io::Error::from(std::io::ErrorKind::Unsupported))
    }

    /// A kept run's init holds the agent's control connection from now on (for a later daemon). A run that is
    /// not kept ignores it.
    fn hold(&self, conn: BorrowedFd<'_>) -> Result<(), LongLivedError> {
        let _ = conn;
        Ok(())
    }

    /// A kept run's init (`None` for a run that is not kept).
    fn init(&self) -> Option<InitIdentity> {
        None
    }

    /// Sends `signal` to the container's init: `SIGKILL` ends the whole container, `SIGTERM`, `SIGINT` and
    /// `SIGHUP` are passed on to the agent. Errors are logged (it may be gone already).
    fn signal(&self, signal: Signal);

    /// Freezes every process of the container (and waits until the kernel reports it frozen).
    fn freeze(&self) -> BoxFuture<'static, Result<(), LongLivedError>>;

    /// Thaws a frozen container.
    fn thaw(&self) -> BoxFuture<'static, Result<(), LongLivedError>>;

    /// Sets a hard CPU quota of `cores`.
    fn set_cpu_quota(&self, cores: f64) -> Result<(), LongLivedError>;

    /// Memory and CPU time now.
    fn usage(&self) -> Result<RunUsage, LongLivedError>;

    /// A listener on `address` inside the container's network namespace, accepted by the daemon (the entrance of
    /// the sandbox's egress proxy: the agent connects to it on its own loopback). Called before the launch.
    fn listen_inside(&self, address: SocketAddr) -> std::io::Result<std::net::TcpListener>;

    /// Resolves once the container has ended (nothing of the agent can still run then). Cancel-safe, and may be
    /// called again after it resolved.
    fn ended(&self) -> BoxFuture<'_, Ended>;

    /// Kills the container if it still runs and removes it. Errors are logged.
    fn remove(&self) -> BoxFuture<'_, ()>;
}

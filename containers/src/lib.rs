//! The container seam: everything between sandboxd's logic (its engine, pool and agent sandboxes) and the
//! containers it runs, in one place.
//!
//! Two kinds of container, as two traits:
//! - an execution's ([`ContainerBackend`] creates one; a [`ContainerHandle`] is one created container whose init
//!   waits for its program): the engine writes the request's limits and inputs into it, launches the program with
//!   its stdio, learns of the end, kills it, reads its usage, and hands it back for removal;
//! - the long-lived kind agent sandboxes use ([`agent`]): a workspace that outlives its runs, and in it one
//!   container per run, launched with a command and its stdio, signalled, frozen and thawed, given a CPU quota,
//!   measured, waited for and removed.
//!
//! Two backends implement both:
//! - [`helper`], what the daemon runs on: the helper processes ([`runtime::helper`]), the launch channel
//!   ([`runtime::launch`]), the init's pidfd and status pipe and the cgroups ([`runtime::cgroups`]), with one
//!   bundle builder for both kinds;
//! - `fake` (feature `fake`, for tests): programs run as plain child processes and every call is recorded, so the
//!   engine's timeout, cancel, output-limit, OOM and client-gone paths and the agent sandboxes' lifecycle are tested
//!   without root.
//!
//! What a container's root is built from, and how a language runs on it, is [`image`].
//!
//! Creation and removal are boxed futures (trait objects, one allocation per container, next to milliseconds of
//! work); the per-execution calls are plain methods, except [`ContainerHandle::prepare`], whose boxed future
//! replaces the clones the blocking task needed before.

pub mod agent;
mod executions;
pub mod helper;
pub mod image;
mod runs;

#[cfg(feature = "fake")]
pub mod fake;
#[cfg(feature = "fake")]
mod fake_record;
#[cfg(feature = "fake")]
mod fake_runs;

use std::os::fd::BorrowedFd;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use nix::sys::signal::Signal;
use protocol::Limits;
use runtime::cgroups::{CgroupLimits, Usage};
use runtime::launch::Launch;
use runtime::rootfs::InputFile;
use tokio::sync::oneshot;

use crate::agent::{InitIdentity, Workspace};
use crate::image::{LanguageRuntime, RootImage};

/// A boxed, sendable future (what the backend's asynchronous calls return).
pub use crate::agent::BoxFuture;

/// What a container is created for.
#[derive(Debug, Clone, Copy)]
pub struct Plan<'a> {
    /// Its id (the container's, the cgroup leaf's, the scratch directory's name).
    pub cid: &'a str,
    /// Host uid of container root.
    pub host_id: u32,
    /// Language: image and interpreter.
    pub lang: &'a LanguageRuntime,
    /// Scratch space (tmpfs, `/dev/shm`, `RLIMIT_FSIZE`).
    pub disk_mb: u64,
    /// Limits written into its cgroup at creation (lowered to the request's at launch).
    pub limits: &'a Limits,
    /// Its init starts the language's warm interpreter (the daemon's warm interpreter) ahead of the launch.
    pub warm: bool,
    /// Volumes bound under `/workspace` (extension `volumes`).
    pub volumes: &'a [VolumeBind],
    /// A snapshot's layer `/workspace` starts from (extension `snapshots`; see
    /// [`runtime::rootfs::Scratch::workspace_from`]).
    pub snapshot: Option<&'a Path>,
}

/// A volume bound into an execution's container: its filesystem on the host, shown with the container's
/// idmapping (owner 0 on disk is the container's root).
#[derive(Debug, Clone)]
pub struct VolumeBind {
    /// The volume's filesystem on the host.
    pub source: PathBuf,
    /// Where, relative to `/workspace`.
    pub rel: String,
    /// Mounted read-only.
    pub read_only: bool,
}

/// What an agent sandbox's workspace is created for: the long-lived kind of container ([`crate::agent`]).
#[derive(Debug, Clone, Copy)]
pub struct WorkspacePlan<'a> {
    /// Its id (the directory's name under `parent`).
    pub id: &'a str,
    /// The directory the workspace is created in.
    pub parent: &'a Path,
    /// Host uid of container root (owner of the workspace).
    pub host_id: u32,
    /// The image its runs start on.
    pub image: &'a Arc<RootImage>,
    /// Size of `/workspace` and `/tmp` (tmpfs) and `RLIMIT_FSIZE`, MiB.
    pub disk_mb: u64,
    /// A snapshot's layer `/workspace` starts from (an overlay's lower layer; see
    /// [`runtime::rootfs::Scratch::workspace_from`]).
    pub snapshot: Option<&'a Path>,
    /// A workspace of the copy-on-write store that is `/workspace` (see
    /// [`runtime::rootfs::Scratch::workspace_on`]; not with `snapshot`).
    pub subvolume: Option<&'a Path>,
    /// A snapshot's root layer the overlay root's upper layer starts as a copy of (see
    /// [`runtime::rootfs::RootSource::Overlay`]); only with an image's root.
    pub root_layer: Option<&'a Path>,
}

/// How the init reported the end: its status record (empty when it died without writing) and the
/// `CLOCK_MONOTONIC` time the end was seen.
pub type EndRecord = (String, u64);

/// A container could not be created. Nothing of it is left.
#[derive(Debug, thiserror::Error)]
pub enum CreateError {
    /// The scratch space or the bundle could not be made.
    #[error(transparent)]
    Prepare(runtime::Error),
    /// The bundle's `config.json` could not be written.
    #[error("Cannot write {}", path.display())]
    Bundle {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// The blocking preparation task did not finish.
    #[error("Preparation panicked")]
    Panicked(#[source] tokio::task::JoinError),
    /// The helper failed to create or start the container.
    #[error(transparent)]
    Helper(runtime::Error),
    /// No helper process is there to create it.
    #[error("No container helper is running")]
    NoHelper,
}

/// Writing the request's limits and inputs failed.
#[derive(Debug, thiserror::Error)]
pub enum PrepareError {
    /// The blocking task did not finish.
    #[error("Preparation panicked")]
    Panicked(#[source] tokio::task::JoinError),
    /// A write failed (an input file the request got wrong is [`runtime::Error::InputFile`]).
    #[error(transparent)]
    Failed(runtime::Error),
}

/// Sending the program to the init failed.
#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    /// The init refused to run anything: a restriction could not be applied (fail closed). Its report's text.
    #[error("Sandbox setup failed: {0}")]
    Setup(String),
    /// The launch message could not be sent.
    #[error("Cannot launch the program")]
    Send(#[source] runtime::Error),
}

/// Creates containers.
pub trait ContainerBackend: Send + Sync + 'static {
    /// Creates a container whose init waits for its launch. On failure nothing of it is left.
    fn create<'a>(
        &'a self,
        plan: Plan<'a>,
    ) -> BoxFuture<'a, Result<Box<dyn ContainerHandle>, CreateError>>;

    /// Creates an agent sandbox's workspace, in which long-lived containers are created one run at a time. On
    /// failure nothing of it is left.
    fn create_workspace<'a>(
        &'a self,
        plan: WorkspacePlan<'a>,
    ) -> BoxFuture<'a, Result<Arc<dyn Workspace>, CreateError>>;

    /// Takes back an agent sandbox's workspace that a previous daemon left mounted at `plan.parent/plan.id`
    /// (live restore); nothing is created. The backends that cannot say so.
    fn adopt_workspace<'a>(
        &'a self,
        plan: WorkspacePlan<'a>,
    ) -> BoxFuture<'a, Result<Arc<dyn Workspace>, CreateError>> {
        let _ = plan;
        Box::pin(async { Err(CreateError::NoHelper) })
    }

    /// Ends a kept run of a previous daemon that is not taken back: its init killed if it is still `init`, its
    /// cgroups (thawed) removed. A backend without kept runs has none to end.
    fn end_kept_run<'a>(&'a self, cid: &'a str, init: InitIdentity) -> BoxFuture<'a, ()> {
        let _ = (cid, init);
        Box::pin(async {})
    }

    /// How many creations are worth running at once (with the helpers: how many there are).
    fn parallelism(&self) -> usize;

    /// False once containers can no longer be created or removed (a helper process died).
    fn alive(&self) -> bool;

    /// Resolves once [`Self::alive`] is false (the daemon then shuts down); never while it is true.
    fn gone(&self) -> BoxFuture<'_, ()>;

    /// Removes every container and stops whatever creates them (daemon shutdown).
    fn shutdown(&self) -> BoxFuture<'_, ()>;
}

/// One created container, used for one execution.
pub trait ContainerHandle: Send + Sync + 'static {
    /// The scratch directory on the host (the tool broker's socket goes in its `code/`).
    fn dir(&self) -> &Path;

    /// The program's working directory as the host sees it (artifacts are collected from it).
    fn workspace(&self) -> PathBuf;

    /// Writes the request's cgroup limits, then the code file and the input files (blocking work, off the async
    /// threads).
    fn prepare(
        &self,
        limits: CgroupLimits,
        code_name: &'static str,
        code: Vec<u8>,
        files: Vec<InputFile>,
    ) -> BoxFuture<'static, Result<(), PrepareError>>;

    /// Sends the program to the init with its stdin, stdout and stderr (the init holds its own copies after).
    fn launch(&self, launch: &Launch, stdio: [BorrowedFd<'_>; 3]) -> Result<(), LaunchError>;

    /// Resolves once the container has ended: nothing of the program can still run or write then.
    fn watch_end(&self) -> std::io::Result<oneshot::Receiver<EndRecord>>;

    /// Sends `signal` to the container's init (errors are logged: it may be gone already).
    fn kill(&self, signal: Signal);

    /// Peak memory, CPU time and OOM kills so far.
    fn usage(&self) -> runtime::Result<Usage>;

    /// A listener on `address` inside the container's network namespace, accepted by the daemon (the egress
    /// proxy's entrance: programs connect to it on their own loopback).
    fn listen_inside(
        &self,
        address: std::net::SocketAddr,
    ) -> std::io::Result<std::net::TcpListener>;

    /// Kills, deletes and reaps the container and removes its scratch space. Errors are logged: there is nobody
    /// left to tell.
    fn remove(self: Box<Self>) -> BoxFuture<'static, ()>;
}

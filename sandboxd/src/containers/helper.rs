//! The real backend: containers created and removed by the helper processes ([`runtime::helper`]), launched over
//! their launch channel ([`runtime::launch`]), watched and killed through the init's pidfd, limited and measured
//! through their cgroups ([`runtime::cgroups`]).

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use nix::sys::signal::Signal;
use runtime::cgroups::{CgroupLimits, Cgroups, Usage};
use runtime::helper::{Created, HelperClient};
use runtime::init::Report;
use runtime::launch::Launch;
use runtime::rootfs::{InputFile, RootSource, Scratch, CODE_DIR, WORKDIR};
use runtime::spec::ContainerPlan;
use tokio::io::AsyncReadExt;
use tokio::sync::oneshot;
use tracing::{debug, error, warn};

use super::{
    BoxFuture, ContainerBackend, ContainerHandle, CreateError, EndRecord, LaunchError, Plan,
    PrepareError, WorkspacePlan,
};
use crate::images::{RootImage, RootKind};
use agents::container::Workspace;
use runtime::error::Chain;

/// The helper processes. Containers are spread over them round-robin, so creations and removals run in parallel
/// (each helper is single-threaded, and a creation is mostly CPU work in it); a container is removed by the helper
/// that created it (its init is that helper's child).
pub struct Helpers {
    all: Vec<HelperClient>,
    primary: HelperClient,
    next: AtomicUsize,
}

impl Helpers {
    /// Over `first` and `rest`.
    pub fn new(first: HelperClient, rest: Vec<HelperClient>) -> Self {
        let mut all = vec![first.clone()];
        all.extend(rest);
        Self {
            all,
            primary: first,
            next: AtomicUsize::new(0),
        }
    }

    /// The first helper: the long-lived containers of agent runs live there (they are few).
    pub(super) fn primary(&self) -> &HelperClient {
        &self.primary
    }

    pub(super) fn pick(&self) -> usize {
        self.next.fetch_add(1, Ordering::Relaxed) % self.all.len().max(1)
    }

    pub(super) fn get(&self, i: usize) -> Option<&HelperClient> {
        self.all.get(i)
    }

    /// How many there are.
    pub fn len(&self) -> usize {
        self.all.len()
    }

    /// True while every helper runs (one gone means its containers are gone: the daemon is unhealthy).
    pub fn all_alive(&self) -> bool {
        !self.all.is_empty() && self.all.iter().all(HelperClient::is_alive)
    }

    /// Asks every helper to remove its containers and exit.
    pub async fn shutdown(&self) {
        for h in &self.all {
            let _ = h.shutdown().await;
        }
    }
}

/// Containers through the helper processes.
pub struct HelperBackend {
    /// The helper processes.
    pub helpers: Arc<Helpers>,
    /// Cgroup setup.
    pub cgroups: Cgroups,
    /// Per-execution state directory.
    pub run_dir: PathBuf,
    /// `RLIMIT_NOFILE` of programs.
    pub nofile: u64,
}

/// What differs between the bundles of an execution's container and of an agent run's.
pub(super) struct Bundle<'a> {
    pub cid: &'a str,
    pub host_id: u32,
    pub image: &'a RootImage,
    pub scratch: &'a Scratch,
    pub args: Vec<String>,
    pub env: Vec<String>,
    pub memory_bytes: u64,
    pub pids_max: u64,
    pub cpu_shares: u64,
    pub fsize_bytes: u64,
    pub shm_bytes: u64,
}

impl HelperBackend {
    /// The one bundle builder: the container plan of `b` (root and binds from its image and scratch space) saved
    /// as `<scratch>/config.json`.
    pub(super) fn write_bundle(&self, b: Bundle<'_>) -> Result<(), CreateError> {
        let (rootfs, readonly_root, mut binds) = match &b.image.kind {
            RootKind::Host(host) => (host.rootfs.clone(), true, host.binds.clone()),
            RootKind::Oci { .. } => (b.scratch.rootfs(), false, Vec::new()),
        };
        binds.extend(b.scratch.binds());
        let plan = ContainerPlan {
            rootfs,
            readonly_root,
            hostname: "sandbox".into(),
            args: b.args,
            env: b.env,
            cwd: WORKDIR.into(),
            binds,
            host_id: b.host_id,
            cgroups_path: self.cgroups.cgroups_path(b.cid),
            memory_bytes: b.memory_bytes as i64,
            pids_max: b.pids_max as i64,
            cpu_shares: b.cpu_shares,
            nofile: self.nofile,
            fsize_bytes: b.fsize_bytes,
            shm_bytes: b.shm_bytes,
        };
        let spec = runtime::spec::build(&plan).map_err(CreateError::Prepare)?;
        let path = b.scratch.dir().join("config.json");
        spec.save(&path).map_err(|e| CreateError::Bundle {
            path,
            source: Box::new(e),
        })
    }

    /// Scratch space and the bundle's `config.json` (the program itself comes with the launch message).
    fn prepare(&self, plan: &Plan<'_>) -> Result<Scratch, CreateError> {
        let Plan {
            cid,
            host_id,
            lang,
            disk_mb,
            limits,
        } = *plan;
        let disk_bytes = disk_mb << 20;
        let scratch = create_scratch(&self.run_dir, cid, disk_bytes, host_id, &lang.image)?;
        let mut args = lang.command.clone();
        args.push(format!("{CODE_DIR}/{}", lang.file_name));
        self.write_bundle(Bundle {
            cid,
            host_id,
            image: &lang.image,
            scratch: &scratch,
            args,
            env: Vec::new(),
            memory_bytes: limits.memory_mb << 20,
            pids_max: limits.pids_max,
            cpu_shares: limits.cpu_shares,
            fsize_bytes: disk_bytes,
            shm_bytes: disk_bytes,
        })?;
        Ok(scratch)
    }
}

/// `<parent>/<id>/` with its tmpfs of `disk_bytes`, and the overlay root for an OCI image.
pub(super) fn create_scratch(
    parent: &Path,
    id: &str,
    disk_bytes: u64,
    host_id: u32,
    image: &RootImage,
) -> Result<Scratch, CreateError> {
    let root = match &image.kind {
        RootKind::Host(_) => RootSource::Shared,
        RootKind::Oci { lowers } => RootSource::Overlay(lowers),
    };
    Scratch::create(parent, id, disk_bytes, host_id, root).map_err(CreateError::Prepare)
}

impl ContainerBackend for Arc<HelperBackend> {
    fn create<'a>(
        &'a self,
        plan: Plan<'a>,
    ) -> BoxFuture<'a, Result<Box<dyn ContainerHandle>, CreateError>> {
        Box::pin(async move {
            let this = self.clone();
            let owned = (plan.cid.to_owned(), plan.lang.clone(), *plan.limits);
            let (host_id, disk_mb) = (plan.host_id, plan.disk_mb);
            let prepared = tokio::task::spawn_blocking(move || {
                let (cid, lang, limits) = owned;
                this.prepare(&Plan {
                    cid: &cid,
                    host_id,
                    lang: &lang,
                    disk_mb,
                    limits: &limits,
                })
            })
            .await
            .map_err(CreateError::Panicked);
            let scratch = prepared.and_then(|r| r)?;
            let Some(client) = self.helpers.get(self.helpers.pick()).cloned() else {
                remove_scratch(scratch).await;
                return Err(CreateError::NoHelper);
            };
            match client
                .create(
                    plan.cid,
                    scratch.dir().to_owned(),
                    plan.lang.image.landlock.clone(),
                )
                .await
            {
                Ok(created) => Ok(Box::new(HelperContainer {
                    cid: plan.cid.to_owned(),
                    client,
                    cgroups: self.cgroups.clone(),
                    scratch,
                    created,
                }) as Box<dyn ContainerHandle>),
                Err(e) => {
                    // The helper removed whatever it created; the scratch space is ours.
                    remove_scratch(scratch).await;
                    Err(CreateError::Helper(e))
                }
            }
        })
    }

    fn create_workspace<'a>(
        &'a self,
        plan: WorkspacePlan<'a>,
    ) -> BoxFuture<'a, Result<Arc<dyn Workspace>, CreateError>> {
        Box::pin(super::runs::create_workspace(self.clone(), plan))
    }

    fn parallelism(&self) -> usize {
        // Each helper is single-threaded: one creation at a time in each.
        self.helpers.len().max(1)
    }

    fn alive(&self) -> bool {
        self.helpers.all_alive()
    }

    fn shutdown(&self) -> BoxFuture<'_, ()> {
        Box::pin(self.helpers.shutdown())
    }
}

/// A container created by a helper.
struct HelperContainer {
    cid: String,
    /// The helper that created it, which removes it (its init is that helper's child).
    client: HelperClient,
    cgroups: Cgroups,
    /// The scratch space (working directory, `/tmp`, code directory, overlay root).
    scratch: Scratch,
    /// The daemon's descriptors: launch channel, status pipe, pidfd.
    created: Created,
}

impl ContainerHandle for HelperContainer {
    fn dir(&self) -> &Path {
        self.scratch.dir()
    }

    fn workspace(&self) -> PathBuf {
        self.scratch.workspace()
    }

    fn prepare(
        &self,
        limits: CgroupLimits,
        code_name: &'static str,
        code: Vec<u8>,
        files: Vec<InputFile>,
    ) -> BoxFuture<'static, Result<(), PrepareError>> {
        let inputs = self.scratch.inputs();
        let (cgroups, cid) = (self.cgroups.clone(), self.cid.clone());
        Box::pin(async move {
            tokio::task::spawn_blocking(move || {
                cgroups.set_limits(&cid, &limits)?;
                inputs.write(code_name, &code, &files)
            })
            .await
            .map_err(PrepareError::Panicked)?
            .map_err(PrepareError::Failed)
        })
    }

    fn launch(&self, launch: &Launch, stdio: [BorrowedFd<'_>; 3]) -> Result<(), LaunchError> {
        runtime::launch::send(self.created.launch.as_fd(), launch, stdio).map_err(|e| {
            match setup_error(&self.created.status) {
                Some(setup) => LaunchError::Setup(setup),
                None => LaunchError::Send(e),
            }
        })
    }

    fn watch_end(&self) -> std::io::Result<oneshot::Receiver<EndRecord>> {
        watch_end(&self.created.pidfd, &self.created.status)
    }

    fn kill(&self, signal: Signal) {
        if let Err(e) = runtime::sys::pidfd_send_signal(self.created.pidfd.as_fd(), signal) {
            debug!(error = %e, "kill of the container's init failed (already gone?)");
        }
    }

    fn usage(&self) -> runtime::Result<Usage> {
        self.cgroups.usage(&self.cid)
    }

    fn remove(self: Box<Self>) -> BoxFuture<'static, ()> {
        Box::pin(async move {
            let HelperContainer {
                cid,
                client,
                scratch,
                created,
                ..
            } = *self;
            // Closing the launch channel ends an init that never got a program.
            drop(created);
            match client.remove(&cid).await {
                Ok(None) => {}
                Ok(Some(step)) => {
                    error!(container = %cid, error = %step, "container removal reported an error")
                }
                Err(e) => error!(container = %cid, error = %Chain(&e), "container not removed"),
            }
            remove_scratch(scratch).await;
        })
    }
}

pub(super) async fn remove_scratch(mut scratch: Scratch) {
    match tokio::task::spawn_blocking(move || scratch.remove()).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => error!(error = %Chain(&e), "scratch cleanup failed"),
        Err(e) => error!(error = %e, "scratch cleanup panicked"),
    }
}

/// Waits in a task of its own until the container's init has ended, then reads its status pipe. The end is the
/// pidfd turning readable, which the kernel signals only once the init is a zombie, that is after every other
/// process of its pid namespace is gone too: when the result is computed (usage, artifacts), nothing of the
/// program can still run or write. The receiver gets the record (empty when the init died without writing) and
/// the `CLOCK_MONOTONIC` time of the end.
fn watch_end(pidfd: &OwnedFd, status: &OwnedFd) -> std::io::Result<oneshot::Receiver<EndRecord>> {
    let pidfd = pidfd.try_clone()?;
    // SAFETY: the OwnedFd moves into the AsyncFd, which keeps it open and unchanged for its whole lifetime.
    let pidfd = unsafe {
        tokio::io::unix::AsyncFd::register_with_interest(pidfd, tokio::io::Interest::READABLE)
    }?;
    let mut pipe = tokio::net::unix::pipe::Receiver::from_owned_fd(status.try_clone()?)?;
    let (tx, rx) = oneshot::channel();
    tokio::spawn(async move {
        let ended = match pidfd.readable().await {
            Ok(_) => runtime::init::monotonic_ns(),
            Err(e) => {
                warn!(error = %e, "waiting on the container's pidfd failed");
                runtime::init::monotonic_ns()
            }
        };
        let mut record = Vec::new();
        if let Err(e) = pipe.read_to_end(&mut record).await {
            warn!(error = %e, "reading the container's status pipe failed");
        }
        let _ = tx.send((String::from_utf8_lossy(&record).into_owned(), ended));
    });
    Ok(rx)
}

/// What an init that is gone before its launch wrote on its status pipe, if it failed to set up.
fn setup_error(status: &OwnedFd) -> Option<String> {
    report_so_far(status).setup_error
}

/// What the init wrote on its status pipe so far (read without blocking: a live init has written nothing).
pub(super) fn report_so_far(status: &OwnedFd) -> Report {
    use std::io::Read;
    let Ok(fd) = status.try_clone() else {
        return Report::default();
    };
    let nonblocking = nix::fcntl::fcntl(fd.as_raw_fd(), nix::fcntl::FcntlArg::F_GETFL)
        .map(nix::fcntl::OFlag::from_bits_truncate)
        .and_then(|f| {
            nix::fcntl::fcntl(
                fd.as_raw_fd(),
                nix::fcntl::FcntlArg::F_SETFL(f | nix::fcntl::OFlag::O_NONBLOCK),
            )
        });
    let mut record = String::new();
    if nonblocking.is_ok() {
        let _ = std::fs::File::from(fd).read_to_string(&mut record);
    }
    Report::decode(&record)
}

//! The helper backend's [`ContainerBackend`]: an execution's container (created with its bundle, prepared,
//! launched, watched through the init's pidfd and status pipe, killed and removed), and the agents' workspaces,
//! whose runs are in `runs`. Built on the backend's shared parts in [`crate::helper`].

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use nix::sys::signal::Signal;
use runtime::cgroups::{CgroupLimits, LimitFiles, Usage};
use runtime::helper::{Created, HelperClient};
use runtime::launch::Launch;
use runtime::rootfs::{InputFile, Scratch};
use tokio::io::AsyncReadExt;
use tokio::sync::oneshot;
use tracing::{debug, error, warn};

use crate::agent::{InitIdentity, Workspace};
use crate::helper::{remove_scratch, report_so_far, HelperBackend};
use crate::{
    BoxFuture, ContainerBackend, ContainerHandle, CreateError, EndRecord, LaunchError, Plan,
    PrepareError, WorkspacePlan,
};
use runtime::error::Chain;

impl ContainerBackend for Arc<HelperBackend> {
    fn create<'a>(
        &'a self,
        plan: Plan<'a>,
    ) -> BoxFuture<'a, Result<Box<dyn ContainerHandle>, CreateError>> {
        Box::pin(async move {
            let this = self.clone();
            let owned = (
                plan.cid.to_owned(),
                plan.lang.clone(),
                *plan.limits,
                plan.volumes.to_vec(),
                plan.snapshot.map(Path::to_owned),
            );
            let (host_id, disk_mb, warm) = (plan.host_id, plan.disk_mb, plan.warm);
            let prepared = tokio::task::spawn_blocking(move || {
                let (cid, lang, limits, volumes, snapshot) = owned;
                this.prepare(&Plan {
                    cid: &cid,
                    host_id,
                    lang: &lang,
                    disk_mb,
                    limits: &limits,
                    warm,
                    volumes: &volumes,
                    snapshot: snapshot.as_deref(),
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
                    plan.warm.then(|| plan.lang.warm.clone()).flatten(),
                )
                .await
            {
                Ok(created) => {
                    // The limit files are opened here, off the launch's path (see `LimitFiles`), with no await
                    // between the helper's creation and the handle that removes the container: a few opens.
                    match self.cgroups.limit_files(plan.cid) {
                        Ok(files) => Ok(Box::new(HelperContainer {
                            cid: plan.cid.to_owned(),
                            client,
                            limits: Arc::new(files),
                            scratch,
                            created,
                            cpu_before_launch: Arc::new(AtomicU64::new(0)),
                        }) as Box<dyn ContainerHandle>),
                        Err(e) => {
                            remove((plan.cid.to_owned(), client, scratch, created)).await;
                            Err(CreateError::Prepare(e))
                        }
                    }
                }
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
        Box::pin(crate::runs::create_workspace(self.clone(), plan))
    }

    fn adopt_workspace<'a>(
        &'a self,
        plan: WorkspacePlan<'a>,
    ) -> BoxFuture<'a, Result<Arc<dyn Workspace>, CreateError>> {
        let adopted = crate::runs::adopt_workspace(self.clone(), plan);
        Box::pin(async move { adopted })
    }

    fn end_kept_run<'a>(&'a self, cid: &'a str, init: InitIdentity) -> BoxFuture<'a, ()> {
        Box::pin(crate::runs::end_kept(cid, init, &self.cgroups))
    }

    fn parallelism(&self) -> usize {
        // Each helper is single-threaded: one creation at a time in each.
        self.helpers.len().max(1)
    }

    fn alive(&self) -> bool {
        self.helpers.all_alive()
    }

    fn gone(&self) -> BoxFuture<'_, ()> {
        Box::pin(self.helpers.any_gone())
    }

    fn shutdown(&self) -> BoxFuture<'_, ()> {
        Box::pin(self.helpers.shutdown())
    }
}

/// The most code written on the execution's own task rather than on a blocking thread, when there are no input
/// files and the request's memory limit is at least twice what the container holds: the limits (a write per open
/// cgroup file, see `LimitFiles`) and a small code file take 100-150 µs on a 2-core machine, about what handing
/// them to a blocking thread costs, and without a wait for a core when the pool's refills keep both busy. A limit
/// closer to (or under) what the container holds could make the kernel reclaim, or on v2 run the OOM killer, in
/// the write: that goes to a blocking thread.
const INLINE_INPUTS: usize = 64 << 10;

/// A container created by a helper.
struct HelperContainer {
    cid: String,
    /// The helper that created it, which removes it (its init is that helper's child).
    client: HelperClient,
    /// Its cgroup's limit and usage files, open.
    limits: Arc<LimitFiles>,
    /// The scratch space (working directory, `/tmp`, code directory, overlay root).
    scratch: Scratch,
    /// The daemon's descriptors: launch channel, status pipe, pidfd.
    created: Created,
    /// The CPU time its cgroup had used when the request's limits were written, just before the launch (the init's
    /// set-up, and a warm interpreter's start): not the execution's, so not in its usage.
    cpu_before_launch: Arc<AtomicU64>,
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
        let limit_files = self.limits.clone();
        let cpu_before = self.cpu_before_launch.clone();
        // Inline only when the limit cannot make the kernel reclaim (or, on v2, kill) what the container holds; the
        // memory is read only when the inputs are small enough.
        let inline = files.is_empty()
            && code.len() <= INLINE_INPUTS
            && self
                .limits
                .memory_current()
                .is_ok_and(|now| limits.memory_bytes >= now.saturating_mul(2));
        let queued = std::time::Instant::now();
        let work = move || {
            let started = std::time::Instant::now();
            limit_files.set(&limits)?;
            cpu_before.store(limit_files.cpu_time_ns()?, Ordering::Relaxed);
            let limited = started.elapsed();
            let written = inputs.write(code_name, &code, &files);
            debug!(
                queued_us = (started - queued).as_micros() as u64,
                limits_us = limited.as_micros() as u64,
                files_us = (started.elapsed() - limited).as_micros() as u64,
                inline,
                "prepare timings"
            );
            written
        };
        Box::pin(async move {
            if inline {
                return work().map_err(PrepareError::Failed);
            }
            tokio::task::spawn_blocking(work)
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

    fn listen_inside(
        &self,
        address: std::net::SocketAddr,
    ) -> std::io::Result<std::net::TcpListener> {
        runtime::sys::tcp_listener_in_netns(self.created.pidfd.as_fd(), address)
    }

    fn usage(&self) -> runtime::Result<Usage> {
        let mut usage = self.limits.usage()?;
        let before = self.cpu_before_launch.load(Ordering::Relaxed);
        usage.cpu_time_ns = usage.cpu_time_ns.saturating_sub(before);
        Ok(usage)
    }

    fn remove(self: Box<Self>) -> BoxFuture<'static, ()> {
        let HelperContainer {
            cid,
            client,
            scratch,
            created,
            ..
        } = *self;
        Box::pin(remove((cid, client, scratch, created)))
    }
}

/// Removes a container the helper created, and its scratch space.
async fn remove((cid, client, scratch, created): (String, HelperClient, Scratch, Created)) {
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
}

/// Waits in a task of its own until the execution's container has ended, reading the init's status pipe. The end
/// is either the init's record saying it was left alone ([`runtime::init::ended_alone`]: the program was reaped, or
/// was a warm interpreter that reported its end and was killed, and no other process of its pid namespace exists),
/// or else the pidfd turning readable, which the kernel signals only once the init is a zombie, that is after every
/// other process of its pid namespace is gone too. Either way, when the result is computed (usage, artifacts), the
/// program has ended (a reported interpreter was killed before the record was written); the first spares the wait
/// for the init's own exit and its namespaces' tear-down. The receiver gets the record (empty when the
/// init died without writing) and the `CLOCK_MONOTONIC` time of the end.
fn watch_end(pidfd: &OwnedFd, status: &OwnedFd) -> std::io::Result<oneshot::Receiver<EndRecord>> {
    let pidfd = pidfd.try_clone()?;
    // SAFETY: the OwnedFd moves into the AsyncFd, which keeps it open and unchanged for its whole lifetime.
    let pidfd = unsafe {
        tokio::io::unix::AsyncFd::register_with_interest(pidfd, tokio::io::Interest::READABLE)
    }?;
    let mut pipe = tokio::net::unix::pipe::Receiver::from_owned_fd(status.try_clone()?)?;
    let (tx, rx) = oneshot::channel();
    tokio::spawn(async move {
        let mut record = Vec::new();
        let mut buf = [0u8; 1024];
        let alone = loop {
            match pipe.read(&mut buf).await {
                Ok(0) => break false,
                Ok(n) => {
                    record.extend_from_slice(&buf[..n]);
                    if runtime::init::ended_alone(&record) {
                        break true;
                    }
                }
                Err(e) => {
                    warn!(error = %e, "reading the container's status pipe failed");
                    break false;
                }
            }
        };
        if !alone {
            if let Err(e) = pidfd.readable().await {
                warn!(error = %e, "waiting on the container's pidfd failed");
            }
        }
        let ended = runtime::init::monotonic_ns();
        let _ = tx.send((String::from_utf8_lossy(&record).into_owned(), ended));
    });
    Ok(rx)
}

/// What an init that is gone before its launch wrote on its status pipe, if it failed to set up.
fn setup_error(status: &OwnedFd) -> Option<String> {
    report_so_far(status).setup_error
}

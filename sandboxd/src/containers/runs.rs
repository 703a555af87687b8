//! The long-lived kind ([`agents::container`]) on the real backend: a workspace is a [`Scratch`] space of its own,
//! each run a container created by the primary helper from a bundle written by the shared builder, launched over
//! its launch channel, signalled, watched and given the egress proxy's listener through the init's pidfd, frozen,
//! limited and measured through its cgroups.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use nix::sys::signal::Signal;
use runtime::cgroups::Cgroups;
use runtime::error::Chain;
use runtime::helper::{Created, HelperClient};
use runtime::init::ProgramExit;
use runtime::launch::Launch;
use runtime::rootfs::{InputFile, Scratch};
use tokio::io::unix::AsyncFd;
use tracing::{debug, error, warn};

use super::helper::{create_scratch, remove_scratch, report_so_far, Bundle, HelperBackend};
use super::{CreateError, WorkspacePlan};
use crate::images::RootImage;
use agents::container::{
    BoxFuture, Ended, LongLivedError, RunContainer, RunPlan, RunUsage, Workspace,
};

/// How long a run's removal may take before it is given up (logged).
const REMOVE_TIMEOUT: Duration = Duration::from_secs(30);

/// Creates the workspace's scratch space (blocking work, off the async threads).
pub(super) async fn create_workspace(
    backend: Arc<HelperBackend>,
    plan: WorkspacePlan<'_>,
) -> Result<Arc<dyn Workspace>, CreateError> {
    let (parent, id, image) = (
        plan.parent.to_owned(),
        plan.id.to_owned(),
        plan.image.clone(),
    );
    let (host_id, disk_bytes) = (plan.host_id, plan.disk_mb << 20);
    let (image2, snapshot) = (image.clone(), plan.snapshot.map(Path::to_owned));
    let scratch = tokio::task::spawn_blocking(move || {
        let mut scratch = create_scratch(&parent, &id, disk_bytes, host_id, &image2)?;
        if let Some(layer) = snapshot {
            // On error the scratch space is removed as it is dropped.
            scratch
                .workspace_from(&layer)
                .map_err(CreateError::Prepare)?;
        }
        Ok::<_, CreateError>(scratch)
    })
    .await
    .map_err(CreateError::Panicked)??;
    Ok(Arc::new(HelperWorkspace {
        dir: scratch.dir().to_owned(),
        backend,
        image,
        host_id,
        disk_bytes,
        scratch: Mutex::new(Some(scratch)),
    }))
}

struct HelperWorkspace {
    dir: PathBuf,
    backend: Arc<HelperBackend>,
    image: Arc<RootImage>,
    host_id: u32,
    disk_bytes: u64,
    /// `None` once removed.
    scratch: Mutex<Option<Scratch>>,
}

impl HelperWorkspace {
    fn scratch(&self) -> std::sync::MutexGuard<'_, Option<Scratch>> {
        self.scratch.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The run's bundle in the workspace's directory.
    fn write_bundle(&self, plan: &RunPlan<'_>) -> Result<(), LongLivedError> {
        let scratch = self.scratch();
        let Some(scratch) = scratch.as_ref() else {
            return Err(LongLivedError::Create(
                "the workspace is being removed".into(),
            ));
        };
        self.backend
            .write_bundle(Bundle {
                cid: plan.cid,
                host_id: self.host_id,
                image: &self.image,
                scratch,
                args: plan.args.clone(),
                env: plan.env.clone(),
                memory_bytes: plan.memory_mb << 20,
                pids_max: plan.pids_max,
                cpu_shares: 1024,
                fsize_bytes: self.disk_bytes,
                shm_bytes: plan.shm_bytes,
                extra_binds: Vec::new(),
            })
            .map_err(|e| LongLivedError::Create(Box::new(e)))
    }
}

impl Workspace for HelperWorkspace {
    fn dir(&self) -> &Path {
        &self.dir
    }

    fn workspace(&self) -> PathBuf {
        self.dir.join("scratch/workspace")
    }

    fn host_id(&self) -> u32 {
        self.host_id
    }

    fn write_inputs(&self, name: &str, content: &[u8], files: &[InputFile]) -> runtime::Result<()> {
        let inputs = self.scratch().as_ref().map(Scratch::inputs);
        match inputs {
            Some(inputs) => inputs.write(name, content, files),
            None => Err(runtime::Error::io(
                &self.dir,
                std::io::Error::from(std::io::ErrorKind::NotFound),
            )),
        }
    }

    fn create_run<'a>(
        &'a self,
        plan: RunPlan<'a>,
    ) -> BoxFuture<'a, Result<Arc<dyn RunContainer>, LongLivedError>> {
        Box::pin(async move {
            self.write_bundle(&plan)?;
            let client = self.backend.helpers.primary().clone();
            let created = client
                .create(
                    plan.cid,
                    self.dir.clone(),
                    self.image.landlock.clone(),
                    None,
                )
                .await
                .map_err(|e| LongLivedError::Create(Box::new(e)))?;
            let pidfd = created.pidfd.try_clone().and_then(|fd| {
                // SAFETY: the OwnedFd moves into the AsyncFd, which keeps it open and unchanged for its lifetime.
                unsafe { AsyncFd::register_with_interest(fd, tokio::io::Interest::READABLE) }
                    .map_err(std::io::Error::from)
            });
            let run = HelperRun {
                cid: plan.cid.to_owned(),
                client,
                cgroups: self.backend.cgroups.clone(),
                launch: Launch {
                    args: plan.args,
                    env: plan.env,
                    warm: false,
                    relay: false,
                },
                created,
                pidfd: None,
            };
            match pidfd {
                Ok(pidfd) => Ok(Arc::new(HelperRun {
                    pidfd: Some(pidfd),
                    ..run
                }) as Arc<dyn RunContainer>),
                Err(e) => {
                    run.remove().await;
                    Err(LongLivedError::Create(Box::new(e)))
                }
            }
        })
    }

    fn remove(&self) -> BoxFuture<'_, ()> {
        let scratch = self.scratch().take();
        Box::pin(async move {
            if let Some(scratch) = scratch {
                remove_scratch(scratch).await;
            }
        })
    }
}

/// A run's container, created by the primary helper.
struct HelperRun {
    cid: String,
    /// The helper that created it, which removes it (its init is that helper's child).
    client: HelperClient,
    cgroups: Cgroups,
    launch: Launch,
    /// The daemon's descriptors: launch channel, status pipe, pidfd.
    created: Created,
    /// The init's pidfd, registered with the reactor (always `Some` once handed out).
    pidfd: Option<AsyncFd<OwnedFd>>,
}

impl HelperRun {
    fn cgroup<T: Send + 'static>(
        &self,
        what: &'static str,
        f: impl FnOnce(&Cgroups, &str) -> runtime::Result<T> + Send + 'static,
    ) -> BoxFuture<'static, Result<T, LongLivedError>> {
        let (cgroups, cid) = (self.cgroups.clone(), self.cid.clone());
        Box::pin(async move {
            match tokio::task::spawn_blocking(move || f(&cgroups, &cid)).await {
                Ok(r) => r.map_err(|e| cgroup_error(what, e)),
                Err(e) => Err(cgroup_error(what, e)),
            }
        })
    }
}

fn cgroup_error(
    what: &'static str,
    e: impl std::error::Error + Send + Sync + 'static,
) -> LongLivedError {
    LongLivedError::Cgroup {
        what,
        source: Box::new(e),
    }
}

impl RunContainer for HelperRun {
    fn cid(&self) -> &str {
        &self.cid
    }

    fn launch(&self, stdio: [BorrowedFd<'_>; 3]) -> Result<(), LongLivedError> {
        runtime::launch::send(self.created.launch.as_fd(), &self.launch, stdio).map_err(|e| {
            match report_so_far(&self.created.status).setup_error {
                Some(setup) => LongLivedError::Setup(setup),
                None => LongLivedError::Launch(Box::new(e)),
            }
        })
    }

    fn signal(&self, signal: Signal) {
        if let Err(e) = runtime::sys::pidfd_send_signal(self.created.pidfd.as_fd(), signal) {
            debug!(container = %self.cid, error = %e, "signal to the container's init failed (already gone?)");
        }
    }

    fn freeze(&self) -> BoxFuture<'static, Result<(), LongLivedError>> {
        self.cgroup("freeze the agent", |cg, cid| cg.freeze(cid))
    }

    fn thaw(&self) -> BoxFuture<'static, Result<(), LongLivedError>> {
        self.cgroup("thaw the agent", |cg, cid| cg.thaw(cid))
    }

    fn set_cpu_quota(&self, cores: f64) -> Result<(), LongLivedError> {
        self.cgroups
            .set_cpu_quota(&self.cid, cores)
            .map_err(|e| cgroup_error("enforce the cpu quota", e))
    }

    fn usage(&self) -> Result<RunUsage, LongLivedError> {
        let cpu = self.cgroups.usage(&self.cid);
        let memory = self.cgroups.memory_current(&self.cid);
        match (cpu, memory) {
            (Ok(u), Ok(memory_bytes)) => Ok(RunUsage {
                memory_bytes,
                cpu_time_ns: u.cpu_time_ns,
            }),
            (Err(e), _) | (_, Err(e)) => Err(cgroup_error("read the agent's usage", e)),
        }
    }

    /// Through the init's pidfd: the listener is made in the container's network namespace.
    fn listen_inside(
        &self,
        address: std::net::SocketAddr,
    ) -> std::io::Result<std::net::TcpListener> {
        runtime::sys::tcp_listener_in_netns(self.created.pidfd.as_fd(), address)
    }

    fn ended(&self) -> BoxFuture<'_, Ended> {
        Box::pin(async move {
            if let Some(pidfd) = &self.pidfd {
                // The readiness stays set (the pidfd stays readable): a later call returns at once.
                match pidfd.readable().await {
                    Ok(mut guard) => guard.retain_ready(),
                    Err(e) => {
                        warn!(container = %self.cid, error = %e, "waiting on the pidfd failed")
                    }
                }
            }
            let report = report_so_far(&self.created.status);
            Ended {
                // Only SIGKILL ends the init without a record.
                exit: report.exit.unwrap_or(ProgramExit::Signal(libc::SIGKILL)),
                setup_error: report.setup_error,
            }
        })
    }

    fn remove(&self) -> BoxFuture<'_, ()> {
        Box::pin(async move {
            match tokio::time::timeout(REMOVE_TIMEOUT, self.client.remove(&self.cid)).await {
                Ok(Ok(None)) => {}
                Ok(Ok(Some(step))) => {
                    error!(container = %self.cid, error = %step, "container removal reported an error")
                }
                Ok(Err(e)) => {
                    error!(container = %self.cid, error = %Chain(&e), "container not removed")
                }
                Err(_) => error!(container = %self.cid, "container not removed within 30 s"),
            }
        })
    }
}

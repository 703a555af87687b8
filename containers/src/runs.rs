//! The long-lived kind ([`crate::agent`]) on the real backend: a workspace is a [`Scratch`] space of its own,
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

use crate::agent::{
    Adopted, AdoptedRun, BoxFuture, Ended, InitIdentity, LongLivedError, RunContainer, RunPlan,
    RunUsage, Workspace,
};
use crate::helper::{create_scratch, remove_scratch, report_so_far, Bundle, HelperBackend};
use crate::image::{RootImage, RootKind};
use crate::{CreateError, WorkspacePlan};

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
    let subvolume = plan.subvolume.map(Path::to_owned);
    let root_layer = plan.root_layer.map(Path::to_owned);
    let scratch = tokio::task::spawn_blocking(move || {
        let mut scratch = create_scratch(
            &parent,
            &id,
            disk_bytes,
            host_id,
            (&image2, root_layer.as_deref()),
        )?;
        // On error the scratch space is removed as it is dropped.
        if let Some(layer) = snapshot {
            scratch
                .workspace_from(&layer)
                .map_err(CreateError::Prepare)?;
        }
        if let Some(subvolume) = subvolume {
            scratch
                .workspace_on(&subvolume)
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

/// Takes back a workspace a previous daemon left mounted (live restore).
pub(super) fn adopt_workspace(
    backend: Arc<HelperBackend>,
    plan: WorkspacePlan<'_>,
) -> Result<Arc<dyn Workspace>, CreateError> {
    let disk_bytes = plan.disk_mb << 20;
    let mut scratch = Scratch::adopt(plan.parent, plan.id, disk_bytes, plan.host_id)
        .map_err(CreateError::Prepare)?;
    if let Some(subvolume) = plan.subvolume {
        scratch.adopt_store(subvolume);
    }
    Ok(Arc::new(HelperWorkspace {
        dir: scratch.dir().to_owned(),
        backend,
        image: plan.image.clone(),
        host_id: plan.host_id,
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
        // The home is a second mount of /workspace (bound after it: the mounts under /workspace, volumes
        // included, are not repeated there).
        // On an image's overlay root the mount point is made in the root by the host (the container's user may
        // not write the image's /home); the host image's skeleton has it.
        if let (Some(home), RootKind::Oci { .. }) = (plan.home, &self.image.kind) {
            runtime::rootfs::mount_point_in(&scratch.rootfs(), home)
                .map_err(|e| LongLivedError::Create(Box::new(e)))?;
        }
        let extra_binds = plan
            .home
            .map(|home| {
                scratch
                    .binds()
                    .into_iter()
                    .filter(|b| b.destination == Path::new(runtime::rootfs::WORKDIR))
                    .map(|b| runtime::spec::BindMount {
                        destination: home.into(),
                        ..b
                    })
                    .collect()
            })
            .unwrap_or_default();
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
                extra_binds,
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

    fn root_upper(&self) -> Option<PathBuf> {
        match self.image.kind {
            RootKind::Oci { .. } => Some(self.dir.join(runtime::rootfs::UPPER)),
            RootKind::Host(_) => None,
        }
    }

    fn host_workspace(&self) -> (PathBuf, u32) {
        match self.scratch().as_ref() {
            Some(s) => s.host_workspace(),
            None => (self.workspace(), self.host_id),
        }
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
            let landlock = self.image.landlock.clone();
            let created = if plan.keep {
                client
                    .create_kept(plan.cid, self.dir.clone(), landlock)
                    .await
            } else {
                client
                    .create(plan.cid, self.dir.clone(), landlock, None)
                    .await
            }
            .map_err(|e| LongLivedError::Create(Box::new(e)))?;
            let Created {
                pid,
                launch,
                status,
                pidfd,
            } = created;
            let run = HelperRun {
                cid: plan.cid.to_owned(),
                pid,
                client: Some(client),
                cgroups: self.backend.cgroups.clone(),
                launch: Launch {
                    keep: plan.keep,
                    ..Launch::program(plan.args, plan.env)
                },
                launch_chan: Some(launch),
                status,
                watch: None,
                pidfd,
                kept: plan.keep.then(|| Kept {
                    path: self.dir.join(KEEPER_SOCKET),
                    link: Mutex::new(None),
                    init: Mutex::new(None),
                    pid,
                }),
            };
            run.watched().await
        })
    }

    fn leave(&self) {
        if let Some(scratch) = self.scratch().take() {
            scratch.leave();
        }
    }

    fn adopt_run<'a>(
        &'a self,
        cid: &'a str,
        init: InitIdentity,
    ) -> BoxFuture<'a, Result<AdoptedRun, LongLivedError>> {
        let path = self.dir.join(KEEPER_SOCKET);
        let cgroups = self.backend.cgroups.clone();
        let cid = cid.to_owned();
        Box::pin(async move {
            let adopt = |what: &str, e: runtime::Error| {
                LongLivedError::Create(format!("{what}: {}", Chain(&e)).into())
            };
            let pidfd = open_init(init)?;
            // From here on the init is this daemon's: a run not taken back is ended, never left unsupervised.
            let collected = match runtime::init::keeper::collect(pidfd.as_fd()) {
                Ok(c) => c,
                Err(e) => {
                    end_adopted(&cid, &pidfd, &cgroups).await;
                    return Err(adopt("the run's init holds nothing", e));
                }
            };
            // A frozen init does not accept: without a link now, one is made when it is needed.
            let link = runtime::init::keeper::connect(&path)
                .inspect_err(|e| {
                    debug!(container = %cid, error = %Chain(e), "no link to the run's keeper yet")
                })
                .ok();
            let run = HelperRun::adopted(cid, init, cgroups, pidfd, collected.status, (path, link));
            let adopted = Adopted {
                control: collected.control,
                conn: collected.conn,
            };
            Ok((run.watched().await?, adopted))
        })
    }

    fn adopt_serving_run<'a>(
        &'a self,
        cid: &'a str,
        init: InitIdentity,
    ) -> BoxFuture<'a, Result<crate::agent::AdoptedServingRun, LongLivedError>> {
        let path = self.dir.join(KEEPER_SOCKET);
        let cgroups = self.backend.cgroups.clone();
        let cid = cid.to_owned();
        Box::pin(async move {
            let adopt =
                |what: &str, e: nix::Error| LongLivedError::Create(format!("{what}: {e}").into());
            let pidfd = open_init(init)?;
            // From here on the init is this daemon's: a run not taken back is ended, never left unsupervised.
            let held = runtime::sys::pidfd_getfd(pidfd.as_fd(), runtime::init::serve::CHANNEL_FD)
                .map_err(|e| adopt("the run's init holds no channel", e))
                .and_then(|chan| {
                    runtime::sys::pidfd_getfd(pidfd.as_fd(), runtime::init::keeper::STATUS_FD)
                        .map(|status| (chan, status))
                        .map_err(|e| adopt("the run's init holds no status pipe", e))
                });
            let (chan, status) = match held {
                Ok(h) => h,
                Err(e) => {
                    end_adopted(&cid, &pidfd, &cgroups).await;
                    return Err(e);
                }
            };
            let run = HelperRun::adopted(cid, init, cgroups, pidfd, status, (path, None));
            Ok((run.watched().await?, chan))
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

/// The kept run's socket in the workspace's directory ([`runtime::init::keeper`]).
const KEEPER_SOCKET: &str = "keeper.sock";

/// A run's container, created by the primary helper (or adopted from a previous daemon).
struct HelperRun {
    cid: String,
    /// The init's host pid (pinned by `pidfd`).
    pid: i32,
    /// The helper that created it, which removes it (its init is that helper's child); `None` for a run adopted
    /// from a previous daemon, whose init is nobody's child of ours.
    client: Option<HelperClient>,
    cgroups: Cgroups,
    launch: Launch,
    /// The launch channel (`None` for an adopted run: it was launched long ago).
    launch_chan: Option<OwnedFd>,
    /// The status pipe's read end.
    status: OwnedFd,
    /// The init's pidfd.
    pidfd: OwnedFd,
    /// A copy of the pidfd registered with the reactor (always `Some` once handed out).
    watch: Option<AsyncFd<OwnedFd>>,
    /// A kept run's keeper.
    kept: Option<Kept>,
}

/// What a daemon knows of a kept run's keeper.
struct Kept {
    /// Its socket.
    path: PathBuf,
    /// This daemon's connection to it, once the run is launched.
    link: Mutex<Option<OwnedFd>>,
    /// The init, once launched.
    init: Mutex<Option<InitIdentity>>,
    pid: i32,
}

impl HelperRun {
    /// A kept run taken back from a daemon that is gone: its init `init` (behind `pidfd`), its status pipe, its
    /// keeper's socket and the link to it (if made).
    fn adopted(
        cid: String,
        init: InitIdentity,
        cgroups: Cgroups,
        pidfd: OwnedFd,
        status: OwnedFd,
        (path, link): (PathBuf, Option<OwnedFd>),
    ) -> Self {
        HelperRun {
            cid,
            pid: init.pid,
            client: None,
            cgroups,
            // Launched long ago: nothing of this is sent again.
            launch: Launch {
                keep: true,
                ..Launch::program(Vec::new(), Vec::new())
            },
            launch_chan: None,
            status,
            watch: None,
            pidfd,
            kept: Some(Kept {
                path,
                link: Mutex::new(link),
                init: Mutex::new(Some(init)),
                pid: init.pid,
            }),
        }
    }

    /// The run with its pidfd watched by the reactor; on failure it is removed.
    async fn watched(self) -> Result<Arc<dyn RunContainer>, LongLivedError> {
        match watch(&self.pidfd) {
            Ok(pidfd) => Ok(Arc::new(HelperRun {
                watch: Some(pidfd),
                ..self
            }) as Arc<dyn RunContainer>),
            Err(e) => {
                self.remove().await;
                Err(LongLivedError::Create(Box::new(e)))
            }
        }
    }

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

    /// A kept run's launch: the keeper's listener is made, handed to the init with the control listener and the
    /// status pipe's read end, and this daemon connects to it.
    fn launch_kept(
        &self,
        chan: &OwnedFd,
        stdio: [BorrowedFd<'_>; 3],
        control: BorrowedFd<'_>,
        kept: &Kept,
    ) -> Result<(), LongLivedError> {
        let listener = runtime::init::keeper::listen(&kept.path)
            .map_err(|e| LongLivedError::Launch(Box::new(e)))?;
        let sent = runtime::launch::send_keeping(
            chan.as_fd(),
            &self.launch,
            stdio,
            &[control, listener.as_fd(), self.status.as_fd()],
        );
        drop(listener);
        sent.map_err(|e| self.launch_error(e))?;
        let link = runtime::init::keeper::connect(&kept.path)
            .map_err(|e| LongLivedError::Launch(Box::new(e)))?;
        *lock(&kept.link) = Some(link);
        *lock(&kept.init) = runtime::sys::start_time(kept.pid).map(|start| InitIdentity {
            pid: kept.pid,
            start,
        });
        Ok(())
    }

    fn launch_error(&self, e: runtime::Error) -> LongLivedError {
        match report_so_far(&self.status).setup_error {
            Some(setup) => LongLivedError::Setup(setup),
            None => LongLivedError::Launch(Box::new(e)),
        }
    }

    /// An adopted run's removal: killed through its pidfd (thawed first), waited for, its cgroups removed.
    async fn remove_adopted(&self) {
        end_adopted(&self.cid, &self.pidfd, &self.cgroups).await;
    }
}

/// A pidfd of a kept run's init `init`, once it is known to be that process: the pidfd pins the pid, and a process
/// that still starts when the record says is the same one.
fn open_init(init: InitIdentity) -> Result<OwnedFd, LongLivedError> {
    let pidfd = runtime::sys::pidfd_open(nix::unistd::Pid::from_raw(init.pid)).map_err(|e| {
        LongLivedError::Create(format!("the run's init is gone: {}", Chain(&e)).into())
    })?;
    if runtime::sys::start_time(init.pid) != Some(init.start) {
        return Err(LongLivedError::Create(
            "the run's init is gone (its pid now names another process)".into(),
        ));
    }
    Ok(pidfd)
}

/// Ends an adopted run's container: SIGKILL to its init, its cgroup leaves thawed, emptied and removed, and the
/// init waited for through `pidfd` (it is not our child: its reaper is init).
async fn end_adopted(cid: &str, pidfd: &OwnedFd, cgroups: &Cgroups) {
    if let Err(e) = runtime::sys::pidfd_send_signal(pidfd.as_fd(), Signal::SIGKILL) {
        debug!(container = %cid, error = %e, "SIGKILL of an adopted init failed (already gone?)");
    }
    let (cg, id) = (cgroups.clone(), cid.to_owned());
    match tokio::task::spawn_blocking(move || cg.remove_leaf(&id)).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => {
            error!(container = %cid, error = %Chain(&e), "an adopted run's cgroups not removed")
        }
        Err(e) => error!(container = %cid, error = %e, "an adopted run's cgroup removal panicked"),
    }
    let exited = watch(pidfd).map(|w| async move {
        let _ = w.readable().await;
    });
    match exited {
        Ok(wait) => {
            if tokio::time::timeout(REMOVE_TIMEOUT, wait).await.is_err() {
                error!(container = %cid, "an adopted init did not end within 30 s of SIGKILL");
            }
        }
        Err(e) => warn!(container = %cid, error = %e, "cannot wait for an adopted init"),
    }
}

/// Ends a kept run that is not taken back ([`crate::ContainerBackend::end_kept_run`]): as an adopted run's end
/// when its init is still `init`; otherwise its process is gone and only its cgroups may be left.
pub(super) async fn end_kept(cid: &str, init: InitIdentity, cgroups: &Cgroups) {
    let pidfd = runtime::sys::pidfd_open(nix::unistd::Pid::from_raw(init.pid)).ok();
    match pidfd.filter(|_| runtime::sys::start_time(init.pid) == Some(init.start)) {
        Some(pidfd) => end_adopted(cid, &pidfd, cgroups).await,
        None => {
            let (cg, id) = (cgroups.clone(), cid.to_owned());
            if let Ok(Err(e)) = tokio::task::spawn_blocking(move || cg.remove_leaf(&id)).await {
                error!(container = %cid, error = %Chain(&e), "a kept run's cgroups not removed");
            }
        }
    }
}

/// A copy of `pidfd` registered with the reactor: readable once the process has ended.
fn watch(pidfd: &OwnedFd) -> std::io::Result<AsyncFd<OwnedFd>> {
    let fd = pidfd.try_clone()?;
    // SAFETY: the OwnedFd moves into the AsyncFd, which keeps it open and unchanged for its lifetime.
    unsafe { AsyncFd::register_with_interest(fd, tokio::io::Interest::READABLE) }
        .map_err(std::io::Error::from)
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
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

    fn launch(
        &self,
        stdio: [BorrowedFd<'_>; 3],
        control: Option<BorrowedFd<'_>>,
    ) -> Result<(), LongLivedError> {
        let Some(chan) = &self.launch_chan else {
            return Err(LongLivedError::Launch(
                "an adopted run is launched already".into(),
            ));
        };
        match (&self.kept, control) {
            (Some(kept), Some(control)) => self.launch_kept(chan, stdio, control, kept),
            (None, None) => runtime::launch::send(chan.as_fd(), &self.launch, stdio)
                .map_err(|e| self.launch_error(e)),
            _ => Err(LongLivedError::Launch(
                "a kept run is launched with its control socket, and only a kept run".into(),
            )),
        }
    }

    fn serve(&self) -> Result<runtime::processes::Processes, LongLivedError> {
        let Some(chan) = &self.launch_chan else {
            return Err(LongLivedError::Launch(
                "an adopted run is launched already".into(),
            ));
        };
        let launch = Launch {
            serve: true,
            args: Vec::new(),
            ..self.launch.clone()
        };
        let null =
            std::fs::File::open("/dev/null").map_err(|e| LongLivedError::Launch(Box::new(e)))?;
        let stdio = [null.as_fd(), null.as_fd(), null.as_fd()];
        // A kept run's init holds the daemon's end of the channel and the status pipe for a later daemon.
        let kept = [chan.as_fd(), self.status.as_fd(), null.as_fd()];
        let sent = match &self.kept {
            Some(_) => runtime::launch::send_keeping(chan.as_fd(), &launch, stdio, &kept),
            None => runtime::launch::send(chan.as_fd(), &launch, stdio),
        };
        sent.map_err(|e| self.launch_error(e))?;
        if let Some(kept) = &self.kept {
            *lock(&kept.init) = runtime::sys::start_time(kept.pid).map(|start| InitIdentity {
                pid: kept.pid,
                start,
            });
        }
        let chan = chan
            .try_clone()
            .map_err(|e| LongLivedError::Launch(Box::new(e)))?;
        runtime::processes::Processes::new(chan).map_err(|e| LongLivedError::Launch(Box::new(e)))
    }

    fn init_fd(&self, fd: i32) -> std::io::Result<OwnedFd> {
        runtime::sys::pidfd_getfd(self.pidfd.as_fd(), fd).map_err(std::io::Error::from)
    }

    /// Opened by the init's pid, then checked alive through its pidfd: the pid cannot have been recycled while
    /// the pidfd is open and the process it names still runs.
    fn root_dir(&self) -> std::io::Result<OwnedFd> {
        let dir = std::fs::File::open(format!("/proc/{}/root", self.pid))?;
        // A pidfd is readable once its process has ended.
        let mut ended = [nix::poll::PollFd::new(
            self.pidfd.as_fd(),
            nix::poll::PollFlags::POLLIN,
        )];
        match nix::poll::poll(&mut ended, nix::poll::PollTimeout::ZERO) {
            Ok(0) => Ok(dir.into()),
            _ => Err(std::io::Error::from(std::io::ErrorKind::NotFound)),
        }
    }

    fn hold(&self, conn: BorrowedFd<'_>) -> Result<(), LongLivedError> {
        let Some(kept) = &self.kept else {
            return Ok(());
        };
        let mut link = lock(&kept.link);
        if link.is_none() && self.launch_chan.is_none() {
            // An adopted run whose keeper did not accept at adoption (it was frozen).
            *link = runtime::init::keeper::connect(&kept.path).ok();
        }
        match link.as_ref() {
            Some(l) => runtime::init::keeper::hand(l, conn)
                .map_err(|e| LongLivedError::Launch(Box::new(e))),
            None => Err(LongLivedError::Launch("no link to the run's keeper".into())),
        }
    }

    fn init(&self) -> Option<InitIdentity> {
        self.kept.as_ref().and_then(|k| *lock(&k.init))
    }

    fn signal(&self, signal: Signal) {
        if let Err(e) = runtime::sys::pidfd_send_signal(self.pidfd.as_fd(), signal) {
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
        runtime::sys::tcp_listener_in_netns(self.pidfd.as_fd(), address)
    }

    fn ended(&self) -> BoxFuture<'_, Ended> {
        Box::pin(async move {
            if let Some(pidfd) = &self.watch {
                // The readiness stays set (the pidfd stays readable): a later call returns at once.
                match pidfd.readable().await {
                    Ok(mut guard) => guard.retain_ready(),
                    Err(e) => {
                        warn!(container = %self.cid, error = %e, "waiting on the pidfd failed")
                    }
                }
            }
            let report = report_so_far(&self.status);
            Ended {
                // Only SIGKILL ends the init without a record.
                exit: report.exit.unwrap_or(ProgramExit::Signal(libc::SIGKILL)),
                setup_error: report.setup_error,
            }
        })
    }

    fn remove(&self) -> BoxFuture<'_, ()> {
        Box::pin(async move {
            if let Some(kept) = &self.kept {
                let _ = std::fs::remove_file(&kept.path);
            }
            let Some(client) = &self.client else {
                return self.remove_adopted().await;
            };
            // A frozen task takes no SIGKILL until it is thawed (cgroup v1's freezer): the helper would wait for the
            // init forever. An adopted run's end thaws too (end_adopted).
            if let Err(e) = self
                .cgroup("thaw before removal", |cg, cid| cg.thaw(cid))
                .await
            {
                debug!(container = %self.cid, error = %Chain(&e), "thaw before removal failed");
            }
            match tokio::time::timeout(REMOVE_TIMEOUT, client.remove(&self.cid)).await {
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

//! The real backend's shared parts (its trait implementation is in `executions`, agent runs in `runs`):
//! containers created and removed by the helper processes ([`runtime::helper`]), launched over
//! their launch channel ([`runtime::launch`]), watched and killed through the init's pidfd, limited and measured
//! through their cgroups ([`runtime::cgroups`]).

use std::os::fd::{AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use runtime::cgroups::Cgroups;
use runtime::helper::HelperClient;
use runtime::init::Report;
use runtime::rootfs::{RootSource, Scratch, CODE_DIR, WORKDIR};
use runtime::spec::{BindMount, ContainerPlan};
use tracing::error;

use crate::image::{RootImage, RootKind};
use crate::{CreateError, Plan};
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
    pub(crate) fn len(&self) -> usize {
        self.all.len()
    }

    /// True while every helper runs (one gone means its containers are gone: the daemon is unhealthy).
    pub fn all_alive(&self) -> bool {
        !self.all.is_empty() && self.all.iter().all(HelperClient::is_alive)
    }

    /// Resolves once any helper has gone away (at once when there is none): [`Self::all_alive`] is false from then on.
    pub async fn any_gone(&self) {
        if self.all.is_empty() {
            return;
        }
        let gone = self.all.iter().map(|h| Box::pin(h.gone()));
        futures_util::future::select_all(gone).await;
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
    /// Binds after the image's and the scratch space's (an execution's volumes).
    pub extra_binds: Vec<BindMount>,
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
        binds.extend(b.extra_binds);
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
    pub(super) fn prepare(&self, plan: &Plan<'_>) -> Result<Scratch, CreateError> {
        let Plan {
            cid,
            host_id,
            lang,
            disk_mb,
            limits,
            warm: _,
            volumes,
            snapshot,
        } = *plan;
        let disk_bytes = disk_mb << 20;
        let mut scratch =
            create_scratch(&self.run_dir, cid, disk_bytes, host_id, (&lang.image, None))?;
        if let Some(layer) = snapshot {
            // On error the scratch space is removed as it is dropped.
            scratch
                .workspace_from(layer)
                .map_err(CreateError::Prepare)?;
        }
        let extra_binds = bind_volumes(&scratch, volumes, host_id)?;
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
            extra_binds,
        })?;
        Ok(scratch)
    }
}

/// Binds each volume, idmapped for `host_id`, at `vol-<n>` on the scratch tmpfs (out of the container's sight; its
/// lazy unmount takes them with it), and the container's binds of them under `/workspace`.
fn bind_volumes(
    scratch: &Scratch,
    volumes: &[crate::VolumeBind],
    host_id: u32,
) -> Result<Vec<BindMount>, CreateError> {
    let mut binds = Vec::with_capacity(volumes.len());
    for (n, v) in volumes.iter().enumerate() {
        let at = scratch.dir().join(format!("scratch/vol-{n}"));
        std::fs::create_dir(&at).map_err(|e| CreateError::Prepare(runtime::Error::io(&at, e)))?;
        runtime::idmap::bind(&v.source, &at, host_id, v.read_only).map_err(CreateError::Prepare)?;
        binds.push(BindMount {
            source: at,
            destination: Path::new(WORKDIR).join(&v.rel),
            readonly: v.read_only,
        });
    }
    Ok(binds)
}

/// `<parent>/<id>/` with its tmpfs of `disk_bytes`, and the overlay root for an OCI image (its upper layer a copy
/// of `root_layer`, when there is one).
pub(super) fn create_scratch(
    parent: &Path,
    id: &str,
    disk_bytes: u64,
    host_id: u32,
    (image, root_layer): (&RootImage, Option<&Path>),
) -> Result<Scratch, CreateError> {
    let root = match (&image.kind, root_layer) {
        (RootKind::Host(_), None) => RootSource::Shared,
        (RootKind::Host(_), Some(_)) => {
            return Err(CreateError::Prepare(runtime::Error::io(
                parent,
                std::io::Error::other("a root layer on the host image, whose root is read-only"),
            )))
        }
        (RootKind::Oci { lowers }, None) => RootSource::Overlay(lowers),
        (RootKind::Oci { lowers }, Some(layer)) => RootSource::OverlayWith(lowers, layer),
    };
    Scratch::create(parent, id, disk_bytes, host_id, root).map_err(CreateError::Prepare)
}

pub(super) async fn remove_scratch(mut scratch: Scratch) {
    match tokio::task::spawn_blocking(move || scratch.remove()).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => error!(error = %Chain(&e), "scratch cleanup failed"),
        Err(e) => error!(error = %e, "scratch cleanup panicked"),
    }
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

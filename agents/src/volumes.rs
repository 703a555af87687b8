//! Volumes (`POST /volumes`): filesystems of a fixed size that outlive the sandboxes they are mounted into and the
//! daemon's restarts, under `<state_dir>/volumes/<id>/` (`volume.json`, the filesystem, and `artifacts.jsonl`,
//! what the writer's `ArtifactEvent`s said about its files).
//!
//! A volume is mounted into a sandbox at creation (`workspaceRequirements.mounts: [{volume, path, readOnly}]`,
//! `path` at or under `/workspace`): read-only by any number of sandboxes, read-write by one at a time. When the
//! writer goes (its sandbox deleted, or the daemon lost with it), the recovery scan compares the volume's files with
//! the artifacts the writer emitted: uploaded, upload failed (retried while the sandbox's credentials are still
//! there), never reported (orphans); the result is the volume's `recovery`.
//!
//! The kernel side is the host's [`Disks`]: the daemon's is an ext4 filesystem in a file, loop-mounted, bound into
//! each sandbox with an idmapping (owner 0 on disk is the sandbox's own root).

use std::collections::{BTreeMap, HashMap};
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use agent_api::{CreateVolumeRequest, PluginError, Volume, VolumeAttachment, VolumeRecovery};
use serde::{Deserialize, Serialize};
use time::format_description::well_known::Rfc3339;
use time::OffsetDateTime;
use tracing::{error, info, warn};

use containers::agent::BoxFuture;

/// Any error of the host's [`Disks`].
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The smallest volume, MiB (room for ext4's own metadata and journal).
pub const MIN_VOLUME_MB: u64 = 8;
/// Paths each list of a recovery report holds at most.
const MAX_LISTED: usize = 1000;
/// Files the recovery scan looks at, at most.
const MAX_SCANNED: u64 = 100_000;
/// The metadata file.
const META: &str = "volume.json";
/// The writer's artifact records.
const RECORDS: &str = "artifacts.jsonl";

/// The kernel side of volumes, blocking calls each. `dir` is the volume's directory; its filesystem is mounted at
/// `dir/mnt` while the daemon runs.
pub trait Disks: Send + Sync + 'static {
    /// Creates an empty filesystem of `bytes` (its root owned by 0) in `dir`.
    fn create(&self, dir: &Path, bytes: u64) -> Result<(), BoxError>;
    /// Mounts it at `dir/mnt` unless it is mounted.
    fn mount(&self, dir: &Path) -> Result<(), BoxError>;
    /// Unmounts `dir/mnt` if it is mounted.
    fn unmount(&self, dir: &Path) -> Result<(), BoxError>;
    /// Binds `dir/mnt` onto the directory `target`, owner 0 shown as `host_id`, read-only when asked.
    fn attach(
        &self,
        dir: &Path,
        target: &Path,
        host_id: u32,
        read_only: bool,
    ) -> Result<(), BoxError>;
    /// Bytes in use on the mounted filesystem (0 when it is not mounted).
    fn used_bytes(&self, dir: &Path) -> u64;
}

/// A volume operation was refused or failed.
#[derive(Debug, thiserror::Error)]
pub enum VolumeError {
    /// No such volume.
    #[error("No volume {0:?}")]
    NotFound(String),
    /// A second writer.
    #[error("Volume {id} is mounted read-write by sandbox {writer}: one writer at a time")]
    Busy {
        /// The volume.
        id: String,
        /// The sandbox that writes it.
        writer: String,
    },
    /// Deleting a mounted volume.
    #[error("Volume {id} is mounted in {sandboxes} sandbox(es); delete them first")]
    InUse {
        /// The volume.
        id: String,
        /// How many sandboxes mount it.
        sandboxes: usize,
    },
    /// A malformed request (the message names the field).
    #[error("{0}")]
    Invalid(String),
    /// `agents.max_volumes` volumes exist.
    #[error("{0} volumes exist, the maximum (agents.max_volumes)")]
    Full(usize),
    /// The volume is being deleted.
    #[error("Volume {0} is being deleted")]
    Deleting(String),
    /// The host could not do it.
    #[error("Cannot {what} volume {id}")]
    Disk {
        /// What was asked.
        what: &'static str,
        /// The volume.
        id: String,
        /// Why.
        #[source]
        source: BoxError,
    },
}

impl VolumeError {
    /// The HTTP status and `PluginError` body it is answered with.
    pub fn plugin(&self) -> (u16, PluginError) {
        let message = runtime::error::Chain(self).to_string();
        match self {
            Self::NotFound(_) => (404, PluginError::invalid(message)),
            Self::Busy { .. } | Self::InUse { .. } | Self::Deleting(_) => {
                (409, PluginError::invalid(message))
            }
            Self::Invalid(_) => (400, PluginError::invalid(message)),
            Self::Full(_) => (
                503,
                PluginError::ProviderUnavailable {
                    message,
                    retryable: true,
                },
            ),
            Self::Disk { .. } => (
                503,
                PluginError::ProviderUnavailable {
                    message,
                    retryable: false,
                },
            ),
        }
    }
}

/// What `volume.json` holds.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Meta {
    id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    name: Option<String>,
    size_bytes: u64,
    created_at: String,
    /// The sandbox mounting it read-write, persisted so that a daemon that died with it scans at its next start.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    writer: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    recovery: Option<VolumeRecovery>,
}

/// One line of `artifacts.jsonl`: the volume's artifact history, across writers (compacted by each scan to one
/// line per file still there).
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Record {
    /// Path in the volume.
    path: String,
    uploaded: bool,
    /// The writer whose event it was.
    #[serde(default)]
    sandbox: String,
}

struct Entry {
    meta: Meta,
    attachments: Vec<VolumeAttachment>,
    deleting: bool,
    /// Its filesystem could not be mounted at the start: a lost writer's scan waits for a start that can.
    unmounted: bool,
}

/// Re-uploads a file of the volume (its path in the volume): true when it is uploaded now.
pub type Reupload<'a> = &'a (dyn Fn(String) -> BoxFuture<'a, bool> + Sync);

/// The volumes of this daemon.
pub struct Volumes {
    dir: PathBuf,
    disks: Arc<dyn Disks>,
    max_mb: u64,
    max_count: usize,
    entries: Mutex<BTreeMap<String, Entry>>,
    /// Creations one at a time (the count is checked with nothing in between).
    creating: tokio::sync::Mutex<()>,
    /// The disk work (mounts, `volume.json`, the records), one at a time: a metadata write reads the newest state
    /// under it, so the last write is always of the last change.
    disk: Mutex<()>,
}

impl Volumes {
    /// The volumes under `dir`, mounted; a volume whose writer was lost with the previous daemon is scanned first
    /// (blocking work, at start). `held` are the mounts of the sandboxes a previous daemon left and this one takes
    /// back (live restore), with their sandbox ids: they are the volumes' first attachments, and a writer among
    /// them is not lost (its sandbox's removal scans, or [`Self::drop_held`] if it cannot be taken back after all).
    /// A directory without `volume.json` (a creation that did not finish) is removed; a volume that cannot be read
    /// or mounted is logged and left as it is (its scan waits for a start that can).
    pub fn open(
        dir: PathBuf,
        disks: Arc<dyn Disks>,
        (max_mb, max_count): (u64, usize),
        held: &[(String, Mounted)],
    ) -> std::io::Result<Arc<Self>> {
        use std::os::unix::fs::DirBuilderExt as _;
        std::fs::DirBuilder::new()
            .mode(0o700)
            .recursive(true)
            .create(&dir)?;
        let mut entries = BTreeMap::new();
        for e in std::fs::read_dir(&dir)?.flatten() {
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                if let Some(entry) = open_one(&e.path(), &*disks, held) {
                    entries.insert(entry.meta.id.clone(), entry);
                }
            }
        }
        Ok(Arc::new(Self {
            dir,
            disks,
            max_mb,
            max_count,
            entries: Mutex::new(entries),
            creating: tokio::sync::Mutex::new(()),
            disk: Mutex::new(()),
        }))
    }

    fn entries(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, Entry>> {
        self.entries.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn disk(&self) -> std::sync::MutexGuard<'_, ()> {
        self.disk.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn path(&self, id: &str) -> PathBuf {
        self.dir.join(id)
    }

    /// Runs blocking disk work off the async threads.
    async fn blocking<T: Send + 'static>(
        self: &Arc<Self>,
        f: impl FnOnce(&Self) -> T + Send + 'static,
    ) -> Result<T, BoxError> {
        let this = self.clone();
        tokio::task::spawn_blocking(move || f(&this))
            .await
            .map_err(|e| e.to_string().into())
    }

    /// Writes volume `id`'s newest metadata (with the disk lock held).
    fn persist(&self, id: &str) -> std::io::Result<()> {
        let meta = self.entries().get(id).map(|e| e.meta.clone());
        match meta {
            Some(meta) => save(&self.path(id), &meta),
            None => Ok(()),
        }
    }

    /// Volumes as the API shows them (their usage read outside the registry's lock).
    fn views(&self, ids: Option<&str>) -> Vec<Volume> {
        let picked: Vec<Volume> = self
            .entries()
            .values()
            .filter(|e| ids.is_none_or(|id| e.meta.id == id))
            .map(|e| Volume {
                id: e.meta.id.clone(),
                name: e.meta.name.clone(),
                size_bytes: e.meta.size_bytes,
                used_bytes: 0,
                created_at: e.meta.created_at.clone(),
                attachments: e.attachments.clone(),
                recovery: e.meta.recovery.clone(),
            })
            .collect();
        picked
            .into_iter()
            .map(|mut v| {
                v.used_bytes = self.disks.used_bytes(&self.path(&v.id));
                v
            })
            .collect()
    }

    /// Whether volume `id` exists (and is not being deleted).
    pub fn contains(&self, id: &str) -> bool {
        self.entries().get(id).is_some_and(|e| !e.deleting)
    }

    /// Every volume, by id.
    pub fn list(&self) -> Vec<Volume> {
        self.views(None)
    }

    /// One volume.
    pub fn get(&self, id: &str) -> Result<Volume, VolumeError> {
        self.views(Some(id))
            .pop()
            .ok_or_else(|| VolumeError::NotFound(shown(id)))
    }

    /// `POST /volumes`: an empty volume of `sizeMb`, mounted.
    pub async fn create(self: &Arc<Self>, req: CreateVolumeRequest) -> Result<Volume, VolumeError> {
        if !(MIN_VOLUME_MB..=self.max_mb).contains(&req.size_mb) {
            return Err(VolumeError::Invalid(format!(
                "sizeMb must be from {MIN_VOLUME_MB} to {} (agents.volume_max_mb), not {}",
                self.max_mb, req.size_mb
            )));
        }
        if let Some(name) = &req.name {
            let ok = !name.is_empty()
                && name.len() <= 64
                && name
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b));
            if !ok {
                return Err(VolumeError::Invalid(
                    "name must be 1 to 64 letters, digits, '.', '_' or '-'".into(),
                ));
            }
        }
        let _one = self.creating.lock().await;
        let count = self.entries().len();
        if count >= self.max_count {
            return Err(VolumeError::Full(count));
        }
        let id = format!("vol-{}", &uuid::Uuid::new_v4().simple().to_string()[..16]);
        let meta = Meta {
            id: id.clone(),
            name: req.name,
            size_bytes: req.size_mb << 20,
            created_at: now(),
            writer: None,
            recovery: None,
        };
        let m = meta.clone();
        self.blocking(move |v| v.make(&m))
            .await
            .and_then(|r| r)
            .map_err(|e| disk("create", &id, e))?;
        info!(volume = %id, size_mb = req.size_mb, "volume created");
        self.entries().insert(
            id.clone(),
            Entry {
                meta,
                attachments: Vec::new(),
                deleting: false,
                unmounted: false,
            },
        );
        self.get(&id)
    }

    /// The directory, the filesystem, mounted, then `volume.json` (its presence marks a finished volume); on
    /// failure nothing is left.
    fn make(&self, meta: &Meta) -> Result<(), BoxError> {
        use std::os::unix::fs::DirBuilderExt as _;
        let _disk = self.disk();
        let dir = self.path(&meta.id);
        std::fs::DirBuilder::new().mode(0o700).create(&dir)?;
        let made = self
            .disks
            .create(&dir, meta.size_bytes)
            .and_then(|()| self.disks.mount(&dir))
            .and_then(|()| save(&dir, meta).map_err(Into::into));
        if made.is_err() {
            if let Err(e) = self
                .disks
                .unmount(&dir)
                .and_then(|()| std::fs::remove_dir_all(&dir).map_err(Into::into))
            {
                error!(volume = %meta.id, error = %e, "cannot remove a volume whose creation failed");
            }
        }
        made
    }

    /// `DELETE /volumes/<id>`: refused while a sandbox mounts it.
    pub async fn delete(self: &Arc<Self>, id: &str) -> Result<(), VolumeError> {
        {
            let mut entries = self.entries();
            let e = live(&mut entries, id)?;
            if !e.attachments.is_empty() {
                return Err(VolumeError::InUse {
                    id: id.to_owned(),
                    sandboxes: e.attachments.len(),
                });
            }
            e.deleting = true;
        }
        let owned = id.to_owned();
        let removed = self
            .blocking(move |v| -> Result<(), BoxError> {
                let _disk = v.disk();
                let dir = v.path(&owned);
                v.disks.unmount(&dir)?;
                // volume.json first: a removal cut short is then an unfinished volume, removed at the next start.
                std::fs::remove_file(dir.join(META))?;
                std::fs::remove_dir_all(&dir)?;
                Ok(())
            })
            .await
            .and_then(|r| r);
        let mut entries = self.entries();
        match removed {
            Ok(()) => {
                entries.remove(id);
                info!(volume = %id, "volume deleted");
                Ok(())
            }
            Err(e) => {
                if let Some(entry) = entries.get_mut(id) {
                    entry.deleting = false;
                }
                Err(disk("delete", id, e))
            }
        }
    }

    /// Mounts volume `id` onto `target` (a directory in sandbox `sandbox`'s fresh workspace, `path` inside, where
    /// nothing has run yet) for a sandbox whose root is host uid `host_id`. A second writer is refused.
    pub async fn attach(
        self: &Arc<Self>,
        id: &str,
        sandbox: &str,
        (target, path): (&Path, &str),
        host_id: u32,
        read_only: bool,
    ) -> Result<(), VolumeError> {
        let source = self.reserve(id, sandbox, path, read_only).await?;
        let target = target.to_owned();
        let done = self
            .blocking(move |v| v.disks.attach(&source, &target, host_id, read_only))
            .await
            .and_then(|r| r);
        if let Err(e) = done {
            self.release(id, sandbox, path, read_only).await;
            return Err(disk("mount", id, e));
        }
        Ok(())
    }

    /// Claims volume `id` for `holder` (an execution: `execution:<id>`) at `path`, mounted, for a container to
    /// bind; released when the claim is dropped (once the container is gone). A second writer is refused.
    pub async fn claim(
        self: &Arc<Self>,
        id: &str,
        holder: &str,
        path: &str,
        read_only: bool,
    ) -> Result<Claim, VolumeError> {
        let source = self.reserve(id, holder, path, read_only).await?;
        Ok(Claim {
            volumes: self.clone(),
            id: id.to_owned(),
            holder: holder.to_owned(),
            path: path.to_owned(),
            read_only,
            source: source.join("mnt"),
        })
    }

    /// Notes `holder`'s mount (a writer refused while there is one; a writer written to `volume.json` before it
    /// can write anything) and mounts the volume: its directory.
    async fn reserve(
        self: &Arc<Self>,
        id: &str,
        holder: &str,
        path: &str,
        read_only: bool,
    ) -> Result<PathBuf, VolumeError> {
        {
            let mut entries = self.entries();
            let e = live(&mut entries, id)?;
            if !read_only {
                if let Some(w) = e.attachments.iter().find(|a| !a.read_only) {
                    return Err(VolumeError::Busy {
                        id: id.to_owned(),
                        writer: w.sandbox_id.clone(),
                    });
                }
                e.meta.writer = Some(holder.to_owned());
            }
            e.attachments.push(VolumeAttachment {
                sandbox_id: holder.to_owned(),
                path: path.to_owned(),
                read_only,
            });
        }
        let owned = id.to_owned();
        let done = self
            .blocking(move |v| -> Result<PathBuf, BoxError> {
                let _disk = v.disk();
                let dir = v.path(&owned);
                v.persist(&owned)?;
                v.disks.mount(&dir)?;
                Ok(dir)
            })
            .await
            .and_then(|r| r);
        match done {
            Ok(dir) => Ok(dir),
            Err(e) => {
                self.release(id, holder, path, read_only).await;
                Err(disk("mount", id, e))
            }
        }
    }

    /// Forgets sandbox `sandbox`'s mount of volume `id` at `path` (its workspace, which held the bind, is gone); a
    /// writer's release is written to `volume.json`.
    pub async fn release(self: &Arc<Self>, id: &str, sandbox: &str, path: &str, read_only: bool) {
        {
            let mut entries = self.entries();
            let Some(e) = entries.get_mut(id) else {
                return;
            };
            if let Some(i) = e
                .attachments
                .iter()
                .position(|a| a.sandbox_id == sandbox && a.path == path && a.read_only == read_only)
            {
                e.attachments.remove(i);
            }
            if read_only || e.meta.writer.as_deref() != Some(sandbox) {
                return;
            }
            e.meta.writer = None;
        }
        let owned = id.to_owned();
        let saved = self
            .blocking(move |v| {
                let _disk = v.disk();
                v.persist(&owned)
            })
            .await;
        if !matches!(saved, Ok(Ok(()))) {
            error!(volume = %id, "cannot save a volume's metadata");
        }
    }

    /// A mount held by a sandbox a previous daemon left ([`Self::open`]'s `held`) that is not taken back after all:
    /// given back, and when the sandbox was the volume's writer, the volume is scanned as a lost writer's
    /// (`restart`; nothing is uploaded again) first. A volume that could not be mounted at the start keeps its
    /// writer, for the scan of a start that can mount it.
    pub async fn drop_held(self: &Arc<Self>, sandbox: &str, m: &Mounted) {
        let (writer, unmounted) = match self.entries().get(&m.volume) {
            Some(e) => (e.meta.writer.as_deref() == Some(sandbox), e.unmounted),
            None => return,
        };
        if writer && unmounted {
            if let Some(e) = self.entries().get_mut(&m.volume) {
                e.attachments.retain(|a| a.sandbox_id != sandbox);
            }
            return;
        }
        if writer && !m.read_only {
            let none = |_: String| -> BoxFuture<'_, bool> { Box::pin(async { false }) };
            self.recover(&m.volume, sandbox, "restart", &none).await;
        }
        self.release(&m.volume, sandbox, &m.path, m.read_only).await;
    }

    /// Notes what writer `sandbox`'s `ArtifactEvent` for `path` (in the volume) came to.
    pub async fn record_artifact(
        self: &Arc<Self>,
        id: &str,
        sandbox: &str,
        path: String,
        uploaded: bool,
    ) {
        let record = Record {
            path,
            uploaded,
            sandbox: sandbox.to_owned(),
        };
        let line = serde_json::to_string(&record).unwrap_or_default() + "\n";
        let owned = id.to_owned();
        let appended = self
            .blocking(move |v| {
                let _disk = v.disk();
                std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(v.path(&owned).join(RECORDS))
                    .and_then(|mut f| f.write_all(line.as_bytes()))
            })
            .await;
        if !matches!(appended, Ok(Ok(()))) {
            warn!(volume = %id, "cannot record an artifact for the recovery scan");
        }
    }

    /// The recovery scan after writer `sandbox` is gone (`reason`: `deleted` or `shutdown`): the files whose
    /// upload by this writer failed are given to `reupload` (its credentials); the report becomes the volume's
    /// `recovery`.
    pub async fn recover(
        self: &Arc<Self>,
        id: &str,
        sandbox: &str,
        reason: &str,
        reupload: Reupload<'_>,
    ) {
        let (owned, s, r) = (id.to_owned(), sandbox.to_owned(), reason.to_owned());
        let Ok(mut scanned) = self.blocking(move |v| scan(&v.path(&owned), &s, &r)).await else {
            error!(volume = %id, "the recovery scan panicked");
            return;
        };
        let report = &mut scanned.report;
        for path in std::mem::take(&mut report.not_uploaded) {
            let rec = scanned.kept.iter_mut().find(|k| k.path == path);
            let mine = rec.as_ref().is_some_and(|k| k.sandbox == sandbox);
            if mine && reupload(path.clone()).await {
                if let Some(k) = rec {
                    k.uploaded = true;
                }
                report.reuploaded.push(path);
            } else {
                report.not_uploaded.push(path);
            }
        }
        info!(volume = %id, sandbox, files = report.files, uploaded = report.uploaded,
            reuploaded = report.reuploaded.len(), not_uploaded = report.not_uploaded.len(),
            orphans = report.orphans.len(), "recovery scan");
        if let Some(e) = self.entries().get_mut(id) {
            e.meta.recovery = Some(scanned.report.clone());
        }
        let owned = id.to_owned();
        let saved = self
            .blocking(move |v| {
                let _disk = v.disk();
                if scanned.complete {
                    write_records(&v.path(&owned), &scanned.kept)?;
                }
                v.persist(&owned)
            })
            .await;
        if !matches!(saved, Ok(Ok(()))) {
            error!(volume = %id, "cannot save a volume's recovery report");
        }
    }
}

/// A volume claimed for an execution's container ([`Volumes::claim`]); dropping it releases the volume.
pub struct Claim {
    volumes: Arc<Volumes>,
    id: String,
    holder: String,
    path: String,
    read_only: bool,
    source: PathBuf,
}

impl Claim {
    /// The volume's filesystem on the host, to bind (with the container's idmapping).
    pub fn source(&self) -> &Path {
        &self.source
    }

    /// Where it goes inside.
    pub fn path(&self) -> &str {
        &self.path
    }

    /// Whether it is mounted read-only.
    pub fn read_only(&self) -> bool {
        self.read_only
    }

    /// Gives the volume back now: when this returns, the volume no longer lists the holder and another writer (or
    /// a deletion) is let in. Dropping a claim does the same in a task of its own.
    pub async fn release(mut self) {
        let (id, holder, path) = self.take();
        self.volumes
            .release(&id, &holder, &path, self.read_only)
            .await;
    }

    /// Empties the claim (its drop then does nothing): the volume's id, the holder and the path.
    fn take(&mut self) -> (String, String, String) {
        (
            std::mem::take(&mut self.id),
            std::mem::take(&mut self.holder),
            std::mem::take(&mut self.path),
        )
    }
}

impl std::fmt::Debug for Claim {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Claim")
            .field("volume", &self.id)
            .field("holder", &self.holder)
            .field("path", &self.path)
            .field("read_only", &self.read_only)
            .finish()
    }
}

impl Drop for Claim {
    fn drop(&mut self) {
        let (id, holder, path) = self.take();
        if id.is_empty() {
            return; // released already
        }
        let (volumes, read_only) = (self.volumes.clone(), self.read_only);
        match tokio::runtime::Handle::try_current() {
            Ok(rt) => {
                rt.spawn(async move { volumes.release(&id, &holder, &path, read_only).await });
            }
            Err(_) => {
                error!(volume = %id, holder, "a volume claim dropped outside the runtime stays held")
            }
        }
    }
}

/// One volume found at start (blocking): mounted, with the attachments of the sandboxes taken back (`held`), and
/// scanned when its writer was lost (not among them); `None` when it is not a volume (an unfinished one is
/// removed) or cannot be read.
fn open_one(path: &Path, disks: &dyn Disks, held: &[(String, Mounted)]) -> Option<Entry> {
    let meta = match std::fs::read(path.join(META)) {
        Ok(bytes) => match serde_json::from_slice::<Meta>(&bytes) {
            Ok(m) => m,
            Err(err) => {
                error!(path = %path.display(), error = %err, "unreadable volume metadata; volume left as it is");
                return None;
            }
        },
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => {
            warn!(path = %path.display(), "removing an unfinished volume");
            let removed = disks
                .unmount(path)
                .and_then(|()| std::fs::remove_dir_all(path).map_err(Into::into));
            if let Err(err) = removed {
                error!(path = %path.display(), error = %err, "cannot remove an unfinished volume");
            }
            return None;
        }
        Err(err) => {
            error!(path = %path.display(), error = %err, "cannot read a volume's metadata; volume left as it is");
            return None;
        }
    };
    let attachments: Vec<VolumeAttachment> = held
        .iter()
        .filter(|(_, m)| m.volume == meta.id)
        .map(|(sandbox, m)| VolumeAttachment {
            sandbox_id: sandbox.clone(),
            path: m.path.clone(),
            read_only: m.read_only,
        })
        .collect();
    let kept_writer = meta.writer.as_ref().is_some_and(|w| {
        attachments
            .iter()
            .any(|a| &a.sandbox_id == w && !a.read_only)
    });
    let mut entry = Entry {
        meta,
        attachments,
        deleting: false,
        unmounted: false,
    };
    if let Err(err) = disks.mount(path) {
        // Its scan, if one is due, waits for a start that can mount it.
        error!(volume = %entry.meta.id, error = %err, "cannot mount a volume");
        entry.unmounted = true;
        return Some(entry);
    }
    if kept_writer {
        info!(volume = %entry.meta.id, sandbox = ?entry.meta.writer, "volume's writer taken back");
    } else if let Some(writer) = entry.meta.writer.clone() {
        let scanned = scan(path, &writer, "restart");
        warn!(volume = %entry.meta.id, sandbox = %writer, orphans = scanned.report.orphans.len(),
            not_uploaded = scanned.report.not_uploaded.len(), "recovery scan of a volume whose writer was lost");
        entry.meta.recovery = Some(scanned.report);
        entry.meta.writer = None;
        let saved = if scanned.complete {
            write_records(path, &scanned.kept)
        } else {
            Ok(())
        }
        .and_then(|()| save(path, &entry.meta));
        if let Err(err) = saved {
            error!(volume = %entry.meta.id, error = %err, "cannot save a volume's recovery report");
        }
    }
    Some(entry)
}

/// Volume `id`, unless it is unknown or being deleted.
fn live<'a>(
    entries: &'a mut BTreeMap<String, Entry>,
    id: &str,
) -> Result<&'a mut Entry, VolumeError> {
    let e = entries
        .get_mut(id)
        .ok_or_else(|| VolumeError::NotFound(shown(id)))?;
    if e.deleting {
        return Err(VolumeError::Deleting(id.to_owned()));
    }
    Ok(e)
}

/// What a scan found.
struct Scanned {
    report: VolumeRecovery,
    /// The records of the files still there (one per file).
    kept: Vec<Record>,
    /// Every file was seen (nothing unreadable, nothing cut): only then may `kept` replace the records.
    complete: bool,
}

/// Compares the files on the volume (its filesystem at `dir/mnt`) with the artifact records (blocking). A path's
/// last record counts.
fn scan(dir: &Path, sandbox: &str, reason: &str) -> Scanned {
    let mut records: HashMap<String, Record> = HashMap::new();
    if let Ok(text) = std::fs::read_to_string(dir.join(RECORDS)) {
        for line in text.lines() {
            if let Ok(r) = serde_json::from_str::<Record>(line) {
                records.insert(r.path.clone(), r);
            }
        }
    }
    let mut out = Scanned {
        report: VolumeRecovery {
            at: now(),
            sandbox_id: sandbox.to_owned(),
            reason: reason.to_owned(),
            ..VolumeRecovery::default()
        },
        kept: Vec::new(),
        complete: true,
    };
    let listed = |list: &mut Vec<String>, path: String, truncated: &mut bool| {
        if list.len() < MAX_LISTED {
            list.push(path);
        } else {
            *truncated = true;
        }
    };
    let root = dir.join("mnt");
    let mut stack = vec![PathBuf::new()];
    while let Some(rel) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(root.join(&rel)) else {
            out.complete = false;
            continue;
        };
        for e in entries {
            let Ok(e) = e else {
                out.complete = false;
                continue;
            };
            let Ok(kind) = e.file_type() else {
                out.complete = false;
                continue;
            };
            let path = rel.join(e.file_name());
            if kind.is_dir() {
                if !(rel.as_os_str().is_empty() && e.file_name() == "lost+found") {
                    stack.push(path);
                }
                continue;
            }
            if !kind.is_file() {
                continue;
            }
            let report = &mut out.report;
            if report.files >= MAX_SCANNED {
                report.truncated = true;
                out.complete = false;
                return out;
            }
            report.files += 1;
            let path = path.to_string_lossy().into_owned();
            match records.remove(&path) {
                Some(r) => {
                    if r.uploaded {
                        report.uploaded += 1;
                    } else {
                        listed(&mut report.not_uploaded, path, &mut report.truncated);
                    }
                    out.kept.push(r);
                }
                None => listed(&mut report.orphans, path, &mut report.truncated),
            }
        }
    }
    out.report.orphans.sort();
    out.report.not_uploaded.sort();
    out
}

/// Replaces the artifact records with `records`.
fn write_records(dir: &Path, records: &[Record]) -> std::io::Result<()> {
    let mut text = String::new();
    for r in records {
        text += &serde_json::to_string(r).map_err(std::io::Error::other)?;
        text.push('\n');
    }
    let tmp = dir.join(".artifacts.jsonl.new");
    std::fs::write(&tmp, text)?;
    std::fs::rename(&tmp, dir.join(RECORDS))
}

/// Writes `volume.json` (a new file renamed over the old one).
fn save(dir: &Path, meta: &Meta) -> std::io::Result<()> {
    let tmp = dir.join(".volume.json.new");
    std::fs::write(
        &tmp,
        serde_json::to_vec_pretty(meta).map_err(std::io::Error::other)?,
    )?;
    std::fs::rename(&tmp, dir.join(META))
}

fn disk(what: &'static str, id: &str, source: BoxError) -> VolumeError {
    VolumeError::Disk {
        what,
        id: id.to_owned(),
        source,
    }
}

/// An id as an error message shows it (bounded).
fn shown(id: &str) -> String {
    id.chars().take(64).collect()
}

fn now() -> String {
    OffsetDateTime::now_utc()
        .format(&Rfc3339)
        .unwrap_or_default()
}

/// A volume mounted into a sandbox.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Mounted {
    /// The volume's id.
    pub volume: String,
    /// Path inside the sandbox.
    pub path: String,
    /// That path relative to `/workspace` (empty for `/workspace` itself).
    pub rel: String,
    /// Mounted read-only.
    pub read_only: bool,
}

impl Mounted {
    /// The path in this volume of sandbox path `uri`, when it lies in it.
    pub fn inside(&self, uri: &str) -> Option<String> {
        let rest = uri.strip_prefix(&self.path)?.strip_prefix('/')?;
        (!rest.is_empty()).then(|| rest.to_owned())
    }
}

/// Checks a sandbox's mounts (`workspaceRequirements.mounts`): each a volume, at or under `/workspace`, none
/// inside another, no template file inside one. A `hostPath` mount is `capability_unsupported`.
pub fn plan(
    mounts: &[agent_api::WorkspaceMount],
    have_volumes: bool,
    files: &[&str],
) -> Result<Vec<Mounted>, PluginError> {
    let mut planned: Vec<Mounted> = Vec::with_capacity(mounts.len());
    for (i, m) in mounts.iter().enumerate() {
        let field = format!("workspaceRequirements.mounts[{i}]");
        let volume = match (&m.volume, &m.host_path) {
            (Some(v), None) => v.clone(),
            (None, Some(_)) => {
                return Err(PluginError::CapabilityUnsupported {
                    capability: "mounts".into(),
                })
            }
            (None, None) => {
                return Err(PluginError::invalid(format!(
                    "{field}: names neither a volume nor a hostPath"
                )))
            }
            (Some(_), Some(_)) => {
                return Err(PluginError::invalid(format!(
                    "{field}: volume and hostPath exclude each other"
                )))
            }
        };
        if !have_volumes {
            return Err(PluginError::CapabilityUnsupported {
                capability: "volumes".into(),
            });
        }
        let rel = mount_place(&m.sandbox_path)
            .map_err(|e| PluginError::invalid(format!("{field}.sandboxPath: {e}")))?;
        if let Some(other) = planned
            .iter()
            .find(|p| protocol::paths_overlap(&p.rel, &rel) || p.volume == volume)
        {
            return Err(PluginError::invalid(format!(
                "{field}: overlaps the mount of {} at {}",
                other.volume, other.path
            )));
        }
        planned.push(Mounted {
            volume,
            path: m.sandbox_path.clone(),
            rel,
            read_only: m.read_only,
        });
    }
    if let Some((f, m)) = files.iter().find_map(|f| {
        planned
            .iter()
            .find(|m| protocol::paths_overlap(f, &m.rel))
            .map(|m| (f, m))
    }) {
        return Err(PluginError::invalid(format!(
            "template.files: {f} lies in the volume mounted at {}",
            m.path
        )));
    }
    Ok(planned)
}

/// The place of a mount at `path` (at or under `/workspace`): its path relative to `/workspace` (empty for
/// `/workspace` itself), or why it is refused.
pub fn mount_place(path: &str) -> Result<String, String> {
    let rest = path
        .strip_prefix(runtime::rootfs::WORKDIR)
        .ok_or_else(|| format!("{path:?} is not at or under {}", runtime::rootfs::WORKDIR))?;
    if rest.is_empty() {
        return Ok(String::new());
    }
    let rel = rest
        .strip_prefix('/')
        .ok_or_else(|| format!("{path:?} is not at or under {}", runtime::rootfs::WORKDIR))?;
    protocol::validate_relative_path(rel).map_err(|e| format!("{path:?}: {e}"))?;
    Ok(rel.to_owned())
}

#[cfg(test)]
mod tests;

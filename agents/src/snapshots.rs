//! Snapshots (`POST /sandboxes/<id>/snapshot`): a sandbox's `/workspace` as it was at one moment, stored under
//! `<state_dir>/snapshots/<id>/` (`snapshot.json` and the files in `layer/`, owned by 0) until it is deleted, across
//! restarts of the daemon. A sandbox started from one (`fromSnapshot`, or `POST /sandboxes/<id>/fork`) gets the layer
//! as the read-only lower layer of an overlay `/workspace` whose upper layer is its own tmpfs: nothing is copied, the
//! files show as owned by the sandbox's root (an idmapped bind), and what it changes never reaches the snapshot.
//!
//! Taking one copies the workspace once (it lives on a tmpfs that goes with its sandbox), with the sandbox frozen so
//! that the copy is of one moment, and hashes it on the way into its digest ([`copy_tree_durable`], in
//! `runtime::tree`). The copy is made durable by fsyncs of its own files and directories before its record is
//! named, not by a `syncfs` of the state disk, which would wait for whatever else (other sandboxes' snapshots, the
//! images, any other writer) is unwritten on that filesystem.
//! On an OCI image it also copies the root's upper layer into `root/` ([`runtime::tree::copy_layer`]: whiteouts and
//! opaque directories kept, the sandbox's root stored as 0), which a sandbox started from the snapshot gets as the
//! first content of its own upper layer, on the same image only.
//!
//! A snapshot that sandboxes were started from is kept while any of them exists: `DELETE` is refused (409) until
//! they are gone. A directory without `snapshot.json` is one whose copy never finished: removed at start.

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use agent_api::{PluginError, RootLayer, Snapshot};

use crate::cow::CowStore;
use runtime::tree::{copy_layer, copy_layer_durable, copy_tree_durable, sync_tree, LayerOwners};
pub use runtime::tree::{copy_tree, walk_tree, Copied};
use time::format_description::well_known::Rfc3339;
use time::OffsetDateTime;
use tracing::{info, warn};

/// The metadata file of a finished snapshot.
const META: &str = "snapshot.json";
/// The directory holding its files.
const LAYER: &str = "layer";
/// The directory holding its copy of the sandbox's root layer, when it has one.
const ROOT: &str = "root";

/// A sandbox's root layer to take with its workspace: the upper directory of its overlay root as the host sees it,
/// and the host id that is root in its containers (the layer's files it owns are stored as owned by 0).
#[derive(Debug, Clone)]
pub struct RootUpper {
    /// The upper directory.
    pub upper: PathBuf,
    /// The sandbox's host id.
    pub host_id: u32,
}

/// A snapshot operation was refused or failed.
#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    /// No such snapshot.
    #[error("No snapshot {0:?}")]
    NotFound(String),
    /// Deleting one that sandboxes were started from.
    #[error("Snapshot {id} is used by {sandboxes} sandbox(es); delete them first")]
    InUse {
        /// The snapshot.
        id: String,
        /// How many sandboxes use it.
        sandboxes: usize,
    },
    /// It is being deleted.
    #[error("Snapshot {0} is being deleted")]
    Deleting(String),
    /// `agents.max_snapshots` snapshots exist (or are being taken).
    #[error("{0} snapshots exist, the maximum (agents.max_snapshots)")]
    Full(usize),
    /// The workspace (with the root's layer) holds more than a snapshot may.
    #[error("The workspace and the root's layer hold more than {0} bytes, the most a snapshot holds (agents.disk_mb)")]
    TooLarge(u64),
    /// A sandbox would start from a snapshot with a root layer on another image than the snapshot's.
    #[error("Snapshot {id} holds a root layer of image {image:?}; a sandbox from it runs on that image, not {asked:?}")]
    OtherImage {
        /// The snapshot.
        id: String,
        /// Its image.
        image: String,
        /// The image asked for.
        asked: String,
    },
    /// A workspace of the copy-on-write store would start from a snapshot holding more than its quota.
    #[error(
        "Snapshot {id} holds {bytes} bytes, more than the sandbox's diskMb ({max_bytes} bytes)"
    )]
    Larger {
        /// The snapshot.
        id: String,
        /// What it holds.
        bytes: u64,
        /// The sandbox's quota.
        max_bytes: u64,
    },
    /// The sandbox's agent could not be frozen for the copy.
    #[error("Cannot freeze the agent for the snapshot: {0}")]
    Freeze(String),
    /// This host cannot start workspaces from snapshots (the reason).
    #[error("Snapshots are not available on this host: {0}")]
    Unsupported(String),
    /// The store could not do it.
    #[error("Cannot {what} snapshot {id}")]
    Store {
        /// What was asked.
        what: &'static str,
        /// The snapshot.
        id: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

impl SnapshotError {
    /// The HTTP status and `PluginError` body it is answered with.
    pub fn plugin(&self) -> (u16, PluginError) {
        let message = runtime::error::Chain(self).to_string();
        match self {
            Self::NotFound(_) => (404, PluginError::invalid(message)),
            Self::Unsupported(_) => (
                422,
                PluginError::CapabilityUnsupported {
                    capability: "snapshots".into(),
                },
            ),
            Self::InUse { .. }
            | Self::Deleting(_)
            | Self::TooLarge(_)
            | Self::Larger { .. }
            | Self::OtherImage { .. } => (409, PluginError::invalid(message)),
            Self::Full(_) => (
                503,
                PluginError::ProviderUnavailable {
                    message,
                    retryable: true,
                },
            ),
            Self::Store { .. } | Self::Freeze(_) => (
                503,
                PluginError::ProviderUnavailable {
                    message,
                    retryable: false,
                },
            ),
        }
    }
}

/// What `snapshot.json` holds.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct Meta {
    id: String,
    digest: String,
    bytes: u64,
    files: u64,
    image: String,
    source: String,
    created_at: String,
    #[serde(default)]
    skipped: Vec<String>,
    /// Its files are a read-only snapshot in the copy-on-write store (not `layer/`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    cow: bool,
    /// Its copy of the sandbox's root layer (in `root/`), when there was anything in it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    root: Option<RootLayer>,
    /// What that copy was charged (as [`Copied::charged`]): what a copy of it takes of a tmpfs.
    #[serde(default, skip_serializing_if = "is_zero")]
    root_charged: u64,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

struct Entry {
    meta: Meta,
    /// Sandboxes started from it that exist now.
    users: BTreeSet<String>,
    deleting: bool,
}

/// The daemon's snapshots.
pub struct Snapshots {
    dir: PathBuf,
    max: usize,
    entries: Mutex<BTreeMap<String, Entry>>,
    /// Snapshots being taken (they count against `max`).
    taking: Mutex<usize>,
    /// The copy-on-write store, when workspaces are in one.
    cow: Option<Arc<dyn CowStore>>,
}

/// A snapshot made in the copy-on-write store ([`Snapshots::capture`]) whose files are not yet walked: finished by
/// [`Snapshots::finish`] (dropped unfinished, it is removed).
pub struct Captured {
    snapshots: Arc<Snapshots>,
    meta: Option<Meta>,
    files: PathBuf,
    /// The most it may hold (as [`copy_tree`] counts).
    max_bytes: u64,
}

impl Snapshots {
    /// Opens `dir` (created if missing): every finished snapshot in it is there again; unfinished ones are removed,
    /// and so are the files in the copy-on-write store `cow` of a snapshot that is not there (or a snapshot there
    /// whose files are gone).
    pub fn open(
        dir: PathBuf,
        max: usize,
        cow: Option<Arc<dyn CowStore>>,
    ) -> std::io::Result<Arc<Self>> {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&dir)?;
        let mut entries = BTreeMap::new();
        for e in std::fs::read_dir(&dir)? {
            let path = e?.path();
            let meta = std::fs::read(path.join(META))
                .ok()
                .and_then(|b| serde_json::from_slice::<Meta>(&b).ok())
                .filter(|m| path.file_name() == Some(m.id.as_ref()))
                .filter(|m| match (&cow, m.cow) {
                    (Some(cow), true) => {
                        let there = cow.snapshot_path(&m.id).is_dir();
                        if !there {
                            warn!(snapshot = %m.id, "its files in the workspace store are gone");
                        }
                        there
                    }
                    _ => true,
                });
            match meta {
                Some(meta) => {
                    entries.insert(
                        meta.id.clone(),
                        Entry {
                            meta,
                            users: BTreeSet::new(),
                            deleting: false,
                        },
                    );
                }
                None => {
                    warn!(path = %path.display(), "removing an unfinished snapshot");
                    if let Err(e) = remove_all(&path) {
                        warn!(path = %path.display(), error = %e, "cannot remove an unfinished snapshot");
                    }
                }
            }
        }
        if let Some(cow) = &cow {
            for id in cow.list().1 {
                if !entries.get(&id).is_some_and(|e| e.meta.cow) {
                    warn!(snapshot = %id, "removing a snapshot's files the store has no record of");
                    if let Err(e) = cow.destroy(&cow.snapshot_path(&id)) {
                        warn!(snapshot = %id, error = %e, "cannot remove a snapshot's files");
                    }
                }
            }
        }
        if !entries.is_empty() {
            info!(snapshots = entries.len(), "snapshots found");
        }
        Ok(Arc::new(Self {
            dir,
            max,
            entries: Mutex::new(entries),
            taking: Mutex::new(0),
            cow,
        }))
    }

    fn entries(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, Entry>> {
        self.entries.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn taking(&self) -> std::sync::MutexGuard<'_, usize> {
        self.taking.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Every snapshot, by id.
    pub fn list(&self) -> Vec<Snapshot> {
        self.entries().values().map(view).collect()
    }

    /// One snapshot.
    pub fn get(&self, id: &str) -> Result<Snapshot, SnapshotError> {
        self.entries()
            .get(id)
            .map(view)
            .ok_or_else(|| SnapshotError::NotFound(id.into()))
    }

    /// Copies the directory `workspace` (the sandbox `source`'s `/workspace` as the host sees it, which must not
    /// change meanwhile: its sandbox is frozen) and its root layer `root`, if it has one, into a new snapshot of
    /// image `image`, each of at most `max_bytes`.
    pub async fn take(
        self: &Arc<Self>,
        (workspace, root): (PathBuf, Option<RootUpper>),
        image: &str,
        source: &str,
        max_bytes: u64,
    ) -> Result<Snapshot, SnapshotError> {
        self.reserve()?;
        let mut meta = new_meta(image, source, false);
        let id = meta.id.clone();
        let (final_dir, partial) = (self.dir.join(&id), self.dir.join(format!("{id}.partial")));
        let m = meta.clone();
        let made = tokio::task::spawn_blocking(move || -> std::io::Result<Meta> {
            let made = store(
                (&workspace, root.as_ref()),
                (&partial, &final_dir),
                m,
                max_bytes,
            );
            if made.is_err() {
                let _ = remove_all(&partial);
            }
            made
        })
        .await
        .unwrap_or_else(|e| Err(std::io::Error::other(e.to_string())));
        meta = match made {
            Ok(meta) => meta,
            Err(source) => {
                *self.taking() -= 1;
                return Err(taking_failed(source, id, max_bytes));
            }
        };
        info!(snapshot = %id, sandbox = source, bytes = meta.bytes, files = meta.files, "snapshot taken");
        // Listed before it stops counting as being taken: `max` holds at every moment.
        let snapshot = self.insert(meta);
        *self.taking() -= 1;
        Ok(snapshot)
    }

    /// Counts a snapshot being taken, unless `max` exist or are being taken.
    fn reserve(&self) -> Result<(), SnapshotError> {
        let mut taking = self.taking();
        let n = self.entries().len() + *taking;
        if n >= self.max {
            return Err(SnapshotError::Full(n));
        }
        *taking += 1;
        Ok(())
    }

    fn insert(&self, meta: Meta) -> Snapshot {
        let snapshot = view_meta(&meta, &BTreeSet::new());
        self.entries().insert(
            meta.id.clone(),
            Entry {
                meta,
                users: BTreeSet::new(),
                deleting: false,
            },
        );
        snapshot
    }

    /// Makes a snapshot of the copy-on-write store's workspace `workspace` (of sandbox `source`, on image
    /// `image`), in constant time: the moment it shows, so its sandbox is frozen meanwhile. [`Self::finish`] walks
    /// it once the sandbox is thawed, and refuses it when it holds more than `max_bytes` (as a copy counts them:
    /// the size of each file, not the blocks it takes, so a sparse, linked or compressed file counts in full).
    pub async fn capture(
        self: &Arc<Self>,
        (workspace, root): (PathBuf, Option<RootUpper>),
        (image, source): (&str, &str),
        max_bytes: u64,
    ) -> Result<Captured, SnapshotError> {
        let Some(cow) = self.cow.clone() else {
            return Err(SnapshotError::Unsupported(
                "the workspace store is off (agents.workspace_store)".into(),
            ));
        };
        self.reserve()?;
        let mut meta = new_meta(image, source, true);
        let (id, dir) = (meta.id.clone(), self.dir.join(&meta.id));
        // Its directory is made now (its record is written into it once its files are walked; a directory without
        // one is removed at the next start), with the root layer, which is on the sandbox's tmpfs: copied while
        // the sandbox is frozen. A sandbox started from it may copy that layer before the record is written.
        let made = tokio::task::spawn_blocking(move || {
            let files = cow.snapshot(&workspace, &id).map_err(std::io::Error::other)?;
            let root = std::fs::DirBuilder::new()
                .mode(0o700)
                .create(&dir)
                .and_then(|()| copy_root(root.as_ref(), &dir, max_bytes, false));
            match root {
                Ok((root, charged)) => Ok((files, root, charged)),
                Err(e) => {
                    let _ = remove_all(&dir);
                    if let Err(e) = cow.destroy(&files) {
                        warn!(snapshot = %id, error = %e, "cannot remove an unfinished snapshot's files");
                    }
                    Err(e)
                }
            }
        })
        .await
        .unwrap_or_else(|e| Err(std::io::Error::other(e.to_string())));
        match made {
            Ok((files, root, charged)) => {
                (meta.root, meta.root_charged) = (root, charged);
                Ok(Captured {
                    snapshots: self.clone(),
                    meta: Some(meta),
                    files,
                    max_bytes,
                })
            }
            Err(source) => {
                *self.taking() -= 1;
                Err(match source.kind() {
                    std::io::ErrorKind::FileTooLarge => SnapshotError::TooLarge(max_bytes),
                    _ => SnapshotError::Store {
                        what: "take",
                        id: meta.id,
                        source,
                    },
                })
            }
        }
    }

    /// Walks a captured snapshot's files for its bytes, entries and digest ([`walk_tree`], the digest a copy of
    /// the same tree gets) and records it. With `later` (a fork, which must not wait for the hash of every byte)
    /// the digest is computed after the return: the snapshot shows `digest: ""` until then, and is recorded on
    /// disk only then (a daemon that ends before it does not find it again).
    pub async fn finish(
        self: &Arc<Self>,
        mut captured: Captured,
        later: bool,
    ) -> Result<Snapshot, SnapshotError> {
        let Some(meta) = captured.meta.clone() else {
            return Err(SnapshotError::NotFound(String::new()));
        };
        let id = meta.id.clone();
        let (files, max_bytes) = (captured.files.clone(), captured.max_bytes);
        let (this, f) = (self.clone(), files.clone());
        let walked =
            tokio::task::spawn_blocking(move || this.record(&f, meta, (!later, false), max_bytes))
                .await
                .unwrap_or_else(|e| Err(std::io::Error::other(e.to_string())));
        let meta = match walked {
            Ok(meta) => meta,
            // `captured` goes unfinished: its files are removed and it stops counting.
            Err(source) => return Err(taking_failed(source, id, max_bytes)),
        };
        info!(snapshot = %id, sandbox = %meta.source, bytes = meta.bytes, files = meta.files, "snapshot taken (copy-on-write)");
        // Finished; listed before it stops counting as being taken: `max` holds at every moment.
        captured.meta = None;
        let snapshot = self.insert(meta.clone());
        *self.taking() -= 1;
        if later {
            let this = self.clone();
            tokio::task::spawn_blocking(move || {
                if let Err(e) = this.record(&files, meta, (true, true), max_bytes) {
                    warn!(snapshot = %id, error = %e, "cannot hash a snapshot; it is not kept after the daemon");
                }
            });
        }
        Ok(snapshot)
    }

    /// Walks `files` into `meta`'s sizes, and with `hash` its digest, then (with `hash`) writes its record
    /// (blocking); more than `max_bytes` is an error of kind `FileTooLarge`. With `listed` (it was listed before its digest) a snapshot deleted meanwhile is not recorded.
    fn record(
        &self,
        files: &Path,
        mut meta: Meta,
        (hash, listed): (bool, bool),
        max_bytes: u64,
    ) -> std::io::Result<Meta> {
        let walked = walk_tree(files, None, max_bytes, hash)?;
        meta.bytes = walked.bytes;
        meta.files = walked.files;
        meta.skipped = walked.skipped;
        if !hash {
            return Ok(meta);
        }
        meta.digest = walked.digest;
        let id = meta.id.clone();
        let dir = self.dir.join(&id);
        if listed && self.entries().get(&id).is_none_or(|e| e.deleting) {
            return Ok(meta);
        }
        // The root layer was copied while the sandbox was frozen, and made durable only now, after its thaw.
        if meta.root.is_some() {
            sync_tree(&dir.join(ROOT))?;
        }
        // Written beside and renamed: a directory holds a whole record or none.
        let new = format!("{META}.new");
        write_meta_file(&dir, &new, &meta)?;
        std::fs::rename(dir.join(&new), dir.join(META))?;
        std::fs::File::open(&dir)?.sync_all()?;
        if let Some(e) = self.entries().get_mut(&id) {
            e.meta.digest = meta.digest.clone();
        }
        Ok(meta)
    }

    /// Notes that sandbox `sandbox` starts from snapshot `id`: its layer (to mount) and its image. Given back by
    /// [`Self::release`].
    pub fn acquire(&self, id: &str, sandbox: &str) -> Result<(PathBuf, String), SnapshotError> {
        let mut entries = self.entries();
        let e = usable(&mut entries, id)?;
        let layer = match (e.meta.cow, &self.cow) {
            (false, _) => self.dir.join(id).join(LAYER),
            (true, Some(cow)) => cow.snapshot_path(id),
            (true, None) => {
                return Err(SnapshotError::Unsupported(format!(
                    "snapshot {id}'s files are in the btrfs workspace store, which is off (agents.workspace_store)"
                )))
            }
        };
        e.users.insert(sandbox.to_owned());
        Ok((layer, e.meta.image.clone()))
    }

    /// Snapshot `id`'s files in the copy-on-write store, to make a workspace of at most `max_bytes` from (a
    /// writable copy: nothing of the snapshot is used after, so it is not held; its files count against the
    /// workspace's quota, so a snapshot of more is refused); `None` when it is a copy (started from through
    /// [`Self::acquire`]).
    pub fn cow_source(&self, id: &str, max_bytes: u64) -> Result<Option<PathBuf>, SnapshotError> {
        let mut entries = self.entries();
        let e = usable(&mut entries, id)?;
        if !e.meta.cow || self.cow.is_none() {
            return Ok(None);
        }
        if e.meta.bytes > max_bytes {
            return Err(SnapshotError::Larger {
                id: id.into(),
                bytes: e.meta.bytes,
                max_bytes,
            });
        }
        Ok(self.cow.as_ref().map(|cow| cow.snapshot_path(id)))
    }

    /// Snapshot `id`'s root layer, if it has one, for sandbox `sandbox` on image `image` whose tmpfs holds
    /// `max_bytes`: refused for another image than the snapshot's, or for a layer whose copy would take more. It is
    /// copied into the sandbox's tmpfs, so the snapshot is held only until the returned guard is dropped, once the
    /// copy is made (listed in `usedBy` as `<sandbox>:creating` meanwhile).
    pub fn root_layer(
        self: &Arc<Self>,
        id: &str,
        (sandbox, image): (&str, &str),
        max_bytes: u64,
    ) -> Result<Option<(PathBuf, Hold)>, SnapshotError> {
        let holder = format!("{sandbox}:creating");
        let mut entries = self.entries();
        let e = usable(&mut entries, id)?;
        let Some(root) = &e.meta.root else {
            return Ok(None);
        };
        if e.meta.image != image {
            return Err(SnapshotError::OtherImage {
                id: id.into(),
                image: e.meta.image.clone(),
                asked: image.into(),
            });
        }
        // As the copy charges it: its content and a block per other entry, and no more entries than fit.
        if e.meta.root_charged.max(root.bytes) > max_bytes
            || root.files >= runtime::spec::inodes_for(max_bytes)
        {
            return Err(SnapshotError::Larger {
                id: id.into(),
                bytes: e.meta.root_charged.max(root.bytes),
                max_bytes,
            });
        }
        e.users.insert(holder.clone());
        let hold = Hold {
            snapshots: self.clone(),
            holder,
        };
        Ok(Some((self.dir.join(id).join(ROOT), hold)))
    }

    /// Whether snapshot `id` exists.
    pub fn contains(&self, id: &str) -> bool {
        self.entries().contains_key(id)
    }

    /// [`Self::acquire`] for a holder that is not a sandbox (an execution: `execution:<id>`): the layer, and a
    /// guard that gives it back when dropped (once the holder's workspace is unmounted).
    pub fn hold(
        self: &Arc<Self>,
        id: &str,
        holder: &str,
    ) -> Result<(PathBuf, Hold), SnapshotError> {
        let (layer, _) = self.acquire(id, holder)?;
        Ok((
            layer,
            Hold {
                snapshots: self.clone(),
                holder: holder.to_owned(),
            },
        ))
    }

    /// Sandbox `sandbox` is gone (its workspace unmounted): no snapshot is used by it any more.
    pub fn release(&self, sandbox: &str) {
        for e in self.entries().values_mut() {
            e.users.remove(sandbox);
        }
    }

    /// `DELETE /snapshots/<id>`: refused while a sandbox uses it.
    pub async fn delete(self: &Arc<Self>, id: &str) -> Result<(), SnapshotError> {
        let cow = {
            let mut entries = self.entries();
            let e = usable(&mut entries, id)?;
            if !e.users.is_empty() {
                return Err(SnapshotError::InUse {
                    id: id.into(),
                    sandboxes: e.users.len(),
                });
            }
            e.deleting = true;
            e.meta.cow
        };
        let dir = self.dir.join(id);
        let files = match cow {
            true => self.cow.clone().map(|c| (c.snapshot_path(id), c)),
            false => None,
        };
        let removed = tokio::task::spawn_blocking(move || {
            // The files first: a record whose files are gone is removed at the next start, so a deletion that
            // fails half-way leaves the snapshot listed only while it is still whole.
            if let Some((path, cow)) = files {
                cow.destroy(&path).map_err(std::io::Error::other)?;
            }
            remove_all(&dir)
        })
        .await
        .unwrap_or_else(|e| Err(std::io::Error::other(e.to_string())));
        match removed {
            Ok(()) => {
                self.entries().remove(id);
                info!(snapshot = %id, "snapshot deleted");
                Ok(())
            }
            Err(source) => {
                if let Some(e) = self.entries().get_mut(id) {
                    e.deleting = false;
                }
                Err(SnapshotError::Store {
                    what: "delete",
                    id: id.into(),
                    source,
                })
            }
        }
    }
}

/// A snapshot held by an execution ([`Snapshots::hold`]); given back when dropped.
pub struct Hold {
    snapshots: Arc<Snapshots>,
    holder: String,
}

impl std::fmt::Debug for Hold {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Hold")
            .field("holder", &self.holder)
            .finish()
    }
}

impl Drop for Hold {
    fn drop(&mut self) {
        self.snapshots.release(&self.holder);
    }
}

/// Snapshot `id`, unless it is unknown or being deleted.
fn usable<'a>(
    entries: &'a mut BTreeMap<String, Entry>,
    id: &str,
) -> Result<&'a mut Entry, SnapshotError> {
    let e = entries
        .get_mut(id)
        .ok_or_else(|| SnapshotError::NotFound(id.into()))?;
    if e.deleting {
        return Err(SnapshotError::Deleting(id.into()));
    }
    Ok(e)
}

fn view(e: &Entry) -> Snapshot {
    view_meta(&e.meta, &e.users)
}

fn view_meta(m: &Meta, users: &BTreeSet<String>) -> Snapshot {
    Snapshot {
        id: m.id.clone(),
        digest: m.digest.clone(),
        bytes: m.bytes,
        files: m.files,
        image: m.image.clone(),
        source: m.source.clone(),
        created_at: m.created_at.clone(),
        used_by: users.iter().cloned().collect(),
        skipped: m.skipped.clone(),
        root: m.root.clone(),
    }
}

impl Drop for Captured {
    fn drop(&mut self) {
        let Some(meta) = self.meta.take() else {
            return;
        };
        *self.snapshots.taking() -= 1;
        let Some(cow) = self.snapshots.cow.clone() else {
            return;
        };
        let files = std::mem::take(&mut self.files);
        let dir = self.snapshots.dir.join(&meta.id);
        let destroy = move || {
            if let Err(e) = cow.destroy(&files) {
                warn!(snapshot = %meta.id, error = %e, "cannot remove an unfinished snapshot's files");
            }
            if let Err(e) = remove_all(&dir) {
                warn!(snapshot = %meta.id, error = %e, "cannot remove an unfinished snapshot's directory");
            }
        };
        // Off the async threads when there are some: a removal waits for a btrfs transaction.
        match tokio::runtime::Handle::try_current() {
            Ok(rt) => drop(rt.spawn_blocking(destroy)),
            Err(_) => destroy(),
        }
    }
}

/// A new snapshot's record, before its files are walked.
fn new_meta(image: &str, source: &str, cow: bool) -> Meta {
    Meta {
        id: format!("snap-{}", &uuid::Uuid::now_v7().simple().to_string()[16..]),
        digest: String::new(),
        bytes: 0,
        files: 0,
        image: image.to_owned(),
        source: source.to_owned(),
        created_at: OffsetDateTime::now_utc()
            .format(&Rfc3339)
            .unwrap_or_default(),
        skipped: Vec::new(),
        cow,
        root: None,
        root_charged: 0,
    }
}

fn remove_all(path: &Path) -> std::io::Result<()> {
    match std::fs::remove_dir_all(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

/// Copies `workspace` into `partial/layer` (and the root layer into `partial/root`), each durable once copied (an
/// fsync of each of their files and directories: none of what else is written to the state disk is waited for),
/// then writes `partial/snapshot.json`, makes it durable and renames `partial` to `done` (blocking).
fn store(
    (workspace, root): (&Path, Option<&RootUpper>),
    (partial, done): (&Path, &Path),
    mut meta: Meta,
    max_bytes: u64,
) -> std::io::Result<Meta> {
    std::fs::DirBuilder::new().mode(0o700).create(partial)?;
    let copied = copy_tree_durable(workspace, &partial.join(LAYER), max_bytes)?;
    // Both on the state disk: at most `max_bytes` together.
    (meta.root, meta.root_charged) = copy_root(
        root,
        partial,
        max_bytes.saturating_sub(copied.charged),
        true,
    )?;
    meta.digest = copied.digest;
    meta.bytes = copied.bytes;
    meta.files = copied.files;
    meta.skipped = copied.skipped;
    write_meta(partial, done, &meta)?;
    Ok(meta)
}

/// Writes `meta` into the new file `dir/name`, durable (its entry in `dir` is not yet: the caller syncs `dir`). The
/// snapshot's files must be durable already: a record is named only once they are.
fn write_meta_file(dir: &Path, name: &str, meta: &Meta) -> std::io::Result<()> {
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(dir.join(name))?;
    f.write_all(&serde_json::to_vec_pretty(meta).map_err(std::io::Error::other)?)?;
    f.sync_all()
}

/// Copies the root layer `root` (if any) into `into/root` with the owners a snapshot stores (the sandbox's root as
/// 0, any other as nobody), leaving out the runtime's mount points, durable on return with `durable`; `None` (and
/// nothing left) when it holds nothing else. More than `max_bytes` is an error of kind `FileTooLarge`.
fn copy_root(
    root: Option<&RootUpper>,
    into: &Path,
    max_bytes: u64,
    durable: bool,
) -> std::io::Result<(Option<RootLayer>, u64)> {
    let Some(root) = root else {
        return Ok((None, 0));
    };
    let dst = into.join(ROOT);
    let owners = LayerOwners {
        from: root.host_id,
        to: 0,
    };
    let copy = match durable {
        true => copy_layer_durable,
        false => copy_layer,
    };
    let copied = copy(
        &root.upper,
        &dst,
        (owners, runtime::rootfs::IMAGE_MOUNT_POINTS),
        max_bytes,
    )?;
    if copied.files == 0 {
        remove_all(&dst)?;
        return Ok((None, 0));
    }
    let charged = copied.charged;
    let layer = RootLayer {
        digest: copied.digest,
        bytes: copied.bytes,
        files: copied.files,
        skipped: copied.skipped,
    };
    Ok((Some(layer), charged))
}

/// Writes `partial/snapshot.json`, makes the directory durable and renames it to `done` (blocking).
fn write_meta(partial: &Path, done: &Path, meta: &Meta) -> std::io::Result<()> {
    write_meta_file(partial, META, meta)?;
    std::fs::File::open(partial)?.sync_all()?;
    std::fs::rename(partial, done)?;
    if let Some(parent) = done.parent() {
        std::fs::File::open(parent)?.sync_all()?;
    }
    Ok(())
}

/// Taking snapshot `id` failed: over `max_bytes` (the copy stopped at the limit), or the store's own error.
fn taking_failed(source: std::io::Error, id: String, max_bytes: u64) -> SnapshotError {
    match source.kind() {
        std::io::ErrorKind::FileTooLarge => SnapshotError::TooLarge(max_bytes),
        _ => SnapshotError::Store {
            what: "take",
            id,
            source,
        },
    }
}

#[cfg(test)]
mod tests;

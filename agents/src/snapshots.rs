//! Snapshots (`POST /sandboxes/<id>/snapshot`): a sandbox's `/workspace` as it was at one moment, stored under
//! `<state_dir>/snapshots/<id>/` (`snapshot.json` and the files in `layer/`, owned by 0) until it is deleted, across
//! restarts of the daemon. A sandbox started from one (`fromSnapshot`, or `POST /sandboxes/<id>/fork`) gets the layer
//! as the read-only lower layer of an overlay `/workspace` whose upper layer is its own tmpfs: nothing is copied, the
//! files show as owned by the sandbox's root (an idmapped bind), and what it changes never reaches the snapshot.
//!
//! Taking one copies the workspace once (it lives on a tmpfs that goes with its sandbox), with the sandbox frozen so
//! that the copy is of one moment, and hashes it on the way into its digest. The copy is written here by hand: it
//! must never follow a link the agent made, must leave out what is mounted into the workspace (volumes) and must not
//! keep set-id bits, and no crate does that with a digest of the result in one pass.
//!
//! A snapshot that sandboxes were started from is kept while any of them exists: `DELETE` is refused (409) until
//! they are gone. A directory without `snapshot.json` is one whose copy never finished: removed at start.

use std::collections::{BTreeMap, BTreeSet};
use std::ffi::OsString;
use std::io::{Read, Write};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use agent_api::{PluginError, Snapshot};
use sha2::{Digest, Sha256};
use time::format_description::well_known::Rfc3339;
use time::OffsetDateTime;
use tracing::{info, warn};

/// The metadata file of a finished snapshot.
const META: &str = "snapshot.json";
/// The directory holding its files.
const LAYER: &str = "layer";
/// Entries a snapshot's `skipped` lists at most.
const MAX_SKIPPED: usize = 100;

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
    /// The workspace holds more than a snapshot may.
    #[error("The workspace holds more than {0} bytes, the most a snapshot holds (agents.disk_mb)")]
    TooLarge(u64),
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
            Self::InUse { .. } | Self::Deleting(_) | Self::TooLarge(_) => {
                (409, PluginError::invalid(message))
            }
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
}

impl Snapshots {
    /// Opens `dir` (created if missing): every finished snapshot in it is there again; unfinished ones are removed.
    pub fn open(dir: PathBuf, max: usize) -> std::io::Result<Arc<Self>> {
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
                .filter(|m| path.file_name() == Some(m.id.as_ref()));
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
        if !entries.is_empty() {
            info!(snapshots = entries.len(), "snapshots found");
        }
        Ok(Arc::new(Self {
            dir,
            max,
            entries: Mutex::new(entries),
            taking: Mutex::new(0),
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
    /// change meanwhile: its sandbox is frozen) into a new snapshot of image `image`, of at most `max_bytes`.
    pub async fn take(
        self: &Arc<Self>,
        workspace: PathBuf,
        image: &str,
        source: &str,
        max_bytes: u64,
    ) -> Result<Snapshot, SnapshotError> {
        {
            let mut taking = self.taking();
            let n = self.entries().len() + *taking;
            if n >= self.max {
                return Err(SnapshotError::Full(n));
            }
            *taking += 1;
        }
        let id = format!("snap-{}", &uuid::Uuid::now_v7().simple().to_string()[16..]);
        let (final_dir, partial) = (self.dir.join(&id), self.dir.join(format!("{id}.partial")));
        let mut meta = Meta {
            id: id.clone(),
            digest: String::new(),
            bytes: 0,
            files: 0,
            image: image.to_owned(),
            source: source.to_owned(),
            created_at: OffsetDateTime::now_utc()
                .format(&Rfc3339)
                .unwrap_or_default(),
            skipped: Vec::new(),
        };
        let m = meta.clone();
        let made = tokio::task::spawn_blocking(move || -> std::io::Result<Meta> {
            let made = store(&workspace, (&partial, &final_dir), m, max_bytes);
            if made.is_err() {
                let _ = remove_all(&partial);
            }
            made
        })
        .await
        .unwrap_or_else(|e| Err(std::io::Error::other(e.to_string())));
        *self.taking() -= 1;
        meta = made.map_err(|source| match source.kind() {
            std::io::ErrorKind::FileTooLarge => SnapshotError::TooLarge(max_bytes),
            _ => SnapshotError::Store {
                what: "take",
                id: id.clone(),
                source,
            },
        })?;
        info!(snapshot = %id, sandbox = source, bytes = meta.bytes, files = meta.files, "snapshot taken");
        let snapshot = view_meta(&meta, &BTreeSet::new());
        self.entries().insert(
            id,
            Entry {
                meta,
                users: BTreeSet::new(),
                deleting: false,
            },
        );
        Ok(snapshot)
    }

    /// Notes that sandbox `sandbox` starts from snapshot `id`: its layer (to mount) and its image. Given back by
    /// [`Self::release`].
    pub fn acquire(&self, id: &str, sandbox: &str) -> Result<(PathBuf, String), SnapshotError> {
        let mut entries = self.entries();
        let e = usable(&mut entries, id)?;
        e.users.insert(sandbox.to_owned());
        Ok((self.dir.join(id).join(LAYER), e.meta.image.clone()))
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
        {
            let mut entries = self.entries();
            let e = usable(&mut entries, id)?;
            if !e.users.is_empty() {
                return Err(SnapshotError::InUse {
                    id: id.into(),
                    sandboxes: e.users.len(),
                });
            }
            e.deleting = true;
        }
        let dir = self.dir.join(id);
        let removed = tokio::task::spawn_blocking(move || remove_all(&dir))
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
    }
}

fn remove_all(path: &Path) -> std::io::Result<()> {
    match std::fs::remove_dir_all(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

/// Copies `workspace` into `partial/layer`, writes `partial/snapshot.json`, makes both durable and renames
/// `partial` to `done` (blocking).
fn store(
    workspace: &Path,
    (partial, done): (&Path, &Path),
    mut meta: Meta,
    max_bytes: u64,
) -> std::io::Result<Meta> {
    std::fs::DirBuilder::new().mode(0o700).create(partial)?;
    let copied = copy_tree(workspace, &partial.join(LAYER), max_bytes)?;
    meta.digest = copied.digest;
    meta.bytes = copied.bytes;
    meta.files = copied.files;
    meta.skipped = copied.skipped;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(partial.join(META))?;
    f.write_all(&serde_json::to_vec_pretty(&meta).map_err(std::io::Error::other)?)?;
    // One syncfs for every file of the copy: the snapshot is complete on disk before it is named.
    nix::unistd::syncfs(std::os::fd::AsRawFd::as_raw_fd(&f)).map_err(std::io::Error::from)?;
    drop(f);
    std::fs::rename(partial, done)?;
    if let Some(parent) = done.parent() {
        std::fs::File::open(parent)?.sync_all()?;
    }
    Ok(meta)
}

/// What [`copy_tree`] copied.
#[derive(Debug, Default)]
pub struct Copied {
    /// `sha256:<hex>` over every entry (kind, stored mode, size, path, content hash or link target) in walk order.
    pub digest: String,
    /// Bytes of file content.
    pub bytes: u64,
    /// Files, directories and links (the top directory not counted).
    pub files: u64,
    /// Paths left out (at most [`MAX_SKIPPED`]), with why.
    pub skipped: Vec<String>,
}

/// Bytes a directory or a link is charged against a snapshot's size (a block of the state disk).
const ENTRY_BYTES: u64 = 4096;
/// Bytes of paths a copy keeps at once (the directories still to walk, and those whose modes are set last).
const MAX_PATH_BYTES: usize = 64 << 20;

/// Copies the tree at `src` into the new directory `dst` (blocking): regular files, directories and symbolic links
/// (as links: never followed), each owned by the caller (0), with its permission bits (set-id bits dropped) and
/// modification time; anything else, and any directory on another filesystem (a mount), is left out and listed.
/// `src` must not change meanwhile. More than `max_bytes` (file content, and [`ENTRY_BYTES`] per directory and
/// link), more entries than a tmpfs of `max_bytes` holds, or a tree whose paths would take more than
/// [`MAX_PATH_BYTES`] to walk, is an error of kind `FileTooLarge`. The digest covers each entry in the walk's order
/// (a directory's entries sorted by name, depth first), each field length-prefixed.
pub fn copy_tree(src: &Path, dst: &Path, max_bytes: u64) -> std::io::Result<Copied> {
    let top = std::fs::symlink_metadata(src)?;
    if !top.is_dir() {
        return Err(std::io::Error::other(format!(
            "{} is not a directory",
            src.display()
        )));
    }
    let dev = top.dev();
    let max_entries = runtime::spec::inodes_for(max_bytes);
    std::fs::DirBuilder::new().mode(0o700).create(dst)?;
    let too_large = || std::io::Error::from(std::io::ErrorKind::FileTooLarge);
    let (mut out, mut charged, mut path_bytes) = (Copied::default(), 0u64, 0usize);
    let mut h = Sha256::new();
    // Directories get their modes and times last (after their entries were written).
    let mut dirs: Vec<(PathBuf, std::fs::Metadata)> = vec![(dst.to_owned(), top)];
    let mut todo: Vec<PathBuf> = vec![PathBuf::new()];
    let mut buf = vec![0u8; 1 << 20];
    while let Some(rel) = todo.pop() {
        let mut names: Vec<OsString> = std::fs::read_dir(src.join(&rel))?
            .map(|e| e.map(|e| e.file_name()))
            .collect::<std::io::Result<_>>()?;
        names.sort();
        // Pushed in reverse, so that they are walked in name order.
        let mut subdirs = Vec::new();
        for name in names {
            let rel = rel.join(&name);
            let (from, to) = (src.join(&rel), dst.join(&rel));
            let md = std::fs::symlink_metadata(&from)?;
            let ft = md.file_type();
            let size = if ft.is_file() { md.len() } else { ENTRY_BYTES };
            charged = charged.saturating_add(size);
            if charged > max_bytes || out.files >= max_entries {
                return Err(too_large());
            }
            let (kind, mode, detail) = if ft.is_dir() && md.dev() != dev {
                skip(&mut out, &rel, "a mount");
                std::fs::DirBuilder::new().mode(0o755).create(&to)?;
                (b'd', 0o755, Vec::new())
            } else if ft.is_dir() {
                std::fs::DirBuilder::new().mode(0o700).create(&to)?;
                path_bytes += 2 * rel.as_os_str().len();
                if path_bytes > MAX_PATH_BYTES {
                    return Err(too_large());
                }
                dirs.push((to, md.clone()));
                subdirs.push(rel.clone());
                (b'd', md.mode() & 0o1777, Vec::new())
            } else if ft.is_file() {
                let mode = md.mode() & 0o777;
                let hash = copy_file(&from, &to, mode, &mut buf)?;
                set_mtime(&to, &md)?;
                out.bytes += md.len();
                (b'f', mode, hash)
            } else if ft.is_symlink() {
                let target = std::fs::read_link(&from)?;
                std::os::unix::fs::symlink(&target, &to)?;
                (b'l', 0o777, target.as_os_str().as_bytes().to_vec())
            } else {
                skip(&mut out, &rel, "not a file, directory or link");
                continue;
            };
            out.files += 1;
            h.update([kind]);
            h.update(mode.to_le_bytes());
            h.update((if kind == b'f' { md.len() } else { 0 }).to_le_bytes());
            for field in [rel.as_os_str().as_bytes(), &detail] {
                h.update((field.len() as u64).to_le_bytes());
                h.update(field);
            }
        }
        todo.extend(subdirs.into_iter().rev());
    }
    for (dir, md) in dirs.iter().rev() {
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(md.mode() & 0o1777))?;
        set_mtime(dir, md)?;
    }
    out.digest = format!("sha256:{}", hex(&h.finalize()));
    Ok(out)
}

fn skip(out: &mut Copied, rel: &Path, why: &str) {
    if out.skipped.len() < MAX_SKIPPED {
        out.skipped
            .push(format!("{} ({why})", rel.to_string_lossy()));
    }
}

/// Copies one regular file (opened without following a link) to the new file `to` with `mode`; its content's
/// sha256, lowercase hex.
fn copy_file(from: &Path, to: &Path, mode: u32, buf: &mut [u8]) -> std::io::Result<Vec<u8>> {
    let mut src = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(from)?;
    let mut dst = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(to)?;
    let mut h = Sha256::new();
    loop {
        let n = src.read(buf)?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
        dst.write_all(&buf[..n])?;
    }
    // The creation mode went through the umask.
    dst.set_permissions(std::fs::Permissions::from_mode(mode))?;
    Ok(hex(&h.finalize()).into_bytes())
}

fn set_mtime(path: &Path, md: &std::fs::Metadata) -> std::io::Result<()> {
    let t = nix::sys::time::TimeSpec::new(md.mtime(), md.mtime_nsec());
    nix::sys::stat::utimensat(
        None,
        path,
        &nix::sys::time::TimeSpec::UTIME_OMIT,
        &t,
        nix::sys::stat::UtimensatFlags::NoFollowSymlink,
    )
    .map_err(std::io::Error::from)
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests;

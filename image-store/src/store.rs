//! The image store under `<state_dir>/images/oci`:
//!
//! ```text
//! layers/<hex>/      one unpacked layer per blob digest, complete (renamed into place when done), shared
//! refs/<name>.json   an imported image: manifest digest, layers, run config
//! tmp/               unpacks in progress; removed on error and by `remove`
//! lock               flock: shared while a daemon runs or an import goes on, exclusive to remove layers
//! ```

use std::fs;
use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use nix::fcntl::{Flock, FlockArg};

use super::layout::{self, HashingReader, LayerRef, RunConfig};
use super::unpack::{self, UnpackStats};
use super::{valid_name, ImageError, Result, Sha256};

/// Room for `lowerdir=` in the kernel's one page of overlay mount options, leaving space for the upper and work
/// directories of an execution.
const MAX_LOWERDIR_BYTES: usize = 3200;

/// An imported image.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct StoredImage {
    /// Its name in the store.
    pub name: String,
    /// The manifest digest (what `environment_fingerprint` carries).
    pub manifest_digest: Sha256,
    /// The config blob digest.
    pub config_digest: Sha256,
    /// Layers, bottom first.
    pub layers: Vec<LayerRef>,
    /// From the image config.
    pub run: RunConfig,
    /// Bytes of file content in all layers, unpacked.
    pub unpacked_bytes: u64,
    /// Seconds since the epoch.
    pub imported_at: u64,
    /// The layout directory it was imported from.
    pub source: PathBuf,
}

/// What an import did and how long it took.
#[derive(Debug, Clone)]
pub struct ImportReport {
    /// The record written.
    pub image: StoredImage,
    /// Reading and verifying every blob.
    pub verify: Duration,
    /// Unpacking the layers not yet in the cache.
    pub unpack: Duration,
    /// Layers unpacked now.
    pub layers_unpacked: usize,
    /// Layers found in the cache.
    pub layers_cached: usize,
    /// Summed over the layers unpacked now.
    pub stats: UnpackStats,
}

/// The store.
#[derive(Debug, Clone)]
pub struct ImageStore {
    root: PathBuf,
}

/// Held while the layers of the store must not disappear (a running daemon, an import).
#[derive(Debug)]
pub struct StoreLock {
    _lock: Flock<fs::File>,
}

impl ImageStore {
    /// Opens (creating if needed) the store at `root`.
    pub fn open(root: &Path) -> Result<Self> {
        // The ancestors (the state directory) keep ordinary permissions: containers' unprivileged uids traverse
        // the state directory to their own roots. The store itself is root's alone.
        if let Some(parent) = root.parent() {
            fs::create_dir_all(parent).map_err(|e| ImageError::io(parent, e))?;
        }
        for sub in ["", "layers", "refs", "tmp"] {
            let p = root.join(sub);
            fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(&p)
                .map_err(|e| ImageError::io(&p, e))?;
        }
        let store = Self {
            root: root.to_path_buf(),
        };
        // Nobody else is in the store: what an import killed midway left in tmp/ can go.
        if let Some(_lock) = store.lock(FlockArg::LockExclusiveNonblock)? {
            store.clear_tmp()?;
        }
        Ok(store)
    }

    /// Removes everything under `tmp/` (unfinished unpacks, layers on their way out); needs the exclusive lock.
    fn clear_tmp(&self) -> Result<()> {
        let tmp = self.root.join("tmp");
        for e in fs::read_dir(&tmp)
            .map_err(|e| ImageError::io(&tmp, e))?
            .flatten()
        {
            fs::remove_dir_all(e.path()).map_err(|err| ImageError::io(e.path(), err))?;
        }
        Ok(())
    }

    /// The store's directory.
    pub fn root(&self) -> &Path {
        &self.root
    }

    fn lock(&self, arg: FlockArg) -> Result<Option<StoreLock>> {
        let path = self.root.join("lock");
        let file = fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .mode(0o600)
            .open(&path)
            .map_err(|e| ImageError::io(&path, e))?;
        match Flock::lock(file, arg) {
            Ok(lock) => Ok(Some(StoreLock { _lock: lock })),
            Err((_, nix::Error::EWOULDBLOCK)) => Ok(None),
            Err((_, e)) => Err(ImageError::io(&path, e.into())),
        }
    }

    /// A shared lock: layers are not removed while it is held. Waits for a running `remove`.
    pub fn lock_shared(&self) -> Result<StoreLock> {
        self.lock(FlockArg::LockShared)?
            .ok_or_else(|| ImageError::Busy(self.root.clone()))
    }

    /// The directory of an unpacked layer.
    pub fn layer_dir(&self, digest: &Sha256) -> PathBuf {
        self.root.join("layers").join(digest.hex())
    }

    fn ref_path(&self, name: &str) -> PathBuf {
        self.root.join("refs").join(format!("{name}.json"))
    }

    /// Verifies the layout at `dir` completely (every blob's size and sha256), unpacks the layers not yet cached and
    /// records the image as `name` (replacing an earlier image of that name). A refused image leaves nothing behind.
    pub fn import(&self, dir: &Path, name: &str) -> Result<ImportReport> {
        if !valid_name(name) {
            return Err(ImageError::InvalidName(name.to_owned()));
        }
        let _lock = self.lock_shared()?;
        let t0 = Instant::now();
        let layout = layout::open(dir)?;
        // Every execution's overlay lists the layers in one page of mount options; refuse now what could never mount.
        let distinct: std::collections::BTreeSet<&Sha256> =
            layout.layers.iter().map(|l| &l.digest).collect();
        let lowerdir_bytes: usize = distinct
            .iter()
            .map(|d| self.layer_dir(d).as_os_str().len() + 1)
            .sum();
        if lowerdir_bytes > MAX_LOWERDIR_BYTES {
            return Err(ImageError::Layout(format!(
                "{} distinct layers under {} make {lowerdir_bytes} bytes of overlay lowerdir, more than the {MAX_LOWERDIR_BYTES} an execution's mount options can hold (flatten the image)",
                distinct.len(),
                self.root.display()
            )));
        }
        for l in &layout.layers {
            layout::verify_blob(dir, &l.digest, l.size)?;
        }
        let verify = t0.elapsed();
        let t1 = Instant::now();
        let mut stats = UnpackStats::default();
        let (mut unpacked, mut cached) = (0, 0);
        let mut unpacked_bytes = 0;
        // New layers move from tmp/ into layers/ only once every one of them unpacked: a refused image leaves
        // nothing behind (and nothing another import may already have counted on is taken away).
        let mut fresh: Vec<(PathBuf, &Sha256, u64)> = Vec::new();
        for l in &layout.layers {
            let dest = self.layer_dir(&l.digest);
            if let Some((_, _, bytes)) = fresh.iter().find(|(_, d, _)| *d == &l.digest) {
                cached += 1;
                unpacked_bytes += bytes;
                continue;
            }
            if dest.is_dir() {
                cached += 1;
                unpacked_bytes += dir_bytes(&dest);
                continue;
            }
            let (tmp, s) = match self.unpack_layer(dir, l) {
                Ok(r) => r,
                Err(e) => {
                    fresh.iter().for_each(|(tmp, ..)| discard(tmp));
                    return Err(e);
                }
            };
            fresh.push((tmp, &l.digest, s.bytes));
            unpacked += 1;
            unpacked_bytes += s.bytes;
            stats.entries += s.entries;
            stats.bytes += s.bytes;
            stats.whiteouts += s.whiteouts;
            stats.setid_dropped += s.setid_dropped;
        }
        let mut installed = Ok(());
        for (tmp, digest, _) in &fresh {
            match installed {
                Ok(()) => installed = self.install(tmp, digest),
                Err(_) => discard(tmp),
            }
        }
        installed?;
        let unpack = t1.elapsed();
        let image = StoredImage {
            name: name.to_owned(),
            manifest_digest: layout.manifest_digest,
            config_digest: layout.config_digest,
            layers: layout.layers,
            run: layout.run,
            unpacked_bytes,
            imported_at: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0),
            source: fs::canonicalize(dir).unwrap_or_else(|_| dir.to_path_buf()),
        };
        self.write_ref(&image)?;
        Ok(ImportReport {
            image,
            verify,
            unpack,
            layers_unpacked: unpacked,
            layers_cached: cached,
            stats,
        })
    }

    /// Unpacks one layer into a new directory in `tmp/`, checking the blob's digest again on the way (it may have
    /// changed since it was verified); [`Self::install`] moves it into `layers/`.
    fn unpack_layer(&self, dir: &Path, l: &LayerRef) -> Result<(PathBuf, UnpackStats)> {
        let tmp = self.root.join("tmp").join(format!(
            "{}.{}.{}",
            l.digest.hex(),
            std::process::id(),
            rand_suffix()
        ));
        fs::DirBuilder::new()
            .mode(0o755)
            .create(&tmp)
            .map_err(|e| ImageError::io(&tmp, e))?;
        let result = (|| {
            let file = layout::open_blob(dir, &l.digest, l.size)?;
            let mut hashing =
                HashingReader::new(std::io::BufReader::with_capacity(256 << 10, file));
            let stats = unpack::unpack(
                &mut hashing,
                l.compression,
                &l.digest,
                Some(&l.diff_id),
                &tmp,
            )?;
            // Trailing bytes after the compressed stream still count for the blob digest.
            std::io::copy(&mut hashing, &mut std::io::sink())
                .map_err(|e| ImageError::io(layout::blob_path(dir, &l.digest), e))?;
            hashing.check(&l.digest)?;
            sync_dir(&tmp)?;
            Ok(stats)
        })();
        match result {
            Ok(s) => Ok((tmp, s)),
            Err(e) => {
                discard(&tmp);
                Err(e)
            }
        }
    }

    /// Renames a layer unpacked into `tmp` into `layers/`.
    fn install(&self, tmp: &Path, digest: &Sha256) -> Result<()> {
        let dest = self.layer_dir(digest);
        match fs::rename(tmp, &dest) {
            Ok(()) => Ok(()),
            // Another import finished the same layer first: theirs is as good as ours.
            Err(_) if dest.is_dir() => {
                let _ = fs::remove_dir_all(tmp);
                Ok(())
            }
            Err(e) => {
                let _ = fs::remove_dir_all(tmp);
                Err(ImageError::io(&dest, e))
            }
        }
    }

    fn write_ref(&self, image: &StoredImage) -> Result<()> {
        let path = self.ref_path(&image.name);
        let tmp = path.with_extension(format!("json.tmp.{}", std::process::id()));
        let json = serde_json::to_vec_pretty(image)
            .map_err(|e| ImageError::io(&path, std::io::Error::other(e)))?;
        let mut f = fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&tmp)
            .map_err(|e| ImageError::io(&tmp, e))?;
        f.write_all(&json)
            .and_then(|()| f.sync_all())
            .map_err(|e| ImageError::io(&tmp, e))?;
        fs::rename(&tmp, &path).map_err(|e| ImageError::io(&path, e))
    }

    /// The image recorded as `name`, with all its layers present.
    pub fn get(&self, name: &str) -> Result<StoredImage> {
        if !valid_name(name) {
            return Err(ImageError::InvalidName(name.to_owned()));
        }
        let path = self.ref_path(name);
        let bytes = match fs::read(&path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(ImageError::NotFound(name.to_owned()))
            }
            Err(e) => return Err(ImageError::io(&path, e)),
        };
        let image: StoredImage = serde_json::from_slice(&bytes)
            .map_err(|e| ImageError::io(&path, std::io::Error::other(e)))?;
        for l in &image.layers {
            let d = self.layer_dir(&l.digest);
            if !d.is_dir() {
                return Err(ImageError::Layout(format!(
                    "image {name}: layer {} is missing from {} (import the image again)",
                    l.digest,
                    d.display()
                )));
            }
        }
        Ok(image)
    }

    /// Every recorded image, by name.
    pub fn list(&self) -> Result<Vec<StoredImage>> {
        let refs = self.root.join("refs");
        let mut out = Vec::new();
        for e in fs::read_dir(&refs).map_err(|e| ImageError::io(&refs, e))? {
            let e = e.map_err(|e| ImageError::io(&refs, e))?;
            let file_name = e.file_name();
            let Some(name) = file_name.to_str().and_then(|n| n.strip_suffix(".json")) else {
                continue;
            };
            out.push(self.get(name)?);
        }
        out.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(out)
    }

    /// Unpacked layer directories of an image, top first (overlayfs' `lowerdir` order).
    /// A layer listed twice appears once, at its topmost place: overlayfs refuses a repeated lower directory, and
    /// the upper copy re-applies every entry of the lower one, so the merged view is the same.
    pub fn lower_dirs(&self, image: &StoredImage) -> Vec<PathBuf> {
        let mut seen = std::collections::BTreeSet::new();
        image
            .layers
            .iter()
            .rev()
            .filter(|l| seen.insert(l.digest.clone()))
            .map(|l| self.layer_dir(&l.digest))
            .collect()
    }

    /// Forgets `name` and removes the layers no other image uses. Refused while a daemon holds the store.
    pub fn remove(&self, name: &str) -> Result<usize> {
        if !valid_name(name) {
            return Err(ImageError::InvalidName(name.to_owned()));
        }
        let _lock = self
            .lock(FlockArg::LockExclusiveNonblock)?
            .ok_or_else(|| ImageError::Busy(self.root.clone()))?;
        let path = self.ref_path(name);
        if !path.exists() {
            return Err(ImageError::NotFound(name.to_owned()));
        }
        fs::remove_file(&path).map_err(|e| ImageError::io(&path, e))?;
        self.gc_locked()
    }

    /// Removes unreferenced layers and unfinished unpacks; the caller holds the exclusive lock.
    ///
    /// A layer leaves `layers/` by one atomic rename into `tmp/` before it is deleted, so `layers/` only ever holds
    /// complete layers: a crash or an error midway leaves the rest in `tmp/`, cleared by the next exclusive user.
    fn gc_locked(&self) -> Result<usize> {
        let keep: std::collections::BTreeSet<String> = self
            .list_refs_strict()?
            .iter()
            .flat_map(|i| i.layers.iter().map(|l| l.digest.hex().to_owned()))
            .collect();
        let mut removed = 0;
        let layers = self.root.join("layers");
        for e in fs::read_dir(&layers)
            .map_err(|e| ImageError::io(&layers, e))?
            .flatten()
        {
            let n = e.file_name().to_string_lossy().into_owned();
            if !keep.contains(&n) {
                let doomed = self.root.join("tmp").join(format!(
                    "{n}.gc.{}.{}",
                    std::process::id(),
                    rand_suffix()
                ));
                fs::rename(e.path(), &doomed).map_err(|err| ImageError::io(e.path(), err))?;
                removed += 1;
            }
        }
        self.clear_tmp()?;
        Ok(removed)
    }

    /// Every record, even one whose layers are missing; a record that does not parse stops garbage collection
    /// (its layers might still be wanted).
    fn list_refs_strict(&self) -> Result<Vec<StoredImage>> {
        let refs = self.root.join("refs");
        let mut out = Vec::new();
        for e in fs::read_dir(&refs)
            .map_err(|e| ImageError::io(&refs, e))?
            .flatten()
        {
            let path = e.path();
            if path.extension().and_then(|x| x.to_str()) != Some("json") {
                // A record being written (`*.json.tmp.<pid>`) or left by a crash while it was.
                continue;
            }
            let bytes = fs::read(&path).map_err(|err| ImageError::io(&path, err))?;
            let image = serde_json::from_slice(&bytes).map_err(|err| {
                ImageError::Layout(format!(
                    "{} does not parse ({err}); fix or remove it before layers can be collected",
                    path.display()
                ))
            })?;
            out.push(image);
        }
        Ok(out)
    }
}

/// Removes an unpack that will not be installed.
fn discard(tmp: &Path) {
    if let Err(e) = fs::remove_dir_all(tmp) {
        tracing::error!(dir = %tmp.display(), error = %e, "cannot remove a failed unpack");
    }
}

fn rand_suffix() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(Instant::now().elapsed().as_nanos());
    h.finish()
}

/// Flushes the filesystem holding `dir` (one `syncfs` for a whole unpacked layer).
fn sync_dir(dir: &Path) -> Result<()> {
    let f = fs::File::open(dir).map_err(|e| ImageError::io(dir, e))?;
    nix::unistd::syncfs(std::os::fd::AsRawFd::as_raw_fd(&f))
        .map_err(|e| ImageError::io(dir, e.into()))
}

/// Bytes of regular files under `dir` (for a cached layer's share of an image's size).
fn dir_bytes(dir: &Path) -> u64 {
    let mut total = 0;
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(rd) = fs::read_dir(&d) else { continue };
        for e in rd.flatten() {
            match e.file_type() {
                Ok(t) if t.is_dir() => stack.push(e.path()),
                Ok(t) if t.is_file() => total += e.metadata().map(|m| m.len()).unwrap_or(0),
                _ => {}
            }
        }
    }
    total
}

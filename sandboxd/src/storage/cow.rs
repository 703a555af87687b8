//! The copy-on-write store of agent workspaces ([`agents::cow::CowStore`], `agents.workspace_store: btrfs`): a
//! btrfs filesystem in a sparse file of `agents.workspace_store_mb` (`<state_dir>/workspaces/disk.img`),
//! loop-mounted at `<state_dir>/workspaces/mnt` in the daemon's own mount namespace, with quotas on. Each
//! workspace is a subvolume (`ws/<sandbox>`) whose quota group is limited to the sandbox's `diskMb` (a write past
//! it fails with `EDQUOT`), a snapshot is a read-only snapshot of one (`snap/<id>`), and a workspace started from a
//! snapshot is a writable snapshot of that: each one transaction, whatever the files.
//!
//! `mkfs.btrfs` (btrfs-progs) makes the filesystem and `mount(8)` attaches the loop device, as for volumes. The
//! subvolume, snapshot, deletion and quota calls are the kernel's btrfs ioctls ([`runtime::btrfs`]). A sandbox
//! cannot make subvolumes of its own (which would have no quota): the seccomp profile denies the creation ioctls.

use std::os::fd::OwnedFd;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use agents::cow::BoxError;

use crate::storage::volumes::{mounted, run};

/// Whether this host has what the store needs besides btrfs itself (in `/proc/filesystems`): `mkfs.btrfs` and
/// `mount`, and loop devices; why not otherwise.
pub fn probe() -> Result<(), String> {
    crate::storage::volumes::probe_tools(&["mkfs.btrfs", "mount"])
}

/// The store, mounted.
pub struct BtrfsStore {
    mnt: PathBuf,
    /// `/sys/fs/btrfs/<fsid>/qgroups`: each quota group's usage.
    qgroups: PathBuf,
}

impl BtrfsStore {
    /// Opens the store in `dir` (`<state_dir>/workspaces`): made (a sparse file of `size_mb`, `mkfs.btrfs`) when
    /// it is not there, mounted unless it is (a previous daemon's mount carried over), quotas turned on. Any step
    /// that fails is the error: the daemon does not start with a store it cannot enforce quotas in.
    pub fn open(dir: &Path, size_mb: u64) -> Result<Self, BoxError> {
        use std::os::unix::fs::DirBuilderExt;
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)?;
        let (img, mnt) = (dir.join("disk.img"), dir.join("mnt"));
        match std::fs::metadata(&img) {
            Ok(md) if md.len() < size_mb << 20 => {
                return Err(format!(
                    "{} is {} MiB, less than agents.workspace_store_mb ({size_mb}); grow it (truncate -s, then btrfs filesystem resize max on its mount) or lower the setting",
                    img.display(),
                    md.len() >> 20
                )
                .into())
            }
            _ => {}
        }
        if !img.exists() {
            let partial = dir.join("disk.img.partial");
            let _ = std::fs::remove_file(&partial);
            std::fs::File::create_new(&partial)?.set_len(size_mb << 20)?;
            // One copy of the metadata (not btrfs's default two on one device): a quota counts it once, and the
            // file's own disk is where redundancy belongs.
            run(Command::new("mkfs.btrfs")
                .args(["-q", "-f", "-m", "single", "-d", "single"])
                .arg(&partial))?;
            std::fs::rename(&partial, &img)?;
        }
        match std::fs::create_dir(&mnt) {
            Err(e) if e.kind() != std::io::ErrorKind::AlreadyExists => return Err(e.into()),
            _ => {}
        }
        if !mounted(&mnt) {
            run(Command::new("mount")
                .args(["-t", "btrfs", "-o", "loop,nosuid,nodev"])
                .arg(&img)
                .arg(&mnt))?;
            tracing::info!(store = %mnt.display(), "workspace store mounted");
        }
        let top = open_dir(&mnt)?;
        runtime::btrfs::enable_quotas(&top)
            .map_err(|e| format!("cannot turn quotas on in {}: {e}", mnt.display()))?;
        for sub in ["ws", "snap"] {
            match std::fs::DirBuilder::new().mode(0o700).create(mnt.join(sub)) {
                Err(e) if e.kind() != std::io::ErrorKind::AlreadyExists => return Err(e.into()),
                _ => {}
            }
        }
        let fsid = runtime::btrfs::filesystem_id(&top)
            .map_err(|e| format!("cannot read the filesystem id of {}: {e}", mnt.display()))?;
        let hex: String = fsid.iter().map(|b| format!("{b:02x}")).collect();
        let fsid = format!(
            "{}-{}-{}-{}-{}",
            &hex[..8],
            &hex[8..12],
            &hex[12..16],
            &hex[16..20],
            &hex[20..]
        );
        let qgroups = Path::new("/sys/fs/btrfs").join(fsid).join("qgroups");
        // Limits are enforced from the quota groups' counts: counts the kernel marks inconsistent are refused.
        let inconsistent = std::fs::read_to_string(qgroups.join("inconsistent")).map_err(|e| {
            format!(
                "cannot read {}: {e}",
                qgroups.join("inconsistent").display()
            )
        })?;
        if inconsistent.trim() != "0" {
            return Err(format!(
                "the quota counts of {} are inconsistent: run `btrfs quota rescan -w` on it",
                mnt.display()
            )
            .into());
        }
        Ok(Self { mnt, qgroups })
    }
}

impl agents::cow::CowStore for BtrfsStore {
    fn workspace(&self, sandbox: &str) -> PathBuf {
        self.mnt.join("ws").join(sandbox)
    }

    fn snapshot_path(&self, id: &str) -> PathBuf {
        self.mnt.join("snap").join(id)
    }

    fn create(&self, sandbox: &str, bytes: u64, from: Option<&Path>) -> Result<PathBuf, BoxError> {
        let path = self.workspace(sandbox);
        let parent = open_dir(&self.mnt.join("ws"))?;
        match from {
            None => runtime::btrfs::create_subvolume(&parent, sandbox.as_bytes())
                .map_err(|e| format!("cannot make the subvolume {}: {e}", path.display()))?,
            Some(from) => snapshot(&parent, from, sandbox, false)?,
        }
        if let Err(e) = limit(&path, bytes) {
            let _ = self.destroy(&path);
            return Err(e);
        }
        Ok(path)
    }

    fn set_limit(&self, sandbox: &str, bytes: u64) -> Result<(), BoxError> {
        limit(&self.workspace(sandbox), bytes)
    }

    fn snapshot(&self, workspace: &Path, id: &str) -> Result<PathBuf, BoxError> {
        let parent = open_dir(&self.mnt.join("snap"))?;
        snapshot(&parent, workspace, id, true)?;
        Ok(self.snapshot_path(id))
    }

    fn destroy(&self, path: &Path) -> Result<(), BoxError> {
        let (Some(parent), Some(name)) = (path.parent(), path.file_name()) else {
            return Err(format!("{} is not in the store", path.display()).into());
        };
        match std::fs::symlink_metadata(path) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
            Err(e) => return Err(format!("{}: {e}", path.display()).into()),
            Ok(_) => {}
        }
        let parent = open_dir(parent)?;
        runtime::btrfs::destroy(&parent, name.as_bytes())
            .map_err(|e| format!("cannot remove the subvolume {}: {e}", path.display()).into())
    }

    fn used_bytes(&self, sandbox: &str) -> Option<u64> {
        let subvolume = open_dir(&self.workspace(sandbox)).ok()?;
        let id = runtime::btrfs::subvolume_id(&subvolume).ok()?;
        let path = self.qgroups.join(format!("0_{id}")).join("referenced");
        std::fs::read_to_string(path).ok()?.trim().parse().ok()
    }

    fn list(&self) -> (Vec<String>, Vec<String>) {
        let names = |sub: &str| -> Vec<String> {
            std::fs::read_dir(self.mnt.join(sub))
                .map(|d| {
                    d.flatten()
                        .map(|e| e.file_name().to_string_lossy().into_owned())
                        .collect()
                })
                .unwrap_or_default()
        };
        (names("ws"), names("snap"))
    }
}

/// A snapshot of the subvolume `from` named `name` in the directory `parent`.
fn snapshot(parent: &OwnedFd, from: &Path, name: &str, read_only: bool) -> Result<(), BoxError> {
    let source = open_dir(from)?;
    runtime::btrfs::snapshot(parent, &source, name.as_bytes(), read_only)
        .map_err(|e| format!("cannot snapshot {} as {name}: {e}", from.display()).into())
}

/// Limits the quota group of the subvolume at `path` to `bytes` referenced.
fn limit(path: &Path, bytes: u64) -> Result<(), BoxError> {
    let subvolume = open_dir(path)?;
    runtime::btrfs::limit_referenced(&subvolume, bytes)
        .map_err(|e| format!("cannot limit {} to {bytes} bytes: {e}", path.display()).into())
}

fn open_dir(path: &Path) -> Result<OwnedFd, BoxError> {
    use std::os::unix::fs::OpenOptionsExt;
    let dir = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECTORY | libc::O_NOFOLLOW)
        .open(path)
        .map_err(|e| format!("cannot open {}: {e}", path.display()))?;
    Ok(OwnedFd::from(dir))
}

//! The copy-on-write store of agent workspaces ([`agents::cow::CowStore`], `agents.workspace_store: btrfs`): a
//! btrfs filesystem in a sparse file of `agents.workspace_store_mb` (`<state_dir>/workspaces/disk.img`),
//! loop-mounted at `<state_dir>/workspaces/mnt` in the daemon's own mount namespace, with quotas on. Each
//! workspace is a subvolume (`ws/<sandbox>`) whose quota group is limited to the sandbox's `diskMb` (a write past
//! it fails with `EDQUOT`), a snapshot is a read-only snapshot of one (`snap/<id>`), and a workspace started from a
//! snapshot is a writable snapshot of that: each one transaction, whatever the files.
//!
//! `mkfs.btrfs` (btrfs-progs) makes the filesystem and `mount(8)` attaches the loop device, as for volumes. The
//! subvolume, snapshot, deletion and quota calls are the kernel's btrfs ioctls, written here by hand: the one crate
//! that wraps them (`btrfsutil`) binds a C library this daemon would then need at build and run time, for five
//! calls. A sandbox cannot make subvolumes of its own (which would have no quota): the seccomp profile denies the
//! creation ioctls.

use std::ffi::CString;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use agents::cow::BoxError;
use nix::fcntl::OFlag;
use nix::sys::stat::Mode;

use crate::storage::volumes::{mounted, run};

/// `struct btrfs_ioctl_vol_args_v2`: 4 096 bytes.
#[repr(C)]
struct VolArgsV2 {
    fd: i64,
    transid: u64,
    flags: u64,
    unused: [u64; 4],
    name: [u8; 4040],
}

/// `struct btrfs_ioctl_vol_args`: 4 096 bytes.
#[repr(C)]
struct VolArgs {
    fd: i64,
    name: [u8; 4088],
}

/// `struct btrfs_ioctl_qgroup_limit_args` (its `struct btrfs_qgroup_limit` inline).
#[repr(C)]
struct QgroupLimitArgs {
    qgroupid: u64,
    flags: u64,
    max_rfer: u64,
    max_excl: u64,
    rsv_rfer: u64,
    rsv_excl: u64,
}

/// `struct btrfs_ioctl_quota_ctl_args`.
#[repr(C)]
struct QuotaCtlArgs {
    cmd: u64,
    status: u64,
}

const _: () = assert!(std::mem::size_of::<VolArgsV2>() == 4096);
const _: () = assert!(std::mem::size_of::<VolArgs>() == 4096);
const _: () = assert!(std::mem::size_of::<QgroupLimitArgs>() == 48);
const _: () = assert!(std::mem::size_of::<QuotaCtlArgs>() == 16);

/// `_IOW(0x94, 23, struct btrfs_ioctl_vol_args_v2)`.
const IOC_SNAP_CREATE_V2: libc::c_ulong = 0x5000_9417;
/// `_IOW(0x94, 24, struct btrfs_ioctl_vol_args_v2)`.
const IOC_SUBVOL_CREATE_V2: libc::c_ulong = 0x5000_9418;
/// `_IOW(0x94, 15, struct btrfs_ioctl_vol_args)`.
const IOC_SNAP_DESTROY: libc::c_ulong = 0x5000_940f;
/// `_IOR(0x94, 43, struct btrfs_ioctl_qgroup_limit_args)`.
const IOC_QGROUP_LIMIT: libc::c_ulong = 0x8030_942b;
/// `_IOWR(0x94, 40, struct btrfs_ioctl_quota_ctl_args)`.
const IOC_QUOTA_CTL: libc::c_ulong = 0xc010_9428;
/// `_IO(0x94, 46)`: waits for a rescan of the quota counts under way.
const IOC_QUOTA_RESCAN_WAIT: libc::c_ulong = 0x942e;
/// `BTRFS_SUBVOL_RDONLY`.
const SUBVOL_RDONLY: u64 = 1 << 1;
/// `BTRFS_QGROUP_LIMIT_MAX_RFER`.
const LIMIT_MAX_RFER: u64 = 1;
/// `BTRFS_QUOTA_CTL_ENABLE`.
const QUOTA_CTL_ENABLE: u64 = 1;

/// `struct btrfs_ioctl_ino_lookup_args`: 4 096 bytes.
#[repr(C)]
struct InoLookupArgs {
    treeid: u64,
    objectid: u64,
    name: [u8; 4080],
}

/// `struct btrfs_ioctl_fs_info_args`: 1 024 bytes (what is read of it: the filesystem's id).
#[repr(C)]
struct FsInfoArgs {
    max_id: u64,
    num_devices: u64,
    fsid: [u8; 16],
    rest: [u8; 992],
}

const _: () = assert!(std::mem::size_of::<InoLookupArgs>() == 4096);
const _: () = assert!(std::mem::size_of::<FsInfoArgs>() == 1024);

/// `_IOWR(0x94, 18, struct btrfs_ioctl_ino_lookup_args)`.
const IOC_INO_LOOKUP: libc::c_ulong = 0xd000_9412;
/// `_IOR(0x94, 31, struct btrfs_ioctl_fs_info_args)`.
const IOC_FS_INFO: libc::c_ulong = 0x8400_941f;
/// `BTRFS_FIRST_FREE_OBJECTID`: a subvolume's top directory.
const FIRST_FREE_OBJECTID: u64 = 256;

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
        let mut args = QuotaCtlArgs {
            cmd: QUOTA_CTL_ENABLE,
            status: 0,
        };
        // SAFETY: the request's argument is a `btrfs_ioctl_quota_ctl_args`, alive for the call.
        unsafe {
            ioctl(
                &top,
                IOC_QUOTA_CTL,
                &mut args as *mut QuotaCtlArgs as *mut libc::c_void,
            )
        }
        .map_err(|e| format!("cannot turn quotas on in {}: {e}", mnt.display()))?;
        // SAFETY: the request takes no argument.
        unsafe { ioctl(&top, IOC_QUOTA_RESCAN_WAIT, std::ptr::null_mut()) }
            .map_err(|e| format!("cannot wait for the quota counts of {}: {e}", mnt.display()))?;
        for sub in ["ws", "snap"] {
            match std::fs::DirBuilder::new().mode(0o700).create(mnt.join(sub)) {
                Err(e) if e.kind() != std::io::ErrorKind::AlreadyExists => return Err(e.into()),
                _ => {}
            }
        }
        let mut info = Box::new(FsInfoArgs {
            max_id: 0,
            num_devices: 0,
            fsid: [0; 16],
            rest: [0; 992],
        });
        // SAFETY: the request's argument is a `btrfs_ioctl_fs_info_args`, alive for the call.
        unsafe { ioctl(&top, IOC_FS_INFO, &mut *info as *mut FsInfoArgs as *mut _) }
            .map_err(|e| format!("cannot read the filesystem id of {}: {e}", mnt.display()))?;
        let hex: String = info.fsid.iter().map(|b| format!("{b:02x}")).collect();
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
            None => {
                let mut args = vol_args_v2(sandbox, None, 0)?;
                // SAFETY: the request's argument is a `btrfs_ioctl_vol_args_v2`, alive for the call.
                unsafe {
                    ioctl(
                        &parent,
                        IOC_SUBVOL_CREATE_V2,
                        &mut *args as *mut VolArgsV2 as *mut _,
                    )
                }
                .map_err(|e| format!("cannot make the subvolume {}: {e}", path.display()))?;
            }
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
        let mut args = Box::new(VolArgs {
            fd: 0,
            name: [0; 4088],
        });
        let name = name.as_bytes();
        if name.len() >= args.name.len() {
            return Err("name too long".into());
        }
        args.name[..name.len()].copy_from_slice(name);
        // SAFETY: the request's argument is a `btrfs_ioctl_vol_args`, alive for the call.
        unsafe {
            ioctl(
                &parent,
                IOC_SNAP_DESTROY,
                &mut *args as *mut VolArgs as *mut _,
            )
        }
        .map_err(|e| format!("cannot remove the subvolume {}: {e}", path.display()).into())
    }

    fn used_bytes(&self, sandbox: &str) -> Option<u64> {
        let subvolume = open_dir(&self.workspace(sandbox)).ok()?;
        let mut args = Box::new(InoLookupArgs {
            treeid: 0,
            objectid: FIRST_FREE_OBJECTID,
            name: [0; 4080],
        });
        // SAFETY: the request's argument is a `btrfs_ioctl_ino_lookup_args`, alive for the call.
        unsafe {
            ioctl(
                &subvolume,
                IOC_INO_LOOKUP,
                &mut *args as *mut InoLookupArgs as *mut _,
            )
        }
        .ok()?;
        let path = self
            .qgroups
            .join(format!("0_{}", args.treeid))
            .join("referenced");
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
    let flags = if read_only { SUBVOL_RDONLY } else { 0 };
    let mut args = vol_args_v2(name, Some(&source), flags)?;
    // SAFETY: the request's argument is a `btrfs_ioctl_vol_args_v2`, alive for the call.
    unsafe {
        ioctl(
            parent,
            IOC_SNAP_CREATE_V2,
            &mut *args as *mut VolArgsV2 as *mut _,
        )
    }
    .map_err(|e| format!("cannot snapshot {} as {name}: {e}", from.display()).into())
}

/// Limits the quota group of the subvolume at `path` to `bytes` referenced.
fn limit(path: &Path, bytes: u64) -> Result<(), BoxError> {
    let subvolume = open_dir(path)?;
    let mut args = QgroupLimitArgs {
        qgroupid: 0,
        flags: LIMIT_MAX_RFER,
        max_rfer: bytes,
        max_excl: 0,
        rsv_rfer: 0,
        rsv_excl: 0,
    };
    // SAFETY: the request's argument is a `btrfs_ioctl_qgroup_limit_args`, alive for the call.
    unsafe {
        ioctl(
            &subvolume,
            IOC_QGROUP_LIMIT,
            &mut args as *mut QgroupLimitArgs as *mut _,
        )
    }
    .map_err(|e| format!("cannot limit {} to {bytes} bytes: {e}", path.display()).into())
}

fn vol_args_v2(
    name: &str,
    source: Option<&OwnedFd>,
    flags: u64,
) -> Result<Box<VolArgsV2>, BoxError> {
    let mut args = Box::new(VolArgsV2 {
        fd: source.map_or(0, |s| i64::from(s.as_raw_fd())),
        transid: 0,
        flags,
        unused: [0; 4],
        name: [0; 4040],
    });
    if name.is_empty() || name.contains('/') || name.len() >= args.name.len() {
        return Err(format!("{name:?} is not a subvolume name").into());
    }
    args.name[..name.len()].copy_from_slice(name.as_bytes());
    Ok(args)
}

/// `ioctl(fd, request, arg)`.
///
/// # Safety
/// `arg` must point to what `request` reads and writes, alive for the call.
unsafe fn ioctl(
    fd: &OwnedFd,
    request: libc::c_ulong,
    arg: *mut libc::c_void,
) -> std::io::Result<()> {
    // SAFETY: `fd` is an open descriptor; `arg` is what `request` takes (the caller's promise).
    let r = unsafe { libc::ioctl(fd.as_raw_fd(), request, arg) };
    if r < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

fn open_dir(path: &Path) -> Result<OwnedFd, BoxError> {
    let c = CString::new(path.as_os_str().as_bytes())?;
    let fd = nix::fcntl::open(
        c.as_c_str(),
        OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| format!("cannot open {}: {e}", path.display()))?;
    // SAFETY: open returned a new descriptor nothing else owns.
    Ok(unsafe { std::os::fd::FromRawFd::from_raw_fd(fd) })
}

//! The btrfs calls of the copy-on-write store of agent workspaces: subvolumes, snapshots, their removal, quota
//! groups and their limits, as the kernel's ioctls (declared with nix's `ioctl_*!` macros) behind safe functions
//! on open directories. The one crate that wraps them (`btrfsutil`) binds a C library the daemon would then need at
//! build and run time, for eight calls; the argument structures below are the kernel's UAPI
//! (`linux/btrfs.h`), their sizes checked at compile time.

use std::os::fd::{AsFd, AsRawFd, BorrowedFd};

/// `BTRFS_IOCTL_MAGIC`.
const MAGIC: u8 = 0x94;
/// `BTRFS_SUBVOL_RDONLY`.
const SUBVOL_RDONLY: u64 = 1 << 1;
/// `BTRFS_QGROUP_LIMIT_MAX_RFER`.
const LIMIT_MAX_RFER: u64 = 1;
/// `BTRFS_QUOTA_CTL_ENABLE`.
const QUOTA_CTL_ENABLE: u64 = 1;
/// `BTRFS_FIRST_FREE_OBJECTID`: a subvolume's top directory.
const FIRST_FREE_OBJECTID: u64 = 256;

/// `struct btrfs_ioctl_vol_args_v2`: 4 096 bytes.
#[repr(C)]
pub(crate) struct VolArgsV2 {
    fd: i64,
    transid: u64,
    flags: u64,
    unused: [u64; 4],
    name: [u8; 4040],
}

/// `struct btrfs_ioctl_vol_args`: 4 096 bytes.
#[repr(C)]
pub(crate) struct VolArgs {
    fd: i64,
    name: [u8; 4088],
}

/// `struct btrfs_ioctl_qgroup_limit_args` (its `struct btrfs_qgroup_limit` inline).
#[repr(C)]
pub(crate) struct QgroupLimitArgs {
    qgroupid: u64,
    flags: u64,
    max_rfer: u64,
    max_excl: u64,
    rsv_rfer: u64,
    rsv_excl: u64,
}

/// `struct btrfs_ioctl_quota_ctl_args`.
#[repr(C)]
pub(crate) struct QuotaCtlArgs {
    cmd: u64,
    status: u64,
}

/// `struct btrfs_ioctl_ino_lookup_args`: 4 096 bytes.
#[repr(C)]
pub(crate) struct InoLookupArgs {
    treeid: u64,
    objectid: u64,
    name: [u8; 4080],
}

/// `struct btrfs_ioctl_fs_info_args`: 1 024 bytes (what is read of it: the filesystem's id).
#[repr(C)]
pub(crate) struct FsInfoArgs {
    max_id: u64,
    num_devices: u64,
    fsid: [u8; 16],
    rest: [u8; 992],
}

const _: () = assert!(std::mem::size_of::<VolArgsV2>() == 4096);
const _: () = assert!(std::mem::size_of::<VolArgs>() == 4096);
const _: () = assert!(std::mem::size_of::<QgroupLimitArgs>() == 48);
const _: () = assert!(std::mem::size_of::<QuotaCtlArgs>() == 16);
const _: () = assert!(std::mem::size_of::<InoLookupArgs>() == 4096);
const _: () = assert!(std::mem::size_of::<FsInfoArgs>() == 1024);

/// The ioctls, as the kernel declares them (direction, number, argument).
mod ioc {
    use super::{
        FsInfoArgs, InoLookupArgs, QgroupLimitArgs, QuotaCtlArgs, VolArgs, VolArgsV2, MAGIC,
    };

    nix::ioctl_write_ptr!(snap_destroy, MAGIC, 15, VolArgs);
    nix::ioctl_readwrite!(ino_lookup, MAGIC, 18, InoLookupArgs);
    nix::ioctl_write_ptr!(snap_create_v2, MAGIC, 23, VolArgsV2);
    nix::ioctl_write_ptr!(subvol_create_v2, MAGIC, 24, VolArgsV2);
    nix::ioctl_read!(fs_info, MAGIC, 31, FsInfoArgs);
    nix::ioctl_readwrite!(quota_ctl, MAGIC, 40, QuotaCtlArgs);
    nix::ioctl_read!(qgroup_limit, MAGIC, 43, QgroupLimitArgs);
    nix::ioctl_none!(quota_rescan_wait, MAGIC, 46);
}

/// A subvolume or snapshot name is one path component, shorter than the kernel's buffer.
fn name_into(buf: &mut [u8], name: &[u8]) -> std::io::Result<()> {
    if name.is_empty() || name.contains(&b'/') || name.len() >= buf.len() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!(
                "{:?} is not a subvolume name",
                String::from_utf8_lossy(name)
            ),
        ));
    }
    buf[..name.len()].copy_from_slice(name);
    Ok(())
}

fn vol_args_v2(
    name: &[u8],
    source: Option<BorrowedFd<'_>>,
    flags: u64,
) -> std::io::Result<Box<VolArgsV2>> {
    let mut args = Box::new(VolArgsV2 {
        fd: source.map_or(0, |s| i64::from(s.as_raw_fd())),
        transid: 0,
        flags,
        unused: [0; 4],
        name: [0; 4040],
    });
    name_into(&mut args.name, name)?;
    Ok(args)
}

/// Turns quotas on in the filesystem of `dir` and waits for the rescan of its counts.
pub fn enable_quotas(dir: impl AsFd) -> std::io::Result<()> {
    let fd = dir.as_fd().as_raw_fd();
    let mut args = QuotaCtlArgs {
        cmd: QUOTA_CTL_ENABLE,
        status: 0,
    };
    // SAFETY: `fd` is open for the call; the argument is the request's structure, alive for the call.
    unsafe { ioc::quota_ctl(fd, &mut args) }?;
    // SAFETY: `fd` is open for the call; the request takes no argument.
    unsafe { ioc::quota_rescan_wait(fd) }?;
    Ok(())
}

/// The id of the filesystem of `dir` (what names it under `/sys/fs/btrfs`).
pub fn filesystem_id(dir: impl AsFd) -> std::io::Result<[u8; 16]> {
    let mut info = Box::new(FsInfoArgs {
        max_id: 0,
        num_devices: 0,
        fsid: [0; 16],
        rest: [0; 992],
    });
    // SAFETY: the descriptor is open for the call; the argument is the request's structure, alive for the call.
    unsafe { ioc::fs_info(dir.as_fd().as_raw_fd(), &mut *info) }?;
    Ok(info.fsid)
}

/// Makes the empty subvolume `name` in the directory `parent`.
pub fn create_subvolume(parent: impl AsFd, name: &[u8]) -> std::io::Result<()> {
    let args = vol_args_v2(name, None, 0)?;
    // SAFETY: the descriptor is open for the call; the argument is the request's structure, alive for the call.
    unsafe { ioc::subvol_create_v2(parent.as_fd().as_raw_fd(), &*args) }?;
    Ok(())
}

/// Makes `name` in the directory `parent` a snapshot of the subvolume `source` (read-only with `read_only`).
pub fn snapshot(
    parent: impl AsFd,
    source: impl AsFd,
    name: &[u8],
    read_only: bool,
) -> std::io::Result<()> {
    let flags = if read_only { SUBVOL_RDONLY } else { 0 };
    let args = vol_args_v2(name, Some(source.as_fd()), flags)?;
    // SAFETY: both descriptors are open for the call; the argument is the request's structure, alive for it.
    unsafe { ioc::snap_create_v2(parent.as_fd().as_raw_fd(), &*args) }?;
    Ok(())
}

/// Removes the subvolume or snapshot `name` in the directory `parent`.
pub fn destroy(parent: impl AsFd, name: &[u8]) -> std::io::Result<()> {
    let mut args = Box::new(VolArgs {
        fd: 0,
        name: [0; 4088],
    });
    name_into(&mut args.name, name)?;
    // SAFETY: the descriptor is open for the call; the argument is the request's structure, alive for the call.
    unsafe { ioc::snap_destroy(parent.as_fd().as_raw_fd(), &*args) }?;
    Ok(())
}

/// The id of the subvolume whose top directory is `subvolume` (its quota group is `0/<id>`).
pub fn subvolume_id(subvolume: impl AsFd) -> std::io::Result<u64> {
    let mut args = Box::new(InoLookupArgs {
        treeid: 0,
        objectid: FIRST_FREE_OBJECTID,
        name: [0; 4080],
    });
    // SAFETY: the descriptor is open for the call; the argument is the request's structure, alive for the call.
    unsafe { ioc::ino_lookup(subvolume.as_fd().as_raw_fd(), &mut *args) }?;
    Ok(args.treeid)
}

/// Limits the quota group of the subvolume whose top directory is `subvolume` to `bytes` referenced (a write past
/// it fails with `EDQUOT`).
pub fn limit_referenced(subvolume: impl AsFd, bytes: u64) -> std::io::Result<()> {
    let mut args = QgroupLimitArgs {
        qgroupid: 0,
        flags: LIMIT_MAX_RFER,
        max_rfer: bytes,
        max_excl: 0,
        rsv_rfer: 0,
        rsv_excl: 0,
    };
    // SAFETY: the descriptor is open for the call; the argument is the request's structure, alive for the call.
    unsafe { ioc::qgroup_limit(subvolume.as_fd().as_raw_fd(), &mut args) }?;
    Ok(())
}

#[cfg(test)]
mod tests {
    /// The request numbers nix computes are the kernel's (`_IOW(0x94, 23, ...)` and the rest, as `strace` shows them).
    #[test]
    fn the_requests_are_the_kernels() {
        use super::*;
        use nix::{
            request_code_none, request_code_read, request_code_readwrite, request_code_write,
        };
        use std::mem::size_of;
        // As `strace` shows them: `_IOW(0x94, 23, struct btrfs_ioctl_vol_args_v2)` and the rest.
        let requests = [
            (
                request_code_write!(MAGIC, 23, size_of::<VolArgsV2>()),
                0x5000_9417,
            ),
            (
                request_code_write!(MAGIC, 24, size_of::<VolArgsV2>()),
                0x5000_9418,
            ),
            (
                request_code_write!(MAGIC, 15, size_of::<VolArgs>()),
                0x5000_940f,
            ),
            (
                request_code_read!(MAGIC, 43, size_of::<QgroupLimitArgs>()),
                0x8030_942b,
            ),
            (
                request_code_readwrite!(MAGIC, 40, size_of::<QuotaCtlArgs>()),
                0xc010_9428,
            ),
            (request_code_none!(MAGIC, 46), 0x942e),
            (
                request_code_readwrite!(MAGIC, 18, size_of::<InoLookupArgs>()),
                0xd000_9412,
            ),
            (
                request_code_read!(MAGIC, 31, size_of::<FsInfoArgs>()),
                0x8400_941f,
            ),
        ];
        for (computed, kernel) in requests {
            assert_eq!(computed, kernel, "{kernel:#x}");
        }
    }

    #[test]
    fn a_name_is_one_component_that_fits() {
        let mut buf = [0u8; 8];
        assert!(super::name_into(&mut buf, b"ws-1").is_ok());
        assert_eq!(&buf[..5], b"ws-1\0");
        for bad in [&b""[..], b"a/b", b"12345678"] {
            assert!(super::name_into(&mut [0u8; 8], bad).is_err(), "{bad:?}");
        }
    }
}

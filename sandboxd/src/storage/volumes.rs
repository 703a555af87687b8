//! The kernel side of volumes ([`agents::volumes::Disks`]): a volume's filesystem is ext4 in a sparse file of its
//! size (`disk.img`: the quota is the filesystem's size, so a write past it fails with `ENOSPC` inside and the
//! state disk never holds more than the file), loop-mounted at `mnt` in the daemon's own mount namespace (so every
//! mount goes with the daemon, whatever ends it), and bound into a sandbox's workspace with an idmapping
//! ([`runtime::idmap`]): files owned by 0 on disk are the sandbox's root's, whatever host uid that sandbox has.
//!
//! `mkfs.ext4` (e2fsprogs) makes the filesystem and `mount(8)` (util-linux) attaches the loop device: no crate
//! makes ext4, and `mount -o loop` reuses the loop device of a file already attached (one superblock for one file,
//! never two mounts of it through two devices). Unmounts and idmapped binds are system calls. A sandbox's bind
//! goes with its workspace's tmpfs (a lazy unmount takes its submounts): it is never unmounted by a path the
//! sandbox's agent could have changed.

use std::path::{Path, PathBuf};
use std::process::Command;

use agents::volumes::{BoxError, Disks};
use nix::mount::MntFlags;

/// Volumes as ext4 files, loop-mounted.
pub struct Ext4Disks;

impl Ext4Disks {
    /// The disks, when this host can make them: `mkfs.ext4` and `mount` on the `PATH` the tools run with, and
    /// `/dev/loop-control` open for writing (a container without loop devices, such as a Docker one that is not
    /// privileged, has none). Otherwise why not: the daemon then has no volumes (`capability_unsupported`).
    pub fn probe() -> Result<Self, String> {
        probe_tools(&["mkfs.ext4", "mount"]).map(|()| Self)
    }
}

/// Whether `tools` are on the `PATH` the tools run with and `/dev/loop-control` opens for writing; why not
/// otherwise.
pub(crate) fn probe_tools(tools: &[&str]) -> Result<(), String> {
    for tool in tools {
        let found = TOOL_PATH
            .split(':')
            .any(|dir| Path::new(dir).join(tool).is_file());
        if !found {
            return Err(format!("no {tool} in {TOOL_PATH}"));
        }
    }
    std::fs::OpenOptions::new()
        .write(true)
        .open("/dev/loop-control")
        .map_err(|e| format!("cannot open /dev/loop-control: {e}"))?;
    Ok(())
}

/// Where the tools are looked for.
const TOOL_PATH: &str = "/usr/sbin:/usr/bin:/sbin:/bin";

fn image(dir: &Path) -> PathBuf {
    dir.join("disk.img")
}

fn mnt(dir: &Path) -> PathBuf {
    dir.join("mnt")
}

/// Runs a tool, its stderr in the error.
pub(crate) fn run(cmd: &mut Command) -> Result<(), BoxError> {
    let out = cmd
        .env_clear()
        .env("PATH", TOOL_PATH)
        .output()
        .map_err(|e| format!("cannot run {:?}: {e}", cmd.get_program()))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{:?} failed ({}): {}",
            cmd.get_program(),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        )
        .into())
    }
}

/// Whether `path` is a mount point (its device differs from its parent's).
pub(crate) fn mounted(path: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    match (
        std::fs::metadata(path),
        path.parent().map(std::fs::metadata),
    ) {
        (Ok(a), Some(Ok(b))) => a.dev() != b.dev(),
        _ => false,
    }
}

impl Disks for Ext4Disks {
    fn create(&self, dir: &Path, bytes: u64) -> Result<(), BoxError> {
        let img = image(dir);
        std::fs::File::create_new(&img)?.set_len(bytes)?;
        // No blocks reserved for root: owner 0 on disk is the sandbox's root, which must not get more room than
        // the volume's size says.
        run(Command::new("mkfs.ext4")
            .args(["-q", "-F", "-m", "0", "-E", "root_owner=0:0"])
            .arg(&img))?;
        std::fs::create_dir(mnt(dir))?;
        Ok(())
    }

    fn mount(&self, dir: &Path) -> Result<(), BoxError> {
        let target = mnt(dir);
        if mounted(&target) {
            return Ok(());
        }
        run(Command::new("mount")
            .args(["-t", "ext4", "-o", "loop,nosuid,nodev"])
            .arg(image(dir))
            .arg(&target))?;
        tracing::info!(volume = %dir.display(), "volume filesystem mounted");
        Ok(())
    }

    fn unmount(&self, dir: &Path) -> Result<(), BoxError> {
        let target = mnt(dir);
        if !mounted(&target) {
            return Ok(());
        }
        // The loop device was attached with autoclear: it goes with its last mount.
        nix::mount::umount2(&target, MntFlags::empty())?;
        if mounted(&target) {
            return Err(format!("{} is still mounted", target.display()).into());
        }
        Ok(())
    }

    fn attach(
        &self,
        dir: &Path,
        target: &Path,
        host_id: u32,
        read_only: bool,
    ) -> Result<(), BoxError> {
        Ok(runtime::idmap::bind(&mnt(dir), target, host_id, read_only)?)
    }

    fn used_bytes(&self, dir: &Path) -> u64 {
        let target = mnt(dir);
        if !mounted(&target) {
            return 0;
        }
        nix::sys::statvfs::statvfs(&target)
            .map(|s| (s.blocks() - s.blocks_free()) * s.fragment_size())
            .unwrap_or(0)
    }
}

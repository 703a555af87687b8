//! Live restore's part of the daemon's start and exit (`agents.live_restore`, see [`agents::restore`]): the mount
//! namespace and the cgroups a previous daemon's agent sandboxes live on.
//!
//! The daemon makes its mounts (each sandbox's tmpfs, root overlay, workspace from a snapshot) in a mount namespace
//! of its own, which would die with it. With live restore the namespace is pinned: bound onto
//! `<state_dir>/mntns/ns` in the host's mount namespace (pid 1's, else the parent's), where `<state_dir>/mntns` is a
//! private bind of itself, root's only, so the pin never propagates. The next daemon, before anything else, clones
//! each recorded sandbox's directory with what is mounted under it out of the pinned namespace (`open_tree`) and
//! attaches it at the same place in its own new one (`move_mount`), each of its volumes' own mount
//! (`<state_dir>/volumes/<id>/mnt`) first; then it pins its own namespace instead. A sandbox whose mounts cannot all
//! be carried is marked lost ([`agents::restore::mark_lost`]): its run is ended with the leftovers. What the old
//! namespace held for anything else (the executions' mounts) goes with it.
//!
//! Hand-written, because no crate moves mount trees between namespaces; it uses the same two syscalls the runtime's
//! binds do ([`runtime::sys::open_tree`], [`runtime::sys::move_mount_onto`]).

use std::ffi::CString;
use std::fs::File;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use anyhow::Context;
use nix::mount::{MntFlags, MsFlags};
use nix::sched::CloneFlags;
use tracing::{info, warn};

/// The host's mount namespace (where the pin is), kept from the start for [`unpin_if_unused`].
static HOST: OnceLock<File> = OnceLock::new();

/// The pin's directory and file under `state_dir`.
fn pin(state_dir: &Path) -> (PathBuf, PathBuf) {
    let dir = state_dir.join("mntns");
    let file = dir.join("ns");
    (dir, file)
}

/// Where a new namespace is pinned before it replaces the old one at the pin (see [`pin_new`]).
fn next(pin_file: &Path) -> PathBuf {
    pin_file.with_extension("next")
}

/// Whether `path` is a mount namespace file (a pin).
fn is_pinned(path: &Path) -> bool {
    nix::sys::statfs::statfs(path)
        .is_ok_and(|s| s.filesystem_type() == nix::sys::statfs::NSFS_MAGIC)
}

/// Enters the daemon's own mount namespace (as [`runtime::rootfs::unshare_mount_namespace`] does). With live
/// restore, first carries over the recorded sandboxes' mounts from the previous daemon's pinned namespace, and
/// pins the new one; without it, a pin a previous daemon left is released. The pin lives in the host's mount
/// namespace (pid 1's, else the parent's), not necessarily the one the daemon started in: a service manager may
/// start it in a namespace of its own (`ProtectSystem=`, `PrivateTmp=`), which ends with it. Must run on the thread
/// that forks the helpers, before it does (they start in the namespace it ends in).
pub fn enter_mount_namespace(state_dir: &Path, live_restore: bool) -> anyhow::Result<()> {
    let (pin_dir, pin_file) = pin(state_dir);
    if !live_restore && !pin_dir.exists() {
        runtime::rootfs::unshare_mount_namespace()?;
        return Ok(());
    }
    let cwd = std::env::current_dir().ok();
    let start = File::open("/proc/self/ns/mnt").context("open our mount namespace")?;
    // First: the unshare gives this thread a filesystem context of its own, without which it could not change
    // namespaces while other threads run (telemetry's exporter may have started some).
    runtime::rootfs::unshare_mount_namespace()?;
    let new = File::open("/proc/self/ns/mnt").context("open our mount namespace")?;
    let enter = |ns: &File, what: &str| {
        nix::sched::setns(ns.as_fd(), CloneFlags::CLONE_NEWNS)
            .with_context(|| format!("enter {what} mount namespace"))
    };
    // The host's namespace, where the pin is: init's; when it cannot be entered (a host that hides pid 1), the one
    // of the process that started us (a service manager that gave us a namespace of our own is in the host's);
    // else the one we started in.
    let parent = format!("/proc/{}/ns/mnt", nix::unistd::getppid());
    let host = ["/proc/1/ns/mnt", parent.as_str()]
        .into_iter()
        .filter_map(|p| File::open(p).ok())
        .find(|h| enter(h, "the host's").is_ok());
    let host = match host {
        Some(h) => h,
        None => {
            info!("the host's mount namespace cannot be entered: the pin lasts as long as the one sandboxd started in");
            enter(&start, "the starting")?;
            start
        }
    };
    // A pin being replaced when a daemon died is at `next` (the newer one, with every carried sandbox).
    let old = [next(&pin_file), pin_file.clone()]
        .into_iter()
        .find(|p| is_pinned(p))
        .map(|p| File::open(&p).context("open the previous daemon's mount namespace"))
        .transpose()?;
    let result = if live_restore {
        carry_all(state_dir, old.as_ref(), &new)
            .and_then(|()| enter(&host, "the host's"))
            .and_then(|()| pin_new(&pin_dir, &pin_file, &new))
    } else {
        if old.is_some() {
            warn!(pin = %pin_file.display(), "agents.live_restore is off: the previous daemon's mount namespace is released (its sandboxes are removed)");
        }
        Unpin::new(&pin_dir, &pin_file).map(|u| u.run())
    };
    enter(&new, "our")?;
    // Our copy of the pin directory, if the namespace we started in had one (the pin itself is never copied).
    while nix::mount::umount2(&pin_dir, MntFlags::MNT_DETACH).is_ok() {}
    if let Some(cwd) = cwd {
        let _ = std::env::set_current_dir(cwd);
    }
    if live_restore {
        let _ = HOST.set(host);
    }
    result
}

/// Carries every recorded sandbox's mounts from `old` (the previous namespace) into `new`; ends in `new`. A
/// sandbox with volumes has each volume's own mount (`<state_dir>/volumes/<id>/mnt`) carried first: the same
/// superblock its agent's container holds, which the volumes then find mounted instead of mounting the volume's
/// file a second time; so is the workspace store's for a sandbox whose workspace is there. A sandbox whose mounts cannot all be carried (or when there is no previous namespace) is
/// marked lost ([`agents::restore::mark_lost`]): its run is ended with the leftovers, before any volume is mounted.
fn carry_all(state_dir: &Path, old: Option<&File>, new: &File) -> anyhow::Result<()> {
    let volumes = state_dir.join("volumes");
    let mut carried_volumes = std::collections::BTreeSet::new();
    let mut store_carried = false;
    let mut lost = Vec::new();
    for (dir, record) in agents::restore::carried_records(&state_dir.join("agents")) {
        let carried = match old {
            None => Err(anyhow::anyhow!(
                "no mount namespace of a previous daemon is pinned"
            )),
            Some(old) => carry_store(old, new, (state_dir, &mut store_carried), record.cow)
                .and_then(|()| {
                    record.volumes.iter().try_for_each(|m| {
                        if carried_volumes.contains(&m.volume) {
                            return Ok(());
                        }
                        carry(old, new, &volumes.join(&m.volume).join("mnt"))
                            .with_context(|| format!("volume {}", m.volume))?;
                        carried_volumes.insert(m.volume.clone());
                        Ok(())
                    })
                })
                .and_then(|()| carry(old, new, &dir)),
        };
        match carried {
            Ok(()) => info!(path = %dir.display(), "agent sandbox mounts carried over"),
            Err(e) => {
                warn!(path = %dir.display(), error = %format!("{e:#}"), "agent sandbox mounts not carried over: its run is ended");
                lost.push(dir);
            }
        }
    }
    // The E2B sandboxes' directories (their scratch space and root); one that is not carried is not taken back
    // (the engine ends it).
    let e2b = state_dir.join("e2b");
    for id in e2b::sandboxes::recorded(&e2b) {
        let dir = e2b.join(&id);
        let carried = match old {
            None => Err(anyhow::anyhow!(
                "no mount namespace of a previous daemon is pinned"
            )),
            Some(old) => carry(old, new, &dir),
        };
        match carried {
            Ok(()) => info!(path = %dir.display(), "E2B sandbox mounts carried over"),
            Err(e) => {
                warn!(path = %dir.display(), error = %format!("{e:#}"), "E2B sandbox mounts not carried over")
            }
        }
    }
    // Marked once every carry was tried; a start that cannot mark them all fails with none marked (the previous
    // namespace stays pinned for the next try).
    for (i, dir) in lost.iter().enumerate() {
        if let Err(e) = agents::restore::mark_lost(dir) {
            for marked in &lost[..i] {
                let _ = agents::restore::unmark_lost(marked);
            }
            return Err(e).with_context(|| format!("mark {} as not carried", dir.display()));
        }
    }
    Ok(())
}

/// For a sandbox whose workspace is in the copy-on-write store (`cow`): the store's mount
/// (`<state_dir>/workspaces/mnt`), carried once, before the first such sandbox's tree, as a volume's is.
fn carry_store(
    old: &File,
    new: &File,
    (state_dir, carried): (&Path, &mut bool),
    cow: bool,
) -> anyhow::Result<()> {
    if !cow || *carried {
        return Ok(());
    }
    carry(old, new, &state_dir.join("workspaces").join("mnt")).context("the workspace store")?;
    *carried = true;
    Ok(())
}

/// Clones `dir` with its mounts in `old` and attaches the clone at `dir` in `new`; ends in `new`.
fn carry(old: &File, new: &File, dir: &Path) -> anyhow::Result<()> {
    let path = CString::new(dir.as_os_str().as_bytes())?;
    nix::sched::setns(old.as_fd(), CloneFlags::CLONE_NEWNS)
        .context("enter the previous namespace")?;
    let tree = runtime::sys::open_tree(libc::AT_FDCWD, &path);
    nix::sched::setns(new.as_fd(), CloneFlags::CLONE_NEWNS).context("enter our namespace again")?;
    let tree = tree.context("open_tree")?;
    let target: OwnedFd = File::open(dir).context("open the mount point")?.into();
    runtime::sys::move_mount_onto(&tree, &target).context("move_mount")?;
    Ok(())
}

/// In the host's namespace: replaces the pin with `new` (the pin's directory made a private mount first). At every
/// moment one of the pin and `next` pins a namespace with every sandbox's mounts: `new` is pinned at `next` first,
/// then at the pin, and only then is `next` released.
fn pin_new(pin_dir: &Path, pin_file: &Path, new: &File) -> anyhow::Result<()> {
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(pin_dir)?;
    if !runtime::rootfs::is_mount_point(pin_dir) {
        nix::mount::mount(
            Some(pin_dir),
            pin_dir,
            None::<&str>,
            MsFlags::MS_BIND,
            None::<&str>,
        )
        .context("bind the pin's directory")?;
    }
    nix::mount::mount(
        None::<&str>,
        pin_dir,
        None::<&str>,
        MsFlags::MS_PRIVATE,
        None::<&str>,
    )
    .context("make the pin's directory private")?;
    let source = format!("/proc/self/fd/{}", new.as_raw_fd());
    let bind = |to: &Path| -> anyhow::Result<()> {
        // A pin there already (a previous namespace) is released first.
        while nix::mount::umount2(to, MntFlags::MNT_DETACH).is_ok() {}
        File::create(to)?;
        nix::mount::mount(
            Some(source.as_str()),
            to,
            None::<&str>,
            MsFlags::MS_BIND,
            None::<&str>,
        )
        .with_context(|| format!("pin our mount namespace at {}", to.display()))
    };
    let next = next(pin_file);
    bind(&next)?;
    bind(pin_file)?;
    while nix::mount::umount2(&next, MntFlags::MNT_DETACH).is_ok() {}
    let _ = std::fs::remove_file(&next);
    Ok(())
}

/// Refuses a start with live restore whose agent uids (`range`, from [`crate::config::Config::agent_uids`]) do
/// not hold the host uid of every sandbox a previous daemon left to take back under `agents`: such a sandbox
/// keeps its uid (its files and processes are that uid's), which this daemon would not take, or would give to an
/// execution. Checked before any container is created.
pub fn check_recorded_uids(agents: &Path, range: std::ops::Range<u32>) -> anyhow::Result<()> {
    for (_, record) in agents::restore::carried_records(agents) {
        if !range.contains(&record.host_id) {
            anyhow::bail!(
                "agents.live_restore: sandbox {} of a previous daemon runs as host uid {}, outside this \
                 configuration's agent sandbox uids {}..{} (from sandbox.uid_base, capacity.max_concurrent, \
                 pool.size and agents.max_sandboxes): start with the values it was created under, or once with \
                 agents.live_restore: false, which ends the sandboxes a previous daemon left",
                record.id,
                record.host_id,
                range.start,
                range.end
            );
        }
    }
    Ok(())
}

/// At exit with live restore: when no sandbox is left for a next daemon, the pin and its directory are removed
/// (in the host's namespace, from a forked child: the daemon is multi-threaded by then).
pub fn unpin_if_unused(state_dir: &Path) {
    if !agents::restore::recorded(&state_dir.join("agents")).is_empty() {
        return;
    }
    let (pin_dir, pin_file) = pin(state_dir);
    let (Some(host), Ok(unpin)) = (HOST.get(), Unpin::new(&pin_dir, &pin_file)) else {
        return;
    };
    // SAFETY: the child only makes raw syscalls (setns, then `Unpin::run`'s) and `_exit`s: nothing that needs a
    // lock another thread of ours may hold at the fork.
    match unsafe { nix::unistd::fork() } {
        Ok(nix::unistd::ForkResult::Child) => {
            // SAFETY: setns on a valid descriptor; `_exit` ends the child without running anything of ours.
            unsafe {
                if libc::setns(host.as_raw_fd(), libc::CLONE_NEWNS) == 0 {
                    unpin.run();
                }
                libc::_exit(0)
            }
        }
        Ok(nix::unistd::ForkResult::Parent { child }) => {
            let _ = nix::sys::wait::waitpid(child, None);
        }
        Err(e) => warn!(error = %e, "cannot unpin the mount namespace"),
    }
}

/// Releasing the pin (both names) and its directory, as raw syscalls on paths made beforehand: it runs in a forked
/// child of the multi-threaded daemon too, where nothing may allocate.
struct Unpin {
    file: CString,
    next: CString,
    dir: CString,
}

impl Unpin {
    fn new(pin_dir: &Path, pin_file: &Path) -> anyhow::Result<Unpin> {
        let c = |p: &Path| CString::new(p.as_os_str().as_bytes()).context("a pin path");
        Ok(Unpin {
            file: c(pin_file)?,
            next: c(&next(pin_file))?,
            dir: c(pin_dir)?,
        })
    }

    /// In the host's namespace: every pin, then the directory (bound more than once by an older daemon, it comes
    /// off in full). Errors are ignored: what is not there is released already.
    fn run(&self) {
        // SAFETY: umount2, unlink and rmdir on NUL-terminated paths that outlive the calls; nothing else.
        unsafe {
            libc::umount2(self.file.as_ptr(), libc::MNT_DETACH);
            libc::umount2(self.next.as_ptr(), libc::MNT_DETACH);
            while libc::umount2(self.dir.as_ptr(), libc::MNT_DETACH) == 0 {}
            libc::unlink(self.file.as_ptr());
            libc::unlink(self.next.as_ptr());
            libc::rmdir(self.dir.as_ptr());
        }
    }
}

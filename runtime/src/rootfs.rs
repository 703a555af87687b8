//! Root filesystems: the embedded `host` image and each execution's scratch space.
//!
//! The `host` image is a skeleton directory holding only mount points and the host's top-level symlinks
//! (`bin -> usr/bin` on merged-/usr systems); the container gets the host's `/usr` (and any real `/lib*`, `/bin`,
//! `/sbin` directories) bind-mounted read-only, and a generated `/etc` with nothing of the host's but the dynamic
//! linker cache and the alternatives links. The skeleton is built once at start-up and shared read-only.
//!
//! Each execution gets a [`Scratch`]: a size- and inode-limited tmpfs (`disk_mb`) mounted in the daemon's private mount
//! namespace, holding the writable working directory and `/tmp`, plus a read-only directory with the code. On an
//! OCI image (its layers unpacked by `sandboxd-image-store`, given here as plain directories) the same tmpfs also
//! holds the upper and work directories of the execution's overlay root (the layers as read-only lowers), so
//! `disk_mb` bounds everything the program writes and all of it vanishes with the tmpfs.

use std::fs;
use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use nix::mount::{MntFlags, MsFlags};

use crate::error::{Error, Result};
use crate::spec::BindMount;

pub use crate::error::RootfsError;

/// Where the working directory appears in the container.
pub const WORKDIR: &str = "/workspace";
/// Where the code file appears in the container (read-only).
pub const CODE_DIR: &str = "/sandbox";

/// Top-level host entries mirrored into the image: bind-mounted read-only when a directory, re-created when a
/// symlink (merged /usr), skipped when absent.
const HOST_TOP_LEVEL: &[&str] = &["bin", "sbin", "lib", "lib32", "lib64", "libx32"];
/// Mount points of the skeleton.
const MOUNT_POINTS: &[&str] = &[
    "usr",
    "etc",
    "proc",
    "dev",
    "tmp",
    "sys",
    "workspace",
    "sandbox",
    "home",
];
/// The mount point of an E2B sandbox's home (a second mount of `/workspace`), kept in the read-only skeleton.
const HOME_MOUNT_POINT: &str = "home/user";

/// Makes the directory `rel` (relative, `/`-separated) under an overlay root `root` for a bind's mount point, as the
/// host's root: each component an existing directory or made (0755); a component that is a symlink or a file (an
/// image's `/home -> /etc`) is refused, so nothing is ever made outside the root.
pub fn mount_point_in(root: &Path, rel: &str) -> Result<()> {
    let mut p = root.to_path_buf();
    for part in rel.split('/').filter(|c| !c.is_empty()) {
        if part == ".." || part == "." {
            return Err(Error::io(
                &p,
                std::io::Error::from(std::io::ErrorKind::InvalidInput),
            ));
        }
        p.push(part);
        match fs::symlink_metadata(&p) {
            Ok(md) if md.is_dir() => {}
            Ok(_) => {
                return Err(Error::io(
                    &p,
                    std::io::Error::other("not a directory (a mount point must be one)"),
                ))
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => mkdir(&p, 0o755)?,
            Err(e) => return Err(Error::io(&p, e)),
        }
    }
    Ok(())
}

/// The upper layer of an overlay root, relative to its space's directory.
pub const UPPER: &str = "scratch/upper";
/// Top-level directories mounted over in a container whose root is an image's overlay: the overlay root must hold
/// them as directories (created when missing), never as a symlink or a file. The image store refuses layers that
/// hold them otherwise (`image_store::MOUNT_POINTS`, the same list; sandboxd's tests check the two agree).
pub const IMAGE_MOUNT_POINTS: &[&str] = &["proc", "dev", "sys", "tmp", "workspace", "sandbox"];

/// The embedded default image: the host's /usr under a generated root.
#[derive(Debug, Clone)]
pub struct HostImage {
    /// The skeleton root directory.
    pub rootfs: PathBuf,
    /// Read-only bind mounts from the host (`/usr`, real `/lib*` directories) and the generated `/etc`.
    pub binds: Vec<BindMount>,
    host_root: PathBuf,
}

impl HostImage {
    /// Builds the image under `dir` from the host tree at `host_root` (`/` in production), or brings the one a
    /// previous daemon built there up to date in place.
    ///
    /// In place, never removed and made again: the agent sandboxes a live restore takes back have this skeleton
    /// as their root and their mounts (`/usr`, `/workspace`, volumes) on its directories, and removing a directory
    /// detaches every mount on it in every mount namespace, so a rebuilt image would leave them an empty `/`. The
    /// mount points that stay are kept as they are; the generated files are replaced whole (written aside, then
    /// renamed over), so a running container sees either the old file or the new one; entries the image no longer
    /// has are removed.
    pub fn prepare(dir: &Path, host_root: &Path) -> Result<Self> {
        let rootfs = dir.join("rootfs");
        let etc = dir.join("etc");
        ensure_dir(&rootfs)?;
        let mut entries: Vec<&str> = MOUNT_POINTS.to_vec();
        for m in MOUNT_POINTS {
            ensure_dir(&rootfs.join(m))?;
        }
        ensure_dir(&rootfs.join(HOME_MOUNT_POINT))?;
        let mut binds = vec![BindMount {
            source: host_root.join("usr"),
            destination: "/usr".into(),
            readonly: true,
        }];
        for name in HOST_TOP_LEVEL {
            let host = host_root.join(name);
            match fs::symlink_metadata(&host) {
                Ok(m) if m.file_type().is_symlink() => {
                    let target = fs::read_link(&host).map_err(|e| Error::io(&host, e))?;
                    put_symlink(&rootfs.join(name), &target)?;
                    entries.push(name);
                }
                Ok(m) if m.is_dir() => {
                    ensure_dir(&rootfs.join(name))?;
                    entries.push(name);
                    binds.push(BindMount {
                        source: host,
                        destination: Path::new("/").join(name),
                        readonly: true,
                    });
                }
                _ => {}
            }
        }
        prune(&rootfs, &entries)?;
        write_etc(&etc, host_root)?;
        binds.push(BindMount {
            source: etc,
            destination: "/etc".into(),
            readonly: true,
        });
        Ok(Self {
            rootfs,
            binds,
            host_root: fs::canonicalize(host_root).map_err(|e| Error::io(host_root, e))?,
        })
    }

    /// Resolves a program inside the image to its absolute container path, if the image can run it: absolute
    /// candidates are checked as is, bare names in `/usr/local/bin`, `/usr/bin` and `/bin`.
    pub fn find_program(&self, candidates: &[&str]) -> Option<String> {
        for c in candidates {
            let paths: Vec<String> = if c.starts_with('/') {
                vec![c.to_string()]
            } else {
                ["/usr/local/bin", "/usr/bin", "/bin"]
                    .iter()
                    .map(|d| format!("{d}/{c}"))
                    .collect()
            };
            for p in paths {
                if self.is_executable_in_image(&p) {
                    return Some(p);
                }
            }
        }
        None
    }

    fn is_executable_in_image(&self, path: &str) -> bool {
        // Only what the container can see: /usr and the mirrored top-level entries.
        let rel = path.trim_start_matches('/');
        let top = rel.split('/').next().unwrap_or_default();
        if top != "usr" && !HOST_TOP_LEVEL.contains(&top) {
            return false;
        }
        // Symlinks are resolved on the host; the target must also be inside the image (a pyenv shim under /root or
        // an nvm node under /home would not exist in the container).
        let Ok(real) = fs::canonicalize(self.host_root.join(rel)) else {
            return false;
        };
        let Ok(real_rel) = real.strip_prefix(&self.host_root) else {
            return false;
        };
        let real_top = real_rel
            .components()
            .next()
            .map(|c| c.as_os_str().to_string_lossy().into_owned());
        if !real_top.is_some_and(|t| t == "usr" || HOST_TOP_LEVEL.contains(&t.as_str())) {
            return false;
        }
        fs::metadata(&real)
            .map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
            .unwrap_or(false)
    }
}

fn mkdir(path: &Path, mode: u32) -> Result<()> {
    fs::DirBuilder::new()
        .recursive(true)
        .mode(mode)
        .create(path)
        .map_err(|e| Error::io(path, e))
}

/// The generated `/etc`: identity files for root and nobody, local-only name resolution, and the two host pieces
/// programs need to run at all (the dynamic linker cache and the alternatives symlinks into /usr). Brought up to
/// date in place ([`HostImage::prepare`]).
fn write_etc(etc: &Path, host_root: &Path) -> Result<()> {
    ensure_dir(etc)?;
    let files: &[(&str, &str)] = &[
        (
            "passwd",
            "root:x:0:0:root:/workspace:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n",
        ),
        ("group", "root:x:0:\nnogroup:x:65534:\n"),
        ("hosts", "127.0.0.1\tlocalhost sandbox\n::1\tlocalhost ip6-localhost ip6-loopback\n"),
        ("hostname", "sandbox\n"),
        ("resolv.conf", "# sandboxd: executions have no network beyond loopback\n"),
        ("nsswitch.conf", "passwd: files\ngroup: files\nshadow: files\nhosts: files\n"),
    ];
    let mut entries: Vec<&str> = files.iter().map(|(name, _)| *name).collect();
    for (name, content) in files {
        put_file(&etc.join(name), content.as_bytes())?;
    }
    let cache = host_root.join("etc/ld.so.cache");
    if cache.is_file() {
        let content = fs::read(&cache).map_err(|e| Error::io(&cache, e))?;
        put_file(&etc.join("ld.so.cache"), &content)?;
        entries.push("ld.so.cache");
    }
    let alternatives = host_root.join("etc/alternatives");
    if let Ok(found) = fs::read_dir(&alternatives) {
        let dst = etc.join("alternatives");
        ensure_dir(&dst)?;
        let mut links = Vec::new();
        for e in found.flatten() {
            if let Ok(target) = fs::read_link(e.path()) {
                // Only links that stay inside what the image shows.
                if target.starts_with("/usr")
                    || target.starts_with("/bin")
                    || target.starts_with("/lib")
                {
                    put_symlink(&dst.join(e.file_name()), &target)?;
                    links.push(e.file_name());
                }
            }
        }
        let links: Vec<&str> = links.iter().filter_map(|n| n.to_str()).collect();
        prune(&dst, &links)?;
        entries.push("alternatives");
    }
    prune(etc, &entries)
}

/// `path` as a directory (mode 0755), kept as it is when it is one: a container may have a mount on it.
fn ensure_dir(path: &Path) -> Result<()> {
    match fs::symlink_metadata(path) {
        Ok(m) if m.is_dir() => {}
        Ok(_) => {
            fs::remove_file(path).map_err(|e| Error::io(path, e))?;
            mkdir(path, 0o755)?;
        }
        Err(_) => mkdir(path, 0o755)?,
    }
    fs::set_permissions(path, fs::Permissions::from_mode(0o755)).map_err(|e| Error::io(path, e))
}

/// The name beside `path` that a replacement is written under before it is renamed over `path`.
fn aside(path: &Path) -> PathBuf {
    let name = path.file_name().unwrap_or_default().to_string_lossy();
    path.with_file_name(format!(".{name}.sandboxd-new"))
}

/// `path` as a file of `content` (mode 0644): kept when it already is, else written aside and renamed over it.
fn put_file(path: &Path, content: &[u8]) -> Result<()> {
    let same = fs::symlink_metadata(path).is_ok_and(|m| m.is_file())
        && fs::read(path).is_ok_and(|old| old == content);
    if !same {
        let new = aside(path);
        let _ = fs::remove_file(&new);
        fs::write(&new, content).map_err(|e| Error::io(&new, e))?;
        replace(&new, path)?;
    }
    fs::set_permissions(path, fs::Permissions::from_mode(0o644)).map_err(|e| Error::io(path, e))
}

/// `link` as a symbolic link to `target`: kept when it already is, else made aside and renamed over it.
fn put_symlink(link: &Path, target: &Path) -> Result<()> {
    if fs::read_link(link).is_ok_and(|t| t == target) {
        return Ok(());
    }
    let new = aside(link);
    let _ = fs::remove_file(&new);
    std::os::unix::fs::symlink(target, &new).map_err(|e| Error::io(&new, e))?;
    replace(&new, link)
}

/// Renames `new` over `path`; a directory in the way (the host turned a directory into a link) is removed first.
fn replace(new: &Path, path: &Path) -> Result<()> {
    if fs::symlink_metadata(path).is_ok_and(|m| m.is_dir()) {
        fs::remove_dir_all(path).map_err(|e| Error::io(path, e))?;
    }
    fs::rename(new, path).map_err(|e| Error::io(path, e))
}

/// Removes every entry of `dir` not named in `keep` (what an earlier build had and this one does not).
fn prune(dir: &Path, keep: &[&str]) -> Result<()> {
    for e in fs::read_dir(dir).map_err(|e| Error::io(dir, e))?.flatten() {
        if keep.iter().any(|k| e.file_name() == **k) {
            continue;
        }
        let path = e.path();
        let removed = match e.file_type() {
            Ok(t) if t.is_dir() => fs::remove_dir_all(&path),
            _ => fs::remove_file(&path),
        };
        removed.map_err(|e| Error::io(&path, e))?;
    }
    Ok(())
}

/// One input file to place in the working directory before the program starts.
#[derive(Debug, Clone)]
pub struct InputFile {
    /// Relative path, already validated by the protocol (no `..`, not absolute, no empty components).
    pub path: String,
    /// Content.
    pub content: Vec<u8>,
}

/// An execution's writable space and code directory, under `<run_dir>/<id>/`.
#[derive(Debug)]
pub struct Scratch {
    dir: PathBuf,
    mounted: bool,
    /// Adopted from a previous daemon ([`Self::adopt`]): `dir` itself is a mount (the tree carried over).
    carried: bool,
    /// The host uid and gid that own the writable directories (container root).
    host_id: u32,
    /// Size of the tmpfs.
    disk_bytes: u64,
    /// The copy-on-write store's workspace bound on `/workspace` ([`Self::workspace_on`]), which the daemon
    /// writes into directly (files owned by 0 there).
    store: Option<PathBuf>,
}

/// Where an execution's root comes from.
#[derive(Debug, Clone, Copy)]
pub enum RootSource<'a> {
    /// A shared read-only root directory (the host image's skeleton): nothing to mount.
    Shared,
    /// An overlay of these unpacked layer directories, top first.
    Overlay(&'a [PathBuf]),
    /// [`Self::Overlay`] whose upper layer starts as a copy of the layer at the path (a snapshot's copy of a root
    /// layer: its whiteouts and opaque directories kept, what 0 owns there owned by the space's host id, the rest
    /// by nobody), within the tmpfs's size.
    OverlayWith(&'a [PathBuf], &'a Path),
}

impl Scratch {
    /// Creates `<run_dir>/<id>/`, mounts a tmpfs of `disk_bytes` on `scratch/` holding `workspace/` and `tmp/`
    /// (owned by the execution's host id), creates the code directory, and for [`RootSource::Overlay`] mounts the
    /// overlay root on `scratch/rootfs/`. The inputs come later ([`Self::inputs`]), so a container can be
    /// created on the scratch space before anyone asked for it. On error everything created so far is removed again.
    pub fn create(
        run_dir: &Path,
        id: &str,
        disk_bytes: u64,
        host_id: u32,
        root: RootSource<'_>,
    ) -> Result<Self> {
        let dir = run_dir.join(id);
        fs::DirBuilder::new()
            .mode(0o711)
            .create(&dir)
            .map_err(|e| Error::io(&dir, e))?;
        let mut scratch = Self {
            dir,
            mounted: false,
            carried: false,
            host_id,
            disk_bytes,
            store: None,
        };
        let made = scratch
            .mount(disk_bytes, host_id)
            .and_then(|()| match root {
                RootSource::Shared => Ok(()),
                RootSource::Overlay(lowers) => scratch.mount_overlay(lowers, None),
                RootSource::OverlayWith(lowers, layer) => {
                    scratch.mount_overlay(lowers, Some(layer))
                }
            });
        match made {
            Ok(()) => Ok(scratch),
            Err(e) => {
                if let Err(cleanup) = scratch.remove() {
                    tracing::error!(error = %cleanup, "cleanup of a failed scratch space failed");
                }
                Err(e)
            }
        }
    }

    /// Takes back `<run_dir>/<id>/` as a previous daemon left it mounted (its tmpfs carried into this daemon's
    /// mount namespace): nothing is created; [`Self::remove`] removes it as usual.
    pub fn adopt(run_dir: &Path, id: &str, disk_bytes: u64, host_id: u32) -> Result<Self> {
        use std::os::unix::fs::MetadataExt;
        let dir = run_dir.join(id);
        let tmpfs = dir.join("scratch");
        let (outer, inner) = (
            fs::metadata(&dir).map_err(|e| Error::io(&dir, e))?,
            fs::metadata(&tmpfs).map_err(|e| Error::io(&tmpfs, e))?,
        );
        if outer.dev() == inner.dev() {
            return Err(Error::io(
                &tmpfs,
                std::io::Error::other("not mounted (the previous daemon's mounts are gone)"),
            ));
        }
        // mountinfo names the canonical path.
        let carried = is_mount_point(&fs::canonicalize(&dir).unwrap_or_else(|_| dir.clone()));
        Ok(Self {
            dir,
            mounted: true,
            carried,
            host_id,
            disk_bytes,
            store: None,
        })
    }

    fn mount(&mut self, disk_bytes: u64, host_id: u32) -> Result<()> {
        let tmpfs = self.dir.join("scratch");
        mkdir(&tmpfs, 0o755)?;
        // Inodes bounded with the size: empty files (and directories) take no space.
        let data = format!(
            "size={disk_bytes},nr_inodes={},mode=0755,uid={host_id},gid={host_id}",
            crate::spec::inodes_for(disk_bytes)
        );
        nix::mount::mount(
            Some("sandboxd-scratch"),
            &tmpfs,
            Some("tmpfs"),
            MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
            Some(data.as_str()),
        )
        .map_err(|e| Error::sys(format!("mount tmpfs on {}", tmpfs.display()), e))?;
        self.mounted = true;
        for (name, mode) in [("workspace", 0o755), ("tmp", 0o1777)] {
            let p = tmpfs.join(name);
            mkdir(&p, mode)?;
            fs::set_permissions(&p, fs::Permissions::from_mode(mode))
                .map_err(|e| Error::io(&p, e))?;
            self.chown(&p)?;
        }
        mkdir(&self.dir.join("code"), 0o755)
    }

    fn chown(&self, p: &Path) -> Result<()> {
        chown(self.host_id, p)
    }

    /// Where the inputs go ([`Inputs::write`]), as an owned value for a blocking task.
    pub fn inputs(&self) -> Inputs {
        let (workspace, owner) = self.host_workspace();
        Inputs {
            dir: self.dir.clone(),
            workspace,
            owner,
            disk_bytes: self.disk_bytes,
        }
    }

    /// Mounts `rootfs/`: `lowers` read-only (top first), upper and work directories in the scratch tmpfs, `nosuid`
    /// and `nodev`. The runtime's mount points must be directories in the image (created in the upper layer when
    /// the image lacks them): a symlink there would make a mount follow a path the image controls.
    fn mount_overlay(&mut self, lowers: &[PathBuf], layer: Option<&Path>) -> Result<()> {
        let tmpfs = self.dir.join("scratch");
        let (upper, work, root) = (self.dir.join(UPPER), tmpfs.join("work"), self.rootfs());
        match layer {
            // Before the mount: an overlay's layers must not change under it.
            Some(layer) => {
                let owners = crate::tree::LayerOwners {
                    from: 0,
                    to: self.host_id,
                };
                crate::tree::copy_layer(layer, &upper, (owners, &[]), self.disk_bytes)
                    .map_err(|e| Error::io(&upper, e))?;
            }
            None => mkdir(&upper, 0o755)?,
        }
        mkdir(&work, 0o700)?;
        mkdir(&root, 0o755)?;
        let data = overlay_options(lowers, &upper, &work)?;
        nix::mount::mount(
            Some("sandboxd-root"),
            &root,
            Some("overlay"),
            MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
            Some(data.as_str()),
        )
        .map_err(|e| Error::sys(format!("mount overlay on {}", root.display()), e))?;
        for m in IMAGE_MOUNT_POINTS {
            let p = root.join(m);
            match fs::symlink_metadata(&p) {
                Ok(md) if md.is_dir() => {}
                Ok(_) => return Err(RootfsError::MountPoint(m).into()),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => mkdir(&p, 0o755)?,
                Err(e) => return Err(Error::io(&p, e)),
            }
        }
        Ok(())
    }

    /// Makes `/workspace` an overlay whose lower layer is `layer` (a snapshot: files owned by 0, shown as this
    /// space's host id through an idmapped read-only bind) and whose upper layer is on the tmpfs: the snapshot's
    /// files are there at once, none copied, and what the program changes is copied up into the tmpfs (within
    /// `disk_mb`) and never reaches the snapshot. Before any input is written. Everything is mounted inside the
    /// tmpfs, so [`Self::remove`]'s one lazy unmount takes it along.
    pub fn workspace_from(&mut self, layer: &Path) -> Result<()> {
        let tmpfs = self.dir.join("scratch");
        let (lower, upper, work) = (
            tmpfs.join("ws-lower"),
            tmpfs.join("ws-upper"),
            tmpfs.join("ws-work"),
        );
        mkdir(&lower, 0o700)?;
        mkdir(&upper, 0o755)?;
        fs::set_permissions(&upper, fs::Permissions::from_mode(0o755))
            .map_err(|e| Error::io(&upper, e))?;
        self.chown(&upper)?;
        mkdir(&work, 0o700)?;
        crate::idmap::bind(layer, &lower, self.host_id, true)?;
        let data = overlay_options(std::slice::from_ref(&lower), &upper, &work)?;
        let target = self.workspace();
        nix::mount::mount(
            Some("sandboxd-workspace"),
            &target,
            Some("overlay"),
            MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
            Some(data.as_str()),
        )
        .map_err(|e| Error::sys(format!("mount overlay on {}", target.display()), e))
    }

    /// Makes `/workspace` the directory `subvolume` (a workspace of a copy-on-write store: files owned by 0 on
    /// disk, shown as this space's host id through an idmapped read-write bind, `nosuid` and `nodev`): what the
    /// program writes lands there, owned by 0 on disk whatever host id wrote it, so another space can start from a
    /// snapshot of it. Before any input is written. The bind is inside the tmpfs, so [`Self::remove`]'s one lazy
    /// unmount takes it along; the subvolume itself is its store's to remove.
    pub fn workspace_on(&mut self, subvolume: &Path) -> Result<()> {
        crate::idmap::bind(subvolume, &self.workspace(), self.host_id, false)?;
        self.store = Some(subvolume.to_owned());
        Ok(())
    }

    /// A workspace taken back ([`Self::adopt`]) whose `/workspace` is the copy-on-write store's `subvolume`
    /// (bound there by the daemon that made it).
    pub fn adopt_store(&mut self, subvolume: &Path) {
        self.store = Some(subvolume.to_owned());
    }

    /// Where the daemon writes into `/workspace`, and the owner it gives what it makes there: the copy-on-write
    /// store's workspace and 0 (an idmapped mount takes no file from an unmapped owner), else the tmpfs's
    /// directory and the host id.
    pub fn host_workspace(&self) -> (PathBuf, u32) {
        match &self.store {
            Some(store) => (store.clone(), 0),
            None => (self.workspace(), self.host_id),
        }
    }

    /// The overlay root (meaningful for [`RootSource::Overlay`]). It is mounted inside the scratch tmpfs, so the
    /// one lazy unmount of the tmpfs takes it along (a second unmount would cost a second RCU grace period).
    pub fn rootfs(&self) -> PathBuf {
        self.dir.join("scratch/rootfs")
    }

    /// The bind mounts that put this scratch space into the container.
    pub fn binds(&self) -> Vec<BindMount> {
        let tmpfs = self.dir.join("scratch");
        vec![
            BindMount {
                source: tmpfs.join("workspace"),
                destination: WORKDIR.into(),
                readonly: false,
            },
            BindMount {
                source: tmpfs.join("tmp"),
                destination: "/tmp".into(),
                readonly: false,
            },
            BindMount {
                source: self.dir.join("code"),
                destination: CODE_DIR.into(),
                readonly: true,
            },
        ]
    }

    /// The execution's directory (`<run_dir>/<id>`); libcontainer's bundle goes in it too.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The working directory as the host sees it (for artifact collection).
    pub fn workspace(&self) -> PathBuf {
        self.dir.join("scratch/workspace")
    }

    /// Unmounts the tmpfs and removes the directory. Idempotent.
    pub fn remove(&mut self) -> Result<()> {
        // A lazy unmount of the tmpfs detaches the overlay root mounted inside it too.
        if self.mounted {
            let tmpfs = self.dir.join("scratch");
            match nix::mount::umount2(&tmpfs, MntFlags::MNT_DETACH) {
                Ok(()) | Err(nix::Error::EINVAL) | Err(nix::Error::ENOENT) => self.mounted = false,
                Err(e) => return Err(Error::sys(format!("umount {}", tmpfs.display()), e)),
            }
        }
        // A tree carried over from a previous daemon is mounted on the directory itself.
        if self.carried {
            match nix::mount::umount2(&self.dir, MntFlags::MNT_DETACH) {
                Ok(()) | Err(nix::Error::EINVAL) | Err(nix::Error::ENOENT) => self.carried = false,
                Err(e) => return Err(Error::sys(format!("umount {}", self.dir.display()), e)),
            }
        }
        match fs::remove_dir_all(&self.dir) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(Error::io(&self.dir, e)),
        }
    }
}

/// Whether `dir` is a mount point (as `/proc/self/mountinfo` lists them).
pub fn is_mount_point(dir: &Path) -> bool {
    fs::read_to_string("/proc/self/mountinfo").is_ok_and(|info| {
        info.lines()
            .filter_map(|l| l.split(' ').nth(4))
            .any(|p| Path::new(&unescape_mountinfo(p)) == dir)
    })
}

/// Lazily unmounts every mount at or under `dir` (deepest first), as `/proc/self/mountinfo` lists them: what a
/// directory left by a previous daemon may still have mounted.
pub fn detach_mounts_under(dir: &Path) -> Result<()> {
    // mountinfo names canonical paths.
    let canonical = fs::canonicalize(dir).unwrap_or_else(|_| dir.to_owned());
    let dir = canonical.as_path();
    let info = fs::read_to_string("/proc/self/mountinfo")
        .map_err(|e| Error::io(Path::new("/proc/self/mountinfo"), e))?;
    let mut points: Vec<PathBuf> = info
        .lines()
        .filter_map(|l| l.split(' ').nth(4))
        .map(|p| PathBuf::from(unescape_mountinfo(p)))
        .filter(|p| p.starts_with(dir))
        .collect();
    points.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
    points.dedup();
    for p in points {
        match nix::mount::umount2(&p, MntFlags::MNT_DETACH) {
            Ok(()) | Err(nix::Error::EINVAL) | Err(nix::Error::ENOENT) => {}
            Err(e) => return Err(Error::sys(format!("umount {}", p.display()), e)),
        }
    }
    Ok(())
}

/// A mountinfo path with its octal escapes (`\040` for a space, and tab, newline, backslash) undone.
fn unescape_mountinfo(p: &str) -> String {
    let b = p.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let octal = b
            .get(i + 1..i + 4)
            .filter(|d| d.iter().all(|c| (b'0'..=b'7').contains(c)));
        match (b[i], octal) {
            (b'\\', Some(d)) => {
                out.push((d[0] - b'0') * 64 + (d[1] - b'0') * 8 + (d[2] - b'0'));
                i += 4;
            }
            (c, _) => {
                out.push(c);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The places of a [`Scratch`] the inputs are written to, with their owner and the space's size.
#[derive(Debug, Clone)]
pub struct Inputs {
    dir: PathBuf,
    /// `/workspace` as the daemon writes into it ([`Scratch::host_workspace`]), and the owner of what it makes.
    workspace: PathBuf,
    owner: u32,
    disk_bytes: u64,
}

impl Inputs {
    /// Writes the input files into the working directory (owned by the execution's host id) and the code file
    /// (`code/<code_name>`, read-only). Runs once, before the program starts.
    pub fn write(&self, code_name: &str, code: &[u8], files: &[InputFile]) -> Result<()> {
        let disk_bytes = self.disk_bytes;
        let workspace = self.workspace.clone();
        for f in files {
            let target = workspace.join(&f.path);
            let refuse = |reason: String| Error::InputFile {
                path: f.path.clone(),
                reason,
            };
            // Parents are created one by one and owned by the execution. Nothing else writes to the tree before the
            // program starts, but a workspace started from a snapshot holds what an earlier program left: a
            // component that is not a directory (a symlink included) is refused, and the file itself is opened
            // without following a link.
            let mut dir = workspace.clone();
            if let Some(parent) = Path::new(&f.path).parent() {
                for comp in parent.components() {
                    dir.push(comp);
                    match fs::symlink_metadata(&dir) {
                        Ok(m) if m.is_dir() => {}
                        Ok(_) => {
                            return Err(refuse(format!(
                                "{} is a file",
                                dir.strip_prefix(&workspace).unwrap_or(&dir).display()
                            )))
                        }
                        Err(_) => {
                            fs::DirBuilder::new()
                                .mode(0o755)
                                .create(&dir)
                                .map_err(|e| refuse(e.to_string()))?;
                            chown(self.owner, &dir)?;
                        }
                    }
                }
            }
            // A file of the snapshot's is replaced; a link or a FIFO there is removed first (never followed or
            // opened), a directory is refused.
            match fs::symlink_metadata(&target) {
                Ok(m) if m.is_dir() => return Err(refuse("is a directory".into())),
                Ok(m) if !m.is_file() => {
                    fs::remove_file(&target).map_err(|e| refuse(e.to_string()))?
                }
                _ => {}
            }
            let mut file = fs::OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(true)
                .mode(0o644)
                .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
                .open(&target)
                .map_err(|e| refuse(e.to_string()))?;
            if !file
                .metadata()
                .map_err(|e| refuse(e.to_string()))?
                .is_file()
            {
                return Err(refuse("not a regular file".into()));
            }
            file.write_all(&f.content).map_err(|e| {
                if matches!(e.raw_os_error(), Some(libc::ENOSPC | libc::EDQUOT)) {
                    refuse(format!(
                        "the files do not fit in disk_mb ({disk_bytes} bytes)"
                    ))
                } else {
                    refuse(e.to_string())
                }
            })?;
            std::os::unix::fs::fchown(&file, Some(self.owner), Some(self.owner))
                .map_err(|e| Error::io(&target, e))?;
        }
        let code_path = self.dir.join("code").join(code_name);
        fs::write(&code_path, code).map_err(|e| Error::io(&code_path, e))?;
        fs::set_permissions(&code_path, fs::Permissions::from_mode(0o444))
            .map_err(|e| Error::io(&code_path, e))?;
        Ok(())
    }
}

/// Whether a workspace can start from a snapshot stored under `dir` here: a small scratch space is made under it
/// and its `/workspace` started from an empty layer there ([`Scratch::workspace_from`], the same mounts a sandbox
/// gets), then removed again (in the caller's mount namespace). Needs idmapped mounts on `dir`'s filesystem and
/// overlayfs taking idmapped layers (Linux 5.19).
pub fn probe_workspace_from(dir: &Path, host_id: u32) -> Result<()> {
    let probe = dir.join(".probe");
    match fs::remove_dir_all(&probe) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(Error::io(&probe, e)),
        _ => {}
    }
    let layer = probe.join("layer");
    mkdir(&layer, 0o700)?;
    let made = Scratch::create(&probe, "scratch", 1 << 20, host_id, RootSource::Shared).and_then(
        |mut scratch| {
            let r = scratch.workspace_from(&layer);
            scratch.remove().and(r)
        },
    );
    let removed = fs::remove_dir_all(&probe).map_err(|e| Error::io(&probe, e));
    made.and(removed)
}

/// Overlay mount options for `lowers` (top first), `upper` and `work`; refused when a path holds a separator or
/// the options exceed the page the kernel takes.
fn overlay_options(lowers: &[PathBuf], upper: &Path, work: &Path) -> Result<String> {
    let mut data = String::from("lowerdir=");
    for (i, l) in lowers.iter().enumerate() {
        let l = l.to_str().filter(|l| !l.contains([',', ':']));
        let Some(l) = l else {
            return Err(RootfsError::LayerPath.into());
        };
        if i > 0 {
            data.push(':');
        }
        data.push_str(l);
    }
    data.push_str(&format!(
        ",upperdir={},workdir={}",
        upper.display(),
        work.display()
    ));
    // The kernel takes one page of mount options.
    if data.len() >= 4000 {
        return Err(RootfsError::TooManyLayers {
            layers: lowers.len(),
            bytes: data.len(),
        }
        .into());
    }
    Ok(data)
}

fn chown(host_id: u32, p: &Path) -> Result<()> {
    let id = Some(nix::unistd::Uid::from_raw(host_id));
    let gid = Some(nix::unistd::Gid::from_raw(host_id));
    nix::unistd::chown(p, id, gid).map_err(|e| Error::sys(format!("chown {}", p.display()), e))
}

impl Scratch {
    /// Leaves the scratch space as it is, mounted, for a later daemon to adopt ([`Self::adopt`]): dropped without
    /// its removal.
    pub fn leave(self) {
        // Only the path's memory is not given back, once, at the daemon's exit.
        std::mem::forget(self);
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        if let Err(e) = self.remove() {
            tracing::error!(dir = %self.dir.display(), error = %e, "scratch space cleanup failed");
        }
    }
}

/// Mounts a private tmpfs on `dir` (the daemon's run directory): per-execution state lives in memory and vanishes
/// with the daemon's mount namespace if the daemon dies.
pub fn mount_run_dir(dir: &Path) -> Result<()> {
    mkdir(dir, 0o711)?;
    nix::mount::mount(
        Some("sandboxd-run"),
        dir,
        Some("tmpfs"),
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
        Some("mode=0711"),
    )
    .map_err(|e| Error::sys(format!("mount tmpfs on {}", dir.display()), e))
}

/// Detaches the calling process from the host's mount propagation (see [`crate::sys::unshare_mount_namespace`]).
pub use crate::sys::unshare_mount_namespace;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_image_mirrors_merged_usr_links_and_binds_real_dirs() {
        let host = tempfile::tempdir().unwrap();
        fs::create_dir_all(host.path().join("usr/bin")).unwrap();
        fs::create_dir_all(host.path().join("lib64")).unwrap();
        std::os::unix::fs::symlink("usr/bin", host.path().join("bin")).unwrap();
        fs::create_dir_all(host.path().join("etc/alternatives")).unwrap();
        std::os::unix::fs::symlink("/usr/bin/mawk", host.path().join("etc/alternatives/awk"))
            .unwrap();
        std::os::unix::fs::symlink("/root/secret", host.path().join("etc/alternatives/evil"))
            .unwrap();
        fs::write(host.path().join("etc/shadow"), "root:secret").unwrap();
        let py = host.path().join("usr/bin/python3");
        fs::write(&py, "").unwrap();
        fs::set_permissions(&py, fs::Permissions::from_mode(0o755)).unwrap();

        let state = tempfile::tempdir().unwrap();
        let img = HostImage::prepare(&state.path().join("host"), host.path()).unwrap();
        assert_eq!(
            fs::read_link(img.rootfs.join("bin")).unwrap(),
            Path::new("usr/bin")
        );
        let dests: Vec<_> = img.binds.iter().map(|b| b.destination.clone()).collect();
        assert_eq!(
            dests,
            [PathBuf::from("/usr"), "/lib64".into(), "/etc".into()]
        );
        assert!(img.binds.iter().all(|b| b.readonly));
        let etc = state.path().join("host/etc");
        assert!(!etc.join("shadow").exists());
        assert!(etc.join("alternatives/awk").is_symlink());
        assert!(!etc.join("alternatives/evil").exists());
        assert_eq!(
            img.find_program(&["/usr/bin/python3"]).as_deref(),
            Some("/usr/bin/python3")
        );
        assert_eq!(
            img.find_program(&["python3"]).as_deref(),
            Some("/usr/bin/python3")
        );
        assert_eq!(img.find_program(&["node", "nodejs"]), None);
        // Outside what the image shows, even if the host has it.
        assert_eq!(img.find_program(&["/etc/shadow"]), None);
    }

    /// The inode of `path` (not following a link).
    fn ino(path: &Path) -> u64 {
        use std::os::unix::fs::MetadataExt;
        fs::symlink_metadata(path).unwrap().ino()
    }

    /// A second start on the same state directory brings the image up to date in place: the directories a
    /// taken-back container has its mounts on are the same directories (a removed one would detach them), the
    /// generated files follow the host, and what the host no longer has is gone.
    #[test]
    fn host_image_is_brought_up_to_date_in_place() {
        let host = tempfile::tempdir().unwrap();
        fs::create_dir_all(host.path().join("usr/bin")).unwrap();
        fs::create_dir_all(host.path().join("lib64")).unwrap();
        fs::create_dir_all(host.path().join("lib32")).unwrap();
        std::os::unix::fs::symlink("usr/bin", host.path().join("bin")).unwrap();
        fs::create_dir_all(host.path().join("etc/alternatives")).unwrap();
        std::os::unix::fs::symlink("/usr/bin/mawk", host.path().join("etc/alternatives/awk"))
            .unwrap();
        fs::write(host.path().join("etc/ld.so.cache"), "cache 1").unwrap();
        let state = tempfile::tempdir().unwrap();
        let dir = state.path().join("host");
        let img = HostImage::prepare(&dir, host.path()).unwrap();
        let kept = [
            "rootfs",
            "rootfs/workspace",
            "rootfs/usr",
            "rootfs/tmp",
            "rootfs/lib64",
        ];
        let before: Vec<u64> = kept.iter().map(|k| ino(&dir.join(k))).collect();
        fs::write(img.rootfs.join("workspace/in-use"), "a container's mount").unwrap();

        fs::remove_dir(host.path().join("lib32")).unwrap();
        fs::remove_file(host.path().join("etc/alternatives/awk")).unwrap();
        std::os::unix::fs::symlink("/usr/bin/gawk", host.path().join("etc/alternatives/gawk"))
            .unwrap();
        fs::write(host.path().join("etc/ld.so.cache"), "cache 2").unwrap();
        fs::write(dir.join("etc/stale"), "from an older build").unwrap();
        let img = HostImage::prepare(&dir, host.path()).unwrap();

        let after: Vec<u64> = kept.iter().map(|k| ino(&dir.join(k))).collect();
        assert_eq!(before, after, "{kept:?}: the same directories");
        assert!(img.rootfs.join("workspace/in-use").exists());
        assert!(!img.rootfs.join("lib32").exists());
        let dests: Vec<_> = img.binds.iter().map(|b| b.destination.clone()).collect();
        assert_eq!(
            dests,
            [PathBuf::from("/usr"), "/lib64".into(), "/etc".into()]
        );
        let etc = dir.join("etc");
        assert_eq!(fs::read(etc.join("ld.so.cache")).unwrap(), b"cache 2");
        assert!(!etc.join("alternatives/awk").is_symlink());
        assert_eq!(
            fs::read_link(etc.join("alternatives/gawk")).unwrap(),
            Path::new("/usr/bin/gawk")
        );
        assert!(!etc.join("stale").exists());
        let names: Vec<_> = fs::read_dir(&etc)
            .unwrap()
            .flatten()
            .map(|e| e.file_name().into_string().unwrap())
            .filter(|n| n.starts_with('.'))
            .collect();
        assert!(names.is_empty(), "nothing written aside is left: {names:?}");
        assert_eq!(
            fs::read_to_string(etc.join("hostname")).unwrap(),
            "sandbox\n"
        );
    }
}

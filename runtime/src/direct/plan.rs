//! What the direct start does, read from the OCI spec sandboxd builds ([`crate::spec`]) and checked before any
//! process is cloned. The direct start knows only what that spec uses; anything else in a spec (a namespace to
//! join, a capability to keep, a sysctl, extra devices, a mount type it does not know) is refused here, so a spec
//! can never ask for something the start would silently skip.

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use nix::mount::MsFlags;
use nix::sys::resource::Resource;
use oci_spec::runtime::{
    get_default_maskedpaths, get_default_readonly_paths, LinuxNamespaceType, Mount,
    PosixRlimitType, Spec,
};

use crate::cgroups::CgroupLimits;
use crate::error::StartError;
use crate::spec::NAMESPACES;

/// One mount in the container, in spec order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MountStep {
    /// Absolute path in the container.
    pub destination: PathBuf,
    /// What is mounted.
    pub kind: MountKind,
    /// Mount flags (`MS_NOSUID`, `MS_RDONLY`, ...).
    pub flags: MsFlags,
    /// Filesystem options passed as mount data (`mode=755,size=65536k`); empty for none.
    pub data: String,
}

/// The kinds of mount sandboxd's spec uses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MountKind {
    /// A new filesystem: `proc`, `tmpfs` or `devpts`, with this source name.
    Fresh {
        /// Filesystem type.
        fstype: &'static str,
        /// Source shown in the mount table.
        source: String,
    },
    /// A recursive bind mount of a host path.
    Bind {
        /// Host path.
        source: PathBuf,
    },
}

/// Everything the direct start needs, checked.
#[derive(Debug, Clone)]
pub struct Blueprint {
    /// The root directory (or overlay mount) on the host.
    pub root: PathBuf,
    /// Remount the root read-only.
    pub root_readonly: bool,
    /// The container's hostname.
    pub hostname: String,
    /// The init's (and so the program's) working directory.
    pub cwd: CString,
    /// Host uid that container root maps to.
    pub host_uid: u32,
    /// Host gid that container root maps to.
    pub host_gid: u32,
    /// Mounts, in order.
    pub mounts: Vec<MountStep>,
    /// Paths hidden (a directory under an empty read-only tmpfs, a file under `/dev/null`).
    pub masked: Vec<PathBuf>,
    /// Paths made read-only.
    pub readonly: Vec<PathBuf>,
    /// Resource limits: (resource, soft, hard).
    pub rlimits: Vec<(Resource, u64, u64)>,
    /// The cgroup limits the container starts with.
    pub limits: CgroupLimits,
    /// The init has no parent death signal: it outlives the helper (set by the helper, never by a spec).
    pub outlives_helper: bool,
}

fn unsupported(what: impl Into<String>) -> StartError {
    StartError::Unsupported(what.into())
}

impl Blueprint {
    /// Reads and checks `spec` for container `cgroups_path` (which the spec's `linux.cgroupsPath` must equal).
    pub fn from_spec(spec: &Spec, cgroups_path: &str) -> Result<Self, StartError> {
        let root = spec.root().as_ref().ok_or_else(|| unsupported("no root"))?;
        let process = spec
            .process()
            .as_ref()
            .ok_or_else(|| unsupported("no process"))?;
        let linux = spec
            .linux()
            .as_ref()
            .ok_or_else(|| unsupported("no linux section"))?;

        let mut kinds: Vec<LinuxNamespaceType> = Vec::new();
        for ns in linux.namespaces().iter().flatten() {
            if ns.path().is_some() {
                return Err(unsupported(format!("joining a {:?} namespace", ns.typ())));
            }
            kinds.push(ns.typ());
        }
        if NAMESPACES.iter().any(|n| !kinds.contains(n)) || kinds.len() != NAMESPACES.len() {
            return Err(unsupported(format!(
                "namespaces {kinds:?}: all seven new ones, nothing else"
            )));
        }
        let host_uid = one_mapping(linux.uid_mappings(), "uid")?;
        let host_gid = one_mapping(linux.gid_mappings(), "gid")?;
        if host_gid != host_uid {
            return Err(unsupported(format!(
                "gid mapped to host id {host_gid}, uid to {host_uid} (one id for both)"
            )));
        }
        if linux.cgroups_path().as_deref() != Some(Path::new(cgroups_path)) {
            return Err(unsupported(format!(
                "cgroupsPath {:?}, not {cgroups_path}",
                linux.cgroups_path()
            )));
        }
        refuse_unset_linux(spec, linux)?;
        refuse_unset_process(process)?;
        if !root.path().is_absolute() {
            return Err(unsupported(format!("root path {}", root.path().display())));
        }

        let rlimits = process
            .rlimits()
            .iter()
            .flatten()
            .map(|r| Ok((resource(r.typ())?, r.soft(), r.hard())))
            .collect::<Result<Vec<_>, StartError>>()?;

        Ok(Self {
            root: root.path().clone(),
            root_readonly: root.readonly() == Some(true),
            hostname: spec.hostname().clone().unwrap_or_default(),
            cwd: CString::new(process.cwd().as_os_str().as_bytes())
                .map_err(|_| unsupported("a NUL in cwd"))?,
            host_uid,
            host_gid,
            mounts: spec
                .mounts()
                .iter()
                .flatten()
                .map(mount_step)
                .collect::<Result<_, _>>()?,
            masked: with_defaults(linux.masked_paths(), get_default_maskedpaths(), "masked")?,
            readonly: with_defaults(
                linux.readonly_paths(),
                get_default_readonly_paths(),
                "read-only",
            )?,
            rlimits,
            limits: limits(linux.resources())?,
            outlives_helper: false,
        })
    }
}

/// Refuses every `linux` (and top-level) setting the direct start does not apply.
fn refuse_unset_linux(spec: &Spec, linux: &oci_spec::runtime::Linux) -> Result<(), StartError> {
    let refused = [
        (
            "sysctl",
            linux.sysctl().as_ref().is_some_and(|s| !s.is_empty()),
        ),
        (
            "devices",
            linux.devices().as_ref().is_some_and(|d| !d.is_empty()),
        ),
        (
            "seccomp (the init installs its own)",
            linux.seccomp().is_some(),
        ),
        ("intelRdt", linux.intel_rdt().is_some()),
        ("mountLabel", linux.mount_label().is_some()),
        ("memoryPolicy", linux.memory_policy().is_some()),
        ("hooks", spec.hooks().is_some()),
        ("domainname", spec.domainname().is_some()),
        ("personality", linux.personality().is_some()),
        ("timeOffsets", linux.time_offsets().is_some()),
        (
            "netDevices",
            linux.net_devices().as_ref().is_some_and(|d| !d.is_empty()),
        ),
        ("rootfsPropagation", linux.rootfs_propagation().is_some()),
    ];
    if let Some((what, _)) = refused.iter().find(|(_, set)| *set) {
        return Err(unsupported(*what));
    }
    Ok(())
}

/// Refuses a process the direct start would not run as asked: another user, privileges, a terminal, or settings
/// it does not apply.
fn refuse_unset_process(process: &oci_spec::runtime::Process) -> Result<(), StartError> {
    let user = process.user();
    if user.uid() != 0
        || user.gid() != 0
        || user
            .additional_gids()
            .as_ref()
            .is_some_and(|g| !g.is_empty())
    {
        return Err(unsupported("a user other than container root"));
    }
    if process.no_new_privileges() != Some(true) {
        return Err(unsupported("a process without noNewPrivileges"));
    }
    if process.terminal() == Some(true) {
        return Err(unsupported("a terminal"));
    }
    let process_refused = [
        ("process.oomScoreAdj", process.oom_score_adj().is_some()),
        (
            "process.apparmorProfile",
            process.apparmor_profile().is_some(),
        ),
        ("process.selinuxLabel", process.selinux_label().is_some()),
        ("process.ioPriority", process.io_priority().is_some()),
        ("process.scheduler", process.scheduler().is_some()),
        (
            "process.execCPUAffinity",
            process.exec_cpu_affinity().is_some(),
        ),
        ("process.user.umask", user.umask().is_some()),
    ];
    if let Some((what, _)) = process_refused.iter().find(|(_, set)| *set) {
        return Err(unsupported(*what));
    }
    if let Some(c) = process.capabilities() {
        let sets = [
            c.bounding(),
            c.effective(),
            c.inheritable(),
            c.permitted(),
            c.ambient(),
        ];
        if sets
            .iter()
            .any(|s| s.as_ref().is_some_and(|s| !s.is_empty()))
        {
            return Err(unsupported("capabilities (every set must be empty)"));
        }
    }
    Ok(())
}

/// The single id mapping `0 -> host id, size 1`.
fn one_mapping(
    maps: &Option<Vec<oci_spec::runtime::LinuxIdMapping>>,
    what: &str,
) -> Result<u32, StartError> {
    match maps.as_deref() {
        Some([m]) if m.container_id() == 0 && m.size() == 1 && m.host_id() != 0 => Ok(m.host_id()),
        _ => Err(unsupported(format!(
            "{what} mappings other than container root to one unprivileged host id"
        ))),
    }
}

fn resource(t: PosixRlimitType) -> Result<Resource, StartError> {
    Ok(match t {
        PosixRlimitType::RlimitCore => Resource::RLIMIT_CORE,
        PosixRlimitType::RlimitNofile => Resource::RLIMIT_NOFILE,
        PosixRlimitType::RlimitFsize => Resource::RLIMIT_FSIZE,
        PosixRlimitType::RlimitNproc => Resource::RLIMIT_NPROC,
        PosixRlimitType::RlimitStack => Resource::RLIMIT_STACK,
        PosixRlimitType::RlimitCpu => Resource::RLIMIT_CPU,
        PosixRlimitType::RlimitAs => Resource::RLIMIT_AS,
        other => return Err(unsupported(format!("rlimit {other:?}"))),
    })
}

fn absolute_paths(paths: &Option<Vec<String>>) -> Result<Vec<PathBuf>, StartError> {
    paths
        .iter()
        .flatten()
        .map(|p| {
            if p.starts_with('/') && !p.split('/').any(|c| c == "..") {
                Ok(PathBuf::from(p))
            } else {
                Err(unsupported(format!("path {p:?}")))
            }
        })
        .collect()
}

/// [`absolute_paths`], which must include every one of `defaults` (the OCI default masked or read-only paths
/// spec::build always gives).
fn with_defaults(
    paths: &Option<Vec<String>>,
    defaults: Vec<String>,
    what: &str,
) -> Result<Vec<PathBuf>, StartError> {
    let paths = absolute_paths(paths)?;
    match defaults.iter().find(|d| !paths.contains(&PathBuf::from(d))) {
        Some(d) => Err(unsupported(format!("not {what}: {d}"))),
        None => Ok(paths),
    }
}

/// Memory (with memory+swap equal: no swap), pids and cpu shares; nothing else may be set.
fn limits(r: &Option<oci_spec::runtime::LinuxResources>) -> Result<CgroupLimits, StartError> {
    let r = r.as_ref().ok_or_else(|| unsupported("no resources"))?;
    let others = r.devices().as_ref().is_some_and(|d| !d.is_empty())
        || r.block_io().is_some()
        || r.hugepage_limits().as_ref().is_some_and(|h| !h.is_empty())
        || r.network().is_some()
        || r.rdma().as_ref().is_some_and(|h| !h.is_empty())
        || r.unified().as_ref().is_some_and(|h| !h.is_empty());
    if others {
        return Err(unsupported(
            "resources other than memory, pids and cpu shares",
        ));
    }
    // Nothing but the fields read below: anything else would be silently left unset.
    let mut only_shares = oci_spec::runtime::LinuxCpu::default();
    only_shares.set_shares(r.cpu().as_ref().and_then(|c| c.shares()));
    let mut only_limits = oci_spec::runtime::LinuxMemory::default();
    if let Some(m) = r.memory() {
        only_limits.set_limit(m.limit());
        only_limits.set_swap(m.swap());
    }
    if r.cpu().as_ref().is_some_and(|c| *c != only_shares)
        || r.memory().as_ref().is_some_and(|m| *m != only_limits)
    {
        return Err(unsupported(
            "cpu or memory settings other than cpu shares and the memory limit",
        ));
    }
    let memory = r.memory().as_ref().and_then(|m| {
        let limit = u64::try_from(m.limit()?).ok()?;
        (m.swap() == m.limit()).then_some(limit)
    });
    let pids = r
        .pids()
        .as_ref()
        .and_then(|p| u64::try_from(p.limit()).ok());
    let shares = r.cpu().as_ref().and_then(|c| c.shares());
    match (memory, pids, shares) {
        // The quota an execution asks for is written by `Cgroups::set_limits` before its program starts.
        (Some(memory_bytes), Some(pids_max), Some(cpu_shares)) => Ok(CgroupLimits {
            memory_bytes,
            pids_max,
            cpu_shares,
            cpu_quota: None,
        }),
        _ => Err(unsupported(
            "limits without a memory limit equal to memory+swap, a pids limit and cpu shares",
        )),
    }
}

/// Flags every mount option sandboxd's spec uses maps to.
fn flag(option: &str) -> Option<MsFlags> {
    Some(match option {
        "nosuid" => MsFlags::MS_NOSUID,
        "nodev" => MsFlags::MS_NODEV,
        "noexec" => MsFlags::MS_NOEXEC,
        "ro" => MsFlags::MS_RDONLY,
        "rw" => MsFlags::empty(),
        "strictatime" => MsFlags::MS_STRICTATIME,
        "relatime" => MsFlags::MS_RELATIME,
        "noatime" => MsFlags::MS_NOATIME,
        _ => return None,
    })
}

fn mount_step(m: &Mount) -> Result<MountStep, StartError> {
    let destination = m.destination().clone();
    if !destination.is_absolute() || destination.components().any(|c| c.as_os_str() == "..") {
        return Err(unsupported(format!(
            "mount destination {}",
            destination.display()
        )));
    }
    if m.uid_mappings().is_some() || m.gid_mappings().is_some() {
        return Err(unsupported(format!(
            "an idmapped mount at {}",
            destination.display()
        )));
    }
    let options: Vec<&str> = m.options().iter().flatten().map(String::as_str).collect();
    let source = m.source().clone().unwrap_or_default();
    let mut flags = MsFlags::empty();
    let mut data = Vec::new();
    let kind = match m.typ().as_deref() {
        Some("bind") => {
            for o in &options {
                match (*o, flag(o)) {
                    ("rbind", _) => {}
                    (_, Some(f)) => flags |= f,
                    _ => return Err(unsupported(format!("bind mount option {o}"))),
                }
            }
            if !source.is_absolute() {
                return Err(unsupported(format!("bind source {}", source.display())));
            }
            // Whatever the spec says: no host file brings a set-uid bit or a device into the container.
            flags |= MsFlags::MS_NOSUID | MsFlags::MS_NODEV;
            if destination == Path::new("/dev") {
                return Err(unsupported(
                    "a bind mount at /dev (it must be a fresh tmpfs)",
                ));
            }
            MountKind::Bind { source }
        }
        Some(t @ ("proc" | "tmpfs" | "devpts")) => {
            if destination == Path::new("/dev") && t != "tmpfs" {
                return Err(unsupported(format!(
                    "{t} at /dev (it must be a fresh tmpfs)"
                )));
            }
            for o in &options {
                match flag(o) {
                    Some(f) => flags |= f,
                    None => data.push(*o),
                }
            }
            MountKind::Fresh {
                fstype: match t {
                    "proc" => "proc",
                    "tmpfs" => "tmpfs",
                    _ => "devpts",
                },
                source: source.to_string_lossy().into_owned(),
            }
        }
        other => return Err(unsupported(format!("mount type {other:?}"))),
    };
    Ok(MountStep {
        destination,
        kind,
        flags,
        data: data.join(","),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::build;
    use crate::spec::tests::plan;

    #[test]
    fn sandboxd_spec_reads_back_whole() {
        let b = Blueprint::from_spec(&build(&plan()).unwrap(), "/sandboxd/e1").unwrap();
        assert_eq!((b.host_uid, b.host_gid), (200_003, 200_003));
        assert!(b.root_readonly);
        assert_eq!(b.hostname, "sandbox");
        assert_eq!(
            b.limits,
            CgroupLimits {
                memory_bytes: 64 << 20,
                pids_max: 64,
                cpu_shares: 512,
                cpu_quota: None,
            }
        );
        let kinds: Vec<_> = b.mounts.iter().map(|m| m.destination.clone()).collect();
        assert_eq!(
            kinds,
            [
                "/proc",
                "/dev",
                "/dev/pts",
                "/dev/shm",
                "/usr",
                "/workspace"
            ]
            .map(PathBuf::from)
        );
        assert!(!b.mounts[5].flags.contains(MsFlags::MS_RDONLY));
        let usr = &b.mounts[4];
        assert_eq!(
            usr.kind,
            MountKind::Bind {
                source: "/usr".into()
            }
        );
        assert!(usr
            .flags
            .contains(MsFlags::MS_RDONLY | MsFlags::MS_NOSUID | MsFlags::MS_NODEV));
        assert_eq!(b.mounts[3].data, "mode=1777,size=67108864,nr_inodes=16384");
        assert_eq!(
            b.mounts[2].data,
            "newinstance,ptmxmode=0666,mode=0620,max=64"
        );
        assert!(b.masked.contains(&PathBuf::from("/proc/kcore")));
        assert!(b.readonly.contains(&PathBuf::from("/proc/sys")));
        assert!(b.rlimits.contains(&(Resource::RLIMIT_CORE, 1, 1)));
    }

    fn refused(spec: &Spec, want: &str) {
        let e = Blueprint::from_spec(spec, "/sandboxd/e1")
            .unwrap_err()
            .to_string();
        assert!(e.contains(want), "{e}");
    }

    fn id_map(host_id: u32) -> oci_spec::runtime::LinuxIdMapping {
        oci_spec::runtime::LinuxIdMappingBuilder::default()
            .host_id(host_id)
            .container_id(0u32)
            .size(1u32)
            .build()
            .unwrap()
    }

    /// An idmapped mount (a mount's own uid/gid mappings) was read as a plain mount, its mapping silently dropped
    /// (found writing the property fuzz/ target `blueprint_from_spec` checks).
    #[test]
    fn idmapped_mounts_are_refused() {
        let mut s = build(&plan()).unwrap();
        let mut mounts = s.mounts().clone().unwrap();
        mounts[4].set_uid_mappings(Some(vec![id_map(0)]));
        s.set_mounts(Some(mounts));
        refused(&s, "idmapped mount");
    }

    /// spec::build maps uid and gid to the same host id; a gid mapping to another host id (a host group such as
    /// `disk` or `shadow`) was accepted (found writing the property fuzz/ target `blueprint_from_spec` checks).
    #[test]
    fn uid_and_gid_map_to_the_same_host_id() {
        let mut s = build(&plan()).unwrap();
        let mut linux = s.linux().clone().unwrap();
        linux.set_gid_mappings(Some(vec![id_map(42)]));
        s.set_linux(Some(linux));
        refused(&s, "gid mapped to host id 42");
    }

    /// Found by fuzzing (fuzz/ target `blueprint_from_spec`): spec::build masks and write-protects the OCI default paths; a spec without some of them
    /// (`/proc/sched_debug` lists the host's tasks) was accepted.
    #[test]
    fn the_default_masked_and_readonly_paths_stay() {
        let good = build(&plan()).unwrap();
        let mut s = good.clone();
        let mut linux = s.linux().clone().unwrap();
        let mut masked = linux.masked_paths().clone().unwrap();
        masked.retain(|p| p != "/proc/sched_debug");
        linux.set_masked_paths(Some(masked));
        s.set_linux(Some(linux));
        refused(&s, "/proc/sched_debug");

        let mut s = good;
        let mut linux = s.linux().clone().unwrap();
        linux.set_readonly_paths(None);
        s.set_linux(Some(linux));
        refused(&s, "not read-only: /proc/");
    }

    #[test]
    fn anything_the_start_would_skip_is_refused() {
        let good = build(&plan()).unwrap();
        let refused = |spec: &Spec, want: &str| {
            let e = Blueprint::from_spec(spec, "/sandboxd/e1")
                .unwrap_err()
                .to_string();
            assert!(e.contains(want), "{e}");
        };
        let _ = Blueprint::from_spec(&good, "/sandboxd/e2").unwrap_err();
        // The good spec with mount `i` edited.
        let with_mount = |i: usize, edit: &dyn Fn(&mut Mount)| {
            let mut s = good.clone();
            let mut mounts = s.mounts().clone().unwrap();
            edit(&mut mounts[i]);
            s.set_mounts(Some(mounts));
            s
        };

        let mut s = good.clone();
        let mut linux = s.linux().clone().unwrap();
        let mut ns = linux.namespaces().clone().unwrap();
        ns.retain(|n| n.typ() != LinuxNamespaceType::Network);
        linux.set_namespaces(Some(ns));
        s.set_linux(Some(linux));
        refused(&s, "namespaces");

        let mut s = good.clone();
        let mut p = s.process().clone().unwrap();
        let mut caps = p.capabilities().clone().unwrap();
        caps.set_bounding(Some([oci_spec::runtime::Capability::SysAdmin].into()));
        p.set_capabilities(Some(caps));
        s.set_process(Some(p));
        refused(&s, "capabilities");

        let s = with_mount(4, &|m| {
            m.set_options(Some(vec!["rbind".into(), "shared".into()]));
        });
        refused(&s, "bind mount option shared");

        let s = with_mount(0, &|m| {
            m.set_typ(Some("sysfs".into()));
        });
        refused(&s, "mount type");

        let s = with_mount(4, &|m| {
            m.set_options(Some(vec!["bind".into(), "ro".into()]));
        });
        refused(&s, "bind mount option bind");

        let s = with_mount(4, &|m| {
            m.set_destination("/dev".into());
        });
        refused(&s, "at /dev");

        let mut s = good.clone();
        let mut linux = s.linux().clone().unwrap();
        let mut r = linux.resources().clone().unwrap();
        let mut cpu = r.cpu().clone().unwrap();
        cpu.set_quota(Some(50_000));
        r.set_cpu(Some(cpu));
        linux.set_resources(Some(r));
        s.set_linux(Some(linux));
        refused(&s, "cpu or memory settings");

        let mut s = good.clone();
        let mut p = s.process().clone().unwrap();
        p.set_oom_score_adj(Some(-1000));
        s.set_process(Some(p));
        refused(&s, "oomScoreAdj");

        let mut s = good.clone();
        s.set_domainname(Some("evil".into()));
        refused(&s, "domainname");

        // A bind without nosuid and nodev gets them anyway.
        let s = with_mount(4, &|m| {
            m.set_options(Some(vec!["rbind".into(), "rw".into()]));
        });
        let b = Blueprint::from_spec(&s, "/sandboxd/e1").unwrap();
        assert!(b.mounts[4]
            .flags
            .contains(MsFlags::MS_NOSUID | MsFlags::MS_NODEV));

        let mut s = good;
        let mut linux = s.linux().clone().unwrap();
        linux.set_sysctl(Some(
            [("net.ipv4.ip_forward".to_string(), "1".to_string())].into(),
        ));
        s.set_linux(Some(linux));
        refused(&s, "sysctl");
    }
}

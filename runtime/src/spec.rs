//! The OCI runtime spec of one execution, built from a [`ContainerPlan`]. A pure function: unit-tested without
//! root, and the one place that says which namespaces, mounts, limits and privileges a sandboxed program gets.

use std::path::PathBuf;

use oci_spec::runtime::{
    get_default_maskedpaths, get_default_readonly_paths, Capabilities, LinuxBuilder,
    LinuxCapabilitiesBuilder, LinuxCpuBuilder, LinuxIdMappingBuilder, LinuxMemoryBuilder,
    LinuxNamespaceBuilder, LinuxNamespaceType, LinuxPidsBuilder, LinuxResourcesBuilder, Mount,
    MountBuilder, PosixRlimitBuilder, PosixRlimitType, ProcessBuilder, RootBuilder, Spec,
    SpecBuilder, UserBuilder,
};

use crate::error::Result;

/// A bind mount from the host (or the execution's scratch space) into the container.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BindMount {
    /// Host path.
    pub source: PathBuf,
    /// Path in the container.
    pub destination: PathBuf,
    /// Mounted read-only.
    pub readonly: bool,
}

/// Everything the spec of one execution depends on.
#[derive(Debug, Clone)]
pub struct ContainerPlan {
    /// The image's root directory (holds the mount points).
    pub rootfs: PathBuf,
    /// Mount the root read-only (the shared host image skeleton); an execution's own overlay root stays writable.
    pub readonly_root: bool,
    /// Hostname inside the container.
    pub hostname: String,
    /// Program and arguments; the program path is absolute.
    pub args: Vec<String>,
    /// `KEY=VALUE` environment.
    pub env: Vec<String>,
    /// Working directory in the container.
    pub cwd: String,
    /// Bind mounts, in order.
    pub binds: Vec<BindMount>,
    /// Host uid and gid that container root maps to (one id each: nothing else is mapped).
    pub host_id: u32,
    /// Absolute `linux.cgroupsPath`.
    pub cgroups_path: String,
    /// Memory limit (and memory+swap limit: no swap), bytes.
    pub memory_bytes: i64,
    /// Maximum number of processes and threads.
    pub pids_max: i64,
    /// Relative cpu weight (v1 `cpu.shares`; libcgroups converts it for v2).
    pub cpu_shares: u64,
    /// `RLIMIT_NOFILE`.
    pub nofile: u64,
    /// `RLIMIT_FSIZE`, bytes.
    pub fsize_bytes: u64,
    /// Size of `/dev/shm`, bytes.
    pub shm_bytes: u64,
}

/// Ptys one container's devpts may hold (`max=`): the host's `kernel.pty.max` (4096 by default, 1024 of them
/// reserved for the host's own devpts) is shared by every container.
pub const PTY_MAX: u32 = 64;
/// Inodes of the container's `/dev` tmpfs: it holds a dozen entries.
pub const DEV_INODES: u64 = 256;
/// A tmpfs gets one inode per page of its size: without `nr_inodes` the kernel allows half the host's RAM pages,
/// whatever the size, since empty files and directories take no space. A non-empty file takes at least a page, so
/// the bound only ever stops empty files and directories.
pub const BYTES_PER_INODE: u64 = 4 << 10;
/// The fewest inodes a sized tmpfs gets.
pub const MIN_INODES: u64 = 1024;

/// `nr_inodes` of a tmpfs of `bytes`.
pub fn inodes_for(bytes: u64) -> u64 {
    (bytes / BYTES_PER_INODE).max(MIN_INODES)
}

/// `RLIMIT_CORE`, soft and hard: 1, not 0. Below a page, so no core file is ever written, and the one value the
/// kernel reads as "no dump" when `core_pattern` pipes to a helper (systemd-coredump, apport), which it would
/// otherwise start as root on the host, outside every cgroup, for each crash; 0 is ignored for pipes. The seccomp
/// profile refuses every change of it.
pub const CORE_LIMIT: u64 = 1;

fn mount(dest: &str, typ: &str, source: &str, options: &[&str]) -> Result<Mount> {
    Ok(MountBuilder::default()
        .destination(dest)
        .typ(typ)
        .source(source)
        .options(options.iter().map(|s| s.to_string()).collect::<Vec<_>>())
        .build()?)
}

/// Builds the spec. The container gets new pid, mount, ipc, uts, net (loopback only), cgroup and user namespaces,
/// no capabilities at all, `no_new_privs`, a read-only root, the OCI default masked and read-only paths, and
/// cgroup limits for memory (no swap), pids and cpu.
pub fn build(plan: &ContainerPlan) -> Result<Spec> {
    Ok(SpecBuilder::default()
        .version("1.0.2")
        .root(
            RootBuilder::default()
                .path(&plan.rootfs)
                .readonly(plan.readonly_root)
                .build()?,
        )
        .hostname(&plan.hostname)
        .mounts(mounts(plan)?)
        .process(process(plan)?)
        .linux(linux(plan)?)
        .build()?)
}

/// `/proc`, a small `/dev` with `pts` (at most [`PTY_MAX`] ptys) and `shm`, then the plan's bind mounts in order.
/// Every tmpfs has a size and an inode bound.
fn mounts(plan: &ContainerPlan) -> Result<Vec<Mount>> {
    let mut mounts = vec![
        mount("/proc", "proc", "proc", &["nosuid", "noexec", "nodev"])?,
        mount(
            "/dev",
            "tmpfs",
            "tmpfs",
            &[
                "nosuid",
                "strictatime",
                "mode=755",
                "size=65536k",
                &format!("nr_inodes={DEV_INODES}"),
            ],
        )?,
        mount(
            "/dev/pts",
            "devpts",
            "devpts",
            &[
                "nosuid",
                "noexec",
                "newinstance",
                "ptmxmode=0666",
                "mode=0620",
                // Every devpts instance but the host's shares kernel.pty.max less kernel.pty.reserve (3072 by
                // default): without a cap of its own, one container takes them all and no other can open a pty.
                &format!("max={PTY_MAX}"),
            ],
        )?,
        mount(
            "/dev/shm",
            "tmpfs",
            "shm",
            &[
                "nosuid",
                "noexec",
                "nodev",
                "mode=1777",
                &format!("size={}", plan.shm_bytes),
                &format!("nr_inodes={}", inodes_for(plan.shm_bytes)),
            ],
        )?,
    ];
    for b in &plan.binds {
        let mut options = vec!["rbind", "nosuid", "nodev"];
        options.push(if b.readonly { "ro" } else { "rw" });
        mounts.push(
            MountBuilder::default()
                .destination(&b.destination)
                .typ("bind")
                .source(&b.source)
                .options(options.iter().map(|s| s.to_string()).collect::<Vec<_>>())
                .build()?,
        );
    }
    Ok(mounts)
}

/// The program as root of the user namespace with no capabilities, `no_new_privs` and rlimits (no core dumps:
/// [`CORE_LIMIT`]).
fn process(plan: &ContainerPlan) -> Result<oci_spec::runtime::Process> {
    let no_caps = Capabilities::new();
    Ok(ProcessBuilder::default()
        .terminal(false)
        .user(UserBuilder::default().uid(0u32).gid(0u32).build()?)
        .args(plan.args.clone())
        .env(plan.env.clone())
        .cwd(&plan.cwd)
        .no_new_privileges(true)
        .capabilities(
            LinuxCapabilitiesBuilder::default()
                .bounding(no_caps.clone())
                .effective(no_caps.clone())
                .inheritable(no_caps.clone())
                .permitted(no_caps.clone())
                .ambient(no_caps)
                .build()?,
        )
        .rlimits(vec![
            PosixRlimitBuilder::default()
                .typ(PosixRlimitType::RlimitCore)
                .hard(CORE_LIMIT)
                .soft(CORE_LIMIT)
                .build()?,
            PosixRlimitBuilder::default()
                .typ(PosixRlimitType::RlimitNofile)
                .hard(plan.nofile)
                .soft(plan.nofile)
                .build()?,
            PosixRlimitBuilder::default()
                .typ(PosixRlimitType::RlimitFsize)
                .hard(plan.fsize_bytes)
                .soft(plan.fsize_bytes)
                .build()?,
        ])
        .build()?)
}

/// The namespaces every container gets, all of them new (and the only set the direct start accepts).
pub const NAMESPACES: [LinuxNamespaceType; 7] = [
    LinuxNamespaceType::Pid,
    LinuxNamespaceType::Mount,
    LinuxNamespaceType::Ipc,
    LinuxNamespaceType::Uts,
    LinuxNamespaceType::Network,
    LinuxNamespaceType::Cgroup,
    LinuxNamespaceType::User,
];

/// Namespaces, the one-id user mapping, cgroup limits and the OCI default masked and read-only paths.
fn linux(plan: &ContainerPlan) -> Result<oci_spec::runtime::Linux> {
    let namespaces = NAMESPACES
        .into_iter()
        .map(|t| LinuxNamespaceBuilder::default().typ(t).build())
        .collect::<Result<Vec<_>, _>>()?;

    let id_map = LinuxIdMappingBuilder::default()
        .host_id(plan.host_id)
        .container_id(0u32)
        .size(1u32)
        .build()?;

    let resources = LinuxResourcesBuilder::default()
        .memory(
            LinuxMemoryBuilder::default()
                .limit(plan.memory_bytes)
                .swap(plan.memory_bytes)
                .build()?,
        )
        .pids(LinuxPidsBuilder::default().limit(plan.pids_max).build()?)
        .cpu(LinuxCpuBuilder::default().shares(plan.cpu_shares).build()?)
        .build()?;

    Ok(LinuxBuilder::default()
        .namespaces(namespaces)
        .uid_mappings(vec![id_map])
        .gid_mappings(vec![id_map])
        .cgroups_path(PathBuf::from(&plan.cgroups_path))
        .resources(resources)
        .masked_paths(get_default_maskedpaths())
        .readonly_paths(get_default_readonly_paths())
        .build()?)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A plan like the daemon's (also read back by the direct start's tests).
    pub(crate) fn plan() -> ContainerPlan {
        ContainerPlan {
            rootfs: "/state/images/host/rootfs".into(),
            readonly_root: true,
            hostname: "sandbox".into(),
            args: vec!["/usr/bin/python3".into(), "/sandbox/main.py".into()],
            env: vec!["PATH=/usr/bin:/bin".into()],
            cwd: "/workspace".into(),
            binds: vec![
                BindMount {
                    source: "/usr".into(),
                    destination: "/usr".into(),
                    readonly: true,
                },
                BindMount {
                    source: "/run/x/scratch/workspace".into(),
                    destination: "/workspace".into(),
                    readonly: false,
                },
            ],
            host_id: 200_003,
            cgroups_path: "/sandboxd/e1".into(),
            memory_bytes: 64 << 20,
            pids_max: 64,
            cpu_shares: 512,
            nofile: 1024,
            fsize_bytes: 64 << 20,
            shm_bytes: 64 << 20,
        }
    }

    fn options_of<'a>(spec: &'a Spec, dest: &str) -> &'a Vec<String> {
        spec.mounts()
            .as_ref()
            .unwrap()
            .iter()
            .find(|m| m.destination() == &PathBuf::from(dest))
            .unwrap_or_else(|| panic!("no mount at {dest}"))
            .options()
            .as_ref()
            .unwrap()
    }

    /// Core dumps: soft and hard 1 (0 does not stop a piped `core_pattern`); one container cannot take the host's
    /// ptys or a tmpfs's inodes without bound.
    #[test]
    fn core_limit_is_one_and_ptys_and_inodes_are_bounded() {
        let spec = build(&plan()).unwrap();
        let core = spec
            .process()
            .as_ref()
            .unwrap()
            .rlimits()
            .as_ref()
            .unwrap()
            .iter()
            .find(|r| r.typ() == PosixRlimitType::RlimitCore)
            .unwrap();
        assert_eq!((core.soft(), core.hard()), (1, 1));
        let pts = options_of(&spec, "/dev/pts");
        assert!(pts.iter().any(|o| o == "max=64"), "/dev/pts: {pts:?}");
        // `/dev` holds a dozen entries; `/dev/shm` one inode per 4 KiB page of its 64 MiB.
        for (dest, inodes) in [("/dev", "nr_inodes=256"), ("/dev/shm", "nr_inodes=16384")] {
            let o = options_of(&spec, dest);
            assert!(o.iter().any(|o| o == inodes), "{dest}: {o:?}");
        }
    }

    #[test]
    fn every_namespace_is_new_and_root_maps_to_one_unprivileged_id() {
        let spec = build(&plan()).unwrap();
        let linux = spec.linux().as_ref().unwrap();
        let types: Vec<_> = linux
            .namespaces()
            .as_ref()
            .unwrap()
            .iter()
            .map(|n| n.typ())
            .collect();
        for t in [
            LinuxNamespaceType::Pid,
            LinuxNamespaceType::Mount,
            LinuxNamespaceType::Ipc,
            LinuxNamespaceType::Uts,
            LinuxNamespaceType::Network,
            LinuxNamespaceType::Cgroup,
            LinuxNamespaceType::User,
        ] {
            assert!(types.contains(&t), "{t:?} missing");
        }
        for maps in [linux.uid_mappings(), linux.gid_mappings()] {
            let m = maps.as_ref().unwrap();
            assert_eq!(m.len(), 1);
            assert_eq!(
                (m[0].container_id(), m[0].host_id(), m[0].size()),
                (0, 200_003, 1)
            );
        }
        assert!(linux
            .masked_paths()
            .as_ref()
            .unwrap()
            .contains(&"/proc/kcore".to_string()));
    }

    #[test]
    fn no_capabilities_no_new_privs_readonly_root() {
        let spec = build(&plan()).unwrap();
        let p = spec.process().as_ref().unwrap();
        assert_eq!(p.no_new_privileges(), Some(true));
        let caps = p.capabilities().as_ref().unwrap();
        for set in [
            caps.bounding(),
            caps.effective(),
            caps.inheritable(),
            caps.permitted(),
            caps.ambient(),
        ] {
            assert!(set.as_ref().unwrap().is_empty());
        }
        assert_eq!(spec.root().as_ref().unwrap().readonly(), Some(true));
    }

    #[test]
    fn limits_forbid_swap_and_bind_modes_follow_the_plan() {
        let spec = build(&plan()).unwrap();
        let r = spec.linux().as_ref().unwrap().resources().as_ref().unwrap();
        let mem = r.memory().as_ref().unwrap();
        assert_eq!(mem.limit(), Some(64 << 20));
        assert_eq!(mem.swap(), mem.limit());
        assert_eq!(r.pids().as_ref().unwrap().limit(), 64);
        let mounts = spec.mounts().as_ref().unwrap();
        let usr = mounts
            .iter()
            .find(|m| m.destination() == &PathBuf::from("/usr"))
            .unwrap();
        assert!(usr.options().as_ref().unwrap().contains(&"ro".to_string()));
        let ws = mounts
            .iter()
            .find(|m| m.destination() == &PathBuf::from("/workspace"))
            .unwrap();
        let opts = ws.options().as_ref().unwrap();
        assert!(opts.contains(&"rw".to_string()) && opts.contains(&"nosuid".to_string()));
    }
}

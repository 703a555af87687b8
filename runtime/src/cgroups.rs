//! Cgroups: which hierarchy the host runs, the daemon-owned parent cgroup, each container's leaf (limits, pids,
//! freezer, cpu quota), per-execution usage and leftovers.
//!
//! Every function takes the cgroupfs root as a parameter so it is tested against a fake tree in a tempdir;
//! nothing here touches a cgroup outside `<root>/<hierarchy>/<parent>`.
//!
//! # What goes through cgroups-rs, and what does not
//!
//! The controller files of a container's leaf are written by [`cgroups_rs`] (kata-containers): a cpu quota set on
//! its own ([`Cgroups::set_cpu_quota`], [`CpuController`]), freeze and thaw
//! ([`FreezerController`], and on v1 the freezer state read back) and moving a process in
//! ([`cgroups_rs::fs::Cgroup::add_task_by_tgid`]). It is handed the directories through a [`Hierarchy`] of our
//! own (`Controllers`), not through its `hierarchies::auto()`: that one reads `/proc/self/mountinfo` (v1) and
//! the fixed `/sys/fs/cgroup` (v2), so it could not be pointed at the fake tree, and on v1 it would hand out every
//! mounted hierarchy where sandboxd uses five controllers. The rest is written here, each for a reason:
//!
//! - **Detection and the controller check** ([`Cgroups::detect`], [`Cgroups::check_controllers`]): cgroups-rs
//!   decides v1 or v2 by `statfs` of the fixed `/sys/fs/cgroup` and reads that root's `cgroup.controllers`; it
//!   takes no root. Detection uses libcgroups' `get_cgroup_setup_with_root`, the check reads the given root.
//! - **Creating a leaf** ([`Cgroups::create_leaf`]): cgroups-rs creates with `create_dir_all`, so a leaf that
//!   exists already is taken silently; here it is an error (the id is fresh, an existing leaf is somebody else's).
//!   On v2 its `Cgroup::create` also writes `+controller` into the subtree control of every ancestor from the
//!   cgroupfs root down, a cgroup sandboxd does not own, and ignores a refused write (fail open).
//! - **The parent** ([`Cgroups::ensure_parent`]): the same v2 ancestor writes; on v1 cgroups-rs's cpuset
//!   `post_create` logs a failure to copy `cpuset.cpus`/`cpuset.mems` and carries on, here it is an error.
//! - **The limits** ([`Cgroups::set_limits`], [`LimitFiles`]): written before every launch, through files opened
//!   when the container was made (one write each, see [`LimitFiles`]), where cgroups-rs's controllers open each
//!   file on each call and check each directory first.
//! - **Usage** ([`Cgroups::usage`], [`Cgroups::memory_current`]): read on every execution's way out. cgroups-rs
//!   reads whole groups of files for one number (`memory_stat()` opens eleven files on v1 including
//!   `memory.stat` and `memory.numa_stat`, `cpuacct()` eight), has no reader for v2's `memory.events`
//!   (`oom_kill` is always 0 there), and `parse_oom_control` panics (`unwrap`) on a file it does not expect.
//!   Here: three reads.
//! - **v2 frozen state** ([`Cgroups::frozen`]): cgroups-rs's `FreezerController::state` reads `cgroup.freeze`
//!   on v2, which is the state asked for, not the one reached; the kernel reports that in `cgroup.events`.
//! - **Removal** ([`Cgroups::remove_leaf`], leftovers): cgroups-rs's delete removes only the controllers it was
//!   given and kills nothing. Here every hierarchy is swept (the libcontainer start creates a container's cgroup
//!   in all of them), the processes of a leftover are killed first, and a fake tree (regular files in the
//!   directories) is removed too.

use std::fs;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cgroups_rs::fs::cpu::CpuController;
use cgroups_rs::fs::cpuacct::CpuAcctController;
use cgroups_rs::fs::freezer::FreezerController;
use cgroups_rs::fs::memory::MemController;
use cgroups_rs::fs::pid::PidController;
use cgroups_rs::fs::{Cgroup, ControllIdentifier, Controller, Hierarchy, Subsystem};
use cgroups_rs::{CgroupPid, FreezerState};

use crate::error::{Error, Result};

pub use crate::error::CgroupError;
use limits::{keyed, to_i64, usage_names, LeafDirs};
pub use limits::{shares_to_weight, CgroupLimits, CpuQuota, LimitFiles, Usage, CPU_PERIOD_US};

mod limits;

/// The default cgroupfs mount point.
pub const DEFAULT_ROOT: &str = "/sys/fs/cgroup";

/// v1 controllers an execution's limits and usage need.
const V1_REQUIRED: &[&str] = &["memory", "pids", "cpu", "cpuacct"];
/// How long a freeze or thaw may take before it is an error.
const FREEZE_TIMEOUT: Duration = Duration::from_secs(5);
/// v2 controllers an execution's limits and usage need.
const V2_REQUIRED: &[&str] = &["memory", "pids", "cpu"];

/// Which cgroup hierarchy limits are enforced through.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CgroupVersion {
    /// Legacy or hybrid hosts: one hierarchy per controller.
    V1,
    /// Unified hierarchy.
    V2,
}

impl CgroupVersion {
    /// `"v1"` or `"v2"`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::V1 => "v1",
            Self::V2 => "v2",
        }
    }
}

/// A cgroup directory removed during leftover cleanup, and how many processes had to be killed in it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Removed {
    /// The directory removed.
    pub path: PathBuf,
    /// Processes found in it and killed.
    pub killed: usize,
}

/// The hierarchy directory of each controller sandboxd uses (v2: the root for all), found once. It is the
/// [`Hierarchy`] cgroups-rs works in: its subsystems are exactly these, at exactly these paths.
#[derive(Debug, Clone)]
struct Controllers(Arc<ControllerDirs>);

#[derive(Debug)]
struct ControllerDirs {
    v2: bool,
    root: PathBuf,
    memory: Option<PathBuf>,
    pids: Option<PathBuf>,
    cpu: Option<PathBuf>,
    cpuacct: Option<PathBuf>,
    freezer: Option<PathBuf>,
}

impl Controllers {
    fn new(version: CgroupVersion, root: &Path, hierarchies: &[PathBuf]) -> Self {
        let dir = |controller: &str| match version {
            CgroupVersion::V2 => Some(root.to_owned()),
            CgroupVersion::V1 => v1_hierarchy(hierarchies, controller),
        };
        Self(Arc::new(ControllerDirs {
            v2: version == CgroupVersion::V2,
            root: root.to_owned(),
            memory: dir("memory"),
            pids: dir("pids"),
            cpu: dir("cpu"),
            cpuacct: dir("cpuacct"),
            freezer: dir("freezer"),
        }))
    }

    /// The hierarchy directory of `controller`.
    fn dir(&self, controller: &str) -> Option<&Path> {
        let d = &self.0;
        match controller {
            "memory" => d.memory.as_deref(),
            "pids" => d.pids.as_deref(),
            "cpu" => d.cpu.as_deref(),
            "cpuacct" => d.cpuacct.as_deref(),
            "freezer" => d.freezer.as_deref(),
            _ => None,
        }
    }
}

impl Hierarchy for Controllers {
    fn v2(&self) -> bool {
        self.0.v2
    }

    /// One subsystem per controller found; on v1 `cpuacct` only when it is not co-mounted with `cpu` (one
    /// directory, joined once).
    fn subsystems(&self) -> Vec<Subsystem> {
        let d = &self.0;
        let mut subs = Vec::with_capacity(5);
        if let Some(p) = &d.memory {
            subs.push(Subsystem::Mem(MemController::new(
                p.clone(),
                p.clone(),
                d.v2,
            )));
        }
        if let Some(p) = &d.pids {
            subs.push(Subsystem::Pid(PidController::new(
                p.clone(),
                p.clone(),
                d.v2,
            )));
        }
        if let Some(p) = &d.cpu {
            subs.push(Subsystem::Cpu(CpuController::new(
                p.clone(),
                p.clone(),
                d.v2,
            )));
        }
        if let Some(p) = d
            .cpuacct
            .as_ref()
            .filter(|p| !d.v2 && d.cpu.as_ref() != Some(*p))
        {
            subs.push(Subsystem::CpuAcct(CpuAcctController::new(
                p.clone(),
                p.clone(),
            )));
        }
        if let Some(p) = &d.freezer {
            subs.push(Subsystem::Freezer(FreezerController::new(
                p.clone(),
                p.clone(),
                d.v2,
            )));
        }
        subs
    }

    fn root(&self) -> PathBuf {
        self.0.root.clone()
    }

    fn root_control_group(&self) -> Cgroup {
        Cgroup::load(Box::new(self.clone()), "")
    }

    fn parent_control_group(&self, path: &str) -> Cgroup {
        let parent = Path::new(path).parent().unwrap_or(Path::new(""));
        Cgroup::load(Box::new(self.clone()), parent)
    }
}

/// The cgroup setup sandboxd works in: version, cgroupfs root and the daemon-owned parent (relative, no leading
/// slash, e.g. `sandboxd`).
#[derive(Debug, Clone)]
pub struct Cgroups {
    version: CgroupVersion,
    root: PathBuf,
    parent: String,
    /// The hierarchy directories, found once: the mounts under the cgroupfs root do not change while sandboxd
    /// runs, and every execution asks for them several times (limits, usage, removal).
    hierarchies: Arc<[PathBuf]>,
    /// Those of the controllers sandboxd uses, for cgroups-rs.
    controllers: Controllers,
}

impl Cgroups {
    /// Detects the host's setup with libcgroups (hybrid counts as v1, as libcgroups treats it).
    pub fn detect(root: &Path, parent: &str) -> Result<Self> {
        let setup = libcgroups::common::get_cgroup_setup_with_root(root).map_err(|source| {
            CgroupError::Detect {
                root: root.to_owned(),
                source,
            }
        })?;
        let version = match setup {
            libcgroups::common::CgroupSetup::Unified => CgroupVersion::V2,
            libcgroups::common::CgroupSetup::Legacy | libcgroups::common::CgroupSetup::Hybrid => {
                CgroupVersion::V1
            }
        };
        Self::with_version(version, root, parent)
    }

    /// Uses a known version (tests use this with a fake tree).
    pub fn with_version(version: CgroupVersion, root: &Path, parent: &str) -> Result<Self> {
        let parent = parent.trim_matches('/').to_owned();
        if parent.is_empty()
            || parent
                .split('/')
                .any(|c| c.is_empty() || c == "." || c == "..")
        {
            return Err(CgroupError::InvalidParent(parent).into());
        }
        let hierarchies = scan_hierarchies(version, root);
        Ok(Self {
            version,
            root: root.to_owned(),
            parent,
            controllers: Controllers::new(version, root, &hierarchies),
            hierarchies: hierarchies.into(),
        })
    }

    /// The hierarchy version.
    pub fn version(&self) -> CgroupVersion {
        self.version
    }

    /// The parent, relative to each hierarchy root.
    pub fn parent(&self) -> &str {
        &self.parent
    }

    /// The absolute `linux.cgroupsPath` for an execution: `/<parent>/<id>`.
    pub fn cgroups_path(&self, id: &str) -> String {
        format!("/{}/{}", self.parent, id)
    }

    /// Every hierarchy directory: v1 one per mounted controller set (real directories holding `cgroup.procs`,
    /// the hybrid `unified` mount excluded), v2 the root. Found when this was made.
    pub fn hierarchies(&self) -> &[PathBuf] {
        &self.hierarchies
    }

    /// Fails closed when a controller sandboxd needs is missing, naming it and what to do.
    pub fn check_controllers(&self) -> Result<()> {
        match self.version {
            CgroupVersion::V1 => {
                let missing: Vec<_> = V1_REQUIRED
                    .iter()
                    .filter(|c| self.controllers.dir(c).is_none())
                    .copied()
                    .collect();
                if !missing.is_empty() {
                    return Err(CgroupError::V1ControllersMissing {
                        missing,
                        root: self.root.clone(),
                    }
                    .into());
                }
                // Without memsw the memory limit cannot forbid swap; that only matters when the host has swap.
                let memory = self.controllers.dir("memory").unwrap_or(Path::new(""));
                if host_has_swap() && !memory.join("memory.memsw.limit_in_bytes").exists() {
                    return Err(CgroupError::NoSwapAccounting.into());
                }
                Ok(())
            }
            CgroupVersion::V2 => {
                let path = self.root.join("cgroup.controllers");
                let missing = v2_missing(&path)?;
                if !missing.is_empty() {
                    return Err(CgroupError::V2ControllersMissing {
                        missing,
                        file: path,
                    }
                    .into());
                }
                // Offered by the host is not enough: the cgroup the parent is created in must have them in its
                // subtree control, or the parent's own `+cpu` is refused (ENOENT). systemd enables them down to a
                // unit with Delegate=yes; a daemon started elsewhere finds only what other units asked for.
                let above = Path::new(&self.parent).parent().unwrap_or(Path::new(""));
                let path = self.root.join(above).join("cgroup.subtree_control");
                let missing = v2_missing(&path)?;
                if missing.is_empty() {
                    Ok(())
                } else {
                    Err(CgroupError::V2ControllersNotEnabled {
                        missing,
                        file: path,
                    }
                    .into())
                }
            }
        }
    }

    /// Creates the parent in every hierarchy (v2: and delegates the controllers to its children).
    pub fn ensure_parent(&self) -> Result<()> {
        for h in self.hierarchies() {
            let dir = h.join(&self.parent);
            fs::create_dir_all(&dir).map_err(|e| Error::io(&dir, e))?;
            if self.version == CgroupVersion::V1 && h.file_name().is_some_and(|n| n == "cpuset") {
                // A new cpuset cgroup starts empty; children cannot be populated until the parent has cpus/mems.
                for file in ["cpuset.cpus", "cpuset.mems"] {
                    let mine = dir.join(file);
                    if fs::read_to_string(&mine)
                        .map(|s| s.trim().is_empty())
                        .unwrap_or(false)
                    {
                        let from = h.join(file);
                        let value = fs::read_to_string(&from).map_err(|e| Error::io(&from, e))?;
                        fs::write(&mine, value.trim()).map_err(|e| Error::io(&mine, e))?;
                    }
                }
            }
            if self.version == CgroupVersion::V2 {
                let control = dir.join("cgroup.subtree_control");
                let want: String = V2_REQUIRED.iter().map(|c| format!("+{c} ")).collect();
                fs::write(&control, want.trim()).map_err(|e| Error::io(&control, e))?;
            }
        }
        Ok(())
    }

    /// The leaf of an execution in the hierarchy holding `controller` (v2: the only one).
    fn leaf(&self, controller: &str, id: &str) -> Option<PathBuf> {
        let h = match self.version {
            CgroupVersion::V2 => &self.root,
            CgroupVersion::V1 => self.controllers.dir(controller)?,
        };
        Some(h.join(&self.parent).join(id))
    }

    /// The leaf of an execution in the hierarchy holding `controller`, which must exist; `needed_for` names what
    /// cannot be enforced without the hierarchy.
    fn existing_leaf(
        &self,
        controller: &'static str,
        id: &str,
        needed_for: &'static str,
    ) -> Result<PathBuf, CgroupError> {
        let leaf = self.leaf(controller, id).ok_or(CgroupError::NoHierarchy {
            controller,
            needed_for,
        })?;
        if leaf.is_dir() {
            Ok(leaf)
        } else {
            Err(CgroupError::Missing(leaf))
        }
    }

    /// An execution's cgroup as cgroups-rs sees it: one subsystem per controller sandboxd uses, at
    /// `<hierarchy>/<parent>/<id>`. Nothing is read or created.
    fn cgroup(&self, id: &str) -> Cgroup {
        Cgroup::load(
            Box::new(self.controllers.clone()),
            format!("{}/{}", self.parent, id),
        )
    }

    /// Reads an execution's usage. Missing files read as zero (a kernel without `memory.peak`, say) but a leaf that
    /// does not exist is an error: the usage would be made up.
    pub fn usage(&self, id: &str) -> Result<Usage> {
        let memory = self.existing_leaf("memory", id, "usage accounting")?;
        let names = usage_names(self.version == CgroupVersion::V2);
        Ok(Usage {
            peak_memory_bytes: read_u64(&memory.join(names.peak)),
            cpu_time_ns: self.cpu_time_ns(id)?,
            oom_kills: read_keyed(&memory.join(names.oom), "oom_kill"),
        })
    }

    /// The CPU time an execution's cgroup has used so far, ns (what [`Self::usage`] reads as `cpu_time_ns`).
    pub fn cpu_time_ns(&self, id: &str) -> Result<u64> {
        let v2 = self.version == CgroupVersion::V2;
        let dir = match v2 {
            false => self.existing_leaf("cpuacct", id, "usage accounting")?,
            true => self.existing_leaf("memory", id, "usage accounting")?,
        };
        let text = fs::read_to_string(dir.join(usage_names(v2).cpu)).unwrap_or_default();
        Ok(limits::cpu_time_ns(v2, &text))
    }

    /// Sets the limits of a live container's cgroup: memory (and memory+swap, so no swap), pids, cpu weight and
    /// the cpu quota when one is given.
    ///
    /// Each file is written on its own rather than through libcgroups' or cgroups-rs's `apply`, which walk every
    /// controller and resource kind and cost more than the execution they prepare; a container made ahead of time
    /// keeps its files open ([`LimitFiles`]) and gets the request's limits through them. Fails (closed) when a leaf
    /// or a file is missing or a file refuses the value, e.g. a memory limit below what the cgroup already uses.
    pub fn set_limits(&self, id: &str, limits: &CgroupLimits) -> Result<()> {
        limits::checked(limits)?;
        LimitFiles::open(self.leaf_dirs(id, false)?)?.set(limits)
    }

    /// Container `id`'s limit and usage files, opened once (see [`LimitFiles`]); its leaves must exist.
    pub fn limit_files(&self, id: &str) -> Result<LimitFiles> {
        LimitFiles::open(self.leaf_dirs(id, true)?)
    }

    /// The leaves [`LimitFiles`] opens files in; the usage's (v1 `cpuacct`) only when `usage`.
    fn leaf_dirs(&self, id: &str, usage: bool) -> Result<LeafDirs, CgroupError> {
        const FOR: &str = "a container's limits";
        let v2 = self.version == CgroupVersion::V2;
        Ok(LeafDirs {
            v2,
            memory: self.existing_leaf("memory", id, FOR)?,
            pids: self.existing_leaf("pids", id, FOR)?,
            cpu: self.existing_leaf("cpu", id, FOR)?,
            usage: match (usage, v2) {
                (false, _) => None,
                (true, true) => Some(self.existing_leaf("cpu", id, "usage accounting")?),
                (true, false) => Some(self.existing_leaf("cpuacct", id, "usage accounting")?),
            },
        })
    }

    /// Every directory under the parent, in every hierarchy: what a crashed instance may have left.
    pub fn leftovers(&self) -> Vec<PathBuf> {
        let mut out = Vec::new();
        for h in self.hierarchies() {
            let Ok(entries) = fs::read_dir(h.join(&self.parent)) else {
                continue;
            };
            for e in entries.flatten() {
                if e.file_type().map(|t| t.is_dir()).unwrap_or(false) {
                    out.push(e.path());
                }
            }
        }
        out.sort();
        out
    }

    /// Kills every process in each leftover cgroup (they are ours: nothing else lives under our parent), then
    /// removes the directories, deepest first.
    pub fn remove_leftovers(&self) -> Vec<Result<Removed>> {
        self.remove_leftovers_except(&[])
    }

    /// [`Self::remove_leftovers`], but the containers named in `kept` (agent runs a restarted daemon takes back)
    /// are left as they are.
    pub fn remove_leftovers_except(&self, kept: &[String]) -> Vec<Result<Removed>> {
        let dirs: Vec<PathBuf> = self
            .leftovers()
            .into_iter()
            .filter(|d| {
                d.file_name()
                    .is_none_or(|n| !kept.iter().any(|k| n == k.as_str()))
            })
            .collect();
        dirs.iter().for_each(|d| thaw_tree(d));
        dirs.iter().map(|dir| remove_tree(dir)).collect()
    }

    /// Freezes every process of a container's cgroup (v1 `freezer.state`, v2 `cgroup.freeze`) and waits until the
    /// kernel reports it frozen. Used by agent sandboxes for a true pause.
    pub fn freeze(&self, id: &str) -> Result<()> {
        self.set_frozen(id, true, FREEZE_TIMEOUT)
    }

    /// Thaws a frozen container's cgroup and waits until the kernel reports it thawed.
    pub fn thaw(&self, id: &str) -> Result<()> {
        self.set_frozen(id, false, FREEZE_TIMEOUT)
    }

    /// Whether a container's cgroup is frozen now (v1: `FROZEN`; `FREEZING` is not yet frozen).
    pub fn frozen(&self, id: &str) -> Result<bool> {
        let cg = self.cgroup(id);
        self.is_frozen(existing(&cg, "freezer", "pause")?)
    }

    /// v1: cgroups-rs's freezer state. v2: `frozen 1` in `cgroup.events`, the state the kernel reached
    /// (cgroups-rs reads `cgroup.freeze` there, the state asked for).
    fn is_frozen(&self, freezer: &FreezerController) -> Result<bool> {
        match self.version {
            CgroupVersion::V1 => {
                let state = freezer
                    .state()
                    .map_err(refused("a read of the freezer state", freezer.path()))?;
                Ok(matches!(state, FreezerState::Frozen))
            }
            CgroupVersion::V2 => {
                let events = freezer.path().join("cgroup.events");
                let s = fs::read_to_string(&events).map_err(|e| Error::io(&events, e))?;
                Ok(s.lines().any(|l| l.trim() == "frozen 1"))
            }
        }
    }

    fn set_frozen(&self, id: &str, frozen: bool, timeout: Duration) -> Result<()> {
        let cg = self.cgroup(id);
        let freezer: &FreezerController = existing(&cg, "freezer", "pause")?;
        let deadline = Instant::now() + timeout;
        loop {
            // v1 may stay FREEZING while a task is in an uninterruptible sleep; writing again retries the freeze.
            if frozen {
                freezer.freeze()
            } else {
                freezer.thaw()
            }
            .map_err(refused(
                if frozen { "a freeze" } else { "a thaw" },
                freezer.path(),
            ))?;
            if self.is_frozen(freezer)? == frozen {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(CgroupError::FreezeTimeout {
                    id: id.to_owned(),
                    frozen,
                    timeout,
                }
                .into());
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    /// Sets a hard CPU quota of `cores` (v1 `cpu.cfs_quota_us` over a 100 ms period, v2 `cpu.max`).
    pub fn set_cpu_quota(&self, id: &str, cores: f64) -> Result<()> {
        let quota = CpuQuota::from_cores(cores)?;
        let cg = self.cgroup(id);
        write_quota(existing(&cg, "cpu", "a cpu quota")?, quota)?;
        Ok(())
    }

    /// Memory charged to a container's cgroup now, bytes (v1 `memory.usage_in_bytes`, v2 `memory.current`).
    pub fn memory_current(&self, id: &str) -> Result<u64> {
        let leaf = self.existing_leaf("memory", id, "memory accounting")?;
        let names = usage_names(self.version == CgroupVersion::V2);
        Ok(read_u64(&leaf.join(names.current)))
    }

    /// The leaf directories of an execution that the direct start ([`crate::direct`]) creates: on v1 one per
    /// hierarchy carrying a controller sandboxd limits, accounts or freezes with (`memory`, `cpu`, `cpuacct`,
    /// `pids`, and `freezer` where mounted; co-mounted controllers share a directory), on v2 the one leaf. The other
    /// v1 hierarchies (blkio, cpuset, devices, ...) are left alone: sandboxd sets nothing in them.
    pub fn joined_leaves(&self, id: &str) -> Result<Vec<PathBuf>> {
        let mut out: Vec<PathBuf> = Vec::new();
        for controller in V1_REQUIRED.iter().chain(&["freezer"]) {
            let Some(h) = self.controllers.dir(controller) else {
                if *controller == "freezer" {
                    continue;
                }
                return Err(CgroupError::NoHierarchy {
                    controller,
                    needed_for: "a container's limits",
                }
                .into());
            };
            let leaf = h.join(&self.parent).join(id);
            if !out.contains(&leaf) {
                out.push(leaf);
            }
        }
        Ok(out)
    }

    /// Creates an execution's leaves ([`Self::joined_leaves`]) and writes its limits; for the direct start, which
    /// then moves the container's init in with [`Self::attach`]. A leaf that already exists is an error: the id
    /// is fresh, so it would be somebody else's.
    pub fn create_leaf(&self, id: &str, limits: &CgroupLimits) -> Result<()> {
        for leaf in self.joined_leaves(id)? {
            fs::create_dir(&leaf).map_err(|e| Error::io(&leaf, e))?;
        }
        self.set_limits(id, limits)
    }

    /// Moves process `pid` into every leaf of the execution (`cgroup.procs`, through cgroups-rs). Fails closed,
    /// as [`Self::joined_leaves`] does, when a hierarchy sandboxd limits with is missing.
    pub fn attach(&self, id: &str, pid: i32) -> Result<()> {
        self.joined_leaves(id)?;
        let tgid = u64::try_from(pid).map_err(|_| CgroupError::InvalidPid(pid))?;
        let path = PathBuf::from(self.cgroups_path(id));
        self.cgroup(id)
            .add_task_by_tgid(CgroupPid::from(tgid))
            .map_err(refused("a process", &path))?;
        Ok(())
    }

    /// Removes one execution's leaf in every hierarchy if it is still there (libcontainer normally does this).
    pub fn remove_leaf(&self, id: &str) -> Result<()> {
        self.remove_all(&format!("{}/{}", self.parent, id))
    }

    /// Removes the (empty) parent in every hierarchy; used at daemon shutdown.
    pub fn remove_parent(&self) -> Result<()> {
        self.remove_all(&self.parent)
    }

    /// Removes cgroup `path` (relative) in every hierarchy, thawed everywhere first.
    fn remove_all(&self, path: &str) -> Result<()> {
        let dirs: Vec<PathBuf> = self
            .hierarchies()
            .iter()
            .map(|h| h.join(path))
            .filter(|d| d.exists())
            .collect();
        dirs.iter().for_each(|d| thaw_tree(d));
        for dir in &dirs {
            remove_tree(dir)?;
        }
        Ok(())
    }
}

/// The controllers of [`V2_REQUIRED`] a v2 controller list (`cgroup.controllers`, `cgroup.subtree_control`)
/// lacks.
fn v2_missing(path: &Path) -> Result<Vec<&'static str>> {
    let listed = fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
    Ok(V2_REQUIRED
        .iter()
        .filter(|c| !listed.split_whitespace().any(|h| h == **c))
        .copied()
        .collect())
}

/// The controller `T` of a cgroup, whose leaf must exist; `name` and `needed_for` name the error when no hierarchy
/// carries it.
fn existing<'a, T>(
    cg: &'a Cgroup,
    name: &'static str,
    needed_for: &'static str,
) -> Result<&'a T, CgroupError>
where
    &'a T: From<&'a Subsystem>,
    T: Controller + ControllIdentifier,
{
    let c = cg.controller_of::<T>().ok_or(CgroupError::NoHierarchy {
        controller: name,
        needed_for,
    })?;
    if c.exists() {
        Ok(c)
    } else {
        Err(CgroupError::Missing(c.path().to_owned()))
    }
}

/// The error of a cgroups-rs call on `leaf` that refused `what`.
fn refused<'a>(
    what: &'static str,
    leaf: &'a Path,
) -> impl FnOnce(cgroups_rs::fs::error::Error) -> CgroupError + 'a {
    move |source| CgroupError::Refused {
        what,
        leaf: leaf.to_owned(),
        source,
    }
}

/// Writes `quota` over [`CPU_PERIOD_US`] into the leaf of `cpu`; an error when the controller refuses it (a v1
/// kernel without CFS bandwidth control has no `cpu.cfs_quota_us`).
fn write_quota(cpu: &CpuController, quota: CpuQuota) -> Result<(), CgroupError> {
    let quota_us = to_i64("cpu quota", quota.quota_us())?;
    cpu.set_cfs_quota_and_period(Some(quota_us), Some(CPU_PERIOD_US))
        .map_err(refused("a cpu quota", cpu.path()))
}

/// The v1 hierarchy among `hierarchies` that carries a controller (`cpu,cpuacct` counts for both).
fn v1_hierarchy(hierarchies: &[PathBuf], controller: &str) -> Option<PathBuf> {
    hierarchies
        .iter()
        .find(|h| {
            h.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.split(',').any(|c| c == controller))
        })
        .cloned()
}

/// The hierarchy directories under `root` (see [`Cgroups::hierarchies`]).
fn scan_hierarchies(version: CgroupVersion, root: &Path) -> Vec<PathBuf> {
    match version {
        CgroupVersion::V2 => vec![root.to_owned()],
        CgroupVersion::V1 => {
            let mut out = Vec::new();
            let Ok(entries) = fs::read_dir(root) else {
                return out;
            };
            for entry in entries.flatten() {
                let name = entry.file_name();
                if name == "unified" {
                    continue;
                }
                let Ok(ft) = entry.file_type() else { continue };
                if ft.is_dir() && entry.path().join("cgroup.procs").exists() {
                    out.push(entry.path());
                }
            }
            out.sort();
            out
        }
    }
}

/// Thaws every cgroup of a tree, best effort (files a hierarchy lacks are skipped). A frozen v1 task cannot die
/// until thawed, and on v1 the freezer is a hierarchy of its own: [`remove_tree`] kills through whichever hierarchy
/// comes first, so the whole leaf is thawed in every hierarchy before any kill (a paused agent's leaf, say, left by
/// a crash). v2 lets SIGKILL through a freeze; thawing there too keeps one path.
fn thaw_tree(dir: &Path) {
    let _ = fs::write(dir.join("freezer.state"), "THAWED");
    let _ = fs::write(dir.join("cgroup.freeze"), "0");
    if let Ok(entries) = fs::read_dir(dir) {
        for e in entries.flatten() {
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                thaw_tree(&e.path());
            }
        }
    }
}

/// Kills the processes of a cgroup tree and removes it, children first. Processes are killed by the pids the
/// cgroup lists; a fork racing the kill is caught by the next round (bounded).
fn remove_tree(dir: &Path) -> Result<Removed> {
    let mut killed = 0;
    if let Ok(entries) = fs::read_dir(dir) {
        for e in entries.flatten() {
            if e.file_type().map(|t| t.is_dir()).unwrap_or(false) {
                killed += remove_tree(&e.path())?.killed;
            }
        }
    }
    let procs = dir.join("cgroup.procs");
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let pids: Vec<i32> = fs::read_to_string(&procs)
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.trim().parse().ok())
            .collect();
        if pids.is_empty() {
            break;
        }
        for pid in pids {
            if nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::SIGKILL)
                .is_ok()
            {
                killed += 1;
            }
        }
        if Instant::now() > deadline {
            return Err(CgroupError::Unkillable(dir.to_owned()).into());
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    // rmdir can see EBUSY for a moment after the last task exits.
    let deadline = Instant::now() + Duration::from_secs(2);
    loop {
        match fs::remove_dir(dir) {
            Ok(()) => break,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => break,
            // A fake tree (tests) holds regular files; a real cgroupfs directory never does.
            Err(e) if e.raw_os_error() == Some(libc::ENOTEMPTY) && !is_cgroupfs(dir) => {
                fs::remove_dir_all(dir).map_err(|e| Error::io(dir, e))?;
                break;
            }
            Err(e) if Instant::now() < deadline => {
                tracing::debug!(dir = %dir.display(), error = %e, "rmdir of cgroup failed, retrying");
                std::thread::sleep(Duration::from_millis(10));
            }
            Err(e) => return Err(Error::io(dir, e)),
        }
    }
    Ok(Removed {
        path: dir.to_owned(),
        killed,
    })
}

fn is_cgroupfs(path: &Path) -> bool {
    nix::sys::statfs::statfs(path).is_ok_and(|s| limits::is_cgroup_fs(&s))
}

fn host_has_swap() -> bool {
    fs::read_to_string("/proc/swaps")
        .map(|s| s.lines().count() > 1)
        .unwrap_or(false)
}

fn read_u64(path: &Path) -> u64 {
    fs::read_to_string(path)
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(0)
}

/// Reads `key value` lines (memory.oom_control, memory.events, cpu.stat).
fn read_keyed(path: &Path, key: &str) -> u64 {
    fs::read_to_string(path).map_or(0, |s| keyed(&s, key))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(path: &Path, content: &str) {
        fs::create_dir_all(path.parent().unwrap()).unwrap();
        fs::write(path, content).unwrap();
    }

    fn fake_v1() -> tempfile::TempDir {
        let t = tempfile::tempdir().unwrap();
        for h in [
            "memory",
            "pids",
            "cpu,cpuacct",
            "cpuset",
            "freezer",
            "unified",
        ] {
            write(&t.path().join(h).join("cgroup.procs"), "");
        }
        std::os::unix::fs::symlink("cpu,cpuacct", t.path().join("cpu")).unwrap();
        t
    }

    fn fake_v2(controllers: &str) -> tempfile::TempDir {
        let t = tempfile::tempdir().unwrap();
        write(&t.path().join("cgroup.procs"), "");
        write(&t.path().join("cgroup.controllers"), controllers);
        write(&t.path().join("cgroup.subtree_control"), controllers);
        t
    }

    /// Offered by the host but not enabled where the parent is created (a daemon outside a delegating unit): a
    /// refusal at start naming the controllers, the file and the fix, not an I/O error on the parent.
    #[test]
    fn v2_controllers_not_enabled_above_the_parent_fail_closed() {
        let t = fake_v2("cpuset cpu io memory pids");
        write(&t.path().join("cgroup.subtree_control"), "memory pids");
        let cg = Cgroups::with_version(CgroupVersion::V2, t.path(), "sandboxd").unwrap();
        let err = cg.check_controllers().unwrap_err().to_string();
        assert!(
            err.contains("cpu are not enabled")
                && err.contains("cgroup.subtree_control")
                && err.contains("Delegate=yes"),
            "{err}"
        );
        // A nested parent is checked where it is created.
        write(
            &t.path().join("system.slice/cgroup.subtree_control"),
            "cpu memory pids",
        );
        let cg =
            Cgroups::with_version(CgroupVersion::V2, t.path(), "system.slice/sandboxd").unwrap();
        cg.check_controllers().unwrap();
    }

    #[test]
    fn v1_hierarchies_skip_unified_and_symlinks() {
        let t = fake_v1();
        let cg = Cgroups::with_version(CgroupVersion::V1, t.path(), "sandboxd").unwrap();
        let names: Vec<_> = cg
            .hierarchies()
            .iter()
            .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
            .collect();
        assert_eq!(
            names,
            ["cpu,cpuacct", "cpuset", "freezer", "memory", "pids"]
        );
        cg.check_controllers().unwrap();
    }

    #[test]
    fn v1_missing_controller_fails_closed() {
        let t = tempfile::tempdir().unwrap();
        write(&t.path().join("memory/cgroup.procs"), "");
        let cg = Cgroups::with_version(CgroupVersion::V1, t.path(), "sandboxd").unwrap();
        let err = cg.check_controllers().unwrap_err().to_string();
        assert!(err.contains("pids") && err.contains("cpuacct"), "{err}");
    }

    #[test]
    fn v1_usage_reads_peak_cpu_and_oom_kill() {
        let t = fake_v1();
        let cg = Cgroups::with_version(CgroupVersion::V1, t.path(), "sandboxd").unwrap();
        let mem = t.path().join("memory/sandboxd/e1");
        write(&mem.join("memory.max_usage_in_bytes"), "67108864\n");
        write(
            &mem.join("memory.oom_control"),
            "oom_kill_disable 0\nunder_oom 0\noom_kill 1\n",
        );
        write(
            &t.path().join("cpu,cpuacct/sandboxd/e1/cpuacct.usage"),
            "123456789\n",
        );
        assert_eq!(
            cg.usage("e1").unwrap(),
            Usage {
                peak_memory_bytes: 64 << 20,
                cpu_time_ns: 123_456_789,
                oom_kills: 1
            }
        );
        assert_eq!(cg.cgroups_path("e1"), "/sandboxd/e1");
        assert_eq!(cg.cpu_time_ns("e1").unwrap(), 123_456_789);
        assert!(cg.cpu_time_ns("gone").is_err(), "a missing leaf is no zero");
    }

    #[test]
    fn v2_usage_reads_peak_cpu_and_oom_kill() {
        let t = fake_v2("cpuset cpu io memory pids");
        let cg = Cgroups::with_version(CgroupVersion::V2, t.path(), "/sandboxd/").unwrap();
        cg.check_controllers().unwrap();
        let leaf = t.path().join("sandboxd/e2");
        write(&leaf.join("memory.peak"), "1048576\n");
        write(
            &leaf.join("memory.events"),
            "low 0\nhigh 0\nmax 3\noom 1\noom_kill 2\n",
        );
        write(
            &leaf.join("cpu.stat"),
            "usage_usec 2500\nuser_usec 2000\nsystem_usec 500\n",
        );
        assert_eq!(
            cg.usage("e2").unwrap(),
            Usage {
                peak_memory_bytes: 1 << 20,
                cpu_time_ns: 2_500_000,
                oom_kills: 2
            }
        );
        assert_eq!(cg.cpu_time_ns("e2").unwrap(), 2_500_000);
    }

    #[test]
    fn v2_missing_controller_fails_closed() {
        let t = fake_v2("cpu io");
        let cg = Cgroups::with_version(CgroupVersion::V2, t.path(), "sandboxd").unwrap();
        let err = cg.check_controllers().unwrap_err().to_string();
        assert!(err.contains("memory") && err.contains("pids"), "{err}");
    }

    #[test]
    fn v2_parent_delegates_controllers() {
        let t = fake_v2("cpu memory pids");
        let cg = Cgroups::with_version(CgroupVersion::V2, t.path(), "sandboxd").unwrap();
        cg.ensure_parent().unwrap();
        let control = fs::read_to_string(t.path().join("sandboxd/cgroup.subtree_control")).unwrap();
        assert_eq!(control, "+memory +pids +cpu");
    }

    #[test]
    fn v1_set_limits_lowers_memory_before_memsw_and_writes_pids_and_shares() {
        let t = fake_v1();
        let cg = Cgroups::with_version(CgroupVersion::V1, t.path(), "sbx").unwrap();
        let mem = t.path().join("memory/sbx/c1");
        write(&mem.join("memory.limit_in_bytes"), "1073741824");
        write(&mem.join("memory.memsw.limit_in_bytes"), "1073741824");
        write(&t.path().join("pids/sbx/c1/pids.max"), "1024");
        write(&t.path().join("cpu,cpuacct/sbx/c1/cpu.shares"), "1024");
        // No quota, and a period other than the one written (the kernel's default is 100 ms).
        write(&t.path().join("cpu,cpuacct/sbx/c1/cpu.cfs_quota_us"), "-1");
        write(
            &t.path().join("cpu,cpuacct/sbx/c1/cpu.cfs_period_us"),
            "50000",
        );
        let limits = CgroupLimits {
            memory_bytes: 128 << 20,
            pids_max: 64,
            cpu_shares: 512,
            cpu_quota: Some(CpuQuota::from_cores(0.5).unwrap()),
        };
        cg.set_limits("c1", &limits).unwrap();
        let read = |p: PathBuf| fs::read_to_string(p).unwrap();
        assert_eq!(read(mem.join("memory.limit_in_bytes")), "134217728");
        assert_eq!(read(mem.join("memory.memsw.limit_in_bytes")), "134217728");
        assert_eq!(read(t.path().join("pids/sbx/c1/pids.max")), "64");
        let cpu = t.path().join("cpu,cpuacct/sbx/c1");
        assert_eq!(read(cpu.join("cpu.shares")), "512");
        assert_eq!(read(cpu.join("cpu.cfs_quota_us")), "50000");
        assert_eq!(read(cpu.join("cpu.cfs_period_us")), "100000");
        // A missing leaf is an error, never a silently unlimited container.
        assert!(cg.set_limits("c2", &limits).is_err());
    }

    #[test]
    fn v2_set_limits_writes_max_no_swap_pids_and_weight() {
        let t = fake_v2("cpu memory pids");
        let cg = Cgroups::with_version(CgroupVersion::V2, t.path(), "sbx").unwrap();
        let leaf = t.path().join("sbx/c1");
        write(&leaf.join("memory.max"), "max");
        write(&leaf.join("memory.swap.max"), "max");
        // The kernel's default in a new cgroup; cgroups-rs reads it before writing both values.
        write(&leaf.join("cpu.max"), "max 100000\n");
        let mut limits = CgroupLimits {
            memory_bytes: 64 << 20,
            pids_max: 32,
            cpu_shares: 1024,
            cpu_quota: Some(CpuQuota::from_cores(0.5).unwrap()),
        };
        cg.set_limits("c1", &limits).unwrap();
        let read = |n: &str| fs::read_to_string(leaf.join(n)).unwrap();
        assert_eq!(read("memory.max"), "67108864");
        assert_eq!(read("memory.swap.max"), "0");
        assert_eq!(read("pids.max"), "32");
        assert_eq!(read("cpu.weight"), "39");
        assert_eq!(read("cpu.max"), "50000 100000");
        // No quota asked for: the leaf's stays as it is.
        limits.cpu_quota = None;
        cg.set_limits("c1", &limits).unwrap();
        assert_eq!(read("cpu.max"), "50000 100000");
        // A cpu controller that cannot take a quota fails the limits (closed), it is not skipped.
        fs::remove_file(leaf.join("cpu.max")).unwrap();
        limits.cpu_quota = Some(CpuQuota::from_cores(1.0).unwrap());
        let err = cg.set_limits("c1", &limits).unwrap_err().to_string();
        assert!(err.contains("cpu quota"), "{err}");
        assert_eq!(shares_to_weight(2), 1);
        assert_eq!(shares_to_weight(262_144), 10_000);
    }

    const LIMITS: CgroupLimits = CgroupLimits {
        memory_bytes: 64 << 20,
        pids_max: 32,
        cpu_shares: 1024,
        cpu_quota: None,
    };

    #[test]
    fn v1_direct_leaves_are_the_limited_hierarchies_only() {
        let t = fake_v1();
        let cg = Cgroups::with_version(CgroupVersion::V1, t.path(), "sbx").unwrap();
        cg.ensure_parent().unwrap();
        cg.create_leaf("c1", &LIMITS).unwrap();
        for h in ["memory", "pids", "cpu,cpuacct", "freezer"] {
            assert!(t.path().join(h).join("sbx/c1").is_dir(), "{h}");
        }
        assert!(
            !t.path().join("cpuset/sbx/c1").exists(),
            "cpuset is not sandboxd's"
        );
        assert_eq!(
            fs::read_to_string(t.path().join("pids/sbx/c1/pids.max")).unwrap(),
            "32"
        );
        cg.attach("c1", 4242).unwrap();
        for h in ["memory", "pids", "cpu,cpuacct", "freezer"] {
            let procs = t.path().join(h).join("sbx/c1/cgroup.procs");
            assert_eq!(fs::read_to_string(procs).unwrap(), "4242", "{h}");
        }
        // The id is fresh: a leaf that exists already is somebody else's.
        assert!(cg.create_leaf("c1", &LIMITS).is_err());
        fs::remove_dir_all(t.path().join("pids")).unwrap();
        let cg = Cgroups::with_version(CgroupVersion::V1, t.path(), "sbx").unwrap();
        assert!(cg.create_leaf("c2", &LIMITS).is_err(), "no pids hierarchy");
    }

    #[test]
    fn v2_direct_leaf_is_one_directory() {
        let t = fake_v2("cpu memory pids");
        let cg = Cgroups::with_version(CgroupVersion::V2, t.path(), "sbx").unwrap();
        fs::create_dir(t.path().join("sbx")).unwrap();
        cg.create_leaf("c1", &LIMITS).unwrap();
        assert_eq!(cg.joined_leaves("c1").unwrap(), [t.path().join("sbx/c1")]);
        assert_eq!(
            fs::read_to_string(t.path().join("sbx/c1/memory.max")).unwrap(),
            "67108864"
        );
        cg.attach("c1", 4242).unwrap();
        assert_eq!(
            fs::read_to_string(t.path().join("sbx/c1/cgroup.procs")).unwrap(),
            "4242"
        );
    }

    #[test]
    fn usage_of_missing_leaf_is_an_error() {
        let t = fake_v2("cpu memory pids");
        let cg = Cgroups::with_version(CgroupVersion::V2, t.path(), "sandboxd").unwrap();
        assert!(cg.usage("nope").is_err());
    }

    #[test]
    fn leftovers_are_found_and_removed_only_under_the_parent() {
        let t = fake_v1();
        let cg = Cgroups::with_version(CgroupVersion::V1, t.path(), "sandboxd").unwrap();
        write(&t.path().join("memory/sandboxd/old1/cgroup.procs"), "");
        write(&t.path().join("pids/sandboxd/old1/cgroup.procs"), "");
        write(&t.path().join("memory/someone-else/cgroup.procs"), "");
        write(&t.path().join("memory/sandboxd/kept/cgroup.procs"), "");
        assert_eq!(cg.leftovers().len(), 3);
        let removed = cg.remove_leftovers_except(&["kept".to_owned()]);
        assert_eq!(removed.len(), 2);
        assert!(removed
            .iter()
            .all(|r| r.as_ref().is_ok_and(|r| r.killed == 0)));
        assert_eq!(cg.leftovers(), vec![t.path().join("memory/sandboxd/kept")]);
        cg.remove_leftovers();
        assert!(cg.leftovers().is_empty());
        assert!(t.path().join("memory/someone-else").exists());
    }

    #[test]
    fn parent_must_be_a_plain_relative_path() {
        let t = fake_v1();
        for bad in ["", "/", "a/../b", "a//b"] {
            assert!(
                Cgroups::with_version(CgroupVersion::V1, t.path(), bad).is_err(),
                "{bad}"
            );
        }
    }

    #[test]
    fn v2_freeze_writes_cgroup_freeze_and_waits_for_events() {
        let t = fake_v2("cpu memory pids");
        let cg = Cgroups::with_version(CgroupVersion::V2, t.path(), "sandboxd").unwrap();
        let leaf = t.path().join("sandboxd/c1");
        write(&leaf.join("cgroup.events"), "populated 1\nfrozen 1\n");
        cg.freeze("c1").unwrap();
        assert_eq!(fs::read_to_string(leaf.join("cgroup.freeze")).unwrap(), "1");
        assert!(cg.frozen("c1").unwrap());
        // The kernel has not reported the thaw yet: a short wait gives up with an error.
        let err = cg
            .set_frozen("c1", false, Duration::from_millis(20))
            .unwrap_err()
            .to_string();
        assert!(err.contains("not thawed"), "{err}");
        assert_eq!(fs::read_to_string(leaf.join("cgroup.freeze")).unwrap(), "0");
        write(&leaf.join("cgroup.events"), "populated 1\nfrozen 0\n");
        cg.thaw("c1").unwrap();
        assert!(!cg.frozen("c1").unwrap());
        assert!(cg.freeze("missing").is_err());
    }

    #[test]
    fn v2_cpu_quota_and_current_memory() {
        let t = fake_v2("cpu memory pids");
        let cg = Cgroups::with_version(CgroupVersion::V2, t.path(), "sandboxd").unwrap();
        let leaf = t.path().join("sandboxd/c1");
        write(&leaf.join("memory.current"), "2097152\n");
        // The kernel's default in a new cgroup; cgroups-rs reads it before writing both values.
        write(&leaf.join("cpu.max"), "max 100000\n");
        cg.set_cpu_quota("c1", 1.5).unwrap();
        assert_eq!(
            fs::read_to_string(leaf.join("cpu.max")).unwrap(),
            "150000 100000"
        );
        assert_eq!(cg.memory_current("c1").unwrap(), 2 << 20);
        assert!(cg.set_cpu_quota("c1", 0.0).is_err());
        assert!(cg.set_cpu_quota("c1", f64::NAN).is_err());
        // Under the kernel's 1 ms per period is refused, not raised to it.
        assert!(cg.set_cpu_quota("c1", 0.009).is_err());
        assert_eq!(CpuQuota::from_cores(0.01).unwrap().quota_us(), 1000);
        assert_eq!(CpuQuota::from_cores(0.333_333).unwrap().quota_us(), 33_333);
    }

    #[test]
    fn v1_cpu_quota_goes_to_the_cpu_hierarchy() {
        let t = fake_v1();
        let cg = Cgroups::with_version(CgroupVersion::V1, t.path(), "sandboxd").unwrap();
        let leaf = t.path().join("cpu,cpuacct/sandboxd/c1");
        fs::create_dir_all(&leaf).unwrap();
        cg.set_cpu_quota("c1", 0.5).unwrap();
        assert_eq!(
            fs::read_to_string(leaf.join("cpu.cfs_quota_us")).unwrap(),
            "50000"
        );
        assert_eq!(
            fs::read_to_string(leaf.join("cpu.cfs_period_us")).unwrap(),
            "100000"
        );
    }

    /// cgroups-rs gets exactly the directories of the controllers sandboxd uses, under the given root: co-mounted
    /// `cpu,cpuacct` once, a separate `cpuacct` hierarchy on its own, never `cpuset` or the hybrid `unified`.
    #[test]
    fn cgroups_rs_works_in_our_directories_only() {
        let paths = |cg: &Cgroups| -> Vec<PathBuf> {
            let c = cg.cgroup("c1");
            c.subsystems()
                .iter()
                .map(|s| s.to_controller().path().to_owned())
                .collect()
        };
        let t = fake_v1();
        let cg = Cgroups::with_version(CgroupVersion::V1, t.path(), "sbx").unwrap();
        let want: Vec<PathBuf> = ["memory", "pids", "cpu,cpuacct", "freezer"]
            .iter()
            .map(|h| t.path().join(h).join("sbx/c1"))
            .collect();
        assert_eq!(paths(&cg), want);
        assert_eq!(cg.joined_leaves("c1").unwrap(), want);

        let t = tempfile::tempdir().unwrap();
        for h in ["memory", "pids", "cpu", "cpuacct"] {
            write(&t.path().join(h).join("cgroup.procs"), "");
        }
        let cg = Cgroups::with_version(CgroupVersion::V1, t.path(), "sbx").unwrap();
        let want: Vec<PathBuf> = ["memory", "pids", "cpu", "cpuacct"]
            .iter()
            .map(|h| t.path().join(h).join("sbx/c1"))
            .collect();
        assert_eq!(paths(&cg), want);
        assert!(cg.freeze("c1").is_err(), "no freezer hierarchy");

        let t = fake_v2("cpu memory pids");
        let cg = Cgroups::with_version(CgroupVersion::V2, t.path(), "sbx").unwrap();
        assert!(paths(&cg).iter().all(|p| *p == t.path().join("sbx/c1")));
    }

    #[test]
    fn v1_freeze_and_thaw_write_and_read_freezer_state() {
        let t = fake_v1();
        let cg = Cgroups::with_version(CgroupVersion::V1, t.path(), "sbx").unwrap();
        let state = t.path().join("freezer/sbx/c1/freezer.state");
        write(&state, "THAWED\n");
        assert!(!cg.frozen("c1").unwrap());
        cg.freeze("c1").unwrap();
        assert_eq!(fs::read_to_string(&state).unwrap(), "FROZEN");
        assert!(cg.frozen("c1").unwrap());
        cg.thaw("c1").unwrap();
        assert_eq!(fs::read_to_string(&state).unwrap(), "THAWED");
        // A state the freezer does not know is an error, not "thawed".
        write(&state, "MELTED\n");
        assert!(cg.frozen("c1").is_err());
    }

    #[test]
    fn limits_that_do_not_fit_are_refused_before_any_write() {
        let t = fake_v2("cpu memory pids");
        let cg = Cgroups::with_version(CgroupVersion::V2, t.path(), "sbx").unwrap();
        let leaf = t.path().join("sbx/c1");
        fs::create_dir_all(&leaf).unwrap();
        let huge = CgroupLimits {
            memory_bytes: u64::MAX,
            ..LIMITS
        };
        let err = cg.set_limits("c1", &huge).unwrap_err().to_string();
        assert!(err.contains("memory limit"), "{err}");
        assert!(!leaf.join("memory.max").exists());
        assert!(cg.attach("c1", -1).is_err());
    }

    /// [`LimitFiles`] on a real leaf `c1` with a busy task in it: see the test above.
    fn limit_files_write_and_read(cg: &Cgroups, pids: &Path) {
        // Through files opened once (a pooled container's): lowered, raised past where it began and lowered
        // again, which the kernel refuses when the v1 memory and memory+swap writes come in the wrong order;
        // the usage read again through the same descriptor moves on.
        let files = cg.limit_files("c1").unwrap();
        let memory = cg.leaf("memory", "c1").unwrap();
        let limit = if cg.version == CgroupVersion::V1 {
            "memory.limit_in_bytes"
        } else {
            "memory.max"
        };
        for (mb, max) in [(32u64, 16u64), (256, 64), (48, 8)] {
            files
                .set(&CgroupLimits {
                    memory_bytes: mb << 20,
                    pids_max: max,
                    cpu_quota: Some(CpuQuota::from_cores(1.5).unwrap()),
                    ..LIMITS
                })
                .unwrap();
            let read = |p: PathBuf| fs::read_to_string(p).unwrap().trim().to_owned();
            assert_eq!(read(memory.join(limit)), (mb << 20).to_string());
            assert_eq!(read(pids.join("pids.max")), max.to_string());
        }
        let cpu = cg.leaf("cpu", "c1").unwrap();
        let read = |p: PathBuf| fs::read_to_string(p).unwrap().trim().to_owned();
        match cg.version {
            CgroupVersion::V1 => {
                assert_eq!(read(cpu.join("cpu.cfs_quota_us")), "150000");
                assert_eq!(read(cpu.join("cpu.cfs_period_us")), "100000");
                assert_eq!(read(cpu.join("cpu.shares")), "1024");
            }
            CgroupVersion::V2 => {
                assert_eq!(read(cpu.join("cpu.max")), "150000 100000");
                assert_eq!(read(cpu.join("cpu.weight")), "39");
            }
        }
        let first = files.cpu_time_ns().unwrap();
        std::thread::sleep(Duration::from_millis(50));
        assert!(
            files.cpu_time_ns().unwrap() > first,
            "the usage did not move"
        );
        let through_files = files.usage().unwrap();
        let through_paths = cg.usage("c1").unwrap();
        assert!(through_files.cpu_time_ns <= through_paths.cpu_time_ns);
        assert_eq!(
            through_files.peak_memory_bytes,
            through_paths.peak_memory_bytes
        );
        assert_eq!(through_files.oom_kills, through_paths.oom_kills);
        assert_eq!(
            files.memory_current().unwrap(),
            cg.memory_current("c1").unwrap()
        );
    }

    /// A real leaf on the host's own hierarchy (v1 or v2, as detected): the parent and the leaf are created with
    /// their limits, a busy child moved in, frozen (its cpu time stops) and thawed, its usage read, and the leaf
    /// and the parent removed with the child still in it. On v2 this is the unified tree `sandboxd` runs on in
    /// production (tests/vm runs it there); on a v1 host the hierarchies of the controllers sandboxd uses.
    #[test]
    fn a_real_leaf_is_limited_frozen_thawed_and_removed() {
        let root = Path::new(DEFAULT_ROOT);
        if !test_support::is_root() {
            test_support::cannot_run(
                "a_real_leaf_is_limited_frozen_thawed_and_removed",
                "needs root",
            );
            return;
        }
        let parent = format!("sandboxd-test-leaf-{}", std::process::id());
        let cg = Cgroups::detect(root, &parent).unwrap();
        cg.check_controllers().unwrap();
        if cg.controllers.dir("freezer").is_none() {
            test_support::cannot_run(
                "a_real_leaf_is_limited_frozen_thawed_and_removed",
                "the host has no freezer (v1 without a freezer hierarchy)",
            );
            return;
        }
        cg.ensure_parent().unwrap();
        let mut child = std::process::Command::new("/bin/sh")
            .args(["-c", "while :; do :; done"])
            .spawn()
            .unwrap();
        let pid = child.id();
        let ticks = || -> u64 {
            let stat = fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
            let after = &stat[stat.rfind(')').unwrap() + 2..];
            let f: Vec<&str> = after.split_whitespace().collect();
            f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap()
        };
        let outcome = std::panic::catch_unwind(|| {
            cg.create_leaf("c1", &LIMITS).unwrap();
            cg.attach("c1", pid as i32).unwrap();
            let pids = cg.leaf("pids", "c1").unwrap();
            assert_eq!(
                fs::read_to_string(pids.join("pids.max")).unwrap().trim(),
                "32"
            );
            let procs = fs::read_to_string(pids.join("cgroup.procs")).unwrap();
            assert_eq!(procs.trim(), pid.to_string());
            assert!(!cg.frozen("c1").unwrap());
            cg.freeze("c1").unwrap();
            assert!(cg.frozen("c1").unwrap());
            let before = ticks();
            std::thread::sleep(Duration::from_millis(300));
            assert_eq!(ticks(), before, "a frozen task ran");
            cg.thaw("c1").unwrap();
            assert!(!cg.frozen("c1").unwrap());
            let before = ticks();
            std::thread::sleep(Duration::from_millis(300));
            assert!(ticks() > before, "a thawed task did not run");
            // The busy loop charges cpu time to the leaf (its memory was charged before the move).
            let usage = cg.usage("c1").unwrap();
            assert!(usage.cpu_time_ns > 0, "{usage:?}");
            limit_files_write_and_read(&cg, &pids);
            // A frozen leaf with a live task in it is removed too (the task is killed).
            cg.freeze("c1").unwrap();
            cg.remove_leaf("c1").unwrap();
        });
        // A frozen child would never be reaped.
        let _ = cg.thaw("c1");
        let _ = child.kill();
        let _ = child.wait();
        let removed = cg.remove_parent();
        let left: Vec<_> = cg
            .hierarchies()
            .iter()
            .map(|h| h.join(&parent))
            .filter(|d| d.exists())
            .collect();
        if let Err(p) = outcome {
            std::panic::resume_unwind(p);
        }
        removed.unwrap();
        assert!(left.is_empty(), "left behind: {left:?}");
    }
}

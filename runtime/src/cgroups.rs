//! Cgroups: which hierarchy the host runs, the daemon-owned parent cgroup, per-execution usage and leftovers.
//!
//! libcontainer creates each execution's leaf (`<parent>/<id>`) and writes its limits. This module owns what
//! libcontainer does not: checking that every controller sandboxd needs is there (fail closed), creating and
//! removing the parent, reading peak memory / cpu time / OOM kills before the leaf goes away, and removing what a
//! crashed daemon left under its parent. Every function takes the cgroupfs root as a parameter so it is tested
//! against a fake tree in a tempdir; nothing here touches a cgroup outside `<root>/<hierarchy>/<parent>`.

use std::fs;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::error::{Error, Result};

pub use crate::error::CgroupError;

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

/// Resource usage of one execution, read from its cgroup after the program ended and before the cgroup is removed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Usage {
    /// High-water mark of memory charged to the cgroup, bytes.
    pub peak_memory_bytes: u64,
    /// CPU time of every process of the cgroup, nanoseconds.
    pub cpu_time_ns: u64,
    /// How many processes the kernel OOM killer killed in this cgroup.
    pub oom_kills: u64,
}

/// A cgroup directory removed during leftover cleanup, and how many processes had to be killed in it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Removed {
    /// The directory removed.
    pub path: PathBuf,
    /// Processes found in it and killed.
    pub killed: usize,
}

/// The limits [`Cgroups::set_limits`] writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CgroupLimits {
    /// Memory limit, and memory+swap limit (no swap), bytes.
    pub memory_bytes: u64,
    /// Maximum number of processes and threads.
    pub pids_max: u64,
    /// v1 `cpu.shares` (converted to `cpu.weight` on v2 as runc and libcgroups do).
    pub cpu_shares: u64,
}

/// The cgroup v2 `cpu.weight` for v1 `cpu.shares` (`[2, 262144]` onto `[1, 10000]`, runc's formula).
pub fn shares_to_weight(shares: u64) -> u64 {
    let shares = shares.clamp(2, 262_144);
    1 + ((shares - 2) * 9999) / 262_142
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
    hierarchies: std::sync::Arc<[PathBuf]>,
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
        Ok(Self {
            version,
            root: root.to_owned(),
            parent,
            hierarchies: scan_hierarchies(version, root).into(),
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

    /// The v1 hierarchy that carries a controller (`cpu,cpuacct` counts for both).
    fn v1_hierarchy(&self, controller: &str) -> Option<PathBuf> {
        self.hierarchies()
            .iter()
            .find(|h| {
                h.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.split(',').any(|c| c == controller))
            })
            .cloned()
    }

    /// Fails closed when a controller sandboxd needs is missing, naming it and what to do.
    pub fn check_controllers(&self) -> Result<()> {
        match self.version {
            CgroupVersion::V1 => {
                let missing: Vec<_> = V1_REQUIRED
                    .iter()
                    .filter(|c| self.v1_hierarchy(c).is_none())
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
                let memory = self.v1_hierarchy("memory").unwrap_or_default();
                if host_has_swap() && !memory.join("memory.memsw.limit_in_bytes").exists() {
                    return Err(CgroupError::NoSwapAccounting.into());
                }
                Ok(())
            }
            CgroupVersion::V2 => {
                let path = self.root.join("cgroup.controllers");
                let have = fs::read_to_string(&path).map_err(|e| Error::io(&path, e))?;
                let missing: Vec<_> = V2_REQUIRED
                    .iter()
                    .filter(|c| !have.split_whitespace().any(|h| h == **c))
                    .copied()
                    .collect();
                if missing.is_empty() {
                    Ok(())
                } else {
                    Err(CgroupError::V2ControllersMissing {
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
            CgroupVersion::V2 => self.root.clone(),
            CgroupVersion::V1 => self.v1_hierarchy(controller)?,
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

    /// Reads an execution's usage. Missing files read as zero (a kernel without `memory.peak`, say) but a leaf that
    /// does not exist is an error: the usage would be made up.
    pub fn usage(&self, id: &str) -> Result<Usage> {
        let memory = self.existing_leaf("memory", id, "usage accounting")?;
        match self.version {
            CgroupVersion::V1 => {
                let cpu = self.leaf("cpuacct", id).ok_or(CgroupError::NoHierarchy {
                    controller: "cpuacct",
                    needed_for: "usage accounting",
                })?;
                Ok(Usage {
                    peak_memory_bytes: read_u64(&memory.join("memory.max_usage_in_bytes")),
                    cpu_time_ns: read_u64(&cpu.join("cpuacct.usage")),
                    oom_kills: read_keyed(&memory.join("memory.oom_control"), "oom_kill"),
                })
            }
            CgroupVersion::V2 => Ok(Usage {
                peak_memory_bytes: read_u64(&memory.join("memory.peak")),
                cpu_time_ns: read_keyed(&memory.join("cpu.stat"), "usage_usec")
                    .saturating_mul(1000),
                oom_kills: read_keyed(&memory.join("memory.events"), "oom_kill"),
            }),
        }
    }

    /// Sets the limits of a live container's cgroup: memory (and memory+swap, so no swap), pids and cpu weight.
    ///
    /// A container created ahead of time gets the request's limits here, before its program is launched. Written
    /// by hand rather than through libcgroups' `apply`, which rewrites every controller (device rules included) and
    /// costs more than the execution it prepares. On v1 the memory and memory+swap limits are written in the order
    /// that keeps `limit <= memsw` at every step. Fails (closed) when a file is missing or refuses the value, e.g.
    /// a memory limit below what the cgroup already uses.
    pub fn set_limits(&self, id: &str, limits: &CgroupLimits) -> Result<()> {
        let leaf = |controller: &'static str| {
            self.leaf(controller, id)
                .filter(|p| p.is_dir())
                .ok_or_else(|| CgroupError::NoLeaf {
                    controller,
                    id: id.to_owned(),
                })
        };
        let write = |path: PathBuf, value: String| match fs::write(&path, &value) {
            Ok(()) => Ok(()),
            Err(source) => Err(CgroupError::Write {
                path,
                value,
                source,
            }),
        };
        let memory = leaf("memory")?;
        match self.version {
            CgroupVersion::V1 => {
                let limit = memory.join("memory.limit_in_bytes");
                let memsw = memory.join("memory.memsw.limit_in_bytes");
                let value = limits.memory_bytes.to_string();
                if memsw.exists() {
                    // Lowering: the memory limit first; raising: memory+swap first.
                    if limits.memory_bytes < read_u64(&limit) {
                        write(limit, value.clone())?;
                        write(memsw, value)?;
                    } else {
                        write(memsw, value.clone())?;
                        write(limit, value)?;
                    }
                } else {
                    write(limit, value)?;
                }
                write(leaf("pids")?.join("pids.max"), limits.pids_max.to_string())?;
                write(
                    leaf("cpu")?.join("cpu.shares"),
                    limits.cpu_shares.to_string(),
                )?;
            }
            CgroupVersion::V2 => {
                write(memory.join("memory.max"), limits.memory_bytes.to_string())?;
                let swap = memory.join("memory.swap.max");
                if swap.exists() {
                    write(swap, "0".into())?;
                }
                write(memory.join("pids.max"), limits.pids_max.to_string())?;
                write(
                    memory.join("cpu.weight"),
                    shares_to_weight(limits.cpu_shares).to_string(),
                )?;
            }
        }
        Ok(())
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
        self.leftovers()
            .into_iter()
            .map(|dir| remove_tree(&dir))
            .collect()
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
        match self.version {
            CgroupVersion::V1 => {
                let state = self.freezer_file(id, "freezer.state")?;
                let s = fs::read_to_string(&state).map_err(|e| Error::io(&state, e))?;
                Ok(s.trim() == "FROZEN")
            }
            CgroupVersion::V2 => {
                let events = self.freezer_file(id, "cgroup.events")?;
                let s = fs::read_to_string(&events).map_err(|e| Error::io(&events, e))?;
                Ok(s.lines().any(|l| l.trim() == "frozen 1"))
            }
        }
    }

    fn freezer_file(&self, id: &str, file: &str) -> Result<PathBuf> {
        let controller = match self.version {
            CgroupVersion::V1 => "freezer",
            CgroupVersion::V2 => "cgroup",
        };
        Ok(self.existing_leaf(controller, id, "pause")?.join(file))
    }

    fn set_frozen(&self, id: &str, frozen: bool, timeout: Duration) -> Result<()> {
        let (file, value) = match (self.version, frozen) {
            (CgroupVersion::V1, true) => ("freezer.state", "FROZEN"),
            (CgroupVersion::V1, false) => ("freezer.state", "THAWED"),
            (CgroupVersion::V2, true) => ("cgroup.freeze", "1"),
            (CgroupVersion::V2, false) => ("cgroup.freeze", "0"),
        };
        let path = self.freezer_file(id, file)?;
        let deadline = Instant::now() + timeout;
        loop {
            // v1 may stay FREEZING while a task is in an uninterruptible sleep; writing again retries the freeze.
            fs::write(&path, value).map_err(|e| Error::io(&path, e))?;
            if self.frozen(id)? == frozen {
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
        if !(cores.is_finite() && cores > 0.0) {
            return Err(CgroupError::InvalidQuota(cores).into());
        }
        let period: u64 = 100_000;
        let quota = ((cores * period as f64) as u64).max(1000);
        let leaf = self.existing_leaf("cpu", id, "a cpu quota")?;
        let writes: Vec<(PathBuf, String)> = match self.version {
            CgroupVersion::V1 => vec![
                (leaf.join("cpu.cfs_period_us"), period.to_string()),
                (leaf.join("cpu.cfs_quota_us"), quota.to_string()),
            ],
            CgroupVersion::V2 => vec![(leaf.join("cpu.max"), format!("{quota} {period}"))],
        };
        for (p, v) in writes {
            fs::write(&p, v).map_err(|e| Error::io(&p, e))?;
        }
        Ok(())
    }

    /// Memory charged to a container's cgroup now, bytes (v1 `memory.usage_in_bytes`, v2 `memory.current`).
    pub fn memory_current(&self, id: &str) -> Result<u64> {
        let leaf = self.existing_leaf("memory", id, "memory accounting")?;
        Ok(match self.version {
            CgroupVersion::V1 => read_u64(&leaf.join("memory.usage_in_bytes")),
            CgroupVersion::V2 => read_u64(&leaf.join("memory.current")),
        })
    }

    /// The leaf directories of an execution that the direct start ([`crate::direct`]) creates: on v1 one per
    /// hierarchy carrying a controller sandboxd limits, accounts or freezes with (`memory`, `cpu`, `cpuacct`,
    /// `pids`, and `freezer` where mounted; co-mounted controllers share a directory), on v2 the one leaf. The other
    /// v1 hierarchies (blkio, cpuset, devices, ...) are left alone: sandboxd sets nothing in them.
    pub fn joined_leaves(&self, id: &str) -> Result<Vec<PathBuf>> {
        match self.version {
            CgroupVersion::V2 => Ok(vec![self.root.join(&self.parent).join(id)]),
            CgroupVersion::V1 => {
                let mut out: Vec<PathBuf> = Vec::new();
                for controller in V1_REQUIRED.iter().chain(&["freezer"]) {
                    let Some(h) = self.v1_hierarchy(controller) else {
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
        }
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

    /// Moves process `pid` into every leaf of the execution (`cgroup.procs`).
    pub fn attach(&self, id: &str, pid: i32) -> Result<()> {
        let pid = pid.to_string();
        for leaf in self.joined_leaves(id)? {
            let procs = leaf.join("cgroup.procs");
            fs::write(&procs, &pid).map_err(|source| CgroupError::Write {
                path: procs,
                value: pid.clone(),
                source,
            })?;
        }
        Ok(())
    }

    /// Removes one execution's leaf in every hierarchy if it is still there (libcontainer normally does this).
    pub fn remove_leaf(&self, id: &str) -> Result<()> {
        for h in self.hierarchies() {
            let dir = h.join(&self.parent).join(id);
            if dir.exists() {
                remove_tree(&dir)?;
            }
        }
        Ok(())
    }

    /// Removes the (empty) parent in every hierarchy; used at daemon shutdown.
    pub fn remove_parent(&self) -> Result<()> {
        for h in self.hierarchies() {
            let dir = h.join(&self.parent);
            if dir.exists() {
                remove_tree(&dir)?;
            }
        }
        Ok(())
    }
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
    nix::sys::statfs::statfs(path)
        .map(|s| {
            s.filesystem_type() == nix::sys::statfs::CGROUP_SUPER_MAGIC
                || s.filesystem_type() == nix::sys::statfs::CGROUP2_SUPER_MAGIC
        })
        .unwrap_or(false)
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
    fs::read_to_string(path)
        .ok()
        .and_then(|s| {
            s.lines().find_map(|l| {
                let mut it = l.split_whitespace();
                (it.next() == Some(key)).then(|| it.next().and_then(|v| v.parse().ok()))?
            })
        })
        .unwrap_or(0)
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
        t
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
        let limits = CgroupLimits {
            memory_bytes: 128 << 20,
            pids_max: 64,
            cpu_shares: 512,
        };
        cg.set_limits("c1", &limits).unwrap();
        let read = |p: PathBuf| fs::read_to_string(p).unwrap();
        assert_eq!(read(mem.join("memory.limit_in_bytes")), "134217728");
        assert_eq!(read(mem.join("memory.memsw.limit_in_bytes")), "134217728");
        assert_eq!(read(t.path().join("pids/sbx/c1/pids.max")), "64");
        assert_eq!(read(t.path().join("cpu,cpuacct/sbx/c1/cpu.shares")), "512");
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
        cg.set_limits(
            "c1",
            &CgroupLimits {
                memory_bytes: 64 << 20,
                pids_max: 32,
                cpu_shares: 1024,
            },
        )
        .unwrap();
        let read = |n: &str| fs::read_to_string(leaf.join(n)).unwrap();
        assert_eq!(read("memory.max"), "67108864");
        assert_eq!(read("memory.swap.max"), "0");
        assert_eq!(read("pids.max"), "32");
        assert_eq!(read("cpu.weight"), "39");
        assert_eq!(shares_to_weight(2), 1);
        assert_eq!(shares_to_weight(262_144), 10_000);
    }

    const LIMITS: CgroupLimits = CgroupLimits {
        memory_bytes: 64 << 20,
        pids_max: 32,
        cpu_shares: 1024,
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
        assert_eq!(cg.leftovers().len(), 2);
        let removed = cg.remove_leftovers();
        assert_eq!(removed.len(), 2);
        assert!(removed
            .iter()
            .all(|r| r.as_ref().is_ok_and(|r| r.killed == 0)));
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
        cg.set_cpu_quota("c1", 1.5).unwrap();
        assert_eq!(
            fs::read_to_string(leaf.join("cpu.max")).unwrap(),
            "150000 100000"
        );
        assert_eq!(cg.memory_current("c1").unwrap(), 2 << 20);
        assert!(cg.set_cpu_quota("c1", 0.0).is_err());
        assert!(cg.set_cpu_quota("c1", f64::NAN).is_err());
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

    /// A real v1 freezer: a busy child in a cgroup of our own is frozen (its cpu time stops) and thawed again.
    #[test]
    fn v1_freeze_for_real() {
        let root = Path::new(DEFAULT_ROOT);
        if !test_support::is_root() || !root.join("freezer/cgroup.procs").exists() {
            test_support::cannot_run(
                "v1_freeze_for_real",
                "needs root and a cgroup v1 freezer hierarchy",
            );
            return;
        }
        let parent = format!("sandboxd-test-freeze-{}", std::process::id());
        let cg = Cgroups::with_version(CgroupVersion::V1, root, &parent).unwrap();
        let leaf = root.join("freezer").join(&parent).join("c1");
        fs::create_dir_all(&leaf).unwrap();
        let mut child = std::process::Command::new("/bin/sh")
            .args(["-c", "while :; do :; done"])
            .spawn()
            .unwrap();
        let pid = child.id();
        fs::write(leaf.join("cgroup.procs"), pid.to_string()).unwrap();
        let ticks = || -> u64 {
            let stat = fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
            let after = &stat[stat.rfind(')').unwrap() + 2..];
            let f: Vec<&str> = after.split_whitespace().collect();
            f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap()
        };
        let outcome = std::panic::catch_unwind(|| {
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
        });
        let _ = child.kill();
        let _ = child.wait();
        let _ = cg.remove_parent();
        assert!(!root.join("freezer").join(&parent).exists());
        if let Err(p) = outcome {
            std::panic::resume_unwind(p);
        }
    }
}

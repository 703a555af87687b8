//! A container's limit files, opened once.
//!
//! A pooled container gets the request's limits right before its program is launched, on the path of every
//! execution. Through paths, that is a path walk, an open and a close per file (cgroups-rs also checks that each
//! controller's directory exists, and reads the cpu quota's file before it writes it): 26 system calls and
//! 200-300 µs on a 2-core machine. [`LimitFiles`] opens the files when the container is made, off that path, and
//! writes the limits as one `pwrite` per file; the cpu time, read right before the launch, is one `pread`, and
//! the usage read at the end three.
//!
//! Written by hand: cgroups-rs's controllers open their file on each call, and libcgroups writes whole resource
//! sets. The values are the ones cgroups-rs wrote, and the v1 memory and memory+swap limits keep their order; what
//! does not depend on the request (v2 no swap, the v1 quota's period) is written once, when the files are opened.
//! [`super::Cgroups::set_limits`] is the same code: the files opened, the limits written once.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use crate::error::{CgroupError, Error, Result};

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

/// The limits [`super::Cgroups::set_limits`] writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CgroupLimits {
    /// Memory limit, and memory+swap limit (no swap), bytes.
    pub memory_bytes: u64,
    /// Maximum number of processes and threads.
    pub pids_max: u64,
    /// v1 `cpu.shares` (converted to `cpu.weight` on v2 as runc and libcgroups do).
    pub cpu_shares: u64,
    /// Hard CPU limit; `None` leaves the leaf's quota as it is (none in a new leaf).
    pub cpu_quota: Option<CpuQuota>,
}

/// The CFS period every quota is written with: 100 ms, the kernel's default.
pub const CPU_PERIOD_US: u64 = 100_000;

/// A hard CPU limit: `quota_us` of CPU time in every [`CPU_PERIOD_US`] (v1 `cpu.cfs_quota_us` and
/// `cpu.cfs_period_us`, v2 `cpu.max`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CpuQuota {
    quota_us: u64,
}

impl CpuQuota {
    /// The quota of `cores` (e.g. 0.5: 50 ms per 100 ms), rounded to the microsecond. Refuses anything under the
    /// kernel's smallest quota, 1 ms per period (0.01 cores), rather than raising it.
    pub fn from_cores(cores: f64) -> Result<Self, CgroupError> {
        let quota = (cores * CPU_PERIOD_US as f64).round();
        if !(quota.is_finite() && (1000.0..=i64::MAX as f64).contains(&quota)) {
            return Err(CgroupError::InvalidQuota(cores));
        }
        Ok(Self {
            quota_us: quota as u64,
        })
    }

    /// Microseconds of CPU time per [`CPU_PERIOD_US`].
    pub fn quota_us(self) -> u64 {
        self.quota_us
    }
}

/// The cgroup v2 `cpu.weight` for v1 `cpu.shares` (`[2, 262144]` onto `[1, 10000]`, runc's formula).
pub fn shares_to_weight(shares: u64) -> u64 {
    let shares = shares.clamp(2, 262_144);
    1 + ((shares - 2) * 9999) / 262_142
}

/// A limit as cgroups-rs takes it (`i64`).
pub(super) fn to_i64(what: &'static str, value: u64) -> Result<i64, CgroupError> {
    i64::try_from(value).map_err(|_| CgroupError::InvalidLimit { what, value })
}

/// The value of `key` in `key value` lines, 0 when it is absent.
pub(super) fn keyed(text: &str, key: &str) -> u64 {
    text.lines()
        .find_map(|l| {
            let mut it = l.split_whitespace();
            (it.next() == Some(key)).then(|| it.next().and_then(|v| v.parse().ok()))?
        })
        .unwrap_or(0)
}

/// The files a leaf's usage is read from, one set per hierarchy kind (shared by [`LimitFiles`] and the path-based
/// reads of [`super::Cgroups`]).
pub(super) struct UsageNames {
    /// The cpu time (v1 in the `cpuacct` hierarchy, read with [`cpu_time_ns`]).
    pub cpu: &'static str,
    /// The memory charged now.
    pub current: &'static str,
    /// The memory's high-water mark (absent on v2 before Linux 5.19).
    pub peak: &'static str,
    /// The OOM kills (its `oom_kill` line).
    pub oom: &'static str,
}

/// The usage files of a v1 (`false`) or v2 (`true`) leaf.
pub(super) const fn usage_names(v2: bool) -> UsageNames {
    match v2 {
        false => UsageNames {
            cpu: "cpuacct.usage",
            current: "memory.usage_in_bytes",
            peak: "memory.max_usage_in_bytes",
            oom: "memory.oom_control",
        },
        true => UsageNames {
            cpu: "cpu.stat",
            current: "memory.current",
            peak: "memory.peak",
            oom: "memory.events",
        },
    }
}

/// The cpu time, ns, in the text of [`UsageNames::cpu`] (v1 a number of ns, v2 `usage_usec` among other lines).
pub(super) fn cpu_time_ns(v2: bool, text: &str) -> u64 {
    match v2 {
        false => number(text),
        true => keyed(text, "usage_usec").saturating_mul(1000),
    }
}

/// Whether `statfs` says a cgroup filesystem (v1 or v2).
pub(super) fn is_cgroup_fs(s: &nix::sys::statfs::Statfs) -> bool {
    use nix::sys::statfs::{CGROUP2_SUPER_MAGIC, CGROUP_SUPER_MAGIC};
    s.filesystem_type() == CGROUP_SUPER_MAGIC || s.filesystem_type() == CGROUP2_SUPER_MAGIC
}

/// The leaf directories of a container that [`LimitFiles`] opens files in (v2: one directory for all).
#[derive(Debug)]
pub(super) struct LeafDirs {
    /// The unified hierarchy.
    pub v2: bool,
    pub memory: PathBuf,
    pub pids: PathBuf,
    pub cpu: PathBuf,
    /// Where the cpu usage is read (v1 `cpuacct`, v2 the leaf); `None`: the usage files are not opened.
    pub usage: Option<PathBuf>,
}

/// The open limit and usage files of one container's cgroup.
#[derive(Debug)]
pub struct LimitFiles {
    v2: bool,
    /// v1 `memory.limit_in_bytes`, v2 `memory.max`.
    memory: Limit,
    /// v1 `memory.memsw.limit_in_bytes`, when the kernel accounts swap.
    memsw: Option<Limit>,
    /// The memory limit in force (v1: the order of the two memory writes depends on it).
    memory_now: AtomicU64,
    pids: Limit,
    /// v1 `cpu.shares`, v2 `cpu.weight`.
    cpu_weight: Limit,
    /// v1 `cpu.cfs_quota_us`, v2 `cpu.max`; absent when the controller cannot take a quota (an error once one is
    /// asked for: its path).
    cpu_quota: std::result::Result<Limit, PathBuf>,
    /// The usage files (not opened for a single write of limits).
    usage: Option<UsageFiles>,
}

/// The files [`super::Cgroups::usage`] reads.
#[derive(Debug)]
struct UsageFiles {
    /// v1 `cpuacct.usage`, v2 `cpu.stat`.
    cpu: Reader,
    /// v1 `memory.usage_in_bytes`, v2 `memory.current`.
    current: Reader,
    /// v1 `memory.max_usage_in_bytes`, v2 `memory.peak` (absent before Linux 5.19: read as 0).
    peak: Option<Reader>,
    /// v1 `memory.oom_control`, v2 `memory.events`.
    oom: Option<Reader>,
}

/// A file read again and again from its start.
#[derive(Debug)]
struct Reader {
    file: File,
    path: PathBuf,
}

impl Reader {
    fn open(path: PathBuf) -> Result<Self> {
        match File::open(&path) {
            Ok(file) => Ok(Self { file, path }),
            Err(e) => Err(Error::io(&path, e)),
        }
    }

    /// Opens `path` when it exists.
    fn optional(path: PathBuf) -> Result<Option<Self>> {
        match path.exists() {
            true => Self::open(path).map(Some),
            false => Ok(None),
        }
    }

    /// The whole content (these files are a few lines: `cpu.stat`, the longest, under 400 bytes); an error once
    /// the cgroup is gone, or when the file fills the buffer (a kernel that writes more would be misread).
    fn read<T>(&self, parse: impl FnOnce(&str) -> T) -> Result<T> {
        let mut buf = [0u8; 4096];
        let n = self
            .file
            .read_at(&mut buf, 0)
            .map_err(|e| Error::io(&self.path, e))?;
        if n == buf.len() {
            let long = std::io::Error::other("longer than 4096 bytes");
            return Err(Error::io(&self.path, long));
        }
        Ok(parse(std::str::from_utf8(&buf[..n]).unwrap_or("")))
    }
}

/// A number alone in a file, 0 when it does not parse.
pub(super) fn number(text: &str) -> u64 {
    text.trim().parse().unwrap_or(0)
}

/// One open file of a cgroup.
#[derive(Debug)]
struct Limit {
    file: File,
    path: PathBuf,
    /// Not a cgroup filesystem (a test's tree of plain files): each write replaces the whole content.
    plain: bool,
}

impl Limit {
    /// Opens a file to write. `create` is for a test's fake tree of plain files, where the kernel's files are
    /// not all made up front; on a cgroup filesystem a missing file cannot be created, and the open fails.
    fn open(path: PathBuf, create: bool) -> Result<Self, CgroupError> {
        let file = OpenOptions::new()
            .write(true)
            .create(create)
            .open(&path)
            .map_err(|source| CgroupError::File {
                what: "the limits",
                path: path.clone(),
                source,
            })?;
        let plain = !is_cgroupfs(&file);
        Ok(Self { file, path, plain })
    }

    /// Opens `path` when it exists.
    fn optional(path: PathBuf) -> Result<Option<Self>, CgroupError> {
        match path.exists() {
            true => Self::open(path, false).map(Some),
            false => Ok(None),
        }
    }

    fn write(&self, what: &'static str, value: &str) -> Result<(), CgroupError> {
        let refused = |source| CgroupError::File {
            what,
            path: self.path.clone(),
            source,
        };
        if self.plain {
            self.file.set_len(0).map_err(refused)?;
        }
        // A cgroup file takes each write whole, at any offset; a short write is a refusal.
        match self.file.write_at(value.as_bytes(), 0) {
            Ok(n) if n == value.len() => Ok(()),
            Ok(_) => Err(refused(std::io::ErrorKind::WriteZero.into())),
            Err(e) => Err(refused(e)),
        }
    }
}

fn is_cgroupfs(file: &File) -> bool {
    nix::sys::statfs::fstatfs(file).is_ok_and(|s| is_cgroup_fs(&s))
}

impl LimitFiles {
    /// Opens the limit files of a container's leaves, and its usage files when `dirs.usage` is given. What does not
    /// depend on a request is written here: no swap (v2 `memory.swap.max` 0, when the kernel has it) and, on v1,
    /// the cpu quota's period.
    pub(super) fn open(dirs: LeafDirs) -> Result<Self> {
        let LeafDirs {
            v2,
            memory,
            pids,
            cpu,
            usage,
        } = dirs;
        let (memory_file, memsw_file) = match v2 {
            false => ("memory.limit_in_bytes", "memory.memsw.limit_in_bytes"),
            true => ("memory.max", "memory.swap.max"),
        };
        let memory_now = read_limit(&memory.join(memory_file));
        let second = Limit::optional(memory.join(memsw_file))?;
        let (memsw, swap) = if v2 { (None, second) } else { (second, None) };
        let (weight, quota) = match v2 {
            false => ("cpu.shares", "cpu.cfs_quota_us"),
            true => ("cpu.weight", "cpu.max"),
        };
        let names = usage_names(v2);
        let usage = match usage {
            None => None,
            Some(dir) => Some(UsageFiles {
                cpu: Reader::open(dir.join(names.cpu))?,
                current: Reader::open(memory.join(names.current))?,
                peak: Reader::optional(memory.join(names.peak))?,
                oom: Reader::optional(memory.join(names.oom))?,
            }),
        };
        let quota = cpu.join(quota);
        let files = Self {
            v2,
            memory: Limit::open(memory.join(memory_file), true)?,
            memsw,
            memory_now: AtomicU64::new(memory_now),
            pids: Limit::open(pids.join("pids.max"), true)?,
            cpu_weight: Limit::open(cpu.join(weight), true)?,
            cpu_quota: match quota.exists() {
                true => Ok(Limit::open(quota, false)?),
                false => Err(quota),
            },
            usage,
        };
        if let Some(swap) = swap {
            swap.write("the memory limits", "0")?;
        }
        if !v2 && files.cpu_quota.is_ok() {
            Limit::open(cpu.join("cpu.cfs_period_us"), true)?
                .write("a cpu quota", &CPU_PERIOD_US.to_string())?;
        }
        Ok(files)
    }

    /// Writes `limits`: memory (and on v1 memory+swap, in the order that keeps `limit <= memsw` at every step),
    /// pids, cpu weight, and the cpu quota when one is given (else the leaf's stays as it is). Fails (closed) when
    /// a file refuses a value, e.g. a memory limit below what the cgroup already uses.
    pub fn set(&self, limits: &CgroupLimits) -> Result<()> {
        let (memory, pids) = checked(limits)?;
        let memory_s = memory.to_string();
        let now = self.memory_now.load(Ordering::Relaxed);
        let what = "the memory limits";
        match &self.memsw {
            None => self.memory.write(what, &memory_s)?,
            // Lowering: the memory limit first; raising: memory+swap first.
            Some(memsw) if limits.memory_bytes < now => {
                self.memory.write(what, &memory_s)?;
                memsw.write(what, &memory_s)?;
            }
            Some(memsw) => {
                memsw.write(what, &memory_s)?;
                self.memory.write(what, &memory_s)?;
            }
        }
        self.memory_now
            .store(limits.memory_bytes, Ordering::Relaxed);
        self.pids.write("the pids limit", &pids.to_string())?;
        let weight = match self.v2 {
            false => limits.cpu_shares,
            true => shares_to_weight(limits.cpu_shares),
        };
        self.cpu_weight
            .write("the cpu weight", &weight.to_string())?;
        if let Some(quota) = limits.cpu_quota {
            let quota_us = to_i64("cpu quota", quota.quota_us)?;
            let file = self.cpu_quota.as_ref().map_err(|path| CgroupError::File {
                what: "a cpu quota",
                path: path.clone(),
                source: std::io::ErrorKind::NotFound.into(),
            })?;
            let value = match self.v2 {
                false => quota_us.to_string(),
                true => format!("{quota_us} {CPU_PERIOD_US}"),
            };
            file.write("a cpu quota", &value)?;
        }
        Ok(())
    }

    /// The CPU time the cgroup has used so far, ns (as [`super::Cgroups::cpu_time_ns`] reads it).
    pub fn cpu_time_ns(&self) -> Result<u64> {
        let v2 = self.v2;
        self.usage_files()?.cpu.read(|t| cpu_time_ns(v2, t))
    }

    /// The cgroup's usage, as [`super::Cgroups::usage`] reads it: a file the kernel lacks reads as 0, a cgroup removed
    /// since the files were opened is an error.
    pub fn usage(&self) -> Result<Usage> {
        let files = self.usage_files()?;
        let oom = |t: &str| keyed(t, "oom_kill");
        Ok(Usage {
            peak_memory_bytes: files.peak.as_ref().map_or(Ok(0), |r| r.read(number))?,
            cpu_time_ns: self.cpu_time_ns()?,
            oom_kills: files.oom.as_ref().map_or(Ok(0), |r| r.read(oom))?,
        })
    }

    /// Memory charged to the cgroup now, bytes.
    pub fn memory_current(&self) -> Result<u64> {
        self.usage_files()?.current.read(number)
    }

    fn usage_files(&self) -> Result<&UsageFiles, CgroupError> {
        self.usage.as_ref().ok_or(CgroupError::NoHierarchy {
            controller: "cpuacct",
            needed_for: "usage accounting",
        })
    }
}

/// The limits as the files take them, checked before anything is opened or written.
pub(super) fn checked(limits: &CgroupLimits) -> Result<(i64, i64), CgroupError> {
    Ok((
        to_i64("memory limit", limits.memory_bytes)?,
        to_i64("pids limit", limits.pids_max)?,
    ))
}

/// A memory limit file's value; `max` (v2) and what does not parse read as the largest.
fn read_limit(path: &Path) -> u64 {
    std::fs::read_to_string(path)
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(u64::MAX)
}

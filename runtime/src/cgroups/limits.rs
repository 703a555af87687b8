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
//! sets. The values written, their order and the files' absence are handled as [`super::Cgroups::set_limits`]
//! always did, which is now [`LimitFiles::open`] followed by [`LimitFiles::set`].

use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use super::{shares_to_weight, to_i64, CgroupLimits, CgroupVersion, Cgroups, Usage, CPU_PERIOD_US};
use crate::error::{CgroupError, Error, Result};

/// The open limit and usage files of one container's cgroup.
#[derive(Debug)]
pub struct LimitFiles {
    version: CgroupVersion,
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

    /// The whole content (these files are short); an error once the cgroup is gone.
    fn read<T>(&self, parse: impl FnOnce(&str) -> T) -> Result<T> {
        let mut buf = [0u8; 1024];
        let n = self
            .file
            .read_at(&mut buf, 0)
            .map_err(|e| Error::io(&self.path, e))?;
        Ok(parse(std::str::from_utf8(&buf[..n]).unwrap_or("")))
    }
}

/// A number alone in a file, 0 when it does not parse.
fn number(text: &str) -> u64 {
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
    use nix::sys::statfs::{fstatfs, CGROUP2_SUPER_MAGIC, CGROUP_SUPER_MAGIC};
    fstatfs(file).is_ok_and(|s| {
        s.filesystem_type() == CGROUP_SUPER_MAGIC || s.filesystem_type() == CGROUP2_SUPER_MAGIC
    })
}

impl LimitFiles {
    /// Opens the limit and usage files of container `id`'s leaves, which must exist. What does not depend on a
    /// request is written here: no swap (v2 `memory.swap.max` 0, when the kernel has it) and, on v1, the cpu
    /// quota's period.
    pub fn open(cgroups: &Cgroups, id: &str) -> Result<Self> {
        Self::open_with(cgroups, id, true)
    }

    /// [`Self::open`]; the usage files only when `usage`.
    pub(super) fn open_with(cgroups: &Cgroups, id: &str, usage: bool) -> Result<Self> {
        const FOR: &str = "a container's limits";
        let memory = cgroups.existing_leaf("memory", id, FOR)?;
        let pids = cgroups.existing_leaf("pids", id, FOR)?;
        let cpu = cgroups.existing_leaf("cpu", id, FOR)?;
        let v1 = cgroups.version == CgroupVersion::V1;
        let (memory_file, memsw_file) = if v1 {
            ("memory.limit_in_bytes", "memory.memsw.limit_in_bytes")
        } else {
            ("memory.max", "memory.swap.max")
        };
        let memory_now = read_limit(&memory.join(memory_file));
        let second = memory.join(memsw_file);
        let second = match second.exists() {
            false => None,
            true => Some(Limit::open(second, false)?),
        };
        let (memsw, swap) = if v1 { (second, None) } else { (None, second) };
        let memory_limit = Limit::open(memory.join(memory_file), true)?;
        let (weight, quota) = match v1 {
            true => ("cpu.shares", "cpu.cfs_quota_us"),
            false => ("cpu.weight", "cpu.max"),
        };
        let usage = match (usage, v1) {
            (false, _) => None,
            (true, true) => {
                let acct = cgroups.existing_leaf("cpuacct", id, "usage accounting")?;
                Some(UsageFiles {
                    cpu: Reader::open(acct.join("cpuacct.usage"))?,
                    peak: Reader::optional(memory.join("memory.max_usage_in_bytes"))?,
                    oom: Reader::optional(memory.join("memory.oom_control"))?,
                })
            }
            (true, false) => Some(UsageFiles {
                cpu: Reader::open(cpu.join("cpu.stat"))?,
                peak: Reader::optional(memory.join("memory.peak"))?,
                oom: Reader::optional(memory.join("memory.events"))?,
            }),
        };
        let quota = cpu.join(quota);
        let files = Self {
            version: cgroups.version,
            memory: memory_limit,
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
        if v1 && files.cpu_quota.is_ok() {
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
        let weight = match self.version {
            CgroupVersion::V1 => limits.cpu_shares,
            CgroupVersion::V2 => shares_to_weight(limits.cpu_shares),
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
            let value = match self.version {
                CgroupVersion::V1 => quota_us.to_string(),
                CgroupVersion::V2 => format!("{quota_us} {CPU_PERIOD_US}"),
            };
            file.write("a cpu quota", &value)?;
        }
        Ok(())
    }

    /// The CPU time the cgroup has used so far, ns (as [`Cgroups::cpu_time_ns`] reads it).
    pub fn cpu_time_ns(&self) -> Result<u64> {
        let cpu = &self.usage_files()?.cpu;
        match self.version {
            CgroupVersion::V1 => cpu.read(number),
            CgroupVersion::V2 => cpu.read(|t| super::keyed(t, "usage_usec").saturating_mul(1000)),
        }
    }

    /// The cgroup's usage, as [`Cgroups::usage`] reads it: a file the kernel lacks reads as 0, a cgroup removed
    /// since the files were opened is an error.
    pub fn usage(&self) -> Result<Usage> {
        let files = self.usage_files()?;
        let oom = |t: &str| super::keyed(t, "oom_kill");
        Ok(Usage {
            peak_memory_bytes: files.peak.as_ref().map_or(Ok(0), |r| r.read(number))?,
            cpu_time_ns: self.cpu_time_ns()?,
            oom_kills: files.oom.as_ref().map_or(Ok(0), |r| r.read(oom))?,
        })
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

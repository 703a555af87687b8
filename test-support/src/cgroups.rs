//! The host's cgroups as the test harnesses see them, and the removal of what a test daemon left of its cgroup
//! parent. Only ever called with a parent the calling test process created (never a cgroup it did not create).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use nix::unistd::Pid;

/// The cgroupfs root of the host.
pub const CGROUP_ROOT: &str = "/sys/fs/cgroup";

/// How long [`remove_cgroup_parent`] keeps trying (a killed task leaves its cgroup a moment later).
const REMOVE_DEADLINE: Duration = Duration::from_secs(5);

/// Every hierarchy directory under [`CGROUP_ROOT`] (symlinks such as `cpu -> cpu,cpuacct` skipped); on a unified
/// (v2) host the root itself, whose subdirectories are cgroups (`system.slice`, a daemon's parent), not hierarchies.
pub fn cgroup_hierarchies() -> Vec<PathBuf> {
    let root = Path::new(CGROUP_ROOT);
    if root.join("cgroup.controllers").exists() {
        return vec![root.to_owned()];
    }
    let mut out = Vec::new();
    if let Ok(entries) = std::fs::read_dir(CGROUP_ROOT) {
        for e in entries.flatten() {
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                out.push(e.path());
            }
        }
    }
    out.sort();
    out
}

/// The directories of cgroup parent `parent` that exist, one per hierarchy.
pub fn cgroup_parent_dirs(parent: &str) -> Vec<PathBuf> {
    cgroup_hierarchies()
        .into_iter()
        .map(|h| h.join(parent))
        .filter(|p| p.is_dir())
        .collect()
}

/// Every cgroup directory under `parent`, in every hierarchy (containers that still exist).
pub fn cgroup_children(parent: &str) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for dir in cgroup_parent_dirs(parent) {
        if let Ok(entries) = std::fs::read_dir(&dir) {
            for e in entries.flatten() {
                if e.file_type().is_ok_and(|t| t.is_dir()) {
                    out.push(e.path());
                }
            }
        }
    }
    out
}

/// Best-effort removal of what is left of a test daemon's cgroup parent: thaws and kills the processes in it and
/// removes the directories, deepest first, for up to [`REMOVE_DEADLINE`]. Says on stderr what it found left over
/// and what it could not remove.
pub fn remove_cgroup_parent(parent: &str) {
    if cgroup_parent_dirs(parent).is_empty() {
        return;
    }
    let leftovers = cgroup_children(parent);
    if !leftovers.is_empty() {
        eprintln!("test-support: removing leftover cgroups of a stopped daemon: {leftovers:?}");
    }
    let start = Instant::now();
    loop {
        let mut all: Vec<PathBuf> = Vec::new();
        for d in cgroup_parent_dirs(parent) {
            collect_dirs(&d, &mut all);
        }
        if all.is_empty() {
            return;
        }
        all.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
        for d in &all {
            // A frozen task cannot die: thaw first (v1 freezer.state, v2 cgroup.freeze; absent files are skipped).
            let _ = std::fs::write(d.join("freezer.state"), "THAWED");
            let _ = std::fs::write(d.join("cgroup.freeze"), "0");
            if let Ok(procs) = std::fs::read_to_string(d.join("cgroup.procs")) {
                for pid in procs.lines().filter_map(|l| l.trim().parse::<i32>().ok()) {
                    let _ = nix::sys::signal::kill(Pid::from_raw(pid), Signal::SIGKILL);
                }
            }
            let _ = std::fs::remove_dir(d);
        }
        if start.elapsed() > REMOVE_DEADLINE {
            eprintln!("test-support: could not remove cgroups {all:?}");
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Removes a cgroup parent of this test process when dropped (for a parent no live daemon owns, e.g. after a
/// simulated crash).
pub struct CgroupParentGuard(pub String);

impl Drop for CgroupParentGuard {
    fn drop(&mut self) {
        remove_cgroup_parent(&self.0);
    }
}

/// `dir` and every directory under it, children before their parent.
fn collect_dirs(dir: &Path, out: &mut Vec<PathBuf>) {
    if let Ok(entries) = std::fs::read_dir(dir) {
        for e in entries.flatten() {
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                collect_dirs(&e.path(), out);
            }
        }
    }
    out.push(dir.to_owned());
}

//! Artifact collection: regular files under the working directory that match the requested globs, found and opened
//! without ever resolving a path string from the root.
//!
//! The walk holds a directory descriptor per level and opens every child relative to it with `openat2` and
//! `RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS` (plain `openat` with `O_NOFOLLOW` where `openat2` is missing), then checks
//! the type and size on the opened descriptor itself. A symlink, fifo, socket or device is skipped with its reason,
//! whatever was swapped in between listing and opening (cf. CVE-2018-15664). Collection runs after the program and
//! every process of its container are gone, so in sandboxd nothing can race it; the walk is safe without that.

use std::collections::BTreeMap;
use std::ffi::OsStr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use globset::{GlobBuilder, GlobSet, GlobSetBuilder};
use nix::fcntl::OFlag;
use nix::sys::stat::{fstat, SFlag};

use crate::error::{Error, Result};

/// Limits of one collection (what the artifact walk takes at most).
#[derive(Debug, Clone, Copy)]
pub struct CollectLimits {
    /// Files collected at most.
    pub max_files: usize,
    /// Largest file collected, bytes.
    pub max_file_bytes: u64,
    /// Total bytes collected at most.
    pub max_total_bytes: u64,
    /// Entries skipped that are listed by name (the rest are only counted).
    pub max_listed_skips: usize,
}

/// Directory levels walked at most.
const MAX_DEPTH: usize = 64;
/// Directory entries examined at most (bounds the cost of a hostile tree).
const MAX_ENTRIES: usize = 200_000;

/// A file accepted for collection: opened, verified regular, within the limits.
#[derive(Debug)]
pub struct Found {
    /// Path relative to the working directory.
    pub path: String,
    /// The open file.
    pub file: std::fs::File,
    /// Size at open time.
    pub size: u64,
    /// Artifact type (`file` unless the request said otherwise for the matching glob).
    pub artifact_type: String,
}

/// A matching entry that was not collected, and why.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Skipped {
    /// Path relative to the working directory.
    pub path: String,
    /// `symlink`, `fifo`, `socket`, `device`, `not_regular`, `too_large`, `count_limit`, `total_limit`, `unreadable`.
    pub reason: String,
}

/// The result of a walk.
#[derive(Debug, Default)]
pub struct Collection {
    /// Files to store, in path order.
    pub found: Vec<Found>,
    /// Matching entries not collected (at most `max_listed_skips`).
    pub skipped: Vec<Skipped>,
    /// Skipped entries per reason, all of them (including those not listed).
    pub skipped_counts: BTreeMap<String, u64>,
    /// Whether the walk stopped early (too deep or too many entries).
    pub walk_truncated: bool,
}

/// Compiled glob patterns (relative to the working directory) with their artifact types.
pub struct Patterns {
    set: GlobSet,
    types: Vec<String>,
}

impl Patterns {
    /// `*` and `?` stay within one path component; `**` crosses them.
    pub fn new(globs: &[String], types: &BTreeMap<String, String>) -> Result<Self> {
        let mut b = GlobSetBuilder::new();
        let mut t = Vec::new();
        for g in globs {
            let glob = GlobBuilder::new(g)
                .literal_separator(true)
                .build()
                .map_err(|e| Error::InputFile {
                    path: g.clone(),
                    reason: format!("invalid glob: {e}"),
                })?;
            b.add(glob);
            t.push(types.get(g).cloned().unwrap_or_else(|| "file".into()));
        }
        let set = b.build().map_err(|e| Error::InputFile {
            path: globs.join(","),
            reason: e.to_string(),
        })?;
        Ok(Self { set, types: t })
    }

    fn matches(&self, path: &str) -> Option<&str> {
        self.set
            .matches(path)
            .first()
            .map(|i| self.types[*i].as_str())
    }
}

fn kind_reason(mode: SFlag) -> &'static str {
    match mode {
        m if m == SFlag::S_IFLNK => "symlink",
        m if m == SFlag::S_IFIFO => "fifo",
        m if m == SFlag::S_IFSOCK => "socket",
        m if m == SFlag::S_IFCHR || m == SFlag::S_IFBLK => "device",
        _ => "not_regular",
    }
}

/// Walks `root` (a directory) and collects what `patterns` match.
pub fn collect(root: &Path, patterns: &Patterns, limits: CollectLimits) -> Result<Collection> {
    let root_fd = nix::fcntl::open(
        root,
        OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
        nix::sys::stat::Mode::empty(),
    )
    .map_err(|e| Error::sys(format!("open {}", root.display()), e))?;
    // SAFETY: open returned a new descriptor that nothing else owns.
    let root_fd = unsafe { OwnedFd::from_raw_fd(root_fd) };
    let mut walker = Walker {
        patterns,
        limits,
        out: Collection::default(),
        total: 0,
        entries: 0,
    };
    walker.walk(&root_fd, "", 0)?;
    let mut out = walker.out;
    out.found.sort_by(|a, b| a.path.cmp(&b.path));
    Ok(out)
}

/// One collection under way: what to match, the limits, and what was found so far.
struct Walker<'a> {
    patterns: &'a Patterns,
    limits: CollectLimits,
    out: Collection,
    /// Bytes accepted so far.
    total: u64,
    /// Directory entries examined so far.
    entries: usize,
}

impl Walker<'_> {
    fn skip(&mut self, path: String, reason: &str) {
        *self
            .out
            .skipped_counts
            .entry(reason.to_owned())
            .or_default() += 1;
        if self.out.skipped.len() < self.limits.max_listed_skips {
            self.out.skipped.push(Skipped {
                path,
                reason: reason.to_owned(),
            });
        }
    }

    /// Walks one directory: subdirectories recursively (beneath `dir`, never through a symlink), matching entries
    /// through [`Self::consider`].
    fn walk(&mut self, dir: &OwnedFd, prefix: &str, depth: usize) -> Result<()> {
        if depth > MAX_DEPTH {
            self.out.walk_truncated = true;
            return Ok(());
        }
        for name in self.list(dir, prefix)? {
            let os_name = OsStr::from_bytes(&name);
            let Ok(name_str) = std::str::from_utf8(&name) else {
                // A name that is not UTF-8 cannot be named in a JSON manifest; it is not collected.
                continue;
            };
            let rel = if prefix.is_empty() {
                name_str.to_owned()
            } else {
                format!("{prefix}/{name_str}")
            };
            let st = match nix::sys::stat::fstatat(
                Some(dir.as_raw_fd()),
                os_name,
                nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW,
            ) {
                Ok(st) => st,
                Err(_) => continue,
            };
            let kind = SFlag::from_bits_truncate(st.st_mode) & SFlag::S_IFMT;
            if kind == SFlag::S_IFDIR {
                match crate::sys::open_beneath(
                    dir.as_raw_fd(),
                    os_name,
                    OFlag::O_RDONLY | OFlag::O_DIRECTORY,
                ) {
                    Ok(sub) => self.walk(&sub, &rel, depth + 1)?,
                    // Swapped for a symlink (ELOOP) or removed since listing: not ours to follow.
                    Err(_) => {
                        if self.patterns.matches(&rel).is_some() {
                            self.skip(rel, "symlink");
                        }
                    }
                }
                continue;
            }
            let Some(artifact_type) = self.patterns.matches(&rel) else {
                continue;
            };
            if kind != SFlag::S_IFREG {
                self.skip(rel, kind_reason(kind));
                continue;
            }
            self.consider(dir, os_name, rel, artifact_type.to_owned());
        }
        Ok(())
    }

    /// The names in `dir` (`.` and `..` excluded), sorted; stops early past [`MAX_ENTRIES`] in all.
    fn list(&mut self, dir: &OwnedFd, prefix: &str) -> Result<Vec<Vec<u8>>> {
        // Dir::openat on "." gives an independent stream for this directory without resolving any path.
        let mut listing = nix::dir::Dir::openat(
            Some(dir.as_raw_fd()),
            ".",
            OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
            nix::sys::stat::Mode::empty(),
        )
        .map_err(|e| Error::sys(format!("opendir {prefix:?}"), e))?;
        let mut names: Vec<Vec<u8>> = Vec::new();
        for entry in listing.iter() {
            let entry = entry.map_err(|e| Error::sys(format!("readdir {prefix:?}"), e))?;
            let name = entry.file_name().to_bytes();
            if name == b"." || name == b".." {
                continue;
            }
            self.entries += 1;
            if self.entries > MAX_ENTRIES {
                self.out.walk_truncated = true;
                break;
            }
            names.push(name.to_vec());
        }
        names.sort();
        Ok(names)
    }

    /// A matching entry that looked like a regular file: opened beneath `dir`, checked again on the descriptor
    /// (type, size) and collected if it fits the limits, skipped with its reason otherwise.
    fn consider(&mut self, dir: &OwnedFd, name: &OsStr, rel: String, artifact_type: String) {
        // O_NONBLOCK: if a fifo was swapped in since the stat, opening it must not hang.
        let fd = match crate::sys::open_beneath(
            dir.as_raw_fd(),
            name,
            OFlag::O_RDONLY | OFlag::O_NONBLOCK,
        ) {
            Ok(fd) => fd,
            Err(nix::Error::ELOOP) => return self.skip(rel, "symlink"),
            Err(_) => return self.skip(rel, "unreadable"),
        };
        // The opened object decides, not the earlier stat.
        let Ok(st) = fstat(fd.as_raw_fd()) else {
            return self.skip(rel, "unreadable");
        };
        let kind = SFlag::from_bits_truncate(st.st_mode) & SFlag::S_IFMT;
        if kind != SFlag::S_IFREG {
            return self.skip(rel, kind_reason(kind));
        }
        let size = st.st_size as u64;
        if size > self.limits.max_file_bytes {
            return self.skip(rel, "too_large");
        }
        if self.out.found.len() >= self.limits.max_files {
            return self.skip(rel, "count_limit");
        }
        if self.total + size > self.limits.max_total_bytes {
            return self.skip(rel, "total_limit");
        }
        self.total += size;
        self.out.found.push(Found {
            path: rel,
            file: std::fs::File::from(fd),
            size,
            artifact_type,
        });
    }
}

#[cfg(test)]
mod tests {
    use std::io::Read;
    use std::os::unix::fs::symlink;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;

    use super::*;

    const LIMITS: CollectLimits = CollectLimits {
        max_files: 64,
        max_file_bytes: 1 << 20,
        max_total_bytes: 4 << 20,
        max_listed_skips: 100,
    };

    fn pats(globs: &[&str]) -> Patterns {
        Patterns::new(
            &globs.iter().map(|s| s.to_string()).collect::<Vec<_>>(),
            &BTreeMap::new(),
        )
        .unwrap()
    }

    #[test]
    fn globs_select_regular_files_and_list_what_they_skip() {
        let t = tempfile::tempdir().unwrap();
        let w = t.path();
        std::fs::create_dir_all(w.join("out/deep")).unwrap();
        std::fs::write(w.join("out/a.txt"), "a").unwrap();
        std::fs::write(w.join("out/deep/b.bin"), [0u8, 1, 2]).unwrap();
        std::fs::write(w.join("top.txt"), "top").unwrap();
        symlink("/etc/passwd", w.join("out/link")).unwrap();
        nix::unistd::mkfifo(
            &w.join("out/fifo"),
            nix::sys::stat::Mode::from_bits_truncate(0o644),
        )
        .unwrap();
        std::fs::write(w.join("out/big"), vec![7u8; (1 << 20) + 1]).unwrap();
        let c = collect(w, &pats(&["out/**"]), LIMITS).unwrap();
        let paths: Vec<_> = c.found.iter().map(|f| f.path.as_str()).collect();
        assert_eq!(paths, ["out/a.txt", "out/deep/b.bin"]);
        let mut skipped: Vec<_> = c
            .skipped
            .iter()
            .map(|s| (s.path.as_str(), s.reason.as_str()))
            .collect();
        skipped.sort();
        assert_eq!(
            skipped,
            [
                ("out/big", "too_large"),
                ("out/fifo", "fifo"),
                ("out/link", "symlink")
            ]
        );
        // `*` stays in one component.
        let c = collect(w, &pats(&["*.txt"]), LIMITS).unwrap();
        assert_eq!(
            c.found.iter().map(|f| f.path.as_str()).collect::<Vec<_>>(),
            ["top.txt"]
        );
    }

    #[test]
    fn a_symlinked_directory_is_not_followed() {
        let t = tempfile::tempdir().unwrap();
        let outside = tempfile::tempdir().unwrap();
        std::fs::write(outside.path().join("secret"), "secret").unwrap();
        symlink(outside.path(), t.path().join("out")).unwrap();
        let c = collect(t.path(), &pats(&["**"]), LIMITS).unwrap();
        assert!(c.found.is_empty());
        assert_eq!(
            c.skipped,
            [Skipped {
                path: "out".into(),
                reason: "symlink".into()
            }]
        );
    }

    #[test]
    fn count_and_total_limits_say_what_was_dropped() {
        let t = tempfile::tempdir().unwrap();
        for i in 0..10 {
            std::fs::write(t.path().join(format!("f{i:02}")), vec![b'x'; 1000]).unwrap();
        }
        let limits = CollectLimits {
            max_files: 3,
            max_listed_skips: 2,
            ..LIMITS
        };
        let c = collect(t.path(), &pats(&["f*"]), limits).unwrap();
        assert_eq!(c.found.len(), 3);
        assert_eq!(c.skipped.len(), 2);
        assert_eq!(c.skipped_counts["count_limit"], 7);
        let limits = CollectLimits {
            max_total_bytes: 2500,
            ..LIMITS
        };
        let c = collect(t.path(), &pats(&["f*"]), limits).unwrap();
        assert_eq!(c.found.len(), 2);
        assert_eq!(c.skipped_counts["total_limit"], 8);
    }

    /// A thread keeps swapping `out/x` between a regular file and a symlink to a secret while collections run:
    /// no collection may ever return the secret's content.
    #[test]
    fn a_symlink_swapped_in_during_collection_is_never_followed() {
        let t = tempfile::tempdir().unwrap();
        let secret = t.path().join("secret");
        std::fs::write(&secret, "SECRET").unwrap();
        let w = t.path().join("w");
        std::fs::create_dir_all(w.join("out")).unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let swapper = {
            let (w, secret, stop) = (w.clone(), secret.clone(), stop.clone());
            std::thread::spawn(move || {
                let (target, tmp_file, tmp_link) =
                    (w.join("out/x"), w.join("out/.f"), w.join("out/.l"));
                while !stop.load(Ordering::Relaxed) {
                    std::fs::write(&tmp_file, "plain").unwrap();
                    std::fs::rename(&tmp_file, &target).unwrap();
                    let _ = std::fs::remove_file(&tmp_link);
                    symlink(&secret, &tmp_link).unwrap();
                    std::fs::rename(&tmp_link, &target).unwrap();
                }
            })
        };
        // Until both states were seen often enough: on a loaded machine the regular file can be missed for
        // thousands of rounds in a row, so the bound is time, not a count.
        let (mut collected, mut rounds) = (0, 0);
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        while (collected < 20 || rounds < 2000) && std::time::Instant::now() < deadline {
            rounds += 1;
            let c = collect(&w, &pats(&["out/x"]), LIMITS).unwrap();
            for mut f in c.found {
                let mut s = String::new();
                f.file.read_to_string(&mut s).unwrap();
                assert_eq!(s, "plain", "followed a swapped-in symlink");
                collected += 1;
            }
        }
        stop.store(true, Ordering::Relaxed);
        swapper.join().unwrap();
        assert!(
            collected > 0,
            "the race never saw a regular file; the test proved nothing"
        );
    }
}

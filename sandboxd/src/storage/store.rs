//! The artifact store: content-addressed blobs under `<state_dir>/artifacts/sha256/<hex>`, the manifests that
//! reference them, and the garbage collector.
//!
//! A blob is written to a temporary file while it is hashed, fsynced, then renamed into place (and the directory
//! fsynced), so a crash never leaves a partial blob under a content address. Identical content is stored once.
//! Manifests are kept as files too; the collector deletes manifests older than the retention age and blobs that no
//! remaining manifest references (expired first, then oldest first while the store is over its size limit). It never
//! deletes a blob a live manifest references. Collections and the collector exclude each other with a lock, so a
//! blob stored for a manifest not yet written is never collected.

use std::collections::BTreeSet;
use std::fs::{self, File};
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::RwLock;
use std::time::{Duration, SystemTime};

use sha2::{Digest, Sha256};

/// Bytes kept for a text preview.
pub const PREVIEW_BYTES: usize = 512;

/// A stored blob.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stored {
    /// Lowercase hex sha256.
    pub hex: String,
    /// Size in bytes.
    pub size: u64,
    /// The first bytes of the content (for previews and type sniffing).
    pub head: Vec<u8>,
}

/// A blob written and hashed but not yet under its content address.
#[derive(Debug)]
pub struct Staged {
    tmp: tempfile::NamedTempFile,
    stored: Stored,
    content_type: String,
}

/// What a collector run did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct GcReport {
    /// Expired manifests removed.
    pub manifests_removed: usize,
    /// Blobs removed.
    pub blobs_removed: usize,
    /// Bytes freed.
    pub bytes_freed: u64,
    /// Bytes left in the store.
    pub bytes_left: u64,
}

/// The store.
#[derive(Debug)]
pub struct Store {
    root: PathBuf,
    retention: Duration,
    max_bytes: u64,
    lock: RwLock<()>,
}

fn is_hex64(s: &str) -> bool {
    s.len() == 64
        && s.bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

fn fsync_dir(dir: &Path) -> io::Result<()> {
    File::open(dir)?.sync_all()
}

impl Store {
    /// Opens (creating) the store under `root`; removes temporary files a crash left.
    pub fn open(root: &Path, retention: Duration, max_bytes: u64) -> io::Result<Self> {
        for d in ["sha256", "manifests", "tmp"] {
            fs::create_dir_all(root.join(d))?;
        }
        for e in fs::read_dir(root.join("tmp"))?.flatten() {
            let _ = fs::remove_file(e.path());
        }
        Ok(Self {
            root: root.to_owned(),
            retention,
            max_bytes,
            lock: RwLock::new(()),
        })
    }

    /// Holds off the collector while a collection stores blobs and writes its manifest.
    pub fn writing(&self) -> std::sync::RwLockReadGuard<'_, ()> {
        self.lock.read().unwrap_or_else(|p| p.into_inner())
    }

    /// The path of a blob, if the hex is well-formed and the blob exists.
    pub fn blob(&self, hex: &str) -> Option<PathBuf> {
        if !is_hex64(hex) {
            return None;
        }
        let p = self.root.join("sha256").join(hex);
        p.is_file().then_some(p)
    }

    /// The content type recorded for a blob.
    pub fn content_type(&self, hex: &str) -> String {
        fs::read_to_string(self.root.join("sha256").join(format!("{hex}.type")))
            .unwrap_or_else(|_| "application/octet-stream".into())
    }

    /// Copies the content of `src` (at most `limit` bytes; more is an error: the file grew since it was sized) to a
    /// temporary file while hashing it. Nothing is visible under a content address until [`Store::commit`].
    pub fn stage(
        &self,
        src: &mut impl Read,
        limit: u64,
        content_type: impl FnOnce(&[u8]) -> String,
    ) -> io::Result<Staged> {
        let tmp = tempfile::NamedTempFile::new_in(self.root.join("tmp"))?;
        let mut hasher = Sha256::new();
        let mut head = Vec::new();
        let mut size = 0u64;
        let mut buf = vec![0u8; 256 * 1024];
        let mut out = tmp.as_file();
        loop {
            let n = src.read(&mut buf)?;
            if n == 0 {
                break;
            }
            size += n as u64;
            if size > limit {
                return Err(io::Error::other(
                    "the file grew past its limit while it was stored",
                ));
            }
            hasher.update(&buf[..n]);
            if head.len() < PREVIEW_BYTES {
                let take = (PREVIEW_BYTES - head.len()).min(n);
                head.extend_from_slice(&buf[..take]);
            }
            out.write_all(&buf[..n])?;
        }
        let content_type = content_type(&head);
        Ok(Staged {
            tmp,
            stored: Stored {
                hex: format!("{:x}", hasher.finalize()),
                size,
                head,
            },
            content_type,
        })
    }

    /// Makes staged blobs durable and visible: one `syncfs` for all their data, then the renames (content already
    /// present is kept and the copy dropped), then one directory fsync. A crash before the renames leaves only
    /// temporary files, which the next [`Store::open`] removes.
    pub fn commit(&self, staged: Vec<Staged>) -> io::Result<Vec<Stored>> {
        if staged.is_empty() {
            return Ok(Vec::new());
        }
        nix::unistd::syncfs(std::os::fd::AsRawFd::as_raw_fd(staged[0].tmp.as_file()))
            .map_err(io::Error::from)?;
        let dir = self.root.join("sha256");
        let mut out = Vec::with_capacity(staged.len());
        for s in staged {
            let dest = dir.join(&s.stored.hex);
            if !dest.exists() {
                fs::write(dir.join(format!("{}.type", s.stored.hex)), &s.content_type)?;
                s.tmp.persist(&dest).map_err(|e| e.error)?;
                crate::observe::metrics::get().artifact_stored(s.stored.size);
            }
            out.push(s.stored);
        }
        fsync_dir(&dir)?;
        Ok(out)
    }

    /// [`Store::stage`] and [`Store::commit`] of one blob.
    #[cfg(test)]
    pub fn put(
        &self,
        src: &mut impl Read,
        limit: u64,
        content_type: impl FnOnce(&[u8]) -> String,
    ) -> io::Result<Stored> {
        let staged = self.stage(src, limit, content_type)?;
        let mut v = self.commit(vec![staged])?;
        v.pop().ok_or_else(|| io::Error::other("nothing committed"))
    }

    /// Writes a manifest (atomically) so the collector knows what it references.
    pub fn save_manifest(&self, id: &str, manifest: &serde_json::Value) -> io::Result<()> {
        let mut tmp = tempfile::NamedTempFile::new_in(self.root.join("tmp"))?;
        tmp.write_all(manifest.to_string().as_bytes())?;
        tmp.as_file().sync_all()?;
        tmp.persist(self.root.join("manifests").join(format!("{id}.json")))
            .map_err(|e| e.error)?;
        fsync_dir(&self.root.join("manifests"))
    }

    /// Runs the collector as of `now`.
    pub fn gc(&self, now: SystemTime) -> io::Result<GcReport> {
        let _exclusive = self.lock.write().unwrap_or_else(|p| p.into_inner());
        let mut report = GcReport::default();
        let age = |p: &Path| -> Duration {
            fs::metadata(p)
                .and_then(|m| m.modified())
                .ok()
                .and_then(|t| now.duration_since(t).ok())
                .unwrap_or_default()
        };
        let mut live = BTreeSet::new();
        for e in fs::read_dir(self.root.join("manifests"))?.flatten() {
            let p = e.path();
            if age(&p) > self.retention {
                fs::remove_file(&p)?;
                report.manifests_removed += 1;
                continue;
            }
            let text = fs::read_to_string(&p).unwrap_or_default();
            let doc: serde_json::Value = serde_json::from_str(&text).unwrap_or_default();
            for a in doc["artifacts"].as_array().into_iter().flatten() {
                if let Some(hex) = a["checksum"]
                    .as_str()
                    .and_then(|c| c.strip_prefix("sha256:"))
                {
                    live.insert(hex.to_owned());
                }
            }
        }
        let mut blobs: Vec<(Duration, String, u64)> = Vec::new();
        let mut total = 0u64;
        for e in fs::read_dir(self.root.join("sha256"))?.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if !is_hex64(&name) {
                continue;
            }
            let size = e.metadata().map(|m| m.len()).unwrap_or(0);
            total += size;
            blobs.push((age(&e.path()), name, size));
        }
        // Oldest first.
        blobs.sort_by_key(|b| std::cmp::Reverse(b.0));
        for (blob_age, hex, size) in blobs {
            if live.contains(&hex) {
                continue;
            }
            if blob_age > self.retention || total > self.max_bytes {
                let p = self.root.join("sha256").join(&hex);
                fs::remove_file(&p)?;
                let _ = fs::remove_file(self.root.join("sha256").join(format!("{hex}.type")));
                total -= size;
                report.blobs_removed += 1;
                report.bytes_freed += size;
            }
        }
        report.bytes_left = total;
        crate::observe::metrics::get().set_artifacts_bytes(total);
        Ok(report)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn manifest(hexes: &[&str]) -> serde_json::Value {
        serde_json::json!({"artifacts": hexes.iter().map(|h| serde_json::json!({"checksum": format!("sha256:{h}")})).collect::<Vec<_>>()})
    }

    #[test]
    fn identical_content_is_stored_once_under_its_sha256() {
        let t = tempfile::tempdir().unwrap();
        let s = Store::open(t.path(), Duration::from_secs(60), u64::MAX).unwrap();
        let a = s
            .put(&mut &b"hello\n"[..], 100, |_| "text/plain".into())
            .unwrap();
        let b = s
            .put(&mut &b"hello\n"[..], 100, |_| "text/plain".into())
            .unwrap();
        assert_eq!(a, b);
        assert_eq!(
            a.hex,
            "5891b5b522d5df086d0ff0b110fbd9d21bb4fc7163af34d08286a2e846f6be03"
        );
        assert_eq!(fs::read(s.blob(&a.hex).unwrap()).unwrap(), b"hello\n");
        let blobs = fs::read_dir(t.path().join("sha256"))
            .unwrap()
            .filter(|e| e.as_ref().unwrap().file_name().len() == 64)
            .count();
        assert_eq!(blobs, 1);
        assert_eq!(s.content_type(&a.hex), "text/plain");
        assert!(s.blob("../../etc/passwd").is_none());
        assert!(s.put(&mut &b"too long"[..], 3, |_| String::new()).is_err());
    }

    #[test]
    fn gc_removes_only_unreferenced_expired_content_and_survives_reopen() {
        let t = tempfile::tempdir().unwrap();
        let s = Store::open(t.path(), Duration::from_secs(60), u64::MAX).unwrap();
        let kept = s.put(&mut &b"kept"[..], 100, |_| String::new()).unwrap();
        let orphan = s.put(&mut &b"orphan"[..], 100, |_| String::new()).unwrap();
        let old = s
            .put(&mut &b"old manifest"[..], 100, |_| String::new())
            .unwrap();
        s.save_manifest("am_live", &manifest(&[&kept.hex])).unwrap();
        s.save_manifest("am_old", &manifest(&[&old.hex])).unwrap();
        // Reopening (a daemon restart) keeps everything.
        drop(s);
        let s = Store::open(t.path(), Duration::from_secs(60), u64::MAX).unwrap();
        // Now: nothing is expired, nothing goes.
        assert_eq!(s.gc(SystemTime::now()).unwrap().blobs_removed, 0);
        // Age the old manifest and every blob past the retention.
        let past = SystemTime::now() - Duration::from_secs(3600);
        for p in [t.path().join("manifests/am_old.json")].into_iter().chain(
            [&kept.hex, &orphan.hex, &old.hex]
                .iter()
                .map(|h| t.path().join("sha256").join(h)),
        ) {
            File::options()
                .write(true)
                .open(&p)
                .unwrap()
                .set_modified(past)
                .unwrap();
        }
        let r = s.gc(SystemTime::now()).unwrap();
        assert_eq!((r.manifests_removed, r.blobs_removed), (1, 2));
        assert!(
            s.blob(&kept.hex).is_some(),
            "a live manifest's blob was collected"
        );
        assert!(s.blob(&orphan.hex).is_none() && s.blob(&old.hex).is_none());
    }

    #[test]
    fn over_the_size_limit_unreferenced_blobs_go_oldest_first() {
        let t = tempfile::tempdir().unwrap();
        let s = Store::open(t.path(), Duration::from_secs(3600), 10).unwrap();
        let live = s
            .put(&mut &b"0123456789"[..], 100, |_| String::new())
            .unwrap();
        let young = s.put(&mut &b"abcdef"[..], 100, |_| String::new()).unwrap();
        s.save_manifest("am", &manifest(&[&live.hex])).unwrap();
        let r = s.gc(SystemTime::now()).unwrap();
        assert_eq!(r.blobs_removed, 1);
        assert!(s.blob(&young.hex).is_none() && s.blob(&live.hex).is_some());
        assert_eq!(r.bytes_left, 10);
    }
}

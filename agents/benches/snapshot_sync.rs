//! `cargo bench -p sandboxd-agents --bench snapshot_sync`: what a snapshot's durability costs, on a quiet state disk
//! and with another writer on it. The workspace is 1 000 files of 100 KiB (about 100 MB, in 10 directories) on a
//! tmpfs (`/dev/shm`, as a sandbox's is); the snapshots go to a directory on the state disk (`SNAPSHOT_SYNC_BENCH_DIR`,
//! default `/var/tmp`, as a daemon's `state_dir` is). Each of `SNAPSHOT_SYNC_BENCH_ROUNDS` (9) rounds times, in
//! turns:
//! - `Snapshots::take` (what `POST /snapshot` does once the agent is frozen, and what `POST /fork` does before it
//!   creates the sandbox): the copy, hashed, made durable by an fsync of each of its files and directories, then
//!   its record;
//! - the same copy and record made durable by one `syncfs` of the state disk (what `take` did before), and that
//!   `syncfs` alone;
//! - the same copy, not durable, then made durable by `runtime::tree::sync_tree` (the fsyncs `take` does, timed
//!   apart from the copy).
//!
//! First with nothing else writing (each measure after a `syncfs`, so that nothing is left unwritten), then with a
//! thread that keeps rewriting a 1 GiB file in the same directory (at most 512 MiB/s, never synced), each measure
//! once about that much is unwritten (`Dirty` in `/proc/meminfo`, waited for up to 5 s). Prints p50, min and max of
//! each, in ms.
//!
//! Every copy is kept until the end (about 6 GB): on an ext4 without a journal, files made within a minute of
//! others' removal take far longer to make (its allocator skips inodes freed in the last minute), which would
//! drown the figures in that.
//!
//! Figures, not assertions.

#![allow(missing_docs, clippy::unwrap_used, clippy::expect_used)]

use std::io::Write;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use agents::snapshots::{copy_tree, Snapshots};

const FILES: usize = 1000;
const FILE_BYTES: usize = 100 << 10;
const WRITER_BYTES: u64 = 1 << 30;
const CHUNK: usize = 1 << 20;
/// The writer's pace: a chunk at most every this long (512 MiB/s), so that it dirties pages faster than a disk
/// writes them without taking a whole core from the copies.
const CHUNK_EVERY: Duration = Duration::from_micros(1953);

/// The figures, by row: what each is.
const ROWS: [&str; 6] = [
    "Snapshots::take (fsyncs of its files)",
    "copy + record + syncfs (before)",
    "  of which the syncfs",
    "copy alone (not durable)",
    "  then sync_tree (fsyncs of its files)",
    "MiB unwritten when each began",
];

/// One way of taking a snapshot, and the rows it adds to.
#[derive(Clone, Copy)]
enum Way {
    /// `Snapshots::take`.
    Take,
    /// The same copy and record, durable by one `syncfs`.
    Syncfs,
    /// The copy, then `sync_tree`.
    CopyThenSync,
}

const WAYS: [Way; 3] = [Way::Take, Way::Syncfs, Way::CopyThenSync];

fn main() {
    let rounds: usize = std::env::var("SNAPSHOT_SYNC_BENCH_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(9);
    let base = std::env::var("SNAPSHOT_SYNC_BENCH_DIR").unwrap_or_else(|_| "/var/tmp".into());
    let state = tempfile::tempdir_in(&base).unwrap();
    let source = tempfile::tempdir_in("/dev/shm")
        .or_else(|_| tempfile::tempdir())
        .unwrap();
    let ws = workspace(source.path());
    let rt = tokio::runtime::Runtime::new().unwrap();
    let max = 2 * WAYS.len() * (rounds + 1);
    let store = Snapshots::open(state.path().join("snapshots"), max, None).unwrap();
    println!(
        "snapshot_sync bench: a workspace of {FILES} files of {} KiB ({:.1} MB) from {}, to {} ({}); {rounds} \
         rounds; p50 (min-max) in ms",
        FILE_BYTES >> 10,
        (FILES * FILE_BYTES) as f64 / 1e6,
        source.path().display(),
        state.path().display(),
        fs_type(state.path()),
    );
    let bench = Bench {
        rt,
        store,
        ws,
        state: state.path().to_owned(),
    };
    // One of each first, untimed: the page cache and the allocator warm.
    let mut n = 0;
    let mut warm = vec![Vec::new(); ROWS.len()];
    for way in WAYS {
        bench.once(way, &mut n, &mut warm);
    }
    let quiet = bench.measure(rounds, &mut n, true);
    let stop = Arc::new(AtomicBool::new(false));
    let writer = {
        let (stop, path) = (stop.clone(), state.path().join("writer.bin"));
        std::thread::spawn(move || write_loop(&path, &stop))
    };
    let loaded = bench.measure(rounds, &mut n, false);
    stop.store(true, Ordering::Relaxed);
    let written = writer.join().unwrap();
    println!("{:<40} {:>22} {:>22}", "", "quiet", "another writer");
    for (i, what) in ROWS.iter().enumerate() {
        println!(
            "{what:<40} {:>22} {:>22}",
            stats(quiet[i].clone()),
            stats(loaded[i].clone())
        );
    }
    println!(
        "the writer wrote {:.1} GiB meanwhile",
        written as f64 / (1u64 << 30) as f64
    );
    for s in bench.store.list() {
        bench.rt.block_on(bench.store.delete(&s.id)).unwrap();
    }
}

struct Bench {
    rt: tokio::runtime::Runtime,
    store: Arc<Snapshots>,
    ws: PathBuf,
    state: PathBuf,
}

impl Bench {
    /// `rounds` of each way, in turns (the first of each round a different one), the copies numbered from `n` on;
    /// with `settle`, each starts once the filesystem has nothing unwritten, without once [`WRITER_BYTES`] are
    /// (nearly). The figures, by row.
    fn measure(&self, rounds: usize, n: &mut usize, settle: bool) -> Vec<Vec<f64>> {
        let mut rows = vec![Vec::new(); ROWS.len()];
        for round in 0..rounds {
            for k in 0..WAYS.len() {
                if settle {
                    syncfs(&self.state);
                } else {
                    let deadline = Instant::now() + Duration::from_secs(5);
                    while meminfo_kib("Dirty:") < (WRITER_BYTES * 7 / 8) >> 10
                        && Instant::now() < deadline
                    {
                        std::thread::sleep(Duration::from_millis(20));
                    }
                }
                rows[ROWS.len() - 1].push((meminfo_kib("Dirty:") >> 10) as f64);
                self.once(WAYS[(round + k) % WAYS.len()], n, &mut rows);
            }
        }
        rows
    }

    /// One snapshot of the workspace taken `way` (into copy `n`, unless it is `Snapshots::take`'s), its figures
    /// added to `rows`.
    fn once(&self, way: Way, n: &mut usize, rows: &mut [Vec<f64>]) {
        let to = self.state.join(format!("copy-{n}"));
        *n += 1;
        let t = Instant::now();
        match way {
            Way::Take => {
                let taken = self
                    .store
                    .take((self.ws.clone(), None), "host", "bench", u64::MAX);
                self.rt.block_on(taken).unwrap();
                rows[0].push(ms(t));
            }
            Way::Syncfs => {
                let synced = store_with_syncfs(&self.ws, &to);
                rows[1].push(ms(t));
                rows[2].push(synced);
            }
            Way::CopyThenSync => {
                copy_tree(&self.ws, &to, u64::MAX).unwrap();
                rows[3].push(ms(t));
                let t = Instant::now();
                runtime::tree::sync_tree(&to).unwrap();
                rows[4].push(ms(t));
            }
        }
    }
}

fn ms(since: Instant) -> f64 {
    since.elapsed().as_secs_f64() * 1e3
}

/// What `Snapshots::take` did before, into `done`: the copy, its record, one `syncfs` for both, then the rename and
/// the fsync of the parent. The time of the `syncfs`, in ms.
fn store_with_syncfs(ws: &Path, done: &Path) -> f64 {
    let partial = done.with_extension("partial");
    std::fs::create_dir(&partial).unwrap();
    let copied = copy_tree(ws, &partial.join("layer"), u64::MAX).unwrap();
    let mut f = std::fs::File::create_new(partial.join("snapshot.json")).unwrap();
    f.write_all(format!("{{\"digest\": \"{}\"}}", copied.digest).as_bytes())
        .unwrap();
    let t = Instant::now();
    nix::unistd::syncfs(f.as_raw_fd()).unwrap();
    let synced = ms(t);
    std::fs::rename(&partial, done).unwrap();
    let parent = done.parent().unwrap();
    std::fs::File::open(parent).unwrap().sync_all().unwrap();
    synced
}

/// 1 000 files of pseudo-random bytes, ten directories of 100.
fn workspace(root: &Path) -> PathBuf {
    let ws = root.join("workspace");
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    let mut buf = vec![0u8; FILE_BYTES];
    for i in 0..FILES {
        for b in buf.chunks_mut(8) {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            b.copy_from_slice(&x.to_le_bytes()[..b.len()]);
        }
        let dir = ws.join(format!("d{}", i % 10));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join(format!("f{i}.bin")), &buf).unwrap();
    }
    ws
}

/// Rewrites the first [`WRITER_BYTES`] of `path` in a loop, never synced, until `stop`; the bytes written.
fn write_loop(path: &Path, stop: &AtomicBool) -> u64 {
    let f = std::fs::File::create(path).unwrap();
    let chunk: Vec<u8> = (0..CHUNK).map(|i| (i * 31 % 251) as u8).collect();
    let (mut at, mut written) = (0u64, 0u64);
    while !stop.load(Ordering::Relaxed) {
        let t = Instant::now();
        f.write_all_at(&chunk, at).unwrap();
        written += CHUNK as u64;
        at = (at + CHUNK as u64) % WRITER_BYTES;
        if let Some(rest) = CHUNK_EVERY.checked_sub(t.elapsed()) {
            std::thread::sleep(rest);
        }
    }
    drop(f);
    std::fs::remove_file(path).unwrap();
    written
}

fn syncfs(path: &Path) {
    let f = std::fs::File::open(path).unwrap();
    nix::unistd::syncfs(f.as_raw_fd()).unwrap();
}

fn stats(mut v: Vec<f64>) -> String {
    v.sort_by(|a, b| a.total_cmp(b));
    format!("{:.0} ({:.0}-{:.0})", v[v.len() / 2], v[0], v[v.len() - 1])
}

/// A field of `/proc/meminfo`, in KiB.
fn meminfo_kib(field: &str) -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

/// The type of the filesystem holding `path`, as `/proc/self/mounts` names it (the longest mount point above it),
/// and for an ext4 whether it has a journal.
fn fs_type(path: &Path) -> String {
    let mounts = std::fs::read_to_string("/proc/self/mounts").unwrap_or_default();
    let Some((_, dev, kind)) = mounts
        .lines()
        .filter_map(|l| {
            let mut f = l.split_whitespace();
            let (dev, at, kind) = (f.next()?, f.next()?, f.next()?);
            path.starts_with(at)
                .then(|| (at.len(), dev.to_owned(), kind.to_owned()))
        })
        .max()
    else {
        return String::new();
    };
    let name = dev.rsplit('/').next().unwrap_or_default();
    match std::fs::read_to_string(format!("/sys/fs/ext4/{name}/journal_task")) {
        Ok(task) if task.trim() == "<none>" => format!("{kind} {dev}, no journal"),
        Ok(_) => format!("{kind} {dev}, with a journal"),
        Err(_) => format!("{kind} {dev}"),
    }
}

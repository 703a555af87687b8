//! Adversarial suite, resources: a fork bomb and a thread bomb held at `pids_max` while a neighbour
//! execution still finishes, memory bombs ending in `oom`, disk fills answered with `ENOSPC` after which the next
//! job starts clean, an output flood with the daemon's memory bounded, a 64 MiB line without a newline, a cpu
//! burner, and argv/env/code too large to exec. Each runs through [`Arena::attack`] (pings answered within 500 ms,
//! host unchanged, nothing left, `echo ok` afterwards).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use protocol::{ExecStatus, Limits, Reason, ServerMessage};
use serde_json::{json, Value};

use super::attack::{vm_rss_kib, Arena};
use super::harness::{
    cgroup_children, exec_json, privileged, privileged_alone, processes_with_uid, with, Client,
    Collected, DaemonOpts, MAX_LIMITS,
};

/// The largest output the flood cases may ask for.
const FLOOD_LIMIT: u64 = 128 << 20;
/// The largest growth of the daemon's resident memory the flood may cause.
const RSS_GROWTH_BOUND_KIB: u64 = 64 << 10;

fn opts() -> DaemonOpts {
    DaemonOpts {
        max_limits: Limits {
            max_output_bytes: FLOOD_LIMIT,
            timeout_ms: 120_000,
            ..MAX_LIMITS
        },
        ..DaemonOpts::default()
    }
}

/// Samples something on a thread every 20 ms until stopped; returns the largest value.
struct Sampler {
    stop: Arc<AtomicBool>,
    max: Arc<AtomicU64>,
    thread: std::thread::JoinHandle<()>,
}

impl Sampler {
    fn start(f: impl Fn() -> u64 + Send + 'static) -> Sampler {
        let stop = Arc::new(AtomicBool::new(false));
        let max = Arc::new(AtomicU64::new(0));
        let (s, m) = (stop.clone(), max.clone());
        let thread = std::thread::spawn(move || {
            while !s.load(Ordering::SeqCst) {
                m.fetch_max(f(), Ordering::SeqCst);
                std::thread::sleep(Duration::from_millis(20));
            }
        });
        Sampler { stop, max, thread }
    }

    fn finish(self) -> u64 {
        self.stop.store(true, Ordering::SeqCst);
        self.thread.join().expect("sampler thread");
        self.max.load(Ordering::SeqCst)
    }
}

/// The most processes any single uid of `range` has right now.
fn max_processes_per_uid(range: std::ops::Range<u32>) -> u64 {
    let mut count = std::collections::HashMap::<u32, u64>::new();
    for p in processes_with_uid(range) {
        *count.entry(p.uid).or_default() += 1;
    }
    count.values().copied().max().unwrap_or(0)
}

/// The pids controller's view of the containers under `parent`: the largest `pids.current`, and the largest count of
/// refused forks (`max` of `pids.events`).
fn pids_cgroup_state(parent: &str) -> (u64, u64) {
    let (mut current, mut refused) = (0, 0);
    for dir in cgroup_children(parent) {
        let read = |f: &str| std::fs::read_to_string(dir.join(f)).unwrap_or_default();
        if let Ok(n) = read("pids.current").trim().parse::<u64>() {
            current = current.max(n);
        }
        if let Some(n) = read("pids.events")
            .lines()
            .find_map(|l| l.strip_prefix("max "))
            .and_then(|n| n.trim().parse::<u64>().ok())
        {
            refused = refused.max(n);
        }
    }
    (current, refused)
}

/// The neighbour: forks a few children of its own (its pids budget is its own), sleeps, and finishes.
const NEIGHBOUR: &str = r#"
import os, time
kids = []
for i in range(8):
    p = os.fork()
    if p == 0:
        time.sleep(0.5)
        os._exit(0)
    kids.append(p)
for p in kids:
    os.waitpid(p, 0)
time.sleep(2)
print("neighbour done", len(kids))
"#;

/// Runs `bomb` next to the [`NEIGHBOUR`]; the neighbour must complete, the bomb stay within `pids_max` processes.
async fn bomb_next_to_a_neighbour(
    a: &mut Arena,
    case: &str,
    bomb: Value,
    pids_max: u64,
) -> Collected {
    let n_id = a.id("neighbour");
    let watch = a.watch().await;
    let range = a.d.uid_range();
    let sampler = Sampler::start(move || max_processes_per_uid(range.clone()));
    let parent = a.d.cgroup_parent.clone();
    let p2 = parent.clone();
    let current = Sampler::start(move || pids_cgroup_state(&parent).0);
    let refused = Sampler::start(move || pids_cgroup_state(&p2).1);
    let id = bomb["id"].as_str().unwrap().to_owned();
    a.c.send_json(&bomb).await;
    // Let the bomb reach its ceiling first.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let r =
        a.c.run(exec_json(&n_id, "python", NEIGHBOUR, 30_000, 128))
            .await;
    assert_eq!(
        (r.terminal_status(), r.stdout_text().as_str()),
        (Some(ExecStatus::Completed), "neighbour done 8\n"),
        "{case}: the neighbour execution did not finish normally: {}",
        r.dump()
    );
    let bomb = a.c.collect(&id).await;
    bomb.check_sequence();
    let most = sampler.finish();
    let (current, refused) = (current.finish(), refused.finish());
    a.watched(watch, case);
    eprintln!(
        "{case}: at most {most} processes of one execution seen on the host, pids.current at most {current}, \
         {refused} forks refused"
    );
    assert!(
        most <= pids_max && current <= pids_max,
        "{case}: a single execution had {most} processes on the host (pids.current {current}), above pids_max \
         {pids_max}"
    );
    assert!(
        refused > 0,
        "{case}: precondition: the bomb reached its ceiling (pids.current at most {current} of {pids_max}, \
         {refused} forks refused)"
    );
    a.after(case).await;
    bomb
}

#[tokio::test]
async fn fork_and_thread_bombs_stay_at_pids_max_while_a_neighbour_finishes() {
    let Some(_g) =
        privileged_alone("fork_and_thread_bombs_stay_at_pids_max_while_a_neighbour_finishes").await
    else {
        return;
    };
    let mut a = Arena::start("resources", opts()).await;

    // The shell classic, and a python one whose every process keeps retrying.
    for (case, lang, code) in [
        // `exec`: the main shell must not need a fork of its own once the bomb holds every pid (it would end
        // with "Cannot fork", exit 2, before its timeout).
        ("fork bomb (sh)", "shell", "b() { b | b & }; b; exec sleep 60"),
        (
            "fork bomb (python, retrying)",
            "python",
            "import os, time\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        time.sleep(0.001)\n",
        ),
    ] {
        let id = a.id(case);
        let bomb = with(
            exec_json(&id, lang, code, 4_000, 256),
            json!({"limits": {"pids_max": 64}}),
        );
        let r = bomb_next_to_a_neighbour(&mut a, case, bomb, 64).await;
        assert_eq!(
            r.terminal_status(),
            Some(ExecStatus::Timeout),
            "{case}: the bomb runs until its timeout: {}",
            r.dump()
        );
        a.contained(case);
    }

    // Threads count against pids_max too.
    let case = "thread bomb";
    let id = a.id(case);
    let code = r#"
import threading, time, json
n, err = 0, None
while True:
    try:
        threading.Thread(target=time.sleep, args=(30,), daemon=True).start()
        n += 1
    except RuntimeError as e:
        err = str(e)
        break
print(json.dumps({"threads": n, "error": err}), flush=True)
time.sleep(30)
"#;
    let bomb = with(
        exec_json(&id, "python", code, 4_000, 256),
        json!({"limits": {"pids_max": 64}}),
    );
    let r = bomb_next_to_a_neighbour(&mut a, case, bomb, 64).await;
    let out: Value = r
        .stdout_text()
        .lines()
        .find_map(|l| serde_json::from_str(l).ok())
        .unwrap_or_else(|| panic!("{case}: {}", r.dump()));
    assert!(
        out["threads"].as_u64().unwrap() < 64 && out["error"].is_string(),
        "{case}: thread creation stops below pids_max: {out}"
    );
    a.contained(case);
    a.finish();
}

#[tokio::test]
async fn memory_bombs_end_in_oom() {
    let Some(_g) = privileged("memory_bombs_end_in_oom").await else {
        return;
    };
    let mut a = Arena::start("resources", opts()).await;
    let cases = [
        (
            "memory bomb (heap)",
            "chunks = []\nwhile True:\n    chunks.append(b'x' * (1 << 20))\n",
        ),
        (
            "memory bomb (forked children)",
            "import os, time\nfor i in range(16):\n    if os.fork() == 0:\n        \
             b = bytearray(16 << 20)\n        for j in range(0, len(b), 4096): b[j] = 1\n        time.sleep(60)\n\
             chunks = []\nwhile True:\n    chunks.append(b'y' * (1 << 20))\n",
        ),
        (
            "memory bomb (tmpfs pages in /dev/shm)",
            "f = open('/dev/shm/fill', 'wb')\nwhile True:\n    f.write(b'z' * (1 << 20)); f.flush()\n",
        ),
        // Many processes each smaller than the container's init: the OOM killer's largest task is the init.
        (
            "memory bomb (many processes smaller than the init)",
            "#!sh\nfor i in $(seq 1 80); do\n  ( x=$(head -c 2000000 /dev/zero | tr '\\0' a); sleep 60 ) &\ndone\nwait\n",
        ),
    ];
    for (case, code) in cases {
        let lang = if code.starts_with("#!sh") {
            "shell"
        } else {
            "python"
        };
        let earlier = oom_victims(&a.d.cgroup_parent);
        let r = a
            .attack(case, |id| {
                with(
                    exec_json(id, lang, code, 30_000, 64),
                    json!({"limits": {"disk_mb": 256, "pids_max": 256}}),
                )
            })
            .await;
        // Near the limit a fork may also fail to charge its memory (ENOMEM): the shell gives up ("Cannot fork")
        // before anything is killed. Contained as well.
        let fork_refused = lang == "shell"
            && r.terminal_status() == Some(ExecStatus::Failed)
            && String::from_utf8_lossy(&r.stderr()).contains("Cannot fork");
        if !fork_refused {
            assert_eq!(
                r.terminal_status(),
                Some(ExecStatus::Oom),
                "{case}: {}",
                r.dump()
            );
            assert_eq!(r.result().reason, Reason::Oom, "{case}: {}", r.dump());
        }
        assert!(
            r.result().resource_usage.peak_memory_mb <= 64 + 8,
            "{case}: peak memory within the limit: {}",
            r.dump()
        );
        // Who the OOM killer picked: the kernel log names the task (its summaries are rate-limited, so this is
        // informational). `youki:[2:INIT]` is the container's init, which ends the whole execution at once.
        let victims: Vec<String> = oom_victims(&a.d.cgroup_parent)
            .into_iter()
            .filter(|v| !earlier.contains(v))
            .collect();
        eprintln!("{case}: OOM victims {victims:?}");
        a.contained(case);
    }
    a.finish();
}

/// `task=NAME,pid=N` of the OOM kills in containers under `parent`, from the kernel log (empty if unreadable).
fn oom_victims(parent: &str) -> Vec<String> {
    let log = std::process::Command::new("dmesg")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default();
    let needle = format!("oom_memcg=/{parent}/");
    log.lines()
        .filter(|l| l.contains(&needle))
        .filter_map(|l| {
            l.split_once(",task=")
                .map(|(_, t)| t.split(",uid=").next().unwrap_or(t).to_owned())
        })
        .collect()
}

#[tokio::test]
async fn disk_fills_get_enospc_and_the_next_job_starts_clean() {
    let Some(_g) = privileged("disk_fills_get_enospc_and_the_next_job_starts_clean").await else {
        return;
    };
    let mut a = Arena::start("resources", opts()).await;
    // Files of 4 MiB (below RLIMIT_FSIZE, which is disk_mb) until the space runs out, then many small ones.
    let fill = r#"
import json, os
out = {}
for d in ("/workspace", "/tmp", "/dev/shm"):
    written, err, n = 0, None, 0
    try:
        while written < (64 << 20):
            with open(d + "/fill%d" % n, "wb") as f:
                n += 1
                for i in range(4):
                    f.write(b"x" * (1 << 20))
                    f.flush()
                    written += 1 << 20
    except OSError as e:
        err = e.errno
    small = 0
    try:
        for i in range(1000):
            with open(d + "/small%d" % i, "wb") as f:
                f.write(b"y" * 4096)
            small += 1
    except OSError as e:
        pass
    out[d] = {"written_mb": written >> 20, "errno": err, "small": small}
print(json.dumps(out))
"#;
    let case = "disk fill";
    let out = a
        .attack_py(case, fill, json!({"disk_mb": 16, "memory_mb": 256}))
        .await;
    for d in ["/workspace", "/tmp", "/dev/shm"] {
        assert_eq!(
            out[d]["errno"], 28,
            "{case}: {d} filled up with ENOSPC: {out}"
        );
        assert_eq!(
            out[d]["small"], 0,
            "{case}: {d}: no room for small files either: {out}"
        );
        assert!(
            out[d]["written_mb"].as_u64().unwrap() <= 16,
            "{case}: {d} holds at most disk_mb: {out}"
        );
    }
    a.contained(case);

    // The next job sees an empty /workspace and /tmp with all of its space.
    let case = "next job after a disk fill";
    let probe = r#"
import json, os
def free(d):
    s = os.statvfs(d)
    return s.f_bavail * s.f_frsize >> 20
print(json.dumps({"workspace": os.listdir("/workspace"), "tmp": os.listdir("/tmp"),
                  "shm": os.listdir("/dev/shm"), "free_mb": free("/workspace"), "shm_free_mb": free("/dev/shm")}))
"#;
    let out = a
        .attack_py(case, probe, json!({"disk_mb": 16, "memory_mb": 256}))
        .await;
    assert_eq!(out["workspace"], json!([]), "{case}: {out}");
    assert_eq!(out["tmp"], json!([]), "{case}: {out}");
    assert_eq!(out["shm"], json!([]), "{case}: {out}");
    assert!(
        out["free_mb"].as_u64().unwrap() >= 15 && out["shm_free_mb"].as_u64().unwrap() >= 15,
        "{case}: the whole disk_mb is free again: {out}"
    );
    a.contained(case);
    a.finish();
}

/// What a large output produced, counted without keeping it.
#[derive(Debug, Default)]
struct Drained {
    stdout: u64,
    stderr: u64,
    chunks: u64,
    largest_chunk: usize,
    wrong_bytes: u64,
    status: Option<ExecStatus>,
    result: Option<protocol::ResultMessage>,
}

/// Reads execution `id` to its end, counting output bytes and checking each is `fill`.
async fn drain(c: &mut Client, id: &str, fill: u8) -> Drained {
    let mut d = Drained::default();
    loop {
        let (m, raw) = c.next_raw().await;
        assert_eq!(m.id(), Some(id), "{raw}");
        match m {
            ServerMessage::Stdout(ch) | ServerMessage::Stderr(ch) => {
                let bytes = ch.decode().expect("chunk decodes");
                d.chunks += 1;
                d.largest_chunk = d.largest_chunk.max(bytes.len());
                d.wrong_bytes += bytes.iter().filter(|b| **b != fill).count() as u64;
                if raw["type"] == "stdout" {
                    d.stdout += bytes.len() as u64;
                } else {
                    d.stderr += bytes.len() as u64;
                }
            }
            ServerMessage::Status { status, .. } if status.is_terminal() => d.status = Some(status),
            ServerMessage::Result(r) => {
                d.result = Some(r);
                return d;
            }
            ServerMessage::Error(e) => panic!("{id}: {e:?}"),
            _ => {}
        }
    }
}

/// An endless flood: 1 MiB on stdout and 4 KiB on stderr per round, until the output limit ends it.
const ENDLESS_FLOOD: &str =
    "import os\nb = b'f' * (1 << 20)\nwhile True:\n    os.write(1, b); os.write(2, b[:4096])\n";
/// One line of 64 MiB without a newline, written at once.
const LINE_OF_64_MIB: &str = "import sys\nsys.stdout.write('L' * (64 << 20))\nsys.stdout.flush()\n";
/// 32 MiB on stdout in writes of 1 MiB.
const FLOOD_OF_32_MIB: &str =
    "import os\nb = b's' * (1 << 20)\nfor i in range(32):\n    os.write(1, b)\n";
/// 8 processes writing one byte at a time for 3 s.
const ONE_BYTE_WRITES: &str =
    "import os, time\nfor i in range(7):\n    if os.fork() == 0: break\nend = time.time() + 3\n\
                               while time.time() < end:\n    os.write(1, b'.')\n";
/// 8 processes spinning forever.
const CPU_BURNER: &str =
    "import os\nfor i in range(7):\n    if os.fork() == 0: break\nwhile True: pass\n";

#[tokio::test]
async fn output_flood_and_a_64_mib_line_keep_the_daemon_small() {
    let Some(_g) = privileged_alone("output_flood_and_a_64_mib_line_keep_the_daemon_small").await
    else {
        return;
    };
    let mut a = Arena::start("resources", opts()).await;
    a.c.deadline = Duration::from_secs(120);

    an_endless_flood_is_cut_at_the_limit(&mut a).await;
    a_64_mib_line_streams_in_small_chunks(&mut a).await;
    a_stalled_reader_holds_the_flood_back(&mut a).await;
    one_byte_writes_from_8_processes_arrive_intact(&mut a).await;
    a_cpu_burner_times_out(&mut a).await;
    a.finish();
}

/// A sampler of the daemon's resident memory (KiB), for its peak during a case.
fn daemon_rss_sampler(pid: i32) -> Sampler {
    Sampler::start(move || vm_rss_kib(pid).unwrap_or(0))
}

/// Starts a python execution of `code` (120 s, `memory_mb`) whose output may reach `max_output_bytes`.
async fn send_flood(a: &mut Arena, id: &str, code: &str, memory_mb: u64, max_output_bytes: u64) {
    a.c.send_json(&with(
        exec_json(id, "python", code, 120_000, memory_mb),
        json!({"limits": {"max_output_bytes": max_output_bytes}}),
    ))
    .await;
}

/// The daemon's resident memory grew by less than [`RSS_GROWTH_BOUND_KIB`] from `before` to `peak`.
fn assert_rss_growth_bounded(case: &str, before: u64, peak: u64) {
    assert!(
        peak.saturating_sub(before) < RSS_GROWTH_BOUND_KIB,
        "{case}: the daemon's memory grew by {} KiB (bound {RSS_GROWTH_BOUND_KIB} KiB)",
        peak.saturating_sub(before)
    );
}

/// An endless flood on stdout and stderr, cut at [`FLOOD_LIMIT`].
async fn an_endless_flood_is_cut_at_the_limit(a: &mut Arena) {
    let case = "output flood";
    let pid = a.d.pid();
    let before = vm_rss_kib(pid).expect("daemon VmRSS");
    let sampler = daemon_rss_sampler(pid);
    let watch = a.watch().await;
    let id = a.id(case);
    let started = Instant::now();
    send_flood(a, &id, ENDLESS_FLOOD, 128, FLOOD_LIMIT).await;
    let d = drain(&mut a.c, &id, b'f').await;
    let took = started.elapsed();
    a.watched(watch, case);
    let peak = sampler.finish();
    let after = vm_rss_kib(pid).expect("daemon VmRSS");
    eprintln!(
        "{case}: {} MiB in {took:?}; daemon VmRSS {before} KiB before, {peak} KiB peak, {after} KiB after \
         (growth {} KiB)",
        (d.stdout + d.stderr) >> 20,
        peak.saturating_sub(before)
    );
    assert_flood_truncated_at_limit(case, &d);
    assert_rss_growth_bounded(case, before, peak);
    a.after(case).await;
    a.contained(case);
}

/// The flood failed with `output_limit`, truncated at exactly [`FLOOD_LIMIT`] bytes of its own output, in chunks
/// of at most 64 KiB.
fn assert_flood_truncated_at_limit(case: &str, d: &Drained) {
    assert_eq!(d.status, Some(ExecStatus::Failed), "{case}: {d:?}");
    let res = d.result.as_ref().unwrap();
    assert_eq!(res.reason, Reason::OutputLimit, "{case}: {d:?}");
    assert!(res.truncated, "{case}: {d:?}");
    assert_eq!(d.stdout + d.stderr, FLOOD_LIMIT, "{case}: {d:?}");
    assert_eq!(d.wrong_bytes, 0, "{case}: {d:?}");
    assert!(
        d.largest_chunk <= 64 << 10,
        "{case}: chunks of at most 64 KiB: {d:?}"
    );
}

/// One 64 MiB line without a newline, exactly at the limit: complete, streamed in chunks of at most 64 KiB.
async fn a_64_mib_line_streams_in_small_chunks(a: &mut Arena) {
    let case = "64 MiB line without newline";
    let pid = a.d.pid();
    let before = vm_rss_kib(pid).expect("daemon VmRSS");
    let sampler = daemon_rss_sampler(pid);
    let watch = a.watch().await;
    let id = a.id(case);
    send_flood(a, &id, LINE_OF_64_MIB, 512, 64 << 20).await;
    let d = drain(&mut a.c, &id, b'L').await;
    a.watched(watch, case);
    let peak = sampler.finish();
    eprintln!(
        "{case}: {} chunks; daemon VmRSS {before} KiB before, {peak} KiB peak (growth {} KiB)",
        d.chunks,
        peak.saturating_sub(before)
    );
    assert_eq!(d.status, Some(ExecStatus::Completed), "{case}: {d:?}");
    let res = d.result.as_ref().unwrap();
    assert_eq!(
        (res.stdout_bytes, res.truncated, d.stdout, d.wrong_bytes),
        (64 << 20, false, 64 << 20, 0),
        "{case}: {d:?}"
    );
    assert!(
        d.largest_chunk <= 64 << 10 && d.chunks >= 1024,
        "{case}: streamed in chunks of at most 64 KiB: {d:?}"
    );
    assert_rss_growth_bounded(case, before, peak);
    a.after(case).await;
    a.contained(case);
}

/// A flood nobody reads for 5 s: the daemon holds the program back instead of buffering.
async fn a_stalled_reader_holds_the_flood_back(a: &mut Arena) {
    let case = "flood with a stalled reader";
    let pid = a.d.pid();
    let before = vm_rss_kib(pid).expect("daemon VmRSS");
    let sampler = daemon_rss_sampler(pid);
    let watch = a.watch().await;
    let id = a.id(case);
    send_flood(a, &id, FLOOD_OF_32_MIB, 128, 32 << 20).await;
    tokio::time::sleep(Duration::from_secs(5)).await;
    let stalled_peak = sampler.finish();
    let sampler = daemon_rss_sampler(pid);
    let d = drain(&mut a.c, &id, b's').await;
    let peak = sampler.finish().max(stalled_peak);
    a.watched(watch, case);
    eprintln!(
        "{case}: daemon VmRSS {before} KiB before, {stalled_peak} KiB peak while stalled, {peak} KiB peak \
         (growth {} KiB)",
        peak.saturating_sub(before)
    );
    assert_eq!(
        (d.status, d.stdout, d.wrong_bytes),
        (Some(ExecStatus::Completed), 32 << 20, 0),
        "{case}: {d:?}"
    );
    assert_rss_growth_bounded(case, before, peak);
    a.after(case).await;
    a.contained(case);
}

/// Output in 1-byte writes from 8 processes for 3 s (as many messages as possible) arrives unchanged.
async fn one_byte_writes_from_8_processes_arrive_intact(a: &mut Arena) {
    let case = "flood of 1-byte writes";
    let pid = a.d.pid();
    let before = vm_rss_kib(pid).expect("daemon VmRSS");
    let sampler = daemon_rss_sampler(pid);
    let watch = a.watch().await;
    let id = a.id(case);
    send_flood(a, &id, ONE_BYTE_WRITES, 128, FLOOD_LIMIT).await;
    let d = drain(&mut a.c, &id, b'.').await;
    let peak = sampler.finish();
    a.watched(watch, case);
    eprintln!(
        "{case}: {} bytes in {} chunks; daemon VmRSS {before} KiB before, {peak} KiB peak (growth {} KiB)",
        d.stdout,
        d.chunks,
        peak.saturating_sub(before)
    );
    assert_eq!(
        (d.status, d.wrong_bytes),
        (Some(ExecStatus::Completed), 0),
        "{case}: {d:?}"
    );
    assert_rss_growth_bounded(case, before, peak);
    a.after(case).await;
    a.contained(case);
}

/// A cpu burner on every core times out, and the daemon still answers.
async fn a_cpu_burner_times_out(a: &mut Arena) {
    let case = "cpu burner";
    let r = a
        .attack(case, |id| exec_json(id, "python", CPU_BURNER, 3_000, 128))
        .await;
    assert_eq!(
        r.terminal_status(),
        Some(ExecStatus::Timeout),
        "{case}: {}",
        r.dump()
    );
    a.contained(case);
}

#[tokio::test]
async fn huge_argv_env_and_code_get_a_typed_outcome() {
    let Some(_g) = privileged("huge_argv_env_and_code_get_a_typed_outcome").await else {
        return;
    };
    let mut a = Arena::start("resources", opts()).await;

    // One environment variable of 4 MiB (above MAX_ARG_STRLEN), and 2048 of 2 KiB (4 MiB in all, above the
    // argument space of an 8 MiB stack).
    let one: serde_json::Map<String, Value> =
        [("HUGE".to_owned(), Value::from("e".repeat(4 << 20)))]
            .into_iter()
            .collect();
    let many: serde_json::Map<String, Value> = (0..2048)
        .map(|i| (format!("V{i}"), Value::from("v".repeat(2048))))
        .collect();
    for (case, env) in [
        ("env of one 4 MiB variable", one),
        ("env of 2048 x 2 KiB", many),
    ] {
        let r = a
            .attack(case, |id| {
                with(
                    exec_json(id, "python", "print('ran')", 30_000, 128),
                    json!({ "env": env }),
                )
            })
            .await;
        typed_exec_refusal(case, &r);
        a.contained(case);
    }

    // The program itself tries to exec with 16 MiB of arguments.
    let case = "argv of 16 MiB from inside";
    let out = a
        .attack_py(
            case,
            "import json, os\ntry:\n    os.execv('/bin/true', ['true'] + ['a' * 100000] * 160)\nexcept OSError as e:\n    \
             print(json.dumps({'errno': e.errno}))\n",
            json!({}),
        )
        .await;
    assert_eq!(out["errno"], 7, "{case}: E2BIG: {out}");
    a.contained(case);

    // 12 MiB of code (within max_frame_bytes): runs, or is refused with a typed error.
    let case = "12 MiB of code";
    let code = format!("print('big code ran')\n#{}\n", "c".repeat(12 << 20));
    let r = a
        .attack(case, |id| exec_json(id, "python", &code, 30_000, 256))
        .await;
    eprintln!("{case}: {:?}", r.kinds());
    match r.terminal_status() {
        Some(ExecStatus::Completed) => assert_eq!(r.stdout_text(), "big code ran\n"),
        _ => typed_exec_refusal(case, &r),
    }
    a.contained(case);
    a.finish();
}

/// An execution refused with `INVALID_REQUEST`, or one that ran the exec and failed with E2BIG (exit 127 and the
/// reason on stderr).
fn typed_exec_refusal(case: &str, r: &Collected) {
    eprintln!(
        "{case}: {:?}, stderr {:?}",
        r.kinds(),
        String::from_utf8_lossy(&r.stderr())
    );
    match r.messages.last() {
        Some(ServerMessage::Error(e)) => assert_eq!(
            e.code,
            protocol::ErrorCode::InvalidRequest,
            "{case}: {}",
            r.dump()
        ),
        Some(ServerMessage::Result(res)) => {
            let err = String::from_utf8_lossy(&r.stderr()).into_owned();
            assert_eq!(
                (r.terminal_status(), res.exit_code),
                (Some(ExecStatus::Failed), Some(127)),
                "{case}: {}",
                r.dump()
            );
            assert!(
                err.contains("Argument list too long"),
                "{case}: the reason is on stderr: {}",
                r.dump()
            );
            assert!(!r.stdout_text().contains("ran"), "{case}: {}", r.dump());
        }
        _ => panic!("{case}: {}", r.dump()),
    }
}

/// Reads the core, nofile and fsize rlimits and tries to raise each, opens files until refused, and looks for a
/// core file after a crash.
const RLIMIT_PROBE: &str = r#"
import errno, json, os, resource, signal, subprocess
out = {}
for name in ("RLIMIT_CORE", "RLIMIT_NOFILE", "RLIMIT_FSIZE"):
    lim = getattr(resource, name)
    out[name] = list(resource.getrlimit(lim))
    try:
        resource.setrlimit(lim, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        out[name + " raised"] = "OK"
    except (ValueError, OSError) as e:
        out[name + " raised"] = type(e).__name__
fds = []
try:
    while True:
        fds.append(os.open("/dev/null", os.O_RDONLY))
except OSError as e:
    out["open until"] = [len(fds) + 3, e.errno]
for fd in fds:
    os.close(fd)
p = subprocess.run(["python3", "-c", "import os; os.kill(os.getpid(), 11)"], cwd="/workspace")
out["segv"] = p.returncode
out["core files"] = [f for f in os.listdir("/workspace") + os.listdir("/tmp") if "core" in f]
print(json.dumps(out))
"#;
/// Counts the input files under /workspace/in and the bytes of /workspace/big.bin.
const COUNT_INPUTS: &str = "find /workspace/in -type f | wc -l; wc -c < /workspace/big.bin";
/// Writes six random files of 8 MiB under out/.
const SIX_ARTIFACTS_OF_8_MIB: &str = "import os\nos.makedirs('out')\nfor i in range(6):\n    open('out/f%d' % i, 'wb').write(os.urandom(8 << 20))\n";
/// A `result` message as the daemon would send it, with `ID` for the execution's id.
const FORGED_RESULT: &str = r#"{"v":1,"type":"result","id":"ID","exit_code":0,"duration_ms":1,"resource_usage":{"peak_memory_mb":1,"cpu_time_ms":1},"reason":"exited","stdout_bytes":0,"stderr_bytes":0,"truncated":false,"ts":"2026-01-01T00:00:00.000Z"}"#;

#[tokio::test]
async fn rlimits_hold_and_large_inputs_and_artifacts_keep_the_daemon_responsive() {
    let Some(_g) =
        privileged("rlimits_hold_and_large_inputs_and_artifacts_keep_the_daemon_responsive").await
    else {
        return;
    };
    let mut a = Arena::start("resources", opts()).await;

    rlimits_cannot_be_raised(&mut a).await;
    twenty_thousand_input_files_are_written_before_start(&mut a).await;
    artifacts_of_48_mib_are_all_stored(&mut a).await;
    protocol_messages_in_the_output_are_only_output(&mut a).await;
    a.finish();
}

/// rlimits: core 1, nofile 1024, fsize disk_mb; none can be raised; a crash leaves no core file.
async fn rlimits_cannot_be_raised(a: &mut Arena) {
    let case = "rlimits cannot be raised";
    let out = a
        .attack_py(case, RLIMIT_PROBE, json!({"disk_mb": 32, "memory_mb": 128}))
        .await;
    assert_eq!(out["RLIMIT_CORE"], json!([1, 1]), "{case}: {out}");
    assert_eq!(out["RLIMIT_NOFILE"], json!([1024, 1024]), "{case}: {out}");
    assert_eq!(
        out["RLIMIT_FSIZE"],
        json!([32 << 20, 32 << 20]),
        "{case}: fsize is disk_mb: {out}"
    );
    for k in [
        "RLIMIT_CORE raised",
        "RLIMIT_NOFILE raised",
        "RLIMIT_FSIZE raised",
    ] {
        assert_ne!(out[k], "OK", "{case}: {k}: {out}");
    }
    assert_eq!(
        out["open until"],
        json!([1024, 24]),
        "{case}: EMFILE at 1024: {out}"
    );
    assert_eq!(out["segv"], -11, "{case}: {out}");
    assert_eq!(out["core files"], json!([]), "{case}: {out}");
    a.contained(case);
}

/// 20 000 input files and a 10 MiB one: written before start, the daemon answering meanwhile.
async fn twenty_thousand_input_files_are_written_before_start(a: &mut Arena) {
    let case = "20000 input files";
    let mut files: Vec<Value> = (0..20_000)
        .map(|i| json!({"path": format!("in/{}/{i}.txt", i % 100), "content": "0123456789"}))
        .collect();
    files.push(json!({"path": "big.bin", "content": "b".repeat(10 << 20)}));
    let r = a
        .attack(case, |id| {
            with(
                exec_json(id, "shell", COUNT_INPUTS, 60_000, 128),
                json!({"files": files, "limits": {"disk_mb": 256}}),
            )
        })
        .await;
    assert_eq!(
        (r.terminal_status(), r.stdout_text().as_str()),
        (Some(ExecStatus::Completed), "20000\n10485760\n"),
        "{case}: {}",
        r.dump()
    );
    a.contained(case);
}

/// 48 MiB of artifacts: hashed and stored while the daemon keeps answering.
async fn artifacts_of_48_mib_are_all_stored(a: &mut Arena) {
    let case = "48 MiB of artifacts";
    let r = a
        .attack(case, |id| {
            with(
                exec_json(id, "python", SIX_ARTIFACTS_OF_8_MIB, 60_000, 256),
                json!({"artifacts": {"paths": ["out/*"]}, "limits": {"disk_mb": 128}}),
            )
        })
        .await;
    let manifest = r.result_raw()["artifacts"].clone();
    assert_eq!(
        manifest["artifacts"].as_array().map(Vec::len),
        Some(6),
        "{case}: {manifest}"
    );
    a.contained(case);
}

/// Output that looks like protocol messages (a forged `result`, terminal escapes) is only output.
async fn protocol_messages_in_the_output_are_only_output(a: &mut Arena) {
    let case = "protocol messages in the output";
    let r = a
        .attack(case, |id| {
            let line = FORGED_RESULT.replace("ID", id);
            exec_json(
                id,
                "python",
                &format!(
                    "import sys, time\nsys.stdout.write({line:?} + '\\n')\nsys.stdout.flush()\n\
                     sys.stderr.write('\\x1b]0;title\\x07\\x00\\r\\n')\ntime.sleep(0.5)\nsys.exit(3)\n"
                ),
                20_000,
                128,
            )
        })
        .await;
    assert_eq!(
        (r.terminal_status(), r.result().exit_code),
        (Some(ExecStatus::Failed), Some(3)),
        "{case}: the forged result did not end the execution: {}",
        r.dump()
    );
    assert!(
        r.stdout_text().contains(r#""type":"result""#),
        "{case}: {}",
        r.dump()
    );
    a.contained(case);
}

/// `/proc/sys/fs/aio-nr` and `aio-max-nr` of the host.
fn host_aio() -> (u64, u64) {
    let read = |f: &str| {
        std::fs::read_to_string(format!("/proc/sys/fs/{f}"))
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(0)
    };
    (read("aio-nr"), read("aio-max-nr"))
}

/// What `io_setup(2)` of one event gives a host process right now: `OK` or the error.
fn host_io_setup() -> String {
    let mut ctx: libc::c_ulong = 0;
    // SAFETY: io_setup writes one aio_context_t through the valid pointer; the context is destroyed right after.
    let r = unsafe {
        libc::syscall(
            libc::SYS_io_setup,
            1 as libc::c_long,
            &mut ctx as *mut libc::c_ulong,
        )
    };
    if r == 0 {
        // SAFETY: destroys the context created above.
        unsafe { libc::syscall(libc::SYS_io_destroy, ctx) };
        "OK".to_owned()
    } else {
        std::io::Error::last_os_error().to_string()
    }
}

#[tokio::test]
async fn host_wide_kernel_counters_are_not_exhausted() {
    let Some(_g) = privileged_alone("host_wide_kernel_counters_are_not_exhausted").await else {
        return;
    };
    let mut a = Arena::start("resources", opts()).await;

    // Linux AIO contexts count against one host-wide limit (fs.aio-max-nr), not against any cgroup: a program
    // that reserves them all makes io_setup(2) fail with EAGAIN for every process on the host (databases using
    // libaio) until it ends.
    let case = "AIO contexts (host-wide fs.aio-max-nr)";
    let code = r#"
import ctypes, json, os, sys, time
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
ctxs, reserved, err = [], 0, None
while len(ctxs) < 4096:
    ctx = ctypes.c_ulong(0)
    r = libc.syscall(206, ctypes.c_long(4096), ctypes.byref(ctx))
    if r != 0:
        err = ctypes.get_errno()
        break
    ctxs.append(ctx)
print(json.dumps({"contexts": len(ctxs), "errno": err}), flush=True)
print("holding", flush=True)
time.sleep(3)
"#;
    let id = a.id(case);
    let watch = a.watch().await;
    let (before, max) = host_aio();
    a.c.send_json(&exec_json(&id, "python", code, 30_000, 256))
        .await;
    a.c.observe(
        "the contexts to be held",
        super::harness::stdout_contains(&id, "holding"),
    )
    .await;
    let (held, _) = host_aio();
    let host_io_setup = host_io_setup();
    let r = a.c.collect(&id).await;
    a.watched(watch, case);
    a.after(case).await;
    let (after, _) = host_aio();
    eprintln!(
        "{case}: host aio-nr {before} before, {held} while the execution ran, {after} after (aio-max-nr {max}); {}",
        r.stdout_text().lines().next().unwrap_or("")
    );
    assert_eq!(after, before, "{case}: released at the end");
    assert!(
        held.saturating_sub(before) <= max / 2,
        "{case}: one execution reserved {} of the host's {max} AIO events (aio-nr {before} -> {held}): io_setup(2) \
         fails for every other process on the host while it runs (a host process got: {host_io_setup}); {}",
        held.saturating_sub(before),
        r.dump()
    );
    a.contained(case);
    a.finish();
}

/// Core dumps, ptys and inodes: `RLIMIT_CORE` is 1 soft and hard (0 would not stop a piped `core_pattern`, which
/// runs a helper as root on the host) and cannot be lowered to 0; a crash leaves no core file; devpts holds at
/// most 64 ptys and every tmpfs a bounded number of inodes. The host's `core_pattern` is left as it is.
const BOUNDS_PROBE: &str = r#"
import ctypes, errno, json, os, resource, signal, subprocess
out = {}
out["RLIMIT_CORE"] = list(resource.getrlimit(resource.RLIMIT_CORE))
# Through libc: python's resource.setrlimit turns EPERM into a ValueError.
libc = ctypes.CDLL(None, use_errno=True)
for name, lim in (("setrlimit(core, 0/0)", (0, 0)), ("setrlimit(core, 0/1)", (0, 1))):
    r = libc.setrlimit(4, (ctypes.c_ulong * 2)(*lim))
    out[name] = "OK" if r == 0 else errno.errorcode[ctypes.get_errno()]
try:
    resource.prlimit(0, resource.RLIMIT_CORE, (0, 0))
    out["prlimit(core, 0/0)"] = "OK"
except OSError as e:
    out["prlimit(core, 0/0)"] = errno.errorcode[e.errno]
out["RLIMIT_CORE after"] = list(resource.getrlimit(resource.RLIMIT_CORE))
# bash's ulimit counts 1024-byte blocks (1 byte shows as 0): prlimit(1) shows bytes.
sh = subprocess.run(["/bin/bash", "-c", "ulimit -c 0 2>/dev/null; echo rc=$?; ulimit -Sc 0 2>/dev/null; echo rc=$?; "
                     "prlimit --pid $$ --core --output SOFT,HARD --noheadings"],
                    capture_output=True, text=True)
out["ulimit"] = sh.stdout.split()
# A crash in /workspace and one in /tmp: the kernel must not dump.
dumped = []
for d in ("/workspace", "/tmp"):
    p = os.fork()
    if p == 0:
        os.chdir(d)
        os.kill(os.getpid(), signal.SIGSEGV)
        os._exit(0)
    _, status = os.waitpid(p, 0)
    dumped.append([d, os.WIFSIGNALED(status), os.WCOREDUMP(status)])
out["crashes"] = dumped
out["core files"] = [os.path.join(d, f) for d in ("/workspace", "/tmp") for f in os.listdir(d) if f.startswith("core")]
# ptys: open until the kernel refuses (at most 200).
ptys, err = [], None
while len(ptys) < 200:
    try:
        ptys.append(os.openpty())
    except OSError as e:
        err = errno.errorcode[e.errno]
        break
out["ptys"] = [len(ptys), err]
for m, s in ptys:
    os.close(m); os.close(s)
out["devpts options"] = [l.split(" - ")[1].split()[2] for l in open("/proc/self/mountinfo") if " - devpts " in l]
out["inodes"] = {p: os.statvfs(p).f_files for p in ("/workspace", "/tmp", "/dev", "/dev/shm")}
print(json.dumps(out))
"#;

#[tokio::test]
async fn core_dumps_ptys_and_tmpfs_inodes_are_bounded() {
    let Some(_g) = privileged("core_dumps_ptys_and_tmpfs_inodes_are_bounded").await else {
        return;
    };
    let mut a = Arena::start("resources", opts()).await;
    let case = "core dumps, ptys and inodes";
    let out = a
        .attack_py(case, BOUNDS_PROBE, json!({ "disk_mb": 64 }))
        .await;
    let mut wrong = Vec::new();
    let mut expect = |key: &str, want: Value| {
        if out[key] != want {
            wrong.push(format!("{key}: {} (expected {want})", out[key]));
        }
    };
    expect("RLIMIT_CORE", json!([1, 1]));
    expect("setrlimit(core, 0/0)", json!("EPERM"));
    expect("setrlimit(core, 0/1)", json!("EPERM"));
    expect("prlimit(core, 0/0)", json!("EPERM"));
    expect("RLIMIT_CORE after", json!([1, 1]));
    // bash: `ulimit -c 0` and `ulimit -Sc 0` fail, soft and hard stay 1 byte.
    expect("ulimit", json!(["rc=1", "rc=1", "1", "1"]));
    expect(
        "crashes",
        json!([["/workspace", true, false], ["/tmp", true, false]]),
    );
    expect("core files", json!([]));
    expect("ptys", json!([64, "ENOSPC"]));
    // 64 MiB of disk (and /dev/shm): one inode per 4 KiB page; /dev a dozen entries.
    expect(
        "inodes",
        json!({"/workspace": 16384, "/tmp": 16384, "/dev": 256, "/dev/shm": 16384}),
    );
    let devpts = out["devpts options"].to_string();
    if !devpts.contains("max=64") {
        wrong.push(format!("devpts options {devpts}: no max=64"));
    }
    assert!(
        wrong.is_empty(),
        "{case}:\n  {}\n(all: {out})",
        wrong.join("\n  ")
    );
    a.contained(case);
    a.finish();
}

//! Limits that end or restrain an execution: the wall-clock timeout (the whole process tree dies, double-forked
//! daemons included, and everything is cleaned up), memory (OOM), processes and scratch space (spec sections 3
//! and 4).

use std::time::Duration;

use protocol::{ExecStatus, Reason};
use serde_json::{json, Value};

use super::harness::{
    exec_json, privileged, processes_with_arg, stdout_contains, unique_marker, wait_until, with,
    Client, Daemon, DaemonOpts,
};

#[tokio::test]
async fn timeout_kills_the_whole_tree_and_cleans_up() {
    let Some(_g) = privileged("timeout_kills_the_whole_tree_and_cleans_up").await else {
        return;
    };
    let d = Daemon::start(DaemonOpts::default()).await;
    let mut c = Client::connect(&d).await;
    let tag = format!("3600.{}", unique_marker());
    // The program double-forks a `sleep` (own session, orphaned), waits until it runs, then sleeps itself.
    let code = format!(
        r#"
import os, sys, time
TAG = "{tag}"
pid = os.fork()
if pid == 0:
    os.setsid()
    if os.fork() == 0:
        os.execvp("sleep", ["sleep", TAG])
    os._exit(0)
os.waitpid(pid, 0)
deadline = time.time() + 5
while time.time() < deadline:
    if any(TAG.encode() in open("/proc/" + p + "/cmdline", "rb").read()
           for p in os.listdir("/proc") if p.isdigit() and os.path.exists("/proc/" + p + "/cmdline")):
        break
    time.sleep(0.01)
print("forked", flush=True)
time.sleep(3600)
"#
    );
    c.send_json(&exec_json("slow", "python", &code, 1000, 128))
        .await;
    c.observe(
        "the grandchild to be running",
        stdout_contains("slow", "forked"),
    )
    .await;
    let alive = processes_with_arg(&tag);
    assert!(
        !alive.is_empty(),
        "precondition: the double-forked sleep {tag} is visible on the host while the execution runs"
    );
    assert!(
        alive.iter().all(|p| d.uid_range().contains(&p.uid)),
        "it runs as the execution's host uid: {alive:?}"
    );

    let r = c.collect("slow").await;
    r.check_sequence();
    assert_eq!(
        r.terminal_status(),
        Some(ExecStatus::Timeout),
        "{}",
        r.dump()
    );
    let res = r.result();
    assert_eq!(res.reason, Reason::Timeout, "{}", r.dump());
    assert_eq!(res.exit_code, None, "{}", r.dump());
    assert!(
        res.duration_ms >= 1000,
        "killed after timeout_ms, not before: {}",
        r.dump()
    );

    wait_until(
        "the execution's processes, cgroups, mounts and files to be gone",
        Duration::from_secs(10),
        || async {
            let procs = processes_with_arg(&tag);
            if !procs.is_empty() {
                return Err(format!("processes {procs:?}"));
            }
            d.leftovers().await
        },
    )
    .await;
}

#[tokio::test]
async fn memory_limit_ends_in_oom() {
    let Some(_g) = privileged("memory_limit_ends_in_oom").await else {
        return;
    };
    let d = Daemon::start(DaemonOpts::default()).await;
    let mut c = Client::connect(&d).await;
    // 1 GiB, 1 MiB at a time, every page touched.
    let code = "chunks = []\nfor i in range(1024):\n    chunks.append(b'x' * (1 << 20))\nprint('survived')";
    let r = c.run(exec_json("oom-1", "python", code, 30_000, 64)).await;
    assert_eq!(r.terminal_status(), Some(ExecStatus::Oom), "{}", r.dump());
    let res = r.result();
    assert_eq!(res.reason, Reason::Oom, "{}", r.dump());
    assert_eq!(res.exit_code, None, "{}", r.dump());
    assert!(
        res.resource_usage.peak_memory_mb >= 50,
        "peak memory near the 64 MiB limit: {}",
        r.dump()
    );
    assert!(!r.stdout_text().contains("survived"));
    // The daemon goes on.
    c.run_completed(exec_json("after-oom", "shell", "echo fine", 20_000, 64))
        .await;
}

#[tokio::test]
async fn pids_and_disk_limits_are_enforced() {
    let Some(_g) = privileged("pids_and_disk_limits_are_enforced").await else {
        return;
    };
    let d = Daemon::start(DaemonOpts::default()).await;
    let mut c = Client::connect(&d).await;

    // pids_max 16: the 40th process cannot exist.
    let code = r#"
import os, time, json
started, error = 0, None
for i in range(40):
    try:
        pid = os.fork()
    except OSError as e:
        error = e.errno
        break
    if pid == 0:
        time.sleep(5)
        os._exit(0)
    started += 1
print(json.dumps({"started": started, "errno": error}))
"#;
    let r = c
        .run(with(
            exec_json("pids", "python", code, 30_000, 128),
            json!({"limits": {"pids_max": 16}}),
        ))
        .await;
    let out: Value =
        serde_json::from_slice(&r.stdout()).unwrap_or_else(|e| panic!("{e}: {}", r.dump()));
    assert!(
        out["started"].as_u64().unwrap() < 16,
        "pids_max 16 is enforced: {out}"
    );
    assert_eq!(out["errno"], 11, "fork fails with EAGAIN: {out}");

    // disk_mb 8: writing 32 MiB to /workspace fails with ENOSPC (or EFBIG from the file size limit).
    let code = r#"
import json
written, error = 0, None
try:
    with open("/workspace/big", "wb") as f:
        for i in range(32):
            f.write(b"x" * (1 << 20))
            f.flush()
            written += 1
except OSError as e:
    error = e.errno
print(json.dumps({"written_mb": written, "errno": error}))
"#;
    let r = c
        .run(with(
            exec_json("disk", "python", code, 30_000, 128),
            json!({"limits": {"disk_mb": 8}}),
        ))
        .await;
    let out: Value =
        serde_json::from_slice(&r.stdout()).unwrap_or_else(|e| panic!("{e}: {}", r.dump()));
    assert!(
        out["written_mb"].as_u64().unwrap() <= 8,
        "disk_mb 8 is enforced: {out}; {}",
        r.dump()
    );
    assert!(
        out["errno"] == 28 || out["errno"] == 27,
        "ENOSPC or EFBIG: {out}; {}",
        r.dump()
    );
}

/// The CPU time a container's cgroup has used, in microseconds (v1 `cpuacct.usage`, v2 `usage_usec` in
/// `cpu.stat`), from any of its leaves that accounts it.
fn cgroup_cpu_usage_us(leaves: &[std::path::PathBuf]) -> Option<u64> {
    leaves.iter().find_map(|l| {
        if let Ok(ns) = std::fs::read_to_string(l.join("cpuacct.usage")) {
            return ns.trim().parse::<u64>().ok().map(|ns| ns / 1000);
        }
        let stat = std::fs::read_to_string(l.join("cpu.stat")).ok()?;
        stat.lines()
            .find_map(|line| line.strip_prefix("usage_usec "))
            .and_then(|v| v.trim().parse().ok())
    })
}

/// Whether `leaf` carries the hard quota of half a core (v1 `cpu.cfs_quota_us` 50000 over the 100 ms period, v2
/// `cpu.max`).
fn has_half_core_quota(leaf: &std::path::Path) -> bool {
    let read = |f: &str| std::fs::read_to_string(leaf.join(f)).unwrap_or_default();
    (read("cpu.cfs_quota_us").trim() == "50000" && read("cpu.cfs_period_us").trim() == "100000")
        || read("cpu.max").trim() == "50000 100000"
}

#[tokio::test]
async fn cpu_cores_caps_a_busy_loop_at_its_quota() {
    let Some(_g) = privileged("cpu_cores_caps_a_busy_loop_at_its_quota").await else {
        return;
    };
    let d = Daemon::start(DaemonOpts::default()).await;
    let mut c = Client::connect(&d).await;
    let caps = c.ping().await.capabilities.expect("pong capabilities");
    assert!(
        caps.extensions.iter().any(|e| e == "cpu_cores"),
        "{:?}",
        caps.extensions
    );
    assert_eq!(
        caps.max_limits.cpu_cores.map(protocol::CpuCores::get),
        Some(2.0)
    );
    // Two processes spinning for 4 s: without the quota they could use two cores.
    let code = r#"
import os, time
end = time.time() + 4
child = os.fork()
print("spinning", flush=True)
while time.time() < end:
    pass
if child:
    os.waitpid(child, 0)
"#;
    let req = with(
        exec_json("busy", "python", code, 30_000, 128),
        json!({"limits": {"cpu_cores": 0.5}}),
    );
    c.send_json(&req).await;
    c.observe("the loop to spin", stdout_contains("busy", "spinning"))
        .await;
    // The quota is on the container's leaf while the program runs (written before it started).
    let leaves = d.cgroup_leftovers();
    let quota: Vec<_> = leaves.iter().filter(|l| has_half_core_quota(l)).collect();
    assert_eq!(
        quota.len(),
        1,
        "exactly the running container's leaf has the 0.5-core quota: {leaves:?}"
    );
    let name = quota[0].file_name().map(ToOwned::to_owned);
    let mine: Vec<_> = leaves
        .into_iter()
        .filter(|l| l.file_name().map(ToOwned::to_owned) == name)
        .collect();
    // Usage over one second of the loop.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let before = cgroup_cpu_usage_us(&mine).expect("the leaf accounts cpu time");
    let t0 = std::time::Instant::now();
    tokio::time::sleep(Duration::from_secs(1)).await;
    let used = cgroup_cpu_usage_us(&mine).expect("the leaf accounts cpu time") - before;
    let cores = used as f64 / t0.elapsed().as_micros() as f64;
    eprintln!("cpu_cores 0.5, two spinning processes: {cores:.3} cores over one second");
    // Generous bounds: the upper one is the quota (plus a period of slack at the window's edges); the lower one only
    // says the loop ran, since the machine's other load may leave it less than its quota.
    assert!(
        (0.15..=0.62).contains(&cores),
        "the loop used {cores:.3} cores with a quota of 0.5"
    );

    let r = c.collect("busy").await;
    assert_eq!(
        r.terminal_status(),
        Some(ExecStatus::Completed),
        "{}",
        r.dump()
    );
    let (limits, _) = r.ack();
    assert_eq!(
        limits
            .and_then(|l| l.cpu_cores)
            .map(protocol::CpuCores::get),
        Some(0.5),
        "ack.limits.cpu_cores reports the limit in effect: {}",
        r.dump()
    );
    let res = r.result();
    let ratio = res.resource_usage.cpu_time_ms as f64 / res.duration_ms as f64;
    eprintln!(
        "whole run: {} ms cpu in {} ms ({ratio:.3} cores)",
        res.resource_usage.cpu_time_ms, res.duration_ms
    );
    assert!(
        ratio <= 0.62,
        "the whole run stayed under its quota: {}",
        r.dump()
    );
}

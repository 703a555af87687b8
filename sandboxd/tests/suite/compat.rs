//! Compatibility: the hardening must not break real programs. Inside the sandbox, python's own test
//! modules pass, a node script using `child_process` and `worker_threads` runs, and a coreutils pipeline works.
//!
//! Excluded from python's tests, by name, with the reason:
//! - `test_user` and `test_group` (test_subprocess) and `test_chown_with_root` (test_os) switch to uid/gid 65534,
//!   which the user namespace does not map (container root is the only mapped id): `EINVAL` by design.

use protocol::{ExecStatus, Limits};
use serde_json::json;

use super::harness::{
    cannot_run, exec_json, privileged, with, Client, Daemon, DaemonOpts, MAX_LIMITS,
};

/// Python's test modules come from Debian's `libpython3.11-testsuite` (`.ci/run` installs it).
const PY_TESTS: &str = "/usr/lib/python3.11/test/test_os.py";

/// Tests that cannot pass with a single mapped uid (see the module docs).
const PY_EXCLUDED: &[(&str, &str)] = &[
    (
        "test_user",
        "switches to uid 65534, unmapped in the user namespace: EINVAL by design",
    ),
    (
        "test_group",
        "switches to gid 65534, unmapped in the user namespace: EINVAL by design",
    ),
    (
        "test_chown_with_root",
        "chowns to uid 65534, unmapped in the user namespace: EINVAL by design",
    ),
];

fn compat_opts() -> DaemonOpts {
    DaemonOpts {
        max_limits: Limits {
            timeout_ms: 300_000,
            memory_mb: 1024,
            pids_max: 512,
            disk_mb: 512,
            ..MAX_LIMITS
        },
        ..DaemonOpts::default()
    }
}

#[tokio::test]
async fn pythons_own_test_suite_passes_inside_the_sandbox() {
    let Some(_g) = privileged("pythons_own_test_suite_passes_inside_the_sandbox").await else {
        return;
    };
    if !std::path::Path::new(PY_TESTS).exists() {
        cannot_run(
            "pythons_own_test_suite_passes_inside_the_sandbox",
            &format!("{PY_TESTS} is missing: apt-get install libpython3.11-testsuite"),
        );
        return;
    }
    let d = Daemon::start(compat_opts()).await;
    let mut c = Client::connect(&d).await;
    c.deadline = std::time::Duration::from_secs(330);
    let ignore: String = PY_EXCLUDED
        .iter()
        .map(|(name, _)| format!(" -i {name}"))
        .collect();
    let script = format!(
        "exec /usr/bin/python3 -m test test_json test_re test_threading test_subprocess test_tempfile test_os \
         -v{ignore} 2>&1"
    );
    let r = c
        .run(with(
            exec_json("py-tests", "shell", &script, 300_000, 1024),
            json!({"limits": {"pids_max": 512, "disk_mb": 512, "max_output_bytes": 16 << 20}}),
        ))
        .await;
    let out = r.stdout_text();
    let tail: String = {
        let lines: Vec<&str> = out.lines().collect();
        lines[lines.len().saturating_sub(60)..].join("\n")
    };
    let failures: Vec<&str> = out
        .lines()
        .filter(|l| {
            l.ends_with("... FAIL")
                || l.ends_with("... ERROR")
                || l.starts_with("FAIL:")
                || l.starts_with("ERROR:")
        })
        .collect();
    assert!(
        r.terminal_status() == Some(ExecStatus::Completed) && out.contains("Tests result: SUCCESS"),
        "python's tests fail inside the sandbox ({:?}, {} ms):\n{}\n...\n{tail}",
        r.result().reason,
        r.result().duration_ms,
        failures.join("\n")
    );
    eprintln!(
        "python tests passed in {} ms; excluded: {PY_EXCLUDED:?}",
        r.result().duration_ms
    );
}

#[tokio::test]
async fn node_child_process_and_worker_threads_run() {
    let Some(_g) = privileged("node_child_process_and_worker_threads_run").await else {
        return;
    };
    let d = Daemon::start(DaemonOpts::default()).await;
    let mut c = Client::connect(&d).await;
    let pong = c.ping().await;
    let has_node = pong
        .capabilities
        .as_ref()
        .is_some_and(|caps| caps.languages.iter().any(|l| l.as_str() == "javascript"));
    if !has_node {
        cannot_run(
            "node_child_process_and_worker_threads_run",
            "node is not installed on the host",
        );
        return;
    }
    let code = r#"
const { execSync, spawnSync } = require('child_process');
const { Worker, isMainThread } = require('worker_threads');
const os = require('os');
const fs = require('fs');
const echoed = execSync('echo from-child && id -u').toString().trim().split('\n');
const piped = spawnSync('sh', ['-c', "seq 1 5 | awk '{s+=$1} END {print s}'"]).stdout.toString().trim();
fs.writeFileSync('/tmp/node.txt', 'written');
const w = new Worker(`
  const { parentPort } = require('worker_threads');
  let s = 0; for (let i = 1; i <= 1000000; i++) s += i;
  parentPort.postMessage(s);
`, { eval: true });
w.on('message', (sum) => {
  console.log(JSON.stringify({ echoed, piped, sum, file: fs.readFileSync('/tmp/node.txt', 'utf8'), cpus: os.cpus().length > 0 }));
});
w.on('error', (e) => { console.error('worker failed', e); process.exit(1); });
"#;
    let r = c
        .run_completed(exec_json("node-compat", "javascript", code, 60_000, 512))
        .await;
    let out: serde_json::Value = serde_json::from_str(r.stdout_text().trim())
        .unwrap_or_else(|e| panic!("{e}: {}", r.dump()));
    assert_eq!(out["echoed"], json!(["from-child", "0"]), "{out}");
    assert_eq!(out["piped"], "15", "{out}");
    assert_eq!(out["sum"], 500000500000u64, "{out}");
    assert_eq!(out["file"], "written", "{out}");
}

#[tokio::test]
async fn a_coreutils_pipeline_works() {
    let Some(_g) = privileged("a_coreutils_pipeline_works").await else {
        return;
    };
    let d = Daemon::start(DaemonOpts::default()).await;
    let mut c = Client::connect(&d).await;
    let script = r#"
set -e
echo "count $(seq 1 100000 | sort -rn | head -n 5 | wc -l)"
echo "top $(seq 1 100000 | sort -rn | head -n 1)"
echo "sum $(seq 1 1000 | sha256sum | cut -d' ' -f1)"
yes | head -n 3 > /dev/null
echo "yes-head $?"
printf 'b\na\nc\na\n' | sort | uniq -c | tr -s ' ' | sed 's/^ //' | tr '\n' ',' ; echo
echo "grep $(seq 1 100 | grep -c 7)"
mkdir -p /workspace/d && echo hi > /workspace/d/f && tar -C /workspace -cf - d | tar -tf - | tr '\n' ' '; echo
echo "date $(date -u +%Y >/dev/null && echo ok)"
echo "xargs $(seq 1 4 | xargs -n 2 echo | wc -l)"
"#;
    let r = c
        .run(exec_json("coreutils", "shell", script, 30_000, 128))
        .await;
    let expected_sum = {
        let seq: String = (1..=1000).map(|i| format!("{i}\n")).collect();
        super::attack::sha256_hex(seq.as_bytes())
    };
    assert_eq!(
        r.terminal_status(),
        Some(ExecStatus::Completed),
        "{}",
        r.dump()
    );
    assert_eq!(
        r.stdout_text(),
        format!(
            "count 5\ntop 100000\nsum {expected_sum}\nyes-head 0\n2 a,1 b,1 c,\ngrep 19\nd/ d/f \ndate ok\nxargs 2\n"
        ),
        "{}",
        r.dump()
    );
}

//! Live restore of E2B sandboxes (`agents.live_restore: true`, docs/spec/e2b-compat.md), driven by the unchanged
//! Python SDK (tests/e2b/live_restore_check.py, from the venv tests/e2b/setup.sh makes) in phases around restarts of
//! the daemon (SIGKILL, then SIGTERM; each time a new daemon on the same config, so the same state_dir and facade
//! port): the sandbox comes back with its files, metadata, end time and running processes; `commands.list()` shows
//! the ticker started before, `commands.connect(pid)` re-attaches to its output (later, consecutive ticks, beginning
//! no later than what it wrote while no daemon ran) and `commands.kill(pid)` ends it; a process started by the new
//! daemon survives the next restart, as does a `set_timeout` made after the first one. A sandbox whose end time
//! passes while the daemon restarts is gone when it should be. Afterwards nothing is left.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use serde_json::{json, Value};

use super::e2b_sdk::{facade_get, venv};
use super::harness::*;

/// How long one phase of the script may run (a sandbox, a few calls, a few seconds of ticks).
const SCRIPT_DEADLINE: Duration = Duration::from_secs(3 * 60);

/// The ticker's command line as the host shows it (`bash -c <script>`): it runs in the sandbox.
const TICKER_MARK: &str = "echo tick $i; i=$((i+1)); sleep 0.2";

/// The tickers running in `d`'s sandboxes (in a cgroup under its parent; other daemons' are not its business).
fn tickers(d: &Daemon) -> Vec<ProcInfo> {
    let under = format!("/{}/", d.cgroup_parent);
    processes_with_arg(TICKER_MARK)
        .into_iter()
        .filter(|p| {
            std::fs::read_to_string(format!("/proc/{}/cgroup", p.pid))
                .is_ok_and(|c| c.contains(&under))
        })
        .collect()
}

/// The ids `GET /v2/sandboxes` lists.
async fn listed(port: u16, api_key: &str) -> Result<Vec<String>, String> {
    match facade_get(port, "/v2/sandboxes", api_key).await? {
        (200, Value::Array(items)) => Ok(items
            .iter()
            .filter_map(|s| s["sandboxID"].as_str().map(str::to_owned))
            .collect()),
        other => Err(format!("GET /v2/sandboxes: {other:?}")),
    }
}

/// Waits until the facade answers on its listener (after a start or a restart).
async fn facade_up(d: &Daemon, port: u16) {
    wait_until(
        "the facade to answer on its listener",
        Duration::from_secs(30),
        || async { listed(port, d.token()).await.map(|_| ()) },
    )
    .await;
}

/// A daemon with live restore and the facade on a port of its own (the same after a restart: the new daemon reads
/// the same config); returns once the facade answers.
async fn start() -> (Daemon, u16) {
    let port = free_port();
    let d = Daemon::start(DaemonOpts {
        extra_config: Some(json!({
            "agents": {"live_restore": true},
            "e2b": {"listen": format!("127.0.0.1:{port}")},
        })),
        ..DaemonOpts::default()
    })
    .await;
    facade_up(&d, port).await;
    (d, port)
}

/// Words of the daemon's log lines shown when a phase fails.
const LOG_WORDS: [&str; 7] = [
    "e2b",
    "E2B",
    "WARN",
    "ERROR",
    "taken back",
    "restor",
    "adopt",
];

/// The daemon's log lines that bear on the sandboxes (`ids`), on E2B, or on anything that went wrong: the last 60.
fn log_excerpt(d: &Daemon, ids: &[&str]) -> String {
    let log = d.log();
    let lines: Vec<&str> = log
        .lines()
        .filter(|l| {
            ids.iter().any(|id| !id.is_empty() && l.contains(id))
                || (LOG_WORDS.iter().any(|w| l.contains(w))
                    && !l.contains("removed a leftover cgroup"))
        })
        .collect();
    lines[lines.len().saturating_sub(60)..].join("\n")
}

/// [`try_script`], panicking with its report when a check failed.
async fn script(venv: &Path, d: &Daemon, port: u16, args: &[&str], ids: &[&str]) -> Vec<String> {
    let (lines, failure) = try_script(venv, d, port, args, ids).await;
    if let Some(report) = failure {
        panic!("{report}");
    }
    lines
}

/// Runs tests/e2b/live_restore_check.py with `args` from the repository's root, with only the facade's environment
/// for the SDK; prints its output and returns its stdout's lines and, when it did not end with `OK`, a report: its
/// failed checks, the end of its stderr and the daemon's log lines about `ids`.
async fn try_script(
    venv: &Path,
    d: &Daemon,
    port: u16,
    args: &[&str],
    ids: &[&str],
) -> (Vec<String>, Option<String>) {
    let url = format!("http://127.0.0.1:{port}");
    let repo = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the workspace root");
    let mut cmd = tokio::process::Command::new(venv.join("bin/python"));
    cmd.arg("tests/e2b/live_restore_check.py")
        .args(args)
        .current_dir(repo)
        .env_clear()
        .env("PATH", "/usr/local/bin:/usr/bin:/bin")
        .env("E2B_API_KEY", d.token())
        .env("E2B_API_URL", &url)
        .env("E2B_SANDBOX_URL", &url)
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .env("PYTHONUNBUFFERED", "1")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    let what = format!(
        "live_restore_check.py {}",
        args.iter()
            .map(|a| if a.len() > 40 { "<state>" } else { a })
            .collect::<Vec<_>>()
            .join(" ")
    );
    let started = Instant::now();
    let out = tokio::time::timeout(SCRIPT_DEADLINE, cmd.output())
        .await
        .unwrap_or_else(|_| {
            panic!(
                "{what}: still running after {SCRIPT_DEADLINE:?} (killed)\ndaemon log lines:\n{}",
                log_excerpt(d, ids)
            )
        })
        .unwrap_or_else(|e| panic!("{what}: cannot start: {e}"));
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    println!(
        "===== {what}: {} after {:.1} s\n{stdout}----- stderr\n{stderr}===== end",
        out.status,
        started.elapsed().as_secs_f64()
    );
    let lines: Vec<String> = stdout.lines().map(str::to_owned).collect();
    if !out.status.success() || lines.last().map(String::as_str) != Some("OK") {
        let failed: Vec<&str> = lines
            .iter()
            .filter(|l| l.starts_with("CHECK FAIL") || l.starts_with("stopped after"))
            .map(String::as_str)
            .collect();
        let err: Vec<&str> = stderr.lines().collect();
        let report = format!(
            "{what}: {}\nfailed checks:\n{}\nstderr (end):\n{}\ndaemon log lines:\n{}",
            out.status,
            failed.join("\n"),
            err[err.len().saturating_sub(25)..].join("\n"),
            log_excerpt(d, ids)
        );
        println!("FAIL {report}");
        return (lines, Some(report));
    }
    (lines, None)
}

/// The JSON of the script's `STATE` line, if it printed one.
fn try_state(lines: &[String]) -> Option<Value> {
    let line = lines.iter().find_map(|l| l.strip_prefix("STATE "))?;
    Some(serde_json::from_str(line).unwrap_or_else(|e| panic!("STATE {line}: {e}")))
}

/// The JSON of the script's `STATE` line.
fn state(lines: &[String]) -> Value {
    try_state(lines).unwrap_or_else(|| panic!("no STATE line in {lines:#?}"))
}

/// Stops the daemon with `how` (SIGKILL: [`Daemon::kill_hard`]; SIGTERM: a clean stop, waited for), checks that the
/// sandboxes' processes (the ticker, when `ticker`) outlived it, leaves it down for a while (the ticker goes on
/// writing into its pipe meanwhile), starts it again and waits for the facade. Returns when the old daemon was gone
/// (wall clock, seconds since the epoch).
async fn restart(d: &mut Daemon, port: u16, how: Signal, ticker: bool) -> f64 {
    if how == Signal::SIGKILL {
        d.kill_hard();
    } else {
        d.signal(how);
        assert!(
            d.wait_exit(Duration::from_secs(30)).is_some(),
            "the daemon did not stop within 30 s of {how}"
        );
    }
    let down = Instant::now();
    let down_at = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("the clock is after 1970")
        .as_secs_f64();
    if ticker {
        assert!(
            !tickers(d).is_empty(),
            "after {how} of the daemon, the sandbox's ticker is gone (live restore keeps it running)"
        );
    }
    // Down for a while on purpose: the ticker writes some 7 ticks that no daemon reads.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    if ticker {
        assert!(
            !tickers(d).is_empty(),
            "the sandbox's ticker died while no daemon ran ({how})"
        );
    }
    d.restart().await;
    facade_up(d, port).await;
    let took = down.elapsed();
    println!(
        "daemon restarted after {how}: down {:.1} s",
        took.as_secs_f64()
    );
    down_at
}

/// Every sandbox was killed: the facade lists none, and nothing of their containers is left on the host (no cgroup
/// leaf, scratch mount or process beyond the pool's, no sandbox directory).
async fn nothing_left(d: &Daemon, port: u16) {
    assert_eq!(
        facade_get(port, "/v2/sandboxes", d.token()).await,
        Ok((200, json!([]))),
        "sandboxes left after the script ended"
    );
    let e2b_dir = PathBuf::from(format!("/proc/{}/root", d.pid()))
        .join(d.state_dir.strip_prefix("/").unwrap_or(&d.state_dir))
        .join("e2b");
    wait_until(
        "nothing of the sandboxes left",
        Duration::from_secs(20),
        || async {
            d.leftovers().await?;
            let dirs: Vec<_> = std::fs::read_dir(&e2b_dir)
                .map(|rd| rd.flatten().map(|e| e.path()).collect())
                .unwrap_or_default();
            match dirs.is_empty() {
                true => Ok(()),
                false => Err(format!("sandbox directories left: {dirs:?}")),
            }
        },
    )
    .await;
    let left = tickers(d);
    assert!(left.is_empty(), "a ticker outlived its sandbox: {left:?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn an_e2b_sandbox_and_its_processes_outlive_daemon_restarts() {
    const TEST: &str = "an_e2b_sandbox_and_its_processes_outlive_daemon_restarts";
    let Some(_g) = privileged(TEST).await else {
        return;
    };
    let Some(venv) = venv(TEST) else {
        return;
    };
    let (mut d, port) = start().await;
    let lines = script(&venv, &d, port, &["before"], &[]).await;
    let mut st = state(&lines);
    let id = st["sandbox_id"].as_str().expect("sandbox_id").to_owned();
    // Round 1 (SIGKILL) re-arms: a new ticker started by the restarted daemon, and a set_timeout it made, must
    // outlive round 2 (SIGTERM) in turn. Failures are reported at the end, so one round's do not hide the next's.
    let mut failures = Vec::new();
    for (how, rearm) in [(Signal::SIGKILL, true), (Signal::SIGTERM, false)] {
        st["down_at"] = json!(restart(&mut d, port, how, true).await);
        let list = listed(port, d.token()).await;
        if list != Ok(vec![id.clone()]) {
            let failure = format!("after {how}, GET /v2/sandboxes lists {list:?}, not [{id}]");
            println!("FAIL {failure}");
            failures.push(failure);
        }
        let st_json = st.to_string();
        let mut args = vec!["after", st_json.as_str()];
        if rearm {
            args.push("rearm");
        }
        let (lines, failure) = try_script(&venv, &d, port, &args, &[&id]).await;
        failures.extend(failure);
        if rearm {
            st = try_state(&lines).unwrap_or_else(|| {
                panic!(
                    "no STATE line for the next round; failures:\n{}",
                    failures.join("\n\n")
                )
            });
            assert_eq!(st["sandbox_id"], id.as_str());
        }
    }
    let (_, failure) = try_script(&venv, &d, port, &["kill", &id], &[&id]).await;
    failures.extend(failure);
    if !failures.is_empty() {
        println!(
            "FAILURES before the final checks:\n{}",
            failures.join("\n\n")
        );
    }
    nothing_left(&d, port).await;
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

#[tokio::test(flavor = "multi_thread")]
async fn an_e2b_sandbox_s_end_time_survives_a_daemon_restart() {
    const TEST: &str = "an_e2b_sandbox_s_end_time_survives_a_daemon_restart";
    let Some(_g) = privileged(TEST).await else {
        return;
    };
    let Some(venv) = venv(TEST) else {
        return;
    };
    let (mut d, port) = start().await;
    let lines = script(&venv, &d, port, &["short"], &[]).await;
    let st = state(&lines);
    let short = st["short"].as_str().expect("short").to_owned();
    let long = st["long"].as_str().expect("long").to_owned();
    restart(&mut d, port, Signal::SIGKILL, false).await;
    let st_json = st.to_string();
    script(
        &venv,
        &d,
        port,
        &["short-after", &st_json],
        &[&short, &long],
    )
    .await;
    nothing_left(&d, port).await;
}

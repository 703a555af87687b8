//! Operations: the systemd unit (`systemd/sandboxd.service`: its `ExecStart` line run for real with a
//! `NOTIFY_SOCKET`, and `systemd-analyze verify`), and `GET /metrics` counting real executions behind the token.

use std::os::unix::net::UnixDatagram;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use nix::unistd::Pid;
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::harness::{
    cannot_run, exec_json, free_port, http_get, on_ci, privileged, wait_until, CgroupParentGuard,
    Client, Daemon, DaemonOpts, SANDBOXD,
};

/// The unit file, as shipped.
const UNIT: &str = include_str!("../../../systemd/sandboxd.service");
/// Where the unit expects the binary and the config.
const UNIT_BINARY: &str = "/usr/local/bin/sandboxd";
const UNIT_CONFIG: &str = "/etc/sandboxd/config.yaml";

/// The unit's `ExecStart=` command line, split on whitespace (it has no quoting).
fn unit_exec_start() -> Vec<String> {
    let line = UNIT
        .lines()
        .find_map(|l| l.strip_prefix("ExecStart="))
        .expect("the unit has an ExecStart= line");
    line.split_whitespace().map(str::to_owned).collect()
}

/// Receives notify datagrams until one contains `want` (a line of it), or panics after `deadline`; returns every
/// line received on the way, `want` included.
fn receive_until(
    sock: &UnixDatagram,
    want: &str,
    deadline: Duration,
    log: &dyn Fn() -> String,
) -> Vec<String> {
    let start = Instant::now();
    let mut lines = Vec::new();
    let mut buf = vec![0u8; 4096];
    loop {
        let left = deadline.saturating_sub(start.elapsed());
        assert!(
            !left.is_zero(),
            "no {want} within {deadline:?}; received {lines:?}; daemon log:\n{}",
            log()
        );
        sock.set_read_timeout(Some(left.min(Duration::from_millis(500))))
            .unwrap();
        match sock.recv(&mut buf) {
            Ok(n) => {
                let text = String::from_utf8_lossy(&buf[..n]).into_owned();
                let done = text.lines().any(|l| l == want);
                lines.extend(text.lines().map(str::to_owned));
                if done {
                    return lines;
                }
            }
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) => {}
            Err(e) => panic!("recv on the notify socket: {e}"),
        }
    }
}

/// The unit's `ExecStart` (binary and config path substituted) under a `NOTIFY_SOCKET` and a watchdog: `READY=1`
/// once it serves, `WATCHDOG=1` at half `WATCHDOG_USEC`, `STOPPING=1` at SIGTERM, then a clean exit.
#[tokio::test]
async fn unit_exec_start_notifies_ready_watchdog_and_stopping() {
    let Some(_g) = privileged("unit_exec_start_notifies_ready_watchdog_and_stopping").await else {
        return;
    };
    let argv = unit_exec_start();
    assert_eq!(argv[0], UNIT_BINARY, "ExecStart runs {argv:?}");
    assert!(
        argv.iter().any(|a| a == UNIT_CONFIG),
        "ExecStart reads {UNIT_CONFIG}: {argv:?}"
    );
    let argv: Vec<String> = argv
        .into_iter()
        .map(|a| match a.as_str() {
            UNIT_BINARY => SANDBOXD.to_owned(),
            _ => a,
        })
        .collect();

    let dir = tempfile::Builder::new()
        .prefix("sandboxd-unit-")
        .tempdir()
        .unwrap();
    // Containers' unprivileged uids traverse state_dir.
    std::fs::set_permissions(
        dir.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();
    let pid = std::process::id();
    let parent = format!("sandboxd-test-{pid}-unit");
    let _cleanup = CgroupParentGuard(parent.clone());
    let port = free_port();
    let token = format!("unit-token-{pid}-{:016x}", rand::random::<u64>());
    let config = dir.path().join("config.yaml");
    std::fs::write(
        &config,
        serde_json::to_string_pretty(&json!({
            "listen": format!("127.0.0.1:{port}"),
            "state_dir": dir.path().join("state"),
            "auth": {"tokens": [token]},
            "capacity": {"max_concurrent": 2, "max_queue": 2},
            "shutdown_grace_ms": 2000,
            "sandbox": {"cgroup_parent": parent, "uid_base": 1_000_000 + (pid % 20_000) * 8192 + 120 * 64},
        }))
        .unwrap(),
    )
    .unwrap();
    let argv: Vec<String> = argv
        .into_iter()
        .map(|a| match a.as_str() {
            UNIT_CONFIG => config.display().to_string(),
            _ => a,
        })
        .collect();

    let notify_path = dir.path().join("notify.sock");
    let sock = UnixDatagram::bind(&notify_path).unwrap();
    let stderr_path = dir.path().join("stderr.log");
    let mut child = Command::new(&argv[0])
        .args(&argv[1..])
        .env("NOTIFY_SOCKET", &notify_path)
        .env("WATCHDOG_USEC", "200000")
        .env_remove("WATCHDOG_PID")
        .env_remove("SANDBOXD_TOKEN")
        .env_remove("SANDBOXD_LOG")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&stderr_path).unwrap())
        .spawn()
        .unwrap();
    let log = || std::fs::read_to_string(&stderr_path).unwrap_or_default();

    let ready = receive_until(&sock, "READY=1", Duration::from_secs(60), &log);
    // READY=1 means serving: the health endpoint answers at once.
    let (code, _) = http_get(port, "/healthz").await.unwrap();
    assert_eq!(
        code, 200,
        "healthz right after READY=1; notifications {ready:?}"
    );
    // Two pings at 100 ms intervals.
    let mut pings = ready.iter().filter(|l| *l == "WATCHDOG=1").count();
    while pings < 2 {
        pings += receive_until(&sock, "WATCHDOG=1", Duration::from_secs(5), &log)
            .iter()
            .filter(|l| *l == "WATCHDOG=1")
            .count();
    }

    nix::sys::signal::kill(Pid::from_raw(child.id() as i32), Signal::SIGTERM).unwrap();
    receive_until(&sock, "STOPPING=1", Duration::from_secs(10), &log);
    let start = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if start.elapsed() > Duration::from_secs(15) {
            let _ = child.kill();
            panic!("sandboxd still runs 15 s after SIGTERM; log:\n{}", log());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert!(
        status.success(),
        "exit after SIGTERM: {status}; log:\n{}",
        log()
    );
}

/// `systemd-analyze verify` accepts the unit (with `ExecStart` pointing at the built binary, which it checks
/// exists). The exposure score of `systemd-analyze security --offline=true` is printed for the README.
#[test]
fn unit_passes_systemd_analyze_verify() {
    let test = "unit_passes_systemd_analyze_verify";
    if Command::new("systemd-analyze")
        .arg("--version")
        .output()
        .is_err()
    {
        cannot_run(
            test,
            "systemd-analyze is not installed (apt-get install systemd)",
        );
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let unit = dir.path().join("sandboxd.service");
    std::fs::write(&unit, UNIT.replace(UNIT_BINARY, SANDBOXD)).unwrap();
    let out = Command::new("systemd-analyze")
        .arg("verify")
        .arg(&unit)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "systemd-analyze verify failed: {}\n{stderr}",
        out.status
    );
    // verify reports some problems (unknown directives, bad values) on stderr with a zero exit status.
    assert!(
        !stderr.contains(unit.to_str().unwrap()),
        "systemd-analyze verify complains about the unit:\n{stderr}"
    );
    let security = Command::new("systemd-analyze")
        .args(["security", "--offline=true"])
        .arg(&unit)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&security.stdout);
    match text.lines().find(|l| l.contains("Overall exposure level")) {
        Some(line) => eprintln!("systemd-analyze security: {line}"),
        None if on_ci() => {}
        None => eprintln!(
            "systemd-analyze security --offline=true gave no score (systemd older than 250?)"
        ),
    }
}

/// A minimal HTTP/1.1 GET with optional bearer token: status code and body.
pub(super) async fn get_with_token(port: u16, path: &str, token: Option<&str>) -> (u16, String) {
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .unwrap();
    let auth = token
        .map(|t| format!("Authorization: Bearer {t}\r\n"))
        .unwrap_or_default();
    s.write_all(
        format!("GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n{auth}Connection: close\r\n\r\n")
            .as_bytes(),
    )
    .await
    .unwrap();
    let mut buf = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut buf))
        .await
        .expect("HTTP GET timed out")
        .unwrap();
    let text = String::from_utf8_lossy(&buf).into_owned();
    let code = text
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("not an HTTP response: {text:?}"));
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    (code, body)
}

/// The value of one series (`name{labels}` exactly as exposed), 0 when absent.
pub(super) fn series(text: &str, name: &str) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .find_map(|l| {
            let (n, v) = l.rsplit_once(' ')?;
            (n == name).then(|| v.parse().ok()).flatten()
        })
        .unwrap_or(0.0)
}

/// Executions move `sandboxd_executions_total` by language and reason and the latency histograms, on the main
/// listener and on `metrics_listen`; both refuse a missing or wrong token.
#[tokio::test]
async fn metrics_count_executions_by_reason_and_language_behind_the_token() {
    let Some(_g) =
        privileged("metrics_count_executions_by_reason_and_language_behind_the_token").await
    else {
        return;
    };
    let metrics_port = free_port();
    let d = Daemon::start(DaemonOpts {
        extra_config: Some(json!({"metrics_listen": format!("127.0.0.1:{metrics_port}")})),
        ..DaemonOpts::default()
    })
    .await;

    for port in [d.port, metrics_port] {
        let (code, body) = get_with_token(port, "/metrics", None).await;
        assert_eq!(code, 401, "no token on port {port}: {body}");
        let (code, body) = get_with_token(port, "/metrics", Some("not-the-token-at-all")).await;
        assert_eq!(code, 401, "wrong token on port {port}: {body}");
        assert!(
            !body.contains("sandboxd_"),
            "a refusal reveals nothing: {body}"
        );
    }
    // The pool gauge is read at scrape time: wait for a full pool (one ready container per language here).
    let ready = wait_until("the pool to be full", Duration::from_secs(20), || async {
        let (_, h) = d.healthz().await;
        let (ready, per) = (
            h["pool"]["ready"].as_u64(),
            h["pool"]["per_language"].as_u64(),
        );
        let langs = h["languages"].as_array().map(|l| l.len() as u64);
        match (ready, per, langs) {
            (Some(r), Some(p), Some(l)) if r == p * l => Ok(r),
            other => Err(format!("{other:?}")),
        }
    })
    .await;
    let (code, before) = get_with_token(d.port, "/metrics", Some(d.token())).await;
    assert_eq!(code, 200, "{before}");
    assert!(
        before.ends_with("# EOF\n"),
        "OpenMetrics text ends with # EOF:\n{before}"
    );
    let pool_gauge = format!("sandboxd_pool_size {ready}");
    for gauge in [
        "sandboxd_queue_depth 0",
        "sandboxd_slots_in_use 0",
        "sandboxd_slots 4",
        pool_gauge.as_str(),
    ] {
        assert!(before.contains(gauge), "{gauge} missing:\n{before}");
    }

    let mut c = Client::connect(&d).await;
    let runs = [
        ("m-ok", "shell", "echo hi", 10_000, "exited"),
        ("m-fail", "shell", "exit 3", 10_000, "exited"),
        ("m-timeout", "shell", "sleep 30", 300, "timeout"),
        ("m-py", "python", "print(6 * 7)", 10_000, "exited"),
    ];
    for (id, lang, code, timeout_ms, reason) in runs {
        let r = c.run(exec_json(id, lang, code, timeout_ms, 64)).await;
        assert_eq!(r.result().reason.as_str(), reason, "{}", r.dump());
    }

    // The counters move right after each result is sent and the slot is freed after cleanup: poll until all
    // four executions are counted and no slot is in use, then check every series exactly.
    let token = d.token().to_owned();
    let after = wait_until("four executions counted", Duration::from_secs(10), || {
        let token = token.clone();
        let before = before.clone();
        async move {
            let (code, text) = get_with_token(metrics_port, "/metrics", Some(&token)).await;
            let counted = series(&text, "sandboxd_total_seconds_count{language=\"shell\"}")
                - series(&before, "sandboxd_total_seconds_count{language=\"shell\"}")
                + series(&text, "sandboxd_total_seconds_count{language=\"python\"}")
                - series(&before, "sandboxd_total_seconds_count{language=\"python\"}");
            if code == 200 && counted >= 4.0 && text.contains("sandboxd_slots_in_use 0") {
                Ok(text)
            } else {
                Err(format!("{code}, {counted} counted:\n{text}"))
            }
        }
    })
    .await;
    let delta = |name: &str| series(&after, name) - series(&before, name);
    let total = |lang: &str, reason: &str| {
        delta(&format!(
            "sandboxd_executions_total{{language=\"{lang}\",reason=\"{reason}\"}}"
        ))
    };
    assert_eq!(total("shell", "exited"), 2.0, "{after}");
    assert_eq!(total("shell", "timeout"), 1.0, "{after}");
    assert_eq!(total("python", "exited"), 1.0, "{after}");
    assert_eq!(total("shell", "error"), 0.0, "{after}");
    for h in ["queue_wait", "create", "run", "total"] {
        assert_eq!(
            delta(&format!("sandboxd_{h}_seconds_count{{language=\"shell\"}}")),
            3.0,
            "{h}:\n{after}"
        );
        assert_eq!(
            delta(&format!(
                "sandboxd_{h}_seconds_count{{language=\"python\"}}"
            )),
            1.0,
            "{h}:\n{after}"
        );
    }
    // The timed-out run alone spent 300 ms running.
    assert!(
        delta("sandboxd_run_seconds_sum{language=\"shell\"}") >= 0.3,
        "{after}"
    );
    assert!(after.contains("sandboxd_artifacts_stored_bytes"), "{after}");
    assert!(Path::new(&d.state_dir).is_dir());
}

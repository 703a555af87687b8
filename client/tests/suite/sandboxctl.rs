//! `sandboxctl` against a real daemon: output streamed, exit codes, `--json`, `ping`, `health`, endpoint and
//! token from the environment.

use std::process::Output;
use std::time::Duration;

use serde_json::Value;
use tokio::io::AsyncWriteExt;
use tokio::process::Command;

use super::daemon::{free_port, require_daemon, sandboxctl, Daemon, DaemonOpts};

/// `sandboxctl ARGS` with the daemon's endpoint and token in the environment (the token file disabled).
async fn ctl(d: &Daemon, args: &[&str], stdin: Option<&str>) -> Output {
    ctl_env(
        args,
        stdin,
        &[("SANDBOXD_URL", &d.url()), ("SANDBOXD_TOKEN", &d.token)],
    )
    .await
}

pub(super) async fn ctl_env(args: &[&str], stdin: Option<&str>, env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(sandboxctl());
    cmd.args(args)
        .args(["--token-file", "/nonexistent/token"])
        .env_remove("SANDBOXD_URL")
        .env_remove("SANDBOXD_TOKEN")
        .envs(env.iter().copied())
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true);
    let mut child = cmd.spawn().expect("spawn sandboxctl");
    let mut input = child.stdin.take().unwrap();
    if let Some(s) = stdin {
        input.write_all(s.as_bytes()).await.unwrap();
    }
    drop(input);
    tokio::time::timeout(Duration::from_secs(60), child.wait_with_output())
        .await
        .expect("sandboxctl did not finish within 60 s")
        .unwrap()
}

fn code(o: &Output) -> i32 {
    o.status.code().unwrap_or(-1)
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn show(o: &Output) -> String {
    format!(
        "exit {:?}\nstdout: {}\nstderr: {}",
        o.status.code(),
        text(&o.stdout),
        text(&o.stderr)
    )
}

#[tokio::test]
async fn exec_streams_output_and_exits_with_the_programs_code() {
    let Some(bin) = require_daemon("exec_streams_output_and_exits_with_the_programs_code") else {
        return;
    };
    let d = Daemon::start(&bin, DaemonOpts::default()).await;

    // --code, exit code passed through, stdout and stderr apart.
    let o = ctl(
        &d,
        &[
            "exec",
            "--language",
            "python",
            "--code",
            "import sys; print('out'); print('err', file=sys.stderr); sys.exit(3)",
        ],
        None,
    )
    .await;
    assert_eq!(code(&o), 3, "{}", show(&o));
    assert_eq!(text(&o.stdout), "out\n");
    assert_eq!(text(&o.stderr), "err\n");

    // The program from stdin (-), with --stdin, --env and --file-in.
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("input.txt");
    std::fs::write(&input, "piped").unwrap();
    let data = dir.path().join("data.bin");
    std::fs::write(&data, [0xffu8, 0x00, 0x41]).unwrap();
    let o = ctl(
        &d,
        &[
            "exec",
            "-l",
            "python",
            "--stdin",
            input.to_str().unwrap(),
            "--env",
            "NAME=world",
            "--file-in",
            &format!("in/data.bin={}", data.display()),
            "-",
        ],
        Some("import os, sys\nprint(os.environ['NAME'], sys.stdin.read(), open('in/data.bin','rb').read().hex())"),
    )
    .await;
    assert_eq!(code(&o), 0, "{}", show(&o));
    assert_eq!(text(&o.stdout), "world piped ff0041\n");

    // --file.
    let prog = dir.path().join("prog.sh");
    std::fs::write(&prog, "echo from file").unwrap();
    let o = ctl(
        &d,
        &["exec", "-l", "shell", "--file", prog.to_str().unwrap()],
        None,
    )
    .await;
    assert_eq!(
        (code(&o), text(&o.stdout)),
        (0, "from file\n".to_owned()),
        "{}",
        show(&o)
    );

    // Killed by a signal: 128 + its number.
    let o = ctl(
        &d,
        &["exec", "-l", "shell", "--code", "kill -SEGV $$"],
        None,
    )
    .await;
    assert_eq!(code(&o), 128 + 11, "{}", show(&o));
    assert!(text(&o.stderr).contains("SIGSEGV"), "{}", show(&o));
}

#[tokio::test]
async fn exec_has_distinct_codes_for_timeout_oom_output_limit_and_refusal() {
    let Some(bin) =
        require_daemon("exec_has_distinct_codes_for_timeout_oom_output_limit_and_refusal")
    else {
        return;
    };
    let d = Daemon::start(&bin, DaemonOpts::default()).await;

    let o = ctl(
        &d,
        &[
            "exec",
            "-l",
            "shell",
            "--code",
            "sleep 10",
            "--timeout-ms",
            "300",
        ],
        None,
    )
    .await;
    assert_eq!(code(&o), 124, "{}", show(&o));
    assert!(text(&o.stderr).contains("timeout"), "{}", show(&o));
    assert_eq!(text(&o.stderr).lines().count(), 1, "one line: {}", show(&o));

    // The client deadline, too.
    let o = ctl(
        &d,
        &[
            "exec",
            "-l",
            "shell",
            "--code",
            "sleep 10",
            "--deadline-ms",
            "500",
        ],
        None,
    )
    .await;
    assert_eq!(code(&o), 124, "{}", show(&o));

    let o = ctl(
        &d,
        &[
            "exec",
            "-l",
            "python",
            "--memory-mb",
            "64",
            "--code",
            "chunks = []\nfor i in range(1024):\n    chunks.append(b'x' * (1 << 20))\nprint('survived')",
        ],
        None,
    )
    .await;
    assert_eq!(code(&o), 125, "{}", show(&o));
    assert!(text(&o.stderr).contains("out of memory"), "{}", show(&o));

    let o = ctl(
        &d,
        &[
            "exec",
            "-l",
            "shell",
            "--max-output-bytes",
            "10",
            "--code",
            "yes",
        ],
        None,
    )
    .await;
    assert_eq!(code(&o), 126, "{}", show(&o));
    assert_eq!(o.stdout.len(), 10, "{}", show(&o));
    assert!(text(&o.stderr).contains("output limit"), "{}", show(&o));

    let o = ctl(
        &d,
        &[
            "exec",
            "-l",
            "shell",
            "--memory-mb",
            "100000",
            "--code",
            "true",
        ],
        None,
    )
    .await;
    assert_eq!(code(&o), 65, "{}", show(&o));
    assert!(text(&o.stderr).contains("INVALID_REQUEST"), "{}", show(&o));
    assert_eq!(text(&o.stderr).lines().count(), 1, "one line: {}", show(&o));
}

#[tokio::test]
async fn json_ping_health_and_connection_failures() {
    let Some(bin) = require_daemon("json_ping_health_and_connection_failures") else {
        return;
    };
    let d = Daemon::start(&bin, DaemonOpts::default()).await;

    // --json: the protocol events, one JSON object per line, ack first, result last.
    let o = ctl(
        &d,
        &["exec", "-l", "shell", "--code", "echo hi", "--json"],
        None,
    )
    .await;
    assert_eq!(code(&o), 0, "{}", show(&o));
    let events: Vec<Value> = text(&o.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect();
    let types: Vec<&str> = events.iter().map(|e| e["type"].as_str().unwrap()).collect();
    assert_eq!(
        types,
        ["ack", "status", "stdout", "status", "result"],
        "{}",
        show(&o)
    );
    assert_eq!(events[2]["data"], "hi\n");
    for e in &events {
        assert_eq!(e["v"], 1);
        protocol::parse_ts(e["ts"].as_str().unwrap()).unwrap();
    }

    // ping: load and capabilities.
    let o = ctl(&d, &["ping"], None).await;
    assert_eq!(code(&o), 0, "{}", show(&o));
    let out = text(&o.stdout);
    // (The load may still count the execution above: the daemon frees its slot after cleanup.)
    assert!(
        out.starts_with("load: ") && out.contains(" active, ") && out.contains(" queued\n"),
        "{out}"
    );
    assert!(
        out.contains("languages: ") && out.contains("python"),
        "{out}"
    );
    let o = ctl(&d, &["ping", "--json"], None).await;
    let pong: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert!(
        pong["capabilities"]["max_limits"]["timeout_ms"].is_u64(),
        "{pong}"
    );

    // health: GET /healthz (no token needed), endpoint from a flag this time.
    let o = ctl_env(&["health", "--url", &d.url()], None, &[]).await;
    assert_eq!(code(&o), 0, "{}", show(&o));
    let body: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(body["status"], "ok");

    // A token given as a flag wins over the environment; a wrong one is refused with 77.
    let o = ctl(&d, &["ping", "--token", "wrong-token-000000"], None).await;
    assert_eq!(code(&o), 77, "{}", show(&o));

    // Nothing listening: unavailable (69), retryable.
    let nowhere = format!("ws://127.0.0.1:{}/ws", free_port());
    let o = ctl_env(
        &["exec", "-l", "shell", "--code", "true", "--url", &nowhere],
        None,
        &[],
    )
    .await;
    assert_eq!(code(&o), 69, "{}", show(&o));
    assert!(text(&o.stderr).contains("retryable"), "{}", show(&o));
    let o = ctl_env(&["health", "--url", &nowhere], None, &[]).await;
    assert_eq!(code(&o), 69, "{}", show(&o));
}

#[tokio::test]
async fn the_token_file_is_the_fallback() {
    let Some(bin) = require_daemon("the_token_file_is_the_fallback") else {
        return;
    };
    let d = Daemon::start(&bin, DaemonOpts::default()).await;
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("token");
    std::fs::write(&file, format!("{}\n", d.token)).unwrap();
    let mut cmd = Command::new(sandboxctl());
    let o = cmd
        .args([
            "ping",
            "--url",
            &d.url(),
            "--token-file",
            file.to_str().unwrap(),
        ])
        .env_remove("SANDBOXD_URL")
        .env_remove("SANDBOXD_TOKEN")
        .output()
        .await
        .unwrap();
    assert_eq!(code(&o), 0, "{}", show(&o));
}

#[tokio::test]
async fn ctrl_c_cancels_the_execution_and_exits_130() {
    let Some(bin) = require_daemon("ctrl_c_cancels_the_execution_and_exits_130") else {
        return;
    };
    let d = Daemon::start(&bin, DaemonOpts::default()).await;
    let mut child = Command::new(sandboxctl())
        .args(["exec", "-l", "shell", "--code", "echo ready; sleep 30"])
        .args(["--url", &d.url(), "--token", &d.token])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    // The program runs once its first line is out.
    let mut stdout = child.stdout.take().unwrap();
    let mut seen = Vec::new();
    while !seen.ends_with(b"ready\n") {
        let mut buf = [0u8; 64];
        let n = tokio::time::timeout(
            Duration::from_secs(20),
            tokio::io::AsyncReadExt::read(&mut stdout, &mut buf),
        )
        .await
        .expect("no output within 20 s")
        .unwrap();
        assert!(n > 0, "sandboxctl closed stdout early");
        seen.extend_from_slice(&buf[..n]);
    }
    let pid = nix::unistd::Pid::from_raw(child.id().unwrap() as i32);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGINT).unwrap();
    let o = tokio::time::timeout(Duration::from_secs(10), child.wait_with_output())
        .await
        .expect("sandboxctl still runs 10 s after Ctrl-C")
        .unwrap();
    assert_eq!(code(&o), 130, "{}", show(&o));
    assert!(text(&o.stderr).contains("cancelled"), "{}", show(&o));
}

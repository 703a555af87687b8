//! The daemon's life: graceful shutdown on SIGTERM, a bad config, the generated token of a config-less start,
//! and recovery from a crash that left a container running.

use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use nix::sys::signal::Signal;
use nix::unistd::Pid;
use protocol::{ErrorCode, Reason, ServerMessage};
use serde_json::json;
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;
use tokio_tungstenite::tungstenite::Message;

use super::harness::{
    cannot_run, cgroup_children, cgroup_parent_dirs, children_of, exec_json, free_port, is,
    privileged, proc_info, processes_with_arg, run_until_exit, unique_marker, wait_until, with,
    CgroupParentGuard, Client, Daemon, DaemonOpts, Launch, ProcInfo,
};

#[tokio::test]
async fn sigterm_lets_running_executions_finish_then_exits_0() {
    let Some(_g) = privileged("sigterm_lets_running_executions_finish_then_exits_0").await else {
        return;
    };
    let mut d = Daemon::start(DaemonOpts {
        shutdown_grace_ms: 5000,
        ..DaemonOpts::default()
    })
    .await;
    let parent = d.cgroup_parent.clone();
    let mut c = Client::connect(&d).await;
    c.send_json(&exec_json(
        "drain",
        "shell",
        "sleep 1; echo done",
        30_000,
        64,
    ))
    .await;
    c.observe("running", is("drain", "status:running")).await;
    d.signal(Signal::SIGTERM);

    let r = c.collect("drain").await;
    r.check_completed();
    assert_eq!(r.stdout_text(), "done\n");
    assert_eq!(r.result().exit_code, Some(0));
    // After the result, the daemon closes the connection itself: 1001, going away.
    assert_going_away(&mut c).await;

    exits_0_after_sigterm(&mut d);
    assert!(
        cgroup_parent_dirs(&parent).is_empty(),
        "the cgroup parent is removed at exit: {:?}",
        cgroup_parent_dirs(&parent)
    );
}

/// `d`, sent SIGTERM, exits with status 0 within 15 s.
fn exits_0_after_sigterm(d: &mut Daemon) {
    let status = d
        .wait_exit(Duration::from_secs(15))
        .unwrap_or_else(|| panic!("sandboxd still runs 15 s after SIGTERM"));
    assert!(
        status.success(),
        "exit status after SIGTERM: {status}\n{}",
        d.log()
    );
}

/// The next frame of `c` is a close frame with code 1001 (going away).
async fn assert_going_away(c: &mut Client) {
    match c.next_frame(Duration::from_secs(15)).await {
        Some(Ok(Message::Close(Some(frame)))) => {
            assert_eq!(frame.code, CloseCode::Away, "close code 1001: {frame:?}")
        }
        other => {
            panic!("expected a close frame with code 1001 after the last message, got {other:?}")
        }
    }
}

#[tokio::test]
async fn sigterm_writes_every_queued_message_before_the_daemon_exits() {
    let Some(_g) = privileged("sigterm_writes_every_queued_message_before_the_daemon_exits").await
    else {
        return;
    };
    let mut d = Daemon::start(DaemonOpts {
        shutdown_grace_ms: 10_000,
        ..DaemonOpts::default()
    })
    .await;
    // 6 MB of output: more than the socket buffers hold (about 4 MB on loopback) while the client does not read,
    // and less than they and the connection's queue (64 messages of up to 64 KiB) hold together, so the execution
    // ends, and the drain with it, while its last messages still wait in the daemon to be written. The output is
    // made first and written by `dd` in 1 MiB blocks, larger than the pipe, so each read of the daemon takes a full
    // pipe (64 KiB) however the daemon is scheduled. Written by `tr` as it goes, 4 KiB at a time, the pieces the
    // daemon reads depend on how soon it wakes: 64 small ones fill the queue with far less than 4 MiB, and the
    // program then waits on its pipe until the grace period ends (a failure seen once with builds running beside).
    const BYTES: usize = 6_000_000;
    let mut c = Client::connect(&d).await;
    c.send_json(&with(
        exec_json(
            "behind",
            "shell",
            &format!(
                "head -c {BYTES} /dev/zero | tr '\\0' a > /tmp/out; \
                 sleep 0.5; dd if=/tmp/out bs=1048576 2>/dev/null"
            ),
            30_000,
            64,
        ),
        json!({"limits": {"max_output_bytes": BYTES + 1}}),
    ))
    .await;
    c.observe("running", is("behind", "status:running")).await;
    d.signal(Signal::SIGTERM);
    // The client reads nothing until the drain has ended: the program wrote its output and ended meanwhile, and
    // its last messages wait in the daemon. (The daemon then gives the connections 5 s.)
    wait_until("the drain to end", Duration::from_secs(20), || {
        let log = d.log();
        async move {
            match log.contains("drained; closing the connections") {
                true => Ok(()),
                false => Err("not yet".to_owned()),
            }
        }
    })
    .await;

    let r = c.collect("behind").await;
    r.check_completed();
    assert_eq!(r.stdout_text().len(), BYTES, "every stdout byte arrives");
    assert_eq!(r.result().exit_code, Some(0));
    assert_going_away(&mut c).await;
    exits_0_after_sigterm(&mut d);
}

#[tokio::test]
async fn sigterm_kills_what_outlives_the_grace_period() {
    let Some(_g) = privileged("sigterm_kills_what_outlives_the_grace_period").await else {
        return;
    };
    let mut d = Daemon::start(DaemonOpts {
        shutdown_grace_ms: 500,
        ..DaemonOpts::default()
    })
    .await;
    let parent = d.cgroup_parent.clone();
    let marker = unique_marker();
    let mut c = Client::connect(&d).await;
    c.send_json(&exec_json(
        "long",
        "shell",
        &format!("sleep 300.{marker}"),
        60_000,
        64,
    ))
    .await;
    c.observe("running", is("long", "status:running")).await;
    d.signal(Signal::SIGTERM);

    // Spec section 5: exactly one terminal message per execute, even when the daemon shuts down.
    let mut seen = Vec::new();
    let terminal = loop {
        match c.next_frame(Duration::from_secs(20)).await {
            None => panic!("no terminal message within 20 s of SIGTERM; got {seen:?}"),
            Some(Ok(Message::Text(t))) => {
                let (m, raw) = Client::parse(t.as_str());
                if m.id() == Some("long") && m.is_terminal() {
                    break (m, raw);
                }
                seen.push(raw);
            }
            Some(other) => panic!(
                "the connection ended ({other:?}) before the execution got its terminal message; got {seen:?}"
            ),
        }
    };
    match &terminal.0 {
        ServerMessage::Error(e) => assert_eq!(e.code, ErrorCode::InternalError, "{}", terminal.1),
        ServerMessage::Result(r) => assert_ne!(r.reason, Reason::Exited, "{}", terminal.1),
        _ => unreachable!(),
    }
    assert_going_away(&mut c).await;
    exits_0_after_sigterm(&mut d);
    assert!(
        processes_with_arg(&marker).is_empty(),
        "the execution was killed"
    );
    assert!(
        cgroup_parent_dirs(&parent).is_empty(),
        "cgroup parent removed"
    );
}

#[tokio::test]
async fn bad_config_is_refused_naming_the_key() {
    // No root needed: the config is read before anything privileged happens.
    let dir = tempfile::tempdir().unwrap();
    for (yaml, key) in [
        ("listen: 127.0.0.1:1\nbogus_key: 1\n", "bogus_key"),
        ("sandbox:\n  cgroup_parent: x\n  uid_bass: 5\n", "uid_bass"),
        ("capacity:\n  max_queue: lots\n", "max_queue"),
    ] {
        let path = dir.path().join("bad.yaml");
        std::fs::write(&path, yaml).unwrap();
        let (status, stderr) = run_until_exit(&path, Duration::from_secs(10)).await;
        assert!(!status.success(), "a bad config ({key}) exits non-zero");
        assert!(stderr.contains(key), "stderr names {key}: {stderr}");
    }
}

/// The daemon without `--config` uses the default cgroup parent `sandboxd`; test processes take a lock so that
/// only one at a time does, and never while someone else's executions live there.
fn default_parent_lock() -> nix::fcntl::Flock<std::fs::File> {
    let f = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open("/tmp/sandboxd-tests-default-cgroup-parent.lock")
        .unwrap();
    nix::fcntl::Flock::lock(f, nix::fcntl::FlockArg::LockExclusive)
        .map_err(|(_, e)| e)
        .unwrap()
}

#[tokio::test]
async fn config_less_start_generates_a_token_once() {
    let test = "config_less_start_generates_a_token_once";
    let Some(_g) = privileged(test).await else {
        return;
    };
    let _lock = tokio::task::spawn_blocking(default_parent_lock)
        .await
        .unwrap();
    let in_use = cgroup_children("sandboxd");
    if !in_use.is_empty() {
        cannot_run(
            test,
            &format!("the default cgroup parent is in use by other executions: {in_use:?}"),
        );
        return;
    }
    let state = tempfile::tempdir().unwrap();
    let state_dir = state.path().join("state");

    let start = |port: u16| {
        let dir = tempfile::Builder::new()
            .prefix("sandboxd-test-")
            .tempdir()
            .unwrap();
        Daemon::launch(Launch {
            args: vec![
                "--state-dir".into(),
                state_dir.display().to_string(),
                "--listen".into(),
                format!("127.0.0.1:{port}"),
            ],
            port,
            token: String::new(),
            dir,
            state_dir: state_dir.clone(),
            cgroup_parent: "sandboxd".into(),
            uid_base: 200_000,
            max_concurrent: 8,
            pool_size: 8,
        })
    };

    let mut d = start(free_port()).await;
    let stdout = d.stdout();
    let lines: Vec<&str> = stdout.lines().filter(|l| l.contains("token")).collect();
    assert_eq!(
        lines.len(),
        1,
        "the generated token is printed once on stdout: {stdout:?}"
    );
    let token_path = state_dir.join("token");
    let saved = std::fs::read_to_string(&token_path).unwrap();
    let token = saved.trim().to_owned();
    assert!(token.len() >= 16, "{saved:?}");
    assert!(
        lines[0].contains(&token),
        "stdout shows the token saved in {}: {stdout:?}",
        token_path.display()
    );
    let mode = std::fs::metadata(&token_path).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600, "the token file is private");
    assert!(!d.log().contains(&token), "the token is not in the log");

    d.set_token(&token);
    let mut c = Client::connect(&d).await;
    c.run_completed(exec_json("tok", "shell", "echo ok", 20_000, 64))
        .await;
    drop(c);
    assert!(
        Client::try_connect(&d.url(), Some("0123456789abcdef-wrong"), &[])
            .await
            .is_err()
    );
    d.signal(Signal::SIGTERM);
    let status = d
        .wait_exit(Duration::from_secs(15))
        .expect("exits after SIGTERM");
    assert!(status.success(), "{status}");
    drop(d);

    // Started again on the same state: no new token, the saved one still works.
    let mut d = start(free_port()).await;
    assert!(
        !d.stdout().contains("token"),
        "the token is printed only when generated: {:?}",
        d.stdout()
    );
    assert_eq!(std::fs::read_to_string(&token_path).unwrap(), saved);
    d.set_token(&token);
    let mut c = Client::connect(&d).await;
    c.assert_usable().await;
}

/// A container helper that dies takes the daemon down at once (it can no longer create or remove containers): the
/// daemon notices the helper's end, says why, drains and exits non-zero, without waiting for a poll.
#[tokio::test]
async fn a_dead_helper_shuts_the_daemon_down() {
    let Some(_g) = privileged("a_dead_helper_shuts_the_daemon_down").await else {
        return;
    };
    let mut d = Daemon::start(DaemonOpts::default()).await;
    let helpers = children_of(d.pid());
    assert!(!helpers.is_empty(), "the daemon has a helper child process");
    // The helper is this test's daemon's own child: the one process ended here, by pid.
    nix::sys::signal::kill(Pid::from_raw(helpers[0].pid), Signal::SIGKILL).unwrap();
    let status = d.wait_exit(Duration::from_secs(15)).unwrap_or_else(|| {
        panic!(
            "sandboxd still runs 15 s after its helper died\n{}",
            d.log()
        )
    });
    assert_eq!(status.code(), Some(1), "{status}\n{}", d.log());
    assert!(
        d.log().contains("the container helper died; shutting down"),
        "{}",
        d.log()
    );
}

#[tokio::test]
async fn restart_after_a_crash_removes_the_leftover_container() {
    let Some(_g) = privileged("restart_after_a_crash_removes_the_leftover_container").await else {
        return;
    };
    let state = tempfile::tempdir().unwrap();
    let state_dir = state.path().join("state");
    let mut d1 = Daemon::start(DaemonOpts {
        state_dir: Some(state_dir.clone()),
        ..DaemonOpts::default()
    })
    .await;
    let parent = d1.cgroup_parent.clone();
    let marker = unique_marker();
    let mut c = Client::connect(&d1).await;
    start_a_container_sleeping_with(&mut c, &marker).await;

    // Crash: SIGKILL the daemon and its helper (its child process).
    let helpers = children_of(d1.pid());
    assert!(!helpers.is_empty(), "the daemon has a helper child process");
    let _ = nix::sys::signal::kill(Pid::from_raw(d1.pid()), Signal::SIGKILL);
    for h in &helpers {
        let _ = nix::sys::signal::kill(Pid::from_raw(h.pid), Signal::SIGKILL);
    }
    d1.kill_hard();
    // Whatever happens next, this test's cgroup parent goes away at its end (after `d2`, declared later).
    let _parent_guard = CgroupParentGuard(parent.clone());
    drop(c);
    wait_for_the_helpers_to_be_gone(&helpers).await;
    let leftovers = cgroup_children(&parent);
    assert!(
        !leftovers.is_empty(),
        "precondition: the crash leaves the container's cgroup behind"
    );
    let (live_marker, stand_in) = a_live_process_in_the_leftovers(&marker, &leftovers).await;

    // Restart on the same cgroup parent and state directory.
    let d2 = Daemon::start(DaemonOpts {
        state_dir: Some(state_dir.clone()),
        cgroup_parent: Some(parent.clone()),
        ..DaemonOpts::default()
    })
    .await;
    the_leftover_container_is_removed(&d2, &leftovers, &live_marker).await;
    if let Some(mut child) = stand_in {
        let _ = child.kill();
        let _ = child.wait();
    }
    // And it serves.
    let mut c = Client::connect(&d2).await;
    c.run_completed(exec_json("after-crash", "shell", "echo ok", 20_000, 64))
        .await;
}

/// Starts execution `orphan`, a `sleep` whose argument carries `marker`, and waits until it runs.
async fn start_a_container_sleeping_with(c: &mut Client, marker: &str) {
    c.send_json(&exec_json(
        "orphan",
        "shell",
        &format!("sleep 300.{marker}"),
        60_000,
        64,
    ))
    .await;
    c.observe("running", is("orphan", "status:running")).await;
    wait_until("the container's sleep", Duration::from_secs(10), || async {
        if processes_with_arg(marker).is_empty() {
            Err("not yet".to_owned())
        } else {
            Ok(())
        }
    })
    .await;
}

/// Waits until none of the killed daemon's `helpers` is alive.
async fn wait_for_the_helpers_to_be_gone(helpers: &[ProcInfo]) {
    wait_until("the helper to be gone", Duration::from_secs(10), || async {
        let alive: Vec<_> = helpers
            .iter()
            .filter_map(|h| proc_info(h.pid).filter(|p| p.state != 'Z' && p.cmdline == h.cmdline))
            .collect();
        if alive.is_empty() {
            Ok(())
        } else {
            Err(format!("{alive:?}"))
        }
    })
    .await;
}

/// The container's init dies with the helper (PR_SET_PDEATHSIG) and takes its pid namespace along. If it did,
/// a stand-in process is put into the `leftovers` cgroups, so the restart has a live leftover to kill either way.
/// Returns the marker of the live process, and the stand-in if there is one.
async fn a_live_process_in_the_leftovers(
    marker: &str,
    leftovers: &[PathBuf],
) -> (String, Option<std::process::Child>) {
    let died = {
        let start = std::time::Instant::now();
        loop {
            if processes_with_arg(marker).is_empty() {
                break true;
            }
            if start.elapsed() > Duration::from_secs(5) {
                break false;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    if !died {
        return (marker.to_owned(), None);
    }
    let m = unique_marker();
    let child = Command::new("sleep")
        .arg(format!("300.{m}"))
        .spawn()
        .unwrap();
    let mut placed = 0;
    for dir in leftovers {
        if std::fs::write(dir.join("cgroup.procs"), child.id().to_string()).is_ok() {
            placed += 1;
        }
    }
    assert!(
        placed > 0,
        "the stand-in could not join the leftover cgroups {leftovers:?}"
    );
    (m, Some(child))
}

/// The restarted daemon `d2` says it removes the `leftovers` cgroups, they are gone, and so is the process marked
/// `live_marker`.
async fn the_leftover_container_is_removed(d2: &Daemon, leftovers: &[PathBuf], live_marker: &str) {
    let log = d2.log();
    assert!(
        log.contains("leftover cgroup"),
        "the new daemon's log mentions removing the leftover cgroup:\n{log}"
    );
    let still: Vec<_> = leftovers.iter().filter(|p| p.exists()).collect();
    assert!(
        still.is_empty(),
        "the crashed daemon's cgroups are removed: {still:?}"
    );
    wait_until(
        "the leftover container's process to be gone",
        Duration::from_secs(10),
        || async {
            let p = processes_with_arg(live_marker);
            if p.is_empty() {
                Ok(())
            } else {
                Err(format!("{p:?}"))
            }
        },
    )
    .await;
}

/// A daemon whose state directory the container user cannot traverse would report healthy and fail every
/// execution; instead its start-up self-test fails and it exits non-zero, naming the directory.
#[tokio::test]
async fn an_unusable_state_dir_is_refused_at_start() {
    let Some(_g) = privileged("an_unusable_state_dir_is_refused_at_start").await else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let private = dir.path().join("private");
    std::fs::create_dir(&private).unwrap();
    std::fs::set_permissions(&private, std::fs::Permissions::from_mode(0o700)).unwrap();
    let parent = format!("sandboxd-test-{}-0700", std::process::id());
    let _cg = CgroupParentGuard(parent.clone());
    let config = dir.path().join("c.yaml");
    std::fs::write(
        &config,
        format!(
            "listen: 127.0.0.1:{}\nstate_dir: {}\nauth: {{tokens: [\"a-token-of-enough-length\"]}}\n\
             sandbox: {{cgroup_parent: {parent}, uid_base: 920000}}\n",
            free_port(),
            private.join("state").display()
        ),
    )
    .unwrap();
    let (status, stderr) = run_until_exit(&config, Duration::from_secs(30)).await;
    assert!(!status.success(), "{stderr}");
    assert!(stderr.contains("self-test"), "{stderr}");
    assert!(
        stderr.contains(&private.display().to_string()),
        "names the directory: {stderr}"
    );
    assert!(
        cgroup_parent_dirs(&parent).is_empty(),
        "a failed start leaves no cgroup parent"
    );
}

//! Failures against a real daemon: the daemon killed mid-run and restarted, overload, and the client deadline.

use std::time::{Duration, Instant};

use client::{
    new_execution_id, ClientError, ErrorKind, ExecOptions, ExecStatus, Execute, ExecuteRequest,
    Language, Pool, RequestedLimits, ServerMessage,
};
use protocol::ErrorCode;

use super::daemon::{processes_with_uid, require_daemon, wait_until, Daemon, DaemonOpts};

fn shell(code: &str, timeout_ms: u64) -> ExecuteRequest {
    ExecuteRequest::new(
        new_execution_id(),
        Language::Shell,
        code,
        RequestedLimits::new(timeout_ms, 64),
    )
}

/// Waits until the execution's program runs.
async fn until_running(ex: &mut client::Execution) {
    loop {
        match ex.next().await {
            Some(Ok(ev)) => {
                if matches!(
                    ev.message,
                    ServerMessage::Status {
                        status: ExecStatus::Running,
                        ..
                    }
                ) {
                    return;
                }
            }
            other => panic!("the execution ended before it ran: {other:?}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn daemon_killed_mid_run_fails_in_flight_retryable_then_later_executions_succeed() {
    let test = "daemon_killed_mid_run_fails_in_flight_retryable_then_later_executions_succeed";
    let Some(bin) = require_daemon(test) else {
        return;
    };
    let mut d = Daemon::start(&bin, DaemonOpts::default()).await;
    let pool = Pool::builder(d.url())
        .token(d.token.clone())
        .size(2)
        .max_overflow(2)
        .build()
        .unwrap();
    // Four executions in flight (two on base connections, two on overflow ones).
    let mut running = Vec::new();
    for _ in 0..4 {
        let mut ex = pool
            .execute_stream(shell("echo started; sleep 60", 90_000))
            .await
            .unwrap();
        until_running(&mut ex).await;
        running.push(ex);
    }
    let in_flight: Vec<_> = running
        .into_iter()
        .map(|ex| tokio::spawn(ex.result()))
        .collect();

    d.kill_hard();
    for t in in_flight {
        let e = tokio::time::timeout(Duration::from_secs(10), t)
            .await
            .expect("an in-flight execution did not fail within 10 s of the crash")
            .unwrap()
            .unwrap_err();
        assert!(
            matches!(e, ClientError::Disconnected { .. }),
            "in-flight execution: {e:?}"
        );
        assert!(e.is_retryable(), "{e}");
        assert_eq!(e.kind(), ErrorKind::Sandbox);
    }
    // While the daemon is down, executions fail fast and retryable.
    let e = pool.execute(shell("echo hi", 5000)).await.unwrap_err();
    assert!(e.is_retryable(), "while down: {e:?}");

    d.restart().await;
    // The first execution after the restart succeeds (no retry by the caller).
    let r = pool.execute(shell("echo back", 5000)).await;
    match r {
        Ok(r) => assert_eq!(r.stdout_text(), "back\n"),
        Err(e) => panic!("first execution after the restart: {e:?}\n{}", d.log()),
    }
    // And so do later ones, concurrently, on reconnected and new connections alike.
    let later: Vec<_> = (0..8)
        .map(|i| {
            let pool = pool.clone();
            tokio::spawn(async move { pool.execute(shell(&format!("echo {i}"), 10_000)).await })
        })
        .collect();
    for (i, t) in later.into_iter().enumerate() {
        let r = t
            .await
            .unwrap()
            .unwrap_or_else(|e| panic!("later execution {i}: {e:?}"));
        assert_eq!(r.stdout_text(), format!("{i}\n"));
    }
}

#[tokio::test]
async fn overload_surfaces_sandbox_overloaded_as_retryable() {
    let Some(bin) = require_daemon("overload_surfaces_sandbox_overloaded_as_retryable") else {
        return;
    };
    let d = Daemon::start(
        &bin,
        DaemonOpts {
            max_concurrent: 1,
            max_queue: 0,
            ..DaemonOpts::default()
        },
    )
    .await;
    let pool = Pool::builder(d.url())
        .token(d.token.clone())
        .size(2)
        .build()
        .unwrap();
    let mut busy = pool
        .execute_stream(shell("sleep 30", 60_000))
        .await
        .unwrap();
    until_running(&mut busy).await;

    let start = Instant::now();
    let e = pool.execute(shell("echo no room", 5000)).await.unwrap_err();
    assert!(
        matches!(
            e,
            ClientError::Server {
                code: ErrorCode::SandboxOverloaded,
                ..
            }
        ),
        "{e:?}"
    );
    assert!(e.is_retryable());
    assert_eq!(e.code(), Some(ErrorCode::SandboxOverloaded));
    assert!(
        start.elapsed() < Duration::from_secs(2),
        "SANDBOX_OVERLOADED is sent at once, got it after {:?}",
        start.elapsed()
    );

    // Once the slot is free, the same request goes through. The daemon frees the slot after the container is
    // cleaned up, a moment after the result: wait for its load to say so.
    busy.cancel().await.unwrap();
    let r = busy.result().await.unwrap();
    assert_eq!(r.status, ExecStatus::Cancelled);
    wait_until("the slot to be free", Duration::from_secs(10), || {
        let pool = pool.clone();
        async move {
            match pool.ping().await {
                Ok(p) if p.load.active_executions == 0 => Ok(()),
                other => Err(format!("{other:?}")),
            }
        }
    })
    .await;
    let r = pool.execute(shell("echo room", 5000)).await.unwrap();
    assert_eq!(r.stdout_text(), "room\n");
}

#[tokio::test]
async fn a_client_deadline_cancels_and_the_process_is_gone_on_the_daemon() {
    let Some(bin) =
        require_daemon("a_client_deadline_cancels_and_the_process_is_gone_on_the_daemon")
    else {
        return;
    };
    let d = Daemon::start(&bin, DaemonOpts::default()).await;
    let pool = Pool::builder(d.url())
        .token(d.token.clone())
        .size(2)
        .build()
        .unwrap();
    let uids = d.uid_range();
    // A program the daemon would let run for a minute.
    let exec = {
        let pool = pool.clone();
        tokio::spawn(async move {
            let start = Instant::now();
            let r = pool
                .execute_with(
                    shell("sleep 60", 90_000),
                    ExecOptions::new().deadline(Duration::from_secs(2)),
                )
                .await;
            (r, start.elapsed())
        })
    };
    // Precondition: it runs, as a process of the daemon's uid range.
    wait_until("the program to run", Duration::from_secs(10), || {
        let uids = uids.clone();
        async move {
            let p = processes_with_uid(uids);
            if p.is_empty() {
                Err("no process in the daemon's uid range".to_owned())
            } else {
                Ok(())
            }
        }
    })
    .await;

    let (r, took) = exec.await.unwrap();
    let e = r.unwrap_err();
    assert!(matches!(e, ClientError::Timeout { .. }), "{e:?}");
    assert!(!e.is_retryable());
    assert_eq!(e.kind(), ErrorKind::Timeout);
    assert!(
        took >= Duration::from_secs(2) && took < Duration::from_secs(5),
        "the deadline fired after {took:?}"
    );

    // The cancel reached the daemon: its load returns to 0 and the program's processes are gone.
    wait_until(
        "the daemon's load to return to 0",
        Duration::from_secs(10),
        || {
            let pool = pool.clone();
            async move {
                match pool.ping().await {
                    Ok(p) if p.load.active_executions == 0 && p.load.queue_depth == 0 => Ok(()),
                    Ok(p) => Err(format!("{:?}", p.load)),
                    Err(e) => Err(e.to_string()),
                }
            }
        },
    )
    .await;
    wait_until(
        "the program's processes to be gone",
        Duration::from_secs(10),
        || {
            let uids = uids.clone();
            async move {
                let p = processes_with_uid(uids);
                if p.is_empty() {
                    Ok(())
                } else {
                    Err(format!("still running: {p:?}"))
                }
            }
        },
    )
    .await;
    // The connection is still good for the next execution.
    let r = pool.execute(shell("echo after", 5000)).await.unwrap();
    assert_eq!(r.stdout_text(), "after\n");
}

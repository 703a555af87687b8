//! Disconnects: when a connection closes, every execution it started is killed and cleaned up (processes,
//! cgroups, mounts), running and queued alike (spec section 1).

use std::time::Duration;

use protocol::{ExecStatus, Limits, ServerMessage};
use serde_json::json;

use super::harness::{
    exec_json, is, privileged, processes_with_arg, unique_marker, wait_until, with, Client, Daemon,
    DaemonOpts, MAX_LIMITS,
};

/// Everything of the daemon's executions is gone: no container cgroup, no scratch mount, no process of a sandbox
/// uid, no per-execution state file, and `/healthz` counts nothing.
async fn assert_all_cleaned_up(d: &Daemon, deadline: Duration) {
    wait_until("every execution to be cleaned up", deadline, || async {
        let (_, h) = d.healthz().await;
        let counts = (h["active_executions"].as_u64(), h["queue_depth"].as_u64());
        d.leftovers().await?;
        if counts == (Some(0), Some(0)) {
            Ok(())
        } else {
            Err(format!("healthz {counts:?}"))
        }
    })
    .await;
}

#[tokio::test]
async fn disconnect_kills_the_connections_executions() {
    let Some(_g) = privileged("disconnect_kills_the_connections_executions").await else {
        return;
    };
    let d = Daemon::start(DaemonOpts::default()).await;
    let marker = unique_marker();
    let mut c = Client::connect(&d).await;
    c.send_json(&exec_json(
        "bye",
        "shell",
        &format!("sleep 300.{marker}"),
        60_000,
        64,
    ))
    .await;
    c.observe("running", is("bye", "status:running")).await;
    wait_until("the sleep to run", Duration::from_secs(10), || async {
        if processes_with_arg(&marker).is_empty() {
            Err("not yet".to_owned())
        } else {
            Ok(())
        }
    })
    .await;
    // A second connection's execution must not be affected.
    let mut other = Client::connect(&d).await;
    other
        .send_json(&exec_json(
            "stay",
            "shell",
            "sleep 2; echo stayed",
            60_000,
            64,
        ))
        .await;
    other.observe("running", is("stay", "status:running")).await;

    drop(c);
    wait_until(
        "the disconnected execution to be gone",
        Duration::from_secs(10),
        || async {
            let p = processes_with_arg(&marker);
            if p.is_empty() {
                Ok(())
            } else {
                Err(format!("{p:?}"))
            }
        },
    )
    .await;
    let r = other.collect("stay").await;
    r.check_completed();
    assert_eq!(r.stdout_text(), "stayed\n");
    drop(other);
    assert_all_cleaned_up(&d, Duration::from_secs(20)).await;
}

/// A client that disconnects while its execution floods output: the execution is killed and cleaned up, and the
/// daemon neither panics nor stops serving.
#[tokio::test]
async fn disconnect_during_an_output_flood() {
    let Some(_g) = privileged("disconnect_during_an_output_flood").await else {
        return;
    };
    let big = 1u64 << 34;
    let d = Daemon::start(DaemonOpts {
        max_limits: Limits {
            max_output_bytes: big,
            ..MAX_LIMITS
        },
        ..DaemonOpts::default()
    })
    .await;
    let marker = unique_marker();
    let mut c = Client::connect(&d).await;
    // Many processes make the container slower to die, so the daemon sees the client gone before the exit.
    let code = format!("for i in $(seq 40); do sleep 300 & done; exec yes flood-{marker}");
    c.send_json(&with(
        exec_json("gush", "shell", &code, 60_000, 64),
        json!({"limits": {"max_output_bytes": big}}),
    ))
    .await;
    c.observe("output", is("gush", "stdout")).await;
    // Stop reading until the whole chain is backed up (socket, daemon queues, pipe): the program then sleeps in
    // write(2). Only then disconnect, so the daemon finds output still pending when the client is gone.
    let flood = format!("flood-{marker}");
    let mut sleeping = 0;
    wait_until(
        "the flood to block on its full pipe",
        Duration::from_secs(20),
        || {
            let p = processes_with_arg(&flood);
            sleeping = if p.iter().any(|p| p.state == 'S') {
                sleeping + 1
            } else {
                0
            };
            let state = format!("{p:?}");
            let blocked = sleeping >= 3;
            async move {
                if blocked {
                    Ok(())
                } else {
                    Err(state)
                }
            }
        },
    )
    .await;
    drop(c);
    assert_all_cleaned_up(&d, Duration::from_secs(20)).await;
    let log = d.log();
    assert!(
        !log.contains("panicked"),
        "the daemon panicked after the disconnect:\n{log}"
    );
    let mut c = Client::connect(&d).await;
    c.run_completed(exec_json("after", "shell", "echo ok", 20_000, 64))
        .await;
}

/// 100 executions over 10 connections; each connection is dropped while its executions run (8 running, the
/// other 2 queued). Afterwards nothing of any of them is left.
#[tokio::test]
async fn hundred_executions_with_disconnects_leave_nothing() {
    let Some(_g) = privileged("hundred_executions_with_disconnects_leave_nothing").await else {
        return;
    };
    let d = Daemon::start(DaemonOpts {
        max_concurrent: 8,
        max_queue: 100,
        ..DaemonOpts::default()
    })
    .await;
    let programs = [
        ("python", "import time\ntime.sleep(30)"),
        ("shell", "sleep 30"),
        (
            "python",
            "import time\nwhile True:\n    print('tick', flush=True)\n    time.sleep(0.05)",
        ),
        ("shell", "while :; do echo tock; sleep 0.05; done"),
        ("shell", "sleep 30 & sleep 30 & (sleep 30 &) ; wait"),
    ];
    let mut ran = 0;
    for batch in 0..10 {
        let mut c = Client::connect(&d).await;
        c.deadline = Duration::from_secs(60);
        let ids: Vec<String> = (0..10).map(|i| format!("b{batch}-e{i}")).collect();
        for (i, id) in ids.iter().enumerate() {
            let (lang, code) = programs[(batch + i) % programs.len()];
            c.send_json(&exec_json(id, lang, code, 60_000, 64)).await;
        }
        // Wait until every slot runs one of this batch's executions (the rest are queued behind them).
        let mut running = 0;
        let mut acks = 0;
        while running < d.max_concurrent || acks < ids.len() {
            match c.next().await {
                ServerMessage::Ack { .. } => acks += 1,
                ServerMessage::Status {
                    status: ExecStatus::Running,
                    ..
                } => running += 1,
                ServerMessage::Stdout(_) => {}
                other => panic!("batch {batch}: unexpected {other:?}"),
            }
        }
        ran += running;
        drop(c);
    }
    assert_eq!(ran, 80);
    assert_all_cleaned_up(&d, Duration::from_secs(60)).await;
    let log = d.log();
    for bad in ["not removed", "cleanup failed", "panicked"] {
        assert!(
            !log.contains(bad),
            "the daemon's log reports {bad:?}:\n{log}"
        );
    }
}

//! `cancel` and execution ids: cancelling a running execution, a second cancel, unknown ids, and a duplicate id
//! while in flight (spec section 3).

use std::time::Duration;

use protocol::{ErrorCode, ExecStatus, Reason, ServerMessage};

use super::harness::{
    assert_error, cancel_json, exec_json, is, privileged, processes_with_arg, stdout_contains,
    unique_marker, wait_until, Client, Daemon, DaemonOpts,
};

#[tokio::test]
async fn cancel_kills_a_running_execution_and_a_second_cancel_is_silent() {
    let Some(_g) =
        privileged("cancel_kills_a_running_execution_and_a_second_cancel_is_silent").await
    else {
        return;
    };
    let d = Daemon::start(DaemonOpts::default()).await;
    let mut c = Client::connect(&d).await;
    let marker = unique_marker();
    let code = format!("echo started; sleep 30.{marker}; echo not-cancelled");
    c.send_json(&exec_json("c1", "shell", &code, 60_000, 64))
        .await;
    c.observe("the first output", stdout_contains("c1", "started"))
        .await;
    wait_until("the sleep to run", Duration::from_secs(10), || async {
        if processes_with_arg(&marker).is_empty() {
            Err("no sleep yet".to_owned())
        } else {
            Ok(())
        }
    })
    .await;

    // Two cancels back to back: the second arrives while the first is being carried out.
    c.send_all(&[cancel_json("c1"), cancel_json("c1")]).await;
    // No spec bound on how fast; well under the 30 s the program would otherwise run.
    c.deadline = Duration::from_secs(10);
    let r = c.collect("c1").await;
    r.check_sequence();
    assert_eq!(
        r.statuses(),
        [ExecStatus::Running, ExecStatus::Cancelled],
        "{}",
        r.dump()
    );
    let res = r.result();
    assert_eq!(res.reason, Reason::Cancelled, "{}", r.dump());
    assert_eq!(res.exit_code, None, "{}", r.dump());
    assert!(!r.stdout_text().contains("not-cancelled"), "{}", r.dump());

    // The second cancel produced nothing: the next message after a ping is its pong.
    assert!(
        c.unclaimed().is_empty(),
        "nothing else arrived: {:?}",
        c.unclaimed()
    );
    c.send_json(&super::harness::ping_json()).await;
    let (m, raw) = c.next_raw().await;
    assert!(
        matches!(m, ServerMessage::Pong(_)),
        "the second cancel must produce nothing; got {raw}"
    );

    wait_until(
        "the cancelled process tree to be gone",
        Duration::from_secs(10),
        || async {
            let p = processes_with_arg(&marker);
            if !p.is_empty() {
                return Err(format!("processes {p:?}"));
            }
            d.leftovers().await
        },
    )
    .await;
}

#[tokio::test]
async fn cancel_of_an_id_not_in_flight_is_unknown_execution() {
    let Some(_g) = privileged("cancel_of_an_id_not_in_flight_is_unknown_execution").await else {
        return;
    };
    let d = Daemon::start(DaemonOpts::default()).await;
    let mut c = Client::connect(&d).await;

    c.cancel("never-sent").await;
    let (e, raw) = c.take_error().await;
    assert_error(&e, &raw, ErrorCode::UnknownExecution, Some("never-sent"));
    c.assert_usable().await;

    // An execution that already ended is not in flight any more.
    c.run_completed(exec_json("done-1", "shell", "echo hi", 20_000, 64))
        .await;
    c.cancel("done-1").await;
    let (e, raw) = c.take_error().await;
    assert_error(&e, &raw, ErrorCode::UnknownExecution, Some("done-1"));

    // Nor is an execution of another connection.
    let mut other = Client::connect(&d).await;
    other
        .send_json(&exec_json("theirs", "shell", "sleep 30", 60_000, 64))
        .await;
    other
        .observe("running", is("theirs", "status:running"))
        .await;
    c.cancel("theirs").await;
    let (e, raw) = c.take_error().await;
    assert_error(&e, &raw, ErrorCode::UnknownExecution, Some("theirs"));
    other.cancel("theirs").await;
    let r = other.collect("theirs").await;
    assert_eq!(
        r.terminal_status(),
        Some(ExecStatus::Cancelled),
        "{}",
        r.dump()
    );
}

#[tokio::test]
async fn duplicate_id_in_flight_is_refused_and_the_first_runs_on() {
    let Some(_g) = privileged("duplicate_id_in_flight_is_refused_and_the_first_runs_on").await
    else {
        return;
    };
    let d = Daemon::start(DaemonOpts::default()).await;
    let mut c = Client::connect(&d).await;
    c.send_json(&exec_json(
        "dup",
        "shell",
        "sleep 1; echo first-done",
        30_000,
        64,
    ))
    .await;
    c.observe("running", is("dup", "status:running")).await;
    c.send_json(&exec_json("dup", "shell", "echo second", 30_000, 64))
        .await;
    let (e, raw) = c
        .take(
            "the duplicate's error",
            |m| matches!(m, ServerMessage::Error(e) if e.id.as_deref() == Some("dup")),
        )
        .await;
    let ServerMessage::Error(e) = e else {
        unreachable!()
    };
    assert_error(&e, &raw, ErrorCode::InvalidRequest, Some("dup"));
    assert!(
        e.message.to_lowercase().contains("duplicate"),
        "the message says it is a duplicate: {raw}"
    );

    let r = c.collect("dup").await;
    r.check_sequence();
    assert_eq!(
        r.statuses(),
        [ExecStatus::Running, ExecStatus::Completed],
        "{}",
        r.dump()
    );
    assert_eq!(
        r.stdout_text(),
        "first-done\n",
        "the first execution is not affected: {}",
        r.dump()
    );
    assert_eq!(r.result().exit_code, Some(0));

    // Once it ended, the id may be used again.
    let r = c
        .run_completed(exec_json("dup", "shell", "echo again", 30_000, 64))
        .await;
    assert_eq!(r.stdout_text(), "again\n");
}

//! Admission control: `max_concurrent` run, `max_queue` wait, the rest get `SANDBOX_OVERLOADED` at once, and
//! `pong.load` tells the truth (spec section 6).

use std::collections::BTreeMap;
use std::time::Duration;

use protocol::{ErrorCode, ExecStatus, Reason, ServerMessage};

use super::harness::{assert_error, exec_json, privileged, Client, Collected, Daemon, DaemonOpts};

#[tokio::test]
async fn overload_refuses_exactly_the_surplus_at_once() {
    let Some(_g) = privileged("overload_refuses_exactly_the_surplus_at_once").await else {
        return;
    };
    let d = Daemon::start(DaemonOpts {
        max_concurrent: 2,
        max_queue: 2,
        ..DaemonOpts::default()
    })
    .await;
    let mut c = Client::connect(&d).await;
    let ids: Vec<String> = (0..7).map(|i| format!("load-{i}")).collect();
    let execs: Vec<_> = ids
        .iter()
        .map(|id| exec_json(id, "shell", "sleep 5", 60_000, 64))
        .collect();
    c.send_all(&execs).await;

    // Every request gets its answer (ack or refusal) before any of the 5 s sleeps can end.
    let mut acks: BTreeMap<String, bool> = BTreeMap::new();
    let mut refused: Vec<String> = Vec::new();
    let mut seen: BTreeMap<String, Collected> = BTreeMap::new();
    while acks.len() + refused.len() < ids.len() {
        let (m, raw) = c.next_raw().await;
        if let Some(id) = m.id() {
            seen.entry(id.to_owned())
                .or_insert_with(|| Collected::new(id))
                .push(m.clone(), raw.clone());
        }
        match m {
            ServerMessage::Ack { id, queued, .. } => {
                acks.insert(
                    id,
                    queued.unwrap_or_else(|| panic!("sandboxd's ack has queued: {raw}")),
                );
            }
            ServerMessage::Error(e) => {
                assert_error(&e, &raw, ErrorCode::SandboxOverloaded, e.id.as_deref());
                assert!(e.retryable, "SANDBOX_OVERLOADED is retryable: {raw}");
                refused.push(
                    e.id.clone()
                        .unwrap_or_else(|| panic!("the refusal echoes the id: {raw}")),
                );
            }
            ServerMessage::Status {
                status: ExecStatus::Running,
                ..
            }
            | ServerMessage::Stdout(_) => {}
            other => panic!("unexpected before every request was answered: {other:?}"),
        }
    }
    // The connection keeps running/queued messages for later.
    let running: Vec<&String> = acks
        .iter()
        .filter(|(_, q)| !**q)
        .map(|(id, _)| id)
        .collect();
    let queued: Vec<&String> = acks.iter().filter(|(_, q)| **q).map(|(id, _)| id).collect();
    assert_eq!(
        refused.len(),
        3,
        "exactly the surplus is refused: refused {refused:?}, acks {acks:?}"
    );
    assert_eq!(running.len(), 2, "max_concurrent run at once: {acks:?}");
    assert_eq!(queued.len(), 2, "max_queue wait: {acks:?}");
    // In order of arrival.
    assert_eq!(running, [&ids[0], &ids[1]]);
    assert_eq!(queued, [&ids[2], &ids[3]]);
    assert_eq!(refused, ids[4..].to_vec());

    let pong = c.ping().await;
    assert_eq!(
        (pong.load.active_executions, pong.load.queue_depth),
        (2, 2),
        "pong.load is truthful: {pong:?}"
    );
    let (_, health) = d.healthz().await;
    assert_eq!(health["active_executions"], 2, "{health}");
    assert_eq!(health["queue_depth"], 2, "{health}");

    // Cancel everything (queued first, so nothing new starts), and all four end as cancelled.
    for id in ids[..4].iter().rev() {
        c.cancel(id).await;
    }
    for id in &ids[..4] {
        let mut r = seen.remove(id).unwrap_or_else(|| Collected::new(id));
        c.collect_into(&mut r).await;
        r.check_sequence();
        assert_eq!(
            r.terminal_status(),
            Some(ExecStatus::Cancelled),
            "{}",
            r.dump()
        );
        assert_eq!(r.result().reason, Reason::Cancelled, "{}", r.dump());
    }
    for id in &ids[4..] {
        assert!(
            c.unclaimed().iter().all(|m| m.id() != Some(id.as_str())),
            "a refused execution gets nothing after its error: {:?}",
            c.unclaimed()
        );
    }
    let start = std::time::Instant::now();
    loop {
        let p = c.ping().await;
        if (p.load.active_executions, p.load.queue_depth) == (0, 0) {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "the load stays at {:?}",
            p.load
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn queued_executions_run_in_order_when_slots_free() {
    let Some(_g) = privileged("queued_executions_run_in_order_when_slots_free").await else {
        return;
    };
    let d = Daemon::start(DaemonOpts {
        max_concurrent: 1,
        max_queue: 3,
        ..DaemonOpts::default()
    })
    .await;
    let mut c = Client::connect(&d).await;
    let ids = ["q-0", "q-1", "q-2", "q-3"];
    let execs: Vec<_> = ids
        .iter()
        .map(|id| exec_json(id, "shell", &format!("sleep 0.2; echo {id}"), 30_000, 64))
        .collect();
    c.send_all(&execs).await;
    for (i, id) in ids.iter().enumerate() {
        let r = c.collect(id).await;
        r.check_sequence();
        assert_eq!(
            r.ack().1,
            Some(i > 0),
            "only the first runs at once: {}",
            r.dump()
        );
        assert_eq!(
            r.terminal_status(),
            Some(ExecStatus::Completed),
            "{}",
            r.dump()
        );
        assert_eq!(r.stdout_text(), format!("{id}\n"));
    }
    let p = c.ping().await;
    assert_eq!(p.load.queue_depth, 0, "{p:?}");
}

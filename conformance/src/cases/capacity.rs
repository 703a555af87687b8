//! P.6: capacity (spec section 6). One scenario, run once and judged by several cases: it saturates the server
//! with long-running executions until one is refused with `SANDBOX_OVERLOADED`, which discovers `max_concurrent`
//! (executions that reached `status:running`) and `max_queue` (the others that were acknowledged), then frees
//! capacity step by step.
//!
//! The scenario assumes the suite is the server's only client while it runs.

use std::time::{Duration, Instant};

use serde_json::{json, Value};

use super::{case, ended, sequence, C};
use crate::ctx::{load_of, Ctx};
use crate::framework::{Case, CaseResult, Stop};
use crate::msgs::cancel;
pub use crate::observed::CapacityObs;
use crate::wire::{check_error, short};
use crate::{check, fail, skip};

/// The most executions the scenario sends before it gives up on saturating the server.
const MAX_SATURATION: usize = 128;

const OVERLOAD: &str = "The server runs at most `max_concurrent` executions (config) and queues up to `max_queue` more. Beyond that, `execute` gets `SANDBOX_OVERLOADED` at once.";
const AT_ONCE: &str = "`SANDBOX_OVERLOADED` (retryable): no execution slot and the wait queue is full; sent at once, never after a hang.";
const RETRY: &str = "| `SANDBOX_OVERLOADED` | yes | no execution slot and the wait queue is full |";
const LOAD: &str = "`pong.load` reports both numbers truthfully. (`ack.queued`: true if the execution waits for a slot.)";
const QUEUE: &str = "The server runs at most `max_concurrent` executions (config) and queues up to `max_queue` more.";
const CANCEL: &str = "An id that is in flight (running or queued) can be cancelled; cancelled before it started, it ends as `status: cancelled` with its `result`.";

/// The cases of this group, in id order.
pub static CASES: &[Case] = &[
    case!(
        "P.6.1",
        Must,
        "6",
        "Beyond capacity, execute gets SANDBOX_OVERLOADED",
        OVERLOAD,
        overloaded
    ),
    case!(
        "P.6.2",
        Must,
        "4, 6",
        "SANDBOX_OVERLOADED is sent at once",
        AT_ONCE,
        at_once
    ),
    case!(
        "P.6.3",
        Must,
        "4",
        "SANDBOX_OVERLOADED is retryable and echoes the id",
        RETRY,
        retryable
    ),
    case!(
        "P.6.4",
        Must,
        "6",
        "pong.load is truthful while saturated",
        LOAD,
        load_truthful
    ),
    case!(
        "P.6.5",
        Must,
        "6",
        "A queued execution starts when a slot frees",
        QUEUE,
        queued_starts
    ),
    case!(
        "P.6.6",
        Must,
        "3, 6",
        "Cancel of a queued execution ends it as cancelled",
        CANCEL,
        queued_cancel
    ),
    case!(
        "P.6.7",
        Must,
        "6",
        "pong.load returns to 0 when everything ended",
        LOAD,
        load_back
    ),
    case!(
        "P.6.8",
        Should,
        "4, 6",
        "A retry is accepted once capacity is free",
        RETRY,
        retry_accepted
    ),
    case!(
        "P.6.9",
        Info,
        "6",
        "Discovered max_concurrent and max_queue",
        QUEUE,
        discovered
    ),
    case!(
        "P.6.10",
        Info,
        "6",
        "Whether queued executions start in order of arrival",
        "The server ... queues up to `max_queue` more. (The spec does not say in which order they start.)",
        queue_order
    ),
];

/// Runs the capacity scenario once per run.
pub async fn observe(ctx: &Ctx) -> Result<CapacityObs, Stop> {
    ctx.capacity.get_or_init(|| scenario(ctx)).await.clone()
}

async fn scenario(ctx: &Ctx) -> Result<CapacityObs, Stop> {
    let lang = ctx.shell()?;
    let mut c = ctx.connect().await?;
    ctx.wait_load(&mut c, (0, 0), ctx.secs(20))
        .await
        .map_err(|s| {
            Stop::Harness(format!(
                "the server is not idle, so its capacity cannot be measured: {}",
                s.message()
            ))
        })?;
    let timeout = ctx.fit("timeout_ms", 120_000);
    let memory = ctx.fit("memory_mb", 32);
    let not_yet = || Err(Stop::Harness("not observed".into()));
    let mut obs = CapacityObs {
        max_concurrent: 0,
        max_queue: 0,
        refusal: None,
        refusal_latency: Duration::ZERO,
        load_truthful: Err(String::new()),
        queued_started: not_yet(),
        retry_accepted: not_yet(),
        queued_cancel: not_yet(),
        load_back: Err(String::new()),
        queue_order: None,
    };
    let mut accepted: Vec<(String, Option<bool>)> = Vec::new();
    let started = Instant::now();
    for _ in 0..MAX_SATURATION {
        let id = ctx.id("cap");
        let exec = crate::msgs::execute(&id, lang, "sleep 120", timeout, memory);
        let sent = Instant::now();
        c.send_json(&exec).await?;
        // Observed, not taken: the ack stays for the execution's later collection.
        let m = c
            .observe(
                ctx.secs(10),
                &format!("the ack or refusal of saturating execute {id}"),
                |m| m.is_for(&id) && matches!(m.kind(), "ack" | "error"),
            )
            .await?;
        if m.kind() == "error" {
            obs.refusal_latency = sent.elapsed();
            c.discard(|x| x.is_for(&id));
            obs.refusal = Some((id, m.raw));
            break;
        }
        accepted.push((id, m.raw.get("queued").and_then(Value::as_bool)));
    }
    let accepted_ids: Vec<String> = accepted.iter().map(|(id, _)| id.clone()).collect();
    if obs.refusal.is_none() {
        for id in &accepted_ids {
            let _ = c.send_json(&cancel(id)).await;
        }
        c.close().await;
        return Err(Stop::Skip(format!(
            "{MAX_SATURATION} long-running executions were accepted without SANDBOX_OVERLOADED: the capacity is larger than the suite tries"
        )));
    }

    // How many run: wait until the running statuses and pong.load agree (they may lag behind the acks).
    let running_ids = |c: &crate::client::Conn| -> Vec<String> {
        accepted_ids
            .iter()
            .filter(|id| {
                c.unclaimed()
                    .iter()
                    .any(|m| m.is_for(id) && m.status() == Some("running"))
            })
            .cloned()
            .collect()
    };
    let mut last = String::new();
    obs.load_truthful = Err(String::new());
    let deadline = Instant::now() + ctx.secs(20);
    while Instant::now() < deadline {
        let pong = c.ping(ctx.secs(5)).await?;
        let running = running_ids(&c).len() as u64;
        let queued = accepted_ids.len() as u64 - running;
        let load = load_of(&pong.raw);
        last = format!(
            "{} running and {queued} queued observed, pong.load {}",
            running,
            short(&pong.raw["load"])
        );
        if load == Some((running, queued)) && running > 0 {
            obs.load_truthful = Ok(last.clone());
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    if obs.load_truthful.is_err() {
        obs.load_truthful = Err(format!("after {:?}: {last}", ctx.secs(20)));
    }
    let running = running_ids(&c);
    // ack.queued (sandboxd addition), when sent, tells the same story.
    for (id, queued) in &accepted {
        if let Some(q) = queued {
            if *q == running.contains(id) {
                obs.load_truthful = Err(format!(
                    "execution {id} was acknowledged with queued {q}, but it {} at once",
                    if running.contains(id) {
                        "ran"
                    } else {
                        "did not run"
                    }
                ));
            }
        }
    }
    obs.max_concurrent = running.len() as u64;
    obs.max_queue = (accepted_ids.len() - running.len()) as u64;
    let queued: Vec<String> = accepted_ids
        .iter()
        .filter(|id| !running.contains(id))
        .cloned()
        .collect();

    // Free a slot: a queued execution must start, and the refused request, retried, must be accepted.
    let refused_id = obs
        .refusal
        .as_ref()
        .map(|(id, _)| id.clone())
        .unwrap_or_default();
    let mut in_flight: Vec<String> = accepted_ids.clone();
    obs.queued_started = Err(Stop::Skip(
        "no execution was queued (max_queue is 0)".into(),
    ));
    obs.retry_accepted = Err(Stop::Skip(
        "no execution ran, so none could be cancelled to free a slot".into(),
    ));
    if let Some(first) = running.first() {
        c.send_json(&cancel(first)).await?;
        let e = c.collect(first, started, ctx.secs(10)).await?;
        in_flight.retain(|x| x != first);
        if e.terminal_status().as_deref() != Some("cancelled") {
            obs.queued_started = Err(Stop::Fail(format!(
                "cancelling a running execution to free a slot failed: {}",
                e.dump()
            )));
        } else if let Some(next) = queued.first() {
            let waiting = queued.clone();
            obs.queued_started = match c
                .observe(
                    ctx.secs(10),
                    "a queued execution's status:running once a slot was freed",
                    |m| {
                        m.status() == Some("running")
                            && m.id().is_some_and(|id| waiting.iter().any(|q| q == id))
                    },
                )
                .await
            {
                Ok(m) => {
                    let started = m.id().unwrap_or_default().to_owned();
                    obs.queue_order = Some(if &started == next {
                        format!("the first queued execution ({next}) started first")
                    } else {
                        format!("{started} started before {next}, which had been queued earlier: the queue is not first-in first-out")
                    });
                    Ok(format!("{started} started once {first} was cancelled"))
                }
                Err(s) => Err(s),
            };
        }
        let retry = crate::msgs::execute(&refused_id, lang, "sleep 120", timeout, memory);
        c.send_json(&retry).await?;
        obs.retry_accepted = match c
            .observe(ctx.secs(10), "the answer to the retried execute", |m| {
                m.is_for(&refused_id) && matches!(m.kind(), "ack" | "error")
            })
            .await
        {
            Ok(m) if m.kind() == "ack" => {
                in_flight.push(refused_id.clone());
                Ok("the refused execute, retried after a slot was freed, was accepted".into())
            }
            Ok(m) => {
                c.discard(|x| x.is_for(&refused_id));
                Err(Stop::Fail(format!(
                    "the retry was refused again: {}",
                    short(&m.raw)
                )))
            }
            Err(s) => Err(s),
        };
    }

    // Cancel a queued execution (the last one acknowledged, which is still waiting).
    obs.queued_cancel = Err(Stop::Skip(
        "no execution was queued (max_queue is 0)".into(),
    ));
    if obs.max_queue > 0 {
        let pong = c.ping(ctx.secs(5)).await?;
        let still_queued: Vec<String> = in_flight
            .iter()
            .filter(|id| {
                !c.unclaimed()
                    .iter()
                    .any(|m| m.is_for(id) && m.status() == Some("running"))
            })
            .cloned()
            .collect();
        if let Some(q) = still_queued.last().cloned() {
            c.send_json(&cancel(&q)).await?;
            obs.queued_cancel = match c.collect(&q, started, ctx.secs(10)).await {
                Ok(e) => {
                    in_flight.retain(|x| x != &q);
                    sequence(&e)
                        .and_then(|()| ended(&e, "cancelled", "cancelled"))
                        .map(|()| {
                            if e.statuses().iter().any(|s| s == "running") {
                                "it had started meanwhile; cancelled".into()
                            } else {
                                "cancelled while queued (no status:running)".into()
                            }
                        })
                }
                Err(s) => Err(s),
            };
        } else {
            obs.queued_cancel = Err(Stop::Harness(format!(
                "no queued execution left to cancel (pong {})",
                short(&pong.raw)
            )));
        }
    }

    // Cancel the rest; the load must return to 0.
    for id in &in_flight {
        c.send_json(&cancel(id)).await?;
    }
    for id in &in_flight {
        c.collect(id, started, ctx.secs(15)).await?;
    }
    obs.load_back = match ctx.wait_load(&mut c, (0, 0), ctx.secs(20)).await {
        Ok(()) => Ok(String::new()),
        Err(s) => Err(s.message().to_owned()),
    };
    c.close().await;
    Ok(obs)
}

async fn overloaded(ctx: C) -> CaseResult {
    let obs = observe(&ctx).await?;
    let Some((id, raw)) = &obs.refusal else {
        fail!("no refusal observed")
    };
    check!(
        raw["code"] == "SANDBOX_OVERLOADED",
        "execute beyond capacity got {} instead of SANDBOX_OVERLOADED",
        short(raw)
    );
    check!(
        raw["id"] == json!(id),
        "the SANDBOX_OVERLOADED error does not echo the id {id:?}: {}",
        short(raw)
    );
    Ok(format!(
        "refused after {} running and {} queued",
        obs.max_concurrent, obs.max_queue
    ))
}

fn refusal(obs: &CapacityObs) -> Result<&(String, Value), Stop> {
    match &obs.refusal {
        Some(r) if r.1["code"] == "SANDBOX_OVERLOADED" => Ok(r),
        Some(r) => Err(Stop::Skip(format!(
            "the saturating execute was refused with {}, not SANDBOX_OVERLOADED (see P.6.1)",
            r.1["code"]
        ))),
        None => Err(Stop::Skip("no SANDBOX_OVERLOADED was observed".into())),
    }
}

async fn at_once(ctx: C) -> CaseResult {
    let obs = observe(&ctx).await?;
    refusal(&obs)?;
    let bound = ctx
        .scaled(Duration::from_secs(1))
        .max(Duration::from_millis(500));
    check!(
        obs.refusal_latency <= bound,
        "SANDBOX_OVERLOADED came {:?} after the execute (bound {bound:?}): not at once",
        obs.refusal_latency
    );
    Ok(format!("after {:?}", obs.refusal_latency))
}

async fn retryable(ctx: C) -> CaseResult {
    let obs = observe(&ctx).await?;
    let (id, raw) = refusal(&obs)?;
    crate::framework::checked(check_error(raw, "SANDBOX_OVERLOADED", Some(id)))?;
    Ok(String::new())
}

async fn load_truthful(ctx: C) -> CaseResult {
    let obs = observe(&ctx).await?;
    obs.load_truthful.clone().map_err(|e| {
        Stop::Fail(format!(
            "pong.load does not match the executions observed: {e}"
        ))
    })
}

async fn queued_starts(ctx: C) -> CaseResult {
    observe(&ctx).await?.queued_started
}

async fn queued_cancel(ctx: C) -> CaseResult {
    observe(&ctx).await?.queued_cancel
}

async fn load_back(ctx: C) -> CaseResult {
    observe(&ctx).await?.load_back.map_err(Stop::Fail)
}

async fn retry_accepted(ctx: C) -> CaseResult {
    observe(&ctx).await?.retry_accepted
}

async fn discovered(ctx: C) -> CaseResult {
    let obs = match observe(&ctx).await {
        Ok(o) => o,
        Err(Stop::Skip(s)) => skip!("{s}"),
        Err(e) => return Err(e),
    };
    Ok(format!(
        "max_concurrent {} and max_queue {} (as observed)",
        obs.max_concurrent, obs.max_queue
    ))
}

async fn queue_order(ctx: C) -> CaseResult {
    match observe(&ctx).await?.queue_order {
        Some(o) => Ok(o),
        None => skip!("no queued execution was seen to start"),
    }
}

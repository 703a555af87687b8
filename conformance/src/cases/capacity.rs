//! P.6: capacity (spec section 6). One scenario, run once and judged by several cases: it saturates the server
//! with long-running executions until one is refused with `SANDBOX_OVERLOADED`, which discovers `max_concurrent`
//! (executions that reached `status:running`) and `max_queue` (the others that were acknowledged), then frees
//! capacity step by step.
//!
//! The scenario assumes the suite is the server's only client while it runs.

use std::time::{Duration, Instant};

use serde_json::{json, Value};

use super::common::{case, ended, sequence, C};
use crate::client::Conn;
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
    let mut s = Scenario::begin(ctx).await?;
    if !s.saturate().await? {
        return Err(s.give_up().await);
    }
    let (running, queued) = s.count().await?;
    s.free_a_slot(&running, &queued).await?;
    s.cancel_queued().await?;
    s.wind_down().await
}

/// The capacity scenario between its phases: saturate, count, free a slot, cancel a queued execution, wind
/// down. Each phase records its findings in `obs`; an `Err` of a phase ends the scenario (and its connection)
/// at once.
struct Scenario<'a> {
    ctx: &'a Ctx,
    c: Conn,
    lang: &'static str,
    /// The saturating executions' `timeout_ms` and `memory_mb`.
    timeout: u64,
    memory: u64,
    /// When the saturation began: the executions are collected from then on.
    started: Instant,
    obs: CapacityObs,
    /// The acknowledged executions, in order, with their `ack.queued` when sent.
    accepted: Vec<(String, Option<bool>)>,
    /// The executions not ended yet, once counted.
    in_flight: Vec<String>,
}

impl<'a> Scenario<'a> {
    /// Connects, once the server is idle.
    async fn begin(ctx: &'a Ctx) -> Result<Scenario<'a>, Stop> {
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
        let not_yet = || Err(Stop::Harness("not observed".into()));
        Ok(Scenario {
            ctx,
            c,
            lang,
            timeout: ctx.fit("timeout_ms", 120_000),
            memory: ctx.fit("memory_mb", 32),
            obs: CapacityObs {
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
            },
            accepted: Vec::new(),
            in_flight: Vec::new(),
            started: Instant::now(),
        })
    }

    /// Sends long-running executions until one is refused (true), or [`MAX_SATURATION`] were accepted (false).
    async fn saturate(&mut self) -> Result<bool, Stop> {
        let ctx = self.ctx;
        for _ in 0..MAX_SATURATION {
            let id = ctx.id("cap");
            let exec = crate::msgs::execute(&id, self.lang, "sleep 120", self.timeout, self.memory);
            let sent = Instant::now();
            self.c.send_json(&exec).await?;
            // Observed, not taken: the ack stays for the execution's later collection.
            let m = self
                .c
                .observe(
                    ctx.secs(10),
                    &format!("the ack or refusal of saturating execute {id}"),
                    |m| m.is_for(&id) && matches!(m.kind(), "ack" | "error"),
                )
                .await?;
            if m.kind() == "error" {
                self.obs.refusal_latency = sent.elapsed();
                self.c.discard(|x| x.is_for(&id));
                self.obs.refusal = Some((id, m.raw));
                return Ok(true);
            }
            self.accepted
                .push((id, m.raw.get("queued").and_then(Value::as_bool)));
        }
        Ok(false)
    }

    /// No refusal: cancels everything and skips.
    async fn give_up(mut self) -> Stop {
        for (id, _) in &self.accepted {
            let _ = self.c.send_json(&cancel(id)).await;
        }
        self.c.close().await;
        Stop::Skip(format!(
            "{MAX_SATURATION} long-running executions were accepted without SANDBOX_OVERLOADED: the capacity is larger than the suite tries"
        ))
    }

    fn accepted_ids(&self) -> Vec<String> {
        self.accepted.iter().map(|(id, _)| id.clone()).collect()
    }

    /// The accepted executions that sent `status: running`.
    fn running_ids(&self) -> Vec<String> {
        self.accepted_ids()
            .into_iter()
            .filter(|id| {
                self.c
                    .unclaimed()
                    .iter()
                    .any(|m| m.is_for(id) && m.status() == Some("running"))
            })
            .collect()
    }

    /// How many run and how many wait: waits until the running statuses and `pong.load` agree (they may lag
    /// behind the acks). Returns the running and the queued executions.
    async fn count(&mut self) -> Result<(Vec<String>, Vec<String>), Stop> {
        let ctx = self.ctx;
        let accepted = self.accepted.len() as u64;
        let mut last = String::new();
        self.obs.load_truthful = Err(String::new());
        let deadline = Instant::now() + ctx.secs(20);
        while Instant::now() < deadline {
            let pong = self.c.ping(ctx.secs(5)).await?;
            let running = self.running_ids().len() as u64;
            let queued = accepted - running;
            let load = load_of(&pong.raw);
            last = format!(
                "{} running and {queued} queued observed, pong.load {}",
                running,
                short(&pong.raw["load"])
            );
            if load == Some((running, queued)) && running > 0 {
                self.obs.load_truthful = Ok(last.clone());
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        if self.obs.load_truthful.is_err() {
            self.obs.load_truthful = Err(format!("after {:?}: {last}", ctx.secs(20)));
        }
        let running = self.running_ids();
        // ack.queued (sandboxd addition), when sent, tells the same story.
        for (id, queued) in &self.accepted {
            if let Some(q) = queued {
                if *q == running.contains(id) {
                    self.obs.load_truthful = Err(format!(
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
        let accepted_ids = self.accepted_ids();
        self.obs.max_concurrent = running.len() as u64;
        self.obs.max_queue = (accepted_ids.len() - running.len()) as u64;
        let queued: Vec<String> = accepted_ids
            .iter()
            .filter(|id| !running.contains(id))
            .cloned()
            .collect();
        self.in_flight = accepted_ids;
        Ok((running, queued))
    }

    /// Frees a slot by cancelling a running execution: a queued execution must start, and the refused request,
    /// retried, must be accepted.
    async fn free_a_slot(&mut self, running: &[String], queued: &[String]) -> Result<(), Stop> {
        let ctx = self.ctx;
        self.obs.queued_started = Err(Stop::Skip(
            "no execution was queued (max_queue is 0)".into(),
        ));
        self.obs.retry_accepted = Err(Stop::Skip(
            "no execution ran, so none could be cancelled to free a slot".into(),
        ));
        let Some(first) = running.first() else {
            return Ok(());
        };
        self.c.send_json(&cancel(first)).await?;
        let e = self.c.collect(first, self.started, ctx.secs(10)).await?;
        self.in_flight.retain(|x| x != first);
        if e.terminal_status().as_deref() != Some("cancelled") {
            self.obs.queued_started = Err(Stop::Fail(format!(
                "cancelling a running execution to free a slot failed: {}",
                e.dump()
            )));
        } else if let Some(next) = queued.first() {
            let started = self
                .c
                .observe(
                    ctx.secs(10),
                    "a queued execution's status:running once a slot was freed",
                    |m| {
                        m.status() == Some("running")
                            && m.id().is_some_and(|id| queued.iter().any(|q| q == id))
                    },
                )
                .await;
            self.obs.queued_started = match started {
                Ok(m) => {
                    let started = m.id().unwrap_or_default().to_owned();
                    self.obs.queue_order = Some(if &started == next {
                        format!("the first queued execution ({next}) started first")
                    } else {
                        format!("{started} started before {next}, which had been queued earlier: the queue is not first-in first-out")
                    });
                    Ok(format!("{started} started once {first} was cancelled"))
                }
                Err(s) => Err(s),
            };
        }
        self.retry_refused().await
    }

    /// Sends the refused execute again, now that a slot was freed.
    async fn retry_refused(&mut self) -> Result<(), Stop> {
        let refused_id = self
            .obs
            .refusal
            .as_ref()
            .map(|(id, _)| id.clone())
            .unwrap_or_default();
        let retry = crate::msgs::execute(
            &refused_id,
            self.lang,
            "sleep 120",
            self.timeout,
            self.memory,
        );
        self.c.send_json(&retry).await?;
        self.obs.retry_accepted = match self
            .c
            .observe(
                self.ctx.secs(10),
                "the answer to the retried execute",
                |m| m.is_for(&refused_id) && matches!(m.kind(), "ack" | "error"),
            )
            .await
        {
            Ok(m) if m.kind() == "ack" => {
                self.in_flight.push(refused_id.clone());
                Ok("the refused execute, retried after a slot was freed, was accepted".into())
            }
            Ok(m) => {
                self.c.discard(|x| x.is_for(&refused_id));
                Err(Stop::Fail(format!(
                    "the retry was refused again: {}",
                    short(&m.raw)
                )))
            }
            Err(s) => Err(s),
        };
        Ok(())
    }

    /// Cancels a queued execution (the last one acknowledged, which is still waiting).
    async fn cancel_queued(&mut self) -> Result<(), Stop> {
        let ctx = self.ctx;
        self.obs.queued_cancel = Err(Stop::Skip(
            "no execution was queued (max_queue is 0)".into(),
        ));
        if self.obs.max_queue == 0 {
            return Ok(());
        }
        let pong = self.c.ping(ctx.secs(5)).await?;
        let unclaimed = self.c.unclaimed();
        let still_queued: Vec<String> = self
            .in_flight
            .iter()
            .filter(|id| {
                !unclaimed
                    .iter()
                    .any(|m| m.is_for(id) && m.status() == Some("running"))
            })
            .cloned()
            .collect();
        let Some(q) = still_queued.last().cloned() else {
            self.obs.queued_cancel = Err(Stop::Harness(format!(
                "no queued execution left to cancel (pong {})",
                short(&pong.raw)
            )));
            return Ok(());
        };
        self.c.send_json(&cancel(&q)).await?;
        self.obs.queued_cancel = match self.c.collect(&q, self.started, ctx.secs(10)).await {
            Ok(e) => {
                self.in_flight.retain(|x| x != &q);
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
        Ok(())
    }

    /// Cancels the rest; the load must return to 0.
    async fn wind_down(mut self) -> Result<CapacityObs, Stop> {
        let ctx = self.ctx;
        for id in &self.in_flight {
            self.c.send_json(&cancel(id)).await?;
        }
        for id in &self.in_flight {
            self.c.collect(id, self.started, ctx.secs(15)).await?;
        }
        self.obs.load_back = match ctx.wait_load(&mut self.c, (0, 0), ctx.secs(20)).await {
            Ok(()) => Ok(String::new()),
            Err(s) => Err(s.message().to_owned()),
        };
        self.c.close().await;
        Ok(self.obs)
    }
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

//! `cargo bench -p sandboxd-client`: pool checkout and reconnect times against a real sandboxd (root needed; the
//! daemon binary is `target/release/sandboxd`, from `cargo build --release -p sandboxd`, or `$SANDBOXD_BIN`).
//!
//! Prints, for a pool of 5 + 10 on 127.0.0.1:
//! - warm checkout (an idle connection, health-check `ping` included): p50, p99, max over 2000 sequential
//!   checkouts, and with 5 callers at once;
//! - a cold connect (TCP + WebSocket upgrade) and a whole `execute` of `true`, for comparison;
//! - reconnect: the daemon SIGKILLed, down for 500 ms, started again on the same port and state; from the restart
//!   (process spawned) to `/healthz` answering, and to the first successful `pool.execute` of a caller retrying
//!   every 5 ms; then until every idle pooled connection is connected again (its own backoff, or replaced at
//!   check-in by a fresh connection).
#![allow(missing_docs)]
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

#[path = "../tests/suite/daemon.rs"]
mod daemon;

use common::percentile;
use std::time::{Duration, Instant};

use client::{
    new_execution_id, ConnectOptions, Connection, Execute, ExecuteRequest, Language, Pool,
    RequestedLimits,
};
use daemon::{Daemon, DaemonOpts};

fn summary(name: &str, mut v: Vec<Duration>) {
    v.sort();
    let us = |d: Duration| d.as_secs_f64() * 1e6;
    println!(
        "{name:<44} n={:<5} p50 {:>9.1} µs   p99 {:>9.1} µs   max {:>9.1} µs",
        v.len(),
        us(percentile(&v, 50)),
        us(percentile(&v, 99)),
        us(v[v.len() - 1])
    );
}

fn true_request() -> ExecuteRequest {
    ExecuteRequest::new(
        new_execution_id(),
        Language::Shell,
        "true",
        RequestedLimits::new(10_000, 64),
    )
}

fn main() {
    common::block_on(run());
}

async fn run() {
    let Some(bin) = daemon::require_daemon("pool bench") else {
        return;
    };
    println!("sandboxd binary: {}", bin.display());
    let mut d = Daemon::start(&bin, DaemonOpts::default()).await;
    let pool = Pool::builder(d.url())
        .token(d.token.clone())
        .size(5)
        .max_overflow(10)
        .build()
        .unwrap();
    pool.warm_up().await.unwrap();

    summary("warm checkout (1 caller)", warm_checkouts(&pool).await);
    summary(
        "warm checkout (5 callers at once)",
        concurrent_warm_checkouts(&pool).await,
    );
    summary("cold connect (TCP + upgrade)", cold_connects(&d).await);
    summary("pool.execute(`true`) end to end", executions(&pool).await);
    reconnects(&pool, &mut d).await;
}

/// `n` sequential checkouts of an idle connection, each returned at once.
async fn checkout_times(pool: &Pool, n: usize) -> Vec<Duration> {
    let mut v = Vec::new();
    for _ in 0..n {
        let t = Instant::now();
        let lease = pool.checkout().await.unwrap();
        v.push(t.elapsed());
        drop(lease);
    }
    v
}

/// Warm checkout, one caller: 2000 timed after 100 untimed.
async fn warm_checkouts(pool: &Pool) -> Vec<Duration> {
    for _ in 0..100 {
        drop(pool.checkout().await.unwrap());
    }
    checkout_times(pool, 2000).await
}

/// Warm checkout, 5 callers at once (as many as base connections), 400 each.
async fn concurrent_warm_checkouts(pool: &Pool) -> Vec<Duration> {
    let tasks: Vec<_> = (0..5)
        .map(|_| {
            let pool = pool.clone();
            tokio::spawn(async move { checkout_times(&pool, 400).await })
        })
        .collect();
    let mut v = Vec::new();
    for t in tasks {
        v.extend(t.await.unwrap());
    }
    v
}

/// Cold connect, for comparison: 100 connections opened and closed.
async fn cold_connects(d: &Daemon) -> Vec<Duration> {
    let mut v = Vec::new();
    for _ in 0..100 {
        let t = Instant::now();
        let c = Connection::connect(ConnectOptions::new(d.url()).token(d.token.clone()))
            .await
            .unwrap();
        v.push(t.elapsed());
        c.close();
    }
    v
}

/// A whole execution, for scale: 50 of them.
async fn executions(pool: &Pool) -> Vec<Duration> {
    let mut v = Vec::new();
    for _ in 0..50 {
        let t = Instant::now();
        pool.execute(true_request()).await.unwrap();
        v.push(t.elapsed());
    }
    v
}

/// Times of one restart, from the respawn.
struct Round {
    /// To `/healthz` answering 200.
    healthy: Duration,
    /// To the first successful `pool.execute`.
    first: Duration,
    /// To every idle pooled connection connected again (`Duration::MAX` if not within 60 s).
    idle_back: Duration,
}

/// Five restarts, each round printed, then the medians.
async fn reconnects(pool: &Pool, d: &mut Daemon) {
    println!();
    println!("reconnect (daemon SIGKILLed, down 500 ms, restarted on the same port and state):");
    let mut to_healthy = Vec::new();
    let mut to_first = Vec::new();
    let mut after_healthy = Vec::new();
    for round in 1..=5 {
        let Round {
            healthy,
            first,
            idle_back,
        } = restart(pool, d).await;
        println!(
            "  round {round}: restart → healthy {:>6.1} ms, → first execute ok {:>6.1} ms ({:>5.1} ms after healthy); \
             every idle connection connected again after {:>6.1} ms",
            healthy.as_secs_f64() * 1e3,
            first.as_secs_f64() * 1e3,
            first.saturating_sub(healthy).as_secs_f64() * 1e3,
            idle_back.as_secs_f64() * 1e3,
        );
        to_healthy.push(healthy);
        to_first.push(first);
        after_healthy.push(first.saturating_sub(healthy));
    }
    let median = |mut v: Vec<Duration>| {
        v.sort();
        v[v.len() / 2].as_secs_f64() * 1e3
    };
    println!(
        "  median: restart → healthy {:.1} ms, restart → first execute ok {:.1} ms, healthy → first execute ok {:.1} ms",
        median(to_healthy),
        median(to_first),
        median(after_healthy)
    );
}

/// One round: the pool at rest (its base connections idle and connected), the daemon SIGKILLed, down 500 ms,
/// respawned; timed from the respawn until the daemon serves again.
async fn restart(pool: &Pool, d: &mut Daemon) -> Round {
    pool.warm_up().await.unwrap();
    d.kill_hard();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let t0 = Instant::now();
    d.respawn();
    let healthy = tokio::spawn(healthy_after(d.url(), t0));
    let first = first_execute_after(pool, t0).await;
    let healthy = healthy.await.unwrap();
    let idle_back = idle_connected_after(pool, t0).await;
    d.wait_serving().await;
    Round {
        healthy,
        first,
        idle_back,
    }
}

/// Polls `/healthz` every 2 ms until it answers 200.
async fn healthy_after(url: String, t0: Instant) -> Duration {
    loop {
        if let Ok(h) = client::health(&url, None, Duration::from_secs(1)).await {
            if h.status == 200 {
                return t0.elapsed();
            }
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

/// A caller retrying `pool.execute` every 5 ms until one succeeds.
async fn first_execute_after(pool: &Pool, t0: Instant) -> Duration {
    loop {
        match pool.execute(true_request()).await {
            Ok(_) => break t0.elapsed(),
            Err(e) if e.is_retryable() => tokio::time::sleep(Duration::from_millis(5)).await,
            Err(e) => panic!("non-retryable error while the daemon restarts: {e}"),
        }
    }
}

/// The idle connections come back on their own backoff schedule (or are replaced by fresh ones at check-in).
async fn idle_connected_after(pool: &Pool, t0: Instant) -> Duration {
    loop {
        let s = pool.stats();
        if s.idle_connected >= s.idle && s.idle > 0 {
            break t0.elapsed();
        }
        if t0.elapsed() > Duration::from_secs(60) {
            break Duration::MAX;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

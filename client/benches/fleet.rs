//! `cargo bench -p sandboxd-client --bench fleet`: a fleet of three real daemons, each in its own network
//! namespace on a bridge (root needed; the daemon binary is `target/<profile>/sandboxd` or `$SANDBOXD_BIN`),
//! each with 12 warm containers (`pool.size`, as a production host has), against a single-endpoint pool in the
//! same run.
//!
//! Prints:
//! - placement: the decision alone (`Fleet::pick`, sampling two nodes and comparing their scores), p50 over
//!   100 000 calls, and `execute` of `true` end to end through the fleet and through a pool to one node,
//!   interleaved, p50 and p99 of each and the difference of the p50s: back to back, and settled (every node
//!   idle for 40 ms before each execution, the order alternating, 500 pairs), which leaves out the daemons'
//!   refill, with the median of the paired differences;
//! - the fleet's own cost: the same comparison against three in-process fake nodes that answer at once, where
//!   the client is all there is to measure (5 000 pairs);
//! - balance under uniform load: executions placed per node, max/min, over 300 executions 12 at a time;
//! - a node SIGKILLed under load: the time from the kill until no new execution is placed on it (its last
//!   placement), until it is ejected, and how the executions submitted in that window ended (result, `NodeLost`,
//!   other errors, none ending is a loss: must be 0).
#![allow(missing_docs)]
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

#[path = "../tests/suite/daemon.rs"]
mod daemon;
#[path = "../tests/suite/fake.rs"]
mod fake;
#[path = "../tests/suite/netns.rs"]
mod netns;

use common::percentile;
use std::sync::Arc;
use std::time::{Duration, Instant};

use client::{
    new_execution_id, ClientError, Discovery, Execute, ExecuteRequest, Fleet, Language, NodeHealth,
    Pool, RequestedLimits,
};
use daemon::Daemon;
use futures_util::stream::{self, StreamExt};

fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

fn summary(name: &str, v: &mut [Duration]) -> Duration {
    v.sort();
    let p50 = percentile(v, 50);
    println!(
        "{name:<44} n={:<6} p50 {:>9.2} µs   p99 {:>9.2} µs",
        v.len(),
        us(p50),
        us(percentile(v, 99)),
    );
    p50
}

fn request(code: &str) -> ExecuteRequest {
    ExecuteRequest::new(
        new_execution_id(),
        Language::Shell,
        code,
        RequestedLimits::new(10_000, 64),
    )
}

fn main() {
    common::block_on(run());
}

async fn run() {
    let Ok(bin) = daemon::sandboxd_binary() else {
        daemon::require_daemon("fleet bench");
        return;
    };
    let Some(hosts) = netns::hosts_with("fleet bench", 4, 12).await else {
        return;
    };
    println!("sandboxd binary: {}", bin.display());
    client_cost().await;
    let token = hosts.token.clone();
    let urls = hosts.urls();
    let pool_builder = |url: &str| {
        Pool::builder(url)
            .token(token.clone())
            .size(4)
            .max_overflow(16)
    };
    let fleet = Arc::new(
        Fleet::builder(Discovery::Static(urls.clone()))
            .pool(pool_builder(""))
            .check_interval(Duration::from_millis(200))
            .check_timeout(Duration::from_millis(500))
            .build()
            .await
            .unwrap(),
    );
    let single = pool_builder(&urls[0]).build().unwrap();
    placement(&fleet, &single).await;
    balance(&fleet).await;
    let mut hosts = hosts;
    node_death(&fleet, &mut hosts.daemons[2]).await;
}

async fn placement(fleet: &Fleet, single: &Pool) {
    let mut picks = Vec::with_capacity(100_000);
    for _ in 0..100_000 {
        let start = Instant::now();
        std::hint::black_box(fleet.pick());
        picks.push(start.elapsed());
    }
    summary("placement decision (Fleet::pick)", &mut picks);
    // Warm both up, then interleave.
    for _ in 0..20 {
        fleet.execute(request("true")).await.unwrap();
        single.execute(request("true")).await.unwrap();
    }
    let pairs = interleaved(fleet, single, 300, Duration::ZERO).await;
    report("back to back", "execute(`true`)", pairs);
    // Back to back, each figure also carries the daemons' state: a node that ran the previous execution is
    // still refilling its container pool, and three daemons share two cores with the client. With every node
    // idle for 40 ms before each execution, and the order alternating, what is left of the difference is the
    // client's own cost: the placement, the wait for the ack, the node watch.
    let pairs = interleaved(fleet, single, 500, Duration::from_millis(40)).await;
    report("settled", "execute(`true`)", pairs);
}

/// `n` pairs of `execute(true)`, one through the fleet and one through the pool, the order alternating, each
/// execution after `settle`: (through the fleet, through the pool).
async fn interleaved(
    fleet: &Fleet,
    single: &Pool,
    n: usize,
    settle: Duration,
) -> (Vec<Duration>, Vec<Duration>) {
    let (mut via_fleet, mut via_pool) = (Vec::new(), Vec::new());
    for i in 0..n {
        for fleet_now in [i % 2 == 0, i % 2 == 1] {
            if !settle.is_zero() {
                tokio::time::sleep(settle).await;
            }
            let start = Instant::now();
            if fleet_now {
                fleet.execute(request("true")).await.unwrap();
                via_fleet.push(start.elapsed());
            } else {
                single.execute(request("true")).await.unwrap();
                via_pool.push(start.elapsed());
            }
        }
    }
    (via_fleet, via_pool)
}

/// Prints both columns, the difference of their p50s and the median of the paired differences (each pair ran
/// one after the other, so it is the figure least disturbed by the nodes' own spread).
fn report(label: &str, what: &str, (mut via_fleet, mut via_pool): (Vec<Duration>, Vec<Duration>)) {
    let mut paired: Vec<f64> = via_fleet
        .iter()
        .zip(&via_pool)
        .map(|(f, p)| us(*f) - us(*p))
        .collect();
    paired.sort_by(f64::total_cmp);
    let f = summary(
        &format!("{label}: {what} through the fleet"),
        &mut via_fleet,
    );
    let p = summary(&format!("{label}: {what}, a one-node pool"), &mut via_pool);
    println!(
        "{label}: fleet overhead at p50: {:+.1} µs ({:.3}x the pool); median of the {} paired differences \
         {:+.1} µs",
        us(f) - us(p),
        f.as_secs_f64() / p.as_secs_f64(),
        paired.len(),
        paired[paired.len() / 2]
    );
}

/// The fleet's own cost, without a daemon's spread around it: three in-process fake nodes (loopback, answering
/// each `execute` at once with ack, status, output and result), a fleet over them against a pool to one of
/// them, interleaved.
async fn client_cost() {
    let (servers, _, _) = fake::three_hosts().await;
    let urls: Vec<String> = servers.iter().map(|s| s.url()).collect();
    let fleet = fake::fleet_of_fakes(Discovery::Static(urls.clone()))
        .pool(Pool::builder("").size(4))
        .build()
        .await
        .unwrap();
    let single = Pool::builder(&urls[0]).size(4).build().unwrap();
    for _ in 0..200 {
        fleet.execute(request("true")).await.unwrap();
        single.execute(request("true")).await.unwrap();
    }
    let pairs = interleaved(&fleet, &single, 5_000, Duration::ZERO).await;
    report("fake nodes", "execute", pairs);
}

fn placed(fleet: &Fleet) -> Vec<u64> {
    fleet.status().iter().map(|s| s.placed).collect()
}

async fn balance(fleet: &Fleet) {
    let before = placed(fleet);
    let results: Vec<_> = stream::iter(0..300)
        .map(|_| fleet.execute(request("sleep 0.05")))
        .buffer_unordered(12)
        .collect()
        .await;
    let failed = results.iter().filter(|r| r.is_err()).count();
    let per_node: Vec<u64> = placed(fleet)
        .iter()
        .zip(&before)
        .map(|(a, b)| a - b)
        .collect();
    let (max, min) = (
        per_node.iter().max().unwrap(),
        per_node.iter().min().unwrap(),
    );
    println!(
        "balance, 300 executions 12 at a time: per node {per_node:?}, max/min {:.2}, failed {failed}",
        *max as f64 / (*min).max(1) as f64
    );
}

async fn node_death(fleet: &Arc<Fleet>, victim: &mut Daemon) {
    let run = {
        let fleet = fleet.clone();
        tokio::spawn(async move {
            stream::iter(0..240)
                .map(|_| {
                    let fleet = fleet.clone();
                    async move {
                        tokio::time::timeout(
                            Duration::from_secs(60),
                            fleet.execute(request("sleep 0.2")),
                        )
                        .await
                    }
                })
                .buffer_unordered(9)
                .collect::<Vec<_>>()
                .await
        })
    };
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let mut last = placed(fleet)[2];
    let killed = Instant::now();
    victim.kill_hard();
    let mut last_change = killed;
    let mut ejected = None;
    while !run.is_finished() {
        let status = &fleet.status()[2];
        if status.placed != last {
            last = status.placed;
            last_change = Instant::now();
        }
        if ejected.is_none() && status.health == NodeHealth::Ejected {
            ejected = Some(killed.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let results = run.await.unwrap();
    let (mut ok, mut lost, mut other, mut hung) = (0, 0, 0, 0);
    for r in &results {
        match r {
            Ok(Ok(_)) => ok += 1,
            Ok(Err(ClientError::NodeLost { .. })) => lost += 1,
            Ok(Err(_)) => other += 1,
            Err(_) => hung += 1,
        }
    }
    println!(
        "node SIGKILLed under load: last placement on it {:.1} ms after the kill, ejected after {:.1} ms",
        (last_change.saturating_duration_since(killed)).as_secs_f64() * 1e3,
        ejected.map_or(f64::NAN, |d| d.as_secs_f64() * 1e3)
    );
    println!(
        "  240 executions: {ok} results, {lost} NodeLost (typed, retryable), {other} other errors, {hung} lost"
    );
}

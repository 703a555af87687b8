//! Sustained load, the latency bench's `SANDBOXD_BENCH_ONLY=sustained` tables: what a client running an evaluation
//! or a batch of test cases sees, as opposed to the gapped rows (each execution from a full pool).
//!
//! 1. Back to back: [`runs`] executions in a row on one connection (no gap: the pool drains, and each execution
//!    then waits for the refills it caused), per language, on this daemon and the baseline daemon in turns (the
//!    order alternates by round), each block from full pools; p50 and p90 of each block, the CPU per execution
//!    (daemon, helpers and containers, their removal included), and a bare spawn of the same program.
//! 2. In flight: python `print(1)` with 16 executions in flight, executions per second and CPU per execution, the
//!    two daemons in turns.
//!
//! `SANDBOXD_BENCH_RUNS` (default 500) and `SANDBOXD_BENCH_ROUNDS` (default 3) change the block and the rounds.
//! Each figure is a round's; the table quotes every round and their median.

use std::path::Path;
use std::time::Duration;

use super::{connect, execute, median_ms, pct, Daemon};

/// Executions per block.
fn runs() -> usize {
    env_or("SANDBOXD_BENCH_RUNS", 500)
}

fn rounds() -> usize {
    env_or("SANDBOXD_BENCH_ROUNDS", 3)
}

fn env_or(key: &str, default: usize) -> usize {
    std::env::var(key)
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default)
}

/// Executions in flight in the throughput rows.
const IN_FLIGHT: usize = 16;
/// Bare spawns per round and case.
const BARE: usize = 50;

struct Case {
    name: &'static str,
    lang: &'static str,
    code: &'static str,
}

const CASES: [Case; 3] = [
    Case {
        name: "python `print(1)`",
        lang: "python",
        code: "print(1)\n",
    },
    Case {
        name: "javascript `console.log(1)`",
        lang: "javascript",
        code: "console.log(1)\n",
    },
    Case {
        name: "shell `true`",
        lang: "shell",
        code: "true\n",
    },
];

/// Each round's executions per second and CPU ms per execution.
type Flight = Vec<(f64, Option<f64>)>;

/// One daemon's block: p50 and p90 (ms), CPU ms per execution, hits and misses.
#[derive(Default, Clone, Copy)]
struct Block {
    p50: f64,
    p90: f64,
    cpu: Option<f64>,
    hits: u64,
    misses: u64,
}

/// Both daemons' pools full, their removals done, and a moment of quiet.
fn settle(daemons: &[&Daemon]) {
    for d in daemons {
        d.wait_refilled();
        d.wait_removed();
    }
    std::thread::sleep(Duration::from_millis(200));
}

fn back_to_back(rt: &tokio::runtime::Runtime, d: &Daemon, case: &Case, tag: &str) -> Block {
    let (_, h0, m0) = d.pool();
    let cpu0 = d.cpu_used();
    let n = runs();
    let lat = rt.block_on(async {
        let mut ws = connect(d.port).await;
        let mut lat = Vec::with_capacity(n);
        for i in 0..n {
            let id = format!("sus-{tag}-{}-{i}", case.lang);
            lat.push(execute(&mut ws, &id, case.lang, case.code).await.0);
        }
        lat
    });
    let (_, h1, m1) = d.pool();
    // The removals of this block's containers are its CPU too.
    d.wait_removed();
    Block {
        p50: pct(&lat, 0.5),
        p90: pct(&lat, 0.9),
        cpu: d
            .cpu_used()
            .zip(cpu0)
            .map(|(b, a)| (b - a) as f64 / 1e6 / n as f64),
        hits: h1 - h0,
        misses: m1 - m0,
    }
}

fn bare(case: &Case, tmp: &Path) -> f64 {
    let samples: Vec<Duration> = (0..BARE)
        .map(|_| match case.lang {
            "python" => super::warm::bare_python(),
            "javascript" => super::warm::bare_node(),
            _ => super::bare("/bin/sh", "sh", case.code, tmp).0,
        })
        .collect();
    pct(&samples, 0.5)
}

/// Executions per second and CPU ms per execution of python `print(1)` with [`IN_FLIGHT`] in flight.
fn in_flight(rt: &tokio::runtime::Runtime, d: &Daemon, tag: &str) -> (f64, Option<f64>) {
    let n = runs();
    let cpu0 = d.cpu_used();
    let per_s = super::run_in_flight(
        rt,
        d.port,
        (IN_FLIGHT, n),
        ("python", "print(1)\n"),
        &format!("inf-{tag}"),
    );
    d.wait_removed();
    let cpu = d
        .cpu_used()
        .zip(cpu0)
        .map(|(b, a)| (b - a) as f64 / 1e6 / n as f64);
    (per_s, cpu)
}

/// The `sustained` mode: daemons with the default capacity (this binary's and the baseline's), [`tables`], then the
/// memory per ready container of both binaries. `wide` are the bench's daemons with 16 at once.
pub fn run(
    rt: &tokio::runtime::Runtime,
    wide: (&Daemon, Option<&Daemon>),
    baseline_bin: Option<&Path>,
    tmp: &Path,
) {
    const DEFAULT: &str = "capacity: {max_queue: 256}\n";
    let this = Daemon::start(7, DEFAULT);
    let base = baseline_bin.map(|bin| Daemon::start_binary(bin, 8, DEFAULT, ""));
    tables(rt, (&this, base.as_ref()), wide, tmp);
    let bin = Path::new(env!("CARGO_BIN_EXE_sandboxd"));
    let mut binaries = vec![(bin, 10, "this daemon")];
    binaries.extend(baseline_bin.map(|b| (b, 12, "baseline")));
    for (binary, n, who) in binaries {
        let label = |kind: &str| format!("{who}: waiting {kind} interpreter");
        super::warm::memory_row(binary, n, "python", &label("python"), "");
        super::warm::memory_row(binary, n + 1, "javascript", &label("node"), "");
    }
}

/// The median of `v` with two decimals, `-` when there is none (a daemon without a CPU meter).
fn median_cell(v: impl Iterator<Item = f64>) -> String {
    let v: Vec<f64> = v.collect();
    if v.is_empty() {
        "-".to_owned()
    } else {
        format!("{:.2}", median_ms(&v))
    }
}

/// Runs and prints both tables: back to back on `default` (this daemon and the baseline with the default
/// capacity), in flight on `wide` (16 at once); without a baseline daemon its lines are left out.
fn tables(
    rt: &tokio::runtime::Runtime,
    default: (&Daemon, Option<&Daemon>),
    wide: (&Daemon, Option<&Daemon>),
    tmp: &Path,
) {
    let mut daemons = vec![default.0, wide.0];
    daemons.extend(default.1);
    daemons.extend(wide.1);
    let (this, baseline) = default;
    let (runs, rounds) = (runs(), rounds());
    // Per case: this daemon's blocks, the baseline's, the bare spawn's p50 per round.
    let mut rows: Vec<(Vec<Block>, Vec<Block>, Vec<f64>)> = vec![Default::default(); CASES.len()];
    let mut flight: (Flight, Flight) = Default::default();
    for round in 0..rounds {
        let baseline_first = round % 2 == 1;
        for (case, row) in CASES.iter().zip(&mut rows) {
            for turn in 0..2 {
                settle(&daemons);
                if (turn == 0) != baseline_first {
                    row.0
                        .push(back_to_back(rt, this, case, &format!("w{round}")));
                } else if let Some(b) = baseline {
                    row.1.push(back_to_back(rt, b, case, &format!("b{round}")));
                }
            }
            settle(&daemons);
            row.2.push(bare(case, tmp));
        }
        for turn in 0..2 {
            settle(&daemons);
            if (turn == 0) != baseline_first {
                flight.0.push(in_flight(rt, wide.0, &format!("w{round}")));
            } else if let Some(b) = wide.1 {
                flight.1.push(in_flight(rt, b, &format!("b{round}")));
            }
        }
    }
    println!();
    println!(
        "sustained: {runs} executions back to back on one connection per block, each block from full pools, the \
         two daemons in turns ({rounds} rounds, the order alternating); p50 / p90 ms per round, then the median \
         of the rounds' p50; CPU: daemon, helpers and containers (removal included) per execution"
    );
    let fmt = |blocks: &[Block]| -> (String, f64, String, String) {
        let each = blocks
            .iter()
            .map(|b| format!("{:.2}/{:.2}", b.p50, b.p90))
            .collect::<Vec<_>>()
            .join(" ");
        let med = median_ms(&blocks.iter().map(|b| b.p50).collect::<Vec<_>>());
        let cpu = median_cell(blocks.iter().filter_map(|b| b.cpu));
        let hm = blocks
            .iter()
            .map(|b| format!("{}/{}", b.hits, b.misses))
            .collect::<Vec<_>>()
            .join(" ");
        (each, med, cpu, hm)
    };
    for (case, (this_b, base_b, bare_p50)) in CASES.iter().zip(&rows) {
        let bare = median_ms(bare_p50);
        let (each, med, cpu, hm) = fmt(this_b);
        println!("{}", case.name);
        println!("  this daemon: p50 {med:.2} ms ({each}), CPU {cpu} ms/exec, hits/misses {hm}");
        if !base_b.is_empty() {
            let (each, bmed, bcpu, bhm) = fmt(base_b);
            println!(
                "  baseline:    p50 {bmed:.2} ms ({each}), CPU {bcpu} ms/exec, hits/misses {bhm}; this/baseline p50 {:.2}",
                med / bmed
            );
        }
        println!(
            "  bare spawn:  p50 {bare:.2} ms; this daemon over it {:.2} ms",
            med - bare
        );
    }
    let fmt_flight = |v: &[(f64, Option<f64>)]| {
        let each = v
            .iter()
            .map(|(p, _)| format!("{p:.1}"))
            .collect::<Vec<_>>()
            .join(" ");
        let cpu = median_cell(v.iter().filter_map(|(_, c)| *c));
        (
            median_ms(&v.iter().map(|(p, _)| *p).collect::<Vec<_>>()),
            each,
            cpu,
        )
    };
    let (per_s, each, cpu) = fmt_flight(&flight.0);
    println!(
        "python `print(1)`, {IN_FLIGHT} in flight, {runs} executions per round: this daemon {per_s:.1} exec/s ({each}), CPU {cpu} ms/exec"
    );
    if !flight.1.is_empty() {
        let (bper_s, each, bcpu) = fmt_flight(&flight.1);
        println!(
            "  baseline {bper_s:.1} exec/s ({each}), CPU {bcpu} ms/exec; this/baseline {:.2}",
            per_s / bper_s
        );
    }
}

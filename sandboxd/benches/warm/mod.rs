//! The warm interpreter's rows of the latency bench: python `print(1)` against a bare `python3 -c 'print(1)'` and
//! the baseline daemon, sample by sample, without and with a tool listed (the tool SDK loads), and javascript
//! `console.log(1)` against a bare `node -e 'console.log(1)'`; the same back to
//! back (no gap between one daemon's executions, so its pool refills and removals run while the next execution
//! does); and the memory a ready pooled container holds.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use serde_json::json;

use super::{connect, execute, execute_with, pct, timed, Daemon, Ws};

const SAMPLES: usize = 100;
/// Executions per block of the back-to-back rows; blocks of each column alternate.
const BLOCK: usize = 10;
const BLOCKS: usize = 10;

/// One row: a name, its columns (this daemon, the baseline daemon, a bare spawn) and this daemon's pool hits and
/// misses during the row.
type Row = (String, [Vec<Duration>; 3], (u64, u64));

/// Hits and misses between two `Daemon::pool` readings.
fn hits_misses(before: (u64, u64, u64), after: (u64, u64, u64)) -> (u64, u64) {
    (after.1 - before.1, after.2 - before.2)
}

/// A bare interpreter spawn, with an environment as bare as a container's: the bench's own can hold variables that
/// change an interpreter's start-up (`NODE_EXTRA_CA_CERTS` makes node parse a CA bundle: 142 ms instead of 47 on
/// one of our machines).
fn bare_interpreter(program: &str, args: [&str; 2]) -> Duration {
    let mut cmd = Command::new(program);
    cmd.args(args).env_clear().env("PATH", "/usr/bin:/bin");
    timed(cmd).0
}

pub(super) fn bare_python() -> Duration {
    bare_interpreter("/usr/bin/python3", ["-c", "print(1)"])
}

pub(super) fn bare_node() -> Duration {
    bare_interpreter("/usr/bin/node", ["-e", "console.log(1)"])
}

/// A language's one-line program and its bare spawn.
struct Program {
    lang: &'static str,
    code: &'static str,
    bare: fn() -> Duration,
}

const PYTHON: Program = Program {
    lang: "python",
    code: "print(1)\n",
    bare: bare_python,
};
const NODE: Program = Program {
    lang: "javascript",
    code: "console.log(1)\n",
    bare: bare_node,
};

fn bare_shell(tmp: &Path) -> Duration {
    super::bare("/bin/sh", "sh", "true\n", tmp).0
}

/// `p` (with `extra`'s fields) on this daemon, on the baseline, and as a bare spawn, sample by sample, after 5
/// unrecorded rounds.
async fn interleaved(
    ws: &mut Ws,
    mut bs: Option<&mut Ws>,
    prefix: &str,
    p: &Program,
    extra: &serde_json::Value,
) -> [Vec<Duration>; 3] {
    let mut cols: [Vec<Duration>; 3] = Default::default();
    for i in 0..5 + SAMPLES {
        // The two daemons take turns at going first: each one's pool refills land in the other's samples as often
        // as the other way round (always this daemon first made the baseline pay for this one's refills).
        let (w_id, b_id) = (format!("{prefix}-w-{i}"), format!("{prefix}-b-{i}"));
        let baseline_first = i % 2 == 1;
        let mut b = None;
        if baseline_first {
            if let Some(bs) = &mut bs {
                b = Some(execute_with(bs, &b_id, p.lang, p.code, extra).await.0);
            }
        }
        let w = execute_with(ws, &w_id, p.lang, p.code, extra).await.0;
        if !baseline_first {
            if let Some(bs) = &mut bs {
                b = Some(execute_with(bs, &b_id, p.lang, p.code, extra).await.0);
            }
        }
        let bare = (p.bare)();
        if i >= 5 {
            cols[0].push(w);
            cols[1].extend(b);
            cols[2].push(bare);
        }
    }
    cols
}

/// Prints the table; `baseline` adds its column.
pub fn table(rt: &tokio::runtime::Runtime, warm: &Daemon, baseline: Option<&Daemon>, tmp: &Path) {
    warm.wait_refilled();
    if let Some(b) = baseline {
        b.wait_refilled();
    }
    let mut rows: Vec<Row> = Vec::new();
    rt.block_on(async {
        let mut ws = connect(warm.port).await;
        let mut bs = match baseline {
            Some(b) => Some(connect(b.port).await),
            None => None,
        };
        // Interleaved sample by sample: each daemon's pool refills while the others run. With a tool listed
        // (none called), the tool SDK and its runner load too; a baseline whose executions with tools get a plain
        // interpreter shows what the waiting one saves.
        for (name, prefix, program, extra) in [
            ("python `print(1)`", "py", &PYTHON, json!({})),
            (
                "python `print(1)` with a tool",
                "pyt",
                &PYTHON,
                json!({"tools": [{"name": "echo"}]}),
            ),
            ("javascript `console.log(1)`", "js", &NODE, json!({})),
        ] {
            let before = warm.pool();
            let cols = interleaved(&mut ws, bs.as_mut(), prefix, program, &extra).await;
            rows.push((name.into(), cols, hits_misses(before, warm.pool())));
        }
        for (name, lang, code) in [
            ("python `print(1)` back to back", "python", "print(1)\n"),
            ("shell `true` back to back", "shell", "true\n"),
        ] {
            let mut cols: [Vec<Duration>; 3] = Default::default();
            let before = warm.pool();
            // Each block starts with both pools full: a block pays for its own daemon's refills and removals
            // only (not for the other daemon's, which would otherwise run during it).
            let settle = || {
                warm.wait_refilled();
                if let Some(b) = baseline {
                    b.wait_refilled();
                }
                std::thread::sleep(Duration::from_millis(100));
            };
            for block in 0..BLOCKS {
                let baseline_first = block % 2 == 1;
                for turn in 0..2 {
                    settle();
                    if (turn == 0) != baseline_first {
                        for i in 0..BLOCK {
                            let id = format!("bb-w-{lang}-{block}-{i}");
                            cols[0].push(execute(&mut ws, &id, lang, code).await.0);
                        }
                    } else if let Some(bs) = &mut bs {
                        for i in 0..BLOCK {
                            let id = format!("bb-b-{lang}-{block}-{i}");
                            cols[1].push(execute(bs, &id, lang, code).await.0);
                        }
                    }
                }
                settle();
                for _ in 0..BLOCK {
                    cols[2].push(if lang == "python" {
                        bare_python()
                    } else {
                        bare_shell(tmp)
                    });
                }
            }
            rows.push((name.into(), cols, hits_misses(before, warm.pool())));
        }
    });
    println!();
    println!(
        "warm interpreters: execute→result, ms (p50 / p95); bare spawn: `python3 -c 'print(1)'`, \
         `node -e 'console.log(1)'` (both with only PATH set), `sh main.sh`; \
         back to back: blocks of {BLOCK} executions in a row per column, each from full pools, {BLOCKS} blocks \
         alternating (the daemons take turns at going first)"
    );
    println!(
        "{:<32} {:>15} {:>15} {:>15} | {:>10} {:>13} {:>13} {:>11}",
        "case",
        "this daemon",
        "baseline",
        "bare spawn",
        "this/bare",
        "baseline/bare",
        "this-bare ms",
        "hits/misses"
    );
    for (name, cols, (hits, misses)) in &rows {
        let cell = |c: &Vec<Duration>| {
            if c.is_empty() {
                format!("{:>15}", "-")
            } else {
                format!("{:>7.2} / {:>5.2}", pct(c, 0.5), pct(c, 0.95))
            }
        };
        let bare = pct(&cols[2], 0.5);
        let ratio = |c: &Vec<Duration>| {
            if c.is_empty() {
                "-".to_owned()
            } else {
                format!("{:.2}", pct(c, 0.5) / bare)
            }
        };
        println!(
            "{name:<32} {} {} {} | {:>10} {:>13} {:>13.2} {:>11}",
            cell(&cols[0]),
            cell(&cols[1]),
            cell(&cols[2]),
            ratio(&cols[0]),
            ratio(&cols[1]),
            pct(&cols[0], 0.5) - bare,
            format!("{hits}/{misses}")
        );
    }
}

/// Memory charged to the ready pooled containers of a python-only daemon (cgroup v1 `memory.usage_in_bytes` or
/// v2 `memory.current` of each container's leaf), per container; `None` when no leaf can be read.
pub fn memory_per_ready(d: &Daemon, parent: &str) -> Option<(f64, usize)> {
    d.wait_refilled();
    d.wait_removed();
    // The interpreter's start-up is done within a second; let the pool settle.
    std::thread::sleep(Duration::from_secs(2));
    let (dir, file) = [
        ("/sys/fs/cgroup/memory", "memory.usage_in_bytes"),
        ("/sys/fs/cgroup", "memory.current"),
    ]
    .into_iter()
    .map(|(root, file)| (Path::new(root).join(parent), file))
    .find(|(dir, _)| dir.is_dir())?;
    let mut total = 0u64;
    let mut n = 0usize;
    for e in std::fs::read_dir(&dir).ok()?.flatten() {
        if let Some(v) = std::fs::read_to_string(e.path().join(file))
            .ok()
            .and_then(|s| s.trim().parse::<u64>().ok())
        {
            total += v;
            n += 1;
        }
    }
    (n > 0).then(|| (total as f64 / n as f64 / (1 << 20) as f64, n))
}

/// Starts a daemon serving `lang` alone (`python` or `javascript`) on `binary` with 4 ready containers and reports
/// the memory per ready one.
pub fn memory_row(binary: &Path, n: u32, lang: &str, label: &str, extra: &str) {
    let command = match lang {
        "javascript" => "/usr/bin/node",
        _ => "/usr/bin/python3",
    };
    let d = Daemon::start_binary(
        binary,
        n,
        &format!(
            "languages: {{{lang}: {{image: host, command: [{command}]}}}}\npool: {{size: 4{extra}}}\n"
        ),
        "",
    );
    let parent = format!("sandboxd-bench-{}-{n}", std::process::id());
    match memory_per_ready(&d, &parent) {
        Some((mib, count)) => println!(
            "memory per ready pooled {lang} container, {label}: {mib:.2} MiB ({count} containers)"
        ),
        None => {
            println!("memory per ready pooled {lang} container, {label}: no memory cgroup to read")
        }
    }
}

/// `SANDBOXD_BENCH_DATA_IMAGE=DIR` (an OCI layout from `images/build.sh python-data`): a pandas program on that
/// image, with `preload: [numpy, pandas]` and without, sample by sample.
pub fn preload_table(rt: &tokio::runtime::Runtime, layout: &Path) {
    let code =
        "import pandas as pd\nprint(pd.DataFrame({'a': range(10)}).describe().loc['mean', 'a'])\n";
    let config = |preload: &str| {
        format!(
            "images: {{pydata: {{layout: {}{preload}}}}}\n\
             languages: {{python: {{image: pydata, command: [/usr/bin/python3]}}}}\npool: {{size: 4}}\n",
            layout.display()
        )
    };
    let this = Path::new(env!("CARGO_BIN_EXE_sandboxd"));
    let with = Daemon::start_binary(this, 7, &config(", preload: [numpy, pandas]"), "");
    let without = Daemon::start_binary(this, 8, &config(""), "");
    let mut cols: [Vec<Duration>; 2] = Default::default();
    rt.block_on(async {
        let mut ws = connect(with.port).await;
        let mut wo = connect(without.port).await;
        for i in 0..5 + SAMPLES / 2 {
            // Each column from a full pool: the interpreters (and their preloads) are ready.
            with.wait_refilled();
            without.wait_refilled();
            let a = execute(&mut ws, &format!("pd-w-{i}"), "python", code)
                .await
                .0;
            let b = execute(&mut wo, &format!("pd-o-{i}"), "python", code)
                .await
                .0;
            if i >= 5 {
                cols[0].push(a);
                cols[1].push(b);
            }
        }
    });
    println!();
    println!(
        "pandas `DataFrame(...).describe()` on the python-data image, warm pools, ms (p50 / p95), {} samples",
        cols[0].len()
    );
    println!(
        "preload [numpy, pandas]: {:.2} / {:.2}; no preload: {:.2} / {:.2}; ratio {:.2}",
        pct(&cols[0], 0.5),
        pct(&cols[0], 0.95),
        pct(&cols[1], 0.5),
        pct(&cols[1], 0.95),
        pct(&cols[0], 0.5) / pct(&cols[1], 0.5)
    );
    for (label, d, n) in [("preload", &with, 7), ("no preload", &without, 8)] {
        let parent = format!("sandboxd-bench-{}-{n}", std::process::id());
        if let Some((mib, count)) = memory_per_ready(d, &parent) {
            println!("memory per ready pooled container, python-data, {label}: {mib:.2} MiB ({count} containers)");
        }
    }
}

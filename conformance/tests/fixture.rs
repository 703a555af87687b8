//! The suite must be able to fail: it runs against the faulty fixture server with no fault (which must pass: no
//! FAIL, no HARNESS_ERROR, and only the SHOULD failures a server without isolation cannot avoid), then with each
//! fault on (which must make at least one case FAIL). Prints the fault matrix (fault → cases that caught it) and
//! writes it to `target/tmp/fault-matrix.md`.

#![allow(
    clippy::expect_used,
    reason = "a test: a broken fixture is a failed test"
)]

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write as _;
use std::sync::Arc;
use std::time::Instant;

use conformance::fixture::{self, Fault, FixtureConfig};
use conformance::{run_suite, RunConfig, RunReport, Verdict, Xfail};

/// SHOULD cases a server without any isolation fails honestly (which of them depends on the user running the test:
/// as root the programs hold capabilities).
const EXPECTED_NON_STRICT: &[&str] = &["R.limits.2", "I.caps.1", "I.caps.2", "I.nnp.1", "I.fs.4"];

/// Fault runs at the same time.
const PARALLEL: usize = 12;

async fn run(faults: BTreeSet<Fault>) -> RunReport {
    let config = FixtureConfig {
        faults: faults.clone(),
        ..FixtureConfig::default()
    };
    let token = config.token.clone();
    let fx = fixture::start(config, "127.0.0.1:0")
        .await
        .expect("start the fixture");
    let cfg = RunConfig {
        endpoint: fx.endpoint(),
        token,
        strict: false,
        timeout_scale: 1.0,
        network_allow: None,
    };
    let report = run_suite(cfg, None, &Xfail::default(), |_| {}).await;
    drop(fx);
    report.unwrap_or_else(|e| {
        panic!("the suite could not run against the fixture with {faults:?}: {e}")
    })
}

fn show(r: &RunReport) -> String {
    r.cases
        .iter()
        .filter(|c| !matches!(c.verdict, Verdict::Pass | Verdict::Skip | Verdict::Info))
        .map(|c| {
            format!(
                "  {} {} {}: {}",
                c.verdict,
                c.id,
                c.title,
                c.details.chars().take(300).collect::<String>()
            )
        })
        .collect::<Vec<_>>()
        .join("\n")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_suite_passes_the_fixture_and_catches_every_fault() {
    let mut out = std::io::stderr();

    // No fault: the fixture conforms.
    let started = Instant::now();
    let clean = run(BTreeSet::new()).await;
    let bad: Vec<_> = clean
        .cases
        .iter()
        .filter(|c| matches!(c.verdict, Verdict::Fail | Verdict::HarnessError))
        .collect();
    assert!(
        bad.is_empty(),
        "the suite fails the fixture without faults:\n{}",
        show(&clean)
    );
    let non_strict: BTreeSet<&str> = clean
        .cases
        .iter()
        .filter(|c| c.verdict == Verdict::NonStrict)
        .map(|c| c.id)
        .collect();
    for id in &non_strict {
        assert!(
            EXPECTED_NON_STRICT.contains(id),
            "unexpected NON_STRICT {id} without faults:\n{}",
            show(&clean)
        );
    }
    let _ = writeln!(
        out,
        "no fault: {:?} in {:.1} s; NON_STRICT {non_strict:?}",
        clean.summary,
        started.elapsed().as_secs_f64()
    );

    // Every fault, a few at a time.
    let gate = Arc::new(tokio::sync::Semaphore::new(PARALLEL));
    let mut tasks = Vec::new();
    for fault in Fault::ALL {
        let gate = gate.clone();
        tasks.push(tokio::spawn(async move {
            let _permit = gate.acquire_owned().await.expect("semaphore");
            let t = Instant::now();
            let r = run(BTreeSet::from([fault])).await;
            (fault, r, t.elapsed())
        }));
    }
    let mut matrix: BTreeMap<&'static str, (Vec<&'static str>, Vec<&'static str>)> =
        BTreeMap::new();
    let mut uncaught = Vec::new();
    for t in tasks {
        let (fault, r, took) = t.await.expect("fault run");
        let failed: Vec<&'static str> = r
            .cases
            .iter()
            .filter(|c| c.verdict == Verdict::Fail)
            .map(|c| c.id)
            .collect();
        let newly_non_strict: Vec<&'static str> = r
            .cases
            .iter()
            .filter(|c| c.verdict == Verdict::NonStrict && !non_strict.contains(c.id))
            .map(|c| c.id)
            .collect();
        let _ = writeln!(
            out,
            "fault {fault}: {} FAIL in {:.1} s\n{}",
            failed.len(),
            took.as_secs_f64(),
            show(&r)
        );
        if failed.is_empty() {
            uncaught.push(fault);
        }
        matrix.insert(fault.name(), (failed, newly_non_strict));
    }

    let mut md = String::from("| fault | caught by (FAIL) | also NON_STRICT |\n|---|---|---|\n");
    for (fault, (failed, ns)) in &matrix {
        md.push_str(&format!(
            "| {fault} | {} | {} |\n",
            failed.join(", "),
            ns.join(", ")
        ));
    }
    let _ = writeln!(out, "\nFault matrix ({} faults):\n{md}", matrix.len());
    let path = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("fault-matrix.md");
    let _ = std::fs::write(&path, &md);
    assert!(
        uncaught.is_empty(),
        "faults no case caught: {uncaught:?}\n{md}"
    );
    assert!(Fault::ALL.len() >= 12);
}

//! A conformance suite for the Fathom Sandbox Protocol v1 (FSP/1, sandboxd profile): it connects to any FSP/1
//! endpoint and tells, case by case, whether the implementation does what `docs/spec/fsp-v1.md` requires.
//!
//! - [`framework`]: cases with stable ids and RFC 2119 levels, verdicts (PASS, NON_STRICT, FAIL, SKIP, INFO,
//!   HARNESS_ERROR), selection by glob, expected failures, and the runner.
//! - [`cases`]: every case: `P.<section>.<n>` protocol, `I.<area>.<n>` isolation posture, `R.<area>.<n>` resources
//!   and lifecycle.
//! - [`wire`]: the suite's own reading of server messages and of the spec's tables (independent of the protocol
//!   crate's lenient parser); [`client`]: a WebSocket client for the cases; [`msgs`]: client messages as JSON (the
//!   hand-written builders the daemon's tests use too, from `sandboxd-test-support`).
//! - [`probe`]: the programs isolation cases run inside the sandbox.
//! - [`report`]: human summary, JSON and JUnit reports.
//! - [`ctx`]: what a run shares (configuration, connections, memoised [`observed`] scenarios); [`stop`]: why a
//!   case stopped without passing.
//! - [`fixture`]: a deliberately faulty FSP/1 server, with switchable [`fault`]s, that shows the suite can fail.

pub mod cases;
pub mod client;
pub mod ctx;
pub mod fault;
pub mod fixture;
pub mod fixture_agents;
mod fixture_tools;
pub mod framework;
/// Client messages as hand-written JSON, so that cases can also send malformed ones.
pub use test_support::fsp as msgs;
pub mod observed;
pub mod probe;
pub mod report;
pub mod stop;
pub mod wire;

use std::sync::Arc;
use std::time::Instant;

pub use ctx::{Ctx, RunConfig};
pub use framework::{CaseReport, Level, Verdict, Xfail};
pub use report::RunReport;

/// Runs the selected cases (comma-separated globs; `None`: all) against `cfg.endpoint`. `progress` is called
/// after each case. Fails only when the suite cannot start (bad selection, the endpoint unreachable).
pub async fn run_suite(
    cfg: RunConfig,
    selection: Option<&str>,
    xfail: &Xfail,
    progress: impl FnMut(&CaseReport),
) -> Result<RunReport, String> {
    let all = cases::all();
    let selected = framework::select(&all, selection);
    if selected.is_empty() {
        return Err(format!("no case matches {:?}", selection.unwrap_or("")));
    }
    let started = protocol::now_ts();
    let clock = Instant::now();
    let ctx = Arc::new(Ctx::new(cfg.clone()).await?);
    let reports = framework::run_cases(ctx.clone(), &selected, xfail, progress).await;
    Ok(RunReport::new(
        &cfg.endpoint,
        started,
        clock.elapsed().as_millis() as u64,
        cfg.strict,
        cfg.timeout_scale,
        ctx.server.pong.clone(),
        reports,
    ))
}

/// One line of progress for a finished case, e.g. `PASS        P.1.1   MUST   A missing token ... (12 ms)`.
pub fn progress_line(r: &CaseReport) -> String {
    let mut line = format!(
        "{:<13} {:<12} {:<6} {} ({} ms)",
        r.verdict.as_str(),
        r.id,
        r.level.as_str(),
        r.title,
        r.duration_ms
    );
    if !r.details.is_empty() && r.verdict != Verdict::Pass {
        let d: String = r.details.chars().take(240).collect();
        line.push_str(&format!("\n{:<13} {d}", ""));
    }
    line
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use super::*;

    #[test]
    fn case_ids_are_unique_well_formed_and_enough() {
        let all = cases::all();
        let mut seen = HashSet::new();
        for c in &all {
            assert!(seen.insert(c.id), "duplicate id {}", c.id);
            let parts: Vec<&str> = c.id.split('.').collect();
            assert_eq!(parts.len(), 3, "{}", c.id);
            assert!(
                matches!(parts[0], "P" | "I" | "R" | "E" | "A" | "V" | "S"),
                "{}",
                c.id
            );
            assert!(parts[2].parse::<u32>().is_ok(), "{}", c.id);
            assert!(!c.requirement.is_empty() && !c.title.is_empty(), "{}", c.id);
        }
        assert!(all.len() >= 60, "{} cases", all.len());
        // Numbers within a group are consecutive from 1 (ids are never renumbered, so gaps would be retired ids).
        let mut groups: std::collections::BTreeMap<&str, Vec<u32>> = Default::default();
        for c in &all {
            let (g, n) = c.id.rsplit_once('.').unwrap();
            groups.entry(g).or_default().push(n.parse().unwrap());
        }
        for (g, ns) in groups {
            let want: Vec<u32> = (1..=ns.len() as u32).collect();
            assert_eq!(ns, want, "group {g}");
        }
    }
}

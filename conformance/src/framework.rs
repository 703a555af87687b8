//! The test framework: cases with stable ids and compliance levels, their outcomes, verdicts, selection and the
//! runner (shaped like youki's contest framework: a case either passes, fails, or says why it could not run).

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::ctx::Ctx;
pub use crate::stop::Stop;

/// How strongly the spec asks for what a case checks (RFC 2119), or `Info` for a case that only reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "UPPERCASE")]
pub enum Level {
    /// An absolute requirement: a failure makes the run fail.
    Must,
    /// A recommendation: a failure is `NON_STRICT`, or `FAIL` with `--strict`.
    Should,
    /// An option: a failure is reported as `INFO`.
    May,
    /// Not a requirement: the case reports what it observed.
    Info,
}

impl Level {
    /// The upper-case name, e.g. `MUST`.
    pub const fn as_str(self) -> &'static str {
        match self {
            Level::Must => "MUST",
            Level::Should => "SHOULD",
            Level::May => "MAY",
            Level::Info => "INFO",
        }
    }
}

impl fmt::Display for Level {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The verdict on one case.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum Verdict {
    /// The implementation does what the case checks.
    Pass,
    /// A SHOULD (or MAY) requirement failed and `--strict` was not given.
    NonStrict,
    /// A requirement failed.
    Fail,
    /// The case could not apply (a capability not announced, a language missing, ...); the reason says why.
    Skip,
    /// An informational case: the details are the observation.
    Info,
    /// The suite itself could not carry out the case (could not connect, a case panicked, ...).
    HarnessError,
}

impl Verdict {
    /// Every verdict, in report order.
    pub const ALL: [Verdict; 6] = [
        Verdict::Pass,
        Verdict::NonStrict,
        Verdict::Fail,
        Verdict::Skip,
        Verdict::Info,
        Verdict::HarnessError,
    ];

    /// The report spelling, e.g. `NON_STRICT`.
    pub const fn as_str(self) -> &'static str {
        match self {
            Verdict::Pass => "PASS",
            Verdict::NonStrict => "NON_STRICT",
            Verdict::Fail => "FAIL",
            Verdict::Skip => "SKIP",
            Verdict::Info => "INFO",
            Verdict::HarnessError => "HARNESS_ERROR",
        }
    }
}

impl fmt::Display for Verdict {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What a case returns: `Ok(note)` when it passed (or, for an `INFO` case, what it observed).
pub type CaseResult = Result<String, Stop>;

/// A boxed case future.
pub type CaseFuture = Pin<Box<dyn Future<Output = CaseResult> + Send + 'static>>;

/// The body of a case.
pub type CaseFn = fn(Arc<Ctx>) -> CaseFuture;

/// One conformance case.
#[derive(Clone)]
pub struct Case {
    /// Stable id, never renumbered: `P.<section>.<n>`, `I.<area>.<n>` or `R.<area>.<n>`.
    pub id: &'static str,
    /// Compliance level.
    pub level: Level,
    /// Spec section, e.g. `3 (cancel)`.
    pub section: &'static str,
    /// A short title.
    pub title: &'static str,
    /// The requirement the case checks, quoted from the spec where possible.
    pub requirement: &'static str,
    /// The body.
    pub run: CaseFn,
}

impl fmt::Debug for Case {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Case")
            .field("id", &self.id)
            .field("level", &self.level)
            .field("section", &self.section)
            .field("title", &self.title)
            .finish()
    }
}

/// Returns early from a case with [`Stop::Fail`].
#[macro_export]
macro_rules! fail {
    ($($arg:tt)*) => { return Err($crate::framework::Stop::Fail(format!($($arg)*))) };
}

/// Returns early from a case with [`Stop::Skip`].
#[macro_export]
macro_rules! skip {
    ($($arg:tt)*) => { return Err($crate::framework::Stop::Skip(format!($($arg)*))) };
}

/// Fails the case with the message unless the condition holds.
#[macro_export]
macro_rules! check {
    ($cond:expr, $($arg:tt)*) => {
        if !$cond {
            return Err($crate::framework::Stop::Fail(format!($($arg)*)));
        }
    };
}

/// Turns a `Result<T, String>` from a checker into a case failure.
pub fn checked<T>(r: Result<T, String>) -> Result<T, Stop> {
    r.map_err(Stop::Fail)
}

/// Whether `id` matches the glob `pattern` (`*` any run of characters, `?` one character).
pub fn glob_match(pattern: &str, id: &str) -> bool {
    fn go(p: &[u8], s: &[u8]) -> bool {
        match (p.first(), s.first()) {
            (None, None) => true,
            (Some(b'*'), _) => go(&p[1..], s) || (!s.is_empty() && go(p, &s[1..])),
            (Some(b'?'), Some(_)) => go(&p[1..], &s[1..]),
            (Some(a), Some(b)) if a == b => go(&p[1..], &s[1..]),
            _ => false,
        }
    }
    go(pattern.as_bytes(), id.as_bytes())
}

/// Selects cases by comma-separated globs (`None`: every case). A bare prefix such as `P.3` also selects `P.3.*`.
pub fn select<'a>(cases: &'a [Case], patterns: Option<&str>) -> Vec<&'a Case> {
    let Some(patterns) = patterns else {
        return cases.iter().collect();
    };
    let pats: Vec<&str> = patterns
        .split(',')
        .map(str::trim)
        .filter(|p| !p.is_empty())
        .collect();
    cases
        .iter()
        .filter(|c| {
            pats.iter().any(|p| {
                glob_match(p, c.id)
                    || (!p.contains(['*', '?']) && c.id.starts_with(&format!("{p}.")))
            })
        })
        .collect()
}

/// Cases expected to fail, from an `--xfail` file: one case id (or glob) per line, optionally followed by a
/// reason; `#` starts a comment.
#[derive(Debug, Clone, Default)]
pub struct Xfail {
    entries: Vec<(String, String)>,
}

impl Xfail {
    /// Parses the file's text.
    pub fn parse(text: &str) -> Result<Xfail, String> {
        let mut entries = Vec::new();
        for (n, line) in text.lines().enumerate() {
            let line = line.split('#').next().unwrap_or("").trim();
            if line.is_empty() {
                continue;
            }
            let (id, reason) = match line.split_once(char::is_whitespace) {
                Some((id, reason)) => (id, reason.trim()),
                None => (line, ""),
            };
            let valid = id
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '*' | '?' | '_' | '-'));
            if !valid {
                return Err(format!("line {}: {id:?} is not a case id or glob", n + 1));
            }
            entries.push((id.to_owned(), reason.to_owned()));
        }
        Ok(Xfail { entries })
    }

    /// The reason `id` is expected to fail, if it is.
    pub fn reason(&self, id: &str) -> Option<&str> {
        self.entries
            .iter()
            .find(|(p, _)| glob_match(p, id))
            .map(|(_, r)| r.as_str())
    }
}

/// The result of one case.
#[derive(Debug, Clone, Serialize)]
pub struct CaseReport {
    /// Case id.
    pub id: &'static str,
    /// Level.
    pub level: Level,
    /// Spec section.
    pub section: &'static str,
    /// Title.
    pub title: &'static str,
    /// The requirement checked.
    pub requirement: &'static str,
    /// Verdict.
    pub verdict: Verdict,
    /// Why (failure, skip reason, observation, note); empty when there is nothing to say.
    pub details: String,
    /// Wall-clock time of the case.
    pub duration_ms: u64,
    /// Set when the case was listed in the `--xfail` file (its reason); an expected failure does not fail the run.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub xfail: Option<String>,
}

impl CaseReport {
    /// Whether this result makes the run fail (a `FAIL` not listed as expected).
    pub fn fails_run(&self) -> bool {
        self.verdict == Verdict::Fail && self.xfail.is_none()
    }
}

/// The verdict for a case of `level` that ended with `outcome`.
pub fn verdict(level: Level, outcome: &CaseResult, strict: bool) -> Verdict {
    match outcome {
        Ok(_) if level == Level::Info => Verdict::Info,
        Ok(_) => Verdict::Pass,
        Err(Stop::Skip(_)) => Verdict::Skip,
        Err(Stop::Harness(_)) => Verdict::HarnessError,
        Err(Stop::Fail(_)) => match level {
            Level::Must => Verdict::Fail,
            Level::Should if strict => Verdict::Fail,
            Level::Should => Verdict::NonStrict,
            Level::May | Level::Info => Verdict::Info,
        },
    }
}

/// The longest a single case may take before the runner gives up on it (scaled by `--timeout-scale`).
const CASE_BUDGET: Duration = Duration::from_secs(180);

/// Runs `cases` one after another against the context's endpoint. `progress` is called after each case.
pub async fn run_cases(
    ctx: Arc<Ctx>,
    cases: &[&Case],
    xfail: &Xfail,
    mut progress: impl FnMut(&CaseReport),
) -> Vec<CaseReport> {
    let mut out = Vec::with_capacity(cases.len());
    for case in cases {
        let started = Instant::now();
        let fut = (case.run)(ctx.clone());
        let budget = ctx.scaled(CASE_BUDGET);
        let handle = tokio::spawn(async move { tokio::time::timeout(budget, fut).await });
        let outcome: CaseResult = match handle.await {
            Ok(Ok(r)) => r,
            Ok(Err(_)) => Err(Stop::Harness(format!(
                "the case did not finish within {budget:?}"
            ))),
            Err(e) if e.is_panic() => Err(Stop::Harness(format!("the case panicked: {e}"))),
            Err(e) => Err(Stop::Harness(format!("the case was aborted: {e}"))),
        };
        let v = verdict(case.level, &outcome, ctx.cfg.strict);
        let details = match &outcome {
            Ok(note) => note.clone(),
            Err(stop) => stop.message().to_owned(),
        };
        let report = CaseReport {
            id: case.id,
            level: case.level,
            section: case.section,
            title: case.title,
            requirement: case.requirement,
            verdict: v,
            details,
            duration_ms: started.elapsed().as_millis() as u64,
            xfail: xfail.reason(case.id).map(str::to_owned),
        };
        progress(&report);
        out.push(report);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn globs() {
        assert!(glob_match("P.3.*", "P.3.12"));
        assert!(!glob_match("P.3.*", "P.31.1"));
        assert!(glob_match("*", "R.cleanup.1"));
        assert!(glob_match("P.?.1", "P.4.1"));
        assert!(!glob_match("P.4.1", "P.4.10"));
    }

    #[test]
    fn levels_map_failures_to_verdicts() {
        let fail: CaseResult = Err(Stop::Fail("x".into()));
        assert_eq!(verdict(Level::Must, &fail, false), Verdict::Fail);
        assert_eq!(verdict(Level::Should, &fail, false), Verdict::NonStrict);
        assert_eq!(verdict(Level::Should, &fail, true), Verdict::Fail);
        assert_eq!(verdict(Level::May, &fail, true), Verdict::Info);
        assert_eq!(
            verdict(Level::Info, &Ok(String::new()), false),
            Verdict::Info
        );
        assert_eq!(
            verdict(Level::Must, &Ok(String::new()), false),
            Verdict::Pass
        );
        let skip: CaseResult = Err(Stop::Skip("no".into()));
        assert_eq!(verdict(Level::Must, &skip, true), Verdict::Skip);
    }

    #[test]
    fn xfail_file() {
        let x = Xfail::parse("# comment\nP.3.4  clamps on purpose\n\nI.caps.*\n").unwrap();
        assert_eq!(x.reason("P.3.4"), Some("clamps on purpose"));
        assert_eq!(x.reason("I.caps.1"), Some(""));
        assert_eq!(x.reason("P.3.5"), None);
        assert!(Xfail::parse("P.1.1; rm -rf").is_err() || Xfail::parse("P.1.1;").is_err());
    }
}

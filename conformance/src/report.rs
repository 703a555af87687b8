//! Reports: the human summary, the JSON report (Autobahn-like) and JUnit XML (h2spec-like).

use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde::Serialize;
use serde_json::Value;

use crate::framework::{CaseReport, Level, Verdict};

/// A whole run.
#[derive(Debug, Clone, Serialize)]
pub struct RunReport {
    /// `fsp-conformance`.
    pub tool: &'static str,
    /// The suite's version.
    pub version: &'static str,
    /// The endpoint tested.
    pub endpoint: String,
    /// When the run started (UTC, ISO 8601).
    pub started: String,
    /// Wall-clock time of the run.
    pub duration_ms: u64,
    /// Whether SHOULD failures counted as failures.
    pub strict: bool,
    /// `--timeout-scale`.
    pub timeout_scale: f64,
    /// The server's first pong (what it announced).
    pub server: Value,
    /// Counts per verdict.
    pub summary: BTreeMap<&'static str, usize>,
    /// Counts per level and verdict.
    pub by_level: BTreeMap<&'static str, BTreeMap<&'static str, usize>>,
    /// Every case.
    pub cases: Vec<CaseReport>,
}

impl RunReport {
    /// Builds the report and its counts.
    pub fn new(
        endpoint: &str,
        started: String,
        duration_ms: u64,
        strict: bool,
        timeout_scale: f64,
        server: Value,
        cases: Vec<CaseReport>,
    ) -> RunReport {
        let mut summary = BTreeMap::new();
        let mut by_level: BTreeMap<&'static str, BTreeMap<&'static str, usize>> = BTreeMap::new();
        for v in Verdict::ALL {
            summary.insert(v.as_str(), 0);
        }
        for c in &cases {
            *summary.entry(c.verdict.as_str()).or_default() += 1;
            *by_level
                .entry(c.level.as_str())
                .or_default()
                .entry(c.verdict.as_str())
                .or_default() += 1;
        }
        RunReport {
            tool: "fsp-conformance",
            version: env!("CARGO_PKG_VERSION"),
            endpoint: endpoint.to_owned(),
            started,
            duration_ms,
            strict,
            timeout_scale,
            server,
            summary,
            by_level,
            cases,
        }
    }

    /// Cases that make the run fail (FAIL not listed as expected).
    pub fn failures(&self) -> Vec<&CaseReport> {
        self.cases.iter().filter(|c| c.fails_run()).collect()
    }

    /// Cases the suite could not carry out.
    pub fn harness_errors(&self) -> Vec<&CaseReport> {
        self.cases
            .iter()
            .filter(|c| c.verdict == Verdict::HarnessError)
            .collect()
    }

    /// The JSON report.
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).unwrap_or_else(|e| format!("{{\"error\": \"{e}\"}}"))
    }

    /// The human summary: failures and non-strict results with their reasons, then the counts.
    pub fn human(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(s, "\nFSP/1 conformance of {}", self.endpoint);
        for (title, pick) in [
            ("Failures", Verdict::Fail),
            (
                "SHOULD requirements not met (NON_STRICT)",
                Verdict::NonStrict,
            ),
            ("Harness errors", Verdict::HarnessError),
        ] {
            let list: Vec<&CaseReport> = self.cases.iter().filter(|c| c.verdict == pick).collect();
            if list.is_empty() {
                continue;
            }
            let _ = writeln!(s, "\n{title}:");
            for c in list {
                let x = c
                    .xfail
                    .as_ref()
                    .map_or(String::new(), |r| format!(" [expected failure: {r}]"));
                let _ = writeln!(s, "  {} {} [{}] {}{x}", c.id, c.level, c.section, c.title);
                let _ = writeln!(s, "      requirement: {}", c.requirement);
                let _ = writeln!(s, "      {}", c.details);
            }
        }
        let internal = self
            .cases
            .iter()
            .filter(|c| c.verdict == Verdict::Fail && c.details.contains("INTERNAL_ERROR"))
            .count();
        if internal > 0 {
            let _ = writeln!(
                s,
                "\nNote: {internal} failing case(s) saw INTERNAL_ERROR: the server could not run some programs at all. \
                 Look at that first; many other failures may follow from it."
            );
        }
        let xpass: Vec<&str> = self
            .cases
            .iter()
            .filter(|c| c.xfail.is_some() && c.verdict == Verdict::Pass)
            .map(|c| c.id)
            .collect();
        if !xpass.is_empty() {
            let _ = writeln!(s, "\nListed as expected failures but passed (remove them from the xfail file): {xpass:?}");
        }
        let _ = writeln!(s, "\nBy level:");
        for level in [Level::Must, Level::Should, Level::May, Level::Info] {
            if let Some(counts) = self.by_level.get(level.as_str()) {
                let total: usize = counts.values().sum();
                let parts: Vec<String> = Verdict::ALL
                    .iter()
                    .filter_map(|v| counts.get(v.as_str()).map(|n| format!("{n} {v}")))
                    .collect();
                let _ = writeln!(
                    s,
                    "  {:<6} {total:>3} cases: {}",
                    level.as_str(),
                    parts.join(", ")
                );
            }
        }
        let parts: Vec<String> = Verdict::ALL
            .iter()
            .map(|v| {
                format!(
                    "{} {}",
                    self.summary.get(v.as_str()).copied().unwrap_or(0),
                    v
                )
            })
            .collect();
        let _ = writeln!(
            s,
            "\n{} cases in {:.1} s: {}",
            self.cases.len(),
            self.duration_ms as f64 / 1000.0,
            parts.join(", ")
        );
        let verdict = if !self.failures().is_empty() {
            "NOT CONFORMING"
        } else if !self.harness_errors().is_empty() {
            "INCOMPLETE (harness errors)"
        } else {
            "CONFORMING (no MUST failed)"
        };
        let _ = writeln!(s, "{verdict}{}", if self.strict { " [strict]" } else { "" });
        s
    }

    /// JUnit XML: one test suite per case group (`P.1`, `R.cleanup`, ...). FAIL is a failure, HARNESS_ERROR an
    /// error, SKIP skipped; NON_STRICT and INFO pass with their details in `system-out`.
    pub fn to_junit(&self) -> String {
        let mut groups: BTreeMap<String, Vec<&CaseReport>> = BTreeMap::new();
        for c in &self.cases {
            let group = c.id.rsplit_once('.').map_or(c.id, |(g, _)| g).to_owned();
            groups.entry(group).or_default().push(c);
        }
        let mut x = String::from("<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n");
        let count = |v: Verdict| {
            self.cases
                .iter()
                .filter(|c| c.verdict == v && !(v == Verdict::Fail && c.xfail.is_some()))
                .count()
        };
        let _ = writeln!(
            x,
            "<testsuites name=\"fsp-conformance\" tests=\"{}\" failures=\"{}\" errors=\"{}\" skipped=\"{}\" time=\"{:.3}\">",
            self.cases.len(),
            count(Verdict::Fail),
            count(Verdict::HarnessError),
            count(Verdict::Skip),
            self.duration_ms as f64 / 1000.0
        );
        for (group, cases) in &groups {
            let failures = cases.iter().filter(|c| c.fails_run()).count();
            let errors = cases
                .iter()
                .filter(|c| c.verdict == Verdict::HarnessError)
                .count();
            let skipped = cases.iter().filter(|c| c.verdict == Verdict::Skip).count();
            let time: u64 = cases.iter().map(|c| c.duration_ms).sum();
            let _ = writeln!(
                x,
                "  <testsuite name=\"{}\" tests=\"{}\" failures=\"{failures}\" errors=\"{errors}\" skipped=\"{skipped}\" time=\"{:.3}\">",
                esc(group),
                cases.len(),
                time as f64 / 1000.0
            );
            for c in cases {
                let _ = write!(
                    x,
                    "    <testcase classname=\"{}\" name=\"{}\" time=\"{:.3}\">",
                    esc(group),
                    esc(&format!("{} [{}] {}", c.id, c.level, c.title)),
                    c.duration_ms as f64 / 1000.0
                );
                let details = esc(&c.details);
                match c.verdict {
                    Verdict::Fail if c.xfail.is_none() => {
                        let _ = write!(
                            x,
                            "<failure message=\"{}\" type=\"{}\">{}</failure>",
                            esc(&first_line(&c.details)),
                            c.level,
                            details
                        );
                    }
                    Verdict::HarnessError => {
                        let _ = write!(
                            x,
                            "<error message=\"{}\" type=\"HARNESS_ERROR\">{details}</error>",
                            esc(&first_line(&c.details))
                        );
                    }
                    Verdict::Skip => {
                        let _ =
                            write!(x, "<skipped message=\"{}\"/>", esc(&first_line(&c.details)));
                    }
                    _ => {}
                }
                let _ = write!(
                    x,
                    "<system-out>{}: {}\nrequirement (spec section {}): {}{}</system-out>",
                    c.verdict,
                    details,
                    esc(c.section),
                    esc(c.requirement),
                    c.xfail
                        .as_ref()
                        .map_or(String::new(), |r| format!("\nexpected failure: {}", esc(r)))
                );
                x.push_str("</testcase>\n");
            }
            x.push_str("  </testsuite>\n");
        }
        x.push_str("</testsuites>\n");
        x
    }
}

fn first_line(s: &str) -> String {
    s.lines().next().unwrap_or("").chars().take(300).collect()
}

/// Escapes text for XML (and drops characters XML 1.0 cannot carry).
pub fn esc(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for ch in s.chars() {
        match ch {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&apos;"),
            '\t' | '\n' | '\r' => out.push(ch),
            c if (c as u32) < 0x20 || c == '\u{fffe}' || c == '\u{ffff}' => out.push('\u{fffd}'),
            c => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn case(id: &'static str, level: Level, verdict: Verdict) -> CaseReport {
        CaseReport {
            id,
            level,
            section: "1",
            title: "t <&>",
            requirement: "r",
            verdict,
            details: "why \"x\" \u{1}".into(),
            duration_ms: 5,
            xfail: None,
        }
    }

    #[test]
    fn junit_and_counts() {
        let r = RunReport::new(
            "ws://x/ws",
            "2026-01-01T00:00:00.000Z".into(),
            10,
            false,
            1.0,
            Value::Null,
            vec![
                case("P.1.1", Level::Must, Verdict::Pass),
                case("P.1.2", Level::Must, Verdict::Fail),
                case("R.cleanup.1", Level::Should, Verdict::NonStrict),
                case("I.ns.1", Level::Must, Verdict::Skip),
            ],
        );
        assert_eq!(r.failures().len(), 1);
        let x = r.to_junit();
        assert!(
            x.contains("<testsuite name=\"P.1\" tests=\"2\" failures=\"1\""),
            "{x}"
        );
        assert!(x.contains("<testsuite name=\"R.cleanup\""), "{x}");
        assert!(x.contains("<skipped"), "{x}");
        assert!(!x.contains('\u{1}'));
        assert!(x.contains("t &lt;&amp;&gt;"));
        assert!(r.human().contains("NOT CONFORMING"));
        let j: Value = serde_json::from_str(&r.to_json()).unwrap();
        assert_eq!(j["summary"]["FAIL"], 1);
        assert_eq!(j["cases"][1]["verdict"], "FAIL");
    }
}

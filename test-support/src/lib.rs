//! What the workspace's tests (and the conformance suite) share, so each rule lives once:
//!
//! - [`cannot_run`] and [`require_root`]: every test that cannot run here says why on stderr, with its name, and
//!   when `CI` is set (`.ci/run` exports `CI=1`; CI runs as root) panics instead, so a privileged test never passes
//!   on CI by skipping. [`not_applicable`] is the one exception: a test that does not apply to this platform at
//!   all (another architecture) says so, and is not a failure on CI either.
//! - [`daemon`]: the pieces of the sandboxd and client harnesses that run real daemons (config, launch on a free
//!   port, wait until serving, stop, logs), and [`daemon::wait_until`].
//! - [`cgroups`]: the clean-up of a test daemon's cgroup parent.
//! - [`procs`]: the host's processes, for the checks that nothing is left behind.
//! - `dns` (feature `dns`): a nameserver answering A records from a table the test changes.
//! - [`fsp`]: FSP/1 client messages as hand-written JSON, for tests and the conformance cases that also send
//!   malformed ones.
//!
//! A dev-dependency of the daemon's and the client's tests, and a dependency of `fsp-conformance` (a test tool
//! itself, which uses [`fsp`]). Its dependencies are ones every user already has (nix, serde_json, tokio and the
//! protocol crate); nothing here belongs in the daemon or the client library.

#![forbid(unsafe_code)]

pub mod cgroups;
pub mod daemon;
#[cfg(feature = "dns")]
pub mod dns;
pub mod fsp;
pub mod procs;

use std::io::Write as _;

/// Whether the tests run on CI, where every privileged test must run (`CI` set and not empty).
pub fn on_ci() -> bool {
    std::env::var_os("CI").is_some_and(|v| !v.is_empty())
}

/// Whether this process runs as root (effective uid 0).
pub fn is_root() -> bool {
    nix::unistd::geteuid().is_root()
}

/// A test (or a part of one) that cannot run here, for `reason`: a loud skip on a developer's machine, a panic on
/// CI. The caller returns right after.
pub fn cannot_run(test: &str, reason: &str) {
    if on_ci() {
        panic!("{test} cannot run ({reason}), and CI (CI is set) must run every test");
    }
    say_skipped(test, reason);
}

/// For a test that needs root, `why` saying what for: true when root; otherwise [`cannot_run`] (a panic on CI)
/// and false.
pub fn require_root(test: &str, why: &str) -> bool {
    if is_root() {
        return true;
    }
    let reason = if why.is_empty() {
        "needs root".to_owned()
    } else {
        format!("needs root: {why}")
    };
    cannot_run(test, &reason);
    false
}

/// A test that does not apply to this platform (e.g. machine code of another architecture): said loudly, and not
/// a failure on CI either, since no machine could run it there.
pub fn not_applicable(test: &str, reason: &str) {
    say_skipped(test, reason);
}

fn say_skipped(test: &str, reason: &str) {
    // Straight to fd 2: the libtest harness captures `eprintln!` of passing tests, and a skip must be seen.
    let _ = writeln!(std::io::stderr(), "SKIPPED ({reason}): {test}");
}

/// The venv of the pinned E2B SDKs that `tests/e2b/setup.sh` made (`SANDBOXD_TEST_E2B_VENV`), or `None` after saying
/// why `test` cannot run.
pub fn e2b_venv(test: &str) -> Option<std::path::PathBuf> {
    let venv = e2b_setup_path(test, "SANDBOXD_TEST_E2B_VENV")?;
    assert!(
        venv.join("bin/python").exists(),
        "SANDBOXD_TEST_E2B_VENV {}: no bin/python (tests/e2b/setup.sh makes it)",
        venv.display()
    );
    Some(venv)
}

/// The path in `var`, one of the variables `tests/e2b/setup.sh` prints (the E2B SDKs' venv, their node modules), or
/// `None` after saying why `test` cannot run.
pub fn e2b_setup_path(test: &str, var: &str) -> Option<std::path::PathBuf> {
    let path = std::env::var_os(var).filter(|v| !v.is_empty());
    if path.is_none() {
        cannot_run(
            test,
            &format!(
                "{var} is not set; run tests/e2b/setup.sh and take the variables it prints \
                 (e2b_env=$(tests/e2b/setup.sh) && eval \"$e2b_env\" && export SANDBOXD_TEST_E2B_VENV \
                 SANDBOXD_TEST_E2B_NODE)"
            ),
        );
    }
    path.map(std::path::PathBuf::from)
}

#[cfg(test)]
mod tests {
    use super::*;

    // One test for every case: `CI` is process-wide, and tests of a crate run in parallel threads.
    #[test]
    fn cannot_run_skips_off_ci_and_panics_on_ci() {
        std::env::remove_var("CI");
        cannot_run("off_ci", "returns");
        std::env::set_var("CI", "");
        assert!(!on_ci(), "an empty CI is not CI");
        cannot_run("empty_ci", "returns");
        std::env::set_var("CI", "1");
        assert!(on_ci());
        let panicked = std::panic::catch_unwind(|| cannot_run("on_ci", "must panic")).is_err();
        not_applicable("on_ci", "never panics");
        if is_root() {
            assert!(require_root("on_ci", "root goes on, CI or not"));
        }
        std::env::remove_var("CI");
        assert!(panicked, "cannot_run must panic when CI is set");
    }
}

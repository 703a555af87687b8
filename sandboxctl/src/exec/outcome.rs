//! How an execution ended: our exit code, the one-line reason on stderr, the egress proxy's counters.

use std::process::ExitCode;

use client::{ExecStatus, NetworkUsage, Reason};

use crate::exit::Exit;
use crate::output::say;

/// One line of the egress proxy's counters (`result.network`).
pub(super) fn network_summary(n: &NetworkUsage) -> String {
    format!(
        "network: {} connections ({} upstream), {} refused, {} bytes sent, {} bytes received",
        n.connections, n.upstream_connections, n.refused, n.bytes_sent, n.bytes_received
    )
}

/// The exit code for a finished execution, with a one-line reason on stderr when it is not the program's own.
pub(super) async fn outcome(result: &protocol::ResultMessage, timeout_ms: u64) -> ExitCode {
    let status = ExecStatus::terminal(result.reason, result.exit_code);
    match result.reason {
        Reason::Exited => ExitCode::from((result.exit_code.unwrap_or(0) & 0xff) as u8),
        Reason::Signaled => {
            let name = result.signal.as_deref().unwrap_or("an unknown signal");
            say(format!("the program was killed by {name}")).await;
            let n = result.signal.as_deref().map(signal_number).unwrap_or(0);
            ExitCode::from(128u8.saturating_add(n))
        }
        Reason::Timeout => {
            say(format!(
                "timeout: the program ran longer than {timeout_ms} ms (status {})",
                status.as_str()
            ))
            .await;
            Exit::Timeout.into()
        }
        Reason::Oom => {
            say(format!(
                "out of memory: killed by the memory limit (peak {} MiB)",
                result.resource_usage.peak_memory_mb
            ))
            .await;
            Exit::Oom.into()
        }
        Reason::OutputLimit => {
            say(format!(
                "output limit: killed after {} bytes of output",
                result.stdout_bytes + result.stderr_bytes
            ))
            .await;
            Exit::OutputLimit.into()
        }
        Reason::Cancelled => {
            say("cancelled".to_owned()).await;
            Exit::Interrupted.into()
        }
    }
}

/// The Linux number of a signal name like `SIGKILL` (0 if unknown).
fn signal_number(name: &str) -> u8 {
    const NAMES: [&str; 31] = [
        "SIGHUP",
        "SIGINT",
        "SIGQUIT",
        "SIGILL",
        "SIGTRAP",
        "SIGABRT",
        "SIGBUS",
        "SIGFPE",
        "SIGKILL",
        "SIGUSR1",
        "SIGSEGV",
        "SIGUSR2",
        "SIGPIPE",
        "SIGALRM",
        "SIGTERM",
        "SIGSTKFLT",
        "SIGCHLD",
        "SIGCONT",
        "SIGSTOP",
        "SIGTSTP",
        "SIGTTIN",
        "SIGTTOU",
        "SIGURG",
        "SIGXCPU",
        "SIGXFSZ",
        "SIGVTALRM",
        "SIGPROF",
        "SIGWINCH",
        "SIGIO",
        "SIGPWR",
        "SIGSYS",
    ];
    NAMES
        .iter()
        .position(|n| *n == name)
        .map(|i| i as u8 + 1)
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signal_numbers() {
        assert_eq!(signal_number("SIGKILL"), 9);
        assert_eq!(signal_number("SIGSEGV"), 11);
        assert_eq!(signal_number("SIGSYS"), 31);
        assert_eq!(signal_number("SIGNOPE"), 0);
    }

    #[test]
    fn network_counters_fit_one_line() {
        let line = network_summary(&NetworkUsage {
            connections: 4,
            upstream_connections: 3,
            refused: 1,
            bytes_sent: 900,
            bytes_received: 12_000,
        });
        assert_eq!(
            line,
            "network: 4 connections (3 upstream), 1 refused, 900 bytes sent, 12000 bytes received"
        );
    }
}

//! Why an execution ended: a pure function of what the daemon did (a kill and its reason), what the init reported
//! about the program, and the cgroup's OOM-kill counter.

use protocol::{ExecStatus, Reason};
use runtime::init::ProgramExit;

/// Why the daemon killed an execution (the first reason wins).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KillReason {
    /// Over `timeout_ms`.
    Timeout,
    /// Over `max_output_bytes`.
    OutputLimit,
    /// Cancelled by the client, the client went away, or the daemon shut down.
    Cancelled,
}

/// The classification of a finished execution.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Outcome {
    /// The result's `reason`.
    pub reason: Reason,
    /// Exit code or signal.
    pub exit: ProgramExit,
    /// The terminal `status`.
    pub status: ExecStatus,
}

/// An end no kill and no OOM kill explains: the init died without reporting the program.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the container's init ended without reporting the program")]
pub struct Unexplained;

/// Classifies an execution's end. `program` is `None` when the init died without reporting, which only `SIGKILL`
/// (ours, or the OOM killer's) can cause; with no kill of ours and no OOM kill that is unexplained: `Err`.
pub fn classify(
    kill: Option<KillReason>,
    program: Option<ProgramExit>,
    oom_kills: u64,
) -> Result<Outcome, Unexplained> {
    let killed_by_kernel = matches!(program, Some(ProgramExit::Signal(9)) | None);
    let reason = match kill {
        Some(KillReason::Timeout) => Reason::Timeout,
        Some(KillReason::OutputLimit) => Reason::OutputLimit,
        Some(KillReason::Cancelled) => Reason::Cancelled,
        None if oom_kills > 0 && killed_by_kernel => Reason::Oom,
        None => match program {
            Some(ProgramExit::Code(_)) => Reason::Exited,
            Some(ProgramExit::Signal(_)) => Reason::Signaled,
            None => return Err(Unexplained),
        },
    };
    let exit = match (reason, program) {
        (Reason::Exited, Some(ProgramExit::Code(c))) => ProgramExit::Code(c),
        (_, Some(ProgramExit::Signal(s))) => ProgramExit::Signal(s),
        (_, Some(ProgramExit::Code(c))) if kill.is_none() => ProgramExit::Code(c),
        _ => ProgramExit::Signal(9),
    };
    let status = match (reason, exit) {
        (Reason::Exited, ProgramExit::Code(0)) => ExecStatus::Completed,
        (Reason::Exited | Reason::Signaled | Reason::OutputLimit, _) => ExecStatus::Failed,
        (Reason::Timeout, _) => ExecStatus::Timeout,
        (Reason::Oom, _) => ExecStatus::Oom,
        (Reason::Cancelled, _) => ExecStatus::Cancelled,
    };
    Ok(Outcome {
        reason,
        exit,
        status,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ok(kill: Option<KillReason>, program: Option<ProgramExit>, oom: u64) -> Outcome {
        classify(kill, program, oom).unwrap()
    }

    #[test]
    fn exits_and_signals_of_the_program_itself() {
        let o = ok(None, Some(ProgramExit::Code(0)), 0);
        assert_eq!(
            (o.reason, o.exit, o.status),
            (Reason::Exited, ProgramExit::Code(0), ExecStatus::Completed)
        );
        let o = ok(None, Some(ProgramExit::Code(3)), 0);
        assert_eq!(
            (o.reason, o.exit, o.status),
            (Reason::Exited, ProgramExit::Code(3), ExecStatus::Failed)
        );
        let o = ok(None, Some(ProgramExit::Signal(11)), 0);
        assert_eq!(
            (o.reason, o.exit, o.status),
            (
                Reason::Signaled,
                ProgramExit::Signal(11),
                ExecStatus::Failed
            )
        );
        // A SIGKILL with no OOM kill counted is the program's own doing (kill -9 $$).
        let o = ok(None, Some(ProgramExit::Signal(9)), 0);
        assert_eq!(o.reason, Reason::Signaled);
    }

    #[test]
    fn oom_needs_a_kernel_kill_and_the_counter() {
        for program in [Some(ProgramExit::Signal(9)), None] {
            let o = ok(None, program, 1);
            assert_eq!(
                (o.reason, o.exit, o.status),
                (Reason::Oom, ProgramExit::Signal(9), ExecStatus::Oom)
            );
        }
        // A child was OOM-killed but the program exited by itself: its own exit code stands.
        let o = ok(None, Some(ProgramExit::Code(1)), 1);
        assert_eq!((o.reason, o.exit), (Reason::Exited, ProgramExit::Code(1)));
    }

    #[test]
    fn our_kills_win_over_what_the_program_reports() {
        for (kill, reason, status) in [
            (KillReason::Timeout, Reason::Timeout, ExecStatus::Timeout),
            (
                KillReason::OutputLimit,
                Reason::OutputLimit,
                ExecStatus::Failed,
            ),
            (
                KillReason::Cancelled,
                Reason::Cancelled,
                ExecStatus::Cancelled,
            ),
        ] {
            for program in [
                None,
                Some(ProgramExit::Signal(9)),
                Some(ProgramExit::Code(0)),
            ] {
                let o = ok(Some(kill), program, 1);
                assert_eq!(
                    (o.reason, o.status),
                    (reason, status),
                    "{kill:?} {program:?}"
                );
                assert_eq!(o.exit, ProgramExit::Signal(9), "{kill:?} {program:?}");
            }
        }
        // The program died of another signal before our kill landed: that signal is reported.
        let o = ok(Some(KillReason::Timeout), Some(ProgramExit::Signal(15)), 0);
        assert_eq!(
            (o.reason, o.exit),
            (Reason::Timeout, ProgramExit::Signal(15))
        );
    }

    #[test]
    fn a_silent_init_without_any_kill_is_unexplained() {
        assert_eq!(classify(None, None, 0), Err(Unexplained));
    }
}

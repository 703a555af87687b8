//! The faults of the [`crate::fixture`] server: each breaks one requirement of FSP/1 on purpose, so a run of the
//! suite against the fixture with that fault shows the suite catches it. A module of its own so that the fixture
//! and its agent-sandbox routes ([`crate::fixture_agents`]) both depend on it, and not on each other.

use std::fmt;
use std::str::FromStr;

/// Declares [`Fault`] from one table (variant, its doc, its command-line name), with [`Fault::ALL`] in table order
/// and [`Fault::name`].
macro_rules! faults {
    ($($(#[doc = $doc:literal])+ $variant:ident = $name:literal,)+) => {
        /// One way the fixture breaks FSP/1 on purpose.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub enum Fault {
            $($(#[doc = $doc])+ $variant,)+
        }

        impl Fault {
            /// Every fault.
            pub const ALL: [Fault; [$($name),+].len()] = [$(Fault::$variant),+];

            /// The command-line name, e.g. `no-ack`.
            pub const fn name(self) -> &'static str {
                match self {
                    $(Fault::$variant => $name,)+
                }
            }
        }
    };
}

faults! {
    /// Never sends `ack`.
    NoAck = "no-ack",
    /// Sends `result` before the terminal `status`.
    ResultBeforeStatus = "result-before-status",
    /// After a timeout, sends the terminal status but no `result`.
    NoResultAfterTimeout = "no-result-after-timeout",
    /// Answers a cancel of an unknown id with `INVALID_REQUEST` instead of `UNKNOWN_EXECUTION`.
    WrongErrorCode = "wrong-error-code",
    /// Lowers limits above the maximum to the maximum instead of refusing them.
    ClampsLimits = "clamps-limits",
    /// Ignores `cancel`.
    IgnoresCancel = "ignores-cancel",
    /// Sends all output, beyond `max_output_bytes`.
    OutputBeyondLimit = "output-beyond-limit",
    /// Holds `pong` back while output flows on the connection.
    NoPongDuringFlood = "no-pong-during-flood",
    /// Accepts any bearer token.
    AcceptsBadToken = "accepts-bad-token",
    /// Runs every execution in one shared working directory, never cleaned.
    SharedWorkdir = "shared-workdir",
    /// Leaves the programs of a closed connection running.
    LeavesProcessAfterDisconnect = "leaves-process-after-disconnect",
    /// Sends each read of output as it comes, splitting UTF-8 sequences across chunks.
    SplitsUtf8 = "splits-utf8",
    /// Sends `SANDBOX_OVERLOADED` with `retryable: false`.
    OverloadNotRetryable = "overload-not-retryable",
    /// Leaves `id` out of every `error`.
    ErrorWithoutId = "error-without-id",
    /// Ignores unknown fields of `execute` instead of refusing them.
    IgnoresUnknownFields = "ignores-unknown-fields",
    /// Sends `SANDBOX_OVERLOADED` only after 3 s.
    SlowOverload = "slow-overload",
    /// Reports `pong.load` as always 0.
    LoadLies = "load-lies",
    /// Reports exit code 128+N instead of null for a program killed by signal N.
    ExitCodeOnSignal = "exit-code-on-signal",
    /// Accepts any `X-Protocol-Version`.
    IgnoresVersionHeader = "ignores-version-header",
    /// Forwards calls of tools the request did not list (extension `tool_calls`) instead of refusing them.
    ForwardsUnlistedTools = "forwards-unlisted-tools",
    /// Agent sandboxes: skips `sourceSequence` 3.
    AgentSequenceGap = "agent-sequence-gap",
    /// Agent sandboxes: `POST /resolve` of an unknown decision succeeds.
    AgentResolveUnknownOk = "agent-resolve-unknown-ok",
    /// Agent sandboxes: `POST /replay` answers the range one later.
    AgentReplayOffByOne = "agent-replay-off-by-one",
    /// Agent sandboxes: refusals are plain text, not `PluginError` JSON.
    AgentPlainTextErrors = "agent-plain-text-errors",
}

impl fmt::Display for Fault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Fault {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Fault::ALL
            .into_iter()
            .find(|f| f.name() == s)
            .ok_or_else(|| {
                format!(
                    "unknown fault {s:?}; known: {}",
                    Fault::ALL.map(Fault::name).join(", ")
                )
            })
    }
}

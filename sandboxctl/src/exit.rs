//! The exit codes of `sandboxctl` besides the program's own, and the one for each client error.

use std::process::ExitCode;

use client::ClientError;

use crate::output::say;

/// The exit codes of `sandboxctl` besides the program's own (0-255 as the program exited, 128 + N when a signal N
/// killed it). A program may exit with any of these numbers itself; the one-line reason on stderr tells them
/// apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum Exit {
    /// Success.
    Ok0 = 0,
    /// A local problem: a file that cannot be read, a bad `--env` or `--file-in`, a bad URL, Kubernetes
    /// discovery refused or without a token.
    Local = 1,
    /// The sandbox refused the request (`INVALID_REQUEST`, `LANGUAGE_NOT_SUPPORTED`, ...): do not retry as is.
    Refused = 65,
    /// The sandbox is unavailable (cannot connect, connection lost, `SANDBOX_OVERLOADED`, `INTERNAL_ERROR`, no
    /// pong, unhealthy): retrying later may work.
    Unavailable = 69,
    /// The sandbox sent a malformed message or broke the protocol.
    Protocol = 76,
    /// The token was refused (HTTP 401).
    Unauthorized = 77,
    /// The program ran over `timeout_ms` (or the client deadline passed).
    Timeout = 124,
    /// The program was killed by the memory limit.
    Oom = 125,
    /// The program wrote more than `max_output_bytes`.
    OutputLimit = 126,
    /// Interrupted (Ctrl-C): the execution was cancelled (128 + SIGINT, as shells do).
    Interrupted = 130,
}

impl From<Exit> for ExitCode {
    fn from(e: Exit) -> Self {
        ExitCode::from(e as u8)
    }
}

/// Reports a client error on stderr and picks the exit code.
pub(crate) async fn fail(e: &ClientError) -> ExitCode {
    let code = match e {
        ClientError::Timeout { .. } => Exit::Timeout,
        ClientError::Unauthorized => Exit::Unauthorized,
        ClientError::Malformed { .. } | ClientError::Protocol { .. } => Exit::Protocol,
        ClientError::Config(_) => Exit::Local,
        ClientError::Kubernetes(k) if !k.is_retryable() => Exit::Local,
        e if e.is_retryable() => Exit::Unavailable,
        _ => Exit::Refused,
    };
    let hint = if e.is_retryable() { " (retryable)" } else { "" };
    say(format!("{e}{hint}")).await;
    code.into()
}

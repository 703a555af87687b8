//! FSP error codes, their retryability (spec section 4), and the error a refused request produces.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::envelope::SUPPORTED_VERSIONS;

/// The `code` of an FSP `error` message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum ErrorCode {
    /// Malformed or refused request (spec sections 2 and 3).
    InvalidRequest,
    /// The language is not available in this sandbox.
    LanguageNotSupported,
    /// `cancel` for an id that is not in flight on this connection.
    UnknownExecution,
    /// Reserved: sandboxd reports a timeout as terminal status and `result.reason`.
    Timeout,
    /// Reserved: sandboxd reports OOM as terminal status and `result.reason`.
    Oom,
    /// Reserved: sandboxd reports the output limit as terminal status and `result.reason`.
    OutputLimit,
    /// No execution slot and the wait queue is full.
    SandboxOverloaded,
    /// The sandbox failed (could not create the container, lost the process, ...).
    InternalError,
    /// Reserved: sandbox network issue.
    NetworkError,
}

impl ErrorCode {
    /// Every code, in the order of the spec's table.
    pub const ALL: [ErrorCode; 9] = [
        ErrorCode::InvalidRequest,
        ErrorCode::LanguageNotSupported,
        ErrorCode::UnknownExecution,
        ErrorCode::Timeout,
        ErrorCode::Oom,
        ErrorCode::OutputLimit,
        ErrorCode::SandboxOverloaded,
        ErrorCode::InternalError,
        ErrorCode::NetworkError,
    ];

    /// Whether a client may retry the same request later (the spec's `retryable` column).
    pub const fn retryable(self) -> bool {
        match self {
            ErrorCode::InvalidRequest
            | ErrorCode::LanguageNotSupported
            | ErrorCode::UnknownExecution
            | ErrorCode::Timeout
            | ErrorCode::Oom
            | ErrorCode::OutputLimit => false,
            ErrorCode::SandboxOverloaded | ErrorCode::InternalError | ErrorCode::NetworkError => {
                true
            }
        }
    }

    /// The wire spelling, e.g. `INVALID_REQUEST`.
    pub const fn as_str(self) -> &'static str {
        match self {
            ErrorCode::InvalidRequest => "INVALID_REQUEST",
            ErrorCode::LanguageNotSupported => "LANGUAGE_NOT_SUPPORTED",
            ErrorCode::UnknownExecution => "UNKNOWN_EXECUTION",
            ErrorCode::Timeout => "TIMEOUT",
            ErrorCode::Oom => "OOM",
            ErrorCode::OutputLimit => "OUTPUT_LIMIT",
            ErrorCode::SandboxOverloaded => "SANDBOX_OVERLOADED",
            ErrorCode::InternalError => "INTERNAL_ERROR",
            ErrorCode::NetworkError => "NETWORK_ERROR",
        }
    }
}

impl fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A refused client message: everything an FSP `error` needs except `retryable`, which follows from `code`.
///
/// Turn it into a wire message with [`ErrorMessage::from`](crate::server::ErrorMessage).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct RequestError {
    /// The request's id when it carried a usable one; echoed in the `error`.
    pub id: Option<String>,
    /// The wire error code.
    pub code: ErrorCode,
    /// Human-readable reason; names the offending field when there is one.
    pub message: String,
    /// Set when the request's `v` is not spoken by this server.
    pub supported_versions: Option<Vec<u64>>,
}

impl RequestError {
    /// An error with the given code.
    pub fn new(id: Option<String>, code: ErrorCode, message: impl Into<String>) -> Self {
        RequestError {
            id,
            code,
            message: message.into(),
            supported_versions: None,
        }
    }

    /// An `INVALID_REQUEST` error.
    pub fn invalid(id: Option<String>, message: impl Into<String>) -> Self {
        Self::new(id, ErrorCode::InvalidRequest, message)
    }

    /// An `INVALID_REQUEST` error about `v`, listing [`SUPPORTED_VERSIONS`].
    pub fn unsupported_version(id: Option<String>, message: impl Into<String>) -> Self {
        RequestError {
            supported_versions: Some(SUPPORTED_VERSIONS.to_vec()),
            ..Self::invalid(id, message)
        }
    }

    /// The `INVALID_REQUEST` error for a binary WebSocket frame (spec section 1).
    pub fn binary_frame() -> Self {
        Self::invalid(
            None,
            "Binary frames are not accepted; send one JSON object per text frame",
        )
    }

    /// The `LANGUAGE_NOT_SUPPORTED` error for `language` (a name the client sent, known or not).
    pub fn language_not_supported(id: &str, language: &str) -> Self {
        Self::new(
            Some(id.to_owned()),
            ErrorCode::LanguageNotSupported,
            format!("Language {language:?} is not available in this sandbox"),
        )
    }

    /// The `INVALID_REQUEST` error for an `execute` whose id is already in flight (spec section 3).
    pub fn duplicate_execution(id: &str) -> Self {
        Self::invalid(
            Some(id.to_owned()),
            format!("Duplicate id {id:?}: an execution with this id is still in flight"),
        )
    }

    /// The `UNKNOWN_EXECUTION` error for a `cancel` whose id is not in flight (spec section 3).
    pub fn unknown_execution(id: &str) -> Self {
        Self::new(
            Some(id.to_owned()),
            ErrorCode::UnknownExecution,
            format!("No execution with id {id:?} is in flight on this connection"),
        )
    }

    /// Whether the client may retry (follows from [`code`](Self::code)).
    pub const fn retryable(&self) -> bool {
        self.code.retryable()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_round_trip_and_retryability_matches_the_spec_table() {
        let retryable = [
            ErrorCode::SandboxOverloaded,
            ErrorCode::InternalError,
            ErrorCode::NetworkError,
        ];
        for code in ErrorCode::ALL {
            let json = serde_json::to_string(&code).unwrap();
            assert_eq!(json, format!("\"{}\"", code.as_str()));
            assert_eq!(serde_json::from_str::<ErrorCode>(&json).unwrap(), code);
            assert_eq!(code.to_string(), code.as_str());
            assert_eq!(code.retryable(), retryable.contains(&code), "{code}");
        }
    }

    #[test]
    fn helpers() {
        let err = RequestError::unsupported_version(Some("a".into()), "Unsupported v 2");
        assert_eq!(err.supported_versions, Some(vec![1]));
        assert_eq!(err.to_string(), "Unsupported v 2");
        assert!(!err.retryable());
        let err = RequestError::duplicate_execution("exec_1");
        assert_eq!(err.code, ErrorCode::InvalidRequest);
        assert!(err.message.contains("Duplicate"));
        assert_eq!(
            RequestError::unknown_execution("x").code,
            ErrorCode::UnknownExecution
        );
        assert_eq!(RequestError::binary_frame().id, None);
        let err = RequestError::language_not_supported("x", "rust");
        assert_eq!(err.code, ErrorCode::LanguageNotSupported);
        assert!(err.message.contains("\"rust\""));
    }
}

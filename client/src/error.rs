//! [`ClientError`]: every way a call can fail, with the FSP code it maps to and whether retrying can help.
//!
//! The original design's error table (`docs/spec/fsp-v1.md`, Appendix A) is covered one-to-one, and [`ErrorKind`]
//! mirrors its `ToolError` types:
//!
//! | scenario | variant | [`ErrorKind`] | retryable |
//! |---|---|---|---|
//! | disconnect mid-execution | [`ClientError::Disconnected`] | `Sandbox` | yes |
//! | cannot (re)connect | [`ClientError::Connect`], [`ClientError::Unresponsive`] | `Sandbox` | yes |
//! | malformed response | [`ClientError::Malformed`], [`ClientError::Protocol`] | `Sandbox` | no |
//! | execution timeout (client deadline) | [`ClientError::Timeout`] | `Timeout` | no |
//! | server-reported error | [`ClientError::Server`] | `Execution` | per code: `SANDBOX_OVERLOADED`, `INTERNAL_ERROR`, `NETWORK_ERROR` yes, others no |
//! | pool exhausted | [`ClientError::PoolExhausted`] | `Sandbox` | yes |
//! | fleet: the node of an acknowledged execution lost | [`ClientError::NodeLost`] | `Sandbox` | yes |
//! | fleet: no node could take the execution | [`ClientError::NoNode`] | `Sandbox` | yes |
//! | fleet: Kubernetes discovery failed | [`ClientError::Kubernetes`] | `Sandbox` | when the API was not reached |
//! | request refused before sending | [`ClientError::InvalidRequest`] | `Validation` | no |

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use protocol::{ErrorCode, RequestError};
use tokio_tungstenite::tungstenite;

/// A boxed error from a [`TokenProvider`](crate::TokenProvider).
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// The original design's `ToolError` types: what an agent loop tells the model about a failure.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorKind {
    /// The sandbox could not be reached or misbehaved (disconnect, malformed response, pool exhausted).
    Sandbox,
    /// The execution took longer than the client's deadline.
    Timeout,
    /// The sandbox explicitly refused or failed the execution (an FSP `error`).
    Execution,
    /// The request was refused before it was sent (bad id, path, environment variable, configuration).
    Validation,
}

/// Why a client call failed. Cheap to clone (sources are shared), so one failure can be reported to every
/// execution it affects.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum ClientError {
    /// The connection closed or broke while the call was in flight, or the connection is reconnecting.
    #[error("Connection to the sandbox lost: {reason}")]
    Disconnected {
        /// What happened, e.g. `connection reset` or `reconnecting (attempt 3)`.
        reason: String,
    },
    /// The TCP, TLS or WebSocket connection could not be opened.
    #[error("Cannot connect to {url}")]
    Connect {
        /// The endpoint.
        url: String,
        /// What failed.
        #[source]
        source: Arc<tungstenite::Error>,
    },
    /// Connecting took longer than the connect timeout.
    #[error("Connecting to {url} took longer than {after:?}")]
    ConnectTimeout {
        /// The endpoint.
        url: String,
        /// The connect timeout.
        after: Duration,
    },
    /// The server refused the token at the upgrade (HTTP 401).
    #[error("The sandbox refused the token (HTTP 401)")]
    Unauthorized,
    /// The server refused the upgrade with another HTTP status (e.g. 400 for an unsupported protocol version).
    #[error("The sandbox refused the WebSocket upgrade with HTTP {status}: {body}")]
    Handshake {
        /// The HTTP status.
        status: u16,
        /// The start of the response body.
        body: String,
    },
    /// The token provider failed.
    #[error("The token provider failed")]
    Token {
        /// The provider's error.
        #[source]
        source: Arc<dyn std::error::Error + Send + Sync + 'static>,
    },
    /// A `ping` was not answered in time (the pool's health check; the connection is replaced).
    #[error("The sandbox did not answer a ping within {after:?}")]
    Unresponsive {
        /// The health-check timeout.
        after: Duration,
    },
    /// The server sent a frame that is not a valid FSP/1 message. Logged with the frame; not retryable (it points
    /// at a bug, and sending the same request again would most likely hit it again).
    #[error("Malformed message from the sandbox: {reason}")]
    Malformed {
        /// What is wrong with it.
        reason: String,
    },
    /// The server sent valid messages in an order or amount FSP/1 forbids (e.g. output beyond `max_output_bytes`,
    /// the stream ending without a `result`).
    #[error("The sandbox broke the protocol: {reason}")]
    Protocol {
        /// What it did.
        reason: String,
    },
    /// The client-side deadline passed; a `cancel` was sent.
    #[error("Execution {id} timed out after {after:?} (client deadline); cancelled")]
    Timeout {
        /// The execution id.
        id: String,
        /// The deadline.
        after: Duration,
    },
    /// The server answered the execution with an FSP `error`.
    #[error("The sandbox refused execution {id}: {code}: {message}", id = id.as_deref().unwrap_or("-"))]
    Server {
        /// The execution id the error echoes, if any.
        id: Option<String>,
        /// The FSP error code.
        code: ErrorCode,
        /// The server's message.
        message: String,
    },
    /// No pooled connection became free within the checkout timeout.
    #[error("Connection pool exhausted: no connection free within {waited:?}")]
    PoolExhausted {
        /// How long the checkout waited.
        waited: Duration,
    },
    /// The request was refused before it was sent (the checks the server would apply).
    #[error("Invalid request: {0}")]
    InvalidRequest(#[source] RequestError),
    /// An execution with this id is already in flight on the connection.
    #[error("An execution with id {id:?} is already in flight on this connection")]
    DuplicateId {
        /// The id.
        id: String,
    },
    /// The client is misconfigured (bad URL, bad TLS setup, size 0 pool).
    #[error("Invalid client configuration: {0}")]
    Config(String),
    /// An HTTP request (`GET /healthz`) failed.
    #[error("GET {url} failed: {reason}")]
    Http {
        /// The URL.
        url: String,
        /// What failed.
        reason: String,
    },
    /// The pool or connection was closed by its owner.
    #[error("The connection or pool was closed by its owner")]
    Closed,
    /// A [`Fleet`](crate::Fleet) lost the node of an execution the node had acknowledged (its connection broke,
    /// or it failed its health checks): the execution may or may not have run there, so the fleet does not send
    /// it again by itself. Retryable: the caller decides whether running it twice is acceptable.
    #[error("Node {node} was lost after it acknowledged execution {id}: {reason}")]
    NodeLost {
        /// The node's endpoint.
        node: String,
        /// The execution id.
        id: String,
        /// What happened.
        reason: String,
    },
    /// A [`Fleet`](crate::Fleet) found no node to take the execution: none is admitted, or every node tried
    /// refused it before acknowledging it (overloaded, unreachable).
    #[error("No node of the fleet took the execution after {tried} attempt(s): {last}")]
    NoNode {
        /// Nodes tried.
        tried: usize,
        /// The last refusal, or why no node was tried.
        last: String,
    },
    /// Kubernetes discovery could not list a [`Fleet`](crate::Fleet)'s nodes (refused, no token, not in a pod);
    /// the message names the fix.
    #[error(transparent)]
    Kubernetes(#[from] KubernetesError),
}

impl ClientError {
    /// Whether the same request may succeed if sent again later (the original design's `retryable` column; for
    /// server errors, the spec's table).
    pub fn is_retryable(&self) -> bool {
        match self {
            ClientError::Disconnected { .. }
            | ClientError::Connect { .. }
            | ClientError::ConnectTimeout { .. }
            | ClientError::Token { .. }
            | ClientError::Unresponsive { .. }
            | ClientError::Http { .. }
            | ClientError::PoolExhausted { .. }
            | ClientError::NodeLost { .. }
            | ClientError::NoNode { .. } => true,
            ClientError::Server { code, .. } => code.retryable(),
            ClientError::Kubernetes(e) => e.is_retryable(),
            ClientError::Unauthorized
            | ClientError::Handshake { .. }
            | ClientError::Malformed { .. }
            | ClientError::Protocol { .. }
            | ClientError::Timeout { .. }
            | ClientError::InvalidRequest(_)
            | ClientError::DuplicateId { .. }
            | ClientError::Config(_)
            | ClientError::Closed => false,
        }
    }

    /// The FSP error code this failure corresponds to: the server's code for [`ClientError::Server`], `TIMEOUT`
    /// for the client deadline, `NETWORK_ERROR` for a lost or failed connection, `SANDBOX_OVERLOADED` for an
    /// exhausted pool, `INVALID_REQUEST` for a request refused locally. `None` for failures FSP has no code for
    /// (malformed server messages, configuration, authentication).
    pub fn code(&self) -> Option<ErrorCode> {
        match self {
            ClientError::Server { code, .. } => Some(*code),
            ClientError::Timeout { .. } => Some(ErrorCode::Timeout),
            ClientError::Disconnected { .. }
            | ClientError::Connect { .. }
            | ClientError::ConnectTimeout { .. }
            | ClientError::Http { .. }
            | ClientError::Unresponsive { .. }
            | ClientError::NodeLost { .. } => Some(ErrorCode::NetworkError),
            ClientError::PoolExhausted { .. } | ClientError::NoNode { .. } => {
                Some(ErrorCode::SandboxOverloaded)
            }
            ClientError::InvalidRequest(_) | ClientError::DuplicateId { .. } => {
                Some(ErrorCode::InvalidRequest)
            }
            ClientError::Unauthorized
            | ClientError::Handshake { .. }
            | ClientError::Token { .. }
            | ClientError::Kubernetes(_)
            | ClientError::Malformed { .. }
            | ClientError::Protocol { .. }
            | ClientError::Config(_)
            | ClientError::Closed => None,
        }
    }

    /// The original design's `ToolError` type for this failure.
    pub fn kind(&self) -> ErrorKind {
        match self {
            ClientError::Timeout { .. } => ErrorKind::Timeout,
            ClientError::Server { .. } => ErrorKind::Execution,
            ClientError::InvalidRequest(_)
            | ClientError::DuplicateId { .. }
            | ClientError::Config(_) => ErrorKind::Validation,
            _ => ErrorKind::Sandbox,
        }
    }

    pub(crate) fn disconnected(reason: impl Into<String>) -> Self {
        ClientError::Disconnected {
            reason: reason.into(),
        }
    }
}

impl From<protocol::ErrorMessage> for ClientError {
    fn from(e: protocol::ErrorMessage) -> Self {
        ClientError::Server {
            id: e.id,
            code: e.code,
            message: e.message,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_original_design_table() {
        let disconnect = ClientError::disconnected("reset");
        assert!(disconnect.is_retryable());
        assert_eq!(disconnect.kind(), ErrorKind::Sandbox);
        let malformed = ClientError::Malformed { reason: "x".into() };
        assert!(!malformed.is_retryable());
        assert_eq!(malformed.kind(), ErrorKind::Sandbox);
        let timeout = ClientError::Timeout {
            id: "a".into(),
            after: Duration::from_secs(1),
        };
        assert!(!timeout.is_retryable());
        assert_eq!(timeout.kind(), ErrorKind::Timeout);
        assert_eq!(timeout.code(), Some(ErrorCode::Timeout));
        let exhausted = ClientError::PoolExhausted {
            waited: Duration::from_secs(1),
        };
        assert!(exhausted.is_retryable());
        assert_eq!(exhausted.kind(), ErrorKind::Sandbox);
        let lost = ClientError::NodeLost {
            node: "ws://n/ws".into(),
            id: "a".into(),
            reason: "reset".into(),
        };
        assert!(lost.is_retryable());
        assert_eq!(lost.code(), Some(ErrorCode::NetworkError));
        assert_eq!(lost.kind(), ErrorKind::Sandbox);
        let none = ClientError::NoNode {
            tried: 0,
            last: "no node admitted".into(),
        };
        assert!(none.is_retryable());
        assert_eq!(none.code(), Some(ErrorCode::SandboxOverloaded));
    }

    #[test]
    fn server_errors_follow_the_spec_table() {
        for code in ErrorCode::ALL {
            let e = ClientError::from(protocol::ErrorMessage::new(Some("x".into()), code, "m"));
            let expected = matches!(
                code,
                ErrorCode::SandboxOverloaded | ErrorCode::InternalError | ErrorCode::NetworkError
            );
            assert_eq!(e.is_retryable(), expected, "{code}");
            assert_eq!(e.code(), Some(code));
            assert_eq!(e.kind(), ErrorKind::Execution);
            assert!(e.to_string().contains(code.as_str()), "{e}");
        }
    }

    #[test]
    fn errors_are_send_sync_and_small() {
        fn assert_send_sync<T: Send + Sync + 'static>() {}
        assert_send_sync::<ClientError>();
        assert!(std::mem::size_of::<ClientError>() <= 128);
    }
}

/// Why Kubernetes discovery could not list the nodes; each message names the fix.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum KubernetesError {
    /// No API URL was given and the pod's environment does not name one.
    #[error(
        "Not in a Kubernetes pod: KUBERNETES_SERVICE_HOST and KUBERNETES_SERVICE_PORT are not set; \
         give the API server's URL (--k8s-api)"
    )]
    NotInCluster,
    /// The service-account token could not be read.
    #[error(
        "Cannot read the service-account token {path}: {reason}; mount the pod's token \
         (automountServiceAccountToken: true) or name a token file (--k8s-token-file)"
    )]
    Token {
        /// The token file.
        path: PathBuf,
        /// What failed.
        reason: String,
    },
    /// No namespace was given and the namespace file could not be read.
    #[error("Cannot read the pod's namespace from {path}: {reason}; name the namespace (--k8s-namespace)")]
    Namespace {
        /// The namespace file.
        path: PathBuf,
        /// What failed.
        reason: String,
    },
    /// The API server's CA could not be read or used.
    #[error(
        "Cannot use the API server's CA {path}: {reason}; mount the service-account CA or name one (--k8s-ca-file)"
    )]
    Ca {
        /// The CA file.
        path: PathBuf,
        /// What failed.
        reason: String,
    },
    /// The API server refused the list (401, 403 or 404).
    #[error("The API server refused to list the EndpointSlices of {namespace}/{service} (HTTP {status}): {fix}")]
    Refused {
        /// The HTTP status.
        status: u16,
        /// The namespace.
        namespace: String,
        /// The Service.
        service: String,
        /// What to change, and the API server's own message.
        fix: String,
    },
    /// The list failed otherwise (connection, another status, an answer that is not an EndpointSliceList).
    #[error("Listing EndpointSlices from {url} failed: {reason}")]
    Api {
        /// The list URL.
        url: String,
        /// What failed.
        reason: String,
    },
}

impl KubernetesError {
    /// Whether listing again later may succeed without a change of configuration or RBAC.
    pub fn is_retryable(&self) -> bool {
        matches!(self, KubernetesError::Api { .. })
    }
}

//! Orchestrator client for sandboxd: pooled FSP/1 connections over WebSocket (`ws://`, or `wss://` with rustls),
//! reconnect with backoff, typed retryable errors, and the pieces of the `sandboxctl` command.
//!
//! The protocol is `docs/spec/fsp-v1.md`; the wire types come from the [`protocol`] crate. This crate is the Rust
//! counterpart of the orchestrator side of the original FSP design (`docs/spec/fsp-v1.md`, Appendix A: the pool
//! with health check, reconnection with immediate retry then exponential backoff, the error table, the token
//! manager).
//!
//! - [`Pool`]: `Pool::builder(url).token(..).size(5).max_overflow(10).build()`. Checkout hands out a connection
//!   only after a `ping` answered in time, replaces one that fails, closes overflow connections when they come
//!   back, and fails with [`ClientError::PoolExhausted`] (retryable) when none is free in time. The pool runs
//!   **one execution per checked-out connection** (no multiplexing across callers), so a slow consumer or a broken
//!   link only affects its own execution.
//! - [`Connection`]: one WebSocket with a driver task that reconnects (first retry at once, then 100 ms doubling to
//!   30 s, at most 10 retries, then [`ConnectionStatus::Failed`]); any number of executions may be multiplexed on
//!   it. On disconnect every execution in flight fails with a retryable error; a malformed server message is logged
//!   and fails the executions it concerns with a non-retryable one.
//! - [`Execute`]: `execute`, `execute_with`, `execute_with_tools`, `execute_stream` and `execute_stream_with`,
//!   written once for a [`Pool`] and a [`Connection`] (bring the trait into scope to call them).
//! - [`Execution`]: the streaming form, a [`futures_util::Stream`] of the server's messages as they arrive, with
//!   bounded buffering (backpressure reaches the program's output pipe) and a client deadline that sends `cancel`
//!   and reports [`ClientError::Timeout`]. [`Execution::result`] adds it up into an [`ExecutionResult`].
//! - Tool calls (extension `tool_calls`): [`Execute::execute_with_tools`] on a pool or a connection runs a
//!   request that lists [`ToolSpec`]s and answers each [`ToolCall`] with an async handler; [`tools::CommandTool`]
//!   is a handler that runs a local command (what `sandboxctl --tool` uses).
//! - Egress (extension `network`): set [`ExecuteRequest::network`] to a [`NetworkRequest`]
//!   (`NetworkRequest::allow(["pypi.org:443"])`, optionally `egress_bytes`) and the program may reach those hosts
//!   through the server's proxy (`HTTPS_PROXY`); [`ExecutionResult::network`] carries the proxy's counters
//!   ([`NetworkUsage`]). A server that does not announce `network` in `pong.capabilities.extensions` refuses such a
//!   request ([`ClientError::Server`], `INVALID_REQUEST`); so does one whose operator bound does not cover an entry.
//! - [`ClientError`]: every failure, with [`is_retryable`](ClientError::is_retryable),
//!   [`code`](ClientError::code) (the FSP code) and [`kind`](ClientError::kind) (the original design's `ToolError`
//!   type, `docs/spec/fsp-v1.md` Appendix A).
//! - [`Auth`]: a static token or a [`TokenProvider`] asked on every (re)connect.
//! - [`health()`]: `GET /healthz`.
//! - [`Fleet`]: many hosts behind one client (static or DNS discovery, one pool per node, power-of-two-choices
//!   placement on each node's load, ejection of failing nodes, retries that never run an execution twice); it
//!   implements [`Execute`], so it replaces a [`Pool`] without other changes.
//! - [`Gateway`]: agent sandboxes (`POST /sandboxes` and the adapter-shim endpoints), with an [`EventStream`] that
//!   replays what a dropped connection lost.
//!
//! ```no_run
//! use client::{new_execution_id, Execute, ExecuteRequest, Language, Pool, RequestedLimits};
//!
//! # async fn run() -> Result<(), client::ClientError> {
//! let pool = Pool::builder("ws://127.0.0.1:7070/ws")
//!     .token("the-token")
//!     .size(5)
//!     .max_overflow(10)
//!     .build()?;
//! let request = ExecuteRequest::new(
//!     new_execution_id(),
//!     Language::Python,
//!     "print(6 * 7)",
//!     RequestedLimits::new(5_000, 128),
//! );
//! match pool.execute(request).await {
//!     Ok(result) => println!("{} {:?}", result.stdout_text(), result.status),
//!     Err(e) if e.is_retryable() => eprintln!("try again later: {e}"),
//!     Err(e) => eprintln!("failed: {e}"),
//! }
//! # Ok(())
//! # }
//! ```
//!
//! Nothing here blocks a runtime thread: I/O is tokio's, locks are held for a few map operations only.

#![forbid(unsafe_code)]

pub mod auth;
pub mod config;
pub mod connection;
pub mod error;
pub mod execute;
pub mod execution;
pub mod fleet;
pub mod gateway;
pub mod health;
pub mod pool;
mod session;
pub mod tls;
pub mod tools;

pub use auth::{Auth, TokenFuture, TokenProvider};
pub use config::{Backoff, ConnectOptions, ExecOptions, DEFAULT_TOKEN_FILE, DEFAULT_URL};
pub use connection::{Connection, ConnectionStatus};
pub use error::{BoxError, ClientError, ErrorKind};
pub use execute::Execute;
pub use execution::{Execution, ExecutionResult};
pub use fleet::{
    Discovery, DnsDiscovery, Fleet, FleetBuilder, KubernetesDiscovery, KubernetesError, NodeHealth,
    NodeStatus, DEFAULT_K8S_PORT_NAME,
};
pub use gateway::{EventStream, Gateway, GatewayError, SandboxClient};
pub use health::{health, healthz_url, Health};
pub use pool::{Pool, PoolBuilder, PoolStats, PooledConnection};
pub use protocol::{
    ExecStatus, ExecuteRequest, Language, Limits, NetworkRequest, NetworkUsage, Pong, Reason,
    RequestedLimits, ServerEnvelope, ServerMessage, ToolCall, ToolResult, ToolSpec,
    MAX_NETWORK_ALLOW,
};
/// The rustls this crate is built with, to build a [`rustls::ClientConfig`] for [`ConnectOptions::tls_config`].
pub use rustls;
pub use tools::{CommandTool, ToolOutcome};

/// A fresh execution id: `exec-` and 20 random hex digits (ids only need to be unique per connection; random ones
/// are unique across connections too, which keeps logs readable).
pub fn new_execution_id() -> String {
    let n: u128 = rand::random();
    format!("exec-{:020x}", n >> 48)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn execution_ids_are_valid_and_distinct() {
        let a = new_execution_id();
        let b = new_execution_id();
        assert_ne!(a, b);
        assert!(protocol::is_valid_id(&a), "{a}");
        assert_eq!(a.len(), 25);
    }

    fn request() -> ExecuteRequest {
        ExecuteRequest::new(
            "net-1",
            Language::Python,
            "print(1)",
            RequestedLimits::new(5_000, 64),
        )
    }

    /// The `execute` frame the client sends, as JSON.
    fn wire(request: ExecuteRequest) -> serde_json::Value {
        let text = serde_json::to_string(&protocol::ClientMessage::Execute(request)).unwrap();
        serde_json::from_str(&text).unwrap()
    }

    #[test]
    fn network_is_sent_only_when_asked_for() {
        assert!(wire(request()).get("network").is_none());

        let mut with = request();
        with.network = Some(NetworkRequest::allow(["pypi.org:443", "api.example.com"]));
        assert_eq!(
            wire(with.clone())["network"],
            serde_json::json!({"allow": ["pypi.org:443", "api.example.com"]})
        );
        if let Some(n) = &mut with.network {
            n.egress_bytes = Some(1 << 20);
        }
        let sent = wire(with.clone());
        assert_eq!(
            sent["network"],
            serde_json::json!({"allow": ["pypi.org:443", "api.example.com"], "egress_bytes": 1_048_576})
        );
        // What the server parses is what was set.
        match protocol::parse_client_message(&sent.to_string()).unwrap() {
            protocol::ClientMessage::Execute(parsed) => assert_eq!(parsed.network, with.network),
            other => panic!("parsed as {other:?}"),
        }
    }

    #[test]
    fn a_malformed_network_request_is_refused_before_sending() {
        let too_many: Vec<String> = (0..=MAX_NETWORK_ALLOW)
            .map(|i| format!("h{i}.example.com:443"))
            .collect();
        for (network, field) in [
            (NetworkRequest::allow(Vec::<String>::new()), "network.allow"),
            (NetworkRequest::allow(too_many), "network.allow"),
            (NetworkRequest::allow(["bad host"]), "network.allow"),
            (
                NetworkRequest {
                    allow: vec!["pypi.org:443".into()],
                    egress_bytes: Some(0),
                },
                "network.egress_bytes",
            ),
        ] {
            let mut r = request();
            r.network = Some(network);
            let err = ClientError::InvalidRequest(r.validate().unwrap_err());
            assert!(!err.is_retryable(), "{err}");
            assert!(err.to_string().contains(field), "{field}: {err}");
        }
    }
}

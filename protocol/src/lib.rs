//! Wire types, validation and error codes of the Fathom Sandbox Protocol v1 (FSP/1), sandboxd profile.
//!
//! The authoritative text is `docs/spec/fsp-v1.md`. This crate does no I/O: the daemon hands it the text of each
//! WebSocket frame and gets back a typed [`ClientMessage`] or a [`RequestError`] that maps one-to-one onto an FSP
//! `error` message; it builds [`ServerMessage`]s and turns them into frames with [`encode`]. The agent sandboxes'
//! HTTP surface has its own crate (`agent-api`).
//!
//! - [`artifacts`]: the artifact manifest a `result` carries ([`ArtifactManifest`], `docs/spec/artifact-manifest.md`).
//! - [`envelope`]: protocol version, execution ids and timestamps shared by every message.
//! - [`client`]: `execute`, `cancel`, `ping`, `tool_result` and [`parse_client_message`], which applies the refusal rules of
//!   spec sections 2 and 3 in a fixed order (JSON, object, `id`, `v`, `type`, `ts`, body, semantic checks).
//! - [`server`]: `ack`, `status`, `stdout`/`stderr`, `result`, `error`, `pong`, [`encode`] and
//!   [`parse_server_message`] (for clients and tests).
//! - [`limits`]: requested and effective resource limits, defaults and [`RequestedLimits::resolve`].
//! - [`error`]: [`ErrorCode`] with its retryability, and [`RequestError`].
//! - [`validate`]: path, glob and environment checks used by `execute`.
//! - [`tools`]: the `tool_calls` extension: [`ToolSpec`], [`ToolCall`] and [`ToolResult`].
//! - [`output`]: [`Utf8Chunker`], which turns raw pipe bytes into chunks that never split a UTF-8 sequence.

#![forbid(unsafe_code)]

pub mod artifacts;
pub mod client;
pub mod envelope;
pub mod error;
pub mod language;
pub mod limits;
pub mod output;
pub mod server;
pub mod tools;
pub mod validate;

pub use artifacts::{Artifact, ArtifactManifest, DroppedArtifacts, SkippedArtifact};
pub use client::{
    is_traceparent, parse_client_message, ArtifactsRequest, CancelRequest, ClientMessage,
    ExecuteRequest, FileContentError, FileEncoding, FileSpec, MountRequest, NetworkRequest,
    PingRequest, MAX_MOUNTS, MAX_NETWORK_ALLOW,
};
pub use envelope::{
    format_ts, is_valid_id, now_ts, parse_ts, TimestampError, MAX_ID_LEN, PROTOCOL_VERSION,
    SUPPORTED_VERSIONS,
};
pub use error::{ErrorCode, RequestError};
pub use language::{Language, UnknownLanguage};
pub use limits::{CpuCores, LimitDefaults, LimitError, Limits, RequestedLimits};
pub use output::{Chunk, OutputEncoding, Utf8Chunker};
pub use server::{
    encode, encode_with_ts, parse_server_envelope, parse_server_message, Capabilities, Environment,
    ErrorMessage, ExecStatus, Isolation, Load, NetworkUsage, OutputChunk, Pong, Reason,
    ResourceUsage, ResultMessage, ServerEnvelope, ServerMessage, SANDBOXD_EXTENSIONS,
};
pub use tools::{
    parse_tool_request, RawArgs, ToolCall, ToolRequest, ToolRequestError, ToolResult, ToolSpec,
    DEFAULT_TOOL_TIMEOUT_MS, MAX_TOOLS,
};
pub use validate::{
    paths_overlap, validate_env_var, validate_relative_path, EnvError, PathError, MAX_PATH_LEN,
};

//! Server → client messages (spec section 4) and their wire form.
//!
//! [`ServerMessage`] serializes to `{"type":..,...}`; [`encode`] adds the envelope (`v` and `ts`) and is what the
//! daemon sends. [`parse_server_message`] reads the wire form back, for clients and tests; fields sandboxd adds to
//! the FSP v1.0 messages are optional there, so messages from a plain FSP v1.0 server parse too.

use base64::engine::general_purpose::STANDARD;
use base64::Engine;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::envelope::{now_ts, PROTOCOL_VERSION, SUPPORTED_VERSIONS};
use crate::error::{ErrorCode, RequestError};
use crate::language::Language;
use crate::limits::Limits;
use crate::output::{Chunk, OutputEncoding};
use crate::tools::ToolCall;

/// The protocol extensions sandboxd implements, for `pong.capabilities.extensions`.
pub const SANDBOXD_EXTENSIONS: &[&str] = &[
    "files",
    "artifacts",
    "base64_output",
    "tool_calls",
    "cpu_cores",
];

/// A message the server sends. Tagged by `type`; [`encode`] adds `v` and `ts`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "lowercase")]
pub enum ServerMessage {
    /// `ack`: the execution is accepted. Sent once, before anything else for that id.
    Ack {
        /// The execution id.
        id: String,
        /// The limits in effect, defaults filled in (sandboxd addition).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        limits: Option<Limits>,
        /// Whether the execution waits for a slot (sandboxd addition).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        queued: Option<bool>,
        /// The same fingerprint the `result` carries (sandboxd addition).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        environment_fingerprint: Option<String>,
        /// What the fingerprint is made of, to reproduce the run (sandboxd addition).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        environment: Option<Box<Environment>>,
    },
    /// `status`: the execution changed state.
    Status {
        /// The execution id.
        id: String,
        /// The new state.
        status: ExecStatus,
    },
    /// `stdout`: output the program wrote to stdout.
    Stdout(OutputChunk),
    /// `stderr`: output the program wrote to stderr.
    Stderr(OutputChunk),
    /// `result`: how the execution ended. Sent exactly once, right after the terminal status.
    Result(ResultMessage),
    /// `error`: a refused request, or an execution's last message when the sandbox failed.
    Error(ErrorMessage),
    /// `pong`: the answer to `ping`.
    Pong(Pong),
    /// `tool_call`: code in the execution called a tool (extension `tool_calls`); answered by `tool_result`.
    #[serde(rename = "tool_call")]
    ToolCall(ToolCall),
}

impl ServerMessage {
    /// The wire `type`.
    pub const fn type_name(&self) -> &'static str {
        match self {
            ServerMessage::Ack { .. } => "ack",
            ServerMessage::Status { .. } => "status",
            ServerMessage::Stdout(_) => "stdout",
            ServerMessage::Stderr(_) => "stderr",
            ServerMessage::Result(_) => "result",
            ServerMessage::Error(_) => "error",
            ServerMessage::Pong(_) => "pong",
            ServerMessage::ToolCall(_) => "tool_call",
        }
    }

    /// The execution id the message is about, if any.
    pub fn id(&self) -> Option<&str> {
        match self {
            ServerMessage::Ack { id, .. } | ServerMessage::Status { id, .. } => Some(id),
            ServerMessage::Stdout(chunk) | ServerMessage::Stderr(chunk) => Some(&chunk.id),
            ServerMessage::Result(result) => Some(&result.id),
            ServerMessage::Error(error) => error.id.as_deref(),
            ServerMessage::Pong(_) => None,
            ServerMessage::ToolCall(call) => Some(&call.id),
        }
    }

    /// Whether this is the last message for its execution (`result`, or `error` with an id).
    pub fn is_terminal(&self) -> bool {
        match self {
            ServerMessage::Result(_) => true,
            ServerMessage::Error(error) => error.id.is_some(),
            _ => false,
        }
    }
}

impl From<RequestError> for ServerMessage {
    fn from(err: RequestError) -> Self {
        ServerMessage::Error(err.into())
    }
}

/// The state of an execution, as sent in `status`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ExecStatus {
    /// The program started. Sent once.
    Running,
    /// The program exited with code 0.
    Completed,
    /// The program exited non-zero, was killed by a signal the daemon did not send, or hit the output limit.
    Failed,
    /// Wall clock over `timeout_ms`.
    Timeout,
    /// Killed by the memory limit.
    Oom,
    /// Cancelled by the client.
    Cancelled,
}

impl ExecStatus {
    /// Whether no further `status` follows (everything but `running`).
    pub const fn is_terminal(self) -> bool {
        !matches!(self, ExecStatus::Running)
    }

    /// The wire spelling, e.g. `running`.
    pub const fn as_str(self) -> &'static str {
        match self {
            ExecStatus::Running => "running",
            ExecStatus::Completed => "completed",
            ExecStatus::Failed => "failed",
            ExecStatus::Timeout => "timeout",
            ExecStatus::Oom => "oom",
            ExecStatus::Cancelled => "cancelled",
        }
    }

    /// The terminal status for an execution that ended for `reason` with `exit_code` (spec section 4).
    pub const fn terminal(reason: Reason, exit_code: Option<i32>) -> ExecStatus {
        match reason {
            Reason::Exited => match exit_code {
                Some(0) => ExecStatus::Completed,
                _ => ExecStatus::Failed,
            },
            Reason::Signaled | Reason::OutputLimit => ExecStatus::Failed,
            Reason::Timeout => ExecStatus::Timeout,
            Reason::Oom => ExecStatus::Oom,
            Reason::Cancelled => ExecStatus::Cancelled,
        }
    }
}

/// Why an execution ended (`result.reason`, sandboxd addition).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Reason {
    /// The program exited by itself.
    Exited,
    /// The program was killed by a signal the daemon did not send.
    Signaled,
    /// The daemon killed it at `timeout_ms`.
    Timeout,
    /// The memory limit killed it.
    Oom,
    /// The daemon killed it at `max_output_bytes`.
    OutputLimit,
    /// The daemon killed it on `cancel`.
    Cancelled,
}

impl Reason {
    /// The wire spelling, e.g. `output_limit`.
    pub const fn as_str(self) -> &'static str {
        match self {
            Reason::Exited => "exited",
            Reason::Signaled => "signaled",
            Reason::Timeout => "timeout",
            Reason::Oom => "oom",
            Reason::OutputLimit => "output_limit",
            Reason::Cancelled => "cancelled",
        }
    }
}

/// The body of `stdout` and `stderr`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OutputChunk {
    /// The execution id.
    pub id: String,
    /// The output, or its base64 when `encoding` is `base64`.
    pub data: String,
    /// Left out for UTF-8 text; `base64` when the chunk is not valid UTF-8.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub encoding: Option<OutputEncoding>,
}

impl OutputChunk {
    /// The message body for a chunk from [`Utf8Chunker`](crate::output::Utf8Chunker).
    pub fn new(id: impl Into<String>, chunk: Chunk) -> Self {
        let encoding = match chunk.encoding {
            OutputEncoding::Utf8 => None,
            OutputEncoding::Base64 => Some(OutputEncoding::Base64),
        };
        OutputChunk {
            id: id.into(),
            data: chunk.data,
            encoding,
        }
    }

    /// The raw output bytes the chunk carries.
    pub fn decode(&self) -> Result<Vec<u8>, base64::DecodeError> {
        match self.encoding {
            None | Some(OutputEncoding::Utf8) => Ok(self.data.as_bytes().to_vec()),
            Some(OutputEncoding::Base64) => STANDARD.decode(&self.data),
        }
    }
}

/// Resources an execution used (`result.resource_usage`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ResourceUsage {
    /// Peak memory of the execution's cgroup, in MiB.
    pub peak_memory_mb: u64,
    /// User plus system CPU time of the execution's processes from its launch, in milliseconds (a pooled
    /// container's set-up and its waiting interpreter's start are not counted).
    pub cpu_time_ms: u64,
}

/// The body of `result`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(from = "ResultWire")]
pub struct ResultMessage {
    /// The execution id.
    pub id: String,
    /// The exit code; `null` (always sent) when the program was killed by a signal.
    pub exit_code: Option<i32>,
    /// Wall-clock time from start to end, in milliseconds.
    pub duration_ms: u64,
    /// What the execution used.
    pub resource_usage: ResourceUsage,
    /// Why the execution ended (sandboxd addition).
    pub reason: Reason,
    /// The killing signal, e.g. `SIGKILL`, when signaled (sandboxd addition).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub signal: Option<String>,
    /// Bytes the program wrote to stdout that were sent (sandboxd addition).
    pub stdout_bytes: u64,
    /// Bytes the program wrote to stderr that were sent (sandboxd addition).
    pub stderr_bytes: u64,
    /// Whether output was cut at `max_output_bytes` (sandboxd addition).
    pub truncated: bool,
    /// The artifact manifest, when artifacts were requested (sandboxd addition; see `artifact-manifest.md`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub artifacts: Option<Value>,
    /// Hash of image digest, runtime version, seccomp profile and config limits (sandboxd addition).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub environment_fingerprint: Option<String>,
    /// What the fingerprint is made of (sandboxd addition).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub environment: Option<Box<Environment>>,
    /// How many tool calls were forwarded to the client; present when the request offered tools (extension
    /// `tool_calls`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<u64>,
    /// The value the code returned (extension `tool_calls`); absent when it returned nothing. Boxed: it is rare,
    /// and every message the daemon queues is as large as the largest one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub return_value: Option<Box<Value>>,
    /// What went through the egress proxy; present when the request asked for `network` (extension `network`).
    /// Boxed, as `return_value` is: it is rare, and every queued message is as large as the largest one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub network: Option<Box<NetworkUsage>>,
}

impl ResultMessage {
    /// The result of execution `id` that ended for `reason`, with nothing measured, counted or attached: its
    /// sender sets what it has with struct update syntax (`ResultMessage { exit_code, .. ResultMessage::new(id,
    /// reason) }`).
    pub fn new(id: impl Into<String>, reason: Reason) -> Self {
        Self {
            id: id.into(),
            exit_code: None,
            duration_ms: 0,
            resource_usage: ResourceUsage::default(),
            reason,
            signal: None,
            stdout_bytes: 0,
            stderr_bytes: 0,
            truncated: false,
            artifacts: None,
            environment_fingerprint: None,
            environment: None,
            tool_calls: None,
            return_value: None,
            network: None,
        }
    }
}

/// `result.network` (extension `network`): the egress proxy's counters for one execution.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct NetworkUsage {
    /// Connections the program opened to the proxy.
    pub connections: u64,
    /// Connections the proxy opened to the outside.
    pub upstream_connections: u64,
    /// Requests the proxy refused (not allowed, refused address, over the byte limit, malformed).
    pub refused: u64,
    /// Bytes sent to the outside.
    pub bytes_sent: u64,
    /// Bytes received from the outside.
    pub bytes_received: u64,
}

/// The parts of `environment_fingerprint` (sandboxd addition): enough to run the same program on the same image,
/// sandboxd build and seccomp profile again. The fingerprint is `sha256:` of
/// `image=<image_digest>;sandboxd=<sandboxd_version>;seccomp=<seccomp_profile>;limits=<limits as JSON>`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Environment {
    /// The image's name on this server (`host` for the embedded image).
    pub image: String,
    /// The OCI manifest digest `sha256:…`; for the embedded host image `host:sha256:…` of the host's
    /// `/etc/os-release` (the host image is not content-addressed).
    pub image_digest: String,
    /// sandboxd's version.
    pub sandboxd_version: String,
    /// sha256 of the seccomp profile in force.
    pub seccomp_profile: String,
}

impl Environment {
    /// The fingerprint of this environment with these limits.
    pub fn fingerprint(&self, limits: &Limits) -> String {
        use sha2::Digest;
        let text = format!(
            "image={};sandboxd={};seccomp={};limits={}",
            self.image_digest,
            self.sandboxd_version,
            self.seccomp_profile,
            serde_json::to_string(limits).unwrap_or_default()
        );
        format!("sha256:{:x}", sha2::Sha256::digest(text.as_bytes()))
    }
}

/// `result` as it may arrive: the sandboxd additions are optional so a plain FSP v1.0 `result` parses.
#[derive(Deserialize)]
struct ResultWire {
    id: String,
    #[serde(default)]
    exit_code: Option<i32>,
    duration_ms: u64,
    #[serde(default)]
    resource_usage: ResourceUsage,
    #[serde(default)]
    reason: Option<Reason>,
    #[serde(default)]
    signal: Option<String>,
    #[serde(default)]
    stdout_bytes: u64,
    #[serde(default)]
    stderr_bytes: u64,
    #[serde(default)]
    truncated: bool,
    #[serde(default)]
    artifacts: Option<Value>,
    #[serde(default)]
    environment_fingerprint: Option<String>,
    #[serde(default)]
    environment: Option<Box<Environment>>,
    #[serde(default)]
    tool_calls: Option<u64>,
    #[serde(default)]
    return_value: Option<Box<Value>>,
    #[serde(default)]
    network: Option<Box<NetworkUsage>>,
}

impl From<ResultWire> for ResultMessage {
    fn from(wire: ResultWire) -> Self {
        // Without `reason`, infer it the way FSP v1.0 defines `exit_code`: null means killed.
        let reason = wire.reason.unwrap_or(match wire.exit_code {
            Some(_) => Reason::Exited,
            None => Reason::Signaled,
        });
        ResultMessage {
            id: wire.id,
            exit_code: wire.exit_code,
            duration_ms: wire.duration_ms,
            resource_usage: wire.resource_usage,
            reason,
            signal: wire.signal,
            stdout_bytes: wire.stdout_bytes,
            stderr_bytes: wire.stderr_bytes,
            truncated: wire.truncated,
            artifacts: wire.artifacts,
            environment_fingerprint: wire.environment_fingerprint,
            environment: wire.environment,
            tool_calls: wire.tool_calls,
            return_value: wire.return_value,
            network: wire.network,
        }
    }
}

/// The body of `error`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorMessage {
    /// The id of the message this answers; left out when that message had no usable id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    /// The error code.
    pub code: ErrorCode,
    /// Human-readable reason.
    pub message: String,
    /// Whether the client may retry; follows from `code`.
    pub retryable: bool,
    /// The versions the server speaks, when the client's `v` is not one of them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub supported_versions: Option<Vec<u64>>,
}

impl ErrorMessage {
    /// An error with `retryable` taken from `code`.
    pub fn new(id: Option<String>, code: ErrorCode, message: impl Into<String>) -> Self {
        ErrorMessage {
            id,
            code,
            message: message.into(),
            retryable: code.retryable(),
            supported_versions: None,
        }
    }

    /// `SANDBOX_OVERLOADED` for the execution `id`: no slot and the queue is full.
    pub fn overloaded(id: &str) -> Self {
        Self::new(
            Some(id.to_owned()),
            ErrorCode::SandboxOverloaded,
            "No execution slot is free and the wait queue is full",
        )
    }

    /// `INTERNAL_ERROR` for the execution `id`.
    pub fn internal(id: &str, message: impl Into<String>) -> Self {
        Self::new(Some(id.to_owned()), ErrorCode::InternalError, message)
    }
}

impl From<RequestError> for ErrorMessage {
    fn from(err: RequestError) -> Self {
        ErrorMessage {
            supported_versions: err.supported_versions,
            ..Self::new(err.id, err.code, err.message)
        }
    }
}

/// The body of `pong`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Pong {
    /// Current load.
    pub load: Load,
    /// What this server offers (sandboxd addition).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capabilities: Option<Capabilities>,
}

/// `pong.load`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Load {
    /// Executions running now.
    pub active_executions: u64,
    /// Executions waiting for a slot.
    pub queue_depth: u64,
}

/// `pong.capabilities` (sandboxd addition).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Capabilities {
    /// The languages that work on this server.
    pub languages: Vec<Language>,
    /// The largest limits an `execute` may ask for.
    pub max_limits: Limits,
    /// Protocol extensions implemented, e.g. [`SANDBOXD_EXTENSIONS`].
    pub extensions: Vec<String>,
    /// The isolation layers that are active.
    pub isolation: Isolation,
}

/// Which isolation layers are active (`pong.capabilities.isolation`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Isolation {
    /// Namespaces each execution gets, e.g. `["mount","pid","net","ipc","uts","user","cgroup"]`.
    pub namespaces: Vec<String>,
    /// `v1` or `v2`.
    pub cgroup_version: String,
    /// Whether a seccomp filter is applied.
    pub seccomp: bool,
    /// The Landlock ABI enforced, or `null` when Landlock is not used.
    pub landlock_abi: Option<u32>,
    /// Whether executions run in a user namespace.
    pub user_namespace: bool,
    /// Network access of executions, e.g. `none`.
    pub network: String,
}

/// The wire form: envelope first, then the message, then `ts`.
#[derive(Serialize)]
struct Outgoing<'a> {
    v: u64,
    #[serde(flatten)]
    message: &'a ServerMessage,
    ts: &'a str,
}

/// The text frame for `message`, stamped with `v` and the current time.
pub fn encode(message: &ServerMessage) -> String {
    encode_with_ts(message, &now_ts())
}

/// The text frame for `message` with the given `ts` (for tests and replay).
pub fn encode_with_ts(message: &ServerMessage, ts: &str) -> String {
    match serde_json::to_string(&Outgoing {
        v: PROTOCOL_VERSION,
        message,
        ts,
    }) {
        Ok(text) => text,
        // Not reachable with these types (string keys, no floats); still answer with a well-formed frame.
        Err(e) => serde_json::json!({
            "v": PROTOCOL_VERSION,
            "type": "error",
            "id": message.id(),
            "ts": ts,
            "code": ErrorCode::InternalError,
            "message": format!("Failed to encode a {} message: {e}", message.type_name()),
            "retryable": true,
        })
        .to_string(),
    }
}

/// A parsed server frame with its envelope.
#[derive(Debug, Clone, PartialEq)]
pub struct ServerEnvelope {
    /// The protocol version; one of [`SUPPORTED_VERSIONS`].
    pub v: u64,
    /// The server's timestamp, as sent (check it with [`parse_ts`](crate::envelope::parse_ts)).
    pub ts: String,
    /// The message.
    pub message: ServerMessage,
}

/// Parses a server frame, keeping `v` and `ts`. Unknown fields are ignored.
pub fn parse_server_envelope(text: &str) -> Result<ServerEnvelope, serde_json::Error> {
    use serde::de::Error as _;

    let value: Value = serde_json::from_str(text)?;
    let Some(obj) = value.as_object() else {
        return Err(serde_json::Error::custom(
            "A server message must be a JSON object",
        ));
    };
    let v = match obj.get("v").and_then(Value::as_u64) {
        Some(v) if SUPPORTED_VERSIONS.contains(&v) => v,
        Some(v) => {
            return Err(serde_json::Error::custom(format!(
                "Unsupported protocol version {v}"
            )))
        }
        None => return Err(serde_json::Error::custom("Missing or non-integer field v")),
    };
    let Some(ts) = obj.get("ts").and_then(Value::as_str).map(str::to_owned) else {
        return Err(serde_json::Error::custom("Missing or non-string field ts"));
    };
    let message = ServerMessage::deserialize(value)?;
    Ok(ServerEnvelope { v, ts, message })
}

/// Parses a server frame; `v` must be supported and `ts` must be a string.
pub fn parse_server_message(text: &str) -> Result<ServerMessage, serde_json::Error> {
    parse_server_envelope(text).map(|envelope| envelope.message)
}

//! Agent sandboxes: the wire types of the adapter-shim HTTP/WebSocket surface (`docs/spec/agent-sandboxes.md`),
//! apart from the FSP/1 types of `protocol` (which they use for template files).
//!
//! sandboxd hosts long-lived agent sandboxes. A gateway provisions one with `POST /sandboxes`
//! ([`CreateSandboxRequest`] → [`CreateSandboxResponse`]) and then drives it under `/sandboxes/<id>` with the
//! adapter-shim endpoints (`/spawn`, `/pause`, `/resume`, `/kill`, `/resolve`, `/inject-context`,
//! `/update-brief`, `WS /events`, `/replay`, `/health`, `/network`). Every refusal is a [`PluginError`].
//!
//! The agent's own payloads (the brief's deeper fields, event payloads, resolutions) are kept as JSON objects:
//! sandboxd forwards them and only reads the few fields it acts on (`type`, `agentId`, `decisionId`, an
//! artifact's `uri`). The agent talks to sandboxd over a control channel with JSON lines: [`AgentCommand`]s go to
//! the agent, [`AgentLine`]s come back.

#![forbid(unsafe_code)]

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use protocol::FileSpec;

/// Default grace period of `POST /kill`, milliseconds.
pub const DEFAULT_GRACE_TIMEOUT_MS: u64 = 10_000;
/// Age after which a buffered event is dropped while no gateway is connected, milliseconds. (The queue's budgets,
/// in events and in bytes, and the replay log's, in bytes, are set by the daemon's `agents:` configuration.)
pub const DISCONNECTED_BUFFER_MS: u64 = 60_000;

/// The `errorCode`s of sandboxd's own `ErrorEvent`s. An agent's error event may not use them (sandboxd refuses such
/// a line), so a gateway can tell what sandboxd says from what the agent says.
pub mod error_codes {
    /// The agent crashed (with `LifecycleEvent` `crashed`).
    pub const AGENT_CRASHED: &str = "agent_crashed";
    /// An artifact was not uploaded (its event went out without `uri`).
    pub const ARTIFACT_UPLOAD_FAILED: &str = "artifact_upload_failed";
    /// A control line, or the event it became, was over `agents.max_line_bytes` and skipped.
    pub const CONTROL_LINE_TOO_LONG: &str = "control_line_too_long";
    /// Events were dropped from the gateway's queue (the count is in the message).
    pub const EVENTS_DROPPED: &str = "events_dropped";
    /// A control line was not valid, or not the agent's to write, and was dropped.
    pub const MALFORMED_EVENT: &str = "malformed_event";
    /// Every code above.
    pub const RESERVED: &[&str] = &[
        AGENT_CRASHED,
        ARTIFACT_UPLOAD_FAILED,
        CONTROL_LINE_TOO_LONG,
        EVENTS_DROPPED,
        MALFORMED_EVENT,
    ];
}

/// A mount into the sandbox: a volume of the daemon's (`volume`), or a project directory (`hostPath`, which
/// sandboxd refuses with `capability_unsupported`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct WorkspaceMount {
    /// Project-relative path on the host.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_path: Option<String>,
    /// The id of a volume (`POST /volumes`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub volume: Option<String>,
    /// Path inside the sandbox (`path` is accepted too).
    #[serde(alias = "path")]
    pub sandbox_path: String,
    /// Mounted read-only.
    #[serde(default)]
    pub read_only: bool,
}

/// `POST /volumes`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CreateVolumeRequest {
    /// Size (the quota: a write beyond it fails with `ENOSPC` inside), MiB.
    pub size_mb: u64,
    /// A name for people (letters, digits, `.`, `_`, `-`; at most 64), not unique.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

/// Where a volume is mounted now.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct VolumeAttachment {
    /// The sandbox.
    pub sandbox_id: String,
    /// Path inside it.
    pub path: String,
    /// Mounted read-only.
    pub read_only: bool,
}

/// What the recovery scan found on a volume once its writer was gone (the sandbox deleted, or the daemon
/// restarted after a crash): each file compared with the `ArtifactEvent`s the writer emitted for it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct VolumeRecovery {
    /// When it ran (RFC 3339).
    pub at: String,
    /// The writer.
    pub sandbox_id: String,
    /// `deleted` (the sandbox was deleted), `shutdown` (the daemon stopped) or `restart` (the daemon started again
    /// after the writer was lost with it).
    pub reason: String,
    /// Regular files on the volume.
    pub files: u64,
    /// Files whose artifact was uploaded when emitted.
    pub uploaded: u64,
    /// Files whose upload had failed and that were uploaded by the scan (volume paths).
    pub reuploaded: Vec<String>,
    /// Files whose upload failed and still fails (or could not be retried: no credentials after a restart).
    pub not_uploaded: Vec<String>,
    /// Files never named by an `ArtifactEvent`, for a person to triage.
    pub orphans: Vec<String>,
    /// The lists stop at 1000 paths each; true when one was cut.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub truncated: bool,
}

/// A volume.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Volume {
    /// Its id (`vol-...`).
    pub id: String,
    /// Its name, if it was given one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Size (quota), bytes.
    pub size_bytes: u64,
    /// Bytes in use (the filesystem's own figure, its metadata included).
    pub used_bytes: u64,
    /// When it was created (RFC 3339).
    pub created_at: String,
    /// Where it is mounted now.
    pub attachments: Vec<VolumeAttachment>,
    /// The last recovery scan, if one ran.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub recovery: Option<VolumeRecovery>,
}

/// A snapshot (`POST /sandboxes/<id>/snapshot`): a sandbox's `/workspace` as it was, stored once and started from
/// by any number of sandboxes (`fromSnapshot`), none of which copies it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Snapshot {
    /// Its id (`snap-...`).
    pub id: String,
    /// `sha256:<hex>` over its files' paths, kinds, modes and contents: the same files give the same digest.
    pub digest: String,
    /// Bytes of file content it holds.
    pub bytes: u64,
    /// Files, directories and symbolic links it holds.
    pub files: u64,
    /// The image of the sandbox it was taken from (the default image of sandboxes started from it).
    pub image: String,
    /// The sandbox it was taken from.
    pub source: String,
    /// When it was taken (RFC 3339).
    pub created_at: String,
    /// The sandboxes started from it that exist now (it cannot be deleted while there are any).
    pub used_by: Vec<String>,
    /// What it left out: entries that are neither files, directories nor symbolic links (sockets, FIFOs), and
    /// volumes mounted in the workspace (their own data is kept by the volume).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub skipped: Vec<String>,
    /// What the sandbox's runs had written into its root outside `/workspace` and `/tmp` (the upper layer of an
    /// image's overlay root), when there was anything: a sandbox started from the snapshot starts with it, on the
    /// same image. Absent for a sandbox on the host image, whose root is read-only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub root: Option<RootLayer>,
}

/// A snapshot's copy of its sandbox's root layer: the files, directories, links and whiteouts (deletions) its runs
/// made over the image, each owned by the sandbox's root or by nobody.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RootLayer {
    /// `sha256:<hex>` over its entries (as the workspace's `digest`, with each entry's owner and opaque mark).
    pub digest: String,
    /// Bytes of file content it holds.
    pub bytes: u64,
    /// Its entries.
    pub files: u64,
    /// What it left out (sockets, FIFOs, a renamed image directory's image content).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub skipped: Vec<String>,
}

/// `POST /sandboxes/<id>/fork` → 201: the snapshot taken and the sandbox started from it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ForkResponse {
    /// The snapshot of the source sandbox.
    pub snapshot: Snapshot,
    /// The new sandbox.
    pub sandbox: CreateSandboxResponse,
}

/// A system-level capability a sandbox may ask for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SandboxCapability {
    /// Shell access.
    Terminal,
    /// A headless browser.
    Browser,
    /// The git CLI.
    Git,
    /// Docker in the sandbox.
    Docker,
    /// Outbound internet access.
    NetworkExternal,
    /// No internet; sandbox-to-backend only.
    NetworkInternalOnly,
    /// GPU access.
    Gpu,
}

impl SandboxCapability {
    /// The wire name.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Terminal => "terminal",
            Self::Browser => "browser",
            Self::Git => "git",
            Self::Docker => "docker",
            Self::NetworkExternal => "network_external",
            Self::NetworkInternalOnly => "network_internal_only",
            Self::Gpu => "gpu",
        }
    }
}

/// Resource limits of a sandbox; absent fields take the daemon's defaults.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ResourceLimits {
    /// CPU cores (a hard quota).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu_cores: Option<f64>,
    /// Memory, MiB.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_mb: Option<u64>,
    /// Size of `/workspace` plus `/tmp`, MiB.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disk_mb: Option<u64>,
    /// Maximum agent lifetime, milliseconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_ms: Option<u64>,
}

/// What the sandbox must provide.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct WorkspaceRequirements {
    /// Mounts from the project.
    #[serde(default)]
    pub mounts: Vec<WorkspaceMount>,
    /// Capabilities.
    #[serde(default)]
    pub capabilities: Vec<SandboxCapability>,
    /// Resource limits.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resource_limits: Option<ResourceLimits>,
    /// Image name (`host` or a configured image); the host image when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub base_image: Option<String>,
}

/// How the sandbox reaches the backend. The token is a secret: `Debug` never shows it.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SandboxBootstrap {
    /// Backend base URL (`http://host:port`); token renewal goes to `{backendUrl}/api/token/renew`.
    pub backend_url: String,
    /// Bearer token for sandbox-to-backend calls.
    pub backend_token: String,
    /// When the token expires (RFC 3339).
    pub token_expires_at: String,
    /// The agent this sandbox is for.
    pub agent_id: String,
    /// Where artifact content is uploaded.
    pub artifact_upload_endpoint: String,
}

impl std::fmt::Debug for SandboxBootstrap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SandboxBootstrap")
            .field("backend_url", &self.backend_url)
            .field("backend_token", &"<redacted>")
            .field("token_expires_at", &self.token_expires_at)
            .field("agent_id", &self.agent_id)
            .field("artifact_upload_endpoint", &self.artifact_upload_endpoint)
            .finish()
    }
}

/// The agent program of a sandbox (sandboxd's "sandbox template"): a brief's `providerConfig.command` overrides
/// `command`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct AgentTemplate {
    /// Program and arguments (absolute program path inside the sandbox).
    #[serde(default)]
    pub command: Vec<String>,
    /// Extra environment.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Files placed in `/workspace` before the first spawn.
    #[serde(default)]
    pub files: Vec<FileSpec>,
}

/// `POST /sandboxes`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CreateSandboxRequest {
    /// What the sandbox must provide.
    pub workspace_requirements: WorkspaceRequirements,
    /// How the sandbox reaches the backend.
    pub bootstrap: SandboxBootstrap,
    /// The agent program.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub template: Option<AgentTemplate>,
    /// Egress through the daemon's proxy (the `network` extension): the hosts every run of the sandbox may reach.
    /// Without it the sandbox has no way out.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network: Option<SandboxNetwork>,
    /// Start `/workspace` from this snapshot (`snap-...`): its files are there, owned by the sandbox's root, and
    /// nothing is copied; without `workspaceRequirements.baseImage`, the snapshot's image.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from_snapshot: Option<String>,
}

/// `network` of `POST /sandboxes`: the same shape as an FSP execute's `network` (its field names are snake_case,
/// as there). Each entry (`pypi.org:443`, `*.pythonhosted.org:443`, `api.example.com` for ports 443 and 80) must
/// lie within the operator's `network.allow_max`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SandboxNetwork {
    /// Allowlist entries, at most [`protocol::MAX_NETWORK_ALLOW`]; the list may be empty (nothing is reachable
    /// until `POST /sandboxes/<id>/network` lists something).
    pub allow: Vec<String>,
    /// Bytes the sandbox may exchange with the outside over its whole life (both directions, every run); default
    /// and maximum the daemon's `network.egress_bytes_max`.
    #[serde(
        default,
        alias = "egressBytes",
        skip_serializing_if = "Option::is_none"
    )]
    pub egress_bytes: Option<u64>,
}

/// `POST /sandboxes/<id>/network` (a new allowlist for a sandbox created with `network`), and its answer: the list
/// in force.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SandboxNetworkAllow {
    /// Allowlist entries, as for [`SandboxNetwork::allow`].
    pub allow: Vec<String>,
}

/// `network` of `GET /sandboxes/<id>/health`: the allowlist in force and the sandbox's egress proxy's counters
/// (over every run so far; the field names are those of an FSP result's `network`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SandboxNetworkUsage {
    /// The allowlist in force, as it was given.
    pub allow: Vec<String>,
    /// Connections the sandbox's programs opened to the proxy.
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

/// The answer to `POST /sandboxes` (the agent-plugin design's `ContainerTransport` addresses).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CreateSandboxResponse {
    /// Sandbox id.
    pub id: String,
    /// Base URL of the adapter-shim endpoints.
    pub rpc_endpoint: String,
    /// `ws://.../events`.
    pub event_stream_endpoint: String,
    /// `http://.../health`.
    pub health_endpoint: String,
}

/// The brief an agent is spawned with. sandboxd reads `agentId` and `providerConfig`; every other field is kept
/// as sent and handed to the agent.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AgentBrief {
    /// The agent.
    pub agent_id: String,
    /// Adapter-specific options; `command` (array of strings) selects the agent program.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub provider_config: Option<Map<String, Value>>,
    /// Everything else in the brief.
    #[serde(flatten)]
    pub rest: Map<String, Value>,
}

impl AgentBrief {
    /// `providerConfig.command`, when it is an array of strings.
    pub fn command(&self) -> Option<Vec<String>> {
        let v = self.provider_config.as_ref()?.get("command")?.as_array()?;
        v.iter().map(|s| s.as_str().map(str::to_owned)).collect()
    }
}

/// Status of an agent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AgentStatus {
    /// Running.
    Running,
    /// Frozen by `POST /pause`.
    Paused,
    /// Blocked on a decision.
    WaitingOnHuman,
    /// Ended by itself (exit status 0) or killed.
    Completed,
    /// Crashed; terminal.
    Error,
}

/// The lean handle of a spawned agent.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AgentHandle {
    /// The agent id.
    pub id: String,
    /// `sandboxd`.
    pub plugin_name: String,
    /// Status.
    pub status: AgentStatus,
    /// The run id (one per spawn).
    pub session_id: String,
    /// Brief changes not yet seen by the agent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pending_brief_changes: Option<Value>,
}

/// Why a [`SerializedAgentState`] was made.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SerializedBy {
    /// `POST /pause`.
    Pause,
    /// `POST /kill` with grace.
    KillGrace,
    /// After a crash.
    CrashRecovery,
}

/// What is needed to resume an agent. `checkpoint` is opaque to the backend.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SerializedAgentState {
    /// The agent.
    pub agent_id: String,
    /// `sandboxd`.
    pub plugin_name: String,
    /// The run id.
    pub session_id: String,
    /// Adapter-specific checkpoint.
    pub checkpoint: Value,
    /// The brief the agent runs with (updates applied).
    pub brief_snapshot: Value,
    /// Compressed conversation history, if the agent gave one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub conversation_summary: Option<String>,
    /// Decisions the agent is blocked on.
    pub pending_decision_ids: Vec<String>,
    /// Last `sourceSequence` emitted.
    pub last_sequence: u64,
    /// When (RFC 3339).
    pub serialized_at: String,
    /// Why.
    pub serialized_by: SerializedBy,
    /// Size of this state as JSON, bytes.
    pub estimated_size_bytes: u64,
}

/// `POST /kill`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct KillRequest {
    /// Let the agent shut down (and upload artifacts) before it is killed.
    #[serde(default = "default_true")]
    pub grace: bool,
    /// The grace period; default [`DEFAULT_GRACE_TIMEOUT_MS`]. Ignored without grace.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub grace_timeout_ms: Option<u64>,
}

fn default_true() -> bool {
    true
}

impl Default for KillRequest {
    fn default() -> Self {
        Self {
            grace: true,
            grace_timeout_ms: None,
        }
    }
}

/// The answer to `POST /kill`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct KillResponse {
    /// The agent's state, when it gave one during the grace period.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state: Option<SerializedAgentState>,
    /// Artifacts uploaded during the grace period.
    pub artifacts_extracted: u64,
    /// The agent exited by itself with status 0 within the grace period.
    pub clean_shutdown: bool,
}

/// `POST /resolve`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ResolveRequest {
    /// The decision (from a `DecisionEvent`).
    pub decision_id: String,
    /// The agent-plugin design's `Resolution`, forwarded as is.
    pub resolution: Map<String, Value>,
}

/// Priority of a context injection.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum InjectionPriority {
    /// Always delivered.
    Required,
    /// Dropped when over budget.
    Recommended,
    /// Dropped first.
    Supplementary,
}

/// Format of injected content.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum InjectionFormat {
    /// Markdown.
    Markdown,
    /// JSON.
    Json,
    /// Plain text.
    Plain,
}

/// `POST /inject-context`: the agent-plugin design's `ContextInjection`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ContextInjection {
    /// The content.
    pub content: String,
    /// Its format.
    pub format: InjectionFormat,
    /// Knowledge store version.
    pub snapshot_version: u64,
    /// Estimated tokens.
    pub estimated_tokens: u64,
    /// Priority.
    pub priority: InjectionPriority,
}

/// `POST /update-brief`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct UpdateBriefRequest {
    /// A partial `AgentBrief`.
    pub changes: Map<String, Value>,
}

/// One event on `WS /events` and in `POST /replay`: source identity stamped by sandboxd plus the agent's payload.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AdapterEvent {
    /// UUID v7.
    pub source_event_id: String,
    /// Monotonic per sandbox, from 1.
    pub source_sequence: u64,
    /// When sandboxd read the event from the agent (RFC 3339).
    pub source_occurred_at: String,
    /// The run (spawn) that produced it.
    pub run_id: String,
    /// The `AgentEvent`.
    pub event: Map<String, Value>,
}

/// The `AgentEvent` types of the agent-plugin design. `lifecycle` events are sandboxd's own: the daemon refuses
/// one from an agent's control line, as it refuses an error event with one of [`error_codes::RESERVED`].
pub const EVENT_TYPES: &[&str] = &[
    "status",
    "decision",
    "artifact",
    "coherence",
    "tool_call",
    "completion",
    "error",
    "delegation",
    "guardrail",
    "lifecycle",
    "progress",
    "raw_provider",
];

/// Event types dropped first when a gateway does not keep up (observability only; nothing waits on them).
pub const LOW_PRIORITY_TYPES: &[&str] = &["status", "progress", "tool_call", "raw_provider"];

/// Whether an event payload may be dropped first under backpressure.
pub fn is_low_priority(event: &Map<String, Value>) -> bool {
    event
        .get("type")
        .and_then(Value::as_str)
        .is_some_and(|t| LOW_PRIORITY_TYPES.contains(&t))
}

/// Checks an agent-written event payload: an object with a known `type` and a string `agentId`.
pub fn validate_event(event: &Map<String, Value>) -> Result<(), String> {
    let Some(t) = event.get("type").and_then(Value::as_str) else {
        return Err("the event has no string \"type\"".into());
    };
    if !EVENT_TYPES.contains(&t) {
        return Err(format!("unknown event type {t:?}"));
    }
    if !event.get("agentId").is_some_and(Value::is_string) {
        return Err("the event has no string \"agentId\"".into());
    }
    Ok(())
}

/// A `LifecycleEvent` payload.
pub fn lifecycle_event(agent_id: &str, action: &str, reason: Option<&str>) -> Map<String, Value> {
    let mut m = Map::new();
    m.insert("type".into(), "lifecycle".into());
    m.insert("agentId".into(), agent_id.into());
    m.insert("action".into(), action.into());
    if let Some(r) = reason {
        m.insert("reason".into(), r.into());
    }
    m
}

/// An `ErrorEvent` payload.
pub fn error_event(
    agent_id: &str,
    severity: &str,
    message: &str,
    recoverable: bool,
    error_code: Option<&str>,
    category: &str,
) -> Map<String, Value> {
    let mut m = Map::new();
    m.insert("type".into(), "error".into());
    m.insert("agentId".into(), agent_id.into());
    m.insert("severity".into(), severity.into());
    m.insert("message".into(), message.into());
    m.insert("recoverable".into(), recoverable.into());
    if let Some(c) = error_code {
        m.insert("errorCode".into(), c.into());
    }
    m.insert("category".into(), category.into());
    m
}

/// An inclusive range of sequences.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SequenceRange {
    /// First sequence.
    pub from_sequence: u64,
    /// Last sequence (inclusive).
    pub to_sequence: u64,
}

/// `POST /replay`: an inclusive range.
pub type ReplayRequest = SequenceRange;

/// The answer to `POST /replay`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ReplayResponse {
    /// The events of the range still in the log, in order, exactly as first emitted.
    pub events: Vec<AdapterEvent>,
    /// The part of the range evicted from the log (unrecoverable), if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub evicted: Option<SequenceRange>,
    /// The last sequence emitted so far (a range past it is answered up to it).
    pub last_sequence: u64,
}

/// `status` of `GET /health`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum HealthStatus {
    /// All well.
    Healthy,
    /// Working, with a problem (events being dropped, usage unreadable).
    Degraded,
    /// The agent crashed.
    Unhealthy,
}

/// Resource usage from the sandbox's cgroup and workspace.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SandboxResourceUsage {
    /// CPU use since the previous sample, percent of one core.
    pub cpu_percent: f64,
    /// Memory charged now, MiB.
    pub memory_mb: f64,
    /// `/workspace` and `/tmp` in use, MiB.
    pub disk_mb: f64,
    /// When sampled (RFC 3339).
    pub collected_at: String,
}

/// `GET /health`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SandboxHealthResponse {
    /// Overall status.
    pub status: HealthStatus,
    /// The agent's status (`completed` before the first spawn).
    pub agent_status: AgentStatus,
    /// Time since the sandbox was created.
    pub uptime_ms: u64,
    /// Usage.
    pub resource_usage: SandboxResourceUsage,
    /// Events waiting for a gateway.
    pub pending_event_buffer_size: u64,
    /// The egress proxy, when the sandbox was created with `network`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network: Option<SandboxNetworkUsage>,
}

/// Names of [`PluginCapabilities`] fields, for `capability_unsupported`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PluginCapabilities {
    /// True pause (cgroup freezer).
    pub supports_pause: bool,
    /// Resume continues exactly where it stopped.
    pub supports_resume: bool,
    /// Graceful kill.
    pub supports_kill: bool,
    /// Brief updates reach the running agent.
    pub supports_hot_brief_update: bool,
}

/// What sandboxd offers.
pub const CAPABILITIES: PluginCapabilities = PluginCapabilities {
    supports_pause: true,
    supports_resume: true,
    supports_kill: true,
    supports_hot_brief_update: true,
};

/// Every refusal of the adapter-shim surface, with the agent-plugin design's shapes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, thiserror::Error)]
#[serde(tag = "code", rename_all = "snake_case")]
pub enum PluginError {
    /// The sandbox or agent cannot serve the call now.
    #[error("Provider unavailable: {message}")]
    ProviderUnavailable {
        /// Why.
        message: String,
        /// Worth retrying later.
        retryable: bool,
    },
    /// The call does not fit the sandbox's state (or the request is malformed, unauthorized, unknown).
    #[error("Invalid state: {message}")]
    InvalidState {
        /// Why.
        message: String,
        /// The agent's handle, when there is one.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        handle: Option<Box<AgentHandle>>,
    },
    /// No pending decision with this id.
    #[error("Decision {decision_id} not found")]
    #[serde(rename_all = "camelCase")]
    DecisionNotFound {
        /// The id asked for.
        decision_id: String,
    },
    /// Too many calls.
    #[error("Rate limited; retry after {retry_after_ms} ms")]
    #[serde(rename_all = "camelCase")]
    RateLimited {
        /// When to retry.
        retry_after_ms: u64,
    },
    /// Too large for the agent's context.
    #[error("Context overflow ({current_tokens} of {max_tokens} tokens)")]
    #[serde(rename_all = "camelCase")]
    ContextOverflow {
        /// Tokens now.
        current_tokens: u64,
        /// The maximum.
        max_tokens: u64,
    },
    /// Not offered by this sandbox.
    #[error("Capability {capability} unsupported")]
    CapabilityUnsupported {
        /// The capability.
        capability: String,
    },
}

impl PluginError {
    /// `invalid_state` without a handle.
    pub fn invalid(message: impl Into<String>) -> Self {
        Self::InvalidState {
            message: message.into(),
            handle: None,
        }
    }

    /// The HTTP status sandboxd answers with: 404 `decision_not_found`, 409 `invalid_state`, 429 `rate_limited`,
    /// 413 `context_overflow`, 422 `capability_unsupported`, 503 `provider_unavailable`. Request-level refusals
    /// (malformed JSON, unknown sandbox, bad token) pick their own status with an `invalid_state` body.
    pub fn status(&self) -> u16 {
        match self {
            Self::ProviderUnavailable { .. } => 503,
            Self::InvalidState { .. } => 409,
            Self::DecisionNotFound { .. } => 404,
            Self::RateLimited { .. } => 429,
            Self::ContextOverflow { .. } => 413,
            Self::CapabilityUnsupported { .. } => 422,
        }
    }

    /// Whether a retry may succeed.
    pub fn retryable(&self) -> bool {
        match self {
            Self::ProviderUnavailable { retryable, .. } => *retryable,
            Self::RateLimited { .. } => true,
            _ => false,
        }
    }
}

/// A control-channel line from sandboxd to the agent.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum AgentCommand {
    /// The first line after the agent connects: its brief.
    #[serde(rename_all = "camelCase")]
    Brief {
        /// The brief.
        brief: AgentBrief,
        /// This run's id.
        run_id: String,
        /// The sandbox id.
        sandbox_id: String,
        /// The agent's checkpoint when the run resumes a stored state (`POST /resume` with no agent running).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        resume: Option<Value>,
    },
    /// A decision was resolved.
    #[serde(rename_all = "camelCase")]
    Resolve {
        /// The decision.
        decision_id: String,
        /// The resolution.
        resolution: Map<String, Value>,
    },
    /// New context.
    InjectContext {
        /// The injection.
        injection: ContextInjection,
    },
    /// Brief changes.
    UpdateBrief {
        /// A partial brief.
        changes: Map<String, Value>,
    },
    /// Shut down within the grace period; the agent may answer with an [`AgentLine::State`] first.
    #[serde(rename_all = "camelCase")]
    Shutdown {
        /// Milliseconds until SIGKILL.
        grace_timeout_ms: u64,
    },
}

/// A control-channel line from the agent: an `AgentEvent` payload, or its state during a graceful shutdown.
#[derive(Debug, Clone, PartialEq)]
pub enum AgentLine {
    /// An event payload (validated by [`validate_event`]).
    Event(Map<String, Value>),
    /// `{"type":"state","state":{...}}`: the agent's checkpoint (the `checkpoint` of its
    /// [`SerializedAgentState`]), plus an optional conversation summary.
    State {
        /// Opaque checkpoint.
        checkpoint: Value,
        /// Optional summary.
        conversation_summary: Option<String>,
    },
}

/// Parses one line the agent wrote.
pub fn parse_agent_line(line: &[u8]) -> Result<AgentLine, String> {
    let v: Value = serde_json::from_slice(line).map_err(|e| format!("not JSON: {e}"))?;
    let Value::Object(mut m) = v else {
        return Err("not a JSON object".into());
    };
    if m.get("type").and_then(Value::as_str) == Some("state") {
        let checkpoint = m.remove("state").unwrap_or(Value::Null);
        let conversation_summary = m
            .get("conversationSummary")
            .and_then(Value::as_str)
            .map(str::to_owned);
        return Ok(AgentLine::State {
            checkpoint,
            conversation_summary,
        });
    }
    validate_event(&m)?;
    Ok(AgentLine::Event(m))
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn plugin_errors_have_the_design_shapes() {
        let cases = [
            (
                PluginError::ProviderUnavailable {
                    message: "m".into(),
                    retryable: true,
                },
                json!({"code":"provider_unavailable","message":"m","retryable":true}),
            ),
            (
                PluginError::invalid("m"),
                json!({"code":"invalid_state","message":"m"}),
            ),
            (
                PluginError::DecisionNotFound {
                    decision_id: "d1".into(),
                },
                json!({"code":"decision_not_found","decisionId":"d1"}),
            ),
            (
                PluginError::RateLimited { retry_after_ms: 5 },
                json!({"code":"rate_limited","retryAfterMs":5}),
            ),
            (
                PluginError::ContextOverflow {
                    current_tokens: 1,
                    max_tokens: 2,
                },
                json!({"code":"context_overflow","currentTokens":1,"maxTokens":2}),
            ),
            (
                PluginError::CapabilityUnsupported {
                    capability: "gpu".into(),
                },
                json!({"code":"capability_unsupported","capability":"gpu"}),
            ),
        ];
        for (e, want) in cases {
            assert_eq!(serde_json::to_value(&e).unwrap(), want);
            assert_eq!(serde_json::from_value::<PluginError>(want).unwrap(), e);
        }
    }

    #[test]
    fn workspace_requirements_from_the_design() {
        let w: WorkspaceRequirements = serde_json::from_value(json!({
            "mounts": [{"hostPath": "./src", "sandboxPath": "/workspace/src", "readOnly": true},
                       {"volume": "vol-1", "path": "/workspace/data"}],
            "capabilities": ["terminal", "git", "network_internal_only"],
            "resourceLimits": {"cpuCores": 2, "memoryMb": 4096, "diskMb": 10240, "timeoutMs": 3600000},
            "baseImage": "project-tab/sandbox-python:latest"
        }))
        .unwrap();
        assert_eq!(w.mounts[0].sandbox_path, "/workspace/src");
        assert!(w.mounts[0].read_only);
        assert_eq!(w.mounts[1].volume.as_deref(), Some("vol-1"));
        assert_eq!(w.mounts[1].sandbox_path, "/workspace/data");
        assert!(!w.mounts[1].read_only);
        assert_eq!(
            w.capabilities,
            [
                SandboxCapability::Terminal,
                SandboxCapability::Git,
                SandboxCapability::NetworkInternalOnly
            ]
        );
        let l = w.resource_limits.unwrap();
        assert_eq!(
            (l.cpu_cores, l.memory_mb, l.disk_mb, l.timeout_ms),
            (Some(2.0), Some(4096), Some(10240), Some(3_600_000))
        );
        assert!(serde_json::from_value::<WorkspaceRequirements>(
            json!({"capabilities":["teleport"]})
        )
        .is_err());
        assert!(serde_json::from_value::<WorkspaceRequirements>(json!({"extra":1})).is_err());
    }

    #[test]
    fn bootstrap_never_shows_its_token() {
        let b: SandboxBootstrap = serde_json::from_value(json!({
            "backendUrl": "https://backend.internal:3000",
            "backendToken": "secret-jwt",
            "tokenExpiresAt": "2026-01-01T00:00:00Z",
            "agentId": "a1",
            "artifactUploadEndpoint": "https://backend.internal:3000/api/artifacts"
        }))
        .unwrap();
        assert!(!format!("{b:?}").contains("secret-jwt"));
        assert_eq!(b.agent_id, "a1");
    }

    #[test]
    fn kill_request_defaults_to_grace() {
        let k: KillRequest = serde_json::from_value(json!({})).unwrap();
        assert_eq!(k, KillRequest::default());
        assert!(k.grace);
        let k: KillRequest = serde_json::from_value(json!({"grace": false})).unwrap();
        assert!(!k.grace);
        let r = KillResponse {
            state: None,
            artifacts_extracted: 2,
            clean_shutdown: true,
        };
        assert_eq!(
            serde_json::to_value(r).unwrap(),
            json!({"artifactsExtracted":2,"cleanShutdown":true})
        );
    }

    /// Found by fuzzing (fuzz/ target `agent_request_body`): a brief's number came back one bit off after a
    /// re-encode (serde_json's fast float parsing), so the brief handed to the agent was not the one sent.
    #[test]
    fn brief_numbers_survive_a_round_trip() {
        let body = r#"{"agentId":"a1","workstream":1088888888888888888888888888888888888888888888888888888824}"#;
        let b: AgentBrief = serde_json::from_str(body).unwrap();
        let again: AgentBrief = serde_json::from_str(&serde_json::to_string(&b).unwrap()).unwrap();
        assert_eq!(again, b);
    }

    #[test]
    fn brief_keeps_unknown_fields_and_reads_the_command() {
        let b: AgentBrief = serde_json::from_value(json!({
            "agentId": "a1", "role": "Research Agent", "workstream": "w",
            "providerConfig": {"command": ["/usr/bin/python3", "/workspace/agent.py"]}
        }))
        .unwrap();
        assert_eq!(b.command().unwrap()[1], "/workspace/agent.py");
        let back = serde_json::to_value(&b).unwrap();
        assert_eq!(back["role"], "Research Agent");
        assert!(serde_json::from_value::<AgentBrief>(json!({"role": "x"})).is_err());
    }

    #[test]
    fn adapter_event_and_handle_field_names() {
        let e = AdapterEvent {
            source_event_id: "0190-...".into(),
            source_sequence: 42,
            source_occurred_at: "2026-01-01T00:00:00.000Z".into(),
            run_id: "r1".into(),
            event: lifecycle_event("a1", "crashed", Some("exit 137")),
        };
        let v = serde_json::to_value(&e).unwrap();
        for k in [
            "sourceEventId",
            "sourceSequence",
            "sourceOccurredAt",
            "runId",
            "event",
        ] {
            assert!(v.get(k).is_some(), "{k}");
        }
        assert_eq!(v["event"]["action"], "crashed");
        let h = AgentHandle {
            id: "a1".into(),
            plugin_name: "sandboxd".into(),
            status: AgentStatus::WaitingOnHuman,
            session_id: "r1".into(),
            pending_brief_changes: None,
        };
        assert_eq!(
            serde_json::to_value(h).unwrap(),
            json!({"id":"a1","pluginName":"sandboxd","status":"waiting_on_human","sessionId":"r1"})
        );
    }

    #[test]
    fn replay_answer_names_the_evicted_range() {
        let r = ReplayResponse {
            events: vec![],
            evicted: Some(SequenceRange {
                from_sequence: 1,
                to_sequence: 10,
            }),
            last_sequence: 20,
        };
        assert_eq!(
            serde_json::to_value(r).unwrap(),
            json!({"events":[],"evicted":{"fromSequence":1,"toSequence":10},"lastSequence":20})
        );
        let q: ReplayRequest =
            serde_json::from_value(json!({"fromSequence": 3, "toSequence": 4})).unwrap();
        assert_eq!(q.to_sequence, 4);
    }

    #[test]
    fn agent_lines_are_validated() {
        assert!(matches!(
            parse_agent_line(br#"{"type":"status","agentId":"a","message":"hi"}"#),
            Ok(AgentLine::Event(_))
        ));
        assert!(matches!(
            parse_agent_line(br#"{"type":"state","state":{"pos":3}}"#),
            Ok(AgentLine::State { .. })
        ));
        for bad in [
            &b"nope"[..],
            b"[]",
            br#"{"type":"teleport","agentId":"a"}"#,
            br#"{"type":"status"}"#,
        ] {
            assert!(parse_agent_line(bad).is_err());
        }
        assert!(!is_low_priority(&lifecycle_event("a", "x", None)));
        let cmd = AgentCommand::Shutdown {
            grace_timeout_ms: 5,
        };
        assert_eq!(
            serde_json::to_value(cmd).unwrap(),
            json!({"type":"shutdown","graceTimeoutMs":5})
        );
    }
}

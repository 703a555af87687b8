//! Client → server messages (`execute`, `cancel`, `ping`) and the parser that refuses bad ones (spec sections 2
//! and 3).
//!
//! [`parse_client_message`] checks a frame in a fixed order, so the answer to a bad frame is predictable:
//!
//! 1. JSON and an object, else `INVALID_REQUEST` without `id`.
//! 2. A usable `id` (a string matching `^[A-Za-z0-9_.:-]{1,128}$`) is noted; every later error echoes it.
//! 3. `v`: present, an integer, and one of [`SUPPORTED_VERSIONS`] (errors list `supported_versions`).
//! 4. `type`: `execute`, `cancel`, `ping` or `tool_result`.
//! 5. `id` is required and must be usable on `execute`, `cancel` and `tool_result`.
//! 6. `ts`: a string. Its format is not checked: the spec's own examples use `"..."`.
//! 7. The body. `execute` and `tool_result` refuse unknown fields at every level; `cancel` and `ping` ignore them. Errors name the
//!    field path, e.g. `limits.timeout_ms`.
//! 8. `execute` only: the language (`LANGUAGE_NOT_SUPPORTED` for a name FSP/1 does not know), then
//!    [`ExecuteRequest::validate`].

use std::collections::BTreeMap;

use base64::engine::general_purpose::STANDARD;
use base64::Engine;
use serde::{Deserialize, Serialize, Serializer};
use serde_json::{Map, Value};

use crate::envelope::{is_valid_id, now_ts, MAX_ID_LEN, PROTOCOL_VERSION, SUPPORTED_VERSIONS};
use crate::error::RequestError;
use crate::language::Language;
use crate::limits::{Limits, RequestedLimits};
use crate::tools::{check_tools, ToolResult, ToolSpec, DEFAULT_TOOL_TIMEOUT_MS};
use crate::validate::{paths_overlap, validate_env_var, validate_relative_path};

/// The longest artifact type name, in bytes.
const MAX_ARTIFACT_TYPE_LEN: usize = 64;

/// A message a client sends.
///
/// Serializes to the wire form, with `v` and `type`: `{"v":1,"type":"execute","id":..,"ts":..,...}`.
#[derive(Debug, Clone, PartialEq, Eq)]
#[allow(
    clippy::large_enum_variant,
    reason = "one message per frame, matched at once; boxing would only complicate the daemon's match"
)]
pub enum ClientMessage {
    /// `execute`: run code.
    Execute(ExecuteRequest),
    /// `cancel`: kill a running execution.
    Cancel(CancelRequest),
    /// `ping`: ask for a `pong`.
    Ping(PingRequest),
    /// `tool_result`: the answer to a `tool_call` (extension `tool_calls`).
    ToolResult(ToolResult),
}

impl ClientMessage {
    /// The wire `type`.
    pub const fn type_name(&self) -> &'static str {
        match self {
            ClientMessage::Execute(_) => "execute",
            ClientMessage::Cancel(_) => "cancel",
            ClientMessage::Ping(_) => "ping",
            ClientMessage::ToolResult(_) => "tool_result",
        }
    }

    /// The execution id, for `execute` and `cancel`.
    pub fn id(&self) -> Option<&str> {
        match self {
            ClientMessage::Execute(req) => Some(&req.id),
            ClientMessage::Cancel(req) => Some(&req.id),
            ClientMessage::Ping(_) => None,
            ClientMessage::ToolResult(res) => Some(&res.id),
        }
    }

    /// The client's `ts`, unchecked.
    pub fn ts(&self) -> &str {
        match self {
            ClientMessage::Execute(req) => &req.ts,
            ClientMessage::Cancel(req) => &req.ts,
            ClientMessage::Ping(req) => &req.ts,
            ClientMessage::ToolResult(res) => &res.ts,
        }
    }
}

/// The wire form of a client message: the envelope, then the message's own fields.
#[derive(Serialize)]
struct Wire<'a, T> {
    v: u64,
    #[serde(rename = "type")]
    kind: &'static str,
    #[serde(flatten)]
    body: &'a T,
}

impl Serialize for ClientMessage {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let (v, kind) = (PROTOCOL_VERSION, self.type_name());
        match self {
            ClientMessage::Execute(body) => Wire { v, kind, body }.serialize(serializer),
            ClientMessage::Cancel(body) => Wire { v, kind, body }.serialize(serializer),
            ClientMessage::Ping(body) => Wire { v, kind, body }.serialize(serializer),
            ClientMessage::ToolResult(body) => Wire { v, kind, body }.serialize(serializer),
        }
    }
}

/// `execute`: run `code` in a fresh sandbox.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ExecuteRequest {
    /// Execution id, chosen by the client.
    pub id: String,
    /// The client's timestamp, unchecked.
    pub ts: String,
    /// The language to run `code` as.
    pub language: Language,
    /// The program text. No NUL bytes.
    pub code: String,
    /// Written to the program's stdin, which is then closed. `None`: empty stdin.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stdin: Option<String>,
    /// Extra environment variables.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub env: BTreeMap<String, String>,
    /// Requested limits; see [`RequestedLimits::resolve`].
    pub limits: RequestedLimits,
    /// Files placed in the working directory before the program starts (sandboxd addition).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub files: Vec<FileSpec>,
    /// Files to collect after the program ends (sandboxd addition).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub artifacts: Option<ArtifactsRequest>,
    /// Tools the code may call (extension `tool_calls`; python and javascript).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub tools: Vec<ToolSpec>,
    /// How long one tool call may wait for its `tool_result`; only with `tools`. Default
    /// [`DEFAULT_TOOL_TIMEOUT_MS`](crate::tools::DEFAULT_TOOL_TIMEOUT_MS), at most the server's maximum.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_timeout_ms: Option<u64>,
    /// `false`: run the code in a freshly started interpreter, never in one started ahead of time (sandboxd
    /// addition; `None` and `true`: the server's choice).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub warm: Option<bool>,
    /// The caller's span as a W3C `traceparent` (`00-<trace id>-<span id>-<flags>`, sandboxd addition): the
    /// server's spans for this execution become its children.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub traceparent: Option<String>,
    /// Egress through the server's proxy (extension `network`); `None`: no network, as always.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub network: Option<NetworkRequest>,
    /// Volumes of the server's mounted under the working directory (extension `volumes`).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub mounts: Vec<MountRequest>,
    /// A snapshot of an agent sandbox's workspace (`POST /sandboxes/<id>/snapshot`) the working directory starts
    /// from (extension `snapshots`): its files are there, nothing is copied, and what the program changes never
    /// reaches the snapshot.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub snapshot: Option<String>,
}

/// The most volumes one execution may mount.
pub const MAX_MOUNTS: usize = 8;

/// `execute.mounts[]` (extension `volumes`): a volume (`POST /volumes`) mounted at `path`, under `/workspace`;
/// read-write by one holder at a time (an execution or an agent sandbox), read-only by any number.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MountRequest {
    /// The volume's id.
    pub volume: String,
    /// Where: `/workspace/<relative path>`.
    pub path: String,
    /// Mounted read-only.
    #[serde(default)]
    pub read_only: bool,
}

impl MountRequest {
    /// `path` relative to `/workspace`.
    pub fn relative(&self) -> &str {
        self.path.strip_prefix("/workspace/").unwrap_or_default()
    }
}

/// Checks `mounts`: at most [`MAX_MOUNTS`], each a volume id and a path under `/workspace` (not `/workspace`
/// itself), no volume twice, none inside another, no input file inside one.
fn check_mounts(mounts: &[MountRequest], files: &[FileSpec]) -> Result<(), String> {
    if mounts.len() > MAX_MOUNTS {
        return Err(format!("Field mounts: at most {MAX_MOUNTS} volumes"));
    }
    for (i, m) in mounts.iter().enumerate() {
        if m.volume.is_empty() || m.volume.len() > 64 || m.volume.contains('/') {
            return Err(format!("Field mounts[{i}].volume: not a volume id"));
        }
        let rel = m.path.strip_prefix("/workspace/").ok_or_else(|| {
            format!(
                "Field mounts[{i}].path: {:?} is not under /workspace",
                m.path
            )
        })?;
        validate_relative_path(rel).map_err(|e| format!("Field mounts[{i}].path: {e}"))?;
        for (j, other) in mounts[..i].iter().enumerate() {
            if other.volume == m.volume || paths_overlap(rel, other.relative()) {
                return Err(format!("Field mounts[{i}]: overlaps mounts[{j}]"));
            }
        }
        if let Some(f) = files.iter().find(|f| paths_overlap(&f.path, rel)) {
            return Err(format!(
                "Field files: {} lies in the volume mounted at {}",
                f.path, m.path
            ));
        }
    }
    Ok(())
}

/// The most entries `network.allow` may list.
pub const MAX_NETWORK_ALLOW: usize = 64;

/// `execute.network` (extension `network`): which hosts the program may reach through the server's egress proxy.
///
/// Entries are host names, never IP literals: `pypi.org:443`, `*.pythonhosted.org:443`, `api.example.com` (no
/// port: 443 and 80). The server checks each against its operator bound and refuses the request when one is not
/// covered. The program reaches the proxy through `HTTP_PROXY`/`HTTPS_PROXY`; it has no other route out.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NetworkRequest {
    /// Allowlist entries, 1 to [`MAX_NETWORK_ALLOW`].
    pub allow: Vec<String>,
    /// Bytes exchanged with the outside (both directions) after which the proxy closes every connection and
    /// refuses new ones; default and maximum the server's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub egress_bytes: Option<u64>,
}

impl NetworkRequest {
    /// A request allowing these entries, with the server's byte limit.
    pub fn allow<S: Into<String>>(entries: impl IntoIterator<Item = S>) -> NetworkRequest {
        NetworkRequest {
            allow: entries.into_iter().map(Into::into).collect(),
            egress_bytes: None,
        }
    }

    fn check(&self) -> Result<(), String> {
        if self.allow.is_empty() || self.allow.len() > MAX_NETWORK_ALLOW {
            return Err(format!(
                "Field network.allow: {} entries; 1 to {MAX_NETWORK_ALLOW} are allowed",
                self.allow.len()
            ));
        }
        if let Some(bad) = self.allow.iter().find(|e| {
            e.is_empty() || e.len() > 260 || e.chars().any(|c| c.is_whitespace() || c.is_control())
        }) {
            return Err(format!(
                "Field network.allow: {:?} is not a host name entry",
                bad.chars().take(64).collect::<String>()
            ));
        }
        if self.egress_bytes == Some(0) {
            return Err("Field network.egress_bytes: must be at least 1".to_owned());
        }
        Ok(())
    }
}

impl ExecuteRequest {
    /// A request stamped now, with no stdin, environment, files or artifacts.
    pub fn new(
        id: impl Into<String>,
        language: Language,
        code: impl Into<String>,
        limits: RequestedLimits,
    ) -> Self {
        ExecuteRequest {
            id: id.into(),
            ts: now_ts(),
            language,
            code: code.into(),
            stdin: None,
            env: BTreeMap::new(),
            limits,
            files: Vec::new(),
            artifacts: None,
            tools: Vec::new(),
            tool_timeout_ms: None,
            warm: None,
            network: None,
            traceparent: None,
            mounts: Vec::new(),
            snapshot: None,
        }
    }

    /// Checks what the types alone do not: a usable id, no NUL in `code`, environment variables `execve` can
    /// take, file paths that stay inside the working directory (no duplicates, no file that is also a directory
    /// of another), decodable contents, and artifact globs that stay inside the working directory.
    ///
    /// [`parse_client_message`] calls it; a client may call it before sending.
    pub fn validate(&self) -> Result<(), RequestError> {
        if !is_valid_id(&self.id) {
            return Err(RequestError::invalid(None, invalid_id_message()));
        }
        let fail = |message: String| Err(RequestError::invalid(Some(self.id.clone()), message));
        if self.code.contains('\0') {
            return fail("Field code must not contain a NUL byte".to_owned());
        }
        for (key, value) in &self.env {
            if let Err(e) = validate_env_var(key, value) {
                return fail(format!(
                    "Field env.{}: {}",
                    key.escape_debug(),
                    lower_first(&e)
                ));
            }
        }
        if let Err(message) = check_files(&self.files) {
            return fail(message);
        }
        if let Some(t) = &self.traceparent {
            if !is_traceparent(t) {
                return fail(format!(
                    "Field traceparent: {:?} is not a W3C traceparent (00-<32 hex>-<16 hex>-<2 hex>, ids not all zero)",
                    t.chars().take(64).collect::<String>()
                ));
            }
        }
        if let Some(artifacts) = &self.artifacts {
            if let Err(message) = artifacts.check() {
                return fail(message);
            }
        }
        if let Err(message) = check_tools(self.language, &self.tools, self.tool_timeout_ms) {
            return fail(message);
        }
        if let Some(Err(message)) = self.network.as_ref().map(NetworkRequest::check) {
            return fail(message);
        }
        if let Err(message) = check_mounts(&self.mounts, &self.files) {
            return fail(message);
        }
        if let Some(s) = &self.snapshot {
            let ok = !s.is_empty()
                && s.len() <= 128
                && s.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
            if !ok {
                return fail("Field snapshot: not a snapshot id".into());
            }
            if !self.mounts.is_empty() {
                return fail("Field mounts: not with snapshot".into());
            }
        }
        Ok(())
    }

    /// The per-call tool timeout in effect: `tool_timeout_ms` or the default (capped by `max`), refused above
    /// `max` (never clamped).
    pub fn resolve_tool_timeout(&self, max: u64) -> Result<u64, RequestError> {
        match self.tool_timeout_ms {
            Some(ms) if ms > max => Err(RequestError::invalid(
                Some(self.id.clone()),
                format!("Field tool_timeout_ms: {ms} is above the maximum {max}"),
            )),
            Some(ms) => Ok(ms),
            None => Ok(DEFAULT_TOOL_TIMEOUT_MS.min(max)),
        }
    }

    /// [`RequestedLimits::resolve`] against the server's maximums, as an error for this execution.
    pub fn resolve_limits(&self, max: &Limits) -> Result<Limits, RequestError> {
        self.limits
            .resolve(max)
            .map_err(|e| e.into_request_error(&self.id))
    }
}

/// Checks every path of `files`, then that no two files collide.
fn check_files(files: &[FileSpec]) -> Result<(), String> {
    // Path -> index, for files and for the directories they imply.
    let mut file_at: BTreeMap<&str, usize> = BTreeMap::new();
    let mut dir_of: BTreeMap<&str, usize> = BTreeMap::new();
    for (i, file) in files.iter().enumerate() {
        let path = file.path.as_str();
        validate_relative_path(path)
            .map_err(|e| format!("Field files[{i}].path: {}", lower_first(&e)))?;
        if let Some(j) = file_at.get(path) {
            return Err(format!(
                "Field files[{i}].path: duplicate of files[{j}].path {path:?}"
            ));
        }
        if let Some(j) = dir_of.get(path) {
            return Err(format!(
                "Field files[{i}].path: {path:?} is a directory of files[{j}].path {:?}",
                files[*j].path
            ));
        }
        for (end, _) in path.match_indices('/') {
            let parent = &path[..end];
            if let Some(j) = file_at.get(parent) {
                return Err(format!(
                    "Field files[{i}].path: {path:?} needs directory {parent:?}, which is files[{j}].path"
                ));
            }
            dir_of.entry(parent).or_insert(i);
        }
        if let Err(e) = file.decoded() {
            return Err(format!(
                "Field files[{i}].content: {}: {}",
                lower_first(&e),
                e.0
            ));
        }
        file_at.insert(path, i);
    }
    Ok(())
}

/// How a [`FileSpec`]'s `content` is encoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FileEncoding {
    /// `content` is the file's text.
    #[default]
    Utf8,
    /// `content` is the standard base64 (with padding) of the file's bytes.
    Base64,
}

/// A file to place in the working directory before the program starts. Unknown fields are refused.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, expecting = "a file object")]
pub struct FileSpec {
    /// Path relative to the working directory; see [`validate_relative_path`].
    pub path: String,
    /// The content, encoded as [`encoding`](Self::encoding) says.
    pub content: String,
    /// Encoding of `content`; default `utf8`.
    #[serde(default)]
    pub encoding: FileEncoding,
}

impl FileSpec {
    /// The file's bytes.
    pub fn decoded(&self) -> Result<Vec<u8>, FileContentError> {
        match self.encoding {
            FileEncoding::Utf8 => Ok(self.content.as_bytes().to_vec()),
            FileEncoding::Base64 => STANDARD.decode(&self.content).map_err(FileContentError),
        }
    }
}

/// A `base64` file content that does not decode.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("Content is not valid base64")]
pub struct FileContentError(#[source] pub base64::DecodeError);

/// `artifacts`: files to collect after the program ends (see `artifact-manifest.md`). Unknown fields are refused.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, expecting = "an artifacts object")]
pub struct ArtifactsRequest {
    /// Glob patterns relative to the working directory, e.g. `out/**`.
    pub paths: Vec<String>,
    /// Artifact type per glob (a key of this map must be one of `paths`); default `file`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub types: Option<BTreeMap<String, String>>,
}

impl ArtifactsRequest {
    fn check(&self) -> Result<(), String> {
        for (i, glob) in self.paths.iter().enumerate() {
            validate_relative_path(glob)
                .map_err(|e| format!("Field artifacts.paths[{i}]: {}", lower_first(&e)))?;
        }
        for (glob, kind) in self.types.iter().flatten() {
            if !self.paths.contains(glob) {
                return Err(format!(
                    "Field artifacts.types.{glob}: not one of artifacts.paths"
                ));
            }
            let valid = !kind.is_empty()
                && kind.len() <= MAX_ARTIFACT_TYPE_LEN
                && kind
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'));
            if !valid {
                return Err(format!(
                    "Field artifacts.types.{glob}: type must be 1 to {MAX_ARTIFACT_TYPE_LEN} characters of \
                     [A-Za-z0-9_.-]"
                ));
            }
        }
        Ok(())
    }
}

/// `cancel`: kill the execution `id` and its whole process tree.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct CancelRequest {
    /// The execution to cancel.
    pub id: String,
    /// The client's timestamp, unchecked.
    pub ts: String,
}

impl CancelRequest {
    /// A cancel stamped now.
    pub fn new(id: impl Into<String>) -> Self {
        CancelRequest {
            id: id.into(),
            ts: now_ts(),
        }
    }
}

/// `ping`: asks for a `pong`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PingRequest {
    /// The client's timestamp, unchecked.
    pub ts: String,
}

impl PingRequest {
    /// A ping stamped now.
    pub fn new() -> Self {
        PingRequest { ts: now_ts() }
    }
}

impl Default for PingRequest {
    fn default() -> Self {
        Self::new()
    }
}

/// The fields of `execute` besides the envelope, as they arrive. `language` stays a string here so that an
/// unknown language is told apart from a malformed request.
#[derive(Deserialize)]
#[serde(deny_unknown_fields, expecting = "an execute object")]
struct ExecuteBody {
    language: String,
    code: String,
    #[serde(default)]
    stdin: Option<String>,
    #[serde(default)]
    env: Option<BTreeMap<String, String>>,
    limits: RequestedLimits,
    #[serde(default)]
    files: Option<Vec<FileSpec>>,
    #[serde(default)]
    artifacts: Option<ArtifactsRequest>,
    #[serde(default)]
    tools: Option<Vec<ToolSpec>>,
    #[serde(default)]
    tool_timeout_ms: Option<u64>,
    #[serde(default)]
    warm: Option<bool>,
    traceparent: Option<String>,
    #[serde(default)]
    network: Option<NetworkRequest>,
    #[serde(default)]
    mounts: Option<Vec<MountRequest>>,
    #[serde(default)]
    snapshot: Option<String>,
}

/// The fields of `tool_result` besides the envelope. Unknown fields are refused.
#[derive(Deserialize)]
#[serde(deny_unknown_fields, expecting = "a tool_result object")]
struct ToolResultBody {
    call_id: String,
    ok: bool,
    #[serde(default)]
    result: Option<Value>,
    #[serde(default)]
    error: Option<String>,
}

/// The message types a client may send.
#[derive(Clone, Copy)]
enum Kind {
    Execute,
    Cancel,
    Ping,
    ToolResult,
}

/// Parses one text frame from a client, applying every refusal of spec sections 2 and 3 (see the module docs for
/// the order). Limits are not checked against the server's maximums here: call
/// [`ExecuteRequest::resolve_limits`].
pub fn parse_client_message(text: &str) -> Result<ClientMessage, RequestError> {
    let value: Value = serde_json::from_str(text)
        .map_err(|e| RequestError::invalid(None, format!("Invalid JSON: {e}")))?;
    let mut obj = match value {
        Value::Object(obj) => obj,
        other => {
            return Err(RequestError::invalid(
                None,
                format!("A message must be a JSON object, got {}", json_kind(&other)),
            ))
        }
    };

    let id = obj
        .get("id")
        .and_then(Value::as_str)
        .filter(|id| is_valid_id(id))
        .map(str::to_owned);
    let invalid = |message: String| RequestError::invalid(id.clone(), message);

    match obj.get("v") {
        None => {
            return Err(RequestError::unsupported_version(
                id.clone(),
                "Missing field v",
            ))
        }
        Some(Value::Number(n)) if n.is_u64() || n.is_i64() => {
            let supported = n.as_u64().is_some_and(|v| SUPPORTED_VERSIONS.contains(&v));
            if !supported {
                return Err(RequestError::unsupported_version(
                    id.clone(),
                    format!("Field v: unsupported protocol version {n}; supported versions: {SUPPORTED_VERSIONS:?}"),
                ));
            }
        }
        Some(other) => {
            return Err(RequestError::unsupported_version(
                id.clone(),
                format!("Field v must be an integer, got {}", json_kind(other)),
            ))
        }
    }

    let kind = match obj.get("type") {
        None => return Err(invalid("Missing field type".to_owned())),
        Some(Value::String(kind)) => match kind.as_str() {
            "execute" => Kind::Execute,
            "cancel" => Kind::Cancel,
            "ping" => Kind::Ping,
            "tool_result" => Kind::ToolResult,
            other => {
                return Err(invalid(format!(
                    "Field type: unknown message type {other:?}; expected execute, cancel, ping or tool_result"
                )))
            }
        },
        Some(other) => {
            return Err(invalid(format!(
                "Field type must be a string, got {}",
                json_kind(other)
            )))
        }
    };

    let exec_id = match kind {
        Kind::Execute | Kind::Cancel | Kind::ToolResult => match (&id, obj.get("id")) {
            (Some(id), _) => id.clone(),
            (None, None) => return Err(invalid("Missing field id".to_owned())),
            (None, Some(_)) => return Err(invalid(invalid_id_message())),
        },
        Kind::Ping => String::new(),
    };

    let ts = match obj.get("ts") {
        None => return Err(invalid("Missing field ts".to_owned())),
        Some(Value::String(ts)) => ts.clone(),
        Some(other) => {
            return Err(invalid(format!(
                "Field ts must be a string, got {}",
                json_kind(other)
            )))
        }
    };

    match kind {
        Kind::Execute => {
            for envelope_field in ["v", "type", "id", "ts"] {
                obj.remove(envelope_field);
            }
            parse_execute(obj, exec_id, ts).map(ClientMessage::Execute)
        }
        Kind::Cancel => Ok(ClientMessage::Cancel(CancelRequest { id: exec_id, ts })),
        Kind::Ping => Ok(ClientMessage::Ping(PingRequest { ts })),
        Kind::ToolResult => {
            for envelope_field in ["v", "type", "id", "ts"] {
                obj.remove(envelope_field);
            }
            parse_tool_result(obj, exec_id, ts).map(ClientMessage::ToolResult)
        }
    }
}

/// Parses and checks the body of a `tool_result` whose envelope has been checked and removed.
fn parse_tool_result(
    body: Map<String, Value>,
    id: String,
    ts: String,
) -> Result<ToolResult, RequestError> {
    let body: ToolResultBody =
        serde_path_to_error::deserialize(Value::Object(body)).map_err(|e| {
            RequestError::invalid(
                Some(id.clone()),
                describe_body_error(&e).replace("Invalid execute", "Invalid tool_result"),
            )
        })?;
    let result = ToolResult {
        id,
        ts,
        call_id: body.call_id,
        ok: body.ok,
        result: body.result,
        error: body.error,
    };
    result
        .check()
        .map_err(|m| RequestError::invalid(Some(result.id.clone()), m))?;
    Ok(result)
}

/// Parses and validates the body of an `execute` whose envelope has been checked and removed.
fn parse_execute(
    body: Map<String, Value>,
    id: String,
    ts: String,
) -> Result<ExecuteRequest, RequestError> {
    let body: ExecuteBody = serde_path_to_error::deserialize(Value::Object(body))
        .map_err(|e| RequestError::invalid(Some(id.clone()), describe_body_error(&e)))?;
    let language = match body.language.parse::<Language>() {
        Ok(language) => language,
        Err(_) => return Err(RequestError::language_not_supported(&id, &body.language)),
    };
    let request = ExecuteRequest {
        id,
        ts,
        language,
        code: body.code,
        stdin: body.stdin,
        env: body.env.unwrap_or_default(),
        limits: body.limits,
        files: body.files.unwrap_or_default(),
        artifacts: body.artifacts,
        tools: body.tools.unwrap_or_default(),
        tool_timeout_ms: body.tool_timeout_ms,
        warm: body.warm,
        traceparent: body.traceparent,
        network: body.network,
        mounts: body.mounts.unwrap_or_default(),
        snapshot: body.snapshot,
    };
    request.validate()?;
    Ok(request)
}

/// A W3C trace-context `traceparent` of version 00: `00-<trace id: 32 lowercase hex>-<parent id: 16>-<flags: 2>`,
/// neither id all zeros.
pub fn is_traceparent(t: &str) -> bool {
    let parts: Vec<&str> = t.split('-').collect();
    let hex = |s: &str, n: usize| {
        s.len() == n
            && s.bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    };
    let nonzero = |s: &str| s.bytes().any(|b| b != b'0');
    matches!(parts[..], [v, trace, parent, flags]
        if v == "00" && hex(trace, 32) && hex(parent, 16) && hex(flags, 2) && nonzero(trace) && nonzero(parent))
}

/// A message naming the field a deserialization error is about, e.g. `Missing field limits.timeout_ms` or
/// `Field limits.timeout_ms: invalid type: string "x", expected u64`.
fn describe_body_error(err: &serde_path_to_error::Error<serde_json::Error>) -> String {
    let path = err.path().to_string();
    let inner = err.inner().to_string();
    let prefix = if path == "." {
        String::new()
    } else {
        format!("{path}.")
    };
    if let Some(field) = inner
        .strip_prefix("missing field `")
        .and_then(|rest| rest.strip_suffix('`'))
    {
        return format!("Missing field {prefix}{field}");
    }
    // The path of an unknown field already ends with the field itself.
    if let Some((_, expected)) = inner
        .strip_prefix("unknown field `")
        .and_then(|rest| rest.split_once("`, "))
    {
        return format!("Unknown field {path}; {}", expected.replace('`', ""));
    }
    if path == "." {
        format!("Invalid execute: {inner}")
    } else {
        format!("Field {path}: {inner}")
    }
}

/// An error's message for use after a colon: `Path is empty` becomes `path is empty`.
fn lower_first(err: &dyn std::fmt::Display) -> String {
    let text = err.to_string();
    let mut chars = text.chars();
    match chars.next() {
        Some(first) => first.to_lowercase().chain(chars).collect(),
        None => text,
    }
}

fn invalid_id_message() -> String {
    format!("Field id must be a string of 1 to {MAX_ID_LEN} characters of [A-Za-z0-9_.:-]")
}

/// How a JSON value is described in error messages.
fn json_kind(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

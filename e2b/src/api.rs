//! The control plane: E2B's REST API on `X-API-KEY` (`POST /v2/sandboxes`, `GET /sandboxes/{id}`, `GET
//! /v2/sandboxes`, kill, timeout, connect, pause, resume, metrics), answered from the [`Engine`](crate::engine::Engine).
//!
//! Every error is `{"code":<status>,"message":...}` with `Should-Retry: false`, so the SDK never retries a
//! permanent refusal. E2B features sandboxd does not map (auto-pause, MCP, IAM, volumes, egress deny rules) are
//! refused with 400 naming the field rather than silently ignored.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::body::Body;
use axum::extract::{Path, RawQuery, Request, State};
use axum::http::header::CONTENT_TYPE;
use axum::http::{HeaderValue, Method, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Router};
use serde_json::{json, Map, Value};

use crate::connect::{read_body, BodyError};
use crate::engine::{CreateSpec, EngineError, LiveSandbox, SandboxInfo, SandboxState};
use crate::fleet::{Forwarded, Placement};
pub use crate::listing::{
    list_page, parse_list_query, ListQuery, DEFAULT_LIST_LIMIT, MAX_LIST_LIMIT,
};
use crate::reply::{check_api_key, KeyRefusal};
pub use crate::reply::{error_response, json_response, rfc3339, SHOULD_RETRY};
use crate::Facade;

/// The template of a create request that names none.
pub const DEFAULT_TEMPLATE: &str = "base";

/// A sandbox's lifetime when create names none (the v2 API's default), in seconds.
pub const DEFAULT_TIMEOUT_SECS: u64 = 300;

/// The longest lifetime a request may ask for, in seconds (24 hours, E2B's ceiling).
pub const MAX_TIMEOUT_SECS: u64 = 86_400;

/// The largest control-plane request body, in bytes.
pub const MAX_API_BODY_BYTES: usize = 1 << 20;

/// The `clientID` every answer carries (E2B's field is vestigial; the SDK only requires it).
pub const CLIENT_ID: &str = "sandboxd";

/// Create keys E2B defines that sandboxd does not map: a set value is refused with 400 naming the key.
const UNMAPPED_CREATE_KEYS: &[&str] = &[
    "autoPause",
    "autoPauseMemory",
    "autoResume",
    "mcp",
    "iam",
    "volumeMounts",
];

/// `network` keys E2B defines that sandboxd does not map (besides `allowOut`, which it maps, and
/// `allowPublicTraffic`, which has nothing to govern: the facade publishes no sandbox ports).
const UNMAPPED_NETWORK_KEYS: &[&str] = &["denyOut", "rules", "maskRequestHost"];

/// Why a control-plane call failed; each maps to one status.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// No `X-API-KEY`, or one the daemon does not accept.
    #[error(transparent)]
    Key(#[from] KeyRefusal),
    /// The request is malformed or asks for something out of range.
    #[error("{0}")]
    BadRequest(String),
    /// The request uses an E2B feature sandboxd does not map.
    #[error("{field} is not supported by sandboxd")]
    Unmapped {
        /// The request field, as E2B names it.
        field: String,
    },
    /// `pause` on a paused sandbox.
    #[error("Sandbox {0} is already paused")]
    AlreadyPaused(String),
    /// The legacy `resume` on a running sandbox.
    #[error("Sandbox {0} is already running")]
    AlreadyRunning(String),
    /// A path or method of E2B's API that the facade does not serve.
    #[error("{method} {path} is not supported by sandboxd")]
    NotSupported {
        /// The request's method.
        method: String,
        /// The request's path.
        path: String,
    },
    /// The request body could not be read.
    #[error(transparent)]
    Body(#[from] BodyError),
    /// The engine refused or failed.
    #[error(transparent)]
    Engine(#[from] EngineError),
}

impl ApiError {
    /// The 501 answer to a path or method that is not served.
    pub fn not_supported(method: &Method, path: &str) -> Self {
        ApiError::NotSupported {
            method: method.to_string(),
            path: path.to_owned(),
        }
    }

    /// Its HTTP status.
    pub fn status(&self) -> StatusCode {
        match self {
            ApiError::Key(_) => StatusCode::UNAUTHORIZED,
            ApiError::BadRequest(_) | ApiError::Unmapped { .. } => StatusCode::BAD_REQUEST,
            ApiError::AlreadyPaused(_) | ApiError::AlreadyRunning(_) => StatusCode::CONFLICT,
            ApiError::NotSupported { .. } => StatusCode::NOT_IMPLEMENTED,
            ApiError::Body(BodyError::TooLarge { .. }) => StatusCode::PAYLOAD_TOO_LARGE,
            ApiError::Body(BodyError::Read(_)) => StatusCode::BAD_REQUEST,
            ApiError::Engine(err) => match err {
                EngineError::SandboxNotFound(_) | EngineError::ProcessNotFound(_) => {
                    StatusCode::NOT_FOUND
                }
                EngineError::Invalid(_) => StatusCode::BAD_REQUEST,
                EngineError::Paused(_) => StatusCode::CONFLICT,
                EngineError::Full(_) => StatusCode::TOO_MANY_REQUESTS,
                EngineError::Start(_) | EngineError::Internal(_) => {
                    StatusCode::INTERNAL_SERVER_ERROR
                }
            },
        }
    }
}

/// `{"code":<status>,"message":...}` with `Should-Retry: false`.
impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = self.status();
        error_response(status, &self.to_string())
    }
}

/// The control plane's routes, behind the `X-API-KEY` check.
pub fn routes(facade: Facade) -> Router<Facade> {
    Router::new()
        .route("/v2/sandboxes", post(create).get(list))
        .route("/sandboxes/{id}", get(info).delete(kill))
        .route("/sandboxes/{id}/timeout", post(set_timeout))
        .route("/v2/sandboxes/{id}/connect", post(connect))
        .route("/sandboxes/{id}/pause", post(pause))
        .route("/sandboxes/{id}/resume", post(resume))
        .route("/sandboxes/{id}/metrics", get(metrics))
        .route_layer(middleware::from_fn_with_state(facade, require_api_key))
}

/// Refuses a request without an accepted `X-API-KEY` (401).
async fn require_api_key(State(facade): State<Facade>, request: Request, next: Next) -> Response {
    // A call another node of the fleet forwarded: that node checked the key, this one checked the fleet's secret.
    if request.extensions().get::<Forwarded>().is_some() {
        return next.run(request).await;
    }
    match check_api_key(&facade, request.headers()) {
        Ok(()) => next.run(request).await,
        Err(refusal) => ApiError::from(refusal).into_response(),
    }
}

/// A request body as a JSON object (`{}` when empty).
async fn read_json(body: Body) -> Result<Map<String, Value>, ApiError> {
    let bytes = read_body(body, MAX_API_BODY_BYTES).await?;
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Ok(Map::new());
    }
    match serde_json::from_slice::<Value>(&bytes) {
        Ok(Value::Object(map)) => Ok(map),
        Ok(_) => Err(ApiError::BadRequest(
            "The request body must be a JSON object".into(),
        )),
        Err(err) => Err(ApiError::BadRequest(format!(
            "The request body is not valid JSON: {err}"
        ))),
    }
}

/// Whether a value leaves its feature off: null, false, empty, or an object of such scalars.
fn is_unset(value: &Value) -> bool {
    match value {
        Value::Null | Value::Bool(false) => true,
        Value::String(s) => s.is_empty(),
        Value::Array(items) => items.is_empty(),
        // `{"enabled": false}` leaves a feature off; `{"server": {}}` (an MCP server, say) turns one on.
        Value::Object(map) => map.values().all(|v| !v.is_object() && is_unset(v)),
        Value::Number(_) | Value::Bool(true) => false,
    }
}

/// A `timeout` in seconds within `min..=MAX_TIMEOUT_SECS`, if present.
fn timeout_field(body: &Map<String, Value>, min: u64) -> Result<Option<Duration>, ApiError> {
    let Some(value) = body.get("timeout").filter(|v| !v.is_null()) else {
        return Ok(None);
    };
    match value.as_u64() {
        Some(secs) if (min..=MAX_TIMEOUT_SECS).contains(&secs) => {
            Ok(Some(Duration::from_secs(secs)))
        }
        _ => Err(ApiError::BadRequest(format!(
            "timeout must be an integer number of seconds from {min} to {MAX_TIMEOUT_SECS}"
        ))),
    }
}

/// A `{string: string}` field (empty when absent or null).
fn string_map(body: &Map<String, Value>, key: &str) -> Result<BTreeMap<String, String>, ApiError> {
    match body.get(key) {
        None | Some(Value::Null) => Ok(BTreeMap::new()),
        Some(Value::Object(map)) => map
            .iter()
            .map(|(k, v)| match v {
                Value::String(s) => Ok((k.clone(), s.clone())),
                _ => Err(ApiError::BadRequest(format!("{key}.{k} must be a string"))),
            })
            .collect(),
        Some(_) => Err(ApiError::BadRequest(format!(
            "{key} must be an object of strings"
        ))),
    }
}

/// Checks a create body and maps it onto a [`CreateSpec`].
pub fn parse_create(body: &Map<String, Value>) -> Result<CreateSpec, ApiError> {
    for key in UNMAPPED_CREATE_KEYS {
        if body.get(*key).is_some_and(|v| !is_unset(v)) {
            return Err(ApiError::Unmapped {
                field: (*key).to_owned(),
            });
        }
    }
    let template = match body.get("templateID") {
        None | Some(Value::Null) => DEFAULT_TEMPLATE.to_owned(),
        Some(Value::String(s)) if !s.is_empty() => s.clone(),
        Some(_) => {
            return Err(ApiError::BadRequest(
                "templateID must be a non-empty string".into(),
            ))
        }
    };
    let timeout = timeout_field(body, 1)?.unwrap_or(Duration::from_secs(DEFAULT_TIMEOUT_SECS));
    let metadata = string_map(body, "metadata")?;
    let env_vars = string_map(body, "envVars")?;
    let internet = match body.get("allow_internet_access") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => {
            return Err(ApiError::BadRequest(
                "allow_internet_access must be a bool".into(),
            ))
        }
    };
    let mut allow_out = Vec::new();
    match body.get("network") {
        None | Some(Value::Null) => {}
        Some(Value::Object(network)) => {
            for key in UNMAPPED_NETWORK_KEYS {
                if network.get(*key).is_some_and(|v| !is_unset(v)) {
                    return Err(ApiError::Unmapped {
                        field: format!("network.{key}"),
                    });
                }
            }
            match network.get("allowOut") {
                None | Some(Value::Null) => {}
                Some(Value::Array(items)) => {
                    for item in items {
                        match item {
                            Value::String(s) if !s.is_empty() => allow_out.push(s.clone()),
                            _ => {
                                return Err(ApiError::BadRequest(
                                    "network.allowOut must be a list of non-empty strings".into(),
                                ))
                            }
                        }
                    }
                }
                Some(_) => {
                    return Err(ApiError::BadRequest(
                        "network.allowOut must be a list".into(),
                    ))
                }
            }
        }
        Some(_) => return Err(ApiError::BadRequest("network must be an object".into())),
    }
    if allow_out.is_empty() && internet {
        return Err(ApiError::BadRequest(
            "allow_internet_access: sandboxd gives no open internet access; list the hosts a sandbox may reach in \
             network.allowOut (within the daemon's network.allow_max)"
                .into(),
        ));
    }
    Ok(CreateSpec {
        template,
        timeout,
        metadata,
        env_vars,
        allow_out,
    })
}

/// The `Sandbox` answer of create, connect and resume.
fn sandbox_body(info: &SandboxInfo) -> Value {
    json!({
        "templateID": info.template,
        "sandboxID": info.id,
        "clientID": CLIENT_ID,
        "envdVersion": crate::ENVD_VERSION,
        "envdAccessToken": info.access_token,
        "domain": Value::Null,
        "trafficAccessToken": Value::Null,
        "alias": info.template,
    })
}

/// The `ListedSandbox` fields (what `SandboxDetail` has, less the access token).
fn listed_body(info: &SandboxInfo) -> Value {
    json!({
        "templateID": info.template,
        "alias": info.template,
        "sandboxID": info.id,
        "clientID": CLIENT_ID,
        "startedAt": rfc3339(info.started_at),
        "endAt": rfc3339(info.end_at),
        "envdVersion": crate::ENVD_VERSION,
        "cpuCount": info.cpu_count,
        "memoryMB": info.memory_mb,
        "diskSizeMB": info.disk_mb,
        "state": state_name(info.state),
        "metadata": info.metadata,
    })
}

/// The `SandboxDetail` answer of `GET /sandboxes/{id}`.
fn detail_body(info: &SandboxInfo) -> Value {
    let mut body = listed_body(info);
    if let Value::Object(map) = &mut body {
        map.insert(
            "envdAccessToken".into(),
            Value::String(info.access_token.clone()),
        );
        map.insert("domain".into(), Value::Null);
    }
    body
}

/// E2B's name of a state.
fn state_name(state: SandboxState) -> &'static str {
    match state {
        SandboxState::Running => "running",
        SandboxState::Paused => "paused",
    }
}

/// The sandbox, or 404.
fn sandbox(facade: &Facade, id: &str) -> Result<Arc<dyn LiveSandbox>, ApiError> {
    facade
        .engine
        .get(id)
        .ok_or_else(|| ApiError::Engine(EngineError::SandboxNotFound(id.to_owned())))
}

/// `POST /v2/sandboxes` → 201 `Sandbox`. On a fleet, a create from a user goes to the least loaded node.
async fn create(
    State(facade): State<Facade>,
    forwarded: Option<Extension<Forwarded>>,
    body: Body,
) -> Result<Response, ApiError> {
    let raw = read_json(body).await?;
    let spec = parse_create(&raw)?;
    if let Some(fleet) = facade.fleet.as_ref().filter(|_| forwarded.is_none()) {
        if let Placement::There(peer) = fleet.place(facade.engine.list().len() as u64).await {
            let _placing = fleet.placing(&peer.tag);
            let request = axum::http::Request::builder()
                .method(Method::POST)
                .uri("/v2/sandboxes")
                .header(CONTENT_TYPE, "application/json")
                .body(Body::from(Value::Object(raw).to_string()))
                .map_err(|e| EngineError::Internal(e.to_string()))?;
            return fleet.forward(&peer, request).await.map_err(|e| {
                ApiError::Engine(EngineError::Full(format!(
                    "the node chosen for the sandbox did not take it: {e}"
                )))
            });
        }
    }
    let _placing = facade.fleet.as_ref().map(|f| f.placing(f.tag()));
    let info = facade.engine.create(spec).await?;
    Ok(json_response(StatusCode::CREATED, &sandbox_body(&info)))
}

/// `GET /sandboxes/{id}` → 200 `SandboxDetail`.
async fn info(State(facade): State<Facade>, Path(id): Path<String>) -> Result<Response, ApiError> {
    let info = sandbox(&facade, &id)?.info();
    Ok(json_response(StatusCode::OK, &detail_body(&info)))
}

/// `DELETE /sandboxes/{id}` → 204, or 404.
async fn kill(State(facade): State<Facade>, Path(id): Path<String>) -> Result<Response, ApiError> {
    if facade.engine.kill(&id).await {
        Ok(StatusCode::NO_CONTENT.into_response())
    } else {
        Err(EngineError::SandboxNotFound(id).into())
    }
}

/// `POST /sandboxes/{id}/timeout` `{"timeout":s}` → 204.
async fn set_timeout(
    State(facade): State<Facade>,
    Path(id): Path<String>,
    body: Body,
) -> Result<Response, ApiError> {
    let body = read_json(body).await?;
    let sandbox = sandbox(&facade, &id)?;
    let timeout = timeout_field(&body, 0)?
        .ok_or_else(|| ApiError::BadRequest("timeout is required".into()))?;
    sandbox.set_timeout(timeout);
    Ok(StatusCode::NO_CONTENT.into_response())
}

/// Extends a sandbox's end to `timeout` from now, never shortening it.
fn extend(sandbox: &dyn LiveSandbox, timeout: Duration) {
    let wanted = SystemTime::now() + timeout;
    if wanted > sandbox.info().end_at {
        sandbox.set_timeout(timeout);
    }
}

/// `POST /v2/sandboxes/{id}/connect` → 200 `Sandbox`: resumes a paused sandbox; a `timeout` extends its end.
async fn connect(
    State(facade): State<Facade>,
    Path(id): Path<String>,
    body: Body,
) -> Result<Response, ApiError> {
    let body = read_json(body).await?;
    let timeout = timeout_field(&body, 0)?;
    let sandbox = sandbox(&facade, &id)?;
    if sandbox.info().state == SandboxState::Paused {
        sandbox.resume().await?;
    }
    if let Some(timeout) = timeout {
        extend(sandbox.as_ref(), timeout);
    }
    Ok(json_response(
        StatusCode::OK,
        &sandbox_body(&sandbox.info()),
    ))
}

/// `POST /sandboxes/{id}/pause` → 204, or 409 when it is paused already.
async fn pause(State(facade): State<Facade>, Path(id): Path<String>) -> Result<Response, ApiError> {
    if sandbox(&facade, &id)?.pause().await? {
        Ok(StatusCode::NO_CONTENT.into_response())
    } else {
        Err(ApiError::AlreadyPaused(id))
    }
}

/// `POST /sandboxes/{id}/resume` (the legacy call) → 201 `Sandbox`, or 409 when it is running.
async fn resume(
    State(facade): State<Facade>,
    Path(id): Path<String>,
    body: Body,
) -> Result<Response, ApiError> {
    let body = read_json(body).await?;
    let timeout = timeout_field(&body, 1)?;
    if body.get("autoPause").is_some_and(|v| !is_unset(v)) {
        return Err(ApiError::Unmapped {
            field: "autoPause".into(),
        });
    }
    let sandbox = sandbox(&facade, &id)?;
    if sandbox.info().state == SandboxState::Running {
        return Err(ApiError::AlreadyRunning(id));
    }
    sandbox.resume().await?;
    if let Some(timeout) = timeout {
        sandbox.set_timeout(timeout);
    }
    Ok(json_response(
        StatusCode::CREATED,
        &sandbox_body(&sandbox.info()),
    ))
}

/// `GET /sandboxes/{id}/metrics` → 200 with one sample. CPU use is the average since the sandbox started.
async fn metrics(
    State(facade): State<Facade>,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    let sandbox = sandbox(&facade, &id)?;
    let info = sandbox.info();
    let (mem_used, cpu_ns) = sandbox.usage()?;
    let now = SystemTime::now();
    let wall_ns = now
        .duration_since(info.started_at)
        .unwrap_or_default()
        .as_nanos() as f64;
    let cpus = f64::from(info.cpu_count.max(1));
    let cpu_pct = if wall_ns > 0.0 {
        (cpu_ns as f64 / (wall_ns * cpus) * 100.0).clamp(0.0, 100.0)
    } else {
        0.0
    };
    let sample = json!({
        "timestamp": rfc3339(now),
        "timestampUnix": now.duration_since(UNIX_EPOCH).unwrap_or_default().as_secs(),
        "cpuCount": info.cpu_count,
        "cpuUsedPct": cpu_pct,
        "memUsed": mem_used,
        "memTotal": info.memory_mb.saturating_mul(1 << 20),
        // The cgroup's charge counts the page cache in memUsed; it is not reported apart.
        "memCache": 0,
        "diskUsed": 0,
        "diskTotal": info.disk_mb.saturating_mul(1 << 20),
    });
    Ok(json_response(StatusCode::OK, &json!([sample])))
}

/// `GET /v2/sandboxes` → 200 list, with `x-next-token` when more remain.
/// On a fleet, a list from a user spans every node.
async fn list(
    State(facade): State<Facade>,
    forwarded: Option<Extension<Forwarded>>,
    RawQuery(raw): RawQuery,
) -> Result<Response, ApiError> {
    let raw = raw.unwrap_or_default();
    let query = parse_list_query(&raw).map_err(ApiError::BadRequest)?;
    let mut infos: Vec<SandboxInfo> = facade.engine.list().iter().map(|s| s.info()).collect();
    if let Some(fleet) = facade.fleet.as_ref().filter(|_| forwarded.is_none()) {
        infos.extend(fleet.list_elsewhere(&raw).await);
    }
    let (page, token) = list_page(infos, &query);
    let body = Value::Array(page.iter().map(listed_body).collect());
    let mut response = json_response(StatusCode::OK, &body);
    if let Some(token) = token.and_then(|t| HeaderValue::from_str(&t).ok()) {
        response.headers_mut().insert("x-next-token", token);
    }
    Ok(response)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn obj(v: Value) -> Map<String, Value> {
        match v {
            Value::Object(m) => m,
            _ => panic!("not an object"),
        }
    }

    #[test]
    fn create_defaults() {
        let spec = parse_create(&obj(json!({"metadata": {}, "envVars": {}}))).unwrap();
        assert_eq!(spec.template, "base");
        assert_eq!(spec.timeout, Duration::from_secs(300));
        assert!(spec.allow_out.is_empty());
    }

    #[test]
    fn create_network() {
        let err = parse_create(&obj(json!({"allow_internet_access": true}))).unwrap_err();
        assert!(err.to_string().contains("network.allowOut"), "{err}");
        let spec = parse_create(&obj(
            json!({"allow_internet_access": true, "network": {"allowOut": ["pypi.org:443"]}}),
        ))
        .unwrap();
        assert_eq!(spec.allow_out, vec!["pypi.org:443".to_owned()]);
        let spec = parse_create(&obj(
            json!({"network": {"allowOut": ["pypi.org"], "denyOut": []}}),
        ))
        .unwrap();
        assert_eq!(spec.allow_out, vec!["pypi.org".to_owned()]);
        let err = parse_create(&obj(json!({"network": {"denyOut": ["0.0.0.0/0"]}}))).unwrap_err();
        assert_eq!(
            err.to_string(),
            "network.denyOut is not supported by sandboxd"
        );
    }

    #[test]
    fn create_refusals() {
        for body in [
            json!({"autoPause": true}),
            json!({"mcp": {"x": {}}}),
            json!({"volumeMounts": [{"name": "v"}]}),
        ] {
            let err = parse_create(&obj(body)).unwrap_err();
            assert_eq!(err.status(), StatusCode::BAD_REQUEST);
        }
        assert!(parse_create(&obj(
            json!({"autoPause": false, "volumeMounts": [], "unknownKey": 1})
        ))
        .is_ok());
        assert!(parse_create(&obj(json!({"autoResume": {"enabled": false}}))).is_ok());
        for timeout in [json!(0), json!(86401), json!("5")] {
            assert!(parse_create(&obj(json!({ "timeout": timeout }))).is_err());
        }
        assert_eq!(
            parse_create(&obj(json!({"timeout": 86400})))
                .unwrap()
                .timeout,
            Duration::from_secs(86400)
        );
    }
}

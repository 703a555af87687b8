//! The axum routes of agent sandboxes: `POST /sandboxes`, `DELETE /sandboxes/<id>`, the adapter-shim endpoints
//! under `/sandboxes/<id>`, and sandboxd's own `POST /sandboxes/<id>/network` (a new egress allowlist), volumes
//! (`/volumes`) and snapshots (`POST /sandboxes/<id>/snapshot`, `POST /sandboxes/<id>/fork`, `/snapshots`). Every route checks the same bearer token as `/ws` before anything else, reads at most
//! `agents.max_body_bytes` of body, and answers every refusal with a `PluginError` JSON body (an unknown path under
//! `/sandboxes/<id>/` too: 404, and a wrong method: 405). `POST /replay` streams its answer from the log.

use std::sync::Arc;

use agent_api::{
    AgentBrief, ContextInjection, CreateSandboxRequest, CreateSandboxResponse, CreateVolumeRequest,
    ForkResponse, KillRequest, PluginError, ReplayRequest, ResolveRequest, SandboxNetworkAllow,
    SerializedAgentState, UpdateBriefRequest,
};
use axum::body::Body;
use axum::extract::ws::{Message, WebSocket, WebSocketUpgrade};
use axum::extract::{Path, State};
use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::{any, delete, get, post, MethodRouter};
use axum::{Json, Router};
use futures_util::{SinkExt, StreamExt};
use serde::de::DeserializeOwned;

use crate::network::NetworkError;
use crate::registry::Refusal;
use crate::sandbox::Sandbox;
use crate::snapshots::{SnapshotError, Snapshots};
use crate::volumes::{VolumeError, Volumes};
use crate::Agents;

/// The routes' state: the registry (and through it, the host's token check and settings).
pub type AgentState = Arc<Agents>;

/// The agent routes, merged into the daemon's router once given their state. Every one checks the bearer token
/// first ([`require_token`]), its method fallbacks and unknown paths included.
pub fn router(st: AgentState) -> Router<AgentState> {
    Router::new()
        .route("/sandboxes", only(post(create), "POST"))
        .route("/sandboxes/{id}", only(delete(remove), "DELETE"))
        .route("/sandboxes/{id}/spawn", only(post(spawn), "POST"))
        .route("/sandboxes/{id}/pause", only(post(pause), "POST"))
        .route("/sandboxes/{id}/resume", only(post(resume), "POST"))
        .route("/sandboxes/{id}/kill", only(post(kill), "POST"))
        .route("/sandboxes/{id}/resolve", only(post(resolve), "POST"))
        .route("/sandboxes/{id}/inject-context", only(post(inject), "POST"))
        .route(
            "/sandboxes/{id}/update-brief",
            only(post(update_brief), "POST"),
        )
        .route("/sandboxes/{id}/replay", only(post(replay), "POST"))
        .route("/sandboxes/{id}/health", only(get(health), "GET"))
        .route("/sandboxes/{id}/network", only(post(network), "POST"))
        .route("/sandboxes/{id}/events", only(get(events), "GET"))
        .route(
            "/volumes",
            only(post(create_volume).get(list_volumes), "GET, POST"),
        )
        .route(
            "/volumes/{id}",
            only(get(volume).delete(delete_volume), "GET, DELETE"),
        )
        .route("/sandboxes/{id}/snapshot", only(post(snapshot), "POST"))
        .route("/sandboxes/{id}/fork", only(post(fork), "POST"))
        .route("/snapshots", only(get(list_snapshots), "GET"))
        .route(
            "/snapshots/{id}",
            only(get(get_snapshot).delete(delete_snapshot), "GET, DELETE"),
        )
        .route("/sandboxes/{id}/", any(unknown_path))
        .route("/sandboxes/{id}/{*rest}", any(unknown_path))
        .route_layer(axum::middleware::from_fn_with_state(st, require_token))
}

/// Refuses a request without the daemon's bearer token (401, a PluginError body) before anything else runs.
async fn require_token(
    State(st): State<AgentState>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    if st.host().auth.authorized(request.headers()) {
        next.run(request).await
    } else {
        unauthorized()
    }
}

/// A route that answers other methods with 405, a PluginError body and `Allow` (after the token check).
fn only(route: MethodRouter<AgentState>, allow: &'static str) -> MethodRouter<AgentState> {
    route.fallback(move |method: Method| async move {
        let mut r = refuse(
            StatusCode::METHOD_NOT_ALLOWED,
            PluginError::invalid(format!("Method {method} not allowed here (only {allow})")),
        );
        r.headers_mut()
            .insert(header::ALLOW, HeaderValue::from_static(allow));
        r
    })
}

/// Any path under `/sandboxes/<id>/` that is no endpoint: 404 (after the token check).
async fn unknown_path(uri: Uri) -> Response {
    let shown: String = uri.path().chars().take(128).collect();
    refuse(
        StatusCode::NOT_FOUND,
        PluginError::invalid(format!("No endpoint {shown:?}")),
    )
}

fn refuse(status: StatusCode, e: PluginError) -> Response {
    (status, Json(e)).into_response()
}

fn plugin(e: PluginError) -> Response {
    let status = StatusCode::from_u16(e.status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    refuse(status, e)
}

fn unauthorized() -> Response {
    refuse(
        StatusCode::UNAUTHORIZED,
        PluginError::invalid("Unauthorized: missing or wrong bearer token"),
    )
}

/// The sandbox, or 404.
fn lookup(st: &AgentState, id: &str) -> Result<Arc<Sandbox>, Box<Response>> {
    st.get(id).ok_or_else(|| {
        let shown: String = id.chars().take(64).collect();
        Box::new(refuse(
            StatusCode::NOT_FOUND,
            PluginError::invalid(format!("No sandbox {shown:?}")),
        ))
    })
}

/// Reads a bounded body and parses it; an empty body reads as `{}`.
async fn body<T: DeserializeOwned>(st: &AgentState, body: Body) -> Result<T, Box<Response>> {
    let limit = st.host().settings.agents.max_body_bytes;
    let bytes = axum::body::to_bytes(body, limit).await.map_err(|_| {
        Box::new(refuse(
            StatusCode::PAYLOAD_TOO_LARGE,
            PluginError::invalid(format!("Request body over {limit} bytes")),
        ))
    })?;
    let bytes: &[u8] = if bytes.iter().all(u8::is_ascii_whitespace) {
        b"{}"
    } else {
        &bytes
    };
    parse_body(bytes).map_err(|message| {
        Box::new(refuse(
            StatusCode::BAD_REQUEST,
            PluginError::invalid(message),
        ))
    })
}

/// Parses one JSON value and nothing after it (trailing bytes other than white space are refused); the error
/// names the field at fault.
fn parse_body<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, String> {
    let de = &mut serde_json::Deserializer::from_slice(bytes);
    let value = serde_path_to_error::deserialize(&mut *de).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        let at = if path == "." {
            String::new()
        } else {
            format!(" at {path}")
        };
        format!("Malformed request body{at}: {inner}")
    })?;
    de.end()
        .map_err(|e| format!("Malformed request body: {e}"))?;
    Ok(value)
}

async fn create(State(st): State<AgentState>, headers: HeaderMap, b: Body) -> Response {
    let req: CreateSandboxRequest = match body(&st, b).await {
        Ok(r) => r,
        Err(r) => return *r,
    };
    let host = request_host(&st, &headers);
    let agents = st.clone();
    let created = detached(async move { agents.create(req).await }).await;
    match created.and_then(|r| r) {
        Ok(sb) => (StatusCode::CREATED, Json(created_response(&host, &sb))).into_response(),
        Err(r) => refused(r),
    }
}

/// The `Host` the client used (for the endpoints it is told), else the daemon's listen address.
fn request_host(st: &AgentState, headers: &HeaderMap) -> String {
    headers
        .get(axum::http::header::HOST)
        .and_then(|h| h.to_str().ok())
        .filter(|h| h.bytes().all(|c| c.is_ascii_graphic()))
        .map(str::to_owned)
        .unwrap_or_else(|| st.host().settings.listen.to_string())
}

fn created_response(host: &str, sb: &Sandbox) -> CreateSandboxResponse {
    let base = format!("http://{host}/sandboxes/{}", sb.id);
    CreateSandboxResponse {
        id: sb.id.clone(),
        event_stream_endpoint: format!("ws://{host}/sandboxes/{}/events", sb.id),
        health_endpoint: format!("{base}/health"),
        rpc_endpoint: base,
    }
}

async fn remove(State(st): State<AgentState>, Path(id): Path<String>) -> Response {
    if let Err(r) = lookup(&st, &id) {
        return *r;
    }
    let (agents, owned) = (st.clone(), id.clone());
    match detached(async move { agents.delete(&owned).await }).await {
        Ok(true) => StatusCode::NO_CONTENT.into_response(),
        Ok(false) => refuse(
            StatusCode::NOT_FOUND,
            PluginError::invalid("No such sandbox"),
        ),
        Err(r) => refused(r),
    }
}

/// One adapter-shim command: auth, sandbox, body, call.
macro_rules! command {
    ($name:ident, $req:ty, |$sb:ident, $r:ident| $call:expr) => {
        async fn $name(State(st): State<AgentState>, Path(id): Path<String>, b: Body) -> Response {
            let $sb = match lookup(&st, &id) {
                Ok(s) => s,
                Err(r) => return *r,
            };
            let $r: $req = match body(&st, b).await {
                Ok(r) => r,
                Err(r) => return *r,
            };
            match $call.await {
                Ok(v) => Json(v).into_response(),
                Err(e) => plugin(e),
            }
        }
    };
}

/// An empty body (`{}` or nothing).
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct Empty {}

command!(spawn, AgentBrief, |sb, r| sb.spawn(r));
command!(pause, Empty, |sb, _r| sb.pause());
command!(resume, SerializedAgentState, |sb, r| sb.resume(r));
command!(kill, KillRequest, |sb, r| sb.kill(r));
command!(resolve, ResolveRequest, |sb, r| async {
    sb.resolve(r).await.map(|()| serde_json::json!({}))
});
command!(inject, ContextInjection, |sb, r| async {
    sb.inject(r).await.map(|()| serde_json::json!({}))
});
command!(update_brief, UpdateBriefRequest, |sb, r| async {
    sb.update_brief(r.changes)
        .await
        .map(|()| serde_json::json!({}))
});
/// Replays streaming at once (each holds one blocking thread while it reads the log).
const MAX_REPLAYS: usize = 32;
static REPLAYS: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(MAX_REPLAYS);
/// How long a replay waits for its reader to take the next chunk before it gives up (the body ends early).
const REPLAY_STALL: std::time::Duration = std::time::Duration::from_secs(30);

/// `POST /replay`: 400 for an inverted range; the answer is streamed from the log in chunks (never the whole
/// range in memory). A read error midway ends the body early (the client sees a truncated JSON).
async fn replay(State(st): State<AgentState>, Path(id): Path<String>, b: Body) -> Response {
    let sb = match lookup(&st, &id) {
        Ok(s) => s,
        Err(r) => return *r,
    };
    let r: ReplayRequest = match body(&st, b).await {
        Ok(r) => r,
        Err(r) => return *r,
    };
    if r.from_sequence > r.to_sequence {
        return refuse(
            StatusCode::BAD_REQUEST,
            PluginError::invalid("fromSequence is after toSequence"),
        );
    }
    // Each replay holds a blocking thread while it streams: bounded in number, and a reader that stops reading
    // for REPLAY_STALL lets its thread go.
    let Ok(permit) = REPLAYS.try_acquire() else {
        return plugin(unavailable(format!(
            "{MAX_REPLAYS} replays are in progress; try again"
        )));
    };
    let hub = sb.hub.clone();
    let opened = match tokio::task::spawn_blocking(move || hub.replay(r)).await {
        Ok(Ok(replay)) => replay,
        Ok(Err(e)) => return plugin(unavailable(format!("Cannot read the event log: {e}"))),
        Err(e) => return plugin(unavailable(format!("Replay failed: {e}"))),
    };
    let (tx, rx) = tokio::sync::mpsc::channel::<std::io::Result<Vec<u8>>>(2);
    let rt = tokio::runtime::Handle::current();
    tokio::task::spawn_blocking(move || {
        let _permit = permit;
        let chunks = tx.clone();
        let send = |chunk| {
            let sent = rt.block_on(tokio::time::timeout(REPLAY_STALL, chunks.send(Ok(chunk))));
            matches!(sent, Ok(Ok(())))
        };
        if let Err(e) = opened.write(send) {
            tracing::warn!(error = %e, "replay stopped: the event log is unreadable");
            let _ = tx.blocking_send(Err(e));
        }
    });
    let stream = futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|chunk| (chunk, rx))
    });
    (
        [(header::CONTENT_TYPE, "application/json")],
        Body::from_stream(stream),
    )
        .into_response()
}

fn unavailable(message: String) -> PluginError {
    PluginError::ProviderUnavailable {
        message,
        retryable: true,
    }
}

async fn health(State(st): State<AgentState>, Path(id): Path<String>) -> Response {
    match lookup(&st, &id) {
        Ok(sb) => {
            let sb2 = sb.clone();
            match tokio::task::spawn_blocking(move || sb2.health()).await {
                Ok(h) => Json(h).into_response(),
                Err(e) => plugin(PluginError::ProviderUnavailable {
                    message: format!("Health failed: {e}"),
                    retryable: true,
                }),
            }
        }
        Err(r) => *r,
    }
}

/// `POST /network`: 200 with the list in force; 400 for a malformed or uncovered entry; 409 when the sandbox was
/// created without `network` (the proxy a list could apply to does not exist: a state of the sandbox, not a fault
/// of the request's body).
async fn network(State(st): State<AgentState>, Path(id): Path<String>, b: Body) -> Response {
    let sb = match lookup(&st, &id) {
        Ok(s) => s,
        Err(r) => return *r,
    };
    let r: SandboxNetworkAllow = match body(&st, b).await {
        Ok(r) => r,
        Err(r) => return *r,
    };
    match sb.set_network(r.allow) {
        Ok(allow) => Json(SandboxNetworkAllow { allow }).into_response(),
        Err(e @ NetworkError::NotCreatedWith) => refuse(
            StatusCode::CONFLICT,
            PluginError::InvalidState {
                message: e.to_string(),
                handle: Some(Box::new(sb.handle())),
            },
        ),
        Err(e @ NetworkError::Record(_)) => refuse(
            StatusCode::SERVICE_UNAVAILABLE,
            PluginError::ProviderUnavailable {
                message: runtime::error::Chain(&e).to_string(),
                retryable: true,
            },
        ),
        Err(e) => refuse(StatusCode::BAD_REQUEST, PluginError::invalid(e.to_string())),
    }
}

async fn events(
    State(st): State<AgentState>,
    Path(id): Path<String>,
    upgrade: Result<WebSocketUpgrade, axum::extract::ws::rejection::WebSocketUpgradeRejection>,
) -> Response {
    let sb = match lookup(&st, &id) {
        Ok(s) => s,
        Err(r) => return *r,
    };
    let upgrade = match upgrade {
        Ok(u) => u,
        Err(rej) => {
            return refuse(
                rej.status(),
                PluginError::invalid(format!("Not a WebSocket upgrade: {rej}")),
            )
        }
    };
    // The gateway's connection is one span, a child of the upgrade's request, with the events it was sent.
    let span = tracing::info_span!(
        "agent_events",
        sandbox = %sb.id,
        delivered = tracing::field::Empty,
    );
    upgrade
        .max_message_size(64 << 10)
        .on_upgrade(move |ws| tracing::Instrument::instrument(stream_events(sb, ws), span))
}

/// Sends queued events to this gateway until it goes away or a newer one connects.
async fn stream_events(sb: Arc<Sandbox>, ws: WebSocket) {
    let mut delivered = 0u64;
    let hub = sb.hub.clone();
    let mut changed = hub.subscribe();
    let g = hub.attach();
    let (mut sink, mut stream) = ws.split();
    'outer: loop {
        changed.borrow_and_update();
        loop {
            match hub.next(g) {
                Ok(Some(json)) => {
                    if sink
                        .send(Message::Text(json.as_ref().into()))
                        .await
                        .is_err()
                    {
                        break 'outer;
                    }
                    delivered += 1;
                }
                Ok(None) => break,
                Err(crate::events::Replaced) => {
                    let _ = sink.send(Message::Close(None)).await;
                    break 'outer;
                }
            }
        }
        tokio::select! {
            r = changed.changed() => if r.is_err() { break },
            m = stream.next() => match m {
                None | Some(Err(_)) | Some(Ok(Message::Close(_))) => break,
                Some(Ok(_)) => {}
            },
        }
    }
    hub.detach(g);
    tracing::Span::current().record("delivered", delivered);
}

/// Runs `work` as a task of its own and waits for it: a client that goes away mid-request (its handler dropped)
/// cannot cut a creation or a removal short and leave its state half made. It stays in the request's span. A panic
/// is 503.
async fn detached<T: Send + 'static>(
    work: impl std::future::Future<Output = T> + Send + 'static,
) -> Result<T, Refusal> {
    let work = tracing::Instrument::instrument(work, tracing::Span::current());
    tokio::spawn(work).await.map_err(|e| {
        Refusal::from(PluginError::ProviderUnavailable {
            message: format!("The request failed: {e}"),
            retryable: false,
        })
    })
}

/// The volumes (`capability_unsupported` when the host has none).
fn volumes(st: &AgentState) -> Result<Arc<Volumes>, Box<Response>> {
    st.volumes().cloned().ok_or_else(|| {
        Box::new(plugin(PluginError::CapabilityUnsupported {
            capability: "volumes".into(),
        }))
    })
}

fn volume_refused(e: VolumeError) -> Response {
    let (status, error) = e.plugin();
    refused(Refusal { status, error })
}

fn refused(r: Refusal) -> Response {
    refuse(
        StatusCode::from_u16(r.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
        r.error,
    )
}

/// `POST /volumes` → 201 `Volume`.
async fn create_volume(State(st): State<AgentState>, b: Body) -> Response {
    let vols = match volumes(&st) {
        Ok(v) => v,
        Err(r) => return *r,
    };
    let req: CreateVolumeRequest = match body(&st, b).await {
        Ok(r) => r,
        Err(r) => return *r,
    };
    match detached(async move { vols.create(req).await }).await {
        Ok(Ok(v)) => (StatusCode::CREATED, Json(v)).into_response(),
        Ok(Err(e)) => volume_refused(e),
        Err(r) => refused(r),
    }
}

/// `GET /volumes` → `{volumes: [Volume]}`.
async fn list_volumes(State(st): State<AgentState>) -> Response {
    match volumes(&st) {
        Ok(v) => Json(serde_json::json!({ "volumes": v.list() })).into_response(),
        Err(r) => *r,
    }
}

/// `GET /volumes/<id>` → `Volume`.
async fn volume(State(st): State<AgentState>, Path(id): Path<String>) -> Response {
    match volumes(&st).map(|v| v.get(&id)) {
        Ok(Ok(v)) => Json(v).into_response(),
        Ok(Err(e)) => volume_refused(e),
        Err(r) => *r,
    }
}

/// `DELETE /volumes/<id>` → 204; 409 while a sandbox mounts it.
async fn delete_volume(State(st): State<AgentState>, Path(id): Path<String>) -> Response {
    let vols = match volumes(&st) {
        Ok(v) => v,
        Err(r) => return *r,
    };
    match detached(async move { vols.delete(&id).await }).await {
        Ok(Ok(())) => StatusCode::NO_CONTENT.into_response(),
        Ok(Err(e)) => volume_refused(e),
        Err(r) => refused(r),
    }
}

fn snapshot_refused(e: SnapshotError) -> Response {
    let (status, error) = e.plugin();
    refused(Refusal { status, error })
}

/// An empty body (or `{}`): the snapshot routes take no options.
#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct NoOptions {}

/// `POST /sandboxes/<id>/snapshot` → 201 `Snapshot`.
async fn snapshot(State(st): State<AgentState>, Path(id): Path<String>, b: Body) -> Response {
    if let Err(r) = lookup(&st, &id) {
        return *r;
    }
    if let Err(r) = body::<NoOptions>(&st, b).await {
        return *r;
    }
    let agents = st.clone();
    match detached(async move { agents.snapshot(&id).await }).await {
        Ok(Some(Ok(s))) => (StatusCode::CREATED, Json(s)).into_response(),
        Ok(Some(Err(e))) => snapshot_refused(e),
        Ok(None) => refuse(
            StatusCode::NOT_FOUND,
            PluginError::invalid("No such sandbox"),
        ),
        Err(r) => refused(r),
    }
}

/// `POST /sandboxes/<id>/fork` (a creation request) → 201 `ForkResponse`.
async fn fork(
    State(st): State<AgentState>,
    headers: HeaderMap,
    Path(id): Path<String>,
    b: Body,
) -> Response {
    if let Err(r) = lookup(&st, &id) {
        return *r;
    }
    let req: CreateSandboxRequest = match body(&st, b).await {
        Ok(r) => r,
        Err(r) => return *r,
    };
    let host = request_host(&st, &headers);
    let agents = st.clone();
    match detached(async move { agents.fork(&id, req).await }).await {
        Ok(Ok((snapshot, sb))) => (
            StatusCode::CREATED,
            Json(ForkResponse {
                snapshot,
                sandbox: created_response(&host, &sb),
            }),
        )
            .into_response(),
        Ok(Err(r)) | Err(r) => refused(r),
    }
}

/// The snapshots (`capability_unsupported` when the host has none).
fn snapshot_store(st: &AgentState) -> Result<Arc<Snapshots>, Box<Response>> {
    st.snapshots()
        .cloned()
        .map_err(|e| Box::new(snapshot_refused(e)))
}

/// `GET /snapshots` → `{snapshots: [Snapshot]}`.
async fn list_snapshots(State(st): State<AgentState>) -> Response {
    match snapshot_store(&st) {
        Ok(s) => Json(serde_json::json!({ "snapshots": s.list() })).into_response(),
        Err(r) => *r,
    }
}

/// `GET /snapshots/<id>` → `Snapshot`.
async fn get_snapshot(State(st): State<AgentState>, Path(id): Path<String>) -> Response {
    match snapshot_store(&st).map(|s| s.get(&id)) {
        Ok(Ok(s)) => Json(s).into_response(),
        Ok(Err(e)) => snapshot_refused(e),
        Err(r) => *r,
    }
}

/// `DELETE /snapshots/<id>` → 204; 409 while a sandbox started from it exists.
async fn delete_snapshot(State(st): State<AgentState>, Path(id): Path<String>) -> Response {
    let snapshots = match snapshot_store(&st) {
        Ok(s) => s,
        Err(r) => return *r,
    };
    match detached(async move { snapshots.delete(&id).await }).await {
        Ok(Ok(())) => StatusCode::NO_CONTENT.into_response(),
        Ok(Err(e)) => snapshot_refused(e),
        Err(r) => refused(r),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Kill {
        #[allow(dead_code)]
        grace: bool,
    }

    #[test]
    fn a_body_with_bytes_after_its_value_is_refused() {
        assert!(parse_body::<Kill>(b"{\"grace\":false}  \n").is_ok());
        let e = parse_body::<Kill>(b"{\"grace\":false}xyz").unwrap_err();
        assert!(e.contains("trailing characters"), "{e}");
        let e = parse_body::<Kill>(b"{\"grace\":1}").unwrap_err();
        assert!(e.contains("at grace"), "{e}");
    }
}

//! The axum routes of agent sandboxes: `POST /sandboxes`, `DELETE /sandboxes/<id>`, the adapter-shim endpoints
//! under `/sandboxes/<id>`, and sandboxd's own `POST /sandboxes/<id>/network` (a new egress allowlist), volumes
//! (`/volumes`) and snapshots (`POST /sandboxes/<id>/snapshot`, `POST /sandboxes/<id>/fork`, `/snapshots`).
//!
//! In axum's idiom: the bearer token is one layer ([`require_token`]) that runs before any route, its method
//! fallbacks and unknown paths included; the sandbox of a path is an extractor ([`Found`]: 404 when there is none),
//! and so is the body ([`Bounded`]: at most `agents.max_body_bytes`, parsed with the field at fault named); every
//! refusal is a [`Refusal`], which answers with its status and a `PluginError` JSON body (an unknown path under
//! `/sandboxes/<id>/` too: 404, and a wrong method: 405). `POST /replay` streams its answer from the log.

use std::sync::Arc;

use agent_api::{
    AgentBrief, ContextInjection, CreateSandboxRequest, CreateSandboxResponse, CreateVolumeRequest,
    ForkResponse, KillRequest, PluginError, ReplayRequest, ResolveRequest, SandboxNetworkAllow,
    SerializedAgentState, UpdateBriefRequest,
};
use axum::body::Body;
use axum::extract::ws::{Message, WebSocket, WebSocketUpgrade};
use axum::extract::{FromRequest, FromRequestParts, Path, Request, State};
use axum::http::request::Parts;
use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::{any, delete, get, post, MethodRouter};
use axum::{Json, Router};
use futures_util::{SinkExt, StreamExt};
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::network::NetworkError;
use crate::registry::Refusal;
use crate::sandbox::Sandbox;
use crate::snapshots::Snapshots;
use crate::volumes::Volumes;
use crate::Agents;

/// The routes' state: the registry (and through it, the host's token check and settings).
pub type AgentState = Arc<Agents>;

/// What a route answers: its JSON (200 unless it says otherwise), or a refusal.
type Answer<T> = Result<T, Refusal>;

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

impl IntoResponse for Refusal {
    /// The status and the `PluginError` body.
    fn into_response(self) -> Response {
        let status = StatusCode::from_u16(self.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        (status, Json(self.error)).into_response()
    }
}

/// A refusal with `status` and an `invalid` body saying `message`.
fn refuse(status: StatusCode, message: impl Into<String>) -> Refusal {
    Refusal {
        status: status.as_u16(),
        error: PluginError::invalid(message),
    }
}

/// A sandbox command's refusal, with the error's own status.
fn plugin(error: PluginError) -> Refusal {
    Refusal {
        status: error.status(),
        error,
    }
}

fn unavailable(message: String) -> Refusal {
    plugin(PluginError::ProviderUnavailable {
        message,
        retryable: true,
    })
}

/// Refuses a request without the daemon's bearer token (401, a PluginError body) before anything else runs.
async fn require_token(
    State(st): State<AgentState>,
    request: Request,
    next: axum::middleware::Next,
) -> Response {
    if st.host().auth.authorized(request.headers()) {
        next.run(request).await
    } else {
        refuse(
            StatusCode::UNAUTHORIZED,
            "Unauthorized: missing or wrong bearer token",
        )
        .into_response()
    }
}

/// A route that answers other methods with 405, a PluginError body and `Allow` (after the token check).
fn only(route: MethodRouter<AgentState>, allow: &'static str) -> MethodRouter<AgentState> {
    route.fallback(move |method: Method| async move {
        let refused = refuse(
            StatusCode::METHOD_NOT_ALLOWED,
            format!("Method {method} not allowed here (only {allow})"),
        );
        ([(header::ALLOW, HeaderValue::from_static(allow))], refused)
    })
}

/// Any path under `/sandboxes/<id>/` that is no endpoint: 404 (after the token check).
async fn unknown_path(uri: Uri) -> Refusal {
    let shown: String = uri.path().chars().take(128).collect();
    refuse(StatusCode::NOT_FOUND, format!("No endpoint {shown:?}"))
}

/// The sandbox the path's `{id}` names; 404 when there is none.
struct Found(Arc<Sandbox>);

impl FromRequestParts<AgentState> for Found {
    type Rejection = Refusal;

    async fn from_request_parts(parts: &mut Parts, st: &AgentState) -> Result<Self, Refusal> {
        let Path(id) = Path::<String>::from_request_parts(parts, st)
            .await
            .map_err(|e| refuse(e.status(), e.body_text()))?;
        st.get(&id).map(Found).ok_or_else(|| {
            let shown: String = id.chars().take(64).collect();
            refuse(StatusCode::NOT_FOUND, format!("No sandbox {shown:?}"))
        })
    }
}

/// The request's body as a `T`: at most `agents.max_body_bytes` (413 above), one JSON value naming the field at
/// fault when it does not parse (400); an empty body reads as `{}`.
struct Bounded<T>(T);

impl<T: DeserializeOwned> FromRequest<AgentState> for Bounded<T> {
    type Rejection = Refusal;

    async fn from_request(request: Request, st: &AgentState) -> Result<Self, Refusal> {
        let limit = st.host().settings.agents.max_body_bytes;
        let bytes = axum::body::to_bytes(request.into_body(), limit)
            .await
            .map_err(|_| {
                refuse(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    format!("Request body over {limit} bytes"),
                )
            })?;
        let bytes: &[u8] = if bytes.iter().all(u8::is_ascii_whitespace) {
            b"{}"
        } else {
            &bytes
        };
        parse_body(bytes)
            .map(Bounded)
            .map_err(|message| refuse(StatusCode::BAD_REQUEST, message))
    }
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

/// `201 Created` with `body`.
fn created(body: impl Serialize) -> Response {
    (StatusCode::CREATED, Json(body)).into_response()
}

async fn create(
    State(st): State<AgentState>,
    headers: HeaderMap,
    Bounded(req): Bounded<CreateSandboxRequest>,
) -> Answer<Response> {
    let host = request_host(&st, &headers);
    let agents = st.clone();
    let sb = detached(async move { agents.create(req).await }).await??;
    Ok(created(created_response(&host, &sb)))
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

async fn remove(State(st): State<AgentState>, Found(sb): Found) -> Answer<StatusCode> {
    // The registry's reference alone is left while it removes the sandbox.
    let id = sb.id.clone();
    drop(sb);
    let agents = st.clone();
    match detached(async move { agents.delete(&id).await }).await? {
        true => Ok(StatusCode::NO_CONTENT),
        false => Err(refuse(StatusCode::NOT_FOUND, "No such sandbox")),
    }
}

/// An empty body (`{}` or nothing).
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct Empty {}

async fn spawn(Found(sb): Found, Bounded(r): Bounded<AgentBrief>) -> Answer<impl IntoResponse> {
    Ok(Json(sb.spawn(r).await.map_err(plugin)?))
}

async fn pause(Found(sb): Found, Bounded(Empty {}): Bounded<Empty>) -> Answer<impl IntoResponse> {
    Ok(Json(sb.pause().await.map_err(plugin)?))
}

async fn resume(
    Found(sb): Found,
    Bounded(r): Bounded<SerializedAgentState>,
) -> Answer<impl IntoResponse> {
    Ok(Json(sb.resume(r).await.map_err(plugin)?))
}

async fn kill(Found(sb): Found, Bounded(r): Bounded<KillRequest>) -> Answer<impl IntoResponse> {
    Ok(Json(sb.kill(r).await.map_err(plugin)?))
}

/// `{}`: what the commands that answer nothing answer.
fn done() -> Json<serde_json::Value> {
    Json(serde_json::json!({}))
}

async fn resolve(
    Found(sb): Found,
    Bounded(r): Bounded<ResolveRequest>,
) -> Answer<impl IntoResponse> {
    sb.resolve(r).await.map_err(plugin)?;
    Ok(done())
}

async fn inject(
    Found(sb): Found,
    Bounded(r): Bounded<ContextInjection>,
) -> Answer<impl IntoResponse> {
    sb.inject(r).await.map_err(plugin)?;
    Ok(done())
}

async fn update_brief(
    Found(sb): Found,
    Bounded(r): Bounded<UpdateBriefRequest>,
) -> Answer<impl IntoResponse> {
    sb.update_brief(r.changes).await.map_err(plugin)?;
    Ok(done())
}

/// Replays streaming at once (each holds one blocking thread while it reads the log).
const MAX_REPLAYS: usize = 32;
static REPLAYS: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(MAX_REPLAYS);
/// How long a replay waits for its reader to take the next chunk before it gives up (the body ends early).
const REPLAY_STALL: std::time::Duration = std::time::Duration::from_secs(30);

/// `POST /replay`: 400 for an inverted range; the answer is streamed from the log in chunks (never the whole
/// range in memory). A read error midway ends the body early (the client sees a truncated JSON).
async fn replay(Found(sb): Found, Bounded(r): Bounded<ReplayRequest>) -> Answer<Response> {
    if r.from_sequence > r.to_sequence {
        return Err(refuse(
            StatusCode::BAD_REQUEST,
            "fromSequence is after toSequence",
        ));
    }
    // Each replay holds a blocking thread while it streams: bounded in number, and a reader that stops reading
    // for REPLAY_STALL lets its thread go.
    let Ok(permit) = REPLAYS.try_acquire() else {
        return Err(unavailable(format!(
            "{MAX_REPLAYS} replays are in progress; try again"
        )));
    };
    let hub = sb.hub.clone();
    let opened = match tokio::task::spawn_blocking(move || hub.replay(r)).await {
        Ok(Ok(replay)) => replay,
        Ok(Err(e)) => return Err(unavailable(format!("Cannot read the event log: {e}"))),
        Err(e) => return Err(unavailable(format!("Replay failed: {e}"))),
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
    Ok((
        [(header::CONTENT_TYPE, "application/json")],
        Body::from_stream(stream),
    )
        .into_response())
}

async fn health(Found(sb): Found) -> Answer<impl IntoResponse> {
    match tokio::task::spawn_blocking(move || sb.health()).await {
        Ok(h) => Ok(Json(h)),
        Err(e) => Err(unavailable(format!("Health failed: {e}"))),
    }
}

/// `POST /network`: 200 with the list in force; 400 for a malformed or uncovered entry; 409 when the sandbox was
/// created without `network` (the proxy a list could apply to does not exist: a state of the sandbox, not a fault
/// of the request's body).
async fn network(
    Found(sb): Found,
    Bounded(r): Bounded<SandboxNetworkAllow>,
) -> Answer<impl IntoResponse> {
    match sb.set_network(r.allow) {
        Ok(allow) => Ok(Json(SandboxNetworkAllow { allow })),
        Err(e @ NetworkError::NotCreatedWith) => Err(Refusal {
            status: StatusCode::CONFLICT.as_u16(),
            error: PluginError::InvalidState {
                message: e.to_string(),
                handle: Some(Box::new(sb.handle())),
            },
        }),
        Err(e @ NetworkError::Record(_)) => Err(Refusal {
            status: StatusCode::SERVICE_UNAVAILABLE.as_u16(),
            error: PluginError::ProviderUnavailable {
                message: runtime::error::Chain(&e).to_string(),
                retryable: true,
            },
        }),
        Err(e) => Err(refuse(StatusCode::BAD_REQUEST, e.to_string())),
    }
}

async fn events(
    Found(sb): Found,
    upgrade: Result<WebSocketUpgrade, axum::extract::ws::rejection::WebSocketUpgradeRejection>,
) -> Answer<Response> {
    let upgrade =
        upgrade.map_err(|rej| refuse(rej.status(), format!("Not a WebSocket upgrade: {rej}")))?;
    // The gateway's connection is one span, a child of the upgrade's request, with the events it was sent.
    let span = tracing::info_span!(
        "agent_events",
        sandbox = %sb.id,
        delivered = tracing::field::Empty,
    );
    Ok(upgrade
        .max_message_size(64 << 10)
        .on_upgrade(move |ws| tracing::Instrument::instrument(stream_events(sb, ws), span)))
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
fn volumes(st: &AgentState) -> Answer<Arc<Volumes>> {
    st.volumes().cloned().ok_or_else(|| {
        plugin(PluginError::CapabilityUnsupported {
            capability: "volumes".into(),
        })
    })
}

/// `POST /volumes` → 201 `Volume`.
async fn create_volume(
    State(st): State<AgentState>,
    Bounded(req): Bounded<CreateVolumeRequest>,
) -> Answer<Response> {
    let vols = volumes(&st)?;
    Ok(created(
        detached(async move { vols.create(req).await }).await??,
    ))
}

/// `GET /volumes` → `{volumes: [Volume]}`.
async fn list_volumes(State(st): State<AgentState>) -> Answer<impl IntoResponse> {
    Ok(Json(serde_json::json!({ "volumes": volumes(&st)?.list() })))
}

/// `GET /volumes/<id>` → `Volume`.
async fn volume(State(st): State<AgentState>, Path(id): Path<String>) -> Answer<impl IntoResponse> {
    Ok(Json(volumes(&st)?.get(&id)?))
}

/// `DELETE /volumes/<id>` → 204; 409 while a sandbox mounts it.
async fn delete_volume(State(st): State<AgentState>, Path(id): Path<String>) -> Answer<StatusCode> {
    let vols = volumes(&st)?;
    detached(async move { vols.delete(&id).await }).await??;
    Ok(StatusCode::NO_CONTENT)
}

/// An empty body (or `{}`): the snapshot routes take no options.
#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct NoOptions {}

/// `POST /sandboxes/<id>/snapshot` → 201 `Snapshot`.
async fn snapshot(
    State(st): State<AgentState>,
    Found(sb): Found,
    Bounded(NoOptions {}): Bounded<NoOptions>,
) -> Answer<Response> {
    let (agents, id) = (st.clone(), sb.id.clone());
    drop(sb);
    match detached(async move { agents.snapshot(&id).await }).await? {
        Some(snapshot) => Ok(created(snapshot?)),
        None => Err(refuse(StatusCode::NOT_FOUND, "No such sandbox")),
    }
}

/// `POST /sandboxes/<id>/fork` (a creation request) → 201 `ForkResponse`.
async fn fork(
    State(st): State<AgentState>,
    headers: HeaderMap,
    Found(sb): Found,
    Bounded(req): Bounded<CreateSandboxRequest>,
) -> Answer<Response> {
    let host = request_host(&st, &headers);
    let (agents, id) = (st.clone(), sb.id.clone());
    drop(sb);
    let (snapshot, forked) = detached(async move { agents.fork(&id, req).await }).await??;
    Ok(created(ForkResponse {
        snapshot,
        sandbox: created_response(&host, &forked),
    }))
}

/// The snapshots (`capability_unsupported` when the host has none).
fn snapshot_store(st: &AgentState) -> Answer<Arc<Snapshots>> {
    Ok(st.snapshots().cloned()?)
}

/// `GET /snapshots` → `{snapshots: [Snapshot]}`.
async fn list_snapshots(State(st): State<AgentState>) -> Answer<impl IntoResponse> {
    Ok(Json(
        serde_json::json!({ "snapshots": snapshot_store(&st)?.list() }),
    ))
}

/// `GET /snapshots/<id>` → `Snapshot`.
async fn get_snapshot(
    State(st): State<AgentState>,
    Path(id): Path<String>,
) -> Answer<impl IntoResponse> {
    Ok(Json(snapshot_store(&st)?.get(&id)?))
}

/// `DELETE /snapshots/<id>` → 204; 409 while a sandbox started from it exists.
async fn delete_snapshot(
    State(st): State<AgentState>,
    Path(id): Path<String>,
) -> Answer<StatusCode> {
    let snapshots = snapshot_store(&st)?;
    detached(async move { snapshots.delete(&id).await }).await??;
    Ok(StatusCode::NO_CONTENT)
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

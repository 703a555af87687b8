//! The FSP/1 listener: `GET /healthz`, artifact downloads, and `/ws`, the FSP/1 endpoint with bearer auth at the
//! upgrade; each upgraded socket becomes a [`super::connection`].
//!
//! At shutdown, once the drain has ended the executions, [`Connections::close`] asks every connection to end: its
//! writer sends what is still queued (the last results), then a close frame with 1001 (going away), and the daemon
//! waits for that, bounded, before it exits.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use axum::extract::ws::WebSocketUpgrade;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use protocol::SUPPORTED_VERSIONS;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::Instrument;

use crate::auth::authorized;
use crate::config::CONNECTIONS_CLOSE;
use crate::exec::engine::Engine;

use super::connection::connection;

/// The open FSP connections: numbered for their log spans, and closed at shutdown once their messages are written.
#[derive(Clone, Default)]
pub struct Connections {
    count: Arc<AtomicU64>,
    open: TaskTracker,
    going_away: CancellationToken,
}

impl Connections {
    /// Asks every connection, open now or opened later, to end once its queued messages are written, and waits for
    /// them at most [`CONNECTIONS_CLOSE`]. False when some were still open then.
    pub async fn close(&self) -> bool {
        self.open.close();
        self.going_away.cancel();
        tokio::time::timeout(CONNECTIONS_CLOSE, self.open.wait())
            .await
            .is_ok()
    }
}

/// Shared state of the HTTP server.
#[derive(Clone)]
pub struct AppState {
    /// The engine.
    pub engine: Arc<Engine>,
    /// Accepted tokens.
    pub tokens: Arc<Vec<String>>,
    /// The open FSP connections.
    pub connections: Connections,
    /// Agent sandboxes.
    pub agents: Arc<agents::Agents>,
}

/// The router.
pub fn router(state: AppState) -> Router {
    // Agent sandboxes: their routes with their own state.
    let agents = agents::router(state.agents.clone())
        .with_state(state.agents.clone())
        .layer(axum::middleware::from_fn(traced));
    Router::new()
        .route("/healthz", get(healthz))
        .route("/ws", get(ws))
        .route("/artifacts/sha256/{hex}", get(artifact))
        .merge(agents)
        .with_state(state)
}

/// An agent request's span (`agent_request`, method and path), a child of the caller's span when the request
/// carries a W3C `traceparent` header.
async fn traced(req: axum::extract::Request, next: axum::middleware::Next) -> Response {
    let span =
        tracing::info_span!("agent_request", method = %req.method(), path = %req.uri().path());
    if let Some(parent) = req
        .headers()
        .get("traceparent")
        .and_then(|v| v.to_str().ok())
    {
        crate::observe::telemetry::set_parent(&span, parent);
    }
    next.run(req).instrument(span).await
}

async fn healthz(State(state): State<AppState>) -> Response {
    let (healthy, body) = state.engine.health();
    let code = if healthy {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (code, Json(body)).into_response()
}

/// `GET` (and `HEAD`) `/artifacts/sha256/<hex>`: the stored content, with the same bearer auth as `/ws`.
async fn artifact(
    State(state): State<AppState>,
    headers: HeaderMap,
    axum::extract::Path(hex): axum::extract::Path<String>,
) -> Response {
    if !authorized(&headers, &state.tokens) {
        return (StatusCode::UNAUTHORIZED, "unauthorized\n").into_response();
    }
    let Some(path) = state.engine.daemon().store().blob(&hex) else {
        return (StatusCode::NOT_FOUND, "no such artifact\n").into_response();
    };
    let file = match tokio::fs::File::open(&path).await {
        Ok(f) => f,
        Err(_) => return (StatusCode::NOT_FOUND, "no such artifact\n").into_response(),
    };
    let len = file.metadata().await.map(|m| m.len()).unwrap_or(0);
    let body = axum::body::Body::from_stream(tokio_util::io::ReaderStream::new(file));
    (
        [
            (
                axum::http::header::CONTENT_TYPE,
                state.engine.daemon().store().content_type(&hex),
            ),
            (axum::http::header::CONTENT_LENGTH, len.to_string()),
            (axum::http::header::ETAG, format!("\"sha256:{hex}\"")),
        ],
        body,
    )
        .into_response()
}

async fn ws(
    State(state): State<AppState>,
    headers: HeaderMap,
    upgrade: Result<WebSocketUpgrade, axum::extract::ws::rejection::WebSocketUpgradeRejection>,
) -> Response {
    if !authorized(&headers, &state.tokens) {
        return (StatusCode::UNAUTHORIZED, "unauthorized\n").into_response();
    }
    if let Some(v) = headers.get("x-protocol-version") {
        let ok = v
            .to_str()
            .ok()
            .and_then(|s| s.trim().parse::<u64>().ok())
            .is_some_and(|n| SUPPORTED_VERSIONS.contains(&n));
        if !ok {
            let body = serde_json::json!({
                "error": "unsupported protocol version",
                "supported_versions": SUPPORTED_VERSIONS,
            });
            return (StatusCode::BAD_REQUEST, Json(body)).into_response();
        }
    }
    let upgrade = match upgrade {
        Ok(u) => u,
        Err(rejection) => return rejection.into_response(),
    };
    let max = state.engine.daemon().config().max_frame_bytes;
    let connections = state.connections.clone();
    let n = connections.count.fetch_add(1, Ordering::Relaxed);
    let open = connections.open.token();
    upgrade
        .max_message_size(max)
        .max_frame_size(max)
        .on_upgrade(move |socket| {
            let span = tracing::info_span!("connection", conn = n);
            async move {
                connection(state.engine, socket, connections.going_away).await;
                drop(open);
            }
            .instrument(span)
        })
}

//! HTTP and WebSocket: `GET /healthz`, and `/ws`, the FSP/1 endpoint with bearer auth at the upgrade.
//!
//! Each connection has one reader (this task) and one writer task. Executions send their messages through a
//! bounded, ordered queue, so a client that does not read slows its executions down instead of growing the
//! daemon's memory; `pong` and refusals go through a separate queue the writer prefers, so a `ping` is answered
//! while executions flood output.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use axum::extract::ws::{CloseFrame, Message, WebSocket, WebSocketUpgrade};
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use futures_util::{SinkExt, StreamExt};
use protocol::{
    ClientMessage, ErrorCode, ErrorMessage, RequestError, ServerMessage, SUPPORTED_VERSIONS,
};
use tokio::sync::{mpsc, watch};
use tracing::{debug, info, warn, Instrument};

use crate::capacity::Admission;
use crate::engine::{Control, Engine};

/// Messages of executions a connection buffers before executions wait (backpressure).
const EXEC_QUEUE: usize = 64;
/// Priority messages (pong, refusals) buffered; a client that sends this many requests without reading is dropped.
const PRIORITY_QUEUE: usize = 1024;
/// WebSocket close code for a message over the size limit.
const CLOSE_TOO_BIG: u16 = 1009;

/// Shared state of the HTTP server.
#[derive(Clone)]
pub struct AppState {
    /// The engine.
    pub engine: Arc<Engine>,
    /// Accepted tokens.
    pub tokens: Arc<Vec<String>>,
    /// Connection counter (for log spans).
    pub connections: Arc<AtomicU64>,
}

/// The router.
pub fn router(state: AppState) -> Router {
    Router::new()
        .route("/healthz", get(healthz))
        .route("/ws", get(ws))
        .route("/artifacts/sha256/{hex}", get(artifact))
        .with_state(state)
}

async fn healthz(State(state): State<AppState>) -> Response {
    let e = &state.engine;
    let healthy = e.helper.is_alive();
    let body = serde_json::json!({
        "status": if healthy { "ok" } else { "unhealthy" },
        "version": env!("CARGO_PKG_VERSION"),
        "uptime_s": e.started.elapsed().as_secs(),
        "active_executions": e.capacity.active(),
        "queue_depth": e.capacity.queued(),
        "max_concurrent": e.config.capacity.max_concurrent,
        "max_queue": e.config.capacity.max_queue,
        "languages": e.languages.keys().collect::<Vec<_>>(),
        // Which image each language runs on, by manifest digest (what `environment.image_digest` says).
        "images": e
            .languages
            .iter()
            .map(|(l, r)| (l.as_str().to_owned(), serde_json::json!({"image": r.image.name, "digest": r.image.digest})))
            .collect::<serde_json::Map<String, serde_json::Value>>(),
        "isolation": e.isolation,
    });
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
    let Some(path) = state.engine.store.blob(&hex) else {
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
                state.engine.store.content_type(&hex),
            ),
            (axum::http::header::CONTENT_LENGTH, len.to_string()),
            (axum::http::header::ETAG, format!("\"sha256:{hex}\"")),
        ],
        body,
    )
        .into_response()
}

/// Constant-time check of `Authorization: Bearer <token>` against every configured token.
pub(crate) fn authorized(headers: &HeaderMap, tokens: &[String]) -> bool {
    let Some(given) = headers
        .get(axum::http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
    else {
        return false;
    };
    // Compare against all tokens without stopping early, so timing says nothing about which one was close.
    tokens.iter().fold(false, |ok, t| {
        constant_time_eq::constant_time_eq(given.as_bytes(), t.as_bytes()) | ok
    })
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
    let max = state.engine.config.max_frame_bytes;
    let n = state.connections.fetch_add(1, Ordering::Relaxed);
    upgrade
        .max_message_size(max)
        .max_frame_size(max)
        .on_upgrade(move |socket| {
            let span = tracing::info_span!("connection", conn = n);
            connection(state.engine, socket).instrument(span)
        })
}

/// A queued outgoing frame.
enum Outgoing {
    Message(ServerMessage),
    Close(u16, &'static str),
}

/// The executions in flight on one connection, by id. An execution removes itself right before it sends its
/// terminal message, so a client that saw the result may reuse the id at once.
type Entries = HashMap<String, (u64, watch::Sender<Control>)>;

#[derive(Clone, Default)]
pub struct Registry {
    inner: Arc<Mutex<Entries>>,
    next: Arc<AtomicU64>,
}

impl Registry {
    fn lock(&self) -> std::sync::MutexGuard<'_, Entries> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Registers `id`; `None` if it is already in flight.
    fn register(&self, id: &str) -> Option<(Registration, watch::Receiver<Control>)> {
        let mut map = self.lock();
        if map.contains_key(id) {
            return None;
        }
        let token = self.next.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = watch::channel(Control::Run);
        map.insert(id.to_owned(), (token, tx));
        Some((
            Registration {
                registry: self.clone(),
                id: id.to_owned(),
                token,
            },
            rx,
        ))
    }

    /// Cancels `id`: `Some(true)` if it was running, `Some(false)` if already cancelling, `None` if unknown.
    fn cancel(&self, id: &str) -> Option<bool> {
        let map = self.lock();
        let (_, tx) = map.get(id)?;
        Some(tx.send_if_modified(|c| {
            let first = *c != Control::Cancel;
            *c = Control::Cancel;
            first
        }))
    }

    /// Drops every control sender: each execution sees its client gone.
    fn disconnect(&self) {
        self.lock().clear();
    }
}

/// An execution's entry in its connection's registry.
pub struct Registration {
    registry: Registry,
    id: String,
    token: u64,
}

impl Registration {
    /// Leaves the registry (idempotent; a newer execution with the same id is left alone).
    pub fn release(&self) {
        let mut map = self.registry.lock();
        if map.get(&self.id).is_some_and(|(t, _)| *t == self.token) {
            map.remove(&self.id);
        }
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        self.release();
    }
}

async fn connection(engine: Arc<Engine>, socket: WebSocket) {
    info!("connected");
    let (mut sink, mut stream) = socket.split();
    let (exec_tx, mut exec_rx) = mpsc::channel::<ServerMessage>(EXEC_QUEUE);
    let (prio_tx, mut prio_rx) = mpsc::channel::<Outgoing>(PRIORITY_QUEUE);
    let writer = tokio::spawn(
        async move {
            loop {
                let out = tokio::select! {
                    biased;
                    m = prio_rx.recv() => match m { Some(m) => m, None => break },
                    m = exec_rx.recv() => match m { Some(m) => Outgoing::Message(m), None => break },
                };
                let frame = match out {
                    Outgoing::Message(m) => Message::Text(protocol::encode(&m).into()),
                    Outgoing::Close(code, reason) => {
                        let _ = sink
                            .send(Message::Close(Some(CloseFrame {
                                code,
                                reason: reason.into(),
                            })))
                            .await;
                        break;
                    }
                };
                if sink.send(frame).await.is_err() {
                    break;
                }
            }
        }
        .in_current_span(),
    );

    let registry = Registry::default();
    let reply = |m: ServerMessage| {
        if prio_tx.try_send(Outgoing::Message(m)).is_err() {
            warn!("client does not read its replies; closing");
            return false;
        }
        true
    };
    while let Some(frame) = stream.next().await {
        let text = match frame {
            Ok(Message::Text(t)) => t,
            Ok(Message::Binary(_)) => {
                if !reply(RequestError::binary_frame().into()) {
                    break;
                }
                continue;
            }
            Ok(Message::Close(_)) => break,
            Ok(_) => continue,
            Err(e) => {
                let too_big = std::error::Error::source(&e)
                    .and_then(|s| s.downcast_ref::<tokio_tungstenite::tungstenite::Error>())
                    .is_some_and(|t| {
                        matches!(t, tokio_tungstenite::tungstenite::Error::Capacity(_))
                    });
                if too_big {
                    warn!("message over the size limit; closing with 1009");
                    let _ = prio_tx.try_send(Outgoing::Close(CLOSE_TOO_BIG, "message too big"));
                } else {
                    debug!(error = %e, "connection error");
                }
                break;
            }
        };
        let keep = match protocol::parse_client_message(&text) {
            Err(e) => reply(e.into()),
            Ok(ClientMessage::Ping(_)) => reply(ServerMessage::Pong(engine.pong())),
            Ok(ClientMessage::Cancel(c)) => match registry.cancel(&c.id) {
                Some(_) => true,
                None => reply(RequestError::unknown_execution(&c.id).into()),
            },
            Ok(ClientMessage::Execute(req)) => {
                let refusal = refuse(&engine, &req);
                match refusal {
                    Some(e) => reply(ServerMessage::Error(e)),
                    None => match req.resolve_limits(&engine.max_limits()) {
                        Err(e) => reply(e.into()),
                        Ok(limits) => match registry.register(&req.id) {
                            None => reply(RequestError::duplicate_execution(&req.id).into()),
                            Some((registration, control)) => match engine.admit() {
                                Admission::Overloaded => {
                                    drop(registration);
                                    reply(ServerMessage::Error(ErrorMessage::overloaded(&req.id)))
                                }
                                admission => {
                                    let span = tracing::info_span!("execution", id = %req.id);
                                    let engine = engine.clone();
                                    let out = exec_tx.clone();
                                    tokio::spawn(
                                        engine
                                            .run(req, limits, admission, out, control, registration)
                                            .instrument(span),
                                    );
                                    true
                                }
                            },
                        },
                    },
                }
            }
        };
        if !keep {
            break;
        }
    }
    // Executions of this connection never outlive it.
    registry.disconnect();
    drop(exec_tx);
    drop(prio_tx);
    let _ = writer.await;
    info!("disconnected");
}

/// The self-test program per language: from inside the container, check that the seccomp filter is installed, no
/// capability is held and `no_new_privs` is set, then print `self-test-ok`. Only the language's own interpreter is
/// used (an image may have no grep).
fn self_test_program(lang: protocol::Language) -> &'static str {
    match lang {
        protocol::Language::Shell => {
            r#"ok=0
while IFS=: read -r k v; do
  v=$(echo $v)
  case "$k" in
    Seccomp) [ "$v" = 2 ] && ok=$((ok+1)) ;;
    CapEff|CapBnd) [ "$v" = 0000000000000000 ] && ok=$((ok+1)) ;;
    NoNewPrivs) [ "$v" = 1 ] && ok=$((ok+1)) ;;
  esac
done < /proc/self/status
[ "$ok" = 4 ] && echo self-test-ok"#
        }
        protocol::Language::Python => {
            r#"s = {k: v.strip() for k, v in (l.split(":", 1) for l in open("/proc/self/status"))}
z = "0" * 16
ok = s["Seccomp"] == "2" and s["CapEff"] == z and s["CapBnd"] == z and s["NoNewPrivs"] == "1"
print("self-test-ok" if ok else s)"#
        }
        protocol::Language::Javascript => {
            r#"const s = Object.fromEntries(require("fs").readFileSync("/proc/self/status", "utf8").trim().split("\n")
  .map((l) => { const i = l.indexOf(":"); return [l.slice(0, i), l.slice(i + 1).trim()]; }));
const z = "0".repeat(16);
const ok = s.Seccomp === "2" && s.CapEff === z && s.CapBnd === z && s.NoNewPrivs === "1";
console.log(ok ? "self-test-ok" : JSON.stringify(s));"#
        }
        protocol::Language::Elixir => {
            r#"s = File.read!("/proc/self/status") |> String.split("\n", trim: true) |> Map.new(fn l -> [k, v] = String.split(l, ":", parts: 2); {k, String.trim(v)} end)
z = String.duplicate("0", 16)
IO.puts(if s["Seccomp"] == "2" and s["CapEff"] == z and s["CapBnd"] == z and s["NoNewPrivs"] == "1", do: "self-test-ok", else: inspect(s))"#
        }
    }
}

/// Runs one real execution per configured language before the daemon serves (see [`self_test_program`]). A daemon
/// that cannot run them (a state directory the container user cannot traverse, a broken image, an interpreter that
/// does not start) refuses to start instead of reporting healthy and failing every execution.
pub async fn self_test(engine: Arc<Engine>) -> Result<(), String> {
    let languages: Vec<protocol::Language> = engine.languages.keys().copied().collect();
    for lang in languages {
        self_test_one(engine.clone(), lang)
            .await
            .map_err(|e| format!("{lang}: {e}"))?;
    }
    Ok(())
}

async fn self_test_one(engine: Arc<Engine>, lang: protocol::Language) -> Result<(), String> {
    let registry = Registry::default();
    let id = format!("sandboxd-self-test-{lang}");
    let (registration, control) = registry.register(&id).ok_or("self-test id in use")?;
    let max = engine.max_limits();
    // Interpreters like the BEAM need more than the default 64 MiB to start.
    let req = protocol::ExecuteRequest::new(
        &id,
        lang,
        self_test_program(lang),
        protocol::RequestedLimits::new(max.timeout_ms.min(60_000), max.memory_mb.min(512)),
    );
    let limits = req.resolve_limits(&max).map_err(|e| e.message)?;
    let admission = engine.admit();
    let (tx, mut rx) = mpsc::channel(16);
    let task = tokio::spawn(
        engine
            .clone()
            .run(req, limits, admission, tx, control, registration),
    );
    let (mut stdout, mut stderr) = (String::new(), String::new());
    let mut outcome = Err("the self-test execution ended without a result".to_owned());
    while let Some(m) = rx.recv().await {
        match m {
            ServerMessage::Stdout(c) => stdout.push_str(&c.data),
            ServerMessage::Stderr(c) => stderr.push_str(&c.data),
            ServerMessage::Result(r)
                if r.exit_code == Some(0) && stdout.contains("self-test-ok") =>
            {
                outcome = Ok(());
                break;
            }
            ServerMessage::Result(r) => {
                let tail: String = format!("{stdout}{stderr}").chars().take(400).collect();
                outcome = Err(format!(
                    "the self-test execution ended {:?} (exit {:?}): an isolation layer is not in effect or the interpreter does not run; output: {tail:?}",
                    r.reason, r.exit_code
                ));
                break;
            }
            ServerMessage::Error(e) => {
                outcome = Err(format!("the self-test execution failed: {}", e.message));
                break;
            }
            _ => {}
        }
    }
    // The execution frees its slot only after its container is removed: wait for that, so the next self-test
    // finds a free slot even with `max_concurrent: 1` and no queue. The control sender (the registry) stays alive
    // until then so the execution is not seen as disconnected.
    drop(rx);
    let _ = task.await;
    drop(registry);
    outcome
}

/// Refusals that need the engine: language availability, unsupported extensions, files bigger than the scratch.
fn refuse(engine: &Engine, req: &protocol::ExecuteRequest) -> Option<ErrorMessage> {
    let id = Some(req.id.clone());
    if !engine.languages.contains_key(&req.language) {
        return Some(ErrorMessage::from(RequestError::language_not_supported(
            &req.id,
            req.language.as_str(),
        )));
    }
    if let Some(a) = &req.artifacts {
        if let Err(e) =
            runtime::artifacts::Patterns::new(&a.paths, &a.types.clone().unwrap_or_default())
        {
            return Some(ErrorMessage::new(
                id,
                ErrorCode::InvalidRequest,
                format!("Field artifacts.paths: {e}"),
            ));
        }
    }
    let disk_mb = req
        .limits
        .disk_mb
        .unwrap_or(protocol::Limits::DEFAULTS.disk_mb);
    let total: u64 = req
        .files
        .iter()
        .map(|f| f.decoded().map(|c| c.len() as u64).unwrap_or(0))
        .sum();
    if total > disk_mb << 20 {
        return Some(ErrorMessage::new(
            id,
            ErrorCode::InvalidRequest,
            format!("Field files: {total} bytes do not fit in limits.disk_mb ({disk_mb} MiB)"),
        ));
    }
    None
}

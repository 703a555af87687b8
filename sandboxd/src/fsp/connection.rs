//! One FSP/1 connection: one reader (the connection's task) and one writer task. Executions send their messages
//! through a bounded, ordered queue, so a client that does not read slows its executions down instead of growing
//! the daemon's memory; `pong` and refusals go through a separate queue the writer prefers, so a `ping` is answered
//! while executions flood output.

use std::sync::Arc;

use axum::extract::ws::{CloseFrame, Message, WebSocket};
use futures_util::{SinkExt, StreamExt};
use protocol::{ClientMessage, ErrorCode, ErrorMessage, RequestError, ServerMessage};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn, Instrument};

use crate::config::CONNECTIONS_CLOSE;
use crate::exec::capacity::Admission;
use crate::exec::engine::Engine;
use crate::exec::registry::Registry;

/// Messages of executions a connection buffers before executions wait (backpressure).
const EXEC_QUEUE: usize = 64;
/// Priority messages (pong, refusals) buffered; a client that sends this many requests without reading is dropped.
const PRIORITY_QUEUE: usize = 1024;
/// WebSocket close code for a message over the size limit.
const CLOSE_TOO_BIG: u16 = 1009;
/// WebSocket close code when the daemon shuts down (going away).
const CLOSE_GOING_AWAY: u16 = 1001;

/// A queued outgoing frame.
enum Outgoing {
    Message(ServerMessage),
    Close(u16, &'static str),
}

/// Serves one upgraded socket until the client leaves or the daemon asks it to end (`going_away`).
pub(super) async fn connection(
    engine: Arc<Engine>,
    socket: WebSocket,
    going_away: CancellationToken,
) {
    info!("connected");
    let (sink, mut stream) = socket.split();
    let (exec_tx, exec_rx) = mpsc::channel::<ServerMessage>(EXEC_QUEUE);
    let (prio_tx, prio_rx) = mpsc::channel::<Outgoing>(PRIORITY_QUEUE);
    let writer = tokio::spawn(write(sink, prio_rx, exec_rx, going_away.clone()).in_current_span());

    let registry = Registry::default();
    let reply = |m: ServerMessage| {
        if prio_tx.try_send(Outgoing::Message(m)).is_err() {
            warn!("client does not read its replies; closing");
            return false;
        }
        true
    };
    let shutdown = loop {
        let frame = tokio::select! {
            biased;
            _ = going_away.cancelled() => break true,
            frame = stream.next() => frame,
        };
        let Some(frame) = frame else { break false };
        let text = match frame {
            Ok(Message::Text(t)) => t,
            Ok(Message::Binary(_)) => {
                if !reply(RequestError::binary_frame().into()) {
                    break false;
                }
                continue;
            }
            Ok(Message::Close(_)) => break false,
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
                break false;
            }
        };
        let keep = match protocol::parse_client_message(&text) {
            Err(e) => reply(e.into()),
            Ok(ClientMessage::Ping(_)) => reply(ServerMessage::Pong(engine.pong())),
            Ok(ClientMessage::ToolResult(result)) => {
                registry.tool_result(result);
                true
            }
            Ok(ClientMessage::Cancel(c)) => match registry.cancel(&c.id) {
                Some(_) => true,
                None => reply(RequestError::unknown_execution(&c.id).into()),
            },
            Ok(ClientMessage::Execute(req)) => match execute(&engine, &registry, &exec_tx, req) {
                None => true,
                Some(refusal) => reply(refusal),
            },
        };
        if !keep {
            break false;
        }
    };
    // Executions of this connection never outlive it.
    registry.disconnect();
    drop(exec_tx);
    drop(prio_tx);
    // At shutdown the writer ends once it has written everything queued, and the close frame comes after that.
    if let Ok(Some(mut sink)) = writer.await {
        if shutdown {
            let close = CloseFrame {
                code: CLOSE_GOING_AWAY,
                reason: "sandboxd is shutting down".into(),
            };
            if sink.send(Message::Close(Some(close))).await.is_ok() {
                // Read on until the client's close (or its end): a socket closed with unread data resets the
                // connection, and the last messages still in its send buffer would be lost.
                let answered = async {
                    while let Some(Ok(m)) = stream.next().await {
                        if let Message::Close(_) = m {
                            break;
                        }
                    }
                };
                let _ = tokio::time::timeout(CONNECTIONS_CLOSE, answered).await;
            }
        }
    }
    info!("disconnected");
}

/// Messages written at most in one go by [`write`] (a busy connection still flushes, and yields, between them).
const MAX_BATCH: usize = 64;

/// The connection's writer: priority frames (pong, refusals, close) first, then the executions' messages. The
/// messages already queued go out in one write (an execution's terminal status and result, say), so the client
/// wakes once for them.
///
/// Once the connection ended (the priority queue closed), the executions' messages still queued are written only at
/// shutdown (`going_away`: the drain has ended the executions, these are their last messages); after a client's
/// disconnect they are dropped with the executions. Returns the sink unless a write failed, to close the
/// connection after the last message at shutdown.
async fn write(
    mut sink: futures_util::stream::SplitSink<WebSocket, Message>,
    mut prio_rx: mpsc::Receiver<Outgoing>,
    mut exec_rx: mpsc::Receiver<ServerMessage>,
    going_away: CancellationToken,
) -> Option<futures_util::stream::SplitSink<WebSocket, Message>> {
    let mut queued = 0usize;
    loop {
        let ready = match queued < MAX_BATCH {
            true => match prio_rx.try_recv() {
                Ok(m) => Some(m),
                Err(_) => exec_rx.try_recv().ok().map(Outgoing::Message),
            },
            false => None,
        };
        let out = match ready {
            Some(m) => m,
            None => {
                if queued > 0 {
                    if sink.flush().await.is_err() {
                        return None;
                    }
                    queued = 0;
                }
                tokio::select! {
                    biased;
                    m = prio_rx.recv() => match m {
                        Some(m) => m,
                        None if going_away.is_cancelled() => match exec_rx.recv().await {
                            Some(m) => Outgoing::Message(m),
                            None => break,
                        },
                        None => break,
                    },
                    m = exec_rx.recv() => match m { Some(m) => Outgoing::Message(m), None => break },
                }
            }
        };
        let frame = match out {
            Outgoing::Message(m) => {
                if let ServerMessage::Error(e) = &m {
                    crate::observe::metrics::error_sent(e.code);
                }
                Message::Text(protocol::encode(&m).into())
            }
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
        if sink.feed(frame).await.is_err() {
            return None;
        }
        queued += 1;
    }
    sink.flush().await.ok().map(|()| sink)
}

/// An `execute`: refused at once (`Some`: the message to reply with), or admitted and started in a task of its own.
fn execute(
    engine: &Arc<Engine>,
    registry: &Registry,
    exec_tx: &mpsc::Sender<ServerMessage>,
    req: protocol::ExecuteRequest,
) -> Option<ServerMessage> {
    if let Some(e) = refuse(engine, &req) {
        return Some(ServerMessage::Error(e));
    }
    let limits = match req.resolve_limits(&engine.max_limits()) {
        Ok(l) => l,
        Err(e) => return Some(e.into()),
    };
    let Some((registration, control)) = registry.register(&req.id) else {
        return Some(RequestError::duplicate_execution(&req.id).into());
    };
    match engine.admit() {
        Admission::Overloaded => {
            drop(registration);
            Some(ServerMessage::Error(ErrorMessage::overloaded(&req.id)))
        }
        admission => {
            let span = tracing::info_span!("execution", id = %req.id);
            if let Some(parent) = &req.traceparent {
                crate::observe::telemetry::set_parent(&span, parent);
            }
            engine.daemon().spawn_execution(
                engine
                    .clone()
                    .run(
                        req,
                        limits,
                        admission,
                        exec_tx.clone(),
                        control,
                        registration,
                    )
                    .instrument(span),
            );
            None
        }
    }
}

/// Refusals that need the engine: language availability, unsupported extensions, unknown volumes, files bigger
/// than the scratch.
fn refuse(engine: &Engine, req: &protocol::ExecuteRequest) -> Option<ErrorMessage> {
    let id = Some(req.id.clone());
    if engine.language(req.language).is_none() {
        return Some(ErrorMessage::from(RequestError::language_not_supported(
            &req.id,
            req.language.as_str(),
        )));
    }
    if let Err(e) = req.resolve_tool_timeout(engine.daemon().config().tools.max_call_timeout_ms) {
        return Some(e.into());
    }
    if req.network.is_some() {
        let checked = match engine.egress() {
            Some(egress) => egress.check(req).map(drop),
            None => Err(ErrorMessage::new(
                id.clone(),
                ErrorCode::InvalidRequest,
                "Field network: the network extension is not enabled on this server",
            )),
        };
        if let Err(refusal) = checked {
            return Some(refusal);
        }
    }
    if let Err(message) = engine
        .check_mounts(req)
        .and_then(|()| engine.check_snapshot(req))
    {
        return Some(ErrorMessage::new(id, ErrorCode::InvalidRequest, message));
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

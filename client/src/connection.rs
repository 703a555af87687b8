//! One FSP/1 connection that keeps itself connected.
//!
//! A [`Connection`] is a handle to a driver task that owns the WebSocket. The driver has a reader and a writer
//! running side by side:
//!
//! - the writer sends what callers queue (a bounded queue: a caller waits when it is full);
//! - the reader parses every frame with [`protocol::parse_server_envelope`] and routes it by `id` to the
//!   execution it belongs to, over that execution's bounded event channel. When a consumer does not keep up, the
//!   reader waits for it: the server's own bounded queues then fill and the program blocks on its output, so a slow
//!   consumer costs no memory anywhere (it does hold up the other executions multiplexed on the same connection;
//!   the pool runs one execution per checked-out connection, so there it only holds up its own).
//!
//! When the link drops, every execution in flight fails with [`ClientError::Disconnected`] (retryable) and pending
//! pings fail; the driver reconnects on the [`Backoff`](crate::Backoff) schedule (first retry at once, then
//! 100 ms doubling to 30 s, at most 10 retries), asking the [`Auth`](crate::Auth) for the token each time. When the
//! retries are used up, the connection is [`ConnectionStatus::Failed`] for good and a pool replaces it.
//!
//! A frame that does not parse is logged (`tracing::error!`, with the frame's start) and fails the executions it may
//! concern with [`ClientError::Malformed`] (not retryable): the one whose `id` it carries, or, when no `id` can be read
//! from it, every execution in flight on the connection (the original design's rule, `docs/spec/fsp-v1.md` Appendix A).
//! Those executions are cancelled on the server. The connection itself stays open.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::stream::{SplitSink, SplitStream};
use futures_util::{SinkExt, StreamExt};
use protocol::{ClientMessage, ExecuteRequest, PingRequest, Pong, ServerMessage};
use tokio::net::TcpStream;
use tokio::sync::{mpsc, oneshot, watch, Notify};
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::http::{header, HeaderValue};
use tokio_tungstenite::tungstenite::protocol::WebSocketConfig;
use tokio_tungstenite::tungstenite::{self, Message};
use tokio_tungstenite::{Connector, MaybeTlsStream, WebSocketStream};
use tracing::{debug, error, info, warn};

use crate::config::{ConnectOptions, ExecOptions};
use crate::error::ClientError;
use crate::execute::Execute;
use crate::execution::{Execution, Parts};
pub use crate::session::ConnectionStatus;
use crate::session::{encode, Handle, Pending, Shared, State};

/// Frames callers may queue for the writer before they wait.
const OUTBOX: usize = 64;
/// Events of one execution buffered for its consumer before the reader waits for it.
const EVENTS: usize = 64;
/// How much of a malformed frame is logged.
const LOGGED_FRAME_BYTES: usize = 512;
/// How long a closing connection tries to send its close frame.
const CLOSE_GRACE: Duration = Duration::from_secs(1);

type Ws = WebSocketStream<MaybeTlsStream<TcpStream>>;

/// A connection to sandboxd. Cheap to clone (clones share the connection); the connection closes when the last
/// clone is dropped or [`close`](Self::close) is called.
///
/// Any number of executions may run on one connection at once (FSP/1 tells them apart by `id`).
#[derive(Clone)]
pub struct Connection {
    handle: Arc<Handle>,
}

impl std::fmt::Debug for Connection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Connection")
            .field("url", &self.handle.shared.options.url)
            .field("status", &self.status())
            .finish()
    }
}

impl Connection {
    /// Opens a connection (one attempt, within the connect timeout) and starts its driver. Later link losses are
    /// handled by reconnecting on the backoff schedule.
    pub async fn connect(options: ConnectOptions) -> Result<Connection, ClientError> {
        Connection::connect_shared(options.validated()?).await
    }

    pub(crate) async fn connect_shared(
        options: Arc<ConnectOptions>,
    ) -> Result<Connection, ClientError> {
        let ws = open(&options).await?;
        let (status, _) = watch::channel(ConnectionStatus::Connected);
        let shared = Arc::new(Shared {
            options,
            state: Mutex::new(State::default()),
            close: Notify::new(),
            status,
            next_token: AtomicU64::new(0),
        });
        // The link is installed before the driver runs, so the connection is usable as soon as this returns.
        let (out_tx, out_rx) = mpsc::channel(OUTBOX);
        let generation = shared.install_link(out_tx);
        tokio::spawn(drive(shared.clone(), ws, out_rx, generation));
        Ok(Connection {
            handle: Arc::new(Handle { shared }),
        })
    }

    /// The endpoint.
    pub fn url(&self) -> &str {
        &self.handle.shared.options.url
    }

    /// Where the connection is now.
    pub fn status(&self) -> ConnectionStatus {
        *self.handle.shared.status.borrow()
    }

    /// Follows [`status`](Self::status) changes.
    pub fn watch_status(&self) -> watch::Receiver<ConnectionStatus> {
        self.handle.shared.status.subscribe()
    }

    /// Executions in flight on this connection.
    pub fn in_flight(&self) -> usize {
        self.handle.shared.lock().pending.len()
    }

    /// Closes the connection: the driver sends a close frame and stops; executions still in flight fail with
    /// [`ClientError::Closed`] (the server kills them).
    pub fn close(&self) {
        self.handle.shared.close();
    }

    /// Sends `ping` and waits up to `within` for the `pong` (load and capabilities).
    pub async fn ping(&self, within: Duration) -> Result<Pong, ClientError> {
        let shared = &self.handle.shared;
        let (tx, rx) = oneshot::channel();
        let out = {
            let mut st = shared.lock();
            let out = st.sender(shared)?;
            st.pings.push_back(tx);
            out
        };
        let frame = encode(&ClientMessage::Ping(PingRequest::new()))?;
        let wait = async {
            out.send(frame).await.map_err(|_| {
                ClientError::disconnected("the connection closed before the ping was sent")
            })?;
            rx.await
                .map_err(|_| ClientError::disconnected("the connection closed before the pong"))
        };
        match tokio::time::timeout(within, wait).await {
            Ok(r) => r,
            Err(_) => Err(ClientError::Unresponsive { after: within }),
        }
    }
}

/// Runs requests on this connection, multiplexed with the others in flight on it (see [`Execute`]).
impl Execute for Connection {
    async fn execute_stream_with(
        &self,
        request: ExecuteRequest,
        options: ExecOptions,
    ) -> Result<Execution, ClientError> {
        request.validate().map_err(ClientError::InvalidRequest)?;
        let shared = &self.handle.shared;
        let id = request.id.clone();
        let limits = request.limits;
        let frame = encode(&ClientMessage::Execute(request))?;
        let (events_tx, events_rx) = mpsc::channel(EVENTS);
        let (fail_tx, fail_rx) = oneshot::channel();
        let token = shared.next_token.fetch_add(1, Ordering::Relaxed);
        let (out, generation) = {
            let mut st = shared.lock();
            let out = st.sender(shared)?;
            if st.pending.contains_key(&id) {
                return Err(ClientError::DuplicateId { id });
            }
            st.pending.insert(
                id.clone(),
                Pending {
                    events: events_tx,
                    fail: fail_tx,
                    acked: false,
                    token,
                },
            );
            (out, st.generation)
        };
        let (first, on_running) =
            options.deadlines(limits.timeout_ms, shared.options.deadline_grace);
        // Built before sending: if this future is dropped while the frame waits for room, the execution's drop
        // takes it out of the connection again.
        let execution = Execution::new(Parts {
            id,
            handle: self.handle.clone(),
            generation,
            token,
            events: events_rx,
            failure: fail_rx,
            deadline: first,
            deadline_on_running: on_running,
            max_output_bytes: limits
                .max_output_bytes
                .unwrap_or(protocol::Limits::DEFAULTS.max_output_bytes),
        });
        // A failed send means the link is gone: the driver fails the execution (it is registered), and the
        // stream reports it.
        let _ = out.send(frame).await;
        Ok(execution)
    }
}

/// Opens a WebSocket to the endpoint: asks the auth for the token, sends `Authorization: Bearer` and
/// `X-Protocol-Version: 1`. All of it within the connect timeout.
async fn open(options: &ConnectOptions) -> Result<Ws, ClientError> {
    match tokio::time::timeout(options.connect_timeout, open_unbounded(options)).await {
        Ok(result) => result,
        Err(_) => Err(ClientError::ConnectTimeout {
            url: options.url.clone(),
            after: options.connect_timeout,
        }),
    }
}

async fn open_unbounded(options: &ConnectOptions) -> Result<Ws, ClientError> {
    let token = options
        .auth
        .current()
        .await
        .map_err(|e| ClientError::Token {
            source: Arc::from(e),
        })?;
    let mut request = options
        .url
        .as_str()
        .into_client_request()
        .map_err(|e| ClientError::Config(format!("URL {:?}: {e}", options.url)))?;
    if let Some(token) = token {
        let value = HeaderValue::from_str(&format!("Bearer {token}")).map_err(|_| {
            ClientError::Config("the token contains characters a header cannot carry".into())
        })?;
        request.headers_mut().insert(header::AUTHORIZATION, value);
    }
    request
        .headers_mut()
        .insert("x-protocol-version", HeaderValue::from_static("1"));
    let config = WebSocketConfig::default()
        .max_message_size(Some(options.max_message_bytes))
        .max_frame_size(Some(options.max_message_bytes));
    let connector = match &options.tls {
        Some(tls) if options.is_tls() => Connector::Rustls(tls.clone()),
        _ => Connector::Plain,
    };
    let connecting = tokio_tungstenite::connect_async_tls_with_config(
        request,
        Some(config),
        // No Nagle: a ping or a cancel must not wait for the server's delayed ACK.
        true,
        Some(connector),
    );
    match connecting.await {
        Ok((ws, _)) => Ok(ws),
        Err(tungstenite::Error::Http(response)) => {
            let status = response.status().as_u16();
            if status == 401 {
                return Err(ClientError::Unauthorized);
            }
            let body = response
                .body()
                .as_deref()
                .map(|b| excerpt(&String::from_utf8_lossy(b), 200).to_owned())
                .unwrap_or_default();
            Err(ClientError::Handshake { status, body })
        }
        Err(e) => Err(ClientError::Connect {
            url: options.url.clone(),
            source: Arc::new(e),
        }),
    }
}

/// Why a link ended.
enum LinkEnd {
    /// The owner closed the connection.
    Closed,
    /// The link broke.
    Lost(String),
}

/// The driver: runs the link, and on loss fails what was in flight and reconnects.
async fn drive(
    shared: Arc<Shared>,
    mut ws: Ws,
    mut out_rx: mpsc::Receiver<Message>,
    mut generation: u64,
) {
    let url = shared.options.url.clone();
    loop {
        // The writer queue goes with the link: once the link is gone, sending on it fails at once.
        let end = run_link(&shared, ws, out_rx, generation).await;
        match end {
            LinkEnd::Closed => break,
            LinkEnd::Lost(reason) => {
                if shared.is_closed() {
                    break;
                }
                warn!(%url, %reason, "connection to the sandbox lost; reconnecting");
                // The status says so before anyone hears of the failure.
                shared.set_status(ConnectionStatus::Reconnecting { attempt: 1 });
                shared.link_lost(|| ClientError::disconnected(reason.clone()));
            }
        }
        match reconnect(&shared).await {
            Some(new_ws) => {
                let (out_tx, new_rx) = mpsc::channel(OUTBOX);
                out_rx = new_rx;
                generation = shared.install_link(out_tx);
                ws = new_ws;
            }
            None if shared.is_closed() => break,
            None => {
                shared.lock().failed = true;
                shared.set_status(ConnectionStatus::Failed);
                shared
                    .link_lost(|| ClientError::disconnected("the connection gave up reconnecting"));
                return;
            }
        }
    }
    shared.link_lost(|| ClientError::Closed);
    shared.set_status(ConnectionStatus::Closed);
    debug!(%url, "connection closed");
}

/// Retries on the backoff schedule; `None` when closed or out of retries.
async fn reconnect(shared: &Arc<Shared>) -> Option<Ws> {
    let backoff = shared.options.backoff;
    let url = &shared.options.url;
    for retry in 1..=backoff.max_retries {
        shared.set_status(ConnectionStatus::Reconnecting { attempt: retry });
        let delay = backoff.delay(retry);
        if !delay.is_zero() {
            tokio::select! {
                () = tokio::time::sleep(delay) => {}
                () = shared.close.notified() => return None,
            }
        }
        if shared.is_closed() {
            return None;
        }
        let result = tokio::select! {
            r = open(&shared.options) => r,
            () = shared.close.notified() => return None,
        };
        match result {
            Ok(ws) => {
                info!(%url, retry, "reconnected to the sandbox");
                return Some(ws);
            }
            Err(e) => {
                let next = (retry < backoff.max_retries).then(|| backoff.delay(retry + 1));
                warn!(%url, retry, error = %e, next_retry_in = ?next, "reconnect failed");
            }
        }
    }
    error!(%url, retries = backoff.max_retries, "giving up reconnecting to the sandbox");
    None
}

/// Runs one link until it breaks or the connection is closed.
async fn run_link(
    shared: &Arc<Shared>,
    ws: Ws,
    mut out_rx: mpsc::Receiver<Message>,
    generation: u64,
) -> LinkEnd {
    let (mut sink, mut stream) = ws.split();
    let end = tokio::select! {
        end = read_loop(shared, &mut stream, generation) => end,
        end = write_loop(&mut sink, &mut out_rx) => end,
        () = shared.close.notified() => LinkEnd::Closed,
    };
    if matches!(end, LinkEnd::Closed) {
        // Best effort: what is queued (the close frame last), then stop.
        let _ = tokio::time::timeout(CLOSE_GRACE, async {
            while let Ok(m) = out_rx.try_recv() {
                if sink.feed(m).await.is_err() {
                    return;
                }
            }
            let _ = sink.close().await;
        })
        .await;
    }
    end
}

async fn write_loop(
    sink: &mut SplitSink<Ws, Message>,
    out_rx: &mut mpsc::Receiver<Message>,
) -> LinkEnd {
    while let Some(m) = out_rx.recv().await {
        let closing = matches!(m, Message::Close(_));
        if let Err(e) = sink.send(m).await {
            return LinkEnd::Lost(format!("send failed: {e}"));
        }
        if closing {
            return LinkEnd::Closed;
        }
    }
    LinkEnd::Closed
}

async fn read_loop(shared: &Arc<Shared>, stream: &mut SplitStream<Ws>, generation: u64) -> LinkEnd {
    loop {
        let frame = match stream.next().await {
            None => return LinkEnd::Lost("connection closed".to_owned()),
            Some(Err(e)) => return LinkEnd::Lost(e.to_string()),
            Some(Ok(frame)) => frame,
        };
        match frame {
            Message::Text(text) => dispatch(shared, text.as_str(), generation).await,
            Message::Binary(bytes) => {
                malformed(
                    shared,
                    generation,
                    None,
                    &format!("{} bytes", bytes.len()),
                    "a binary frame (FSP/1 sends text frames only)".to_owned(),
                );
            }
            Message::Close(frame) => {
                let why = frame
                    .map(|f| format!("closed by the server ({} {})", f.code, f.reason))
                    .unwrap_or_else(|| "closed by the server".to_owned());
                return LinkEnd::Lost(why);
            }
            Message::Ping(_) | Message::Pong(_) | Message::Frame(_) => {}
        }
    }
}

/// Routes one text frame.
async fn dispatch(shared: &Arc<Shared>, text: &str, generation: u64) {
    let envelope = match protocol::parse_server_envelope(text) {
        Ok(envelope) => envelope,
        Err(e) => {
            let id = serde_json::from_str::<serde_json::Value>(text)
                .ok()
                .and_then(|v| v.get("id")?.as_str().map(str::to_owned));
            malformed(shared, generation, id, text, e.to_string());
            return;
        }
    };
    let id = match &envelope.message {
        ServerMessage::Pong(pong) => {
            let mut st = shared.lock();
            let mut pong = pong.clone();
            loop {
                let Some(waiter) = st.pings.pop_front() else {
                    debug!("pong nobody waits for");
                    break;
                };
                match waiter.send(pong) {
                    Ok(()) => break,
                    // That ping gave up waiting; the pong goes to the next one.
                    Err(p) => pong = p,
                }
            }
            return;
        }
        ServerMessage::Error(e) if e.id.is_none() => {
            // The server could not read one of our frames. Only an execution it never acknowledged can be the
            // one: fail those.
            let victims: Vec<(String, Pending)> = {
                let mut st = shared.lock();
                let ids: Vec<String> = st
                    .pending
                    .iter()
                    .filter(|(_, p)| !p.acked)
                    .map(|(id, _)| id.clone())
                    .collect();
                ids.into_iter()
                    .filter_map(|id| st.pending.remove(&id).map(|p| (id, p)))
                    .collect()
            };
            warn!(code = %e.code, message = %e.message, executions = ?victims.iter().map(|(id, _)| id).collect::<Vec<_>>(),
                "the sandbox sent an error without id; failing the executions it has not acknowledged");
            for (_, p) in victims {
                p.fail(ClientError::from(e.clone()));
            }
            return;
        }
        message => match message.id() {
            Some(id) => id.to_owned(),
            None => return,
        },
    };
    let terminal = envelope.message.is_terminal();
    let is_ack = matches!(envelope.message, ServerMessage::Ack { .. });
    let (events, token) = {
        let mut st = shared.lock();
        let Some(p) = st.pending.get_mut(&id) else {
            debug!(%id, kind = envelope.message.type_name(), "message for an execution no longer followed");
            return;
        };
        if is_ack {
            p.acked = true;
        }
        let token = p.token;
        if terminal {
            // Out of the connection before the consumer sees the end, so the id is free again by then.
            match st.pending.remove(&id) {
                Some(p) => (p.events, token),
                None => return,
            }
        } else {
            (p.events.clone(), token)
        }
    };
    // Backpressure: wait until the consumer has room.
    if events.send(envelope).await.is_err() && !terminal {
        // The consumer is gone without saying so: stop following the execution and cancel it.
        if shared.forget(&id, token) {
            shared.cancel_soon(&id, generation);
        }
    }
}

/// Logs a malformed frame and fails the executions it may concern.
fn malformed(
    shared: &Arc<Shared>,
    generation: u64,
    id: Option<String>,
    frame: &str,
    reason: String,
) {
    let victims: Vec<(String, Pending)> = {
        let mut st = shared.lock();
        match id.as_deref().filter(|id| st.pending.contains_key(*id)) {
            Some(id) => st
                .pending
                .remove(id)
                .map(|p| (id.to_owned(), p))
                .into_iter()
                .collect(),
            None => st.pending.drain().collect(),
        }
    };
    let ids: Vec<&str> = victims.iter().map(|(id, _)| id.as_str()).collect();
    error!(
        url = %shared.options.url,
        error = %reason,
        frame = %excerpt(frame, LOGGED_FRAME_BYTES),
        frame_id = ?id,
        executions = ?ids,
        "malformed message from the sandbox; failing the executions it may concern"
    );
    for (id, p) in victims {
        p.fail(ClientError::Malformed {
            reason: reason.clone(),
        });
        shared.cancel_soon(&id, generation);
    }
}

/// At most `max` bytes of `s`, cut on a character boundary.
fn excerpt(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn excerpts_cut_on_char_boundaries() {
        assert_eq!(excerpt("abc", 10), "abc");
        assert_eq!(excerpt("abcdef", 3), "abc");
        assert_eq!(excerpt("aé", 2), "a");
    }
}

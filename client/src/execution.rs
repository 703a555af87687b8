//! One execution: the [`Execution`] stream of its events, and the [`ExecutionResult`] they add up to.

use std::borrow::Cow;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use futures_util::Stream;
use protocol::{
    ExecStatus, Limits, NetworkUsage, Reason, ResourceUsage, ResultMessage, ServerEnvelope,
    ServerMessage,
};
use tokio::sync::{mpsc, oneshot};
use tokio::time::{Instant, Sleep};

use crate::error::ClientError;
use crate::session::Handle;
use crate::tools::ToolOutcome;

/// What a [`Connection`](crate::Connection) hands to a new [`Execution`].
pub(crate) struct Parts {
    pub(crate) id: String,
    /// The connection's handle: the execution keeps the connection open until it ends.
    pub(crate) handle: Arc<Handle>,
    pub(crate) generation: u64,
    pub(crate) token: u64,
    pub(crate) events: mpsc::Receiver<ServerEnvelope>,
    pub(crate) failure: oneshot::Receiver<ClientError>,
    /// Client deadline counted from sending.
    pub(crate) deadline: Option<Duration>,
    /// Client deadline counted again from `status: running`.
    pub(crate) deadline_on_running: Option<Duration>,
    /// The output limit requested (the `ack` tells the one in effect).
    pub(crate) max_output_bytes: u64,
}

/// The client deadline of an execution.
struct Deadline {
    sleep: Pin<Box<Sleep>>,
    after: Duration,
    on_running: Option<Duration>,
}

/// An execution in flight: a [`Stream`] of its server messages (with their envelope), in the order they arrive.
///
/// The stream yields `ack`, `status`, `stdout`/`stderr` and finally `result`, then ends. A server `error` for the
/// execution ends it with `Err(`[`ClientError::Server`]`)`; a lost connection with
/// `Err(`[`ClientError::Disconnected`]`)` (retryable); a malformed message with
/// `Err(`[`ClientError::Malformed`]`)`; the client deadline with `Err(`[`ClientError::Timeout`]`)` after sending
/// `cancel`. The deadline is checked while the stream is polled.
///
/// Events are buffered in a bounded channel (64 deep); a consumer that stops polling
/// applies backpressure all the way to the program's output pipe. Dropping the stream before its end cancels the
/// execution on the server. A stream from a [`Pool`](crate::Pool) keeps its connection checked out until the end.
pub struct Execution {
    id: String,
    handle: Arc<Handle>,
    generation: u64,
    token: u64,
    events: mpsc::Receiver<ServerEnvelope>,
    failure: oneshot::Receiver<ClientError>,
    deadline: Option<Deadline>,
    max_output_bytes: u64,
    done: bool,
    /// Whatever must stay alive until the execution ends (a pool's checked-out connection).
    lease: Option<Box<dyn Send + Sync>>,
    /// The first event, read ahead by [`wait_ack`](Self::wait_ack) and handed out first.
    read_ahead: Option<ServerEnvelope>,
    /// The fleet node it runs on, once acknowledged there.
    node: Option<NodeWatch>,
}

/// The fleet node an execution runs on, and a future that completes (with the reason) when the fleet declares
/// the node lost.
pub(crate) struct NodeWatch {
    pub(crate) url: Arc<str>,
    pub(crate) lost: Pin<Box<dyn Future<Output = String> + Send + Sync>>,
}

impl std::fmt::Debug for Execution {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Execution")
            .field("id", &self.id)
            .field("done", &self.done)
            .finish()
    }
}

impl Execution {
    pub(crate) fn new(parts: Parts) -> Self {
        let deadline = parts.deadline.map(|after| Deadline {
            sleep: Box::pin(tokio::time::sleep(after)),
            after,
            on_running: parts.deadline_on_running,
        });
        Execution {
            id: parts.id,
            handle: parts.handle,
            generation: parts.generation,
            token: parts.token,
            events: parts.events,
            failure: parts.failure,
            deadline,
            max_output_bytes: parts.max_output_bytes,
            done: false,
            lease: None,
            read_ahead: None,
            node: None,
        }
    }

    /// Reads up to the first event: `Ok` once the server took the execution (its `ack`, or any later event, which
    /// is kept and handed out first), the error when it refused it or the connection failed before. Used by a
    /// fleet to decide whether sending the request to another node can duplicate work (it cannot before this).
    pub(crate) async fn wait_ack(&mut self) -> Result<(), ClientError> {
        match self.next().await {
            Some(Ok(envelope)) => {
                self.read_ahead = Some(envelope);
                Ok(())
            }
            Some(Err(e)) => Err(e),
            None => Err(ClientError::Protocol {
                reason: format!("execution {} ended before its ack", self.id),
            }),
        }
    }

    /// From now on, a lost connection, or `node.lost` completing, ends the execution with
    /// [`ClientError::NodeLost`].
    pub(crate) fn watch_node(&mut self, node: NodeWatch) {
        self.node = Some(node);
    }

    fn node_lost(&self, reason: String) -> ClientError {
        ClientError::NodeLost {
            node: self
                .node
                .as_ref()
                .map(|n| n.url.to_string())
                .unwrap_or_default(),
            id: self.id.clone(),
            reason,
        }
    }

    /// Keeps `lease` checked out until the execution ends.
    pub(crate) fn hold(&mut self, lease: impl Send + Sync + 'static) {
        // What it held already (a pool's connection) is kept too, and released first.
        let before = self.lease.take();
        self.lease = Some(Box::new((before, lease)));
    }

    /// The execution id.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// Whether the stream has ended.
    pub fn is_done(&self) -> bool {
        self.done
    }

    /// The next event, `None` after the last one.
    pub async fn next(&mut self) -> Option<Result<ServerEnvelope, ClientError>> {
        std::future::poll_fn(|cx| Pin::new(&mut *self).poll_next(cx)).await
    }

    /// Asks the server to cancel the execution. The stream goes on to its end: `status: cancelled` and the
    /// `result` with reason `cancelled`.
    pub async fn cancel(&self) -> Result<(), ClientError> {
        if self.done {
            return Ok(());
        }
        self.handle.shared.cancel(&self.id, self.generation).await
    }

    /// Reads the stream to its end and adds it up: stdout and stderr bytes (at most the `max_output_bytes` in
    /// effect; more is a protocol violation), the terminal status and the `result`.
    pub async fn result(mut self) -> Result<ExecutionResult, ClientError> {
        let mut acc = Accumulator::new(self.id.clone(), self.max_output_bytes);
        while let Some(item) = self.next().await {
            acc.push(item?.message)?;
        }
        acc.finish()
    }

    /// Answers the `tool_call` `call_id` of this execution (extension `tool_calls`): `Ok(value)` is sent as
    /// `tool_result` `ok: true`, `Err(message)` as `ok: false`.
    pub async fn answer(&self, call_id: &str, outcome: ToolOutcome) -> Result<(), ClientError> {
        let result = match outcome {
            Ok(value) => protocol::ToolResult::success(&self.id, call_id, value),
            Err(error) => protocol::ToolResult::failure(&self.id, call_id, error),
        };
        self.handle
            .shared
            .tool_result(result, self.generation)
            .await
    }

    /// Reads the stream to its end like [`result`](Self::result), answering every `tool_call` (extension
    /// `tool_calls`) with `handler`: `Ok(value)` becomes `tool_result` `ok: true` with `result: value`, `Err(message)`
    /// `ok: false` with `error: message`. Handlers run concurrently with each other and with the stream (each call
    /// is a future polled here, no task is spawned); those still running when the execution ends are dropped.
    pub async fn result_with_tools<H, F>(
        mut self,
        mut handler: H,
    ) -> Result<ExecutionResult, ClientError>
    where
        H: FnMut(protocol::ToolCall) -> F,
        F: Future<Output = ToolOutcome>,
    {
        use futures_util::stream::FuturesUnordered;
        use futures_util::StreamExt as _;

        let mut acc = Accumulator::new(self.id.clone(), self.max_output_bytes);
        let mut running = FuturesUnordered::new();
        loop {
            tokio::select! {
                item = self.next() => {
                    let Some(item) = item else { break };
                    let message = item?.message;
                    if let ServerMessage::ToolCall(call) = message {
                        let call_id = call.call_id.clone();
                        let answer = handler(call);
                        running.push(async move { (call_id, answer.await) });
                    } else {
                        acc.push(message)?;
                    }
                }
                Some((call_id, outcome)) = running.next(), if !running.is_empty() => {
                    // A result for an execution that just ended is dropped by the server; a lost link ends the
                    // stream with its own error.
                    let _ = self.answer(&call_id, outcome).await;
                }
            }
        }
        acc.finish()
    }

    /// Ends the stream; the connection goes back to its pool.
    fn finish(&mut self) {
        self.done = true;
        self.deadline = None;
        self.lease = None;
    }

    /// Stops following the execution and cancels it on the server.
    fn abandon(&mut self) {
        let shared = &self.handle.shared;
        if shared.forget(&self.id, self.token) {
            shared.cancel_soon(&self.id, self.generation);
        }
        // Wakes a reader waiting for room in the channel.
        self.events.close();
        self.finish();
    }
}

impl Stream for Execution {
    type Item = Result<ServerEnvelope, ClientError>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        if let Some(envelope) = this.read_ahead.take() {
            return Poll::Ready(Some(Ok(envelope)));
        }
        if this.done {
            return Poll::Ready(None);
        }
        if let Some(node) = &mut this.node {
            if let Poll::Ready(reason) = node.lost.as_mut().poll(cx) {
                let error = this.node_lost(reason);
                this.abandon();
                return Poll::Ready(Some(Err(error)));
            }
        }
        // The deadline first, so a flood of buffered events cannot hide it.
        if let Some(deadline) = &mut this.deadline {
            if deadline.sleep.as_mut().poll(cx).is_ready() {
                let after = deadline.after;
                this.abandon();
                return Poll::Ready(Some(Err(ClientError::Timeout {
                    id: this.id.clone(),
                    after,
                })));
            }
        }
        match this.events.poll_recv(cx) {
            Poll::Ready(Some(envelope)) => {
                match &envelope.message {
                    ServerMessage::Error(e) => {
                        let error = ClientError::from(e.clone());
                        this.finish();
                        return Poll::Ready(Some(Err(error)));
                    }
                    ServerMessage::Result(_) => this.finish(),
                    ServerMessage::Ack {
                        limits: Some(limits),
                        ..
                    } => this.max_output_bytes = limits.max_output_bytes,
                    ServerMessage::Status {
                        status: ExecStatus::Running,
                        ..
                    } => {
                        if let Some(d) = &mut this.deadline {
                            if let Some(after) = d.on_running.take() {
                                d.sleep.as_mut().reset(Instant::now() + after);
                                d.after = after;
                            }
                        }
                    }
                    _ => {}
                }
                Poll::Ready(Some(Ok(envelope)))
            }
            Poll::Ready(None) => {
                let error = match this.failure.try_recv() {
                    Ok(ClientError::Disconnected { reason }) if this.node.is_some() => {
                        this.node_lost(reason)
                    }
                    Ok(error) => error,
                    Err(_) => ClientError::Protocol {
                        reason: format!("execution {} ended without a result", this.id),
                    },
                };
                this.finish();
                Poll::Ready(Some(Err(error)))
            }
            Poll::Pending => Poll::Pending,
        }
    }
}

impl Drop for Execution {
    fn drop(&mut self) {
        if !self.done {
            self.abandon();
        }
    }
}

/// How an execution ended, with everything it printed.
#[derive(Debug, Clone, PartialEq)]
pub struct ExecutionResult {
    /// The execution id.
    pub id: String,
    /// The terminal status: `completed`, `failed`, `timeout`, `oom` or `cancelled`.
    pub status: ExecStatus,
    /// Why it ended (`exited`, `signaled`, `timeout`, `oom`, `output_limit`, `cancelled`).
    pub reason: Reason,
    /// The exit code; `None` when killed by a signal.
    pub exit_code: Option<i32>,
    /// The killing signal, e.g. `SIGKILL`, when signaled.
    pub signal: Option<String>,
    /// Wall-clock time from start to end, as the server measured it.
    pub duration: Duration,
    /// Peak memory and CPU time.
    pub resource_usage: ResourceUsage,
    /// Everything written to stdout (decoded from base64 chunks where needed).
    pub stdout: Vec<u8>,
    /// Everything written to stderr.
    pub stderr: Vec<u8>,
    /// Whether output was cut at `max_output_bytes`.
    pub truncated: bool,
    /// The artifact manifest, when artifacts were requested.
    pub artifacts: Option<serde_json::Value>,
    /// The limits in effect (from `ack`), when the server says.
    pub limits: Option<Limits>,
    /// Whether the execution waited for a slot.
    pub queued: bool,
    /// The server's environment fingerprint, when it sends one.
    pub environment_fingerprint: Option<String>,
    /// Tool calls forwarded to the client (extension `tool_calls`), when the request offered tools.
    pub tool_calls: Option<u64>,
    /// The value the code returned (extension `tool_calls`), if it returned one.
    pub return_value: Option<serde_json::Value>,
    /// What went through the server's egress proxy (extension `network`), when the request asked for
    /// [`network`](protocol::ExecuteRequest::network): connections, refusals and bytes each way.
    pub network: Option<NetworkUsage>,
}

impl ExecutionResult {
    /// Whether the program exited with code 0.
    pub fn success(&self) -> bool {
        self.status == ExecStatus::Completed
    }

    /// stdout as text (invalid UTF-8 replaced).
    pub fn stdout_text(&self) -> Cow<'_, str> {
        String::from_utf8_lossy(&self.stdout)
    }

    /// stderr as text (invalid UTF-8 replaced).
    pub fn stderr_text(&self) -> Cow<'_, str> {
        String::from_utf8_lossy(&self.stderr)
    }
}

/// Adds up an execution's messages into an [`ExecutionResult`].
pub(crate) struct Accumulator {
    id: String,
    stdout: Vec<u8>,
    stderr: Vec<u8>,
    status: Option<ExecStatus>,
    limits: Option<Limits>,
    queued: bool,
    max_output_bytes: u64,
    result: Option<ResultMessage>,
}

impl Accumulator {
    pub(crate) fn new(id: String, max_output_bytes: u64) -> Self {
        Accumulator {
            id,
            stdout: Vec::new(),
            stderr: Vec::new(),
            status: None,
            limits: None,
            queued: false,
            max_output_bytes,
            result: None,
        }
    }

    pub(crate) fn push(&mut self, message: ServerMessage) -> Result<(), ClientError> {
        match message {
            ServerMessage::Ack { limits, queued, .. } => {
                if let Some(l) = limits {
                    self.max_output_bytes = l.max_output_bytes;
                }
                self.limits = limits;
                self.queued = queued.unwrap_or(false);
            }
            ServerMessage::Status { status, .. } => {
                if status.is_terminal() {
                    self.status = Some(status);
                }
            }
            ServerMessage::Stdout(chunk) => self.output(true, &chunk)?,
            ServerMessage::Stderr(chunk) => self.output(false, &chunk)?,
            ServerMessage::Result(result) => self.result = Some(result),
            ServerMessage::Error(e) => return Err(e.into()),
            // Answered by `result_with_tools`; a plain `result` leaves them unanswered (the call times out).
            ServerMessage::Pong(_) | ServerMessage::ToolCall(_) => {}
        }
        Ok(())
    }

    fn output(&mut self, stdout: bool, chunk: &protocol::OutputChunk) -> Result<(), ClientError> {
        let bytes = chunk.decode().map_err(|e| ClientError::Malformed {
            reason: format!("output chunk of {} is not valid base64: {e}", self.id),
        })?;
        let total = (self.stdout.len() + self.stderr.len() + bytes.len()) as u64;
        if total > self.max_output_bytes {
            return Err(ClientError::Protocol {
                reason: format!(
                    "execution {} sent {total} bytes of output, over its max_output_bytes {}",
                    self.id, self.max_output_bytes
                ),
            });
        }
        if stdout {
            self.stdout.extend_from_slice(&bytes);
        } else {
            self.stderr.extend_from_slice(&bytes);
        }
        Ok(())
    }

    pub(crate) fn finish(self) -> Result<ExecutionResult, ClientError> {
        let Some(r) = self.result else {
            return Err(ClientError::Protocol {
                reason: format!("execution {} ended without a result", self.id),
            });
        };
        Ok(ExecutionResult {
            status: self
                .status
                .unwrap_or_else(|| ExecStatus::terminal(r.reason, r.exit_code)),
            id: r.id,
            reason: r.reason,
            exit_code: r.exit_code,
            signal: r.signal,
            duration: Duration::from_millis(r.duration_ms),
            resource_usage: r.resource_usage,
            stdout: self.stdout,
            stderr: self.stderr,
            truncated: r.truncated,
            artifacts: r.artifacts,
            limits: self.limits,
            queued: self.queued,
            environment_fingerprint: r.environment_fingerprint,
            tool_calls: r.tool_calls,
            return_value: r.return_value.map(|v| *v),
            network: r.network.map(|n| *n),
        })
    }
}

#[cfg(test)]
mod tests {
    use protocol::{OutputChunk, OutputEncoding};

    use super::*;

    fn chunk(data: &str, base64: bool) -> OutputChunk {
        OutputChunk {
            id: "e".into(),
            data: data.into(),
            encoding: base64.then_some(OutputEncoding::Base64),
        }
    }

    fn result(reason: Reason, exit_code: Option<i32>) -> ResultMessage {
        ResultMessage {
            exit_code,
            duration_ms: 12,
            ..ResultMessage::new("e", reason)
        }
    }

    #[test]
    fn accumulates_output_and_result() {
        let mut acc = Accumulator::new("e".into(), 100);
        acc.push(ServerMessage::Stdout(chunk("hi ", false)))
            .unwrap();
        acc.push(ServerMessage::Stderr(chunk("oops", false)))
            .unwrap();
        acc.push(ServerMessage::Stdout(chunk("/w==", true)))
            .unwrap(); // 0xff
        acc.push(ServerMessage::Status {
            id: "e".into(),
            status: ExecStatus::Failed,
        })
        .unwrap();
        acc.push(ServerMessage::Result(result(Reason::Exited, Some(3))))
            .unwrap();
        let r = acc.finish().unwrap();
        assert_eq!(r.stdout, b"hi \xff");
        assert_eq!(r.stderr, b"oops");
        assert_eq!(r.status, ExecStatus::Failed);
        assert_eq!(r.exit_code, Some(3));
        assert_eq!(r.duration, Duration::from_millis(12));
        assert!(!r.success());
    }

    #[test]
    fn output_beyond_the_limit_is_a_protocol_violation() {
        let mut acc = Accumulator::new("e".into(), 4);
        acc.push(ServerMessage::Stdout(chunk("abcd", false)))
            .unwrap();
        let err = acc
            .push(ServerMessage::Stderr(chunk("e", false)))
            .unwrap_err();
        assert!(matches!(err, ClientError::Protocol { .. }), "{err}");
        assert!(!err.is_retryable());
    }

    #[test]
    fn bad_base64_is_malformed_and_a_missing_result_is_a_violation() {
        let mut acc = Accumulator::new("e".into(), 100);
        let err = acc
            .push(ServerMessage::Stdout(chunk("***", true)))
            .unwrap_err();
        assert!(matches!(err, ClientError::Malformed { .. }), "{err}");
        let err = Accumulator::new("e".into(), 100).finish().unwrap_err();
        assert!(matches!(err, ClientError::Protocol { .. }), "{err}");
    }

    #[test]
    fn network_counters_come_from_the_result() {
        let usage = NetworkUsage {
            connections: 3,
            upstream_connections: 2,
            refused: 1,
            bytes_sent: 517,
            bytes_received: 4096,
        };
        let mut acc = Accumulator::new("e".into(), 100);
        let mut r = result(Reason::Exited, Some(0));
        r.network = Some(Box::new(usage));
        acc.push(ServerMessage::Result(r)).unwrap();
        assert_eq!(acc.finish().unwrap().network, Some(usage));

        // Without `network` in the request the server sends none, and the result has none.
        let mut acc = Accumulator::new("e".into(), 100);
        acc.push(ServerMessage::Result(result(Reason::Exited, Some(0))))
            .unwrap();
        assert_eq!(acc.finish().unwrap().network, None);
    }

    #[test]
    fn network_counters_are_read_from_the_wire() {
        let line = r#"{"v":1,"type":"result","id":"e","ts":"2026-01-01T00:00:00.000Z","exit_code":0,
            "duration_ms":7,"resource_usage":{"peak_memory_mb":1,"cpu_time_ms":2},"reason":"exited",
            "network":{"connections":2,"upstream_connections":1,"refused":1,"bytes_sent":10,"bytes_received":20}}"#;
        let envelope = protocol::parse_server_envelope(line).unwrap();
        let mut acc = Accumulator::new("e".into(), 100);
        acc.push(envelope.message).unwrap();
        let n = acc.finish().unwrap().network.unwrap();
        assert_eq!(
            (
                n.connections,
                n.upstream_connections,
                n.refused,
                n.bytes_sent,
                n.bytes_received
            ),
            (2, 1, 1, 10, 20)
        );
    }

    #[test]
    fn status_defaults_from_the_result() {
        let mut acc = Accumulator::new("e".into(), 100);
        acc.push(ServerMessage::Result(result(Reason::Oom, None)))
            .unwrap();
        assert_eq!(acc.finish().unwrap().status, ExecStatus::Oom);
    }
}

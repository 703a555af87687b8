//! The gateway side of agent sandboxes (`docs/spec/agent-sandboxes.md`): provision a sandbox with
//! [`Gateway::create`], drive it with a [`SandboxClient`] (`spawn`, `pause`, `resume`, `kill`, `resolve`,
//! `inject_context`, `update_brief`, `replay`, `health`, `set_network`), and read its events with an [`EventStream`] that
//! reconnects by itself and replays what a dropped connection lost, so the caller sees every sequence exactly once.
//!
//! Plain `http://` / `ws://` only (the daemon's agent endpoints are served next to `/ws`).

use std::collections::VecDeque;
use std::time::Duration;

use agent_api::{
    AdapterEvent, AgentBrief, AgentHandle, ContextInjection, CreateSandboxRequest,
    CreateSandboxResponse, CreateVolumeRequest, ForkResponse, KillRequest, KillResponse,
    PluginError, ReplayResponse, SandboxHealthResponse, SandboxNetworkAllow, SequenceRange,
    SerializedAgentState, Snapshot, Volume,
};
use futures_util::StreamExt;
use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::{Map, Value};
use tokio::net::TcpStream;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::http::HeaderValue;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::{MaybeTlsStream, WebSocketStream};

/// Largest answer read.
const MAX_ANSWER: usize = 64 << 20;
/// Time a connection has to be established.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Per-request deadline.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(60);

/// A failed gateway call.
#[derive(Debug, thiserror::Error)]
pub enum GatewayError {
    /// The daemon refused the call with a `PluginError`.
    #[error("HTTP {status}: {error}")]
    Plugin {
        /// HTTP status.
        status: u16,
        /// The refusal.
        error: PluginError,
    },
    /// The daemon could not be reached: the request was not sent.
    #[error("Cannot connect to {url}: {reason}")]
    Connect {
        /// The URL.
        url: String,
        /// Why.
        reason: String,
    },
    /// No node of a [`Fleet`](crate::Fleet) took the sandbox: each was unreachable or at its sandbox limit.
    #[error("No node of the fleet took the sandbox after {tried} attempt(s): {last}")]
    NoNode {
        /// Nodes tried.
        tried: usize,
        /// The last node's refusal.
        last: String,
    },
    /// The call did not get an answer.
    #[error("Request to {url} failed: {reason}")]
    Http {
        /// The URL.
        url: String,
        /// Why.
        reason: String,
    },
    /// The answer is not what the protocol says.
    #[error("Malformed answer from {url}: {reason}")]
    Malformed {
        /// The URL.
        url: String,
        /// Why.
        reason: String,
    },
    /// The event stream failed and could not reconnect.
    #[error("Event stream failed: {0}")]
    Events(String),
}

impl GatewayError {
    /// Whether a retry may succeed.
    pub fn is_retryable(&self) -> bool {
        match self {
            Self::Plugin { error, .. } => error.retryable(),
            Self::Connect { .. } | Self::NoNode { .. } | Self::Http { .. } | Self::Events(_) => {
                true
            }
            Self::Malformed { .. } => false,
        }
    }
}

/// An HTTP answer as bytes.
#[derive(Debug, Clone)]
pub struct RawAnswer {
    /// Status.
    pub status: u16,
    /// Body.
    pub body: Vec<u8>,
}

#[derive(Clone)]
struct Http {
    client: Client<HttpConnector, Full<Bytes>>,
    token: String,
}

impl Http {
    fn new(token: &str) -> Self {
        // A host that does not answer the handshake (a link down) is a connect error, so a fleet can ask another.
        let mut connector = HttpConnector::new();
        connector.set_connect_timeout(Some(CONNECT_TIMEOUT));
        Self {
            // No connection reuse: a daemon closes a connection after refusing an oversize body, and a pooled
            // connection closed under a request fails it; one TCP handshake on the gateway's link is cheap.
            client: Client::builder(TokioExecutor::new())
                .pool_max_idle_per_host(0)
                .build(connector),
            token: token.to_owned(),
        }
    }

    async fn raw(
        &self,
        method: &str,
        url: &str,
        body: Vec<u8>,
        token: Option<&str>,
    ) -> Result<RawAnswer, GatewayError> {
        let fail = |reason: String| GatewayError::Http {
            url: url.to_owned(),
            reason,
        };
        let mut req = hyper::Request::builder()
            .method(method)
            .uri(url)
            .header("content-type", "application/json");
        if let Some(t) = token {
            req = req.header("authorization", format!("Bearer {t}"));
        }
        let req = req
            .body(Full::new(Bytes::from(body)))
            .map_err(|e| fail(e.to_string()))?;
        let resp = tokio::time::timeout(REQUEST_TIMEOUT, self.client.request(req))
            .await
            .map_err(|_| fail("timed out".into()))?
            .map_err(|e| {
                if e.is_connect() {
                    GatewayError::Connect {
                        url: url.to_owned(),
                        reason: e.to_string(),
                    }
                } else {
                    fail(e.to_string())
                }
            })?;
        let status = resp.status().as_u16();
        let body = http_body_util::Limited::new(resp.into_body(), MAX_ANSWER)
            .collect()
            .await
            .map_err(|e| fail(format!("reading the answer: {e}")))?
            .to_bytes()
            .to_vec();
        Ok(RawAnswer { status, body })
    }

    /// `DELETE url`: 204, or the daemon's refusal.
    async fn delete(&self, url: &str) -> Result<(), GatewayError> {
        let a = self
            .raw("DELETE", url, Vec::new(), Some(&self.token))
            .await?;
        if a.status == 204 {
            return Ok(());
        }
        let error: PluginError =
            serde_json::from_slice(&a.body).map_err(|e| GatewayError::Malformed {
                url: url.to_owned(),
                reason: format!("HTTP {} without a PluginError body: {e}", a.status),
            })?;
        Err(GatewayError::Plugin {
            status: a.status,
            error,
        })
    }

    async fn call<T: DeserializeOwned>(
        &self,
        method: &str,
        url: &str,
        body: &impl Serialize,
    ) -> Result<T, GatewayError> {
        let bytes = serde_json::to_vec(body).map_err(|e| GatewayError::Malformed {
            url: url.to_owned(),
            reason: e.to_string(),
        })?;
        let a = self.raw(method, url, bytes, Some(&self.token)).await?;
        let malformed = |reason: String| GatewayError::Malformed {
            url: url.to_owned(),
            reason,
        };
        if !(200..300).contains(&a.status) {
            let error: PluginError = serde_json::from_slice(&a.body).map_err(|e| {
                malformed(format!("HTTP {} without a PluginError body: {e}", a.status))
            })?;
            return Err(GatewayError::Plugin {
                status: a.status,
                error,
            });
        }
        let body: &[u8] = if a.body.is_empty() { b"null" } else { &a.body };
        serde_json::from_slice(body).map_err(|e| malformed(e.to_string()))
    }
}

/// Provisions sandboxes on one daemon (`http://host:port`).
#[derive(Clone)]
pub struct Gateway {
    base: String,
    http: Http,
}

impl Gateway {
    /// A gateway for the daemon at `base` (`http://host:port`) with its bearer token.
    pub fn new(base: &str, token: &str) -> Self {
        Self {
            base: base.trim_end_matches('/').to_owned(),
            http: Http::new(token),
        }
    }

    /// `POST /sandboxes`.
    pub async fn create(&self, req: &CreateSandboxRequest) -> Result<SandboxClient, GatewayError> {
        let url = format!("{}/sandboxes", self.base);
        let resp: CreateSandboxResponse = self.http.call("POST", &url, req).await?;
        Ok(self.sandbox(resp))
    }

    /// A client for an existing sandbox.
    pub fn sandbox(&self, transport: CreateSandboxResponse) -> SandboxClient {
        SandboxClient {
            transport,
            http: self.http.clone(),
        }
    }

    /// `DELETE /sandboxes/<id>`.
    pub async fn delete(&self, id: &str) -> Result<(), GatewayError> {
        self.http
            .delete(&format!("{}/sandboxes/{id}", self.base))
            .await
    }

    /// `POST /volumes`: a volume of `size_mb` that outlives the sandboxes it is mounted into.
    pub async fn create_volume(&self, req: &CreateVolumeRequest) -> Result<Volume, GatewayError> {
        let url = format!("{}/volumes", self.base);
        self.http.call("POST", &url, req).await
    }

    /// `GET /volumes`.
    pub async fn volumes(&self) -> Result<Vec<Volume>, GatewayError> {
        #[derive(serde::Deserialize)]
        struct List {
            volumes: Vec<Volume>,
        }
        let url = format!("{}/volumes", self.base);
        let list: List = self.http.call("GET", &url, &()).await?;
        Ok(list.volumes)
    }

    /// `GET /volumes/<id>`.
    pub async fn volume(&self, id: &str) -> Result<Volume, GatewayError> {
        let url = format!("{}/volumes/{id}", self.base);
        self.http.call("GET", &url, &()).await
    }

    /// `DELETE /volumes/<id>` (refused while a sandbox mounts it).
    pub async fn delete_volume(&self, id: &str) -> Result<(), GatewayError> {
        self.http
            .delete(&format!("{}/volumes/{id}", self.base))
            .await
    }

    /// `POST /sandboxes/<id>/snapshot`: sandbox `id`'s `/workspace` kept as a snapshot (its agent frozen
    /// meanwhile).
    pub async fn snapshot(&self, id: &str) -> Result<Snapshot, GatewayError> {
        let url = format!("{}/sandboxes/{id}/snapshot", self.base);
        self.http.call("POST", &url, &serde_json::json!({})).await
    }

    /// `POST /sandboxes/<id>/fork`: a snapshot of sandbox `id` and a new sandbox created from it with `req`.
    pub async fn fork(
        &self,
        id: &str,
        req: &CreateSandboxRequest,
    ) -> Result<(Snapshot, SandboxClient), GatewayError> {
        let url = format!("{}/sandboxes/{id}/fork", self.base);
        let resp: ForkResponse = self.http.call("POST", &url, req).await?;
        Ok((resp.snapshot, self.sandbox(resp.sandbox)))
    }

    /// `GET /snapshots`.
    pub async fn snapshots(&self) -> Result<Vec<Snapshot>, GatewayError> {
        #[derive(serde::Deserialize)]
        struct List {
            snapshots: Vec<Snapshot>,
        }
        let url = format!("{}/snapshots", self.base);
        let list: List = self.http.call("GET", &url, &()).await?;
        Ok(list.snapshots)
    }

    /// `GET /snapshots/<id>`.
    pub async fn snapshot_info(&self, id: &str) -> Result<Snapshot, GatewayError> {
        let url = format!("{}/snapshots/{id}", self.base);
        self.http.call("GET", &url, &()).await
    }

    /// `DELETE /snapshots/<id>` (refused while a sandbox started from it exists).
    pub async fn delete_snapshot(&self, id: &str) -> Result<(), GatewayError> {
        self.http
            .delete(&format!("{}/snapshots/{id}", self.base))
            .await
    }

    /// Any request with any body and token (`None`: no `Authorization`), for probing refusals.
    pub async fn raw(
        &self,
        method: &str,
        path: &str,
        body: Vec<u8>,
        token: Option<&str>,
    ) -> Result<RawAnswer, GatewayError> {
        self.http
            .raw(method, &format!("{}{path}", self.base), body, token)
            .await
    }
}

/// The adapter-shim endpoints of one sandbox.
#[derive(Clone)]
pub struct SandboxClient {
    /// Where the sandbox is.
    pub transport: CreateSandboxResponse,
    http: Http,
}

impl std::fmt::Debug for SandboxClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SandboxClient")
            .field("transport", &self.transport)
            .finish_non_exhaustive()
    }
}

impl SandboxClient {
    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.transport.rpc_endpoint)
    }

    /// The sandbox id.
    pub fn id(&self) -> &str {
        &self.transport.id
    }

    /// `DELETE` the sandbox, on the daemon that serves it.
    pub async fn delete(&self) -> Result<(), GatewayError> {
        self.http.delete(&self.transport.rpc_endpoint).await
    }

    /// `POST /spawn`.
    pub async fn spawn(&self, brief: &AgentBrief) -> Result<AgentHandle, GatewayError> {
        self.http.call("POST", &self.url("/spawn"), brief).await
    }

    /// `POST /pause`.
    pub async fn pause(&self) -> Result<SerializedAgentState, GatewayError> {
        self.http
            .call("POST", &self.url("/pause"), &Map::new())
            .await
    }

    /// `POST /resume`.
    pub async fn resume(&self, state: &SerializedAgentState) -> Result<AgentHandle, GatewayError> {
        self.http.call("POST", &self.url("/resume"), state).await
    }

    /// `POST /kill`.
    pub async fn kill(&self, req: &KillRequest) -> Result<KillResponse, GatewayError> {
        self.http.call("POST", &self.url("/kill"), req).await
    }

    /// `POST /resolve`.
    pub async fn resolve(
        &self,
        decision_id: &str,
        resolution: Map<String, Value>,
    ) -> Result<(), GatewayError> {
        let body = serde_json::json!({"decisionId": decision_id, "resolution": resolution});
        let _: Value = self.http.call("POST", &self.url("/resolve"), &body).await?;
        Ok(())
    }

    /// `POST /inject-context`.
    pub async fn inject_context(&self, injection: &ContextInjection) -> Result<(), GatewayError> {
        let _: Value = self
            .http
            .call("POST", &self.url("/inject-context"), injection)
            .await?;
        Ok(())
    }

    /// `POST /update-brief`.
    pub async fn update_brief(&self, changes: Map<String, Value>) -> Result<(), GatewayError> {
        let body = serde_json::json!({ "changes": changes });
        let _: Value = self
            .http
            .call("POST", &self.url("/update-brief"), &body)
            .await?;
        Ok(())
    }

    /// `POST /replay`.
    pub async fn replay(&self, from: u64, to: u64) -> Result<ReplayResponse, GatewayError> {
        let body = SequenceRange {
            from_sequence: from,
            to_sequence: to,
        };
        self.http.call("POST", &self.url("/replay"), &body).await
    }

    /// `POST /network`: a new egress allowlist for a sandbox created with `network`; the list in force. Requests
    /// from then on use it; tunnels already open stay.
    pub async fn set_network(&self, allow: Vec<String>) -> Result<Vec<String>, GatewayError> {
        let body = SandboxNetworkAllow { allow };
        let a: SandboxNetworkAllow = self.http.call("POST", &self.url("/network"), &body).await?;
        Ok(a.allow)
    }

    /// `GET /health`.
    pub async fn health(&self) -> Result<SandboxHealthResponse, GatewayError> {
        let url = self.transport.health_endpoint.clone();
        let a = self
            .http
            .raw("GET", &url, Vec::new(), Some(&self.http.token))
            .await?;
        if a.status != 200 {
            let error: PluginError =
                serde_json::from_slice(&a.body).map_err(|e| GatewayError::Malformed {
                    url: url.clone(),
                    reason: format!("HTTP {}: {e}", a.status),
                })?;
            return Err(GatewayError::Plugin {
                status: a.status,
                error,
            });
        }
        serde_json::from_slice(&a.body).map_err(|e| GatewayError::Malformed {
            url,
            reason: e.to_string(),
        })
    }

    /// The event stream, starting after sequence `after` (0: from the start).
    pub fn events(&self, after: u64) -> EventStream {
        EventStream {
            sandbox: self.clone(),
            ws: None,
            last: after,
            pending: VecDeque::new(),
            replays: Vec::new(),
            evicted: Vec::new(),
            reconnects: 0,
        }
    }
}

type Ws = WebSocketStream<MaybeTlsStream<TcpStream>>;

/// `WS /events` with replay-on-reconnect: events come out in sequence order, each once; a dropped connection is
/// re-opened (100 ms doubling to 30 s, at most 10 attempts in a row) and the sequences it lost are fetched with
/// `POST /replay`. Ranges the daemon no longer has are recorded in [`EventStream::evicted`].
pub struct EventStream {
    sandbox: SandboxClient,
    ws: Option<Ws>,
    last: u64,
    pending: VecDeque<AdapterEvent>,
    /// Every replay this stream made: the range asked and the sequences it got.
    pub replays: Vec<(SequenceRange, Vec<u64>)>,
    /// Ranges reported evicted (unrecoverable).
    pub evicted: Vec<SequenceRange>,
    /// Reconnections so far.
    pub reconnects: u64,
}

impl EventStream {
    /// The last sequence handed out.
    pub fn last_sequence(&self) -> u64 {
        self.last
    }

    async fn connect(&mut self) -> Result<(), GatewayError> {
        let url = &self.sandbox.transport.event_stream_endpoint;
        let mut req = url
            .as_str()
            .into_client_request()
            .map_err(|e| GatewayError::Events(format!("bad URL {url}: {e}")))?;
        let auth = HeaderValue::from_str(&format!("Bearer {}", self.sandbox.http.token))
            .map_err(|e| GatewayError::Events(e.to_string()))?;
        req.headers_mut().insert("authorization", auth);
        let (ws, _) = tokio_tungstenite::connect_async(req)
            .await
            .map_err(|e| GatewayError::Events(format!("connect {url}: {e}")))?;
        self.ws = Some(ws);
        Ok(())
    }

    /// Fetches everything after `self.last` up to `to` with `POST /replay` into the pending queue.
    async fn fill(&mut self, to: u64) -> Result<(), GatewayError> {
        let from = self.last + 1;
        let r = self.sandbox.replay(from, to).await?;
        let range = SequenceRange {
            from_sequence: from,
            to_sequence: to.min(r.last_sequence),
        };
        if let Some(e) = r.evicted {
            self.evicted.push(e);
        }
        let seqs = r.events.iter().map(|e| e.source_sequence).collect();
        self.replays.push((range, seqs));
        let mut last = self.last;
        for e in r.events {
            if e.source_sequence > last {
                last = e.source_sequence;
                self.pending.push_back(e);
            }
        }
        Ok(())
    }

    /// The next event.
    pub async fn next(&mut self) -> Result<AdapterEvent, GatewayError> {
        loop {
            if let Some(e) = self.pending.pop_front() {
                if e.source_sequence > self.last {
                    self.last = e.source_sequence;
                    return Ok(e);
                }
                continue;
            }
            if self.ws.is_none() {
                let first = self.reconnects == 0 && self.last == 0;
                let mut delay = Duration::from_millis(100);
                let mut attempt = 0;
                loop {
                    match self.connect().await {
                        Ok(()) => break,
                        Err(e) => {
                            attempt += 1;
                            if attempt >= 10 {
                                return Err(e);
                            }
                            tokio::time::sleep(delay).await;
                            delay = (delay * 2).min(Duration::from_secs(30));
                        }
                    }
                }
                if !first {
                    self.reconnects += 1;
                    // What the dropped connection lost (and anything newer): replayed now, duplicates skipped.
                    self.fill(u64::MAX).await?;
                    continue;
                }
            }
            let Some(ws) = self.ws.as_mut() else { continue };
            match ws.next().await {
                Some(Ok(Message::Text(t))) => {
                    let e: AdapterEvent = serde_json::from_str(&t)
                        .map_err(|e| GatewayError::Events(format!("malformed event: {e}")))?;
                    if e.source_sequence <= self.last {
                        continue;
                    }
                    if e.source_sequence > self.last + 1 {
                        self.fill(e.source_sequence - 1).await?;
                    }
                    self.pending.push_back(e);
                }
                Some(Ok(_)) => {}
                Some(Err(_)) | None => self.ws = None,
            }
        }
    }

    /// Drops the WebSocket abruptly (no close frame), as a network failure would; the next [`Self::next`]
    /// reconnects and replays.
    pub fn drop_connection(&mut self) {
        if let Some(ws) = self.ws.take() {
            if let MaybeTlsStream::Plain(tcp) = ws.get_ref() {
                let _ = reset_on_close(tcp);
            }
        }
    }
}

fn reset_on_close(tcp: &TcpStream) -> std::io::Result<()> {
    // A zero linger timeout makes close send a RST at once (the deprecation is about blocking on a non-zero
    // timeout): the daemon sees the connection fail mid-stream.
    #[allow(deprecated)]
    tcp.set_linger(Some(Duration::ZERO))
}

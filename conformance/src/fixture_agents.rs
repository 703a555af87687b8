//! The fixture's agent sandboxes: just enough of the adapter-shim surface (`docs/spec/agent-sandboxes.md`) for the
//! `A.*` cases to pass, with an in-process scripted agent instead of a container, and the agent faults of
//! [`Fault`]. Plain HTTP/1.1 (one request per connection) and `WS /sandboxes/<id>/events`.

use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use futures_util::{SinkExt, StreamExt};
use serde_json::{json, Map, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::watch;
use tokio_tungstenite::tungstenite::handshake::server::{ErrorResponse, Request, Response};
use tokio_tungstenite::tungstenite::http::StatusCode;
use tokio_tungstenite::tungstenite::Message;

use crate::fault::Fault;

/// Largest request body.
const MAX_BODY: usize = 1 << 20;

/// One fixture sandbox.
struct Sbx {
    log: Mutex<Vec<Value>>,
    /// Events already sent to a gateway (a new connection gets only the later ones).
    delivered: Mutex<usize>,
    changed: watch::Sender<usize>,
    state: Mutex<State>,
    created: Instant,
}

#[derive(Default)]
struct State {
    running: bool,
    status: &'static str,
    run_id: String,
    pending: BTreeSet<String>,
    next_seq: u64,
}

/// Every fixture sandbox.
#[derive(Default)]
pub struct Agents {
    map: Mutex<HashMap<String, Arc<Sbx>>>,
    seq: AtomicU64,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn now_ts() -> String {
    protocol::now_ts()
}

/// A UUID v7 (48-bit milliseconds, version 7, variant 10, the rest from the clock and a counter).
fn uuid_v7(n: u64) -> String {
    let d = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    let ms = d.as_millis() as u64 & 0xffff_ffff_ffff;
    let r = (d.subsec_nanos() as u64) << 20 ^ n;
    format!(
        "{:08x}-{:04x}-7{:03x}-{:04x}-{:012x}",
        ms >> 16,
        ms & 0xffff,
        r & 0xfff,
        0x8000 | ((r >> 12) & 0x3fff),
        (r >> 26 ^ n.wrapping_mul(0x9e37_79b9)) & 0xffff_ffff_ffff
    )
}

impl Sbx {
    fn emit(&self, faults: &BTreeSet<Fault>, event: Map<String, Value>) {
        let mut st = lock(&self.state);
        st.next_seq += 1;
        // The gap fault skips sequence 3.
        if faults.contains(&Fault::AgentSequenceGap) && st.next_seq == 3 {
            st.next_seq += 1;
        }
        let seq = st.next_seq;
        let run_id = st.run_id.clone();
        drop(st);
        let mut log = lock(&self.log);
        let n = log.len() as u64;
        log.push(json!({
            "sourceEventId": uuid_v7(n),
            "sourceSequence": seq,
            "sourceOccurredAt": now_ts(),
            "runId": run_id,
            "event": event,
        }));
        let len = log.len();
        drop(log);
        self.changed.send_replace(len);
    }
}

/// The operations on one sandbox (`/sandboxes/<id>/<op>`), each answering a status and a JSON body.
impl Sbx {
    /// `POST spawn`: starts the scripted agent, which emits its whole script at once.
    fn spawn(&self, body: &Value, faults: &BTreeSet<Fault>) -> (u16, Option<Value>) {
        let Some(agent) = body["agentId"].as_str().map(str::to_owned) else {
            return (
                400,
                Some(invalid("Malformed request body: missing agentId")),
            );
        };
        {
            let mut st = lock(&self.state);
            if st.running {
                let h = json!({"id": "agent", "pluginName": "fixture", "status": st.status, "sessionId": st.run_id});
                return (
                    409,
                    Some(
                        json!({"code": "invalid_state", "message": "already running", "handle": h}),
                    ),
                );
            }
            st.running = true;
            st.status = "running";
            st.run_id = uuid_v7(st.next_seq + 99);
        }
        self.emit(
            faults,
            event(json!({"type": "lifecycle", "agentId": agent, "action": "started"})),
        );
        self.emit(
            faults,
            event(json!({"type": "status", "agentId": agent, "message": "brief received"})),
        );
        let script = body["providerConfig"]["script"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        self.play(&script, &agent, faults);
        let st = lock(&self.state);
        (
            200,
            Some(
                json!({"id": agent, "pluginName": "fixture", "status": "running", "sessionId": st.run_id}),
            ),
        )
    }

    /// The agent's script: `{"emit": event}` steps (a `decision` event waits on a human) and `{"emit_many": n}`.
    fn play(&self, script: &[Value], agent: &str, faults: &BTreeSet<Fault>) {
        for step in script {
            if let Some(e) = step.get("emit") {
                let mut e = event(e.clone());
                e.entry("agentId").or_insert_with(|| agent.into());
                if e.get("type").and_then(Value::as_str) == Some("decision") {
                    if let Some(d) = e.get("decisionId").and_then(Value::as_str) {
                        let mut st = lock(&self.state);
                        st.pending.insert(d.to_owned());
                        st.status = "waiting_on_human";
                    }
                }
                self.emit(faults, e);
            } else if let Some(n) = step.get("emit_many").and_then(Value::as_u64) {
                for i in 0..n {
                    self.emit(faults, event(json!({"type": "status", "agentId": agent, "message": format!("tick {i}")})));
                }
            }
        }
    }

    /// `POST resolve`: answers a pending decision.
    fn resolve(&self, body: &Value, faults: &BTreeSet<Fault>) -> (u16, Option<Value>) {
        let Some(d) = body["decisionId"].as_str() else {
            return (400, Some(invalid("Malformed request body: decisionId")));
        };
        let mut st = lock(&self.state);
        if !st.running {
            return (409, Some(invalid("No agent is running")));
        }
        if !st.pending.remove(d) && !faults.contains(&Fault::AgentResolveUnknownOk) {
            return (
                404,
                Some(json!({"code": "decision_not_found", "decisionId": d})),
            );
        }
        if st.pending.is_empty() {
            st.status = "running";
        }
        (200, Some(json!({})))
    }

    /// `POST replay`: the events of a range of sequence numbers.
    fn replay(&self, body: &Value, faults: &BTreeSet<Fault>) -> (u16, Option<Value>) {
        let (Some(mut from), Some(mut to)) =
            (body["fromSequence"].as_u64(), body["toSequence"].as_u64())
        else {
            return (
                400,
                Some(invalid("Malformed request body: fromSequence, toSequence")),
            );
        };
        if faults.contains(&Fault::AgentReplayOffByOne) {
            from += 1;
            to += 1;
        }
        let log = lock(&self.log);
        let events: Vec<Value> = log
            .iter()
            .filter(|e| {
                e["sourceSequence"]
                    .as_u64()
                    .is_some_and(|s| (from..=to).contains(&s))
            })
            .cloned()
            .collect();
        let last = log
            .last()
            .and_then(|e| e["sourceSequence"].as_u64())
            .unwrap_or(0);
        (200, Some(json!({"events": events, "lastSequence": last})))
    }

    /// `POST kill`: ends the agent.
    fn kill(&self, faults: &BTreeSet<Fault>) -> (u16, Option<Value>) {
        let mut st = lock(&self.state);
        if !st.running {
            return (409, Some(invalid("No agent is running")));
        }
        st.running = false;
        st.status = "completed";
        drop(st);
        self.emit(faults, event(json!({"type": "lifecycle", "agentId": "agent", "action": "killed", "reason": "kill"})));
        (
            200,
            Some(json!({"artifactsExtracted": 0, "cleanShutdown": true})),
        )
    }

    /// `GET health`.
    fn health(&self) -> (u16, Option<Value>) {
        let st = lock(&self.state);
        (
            200,
            Some(json!({
                "status": "healthy", "agentStatus": st.status,
                "uptimeMs": self.created.elapsed().as_millis() as u64,
                "resourceUsage": {"cpuPercent": 0.0, "memoryMb": 0.0, "diskMb": 0.0, "collectedAt": now_ts()},
                "pendingEventBufferSize": 0
            })),
        )
    }
}

fn event(v: Value) -> Map<String, Value> {
    match v {
        Value::Object(m) => m,
        _ => Map::new(),
    }
}

struct Req {
    method: String,
    path: String,
    auth: Option<String>,
    body: Result<Vec<u8>, ()>,
}

async fn read_request(stream: &mut TcpStream) -> Option<Req> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 16384];
    let head_end = loop {
        let n = stream.read(&mut chunk).await.ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&chunk[..n]);
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
        if buf.len() > 65536 {
            return None;
        }
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).into_owned();
    let mut first = head.lines().next()?.split_whitespace();
    let method = first.next()?.to_owned();
    let path = first.next()?.to_owned();
    let header = |name: &str| {
        head.lines().skip(1).find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.trim()
                .eq_ignore_ascii_case(name)
                .then(|| v.trim().to_owned())
        })
    };
    let len: usize = header("content-length")
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let auth = header("authorization");
    if len > MAX_BODY {
        return Some(Req {
            method,
            path,
            auth,
            body: Err(()),
        });
    }
    while buf.len() < head_end + len {
        let n = stream.read(&mut chunk).await.ok()?;
        if n == 0 {
            break;
        }
        buf.extend_from_slice(&chunk[..n]);
    }
    Some(Req {
        method,
        path,
        auth,
        body: Ok(buf[head_end..].to_vec()),
    })
}

async fn respond(stream: &mut TcpStream, status: u16, body: Option<Value>) {
    let text = body.map(|b| b.to_string()).unwrap_or_default();
    let reason = StatusCode::from_u16(status)
        .ok()
        .and_then(|s| s.canonical_reason())
        .unwrap_or("");
    let resp = format!(
        "HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{text}",
        text.len()
    );
    let _ = stream.write_all(resp.as_bytes()).await;
    let _ = stream.shutdown().await;
}

fn invalid(message: &str) -> Value {
    json!({"code": "invalid_state", "message": message})
}

impl Agents {
    fn get(&self, id: &str) -> Option<Arc<Sbx>> {
        lock(&self.map).get(id).cloned()
    }

    /// Serves one connection whose request targets `/sandboxes...`.
    pub async fn serve(
        self: Arc<Self>,
        mut stream: TcpStream,
        token: &str,
        faults: &BTreeSet<Fault>,
        is_ws: bool,
    ) {
        let accepts_any = faults.contains(&Fault::AcceptsBadToken);
        if is_ws {
            self.events(stream, token, accepts_any).await;
            return;
        }
        let Some(req) = read_request(&mut stream).await else {
            return;
        };
        let (status, body) = self.route(req, token, accepts_any, faults);
        let body = if status >= 400 && faults.contains(&Fault::AgentPlainTextErrors) {
            // Refusals as plain text: no PluginError body.
            let text = format!("error {status}");
            let resp = format!(
                "HTTP/1.1 {status} Error\r\ncontent-type: text/plain\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{text}",
                text.len()
            );
            let _ = stream.write_all(resp.as_bytes()).await;
            let _ = stream.shutdown().await;
            return;
        } else {
            body
        };
        respond(&mut stream, status, body).await;
    }

    fn route(
        &self,
        req: Req,
        token: &str,
        accepts_any: bool,
        faults: &BTreeSet<Fault>,
    ) -> (u16, Option<Value>) {
        let authorized = req.auth.as_deref().and_then(|a| a.strip_prefix("Bearer ")) == Some(token);
        if !authorized && !accepts_any {
            return (401, Some(invalid("Unauthorized")));
        }
        let Ok(body) = req.body else {
            return (413, Some(invalid("Request body too large")));
        };
        let parsed: Result<Value, _> = if body.iter().all(u8::is_ascii_whitespace) {
            Ok(json!({}))
        } else {
            serde_json::from_slice(&body)
        };
        let Ok(body) = parsed else {
            return (400, Some(invalid("Malformed request body")));
        };
        let parts: Vec<&str> = req.path.trim_start_matches('/').split('/').collect();
        match (req.method.as_str(), parts.as_slice()) {
            ("POST", ["sandboxes"]) => {
                if !body["workspaceRequirements"].is_object() || !body["bootstrap"].is_object() {
                    return (400, Some(invalid("Malformed request body: workspaceRequirements and bootstrap are required")));
                }
                let id = format!("fx-{}", self.seq.fetch_add(1, Ordering::Relaxed));
                let sbx = Arc::new(Sbx {
                    log: Mutex::new(Vec::new()),
                    delivered: Mutex::new(0),
                    changed: watch::channel(0).0,
                    state: Mutex::new(State {
                        status: "completed",
                        ..State::default()
                    }),
                    created: Instant::now(),
                });
                lock(&self.map).insert(id.clone(), sbx);
                (
                    201,
                    Some(json!({"id": id, "rpcEndpoint": format!("/sandboxes/{id}"),
                    "eventStreamEndpoint": format!("/sandboxes/{id}/events"), "healthEndpoint": format!("/sandboxes/{id}/health")})),
                )
            }
            ("DELETE", ["sandboxes", id]) => match lock(&self.map).remove(*id) {
                Some(_) => (204, None),
                None => (404, Some(invalid("No such sandbox"))),
            },
            (_, ["sandboxes", id, op]) => {
                let Some(sbx) = self.get(id) else {
                    return (404, Some(invalid("No such sandbox")));
                };
                self.op(&sbx, &req.method, op, body, faults)
            }
            _ => (404, Some(invalid("No such route"))),
        }
    }

    fn op(
        &self,
        sbx: &Sbx,
        method: &str,
        op: &str,
        body: Value,
        faults: &BTreeSet<Fault>,
    ) -> (u16, Option<Value>) {
        match (method, op) {
            ("POST", "spawn") => sbx.spawn(&body, faults),
            ("POST", "resolve") => sbx.resolve(&body, faults),
            ("POST", "replay") => sbx.replay(&body, faults),
            ("POST", "kill") => sbx.kill(faults),
            ("GET", "health") => sbx.health(),
            _ => (404, Some(invalid("No such route"))),
        }
    }

    #[allow(
        clippy::result_large_err,
        reason = "the handshake callback's error type is tungstenite's"
    )]
    async fn events(self: Arc<Self>, stream: TcpStream, token: &str, accepts_any: bool) {
        let me = self.clone();
        let found: Arc<Mutex<Option<Arc<Sbx>>>> = Arc::new(Mutex::new(None));
        let found2 = found.clone();
        let token = token.to_owned();
        let check = move |req: &Request, resp: Response| -> Result<Response, ErrorResponse> {
            let deny = |code: StatusCode, body: Value| {
                let mut r = ErrorResponse::new(Some(body.to_string()));
                *r.status_mut() = code;
                r
            };
            let auth = req
                .headers()
                .get("authorization")
                .and_then(|v| v.to_str().ok());
            if auth.and_then(|a| a.strip_prefix("Bearer ")) != Some(token.as_str()) && !accepts_any
            {
                return Err(deny(StatusCode::UNAUTHORIZED, invalid("Unauthorized")));
            }
            let id = req
                .uri()
                .path()
                .trim_start_matches("/sandboxes/")
                .trim_end_matches("/events");
            match me.get(id) {
                Some(s) => {
                    *lock(&found2) = Some(s);
                    Ok(resp)
                }
                None => Err(deny(StatusCode::NOT_FOUND, invalid("No such sandbox"))),
            }
        };
        let Ok(ws) = tokio_tungstenite::accept_hdr_async(stream, check).await else {
            return;
        };
        let Some(sbx) = lock(&found).clone() else {
            return;
        };
        let (mut sink, mut source) = ws.split();
        let mut changed = sbx.changed.subscribe();
        loop {
            changed.borrow_and_update();
            let from = *lock(&sbx.delivered);
            let pending: Vec<Value> = lock(&sbx.log)[from..].to_vec();
            for e in pending {
                if sink.send(Message::text(e.to_string())).await.is_err() {
                    return;
                }
                *lock(&sbx.delivered) += 1;
            }
            // The gateway's close first: an event is not written to a connection that is going away.
            tokio::select! {
                biased;
                m = source.next() => match m {
                    None | Some(Err(_)) | Some(Ok(Message::Close(_))) => return,
                    Some(Ok(_)) => {}
                },
                r = changed.changed() => if r.is_err() { return },
            }
        }
    }
}

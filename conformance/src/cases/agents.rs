//! A.*: agent sandboxes, the adapter-shim HTTP/WebSocket surface (`docs/spec/agent-sandboxes.md`), on the same
//! host and port as the FSP endpoint. A server without it (`POST /sandboxes` answered 404 or 405) skips them.
//!
//! Each case provisions its own sandbox with a small agent program (python3, shipped in the create request) that
//! follows the brief's `providerConfig.script`, and removes it at the end.

use std::time::Duration;

use futures_util::StreamExt;
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::http::HeaderValue;
use tokio_tungstenite::tungstenite::Message;

use super::common::{case, C};
use crate::ctx::Ctx;
use crate::framework::{Case, CaseResult, Stop};
use crate::wire::short;
use crate::{check, fail, skip};

/// The agent program: connects to `$SANDBOXD_CONTROL_SOCKET`, reads its brief, follows the script (`emit` an event,
/// `emit_many` status events, `write` a file under `/workspace`, `read` one into a status event), then answers
/// `shutdown` by exiting 0.
const AGENT: &str = r#"import json, os, socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect(os.environ["SANDBOXD_CONTROL_SOCKET"])
r = s.makefile("rb")
aid = os.environ.get("SANDBOXD_AGENT_ID", "agent")
def emit(e):
    e = dict(e); e.setdefault("agentId", aid); s.sendall((json.dumps(e) + "\n").encode())
brief = json.loads(r.readline())
emit({"type": "status", "message": "brief received"})
for step in (brief["brief"].get("providerConfig") or {}).get("script", []):
    if "emit" in step: emit(step["emit"])
    for i in range(step.get("emit_many", 0)): emit({"type": "status", "message": "tick %d" % i})
    if "write" in step:
        with open("/workspace/" + step["write"]["path"], "w") as f: f.write(step["write"]["content"])
    if "read" in step:
        try:
            with open("/workspace/" + step["read"]) as f: emit({"type": "status", "message": "read " + f.read()})
        except OSError as e: emit({"type": "status", "message": "read failed: errno %d" % e.errno})
for line in r:
    if json.loads(line)["type"] == "shutdown": sys.exit(0)
"#;

const AUTH: &str = "Every agent-sandbox route checks the bearer token first; a missing or wrong token gets 401 with a PluginError body.";
const UNKNOWN: &str = "A route naming a sandbox that does not exist gets 404 with a PluginError (`invalid_state`) body.";
const MALFORMED: &str = "A body that is not the endpoint's JSON gets 400, one over the body limit 413, both with a PluginError body; the server keeps serving.";
const CREATE: &str = "`POST /sandboxes` answers `{id, rpcEndpoint, eventStreamEndpoint, healthEndpoint}` under `/sandboxes/<id>`; `DELETE /sandboxes/<id>` removes it (then 404).";
const STAMPS: &str = "Events carry `sourceEventId` (UUID v7), `sourceSequence` (from 1, no gaps), `sourceOccurredAt` and `runId` (the handle's `sessionId`); the first is `LifecycleEvent` `started`.";
const RESOLVE: &str = "`POST /resolve` of a decision the agent did not emit (or already resolved) gets 404 `decision_not_found` with the `decisionId`.";
const REPLAY: &str = "`POST /replay {fromSequence, toSequence}` answers exactly the range's events as first emitted (same `sourceEventId`).";
const KILL: &str = "`POST /kill` answers `KillResponse {artifactsExtracted, cleanShutdown}`, a `LifecycleEvent` `killed` follows, a second kill gets 409 `invalid_state`.";
const HEALTH: &str = "`GET /health` answers `{status, agentStatus, uptimeMs, resourceUsage {cpuPercent, memoryMb, diskMb, collectedAt}, pendingEventBufferSize}`.";

/// The cases of this group, in id order.
pub static CASES: &[Case] = &[
    case!(
        "A.1.1",
        Must,
        "agents",
        "Agent routes need the bearer token",
        AUTH,
        auth
    ),
    case!(
        "A.1.2",
        Must,
        "agents",
        "Unknown sandbox: 404 PluginError",
        UNKNOWN,
        unknown
    ),
    case!(
        "A.1.3",
        Must,
        "agents",
        "Malformed and oversize bodies: 400/413 PluginError",
        MALFORMED,
        malformed
    ),
    case!(
        "A.2.1",
        Must,
        "agents",
        "Create answers the endpoints; delete removes",
        CREATE,
        create_delete
    ),
    case!(
        "A.2.2",
        Must,
        "agents",
        "Events are stamped with gapless sequences and UUID v7 ids",
        STAMPS,
        stamps
    ),
    case!(
        "A.2.3",
        Must,
        "agents",
        "Resolve of an unknown decision: decision_not_found",
        RESOLVE,
        resolve
    ),
    case!(
        "A.2.4",
        Must,
        "agents",
        "Replay answers exactly the range",
        REPLAY,
        replay
    ),
    case!(
        "A.2.5",
        Must,
        "agents",
        "Kill answers a KillResponse and emits killed",
        KILL,
        kill
    ),
    case!(
        "A.2.6",
        Must,
        "agents",
        "Health has the SandboxHealthResponse fields",
        HEALTH,
        health
    ),
];

/// One HTTP/1.1 request (`Connection: close`): status and JSON body (`Value::Null` when empty, a string when not
/// JSON).
pub(super) async fn http(
    ctx: &Ctx,
    method: &str,
    path: &str,
    body: &[u8],
    token: Option<&str>,
) -> Result<(u16, Value), Stop> {
    let (host, port) = ctx.endpoint_host_port();
    let fut = async {
        let mut s = tokio::net::TcpStream::connect((host.as_str(), port))
            .await
            .map_err(|e| Stop::Harness(format!("connect {host}:{port}: {e}")))?;
        let auth = token
            .map(|t| format!("Authorization: Bearer {t}\r\n"))
            .unwrap_or_default();
        let head = format!(
            "{method} {path} HTTP/1.1\r\nHost: {host}:{port}\r\n{auth}Content-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
            body.len()
        );
        s.write_all(head.as_bytes())
            .await
            .map_err(|e| Stop::Harness(e.to_string()))?;
        // A server may answer (e.g. 413) before the body is sent and close: that is fine.
        let _ = s.write_all(body).await;
        let mut out = Vec::new();
        let _ = s.read_to_end(&mut out).await;
        let text = String::from_utf8_lossy(&out).into_owned();
        let (head, rest) = text.split_once("\r\n\r\n").ok_or_else(|| {
            Stop::Fail(format!(
                "{method} {path}: not an HTTP answer: {:?}",
                text.chars().take(200).collect::<String>()
            ))
        })?;
        let status: u16 = head
            .split_whitespace()
            .nth(1)
            .and_then(|c| c.parse().ok())
            .ok_or_else(|| Stop::Fail(format!("{method} {path}: bad status line {head:?}")))?;
        let chunked = head
            .to_ascii_lowercase()
            .contains("transfer-encoding: chunked");
        let body = if chunked {
            dechunk(rest)
        } else {
            rest.to_owned()
        };
        let v = if body.trim().is_empty() {
            Value::Null
        } else {
            serde_json::from_str(&body).unwrap_or(Value::String(body))
        };
        Ok((status, v))
    };
    tokio::time::timeout(ctx.secs(30), fut)
        .await
        .map_err(|_| Stop::Fail(format!("{method} {path}: no answer within 30 s")))?
}

fn dechunk(s: &str) -> String {
    let mut out = String::new();
    let mut rest = s;
    while let Some((size, tail)) = rest.split_once("\r\n") {
        let Ok(n) = usize::from_str_radix(size.trim(), 16) else {
            break;
        };
        if n == 0 || tail.len() < n {
            break;
        }
        out.push_str(&tail[..n]);
        rest = tail[n..].trim_start_matches("\r\n");
    }
    out
}

/// Checks a PluginError body with `code`.
pub(super) fn plugin_error(
    what: &str,
    status: u16,
    want: u16,
    body: &Value,
    code: &str,
) -> Result<(), Stop> {
    check!(
        status == want,
        "{what}: HTTP {status}, expected {want}: {}",
        short(body)
    );
    check!(
        body.get("code").and_then(Value::as_str) == Some(code),
        "{what}: expected a PluginError with code {code:?}, got {}",
        short(body)
    );
    Ok(())
}

pub(super) fn create_body() -> Value {
    let expires = protocol::format_ts(time_in(3600));
    json!({
        "workspaceRequirements": {"mounts": [], "capabilities": ["terminal"],
                                  "resourceLimits": {"memoryMb": 256, "diskMb": 64, "cpuCores": 1}},
        "bootstrap": {"backendUrl": "http://127.0.0.1:9", "backendToken": "conformance-token",
                      "tokenExpiresAt": expires, "agentId": "agent-1",
                      "artifactUploadEndpoint": "http://127.0.0.1:9/api/artifacts"},
        "template": {"command": ["/usr/bin/python3", "/workspace/agent.py"],
                     "files": [{"path": "agent.py", "content": AGENT}]}
    })
}

fn time_in(secs: i64) -> time::OffsetDateTime {
    time::OffsetDateTime::now_utc() + time::Duration::seconds(secs)
}

/// Creates a sandbox; skips when the server has no agent sandboxes.
pub(super) async fn create(ctx: &Ctx) -> Result<String, Stop> {
    let (status, body) = http(
        ctx,
        "POST",
        "/sandboxes",
        create_body().to_string().as_bytes(),
        Some(&ctx.cfg.token),
    )
    .await?;
    if status == 404 || status == 405 {
        skip!("the server has no agent sandboxes (POST /sandboxes: HTTP {status})");
    }
    check!(
        status == 201 || status == 200,
        "POST /sandboxes: HTTP {status}: {}",
        short(&body)
    );
    body["id"]
        .as_str()
        .map(str::to_owned)
        .ok_or_else(|| Stop::Fail(format!("POST /sandboxes: no id: {}", short(&body))))
}

pub(super) async fn remove(ctx: &Ctx, id: &str) {
    let _ = http(
        ctx,
        "DELETE",
        &format!("/sandboxes/{id}"),
        b"",
        Some(&ctx.cfg.token),
    )
    .await;
}

/// Runs `f` on a fresh sandbox and removes it whatever happens.
async fn with_sandbox<F, Fut>(ctx: &Ctx, f: F) -> CaseResult
where
    F: FnOnce(String) -> Fut,
    Fut: std::future::Future<Output = CaseResult>,
{
    let id = create(ctx).await?;
    let r = f(id.clone()).await;
    remove(ctx, &id).await;
    r
}

pub(super) async fn spawn(ctx: &Ctx, id: &str, script: Value) -> Result<Value, Stop> {
    let brief =
        json!({"agentId": "agent-1", "role": "conformance", "providerConfig": {"script": script}});
    let (status, h) = http(
        ctx,
        "POST",
        &format!("/sandboxes/{id}/spawn"),
        brief.to_string().as_bytes(),
        Some(&ctx.cfg.token),
    )
    .await?;
    check!(status == 200, "POST /spawn: HTTP {status}: {}", short(&h));
    check!(
        h["status"] == "running",
        "POST /spawn: the handle's status is not running: {}",
        short(&h)
    );
    Ok(h)
}

/// Reads `n` events from a new `WS /events` connection, then closes it.
async fn read_events(ctx: &Ctx, id: &str, n: usize) -> Result<Vec<Value>, Stop> {
    let mut events = Events::open(ctx, id).await?;
    let out = events.next(ctx, n).await?;
    events.close().await;
    Ok(out)
}

/// One gateway connection to `WS /events`.
pub(super) struct Events {
    url: String,
    ws: tokio_tungstenite::WebSocketStream<
        tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>,
    >,
}

impl Events {
    pub(super) async fn open(ctx: &Ctx, id: &str) -> Result<Self, Stop> {
        let (host, port) = ctx.endpoint_host_port();
        let url = format!("ws://{host}:{port}/sandboxes/{id}/events");
        let mut req = url
            .as_str()
            .into_client_request()
            .map_err(|e| Stop::Harness(format!("bad URL {url}: {e}")))?;
        let auth = HeaderValue::from_str(&format!("Bearer {}", ctx.cfg.token))
            .map_err(|e| Stop::Harness(e.to_string()))?;
        req.headers_mut().insert("authorization", auth);
        match tokio::time::timeout(ctx.secs(10), tokio_tungstenite::connect_async(req)).await {
            Err(_) => fail!("WS {url}: no upgrade within 10 s"),
            Ok(Err(e)) => fail!("WS {url}: {e}"),
            Ok(Ok((ws, _))) => Ok(Self { url, ws }),
        }
    }

    /// The next `n` events.
    pub(super) async fn next(&mut self, ctx: &Ctx, n: usize) -> Result<Vec<Value>, Stop> {
        let mut out = Vec::new();
        let deadline = tokio::time::Instant::now() + ctx.secs(30);
        while out.len() < n {
            let m = tokio::time::timeout_at(deadline, self.ws.next())
                .await
                .map_err(|_| {
                    Stop::Fail(format!(
                        "only {} of {n} events within 30 s: {}",
                        out.len(),
                        short(&Value::Array(out.clone()))
                    ))
                })?;
            match m {
                Some(Ok(Message::Text(t))) => {
                    let v: Value = serde_json::from_str(&t)
                        .map_err(|e| Stop::Fail(format!("an event is not JSON ({e}): {t}")))?;
                    out.push(v);
                }
                Some(Ok(_)) => {}
                other => fail!(
                    "{}: the event stream ended after {} events: {other:?}",
                    self.url,
                    out.len()
                ),
            }
        }
        Ok(out)
    }

    pub(super) async fn close(mut self) {
        let _ = self.ws.close(None).await;
    }
}

async fn auth(ctx: C) -> CaseResult {
    let body = create_body().to_string();
    for token in [None, Some("not-the-token-0123456789")] {
        let (status, v) = http(&ctx, "POST", "/sandboxes", body.as_bytes(), token).await?;
        if status == 404 || status == 405 {
            skip!("the server has no agent sandboxes (POST /sandboxes: HTTP {status})");
        }
        if status == 201 {
            if let Some(id) = v["id"].as_str() {
                remove(&ctx, id).await;
            }
        }
        plugin_error(
            &format!("POST /sandboxes with token {token:?}"),
            status,
            401,
            &v,
            "invalid_state",
        )?;
    }
    Ok("missing and wrong tokens refused".into())
}

async fn unknown(ctx: C) -> CaseResult {
    // Make sure the feature exists first (else skip).
    let id = create(&ctx).await?;
    remove(&ctx, &id).await;
    for (m, p) in [
        ("GET", "health"),
        ("POST", "spawn"),
        ("POST", "kill"),
        ("POST", "replay"),
    ] {
        let (status, v) = http(
            &ctx,
            m,
            &format!("/sandboxes/no-such-sandbox/{p}"),
            b"{}",
            Some(&ctx.cfg.token),
        )
        .await?;
        plugin_error(
            &format!("{m} /sandboxes/no-such-sandbox/{p}"),
            status,
            404,
            &v,
            "invalid_state",
        )?;
    }
    Ok("404 invalid_state".into())
}

async fn malformed(ctx: C) -> CaseResult {
    let id = create(&ctx).await?;
    remove(&ctx, &id).await;
    let (status, v) = http(
        &ctx,
        "POST",
        "/sandboxes",
        b"{not json",
        Some(&ctx.cfg.token),
    )
    .await?;
    plugin_error(
        "POST /sandboxes with a body that is not JSON",
        status,
        400,
        &v,
        "invalid_state",
    )?;
    let big = vec![b' '; 4 << 20];
    let (status, v) = http(&ctx, "POST", "/sandboxes", &big, Some(&ctx.cfg.token)).await?;
    plugin_error(
        "POST /sandboxes with a 4 MiB body",
        status,
        413,
        &v,
        "invalid_state",
    )?;
    // Still serving.
    let id = create(&ctx).await?;
    remove(&ctx, &id).await;
    Ok("400 and 413 with PluginError bodies".into())
}

async fn create_delete(ctx: C) -> CaseResult {
    let (status, body) = http(
        &ctx,
        "POST",
        "/sandboxes",
        create_body().to_string().as_bytes(),
        Some(&ctx.cfg.token),
    )
    .await?;
    if status == 404 || status == 405 {
        skip!("the server has no agent sandboxes (POST /sandboxes: HTTP {status})");
    }
    check!(
        status == 201,
        "POST /sandboxes: HTTP {status}, expected 201: {}",
        short(&body)
    );
    let id = body["id"].as_str().unwrap_or_default().to_owned();
    check!(!id.is_empty(), "no id: {}", short(&body));
    let ends = |k: &str, tail: &str| {
        body[k]
            .as_str()
            .is_some_and(|v| v.ends_with(&format!("/sandboxes/{id}{tail}")))
    };
    let ok = ends("rpcEndpoint", "")
        && ends("eventStreamEndpoint", "/events")
        && ends("healthEndpoint", "/health");
    if !ok {
        remove(&ctx, &id).await;
        fail!(
            "the endpoints are not under /sandboxes/{id}: {}",
            short(&body)
        );
    }
    let (status, v) = http(
        &ctx,
        "DELETE",
        &format!("/sandboxes/{id}"),
        b"",
        Some(&ctx.cfg.token),
    )
    .await?;
    check!(
        (200..300).contains(&status),
        "DELETE: HTTP {status}: {}",
        short(&v)
    );
    let (status, v) = http(
        &ctx,
        "GET",
        &format!("/sandboxes/{id}/health"),
        b"",
        Some(&ctx.cfg.token),
    )
    .await?;
    plugin_error("GET /health after DELETE", status, 404, &v, "invalid_state")?;
    Ok(format!("created and removed {id}"))
}

fn is_uuid_v7(s: &str) -> bool {
    let b = s.as_bytes();
    s.len() == 36
        && [8, 13, 18, 23].iter().all(|&i| b[i] == b'-')
        && s.chars()
            .enumerate()
            .all(|(i, c)| [8, 13, 18, 23].contains(&i) || c.is_ascii_hexdigit())
        && b[14] == b'7'
        && matches!(b[19], b'8' | b'9' | b'a' | b'b' | b'A' | b'B')
}

async fn stamps(ctx: C) -> CaseResult {
    let c = ctx.clone();
    with_sandbox(&ctx, |id| async move {
        let h = spawn(&c, &id, json!([{"emit_many": 5}])).await?;
        // started, brief received, 5 ticks.
        let events = read_events(&c, &id, 7).await?;
        check!(
            events[0]["event"]["type"] == "lifecycle" && events[0]["event"]["action"] == "started",
            "the first event is not LifecycleEvent started: {}",
            short(&events[0])
        );
        for (i, e) in events.iter().enumerate() {
            check!(
                e["sourceSequence"] == (i as u64 + 1),
                "event {i} has sourceSequence {} (expected {}): {}",
                e["sourceSequence"],
                i + 1,
                short(e)
            );
            check!(
                e["sourceEventId"].as_str().is_some_and(is_uuid_v7),
                "sourceEventId is not a UUID v7: {}",
                short(e)
            );
            check!(
                e["sourceOccurredAt"].is_string(),
                "no sourceOccurredAt: {}",
                short(e)
            );
            check!(
                e["runId"] == h["sessionId"],
                "runId {} is not the handle's sessionId {}",
                e["runId"],
                h["sessionId"]
            );
        }
        Ok("7 events, sequences 1..7".into())
    })
    .await
}

async fn resolve(ctx: C) -> CaseResult {
    let c = ctx.clone();
    with_sandbox(&ctx, |id| async move {
        spawn(&c, &id, json!([{"emit": {"type": "decision", "subtype": "tool_approval", "decisionId": "d1", "toolName": "t", "toolArgs": {}}}])).await?;
        read_events(&c, &id, 3).await?;
        let path = format!("/sandboxes/{id}/resolve");
        let (status, v) = http(&c, "POST", &path, json!({"decisionId": "d-unknown", "resolution": {}}).to_string().as_bytes(), Some(&c.cfg.token)).await?;
        plugin_error("resolve of an unknown decision", status, 404, &v, "decision_not_found")?;
        check!(v["decisionId"] == "d-unknown", "decision_not_found without the decisionId: {}", short(&v));
        let res = json!({"decisionId": "d1", "resolution": {"resolutionType": "approve", "rationale": "ok", "actionKind": "create"}});
        let (status, v) = http(&c, "POST", &path, res.to_string().as_bytes(), Some(&c.cfg.token)).await?;
        check!((200..300).contains(&status), "resolve of the agent's decision: HTTP {status}: {}", short(&v));
        let (status, v) = http(&c, "POST", &path, res.to_string().as_bytes(), Some(&c.cfg.token)).await?;
        plugin_error("a second resolve of the same decision", status, 404, &v, "decision_not_found")?;
        Ok("unknown and stale decisions refused".into())
    })
    .await
}

async fn replay(ctx: C) -> CaseResult {
    let c = ctx.clone();
    with_sandbox(&ctx, |id| async move {
        spawn(&c, &id, json!([{"emit_many": 6}])).await?;
        let events = read_events(&c, &id, 8).await?;
        let (status, v) = http(
            &c,
            "POST",
            &format!("/sandboxes/{id}/replay"),
            br#"{"fromSequence": 3, "toSequence": 5}"#,
            Some(&c.cfg.token),
        )
        .await?;
        check!(status == 200, "POST /replay: HTTP {status}: {}", short(&v));
        let got = v["events"].as_array().cloned().unwrap_or_default();
        check!(
            got == events[2..5].to_vec(),
            "replay of 3..5 is not the events first streamed: {} vs {}",
            short(&Value::Array(got)),
            short(&Value::Array(events[2..5].to_vec()))
        );
        Ok("3 events, identical".into())
    })
    .await
}

async fn kill(ctx: C) -> CaseResult {
    let c = ctx.clone();
    with_sandbox(&ctx, |id| async move {
        spawn(&c, &id, json!([])).await?;
        // One gateway connection throughout: an event written to a connection the client is closing counts as
        // delivered to it, so a second connection opened right after the kill may never see the kill's event.
        let mut events = Events::open(&c, &id).await?;
        events.next(&c, 2).await?;
        let path = format!("/sandboxes/{id}/kill");
        let (status, v) = http(
            &c,
            "POST",
            &path,
            br#"{"grace": true, "graceTimeoutMs": 5000}"#,
            Some(&c.cfg.token),
        )
        .await?;
        check!(status == 200, "POST /kill: HTTP {status}: {}", short(&v));
        check!(
            v["artifactsExtracted"].is_u64() && v["cleanShutdown"].is_boolean(),
            "not a KillResponse: {}",
            short(&v)
        );
        // Events already delivered are not sent again: the next one is the kill's.
        let after = events.next(&c, 1).await?;
        events.close().await;
        let events = after;
        check!(
            events[0]["event"]["action"] == "killed",
            "no LifecycleEvent killed after the kill: {}",
            short(&events[0])
        );
        let (status, v) = http(&c, "POST", &path, b"{}", Some(&c.cfg.token)).await?;
        plugin_error("a second kill", status, 409, &v, "invalid_state")?;
        Ok(format!("cleanShutdown {}", v["cleanShutdown"]))
    })
    .await
}

async fn health(ctx: C) -> CaseResult {
    let c = ctx.clone();
    with_sandbox(&ctx, |id| async move {
        spawn(&c, &id, json!([])).await?;
        tokio::time::sleep(Duration::from_millis(100)).await;
        let (status, v) = http(
            &c,
            "GET",
            &format!("/sandboxes/{id}/health"),
            b"",
            Some(&c.cfg.token),
        )
        .await?;
        check!(status == 200, "GET /health: HTTP {status}: {}", short(&v));
        check!(
            ["healthy", "degraded", "unhealthy"].contains(&v["status"].as_str().unwrap_or("")),
            "status: {}",
            short(&v)
        );
        check!(
            v["agentStatus"].is_string()
                && v["uptimeMs"].is_u64()
                && v["pendingEventBufferSize"].is_u64(),
            "fields: {}",
            short(&v)
        );
        let u = &v["resourceUsage"];
        check!(
            u["cpuPercent"].is_number()
                && u["memoryMb"].is_number()
                && u["diskMb"].is_number()
                && u["collectedAt"].is_string(),
            "resourceUsage: {}",
            short(&v)
        );
        Ok(format!("agentStatus {}", v["agentStatus"]))
    })
    .await
}

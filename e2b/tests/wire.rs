//! The facade's wire, in process: the router over a fake engine, driven with `tower::ServiceExt::oneshot` the way
//! the e2b SDK drives it (headers, bodies and framing as research note §1–3 records them).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::io::Write as _;
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::body::Body;
use axum::http::{HeaderMap, Request, StatusCode};
use axum::Router;
use bytes::Bytes;
use e2b::engine::{
    Attached, BoxFuture, CreateSpec, Engine, EngineError, LiveSandbox, ProcessEnd, ProcessEvent,
    ProcessInfo, ProcessSpec, SandboxInfo, SandboxState,
};
use e2b::envd::{file_signature, FileOperation};
use e2b::{router, Facade};
use http_body_util::BodyExt;
use nix::sys::signal::Signal;
use serde_json::{json, Value};
use tokio::sync::mpsc;
use tower::ServiceExt;

const API_KEY: &str = "e2b_test_key";

/// A sandbox whose processes answer with a canned event sequence, and whose root is a temporary directory.
struct FakeSandbox {
    info: Mutex<SandboxInfo>,
    root: PathBuf,
    started: Mutex<Vec<ProcessSpec>>,
    signals: Mutex<Vec<(u32, Signal)>>,
    /// Senders of processes that never end (cmd `hang`), kept so their streams stay open.
    hanging: Mutex<Vec<mpsc::Sender<ProcessEvent>>>,
}

impl FakeSandbox {
    fn running(&self) -> bool {
        self.info.lock().unwrap().state == SandboxState::Running
    }
}

impl LiveSandbox for FakeSandbox {
    fn info(&self) -> SandboxInfo {
        self.info.lock().unwrap().clone()
    }

    fn set_timeout(&self, timeout: Duration) {
        self.info.lock().unwrap().end_at = SystemTime::now() + timeout;
    }

    fn pause(&self) -> BoxFuture<'_, Result<bool, EngineError>> {
        Box::pin(async move {
            let mut info = self.info.lock().unwrap();
            if info.state == SandboxState::Paused {
                return Ok(false);
            }
            info.state = SandboxState::Paused;
            Ok(true)
        })
    }

    fn resume(&self) -> BoxFuture<'_, Result<(), EngineError>> {
        Box::pin(async move {
            self.info.lock().unwrap().state = SandboxState::Running;
            Ok(())
        })
    }

    fn start(&self, spec: ProcessSpec) -> BoxFuture<'_, Result<Attached, EngineError>> {
        Box::pin(async move {
            assert!(self.running());
            let hang = spec.cmd == "hang";
            self.started.lock().unwrap().push(spec);
            let (tx, rx) = mpsc::channel(8);
            if hang {
                self.hanging.lock().unwrap().push(tx);
                return Ok(Attached {
                    pid: 42,
                    events: rx,
                });
            }
            tx.send(ProcessEvent::Stdout(Bytes::from_static(b"hello\n")))
                .await
                .unwrap();
            tx.send(ProcessEvent::Stderr(Bytes::from_static(b"oops")))
                .await
                .unwrap();
            let end = ProcessEnd {
                exit_code: 3,
                exited: true,
                status: "exit status 3".into(),
                error: None,
            };
            tx.send(ProcessEvent::End(end)).await.unwrap();
            Ok(Attached { pid: 7, events: rx })
        })
    }

    fn attach(&self, pid: u32) -> Result<Attached, EngineError> {
        if pid != 42 {
            return Err(EngineError::ProcessNotFound(pid));
        }
        let (tx, rx) = mpsc::channel(8);
        self.hanging.lock().unwrap().push(tx);
        Ok(Attached { pid, events: rx })
    }

    fn processes(&self) -> Vec<ProcessInfo> {
        let spec = ProcessSpec {
            cmd: "hang".into(),
            tag: Some("bg".into()),
            ..ProcessSpec::default()
        };
        vec![ProcessInfo { pid: 42, spec }]
    }

    fn signal(&self, pid: u32, signal: Signal) -> BoxFuture<'_, Result<(), EngineError>> {
        Box::pin(async move {
            if pid != 42 {
                return Err(EngineError::ProcessNotFound(pid));
            }
            self.signals.lock().unwrap().push((pid, signal));
            Ok(())
        })
    }

    fn send_input<'a>(
        &'a self,
        pid: u32,
        _data: &'a [u8],
    ) -> BoxFuture<'a, Result<(), EngineError>> {
        Box::pin(async move {
            if pid == 42 {
                Ok(())
            } else {
                Err(EngineError::ProcessNotFound(pid))
            }
        })
    }

    fn close_stdin(&self, pid: u32) -> Result<(), EngineError> {
        if pid == 42 {
            Ok(())
        } else {
            Err(EngineError::ProcessNotFound(pid))
        }
    }

    fn root(&self) -> Result<OwnedFd, EngineError> {
        std::fs::File::open(&self.root)
            .map(OwnedFd::from)
            .map_err(|e| EngineError::Internal(e.to_string()))
    }

    fn owner(&self) -> (u32, u32) {
        (
            nix::unistd::getuid().as_raw(),
            nix::unistd::getgid().as_raw(),
        )
    }

    fn usage(&self) -> Result<(u64, u64), EngineError> {
        Ok((64 << 20, 1_000_000))
    }
}

/// Sandboxes in a table; each one's root is a directory with `/home/user`.
struct FakeEngine {
    dir: tempfile::TempDir,
    next: AtomicU32,
    sandboxes: Mutex<Vec<Arc<FakeSandbox>>>,
    created: Mutex<Vec<CreateSpec>>,
}

impl FakeEngine {
    fn new() -> Arc<Self> {
        Arc::new(Self {
            dir: tempfile::tempdir().unwrap(),
            next: AtomicU32::new(1),
            sandboxes: Mutex::new(Vec::new()),
            created: Mutex::new(Vec::new()),
        })
    }

    fn sandbox(&self, id: &str) -> Arc<FakeSandbox> {
        self.sandboxes
            .lock()
            .unwrap()
            .iter()
            .find(|s| s.info().id == id)
            .unwrap()
            .clone()
    }
}

impl Engine for FakeEngine {
    fn create(&self, spec: CreateSpec) -> BoxFuture<'_, Result<SandboxInfo, EngineError>> {
        Box::pin(async move {
            let n = self.next.fetch_add(1, Ordering::SeqCst);
            let id = format!("sbx{n}");
            let root = self.dir.path().join(&id);
            std::fs::create_dir_all(root.join("home/user")).unwrap();
            // Started n seconds after a fixed instant, so the listing order is known.
            let started_at = UNIX_EPOCH + Duration::from_secs(1_700_000_000 + u64::from(n));
            let info = SandboxInfo {
                id,
                template: spec.template.clone(),
                metadata: spec.metadata.clone(),
                started_at,
                end_at: SystemTime::now() + spec.timeout,
                state: SandboxState::Running,
                access_token: format!("token-{n}"),
                cpu_count: 2,
                memory_mb: 512,
                disk_mb: 1024,
            };
            self.created.lock().unwrap().push(spec);
            self.sandboxes.lock().unwrap().push(Arc::new(FakeSandbox {
                info: Mutex::new(info.clone()),
                root,
                started: Mutex::new(Vec::new()),
                signals: Mutex::new(Vec::new()),
                hanging: Mutex::new(Vec::new()),
            }));
            Ok(info)
        })
    }

    fn get(&self, id: &str) -> Option<Arc<dyn LiveSandbox>> {
        let sandboxes = self.sandboxes.lock().unwrap();
        let found = sandboxes.iter().find(|s| s.info().id == id)?;
        Some(found.clone() as Arc<dyn LiveSandbox>)
    }

    fn list(&self) -> Vec<Arc<dyn LiveSandbox>> {
        self.sandboxes
            .lock()
            .unwrap()
            .iter()
            .map(|s| s.clone() as Arc<dyn LiveSandbox>)
            .collect()
    }

    fn kill<'a>(&'a self, id: &'a str) -> BoxFuture<'a, bool> {
        Box::pin(async move {
            let mut sandboxes = self.sandboxes.lock().unwrap();
            let before = sandboxes.len();
            sandboxes.retain(|s| s.info().id != id);
            sandboxes.len() != before
        })
    }
}

fn app(engine: &Arc<FakeEngine>) -> Router {
    router(Facade {
        engine: engine.clone(),
        api_key: Arc::new(|key| key == API_KEY),
        max_upload_bytes: 1 << 20,
        fleet: None,
    })
}

struct Answer {
    status: StatusCode,
    headers: HeaderMap,
    body: Bytes,
}

impl Answer {
    fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| panic!("{e}: {:?}", self.body))
    }
}

async fn send(app: &Router, request: Request<Body>) -> Answer {
    let response = app.clone().oneshot(request).await.unwrap();
    let status = response.status();
    let headers = response.headers().clone();
    let body = response.into_body().collect().await.unwrap().to_bytes();
    Answer {
        status,
        headers,
        body,
    }
}

fn api(method: &str, uri: &str, body: Value) -> Request<Body> {
    Request::builder()
        .method(method)
        .uri(uri)
        .header("x-api-key", API_KEY)
        .header("content-type", "application/json")
        .body(Body::from(body.to_string()))
        .unwrap()
}

async fn create(app: &Router, body: Value) -> (String, String) {
    let answer = send(app, api("POST", "/v2/sandboxes", body)).await;
    assert_eq!(answer.status, StatusCode::CREATED, "{:?}", answer.body);
    let v = answer.json();
    (
        v["sandboxID"].as_str().unwrap().to_owned(),
        v["envdAccessToken"].as_str().unwrap().to_owned(),
    )
}

fn envelope(flags: u8, payload: &[u8]) -> Vec<u8> {
    let mut out = vec![flags];
    out.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    out.extend_from_slice(payload);
    out
}

fn rpc(path: &str, id: &str, token: &str, stream: bool, body: Vec<u8>) -> Request<Body> {
    let content_type = if stream {
        "application/connect+json"
    } else {
        "application/json"
    };
    Request::builder()
        .method("POST")
        .uri(path)
        .header("E2b-Sandbox-Id", id)
        .header("e2b-sandbox-port", "49983")
        .header("X-Access-Token", token)
        .header("connect-protocol-version", "1")
        .header("content-type", content_type)
        .body(Body::from(body))
        .unwrap()
}

fn stream_rpc(path: &str, id: &str, token: &str, message: Value) -> Request<Body> {
    rpc(
        path,
        id,
        token,
        true,
        envelope(0, message.to_string().as_bytes()),
    )
}

fn unary_rpc(path: &str, id: &str, token: &str, message: Value) -> Request<Body> {
    rpc(path, id, token, false, message.to_string().into_bytes())
}

/// The envelopes of a stream body: (flags, JSON).
fn envelopes(mut body: &[u8]) -> Vec<(u8, Value)> {
    let mut out = Vec::new();
    while !body.is_empty() {
        let len = u32::from_be_bytes(body[1..5].try_into().unwrap()) as usize;
        out.push((body[0], serde_json::from_slice(&body[5..5 + len]).unwrap()));
        body = &body[5 + len..];
    }
    out
}

/// A query value url-encoded, as the SDK's urlencode does.
fn enc(value: &str) -> String {
    form_urlencoded::byte_serialize(value.as_bytes()).collect()
}

fn home(engine: &FakeEngine, id: &str) -> PathBuf {
    engine.sandbox(id).root.join("home/user")
}

#[tokio::test]
async fn create_returns_201_with_the_keys_the_sdk_requires() {
    let engine = FakeEngine::new();
    let app = app(&engine);
    let body =
        json!({"templateID": "base", "timeout": 60, "metadata": {"k": "v"}, "envVars": {"A": "1"}});
    let answer = send(&app, api("POST", "/v2/sandboxes", body)).await;
    assert_eq!(answer.status, StatusCode::CREATED);
    let v = answer.json();
    for key in [
        "templateID",
        "sandboxID",
        "clientID",
        "envdVersion",
        "envdAccessToken",
    ] {
        assert!(v[key].is_string(), "{key} missing in {v}");
    }
    assert_eq!(v["envdVersion"], e2b::ENVD_VERSION);
    assert!(v["domain"].is_null() && v.get("domain").is_some());
    assert!(v["trafficAccessToken"].is_null());
    let spec = engine.created.lock().unwrap()[0].clone();
    assert_eq!(spec.timeout, Duration::from_secs(60));
    assert_eq!(
        spec.env_vars,
        BTreeMap::from([("A".to_owned(), "1".to_owned())])
    );

    // Unmapped E2B features are refused, naming the field.
    let answer = send(
        &app,
        api("POST", "/v2/sandboxes", json!({"autoPause": true})),
    )
    .await;
    assert_eq!(answer.status, StatusCode::BAD_REQUEST);
    assert!(answer.json()["message"]
        .as_str()
        .unwrap()
        .contains("autoPause"));
    assert_eq!(answer.headers["should-retry"], "false");
}

#[tokio::test]
async fn wrong_or_missing_api_key_is_401() {
    let engine = FakeEngine::new();
    let app = app(&engine);
    let mut request = api("POST", "/v2/sandboxes", json!({}));
    request
        .headers_mut()
        .insert("x-api-key", "nope".parse().unwrap());
    let answer = send(&app, request).await;
    assert_eq!(answer.status, StatusCode::UNAUTHORIZED);
    assert_eq!(answer.json()["code"], 401);
    let mut request = api("GET", "/v2/sandboxes", json!({}));
    request.headers_mut().remove("x-api-key");
    assert_eq!(send(&app, request).await.status, StatusCode::UNAUTHORIZED);
}

#[tokio::test]
async fn sandbox_lifecycle_answers() {
    let engine = FakeEngine::new();
    let app = app(&engine);
    let (id, token) = create(&app, json!({"metadata": {"a": "b"}})).await;

    let answer = send(&app, api("GET", &format!("/sandboxes/{id}"), Value::Null)).await;
    assert_eq!(answer.status, StatusCode::OK);
    let v = answer.json();
    assert_eq!(v["state"], "running");
    assert_eq!(v["envdAccessToken"], token);
    assert_eq!(v["memoryMB"], 512);
    assert!(v["startedAt"]
        .as_str()
        .unwrap()
        .starts_with("2023-11-14T22:13:"));

    let answer = send(
        &app,
        api("POST", &format!("/sandboxes/{id}/pause"), json!({})),
    )
    .await;
    assert_eq!(answer.status, StatusCode::NO_CONTENT);
    let answer = send(
        &app,
        api("POST", &format!("/sandboxes/{id}/pause"), json!({})),
    )
    .await;
    assert_eq!(answer.status, StatusCode::CONFLICT);
    // A paused sandbox's plane answers like a missing one (the SDK: not running).
    let health = Request::get("/health")
        .header("e2b-sandbox-id", &id)
        .header("x-access-token", &token);
    let answer = send(&app, health.body(Body::empty()).unwrap()).await;
    assert_eq!(answer.status, StatusCode::BAD_GATEWAY);

    let before = engine.sandbox(&id).info().end_at;
    let answer = send(
        &app,
        api(
            "POST",
            &format!("/v2/sandboxes/{id}/connect"),
            json!({"timeout": 1}),
        ),
    )
    .await;
    assert_eq!(answer.status, StatusCode::OK);
    assert_eq!(answer.json()["envdAccessToken"], token);
    assert_eq!(engine.sandbox(&id).info().state, SandboxState::Running);
    assert_eq!(
        engine.sandbox(&id).info().end_at,
        before,
        "connect never shortens"
    );

    let answer = send(
        &app,
        api("POST", &format!("/sandboxes/{id}/resume"), json!({})),
    )
    .await;
    assert_eq!(answer.status, StatusCode::CONFLICT);

    let answer = send(
        &app,
        api(
            "POST",
            &format!("/sandboxes/{id}/timeout"),
            json!({"timeout": 5}),
        ),
    )
    .await;
    assert_eq!(answer.status, StatusCode::NO_CONTENT);

    let answer = send(
        &app,
        api("GET", &format!("/sandboxes/{id}/metrics"), Value::Null),
    )
    .await;
    assert_eq!(answer.status, StatusCode::OK);
    assert_eq!(answer.json()[0]["memTotal"], 512u64 << 20);

    let answer = send(
        &app,
        api("DELETE", &format!("/sandboxes/{id}"), Value::Null),
    )
    .await;
    assert_eq!(answer.status, StatusCode::NO_CONTENT);
    let answer = send(
        &app,
        api("DELETE", &format!("/sandboxes/{id}"), Value::Null),
    )
    .await;
    assert_eq!(answer.status, StatusCode::NOT_FOUND);
    let answer = send(
        &app,
        api(
            "POST",
            &format!("/sandboxes/{id}/timeout"),
            json!({"timeout": 5}),
        ),
    )
    .await;
    assert_eq!(answer.status, StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn list_pages_with_x_next_token_and_filters_by_metadata() {
    let engine = FakeEngine::new();
    let app = app(&engine);
    let (a, _) = create(&app, json!({"metadata": {"team": "x y"}})).await;
    let (b, _) = create(&app, json!({"metadata": {"team": "other"}})).await;
    let (c, _) = create(&app, json!({"metadata": {"team": "x y", "n": "3"}})).await;

    // Newest first, as E2B's API lists by default.
    let answer = send(&app, api("GET", "/v2/sandboxes?limit=2", Value::Null)).await;
    assert_eq!(answer.status, StatusCode::OK);
    let ids: Vec<_> = answer
        .json()
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["sandboxID"].clone())
        .collect();
    assert_eq!(ids, vec![json!(c), json!(b)]);
    let token = answer.headers["x-next-token"].to_str().unwrap().to_owned();
    let answer = send(
        &app,
        api(
            "GET",
            &format!("/v2/sandboxes?limit=2&nextToken={token}"),
            Value::Null,
        ),
    )
    .await;
    let page = answer.json();
    assert_eq!(page.as_array().unwrap().len(), 1);
    assert_eq!(page[0]["sandboxID"], json!(a));
    assert!(answer.headers.get("x-next-token").is_none());

    // The SDK sends metadata=urlencode({"team": "x y"}), itself url-encoded.
    let answer = send(
        &app,
        api(
            "GET",
            "/v2/sandboxes?metadata=team%3Dx%2By&state=running",
            Value::Null,
        ),
    )
    .await;
    let ids: Vec<_> = answer
        .json()
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["sandboxID"].clone())
        .collect();
    assert_eq!(ids, vec![json!(c), json!(a)]);
    let answer = send(&app, api("GET", "/v2/sandboxes?state=paused", Value::Null)).await;
    assert_eq!(answer.json(), json!([]));
}

#[tokio::test]
async fn unknown_sandbox_is_502_was_not_found() {
    let engine = FakeEngine::new();
    let app = app(&engine);
    let health = Request::get("/health")
        .header("E2b-Sandbox-Id", "gone")
        .header("x-access-token", "t");
    let answer = send(&app, health.body(Body::empty()).unwrap()).await;
    assert_eq!(answer.status, StatusCode::BAD_GATEWAY);
    assert_eq!(answer.json()["code"], 502);
    assert!(answer.json()["message"]
        .as_str()
        .unwrap()
        .contains("was not found"));
    let answer = send(
        &app,
        stream_rpc("/process.Process/Start", "gone", "t", json!({})),
    )
    .await;
    assert_eq!(answer.status, StatusCode::BAD_GATEWAY);
    assert!(answer.json()["message"]
        .as_str()
        .unwrap()
        .contains("was not found"));
}

#[tokio::test]
async fn access_token_is_required() {
    let engine = FakeEngine::new();
    let app = app(&engine);
    let (id, token) = create(&app, json!({})).await;
    for given in [None, Some("wrong"), Some(token.as_str())] {
        let mut request = Request::get("/health").header("e2b-sandbox-id", &id);
        if let Some(given) = given {
            request = request.header("x-access-token", given);
        }
        let answer = send(&app, request.body(Body::empty()).unwrap()).await;
        let expected = if given == Some(token.as_str()) {
            StatusCode::NO_CONTENT
        } else {
            StatusCode::UNAUTHORIZED
        };
        assert_eq!(answer.status, expected, "token {given:?}");
    }
    let answer = send(
        &app,
        unary_rpc("/process.Process/List", &id, "wrong", json!({})),
    )
    .await;
    assert_eq!(answer.status, StatusCode::UNAUTHORIZED);
}

#[tokio::test]
async fn start_stream_is_framed_byte_for_byte() {
    let engine = FakeEngine::new();
    let app = app(&engine);
    let (id, token) = create(&app, json!({})).await;
    let message = json!({"process": {"cmd": "/bin/bash", "args": ["-l", "-c", "echo hello"], "envs": {"X": "1"},
                                     "cwd": "work"}, "stdin": false});
    let answer = send(
        &app,
        stream_rpc("/process.Process/Start", &id, &token, message),
    )
    .await;
    assert_eq!(answer.status, StatusCode::OK);
    assert_eq!(answer.headers["content-type"], "application/connect+json");
    let expected = [
        envelope(0, br#"{"event":{"start":{"pid":7}}}"#),
        envelope(0, br#"{"event":{"data":{"stdout":"aGVsbG8K"}}}"#),
        envelope(0, br#"{"event":{"data":{"stderr":"b29wcw=="}}}"#),
        envelope(
            0,
            br#"{"event":{"end":{"exitCode":3,"exited":true,"status":"exit status 3"}}}"#,
        ),
        envelope(2, b"{}"),
    ]
    .concat();
    assert_eq!(answer.body, expected);
    let spec = engine.sandbox(&id).started.lock().unwrap()[0].clone();
    assert_eq!(spec.cmd, "/bin/bash");
    assert_eq!(spec.args, vec!["-l", "-c", "echo hello"]);
    assert_eq!(spec.cwd.as_deref(), Some("/home/user/work"));
    assert!(!spec.stdin);
}

#[tokio::test]
async fn start_errors_end_the_stream() {
    let engine = FakeEngine::new();
    let app = app(&engine);
    let (id, token) = create(&app, json!({})).await;

    // A malformed envelope: 200 connect+json with only the end-of-stream error.
    let answer = send(
        &app,
        rpc("/process.Process/Start", &id, &token, true, vec![0, 0, 0]),
    )
    .await;
    assert_eq!(answer.status, StatusCode::OK);
    assert_eq!(answer.headers["content-type"], "application/connect+json");
    let frames = envelopes(&answer.body);
    assert_eq!(frames.len(), 1);
    assert_eq!(frames[0].0, 2);
    assert_eq!(frames[0].1["error"]["code"], "invalid_argument");

    // Malformed JSON inside a well-formed envelope.
    let answer = send(
        &app,
        rpc(
            "/process.Process/Start",
            &id,
            &token,
            true,
            envelope(0, b"{nope"),
        ),
    )
    .await;
    assert_eq!(
        envelopes(&answer.body)[0].1["error"]["code"],
        "invalid_argument"
    );

    // A PTY.
    let pty = json!({"process": {"cmd": "/bin/bash"}, "pty": {"size": {"cols": 80, "rows": 24}}});
    let answer = send(&app, stream_rpc("/process.Process/Start", &id, &token, pty)).await;
    assert_eq!(
        envelopes(&answer.body),
        vec![(
            2,
            json!({"error": {"code": "unimplemented",
        "message": "PTYs are not supported by sandboxd"}})
        )]
    );

    // Connect to an unknown pid.
    let answer = send(
        &app,
        stream_rpc(
            "/process.Process/Connect",
            &id,
            &token,
            json!({"process": {"pid": 5}}),
        ),
    )
    .await;
    assert_eq!(envelopes(&answer.body)[0].1["error"]["code"], "not_found");
}

#[tokio::test]
async fn start_deadline_kills_the_process() {
    let engine = FakeEngine::new();
    let app = app(&engine);
    let (id, token) = create(&app, json!({})).await;
    let mut request = stream_rpc(
        "/process.Process/Start",
        &id,
        &token,
        json!({"process": {"cmd": "hang"}}),
    );
    request
        .headers_mut()
        .insert("connect-timeout-ms", "50".parse().unwrap());
    request
        .headers_mut()
        .insert("keepalive-ping-interval", "0".parse().unwrap());
    let answer = send(&app, request).await;
    let frames = envelopes(&answer.body);
    assert_eq!(frames[0], (0, json!({"event": {"start": {"pid": 42}}})));
    let last = frames.last().unwrap();
    assert_eq!(last.0, 2);
    assert_eq!(last.1["error"]["code"], "deadline_exceeded");
    assert_eq!(
        engine.sandbox(&id).signals.lock().unwrap().as_slice(),
        &[(42, Signal::SIGKILL)]
    );
}

#[tokio::test]
async fn connect_reattaches_and_its_deadline_kills_nothing() {
    let engine = FakeEngine::new();
    let app = app(&engine);
    let (id, token) = create(&app, json!({})).await;
    let message = json!({"process": {"tag": "bg"}});
    let mut request = stream_rpc("/process.Process/Connect", &id, &token, message);
    request
        .headers_mut()
        .insert("connect-timeout-ms", "50".parse().unwrap());
    let frames = envelopes(&send(&app, request).await.body);
    assert_eq!(frames[0], (0, json!({"event": {"start": {"pid": 42}}})));
    assert_eq!(frames[1].1["error"]["code"], "deadline_exceeded");
    assert!(engine.sandbox(&id).signals.lock().unwrap().is_empty());
}

#[tokio::test]
async fn idle_streams_send_keepalives() {
    let engine = FakeEngine::new();
    let app = app(&engine);
    let (id, token) = create(&app, json!({})).await;
    let message = json!({"process": {"cmd": "hang"}});
    let mut request = stream_rpc("/process.Process/Start", &id, &token, message);
    request
        .headers_mut()
        .insert("keepalive-ping-interval", "1".parse().unwrap());
    request
        .headers_mut()
        .insert("connect-timeout-ms", "2500".parse().unwrap());
    let frames = envelopes(&send(&app, request).await.body);
    let keepalive = (0, json!({"event": {"keepalive": {}}}));
    assert_eq!(frames[1..3], [keepalive.clone(), keepalive]);
    assert_eq!(frames.len(), 4, "{frames:?}");
}

#[tokio::test]
async fn a_client_that_leaves_does_not_end_the_process() {
    let engine = FakeEngine::new();
    let app = app(&engine);
    let (id, token) = create(&app, json!({})).await;
    let start = || {
        stream_rpc(
            "/process.Process/Start",
            &id,
            &token,
            json!({"process": {"cmd": "hang"}}),
        )
    };
    // No deadline: the process runs on.
    drop(app.clone().oneshot(start()).await.unwrap());
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(engine.sandbox(&id).signals.lock().unwrap().is_empty());
    // A deadline: envd kills the process when it passes, reader or not.
    let mut request = start();
    request
        .headers_mut()
        .insert("connect-timeout-ms", "100".parse().unwrap());
    drop(app.clone().oneshot(request).await.unwrap());
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert_eq!(
        engine.sandbox(&id).signals.lock().unwrap().as_slice(),
        &[(42, Signal::SIGKILL)]
    );
}

#[tokio::test]
async fn process_unary_calls() {
    let engine = FakeEngine::new();
    let app = app(&engine);
    let (id, token) = create(&app, json!({})).await;
    let answer = send(
        &app,
        unary_rpc("/process.Process/List", &id, &token, json!({})),
    )
    .await;
    assert_eq!(answer.status, StatusCode::OK);
    assert_eq!(
        answer.json(),
        json!({"processes": [{"pid": 42, "tag": "bg",
        "config": {"cmd": "hang", "args": [], "envs": {}}}]})
    );

    let kill = json!({"process": {"tag": "bg"}, "signal": "SIGNAL_SIGKILL"});
    let answer = send(
        &app,
        unary_rpc("/process.Process/SendSignal", &id, &token, kill),
    )
    .await;
    assert_eq!((answer.status, answer.json()), (StatusCode::OK, json!({})));
    let term = json!({"process": {"pid": "42"}, "signal": 15});
    assert_eq!(
        send(
            &app,
            unary_rpc("/process.Process/SendSignal", &id, &token, term)
        )
        .await
        .status,
        StatusCode::OK
    );
    assert_eq!(
        engine.sandbox(&id).signals.lock().unwrap().as_slice(),
        &[(42, Signal::SIGKILL), (42, Signal::SIGTERM)]
    );
    let missing = json!({"process": {"pid": 9}, "signal": "SIGNAL_SIGKILL"});
    let answer = send(
        &app,
        unary_rpc("/process.Process/SendSignal", &id, &token, missing),
    )
    .await;
    assert_eq!(answer.status, StatusCode::NOT_FOUND);
    assert_eq!(answer.json()["code"], "not_found");

    let input = json!({"process": {"pid": 42}, "input": {"stdin": "aGk="}});
    assert_eq!(
        send(
            &app,
            unary_rpc("/process.Process/SendInput", &id, &token, input)
        )
        .await
        .status,
        StatusCode::OK
    );
    let pty = json!({"process": {"pid": 42}, "input": {"pty": "aGk="}});
    let answer = send(
        &app,
        unary_rpc("/process.Process/SendInput", &id, &token, pty),
    )
    .await;
    assert_eq!(answer.json()["code"], "unimplemented");
    let close = json!({"process": {"pid": 42}});
    assert_eq!(
        send(
            &app,
            unary_rpc("/process.Process/CloseStdin", &id, &token, close)
        )
        .await
        .status,
        StatusCode::OK
    );
}

#[tokio::test]
async fn unknown_rpcs_and_paths_are_unimplemented_not_404() {
    let engine = FakeEngine::new();
    let app = app(&engine);
    let (id, token) = create(&app, json!({})).await;
    let answer = send(
        &app,
        unary_rpc("/process.Process/Frobnicate", &id, &token, json!({})),
    )
    .await;
    assert_eq!(answer.status, StatusCode::NOT_IMPLEMENTED);
    assert_eq!(answer.json()["code"], "unimplemented");
    let answer = send(
        &app,
        unary_rpc("/process.Process/Update", &id, &token, json!({})),
    )
    .await;
    assert_eq!(answer.json()["code"], "unimplemented");
    let answer = send(
        &app,
        stream_rpc(
            "/filesystem.Filesystem/WatchDir",
            &id,
            &token,
            json!({"path": "/"}),
        ),
    )
    .await;
    assert_eq!(answer.status, StatusCode::OK);
    assert_eq!(
        envelopes(&answer.body)[0].1["error"]["code"],
        "unimplemented"
    );
    let answer = send(
        &app,
        unary_rpc(
            "/filesystem.Filesystem/CreateWatcher",
            &id,
            &token,
            json!({}),
        ),
    )
    .await;
    assert_eq!(answer.json()["code"], "unimplemented");
    let answer = send(
        &app,
        unary_rpc("/other.Service/Call", &id, &token, json!({})),
    )
    .await;
    assert_eq!(answer.json()["code"], "unimplemented");

    for (method, path) in [
        ("GET", "/templates"),
        ("GET", "/sandboxes"),
        ("PUT", "/sandboxes/x"),
        ("GET", "/v2/sandboxes/x/logs"),
    ] {
        let answer = send(&app, api(method, path, json!({}))).await;
        assert_eq!(
            answer.status,
            StatusCode::NOT_IMPLEMENTED,
            "{method} {path}"
        );
        assert_eq!(answer.headers["should-retry"], "false");
        assert_eq!(answer.json()["code"], 501);
        assert!(answer.json()["message"]
            .as_str()
            .unwrap()
            .contains("is not supported by sandboxd"));
    }
}

#[tokio::test]
async fn filesystem_calls() {
    let engine = FakeEngine::new();
    let app = app(&engine);
    let (id, token) = create(&app, json!({})).await;
    std::fs::write(home(&engine, &id).join("a.txt"), b"hello").unwrap();

    let answer = send(
        &app,
        unary_rpc(
            "/filesystem.Filesystem/Stat",
            &id,
            &token,
            json!({"path": "a.txt"}),
        ),
    )
    .await;
    assert_eq!(answer.status, StatusCode::OK, "{:?}", answer.body);
    let entry = &answer.json()["entry"];
    assert_eq!(entry["type"], "FILE_TYPE_FILE");
    assert_eq!(entry["path"], "/home/user/a.txt");
    assert_eq!(entry["size"], "5");
    assert!(entry["modifiedTime"].as_str().unwrap().ends_with('Z'));

    let answer = send(
        &app,
        unary_rpc(
            "/filesystem.Filesystem/Stat",
            &id,
            &token,
            json!({"path": "nope"}),
        ),
    )
    .await;
    assert_eq!(answer.status, StatusCode::NOT_FOUND);
    assert_eq!(answer.json()["code"], "not_found");

    let mk = json!({"path": "/home/user/d/e"});
    let answer = send(
        &app,
        unary_rpc("/filesystem.Filesystem/MakeDir", &id, &token, mk.clone()),
    )
    .await;
    assert_eq!(answer.json()["entry"]["type"], "FILE_TYPE_DIRECTORY");
    let answer = send(
        &app,
        unary_rpc("/filesystem.Filesystem/MakeDir", &id, &token, mk),
    )
    .await;
    assert_eq!(answer.json()["code"], "already_exists");

    let answer = send(
        &app,
        unary_rpc(
            "/filesystem.Filesystem/ListDir",
            &id,
            &token,
            json!({"path": "", "depth": 1}),
        ),
    )
    .await;
    let names: Vec<_> = answer.json()["entries"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["name"].clone())
        .collect();
    assert_eq!(names, vec![json!("a.txt"), json!("d")]);

    let mv = json!({"source": "a.txt", "destination": "b.txt"});
    let answer = send(
        &app,
        unary_rpc("/filesystem.Filesystem/Move", &id, &token, mv),
    )
    .await;
    assert_eq!(answer.json()["entry"]["path"], "/home/user/b.txt");
    let answer = send(
        &app,
        unary_rpc(
            "/filesystem.Filesystem/Remove",
            &id,
            &token,
            json!({"path": "d"}),
        ),
    )
    .await;
    assert_eq!((answer.status, answer.json()), (StatusCode::OK, json!({})));
    assert!(!home(&engine, &id).join("d").exists());
}

fn files_request(
    method: &str,
    query: &str,
    id: &str,
    token: Option<&str>,
) -> axum::http::request::Builder {
    let mut builder = Request::builder()
        .method(method)
        .uri(format!("/files?{query}"))
        .header("e2b-sandbox-id", id);
    if let Some(token) = token {
        builder = builder.header("x-access-token", token);
    }
    builder
}

#[tokio::test]
async fn download_plain_and_signed() {
    let engine = FakeEngine::new();
    let app = app(&engine);
    let (id, token) = create(&app, json!({})).await;
    std::fs::write(home(&engine, &id).join("a.txt"), b"content").unwrap();

    let answer = send(
        &app,
        files_request("GET", "path=a.txt", &id, Some(&token))
            .body(Body::empty())
            .unwrap(),
    )
    .await;
    assert_eq!(
        (answer.status, &answer.body[..]),
        (StatusCode::OK, &b"content"[..])
    );
    let answer = send(
        &app,
        files_request("GET", "path=missing", &id, Some(&token))
            .body(Body::empty())
            .unwrap(),
    )
    .await;
    assert_eq!(answer.status, StatusCode::NOT_FOUND);
    assert_eq!(answer.json()["code"], 404);
    let answer = send(
        &app,
        files_request("GET", "path=%2Fhome", &id, Some(&token))
            .body(Body::empty())
            .unwrap(),
    )
    .await;
    assert_eq!(answer.status, StatusCode::BAD_REQUEST);

    let future = (SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs()
        + 60)
        .to_string();
    let sig = file_signature("a.txt", FileOperation::Read, "user", &token, Some(&future));
    let query = format!(
        "path=a.txt&username=user&signature={}&signature_expiration={future}",
        enc(&sig)
    );
    let answer = send(
        &app,
        files_request("GET", &query, &id, None)
            .body(Body::empty())
            .unwrap(),
    )
    .await;
    assert_eq!(
        (answer.status, &answer.body[..]),
        (StatusCode::OK, &b"content"[..])
    );

    let sig = file_signature("a.txt", FileOperation::Read, "", &token, Some("1000"));
    let query = format!(
        "path=a.txt&signature={}&signature_expiration=1000",
        enc(&sig)
    );
    let answer = send(
        &app,
        files_request("GET", &query, &id, None)
            .body(Body::empty())
            .unwrap(),
    )
    .await;
    assert_eq!(answer.status, StatusCode::UNAUTHORIZED, "expired");

    let sig = file_signature("a.txt", FileOperation::Write, "", &token, None);
    let answer = send(
        &app,
        files_request(
            "GET",
            &format!("path=a.txt&signature={}", enc(&sig)),
            &id,
            None,
        )
        .body(Body::empty())
        .unwrap(),
    )
    .await;
    assert_eq!(
        answer.status,
        StatusCode::UNAUTHORIZED,
        "a write signature does not read"
    );
    let answer = send(
        &app,
        files_request("GET", "path=a.txt", &id, None)
            .body(Body::empty())
            .unwrap(),
    )
    .await;
    assert_eq!(answer.status, StatusCode::UNAUTHORIZED);
}

#[tokio::test]
async fn gzip_octet_stream_upload_is_decoded() {
    let engine = FakeEngine::new();
    let app = app(&engine);
    let (id, token) = create(&app, json!({})).await;
    let content = b"hello gzip ".repeat(1000);
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    gz.write_all(&content).unwrap();
    let gz = gz.finish().unwrap();
    // A chunked body, as the SDK sends iterables.
    let chunks: Vec<Result<Bytes, std::io::Error>> = gz
        .chunks(100)
        .map(|c| Ok(Bytes::copy_from_slice(c)))
        .collect();
    let request = files_request("POST", "path=dir%2Fg.txt", &id, Some(&token))
        .header("content-type", "application/octet-stream")
        .header("content-encoding", "gzip")
        .body(Body::from_stream(futures_util::stream::iter(chunks)))
        .unwrap();
    let answer = send(&app, request).await;
    assert_eq!(answer.status, StatusCode::OK, "{:?}", answer.body);
    assert_eq!(
        answer.json(),
        json!([{"name": "g.txt", "type": "file", "path": "/home/user/dir/g.txt"}])
    );
    assert_eq!(
        std::fs::read(home(&engine, &id).join("dir/g.txt")).unwrap(),
        content
    );

    let bad = files_request("POST", "path=bad.txt", &id, Some(&token))
        .header("content-type", "application/octet-stream")
        .header("content-encoding", "gzip")
        .body(Body::from("not gzip at all"))
        .unwrap();
    assert_eq!(send(&app, bad).await.status, StatusCode::BAD_REQUEST);
    assert!(
        !home(&engine, &id).join("bad.txt").exists(),
        "a failed upload leaves no file"
    );
}

#[tokio::test]
async fn upload_limit_is_413() {
    let engine = FakeEngine::new();
    let app = app(&engine);
    let (id, token) = create(&app, json!({})).await;
    let big = vec![b'x'; (1 << 20) + 1];
    let request = files_request("POST", "path=big", &id, Some(&token))
        .header("content-type", "application/octet-stream")
        .body(Body::from(big.clone()))
        .unwrap();
    assert_eq!(
        send(&app, request).await.status,
        StatusCode::PAYLOAD_TOO_LARGE
    );
    // Without Content-Length (chunked), the limit is found while writing.
    let request = files_request("POST", "path=big", &id, Some(&token))
        .header("content-type", "application/octet-stream")
        .body(Body::from_stream(futures_util::stream::iter(vec![Ok::<
            _,
            std::io::Error,
        >(
            Bytes::from(big),
        )])))
        .unwrap();
    assert_eq!(
        send(&app, request).await.status,
        StatusCode::PAYLOAD_TOO_LARGE
    );
    assert!(!home(&engine, &id).join("big").exists());
}

fn multipart(boundary: &str, parts: &[(&str, &[u8])]) -> Vec<u8> {
    let mut body = Vec::new();
    for (filename, content) in parts {
        write!(body, "--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"{filename}\"\r\n")
            .unwrap();
        body.extend_from_slice(b"Content-Type: application/octet-stream\r\n\r\n");
        body.extend_from_slice(content);
        body.extend_from_slice(b"\r\n");
    }
    write!(body, "--{boundary}--\r\n").unwrap();
    body
}

#[tokio::test]
async fn multipart_upload_of_two_files() {
    let engine = FakeEngine::new();
    let app = app(&engine);
    let (id, token) = create(&app, json!({})).await;
    let body = multipart(
        "xyz",
        &[("rel/one.txt", b"one"), ("/home/user/two.txt", b"two\r\n2")],
    );
    let request = files_request("POST", "username=user", &id, Some(&token))
        .header("content-type", "multipart/form-data; boundary=xyz")
        .body(Body::from(body))
        .unwrap();
    let answer = send(&app, request).await;
    assert_eq!(answer.status, StatusCode::OK, "{:?}", answer.body);
    assert_eq!(
        answer.json(),
        json!([
            {"name": "one.txt", "type": "file", "path": "/home/user/rel/one.txt"},
            {"name": "two.txt", "type": "file", "path": "/home/user/two.txt"},
        ])
    );
    let home = home(&engine, &id);
    assert_eq!(std::fs::read(home.join("rel/one.txt")).unwrap(), b"one");
    assert_eq!(std::fs::read(home.join("two.txt")).unwrap(), b"two\r\n2");

    // ?path= overrides the single part's filename.
    let body = multipart("b", &[("ignored", b"x")]);
    let request = files_request("POST", "path=%2Ftmp%2Fz", &id, Some(&token))
        .header("content-type", "multipart/form-data; boundary=b")
        .body(Body::from(body))
        .unwrap();
    let answer = send(&app, request).await;
    assert_eq!(answer.json()[0]["path"], "/tmp/z");
    assert!(Path::new(&engine.sandbox(&id).root.join("tmp/z")).exists());

    // A write signature replaces the token.
    let sig = file_signature("s.txt", FileOperation::Write, "", &token, None);
    let request = files_request(
        "POST",
        &format!("path=s.txt&signature={}", enc(&sig)),
        &id,
        None,
    )
    .header("content-type", "multipart/form-data; boundary=b")
    .body(Body::from(multipart("b", &[("s.txt", b"s")])))
    .unwrap();
    assert_eq!(send(&app, request).await.status, StatusCode::OK);
}

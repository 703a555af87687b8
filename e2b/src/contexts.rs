//! Stateful code contexts: `e2b-code-interpreter`'s `run_code` (`POST /execute`, newline-delimited JSON) and
//! `/contexts` (create, list, restart, delete) on the sandbox plane, port 49999 of E2B's wire.
//!
//! A context is a long-running kernel process inside the sandbox's container, started like any of its processes
//! ([`LiveSandbox::start`]), so it has the sandbox's limits and confinement and ends with it; its state (variables,
//! imports, the directory) lives in that process, never in the daemon. The kernels (`e2b/kernels/`) read cells as
//! JSON lines on stdin and answer with the SDK's own JSON lines on stdout (`stdout`, `stderr`, `result`, `error`,
//! `number_of_executions`), then `{"type":"__done__"}`; the daemon relays each line as it comes and ends the answer
//! at the cell's end. Cells on one context queue; contexts run in parallel. A caller that goes away (the SDK's
//! timeout) interrupts the cell with `SIGINT`: the context lives on and its next cell runs. A kernel that dies is
//! reported as the cell's error and started again on the next cell.
//!
//! As the SDK sends them, `/contexts` calls carry no access token (only `/execute` does), so they are routed by
//! `E2b-Sandbox-Id` alone; they start, stop and list kernels but run no code.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

use axum::body::{Body, Bytes};
use axum::extract::{FromRequestParts, Path};
use axum::http::request::Parts;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, post};
use axum::{Json, Router};
use nix::sys::signal::Signal;
use serde_json::{json, Value};
use tokio::sync::mpsc;

use crate::api::{error_response, json_response};
use crate::engine::{LiveSandbox, ProcessEvent, ProcessSpec, HOME};
use crate::lock;
use crate::Facade;

/// The python kernel.
const PYTHON: &str = include_str!("../kernels/python.py");
/// The bash kernel (a python driver of one bash).
const BASH: &str = include_str!("../kernels/bash.py");
/// The javascript kernel.
const JAVASCRIPT: &str = include_str!("../kernels/javascript.js");
/// Lines of a cell's answer queued for a slow reader before the kernel's output waits.
const ANSWER_QUEUE: usize = 256;
/// The longest line a kernel may write (a PNG as base64, a large DataFrame's HTML).
const MAX_LINE: usize = 64 << 20;
/// Contexts a sandbox may have at once.
const MAX_CONTEXTS: usize = 32;

/// A refusal: its status and message, answered as the rest of the sandbox plane's (`{"code","message"}`).
struct Refusal(StatusCode, String);

impl Refusal {
    fn new(status: StatusCode, message: impl Into<String>) -> Self {
        Self(status, message.into())
    }
}

impl IntoResponse for Refusal {
    fn into_response(self) -> Response {
        error_response(self.0, &self.1)
    }
}

/// The contexts of every sandbox of the facade.
#[derive(Default)]
pub struct Contexts {
    by_sandbox: Mutex<HashMap<String, Arc<SandboxContexts>>>,
}

/// One sandbox's contexts.
#[derive(Default)]
struct SandboxContexts {
    contexts: Mutex<BTreeMap<String, Arc<Context>>>,
    /// The default context of each language (made on its first cell).
    defaults: Mutex<HashMap<Language, String>>,
}

/// A language a context runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Language {
    Python,
    Javascript,
    Bash,
}

impl Language {
    fn parse(name: Option<&str>) -> Result<Self, Refusal> {
        match name.map(str::to_ascii_lowercase).as_deref() {
            None | Some("") | Some("python") | Some("python3") => Ok(Self::Python),
            Some("javascript") | Some("js") => Ok(Self::Javascript),
            Some("bash") | Some("sh") => Ok(Self::Bash),
            Some(other) => Err(Refusal::new(
                StatusCode::BAD_REQUEST,
                format!(
                    "language {other:?} is not supported by sandboxd (python, javascript, bash)"
                ),
            )),
        }
    }

    fn name(self) -> &'static str {
        match self {
            Self::Python => "python",
            Self::Javascript => "javascript",
            Self::Bash => "bash",
        }
    }

    /// The kernel's process.
    fn spec(self, id: &str, cwd: &str) -> ProcessSpec {
        let (cmd, args) = match self {
            Self::Python => ("python3", vec!["-u".into(), "-c".into(), PYTHON.into()]),
            Self::Bash => ("python3", vec!["-u".into(), "-c".into(), BASH.into()]),
            Self::Javascript => ("node", vec!["-e".into(), JAVASCRIPT.into()]),
        };
        ProcessSpec {
            cmd: cmd.into(),
            args,
            envs: BTreeMap::new(),
            cwd: Some(cwd.to_owned()),
            stdin: true,
            tag: Some(format!("context-{id}")),
        }
    }
}

/// One context: its kernel, one cell at a time.
struct Context {
    id: String,
    language: Language,
    cwd: String,
    kernel: tokio::sync::Mutex<Option<Kernel>>,
}

/// A running kernel.
struct Kernel {
    pid: u32,
    events: mpsc::Receiver<ProcessEvent>,
    /// Output read past the last whole line.
    pending: Vec<u8>,
}

impl Context {
    fn json(&self) -> Value {
        json!({"id": self.id, "language": self.language.name(), "cwd": self.cwd})
    }
}

/// The routes: `/execute` and `/contexts`.
pub fn routes(contexts: Arc<Contexts>) -> Router<Facade> {
    Router::new()
        .route("/execute", post(execute))
        .route("/contexts", post(create).get(list))
        .route("/contexts/{id}", delete(remove))
        .route("/contexts/{id}/restart", post(restart))
        .layer(axum::Extension(contexts))
}

/// A handler's argument: the sandbox a request names (`E2b-Sandbox-Id`), and its contexts; 502 "was not found" as the
/// rest of the sandbox plane answers.
struct Named {
    sandbox: Arc<dyn LiveSandbox>,
    mine: Arc<SandboxContexts>,
}

impl FromRequestParts<Facade> for Named {
    type Rejection = Refusal;

    async fn from_request_parts(parts: &mut Parts, facade: &Facade) -> Result<Self, Refusal> {
        let contexts = parts
            .extensions
            .get::<Arc<Contexts>>()
            .cloned()
            .ok_or_else(|| Refusal::new(StatusCode::INTERNAL_SERVER_ERROR, "No contexts"))?;
        let id = parts
            .headers
            .get(crate::SANDBOX_ID_HEADER)
            .and_then(|v| v.to_str().ok())
            .ok_or_else(|| {
                Refusal::new(StatusCode::BAD_REQUEST, "Missing E2b-Sandbox-Id header")
            })?;
        let sandbox = facade.engine.get(id).ok_or_else(|| {
            Refusal::new(
                StatusCode::BAD_GATEWAY,
                format!("The sandbox {id} was not found"),
            )
        })?;
        let mut all = lock(&contexts.by_sandbox);
        if !all.contains_key(id) {
            // A sandbox seen for the first time: the contexts of sandboxes that are gone are forgotten then (their
            // kernels ended with their containers).
            all.retain(|sid, _| facade.engine.get(sid).is_some());
        }
        let mine = all.entry(id.to_owned()).or_default().clone();
        Ok(Named { sandbox, mine })
    }
}

/// `POST /contexts` `{"language"?, "cwd"?}`.
async fn create(Named { sandbox, mine }: Named, body: Bytes) -> Result<Response, Refusal> {
    let body: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let language = Language::parse(body.get("language").and_then(Value::as_str))?;
    let cwd = body
        .get("cwd")
        .and_then(Value::as_str)
        .filter(|c| !c.is_empty())
        .unwrap_or(HOME)
        .to_owned();
    let ctx = new_context(&*sandbox, &mine, language, cwd).await?;
    Ok(json_response(StatusCode::OK, &ctx.json()))
}

/// Makes a context and starts its kernel.
async fn new_context(
    sandbox: &dyn LiveSandbox,
    mine: &SandboxContexts,
    language: Language,
    cwd: String,
) -> Result<Arc<Context>, Refusal> {
    if lock(&mine.contexts).len() >= MAX_CONTEXTS {
        return Err(Refusal::new(
            StatusCode::TOO_MANY_REQUESTS,
            format!("A sandbox has at most {MAX_CONTEXTS} contexts"),
        ));
    }
    let id = crate::random_hex(8);
    let ctx = Arc::new(Context {
        id: id.clone(),
        language,
        cwd,
        kernel: tokio::sync::Mutex::new(None),
    });
    let kernel = start(sandbox, &ctx).await?;
    *ctx.kernel.lock().await = Some(kernel);
    lock(&mine.contexts).insert(id, ctx.clone());
    Ok(ctx)
}

/// Starts a context's kernel.
async fn start(sandbox: &dyn LiveSandbox, ctx: &Context) -> Result<Kernel, Refusal> {
    let attached = sandbox
        .start(ctx.language.spec(&ctx.id, &ctx.cwd))
        .await
        .map_err(|e| {
            Refusal::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("Cannot start the {} context: {e}", ctx.language.name()),
            )
        })?;
    Ok(Kernel {
        pid: attached.pid,
        events: attached.events,
        pending: Vec::new(),
    })
}

/// `GET /contexts`.
async fn list(Named { mine, .. }: Named) -> Result<Response, Refusal> {
    let all: Vec<Value> = lock(&mine.contexts).values().map(|c| c.json()).collect();
    Ok(json_response(StatusCode::OK, &Value::Array(all)))
}

/// `DELETE /contexts/{id}`: its kernel is killed.
async fn remove(
    Named { sandbox, mine }: Named,
    Path(id): Path<String>,
) -> Result<StatusCode, Refusal> {
    let ctx = lock(&mine.contexts)
        .remove(&id)
        .ok_or_else(|| unknown_context(&id))?;
    lock(&mine.defaults).retain(|_, c| *c != id);
    if let Some(pid) = ctx
        .kernel
        .try_lock()
        .ok()
        .and_then(|k| k.as_ref().map(|k| k.pid))
    {
        let _ = sandbox.signal(pid, Signal::SIGKILL).await;
    } else {
        // A cell is running: its kernel is killed once the cell's task lets go of it.
        tokio::spawn(async move {
            if let Some(k) = ctx.kernel.lock().await.take() {
                let _ = sandbox.signal(k.pid, Signal::SIGKILL).await;
            }
        });
    }
    Ok(StatusCode::NO_CONTENT)
}

/// `POST /contexts/{id}/restart`: a new kernel, its state gone.
async fn restart(
    Named { sandbox, mine }: Named,
    Path(id): Path<String>,
) -> Result<StatusCode, Refusal> {
    let ctx = lock(&mine.contexts)
        .get(&id)
        .cloned()
        .ok_or_else(|| unknown_context(&id))?;
    let mut kernel = ctx.kernel.lock().await;
    if let Some(k) = kernel.take() {
        let _ = sandbox.signal(k.pid, Signal::SIGKILL).await;
    }
    *kernel = Some(start(&*sandbox, &ctx).await?);
    Ok(StatusCode::NO_CONTENT)
}

fn unknown_context(id: &str) -> Refusal {
    Refusal::new(StatusCode::NOT_FOUND, format!("Context {id} not found"))
}

/// `POST /execute` `{"code", "context_id"?, "language"?, "env_vars"?}`: the cell's output as newline-delimited JSON,
/// ending with the cell.
async fn execute(
    Named { sandbox, mine }: Named,
    headers: HeaderMap,
    Json(body): Json<Value>,
) -> Result<Response, Refusal> {
    let token = headers.get("x-access-token").and_then(|v| v.to_str().ok());
    let expected = sandbox.info().access_token;
    if !token.is_some_and(|t| constant_time_eq::constant_time_eq(t.as_bytes(), expected.as_bytes()))
    {
        return Err(Refusal::new(
            StatusCode::UNAUTHORIZED,
            "Invalid or missing access token",
        ));
    }
    let code = body
        .get("code")
        .and_then(Value::as_str)
        .map(str::to_owned)
        .ok_or_else(|| Refusal::new(StatusCode::BAD_REQUEST, "code is required"))?;
    let env: BTreeMap<String, String> = body
        .get("env_vars")
        .and_then(Value::as_object)
        .map(|m| {
            m.iter()
                .filter_map(|(k, v)| v.as_str().map(|v| (k.clone(), v.to_owned())))
                .collect()
        })
        .unwrap_or_default();
    let ctx = match body.get("context_id").and_then(Value::as_str) {
        Some(id) => lock(&mine.contexts)
            .get(id)
            .cloned()
            .ok_or_else(|| unknown_context(id))?,
        None => {
            let language = Language::parse(body.get("language").and_then(Value::as_str))?;
            default_context(&*sandbox, &mine, language).await?
        }
    };
    let (tx, rx) = mpsc::channel::<Result<Bytes, std::io::Error>>(ANSWER_QUEUE);
    let cell = json!({"code": code, "env": env}).to_string() + "\n";
    tokio::spawn(run_cell(sandbox, ctx, cell, tx));
    let mut response = Response::new(Body::from_stream(tokio_stream_from(rx)));
    response.headers_mut().insert(
        axum::http::header::CONTENT_TYPE,
        axum::http::HeaderValue::from_static("application/x-ndjson"),
    );
    Ok(response)
}

/// A receiver as a stream of body chunks.
fn tokio_stream_from(
    mut rx: mpsc::Receiver<Result<Bytes, std::io::Error>>,
) -> impl futures_util::Stream<Item = Result<Bytes, std::io::Error>> {
    futures_util::stream::poll_fn(move |cx| rx.poll_recv(cx))
}

/// The default context of `language`, made on its first use.
async fn default_context(
    sandbox: &dyn LiveSandbox,
    mine: &SandboxContexts,
    language: Language,
) -> Result<Arc<Context>, Refusal> {
    let existing = lock(&mine.defaults)
        .get(&language)
        .and_then(|id| lock(&mine.contexts).get(id).cloned());
    if let Some(ctx) = existing {
        return Ok(ctx);
    }
    let ctx = new_context(sandbox, mine, language, HOME.to_owned()).await?;
    let mut defaults = lock(&mine.defaults);
    match defaults
        .get(&language)
        .and_then(|id| lock(&mine.contexts).get(id).cloned())
    {
        // Another first cell made one meanwhile: that one is the default, this one an extra.
        Some(other) => Ok(other),
        None => {
            defaults.insert(language, ctx.id.clone());
            Ok(ctx)
        }
    }
}

/// Runs one cell on its context (after the cells queued before it), relaying the kernel's lines to `tx`. A reader
/// that went away interrupts the cell (`SIGINT`); the rest of its output is read and dropped, so the next cell
/// starts clean.
async fn run_cell(
    sandbox: Arc<dyn LiveSandbox>,
    ctx: Arc<Context>,
    cell: String,
    tx: mpsc::Sender<Result<Bytes, std::io::Error>>,
) {
    let mut guard = ctx.kernel.lock().await;
    if guard.is_none() {
        match start(&*sandbox, &ctx).await {
            Ok(k) => *guard = Some(k),
            Err(_) => {
                let _ = tx
                    .send(Ok(error_line(
                        "ContextError",
                        "the context's kernel cannot start",
                    )))
                    .await;
                return;
            }
        }
    }
    let Some(kernel) = guard.as_mut() else {
        return;
    };
    if let Err(e) = sandbox.send_input(kernel.pid, cell.as_bytes()).await {
        *guard = None;
        let _ = tx
            .send(Ok(error_line(
                "ContextError",
                &format!("the context's kernel is gone: {e}"),
            )))
            .await;
        return;
    }
    let mut interrupted = false;
    loop {
        let event = tokio::select! {
            event = kernel.events.recv() => event,
            () = tx.closed(), if !interrupted => {
                interrupted = true;
                let _ = sandbox.signal(kernel.pid, Signal::SIGINT).await;
                continue;
            }
        };
        match event {
            Some(ProcessEvent::Stdout(bytes)) => {
                kernel.pending.extend_from_slice(&bytes);
                while let Some(end) = kernel.pending.iter().position(|&b| b == b'\n') {
                    let line: Vec<u8> = kernel.pending.drain(..=end).collect();
                    if is_done(&line) {
                        return;
                    }
                    if !interrupted {
                        let _ = tx.send(Ok(Bytes::from(line))).await;
                    }
                }
                if kernel.pending.len() > MAX_LINE {
                    kernel.pending.clear();
                    let _ = tx
                        .send(Ok(error_line(
                            "OutputTooLarge",
                            "a line of the cell's output is over 64 MiB",
                        )))
                        .await;
                }
            }
            // The kernel's own complaints (its cells' stderr comes as JSON on stdout).
            Some(ProcessEvent::Stderr(bytes)) => {
                tracing::debug!(context = %ctx.id, text = %String::from_utf8_lossy(&bytes), "kernel stderr");
            }
            Some(ProcessEvent::End(end)) => {
                *guard = None;
                let _ = tx
                    .send(Ok(error_line(
                        "ContextRestarting",
                        &format!(
                            "the context's kernel ended ({}); its state is lost, and the next cell starts a new one",
                            end.status
                        ),
                    )))
                    .await;
                return;
            }
            None => {
                *guard = None;
                let _ = tx
                    .send(Ok(error_line(
                        "SandboxGone",
                        "the sandbox ended during the cell",
                    )))
                    .await;
                return;
            }
        }
    }
}

fn is_done(line: &[u8]) -> bool {
    serde_json::from_slice::<Value>(line)
        .ok()
        .is_some_and(|v| v.get("type").and_then(Value::as_str) == Some("__done__"))
}

/// An `error` line of the SDK's wire.
fn error_line(name: &str, value: &str) -> Bytes {
    Bytes::from(
        json!({"type": "error", "name": name, "value": value, "traceback": ""}).to_string() + "\n",
    )
}

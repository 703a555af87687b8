//! The fixture's `tool_calls` extension (`docs/spec/tool-calls.md`): python programs only, run on the host with
//! sandboxd's own SDK next to the code and a unix socket in the execution's directory. One request at a time per
//! socket connection; a listed tool becomes a `tool_call`, the client's `tool_result` (routed by
//! [`Waiters::deliver`]) the reply; no answer within the per-call timeout is a `timeout` error. With the fault
//! `forwards-unlisted-tools` a tool the request did not list is forwarded instead of refused.

use std::collections::HashMap;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use protocol::{ExecuteRequest, ServerMessage, ToolCall, ToolResult};
use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::UnixListener;
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinSet;

/// The SDK files, the same ones sandboxd writes.
const SDK: [(&str, &str); 2] = [
    (
        "sandbox_tools.py",
        include_str!("../../sandboxd/sdk/sandbox_tools.py"),
    ),
    (
        "sandbox_tools_run.py",
        include_str!("../../sandboxd/sdk/sandbox_tools_run.py"),
    ),
];

type Pending = HashMap<(String, String), oneshot::Sender<ToolResult>>;

/// The calls of one connection waiting for their `tool_result`, by execution and call id.
#[derive(Clone, Default)]
pub(crate) struct Waiters(Arc<Mutex<Pending>>);

impl Waiters {
    fn lock(&self) -> std::sync::MutexGuard<'_, Pending> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Hands `result` to its call; one nobody waits for is dropped.
    pub(crate) fn deliver(&self, result: ToolResult) {
        if let Some(tx) = self
            .lock()
            .remove(&(result.id.clone(), result.call_id.clone()))
        {
            let _ = tx.send(result);
        }
    }
}

/// One execution's tool socket; dropping it ends its tasks.
pub(crate) struct Broker {
    /// The environment the interpreter needs.
    pub(crate) env: Vec<(String, String)>,
    /// The runner, given to the interpreter before the code path.
    pub(crate) runner: String,
    task: tokio::task::JoinHandle<()>,
    calls: Arc<AtomicU64>,
    value: Arc<Mutex<Option<Value>>>,
}

impl Drop for Broker {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Broker {
    /// Writes the SDK into `dir`, binds `dir/tools.sock` and serves it.
    pub(crate) fn start(
        req: &ExecuteRequest,
        dir: &Path,
        out: mpsc::Sender<ServerMessage>,
        waiters: Waiters,
        forward_unlisted: bool,
    ) -> std::io::Result<Broker> {
        let tools: Vec<Value> = req
            .tools
            .iter()
            .map(
                |t| json!({"name": t.name, "description": t.description, "params": t.parameters()}),
            )
            .collect();
        std::fs::create_dir_all(dir)?;
        std::fs::write(
            dir.join("sandbox_tools.json"),
            json!({ "tools": tools }).to_string(),
        )?;
        for (name, text) in SDK {
            std::fs::write(dir.join(name), text)?;
        }
        let sock = dir.join("tools.sock");
        let listener = UnixListener::bind(&sock)?;
        let shared = Arc::new(Shared {
            id: req.id.clone(),
            allowed: req.tools.iter().map(|t| t.name.clone()).collect(),
            timeout: Duration::from_millis(
                req.tool_timeout_ms
                    .unwrap_or(protocol::DEFAULT_TOOL_TIMEOUT_MS),
            ),
            out,
            waiters,
            forward_unlisted,
            seq: AtomicU64::new(0),
            calls: Arc::new(AtomicU64::new(0)),
            value: Arc::new(Mutex::new(None)),
        });
        let (calls, value) = (shared.calls.clone(), shared.value.clone());
        let task = tokio::spawn(async move {
            let mut conns = JoinSet::new();
            while let Ok((stream, _)) = listener.accept().await {
                let shared = shared.clone();
                conns.spawn(async move {
                    let (read, mut write) = stream.into_split();
                    let mut lines = BufReader::new(read).lines();
                    while let Ok(Some(line)) = lines.next_line().await {
                        let reply = shared.handle(&line).await;
                        if write
                            .write_all(format!("{reply}\n").as_bytes())
                            .await
                            .is_err()
                        {
                            break;
                        }
                    }
                });
            }
        });
        let env = vec![
            ("PYTHONPATH".to_owned(), dir.display().to_string()),
            (
                "SANDBOX_TOOLS_SOCKET".to_owned(),
                sock.display().to_string(),
            ),
        ];
        let runner = dir.join("sandbox_tools_run.py").display().to_string();
        Ok(Broker {
            env,
            runner,
            task,
            calls,
            value,
        })
    }

    /// Calls forwarded to the client.
    pub(crate) fn calls(&self) -> u64 {
        self.calls.load(Ordering::Relaxed)
    }

    /// The program's return value.
    pub(crate) fn return_value(&self) -> Option<Value> {
        self.value.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

struct Shared {
    id: String,
    allowed: Vec<String>,
    timeout: Duration,
    out: mpsc::Sender<ServerMessage>,
    waiters: Waiters,
    forward_unlisted: bool,
    seq: AtomicU64,
    calls: Arc<AtomicU64>,
    value: Arc<Mutex<Option<Value>>>,
}

fn refusal(code: &str, message: &str) -> Value {
    json!({"ok": false, "error": {"code": code, "message": message}})
}

impl Shared {
    async fn handle(&self, line: &str) -> Value {
        let Ok(req) = serde_json::from_str::<Value>(line) else {
            return refusal("invalid", "not JSON");
        };
        if req["op"] == "return" {
            *self.value.lock().unwrap_or_else(|p| p.into_inner()) =
                Some(req["value"].clone()).filter(|v| !v.is_null());
            return json!({"ok": true, "result": null});
        }
        let name = req["name"].as_str().unwrap_or_default().to_owned();
        if !self.allowed.contains(&name) && !self.forward_unlisted {
            return refusal("not_allowed", &format!("Tool {name:?} is not offered"));
        }
        let call_id = format!("c{}", self.seq.fetch_add(1, Ordering::Relaxed) + 1);
        let (tx, rx) = oneshot::channel();
        self.waiters
            .lock()
            .insert((self.id.clone(), call_id.clone()), tx);
        let call = ToolCall {
            id: self.id.clone(),
            call_id: call_id.clone(),
            name,
            args: req.get("args").cloned().unwrap_or_else(|| json!({})),
            raw_args: None,
            timeout_ms: Some(self.timeout.as_millis() as u64),
        };
        if self.out.send(ServerMessage::ToolCall(call)).await.is_err() {
            return refusal("closed", "the client is gone");
        }
        self.calls.fetch_add(1, Ordering::Relaxed);
        match tokio::time::timeout(self.timeout, rx).await {
            Ok(Ok(r)) if r.ok => json!({"ok": true, "result": r.result}),
            Ok(Ok(r)) => refusal("tool_error", r.error.as_deref().unwrap_or_default()),
            Ok(Err(_)) => refusal("closed", "the execution is ending"),
            Err(_) => {
                self.waiters.lock().remove(&(self.id.clone(), call_id));
                refusal("timeout", "no tool_result in time")
            }
        }
    }
}

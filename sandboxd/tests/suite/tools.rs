//! The `tool_calls` extension (`docs/spec/tool-calls.md`) against a real daemon: code in the sandbox calls tools
//! over `/sandbox/tools.sock`, the client answers `tool_call` with `tool_result`.

use std::time::{Duration, Instant};

use protocol::{ErrorCode, ServerMessage, ToolCall};
use serde_json::{json, Value};

use super::harness::*;

/// Python that calls `read_file` twice (into `a` and `b`) and `boom` once, which fails.
pub(super) const READS_AND_A_FAILED_CALL: &str = r#"
a = read_file(path="a")
b = read_file(path="b")
try:
    boom()
except ToolError:
    pass
"#;

/// An `execute` offering `tools` (names only).
pub(super) fn exec_tools(id: &str, language: &str, code: &str, tools: &[&str]) -> Value {
    let tools: Vec<Value> = tools.iter().map(|n| json!({"name": n})).collect();
    with(
        exec_json(id, language, code, 30_000, 256),
        json!({ "tools": tools }),
    )
}

fn tool_result(id: &str, call_id: &str, result: Result<Value, &str>) -> Value {
    let mut m = json!({"v": 1, "type": "tool_result", "id": id, "call_id": call_id, "ts": protocol::now_ts()});
    match result {
        Ok(v) => {
            m["ok"] = true.into();
            m["result"] = v;
        }
        Err(e) => {
            m["ok"] = false.into();
            m["error"] = e.into();
        }
    }
    m
}

/// Runs `exec` to its end, answering each `tool_call` with `handler` (`None`: no answer). Returns the execution's
/// messages and the calls seen.
pub(super) async fn run_answering(
    c: &mut Client,
    exec: Value,
    mut handler: impl FnMut(&ToolCall) -> Option<Result<Value, String>>,
) -> (Collected, Vec<ToolCall>) {
    let id = exec["id"].as_str().unwrap().to_owned();
    c.send_json(&exec).await;
    let mut collected = Collected::new(&id);
    let mut calls = Vec::new();
    while !collected.is_done() {
        let (m, raw) = c.next_raw().await;
        if m.id() != Some(id.as_str()) {
            continue;
        }
        if let ServerMessage::ToolCall(call) = &m {
            assert_eq!(raw["type"], "tool_call", "{raw}");
            if let Some(answer) = handler(call) {
                let answer = answer.as_ref().map_err(String::as_str).cloned();
                c.send_json(&tool_result(&id, &call.call_id, answer)).await;
            }
            calls.push(call.clone());
        }
        collected.push(m, raw);
    }
    collected.check_sequence();
    (collected, calls)
}

#[tokio::test]
async fn pong_advertises_tool_calls() {
    let Some(_g) = privileged("pong_advertises_tool_calls").await else {
        return;
    };
    let d = Daemon::start(DaemonOpts::default()).await;
    let mut c = Client::connect(&d).await;
    let pong = c.ping().await;
    let ext = pong.capabilities.unwrap().extensions;
    assert!(ext.iter().any(|e| e == "tool_calls"), "{ext:?}");
}

#[tokio::test]
async fn python_calls_a_tool_and_returns_a_value() {
    let Some(_g) = privileged("python_calls_a_tool_and_returns_a_value").await else {
        return;
    };
    let d = Daemon::start(DaemonOpts::default()).await;
    let mut c = Client::connect(&d).await;
    let code = r#"
import os, stat
st = os.stat("/sandbox/tools.sock")
print("socket", stat.S_IMODE(st.st_mode) == 0o600, st.st_uid == os.getuid())
text = read_file("notes.txt")
n = call("read_file", {"path": "other.txt"})
print("lengths", len(text), len(n))
{"upper": text.upper(), "calls": 2}
"#;
    let exec = with(
        exec_tools("t1", "python", code, &["read_file"]),
        json!({"tools": [{"name": "read_file", "description": "Read a file", "schema": {
            "type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}},
            // Named like a module the SDK uses: must not break it.
            {"name": "json"}]}),
    );
    let (run, calls) = run_answering(&mut c, exec, |call| {
        assert_eq!(call.name, "read_file");
        Some(Ok(json!(format!(
            "content of {}",
            call.args["path"].as_str().unwrap()
        ))))
    })
    .await;
    let out = run.stdout_text();
    assert_eq!(
        run.terminal_status(),
        Some(protocol::ExecStatus::Completed),
        "{}",
        run.dump()
    );
    assert!(out.contains("socket True True"), "{out}");
    assert!(out.contains("lengths 20 20"), "{out}");
    assert_eq!(calls.len(), 2);
    assert_eq!(calls[0].args, json!({"path": "notes.txt"}));
    assert_ne!(calls[0].call_id, calls[1].call_id);
    assert_eq!(calls[0].timeout_ms, Some(protocol::DEFAULT_TOOL_TIMEOUT_MS));
    let result = run.result();
    assert_eq!(result.tool_calls, Some(2));
    assert_eq!(
        result.return_value.as_deref(),
        Some(&json!({"upper": "CONTENT OF NOTES.TXT", "calls": 2}))
    );
}

#[tokio::test]
async fn javascript_calls_tools_and_returns_a_value() {
    let Some(_g) = privileged("javascript_calls_tools_and_returns_a_value").await else {
        return;
    };
    let d = Daemon::start(DaemonOpts::default()).await;
    let mut c = Client::connect(&d).await;
    let code = r#"
const a = await add({a: 2, b: 3});
const [b, c] = await Promise.all([add({a: a, b: 1}), call("add", {a: 10, b: 20})]);
let refused = null;
try { await call("delete_everything", {}); } catch (e) { refused = e.code; }
console.log("sums", a, b, c, refused);
return {sum: a + b + c, refused};
"#;
    let (run, calls) = run_answering(
        &mut c,
        exec_tools("j1", "javascript", code, &["add"]),
        |call| {
            let (a, b) = (
                call.args["a"].as_i64().unwrap(),
                call.args["b"].as_i64().unwrap(),
            );
            Some(Ok(json!(a + b)))
        },
    )
    .await;
    assert_eq!(
        run.terminal_status(),
        Some(protocol::ExecStatus::Completed),
        "{}",
        run.dump()
    );
    assert!(
        run.stdout_text().contains("sums 5 6 30 not_allowed"),
        "{}",
        run.dump()
    );
    assert_eq!(calls.len(), 3);
    assert_eq!(run.result().tool_calls, Some(3));
    assert_eq!(
        run.result().return_value.as_deref(),
        Some(&json!({"sum": 41, "refused": "not_allowed"}))
    );
}

#[tokio::test]
async fn a_tool_not_listed_is_refused_inside_the_sandbox() {
    let Some(_g) = privileged("a_tool_not_listed_is_refused_inside_the_sandbox").await else {
        return;
    };
    let d = Daemon::start(DaemonOpts::default()).await;
    let mut c = Client::connect(&d).await;
    let code = r#"
import json, socket
try:
    call("rm_rf", {"path": "/"})
except ToolError as e:
    print("refused", e.code, e.message)
# The same over the raw socket, bypassing the SDK.
s = socket.socket(socket.AF_UNIX)
s.connect("/sandbox/tools.sock")
s.sendall(b'{"op":"call","name":"secret","args":{}}\n')
print("raw", s.makefile().readline().strip())
"#;
    let (run, calls) = run_answering(
        &mut c,
        exec_tools("r1", "python", code, &["read_file"]),
        |_| Some(Ok(Value::Null)),
    )
    .await;
    let out = run.stdout_text();
    assert!(
        calls.is_empty(),
        "a refused tool must never be forwarded: {calls:?}"
    );
    assert!(out.contains("refused not_allowed"), "{}", run.dump());
    assert!(
        out.contains(r#"Tool \"rm_rf\" is not offered"#)
            || out.contains("Tool \"rm_rf\" is not offered"),
        "{out}"
    );
    assert!(out.contains(r#""code":"not_allowed""#), "{out}");
    assert_eq!(run.result().tool_calls, Some(0));
    assert_eq!(run.result().return_value, None);
}

#[tokio::test]
async fn a_handler_that_never_answers_hits_the_per_call_timeout() {
    let Some(_g) = privileged("a_handler_that_never_answers_hits_the_per_call_timeout").await
    else {
        return;
    };
    let d = Daemon::start(DaemonOpts::default()).await;
    let mut c = Client::connect(&d).await;
    let code = r#"
import time
t0 = time.monotonic()
try:
    slow()
    print("answered")
except ToolError as e:
    print("error", e.code, round((time.monotonic() - t0) * 1000))
try:
    slow(_timeout_ms=100)
except ToolError as e:
    print("shorter", e.code)
"#;
    let exec = with(
        exec_tools("to1", "python", code, &["slow"]),
        json!({"tool_timeout_ms": 700}),
    );
    let started = Instant::now();
    let (run, calls) = run_answering(&mut c, exec, |_| None).await;
    let out = run.stdout_text();
    assert!(out.contains("error timeout"), "{}", run.dump());
    assert!(out.contains("shorter timeout"), "{}", run.dump());
    let waited: u64 = out
        .split_whitespace()
        .nth(2)
        .and_then(|w| w.parse().ok())
        .unwrap_or_else(|| panic!("{out}"));
    assert!(
        waited >= 700,
        "the call waited {waited} ms, less than its 700 ms timeout"
    );
    assert_eq!(calls.len(), 2);
    assert_eq!(calls[0].timeout_ms, Some(700));
    assert_eq!(calls[1].timeout_ms, Some(100));
    assert!(started.elapsed() < Duration::from_secs(20));
    // A late answer is dropped quietly: no error for the finished execution, the connection stays usable.
    c.send_json(&tool_result("to1", &calls[0].call_id, Ok(json!(1))))
        .await;
    c.assert_usable().await;
    assert!(
        c.unclaimed()
            .iter()
            .all(|m| !matches!(m, ServerMessage::Error(_))),
        "{:?}",
        c.unclaimed()
    );
}

#[tokio::test]
async fn a_tool_error_reaches_the_code() {
    let Some(_g) = privileged("a_tool_error_reaches_the_code").await else {
        return;
    };
    let d = Daemon::start(DaemonOpts::default()).await;
    let mut c = Client::connect(&d).await;
    let code = "try:\n    boom()\nexcept ToolError as e:\n    print(e.code, e.message)\n";
    let (run, _) = run_answering(&mut c, exec_tools("e1", "python", code, &["boom"]), |_| {
        Some(Err("disk on fire".into()))
    })
    .await;
    assert!(
        run.stdout_text().contains("tool_error disk on fire"),
        "{}",
        run.dump()
    );
    assert_eq!(run.result().tool_calls, Some(1));
}

#[tokio::test]
async fn executions_without_tools_are_unchanged() {
    let Some(_g) = privileged("executions_without_tools_are_unchanged").await else {
        return;
    };
    let d = Daemon::start(DaemonOpts::default()).await;
    let mut c = Client::connect(&d).await;
    let code = "import os, sys\nprint(sorted(os.listdir('/sandbox')), 'PYTHONPATH' in os.environ, sys.argv)\n";
    let run = c.run(exec_json("p1", "python", code, 10_000, 128)).await;
    assert_eq!(
        run.stdout_text().trim(),
        "['main.py'] False ['/sandbox/main.py']",
        "{}",
        run.dump()
    );
    let raw = run.result_raw();
    assert!(
        raw.get("tool_calls").is_none() && raw.get("return_value").is_none(),
        "{raw}"
    );
}

#[tokio::test]
async fn tool_requests_are_validated() {
    let Some(_g) = privileged("tool_requests_are_validated").await else {
        return;
    };
    let d = Daemon::start(DaemonOpts {
        extra_config: Some(json!({"tools": {"max_call_timeout_ms": 5000}})),
        ..DaemonOpts::default()
    })
    .await;
    let mut c = Client::connect(&d).await;
    let cases = [
        (exec_tools("v1", "shell", "true", &["a"]), "tools"),
        (
            exec_tools("v2", "python", "1", &["a", "a"]),
            "tools[1].name",
        ),
        (
            exec_tools("v3", "python", "1", &["import"]),
            "tools[0].name",
        ),
        (
            exec_tools("v4", "python", "1", &["bad-name"]),
            "tools[0].name",
        ),
        (
            with(
                exec_tools("v5", "python", "1", &["a"]),
                json!({"tool_timeout_ms": 5001}),
            ),
            "tool_timeout_ms",
        ),
        (
            with(
                exec_json("v6", "python", "1", 1000, 64),
                json!({"tool_timeout_ms": 10}),
            ),
            "tool_timeout_ms",
        ),
        (
            with(
                exec_json("v7", "python", "1", 1000, 64),
                json!({"tools": [{"name": "a", "extra": 1}]}),
            ),
            "tools[0]",
        ),
        (
            with(
                exec_json("v8", "python", "1", 1000, 64),
                json!({"tools": [{"name": "a", "schema": [1]}]}),
            ),
            "tools[0].schema",
        ),
    ];
    for (exec, field) in cases {
        let id = exec["id"].as_str().unwrap().to_owned();
        c.send_json(&exec).await;
        let (e, raw) = c.take_error().await;
        assert_error(&e, &raw, ErrorCode::InvalidRequest, Some(&id));
        assert!(
            e.message.contains(field),
            "{id}: {:?} does not name {field}",
            e.message
        );
    }
    // A malformed tool_result is refused; one for an unknown execution is dropped quietly.
    c.send_json(
        &json!({"v":1,"type":"tool_result","id":"nope","call_id":"c1","ts":"...","ok":false}),
    )
    .await;
    let (e, _) = c.take_error().await;
    assert!(e.message.contains("error"), "{e:?}");
    c.send_json(&tool_result("nope", "c1", Ok(json!(1)))).await;
    c.assert_usable().await;
    assert!(c.unclaimed().is_empty(), "{:?}", c.unclaimed());
}

/// A program floods the tool socket (allowed calls from many threads, refused calls, garbage and an endless line)
/// while the client answers every call: `ping` on the same connection is still answered within 500 ms.
#[tokio::test]
async fn a_flooding_program_does_not_starve_the_websocket() {
    let Some(_g) = privileged_alone("a_flooding_program_does_not_starve_the_websocket").await
    else {
        return;
    };
    let d = Daemon::start(DaemonOpts {
        extra_config: Some(json!({"tools": {"max_calls": 100_000_000}})),
        ..DaemonOpts::default()
    })
    .await;
    let mut c = Client::connect(&d).await;
    let code = r#"
import socket, threading, time
def flood(line, answers):
    s = socket.socket(socket.AF_UNIX)
    s.connect("/sandbox/tools.sock")
    r = s.makefile("rb")
    end = time.monotonic() + 4
    n = 0
    while time.monotonic() < end:
        s.sendall(line * 32)
        if answers:
            for _ in range(32):
                r.readline()
        n += 32
    return n
connected = threading.Event()
def endless():
    s = socket.socket(socket.AF_UNIX)
    s.connect("/sandbox/tools.sock")
    connected.set()
    try:
        while True:
            s.sendall(b"x" * 65536)
    except OSError:
        print("endless line cut off")
# The endless line connects first: connections are accepted in order, 8 at once, and it must be among them.
threading.Thread(target=endless, daemon=True).start()
connected.wait()
threads = [threading.Thread(target=flood, args=(b'{"op":"call","name":"echo","args":{"x":1}}\n', True)) for _ in range(6)]
threads.append(threading.Thread(target=flood, args=(b'{"op":"call","name":"nope"}\n', True)))
threads.append(threading.Thread(target=flood, args=(b'garbage\n', False)))
for t in threads:
    t.daemon = True  # the garbage thread never reads its replies and blocks once the socket is full
    t.start()
for t in threads[:7]: t.join()
print("flood done")
"#;
    let exec = with(
        exec_tools("f1", "python", code, &["echo"]),
        json!({"limits": {"timeout_ms": 30_000}}),
    );
    c.send_json(&exec).await;
    let mut collected = Collected::new("f1");
    let mut worst = Duration::ZERO;
    let mut pings = 0;
    let mut answered = 0u64;
    let mut next_ping = Instant::now() + Duration::from_millis(500);
    let mut ping_sent: Option<Instant> = None;
    while !collected.is_done() {
        if ping_sent.is_none() && Instant::now() >= next_ping {
            c.send_json(&ping_json()).await;
            ping_sent = Some(Instant::now());
        }
        let Some(frame) = c.next_frame(Duration::from_millis(50)).await else {
            continue;
        };
        let tungstenite_text = match frame.expect("connection open") {
            tokio_tungstenite::tungstenite::Message::Text(t) => t,
            other => panic!("{other:?}"),
        };
        let (m, raw) = Client::parse(tungstenite_text.as_str());
        match &m {
            ServerMessage::Pong(_) => {
                let rtt = ping_sent.take().expect("a pong answers a ping").elapsed();
                worst = worst.max(rtt);
                pings += 1;
                next_ping = Instant::now() + Duration::from_millis(100);
            }
            ServerMessage::ToolCall(call) => {
                answered += 1;
                c.send_json(&tool_result("f1", &call.call_id, Ok(json!({"x": 1}))))
                    .await;
                collected.push(m, raw);
            }
            _ => collected.push(m, raw),
        }
    }
    collected.check_completed();
    let out = collected.stdout_text();
    println!("flood: {answered} calls answered, {pings} pings, worst ping round trip {worst:?}");
    assert!(out.contains("flood done"), "{}", collected.dump());
    assert!(out.contains("endless line cut off"), "{}", collected.dump());
    assert!(
        pings >= 10,
        "only {pings} pings were answered during the flood"
    );
    assert!(answered >= 100, "the flood made only {answered} calls");
    assert_eq!(collected.result().tool_calls, Some(answered));
    assert!(
        worst < Duration::from_millis(500),
        "a ping took {worst:?} during the flood"
    );
}

/// Runs `code` with the tool `echo` (answered with its `args`) within `timeout_ms`; the run and the calls seen.
async fn run_echo(
    id: &str,
    language: &str,
    code: &str,
    timeout_ms: u64,
) -> (Collected, Vec<ToolCall>) {
    let d = Daemon::start(DaemonOpts::default()).await;
    let mut c = Client::connect(&d).await;
    let exec = with(
        exec_tools(id, language, code, &["echo"]),
        // Room for 64 threads.
        json!({"limits": {"timeout_ms": timeout_ms, "pids_max": 128}}),
    );
    run_answering(&mut c, exec, |call| Some(Ok(call.args.clone()))).await
}

/// More threads than the daemon serves connections, each making calls between barriers (so finished threads
/// wait idle for the others): every thread gets its answers, none waits for a connection an idle thread holds.
#[tokio::test]
async fn python_threads_beyond_the_connection_limit_all_get_answers() {
    let Some(_g) = privileged("python_threads_beyond_the_connection_limit_all_get_answers").await
    else {
        return;
    };
    for threads in [16, 64] {
        let code = format!(
            r#"
import threading
N = {threads}
barrier = threading.Barrier(N)
answers = []
def work(i):
    for round in range(3):
        answers.append(echo(i=i, round=round)["i"] == i)
        barrier.wait()
ts = [threading.Thread(target=work, args=(i,)) for i in range(N)]
for t in ts: t.start()
for t in ts: t.join()
print("answers", len(answers), all(answers))
"#
        );
        let (run, calls) = run_echo("th1", "python", &code, 30_000).await;
        assert_eq!(
            run.terminal_status(),
            Some(protocol::ExecStatus::Completed),
            "{threads} threads: {}",
            run.dump()
        );
        assert!(
            run.stdout_text()
                .contains(&format!("answers {} True", threads * 3)),
            "{}",
            run.dump()
        );
        assert_eq!(calls.len(), threads * 3);
    }
    // Forked processes: each calls, then waits idle until all are done; a thread of the parent is in a call when
    // they fork, and the parent still calls after.
    let code = r#"
import os, threading
N = 16
done_r, done_w = os.pipe()
go_r, go_w = os.pipe()
echo(i=-1)
inflight = threading.Thread(target=lambda: echo(i=-2))
inflight.start()
kids = []
for i in range(N):
    pid = os.fork()
    if pid == 0:
        os.close(go_w)
        ok = all(echo(i=i, round=r)["i"] == i for r in range(2))
        os.write(done_w, b"1" if ok else b"0")
        os.read(go_r, 1)
        os._exit(0)
    kids.append(pid)
inflight.join()
got = b""
while len(got) < N:
    got += os.read(done_r, N)
os.close(go_w)
for pid in kids:
    os.waitpid(pid, 0)
print("processes", got.count(b"1"), echo(i=-3)["i"])
"#;
    let (run, calls) = run_echo("fk1", "python", code, 30_000).await;
    assert!(
        run.stdout_text().contains("processes 16 -3"),
        "{}",
        run.dump()
    );
    assert_eq!(calls.len(), 16 * 2 + 3);
}

/// Javascript workers (each loads its own SDK) beyond the connection limit, each calling and then waiting idle
/// until every worker is done: all get their answers.
#[tokio::test]
async fn javascript_workers_beyond_the_connection_limit_all_get_answers() {
    let Some(_g) =
        privileged("javascript_workers_beyond_the_connection_limit_all_get_answers").await
    else {
        return;
    };
    let code = r#"
const { Worker } = require("worker_threads");
const N = 16;
const body = `
const { parentPort, workerData } = require("worker_threads");
const sdk = require("sandbox_tools");
(async () => {
  let ok = 0;
  for (let round = 0; round < 3; round++) {
    const r = await sdk.call("echo", {i: workerData, round});
    if (r.i === workerData) ok++;
  }
  parentPort.postMessage(ok);
  // Stays alive, idle, until told to go.
  parentPort.on("message", () => process.exit(0));
})();
`;
const workers = [];
const results = await new Promise((resolve) => {
  const got = [];
  for (let i = 0; i < N; i++) {
    const w = new Worker(body, { eval: true, workerData: i });
    workers.push(w);
    w.on("message", (ok) => { got.push(ok); if (got.length === N) resolve(got); });
  }
});
for (const w of workers) w.postMessage("go");
console.log("answers", results.reduce((a, b) => a + b, 0));
const many = await Promise.all(Array.from({length: 64}, (_, i) => echo({i})));
console.log("all at once", many.filter((r, i) => r.i === i).length);
"#;
    let (run, calls) = run_echo("jw1", "javascript", code, 30_000).await;
    assert_eq!(
        run.terminal_status(),
        Some(protocol::ExecStatus::Completed),
        "{}",
        run.dump()
    );
    let out = run.stdout_text();
    assert!(out.contains("answers 48"), "{}", run.dump());
    assert!(out.contains("all at once 64"), "{}", run.dump());
    assert_eq!(calls.len(), 48 + 64);
}

/// A request over `max_line_bytes` fails with a clear error, and the next call works: the SDK does not reuse the
/// connection the daemon closed. Also with the SDK's own size check out of the way, so the daemon refuses it.
#[tokio::test]
async fn after_an_oversize_request_the_next_call_works() {
    let Some(_g) = privileged("after_an_oversize_request_the_next_call_works").await else {
        return;
    };
    let python = r#"
import sandbox_tools
def attempt(label):
    try:
        echo(x="y" * (1 << 20))
        print(label, "answered")
    except ToolError as e:
        print(label, e.code)
    print(label, "next", echo(x=1)["x"])
attempt("sdk")
sandbox_tools._MAX_LINE = 1 << 40
attempt("daemon")
"#;
    let (run, calls) = run_echo("ov1", "python", python, 30_000).await;
    let out = run.stdout_text();
    assert!(out.contains("sdk invalid\nsdk next 1"), "{}", run.dump());
    assert!(
        out.contains("daemon invalid\ndaemon next 1"),
        "{}",
        run.dump()
    );
    assert_eq!(calls.len(), 2);
    let js = r#"
const sdk = require("sandbox_tools");
async function attempt(label) {
  try {
    await echo({x: "y".repeat(1 << 20)});
    console.log(label, "answered");
  } catch (e) {
    console.log(label, e.code);
  }
  console.log(label, "next", (await echo({x: 1})).x);
}
await attempt("sdk");
sdk._limits.maxLine = 2 ** 40;
await attempt("daemon");
"#;
    let (run, calls) = run_echo("ov2", "javascript", js, 30_000).await;
    let out = run.stdout_text();
    assert!(out.contains("sdk invalid\nsdk next 1"), "{}", run.dump());
    assert!(
        out.contains("daemon invalid\ndaemon next 1"),
        "{}",
        run.dump()
    );
    assert_eq!(calls.len(), 2);
}

/// A program queues many calls on every connection, then hits its timeout while the client answers what it
/// gets: the execution ends with `timeout`, every `tool_call` the client sees is counted in the result, and none
/// comes after it. (That no call is queued once the end is decided is checked deterministically by the broker's
/// unit test `after_the_end_calls_get_closed_and_are_never_forwarded`; here the daemon wires it up.)
#[tokio::test]
async fn calls_queued_at_the_timeout_are_not_forwarded_after_it() {
    let Some(_g) = privileged("calls_queued_at_the_timeout_are_not_forwarded_after_it").await
    else {
        return;
    };
    let d = Daemon::start(DaemonOpts {
        extra_config: Some(json!({"tools": {"max_calls": 100_000_000}})),
        ..DaemonOpts::default()
    })
    .await;
    let mut c = Client::connect(&d).await;
    let code = r#"
import socket, threading
def flood():
    s = socket.socket(socket.AF_UNIX)
    s.connect("/sandbox/tools.sock")
    r = s.makefile("rb")
    def drain():
        while r.readline():
            pass
    threading.Thread(target=drain, daemon=True).start()
    while True:
        s.sendall(b'{"op":"call","name":"echo","args":{"x":1}}\n' * 256)
for _ in range(8):
    threading.Thread(target=flood, daemon=True).start()
threading.Event().wait()
"#;
    let exec = with(
        exec_tools("q1", "python", code, &["echo"]),
        json!({"limits": {"timeout_ms": 2_000}}),
    );
    let (run, calls) = run_answering(&mut c, exec, |call| Some(Ok(call.args.clone()))).await;
    assert_eq!(
        run.terminal_status(),
        Some(protocol::ExecStatus::Timeout),
        "{}",
        run.dump()
    );
    assert!(!calls.is_empty());
    assert_eq!(run.result().tool_calls, Some(calls.len() as u64));
    // Nothing of the execution after its result.
    let late = c.next_frame(Duration::from_millis(500)).await;
    assert!(late.is_none(), "{late:?}");
}

/// An execution with three tool calls moves every tool series of `/metrics`, and the daemon logs one summary line
/// for it with the call count and the bytes.
#[tokio::test]
async fn tool_calls_show_in_the_metrics_and_the_summary_line() {
    let Some(_g) = privileged("tool_calls_show_in_the_metrics_and_the_summary_line").await else {
        return;
    };
    use super::ops::{get_with_token, series};
    let d = Daemon::start(DaemonOpts::default()).await;
    let mut c = Client::connect(&d).await;
    // The daemon's start-up self-test runs executions too: every check below is a difference.
    let (code, before) = get_with_token(d.port, "/metrics", Some(d.token())).await;
    assert_eq!(code, 200, "{before}");
    // Two big results filtered down to a short answer, one failing call, one tool that is not offered.
    let code = format!(
        "{READS_AND_A_FAILED_CALL}{}",
        r#"
try:
    call("not_offered", {})
except ToolError:
    pass
print("done")
return f"{len(a) + len(b)} bytes"
"#
    );
    let (run, calls) = run_answering(
        &mut c,
        exec_tools("m1", "python", &code, &["read_file", "boom"]),
        |call| match call.name.as_str() {
            "read_file" => Some(Ok(json!("x".repeat(5000)))),
            _ => Some(Err("no".into())),
        },
    )
    .await;
    assert_eq!(calls.len(), 3, "{}", run.dump());
    let res = run.result();
    assert_eq!(
        res.return_value.as_deref(),
        Some(&json!("10000 bytes")),
        "{}",
        run.dump()
    );
    let output_bytes = res.stdout_bytes + res.stderr_bytes + "\"10000 bytes\"".len() as u64;
    // A refused request counts under its code.
    let refused = c.run(exec_json("m2", "python", "1", 1000, 1 << 30)).await;
    assert!(
        matches!(&refused.messages[..], [ServerMessage::Error(e)] if e.code == ErrorCode::InvalidRequest),
        "{}",
        refused.dump()
    );

    let token = d.token().to_owned();
    let counted = "sandboxd_execution_tool_calls_count{language=\"python\"}";
    let text = wait_until(
        "the execution to be counted",
        Duration::from_secs(10),
        || {
            let (token, before) = (token.clone(), before.clone());
            async move {
                let (code, text) = get_with_token(d.port, "/metrics", Some(&token)).await;
                if code == 200 && series(&text, counted) > series(&before, counted) {
                    Ok(text)
                } else {
                    Err(format!("{code}:\n{text}"))
                }
            }
        },
    )
    .await;
    let delta = |name: &str| series(&text, name) - series(&before, name);
    for (name, want) in [
        (
            "sandboxd_execution_tool_calls_count{language=\"python\"}",
            1.0,
        ),
        (
            "sandboxd_execution_tool_calls_sum{language=\"python\"}",
            3.0,
        ),
        (
            "sandboxd_execution_output_bytes_sum{language=\"python\"}",
            output_bytes as f64,
        ),
        (
            "sandboxd_tool_calls_total{tool=\"read_file\",outcome=\"ok\"}",
            2.0,
        ),
        (
            "sandboxd_tool_calls_total{tool=\"boom\",outcome=\"tool_error\"}",
            1.0,
        ),
        (
            "sandboxd_tool_calls_total{tool=\"_unlisted\",outcome=\"not_allowed\"}",
            1.0,
        ),
        ("sandboxd_tool_call_seconds_count{tool=\"read_file\"}", 2.0),
        ("sandboxd_tool_call_seconds_count{tool=\"boom\"}", 1.0),
        ("sandboxd_errors_total{code=\"INVALID_REQUEST\"}", 1.0),
    ] {
        assert_eq!(delta(name), want, "{name}:\n{text}");
    }
    // The two results of 5000 characters, as JSON lines, entered the sandbox.
    let inside = delta("sandboxd_execution_tool_result_bytes_sum{language=\"python\"}");
    assert!((10_000.0..11_000.0).contains(&inside), "{inside}:\n{text}");

    let log = d.log();
    let summary = log
        .lines()
        .find(|l| l.contains("id=m1") && l.contains("program ended"))
        .unwrap_or_else(|| panic!("no summary line for m1:\n{log}"));
    assert!(
        summary.contains(" INFO ")
            && summary.contains("tool_calls=3")
            && summary.contains(&format!("output_bytes={output_bytes}"))
            && summary.contains("tool_result_bytes="),
        "{summary}"
    );
}

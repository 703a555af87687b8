//! `cargo bench -p sandboxd-client --bench tools`: the round trip of a tool call from sandboxed code, against a
//! real sandboxd (root needed; the daemon binary is found as for the client's tests, or `$SANDBOXD_BIN`).
//!
//! One python program makes 1000 calls of an `echo` tool in one execution and times each one (JSON line over
//! `/sandbox/tools.sock` → broker → `tool_call` over the WebSocket → this process's handler → `tool_result` →
//! reply line). The baseline, interleaved round by round, runs the same program on the host against a plain unix
//! socket served by this process that answers each line at once: the cost of the JSON-line round trip itself.
//! Prints p50 and p95 per round and over all rounds; no assertions on the figures.
#![allow(missing_docs)]
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

#[path = "../tests/suite/daemon.rs"]
mod daemon;

use common::percentile;
use std::time::Duration;

use client::{
    new_execution_id, ConnectOptions, Connection, Execute, ExecuteRequest, Language,
    RequestedLimits, ToolSpec,
};
use daemon::{Daemon, DaemonOpts};
use serde_json::Value;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};

const CALLS: usize = 1000;
const ROUNDS: usize = 3;

/// Times `CALLS` round trips on the socket at `SOCK` (a raw client: the same code in and out of the sandbox);
/// the last expression is the list of round trips in microseconds.
const PROGRAM: &str = r#"
import json, socket, time
s = socket.socket(socket.AF_UNIX)
s.connect(SOCK)
r = s.makefile("rb")
times = []
for i in range(CALLS):
    t0 = time.perf_counter_ns()
    s.sendall((json.dumps({"op": "call", "name": "echo", "args": {"i": i}}) + "\n").encode())
    reply = json.loads(r.readline())
    times.append((time.perf_counter_ns() - t0) / 1000)
    assert reply["ok"] and reply["result"]["i"] == i, reply
times
"#;

fn program(sock: &str) -> String {
    format!("SOCK = {sock:?}\nCALLS = {CALLS}\n{PROGRAM}")
}

fn line(name: &str, mut v: Vec<f64>) {
    v.sort_by(|a, b| a.total_cmp(b));
    println!(
        "{name:<40} n={:<5} p50 {:>8.1} µs   p95 {:>8.1} µs   max {:>8.1} µs",
        v.len(),
        percentile(&v, 50),
        percentile(&v, 95),
        v[v.len() - 1]
    );
}

fn main() {
    common::block_on(run());
}

/// The baseline: a unix socket answering each `call` line with its args, as the broker would with an instant
/// handler, and the same program run by the host's python3 (the wrapper the sandbox uses is not needed: the
/// program's last expression is printed as JSON).
async fn baseline(dir: &std::path::Path) -> Vec<f64> {
    let sock = dir.join("baseline.sock");
    let _ = std::fs::remove_file(&sock);
    let listener = tokio::net::UnixListener::bind(&sock).unwrap();
    let server = tokio::spawn(async move {
        let (stream, _) = listener.accept().await.unwrap();
        let (read, mut write) = stream.into_split();
        let mut lines = BufReader::new(read).lines();
        while let Ok(Some(l)) = lines.next_line().await {
            let req: Value = serde_json::from_str(&l).unwrap();
            let reply = serde_json::json!({"ok": true, "result": req["args"]});
            write
                .write_all(format!("{reply}\n").as_bytes())
                .await
                .unwrap();
        }
    });
    let code = program(sock.to_str().unwrap()).replace("\ntimes\n", "\nprint(json.dumps(times))\n");
    let out = tokio::process::Command::new("python3")
        .args(["-c", &code])
        .output()
        .await
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    server.abort();
    serde_json::from_slice(&out.stdout).unwrap()
}

async fn sandboxed(conn: &Connection) -> (Vec<f64>, Duration) {
    let mut req = ExecuteRequest::new(
        new_execution_id(),
        Language::Python,
        program("/sandbox/tools.sock"),
        RequestedLimits::new(60_000, 256),
    );
    req.tools = vec![ToolSpec::new("echo")];
    let r = conn
        .execute_with_tools(req, |call| async move { Ok(call.args) })
        .await
        .unwrap();
    assert!(r.success(), "{}", r.stderr_text());
    assert_eq!(r.tool_calls, Some(CALLS as u64));
    let times = serde_json::from_value(r.return_value.unwrap()).unwrap();
    (times, r.duration)
}

async fn run() {
    let Some(bin) = daemon::require_daemon("tools bench") else {
        return;
    };
    println!("sandboxd binary: {}", bin.display());
    let d = Daemon::start(&bin, DaemonOpts::default()).await;
    let conn = Connection::connect(ConnectOptions::new(d.url()).token(d.token.clone()))
        .await
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    // Warm-up: python's first start, the daemon's first container.
    let _ = sandboxed(&conn).await;
    let (mut all_sandbox, mut all_base) = (Vec::new(), Vec::new());
    println!("{CALLS} sequential tool calls per execution, {ROUNDS} rounds interleaved:");
    for round in 1..=ROUNDS {
        let (s, took) = sandboxed(&conn).await;
        line(
            &format!("round {round}: sandbox → daemon → client"),
            s.clone(),
        );
        println!("{:<40} execution {} ms", "", took.as_millis());
        let b = baseline(dir.path()).await;
        line(
            &format!("round {round}: baseline plain unix socket"),
            b.clone(),
        );
        all_sandbox.extend(s);
        all_base.extend(b);
    }
    println!();
    line("all rounds: sandbox → daemon → client", all_sandbox);
    line("all rounds: baseline plain unix socket", all_base);
}

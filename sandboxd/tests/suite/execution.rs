//! Executions that run to their end: the success sequence per language, the `ack`'s limits, stdin, env, input
//! files, exit codes and signals (spec sections 3, 4 and 5).

use base64::engine::general_purpose::STANDARD;
use base64::Engine as _;
use protocol::{ExecStatus, Limits, Reason};
use serde_json::{json, Value};

use super::harness::{exec_json, privileged, with, Client, Daemon, DaemonOpts};

/// Hello world in `language`: `ack` (limits with the defaults, not queued), `status:running`, stdout,
/// `status:completed`, `result` (exit 0, `exited`, duration and resource usage present).
async fn hello(test: &str, language: &str, code: &str) {
    let Some(_g) = privileged(test).await else {
        return;
    };
    let d = Daemon::start(DaemonOpts::default()).await;
    let mut c = Client::connect(&d).await;
    let r = c
        .run(exec_json("hello-1", language, code, 20_000, 128))
        .await;

    assert_eq!(
        r.kinds(),
        [
            "ack",
            "status:running",
            "stdout",
            "status:completed",
            "result"
        ],
        "{}",
        r.dump()
    );
    let (limits, queued) = r.ack();
    assert_eq!(
        limits,
        Some(Limits {
            timeout_ms: 20_000,
            memory_mb: 128,
            cpu_shares: 512,
            max_output_bytes: 1_048_576,
            pids_max: 64,
            disk_mb: 64,
            cpu_cores: protocol::CpuCores::new(2.0),
        }),
        "ack.limits: the limits in effect with the defaults filled in"
    );
    assert_eq!(queued, Some(false), "ack.queued on an idle daemon");
    assert_eq!(r.stdout_text(), "hello\n", "{}", r.dump());
    assert!(r.stderr().is_empty(), "{}", r.dump());

    let res = r.result();
    assert_eq!(res.exit_code, Some(0), "{}", r.dump());
    assert_eq!(res.reason, Reason::Exited);
    assert_eq!(res.signal, None);
    assert!(!res.truncated);
    assert_eq!((res.stdout_bytes, res.stderr_bytes), (6, 0));
    let raw = r.result_raw();
    assert_eq!(raw["exit_code"], 0, "{raw}");
    assert!(raw["duration_ms"].is_u64(), "duration_ms: {raw}");
    assert!(
        raw["resource_usage"]["peak_memory_mb"].is_u64(),
        "peak_memory_mb: {raw}"
    );
    assert!(
        raw["resource_usage"]["cpu_time_ms"].is_u64(),
        "cpu_time_ms: {raw}"
    );
    assert!(
        res.resource_usage.peak_memory_mb >= 1,
        "a program that ran used some memory: {raw}"
    );
}

#[tokio::test]
async fn hello_python() {
    hello("hello_python", "python", "print('hello')").await;
}

#[tokio::test]
async fn hello_javascript() {
    hello("hello_javascript", "javascript", "console.log('hello')").await;
}

#[tokio::test]
async fn hello_shell() {
    hello("hello_shell", "shell", "echo hello").await;
}

#[tokio::test]
async fn stdin_and_env_reach_the_program() {
    let Some(_g) = privileged("stdin_and_env_reach_the_program").await else {
        return;
    };
    let d = Daemon::start(DaemonOpts::default()).await;
    let mut c = Client::connect(&d).await;
    let code =
        "import sys, os\nprint(repr(sys.stdin.read()))\nprint(os.environ['K'])\nprint(os.getcwd())";
    let r = c
        .run_completed(with(
            exec_json("io-1", "python", code, 20_000, 128),
            json!({"stdin": "line1\nline2\n", "env": {"K": "V with spaces=and equals"}}),
        ))
        .await;
    assert_eq!(
        r.stdout_text(),
        "'line1\\nline2\\n'\nV with spaces=and equals\n/workspace\n",
        "{}",
        r.dump()
    );

    // stdin null (and absent): empty, closed at once.
    let code = "import sys\nprint(repr(sys.stdin.read()))";
    let mut null_stdin = exec_json("io-2", "python", code, 20_000, 128);
    null_stdin["stdin"] = Value::Null;
    for exec in [null_stdin, exec_json("io-3", "python", code, 20_000, 128)] {
        let r = c.run_completed(exec).await;
        assert_eq!(r.stdout_text(), "''\n", "{}", r.dump());
    }
}

#[tokio::test]
async fn files_are_in_the_workspace_before_start() {
    let Some(_g) = privileged("files_are_in_the_workspace_before_start").await else {
        return;
    };
    let d = Daemon::start(DaemonOpts::default()).await;
    let mut c = Client::connect(&d).await;
    let blob: Vec<u8> = (0..=255u8).collect();
    let code = r#"
import json, os
print(json.dumps({
    "csv": open("data/in.csv").read(),
    "blob": open("bin/blob.bin", "rb").read().hex(),
    "deep": open("/workspace/deep/er/x.txt").read(),
    "listing": sorted(os.listdir("/workspace")),
}))
"#;
    let r = c
        .run_completed(with(
            exec_json("files-1", "python", code, 20_000, 128),
            json!({"files": [
                {"path": "data/in.csv", "content": "a,b\n1,2\n", "encoding": "utf8"},
                {"path": "bin/blob.bin", "content": STANDARD.encode(&blob), "encoding": "base64"},
                {"path": "deep/er/x.txt", "content": "é ü"},
            ]}),
        ))
        .await;
    let out: Value =
        serde_json::from_slice(&r.stdout()).unwrap_or_else(|e| panic!("{e}: {}", r.dump()));
    assert_eq!(out["csv"], "a,b\n1,2\n");
    let hex: String = blob.iter().map(|b| format!("{b:02x}")).collect();
    assert_eq!(
        out["blob"],
        hex.as_str(),
        "base64 file decoded byte for byte"
    );
    assert_eq!(out["deep"], "é ü");
    for name in ["bin", "data", "deep"] {
        assert!(
            out["listing"].as_array().unwrap().iter().any(|v| v == name),
            "/workspace lists {name}: {out}"
        );
    }
}

#[tokio::test]
async fn nonzero_exit_and_signals() {
    let Some(_g) = privileged("nonzero_exit_and_signals").await else {
        return;
    };
    let d = Daemon::start(DaemonOpts::default()).await;
    let mut c = Client::connect(&d).await;

    let r = c
        .run(exec_json(
            "exit-3",
            "python",
            "import sys\nsys.exit(3)",
            20_000,
            128,
        ))
        .await;
    assert_eq!(
        r.statuses(),
        [ExecStatus::Running, ExecStatus::Failed],
        "{}",
        r.dump()
    );
    let res = r.result();
    assert_eq!(res.exit_code, Some(3), "{}", r.dump());
    assert_eq!(res.reason, Reason::Exited);
    assert_eq!(res.signal, None);

    let r = c
        .run(exec_json(
            "kill-9",
            "python",
            "import os, signal\nprint('before', flush=True)\nos.kill(os.getpid(), signal.SIGKILL)\nprint('after')",
            20_000,
            128,
        ))
        .await;
    assert_eq!(
        r.statuses(),
        [ExecStatus::Running, ExecStatus::Failed],
        "{}",
        r.dump()
    );
    assert_eq!(r.stdout_text(), "before\n");
    let res = r.result();
    assert_eq!(
        res.exit_code,
        None,
        "killed by a signal: exit_code null; {}",
        r.dump()
    );
    assert!(
        r.result_raw().get("exit_code").is_some_and(Value::is_null),
        "exit_code is sent as null: {}",
        r.result_raw()
    );
    assert_eq!(res.reason, Reason::Signaled, "{}", r.dump());
    assert_eq!(res.signal.as_deref(), Some("SIGKILL"), "{}", r.dump());

    let r = c
        .run(exec_json(
            "term-self",
            "shell",
            "kill -TERM $$",
            20_000,
            128,
        ))
        .await;
    assert_eq!(
        r.statuses(),
        [ExecStatus::Running, ExecStatus::Failed],
        "{}",
        r.dump()
    );
    assert_eq!(r.result().reason, Reason::Signaled, "{}", r.dump());
    assert_eq!(
        r.result().signal.as_deref(),
        Some("SIGTERM"),
        "{}",
        r.dump()
    );
}

#[tokio::test]
async fn pong_reports_load_and_capabilities() {
    let Some(_g) = privileged("pong_reports_load_and_capabilities").await else {
        return;
    };
    let d = Daemon::start(DaemonOpts::default()).await;
    let mut c = Client::connect(&d).await;
    c.send_json(&super::harness::ping_json()).await;
    let (m, raw) = c.next_raw().await;
    let protocol::ServerMessage::Pong(p) = m else {
        panic!("expected a pong, got {raw}");
    };
    assert_eq!(
        (p.load.active_executions, p.load.queue_depth),
        (0, 0),
        "{raw}"
    );
    let caps = p
        .capabilities
        .unwrap_or_else(|| panic!("sandboxd sends capabilities: {raw}"));
    let langs: Vec<&str> = caps.languages.iter().map(|l| l.as_str()).collect();
    for l in ["python", "javascript", "shell"] {
        assert!(langs.contains(&l), "capabilities.languages has {l}: {raw}");
    }
    assert_eq!(caps.max_limits, super::harness::MAX_LIMITS, "{raw}");
    for e in ["files", "base64_output"] {
        assert!(
            caps.extensions.iter().any(|x| x == e),
            "extension {e}: {raw}"
        );
    }
    assert!(caps.isolation.user_namespace, "{raw}");
    assert!(
        caps.isolation.namespaces.iter().any(|n| n == "pid"),
        "{raw}"
    );
    // Every listed language really runs.
    for l in langs {
        let code = match l {
            "python" => "print('ok')",
            "javascript" => "console.log('ok')",
            "shell" => "echo ok",
            "elixir" => "IO.puts(\"ok\")",
            other => panic!("unknown language {other}"),
        };
        let r = c
            .run_completed(exec_json(&format!("lang-{l}"), l, code, 30_000, 256))
            .await;
        assert_eq!(r.stdout_text(), "ok\n", "{}", r.dump());
    }
}

#[tokio::test]
async fn concurrent_executions_on_one_connection_are_told_apart_by_id() {
    let Some(_g) = privileged("concurrent_executions_on_one_connection_are_told_apart_by_id").await
    else {
        return;
    };
    let d = Daemon::start(DaemonOpts::default()).await;
    let mut c = Client::connect(&d).await;
    let ids = ["par-a", "par-b", "par-c"];
    let execs: Vec<Value> = ids
        .iter()
        .map(|id| {
            let code = format!(
                "import sys, time\nfor i in range(20):\n    print('{id}', i, flush=True)\n    \
                 print('{id}-err', i, file=sys.stderr, flush=True)\n    time.sleep(0.02)"
            );
            exec_json(id, "python", &code, 30_000, 128)
        })
        .collect();
    c.send_all(&execs).await;
    for id in ids {
        let r = c.collect(id).await;
        r.check_completed();
        let expected: String = (0..20).map(|i| format!("{id} {i}\n")).collect();
        assert_eq!(
            r.stdout_text(),
            expected,
            "only and all of {id}'s stdout, in order"
        );
        let expected: String = (0..20).map(|i| format!("{id}-err {i}\n")).collect();
        assert_eq!(
            String::from_utf8_lossy(&r.stderr()),
            expected,
            "only and all of {id}'s stderr, in order"
        );
    }
}

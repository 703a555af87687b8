//! The `tool_calls` extension through the client's handler API, against a real daemon: the three example
//! programs of the execute_code design (output filtering, multi-step composition, timeout control) call `read_file`, `grep`,
//! `edit_file` and `bash`, which a test handler implements over a temporary directory on the host.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use client::{
    new_execution_id, ConnectOptions, Connection, Execute, ExecuteRequest, Language, Pool,
    RequestedLimits, ToolCall, ToolOutcome, ToolSpec,
};
use serde_json::{json, Value};

use super::daemon::{require_daemon, Daemon, DaemonOpts};

/// The orchestrator's tools, confined to `root`.
struct Workspace {
    root: PathBuf,
}

impl Workspace {
    fn path(&self, args: &Value) -> Result<PathBuf, String> {
        let rel = args["path"].as_str().ok_or("path is required")?;
        if rel.starts_with('/') || rel.split('/').any(|c| c == "..") {
            return Err(format!("{rel}: outside the workspace"));
        }
        Ok(self.root.join(rel))
    }

    async fn handle(&self, call: ToolCall) -> ToolOutcome {
        let args = &call.args;
        match call.name.as_str() {
            "read_file" => std::fs::read_to_string(self.path(args)?)
                .map(Value::String)
                .map_err(|e| e.to_string()),
            "grep" => {
                let content = args["content"].as_str().ok_or("content is required")?;
                let pattern = args["pattern"].as_str().ok_or("pattern is required")?;
                // A literal prefix of the pattern is enough for these programs (no regex crate in the tests).
                let literal: String = pattern
                    .chars()
                    .take_while(|c| c.is_alphanumeric() || *c == '_')
                    .collect();
                let matches: Vec<Value> = content
                    .lines()
                    .enumerate()
                    .filter(|(_, l)| l.contains(&literal))
                    .map(|(i, l)| json!({"line": i + 1, "content": l}))
                    .collect();
                Ok(Value::Array(matches))
            }
            "edit_file" => {
                let path = self.path(args)?;
                let line = args["line"].as_u64().ok_or("line is required")? as usize;
                let new = args["new"].as_str().ok_or("new is required")?;
                let text = std::fs::read_to_string(&path).map_err(|e| e.to_string())?;
                let mut lines: Vec<&str> = text.lines().collect();
                let slot = lines.get_mut(line - 1).ok_or("no such line")?;
                *slot = new;
                std::fs::write(&path, lines.join("\n") + "\n").map_err(|e| e.to_string())?;
                Ok(json!("edited"))
            }
            "bash" => {
                let command = args["command"].as_str().ok_or("command is required")?;
                let timeout = Duration::from_secs(args["timeout"].as_u64().unwrap_or(120));
                let started = Instant::now();
                let child = tokio::process::Command::new("sh")
                    .arg("-c")
                    .arg(command)
                    .current_dir(&self.root)
                    .stdout(std::process::Stdio::piped())
                    .stderr(std::process::Stdio::piped())
                    .kill_on_drop(true)
                    .spawn()
                    .map_err(|e| e.to_string())?;
                let (stdout, stderr, exit_code, timed_out) =
                    match tokio::time::timeout(timeout, child.wait_with_output()).await {
                        Ok(out) => {
                            let out = out.map_err(|e| e.to_string())?;
                            let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
                            (
                                text(&out.stdout),
                                text(&out.stderr),
                                out.status.code().unwrap_or(-1),
                                false,
                            )
                        }
                        Err(_) => (String::new(), String::new(), -1, true),
                    };
                Ok(json!({
                    "stdout": stdout, "stderr": stderr, "exit_code": exit_code,
                    "duration_ms": started.elapsed().as_millis() as u64,
                    "line_count": stdout.lines().count(), "timed_out": timed_out,
                }))
            }
            other => Err(format!("no tool {other}")),
        }
    }
}

fn tool(name: &str, required: &[&str], optional: &[&str]) -> ToolSpec {
    let mut props = serde_json::Map::new();
    for p in required.iter().chain(optional) {
        props.insert((*p).to_owned(), json!({}));
    }
    ToolSpec {
        name: name.into(),
        description: Some(format!("The orchestrator's {name}")),
        schema: Some(json!({"type": "object", "properties": props, "required": required})),
    }
}

fn request(code: &str) -> ExecuteRequest {
    let mut r = ExecuteRequest::new(
        new_execution_id(),
        Language::Python,
        code,
        RequestedLimits::new(30_000, 256),
    );
    r.tools = vec![
        tool("read_file", &["path"], &[]),
        tool("grep", &["content", "pattern"], &[]),
        tool("edit_file", &["path"], &["line", "new"]),
        tool("bash", &["command"], &["timeout"]),
    ];
    // The programs ask bash for up to 600 s themselves.
    r.tool_timeout_ms = Some(600_000);
    r
}

fn workspace() -> (tempfile::TempDir, Arc<Workspace>) {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().to_owned();
    let write = |rel: &str, text: &str| {
        let p = root.join(rel);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, text).unwrap();
    };
    write(
        "src/config.rs",
        "pub struct Config {\n    name: \"app\",\n    timezone = \"UTC\",\n}\n",
    );
    // 2000 lines of passing tests and three failures: the raw output the program filters.
    write(
        "run_tests.sh",
        "i=0; while [ $i -lt 2000 ]; do echo \"test t$i ... ok\"; i=$((i+1)); done\n\
         echo 'test parse ... FAILED' >&2; echo 'error: assertion failed' >&2; echo 'test io ... FAILED' >&2\n\
         echo 'note: noise' >&2; exit 101\n",
    );
    write(
        "config_test.sh",
        "grep -q 'America/New_York' src/config.rs && echo 'config_test ... ok'\n",
    );
    (dir, Arc::new(Workspace { root }))
}

async fn daemon(test: &str) -> Option<Daemon> {
    let binary = require_daemon(test)?;
    Some(Daemon::start(&binary, DaemonOpts::default()).await)
}

/// Output filtering: only the failures enter the return value, not 2000 lines of test output.
const OUTPUT_FILTERING: &str = r#"
# Instead of 47k tokens of test output entering context:
result = bash("sh run_tests.sh", timeout=120)
if result.exit_code == 0:
    return f"All {result.line_count} lines of test output passed."
else:
    # Only return the failures
    failures = [l for l in result.stderr.split('\n') if 'FAILED' in l or 'error' in l]
    return f"Tests failed ({result.exit_code}):\n" + '\n'.join(failures[:20])
"#;

/// Multi-step composition: read, find, edit, test in one execution.
const COMPOSITION: &str = r#"
config = read_file("src/config.rs")
matches = grep(config, r"timezone\s*=")
if not matches:
    return "No timezone field found in config.rs"

line_num = matches[0].line
edit_file("src/config.rs", line=line_num, new='    timezone: "America/New_York",')

test = bash("sh config_test.sh", timeout=60)
if test.exit_code == 0:
    return f"Fixed timezone on line {line_num}. Config tests pass."
else:
    return f"Fixed timezone on line {line_num}. Tests failed:\n{test.stderr[-500:]}"
"#;

/// Timeout control: the program picks each command's timeout.
const TIMEOUT_CONTROL: &str = r#"
# Agent knows builds take time
build = bash("sleep 0.2; echo built", timeout=600)  # 10 minutes is fine

# Agent knows grep should be instant
search = bash("sleep 30; grep -r 'TODO' src/", timeout=1)  # something's wrong if it takes longer
if search.timed_out:
    return "grep timed out — possible filesystem issue or enormous directory"
return build.stdout
"#;

#[tokio::test]
async fn the_seed_examples_run_against_a_handler() {
    let Some(d) = daemon("the_seed_examples_run_against_a_handler").await else {
        return;
    };
    let (dir, ws) = workspace();
    let pool = Pool::builder(d.url())
        .token(d.token.clone())
        .size(1)
        .build()
        .unwrap();

    // 1. Output filtering.
    let w = ws.clone();
    let r = pool
        .execute_with_tools(request(OUTPUT_FILTERING), move |call| {
            let w = w.clone();
            async move { w.handle(call).await }
        })
        .await
        .unwrap();
    assert!(r.success(), "{r:?}");
    assert_eq!(
        r.return_value,
        Some(json!(
            "Tests failed (101):\ntest parse ... FAILED\nerror: assertion failed\ntest io ... FAILED"
        )),
        "stderr: {}",
        r.stderr_text()
    );
    assert_eq!(r.tool_calls, Some(1));
    assert!(
        r.stdout.is_empty(),
        "the raw output never reaches the execution's output"
    );

    // 2. Multi-step composition.
    let w = ws.clone();
    let r = pool
        .execute_with_tools(request(COMPOSITION), move |call| {
            let w = w.clone();
            async move { w.handle(call).await }
        })
        .await
        .unwrap();
    assert_eq!(
        r.return_value,
        Some(json!("Fixed timezone on line 3. Config tests pass.")),
        "stderr: {}",
        r.stderr_text()
    );
    assert_eq!(r.tool_calls, Some(4));
    let config = std::fs::read_to_string(dir.path().join("src/config.rs")).unwrap();
    assert_eq!(
        config.lines().nth(2),
        Some("    timezone: \"America/New_York\",")
    );

    // 3. Timeout control, on a single connection.
    let conn = Connection::connect(ConnectOptions::new(d.url()).token(d.token.clone()))
        .await
        .unwrap();
    let started = Instant::now();
    let w = ws.clone();
    let r = conn
        .execute_with_tools(request(TIMEOUT_CONTROL), move |call| {
            let w = w.clone();
            async move { w.handle(call).await }
        })
        .await
        .unwrap();
    assert_eq!(
        r.return_value,
        Some(json!(
            "grep timed out — possible filesystem issue or enormous directory"
        )),
        "stderr: {}",
        r.stderr_text()
    );
    assert_eq!(r.tool_calls, Some(2));
    assert!(
        started.elapsed() < Duration::from_secs(15),
        "{:?}",
        started.elapsed()
    );
    drop(dir);
}

#[tokio::test]
async fn sandboxctl_serves_a_tool_with_a_local_command() {
    let Some(d) = daemon("sandboxctl_serves_a_tool_with_a_local_command").await else {
        return;
    };
    let out = tokio::process::Command::new(super::daemon::sandboxctl())
        .args([
            "exec",
            "-l",
            "python",
            "--tool",
            "upper=tr a-z A-Z",
            "--tool",
            "fail=exit 3",
        ])
        .args([
            "--code",
            "try:\n    fail()\nexcept ToolError as e:\n    print(e.code)\nupper({'word': 'hi'})",
        ])
        .args(["--token-file", "/nonexistent/token"])
        .env("SANDBOXD_URL", d.url())
        .env("SANDBOXD_TOKEN", &d.token)
        .output()
        .await
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{out:?}");
    assert_eq!(stdout, "tool_error\n{\"WORD\":\"HI\"}\n", "{out:?}");
}

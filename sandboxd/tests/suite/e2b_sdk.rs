//! The unchanged e2b SDKs as clients of the E2B facade (`e2b.listen`, docs/spec/e2b-compat.md): the Python SDK's
//! scenarios (tests/e2b/test_sdk.py, pytest) and the JavaScript SDK's (tests/e2b/sdk.mjs, node) against a fresh
//! daemon, configured by the environment alone as a user's program is (`E2B_API_KEY` = one of the daemon's tokens,
//! `E2B_API_URL` = `E2B_SANDBOX_URL` = the facade's listener); afterwards no sandbox is left (`GET /v2/sandboxes`
//! answers `[]`). The clients come from tests/e2b/setup.sh (pinned SDKs; `.ci/run` exports
//! `SANDBOXD_TEST_E2B_VENV` and `SANDBOXD_TEST_E2B_NODE`).

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::harness::*;

/// How long each client may run: pytest's 25 scenarios take a minute or two; a hung stream is cut by
/// pytest-timeout (120 s a test) well before this.
const CLIENT_DEADLINE: Duration = Duration::from_secs(20 * 60);

/// The SDK's venv setup.sh made, or `None` after saying why the test cannot run.
pub(super) fn venv(test: &str) -> Option<PathBuf> {
    test_support::e2b_venv(test)
}

/// The venv and node_modules directories setup.sh made, or `None` after saying why the test cannot run.
fn clients(test: &str) -> Option<(PathBuf, PathBuf)> {
    let venv = venv(test)?;
    let node = test_support::e2b_setup_path(test, "SANDBOXD_TEST_E2B_NODE")?;
    assert!(
        node.join("e2b").is_dir(),
        "SANDBOXD_TEST_E2B_NODE {}: no e2b package (tests/e2b/setup.sh installs it)",
        node.display()
    );
    Some((venv, node))
}

/// Waits (30 s at most) until the facade answers `GET /v2/sandboxes` with 200.
pub(super) async fn facade_up(port: u16, api_key: &str) {
    wait_until(
        "the facade to answer on its listener",
        Duration::from_secs(30),
        || async {
            match facade_get(port, "/v2/sandboxes", api_key).await? {
                (200, _) => Ok(()),
                other => Err(format!("GET /v2/sandboxes: {other:?}")),
            }
        },
    )
    .await;
}

/// `python -m pytest -x -q` of the venv on `files` (from the repository's root, as `run_client` runs it).
fn pytest(venv: &Path, files: &[&str]) -> tokio::process::Command {
    let mut pytest = tokio::process::Command::new(venv.join("bin/python"));
    pytest
        .args([
            "-m",
            "pytest",
            "-x",
            "-q",
            "--tb=short",
            "-p",
            "no:cacheprovider",
        ])
        .args(files)
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .env("PYTHONUNBUFFERED", "1");
    pytest
}

/// `GET path` on the facade with `X-API-KEY`: the status and the JSON body (chunked or not).
pub(super) async fn facade_get(
    port: u16,
    path: &str,
    api_key: &str,
) -> Result<(u16, Value), String> {
    let exchange = async {
        let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
        let req = format!(
            "GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nX-API-KEY: {api_key}\r\nConnection: close\r\n\r\n"
        );
        s.write_all(req.as_bytes()).await?;
        let mut out = Vec::new();
        s.read_to_end(&mut out).await?;
        Ok::<_, std::io::Error>(String::from_utf8_lossy(&out).into_owned())
    };
    let text = tokio::time::timeout(Duration::from_secs(10), exchange)
        .await
        .map_err(|_| format!("GET {path}: no answer within 10 s"))?
        .map_err(|e| format!("GET {path}: {e}"))?;
    let (head, body) = text
        .split_once("\r\n\r\n")
        .ok_or_else(|| format!("GET {path}: not an HTTP answer: {text:?}"))?;
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| format!("GET {path}: no status: {head:?}"))?;
    let body = if head
        .lines()
        .any(|l| l.eq_ignore_ascii_case("transfer-encoding: chunked"))
    {
        dechunk(body)
    } else {
        body.to_owned()
    };
    Ok((
        status,
        serde_json::from_str(&body).unwrap_or(Value::String(body)),
    ))
}

/// The payload of a chunked body.
fn dechunk(mut rest: &str) -> String {
    let mut out = String::new();
    while let Some((size, tail)) = rest.split_once("\r\n") {
        let n = usize::from_str_radix(size.split(';').next().unwrap_or("").trim(), 16).unwrap_or(0);
        if n == 0 || tail.len() < n {
            break;
        }
        out.push_str(&tail[..n]);
        rest = tail[n..].trim_start_matches("\r\n");
    }
    out
}

/// Runs a client from the repository's root with only the facade's environment for the SDK, prints its output,
/// and returns whether it succeeded and a summary for the assertion.
async fn run_client(
    what: &str,
    mut cmd: tokio::process::Command,
    port: u16,
    api_key: &str,
) -> (bool, String) {
    let url = format!("http://127.0.0.1:{port}");
    let repo = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the workspace root");
    // Nothing of the caller's SDK or proxy settings reaches the client: the three variables are all it gets.
    for var in [
        "E2B_DEBUG",
        "E2B_DOMAIN",
        "E2B_ACCESS_TOKEN",
        "E2B_HTTP_VERSION",
        "HTTP_PROXY",
        "HTTPS_PROXY",
        "ALL_PROXY",
        "http_proxy",
        "https_proxy",
        "all_proxy",
    ] {
        cmd.env_remove(var);
    }
    cmd.current_dir(repo)
        .env("E2B_API_KEY", api_key)
        .env("E2B_API_URL", &url)
        .env("E2B_SANDBOX_URL", &url)
        .env("NO_PROXY", "127.0.0.1,localhost")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    let started = std::time::Instant::now();
    let out = match tokio::time::timeout(CLIENT_DEADLINE, cmd.output()).await {
        Ok(Ok(out)) => out,
        Ok(Err(e)) => return (false, format!("{what}: cannot start: {e}")),
        Err(_) => {
            return (
                false,
                format!("{what}: still running after {CLIENT_DEADLINE:?} (killed)"),
            )
        }
    };
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    println!(
        "===== {what}: {} after {:.1} s\n{stdout}{}{stderr}===== end of {what}",
        out.status,
        started.elapsed().as_secs_f64(),
        if stderr.is_empty() {
            ""
        } else {
            "----- stderr\n"
        },
    );
    let tail: Vec<&str> = stdout.lines().chain(stderr.lines()).collect();
    let tail = tail[tail.len().saturating_sub(40)..].join("\n");
    (
        out.status.success(),
        format!("{what}: {}; last lines:\n{tail}", out.status),
    )
}

#[tokio::test]
async fn the_unchanged_e2b_sdks_drive_sandboxd_through_the_facade() {
    const TEST: &str = "the_unchanged_e2b_sdks_drive_sandboxd_through_the_facade";
    let Some(_g) = privileged(TEST).await else {
        return;
    };
    let Some((venv, node_modules)) = clients(TEST) else {
        return;
    };
    let port = free_port();
    let d = Daemon::start(DaemonOpts {
        extra_config: Some(
            json!({"e2b": {"listen": format!("127.0.0.1:{port}"), "max_upload_mb": 16}}),
        ),
        ..DaemonOpts::default()
    })
    .await;
    let api_key = d.token().to_owned();
    facade_up(port, &api_key).await;

    let pytest = pytest(
        &venv,
        &[
            "tests/e2b/test_sdk.py",
            "tests/e2b/test_code_interpreter.py",
        ],
    );
    let python = run_client(
        "pytest tests/e2b/test_sdk.py tests/e2b/test_code_interpreter.py",
        pytest,
        port,
        &api_key,
    )
    .await;

    let mut node = tokio::process::Command::new("node");
    node.arg("tests/e2b/sdk.mjs")
        .env("SANDBOXD_TEST_E2B_NODE", &node_modules)
        .env("NODE_PATH", &node_modules);
    let js = run_client("node tests/e2b/sdk.mjs", node, port, &api_key).await;

    // Every sandbox the clients made was killed (their finalizers), and the facade forgot it.
    let mut failures = Vec::new();
    for (ok, summary) in [python, js] {
        if !ok {
            failures.push(summary);
        }
    }
    match facade_get(port, "/v2/sandboxes", &api_key).await {
        Ok((200, left)) if left == json!([]) => {}
        other => failures.push(format!(
            "sandboxes left after the clients ended: GET /v2/sandboxes {other:?}"
        )),
    }
    // Nothing of them is left on the host: no cgroup leaf, scratch mount or process beyond the pool's, and no
    // sandbox directory.
    let e2b_dir = PathBuf::from(format!("/proc/{}/root", d.pid()))
        .join(d.state_dir.strip_prefix("/").unwrap_or(&d.state_dir))
        .join("e2b");
    let mut left = Err(String::new());
    for _ in 0..100 {
        left = d.leftovers().await.and_then(|()| {
            let dirs: Vec<_> = std::fs::read_dir(&e2b_dir)
                .map(|rd| rd.flatten().map(|e| e.path()).collect())
                .unwrap_or_default();
            match dirs.is_empty() {
                true => Ok(()),
                false => Err(format!("sandbox directories left: {dirs:?}")),
            }
        });
        if left.is_ok() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    if let Err(e) = left {
        failures.push(format!(
            "left on the host after every sandbox was killed: {e}"
        ));
    }
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

/// `e2b-code-interpreter` on the code-interpreter image (`images/build.sh code-interpreter`: numpy, pandas,
/// matplotlib; `SANDBOXD_TEST_CODE_IMAGE` names its layout, `.ci/run` sets it) as `e2b.code_interpreter_image`: a
/// DataFrame comes back as HTML and a matplotlib figure as a PNG that decodes.
#[tokio::test]
async fn the_code_interpreter_template_gives_rich_results() {
    const TEST: &str = "the_code_interpreter_template_gives_rich_results";
    let Some(_g) = privileged(TEST).await else {
        return;
    };
    let Some(venv) = venv(TEST) else {
        return;
    };
    let Some(layout) = std::env::var_os("SANDBOXD_TEST_CODE_IMAGE").filter(|v| !v.is_empty())
    else {
        return cannot_run(
            TEST,
            "SANDBOXD_TEST_CODE_IMAGE is not set (images/build.sh code-interpreter; then \
             SANDBOXD_TEST_CODE_IMAGE=images/out/code-interpreter/oci)",
        );
    };
    let layout = std::fs::canonicalize(layout).expect("SANDBOXD_TEST_CODE_IMAGE");
    let port = free_port();
    let d = Daemon::start(DaemonOpts {
        extra_config: Some(json!({
            "images": {"ci": {"layout": layout}},
            "languages": {
                "python": {"image": "ci", "command": ["/usr/bin/python3"]},
                "shell": {"image": "host", "command": ["/bin/sh"]},
            },
            "e2b": {"listen": format!("127.0.0.1:{port}"), "code_interpreter_image": "ci"},
        })),
        ..DaemonOpts::default()
    })
    .await;
    let api_key = d.token().to_owned();
    facade_up(port, &api_key).await;
    let pytest = pytest(&venv, &["tests/e2b/test_code_interpreter_data.py"]);
    let (ok, summary) = run_client(
        "pytest tests/e2b/test_code_interpreter_data.py",
        pytest,
        port,
        &api_key,
    )
    .await;
    assert!(ok, "{summary}");
    match facade_get(port, "/v2/sandboxes", &api_key).await {
        Ok((200, left)) if left == json!([]) => {}
        other => panic!("sandboxes left: {other:?}"),
    }
}

//! The `network` extension for agent sandboxes against a real daemon (`POST /sandboxes` with `network`, `POST
//! /sandboxes/<id>/network`, `network` in `GET /health`): each run's agent (python's urllib with the test CA)
//! reaches the listed origin through the sandbox's proxy and is refused the other one; a new list applies to the
//! next request without restarting the sandbox, while a tunnel opened before it stays open; entries beyond the
//! operator's bound are refused with a PluginError naming the field. The origins are [`super::egress_origin`]'s.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::{json, Value};

use super::egress_origin::{Origin, HTTPS_PORT};
use super::harness::*;
use super::images::agent_http;

/// The agent: one line per URL, `<tag> reached <url> <status> <body>` or `<tag> refused <url> <error>`.
const FETCH: &str = r#"
import os, ssl, sys, urllib.request
tag = sys.argv[1]
print(tag, "proxy", os.environ.get("HTTPS_PROXY"), flush=True)
ctx = ssl.create_default_context(cafile="/workspace/ca.pem")
for url in sys.argv[2:]:
    try:
        with urllib.request.urlopen(url, context=ctx, timeout=20) as r:
            print(tag, "reached", url, r.status, r.read().decode().strip(), flush=True)
    except Exception as e:
        print(tag, "refused", url, type(e).__name__, str(e)[:120], flush=True)
"#;

/// The agent that keeps a tunnel: one request through it, then (once `/workspace/go` exists) another on the same
/// tunnel and one on a new connection to the same host.
const KEEP: &str = r#"
import http.client, os, ssl, sys, time, urllib.request
host, port = sys.argv[1], int(sys.argv[2])
ctx = ssl.create_default_context(cafile="/workspace/ca.pem")
c = http.client.HTTPSConnection("127.0.0.1", 3128, context=ctx, timeout=20)
c.set_tunnel(host, port)
def get(tag):
    c.request("GET", "/hello")
    r = c.getresponse()
    print(tag, r.status, r.read().decode().strip(), flush=True)
get("keep first")
while not os.path.exists("/workspace/go"):
    time.sleep(0.05)
get("keep same-tunnel")
try:
    with urllib.request.urlopen("https://%s:%d/hello" % (host, port), context=ctx, timeout=20) as r:
        print("keep new-connection reached", r.status, flush=True)
except Exception as e:
    print("keep new-connection refused", type(e).__name__, str(e)[:120], flush=True)
"#;

/// The agent that fetches the origin every 100 ms until `/workspace/stop` exists, one line a fetch: `loop reached`,
/// or `loop refused` with the error (a 403 once the byte limit is used up; refused connections while no daemon
/// runs).
const LOOP: &str = r#"
import os, ssl, sys, time, urllib.request
ctx = ssl.create_default_context(cafile="/workspace/ca.pem")
while not os.path.exists("/workspace/stop"):
    try:
        with urllib.request.urlopen(sys.argv[1], context=ctx, timeout=5) as r:
            r.read()
            print("loop reached", r.status, flush=True)
    except Exception as e:
        print("loop refused", type(e).__name__, str(e)[:120], flush=True)
    time.sleep(0.1)
"#;

fn url(host: &str) -> String {
    format!("https://{host}:{HTTPS_PORT}/hello")
}

fn entry(host: &str) -> String {
    format!("{host}:{HTTPS_PORT}")
}

/// `POST /sandboxes` on the host image with the agent and the CA as template files, and `network` if given.
async fn create(d: &Daemon, origin: &Origin, network: Option<Value>) -> (u16, Value) {
    let mut body = json!({
        "workspaceRequirements": {"resourceLimits": {"memoryMb": 256, "diskMb": 32}},
        "bootstrap": {"backendUrl": "http://127.0.0.1:9", "backendToken": "t", "agentId": "a",
                      "tokenExpiresAt": "2099-01-01T00:00:00Z",
                      "artifactUploadEndpoint": "http://127.0.0.1:9/api/artifacts"},
        "template": {"files": [
            {"path": "ca.pem", "content": origin.ca_pem},
            {"path": "fetch.py", "content": FETCH},
            {"path": "keep.py", "content": KEEP},
            {"path": "loop.py", "content": LOOP},
        ]},
    });
    if let Some(n) = network {
        body["network"] = n;
    }
    agent_http(d, "POST", "/sandboxes", &body).await
}

/// Runs the agent once in sandbox `id` (a new run, the sandbox unchanged) and returns the lines it printed.
async fn fetch_run(d: &Daemon, id: &str, tag: &str) -> Vec<String> {
    let command = json!([
        "/usr/bin/python3",
        "/workspace/fetch.py",
        tag,
        url("origin.test"),
        url("denied.test")
    ]);
    spawn(d, id, command).await;
    run_ended(d, id).await;
    log_lines(d, id, tag)
}

/// `POST /spawn` with `command`.
async fn spawn(d: &Daemon, id: &str, command: Value) {
    let (status, h) = agent_http(
        d,
        "POST",
        &format!("/sandboxes/{id}/spawn"),
        &json!({"agentId": "a", "providerConfig": {"command": command}}),
    )
    .await;
    assert_eq!(status, 200, "{h}");
}

/// Waits until the run has ended, and checks it exited with status 0.
async fn run_ended(d: &Daemon, id: &str) {
    let health = wait_until(
        "the agent's run to end",
        Duration::from_secs(60),
        || async {
            let (_, h) = agent_http(d, "GET", &format!("/sandboxes/{id}/health"), &json!({})).await;
            match h["agentStatus"].as_str() {
                Some("running") => Err(format!("still running: {h}")),
                _ => Ok(h),
            }
        },
    )
    .await;
    assert_eq!(health["agentStatus"], "completed", "{health}");
}

/// `rel` in the sandbox's directory as the test sees it: its tmpfs is mounted in the daemon's mount namespace.
fn sandbox_path(d: &Daemon, id: &str, rel: &str) -> PathBuf {
    Path::new(&format!("/proc/{}/root", d.pid()))
        .join(d.state_dir.strip_prefix("/").unwrap_or(&d.state_dir))
        .join("agents")
        .join(id)
        .join(rel)
}

/// The lines of the agent's log that start with `tag`.
fn log_lines(d: &Daemon, id: &str, tag: &str) -> Vec<String> {
    let log = std::fs::read_to_string(sandbox_path(d, id, "scratch/agent.log")).unwrap_or_default();
    log.lines()
        .filter(|l| l.starts_with(&format!("{tag} ")))
        .map(str::to_owned)
        .collect()
}

fn has(lines: &[String], line: &str) -> bool {
    lines.iter().any(|l| l.starts_with(line))
}

async fn health_network(d: &Daemon, id: &str) -> Value {
    let (status, h) = agent_http(d, "GET", &format!("/sandboxes/{id}/health"), &json!({})).await;
    assert_eq!(status, 200, "{h}");
    h["network"].clone()
}

#[tokio::test(flavor = "multi_thread")]
async fn an_agent_sandbox_reaches_its_list_and_the_list_changes_while_it_lives() {
    let Some(_g) =
        privileged("an_agent_sandbox_reaches_its_list_and_the_list_changes_while_it_lives").await
    else {
        return;
    };
    let origin = Origin::start().await;
    let d = origin
        .daemon(64 << 20, json!({"agents": {"max_sandboxes": 2}}))
        .await;
    let (status, created) =
        create(&d, &origin, Some(json!({"allow": [entry("origin.test")]}))).await;
    assert_eq!(status, 201, "{created}");
    let id = created["id"].as_str().unwrap().to_owned();

    let first = fetch_run(&d, &id, "run1").await;
    let origin_url = url("origin.test");
    let denied_url = url("denied.test");
    assert!(
        has(&first, "run1 proxy http://127.0.0.1:3128"),
        "{first:#?}\n{}",
        d.log()
    );
    assert!(
        has(
            &first,
            &format!("run1 reached {origin_url} 200 hello from origin")
        ),
        "{first:#?}"
    );
    assert!(
        has(&first, &format!("run1 refused {denied_url}")),
        "{first:#?}"
    );
    let net = health_network(&d, &id).await;
    assert_eq!(net["allow"], json!([entry("origin.test")]), "{net}");
    assert_eq!(net["upstream_connections"], 1, "{net}");
    assert_eq!(net["refused"], 1, "{net}");
    assert!(net["connections"].as_u64().unwrap() >= 2, "{net}");
    assert!(net["bytes_received"].as_u64().unwrap() > 100, "{net}");
    assert!(net["bytes_sent"].as_u64().unwrap() > 100, "{net}");

    // A new list for the same sandbox: the next run's requests use it.
    let path = format!("/sandboxes/{id}/network");
    let (status, answer) =
        agent_http(&d, "POST", &path, &json!({"allow": [entry("denied.test")]})).await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer, json!({"allow": [entry("denied.test")]}));
    let second = fetch_run(&d, &id, "run2").await;
    assert!(
        has(&second, &format!("run2 refused {origin_url}")),
        "{second:#?}"
    );
    assert!(
        has(
            &second,
            &format!("run2 reached {denied_url} 200 hello from origin")
        ),
        "{second:#?}"
    );
    let net = health_network(&d, &id).await;
    assert_eq!(net["allow"], json!([entry("denied.test")]), "{net}");
    // The counters are the sandbox's: both runs.
    assert_eq!(net["upstream_connections"], 2, "{net}");
    assert_eq!(net["refused"], 2, "{net}");
    let seen = origin.seen();
    assert_eq!(
        seen,
        vec![
            format!("origin.test:{HTTPS_PORT}/hello"),
            format!("denied.test:{HTTPS_PORT}/hello")
        ],
        "each origin reached once, in the run that listed it"
    );

    // Entries beyond the bound or malformed: 400 naming the field, and the list in force stays.
    for bad in [
        json!(["example.com:443"]),
        json!(["*.test"]),
        json!(["10.0.0.1:8443"]),
    ] {
        let (status, e) = agent_http(&d, "POST", &path, &json!({"allow": bad})).await;
        assert_eq!(status, 400, "{bad}: {e}");
        assert_eq!(e["code"], "invalid_state", "{e}");
        assert!(
            e["message"].as_str().unwrap().contains("network.allow"),
            "{e}"
        );
    }
    let (status, e) = agent_http(&d, "POST", &path, &json!({"allow": [], "extra": 1})).await;
    assert_eq!(status, 400, "{e}");
    assert_eq!(
        health_network(&d, &id).await["allow"],
        json!([entry("denied.test")])
    );
    let (status, _) = agent_http(
        &d,
        "POST",
        "/sandboxes/ags-nope/network",
        &json!({"allow": []}),
    )
    .await;
    assert_eq!(status, 404);

    let (status, _) = agent_http(&d, "DELETE", &format!("/sandboxes/{id}"), &json!({})).await;
    assert_eq!(status, 204);
    wait_until(
        "nothing of the sandbox left",
        Duration::from_secs(20),
        || d.leftovers(),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn sandbox_network_requests_the_daemon_cannot_grant_are_refused() {
    let Some(_g) = privileged("sandbox_network_requests_the_daemon_cannot_grant_are_refused").await
    else {
        return;
    };
    let origin = Origin::start().await;
    let d = origin
        .daemon(1 << 20, json!({"agents": {"max_sandboxes": 2}}))
        .await;
    for (network, field) in [
        (json!({"allow": ["pypi.org:443"]}), "network.allow"),
        (json!({"allow": ["origin.test"]}), "network.allow"),
        (
            json!({"allow": [entry("origin.test")], "egress_bytes": 2 << 20}),
            "network.egress_bytes",
        ),
    ] {
        let (status, e) = create(&d, &origin, Some(network.clone())).await;
        assert_eq!(status, 400, "{network}: {e}");
        assert!(
            e["message"].as_str().unwrap().contains(field),
            "{network}: {e}"
        );
    }
    // Without network: no proxy, no `network` in health, and no list to change (409).
    let (status, created) = create(&d, &origin, None).await;
    assert_eq!(status, 201, "{created}");
    let id = created["id"].as_str().unwrap().to_owned();
    assert_eq!(health_network(&d, &id).await, Value::Null);
    let (status, e) = agent_http(
        &d,
        "POST",
        &format!("/sandboxes/{id}/network"),
        &json!({"allow": [entry("origin.test")]}),
    )
    .await;
    assert_eq!(status, 409, "{e}");
    assert!(
        e["message"].as_str().unwrap().contains("without network"),
        "{e}"
    );
    let lines = fetch_run(&d, &id, "bare").await;
    assert!(has(&lines, "bare proxy None"), "{lines:#?}");
    assert!(
        has(&lines, &format!("bare refused {}", url("origin.test"))),
        "{lines:#?}"
    );
    let (status, _) = agent_http(&d, "DELETE", &format!("/sandboxes/{id}"), &json!({})).await;
    assert_eq!(status, 204);
    drop(d);

    // A daemon without the extension refuses `network`, naming the setting.
    let d = Daemon::start(DaemonOpts {
        extra_config: Some(json!({"agents": {"max_sandboxes": 2}})),
        ..DaemonOpts::default()
    })
    .await;
    let (status, e) = create(&d, &origin, Some(json!({"allow": [entry("origin.test")]}))).await;
    assert_eq!(status, 400, "{e}");
    assert!(
        e["message"].as_str().unwrap().contains("network.enabled"),
        "{e}"
    );
    assert!(origin.seen().is_empty(), "{:?}", origin.seen());
}

/// A tunnel opened before the list changes stays open (its next request goes through), while a new connection to
/// the same host, after the change, is refused.
#[tokio::test(flavor = "multi_thread")]
async fn a_tunnel_open_before_the_list_changes_stays_open() {
    let Some(_g) = privileged("a_tunnel_open_before_the_list_changes_stays_open").await else {
        return;
    };
    let origin = Origin::start().await;
    let d = origin
        .daemon(64 << 20, json!({"agents": {"max_sandboxes": 2}}))
        .await;
    let network = json!({"allow": [entry("origin.test")]});
    let (status, created) = create(&d, &origin, Some(network)).await;
    assert_eq!(status, 201, "{created}");
    let id = created["id"].as_str().unwrap().to_owned();
    let port = HTTPS_PORT.to_string();
    spawn(
        &d,
        &id,
        json!([
            "/usr/bin/python3",
            "/workspace/keep.py",
            "origin.test",
            port
        ]),
    )
    .await;
    wait_until(
        "the first request through the tunnel",
        Duration::from_secs(30),
        || async {
            let lines = log_lines(&d, &id, "keep");
            has(&lines, "keep first 200")
                .then_some(())
                .ok_or(format!("{lines:?}"))
        },
    )
    .await;

    let path = format!("/sandboxes/{id}/network");
    let (status, answer) =
        agent_http(&d, "POST", &path, &json!({"allow": [entry("denied.test")]})).await;
    assert_eq!(status, 200, "{answer}");
    std::fs::write(sandbox_path(&d, &id, "scratch/workspace/go"), b"").unwrap();
    run_ended(&d, &id).await;
    let lines = log_lines(&d, &id, "keep");
    assert!(
        has(&lines, "keep same-tunnel 200 hello from origin"),
        "{lines:#?}"
    );
    assert!(has(&lines, "keep new-connection refused"), "{lines:#?}");
    let net = health_network(&d, &id).await;
    assert_eq!(net["upstream_connections"], 1, "{net}");
    assert_eq!(net["refused"], 1, "{net}");
    let (status, _) = agent_http(&d, "DELETE", &format!("/sandboxes/{id}"), &json!({})).await;
    assert_eq!(status, 204);
}

/// Counts the looping agent's lines: (fetches that reached the origin, refused with a 403, any line at all).
fn loop_counts(d: &Daemon, id: &str) -> (usize, usize, usize) {
    let lines = log_lines(d, id, "loop");
    let reached = lines
        .iter()
        .filter(|l| l.starts_with("loop reached"))
        .count();
    let forbidden = lines.iter().filter(|l| l.contains("403")).count();
    (reached, forbidden, lines.len())
}

/// Starts the looping agent in sandbox `id`.
async fn start_loop(d: &Daemon, id: &str) {
    let command = json!(["/usr/bin/python3", "/workspace/loop.py", url("origin.test")]);
    spawn(d, id, command).await;
}

/// Waits until the looping agent in `id` has used up its byte limit (a 403 after its last reach), and returns how
/// many fetches reached the origin.
async fn loop_until_used_up(d: &Daemon, id: &str) -> usize {
    wait_until(
        "the byte limit to be used up",
        Duration::from_secs(60),
        || async {
            match loop_counts(d, id) {
                (reached, forbidden, _) if forbidden > 0 => Ok(reached),
                c => Err(format!("{c:?}: {:?}", log_lines(d, id, "loop"))),
            }
        },
    )
    .await
}

/// Live restore of a sandbox created with `network`: SIGKILLed under a working agent, the daemon's next start takes
/// it back with its egress proxy served again in the agent's network namespace, the allowlist in force, and the
/// byte limit counting what the killed daemon had reserved. The agent, whose fetches reach the origin again after
/// the restart, then reaches it no more often in all than an agent of the same limit that never saw a restart
/// (without the kept reservation, the restart would have given it a whole limit again).
#[tokio::test(flavor = "multi_thread")]
async fn a_sandbox_with_network_is_taken_back_with_its_list_and_what_is_left_of_its_limit() {
    let Some(_g) = privileged(
        "a_sandbox_with_network_is_taken_back_with_its_list_and_what_is_left_of_its_limit",
    )
    .await
    else {
        return;
    };
    let origin = Origin::start().await;
    let mut d = origin
        .daemon(
            64 << 20,
            json!({"agents": {"max_sandboxes": 2, "live_restore": true}}),
        )
        .await;
    let network = json!({"allow": [entry("origin.test")], "egress_bytes": 48 << 10});
    let (status, a) = create(&d, &origin, Some(network.clone())).await;
    assert_eq!(status, 201, "{a}");
    let a = a["id"].as_str().unwrap().to_owned();
    start_loop(&d, &a).await;
    let before = wait_until("three fetches", Duration::from_secs(60), || async {
        match loop_counts(&d, &a) {
            (reached, 0, _) if reached >= 3 => Ok(reached),
            c => Err(format!("{c:?}: {:?}", log_lines(&d, &a, "loop"))),
        }
    })
    .await;
    d.kill_hard();
    // The agent runs on while no daemon serves its proxy (its fetches are refused).
    tokio::time::sleep(Duration::from_millis(500)).await;
    d.restart().await;
    let log = d.log();
    assert!(log.contains("taken back (running)"), "{log}");
    let reached = loop_until_used_up(&d, &a).await;
    assert!(
        reached > before,
        "the proxy serves again after the restart: {:?}",
        log_lines(&d, &a, "loop")
    );
    let health = health_network(&d, &a).await;
    assert_eq!(health["allow"], json!([entry("origin.test")]), "{health}");
    // The same limit, no restart.
    let (status, b) = create(&d, &origin, Some(network)).await;
    assert_eq!(status, 201, "{b}");
    let b = b["id"].as_str().unwrap().to_owned();
    start_loop(&d, &b).await;
    let whole = loop_until_used_up(&d, &b).await;
    eprintln!("fetches: {before} before the restart, {reached} in all; {whole} with no restart");
    assert!(
        reached <= whole + 1,
        "{reached} fetches across the restart, {whole} within one limit ({before} before the restart)"
    );
    for id in [&a, &b] {
        let (status, _) = agent_http(&d, "DELETE", &format!("/sandboxes/{id}"), &json!({})).await;
        assert_eq!(status, 204);
    }
}

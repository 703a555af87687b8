//! Agent sandboxes through the gateway client against a real daemon: a scripted fake agent
//! (`tests/agents/fake_agent.py`, run with the host's python3 inside the sandbox) drives every endpoint; crash
//! detection after `kill -9`, replay after a forced WebSocket drop, pause measured from the cgroup, 100 sandboxes
//! leaving nothing behind, bad input, daemon restart, and `sandboxctl sandbox`.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use agent_api::{
    AdapterEvent, AgentBrief, AgentHandle, AgentStatus, ContextInjection, CreateSandboxRequest,
    HealthStatus, InjectionFormat, InjectionPriority, KillRequest, PluginError,
    SerializedAgentState, SerializedBy,
};
use client::gateway::{EventStream, Gateway, GatewayError, SandboxClient};
use serde_json::{json, Map, Value};
use sha2::Digest;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::daemon::{processes_with_uid, require_daemon, sandboxctl, Daemon, DaemonOpts};

const FAKE_AGENT: &str = include_str!("../agents/fake_agent.py");
const SECRET: &str = "sekrit-backend-token-4711";

/// One request the fake backend received.
#[derive(Debug, Clone)]
pub(super) struct Seen {
    pub(super) path: String,
    auth: String,
    body: Vec<u8>,
}

/// A fake backend: `POST /api/artifacts` answers a `backendUri`, `POST /api/token/renew` a new token.
pub(super) struct Backend {
    pub(super) port: u16,
    seen: Arc<Mutex<Vec<Seen>>>,
}

impl Backend {
    pub(super) async fn start() -> Backend {
        Self::start_refusing(None).await
    }

    /// A backend whose `/api/artifacts` answers 401 to `Bearer <refused>`.
    async fn start_refusing(refused: Option<&str>) -> Backend {
        let refused = refused.map(|t| format!("Bearer {t}"));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let seen2 = seen.clone();
        tokio::spawn(async move {
            let mut n = 0u64;
            loop {
                let Ok((mut s, _)) = listener.accept().await else {
                    return;
                };
                n += 1;
                let seen = seen2.clone();
                let refused = refused.clone();
                tokio::spawn(async move {
                    let mut buf = Vec::new();
                    let mut chunk = [0u8; 65536];
                    let head_end = loop {
                        let k = s.read(&mut chunk).await.unwrap_or(0);
                        if k == 0 {
                            return;
                        }
                        buf.extend_from_slice(&chunk[..k]);
                        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                            break i + 4;
                        }
                    };
                    let head = String::from_utf8_lossy(&buf[..head_end]).to_string();
                    let header = |name: &str| {
                        head.lines()
                            .find_map(|l| {
                                let (k, v) = l.split_once(':')?;
                                k.eq_ignore_ascii_case(name).then(|| v.trim().to_owned())
                            })
                            .unwrap_or_default()
                    };
                    let len: usize = header("content-length").parse().unwrap_or(0);
                    while buf.len() < head_end + len {
                        let k = s.read(&mut chunk).await.unwrap_or(0);
                        if k == 0 {
                            break;
                        }
                        buf.extend_from_slice(&chunk[..k]);
                    }
                    let path = head.split_whitespace().nth(1).unwrap_or("").to_owned();
                    let body = buf[head_end..].to_vec();
                    let answer = if path == "/api/token/renew" {
                        let exp = time::OffsetDateTime::now_utc() + time::Duration::seconds(3600);
                        json!({"backendToken": format!("renewed-token-{n}"),
                               "tokenExpiresAt": exp.format(&time::format_description::well_known::Rfc3339).unwrap()})
                    } else {
                        json!({"backendUri": format!("artifact://project/agent/{n}"), "version": n,
                               "storedAt": "2026-01-01T00:00:00Z", "sizeBytes": len})
                    };
                    let auth = header("authorization");
                    let status = if path == "/api/artifacts" && Some(&auth) == refused.as_ref() {
                        "401 Unauthorized"
                    } else {
                        "200 OK"
                    };
                    seen.lock().unwrap().push(Seen { path, auth, body });
                    let text = answer.to_string();
                    let resp = format!(
                        "HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{text}",
                        text.len()
                    );
                    let _ = s.write_all(resp.as_bytes()).await;
                });
            }
        });
        Backend { port, seen }
    }

    pub(super) fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }
}

fn expires_in(secs: i64) -> String {
    (time::OffsetDateTime::now_utc() + time::Duration::seconds(secs))
        .format(&time::format_description::well_known::Rfc3339)
        .unwrap()
}

pub(super) fn create_request(backend_port: u16, token_ttl_s: i64) -> CreateSandboxRequest {
    serde_json::from_value(json!({
        "workspaceRequirements": {
            "mounts": [], "capabilities": ["terminal", "network_internal_only"],
            "resourceLimits": {"cpuCores": 1, "memoryMb": 256, "diskMb": 64, "timeoutMs": 600000}
        },
        "bootstrap": {
            "backendUrl": format!("http://127.0.0.1:{backend_port}"),
            "backendToken": SECRET,
            "tokenExpiresAt": expires_in(token_ttl_s),
            "agentId": "agent-1",
            "artifactUploadEndpoint": format!("http://127.0.0.1:{backend_port}/api/artifacts"),
        },
        "template": {
            "command": ["/usr/bin/python3", "/workspace/fake_agent.py"],
            "files": [{"path": "fake_agent.py", "content": FAKE_AGENT}],
        }
    }))
    .unwrap()
}

pub(super) fn brief(script: Value) -> AgentBrief {
    serde_json::from_value(json!({
        "agentId": "agent-1", "role": "Test Agent", "workstream": "w",
        "providerConfig": {"script": script}
    }))
    .unwrap()
}

/// Reads events until one matches, within `deadline`; returns everything read.
pub(super) async fn until(
    events: &mut EventStream,
    what: &str,
    deadline: Duration,
    pred: impl Fn(&AdapterEvent) -> bool,
) -> Vec<AdapterEvent> {
    let mut seen = Vec::new();
    let end = Instant::now() + deadline;
    loop {
        let left = end.saturating_duration_since(Instant::now());
        let e = match tokio::time::timeout(left, events.next()).await {
            Ok(Ok(e)) => e,
            Ok(Err(e)) => panic!("event stream failed waiting for {what}: {e}"),
            Err(_) => panic!("no {what} within {deadline:?}; saw {seen:#?}"),
        };
        let hit = pred(&e);
        seen.push(e);
        if hit {
            return seen;
        }
    }
}

fn action(e: &AdapterEvent) -> Option<&str> {
    e.event.get("action").and_then(Value::as_str)
}

fn is(e: &AdapterEvent, ty: &str) -> bool {
    e.event["type"] == ty
}

pub(super) fn status_contains(e: &AdapterEvent, text: &str) -> bool {
    is(e, "status")
        && e.event["message"]
            .as_str()
            .is_some_and(|m| m.contains(text))
}

pub(super) fn plugin_err(r: Result<impl std::fmt::Debug, GatewayError>) -> (u16, PluginError) {
    match r {
        Err(GatewayError::Plugin { status, error }) => (status, error),
        other => panic!("expected a PluginError, got {other:?}"),
    }
}

/// [`start`], a backend, and one sandbox created against it (an hour's lifetime).
pub(super) async fn start_with_sandbox() -> Option<(Daemon, Gateway, Backend, SandboxClient)> {
    let (d, gw) = start().await?;
    let backend = Backend::start().await;
    let sb = gw
        .create(&create_request(backend.port, 3600))
        .await
        .unwrap();
    Some((d, gw, backend, sb))
}

pub(super) async fn start() -> Option<(Daemon, Gateway)> {
    let bin = require_daemon("agent sandboxes")?;
    let d = Daemon::start(&bin, DaemonOpts::default()).await;
    let gw = Gateway::new(&d.http_base(), &d.token);
    Some((d, gw))
}

/// Cgroup leaves of a daemon, in every hierarchy.
fn cgroup_leaves(parent: &str) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for h in std::fs::read_dir("/sys/fs/cgroup").unwrap().flatten() {
        if let Ok(rd) = std::fs::read_dir(h.path().join(parent)) {
            out.extend(
                rd.flatten()
                    .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
                    .map(|e| e.path()),
            );
        }
    }
    out
}

/// Mounts of the daemon's mount namespace under `dir`.
pub(super) fn mounts_under(pid: i32, dir: &Path) -> Vec<String> {
    let info = std::fs::read_to_string(format!("/proc/{pid}/mountinfo")).unwrap_or_default();
    let d = dir.display().to_string();
    info.lines()
        .filter(|l| l.contains(&d))
        .map(str::to_owned)
        .collect()
}

/// Processes in a sandbox's container cgroup (pids hierarchy on v1, the leaf on v2).
pub(super) fn container_pids(parent: &str, cid: &str) -> Vec<i32> {
    for p in [
        format!("/sys/fs/cgroup/pids/{parent}/{cid}/cgroup.procs"),
        format!("/sys/fs/cgroup/{parent}/{cid}/cgroup.procs"),
    ] {
        if let Ok(s) = std::fs::read_to_string(&p) {
            return s.lines().filter_map(|l| l.trim().parse().ok()).collect();
        }
    }
    Vec::new()
}

/// CPU time of a container's cgroup, ns (v1 cpuacct.usage, v2 cpu.stat usage_usec).
fn cpu_ns(parent: &str, cid: &str) -> u64 {
    if let Ok(s) = std::fs::read_to_string(format!(
        "/sys/fs/cgroup/cpuacct/{parent}/{cid}/cpuacct.usage"
    )) {
        return s.trim().parse().unwrap();
    }
    let stat = std::fs::read_to_string(format!("/sys/fs/cgroup/{parent}/{cid}/cpu.stat"))
        .expect("no cpuacct.usage nor cpu.stat for the container");
    stat.lines()
        .find_map(|l| l.strip_prefix("usage_usec "))
        .map(|v| v.trim().parse::<u64>().unwrap() * 1000)
        .unwrap()
}

/// The fake agent's script for `every_endpoint_through_the_client`: a report written and announced as an artifact, a
/// decision asked for, then a wait for each command so that its echo shows it reached the agent.
const EVERY_ENDPOINT_SCRIPT: &str = r##"[
    {"write": {"path": "out/report.md", "content": "# Report\n"}},
    {"artifact": {"path": "out/report.md", "artifactId": "art-1"}},
    {"emit": {"type": "decision", "subtype": "tool_approval", "decisionId": "d1",
              "toolName": "rm", "toolArgs": {"path": "/"}}},
    {"wait": "resolve"},
    {"wait": "inject_context"},
    {"wait": "update_brief"}
]"##;

/// Every endpoint, driven by the fake agent's script.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_endpoint_through_the_client() {
    let Some((d, gw)) = start().await else { return };
    let backend = Backend::start().await;
    // A 3 s token: renewal is due 2.4 s after creation.
    let sb = gw.create(&create_request(backend.port, 3)).await.unwrap();
    let created = Instant::now();
    transport_points_at_the_sandbox(&sb);
    let mut events = sb.events(0);
    let h = spawn_runs_one_agent_at_a_time(&sb).await;
    let seen = events_up_to_the_decision(&mut events, &h).await;
    let run_id = seen[0].run_id.clone();
    artifact_is_uploaded_and_its_uri_rewritten(&seen, &backend);
    events_are_numbered_in_one_run(&seen, &run_id);
    health_waits_on_the_human(&sb).await;
    resolve_answers_the_open_decision_once(&sb, &mut events).await;
    inject_and_update_reach_the_agent(&sb, &mut events).await;
    pause_and_resume_keep_the_updated_brief(&sb, &mut events).await;
    token_is_renewed_at_80_percent_with_the_old_token(&backend, created).await;
    replay_repeats_the_delivered_events(&sb, &seen[0]).await;
    let st = kill_with_grace_returns_the_agents_state(&sb, &mut events).await;
    resume_from_the_stored_state_is_a_new_run(&sb, &mut events, &st, &run_id).await;
    sb.kill(&KillRequest {
        grace: false,
        grace_timeout_ms: None,
    })
    .await
    .unwrap();

    gw.delete(sb.id()).await.unwrap();
    assert_eq!(plugin_err(sb.health().await).0, 404);
    assert!(
        !d.log().contains(SECRET),
        "the backend token reached the log"
    );
    assert!(
        !d.log().contains("renewed-token"),
        "a renewed token reached the log"
    );
}

/// The RPC endpoint names the sandbox; events come over a WebSocket.
fn transport_points_at_the_sandbox(sb: &SandboxClient) {
    assert!(sb
        .transport
        .rpc_endpoint
        .ends_with(&format!("/sandboxes/{}", sb.id())));
    assert!(sb.transport.event_stream_endpoint.starts_with("ws://"));
}

/// Spawns the scripted agent; a second spawn while one runs is refused with the handle.
async fn spawn_runs_one_agent_at_a_time(sb: &SandboxClient) -> AgentHandle {
    let script = serde_json::from_str(EVERY_ENDPOINT_SCRIPT).unwrap();
    let h = sb.spawn(&brief(script)).await.unwrap();
    assert_eq!(h.status, AgentStatus::Running);
    assert_eq!(h.plugin_name, "sandboxd");
    let (status, e) = plugin_err(sb.spawn(&brief(json!([]))).await);
    assert_eq!(status, 409);
    assert!(
        matches!(
            e,
            PluginError::InvalidState {
                handle: Some(_),
                ..
            }
        ),
        "{e:?}"
    );
    h
}

/// Reads up to the agent's decision: the run starts with `started`, and its id is the handle's session.
async fn events_up_to_the_decision(events: &mut EventStream, h: &AgentHandle) -> Vec<AdapterEvent> {
    let seen = until(events, "the decision", Duration::from_secs(20), |e| {
        is(e, "decision")
    })
    .await;
    assert!(
        is(&seen[0], "lifecycle") && action(&seen[0]) == Some("started"),
        "{seen:?}"
    );
    assert_eq!(seen[0].run_id, h.session_id);
    seen
}

/// The artifact event carries the backend's URI instead of the sandbox path, the content's hash and size and its
/// source path; the backend got the content with the bootstrap token.
fn artifact_is_uploaded_and_its_uri_rewritten(seen: &[AdapterEvent], backend: &Backend) {
    let artifact = seen
        .iter()
        .find(|e| is(e, "artifact"))
        .expect("artifact event");
    let uri = artifact.event["uri"].as_str().unwrap();
    assert!(
        uri.starts_with("artifact://project/agent/"),
        "uri not rewritten: {uri}"
    );
    let hash = format!("{:x}", sha2::Sha256::digest(b"# Report\n"));
    assert_eq!(artifact.event["contentHash"], hash.as_str());
    assert_eq!(artifact.event["sizeBytes"], 9);
    assert_eq!(
        artifact.event["provenance"]["sourcePath"],
        "/workspace/out/report.md"
    );
    let upload = backend
        .seen()
        .into_iter()
        .find(|s| s.path == "/api/artifacts")
        .expect("an upload");
    assert_eq!(upload.body, b"# Report\n");
    assert_eq!(upload.auth, format!("Bearer {SECRET}"));
}

/// Sequences count from 1 without a gap, event ids are UUIDv7, and every event belongs to the run.
fn events_are_numbered_in_one_run(seen: &[AdapterEvent], run_id: &str) {
    for (i, e) in seen.iter().enumerate() {
        assert_eq!(e.source_sequence, i as u64 + 1);
        assert_eq!(uuid_version(&e.source_event_id), 7);
        assert_eq!(e.run_id, run_id);
    }
}

/// With a decision open the agent waits on a human, healthy and using memory.
async fn health_waits_on_the_human(sb: &SandboxClient) {
    let h = sb.health().await.unwrap();
    assert_eq!(h.agent_status, AgentStatus::WaitingOnHuman);
    assert_eq!(h.status, HealthStatus::Healthy);
    assert!(h.resource_usage.memory_mb > 0.0, "{h:?}");
}

/// An unknown decision is not found; the open one is resolved, echoed by the agent, and then gone.
async fn resolve_answers_the_open_decision_once(sb: &SandboxClient, events: &mut EventStream) {
    let (status, e) = plugin_err(sb.resolve("nope", Map::new()).await);
    assert_eq!(
        (status, e),
        (
            404,
            PluginError::DecisionNotFound {
                decision_id: "nope".into()
            }
        )
    );
    let mut resolution = Map::new();
    resolution.insert("resolutionType".into(), "approve".into());
    resolution.insert("rationale".into(), "ok".into());
    resolution.insert("actionKind".into(), "delete".into());
    sb.resolve("d1", resolution).await.unwrap();
    until(events, "the resolve echo", Duration::from_secs(10), |e| {
        status_contains(e, "\"decisionId\": \"d1\"") && status_contains(e, "\"type\": \"resolve\"")
    })
    .await;
    // The decision is gone: resolving it again is stale.
    assert_eq!(plugin_err(sb.resolve("d1", Map::new()).await).0, 404);
}

/// A context injection and a brief update both reach the agent, which echoes them.
async fn inject_and_update_reach_the_agent(sb: &SandboxClient, events: &mut EventStream) {
    sb.inject_context(&ContextInjection {
        content: "new facts".into(),
        format: InjectionFormat::Markdown,
        snapshot_version: 3,
        estimated_tokens: 10,
        priority: InjectionPriority::Required,
    })
    .await
    .unwrap();
    until(events, "the inject echo", Duration::from_secs(10), |e| {
        status_contains(e, "new facts")
    })
    .await;
    let mut changes = Map::new();
    changes.insert("constraints".into(), json!(["be brief"]));
    sb.update_brief(changes).await.unwrap();
    until(events, "the update echo", Duration::from_secs(10), |e| {
        status_contains(e, "be brief")
    })
    .await;
}

/// Pause serializes the agent with the updated brief and no pending decision, and refuses a second pause; resume
/// runs it again.
async fn pause_and_resume_keep_the_updated_brief(sb: &SandboxClient, events: &mut EventStream) {
    let state = sb.pause().await.unwrap();
    assert_eq!(state.serialized_by, SerializedBy::Pause);
    assert_eq!(state.agent_id, "agent-1");
    assert_eq!(state.brief_snapshot["constraints"], json!(["be brief"]));
    assert!(state.pending_decision_ids.is_empty());
    assert_eq!(sb.health().await.unwrap().agent_status, AgentStatus::Paused);
    assert_eq!(plugin_err(sb.pause().await).0, 409);
    let h = sb.resume(&state).await.unwrap();
    assert_eq!(h.status, AgentStatus::Running);
    until(events, "resumed", Duration::from_secs(10), |e| {
        action(e) == Some("resumed")
    })
    .await;
}

/// The token is renewed at 80% of its 3 s lifetime (not before 2 s, within 10 s), with the old token.
async fn token_is_renewed_at_80_percent_with_the_old_token(backend: &Backend, created: Instant) {
    let renew = loop {
        if let Some(r) = backend
            .seen()
            .into_iter()
            .find(|s| s.path == "/api/token/renew")
        {
            break r;
        }
        assert!(
            created.elapsed() < Duration::from_secs(10),
            "no token renewal"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(
        created.elapsed() >= Duration::from_millis(2000),
        "renewed too early: {:?}",
        created.elapsed()
    );
    assert_eq!(renew.auth, format!("Bearer {SECRET}"));
    let body: Value = serde_json::from_slice(&renew.body).unwrap();
    assert_eq!(body, json!({"agentId": "agent-1", "currentToken": SECRET}));
}

/// A replay of what was already delivered gives the same events.
async fn replay_repeats_the_delivered_events(sb: &SandboxClient, first: &AdapterEvent) {
    let r = sb.replay(1, 3).await.unwrap();
    assert_eq!(
        r.events
            .iter()
            .map(|e| e.source_sequence)
            .collect::<Vec<_>>(),
        [1, 2, 3]
    );
    assert_eq!(&r.events[0], first);
    assert!(r.evicted.is_none());
}

/// Kill with grace: the agent answers the shutdown line with its state and exits 0; the run is completed, and a
/// second kill is refused.
async fn kill_with_grace_returns_the_agents_state(
    sb: &SandboxClient,
    events: &mut EventStream,
) -> SerializedAgentState {
    let k = sb
        .kill(&KillRequest {
            grace: true,
            grace_timeout_ms: Some(5000),
        })
        .await
        .unwrap();
    assert!(k.clean_shutdown, "{k:?}");
    let st = k.state.expect("state in the kill response");
    assert_eq!(st.serialized_by, SerializedBy::KillGrace);
    assert_eq!(st.checkpoint["agent"]["via"], "shutdown");
    until(events, "killed", Duration::from_secs(10), |e| {
        action(e) == Some("killed")
    })
    .await;
    assert_eq!(
        sb.health().await.unwrap().agent_status,
        AgentStatus::Completed
    );
    assert_eq!(plugin_err(sb.kill(&KillRequest::default()).await).0, 409);
    st
}

/// Resume from the stored state with no agent running: a new run, handed the agent's checkpoint.
async fn resume_from_the_stored_state_is_a_new_run(
    sb: &SandboxClient,
    events: &mut EventStream,
    st: &SerializedAgentState,
    run_id: &str,
) {
    let h = sb.resume(st).await.unwrap();
    assert_eq!(h.status, AgentStatus::Running);
    assert_ne!(h.session_id, run_id);
    until(events, "the resumed agent", Duration::from_secs(20), |e| {
        status_contains(e, "resuming from") && status_contains(e, "\"via\": \"shutdown\"")
    })
    .await;
}

fn uuid_version(id: &str) -> u32 {
    // xxxxxxxx-xxxx-Vxxx-...
    id.chars().nth(14).and_then(|c| c.to_digit(16)).unwrap_or(0)
}

/// `kill -9` of the agent process: LifecycleEvent crashed + ErrorEvent within 1 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_of_the_agent_is_detected_within_1s() {
    let Some((d, gw)) = start().await else { return };
    let backend = Backend::start().await;
    let sb = gw
        .create(&create_request(backend.port, 3600))
        .await
        .unwrap();
    let mut events = sb.events(0);
    sb.spawn(&brief(json!([{"sleep_ms": 60000}])))
        .await
        .unwrap();
    until(
        &mut events,
        "brief received",
        Duration::from_secs(20),
        |e| status_contains(e, "brief received"),
    )
    .await;
    let cid = format!("{}-1", sb.id());
    let agent = container_pids(&d.cgroup_parent, &cid)
        .into_iter()
        .find(|p| {
            std::fs::read(format!("/proc/{p}/cmdline"))
                .is_ok_and(|c| String::from_utf8_lossy(&c).contains("fake_agent.py"))
        })
        .expect("the agent process");
    let t0 = Instant::now();
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(agent), nix::sys::signal::SIGKILL).unwrap();
    let seen = until(&mut events, "crashed", Duration::from_secs(5), |e| {
        action(e) == Some("crashed")
    })
    .await;
    let detected = t0.elapsed();
    eprintln!("crash detected {detected:?} after kill -9");
    assert!(
        detected < Duration::from_secs(1),
        "crash detected after {detected:?}"
    );
    assert!(seen.last().unwrap().event["reason"]
        .as_str()
        .unwrap()
        .contains("SIGKILL"));
    let err = until(&mut events, "the ErrorEvent", Duration::from_secs(2), |e| {
        is(e, "error")
    })
    .await;
    let err = err.last().unwrap();
    assert_eq!(err.event["category"], "internal");
    assert_eq!(err.event["recoverable"], false);
    let h = sb.health().await.unwrap();
    assert_eq!(
        (h.agent_status, h.status),
        (AgentStatus::Error, HealthStatus::Unhealthy)
    );
    // The workspace outlives the crashed container; a new run may start in it.
    sb.spawn(&brief(json!([]))).await.unwrap();
    until(&mut events, "second run", Duration::from_secs(20), |e| {
        status_contains(e, "brief received")
    })
    .await;
    gw.delete(sb.id()).await.unwrap();
    assert!(cgroup_leaves(&d.cgroup_parent).is_empty());
}

/// A WebSocket dropped mid-stream: the stream reconnects, replays exactly the missing sequences, and the
/// consumer sees every sequence once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_after_a_forced_websocket_drop_returns_exactly_the_missing_sequences() {
    let Some((_d, gw, _backend, sb)) = start_with_sandbox().await else {
        return;
    };
    let mut events = sb.events(0);
    const TICKS: u64 = 300;
    sb.spawn(&brief(
        json!([{"emit_many": TICKS, "every_ms": 5}, {"emit": {"type": "completion",
        "summary": "done", "artifactsProduced": [], "decisionsNeeded": [], "outcome": "success"}}]),
    ))
    .await
    .unwrap();
    let mut got: Vec<u64> = Vec::new();
    while got.len() < 40 {
        got.push(events.next().await.unwrap().source_sequence);
    }
    events.drop_connection();
    // Events keep coming while the gateway is away.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let last = loop {
        let e = tokio::time::timeout(Duration::from_secs(20), events.next())
            .await
            .unwrap()
            .unwrap();
        got.push(e.source_sequence);
        if is(&e, "completion") {
            break e.source_sequence;
        }
    };
    // started + "brief received" + ticks + completion.
    assert_eq!(last, TICKS + 3);
    assert_eq!(
        got,
        (1..=last).collect::<Vec<_>>(),
        "every sequence exactly once, in order"
    );
    assert_eq!(events.reconnects, 1);
    assert!(!events.replays.is_empty());
    for (range, seqs) in &events.replays {
        assert_eq!(
            *seqs,
            (range.from_sequence..=range.to_sequence).collect::<Vec<_>>(),
            "a replay returned other than exactly its range"
        );
    }
    assert_eq!(
        events.replays[0].0.from_sequence, 41,
        "the replay starts right after the last event seen"
    );
    assert!(events.evicted.is_empty());
    gw.delete(sb.id()).await.unwrap();
}

/// Pause freezes the cgroup: a busy agent's CPU time stops; resume lets it run again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pause_drops_cpu_to_zero_and_resume_continues() {
    let Some((d, gw)) = start().await else { return };
    let backend = Backend::start().await;
    let sb = gw
        .create(&create_request(backend.port, 3600))
        .await
        .unwrap();
    let mut events = sb.events(0);
    sb.spawn(&brief(json!([{"busy": true}]))).await.unwrap();
    until(&mut events, "busy", Duration::from_secs(20), |e| {
        status_contains(e, "busy")
    })
    .await;
    let cid = format!("{}-1", sb.id());
    let a = cpu_ns(&d.cgroup_parent, &cid);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let b = cpu_ns(&d.cgroup_parent, &cid);
    assert!(b > a, "the busy agent did not use CPU");
    sb.pause().await.unwrap();
    let p0 = cpu_ns(&d.cgroup_parent, &cid);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let p1 = cpu_ns(&d.cgroup_parent, &cid);
    eprintln!(
        "cpu while paused: {} ns in 500 ms; running: {} ns in 300 ms",
        p1 - p0,
        b - a
    );
    assert_eq!(p1, p0, "a paused agent used CPU");
    let state = sb.pause().await;
    assert!(state.is_err());
    let st = serde_json::from_value(json!({
        "agentId": "agent-1", "pluginName": "sandboxd", "sessionId": "s", "checkpoint": {},
        "briefSnapshot": {}, "pendingDecisionIds": [], "lastSequence": 0,
        "serializedAt": "2026-01-01T00:00:00Z", "serializedBy": "pause", "estimatedSizeBytes": 0
    }))
    .unwrap();
    sb.resume(&st).await.unwrap();
    let r0 = cpu_ns(&d.cgroup_parent, &cid);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let r1 = cpu_ns(&d.cgroup_parent, &cid);
    assert!(r1 > r0, "the resumed agent did not run");
    let h = sb.health().await.unwrap();
    let h2 = {
        tokio::time::sleep(Duration::from_millis(200)).await;
        sb.health().await.unwrap()
    };
    eprintln!(
        "health cpuPercent {} then {}",
        h.resource_usage.cpu_percent, h2.resource_usage.cpu_percent
    );
    assert!(h2.resource_usage.cpu_percent > 10.0, "{h2:?}");
    // Kill while paused works too (the cgroup is thawed first).
    sb.pause().await.unwrap();
    let k = sb
        .kill(&KillRequest {
            grace: false,
            grace_timeout_ms: None,
        })
        .await
        .unwrap();
    assert!(!k.clean_shutdown);
    gw.delete(sb.id()).await.unwrap();
}

/// 100 sandboxes created, spawned and destroyed: no cgroup, mount, process or state left.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hundred_sandboxes_leave_nothing_behind() {
    let Some((d, gw)) = start().await else { return };
    let backend = Backend::start().await;
    let t0 = Instant::now();
    let mut tasks = Vec::new();
    for worker in 0..4 {
        let gw = gw.clone();
        let port = backend.port;
        tasks.push(tokio::spawn(async move {
            for i in 0..25 {
                let sb = gw.create(&create_request(port, 3600)).await.unwrap();
                // Every other one runs an agent too.
                if (worker + i) % 2 == 0 {
                    sb.spawn(&brief(json!([]))).await.unwrap();
                }
                gw.delete(sb.id()).await.unwrap();
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    eprintln!("100 sandboxes created and removed in {:?}", t0.elapsed());
    let agents = d.state_dir().join("agents");
    let left: Vec<_> = std::fs::read_dir(&agents)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .collect();
    assert!(left.is_empty(), "state left: {left:?}");
    assert!(
        cgroup_leaves(&d.cgroup_parent).is_empty(),
        "{:?}",
        cgroup_leaves(&d.cgroup_parent)
    );
    let pid = d.pid().unwrap();
    assert!(
        mounts_under(pid, &agents).is_empty(),
        "{:?}",
        mounts_under(pid, &agents)
    );
    let uids = d.uid_base..d.uid_base + 64;
    assert!(processes_with_uid(uids).is_empty());
}

/// Every endpoint of a sandbox, with its method.
const SANDBOX_ENDPOINTS: [(&str, &str); 10] = [
    ("POST", "spawn"),
    ("POST", "pause"),
    ("POST", "resume"),
    ("POST", "kill"),
    ("POST", "resolve"),
    ("POST", "inject-context"),
    ("POST", "update-brief"),
    ("POST", "replay"),
    ("GET", "health"),
    ("GET", "events"),
];

/// Create bodies that are no request: malformed JSON, a wrong field, an unknown field.
const MALFORMED_CREATE_BODIES: [&[u8]; 3] = [
    b"{not json",
    b"[]",
    br#"{"workspaceRequirements":{"capabilities":["teleport"]}}"#,
];

/// Commands a sandbox without an agent refuses, with their status: bad bodies, then commands that need an agent.
const REFUSED_SANDBOX_COMMANDS: [(&str, &[u8], u16); 8] = [
    ("spawn", b"{}", 400),
    ("resolve", b"{\"decisionId\": 5}", 400),
    ("replay", b"{\"fromSequence\": 5, \"toSequence\": 1}", 400),
    (
        "resolve",
        b"{\"decisionId\": \"d\", \"resolution\": {}}",
        409,
    ),
    ("pause", b"", 409),
    ("kill", b"{}", 409),
    // A malformed body, then a sandbox created without `network`: no allowlist to change.
    ("network", b"{\"allow\": \"x\"}", 400),
    ("network", b"{\"allow\": [\"pypi.org:443\"]}", 409),
];

/// The PluginError in a raw answer's body.
fn plugin_error_body(a: client::gateway::RawAnswer) -> PluginError {
    serde_json::from_slice(&a.body).unwrap_or_else(|e| {
        panic!(
            "not a PluginError ({e}): {:?}",
            String::from_utf8_lossy(&a.body)
        )
    })
}

/// Bad input gets a PluginError and leaks nothing; the daemon keeps serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_gets_plugin_errors_and_leaks_nothing() {
    let Some((d, gw)) = start().await else { return };
    let backend = Backend::start().await;
    let tok = Some(d.token.as_str());
    an_unknown_sandbox_is_not_found(&gw, tok).await;
    a_wrong_or_missing_token_is_refused(&gw, backend.port).await;
    malformed_and_oversize_bodies_are_refused(&gw, tok).await;
    requests_the_daemon_cannot_grant_are_refused(&gw, backend.port).await;
    // On a real sandbox: bad bodies, commands without an agent, a non-upgrade GET of /events.
    let sb: SandboxClient = gw.create(&create_request(backend.port, 60)).await.unwrap();
    a_sandbox_without_an_agent_refuses_bad_commands(&gw, &sb, tok).await;
    // Only the one good sandbox exists; the daemon still serves.
    let agents = d.state_dir().join("agents");
    assert_eq!(std::fs::read_dir(&agents).unwrap().count(), 1);
    gw.delete(sb.id()).await.unwrap();
    assert_eq!(std::fs::read_dir(&agents).unwrap().count(), 0);
    assert!(cgroup_leaves(&d.cgroup_parent).is_empty());
    assert!(!d.log().contains(SECRET));
}

/// Unknown sandbox, on every endpoint and on removal: 404.
async fn an_unknown_sandbox_is_not_found(gw: &Gateway, tok: Option<&str>) {
    for (m, p) in SANDBOX_ENDPOINTS {
        let a = gw
            .raw(m, &format!("/sandboxes/nope/{p}"), b"{}".to_vec(), tok)
            .await
            .unwrap();
        assert_eq!(a.status, 404, "{p}");
        assert!(matches!(
            plugin_error_body(a),
            PluginError::InvalidState { .. }
        ));
    }
    assert_eq!(
        gw.raw("DELETE", "/sandboxes/nope", vec![], tok)
            .await
            .unwrap()
            .status,
        404
    );
}

/// A create with a wrong or without a token: 401.
async fn a_wrong_or_missing_token_is_refused(gw: &Gateway, backend_port: u16) {
    for t in [Some("wrong-token-xxxxxxxxxxxx"), None] {
        let a = gw
            .raw(
                "POST",
                "/sandboxes",
                serde_json::to_vec(&create_request(backend_port, 60)).unwrap(),
                t,
            )
            .await
            .unwrap();
        assert_eq!(a.status, 401);
        assert!(matches!(
            plugin_error_body(a),
            PluginError::InvalidState { .. }
        ));
    }
}

/// A create body that is no request: 400 `Malformed…`; an oversize one: 413.
async fn malformed_and_oversize_bodies_are_refused(gw: &Gateway, tok: Option<&str>) {
    for bad in MALFORMED_CREATE_BODIES {
        let a = gw
            .raw("POST", "/sandboxes", bad.to_vec(), tok)
            .await
            .unwrap();
        assert_eq!(a.status, 400, "{}", String::from_utf8_lossy(bad));
        let e = plugin_error_body(a);
        assert!(
            matches!(&e, PluginError::InvalidState { message, .. } if message.starts_with("Malformed")),
            "{e:?}"
        );
    }
    let big = vec![b' '; 2 << 20];
    let a = gw.raw("POST", "/sandboxes", big, tok).await.unwrap();
    assert_eq!(a.status, 413);
    assert!(matches!(
        plugin_error_body(a),
        PluginError::InvalidState { .. }
    ));
}

/// An unsupported capability (422), an https upload, limits over the maximum, a template file outside the
/// workspace, `network` without the extension (400).
async fn requests_the_daemon_cannot_grant_are_refused(gw: &Gateway, backend_port: u16) {
    let mut req = create_request(backend_port, 60);
    req.workspace_requirements
        .capabilities
        .push(agent_api::SandboxCapability::Gpu);
    assert_eq!(
        plugin_err(gw.create(&req).await),
        (
            422,
            PluginError::CapabilityUnsupported {
                capability: "gpu".into()
            }
        )
    );
    let mut req = create_request(backend_port, 60);
    req.bootstrap.artifact_upload_endpoint = "https://backend.invalid/api/artifacts".into();
    assert_eq!(plugin_err(gw.create(&req).await).0, 400);
    let mut req = create_request(backend_port, 60);
    req.workspace_requirements
        .resource_limits
        .as_mut()
        .unwrap()
        .memory_mb = Some(1 << 30);
    assert_eq!(plugin_err(gw.create(&req).await).0, 400);
    let mut req = create_request(backend_port, 60);
    req.template.as_mut().unwrap().files[0].path = "../escape.py".into();
    assert_eq!(plugin_err(gw.create(&req).await).0, 400);
    // This daemon has no `network` extension.
    let mut req = create_request(backend_port, 60);
    req.network = Some(agent_api::SandboxNetwork {
        allow: vec!["pypi.org:443".into()],
        egress_bytes: None,
    });
    let (status, e) = plugin_err(gw.create(&req).await);
    assert_eq!(status, 400);
    assert!(e.to_string().contains("network.enabled"), "{e}");
}

/// Bad bodies and commands that need an agent get their status and a PluginError; a GET of `/events` without an
/// upgrade is refused.
async fn a_sandbox_without_an_agent_refuses_bad_commands(
    gw: &Gateway,
    sb: &SandboxClient,
    tok: Option<&str>,
) {
    let base = format!("/sandboxes/{}", sb.id());
    for (p, body, want) in REFUSED_SANDBOX_COMMANDS {
        let a = gw
            .raw("POST", &format!("{base}/{p}"), body.to_vec(), tok)
            .await
            .unwrap();
        assert_eq!(a.status, want, "{p} {}", String::from_utf8_lossy(&a.body));
        let _ = plugin_error_body(a);
    }
    let a = gw
        .raw("GET", &format!("{base}/events"), vec![], tok)
        .await
        .unwrap();
    assert!(a.status >= 400);
    let _ = plugin_error_body(a);
    let (status, e) = plugin_err(sb.set_network(vec!["pypi.org:443".into()]).await);
    assert_eq!(status, 409, "{e:?}");
    unknown_paths_and_methods_get_plugin_errors(gw, &base, tok).await;
}

/// An unknown path under a sandbox is 404, a known path with the wrong method 405, both with a PluginError body.
async fn unknown_paths_and_methods_get_plugin_errors(gw: &Gateway, base: &str, tok: Option<&str>) {
    let cases = [
        ("POST", format!("{base}/teleport"), 404),
        ("GET", format!("{base}/spawn/extra"), 404),
        ("POST", format!("{base}/"), 404),
        ("GET", format!("{base}/spawn"), 405),
        ("POST", format!("{base}/health"), 405),
        ("GET", base.to_owned(), 405),
    ];
    for (m, path, want) in cases {
        let a = gw.raw(m, &path, b"{}".to_vec(), tok).await.unwrap();
        assert_eq!(
            a.status,
            want,
            "{m} {path}: {}",
            String::from_utf8_lossy(&a.body)
        );
        assert!(matches!(
            plugin_error_body(a),
            PluginError::InvalidState { .. }
        ));
    }
    // Without a token the answer is 401, whatever the path.
    let a = gw
        .raw("POST", &format!("{base}/teleport"), vec![], None)
        .await
        .unwrap();
    assert_eq!(a.status, 401);
    let _ = plugin_error_body(a);
}

/// A daemon killed with SIGKILL while sandboxes run: the restart removes their state, cgroups and processes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_removes_what_a_killed_daemon_left() {
    let Some((mut d, gw)) = start().await else {
        return;
    };
    let backend = Backend::start().await;
    let sb = gw
        .create(&create_request(backend.port, 3600))
        .await
        .unwrap();
    let mut events = sb.events(0);
    sb.spawn(&brief(json!([]))).await.unwrap();
    until(
        &mut events,
        "brief received",
        Duration::from_secs(20),
        |e| status_contains(e, "brief received"),
    )
    .await;
    d.kill_hard();
    d.restart().await;
    let agents = d.state_dir().join("agents");
    assert_eq!(std::fs::read_dir(&agents).unwrap().count(), 0);
    assert!(cgroup_leaves(&d.cgroup_parent).is_empty());
    let uids = d.uid_base..d.uid_base + 64;
    assert!(processes_with_uid(uids).is_empty());
    assert_eq!(plugin_err(sb.health().await).0, 404);
}

/// A malformed control line becomes a warning ErrorEvent; a failed upload forwards the artifact without its sandbox
/// path plus an ErrorEvent; a control connection dropped while the agent keeps running is a crash.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn misbehaving_agents_and_failed_uploads() {
    let Some((_d, gw)) = start().await else {
        return;
    };
    let backend = Backend::start().await;
    let mut req = create_request(backend.port, 3600);
    // Nothing listens there: every upload attempt fails.
    let dead = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    req.bootstrap.artifact_upload_endpoint = format!("http://127.0.0.1:{dead}/api/artifacts");
    let sb = gw.create(&req).await.unwrap();
    let mut events = sb.events(0);
    sb.spawn(&brief(json!([
        {"raw": "this is not json"},
        {"raw": "{\"type\": \"teleport\", \"agentId\": \"x\"}"},
        {"write": {"path": "a.txt", "content": "A"}},
        {"artifact": {"path": "a.txt", "artifactId": "art-a"}},
        {"emit": {"type": "artifact", "artifactId": "art-b", "name": "b", "kind": "other", "workstream": "w",
                  "status": "draft", "qualityScore": 1, "provenance": {"createdBy": "x", "createdAt": "x"},
                  "uri": "/etc/passwd"}},
        {"close_socket": true},
    ])))
    .await
    .unwrap();
    let seen = until(&mut events, "crashed", Duration::from_secs(30), |e| {
        action(e) == Some("crashed")
    })
    .await;
    let codes: Vec<&str> = seen
        .iter()
        .filter_map(|e| e.event.get("errorCode").and_then(Value::as_str))
        .collect();
    assert_eq!(
        codes.iter().filter(|c| **c == "malformed_event").count(),
        2,
        "{seen:#?}"
    );
    assert_eq!(
        codes
            .iter()
            .filter(|c| **c == "artifact_upload_failed")
            .count(),
        2,
        "{seen:#?}"
    );
    for a in seen.iter().filter(|e| is(e, "artifact")) {
        assert!(
            a.event.get("uri").is_none(),
            "a sandbox path was forwarded: {a:?}"
        );
    }
    let a = seen
        .iter()
        .find(|e| is(e, "artifact") && e.event["artifactId"] == "art-a")
        .unwrap();
    assert_eq!(
        a.event["contentHash"],
        format!("{:x}", sha2::Sha256::digest(b"A")).as_str()
    );
    let crashed = seen.last().unwrap();
    assert!(
        crashed.event["reason"]
            .as_str()
            .unwrap()
            .contains("control connection dropped"),
        "{crashed:?}"
    );
    assert_eq!(sb.health().await.unwrap().agent_status, AgentStatus::Error);
    assert!(backend.seen().iter().all(|s| s.path != "/api/artifacts"));
    gw.delete(sb.id()).await.unwrap();
}

/// An upload refused with 401 (the token expired before its renewal) renews the token at once and succeeds with
/// the new one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_token_is_renewed_and_the_upload_retried() {
    let Some((_d, gw)) = start().await else {
        return;
    };
    let backend = Backend::start_refusing(Some(SECRET)).await;
    let sb = gw
        .create(&create_request(backend.port, 3600))
        .await
        .unwrap();
    let mut events = sb.events(0);
    sb.spawn(&brief(json!([
        {"write": {"path": "r.txt", "content": "R"}},
        {"artifact": {"path": "r.txt", "artifactId": "art-r"}},
    ])))
    .await
    .unwrap();
    let seen = until(&mut events, "the artifact", Duration::from_secs(30), |e| {
        is(e, "artifact")
    })
    .await;
    let a = seen.last().unwrap();
    assert!(
        a.event["uri"]
            .as_str()
            .is_some_and(|u| u.starts_with("artifact://")),
        "{a:?}"
    );
    let calls = backend.seen();
    let renew = calls
        .iter()
        .position(|s| s.path == "/api/token/renew")
        .expect("a renewal");
    let ok = calls
        .iter()
        .rposition(|s| s.path == "/api/artifacts")
        .unwrap();
    assert!(calls[..renew]
        .iter()
        .any(|s| s.path == "/api/artifacts" && s.auth == format!("Bearer {SECRET}")));
    assert!(
        ok > renew && calls[ok].auth.starts_with("Bearer renewed-token-"),
        "{calls:?}"
    );
    gw.delete(sb.id()).await.unwrap();
}

/// Capacity counts sandboxes: beyond `agents.max_sandboxes`, `provider_unavailable` (retryable) at once; a removal
/// frees a place.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn capacity_counts_sandboxes() {
    let Some(bin) = require_daemon("capacity_counts_sandboxes") else {
        return;
    };
    let d = Daemon::start(
        &bin,
        DaemonOpts {
            max_sandboxes: 2,
            ..DaemonOpts::default()
        },
    )
    .await;
    let gw = Gateway::new(&d.http_base(), &d.token);
    let backend = Backend::start().await;
    let a = gw
        .create(&create_request(backend.port, 3600))
        .await
        .unwrap();
    let b = gw
        .create(&create_request(backend.port, 3600))
        .await
        .unwrap();
    let (status, e) = plugin_err(gw.create(&create_request(backend.port, 3600)).await);
    assert_eq!(status, 503);
    assert!(
        matches!(
            e,
            PluginError::ProviderUnavailable {
                retryable: true,
                ..
            }
        ),
        "{e:?}"
    );
    assert_eq!(
        std::fs::read_dir(d.state_dir().join("agents"))
            .unwrap()
            .count(),
        2,
        "the refusal left state"
    );
    gw.delete(a.id()).await.unwrap();
    let c = gw
        .create(&create_request(backend.port, 3600))
        .await
        .unwrap();
    // Distinct host uids: the freed one is reused, never shared.
    gw.delete(b.id()).await.unwrap();
    gw.delete(c.id()).await.unwrap();
}

/// Kill with grace reaches an agent that only handles SIGTERM (it ignores the `shutdown` line): it saves its state
/// and exits 0 within the grace period. The container's init passes SIGTERM from outside on to the agent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_with_grace_sends_sigterm_to_the_agent() {
    let Some((_d, gw)) = start().await else {
        return;
    };
    let backend = Backend::start().await;
    let mut req = create_request(backend.port, 3600);
    let t = req.template.as_mut().unwrap();
    t.env.insert("FAKE_AGENT_SIGTERM".into(), "1".into());
    t.env
        .insert("FAKE_AGENT_IGNORE_SHUTDOWN".into(), "1".into());
    let sb = gw.create(&req).await.unwrap();
    let mut events = sb.events(0);
    sb.spawn(&brief(json!([]))).await.unwrap();
    until(
        &mut events,
        "brief received",
        Duration::from_secs(20),
        |e| status_contains(e, "brief received"),
    )
    .await;
    let t0 = Instant::now();
    let k = sb
        .kill(&KillRequest {
            grace: true,
            grace_timeout_ms: Some(5000),
        })
        .await
        .unwrap();
    assert!(k.clean_shutdown, "SIGTERM did not reach the agent: {k:?}");
    assert!(
        t0.elapsed() < Duration::from_secs(4),
        "the kill waited out the grace period"
    );
    assert_eq!(k.state.unwrap().checkpoint["agent"]["via"], "sigterm");
    gw.delete(sb.id()).await.unwrap();
}

/// `sandboxctl sandbox create|spawn|events|kill|rm`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sandboxctl_sandbox_commands() {
    let Some((d, _gw)) = start().await else {
        return;
    };
    let backend = Backend::start().await;
    let dir = tempfile::tempdir().unwrap();
    let req = dir.path().join("req.json");
    std::fs::write(
        &req,
        serde_json::to_vec(&create_request(backend.port, 3600)).unwrap(),
    )
    .unwrap();
    let brief_file = dir.path().join("brief.json");
    std::fs::write(
        &brief_file,
        serde_json::to_vec(&brief(json!([{"emit_many": 3, "every_ms": 0}]))).unwrap(),
    )
    .unwrap();
    let ctl = |args: &[&str]| d.sandboxctl(args);
    let (code, out, err) = ctl(&["sandbox", "create", "--request", req.to_str().unwrap()]);
    assert_eq!(code, Some(0), "{err}");
    let created: Value = serde_json::from_str(&out).unwrap();
    let id = created["id"].as_str().unwrap().to_owned();
    let (code, out, err) = ctl(&[
        "sandbox",
        "spawn",
        &id,
        "--brief",
        brief_file.to_str().unwrap(),
    ]);
    assert_eq!(code, Some(0), "{err}");
    assert_eq!(
        serde_json::from_str::<Value>(&out).unwrap()["status"],
        "running"
    );
    let (code, out, err) = ctl(&["sandbox", "events", &id, "--count", "5"]);
    assert_eq!(code, Some(0), "{err}");
    let seqs: Vec<u64> = out
        .lines()
        .map(|l| {
            serde_json::from_str::<Value>(l).unwrap()["sourceSequence"]
                .as_u64()
                .unwrap()
        })
        .collect();
    assert_eq!(seqs, [1, 2, 3, 4, 5]);
    let (code, out, err) = ctl(&["sandbox", "kill", &id, "--grace-timeout-ms", "3000"]);
    assert_eq!(code, Some(0), "{err}");
    assert_eq!(
        serde_json::from_str::<Value>(&out).unwrap()["cleanShutdown"],
        true
    );
    let (code, _, err) = ctl(&["sandbox", "rm", &id]);
    assert_eq!(code, Some(0), "{err}");
    let (code, _, err) = ctl(&["sandbox", "rm", &id]);
    assert_eq!(code, Some(65), "{err}");
    let out = std::process::Command::new(sandboxctl())
        .args([
            "--url",
            &d.url(),
            "--token",
            "wrong-token-xxxxxxxxxxxxx",
            "sandbox",
            "rm",
            &id,
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(77));
}

/// Waits until the sandbox's log ends with a status event whose message contains `text`; returns its sequence.
async fn logged(sb: &SandboxClient, text: &str) -> u64 {
    let end = Instant::now() + Duration::from_secs(60);
    loop {
        let last = sb.replay(1, 1).await.unwrap().last_sequence;
        if last > 0 {
            let r = sb.replay(last, last).await.unwrap();
            if r.events.iter().any(|e| status_contains(e, text)) {
                return last;
            }
        }
        assert!(Instant::now() < end, "no {text:?} in the log within 60 s");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A control line over `agents.max_line_bytes` is refused with a warning ErrorEvent carrying the agent's id; the
/// run goes on and its next line is read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_oversize_control_line_is_refused_and_the_run_goes_on() {
    let Some((_d, gw, _backend, sb)) = start_with_sandbox().await else {
        return;
    };
    let mut events = sb.events(0);
    sb.spawn(&brief(json!([
        {"big_line": (1 << 20) + 100},
        {"emit": {"type": "status", "message": "still alive"}},
    ])))
    .await
    .unwrap();
    let seen = until(&mut events, "still alive", Duration::from_secs(30), |e| {
        status_contains(e, "still alive")
    })
    .await;
    let refused = seen
        .iter()
        .find(|e| e.event.get("errorCode") == Some(&json!("control_line_too_long")))
        .unwrap_or_else(|| panic!("no control_line_too_long ErrorEvent: {seen:#?}"));
    assert_eq!(refused.event["agentId"], "agent-1");
    assert_eq!(refused.event["severity"], "warning");
    assert_eq!(
        sb.health().await.unwrap().agent_status,
        AgentStatus::Running
    );
    gw.delete(sb.id()).await.unwrap();
}

/// Events dropped while no gateway is connected are counted exactly, and the count reaches the next gateway
/// without the agent emitting again: every logged event is either delivered or counted. The warning names the
/// agent, not the sandbox.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_events_are_counted_exactly_and_delivered() {
    use futures_util::StreamExt;
    use tokio_tungstenite::tungstenite::client::IntoClientRequest;

    let Some((d, gw, _backend, sb)) = start_with_sandbox().await else {
        return;
    };
    // 3000 events of 4 KiB: over the queue's budget in events and in bytes.
    sb.spawn(&brief(json!([
        {"emit_many": 3000, "every_ms": 0, "pad": 4096},
        {"emit": {"type": "status", "message": "burst done"}},
    ])))
    .await
    .unwrap();
    let last = logged(&sb, "burst done").await;
    let url = format!(
        "{}/sandboxes/{}/events",
        d.http_base().replacen("http://", "ws://", 1),
        sb.id()
    );
    let mut req = url.into_client_request().unwrap();
    req.headers_mut().insert(
        "authorization",
        format!("Bearer {}", d.token).parse().unwrap(),
    );
    let (mut ws, _) = tokio_tungstenite::connect_async(req).await.unwrap();
    let mut delivered = 0u64;
    let warning: AdapterEvent = loop {
        let frame = tokio::time::timeout(Duration::from_secs(30), ws.next())
            .await
            .unwrap_or_else(|_| {
                panic!("no events_dropped warning within 30 s ({delivered} events)")
            })
            .unwrap()
            .unwrap();
        let e: AdapterEvent = serde_json::from_str(frame.to_text().unwrap()).unwrap();
        if e.event.get("errorCode") == Some(&json!("events_dropped")) {
            break e;
        }
        delivered += 1;
    };
    let message = warning.event["message"].as_str().unwrap();
    let dropped: u64 = message.split(' ').next().unwrap().parse().unwrap();
    // Every logged event is delivered or counted, and the warning names the agent (not the sandbox).
    assert_eq!(
        (dropped + delivered, warning.event["agentId"].as_str()),
        (last, Some("agent-1")),
        "{message:?}: {delivered} delivered of {last} logged"
    );
    drop(ws);
    gw.delete(sb.id()).await.unwrap();
}

/// An ArtifactEvent naming a FIFO in the workspace is refused (not a regular file) without blocking the sandbox:
/// kill and delete work and leave no cgroup, process or state behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fifo_artifact_is_refused_and_kill_and_delete_still_work() {
    let Some((d, gw, backend, sb)) = start_with_sandbox().await else {
        return;
    };
    let mut events = sb.events(0);
    sb.spawn(&brief(json!([
        {"mkfifo": "pipe"},
        {"artifact": {"path": "pipe", "artifactId": "art-fifo"}},
        {"emit": {"type": "status", "message": "after the fifo"}},
    ])))
    .await
    .unwrap();
    // Up to the status after the artifact (which a blocked sandbox never forwards), then the kill either way.
    let mut seen = Vec::new();
    let end = Instant::now() + Duration::from_secs(20);
    while !seen.iter().any(|e| status_contains(e, "after the fifo")) {
        let left = end.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, events.next()).await {
            Ok(Ok(e)) => seen.push(e),
            Ok(Err(e)) => panic!("event stream failed: {e}"),
            Err(_) => break,
        }
    }
    let killed = sb
        .kill(&KillRequest {
            grace: false,
            grace_timeout_ms: None,
        })
        .await;
    assert!(killed.is_ok(), "kill: {killed:?}");
    seen.extend(
        until(&mut events, "killed", Duration::from_secs(30), |e| {
            action(e) == Some("killed")
        })
        .await,
    );
    let failed = seen
        .iter()
        .find(|e| e.event.get("errorCode") == Some(&json!("artifact_upload_failed")))
        .unwrap_or_else(|| panic!("no artifact_upload_failed: {seen:#?}"));
    assert!(
        failed.event["message"]
            .as_str()
            .unwrap()
            .contains("not a regular file"),
        "{failed:?}"
    );
    let art = seen.iter().find(|e| is(e, "artifact")).unwrap();
    assert!(art.event.get("uri").is_none(), "{art:?}");
    assert!(seen.iter().any(|e| status_contains(e, "after the fifo")));
    gw.delete(sb.id()).await.unwrap();
    let agents = d.state_dir().join("agents");
    assert_eq!(std::fs::read_dir(&agents).unwrap().count(), 0);
    assert!(
        cgroup_leaves(&d.cgroup_parent).is_empty(),
        "{:?}",
        cgroup_leaves(&d.cgroup_parent)
    );
    assert!(processes_with_uid(d.uid_base..d.uid_base + 64).is_empty());
    assert!(backend.seen().iter().all(|s| s.path != "/api/artifacts"));
}

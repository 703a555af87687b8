//! Agent sandboxes on the fake container backend: no root, no namespaces, no cgroups. The agent is the scripted
//! fake agent of the client's tests (`client/tests/agents/fake_agent.py`) run by the host's python3 as a plain
//! child process; it speaks the real control protocol over the real control socket. Each test drives a lifecycle
//! path (spawn, pause, resume, kill with and without grace, crash by exit status or by a dropped control
//! connection, removal) and checks both what the gateway sees (events, handles, health) and what the container
//! backend was asked to do.

use std::sync::Arc;
use std::time::Duration;

use agent_api::{
    AdapterEvent, AgentBrief, AgentStatus, CreateSandboxRequest, HealthStatus, KillRequest,
    PluginError,
};
use containers::fake::{Call, Recorder, Script};
use nix::sys::signal::Signal;
use serde_json::{json, Value};

use crate::config::AgentsConfig;
use crate::host::{Host, Settings};
use crate::sandbox::Sandbox;
use crate::test_host::{Bearer, DirStore, FakeContainers, FakeUploads};
use crate::Agents;

/// The scripted fake agent (see its docstring for the steps).
const FAKE_AGENT: &str = include_str!("../../../client/tests/agents/fake_agent.py");
/// How long any one wait may take before the test fails (the paths take milliseconds).
const PATIENCE: Duration = Duration::from_secs(20);

/// A registry over the fake backend, with its files under a temporary directory.
struct Rig {
    agents: Arc<Agents>,
    recorder: Arc<Recorder>,
    _dir: tempfile::TempDir,
}

impl Rig {
    fn new(max_sandboxes: usize, max_line_bytes: u64) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let recorder = Arc::new(Recorder::default());
        std::fs::create_dir_all(dir.path().join("store")).unwrap();
        let host = Host {
            settings: Arc::new(Settings {
                agents: AgentsConfig {
                    max_sandboxes,
                    max_line_bytes,
                    ..AgentsConfig::default()
                },
                state_dir: dir.path().join("state"),
                max_artifact_bytes: 1 << 20,
                listen: "127.0.0.1:1".parse().unwrap(),
            }),
            containers: Arc::new(FakeContainers::new(
                &dir.path().join("containers"),
                recorder.clone(),
                max_sandboxes,
            )),
            store: Arc::new(DirStore(dir.path().join("store"))),
            uploads: Arc::new(FakeUploads::default()),
            auth: Arc::new(Bearer(Some("t"))),
            network: None,
            disks: None,
            snapshots: Err("the fake backend mounts nothing".into()),
            cow: None,
        };
        std::fs::create_dir_all(dir.path().join("state")).unwrap();
        Self {
            agents: Agents::new(host).unwrap(),
            recorder,
            _dir: dir,
        }
    }

    async fn sandbox(&self) -> Arc<Sandbox> {
        self.agents.create(create_request()).await.unwrap()
    }
}

fn create_request() -> CreateSandboxRequest {
    serde_json::from_value(json!({
        "workspaceRequirements": {
            "mounts": [], "capabilities": [],
            "resourceLimits": {"cpuCores": 1.5, "memoryMb": 256, "diskMb": 64, "timeoutMs": 600000}
        },
        "bootstrap": {
            // Nothing listens there; no test renews a token or uploads.
            "backendUrl": "http://127.0.0.1:9",
            "backendToken": "secret",
            "tokenExpiresAt": "2099-01-01T00:00:00Z",
            "agentId": "agent-1",
            "artifactUploadEndpoint": "http://127.0.0.1:9/api/artifacts",
        },
        "template": {
            "command": ["/usr/bin/python3", "/workspace/fake_agent.py"],
            "files": [{"path": "fake_agent.py", "content": FAKE_AGENT}],
        }
    }))
    .unwrap()
}

fn brief(script: Value) -> AgentBrief {
    serde_json::from_value(json!({
        "agentId": "agent-1", "role": "Test Agent", "workstream": "w",
        "providerConfig": {"script": script}
    }))
    .unwrap()
}

/// The gateway's view: the events of a sandbox, as a connected gateway gets them.
struct Events {
    sb: Arc<Sandbox>,
    gateway: u64,
}

impl Events {
    fn attach(sb: &Arc<Sandbox>) -> Self {
        Self {
            gateway: sb.hub.attach(),
            sb: sb.clone(),
        }
    }

    /// Reads events until one matches; returns everything read.
    async fn until(
        &mut self,
        what: &str,
        pred: impl Fn(&AdapterEvent) -> bool,
    ) -> Vec<AdapterEvent> {
        let mut seen = Vec::new();
        let mut changed = self.sb.hub.subscribe();
        let found = tokio::time::timeout(PATIENCE, async {
            loop {
                while let Some(json) = self.sb.hub.next(self.gateway).unwrap() {
                    let e: AdapterEvent = serde_json::from_str(&json).unwrap();
                    let hit = pred(&e);
                    seen.push(e);
                    if hit {
                        return;
                    }
                }
                changed.changed().await.unwrap();
            }
        })
        .await;
        assert!(
            found.is_ok(),
            "no {what} within {PATIENCE:?}; saw {seen:#?}"
        );
        seen
    }
}

/// A sandbox whose agent runs the empty script (it then echoes its commands), its brief read, and its events.
async fn running_agent(rig: &Rig) -> (Arc<Sandbox>, Events) {
    let sb = rig.sandbox().await;
    let mut events = Events::attach(&sb);
    sb.spawn(brief(json!([]))).await.unwrap();
    events
        .until("brief", |e| status_contains(e, "brief received"))
        .await;
    (sb, events)
}

fn lifecycle(e: &AdapterEvent, action: &str) -> bool {
    e.event.get("type") == Some(&json!("lifecycle"))
        && e.event.get("action") == Some(&json!(action))
}

fn status_contains(e: &AdapterEvent, text: &str) -> bool {
    e.event.get("type") == Some(&json!("status"))
        && e.event
            .get("message")
            .and_then(Value::as_str)
            .is_some_and(|m| m.contains(text))
}

/// The id of the container of the sandbox's `n`th run.
fn run_cid(sb: &Sandbox, n: u64) -> String {
    format!("{}-{n}", sb.id)
}

/// Waits until the agent's status is `want` (the supervisor sets it after the run's end).
async fn status_becomes(sb: &Sandbox, want: AgentStatus) {
    let reached = tokio::time::timeout(PATIENCE, async {
        while sb.handle().status != want {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await;
    assert!(
        reached.is_ok(),
        "status {:?}, not {want:?}",
        sb.handle().status
    );
}

/// Waits until the backend was asked to remove the run's container.
async fn removed(recorder: &Recorder, cid: &str) {
    let done = tokio::time::timeout(PATIENCE, async {
        while !recorder
            .calls_of(cid)
            .contains(&Call::Remove(cid.to_owned()))
        {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await;
    assert!(
        done.is_ok(),
        "{cid} not removed: {:?}",
        recorder.calls_of(cid)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_is_a_container_of_its_own_and_a_clean_exit_ends_the_session() {
    let rig = Rig::new(2, 1 << 20);
    let sb = rig.sandbox().await;
    assert_eq!(
        rig.recorder.calls_of(&sb.id),
        [Call::CreateWorkspace(sb.id.clone())]
    );
    let mut events = Events::attach(&sb);
    let h = sb
        .spawn(brief(
            json!([{"emit": {"type": "status", "message": "hello"}}, {"exit": 0}]),
        ))
        .await
        .unwrap();
    assert_eq!(h.status, AgentStatus::Running);
    let seen = events
        .until("session_end", |e| lifecycle(e, "session_end"))
        .await;
    assert!(lifecycle(&seen[0], "started"), "{seen:#?}");
    assert!(
        seen.iter().any(|e| status_contains(e, "brief received")),
        "{seen:#?}"
    );
    assert!(
        seen.iter().any(|e| status_contains(e, "hello")),
        "{seen:#?}"
    );
    assert!(seen.iter().all(|e| e.run_id == h.session_id), "{seen:#?}");
    let cid = run_cid(&sb, 1);
    removed(&rig.recorder, &cid).await;
    assert_eq!(
        rig.recorder.calls_of(&cid),
        [
            Call::Create(cid.clone()),
            // cpuCores 1.5: the hard quota, in millicores.
            Call::CpuQuota(cid.clone(), 1500),
            Call::Launch(cid.clone()),
            Call::Remove(cid.clone()),
        ]
    );
    status_becomes(&sb, AgentStatus::Completed).await;
    // A second run gets a container of its own.
    sb.spawn(brief(json!([{"exit": 0}]))).await.unwrap();
    removed(&rig.recorder, &run_cid(&sb, 2)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pause_freezes_resume_thaws_and_health_reads_the_run_usage() {
    let rig = Rig::new(2, 1 << 20);
    rig.recorder.script(Script {
        oom_after: None,
        peak_memory_bytes: 48 << 20,
        cpu_time_ns: 0,
    });
    let (sb, mut events) = running_agent(&rig).await;
    let health = sb.health();
    assert_eq!(health.resource_usage.memory_mb, 48.0);
    assert_eq!(health.status, HealthStatus::Healthy);

    let state = sb.pause().await.unwrap();
    assert_eq!(sb.handle().status, AgentStatus::Paused);
    assert_eq!(state.checkpoint["frozen"], true);
    let cid = run_cid(&sb, 1);
    assert!(rig
        .recorder
        .calls_of(&cid)
        .contains(&Call::Freeze(cid.clone())));
    events.until("paused", |e| lifecycle(e, "paused")).await;
    // Paused twice is refused, and so is a resume of a running agent.
    assert!(matches!(
        sb.pause().await,
        Err(PluginError::InvalidState { .. })
    ));

    sb.resume(state).await.unwrap();
    assert_eq!(sb.handle().status, AgentStatus::Running);
    assert!(rig
        .recorder
        .calls_of(&cid)
        .contains(&Call::Thaw(cid.clone())));
    events.until("resumed", |e| lifecycle(e, "resumed")).await;
    // Thawed for real: the agent reads and answers its next command.
    let mut changes = serde_json::Map::new();
    changes.insert("role".into(), "Thawed".into());
    sb.update_brief(changes).await.unwrap();
    events
        .until("the echo", |e| status_contains(e, "Thawed"))
        .await;
    rig.agents.delete(&sb.id).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_without_grace_is_sigkill_and_no_crash() {
    let rig = Rig::new(2, 1 << 20);
    let (sb, mut events) = running_agent(&rig).await;
    let r = sb
        .kill(KillRequest {
            grace: false,
            grace_timeout_ms: None,
        })
        .await
        .unwrap();
    assert!(!r.clean_shutdown);
    assert!(r.state.is_none());
    let cid = run_cid(&sb, 1);
    let calls = rig.recorder.calls_of(&cid);
    assert!(
        calls.contains(&Call::Kill(cid.clone(), Signal::SIGKILL)),
        "{calls:?}"
    );
    assert!(
        !calls.contains(&Call::Kill(cid.clone(), Signal::SIGTERM)),
        "{calls:?}"
    );
    let seen = events.until("killed", |e| lifecycle(e, "killed")).await;
    assert!(!seen.iter().any(|e| lifecycle(e, "crashed")), "{seen:#?}");
    assert_eq!(sb.handle().status, AgentStatus::Completed);
    removed(&rig.recorder, &cid).await;
    // Nothing runs any more.
    assert!(matches!(
        sb.kill(KillRequest {
            grace: false,
            grace_timeout_ms: None
        })
        .await,
        Err(PluginError::InvalidState { .. })
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_with_grace_of_a_paused_agent_thaws_it_and_returns_its_state() {
    let rig = Rig::new(2, 1 << 20);
    let (sb, mut events) = running_agent(&rig).await;
    sb.pause().await.unwrap();
    let r = sb
        .kill(KillRequest {
            grace: true,
            grace_timeout_ms: Some(10_000),
        })
        .await
        .unwrap();
    // The agent got the shutdown line, wrote its state and exited 0 within the grace period.
    assert!(r.clean_shutdown);
    let state = r.state.expect("the agent's state");
    assert_eq!(state.checkpoint["agent"]["via"], "shutdown");
    let cid = run_cid(&sb, 1);
    let calls = rig.recorder.calls_of(&cid);
    let at = |c: &Call| calls.iter().position(|x| x == c);
    let (thaw, term) = (
        at(&Call::Thaw(cid.clone())),
        at(&Call::Kill(cid.clone(), Signal::SIGTERM)),
    );
    assert!(
        thaw.is_some() && thaw < term,
        "thaw before SIGTERM: {calls:?}"
    );
    assert!(
        !calls.contains(&Call::Kill(cid.clone(), Signal::SIGKILL)),
        "{calls:?}"
    );
    events.until("killed", |e| lifecycle(e, "killed")).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_that_exits_non_zero_has_crashed() {
    let rig = Rig::new(2, 1 << 20);
    let sb = rig.sandbox().await;
    let mut events = Events::attach(&sb);
    sb.spawn(brief(json!([{"exit": 3}]))).await.unwrap();
    let seen = events.until("crashed", |e| lifecycle(e, "crashed")).await;
    let crashed = seen.last().unwrap();
    assert_eq!(
        crashed.event["reason"], "the agent ended: exit status 3",
        "{crashed:#?}"
    );
    let error = events
        .until("agent_crashed", |e| {
            e.event.get("errorCode") == Some(&json!("agent_crashed"))
        })
        .await;
    assert_eq!(error.last().unwrap().event["severity"], "high");
    status_becomes(&sb, AgentStatus::Error).await;
    assert_eq!(sb.health().status, HealthStatus::Unhealthy);
    removed(&rig.recorder, &run_cid(&sb, 1)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_control_connection_is_a_crash_and_kills_the_run() {
    let rig = Rig::new(2, 1 << 20);
    let sb = rig.sandbox().await;
    let mut events = Events::attach(&sb);
    sb.spawn(brief(json!([{"close_socket": true}])))
        .await
        .unwrap();
    let seen = events.until("crashed", |e| lifecycle(e, "crashed")).await;
    let reason = seen.last().unwrap().event["reason"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(reason.contains("control connection dropped"), "{reason}");
    let cid = run_cid(&sb, 1);
    // The agent kept running (it sleeps a minute): the run was ended with SIGKILL.
    assert!(rig
        .recorder
        .calls_of(&cid)
        .contains(&Call::Kill(cid.clone(), Signal::SIGKILL)));
    status_becomes(&sb, AgentStatus::Error).await;
    removed(&rig.recorder, &cid).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delete_ends_the_run_removes_the_workspace_and_frees_the_sandbox_slot() {
    let rig = Rig::new(1, 1 << 20);
    let (sb, _events) = running_agent(&rig).await;
    // One sandbox at most: the next is refused, retryably.
    match rig
        .agents
        .create(create_request())
        .await
        .map_err(|r| r.error)
    {
        Err(PluginError::ProviderUnavailable { retryable, message }) => {
            assert!(retryable);
            assert!(message.contains("agents.max_sandboxes"), "{message}");
        }
        Err(e) => panic!("a second sandbox: {e:?}"),
        Ok(sb) => panic!("a second sandbox was created: {}", sb.id),
    }
    let dir = sb_dir(&rig, &sb);
    assert!(dir.join("code/control.sock").exists());
    assert!(rig.agents.delete(&sb.id).await);
    assert!(rig.agents.get(&sb.id).is_none());
    assert!(!rig.agents.delete(&sb.id).await);
    let cid = run_cid(&sb, 1);
    let calls = rig.recorder.calls_of(&cid);
    assert!(
        calls.contains(&Call::Kill(cid.clone(), Signal::SIGKILL)),
        "{calls:?}"
    );
    assert!(calls.contains(&Call::Remove(cid.clone())), "{calls:?}");
    assert!(rig
        .recorder
        .calls_of(&sb.id)
        .contains(&Call::RemoveWorkspace(sb.id.clone())));
    assert!(!dir.exists());
    // Its slot (host uid) is free again.
    let again = rig.sandbox().await;
    rig.agents.delete(&again.id).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_oversize_control_line_is_skipped_with_a_warning_and_the_run_goes_on() {
    let rig = Rig::new(2, 4096);
    let sb = rig.sandbox().await;
    let mut events = Events::attach(&sb);
    sb.spawn(brief(json!([
        {"big_line": 100_000},
        {"raw": "not json"},
        {"emit": {"type": "status", "message": "still alive"}},
    ])))
    .await
    .unwrap();
    let seen = events
        .until("still alive", |e| status_contains(e, "still alive"))
        .await;
    let codes: Vec<Option<&Value>> = seen.iter().map(|e| e.event.get("errorCode")).collect();
    let too_long = codes
        .iter()
        .position(|c| *c == Some(&json!("control_line_too_long")));
    let malformed = codes
        .iter()
        .position(|c| *c == Some(&json!("malformed_event")));
    assert!(too_long.is_some() && too_long < malformed, "{seen:#?}");
    let warning = &seen[too_long.unwrap()].event;
    assert_eq!(warning["agentId"], "agent-1");
    assert_eq!(warning["severity"], "warning");
    assert_eq!(sb.handle().status, AgentStatus::Running);
    rig.agents.delete(&sb.id).await;
}

fn sb_dir(rig: &Rig, sb: &Sandbox) -> std::path::PathBuf {
    rig._dir.path().join("state/agents").join(&sb.id)
}

/// The agent routes check the bearer token before anything else: every route, a wrong method on one and a path that
/// is no endpoint answer 401 without it (a PluginError body), and only then 404 or 405.
#[tokio::test]
async fn the_token_is_checked_before_every_route_its_wrong_methods_and_unknown_paths() {
    use axum::body::Body;
    use axum::http::{Request, StatusCode};
    use http_body_util::BodyExt;
    use tower::ServiceExt;

    let rig = Rig::new(2, 1 << 20);
    let app = crate::router(rig.agents.clone()).with_state(rig.agents.clone());
    let send = |method: &str, uri: &str, token: Option<&str>| {
        let mut request = Request::builder().method(method).uri(uri);
        if let Some(t) = token {
            request = request.header("authorization", format!("Bearer {t}"));
        }
        let request = request.body(Body::from("{}")).unwrap();
        let app = app.clone();
        async move {
            let response = app.oneshot(request).await.unwrap();
            let status = response.status();
            let body = response.into_body().collect().await.unwrap().to_bytes();
            (status, String::from_utf8_lossy(&body).into_owned())
        }
    };
    let calls = [
        ("POST", "/sandboxes"),
        ("DELETE", "/sandboxes/nope"),
        ("GET", "/sandboxes/nope/health"),
        ("POST", "/sandboxes/nope/spawn"),
        ("GET", "/sandboxes/nope/no-such-endpoint"),
        ("PUT", "/volumes"),
        ("GET", "/snapshots"),
    ];
    for (method, uri) in calls {
        for token in [None, Some("wrong")] {
            let (status, body) = send(method, uri, token).await;
            assert_eq!(
                status,
                StatusCode::UNAUTHORIZED,
                "{method} {uri} {token:?}: {body}"
            );
            assert!(body.contains("bearer token"), "{method} {uri}: {body}");
        }
    }
    assert_eq!(
        send("GET", "/sandboxes/nope/health", Some("t")).await.0,
        StatusCode::NOT_FOUND
    );
    assert_eq!(
        send("GET", "/sandboxes/nope/no-such-endpoint", Some("t"))
            .await
            .0,
        StatusCode::NOT_FOUND
    );
    assert_eq!(
        send("PUT", "/volumes", Some("t")).await.0,
        StatusCode::METHOD_NOT_ALLOWED
    );
}

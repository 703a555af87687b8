//! The engine's paths on the recording fake backend ([`containers::fake`]): no root, no containers.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use nix::sys::signal::Signal;
use protocol::{
    ExecStatus, ExecuteRequest, Isolation, Language, Limits, Reason, RequestedLimits, ServerMessage,
};
use tokio::sync::mpsc;

use super::Engine;
use crate::config::Config;
use crate::daemon::Daemon;
use crate::exec::pool::{Factory, Pool, Uids};
use crate::exec::registry::Registry;
use crate::storage::store::Store;
use containers::fake::{shell, Call, FakeBackend, Recorder, Script};
use containers::image::LanguageRuntime;

/// How long any one test execution may take before the test fails (the paths under test take milliseconds).
const PATIENCE: Duration = Duration::from_secs(20);

/// An engine (and its pool of `pool_size`) over the fake backend, with its files under `root`.
pub struct Harness {
    /// The engine.
    pub engine: Arc<Engine>,
    /// What the backend was asked to do.
    pub recorder: Arc<Recorder>,
}

impl Harness {
    /// Builds the engine; must be called inside a tokio runtime (the pool's refill tasks start).
    pub fn new(root: &Path, pool_size: usize) -> Self {
        let recorder = Arc::new(Recorder::default());
        let config = Config::default();
        let max = config.limits.max;
        let languages: BTreeMap<Language, LanguageRuntime> =
            [(Language::Shell, shell())].into_iter().collect();
        let factory = Arc::new(Factory::with_backend(
            Box::new(FakeBackend::new(&root.join("containers"), recorder.clone())),
            max,
            Uids::new(900_000, 64),
        ));
        let pool = Arc::new(Pool::new(factory, pool_size, &languages));
        pool.start(&languages);
        let store = Store::open(&root.join("store"), Duration::from_secs(3600), 1 << 30).unwrap();
        let isolation = Isolation {
            namespaces: Vec::new(),
            cgroup_version: "v2".into(),
            seccomp: false,
            landlock_abi: None,
            user_namespace: false,
            network: "none".into(),
        };
        let daemon = Arc::new(Daemon::new(config, Arc::new(store)));
        let engine = Engine::new(daemon, pool, languages, isolation, "fake".into(), None);
        Self {
            engine: Arc::new(engine),
            recorder,
        }
    }

    /// The largest limits, for requests that pick their own.
    pub fn max_limits(&self) -> Limits {
        self.engine.max_limits()
    }
}

fn request(id: &str, code: &str, timeout_ms: u64) -> ExecuteRequest {
    ExecuteRequest::new(
        id,
        Language::Shell,
        code,
        RequestedLimits::new(timeout_ms, 64),
    )
}

/// An execution under way: its messages, and the connection's side (registry) to cancel or leave.
struct Running {
    registry: Registry,
    rx: mpsc::Receiver<ServerMessage>,
    task: tokio::task::JoinHandle<()>,
}

fn start(h: &Harness, req: ExecuteRequest) -> Running {
    let registry = Registry::default();
    let (registration, control) = registry.register(&req.id).unwrap();
    let limits = req.resolve_limits(&h.max_limits()).unwrap();
    let admission = h.engine.admit();
    let (tx, rx) = mpsc::channel(64);
    let task =
        tokio::spawn(
            h.engine
                .clone()
                .run(req, limits, admission, tx, control, registration),
        );
    Running { registry, rx, task }
}

impl Running {
    /// Reads messages until `status: running`.
    async fn until_running(&mut self) {
        loop {
            match tokio::time::timeout(PATIENCE, self.rx.recv()).await {
                Ok(Some(ServerMessage::Status {
                    status: ExecStatus::Running,
                    ..
                })) => return,
                Ok(Some(_)) => {}
                other => panic!("no running status: {other:?}"),
            }
        }
    }

    /// Every message to the end, then waits for the execution's task and its container's removal.
    async fn finish(mut self, h: &Harness) -> Vec<ServerMessage> {
        let mut all = Vec::new();
        while let Some(m) = tokio::time::timeout(PATIENCE, self.rx.recv())
            .await
            .expect("the execution ended in time")
        {
            all.push(m);
        }
        tokio::time::timeout(PATIENCE, self.task)
            .await
            .unwrap()
            .unwrap();
        h.engine.pool().factory().removals_done().await;
        drop(self.registry);
        all
    }
}

fn result(messages: &[ServerMessage]) -> &protocol::ResultMessage {
    messages
        .iter()
        .find_map(|m| match m {
            ServerMessage::Result(r) => Some(r),
            _ => None,
        })
        .unwrap_or_else(|| panic!("no result in {messages:?}"))
}

fn terminal_status(messages: &[ServerMessage]) -> Option<ExecStatus> {
    messages.iter().rev().find_map(|m| match m {
        ServerMessage::Status { status, .. } if *status != ExecStatus::Running => Some(*status),
        _ => None,
    })
}

fn stdout(messages: &[ServerMessage]) -> String {
    messages
        .iter()
        .filter_map(|m| match m {
            ServerMessage::Stdout(c) => Some(c.data.as_str()),
            _ => None,
        })
        .collect()
}

/// The one container the harness created (no pool), and the calls about it.
fn only_container(h: &Harness) -> (String, Vec<Call>) {
    let created = h.recorder.created();
    assert_eq!(created.len(), 1, "{:?}", h.recorder.calls());
    let cid = created[0].clone();
    let calls = h.recorder.calls_of(&cid);
    (cid, calls)
}

fn kills(calls: &[Call]) -> Vec<Signal> {
    calls
        .iter()
        .filter_map(|c| match c {
            Call::Kill(_, s) => Some(*s),
            _ => None,
        })
        .collect()
}

fn removals(calls: &[Call]) -> usize {
    calls
        .iter()
        .filter(|c| matches!(c, Call::Remove(_)))
        .count()
}

#[tokio::test]
async fn a_program_that_exits_is_reported_with_its_code_and_output_and_removed_once() {
    let dir = tempfile::tempdir().unwrap();
    let h = Harness::new(dir.path(), 0);
    let messages = start(&h, request("plain", "echo hello; exit 3", 10_000))
        .finish(&h)
        .await;
    let r = result(&messages);
    assert_eq!((r.reason, r.exit_code), (Reason::Exited, Some(3)));
    assert_eq!(terminal_status(&messages), Some(ExecStatus::Failed));
    assert_eq!(stdout(&messages), "hello\n");
    assert_eq!(r.stdout_bytes, 6);
    let (cid, calls) = only_container(&h);
    // The request's limits (64 MiB) are written before the launch; nothing is killed.
    let Call::SetLimits(_, limits) = &calls[1] else {
        panic!("{calls:?}")
    };
    assert_eq!(limits.memory_bytes, 64 << 20);
    assert_eq!(
        calls,
        vec![
            Call::Create(cid.clone()),
            Call::SetLimits(cid.clone(), *limits),
            Call::Launch(cid.clone()),
            Call::Remove(cid),
        ]
    );
}

#[tokio::test]
async fn on_timeout_the_container_is_killed_and_removed_exactly_once() {
    let dir = tempfile::tempdir().unwrap();
    let h = Harness::new(dir.path(), 0);
    let t0 = std::time::Instant::now();
    let messages = start(&h, request("slow", "sleep 30", 300)).finish(&h).await;
    assert!(t0.elapsed() < Duration::from_secs(10), "{:?}", t0.elapsed());
    let r = result(&messages);
    assert_eq!(
        (r.reason, r.signal.as_deref()),
        (Reason::Timeout, Some("SIGKILL"))
    );
    assert_eq!(terminal_status(&messages), Some(ExecStatus::Timeout));
    assert!(r.duration_ms >= 300, "{}", r.duration_ms);
    let (_, calls) = only_container(&h);
    assert_eq!(kills(&calls), vec![Signal::SIGKILL], "{calls:?}");
    assert_eq!(removals(&calls), 1, "{calls:?}");
    assert!(matches!(calls.last(), Some(Call::Remove(_))), "{calls:?}");
}

#[tokio::test]
async fn cancel_kills_reports_cancelled_and_removes() {
    let dir = tempfile::tempdir().unwrap();
    let h = Harness::new(dir.path(), 0);
    let mut run = start(&h, request("to-cancel", "sleep 30", 60_000));
    run.until_running().await;
    assert_eq!(run.registry.cancel("to-cancel"), Some(true));
    let messages = run.finish(&h).await;
    let r = result(&messages);
    assert_eq!(r.reason, Reason::Cancelled);
    assert_eq!(terminal_status(&messages), Some(ExecStatus::Cancelled));
    let (_, calls) = only_container(&h);
    assert_eq!(kills(&calls), vec![Signal::SIGKILL], "{calls:?}");
    assert_eq!(removals(&calls), 1, "{calls:?}");
}

#[tokio::test]
async fn a_gone_client_gets_its_program_killed_and_its_container_removed() {
    let dir = tempfile::tempdir().unwrap();
    let h = Harness::new(dir.path(), 0);
    let mut run = start(&h, request("left", "sleep 30", 60_000));
    run.until_running().await;
    // The connection closes: its registry drops every control sender, and nobody reads the messages.
    run.registry.disconnect();
    let Running { rx, task, .. } = run;
    drop(rx);
    tokio::time::timeout(PATIENCE, task).await.unwrap().unwrap();
    h.engine.pool().factory().removals_done().await;
    let (_, calls) = only_container(&h);
    assert_eq!(kills(&calls), vec![Signal::SIGKILL], "{calls:?}");
    assert_eq!(removals(&calls), 1, "{calls:?}");
    assert_eq!(
        h.engine.load().active_executions,
        0,
        "the slot is free again"
    );
}

#[tokio::test]
async fn over_the_output_limit_exactly_the_limit_is_delivered_and_the_program_killed() {
    let dir = tempfile::tempdir().unwrap();
    let h = Harness::new(dir.path(), 0);
    let mut req = request("chatty", "yes abcdefgh", 60_000);
    req.limits.max_output_bytes = Some(1000);
    let messages = start(&h, req).finish(&h).await;
    let r = result(&messages);
    assert_eq!(r.reason, Reason::OutputLimit);
    assert_eq!(terminal_status(&messages), Some(ExecStatus::Failed));
    assert!(r.truncated);
    assert_eq!(r.stdout_bytes + r.stderr_bytes, 1000);
    let out = stdout(&messages);
    assert_eq!(out.len(), 1000);
    assert!(out.starts_with("abcdefgh\nabcdefgh\n"), "{out:.40}");
    let (_, calls) = only_container(&h);
    assert_eq!(kills(&calls), vec![Signal::SIGKILL], "{calls:?}");
    assert_eq!(removals(&calls), 1, "{calls:?}");
}

#[tokio::test]
async fn an_oom_kill_is_reported_as_oom_without_a_kill_of_ours() {
    let dir = tempfile::tempdir().unwrap();
    let h = Harness::new(dir.path(), 0);
    h.recorder.script(Script {
        oom_after: Some(Duration::from_millis(100)),
        peak_memory_bytes: 64 << 20,
        cpu_time_ns: 5_000_000,
    });
    let messages = start(&h, request("hungry", "sleep 30", 60_000))
        .finish(&h)
        .await;
    let r = result(&messages);
    assert_eq!(
        (r.reason, r.signal.as_deref()),
        (Reason::Oom, Some("SIGKILL"))
    );
    assert_eq!(terminal_status(&messages), Some(ExecStatus::Oom));
    assert_eq!(r.resource_usage.peak_memory_mb, 64);
    assert_eq!(r.resource_usage.cpu_time_ms, 5);
    let (_, calls) = only_container(&h);
    assert!(kills(&calls).is_empty(), "{calls:?}");
    assert_eq!(removals(&calls), 1, "{calls:?}");
}

#[tokio::test]
async fn executions_take_warm_containers_each_used_once() {
    let dir = tempfile::tempdir().unwrap();
    let h = Harness::new(dir.path(), 2);
    for i in 0..4 {
        // Each execution finds the pool refilled (the refill waits for the previous execution's end).
        tokio::time::timeout(PATIENCE, async {
            while h.engine.pool().ready() < 2 {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
        .await
        .unwrap();
        let messages = start(&h, request(&format!("warm-{i}"), "echo ok", 10_000))
            .finish(&h)
            .await;
        assert_eq!(result(&messages).reason, Reason::Exited);
    }
    let calls = h.recorder.calls();
    let launched: Vec<&String> = calls
        .iter()
        .filter_map(|c| match c {
            Call::Launch(cid) => Some(cid),
            _ => None,
        })
        .collect();
    assert_eq!(launched.len(), 4);
    for cid in &launched {
        let mine = h.recorder.calls_of(cid);
        assert_eq!(
            mine.iter().filter(|c| matches!(c, Call::Launch(_))).count(),
            1,
            "{mine:?}"
        );
        assert_eq!(removals(&mine), 1, "{mine:?}");
    }
    let pool = h.engine.pool().status();
    assert_eq!(pool["hits"], 4, "{pool}");
    assert_eq!(pool["misses"], 0, "{pool}");
}

/// A program's tool calls are waiting for room in the client's queue (full of its output) when it is cancelled:
/// none of them reaches the client after the kill, not even once the client reads again. (Timeout, cancel, a gone
/// client and the program's exit all end the broker the same way; a cancel makes the moment the test's.)
#[tokio::test]
async fn no_tool_call_is_queued_after_the_kill() {
    if !nix::unistd::geteuid().is_root() {
        // The tool socket is given to the container's uid.
        test_support::cannot_run(
            "no_tool_call_is_queued_after_the_kill",
            "needs root to chown the tool socket",
        );
        return;
    }
    use tokio::io::AsyncWriteExt;

    let dir = tempfile::tempdir().unwrap();
    let h = Harness::new(dir.path(), 0);
    let mut req = request("tq", "while :; do echo x; done", 30_000);
    req.tools = vec![protocol::ToolSpec::new("echo")];
    let registry = Registry::default();
    let (registration, control) = registry.register(&req.id).unwrap();
    let inbox = registration.tool_inbox();
    let limits = req.resolve_limits(&h.max_limits()).unwrap();
    let (tx, rx) = mpsc::channel(64);
    let task = tokio::spawn(h.engine.clone().run(
        req,
        limits,
        h.engine.admit(),
        tx,
        control,
        registration,
    ));
    let mut run = Running { registry, rx, task };
    run.until_running().await;
    let cid = h.recorder.created()[0].clone();
    let socket = dir
        .path()
        .join("containers")
        .join(&cid)
        .join("code")
        .join(crate::extensions::tools::SOCKET_NAME);
    // 8 connections, each with 40 calls waiting to be read.
    let mut conns = Vec::new();
    for _ in 0..8 {
        let mut c = tokio::net::UnixStream::connect(&socket).await.unwrap();
        c.write_all(
            "{\"op\":\"call\",\"name\":\"echo\"}\n"
                .repeat(40)
                .as_bytes(),
        )
        .await
        .unwrap();
        conns.push(c);
    }
    // Calls are answered (by call_id, without reading them) but nobody reads: the queue fills up with output and
    // calls, then the calls after the answered ones wait for room.
    let mut next = 1;
    let answer = |n: usize| {
        inbox.deliver(protocol::ToolResult::success(
            "tq",
            format!("c{n}"),
            serde_json::Value::Null,
        ))
    };
    while run.rx.len() < run.rx.max_capacity() {
        if answer(next) {
            next += 1;
        } else {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }
    while answer(next) {
        next += 1;
    }
    assert_eq!(run.registry.cancel("tq"), Some(true));
    // The kill is decided: on this thread the engine's task has gone on past it.
    while kills(&h.recorder.calls_of(&cid)).is_empty() {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let queued = run.rx.len();
    let messages = run.finish(&h).await;
    let late: Vec<_> = messages[queued..]
        .iter()
        .filter(|m| matches!(m, ServerMessage::ToolCall(_)))
        .collect();
    assert!(late.is_empty(), "{} tool_call after the kill", late.len());
    let sent = messages
        .iter()
        .filter(|m| matches!(m, ServerMessage::ToolCall(_)))
        .count();
    assert_eq!(result(&messages).tool_calls, Some(sent as u64));
    assert_eq!(terminal_status(&messages), Some(ExecStatus::Cancelled));
    drop(conns);
}

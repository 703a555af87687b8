//! A fleet of three real daemons, each in its own network namespace with its own address on a bridge, state
//! directory, port, cgroup parent and uid range (real daemon, root): spread under uniform load, less to a busy
//! node, a node SIGKILLed mid-run and restarted, a node partitioned and healed. Every execution is counted: it
//! ends in a result or a typed error, none hangs.

use std::sync::Arc;
use std::time::Duration;

use client::{
    new_execution_id, ClientError, Discovery, Execute, ExecuteRequest, Fleet, Language, NodeHealth,
    Pool, RequestedLimits,
};
use futures_util::stream::{self, StreamExt};

use super::daemon::wait_until;
use super::k8s_stub::ApiStub;
use super::netns::{hosts, Hosts};
use super::sandboxctl::ctl_env;

/// Per-execution guard: one that has not ended after this long counts as hung (a failure).
const HUNG: Duration = Duration::from_secs(60);

/// A fleet over the hosts that checks every 200 ms and ejects after two failures.
async fn fleet_of(hosts: &Hosts) -> Fleet {
    Fleet::builder(Discovery::Static(hosts.urls()))
        .pool(
            Pool::builder("")
                .token(hosts.token.clone())
                .size(4)
                .max_overflow(16)
                .connect_timeout(Duration::from_secs(1))
                .health_check_timeout(Duration::from_millis(500)),
        )
        .check_interval(Duration::from_millis(200))
        .check_timeout(Duration::from_millis(500))
        .eject_after(2)
        .eject_backoff(Duration::from_millis(200), Duration::from_secs(1))
        .build()
        .await
        .unwrap()
}

fn shell(code: &str) -> ExecuteRequest {
    ExecuteRequest::new(
        new_execution_id(),
        Language::Shell,
        code,
        RequestedLimits::new(30_000, 64),
    )
}

/// How a batch of executions ended.
#[derive(Debug, Default)]
struct Outcomes {
    ok: usize,
    node_lost: usize,
    other: Vec<String>,
    hung: usize,
}

impl Outcomes {
    fn total(&self) -> usize {
        self.ok + self.node_lost + self.other.len() + self.hung
    }
}

/// Runs `n` copies of `code` through `fleet`, `concurrency` at a time, and counts how each ended.
async fn run(fleet: &Fleet, n: usize, concurrency: usize, code: &str) -> Outcomes {
    let results: Vec<_> = stream::iter(0..n)
        .map(|_| tokio::time::timeout(HUNG, fleet.execute(shell(code))))
        .buffer_unordered(concurrency)
        .collect()
        .await;
    let mut out = Outcomes::default();
    for r in results {
        match r {
            Ok(Ok(r)) if r.success() && r.stdout_text() == "ok\n" => out.ok += 1,
            Ok(Ok(r)) => out.other.push(format!("{r:?}")),
            Ok(Err(ClientError::NodeLost { .. })) => out.node_lost += 1,
            Ok(Err(e)) => out.other.push(e.to_string()),
            Err(_) => out.hung += 1,
        }
    }
    out
}

fn placed(fleet: &Fleet) -> Vec<u64> {
    fleet.status().iter().map(|s| s.placed).collect()
}

async fn wait_health(fleet: &Fleet, node: usize, want: NodeHealth) {
    wait_until(
        &format!("node {node} {want:?}"),
        Duration::from_secs(30),
        || {
            let now = fleet.status()[node].clone();
            async move {
                if now.health == want {
                    Ok(())
                } else {
                    Err(format!("{now:?}"))
                }
            }
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn uniform_load_spreads_evenly_over_three_hosts() {
    let Some(hosts) = hosts("uniform_load_spreads_evenly_over_three_hosts", 4).await else {
        return;
    };
    let fleet = fleet_of(&hosts).await;
    let out = run(&fleet, 120, 9, "sleep 0.1; echo ok").await;
    assert_eq!((out.ok, out.total()), (120, 120), "{out:?}");
    let placed = placed(&fleet);
    let (max, min) = (*placed.iter().max().unwrap(), *placed.iter().min().unwrap());
    eprintln!(
        "uniform load: placed per node {placed:?}, max/min {:.2}",
        max as f64 / min.max(1) as f64
    );
    assert_eq!(placed.iter().sum::<u64>(), 120, "{placed:?}");
    assert!(max as f64 <= 1.5 * min as f64, "{placed:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_busy_host_receives_less() {
    let Some(hosts) = hosts("a_busy_host_receives_less", 4).await else {
        return;
    };
    // Host 0's four slots are taken by long programs run around the fleet.
    let direct = Pool::builder(hosts.daemons[0].url())
        .token(hosts.token.clone())
        .build()
        .unwrap();
    let mut long = Vec::new();
    for _ in 0..4 {
        long.push(direct.execute_stream(shell("sleep 60")).await.unwrap());
    }
    let fleet = fleet_of(&hosts).await;
    wait_until("host 0 to report its load", Duration::from_secs(10), || {
        let load = fleet.status()[0].load;
        async move {
            match load {
                Some(l) if l.active_executions >= 4 => Ok(()),
                other => Err(format!("{other:?}")),
            }
        }
    })
    .await;
    let out = run(&fleet, 60, 6, "sleep 0.1; echo ok").await;
    assert_eq!((out.ok, out.total()), (60, 60), "{out:?}");
    let placed = placed(&fleet);
    eprintln!("busy host 0: placed per node {placed:?}");
    assert!(placed[0] * 4 < placed[1].min(placed[2]), "{placed:?}");
    drop(long);
}

/// Runs 60 one-second executions over the hosts, breaks host `node` with `fail` once the batch is under way and
/// the host has an execution in flight (1 s in at the earliest), and checks that every execution ended in a result
/// or `NodeLost` (at least one: the host had executions in flight), none hung, and nothing was placed on the host
/// after its ejection. Then `recover`s it and checks it is re-admitted and placed on again.
async fn break_mid_run(
    mut hosts: Hosts,
    node: usize,
    what: &str,
    fail: impl FnOnce(&mut Hosts),
    recover: impl AsyncFnOnce(&mut Hosts),
) {
    let fleet = Arc::new(fleet_of(&hosts).await);
    let batch = {
        let fleet = fleet.clone();
        tokio::spawn(async move { run(&fleet, 60, 9, "sleep 1; echo ok").await })
    };
    // A fixed delay raced the host's own executions: on a loaded machine its first ones had all ended by then.
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while fleet.status()[node].in_flight == 0 && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    fail(&mut hosts);
    wait_health(&fleet, node, NodeHealth::Ejected).await;
    let placed_at_ejection = placed(&fleet)[node];
    let out = batch.await.unwrap();
    eprintln!(
        "host {node} {what} mid-run: {out:?}, placed {:?}",
        placed(&fleet)
    );
    assert_eq!(out.total(), 60);
    assert_eq!((out.other.len(), out.hung), (0, 0), "{out:?}");
    assert!(
        out.node_lost >= 1,
        "host {node} had executions in flight: {out:?}"
    );
    assert_eq!(out.ok + out.node_lost, 60, "{out:?}");
    assert_eq!(
        placed(&fleet)[node],
        placed_at_ejection,
        "placed on an ejected node"
    );
    recover(&mut hosts).await;
    wait_health(&fleet, node, NodeHealth::Healthy).await;
    let before = placed(&fleet)[node];
    let out = run(&fleet, 30, 6, "echo ok").await;
    assert_eq!((out.ok, out.total()), (30, 30), "{out:?}");
    assert!(placed(&fleet)[node] > before, "{:?}", fleet.status());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_host_killed_mid_run_loses_no_execution_and_is_readmitted_after_restart() {
    let test = "a_host_killed_mid_run_loses_no_execution_and_is_readmitted_after_restart";
    let Some(hosts) = hosts(test, 4).await else {
        return;
    };
    break_mid_run(
        hosts,
        1,
        "SIGKILLed",
        |h| h.daemons[1].kill_hard(),
        // Restarted on the same address, port and state.
        async |h| h.daemons[1].restart().await,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_partitioned_host_is_ejected_and_readmitted_when_its_link_returns() {
    let test = "a_partitioned_host_is_ejected_and_readmitted_when_its_link_returns";
    let Some(hosts) = hosts(test, 4).await else {
        return;
    };
    break_mid_run(
        hosts,
        2,
        "partitioned (link down)",
        |h| h.net.partition(2),
        async |h| h.net.heal(2),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sandboxctl_runs_on_a_fleet_and_reports_each_node() {
    let test = "sandboxctl_runs_on_a_fleet_and_reports_each_node";
    let Some(mut hosts) = hosts(test, 4).await else {
        return;
    };
    let endpoints = hosts.urls().join(",");
    let token = hosts.token.clone();
    let out = ctl_env(
        &["--endpoints", &endpoints, "fleet", "status", "--json"],
        None,
        &[("SANDBOXD_TOKEN", &token)],
    )
    .await;
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    let nodes: Vec<serde_json::Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(nodes.len(), 3, "{nodes:?}");
    for (node, url) in nodes.iter().zip(hosts.urls()) {
        assert_eq!(node["url"], url.as_str());
        assert_eq!(node["health"], "healthy", "{node}");
        assert_eq!(node["version"], env!("CARGO_PKG_VERSION"), "{node}");
        assert_eq!(node["capacity"], 4, "{node}");
    }
    // The environment names the fleet too.
    for _ in 0..6 {
        let out = ctl_env(
            &["exec", "-l", "shell", "--code", "echo ok"],
            None,
            &[
                ("SANDBOXD_ENDPOINTS", &endpoints),
                ("SANDBOXD_TOKEN", &token),
            ],
        )
        .await;
        assert_eq!(
            (out.status.code(), out.stdout.as_slice()),
            (Some(0), &b"ok\n"[..]),
            "{out:?}"
        );
    }
    // A dead node: exec still succeeds elsewhere; status says which node and why, and exits 69.
    hosts.daemons[0].kill_hard();
    for _ in 0..6 {
        let out = ctl_env(
            &[
                "--endpoints",
                &endpoints,
                "exec",
                "-l",
                "shell",
                "--code",
                "echo ok",
            ],
            None,
            &[("SANDBOXD_TOKEN", &token)],
        )
        .await;
        assert_eq!(out.status.code(), Some(0), "{out:?}");
    }
    let out = ctl_env(
        &["--endpoints", &endpoints, "fleet", "status"],
        None,
        &[("SANDBOXD_TOKEN", &token)],
    )
    .await;
    assert_eq!(out.status.code(), Some(69), "{out:?}");
    let table = String::from_utf8_lossy(&out.stdout).into_owned();
    let first = table
        .lines()
        .find(|l| l.starts_with(&hosts.urls()[0]))
        .unwrap();
    assert!(
        !first.contains("\thealthy\t") && first.contains("Cannot connect"),
        "{table}"
    );
    assert_eq!(table.matches("\thealthy\t").count(), 2, "{table}");
}

/// The address of `ws://IP:PORT/ws`.
fn socket_addr(url: &str) -> std::net::SocketAddr {
    url.trim_start_matches("ws://")
        .trim_end_matches("/ws")
        .parse()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn kubernetes_discovery_follows_a_slice_change_under_load() {
    let test = "kubernetes_discovery_follows_a_slice_change_under_load";
    let Some(hosts) = hosts(test, 4).await else {
        return;
    };
    let nodes: Vec<_> = hosts.urls().iter().map(|u| socket_addr(u)).collect();
    let api = ApiStub::start().await;
    let serve = |which: &[(usize, bool)]| {
        let endpoints: Vec<_> = which.iter().map(|&(i, ready)| (nodes[i], ready)).collect();
        api.serve(&endpoints);
    };
    serve(&[(0, true), (1, true), (2, false)]);
    let dir = tempfile::tempdir().unwrap();
    let token = dir.path().join("token");
    std::fs::write(&token, "t\n").unwrap();
    let fleet = Arc::new(
        Fleet::builder(Discovery::Kubernetes(api.discovery(&token)))
            .pool(
                Pool::builder("")
                    .token(hosts.token.clone())
                    .size(4)
                    .max_overflow(16),
            )
            .check_interval(Duration::from_millis(200))
            .build()
            .await
            .unwrap(),
    );
    assert_eq!(fleet.endpoints().len(), 2, "{:?}", fleet.endpoints());
    let batch = {
        let fleet = fleet.clone();
        tokio::spawn(async move { run(&fleet, 90, 9, "sleep 0.2; echo ok").await })
    };
    tokio::time::sleep(Duration::from_millis(800)).await;
    // Host 0 leaves (its pod terminating: not ready), host 2 becomes ready.
    serve(&[(0, false), (1, true), (2, true)]);
    let out = batch.await.unwrap();
    let status = fleet.status();
    eprintln!(
        "kubernetes slice change under load: {out:?}, nodes {:?}",
        status
            .iter()
            .map(|s| (&s.url, s.placed))
            .collect::<Vec<_>>()
    );
    assert_eq!((out.ok, out.total()), (90, 90), "{out:?}");
    let mut endpoints = fleet.endpoints();
    endpoints.sort();
    let mut want = vec![hosts.urls()[1].clone(), hosts.urls()[2].clone()];
    want.sort();
    assert_eq!(endpoints, want);
    let joined = status.iter().find(|s| s.url == hosts.urls()[2]).unwrap();
    assert!(joined.placed > 0, "{status:?}");
}

/// Agent sandboxes placed on the fleet: spread over the hosts, each client's endpoints naming its own host (its
/// health answers there; another host would not know the id); hosts at their sandbox limit are skipped until
/// none is left (a typed `NoNode`, nothing created twice); a SIGKILLed host is skipped, and every sandbox is
/// deleted on its own host.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn agent_sandboxes_are_placed_on_the_fleet_and_reached_on_their_hosts() {
    use client::gateway::GatewayError;
    let test = "agent_sandboxes_are_placed_on_the_fleet_and_reached_on_their_hosts";
    let Some(mut hosts) = hosts(test, 4).await else {
        return;
    };
    let fleet = fleet_of(&hosts).await;
    let req = super::agents::create_request(9, 3600);
    let urls = hosts.urls();
    let host_of = |sb: &client::gateway::SandboxClient| {
        let hostport = sb
            .transport
            .rpc_endpoint
            .trim_start_matches("http://")
            .split('/')
            .next()
            .unwrap()
            .to_owned();
        urls.iter()
            .position(|u| u.contains(&format!("//{hostport}/")))
            .unwrap_or_else(|| panic!("{hostport} is none of {urls:?}"))
    };
    let mut sandboxes = Vec::new();
    for _ in 0..12 {
        sandboxes.push(fleet.create_sandbox(&req).await.unwrap());
    }
    let mut per_host = [0usize; 3];
    for sb in &sandboxes {
        per_host[host_of(sb)] += 1;
        sb.health().await.unwrap();
    }
    eprintln!("agent sandboxes placed per host: {per_host:?}");
    assert!(
        per_host.iter().filter(|n| **n > 0).count() >= 2,
        "{per_host:?}"
    );

    // Until every host is at its limit (16 each): the full ones are skipped, then none is left.
    let refused = loop {
        match fleet.create_sandbox(&req).await {
            Ok(sb) => sandboxes.push(sb),
            Err(e) => break e,
        }
        assert!(sandboxes.len() <= 48, "more sandboxes than the hosts allow");
    };
    assert_eq!(sandboxes.len(), 48, "{refused}");
    assert!(
        matches!(refused, GatewayError::NoNode { tried: 3, .. }),
        "{refused:?}"
    );
    assert!(refused.is_retryable());

    // A host killed: after its sandboxes are gone elsewhere, new ones land on the others only.
    for sb in sandboxes.drain(..) {
        sb.delete().await.unwrap();
    }
    hosts.daemons[0].kill_hard();
    for _ in 0..6 {
        let sb = fleet.create_sandbox(&req).await.unwrap();
        assert_ne!(host_of(&sb), 0, "placed on the killed host");
        sandboxes.push(sb);
    }
    for sb in sandboxes {
        sb.delete().await.unwrap();
    }
}

//! The fleet's retry rules and discovery against scripted fake servers (run anywhere): a refusal or a dropped
//! connection before `ack` moves the execution to another node, exactly once per node; a node lost after `ack`
//! ends it with `NodeLost` and it is not sent again; DNS discovery follows a local nameserver's answers.
//!
//! The fakes serve no `/healthz`, so their checks fail: these fleets eject only after many failures in a row.

use std::collections::HashMap;
use std::net::Ipv4Addr;
use std::sync::Arc;
use std::time::Duration;

use client::{ClientError, Discovery, DnsDiscovery, Execute, Fleet};
use serde_json::json;
use test_support::dns::Nameserver;

use super::fake::{self, FakeServer, Reply};

fn request() -> client::ExecuteRequest {
    fake::hi_request()
}

async fn fleet_of(urls: Vec<String>) -> Fleet {
    fake::fleet_of_fakes(Discovery::Static(urls))
        .build()
        .await
        .unwrap()
}

fn overloaded(msg: &serde_json::Value) -> Vec<Reply> {
    match msg["type"].as_str() {
        Some("ping") => vec![fake::pong()],
        Some("execute") => vec![Reply::Json(json!({"v":1,"type":"error","id":msg["id"],
            "code":"SANDBOX_OVERLOADED","message":"queue full","retryable":true,"ts":fake::ts()}))],
        _ => vec![],
    }
}

/// How many times each execution id reached `server`.
fn executes_by_id(server: &FakeServer) -> HashMap<String, usize> {
    let mut by_id = HashMap::new();
    for m in server.received_of("execute") {
        *by_id
            .entry(m["id"].as_str().unwrap().to_owned())
            .or_default() += 1;
    }
    by_id
}

#[tokio::test]
async fn an_overloaded_refusal_is_placed_on_another_node() {
    let busy = FakeServer::start(Arc::new(|_, m| overloaded(m))).await;
    let free = FakeServer::start(Arc::new(|_, m| fake::standard(m))).await;
    let fleet = fleet_of(vec![busy.url(), free.url()]).await;
    for _ in 0..20 {
        let r = fleet.execute(request()).await.unwrap();
        assert_eq!(r.stdout_text(), "hi\n");
    }
    let ran = executes_by_id(&free);
    assert_eq!(ran.len(), 20);
    assert!(ran.values().all(|&n| n == 1), "{ran:?}");
    // Every refusal was retried, once, on the free node.
    let refused = executes_by_id(&busy);
    assert!(refused.keys().all(|id| ran.contains_key(id)), "{refused:?}");
    assert!(refused.values().all(|&n| n == 1), "{refused:?}");
}

#[tokio::test]
async fn a_connection_dropped_before_ack_is_placed_on_another_node() {
    let dropping = FakeServer::start(Arc::new(|_, m| match m["type"].as_str() {
        Some("execute") => vec![Reply::Drop],
        _ => fake::standard(m),
    }))
    .await;
    let good = FakeServer::start(Arc::new(|_, m| fake::standard(m))).await;
    let fleet = fleet_of(vec![dropping.url(), good.url()]).await;
    for _ in 0..10 {
        fleet.execute(request()).await.unwrap();
    }
    assert_eq!(executes_by_id(&good).len(), 10);
    assert!(executes_by_id(&good).values().all(|&n| n == 1));
}

#[tokio::test]
async fn a_node_lost_after_ack_ends_the_execution_with_node_lost_and_it_is_not_sent_again() {
    let ack_then_drop = FakeServer::start(Arc::new(|_, m| match m["type"].as_str() {
        Some("execute") => vec![
            Reply::Json(json!({"v":1,"type":"ack","id":m["id"],"ts":fake::ts(),"queued":false})),
            Reply::Drop,
        ],
        _ => fake::standard(m),
    }))
    .await;
    let busy = FakeServer::start(Arc::new(|_, m| overloaded(m))).await;
    let fleet = fleet_of(vec![ack_then_drop.url(), busy.url()]).await;
    let (mut lost, mut other) = (0, Vec::new());
    for _ in 0..10 {
        match fleet.execute(request()).await {
            Err(ClientError::NodeLost { node, .. }) => {
                assert_eq!(node, ack_then_drop.url());
                lost += 1;
            }
            r => other.push(format!("{r:?}")),
        }
    }
    assert_eq!((lost, other.len()), (10, 0), "{other:?}");
    let acked = executes_by_id(&ack_then_drop);
    assert_eq!(acked.len(), 10);
    assert!(acked.values().all(|&n| n == 1), "{acked:?}");
    // None of them was sent to the other node after the ack.
    let refused = executes_by_id(&busy);
    assert!(refused.values().all(|&n| n == 1), "{refused:?}");
    let err = ClientError::NodeLost {
        node: String::new(),
        id: String::new(),
        reason: String::new(),
    };
    assert!(err.is_retryable());
}

#[tokio::test]
async fn when_every_node_refuses_the_execution_ends_with_no_node() {
    let a = FakeServer::start(Arc::new(|_, m| overloaded(m))).await;
    let b = FakeServer::start(Arc::new(|_, m| overloaded(m))).await;
    let fleet = fleet_of(vec![a.url(), b.url()]).await;
    match fleet.execute(request()).await {
        Err(ClientError::NoNode { tried, last }) => {
            assert_eq!(tried, 2);
            assert!(last.contains("SANDBOX_OVERLOADED"), "{last}");
        }
        r => panic!("expected NoNode, got {r:?}"),
    }
    assert_eq!(
        a.received_of("execute").len() + b.received_of("execute").len(),
        2
    );
    let empty = fleet_of(Vec::new()).await;
    let err = empty.execute(request()).await.unwrap_err();
    assert!(matches!(err, ClientError::NoNode { tried: 0, .. }), "{err}");
    assert!(err.is_retryable());
}

#[tokio::test]
async fn a_changed_static_list_is_followed_without_a_restart() {
    let a = FakeServer::start(Arc::new(|_, m| fake::standard(m))).await;
    let b = FakeServer::start(Arc::new(|_, m| fake::standard(m))).await;
    let fleet = fleet_of(vec![a.url()]).await;
    fleet.execute(request()).await.unwrap();
    fleet.set_endpoints(&[b.url()]).unwrap();
    assert_eq!(fleet.endpoints(), vec![b.url()]);
    for _ in 0..5 {
        fleet.execute(request()).await.unwrap();
    }
    assert_eq!(a.received_of("execute").len(), 1);
    assert_eq!(b.received_of("execute").len(), 5);
}

#[tokio::test]
async fn dns_discovery_follows_the_nameserver() {
    let (servers, ips, port) = fake::three_hosts().await;
    let name = "sandboxd.fleet.test";
    let ns = Nameserver::start(&[(name, ips[..2].to_vec())])
        .await
        .unwrap();
    let mut dns = DnsDiscovery::new("sandboxd.fleet.test", port);
    dns.nameserver = Some(ns.addr);
    dns.interval = Duration::from_millis(100);
    let fleet = fake::fleet_of_fakes(Discovery::Dns(dns))
        .build()
        .await
        .unwrap();
    let url = |ip: Ipv4Addr| format!("ws://{ip}:{port}/ws");
    let mut endpoints = fleet.endpoints();
    endpoints.sort();
    assert_eq!(endpoints, vec![url(ips[0]), url(ips[1])]);
    // The first host leaves, the third joins.
    ns.set(name, ips[1..].to_vec());
    fake::wait_endpoints(&fleet, vec![url(ips[1]), url(ips[2])]).await;
    for _ in 0..20 {
        fleet.execute(request()).await.unwrap();
    }
    let counts = fake::executes_per_server(&servers);
    assert_eq!(counts[0], 0, "{counts:?}");
    assert_eq!(counts[1] + counts[2], 20, "{counts:?}");
    assert!(counts[2] > 0, "{counts:?}");
    // No records: the nodes leave, nothing can be placed.
    ns.set(name, Vec::new());
    test_support::daemon::wait_until("the fleet to empty", Duration::from_secs(10), || {
        let n = fleet.endpoints().len();
        async move {
            if n == 0 {
                Ok(())
            } else {
                Err(format!("{n} nodes"))
            }
        }
    })
    .await;
    assert!(matches!(
        fleet.execute(request()).await,
        Err(ClientError::NoNode { .. })
    ));
}

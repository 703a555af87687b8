//! Kubernetes discovery against a stub API server serving recorded EndpointSlices (run anywhere): the initial
//! list, slices changing under load (a node added, a node removed, picked up without a restart), not-ready
//! endpoints ignored, the bearer token sent (and read again when it rotates), https with the CA file, sandboxctl's
//! flags, and a refusal or a missing token ending the build with a typed error that names the fix.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use client::{ClientError, Discovery, Execute, Fleet, KubernetesError};
use futures_util::stream::{self, StreamExt};

use super::daemon::wait_until;
use super::fake::{self, wait_endpoints, FakeServer};
use super::k8s_stub::{ApiStub, NAMESPACE, SERVICE};
use super::sandboxctl::ctl_env;

fn request() -> client::ExecuteRequest {
    fake::hi_request()
}

/// The three fakes of [`fake::three_hosts`], their addresses as `IpAddr`.
async fn three_nodes() -> (Vec<FakeServer>, Vec<IpAddr>, u16) {
    let (servers, ips, port) = fake::three_hosts().await;
    (servers, ips.into_iter().map(IpAddr::V4).collect(), port)
}

async fn fleet_of(discovery: client::KubernetesDiscovery) -> Result<Fleet, ClientError> {
    fake::fleet_of_fakes(Discovery::Kubernetes(discovery))
        .build()
        .await
}

fn token_file(dir: &tempfile::TempDir, token: &str) -> std::path::PathBuf {
    let path = dir.path().join("token");
    std::fs::write(&path, format!("{token}\n")).unwrap();
    path
}

#[tokio::test]
async fn kubernetes_discovery_lists_ready_endpoints_with_the_token() {
    let (servers, ips, port) = three_nodes().await;
    let api = ApiStub::start().await;
    api.serve(&[
        (SocketAddr::new(ips[0], port), true),
        (SocketAddr::new(ips[1], port), true),
        (SocketAddr::new(ips[2], port), false),
    ]);
    let dir = tempfile::tempdir().unwrap();
    let fleet = fleet_of(api.discovery(&token_file(&dir, "sa-token-1")))
        .await
        .unwrap();
    let url = |ip: IpAddr| format!("ws://{ip}:{port}/ws");
    let mut endpoints = fleet.endpoints();
    endpoints.sort();
    assert_eq!(endpoints, vec![url(ips[0]), url(ips[1])]);
    for _ in 0..20 {
        fleet.execute(request()).await.unwrap();
    }
    let counts = fake::executes_per_server(&servers);
    assert_eq!(
        counts[2], 0,
        "a not-ready endpoint was placed on: {counts:?}"
    );
    assert_eq!(counts[0] + counts[1], 20, "{counts:?}");
    let first = &api.requests()[0];
    assert!(
        first.starts_with(&format!(
            "GET /apis/discovery.k8s.io/v1/namespaces/{NAMESPACE}/endpointslices\
             ?labelSelector=kubernetes.io%2Fservice-name%3D{SERVICE} HTTP/1.1\r\n"
        )),
        "{first}"
    );
    assert!(
        first.contains("authorization: Bearer sa-token-1\r\n"),
        "{first}"
    );
    // A rotated token is read again before the next list.
    token_file(&dir, "sa-token-2");
    wait_until("a list with the new token", Duration::from_secs(10), || {
        let sent = api
            .requests()
            .iter()
            .any(|h| h.contains("authorization: Bearer sa-token-2\r\n"));
        async move {
            if sent {
                Ok(())
            } else {
                Err("not yet".into())
            }
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn kubernetes_discovery_follows_slices_changing_under_load() {
    let (servers, ips, port) = three_nodes().await;
    let api = ApiStub::start().await;
    api.serve(&[
        (SocketAddr::new(ips[0], port), true),
        (SocketAddr::new(ips[1], port), true),
    ]);
    let dir = tempfile::tempdir().unwrap();
    let fleet = Arc::new(
        fleet_of(api.discovery(&token_file(&dir, "t")))
            .await
            .unwrap(),
    );
    let url = |ip: IpAddr| format!("ws://{ip}:{port}/ws");
    // Executions, 8 at a time, while node 0 leaves and node 2 joins (ready, then node 1 not ready and ready
    // again), and 100 more after the last change was seen; every one is counted. (A fixed number could all end
    // before node 2 was discovered.)
    let (stop, finished) = (
        Arc::new(AtomicBool::new(false)),
        Arc::new(AtomicUsize::new(0)),
    );
    let batch = {
        let (fleet, stop, finished) = (fleet.clone(), stop.clone(), finished.clone());
        tokio::spawn(async move {
            stream::iter(0..100_000)
                .take_while(move |_| std::future::ready(!stop.load(Ordering::SeqCst)))
                .map(|_| {
                    let (fleet, finished) = (fleet.clone(), finished.clone());
                    async move {
                        tokio::time::sleep(Duration::from_millis(5)).await;
                        let r =
                            tokio::time::timeout(Duration::from_secs(30), fleet.execute(request()))
                                .await;
                        finished.fetch_add(1, Ordering::SeqCst);
                        r
                    }
                })
                .buffer_unordered(8)
                .collect::<Vec<_>>()
                .await
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    api.serve(&[
        (SocketAddr::new(ips[1], port), true),
        (SocketAddr::new(ips[2], port), true),
    ]);
    wait_endpoints(&fleet, vec![url(ips[1]), url(ips[2])]).await;
    // An execution placed on node 0 just before it left may still be on its way there: at most one per execution
    // in flight (8). What node 0 has once its count stops moving is all it gets.
    let at_removal = servers[0].received_of("execute").len();
    let on_removed = loop {
        let n = servers[0].received_of("execute").len();
        tokio::time::sleep(Duration::from_millis(200)).await;
        if servers[0].received_of("execute").len() == n {
            break n;
        }
    };
    assert!(
        on_removed - at_removal <= 8,
        "{} executions reached node 0 after it left the slices",
        on_removed - at_removal
    );
    api.serve(&[
        (SocketAddr::new(ips[1], port), false),
        (SocketAddr::new(ips[2], port), true),
    ]);
    wait_endpoints(&fleet, vec![url(ips[2])]).await;
    api.serve(&[
        (SocketAddr::new(ips[1], port), true),
        (SocketAddr::new(ips[2], port), true),
    ]);
    wait_endpoints(&fleet, vec![url(ips[1]), url(ips[2])]).await;
    let seen = finished.load(Ordering::SeqCst);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while finished.load(Ordering::SeqCst) < seen + 100 && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    stop.store(true, Ordering::SeqCst);
    let results = batch.await.unwrap();
    let mut outcomes: HashMap<&str, usize> = HashMap::new();
    for r in &results {
        let kind = match r {
            Ok(Ok(r)) if r.stdout_text() == "hi\n" => "ok",
            Ok(Ok(_)) => "wrong output",
            Ok(Err(ClientError::NodeLost { .. })) => "node lost",
            Ok(Err(ClientError::NoNode { .. })) => "no node",
            Ok(Err(_)) => "other error",
            Err(_) => "hung",
        };
        *outcomes.entry(kind).or_default() += 1;
    }
    let counts = fake::executes_per_server(&servers);
    eprintln!("slices changing under load: {outcomes:?}, executions per node {counts:?}");
    assert!(results.len() >= seen + 100, "{} executions", results.len());
    // Leaving the slices retires a node: nothing new goes there, nothing in flight is lost.
    assert_eq!(outcomes.get("ok"), Some(&results.len()), "{outcomes:?}");
    assert_eq!(
        counts[0], on_removed,
        "placed on a node that left: {counts:?}"
    );
    assert!(counts[0] > 0 && counts[2] > 0, "{counts:?}");
    assert_eq!(counts.iter().sum::<usize>(), results.len(), "{counts:?}");
}

#[tokio::test]
async fn a_refused_list_or_a_missing_token_is_a_typed_error_naming_the_fix() {
    let api = ApiStub::start().await;
    api.refuse(
        403,
        "endpointslices.discovery.k8s.io is forbidden: User \"system:serviceaccount:sandboxd:default\" \
         cannot list resource \"endpointslices\" in API group \"discovery.k8s.io\" in the namespace \"sandboxd\"",
    );
    let dir = tempfile::tempdir().unwrap();
    let err = fleet_of(api.discovery(&token_file(&dir, "t")))
        .await
        .unwrap_err();
    let ClientError::Kubernetes(KubernetesError::Refused { status, fix, .. }) = &err else {
        panic!("not a refusal: {err:?}");
    };
    assert_eq!(*status, 403);
    assert!(
        fix.contains("rbac.yaml") && fix.contains("cannot list resource"),
        "{fix}"
    );
    assert!(!err.is_retryable());
    api.refuse(401, "Unauthorized");
    let err = fleet_of(api.discovery(&token_file(&dir, "t")))
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            ClientError::Kubernetes(KubernetesError::Refused { status: 401, .. })
        ),
        "{err:?}"
    );
    let err = fleet_of(api.discovery(&dir.path().join("no-token")))
        .await
        .unwrap_err();
    assert!(
        matches!(err, ClientError::Kubernetes(KubernetesError::Token { .. })),
        "{err:?}"
    );
    assert!(err.to_string().contains("--k8s-token-file"), "{err}");
}

#[tokio::test]
async fn a_failed_relist_keeps_the_nodes() {
    let (servers, ips, port) = three_nodes().await;
    let api = ApiStub::start().await;
    api.serve(&[(SocketAddr::new(ips[0], port), true)]);
    let dir = tempfile::tempdir().unwrap();
    let fleet = fleet_of(api.discovery(&token_file(&dir, "t")))
        .await
        .unwrap();
    api.refuse(403, "forbidden");
    let before = api.requests().len();
    wait_until("two more lists", Duration::from_secs(10), || {
        let n = api.requests().len();
        async move {
            if n >= before + 2 {
                Ok(())
            } else {
                Err(format!("{n}"))
            }
        }
    })
    .await;
    assert_eq!(
        fleet.endpoints(),
        vec![format!("ws://{}:{port}/ws", ips[0])]
    );
    fleet.execute(request()).await.unwrap();
    assert_eq!(servers[0].received_of("execute").len(), 1);
}

#[tokio::test]
async fn sandboxctl_discovers_a_fleet_in_kubernetes() {
    let (_servers, ips, port) = three_nodes().await;
    let api = ApiStub::start().await;
    api.serve(&[
        (SocketAddr::new(ips[0], port), true),
        (SocketAddr::new(ips[1], port), false),
        (SocketAddr::new(ips[2], port), true),
    ]);
    let dir = tempfile::tempdir().unwrap();
    let token = token_file(&dir, "ctl-token");
    let (api_url, token) = (api.url(), token.to_str().unwrap().to_owned());
    let args = [
        "--k8s-service",
        SERVICE,
        "--k8s-namespace",
        NAMESPACE,
        "--k8s-api",
        &api_url,
        "--k8s-token-file",
        &token,
        "fleet",
        "status",
        "--json",
    ];
    let out = ctl_env(&args, None, &[]).await;
    // The fakes serve no /healthz, so the nodes are not healthy: status exits 69, listing both ready nodes.
    assert_eq!(out.status.code(), Some(69), "{out:?}");
    let urls: Vec<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["url"]
                .as_str()
                .unwrap()
                .to_owned()
        })
        .collect();
    assert_eq!(
        urls,
        vec![
            format!("ws://{}:{port}/ws", ips[0]),
            format!("ws://{}:{port}/ws", ips[2])
        ]
    );
    assert!(api.requests()[0].contains("authorization: Bearer ctl-token\r\n"));
    api.refuse(403, "forbidden");
    let out = ctl_env(&args, None, &[]).await;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    assert!(
        stderr.contains("HTTP 403") && stderr.contains("rbac.yaml"),
        "{stderr}"
    );
}

#[tokio::test]
async fn kubernetes_discovery_over_https_trusts_the_ca_file_only() {
    let (_servers, ips, port) = three_nodes().await;
    let (api, ca_pem) = ApiStub::start_tls().await;
    api.serve(&[(SocketAddr::new(ips[0], port), true)]);
    let dir = tempfile::tempdir().unwrap();
    let ca = dir.path().join("ca.crt");
    std::fs::write(&ca, &ca_pem).unwrap();
    let mut k8s = api.discovery(&token_file(&dir, "tls-token"));
    k8s.api_url = Some(api.tls_url());
    k8s.ca_file = ca;
    let fleet = fleet_of(k8s.clone()).await.unwrap();
    assert_eq!(
        fleet.endpoints(),
        vec![format!("ws://{}:{port}/ws", ips[0])]
    );
    assert!(api.requests()[0].contains("authorization: Bearer tls-token\r\n"));
    // Another CA: the API server's certificate is refused.
    let (_other, other_pem) = ApiStub::start_tls().await;
    let other = dir.path().join("other-ca.crt");
    std::fs::write(&other, other_pem).unwrap();
    k8s.ca_file = other;
    let err = fleet_of(k8s).await.unwrap_err();
    assert!(
        matches!(&err, ClientError::Kubernetes(KubernetesError::Api { reason, .. }) if reason.contains("TLS")),
        "{err:?}"
    );
}

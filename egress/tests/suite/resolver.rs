//! The hickory resolver against a local nameserver: answers are checked like the fake resolver's, so a name
//! rebound to a refused address is refused.

use std::net::{IpAddr, Ipv4Addr};
use std::sync::Arc;

use egress::{AddressPolicy, Allowlist, Proxy, ProxyLimits, Resolve, SystemResolver};
use test_support::dns::Nameserver;
use tokio::net::TcpListener;

use super::common::*;

#[tokio::test]
async fn the_hickory_resolver_answers_and_a_rebound_name_is_refused() {
    let server = tls_server().await;
    let port = server.addr.port();
    let ns = Nameserver::start(&[
        ("public.test", vec![Ipv4Addr::new(93, 184, 216, 34)]),
        ("rebound.test", vec![Ipv4Addr::LOCALHOST]),
    ])
    .await
    .unwrap();
    let resolver = SystemResolver::with_nameserver(ns.addr);
    assert_eq!(
        resolver.resolve("public.test").await.unwrap(),
        vec![IpAddr::from([93, 184, 216, 34])]
    );
    assert!(resolver.resolve("missing.test").await.is_err());

    let allow = Allowlist::parse(&[format!("rebound.test:{port}")]).unwrap();
    let proxy = Proxy::new(
        allow,
        AddressPolicy::new(),
        Arc::new(resolver),
        ProxyLimits::default(),
    );
    let listener = TcpListener::bind((LOCALHOST, 0)).await.unwrap();
    let proxy_addr = listener.local_addr().unwrap();
    let serving = proxy.clone();
    tokio::spawn(async move { serving.serve(listener).await });
    let (status, _) = connect(proxy_addr, &format!("rebound.test:{port}"), "")
        .await
        .unwrap();
    assert_eq!(status, 403);
    assert_eq!(server.accepted.load(std::sync::atomic::Ordering::SeqCst), 0);
}

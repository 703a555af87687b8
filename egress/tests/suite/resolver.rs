//! The hickory resolver against a local nameserver: answers are checked like the fake resolver's, so a name
//! rebound to a refused address is refused.

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;

use egress::{AddressPolicy, Allowlist, Proxy, ProxyLimits, Resolve, SystemResolver};
use hickory_proto::op::{Message, MessageType, ResponseCode};
use hickory_proto::rr::rdata::A;
use hickory_proto::rr::{RData, Record, RecordType};
use tokio::net::{TcpListener, UdpSocket};

use super::common::*;

/// A UDP nameserver answering A queries from a fixed table (absolute names), NXDOMAIN otherwise.
async fn nameserver(table: &[(&str, Ipv4Addr)]) -> SocketAddr {
    let table: HashMap<String, Ipv4Addr> =
        table.iter().map(|(n, ip)| (format!("{n}."), *ip)).collect();
    let socket = UdpSocket::bind((LOCALHOST, 0)).await.unwrap();
    let addr = socket.local_addr().unwrap();
    tokio::spawn(async move {
        let mut buf = [0u8; 512];
        while let Ok((n, peer)) = socket.recv_from(&mut buf).await {
            let Ok(query) = Message::from_vec(&buf[..n]) else {
                continue;
            };
            let mut response = Message::new();
            response
                .set_id(query.id())
                .set_message_type(MessageType::Response)
                .add_queries(query.queries().to_vec());
            let mut found = false;
            for q in query.queries() {
                if let Some(ip) = table.get(&q.name().to_ascii().to_ascii_lowercase()) {
                    found = true;
                    if q.query_type() == RecordType::A {
                        response.add_answer(Record::from_rdata(
                            q.name().clone(),
                            0,
                            RData::A(A(*ip)),
                        ));
                    }
                }
            }
            if !found {
                response.set_response_code(ResponseCode::NXDomain);
            }
            let _ = socket.send_to(&response.to_vec().unwrap(), peer).await;
        }
    });
    addr
}

#[tokio::test]
async fn the_hickory_resolver_answers_and_a_rebound_name_is_refused() {
    let server = tls_server().await;
    let port = server.addr.port();
    let ns = nameserver(&[
        ("public.test", Ipv4Addr::new(93, 184, 216, 34)),
        ("rebound.test", Ipv4Addr::LOCALHOST),
    ])
    .await;
    let resolver = SystemResolver::with_nameserver(ns);
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

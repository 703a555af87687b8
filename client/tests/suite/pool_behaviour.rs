//! Pool mechanics against the fake server: exhaustion, overflow, health checks, giving up and replacement.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use client::{Backoff, ClientError, ConnectionStatus, ErrorKind, Execute, Pool};

use super::daemon::wait_until;
use super::fake::{self, FakeServer};

#[tokio::test]
async fn an_exhausted_pool_is_a_retryable_error() {
    let server = FakeServer::start(Arc::new(|_, m| fake::standard(m))).await;
    let pool = Pool::builder(server.url())
        .size(1)
        .max_overflow(1)
        .checkout_timeout(Duration::from_millis(200))
        .build()
        .unwrap();
    let a = pool.checkout().await.unwrap();
    let b = pool.checkout().await.unwrap();
    let start = Instant::now();
    let e = pool.checkout().await.unwrap_err();
    assert!(matches!(e, ClientError::PoolExhausted { .. }), "{e:?}");
    assert!(e.is_retryable());
    assert_eq!(e.kind(), ErrorKind::Sandbox);
    assert!(start.elapsed() >= Duration::from_millis(200));
    // A waiting checkout gets the connection that comes back.
    let waiter = {
        let pool = pool.clone();
        tokio::spawn(async move { pool.checkout().await.map(|_| ()) })
    };
    tokio::time::sleep(Duration::from_millis(50)).await;
    drop(a);
    waiter.await.unwrap().unwrap();
    drop(b);
}

#[tokio::test]
async fn overflow_connections_are_closed_when_they_come_back() {
    let server = FakeServer::start(Arc::new(|_, m| fake::standard(m))).await;
    let pool = Pool::builder(server.url())
        .size(2)
        .max_overflow(3)
        .build()
        .unwrap();
    let leases: Vec<_> = futures_util::future::join_all((0..5).map(|_| pool.checkout()))
        .await
        .into_iter()
        .map(Result::unwrap)
        .collect();
    assert_eq!(pool.stats().total, 5);
    assert_eq!(pool.stats().in_use, 5);
    drop(leases);
    let stats = pool.stats();
    assert_eq!(
        (stats.total, stats.idle, stats.in_use),
        (2, 2, 0),
        "{stats:?}"
    );
    wait_until(
        "three connections closed",
        Duration::from_secs(5),
        || async {
            let closed = server.closed.load(Ordering::SeqCst);
            if closed == 3 {
                Ok(())
            } else {
                Err(format!("{closed} closed"))
            }
        },
    )
    .await;
    // The base connections are reused.
    for _ in 0..5 {
        pool.checkout().await.unwrap();
    }
    assert_eq!(server.connections.load(Ordering::SeqCst), 5);
}

#[tokio::test]
async fn a_connection_that_fails_its_health_check_is_replaced_not_handed_out() {
    // The first connection stops answering pings after its first one; later connections answer.
    let server = FakeServer::start(Arc::new(|n, m| match m["type"].as_str() {
        Some("ping") if n == 1 => vec![],
        _ => fake::standard(m),
    }))
    .await;
    let pool = Pool::builder(server.url())
        .size(1)
        .max_overflow(0)
        .health_check_timeout(Duration::from_millis(300))
        .checkout_timeout(Duration::from_millis(500))
        .build()
        .unwrap();
    // A fresh connection is handed out without a ping (it just completed its handshake).
    let first = pool.checkout().await.unwrap();
    drop(first);
    // At the next checkout, connection 1 does not answer: it is replaced by connection 2, which serves.
    let lease = pool.checkout().await.unwrap();
    lease.ping(Duration::from_secs(1)).await.unwrap();
    assert_eq!(server.connections.load(Ordering::SeqCst), 2);
    wait_until("connection 1 closed", Duration::from_secs(5), || async {
        let closed = server.closed.load(Ordering::SeqCst);
        if closed == 1 {
            Ok(())
        } else {
            Err(format!("{closed} closed"))
        }
    })
    .await;
    let r = pool
        .execute(client::ExecuteRequest::new(
            "x",
            client::Language::Shell,
            "true",
            client::RequestedLimits::new(1000, 64),
        ))
        .await;
    // `lease` holds the only slot; that checkout waits and then times out.
    assert!(matches!(r, Err(ClientError::PoolExhausted { .. })), "{r:?}");
}

#[tokio::test]
async fn a_connection_gives_up_after_its_retries_and_the_pool_replaces_it() {
    let server = FakeServer::start(Arc::new(|_, m| fake::standard(m))).await;
    let addr = server.addr;
    let pool = Pool::builder(server.url())
        .size(1)
        .max_overflow(0)
        .backoff(Backoff {
            initial: Duration::from_millis(10),
            max: Duration::from_millis(40),
            max_retries: 4,
        })
        .build()
        .unwrap();
    let lease = pool.checkout().await.unwrap();
    let mut status = lease.watch_status();
    // The server goes away for good: the connection retries 4 times (at once, 10, 20, 40 ms), then gives up.
    server.shutdown();
    let start = Instant::now();
    let mut attempts = Vec::new();
    loop {
        status.changed().await.unwrap();
        let s = *status.borrow();
        match s {
            ConnectionStatus::Reconnecting { attempt } => attempts.push(attempt),
            ConnectionStatus::Failed => break,
            other => panic!("unexpected status {other:?}"),
        }
    }
    // Quick changes may be coalesced by the watch; the order and the last retry are certain.
    assert!(attempts.windows(2).all(|w| w[0] < w[1]), "{attempts:?}");
    assert_eq!(attempts.last(), Some(&4), "{attempts:?}");
    assert!(
        start.elapsed() < Duration::from_secs(2),
        "{:?}",
        start.elapsed()
    );
    let e = lease.ping(Duration::from_secs(1)).await.unwrap_err();
    assert!(e.is_retryable(), "{e:?}");
    drop(lease);
    assert_eq!(
        pool.stats().total,
        0,
        "a connection that gave up is not kept"
    );

    // The server is back on the same address: the next checkout opens a new connection.
    let server = FakeServer::start_on(addr, Arc::new(|_, m| fake::standard(m)), None, None).await;
    let lease = pool.checkout().await.unwrap();
    lease.ping(Duration::from_secs(1)).await.unwrap();
    assert_eq!(server.connections.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn an_idle_connection_reconnects_by_itself_and_is_reused() {
    let server = FakeServer::start(Arc::new(|_, m| fake::standard(m))).await;
    let addr = server.addr;
    let pool = Pool::builder(server.url())
        .size(1)
        .max_overflow(0)
        .backoff(Backoff {
            initial: Duration::from_millis(20),
            max: Duration::from_millis(50),
            max_retries: 100,
        })
        .build()
        .unwrap();
    pool.warm_up().await.unwrap();
    assert_eq!(pool.stats().idle, 1);
    let status = pool.checkout().await.unwrap().watch_status();
    server.shutdown();
    let mut s = status.clone();
    s.wait_for(|s| matches!(s, ConnectionStatus::Reconnecting { attempt } if *attempt >= 2))
        .await
        .unwrap();
    let server = FakeServer::start_on(addr, Arc::new(|_, m| fake::standard(m)), None, None).await;
    let mut s = status.clone();
    tokio::time::timeout(
        Duration::from_secs(5),
        s.wait_for(|s| *s == ConnectionStatus::Connected),
    )
    .await
    .unwrap()
    .unwrap();
    // The checkout finds the reconnected idle connection (no new one opened).
    pool.checkout().await.unwrap();
    assert_eq!(server.connections.load(Ordering::SeqCst), 1);
    assert_eq!(pool.stats().total, 1);
}

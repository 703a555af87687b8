//! The proxy: listener loop, per-connection hyper service, and dispatch to CONNECT or plain HTTP.

use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::sync::atomic::Ordering;
use std::sync::{Arc, RwLock};

use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Method, Request, Response};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, TcpStream, UnixListener};
use tracing::Instrument;

use crate::address::AddressPolicy;
use crate::allowlist::Allowlist;
use crate::counting::{Counters, Ledger};
use crate::error::{EgressError, Refusal};
use crate::head::{self, First};
use crate::resolve::Resolve;
use crate::shared::{text, Body, Outcome, ProxyLimits, Shared};
use crate::{http_forward, tunnel};

/// A listener the proxy can serve: TCP or unix.
pub trait Accept: Send + 'static {
    /// An accepted connection.
    type Stream: AsyncRead + AsyncWrite + Unpin + Send + 'static;
    /// Waits for the next connection.
    fn accept_stream(&self) -> impl Future<Output = io::Result<Self::Stream>> + Send;
}

impl Accept for TcpListener {
    type Stream = TcpStream;
    async fn accept_stream(&self) -> io::Result<TcpStream> {
        self.accept().await.map(|(s, _)| s)
    }
}

impl Accept for UnixListener {
    type Stream = tokio::net::UnixStream;
    async fn accept_stream(&self) -> io::Result<tokio::net::UnixStream> {
        self.accept().await.map(|(s, _)| s)
    }
}

/// A snapshot of a proxy's counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Stats {
    /// Client connections accepted.
    pub connections: u64,
    /// Connections opened to the outside.
    pub upstream_connections: u64,
    /// Requests refused.
    pub refused: u64,
    /// Bytes sent to the outside.
    pub bytes_sent: u64,
    /// Bytes received from the outside.
    pub bytes_received: u64,
}

/// One egress proxy (one per sandbox). Cheap to clone: clones share the allowlist and counters.
#[derive(Clone)]
pub struct Proxy {
    shared: Arc<Shared>,
}

impl Proxy {
    /// A proxy with this allowlist, address policy, resolver and limits.
    pub fn new(
        allowlist: Allowlist,
        addresses: AddressPolicy,
        resolver: Arc<dyn Resolve>,
        limits: ProxyLimits,
    ) -> Proxy {
        Self::build(allowlist, addresses, resolver, limits, Counters::default())
    }

    /// [`Proxy::new`], whose byte limit is kept in `ledger` (it outlives the proxy: a proxy made again from it
    /// after a crash counts what this one may have spent).
    pub fn with_ledger(
        allowlist: Allowlist,
        addresses: AddressPolicy,
        resolver: Arc<dyn Resolve>,
        limits: ProxyLimits,
        ledger: Ledger,
    ) -> Proxy {
        let counters = Counters::with_ledger(ledger);
        Self::build(allowlist, addresses, resolver, limits, counters)
    }

    fn build(
        allowlist: Allowlist,
        addresses: AddressPolicy,
        resolver: Arc<dyn Resolve>,
        limits: ProxyLimits,
        counters: Counters,
    ) -> Proxy {
        let slots = tokio::sync::Semaphore::new(limits.max_connections.max(1));
        let shared = Shared {
            allowlist: RwLock::new(Arc::new(allowlist)),
            addresses,
            resolver,
            limits,
            counters: Arc::new(counters),
            tasks: std::sync::Mutex::new(Vec::new()),
            connection_slots: Arc::new(slots),
        };
        Proxy {
            shared: Arc::new(shared),
        }
    }

    /// Replaces the allowlist; requests after this call use the new one, tunnels already open stay.
    pub fn set_allowlist(&self, allowlist: Allowlist) {
        let mut guard = self
            .shared
            .allowlist
            .write()
            .unwrap_or_else(|p| p.into_inner());
        *guard = Arc::new(allowlist);
    }

    /// Ends the tunnels and upstream connections still open. Connections to the proxy itself end with the
    /// [`Proxy::serve`] future that accepted them.
    pub fn close(&self) {
        self.shared.close();
    }

    /// The allowlist in force.
    pub fn allowlist(&self) -> Arc<Allowlist> {
        self.shared
            .allowlist
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Whether its byte limit is kept in a [`Ledger`] ([`Proxy::with_ledger`]).
    pub fn has_ledger(&self) -> bool {
        self.shared.counters.has_ledger()
    }

    /// The counters so far.
    pub fn stats(&self) -> Stats {
        let c = &self.shared.counters;
        Stats {
            connections: c.connections.load(Ordering::Relaxed),
            upstream_connections: c.upstream_connections.load(Ordering::Relaxed),
            refused: c.refused.load(Ordering::Relaxed),
            bytes_sent: c.bytes_sent.load(Ordering::Relaxed),
            bytes_received: c.bytes_received.load(Ordering::Relaxed),
        }
    }

    /// Serves connections from `listener` until accepting fails. The connections are tasks of this future:
    /// dropping it (or aborting the task running it) ends every one of them, tunnels included.
    pub async fn serve<L: Accept>(&self, listener: L) -> Result<(), EgressError> {
        let mut connections = tokio::task::JoinSet::new();
        loop {
            // A connection is accepted only with a free slot; the permit lives as long as the connection.
            let slots = self.shared.connection_slots.clone();
            tokio::select! {
                accepted = async { (slots.acquire_owned().await, listener.accept_stream().await) } => {
                    let (permit, accepted) = accepted;
                    let stream = accepted.map_err(EgressError::Accept)?;
                    let proxy = self.clone();
                    // Each connection logs in the span the proxy serves in (the daemon's names the execution).
                    connections.spawn(
                        async move {
                            let _permit = permit;
                            proxy.serve_connection(stream).await
                        }
                        .in_current_span(),
                    );
                }
                // Reap finished connections so the set holds only live ones.
                Some(_) = connections.join_next(), if !connections.is_empty() => {}
            }
        }
    }

    /// Serves one client connection until it closes.
    pub async fn serve_connection<S: AsyncRead + AsyncWrite + Unpin + Send + 'static>(
        &self,
        mut stream: S,
    ) {
        self.shared
            .counters
            .connections
            .fetch_add(1, Ordering::Relaxed);
        // A client has `hello_timeout` to send each request head, the first one included.
        let timeout = self.shared.limits.hello_timeout;
        let read = match tokio::time::timeout(timeout, head::read_first(&mut stream)).await {
            Ok(Ok(First::Serve(read))) => read,
            Ok(Ok(First::Malformed(refusal))) => {
                self.shared.note_refusal(&refusal);
                if let Err(e) = head::answer(&mut stream, &refusal).await {
                    tracing::debug!(error = %e, "egress refusal not delivered");
                }
                return;
            }
            Ok(Ok(First::Closed)) => return,
            Ok(Err(e)) => {
                tracing::debug!(error = %e, "egress proxy connection ended with an error");
                return;
            }
            Err(_) => {
                tracing::debug!("egress proxy connection sent no request head in time");
                return;
            }
        };
        let shared = self.shared.clone();
        let service = service_fn(move |req| {
            let shared = shared.clone();
            async move { Ok::<_, Infallible>(handle(shared, req).await) }
        });
        let conn = http1::Builder::new()
            .timer(TokioTimer::new())
            .header_read_timeout(timeout)
            .serve_connection(TokioIo::new(head::Rewind::new(read, stream)), service)
            .with_upgrades();
        match conn.await {
            // A later head of the connection that hyper could not parse: hyper answered it with its own 400 (or
            // 431), the proxy counts and logs it as its own refusals.
            Err(e) if e.is_parse() || e.is_parse_too_large() => {
                self.shared
                    .note_refusal(&Refusal::Malformed("a request head that does not parse"));
            }
            Err(e) => tracing::debug!(error = %e, "egress proxy connection ended with an error"),
            Ok(()) => {}
        }
    }
}

async fn handle(shared: Arc<Shared>, req: Request<Incoming>) -> Response<Body> {
    let outcome = if req.method() == Method::CONNECT {
        tunnel::connect(shared.clone(), req).await
    } else {
        http_forward::forward(shared.clone(), req).await
    };
    match outcome {
        Ok(response) => response,
        Err(Outcome::Refused(refusal)) => shared.refuse(&refusal),
        Err(Outcome::Failed(e)) => {
            tracing::info!(error = %e, "egress upstream failed");
            text(http::StatusCode::BAD_GATEWAY, format!("{e}\n"))
        }
    }
}

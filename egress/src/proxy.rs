//! The proxy: listener loop, per-connection hyper service, dispatch to CONNECT or plain HTTP, and the shared state
//! (swappable allowlist, address policy, resolver, counters).

use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Method, Request, Response};
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, TcpStream, UnixListener};

use crate::address::{AddressPolicy, AddressRefusal};
use crate::allowlist::{normalise_request_host, Allowlist, HostError};
use crate::counting::{Counted, Counters};
use crate::error::{EgressError, Refusal};
use crate::resolve::Resolve;
use crate::{http_forward, tunnel};

/// A response body: either the proxy's own text or the origin's body.
pub(crate) type Body = BoxBody<Bytes, hyper::Error>;

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

/// Bounds of one proxy.
#[derive(Debug, Clone)]
pub struct ProxyLimits {
    /// Bytes exchanged with the outside (both directions, all connections) after which connections are closed
    /// and new ones refused; `None` for no limit.
    pub egress_bytes: Option<u64>,
    /// How long to wait for an upstream connection.
    pub connect_timeout: Duration,
    /// How long a tunnel may take to send its ClientHello.
    pub hello_timeout: Duration,
}

impl Default for ProxyLimits {
    fn default() -> ProxyLimits {
        ProxyLimits {
            egress_bytes: None,
            connect_timeout: Duration::from_secs(10),
            hello_timeout: Duration::from_secs(10),
        }
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

pub(crate) struct Shared {
    allowlist: RwLock<Arc<Allowlist>>,
    addresses: AddressPolicy,
    resolver: Arc<dyn Resolve>,
    pub(crate) limits: ProxyLimits,
    pub(crate) counters: Arc<Counters>,
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
        let shared = Shared {
            allowlist: RwLock::new(Arc::new(allowlist)),
            addresses,
            resolver,
            limits,
            counters: Arc::new(Counters::default()),
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

    /// The allowlist in force.
    pub fn allowlist(&self) -> Arc<Allowlist> {
        self.shared
            .allowlist
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
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

    /// Serves connections from `listener` until accepting fails.
    pub async fn serve<L: Accept>(&self, listener: L) -> Result<(), EgressError> {
        loop {
            let stream = listener
                .accept_stream()
                .await
                .map_err(EgressError::Accept)?;
            let proxy = self.clone();
            tokio::spawn(async move { proxy.serve_connection(stream).await });
        }
    }

    /// Serves one client connection until it closes.
    pub async fn serve_connection<S: AsyncRead + AsyncWrite + Unpin + Send + 'static>(
        &self,
        stream: S,
    ) {
        self.shared
            .counters
            .connections
            .fetch_add(1, Ordering::Relaxed);
        let shared = self.shared.clone();
        let service = service_fn(move |req| {
            let shared = shared.clone();
            async move { Ok::<_, Infallible>(handle(shared, req).await) }
        });
        let conn = http1::Builder::new()
            .serve_connection(TokioIo::new(stream), service)
            .with_upgrades();
        if let Err(e) = conn.await {
            tracing::debug!(error = %e, "egress proxy connection ended with an error");
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

/// Why a request got no upstream answer.
pub(crate) enum Outcome {
    Refused(Refusal),
    Failed(EgressError),
}

impl From<Refusal> for Outcome {
    fn from(r: Refusal) -> Outcome {
        Outcome::Refused(r)
    }
}

impl From<EgressError> for Outcome {
    fn from(e: EgressError) -> Outcome {
        Outcome::Failed(e)
    }
}

pub(crate) fn text(status: http::StatusCode, body: String) -> Response<Body> {
    let mut response = Response::new(
        Full::new(Bytes::from(body))
            .map_err(|never| match never {})
            .boxed(),
    );
    *response.status_mut() = status;
    response.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("text/plain"),
    );
    response
}

impl Shared {
    /// Logs and counts a refusal, and answers it.
    pub(crate) fn refuse(&self, refusal: &Refusal) -> Response<Body> {
        self.note_refusal(refusal);
        text(refusal.status(), format!("egress refused: {refusal}\n"))
    }

    pub(crate) fn note_refusal(&self, refusal: &Refusal) {
        self.counters.refused.fetch_add(1, Ordering::Relaxed);
        tracing::info!(reason = %refusal, "egress refused");
    }

    /// Normalises a requested host and checks it and the port against the allowlist in force.
    pub(crate) fn check_host(&self, host: &str, port: u16) -> Result<String, Refusal> {
        let name = normalise_request_host(host).map_err(|e| match e {
            HostError::IpLiteral => Refusal::IpLiteral(host.to_string()),
            HostError::Invalid => Refusal::InvalidHost(host.to_string()),
        })?;
        let list = self
            .allowlist
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        if !list.allows(&name, port) {
            return Err(Refusal::NotAllowed { host: name, port });
        }
        if self.counters.exhausted(self.limits.egress_bytes) {
            return Err(Refusal::ByteLimit);
        }
        Ok(name)
    }

    /// Resolves `host`, keeps the addresses the policy permits, and connects to the first that answers.
    pub(crate) async fn connect(
        &self,
        host: &str,
        port: u16,
    ) -> Result<Counted<TcpStream>, Outcome> {
        let addresses = self.resolver.resolve(host).await?;
        let mut first_refusal: Option<AddressRefusal> = None;
        let mut last_error = None;
        for ip in addresses {
            let address = SocketAddr::new(ip, port);
            if let Err(reason) = self.addresses.check(address) {
                tracing::info!(%host, %address, %reason, "egress address refused");
                first_refusal.get_or_insert(reason);
                continue;
            }
            match tokio::time::timeout(self.limits.connect_timeout, TcpStream::connect(address))
                .await
            {
                Ok(Ok(stream)) => {
                    self.counters
                        .upstream_connections
                        .fetch_add(1, Ordering::Relaxed);
                    return Ok(Counted::new(
                        stream,
                        self.counters.clone(),
                        self.limits.egress_bytes,
                    ));
                }
                Ok(Err(e)) => last_error = Some(e),
                Err(_) => {
                    last_error = Some(io::Error::new(io::ErrorKind::TimedOut, "connect timed out"))
                }
            }
        }
        match (last_error, first_refusal) {
            (Some(source), _) => Err(EgressError::Connect {
                host: host.to_string(),
                source,
            }
            .into()),
            (None, Some(reason)) => Err(Refusal::Address {
                host: host.to_string(),
                reason,
            }
            .into()),
            (None, None) => Err(EgressError::Resolve {
                host: host.to_string(),
                message: "no addresses".into(),
            }
            .into()),
        }
    }
}

//! What every connection of one proxy shares (allowlist, address policy, resolver, limits, counters), and the
//! checks and upstream connect built on it.

use std::io;
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full};
use hyper::Response;
use tokio::net::TcpStream;

use crate::address::{AddressPolicy, AddressRefusal};
use crate::allowlist::{normalise_request_host, Allowlist, HostError};
use crate::counting::{Counted, Counters};
use crate::error::{EgressError, Refusal};
use crate::resolve::Resolve;

/// A response body: either the proxy's own text or the origin's body.
pub(crate) type Body = BoxBody<Bytes, hyper::Error>;

/// Bounds of one proxy.
#[derive(Debug, Clone)]
pub struct ProxyLimits {
    /// Bytes exchanged with the outside (both directions, all connections) after which connections are closed
    /// and new ones refused; `None` for no limit.
    pub egress_bytes: Option<u64>,
    /// How long to wait for an upstream connection.
    pub connect_timeout: Duration,
    /// How long a client may take to send a request head, and a tunnel its ClientHello.
    pub hello_timeout: Duration,
    /// Client connections served at once (all listeners of the proxy together); more wait in the listen
    /// backlog. Bounds what one sandbox can make the proxy hold: each tunnel has two 64 KiB buffers.
    pub max_connections: usize,
}

impl Default for ProxyLimits {
    fn default() -> ProxyLimits {
        ProxyLimits {
            egress_bytes: None,
            connect_timeout: Duration::from_secs(10),
            hello_timeout: Duration::from_secs(10),
            max_connections: 64,
        }
    }
}

/// The state shared by a proxy's connections.
pub(crate) struct Shared {
    pub(crate) allowlist: RwLock<Arc<Allowlist>>,
    pub(crate) addresses: AddressPolicy,
    pub(crate) resolver: Arc<dyn Resolve>,
    pub(crate) limits: ProxyLimits,
    pub(crate) counters: Arc<Counters>,
    /// Tasks that outlive the request that started them (tunnels, upstream connections), ended by
    /// [`Shared::close`].
    pub(crate) tasks: std::sync::Mutex<Vec<tokio::task::AbortHandle>>,
    /// One permit per client connection being served ([`ProxyLimits::max_connections`]).
    pub(crate) connection_slots: Arc<tokio::sync::Semaphore>,
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

/// The body of the answer to a refusal.
pub(crate) fn refusal_text(refusal: &Refusal) -> String {
    format!("egress refused: {refusal}\n")
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
    /// Spawns a task of this proxy, in the caller's tracing span; [`Shared::close`] aborts it.
    pub(crate) fn spawn(&self, task: impl std::future::Future<Output = ()> + Send + 'static) {
        use tracing::Instrument;
        let handle = tokio::spawn(task.in_current_span()).abort_handle();
        let mut tasks = self.tasks.lock().unwrap_or_else(|p| p.into_inner());
        tasks.retain(|t| !t.is_finished());
        tasks.push(handle);
    }

    /// Aborts every task [`Shared::spawn`] started.
    pub(crate) fn close(&self) {
        let tasks = std::mem::take(&mut *self.tasks.lock().unwrap_or_else(|p| p.into_inner()));
        for t in tasks {
            t.abort();
        }
    }

    /// Logs and counts a refusal, and answers it.
    pub(crate) fn refuse(&self, refusal: &Refusal) -> Response<Body> {
        self.note_refusal(refusal);
        text(refusal.status(), refusal_text(refusal))
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
        // Once per resolution: read again when a second old (`HOST_ADDRESSES_MAX_AGE`).
        let own = self
            .addresses
            .host_addresses()
            .inspect_err(|e| tracing::warn!(error = %e, "reading the host's addresses failed"))
            .ok();
        let mut first_refusal: Option<AddressRefusal> = None;
        let mut last_error = None;
        for ip in addresses {
            let address = SocketAddr::new(ip, port);
            if let Err(reason) = self.addresses.check_among(address, own.as_ref()) {
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

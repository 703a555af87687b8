//! Where a fleet's endpoints come from: a static list, a DNS name whose A/AAAA records are resolved again
//! periodically (one endpoint per address), through hickory-resolver (the system's resolver configuration, or a
//! nameserver the caller names; tokio's `lookup_host` cannot be pointed at one), or the EndpointSlices of a
//! Kubernetes Service ([`super::kubernetes`]). The two that change are both a [`Source`] the fleet asks again on
//! its own schedule.

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use hickory_resolver::config::{NameServerConfigGroup, ResolverConfig};
use hickory_resolver::name_server::TokioConnectionProvider;
use hickory_resolver::{ResolveErrorKind, TokioResolver};

use super::kubernetes::{KubernetesDiscovery, KubernetesLister};
use super::node::ws_url;
use crate::error::ClientError;

/// Default time between two resolutions of a DNS name.
pub const DEFAULT_DNS_INTERVAL: Duration = Duration::from_secs(10);

/// Where the endpoints of a [`Fleet`](crate::Fleet) come from.
#[derive(Debug, Clone)]
pub enum Discovery {
    /// A fixed list of `ws://` or `wss://` URLs (change it with [`Fleet::set_endpoints`](crate::Fleet::set_endpoints)).
    Static(Vec<String>),
    /// The A and AAAA records of a name.
    Dns(DnsDiscovery),
    /// The ready addresses of a Kubernetes Service's EndpointSlices.
    Kubernetes(KubernetesDiscovery),
}

/// A discovery whose answer changes: asked once when the fleet is built, then every `interval`.
pub(crate) enum Source {
    Dns(Box<DnsResolver>),
    Kubernetes(Box<KubernetesLister>),
}

impl Source {
    /// The source of `discovery`; `None` for a static list.
    pub(crate) fn new(discovery: &Discovery) -> Result<Option<Source>, ClientError> {
        Ok(match discovery {
            Discovery::Static(_) => None,
            Discovery::Dns(spec) => Some(Source::Dns(Box::new(DnsResolver::new(spec.clone())?))),
            Discovery::Kubernetes(spec) => Some(Source::Kubernetes(Box::new(
                KubernetesLister::new(spec.clone())?,
            ))),
        })
    }

    pub(crate) fn interval(&self) -> Duration {
        match self {
            Source::Dns(d) => d.interval(),
            Source::Kubernetes(k) => k.interval(),
        }
    }

    /// The endpoints now, sorted; an error leaves the fleet's nodes as they are.
    pub(crate) async fn endpoints(&self) -> Result<Vec<String>, ClientError> {
        match self {
            Source::Dns(d) => d.resolve().await,
            Source::Kubernetes(k) => Ok(k.list().await?),
        }
    }
}

/// A DNS name whose addresses are the nodes: `ws://<address>:<port><path>` for each A and AAAA record, resolved
/// again every `interval`. A node whose address leaves the records stops receiving executions; one that joins
/// receives them from the next resolution on.
#[derive(Debug, Clone)]
pub struct DnsDiscovery {
    /// The name, e.g. `sandboxd.internal`.
    pub name: String,
    /// The daemons' port.
    pub port: u16,
    /// `wss://` instead of `ws://` (the certificates must then name the addresses).
    pub tls: bool,
    /// The WebSocket path (default `/ws`).
    pub path: String,
    /// The nameserver to ask; `None` for the system's configuration (`/etc/resolv.conf`).
    pub nameserver: Option<SocketAddr>,
    /// Time between two resolutions (default 10 s).
    pub interval: Duration,
}

impl DnsDiscovery {
    /// `name:port` with the defaults.
    pub fn new(name: impl Into<String>, port: u16) -> Self {
        DnsDiscovery {
            name: name.into(),
            port,
            tls: false,
            path: "/ws".into(),
            nameserver: None,
            interval: DEFAULT_DNS_INTERVAL,
        }
    }

    /// Parses `name:port`, as `sandboxctl --dns` takes it.
    pub fn parse(spec: &str) -> Result<Self, ClientError> {
        let (name, port) = spec.rsplit_once(':').ok_or_else(|| {
            ClientError::Config(format!("DNS discovery {spec:?}: expected NAME:PORT"))
        })?;
        let port = port
            .parse()
            .map_err(|_| ClientError::Config(format!("DNS discovery {spec:?}: bad port")))?;
        if name.is_empty() {
            return Err(ClientError::Config(format!(
                "DNS discovery {spec:?}: empty name"
            )));
        }
        Ok(DnsDiscovery::new(name, port))
    }

    /// The endpoint URL of one address.
    pub fn url(&self, ip: IpAddr) -> String {
        ws_url(self.tls, ip, self.port, &self.path)
    }
}

/// A resolver for one [`DnsDiscovery`].
pub(crate) struct DnsResolver {
    spec: DnsDiscovery,
    resolver: TokioResolver,
}

impl DnsResolver {
    pub(crate) fn new(spec: DnsDiscovery) -> Result<Self, ClientError> {
        let mut builder = match spec.nameserver {
            Some(ns) => {
                let group = NameServerConfigGroup::from_ips_clear(&[ns.ip()], ns.port(), true);
                TokioResolver::builder_with_config(
                    ResolverConfig::from_parts(None, vec![], group),
                    TokioConnectionProvider::default(),
                )
            }
            None => TokioResolver::builder_tokio()
                .map_err(|e| ClientError::Config(format!("system resolver configuration: {e}")))?,
        };
        // The fleet resolves on its own schedule; a cached answer would hide a change until its TTL.
        builder.options_mut().cache_size = 0;
        Ok(DnsResolver {
            spec,
            resolver: builder.build(),
        })
    }

    pub(crate) fn interval(&self) -> Duration {
        self.spec.interval
    }

    /// The endpoints now: one per address, sorted. A name with no records is an empty list (the nodes left); a
    /// failed lookup is an error (the fleet keeps the nodes it has).
    pub(crate) async fn resolve(&self) -> Result<Vec<String>, ClientError> {
        let fail = |reason: String| ClientError::Http {
            url: format!("dns:{}", self.spec.name),
            reason,
        };
        match self.resolver.lookup_ip(self.spec.name.as_str()).await {
            Ok(lookup) => {
                let mut urls: Vec<String> = lookup.iter().map(|ip| self.spec.url(ip)).collect();
                urls.sort();
                urls.dedup();
                Ok(urls)
            }
            Err(e)
                if e.is_no_records_found()
                    || matches!(e.kind(), ResolveErrorKind::Proto(p) if p.is_no_records_found()) =>
            {
                Ok(Vec::new())
            }
            Err(e) => Err(fail(e.to_string())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_name_and_port() {
        let d = DnsDiscovery::parse("sandboxd.internal:7070").unwrap();
        assert_eq!((d.name.as_str(), d.port), ("sandboxd.internal", 7070));
        assert!(DnsDiscovery::parse("nothing").is_err());
        assert!(DnsDiscovery::parse("x:port").is_err());
        assert!(DnsDiscovery::parse(":7").is_err());
    }

    #[test]
    fn urls_per_address_family() {
        let mut d = DnsDiscovery::new("n", 7070);
        assert_eq!(d.url("10.0.0.1".parse().unwrap()), "ws://10.0.0.1:7070/ws");
        d.tls = true;
        assert_eq!(d.url("fd00::1".parse().unwrap()), "wss://[fd00::1]:7070/ws");
    }
}

//! Name resolution for the proxy: the system resolver through hickory, and a fixed table for tests.

use std::collections::HashMap;
use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;

use hickory_resolver::config::{NameServerConfigGroup, ResolverConfig};
use hickory_resolver::name_server::TokioConnectionProvider;
use hickory_resolver::TokioResolver;

use crate::error::EgressError;

/// The future [`Resolve::resolve`] returns.
pub type ResolveFuture<'a> =
    Pin<Box<dyn Future<Output = Result<Vec<IpAddr>, EgressError>> + Send + 'a>>;

/// Resolves a normalised host name to its addresses. The proxy checks every address it returns.
pub trait Resolve: Send + Sync + 'static {
    /// The addresses of `host` (never an IP literal: the proxy refuses those before resolving).
    fn resolve<'a>(&'a self, host: &'a str) -> ResolveFuture<'a>;
}

/// The system's resolver configuration (`/etc/resolv.conf`) through hickory-resolver. Names are queried as
/// absolute names, so no search domain is appended to them.
pub struct SystemResolver {
    resolver: TokioResolver,
}

impl SystemResolver {
    /// Reads the system configuration.
    pub fn new() -> Result<SystemResolver, EgressError> {
        let resolver = TokioResolver::builder_tokio()
            .map_err(EgressError::ResolverConfig)?
            .build();
        Ok(SystemResolver { resolver })
    }

    /// Queries this nameserver (UDP, then TCP) instead of the system's.
    pub fn with_nameserver(nameserver: SocketAddr) -> SystemResolver {
        let group =
            NameServerConfigGroup::from_ips_clear(&[nameserver.ip()], nameserver.port(), true);
        let config = ResolverConfig::from_parts(None, vec![], group);
        let resolver =
            TokioResolver::builder_with_config(config, TokioConnectionProvider::default()).build();
        SystemResolver { resolver }
    }
}

impl Resolve for SystemResolver {
    fn resolve<'a>(&'a self, host: &'a str) -> ResolveFuture<'a> {
        Box::pin(async move {
            let absolute = format!("{host}.");
            let lookup = self
                .resolver
                .lookup_ip(absolute.as_str())
                .await
                .map_err(|e| EgressError::Resolve {
                    host: host.to_string(),
                    message: e.to_string(),
                })?;
            Ok(lookup.iter().collect())
        })
    }
}

/// A fixed name table; a name not in it fails to resolve.
#[derive(Debug, Clone, Default)]
pub struct StaticResolver {
    names: HashMap<String, Vec<IpAddr>>,
}

impl StaticResolver {
    /// An empty table.
    pub fn new() -> StaticResolver {
        StaticResolver::default()
    }

    /// Adds a name (lower-case, no trailing dot) and its addresses.
    pub fn with(
        mut self,
        host: &str,
        addresses: impl IntoIterator<Item = IpAddr>,
    ) -> StaticResolver {
        self.names
            .insert(host.to_string(), addresses.into_iter().collect());
        self
    }
}

impl Resolve for StaticResolver {
    fn resolve<'a>(&'a self, host: &'a str) -> ResolveFuture<'a> {
        let found = self
            .names
            .get(host)
            .cloned()
            .ok_or_else(|| EgressError::Resolve {
                host: host.to_string(),
                message: "no such name".to_string(),
            });
        Box::pin(async move { found })
    }
}

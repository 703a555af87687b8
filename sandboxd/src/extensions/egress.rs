//! The `network` extension: an execution reaches the hosts its request lists, through an egress proxy the daemon
//! runs for it ([`egress::Proxy`]), and nothing else.
//!
//! The container keeps its own network namespace with only loopback. When the request has `network`, the daemon
//! creates a listener on [`PROXY_ADDRESS`] inside that namespace ([`containers::ContainerHandle::listen_inside`])
//! and serves the proxy on it from the daemon itself: nothing of the daemon's runs in the container, and the
//! program finds the proxy through `HTTP_PROXY`, `HTTPS_PROXY` and their relatives ([`proxy_env`]). The proxy
//! resolves names itself, refuses loopback, private (unless the operator allows them), link-local and other
//! special addresses (the operator may permit networks of its own among the private, shared and special-purpose
//! ones: `network.allow_networks`), the daemon's own listen addresses and the host's own addresses whatever the
//! list says, and counts connections and bytes, which the result reports (`result.network`).
//!
//! Requests are checked against the operator's bound `network.allow_max` before anything runs; the extension is
//! announced in `pong` only when `network.enabled` is set. Agent sandboxes use the same settings through
//! [`crate::agent_host`]: one proxy per sandbox, served inside each of its runs.

use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::sync::Arc;
use std::time::Duration;

use egress::{
    parse_allowed_networks, AddressPolicy, Allowlist, AllowlistError, Proxy, ProxyLimits, Resolve,
    SystemResolver,
};
use protocol::{ErrorCode, ErrorMessage, ExecuteRequest, NetworkUsage};
use serde::Deserialize;
use tracing::{info, warn, Instrument};

/// Where the proxy listens inside each container.
pub const PROXY_ADDRESS: SocketAddr = SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::LOCALHOST, 3128));

/// Default for `network.egress_bytes_max`: 1 GiB per execution.
pub const DEFAULT_EGRESS_BYTES_MAX: u64 = 1 << 30;

/// `network:` in the daemon's configuration.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct NetworkConfig {
    /// Serve the `network` extension (announced in `pong`). Off: a request with `network` is refused.
    pub enabled: bool,
    /// The widest entries a request may list (`pypi.org:443`, `*.pythonhosted.org:443`, `api.example.com`);
    /// each requested entry must lie within one of them. Required when enabled.
    pub allow_max: Vec<String>,
    /// Let the proxy connect to RFC 1918 and IPv6 ULA addresses. Loopback, link-local (cloud metadata),
    /// CGNAT, multicast and reserved ranges, and the daemon's own listen addresses, stay refused.
    pub allow_private: bool,
    /// Networks (CIDR, `198.18.3.0/24`, `fd00:1::/48`) whose private, shared (CGNAT) and special-purpose addresses
    /// the proxy may connect to. Loopback, link-local, unspecified, multicast and reserved addresses, the daemon's
    /// own and the host's own addresses stay refused inside them; a network overlapping the first five is refused
    /// at load ([`parse_allowed_networks`]).
    pub allow_networks: Vec<String>,
    /// Nameservers the proxy queries (`ip:port`), the first one used; empty: the host's `/etc/resolv.conf`.
    pub nameservers: Vec<SocketAddr>,
    /// Bytes one execution may exchange with the outside, both directions; a request's `egress_bytes` may ask
    /// for less.
    pub egress_bytes_max: u64,
    /// How long the proxy waits for an upstream connection, milliseconds.
    pub connect_timeout_ms: u64,
}

impl Default for NetworkConfig {
    fn default() -> Self {
        Self {
            enabled: false,
            allow_max: Vec::new(),
            allow_private: false,
            allow_networks: Vec::new(),
            nameservers: Vec::new(),
            egress_bytes_max: DEFAULT_EGRESS_BYTES_MAX,
            connect_timeout_ms: 10_000,
        }
    }
}

impl NetworkConfig {
    /// Checks the bound parses and is present when enabled, and the allowed networks; `(key, reason)` otherwise.
    pub fn validate(&self) -> Result<(), (&'static str, String)> {
        let bound =
            Allowlist::parse(&self.allow_max).map_err(|e| ("network.allow_max", e.to_string()))?;
        parse_allowed_networks(&self.allow_networks)
            .map_err(|e| ("network.allow_networks", e.to_string()))?;
        if self.enabled && bound.entries().is_empty() {
            return Err((
                "network.allow_max",
                "must list at least one entry when network.enabled is true".into(),
            ));
        }
        if self.egress_bytes_max == 0 {
            return Err(("network.egress_bytes_max", "must be at least 1".into()));
        }
        if self.connect_timeout_ms == 0 {
            return Err(("network.connect_timeout_ms", "must be at least 1".into()));
        }
        Ok(())
    }
}

/// The daemon's egress settings, parsed once: the bound, the address policy and the shared resolver.
pub struct Egress {
    config: NetworkConfig,
    allow_max: Allowlist,
    addresses: AddressPolicy,
    resolver: Arc<dyn Resolve>,
}

impl Egress {
    /// `None` when the extension is off. `daemon_addresses` are the daemon's own listeners, never reachable.
    pub fn new(
        config: &NetworkConfig,
        daemon_addresses: impl IntoIterator<Item = SocketAddr>,
    ) -> Result<Option<Egress>, String> {
        if !config.enabled {
            return Ok(None);
        }
        let allow_max = Allowlist::parse(&config.allow_max).map_err(|e| e.to_string())?;
        let allow_networks =
            parse_allowed_networks(&config.allow_networks).map_err(|e| e.to_string())?;
        let resolver: Arc<dyn Resolve> = match config.nameservers.first() {
            Some(ns) => Arc::new(SystemResolver::with_nameserver(*ns)),
            None => Arc::new(SystemResolver::new().map_err(|e| e.to_string())?),
        };
        Ok(Some(Egress {
            config: config.clone(),
            allow_max,
            addresses: AddressPolicy::new()
                .allow_private(config.allow_private)
                .allow_networks(allow_networks)
                .daemon_addresses(daemon_addresses),
            resolver,
        }))
    }

    /// The request's allowlist within the bound, and its byte limit; the refusal to send otherwise.
    pub fn check(&self, req: &ExecuteRequest) -> Result<Option<Admitted>, ErrorMessage> {
        let Some(network) = &req.network else {
            return Ok(None);
        };
        let refuse = |message: String| {
            ErrorMessage::new(Some(req.id.clone()), ErrorCode::InvalidRequest, message)
        };
        let allowlist = self
            .allowlist(&network.allow)
            .map_err(|e| refuse(format!("Field network.allow: {e}")))?;
        let egress_bytes = self.egress_bytes(network.egress_bytes).map_err(|max| {
            let n = network.egress_bytes.unwrap_or(max);
            refuse(format!(
                "Field network.egress_bytes: {n} is above the maximum {max}"
            ))
        })?;
        Ok(Some(Admitted {
            allowlist,
            egress_bytes,
        }))
    }

    /// `allow` parsed, each entry within the operator's bound.
    pub fn allowlist<S: AsRef<str>>(&self, allow: &[S]) -> Result<Allowlist, AllowlistError> {
        Allowlist::parse_within(allow, &self.allow_max)
    }

    /// The byte limit for `asked` (`None`: `network.egress_bytes_max`); `Err(maximum)` when above it.
    pub fn egress_bytes(&self, asked: Option<u64>) -> Result<u64, u64> {
        let max = self.config.egress_bytes_max;
        match asked {
            Some(n) if n > max => Err(max),
            Some(n) => Ok(n),
            None => Ok(max),
        }
    }

    /// A proxy (serving nothing yet) with `allowlist`, the daemon's address policy and resolver, and a limit of
    /// `egress_bytes`, kept in `ledger` when given.
    pub fn proxy(
        &self,
        allowlist: Allowlist,
        egress_bytes: u64,
        ledger: Option<egress::Ledger>,
    ) -> Proxy {
        let limits = ProxyLimits {
            egress_bytes: Some(egress_bytes),
            connect_timeout: Duration::from_millis(self.config.connect_timeout_ms),
            ..ProxyLimits::default()
        };
        let (addresses, resolver) = (self.addresses.clone(), self.resolver.clone());
        match ledger {
            Some(ledger) => Proxy::with_ledger(allowlist, addresses, resolver, limits, ledger),
            None => Proxy::new(allowlist, addresses, resolver, limits),
        }
    }

    /// Starts the proxy for one execution on `listener` (inside its container). Dropping the returned
    /// [`Running`] stops it and closes every connection.
    pub fn start(
        &self,
        admitted: Admitted,
        listener: std::net::TcpListener,
        id: &str,
    ) -> std::io::Result<Running> {
        let listener = tokio::net::TcpListener::from_std(listener)?;
        let proxy = self.proxy(admitted.allowlist, admitted.egress_bytes, None);
        let serving = proxy.clone();
        let span = tracing::info_span!("egress", execution = %id);
        let task = tokio::spawn(
            async move {
                if let Err(e) = serving.serve(listener).await {
                    warn!(error = %e, "egress proxy stopped accepting");
                }
            }
            .instrument(span),
        );
        Ok(Running { proxy, task })
    }
}

/// A request's network settings, checked.
#[derive(Debug)]
pub struct Admitted {
    allowlist: Allowlist,
    egress_bytes: u64,
}

/// One execution's proxy; dropping it ends the proxy's task and every connection it serves.
pub struct Running {
    proxy: Proxy,
    task: tokio::task::JoinHandle<()>,
}

impl Running {
    /// The counters so far, as `result.network` reports them.
    pub fn usage(&self) -> NetworkUsage {
        let s = self.proxy.stats();
        NetworkUsage {
            connections: s.connections,
            upstream_connections: s.upstream_connections,
            refused: s.refused,
            bytes_sent: s.bytes_sent,
            bytes_received: s.bytes_received,
        }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        self.task.abort();
        self.proxy.close();
        let u = self.usage();
        info!(
            connections = u.connections,
            upstream_connections = u.upstream_connections,
            refused = u.refused,
            bytes_sent = u.bytes_sent,
            bytes_received = u.bytes_received,
            "egress proxy closed"
        );
    }
}

/// The environment that points a program's HTTP clients at the proxy (curl, python's urllib and requests, pip,
/// npm, node's `fetch` with `NODE_USE_ENV_PROXY`).
pub fn proxy_env() -> Vec<(String, String)> {
    let url = format!("http://{PROXY_ADDRESS}");
    let mut env = Vec::new();
    for key in [
        "HTTP_PROXY",
        "HTTPS_PROXY",
        "ALL_PROXY",
        "http_proxy",
        "https_proxy",
        "all_proxy",
    ] {
        env.push((key.to_owned(), url.clone()));
    }
    for key in ["npm_config_proxy", "npm_config_https_proxy"] {
        env.push((key.to_owned(), url.clone()));
    }
    for key in ["NO_PROXY", "no_proxy"] {
        env.push((key.to_owned(), "localhost,127.0.0.1,::1".to_owned()));
    }
    env.push(("NODE_USE_ENV_PROXY".to_owned(), "1".to_owned()));
    env
}

#[cfg(test)]
mod tests {
    use super::*;

    fn enabled(allow_max: &[&str]) -> NetworkConfig {
        NetworkConfig {
            enabled: true,
            allow_max: allow_max.iter().map(|s| (*s).to_owned()).collect(),
            nameservers: vec!["127.0.0.1:53".parse().unwrap()],
            egress_bytes_max: 1000,
            ..NetworkConfig::default()
        }
    }

    fn request(allow: &[&str], egress_bytes: Option<u64>) -> ExecuteRequest {
        let mut req = ExecuteRequest::new(
            "n",
            protocol::Language::Python,
            "pass",
            protocol::RequestedLimits::new(1000, 64),
        );
        req.network = Some(protocol::NetworkRequest {
            allow: allow.iter().map(|s| (*s).to_owned()).collect(),
            egress_bytes,
        });
        req
    }

    #[test]
    fn the_configuration_is_checked() {
        assert!(NetworkConfig::default().validate().is_ok());
        let (key, reason) = enabled(&[]).validate().unwrap_err();
        assert_eq!(key, "network.allow_max");
        assert!(reason.contains("at least one entry"), "{reason}");
        let (key, reason) = enabled(&["10.0.0.1:443"]).validate().unwrap_err();
        assert_eq!(key, "network.allow_max");
        assert!(reason.contains("IP literal"), "{reason}");
        let mut networks = enabled(&["a.example"]);
        networks.allow_networks = vec!["198.18.3.0/24".into(), "fd00:1::/48".into()];
        assert!(networks.validate().is_ok());
        for (bad, why) in [
            ("198.18.3.0", "not a network in CIDR notation"),
            ("198.18.3.1/24", "host bits set"),
            ("127.0.0.0/8", "loopback"),
            ("169.254.0.0/16", "link-local"),
            ("0.0.0.0/0", "unspecified"),
            ("ff00::/8", "multicast"),
        ] {
            networks.allow_networks = vec!["198.18.3.0/24".into(), bad.into()];
            let (key, reason) = networks.validate().unwrap_err();
            assert_eq!(key, "network.allow_networks", "{bad}");
            assert!(
                reason.contains(bad) && reason.contains(why),
                "{bad}: {reason}"
            );
        }
        let mut zero = enabled(&["a.example"]);
        zero.egress_bytes_max = 0;
        assert_eq!(zero.validate().unwrap_err().0, "network.egress_bytes_max");
    }

    #[tokio::test]
    async fn requests_are_checked_against_the_bound() {
        let egress = Egress::new(&enabled(&["*.example.com:443", "pypi.org"]), [])
            .unwrap()
            .expect("enabled");
        let ok = egress
            .check(&request(&["api.example.com:443", "pypi.org:80"], Some(10)))
            .unwrap()
            .expect("admitted");
        assert_eq!(ok.egress_bytes, 10);
        let default = egress
            .check(&request(&["pypi.org"], None))
            .unwrap()
            .unwrap();
        assert_eq!(default.egress_bytes, 1000);
        for (allow, bytes, why) in [
            ("example.com:443", None, "not covered"),
            ("api.example.com:80", None, "not covered"),
            ("1.2.3.4:443", None, "IP literal"),
            ("pypi.org", Some(1001), "above the maximum 1000"),
        ] {
            let e = egress.check(&request(&[allow], bytes)).unwrap_err();
            assert_eq!(e.code, ErrorCode::InvalidRequest);
            assert!(e.message.contains(why), "{allow}: {}", e.message);
        }
        let mut none = request(&[], None);
        none.network = None;
        assert!(egress.check(&none).unwrap().is_none());
        assert!(Egress::new(&NetworkConfig::default(), [])
            .unwrap()
            .is_none());
    }

    #[test]
    fn the_environment_points_every_client_at_the_proxy() {
        let env: std::collections::BTreeMap<_, _> = proxy_env().into_iter().collect();
        for key in [
            "HTTP_PROXY",
            "https_proxy",
            "ALL_PROXY",
            "npm_config_https_proxy",
        ] {
            assert_eq!(env[key], "http://127.0.0.1:3128", "{key}");
        }
        assert_eq!(env["NO_PROXY"], "localhost,127.0.0.1,::1");
    }
}

//! Where to connect and with which token: the endpoint, the fleet (`--endpoints`, `--dns`, `--k8s-service`) and
//! the token, from flags, environment and the token file.

use std::path::PathBuf;

use clap::Args;
use client::{
    ClientError, ConnectOptions, Discovery, DnsDiscovery, Fleet, KubernetesDiscovery, Pool,
    DEFAULT_K8S_PORT_NAME, DEFAULT_URL,
};

use crate::Cli;

/// Kubernetes discovery of a fleet.
#[derive(Args, Debug)]
pub(crate) struct K8sArgs {
    /// A fleet discovered in Kubernetes: the headless Service whose EndpointSlices' ready addresses are the
    /// daemons (`exec` and `fleet status`; read with the pod's service-account token).
    #[arg(
        long = "k8s-service",
        global = true,
        env = "SANDBOXD_K8S_SERVICE",
        conflicts_with = "dns"
    )]
    k8s_service: Option<String>,
    /// The Service's namespace [default: the pod's].
    #[arg(long = "k8s-namespace", global = true, requires = "k8s_service")]
    k8s_namespace: Option<String>,
    /// The name of the Service port serving FSP.
    #[arg(long = "k8s-port-name", global = true, default_value = DEFAULT_K8S_PORT_NAME)]
    k8s_port_name: String,
    /// The API server's URL [default: https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT].
    #[arg(long = "k8s-api", global = true, requires = "k8s_service")]
    k8s_api: Option<String>,
    /// The bearer token file [default: the service account's].
    #[arg(long = "k8s-token-file", global = true, requires = "k8s_service")]
    k8s_token_file: Option<PathBuf>,
    /// The API server's CA [default: the service account's].
    #[arg(long = "k8s-ca-file", global = true, requires = "k8s_service")]
    k8s_ca_file: Option<PathBuf>,
}

impl K8sArgs {
    /// The discovery these flags name, if `--k8s-service` is given.
    fn discovery(&self) -> Option<KubernetesDiscovery> {
        let service = self
            .k8s_service
            .as_deref()
            .map(str::trim)
            .filter(|s| !s.is_empty())?;
        let mut k8s = KubernetesDiscovery::new(service);
        k8s.namespace.clone_from(&self.k8s_namespace);
        k8s.port_name.clone_from(&self.k8s_port_name);
        k8s.api_url.clone_from(&self.k8s_api);
        if let Some(f) = &self.k8s_token_file {
            k8s.token_file.clone_from(f);
        }
        if let Some(f) = &self.k8s_ca_file {
            k8s.ca_file.clone_from(f);
        }
        Some(k8s)
    }
}

impl Cli {
    /// The endpoint: flag, then environment (clap reads both; empty counts as unset), then the default.
    pub(crate) fn url(&self) -> String {
        self.url
            .as_deref()
            .map(str::trim)
            .filter(|u| !u.is_empty())
            .unwrap_or(DEFAULT_URL)
            .to_owned()
    }
}

/// The fleet named by `--endpoints`, `--dns` or `--k8s-service`, if any.
pub(crate) fn fleet_discovery(cli: &Cli) -> anyhow::Result<Option<Discovery>> {
    let endpoints: Vec<String> = cli
        .endpoints
        .iter()
        .map(|e| e.trim().to_owned())
        .filter(|e| !e.is_empty())
        .collect();
    if !endpoints.is_empty() {
        return Ok(Some(Discovery::Static(endpoints)));
    }
    match cli.dns.as_deref().map(str::trim).filter(|d| !d.is_empty()) {
        Some(spec) => {
            let mut dns = DnsDiscovery::parse(spec)?;
            dns.nameserver = cli.dns_server;
            Ok(Some(Discovery::Dns(dns)))
        }
        None => Ok(cli.k8s.discovery().map(Discovery::Kubernetes)),
    }
}

pub(crate) async fn build_fleet(
    discovery: Discovery,
    token: Option<String>,
) -> Result<Fleet, ClientError> {
    let pool = Pool::builder("").size(1);
    let pool = match token {
        Some(t) => pool.token(t),
        None => pool,
    };
    Fleet::builder(discovery).pool(pool).build().await
}

/// The daemon's HTTP base (`http://host:port`) from its WebSocket endpoint.
pub(crate) fn http_base(ws_url: &str) -> anyhow::Result<String> {
    let healthz = client::healthz_url(ws_url)?;
    Ok(healthz.trim_end_matches("/healthz").to_owned())
}

/// The token: flag, then environment, then the token file.
pub(crate) async fn resolve_token(cli: &Cli) -> Option<String> {
    let given = cli
        .token
        .as_deref()
        .map(str::trim)
        .filter(|t| !t.is_empty());
    match given {
        Some(t) => Some(t.to_owned()),
        None => tokio::fs::read_to_string(&cli.token_file)
            .await
            .ok()
            .map(|t| t.trim().to_owned())
            .filter(|t| !t.is_empty()),
    }
}

/// Endpoint and token: flags, then environment (clap reads both), then the local token file.
pub(crate) async fn connect_options(cli: &Cli) -> ConnectOptions {
    let options = ConnectOptions::new(cli.url());
    match resolve_token(cli).await {
        Some(t) => options.token(t),
        None => options,
    }
}

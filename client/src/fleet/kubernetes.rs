//! Kubernetes discovery: the EndpointSlices of a headless Service (label `kubernetes.io/service-name=<service>`),
//! listed from the API server with the pod's service-account token and listed again every `interval`. Each ready
//! address of a slice that has the named port is one endpoint.
//!
//! One list call does not need kube-rs (and its tree of dependencies): the request goes through the client's own
//! hyper + rustls GET ([`crate::health`]), and the answer is decoded into serde types that hold only the fields
//! used. The token is read again before every list, since the kubelet rotates projected tokens.

use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::CertificateDer;
use serde::Deserialize;

use super::node::ws_url;
use crate::error::{ClientError, KubernetesError};
use crate::health::{self, Target};
use crate::tls;

/// The directory where Kubernetes mounts a pod's service-account token, CA and namespace.
pub const SERVICE_ACCOUNT_DIR: &str = "/var/run/secrets/kubernetes.io/serviceaccount";
/// Default time between two lists of the EndpointSlices.
pub const DEFAULT_K8S_INTERVAL: Duration = Duration::from_secs(10);
/// Default name of the Service's port that serves FSP.
pub const DEFAULT_K8S_PORT_NAME: &str = "fsp";
/// Time a list call has to answer.
const LIST_TIMEOUT: Duration = Duration::from_secs(10);
/// The largest list answer read.
const MAX_LIST_BYTES: usize = 16 << 20;

/// The EndpointSlices of a headless Service: `ws://<address>:<port><path>` for each ready address of each slice
/// whose ports include `port_name`, listed again every `interval`. An endpoint that stops being ready (its pod is
/// terminating, or fails its readiness probe) stops receiving executions; one that becomes ready receives them
/// from the next list on.
#[derive(Debug, Clone)]
pub struct KubernetesDiscovery {
    /// The Service's name.
    pub service: String,
    /// Its namespace; `None`: the pod's own (the service account's `namespace` file).
    pub namespace: Option<String>,
    /// The name of the Service port serving FSP (default `fsp`).
    pub port_name: String,
    /// `wss://` instead of `ws://` (the certificates must then name the addresses).
    pub tls: bool,
    /// The WebSocket path (default `/ws`).
    pub path: String,
    /// The API server (`https://host:port` or, for a stub or a proxy, `http://`); `None`:
    /// `https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT`.
    pub api_url: Option<String>,
    /// The bearer token file (default: the service account's `token`), read again before every list.
    pub token_file: PathBuf,
    /// The API server's CA for `https://` (default: the service account's `ca.crt`).
    pub ca_file: PathBuf,
    /// The file naming the pod's namespace, read when `namespace` is `None` (default: the service account's
    /// `namespace`).
    pub namespace_file: PathBuf,
    /// Time between two lists (default 10 s).
    pub interval: Duration,
}

impl KubernetesDiscovery {
    /// The Service `service` with the in-cluster defaults.
    pub fn new(service: impl Into<String>) -> Self {
        let dir = Path::new(SERVICE_ACCOUNT_DIR);
        KubernetesDiscovery {
            service: service.into(),
            namespace: None,
            port_name: DEFAULT_K8S_PORT_NAME.into(),
            tls: false,
            path: "/ws".into(),
            api_url: None,
            token_file: dir.join("token"),
            ca_file: dir.join("ca.crt"),
            namespace_file: dir.join("namespace"),
            interval: DEFAULT_K8S_INTERVAL,
        }
    }
}

/// A lister for one [`KubernetesDiscovery`], its API URL, namespace and TLS settled.
pub(crate) struct KubernetesLister {
    spec: KubernetesDiscovery,
    namespace: String,
    api: Target,
    url: String,
    path_and_query: String,
    tls_config: Option<Arc<rustls::ClientConfig>>,
}

impl KubernetesLister {
    pub(crate) fn new(spec: KubernetesDiscovery) -> Result<Self, ClientError> {
        let api_url = match &spec.api_url {
            Some(url) => url.trim_end_matches('/').to_owned(),
            None => in_cluster_url()?,
        };
        let api = Target::parse_http(&api_url)?;
        let namespace = match &spec.namespace {
            Some(ns) => ns.clone(),
            None => {
                let path = &spec.namespace_file;
                let ns = std::fs::read_to_string(path).map_err(|e| KubernetesError::Namespace {
                    path: path.clone(),
                    reason: e.to_string(),
                })?;
                ns.trim().to_owned()
            }
        };
        for (what, name) in [("Service", &spec.service), ("namespace", &namespace)] {
            if !is_dns_label(name) {
                return Err(ClientError::Config(format!(
                    "Kubernetes {what} {name:?}: not a DNS label (lowercase letters, digits and '-', at most 63)"
                )));
            }
        }
        let tls_config = if api.tls {
            Some(ca_config(&spec.ca_file)?)
        } else {
            None
        };
        let path_and_query = format!(
            "/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices\
             ?labelSelector=kubernetes.io%2Fservice-name%3D{}",
            spec.service
        );
        Ok(KubernetesLister {
            url: format!("{api_url}{path_and_query}"),
            spec,
            namespace,
            api,
            path_and_query,
            tls_config,
        })
    }

    pub(crate) fn interval(&self) -> Duration {
        self.spec.interval
    }

    /// The endpoints now: one per ready address, sorted. No slice, or none ready, is an empty list (the nodes
    /// left); a failed list is an error (the fleet keeps the nodes it has).
    pub(crate) async fn list(&self) -> Result<Vec<String>, KubernetesError> {
        let token =
            std::fs::read_to_string(&self.spec.token_file).map_err(|e| KubernetesError::Token {
                path: self.spec.token_file.clone(),
                reason: e.to_string(),
            })?;
        let (status, body) = health::get(
            &self.api,
            &self.path_and_query,
            Some(token.trim()),
            self.tls_config.clone(),
            LIST_TIMEOUT,
            MAX_LIST_BYTES,
        )
        .await
        .map_err(|reason| self.api_error(reason))?;
        match status {
            200 => {
                let list: EndpointSliceList = serde_json::from_slice(&body)
                    .map_err(|e| self.api_error(format!("not an EndpointSliceList: {e}")))?;
                Ok(endpoints_of(&list, &self.spec))
            }
            401 | 403 | 404 => Err(KubernetesError::Refused {
                status,
                namespace: self.namespace.clone(),
                service: self.spec.service.clone(),
                fix: format!(
                    "{} (API server: {})",
                    fix_for(status),
                    status_message(&body)
                ),
            }),
            other => Err(self.api_error(format!("HTTP {other}: {}", status_message(&body)))),
        }
    }

    fn api_error(&self, reason: String) -> KubernetesError {
        KubernetesError::Api {
            url: self.url.clone(),
            reason,
        }
    }
}

/// Whether `name` is an RFC 1123 label, as Service and namespace names are (so it goes into the path and the label
/// selector as it is).
fn is_dns_label(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 63
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !name.starts_with('-')
        && !name.ends_with('-')
}

/// `https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT`.
fn in_cluster_url() -> Result<String, KubernetesError> {
    let host =
        std::env::var("KUBERNETES_SERVICE_HOST").map_err(|_| KubernetesError::NotInCluster)?;
    let port =
        std::env::var("KUBERNETES_SERVICE_PORT").map_err(|_| KubernetesError::NotInCluster)?;
    Ok(if host.contains(':') {
        format!("https://[{host}]:{port}")
    } else {
        format!("https://{host}:{port}")
    })
}

/// A TLS configuration trusting the certificates of the PEM file `path`.
fn ca_config(path: &Path) -> Result<Arc<rustls::ClientConfig>, ClientError> {
    let ca = |reason: String| KubernetesError::Ca {
        path: path.to_owned(),
        reason,
    };
    let pem = std::fs::read(path).map_err(|e| ca(e.to_string()))?;
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(&pem)
        .collect::<Result<_, _>>()
        .map_err(|e| ca(format!("not PEM certificates: {e}")))?;
    if certs.is_empty() {
        return Err(ca("no certificate in the file".into()).into());
    }
    tls::config_trusting(certs)
}

/// What to change when the API server answers `status` to the list.
fn fix_for(status: u16) -> &'static str {
    match status {
        401 => {
            "the token is not valid for this API server: check the token file and the API URL \
             (a pod's token is rotated and read again before every list)"
        }
        403 => {
            "the service account may not list endpointslices (discovery.k8s.io) in this namespace: bind it a \
             Role granting get, list and watch on them (deploy/kubernetes/rbac.yaml)"
        }
        _ => {
            "the API server does not serve discovery.k8s.io/v1 EndpointSlices here (Kubernetes 1.21 or later \
             does): check the API URL and the namespace"
        }
    }
}

/// The `message` of a `Status` answer, or the start of the body.
fn status_message(body: &[u8]) -> String {
    #[derive(Deserialize)]
    struct Status {
        message: Option<String>,
    }
    match serde_json::from_slice::<Status>(body) {
        Ok(Status { message: Some(m) }) => m,
        _ => String::from_utf8_lossy(&body[..body.len().min(200)]).into_owned(),
    }
}

/// `discovery.k8s.io/v1` `EndpointSliceList`: the fields discovery reads.
#[derive(Debug, Deserialize)]
pub(crate) struct EndpointSliceList {
    #[serde(default)]
    items: Vec<EndpointSlice>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct EndpointSlice {
    address_type: String,
    #[serde(default)]
    endpoints: Option<Vec<Endpoint>>,
    #[serde(default)]
    ports: Option<Vec<EndpointPort>>,
}

#[derive(Debug, Deserialize)]
struct Endpoint {
    addresses: Vec<String>,
    #[serde(default)]
    conditions: Conditions,
}

#[derive(Debug, Default, Deserialize)]
struct Conditions {
    /// `None` is an unknown state, which the API asks consumers to take as ready.
    ready: Option<bool>,
}

#[derive(Debug, Deserialize)]
struct EndpointPort {
    name: Option<String>,
    port: Option<u16>,
}

/// One endpoint per ready IP address of each slice that has the named port; sorted, without duplicates.
pub(crate) fn endpoints_of(list: &EndpointSliceList, spec: &KubernetesDiscovery) -> Vec<String> {
    let mut urls = Vec::new();
    for slice in &list.items {
        if slice.address_type != "IPv4" && slice.address_type != "IPv6" {
            continue;
        }
        let port = slice.ports.iter().flatten().find_map(|p| {
            (p.name.as_deref().unwrap_or("") == spec.port_name)
                .then_some(p.port)
                .flatten()
        });
        let Some(port) = port else { continue };
        for endpoint in slice.endpoints.iter().flatten() {
            if endpoint.conditions.ready == Some(false) {
                continue;
            }
            for address in &endpoint.addresses {
                if let Ok(ip) = address.parse::<IpAddr>() {
                    urls.push(ws_url(spec.tls, ip, port, &spec.path));
                }
            }
        }
    }
    urls.sort();
    urls.dedup();
    urls
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An `EndpointSliceList` as the API server returns it (trimmed of managed fields): an IPv4 slice with two
    /// ready endpoints, one terminating (not ready) and one whose readiness is unknown; an IPv6 slice; a slice of
    /// another port only; an FQDN slice.
    const LIST: &str = r#"{
      "kind": "EndpointSliceList", "apiVersion": "discovery.k8s.io/v1",
      "metadata": {"resourceVersion": "48213"},
      "items": [
        {"kind": "EndpointSlice", "apiVersion": "discovery.k8s.io/v1",
         "metadata": {"name": "sandboxd-7xk2p", "namespace": "sandboxd", "generateName": "sandboxd-",
                      "labels": {"kubernetes.io/service-name": "sandboxd",
                                 "endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io"}},
         "addressType": "IPv4",
         "endpoints": [
           {"addresses": ["10.244.1.7"], "conditions": {"ready": true, "serving": true, "terminating": false},
            "nodeName": "node-a", "targetRef": {"kind": "Pod", "namespace": "sandboxd", "name": "sandboxd-abcde"}},
           {"addresses": ["10.244.2.9"], "conditions": {"ready": false, "serving": true, "terminating": true},
            "nodeName": "node-b"},
           {"addresses": ["10.244.3.4"], "conditions": {}, "nodeName": "node-c"},
           {"addresses": ["10.244.4.2"], "conditions": {"ready": true}, "nodeName": "node-d"}
         ],
         "ports": [{"name": "metrics", "protocol": "TCP", "port": 9090},
                   {"name": "fsp", "protocol": "TCP", "port": 7070}]},
        {"kind": "EndpointSlice", "apiVersion": "discovery.k8s.io/v1",
         "metadata": {"name": "sandboxd-v6abc", "namespace": "sandboxd"},
         "addressType": "IPv6",
         "endpoints": [{"addresses": ["fd00::7"], "conditions": {"ready": true}}],
         "ports": [{"name": "fsp", "protocol": "TCP", "port": 7070}]},
        {"kind": "EndpointSlice", "apiVersion": "discovery.k8s.io/v1",
         "metadata": {"name": "sandboxd-other", "namespace": "sandboxd"},
         "addressType": "IPv4",
         "endpoints": [{"addresses": ["10.244.9.9"], "conditions": {"ready": true}}],
         "ports": [{"name": "metrics", "protocol": "TCP", "port": 9090}]},
        {"kind": "EndpointSlice", "apiVersion": "discovery.k8s.io/v1",
         "metadata": {"name": "sandboxd-fqdn", "namespace": "sandboxd"},
         "addressType": "FQDN",
         "endpoints": [{"addresses": ["node.example.com"], "conditions": {"ready": true}}],
         "ports": [{"name": "fsp", "protocol": "TCP", "port": 7070}]},
        {"kind": "EndpointSlice", "apiVersion": "discovery.k8s.io/v1",
         "metadata": {"name": "sandboxd-empty", "namespace": "sandboxd"},
         "addressType": "IPv4", "endpoints": null, "ports": null}
      ]
    }"#;

    #[test]
    fn ready_addresses_with_the_named_port() {
        let list: EndpointSliceList = serde_json::from_str(LIST).unwrap();
        let spec = KubernetesDiscovery::new("sandboxd");
        assert_eq!(
            endpoints_of(&list, &spec),
            vec![
                "ws://10.244.1.7:7070/ws",
                "ws://10.244.3.4:7070/ws",
                "ws://10.244.4.2:7070/ws",
                "ws://[fd00::7]:7070/ws",
            ]
        );
        let mut metrics = spec.clone();
        metrics.port_name = "metrics".into();
        metrics.tls = true;
        assert_eq!(
            endpoints_of(&list, &metrics),
            vec![
                "wss://10.244.1.7:9090/ws",
                "wss://10.244.3.4:9090/ws",
                "wss://10.244.4.2:9090/ws",
                "wss://10.244.9.9:9090/ws",
            ]
        );
        let empty: EndpointSliceList =
            serde_json::from_str(r#"{"kind":"EndpointSliceList","items":[]}"#).unwrap();
        assert!(endpoints_of(&empty, &spec).is_empty());
    }

    #[test]
    fn a_missing_ca_or_namespace_names_the_fix() {
        let mut spec = KubernetesDiscovery::new("sandboxd");
        spec.api_url = Some("https://127.0.0.1:6443".into());
        spec.namespace = Some("sandboxd".into());
        spec.ca_file = "/nonexistent/ca.crt".into();
        let err = KubernetesLister::new(spec.clone())
            .err()
            .unwrap()
            .to_string();
        assert!(
            err.contains("/nonexistent/ca.crt") && err.contains("--k8s-ca-file"),
            "{err}"
        );
        spec.api_url = Some("http://127.0.0.1:6443".into());
        spec.namespace = None;
        spec.namespace_file = "/nonexistent/namespace".into();
        let err = KubernetesLister::new(spec).err().unwrap().to_string();
        assert!(
            err.contains("/nonexistent/namespace") && err.contains("--k8s-namespace"),
            "{err}"
        );
    }

    #[test]
    fn service_and_namespace_must_be_dns_labels() {
        assert!(is_dns_label("sandboxd") && is_dns_label("a-1"));
        for bad in ["", "-a", "a-", "Sandboxd", "a/b", "a&b=c", &"a".repeat(64)] {
            assert!(!is_dns_label(bad), "{bad:?}");
        }
        let mut spec = KubernetesDiscovery::new("x&labelSelector=y");
        spec.api_url = Some("http://127.0.0.1:6443".into());
        spec.namespace = Some("sandboxd".into());
        assert!(matches!(
            KubernetesLister::new(spec).err(),
            Some(ClientError::Config(_))
        ));
    }

    #[test]
    fn refusals_are_typed_and_not_retried() {
        assert!(fix_for(403).contains("rbac.yaml"));
        assert_eq!(
            status_message(br#"{"kind":"Status","message":"forbidden: no"}"#),
            "forbidden: no"
        );
        let refused = KubernetesError::Refused {
            status: 403,
            namespace: "ns".into(),
            service: "s".into(),
            fix: String::new(),
        };
        assert!(!refused.is_retryable());
        let api = KubernetesError::Api {
            url: String::new(),
            reason: String::new(),
        };
        assert!(api.is_retryable());
    }
}

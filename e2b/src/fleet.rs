//! The E2B API on a fleet (`docs/spec/e2b-compat.md`, "On a fleet"): any node's listener serves any sandbox of
//! the fleet, so the SDK's one URL may be a load balancer in front of many nodes.
//!
//! - A sandbox id ends in its node's tag (`-` and eight hex digits of the SHA-256 of the node's name). A request for
//!   a sandbox of another node, by `E2b-Sandbox-Id` or by the control plane's path, is forwarded to that node:
//!   request and answer are streamed through (hyper's client, one pool of connections per node), never buffered
//!   whole, so a slow reader slows the process's output as it would on the node itself.
//! - `POST /v2/sandboxes` is placed on the least loaded node (sandboxes per slot of capacity, asked of every node
//!   at that moment, plus the creates this node has in flight), not where it landed; `GET /v2/sandboxes` asks every
//!   node for its page and merges them (the page token is a position in the one order all nodes share).
//! - Node-to-node calls carry the fleet's secret (`X-Sandboxd-Fleet`), not the user's API key: the node a user's
//!   call lands on checks the key, the node it is forwarded to checks the secret. A forwarded request is never
//!   forwarded again: one that reaches a node not holding its sandbox is refused (508), so nodes that disagree
//!   about the fleet cannot bounce a request between them.
//! - The nodes come from a static list or a DNS name (a Kubernetes headless Service), asked every `refresh_ms` who
//!   they are (`GET /fleet/v1/node`); only a node that answered with the secret is ever a target. A node that
//!   stops answering leaves the placement at once and the table after three refreshes; its sandboxes answer "was
//!   not found" meanwhile (its connections are refused), and again once it answers (a live restore).

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, UNIX_EPOCH};

use axum::body::Body;
use axum::extract::{RawQuery, Request, State};
use axum::http::{header, HeaderName, HeaderValue, Method, StatusCode, Uri};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Extension, Router};
use futures_util::future::join_all;
use http_body_util::BodyExt;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::config::FleetConfig;
use crate::engine::{SandboxInfo, SandboxState};
use crate::listing::{list_page, parse_list_query};
use crate::lock;
use crate::reply::{check_api_key, error_response, json_response};
use crate::{Facade, SANDBOX_ID_HEADER};

/// The header of node-to-node calls: the fleet's secret.
pub const FLEET_HEADER: HeaderName = HeaderName::from_static("x-sandboxd-fleet");

/// The header naming the node a forwarded call came from (for the logs and the loop refusal).
pub const FROM_HEADER: HeaderName = HeaderName::from_static("x-sandboxd-fleet-from");

/// How long a node has to answer who it is.
const PROBE_TIMEOUT: Duration = Duration::from_secs(1);

/// How long a create waits for the nodes' load before it places on what it knew.
const PLACE_TIMEOUT: Duration = Duration::from_millis(300);

/// How long a list waits for a node's page.
const LIST_TIMEOUT: Duration = Duration::from_secs(5);

/// Refreshes a node may miss before it leaves the table.
const MISSES_TO_LEAVE: u32 = 3;

/// Whether a header belongs to one connection and is not forwarded (RFC 9110 section 7.6.1).
fn is_hop_by_hop(name: &HeaderName) -> bool {
    matches!(
        name.as_str(),
        "connection"
            | "te"
            | "trailer"
            | "transfer-encoding"
            | "upgrade"
            | "proxy-authorization"
            | "keep-alive"
            | "proxy-connection"
    )
}

/// Why the fleet could not be set up or a node could not be reached.
#[derive(Debug, thiserror::Error)]
pub enum FleetError {
    /// The secret file could not be read.
    #[error("cannot read the fleet secret {path}: {source}")]
    Secret {
        /// The file.
        path: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The secret is too short or not printable.
    #[error("the fleet secret in {0} must be at least 16 printable ASCII bytes")]
    WeakSecret(String),
    /// This node has no name (none configured, no `$SANDBOXD_NODE_NAME`, no host name).
    #[error("this node has no name: set e2b.fleet.node")]
    NoName,
    /// A node did not answer, or answered what is not HTTP.
    #[error("node {node} did not answer: {reason}")]
    Unreachable {
        /// The node's name (or address).
        node: String,
        /// Why.
        reason: String,
    },
}

/// The short name of a node in its sandboxes' ids: eight hex digits of the SHA-256 of its name.
pub fn tag_of(name: &str) -> String {
    Sha256::digest(name.as_bytes())[..4]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// The node tag a sandbox id ends in, if it has one.
pub fn tag_in(id: &str) -> Option<&str> {
    let (_, tag) = id.rsplit_once('-')?;
    (tag.len() == 8 && tag.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))).then_some(tag)
}

/// Marks a request that came from another node of the fleet (its secret checked): it is served here, never
/// forwarded again, and needs no API key.
#[derive(Debug, Clone)]
pub struct Forwarded {
    /// The node it came from.
    pub from: String,
}

/// A node of the fleet other than this one, as it last answered.
#[derive(Debug, Clone, PartialEq)]
pub struct Peer {
    /// Its name.
    pub name: String,
    /// Its tag (in its sandboxes' ids).
    pub tag: String,
    /// Its E2B listener.
    pub addr: SocketAddr,
    /// The E2B sandboxes it holds.
    pub sandboxes: u64,
    /// How many it may hold.
    pub capacity: u64,
    /// Refreshes it has missed in a row (0: it answered the last one).
    pub misses: u32,
}

/// What `GET /fleet/v1/node` answers.
#[derive(Debug, Serialize, Deserialize)]
struct NodeAnswer {
    node: String,
    sandboxes: u64,
    capacity: u64,
}

/// A sandbox as `GET /fleet/v1/sandboxes` lists it: what the list shows, with exact times.
#[derive(Debug, Serialize, Deserialize)]
struct Listed {
    id: String,
    template: String,
    metadata: BTreeMap<String, String>,
    started_ns: u64,
    end_ns: u64,
    paused: bool,
    cpu_count: u32,
    memory_mb: u64,
    disk_mb: u64,
}

fn nanos(at: std::time::SystemTime) -> u64 {
    at.duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
}

impl From<&SandboxInfo> for Listed {
    fn from(info: &SandboxInfo) -> Self {
        Listed {
            id: info.id.clone(),
            template: info.template.clone(),
            metadata: info.metadata.clone(),
            started_ns: nanos(info.started_at),
            end_ns: nanos(info.end_at),
            paused: info.state == SandboxState::Paused,
            cpu_count: info.cpu_count,
            memory_mb: info.memory_mb,
            disk_mb: info.disk_mb,
        }
    }
}

impl From<Listed> for SandboxInfo {
    fn from(l: Listed) -> Self {
        SandboxInfo {
            id: l.id,
            template: l.template,
            metadata: l.metadata,
            started_at: UNIX_EPOCH + Duration::from_nanos(l.started_ns),
            end_at: UNIX_EPOCH + Duration::from_nanos(l.end_ns),
            state: if l.paused {
                SandboxState::Paused
            } else {
                SandboxState::Running
            },
            // A list shows no token; the node holding the sandbox answers the calls that do.
            access_token: String::new(),
            cpu_count: l.cpu_count,
            memory_mb: l.memory_mb,
            disk_mb: l.disk_mb,
        }
    }
}

/// Where a create goes.
#[derive(Debug)]
pub enum Placement {
    /// Here.
    Here,
    /// To this node.
    There(Peer),
}

/// This node's view of the fleet, and its client to the other nodes.
pub struct Fleet {
    name: String,
    tag: String,
    secret: HeaderValue,
    capacity: u64,
    peers: Vec<String>,
    peers_dns: Option<String>,
    refresh: Duration,
    client: Client<HttpConnector, Body>,
    /// The other nodes by tag.
    table: Mutex<BTreeMap<String, Peer>>,
    /// Creates this node placed and is waiting for, by tag (its own included).
    placing: Mutex<HashMap<String, u64>>,
}

impl std::fmt::Debug for Fleet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Fleet")
            .field("name", &self.name)
            .field("tag", &self.tag)
            .field("peers", &self.peers)
            .field("peers_dns", &self.peers_dns)
            .finish_non_exhaustive()
    }
}

/// Reads the fleet's secret: at least 16 printable ASCII bytes once trimmed.
fn read_secret(path: &Path) -> Result<HeaderValue, FleetError> {
    let text = std::fs::read_to_string(path).map_err(|source| FleetError::Secret {
        path: path.display().to_string(),
        source,
    })?;
    let secret = text.trim();
    let weak = || FleetError::WeakSecret(path.display().to_string());
    if secret.len() < 16 || !secret.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(weak());
    }
    let mut value = HeaderValue::from_str(secret).map_err(|_| weak())?;
    value.set_sensitive(true);
    Ok(value)
}

/// This node's name: the configured one, else `$SANDBOXD_NODE_NAME`, else the host name.
fn node_name(config: &FleetConfig) -> Result<String, FleetError> {
    if let Some(name) = &config.node {
        return Ok(name.clone());
    }
    if let Some(name) = std::env::var("SANDBOXD_NODE_NAME")
        .ok()
        .filter(|n| !n.is_empty())
    {
        return Ok(name);
    }
    nix::unistd::gethostname()
        .ok()
        .and_then(|h| h.into_string().ok())
        .filter(|h| !h.is_empty())
        .ok_or(FleetError::NoName)
}

impl Fleet {
    /// The fleet as `config` describes it, this node holding at most `capacity` sandboxes. The table is empty
    /// until [`Fleet::refresh`].
    pub fn new(config: &FleetConfig, capacity: u64) -> Result<Arc<Fleet>, FleetError> {
        let name = node_name(config)?;
        let mut http = HttpConnector::new();
        http.set_nodelay(true);
        http.set_connect_timeout(Some(Duration::from_secs(2)));
        http.set_keepalive(Some(Duration::from_secs(30)));
        let client = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(Duration::from_secs(60))
            .build(http);
        Ok(Arc::new(Fleet {
            tag: tag_of(&name),
            name,
            secret: read_secret(&config.secret_file)?,
            capacity,
            peers: config.peers.clone(),
            peers_dns: config.peers_dns.clone(),
            refresh: Duration::from_millis(config.refresh_ms),
            client,
            table: Mutex::new(BTreeMap::new()),
            placing: Mutex::new(HashMap::new()),
        }))
    }

    /// This node's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// This node's tag.
    pub fn tag(&self) -> &str {
        &self.tag
    }

    /// The other nodes as last seen.
    pub fn peers(&self) -> Vec<Peer> {
        lock(&self.table).values().cloned().collect()
    }

    /// Whether a header value is the fleet's secret (in constant time).
    fn is_secret(&self, value: &HeaderValue) -> bool {
        constant_time_eq::constant_time_eq(value.as_bytes(), self.secret.as_bytes())
    }

    /// The addresses the nodes are at now: the static list and the DNS name's records.
    async fn addresses(&self) -> Vec<SocketAddr> {
        let mut out = Vec::new();
        for spec in self.peers.iter().chain(self.peers_dns.iter()) {
            match tokio::net::lookup_host(spec.as_str()).await {
                Ok(addrs) => out.extend(addrs),
                Err(e) => tracing::warn!(peer = %spec, error = %e, "fleet: cannot resolve"),
            }
        }
        out.sort();
        out.dedup();
        out
    }

    /// A request to another node, with the secret.
    fn request(
        &self,
        method: Method,
        addr: SocketAddr,
        path_and_query: &str,
        body: Body,
    ) -> Request {
        let mut request = Request::new(body);
        *request.method_mut() = method;
        *request.uri_mut() = Uri::builder()
            .scheme("http")
            .authority(addr.to_string())
            .path_and_query(path_and_query)
            .build()
            .unwrap_or_default();
        let headers = request.headers_mut();
        headers.insert(FLEET_HEADER, self.secret.clone());
        if let Ok(from) = HeaderValue::from_str(&self.name) {
            headers.insert(FROM_HEADER, from);
        }
        request
    }

    /// Sends a small call to a node and reads its JSON answer.
    async fn call<T: serde::de::DeserializeOwned>(
        &self,
        addr: SocketAddr,
        path_and_query: &str,
        within: Duration,
    ) -> Result<T, FleetError> {
        let unreachable = |reason: String| FleetError::Unreachable {
            node: addr.to_string(),
            reason,
        };
        let request = self.request(Method::GET, addr, path_and_query, Body::empty());
        let exchange = async {
            let response = self
                .client
                .request(request)
                .await
                .map_err(|e| unreachable(e.to_string()))?;
            if !response.status().is_success() {
                return Err(unreachable(format!("answered {}", response.status())));
            }
            let body = response
                .into_body()
                .collect()
                .await
                .map_err(|e| unreachable(e.to_string()))?
                .to_bytes();
            serde_json::from_slice(&body).map_err(|e| unreachable(e.to_string()))
        };
        tokio::time::timeout(within, exchange)
            .await
            .map_err(|_| unreachable(format!("no answer within {within:?}")))?
    }

    /// Asks every node who it is and what it holds, and makes that the table: a node that does not answer keeps
    /// its place (out of the placement) until it missed [`MISSES_TO_LEAVE`] refreshes.
    pub async fn refresh(&self) {
        let addrs = self.addresses().await;
        let answers = join_all(addrs.iter().map(|&addr| async move {
            (
                addr,
                self.call::<NodeAnswer>(addr, "/fleet/v1/node", PROBE_TIMEOUT)
                    .await,
            )
        }))
        .await;
        let mut seen = BTreeMap::new();
        for (addr, answer) in answers {
            match answer {
                Ok(a) if a.node == self.name => {}
                Ok(a) => {
                    let tag = tag_of(&a.node);
                    if let Some(other) = seen.get(&tag).filter(|p: &&Peer| p.name != a.node) {
                        tracing::error!(node = %a.node, other = %other.name, tag = %tag,
                            "fleet: two nodes have the same tag; the second is left out");
                        continue;
                    }
                    seen.insert(
                        tag.clone(),
                        Peer {
                            name: a.node,
                            tag,
                            addr,
                            sandboxes: a.sandboxes,
                            capacity: a.capacity,
                            misses: 0,
                        },
                    );
                }
                Err(e) => tracing::debug!(error = %e, "fleet: probe"),
            }
        }
        let mut table = lock(&self.table);
        for (tag, mut old) in std::mem::take(&mut *table) {
            if !seen.contains_key(&tag) && old.misses + 1 < MISSES_TO_LEAVE {
                old.misses += 1;
                seen.insert(tag, old);
            } else if !seen.contains_key(&tag) {
                tracing::info!(node = %old.name, "fleet: node left");
            }
        }
        *table = seen;
    }

    /// Refreshes the table every `refresh_ms`, for as long as the fleet is referenced elsewhere.
    pub fn spawn_refresh(self: &Arc<Self>) -> tokio::task::JoinHandle<()> {
        let weak = Arc::downgrade(self);
        let every = self.refresh;
        tokio::spawn(async move {
            while let Some(fleet) = weak.upgrade() {
                fleet.refresh().await;
                drop(fleet);
                tokio::time::sleep(every).await;
            }
        })
    }

    /// The node a tag names, if it is in the table.
    pub fn peer(&self, tag: &str) -> Option<Peer> {
        lock(&self.table).get(tag).cloned()
    }

    /// Where a create goes: the node with the fewest sandboxes per slot of capacity, counting the creates this
    /// node has in flight, asked of every node now (within [`PLACE_TIMEOUT`]; one that does not answer is left
    /// out). Ties go to a random one of them.
    pub async fn place(&self, here: u64) -> Placement {
        let known: Vec<Peer> = self.peers().into_iter().filter(|p| p.misses == 0).collect();
        let fresh = join_all(known.into_iter().map(|p| async move {
            match self
                .call::<NodeAnswer>(p.addr, "/fleet/v1/node", PLACE_TIMEOUT)
                .await
            {
                Ok(a) if a.node == p.name => Some(Peer {
                    sandboxes: a.sandboxes,
                    capacity: a.capacity,
                    ..p
                }),
                _ => None,
            }
        }))
        .await;
        let placing = lock(&self.placing);
        let score = |tag: &str, held: u64, capacity: u64| {
            let busy = held + placing.get(tag).copied().unwrap_or(0);
            busy as f64 / capacity.max(1) as f64
        };
        let mut best = vec![(score(&self.tag, here, self.capacity), None)];
        for peer in fresh.into_iter().flatten() {
            let s = score(&peer.tag, peer.sandboxes, peer.capacity);
            if s < best[0].0 {
                best.clear();
            }
            if best.is_empty() || s <= best[0].0 {
                best.push((s, Some(peer)));
            }
        }
        let pick = rand::Rng::gen_range(&mut rand::thread_rng(), 0..best.len());
        match best.swap_remove(pick).1 {
            Some(peer) => Placement::There(peer),
            None => Placement::Here,
        }
    }

    /// Counts a create placed on `tag` until the guard drops.
    pub fn placing(self: &Arc<Self>, tag: &str) -> PlacingGuard {
        *lock(&self.placing).entry(tag.to_owned()).or_default() += 1;
        PlacingGuard {
            fleet: self.clone(),
            tag: tag.to_owned(),
        }
    }

    /// Sends a user's request on to `peer`, streaming both ways; the user's API key stays here.
    pub async fn forward(&self, peer: &Peer, request: Request) -> Result<Response, FleetError> {
        let (parts, body) = request.into_parts();
        let path = parts.uri.path_and_query().map_or("/", |p| p.as_str());
        let mut out = self.request(parts.method.clone(), peer.addr, path, body);
        for (name, value) in &parts.headers {
            if !is_dropped(name) {
                out.headers_mut().append(name.clone(), value.clone());
            }
        }
        let response = self
            .client
            .request(out)
            .await
            .map_err(|e| FleetError::Unreachable {
                node: peer.name.clone(),
                reason: error_chain(&e),
            })?;
        let (mut parts, body) = response.into_parts();
        let hop: Vec<HeaderName> = parts
            .headers
            .keys()
            .filter(|n| is_hop_by_hop(n))
            .cloned()
            .collect();
        for name in hop {
            parts.headers.remove(name);
        }
        Ok(Response::from_parts(parts, Body::new(body)))
    }

    /// Every other node's page of `GET /v2/sandboxes?query`, merged (a node that does not answer is left out).
    pub async fn list_elsewhere(&self, query: &str) -> Vec<SandboxInfo> {
        let path = format!("/fleet/v1/sandboxes?{query}");
        let peers: Vec<Peer> = self.peers().into_iter().filter(|p| p.misses == 0).collect();
        let pages = join_all(peers.iter().map(|p| {
            let path = path.clone();
            async move {
                (
                    p,
                    self.call::<Vec<Listed>>(p.addr, &path, LIST_TIMEOUT).await,
                )
            }
        }))
        .await;
        let mut out = Vec::new();
        for (peer, page) in pages {
            match page {
                Ok(page) => out.extend(page.into_iter().map(SandboxInfo::from)),
                Err(e) => {
                    tracing::warn!(node = %peer.name, error = %e, "fleet: list left a node out")
                }
            }
        }
        out
    }
}

/// Whether a user's request header is not sent on: connection headers, `Host` (the client sets the node's) and
/// the user's API key (the node it goes to trusts the secret instead). Headers that would pose as the fleet are
/// dropped too, though [`route`] refuses them before.
fn is_dropped(name: &HeaderName) -> bool {
    is_hop_by_hop(name)
        || *name == header::HOST
        || name == "x-api-key"
        || *name == FLEET_HEADER
        || *name == FROM_HEADER
}

/// An error with its sources, for the answer's message.
fn error_chain(err: &dyn std::error::Error) -> String {
    let mut out = err.to_string();
    let mut source = err.source();
    while let Some(s) = source {
        out.push_str(": ");
        out.push_str(&s.to_string());
        source = s.source();
    }
    out
}

/// Counts a placed create while it is under way.
pub struct PlacingGuard {
    fleet: Arc<Fleet>,
    tag: String,
}

impl Drop for PlacingGuard {
    fn drop(&mut self) {
        let mut placing = lock(&self.fleet.placing);
        if let Some(n) = placing.get_mut(&self.tag) {
            *n = n.saturating_sub(1);
        }
    }
}

/// Whether a path is the control plane's (404 for a sandbox not found) rather than the sandbox plane's (502).
fn is_control_plane(path: &str) -> bool {
    path.starts_with("/sandboxes/") || path.starts_with("/v2/sandboxes/")
}

/// The sandbox a request is for: its `E2b-Sandbox-Id`, else the id in a control-plane path.
fn target_id(request: &Request) -> Option<String> {
    if let Some(id) = request
        .headers()
        .get(SANDBOX_ID_HEADER)
        .and_then(|v| v.to_str().ok())
    {
        return Some(id.to_owned());
    }
    let path = request.uri().path();
    let rest = path
        .strip_prefix("/v2/sandboxes/")
        .or_else(|| path.strip_prefix("/sandboxes/"))?;
    let id = rest.split('/').next().filter(|id| !id.is_empty())?;
    Some(id.to_owned())
}

/// The answer to a call for a sandbox that no node of the fleet serves: as its own node would answer (404 on the
/// control plane, 502 "was not found" on the sandbox plane, which the SDK reports as a sandbox not running).
fn not_found(path: &str, id: &str, why: &str) -> Response {
    let status = if is_control_plane(path) {
        StatusCode::NOT_FOUND
    } else {
        StatusCode::BAD_GATEWAY
    };
    error_response(status, &format!("The sandbox {id} was not found: {why}"))
}

/// The fleet's routing, before every route: checks and marks a call from another node, forwards a user's call for
/// another node's sandbox, serves the rest here.
pub async fn route(State(facade): State<Facade>, mut request: Request, next: Next) -> Response {
    let Some(fleet) = &facade.fleet else {
        return next.run(request).await;
    };
    let path = request.uri().path().to_owned();
    if let Some(secret) = request.headers().get(&FLEET_HEADER) {
        if !fleet.is_secret(secret) {
            return error_response(StatusCode::UNAUTHORIZED, "Invalid fleet secret");
        }
        let from = request
            .headers()
            .get(&FROM_HEADER)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("?")
            .to_owned();
        if let Some(id) = target_id(&request) {
            if tag_in(&id).is_some_and(|tag| tag != fleet.tag) {
                return error_response(
                    StatusCode::LOOP_DETECTED,
                    &format!(
                        "node {from} forwarded the call for sandbox {id} to node {}, which does not hold it; \
                         a forwarded call is not forwarded again",
                        fleet.name
                    ),
                );
            }
        }
        request.extensions_mut().insert(Forwarded { from });
        return next.run(request).await;
    }
    if path.starts_with("/fleet/") {
        return error_response(StatusCode::UNAUTHORIZED, "Missing fleet secret");
    }
    let Some(id) = target_id(&request) else {
        if is_signed_download(&request) {
            return signed_download(fleet, request, next).await;
        }
        return next.run(request).await;
    };
    let Some(tag) = tag_in(&id).filter(|tag| *tag != fleet.tag) else {
        return next.run(request).await;
    };
    if is_control_plane(&path) {
        // The key is checked where the call lands; it does not travel.
        if let Err(refusal) = check_api_key(&facade, request.headers()) {
            return refusal.into_response();
        }
    }
    let Some(peer) = fleet.peer(tag) else {
        return not_found(
            &path,
            &id,
            &format!("no node of the fleet has the tag {tag}"),
        );
    };
    match fleet.forward(&peer, request).await {
        Ok(response) => response,
        Err(e) => {
            tracing::warn!(sandbox = %id, error = %e, "fleet: forward failed");
            not_found(&path, &id, &e.to_string())
        }
    }
}

/// Whether a request is a signed `GET /files` (`download_url`) without `E2b-Sandbox-Id`: a plain client's, which
/// names no sandbox; the signature names it only to the node that holds the sandbox's token.
fn is_signed_download(request: &Request) -> bool {
    request.method() == Method::GET
        && request.uri().path() == "/files"
        && request
            .uri()
            .query()
            .is_some_and(|q| form_urlencoded::parse(q.as_bytes()).any(|(k, _)| k == "signature"))
}

/// A signed download this node cannot place: served here when the signature is one of this node's sandboxes',
/// else asked of the other nodes, all at once (a GET has no body to replay), and the first answer that is not a
/// refusal of the signature wins; when every node refuses it, this node's refusal is the answer.
async fn signed_download(fleet: &Fleet, request: Request, next: Next) -> Response {
    let (parts, _) = request.into_parts();
    let copy = |parts: &axum::http::request::Parts| {
        let mut r = Request::new(Body::empty());
        *r.method_mut() = parts.method.clone();
        *r.uri_mut() = parts.uri.clone();
        *r.headers_mut() = parts.headers.clone();
        r
    };
    let here = next.run(copy(&parts)).await;
    if here.status() != StatusCode::UNAUTHORIZED {
        return here;
    }
    let peers: Vec<Peer> = fleet
        .peers()
        .into_iter()
        .filter(|p| p.misses == 0)
        .collect();
    let answers = join_all(peers.iter().map(|p| fleet.forward(p, copy(&parts)))).await;
    answers
        .into_iter()
        .flatten()
        .find(|r| r.status() != StatusCode::UNAUTHORIZED)
        .unwrap_or(here)
}

/// The node-to-node routes (behind [`route`], which checked the secret).
pub fn routes() -> Router<Facade> {
    Router::new()
        .route("/fleet/v1/node", get(node))
        .route("/fleet/v1/sandboxes", get(sandboxes))
}

/// `GET /fleet/v1/node`: who this node is and what it holds (its sandboxes and the creates it is making).
async fn node(State(facade): State<Facade>, _from: Extension<Forwarded>) -> Response {
    let Some(fleet) = &facade.fleet else {
        return StatusCode::NOT_FOUND.into_response();
    };
    // Creates under way count: a node placing at the same moment sees them.
    let creating = lock(&fleet.placing).get(&fleet.tag).copied();
    let answer = NodeAnswer {
        node: fleet.name.clone(),
        sandboxes: facade.engine.list().len() as u64 + creating.unwrap_or(0),
        capacity: fleet.capacity,
    };
    json_response(StatusCode::OK, &serde_json::json!(answer))
}

/// `GET /fleet/v1/sandboxes?query`: this node's page of `GET /v2/sandboxes?query`, with exact times.
async fn sandboxes(
    State(facade): State<Facade>,
    _from: Extension<Forwarded>,
    RawQuery(query): RawQuery,
) -> Response {
    let query = match parse_list_query(query.as_deref().unwrap_or("")) {
        Ok(q) => q,
        Err(e) => return error_response(StatusCode::BAD_REQUEST, &e),
    };
    let infos = facade.engine.list().iter().map(|s| s.info()).collect();
    let (page, _) = list_page(infos, &query);
    let listed: Vec<Listed> = page.iter().map(Listed::from).collect();
    json_response(StatusCode::OK, &serde_json::json!(listed))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tag_is_eight_hex_digits_of_the_name() {
        let tag = tag_of("node-a");
        assert_eq!(tag.len(), 8);
        assert_ne!(tag, tag_of("node-b"));
        assert_eq!(tag, tag_of("node-a"));
    }

    #[test]
    fn the_tag_is_read_from_the_end_of_an_id() {
        assert_eq!(tag_in("i3a1b2c3d4e5f6a7b8-0123abcd"), Some("0123abcd"));
        assert_eq!(tag_in("i3a1b2c3d4e5f6a7b8"), None);
        assert_eq!(tag_in("x-0123ABCD"), None);
        assert_eq!(tag_in("x-0123abc"), None);
        assert_eq!(tag_in("x-0123abcde"), None);
    }

    #[test]
    fn the_sandbox_of_a_request() {
        let req = |uri: &str| Request::builder().uri(uri).body(Body::empty()).unwrap();
        assert_eq!(target_id(&req("/sandboxes/abc")).as_deref(), Some("abc"));
        assert_eq!(
            target_id(&req("/sandboxes/abc/timeout")).as_deref(),
            Some("abc")
        );
        assert_eq!(
            target_id(&req("/v2/sandboxes/abc/connect")).as_deref(),
            Some("abc")
        );
        assert_eq!(target_id(&req("/v2/sandboxes")), None);
        assert_eq!(target_id(&req("/v2/sandboxes?limit=1")), None);
        let mut r = req("/files?path=x");
        r.headers_mut()
            .insert(SANDBOX_ID_HEADER, HeaderValue::from_static("s-1"));
        assert_eq!(target_id(&r).as_deref(), Some("s-1"));
    }

    #[test]
    fn a_weak_secret_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s");
        std::fs::write(&path, "short\n").unwrap();
        assert!(matches!(read_secret(&path), Err(FleetError::WeakSecret(_))));
        std::fs::write(&path, "with a space inside it\n").unwrap();
        assert!(matches!(read_secret(&path), Err(FleetError::WeakSecret(_))));
        std::fs::write(&path, "  0123456789abcdef0123\n").unwrap();
        assert_eq!(read_secret(&path).unwrap(), "0123456789abcdef0123");
        assert!(matches!(
            read_secret(&dir.path().join("missing")),
            Err(FleetError::Secret { .. })
        ));
    }
}

//! [`Fleet`]: many sandboxd hosts behind one client. It implements [`Execute`], so code written for a
//! [`Pool`] runs on a fleet unchanged.
//!
//! - **Endpoints** come from a [`Discovery`]: a static list (changed at run time with
//!   [`Fleet::set_endpoints`]), a DNS name whose A/AAAA records are resolved again periodically, or the
//!   EndpointSlices of a Kubernetes headless Service listed again periodically ([`KubernetesDiscovery`]). Nodes
//!   that join are used from the next placement on; nodes that leave receive nothing new (their executions in
//!   flight go on).
//! - **One [`Pool`] per node**, built from one [`PoolBuilder`] (token, sizes, timeouts, TLS).
//! - **Placement** by power-of-K choices (K = 2): K admitted nodes sampled at random, the one with the lowest
//!   load score taken. The score is the node's running plus queued executions from its last `pong`, plus this
//!   client's executions in flight on it, per slot of its `max_concurrent` (from `/healthz`).
//! - **Health checks**: every node is checked every `check_interval` (a `ping` on a connection of its own and
//!   `GET /healthz`); after `eject_after` failures in a row it is ejected, checked again after a backoff, and
//!   re-admitted by the first check that passes (see [`NodeHealth`]).
//! - **Retries never duplicate work.** An execution refused with `SANDBOX_OVERLOADED`, or whose connection
//!   failed before the node's `ack`, is placed on another node (each node at most once per execution). Once a node
//!   acknowledged it, losing the node (connection broken, or node ejected) ends it with
//!   [`ClientError::NodeLost`], retryable: whether to run it again is the caller's call. When no node takes it:
//!   [`ClientError::NoNode`]. Every execution ends in a result or one of these errors.
//!
//! ```no_run
//! use client::{Discovery, Execute, Fleet};
//!
//! # async fn run(request: client::ExecuteRequest) -> Result<(), client::ClientError> {
//! let fleet = Fleet::builder(Discovery::Static(vec![
//!     "ws://10.0.0.1:7070/ws".into(),
//!     "ws://10.0.0.2:7070/ws".into(),
//! ]))
//! .pool(client::Pool::builder("").token("the-token").size(4))
//! .build()
//! .await?;
//! let result = fleet.execute(request).await?;
//! # Ok(())
//! # }
//! ```
//!
//! The fleet's checks and discovery run on a task spawned by [`FleetBuilder::build`] (so it needs a tokio
//! runtime), which stops when the last clone of the fleet is dropped.

mod discovery;
mod kubernetes;
mod node;
mod place;

use std::collections::HashSet;
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;

pub use crate::error::KubernetesError;
use discovery::Source;
pub use discovery::{Discovery, DnsDiscovery, DEFAULT_DNS_INTERVAL};
pub use kubernetes::{
    KubernetesDiscovery, DEFAULT_K8S_INTERVAL, DEFAULT_K8S_PORT_NAME, SERVICE_ACCOUNT_DIR,
};
use node::{Checks, Node};
pub use node::{NodeHealth, NodeStatus};
use protocol::{ErrorCode, ExecuteRequest};
use tokio_util::sync::CancellationToken;

use agent_api::{CreateSandboxRequest, PluginError};

use crate::config::ExecOptions;
use crate::error::ClientError;
use crate::execute::Execute;
use crate::execution::{Execution, NodeWatch};
use crate::gateway::{GatewayError, SandboxClient};
use crate::pool::{Pool, PoolBuilder};

/// Default number of nodes sampled per placement.
pub const DEFAULT_CHOICES: usize = 2;
/// Default time between two health checks of a node.
pub const DEFAULT_CHECK_INTERVAL: Duration = Duration::from_secs(1);
/// Default time a health check has to pass.
pub const DEFAULT_CHECK_TIMEOUT: Duration = Duration::from_secs(1);
/// Default failed checks in a row that eject a node.
pub const DEFAULT_EJECT_AFTER: u32 = 2;
/// Default first backoff of an ejected node (doubling while it keeps failing).
pub const DEFAULT_EJECT_BASE: Duration = Duration::from_millis(500);
/// Default longest backoff of an ejected node.
pub const DEFAULT_EJECT_MAX: Duration = Duration::from_secs(30);

/// Builds a [`Fleet`]: `Fleet::builder(discovery).pool(Pool::builder("").token(..)).build().await`.
#[derive(Debug, Clone)]
pub struct FleetBuilder {
    discovery: Discovery,
    pool: PoolBuilder,
    choices: usize,
    checks: Checks,
}

impl FleetBuilder {
    /// The settings of every node's pool (its URL is replaced by the node's).
    pub fn pool(mut self, pool: PoolBuilder) -> Self {
        self.pool = pool;
        self
    }

    /// Nodes sampled per placement (default 2; 1 is random placement).
    pub fn choices(mut self, k: usize) -> Self {
        self.choices = k.max(1);
        self
    }

    /// Time between two health checks of a node (default 1 s).
    pub fn check_interval(mut self, every: Duration) -> Self {
        self.checks.interval = every;
        self
    }

    /// Time a health check has to pass (default 1 s).
    pub fn check_timeout(mut self, within: Duration) -> Self {
        self.checks.timeout = within;
        self
    }

    /// Failed checks in a row that eject a node (default 2).
    pub fn eject_after(mut self, failures: u32) -> Self {
        self.checks.eject_after = failures.max(1);
        self
    }

    /// Backoff of an ejected node: `base`, doubling while it keeps failing, at most `max`.
    pub fn eject_backoff(mut self, base: Duration, max: Duration) -> Self {
        self.checks.eject_base = base;
        self.checks.eject_max = max.max(base);
        self
    }

    /// Checks the configuration, discovers the nodes and checks each once, and starts the background checks.
    /// Needs a tokio runtime.
    pub async fn build(self) -> Result<Fleet, ClientError> {
        // A pool for a placeholder URL checks everything but the URL once, before any node exists.
        self.pool.for_url("ws://placeholder/ws").build()?;
        let source = Source::new(&self.discovery)?;
        let inner = Arc::new(Inner {
            pool: self.pool,
            choices: self.choices,
            checks: self.checks,
            nodes: Mutex::new(Vec::new()),
            stop: CancellationToken::new(),
        });
        let fleet = Fleet { inner };
        match (&self.discovery, &source) {
            (Discovery::Static(urls), _) => fleet.set_endpoints(urls)?,
            (_, Some(source)) => fleet.set_endpoints(&source.endpoints().await?)?,
            (_, None) => {}
        }
        fleet.check_now().await;
        tokio::spawn(background(Arc::downgrade(&fleet.inner), source));
        Ok(fleet)
    }
}

struct Inner {
    pool: PoolBuilder,
    choices: usize,
    checks: Checks,
    nodes: Mutex<Vec<Arc<Node>>>,
    stop: CancellationToken,
}

impl Drop for Inner {
    fn drop(&mut self) {
        self.stop.cancel();
        for node in self
            .nodes
            .get_mut()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
        {
            node.retire();
        }
    }
}

/// Many sandboxd hosts behind one client (see the [module docs](self)). Cheap to clone (clones share the fleet).
#[derive(Clone)]
pub struct Fleet {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Fleet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Fleet")
            .field("nodes", &self.status())
            .finish()
    }
}

impl Fleet {
    /// A builder for a fleet whose nodes come from `discovery`.
    pub fn builder(discovery: Discovery) -> FleetBuilder {
        FleetBuilder {
            discovery,
            pool: Pool::builder(""),
            choices: DEFAULT_CHOICES,
            checks: Checks {
                interval: DEFAULT_CHECK_INTERVAL,
                timeout: DEFAULT_CHECK_TIMEOUT,
                eject_after: DEFAULT_EJECT_AFTER,
                eject_base: DEFAULT_EJECT_BASE,
                eject_max: DEFAULT_EJECT_MAX,
            },
        }
    }

    fn nodes(&self) -> MutexGuard<'_, Vec<Arc<Node>>> {
        self.inner.nodes.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Replaces the node list: nodes not in `urls` are retired (nothing new is placed on them; their executions
    /// in flight go on), new ones are added (trusted until a check fails). Nodes kept keep their pools and state.
    pub fn set_endpoints(&self, urls: &[impl AsRef<str>]) -> Result<(), ClientError> {
        let wanted: Vec<&str> = urls.iter().map(AsRef::as_ref).collect();
        let mut added = Vec::new();
        for url in &wanted {
            if !self.nodes().iter().any(|n| &*n.url == *url)
                && !added.iter().any(|n: &Arc<Node>| &*n.url == *url)
            {
                let builder = self.inner.pool.for_url(url);
                let probe = builder.options().clone();
                added.push(Arc::new(Node::new(url, builder.build()?, probe)));
            }
        }
        let retired: Vec<Arc<Node>> = {
            let mut nodes = self.nodes();
            let (keep, gone): (Vec<_>, Vec<_>) =
                nodes.drain(..).partition(|n| wanted.contains(&&*n.url));
            *nodes = keep;
            nodes.extend(added);
            gone
        };
        for node in retired {
            tracing::info!(node = %node.url, "fleet node left discovery");
            node.retire();
        }
        Ok(())
    }

    /// The endpoints now.
    pub fn endpoints(&self) -> Vec<String> {
        self.nodes().iter().map(|n| n.url.to_string()).collect()
    }

    /// Every node: address, version, load and capacity, health, in flight, placed, last error.
    pub fn status(&self) -> Vec<NodeStatus> {
        self.nodes().iter().map(|n| n.status()).collect()
    }

    /// Checks every node whose check is due now (concurrently), as the background task does every interval.
    pub async fn check_now(&self) {
        let due: Vec<Arc<Node>> = self
            .nodes()
            .iter()
            .filter(|n| n.check_due())
            .cloned()
            .collect();
        let checks = self.inner.checks;
        futures_util::future::join_all(due.iter().map(|n| n.check(&checks))).await;
    }

    /// The node the next placement would choose (sampling, so two calls may differ), for a caller that places
    /// something of its own on the fleet's nodes; `None` when no node is admitted.
    pub fn pick(&self) -> Option<String> {
        self.place(&HashSet::new()).map(|n| n.url.to_string())
    }

    /// Picks an admitted node not in `tried` by power-of-K choices.
    fn place(&self, tried: &HashSet<Arc<str>>) -> Option<Arc<Node>> {
        let candidates: Vec<Arc<Node>> = self
            .nodes()
            .iter()
            .filter(|n| n.admitted() && !tried.contains(&n.url))
            .cloned()
            .collect();
        let scores: Vec<f64> = candidates.iter().map(|n| n.score()).collect();
        let i = place::pick(&scores, self.inner.choices, &mut rand::thread_rng())?;
        candidates.into_iter().nth(i)
    }

    /// Sends `request` to `node` and waits for its `ack`.
    async fn try_node(
        &self,
        node: &Arc<Node>,
        request: ExecuteRequest,
        options: ExecOptions,
    ) -> Result<Execution, ClientError> {
        let in_flight = node.start();
        // Taken before sending, so an ejection at any point from here on is seen.
        let mut lost = node.lost();
        let mut execution = node.pool.execute_stream_with(request, options).await?;
        tokio::select! {
            acked = execution.wait_ack() => acked?,
            // Ejected (e.g. partitioned) before it acknowledged: as good as a connection failing before the ack.
            reason = &mut lost => return Err(ClientError::Disconnected { reason }),
        }
        execution.hold(in_flight);
        execution.watch_node(NodeWatch {
            url: node.url.clone(),
            lost,
        });
        Ok(execution)
    }
}

impl Fleet {
    /// Creates an agent sandbox (`POST /sandboxes`) on a node placed as executions are (power-of-K choices on
    /// load), with the fleet's token. The client returned names that node in its endpoints, so its calls, its
    /// event stream and replay reach it afterwards. A node that creates nothing (unreachable: the request was not
    /// sent; or at its sandbox limit: a retryable `provider_unavailable`) is skipped for another; any other
    /// answer is returned as it is (a request that reached a node is never sent to a second one).
    pub async fn create_sandbox(
        &self,
        req: &CreateSandboxRequest,
    ) -> Result<SandboxClient, GatewayError> {
        let mut tried = HashSet::new();
        let mut last = "no node is admitted".to_owned();
        while let Some(node) = self.place(&tried) {
            tried.insert(node.url.clone());
            let gateway = match node.gateway().await {
                Ok(g) => g,
                Err(why) => {
                    last = why;
                    continue;
                }
            };
            let _placed = node.start();
            match gateway.create(req).await {
                Ok(sandbox) => return Ok(sandbox),
                Err(e) if skipped(&e) => {
                    tracing::debug!(node = %node.url, error = %e, "placing the sandbox on another node");
                    last = format!("{}: {e}", node.url);
                }
                Err(e) => return Err(e),
            }
        }
        Err(GatewayError::NoNode {
            tried: tried.len(),
            last,
        })
    }
}

/// Whether a failed create means the node made nothing, so another node may be asked.
fn skipped(e: &GatewayError) -> bool {
    match e {
        GatewayError::Connect { .. } => true,
        GatewayError::Plugin {
            error: PluginError::ProviderUnavailable { retryable, .. },
            ..
        } => *retryable,
        _ => false,
    }
}

/// Whether an error before the `ack` means the request can go to another node without running twice, and
/// whether it says the node is unreachable.
fn before_ack(error: &ClientError) -> Option<Refusal> {
    match error {
        ClientError::Server {
            code: ErrorCode::SandboxOverloaded,
            ..
        }
        | ClientError::PoolExhausted { .. } => Some(Refusal::Busy),
        ClientError::Connect { .. }
        | ClientError::ConnectTimeout { .. }
        | ClientError::Unresponsive { .. } => Some(Refusal::Unreachable),
        ClientError::Disconnected { .. } | ClientError::Closed => Some(Refusal::Dropped),
        _ => None,
    }
}

enum Refusal {
    Busy,
    Unreachable,
    Dropped,
}

/// Places each request on a node by power-of-K choices, and on another one when a node refuses it before its
/// `ack` (see the [module docs](self)).
impl Execute for Fleet {
    async fn execute_stream_with(
        &self,
        request: ExecuteRequest,
        options: ExecOptions,
    ) -> Result<Execution, ClientError> {
        request.validate().map_err(ClientError::InvalidRequest)?;
        let mut tried = HashSet::new();
        let mut last = "no node is admitted".to_owned();
        while let Some(node) = self.place(&tried) {
            tried.insert(node.url.clone());
            match self.try_node(&node, request.clone(), options).await {
                Ok(execution) => return Ok(execution),
                Err(e) => match before_ack(&e) {
                    Some(refusal) => {
                        match refusal {
                            Refusal::Busy => node.overloaded(&e),
                            Refusal::Unreachable => node.unreachable(&e, &self.inner.checks),
                            Refusal::Dropped => {}
                        }
                        tracing::debug!(node = %node.url, error = %e, "placing on another node");
                        last = format!("{}: {e}", node.url);
                    }
                    None => return Err(e),
                },
            }
        }
        Err(ClientError::NoNode {
            tried: tried.len(),
            last,
        })
    }
}

/// Checks the nodes every interval and asks the discovery source again on its own schedule, until the fleet is
/// dropped.
async fn background(fleet: Weak<Inner>, source: Option<Source>) {
    let Some((stop, every)) = fleet.upgrade().map(|i| (i.stop.clone(), i.checks.interval)) else {
        return;
    };
    let mut checks = tokio::time::interval(every);
    checks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut resolve = tokio::time::interval(
        source
            .as_ref()
            .map_or(Duration::from_secs(3600), Source::interval),
    );
    resolve.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = checks.tick() => {
                let Some(inner) = fleet.upgrade() else { return };
                Fleet { inner }.check_now().await;
            }
            _ = resolve.tick(), if source.is_some() => {
                let (Some(source), Some(inner)) = (&source, fleet.upgrade()) else { return };
                match source.endpoints().await {
                    Ok(urls) => {
                        if let Err(e) = (Fleet { inner }).set_endpoints(&urls) {
                            tracing::warn!(error = %e, "fleet: discovery answer not usable");
                        }
                    }
                    Err(e) => tracing::warn!(error = %e, "fleet: discovery failed; keeping the nodes"),
                }
            }
        }
    }
}

//! One node of a fleet: its pool, what its last health check said (load, capacity, version), this client's
//! executions in flight on it, and its ejection state.
//!
//! A node is admitted until `eject_after` health checks in a row fail (or an execution cannot connect to it);
//! then it is ejected: nothing is placed on it, the executions it had acknowledged end with
//! [`ClientError::NodeLost`], and it is checked again after a backoff (doubling from `eject_base` to
//! `eject_max` while it keeps failing). The first check that passes re-admits it.

use std::future::Future;
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use protocol::Load;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::config::ConnectOptions;
use crate::connection::Connection;
use crate::error::ClientError;
use crate::gateway::Gateway;
use crate::health::health;
use crate::pool::Pool;

/// How a fleet checks and ejects its nodes.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Checks {
    pub(crate) interval: Duration,
    pub(crate) timeout: Duration,
    pub(crate) eject_after: u32,
    pub(crate) eject_base: Duration,
    pub(crate) eject_max: Duration,
}

/// Whether a node takes executions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NodeHealth {
    /// Not checked yet (executions are placed on it: a node is trusted until a check fails).
    Unknown,
    /// Its last check passed.
    Healthy,
    /// Its last check failed, but fewer than the ejection threshold in a row.
    Suspect,
    /// Ejected: nothing is placed on it until a check passes again.
    Ejected,
}

/// One node as [`Fleet::status`](crate::Fleet::status) reports it.
#[derive(Debug, Clone, PartialEq)]
pub struct NodeStatus {
    /// The endpoint.
    pub url: String,
    /// Whether it takes executions.
    pub health: NodeHealth,
    /// `version` from its `/healthz`.
    pub version: Option<String>,
    /// Executions running and queued there (its last `pong`).
    pub load: Option<Load>,
    /// Its `max_concurrent` (from `/healthz`).
    pub capacity: Option<u64>,
    /// This client's executions in flight on it.
    pub in_flight: u64,
    /// Executions this client placed on it so far.
    pub placed: u64,
    /// Times it was ejected.
    pub ejections: u64,
    /// The last failure seen (check or execution), if any.
    pub last_error: Option<String>,
}

#[derive(Default)]
struct State {
    checked: bool,
    load: Option<Load>,
    capacity: Option<u64>,
    version: Option<String>,
    failures: u32,
    ejected: bool,
    ejections: u64,
    /// Ejections since it was last healthy (the backoff's exponent).
    ejected_in_a_row: u32,
    next_check: Option<Instant>,
    last_error: Option<String>,
    /// A dedicated connection for the pings, so a busy pool does not fail a check.
    probe: Option<Connection>,
}

pub(crate) struct Node {
    pub(crate) url: Arc<str>,
    pub(crate) pool: Pool,
    probe_options: Arc<ConnectOptions>,
    in_flight: AtomicU64,
    placed: AtomicU64,
    state: Mutex<State>,
    /// Cancelled when the node is ejected; executions it acknowledged watch it.
    lost: Mutex<CancellationToken>,
}

/// One of this client's executions in flight on a node; counts while alive.
pub(crate) struct InFlight(Arc<Node>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Node {
    pub(crate) fn new(url: &str, pool: Pool, probe_options: ConnectOptions) -> Self {
        Node {
            url: url.into(),
            pool,
            probe_options: Arc::new(probe_options),
            in_flight: AtomicU64::new(0),
            placed: AtomicU64::new(0),
            state: Mutex::new(State::default()),
            lost: Mutex::new(CancellationToken::new()),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A gateway to the node's agent endpoints (`http://host:port`, with the fleet's token); `None` for a
    /// `wss://` node (the gateway is plain HTTP) or a token provider that fails.
    pub(crate) async fn gateway(&self) -> Result<Gateway, String> {
        let healthz = crate::health::healthz_url(&self.url).map_err(|e| e.to_string())?;
        let base = healthz
            .strip_suffix("/healthz")
            .filter(|b| b.starts_with("http://"))
            .ok_or_else(|| format!("{}: the gateway speaks plain http only", self.url))?;
        let token = self
            .probe_options
            .auth
            .current()
            .await
            .map_err(|e| format!("the token provider failed: {e}"))?;
        Ok(Gateway::new(base, token.as_deref().unwrap_or("")))
    }

    /// Whether executions may be placed here.
    pub(crate) fn admitted(&self) -> bool {
        !self.lock().ejected
    }

    /// Its load score (see [`super::place::score`]).
    pub(crate) fn score(&self) -> f64 {
        let st = self.lock();
        let load = st.load.unwrap_or_default();
        super::place::score(
            load.active_executions,
            load.queue_depth,
            self.in_flight.load(Ordering::Relaxed),
            st.capacity,
        )
    }

    /// Counts an execution placed here until the returned guard drops.
    pub(crate) fn start(self: &Arc<Self>) -> InFlight {
        self.in_flight.fetch_add(1, Ordering::Relaxed);
        self.placed.fetch_add(1, Ordering::Relaxed);
        InFlight(self.clone())
    }

    /// A future that completes with the reason when the node is ejected from now on.
    pub(crate) fn lost(self: &Arc<Self>) -> Pin<Box<dyn Future<Output = String> + Send + Sync>> {
        let token = self.lost.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let node = self.clone();
        Box::pin(async move {
            token.cancelled_owned().await;
            let reason = node.lock().last_error.clone();
            format!(
                "the node was ejected: {}",
                reason.as_deref().unwrap_or("it failed its health checks")
            )
        })
    }

    /// An execution could not reach the node (connect failure): ejected at once, since the connection attempt
    /// is itself a failed check.
    pub(crate) fn unreachable(&self, error: &ClientError, checks: &Checks) {
        let mut st = self.lock();
        st.failures = st.failures.max(checks.eject_after);
        st.last_error = Some(error.to_string());
        if !st.ejected {
            self.eject(&mut st, checks);
        }
    }

    /// Refused with `SANDBOX_OVERLOADED`: full until the next check says otherwise.
    pub(crate) fn overloaded(&self, error: &ClientError) {
        let mut st = self.lock();
        st.last_error = Some(error.to_string());
        let full = st.capacity.unwrap_or(1);
        let load = st.load.get_or_insert_with(Load::default);
        load.active_executions = load.active_executions.max(full);
        load.queue_depth = load.queue_depth.max(1);
    }

    fn eject(&self, st: &mut State, checks: &Checks) {
        if !st.ejected {
            st.ejections += 1;
        }
        st.ejected = true;
        let exp = st.ejected_in_a_row.min(16);
        st.ejected_in_a_row += 1;
        let backoff = checks
            .eject_base
            .saturating_mul(1 << exp)
            .min(checks.eject_max);
        st.next_check = Some(Instant::now() + backoff);
        let mut lost = self.lost.lock().unwrap_or_else(|p| p.into_inner());
        lost.cancel();
        *lost = CancellationToken::new();
        tracing::warn!(node = %self.url, ?backoff, error = ?st.last_error, "fleet node ejected");
    }

    /// Whether a check is due (an ejected node waits out its backoff).
    pub(crate) fn check_due(&self) -> bool {
        let st = self.lock();
        st.next_check.is_none_or(|t| Instant::now() >= t)
    }

    /// Checks the node: a `ping` on its probe connection (the load) and `GET /healthz` (status, version,
    /// capacity), both within `checks.timeout`.
    pub(crate) async fn check(&self, checks: &Checks) {
        let probe = self.lock().probe.clone();
        let ping = async {
            let conn = match probe {
                Some(c) => c,
                None => {
                    let c = tokio::time::timeout(
                        checks.timeout,
                        Connection::connect_shared(self.probe_options.clone()),
                    )
                    .await
                    .map_err(|_| ClientError::ConnectTimeout {
                        url: self.url.to_string(),
                        after: checks.timeout,
                    })??;
                    self.lock().probe = Some(c.clone());
                    c
                }
            };
            conn.ping(checks.timeout).await
        };
        let healthz = health(&self.url, self.probe_options.tls.clone(), checks.timeout);
        let (pong, healthz) = tokio::join!(ping, healthz);
        let outcome = match (pong, healthz) {
            (Ok(pong), Ok(h)) if h.is_healthy() => Ok((pong, h)),
            (Ok(_), Ok(h)) => Err(format!(
                "/healthz answered {} {}",
                h.status, h.body["status"]
            )),
            (Err(e), _) | (_, Err(e)) => Err(e.to_string()),
        };
        let mut st = self.lock();
        st.checked = true;
        match outcome {
            Ok((pong, h)) => {
                if st.ejected {
                    tracing::info!(node = %self.url, "fleet node re-admitted");
                }
                st.load = Some(pong.load);
                st.capacity = h.body["max_concurrent"].as_u64();
                st.version = h.body["version"].as_str().map(str::to_owned);
                st.failures = 0;
                st.ejected = false;
                st.ejected_in_a_row = 0;
                st.next_check = None;
            }
            Err(reason) => {
                if let Some(c) = st.probe.take() {
                    c.close();
                }
                st.failures += 1;
                st.last_error = Some(reason);
                if st.ejected || st.failures >= checks.eject_after {
                    self.eject(&mut st, checks);
                }
            }
        }
    }

    pub(crate) fn status(&self) -> NodeStatus {
        let st = self.lock();
        let health = match (st.checked, st.ejected, st.failures) {
            (_, true, _) => NodeHealth::Ejected,
            (false, false, _) => NodeHealth::Unknown,
            (true, false, 0) => NodeHealth::Healthy,
            (true, false, _) => NodeHealth::Suspect,
        };
        NodeStatus {
            url: self.url.to_string(),
            health,
            version: st.version.clone(),
            load: st.load,
            capacity: st.capacity,
            in_flight: self.in_flight.load(Ordering::Relaxed),
            placed: self.placed.load(Ordering::Relaxed),
            ejections: st.ejections,
            last_error: st.last_error.clone(),
        }
    }

    /// Stops using the node (it left discovery): idle connections close, executions in flight go on.
    pub(crate) fn retire(&self) {
        self.pool.close();
        if let Some(c) = self.lock().probe.take() {
            c.close();
        }
    }
}

/// `ws://<ip>:<port><path>` (`wss://` with `tls`), the address in brackets for IPv6.
pub(crate) fn ws_url(tls: bool, ip: IpAddr, port: u16, path: &str) -> String {
    let scheme = if tls { "wss" } else { "ws" };
    match ip {
        IpAddr::V4(v4) => format!("{scheme}://{v4}:{port}{path}"),
        IpAddr::V6(v6) => format!("{scheme}://[{v6}]:{port}{path}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A node on a port nothing listens on.
    fn dead_node() -> Arc<Node> {
        let url = "ws://127.0.0.1:1/ws";
        let pool = Pool::builder(url).build().unwrap();
        Arc::new(Node::new(url, pool, ConnectOptions::new(url)))
    }

    const CHECKS: Checks = Checks {
        interval: Duration::from_secs(1),
        timeout: Duration::from_millis(100),
        eject_after: 2,
        eject_base: Duration::from_millis(300),
        eject_max: Duration::from_secs(2),
    };

    #[tokio::test]
    async fn an_unreachable_node_is_ejected_and_checked_again_after_a_doubling_backoff() {
        let node = dead_node();
        let lost = node.lost();
        assert!(node.admitted() && node.check_due());
        assert_eq!(node.status().health, NodeHealth::Unknown);
        node.unreachable(&ClientError::Closed, &CHECKS);
        let status = node.status();
        assert_eq!((status.health, status.ejections), (NodeHealth::Ejected, 1));
        assert!(!node.admitted());
        // The executions it had acknowledged learn it, with the reason.
        let reason = lost.await;
        assert!(
            reason.contains("ejected") && reason.contains("closed"),
            "{reason}"
        );
        assert!(!node.check_due());
        tokio::time::sleep(Duration::from_millis(310)).await;
        assert!(node.check_due());
        // The check fails again: still ejected (not counted twice), the backoff doubled to 600 ms.
        node.check(&CHECKS).await;
        assert_eq!(node.status().ejections, 1);
        assert!(!node.admitted() && !node.check_due());
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(!node.check_due());
        tokio::time::sleep(Duration::from_millis(550)).await;
        assert!(node.check_due());
    }

    #[tokio::test]
    async fn one_failed_check_makes_a_node_suspect_and_two_eject_it() {
        let node = dead_node();
        node.check(&CHECKS).await;
        let status = node.status();
        assert_eq!(status.health, NodeHealth::Suspect);
        assert!(status.last_error.is_some());
        assert!(node.admitted());
        node.check(&CHECKS).await;
        assert_eq!(node.status().health, NodeHealth::Ejected);
        assert!(!node.admitted());
    }

    #[test]
    fn an_overloaded_refusal_raises_the_score_until_the_next_check() {
        let node = dead_node();
        let idle = node.score();
        node.overloaded(&ClientError::Closed);
        assert!(node.score() > idle);
        let _a = node.start();
        let with_one = node.score();
        drop(_a);
        assert!(node.score() < with_one);
        assert_eq!(node.status().placed, 1);
    }
}

//! The connection pool: the Rust counterpart of the original design's pool of WebSocket workers
//! (`docs/spec/fsp-v1.md`, Appendix A).
//!
//! - Up to `size + max_overflow` connections are checked out at once; a checkout beyond that waits (first come,
//!   first served) up to the checkout timeout, then fails with [`ClientError::PoolExhausted`] (retryable).
//! - Checkout hands out an idle connection only if it is connected and answers a `ping` within the health-check
//!   timeout. One that fails is closed and replaced, never handed out. A connection that is reconnecting is left
//!   to its backoff while there is room for a new one, and replaced when there is not; one that gave up
//!   ([`ConnectionStatus::Failed`]) is replaced. Replacing means opening a new
//!   connection, at once, for the caller that needs it.
//! - At check-in, a connection beyond `size` (an overflow connection) is closed; the first `size` stay open, idle,
//!   and keep themselves connected (reconnect with backoff) between checkouts.
//! - Connections are opened on demand ([`Pool::warm_up`] opens `size` of them ahead).
//!
//! [`Execute::execute`] and [`Execute::execute_stream`] on a pool check out one connection per execution and hold
//! it until the execution ends: executions are not multiplexed by the pool, so a slow consumer or a broken
//! connection only affects its own execution. A [`PooledConnection`] may still multiplex (it derefs to a [`Connection`]).

use std::collections::VecDeque;
use std::ops::Deref;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use protocol::{ExecuteRequest, Pong};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;
use tracing::debug;

use crate::auth::{Auth, TokenProvider};
use crate::config::{Backoff, ConnectOptions, ExecOptions};
use crate::connection::{Connection, ConnectionStatus};
use crate::error::ClientError;
use crate::execute::Execute;
use crate::execution::Execution;

/// Default base number of connections.
pub const DEFAULT_SIZE: usize = 5;
/// Default connections allowed beyond `size` under load.
pub const DEFAULT_MAX_OVERFLOW: usize = 10;
/// Default wait for a free connection before [`ClientError::PoolExhausted`].
pub const DEFAULT_CHECKOUT_TIMEOUT: Duration = Duration::from_secs(5);
/// Default time a `ping` has to be answered at checkout (FSP/1 requires an answer within 1 s).
pub const DEFAULT_HEALTH_CHECK_TIMEOUT: Duration = Duration::from_secs(1);

/// Builds a [`Pool`]: `Pool::builder(url).token(..).size(5).max_overflow(10).build()`.
#[derive(Debug, Clone)]
pub struct PoolBuilder {
    options: ConnectOptions,
    size: usize,
    max_overflow: usize,
    checkout_timeout: Duration,
    health_check_timeout: Duration,
}

impl PoolBuilder {
    /// A static bearer token.
    pub fn token(mut self, token: impl Into<String>) -> Self {
        self.options = self.options.token(token);
        self
    }

    /// A token provider asked on every connection attempt (the original design's token manager).
    pub fn token_provider(mut self, provider: impl TokenProvider) -> Self {
        self.options = self.options.auth(Auth::provider(provider));
        self
    }

    /// How to authenticate.
    pub fn auth(mut self, auth: Auth) -> Self {
        self.options = self.options.auth(auth);
        self
    }

    /// Connections kept open between checkouts (default 5).
    pub fn size(mut self, size: usize) -> Self {
        self.size = size;
        self
    }

    /// Connections opened beyond `size` under load and closed when checked in (default 10).
    pub fn max_overflow(mut self, max_overflow: usize) -> Self {
        self.max_overflow = max_overflow;
        self
    }

    /// Wait for a free connection before [`ClientError::PoolExhausted`] (default 5 s).
    pub fn checkout_timeout(mut self, timeout: Duration) -> Self {
        self.checkout_timeout = timeout;
        self
    }

    /// Time the checkout `ping` has to be answered (default 1 s).
    pub fn health_check_timeout(mut self, timeout: Duration) -> Self {
        self.health_check_timeout = timeout;
        self
    }

    /// Time to open a connection (default 5 s).
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.options = self.options.connect_timeout(timeout);
        self
    }

    /// Reconnect schedule of each connection (default [`Backoff::DEFAULT`]).
    pub fn backoff(mut self, backoff: Backoff) -> Self {
        self.options = self.options.backoff(backoff);
        self
    }

    /// rustls configuration for `wss://` (default: webpki roots).
    pub fn tls_config(mut self, config: Arc<rustls::ClientConfig>) -> Self {
        self.options = self.options.tls_config(config);
        self
    }

    /// Slack of the default client deadline over `timeout_ms` (default 10 s).
    pub fn deadline_grace(mut self, grace: Duration) -> Self {
        self.options = self.options.deadline_grace(grace);
        self
    }

    /// Largest message accepted from the server (default 16 MiB).
    pub fn max_message_bytes(mut self, bytes: usize) -> Self {
        self.options = self.options.max_message_bytes(bytes);
        self
    }

    /// The same settings for another endpoint (a fleet builds one pool per node from one builder).
    pub(crate) fn for_url(&self, url: &str) -> Self {
        let mut b = self.clone();
        b.options.url = url.to_owned();
        b
    }

    /// The connect options (a fleet's health checks use its TLS setup).
    pub(crate) fn options(&self) -> &ConnectOptions {
        &self.options
    }

    /// Checks the configuration. Connects nothing yet (see [`Pool::warm_up`]).
    pub fn build(self) -> Result<Pool, ClientError> {
        if self.size == 0 {
            return Err(ClientError::Config("pool size must be at least 1".into()));
        }
        let cap = self.size.saturating_add(self.max_overflow);
        if cap > Semaphore::MAX_PERMITS {
            return Err(ClientError::Config("pool too large".into()));
        }
        let options = self.options.validated()?;
        Ok(Pool {
            inner: Arc::new(Inner {
                options,
                size: self.size,
                max_overflow: self.max_overflow,
                checkout_timeout: self.checkout_timeout,
                health_check_timeout: self.health_check_timeout,
                permits: Arc::new(Semaphore::new(cap)),
                state: Mutex::new(PoolState::default()),
            }),
        })
    }
}

/// A pool of sandboxd connections. Cheap to clone (clones share the pool).
#[derive(Clone)]
pub struct Pool {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Pool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pool")
            .field("url", &self.inner.options.url)
            .field("stats", &self.stats())
            .finish()
    }
}

/// A snapshot of a pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolStats {
    /// Configured base size.
    pub size: usize,
    /// Configured overflow.
    pub max_overflow: usize,
    /// Open connections (idle, checked out, being opened).
    pub total: usize,
    /// Connections waiting in the pool.
    pub idle: usize,
    /// Connections checked out (or being opened for a checkout).
    pub in_use: usize,
    /// Idle connections that are connected now (the others are reconnecting).
    pub idle_connected: usize,
}

struct Inner {
    options: Arc<ConnectOptions>,
    size: usize,
    max_overflow: usize,
    checkout_timeout: Duration,
    health_check_timeout: Duration,
    /// One per connection that may be checked out at once.
    permits: Arc<Semaphore>,
    state: Mutex<PoolState>,
}

#[derive(Default)]
struct PoolState {
    /// Idle connections, most recently used last.
    idle: VecDeque<Connection>,
    /// Idle plus checked out plus being opened.
    total: usize,
    closed: bool,
}

/// What a checkout does next.
enum Step {
    Check(Connection),
    Open,
}

impl Inner {
    fn lock(&self) -> MutexGuard<'_, PoolState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn cap(&self) -> usize {
        self.size + self.max_overflow
    }

    /// Picks what to try next: a connected idle connection, or room for a new one (closing an idle connection
    /// that cannot serve when the pool is full).
    fn next_step(&self) -> Result<Step, ClientError> {
        let mut replaced = Vec::new();
        let step = {
            let mut st = self.lock();
            if st.closed {
                return Err(ClientError::Closed);
            }
            // Connections that gave up or were closed are gone for good.
            let before = st.idle.len();
            st.idle.retain(|c| {
                let keep = !matches!(
                    c.status(),
                    ConnectionStatus::Failed | ConnectionStatus::Closed
                );
                if !keep {
                    replaced.push(c.clone());
                }
                keep
            });
            st.total -= before - st.idle.len();
            let connected = st
                .idle
                .iter()
                .rposition(|c| c.status() == ConnectionStatus::Connected);
            if let Some(i) = connected.and_then(|i| st.idle.remove(i)) {
                Step::Check(i)
            } else {
                if st.total >= self.cap() {
                    // Every slot is taken and we hold a permit, so an idle (reconnecting) connection exists:
                    // replace the one that has waited longest.
                    if let Some(c) = st.idle.pop_front() {
                        st.total -= 1;
                        replaced.push(c);
                    }
                }
                st.total += 1;
                Step::Open
            }
        };
        for c in replaced {
            debug!(status = ?c.status(), "replacing a pooled connection that cannot serve");
            c.close();
        }
        Ok(step)
    }

    fn forget_one(&self) {
        let mut st = self.lock();
        st.total = st.total.saturating_sub(1);
    }

    /// Takes a connection back: idle if it can serve and the pool is not over `size`, else closed. Over `size`, a
    /// connected one coming back takes the place of an idle one that is still reconnecting.
    fn check_in(&self, conn: Connection) {
        let mut close = Vec::new();
        {
            let mut st = self.lock();
            let status = conn.status();
            let usable = !st.closed
                && !matches!(status, ConnectionStatus::Failed | ConnectionStatus::Closed);
            if usable && st.total > self.size && status == ConnectionStatus::Connected {
                if let Some(i) = st
                    .idle
                    .iter()
                    .position(|c| c.status() != ConnectionStatus::Connected && c.in_flight() == 0)
                {
                    if let Some(stale) = st.idle.remove(i) {
                        st.total -= 1;
                        close.push(stale);
                    }
                }
            }
            // Executions still running on it (a caller multiplexed and let go early) keep it open.
            if usable && (st.total <= self.size || conn.in_flight() > 0) {
                st.idle.push_back(conn);
            } else {
                st.total = st.total.saturating_sub(1);
                close.push(conn);
            }
        }
        for c in close {
            c.close();
        }
    }
}

impl Pool {
    /// A builder for a pool of connections to `url` (`ws://` or `wss://`).
    pub fn builder(url: impl Into<String>) -> PoolBuilder {
        PoolBuilder {
            options: ConnectOptions::new(url),
            size: DEFAULT_SIZE,
            max_overflow: DEFAULT_MAX_OVERFLOW,
            checkout_timeout: DEFAULT_CHECKOUT_TIMEOUT,
            health_check_timeout: DEFAULT_HEALTH_CHECK_TIMEOUT,
        }
    }

    /// The endpoint.
    pub fn url(&self) -> &str {
        &self.inner.options.url
    }

    /// Counts of connections now.
    pub fn stats(&self) -> PoolStats {
        let st = self.inner.lock();
        PoolStats {
            size: self.inner.size,
            max_overflow: self.inner.max_overflow,
            total: st.total,
            idle: st.idle.len(),
            in_use: st.total - st.idle.len(),
            idle_connected: st
                .idle
                .iter()
                .filter(|c| c.status() == ConnectionStatus::Connected)
                .count(),
        }
    }

    /// A healthy connection for the caller's exclusive use until the [`PooledConnection`] is dropped.
    ///
    /// Waits up to the checkout timeout for a free slot ([`ClientError::PoolExhausted`] after). Hands out an idle
    /// connection only after it answered a `ping` within the health-check timeout; otherwise opens a new one (an
    /// error from that is returned as is: [`ClientError::Connect`] and friends are retryable).
    pub async fn checkout(&self) -> Result<PooledConnection, ClientError> {
        let inner = &self.inner;
        let start = Instant::now();
        let permit = match tokio::time::timeout(
            inner.checkout_timeout,
            inner.permits.clone().acquire_owned(),
        )
        .await
        {
            Ok(Ok(permit)) => permit,
            Ok(Err(_)) => return Err(ClientError::Closed),
            Err(_) => {
                return Err(ClientError::PoolExhausted {
                    waited: start.elapsed(),
                })
            }
        };
        loop {
            match inner.next_step()? {
                Step::Check(conn) => match conn.ping(inner.health_check_timeout).await {
                    Ok(_) => return Ok(self.lease(conn, permit)),
                    Err(e) => {
                        debug!(error = %e, "pooled connection failed its health check; replacing it");
                        conn.close();
                        inner.forget_one();
                    }
                },
                Step::Open => {
                    return match Connection::connect_shared(inner.options.clone()).await {
                        Ok(conn) => Ok(self.lease(conn, permit)),
                        Err(e) => {
                            inner.forget_one();
                            Err(e)
                        }
                    }
                }
            }
        }
    }

    fn lease(&self, conn: Connection, permit: OwnedSemaphorePermit) -> PooledConnection {
        PooledConnection {
            conn: Some(conn),
            pool: self.inner.clone(),
            _permit: permit,
        }
    }

    /// Opens connections until `size` are open (concurrently), so the first checkouts find them ready.
    pub async fn warm_up(&self) -> Result<(), ClientError> {
        let missing = self.inner.size.saturating_sub(self.stats().total);
        let leases = futures_util::future::join_all((0..missing).map(|_| self.checkout())).await;
        for lease in leases {
            lease?;
        }
        Ok(())
    }

    /// Sends `ping` on a checked-out connection and returns the `pong` (load and capabilities).
    pub async fn ping(&self) -> Result<Pong, ClientError> {
        let conn = self.checkout().await?;
        conn.ping(self.inner.health_check_timeout).await
    }

    /// Closes every idle connection and refuses further checkouts; checked-out connections close when they
    /// come back.
    pub fn close(&self) {
        let idle: Vec<Connection> = {
            let mut st = self.inner.lock();
            st.closed = true;
            let idle: Vec<Connection> = st.idle.drain(..).collect();
            st.total -= idle.len();
            idle
        };
        self.inner.permits.close();
        for c in idle {
            c.close();
        }
    }
}

/// Runs each request on a connection checked out for it, which stays checked out until the execution's stream
/// ends (see [`Execute`]).
impl Execute for Pool {
    async fn execute_stream_with(
        &self,
        request: ExecuteRequest,
        options: ExecOptions,
    ) -> Result<Execution, ClientError> {
        let lease = self.checkout().await?;
        let mut execution = lease.execute_stream_with(request, options).await?;
        execution.hold(lease);
        Ok(execution)
    }
}

/// A connection checked out of a [`Pool`]; goes back when dropped. Derefs to [`Connection`].
pub struct PooledConnection {
    conn: Option<Connection>,
    pool: Arc<Inner>,
    _permit: OwnedSemaphorePermit,
}

impl std::fmt::Debug for PooledConnection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("PooledConnection").field(&self.conn).finish()
    }
}

impl Deref for PooledConnection {
    type Target = Connection;

    fn deref(&self) -> &Connection {
        match &self.conn {
            Some(conn) => conn,
            // `conn` is only taken in `drop`.
            None => unreachable!("a PooledConnection is used after it was checked in"),
        }
    }
}

impl Drop for PooledConnection {
    fn drop(&mut self) {
        if let Some(conn) = self.conn.take() {
            self.pool.check_in(conn);
        }
        // The permit is released after the check-in, so the next waiter finds the connection idle.
    }
}

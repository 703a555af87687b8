//! The daemon's context: what every part of the daemon shares, built once at start and passed explicitly (the
//! [`crate::exec::engine::Engine`] holds it; nothing reaches it through the engine's fields).
//!
//! - the configuration in force and the artifact store (the cgroup setup belongs to the container layer, which
//!   is the only part that touches cgroups);
//! - when the daemon started (its metrics are one process-wide registry, [`crate::observe::metrics::get`], which the
//!   container layer's calls report into as well);
//! - the drain: every execution task is spawned on one [`TaskTracker`], and one [`CancellationToken`] ends them all
//!   when the shutdown grace period is over ([`Daemon::drain`]).

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::config::Config;
use crate::storage::store::Store;

/// How long killed executions may take to report and hand their containers back after the grace period.
const KILLED_CLEANUP: Duration = Duration::from_secs(30);

/// What every part of the daemon shares.
pub struct Daemon {
    config: Config,
    store: Arc<Store>,
    started: Instant,
    executions: TaskTracker,
    kill: CancellationToken,
}

/// How a drain ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Drained {
    /// Every execution finished within the grace period.
    Finished,
    /// The grace period ended; the rest were killed and have reported.
    Killed,
    /// Executions killed at the end of the grace period still had not reported after [`KILLED_CLEANUP`].
    Stuck,
}

impl Daemon {
    /// The context of a daemon starting now.
    pub fn new(config: Config, store: Arc<Store>) -> Self {
        Self {
            config,
            store,
            started: Instant::now(),
            executions: TaskTracker::new(),
            kill: CancellationToken::new(),
        }
    }

    /// The configuration in force.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// The artifact store.
    pub fn store(&self) -> &Arc<Store> {
        &self.store
    }

    /// How long the daemon has run.
    pub fn uptime(&self) -> Duration {
        self.started.elapsed()
    }

    /// Runs an execution's task, tracked by the drain.
    pub fn spawn_execution<F>(&self, task: F) -> tokio::task::JoinHandle<()>
    where
        F: Future<Output = ()> + Send + 'static,
    {
        self.executions.spawn(task)
    }

    /// Resolves once the shutdown grace period is over: every execution still running is to be killed.
    pub fn killed(&self) -> tokio_util::sync::WaitForCancellationFuture<'_> {
        self.kill.cancelled()
    }

    /// Executions still tracked (running, or reporting their end).
    pub fn executions(&self) -> usize {
        self.executions.len()
    }

    /// Waits up to `grace` for every execution to end; then kills the rest and waits (bounded) for them to report.
    /// New executions must already be refused (admission closed) when this is called.
    pub async fn drain(&self, grace: Duration) -> Drained {
        self.executions.close();
        if tokio::time::timeout(grace, self.executions.wait())
            .await
            .is_ok()
        {
            return Drained::Finished;
        }
        self.kill.cancel();
        match tokio::time::timeout(KILLED_CLEANUP, self.executions.wait()).await {
            Ok(()) => Drained::Killed,
            Err(_) => Drained::Stuck,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn daemon(root: &std::path::Path) -> Daemon {
        let store = Store::open(&root.join("store"), Duration::from_secs(60), 1 << 20).unwrap();
        Daemon::new(Config::default(), Arc::new(store))
    }

    #[tokio::test(start_paused = true)]
    async fn a_drain_waits_for_executions_then_kills_the_rest() {
        let dir = tempfile::tempdir().unwrap();
        let d = Arc::new(daemon(dir.path()));
        assert_eq!(d.drain(Duration::from_secs(1)).await, Drained::Finished);

        let d = Arc::new(daemon(dir.path()));
        // One execution ends by itself within the grace, one only when killed, one never.
        d.spawn_execution(tokio::time::sleep(Duration::from_millis(500)));
        let d2 = d.clone();
        d.spawn_execution(async move { d2.killed().await });
        assert_eq!(d.executions(), 2);
        assert_eq!(d.drain(Duration::from_secs(1)).await, Drained::Killed);
        assert_eq!(d.executions(), 0);

        let d = Arc::new(daemon(dir.path()));
        d.spawn_execution(std::future::pending());
        assert_eq!(d.drain(Duration::from_secs(1)).await, Drained::Stuck);
    }
}

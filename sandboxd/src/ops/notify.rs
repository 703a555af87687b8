//! systemd readiness and watchdog (`Type=notify`, `WatchdogSec=`) through the `sd-notify` crate.
//!
//! `READY=1` once the listener is bound (after the start-up checks and the self-test execution), `STOPPING=1` when
//! the drain starts, and `WATCHDOG=1` every half `WATCHDOG_USEC` while the async runtime and the container helper
//! are alive. Outside systemd (`NOTIFY_SOCKET` unset) every call does nothing. A failed notification is logged, never
//! fatal: the service manager then acts on its own timeouts.

use std::sync::Arc;
use std::time::Duration;

use sd_notify::NotifyState;
use tracing::{debug, warn};

use crate::exec::engine::Engine;

fn send(states: &[NotifyState<'_>]) {
    match sd_notify::notify(states) {
        Ok(()) => debug!(?states, "sd_notify"),
        Err(e) => warn!(error = %e, ?states, "sd_notify failed"),
    }
}

/// The daemon serves: `READY=1` with a status line naming the address.
pub fn ready(addr: std::net::SocketAddr) {
    let status = format!("serving FSP/1 on {addr}");
    send(&[NotifyState::Ready, NotifyState::Status(&status)]);
}

/// The daemon drains and stops: `STOPPING=1`.
pub fn stopping() {
    send(&[NotifyState::Stopping, NotifyState::Status("draining")]);
}

/// When systemd asked for a watchdog (`WATCHDOG_USEC` for this pid), pings it at half the interval for as long as
/// the container helper lives; a wedged runtime or a dead helper stops the pings and systemd restarts the service.
pub fn spawn_watchdog(engine: Arc<Engine>) {
    let Some(interval) = sd_notify::watchdog_enabled() else {
        return;
    };
    let period = (interval / 2).max(Duration::from_millis(10));
    tracing::info!(?interval, "systemd watchdog enabled");
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(period);
        loop {
            tick.tick().await;
            if !engine.healthy() {
                return;
            }
            send(&[NotifyState::Watchdog]);
        }
    });
}

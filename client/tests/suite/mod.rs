//! The suites, by area.

pub mod daemon;
pub mod fake;
pub mod k8s_stub;
pub mod netns;

mod agents;
mod auth;
mod cow;
mod daemon_failures;
mod daemon_pool;
mod fleet_e2b;
mod fleet_hosts;
mod fleet_k8s;
mod fleet_rules;
mod live_restore;
mod malformed;
mod network;
mod pool_behaviour;
mod readme;
mod sandboxctl;
mod snapshots;
mod tls;
mod tools;
mod volumes;

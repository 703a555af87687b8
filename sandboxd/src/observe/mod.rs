//! What the daemon tells its operator while it runs: [`metrics`] (`/metrics`) and [`telemetry`] (traces).

pub mod metrics;
pub mod telemetry;

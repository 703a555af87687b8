//! Agent sandboxes: long-lived sandboxes for AI agents behind the adapter-shim HTTP/WebSocket endpoints
//! (`docs/spec/agent-sandboxes.md`), as a library the sandboxd daemon mounts.
//!
//! - [`Agents`] ([`registry`]): provisioning (`POST /sandboxes`), the sandbox limit, removal, and the removal of
//!   what a previous daemon left under `<state_dir>/agents` at start.
//! - [`sandbox`]: one sandbox and its agent runs: the lifecycle (spawn, kill with grace, commands, crash
//!   detection, health), the control channel ([`sandbox::control`]) and the freezer (pause and resume).
//! - [`events`]: stamping, the rolling replay log, the gateway queue with backpressure.
//! - [`backend`]: eager artifact upload and token renewal.
//! - [`routes`]: the axum routes, bearer auth and bounded bodies.
//! - [`network`]: a sandbox's egress proxy (the `network` extension): one per sandbox, served inside each run.
//! - The long-lived kind of container the runs use is `containers::agent` (the container seam's crate).
//! - [`host`]: what the daemon provides, as narrow traits: containers and images, the artifact store, backend
//!   calls, the token check, the egress proxy's settings, configuration values. This crate does not depend on the daemon.
//! - [`volumes`]: volumes that outlive sandboxes and restarts (`POST /volumes`), mounted into sandboxes, and the
//!   recovery scan once their writer is gone.
//! - [`snapshots`]: a sandbox's `/workspace` kept (`POST /sandboxes/<id>/snapshot`) and started from by other
//!   sandboxes without a copy (`fromSnapshot`, fork).
//! - [`cow`]: the copy-on-write store of workspaces (`agents.workspace_store: btrfs`): snapshots and forks in
//!   constant time.
//! - [`restore`]: live restore (`agents.live_restore`): each sandbox's record, and the runs a later daemon takes
//!   back.
//! - [`config`]: the `agents:` configuration block.
//!
//! The wire types are `agent_api`'s.

pub mod backend;
pub mod config;
pub mod cow;
pub mod events;
pub mod host;
pub mod network;
pub mod registry;
pub mod restore;
pub mod routes;
pub mod sandbox;
pub mod snapshots;
pub mod volumes;

#[cfg(test)]
mod test_host;

pub use registry::Agents;
pub use routes::router;

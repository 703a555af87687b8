//! FSP/1 over WebSocket: the [`listener`] (`/healthz`, the `/ws` upgrade with its bearer check, artifact
//! downloads) and each [`connection`]'s reader and writer.

pub mod connection;
pub mod listener;

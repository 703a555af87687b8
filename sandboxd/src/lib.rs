//! `sandboxd`: the sandbox execution daemon, as a library its binary (`main.rs`) calls.
//!
//! The folders follow the data paths:
//! - [`fsp`]: FSP/1 over WebSocket: the listener (`/healthz`, `/ws`, artifact downloads) and each connection's
//!   reader and writer.
//! - [`exec`]: an execution from admission to its result: admission (`capacity`), the executions of each
//!   connection (`registry`), the engine (output streams, how it ended, artifacts), the warm pool and its
//!   interpreters, and the images each language runs on.
//! - [`agent_host`]: what agent sandboxes (the `agents` crate) and the E2B API get from the daemon.
//! - [`extensions`]: the protocol's extensions an execution can ask for: tool calls and the network.
//! - [`storage`]: the artifact store and uploads, volumes, and the copy-on-write store of workspaces.
//! - [`observe`]: `/metrics` and traces.
//! - [`ops`]: start-up and operations: the self-test, live restore's leftovers, systemd notify, `doctor`, and the
//!   `images` subcommands.
//!
//! Beside them: [`config`] (the configuration file), [`daemon`] (the context every part shares), [`auth`] (the
//! bearer tokens) and [`cli`] (the command line and start-up). The container seam is the `containers` crate.

mod agent_host;
mod auth;
mod cli;
mod config;
mod daemon;
mod exec;
mod extensions;
mod fsp;
mod observe;
mod ops;
mod storage;

pub use cli::main;

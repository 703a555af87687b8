//! The suites, by area. Each names the spec section (`docs/spec/fsp-v1.md`) its cases come from.

pub mod harness;

mod artifacts;
mod attack;
mod attacks_filesystem;
mod attacks_network;
mod attacks_processes;
mod attacks_resources;
mod attacks_syscalls;
mod auth;
mod cancel;
mod capacity;
mod cleanup;
mod compat;
mod e2b_egress;
mod e2b_live_restore;
mod e2b_sdk;
mod egress;
mod egress_agents;
mod egress_origin;
mod execution;
mod images;
mod isolation;
mod lifecycle;
mod limits;
mod neighbours;
mod ops;
mod output;
mod pool;
mod requests;
mod root_layers;
mod telemetry;
mod tools;
mod warm;
mod warm_node;

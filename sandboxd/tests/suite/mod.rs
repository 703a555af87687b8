//! The suites, by area. Each names the spec section (`/shared/spec/fsp-v1.md`) its cases come from.

pub mod harness;

mod artifacts;
mod auth;
mod cancel;
mod capacity;
mod cleanup;
mod execution;
mod isolation;
mod lifecycle;
mod limits;
mod output;
mod requests;

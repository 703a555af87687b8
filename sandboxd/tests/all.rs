//! Integration tests of `sandboxd`: one test binary, one suite file per area (`suite/*.rs`).
//!
//! Every test starts its own daemon (a real `sandboxd` process, as root, with its own port, state directory,
//! cgroup parent and uid range) and talks FSP/1 to it over WebSocket, then checks the host from outside:
//! processes, cgroups and the daemon's mounts. Tests that need root say `SKIPPED (needs root)` when run
//! unprivileged, and fail instead when `CI` is set (`test_support::cannot_run`, shared by the workspace's tests).
#![allow(missing_docs)]
// Tests may unwrap (the workspace denies it outside tests; clippy does not see harness helpers as tests).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod suite;

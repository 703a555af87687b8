//! Integration tests of the client crate and `sandboxctl`: one test binary, one suite file per area.
//!
//! Tests marked "real daemon" start their own `sandboxd` (as root, with its own port, state directory, cgroup
//! parent and uid range) from `target/<profile>/sandboxd`, which `cargo test --workspace` builds. Without root or
//! without the binary they say `SKIPPED (...)` on stderr, and fail instead when `CI` is set
//! (`test_support::cannot_run`). The other tests use a
//! scripted fake server and run anywhere.
#![allow(missing_docs)]
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod suite;

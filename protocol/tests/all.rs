//! Integration tests of `sandboxd-protocol`, as one binary: the spec's examples, the refusals of spec sections 2
//! and 3, and the wire form of server messages.

// `cfg(test)` marks the suite as test code, so the workspace's unwrap/expect lints allow it (clippy.toml).
#[cfg(test)]
mod suite;

//! The egress proxy against real sockets: local TLS and HTTP servers on 127.0.0.1 (and a unix listener), reached
//! through a proxy started by each test. The fake resolver maps the tests' names to 127.0.0.1; each proxy permits
//! exactly its test server's address (`AddressPolicy::exempt_for_tests`), so the default refusal of loopback stays
//! in force for everything else, and is tested on its own.
#![allow(missing_docs)]
// Tests may unwrap (the workspace denies it outside tests; clippy does not see harness helpers as tests).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod suite;

//! Egress proxy for sandboxes.
//!
//! A sandbox has no route out; the daemon runs one [`Proxy`] per sandbox and makes it reachable inside the sandbox.
//! The proxy speaks HTTP/1.1 (parsed by hyper) and allows:
//!
//! - `CONNECT host:port` when the [`Allowlist`] allows the host and port; the proxy resolves the name itself
//!   (through a [`Resolve`] implementation), connects only to addresses the [`AddressPolicy`] permits, and then
//!   requires the tunnel to open with a TLS ClientHello whose SNI is the CONNECT host (read with rustls's
//!   `Acceptor`, so domain fronting through an allowed name is closed). A tunnel that opens with plain HTTP/1.1
//!   instead (undici, node's `fetch`, tunnels `http://` URLs) is served as HTTP: every request in origin form, its
//!   Host header naming the CONNECT host and port, checked against the list in force;
//! - plain HTTP in absolute form (`GET http://host/path`), with the Host header equal to the URI's host, forwarded
//!   once to the origin in origin form; responses (redirects included) are relayed, never followed.
//!
//! Everything else is refused and logged at info level with a reason. Connections and bytes are counted per proxy
//! ([`Stats`]); a byte limit closes connections once the bytes exchanged with the outside exceed it. The
//! allowlist can be swapped while the proxy runs ([`Proxy::set_allowlist`]); each new request uses the new list.
//! With a [`Ledger`] ([`Proxy::with_ledger`]) the bytes are reserved in it before they are moved, so the limit
//! holds across a proxy made again after a crash.

mod address;
mod allowlist;
mod counting;
mod error;
mod http_forward;
mod proxy;
mod resolve;
mod shared;
mod sni;
mod tunnel;
mod tunnel_http;

pub use address::{classify, AddressPolicy, AddressRefusal};
pub use allowlist::{Allowlist, AllowlistError, Entry, HostPattern, DEFAULT_PORTS};
pub use counting::{Ledger, Reserve};
pub use error::{EgressError, Refusal};
pub use proxy::{Accept, Proxy, Stats};
pub use resolve::{Resolve, ResolveFuture, StaticResolver, SystemResolver};
pub use shared::ProxyLimits;

//! Egress proxy for sandboxes.
//!
//! A sandbox has no route out; the daemon runs one [`Proxy`] per sandbox and makes it reachable inside the sandbox.
//! The proxy speaks HTTP/1.1 (parsed by hyper) and allows:
//!
//! - `CONNECT host:port` when the [`Allowlist`] allows the host and port; the proxy resolves the name itself
//!   (through a [`Resolve`] implementation), connects only to addresses the [`AddressPolicy`] permits, and then
//!   requires the tunnel to open with a TLS ClientHello whose SNI is the CONNECT host (read with rustls's
//!   `Acceptor`), or with plain HTTP/1.1 (undici, node's `fetch`, tunnels `http://` URLs), which is then served as
//!   HTTP: every request in origin form, its Host header naming the CONNECT host and port, checked against the
//!   list in force;
//! - plain HTTP in absolute form (`GET http://host/path`), with the Host header equal to the URI's host, forwarded
//!   once to the origin in origin form; responses (redirects included) are relayed, never followed.
//!
//! What a TLS tunnel checks, and what it does not: the CONNECT host against the allowlist, the addresses it
//! resolves to against the address policy, and the SNI of the tunnel's first ClientHello against the CONNECT
//! host; after that the tunnel is spliced, and everything inside TLS is opaque to the proxy. So an allowed name
//! still fronts for others where the server behind it lets it: the HTTP Host (or `:authority`) inside TLS is not
//! checked, so a shared CDN address that routes by that header reaches whatever name it serves; and with
//! Encrypted Client Hello the SNI checked is the outer (public) name, the inner name the server routes by is not
//! seen. An allowlist entry thus admits what the servers at its addresses serve under any name they accept.
//!
//! The address policy refuses, whatever the allowlist says, the special-purpose ranges ([`AddressRefusal`]), the
//! daemon's listen addresses and the host's own interface addresses ([`HostAddresses`], read again once a second).
//! An operator may permit networks of its own inside the private, shared and special-purpose ranges
//! ([`parse_allowed_networks`], [`AddressPolicy::allow_networks`]); the other refusals hold inside them too.
//!
//! Everything else is refused and logged at info level with a reason, in the span the proxy serves in: a request
//! head that does not parse as HTTP/1.x included (its 400 names the reason; a later head of a kept-alive
//! connection that hyper rejects gets hyper's own answer, and is counted and logged all the same). Connections
//! and bytes are counted per proxy ([`Stats`]). The byte limit is a reservation: a read or write claims the bytes
//! it may move before it moves them and gives back what it did not move, so the connections together never move
//! more than the limit; once it is used up connections are closed and new ones refused. The allowlist can be
//! swapped while the proxy runs ([`Proxy::set_allowlist`]); each new request uses the new list. With a [`Ledger`]
//! ([`Proxy::with_ledger`]) the bytes are also recorded in it before they are moved, so the limit holds across a
//! proxy made again after a crash.

#![forbid(unsafe_code)]

mod address;
mod allowlist;
mod counting;
mod error;
mod head;
mod http_forward;
mod proxy;
mod resolve;
mod shared;
mod sni;
mod tunnel;
mod tunnel_http;

pub use address::{
    classify, parse_allowed_networks, AddressPolicy, AddressRefusal, AllowedNetworkError,
    HostAddresses, HOST_ADDRESSES_MAX_AGE,
};
pub use allowlist::{Allowlist, AllowlistError, Entry, HostPattern, DEFAULT_PORTS};
pub use counting::{Ledger, Reserve};
pub use error::{EgressError, Refusal};
pub use ipnet::IpNet;
pub use proxy::{Accept, Proxy, Stats};
pub use resolve::{Resolve, ResolveFuture, StaticResolver, SystemResolver};
pub use shared::ProxyLimits;

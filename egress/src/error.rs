//! The proxy's errors and refusal reasons.

use std::io;

use thiserror::Error;

use crate::address::AddressRefusal;

/// Why the proxy refused a request. Each is logged at info level and answered with its status.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum Refusal {
    /// The host and port are not on the allowlist.
    #[error("{host}:{port} is not on the allowlist")]
    NotAllowed {
        /// The requested host.
        host: String,
        /// The requested port.
        port: u16,
    },
    /// The request named an IP address instead of a host name.
    #[error("IP literal {0} refused; name a host")]
    IpLiteral(String),
    /// The host is not a valid ASCII DNS name.
    #[error("invalid host {0:?}")]
    InvalidHost(String),
    /// Every address the name resolved to is refused.
    #[error("{host} resolves only to refused addresses ({reason})")]
    Address {
        /// The requested host.
        host: String,
        /// The refusal of the first address.
        reason: AddressRefusal,
    },
    /// The Host header names another host than the request's URI.
    #[error("Host header {header:?} does not match the request's host {uri_host:?}")]
    HostMismatch {
        /// The Host header's value.
        header: String,
        /// The URI's host and port.
        uri_host: String,
    },
    /// The TLS ClientHello named another server than the CONNECT host (or none).
    #[error("TLS SNI {sni:?} does not match the CONNECT host {host}")]
    SniMismatch {
        /// The CONNECT host.
        host: String,
        /// The SNI, if any.
        sni: Option<String>,
    },
    /// The tunnel opened with neither a TLS ClientHello nor an HTTP/1.1 request.
    #[error("the tunnel to {0} opened with neither a TLS ClientHello nor an HTTP/1.1 request")]
    NotTlsOrHttp(String),
    /// The proxy's byte limit is used up.
    #[error("egress byte limit reached")]
    ByteLimit,
    /// Neither CONNECT nor an absolute-form `http://` request, or a request with ambiguous framing.
    #[error("malformed proxy request: {0}")]
    Malformed(&'static str),
}

impl Refusal {
    /// The HTTP status the client gets.
    pub fn status(&self) -> http::StatusCode {
        match self {
            Refusal::Malformed(_) | Refusal::InvalidHost(_) => http::StatusCode::BAD_REQUEST,
            _ => http::StatusCode::FORBIDDEN,
        }
    }
}

/// Errors of the proxy's own operation (not refusals of a request).
#[derive(Debug, Error)]
pub enum EgressError {
    /// The listener failed to accept.
    #[error("Accepting a proxy connection failed")]
    Accept(#[source] io::Error),
    /// The system resolver could not be configured.
    #[error("Configuring the system resolver failed")]
    ResolverConfig(#[source] hickory_resolver::ResolveError),
    /// A name could not be resolved.
    #[error("Resolving {host} failed: {message}")]
    Resolve {
        /// The name.
        host: String,
        /// The resolver's message.
        message: String,
    },
    /// No permitted address of the host accepted a connection.
    #[error("Connecting to {host} failed")]
    Connect {
        /// The host.
        host: String,
        /// The last connect error.
        #[source]
        source: io::Error,
    },
    /// The HTTP exchange with the origin failed.
    #[error("The request to {host} failed")]
    Upstream {
        /// The host.
        host: String,
        /// hyper's error.
        #[source]
        source: hyper::Error,
    },
}

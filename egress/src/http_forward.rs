//! Plain HTTP in absolute form (`GET http://host/path`): the Host header must name the URI's host, the request is
//! sent once to the origin in origin form, and the response is relayed as it is (redirects are not followed).

use std::sync::Arc;

use http::header::{self, HeaderMap, HeaderName};
use http::uri::{Authority, PathAndQuery};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;

use crate::allowlist::normalise_request_host;
use crate::error::{EgressError, Refusal};
use crate::shared::{Body, Outcome, Shared};

/// Forwards one absolute-form request, or refuses it.
pub(crate) async fn forward(
    shared: Arc<Shared>,
    mut req: Request<Incoming>,
) -> Result<Response<Body>, Outcome> {
    let uri = req.uri().clone();
    if uri.scheme_str() != Some("http") {
        return Err(Refusal::Malformed("not an absolute http:// request").into());
    }
    let authority = uri
        .authority()
        .ok_or(Refusal::Malformed("no host in the request URI"))?
        .clone();
    let port = authority.port_u16().unwrap_or(80);
    check_framing(req.headers())?;
    check_host_header(req.headers(), &authority, port)?;
    let host = shared.check_host(authority.host(), port)?;
    let upstream = shared.connect(&host, port).await?;
    let failed = |source| {
        Outcome::Failed(EgressError::Upstream {
            host: host.clone(),
            source,
        })
    };
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(upstream))
        .await
        .map_err(failed)?;
    shared.spawn(async move {
        if let Err(e) = conn.await {
            tracing::debug!(error = %e, "egress upstream connection ended with an error");
        }
    });
    let origin_form = uri
        .path_and_query()
        .cloned()
        .unwrap_or_else(|| PathAndQuery::from_static("/"));
    *req.uri_mut() = origin_form.into();
    strip_hop_by_hop(req.headers_mut());
    let host_value = http::HeaderValue::from_str(authority.as_str())
        .map_err(|_| Refusal::Malformed("host is not a header value"))?;
    req.headers_mut().insert(header::HOST, host_value);
    let mut response = sender.send_request(req).await.map_err(failed)?;
    strip_hop_by_hop(response.headers_mut());
    Ok(response.map(|body| body.boxed()))
}

/// Refuses framing a proxy and an origin could read differently (hyper refuses most of it before this).
pub(crate) fn check_framing(headers: &HeaderMap) -> Result<(), Refusal> {
    if headers.contains_key(header::TRANSFER_ENCODING)
        && headers.contains_key(header::CONTENT_LENGTH)
    {
        return Err(Refusal::Malformed(
            "both Content-Length and Transfer-Encoding",
        ));
    }
    if headers.get_all(header::CONTENT_LENGTH).iter().count() > 1 {
        return Err(Refusal::Malformed("more than one Content-Length"));
    }
    Ok(())
}

/// The Host header, when present, must name the URI's host and port.
pub(crate) fn check_host_header(
    headers: &HeaderMap,
    authority: &Authority,
    port: u16,
) -> Result<(), Refusal> {
    let mut values = headers.get_all(header::HOST).iter();
    let (Some(value), None) = (values.next(), values.next()) else {
        return match headers.contains_key(header::HOST) {
            true => Err(Refusal::Malformed("more than one Host header")),
            false => Ok(()),
        };
    };
    let mismatch = || Refusal::HostMismatch {
        header: String::from_utf8_lossy(value.as_bytes()).into_owned(),
        uri_host: format!("{}:{port}", authority.host()),
    };
    let header_authority: Authority = value
        .to_str()
        .ok()
        .and_then(|v| v.parse().ok())
        .ok_or_else(mismatch)?;
    let same_host = match (
        normalise_request_host(header_authority.host()),
        normalise_request_host(authority.host()),
    ) {
        (Ok(a), Ok(b)) => a == b,
        _ => header_authority
            .host()
            .eq_ignore_ascii_case(authority.host()),
    };
    if !same_host || header_authority.port_u16().unwrap_or(80) != port {
        return Err(mismatch());
    }
    Ok(())
}

/// Removes the headers that belong to one hop (RFC 9110 7.6.1), including those `Connection` names.
pub(crate) fn strip_hop_by_hop(headers: &mut HeaderMap) {
    let named: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|name| HeaderName::from_bytes(name.trim().as_bytes()).ok())
        .collect();
    for name in named {
        headers.remove(name);
    }
    for name in [
        "connection",
        "proxy-connection",
        "keep-alive",
        "proxy-authorization",
        "proxy-authenticate",
        "te",
        "trailer",
        "upgrade",
    ] {
        headers.remove(name);
    }
}

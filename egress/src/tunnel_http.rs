//! Plain HTTP inside a CONNECT tunnel (undici, and so node's `fetch`, tunnels `http://` URLs too): the tunnel is
//! served as an HTTP/1.1 connection, not spliced. Each request must be in origin form with a Host header naming
//! the CONNECT host and port, is checked against the allowlist in force, and goes over the tunnel's one upstream
//! connection; anything that is not HTTP/1.1 ends the tunnel with a refusal.

use std::convert::Infallible;
use std::io::Cursor;
use std::sync::Arc;

use http::uri::Authority;
use hyper::body::Incoming;
use hyper::client::conn::http1::SendRequest;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite};
use tokio::net::TcpStream;
use tokio::sync::Mutex;

use crate::counting::Counted;
use crate::error::{EgressError, Refusal};
use crate::http_forward::{check_framing, check_host_header, strip_hop_by_hop};
use crate::shared::{Body, Outcome, Shared};

/// Serves the tunnel to `host:port` as HTTP/1.1: `read` holds the bytes already read from `client`.
pub(crate) async fn serve<S: AsyncRead + AsyncWrite + Send + Unpin + 'static>(
    shared: &Arc<Shared>,
    host: &str,
    port: u16,
    read: Vec<u8>,
    client: S,
    upstream: Counted<TcpStream>,
) {
    let Ok(authority) = format!("{host}:{port}").parse::<Authority>() else {
        return;
    };
    let sender = match hyper::client::conn::http1::handshake(TokioIo::new(upstream)).await {
        Ok((sender, conn)) => {
            shared.spawn(async move {
                if let Err(e) = conn.await {
                    tracing::debug!(error = %e, "egress upstream connection ended with an error");
                }
            });
            Arc::new(Mutex::new(sender))
        }
        Err(e) => {
            tracing::info!(error = %e, %host, "egress tunnel closed");
            return;
        }
    };
    // The bytes read while looking for a ClientHello come first, then the rest of the tunnel.
    let (reader, writer) = tokio::io::split(client);
    let client = tokio::io::join(Cursor::new(read).chain(reader), writer);
    let service_shared = shared.clone();
    let service = service_fn(move |req| {
        let (shared, authority, sender) =
            (service_shared.clone(), authority.clone(), sender.clone());
        async move {
            let response = match forward(&shared, &authority, &sender, req).await {
                Ok(response) => response,
                Err(Outcome::Refused(refusal)) => shared.refuse(&refusal),
                Err(Outcome::Failed(e)) => {
                    tracing::info!(error = %e, "egress upstream failed");
                    crate::shared::text(http::StatusCode::BAD_GATEWAY, format!("{e}\n"))
                }
            };
            Ok::<_, Infallible>(response)
        }
    });
    let conn = http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(shared.limits.hello_timeout)
        .serve_connection(TokioIo::new(client), service);
    if let Err(e) = conn.await {
        if e.is_parse() || e.is_timeout() {
            shared.note_refusal(&Refusal::NotTlsOrHttp(host.to_string()));
        } else {
            tracing::debug!(error = %e, %host, "egress tunnel closed");
        }
    }
}

/// Checks one request of the tunnel and sends it upstream.
async fn forward(
    shared: &Shared,
    authority: &Authority,
    sender: &Mutex<SendRequest<Incoming>>,
    mut req: Request<Incoming>,
) -> Result<Response<Body>, Outcome> {
    let uri = req.uri();
    if uri.scheme().is_some() || uri.authority().is_some() {
        return Err(Refusal::Malformed("an absolute-form request inside a tunnel").into());
    }
    let port = authority.port_u16().unwrap_or(80);
    if !req.headers().contains_key(http::header::HOST) {
        return Err(Refusal::Malformed("no Host header").into());
    }
    check_host_header(req.headers(), authority, port)?;
    check_framing(req.headers())?;
    // The list may have changed since the tunnel opened, and the byte limit may be reached.
    shared.check_host(authority.host(), port)?;
    strip_hop_by_hop(req.headers_mut());
    let failed = |source| {
        Outcome::Failed(EgressError::Upstream {
            host: authority.host().to_string(),
            source,
        })
    };
    let mut sender = sender.lock().await;
    sender.ready().await.map_err(failed)?;
    let mut response = sender.send_request(req).await.map_err(failed)?;
    strip_hop_by_hop(response.headers_mut());
    Ok(response.map(http_body_util::BodyExt::boxed))
}

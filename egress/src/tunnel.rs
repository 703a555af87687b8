//! `CONNECT host:port`: allowlist, resolution and address policy, then a tunnel that must open with a TLS
//! ClientHello naming the CONNECT host, or with plain HTTP/1.1 ([`crate::tunnel_http`]).

use std::sync::Arc;

use http_body_util::{BodyExt, Empty};
use hyper::body::Incoming;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

use crate::counting::Counted;
use crate::error::Refusal;
use crate::shared::{Body, Outcome, Shared};
use crate::sni::{read_client_hello, Hello};

/// Answers a CONNECT: 200 and a tunnel, or the refusal.
pub(crate) async fn connect(
    shared: Arc<Shared>,
    req: Request<Incoming>,
) -> Result<Response<Body>, Outcome> {
    let headers = req.headers();
    if headers.contains_key(http::header::CONTENT_LENGTH)
        || headers.contains_key(http::header::TRANSFER_ENCODING)
    {
        return Err(Refusal::Malformed("CONNECT with a body").into());
    }
    let uri = req.uri();
    let authority = match (uri.scheme(), uri.authority(), uri.path_and_query()) {
        (None, Some(authority), None) => authority.clone(),
        _ => return Err(Refusal::Malformed("CONNECT target is not host:port").into()),
    };
    let port = authority
        .port_u16()
        .ok_or(Refusal::Malformed("CONNECT target has no port"))?;
    let host = shared.check_host(authority.host(), port)?;
    let upstream = shared.connect(&host, port).await?;
    let task_shared = shared.clone();
    shared.spawn(async move {
        match hyper::upgrade::on(req).await {
            Ok(upgraded) => {
                // The tunnel takes over the slot of the connection it came from (released by the upgrade), so
                // open tunnels count against max_connections too.
                let Ok(_slot) = task_shared.connection_slots.clone().acquire_owned().await else {
                    return;
                };
                splice(&task_shared, &host, port, TokioIo::new(upgraded), upstream).await
            }
            Err(e) => tracing::debug!(error = %e, %host, "egress CONNECT upgrade failed"),
        }
    });
    Ok(Response::new(
        Empty::new().map_err(|never| match never {}).boxed(),
    ))
}

async fn splice(
    shared: &Arc<Shared>,
    host: &str,
    port: u16,
    mut client: TokioIo<hyper::upgrade::Upgraded>,
    mut upstream: Counted<TcpStream>,
) {
    let hello =
        tokio::time::timeout(shared.limits.hello_timeout, read_client_hello(&mut client)).await;
    let bytes = match hello {
        Ok(Ok(Hello::Tls { sni, bytes })) => {
            if sni.as_deref() != Some(host) {
                shared.note_refusal(&Refusal::SniMismatch {
                    host: host.to_string(),
                    sni,
                });
                return;
            }
            bytes
        }
        Ok(Ok(Hello::NotTls { bytes })) => {
            crate::tunnel_http::serve(shared, host, port, bytes, client, upstream).await;
            return;
        }
        Err(_) => {
            shared.note_refusal(&Refusal::NotTlsOrHttp(host.to_string()));
            return;
        }
        Ok(Err(e)) => {
            tracing::debug!(error = %e, %host, "egress tunnel closed before its ClientHello");
            return;
        }
    };
    if let Err(e) = upstream.write_all(&bytes).await {
        tracing::info!(error = %e, %host, "egress tunnel closed");
        return;
    }
    // 64 KiB buffers each way: the default 8 KiB ones cost a third of a bulk download's throughput (bench `proxy`).
    match tokio::io::copy_bidirectional_with_sizes(&mut client, &mut upstream, 64 << 10, 64 << 10)
        .await
    {
        Ok((up, down)) => tracing::debug!(%host, up, down, "egress tunnel closed"),
        Err(e) => tracing::info!(error = %e, %host, "egress tunnel closed"),
    }
}

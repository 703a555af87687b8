//! Local servers (a TLS echo server and an HTTP origin), a proxy started on a port of its own, and raw clients.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{bail, Context};
use bytes::Bytes;
use egress::{AddressPolicy, Allowlist, Proxy, ProxyLimits, StaticResolver};
use http_body_util::Full;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer, ServerName};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::client::TlsStream;
use tokio_rustls::{TlsAcceptor, TlsConnector};

pub const LOCALHOST: IpAddr = IpAddr::V4(Ipv4Addr::LOCALHOST);
pub const TIMEOUT: Duration = Duration::from_secs(10);

/// A proxy on its own 127.0.0.1 port.
pub struct TestProxy {
    pub proxy: Proxy,
    pub addr: SocketAddr,
}

pub async fn start_proxy(
    allow: &[String],
    policy: AddressPolicy,
    resolver: StaticResolver,
    limits: ProxyLimits,
) -> TestProxy {
    let listener = TcpListener::bind((LOCALHOST, 0)).await.unwrap();
    let addr = listener.local_addr().unwrap();
    let proxy = Proxy::new(
        Allowlist::parse(allow).unwrap(),
        policy,
        Arc::new(resolver),
        limits,
    );
    let serving = proxy.clone();
    tokio::spawn(async move { serving.serve(listener).await });
    TestProxy { proxy, addr }
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// A TLS server for `allowed.test` and `other.test` that greets, then echoes each read prefixed with `echo:`;
/// `big` bytes after the greeting when asked for them with `big`.
pub struct TlsServer {
    pub addr: SocketAddr,
    pub cert: CertificateDer<'static>,
    /// TCP connections accepted.
    pub accepted: Arc<AtomicUsize>,
    /// TLS handshakes completed.
    pub handshakes: Arc<AtomicUsize>,
}

pub async fn tls_server() -> TlsServer {
    let certified =
        rcgen::generate_simple_self_signed(vec!["allowed.test".into(), "other.test".into()])
            .unwrap();
    let cert = certified.cert.der().clone();
    let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(certified.key_pair.serialize_der()));
    let config = rustls::ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(vec![cert.clone()], key)
        .unwrap();
    let acceptor = TlsAcceptor::from(Arc::new(config));
    let listener = TcpListener::bind((LOCALHOST, 0)).await.unwrap();
    let addr = listener.local_addr().unwrap();
    let accepted = Arc::new(AtomicUsize::new(0));
    let handshakes = Arc::new(AtomicUsize::new(0));
    let (a, h) = (accepted.clone(), handshakes.clone());
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            a.fetch_add(1, Ordering::SeqCst);
            let (acceptor, h) = (acceptor.clone(), h.clone());
            tokio::spawn(async move {
                let Ok(mut tls) = acceptor.accept(stream).await else {
                    return;
                };
                h.fetch_add(1, Ordering::SeqCst);
                tls.write_all(b"hello\n").await.ok();
                let mut buf = vec![0u8; 1024];
                while let Ok(n) = tls.read(&mut buf).await {
                    if n == 0 {
                        break;
                    }
                    if &buf[..n] == b"big" {
                        let chunk = vec![b'x'; 64 * 1024];
                        for _ in 0..32 {
                            if tls.write_all(&chunk).await.is_err() {
                                return;
                            }
                        }
                        continue;
                    }
                    let mut reply = b"echo:".to_vec();
                    reply.extend_from_slice(&buf[..n]);
                    if tls.write_all(&reply).await.is_err() {
                        break;
                    }
                }
            });
        }
    });
    TlsServer {
        addr,
        cert,
        accepted,
        handshakes,
    }
}

/// Sends `CONNECT target` through the proxy and returns the status and the stream after the response head.
pub async fn connect(
    proxy: SocketAddr,
    target: &str,
    extra: &str,
) -> anyhow::Result<(u16, TcpStream)> {
    let mut stream = TcpStream::connect(proxy).await?;
    let request = format!("CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n{extra}\r\n");
    stream.write_all(request.as_bytes()).await?;
    let head = read_head(&mut stream).await?;
    Ok((status_of(&head)?, stream))
}

/// Reads one response head, byte by byte so nothing after it is consumed.
pub async fn read_head<R: AsyncRead + Unpin>(stream: &mut R) -> anyhow::Result<String> {
    let mut head = Vec::new();
    while !head.ends_with(b"\r\n\r\n") {
        let mut byte = [0u8; 1];
        let n = tokio::time::timeout(TIMEOUT, stream.read(&mut byte))
            .await
            .context("response head timed out")??;
        if n == 0 {
            bail!(
                "connection closed after {:?}",
                String::from_utf8_lossy(&head)
            );
        }
        head.push(byte[0]);
    }
    Ok(String::from_utf8(head)?)
}

pub fn status_of(head: &str) -> anyhow::Result<u16> {
    let status = head.split(' ').nth(1).context("no status")?;
    Ok(status.parse()?)
}

/// A TLS client over an open tunnel, trusting `cert`, sending SNI `sni`.
pub async fn tls_over<S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin>(
    stream: S,
    cert: &CertificateDer<'static>,
    sni: &str,
) -> std::io::Result<TlsStream<S>> {
    tls_over_with(stream, cert, sni, true).await
}

/// [`tls_over`], with SNI sent or not.
pub async fn tls_over_with<S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin>(
    stream: S,
    cert: &CertificateDer<'static>,
    sni: &str,
    send_sni: bool,
) -> std::io::Result<TlsStream<S>> {
    let mut roots = rustls::RootCertStore::empty();
    roots.add(cert.clone()).unwrap();
    let config = rustls::ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    let mut config = config;
    config.enable_sni = send_sni;
    let name = ServerName::try_from(sni.to_string()).unwrap();
    tokio::time::timeout(
        TIMEOUT,
        TlsConnector::from(Arc::new(config)).connect(name, stream),
    )
    .await
    .map_err(|_| std::io::Error::other("TLS handshake timed out"))?
}

/// One request an origin saw.
#[derive(Debug, Clone)]
pub struct Seen {
    pub method: String,
    pub uri: String,
    pub host: Option<String>,
    pub body: Vec<u8>,
    pub proxy_authorization: bool,
}

/// An HTTP origin: `/big` answers 1 MiB, `/redirect` a 302 to a denied host, anything else `hello from origin`.
pub struct Origin {
    pub addr: SocketAddr,
    pub accepted: Arc<AtomicUsize>,
    pub seen: Arc<Mutex<Vec<Seen>>>,
}

pub async fn origin() -> Origin {
    let listener = TcpListener::bind((LOCALHOST, 0)).await.unwrap();
    let addr = listener.local_addr().unwrap();
    let accepted = Arc::new(AtomicUsize::new(0));
    let seen: Arc<Mutex<Vec<Seen>>> = Arc::default();
    let (a, s) = (accepted.clone(), seen.clone());
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            a.fetch_add(1, Ordering::SeqCst);
            let s = s.clone();
            let service = service_fn(move |req: hyper::Request<hyper::body::Incoming>| {
                let s = s.clone();
                async move { Ok::<_, std::convert::Infallible>(answer(&s, req).await) }
            });
            tokio::spawn(
                hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service),
            );
        }
    });
    Origin {
        addr,
        accepted,
        seen,
    }
}

async fn answer(
    seen: &Mutex<Vec<Seen>>,
    req: hyper::Request<hyper::body::Incoming>,
) -> hyper::Response<Full<Bytes>> {
    use http_body_util::BodyExt;
    let (parts, body) = req.into_parts();
    let body = body
        .collect()
        .await
        .map(|b| b.to_bytes().to_vec())
        .unwrap_or_default();
    let path = parts.uri.path().to_string();
    seen.lock().unwrap().push(Seen {
        method: parts.method.to_string(),
        uri: parts.uri.to_string(),
        host: parts
            .headers
            .get("host")
            .map(|h| h.to_str().unwrap().to_string()),
        body,
        proxy_authorization: parts.headers.contains_key("proxy-authorization"),
    });
    match path.as_str() {
        "/big" => hyper::Response::new(Full::new(Bytes::from(vec![b'x'; 1 << 20]))),
        "/redirect" => hyper::Response::builder()
            .status(302)
            .header("location", "http://denied.test/")
            .body(Full::new(Bytes::new()))
            .unwrap(),
        _ => hyper::Response::new(Full::new(Bytes::from_static(b"hello from origin"))),
    }
}

/// Writes raw bytes to the proxy and reads until it closes (requests send `Connection: close`).
pub async fn raw(proxy: SocketAddr, request: &str) -> anyhow::Result<String> {
    let mut stream = TcpStream::connect(proxy).await?;
    stream.write_all(request.as_bytes()).await?;
    let mut out = Vec::new();
    let read = tokio::time::timeout(TIMEOUT, stream.read_to_end(&mut out))
        .await
        .context("response timed out")?;
    if let Err(e) = read {
        if out.is_empty() {
            return Err(e.into());
        }
    }
    Ok(String::from_utf8_lossy(&out).into_owned())
}

/// An [`origin`] as `origin.test` (`other.test` and `denied.test` resolve to it too), behind a proxy allowing
/// `origin.test` on its port and permitting exactly its address; returns `origin.test:<port>` too.
pub async fn origin_behind_proxy(limits: ProxyLimits) -> (Origin, TestProxy, String) {
    let origin = origin().await;
    let host = format!("origin.test:{}", origin.addr.port());
    let resolver = StaticResolver::new()
        .with("origin.test", [LOCALHOST])
        .with("other.test", [LOCALHOST])
        .with("denied.test", [LOCALHOST]);
    let policy = AddressPolicy::new().exempt_for_tests(origin.addr);
    let proxy = start_proxy(std::slice::from_ref(&host), policy, resolver, limits).await;
    (origin, proxy, host)
}

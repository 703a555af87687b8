//! What the proxy bench runs against: one HTTP origin served both in plain text and over TLS (a certificate for
//! `origin.test`), a proxy allowing exactly that origin, and the clients that reach it directly or through the
//! proxy.

use std::convert::Infallible;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context as TaskContext, Poll};

use anyhow::{ensure, Context};
use bytes::Bytes;
use egress::{AddressPolicy, Allowlist, Proxy, ProxyLimits, StaticResolver};
use http_body_util::{BodyExt, Empty};
use hyper::body::{Body, Frame, Incoming, SizeHint};
use hyper::client::conn::http1::SendRequest;
use hyper::service::service_fn;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer, ServerName};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::client::TlsStream;
use tokio_rustls::{TlsAcceptor, TlsConnector};

/// The origin's name, as the proxy's allowlist and resolver know it and as its certificate names it.
pub const HOST: &str = "origin.test";
/// What `/small` answers.
pub const SMALL_BODY: &[u8] = b"hello from origin\n";

const LOCALHOST: IpAddr = IpAddr::V4(Ipv4Addr::LOCALHOST);
/// The slice size `/big` is sent in.
const CHUNK: usize = 64 * 1024;

/// A client's request sender on one HTTP/1.1 connection.
pub type Sender = SendRequest<Empty<Bytes>>;

/// A response body of `left` bytes sent as slices of one shared buffer (no copy, no allocation per response).
struct Repeat {
    chunk: Bytes,
    left: u64,
}

impl Body for Repeat {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _cx: &mut TaskContext<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        if self.left == 0 {
            return Poll::Ready(None);
        }
        let n = usize::try_from(self.left).map_or(self.chunk.len(), |l| l.min(self.chunk.len()));
        self.left -= n as u64;
        Poll::Ready(Some(Ok(Frame::data(self.chunk.slice(..n)))))
    }

    fn is_end_stream(&self) -> bool {
        self.left == 0
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::with_exact(self.left)
    }
}

/// The origin's answer: `/small` a short text, `/big` `big` bytes of `x`, anything else 404.
fn answer(path: &str, big: u64, filler: &Bytes) -> Response<Repeat> {
    let (status, chunk, left) = match path {
        "/small" => (
            StatusCode::OK,
            Bytes::from_static(SMALL_BODY),
            SMALL_BODY.len() as u64,
        ),
        "/big" => (StatusCode::OK, filler.clone(), big),
        _ => (StatusCode::NOT_FOUND, Bytes::new(), 0),
    };
    let mut response = Response::new(Repeat { chunk, left });
    *response.status_mut() = status;
    response
}

/// Serves HTTP/1.1 on one accepted connection. Its errors are dropped on purpose: the clients here close right
/// after a TLS handshake or a response, and every result is checked on the client's side.
fn serve_http<S: AsyncRead + AsyncWrite + Unpin + Send + 'static>(io: S, big: u64, filler: Bytes) {
    let service = service_fn(move |req: Request<Incoming>| {
        let response = answer(req.uri().path(), big, &filler);
        async move { Ok::<_, Infallible>(response) }
    });
    tokio::spawn(async move {
        let _ = hyper::server::conn::http1::Builder::new()
            .serve_connection(TokioIo::new(io), service)
            .await;
    });
}

/// The origin: the same service on a plain port and on a TLS port.
pub struct Origin {
    /// Plain HTTP.
    pub plain: SocketAddr,
    /// HTTP over TLS (certificate for [`HOST`]).
    pub tls: SocketAddr,
    /// The certificate clients trust.
    pub cert: CertificateDer<'static>,
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// Starts the origin on two 127.0.0.1 ports; `/big` answers `big` bytes.
pub async fn origin(big: u64) -> anyhow::Result<Origin> {
    let certified =
        rcgen::generate_simple_self_signed(vec![HOST.to_string()]).context("origin certificate")?;
    let cert = certified.cert.der().clone();
    let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(certified.key_pair.serialize_der()));
    let config = rustls::ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .context("TLS versions")?
        .with_no_client_auth()
        .with_single_cert(vec![cert.clone()], key)
        .context("origin TLS config")?;
    let acceptor = TlsAcceptor::from(Arc::new(config));
    let filler = Bytes::from(vec![b'x'; CHUNK]);

    let plain_listener = TcpListener::bind((LOCALHOST, 0)).await?;
    let tls_listener = TcpListener::bind((LOCALHOST, 0)).await?;
    let (plain, tls) = (plain_listener.local_addr()?, tls_listener.local_addr()?);
    let plain_filler = filler.clone();
    tokio::spawn(async move {
        while let Ok((stream, _)) = plain_listener.accept().await {
            // As servers commonly do; the proxy's own sockets are left as the proxy sets them.
            let _ = stream.set_nodelay(true);
            serve_http(stream, big, plain_filler.clone());
        }
    });
    tokio::spawn(async move {
        while let Ok((stream, _)) = tls_listener.accept().await {
            let _ = stream.set_nodelay(true);
            let (acceptor, filler) = (acceptor.clone(), filler.clone());
            tokio::spawn(async move {
                if let Ok(tls) = acceptor.accept(stream).await {
                    serve_http(tls, big, filler);
                }
            });
        }
    });
    Ok(Origin { plain, tls, cert })
}

/// Starts a proxy on its own 127.0.0.1 port allowing [`HOST`] on both of the origin's ports, resolving it to
/// 127.0.0.1 and permitting exactly the origin's two addresses.
pub async fn proxy(origin: &Origin) -> anyhow::Result<(Proxy, SocketAddr)> {
    proxy_with(origin, ProxyLimits::default(), None).await
}

/// [`proxy`] with these limits, its byte limit kept in `ledger` when given.
pub async fn proxy_with(
    origin: &Origin,
    limits: ProxyLimits,
    ledger: Option<egress::Ledger>,
) -> anyhow::Result<(Proxy, SocketAddr)> {
    let allow = [
        format!("{HOST}:{}", origin.plain.port()),
        format!("{HOST}:{}", origin.tls.port()),
    ];
    let policy = AddressPolicy::new()
        .exempt_for_tests(origin.plain)
        .exempt_for_tests(origin.tls);
    let resolver = StaticResolver::new().with(HOST, [LOCALHOST]);
    let allowlist = Allowlist::parse(&allow).context("allowlist")?;
    let proxy = match ledger {
        Some(l) => Proxy::with_ledger(allowlist, policy, Arc::new(resolver), limits, l),
        None => Proxy::new(allowlist, policy, Arc::new(resolver), limits),
    };
    let listener = TcpListener::bind((LOCALHOST, 0)).await?;
    let addr = listener.local_addr()?;
    let serving = proxy.clone();
    tokio::spawn(async move {
        if let Err(e) = serving.serve(listener).await {
            eprintln!("proxy stopped: {e}");
        }
    });
    Ok((proxy, addr))
}

/// A ledger's reservations written as live restore writes them (`egress.reserved`): 8 bytes in place in a file
/// on a disk, one `pwrite` each.
pub struct FileLedger {
    _dir: tempfile::TempDir,
    file: std::fs::File,
    /// Reservations written.
    pub written: std::sync::atomic::AtomicU64,
}

impl FileLedger {
    /// A ledger in a new directory under `/var/tmp` (a disk, as the state directory is).
    pub fn new() -> anyhow::Result<FileLedger> {
        let dir = tempfile::tempdir_in("/var/tmp").context("ledger directory")?;
        let file = std::fs::File::create(dir.path().join("egress.reserved"))?;
        Ok(FileLedger {
            _dir: dir,
            file,
            written: std::sync::atomic::AtomicU64::new(0),
        })
    }
}

impl egress::Reserve for FileLedger {
    fn reserve(&self, total: u64) -> std::io::Result<()> {
        std::os::unix::fs::FileExt::write_all_at(&self.file, &total.to_le_bytes(), 0)?;
        self.written
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    }
}

/// A client TCP connection, with `TCP_NODELAY` as HTTP clients set it.
pub async fn tcp(addr: SocketAddr) -> anyhow::Result<TcpStream> {
    let stream = TcpStream::connect(addr)
        .await
        .with_context(|| format!("connect to {addr}"))?;
    stream.set_nodelay(true).context("TCP_NODELAY")?;
    Ok(stream)
}

/// An HTTP/1.1 client connection over `io`, its connection task spawned.
pub async fn http1<S: AsyncRead + AsyncWrite + Unpin + Send + 'static>(
    io: S,
) -> anyhow::Result<Sender> {
    let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(io))
        .await
        .context("HTTP/1.1 client handshake")?;
    tokio::spawn(async move {
        if let Err(e) = conn.await {
            eprintln!("client connection failed: {e}");
        }
    });
    Ok(sender)
}

/// Sends `GET uri` with `Host: host`, reads the whole body, and checks the status and its length.
pub async fn get(sender: &mut Sender, uri: &str, host: &str, want: u64) -> anyhow::Result<()> {
    sender.ready().await.context("connection not ready")?;
    let request = Request::get(uri)
        .header(hyper::header::HOST, host)
        .body(Empty::new())
        .context("request")?;
    let response = sender
        .send_request(request)
        .await
        .with_context(|| format!("GET {uri}"))?;
    ensure!(
        response.status() == StatusCode::OK,
        "GET {uri}: {}",
        response.status()
    );
    let mut body = response.into_body();
    let mut got = 0u64;
    while let Some(frame) = body.frame().await {
        if let Some(data) = frame.context("response body")?.data_ref() {
            got += data.len() as u64;
        }
    }
    ensure!(got == want, "GET {uri}: {got} bytes, expected {want}");
    Ok(())
}

/// Opens a connection to the proxy and sends `CONNECT target`; returns the stream once the 200 has been read.
pub async fn tunnel(proxy: SocketAddr, target: &str) -> anyhow::Result<TcpStream> {
    let mut stream = tcp(proxy).await?;
    let request = format!("CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n");
    stream.write_all(request.as_bytes()).await?;
    // Nothing follows the response head before the client's ClientHello, so reading in blocks is safe.
    let mut head = Vec::with_capacity(256);
    let mut buf = [0u8; 512];
    let end = loop {
        let n = stream.read(&mut buf).await.context("CONNECT response")?;
        ensure!(
            n > 0,
            "proxy closed after {:?}",
            String::from_utf8_lossy(&head)
        );
        head.extend_from_slice(&buf[..n]);
        if let Some(at) = head.windows(4).position(|w| w == b"\r\n\r\n") {
            break at + 4;
        }
        ensure!(head.len() < 16 * 1024, "CONNECT response head too long");
    };
    ensure!(
        end == head.len() && head.starts_with(b"HTTP/1.1 200"),
        "CONNECT {target}: {:?}",
        String::from_utf8_lossy(&head)
    );
    Ok(stream)
}

/// A TLS client configuration trusting only `cert`, with session resumption off so every handshake is a full one.
pub fn tls_config(cert: &CertificateDer<'static>) -> anyhow::Result<Arc<rustls::ClientConfig>> {
    let mut roots = rustls::RootCertStore::empty();
    roots.add(cert.clone()).context("trust the origin")?;
    let mut config = rustls::ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .context("TLS versions")?
        .with_root_certificates(roots)
        .with_no_client_auth();
    config.resumption = rustls::client::Resumption::disabled();
    Ok(Arc::new(config))
}

/// A TLS handshake with [`HOST`] over `stream`.
pub async fn tls(
    stream: TcpStream,
    config: &Arc<rustls::ClientConfig>,
) -> anyhow::Result<TlsStream<TcpStream>> {
    let name = ServerName::try_from(HOST).context("server name")?;
    TlsConnector::from(config.clone())
        .connect(name, stream)
        .await
        .context("TLS handshake")
}

//! A tiny scripted FSP server (tokio-tungstenite) for the failures a real daemon does not produce on demand:
//! malformed messages, dropped connections, unanswered pings, refused tokens, TLS.

#![allow(dead_code)]

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use futures_util::{SinkExt, StreamExt};
use serde_json::{json, Value};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpListener;
use tokio::sync::Notify;
use tokio_tungstenite::tungstenite::handshake::server::{ErrorResponse, Request, Response};
use tokio_tungstenite::tungstenite::http::StatusCode;
use tokio_tungstenite::tungstenite::Message;

/// What the server does in answer to a client message.
#[derive(Debug, Clone)]
pub enum Reply {
    /// Send this text frame.
    Text(String),
    /// Send this JSON as a text frame.
    Json(Value),
    /// Drop the connection (no close frame).
    Drop,
    /// Wait until [`FakeServer::release`] is called.
    Hold,
}

/// The script: (connection number from 1, client message) → replies.
pub type Script = Arc<dyn Fn(usize, &Value) -> Vec<Reply> + Send + Sync>;

/// A running fake server.
pub struct FakeServer {
    /// Where it listens.
    pub addr: SocketAddr,
    /// Connections accepted (upgrades that succeeded).
    pub connections: Arc<AtomicUsize>,
    /// Connections that ended.
    pub closed: Arc<AtomicUsize>,
    /// The `Authorization` header of every upgrade attempt, in order.
    pub auth_headers: Arc<Mutex<Vec<String>>>,
    /// Every client message received, in order, with its connection number.
    pub received: Arc<Mutex<Vec<(usize, Value)>>>,
    release: Arc<Notify>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for FakeServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A timestamp.
pub fn ts() -> String {
    protocol::now_ts()
}

/// The standard successful run of execution `id` printing `out`.
pub fn success(id: &str, out: &str) -> Vec<Reply> {
    vec![
        Reply::Json(json!({"v":1,"type":"ack","id":id,"ts":ts(),"queued":false})),
        Reply::Json(json!({"v":1,"type":"status","id":id,"status":"running","ts":ts()})),
        Reply::Json(json!({"v":1,"type":"stdout","id":id,"data":out,"ts":ts()})),
        Reply::Json(json!({"v":1,"type":"status","id":id,"status":"completed","ts":ts()})),
        Reply::Json(
            json!({"v":1,"type":"result","id":id,"exit_code":0,"duration_ms":5,
            "resource_usage":{"peak_memory_mb":1,"cpu_time_ms":1},"reason":"exited",
            "stdout_bytes":out.len(),"stderr_bytes":0,"truncated":false,"ts":ts()}),
        ),
    ]
}

/// The `pong` of an idle server.
pub fn pong() -> Reply {
    Reply::Json(
        json!({"v":1,"type":"pong","load":{"active_executions":0,"queue_depth":0},"ts":ts()}),
    )
}

/// The default answers: `pong` to `ping`, [`success`] (printing `hi`) to `execute`, nothing to `cancel`.
pub fn standard(msg: &Value) -> Vec<Reply> {
    match msg["type"].as_str() {
        Some("ping") => vec![pong()],
        Some("execute") => success(msg["id"].as_str().unwrap_or("?"), "hi\n"),
        _ => vec![],
    }
}

impl FakeServer {
    /// Listens on a fresh loopback port.
    pub async fn start(script: Script) -> FakeServer {
        Self::start_on("127.0.0.1:0".parse().unwrap(), script, None, None).await
    }

    /// Listens on `addr`; `token`, when set, is required (401 otherwise); `tls`, when set, serves `wss://`.
    pub async fn start_on(
        addr: SocketAddr,
        script: Script,
        token: Option<String>,
        tls: Option<tokio_rustls::TlsAcceptor>,
    ) -> FakeServer {
        let listener = TcpListener::bind(addr).await.expect("bind the fake server");
        let addr = listener.local_addr().unwrap();
        let connections = Arc::new(AtomicUsize::new(0));
        let closed = Arc::new(AtomicUsize::new(0));
        let auth_headers = Arc::new(Mutex::new(Vec::new()));
        let received = Arc::new(Mutex::new(Vec::new()));
        let release = Arc::new(Notify::new());
        let task = {
            let (connections, closed, auth_headers, received, release) = (
                connections.clone(),
                closed.clone(),
                auth_headers.clone(),
                received.clone(),
                release.clone(),
            );
            tokio::spawn(async move {
                let mut conns = tokio::task::JoinSet::new();
                loop {
                    let Ok((tcp, _)) = listener.accept().await else {
                        return;
                    };
                    let _ = tcp.set_nodelay(true);
                    let ctx = Ctx {
                        script: script.clone(),
                        token: token.clone(),
                        connections: connections.clone(),
                        closed: closed.clone(),
                        auth_headers: auth_headers.clone(),
                        received: received.clone(),
                        release: release.clone(),
                    };
                    match &tls {
                        Some(acceptor) => {
                            let acceptor = acceptor.clone();
                            conns.spawn(async move {
                                if let Ok(stream) = acceptor.accept(tcp).await {
                                    serve(stream, ctx).await;
                                }
                            });
                        }
                        None => {
                            conns.spawn(serve(tcp, ctx));
                        }
                    }
                }
            })
        };
        FakeServer {
            addr,
            connections,
            closed,
            auth_headers,
            received,
            release,
            task,
        }
    }

    /// `ws://ADDR/ws`.
    pub fn url(&self) -> String {
        format!("ws://{}/ws", self.addr)
    }

    /// Lets every [`Reply::Hold`] go on.
    pub fn release(&self) {
        self.release.notify_waiters();
    }

    /// Stops listening and drops every connection.
    pub fn shutdown(self) {
        drop(self);
    }

    /// The messages of `type` received so far.
    pub fn received_of(&self, kind: &str) -> Vec<Value> {
        self.received
            .lock()
            .unwrap()
            .iter()
            .filter(|(_, m)| m["type"] == kind)
            .map(|(_, m)| m.clone())
            .collect()
    }
}

struct Ctx {
    script: Script,
    token: Option<String>,
    connections: Arc<AtomicUsize>,
    closed: Arc<AtomicUsize>,
    auth_headers: Arc<Mutex<Vec<String>>>,
    received: Arc<Mutex<Vec<(usize, Value)>>>,
    release: Arc<Notify>,
}

async fn serve<S: AsyncRead + AsyncWrite + Unpin>(stream: S, ctx: Ctx) {
    let auth = ctx.auth_headers.clone();
    let token = ctx.token.clone();
    // The callback's signature is tungstenite's.
    #[allow(clippy::result_large_err)]
    let callback = move |req: &Request, resp: Response| -> Result<Response, ErrorResponse> {
        let header = req
            .headers()
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_owned();
        auth.lock().unwrap().push(header.clone());
        if let Some(t) = &token {
            if header != format!("Bearer {t}") {
                let mut refuse = ErrorResponse::new(Some("unauthorized\n".into()));
                *refuse.status_mut() = StatusCode::UNAUTHORIZED;
                return Err(refuse);
            }
        }
        Ok(resp)
    };
    let Ok(mut ws) = tokio_tungstenite::accept_hdr_async(stream, callback).await else {
        return;
    };
    let n = ctx.connections.fetch_add(1, Ordering::SeqCst) + 1;
    'conn: while let Some(Ok(frame)) = ws.next().await {
        let Message::Text(text) = frame else {
            if matches!(frame, Message::Close(_)) {
                break;
            }
            continue;
        };
        let Ok(msg) = serde_json::from_str::<Value>(text.as_str()) else {
            continue;
        };
        ctx.received.lock().unwrap().push((n, msg.clone()));
        for reply in (ctx.script)(n, &msg) {
            match reply {
                Reply::Text(t) => {
                    if ws.send(Message::text(t)).await.is_err() {
                        break 'conn;
                    }
                }
                Reply::Json(v) => {
                    if ws.send(Message::text(v.to_string())).await.is_err() {
                        break 'conn;
                    }
                }
                Reply::Drop => break 'conn,
                Reply::Hold => ctx.release.notified().await,
            }
        }
    }
    ctx.closed.fetch_add(1, Ordering::SeqCst);
}

/// Three standard fakes on the same port of 127.0.0.1, .2 and .3 (what three hosts behind one name or Service
/// look like): the servers, their addresses and the port.
pub async fn three_hosts() -> (Vec<FakeServer>, Vec<Ipv4Addr>, u16) {
    let ips: Vec<Ipv4Addr> = (1..=3).map(|i| Ipv4Addr::new(127, 0, 0, i)).collect();
    let mut servers: Vec<FakeServer> = Vec::new();
    for ip in &ips {
        let port = servers.first().map_or(0, |s| s.addr.port());
        let addr = SocketAddr::new(IpAddr::V4(*ip), port);
        servers.push(FakeServer::start_on(addr, Arc::new(|_, m| standard(m)), None, None).await);
    }
    let port = servers[0].addr.port();
    (servers, ips, port)
}

/// Waits until the fleet's endpoints, sorted, are `want`.
pub async fn wait_endpoints(fleet: &client::Fleet, want: Vec<String>) {
    super::daemon::wait_until(
        "the fleet to follow discovery",
        std::time::Duration::from_secs(10),
        || {
            let mut now = fleet.endpoints();
            now.sort();
            let want = want.clone();
            async move {
                if now == want {
                    Ok(())
                } else {
                    Err(format!("{now:?}"))
                }
            }
        },
    )
    .await;
}

/// A `print('hi')` in python with small limits.
pub fn hi_request() -> client::ExecuteRequest {
    client::ExecuteRequest::new(
        client::new_execution_id(),
        client::Language::Python,
        "print('hi')",
        client::RequestedLimits::new(5_000, 64),
    )
}

/// A fleet builder for fakes: the fakes serve no `/healthz`, so their checks fail; this fleet checks once a
/// minute and ejects only after many failures in a row.
pub fn fleet_of_fakes(discovery: client::Discovery) -> client::FleetBuilder {
    client::Fleet::builder(discovery)
        .eject_after(1_000)
        .check_interval(std::time::Duration::from_secs(60))
        .check_timeout(std::time::Duration::from_millis(300))
}

/// How many `execute` messages each server received.
pub fn executes_per_server(servers: &[FakeServer]) -> Vec<usize> {
    servers
        .iter()
        .map(|s| s.received_of("execute").len())
        .collect()
}

/// A TLS acceptor with a self-signed certificate for `name` (a host name or an IP address), and the certificate
/// (DER and PEM) a client must trust.
pub fn self_signed(
    name: &str,
) -> (
    tokio_rustls::TlsAcceptor,
    rustls::pki_types::CertificateDer<'static>,
    String,
) {
    use rustls::pki_types::{PrivateKeyDer, PrivatePkcs8KeyDer};
    let rcgen::CertifiedKey { cert, key_pair } =
        rcgen::generate_simple_self_signed(vec![name.to_owned()]).unwrap();
    let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key_pair.serialize_der()));
    let config = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_no_client_auth()
    .with_single_cert(vec![cert.der().clone()], key)
    .unwrap();
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
    (acceptor, cert.der().clone(), cert.pem())
}

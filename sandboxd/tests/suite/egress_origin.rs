//! The outside world of the egress tests, in a network namespace the test creates: a veth pair from the host into
//! it, on a /24 of 198.18.0.0/15 (the benchmarking range, refused by the proxy unless the operator lists the
//! network in `network.allow_networks`, which these tests do for that /24 only), HTTP and HTTPS origins inside the
//! namespace that record every request they receive, a test CA that signed the HTTPS origin's certificate, a
//! package index serving one wheel, and a nameserver on 127.0.0.1 that the daemon's proxy queries. The host's end
//! of the veth pair is one of the host's own addresses: an HTTP server listens on it too, and the proxy must never
//! reach it, although it lies inside the allowed network.

use std::convert::Infallible;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use http_body_util::Full;
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use nix::sched::CloneFlags;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use tokio::net::TcpListener;
use tokio_rustls::TlsAcceptor;

use super::harness::{merge, Daemon, DaemonOpts};

/// The plain HTTP origin's port.
pub const HTTP_PORT: u16 = 8080;
/// The HTTPS origin's port.
pub const HTTPS_PORT: u16 = 8443;
/// The wheel the package index serves.
pub const WHEEL: &str = "egressdemo-1.0-py3-none-any.whl";

static NEXT: AtomicU32 = AtomicU32::new(0);

/// The origins, their address, the CA and the nameserver; dropping it stops the servers and removes the namespace
/// and its veth pair.
pub struct Origin {
    /// The origins' address (inside the namespace).
    pub ip: Ipv4Addr,
    /// The host's end of the veth pair, in the same /24: one of the host's own addresses.
    pub host_ip: Ipv4Addr,
    /// The test CA's certificate, PEM (the program trusts it from a file).
    pub ca_pem: String,
    /// `host header + path` of every request the origins (and the server on the host's end) received, in order.
    pub seen: Arc<Mutex<Vec<String>>>,
    /// The nameserver the daemon's proxy is configured with.
    pub nameserver: test_support::dns::Nameserver,
    tasks: Vec<tokio::task::JoinHandle<()>>,
    // Dropped after the fields above: the namespace goes once nothing of the test serves in it.
    netns: Netns,
}

impl Origin {
    /// Creates the namespace and starts the origins and the nameserver. Names: `origin.test` and `denied.test` at
    /// the origins' address, `hostside.test` at the host's end of the veth pair, `rebind.test` at 127.0.0.1,
    /// `meta.test` at 169.254.169.254, `private.test` at 10.1.2.3.
    pub async fn start() -> Origin {
        let n = NEXT.fetch_add(1, Ordering::SeqCst);
        let netns = Netns::create(&format!("sbxe{}x{n}", std::process::id() % 100_000), n);
        let (ip, host_ip) = (netns.inside, netns.host);
        let (ca_pem, acceptor) = certificates();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let wheel = Bytes::from(build_wheel());
        let inside = netns
            .bind_inside(&[(ip, HTTP_PORT).into(), (ip, HTTPS_PORT).into()])
            .expect("bind the origins inside the namespace");
        let [http, https] = inside.try_into().expect("two listeners");
        let http = TcpListener::from_std(http).expect("the HTTP origin's listener");
        let https = TcpListener::from_std(https).expect("the HTTPS origin's listener");
        // Would answer like the origins if the proxy ever connected to the host's own address.
        let host_side = TcpListener::bind((host_ip, HTTP_PORT))
            .await
            .expect("bind the server on the host's end");
        let tasks = vec![
            tokio::spawn(serve(http, None, seen.clone(), wheel.clone())),
            tokio::spawn(serve(https, Some(acceptor), seen.clone(), wheel.clone())),
            tokio::spawn(serve(host_side, None, seen.clone(), wheel)),
        ];
        let records = [
            ("origin.test", vec![ip]),
            ("denied.test", vec![ip]),
            ("hostside.test", vec![host_ip]),
            ("rebind.test", vec![Ipv4Addr::LOCALHOST]),
            ("meta.test", vec![Ipv4Addr::new(169, 254, 169, 254)]),
            ("private.test", vec![Ipv4Addr::new(10, 1, 2, 3)]),
        ];
        let nameserver = test_support::dns::Nameserver::start(&records)
            .await
            .expect("start the test nameserver");
        Origin {
            ip,
            host_ip,
            ca_pem,
            seen,
            nameserver,
            tasks,
            netns,
        }
    }

    /// The daemon's `network` configuration for these origins: their /24 allowed, nothing else.
    pub fn network_config(&self, egress_bytes_max: u64) -> serde_json::Value {
        serde_json::json!({
            "enabled": true,
            "allow_max": [
                format!("*.test:{HTTP_PORT}"),
                format!("*.test:{HTTPS_PORT}"),
                "*.test:22",
            ],
            "allow_networks": [self.netns.network()],
            "nameservers": [self.nameserver.addr.to_string()],
            "egress_bytes_max": egress_bytes_max,
        })
    }

    /// A daemon whose proxy reaches these origins (`network` on, with `egress_bytes_max`), with `extra` merged
    /// into its config.
    pub async fn daemon(&self, egress_bytes_max: u64, extra: serde_json::Value) -> Daemon {
        let mut config = serde_json::json!({ "network": self.network_config(egress_bytes_max) });
        merge(&mut config, extra);
        Daemon::start(DaemonOpts {
            extra_config: Some(config),
            ..DaemonOpts::default()
        })
        .await
    }

    /// The requests the origins received so far.
    pub fn seen(&self) -> Vec<String> {
        self.seen.lock().unwrap().clone()
    }
}

impl Drop for Origin {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

/// Held while a subnet is picked and taken, so two origins of this process never pick the same one.
static PICKING: Mutex<()> = Mutex::new(());

/// A network namespace of the test's own and a veth pair into it: `198.18.A.1/24` on the host's end,
/// `198.18.A.2/24` inside, `lo` up inside. Dropping it removes both.
struct Netns {
    name: String,
    link: String,
    host: Ipv4Addr,
    inside: Ipv4Addr,
}

impl Netns {
    /// Creates namespace `name` on the first /24 of 198.18.0.0/16 from one derived from the process and `n` that
    /// no address of the host lies in (another test process may hold one).
    fn create(name: &str, n: u32) -> Netns {
        // A leftover of an earlier crashed run with the same name goes first; a failure here is expected.
        let _ = ip_cmd(&["link", "del", name]);
        let _ = ip_cmd(&["netns", "del", name]);
        let picking = PICKING.lock().unwrap_or_else(|p| p.into_inner());
        let start = std::process::id().wrapping_mul(7).wrapping_add(n);
        let a = (0..256)
            .map(|i| (start.wrapping_add(i) % 256) as u8)
            .find(|&a| subnet_is_free(a))
            .expect("a free /24 in 198.18.0.0/16");
        ip_cmd(&["netns", "add", name]).expect("ip netns add");
        // From here on, dropping the value removes what was made, should a step fail.
        let netns = Netns {
            name: name.to_owned(),
            link: name.to_owned(),
            host: Ipv4Addr::new(198, 18, a, 1),
            inside: Ipv4Addr::new(198, 18, a, 2),
        };
        let peer = format!("{name}p");
        ip_cmd(&["link", "add", name, "type", "veth", "peer", "name", &peer])
            .expect("ip link add (veth)");
        ip_cmd(&["link", "set", &peer, "netns", name]).expect("ip link set netns");
        ip_cmd(&["addr", "add", &format!("{}/24", netns.host), "dev", name]).expect("ip addr add");
        drop(picking);
        ip_cmd(&["link", "set", name, "up"]).expect("ip link set up");
        let inside = format!("{}/24", netns.inside);
        ip_cmd(&["-n", name, "addr", "add", &inside, "dev", &peer]).expect("ip addr add (inside)");
        ip_cmd(&["-n", name, "link", "set", &peer, "up"]).expect("ip link set up (inside)");
        ip_cmd(&["-n", name, "link", "set", "lo", "up"]).expect("ip link set lo up (inside)");
        netns
    }

    /// The /24, as `allow_networks` lists it.
    fn network(&self) -> String {
        let [a, b, c, _] = self.host.octets();
        format!("{a}.{b}.{c}.0/24")
    }

    /// Nonblocking TCP listeners on `addresses`, created inside the namespace: on a thread of their own that
    /// enters it first (a socket stays in the namespace it was created in; the thread ends with its work).
    fn bind_inside(&self, addresses: &[SocketAddr]) -> std::io::Result<Vec<std::net::TcpListener>> {
        let path = format!("/run/netns/{}", self.name);
        let addresses = addresses.to_vec();
        std::thread::spawn(move || {
            let ns = std::fs::File::open(&path)?;
            nix::sched::setns(&ns, CloneFlags::CLONE_NEWNET)?;
            addresses
                .iter()
                .map(|address| {
                    let listener = std::net::TcpListener::bind(address)?;
                    listener.set_nonblocking(true)?;
                    Ok(listener)
                })
                .collect()
        })
        .join()
        .expect("the thread binding inside the namespace panicked")
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        // Deleting one end deletes the pair; the namespace then holds only its loopback.
        if let Err(e) = ip_cmd(&["link", "del", &self.link]) {
            eprintln!("cannot remove the test interface {}: {e}", self.link);
        }
        if let Err(e) = ip_cmd(&["netns", "del", &self.name]) {
            eprintln!("cannot remove the test namespace {}: {e}", self.name);
        }
    }
}

/// Whether no address of the host lies in 198.18.`a`.0/24.
fn subnet_is_free(a: u8) -> bool {
    let out = std::process::Command::new("ip")
        .args([
            "-4",
            "-o",
            "addr",
            "show",
            "to",
            &format!("198.18.{a}.0/24"),
        ])
        .output()
        .expect("run ip addr show");
    out.status.success() && out.stdout.is_empty()
}

fn ip_cmd(args: &[&str]) -> Result<(), String> {
    let out = std::process::Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| format!("ip {args:?}: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "ip {args:?}: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// A CA, and a certificate for `origin.test` and `denied.test` signed by it.
fn certificates() -> (String, TlsAcceptor) {
    use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyPair};
    let ca_key = KeyPair::generate().unwrap();
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    // Distinct names: a leaf whose issuer equals its subject reads as self-signed.
    ca_params
        .distinguished_name
        .push(DnType::CommonName, "sandboxd egress test CA");
    let ca = ca_params.self_signed(&ca_key).unwrap();
    let key = KeyPair::generate().unwrap();
    let mut leaf_params =
        CertificateParams::new(vec!["origin.test".to_owned(), "denied.test".to_owned()]).unwrap();
    leaf_params
        .distinguished_name
        .push(DnType::CommonName, "origin.test");
    let leaf = leaf_params.signed_by(&key, &ca, &ca_key).unwrap();
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(
            vec![CertificateDer::from(leaf.der().to_vec())],
            PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der())),
        )
        .unwrap();
    (ca.pem(), TlsAcceptor::from(Arc::new(config)))
}

/// A pure-python wheel, zipped by the host's python (the package index serves it to pip inside the sandbox).
fn build_wheel() -> Vec<u8> {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(WHEEL);
    let script = r#"
import sys, zipfile
with zipfile.ZipFile(sys.argv[1], "w") as z:
    z.writestr("egressdemo/__init__.py", "VALUE = 'installed through the proxy'\n")
    z.writestr("egressdemo-1.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: egressdemo\nVersion: 1.0\n")
    z.writestr("egressdemo-1.0.dist-info/WHEEL", "Wheel-Version: 1.0\nGenerator: sandboxd-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
    z.writestr("egressdemo-1.0.dist-info/RECORD", "")
"#;
    let status = std::process::Command::new("/usr/bin/python3")
        .args(["-c", script])
        .arg(&path)
        .status()
        .expect("run python3 to build the test wheel");
    assert!(status.success(), "building the test wheel failed");
    std::fs::read(&path).unwrap()
}

async fn serve(
    listener: TcpListener,
    tls: Option<TlsAcceptor>,
    seen: Arc<Mutex<Vec<String>>>,
    wheel: Bytes,
) {
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            return;
        };
        let (tls, seen, wheel) = (tls.clone(), seen.clone(), wheel.clone());
        tokio::spawn(async move {
            let service = service_fn(move |req| {
                let (seen, wheel) = (seen.clone(), wheel.clone());
                async move { Ok::<_, Infallible>(respond(&req, &seen, &wheel)) }
            });
            let builder = hyper::server::conn::http1::Builder::new();
            let _ = match tls {
                Some(acceptor) => match acceptor.accept(stream).await {
                    Ok(s) => builder.serve_connection(TokioIo::new(s), service).await,
                    Err(_) => return,
                },
                None => {
                    builder
                        .serve_connection(TokioIo::new(stream), service)
                        .await
                }
            };
        });
    }
}

fn respond(
    req: &Request<hyper::body::Incoming>,
    seen: &Mutex<Vec<String>>,
    wheel: &Bytes,
) -> Response<Full<Bytes>> {
    let host = req
        .headers()
        .get(hyper::header::HOST)
        .and_then(|h| h.to_str().ok())
        .unwrap_or("")
        .to_owned();
    let path = req.uri().path().to_owned();
    seen.lock().unwrap().push(format!("{host}{path}"));
    let ok = |body: Bytes| Response::new(Full::new(body));
    match path.as_str() {
        "/hello" => ok(Bytes::from_static(b"hello from origin\n")),
        "/redirect" => Response::builder()
            .status(302)
            .header("location", format!("http://denied.test:{HTTP_PORT}/hello"))
            .body(Full::new(Bytes::new()))
            .unwrap(),
        "/simple/egressdemo/" => Response::builder()
            .header("content-type", "text/html")
            .body(Full::new(Bytes::from(format!(
                "<html><body><a href=\"/files/{WHEEL}\">{WHEEL}</a></body></html>"
            ))))
            .unwrap(),
        p if p == format!("/files/{WHEEL}") => ok(wheel.clone()),
        p => match p
            .strip_prefix("/big/")
            .and_then(|n| n.parse::<usize>().ok())
        {
            Some(n) => ok(Bytes::from(vec![b'x'; n])),
            None => Response::builder()
                .status(404)
                .body(Full::new(Bytes::from_static(b"not found\n")))
                .unwrap(),
        },
    }
}

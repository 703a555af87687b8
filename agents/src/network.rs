//! A sandbox's egress (the daemon's `network` extension): one [`egress::Proxy`] per sandbox, created with the
//! sandbox from its request's `network` and closed when the sandbox is removed, so the allowlist and the counters
//! (and the byte limit) are the sandbox's, across its runs. Each run's container gets its own listener at the
//! host's proxy address inside its network namespace ([`RunContainer::listen_inside`]), served by that one proxy
//! for as long as the run lasts ([`Serving`]), and the proxy environment in the agent's.
//!
//! `POST /sandboxes/<id>/network` swaps the allowlist while runs go on ([`SandboxEgress::set_allow`]): every
//! request after the swap (a new `CONNECT`, a new plain-HTTP request) is checked against the new list; a tunnel
//! already open stays open until either side closes it.
//!
//! With live restore the egress outlives the daemon: `egress.json` in the sandbox's directory ([`EgressRecord`])
//! holds the allowlist in force and the byte limit, and `egress.reserved` the bytes reserved of the limit, written
//! before they may cross (the proxy's [`egress::Ledger`], a chunk of 1/16 of the limit at a time, 4 KiB to 4 MiB).
//! The next daemon makes the proxy again from them ([`SandboxEgress::restore`]), counting every reserved byte as
//! spent: a crash can give back none of the limit, and takes at most a chunk of it.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use agent_api::{SandboxNetwork, SandboxNetworkUsage};
use egress::{AllowlistError, Ledger, Proxy, Reserve};
use protocol::MAX_NETWORK_ALLOW;
use serde::{Deserialize, Serialize};
use tracing::{warn, Instrument};

use crate::host::Network;
use containers::agent::{LongLivedError, RunContainer};

/// Why a sandbox's network request was refused.
#[derive(Debug, thiserror::Error)]
pub enum NetworkError {
    /// The daemon does not serve the `network` extension.
    #[error("Field network: this daemon's network extension is off (network.enabled)")]
    Disabled,
    /// The sandbox was created without `network`: there is no proxy whose list could change.
    #[error("The sandbox was created without network; its network cannot be changed")]
    NotCreatedWith,
    /// More entries than allowed.
    #[error("Field network.allow: {0} entries; at most {MAX_NETWORK_ALLOW} are allowed")]
    TooMany(usize),
    /// An entry is malformed or not within the operator's bound.
    #[error("Field network.allow: {0}")]
    Entry(#[from] AllowlistError),
    /// The new list could not be kept for the next daemon (live restore): it is not in force.
    #[error("Cannot keep the sandbox's network for live restore")]
    Record(#[source] std::io::Error),
    /// `egress_bytes` is above the daemon's maximum.
    #[error("Field network.egress_bytes: {asked} is above the maximum {max}")]
    EgressBytes {
        /// What was asked.
        asked: u64,
        /// `network.egress_bytes_max`.
        max: u64,
    },
}

/// A sandbox's egress proxy, its allowlist as given, and the host's settings it was made with.
pub struct SandboxEgress {
    proxy: Proxy,
    network: Arc<dyn Network>,
    /// The entries in force, as the caller wrote them (the proxy holds them parsed). Held while the proxy's list
    /// is swapped, so the two always agree.
    allow: Mutex<Vec<String>>,
    /// With live restore: where the list and the byte limit's use are kept for the next daemon.
    book: Option<Arc<Book>>,
}

/// The file a sandbox's egress is kept in for the next daemon (live restore), in its directory: the list and the
/// limit.
pub const EGRESS_RECORD: &str = "egress.json";
/// The file of the bytes reserved (8 bytes, little-endian), written in place with one `pwrite` a reservation: a
/// rename over a file (as [`EGRESS_RECORD`] is written) makes ext4 flush the new file's data, milliseconds each,
/// which cost a tunnel a quarter of its throughput at a reservation every 4 MiB.
pub const EGRESS_RESERVED: &str = "egress.reserved";

/// What is kept of a sandbox's egress: [`EGRESS_RECORD`] holds the list and the limit, [`EGRESS_RESERVED`] the
/// bytes reserved.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct EgressRecord {
    /// The allowlist in force, as the caller wrote it.
    pub allow: Vec<String>,
    /// The byte limit.
    pub egress_bytes: u64,
    /// The bytes of it reserved so far: at least the bytes that crossed (in [`EGRESS_RESERVED`]).
    #[serde(skip)]
    pub reserved: u64,
}

/// [`EgressRecord`] on disk: the list and limit written (a temporary file renamed over it) whenever the list
/// changes, the reserved bytes in place whenever more are reserved.
struct Book {
    dir: PathBuf,
    record: Mutex<EgressRecord>,
    /// [`EGRESS_RESERVED`], once opened.
    reserved: Mutex<Option<std::fs::File>>,
}

impl Book {
    fn new(dir: &Path, record: EgressRecord) -> Book {
        Book {
            dir: dir.to_owned(),
            record: Mutex::new(record),
            reserved: Mutex::new(None),
        }
    }

    fn record(&self) -> std::sync::MutexGuard<'_, EgressRecord> {
        self.record.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Changes the list or the limit with `change` and writes them; on error the record is left as it was.
    fn update(&self, change: impl FnOnce(&mut EgressRecord)) -> std::io::Result<()> {
        let mut record = self.record();
        let mut next = record.clone();
        change(&mut next);
        let bytes = serde_json::to_vec(&next).map_err(std::io::Error::other)?;
        crate::restore::write_private(&self.dir, EGRESS_RECORD, &bytes)?;
        *record = next;
        Ok(())
    }

    /// Writes `total` as the bytes reserved, in place.
    fn write_reserved(&self, total: u64) -> std::io::Result<()> {
        use std::os::unix::fs::{FileExt as _, OpenOptionsExt as _};
        let mut file = self.reserved.lock().unwrap_or_else(|p| p.into_inner());
        let file = match &mut *file {
            Some(f) => f,
            None => file.insert(
                std::fs::OpenOptions::new()
                    .write(true)
                    .create(true)
                    .truncate(false)
                    .mode(0o600)
                    .open(self.dir.join(EGRESS_RESERVED))?,
            ),
        };
        file.write_all_at(&total.to_le_bytes(), 0)?;
        self.record().reserved = total;
        Ok(())
    }

    /// The proxy's ledger: what is reserved counts as spent; a chunk of 1/16 of the limit (4 KiB to 4 MiB).
    fn ledger(self: &Arc<Self>) -> Ledger {
        let r = self.record();
        Ledger {
            spent: r.reserved,
            chunk: (r.egress_bytes / 16).clamp(4 << 10, 4 << 20),
            reserve: self.clone(),
        }
    }
}

impl Reserve for Book {
    fn reserve(&self, total: u64) -> std::io::Result<()> {
        self.write_reserved(total)
    }
}

impl SandboxEgress {
    /// The proxy for a creation request's `network`; `network` is the host's (`None`: the extension is off). With
    /// `keep` (live restore), its list and limit are kept in the directory given ([`Self::save`] writes them
    /// first).
    pub fn create(
        network: Option<&Arc<dyn Network>>,
        req: &SandboxNetwork,
        keep: Option<&Path>,
    ) -> Result<SandboxEgress, NetworkError> {
        let network = network.ok_or(NetworkError::Disabled)?.clone();
        let allowlist = checked(&*network, &req.allow)?;
        let egress_bytes =
            network
                .egress_bytes(req.egress_bytes)
                .map_err(|max| NetworkError::EgressBytes {
                    asked: req.egress_bytes.unwrap_or(max),
                    max,
                })?;
        let record = EgressRecord {
            allow: req.allow.clone(),
            egress_bytes,
            reserved: 0,
        };
        Ok(Self::make(network, allowlist, record, keep))
    }

    fn make(
        network: Arc<dyn Network>,
        allowlist: egress::Allowlist,
        record: EgressRecord,
        keep: Option<&Path>,
    ) -> SandboxEgress {
        let (allow, egress_bytes) = (record.allow.clone(), record.egress_bytes);
        let book = keep.map(|dir| Arc::new(Book::new(dir, record)));
        let ledger = book.as_ref().map(Book::ledger);
        SandboxEgress {
            proxy: network.proxy(allowlist, egress_bytes, ledger),
            network,
            allow: Mutex::new(allow),
            book,
        }
    }

    /// The egress a previous daemon kept in `dir` (live restore): its list, checked again against this daemon's
    /// bound (`network.allow_max`), its limit (no more than this daemon's `network.egress_bytes_max`), and every
    /// byte it reserved counted as spent. Why not, when it cannot be.
    pub fn restore(
        network: Option<&Arc<dyn Network>>,
        dir: &Path,
    ) -> Result<SandboxEgress, String> {
        let network = network
            .ok_or_else(|| NetworkError::Disabled.to_string())?
            .clone();
        let bytes = std::fs::read(dir.join(EGRESS_RECORD))
            .map_err(|e| format!("its {EGRESS_RECORD}: {e}"))?;
        let mut record: EgressRecord =
            serde_json::from_slice(&bytes).map_err(|e| format!("its {EGRESS_RECORD}: {e}"))?;
        let reserved = std::fs::read(dir.join(EGRESS_RESERVED))
            .map_err(|e| format!("its {EGRESS_RESERVED}: {e}"))?;
        let reserved: [u8; 8] = reserved
            .try_into()
            .map_err(|_| format!("its {EGRESS_RESERVED}: not 8 bytes"))?;
        record.reserved = u64::from_le_bytes(reserved);
        let allowlist = checked(&*network, &record.allow).map_err(|e| e.to_string())?;
        record.egress_bytes = network
            .egress_bytes(Some(record.egress_bytes))
            .unwrap_or_else(|max| max);
        Ok(Self::make(network, allowlist, record, Some(dir)))
    }

    /// Whether the egress is kept for the next daemon (live restore): its record is written and its proxy reserves
    /// its bytes in it.
    pub fn kept(&self) -> bool {
        self.book.is_some() && self.proxy.has_ledger()
    }

    /// Writes the kept record ([`EGRESS_RECORD`]) as it is now (a sandbox's creation, once its directory exists);
    /// nothing without live restore.
    pub fn save(&self) -> std::io::Result<()> {
        match &self.book {
            Some(book) => {
                let reserved = book.record().reserved;
                book.write_reserved(reserved)?;
                book.update(|_| ())
            }
            None => Ok(()),
        }
    }

    fn allow_guard(&self) -> std::sync::MutexGuard<'_, Vec<String>> {
        self.allow.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Replaces the allowlist (checked against the operator's bound like the one given at creation); the list in
    /// force after it. Requests from then on use it; tunnels already open stay.
    pub fn set_allow(&self, allow: Vec<String>) -> Result<Vec<String>, NetworkError> {
        let allowlist = checked(&*self.network, &allow)?;
        let mut guard = self.allow_guard();
        if let Some(book) = &self.book {
            // Kept first: a next daemon never serves a list this one did not.
            book.update(|r| r.allow = allow.clone())
                .map_err(NetworkError::Record)?;
        }
        self.proxy.set_allowlist(allowlist);
        *guard = allow;
        Ok(guard.clone())
    }

    /// The allowlist in force and the counters so far.
    pub fn usage(&self) -> SandboxNetworkUsage {
        let s = self.proxy.stats();
        SandboxNetworkUsage {
            allow: self.allow_guard().clone(),
            connections: s.connections,
            upstream_connections: s.upstream_connections,
            refused: s.refused,
            bytes_sent: s.bytes_sent,
            bytes_received: s.bytes_received,
        }
    }

    /// The environment that points the agent's HTTP clients at the proxy.
    pub fn environment(&self) -> Vec<(String, String)> {
        self.network.environment()
    }

    /// Serves the proxy inside `run`'s container (before its launch) until the returned [`Serving`] is dropped.
    pub fn serve_in(&self, run: &dyn RunContainer) -> Result<Serving, LongLivedError> {
        let listener = run
            .listen_inside(self.network.address())
            .map_err(LongLivedError::Listen)?;
        let listener = listener
            .set_nonblocking(true)
            .and_then(|()| tokio::net::TcpListener::from_std(listener))
            .map_err(LongLivedError::Listen)?;
        let proxy = self.proxy.clone();
        let span = tracing::info_span!("egress", container = %run.cid());
        let task = tokio::spawn(
            async move {
                if let Err(e) = proxy.serve(listener).await {
                    warn!(error = %e, "egress proxy stopped accepting");
                }
            }
            .instrument(span),
        );
        Ok(Serving(task, self.proxy.clone()))
    }

    /// Ends every tunnel and upstream connection still open (the sandbox is being removed).
    pub fn close(&self) {
        self.proxy.close();
    }
}

/// `allow` within the bound, with at most [`MAX_NETWORK_ALLOW`] entries.
fn checked(network: &dyn Network, allow: &[String]) -> Result<egress::Allowlist, NetworkError> {
    if allow.len() > MAX_NETWORK_ALLOW {
        return Err(NetworkError::TooMany(allow.len()));
    }
    Ok(network.allowlist(allow)?)
}

/// The proxy serving one run's listener; dropping it (the run is over) stops accepting, ends that listener's
/// connections and the tunnels and upstream connections they opened: nothing of a run holds a slot or a socket
/// once it ended (a sandbox has one run at a time).
pub struct Serving(tokio::task::JoinHandle<()>, Proxy);

impl Drop for Serving {
    fn drop(&mut self) {
        self.0.abort();
        self.1.close();
    }
}

#[cfg(test)]
mod tests {
    use std::net::{Ipv4Addr, SocketAddr};
    use std::os::fd::BorrowedFd;

    use egress::{AddressPolicy, Allowlist, ProxyLimits, StaticResolver};
    use nix::sys::signal::Signal;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;
    use containers::agent::{BoxFuture, Ended, RunUsage};

    /// A bound of `*.test:8443`, names resolving to loopback (refused by the address policy but for the exempt
    /// address, if any), 1000 bytes at most.
    struct Bound(Allowlist, Option<SocketAddr>);

    impl Network for Bound {
        fn allowlist(&self, allow: &[String]) -> Result<Allowlist, AllowlistError> {
            Allowlist::parse_within(allow, &self.0)
        }
        fn egress_bytes(&self, asked: Option<u64>) -> Result<u64, u64> {
            match asked {
                Some(n) if n > 1000 => Err(1000),
                n => Ok(n.unwrap_or(1000)),
            }
        }
        fn proxy(
            &self,
            allowlist: Allowlist,
            egress_bytes: u64,
            ledger: Option<egress::Ledger>,
        ) -> Proxy {
            let resolver = StaticResolver::new()
                .with("a.test", [Ipv4Addr::LOCALHOST.into()])
                .with("b.test", [Ipv4Addr::LOCALHOST.into()]);
            let limits = ProxyLimits {
                egress_bytes: Some(egress_bytes),
                ..ProxyLimits::default()
            };
            let policy = match self.1 {
                Some(exempt) => AddressPolicy::new().exempt_for_tests(exempt),
                None => AddressPolicy::new(),
            };
            let resolver = Arc::new(resolver);
            match ledger {
                Some(l) => Proxy::with_ledger(allowlist, policy, resolver, limits, l),
                None => Proxy::new(allowlist, policy, resolver, limits),
            }
        }
        fn address(&self) -> SocketAddr {
            (Ipv4Addr::LOCALHOST, 0).into()
        }
        fn environment(&self) -> Vec<(String, String)> {
            vec![("HTTPS_PROXY".into(), "http://proxy".into())]
        }
    }

    /// A run whose "namespace" is the host's loopback (the port the kernel picked is kept); nothing else of it is
    /// used.
    #[derive(Default)]
    struct Loopback(std::sync::Mutex<Option<SocketAddr>>);

    impl RunContainer for Loopback {
        fn cid(&self) -> &str {
            "run-1"
        }
        fn launch(
            &self,
            _: [BorrowedFd<'_>; 3],
            _: Option<BorrowedFd<'_>>,
        ) -> Result<(), LongLivedError> {
            unreachable!()
        }
        fn signal(&self, _: Signal) {}
        fn freeze(&self) -> BoxFuture<'static, Result<(), LongLivedError>> {
            unreachable!()
        }
        fn thaw(&self) -> BoxFuture<'static, Result<(), LongLivedError>> {
            unreachable!()
        }
        fn set_cpu_quota(&self, _: f64) -> Result<(), LongLivedError> {
            unreachable!()
        }
        fn usage(&self) -> Result<RunUsage, LongLivedError> {
            unreachable!()
        }
        fn listen_inside(&self, address: SocketAddr) -> std::io::Result<std::net::TcpListener> {
            let listener = std::net::TcpListener::bind(address)?;
            *self.0.lock().unwrap() = Some(listener.local_addr()?);
            Ok(listener)
        }
        fn ended(&self) -> BoxFuture<'_, Ended> {
            unreachable!()
        }
        fn remove(&self) -> BoxFuture<'_, ()> {
            unreachable!()
        }
    }

    fn network() -> Arc<dyn Network> {
        Arc::new(Bound(Allowlist::parse(&["*.test:8443"]).unwrap(), None))
    }

    /// A tunnel a run opened ends with the run (its proxy's [`Serving`] dropped), upstream socket and slot
    /// included, not with the sandbox.
    #[tokio::test]
    async fn a_tunnel_ends_with_its_run() {
        let upstream = tokio::net::TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
            .await
            .unwrap();
        let up = upstream.local_addr().unwrap();
        let entry = format!("a.test:{}", up.port());
        let list = Allowlist::parse(&[entry.as_str()]).unwrap();
        let net: Arc<dyn Network> = Arc::new(Bound(list, Some(up)));
        let sb = SandboxEgress::create(Some(&net), &req(&[entry.as_str()], None), None).unwrap();
        let run = Loopback::default();
        let serving = sb.serve_in(&run).unwrap();
        let addr = run.0.lock().unwrap().unwrap();
        let mut client = tokio::net::TcpStream::connect(addr).await.unwrap();
        let head = format!("CONNECT {entry} HTTP/1.1\r\nHost: {entry}\r\n\r\n");
        client.write_all(head.as_bytes()).await.unwrap();
        let mut answer = [0; 12];
        client.read_exact(&mut answer).await.unwrap();
        assert_eq!(&answer, b"HTTP/1.1 200");
        let request = format!("GET / HTTP/1.1\r\nHost: {entry}\r\n\r\n");
        client.write_all(request.as_bytes()).await.unwrap();
        let (mut server, _) = upstream.accept().await.unwrap();
        let mut got = [0; 5];
        server.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"GET /");
        drop(serving);
        let mut rest = Vec::new();
        let end = tokio::time::timeout(
            std::time::Duration::from_secs(5),
            server.read_to_end(&mut rest),
        )
        .await;
        assert!(end.is_ok(), "the upstream connection outlives the run");
        sb.close();
    }

    fn req(allow: &[&str], egress_bytes: Option<u64>) -> SandboxNetwork {
        SandboxNetwork {
            allow: allow.iter().map(|s| s.to_string()).collect(),
            egress_bytes,
        }
    }

    #[test]
    fn creation_is_checked_against_the_host() {
        let net = network();
        let e = SandboxEgress::create(None, &req(&["a.test:8443"], None), None).err();
        assert!(matches!(e, Some(NetworkError::Disabled)), "{e:?}");
        let e = SandboxEgress::create(Some(&net), &req(&["a.test:443"], None), None).err();
        assert!(
            matches!(e, Some(NetworkError::Entry(AllowlistError::NotCovered(_)))),
            "{e:?}"
        );
        let e = SandboxEgress::create(Some(&net), &req(&["a.test:8443"], Some(1001)), None).err();
        assert!(
            matches!(
                e,
                Some(NetworkError::EgressBytes {
                    asked: 1001,
                    max: 1000
                })
            ),
            "{e:?}"
        );
        let many: Vec<String> = (0..=MAX_NETWORK_ALLOW)
            .map(|i| format!("n{i}.test:8443"))
            .collect();
        let many: Vec<&str> = many.iter().map(String::as_str).collect();
        let e = SandboxEgress::create(Some(&net), &req(&many, None), None).err();
        assert!(matches!(e, Some(NetworkError::TooMany(_))), "{e:?}");
        let sb = SandboxEgress::create(Some(&net), &req(&[], None), None).unwrap();
        assert!(sb.usage().allow.is_empty());
        assert_eq!(sb.environment()[0].0, "HTTPS_PROXY");
    }

    /// Kept (live restore): the list and the limit are written at creation and at every change of the list; the
    /// next daemon's proxy has the list in force and counts every reserved byte as spent; a list outside this
    /// daemon's bound, a missing record or the extension off is refused.
    #[tokio::test]
    async fn a_kept_egress_is_made_again_from_its_record() {
        let net = network();
        let t = tempfile::tempdir().unwrap();
        let sb = SandboxEgress::create(
            Some(&net),
            &req(&["a.test:8443"], Some(900)),
            Some(t.path()),
        )
        .unwrap();
        sb.save().unwrap();
        let read = || -> EgressRecord {
            serde_json::from_slice(&std::fs::read(t.path().join(EGRESS_RECORD)).unwrap()).unwrap()
        };
        assert_eq!(
            read(),
            EgressRecord {
                allow: vec!["a.test:8443".into()],
                egress_bytes: 900,
                reserved: 0
            }
        );
        sb.set_allow(vec!["b.test:8443".into()]).unwrap();
        assert_eq!(read().allow, ["b.test:8443"]);
        // Refused lists are not written.
        assert!(sb.set_allow(vec!["b.test:443".into()]).is_err());
        assert_eq!(read().allow, ["b.test:8443"]);
        // The reservations as the proxy makes them.
        let book = sb.book.clone().unwrap();
        let ledger = book.ledger();
        assert_eq!((ledger.spent, ledger.chunk), (0, 4096));
        ledger.reserve.reserve(700).unwrap();
        let reserved = std::fs::read(t.path().join(EGRESS_RESERVED)).unwrap();
        assert_eq!(reserved, 700u64.to_le_bytes());

        let again = SandboxEgress::restore(Some(&net), t.path()).unwrap();
        assert_eq!(again.usage().allow, ["b.test:8443"]);
        assert_eq!(again.book.as_ref().unwrap().ledger().spent, 700);
        let run = Loopback::default();
        let _serving = again.serve_in(&run).unwrap();
        let addr = run.0.lock().unwrap().unwrap();
        let b = connect(addr, "b.test:8443").await;
        assert!(b.contains("resolves only to refused addresses"), "{b}");
        // 700 of 900 spent: a request still goes through the checks; at 900 the limit refuses it.
        again.book.as_ref().unwrap().reserve(900).unwrap();
        let used_up = SandboxEgress::restore(Some(&net), t.path()).unwrap();
        let run = Loopback::default();
        let _serving = used_up.serve_in(&run).unwrap();
        let addr = run.0.lock().unwrap().unwrap();
        let b = connect(addr, "b.test:8443").await;
        assert!(b.contains("byte limit"), "{b}");

        let mut wide = read();
        wide.allow = vec!["c.example:443".into()];
        std::fs::write(
            t.path().join(EGRESS_RECORD),
            serde_json::to_vec(&wide).unwrap(),
        )
        .unwrap();
        let e = SandboxEgress::restore(Some(&net), t.path()).err().unwrap();
        assert!(e.contains("network.allow"), "{e}");
        // Without its reserved bytes it is not made again (they would count as none).
        wide.allow = vec!["b.test:8443".into()];
        std::fs::write(
            t.path().join(EGRESS_RECORD),
            serde_json::to_vec(&wide).unwrap(),
        )
        .unwrap();
        assert!(SandboxEgress::restore(Some(&net), t.path()).is_ok());
        std::fs::remove_file(t.path().join(EGRESS_RESERVED)).unwrap();
        let e = SandboxEgress::restore(Some(&net), t.path()).err().unwrap();
        assert!(e.contains(EGRESS_RESERVED), "{e}");
        assert!(SandboxEgress::restore(None, t.path()).is_err());
        let empty = tempfile::tempdir().unwrap();
        let e = SandboxEgress::restore(Some(&net), empty.path())
            .err()
            .unwrap();
        assert!(e.contains(EGRESS_RECORD), "{e}");
    }

    /// Sends a CONNECT to the proxy on `addr` and returns the answer's status line and body.
    async fn connect(addr: SocketAddr, target: &str) -> String {
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        let head =
            format!("CONNECT {target} HTTP/1.1\r\nHost: {target}\r\nConnection: close\r\n\r\n");
        s.write_all(head.as_bytes()).await.unwrap();
        let mut out = Vec::new();
        s.read_to_end(&mut out).await.unwrap();
        String::from_utf8_lossy(&out).into_owned()
    }

    #[tokio::test]
    async fn a_new_list_applies_to_the_next_request_and_a_bad_one_changes_nothing() {
        let net = network();
        let sb = SandboxEgress::create(Some(&net), &req(&["a.test:8443"], None), None).unwrap();
        let run = Loopback::default();
        let serving = sb.serve_in(&run).unwrap();
        let addr = run.0.lock().unwrap().unwrap();
        // Listed, but it resolves to loopback: refused for the address, not the list.
        let a = connect(addr, "a.test:8443").await;
        assert!(a.contains("resolves only to refused addresses"), "{a}");
        let b = connect(addr, "b.test:8443").await;
        assert!(b.contains("not on the allowlist"), "{b}");

        let bad = sb.set_allow(vec!["b.test:443".into()]).unwrap_err();
        assert!(bad.to_string().starts_with("Field network.allow:"), "{bad}");
        assert_eq!(sb.usage().allow, ["a.test:8443"]);
        assert_eq!(
            sb.set_allow(vec!["b.test:8443".into()]).unwrap(),
            ["b.test:8443"]
        );
        let a = connect(addr, "a.test:8443").await;
        assert!(a.contains("not on the allowlist"), "{a}");
        let b = connect(addr, "b.test:8443").await;
        assert!(b.contains("resolves only to refused addresses"), "{b}");

        let u = sb.usage();
        assert_eq!(
            (u.connections, u.refused, u.upstream_connections),
            (4, 4, 0)
        );
        assert_eq!(u.allow, ["b.test:8443"]);
        // The run is over: its listener is closed.
        drop(serving);
        tokio::task::yield_now().await;
        for _ in 0..100 {
            if tokio::net::TcpStream::connect(addr).await.is_err() {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        assert!(tokio::net::TcpStream::connect(addr).await.is_err());
        sb.close();
    }
}

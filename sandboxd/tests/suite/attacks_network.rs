//! Adversarial suite, network: executions have a network namespace of their own with only `lo`. Egress to a
//! public address and to the host's own address fails, a port (TCP, UDP) or abstract unix socket the TEST opens on
//! the host is never reached (127.0.0.1 inside is the sandbox's own loopback), a listener inside is not reachable
//! from the host, and loopback inside works.

use std::io::Read;
use std::net::{TcpListener, UdpSocket};
use std::os::linux::net::SocketAddrExt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use protocol::ExecStatus;
use serde_json::json;

use super::attack::{json_of, Arena};
use super::harness::{exec_json, privileged, stdout_contains, DaemonOpts};

/// A TCP and a UDP port and an abstract unix socket on the host, counting whatever reaches them.
struct HostListeners {
    tcp_port: u16,
    udp_port: u16,
    abstract_name: String,
    hits: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl HostListeners {
    fn start() -> HostListeners {
        let hits = Arc::new(AtomicU64::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let mut threads = Vec::new();

        // Listens on every address, so the host's own external address is covered too.
        let tcp = TcpListener::bind("0.0.0.0:0").expect("bind a host TCP port");
        tcp.set_nonblocking(true).unwrap();
        let tcp_port = tcp.local_addr().unwrap().port();
        let udp = UdpSocket::bind("0.0.0.0:0").expect("bind a host UDP port");
        udp.set_read_timeout(Some(Duration::from_millis(50)))
            .unwrap();
        let udp_port = udp.local_addr().unwrap().port();
        let abstract_name = format!("sandboxd-test-{}", super::harness::unique_marker());
        let addr =
            std::os::unix::net::SocketAddr::from_abstract_name(abstract_name.as_bytes()).unwrap();
        let unix =
            std::os::unix::net::UnixListener::bind_addr(&addr).expect("bind an abstract socket");
        unix.set_nonblocking(true).unwrap();

        let (h, s) = (hits.clone(), stop.clone());
        threads.push(std::thread::spawn(move || {
            let mut buf = [0u8; 64];
            while !s.load(Ordering::SeqCst) {
                if tcp.accept().is_ok() {
                    h.fetch_add(1, Ordering::SeqCst);
                }
                if unix.accept().is_ok() {
                    h.fetch_add(1, Ordering::SeqCst);
                }
                if udp.recv_from(&mut buf).is_ok() {
                    h.fetch_add(1, Ordering::SeqCst);
                }
            }
        }));
        HostListeners {
            tcp_port,
            udp_port,
            abstract_name,
            hits,
            stop,
            threads,
        }
    }

    /// Checks the listeners themselves work (from the host), then resets the count.
    fn self_test(&self) {
        let mut s = std::net::TcpStream::connect(("127.0.0.1", self.tcp_port)).unwrap();
        let _ = s.read(&mut [0u8; 0]);
        UdpSocket::bind("127.0.0.1:0")
            .unwrap()
            .send_to(b"x", ("127.0.0.1", self.udp_port))
            .unwrap();
        let addr =
            std::os::unix::net::SocketAddr::from_abstract_name(self.abstract_name.as_bytes())
                .unwrap();
        std::os::unix::net::UnixStream::connect_addr(&addr).unwrap();
        let start = std::time::Instant::now();
        while self.hits.load(Ordering::SeqCst) < 3 {
            assert!(
                start.elapsed() < Duration::from_secs(5),
                "the host listeners do not see the host's own connections"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        self.hits.store(0, Ordering::SeqCst);
    }
}

impl Drop for HostListeners {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// The host's address on its default route (no packet is sent to find it), if it has one.
fn host_external_ip() -> Option<String> {
    let s = UdpSocket::bind("0.0.0.0:0").ok()?;
    s.connect("1.1.1.1:53").ok()?;
    let ip = s.local_addr().ok()?.ip();
    (!ip.is_loopback() && !ip.is_unspecified()).then(|| ip.to_string())
}

const PY_NET: &str = r#"
import errno, json, os, socket
def tcp(host, port, family=socket.AF_INET):
    s = socket.socket(family, socket.SOCK_STREAM)
    s.settimeout(3)
    try:
        s.connect((host, port))
        return "connected"
    except OSError as e:
        return errno.errorcode.get(e.errno, str(e.errno)) if e.errno else repr(e)
    finally:
        s.close()
def udp(host, port, family=socket.AF_INET):
    s = socket.socket(family, socket.SOCK_DGRAM)
    try:
        s.sendto(b"escape", (host, port))
        return "sent"
    except OSError as e:
        return errno.errorcode.get(e.errno, str(e.errno))
    finally:
        s.close()
out = {}
"#;

#[tokio::test]
async fn egress_and_the_hosts_ports_are_unreachable() {
    let Some(_g) = privileged("egress_and_the_hosts_ports_are_unreachable").await else {
        return;
    };
    let mut a = Arena::start("network", DaemonOpts::default()).await;
    let host = HostListeners::start();
    host.self_test();
    let ext = host_external_ip();

    // Public addresses.
    let case = "egress to public addresses";
    let code = format!(
        r#"{PY_NET}
out["tcp 1.1.1.1:53"] = tcp("1.1.1.1", 53)
out["tcp 8.8.8.8:443"] = tcp("8.8.8.8", 443)
out["udp 1.1.1.1:53"] = udp("1.1.1.1", 53)
out["tcp6 [2606:4700:4700::1111]:53"] = tcp("2606:4700:4700::1111", 53, socket.AF_INET6)
try:
    out["dns example.com"] = socket.getaddrinfo("example.com", 80)[0][4][0]
except OSError as e:
    out["dns example.com"] = "failed"
print(json.dumps(out))
"#
    );
    let out = a.attack_py(case, &code, json!({})).await;
    for (k, v) in [
        ("tcp 1.1.1.1:53", "ENETUNREACH"),
        ("tcp 8.8.8.8:443", "ENETUNREACH"),
        ("udp 1.1.1.1:53", "ENETUNREACH"),
        ("tcp6 [2606:4700:4700::1111]:53", "ENETUNREACH"),
        ("dns example.com", "failed"),
    ] {
        assert_eq!(out[k], v, "{case}: {k}: {out}");
    }
    a.contained(case);

    // The ports the test opened on the host, the daemon's own port, the host's external address.
    let case = "host loopback ports";
    let code = format!(
        r#"{PY_NET}
out["tcp"] = tcp("127.0.0.1", {tcp})
out["udp"] = udp("127.0.0.1", {udp})
out["daemon"] = tcp("127.0.0.1", {daemon})
out["tcp6 ::1"] = tcp("::1", {tcp}, socket.AF_INET6)
ext = {ext:?}
if ext:
    out["external tcp"] = tcp(ext, {tcp})
    out["external udp"] = udp(ext, {udp})
u = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
try:
    u.connect("\0{name}")
    out["abstract"] = "connected"
except OSError as e:
    out["abstract"] = errno.errorcode.get(e.errno, str(e.errno))
print(json.dumps(out))
"#,
        tcp = host.tcp_port,
        udp = host.udp_port,
        daemon = a.d.port,
        name = host.abstract_name,
        ext = ext.clone().unwrap_or_default(),
    );
    let out = a.attack_py(case, &code, json!({})).await;
    // Give a stray packet time to arrive before counting.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        host.hits.load(Ordering::SeqCst),
        0,
        "{case}: the host's listeners were reached from the sandbox: {out}"
    );
    for k in ["tcp", "daemon", "tcp6 ::1"] {
        assert_eq!(
            out[k], "ECONNREFUSED",
            "{case}: {k} hits the sandbox's own loopback: {out}"
        );
    }
    // Sending a datagram to one's own closed loopback port "works"; it just never leaves the namespace.
    assert_eq!(out["udp"], "sent", "{case}: {out}");
    assert_eq!(
        out["abstract"], "ECONNREFUSED",
        "{case}: abstract unix sockets are per network namespace: {out}"
    );
    if ext.is_some() {
        assert_eq!(out["external tcp"], "ENETUNREACH", "{case}: {out}");
        assert_eq!(out["external udp"], "ENETUNREACH", "{case}: {out}");
    }
    a.contained(case);
    a.finish();
}

/// The interfaces as libc, netlink (`NETLINK_ROUTE`, read-only without `CAP_NET_ADMIN`), `ip`, `/proc` and node
/// list them: `lo` only.
async fn only_loopback_is_listed(a: &mut Arena) {
    let case = "interfaces";
    let code = format!(
        r#"{PY_NET}
# if_nameindex(3) asks netlink (NETLINK_ROUTE, which the profile allows); SIOCGIFCONF asks the kernel directly.
try:
    out["if_nameindex"] = [n for _, n in socket.if_nameindex()]
except OSError as e:
    out["if_nameindex"] = errno.errorcode[e.errno]
import subprocess
ip = lambda *a: subprocess.run(["ip", *a], capture_output=True, text=True)
out["ip -o link"] = [l.split(":")[1].strip() for l in ip("-o", "link").stdout.splitlines()]
# Changes through NETLINK_ROUTE need CAP_NET_ADMIN, which the program does not have.
r = ip("link", "add", "d0", "type", "dummy")
out["ip link add"] = [r.returncode, r.stderr.strip()]
r = ip("link", "set", "lo", "down")
out["ip link set lo down"] = [r.returncode, r.stderr.strip()]
import array, fcntl, struct
s = socket.socket()
buf = array.array("B", b"\0" * 40 * 32)
n = struct.unpack("iL", fcntl.ioctl(s, 0x8912, struct.pack("iL", len(buf), buf.buffer_info()[0])))[0]
out["ifconf"] = sorted(buf.tobytes()[i:i + 16].split(b"\0")[0].decode() for i in range(0, n, 40))
out["proc_net_dev"] = sorted(l.split(":")[0].strip() for l in open("/proc/net/dev").read().splitlines()[2:])
out["routes"] = open("/proc/net/route").read().splitlines()[1:]
flags = struct.unpack("16sH", fcntl.ioctl(s, 0x8913, struct.pack("16sH", b"lo", 0)))[1]
out["lo_up"] = bool(flags & 1)
out["sys_class_net"] = os.path.exists("/sys/class/net")
print(json.dumps(out))
"#
    );
    let out = a.attack_py(case, &code, json!({})).await;
    assert_eq!(out["if_nameindex"], json!(["lo"]), "{case}: {out}");
    assert_eq!(out["ip -o link"], json!(["lo"]), "{case}: {out}");
    for change in ["ip link add", "ip link set lo down"] {
        assert_eq!(
            out[change],
            json!([2, "RTNETLINK answers: Operation not permitted"]),
            "{case}: {change}: {out}"
        );
    }
    assert_eq!(out["ifconf"], json!(["lo"]), "{case}: {out}");
    assert_eq!(out["proc_net_dev"], json!(["lo"]), "{case}: {out}");
    assert_eq!(
        out["routes"],
        json!([]),
        "{case}: no IPv4 route but loopback's: {out}"
    );
    assert_eq!(out["lo_up"], true, "{case}: {out}");
    a.contained(case);

    // node's os.networkInterfaces() reads NETLINK_ROUTE (through getifaddrs(3)); it throws without it.
    let case = "node os.networkInterfaces()";
    let code = "let o = {}; try { o.ifaces = Object.keys(require('os').networkInterfaces()) } \
                catch (e) { o.ifaces = e.message } console.log(JSON.stringify(o))";
    let r = a
        .attack(case, |id| exec_json(id, "javascript", code, 60_000, 256))
        .await;
    let out = json_of(case, &r);
    assert_eq!(out["ifaces"], json!(["lo"]), "{case}: {out}");
    a.contained(case);
}

#[tokio::test]
async fn only_loopback_exists_and_works_inside() {
    let Some(_g) = privileged("only_loopback_exists_and_works_inside").await else {
        return;
    };
    let mut a = Arena::start("network", DaemonOpts::default()).await;

    only_loopback_is_listed(&mut a).await;

    // A server and a client inside one execution, TCP and UDP, IPv4 and IPv6.
    let case = "loopback inside";
    let code = format!(
        r#"{PY_NET}
import threading
def echo_tcp(family, host):
    srv = socket.socket(family, socket.SOCK_STREAM)
    srv.bind((host, 0)); srv.listen(1)
    port = srv.getsockname()[1]
    def serve():
        c, _ = srv.accept(); c.sendall(c.recv(100).upper()); c.close()
    t = threading.Thread(target=serve); t.start()
    c = socket.socket(family, socket.SOCK_STREAM); c.settimeout(5)
    c.connect((host, port)); c.sendall(b"hello"); r = c.recv(100).decode(); t.join()
    return r
def echo_udp():
    a = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); a.bind(("127.0.0.1", 0))
    b = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); b.settimeout(5)
    b.sendto(b"dgram", a.getsockname())
    return a.recv(100).decode()
out["tcp4"] = echo_tcp(socket.AF_INET, "127.0.0.1")
out["tcp6"] = echo_tcp(socket.AF_INET6, "::1")
out["udp"] = echo_udp()
out["localhost"] = socket.gethostbyname("localhost")
print(json.dumps(out))
"#
    );
    let out = a.attack_py(case, &code, json!({})).await;
    assert_eq!(
        out,
        json!({"tcp4": "HELLO", "tcp6": "HELLO", "udp": "dgram", "localhost": "127.0.0.1"}),
        "{case}"
    );
    a.contained(case);

    // A listener inside is not a port on the host.
    let case = "listener inside is not on the host";
    let port = super::harness::free_port();
    let id = a.id(case);
    let watch = a.watch().await;
    let code = format!(
        "import socket, time\ns = socket.socket()\ns.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n\
         s.bind(('0.0.0.0', {port}))\ns.listen(5)\nprint('listening', flush=True)\ntime.sleep(3)\n"
    );
    a.c.send_json(&exec_json(&id, "python", &code, 20_000, 128))
        .await;
    a.c.observe("the sandbox to listen", stdout_contains(&id, "listening"))
        .await;
    let from_host = std::net::TcpStream::connect_timeout(
        &format!("127.0.0.1:{port}").parse().unwrap(),
        Duration::from_secs(2),
    );
    let r = a.c.collect(&id).await;
    a.watched(watch, case);
    a.after(case).await;
    assert_eq!(
        r.terminal_status(),
        Some(ExecStatus::Completed),
        "{case}: {}",
        r.dump()
    );
    let refused = match &from_host {
        Err(e) => e.kind() == std::io::ErrorKind::ConnectionRefused,
        Ok(_) => false,
    };
    assert!(
        refused,
        "{case}: the host reached the sandbox's listener on port {port}: {from_host:?}"
    );
    a.contained(case);
    a.finish();
}

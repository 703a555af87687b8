//! The `network` extension against a real daemon: an execution reaches the hosts its request lists through the
//! daemon's egress proxy (real clients: python's urllib and requests, pip, curl, node's fetch), and every other way
//! out is refused and logged. The origins are in a network namespace the test creates ([`super::egress_origin`]),
//! on a network the daemon's `network.allow_networks` lists; the host's own address in it stays refused.

use base64::engine::general_purpose::STANDARD;
use base64::Engine as _;
use protocol::ErrorCode;
use serde_json::{json, Value};

use super::egress_origin::{Origin, HTTPS_PORT, HTTP_PORT};
use super::harness::*;

/// The entries every execution here lists (`denied.test` resolves to the origins too, and is never listed;
/// `hostside.test` resolves to the host's end of the veth pair, inside the allowed network, and is refused).
fn allow() -> Value {
    json!([
        format!("origin.test:{HTTPS_PORT}"),
        format!("origin.test:{HTTP_PORT}"),
        format!("rebind.test:{HTTPS_PORT}"),
        format!("meta.test:{HTTP_PORT}"),
        format!("private.test:{HTTP_PORT}"),
        format!("hostside.test:{HTTP_PORT}"),
    ])
}

/// An execute with `network` and the CA file in the working directory.
fn exec_net(id: &str, language: &str, code: &str, origin: &Origin, network: Value) -> Value {
    with(
        exec_json(id, language, code, 60_000, 512),
        json!({
            "network": network,
            "files": [{"path": "ca.pem", "content": origin.ca_pem}],
        }),
    )
}

/// Nothing of any execution is left once the pool has refilled.
async fn no_leftovers(d: &Daemon) {
    wait_until(
        "nothing left of the executions",
        std::time::Duration::from_secs(20),
        || d.leftovers(),
    )
    .await;
}

/// Asserts that the run printed each of `lines`, and returns its `result.network`.
fn printed_and_counted(run: &Collected, lines: &[&str]) -> protocol::NetworkUsage {
    let out = run.stdout_text();
    for line in lines {
        assert!(out.contains(line), "missing {line:?} in:\n{}", run.dump());
    }
    run.result()
        .network
        .as_deref()
        .copied()
        .expect("result.network")
}

const CLIENTS: &str = r#"
import os, ssl, subprocess, sys, urllib.request
print("proxy", os.environ.get("HTTPS_PROXY"))
ctx = ssl.create_default_context(cafile="ca.pem")
with urllib.request.urlopen("https://origin.test:@HTTPS@/hello", context=ctx, timeout=20) as r:
    print("urllib https", r.status, r.read().decode().strip())
with urllib.request.urlopen("http://origin.test:@HTTP@/hello", timeout=20) as r:
    print("urllib http", r.status, r.read().decode().strip())
import requests
r = requests.get("https://origin.test:@HTTPS@/hello", verify="ca.pem", timeout=20)
print("requests https", r.status_code, r.text.strip())
pip = subprocess.run([sys.executable, "-m", "pip", "install", "--no-cache-dir", "--disable-pip-version-check",
    "--target", "pkgs", "--cert", "ca.pem", "--index-url", "https://origin.test:@HTTPS@/simple/", "egressdemo"],
    capture_output=True, text=True)
print("pip exit", pip.returncode, pip.stderr[-600:] if pip.returncode else "")
sys.path.insert(0, "pkgs")
import egressdemo
print("pip installed:", egressdemo.VALUE)
"#;

fn ports(code: &str) -> String {
    code.replace("@HTTPS@", &HTTPS_PORT.to_string())
        .replace("@HTTP@", &HTTP_PORT.to_string())
}

#[tokio::test(flavor = "multi_thread")]
async fn listed_hosts_are_reached_through_the_proxy_by_real_clients() {
    let Some(_g) = privileged("listed_hosts_are_reached_through_the_proxy_by_real_clients").await
    else {
        return;
    };
    let origin = Origin::start().await;
    let d = origin.daemon(64 << 20, json!({})).await;
    let mut c = Client::connect(&d).await;
    let pong = c.ping().await;
    let extensions = pong.capabilities.expect("capabilities").extensions;
    assert!(extensions.iter().any(|e| e == "network"), "{extensions:?}");

    c.send_json(&exec_net(
        "py",
        "python",
        &ports(CLIENTS),
        &origin,
        json!({"allow": allow()}),
    ))
    .await;
    let py = c.collect("py").await;
    let net = printed_and_counted(
        &py,
        &[
            "proxy http://127.0.0.1:3128",
            "urllib https 200 hello from origin",
            "urllib http 200 hello from origin",
            "requests https 200 hello from origin",
            "pip exit 0",
            "pip installed: installed through the proxy",
        ],
    );
    // urllib twice, requests once, pip at least once (its index page and wheel may share a tunnel).
    assert!(net.connections >= 4, "{net:?}");
    assert!(net.upstream_connections >= 4, "{net:?}");
    assert_eq!(net.refused, 0, "{net:?}");
    assert!(net.bytes_received > 1000 && net.bytes_sent > 100, "{net:?}");

    let curl = "curl -sS --cacert ca.pem https://origin.test:@HTTPS@/hello && curl -sS http://origin.test:@HTTP@/hello";
    c.send_json(&exec_net(
        "sh",
        "shell",
        &ports(curl),
        &origin,
        json!({"allow": allow()}),
    ))
    .await;
    let sh = c.collect("sh").await;
    assert_eq!(
        sh.stdout_text(),
        "hello from origin\nhello from origin\n",
        "{}",
        sh.dump()
    );
    assert_eq!(
        sh.result()
            .network
            .as_deref()
            .expect("result.network")
            .upstream_connections,
        2
    );

    let seen = origin.seen();
    assert!(
        seen.iter().all(|s| s.starts_with("origin.test")),
        "only origin.test reached the origins: {seen:?}"
    );
    assert!(
        seen.iter()
            .any(|s| s.ends_with(super::egress_origin::WHEEL)),
        "{seen:?}"
    );
    no_leftovers(&d).await;
}

/// Node's `fetch` through the proxy. Node 20 (Debian's) has no `NODE_USE_ENV_PROXY`: its fetch (undici) reaches a
/// proxy once undici's `EnvHttpProxyAgent`, which reads `HTTPS_PROXY`/`HTTP_PROXY`/`NO_PROXY`, is the global
/// dispatcher. Without it, fetch has no way out at all.
const NODE_FETCH: &str = r#"
const { execFileSync } = require("child_process");
const fs = require("fs");
execFileSync("tar", ["xzf", "undici.tgz"]);
const undici = require(require("path").resolve("package"));
const ca = fs.readFileSync("ca.pem");
async function get(url) {
  try {
    const r = await fetch(url, { signal: AbortSignal.timeout(20000) });
    return `${r.status} ${(await r.text()).trim()}`;
  } catch (e) {
    return `refused (${e.cause ? e.cause.code || e.cause.message : e.message})`;
  }
}
(async () => {
  console.log("without the agent:", await get("http://origin.test:@HTTP@/hello"));
  undici.setGlobalDispatcher(new undici.EnvHttpProxyAgent({ requestTls: { ca } }));
  console.log("fetch https", await get("https://origin.test:@HTTPS@/hello"));
  console.log("fetch http", await get("http://origin.test:@HTTP@/hello"));
  console.log("fetch not listed", await get("https://denied.test:@HTTPS@/hello"));
})();
"#;

/// undici's npm tarball (`tests/fixtures/undici.sh` fetches it, pinned and checked; `.ci/run` sets the variable).
fn undici_tarball(test: &str) -> Option<Vec<u8>> {
    let Ok(path) = std::env::var("SANDBOXD_TEST_UNDICI") else {
        cannot_run(
            test,
            "SANDBOXD_TEST_UNDICI is not set (SANDBOXD_TEST_UNDICI=$(tests/fixtures/undici.sh))",
        );
        return None;
    };
    Some(std::fs::read(&path).unwrap_or_else(|e| panic!("SANDBOXD_TEST_UNDICI {path}: {e}")))
}

#[tokio::test(flavor = "multi_thread")]
async fn node_fetch_goes_through_the_proxy() {
    const TEST: &str = "node_fetch_goes_through_the_proxy";
    let Some(_g) = privileged(TEST).await else {
        return;
    };
    let Some(undici) = undici_tarball(TEST) else {
        return;
    };
    let origin = Origin::start().await;
    let d = origin.daemon(64 << 20, json!({})).await;
    let mut c = Client::connect(&d).await;
    let mut request = exec_net(
        "node",
        "javascript",
        &ports(NODE_FETCH),
        &origin,
        json!({"allow": allow()}),
    );
    request["files"].as_array_mut().expect("files").push(
        json!({"path": "undici.tgz", "content": STANDARD.encode(&undici), "encoding": "base64"}),
    );
    c.send_json(&request).await;
    let run = c.collect("node").await;
    println!("{}", run.stdout_text());
    let net = printed_and_counted(
        &run,
        &[
            "without the agent: refused (",
            "fetch https 200 hello from origin",
            "fetch http 200 hello from origin",
            "fetch not listed refused (",
        ],
    );
    assert_eq!(net.upstream_connections, 2, "{net:?}");
    assert!(net.refused >= 1, "{net:?}");
    assert!(
        d.log().lines().any(|l| l.contains("egress refused")
            && l.contains("denied.test")
            && l.contains("is not on the allowlist")),
        "no log line for the name not listed"
    );
    let seen = origin.seen();
    assert!(
        seen.iter().all(|s| s.starts_with("origin.test")),
        "only origin.test reached the origins: {seen:?}"
    );
    no_leftovers(&d).await;
}

const BYPASSES: &str = r#"
import socket, ssl, urllib.request
CA = "ca.pem"
IP = "@IP@"
def fetch(url):
    try:
        ctx = ssl.create_default_context(cafile=CA)
        with urllib.request.urlopen(url, context=ctx, timeout=15) as r:
            return "REACHED %d %r" % (r.status, r.read()[:40])
    except Exception as e:
        return "refused (%s)" % str(e)[:100]
def connect(addr, family=socket.AF_INET, kind=socket.SOCK_STREAM):
    try:
        s = socket.socket(family, kind)
        s.settimeout(3)
        if kind == socket.SOCK_DGRAM:
            s.sendto(b"\x12\x34\x01\x00\x00\x01\x00\x00\x00\x00\x00\x00\x06origin\x04test\x00\x00\x01\x00\x01", addr)
            s.recv(512)
        else:
            s.connect(addr)
        return "REACHED"
    except Exception as e:
        return "refused (%s)" % e
def proxy_raw(data):
    p = socket.create_connection(("127.0.0.1", 3128), timeout=15)
    p.sendall(data)
    got = b""
    try:
        while True:
            chunk = p.recv(65536)
            if not chunk:
                break
            got += chunk
    except socket.timeout:
        pass
    return got
def tunnel(target, sni):
    p = socket.create_connection(("127.0.0.1", 3128), timeout=15)
    p.sendall(b"CONNECT %s HTTP/1.1\r\nHost: %s\r\n\r\n" % (target.encode(), target.encode()))
    head = p.recv(4096)
    status = head.split(b" ")[1].decode()
    if status != "200":
        return "refused (CONNECT %s)" % status
    try:
        ctx = ssl.create_default_context(cafile=CA)
        ctx.check_hostname = False
        s = ctx.wrap_socket(p, server_hostname=sni)
        s.sendall(b"GET /hello HTTP/1.1\r\nHost: %s\r\nConnection: close\r\n\r\n" % sni.encode())
        data = s.recv(200)
        return "REACHED %r" % data[:40] if data else "refused (closed)"
    except Exception as e:
        return "refused (%s)" % e
def smuggled(response):
    # The first request (to a listed name) may be answered; a second answer would be the smuggled one's.
    n = response.count(b"hello from origin")
    return "REACHED" if n > 1 else "refused (%d answers from the origin)" % n
def status_of(response):
    line = response.split(b"\r\n", 1)[0]
    return "REACHED" if b" 200 " in line + b" " and b"hello from origin" in response else "refused (%r)" % line[:60]
checks = {
    "name not listed": fetch("https://denied.test:@HTTPS@/hello"),
    "redirect to a name not listed": fetch("http://origin.test:@HTTP@/redirect"),
    "direct TCP to the origin": connect((IP, @HTTPS@)),
    "direct UDP DNS query": connect((IP, 53), kind=socket.SOCK_DGRAM),
    "DNS from the sandbox": connect(("8.8.8.8", 53), kind=socket.SOCK_DGRAM),
    "IPv6": connect(("2001:db8::1", 443), family=socket.AF_INET6),
    "CONNECT to an IP literal": tunnel("%s:@HTTPS@" % IP, "origin.test"),
    "CONNECT to a port not listed": tunnel("origin.test:22", "origin.test"),
    "SNI of a name not listed (fronting)": tunnel("origin.test:@HTTPS@", "denied.test"),
    "CONNECT to a name not listed with a listed SNI": tunnel("denied.test:@HTTPS@", "origin.test"),
    "name rebound to loopback": fetch("https://rebind.test:@HTTPS@/hello"),
    "name at the metadata address": fetch("http://meta.test:@HTTP@/hello"),
    "name at a private address": fetch("http://private.test:@HTTP@/hello"),
    "name at the host's own address in the allowed network": fetch("http://hostside.test:@HTTP@/hello"),
    "Host header of a name not listed": status_of(proxy_raw(
        b"GET http://origin.test:@HTTP@/hello HTTP/1.1\r\nHost: denied.test:@HTTP@\r\nConnection: close\r\n\r\n")),
    "smuggled second request": smuggled(proxy_raw(
        b"POST http://origin.test:@HTTP@/hello HTTP/1.1\r\nHost: origin.test:@HTTP@\r\nContent-Length: 4\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\nGET http://denied.test:@HTTP@/hello HTTP/1.1\r\n"
        b"Host: denied.test:@HTTP@\r\nConnection: close\r\n\r\n")),
}
try:
    checks["resolver in the sandbox"] = "REACHED %s" % socket.getaddrinfo("origin.test", 443)
except Exception as e:
    checks["resolver in the sandbox"] = "refused (%s)" % e
for name, outcome in checks.items():
    print("%s: %s" % (name, outcome))
"#;

#[tokio::test(flavor = "multi_thread")]
async fn every_other_way_out_is_refused_and_logged() {
    let Some(_g) = privileged("every_other_way_out_is_refused_and_logged").await else {
        return;
    };
    let origin = Origin::start().await;
    let d = origin.daemon(64 << 20, json!({})).await;
    let mut c = Client::connect(&d).await;
    let code = ports(BYPASSES).replace("@IP@", &origin.ip.to_string());
    c.send_json(&exec_net(
        "bypass",
        "python",
        &code,
        &origin,
        json!({"allow": allow()}),
    ))
    .await;
    let run = c.collect("bypass").await;
    let out = run.stdout_text();
    println!("{out}");
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 17, "one line per check:\n{}", run.dump());
    let reached: Vec<&&str> = lines
        .iter()
        .filter(|l| !l.contains(": refused ("))
        .collect();
    assert!(
        reached.is_empty(),
        "ways out that were not refused: {reached:#?}\n{}",
        run.dump()
    );
    let seen = origin.seen();
    assert!(
        seen.iter().all(|s| s.starts_with("origin.test")),
        "a request for another name reached the origins: {seen:?}"
    );
    let net = run
        .result()
        .network
        .as_deref()
        .copied()
        .expect("result.network");
    assert!(net.refused >= 10, "{net:?}");
    let log = d.log();
    for reason in [
        "is not on the allowlist",
        "IP literal",
        "does not match the CONNECT host",
        "resolves only to refused addresses",
        "Host header",
        "private.test resolves only to refused addresses (private address)",
        "hostside.test resolves only to refused addresses (the host's own address)",
    ] {
        assert!(
            log.lines().any(|l| l.contains("egress refused")
                && l.contains(reason)
                && l.contains("bypass")),
            "no log line for {reason:?} naming the execution"
        );
    }
    let host_side = format!("{}:{HTTP_PORT}", origin.host_ip);
    assert!(
        log.lines().any(|l| l.contains("egress address refused")
            && l.contains(&host_side)
            && l.contains("the host's own address")),
        "no log line refusing {host_side}, the host's own address in the allowed network"
    );
    no_leftovers(&d).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn the_byte_limit_cuts_a_download_and_the_result_says_so() {
    let Some(_g) = privileged("the_byte_limit_cuts_a_download_and_the_result_says_so").await else {
        return;
    };
    let origin = Origin::start().await;
    let d = origin.daemon(8 << 20, json!({})).await;
    let mut c = Client::connect(&d).await;
    let code = r#"
import urllib.request
try:
    with urllib.request.urlopen("http://origin.test:@HTTP@/big/4194304", timeout=20) as r:
        print("got", len(r.read()))
except Exception as e:
    print("cut:", type(e).__name__)
try:
    urllib.request.urlopen("http://origin.test:@HTTP@/hello", timeout=20)
    print("after the limit: REACHED")
except Exception as e:
    print("after the limit: refused", e)
"#;
    let network = json!({"allow": allow(), "egress_bytes": 1 << 20});
    c.send_json(&exec_net("big", "python", &ports(code), &origin, network))
        .await;
    let run = c.collect("big").await;
    let out = run.stdout_text();
    assert!(
        out.contains("cut:") && out.contains("after the limit: refused"),
        "{}",
        run.dump()
    );
    let net = run
        .result()
        .network
        .as_deref()
        .copied()
        .expect("result.network");
    assert!(
        net.bytes_received + net.bytes_sent <= (1 << 20) + (256 << 10),
        "bytes beyond the limit: {net:?}"
    );
    assert!(net.refused >= 1, "{net:?}");
    // Above the operator's maximum: refused before anything runs.
    let over = json!({"allow": allow(), "egress_bytes": (8u64 << 20) + 1});
    c.send_json(&exec_net("over", "python", "print(1)", &origin, over))
        .await;
    let (e, _) = c.take_error().await;
    assert_eq!(e.code, ErrorCode::InvalidRequest);
    assert!(
        e.message.starts_with("Field network.egress_bytes:"),
        "{}",
        e.message
    );
    no_leftovers(&d).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn requests_beyond_the_bound_are_refused_and_nothing_changes_without_network() {
    let Some(_g) =
        privileged("requests_beyond_the_bound_are_refused_and_nothing_changes_without_network")
            .await
    else {
        return;
    };
    let origin = Origin::start().await;
    let d = origin.daemon(8 << 20, json!({})).await;
    let mut c = Client::connect(&d).await;
    for (id, entry, why) in [
        (
            "wider",
            "example.com:443",
            "not covered by the operator's allow_max",
        ),
        ("ip", "198.18.0.1:8443", "IP literal"),
        (
            "port",
            "origin.test:9999",
            "not covered by the operator's allow_max",
        ),
        (
            "wider-wildcard",
            "*.example.test:9999",
            "not covered by the operator's allow_max",
        ),
    ] {
        let (e, _) = {
            c.send_json(&exec_net(
                id,
                "python",
                "print(1)",
                &origin,
                json!({"allow": [entry]}),
            ))
            .await;
            c.take_error().await
        };
        assert_eq!(
            (e.id.as_deref(), e.code),
            (Some(id), ErrorCode::InvalidRequest)
        );
        assert!(e.message.contains(why), "{entry}: {}", e.message);
    }
    // The connection still serves, and an execution without `network` has neither proxy nor settings.
    let code = r#"
import os, socket
print("proxy env:", sorted(k for k in os.environ if "proxy" in k.lower()))
try:
    socket.create_connection(("127.0.0.1", 3128), timeout=3)
    print("port 3128: REACHED")
except OSError as e:
    print("port 3128: refused", e.errno)
"#;
    c.send_json(&exec_json("plain", "python", code, 30_000, 256))
        .await;
    let run = c.collect("plain").await;
    assert_eq!(
        run.stdout_text(),
        "proxy env: []\nport 3128: refused 111\n",
        "{}",
        run.dump()
    );
    assert!(run.result().network.is_none());
    assert!(run.result_raw().get("network").is_none());
    no_leftovers(&d).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_daemon_without_the_extension_refuses_network_and_stays_usable() {
    let Some(_g) =
        privileged("a_daemon_without_the_extension_refuses_network_and_stays_usable").await
    else {
        return;
    };
    let d = Daemon::start(DaemonOpts::default()).await;
    let mut c = Client::connect(&d).await;
    let extensions = c
        .ping()
        .await
        .capabilities
        .expect("capabilities")
        .extensions;
    assert!(!extensions.iter().any(|e| e == "network"), "{extensions:?}");
    let req = with(
        exec_json("n", "python", "print(1)", 10_000, 128),
        json!({"network": {"allow": ["example.com:443"]}}),
    );
    c.send_json(&req).await;
    let (e, _) = c.take_error().await;
    assert_eq!(
        (e.id.as_deref(), e.code),
        (Some("n"), ErrorCode::InvalidRequest)
    );
    assert!(e.message.starts_with("Field network:"), "{}", e.message);
    c.send_json(&exec_json("after", "shell", "echo ok", 10_000, 128))
        .await;
    assert_eq!(c.collect("after").await.stdout_text(), "ok\n");
    no_leftovers(&d).await;
}

//! E.net: the `network` extension (egress through the server's proxy). Without it announced in
//! `pong.capabilities.extensions`, an execute asking for `network` must be refused (E.net.1). With it, malformed
//! allowlists are refused (E.net.2-3), and an execution allowed one host (the entry `--network-allow` gives: the
//! suite cannot know the operator's bound) sees a loopback proxy in `HTTPS_PROXY`, gets 403 from it for a host not
//! listed, has no direct route out, and gets the proxy's counters in `result.network` (E.net.4-7). A request
//! without `network` gets no `result.network` (E.net.8).

use std::net::IpAddr;

use serde_json::{json, Value};

use super::common::{case, refused_invalid, sequence, C};
use crate::ctx::Ctx;
use crate::framework::{Case, CaseResult, Stop};
use crate::wire::{check_error_fields, short, Exec};
use crate::{check, fail, skip};

const UNANNOUNCED: &str = "A server that does not announce the `network` extension MUST refuse an execute carrying `network` with an `error` echoing its id (section 2: an unknown field is refused, never ignored), and the connection stays usable.";
const ALLOWLIST: &str = "`network.allow` lists 1 to 64 host name entries (`host:port`, `*.domain:port`, or `host` for ports 443 and 80); an IP literal, an empty list, or an entry the operator's bound does not cover MUST get `error` INVALID_REQUEST naming `network.allow`.";
const PROXY_ENV: &str = "An accepted `network` runs the program with `HTTP_PROXY`/`HTTPS_PROXY` (and lower-case forms, `ALL_PROXY`) pointing at the server's egress proxy on the sandbox's loopback.";
const PROXY_REFUSES: &str = "The proxy (HTTP CONNECT and absolute-form HTTP) answers a request for a host outside `network.allow` with HTTP 403.";
const NO_ROUTE: &str =
    "The proxy is the only way out: no direct connection (and no DNS) from the sandbox.";
const COUNTERS: &str = "`result.network` (`connections`, `upstream_connections`, `refused`, `bytes_sent`, `bytes_received`) is present when the request asked for `network`; `refused` counts the proxy's refusals.";
const ABSENT: &str = "`result.network` is only sent when the request asked for `network`.";

/// The cases of this group, in id order.
#[rustfmt::skip]
pub static CASES: &[Case] = &[
    case!("E.net.1", Must, "network", "Not announced: an execute with network is refused with its id, the connection goes on", UNANNOUNCED, refused_unannounced),
    case!("E.net.2", Must, "network", "An IP literal in network.allow is refused with INVALID_REQUEST", ALLOWLIST, refused_entry(json!(["192.0.2.1:443"]))),
    case!("E.net.3", Must, "network", "An empty network.allow is refused with INVALID_REQUEST", ALLOWLIST, refused_entry(json!([]))),
    case!("E.net.4", Must, "network", "HTTPS_PROXY is set inside and points at a loopback address", PROXY_ENV, proxy_env),
    case!("E.net.5", Must, "network", "A CONNECT to a host not allowed gets 403 from the proxy", PROXY_REFUSES, proxy_refuses),
    case!("E.net.6", Must, "network", "A direct connection to 192.0.2.1:443 fails", NO_ROUTE, no_direct_route),
    case!("E.net.7", Must, "network", "result.network carries the proxy's counters, refused >= 1", COUNTERS, counters),
    case!("E.net.8", Must, "network", "Without network in the request, result.network is absent", ABSENT, absent_without_request),
];

/// A language and a program printing `ok`: shell, else python.
fn trivial(ctx: &Ctx) -> Result<(&'static str, &'static str), Stop> {
    match ctx.shell() {
        Ok(sh) => Ok((sh, "echo ok")),
        Err(no_shell) => ctx
            .python()
            .map(|py| (py, "print('ok')"))
            .map_err(|_| no_shell),
    }
}

fn announced(ctx: &Ctx) -> Result<(), Stop> {
    if ctx.extension("network") != Some(true) {
        skip!("the network extension is not announced in pong.capabilities.extensions");
    }
    Ok(())
}

/// The entry the endpoint accepts (`--network-allow`), when the extension is announced.
fn allowed_entry(ctx: &Ctx) -> Result<&str, Stop> {
    announced(ctx)?;
    match ctx.cfg.network_allow.as_deref() {
        Some(entry) => Ok(entry),
        None => Err(Stop::Skip(
            "network is announced, but the suite cannot know which entries the endpoint's operator allows: \
             run with --network-allow ENTRY (e.g. --network-allow pypi.org:443)"
                .into(),
        )),
    }
}

async fn refused_unannounced(ctx: C) -> CaseResult {
    if ctx.extension("network") == Some(true) {
        skip!("the network extension is announced (E.net.2-7 apply)");
    }
    let (lang, code) = trivial(&ctx)?;
    let mut c = ctx.connect().await?;
    let id = ctx.id("netoff");
    let exec = ctx.exec_with(
        &id,
        lang,
        code,
        json!({"network": {"allow": ["example.com:443"]}}),
    );
    c.send_json(&exec).await?;
    let m = c
        .take(ctx.secs(10), "the answer to an execute with network", |m| {
            m.is_for(&id) || m.kind() == "error"
        })
        .await?;
    if m.kind() != "error" {
        fail!(
            "the network extension is not announced, yet the execute asking for it was taken ({}): it would run \
             without the network it asked for",
            short(&m.raw)
        );
    }
    check!(
        m.id() == Some(id.as_str()),
        "the refusal must echo the execute's id {id:?}: {}",
        short(&m.raw)
    );
    check_error_fields(&m.raw).map_err(Stop::Fail)?;
    c.ping(ctx.secs(10))
        .await
        .map_err(|s| Stop::Fail(format!("no pong after the refusal: {}", s.message())))?;
    let after = ctx.id("netoff");
    let e = ctx.run(&mut c, &ctx.exec(&after, lang, code)).await?;
    check!(
        e.terminal_status().as_deref() == Some("completed") && e.stdout_text().trim() == "ok",
        "an execution after the refusal did not run: {}",
        e.dump()
    );
    Ok(format!(
        "refused with {} ({}); the connection went on",
        m.raw["code"],
        m.raw["message"].as_str().unwrap_or_default()
    ))
}

async fn refused_entry(ctx: &Ctx, allow: Value) -> CaseResult {
    announced(ctx)?;
    let (lang, code) = trivial(ctx)?;
    let mut c = ctx.connect().await?;
    let id = ctx.id("netbad");
    let exec = ctx.exec_with(&id, lang, code, json!({"network": {"allow": allow}}));
    let e = refused_invalid(ctx, &mut c, &exec, &id, &["network.allow"]).await?;
    Ok(format!(
        "refused: {}",
        e.raw["message"].as_str().unwrap_or_default()
    ))
}

/// The Python probe: prints `proxy=`, `connect=` (the status of a CONNECT to `denied.invalid:443` through
/// `HTTPS_PROXY`), `direct=` (a direct connection to 192.0.2.1:443) and `dns=` lines.
const PYTHON_PROBE: &str = r#"
import os, socket, threading
def out(k, v):
    print("%s=%s" % (k, str(v).replace("\n", " ")), flush=True)
proxy = os.environ.get("HTTPS_PROXY", "")
out("proxy", proxy)
out("tool", "python")
def hostport(url):
    rest = url.split("://", 1)[-1].split("/", 1)[0].rsplit("@", 1)[-1]
    if rest.startswith("["):
        host, _, tail = rest[1:].partition("]")
        port = tail[1:]
    else:
        host, _, port = rest.partition(":")
    return host, int(port) if port.isdigit() else 80
def why(e):
    return e.errno or type(e).__name__
def connect_status():
    host, port = hostport(proxy)
    if not host:
        return "no-proxy"
    try:
        s = socket.create_connection((host, port), timeout=5)
    except OSError as e:
        return "proxy-unreachable:%s" % why(e)
    try:
        s.sendall(b"CONNECT denied.invalid:443 HTTP/1.1\r\nHost: denied.invalid:443\r\n\r\n")
        words = s.makefile("rb").readline(256).decode("latin-1").split()
        return words[1] if len(words) > 1 else "no-status"
    except OSError as e:
        return "error:%s" % why(e)
    finally:
        s.close()
out("connect", connect_status())
def direct():
    try:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    except OSError as e:
        return "failed:%s" % why(e)
    s.settimeout(3)
    try:
        s.connect(("192.0.2.1", 443))
        return "connected"
    except socket.timeout:
        return "timeout"
    except OSError as e:
        return "failed:%s" % why(e)
    finally:
        s.close()
out("direct", direct())
dns = ["timeout"]
def look():
    try:
        socket.getaddrinfo("example.com", 443)
        dns[0] = "resolved"
    except OSError:
        dns[0] = "failed"
t = threading.Thread(target=look, daemon=True)
t.start()
t.join(3)
out("dns", dns[0])
"#;

/// The shell probe (POSIX sh; the TCP connections need bash's `/dev/tcp` or `nc`, whichever is there): the same
/// lines as [`PYTHON_PROBE`], `dns=untested`, and `tool=bash|nc|none`.
const SHELL_PROBE: &str = r#"
out=${TMPDIR:-/tmp}/.fsp-net-$$
echo "proxy=${HTTPS_PROXY:-}"
if command -v bash >/dev/null 2>&1; then tool=bash
elif command -v nc >/dev/null 2>&1; then tool=nc
else tool=none; fi
echo "tool=$tool"
hp=${HTTPS_PROXY#*://}; hp=${hp%%/*}; hp=${hp##*@}
case "$hp" in
  \[*) host=${hp%%]*}; host=${host#?}; port=${hp##*]:} ;;
  *) host=${hp%:*}; port=${hp##*:} ;;
esac
case "$port" in ''|*[!0-9]*) port=80 ;; esac
# limited SECONDS FUNCTION ARGS...: runs it with its stdout in $out, killed after SECONDS (status above 128).
limited() {
  s=$1; shift
  "$@" >"$out" 2>/dev/null &
  p=$!
  ( sleep "$s"; kill -9 "$p" ) >/dev/null 2>&1 &
  w=$!
  { wait "$p"; rc=$?; } 2>/dev/null
  kill "$w" 2>/dev/null
  return $rc
}
ask() {
  req='CONNECT denied.invalid:443 HTTP/1.1\r\nHost: denied.invalid:443\r\n\r\n'
  if [ "$tool" = bash ]; then
    printf "$req" | bash -c 'exec 3<>"/dev/tcp/$0/$1" || exit 3; cat >&3; head -n 1 <&3' "$1" "$2"
  else
    printf "$req" | nc "$1" "$2" | head -n 1
  fi
}
reach() {
  if [ "$tool" = bash ]; then bash -c 'exec 3<>"/dev/tcp/$0/$1"' "$1" "$2"; else nc "$1" "$2" </dev/null; fi
}
if [ "$tool" = none ]; then
  echo "connect=untested"; echo "direct=untested"
else
  if [ -z "$host" ]; then echo "connect=no-proxy"; else
    limited 5 ask "$host" "$port"
    set -- $(head -n 1 "$out" 2>/dev/null)
    echo "connect=${2:-no-status}"
  fi
  limited 3 reach 192.0.2.1 443; rc=$?
  if [ "$rc" -eq 0 ]; then echo "direct=connected"
  elif [ "$rc" -gt 128 ]; then echo "direct=timeout"
  else echo "direct=failed:$rc"; fi
fi
echo "dns=untested"
rm -f "$out"
"#;

/// The value of `key=` in the probe's output.
fn field<'a>(out: &'a str, key: &str) -> Option<&'a str> {
    out.lines()
        .find_map(|l| l.strip_prefix(key).and_then(|r| r.strip_prefix('=')))
        .map(str::trim)
}

/// Whether a proxy URL (`http://127.0.0.1:3128`) names a loopback host.
pub fn is_loopback_proxy(url: &str) -> bool {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let authority = rest.split('/').next().unwrap_or(rest);
    let host_port = authority.rsplit_once('@').map_or(authority, |(_, h)| h);
    let host = match host_port.strip_prefix('[') {
        Some(v6) => v6.split(']').next().unwrap_or(v6),
        None => host_port.split(':').next().unwrap_or(host_port),
    };
    host.eq_ignore_ascii_case("localhost")
        || host.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

/// Runs the network probe once per run, allowed `entry`, and returns the execution (E.net.4-7 judge it).
async fn probe(ctx: &Ctx, entry: &str) -> Result<Exec, Stop> {
    let (lang, code) = match ctx.has_language("python") {
        Some(true) => ("python", PYTHON_PROBE),
        _ => (ctx.shell()?, SHELL_PROBE),
    };
    ctx.scenario("network-probe", || async move {
        let mut c = ctx.connect().await?;
        let id = ctx.id("netprobe");
        let exec = ctx.exec_with(&id, lang, code, json!({"network": {"allow": [entry]}}));
        let e = ctx.run(&mut c, &exec).await?;
        if let Some(err) = e.error() {
            return Err(Stop::Harness(format!(
                "the endpoint refused the execution allowing --network-allow {entry:?} ({}); give an entry its \
                 operator's bound covers",
                short(err)
            )));
        }
        sequence(&e)?;
        if e.terminal_status().as_deref() != Some("completed") {
            return Err(Stop::Harness(format!(
                "the network probe did not complete: {}",
                e.dump()
            )));
        }
        Ok(e)
    })
    .await
}

/// The probe's output line `key`, failing the case (harness) when the probe printed none.
fn probed(e: &Exec, key: &str) -> Result<String, Stop> {
    field(&e.stdout_text(), key)
        .map(str::to_owned)
        .ok_or_else(|| Stop::Harness(format!("the network probe printed no {key}=: {}", e.dump())))
}

async fn proxy_env(ctx: C) -> CaseResult {
    let entry = allowed_entry(&ctx)?;
    let e = probe(&ctx, entry).await?;
    let proxy = probed(&e, "proxy")?;
    check!(
        !proxy.is_empty(),
        "HTTPS_PROXY is not set in an execution allowed {entry:?}"
    );
    check!(
        is_loopback_proxy(&proxy),
        "HTTPS_PROXY is {proxy:?}, not a loopback address"
    );
    Ok(format!("HTTPS_PROXY={proxy}"))
}

/// The probe's TCP tool, skipping the case when the shell probe found none.
fn tcp_probed(e: &Exec) -> Result<(), Stop> {
    if probed(e, "tool")? == "none" {
        skip!("the shell probe found no TCP client in the sandbox (bash or nc), and python is not announced");
    }
    Ok(())
}

async fn proxy_refuses(ctx: C) -> CaseResult {
    let entry = allowed_entry(&ctx)?;
    let e = probe(&ctx, entry).await?;
    tcp_probed(&e)?;
    let status = probed(&e, "connect")?;
    match status.as_str() {
        "403" => Ok("CONNECT denied.invalid:443 got 403".into()),
        "no-proxy" => fail!("HTTPS_PROXY is not set, so there is no proxy to ask"),
        other => fail!(
            "CONNECT denied.invalid:443 through HTTPS_PROXY got {other:?}, expected status 403"
        ),
    }
}

async fn no_direct_route(ctx: C) -> CaseResult {
    let entry = allowed_entry(&ctx)?;
    let e = probe(&ctx, entry).await?;
    tcp_probed(&e)?;
    let direct = probed(&e, "direct")?;
    let dns = probed(&e, "dns")?;
    match direct.as_str() {
        "connected" => fail!("a direct connection to 192.0.2.1:443 succeeded beside the proxy"),
        "timeout" => Ok(format!(
            "no answer within 3 s (a sandbox without a route usually fails at once); DNS: {dns}"
        )),
        how => Ok(format!("{how}; DNS lookup of example.com: {dns}")),
    }
}

async fn counters(ctx: C) -> CaseResult {
    let entry = allowed_entry(&ctx)?;
    let e = probe(&ctx, entry).await?;
    let Some(n) = e.result().and_then(|r| r.get("network")) else {
        fail!(
            "the request asked for network but the result has no network: {}",
            e.dump()
        );
    };
    for f in [
        "connections",
        "upstream_connections",
        "refused",
        "bytes_sent",
        "bytes_received",
    ] {
        check!(
            n[f].as_u64().is_some(),
            "result.network.{f} must be a non-negative integer: {}",
            short(n)
        );
    }
    let connect = probed(&e, "connect")?;
    if connect != "403" {
        return Ok(format!(
            "present ({}); refused not judged: the probe's CONNECT got {connect:?}",
            short(n)
        ));
    }
    check!(
        n["refused"].as_u64() >= Some(1),
        "the proxy refused the probe's CONNECT but result.network.refused is {}",
        n["refused"]
    );
    Ok(short(n))
}

async fn absent_without_request(ctx: C) -> CaseResult {
    let (lang, code) = trivial(&ctx)?;
    let mut c = ctx.connect().await?;
    let id = ctx.id("netnone");
    let e = ctx.run(&mut c, &ctx.exec(&id, lang, code)).await?;
    let Some(r) = e.result() else {
        fail!("expected a result: {}", e.dump());
    };
    check!(
        r.get("network").is_none(),
        "result.network was sent for a request without network: {}",
        short(r)
    );
    Ok(String::new())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_proxies() {
        for url in [
            "http://127.0.0.1:3128",
            "http://127.0.0.5:3128/",
            "http://[::1]:3128",
            "http://user:pw@localhost:8080",
            "127.0.0.1:3128",
        ] {
            assert!(is_loopback_proxy(url), "{url}");
        }
        for url in [
            "",
            "http://10.0.0.1:3128",
            "http://proxy.example.com:3128",
            "http://[2001:db8::1]:3128",
        ] {
            assert!(!is_loopback_proxy(url), "{url}");
        }
    }

    /// A stand-in for the egress proxy on a loopback port: answers every request with 403, counts them.
    fn refusing_proxy() -> (u16, std::sync::Arc<std::sync::atomic::AtomicUsize>) {
        use std::io::{BufRead, BufReader, Write};
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let asked = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let count = asked.clone();
        std::thread::spawn(move || {
            for stream in listener.incoming().flatten() {
                let mut reader = BufReader::new(&stream);
                let mut line = String::new();
                while reader.read_line(&mut line).is_ok_and(|n| n > 2) {
                    line.clear();
                }
                count.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                let _ =
                    (&stream).write_all(b"HTTP/1.1 403 Forbidden\r\n\r\nnot in the allowlist\n");
            }
        });
        (port, asked)
    }

    /// Runs a probe here with `HTTPS_PROXY` pointing at `port`; its stdout.
    fn run_probe(program: &str, args: &[&str], port: u16) -> Option<String> {
        let out = std::process::Command::new(program)
            .args(args)
            .env("HTTPS_PROXY", format!("http://127.0.0.1:{port}"))
            .stdin(std::process::Stdio::null())
            .output()
            .ok()?;
        Some(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    #[test]
    fn probes_report_the_proxy_s_answer_here() {
        let (port, asked) = refusing_proxy();
        let shell = std::thread::spawn(move || run_probe("/bin/sh", &["-c", SHELL_PROBE], port));
        let python = std::path::Path::new("/usr/bin/python3")
            .exists()
            .then(|| run_probe("/usr/bin/python3", &["-c", PYTHON_PROBE], port));
        let mut ran = 0;
        for out in [shell.join().unwrap(), python.flatten()]
            .into_iter()
            .flatten()
        {
            assert_eq!(
                field(&out, "proxy"),
                Some(format!("http://127.0.0.1:{port}").as_str()),
                "{out}"
            );
            if field(&out, "tool") == Some("none") {
                continue;
            }
            ran += 1;
            assert_eq!(field(&out, "connect"), Some("403"), "{out}");
            let direct = field(&out, "direct").unwrap_or_default();
            assert!(
                direct == "connected" || direct == "timeout" || direct.starts_with("failed:"),
                "{out}"
            );
            assert!(field(&out, "dns").is_some(), "{out}");
        }
        assert_eq!(asked.load(std::sync::atomic::Ordering::SeqCst), ran);
    }

    #[test]
    fn probe_fields() {
        let out = "proxy=http://127.0.0.1:3128\ntool=python\nconnect=403\ndirect=failed:101\n";
        assert_eq!(field(out, "proxy"), Some("http://127.0.0.1:3128"));
        assert_eq!(field(out, "connect"), Some("403"));
        assert_eq!(field(out, "dns"), None);
    }
}

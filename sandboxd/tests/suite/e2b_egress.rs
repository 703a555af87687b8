//! E2B's `network.allowOut` on the sandbox's egress proxy (docs/spec/e2b-compat.md), driven by the unchanged Python
//! SDK (tests/e2b/egress_check.py, from the venv tests/e2b/setup.sh makes) against a daemon whose `network` extension
//! reaches [`super::egress_origin`]'s origins and whose facade listens on `e2b.listen`: a sandbox created with
//! `allowOut` fetches from the listed origin (plain HTTP and HTTPS with the test CA written by `files.write`) through
//! the proxy its processes' environment names, and gets the proxy's 403 for a host it did not list; one created
//! without `network` reaches nothing; `allow_internet_access` alone and an entry beyond the operator's
//! `network.allow_max` are refused with a 400 naming the field, and nothing is left.

use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use serde_json::json;

use super::e2b_sdk::{facade_get, facade_up, venv};
use super::egress_origin::{Origin, HTTPS_PORT, HTTP_PORT};
use super::harness::*;

/// How long the script may run (two sandboxes, a handful of commands: seconds).
const SCRIPT_DEADLINE: Duration = Duration::from_secs(5 * 60);

/// A daemon whose proxy reaches `origin`'s servers, with the facade on a port of its own; returns once the facade
/// answers.
async fn start(origin: &Origin) -> (Daemon, u16) {
    let port = free_port();
    let d = origin
        .daemon(
            64 << 20,
            json!({"e2b": {"listen": format!("127.0.0.1:{port}")}}),
        )
        .await;
    facade_up(port, d.token()).await;
    (d, port)
}

/// Runs tests/e2b/egress_check.py with `args` from the repository's root, with only the facade's environment for
/// the SDK; prints its output, checks it exited 0, and returns its stdout's lines.
async fn egress_check(venv: &Path, port: u16, api_key: &str, args: &[&str]) -> Vec<String> {
    let url = format!("http://127.0.0.1:{port}");
    let repo = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the workspace root");
    let mut cmd = tokio::process::Command::new(venv.join("bin/python"));
    cmd.arg("tests/e2b/egress_check.py")
        .args(args)
        .current_dir(repo)
        .env_clear()
        .env("PATH", "/usr/local/bin:/usr/bin:/bin")
        .env("E2B_API_KEY", api_key)
        .env("E2B_API_URL", &url)
        .env("E2B_SANDBOX_URL", &url)
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .env("PYTHONUNBUFFERED", "1")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    let what = format!("egress_check.py {}", args.join(" "));
    let out = tokio::time::timeout(SCRIPT_DEADLINE, cmd.output())
        .await
        .unwrap_or_else(|_| panic!("{what}: still running after {SCRIPT_DEADLINE:?} (killed)"))
        .unwrap_or_else(|e| panic!("{what}: cannot start: {e}"));
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    println!(
        "===== {what}: {}\n{stdout}----- stderr\n{stderr}===== end",
        out.status
    );
    assert!(out.status.success(), "{what}: {}\n{stderr}", out.status);
    stdout.lines().map(str::to_owned).collect()
}

/// The line that starts with `prefix`, or a panic listing them all and the daemon's log.
fn line<'a>(lines: &'a [String], prefix: &str, d: &Daemon) -> &'a str {
    lines
        .iter()
        .find(|l| l.starts_with(prefix))
        .unwrap_or_else(|| panic!("no line {prefix:?} in {lines:#?}\ndaemon log:\n{}", d.log()))
}

/// Every sandbox was killed: the facade lists none, and nothing of their containers is left on the host.
async fn nothing_left(d: &Daemon, port: u16) {
    assert_eq!(
        facade_get(port, "/v2/sandboxes", d.token()).await,
        Ok((200, json!([]))),
        "sandboxes left after the script ended"
    );
    wait_until(
        "nothing of the sandboxes left",
        Duration::from_secs(20),
        || d.leftovers(),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn an_e2b_sandbox_reaches_its_allow_out_through_the_proxy_and_one_without_network_nothing() {
    const TEST: &str =
        "an_e2b_sandbox_reaches_its_allow_out_through_the_proxy_and_one_without_network_nothing";
    let Some(_g) = privileged(TEST).await else {
        return;
    };
    let Some(venv) = venv(TEST) else {
        return;
    };
    let origin = Origin::start().await;
    let (d, port) = start(&origin).await;
    let ca = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(ca.path(), &origin.ca_pem).unwrap();
    let ca_path = ca.path().display().to_string();
    let (ip, http, https) = (
        origin.ip.to_string(),
        HTTP_PORT.to_string(),
        HTTPS_PORT.to_string(),
    );
    let lines = egress_check(
        &venv,
        port,
        d.token(),
        &["reach", &ca_path, &ip, &http, &https],
    )
    .await;

    // The listed sandbox's processes name the proxy on its loopback, and reach the listed origin through it.
    let proxy = "http://127.0.0.1:3128";
    assert_eq!(
        line(&lines, "listed proxy ", &d),
        format!("listed proxy {proxy} {proxy}")
    );
    for url in [
        format!("http://origin.test:{HTTP_PORT}/hello"),
        format!("https://origin.test:{HTTPS_PORT}/hello"),
    ] {
        assert_eq!(
            line(&lines, &format!("listed reached {url} "), &d),
            format!("listed reached {url} 200 hello from origin")
        );
    }
    // A host it did not list (the same address, another name): the proxy's 403, the command fails.
    for url in [
        format!("http://denied.test:{HTTP_PORT}/hello"),
        format!("https://denied.test:{HTTPS_PORT}/hello"),
    ] {
        let refused = line(&lines, &format!("listed refused {url} exit=1 "), &d);
        assert!(refused.contains("403"), "{refused}");
    }
    // Without `network`: no proxy, and neither the origin's name nor its address leads anywhere.
    assert_eq!(line(&lines, "bare proxy ", &d), "bare proxy None None");
    for url in [
        format!("http://origin.test:{HTTP_PORT}/hello"),
        format!("http://{ip}:{HTTP_PORT}/hello"),
    ] {
        let refused = line(&lines, &format!("bare refused {url} exit=1 "), &d);
        assert!(refused.contains("URLError"), "{refused}");
    }
    assert_eq!(
        origin.seen(),
        vec![
            format!("origin.test:{HTTP_PORT}/hello"),
            format!("origin.test:{HTTPS_PORT}/hello"),
        ],
        "the origin saw the listed sandbox's two fetches and nothing else"
    );
    nothing_left(&d, port).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn e2b_creates_asking_for_egress_the_daemon_cannot_grant_are_refused_and_leave_nothing() {
    const TEST: &str =
        "e2b_creates_asking_for_egress_the_daemon_cannot_grant_are_refused_and_leave_nothing";
    let Some(_g) = privileged(TEST).await else {
        return;
    };
    let Some(venv) = venv(TEST) else {
        return;
    };
    let origin = Origin::start().await;
    let (d, port) = start(&origin).await;
    let lines = egress_check(&venv, port, d.token(), &["refuse", "pypi.org:443"]).await;
    let open = line(&lines, "refused allow_internet_access ", &d);
    assert!(
        open.starts_with(
            "refused allow_internet_access SandboxException 400: allow_internet_access:"
        ),
        "{open}"
    );
    let beyond = line(&lines, "refused allow_out ", &d);
    assert!(
        beyond.starts_with("refused allow_out SandboxException 400: network.allowOut:"),
        "{beyond}"
    );
    assert!(
        !lines.iter().any(|l| l.starts_with("created ")),
        "{lines:#?}"
    );
    nothing_left(&d, port).await;
    assert!(origin.seen().is_empty(), "{:?}", origin.seen());
}

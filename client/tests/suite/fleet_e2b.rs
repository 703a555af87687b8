//! The E2B API on a fleet (`e2b.fleet`, docs/spec/e2b-compat.md "On a fleet"): three daemons in three network
//! namespaces, each with its E2B listener, behind one front address that spreads connections over them round
//! robin (as a Kubernetes Service does). The unchanged Python `e2b` SDK (tests/e2b/fleet_check.py, the venv of
//! tests/e2b/setup.sh) knows only the front: 30 sandboxes are created, placed evenly, each given a command, a file
//! and a background process through whichever node the front picks; `list` pages through all 30; a node SIGKILLed
//! mid-run costs only its own sandboxes (they answer "not found" promptly, the others' processes finish); back with
//! live restore, it serves them again; forged ids, loops and wrong secrets get clear errors.

use std::path::Path;
use std::process::Stdio;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use serde_json::json;
use tokio::net::{TcpListener, TcpStream};

use super::daemon::{require_daemon, Daemon, DaemonOpts};
use super::netns::Network;

/// The E2B listeners' port inside each host's network namespace.
const E2B_PORT: u16 = 3000;

static START: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();

/// How long one phase of the client may take.
const PHASE_DEADLINE: Duration = Duration::from_secs(600);

/// A TCP front on 127.0.0.1 that hands each connection it accepts to the next of `nodes`, round robin, and
/// copies both ways until either side closes. A node that refuses the connection is skipped for the next, as a
/// Service skips an endpoint that is not ready. Ends with the test's runtime.
async fn front(nodes: Vec<String>) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let next = Arc::new(AtomicUsize::new(0));
    tokio::spawn(async move {
        while let Ok((mut inbound, _)) = listener.accept().await {
            let first = next.fetch_add(1, Ordering::Relaxed);
            let nodes = nodes.clone();
            tokio::spawn(async move {
                let mut outbound = None;
                for k in 0..nodes.len() {
                    if let Ok(s) = TcpStream::connect(&nodes[(first + k) % nodes.len()]).await {
                        outbound = Some(s);
                        break;
                    }
                }
                let Some(mut outbound) = outbound else {
                    return;
                };
                let _ = inbound.set_nodelay(true);
                let _ = outbound.set_nodelay(true);
                let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
            });
        }
    });
    format!("http://{addr}")
}

/// Runs one phase of tests/e2b/fleet_check.py against the front; panics with its output when it fails.
async fn phase(venv: &Path, front: &str, env: &[(&str, &str)], args: &[&str]) -> String {
    let mut cmd = tokio::process::Command::new(venv.join("bin/python"));
    cmd.arg("tests/e2b/fleet_check.py")
        .args(args)
        .current_dir(Path::new(env!("CARGO_MANIFEST_DIR")).join(".."))
        .env("E2B_API_URL", front)
        .env("E2B_SANDBOX_URL", front)
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .kill_on_drop(true);
    let out = tokio::time::timeout(PHASE_DEADLINE, cmd.output())
        .await
        .unwrap_or_else(|_| panic!("fleet_check.py {args:?}: no end within {PHASE_DEADLINE:?}"))
        .expect("run the venv's python");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "fleet_check.py {args:?} failed ({}):\n{stdout}\n{stderr}",
        out.status
    );
    println!(
        "fleet_check.py {} ({:?} since the test began): {}",
        args[0],
        START.get_or_init(std::time::Instant::now).elapsed(),
        stdout.trim()
    );
    stdout
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn fleet_e2b_sdk_through_one_front_address() {
    const TEST: &str = "fleet_e2b_sdk_through_one_front_address";
    let Some(bin) = require_daemon(TEST) else {
        return;
    };
    let Some(venv) = test_support::e2b_venv(TEST) else {
        return;
    };
    let net = match Network::create(3) {
        Ok(net) => net,
        Err(e) => {
            test_support::cannot_run(TEST, &format!("cannot create network namespaces: {e}"));
            return;
        }
    };
    let secrets = tempfile::tempdir().unwrap();
    let secret = format!("fleet-{:032x}", rand::random::<u128>());
    let secret_file = secrets.path().join("fleet-secret");
    std::fs::write(&secret_file, format!("{secret}\n")).unwrap();
    let token = format!("fleet-e2b-{:016x}", rand::random::<u64>());
    let nodes: Vec<String> = net
        .hosts
        .iter()
        .map(|h| format!("{}:{E2B_PORT}", h.ip))
        .collect();
    let mut daemons = Vec::new();
    for (i, host) in net.hosts.iter().enumerate() {
        let opts = DaemonOpts {
            max_concurrent: 4,
            max_queue: 16,
            max_sandboxes: 20,
            netns: Some(host.netns.clone()),
            host: host.ip.to_string(),
            token: Some(token.clone()),
            live_restore: true,
            extra: Some(json!({"e2b": {
                "listen": nodes[i],
                "fleet": {
                    "node": format!("node-{i}"),
                    "secret_file": secret_file,
                    "peers": nodes,
                    "refresh_ms": 500,
                },
            }})),
            ..DaemonOpts::default()
        };
        daemons.push(Daemon::start(&bin, opts).await);
    }
    START.get_or_init(std::time::Instant::now);
    let front = front(nodes.clone()).await;
    let state_dir = tempfile::tempdir().unwrap();
    let state = state_dir.path().join("sandboxes.json");
    let state = state.to_str().unwrap();
    let env = [
        ("E2B_API_KEY", token.as_str()),
        ("FLEET_SECRET", secret.as_str()),
    ];
    // Every node sees the other two before the first create (a refresh is 500 ms).
    tokio::time::sleep(Duration::from_millis(1500)).await;

    phase(&venv, &front, &env, &["create", "30", state]).await;

    // Mid-run: every sandbox has a background process running; node 2 dies with its.
    daemons[2].kill_hard();
    println!("killed at {:?}", START.get().unwrap().elapsed());
    phase(&venv, &front, &env, &["after-kill", state, "node-2"]).await;

    // Back with live restore: its sandboxes, files and all, are served again through the front.
    daemons[2].restart().await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    phase(&venv, &front, &env, &["after-restart", state, "node-2"]).await;
    let mut args = vec!["bad-input", state];
    args.extend(nodes.iter().map(String::as_str));
    phase(&venv, &front, &env, &args).await;
    phase(&venv, &front, &env, &["cleanup", state]).await;
    drop(daemons);
    drop(net);
}

//! `cargo bench -p sandboxd`: latency and throughput of a real daemon over the real protocol on loopback, against a
//! bare `std::process::Command` spawn of the same program measured in the same run.
//!
//! Prints a table: execute→result p50/p95/p99 for shell `true` and python `pass`, time to first stdout byte, and
//! executions per second at concurrency 1, 4 and 16. Needs root (the daemon creates containers). Figures, not
//! assertions: nothing here fails on a slow machine.

#![allow(missing_docs, clippy::unwrap_used, clippy::expect_used)]

use std::io::Read;
use std::net::TcpListener;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use futures_util::{SinkExt, StreamExt};
use serde_json::{json, Value};
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::Message;

const TOKEN: &str = "bench-token-0123456789abcdef";
const SAMPLES: usize = 100;
const THROUGHPUT_RUNS: usize = 96;
const SPARSE_SAMPLES: usize = 30;

struct Daemon {
    child: std::process::Child,
    port: u16,
    _dir: tempfile::TempDir,
}

impl Daemon {
    /// Starts a daemon; `extra` is appended to its config, `n` keeps cgroup parents and uid ranges apart.
    fn start(n: u32, extra: &str) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let config = dir.path().join("config.yaml");
        std::fs::write(
            &config,
            format!(
                "listen: 127.0.0.1:{port}\nstate_dir: {}\nauth: {{tokens: [\"{TOKEN}\"]}}\n\
                 capacity: {{max_concurrent: 16, max_queue: 256}}\n\
                 sandbox: {{cgroup_parent: sandboxd-bench-{}-{n}, uid_base: {}}}\n{extra}",
                dir.path().join("state").display(),
                std::process::id(),
                400_000 + n * 1000,
            ),
        )
        .unwrap();
        let child = Command::new(env!("CARGO_BIN_EXE_sandboxd"))
            .arg("--config")
            .arg(&config)
            .env(
                "SANDBOXD_LOG",
                "warn,libcgroups=error,libcontainer::process::init=error",
            )
            .spawn()
            .expect("start sandboxd");
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            if let Ok(mut s) = std::net::TcpStream::connect(("127.0.0.1", port)) {
                use std::io::Write;
                s.write_all(b"GET /healthz HTTP/1.0\r\n\r\n").unwrap();
                let mut r = String::new();
                let _ = s.read_to_string(&mut r);
                if r.starts_with("HTTP/1.0 200") || r.starts_with("HTTP/1.1 200") {
                    break;
                }
            }
            assert!(Instant::now() < deadline, "sandboxd did not become ready");
            std::thread::sleep(Duration::from_millis(50));
        }
        Self {
            child,
            port,
            _dir: dir,
        }
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(self.child.id() as i32),
            nix::sys::signal::Signal::SIGTERM,
        );
        let _ = self.child.wait();
    }
}

type Ws =
    tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>;

async fn connect(port: u16) -> Ws {
    let mut req = format!("ws://127.0.0.1:{port}/ws")
        .into_client_request()
        .unwrap();
    req.headers_mut()
        .insert("Authorization", format!("Bearer {TOKEN}").parse().unwrap());
    tokio_tungstenite::connect_async_with_config(req, None, true)
        .await
        .unwrap()
        .0
}

/// One execution; returns (time to result, time to first stdout byte).
async fn execute(
    ws: &mut Ws,
    id: &str,
    language: &str,
    code: &str,
) -> (Duration, Option<Duration>) {
    let msg = json!({"v":1,"type":"execute","id":id,"ts":"2026-01-01T00:00:00.000Z","language":language,
                     "code":code,"limits":{"timeout_ms":30000,"memory_mb":256}});
    let t0 = Instant::now();
    ws.send(Message::Text(msg.to_string().into()))
        .await
        .unwrap();
    let mut first = None;
    loop {
        let m = ws.next().await.unwrap().unwrap();
        let Message::Text(t) = m else { continue };
        let v: Value = serde_json::from_str(&t).unwrap();
        if v["id"] != id {
            continue;
        }
        match v["type"].as_str().unwrap() {
            "stdout" if first.is_none() => first = Some(t0.elapsed()),
            "result" => {
                assert_eq!(v["exit_code"], 0, "{v}");
                return (t0.elapsed(), first);
            }
            "error" => panic!("execution failed: {v}"),
            _ => {}
        }
    }
}

fn bare(
    program: &str,
    ext: &str,
    code: &str,
    dir: &std::path::Path,
) -> (Duration, Option<Duration>) {
    let file = dir.join(format!("main.{ext}"));
    std::fs::write(&file, code).unwrap();
    let t0 = Instant::now();
    let mut child = Command::new(program)
        .arg(&file)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .stdin(Stdio::null())
        .spawn()
        .unwrap();
    let mut out = child.stdout.take().unwrap();
    let mut first = None;
    let mut buf = [0u8; 4096];
    loop {
        let n = out.read(&mut buf).unwrap();
        if n == 0 {
            break;
        }
        first.get_or_insert_with(|| t0.elapsed());
    }
    assert!(child.wait().unwrap().success());
    (t0.elapsed(), first)
}

fn pct(mut v: Vec<Duration>, p: f64) -> f64 {
    v.sort();
    let i = ((v.len() as f64 - 1.0) * p).round() as usize;
    v[i].as_secs_f64() * 1000.0
}

struct Row {
    name: String,
    sandbox: Vec<Duration>,
    bare: Vec<Duration>,
}

fn main() {
    if !nix::unistd::geteuid().is_root() {
        eprintln!("SKIPPED: the sandboxd benchmark needs root (it starts the daemon, which creates containers)");
        return;
    }
    // `cargo bench` passes --bench; a filter argument is accepted and ignored.
    let daemon = Daemon::start(0, "");
    let tmp = tempfile::tempdir().unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let cases = [
        ("shell `true`", "shell", "/bin/sh", "sh", "true\n", false),
        (
            "python `pass`",
            "python",
            "/usr/bin/python3",
            "py",
            "pass\n",
            false,
        ),
        (
            "shell first stdout byte",
            "shell",
            "/bin/sh",
            "sh",
            "echo x\n",
            true,
        ),
        (
            "python first stdout byte",
            "python",
            "/usr/bin/python3",
            "py",
            "print('x')\n",
            true,
        ),
    ];
    let mut rows = Vec::new();
    rt.block_on(async {
        let mut ws = connect(daemon.port).await;
        for (name, lang, program, ext, code, first_byte) in cases {
            // Warm-up: page cache, first container.
            for i in 0..5 {
                execute(&mut ws, &format!("warm-{lang}-{i}"), lang, code).await;
                bare(program, ext, code, tmp.path());
            }
            let mut s = Vec::new();
            let mut b = Vec::new();
            // Interleave so both see the same machine state.
            for i in 0..SAMPLES {
                let (total, first) = execute(
                    &mut ws,
                    &format!("{name}-{i}").replace([' ', '`'], "_"),
                    lang,
                    code,
                )
                .await;
                s.push(if first_byte { first.unwrap() } else { total });
                let (total, first) = bare(program, ext, code, tmp.path());
                b.push(if first_byte { first.unwrap() } else { total });
            }
            rows.push(Row {
                name: name.to_string(),
                sandbox: s,
                bare: b,
            });
        }
        // Sparse traffic, the usual agent pattern: 200 ms idle before each execution (cold caches, idle CPUs).
        let mut s = Vec::new();
        let mut b = Vec::new();
        for i in 0..SPARSE_SAMPLES {
            tokio::time::sleep(Duration::from_millis(200)).await;
            s.push(
                execute(&mut ws, &format!("sparse-{i}"), "shell", "true\n")
                    .await
                    .0,
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
            b.push(bare("/bin/sh", "sh", "true\n", tmp.path()).0);
        }
        rows.push(Row {
            name: "shell `true`, 200 ms idle".into(),
            sandbox: s,
            bare: b,
        });
    });

    println!();
    println!(
        "sandboxd bench: {SAMPLES} samples each, interleaved with the bare baseline; times in ms"
    );
    println!(
        "{:<26} {:>9} {:>9} {:>9} | {:>9} {:>9} {:>9} | {:>12}",
        "case", "sbx p50", "sbx p95", "sbx p99", "bare p50", "bare p95", "bare p99", "p50 overhead"
    );
    for r in &rows {
        let (s50, b50) = (pct(r.sandbox.clone(), 0.5), pct(r.bare.clone(), 0.5));
        println!(
            "{:<26} {:>9.2} {:>9.2} {:>9.2} | {:>9.2} {:>9.2} {:>9.2} | {:>9.2} ms",
            r.name,
            s50,
            pct(r.sandbox.clone(), 0.95),
            pct(r.sandbox.clone(), 0.99),
            b50,
            pct(r.bare.clone(), 0.95),
            pct(r.bare.clone(), 0.99),
            s50 - b50
        );
    }

    if let Ok(spec) = std::env::var("SANDBOXD_BENCH_IMAGES") {
        images(&rt, &daemon, &spec);
    }

    println!();
    println!("throughput, shell `true`, {THROUGHPUT_RUNS} executions per run (one connection per worker)");
    println!(
        "{:<12} {:>14} {:>14} {:>8}",
        "concurrency", "sandbox exec/s", "bare exec/s", "ratio"
    );
    for conc in [1usize, 4, 16] {
        let t0 = Instant::now();
        rt.block_on(async {
            let mut tasks = Vec::new();
            for w in 0..conc {
                let port = daemon.port;
                tasks.push(tokio::spawn(async move {
                    let mut ws = connect(port).await;
                    let mut i = w;
                    while i < THROUGHPUT_RUNS {
                        execute(&mut ws, &format!("tp-{conc}-{i}"), "shell", "true\n").await;
                        i += conc;
                    }
                }));
            }
            for t in tasks {
                t.await.unwrap();
            }
        });
        let sbx = THROUGHPUT_RUNS as f64 / t0.elapsed().as_secs_f64();
        let t0 = Instant::now();
        std::thread::scope(|s| {
            for w in 0..conc {
                let dir = tmp.path().join(format!("w{w}"));
                std::fs::create_dir_all(&dir).unwrap();
                s.spawn(move || {
                    let mut i = w;
                    while i < THROUGHPUT_RUNS {
                        bare("/bin/sh", "sh", "true\n", &dir);
                        i += conc;
                    }
                });
            }
        });
        let bare_rate = THROUGHPUT_RUNS as f64 / t0.elapsed().as_secs_f64();
        println!(
            "{:<12} {:>14.1} {:>14.1} {:>8.2}",
            conc,
            sbx,
            bare_rate,
            sbx / bare_rate
        );
    }
    drop(daemon);
}

/// `SANDBOXD_BENCH_IMAGES=shell=DIR,python=DIR` (OCI layouts from `images/build.sh`): the same programs on a second
/// daemon whose languages run on those images, interleaved with the host-image daemon.
fn images(rt: &tokio::runtime::Runtime, host: &Daemon, spec: &str) {
    let mut extra = String::from("images:\n");
    let mut langs = String::from("languages:\n");
    let mut cases = Vec::new();
    for item in spec.split(',').filter(|s| !s.is_empty()) {
        let (lang, dir) = item.split_once('=').expect("lang=DIR");
        let (program, code) = match lang {
            "shell" => ("/bin/sh", "true\n"),
            "python" => ("/usr/bin/python3", "pass\n"),
            "javascript" => ("/usr/bin/node", "\n"),
            other => panic!("no bench case for {other}"),
        };
        let dir = std::fs::canonicalize(dir).expect("layout dir");
        extra.push_str(&format!("  {lang}: {{layout: {}}}\n", dir.display()));
        langs.push_str(&format!(
            "  {lang}: {{image: {lang}, command: [{program}]}}\n"
        ));
        cases.push((lang.to_owned(), code));
    }
    let image = Daemon::start(1, &format!("{extra}{langs}"));
    let mut rows = Vec::new();
    rt.block_on(async {
        let mut hw = connect(host.port).await;
        let mut iw = connect(image.port).await;
        for (lang, code) in &cases {
            for i in 0..5 {
                execute(&mut hw, &format!("warm-h-{lang}-{i}"), lang, code).await;
                execute(&mut iw, &format!("warm-i-{lang}-{i}"), lang, code).await;
            }
            let (mut h, mut m) = (Vec::new(), Vec::new());
            for i in 0..SAMPLES {
                h.push(
                    execute(&mut hw, &format!("h-{lang}-{i}"), lang, code)
                        .await
                        .0,
                );
                m.push(
                    execute(&mut iw, &format!("i-{lang}-{i}"), lang, code)
                        .await
                        .0,
                );
            }
            rows.push((lang.clone(), h, m));
        }
    });
    println!();
    println!("OCI image vs host image, {SAMPLES} samples each, interleaved; times in ms");
    println!(
        "{:<10} {:>10} {:>10} {:>10} {:>10} {:>12} {:>7}",
        "language", "host p50", "host p95", "image p50", "image p95", "p50 diff", "ratio"
    );
    for (lang, h, m) in rows {
        let (h50, m50) = (pct(h.clone(), 0.5), pct(m.clone(), 0.5));
        println!(
            "{:<10} {:>10.2} {:>10.2} {:>10.2} {:>10.2} {:>9.2} ms {:>7.2}",
            lang,
            h50,
            pct(h, 0.95),
            m50,
            pct(m, 0.95),
            m50 - h50,
            m50 / h50
        );
    }
}

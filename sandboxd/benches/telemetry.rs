//! `cargo bench -p sandboxd --bench telemetry`: what exporting traces costs an execution. Two daemons run side by
//! side, one without `telemetry` (no layer installed) and one exporting every span to an in-process OTLP/HTTP
//! receiver; execute→result of shell `true` and of python making three tool calls, through the project's client,
//! interleaved sample by sample. Prints the medians and the ratio of the exporting daemon to the other.
//!
//! Needs root (the daemons create containers). Figures, not assertions.

#![allow(missing_docs, clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use client::{Execute, ExecuteRequest, Language, Pool, RequestedLimits, ToolSpec};

const TOKEN: &str = "bench-token-0123456789abcdef";
const SAMPLES: usize = 60;

struct Daemon {
    /// Stopped when the bench drops it.
    _child: common::Stopped,
    pool: Pool,
    _dir: tempfile::TempDir,
}

impl Daemon {
    fn start(n: u32, extra: &str) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let port = common::free_port();
        let config = dir.path().join("config.yaml");
        std::fs::write(
            &config,
            format!(
                "listen: 127.0.0.1:{port}\nstate_dir: {}\nauth: {{tokens: [\"{TOKEN}\"]}}\n\
                 sandbox: {{cgroup_parent: sandboxd-bench-telemetry-{}-{n}, uid_base: {}}}\n{extra}",
                dir.path().join("state").display(),
                std::process::id(),
                450_000 + n * 1000,
            ),
        )
        .unwrap();
        let child = Command::new(env!("CARGO_BIN_EXE_sandboxd"))
            .arg("--config")
            .arg(&config)
            .env("SANDBOXD_LOG", "warn")
            .spawn()
            .unwrap();
        let t0 = Instant::now();
        while common::healthz(port).is_none() {
            assert!(
                t0.elapsed() < Duration::from_secs(60),
                "daemon {n} did not start"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        let pool = Pool::builder(format!("ws://127.0.0.1:{port}/ws"))
            .token(TOKEN)
            .build()
            .unwrap();
        Self {
            _child: common::Stopped(child),
            pool,
            _dir: dir,
        }
    }

    /// execute→result of one request, in milliseconds.
    async fn sample(&self, language: Language, code: &str, tools: bool) -> f64 {
        let mut req = ExecuteRequest::new(
            client::new_execution_id(),
            language,
            code,
            RequestedLimits::new(10_000, 128),
        );
        let t0 = Instant::now();
        if tools {
            req.tools = vec![ToolSpec::new("echo")];
            let r = self
                .pool
                .execute_with_tools(req, |_call| async { Ok(serde_json::json!(1)) })
                .await
                .unwrap();
            assert_eq!(r.tool_calls, Some(3));
        } else {
            self.pool.execute(req).await.unwrap();
        }
        t0.elapsed().as_secs_f64() * 1000.0
    }
}

/// An OTLP/HTTP receiver that counts the export requests it gets and answers each with success.
async fn receiver(count: Arc<AtomicUsize>) -> String {
    let app = axum::Router::new().route(
        "/v1/traces",
        axum::routing::post(move |_body: axum::body::Bytes| {
            count.fetch_add(1, Ordering::Relaxed);
            async { Vec::<u8>::new() }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    url
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

#[tokio::main]
async fn main() {
    if !nix::unistd::geteuid().is_root() {
        eprintln!("telemetry bench: needs root (the daemons create containers); skipped");
        return;
    }
    let exports = Arc::new(AtomicUsize::new(0));
    let url = receiver(exports.clone()).await;
    let off = Daemon::start(0, "");
    let on = Daemon::start(1, &format!("telemetry: {{otlp_endpoint: \"{url}\"}}"));
    let three_calls = "echo(x=1)\necho(x=2)\necho(x=3)";
    let cases = [
        ("shell true", Language::Shell, "true", false),
        ("python, 3 tool calls", Language::Python, three_calls, true),
    ];
    println!("execute→result, median of {SAMPLES} interleaved samples per daemon");
    println!(
        "{:<24} {:>12} {:>12} {:>8}",
        "", "traces off", "traces on", "on/off"
    );
    for (name, language, code, tools) in cases {
        // A few warm-up runs each, then the samples alternating between the daemons.
        for _ in 0..3 {
            off.sample(language, code, tools).await;
            on.sample(language, code, tools).await;
        }
        let (mut a, mut b) = (Vec::new(), Vec::new());
        for i in 0..SAMPLES {
            if i % 2 == 0 {
                a.push(off.sample(language, code, tools).await);
                b.push(on.sample(language, code, tools).await);
            } else {
                b.push(on.sample(language, code, tools).await);
                a.push(off.sample(language, code, tools).await);
            }
        }
        let (ma, mb) = (median(&mut a), median(&mut b));
        println!("{name:<24} {ma:>9.2} ms {mb:>9.2} ms {:>8.3}", mb / ma);
    }
    // The batch processor sends every 5 s: wait for one more batch so the count shows the export ran.
    tokio::time::sleep(Duration::from_secs(6)).await;
    println!(
        "OTLP export requests received from the exporting daemon: {}",
        exports.load(Ordering::Relaxed)
    );
}

//! The pool against a real daemon: many concurrent executions, what a result carries, the streaming form, and
//! backpressure from a slow consumer.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use client::{
    new_execution_id, ExecStatus, Execute, ExecuteRequest, Language, Pool, Reason, RequestedLimits,
    ServerMessage,
};
use protocol::{FileEncoding, FileSpec};

use super::daemon::{require_daemon, Daemon, DaemonOpts};

fn pool_for(d: &Daemon) -> client::PoolBuilder {
    Pool::builder(d.url()).token(d.token.clone())
}

fn request(language: Language, code: &str) -> ExecuteRequest {
    ExecuteRequest::new(
        new_execution_id(),
        language,
        code,
        RequestedLimits::new(20_000, 128),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn fifty_concurrent_executions_through_a_pool_of_5_plus_10_all_succeed() {
    let Some(bin) =
        require_daemon("fifty_concurrent_executions_through_a_pool_of_5_plus_10_all_succeed")
    else {
        return;
    };
    let d = Daemon::start(
        &bin,
        DaemonOpts {
            max_concurrent: 16,
            max_queue: 64,
            ..DaemonOpts::default()
        },
    )
    .await;
    let pool = pool_for(&d)
        .size(5)
        .max_overflow(10)
        .checkout_timeout(Duration::from_secs(120))
        .build()
        .unwrap();
    // Watch the pool never exceed size + overflow.
    let peak = Arc::new(AtomicUsize::new(0));
    let watcher = {
        let (pool, peak) = (pool.clone(), peak.clone());
        tokio::spawn(async move {
            loop {
                peak.fetch_max(pool.stats().total, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        })
    };
    let tasks: Vec<_> = (0..50)
        .map(|i| {
            let pool = pool.clone();
            tokio::spawn(async move {
                let r = pool
                    .execute(request(Language::Python, &format!("print({i} * 2)")))
                    .await;
                (i, r)
            })
        })
        .collect();
    let mut failures = Vec::new();
    for t in tasks {
        let (i, r) = t.await.unwrap();
        match r {
            Ok(r) if r.success() && r.stdout_text() == format!("{}\n", i * 2) => {}
            other => failures.push((i, format!("{other:?}"))),
        }
    }
    watcher.abort();
    assert!(failures.is_empty(), "failed executions: {failures:#?}");
    let peak = peak.load(Ordering::SeqCst);
    assert!(
        peak <= 15,
        "the pool opened {peak} connections, over size + overflow"
    );
    assert!(
        peak > 5,
        "50 concurrent executions used only {peak} connections: no overflow"
    );
    // Overflow connections are closed when they come back; the base ones stay.
    let stats = pool.stats();
    assert!(stats.total <= 5 && stats.in_use == 0, "{stats:?}");
}

#[tokio::test]
async fn a_result_carries_output_status_reason_and_usage() {
    let Some(bin) = require_daemon("a_result_carries_output_status_reason_and_usage") else {
        return;
    };
    let d = Daemon::start(&bin, DaemonOpts::default()).await;
    let pool = pool_for(&d).size(1).max_overflow(0).build().unwrap();

    let mut req = request(
        Language::Python,
        "import os, sys\n\
         sys.stdout.write(open('data/in.txt').read() + os.environ['GREETING'] + sys.stdin.read())\n\
         sys.stdout.flush()\n\
         sys.stdout.buffer.write(b'\\xff\\n')\n\
         print('to stderr', file=sys.stderr)\n\
         sys.exit(3)",
    );
    req.stdin = Some(" from stdin".into());
    req.env.insert("GREETING".into(), " hello".into());
    req.files.push(FileSpec {
        path: "data/in.txt".into(),
        content: "file".into(),
        encoding: FileEncoding::Utf8,
    });
    let r = pool.execute(req).await.unwrap();
    assert_eq!(r.status, ExecStatus::Failed, "{r:?}");
    assert_eq!(r.reason, Reason::Exited);
    assert_eq!(r.exit_code, Some(3));
    assert_eq!(r.stdout, b"file hello from stdin\xff\n", "{r:?}");
    assert_eq!(r.stderr_text(), "to stderr\n");
    assert!(r.duration > Duration::ZERO);
    assert!(r.resource_usage.peak_memory_mb > 0, "{r:?}");
    assert!(!r.truncated);
    assert_eq!(r.limits.map(|l| l.timeout_ms), Some(20_000));

    // A signal the daemon did not send.
    let r = pool
        .execute(request(Language::Shell, "kill -SEGV $$"))
        .await
        .unwrap();
    assert_eq!(r.reason, Reason::Signaled, "{r:?}");
    assert_eq!(r.exit_code, None);
    assert_eq!(r.signal.as_deref(), Some("SIGSEGV"));

    // The daemon's own timeout is a result, not a client error.
    let mut req = request(Language::Shell, "sleep 10");
    req.limits.timeout_ms = 300;
    let r = pool.execute(req).await.unwrap();
    assert_eq!(r.status, ExecStatus::Timeout, "{r:?}");
    assert_eq!(r.reason, Reason::Timeout);

    // A request the daemon refuses is a non-retryable server error.
    let mut req = request(Language::Shell, "true");
    req.limits.memory_mb = 100_000;
    let e = pool.execute(req).await.unwrap_err();
    assert_eq!(e.code(), Some(protocol::ErrorCode::InvalidRequest), "{e}");
    assert!(!e.is_retryable());
}

#[tokio::test]
async fn the_stream_yields_each_event_as_it_arrives() {
    let Some(bin) = require_daemon("the_stream_yields_each_event_as_it_arrives") else {
        return;
    };
    let d = Daemon::start(&bin, DaemonOpts::default()).await;
    let pool = pool_for(&d).build().unwrap();
    let mut ex = pool
        .execute_stream(request(
            Language::Shell,
            "echo one; sleep 0.5; echo two >&2; sleep 0.5; echo three",
        ))
        .await
        .unwrap();
    let mut kinds = Vec::new();
    let mut first_stdout_at = None;
    let start = std::time::Instant::now();
    while let Some(ev) = ex.next().await {
        let ev = ev.unwrap();
        protocol::parse_ts(&ev.ts).expect("server ts");
        match &ev.message {
            ServerMessage::Stdout(c) => {
                first_stdout_at.get_or_insert(start.elapsed());
                kinds.push(format!(
                    "stdout:{}",
                    String::from_utf8(c.decode().unwrap()).unwrap()
                ));
            }
            ServerMessage::Stderr(c) => kinds.push(format!(
                "stderr:{}",
                String::from_utf8(c.decode().unwrap()).unwrap()
            )),
            ServerMessage::Status { status, .. } => {
                kinds.push(format!("status:{}", status.as_str()))
            }
            m => kinds.push(m.type_name().to_owned()),
        }
    }
    assert_eq!(
        kinds,
        [
            "ack",
            "status:running",
            "stdout:one\n",
            "stderr:two\n",
            "stdout:three\n",
            "status:completed",
            "result"
        ]
    );
    // The first line came while the program was still running (streamed, not collected at the end).
    assert!(
        first_stdout_at.unwrap() < Duration::from_millis(900),
        "first stdout after {first_stdout_at:?}"
    );
    assert!(ex.is_done());
    assert!(ex.next().await.is_none());
    // The connection went back to the pool at the end of the stream.
    assert_eq!(pool.stats().in_use, 0, "{:?}", pool.stats());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_consumer_holds_the_program_back_instead_of_buffering() {
    let Some(bin) = require_daemon("a_slow_consumer_holds_the_program_back_instead_of_buffering")
    else {
        return;
    };
    const TOTAL: u64 = 96 << 20;
    let d = Daemon::start(
        &bin,
        DaemonOpts {
            max_output_bytes: 128 << 20,
            ..DaemonOpts::default()
        },
    )
    .await;
    let pool = pool_for(&d).size(2).build().unwrap();
    let mut req = request(
        Language::Python,
        &format!(
            "import sys\nblock = b'x' * 65536\nfor _ in range({}):\n    sys.stdout.buffer.write(block)\nsys.stdout.flush()\n\
             print('done', file=sys.stderr)",
            TOTAL / 65536
        ),
    );
    req.limits.max_output_bytes = Some(128 << 20);
    req.limits.timeout_ms = 120_000;
    let mut ex = pool.execute_stream(req).await.unwrap();
    // Wait for the program to start, then stop reading.
    loop {
        let ev = ex.next().await.unwrap().unwrap();
        if matches!(
            ev.message,
            ServerMessage::Status {
                status: ExecStatus::Running,
                ..
            }
        ) {
            break;
        }
    }
    tokio::time::sleep(Duration::from_secs(3)).await;
    // Unread, the program cannot have written everything: it is still running, blocked on its output.
    let pong = pool.ping().await.unwrap();
    assert_eq!(
        pong.load.active_executions, 1,
        "with nobody reading, the program finished: its output was buffered somewhere"
    );
    // Reading on gets every byte and the result.
    let mut bytes = 0u64;
    let mut stderr = Vec::new();
    let mut status = None;
    let mut result = None;
    while let Some(ev) = ex.next().await {
        match ev.unwrap().message {
            ServerMessage::Stdout(c) => bytes += c.decode().unwrap().len() as u64,
            ServerMessage::Stderr(c) => stderr.extend(c.decode().unwrap()),
            ServerMessage::Status { status: s, .. } if s.is_terminal() => status = Some(s),
            ServerMessage::Result(r) => result = Some(r),
            _ => {}
        }
    }
    let stderr = String::from_utf8_lossy(&stderr);
    assert_eq!(bytes, TOTAL, "{status:?} {result:?} stderr: {stderr}");
    assert_eq!(stderr, "done\n", "{status:?} {result:?}");
    assert_eq!(status, Some(ExecStatus::Completed), "{result:?}");
}

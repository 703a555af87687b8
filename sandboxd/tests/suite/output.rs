//! Output: base64 for bytes that are not UTF-8, chunks that never split a UTF-8 sequence, the output limit to the
//! byte (stdout and stderr together), and `ping` answered within 1 s while an execution floods output (spec
//! sections 3 and 4).

use std::time::{Duration, Instant};

use protocol::{ExecStatus, Limits, Reason, ServerMessage};
use serde_json::json;
use tokio_tungstenite::tungstenite::Message;

use super::harness::{
    exec_json, is_base64, ping_json, privileged, privileged_alone, with, Client, Daemon,
    DaemonOpts, MAX_LIMITS,
};

#[tokio::test]
async fn non_utf8_output_is_sent_as_base64() {
    let Some(_g) = privileged("non_utf8_output_is_sent_as_base64").await else {
        return;
    };
    let d = Daemon::start(DaemonOpts::default()).await;
    let mut c = Client::connect(&d).await;
    let code = "import sys\nsys.stdout.buffer.write(b'\\xff\\xfe\\xfd')\nsys.stdout.flush()\n\
                sys.stderr.buffer.write(b'\\x80ok')\nsys.stderr.flush()";
    let r = c
        .run_completed(exec_json("bin-1", "python", code, 20_000, 128))
        .await;
    assert_eq!(r.stdout(), b"\xff\xfe\xfd", "{}", r.dump());
    assert!(
        r.stdout_chunks().iter().any(|c| is_base64(c)),
        "invalid UTF-8 goes out as encoding base64: {:?}",
        r.stdout_chunks()
    );
    let raw = r
        .raw
        .iter()
        .find(|v| v["type"] == "stdout")
        .expect("a stdout message");
    assert_eq!(raw["encoding"], "base64", "{raw}");
    assert_eq!(r.stderr(), b"\x80ok", "{}", r.dump());
    assert!(
        r.stderr_chunks().iter().any(|c| is_base64(c)),
        "{:?}",
        r.stderr_chunks()
    );
    assert_eq!((r.result().stdout_bytes, r.result().stderr_bytes), (3, 3));
}

#[tokio::test]
async fn utf8_sequences_are_never_split() {
    let Some(_g) = privileged("utf8_sequences_are_never_split").await else {
        return;
    };
    let d = Daemon::start(DaemonOpts::default()).await;
    let mut c = Client::connect(&d).await;
    // "é" (2 bytes) and "😀" (4 bytes) each written in pieces, flushed, with pauses so the daemon reads the pieces
    // separately.
    let code = r#"
import sys, time
e = "é".encode()
g = "😀".encode()
pieces = [b"ab" + e[:1], e[1:] + b"cd" + g[:1], g[1:3], g[3:] + b"!\n"]
for p in pieces:
    sys.stdout.buffer.write(p)
    sys.stdout.flush()
    time.sleep(0.2)
"#;
    let r = c
        .run_completed(exec_json("utf8-1", "python", code, 20_000, 128))
        .await;
    let chunks = r.stdout_chunks();
    for ch in &chunks {
        assert!(
            !is_base64(ch),
            "valid UTF-8 written in pieces must arrive as text, never split or base64: {chunks:?}"
        );
    }
    let text: String = chunks.iter().map(|c| c.data.as_str()).collect();
    assert_eq!(text, "abécd😀!\n", "{chunks:?}");
}

#[tokio::test]
async fn output_limit_cuts_at_the_exact_byte() {
    let Some(_g) = privileged("output_limit_cuts_at_the_exact_byte").await else {
        return;
    };
    let d = Daemon::start(DaemonOpts::default()).await;
    let mut c = Client::connect(&d).await;
    let cases = [
        ("limit-stdout", "import sys\nsys.stdout.write('x' * 10_000_000)\nsys.stdout.flush()\nprint('survived')"),
        (
            "limit-both",
            "import sys\nfor i in range(100_000):\n    sys.stdout.write('o' * 100); sys.stdout.flush()\n    \
             sys.stderr.write('e' * 100); sys.stderr.flush()\nprint('survived')",
        ),
    ];
    for (id, code) in cases {
        let r = c
            .run(with(
                exec_json(id, "python", code, 30_000, 128),
                json!({"limits": {"max_output_bytes": 1000}}),
            ))
            .await;
        let total = r.stdout().len() + r.stderr().len();
        assert_eq!(
            total,
            1000,
            "exactly max_output_bytes are delivered: {}",
            r.dump()
        );
        assert_eq!(
            r.terminal_status(),
            Some(ExecStatus::Failed),
            "{}",
            r.dump()
        );
        let res = r.result();
        assert_eq!(res.reason, Reason::OutputLimit, "{}", r.dump());
        assert!(res.truncated, "{}", r.dump());
        assert_eq!(res.stdout_bytes + res.stderr_bytes, 1000, "{}", r.dump());
        assert_eq!(res.stdout_bytes as usize, r.stdout().len());
        assert_eq!(res.exit_code, None, "killed by the daemon: {}", r.dump());
        assert!(!r.stdout_text().contains("survived"), "{}", r.dump());
    }
}

#[tokio::test]
async fn output_of_exactly_the_limit_completes() {
    let Some(_g) = privileged("output_of_exactly_the_limit_completes").await else {
        return;
    };
    let d = Daemon::start(DaemonOpts::default()).await;
    let mut c = Client::connect(&d).await;
    let cases = [
        ("exact-stdout", "import sys\nsys.stdout.write('x' * 1000)"),
        (
            "exact-both",
            "import sys\nsys.stdout.write('o' * 600); sys.stdout.flush()\nsys.stderr.write('e' * 400)",
        ),
    ];
    for (id, code) in cases {
        let r = c
            .run_completed(with(
                exec_json(id, "python", code, 30_000, 128),
                json!({"limits": {"max_output_bytes": 1000}}),
            ))
            .await;
        assert_eq!(r.stdout().len() + r.stderr().len(), 1000, "{}", r.dump());
        let res = r.result();
        assert_eq!(
            (res.exit_code, res.reason),
            (Some(0), Reason::Exited),
            "{}",
            r.dump()
        );
        assert!(!res.truncated, "{}", r.dump());
    }
}

#[tokio::test]
async fn output_keeps_its_order_per_stream() {
    let Some(_g) = privileged("output_keeps_its_order_per_stream").await else {
        return;
    };
    let d = Daemon::start(DaemonOpts::default()).await;
    let mut c = Client::connect(&d).await;
    // 20000 numbered lines per stream, in many small writes, far more than one read of the pipe.
    let code = "import sys\nfor i in range(20000):\n    sys.stdout.write('%d\\n' % i)\n    \
                sys.stderr.write('e%d\\n' % i)\n    if i % 100 == 0:\n        sys.stdout.flush(); sys.stderr.flush()";
    let r = c
        .run_completed(exec_json("order", "python", code, 30_000, 128))
        .await;
    let out: String = (0..20000).map(|i| format!("{i}\n")).collect();
    let err: String = (0..20000).map(|i| format!("e{i}\n")).collect();
    assert!(
        r.stdout_text() == out,
        "stdout in order of production ({} bytes)",
        r.stdout().len()
    );
    assert!(
        String::from_utf8_lossy(&r.stderr()) == err,
        "stderr in order of production ({} bytes)",
        r.stderr().len()
    );
    assert!(r.stdout_chunks().len() > 1 || r.stderr_chunks().len() > 1);
}

/// Spec section 3: "A ping MUST be answered within 1 s even while executions flood output on the same
/// connection." Runs alone, so the bound is measured on a quiet machine.
#[tokio::test]
async fn ping_is_answered_within_1s_during_an_output_flood() {
    let Some(_g) = privileged_alone("ping_is_answered_within_1s_during_an_output_flood").await
    else {
        return;
    };
    let big = 1u64 << 36;
    let d = Daemon::start(DaemonOpts {
        max_limits: Limits {
            max_output_bytes: big,
            ..MAX_LIMITS
        },
        ..DaemonOpts::default()
    })
    .await;
    let mut c = Client::connect(&d).await;
    c.send_json(&with(
        exec_json(
            "flood",
            "shell",
            "exec yes 'flood flood flood flood flood flood flood'",
            60_000,
            256,
        ),
        json!({"limits": {"max_output_bytes": big}}),
    ))
    .await;

    // Reads one frame; counts flood output cheaply, parses everything else.
    async fn step(c: &mut Client, flood_bytes: &mut u64) -> Option<ServerMessage> {
        let frame = c
            .next_frame(Duration::from_secs(10))
            .await
            .expect("the flood keeps the connection busy")
            .expect("connection open");
        let Message::Text(t) = frame else {
            panic!("unexpected frame {frame:?}");
        };
        if t.as_str()
            .starts_with(r#"{"v":1,"type":"stdout","id":"flood""#)
        {
            *flood_bytes += t.len() as u64;
            return None;
        }
        let (m, raw) = Client::parse(t.as_str());
        if m.is_terminal() {
            panic!("the flood ended before the test was done: {raw}");
        }
        Some(m)
    }

    let mut flood_bytes = 0u64;
    while flood_bytes < 8 << 20 {
        step(&mut c, &mut flood_bytes).await;
    }
    let before = flood_bytes;
    let mut worst = Duration::ZERO;
    for i in 0..5 {
        c.send_json(&ping_json()).await;
        let sent = Instant::now();
        loop {
            if let Some(ServerMessage::Pong(_)) = step(&mut c, &mut flood_bytes).await {
                break;
            }
            assert!(
                sent.elapsed() < Duration::from_secs(1),
                "ping {i}: no pong within 1 s during the flood ({} bytes of output read meanwhile)",
                flood_bytes - before
            );
        }
        let took = sent.elapsed();
        worst = worst.max(took);
        assert!(
            took < Duration::from_secs(1),
            "ping {i}: pong after {took:?} (> 1 s) during the flood"
        );
        // Keep reading the flood for a while before the next ping.
        let pause = Instant::now();
        while pause.elapsed() < Duration::from_millis(200) {
            step(&mut c, &mut flood_bytes).await;
        }
    }
    assert!(
        flood_bytes - before > 1 << 20,
        "the execution was really flooding while pinging ({} bytes)",
        flood_bytes - before
    );
    eprintln!(
        "flood: {} MiB read, slowest pong {worst:?}",
        flood_bytes >> 20
    );

    c.cancel("flood").await;
    // Drain the rest of the flood cheaply, then look at the end.
    let end = loop {
        let frame = c
            .next_frame(Duration::from_secs(30))
            .await
            .expect("the flood ends after cancel")
            .expect("connection open");
        let Message::Text(t) = frame else {
            panic!("unexpected frame {frame:?}");
        };
        if t.as_str().starts_with(r#"{"v":1,"type":"stdout""#) {
            continue;
        }
        let (m, raw) = Client::parse(t.as_str());
        if m.is_terminal() {
            break (m, raw);
        }
        if let ServerMessage::Status { status, .. } = m {
            assert_eq!(status, ExecStatus::Cancelled, "{raw}");
        }
    };
    match end.0 {
        ServerMessage::Result(r) => assert_eq!(r.reason, Reason::Cancelled, "{}", end.1),
        _ => panic!("expected the flood's result, got {}", end.1),
    }
}

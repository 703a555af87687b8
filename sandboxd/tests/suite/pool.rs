//! The warm pool: executions take containers created ahead of time, get the request's limits in them, fall back to
//! creating their own when the pool is empty or their class differs, and leave nothing behind either way.

use std::time::Duration;

use protocol::{ExecStatus, Reason};
use serde_json::json;

use super::harness::{
    exec_json, privileged, processes_with_arg, stdout_contains, unique_marker, wait_until, with,
    Client, Daemon, DaemonOpts,
};

/// `/healthz`'s pool counters: (ready, hits, misses).
async fn pool(d: &Daemon) -> (u64, u64, u64) {
    let (_, h) = d.healthz().await;
    let n = |k: &str| h["pool"][k].as_u64().unwrap_or(u64::MAX);
    (n("ready"), n("hits"), n("misses"))
}

/// Waits until every language's pool is full again.
async fn wait_full(d: &Daemon) {
    let (_, h) = d.healthz().await;
    let languages = h["languages"].as_array().map_or(0, Vec::len).max(1);
    let full = (d.pool_size.div_ceil(languages) * languages) as u64;
    wait_until("the pool to be full", Duration::from_secs(20), || async {
        let (ready, _, _) = pool(d).await;
        if ready == full {
            Ok(())
        } else {
            Err(format!("{ready} of {full} ready"))
        }
    })
    .await;
}

#[tokio::test]
async fn executions_take_ready_containers_and_the_pool_refills() {
    let Some(_g) = privileged("executions_take_ready_containers_and_the_pool_refills").await else {
        return;
    };
    // Two ready containers per language (three languages on the host image).
    let d = Daemon::start(DaemonOpts {
        pool_size: 6,
        ..DaemonOpts::default()
    })
    .await;
    let mut c = Client::connect(&d).await;
    for i in 0..4 {
        wait_full(&d).await;
        let (_, hits, misses) = pool(&d).await;
        for (lang, code) in [("shell", "echo warm"), ("python", "print('warm')")] {
            let r = c
                .run(exec_json(
                    &format!("warm-{lang}-{i}"),
                    lang,
                    code,
                    10_000,
                    64,
                ))
                .await;
            assert_eq!(
                (r.terminal_status(), r.stdout_text().as_str()),
                (Some(ExecStatus::Completed), "warm\n"),
                "{}",
                r.dump()
            );
        }
        let (_, h2, m2) = pool(&d).await;
        assert_eq!(
            (h2 - hits, m2 - misses),
            (2, 0),
            "both executions took a ready container"
        );
    }
    wait_until(
        "nothing but the full pool to be left",
        Duration::from_secs(15),
        || d.leftovers(),
    )
    .await;
}

#[tokio::test]
async fn an_exhausted_pool_falls_back_to_creating_containers() {
    let Some(_g) = privileged("an_exhausted_pool_falls_back_to_creating_containers").await else {
        return;
    };
    let d = Daemon::start(DaemonOpts {
        max_concurrent: 6,
        max_queue: 0,
        pool_size: 1,
        ..DaemonOpts::default()
    })
    .await;
    wait_full(&d).await;
    let (_, hits, misses) = pool(&d).await;
    let mut c = Client::connect(&d).await;
    let ids: Vec<String> = (0..6).map(|i| format!("burst-{i}")).collect();
    for id in &ids {
        c.send_json(&exec_json(id, "shell", "sleep 0.3; echo done", 10_000, 64))
            .await;
    }
    for id in &ids {
        let r = c.collect(id).await;
        assert_eq!(
            (r.terminal_status(), r.stdout_text().as_str()),
            (Some(ExecStatus::Completed), "done\n"),
            "{}",
            r.dump()
        );
    }
    let (_, h2, m2) = pool(&d).await;
    assert_eq!(h2 + m2 - hits - misses, 6, "every execution counted once");
    assert!(
        h2 - hits >= 1 && m2 - misses >= 4,
        "one ready shell container, the rest created on demand: {} hits, {} misses",
        h2 - hits,
        m2 - misses
    );
    wait_until(
        "nothing but the full pool to be left",
        Duration::from_secs(15),
        || d.leftovers(),
    )
    .await;
}

#[tokio::test]
async fn a_pooled_container_gets_the_requests_memory_and_pids_limits() {
    let Some(_g) = privileged("a_pooled_container_gets_the_requests_memory_and_pids_limits").await
    else {
        return;
    };
    let d = Daemon::start(DaemonOpts {
        pool_size: 1,
        ..DaemonOpts::default()
    })
    .await;
    let mut c = Client::connect(&d).await;

    // Pooled containers are created with the configured maximum (1 GiB here); the request asks for 32 MiB.
    wait_full(&d).await;
    let (_, hits, _) = pool(&d).await;
    let r = c
        .run(exec_json(
            "pooled-oom",
            "python",
            "b = bytearray(200 << 20)\nprint('allocated')",
            20_000,
            32,
        ))
        .await;
    assert_eq!(r.result().reason, Reason::Oom, "{}", r.dump());
    assert_eq!(pool(&d).await.1, hits + 1, "it ran in a pooled container");

    // pids_max 8 (created with 256): the ninth process of the container cannot start.
    wait_full(&d).await;
    let (_, hits, _) = pool(&d).await;
    let code = r#"
import os, time
n = 0
for i in range(20):
    try:
        if os.fork() == 0:
            time.sleep(2)
            os._exit(0)
        n += 1
    except OSError as e:
        print("refused after", n, e.errno)
        break
"#;
    let r = c
        .run(with(
            exec_json("pooled-pids", "python", code, 20_000, 128),
            json!({"limits": {"timeout_ms": 20_000, "memory_mb": 128, "pids_max": 8}}),
        ))
        .await;
    assert_eq!(
        r.stdout_text(),
        "refused after 6 11\n",
        "8 processes in all (the init, the program and 6 children), EAGAIN after: {}",
        r.dump()
    );
    assert_eq!(pool(&d).await.1, hits + 1, "it ran in a pooled container");
    wait_until(
        "nothing but the full pool to be left",
        Duration::from_secs(15),
        || d.leftovers(),
    )
    .await;
}

#[tokio::test]
async fn another_disk_size_gets_a_container_of_its_own_size() {
    let Some(_g) = privileged("another_disk_size_gets_a_container_of_its_own_size").await else {
        return;
    };
    let d = Daemon::start(DaemonOpts {
        pool_size: 1,
        ..DaemonOpts::default()
    })
    .await;
    wait_full(&d).await;
    let (_, hits, misses) = pool(&d).await;
    let mut c = Client::connect(&d).await;
    let code = "import os\nst = os.statvfs('/workspace')\nprint(st.f_blocks * st.f_frsize >> 20)";
    let limits =
        |disk: u64| json!({"limits": {"timeout_ms": 10_000, "memory_mb": 64, "disk_mb": disk}});
    let r = c
        .run(with(
            exec_json("disk-8", "python", code, 10_000, 64),
            limits(8),
        ))
        .await;
    assert_eq!(r.stdout_text(), "8\n", "{}", r.dump());
    let r = c
        .run(with(
            exec_json("disk-64", "python", code, 10_000, 64),
            limits(64),
        ))
        .await;
    assert_eq!(r.stdout_text(), "64\n", "{}", r.dump());
    let (_, h2, m2) = pool(&d).await;
    assert_eq!(
        (h2 - hits, m2 - misses),
        (1, 1),
        "8 MiB is created on demand, the default 64 MiB comes from the pool"
    );
}

#[tokio::test]
async fn without_a_pool_every_execution_creates_its_container() {
    let Some(_g) = privileged("without_a_pool_every_execution_creates_its_container").await else {
        return;
    };
    let d = Daemon::start(DaemonOpts {
        pool_size: 0,
        ..DaemonOpts::default()
    })
    .await;
    let mut c = Client::connect(&d).await;
    for i in 0..3 {
        let r = c
            .run(exec_json(
                &format!("cold-{i}"),
                "shell",
                "echo cold",
                10_000,
                64,
            ))
            .await;
        assert_eq!(r.stdout_text(), "cold\n", "{}", r.dump());
    }
    let (ready, hits, misses) = pool(&d).await;
    // The self-test ran one execution per language before these.
    assert_eq!((ready, hits), (0, 0));
    assert!(misses >= 3);
    wait_until("nothing to be left", Duration::from_secs(15), || {
        d.leftovers()
    })
    .await;
}

#[tokio::test]
async fn sigterm_from_the_host_reaches_the_program_but_its_own_signals_to_pid_1_do_not() {
    let Some(_g) =
        privileged("sigterm_from_the_host_reaches_the_program_but_its_own_signals_to_pid_1_do_not")
            .await
    else {
        return;
    };
    let d = Daemon::start(DaemonOpts::default()).await;
    let mut c = Client::connect(&d).await;
    let marker = unique_marker();
    // The program signals pid 1 itself (ignored), then waits for a SIGTERM from outside.
    let code = format!(
        r#"
import os, signal, sys, time
MARK = "{marker}"
got = []
signal.signal(signal.SIGTERM, lambda s, f: got.append(s))
os.kill(1, signal.SIGTERM)
# Standard signals do not queue: give the init time to take this one before the host's arrives.
time.sleep(1)
# One write per line (PYTHONUNBUFFERED makes print write each piece on its own, and the test looks for the
# whole line in one stdout chunk).
sys.stdout.write(f"after own {{len(got)}}\n"); sys.stdout.flush()
deadline = time.time() + 10
while not got and time.time() < deadline:
    time.sleep(0.05)
sys.stdout.write(f"after host {{got}}\n"); sys.stdout.flush()
"#
    );
    // A plain interpreter: the program is found below by its command line and environment, which a warm one's
    // are not (they are the stub's; the init forwards to either the same way).
    let exec = with(
        exec_json("term", "python", &code, 20_000, 64),
        json!({"env": {"MARK": marker.clone()}, "warm": false}),
    );
    c.send_json(&exec).await;
    c.observe(
        "the program to be waiting",
        stdout_contains("term", "after own 0"),
    )
    .await;
    // The program's host process carries the marker in its environment, not its arguments: find it by the code
    // file of this container instead, through its parent, the container's init.
    let program = wait_until(
        "the program's host process",
        Duration::from_secs(5),
        || async {
            let found: Vec<_> = processes_with_arg("/sandbox/main.py")
                .into_iter()
                .filter(|p| {
                    std::fs::read(format!("/proc/{}/environ", p.pid))
                        .is_ok_and(|e| e.windows(marker.len()).any(|w| w == marker.as_bytes()))
                })
                .collect();
            match found.as_slice() {
                [p] => Ok(p.clone()),
                other => Err(format!("{other:?}")),
            }
        },
    )
    .await;
    // The daemon started this init (our test's daemon); signal it by pid like the service manager would.
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(program.ppid),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    let r = c.collect("term").await;
    assert_eq!(
        (r.terminal_status(), r.stdout_text().as_str()),
        (
            Some(ExecStatus::Completed),
            "after own 0\nafter host [15]\n"
        ),
        "{}",
        r.dump()
    );
}

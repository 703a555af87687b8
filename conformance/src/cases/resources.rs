//! R: resources and lifecycle. Cleanup after a disconnect, a timeout and a normal exit, checked through the
//! protocol (a later execution sees no process or file of the earlier one, and `pong.load` returns to 0), and the
//! enforcement of limits.

use std::time::{Duration, Instant};

use serde_json::json;

use super::common::{case, check_status, idle, run_marked, wait_no_marked_processes, C};
use super::messages::{oom_exec, timeout_exec, TIMEOUT_LIMIT_MS};
use crate::ctx::{Ctx, TIMEOUT_MS};
use crate::framework::{checked, Case, CaseResult, Stop};
use crate::msgs::with;
use crate::wire::short;
use crate::{check, skip};

const CLOSE: &str = "When the connection closes, every execution it started MUST be killed and cleaned up (processes, cgroups, mounts, files). Executions are never orphaned and never outlive their connection.";
const DEFAULTS: &str = "`max_output_bytes` defaults to 1 MiB (stdout and stderr counted together).";
const LIMITS: &str = "`pids_max` (defaults to 64), `disk_mb` (size of the writable scratch space).";
const TIMEOUT: &str = "`timeout` (wall clock over `timeout_ms`).";

/// The cases of this group, in id order.
pub static CASES: &[Case] = &[
    case!(
        "R.cleanup.1",
        Must,
        "1",
        "A disconnect kills the connection's running execution",
        CLOSE,
        disconnect_kills
    ),
    case!(
        "R.cleanup.2",
        Must,
        "1, 6",
        "After a disconnect the load returns to 0",
        CLOSE,
        disconnect_load
    ),
    case!(
        "R.cleanup.3",
        Must,
        "1",
        "After a disconnect no file of the execution is left",
        CLOSE,
        disconnect_files
    ),
    case!(
        "R.cleanup.4",
        Must,
        "1, 6",
        "A disconnect also ends the connection's queued executions",
        CLOSE,
        disconnect_queued
    ),
    case!(
        "R.cleanup.5",
        Should,
        "1",
        "A disconnect leaves other connections' executions alone",
        CLOSE,
        other_connection
    ),
    case!(
        "R.cleanup.6",
        Must,
        "1, 4",
        "A timeout kills the execution's whole process tree",
        CLOSE,
        timeout_tree
    ),
    case!(
        "R.cleanup.7",
        Should,
        "1",
        "Background processes do not outlive a finished execution",
        CLOSE,
        exit_tree
    ),
    case!(
        "R.limits.1",
        Must,
        "3",
        "max_output_bytes defaults to 1 MiB",
        DEFAULTS,
        default_output_limit
    ),
    case!(
        "R.limits.2",
        Should,
        "3",
        "pids_max is enforced",
        LIMITS,
        pids_enforced
    ),
    case!(
        "R.limits.3",
        Should,
        "3",
        "disk_mb limits the writable scratch space",
        LIMITS,
        disk_enforced
    ),
    case!(
        "R.limits.4",
        Should,
        "4",
        "A timeout ends the execution promptly (within 2 s of timeout_ms)",
        TIMEOUT,
        timeout_prompt
    ),
    case!(
        "R.limits.5",
        Info,
        "4",
        "Resource usage reported by the result",
        "`resource_usage:{peak_memory_mb, cpu_time_ms}`",
        usage
    ),
];

/// Starts `code` on a new connection and waits for its first output line; returns the connection.
async fn start(ctx: &Ctx, tag: &str, code: &str) -> Result<(crate::client::Conn, String), Stop> {
    let lang = ctx.shell()?;
    let mut c = ctx.connect().await?;
    let id = ctx.id(tag);
    c.send_json(&ctx.exec(&id, lang, code)).await?;
    c.observe(ctx.secs(10), "the first output", |m| {
        m.is_for(&id) && m.kind() == "stdout"
    })
    .await?;
    Ok((c, id))
}

async fn disconnect_kills(ctx: C) -> CaseResult {
    let marker = ctx.marker();
    let (c, _) = start(
        &ctx,
        "bye",
        &format!("sleep 300.{marker} & echo started; wait"),
    )
    .await?;
    // An abrupt disconnect: the TCP connection ends without a close frame.
    drop(c);
    let mut later = ctx.connect().await?;
    wait_no_marked_processes(&ctx, &mut later, &marker, ctx.secs(10)).await?;
    idle(&ctx, &mut later).await?;
    Ok(String::new())
}

async fn disconnect_load(ctx: C) -> CaseResult {
    let lang = ctx.shell()?;
    let mut c = ctx.connect().await?;
    let ids = [ctx.id("load-a"), ctx.id("load-b")];
    for id in &ids {
        c.send_json(&ctx.exec(id, lang, "echo started; sleep 300"))
            .await?;
    }
    for id in &ids {
        c.observe(ctx.secs(10), "status:running", |m| {
            m.is_for(id) && m.status() == Some("running")
        })
        .await?;
    }
    let pong = c.ping(ctx.secs(5)).await?;
    let active = pong.raw["load"]["active_executions"].as_u64().unwrap_or(0);
    check!(
        active >= 2,
        "two executions run but pong.load says {}",
        short(&pong.raw["load"])
    );
    c.close().await;
    let mut later = ctx.connect().await?;
    idle(&ctx, &mut later).await?;
    Ok(String::new())
}

/// A shell snippet that prints how many files named `*fsp-<marker>*` (marker read from stdin) are in the working
/// directory, TMPDIR or /tmp. Without `find` it fails instead of counting nothing.
pub const COUNT_MARKED_FILES: &str = r#"command -v find >/dev/null 2>&1 || { echo "find is not available" >&2; exit 3; }
read -r m
n=0
for d in . "${TMPDIR:-/tmp}" /tmp; do
  k=$(find "$d" -name "*fsp-$m*" 2>/dev/null | wc -l)
  n=$((n+k))
done
echo "count=$n"
"#;

async fn disconnect_files(ctx: C) -> CaseResult {
    let marker = ctx.marker();
    let code = format!(
        "echo secret > ./fsp-{marker}; mkdir -p sub; echo secret > sub/fsp-{marker}; \
         echo secret > \"${{TMPDIR:-/tmp}}/fsp-{marker}\"; echo written; exec sleep 300"
    );
    let (c, _) = start(&ctx, "files", &code).await?;
    c.close().await;
    let lang = ctx.shell()?;
    let mut later = ctx.connect().await?;
    let started = Instant::now();
    loop {
        let e = run_marked(
            &ctx,
            &mut later,
            lang,
            "findfiles",
            COUNT_MARKED_FILES,
            &marker,
        )
        .await?;
        let out = e.stdout_text();
        check!(
            e.terminal_status().as_deref() == Some("completed"),
            "the file search did not complete: {}",
            e.dump()
        );
        if out.trim() == "count=0" {
            return Ok(String::new());
        }
        if started.elapsed() > ctx.secs(10) {
            return Err(Stop::Fail(format!(
                "a later execution still finds {} file(s) the disconnected execution wrote (working directory or TMPDIR)",
                out.trim().trim_start_matches("count=")
            )));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn disconnect_queued(ctx: C) -> CaseResult {
    let obs = match super::capacity::observe(&ctx).await {
        Ok(o) => o,
        Err(s) => skip!("the capacity is unknown: {}", s.message()),
    };
    if obs.max_queue == 0 {
        skip!("the server queues nothing (max_queue 0)");
    }
    let lang = ctx.shell()?;
    let mut c = ctx.connect().await?;
    let n = obs.max_concurrent + 1;
    let ids: Vec<String> = (0..n).map(|_| ctx.id("dq")).collect();
    for id in &ids {
        c.send_json(&ctx.exec(id, lang, "sleep 300")).await?;
        c.observe(ctx.secs(10), "the ack", |m| {
            m.is_for(id) && m.kind() == "ack"
        })
        .await?;
    }
    let pong = c.ping(ctx.secs(5)).await?;
    check!(
        pong.raw["load"]["queue_depth"].as_u64().unwrap_or(0) >= 1,
        "precondition: one execution should be queued: {}",
        short(&pong.raw["load"])
    );
    drop(c);
    let mut later = ctx.connect().await?;
    idle(&ctx, &mut later).await?;
    Ok(format!(
        "{} running and 1 queued execution ended with their connection",
        obs.max_concurrent
    ))
}

async fn other_connection(ctx: C) -> CaseResult {
    let lang = ctx.shell()?;
    let mut stay = ctx.connect().await?;
    let id = ctx.id("stay");
    let sent = Instant::now();
    stay.send_json(&ctx.exec(&id, lang, "echo started; sleep 1; echo stayed"))
        .await?;
    stay.observe(ctx.secs(10), "status:running", |m| {
        m.is_for(&id) && m.status() == Some("running")
    })
    .await?;
    let (gone, _) = start(&ctx, "gone", "echo started; sleep 300").await?;
    drop(gone);
    let e = stay.collect(&id, sent, ctx.end_within(TIMEOUT_MS)).await?;
    check!(
        e.terminal_status().as_deref() == Some("completed")
            && e.stdout_text() == "started\nstayed\n",
        "another connection's disconnect affected this execution: {}",
        e.dump()
    );
    Ok(String::new())
}

async fn timeout_tree(ctx: C) -> CaseResult {
    let code = |marker: &str| {
        format!(
            "( sleep 300.{marker} >/dev/null 2>&1 & ) ; sleep 299.{marker} & echo started; wait"
        )
    };
    leaves_no_tree(&ctx, "ttree", code, Some(1000), "timeout").await
}

async fn exit_tree(ctx: C) -> CaseResult {
    let code = |marker: &str| format!("( sleep 300.{marker} >/dev/null 2>&1 & ) ; echo done");
    leaves_no_tree(&ctx, "etree", code, None, "completed").await
}

/// Runs `code(marker)`, which leaves processes with the marker in their command line behind, with `timeout_ms`
/// (the usual limit if `None`); checks it ends with `status` and that later no process of it is left.
async fn leaves_no_tree(
    ctx: &Ctx,
    tag: &str,
    code: impl FnOnce(&str) -> String,
    timeout_ms: Option<u64>,
    status: &str,
) -> CaseResult {
    let lang = ctx.shell()?;
    let marker = ctx.marker();
    let mut c = ctx.connect().await?;
    let id = ctx.id(tag);
    let exec = ctx.exec(&id, lang, &code(&marker));
    let e = match timeout_ms {
        Some(t) => {
            let exec = with(exec, json!({"limits": {"timeout_ms": t}}));
            c.run(&exec, ctx.end_within(t)).await?
        }
        None => ctx.run(&mut c, &exec).await?,
    };
    check_status(&e, status)?;
    wait_no_marked_processes(ctx, &mut c, &marker, ctx.secs(10)).await?;
    Ok(String::new())
}

async fn default_output_limit(ctx: C) -> CaseResult {
    let lang = ctx.shell()?;
    if ctx
        .max_limit("max_output_bytes")
        .is_some_and(|m| m < 1 << 20)
    {
        skip!("the server's maximum max_output_bytes is below the 1 MiB default");
    }
    let mut c = ctx.connect().await?;
    let id = ctx.id("default-out");
    let code = "head -c 1048676 /dev/zero | tr '\\0' x; sleep 5; echo survived";
    let e = ctx.run(&mut c, &ctx.exec(&id, lang, code)).await?;
    let total = checked(e.stdout())?.len() + checked(e.stderr())?.len();
    check!(
        total == 1 << 20,
        "{total} bytes were delivered without max_output_bytes (default 1 MiB = 1048576): {}",
        e.dump()
    );
    super::common::ended(&e, "failed", "output_limit")?;
    Ok(String::new())
}

async fn pids_enforced(ctx: C) -> CaseResult {
    let lang = ctx.python()?;
    let mut c = ctx.connect().await?;
    let id = ctx.id("pids");
    let code = r#"
import os, time, json
started, error = 0, None
for i in range(40):
    try:
        pid = os.fork()
    except OSError as e:
        error = e.errno
        break
    if pid == 0:
        time.sleep(3)
        os._exit(0)
    started += 1
print(json.dumps({"started": started, "errno": error}))
"#;
    let e = ctx
        .run(
            &mut c,
            &ctx.exec_with(&id, lang, code, json!({"limits": {"pids_max": 16}})),
        )
        .await?;
    let out: serde_json::Value = serde_json::from_slice(&checked(e.stdout())?).map_err(|err| {
        Stop::Fail(format!(
            "the fork probe did not report ({err}): {}",
            e.dump()
        ))
    })?;
    let started = out["started"].as_u64().unwrap_or(0);
    check!(
        started < 16,
        "with pids_max 16 the program forked {started} children: {out}"
    );
    Ok(format!(
        "forks stopped after {started} children (errno {})",
        out["errno"]
    ))
}

async fn disk_enforced(ctx: C) -> CaseResult {
    let lang = ctx.shell()?;
    let mut c = ctx.connect().await?;
    let id = ctx.id("disk");
    let code =
        "head -c 33554432 /dev/zero > ./big 2>/dev/null; echo \"rc=$? size=$(wc -c < ./big)\"";
    let e = ctx
        .run(
            &mut c,
            &ctx.exec_with(&id, lang, code, json!({"limits": {"disk_mb": 8}})),
        )
        .await?;
    let out = e.stdout_text();
    let size: u64 = out
        .split("size=")
        .nth(1)
        .and_then(|s| s.trim().parse().ok())
        .ok_or_else(|| Stop::Fail(format!("the disk probe did not report: {}", e.dump())))?;
    check!(
        size <= (8 << 20) + (1 << 20),
        "with disk_mb 8 the program wrote a {size}-byte file in its working directory"
    );
    check!(
        !out.contains("rc=0 "),
        "writing 32 MiB with disk_mb 8 succeeded: {out:?}"
    );
    Ok(format!("the write stopped at {size} bytes"))
}

async fn timeout_prompt(ctx: C) -> CaseResult {
    let e = timeout_exec(&ctx).await?;
    let running = e
        .msgs
        .iter()
        .find(|m| m.status() == Some("running"))
        .map(|m| m.at);
    let end = e.msgs.last().map(|m| m.at);
    let (Some(a), Some(b)) = (running, end) else {
        return Err(Stop::Fail(format!(
            "no running status or no end: {}",
            e.dump()
        )));
    };
    let took = b.duration_since(a);
    let bound = Duration::from_millis(TIMEOUT_LIMIT_MS) + ctx.secs(2);
    check!(took <= bound, "the execution with timeout_ms {TIMEOUT_LIMIT_MS} ended {took:?} after it started (bound {bound:?})");
    Ok(format!("ended {took:?} after status:running"))
}

async fn usage(ctx: C) -> CaseResult {
    let e = oom_exec(&ctx).await?;
    let r = e
        .result()
        .ok_or_else(|| Stop::Fail(format!("no result: {}", e.dump())))?;
    Ok(format!(
        "an execution that ran out of memory_mb 64 reported resource_usage {}",
        short(&r["resource_usage"])
    ))
}

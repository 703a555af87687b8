//! P.4: server → client messages (spec section 4): ack, status and every terminal status with its reason,
//! output framing (order, UTF-8 boundaries, base64, the output limit to the byte), result, error and pong.
//!
//! The executions judged here are scenarios shared with P.5 (section 5 judges their message order).

use std::time::Duration;

use serde_json::{json, Value};

use super::common::{case, check_status, ended, exit_null, nothing_for, text, C};
use crate::ctx::{Ctx, TIMEOUT_MS};
use crate::framework::{checked, Case, CaseResult, Stop};
use crate::wire::{check_error_fields, short, Exec, LANGUAGES, LIMIT_NAMES};
use crate::{check, fail};

const ACK: &str = "`ack` `{id}`: sent once, before anything else for that id.";
const STATUS: &str = "`status` `{id, status}`: `running` once when the program starts; then exactly one terminal status: `completed` (exited with code 0), `failed` (exited non-zero, or killed by a signal the daemon did not send), `timeout` (wall clock over `timeout_ms`), `oom` (killed by the memory limit), `cancelled` (client cancel).";
const LIMIT: &str = "Output beyond `max_output_bytes` is not sent: the program is killed, the terminal status is `failed`, and `result.reason` is `output_limit`.";
const ORDER: &str = "`stdout` / `stderr` `{id, data}`: output in order of production per stream.";
const UTF8: &str = "Chunks never split a UTF-8 sequence.";
const BASE64: &str = "If a chunk is not valid UTF-8, sandboxd sends it as `\"encoding\":\"base64\"` with `data` base64-encoded.";
const RESULT: &str = "`result` `{id, exit_code, duration_ms, resource_usage:{peak_memory_mb, cpu_time_ms}}`: sent exactly once, right after the terminal status. `exit_code` is null if the program was killed by a signal.";
const ADDITIONS: &str = "sandboxd adds `reason` (`exited`, `signaled`, `timeout`, `oom`, `output_limit`, `cancelled`), `signal` (e.g. `SIGKILL`) when signaled, `stdout_bytes`, `stderr_bytes`, `truncated`.";
const ERROR: &str = "`error` `{id?, code, message, retryable}`; codes and retryability as in the table of section 4.";
const NEVER: &str = "For an execution, `error` is its last message; an execution that got `error` before `status: running` never runs.";
const PONG: &str = "`pong` `{load:{active_executions, queue_depth}}`. sandboxd adds `capabilities`: `languages`, `max_limits`, `extensions`, and `isolation`.";

/// The cases of this group, in id order.
#[rustfmt::skip]
pub static CASES: &[Case] = &[
    case!("P.4.1", Must, "4 (ack)", "ack is sent once, before anything else for the id", ACK, ack_first),
    case!("P.4.2", Must, "4 (status)", "running once, then exactly one terminal status", STATUS, statuses),
    case!("P.4.3", Must, "4 (status)", "Exit code 0 ends as completed", STATUS, completed),
    case!("P.4.4", Must, "4 (status)", "A non-zero exit code ends as failed with that code", STATUS, failed_exit),
    case!("P.4.5", Must, "4 (status)", "A signal the daemon did not send ends as failed, exit_code null", STATUS, failed_signal),
    case!("P.4.6", Must, "4 (status)", "Wall clock over timeout_ms ends as timeout", STATUS, timeout),
    case!("P.4.7", Must, "4 (status)", "The memory limit ends the program as oom", STATUS, oom),
    case!("P.4.8", Must, "4 (output)", "Output beyond max_output_bytes: cut to the byte, failed, output_limit", LIMIT, output_limit),
    case!("P.4.9", Must, "4 (output)", "Output of exactly max_output_bytes completes untruncated", LIMIT, output_exact),
    case!("P.4.10", Must, "3, 4 (output)", "max_output_bytes counts stdout and stderr together",
        "`max_output_bytes` (1 MiB, stdout and stderr counted together). Output beyond `max_output_bytes` is not sent.", output_both),
    case!("P.4.11", Must, "4 (output)", "Output arrives in order of production per stream", ORDER, output_order),
    case!("P.4.12", Must, "4 (output)", "Chunks never split a UTF-8 sequence", UTF8, utf8_boundaries),
    case!("P.4.13", Must, "4 (output)", "Output that is not UTF-8 arrives exactly, base64-encoded", BASE64, base64_output),
    case!("P.4.14", Must, "4 (result)", "result carries exit_code, duration_ms and resource_usage", RESULT, result_fields),
    case!("P.4.15", Must, "4 (result)", "The sandboxd additions of result are consistent when sent", ADDITIONS, result_additions),
    case!("P.4.16", Must, "4 (error)", "error carries code, message and retryable as the spec's table says", ERROR, error_fields),
    case!("P.4.17", Must, "4 (error)", "An execution refused with an error never runs", NEVER, refused_never_runs),
    case!("P.4.18", Must, "4 (pong)", "pong's load and announced capabilities are well formed", PONG, pong_form),
    case!("P.4.19", Must, "4 (output)", "An output limit inside a UTF-8 character cuts cleanly",
        "Chunks never split a UTF-8 sequence. Output beyond `max_output_bytes` is not sent.", limit_mid_character),
];

async fn run_one(ctx: &Ctx, tag: &str, lang: &str, code: &str, extra: Value) -> Result<Exec, Stop> {
    let mut c = ctx.connect().await?;
    let id = ctx.id(tag);
    let exec = ctx.exec_with(&id, lang, code, extra);
    let timeout = exec["limits"]["timeout_ms"].as_u64().unwrap_or(TIMEOUT_MS);
    let e = c.run(&exec, ctx.end_within(timeout)).await?;
    c.close().await;
    Ok(e)
}

/// A shell program several cases judge, run once per suite run (under `key`, see [`Ctx::scenario`]).
struct ShellScenario {
    key: &'static str,
    /// The execution id's tag.
    tag: &'static str,
    code: &'static str,
    /// The limits the request sets (the others take their defaults).
    limits: &'static [(&'static str, u64)],
}

/// Exit code 0, output on both streams.
const COMPLETED: ShellScenario = ShellScenario {
    key: "completed",
    tag: "ok",
    code: "echo out; echo err >&2; echo more",
    limits: &[],
};

/// Exit code 3.
const EXIT_CODE: ShellScenario = ShellScenario {
    key: "exit3",
    tag: "exit3",
    code: "echo before; exit 3",
    limits: &[],
};

/// Killed by SIGTERM, sent by the program itself.
const SIGNALED: ShellScenario = ShellScenario {
    key: "signaled",
    tag: "sig",
    code: "echo before; kill -TERM $$; sleep 5; echo survived",
    limits: &[],
};

/// The timeout limit of [`timeout_exec`].
pub const TIMEOUT_LIMIT_MS: u64 = 1000;

/// Sleeps past a 1 s timeout.
const TIMEOUT: ShellScenario = ShellScenario {
    key: "timeout",
    tag: "timeout",
    code: "echo started; sleep 30; echo survived",
    limits: &[("timeout_ms", TIMEOUT_LIMIT_MS)],
};

/// Writes 10 MB with `max_output_bytes` 1000.
const OUTPUT_LIMIT: ShellScenario = ShellScenario {
    key: "output_limit",
    tag: "outlimit",
    code: "head -c 10000000 /dev/zero | tr '\\0' x; sleep 5; echo survived",
    limits: &[("max_output_bytes", 1000)],
};

async fn shell_scenario(ctx: &Ctx, s: &'static ShellScenario) -> Result<Exec, Stop> {
    ctx.scenario(s.key, || async {
        let extra = if s.limits.is_empty() {
            json!({})
        } else {
            let limits: serde_json::Map<String, Value> = s
                .limits
                .iter()
                .map(|&(k, v)| (k.to_owned(), json!(v)))
                .collect();
            json!({ "limits": limits })
        };
        run_one(ctx, s.tag, ctx.shell()?, s.code, extra).await
    })
    .await
}

/// [`COMPLETED`]: exit code 0, output on both streams.
pub async fn completed_exec(ctx: &Ctx) -> Result<Exec, Stop> {
    shell_scenario(ctx, &COMPLETED).await
}

/// [`EXIT_CODE`]: exit code 3.
pub async fn exit_code_exec(ctx: &Ctx) -> Result<Exec, Stop> {
    shell_scenario(ctx, &EXIT_CODE).await
}

/// [`SIGNALED`]: killed by SIGTERM, sent by the program itself.
pub async fn signaled_exec(ctx: &Ctx) -> Result<Exec, Stop> {
    shell_scenario(ctx, &SIGNALED).await
}

/// [`TIMEOUT`]: sleeps past a 1 s timeout.
pub async fn timeout_exec(ctx: &Ctx) -> Result<Exec, Stop> {
    shell_scenario(ctx, &TIMEOUT).await
}

/// [`OUTPUT_LIMIT`]: writes 10 MB with `max_output_bytes` 1000.
pub async fn output_limit_exec(ctx: &Ctx) -> Result<Exec, Stop> {
    shell_scenario(ctx, &OUTPUT_LIMIT).await
}

/// Allocates far beyond a 64 MiB memory limit.
pub async fn oom_exec(ctx: &Ctx) -> Result<Exec, Stop> {
    ctx.scenario("oom", || async {
        let memory = ctx.fit("memory_mb", 64);
        let limits = json!({"limits": {"memory_mb": memory}});
        if ctx.has_language("python") == Some(true) {
            // 16x the limit, 1 MiB at a time, every page touched; then a pause so a limit enforced by sampling
            // also catches it.
            let code = format!(
                "import time\nchunks = []\nfor i in range({}):\n    chunks.append(bytearray(b'x' * (1 << 20)))\n    if i % 32 == 0:\n        time.sleep(0.01)\ntime.sleep(5)\nprint('survived')",
                memory * 16
            );
            run_one(ctx, "oom", "python", &code, limits).await
        } else {
            let code = format!("x=$(head -c {} /dev/zero | tr '\\0' x); sleep 5; echo survived", (memory * 16) << 20);
            run_one(ctx, "oom", ctx.shell()?, &code, limits).await
        }
    })
    .await
}

/// The shared executions P.5 judges by name (its table's rows).
#[derive(Debug, Clone, Copy)]
pub enum Scenario {
    /// [`timeout_exec`].
    Timeout,
    /// [`oom_exec`].
    Oom,
    /// [`super::requests::cancelled_execution`].
    Cancelled,
    /// [`output_limit_exec`].
    OutputLimit,
}

impl Scenario {
    /// Runs (or reuses) the execution.
    pub async fn exec(self, ctx: &Ctx) -> Result<Exec, Stop> {
        match self {
            Scenario::Timeout => timeout_exec(ctx).await,
            Scenario::Oom => oom_exec(ctx).await,
            Scenario::Cancelled => super::requests::cancelled_execution(ctx).await,
            Scenario::OutputLimit => output_limit_exec(ctx).await,
        }
    }
}

async fn ack_first(ctx: C) -> CaseResult {
    for e in [
        completed_exec(&ctx).await?,
        exit_code_exec(&ctx).await?,
        timeout_exec(&ctx).await?,
    ] {
        check!(
            e.msgs.first().map(|m| m.kind()) == Some("ack"),
            "the first message is not the ack: {}",
            e.dump()
        );
        check!(
            e.msgs.iter().filter(|m| m.kind() == "ack").count() == 1,
            "more than one ack: {}",
            e.dump()
        );
    }
    Ok(String::new())
}

async fn statuses(ctx: C) -> CaseResult {
    for e in [
        completed_exec(&ctx).await?,
        exit_code_exec(&ctx).await?,
        timeout_exec(&ctx).await?,
    ] {
        let s = e.statuses();
        check!(
            s.len() == 2 && s[0] == "running" && s[1] != "running",
            "statuses {s:?}: {}",
            e.dump()
        );
    }
    Ok(String::new())
}

fn reason_if_sent(e: &Exec, want: &str) -> Result<(), Stop> {
    match e.result().and_then(|r| r.get("reason")) {
        None => Ok(()),
        Some(r) if r == want => Ok(()),
        Some(r) => Err(Stop::Fail(format!(
            "result.reason {r}, expected {want:?}: {}",
            e.dump()
        ))),
    }
}

async fn completed(ctx: C) -> CaseResult {
    let e = completed_exec(&ctx).await?;
    check_status(&e, "completed")?;
    check!(
        e.exit_code() == Some(&json!(0)),
        "exit_code must be 0: {}",
        e.dump()
    );
    reason_if_sent(&e, "exited")?;
    check!(e.stdout_text() == "out\nmore\n", "{}", e.dump());
    check!(
        e.stderr().ok().as_deref() == Some(b"err\n".as_slice()),
        "{}",
        e.dump()
    );
    Ok(String::new())
}

async fn failed_exit(ctx: C) -> CaseResult {
    let e = exit_code_exec(&ctx).await?;
    check!(
        e.terminal_status().as_deref() == Some("failed"),
        "exit 3: {}",
        e.dump()
    );
    check!(
        e.exit_code() == Some(&json!(3)),
        "exit_code must be 3: {}",
        e.dump()
    );
    reason_if_sent(&e, "exited")?;
    Ok(String::new())
}

async fn failed_signal(ctx: C) -> CaseResult {
    let e = signaled_exec(&ctx).await?;
    check!(
        e.terminal_status().as_deref() == Some("failed"),
        "killed by SIGTERM: {}",
        e.dump()
    );
    exit_null(&e)?;
    reason_if_sent(&e, "signaled")?;
    if let Some(sig) = e.result().and_then(|r| r.get("signal")) {
        check!(
            sig == "SIGTERM",
            "result.signal is {sig}, expected \"SIGTERM\": {}",
            e.dump()
        );
    }
    check!(!e.stdout_text().contains("survived"), "{}", e.dump());
    Ok(String::new())
}

async fn timeout(ctx: C) -> CaseResult {
    let e = timeout_exec(&ctx).await?;
    ended(&e, "timeout", "timeout")?;
    exit_null(&e)?;
    check!(
        e.stdout_text() == "started\n",
        "output before the timeout is delivered, none after: {}",
        e.dump()
    );
    let running_at = e
        .msgs
        .iter()
        .find(|m| m.status() == Some("running"))
        .map(|m| m.at);
    let end_at = e
        .msgs
        .iter()
        .find(|m| m.status() == Some("timeout"))
        .map(|m| m.at);
    if let (Some(a), Some(b)) = (running_at, end_at) {
        let seen = b.duration_since(a);
        check!(
            seen + Duration::from_millis(100) >= Duration::from_millis(TIMEOUT_LIMIT_MS),
            "the execution was ended {seen:?} after it started, before timeout_ms {TIMEOUT_LIMIT_MS}"
        );
    }
    if let Some(d) = e.result().and_then(|r| r["duration_ms"].as_u64()) {
        check!(
            d + 100 >= TIMEOUT_LIMIT_MS,
            "result.duration_ms {d} is below timeout_ms {TIMEOUT_LIMIT_MS}"
        );
    }
    Ok(String::new())
}

async fn oom(ctx: C) -> CaseResult {
    let e = oom_exec(&ctx).await?;
    ended(&e, "oom", "oom")?;
    exit_null(&e)?;
    check!(!e.stdout_text().contains("survived"), "{}", e.dump());
    Ok(String::new())
}

fn total_output(e: &Exec) -> Result<usize, Stop> {
    Ok(checked(e.stdout())?.len() + checked(e.stderr())?.len())
}

async fn output_limit(ctx: C) -> CaseResult {
    let e = output_limit_exec(&ctx).await?;
    let total = total_output(&e)?;
    check!(
        total == 1000,
        "{total} bytes of output were delivered with max_output_bytes 1000: {}",
        e.dump()
    );
    ended(&e, "failed", "output_limit")?;
    exit_null(&e)?;
    if let Some(t) = e.result().and_then(|r| r.get("truncated")) {
        check!(t == true, "result.truncated must be true: {}", e.dump());
    }
    check!(
        !e.stdout_text().contains("survived"),
        "the program was not killed: {}",
        e.dump()
    );
    Ok(String::new())
}

async fn output_exact(ctx: C) -> CaseResult {
    let lang = ctx.shell()?;
    let e = run_one(
        &ctx,
        "exact",
        lang,
        "head -c 1000 /dev/zero | tr '\\0' x",
        json!({"limits": {"max_output_bytes": 1000}}),
    )
    .await?;
    check_status(&e, "completed")?;
    check!(total_output(&e)? == 1000, "{}", e.dump());
    reason_if_sent(&e, "exited")?;
    if let Some(t) = e.result().and_then(|r| r.get("truncated")) {
        check!(t == false, "result.truncated must be false: {}", e.dump());
    }
    Ok(String::new())
}

async fn output_both(ctx: C) -> CaseResult {
    let lang = ctx.shell()?;
    // 600 bytes on stdout, then 600 on stderr: counted together they cross 1000, counted apart they do not.
    let over = "head -c 600 /dev/zero | tr '\\0' o; head -c 600 /dev/zero | tr '\\0' e >&2; sleep 5; echo survived";
    let e = run_one(
        &ctx,
        "both",
        lang,
        over,
        json!({"limits": {"max_output_bytes": 1000}}),
    )
    .await?;
    let (o, r) = (checked(e.stdout())?.len(), checked(e.stderr())?.len());
    check!(
        o + r == 1000,
        "stdout {o} + stderr {r} bytes were delivered with max_output_bytes 1000: {}",
        e.dump()
    );
    ended(&e, "failed", "output_limit")?;
    let exact = "head -c 600 /dev/zero | tr '\\0' o; head -c 400 /dev/zero | tr '\\0' e >&2";
    let e = run_one(
        &ctx,
        "both-exact",
        lang,
        exact,
        json!({"limits": {"max_output_bytes": 1000}}),
    )
    .await?;
    check!(
        e.terminal_status().as_deref() == Some("completed") && total_output(&e)? == 1000,
        "600 + 400 bytes with max_output_bytes 1000: {}",
        e.dump()
    );
    Ok(String::new())
}

async fn output_order(ctx: C) -> CaseResult {
    let lang = ctx.shell()?;
    let code = "i=0; while [ $i -lt 5000 ]; do echo $i; echo e$i >&2; i=$((i+1)); done";
    let e = run_one(&ctx, "order", lang, code, json!({})).await?;
    check_status(&e, "completed")?;
    let out: String = (0..5000).map(|i| format!("{i}\n")).collect();
    let err: String = (0..5000).map(|i| format!("e{i}\n")).collect();
    check!(
        e.stdout_text() == out,
        "stdout is not in order of production ({} bytes)",
        e.stdout_text().len()
    );
    check!(
        checked(e.stderr())? == err.as_bytes(),
        "stderr is not in order of production"
    );
    Ok(format!(
        "{} stdout and {} stderr chunks",
        e.chunks("stdout").len(),
        e.chunks("stderr").len()
    ))
}

async fn utf8_boundaries(ctx: C) -> CaseResult {
    let lang = ctx.shell()?;
    // "é" (2 bytes) and "😀" (4 bytes) written in pieces with pauses, so the server reads the pieces separately.
    let code = "printf 'ab\\303'; sleep 0.3; printf '\\251cd\\360'; sleep 0.3; printf '\\237\\230'; sleep 0.3; printf '\\200!\\n'";
    let e = run_one(&ctx, "utf8", lang, code, json!({})).await?;
    check_status(&e, "completed")?;
    let chunks = e.chunks("stdout");
    for ch in &chunks {
        check!(
            !ch.is_base64(),
            "valid UTF-8 written in pieces arrived split (as base64): {}",
            short(&ch.raw)
        );
    }
    let joined: String = chunks
        .iter()
        .map(|c| c.raw["data"].as_str().unwrap_or_default())
        .collect();
    check!(
        joined == "abécd😀!\n",
        "the text arrived as {joined:?} in {} chunk(s), expected \"abécd😀!\\n\"",
        chunks.len()
    );
    Ok(format!("{} chunk(s)", chunks.len()))
}

async fn base64_output(ctx: C) -> CaseResult {
    let lang = ctx.shell()?;
    let e = run_one(
        &ctx,
        "bytes",
        lang,
        "printf '\\377\\376\\375'; printf '\\200ok' >&2",
        json!({}),
    )
    .await?;
    check_status(&e, "completed")?;
    check!(
        checked(e.stdout())? == [0xff, 0xfe, 0xfd],
        "stdout bytes differ: {}",
        e.dump()
    );
    check!(
        checked(e.stderr())? == b"\x80ok",
        "stderr bytes differ: {}",
        e.dump()
    );
    check!(
        e.chunks("stdout").iter().any(|c| c.is_base64()),
        "bytes that are not UTF-8 must be sent with encoding base64: {}",
        e.dump()
    );
    check!(
        e.chunks("stderr").iter().any(|c| c.is_base64()),
        "stderr bytes that are not UTF-8 must be sent with encoding base64: {}",
        e.dump()
    );
    Ok(String::new())
}

async fn result_fields(ctx: C) -> CaseResult {
    for e in [
        completed_exec(&ctx).await?,
        exit_code_exec(&ctx).await?,
        timeout_exec(&ctx).await?,
        signaled_exec(&ctx).await?,
    ] {
        checked(e.check_result_fields())?;
        check!(
            e.msgs.iter().filter(|m| m.kind() == "result").count() == 1,
            "result exactly once: {}",
            e.dump()
        );
    }
    Ok(String::new())
}

async fn result_additions(ctx: C) -> CaseResult {
    let mut notes = Vec::new();
    for e in [
        completed_exec(&ctx).await?,
        signaled_exec(&ctx).await?,
        output_limit_exec(&ctx).await?,
    ] {
        let Some(r) = e.result() else {
            fail!("no result: {}", e.dump())
        };
        if r.get("reason").is_none() {
            notes.push("no reason");
        }
        if let Some(sig) = r.get("signal") {
            check!(
                sig.is_string(),
                "result.signal must be a string: {}",
                short(r)
            );
            check!(
                r["exit_code"].is_null(),
                "result.signal is sent but exit_code is not null: {}",
                short(r)
            );
        }
        if r["reason"] == "signaled" {
            check!(
                r.get("signal").is_some_and(Value::is_string),
                "a signaled result names the signal: {}",
                short(r)
            );
        }
        if let Some(q) = e.ack().and_then(|a| a.get("queued")) {
            check!(q.is_boolean(), "ack.queued must be a boolean: {q}");
        }
        checked(e.check_result_fields())?;
    }
    Ok(if notes.is_empty() {
        String::new()
    } else {
        format!("not sent: {notes:?}")
    })
}

async fn error_fields(ctx: C) -> CaseResult {
    let lang = ctx.shell()?;
    let mut c = ctx.connect().await?;
    let mut seen = Vec::new();
    for frame in [
        text(&json!({"v": 1, "type": "launch", "ts": crate::msgs::ts()})),
        text(&ctx.exec(&ctx.id("err-lang"), "cobol", "x")),
        text(&crate::msgs::cancel(&ctx.id("err-cancel"))),
        text(&crate::msgs::with(
            ctx.exec(&ctx.id("err-field"), lang, "x"),
            json!({"bogus": 1}),
        )),
    ] {
        c.send(frame).await?;
        let e = c.take_error(ctx.secs(10)).await?;
        checked(check_error_fields(&e.raw))?;
        seen.push(e.raw["code"].as_str().unwrap_or_default().to_owned());
    }
    Ok(format!("codes checked: {seen:?}"))
}

async fn refused_never_runs(ctx: C) -> CaseResult {
    let lang = ctx.shell()?;
    let mut c = ctx.connect().await?;
    let ids = [ctx.id("never-a"), ctx.id("never-b"), ctx.id("never-c")];
    let frames = [
        crate::msgs::with(
            ctx.exec(&ids[0], lang, "echo ran"),
            json!({"limits": {"gpu_count": 1}}),
        ),
        crate::msgs::with(
            ctx.exec(&ids[1], lang, "echo ran"),
            json!({"limits": {"timeout_ms": null}}),
        ),
        ctx.exec(&ids[2], "cobol", "DISPLAY 'ran'."),
    ];
    for (id, f) in ids.iter().zip(&frames) {
        c.send_json(f).await?;
        let e = c
            .take(ctx.secs(10), "the refusal", |m| m.is_for(id))
            .await?;
        check!(
            e.kind() == "error",
            "expected the request to be refused, got {}",
            short(&e.raw)
        );
    }
    for id in &ids {
        nothing_for(&ctx, &mut c, id, 300, "a message for a refused execution").await?;
    }
    Ok(String::new())
}

async fn pong_form(ctx: C) -> CaseResult {
    let mut c = ctx.connect().await?;
    let pong = c.ping(ctx.secs(5)).await?.raw;
    check!(
        crate::ctx::load_of(&pong).is_some(),
        "pong.load: {}",
        short(&pong)
    );
    let Some(caps) = pong.get("capabilities") else {
        return Ok("no capabilities (sandboxd addition) announced".into());
    };
    let langs = caps["languages"]
        .as_array()
        .ok_or_else(|| Stop::Fail(format!("capabilities.languages must be an array: {caps}")))?;
    for l in langs {
        check!(
            l.as_str().is_some_and(|l| LANGUAGES.contains(&l)),
            "capabilities.languages has {l}, not an FSP/1 language"
        );
    }
    for name in LIMIT_NAMES {
        check!(
            caps["max_limits"][name].as_u64().is_some(),
            "capabilities.max_limits.{name} must be an integer: {}",
            short(&caps["max_limits"])
        );
    }
    check!(
        caps["extensions"]
            .as_array()
            .is_some_and(|a| a.iter().all(Value::is_string)),
        "capabilities.extensions must be an array of strings"
    );
    let iso = &caps["isolation"];
    check!(
        iso["namespaces"]
            .as_array()
            .is_some_and(|a| a.iter().all(Value::is_string)),
        "isolation.namespaces must be an array of strings: {iso}"
    );
    check!(
        iso["cgroup_version"].is_string(),
        "isolation.cgroup_version must be a string: {iso}"
    );
    check!(
        iso["seccomp"].is_boolean(),
        "isolation.seccomp must be a boolean: {iso}"
    );
    check!(
        iso["landlock_abi"].is_null() || iso["landlock_abi"].is_u64(),
        "isolation.landlock_abi must be an integer or null: {iso}"
    );
    check!(
        iso["user_namespace"].is_boolean(),
        "isolation.user_namespace must be a boolean: {iso}"
    );
    check!(
        iso["network"].is_string(),
        "isolation.network must be a string: {iso}"
    );
    Ok(String::new())
}

async fn limit_mid_character(ctx: C) -> CaseResult {
    let lang = ctx.shell()?;
    // 999 bytes of "x", then "é" (2 bytes): the limit of 1000 falls inside the character.
    let code =
        "head -c 999 /dev/zero | tr '\\0' x; printf '\\303\\251 and more'; sleep 5; echo survived";
    let e = run_one(
        &ctx,
        "midchar",
        lang,
        code,
        json!({"limits": {"max_output_bytes": 1000}}),
    )
    .await?;
    let out = checked(e.stdout())?;
    let mut want = vec![b'x'; 999];
    want.extend_from_slice("é and more".as_bytes());
    check!(
        out.len() <= 1000,
        "{} bytes were delivered with max_output_bytes 1000: {}",
        out.len(),
        e.dump()
    );
    check!(
        out.len() >= 999,
        "only {} bytes were delivered: {}",
        out.len(),
        e.dump()
    );
    check!(
        want.starts_with(&out),
        "the delivered bytes are not the program's output: {}",
        e.dump()
    );
    for ch in e.chunks("stdout") {
        if !ch.is_base64() {
            check!(
                ch.raw["data"]
                    .as_str()
                    .is_some_and(|d| !d.contains('\u{fffd}')),
                "a chunk carries a replacement character: {}",
                short(&ch.raw)
            );
        }
    }
    ended(&e, "failed", "output_limit")?;
    Ok(format!(
        "{} bytes delivered in {} chunk(s)",
        out.len(),
        e.chunks("stdout").len()
    ))
}

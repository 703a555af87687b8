//! P.3: client → server messages (spec section 3): `execute` (languages, limits and their maximums, stdin,
//! files, artifacts, duplicate ids), `cancel` and `ping`.

use std::collections::HashSet;
use std::ops::ControlFlow;
use std::time::{Duration, Instant};

use base64::engine::general_purpose::STANDARD;
use base64::Engine;
use serde_json::{json, Value};

use super::common::{
    case, check_status, ended, exit_null, nothing_for, refused, refused_cancel, refused_invalid,
    sequence, text, wait_no_marked_processes, C,
};
use crate::client::{Conn, Frame};
use crate::ctx::{load_of, max_limits_json, Ctx, TIMEOUT_MS};
use crate::framework::{Case, CaseResult, Stop};
use crate::msgs::{cancel, with};
use crate::wire::{short, Exec, LANGUAGES, LIMIT_NAMES};
use crate::{check, fail, skip};

const LANG: &str = "A language the server or the image cannot run MUST get `error` `LANGUAGE_NOT_SUPPORTED` (non-retryable). `ping`'s capabilities list the languages that work.";
const MAX: &str = "A value above the server's configured maximum MUST be refused with `INVALID_REQUEST` naming the limit and the maximum; it is never silently clamped.";
const DEFAULTS: &str = "`cpu_shares` defaults to 512, `max_output_bytes` to 1 MiB (stdout and stderr counted together), `pids_max` to 64, `disk_mb` (size of the writable scratch space) to 64.";
const STDIN: &str = "`stdin`: written to the program's stdin, which is then closed. Absent or null: stdin is empty.";
const FILES: &str = "`files` (sandboxd addition): files placed in the working directory before start; `encoding` is `utf8` or `base64`; paths are relative and MUST NOT escape the working directory (`..`, absolute paths → `INVALID_REQUEST`).";
const ARTIFACTS: &str = "`artifacts` (sandboxd addition): glob patterns, relative to the working directory, collected after the program ends. (An unannounced extension is an unknown field: refused, never ignored.)";
const DUP: &str = "A second `execute` with the `id` of an execution still in flight MUST get `error` `INVALID_REQUEST` with that id and `\"message\"` saying it is a duplicate; the running execution is not affected.";
const CANCEL: &str = "`cancel` kills the execution's whole process tree.";
const UNKNOWN: &str = "An id that is not in flight on this connection MUST get `error` `UNKNOWN_EXECUTION` (non-retryable).";
const TWICE: &str =
    "A second cancel of an execution that is already being cancelled produces nothing further.";
const PING: &str = "`{\"v\":1,\"type\":\"ping\",\"ts\":\"...\"}` → `pong`.";
const FLOOD: &str = "A `ping` MUST be answered within 1 s even while executions flood output on the same connection.";

/// The cases of this group, in id order.
#[rustfmt::skip]
pub static CASES: &[Case] = &[
    case!("P.3.1", Must, "3 (execute)", "An unknown language gets LANGUAGE_NOT_SUPPORTED", LANG, unknown_language),
    case!("P.3.2", Must, "3 (execute)", "An FSP language the server does not announce gets LANGUAGE_NOT_SUPPORTED", LANG, unannounced_language),
    case!("P.3.3", Must, "3 (execute)", "Every announced language runs a program", LANG, announced_languages),
    case!("P.3.4", Must, "3 (execute)", "timeout_ms above the maximum is refused, not clamped", MAX, above_max("timeout_ms")),
    case!("P.3.5", Must, "3 (execute)", "memory_mb above the maximum is refused, not clamped", MAX, above_max("memory_mb")),
    case!("P.3.6", Must, "3 (execute)", "cpu_shares above the maximum is refused, not clamped", MAX, above_max("cpu_shares")),
    case!("P.3.7", Must, "3 (execute)", "max_output_bytes above the maximum is refused, not clamped", MAX, above_max("max_output_bytes")),
    case!("P.3.8", Must, "3 (execute)", "pids_max above the maximum is refused, not clamped", MAX, above_max("pids_max")),
    case!("P.3.9", Must, "3 (execute)", "disk_mb above the maximum is refused, not clamped", MAX, above_max("disk_mb")),
    case!("P.3.10", Must, "3 (execute)", "Every limit at its maximum is accepted and in effect as asked", MAX, at_maximum),
    case!("P.3.11", Must, "3, 4 (ack)", "Optional limits take their defaults (ack.limits)", DEFAULTS, defaults_filled),
    case!("P.3.12", Must, "3 (execute)", "stdin is written to the program, then closed", STDIN, stdin_written),
    case!("P.3.13", Must, "3 (execute)", "Absent or null stdin is empty", STDIN, stdin_empty),
    case!("P.3.14", Must, "3 (execute)", "files are placed in the working directory (utf8 and base64)", FILES, files_placed),
    case!("P.3.15", Must, "3 (execute)", "File paths that escape the working directory are refused", FILES, files_escape),
    case!("P.3.16", Must, "3 (execute)", "artifacts: a manifest when announced, refused otherwise", ARTIFACTS, artifacts),
    case!("P.3.17", Must, "3 (execute)", "A duplicate id in flight is refused as a duplicate", DUP, duplicate_refused),
    case!("P.3.18", Must, "3 (execute)", "The running execution is not affected by its duplicate", DUP, duplicate_harmless),
    case!("P.3.19", Should, "3 (execute)", "An id can be used again once its execution ended",
        "A second `execute` with the `id` of an execution still in flight MUST get `error` (so an id no longer in flight is free).", id_reuse),
    case!("P.3.20", Must, "3 (cancel)", "Cancel after the first output ends the execution as cancelled", CANCEL, cancel_running),
    case!("P.3.21", Must, "3 (cancel)", "Cancel right after execute (before start) ends it as cancelled", CANCEL, cancel_before_start),
    case!("P.3.22", Must, "3 (cancel)", "Cancel of an unknown id gets UNKNOWN_EXECUTION", UNKNOWN, cancel_unknown),
    case!("P.3.23", Must, "3 (cancel)", "Cancel of an execution that already ended gets UNKNOWN_EXECUTION", UNKNOWN, cancel_ended),
    case!("P.3.24", Must, "3 (cancel)", "Cancel of another connection's execution gets UNKNOWN_EXECUTION", UNKNOWN, cancel_other_connection),
    case!("P.3.25", Must, "3 (cancel)", "A second cancel produces nothing further", TWICE, cancel_twice),
    case!("P.3.26", Must, "3 (cancel)", "Cancel kills the whole process tree", CANCEL, cancel_tree),
    case!("P.3.27", Must, "3 (ping), 4 (pong)", "ping is answered with pong and its load", PING, ping_pong),
    case!("P.3.28", Must, "3 (ping)", "ping is answered within 1 s during an output flood", FLOOD, ping_during_flood),
    case!("E.cpu.1", Must, "3 (execute: cpu_cores)", "cpu_cores: left out it is the announced maximum; above it is refused", CPU_CORES, cpu_cores),
];

const CPU_CORES: &str = "`limits.cpu_cores` (extension `cpu_cores`): defaults to the server's maximum (`max_limits.cpu_cores`), reported in `ack.limits`; above the maximum it is refused with `INVALID_REQUEST` naming the limit and the maximum.";

/// The extension `cpu_cores`: the default in ack, and a refusal above the announced maximum.
async fn cpu_cores(ctx: C) -> CaseResult {
    if ctx.extension("cpu_cores") != Some(true) {
        skip!("the cpu_cores extension is not announced in pong.capabilities.extensions");
    }
    let Some(max) = ctx.server.pong["capabilities"]["max_limits"]["cpu_cores"].as_f64() else {
        fail!("cpu_cores is announced but max_limits.cpu_cores is not a number");
    };
    let lang = ctx.shell()?;
    let mut c = ctx.connect().await?;
    let id = ctx.id("cores");
    let e = ctx.run(&mut c, &ctx.exec(&id, lang, "echo ok")).await?;
    let got = e.ack().map(|a| a["limits"]["cpu_cores"].clone());
    check!(
        got.as_ref().and_then(Value::as_f64) == Some(max),
        "ack.limits.cpu_cores is {got:?}, expected the maximum {max}: {}",
        e.dump()
    );
    let id = ctx.id("cores-over");
    let over = max + 1.0;
    let exec = with(
        ctx.exec(&id, lang, "echo ran"),
        json!({"limits": {"cpu_cores": over}}),
    );
    refused_invalid(&ctx, &mut c, &exec, &id, &["cpu_cores", &max.to_string()]).await?;
    Ok(String::new())
}

async fn unknown_language(ctx: C) -> CaseResult {
    let mut c = ctx.connect().await?;
    for lang in ["rust", "cobol", "Python", ""] {
        let id = ctx.id("lang");
        let e = refused(
            &ctx,
            &mut c,
            text(&ctx.exec(&id, lang, "print(1)")),
            "LANGUAGE_NOT_SUPPORTED",
            Some(&id),
            &[],
        )
        .await;
        match e {
            Ok(_) => {}
            // An empty name may also be judged a malformed field.
            Err(Stop::Fail(why)) if lang.is_empty() && why.contains("INVALID_REQUEST") => {}
            Err(other) => return Err(other),
        }
    }
    Ok(String::new())
}

async fn unannounced_language(ctx: C) -> CaseResult {
    let Some(langs) = ctx.server.languages.clone() else {
        skip!("the server announces no pong.capabilities.languages");
    };
    let missing: Vec<&str> = LANGUAGES
        .iter()
        .copied()
        .filter(|l| !langs.iter().any(|x| x == l))
        .collect();
    if missing.is_empty() {
        skip!("every FSP/1 language is announced");
    }
    let mut c = ctx.connect().await?;
    for lang in &missing {
        let id = ctx.id("unann");
        refused(
            &ctx,
            &mut c,
            text(&ctx.exec(&id, lang, "x")),
            "LANGUAGE_NOT_SUPPORTED",
            Some(&id),
            &[],
        )
        .await?;
    }
    Ok(format!("not announced: {missing:?}"))
}

fn hello(lang: &str) -> &'static str {
    match lang {
        "python" => "print('hello')",
        "javascript" => "console.log('hello')",
        "elixir" => "IO.puts(\"hello\")",
        _ => "echo hello",
    }
}

async fn announced_languages(ctx: C) -> CaseResult {
    let Some(langs) = ctx.server.languages.clone() else {
        skip!("the server announces no pong.capabilities.languages");
    };
    let mut c = ctx.connect().await?;
    for lang in langs.iter().filter(|l| LANGUAGES.contains(&l.as_str())) {
        let id = ctx.id("hello");
        let e = ctx.run(&mut c, &ctx.exec(&id, lang, hello(lang))).await?;
        check!(
            e.terminal_status().as_deref() == Some("completed") && e.stdout_text() == "hello\n",
            "announced language {lang} did not run a hello program: {}",
            e.dump()
        );
    }
    Ok(format!("ran {langs:?}"))
}

/// P.3.4 to P.3.9: `limit` one above its maximum (or 2^52 when no maximum is announced) is refused.
async fn above_max(ctx: &Ctx, limit: &str) -> CaseResult {
    let lang = ctx.shell()?;
    let mut c = ctx.connect().await?;
    let id = ctx.id("above");
    let (value, names, note) = match ctx.max_limit(limit) {
        Some(max) => (max + 1, vec![limit.to_owned(), max.to_string()], format!("maximum {max}")),
        None => (
            1u64 << 52,
            vec![limit.to_owned()],
            "max_limits not announced: a value of 2^52 was refused; the maximum could not be checked in the message".to_owned(),
        ),
    };
    let exec = with(
        ctx.exec(&id, lang, "echo ran"),
        json!({"limits": {limit: value}}),
    );
    let names: Vec<&str> = names.iter().map(String::as_str).collect();
    refused_invalid(ctx, &mut c, &exec, &id, &names).await?;
    Ok(note)
}

async fn at_maximum(ctx: C) -> CaseResult {
    let lang = ctx.shell()?;
    let Some(limits) = max_limits_json(&ctx) else {
        skip!("pong.capabilities.max_limits is not announced");
    };
    let mut c = ctx.connect().await?;
    let id = ctx.id("atmax");
    let timeout = limits["timeout_ms"].as_u64().unwrap_or(TIMEOUT_MS);
    let e = c
        .run(
            &with(
                ctx.exec(&id, lang, "echo ok"),
                json!({"limits": limits.clone()}),
            ),
            ctx.end_within(timeout.min(60_000)),
        )
        .await?;
    check!(
        e.terminal_status().as_deref() == Some("completed"),
        "every limit at its announced maximum: {}",
        e.dump()
    );
    match e.ack().and_then(|a| a.get("limits")) {
        Some(got) => {
            for name in LIMIT_NAMES {
                check!(
                    got[name] == limits[name],
                    "ack.limits.{name} is {} but {} was asked (clamped?): {}",
                    got[name],
                    limits[name],
                    short(got)
                );
            }
            Ok(String::new())
        }
        None => Ok("ack carries no limits (sandboxd addition): only acceptance was checked".into()),
    }
}

async fn defaults_filled(ctx: C) -> CaseResult {
    let lang = ctx.shell()?;
    let mut c = ctx.connect().await?;
    let id = ctx.id("defaults");
    let e = ctx.run(&mut c, &ctx.exec(&id, lang, "echo ok")).await?;
    let Some(limits) = e.ack().and_then(|a| a.get("limits")).cloned() else {
        skip!("the ack carries no limits (sandboxd addition); R.limits.1 checks the output default by behaviour");
    };
    let asked = &ctx.exec(&id, lang, "")["limits"];
    for (name, want) in [
        ("timeout_ms", asked["timeout_ms"].clone()),
        ("memory_mb", asked["memory_mb"].clone()),
        ("cpu_shares", json!(512)),
        ("max_output_bytes", json!(1_048_576)),
        ("pids_max", json!(64)),
        ("disk_mb", json!(64)),
    ] {
        check!(
            limits[name] == want,
            "ack.limits.{name} is {}, expected {want}: {}",
            limits[name],
            short(&limits)
        );
    }
    Ok(String::new())
}

async fn stdin_written(ctx: C) -> CaseResult {
    let lang = ctx.shell()?;
    let mut c = ctx.connect().await?;
    let input = "line one\nzwei ünïcödé ✓\nno newline at the end";
    let id = ctx.id("stdin");
    let e = ctx
        .run(
            &mut c,
            &ctx.exec_with(&id, lang, "cat; echo; echo eof", json!({"stdin": input})),
        )
        .await?;
    check_status(&e, "completed")?;
    check!(
        e.stdout_text() == format!("{input}\neof\n"),
        "stdin did not arrive as sent (or was not closed): {}",
        e.dump()
    );
    Ok(String::new())
}

async fn stdin_empty(ctx: C) -> CaseResult {
    let lang = ctx.shell()?;
    let mut c = ctx.connect().await?;
    for extra in [json!({}), json!({"stdin": null})] {
        let id = ctx.id("nostdin");
        let e = ctx
            .run(
                &mut c,
                &ctx.exec_with(&id, lang, "cat; echo eof", extra.clone()),
            )
            .await?;
        check!(
            e.terminal_status().as_deref() == Some("completed") && e.stdout_text() == "eof\n",
            "with {extra}: stdin was not empty and closed: {}",
            e.dump()
        );
    }
    Ok(String::new())
}

async fn files_placed(ctx: C) -> CaseResult {
    let lang = ctx.shell()?;
    if ctx.extension("files") != Some(true) {
        skip!("the files extension is not announced in pong.capabilities.extensions");
    }
    let mut c = ctx.connect().await?;
    let id = ctx.id("files");
    let files = json!({"files": [
        {"path": "data/in.csv", "content": "a,b\n1,2\n", "encoding": "utf8"},
        {"path": "bin/blob", "content": STANDARD.encode([0u8, 1, 2, 255]), "encoding": "base64"},
        {"path": "plain.txt", "content": "plain"},
    ]});
    let code = "cat data/in.csv; od -An -tx1 bin/blob | tr -d ' \\n'; echo; cat plain.txt";
    let e = ctx
        .run(&mut c, &ctx.exec_with(&id, lang, code, files))
        .await?;
    check_status(&e, "completed")?;
    check!(
        e.stdout_text() == "a,b\n1,2\n000102ff\nplain",
        "the files were not in the working directory as sent: {}",
        e.dump()
    );
    Ok(String::new())
}

async fn files_escape(ctx: C) -> CaseResult {
    let lang = ctx.shell()?;
    let mut c = ctx.connect().await?;
    for path in ["../x", "/etc/passwd", "a/../../x", "/tmp/fsp-escape"] {
        let id = ctx.id("escape");
        let exec = ctx.exec_with(
            &id,
            lang,
            "echo ran",
            json!({"files": [{"path": path, "content": "pwned"}]}),
        );
        refused_invalid(&ctx, &mut c, &exec, &id, &[]).await?;
        nothing_for(&ctx, &mut c, &id, 300, "a refused execute must not run").await?;
    }
    Ok(String::new())
}

async fn artifacts(ctx: C) -> CaseResult {
    let lang = ctx.shell()?;
    let mut c = ctx.connect().await?;
    let id = ctx.id("art");
    let exec = ctx.exec_with(
        &id,
        lang,
        "mkdir -p out; echo report > out/r.txt",
        json!({"artifacts": {"paths": ["out/**"]}}),
    );
    if ctx.extension("artifacts") == Some(true) {
        let e = ctx.run(&mut c, &exec).await?;
        check_status(&e, "completed")?;
        check!(
            e.result().is_some_and(|r| r.get("artifacts").is_some()),
            "artifacts were requested but the result has no manifest: {}",
            e.dump()
        );
        Ok("artifacts announced: manifest returned".into())
    } else {
        refused_invalid(&ctx, &mut c, &exec, &id, &["artifacts"]).await?;
        Ok("artifacts not announced: refused".into())
    }
}

/// Starts an execution, sends a duplicate of its id while it runs, returns (the duplicate's answer, the first
/// execution to its end).
async fn duplicate(ctx: &Ctx) -> Result<(crate::wire::Msg, Exec), Stop> {
    let lang = ctx.shell()?;
    let mut c = ctx.connect().await?;
    let id = ctx.id("dup");
    let sent = Instant::now();
    c.send_json(&ctx.exec(&id, lang, "echo first-started; sleep 1; echo first-done"))
        .await?;
    // Claim the first execution's ack and status:running, so that the duplicate's answer cannot be mistaken.
    let ack = c
        .take(ctx.secs(10), "the first execution's ack", |m| {
            m.is_for(&id) && m.kind() != "stdout"
        })
        .await?;
    let running = c
        .take(ctx.secs(10), "the first execution's status:running", |m| {
            m.is_for(&id) && m.kind() != "stdout"
        })
        .await?;
    c.send_json(&ctx.exec(&id, lang, "echo second")).await?;
    let answer = c
        .take(ctx.secs(10), "the answer to the duplicate", |m| {
            m.is_for(&id) && matches!(m.kind(), "error" | "ack")
        })
        .await?;
    let mut first = Exec::new(&id, sent);
    first.msgs.push(ack);
    first.msgs.push(running);
    c.collect_into(&mut first, ctx.end_within(TIMEOUT_MS))
        .await?;
    Ok((answer, first))
}

async fn duplicate_refused(ctx: C) -> CaseResult {
    let (answer, _) = duplicate(&ctx).await?;
    let id = answer.id().unwrap_or_default().to_owned();
    crate::framework::checked(crate::wire::check_error(
        &answer.raw,
        "INVALID_REQUEST",
        Some(&id),
    ))?;
    let msg = answer.raw["message"]
        .as_str()
        .unwrap_or_default()
        .to_lowercase();
    check!(
        msg.contains("duplicate"),
        "the message must say the id is a duplicate: {}",
        short(&answer.raw)
    );
    Ok(String::new())
}

async fn duplicate_harmless(ctx: C) -> CaseResult {
    let (answer, first) = duplicate(&ctx).await?;
    check!(
        answer.kind() == "error",
        "the duplicate was acknowledged: {}",
        short(&answer.raw)
    );
    sequence(&first)?;
    check!(
        first.statuses() == ["running", "completed"],
        "{}",
        first.dump()
    );
    check!(
        first.stdout_text() == "first-started\nfirst-done\n",
        "the first execution was affected by its duplicate: {}",
        first.dump()
    );
    Ok(String::new())
}

async fn id_reuse(ctx: C) -> CaseResult {
    let lang = ctx.shell()?;
    let mut c = ctx.connect().await?;
    let id = ctx.id("reuse");
    for round in ["first", "again"] {
        let e = ctx
            .run(&mut c, &ctx.exec(&id, lang, &format!("echo {round}")))
            .await?;
        check!(
            e.terminal_status().as_deref() == Some("completed")
                && e.stdout_text() == format!("{round}\n"),
            "{round}: {}",
            e.dump()
        );
    }
    Ok(String::new())
}

/// The cancel scenario: an execution cancelled after its first output. Shared with P.5.5.
pub async fn cancelled_execution(ctx: &Ctx) -> Result<Exec, Stop> {
    ctx.scenario("cancel", || async {
        let lang = ctx.shell()?;
        let mut c = ctx.connect().await?;
        let id = ctx.id("cancel");
        let sent = Instant::now();
        c.send_json(&ctx.exec(&id, lang, "echo started; sleep 30; echo not-cancelled"))
            .await?;
        c.observe(ctx.secs(10), "the first output", |m| {
            m.is_for(&id) && m.kind() == "stdout"
        })
        .await?;
        c.send_json(&cancel(&id)).await?;
        let e = c.collect(&id, sent, ctx.secs(10)).await?;
        c.close().await;
        Ok(e)
    })
    .await
}

async fn cancel_running(ctx: C) -> CaseResult {
    let e = cancelled_execution(&ctx).await?;
    ended(&e, "cancelled", "cancelled")?;
    exit_null(&e)?;
    check!(
        !e.stdout_text().contains("not-cancelled"),
        "the program went on after cancel: {}",
        e.dump()
    );
    Ok(String::new())
}

async fn cancel_before_start(ctx: C) -> CaseResult {
    let lang = ctx.shell()?;
    let mut c = ctx.connect().await?;
    let id = ctx.id("early");
    let sent = Instant::now();
    c.send_all(&[
        ctx.exec(&id, lang, "sleep 30; echo not-cancelled"),
        cancel(&id),
    ])
    .await?;
    let e = c.collect(&id, sent, ctx.secs(10)).await?;
    sequence(&e)?;
    ended(&e, "cancelled", "cancelled")?;
    let ran = e.statuses().iter().any(|s| s == "running");
    Ok(if ran {
        "cancelled after status:running".into()
    } else {
        "cancelled before it started (no status:running)".into()
    })
}

async fn cancel_unknown(ctx: C) -> CaseResult {
    let mut c = ctx.connect().await?;
    let id = ctx.id("never-sent");
    refused_cancel(&ctx, &mut c, &id).await?;
    Ok(String::new())
}

async fn cancel_ended(ctx: C) -> CaseResult {
    let lang = ctx.shell()?;
    let mut c = ctx.connect().await?;
    let id = ctx.id("ended");
    let e = ctx.run(&mut c, &ctx.exec(&id, lang, "echo hi")).await?;
    check!(e.result().is_some(), "{}", e.dump());
    refused_cancel(&ctx, &mut c, &id).await?;
    Ok(String::new())
}

async fn cancel_other_connection(ctx: C) -> CaseResult {
    let lang = ctx.shell()?;
    let mut owner = ctx.connect().await?;
    let mut other = ctx.connect().await?;
    let id = ctx.id("theirs");
    let sent = Instant::now();
    owner
        .send_json(&ctx.exec(&id, lang, "echo started; sleep 1; echo finished"))
        .await?;
    owner
        .observe(ctx.secs(10), "status:running", |m| {
            m.is_for(&id) && m.status() == Some("running")
        })
        .await?;
    refused_cancel(&ctx, &mut other, &id).await?;
    let e = owner.collect(&id, sent, ctx.end_within(TIMEOUT_MS)).await?;
    check!(
        e.terminal_status().as_deref() == Some("completed")
            && e.stdout_text() == "started\nfinished\n",
        "another connection's cancel affected the execution: {}",
        e.dump()
    );
    Ok(String::new())
}

async fn cancel_twice(ctx: C) -> CaseResult {
    let lang = ctx.shell()?;
    let mut c = ctx.connect().await?;
    let id = ctx.id("twice");
    let sent = Instant::now();
    c.send_json(&ctx.exec(&id, lang, "echo started; sleep 30"))
        .await?;
    c.observe(ctx.secs(10), "the first output", |m| {
        m.is_for(&id) && m.kind() == "stdout"
    })
    .await?;
    c.send_all(&[cancel(&id), cancel(&id)]).await?;
    let e = c.collect(&id, sent, ctx.secs(10)).await?;
    sequence(&e)?;
    ended(&e, "cancelled", "cancelled")?;
    // The second cancel arrived while the first was being carried out: nothing at all may follow for the id,
    // neither an error nor another message.
    c.expect_none(
        ctx.scaled(Duration::from_millis(700)),
        "the second cancel produced a message",
        |m| m.is_for(&id) || m.kind() == "error",
    )
    .await?;
    Ok(String::new())
}

async fn cancel_tree(ctx: C) -> CaseResult {
    let lang = ctx.shell()?;
    let marker = ctx.marker();
    let mut c = ctx.connect().await?;
    let id = ctx.id("tree");
    let sent = Instant::now();
    let code = format!("( sleep 300.{marker} & ) ; sleep 299.{marker} & echo started; wait");
    c.send_json(&ctx.exec(&id, lang, &code)).await?;
    c.observe(ctx.secs(10), "the first output", |m| {
        m.is_for(&id) && m.kind() == "stdout"
    })
    .await?;
    c.send_json(&cancel(&id)).await?;
    let e = c.collect(&id, sent, ctx.secs(10)).await?;
    ended(&e, "cancelled", "cancelled")?;
    let mut later = ctx.connect().await?;
    wait_no_marked_processes(&ctx, &mut later, &marker, ctx.secs(10)).await?;
    Ok("no process of the cancelled tree is visible to a later execution".into())
}

async fn ping_pong(ctx: C) -> CaseResult {
    let mut c = ctx.connect().await?;
    let pong = c.ping(ctx.secs(5)).await?;
    check!(
        load_of(&pong.raw).is_some(),
        "pong.load must have integer active_executions and queue_depth: {}",
        short(&pong.raw)
    );
    check!(
        pong.id().is_none(),
        "pong answers a ping, which has no id: {}",
        short(&pong.raw)
    );
    Ok(String::new())
}

/// What a text frame is, read cheaply: large frames are output (only output can be large).
fn classify(t: &str) -> Option<Value> {
    if t.len() > 4096 {
        None
    } else {
        serde_json::from_str(t).ok()
    }
}

async fn ping_during_flood(ctx: C) -> CaseResult {
    let lang = ctx.shell()?;
    let mut c = ctx.connect().await?;
    let mut flood = Flood {
        ctx: &ctx,
        lang,
        per_flood: ctx.fit("max_output_bytes", 256 << 20),
        timeout: ctx.fit("timeout_ms", 60_000),
        inflight: HashSet::new(),
        flood_bytes: 0,
        samples: Vec::new(),
        ping_sent: None,
        last_ping_done: Instant::now(),
    };
    for _ in 0..2 {
        flood.start(&mut c).await?;
    }
    let result = flood.measure(&mut c).await?;
    flood.stop(&mut c).await;
    c.close().await;
    result
}

/// Bound on a pong during the flood (the spec's 1 s, not scaled).
const PONG_BOUND: Duration = Duration::from_secs(1);

/// The flood of P.3.16: two executions writing output as fast as they can (each replaced when it ends), and
/// pings sent meanwhile.
struct Flood<'a> {
    ctx: &'a C,
    lang: &'static str,
    /// Each flood's `max_output_bytes` and `timeout_ms`.
    per_flood: u64,
    timeout: u64,
    /// The flood executions not ended yet.
    inflight: HashSet<String>,
    /// Output read so far (bytes of frames).
    flood_bytes: u64,
    /// How long the pongs took that came while a flood ran.
    samples: Vec<Duration>,
    /// The ping waiting for its pong: when it was sent, and `flood_bytes` then.
    ping_sent: Option<(Instant, u64)>,
    last_ping_done: Instant,
}

impl Flood<'_> {
    /// Starts one more flood execution.
    async fn start(&mut self, c: &mut Conn) -> Result<(), Stop> {
        let id = self.ctx.id("flood");
        let exec = self.ctx.exec_with(
            &id,
            self.lang,
            "exec yes 'flood flood flood flood flood flood flood flood flood flood flood flood'",
            json!({"limits": {"max_output_bytes": self.per_flood, "timeout_ms": self.timeout}}),
        );
        c.send_json(&exec).await?;
        self.inflight.insert(id);
        Ok(())
    }

    /// Pings while the floods run until 3 pongs came in time (or one did not): the case's verdict. `Err` when
    /// the connection fails under the suite.
    async fn measure(&mut self, c: &mut Conn) -> Result<CaseResult, Stop> {
        let started = Instant::now();
        self.last_ping_done = started;
        let overall = self.ctx.secs(60);
        loop {
            if started.elapsed() > overall {
                return Ok(Err(Stop::Harness(format!(
                    "could not take 3 pong samples during a flood within {overall:?}"
                ))));
            }
            if let Some((at, bytes)) = self.ping_sent {
                if at.elapsed() > PONG_BOUND {
                    return Ok(Err(Stop::Fail(format!(
                        "no pong within 1 s of a ping while {} execution(s) flooded output ({} KiB of output read meanwhile)",
                        self.inflight.len(),
                        (self.flood_bytes - bytes) >> 10
                    ))));
                }
            } else if self.flood_bytes >= 2 << 20
                && self.last_ping_done.elapsed() > Duration::from_millis(200)
                && !self.inflight.is_empty()
            {
                c.send_json(&crate::msgs::ping()).await?;
                self.ping_sent = Some((Instant::now(), self.flood_bytes));
            }
            let wait = match self.ping_sent {
                Some((at, _)) => PONG_BOUND
                    .saturating_sub(at.elapsed())
                    .max(Duration::from_millis(1)),
                None => self.ctx.secs(10),
            };
            let frame = match c.raw(wait).await {
                None if self.ping_sent.is_some() => continue,
                None => {
                    return Ok(Err(Stop::Fail(format!(
                        "no output from the flood within {wait:?}"
                    ))))
                }
                Some(Err(Frame::Closed(cl))) => {
                    return Ok(Err(Stop::Fail(format!(
                        "the connection ended during the flood: {cl:?}"
                    ))))
                }
                Some(Err(other)) => {
                    return Ok(Err(Stop::Fail(format!(
                        "unexpected frame during the flood: {other:?}"
                    ))))
                }
                Some(Ok(t)) => t,
            };
            if let ControlFlow::Break(verdict) = self.on_frame(c, &frame).await? {
                return Ok(verdict);
            }
        }
    }

    /// One text frame: output is counted, a pong timed, an ended flood replaced.
    async fn on_frame(
        &mut self,
        c: &mut Conn,
        frame: &str,
    ) -> Result<ControlFlow<CaseResult>, Stop> {
        let Some(v) = classify(frame) else {
            self.flood_bytes += frame.len() as u64;
            return Ok(ControlFlow::Continue(()));
        };
        match v["type"].as_str().unwrap_or_default() {
            "stdout" | "stderr" => self.flood_bytes += frame.len() as u64,
            "pong" => return Ok(self.on_pong()),
            "result" | "error" => {
                let id = v["id"].as_str().unwrap_or_default().to_owned();
                if self.inflight.remove(&id) {
                    if v["type"] == "error" {
                        return Ok(ControlFlow::Break(Err(Stop::Harness(format!(
                            "a flood execution was refused: {}",
                            short(&v)
                        )))));
                    }
                    self.start(c).await?;
                }
            }
            _ => {}
        }
        Ok(ControlFlow::Continue(()))
    }

    fn on_pong(&mut self) -> ControlFlow<CaseResult> {
        let Some((at, _)) = self.ping_sent.take() else {
            return ControlFlow::Continue(());
        };
        let took = at.elapsed();
        if took > PONG_BOUND {
            return ControlFlow::Break(Err(Stop::Fail(format!(
                "pong after {took:?} (> 1 s) during the flood"
            ))));
        }
        if !self.inflight.is_empty() {
            self.samples.push(took);
        }
        self.last_ping_done = Instant::now();
        if self.samples.len() >= 3 {
            let worst = self.samples.iter().max().copied().unwrap_or_default();
            return ControlFlow::Break(Ok(format!(
                "slowest of {} pongs: {worst:?}; {} MiB of output read",
                self.samples.len(),
                self.flood_bytes >> 20
            )));
        }
        ControlFlow::Continue(())
    }

    /// Cancels the floods and drains what is left of them cheaply, before the connection closes.
    async fn stop(&mut self, c: &mut Conn) {
        for id in &self.inflight {
            let _ = c.send_json(&cancel(id)).await;
        }
        let drain_until = Instant::now() + self.ctx.secs(20);
        while !self.inflight.is_empty() && Instant::now() < drain_until {
            match c.raw(self.ctx.secs(5)).await {
                Some(Ok(t)) => {
                    if let Some(v) = classify(&t) {
                        if matches!(v["type"].as_str(), Some("result" | "error")) {
                            self.inflight.remove(v["id"].as_str().unwrap_or_default());
                        }
                    }
                }
                _ => break,
            }
        }
    }
}

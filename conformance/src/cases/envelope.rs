//! P.2: the envelope (spec section 2): `v`, `type`, `ts` and `id` on every message, and the refusals of
//! malformed requests, each naming the offending field.

use std::time::Instant;

use serde_json::{json, Value};

use super::common::{case, nothing_for, refused, refused_cancel, refused_invalid, text, C};
use crate::framework::{Case, CaseResult, Stop};
use crate::msgs::{ts, with};
use crate::wire::{check_ts, short, SERVER_TYPES};
use crate::{check, fail};

const ENVELOPE: &str = "Every message in both directions: `{\"v\": 1, \"type\": \"...\", \"ts\": \"2025-12-27T11:30:00.000Z\", ...}`. `ts` is UTC ISO 8601 with milliseconds.";
const ID: &str =
    "`id` (string, 1-128 chars of `[A-Za-z0-9_.:-]`) is required on execution messages.";
const ECHO: &str = "An `error` that answers a message carrying an `id` MUST echo that `id`; an error about a frame with no usable `id` has none.";
const VERSION: &str = "A message whose `v` the server does not speak MUST get `error` `INVALID_REQUEST` with `supported_versions: [1]`.";
const FIELDS: &str = "Unknown `type`, a missing required field, a wrong field type, or an unknown field in `execute` MUST get `error` `INVALID_REQUEST` with a `message` that names the field.";
const UNKNOWN: &str = "Unknown fields are refused rather than ignored, so a client never believes a limit is enforced when it is not.";

/// The cases of this group, in id order.
pub static CASES: &[Case] = &[
    case!(
        "P.2.1",
        Must,
        "2",
        "Every server message carries \"v\": 1 and a type of section 4",
        ENVELOPE,
        v_and_type
    ),
    case!(
        "P.2.2",
        Must,
        "2",
        "Every server message carries ts in UTC ISO 8601 with milliseconds",
        ENVELOPE,
        timestamps
    ),
    case!(
        "P.2.3",
        Must,
        "2",
        "Execution messages carry the execution's id",
        ID,
        execution_ids
    ),
    case!(
        "P.2.4",
        Must,
        "2",
        "An error answering a message with an id echoes it",
        ECHO,
        echoes_id
    ),
    case!(
        "P.2.5",
        Must,
        "2",
        "An error about a frame without a usable id has none",
        ECHO,
        no_usable_id
    ),
    case!(
        "P.2.6",
        Must,
        "2",
        "An unsupported v gets INVALID_REQUEST with supported_versions [1]",
        VERSION,
        bad_version
    ),
    case!(
        "P.2.7",
        Must,
        "2",
        "An execute with an unsupported v is refused, echoing its id",
        VERSION,
        bad_version_execute
    ),
    case!(
        "P.2.8",
        Must,
        "2",
        "An unknown type gets INVALID_REQUEST naming the field",
        FIELDS,
        unknown_type
    ),
    case!(
        "P.2.9",
        Must,
        "2",
        "A missing required field of execute is refused naming the field",
        FIELDS,
        missing_fields
    ),
    case!(
        "P.2.10",
        Must,
        "2",
        "A missing envelope field is refused naming the field",
        FIELDS,
        missing_envelope
    ),
    case!(
        "P.2.11",
        Must,
        "2",
        "A field of the wrong type is refused naming the field",
        FIELDS,
        wrong_types
    ),
    case!(
        "P.2.12",
        Must,
        "2",
        "An unknown field of execute is refused naming the field",
        UNKNOWN,
        unknown_field
    ),
    case!(
        "P.2.13",
        Must,
        "2",
        "An unknown field in execute.limits is refused naming the field",
        UNKNOWN,
        unknown_limit
    ),
    case!(
        "P.2.14",
        Must,
        "2",
        "An unknown field inside files or artifacts is refused naming the field",
        UNKNOWN,
        unknown_nested
    ),
    case!(
        "P.2.15",
        Must,
        "2",
        "An id of 128 characters using every allowed character is accepted",
        ID,
        longest_id
    ),
];

/// Some ordinary traffic: a ping, an execution with stdout and stderr, a refusal and an unknown cancel. Returns
/// every message received.
async fn traffic(ctx: &C) -> Result<Vec<Value>, Stop> {
    let lang = ctx.shell()?;
    let mut c = ctx.connect().await?;
    c.ping(ctx.secs(10)).await?;
    let id = ctx.id("env");
    let e = ctx
        .run(&mut c, &ctx.exec(&id, lang, "echo out; echo err >&2"))
        .await?;
    check!(e.result().is_some(), "{}", e.dump());
    refused(
        ctx,
        &mut c,
        text(&json!({"v": 1, "type": "launch", "ts": ts()})),
        "INVALID_REQUEST",
        None,
        &[],
    )
    .await?;
    let unknown = ctx.id("env-unknown");
    c.send_json(&crate::msgs::cancel(&unknown)).await?;
    c.take_error(ctx.secs(10)).await?;
    let seen: Vec<Value> = c.seen.iter().map(|m| m.raw.clone()).collect();
    c.close().await;
    Ok(seen)
}

async fn v_and_type(ctx: C) -> CaseResult {
    let seen = traffic(&ctx).await?;
    for raw in &seen {
        check!(
            raw.get("v") == Some(&json!(1)),
            "\"v\" is not the integer 1: {}",
            short(raw)
        );
        let kind = raw["type"].as_str().unwrap_or_default();
        check!(
            SERVER_TYPES.contains(&kind),
            "\"type\" is not one of {SERVER_TYPES:?}: {}",
            short(raw)
        );
    }
    Ok(format!("{} messages checked", seen.len()))
}

async fn timestamps(ctx: C) -> CaseResult {
    let seen = traffic(&ctx).await?;
    for raw in &seen {
        match raw["ts"].as_str() {
            Some(t) => check_ts(t).map_err(|e| Stop::Fail(format!("{e}: {}", short(raw))))?,
            None => fail!("a server message without a string ts: {}", short(raw)),
        }
    }
    Ok(format!("{} messages checked", seen.len()))
}

async fn execution_ids(ctx: C) -> CaseResult {
    let lang = ctx.shell()?;
    let mut c = ctx.connect().await?;
    let id = ctx.id("ids");
    c.send_json(&ctx.exec(&id, lang, "echo out; echo err >&2; exit 2"))
        .await?;
    let until = Instant::now() + ctx.end_within(crate::ctx::TIMEOUT_MS);
    loop {
        let m = c
            .next(
                until.saturating_duration_since(Instant::now()),
                "the execution's messages",
            )
            .await?;
        match m.kind() {
            "ack" | "status" | "stdout" | "stderr" | "result" => {
                check!(
                    m.id() == Some(id.as_str()),
                    "{} without the execution's id {id:?}: {}",
                    m.kind(),
                    short(&m.raw)
                );
                if m.kind() == "result" {
                    return Ok(String::new());
                }
            }
            "error" => fail!("unexpected error: {}", short(&m.raw)),
            _ => {}
        }
    }
}

async fn echoes_id(ctx: C) -> CaseResult {
    let lang = ctx.shell()?;
    let mut c = ctx.connect().await?;
    let id = ctx.id("echo-a");
    refused_invalid(
        &ctx,
        &mut c,
        &json!({"v": 1, "type": "launch", "id": id, "ts": ts()}),
        &id,
        &[],
    )
    .await?;
    let id = ctx.id("echo-b");
    refused_invalid(
        &ctx,
        &mut c,
        &with(ctx.exec(&id, lang, "echo x"), json!({"code": null})),
        &id,
        &[],
    )
    .await?;
    let id = ctx.id("echo-c");
    refused(
        &ctx,
        &mut c,
        text(&with(
            ctx.exec(&id, lang, "echo x"),
            json!({"limits": {"memory_mb": "lots"}}),
        )),
        "INVALID_REQUEST",
        Some(&id),
        &[],
    )
    .await?;
    let id = ctx.id("echo-d");
    refused_cancel(&ctx, &mut c, &id).await?;
    let id = ctx.id("echo-e");
    refused(
        &ctx,
        &mut c,
        text(&ctx.exec(&id, "cobol", "DISPLAY 'x'.")),
        "LANGUAGE_NOT_SUPPORTED",
        Some(&id),
        &[],
    )
    .await?;
    Ok(String::new())
}

async fn no_usable_id(ctx: C) -> CaseResult {
    let lang = ctx.shell()?;
    let mut c = ctx.connect().await?;
    let long = "x".repeat(129);
    for bad in [
        json!(7),
        json!("bad id!"),
        json!(""),
        json!(long),
        json!("a/b"),
        json!("é"),
    ] {
        let exec = with(ctx.exec("placeholder", lang, "echo x"), json!({"id": bad}));
        refused(&ctx, &mut c, text(&exec), "INVALID_REQUEST", None, &["id"]).await?;
    }
    let exec = with(ctx.exec("placeholder", lang, "echo x"), json!({"id": null}));
    refused(&ctx, &mut c, text(&exec), "INVALID_REQUEST", None, &["id"]).await?;
    refused(
        &ctx,
        &mut c,
        text(&json!({"v": 1, "type": "cancel", "ts": ts()})),
        "INVALID_REQUEST",
        None,
        &["id"],
    )
    .await?;
    Ok(String::new())
}

fn check_supported(raw: &Value) -> Result<(), Stop> {
    match raw.get("supported_versions") {
        Some(v) if v == &json!([1]) => Ok(()),
        other => Err(Stop::Fail(format!(
            "supported_versions must be [1], got {other:?}: {}",
            short(raw)
        ))),
    }
}

async fn bad_version(ctx: C) -> CaseResult {
    let mut c = ctx.connect().await?;
    for v in [json!(2), json!(0), json!(99)] {
        let e = refused(
            &ctx,
            &mut c,
            text(&json!({"v": v, "type": "ping", "ts": ts()})),
            "INVALID_REQUEST",
            None,
            &[],
        )
        .await?;
        check_supported(&e.raw)?;
    }
    Ok(String::new())
}

async fn bad_version_execute(ctx: C) -> CaseResult {
    let lang = ctx.shell()?;
    let mut c = ctx.connect().await?;
    let id = ctx.id("v2");
    let e = refused_invalid(
        &ctx,
        &mut c,
        &with(ctx.exec(&id, lang, "echo ran"), json!({"v": 2})),
        &id,
        &[],
    )
    .await?;
    check_supported(&e.raw)?;
    nothing_for(&ctx, &mut c, &id, 500, "a refused execute must not run").await?;
    Ok(String::new())
}

async fn unknown_type(ctx: C) -> CaseResult {
    let mut c = ctx.connect().await?;
    refused(
        &ctx,
        &mut c,
        text(&json!({"v": 1, "type": "launch", "ts": ts()})),
        "INVALID_REQUEST",
        None,
        &["type"],
    )
    .await?;
    let id = ctx.id("type");
    refused_invalid(
        &ctx,
        &mut c,
        &json!({"v": 1, "type": "Execute", "id": id, "ts": ts()}),
        &id,
        &["type"],
    )
    .await?;
    Ok(String::new())
}

async fn missing_fields(ctx: C) -> CaseResult {
    let lang = ctx.shell()?;
    let mut c = ctx.connect().await?;
    for (remove, name) in [
        (json!({"language": null}), "language"),
        (json!({"code": null}), "code"),
        (json!({"limits": null}), "limits"),
        (json!({"limits": {"timeout_ms": null}}), "timeout_ms"),
        (json!({"limits": {"memory_mb": null}}), "memory_mb"),
    ] {
        let id = ctx.id("missing");
        refused_invalid(
            &ctx,
            &mut c,
            &with(ctx.exec(&id, lang, "echo x"), remove),
            &id,
            &[name],
        )
        .await?;
    }
    Ok(String::new())
}

async fn missing_envelope(ctx: C) -> CaseResult {
    let lang = ctx.shell()?;
    let mut c = ctx.connect().await?;
    for (remove, name) in [
        (json!({"type": null}), "type"),
        (json!({"ts": null}), "ts"),
        (json!({"v": null}), "v"),
    ] {
        let id = ctx.id("envf");
        refused_invalid(
            &ctx,
            &mut c,
            &with(ctx.exec(&id, lang, "echo x"), remove),
            &id,
            &[name],
        )
        .await?;
    }
    Ok(String::new())
}

async fn wrong_types(ctx: C) -> CaseResult {
    let lang = ctx.shell()?;
    let mut c = ctx.connect().await?;
    for (change, name) in [
        (json!({"limits": {"timeout_ms": "soon"}}), "timeout_ms"),
        (json!({"limits": {"memory_mb": -5}}), "memory_mb"),
        (json!({"code": 5}), "code"),
        (json!({"stdin": 5}), "stdin"),
        (json!({"env": {"K": 1}}), "env"),
        (json!({"language": ["shell"]}), "language"),
        (json!({"limits": "small"}), "limits"),
    ] {
        let id = ctx.id("types");
        refused_invalid(
            &ctx,
            &mut c,
            &with(ctx.exec(&id, lang, "echo x"), change),
            &id,
            &[name],
        )
        .await?;
    }
    Ok(String::new())
}

async fn unknown_field(ctx: C) -> CaseResult {
    let lang = ctx.shell()?;
    let mut c = ctx.connect().await?;
    for (extra, name) in [
        (json!({"priority": 5}), "priority"),
        (json!({"network": "full"}), "network"),
    ] {
        let id = ctx.id("unk");
        refused_invalid(
            &ctx,
            &mut c,
            &with(ctx.exec(&id, lang, "echo ran"), extra),
            &id,
            &[name],
        )
        .await?;
        nothing_for(
            &ctx,
            &mut c,
            &id,
            300,
            "an execute with an unknown field must not run",
        )
        .await?;
    }
    Ok(String::new())
}

async fn unknown_limit(ctx: C) -> CaseResult {
    let lang = ctx.shell()?;
    let mut c = ctx.connect().await?;
    for (extra, name) in [
        (json!({"limits": {"gpu_count": 1}}), "gpu_count"),
        (json!({"limits": {"cpu_ms": 10}}), "cpu_ms"),
    ] {
        let id = ctx.id("unkl");
        refused_invalid(
            &ctx,
            &mut c,
            &with(ctx.exec(&id, lang, "echo ran"), extra),
            &id,
            &[name],
        )
        .await?;
    }
    Ok(String::new())
}

async fn unknown_nested(ctx: C) -> CaseResult {
    let lang = ctx.shell()?;
    let mut c = ctx.connect().await?;
    let mut note = Vec::new();
    let id = ctx.id("unkf");
    let files = json!({"files": [{"path": "a.txt", "content": "x", "mode": 493}]});
    if ctx.extension("files") == Some(true) {
        refused_invalid(
            &ctx,
            &mut c,
            &with(ctx.exec(&id, lang, "echo ran"), files),
            &id,
            &["mode"],
        )
        .await?;
    } else {
        refused_invalid(
            &ctx,
            &mut c,
            &with(ctx.exec(&id, lang, "echo ran"), files),
            &id,
            &["files"],
        )
        .await?;
        note.push("files not announced: the field itself is refused");
    }
    let id = ctx.id("unka");
    let artifacts = json!({"artifacts": {"paths": ["out/**"], "keep": true}});
    if ctx.extension("artifacts") == Some(true) {
        refused_invalid(
            &ctx,
            &mut c,
            &with(ctx.exec(&id, lang, "echo ran"), artifacts),
            &id,
            &["keep"],
        )
        .await?;
    } else {
        refused_invalid(
            &ctx,
            &mut c,
            &with(ctx.exec(&id, lang, "echo ran"), artifacts),
            &id,
            &["artifacts"],
        )
        .await?;
        note.push("artifacts not announced: the field itself is refused");
    }
    Ok(note.join("; "))
}

async fn longest_id(ctx: C) -> CaseResult {
    let lang = ctx.shell()?;
    let mut c = ctx.connect().await?;
    let base = "AZaz09_.:-";
    let id: String = format!("{base}{}", ctx.id("long"))
        .chars()
        .chain(std::iter::repeat('z'))
        .take(128)
        .collect();
    let e = ctx.run(&mut c, &ctx.exec(&id, lang, "echo ok")).await?;
    check!(
        e.terminal_status().as_deref() == Some("completed"),
        "an execution with a 128-character id: {}",
        e.dump()
    );
    Ok(String::new())
}

//! E.tools: the `tool_calls` extension (`docs/spec/tool-calls.md`), run only when `pong` announces it and python
//! is available: code calls tools through `sandbox_tools`, the client answers `tool_call` with `tool_result`.

use std::time::{Duration, Instant};

use serde_json::{json, Value};

use super::common::{case, refused_invalid, sequence, C};
use crate::client::Conn;
use crate::ctx::{Ctx, TIMEOUT_MS};
use crate::framework::{Case, CaseResult, Stop};
use crate::wire::{short, Exec};
use crate::{check, fail, skip};

const FORWARD: &str = "A call of a tool the execute lists becomes `tool_call` `{id, call_id, name, args}`; the client's `tool_result` (`ok`, `result`) is what the call returns in the code; `result.tool_calls` counts the calls forwarded.";
const REFUSE: &str = "Only tools named in the execute request may be called; others fail inside the sandbox with a clear error and are never forwarded.";
const RETURN: &str = "The value the code returns (its last expression, or an explicit top-level `return`) comes back as `result.return_value`.";
const TIMEOUT: &str = "A call the client does not answer within `tool_timeout_ms` fails in the code with a timeout error.";
const INVALID: &str = "`tools` is refused with INVALID_REQUEST naming the field when names repeat, are not identifiers, or the language has no SDK.";

/// The cases of this group, in id order.
pub static CASES: &[Case] = &[
    case!(
        "E.tools.1",
        Must,
        "tool-calls",
        "A listed tool's call reaches the client and its answer the code",
        FORWARD,
        forwarded
    ),
    case!(
        "E.tools.2",
        Must,
        "tool-calls",
        "A tool not listed is refused inside the sandbox, never forwarded",
        REFUSE,
        refused_inside
    ),
    case!(
        "E.tools.3",
        Must,
        "tool-calls",
        "The code's return value is result.return_value",
        RETURN,
        return_value
    ),
    case!(
        "E.tools.4",
        Must,
        "tool-calls",
        "An unanswered call times out after tool_timeout_ms",
        TIMEOUT,
        timeout
    ),
    case!(
        "E.tools.5",
        Must,
        "tool-calls",
        "Invalid tools are refused with INVALID_REQUEST naming the field",
        INVALID,
        invalid
    ),
];

fn applies(ctx: &Ctx) -> Result<&'static str, Stop> {
    if ctx.extension("tool_calls") != Some(true) {
        skip!("the tool_calls extension is not announced in pong.capabilities.extensions");
    }
    ctx.python()
}

/// Sends `exec` and collects it, answering each `tool_call` with `answer` (`None`: no answer). Returns the
/// execution and the `tool_call`s seen.
async fn run_answering(
    ctx: &Ctx,
    conn: &mut Conn,
    exec: &Value,
    answer: impl Fn(&Value) -> Option<Value>,
) -> Result<(Exec, Vec<Value>), Stop> {
    let id = exec["id"].as_str().unwrap_or_default().to_owned();
    let mut e = Exec::new(&id, Instant::now());
    let mut calls = Vec::new();
    conn.send_json(exec).await?;
    let until = Instant::now() + ctx.end_within(TIMEOUT_MS);
    while !e.done() {
        let left = until.saturating_duration_since(Instant::now());
        let m = conn
            .take(
                left,
                &format!("the end of {id} (so far {:?})", e.labels()),
                |m| m.is_for(&id),
            )
            .await?;
        if m.kind() == "tool_call" {
            let call = m.raw.clone();
            for field in ["call_id", "name"] {
                check!(
                    call[field].is_string(),
                    "tool_call without a string {field}: {}",
                    short(&call)
                );
            }
            check!(
                call["args"].is_object(),
                "tool_call args must be an object: {}",
                short(&call)
            );
            if let Some(result) = answer(&call) {
                conn.send_json(
                    &json!({"v": 1, "type": "tool_result", "id": id, "call_id": call["call_id"],
                                       "ts": crate::msgs::ts(), "ok": true, "result": result}),
                )
                .await?;
            }
            calls.push(call);
        }
        e.msgs.push(m);
    }
    sequence(&e)?;
    Ok((e, calls))
}

fn exec_tools(ctx: &Ctx, tag: &str, lang: &str, code: &str, extra: Value) -> Value {
    let exec = ctx.exec_with(
        &ctx.id(tag),
        lang,
        code,
        json!({"tools": [{"name": "lookup"}]}),
    );
    crate::msgs::with(exec, extra)
}

async fn forwarded(ctx: C) -> CaseResult {
    let lang = applies(&ctx)?;
    let mut c = ctx.connect().await?;
    let code = "from sandbox_tools import call\nprint('got', call('lookup', {'key': 'k1'})['v'])\n";
    let exec = exec_tools(&ctx, "tc", lang, code, json!({}));
    let (e, calls) = run_answering(&ctx, &mut c, &exec, |call| {
        Some(json!({"v": format!("value-of-{}", call["args"]["key"].as_str().unwrap_or(""))}))
    })
    .await?;
    check!(
        calls.len() == 1,
        "expected one tool_call, got {}: {}",
        calls.len(),
        e.dump()
    );
    check!(
        calls[0]["name"] == "lookup" && calls[0]["args"] == json!({"key": "k1"}),
        "the tool_call must carry the name and args the code used: {}",
        short(&calls[0])
    );
    check!(
        e.stdout_text().contains("got value-of-k1"),
        "the answer did not reach the code: {}",
        e.dump()
    );
    let counted = e.result().and_then(|r| r.get("tool_calls")).cloned();
    check!(
        counted == Some(json!(1)),
        "result.tool_calls must be 1, got {counted:?}: {}",
        e.dump()
    );
    Ok("the call was forwarded, answered and counted".into())
}

async fn refused_inside(ctx: C) -> CaseResult {
    let lang = applies(&ctx)?;
    let mut c = ctx.connect().await?;
    let code = "from sandbox_tools import call, ToolError\ntry:\n    call('steal', {})\n    print('called')\nexcept ToolError as e:\n    print('refused', e.code)\n";
    let exec = exec_tools(&ctx, "tcr", lang, code, json!({}));
    let (e, calls) = run_answering(&ctx, &mut c, &exec, |_| Some(json!("leaked"))).await?;
    if !calls.is_empty() {
        fail!(
            "a call of a tool the request did not list was forwarded: {}",
            short(&calls[0])
        );
    }
    check!(
        e.stdout_text().contains("refused not_allowed"),
        "the code must see a not_allowed error: {}",
        e.dump()
    );
    Ok("refused inside the sandbox".into())
}

async fn return_value(ctx: C) -> CaseResult {
    let lang = applies(&ctx)?;
    let mut c = ctx.connect().await?;
    let code = "n = lookup(key='a')\n{'n': n, 'list': [1, 2]}\n";
    let exec = exec_tools(&ctx, "tcv", lang, code, json!({}));
    let (e, _) = run_answering(&ctx, &mut c, &exec, |_| Some(json!(7))).await?;
    let got = e.result().and_then(|r| r.get("return_value")).cloned();
    check!(
        got == Some(json!({"n": 7, "list": [1, 2]})),
        "result.return_value is {got:?}: {}",
        e.dump()
    );
    Ok("the last expression came back".into())
}

async fn timeout(ctx: C) -> CaseResult {
    let lang = applies(&ctx)?;
    let mut c = ctx.connect().await?;
    let code = "import time\nfrom sandbox_tools import ToolError\nt = time.monotonic()\ntry:\n    lookup(key='x')\nexcept ToolError as e:\n    print(e.code, int((time.monotonic() - t) * 1000))\n";
    let exec = exec_tools(&ctx, "tct", lang, code, json!({"tool_timeout_ms": 500}));
    let (e, calls) = run_answering(&ctx, &mut c, &exec, |_| None).await?;
    check!(calls.len() == 1, "expected one tool_call: {}", e.dump());
    let out = e.stdout_text();
    let mut words = out.split_whitespace();
    let (code, ms) = (
        words.next(),
        words.next().and_then(|w| w.parse::<u64>().ok()),
    );
    check!(
        code == Some("timeout"),
        "the code must see a timeout error: {}",
        e.dump()
    );
    let limit = ctx.scaled(Duration::from_secs(10)).as_millis() as u64;
    check!(
        ms.is_some_and(|ms| (500..limit).contains(&ms)),
        "the call failed after {ms:?} ms, expected 500 ms or a little more"
    );
    Ok(format!("timed out after {} ms", ms.unwrap_or(0)))
}

async fn invalid(ctx: C) -> CaseResult {
    let lang = applies(&ctx)?;
    let mut c = ctx.connect().await?;
    let id = ctx.id("tci");
    let dup = ctx.exec_with(
        &id,
        lang,
        "1",
        json!({"tools": [{"name": "a"}, {"name": "a"}]}),
    );
    refused_invalid(&ctx, &mut c, &dup, &id, &["tools[1].name"]).await?;
    let id = ctx.id("tci");
    let bad = ctx.exec_with(&id, lang, "1", json!({"tools": [{"name": "no-dash"}]}));
    refused_invalid(&ctx, &mut c, &bad, &id, &["tools[0].name"]).await?;
    if let Ok(shell) = ctx.shell() {
        let id = ctx.id("tci");
        let sh = ctx.exec_with(&id, shell, "true", json!({"tools": [{"name": "a"}]}));
        refused_invalid(&ctx, &mut c, &sh, &id, &["tools"]).await?;
    }
    Ok("refused, naming the field".into())
}

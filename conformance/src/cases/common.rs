//! What the cases share: the [`case!`] row macro, the context type and the checks several groups make.

use std::sync::Arc;
use std::time::Duration;

use serde_json::Value;
use tokio_tungstenite::tungstenite::Message;

use crate::check;
use crate::client::Conn;
use crate::ctx::Ctx;
use crate::framework::Stop;
use crate::msgs::cancel;
use crate::wire::{check_error, short, Exec, Msg};

/// Declares a [`Case`], a row of a group's `CASES` table. The body is a case function, or a function shared by
/// several rows with the row's arguments after the context (`above_max("timeout_ms")`).
macro_rules! case {
    (@row $id:literal, $level:ident, $section:literal, $title:literal, $req:expr, $run:expr) => {
        $crate::framework::Case {
            id: $id,
            level: $crate::framework::Level::$level,
            section: $section,
            title: $title,
            requirement: $req,
            run: $run,
        }
    };
    ($id:literal, $level:ident, $section:literal, $title:literal, $req:expr, $f:ident($($arg:expr),+ $(,)?)) => {
        $crate::cases::common::case!(@row $id, $level, $section, $title, $req,
            |ctx| Box::pin(async move { $f(&ctx, $($arg),+).await }))
    };
    ($id:literal, $level:ident, $section:literal, $title:literal, $req:expr, $f:path) => {
        $crate::cases::common::case!(@row $id, $level, $section, $title, $req, |ctx| Box::pin($f(ctx)))
    };
}
pub(crate) use case;

/// The shared context type cases get.
pub type C = Arc<Ctx>;

/// Sends `frame`, expects an `error` with `code` (echoing `id`, or with none), whose message names each of
/// `names`; then checks the connection still answers a ping.
pub async fn refused(
    ctx: &Ctx,
    conn: &mut Conn,
    frame: Message,
    code: &str,
    id: Option<&str>,
    names: &[&str],
) -> Result<Msg, Stop> {
    let shown = match &frame {
        Message::Text(t) => short(&Value::String(t.as_str().chars().take(300).collect())),
        other => format!("{other:?}").chars().take(120).collect(),
    };
    conn.send(frame).await?;
    let e = conn
        .take(ctx.secs(10), &format!("an error answering {shown}"), |m| {
            m.kind() == "error" || (id.is_some() && m.is_for(id.unwrap_or_default()))
        })
        .await?;
    check_error(&e.raw, code, id).map_err(|why| Stop::Fail(format!("answering {shown}: {why}")))?;
    let text = e.raw["message"].as_str().unwrap_or_default();
    for n in names {
        if !text.contains(n) {
            return Err(Stop::Fail(format!(
                "the error answering {shown} must name {n:?}: {}",
                short(&e.raw)
            )));
        }
    }
    conn.ping(ctx.secs(10)).await.map_err(|s| {
        Stop::Fail(format!(
            "the connection is not usable after the refusal of {shown}: {}",
            s.message()
        ))
    })?;
    Ok(e)
}

/// Sends `exec` (an `execute`), expects `INVALID_REQUEST` echoing `id` and naming each of `names` ([`refused`]).
pub async fn refused_invalid(
    ctx: &Ctx,
    conn: &mut Conn,
    exec: &Value,
    id: &str,
    names: &[&str],
) -> Result<Msg, Stop> {
    refused(ctx, conn, text(exec), "INVALID_REQUEST", Some(id), names).await
}

/// Sends a `cancel` of `id`, expects `UNKNOWN_EXECUTION` echoing it ([`refused`]).
pub async fn refused_cancel(ctx: &Ctx, conn: &mut Conn, id: &str) -> Result<Msg, Stop> {
    refused(
        ctx,
        conn,
        text(&cancel(id)),
        "UNKNOWN_EXECUTION",
        Some(id),
        &[],
    )
    .await
}

/// Reads for `millis` (scaled) and fails with `what` if a message for execution `id` arrives.
pub async fn nothing_for(
    ctx: &Ctx,
    conn: &mut Conn,
    id: &str,
    millis: u64,
    what: &str,
) -> Result<(), Stop> {
    conn.expect_none(ctx.scaled(Duration::from_millis(millis)), what, |m| {
        m.is_for(id)
    })
    .await
}

/// A text frame of a JSON value.
pub fn text(v: &Value) -> Message {
    Message::text(v.to_string())
}

/// Checks the execution ended with `status` and, when the server sends `reason`, with `reason`.
pub fn ended(e: &Exec, status: &str, reason: &str) -> Result<(), Stop> {
    if e.terminal_status().as_deref() != Some(status) {
        return Err(Stop::Fail(format!(
            "expected terminal status {status:?}: {}",
            e.dump()
        )));
    }
    match e.result() {
        None => Err(Stop::Fail(format!("expected a result: {}", e.dump()))),
        Some(r) => match r.get("reason") {
            Some(v) if v == reason => Ok(()),
            Some(v) => Err(Stop::Fail(format!(
                "result.reason is {v}, expected {reason:?}: {}",
                e.dump()
            ))),
            None => Err(Stop::Fail(format!(
                "result.reason is missing (spec section 4/5: the terminal status comes with the matching result.reason): {}",
                e.dump()
            ))),
        },
    }
}

/// Fails with the execution's dump unless it ended with `status`.
pub fn check_status(e: &Exec, status: &str) -> Result<(), Stop> {
    check!(
        e.terminal_status().as_deref() == Some(status),
        "{}",
        e.dump()
    );
    Ok(())
}

/// Checks the result's `exit_code` is null (the program was killed by a signal).
pub fn exit_null(e: &Exec) -> Result<(), Stop> {
    match e.exit_code() {
        Some(Value::Null) => Ok(()),
        other => Err(Stop::Fail(format!(
            "result.exit_code must be null for a program killed by a signal, got {other:?}: {}",
            e.dump()
        ))),
    }
}

/// Fails unless the execution's sequence is well formed.
pub fn sequence(e: &Exec) -> Result<(), Stop> {
    e.check_sequence().map_err(Stop::Fail)
}

/// Waits until a connection's `pong.load` is back to `(0, 0)`.
pub async fn idle(ctx: &Ctx, conn: &mut Conn) -> Result<(), Stop> {
    ctx.wait_load(conn, (0, 0), ctx.secs(20)).await
}

/// A shell snippet that prints how many processes on this system have `marker` (read from stdin) in their
/// command line, not counting itself.
pub const COUNT_MARKED_PROCESSES: &str = r#"read -r m
n=0
for d in /proc/[0-9]*; do
  [ "$d" = "/proc/$$" ] && continue
  c=$(tr '\0' ' ' < "$d/cmdline" 2>/dev/null) || continue
  case "$c" in *"$m"*) n=$((n+1));; esac
done
echo "count=$n"
"#;

/// Runs `script` (a counting snippet such as [`COUNT_MARKED_PROCESSES`]) in `lang` as a new execution tagged `tag`
/// on `conn`, with `marker` on its stdin, and collects it to its end.
pub async fn run_marked(
    ctx: &Ctx,
    conn: &mut Conn,
    lang: &str,
    tag: &str,
    script: &str,
    marker: &str,
) -> Result<Exec, Stop> {
    let id = ctx.id(tag);
    let stdin = serde_json::json!({"stdin": format!("{marker}\n")});
    ctx.run(conn, &ctx.exec_with(&id, lang, script, stdin))
        .await
}

/// Runs [`COUNT_MARKED_PROCESSES`] in a new execution on `conn` until it reports 0 (polled) or the deadline.
pub async fn wait_no_marked_processes(
    ctx: &Ctx,
    conn: &mut Conn,
    marker: &str,
    within: Duration,
) -> Result<(), Stop> {
    let lang = ctx.shell()?;
    let start = std::time::Instant::now();
    loop {
        let e = run_marked(ctx, conn, lang, "scan", COUNT_MARKED_PROCESSES, marker).await?;
        let out = e.stdout_text();
        if e.terminal_status().as_deref() != Some("completed") {
            return Err(Stop::Harness(format!(
                "the process scan did not complete: {}",
                e.dump()
            )));
        }
        if out.trim() == "count=0" {
            return Ok(());
        }
        if start.elapsed() > within {
            return Err(Stop::Fail(format!(
                "a later execution still sees {} process(es) of the earlier one after {within:?}",
                out.trim().trim_start_matches("count=")
            )));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

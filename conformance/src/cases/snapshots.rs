//! S.*: snapshots and forks of agent sandboxes (`POST /sandboxes/<id>/snapshot`, `fromSnapshot`,
//! `POST /sandboxes/<id>/fork`, `/snapshots`, `docs/spec/agent-sandboxes.md`). A server without them (the snapshot
//! route of an existing sandbox answered 404, 405 or 422 `capability_unsupported`) skips them.

use serde_json::{json, Value};

use super::agents::{create, create_body, http, plugin_error, remove};
use super::common::{case, refused_invalid, C};
use super::volumes::status_from;
use crate::ctx::Ctx;
use crate::framework::{Case, CaseResult, Stop};
use crate::wire::short;
use crate::{check, fail, skip};

const STARTS: &str = "`POST /sandboxes/<id>/snapshot` answers 201 `{id, digest, bytes, files}`; a sandbox created with `fromSnapshot` finds the source's files; what it changes reaches neither the snapshot nor other sandboxes started from it; the snapshot is listed with the sandboxes using it and `DELETE /snapshots/<id>` is 409 while one exists, 204 after.";
const REFUSALS: &str = "Snapshot routes need the bearer token (401); an unknown sandbox, an unknown `fromSnapshot` and an unknown snapshot id get 404 with a PluginError body.";
const EXECUTIONS: &str = "With the `snapshots` extension announced, `execute.snapshot` starts the working directory from a snapshot: the program finds its files and may change them, the next execution from it finds them unchanged, an unknown snapshot gets `INVALID_REQUEST`, and once the result is in the snapshot can be deleted.";
const FORK: &str = "`POST /sandboxes/<id>/fork` with a creation body answers 201 `{snapshot, sandbox}`: the new sandbox has the source's files.";

/// The cases of this group, in id order.
pub static CASES: &[Case] = &[
    case!(
        "S.1.1",
        Must,
        "snapshots",
        "A snapshot starts sandboxes with its files; their changes stay apart",
        STARTS,
        starts
    ),
    case!(
        "S.1.2",
        Must,
        "snapshots",
        "Snapshot refusals: 401, 404 PluginError",
        REFUSALS,
        refusals
    ),
    case!(
        "S.1.3",
        Must,
        "snapshots",
        "A fork is a snapshot and a sandbox started from it",
        FORK,
        fork
    ),
    case!(
        "S.2.1",
        Must,
        "snapshots",
        "Executions start from a snapshot (execute.snapshot)",
        EXECUTIONS,
        executions
    ),
];

async fn call(ctx: &Ctx, method: &str, path: &str, body: &Value) -> Result<(u16, Value), Stop> {
    let bytes = if body.is_null() {
        Vec::new()
    } else {
        body.to_string().into_bytes()
    };
    http(ctx, method, path, &bytes, Some(&ctx.cfg.token)).await
}

/// Skips when the server has no snapshots (`GET /snapshots` answered 404, 405 or 422 `capability_unsupported`).
async fn supported(ctx: &Ctx) -> Result<(), Stop> {
    let (status, v) = call(ctx, "GET", "/snapshots", &Value::Null).await?;
    if status == 404 || status == 405 || (status == 422 && v["capability"] == "snapshots") {
        skip!("the server has no snapshots (GET /snapshots: HTTP {status})");
    }
    Ok(())
}

/// A sandbox that wrote `kept.txt` (`kept`).
async fn source(ctx: &Ctx, made: &mut Vec<String>) -> Result<String, Stop> {
    let id = create(ctx).await?;
    made.push(id.clone());
    let script = json!([{"write": {"path": "kept.txt", "content": "kept"}}, {"read": "kept.txt"}]);
    let m = status_from(ctx, &id, script, "read").await?;
    check!(
        m == "read kept",
        "the source could not write its file: {m:?}"
    );
    Ok(id)
}

/// A snapshot of sandbox `id`; skips when the server has no snapshots.
async fn take(ctx: &Ctx, id: &str) -> Result<Value, Stop> {
    let (status, s) = call(
        ctx,
        "POST",
        &format!("/sandboxes/{id}/snapshot"),
        &json!({}),
    )
    .await?;
    if status == 404 || status == 405 || (status == 422 && s["capability"] == "snapshots") {
        skip!("the server has no snapshots (POST /sandboxes/<id>/snapshot: HTTP {status})");
    }
    check!(
        status == 201
            && s["id"].as_str().is_some_and(|i| !i.is_empty())
            && s["digest"].as_str().is_some_and(|d| d.starts_with("sha256:"))
            && s["bytes"].as_u64().is_some_and(|b| b >= 4)
            && s["files"].as_u64().is_some_and(|f| f >= 1),
        "POST /sandboxes/{id}/snapshot: HTTP {status}, expected 201 with id, digest, bytes and files: {}",
        short(&s)
    );
    Ok(s)
}

/// A sandbox created from snapshot `snapshot`.
async fn from(ctx: &Ctx, snapshot: &str, made: &mut Vec<String>) -> Result<String, Stop> {
    let mut body = create_body();
    body["fromSnapshot"] = json!(snapshot);
    let (status, v) = call(ctx, "POST", "/sandboxes", &body).await?;
    match (status, v["id"].as_str()) {
        (201, Some(id)) => {
            made.push(id.to_owned());
            Ok(id.to_owned())
        }
        _ => fail!(
            "POST /sandboxes with fromSnapshot {snapshot}: HTTP {status}: {}",
            short(&v)
        ),
    }
}

/// Runs `f`, then removes the sandboxes it made and the snapshot it names (if any).
async fn cleaned<F, Fut>(ctx: &Ctx, f: F) -> CaseResult
where
    F: FnOnce(Vec<String>, Option<String>) -> Fut,
    Fut: std::future::Future<Output = (CaseResult, Vec<String>, Option<String>)>,
{
    let (r, made, snapshot) = f(Vec::new(), None).await;
    for id in made {
        remove(ctx, &id).await;
    }
    if let Some(s) = snapshot {
        let _ = call(ctx, "DELETE", &format!("/snapshots/{s}"), &Value::Null).await;
    }
    r
}

async fn starts(ctx: C) -> CaseResult {
    cleaned(&ctx, |mut made, mut snap| async {
        let r = starts_on(&ctx, &mut made, &mut snap).await;
        (r, made, snap)
    })
    .await
}

async fn starts_on(ctx: &Ctx, made: &mut Vec<String>, snap: &mut Option<String>) -> CaseResult {
    supported(ctx).await?;
    let a = source(ctx, made).await?;
    let s = take(ctx, &a).await?;
    let sid = s["id"].as_str().unwrap_or_default().to_owned();
    *snap = Some(sid.clone());
    let b = from(ctx, &sid, made).await?;
    let script =
        json!([{"write": {"path": "kept.txt", "content": "changed"}}, {"read": "kept.txt"}]);
    let m = status_from(ctx, &b, script, "read").await?;
    check!(
        m == "read changed",
        "a sandbox from the snapshot could not change its file: {m:?}"
    );
    let c = from(ctx, &sid, made).await?;
    let m = status_from(ctx, &c, json!([{"read": "kept.txt"}]), "read").await?;
    check!(
        m == "read kept",
        "a sandbox from the snapshot did not find the source's file, or another one's change reached it: {m:?}"
    );
    let (status, got) = call(ctx, "GET", &format!("/snapshots/{sid}"), &Value::Null).await?;
    let users = got["usedBy"].as_array().cloned().unwrap_or_default();
    check!(
        status == 200 && users.contains(&json!(b)) && users.contains(&json!(c)),
        "GET /snapshots/{sid}: HTTP {status}, expected usedBy with {b} and {c}: {}",
        short(&got)
    );
    let (status, list) = call(ctx, "GET", "/snapshots", &Value::Null).await?;
    check!(
        status == 200
            && list["snapshots"]
                .as_array()
                .is_some_and(|l| l.iter().any(|x| x["id"] == sid.as_str())),
        "GET /snapshots: HTTP {status}, {sid} not listed: {}",
        short(&list)
    );
    let (status, body) = call(ctx, "DELETE", &format!("/snapshots/{sid}"), &Value::Null).await?;
    plugin_error(
        "DELETE of a snapshot in use",
        status,
        409,
        &body,
        "invalid_state",
    )?;
    for id in made.drain(..) {
        remove(ctx, &id).await;
    }
    let (status, body) = call(ctx, "DELETE", &format!("/snapshots/{sid}"), &Value::Null).await?;
    check!(
        status == 204,
        "DELETE /snapshots/{sid} once unused: HTTP {status}: {}",
        short(&body)
    );
    *snap = None;
    let (status, body) = call(ctx, "GET", &format!("/snapshots/{sid}"), &Value::Null).await?;
    plugin_error(
        "GET of a deleted snapshot",
        status,
        404,
        &body,
        "invalid_state",
    )?;
    Ok(
        "started two sandboxes without either seeing the other's change; 409 in use, 204 after"
            .into(),
    )
}

async fn refusals(ctx: C) -> CaseResult {
    cleaned(&ctx, |mut made, mut snap| async {
        let r = refusals_on(&ctx, &mut made, &mut snap).await;
        (r, made, snap)
    })
    .await
}

async fn refusals_on(ctx: &Ctx, made: &mut Vec<String>, snap: &mut Option<String>) -> CaseResult {
    supported(ctx).await?;
    let a = create(ctx).await?;
    made.push(a.clone());
    let s = take(ctx, &a).await?;
    *snap = s["id"].as_str().map(str::to_owned);
    let (status, _) = http(ctx, "GET", "/snapshots", b"", None).await?;
    check!(
        status == 401,
        "GET /snapshots without a token: HTTP {status}, expected 401"
    );
    let path = format!("/sandboxes/{a}/snapshot");
    let (status, _) = http(ctx, "POST", &path, b"", None).await?;
    check!(
        status == 401,
        "POST {path} without a token: HTTP {status}, expected 401"
    );
    let (status, body) = call(
        ctx,
        "POST",
        "/sandboxes/ags-conformance-none/snapshot",
        &json!({}),
    )
    .await?;
    plugin_error(
        "a snapshot of an unknown sandbox",
        status,
        404,
        &body,
        "invalid_state",
    )?;
    let mut create = create_body();
    create["fromSnapshot"] = json!("snap-conformance-none");
    let (status, body) = call(ctx, "POST", "/sandboxes", &create).await?;
    if let Some(id) = body["id"].as_str() {
        made.push(id.to_owned());
    }
    plugin_error(
        "fromSnapshot of an unknown snapshot",
        status,
        404,
        &body,
        "invalid_state",
    )?;
    for method in ["GET", "DELETE"] {
        let (status, body) = call(
            ctx,
            method,
            "/snapshots/snap-conformance-none",
            &Value::Null,
        )
        .await?;
        plugin_error(
            &format!("{method} of an unknown snapshot"),
            status,
            404,
            &body,
            "invalid_state",
        )?;
    }
    Ok("401 without a token; 404 PluginError for unknown sandboxes and snapshots".into())
}

async fn fork(ctx: C) -> CaseResult {
    cleaned(&ctx, |mut made, mut snap| async {
        let r = fork_on(&ctx, &mut made, &mut snap).await;
        (r, made, snap)
    })
    .await
}

async fn fork_on(ctx: &Ctx, made: &mut Vec<String>, snap: &mut Option<String>) -> CaseResult {
    supported(ctx).await?;
    let a = source(ctx, made).await?;
    let (status, v) = call(ctx, "POST", &format!("/sandboxes/{a}/fork"), &create_body()).await?;
    if status == 404 || status == 405 || (status == 422 && v["capability"] == "snapshots") {
        skip!("the server has no forks (POST /sandboxes/<id>/fork: HTTP {status})");
    }
    if let Some(id) = v["sandbox"]["id"].as_str() {
        made.push(id.to_owned());
    }
    *snap = v["snapshot"]["id"].as_str().map(str::to_owned);
    let (Some(new), Some(_)) = (v["sandbox"]["id"].as_str(), snap.as_deref()) else {
        fail!(
            "POST /sandboxes/{a}/fork: HTTP {status}, expected 201 {{snapshot, sandbox}}: {}",
            short(&v)
        );
    };
    check!(
        status == 201,
        "POST /sandboxes/{a}/fork: HTTP {status}: {}",
        short(&v)
    );
    let m = status_from(ctx, new, json!([{"read": "kept.txt"}]), "read").await?;
    check!(
        m == "read kept",
        "the fork did not find the source's file: {m:?}"
    );
    Ok("the fork read the source's file".into())
}

async fn executions(ctx: C) -> CaseResult {
    if ctx.extension("snapshots") != Some(true) {
        skip!("the snapshots extension is not announced in pong.capabilities.extensions");
    }
    cleaned(&ctx, |mut made, mut snap| async {
        let r = executions_on(&ctx, &mut made, &mut snap).await;
        (r, made, snap)
    })
    .await
}

async fn executions_on(ctx: &Ctx, made: &mut Vec<String>, snap: &mut Option<String>) -> CaseResult {
    supported(ctx).await?;
    let sh = ctx.shell()?;
    let a = source(ctx, made).await?;
    let s = take(ctx, &a).await?;
    let sid = s["id"].as_str().unwrap_or_default().to_owned();
    *snap = Some(sid.clone());
    let mut c = ctx.connect().await?;
    let from = json!({"snapshot": sid});
    let code = "cat kept.txt; echo; echo changed > kept.txt && cat kept.txt";
    let id = ctx.id("snapx");
    let e = ctx
        .run(&mut c, &ctx.exec_with(&id, sh, code, from.clone()))
        .await?;
    check!(
        e.terminal_status().as_deref() == Some("completed") && e.stdout_text() == "kept\nchanged\n",
        "an execution from the snapshot did not find or could not change its file: {}",
        e.dump()
    );
    let id = ctx.id("snapy");
    let e = ctx
        .run(&mut c, &ctx.exec_with(&id, sh, "cat kept.txt", from))
        .await?;
    check!(
        e.stdout_text() == "kept",
        "the next execution from the snapshot did not find the file unchanged: {}",
        e.dump()
    );
    let id = ctx.id("snapz");
    let exec = ctx.exec_with(
        &id,
        sh,
        "true",
        json!({"snapshot": "snap-conformance-none"}),
    );
    refused_invalid(ctx, &mut c, &exec, &id, &["snapshot"]).await?;
    for id in made.drain(..) {
        remove(ctx, &id).await;
    }
    let (status, body) = call(ctx, "DELETE", &format!("/snapshots/{sid}"), &Value::Null).await?;
    check!(
        status == 204,
        "DELETE /snapshots/{sid} after the executions' results: HTTP {status}: {}",
        short(&body)
    );
    *snap = None;
    Ok("started from, changed apart, unknown snapshot refused, deleted after".into())
}

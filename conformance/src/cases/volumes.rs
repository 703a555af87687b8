//! V.*: volumes (`POST /volumes`, `docs/spec/agent-sandboxes.md`): filesystems that outlive the agent sandboxes
//! they are mounted into. A server without them (`POST /volumes` answered 404, 405 or 422
//! `capability_unsupported`) skips them; one that has them but cannot make one (503) fails.

use serde_json::{json, Value};

use super::agents::{create_body, http, plugin_error, remove, spawn, Events};
use super::common::{case, refused_invalid, C};
use crate::ctx::Ctx;
use crate::framework::{Case, CaseResult, Stop};
use crate::wire::short;
use crate::{check, fail, skip};

const LIFECYCLE: &str = "`POST /volumes {sizeMb}` answers 201 `{id, sizeBytes, usedBytes, createdAt, attachments}`; `GET /volumes/<id>` and `GET /volumes` show it; `DELETE` answers 204, then `GET` 404.";
const REFUSALS: &str = "Volume routes need the bearer token (401); an unknown id gets 404, a size out of bounds 400, each with a PluginError body.";
const EXECUTIONS: &str = "With the `volumes` extension announced, `execute.mounts: [{volume, path, read_only}]` mounts a volume under `/workspace`: a file one execution writes there the next reads, a `read_only` mount refuses writes, and an unknown volume gets `INVALID_REQUEST`.";
const OUTLIVES: &str = "A file written on a volume by one sandbox's agent is read by the next sandbox's; while a sandbox mounts it read-write a second writer gets 409 and `DELETE /volumes/<id>` 409.";

/// The cases of this group, in id order.
pub static CASES: &[Case] = &[
    case!(
        "V.1.1",
        Must,
        "volumes",
        "Volumes are created, shown, listed and deleted",
        LIFECYCLE,
        lifecycle
    ),
    case!(
        "V.1.2",
        Must,
        "volumes",
        "Volume refusals: 401, 404, 400 PluginError",
        REFUSALS,
        refusals
    ),
    case!(
        "V.2.1",
        Must,
        "volumes",
        "A volume outlives its writer; one writer at a time",
        OUTLIVES,
        outlives
    ),
    case!(
        "V.3.1",
        Must,
        "volumes",
        "Executions mount volumes (execute.mounts)",
        EXECUTIONS,
        executions
    ),
];

/// Creates a volume of `size_mb`; skips when the server has no volumes.
async fn create_volume(ctx: &Ctx, size_mb: u64) -> Result<Value, Stop> {
    let body = json!({"sizeMb": size_mb}).to_string();
    let (status, v) = http(
        ctx,
        "POST",
        "/volumes",
        body.as_bytes(),
        Some(&ctx.cfg.token),
    )
    .await?;
    if status == 404 || status == 405 || (status == 422 && v["capability"] == "volumes") {
        skip!("the server has no volumes (POST /volumes: HTTP {status})");
    }
    check!(
        status == 201,
        "POST /volumes: HTTP {status}, expected 201: {}",
        short(&v)
    );
    check!(
        v["id"].as_str().is_some_and(|i| !i.is_empty()),
        "POST /volumes: no id: {}",
        short(&v)
    );
    Ok(v)
}

/// `method /volumes/<id>` with the run's token: the status and the body.
async fn on_volume(ctx: &Ctx, method: &str, id: &str) -> Result<(u16, Value), Stop> {
    http(
        ctx,
        method,
        &format!("/volumes/{id}"),
        b"",
        Some(&ctx.cfg.token),
    )
    .await
}

async fn lifecycle(ctx: C) -> CaseResult {
    let v = create_volume(&ctx, 16).await?;
    let id = v["id"].as_str().unwrap_or_default().to_owned();
    let r = async {
        check!(
            v["sizeBytes"] == 16u64 << 20
                && v["usedBytes"].is_u64()
                && v["createdAt"].is_string()
                && v["attachments"] == json!([]),
            "POST /volumes: not a new 16 MiB volume: {}",
            short(&v)
        );
        let (status, got) = on_volume(&ctx, "GET", &id).await?;
        check!(
            status == 200 && got["id"] == id.as_str(),
            "GET /volumes/{id}: HTTP {status}: {}",
            short(&got)
        );
        let (status, list) = http(&ctx, "GET", "/volumes", b"", Some(&ctx.cfg.token)).await?;
        let listed = list["volumes"]
            .as_array()
            .is_some_and(|l| l.iter().any(|x| x["id"] == id.as_str()));
        check!(
            status == 200 && listed,
            "GET /volumes: HTTP {status}, {id} not listed: {}",
            short(&list)
        );
        Ok(())
    }
    .await;
    let (status, body) = on_volume(&ctx, "DELETE", &id).await?;
    r?;
    check!(
        status == 204,
        "DELETE /volumes/{id}: HTTP {status}: {}",
        short(&body)
    );
    let (status, body) = on_volume(&ctx, "GET", &id).await?;
    plugin_error("GET after DELETE", status, 404, &body, "invalid_state")?;
    Ok(format!("created, shown, listed and deleted {id}"))
}

async fn refusals(ctx: C) -> CaseResult {
    // Whether the server has volumes at all (skips when not); removed at once.
    let v = create_volume(&ctx, 8).await?;
    on_volume(&ctx, "DELETE", v["id"].as_str().unwrap_or_default()).await?;
    let (status, body) = http(&ctx, "GET", "/volumes", b"", None).await?;
    plugin_error(
        "GET /volumes without a token",
        status,
        401,
        &body,
        "invalid_state",
    )?;
    let (status, body) = http(
        &ctx,
        "POST",
        "/volumes",
        b"{\"sizeMb\": 8}",
        Some("wrong-token"),
    )
    .await?;
    plugin_error(
        "POST /volumes with a wrong token",
        status,
        401,
        &body,
        "invalid_state",
    )?;
    for method in ["GET", "DELETE"] {
        let (status, body) = on_volume(&ctx, method, "vol-conformance-none").await?;
        plugin_error(
            &format!("{method} of an unknown volume"),
            status,
            404,
            &body,
            "invalid_state",
        )?;
    }
    for size in [0u64, 1 << 40] {
        let req = json!({"sizeMb": size}).to_string();
        let (status, body) = http(
            &ctx,
            "POST",
            "/volumes",
            req.as_bytes(),
            Some(&ctx.cfg.token),
        )
        .await?;
        plugin_error(
            &format!("POST /volumes sizeMb {size}"),
            status,
            400,
            &body,
            "invalid_state",
        )?;
    }
    Ok("401, 404 and 400 with PluginError bodies".into())
}

/// A sandbox with the volume mounted read-write at `/workspace/data`: its id, or the refusal.
async fn sandbox_on(ctx: &Ctx, volume: &str) -> Result<Result<String, (u16, Value)>, Stop> {
    let mut body = create_body();
    body["workspaceRequirements"]["mounts"] =
        json!([{"volume": volume, "path": "/workspace/data"}]);
    let (status, v) = http(
        ctx,
        "POST",
        "/sandboxes",
        body.to_string().as_bytes(),
        Some(&ctx.cfg.token),
    )
    .await?;
    if status == 404 || status == 405 {
        skip!("the server has no agent sandboxes (POST /sandboxes: HTTP {status})");
    }
    match (status, v["id"].as_str()) {
        (201, Some(id)) => Ok(Ok(id.to_owned())),
        _ => Ok(Err((status, v))),
    }
}

/// Runs `script` in sandbox `id` and returns the first status message starting with `prefix`.
pub(super) async fn status_from(
    ctx: &Ctx,
    id: &str,
    script: Value,
    prefix: &str,
) -> Result<String, Stop> {
    let mut events = Events::open(ctx, id).await?;
    spawn(ctx, id, script).await?;
    for _ in 0..20 {
        let e = events.next(ctx, 1).await?.remove(0);
        if let Some(m) = e["event"]["message"]
            .as_str()
            .filter(|m| m.starts_with(prefix))
        {
            let m = m.to_owned();
            events.close().await;
            return Ok(m);
        }
    }
    events.close().await;
    fail!("no status {prefix:?} in the first 20 events")
}

/// Deletes volume `vid` once `r`, the verdict of what used it, is in; fails unless the deletion answers 204.
async fn deleted_after(ctx: &Ctx, vid: &str, r: CaseResult, after: &str) -> CaseResult {
    let (status, body) = on_volume(ctx, "DELETE", vid).await?;
    let said = r?;
    check!(
        status == 204,
        "DELETE /volumes/{vid} after {after}: HTTP {status}: {}",
        short(&body)
    );
    Ok(said)
}

async fn outlives(ctx: C) -> CaseResult {
    let v = create_volume(&ctx, 16).await?;
    let vid = v["id"].as_str().unwrap_or_default().to_owned();
    let mut made = Vec::new();
    let r = outlives_on(&ctx, &vid, &mut made).await;
    for id in made {
        remove(&ctx, &id).await;
    }
    deleted_after(&ctx, &vid, r, "its sandboxes").await
}

/// [`sandbox_on`], failing the case with `what` and the answer when the sandbox is refused.
async fn sandbox_made(ctx: &Ctx, volume: &str, what: &str) -> Result<String, Stop> {
    match sandbox_on(ctx, volume).await? {
        Ok(id) => Ok(id),
        Err((status, body)) => fail!("{what}: HTTP {status}: {}", short(&body)),
    }
}

async fn outlives_on(ctx: &Ctx, vid: &str, made: &mut Vec<String>) -> CaseResult {
    let first = sandbox_made(ctx, vid, "POST /sandboxes with the volume mounted").await?;
    made.push(first.clone());
    let script =
        json!([{"write": {"path": "data/kept.txt", "content": "kept"}}, {"read": "data/kept.txt"}]);
    let m = status_from(ctx, &first, script, "read").await?;
    check!(
        m == "read kept",
        "the writer could not write its volume: {m:?}"
    );
    match sandbox_on(ctx, vid).await? {
        Ok(id) => {
            made.push(id);
            fail!("a second sandbox mounted the volume read-write while the first one did")
        }
        Err((status, body)) => {
            plugin_error("a second writer", status, 409, &body, "invalid_state")?
        }
    }
    let (status, body) = on_volume(ctx, "DELETE", vid).await?;
    plugin_error(
        "DELETE of a mounted volume",
        status,
        409,
        &body,
        "invalid_state",
    )?;
    remove(ctx, &first).await;
    made.clear();
    let next = sandbox_made(ctx, vid, "POST /sandboxes after the writer's deletion").await?;
    made.push(next.clone());
    let m = status_from(ctx, &next, json!([{"read": "data/kept.txt"}]), "read").await?;
    check!(
        m == "read kept",
        "the next sandbox did not find the file: {m:?}"
    );
    Ok("the next sandbox read the file; second writer and deletion refused with 409".into())
}

async fn executions(ctx: C) -> CaseResult {
    if ctx.extension("volumes") != Some(true) {
        skip!("the volumes extension is not announced in pong.capabilities.extensions");
    }
    let sh = ctx.shell()?;
    let v = create_volume(&ctx, 16).await?;
    let vid = v["id"].as_str().unwrap_or_default().to_owned();
    let r = executions_on(&ctx, sh, &vid).await;
    deleted_after(&ctx, &vid, r, "the executions").await
}

async fn executions_on(ctx: &Ctx, sh: &str, vid: &str) -> CaseResult {
    let mut c = ctx.connect().await?;
    let mounts = |read_only: bool| json!({"mounts": [{"volume": vid, "path": "/workspace/vol", "read_only": read_only}]});
    let id = ctx.id("volw");
    let e = ctx
        .run(
            &mut c,
            &ctx.exec_with(&id, sh, "echo kept > vol/f && echo ok", mounts(false)),
        )
        .await?;
    check!(
        e.terminal_status().as_deref() == Some("completed") && e.stdout_text().trim() == "ok",
        "the writing execution did not write its volume: {}",
        e.dump()
    );
    let id = ctx.id("volr");
    let code = "cat vol/f; echo x > vol/g 2>/dev/null || echo refused";
    let e = ctx
        .run(&mut c, &ctx.exec_with(&id, sh, code, mounts(true)))
        .await?;
    check!(
        e.stdout_text() == "kept\nrefused\n",
        "the next execution did not read the file, or wrote a read-only volume: {}",
        e.dump()
    );
    let id = ctx.id("volx");
    let exec = ctx.exec_with(
        &id,
        sh,
        "true",
        json!({"mounts": [{"volume": "vol-conformance-none", "path": "/workspace/x"}]}),
    );
    refused_invalid(ctx, &mut c, &exec, &id, &["mounts"]).await?;
    Ok("written, read back read-only, unknown volume refused".into())
}

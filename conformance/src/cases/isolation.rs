//! I: isolation posture. The spec's `pong.capabilities.isolation` announces which layers a server applies; the
//! probe programs (see [`crate::probe`]) report what an execution really sees. A layer the server announces MUST
//! hold (MUST cases, skipped when the layer is not announced); practices every sandbox should follow whatever it
//! announces are SHOULD cases; what is only worth knowing is INFO.

use std::time::Instant;

use serde_json::{json, Value};

use super::common::{case, run_marked, C, COUNT_MARKED_PROCESSES};
use super::resources::COUNT_MARKED_FILES;
use crate::ctx::{Ctx, TIMEOUT_MS};
use crate::framework::{Case, CaseResult, Stop};
pub use crate::observed::Posture;
use crate::wire::short;
use crate::{check, fail, skip};

const ANNOUNCED: &str = "`pong.capabilities.isolation` (sandboxd addition): which layers are active: namespaces, cgroup version, seccomp, landlock ABI, user namespace, network. (An announced layer must really be in effect.)";
const POSTURE: &str =
    "Suite posture check (no spec keyword): executions of untrusted code run without privileges.";

/// The cases of this group, in id order.
#[rustfmt::skip]
pub static CASES: &[Case] = &[
    case!("I.summary.1", Info, "4 (pong)", "The isolation the server announces", ANNOUNCED, summary),
    case!("I.probe.1", Info, "-", "What the shell probe reports", POSTURE, shell_probe),
    case!("I.probe.2", Info, "-", "What the python probe reports", POSTURE, python_probe),
    case!("I.caps.1", Should, "-", "No capabilities in the effective, permitted or ambient sets", POSTURE, caps_empty),
    case!("I.caps.2", Should, "-", "An empty capability bounding set", POSTURE, bounding_empty),
    case!("I.nnp.1", Should, "-", "no_new_privs is set", POSTURE, no_new_privs),
    case!("I.seccomp.1", Must, "4 (pong)", "An announced seccomp filter is in effect", ANNOUNCED, seccomp_announced),
    case!("I.seccomp.2", Info, "4 (pong)", "The seccomp mode executions run under", ANNOUNCED, seccomp_mode),
    case!("I.landlock.1", Info, "4 (pong)", "The Landlock ABI announced and the kernel's", ANNOUNCED, landlock),
    case!("I.ns.1", Must, "4 (pong)", "Each announced namespace is fresh per execution", ANNOUNCED, fresh_namespaces),
    case!("I.ns.2", Must, "4 (pong)", "With a pid namespace, another execution's processes are invisible", ANNOUNCED, pid_invisible),
    case!("I.user.1", Must, "4 (pong)", "With a user namespace, root inside is not root outside", ANNOUNCED, user_namespace),
    case!("I.net.1", Must, "4 (pong)", "Restricted network: no connection to a public address", ANNOUNCED, no_public_network),
    case!("I.net.2", Must, "4 (pong)", "Restricted network: the FSP endpoint is unreachable from inside", ANNOUNCED, no_endpoint),
    case!("I.net.3", Must, "4 (pong)", "Restricted network with a net namespace: loopback only", ANNOUNCED, loopback_only),
    case!("I.fs.1", Must, "4 (pong)", "With a mount namespace, system paths are read-only", ANNOUNCED, system_read_only),
    case!("I.fs.2", Should, "3", "The working directory and TMPDIR are writable",
        "`disk_mb` (size of the writable scratch space); files placed in the working directory.", scratch_writable),
    case!("I.fs.3", Must, "4 (pong)", "With a mount namespace, another execution's files are invisible", ANNOUNCED, files_invisible_announced),
    case!("I.fs.4", Should, "1, 3", "Another execution's files are invisible",
        "Suite posture check: files placed in an execution's working directory are its own.", files_invisible),
];

fn announced_ns(ctx: &Ctx) -> Vec<String> {
    ctx.isolation()
        .and_then(|i| i["namespaces"].as_array())
        .map(|a| {
            a.iter()
                .filter_map(|s| s.as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default()
}

fn announces_ns(ctx: &Ctx, name: &str) -> bool {
    announced_ns(ctx)
        .iter()
        .any(|n| n == name || (name == "mount" && n == "mnt") || (name == "mnt" && n == "mount"))
}

fn restricted_network(ctx: &Ctx) -> Option<String> {
    let n = ctx.isolation()?["network"].as_str()?.to_owned();
    matches!(n.as_str(), "none" | "loopback-only" | "loopback").then_some(n)
}

fn probe_input(ctx: &Ctx, hold_ms: u64) -> String {
    let (host, port) = ctx.endpoint_host_port();
    json!({
        "host": host, "port": port, "hold_ms": hold_ms,
        "network": restricted_network(ctx).is_some(),
        "system_writes": announces_ns(ctx, "mount"),
    })
    .to_string()
}

fn parse_report(e: &crate::wire::Exec) -> Result<Value, String> {
    if e.terminal_status().as_deref() != Some("completed") {
        return Err(format!("the probe did not complete: {}", e.dump()));
    }
    let out = e.stdout_text();
    serde_json::from_str(out.lines().next().unwrap_or_default())
        .map_err(|err| format!("the probe printed no JSON ({err}): {}", e.dump()))
}

/// Runs the probes once per run: two of the main language at the same time, one of the other.
pub async fn posture(ctx: &Ctx) -> Result<Posture, Stop> {
    ctx.posture.get_or_init(|| run_posture(ctx)).await.clone()
}

async fn run_posture(ctx: &Ctx) -> Result<Posture, Stop> {
    let python = ctx.python().is_ok();
    let shell = ctx.shell().is_ok();
    let mut p = Posture::default();
    let mut c = ctx.connect().await?;
    let probe = |lang: &str| {
        if lang == "python" {
            crate::probe::PYTHON
        } else {
            crate::probe::SHELL
        }
    };
    let main = if python {
        "python"
    } else if shell {
        "shell"
    } else {
        return Err(Stop::Skip("neither python nor shell is announced".into()));
    };
    // Two probes at once, each holding 1.5 s after it reported, so that their namespaces exist at the same time.
    let ids = [ctx.id("probe-a"), ctx.id("probe-b")];
    let sent = Instant::now();
    let execs: Vec<Value> = ids
        .iter()
        .map(|id| {
            ctx.exec_with(
                id,
                main,
                probe(main),
                json!({"stdin": probe_input(ctx, 1500)}),
            )
        })
        .collect();
    c.send_all(&execs).await?;
    let a = c.collect(&ids[0], sent, ctx.end_within(TIMEOUT_MS)).await?;
    let b = c.collect(&ids[1], sent, ctx.end_within(TIMEOUT_MS)).await?;
    let report_a = parse_report(&a);
    let overlapped = match (
        a.msgs.iter().find(|m| m.status() == Some("running")),
        b.msgs.iter().find(|m| m.status() == Some("running")),
    ) {
        (Some(ra), Some(rb)) => {
            let end_a = a.msgs.last().map(|m| m.at).unwrap_or(sent);
            let end_b = b.msgs.last().map(|m| m.at).unwrap_or(sent);
            ra.at < end_b && rb.at < end_a
        }
        _ => false,
    };
    if let (Ok(x), Ok(y), true) = (&report_a, &parse_report(&b), overlapped) {
        p.pair = Some((x.clone(), y.clone()));
    }
    if main == "python" {
        p.python = Some(report_a);
    } else {
        p.shell = Some(report_a);
    }
    if main == "python" && shell {
        let id = ctx.id("probe-sh");
        let e = ctx
            .run(
                &mut c,
                &ctx.exec_with(
                    &id,
                    "shell",
                    crate::probe::SHELL,
                    json!({"stdin": probe_input(ctx, 0)}),
                ),
            )
            .await?;
        p.shell = Some(parse_report(&e));
    }
    c.close().await;
    Ok(p)
}

async fn summary(ctx: C) -> CaseResult {
    match ctx.isolation() {
        Some(i) => Ok(format!("announced: {i}")),
        None => Ok("the server announces no pong.capabilities.isolation".into()),
    }
}

async fn shell_probe(ctx: C) -> CaseResult {
    ctx.shell()?;
    match posture(&ctx).await?.shell {
        Some(Ok(v)) => Ok(v.to_string()),
        Some(Err(e)) => Err(Stop::Harness(e)),
        None => skip!("the shell probe did not run"),
    }
}

async fn python_probe(ctx: C) -> CaseResult {
    ctx.python()?;
    match posture(&ctx).await?.python {
        Some(Ok(v)) => Ok(v.to_string()),
        Some(Err(e)) => Err(Stop::Harness(e)),
        None => skip!("the python probe did not run"),
    }
}

fn hex_zero(v: &Value, field: &str) -> Result<bool, Stop> {
    let s = v[field]
        .as_str()
        .ok_or_else(|| Stop::Harness(format!("the probe did not report {field}: {}", short(v))))?;
    u64::from_str_radix(s.trim(), 16)
        .map(|n| n == 0)
        .map_err(|e| Stop::Harness(format!("{field} {s:?}: {e}")))
}

async fn caps_empty(ctx: C) -> CaseResult {
    let p = posture(&ctx).await?;
    let v = p.any()?;
    for f in ["CapEff", "CapPrm", "CapAmb"] {
        check!(
            hex_zero(v, f)?,
            "the execution holds capabilities: {f} {} (uid {})",
            v[f],
            v["uid"]
        );
    }
    Ok(String::new())
}

async fn bounding_empty(ctx: C) -> CaseResult {
    let p = posture(&ctx).await?;
    let v = p.any()?;
    check!(
        hex_zero(v, "CapBnd")?,
        "the capability bounding set is not empty: CapBnd {}",
        v["CapBnd"]
    );
    Ok(String::new())
}

async fn no_new_privs(ctx: C) -> CaseResult {
    let p = posture(&ctx).await?;
    let v = p.any()?;
    check!(v["NoNewPrivs"] == "1", "NoNewPrivs is {}", v["NoNewPrivs"]);
    Ok(String::new())
}

fn seccomp_announced_value(ctx: &Ctx) -> Option<bool> {
    ctx.isolation().and_then(|i| i["seccomp"].as_bool())
}

async fn seccomp_announced(ctx: C) -> CaseResult {
    match seccomp_announced_value(&ctx) {
        Some(true) => {}
        Some(false) => skip!("pong.capabilities.isolation.seccomp is false: no filter is announced, so none is checked (see I.seccomp.2)"),
        None => skip!("the server announces no isolation.seccomp"),
    }
    let p = posture(&ctx).await?;
    let v = p.any()?;
    check!(
        v["Seccomp"] == "2",
        "seccomp is announced but the execution's Seccomp mode is {} (2 = filter)",
        v["Seccomp"]
    );
    Ok(String::new())
}

async fn seccomp_mode(ctx: C) -> CaseResult {
    let p = posture(&ctx).await?;
    let v = p.any()?;
    let mode = match v["Seccomp"].as_str() {
        Some("0") => "0 (no filter)",
        Some("1") => "1 (strict)",
        Some("2") => "2 (filter)",
        _ => "unknown",
    };
    Ok(format!(
        "announced seccomp: {:?}; observed Seccomp mode {mode}",
        seccomp_announced_value(&ctx)
    ))
}

async fn landlock(ctx: C) -> CaseResult {
    let announced = ctx.isolation().map(|i| i["landlock_abi"].clone());
    let p = posture(&ctx).await?;
    let kernel = p
        .python
        .as_ref()
        .and_then(|r| r.as_ref().ok())
        .map(|v| v["landlock_kernel_abi"].clone());
    Ok(format!(
        "announced landlock_abi: {}; kernel Landlock ABI seen from inside: {} (enforcement itself cannot be observed from inside)",
        announced.map_or("not announced".into(), |v| v.to_string()),
        kernel.map_or("not probed (no python)".into(), |v| v.to_string())
    ))
}

async fn fresh_namespaces(ctx: C) -> CaseResult {
    let names = announced_ns(&ctx);
    if names.is_empty() {
        skip!("no namespaces are announced");
    }
    let p = posture(&ctx).await?;
    let Some((a, b)) = &p.pair else {
        skip!("two probes did not run at the same time (max_concurrent 1?), so namespaces cannot be compared");
    };
    let mut checked_ns = Vec::new();
    for n in &names {
        let key = if n == "mount" { "mnt" } else { n.as_str() };
        let (x, y) = (&a["ns"][key], &b["ns"][key]);
        if x.as_str().is_none_or(str::is_empty) {
            continue;
        }
        check!(
            x != y,
            "namespace {n} is announced but two concurrent executions share it ({x})"
        );
        checked_ns.push(n.clone());
    }
    check!(
        !checked_ns.is_empty(),
        "none of the announced namespaces {names:?} could be read from /proc/self/ns"
    );
    Ok(format!("fresh per execution: {checked_ns:?}"))
}

async fn pid_invisible(ctx: C) -> CaseResult {
    if !announces_ns(&ctx, "pid") {
        skip!("no pid namespace is announced");
    }
    let lang = ctx.shell()?;
    let marker = ctx.marker();
    let mut c = ctx.connect().await?;
    let a = ctx.id("pid-a");
    c.send_json(&ctx.exec(&a, lang, &format!("echo started; exec sleep 60.{marker}")))
        .await?;
    c.observe(ctx.secs(10), "the first output", |m| {
        m.is_for(&a) && m.kind() == "stdout"
    })
    .await?;
    let e = run_marked(&ctx, &mut c, lang, "pid-b", COUNT_MARKED_PROCESSES, &marker).await?;
    let _ = c.send_json(&crate::msgs::cancel(&a)).await;
    check!(
        e.stdout_text().trim() == "count=0",
        "an execution sees the process of a concurrent one ({}): {}",
        e.stdout_text().trim(),
        e.dump()
    );
    Ok(String::new())
}

async fn user_namespace(ctx: C) -> CaseResult {
    if ctx.isolation().and_then(|i| i["user_namespace"].as_bool()) != Some(true) {
        skip!("no user namespace is announced");
    }
    let p = posture(&ctx).await?;
    let v = p.any()?;
    let map = v["uid_map"].as_array().cloned().unwrap_or_default();
    if map.is_empty() {
        skip!("the probe could not read /proc/self/uid_map (python not available?)");
    }
    let nums: Vec<u64> = map
        .iter()
        .filter_map(|s| s.as_str().and_then(|s| s.parse().ok()))
        .collect();
    check!(nums.len() >= 3, "uid_map {map:?}");
    check!(
        !(nums[1] == 0 && nums[2] >= 4_294_967_295),
        "a user namespace is announced but uid_map is the identity: {map:?}"
    );
    if nums[0] == 0 {
        check!(nums[1] != 0, "root inside maps to root outside: {map:?}");
    }
    Ok(format!("uid_map {map:?}"))
}

async fn network_report(ctx: &C) -> Result<(String, Value), Stop> {
    let Some(net) = restricted_network(ctx) else {
        skip!(
            "the server announces unrestricted network ({:?})",
            ctx.isolation().map(|i| i["network"].clone())
        );
    };
    ctx.python()?;
    let p = posture(ctx).await?;
    match &p.python {
        Some(Ok(v)) => Ok((net, v.clone())),
        Some(Err(e)) => Err(Stop::Harness(e.clone())),
        None => skip!("the network probe needs python"),
    }
}

async fn no_public_network(ctx: C) -> CaseResult {
    let (net, v) = network_report(&ctx).await?;
    check!(
        v["reach_public"] != "connected",
        "network {net:?} is announced but an execution connected to 1.1.1.1:53"
    );
    Ok(format!("1.1.1.1:53: {}", v["reach_public"]))
}

async fn no_endpoint(ctx: C) -> CaseResult {
    let (net, v) = network_report(&ctx).await?;
    check!(
        v["reach_endpoint"] != "connected",
        "network {net:?} is announced but an execution reached the FSP endpoint {:?}",
        ctx.endpoint_host_port()
    );
    Ok(format!("endpoint: {}", v["reach_endpoint"]))
}

async fn loopback_only(ctx: C) -> CaseResult {
    let (net, v) = network_report(&ctx).await?;
    if !announces_ns(&ctx, "net") {
        skip!("no net namespace is announced");
    }
    let Some(ifs) = v["interfaces"].as_array() else {
        skip!("/proc/net/dev is not readable inside");
    };
    check!(
        ifs.iter().all(|i| i == "lo"),
        "network {net:?} is announced but the execution sees interfaces {ifs:?}"
    );
    Ok(format!("interfaces {}", Value::Array(ifs.clone())))
}

async fn system_read_only(ctx: C) -> CaseResult {
    if !announces_ns(&ctx, "mount") {
        skip!("no mount namespace is announced (system paths are not probed outside one)");
    }
    let p = posture(&ctx).await?;
    let v = match &p.python {
        Some(Ok(v)) => v.clone(),
        _ => skip!("the system path probe needs python"),
    };
    let writable: Vec<&str> = ["/", "/usr", "/etc", "/bin", "/usr/bin", "/var"]
        .into_iter()
        .filter(|p| v["writable"][*p] == true)
        .collect();
    check!(
        writable.is_empty(),
        "system paths are writable from inside: {writable:?}"
    );
    Ok(String::new())
}

async fn scratch_writable(ctx: C) -> CaseResult {
    let p = posture(&ctx).await?;
    let v = p.any()?;
    let w = v["writable"]
        .as_object()
        .ok_or_else(|| Stop::Harness(format!("no writable report: {}", short(v))))?;
    check!(
        w.get(".") == Some(&json!(true)),
        "the working directory is not writable: {}",
        short(&v["writable"])
    );
    let tmp = v["tmpdir"]
        .as_str()
        .filter(|t| !t.is_empty())
        .unwrap_or("/tmp");
    check!(
        w.get(tmp) == Some(&json!(true)),
        "TMPDIR ({tmp}) is not writable: {}",
        short(&v["writable"])
    );
    Ok(String::new())
}

async fn other_files_visible(ctx: &C) -> Result<String, Stop> {
    let lang = ctx.shell()?;
    let marker = ctx.marker();
    let mut c = ctx.connect().await?;
    let a = ctx.id("fs-a");
    let code = format!("echo secret > ./fsp-{marker}; echo secret > \"${{TMPDIR:-/tmp}}/fsp-{marker}\"; echo written; exec sleep 60");
    c.send_json(&ctx.exec(&a, lang, &code)).await?;
    c.observe(ctx.secs(10), "the first output", |m| {
        m.is_for(&a) && m.kind() == "stdout"
    })
    .await?;
    let b = ctx.id("fs-b");
    let e = ctx
        .run(
            &mut c,
            &ctx.exec_with(
                &b,
                lang,
                COUNT_MARKED_FILES,
                json!({"stdin": format!("{marker}\n")}),
            ),
        )
        .await?;
    let _ = c.send_json(&crate::msgs::cancel(&a)).await;
    if e.terminal_status().as_deref() != Some("completed") {
        return Err(Stop::Harness(format!(
            "the file search did not complete: {}",
            e.dump()
        )));
    }
    Ok(e.stdout_text().trim().to_owned())
}

async fn files_invisible_announced(ctx: C) -> CaseResult {
    if !announces_ns(&ctx, "mount") {
        skip!("no mount namespace is announced (I.fs.4 checks this without one)");
    }
    let seen = other_files_visible(&ctx).await?;
    check!(
        seen == "count=0",
        "an execution sees files of a concurrent one ({seen})"
    );
    Ok(String::new())
}

async fn files_invisible(ctx: C) -> CaseResult {
    let seen = other_files_visible(&ctx).await?;
    if seen != "count=0" {
        fail!("an execution sees files a concurrent one wrote in its working directory or TMPDIR ({seen})");
    }
    Ok(String::new())
}

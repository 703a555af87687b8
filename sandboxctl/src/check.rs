//! `ping` and `health`: check one daemon.

use std::process::ExitCode;
use std::time::{Duration, Instant};

use client::{ConnectOptions, Connection};
use tokio::io::AsyncWriteExt;

use crate::exit::{fail, Exit};
use crate::output::say;

pub(crate) async fn ping(options: ConnectOptions, json: bool) -> anyhow::Result<ExitCode> {
    let conn = match Connection::connect(options).await {
        Ok(c) => c,
        Err(e) => return Ok(fail(&e).await),
    };
    let start = Instant::now();
    let pong = match conn.ping(Duration::from_secs(5)).await {
        Ok(p) => p,
        Err(e) => return Ok(fail(&e).await),
    };
    let rtt = start.elapsed();
    conn.close();
    let mut out = tokio::io::stdout();
    if json {
        let line = serde_json::to_string(&pong)?;
        out.write_all(format!("{line}\n").as_bytes()).await?;
    } else {
        let mut text = format!(
            "load: {} active, {} queued\nround trip: {:.2} ms\n",
            pong.load.active_executions,
            pong.load.queue_depth,
            rtt.as_secs_f64() * 1000.0
        );
        if let Some(c) = &pong.capabilities {
            let join = |v: Vec<String>| v.join(", ");
            let limits = c
                .max_limits
                .entries()
                .iter()
                .map(|(k, v)| format!("{k}={v}"))
                .chain(c.max_limits.cpu_cores.map(|c| format!("cpu_cores={c}")))
                .collect::<Vec<_>>()
                .join(" ");
            let i = &c.isolation;
            text.push_str(&format!(
                "languages: {}\nmax limits: {limits}\nextensions: {}\nisolation: namespaces [{}], cgroup {}, \
                 seccomp {}, landlock {}, user namespace {}, network {}\n",
                join(c.languages.iter().map(|l| l.to_string()).collect()),
                join(c.extensions.clone()),
                join(i.namespaces.clone()),
                i.cgroup_version,
                if i.seccomp { "on" } else { "off" },
                i.landlock_abi
                    .map(|a| format!("ABI {a}"))
                    .unwrap_or_else(|| "off".to_owned()),
                if i.user_namespace { "on" } else { "off" },
                i.network,
            ));
        }
        out.write_all(text.as_bytes()).await?;
    }
    out.flush().await?;
    Ok(ExitCode::SUCCESS)
}

pub(crate) async fn health(url: &str) -> anyhow::Result<ExitCode> {
    match client::health(url, None, Duration::from_secs(5)).await {
        Ok(h) => {
            let body = serde_json::to_string_pretty(&h.body)?;
            let mut out = tokio::io::stdout();
            out.write_all(format!("{body}\n").as_bytes()).await?;
            out.flush().await?;
            if h.is_healthy() {
                Ok(ExitCode::SUCCESS)
            } else {
                say(format!("unhealthy (HTTP {})", h.status)).await;
                Ok(Exit::Unavailable.into())
            }
        }
        Err(e) => Ok(fail(&e).await),
    }
}

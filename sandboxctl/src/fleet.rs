//! `fleet status`: every node of a fleet checked once, one line (or JSON object) each.

use std::process::ExitCode;

use clap::Subcommand;
use client::{Fleet, NodeHealth};

use crate::exit::Exit;
use crate::output::{say, write_flush};

#[derive(Subcommand, Debug)]
pub(crate) enum FleetCommand {
    /// Checks every node once and prints address, health, version, load/capacity and last error (exit 0 when
    /// every node is healthy, 69 when one is not or there is none).
    Status {
        /// One JSON object per node, one per line.
        #[arg(long)]
        json: bool,
    },
}

/// `fleet status`: one line (or JSON object) per node.
pub(crate) async fn fleet_status(fleet: &Fleet, json: bool) -> anyhow::Result<ExitCode> {
    let nodes = fleet.status();
    let mut out = String::new();
    if !json {
        out.push_str("NODE\tHEALTH\tVERSION\tLOAD\tLAST ERROR\n");
    }
    for n in &nodes {
        let load = n.load.unwrap_or_default();
        if json {
            let line = serde_json::json!({
                "url": n.url,
                "health": format!("{:?}", n.health).to_lowercase(),
                "version": n.version,
                "active_executions": n.load.map(|l| l.active_executions),
                "queue_depth": n.load.map(|l| l.queue_depth),
                "capacity": n.capacity,
                "ejections": n.ejections,
                "last_error": n.last_error,
            });
            out.push_str(&format!("{line}\n"));
        } else {
            out.push_str(&format!(
                "{}\t{}\t{}\t{}+{}/{}\t{}\n",
                n.url,
                format!("{:?}", n.health).to_lowercase(),
                n.version.as_deref().unwrap_or("-"),
                load.active_executions,
                load.queue_depth,
                n.capacity.map_or("?".to_owned(), |c| c.to_string()),
                n.last_error.as_deref().unwrap_or("-"),
            ));
        }
    }
    let mut stdout = tokio::io::stdout();
    write_flush(&mut stdout, out.as_bytes()).await?;
    let healthy = !nodes.is_empty() && nodes.iter().all(|n| n.health == NodeHealth::Healthy);
    if nodes.is_empty() {
        say("the fleet has no node".to_owned()).await;
    }
    Ok(if healthy {
        ExitCode::SUCCESS
    } else {
        Exit::Unavailable.into()
    })
}

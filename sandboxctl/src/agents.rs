//! `sandbox`, `snapshot` and `volume`: agent sandboxes, their snapshots and volumes through the daemon's HTTP
//! gateway (JSON in, JSON out).

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::Context as _;
use clap::Subcommand;
use tokio::io::AsyncWriteExt;

use crate::connect::http_base;
use crate::exit::Exit;
use crate::output::say;

#[derive(Subcommand, Debug)]
pub(crate) enum SandboxCommand {
    /// POST /sandboxes with a CreateSandboxRequest (JSON file, `-` for stdin); prints the endpoints.
    Create {
        /// The request.
        #[arg(long)]
        request: PathBuf,
    },
    /// POST /sandboxes/ID/spawn with an AgentBrief (JSON file, `-` for stdin); prints the AgentHandle.
    Spawn {
        /// Sandbox id.
        id: String,
        /// The brief.
        #[arg(long)]
        brief: PathBuf,
    },
    /// WS /sandboxes/ID/events: prints AdapterEvents as JSON lines (reconnecting and replaying gaps).
    Events {
        /// Sandbox id.
        id: String,
        /// Start after this sequence.
        #[arg(long, default_value_t = 0)]
        after: u64,
        /// Stop after this many events.
        #[arg(long)]
        count: Option<u64>,
    },
    /// POST /sandboxes/ID/kill; prints the KillResponse.
    Kill {
        /// Sandbox id.
        id: String,
        /// Kill at once (no grace period).
        #[arg(long)]
        no_grace: bool,
        /// Grace period in milliseconds (default 10000).
        #[arg(long)]
        grace_timeout_ms: Option<u64>,
    },
    /// POST /sandboxes/ID/snapshot: keeps its /workspace (the agent frozen meanwhile); prints the snapshot.
    Snapshot {
        /// Sandbox id.
        id: String,
    },
    /// POST /sandboxes/ID/fork with a CreateSandboxRequest (JSON file, `-` for stdin): a snapshot and a new
    /// sandbox started from it; prints both.
    Fork {
        /// Sandbox id.
        id: String,
        /// The new sandbox's request.
        #[arg(long)]
        request: PathBuf,
    },
    /// DELETE /sandboxes/ID.
    Rm {
        /// Sandbox id.
        id: String,
    },
}

#[derive(Subcommand, Debug)]
pub(crate) enum SnapshotCommand {
    /// GET /snapshots; prints one snapshot per line.
    Ls,
    /// GET /snapshots/ID; prints the snapshot (and the sandboxes started from it).
    Show {
        /// Snapshot id.
        id: String,
    },
    /// DELETE /snapshots/ID (refused while a sandbox started from it exists).
    Rm {
        /// Snapshot id.
        id: String,
    },
}

#[derive(Subcommand, Debug)]
pub(crate) enum VolumeCommand {
    /// POST /volumes; prints the volume.
    Create {
        /// Size (the quota), MiB.
        #[arg(long)]
        size_mb: u64,
        /// A name for people.
        #[arg(long)]
        name: Option<String>,
    },
    /// GET /volumes; prints one volume per line.
    Ls,
    /// GET /volumes/ID; prints the volume (its mounts and last recovery scan).
    Show {
        /// Volume id.
        id: String,
    },
    /// DELETE /volumes/ID (refused while a sandbox mounts it).
    Rm {
        /// Volume id.
        id: String,
    },
}

fn read_json<T: serde::de::DeserializeOwned>(path: &Path) -> anyhow::Result<T> {
    let text = if path == Path::new("-") {
        std::io::read_to_string(std::io::stdin()).context("reading stdin")?
    } else {
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?
    };
    serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))
}

async fn print_json(v: &impl serde::Serialize) -> anyhow::Result<()> {
    let mut out = tokio::io::stdout();
    out.write_all(format!("{}\n", serde_json::to_string(v)?).as_bytes())
        .await?;
    out.flush().await?;
    Ok(())
}

pub(crate) async fn sandbox(
    url: &str,
    token: Option<String>,
    cmd: SandboxCommand,
) -> anyhow::Result<ExitCode> {
    use agent_api::{CreateSandboxResponse, KillRequest};
    use client::gateway::{Gateway, GatewayError};
    let base = http_base(url)?;
    let gw = Gateway::new(&base, token.as_deref().unwrap_or_default());
    let handle = |id: &str| {
        gw.sandbox(CreateSandboxResponse {
            id: id.to_owned(),
            rpc_endpoint: format!("{base}/sandboxes/{id}"),
            event_stream_endpoint: format!(
                "{}/sandboxes/{id}/events",
                base.replacen("http", "ws", 1)
            ),
            health_endpoint: format!("{base}/sandboxes/{id}/health"),
        })
    };
    let outcome: Result<(), GatewayError> = async {
        match cmd {
            SandboxCommand::Create { request } => {
                let req =
                    read_json(&request).map_err(|e| GatewayError::Events(format!("{e:#}")))?;
                let sb = gw.create(&req).await?;
                let _ = print_json(&sb.transport).await;
            }
            SandboxCommand::Spawn { id, brief } => {
                let brief =
                    read_json(&brief).map_err(|e| GatewayError::Events(format!("{e:#}")))?;
                let h = handle(&id).spawn(&brief).await?;
                let _ = print_json(&h).await;
            }
            SandboxCommand::Events { id, after, count } => {
                let mut events = handle(&id).events(after);
                let mut n = 0;
                while count.is_none_or(|c| n < c) {
                    let e = events.next().await?;
                    let _ = print_json(&e).await;
                    n += 1;
                }
            }
            SandboxCommand::Kill {
                id,
                no_grace,
                grace_timeout_ms,
            } => {
                let r = handle(&id)
                    .kill(&KillRequest {
                        grace: !no_grace,
                        grace_timeout_ms,
                    })
                    .await?;
                let _ = print_json(&r).await;
            }
            SandboxCommand::Snapshot { id } => {
                let _ = print_json(&gw.snapshot(&id).await?).await;
            }
            SandboxCommand::Fork { id, request } => {
                let req =
                    read_json(&request).map_err(|e| GatewayError::Events(format!("{e:#}")))?;
                let (snapshot, sb) = gw.fork(&id, &req).await?;
                let out = agent_api::ForkResponse {
                    snapshot,
                    sandbox: sb.transport,
                };
                let _ = print_json(&out).await;
            }
            SandboxCommand::Rm { id } => gw.delete(&id).await?,
        }
        Ok(())
    }
    .await;
    gateway_exit(outcome).await
}

pub(crate) async fn snapshot(
    url: &str,
    token: Option<String>,
    cmd: SnapshotCommand,
) -> anyhow::Result<ExitCode> {
    use client::gateway::{Gateway, GatewayError};
    let gw = Gateway::new(&http_base(url)?, token.as_deref().unwrap_or_default());
    let outcome: Result<(), GatewayError> = async {
        match cmd {
            SnapshotCommand::Ls => {
                for s in gw.snapshots().await? {
                    let _ = print_json(&s).await;
                }
            }
            SnapshotCommand::Show { id } => {
                let _ = print_json(&gw.snapshot_info(&id).await?).await;
            }
            SnapshotCommand::Rm { id } => gw.delete_snapshot(&id).await?,
        }
        Ok(())
    }
    .await;
    gateway_exit(outcome).await
}

pub(crate) async fn volume(
    url: &str,
    token: Option<String>,
    cmd: VolumeCommand,
) -> anyhow::Result<ExitCode> {
    use client::gateway::{Gateway, GatewayError};
    let gw = Gateway::new(&http_base(url)?, token.as_deref().unwrap_or_default());
    let outcome: Result<(), GatewayError> = async {
        match cmd {
            VolumeCommand::Create { size_mb, name } => {
                let req = agent_api::CreateVolumeRequest { size_mb, name };
                let _ = print_json(&gw.create_volume(&req).await?).await;
            }
            VolumeCommand::Ls => {
                for v in gw.volumes().await? {
                    let _ = print_json(&v).await;
                }
            }
            VolumeCommand::Show { id } => {
                let _ = print_json(&gw.volume(&id).await?).await;
            }
            VolumeCommand::Rm { id } => gw.delete_volume(&id).await?,
        }
        Ok(())
    }
    .await;
    gateway_exit(outcome).await
}

/// The exit code of a gateway call: 0, or the refusal said on stderr and its code.
async fn gateway_exit(
    outcome: Result<(), client::gateway::GatewayError>,
) -> anyhow::Result<ExitCode> {
    use client::gateway::GatewayError;
    match outcome {
        Ok(()) => Ok(Exit::Ok0.into()),
        Err(e) => {
            let code = match &e {
                GatewayError::Plugin { status: 401, .. } => Exit::Unauthorized,
                GatewayError::Malformed { .. } => Exit::Protocol,
                e if e.is_retryable() => Exit::Unavailable,
                _ => Exit::Refused,
            };
            say(e.to_string()).await;
            Ok(code.into())
        }
    }
}

//! `sandboxctl`: run code in sandboxd from a terminal, and check a daemon.
//!
//! ```text
//! sandboxctl exec --language python --code 'print(1)'     # or --file prog.py, or - (code on stdin)
//! sandboxctl exec -l python --tool 'ls=ls -1' --code 'ls().split()'  # a tool served by a local command
//! sandboxctl exec -l shell --allow pypi.org:443 --code 'pip download six'  # egress through the server's proxy
//! sandboxctl ping                                          # load and capabilities
//! sandboxctl health                                        # GET /healthz
//! sandboxctl --endpoints ws://a:7070/ws,ws://b:7070/ws exec -l shell --code 'hostname'  # placed on a fleet
//! sandboxctl --dns sandboxd.internal:7070 fleet status     # per node: address, version, load, health, error
//! sandboxctl --k8s-service sandboxd fleet status          # in a pod: the Service's EndpointSlices
//! ```
//!
//! The endpoint is `--url`, else `SANDBOXD_URL`, else the local daemon's `ws://127.0.0.1:7070/ws`. With
//! `--endpoints` (or `SANDBOXD_ENDPOINTS`, comma-separated) or `--dns NAME:PORT` (or `SANDBOXD_DNS`; `--dns-server`
//! names the nameserver) or `--k8s-service NAME` (or `SANDBOXD_K8S_SERVICE`: the ready addresses of the headless
//! Service's EndpointSlices, port `--k8s-port-name`, read with the pod's service account), `exec` runs on a fleet: placed on the less loaded of two sampled nodes, and on another
//! node when one refuses it before its `ack` (see `client::Fleet`). The token is
//! `--token`, else `SANDBOXD_TOKEN`, else the content of `--token-file` (default `/var/lib/sandboxd/token`) when
//! it is readable.
//!
//! `exec` streams the program's stdout and stderr as they come and exits with the program's exit code, or with
//! one of the codes of [`Exit`] (with a one-line reason on stderr). With `--allow` (extension `network`) it also
//! prints the egress proxy's counters on stderr after the program's output.

#![forbid(unsafe_code)]

mod agents;
mod check;
mod connect;
mod exec;
mod exit;
mod fleet;
mod output;

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::bail;
use clap::{Parser, Subcommand};
use client::DEFAULT_TOKEN_FILE;

use crate::agents::{sandbox, snapshot, volume, SandboxCommand, SnapshotCommand, VolumeCommand};
use crate::check::{health, ping};
use crate::connect::{build_fleet, connect_options, fleet_discovery, resolve_token, K8sArgs};
use crate::exec::{exec, ExecArgs, Target};
use crate::exit::{fail, Exit};
use crate::fleet::{fleet_status, FleetCommand};
use crate::output::say;

#[derive(Parser, Debug)]
#[command(
    name = "sandboxctl",
    version,
    about = "Run code in sandboxd and check a daemon"
)]
struct Cli {
    /// WebSocket endpoint of the daemon [default: ws://127.0.0.1:7070/ws].
    #[arg(long, global = true, env = "SANDBOXD_URL")]
    url: Option<String>,
    /// A fleet: the WebSocket endpoints of its daemons, comma-separated (`exec` and `fleet status`).
    #[arg(
        long,
        global = true,
        env = "SANDBOXD_ENDPOINTS",
        value_delimiter = ',',
        conflicts_with = "dns"
    )]
    endpoints: Vec<String>,
    /// A fleet discovered in DNS: NAME:PORT, one daemon per A/AAAA record of NAME (`exec` and `fleet status`).
    #[arg(long, global = true, env = "SANDBOXD_DNS")]
    dns: Option<String>,
    /// The nameserver for `--dns` (IP:PORT) [default: the system's].
    #[arg(long, global = true, requires = "dns")]
    dns_server: Option<std::net::SocketAddr>,
    #[command(flatten)]
    k8s: K8sArgs,
    /// Bearer token.
    #[arg(long, global = true, env = "SANDBOXD_TOKEN", hide_env_values = true)]
    token: Option<String>,
    /// File holding the token, read when no token is given and it is readable.
    #[arg(long, global = true, default_value = DEFAULT_TOKEN_FILE)]
    token_file: PathBuf,
    /// Log the client's connection events to stderr (-v: info, -vv: debug).
    #[arg(short, long, global = true, action = clap::ArgAction::Count)]
    verbose: u8,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Run a program; its stdout and stderr are streamed, and its exit code is ours.
    Exec(Box<ExecArgs>),
    /// Ask the daemon for its load and capabilities (FSP `ping`).
    Ping {
        /// Print the `pong` as JSON.
        #[arg(long)]
        json: bool,
    },
    /// GET /healthz of the daemon (exit 0 when healthy, 69 when not).
    Health,
    /// Agent sandboxes: create, spawn, events, kill, snapshot, fork, rm (JSON in, JSON out).
    #[command(subcommand)]
    Sandbox(SandboxCommand),
    /// Snapshots of agent sandboxes' workspaces: ls, show, rm (JSON out).
    #[command(subcommand)]
    Snapshot(SnapshotCommand),
    /// Volumes that outlive agent sandboxes: create, ls, show, rm (JSON out).
    #[command(subcommand)]
    Volume(VolumeCommand),
    /// A fleet of daemons (`--endpoints`, `--dns` or `--k8s-service`).
    #[command(subcommand)]
    Fleet(FleetCommand),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    init_logging(cli.verbose);
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("sandboxctl: cannot start the runtime: {e}");
            return Exit::Local.into();
        }
    };
    runtime.block_on(async {
        match run(cli).await {
            Ok(code) => code,
            Err(e) => {
                say(format!("{e:#}")).await;
                Exit::Local.into()
            }
        }
    })
}

fn init_logging(verbose: u8) {
    let level = match verbose {
        0 => "error",
        1 => "info",
        _ => "debug",
    };
    let filter = tracing_subscriber::EnvFilter::try_from_env("SANDBOXCTL_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(level));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
}

async fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    let options = connect_options(&cli).await;
    let (url, token) = (cli.url(), resolve_token(&cli).await);
    let fleet = fleet_discovery(&cli)?;
    match cli.command {
        Command::Exec(args) => match fleet {
            Some(discovery) => match build_fleet(discovery, token).await {
                Ok(fleet) => exec(Target::Fleet(fleet), *args).await,
                Err(e) => Ok(fail(&e).await),
            },
            None => exec(Target::One(options), *args).await,
        },
        Command::Fleet(FleetCommand::Status { json }) => {
            let Some(discovery) = fleet else {
                bail!("fleet status needs --endpoints, --dns or --k8s-service");
            };
            match build_fleet(discovery, token).await {
                Ok(fleet) => fleet_status(&fleet, json).await,
                Err(e) => Ok(fail(&e).await),
            }
        }
        Command::Ping { json } => ping(options, json).await,
        Command::Health => health(&cli.url()).await,
        Command::Sandbox(cmd) => sandbox(&url, token, cmd).await,
        Command::Volume(cmd) => volume(&url, token, cmd).await,
        Command::Snapshot(cmd) => snapshot(&url, token, cmd).await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cli_parses() {
        Cli::command_for_tests().debug_assert();
    }

    impl Cli {
        fn command_for_tests() -> clap::Command {
            <Cli as clap::CommandFactory>::command()
        }
    }
}

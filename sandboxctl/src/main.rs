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

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use base64::Engine as _;
use clap::{ArgGroup, Args, Parser, Subcommand};
use client::{
    new_execution_id, ClientError, ConnectOptions, Connection, ExecOptions, ExecStatus, Execute,
    ExecuteRequest, Language, Reason, RequestedLimits, ServerMessage, DEFAULT_TOKEN_FILE,
    DEFAULT_URL,
};
use client::{
    CommandTool, Discovery, DnsDiscovery, Fleet, KubernetesDiscovery, NetworkRequest, NetworkUsage,
    NodeHealth, Pool, ToolSpec, DEFAULT_K8S_PORT_NAME,
};
use protocol::{ArtifactsRequest, FileEncoding, FileSpec};
use tokio::io::{AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// The exit codes of `sandboxctl` besides the program's own (0-255 as the program exited, 128 + N when a signal N
/// killed it). A program may exit with any of these numbers itself; the one-line reason on stderr tells them
/// apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
enum Exit {
    /// Success.
    Ok0 = 0,
    /// A local problem: a file that cannot be read, a bad `--env` or `--file-in`, a bad URL, Kubernetes
    /// discovery refused or without a token.
    Local = 1,
    /// The sandbox refused the request (`INVALID_REQUEST`, `LANGUAGE_NOT_SUPPORTED`, ...): do not retry as is.
    Refused = 65,
    /// The sandbox is unavailable (cannot connect, connection lost, `SANDBOX_OVERLOADED`, `INTERNAL_ERROR`, no
    /// pong, unhealthy): retrying later may work.
    Unavailable = 69,
    /// The sandbox sent a malformed message or broke the protocol.
    Protocol = 76,
    /// The token was refused (HTTP 401).
    Unauthorized = 77,
    /// The program ran over `timeout_ms` (or the client deadline passed).
    Timeout = 124,
    /// The program was killed by the memory limit.
    Oom = 125,
    /// The program wrote more than `max_output_bytes`.
    OutputLimit = 126,
    /// Interrupted (Ctrl-C): the execution was cancelled (128 + SIGINT, as shells do).
    Interrupted = 130,
}

impl From<Exit> for ExitCode {
    fn from(e: Exit) -> Self {
        ExitCode::from(e as u8)
    }
}

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

/// Kubernetes discovery of a fleet.
#[derive(Args, Debug)]
struct K8sArgs {
    /// A fleet discovered in Kubernetes: the headless Service whose EndpointSlices' ready addresses are the
    /// daemons (`exec` and `fleet status`; read with the pod's service-account token).
    #[arg(
        long = "k8s-service",
        global = true,
        env = "SANDBOXD_K8S_SERVICE",
        conflicts_with = "dns"
    )]
    k8s_service: Option<String>,
    /// The Service's namespace [default: the pod's].
    #[arg(long = "k8s-namespace", global = true, requires = "k8s_service")]
    k8s_namespace: Option<String>,
    /// The name of the Service port serving FSP.
    #[arg(long = "k8s-port-name", global = true, default_value = DEFAULT_K8S_PORT_NAME)]
    k8s_port_name: String,
    /// The API server's URL [default: https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT].
    #[arg(long = "k8s-api", global = true, requires = "k8s_service")]
    k8s_api: Option<String>,
    /// The bearer token file [default: the service account's].
    #[arg(long = "k8s-token-file", global = true, requires = "k8s_service")]
    k8s_token_file: Option<PathBuf>,
    /// The API server's CA [default: the service account's].
    #[arg(long = "k8s-ca-file", global = true, requires = "k8s_service")]
    k8s_ca_file: Option<PathBuf>,
}

impl K8sArgs {
    /// The discovery these flags name, if `--k8s-service` is given.
    fn discovery(&self) -> Option<KubernetesDiscovery> {
        let service = self
            .k8s_service
            .as_deref()
            .map(str::trim)
            .filter(|s| !s.is_empty())?;
        let mut k8s = KubernetesDiscovery::new(service);
        k8s.namespace.clone_from(&self.k8s_namespace);
        k8s.port_name.clone_from(&self.k8s_port_name);
        k8s.api_url.clone_from(&self.k8s_api);
        if let Some(f) = &self.k8s_token_file {
            k8s.token_file.clone_from(f);
        }
        if let Some(f) = &self.k8s_ca_file {
            k8s.ca_file.clone_from(f);
        }
        Some(k8s)
    }
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

#[derive(Subcommand, Debug)]
enum FleetCommand {
    /// Checks every node once and prints address, health, version, load/capacity and last error (exit 0 when
    /// every node is healthy, 69 when one is not or there is none).
    Status {
        /// One JSON object per node, one per line.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Subcommand, Debug)]
enum SandboxCommand {
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
enum SnapshotCommand {
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
enum VolumeCommand {
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

#[derive(Args, Debug)]
#[command(group(ArgGroup::new("source").required(true).args(["code", "file", "dash"])))]
struct ExecArgs {
    /// Language: python, javascript, shell or elixir.
    #[arg(long, short)]
    language: Language,
    /// The program text.
    #[arg(long)]
    code: Option<String>,
    /// Read the program from this file.
    #[arg(long)]
    file: Option<PathBuf>,
    /// `-`: read the program from stdin.
    #[arg(value_name = "-", value_parser = clap::builder::PossibleValuesParser::new(["-"]))]
    dash: Option<String>,
    /// Wall-clock limit in milliseconds.
    #[arg(long, default_value_t = 30_000)]
    timeout_ms: u64,
    /// Memory limit in MiB.
    #[arg(long, default_value_t = 256)]
    memory_mb: u64,
    /// CPU weight (server default 512).
    #[arg(long)]
    cpu_shares: Option<u64>,
    /// Hard CPU limit in cores, e.g. 0.5 (server default: its maximum).
    #[arg(long, value_parser = parse_cores)]
    cpu_cores: Option<protocol::CpuCores>,
    /// stdout + stderr limit in bytes (server default 1 MiB).
    #[arg(long)]
    max_output_bytes: Option<u64>,
    /// Process limit (server default 64).
    #[arg(long)]
    pids_max: Option<u64>,
    /// Scratch space in MiB (server default 64).
    #[arg(long)]
    disk_mb: Option<u64>,
    /// File whose content is the program's stdin (`-`: our stdin; must be UTF-8).
    #[arg(long)]
    stdin: Option<PathBuf>,
    /// Environment variable for the program (repeatable).
    #[arg(long = "env", value_name = "K=V")]
    env: Vec<String>,
    /// Put local file LOCAL at PATH in the working directory (repeatable).
    #[arg(long = "file-in", value_name = "PATH=LOCAL")]
    files: Vec<String>,
    /// Collect files matching GLOB after the run (repeatable; the manifest is in the `--json` result).
    #[arg(long = "artifact", value_name = "GLOB")]
    artifacts: Vec<String>,
    /// Client deadline in milliseconds (default: timeout_ms + 10 s); when it passes, the run is cancelled.
    #[arg(long)]
    deadline_ms: Option<u64>,
    /// Print the protocol events as JSON lines instead of the program's output.
    #[arg(long)]
    json: bool,
    /// Offer the tool NAME to the code (python, javascript; repeatable): each call runs `sh -c COMMAND` here with
    /// the call's arguments as JSON on stdin, and its stdout (JSON, else text) is the result. The code's return
    /// value, if any, is printed as one JSON line on stdout after its output.
    #[arg(long = "tool", value_name = "NAME=COMMAND")]
    tools: Vec<String>,
    /// How long one tool call may take, in milliseconds (server default 30 s).
    #[arg(long)]
    tool_timeout_ms: Option<u64>,
    /// Let the program reach HOST (port PORT; without one, 443 and 80) through the server's egress proxy
    /// (extension `network`; repeatable; `*.example.com` covers subdomains). The server refuses entries its
    /// operator did not allow, and IP addresses.
    #[arg(long = "allow", value_name = "HOST[:PORT]")]
    allow: Vec<String>,
    /// Bytes the program may exchange with the outside, both directions together (server default and maximum).
    #[arg(long, value_name = "N", requires = "allow")]
    egress_bytes: Option<u64>,
    /// Mount volume VOLUME (`sandboxctl volume create`) at /workspace/PATH, read-only with `:ro` (extension
    /// `volumes`; repeatable).
    #[arg(long = "mount", value_name = "VOLUME=PATH[:ro]")]
    mounts: Vec<String>,
}

/// `--cpu-cores`: a number of cores the protocol accepts.
fn parse_cores(s: &str) -> Result<protocol::CpuCores, String> {
    let cores: f64 = s.parse().map_err(|e| format!("{e}"))?;
    protocol::CpuCores::try_from(cores)
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

impl Cli {
    /// The endpoint: flag, then environment (clap reads both; empty counts as unset), then the default.
    fn url(&self) -> String {
        self.url
            .as_deref()
            .map(str::trim)
            .filter(|u| !u.is_empty())
            .unwrap_or(DEFAULT_URL)
            .to_owned()
    }
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

/// The fleet named by `--endpoints`, `--dns` or `--k8s-service`, if any.
fn fleet_discovery(cli: &Cli) -> anyhow::Result<Option<Discovery>> {
    let endpoints: Vec<String> = cli
        .endpoints
        .iter()
        .map(|e| e.trim().to_owned())
        .filter(|e| !e.is_empty())
        .collect();
    if !endpoints.is_empty() {
        return Ok(Some(Discovery::Static(endpoints)));
    }
    match cli.dns.as_deref().map(str::trim).filter(|d| !d.is_empty()) {
        Some(spec) => {
            let mut dns = DnsDiscovery::parse(spec)?;
            dns.nameserver = cli.dns_server;
            Ok(Some(Discovery::Dns(dns)))
        }
        None => Ok(cli.k8s.discovery().map(Discovery::Kubernetes)),
    }
}

async fn build_fleet(discovery: Discovery, token: Option<String>) -> Result<Fleet, ClientError> {
    let pool = Pool::builder("").size(1);
    let pool = match token {
        Some(t) => pool.token(t),
        None => pool,
    };
    Fleet::builder(discovery).pool(pool).build().await
}

/// `fleet status`: one line (or JSON object) per node.
async fn fleet_status(fleet: &Fleet, json: bool) -> anyhow::Result<ExitCode> {
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

/// Where `exec` runs: one daemon, or a fleet.
enum Target {
    One(ConnectOptions),
    Fleet(Fleet),
}

/// The daemon's HTTP base (`http://host:port`) from its WebSocket endpoint.
fn http_base(ws_url: &str) -> anyhow::Result<String> {
    let healthz = client::healthz_url(ws_url)?;
    Ok(healthz.trim_end_matches("/healthz").to_owned())
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

async fn sandbox(
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

async fn snapshot(
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

async fn volume(url: &str, token: Option<String>, cmd: VolumeCommand) -> anyhow::Result<ExitCode> {
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

/// The token: flag, then environment, then the token file.
async fn resolve_token(cli: &Cli) -> Option<String> {
    let given = cli
        .token
        .as_deref()
        .map(str::trim)
        .filter(|t| !t.is_empty());
    match given {
        Some(t) => Some(t.to_owned()),
        None => tokio::fs::read_to_string(&cli.token_file)
            .await
            .ok()
            .map(|t| t.trim().to_owned())
            .filter(|t| !t.is_empty()),
    }
}

/// Endpoint and token: flags, then environment (clap reads both), then the local token file.
async fn connect_options(cli: &Cli) -> ConnectOptions {
    let options = ConnectOptions::new(cli.url());
    match resolve_token(cli).await {
        Some(t) => options.token(t),
        None => options,
    }
}

/// Writes one line to stderr (through tokio: no blocking write on the runtime).
async fn say(line: String) {
    let mut err = tokio::io::stderr();
    let _ = err
        .write_all(format!("sandboxctl: {line}\n").as_bytes())
        .await;
    let _ = err.flush().await;
}

/// Reports a client error on stderr and picks the exit code.
async fn fail(e: &ClientError) -> ExitCode {
    let code = match e {
        ClientError::Timeout { .. } => Exit::Timeout,
        ClientError::Unauthorized => Exit::Unauthorized,
        ClientError::Malformed { .. } | ClientError::Protocol { .. } => Exit::Protocol,
        ClientError::Config(_) => Exit::Local,
        ClientError::Kubernetes(k) if !k.is_retryable() => Exit::Local,
        e if e.is_retryable() => Exit::Unavailable,
        _ => Exit::Refused,
    };
    let hint = if e.is_retryable() { " (retryable)" } else { "" };
    say(format!("{e}{hint}")).await;
    code.into()
}

async fn ping(options: ConnectOptions, json: bool) -> anyhow::Result<ExitCode> {
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

async fn health(url: &str) -> anyhow::Result<ExitCode> {
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

/// Reads a whole file, `-` being stdin.
async fn read_input(path: &Path) -> anyhow::Result<Vec<u8>> {
    if path == Path::new("-") {
        let mut buf = Vec::new();
        tokio::io::stdin()
            .read_to_end(&mut buf)
            .await
            .context("cannot read stdin")?;
        Ok(buf)
    } else {
        tokio::fs::read(path)
            .await
            .with_context(|| format!("cannot read {}", path.display()))
    }
}

async fn build_request(args: &ExecArgs) -> anyhow::Result<ExecuteRequest> {
    let code = match (&args.code, &args.file) {
        (Some(code), _) => code.clone(),
        (None, Some(file)) => String::from_utf8(read_input(file).await?)
            .with_context(|| format!("{} is not UTF-8", file.display()))?,
        (None, None) => String::from_utf8(read_input(Path::new("-")).await?)
            .context("the program on stdin is not UTF-8")?,
    };
    let mut limits = RequestedLimits::new(args.timeout_ms, args.memory_mb);
    limits.cpu_shares = args.cpu_shares;
    limits.cpu_cores = args.cpu_cores;
    limits.max_output_bytes = args.max_output_bytes;
    limits.pids_max = args.pids_max;
    limits.disk_mb = args.disk_mb;
    let mut request = ExecuteRequest::new(new_execution_id(), args.language, code, limits);
    if let Some(path) = &args.stdin {
        if path == Path::new("-") && args.dash.is_some() {
            bail!("--stdin - and the program from stdin (-) cannot both read stdin");
        }
        request.stdin = Some(
            String::from_utf8(read_input(path).await?)
                .with_context(|| format!("--stdin {}: not UTF-8", path.display()))?,
        );
    }
    for kv in &args.env {
        let (k, v) = kv
            .split_once('=')
            .with_context(|| format!("--env {kv:?}: expected K=V"))?;
        request.env.insert(k.to_owned(), v.to_owned());
    }
    for spec in &args.mounts {
        let (volume, place) = spec
            .split_once('=')
            .with_context(|| format!("--mount {spec:?}: expected VOLUME=PATH[:ro]"))?;
        let (path, read_only) = match place.strip_suffix(":ro") {
            Some(path) => (path, true),
            None => (place, false),
        };
        request.mounts.push(protocol::MountRequest {
            volume: volume.to_owned(),
            path: format!("/workspace/{}", path.trim_start_matches('/')),
            read_only,
        });
    }
    for spec in &args.files {
        let (path, local) = spec
            .split_once('=')
            .with_context(|| format!("--file-in {spec:?}: expected PATH=LOCAL"))?;
        let bytes = read_input(Path::new(local)).await?;
        let (content, encoding) = match String::from_utf8(bytes) {
            Ok(text) => (text, FileEncoding::Utf8),
            Err(e) => (
                base64::engine::general_purpose::STANDARD.encode(e.as_bytes()),
                FileEncoding::Base64,
            ),
        };
        request.files.push(FileSpec {
            path: path.to_owned(),
            content,
            encoding,
        });
    }
    for spec in &args.tools {
        let tool = CommandTool::parse(spec).map_err(anyhow::Error::msg)?;
        request.tools.push(ToolSpec::new(tool.name));
    }
    request.tool_timeout_ms = args.tool_timeout_ms;
    if !args.allow.is_empty() {
        request.network = Some(NetworkRequest {
            allow: args.allow.clone(),
            egress_bytes: args.egress_bytes,
        });
    }
    if !args.artifacts.is_empty() {
        request.artifacts = Some(ArtifactsRequest {
            paths: args.artifacts.clone(),
            types: None,
        });
    }
    Ok(request)
}

async fn write_flush<W: AsyncWrite + Unpin>(w: &mut W, bytes: &[u8]) -> std::io::Result<()> {
    w.write_all(bytes).await?;
    w.flush().await
}

async fn exec(target: Target, args: ExecArgs) -> anyhow::Result<ExitCode> {
    let request = build_request(&args).await?;
    let timeout_ms = request.limits.timeout_ms;
    let conn = match &target {
        Target::One(options) => match Connection::connect(options.clone()).await {
            Ok(c) => Some(c),
            Err(e) => return Ok(fail(&e).await),
        },
        Target::Fleet(_) => None,
    };
    let exec_options = match args.deadline_ms {
        Some(ms) => ExecOptions::new().deadline(Duration::from_millis(ms)),
        None => ExecOptions::new(),
    };
    let tools: Vec<CommandTool> = args
        .tools
        .iter()
        .map(|t| CommandTool::parse(t))
        .collect::<Result<_, _>>()
        .map_err(anyhow::Error::msg)?;
    let mut calls = futures_util::stream::FuturesUnordered::<ToolRun>::new();
    let started = match (&conn, &target) {
        (_, Target::Fleet(fleet)) => fleet.execute_stream_with(request, exec_options).await,
        (Some(conn), Target::One(_)) => conn.execute_stream_with(request, exec_options).await,
        (None, Target::One(_)) => return Ok(Exit::Local.into()),
    };
    let mut execution = match started {
        Ok(e) => e,
        Err(e) => return Ok(fail(&e).await),
    };
    let mut stdout = tokio::io::stdout();
    let mut stderr = tokio::io::stderr();
    let mut interrupted = false;
    let mut ctrl_c = std::pin::pin!(tokio::signal::ctrl_c());
    let result = loop {
        let item = tokio::select! {
            item = execution.next() => item,
            Some((call_id, outcome)) = futures_util::StreamExt::next(&mut calls), if !calls.is_empty() => {
                if let Err(e) = execution.answer(&call_id, outcome).await {
                    return Ok(fail(&e).await);
                }
                continue;
            }
            _ = &mut ctrl_c, if !interrupted => {
                interrupted = true;
                say(format!("interrupted; cancelling {}", execution.id())).await;
                if let Err(e) = execution.cancel().await {
                    return Ok(fail(&e).await);
                }
                continue;
            }
        };
        let envelope = match item {
            None => {
                say("the execution ended without a result".to_owned()).await;
                return Ok(Exit::Protocol.into());
            }
            Some(Err(e)) => {
                if args.json {
                    write_server_error(&mut stdout, &e).await?;
                }
                return Ok(fail(&e).await);
            }
            Some(Ok(envelope)) => envelope,
        };
        if args.json {
            let line = protocol::encode_with_ts(&envelope.message, &envelope.ts);
            write_flush(&mut stdout, format!("{line}\n").as_bytes()).await?;
        }
        match envelope.message {
            ServerMessage::Stdout(chunk) if !args.json => {
                let bytes = chunk.decode().context("undecodable stdout chunk")?;
                write_flush(&mut stdout, &bytes).await?;
            }
            ServerMessage::Stderr(chunk) if !args.json => {
                let bytes = chunk.decode().context("undecodable stderr chunk")?;
                write_flush(&mut stderr, &bytes).await?;
            }
            ServerMessage::ToolCall(call) => calls.push(run_tool(&tools, call)),
            ServerMessage::Result(result) => break result,
            _ => {}
        }
    };
    if let (Some(value), false) = (&result.return_value, args.json) {
        write_flush(&mut stdout, format!("{value}\n").as_bytes()).await?;
    }
    if let (Some(usage), false) = (&result.network, args.json) {
        say(network_summary(usage)).await;
    }
    if let Some(conn) = conn {
        conn.close();
    }
    Ok(outcome(&result, timeout_ms).await)
}

/// A tool call being served by a local command: the call's id and its outcome.
type ToolRun = std::pin::Pin<Box<dyn std::future::Future<Output = (String, client::ToolOutcome)>>>;

/// Serves a `tool_call` with the local command of that name (`--tool`), or refuses it.
fn run_tool(tools: &[CommandTool], call: protocol::ToolCall) -> ToolRun {
    let tool = tools.iter().find(|t| t.name == call.name).cloned();
    Box::pin(async move {
        let outcome = match tool {
            Some(t) => {
                t.run(&call.args, call.timeout_ms.map(Duration::from_millis))
                    .await
            }
            None => Err(format!("sandboxctl has no tool {:?}", call.name)),
        };
        (call.call_id, outcome)
    })
}

/// With `--json`, the server's `error` that ended the execution, as a line like the other messages.
async fn write_server_error<W: AsyncWrite + Unpin>(
    out: &mut W,
    e: &ClientError,
) -> std::io::Result<()> {
    if let ClientError::Server { id, code, message } = e {
        let m = ServerMessage::Error(protocol::ErrorMessage::new(
            id.clone(),
            *code,
            message.clone(),
        ));
        write_flush(out, format!("{}\n", protocol::encode(&m)).as_bytes()).await?;
    }
    Ok(())
}

/// One line of the egress proxy's counters (`result.network`).
fn network_summary(n: &NetworkUsage) -> String {
    format!(
        "network: {} connections ({} upstream), {} refused, {} bytes sent, {} bytes received",
        n.connections, n.upstream_connections, n.refused, n.bytes_sent, n.bytes_received
    )
}

/// The exit code for a finished execution, with a one-line reason on stderr when it is not the program's own.
async fn outcome(result: &protocol::ResultMessage, timeout_ms: u64) -> ExitCode {
    let status = ExecStatus::terminal(result.reason, result.exit_code);
    match result.reason {
        Reason::Exited => ExitCode::from((result.exit_code.unwrap_or(0) & 0xff) as u8),
        Reason::Signaled => {
            let name = result.signal.as_deref().unwrap_or("an unknown signal");
            say(format!("the program was killed by {name}")).await;
            let n = result.signal.as_deref().map(signal_number).unwrap_or(0);
            ExitCode::from(128u8.saturating_add(n))
        }
        Reason::Timeout => {
            say(format!(
                "timeout: the program ran longer than {timeout_ms} ms (status {})",
                status.as_str()
            ))
            .await;
            Exit::Timeout.into()
        }
        Reason::Oom => {
            say(format!(
                "out of memory: killed by the memory limit (peak {} MiB)",
                result.resource_usage.peak_memory_mb
            ))
            .await;
            Exit::Oom.into()
        }
        Reason::OutputLimit => {
            say(format!(
                "output limit: killed after {} bytes of output",
                result.stdout_bytes + result.stderr_bytes
            ))
            .await;
            Exit::OutputLimit.into()
        }
        Reason::Cancelled => {
            say("cancelled".to_owned()).await;
            Exit::Interrupted.into()
        }
    }
}

/// The Linux number of a signal name like `SIGKILL` (0 if unknown).
fn signal_number(name: &str) -> u8 {
    const NAMES: [&str; 31] = [
        "SIGHUP",
        "SIGINT",
        "SIGQUIT",
        "SIGILL",
        "SIGTRAP",
        "SIGABRT",
        "SIGBUS",
        "SIGFPE",
        "SIGKILL",
        "SIGUSR1",
        "SIGSEGV",
        "SIGUSR2",
        "SIGPIPE",
        "SIGALRM",
        "SIGTERM",
        "SIGSTKFLT",
        "SIGCHLD",
        "SIGCONT",
        "SIGSTOP",
        "SIGTSTP",
        "SIGTTIN",
        "SIGTTOU",
        "SIGURG",
        "SIGXCPU",
        "SIGXFSZ",
        "SIGVTALRM",
        "SIGPROF",
        "SIGWINCH",
        "SIGIO",
        "SIGPWR",
        "SIGSYS",
    ];
    NAMES
        .iter()
        .position(|n| *n == name)
        .map(|i| i as u8 + 1)
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signal_numbers() {
        assert_eq!(signal_number("SIGKILL"), 9);
        assert_eq!(signal_number("SIGSEGV"), 11);
        assert_eq!(signal_number("SIGSYS"), 31);
        assert_eq!(signal_number("SIGNOPE"), 0);
    }

    #[test]
    fn cli_parses() {
        Cli::command_for_tests().debug_assert();
    }

    fn exec_args(extra: &[&str]) -> Result<ExecArgs, clap::Error> {
        let base = ["sandboxctl", "exec", "-l", "shell", "--code", "true"];
        let cli = <Cli as Parser>::try_parse_from(base.iter().chain(extra))?;
        match cli.command {
            Command::Exec(args) => Ok(*args),
            other => panic!("parsed as {other:?}"),
        }
    }

    fn request_of(args: &ExecArgs) -> ExecuteRequest {
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        rt.block_on(build_request(args)).unwrap()
    }

    #[test]
    fn allow_and_egress_bytes_become_the_network_request() {
        let args = exec_args(&[
            "--allow",
            "pypi.org:443",
            "--allow",
            "*.pythonhosted.org:443",
            "--egress-bytes",
            "1048576",
        ])
        .unwrap();
        assert_eq!(
            request_of(&args).network,
            Some(NetworkRequest {
                allow: vec!["pypi.org:443".into(), "*.pythonhosted.org:443".into()],
                egress_bytes: Some(1 << 20),
            })
        );
        let args = exec_args(&["--allow", "api.example.com"]).unwrap();
        assert_eq!(
            request_of(&args).network,
            Some(NetworkRequest::allow(["api.example.com"]))
        );
        // No --allow, no network; --egress-bytes needs --allow.
        assert_eq!(request_of(&exec_args(&[]).unwrap()).network, None);
        let err = exec_args(&["--egress-bytes", "5"]).unwrap_err();
        assert_eq!(err.kind(), clap::error::ErrorKind::MissingRequiredArgument);
    }

    #[test]
    fn mounts_become_the_request_s_mounts() {
        let args = exec_args(&["--mount", "vol-a=data", "--mount", "vol-b=ref/x:ro"]).unwrap();
        let req = request_of(&args);
        let got: Vec<(&str, &str, bool)> = req
            .mounts
            .iter()
            .map(|m| (m.volume.as_str(), m.path.as_str(), m.read_only))
            .collect();
        assert_eq!(
            got,
            [
                ("vol-a", "/workspace/data", false),
                ("vol-b", "/workspace/ref/x", true)
            ]
        );
    }

    #[test]
    fn network_counters_fit_one_line() {
        let line = network_summary(&NetworkUsage {
            connections: 4,
            upstream_connections: 3,
            refused: 1,
            bytes_sent: 900,
            bytes_received: 12_000,
        });
        assert_eq!(
            line,
            "network: 4 connections (3 upstream), 1 refused, 900 bytes sent, 12000 bytes received"
        );
    }

    impl Cli {
        fn command_for_tests() -> clap::Command {
            <Cli as clap::CommandFactory>::command()
        }
    }
}

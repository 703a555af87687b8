//! The command line: `sandboxd` (the daemon), and its subcommands. Start-up order matters: everything that forks (the
//! helper) happens while the process is still single-threaded, before the tokio runtime exists.

use std::future::IntoFuture;
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};
use clap::Parser;
use protocol::Isolation;
use runtime::cgroups::Cgroups;
use runtime::helper::{HelperClient, HelperConfig};
use runtime::rootfs::HostImage;
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::Layer;

use crate::config::Config;
use crate::exec::engine::Engine;

/// Process exit codes.
#[repr(u8)]
enum Exit {
    /// Clean shutdown.
    Ok = 0,
    /// The daemon failed while running.
    Runtime = 1,
    /// The configuration is invalid.
    Config = 2,
    /// The host cannot provide the required isolation.
    Host = 3,
}

#[derive(Parser, Debug)]
#[command(
    version,
    about = "Sandbox execution daemon speaking FSP/1 over WebSocket"
)]
struct Cli {
    /// YAML configuration file. Without it: defaults, 127.0.0.1:7070, a generated token.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Listen address, overriding the config file.
    #[arg(long)]
    listen: Option<std::net::SocketAddr>,
    /// State directory, overriding the config file.
    #[arg(long)]
    state_dir: Option<PathBuf>,
    /// Log format.
    #[arg(long, value_enum, default_value = "text")]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(clap::Subcommand, Debug)]
enum Command {
    /// Check that this host can provide every isolation layer, and how to fix what is missing.
    Doctor,
    /// Manage the OCI images executions can run on (stored under `<state_dir>/images/oci`).
    Images {
        #[command(subcommand)]
        command: crate::ops::images_cli::ImagesCommand,
    },
}

#[derive(Clone, Copy, Debug, clap::ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

/// Parses the command line and runs the daemon or the subcommand it names; the exit code says how it ended.
pub fn main() -> ExitCode {
    let cli = Cli::parse();
    let config = load_config(&cli);
    // Traces only for the daemon itself, not for its subcommands.
    let traces = match (&config, &cli.command) {
        (Ok(c), None) => crate::observe::telemetry::start(&c.telemetry),
        _ => Ok(None),
    };
    let traces = match traces {
        Ok(t) => t,
        Err(e) => {
            init_logging(cli.log_format, None);
            let e = anyhow::Error::new(e);
            error!("{e:#}");
            eprintln!("sandboxd: {e:#}");
            return ExitCode::from(Exit::Config as u8);
        }
    };
    init_logging(cli.log_format, traces);
    let config = match config {
        Ok(c) => c,
        Err(e) => {
            error!("{e:#}");
            eprintln!("sandboxd: {e:#}");
            return ExitCode::from(Exit::Config as u8);
        }
    };
    match &cli.command {
        Some(Command::Doctor) => {
            let ok = crate::ops::doctor::print(&crate::ops::doctor::run(&config));
            return ExitCode::from(if ok { Exit::Ok } else { Exit::Host } as u8);
        }
        Some(Command::Images { command }) => {
            return match crate::ops::images_cli::run(&config, command) {
                Ok(()) => ExitCode::from(Exit::Ok as u8),
                Err(e) => {
                    eprintln!("sandboxd: {e:#}");
                    ExitCode::from(Exit::Runtime as u8)
                }
            };
        }
        None => {}
    }
    match start(config, cli.config.is_some()) {
        Ok(code) => ExitCode::from(code as u8),
        Err(e) => {
            error!("{e:#}");
            eprintln!("sandboxd: {e:#}");
            ExitCode::from(Exit::Host as u8)
        }
    }
}

/// The log on stderr (text or JSON, filtered by `SANDBOXD_LOG`), and the trace export (spans at info and above,
/// whatever the log's filter) when `traces` is given.
fn init_logging(format: LogFormat, traces: Option<crate::observe::telemetry::OtelLayer>) {
    let filter = tracing_subscriber::EnvFilter::try_from_env("SANDBOXD_LOG").unwrap_or_else(|_| {
        // libcontainer warns that it has no libseccomp: sandboxd installs its own filter instead.
        tracing_subscriber::EnvFilter::new(
            "info,libcontainer=warn,libcgroups=error,libcontainer::process::init=error",
        )
    });
    // Log to a duplicate of stderr, not to fd 2: libcontainer logs from inside the container's init, where fd 2
    // is already the program's stderr pipe, and those lines belong in the daemon's log, not in the output.
    let log: &'static std::fs::File =
        match nix::fcntl::fcntl(2, nix::fcntl::FcntlArg::F_DUPFD_CLOEXEC(3)) {
            // SAFETY: F_DUPFD_CLOEXEC returned a new descriptor that nothing else owns.
            Ok(fd) => Box::leak(Box::new(unsafe {
                <std::fs::File as std::os::fd::FromRawFd>::from_raw_fd(fd)
            })),
            Err(e) => {
                eprintln!("sandboxd: cannot duplicate stderr for logging: {e}");
                std::process::exit(Exit::Runtime as i32)
            }
        };
    let fmt = tracing_subscriber::fmt::layer().with_writer(move || log);
    let fmt = match format {
        LogFormat::Text => fmt.with_ansi(false).with_filter(filter).boxed(),
        LogFormat::Json => fmt
            .json()
            .flatten_event(true)
            .with_current_span(true)
            .with_filter(filter)
            .boxed(),
    };
    // The log level does not silence the traces: their spans are the daemon's own, all at info.
    let traces = traces.map(|t| t.with_filter(tracing_subscriber::filter::LevelFilter::INFO));
    tracing_subscriber::registry().with(traces).with(fmt).init();
}

fn load_config(cli: &Cli) -> anyhow::Result<Config> {
    let mut config = match &cli.config {
        Some(path) => Config::load(path)?,
        None => Config::default(),
    };
    if let Some(listen) = cli.listen {
        config.listen = listen;
    }
    if let Some(dir) = &cli.state_dir {
        config.state_dir = dir.clone();
    }
    if let Ok(t) = std::env::var("SANDBOXD_TOKEN") {
        if t.len() < 16 {
            bail!("SANDBOXD_TOKEN must be at least 16 characters");
        }
        config.auth.tokens.push(t);
    }
    Ok(config)
}

/// With no config file, the daemon uses (or creates once, and prints once) `<state_dir>/token`.
fn ensure_token(config: &mut Config, explicit_config: bool) -> anyhow::Result<()> {
    if explicit_config {
        if config.auth.tokens.is_empty() {
            bail!("auth.tokens is empty and SANDBOXD_TOKEN is not set: refusing to run without authentication");
        }
        return Ok(());
    }
    let path = config.state_dir.join("token");
    if let Ok(existing) = std::fs::read_to_string(&path) {
        let t = existing.trim().to_owned();
        if t.len() >= 16 {
            info!(path = %path.display(), "using the token in the token file");
            config.auth.tokens.push(t);
            return Ok(());
        }
    }
    let token: String = (0..32)
        .map(|_| format!("{:02x}", rand::random::<u8>()))
        .collect();
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&path)
        .with_context(|| format!("cannot write {}", path.display()))?;
    f.write_all(format!("{token}\n").as_bytes())?;
    println!(
        "sandboxd: generated token {token} (saved to {})",
        path.display()
    );
    config.auth.tokens.push(token);
    Ok(())
}

/// The daemon keeps several descriptors per container (launch channel, status pipe, pidfd, its cgroup's limit
/// files) and two per connection: its soft `RLIMIT_NOFILE` is raised to the hard one, as the unit's
/// `LimitNOFILE` would, for a daemon started by hand under a 1024 soft limit. Executions get their own
/// (`limits.nofile`).
fn raise_nofile() {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    match getrlimit(Resource::RLIMIT_NOFILE) {
        Ok((soft, hard)) if soft < hard => {
            if let Err(e) = setrlimit(Resource::RLIMIT_NOFILE, hard, hard) {
                warn!(soft, hard, error = %e, "cannot raise the soft RLIMIT_NOFILE");
            }
        }
        Ok(_) => {}
        Err(e) => warn!(error = %e, "cannot read RLIMIT_NOFILE"),
    }
}

fn start(mut config: Config, explicit: bool) -> anyhow::Result<Exit> {
    // A start this build lacks is refused, never replaced by another one.
    config
        .sandbox
        .start
        .ensure_built()
        .context("sandbox.start")?;
    if !nix::unistd::geteuid().is_root() {
        bail!("sandboxd must run as root (it creates namespaces, cgroups and mounts)");
    }
    raise_nofile();
    std::fs::create_dir_all(&config.state_dir)
        .with_context(|| format!("cannot create state_dir {}", config.state_dir.display()))?;
    // Mounts under it are matched against /proc/self/mountinfo, which names them by their real path.
    config.state_dir = std::fs::canonicalize(&config.state_dir)
        .with_context(|| format!("state_dir {}", config.state_dir.display()))?;
    ensure_token(&mut config, explicit)?;
    let (cgroups, seccomp, landlock_abi) = isolation_layers(&config)?;
    let live = config.agents.live_restore;
    if live {
        crate::ops::live_restore::check_recorded_uids(
            &config.state_dir.join("agents"),
            config.agent_uids(),
        )?;
    }
    crate::ops::live_restore::enter_mount_namespace(&config.state_dir, live)?;
    let run_dir = config.state_dir.join("run");
    // With live restore, the cgroups of the runs a previous daemon left alive are theirs, not leftovers.
    let kept = match live {
        true => {
            let mut kept = agents::restore::kept_runs(&config.state_dir.join("agents"));
            kept.extend(e2b::sandboxes::kept_runs(&config.state_dir.join("e2b")));
            kept
        }
        false => Vec::new(),
    };
    remove_leftovers(&cgroups, &run_dir, &kept)?;
    runtime::rootfs::mount_run_dir(&run_dir)?;
    cgroups.ensure_parent()?;
    // From here on, every way out of `start` (an early error included) removes the parent, empty by then.
    let parent = ParentGuard(cgroups.clone());
    // With live restore the parent holds runs that outlive this daemon, whatever way it ends (an early error
    // included): it is removed only at a normal exit that leaves no sandbox.
    if live {
        std::mem::forget(parent);
    }
    let (state_dir, cgroups_at_exit) = (config.state_dir.clone(), cgroups.clone());

    let host = HostImage::prepare(&config.state_dir.join("images/host"), Path::new("/"))?;
    // The store lock (if any OCI image is used) is held for the daemon's lifetime: `images rm` waits for us.
    let (mut languages, _store_lock) =
        crate::exec::images::resolve(&config, host, landlock_abi, &run_dir).context("languages")?;
    crate::exec::warm::enable(&mut languages, config.pool.warm);
    let store = Arc::new(
        crate::storage::store::Store::open(
            &config.state_dir.join("artifacts"),
            Duration::from_secs(config.artifacts.retention_s),
            config.artifacts.max_store_bytes,
        )
        .context("cannot open the artifact store")?,
    );
    let seccomp_digest = seccomp.digest.clone();
    let helper_config = HelperConfig {
        state_root: run_dir.join("containers"),
        cgroups: cgroups.clone(),
        seccomp,
        start: config.sandbox.start,
    };
    let mut helpers = Vec::new();
    for _ in 0..config.helper_count() {
        let (pid, sock) = runtime::helper::spawn_helper(helper_config.clone())?;
        info!(pid = pid.as_raw(), "container helper started");
        helpers.push((pid, sock));
    }
    let helper_pids: Vec<_> = helpers.iter().map(|(p, _)| *p).collect();
    let prepared = Prepared {
        isolation: isolation_report(&cgroups, landlock_abi),
        config,
        cgroups,
        run_dir,
        languages,
        store,
        seccomp_digest,
        helpers,
    };

    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("sandboxd")
        .build()
        .context("cannot start the async runtime")?;
    crate::observe::telemetry::set_runtime(rt.handle().clone());
    let result = rt.block_on(prepared.run());
    // Batched spans go out while the runtime that sends them still runs.
    crate::observe::telemetry::flush();
    // The helper exits on Shutdown (or when our socket closes); wait so nothing outlives us.
    drop(rt);
    for pid in helper_pids {
        let _ = nix::sys::wait::waitpid(pid, None);
    }
    if live
        && agents::restore::recorded(&state_dir.join("agents")).is_empty()
        && e2b::sandboxes::recorded(&state_dir.join("e2b")).is_empty()
    {
        crate::ops::live_restore::unpin_if_unused(&state_dir);
        drop(ParentGuard(cgroups_at_exit));
    }
    let exit = result?;
    info!("stopped");
    Ok(exit)
}

/// Fails closed on every layer: a layer the host cannot provide stops the daemon here, not an execution later.
/// Returns the cgroup setup, the compiled seccomp profile and the landlock ABI to use.
fn isolation_layers(config: &Config) -> anyhow::Result<(Cgroups, runtime::seccomp::Profile, i32)> {
    runtime::caps::ensure_held(&runtime::caps::HELPER_NEEDS)?;
    let cgroups = Cgroups::detect(&config.sandbox.cgroup_root, &config.sandbox.cgroup_parent)?;
    cgroups.check_controllers()?;
    let (profile_text, arch) = runtime::seccomp::native_profile()?;
    let seccomp = runtime::seccomp::compile(profile_text, arch)?;
    let landlock_abi = runtime::sys::landlock_abi();
    if landlock_abi < config.sandbox.landlock_min_abi {
        bail!(crate::ops::doctor::landlock_refusal(
            landlock_abi,
            config.sandbox.landlock_min_abi
        ));
    }
    let landlock_abi = landlock_abi.min(runtime::landlock::MAX_ABI);
    info!(seccomp = %seccomp.digest, landlock_abi, "isolation layers ready");
    Ok((cgroups, seccomp, landlock_abi))
}

/// What a crashed instance left behind: cgroups under our parent, and per-execution state.
fn remove_leftovers(cgroups: &Cgroups, run_dir: &Path, kept: &[String]) -> anyhow::Result<()> {
    for r in cgroups.remove_leftovers_except(kept) {
        match r {
            Ok(r) => {
                crate::observe::metrics::get().leftover("cgroup");
                warn!(path = %r.path.display(), killed = r.killed, "removed a leftover cgroup")
            }
            Err(e) => bail!("cannot remove a leftover cgroup: {e}"),
        }
    }
    crate::observe::metrics::count_leftover_mounts(run_dir);
    remove_leftover_dir(run_dir)
}

/// The isolation every execution gets, as the protocol reports it.
fn isolation_report(cgroups: &Cgroups, landlock_abi: i32) -> Isolation {
    Isolation {
        namespaces: ["pid", "mount", "ipc", "uts", "net", "cgroup", "user"]
            .iter()
            .map(|s| s.to_string())
            .collect(),
        cgroup_version: cgroups.version().as_str().into(),
        seccomp: true,
        landlock_abi: Some(landlock_abi as u32),
        user_namespace: true,
        network: "loopback-only".into(),
    }
}

/// Everything `start` prepared while single-threaded, for the async part of the daemon.
struct Prepared {
    config: Config,
    cgroups: Cgroups,
    run_dir: PathBuf,
    languages: crate::exec::images::Languages,
    isolation: Isolation,
    store: Arc<crate::storage::store::Store>,
    seccomp_digest: String,
    /// The forked helpers: pid and the daemon's end of the socket.
    helpers: Vec<(nix::unistd::Pid, std::os::fd::OwnedFd)>,
}

impl Prepared {
    /// Builds the pool, the daemon's context and the engine, runs the self-test, serves until shutdown, then stops
    /// every container; how the daemon exits.
    async fn run(self) -> anyhow::Result<Exit> {
        let mut clients = self
            .helpers
            .into_iter()
            .map(|(pid, sock)| HelperClient::new(sock, pid))
            .collect::<Result<std::collections::VecDeque<_>, _>>()?;
        let first = clients
            .pop_front()
            .context("no container helper was started (pool.helpers)")?;
        let config = self.config;
        let factory = Arc::new(crate::exec::pool::Factory::new(
            containers::helper::Helpers::new(first, clients.into()),
            self.cgroups.clone(),
            self.run_dir.clone(),
            config.sandbox.nofile,
            config.limits.max,
            crate::exec::pool::Uids::new(config.sandbox.uid_base, config.uid_count() as u32),
        ));
        let pool = Arc::new(crate::exec::pool::Pool::new(
            factory,
            config.pool_size(),
            &self.languages,
        ));
        pool.start(&self.languages);
        let own_addresses = std::iter::once(config.listen).chain(config.metrics_listen);
        let egress = crate::extensions::egress::Egress::new(&config.network, own_addresses)
            .map_err(anyhow::Error::msg)
            .context("cannot set up the egress proxy (network)")?;
        let daemon = Arc::new(crate::daemon::Daemon::new(config, self.store.clone()));
        let engine = Arc::new(Engine::new(
            daemon.clone(),
            pool.clone(),
            self.languages,
            self.isolation,
            self.seccomp_digest,
            egress,
        ));
        spawn_artifact_gc(self.store);
        if let Err(e) = crate::ops::selftest::self_test(engine.clone()).await {
            stop_containers(&engine).await;
            let hint = untraversable_ancestor(&daemon.config().state_dir)
                .map(|d| {
                    format!(
                        " (hint: {} is not searchable by other users; the container's unprivileged uid must traverse state_dir: chmod o+x it or choose another state_dir)",
                        d.display()
                    )
                })
                .unwrap_or_default();
            bail!("{}{hint}", runtime::error::Chain(&e));
        }
        // Serve only once the self-test's containers are removed: a ready daemon has nothing but its pool.
        engine.pool().factory().removals_done().await;
        info!("self-test execution passed");
        let served = serve(engine.clone()).await;
        stop_containers(&engine).await;
        served
    }
}

/// The artifact store's collector: at start-up, then every ten minutes.
fn spawn_artifact_gc(store: Arc<crate::storage::store::Store>) {
    tokio::spawn(async move {
        loop {
            let s = store.clone();
            match tokio::task::spawn_blocking(move || s.gc(std::time::SystemTime::now())).await {
                Ok(Ok(r)) if r.blobs_removed + r.manifests_removed > 0 => {
                    info!(?r, "artifact GC")
                }
                Ok(Ok(_)) => {}
                Ok(Err(e)) => warn!(error = %e, "artifact GC failed"),
                Err(e) => warn!(error = %e, "artifact GC panicked"),
            }
            tokio::time::sleep(Duration::from_secs(600)).await;
        }
    });
}

/// Removes the daemon's cgroup parent when dropped: `start` holds one from the moment it creates the parent, so
/// no way out of it leaves the (then empty) parent behind.
struct ParentGuard(Cgroups);

impl Drop for ParentGuard {
    fn drop(&mut self) {
        if let Err(e) = self.0.remove_parent() {
            warn!(error = %e, "cgroup parent not removed");
        }
    }
}

/// The first ancestor of `dir` (or `dir` itself) that users other than root cannot traverse.
fn untraversable_ancestor(dir: &Path) -> Option<PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    dir.ancestors()
        .find(|d| std::fs::metadata(d).is_ok_and(|m| m.permissions().mode() & 0o001 == 0))
        .map(Path::to_path_buf)
}

fn remove_leftover_dir(dir: &Path) -> anyhow::Result<()> {
    if let Ok(entries) = std::fs::read_dir(dir) {
        for e in entries.flatten() {
            crate::observe::metrics::get().leftover("state");
            warn!(path = %e.path().display(), "removing leftover execution state");
        }
        std::fs::remove_dir_all(dir).with_context(|| format!("cannot remove {}", dir.display()))?;
    }
    Ok(())
}

/// Serves FSP/1 (and the agent routes, the E2B API and the metrics listener) until SIGTERM, SIGINT or a helper's
/// death, then drains: [`Exit::Runtime`] when the daemon stops without being asked to.
async fn serve(engine: Arc<Engine>) -> anyhow::Result<Exit> {
    let config = engine.daemon().config();
    let listener = tokio::net::TcpListener::bind(config.listen)
        .await
        .with_context(|| format!("cannot listen on {}", config.listen))?;
    let addr = listener.local_addr()?;
    info!(%addr, "listening");
    let agents =
        agents::Agents::new(crate::agent_host::host(&engine)?).context("agent sandboxes")?;
    for line in agents.restore().await {
        info!(sandbox = %line, "live restore");
    }
    if let Some(volumes) = agents.volumes() {
        engine.set_volumes(volumes.clone());
    }
    if let Ok(snapshots) = agents.snapshots() {
        engine.set_snapshots(snapshots.clone());
    }
    let connections = crate::fsp::listener::Connections::default();
    let state = crate::fsp::listener::AppState {
        engine: engine.clone(),
        tokens: Arc::new(config.auth.tokens.clone()),
        connections: connections.clone(),
        agents: agents.clone(),
    };
    let app =
        crate::fsp::listener::router(state).merge(crate::observe::metrics::router(engine.clone()));
    // Executions send several small frames in a row (ack, status, output): without TCP_NODELAY, Nagle's algorithm
    // and the client's delayed ACK hold them for 40 ms.
    let listener = axum::serve::ListenerExt::tap_io(listener, |tcp: &mut tokio::net::TcpStream| {
        if let Err(e) = tcp.set_nodelay(true) {
            warn!(error = %e, "cannot set TCP_NODELAY");
        }
    });
    // Before the main listener serves: the sandboxes taken back hold their uids before an agent sandbox could.
    let e2b = match config.e2b.listen {
        Some(addr) => Some(
            serve_e2b(&engine, &agents, addr)
                .await
                .with_context(|| format!("cannot serve E2B's API on e2b.listen {addr}"))?,
        ),
        None => None,
    };
    // One cancellation tree for the shutdown: `accepting` ends the FSP listener when the drain starts; `serving`,
    // its parent, cancelled last, ends what serves to the end (the metrics listener).
    let serving = CancellationToken::new();
    let accepting = serving.child_token();
    let server = tokio::spawn(
        axum::serve(listener, app)
            .with_graceful_shutdown(accepting.clone().cancelled_owned())
            .into_future(),
    );
    let metrics_server = match config.metrics_listen {
        Some(addr) => Some(
            crate::observe::metrics::serve_separately(
                engine.clone(),
                addr,
                serving.clone().cancelled_owned(),
            )
            .await
            .with_context(|| format!("cannot listen on metrics_listen {addr}"))?,
        ),
        None => None,
    };

    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    let mut int = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt())?;
    // Serving, and SIGTERM handled from here on.
    crate::ops::notify::spawn_watchdog(engine.clone());
    crate::ops::notify::ready(addr);
    // A daemon that stops without being asked to exits non-zero (a service manager restarts it).
    let helper_died = tokio::select! {
        _ = term.recv() => { info!("SIGTERM: draining"); false }
        _ = int.recv() => { info!("SIGINT: draining"); false }
        r = engine_dead(&engine) => { error!("{r}"); true }
    };
    crate::ops::notify::stopping();
    // Stop accepting connections and executions; let running ones finish within the grace period.
    accepting.cancel();
    match engine
        .drain(Duration::from_millis(config.shutdown_grace_ms))
        .await
    {
        crate::daemon::Drained::Finished => {}
        crate::daemon::Drained::Killed => {
            warn!("grace period over; running executions were killed")
        }
        crate::daemon::Drained::Stuck => error!(
            left = engine.daemon().executions(),
            "executions did not clean up within 30 s of being killed"
        ),
    }
    // The executions' last messages are written, then each connection is closed with 1001.
    info!("drained; closing the connections");
    if !connections.close().await {
        warn!(
            "connections still open {:?} after the drain; dropping them",
            crate::config::CONNECTIONS_CLOSE
        );
    }
    server.abort();
    if let Some((server, sandboxes)) = e2b {
        server.abort();
        sandboxes.shutdown().await;
    }
    agents.shutdown().await;
    serving.cancel();
    if let Some(m) = metrics_server {
        m.abort();
    }
    Ok(if helper_died { Exit::Runtime } else { Exit::Ok })
}

/// E2B's API on its own listener: its sandboxes are made through the agent sandboxes' containers (the same uids,
/// images and scratch spaces), its API key is one of the daemon's tokens.
async fn serve_e2b(
    engine: &Arc<Engine>,
    agents: &Arc<agents::Agents>,
    addr: std::net::SocketAddr,
) -> anyhow::Result<(tokio::task::JoinHandle<()>, Arc<e2b::sandboxes::Sandboxes>)> {
    let config = engine.daemon().config();
    let c = &config.e2b;
    let fleet = match &c.fleet {
        Some(f) => {
            let fleet = e2b::fleet::Fleet::new(f, config.agents.max_sandboxes as u64)
                .context("e2b.fleet")?;
            info!(node = %fleet.name(), tag = %fleet.tag(), "E2B fleet: this node");
            Some(fleet)
        }
        None => None,
    };
    let parent = config.state_dir.join("e2b");
    std::fs::create_dir_all(&parent)
        .with_context(|| format!("cannot create {}", parent.display()))?;
    let sandboxes = e2b::sandboxes::Sandboxes::new(
        agents.host().containers.clone(),
        agents.host().network.clone(),
        e2b::sandboxes::Settings {
            parent,
            base_image: c.base_image.clone(),
            code_interpreter_image: c
                .code_interpreter_image
                .clone()
                .unwrap_or_else(|| c.base_image.clone()),
            memory_mb: c.memory_mb,
            cpu_count: c.cpu_count,
            disk_mb: c.disk_mb,
            pids_max: c.pids_max,
            live_restore: config.agents.live_restore,
            id_suffix: fleet
                .as_ref()
                .map_or_else(String::new, |f| format!("-{}", f.tag())),
        },
    );
    for line in sandboxes.restore().await {
        info!(sandbox = %line, "live restore (E2B)");
    }
    let tokens = Arc::new(config.auth.tokens.clone());
    let app = e2b::router(e2b::Facade {
        engine: sandboxes.clone(),
        api_key: Arc::new(move |key: &str| crate::auth::accepted(key, &tokens)),
        max_upload_bytes: c.max_upload_mb << 20,
        fleet: fleet.clone(),
    });
    if let Some(fleet) = &fleet {
        fleet.spawn_refresh();
    }
    let listener = tokio::net::TcpListener::bind(addr).await?;
    info!(addr = %listener.local_addr()?, "E2B API listening");
    let listener = axum::serve::ListenerExt::tap_io(listener, |tcp: &mut tokio::net::TcpStream| {
        let _ = tcp.set_nodelay(true);
    });
    let server = tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            error!(error = %e, "the E2B listener failed");
        }
    });
    Ok((server, sandboxes))
}

/// Removes the pool and waits (bounded) for every container's removal, then stops the helpers.
async fn stop_containers(engine: &Engine) {
    engine.pool().close().await;
    let factory = engine.pool().factory();
    // Every container is removed through the factory, which counts the removals under way; a dead helper ends
    // its removals at once (they fail and are logged).
    let removed = tokio::time::timeout(Duration::from_secs(10), factory.removals_done()).await;
    if removed.is_err() {
        warn!("containers still being removed after 10 s; the helpers remove the rest");
    }
    let taken = engine
        .daemon()
        .config()
        .uid_count()
        .saturating_sub(factory.uids.available());
    if taken > 0 {
        warn!(
            taken,
            "host uids of executions still taken at shutdown; the helpers remove their containers"
        );
    }
    factory.shutdown().await;
}

async fn engine_dead(engine: &Engine) -> &'static str {
    engine.pool().factory().gone().await;
    "the container helper died; shutting down"
}

#[cfg(test)]
mod tests {
    #[test]
    fn exit_codes_are_distinct() {
        use super::Exit;
        let codes = [
            Exit::Ok as u8,
            Exit::Runtime as u8,
            Exit::Config as u8,
            Exit::Host as u8,
        ];
        let mut sorted = codes.to_vec();
        sorted.dedup();
        assert_eq!(sorted.len(), codes.len());
    }
}

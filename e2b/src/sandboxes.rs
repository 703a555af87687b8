//! The engine on the agents' container seam: an E2B sandbox is a workspace ([`Containers::create_workspace`], the
//! same scratch space, image, uid and limits an agent sandbox gets) with one long-lived run whose init serves
//! process launches ([`RunContainer::serve`]). Each process gets pipes for its output, pumped to its readers as it
//! is written; it outlives its readers; a sandbox is killed at its end time.

use std::collections::{BTreeMap, HashMap};
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, SystemTime};

use agents::host::{Containers, Network, WorkspaceError, WorkspaceRequest};
use agents::network::{SandboxEgress, Serving};
use bytes::Bytes;
use containers::agent::{InitIdentity, RunContainer, RunPlan, Workspace};
use nix::sys::signal::Signal;
use runtime::error::Chain;
use runtime::init::ProgramExit;
use runtime::launch::Launch;
use runtime::processes::{ProcessError, Processes};
use tokio::io::AsyncReadExt;
use tokio::sync::mpsc;
use tracing::{info, warn};

use crate::engine::{
    Attached, BoxFuture, CreateSpec, Engine, EngineError, LiveSandbox, ProcessEnd, ProcessEvent,
    ProcessInfo, ProcessSpec, SandboxInfo, SandboxState, HOME,
};
use crate::lock;

/// Events a reader may have queued before the pump waits for it (each up to [`CHUNK`] bytes).
const READER_QUEUE: usize = 64;
/// The largest read of a process's output.
const CHUNK: usize = 32 << 10;
/// How long output written after a process's exit (by what it left running) is still read before its end is
/// reported.
const AFTER_EXIT: Duration = Duration::from_millis(50);
/// How often expired sandboxes are looked for.
const EXPIRY_TICK: Duration = Duration::from_millis(250);

/// What every E2B sandbox of this host gets.
#[derive(Debug, Clone)]
pub struct Settings {
    /// Where the sandboxes' scratch spaces go.
    pub parent: PathBuf,
    /// The image of template `base`.
    pub base_image: String,
    /// The image of template `code-interpreter-v1`.
    pub code_interpreter_image: String,
    /// Memory limit, MiB.
    pub memory_mb: u64,
    /// CPU cores (reported; the cgroup's share).
    pub cpu_count: u32,
    /// Disk limit, MiB.
    pub disk_mb: u64,
    /// Processes and threads.
    pub pids_max: u64,
    /// Sandboxes outlive the daemon (`agents.live_restore`): their containers are kept, each with a record in
    /// `parent` ([`Record`]), and the next daemon takes them back ([`Sandboxes::restore`]).
    pub live_restore: bool,
    /// What every sandbox id ends in: `-<tag>` of this node on a fleet ([`crate::fleet`]), empty otherwise.
    pub id_suffix: String,
}

/// What is kept of a sandbox for the next daemon (live restore), in `<parent>/<id>.json`.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
struct Record {
    id: String,
    template: String,
    image: String,
    metadata: BTreeMap<String, String>,
    env: BTreeMap<String, String>,
    started_ms: u64,
    end_ms: u64,
    paused: bool,
    access_token: String,
    cpu_count: u32,
    memory_mb: u64,
    disk_mb: u64,
    host_id: u32,
    init: InitIdentity,
    allow_out: Vec<String>,
}

/// What is kept of a running process for the next daemon, in `<parent>/<id>.procs/<pid>.json`: what `List` shows.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
struct ProcRecord {
    cmd: String,
    args: Vec<String>,
    envs: BTreeMap<String, String>,
    cwd: Option<String>,
    stdin: bool,
    tag: Option<String>,
}

impl From<&ProcessSpec> for ProcRecord {
    fn from(s: &ProcessSpec) -> Self {
        Self {
            cmd: s.cmd.clone(),
            args: s.args.clone(),
            envs: s.envs.clone(),
            cwd: s.cwd.clone(),
            stdin: s.stdin,
            tag: s.tag.clone(),
        }
    }
}

impl From<ProcRecord> for ProcessSpec {
    fn from(r: ProcRecord) -> Self {
        Self {
            cmd: r.cmd,
            args: r.args,
            envs: r.envs,
            cwd: r.cwd,
            stdin: r.stdin,
            tag: r.tag,
        }
    }
}

fn millis(t: SystemTime) -> u64 {
    t.duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

fn from_millis(ms: u64) -> SystemTime {
    std::time::UNIX_EPOCH + Duration::from_millis(ms)
}

/// The records a previous daemon kept for its E2B sandboxes in `parent`.
fn records(parent: &Path) -> Vec<Record> {
    let Ok(entries) = std::fs::read_dir(parent) else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter(|e| e.path().extension().is_some_and(|x| x == "json"))
        .filter_map(|e| std::fs::read(e.path()).ok())
        .filter_map(|b| serde_json::from_slice::<Record>(&b).ok())
        .collect()
}

/// The ids of the E2B sandboxes a previous daemon kept in `parent` (live restore): their directories' mounts are
/// carried over to the next daemon's mount namespace.
pub fn recorded(parent: &Path) -> Vec<String> {
    records(parent).into_iter().map(|r| r.id).collect()
}

/// The containers a previous daemon kept for its E2B sandboxes in `parent` whose inits still run: their cgroups
/// are theirs, not leftovers, at the next daemon's start.
pub fn kept_runs(parent: &Path) -> Vec<String> {
    records(parent)
        .into_iter()
        .filter(|r| runtime::sys::start_time(r.init.pid) == Some(r.init.start))
        .map(|r| r.id)
        .collect()
}

/// Writes `bytes` to `path` whole: written aside, then renamed over.
fn write_whole(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let aside = path.with_extension("json.new");
    std::fs::write(&aside, bytes)?;
    std::fs::rename(&aside, path)
}

/// The E2B sandboxes of this host.
pub struct Sandboxes {
    containers: Arc<dyn Containers>,
    /// The host's egress settings (`None`: the `network` extension is off, and no sandbox reaches out).
    network: Option<Arc<dyn Network>>,
    settings: Settings,
    map: Mutex<BTreeMap<String, Arc<Live>>>,
    seq: AtomicU64,
}

impl Sandboxes {
    /// The engine, with its expiry task (ends when the engine is dropped).
    pub fn new(
        containers: Arc<dyn Containers>,
        network: Option<Arc<dyn Network>>,
        settings: Settings,
    ) -> Arc<Self> {
        let engine = Arc::new(Self {
            containers,
            network,
            settings,
            map: Mutex::new(BTreeMap::new()),
            seq: AtomicU64::new(0),
        });
        tokio::spawn(expire(Arc::downgrade(&engine)));
        engine
    }

    /// The daemon's exit: with live restore every sandbox is left as it is for the next daemon (its container,
    /// its channel, its files); without, each is killed.
    pub async fn shutdown(&self) {
        if self.settings.live_restore {
            for live in std::mem::take(&mut *lock(&self.map)).into_values() {
                live.processes.leave();
                live.workspace.leave();
            }
            return;
        }
        let ids: Vec<String> = lock(&self.map).keys().cloned().collect();
        for id in ids {
            self.kill(&id).await;
        }
    }

    /// Takes back the sandboxes a previous daemon left (live restore); one line per sandbox, saying what became of
    /// it. A sandbox that cannot be taken back is ended and its record removed.
    pub async fn restore(&self) -> Vec<String> {
        let mut lines = Vec::new();
        let Ok(entries) = std::fs::read_dir(&self.settings.parent) else {
            return lines;
        };
        let mut records: Vec<PathBuf> = entries
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.extension().is_some_and(|e| e == "json"))
            .collect();
        records.sort();
        for path in records {
            let record = std::fs::read(&path)
                .map_err(|e| e.to_string())
                .and_then(|b| serde_json::from_slice::<Record>(&b).map_err(|e| e.to_string()));
            let record = match record {
                Ok(r) => r,
                Err(e) => {
                    warn!(record = %path.display(), error = %e, "an E2B sandbox record that cannot be read; removed");
                    let _ = std::fs::remove_file(&path);
                    continue;
                }
            };
            let id = record.id.clone();
            match self.adopt(record).await {
                Ok(n) => lines.push(format!("{id}: taken back with {n} running processes")),
                Err(e) => {
                    lines.push(format!("{id}: not taken back ({e}); ended"));
                    let _ = std::fs::remove_file(&path);
                    let _ = std::fs::remove_dir_all(self.procs_dir(&id));
                }
            }
        }
        lines
    }

    /// Takes back one sandbox; how many of its processes still run.
    async fn adopt(&self, record: Record) -> Result<usize, String> {
        let s = &self.settings;
        let workspace = self
            .containers
            .adopt_workspace(
                WorkspaceRequest {
                    id: &record.id,
                    parent: &s.parent,
                    image: &record.image,
                    disk_mb: record.disk_mb,
                    snapshot: None,
                    subvolume: None,
                    root_layer: None,
                },
                record.host_id,
            )
            .await;
        let workspace = match workspace {
            Ok(w) => w,
            Err(e) => {
                // Its container is ended; its directory (whose mounts were not carried over) removed.
                self.containers.end_kept_run(&record.id, record.init).await;
                let _ = std::fs::remove_dir_all(s.parent.join(&record.id));
                return Err(Chain(&e).to_string());
            }
        };
        let (run, chan) = match workspace.adopt_serving_run(&record.id, record.init).await {
            Ok(r) => r,
            Err(e) => {
                self.containers.end_kept_run(&record.id, record.init).await;
                workspace.remove().await;
                return Err(Chain(&e).to_string());
            }
        };
        let ended = |e: String| async {
            run.remove().await;
            workspace.remove().await;
            Err::<usize, String>(e)
        };
        // A frozen init answers nothing: a paused sandbox is thawed while it is taken back, then frozen again.
        if let Err(e) = run.thaw().await {
            return ended(Chain(&e).to_string()).await;
        }
        let processes = match Processes::adopt(chan).await {
            Ok(p) => Arc::new(p),
            Err(e) => return ended(Chain(&e).to_string()).await,
        };
        let running = match processes.list().await {
            Ok(r) => r,
            Err(e) => return ended(Chain(&e).to_string()).await,
        };
        if record.paused {
            if let Err(e) = run.freeze().await {
                return ended(Chain(&e).to_string()).await;
            }
        }
        let egress = match record.allow_out.is_empty() {
            true => None,
            false => match SandboxEgress::create(
                self.network.as_ref(),
                &agent_api::SandboxNetwork {
                    allow: record.allow_out.clone(),
                    egress_bytes: None,
                },
                None,
            ) {
                Ok(e) => match e.serve_in(&*run) {
                    Ok(serving) => Some((e, Some(serving))),
                    Err(err) => return ended(Chain(&err).to_string()).await,
                },
                Err(err) => return ended(Chain(&err).to_string()).await,
            },
        };
        let info = SandboxInfo {
            id: record.id.clone(),
            template: record.template.clone(),
            metadata: record.metadata.clone(),
            started_at: from_millis(record.started_ms),
            end_at: from_millis(record.end_ms),
            state: if record.paused {
                SandboxState::Paused
            } else {
                SandboxState::Running
            },
            access_token: record.access_token.clone(),
            cpu_count: record.cpu_count,
            memory_mb: record.memory_mb,
            disk_mb: record.disk_mb,
        };
        let live = Arc::new(Live {
            info: Mutex::new(info),
            workspace,
            run,
            processes,
            table: Arc::new(Mutex::new(HashMap::new())),
            env: record.env.clone(),
            egress,
            kept: Some(Kept {
                record: self.record_path(&record.id),
                procs: self.procs_dir(&record.id),
                base: Mutex::new(record),
            }),
        });
        let count = running.len();
        for r in running {
            live.take_back(r);
        }
        let id = lock(&live.info).id.clone();
        lock(&self.map).insert(id, live);
        Ok(count)
    }

    /// Where a new sandbox is kept for the next daemon (live restore), and its record.
    fn kept(
        &self,
        info: &SandboxInfo,
        image: &str,
        env: &BTreeMap<String, String>,
        host_id: u32,
        init: InitIdentity,
        spec: &CreateSpec,
    ) -> Kept {
        Kept {
            record: self.record_path(&info.id),
            procs: self.procs_dir(&info.id),
            base: Mutex::new(Record {
                id: info.id.clone(),
                template: info.template.clone(),
                image: image.to_owned(),
                metadata: info.metadata.clone(),
                env: env.clone(),
                started_ms: millis(info.started_at),
                end_ms: millis(info.end_at),
                paused: false,
                access_token: info.access_token.clone(),
                cpu_count: info.cpu_count,
                memory_mb: info.memory_mb,
                disk_mb: info.disk_mb,
                host_id,
                init,
                allow_out: spec.allow_out.clone(),
            }),
        }
    }

    fn record_path(&self, id: &str) -> PathBuf {
        self.settings.parent.join(format!("{id}.json"))
    }

    fn procs_dir(&self, id: &str) -> PathBuf {
        self.settings.parent.join(format!("{id}.procs"))
    }

    /// The egress proxy of a sandbox that may reach `allow_out` (none for an empty list), or why not.
    fn egress_for(&self, allow_out: &[String]) -> Result<Option<SandboxEgress>, EngineError> {
        let egress = match allow_out.is_empty() {
            true => None,
            false => Some(
                SandboxEgress::create(
                    self.network.as_ref(),
                    &agent_api::SandboxNetwork {
                        allow: allow_out.to_vec(),
                        egress_bytes: None,
                    },
                    None,
                )
                .map_err(|e| {
                    EngineError::Invalid(match e {
                        // The agents' messages name their own field (network.allow).
                        agents::network::NetworkError::Entry(e) => format!("network.allowOut: {e}"),
                        agents::network::NetworkError::TooMany(n) => {
                            format!("network.allowOut: {n} entries, more than sandboxd allows")
                        }
                        agents::network::NetworkError::Disabled => {
                            "network.allowOut: egress is off on this host (the daemon's network.enabled)".into()
                        }
                        e => format!("network.allowOut: {e}"),
                    })
                })?,
            ),
        };
        Ok(egress)
    }

    /// The environment every process of a sandbox on `image` starts from.
    fn environment(
        &self,
        image: &str,
        egress: Option<&SandboxEgress>,
        env_vars: &BTreeMap<String, String>,
    ) -> BTreeMap<String, String> {
        let mut env: BTreeMap<String, String> =
            self.containers.image_environment(image).unwrap_or_default();
        env.insert("HOME".into(), HOME.into());
        env.insert("USER".into(), "user".into());
        env.entry("PATH".into()).or_insert_with(|| {
            "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin".into()
        });
        if let Some(egress) = egress {
            env.extend(egress.environment());
        }
        env.extend(env_vars.clone());
        env
    }

    /// A fresh sandbox id: a sequence number and random hex, then the node's tag on a fleet.
    fn new_id(&self) -> String {
        format!(
            "i{}{}{}",
            self.seq.fetch_add(1, Ordering::Relaxed),
            crate::random_hex(8),
            self.settings.id_suffix
        )
    }

    #[tracing::instrument(name = "e2b_create", skip_all, fields(sandbox = tracing::field::Empty, template = %spec.template))]
    async fn create_sandbox(&self, spec: CreateSpec) -> Result<SandboxInfo, EngineError> {
        // The allowlist is checked (against the operator's network.allow_max) before anything is made.
        let egress = self.egress_for(&spec.allow_out)?;
        let image = match spec.template.as_str() {
            "base" | "" => self.settings.base_image.clone(),
            "code-interpreter-v1" => self.settings.code_interpreter_image.clone(),
            other => other.to_owned(),
        };
        let id = self.new_id();
        tracing::Span::current().record("sandbox", id.as_str());
        let s = &self.settings;
        let workspace = self
            .containers
            .create_workspace(WorkspaceRequest {
                id: &id,
                parent: &s.parent,
                image: &image,
                disk_mb: s.disk_mb,
                snapshot: None,
                subvolume: None,
                root_layer: None,
            })
            .await
            .map_err(|e| match e {
                WorkspaceError::NoImage(i) => {
                    EngineError::Invalid(format!("template {i:?} does not exist on this host"))
                }
                WorkspaceError::Full(n) => {
                    EngineError::Full(format!("{n} sandboxes exist on this host, the maximum"))
                }
                WorkspaceError::Failed(e) => EngineError::Internal(Chain(&*e).to_string()),
            })?;
        let run = workspace
            .create_run(RunPlan {
                cid: &id,
                args: Vec::new(),
                env: Vec::new(),
                memory_mb: s.memory_mb,
                pids_max: s.pids_max,
                shm_bytes: (s.disk_mb << 20).min(64 << 20),
                keep: s.live_restore,
                home: Some(HOME),
            })
            .await;
        let run = match run {
            Ok(run) => run,
            Err(e) => {
                workspace.remove().await;
                return Err(EngineError::Internal(Chain(&e).to_string()));
            }
        };
        // The proxy listens inside the container's network namespace before anything runs there.
        let served = egress
            .as_ref()
            .map(|e| e.serve_in(&*run))
            .transpose()
            .and_then(|serving| run.serve().map(|p| (serving, p)));
        let (serving, processes) = match served {
            Ok(s) => s,
            Err(e) => {
                run.remove().await;
                workspace.remove().await;
                return Err(EngineError::Internal(Chain(&e).to_string()));
            }
        };
        let env = self.environment(&image, egress.as_ref(), &spec.env_vars);
        let now = SystemTime::now();
        let info = SandboxInfo {
            id: id.clone(),
            template: if spec.template.is_empty() {
                "base".into()
            } else {
                spec.template.clone()
            },
            metadata: spec.metadata.clone(),
            started_at: now,
            end_at: now + spec.timeout,
            state: SandboxState::Running,
            access_token: crate::random_hex(32),
            cpu_count: s.cpu_count,
            memory_mb: s.memory_mb,
            disk_mb: s.disk_mb,
        };
        let kept = match (s.live_restore, run.init()) {
            (false, _) => None,
            (true, Some(init)) => {
                Some(self.kept(&info, &image, &env, workspace.host_id(), init, &spec))
            }
            (true, None) => {
                run.remove().await;
                workspace.remove().await;
                return Err(EngineError::Internal(
                    "the sandbox's container was not kept for live restore".into(),
                ));
            }
        };
        let live = Arc::new(Live {
            info: Mutex::new(info.clone()),
            workspace,
            run,
            processes: Arc::new(processes),
            table: Arc::new(Mutex::new(HashMap::new())),
            env,
            egress: egress.map(|e| (e, serving)),
            kept,
        });
        if let Err(e) = live.persist() {
            live.end().await;
            return Err(EngineError::Internal(format!(
                "cannot keep the sandbox's record for live restore: {e}"
            )));
        }
        lock(&self.map).insert(id.clone(), live);
        info!(sandbox = %id, template = %info.template, "E2B sandbox created");
        Ok(info)
    }
}

impl Engine for Sandboxes {
    fn create(&self, spec: CreateSpec) -> BoxFuture<'_, Result<SandboxInfo, EngineError>> {
        Box::pin(self.create_sandbox(spec))
    }

    fn get(&self, id: &str) -> Option<Arc<dyn LiveSandbox>> {
        lock(&self.map)
            .get(id)
            .map(|l| l.clone() as Arc<dyn LiveSandbox>)
    }

    fn list(&self) -> Vec<Arc<dyn LiveSandbox>> {
        let mut all: Vec<Arc<Live>> = lock(&self.map).values().cloned().collect();
        all.sort_by_key(|l| {
            let info = lock(&l.info);
            (info.started_at, info.id.clone())
        });
        all.into_iter().map(|l| l as Arc<dyn LiveSandbox>).collect()
    }

    fn kill<'a>(&'a self, id: &'a str) -> BoxFuture<'a, bool> {
        let span = tracing::info_span!("e2b_kill", sandbox = %id);
        Box::pin(tracing::Instrument::instrument(
            async move {
                let Some(live) = lock(&self.map).remove(id) else {
                    return false;
                };
                live.end().await;
                info!(sandbox = %id, "E2B sandbox killed");
                true
            },
            span,
        ))
    }
}

/// Kills the sandboxes whose end has come, until the engine is gone.
async fn expire(engine: Weak<Sandboxes>) {
    let mut tick = tokio::time::interval(EXPIRY_TICK);
    loop {
        tick.tick().await;
        let Some(engine) = engine.upgrade() else {
            return;
        };
        let now = SystemTime::now();
        let due: Vec<String> = lock(&engine.map)
            .values()
            .filter(|l| lock(&l.info).end_at <= now)
            .map(|l| lock(&l.info).id.clone())
            .collect();
        for id in due {
            info!(sandbox = %id, "E2B sandbox reached its timeout");
            engine.kill(&id).await;
        }
    }
}

/// One live sandbox.
struct Live {
    info: Mutex<SandboxInfo>,
    workspace: Arc<dyn Workspace>,
    run: Arc<dyn RunContainer>,
    processes: Arc<Processes>,
    /// Its running processes by pid.
    table: Arc<Mutex<HashMap<u32, Arc<Proc>>>>,
    /// The environment every process starts from (the image's, the home, the proxy's, the create's `envVars`).
    env: BTreeMap<String, String>,
    /// Its egress proxy and its serving inside the container, when it may reach out.
    egress: Option<(SandboxEgress, Option<Serving>)>,
    /// With live restore: its record and its processes' records.
    kept: Option<Kept>,
}

/// Where a sandbox is kept for the next daemon.
struct Kept {
    /// `<parent>/<id>.json`.
    record: PathBuf,
    /// `<parent>/<id>.procs`, a file per running process.
    procs: PathBuf,
    /// What does not change (the end and the pause do, and are taken from the sandbox's info when written).
    base: Mutex<Record>,
}

/// One running process.
struct Proc {
    spec: ProcessSpec,
    /// Its readers.
    readers: Mutex<Vec<mpsc::Sender<ProcessEvent>>>,
    /// Its stdin, while open.
    stdin: tokio::sync::Mutex<Option<tokio::net::unix::pipe::Sender>>,
    /// Notified when a reader attaches.
    attached: tokio::sync::Notify,
}

impl Live {
    /// Ends the container and removes everything of the sandbox.
    async fn end(&self) {
        if let Some((egress, _)) = &self.egress {
            egress.close();
        }
        self.run.signal(Signal::SIGKILL);
        self.run.remove().await;
        self.workspace.remove().await;
        lock(&self.table).clear();
        if let Some(kept) = &self.kept {
            let _ = std::fs::remove_file(&kept.record);
            let _ = std::fs::remove_dir_all(&kept.procs);
        }
    }

    /// Writes its record as it is now (live restore); nothing without.
    fn persist(&self) -> std::io::Result<()> {
        let Some(kept) = &self.kept else {
            return Ok(());
        };
        let mut record = lock(&kept.base).clone();
        {
            let info = lock(&self.info);
            record.end_ms = millis(info.end_at);
            record.paused = info.state == SandboxState::Paused;
        }
        let bytes = serde_json::to_vec(&record).map_err(std::io::Error::other)?;
        write_whole(&kept.record, &bytes)
    }

    /// Serves a process a previous daemon started (live restore): its pipes are the copies its init held.
    fn take_back(&self, running: runtime::processes::Running) {
        let Some(kept) = &self.kept else {
            return;
        };
        let pid = running.pid as u32;
        let spec: ProcessSpec = std::fs::read(kept.procs.join(format!("{pid}.json")))
            .ok()
            .and_then(|b| serde_json::from_slice::<ProcRecord>(&b).ok())
            .map(ProcessSpec::from)
            .unwrap_or_default();
        let [stdin, out, err] = running.held;
        let take = |fd: i32| (fd >= 0).then(|| self.run.init_fd(fd).ok()).flatten();
        let (Some(out), Some(err)) = (take(out), take(err)) else {
            warn!(pid, "a process taken back without its output pipes");
            return;
        };
        let stdin = take(stdin)
            .filter(|_| spec.stdin)
            .and_then(|w| tokio::net::unix::pipe::Sender::from_owned_fd(w).ok());
        let (Ok(out), Ok(err)) = (
            tokio::net::unix::pipe::Receiver::from_owned_fd(out),
            tokio::net::unix::pipe::Receiver::from_owned_fd(err),
        ) else {
            return;
        };
        let proc = Arc::new(Proc {
            spec,
            readers: Mutex::new(Vec::new()),
            stdin: tokio::sync::Mutex::new(stdin),
            attached: tokio::sync::Notify::new(),
        });
        // What it wrote while no daemon ran waits in its pipes for its first reader.
        self.serve_process(pid, proc, out, err, running.exit, true);
    }

    /// Registers a process and pumps its output to its readers until it ends; with `hold`, nothing is read
    /// before its first reader attaches (or it ends).
    fn serve_process(
        &self,
        pid: u32,
        proc: Arc<Proc>,
        out: tokio::net::unix::pipe::Receiver,
        err: tokio::net::unix::pipe::Receiver,
        mut exit: tokio::sync::watch::Receiver<Option<ProgramExit>>,
        hold: bool,
    ) {
        lock(&self.table).insert(pid, proc.clone());
        let table = Arc::downgrade(&self.table);
        let record = self
            .kept
            .as_ref()
            .map(|k| k.procs.join(format!("{pid}.json")));
        let processes = Arc::downgrade(&self.processes);
        tokio::spawn(async move {
            if hold {
                tokio::select! {
                    () = proc.attached.notified() => {}
                    _ = exit.wait_for(Option::is_some) => {}
                }
            }
            let end = pump(&proc, out, err, exit).await;
            if let Some(t) = table.upgrade() {
                lock(&t).remove(&pid);
            }
            if let Some(record) = record {
                let _ = std::fs::remove_file(record);
            }
            // When the whole sandbox ended (killed, or its end came), its processes have no end of their own: the
            // readers' streams stop without one, which the SDK takes for a sandbox that is gone.
            let sandbox_gone = processes.upgrade().is_none_or(|p| p.closed());
            if !sandbox_gone {
                proc.emit(ProcessEvent::End(end)).await;
            }
            lock(&proc.readers).clear();
        });
    }

    fn paused(&self) -> bool {
        lock(&self.info).state == SandboxState::Paused
    }

    /// The launch of `spec`: the program looked up in `PATH` when it is a bare name, the environment merged.
    fn launch(&self, spec: &ProcessSpec) -> Result<Launch, EngineError> {
        let mut args = Vec::with_capacity(spec.args.len() + 3);
        if spec.cmd.is_empty() {
            return Err(EngineError::Invalid("process.cmd is empty".into()));
        }
        if !spec.cmd.contains('/') {
            args.extend(["/usr/bin/env".to_owned(), "--".to_owned()]);
        }
        args.push(spec.cmd.clone());
        args.extend(spec.args.iter().cloned());
        let mut env = self.env.clone();
        env.extend(spec.envs.clone());
        let cwd = match spec.cwd.as_deref() {
            None | Some("") => HOME.to_owned(),
            Some(c) => {
                crate::files::Root::absolute(c).map_err(|e| EngineError::Invalid(e.to_string()))?
            }
        };
        Ok(Launch {
            cwd: Some(cwd),
            ..Launch::program(
                args,
                env.into_iter().map(|(k, v)| format!("{k}={v}")).collect(),
            )
        })
    }

    #[tracing::instrument(name = "e2b_start", skip_all, fields(sandbox = %lock(&self.info).id, pid = tracing::field::Empty))]
    async fn start_process(&self, spec: ProcessSpec) -> Result<Attached, EngineError> {
        if self.paused() {
            return Err(EngineError::Paused(lock(&self.info).id.clone()));
        }
        let launch = self.launch(&spec)?;
        let io = |e: std::io::Error| {
            EngineError::Internal(format!("cannot make the process's pipes: {e}"))
        };
        let (out_r, out_w) = pipe().map_err(io)?;
        let (err_r, err_w) = pipe().map_err(io)?;
        let (stdin_r, stdin_w) = match spec.stdin {
            true => {
                let (r, w) = pipe().map_err(io)?;
                (r, Some(w))
            }
            false => (std::fs::File::open("/dev/null").map_err(io)?.into(), None),
        };
        // With live restore the init holds the daemon's ends too, so the process outlives this daemon's.
        let null = std::fs::File::open("/dev/null").map_err(io)?;
        let held = self.kept.as_ref().map(|_| {
            [
                stdin_w.as_ref().map_or(null.as_fd(), |w| w.as_fd()),
                out_r.as_fd(),
                err_r.as_fd(),
            ]
        });
        let started = self
            .processes
            .start(
                &launch,
                [stdin_r.as_fd(), out_w.as_fd(), err_w.as_fd()],
                held,
            )
            .await
            .map_err(|e| match e {
                ProcessError::Refused(why) => EngineError::Start(why),
                ProcessError::Gone => EngineError::SandboxNotFound(lock(&self.info).id.clone()),
                e => EngineError::Internal(Chain(&e).to_string()),
            })?;
        drop((stdin_r, out_w, err_w));
        let pid = started.pid as u32;
        tracing::Span::current().record("pid", pid);
        let receiver =
            |fd: OwnedFd| tokio::net::unix::pipe::Receiver::from_owned_fd(fd).map_err(io);
        let (out, err) = (receiver(out_r)?, receiver(err_r)?);
        let stdin = match stdin_w {
            Some(w) => Some(tokio::net::unix::pipe::Sender::from_owned_fd(w).map_err(io)?),
            None => None,
        };
        if let Some(kept) = &self.kept {
            let record = serde_json::to_vec(&ProcRecord::from(&spec)).unwrap_or_default();
            let written = std::fs::create_dir_all(&kept.procs)
                .and_then(|()| std::fs::write(kept.procs.join(format!("{pid}.json")), record));
            if let Err(e) = written {
                warn!(pid, error = %e, "cannot keep a process's record for live restore");
            }
        }
        let (tx, rx) = mpsc::channel(READER_QUEUE);
        let proc = Arc::new(Proc {
            spec,
            readers: Mutex::new(vec![tx]),
            stdin: tokio::sync::Mutex::new(stdin),
            attached: tokio::sync::Notify::new(),
        });
        self.serve_process(pid, proc, out, err, started.exit, false);
        Ok(Attached { pid, events: rx })
    }
}

impl Proc {
    /// Gives `event` to every reader, waiting for room (a slow reader slows the process's output); a reader that
    /// is gone is dropped.
    async fn emit(&self, event: ProcessEvent) {
        let readers: Vec<mpsc::Sender<ProcessEvent>> = lock(&self.readers).clone();
        let mut gone = Vec::new();
        for (i, r) in readers.iter().enumerate() {
            if r.send(event.clone()).await.is_err() {
                gone.push(i);
            }
        }
        if !gone.is_empty() {
            lock(&self.readers).retain(|r| !r.is_closed());
        }
    }
}

/// Reads a process's stdout and stderr to its readers until it has ended (and, for [`AFTER_EXIT`], what it left
/// running still writes); how it ended.
async fn pump(
    proc: &Proc,
    mut out: tokio::net::unix::pipe::Receiver,
    mut err: tokio::net::unix::pipe::Receiver,
    mut exit: tokio::sync::watch::Receiver<Option<ProgramExit>>,
) -> ProcessEnd {
    let mut out_buf = vec![0u8; CHUNK];
    let mut err_buf = vec![0u8; CHUNK];
    let (mut out_open, mut err_open) = (true, true);
    let mut deadline: Option<tokio::time::Instant> = None;
    loop {
        if !out_open && !err_open {
            break;
        }
        if deadline.is_none() && exit.borrow().is_some() {
            deadline = Some(tokio::time::Instant::now() + AFTER_EXIT);
        }
        let until = async {
            match deadline {
                Some(d) => tokio::time::sleep_until(d).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            n = out.read(&mut out_buf), if out_open => match n {
                Ok(0) | Err(_) => out_open = false,
                Ok(n) => proc.emit(ProcessEvent::Stdout(Bytes::copy_from_slice(&out_buf[..n]))).await,
            },
            n = err.read(&mut err_buf), if err_open => match n {
                Ok(0) | Err(_) => err_open = false,
                Ok(n) => proc.emit(ProcessEvent::Stderr(Bytes::copy_from_slice(&err_buf[..n]))).await,
            },
            _ = exit.changed(), if deadline.is_none() => {}
            () = until => break,
        }
    }
    let ended = match exit.wait_for(Option::is_some).await {
        Ok(e) => *e,
        Err(_) => None,
    };
    describe(ended.unwrap_or(ProgramExit::Signal(libc::SIGKILL)))
}

/// A program's end as envd reports it (Go's `ProcessState` wording).
fn describe(exit: ProgramExit) -> ProcessEnd {
    match exit {
        ProgramExit::Code(code) => ProcessEnd {
            exit_code: code,
            exited: true,
            status: format!("exit status {code}"),
            error: None,
        },
        ProgramExit::Signal(sig) => {
            let name = match sig {
                1 => "hangup".to_owned(),
                2 => "interrupt".to_owned(),
                6 => "aborted".to_owned(),
                9 => "killed".to_owned(),
                11 => "segmentation fault".to_owned(),
                13 => "broken pipe".to_owned(),
                15 => "terminated".to_owned(),
                n => format!("signal {n}"),
            };
            ProcessEnd {
                exit_code: -1,
                exited: false,
                status: format!("signal: {name}"),
                error: None,
            }
        }
    }
}

impl LiveSandbox for Live {
    fn info(&self) -> SandboxInfo {
        lock(&self.info).clone()
    }

    fn set_timeout(&self, timeout: Duration) {
        lock(&self.info).end_at = SystemTime::now() + timeout;
        if let Err(e) = self.persist() {
            warn!(error = %e, "cannot keep a sandbox's new end for live restore");
        }
    }

    fn pause(&self) -> BoxFuture<'_, Result<bool, EngineError>> {
        Box::pin(async move {
            if self.paused() {
                return Ok(false);
            }
            self.run
                .freeze()
                .await
                .map_err(|e| EngineError::Internal(Chain(&e).to_string()))?;
            lock(&self.info).state = SandboxState::Paused;
            if let Err(e) = self.persist() {
                warn!(error = %e, "cannot keep a sandbox's pause for live restore");
            }
            Ok(true)
        })
    }

    fn resume(&self) -> BoxFuture<'_, Result<(), EngineError>> {
        Box::pin(async move {
            if !self.paused() {
                return Ok(());
            }
            self.run
                .thaw()
                .await
                .map_err(|e| EngineError::Internal(Chain(&e).to_string()))?;
            lock(&self.info).state = SandboxState::Running;
            if let Err(e) = self.persist() {
                warn!(error = %e, "cannot keep a sandbox's resume for live restore");
            }
            Ok(())
        })
    }

    fn start(&self, spec: ProcessSpec) -> BoxFuture<'_, Result<Attached, EngineError>> {
        Box::pin(self.start_process(spec))
    }

    fn attach(&self, pid: u32) -> Result<Attached, EngineError> {
        let proc = lock(&self.table)
            .get(&pid)
            .cloned()
            .ok_or(EngineError::ProcessNotFound(pid))?;
        let (tx, rx) = mpsc::channel(READER_QUEUE);
        lock(&proc.readers).push(tx);
        proc.attached.notify_one();
        Ok(Attached { pid, events: rx })
    }

    fn processes(&self) -> Vec<ProcessInfo> {
        let mut all: Vec<ProcessInfo> = lock(&self.table)
            .iter()
            .map(|(pid, p)| ProcessInfo {
                pid: *pid,
                spec: p.spec.clone(),
            })
            .collect();
        all.sort_by_key(|p| p.pid);
        all
    }

    fn signal(&self, pid: u32, signal: Signal) -> BoxFuture<'_, Result<(), EngineError>> {
        Box::pin(async move {
            if !lock(&self.table).contains_key(&pid) {
                return Err(EngineError::ProcessNotFound(pid));
            }
            // The init signals only its own running program of that pid.
            match self.processes.signal(pid as i32, signal).await {
                Ok(true) => Ok(()),
                Ok(false) => Err(EngineError::ProcessNotFound(pid)),
                Err(ProcessError::Gone) => {
                    Err(EngineError::SandboxNotFound(lock(&self.info).id.clone()))
                }
                Err(e) => Err(EngineError::Internal(Chain(&e).to_string())),
            }
        })
    }

    fn send_input<'a>(
        &'a self,
        pid: u32,
        data: &'a [u8],
    ) -> BoxFuture<'a, Result<(), EngineError>> {
        Box::pin(async move {
            let proc = lock(&self.table)
                .get(&pid)
                .cloned()
                .ok_or(EngineError::ProcessNotFound(pid))?;
            let mut stdin = proc.stdin.lock().await;
            let Some(w) = stdin.as_mut() else {
                return Err(EngineError::Invalid(format!(
                    "process {pid} has no open stdin (started without stdin, or closed)"
                )));
            };
            tokio::io::AsyncWriteExt::write_all(w, data)
                .await
                .map_err(|e| EngineError::Invalid(format!("stdin of process {pid}: {e}")))
        })
    }

    fn close_stdin(&self, pid: u32) -> Result<(), EngineError> {
        let proc = lock(&self.table)
            .get(&pid)
            .cloned()
            .ok_or(EngineError::ProcessNotFound(pid))?;
        let closed = match proc.stdin.try_lock() {
            Ok(mut s) => {
                s.take();
                Ok(())
            }
            Err(_) => Err(EngineError::Invalid(format!(
                "stdin of process {pid} is being written"
            ))),
        };
        closed
    }

    fn root(&self) -> Result<OwnedFd, EngineError> {
        self.run
            .root_dir()
            .map_err(|_| EngineError::SandboxNotFound(lock(&self.info).id.clone()))
    }

    fn owner(&self) -> (u32, u32) {
        let id = self.workspace.host_id();
        (id, id)
    }

    fn usage(&self) -> Result<(u64, u64), EngineError> {
        self.run
            .usage()
            .map(|u| (u.memory_bytes, u.cpu_time_ns))
            .map_err(|e| EngineError::Internal(Chain(&e).to_string()))
    }
}

/// A pipe, both ends close-on-exec (the init's copy of the write end becomes the program's stdio).
fn pipe() -> std::io::Result<(OwnedFd, OwnedFd)> {
    nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).map_err(std::io::Error::from)
}

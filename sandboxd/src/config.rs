//! Configuration: a YAML file (every key optional, unknown keys refused), `--listen` and `SANDBOXD_TOKEN`
//! overrides, and the defaults a config-less start uses.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use protocol::{Language, Limits};
use serde::Deserialize;

/// Default listen address.
pub const DEFAULT_LISTEN: &str = "127.0.0.1:7070";
/// Default state directory.
pub const DEFAULT_STATE_DIR: &str = "/var/lib/sandboxd";
/// Default number of executions running at once.
pub const DEFAULT_MAX_CONCURRENT: usize = 8;
/// Default number of executions waiting for a slot.
pub const DEFAULT_MAX_QUEUE: usize = 32;
/// Default grace period for running executions at SIGTERM.
pub const DEFAULT_SHUTDOWN_GRACE_MS: u64 = 10_000;
/// How long, after the drain, the FSP connections have to write their last messages and close (a client that
/// stopped reading would otherwise hold the shutdown). Not configurable.
pub const CONNECTIONS_CLOSE: std::time::Duration = std::time::Duration::from_secs(5);
/// Default largest accepted WebSocket message.
pub const DEFAULT_MAX_FRAME_BYTES: usize = 16 << 20;
/// Default cgroup parent (relative to each hierarchy root).
pub const DEFAULT_CGROUP_PARENT: &str = "sandboxd";
/// Default first host uid/gid that container root maps to; each container that exists at once has its own uid in
/// `uid_base..uid_base + Config::uid_count()`.
pub const DEFAULT_UID_BASE: u32 = 200_000;
/// Default `RLIMIT_NOFILE` in executions.
pub const DEFAULT_NOFILE: u64 = 1024;
/// Default lowest Landlock ABI: 3 (Linux 6.2) handles truncation, so every write path is covered.
pub const DEFAULT_LANDLOCK_MIN_ABI: i32 = 3;
/// Default maximums a request may ask for.
pub const DEFAULT_MAX_LIMITS: Limits = Limits {
    timeout_ms: 300_000,
    memory_mb: 2048,
    cpu_shares: 1024,
    max_output_bytes: 16 << 20,
    pids_max: 1024,
    disk_mb: 1024,
    cpu_cores: Some(protocol::CpuCores::from_const(2.0)),
};

/// The daemon's configuration.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// Address of the HTTP/WebSocket listener.
    pub listen: SocketAddr,
    /// A second listener serving only `GET /metrics` (same bearer token), e.g. on an internal interface.
    pub metrics_listen: Option<SocketAddr>,
    /// Directory for the token file, images and per-execution state.
    pub state_dir: PathBuf,
    /// Authentication.
    pub auth: AuthConfig,
    /// Admission control.
    pub capacity: CapacityConfig,
    /// Maximums for every limit of `execute`.
    pub limits: LimitsConfig,
    /// How long running executions may finish after SIGTERM before they are killed.
    pub shutdown_grace_ms: u64,
    /// Largest accepted WebSocket message; larger ones close the connection with 1009.
    pub max_frame_bytes: usize,
    /// Sandbox settings.
    pub sandbox: SandboxConfig,
    /// Artifact collection and store.
    pub artifacts: ArtifactsConfig,
    /// OCI images executions may run on, by name (besides the embedded `host` image).
    pub images: BTreeMap<String, ImageConfig>,
    /// Which image and interpreter each language uses. Absent: every language the host image can run, with the
    /// interpreter found there. Present: exactly the languages listed.
    pub languages: Option<BTreeMap<Language, LanguageConfig>>,
    /// Containers created ahead of time.
    pub pool: PoolConfig,
    /// The `tool_calls` extension: per-call timeout maximum and per-execution bounds of the tool socket.
    pub tools: crate::extensions::tools::ToolsConfig,
    /// Agent sandboxes (the adapter-shim endpoints under `/sandboxes`).
    pub agents: AgentsConfig,
    /// OpenTelemetry traces.
    pub telemetry: crate::observe::telemetry::TelemetryConfig,
    /// The `network` extension: egress through a per-execution proxy to the hosts a request lists.
    pub network: crate::extensions::egress::NetworkConfig,
    /// E2B's API on a listener of its own (`docs/spec/e2b-compat.md`).
    pub e2b: e2b::config::E2bConfig,
}

pub use agents::config::{AgentsConfig, AGENT_QUEUED_OVERHEAD, AGENT_STAMP_BYTES};

/// The most languages a daemon serves (python, javascript, shell, elixir): bounds the pool's rounding.
pub const MAX_LANGUAGES: usize = 4;

/// `pool:`
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PoolConfig {
    /// Containers kept ready in all, split evenly over the languages (rounded up). `None`:
    /// `capacity.max_concurrent`; 0: no pool (every execution creates its container when it starts).
    pub size: Option<usize>,
    /// Helper processes that create and remove containers in parallel. `None`: one per CPU, at most 8.
    pub helpers: Option<usize>,
    /// Pooled python and javascript containers start their interpreter ahead of time, waiting for the code
    /// ([`crate::exec::warm`]).
    pub warm: bool,
}

impl Default for PoolConfig {
    fn default() -> Self {
        Self {
            size: None,
            helpers: None,
            warm: true,
        }
    }
}

impl Config {
    /// The number of helper processes in force.
    pub fn helper_count(&self) -> usize {
        self.pool.helpers.unwrap_or_else(|| {
            std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1)
                .min(8)
        })
    }

    /// The pool size (all languages) in force.
    pub fn pool_size(&self) -> usize {
        self.pool.size.unwrap_or(self.capacity.max_concurrent)
    }

    /// How many host uids (from `sandbox.uid_base`) containers use: one per container that may exist at once,
    /// running (`max_concurrent`), being removed (as many again) or ready in the pool (its size, plus the
    /// rounding up per language).
    pub fn uid_count(&self) -> usize {
        let rounding = if self.pool_size() > 0 {
            MAX_LANGUAGES
        } else {
            0
        };
        2 * self.capacity.max_concurrent + self.pool_size() + rounding
    }

    /// The host uids of agent sandboxes: `agents.max_sandboxes` of them, after the executions' [`Self::uid_count`].
    pub fn agent_uids(&self) -> std::ops::Range<u32> {
        let base = self.sandbox.uid_base + self.uid_count() as u32;
        base..base + self.agents.max_sandboxes as u32
    }
}

/// `images.<name>:`
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ImageConfig {
    /// An OCI image layout to import (verified, unpacked once) at start unless the store already holds the image
    /// with the same manifest digest. Absent: the image must already be in the store (`sandboxd images import`).
    pub layout: Option<PathBuf>,
    /// Pin: the start fails unless the image's manifest digest is this `sha256:…`.
    pub digest: Option<String>,
    /// Modules the warm interpreter of the language on this image loads before it waits ([`crate::exec::warm`]): python
    /// dotted module names (`[numpy, pandas]`), or node module names (`[lodash, "@scope/pkg", zlib]`). An image
    /// with a list runs python or javascript, not both.
    pub preload: Vec<String>,
}

/// `languages.<language>:`
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LanguageConfig {
    /// `host` or a name under `images`.
    pub image: String,
    /// Interpreter and leading arguments; the code file's path is appended. The program must be absolute.
    pub command: Vec<String>,
}

/// `artifacts:`
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ArtifactsConfig {
    /// Files collected per execution at most.
    pub max_files: usize,
    /// Largest file collected, bytes.
    pub max_file_bytes: u64,
    /// Bytes collected per execution at most.
    pub max_total_bytes: u64,
    /// Manifests (and what only they reference) are kept this long, seconds.
    pub retention_s: u64,
    /// The store's size limit; unreferenced blobs go first, oldest first.
    pub max_store_bytes: u64,
    /// Eager upload of every collected artifact (optional).
    pub upload: Option<crate::storage::upload::UploadConfig>,
}

impl Default for ArtifactsConfig {
    fn default() -> Self {
        Self {
            max_files: 64,
            max_file_bytes: 64 << 20,
            max_total_bytes: 64 << 20,
            retention_s: 86_400,
            max_store_bytes: 10 << 30,
            upload: None,
        }
    }
}

/// `auth:`
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AuthConfig {
    /// Accepted bearer tokens.
    pub tokens: Vec<String>,
}

/// `capacity:`
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CapacityConfig {
    /// Executions running at once.
    pub max_concurrent: usize,
    /// Executions waiting for a slot; beyond that `SANDBOX_OVERLOADED`.
    pub max_queue: usize,
}

impl Default for CapacityConfig {
    fn default() -> Self {
        Self {
            max_concurrent: DEFAULT_MAX_CONCURRENT,
            max_queue: DEFAULT_MAX_QUEUE,
        }
    }
}

/// `limits:`
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LimitsConfig {
    /// The largest value a request may ask for, per limit: the protocol's own [`Limits`] (what `pong` reports),
    /// with the same keys; a key left out keeps its [`DEFAULT_MAX_LIMITS`] value.
    #[serde(deserialize_with = "max_limits")]
    pub max: Limits,
}

impl Default for LimitsConfig {
    fn default() -> Self {
        Self {
            max: DEFAULT_MAX_LIMITS,
        }
    }
}

/// `limits.max`: a map of the protocol's limit names onto [`DEFAULT_MAX_LIMITS`]; an unknown key is refused.
fn max_limits<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Limits, D::Error> {
    struct Maxima;
    impl<'de> serde::de::Visitor<'de> for Maxima {
        type Value = Limits;
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("a map of limit names to maximums")
        }
        fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Limits, A::Error> {
            let mut limits = DEFAULT_MAX_LIMITS;
            while let Some(key) = map.next_key::<String>()? {
                if key == "cpu_cores" {
                    limits.cpu_cores = Some(map.next_value()?);
                    continue;
                }
                let value = map.next_value::<u64>()?;
                if !limits.set(&key, value) {
                    return Err(serde::de::Error::unknown_field(&key, &Limits::NAMES));
                }
            }
            Ok(limits)
        }
    }
    d.deserialize_map(Maxima)
}

/// `sandbox:`
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SandboxConfig {
    /// Cgroup parent the daemon owns (relative to each hierarchy root).
    pub cgroup_parent: String,
    /// cgroupfs root.
    pub cgroup_root: PathBuf,
    /// First host uid/gid container root maps to.
    pub uid_base: u32,
    /// `RLIMIT_NOFILE` of executions.
    pub nofile: u64,
    /// The lowest Landlock ABI the daemon accepts; it refuses to start on a kernel with less.
    pub landlock_min_abi: i32,
    /// How containers are started: `direct` (sandboxd's own start) or `libcontainer` (youki's).
    pub start: runtime::helper::StartMethod,
}

impl Default for SandboxConfig {
    fn default() -> Self {
        Self {
            cgroup_parent: DEFAULT_CGROUP_PARENT.into(),
            cgroup_root: runtime::cgroups::DEFAULT_ROOT.into(),
            uid_base: DEFAULT_UID_BASE,
            nofile: DEFAULT_NOFILE,
            landlock_min_abi: DEFAULT_LANDLOCK_MIN_ABI,
            start: runtime::helper::StartMethod::default(),
        }
    }
}

impl Default for Config {
    fn default() -> Self {
        Self {
            listen: DEFAULT_LISTEN
                .parse()
                .unwrap_or_else(|_| SocketAddr::from(([127, 0, 0, 1], 7070))),
            metrics_listen: None,
            state_dir: DEFAULT_STATE_DIR.into(),
            auth: AuthConfig::default(),
            capacity: CapacityConfig::default(),
            limits: LimitsConfig::default(),
            shutdown_grace_ms: DEFAULT_SHUTDOWN_GRACE_MS,
            max_frame_bytes: DEFAULT_MAX_FRAME_BYTES,
            sandbox: SandboxConfig::default(),
            artifacts: ArtifactsConfig::default(),
            images: BTreeMap::new(),
            languages: None,
            pool: PoolConfig::default(),
            tools: crate::extensions::tools::ToolsConfig::default(),
            agents: AgentsConfig::default(),
            telemetry: crate::observe::telemetry::TelemetryConfig::default(),
            network: crate::extensions::egress::NetworkConfig::default(),
            e2b: e2b::config::E2bConfig::default(),
        }
    }
}

/// A configuration that cannot be used; names the key and why.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("Cannot read config file {path}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The YAML does not parse or has an unknown key or a wrong type (serde's message names the key and line).
    #[error("Invalid config file {path}: {message}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// serde_yaml's message, with the key path and location.
        message: String,
    },
    /// A value parsed but is unusable.
    #[error("Invalid config value {key}: {reason}")]
    Value {
        /// Dotted key.
        key: &'static str,
        /// Why.
        reason: String,
    },
}

impl Config {
    /// Reads and validates a config file.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_owned(),
            source,
        })?;
        Self::parse(&text).map_err(|e| match e {
            ConfigError::Parse { message, .. } => ConfigError::Parse {
                path: path.to_owned(),
                message,
            },
            other => other,
        })
    }

    /// Parses and validates YAML text.
    pub fn parse(text: &str) -> Result<Self, ConfigError> {
        // An empty file is an empty mapping, not an error.
        let config: Config = if text.trim().is_empty() {
            Config::default()
        } else {
            let de = serde_yaml_ng::Deserializer::from_str(text);
            serde_path_to_error::deserialize(de).map_err(|e| {
                let path = e.path().to_string();
                let inner = e.into_inner().to_string();
                ConfigError::Parse {
                    path: PathBuf::new(),
                    message: if path == "." {
                        inner
                    } else {
                        format!("{path}: {inner}")
                    },
                }
            })?
        };
        config.validate()?;
        Ok(config)
    }

    /// Checks what serde cannot: ranges, then identities and paths, then images and languages (in this order,
    /// so the first problem reported is stable).
    fn validate(&self) -> Result<(), ConfigError> {
        self.telemetry
            .validate()
            .map_err(|(key, reason)| ConfigError::Value { key, reason })?;
        self.network
            .validate()
            .map_err(|(key, reason)| ConfigError::Value { key, reason })?;
        self.e2b
            .check()
            .map_err(|(key, reason)| ConfigError::Value { key, reason })?;
        self.validate_numbers()?;
        self.validate_host()?;
        self.validate_images()
    }

    /// Counts, sizes and limits.
    fn validate_numbers(&self) -> Result<(), ConfigError> {
        positive(
            "capacity.max_concurrent",
            self.capacity.max_concurrent as u64,
        )?;
        positive("max_frame_bytes", self.max_frame_bytes as u64)?;
        if self.pool.helpers == Some(0) {
            return Err(ConfigError::Value {
                key: "pool.helpers",
                reason: "must be at least 1 (or null: one per CPU)".into(),
            });
        }
        positive("sandbox.nofile", self.sandbox.nofile)?;
        if !(1..=runtime::landlock::MAX_ABI).contains(&self.sandbox.landlock_min_abi) {
            return Err(ConfigError::Value {
                key: "sandbox.landlock_min_abi",
                reason: format!("must be between 1 and {}", runtime::landlock::MAX_ABI),
            });
        }
        let m = &self.limits.max;
        positive("limits.max.timeout_ms", m.timeout_ms)?;
        let a = &self.agents;
        positive("agents.memory_mb", a.memory_mb)?;
        positive("agents.disk_mb", a.disk_mb)?;
        positive("agents.timeout_ms", a.timeout_ms)?;
        positive("agents.pids_max", a.pids_max)?;
        positive("agents.max_volumes", a.max_volumes as u64)?;
        positive("agents.max_snapshots", a.max_snapshots as u64)?;
        positive("agents.max_body_bytes", a.max_body_bytes as u64)?;
        positive("agents.upload_attempts", a.upload_attempts as u64)?;
        positive("agents.max_line_bytes", a.max_line_bytes)?;
        positive("agents.queue_events", a.queue_events as u64)?;
        if a.live_restore && self.sandbox.nofile <= runtime::init::keeper::CONN_FD as u64 {
            return Err(ConfigError::Value {
                key: "sandbox.nofile",
                reason: format!(
                    "must be above {} with agents.live_restore (a kept run's init holds the control connection at that descriptor)",
                    runtime::init::keeper::CONN_FD
                ),
            });
        }
        if a.live_restore && self.sandbox.start != runtime::helper::StartMethod::Direct {
            return Err(ConfigError::Value {
                key: "agents.live_restore",
                reason: "needs sandbox.start: direct (a kept run's init is the direct start's)"
                    .into(),
            });
        }
        // Every sandbox's and snapshot's quota must fit in the store at once, with a quarter over for btrfs's own
        // metadata: one tenant filling the store would otherwise end the others' writes (ENOSPC) within their quota.
        let quotas = (a.max_sandboxes as u64 + a.max_snapshots as u64).saturating_mul(a.disk_mb);
        let need = quotas.saturating_add(quotas / 4);
        if a.workspace_store == agents::config::WorkspaceStore::Btrfs && a.workspace_store_mb < need
        {
            return Err(ConfigError::Value {
                key: "agents.workspace_store_mb",
                reason: format!(
                    "must hold every sandbox's and snapshot's disk_mb at once, and a quarter more for btrfs's metadata: at least (agents.max_sandboxes + agents.max_snapshots) x agents.disk_mb x 1.25 = {need} (MiB)"
                ),
            });
        }
        if a.volume_max_mb < agents::volumes::MIN_VOLUME_MB {
            return Err(ConfigError::Value {
                key: "agents.volume_max_mb",
                reason: format!("must be at least {} (MiB)", agents::volumes::MIN_VOLUME_MB),
            });
        }
        // A budget smaller than one event could never hold it: refused rather than silently dropping everything.
        let event = a.max_line_bytes.saturating_add(AGENT_STAMP_BYTES);
        let queued = event.saturating_add(AGENT_QUEUED_OVERHEAD);
        if a.queue_bytes < queued {
            return Err(ConfigError::Value {
                key: "agents.queue_bytes",
                reason: format!(
                    "must hold one event: at least agents.max_line_bytes + {} ({queued})",
                    AGENT_STAMP_BYTES + AGENT_QUEUED_OVERHEAD
                ),
            });
        }
        if a.replay_bytes / 2 < event {
            return Err(ConfigError::Value {
                key: "agents.replay_bytes",
                reason: format!(
                    "each half must hold one event: at least 2 x (agents.max_line_bytes + {AGENT_STAMP_BYTES}) ({})",
                    event.saturating_mul(2)
                ),
            });
        }
        if !(a.cpu_cores.is_finite() && a.cpu_cores >= 0.01) {
            return Err(ConfigError::Value {
                key: "agents.cpu_cores",
                reason: "must be at least 0.01".into(),
            });
        }
        positive("limits.max.memory_mb", m.memory_mb)?;
        positive("limits.max.cpu_shares", m.cpu_shares)?;
        positive("limits.max.max_output_bytes", m.max_output_bytes)?;
        positive("limits.max.pids_max", m.pids_max)?;
        positive("limits.max.disk_mb", m.disk_mb)?;
        positive("tools.max_call_timeout_ms", self.tools.max_call_timeout_ms)?;
        positive("tools.max_connections", self.tools.max_connections as u64)?;
        positive("tools.max_calls", self.tools.max_calls)?;
        positive("tools.max_line_bytes", self.tools.max_line_bytes as u64)?;
        if self.tools.max_memory_bytes < self.tools.max_line_bytes {
            // A request of the longest allowed line could never be held.
            return Err(ConfigError::Value {
                key: "tools.max_memory_bytes",
                reason: "must be at least tools.max_line_bytes".into(),
            });
        }
        if m.cpu_shares < 2 {
            return Err(ConfigError::Value {
                key: "limits.max.cpu_shares",
                reason: "the kernel's minimum is 2".into(),
            });
        }
        Ok(())
    }

    /// Tokens, the host uid range, the cgroup parent, the upload endpoint and the state directory.
    fn validate_host(&self) -> Result<(), ConfigError> {
        for t in &self.auth.tokens {
            if t.len() < 16 {
                return Err(ConfigError::Value {
                    key: "auth.tokens",
                    reason: "every token must be at least 16 characters".into(),
                });
            }
        }
        let uids = self.uid_count() + self.agents.max_sandboxes;
        if self.sandbox.uid_base == 0
            || u32::try_from(uids)
                .ok()
                .and_then(|n| self.sandbox.uid_base.checked_add(n))
                .is_none()
        {
            return Err(ConfigError::Value {
                key: "sandbox.uid_base",
                reason: format!(
                    "must be a non-zero uid with room for {uids} uids (2 x max_concurrent + pool size + 4 + agents.max_sandboxes)"
                ),
            });
        }
        runtime::cgroups::Cgroups::with_version(
            runtime::cgroups::CgroupVersion::V1,
            &self.sandbox.cgroup_root,
            &self.sandbox.cgroup_parent,
        )
        .map_err(|e| ConfigError::Value {
            key: "sandbox.cgroup_parent",
            reason: runtime::error::Chain(&e).to_string(),
        })?;
        if let Some(u) = &self.artifacts.upload {
            u.validate().map_err(|e| ConfigError::Value {
                key: "artifacts.upload.url",
                reason: runtime::error::Chain(&e).to_string(),
            })?;
        }
        if !self.state_dir.is_absolute() {
            return Err(ConfigError::Value {
                key: "state_dir",
                reason: "must be an absolute path".into(),
            });
        }
        Ok(())
    }

    /// An image's preload list names modules of the one interpreter (python or node) that runs on it.
    fn validate_preload(&self, name: &str, image: &ImageConfig) -> Result<(), ConfigError> {
        if image.preload.is_empty() {
            return Ok(());
        }
        let on_image = |lang: Language| {
            self.languages
                .iter()
                .flatten()
                .any(|(l, c)| *l == lang && c.image == name)
        };
        let (python, node) = (on_image(Language::Python), on_image(Language::Javascript));
        let refused = |reason: String| ConfigError::Value {
            key: "images",
            reason: format!("images.{name}.preload: {reason}"),
        };
        if python && node {
            return Err(refused(
                "python and javascript both run on this image; a preload list is for one interpreter".into(),
            ));
        }
        let (valid, kind): (fn(&str) -> bool, &str) = match (python, node) {
            (false, true) => (node_module_name, "a node module name"),
            (true, false) => (python_module_name, "a dotted python module name"),
            _ => (
                |m| python_module_name(m) || node_module_name(m),
                "a python or node module name",
            ),
        };
        match image.preload.iter().find(|m| !valid(m)) {
            Some(m) => Err(refused(format!("{m:?} is not {kind}"))),
            None => Ok(()),
        }
    }

    /// Image names and digests, and the languages that run on them.
    fn validate_images(&self) -> Result<(), ConfigError> {
        for (name, image) in &self.images {
            if !image_store::valid_name(name) {
                return Err(ConfigError::Value {
                    key: "images",
                    reason: image_store::ImageError::InvalidName(name.clone()).to_string(),
                });
            }
            self.validate_preload(name, image)?;
            if let Some(d) = &image.digest {
                if image_store::Sha256::parse(d).is_none() {
                    return Err(ConfigError::Value {
                        key: "images",
                        reason: format!("images.{name}.digest {d:?} is not sha256:<64 hex>"),
                    });
                }
            }
        }
        for (lang, l) in self.languages.iter().flatten() {
            if l.image != "host" && !self.images.contains_key(&l.image) {
                return Err(ConfigError::Value {
                    key: "languages",
                    reason: format!(
                        "languages.{lang}.image {:?} is neither \"host\" nor a name under images",
                        l.image
                    ),
                });
            }
            if !l.command.first().is_some_and(|p| p.starts_with('/')) {
                return Err(ConfigError::Value {
                    key: "languages",
                    reason: format!(
                        "languages.{lang}.command must start with the interpreter's absolute path"
                    ),
                });
            }
        }
        if self.languages.as_ref().is_some_and(|l| l.is_empty()) {
            return Err(ConfigError::Value {
                key: "languages",
                reason: "lists no language; leave it out to use the host image's".into(),
            });
        }
        Ok(())
    }
}

/// `key` must be at least 1.
fn positive(key: &'static str, v: u64) -> Result<(), ConfigError> {
    if v == 0 {
        Err(ConfigError::Value {
            key,
            reason: "must be at least 1".into(),
        })
    } else {
        Ok(())
    }
}

/// Whether `name` is a node module name `require` finds among installed modules, as `images.<name>.preload` lists
/// them for javascript: a package (`lodash`, `@scope/pkg`) or a built-in (`zlib`, `node:zlib`), with an optional
/// subpath (`lodash/fp`); never a relative or absolute path.
fn node_module_name(name: &str) -> bool {
    let name = name.strip_prefix("node:").unwrap_or(name);
    let body = name.strip_prefix('@').unwrap_or(name);
    !body.is_empty()
        && !body.starts_with('.')
        && body.split('/').all(|part| {
            !part.is_empty()
                && part != "."
                && part != ".."
                && part
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || "-._~".contains(c))
        })
}

/// Whether `name` is a dotted python module name (`pandas`, `os.path`), as `images.<name>.preload` lists them.
fn python_module_name(name: &str) -> bool {
    name.split('.').all(|part| {
        let mut chars = part.chars();
        chars
            .next()
            .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
            && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The Kubernetes ConfigMap's config.yaml is one the daemon accepts, listening on every address at the port
    /// the DaemonSet names `fsp`, and its drain ends before the pod's termination grace period does.
    #[test]
    fn the_kubernetes_config_map_is_accepted() {
        let doc = |text: &str| -> serde_yaml_ng::Value { serde_yaml_ng::from_str(text).unwrap() };
        let map = doc(include_str!("../../deploy/kubernetes/configmap.yaml"));
        let text = map["data"]["config.yaml"].as_str().unwrap();
        let config = Config::parse(text).unwrap();
        let daemonset = doc(include_str!("../../deploy/kubernetes/daemonset.yaml"));
        let pod = &daemonset["spec"]["template"]["spec"];
        let container = &pod["containers"][0];
        let port = &container["ports"][0];
        assert_eq!(port["name"].as_str(), Some("fsp"));
        assert_eq!(
            config.listen,
            SocketAddr::from(([0, 0, 0, 0], port["containerPort"].as_u64().unwrap() as u16))
        );
        assert_eq!(
            config.state_dir,
            Path::new(
                container["volumeMounts"]
                    .as_sequence()
                    .unwrap()
                    .iter()
                    .find(|m| m["name"] == "state")
                    .unwrap()["mountPath"]
                    .as_str()
                    .unwrap()
            )
        );
        // The drain, then the connections' last messages, then 10 s for the rest of the exit (the helpers'
        // removals are bounded by that).
        let grace_s = pod["terminationGracePeriodSeconds"].as_u64().unwrap();
        let close_ms = CONNECTIONS_CLOSE.as_millis() as u64;
        assert!(
            config.shutdown_grace_ms + close_ms + 10_000 <= grace_s * 1000,
            "shutdown_grace_ms {} and {close_ms} ms for the connections leave less than 10 s of the {grace_s} s \
             grace period",
            config.shutdown_grace_ms
        );
    }

    /// The configuration reference (`docs/configuration.md`) is every key with its default: it must parse (so it
    /// names no unknown key) and equal `Config::default()`.
    #[test]
    fn the_configuration_reference_matches_the_defaults() {
        let readme = include_str!("../../docs/configuration.md");
        let start = readme
            .find("<!-- config-reference-begin -->")
            .expect("begin marker");
        let end = readme
            .find("<!-- config-reference-end -->")
            .expect("end marker");
        let block = &readme[start..end];
        let yaml = block
            .split("```yaml")
            .nth(1)
            .and_then(|b| b.split("```").next())
            .expect("yaml block");
        let documented = Config::parse(yaml).unwrap();
        assert_eq!(
            format!("{documented:?}"),
            format!("{:?}", Config::default())
        );
        // Every top-level and nested key of the real config appears in the block.
        let mut keys = Vec::new();
        collect_keys(
            &serde_yaml_ng::to_value(DefaultsView::from(&Config::default())).unwrap(),
            &mut keys,
        );
        for k in keys {
            assert!(
                yaml.contains(&format!("{k}:")),
                "docs/configuration.md lacks {k}"
            );
        }
    }

    /// A serializable mirror of the config, for listing its keys.
    #[derive(serde::Serialize)]
    struct DefaultsView {
        listen: String,
        metrics_listen: Option<String>,
        state_dir: PathBuf,
        auth: std::collections::BTreeMap<&'static str, Vec<String>>,
        capacity: std::collections::BTreeMap<&'static str, usize>,
        limits: std::collections::BTreeMap<&'static str, Limits>,
        shutdown_grace_ms: u64,
        max_frame_bytes: usize,
        sandbox: std::collections::BTreeMap<&'static str, String>,
        artifacts: std::collections::BTreeMap<&'static str, Option<u64>>,
        images: std::collections::BTreeMap<String, String>,
        languages: Option<u8>,
        pool: std::collections::BTreeMap<&'static str, Option<usize>>,
        agents: std::collections::BTreeMap<&'static str, String>,
        telemetry: std::collections::BTreeMap<&'static str, Option<String>>,
        e2b: std::collections::BTreeMap<&'static str, Option<String>>,
    }

    impl From<&Config> for DefaultsView {
        fn from(c: &Config) -> Self {
            Self {
                listen: c.listen.to_string(),
                metrics_listen: c.metrics_listen.map(|a| a.to_string()),
                state_dir: c.state_dir.clone(),
                auth: [("tokens", c.auth.tokens.clone())].into(),
                capacity: [
                    ("max_concurrent", c.capacity.max_concurrent),
                    ("max_queue", c.capacity.max_queue),
                ]
                .into(),
                limits: [("max", c.limits.max)].into(),
                shutdown_grace_ms: c.shutdown_grace_ms,
                max_frame_bytes: c.max_frame_bytes,
                sandbox: [
                    ("cgroup_parent", c.sandbox.cgroup_parent.clone()),
                    ("cgroup_root", c.sandbox.cgroup_root.display().to_string()),
                    ("uid_base", c.sandbox.uid_base.to_string()),
                    ("nofile", c.sandbox.nofile.to_string()),
                    ("landlock_min_abi", c.sandbox.landlock_min_abi.to_string()),
                ]
                .into(),
                artifacts: [
                    ("max_files", Some(c.artifacts.max_files as u64)),
                    ("max_file_bytes", Some(c.artifacts.max_file_bytes)),
                    ("max_total_bytes", Some(c.artifacts.max_total_bytes)),
                    ("retention_s", Some(c.artifacts.retention_s)),
                    ("max_store_bytes", Some(c.artifacts.max_store_bytes)),
                    ("upload", None),
                ]
                .into(),
                images: Default::default(),
                languages: None,
                pool: [("size", c.pool.size), ("helpers", c.pool.helpers)].into(),
                e2b: [
                    ("listen", c.e2b.listen.map(|a| a.to_string())),
                    ("base_image", Some(c.e2b.base_image.clone())),
                    (
                        "code_interpreter_image",
                        c.e2b.code_interpreter_image.clone(),
                    ),
                    ("memory_mb", Some(c.e2b.memory_mb.to_string())),
                    ("cpu_count", Some(c.e2b.cpu_count.to_string())),
                    ("disk_mb", Some(c.e2b.disk_mb.to_string())),
                    ("pids_max", Some(c.e2b.pids_max.to_string())),
                    ("max_upload_mb", Some(c.e2b.max_upload_mb.to_string())),
                    ("fleet", c.e2b.fleet.as_ref().map(|f| format!("{f:?}"))),
                ]
                .into(),
                agents: [
                    ("max_sandboxes", c.agents.max_sandboxes.to_string()),
                    ("cpu_cores", c.agents.cpu_cores.to_string()),
                    ("memory_mb", c.agents.memory_mb.to_string()),
                    ("disk_mb", c.agents.disk_mb.to_string()),
                    ("timeout_ms", c.agents.timeout_ms.to_string()),
                    ("pids_max", c.agents.pids_max.to_string()),
                    ("max_body_bytes", c.agents.max_body_bytes.to_string()),
                    ("upload_attempts", c.agents.upload_attempts.to_string()),
                    ("max_line_bytes", c.agents.max_line_bytes.to_string()),
                    ("queue_bytes", c.agents.queue_bytes.to_string()),
                    ("queue_events", c.agents.queue_events.to_string()),
                    ("replay_bytes", c.agents.replay_bytes.to_string()),
                ]
                .into(),
                telemetry: [
                    ("otlp_endpoint", c.telemetry.otlp_endpoint.clone()),
                    ("protocol", Some("http/protobuf".into())),
                    (
                        "sampling_ratio",
                        Some(c.telemetry.sampling_ratio.to_string()),
                    ),
                    ("resource_attributes", None),
                ]
                .into(),
            }
        }
    }

    fn collect_keys(v: &serde_yaml_ng::Value, out: &mut Vec<String>) {
        if let serde_yaml_ng::Value::Mapping(m) = v {
            for (k, v) in m {
                if let Some(k) = k.as_str() {
                    out.push(k.to_owned());
                }
                collect_keys(v, out);
            }
        }
    }

    #[test]
    fn empty_file_is_all_defaults() {
        let c = Config::parse("").unwrap();
        assert_eq!(c.listen.to_string(), DEFAULT_LISTEN);
        assert_eq!(c.capacity.max_concurrent, DEFAULT_MAX_CONCURRENT);
        assert_eq!(c.limits.max, DEFAULT_MAX_LIMITS);
    }

    #[test]
    fn full_file_parses() {
        let c = Config::parse(
            "listen: 0.0.0.0:9000\nstate_dir: /srv/sbx\nauth:\n  tokens: [\"0123456789abcdef0123\"]\n\
             capacity: {max_concurrent: 2, max_queue: 0}\nlimits:\n  max: {memory_mb: 512, timeout_ms: 1000, cpu_cores: 0.5}\n\
             shutdown_grace_ms: 5\nsandbox: {cgroup_parent: sbx-test, uid_base: 300000}\n",
        )
        .unwrap();
        assert_eq!(c.listen.port(), 9000);
        assert_eq!(c.capacity.max_queue, 0);
        assert_eq!(c.limits.max.memory_mb, 512);
        assert_eq!(c.limits.max.pids_max, DEFAULT_MAX_LIMITS.pids_max);
        assert_eq!(
            c.limits.max.cpu_cores.map(protocol::CpuCores::get),
            Some(0.5)
        );
        assert_eq!(c.sandbox.cgroup_parent, "sbx-test");
    }

    #[test]
    fn a_btrfs_workspace_store_must_hold_every_quota_at_once() {
        let c = Config::parse("agents: {workspace_store: btrfs}\n").unwrap();
        assert_eq!(c.agents.workspace_store_mb, 65536);
        // (16 + 32) x 1024 x 1.25 = 61440.
        assert!(
            Config::parse("agents: {workspace_store: btrfs, workspace_store_mb: 61440}\n").is_ok()
        );
        let e = Config::parse("agents: {workspace_store: btrfs, workspace_store_mb: 61439}\n")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("agents.workspace_store_mb") && e.contains("61440"),
            "{e}"
        );
        // The tmpfs store has no file to size.
        assert!(Config::parse("agents: {workspace_store_mb: 1}\n").is_ok());
        let e = Config::parse("agents: {workspace_store: zfs}\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("workspace_store"), "{e}");
    }

    #[test]
    fn live_restore_needs_the_direct_start_and_room_for_the_kept_descriptors() {
        assert!(Config::parse("agents: {live_restore: true}\n").is_ok());
        let e = Config::parse("agents: {live_restore: true}\nsandbox: {nofile: 32}\n")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("sandbox.nofile") && e.contains("live_restore"),
            "{e}"
        );
        assert!(
            Config::parse("sandbox: {nofile: 32}\n").is_ok(),
            "only with live restore"
        );
        let e = Config::parse("agents: {live_restore: true}\nsandbox: {start: libcontainer}\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("sandbox.start: direct"), "{e}");
    }

    #[test]
    fn unknown_key_is_named() {
        let e = Config::parse("capacity:\n  max_concurent: 3\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("max_concurent") && e.contains("capacity"), "{e}");
        let e = Config::parse("lisen: 1.2.3.4:5\n").unwrap_err().to_string();
        assert!(e.contains("lisen"), "{e}");
        let e = Config::parse("limits:\n  max:\n    memory_mib: 3\n")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("memory_mib") && e.contains("limits.max") && e.contains("line 3"),
            "{e}"
        );
    }

    #[test]
    fn preload_lists_module_names() {
        let c = Config::parse("images:\n  data: {preload: [numpy, pandas.core]}\n").unwrap();
        assert_eq!(c.images["data"].preload, ["numpy", "pandas.core"]);
        assert!(c.pool.warm, "warm interpreters are on by default");
        let e = Config::parse("images:\n  data: {preload: [\"numpy; import os\"]}\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("images.data.preload"), "{e}");
    }

    #[test]
    fn a_preload_list_names_modules_of_the_interpreter_on_its_image() {
        let parse = |yaml: &str| Config::parse(yaml).map_err(|e| e.to_string());
        let node = "languages:\n  javascript: {image: i, command: [/usr/bin/node]}\n";
        let python = "languages:\n  python: {image: i, command: [/usr/bin/python3]}\n";
        let image = |list: &str| format!("images:\n  i: {{preload: {list}}}\n");
        assert!(
            parse(&(image("[lodash, \"@scope/pkg\", lodash/fp, \"node:zlib\"]") + node)).is_ok()
        );
        let e = parse(&(image("[\"@scope/pkg\"]") + python)).unwrap_err();
        assert!(
            e.contains("images.i.preload") && e.contains("python"),
            "{e}"
        );
        for bad in ["\"./local\"", "\"/abs\"", "\"a/../b\"", "\"a b\"", "\"\""] {
            let e = parse(&(image(&format!("[{bad}]")) + node)).unwrap_err();
            assert!(e.contains("node module name"), "{bad}: {e}");
        }
        let both = format!(
            "{}languages:\n  javascript: {{image: i, command: [/usr/bin/node]}}\n  \
             python: {{image: i, command: [/usr/bin/python3]}}\n",
            image("[json]")
        );
        let e = parse(&both).unwrap_err();
        assert!(e.contains("both run on this image"), "{e}");
    }

    #[test]
    fn preload_names_are_dotted_module_names() {
        for ok in ["numpy", "os.path", "_private", "a1.b_2"] {
            assert!(python_module_name(ok), "{ok}");
        }
        for bad in ["", "1abc", "a..b", "a-b", "-c", "a b", "a.", "é"] {
            assert!(!python_module_name(bad), "{bad}");
        }
    }

    #[test]
    fn cpu_cores_below_the_kernel_minimum_is_refused() {
        let e = Config::parse("limits:\n  max:\n    cpu_cores: 0.001\n")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("limits.max.cpu_cores") && e.contains("at least 0.01"),
            "{e}"
        );
    }

    #[test]
    fn wrong_type_names_key_and_line() {
        let e = Config::parse("listen: 127.0.0.1:1\ncapacity:\n  max_queue: lots\n")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("capacity.max_queue") && e.contains("line 3"),
            "{e}"
        );
        let e = Config::parse("limits:\n  max:\n    pids_max: many\n")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("limits.max.pids_max") && e.contains("line 3"),
            "{e}"
        );
    }

    #[test]
    fn bad_values_are_named() {
        for (yaml, key) in [
            ("capacity: {max_concurrent: 0}", "capacity.max_concurrent"),
            ("limits: {max: {memory_mb: 0}}", "limits.max.memory_mb"),
            ("auth: {tokens: [short]}", "auth.tokens"),
            ("state_dir: relative/dir", "state_dir"),
            (
                "sandbox: {cgroup_parent: \"../escape\"}",
                "sandbox.cgroup_parent",
            ),
            ("agents: {max_line_bytes: 0}", "agents.max_line_bytes"),
            (
                "network: {allow_networks: [198.18.3.0/33]}",
                "network.allow_networks",
            ),
            (
                "network: {allow_networks: [127.0.0.0/8]}",
                "network.allow_networks",
            ),
            ("agents: {queue_events: 0}", "agents.queue_events"),
            // Budgets that could not hold one event of max_line_bytes are refused, not left to drop everything.
            ("agents: {queue_bytes: 1048576}", "agents.queue_bytes"),
            ("agents: {replay_bytes: 2097152}", "agents.replay_bytes"),
            (
                "tools: {max_line_bytes: 4096, max_memory_bytes: 4095}",
                "tools.max_memory_bytes",
            ),
        ] {
            let e = Config::parse(yaml).unwrap_err().to_string();
            assert!(e.contains(key), "{yaml}: {e}");
        }
    }
}

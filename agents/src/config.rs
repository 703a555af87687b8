//! The `agents:` block of sandboxd's configuration (the daemon's `Config` embeds it) and the byte budgets derived
//! from it. Its checks (positive values, room for one event in the queue and each log half) run with the rest of
//! the configuration's in sandboxd.

use serde::Deserialize;

/// Sandboxes at once by default.
pub const DEFAULT_MAX_SANDBOXES: usize = 16;
/// Longest control line an agent may write, bytes.
pub const DEFAULT_AGENT_MAX_LINE_BYTES: u64 = 1 << 20;
/// Event bytes queued for a sandbox's gateway.
pub const DEFAULT_AGENT_QUEUE_BYTES: u64 = 4 << 20;
/// Events queued for a sandbox's gateway (the adapter-shim contract's 1000).
pub const DEFAULT_AGENT_QUEUE_EVENTS: usize = 1000;
/// Bytes of a sandbox's on-disk replay log.
pub const DEFAULT_AGENT_REPLAY_BYTES: u64 = 32 << 20;
/// Room for sandboxd's stamps (`sourceEventId`, `sourceSequence`, `sourceOccurredAt`, `runId`) around an agent's
/// line: an event over `max_line_bytes` plus this is replaced by an `ErrorEvent`.
pub const AGENT_STAMP_BYTES: u64 = 16 << 10;
/// What a queued agent event costs beyond its JSON (its slot, pointer and bookkeeping).
pub const AGENT_QUEUED_OVERHEAD: u64 = 64;

/// `agents:`
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AgentsConfig {
    /// Agent sandboxes at once; `POST /sandboxes` beyond it is refused (`provider_unavailable`, retryable). Their
    /// host uids follow the executions' containers': `uid_base + uid_count() + n`.
    pub max_sandboxes: usize,
    /// The largest, and default, CPU quota of a sandbox, cores.
    pub cpu_cores: f64,
    /// The largest, and default, memory of a sandbox, MiB.
    pub memory_mb: u64,
    /// The largest, and default, size of a sandbox's `/workspace` + `/tmp` tmpfs, MiB.
    pub disk_mb: u64,
    /// The largest, and default, lifetime of a sandbox, ms.
    pub timeout_ms: u64,
    /// Processes and threads of a sandbox.
    pub pids_max: u64,
    /// Largest request body of the agent endpoints.
    pub max_body_bytes: usize,
    /// Upload attempts per artifact.
    pub upload_attempts: u32,
    /// Longest control line an agent may write; a longer one is skipped with a warning `ErrorEvent`
    /// (`control_line_too_long`) and the run goes on.
    pub max_line_bytes: u64,
    /// Event bytes (JSON, plus a small overhead per event) queued for a sandbox's gateway, connected or not; over
    /// it, low-priority events are dropped first, else the oldest (they stay in the replay log).
    pub queue_bytes: u64,
    /// Events queued for a sandbox's gateway, connected or not; over it, as over `queue_bytes`, low-priority
    /// events are dropped first, else the oldest.
    pub queue_events: usize,
    /// Bytes of a sandbox's on-disk replay log: two segments of half of it; the newest half is always there.
    pub replay_bytes: u64,
    /// The largest volume (`POST /volumes`), MiB.
    pub volume_max_mb: u64,
    /// Volumes at once; `POST /volumes` beyond it is refused (`provider_unavailable`, retryable).
    pub max_volumes: usize,
    /// Snapshots at once (`POST /sandboxes/<id>/snapshot`, fork); beyond it a snapshot is refused
    /// (`provider_unavailable`, retryable). Each holds at most a sandbox's `disk_mb` on the state disk.
    pub max_snapshots: usize,
    /// Agent sandboxes outlive the daemon (Docker's `live-restore`): a daemon that is stopped, killed or upgraded
    /// leaves their agents running, and the next daemon on the same `state_dir` takes them back (their runs,
    /// cgroups, control connections, event logs and sequence numbers). Off: they end with the daemon.
    pub live_restore: bool,
    /// Where `/workspace` lives: `tmpfs` (in memory, with `/tmp`; a snapshot copies it) or `btrfs` (a directory
    /// of its own with a quota in a btrfs filesystem in `<state_dir>/workspaces`: a snapshot or a fork copies
    /// nothing).
    pub workspace_store: WorkspaceStore,
    /// Size of the btrfs store's file (sparse), MiB: every workspace and snapshot together.
    pub workspace_store_mb: u64,
}

/// `agents.workspace_store`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum WorkspaceStore {
    /// A tmpfs per sandbox.
    #[default]
    Tmpfs,
    /// A btrfs subvolume per sandbox.
    Btrfs,
}

impl Default for AgentsConfig {
    fn default() -> Self {
        Self {
            max_sandboxes: DEFAULT_MAX_SANDBOXES,
            cpu_cores: 2.0,
            memory_mb: 4096,
            disk_mb: 1024,
            timeout_ms: 3_600_000,
            pids_max: 512,
            max_body_bytes: 1 << 20,
            upload_attempts: 4,
            max_line_bytes: DEFAULT_AGENT_MAX_LINE_BYTES,
            queue_bytes: DEFAULT_AGENT_QUEUE_BYTES,
            queue_events: DEFAULT_AGENT_QUEUE_EVENTS,
            replay_bytes: DEFAULT_AGENT_REPLAY_BYTES,
            volume_max_mb: 1024,
            max_volumes: 32,
            max_snapshots: 32,
            live_restore: false,
            workspace_store: WorkspaceStore::Tmpfs,
            workspace_store_mb: 65536,
        }
    }
}

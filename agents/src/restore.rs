//! Live restore (`agents.live_restore`): what a daemon keeps of each agent sandbox so that the next daemon on the
//! same `state_dir` takes it back, and the reading of it at start.
//!
//! Each sandbox's directory (`<state_dir>/agents/<id>/`) holds `sandbox.json`, a [`Record`]: what the sandbox was
//! created with, the state its operations changed (status, pending decisions, checkpoint, brief), and its live run
//! (the run's container id, its init's pid and start time, the brief line). It is written (to a temporary file, then
//! renamed) whenever any of it changes. The event log (`events/`) is on disk already and gives the sequence
//! numbers back ([`crate::events::Hub::reopen`]).
//!
//! A run of a sandbox with live restore is *kept* ([`crate::container::RunPlan::keep`]): its init does not die with
//! the daemon, and it holds the control socket (the listener and the agent's connection) for the next daemon, which
//! adopts it ([`crate::container::Workspace::adopt_run`]). The daemon carries the sandboxes' mounts over into its
//! new mount namespace before anything else (sandboxd's `main`), and keeps the cgroups of the runs whose init is
//! still the one recorded ([`kept_runs`]).

use std::collections::BTreeSet;
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use agent_api::{AgentStatus, AgentTemplate, SandboxBootstrap};
use runtime::init::ProgramExit;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::container::InitIdentity;

/// The record's file in a sandbox's directory.
pub const RECORD: &str = "sandbox.json";
/// The record format this daemon writes; a record of another version is not adopted (the sandbox is removed).
pub const VERSION: u32 = 1;

/// What a daemon keeps of a sandbox for the next one.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Record {
    /// [`VERSION`].
    pub version: u32,
    /// Sandbox id.
    pub id: String,
    /// The agent.
    pub agent_id: String,
    /// CPU quota, cores.
    pub cpu_cores: f64,
    /// Memory, MiB.
    pub memory_mb: u64,
    /// Workspace tmpfs, MiB.
    pub disk_mb: u64,
    /// Lifetime, ms.
    pub timeout_ms: u64,
    /// The template it was created with.
    pub template: AgentTemplate,
    /// Its image.
    pub image: String,
    /// Its host uid.
    pub host_id: u32,
    /// When it was created, Unix ms.
    pub created_unix_ms: u64,
    /// Backend credentials as last renewed.
    pub bootstrap: SandboxBootstrap,
    /// The snapshot its workspace started from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from_snapshot: Option<String>,
    /// It was created with volume mounts (not adopted yet: removed at restore).
    #[serde(default)]
    pub mounts: bool,
    /// It was created with `network` (not adopted yet: removed at restore).
    #[serde(default)]
    pub network: bool,
    /// Runs started so far (the next run's container id follows it).
    pub runs: u64,
    /// The agent's status.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<AgentStatus>,
    /// The status to return to on resume.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub before_pause: Option<AgentStatus>,
    /// The current (or last) run.
    #[serde(default)]
    pub run_id: String,
    /// Decisions the agent waits for.
    #[serde(default)]
    pub pending_decisions: BTreeSet<String>,
    /// The agent's last checkpoint and conversation summary.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checkpoint: Option<(Value, Option<String>)>,
    /// How the last run ended.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_exit: Option<ProgramExit>,
    /// The lifetime is over.
    #[serde(default)]
    pub expired: bool,
    /// The brief the run was spawned with (as changed by `update-brief`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub brief: Option<Map<String, Value>>,
    /// The live run.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run: Option<RunRecord>,
}

/// A live, kept run.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RunRecord {
    /// Its container id (and cgroup leaf).
    pub cid: String,
    /// Its init.
    pub init: InitIdentity,
    /// The brief line, for an agent that had not connected yet.
    pub brief_line: String,
    /// The agent had connected (its connection is held by the init).
    pub connected: bool,
}

/// Writes `record` into `dir` (a temporary file renamed over the old one; readable by root only: it holds the
/// backend token).
pub fn save(dir: &Path, record: &Record) -> std::io::Result<()> {
    let bytes = serde_json::to_vec(record).map_err(std::io::Error::other)?;
    save_bytes(dir, &bytes)
}

/// [`save`] of an encoded record.
pub fn save_bytes(dir: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let tmp = dir.join(format!("{RECORD}.tmp"));
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&tmp)?;
    f.write_all(bytes)?;
    drop(f);
    std::fs::rename(&tmp, dir.join(RECORD))
}

/// The record in `dir`.
pub fn load(dir: &Path) -> std::io::Result<Record> {
    let bytes = std::fs::read(dir.join(RECORD))?;
    let record: Record = serde_json::from_slice(&bytes).map_err(std::io::Error::other)?;
    if record.version != VERSION {
        return Err(std::io::Error::other(format!(
            "record version {} (this daemon reads {VERSION})",
            record.version
        )));
    }
    Ok(record)
}

/// Whether this daemon takes such a sandbox back. A sandbox with volume mounts is not (yet): its volumes are
/// mounted again at the start, and an ext4 volume must never be mounted twice at once, so its run is ended and its
/// mounts are left behind before that; one with `network` is not either (its proxy's byte budget is not recorded).
pub fn adoptable(record: &Record) -> bool {
    !record.mounts && !record.network
}

/// The sandbox directories under `agents` whose record this daemon takes back ([`adoptable`]): what a daemon with
/// live restore carries over into its mount namespace.
pub fn carried(agents: &Path) -> Vec<PathBuf> {
    recorded(agents)
        .into_iter()
        .filter(|d| load(d).is_ok_and(|r| adoptable(&r)))
        .collect()
}

/// The sandbox directories under `agents` (`<state_dir>/agents`) that hold a record.
pub fn recorded(agents: &Path) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(agents) else {
        return Vec::new();
    };
    let mut dirs: Vec<PathBuf> = entries
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.join(RECORD).is_file())
        .collect();
    dirs.sort();
    dirs
}

/// The container ids of the recorded live runs of sandboxes taken back ([`adoptable`]) whose init is still the
/// recorded process: their cgroups are not leftovers (the others' are removed with their processes).
pub fn kept_runs(agents: &Path) -> Vec<String> {
    recorded(agents)
        .iter()
        .filter_map(|d| load(d).ok().filter(adoptable)?.run)
        .filter(|r| runtime::sys::start_time(r.init.pid) == Some(r.init.start))
        .map(|r| r.cid)
        .collect()
}

/// Kills a recorded run's init if it is still the recorded process (a run that cannot be taken back).
pub fn kill_init(init: InitIdentity) {
    let pid = nix::unistd::Pid::from_raw(init.pid);
    let Ok(pidfd) = runtime::sys::pidfd_open(pid) else {
        return;
    };
    if runtime::sys::start_time(init.pid) == Some(init.start) {
        let _ = runtime::sys::pidfd_send_signal(
            std::os::fd::AsFd::as_fd(&pidfd),
            nix::sys::signal::Signal::SIGKILL,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record() -> Record {
        Record {
            version: VERSION,
            id: "ags-1".into(),
            agent_id: "a".into(),
            cpu_cores: 1.0,
            memory_mb: 256,
            disk_mb: 64,
            timeout_ms: 60_000,
            template: AgentTemplate::default(),
            image: "host".into(),
            host_id: 1234,
            created_unix_ms: 1,
            bootstrap: serde_json::from_value(serde_json::json!({
                "backendUrl": "http://127.0.0.1:1",
                "backendToken": "secret",
                "tokenExpiresAt": "2030-01-01T00:00:00Z",
                "agentId": "a",
                "artifactUploadEndpoint": "http://127.0.0.1:1/up",
            }))
            .unwrap(),
            from_snapshot: None,
            mounts: false,
            network: false,
            runs: 2,
            status: Some(AgentStatus::Running),
            before_pause: None,
            run_id: "r".into(),
            pending_decisions: BTreeSet::from(["d1".to_owned()]),
            checkpoint: None,
            last_exit: None,
            expired: false,
            brief: None,
            run: Some(RunRecord {
                cid: "ags-1-2".into(),
                init: InitIdentity {
                    pid: std::process::id() as i32,
                    start: runtime::sys::start_time(std::process::id() as i32).unwrap(),
                },
                brief_line: "{}\n".into(),
                connected: true,
            }),
        }
    }

    #[test]
    fn a_record_round_trips_and_names_only_live_runs() {
        let t = tempfile::tempdir().unwrap();
        let live = t.path().join("ags-1");
        std::fs::create_dir(&live).unwrap();
        let r = record();
        save(&live, &r).unwrap();
        assert_eq!(load(&live).unwrap(), r);
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(live.join(RECORD))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600, "the token is root's only");
        // A run whose pid now starts at another time is another process: not kept.
        let gone = t.path().join("ags-2");
        std::fs::create_dir(&gone).unwrap();
        let mut other = record();
        other.id = "ags-2".into();
        if let Some(run) = other.run.as_mut() {
            run.cid = "ags-2-1".into();
            run.init.start += 1;
        }
        save(&gone, &other).unwrap();
        std::fs::create_dir(t.path().join("no-record")).unwrap();
        assert_eq!(recorded(t.path()).len(), 2);
        assert_eq!(kept_runs(t.path()), vec!["ags-1-2".to_owned()]);
        // A sandbox with volume mounts is not taken back: its run is not kept, its mounts not carried.
        let mut mounted = record();
        mounted.mounts = true;
        save(&live, &mounted).unwrap();
        assert!(kept_runs(t.path()).is_empty());
        assert_eq!(carried(t.path()), vec![gone.clone()]);
        save(&live, &r).unwrap();
        // Another version is refused.
        let mut v2 = record();
        v2.version = VERSION + 1;
        save(&live, &v2).unwrap();
        assert!(load(&live).is_err());
    }
}

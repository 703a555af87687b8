//! Live restore (`agents.live_restore`): what a daemon keeps of each agent sandbox so that the next daemon on the
//! same `state_dir` takes it back, and the reading of it at start.
//!
//! Each sandbox's directory (`<state_dir>/agents/<id>/`) holds `sandbox.json`, a [`Record`]: what the sandbox was
//! created with, the state its operations changed (status, pending decisions, checkpoint, brief), and its live run
//! (the run's container id, its init's pid and start time, the brief line). It is written (to a temporary file, then
//! renamed) whenever any of it changes. The event log (`events/`) is on disk already and gives the sequence
//! numbers back ([`crate::events::Hub::reopen`]).
//!
//! A run of a sandbox with live restore is *kept* ([`containers::agent::RunPlan::keep`]): its init does not die with
//! the daemon, and it holds the control socket (the listener and the agent's connection) for the next daemon, which
//! adopts it ([`containers::agent::Workspace::adopt_run`]). The daemon carries the sandboxes' mounts over into its
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

use crate::volumes::Mounted;
use containers::agent::InitIdentity;

/// The record's file in a sandbox's directory.
pub const RECORD: &str = "sandbox.json";
/// The mark of a sandbox whose mounts were not carried over ([`mark_lost`]).
const LOST: &str = "mounts-lost";
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
    pub cpu_cores: protocol::CpuCores,
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
    /// Its `/workspace` is in the copy-on-write store (`ws/<id>`), bound into its tmpfs.
    #[serde(default)]
    pub cow: bool,
    /// It was created with volume mounts.
    #[serde(default)]
    pub mounts: bool,
    /// Those mounts (a record of an earlier daemon has `mounts` without them: not taken back).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub volumes: Vec<Mounted>,
    /// It was created with `network`.
    #[serde(default)]
    pub network: bool,
    /// Its egress is kept in `egress.json` and `egress.reserved` ([`crate::network::EgressRecord`]; an earlier
    /// daemon's record has `network` without it: not taken back).
    #[serde(default)]
    pub egress: bool,
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
    write_private(dir, RECORD, bytes)
}

/// Writes `bytes` as file `name` of `dir`, readable by root only: a temporary file renamed over the old one, so a
/// reader (the next daemon) finds the old or the new content, never a part.
pub fn write_private(dir: &Path, name: &str, bytes: &[u8]) -> std::io::Result<()> {
    let tmp = dir.join(format!("{name}.tmp"));
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&tmp)?;
    f.write_all(bytes)?;
    drop(f);
    std::fs::rename(&tmp, dir.join(name))
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

/// Whether this daemon takes such a sandbox back: not when its record has `network` without a kept egress, or
/// volume mounts without naming them (both an earlier daemon's records). A sandbox with volumes is taken back with
/// each volume's own mount carried over from the previous daemon's namespace, so that the volume is never mounted a
/// second time while the agent's container holds it; one with `network` with its proxy made again from its
/// `egress.json`.
pub fn adoptable(record: &Record) -> bool {
    (!record.network || record.egress) && (!record.mounts || !record.volumes.is_empty())
}

/// Each volume mount of the sandboxes under `agents` that this daemon takes back ([`carried`]), with its
/// sandbox's id: the attachments the volumes start with (a writer among them is not a lost writer, so its volume
/// is not scanned).
pub fn held_volumes(agents: &Path) -> Vec<(String, Mounted)> {
    carried_records(agents)
        .into_iter()
        .flat_map(|(_, r)| {
            let id = r.id;
            r.volumes.into_iter().map(move |m| (id.clone(), m))
        })
        .collect()
}

/// Marks sandbox directory `dir` as not carried over: its mounts could not be moved into this daemon's namespace
/// (or there was no previous namespace to move them from). From then on it is not [`carried`]: its run is not kept
/// (it is ended with the leftovers, before any volume is mounted again), its volume mounts are not held, and it is
/// removed at restore.
pub fn mark_lost(dir: &Path) -> std::io::Result<()> {
    std::fs::write(dir.join(LOST), b"")
}

/// Takes [`mark_lost`]'s mark back (a start that failed after marking).
pub fn unmark_lost(dir: &Path) -> std::io::Result<()> {
    std::fs::remove_file(dir.join(LOST))
}

/// Whether [`mark_lost`] marked `dir`.
pub fn lost(dir: &Path) -> bool {
    dir.join(LOST).exists()
}

/// The sandbox directories under `agents` whose record this daemon takes back ([`adoptable`]) and whose mounts
/// were not lost ([`mark_lost`]): what a daemon with live restore carries over into its mount namespace.
pub fn carried(agents: &Path) -> Vec<PathBuf> {
    carried_records(agents)
        .into_iter()
        .map(|(d, _)| d)
        .collect()
}

/// [`carried`], each directory with its record (read once).
pub fn carried_records(agents: &Path) -> Vec<(PathBuf, Record)> {
    recorded(agents)
        .into_iter()
        .filter(|d| !lost(d))
        .filter_map(|d| {
            let r = load(&d).ok().filter(adoptable)?;
            Some((d, r))
        })
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

/// The container ids of the recorded live runs of sandboxes taken back ([`carried`]) whose init is still the
/// recorded process: their cgroups are not leftovers (the others' are removed with their processes, before any
/// volume is mounted again).
pub fn kept_runs(agents: &Path) -> Vec<String> {
    carried_records(agents)
        .into_iter()
        .filter_map(|(_, r)| r.run)
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
            cpu_cores: protocol::CpuCores::from_const(1.0),
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
            cow: false,
            mounts: false,
            volumes: Vec::new(),
            network: false,
            egress: false,
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
        // An earlier daemon's record of a sandbox with volume mounts does not name them: not taken back (its run
        // is not kept, its mounts not carried).
        let mut mounted = record();
        mounted.mounts = true;
        save(&live, &mounted).unwrap();
        assert!(kept_runs(t.path()).is_empty());
        assert_eq!(carried(t.path()), vec![gone.clone()]);
        // Named, they are taken back, and held for the volumes.
        mounted.volumes = vec![Mounted {
            volume: "vol-1".into(),
            path: "/workspace/data".into(),
            rel: "data".into(),
            read_only: false,
        }];
        save(&live, &mounted).unwrap();
        assert_eq!(kept_runs(t.path()), vec!["ags-1-2".to_owned()]);
        assert_eq!(carried(t.path()).len(), 2);
        let held = held_volumes(t.path());
        assert_eq!(held.len(), 1);
        assert_eq!(
            (held[0].0.as_str(), held[0].1.volume.as_str()),
            ("ags-1", "vol-1")
        );
        // One with network is not taken back unless its egress is kept.
        mounted.network = true;
        save(&live, &mounted).unwrap();
        assert!(kept_runs(t.path()).is_empty());
        mounted.egress = true;
        save(&live, &mounted).unwrap();
        assert_eq!(kept_runs(t.path()), vec!["ags-1-2".to_owned()]);
        // Nor one whose mounts were lost: its run is not kept, its volumes not held.
        (mounted.network, mounted.egress) = (false, false);
        save(&live, &mounted).unwrap();
        mark_lost(&live).unwrap();
        assert!(kept_runs(t.path()).is_empty());
        assert!(held_volumes(t.path()).is_empty());
        assert_eq!(carried(t.path()), vec![gone.clone()]);
        std::fs::remove_file(live.join(LOST)).unwrap();
        save(&live, &r).unwrap();
        // Another version is refused.
        let mut v2 = record();
        v2.version = VERSION + 1;
        save(&live, &v2).unwrap();
        assert!(load(&live).is_err());
    }
}

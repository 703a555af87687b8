//! A copy-on-write store of workspaces (`agents.workspace_store: btrfs`): each sandbox's `/workspace` is a
//! directory of the store of its own (`ws/<sandbox>`, a quota of its `diskMb`), a snapshot is a read-only copy of
//! one made in constant time (`snap/<id>`), and a sandbox started from a snapshot (`fromSnapshot`, fork) gets a
//! writable copy of it, again without copying a byte. Files are owned by 0 on disk and shown as the sandbox's root
//! through an idmapped bind ([`runtime::rootfs::Scratch::workspace_on`]), so any sandbox can start from any
//! snapshot whatever host uid wrote it.
//!
//! This trait is the kernel side, blocking calls each; the daemon implements it (on btrfs). Without a store, a
//! workspace is a tmpfs and a snapshot a copy ([`crate::snapshots`]).

use std::path::{Path, PathBuf};

/// Any error, boxed (from the daemon's side).
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The store's directories and operations.
pub trait CowStore: Send + Sync + 'static {
    /// Where sandbox `sandbox`'s workspace is (made by [`Self::create`]).
    fn workspace(&self, sandbox: &str) -> PathBuf;

    /// Where snapshot `id`'s files are (made by [`Self::snapshot`]).
    fn snapshot_path(&self, id: &str) -> PathBuf;

    /// Makes sandbox `sandbox`'s workspace of at most `bytes`: empty (its top directory owned by 0, mode 0755),
    /// or a writable copy of the snapshot at `from`.
    fn create(&self, sandbox: &str, bytes: u64, from: Option<&Path>) -> Result<PathBuf, BoxError>;

    /// Sets sandbox `sandbox`'s workspace's quota to `bytes` (again: a workspace taken back from a previous
    /// daemon).
    fn set_limit(&self, sandbox: &str, bytes: u64) -> Result<(), BoxError>;

    /// Makes snapshot `id`, a read-only copy of the workspace `workspace` as it is now.
    fn snapshot(&self, workspace: &Path, id: &str) -> Result<PathBuf, BoxError>;

    /// Removes a workspace or a snapshot, with whatever was made inside it. Removing what is not there succeeds.
    fn destroy(&self, path: &Path) -> Result<(), BoxError>;

    /// Bytes sandbox `sandbox`'s workspace counts against its quota now (its files, with those it shares with a
    /// snapshot), when the store can tell.
    fn used_bytes(&self, sandbox: &str) -> Option<u64>;

    /// The sandboxes that have a workspace here and the snapshots that have files here (leftovers are found so).
    fn list(&self) -> (Vec<String>, Vec<String>);
}

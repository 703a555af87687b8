//! The image a container's root is built from, and how a language runs on it: what the daemon resolves at start
//! (`images:` and `languages:`) and every container of the seam is created from.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;

use protocol::Environment;
use runtime::landlock::Policy;
use runtime::rootfs::HostImage;

/// What an execution's root is built from.
#[derive(Debug)]
pub enum RootKind {
    /// The shared host skeleton with its read-only binds.
    Host(HostImage),
    /// An overlay of unpacked layers, top first.
    Oci {
        /// overlayfs `lowerdir`s, top first.
        lowers: Vec<PathBuf>,
    },
}

/// An image executions run on.
#[derive(Debug)]
pub struct RootImage {
    /// `host` or the name under `images:`.
    pub name: String,
    /// What `environment.image_digest` says.
    pub digest: String,
    /// How the root is built.
    pub kind: RootKind,
    /// The landlock policy of programs on this image.
    pub landlock: Policy,
    /// The image config's `Env` (applied after sandboxd's defaults, before the request's).
    pub env: Vec<(String, String)>,
    /// Modules the warm interpreter imports before it waits (`images.<name>.preload`).
    pub preload: Vec<String>,
}

/// How a language runs.
#[derive(Debug, Clone)]
pub struct LanguageRuntime {
    /// The image.
    pub image: Arc<RootImage>,
    /// Interpreter and leading arguments (absolute program path); the code file's path is appended.
    pub command: Vec<String>,
    /// File name the code is written to under `CODE_DIR`.
    pub file_name: &'static str,
    /// The interpreter a pooled container's init starts ahead of time (the daemon's warm interpreters); `None`: none.
    pub warm: Option<runtime::launch::Launch>,
}

impl LanguageRuntime {
    /// The environment description sent in `ack` and `result`.
    pub fn environment(&self, seccomp_profile: &str) -> Environment {
        Environment {
            image: self.image.name.clone(),
            image_digest: self.image.digest.clone(),
            sandboxd_version: env!("CARGO_PKG_VERSION").into(),
            seccomp_profile: seccomp_profile.into(),
        }
    }
}

/// Every program's environment before its request's (or sandbox template's) own: sandboxd's base, then the
/// image's.
pub fn base_environment(image: &RootImage) -> BTreeMap<String, String> {
    let mut env: BTreeMap<String, String> = [
        ("PATH", "/usr/local/bin:/usr/bin:/bin"),
        ("HOME", runtime::rootfs::WORKDIR),
        ("TMPDIR", "/tmp"),
        ("LANG", "C.UTF-8"),
        ("PYTHONUNBUFFERED", "1"),
        ("PYTHONDONTWRITEBYTECODE", "1"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v.to_owned()))
    .collect();
    env.extend(image.env.iter().cloned());
    env
}

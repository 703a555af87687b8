//! Messages between the daemon and the helper ([`crate::ipc`] carries them).

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// A request from the daemon.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Request {
    /// Create a container from `<bundle>/config.json` and start its init, which then waits for the launch message.
    Create {
        /// Container id (daemon-generated, unique).
        id: String,
        /// Bundle directory.
        bundle: PathBuf,
        /// The landlock policy of the program (it depends on the image).
        landlock: crate::landlock::Policy,
        /// An interpreter the init starts ahead of time ([`crate::init::InitExecutor::warm`]).
        #[serde(default)]
        warm: Option<crate::launch::Launch>,
        /// The container outlives the helper and the daemon (an agent run under live restore): its init has no
        /// parent death signal, and the helper's shutdown leaves it running. Only its removal ends it.
        #[serde(default)]
        keep: bool,
    },
    /// Signal a container's init. The daemon normally signals through the pidfd it got with
    /// [`Event::Created`]; this is for callers that only know the id.
    Kill {
        /// Container id.
        id: String,
        /// Signal number.
        signal: i32,
    },
    /// Kill the container's init if it still runs, delete the container (cgroups, state) and reap the init.
    Remove {
        /// Container id.
        id: String,
    },
    /// Kill every container, clean up and exit.
    Shutdown,
}

/// An event from the helper about one container.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum Event {
    /// The container exists and its init waits for the launch message. Carries three descriptors: the daemon's end
    /// of the launch channel, the read end of the status pipe and a pidfd of the init.
    Created {
        /// Container id.
        id: String,
        /// Host pid of its init.
        pid: i32,
    },
    /// Creating failed; whatever was created is already removed.
    Failed {
        /// Container id.
        id: String,
        /// Why.
        message: String,
    },
    /// The container is deleted (cgroups, state) and its init reaped.
    Removed {
        /// Container id.
        id: String,
        /// A cleanup step that failed, if any.
        error: Option<String>,
    },
}

impl Event {
    /// The container the event is about.
    pub fn id(&self) -> &str {
        match self {
            Self::Created { id, .. } | Self::Failed { id, .. } | Self::Removed { id, .. } => id,
        }
    }
}

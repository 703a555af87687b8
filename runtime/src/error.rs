//! Errors of the runtime crate, one enum gathered from every module.

use std::path::PathBuf;

/// Result alias of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong while preparing, running or cleaning up a container.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A filesystem operation failed on a named path.
    #[error("I/O error on {path}")]
    Io {
        /// The path the operation was about.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// A system call failed.
    #[error("System call {call} failed")]
    Sys {
        /// What was called (and on what).
        call: String,
        /// The errno.
        #[source]
        source: nix::Error,
    },
    /// The host cannot enforce something sandboxd requires; sandboxd refuses to run rather than run weaker.
    #[error("Host does not support a required isolation feature: {0}")]
    Unsupported(String),
    /// The cgroup hierarchy is not usable.
    #[error("Cgroup error: {0}")]
    Cgroup(String),
    /// Building the OCI spec failed.
    #[error("Invalid container spec")]
    Spec(#[from] oci_spec::OciSpecError),
    /// libcontainer failed to create, start or delete a container.
    #[error("Container runtime error: {0}")]
    Container(String),
    /// A message between the daemon and the helper could not be encoded or decoded.
    #[error("Helper protocol error: {0}")]
    Protocol(String),
    /// The helper process is gone.
    #[error("The container helper process is gone")]
    HelperGone,
    /// Files given for the working directory do not fit or are malformed.
    #[error("Invalid input file {path}: {reason}")]
    InputFile {
        /// Path relative to the working directory.
        path: String,
        /// Why it was refused.
        reason: String,
    },
}

impl Error {
    /// Wraps an `io::Error` with the path it happened on.
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Self::Io {
            path: path.into(),
            source,
        }
    }

    /// Wraps an errno with the call that returned it.
    pub fn sys(call: impl Into<String>, source: nix::Error) -> Self {
        Self::Sys {
            call: call.into(),
            source,
        }
    }
}

//! Errors of the runtime crate: one enum per module ([`crate::cgroups::CgroupError`],
//! [`crate::caps::CapsError`], [`crate::landlock::LandlockError`], [`crate::seccomp::SeccompError`],
//! [`crate::rootfs::RootfsError`], [`crate::launch::LaunchError`], [`crate::helper::HelperError`]) gathered into
//! [`Error`], the error every public function returns.
//!
//! Messages follow one rule: a message says what failed and does not repeat its `#[source]`; [`Chain`] prints an
//! error with all its sources when the whole story has to fit on one line (a log field, a status pipe record).

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
    /// The cgroup hierarchy is not usable, or lacks a controller sandboxd requires.
    #[error(transparent)]
    Cgroup(#[from] crate::cgroups::CgroupError),
    /// The process holds capabilities it must not hold.
    #[error(transparent)]
    Caps(#[from] crate::caps::CapsError),
    /// Landlock cannot be enforced.
    #[error(transparent)]
    Landlock(#[from] crate::landlock::LandlockError),
    /// The seccomp profile cannot be compiled or installed.
    #[error(transparent)]
    Seccomp(#[from] crate::seccomp::SeccompError),
    /// An image's root cannot be mounted safely.
    #[error(transparent)]
    Rootfs(#[from] crate::rootfs::RootfsError),
    /// Building the OCI spec failed.
    #[error("Invalid container spec")]
    Spec(#[from] oci_spec::OciSpecError),
    /// The bundle's `config.json` could not be written.
    #[error("Cannot write the container spec {path}")]
    SaveSpec {
        /// Where it was to be written.
        path: PathBuf,
        /// Why it was not.
        #[source]
        source: oci_spec::OciSpecError,
    },
    /// libcontainer failed to build or start a container (in the helper process).
    #[error("Cannot {op} the container")]
    Container {
        /// The step that failed.
        op: ContainerOp,
        /// libcontainer's error.
        #[source]
        source: libcontainer::error::LibcontainerError,
    },
    /// libcontainer created a container but knows no pid for its init.
    #[error("The created container has no pid")]
    NoPid,
    /// A message on the launch channel could not be encoded, decoded or trusted.
    #[error(transparent)]
    Launch(#[from] crate::launch::LaunchError),
    /// The helper answered something unexpected, or could not create a container.
    #[error(transparent)]
    Helper(#[from] crate::helper::HelperError),
    /// The helper process is gone.
    #[error("The container helper process is gone")]
    HelperGone,
    /// A blocking task the daemon ran for a container panicked or was cancelled.
    #[error("The {task} task did not finish")]
    Task {
        /// What the task did.
        task: &'static str,
        /// Why it ended early.
        #[source]
        source: tokio::task::JoinError,
    },
    /// Files given for the working directory do not fit or are malformed.
    #[error("Invalid input file {path}: {reason}")]
    InputFile {
        /// Path relative to the working directory.
        path: String,
        /// Why it was refused.
        reason: String,
    },
}

/// The libcontainer step of [`Error::Container`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ContainerOp {
    /// Configuring the builder (state directory, id).
    Configure,
    /// Creating the container (namespaces, cgroup, rootfs, init).
    Create,
    /// Starting the created container's init.
    Start,
}

impl std::fmt::Display for ContainerOp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Configure => "configure",
            Self::Create => "create",
            Self::Start => "start",
        })
    }
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

    /// Wraps a failed `config.json` write.
    pub fn save_spec(path: impl Into<PathBuf>, source: oci_spec::OciSpecError) -> Self {
        Self::SaveSpec {
            path: path.into(),
            source,
        }
    }

    /// Wraps a libcontainer failure with the step it happened in.
    pub fn container(op: ContainerOp, source: libcontainer::error::LibcontainerError) -> Self {
        Self::Container { op, source }
    }
}

/// Displays an error followed by each of its sources, `": "`-separated, on one line: `Cannot create the container:
/// failed to ...: No such file or directory`.
pub struct Chain<'a>(pub &'a (dyn std::error::Error + 'static));

impl std::fmt::Display for Chain<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)?;
        let mut source = self.0.source();
        while let Some(e) = source {
            write!(f, ": {e}")?;
            source = e.source();
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chain_prints_every_source_once() {
        let e = Error::io(
            "/x",
            std::io::Error::new(std::io::ErrorKind::NotFound, "gone"),
        );
        assert_eq!(e.to_string(), "I/O error on /x");
        assert_eq!(Chain(&e).to_string(), "I/O error on /x: gone");
        let e = Error::from(crate::cgroups::CgroupError::InvalidParent("a/../b".into()));
        assert_eq!(Chain(&e).to_string(), e.to_string());
    }
}

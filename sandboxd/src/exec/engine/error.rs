//! Why an execution ended in `INTERNAL_ERROR`. The wire message and the log line both carry the whole chain
//! ([`runtime::error::Chain`]); refusals of the request itself (`INVALID_REQUEST`, `LANGUAGE_NOT_SUPPORTED`) are not
//! errors of the daemon and do not come through here.

use super::outcome::Unexplained;
use containers::{CreateError, LaunchError};

/// An execution the daemon could not carry out.
#[derive(Debug, thiserror::Error)]
pub enum ExecError {
    /// The daemon closed admission while the execution waited in the queue.
    #[error("The daemon is shutting down")]
    ShuttingDown,
    /// No container: the backend could not create one.
    #[error("Cannot create the container")]
    Create(#[source] CreateError),
    /// The tool broker could not be set up.
    #[error(transparent)]
    Tools(crate::extensions::tools::ToolsError),
    /// The egress proxy's entrance inside the container could not be opened (extension `network`).
    #[error("Cannot open the egress proxy inside the container")]
    Egress(#[source] std::io::Error),
    /// The blocking task writing the limits and inputs did not finish.
    #[error("Preparation panicked")]
    PreparePanicked(#[source] tokio::task::JoinError),
    /// The limits or the inputs could not be written.
    #[error("Cannot prepare the sandbox")]
    Prepare(#[source] runtime::Error),
    /// The program's stdio could not be created.
    #[error("Cannot create pipes")]
    Pipes(#[source] nix::Error),
    /// The program could not be handed to the init.
    #[error(transparent)]
    Launch(LaunchError),
    /// The container's end cannot be watched.
    #[error("Cannot watch the container")]
    Watch(#[source] std::io::Error),
    /// The init reported that it could not apply a restriction: the program did not run (fail closed).
    #[error("Sandbox setup failed: {0}")]
    Setup(String),
    /// The end of the shutdown grace period killed the execution.
    #[error("The daemon shut down before the execution finished")]
    ShutDown,
    /// The supervision ended without the container's end (cannot happen: the loop waits for it).
    #[error("No exit record")]
    NoExitRecord,
    /// The end cannot be classified.
    #[error(transparent)]
    Unexplained(Unexplained),
    /// The blocking collection task did not finish.
    #[error("Artifact collection panicked")]
    ArtifactsPanicked(#[source] tokio::task::JoinError),
    /// The requested artifacts could not be collected.
    #[error("Artifact collection failed")]
    Artifacts(#[source] ArtifactError),
}

/// Why the requested artifacts could not be collected.
#[derive(Debug, thiserror::Error)]
pub enum ArtifactError {
    /// The patterns are invalid (the server refuses them before the execution, so this is a bug).
    #[error(transparent)]
    Patterns(runtime::Error),
    /// Walking the working directory failed.
    #[error(transparent)]
    Collect(runtime::Error),
    /// The collected files could not be committed to the store.
    #[error("Cannot store artifacts")]
    Store(#[source] std::io::Error),
    /// The manifest could not be saved.
    #[error("Cannot save the manifest")]
    Manifest(#[source] std::io::Error),
}

//! Every call agent sandboxes make into the container runtime, in one place: create a container (its init then
//! waits on the launch channel), launch the agent, signal it, wait for its end and remove it.

use std::io::Read;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::path::Path;
use std::time::Duration;

use runtime::helper::{Created, HelperClient};
use runtime::init::{ProgramExit, Report};
use runtime::launch::Launch;
use tokio::io::unix::AsyncFd;

/// Why an agent's container could not be created, launched or signalled.
#[derive(Debug, thiserror::Error)]
pub enum ContainerError {
    /// The bundle's `config.json` could not be read.
    #[error("Cannot read the bundle")]
    Bundle(#[source] std::io::Error),
    /// The bundle's `config.json` is not JSON.
    #[error("Cannot parse the bundle")]
    BundleJson(#[source] serde_json::Error),
    /// The agent's stdio could not be duplicated.
    #[error("Cannot duplicate the agent's stdio")]
    Stdio(#[source] std::io::Error),
    /// The helper could not create the container.
    #[error("Cannot create the agent's container")]
    Create(#[source] runtime::Error),
    /// The container's pidfd could not be registered.
    #[error("Cannot watch the container")]
    Watch(#[source] std::io::Error),
    /// The cgroup refused the sandbox's cpu quota.
    #[error("Cannot enforce the cpu quota")]
    CpuQuota(#[source] runtime::Error),
    /// [`Container::start`] was called twice.
    #[error("The agent was launched already")]
    Launched,
    /// The init could not confine itself; the text is what it reported on the status pipe.
    #[error("Sandbox setup failed: {0}")]
    Setup(String),
    /// The launch message could not be sent.
    #[error("Cannot launch the agent")]
    Launch(#[source] runtime::Error),
    /// The helper could not be asked to signal the container.
    #[error("Cannot reach the container helper")]
    Signal(#[source] runtime::Error),
}

/// How an agent's container ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Exit {
    /// The agent exited with this code.
    Code(i32),
    /// The agent was killed by this signal.
    Signal(i32),
}

impl Exit {
    /// `exit N` or `signal SIGX`.
    pub fn describe(self) -> String {
        match self {
            Self::Code(c) => format!("exit status {c}"),
            Self::Signal(s) => format!("killed by {}", crate::engine::signal_name(s)),
        }
    }
}

/// A created container, its launch (the agent command from the bundle) and its end.
pub struct Container {
    helper: HelperClient,
    cid: String,
    launch: Launch,
    stdio: Option<[OwnedFd; 3]>,
    created: Created,
    pidfd: AsyncFd<OwnedFd>,
}

impl Container {
    /// Creates container `cid` from `<bundle>/config.json` (whose `process` is the agent's command and
    /// environment) with `stdio` (stdin, stdout, stderr) for the agent. On error nothing is left in the helper.
    pub async fn create(
        helper: &HelperClient,
        cid: &str,
        bundle: &Path,
        landlock: runtime::landlock::Policy,
        stdio: [BorrowedFd<'_>; 3],
    ) -> Result<Self, ContainerError> {
        let config = std::fs::read(bundle.join("config.json")).map_err(ContainerError::Bundle)?;
        let spec: serde_json::Value =
            serde_json::from_slice(&config).map_err(ContainerError::BundleJson)?;
        let strings = |key: &str| -> Vec<String> {
            spec["process"][key]
                .as_array()
                .map(|a| {
                    a.iter()
                        .filter_map(|v| v.as_str().map(str::to_owned))
                        .collect()
                })
                .unwrap_or_default()
        };
        let launch = Launch {
            args: strings("args"),
            env: strings("env"),
        };
        let dup = |fd: BorrowedFd<'_>| fd.try_clone_to_owned().map_err(ContainerError::Stdio);
        let stdio = [dup(stdio[0])?, dup(stdio[1])?, dup(stdio[2])?];
        let created = helper
            .create(cid, bundle.to_owned(), landlock)
            .await
            .map_err(ContainerError::Create)?;
        let pidfd = created.pidfd.try_clone().and_then(|fd| {
            // SAFETY: the OwnedFd moves into the AsyncFd, which keeps it open and unchanged for its lifetime.
            unsafe { AsyncFd::register_with_interest(fd, tokio::io::Interest::READABLE) }
                .map_err(std::io::Error::from)
        });
        let pidfd = match pidfd {
            Ok(p) => p,
            Err(e) => {
                let _ = helper.remove(cid).await;
                return Err(ContainerError::Watch(e));
            }
        };
        Ok(Self {
            helper: helper.clone(),
            cid: cid.to_owned(),
            launch,
            stdio: Some(stdio),
            created,
            pidfd,
        })
    }

    /// Launches the agent. On error the caller removes the container ([`Self::removed`]).
    pub async fn start(&mut self) -> Result<(), ContainerError> {
        let Some([stdin, stdout, stderr]) = self.stdio.take() else {
            return Err(ContainerError::Launched);
        };
        runtime::launch::send(
            self.created.launch.as_fd(),
            &self.launch,
            [stdin.as_fd(), stdout.as_fd(), stderr.as_fd()],
        )
        .map_err(|e| match self.report().setup_error {
            Some(setup) => ContainerError::Setup(setup),
            None => ContainerError::Launch(e),
        })
    }

    /// Waits for the container's end (its init gone, and with it every process of the sandbox's pid namespace).
    /// Cancel-safe: the readiness of the pidfd is kept between calls. The outer `Option` is for callers that also
    /// handled a dead helper; the end of a container never depends on the helper now.
    pub async fn exited(&mut self) -> Option<Option<Exit>> {
        match self.pidfd.readable().await {
            Ok(mut guard) => guard.retain_ready(),
            Err(e) => {
                tracing::warn!(container = %self.cid, error = %e, "waiting on the pidfd failed")
            }
        }
        Some(Some(match self.report().exit {
            Some(ProgramExit::Code(c)) => Exit::Code(c),
            Some(ProgramExit::Signal(s)) => Exit::Signal(s),
            // Only SIGKILL ends the init without a record.
            None => Exit::Signal(libc::SIGKILL),
        }))
    }

    /// What the init wrote on its status pipe so far (read without blocking).
    fn report(&self) -> Report {
        let Ok(fd) = self.created.status.try_clone() else {
            return Report::default();
        };
        let nonblocking = nix::fcntl::fcntl(fd.as_raw_fd(), nix::fcntl::FcntlArg::F_GETFL)
            .map(nix::fcntl::OFlag::from_bits_truncate)
            .and_then(|f| {
                nix::fcntl::fcntl(
                    fd.as_raw_fd(),
                    nix::fcntl::FcntlArg::F_SETFL(f | nix::fcntl::OFlag::O_NONBLOCK),
                )
            });
        let mut record = String::new();
        if nonblocking.is_ok() {
            let _ = std::fs::File::from(fd).read_to_string(&mut record);
        }
        Report::decode(&record)
    }

    /// Kills the container if it still runs and removes it (helper: delete, reap, cgroups), at most 30 s.
    pub async fn removed(self) {
        match tokio::time::timeout(Duration::from_secs(30), self.helper.remove(&self.cid)).await {
            Ok(Ok(None)) => {}
            Ok(Ok(Some(e))) => {
                tracing::error!(container = %self.cid, error = %e, "container removal reported an error")
            }
            Ok(Err(e)) => {
                tracing::error!(container = %self.cid, error = %runtime::error::Chain(&e), "container not removed")
            }
            Err(_) => tracing::error!(container = %self.cid, "container not removed within 30 s"),
        }
    }
}

/// Sends `signal` to container `cid`'s init (SIGKILL ends the whole container; SIGTERM, SIGINT and SIGHUP are
/// passed on to the agent).
pub async fn signal(helper: &HelperClient, cid: &str, signal: i32) -> Result<(), ContainerError> {
    helper
        .kill(cid, signal)
        .await
        .map_err(ContainerError::Signal)
}

//! youki's libcontainer as the helper's second container start (`sandbox.start: libcontainer`), compiled only with
//! the `libcontainer` cargo feature. The direct start ([`crate::direct`]) is the default; this one stays to check
//! the direct start's container against libcontainer's (sandboxd's parity test) and to compare their cost.
//!
//! The same spec, the same init ([`InitExecutor`], here as libcontainer's [`Executor`]) and the same cleanup as the
//! direct start; what differs is libcontainer's two processes per container and its state directory.

use std::os::fd::OwnedFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use libcontainer::container::builder::ContainerBuilder;
use libcontainer::container::Container;
use libcontainer::syscall::syscall::SyscallType;
use libcontainer::workload::{Executor, ExecutorError, ExecutorValidationError};
use nix::sys::wait::{waitid, Id, WaitPidFlag};
use nix::unistd::Pid;
use oci_spec::runtime::Spec;

use crate::error::{ContainerOp, Error, Result};
use crate::init::InitExecutor;

impl Executor for InitExecutor {
    fn validate(&self, spec: &Spec) -> Result<(), ExecutorValidationError> {
        let args = spec.process().as_ref().and_then(|p| p.args().as_ref());
        match args {
            Some(a) if !a.is_empty() && a[0].starts_with('/') => Ok(()),
            _ => Err(ExecutorValidationError::ArgValidationError(
                "process.args must start with an absolute program path".into(),
            )),
        }
    }

    fn exec(&self, _spec: &Spec) -> Result<(), ExecutorError> {
        self.run()
            .map_err(|e| ExecutorError::Other(crate::error::Chain(&e).to_string()))
    }
}

/// libcontainer's create: the init waits in the created container until [`start`]. Its state goes to
/// `<state_root>/<id>`.
pub(super) fn create(
    state_root: &Path,
    id: &str,
    bundle: PathBuf,
    executor: InitExecutor,
) -> Result<(Container, Pid)> {
    // The init's own stdio: nothing (the program gets its own with the launch message).
    let null = || {
        std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_CLOEXEC)
            .open("/dev/null")
            .map(OwnedFd::from)
            .map_err(|e| Error::io("/dev/null", e))
    };
    let container = ContainerBuilder::new(id.to_owned(), SyscallType::default())
        .with_root_path(state_root)
        .map_err(|e| Error::container(ContainerOp::Configure, e))?
        .with_executor(executor)
        .with_stdin(null()?)
        .with_stdout(null()?)
        .with_stderr(null()?)
        .validate_id()
        .map_err(|e| Error::container(ContainerOp::Configure, e))?
        .as_init(bundle)
        .with_systemd(false)
        .with_detach(true)
        .build()
        .map_err(|e| Error::container(ContainerOp::Create, e))?;
    let pid = container.pid().ok_or(Error::NoPid)?;
    Ok((container, pid))
}

/// libcontainer's start of a created container: its init goes on to wait for the launch.
pub(super) fn start(container: &mut Container) -> Result<()> {
    container
        .start()
        .map_err(|e| Error::container(ContainerOp::Start, e))
}

/// Deletes libcontainer's state of a container that failed half-way (it may be in any state).
pub(super) fn delete_failed(id: &str, container: &mut Container) {
    if let Err(e) = container.delete(true) {
        tracing::warn!(%id, error = %e, "delete of a failed container failed");
    }
}

/// Deletes the state libcontainer left in `dir` for a container whose create failed before the helper got its
/// handle. The init found there is our own unreaped child if it exists at all: it is killed, and its pid returned
/// for the caller to reap.
pub(super) fn delete_half_created(id: &str, dir: &Path) -> Option<Pid> {
    let mut c = Container::load(dir.to_path_buf()).ok()?;
    let pid = c.pid();
    if let Some(p) = pid {
        let _ = nix::sys::signal::kill(p, nix::sys::signal::Signal::SIGKILL);
        let _ = waitid(Id::Pid(p), WaitPidFlag::WEXITED | WaitPidFlag::WNOWAIT);
    }
    if let Err(e) = c.delete(true) {
        tracing::warn!(%id, error = %e, "delete of a half-created container failed");
    }
    pid
}

//! The helper process: a single-threaded poll loop that creates, starts, deletes and reaps containers.

use std::collections::HashMap;
use std::os::fd::{AsFd, AsRawFd, OwnedFd, RawFd};
use std::path::PathBuf;

use nix::fcntl::OFlag;
use nix::poll::{PollFd, PollFlags, PollTimeout};
use nix::sys::signal::{SigSet, SigmaskHow, Signal};
use nix::sys::signalfd::{SfdFlags, SignalFd};
use nix::sys::wait::{waitid, waitpid, Id, WaitPidFlag};
use nix::unistd::{ForkResult, Pid};

use super::proto::{Event, Request};
use crate::cgroups::Cgroups;
use crate::direct::{Blueprint, StartError};
use crate::error::{Chain, Error, Result};
use crate::init::InitExecutor;
use crate::ipc;

/// What the helper needs to know, fixed at fork time.
#[derive(Debug, Clone)]
pub struct HelperConfig {
    /// libcontainer's state directory (unused by the direct start).
    pub state_root: PathBuf,
    /// The cgroup setup (leftover removal).
    pub cgroups: Cgroups,
    /// The compiled seccomp profile every program gets.
    pub seccomp: crate::seccomp::Profile,
    /// How containers are started.
    pub start: StartMethod,
}

/// How the helper turns a bundle into a waiting init.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum StartMethod {
    /// sandboxd's own start ([`crate::direct`]): one clone, only the cgroups sandboxd uses.
    #[default]
    Direct,
    /// youki's libcontainer (create, then start); only in a build with the `libcontainer` cargo feature.
    Libcontainer,
}

impl StartMethod {
    /// Whether this build can start containers this way.
    pub fn is_built(self) -> bool {
        match self {
            Self::Direct => true,
            Self::Libcontainer => cfg!(feature = "libcontainer"),
        }
    }

    /// [`Error::StartNotBuilt`] when this build cannot start containers this way.
    pub fn ensure_built(self) -> Result<()> {
        if self.is_built() {
            Ok(())
        } else {
            Err(Error::StartNotBuilt(self.as_str()))
        }
    }

    /// The name the configuration uses.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Direct => "direct",
            Self::Libcontainer => "libcontainer",
        }
    }
}

impl std::fmt::Display for StartMethod {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Forks the helper. Must be called while the process is still single-threaded (before the async runtime).
/// Returns the helper's pid and the daemon's end of the socket. A start method this build lacks is refused here
/// ([`Error::StartNotBuilt`]), before anything is forked.
pub fn spawn_helper(config: HelperConfig) -> Result<(Pid, OwnedFd)> {
    config.start.ensure_built()?;
    let (daemon_end, helper_end) = ipc::pair()?;
    let parent = nix::unistd::getpid();
    // SAFETY: the caller guarantees the process is single-threaded, so the child may run arbitrary code.
    match unsafe { nix::unistd::fork() }.map_err(|e| Error::sys("fork helper", e))? {
        ForkResult::Child => {
            drop(daemon_end);
            // Nothing of the daemon's but stdio: not another helper's socket, not the image store's lock.
            let keep = helper_end.as_raw_fd();
            let closed = crate::sys::close_range(3, keep - 1)
                .and_then(|()| crate::sys::close_range(keep + 1, RawFd::MAX));
            let code = match closed
                .and_then(|()| crate::sys::set_parent_death_signal(Signal::SIGKILL))
            {
                // The daemon may have died between fork and prctl.
                Ok(()) if nix::unistd::getppid() == parent => match Helper::new(helper_end, config)
                {
                    Ok(mut h) => h.run(),
                    Err(e) => {
                        tracing::error!(error = %Chain(&e), "helper failed to start");
                        1
                    }
                },
                _ => 1,
            };
            std::process::exit(code)
        }
        ForkResult::Parent { child } => Ok((child, daemon_end)),
    }
}

struct Running {
    /// libcontainer's handle; `None` for a container of the direct start, which keeps no state.
    #[cfg(feature = "libcontainer")]
    container: Option<libcontainer::container::Container>,
    pid: Pid,
    /// Outlives the helper: the shutdown leaves it running ([`Request::Create`]'s `keep`).
    kept: bool,
}

struct Helper {
    sock: OwnedFd,
    sigchld: SignalFd,
    config: HelperConfig,
    running: HashMap<String, Running>,
}

impl Helper {
    fn new(sock: OwnedFd, config: HelperConfig) -> Result<Self> {
        let mut mask = SigSet::empty();
        mask.add(Signal::SIGCHLD);
        nix::sys::signal::sigprocmask(SigmaskHow::SIG_BLOCK, Some(&mask), None)
            .map_err(|e| Error::sys("sigprocmask", e))?;
        let sigchld = SignalFd::with_flags(&mask, SfdFlags::SFD_NONBLOCK | SfdFlags::SFD_CLOEXEC)
            .map_err(|e| Error::sys("signalfd", e))?;
        std::fs::create_dir_all(&config.state_root)
            .map_err(|e| Error::io(&config.state_root, e))?;
        Ok(Self {
            sock,
            sigchld,
            config,
            running: HashMap::new(),
        })
    }

    /// The loop; returns the process exit code.
    fn run(&mut self) -> i32 {
        let mut buf = vec![0u8; ipc::MAX_MESSAGE];
        loop {
            let (sock_ready, child_ready) = {
                let mut fds = [
                    PollFd::new(self.sock.as_fd(), PollFlags::POLLIN),
                    PollFd::new(self.sigchld.as_fd(), PollFlags::POLLIN),
                ];
                match nix::poll::poll(&mut fds, PollTimeout::NONE) {
                    Ok(_) => {}
                    Err(nix::Error::EINTR) => continue,
                    Err(e) => {
                        tracing::error!(error = %e, "helper poll failed");
                        self.shutdown();
                        return 1;
                    }
                }
                let ready = |f: &PollFd| f.revents().is_some_and(|r| !r.is_empty());
                (ready(&fds[0]), ready(&fds[1]))
            };
            if child_ready {
                // Inits stay unreaped (zombies) until the daemon asks for their removal: drain the signals only.
                while let Ok(Some(_)) = self.sigchld.read_signal() {}
            }
            if sock_ready {
                match ipc::recv(self.sock.as_fd(), &mut buf) {
                    Ok(Some((n, _fds))) => match serde_json::from_slice::<Request>(&buf[..n]) {
                        Ok(Request::Shutdown) => {
                            self.shutdown();
                            return 0;
                        }
                        Ok(req) => self.handle(req),
                        Err(e) => tracing::error!(error = %e, "helper got a malformed request"),
                    },
                    Ok(None) => {
                        // The daemon is gone: nothing may outlive it.
                        self.shutdown();
                        return 0;
                    }
                    Err(nix::Error::EINTR) => {}
                    Err(e) => {
                        tracing::error!(error = %e, "helper socket failed");
                        self.shutdown();
                        return 1;
                    }
                }
            }
        }
    }

    /// Sends an event; false when it could not be sent.
    fn send(&self, event: &Event, fds: &[std::os::fd::BorrowedFd<'_>]) -> bool {
        match serde_json::to_vec(event) {
            Ok(bytes) => match ipc::send(self.sock.as_fd(), &bytes, fds) {
                Ok(()) => true,
                Err(e) => {
                    tracing::debug!(error = %e, "helper could not send an event");
                    false
                }
            },
            Err(e) => {
                tracing::error!(error = %e, "helper could not encode an event");
                false
            }
        }
    }

    fn handle(&mut self, req: Request) {
        match req {
            Request::Create {
                id,
                bundle,
                landlock,
                warm,
                keep,
            } => match self.create(&id, bundle, landlock, warm, keep) {
                Ok((pid, [launch, status, pidfd])) => {
                    let sent = self.send(
                        &Event::Created {
                            id: id.clone(),
                            pid: pid.as_raw(),
                        },
                        &[launch.as_fd(), status.as_fd(), pidfd.as_fd()],
                    );
                    // The daemon never learnt of it: nobody would ask for its removal.
                    if !sent {
                        if let Some(e) = self.remove(&id) {
                            tracing::error!(%id, error = %e, "removing an unannounced container failed");
                        }
                    }
                }
                Err(e) => {
                    // An id that is taken names somebody else's container: it is not ours to clean up.
                    if !matches!(e, Error::Start(StartError::Exists(_))) {
                        self.cleanup_failed(&id);
                    }
                    self.send(
                        &Event::Failed {
                            id,
                            message: Chain(&e).to_string(),
                        },
                        &[],
                    );
                }
            },
            Request::Kill { id, signal } => {
                if let Some(r) = self.running.get(&id) {
                    // The init is our unreaped child: the pid cannot belong to anyone else.
                    match Signal::try_from(signal) {
                        Ok(sig) => {
                            if let Err(e) = nix::sys::signal::kill(r.pid, sig) {
                                tracing::debug!(%id, error = %e, "kill of container init failed");
                            }
                        }
                        Err(e) => {
                            tracing::error!(%id, signal, error = %e, "kill with an invalid signal")
                        }
                    }
                }
            }
            Request::Remove { id } => {
                let error = self.remove(&id);
                self.send(&Event::Removed { id, error }, &[]);
            }
            Request::Shutdown => {}
        }
    }

    /// Creates and starts a container; returns its init's pid and the daemon's descriptors (launch channel, status
    /// pipe read end, pidfd).
    fn create(
        &mut self,
        id: &str,
        bundle: PathBuf,
        landlock: crate::landlock::Policy,
        warm: Option<crate::launch::Launch>,
        keep: bool,
    ) -> Result<(Pid, [OwnedFd; 3])> {
        let taken = self.running.contains_key(id)
            || self.config.state_root.join(id).exists()
            || self
                .config
                .cgroups
                .hierarchies()
                .iter()
                .any(|h| h.join(self.config.cgroups.parent()).join(id).exists());
        if taken {
            return Err(StartError::Exists(id.to_owned()).into());
        }
        let (status_r, status_w) =
            nix::unistd::pipe2(OFlag::O_CLOEXEC).map_err(|e| Error::sys("pipe2", e))?;
        let (launch_daemon, launch_init) = ipc::pair()?;
        let executor = InitExecutor {
            status_fd: status_w.as_raw_fd(),
            launch_fd: launch_init.as_raw_fd(),
            seccomp: self.config.seccomp.clone(),
            landlock,
            warm,
            outlives_helper: keep,
        };
        let pid = match self.config.start {
            StartMethod::Direct => self.start_direct(id, &bundle, &executor)?,
            // libcontainer's init is its own: it cannot be told to outlive the helper.
            #[cfg(feature = "libcontainer")]
            StartMethod::Libcontainer if keep => {
                return Err(StartError::Unsupported(
                    "a container that outlives the daemon needs sandbox.start: direct".into(),
                )
                .into())
            }
            #[cfg(feature = "libcontainer")]
            StartMethod::Libcontainer => self.start_libcontainer(id, bundle, executor)?,
            // spawn_helper refuses it; a helper never gets here.
            #[cfg(not(feature = "libcontainer"))]
            StartMethod::Libcontainer => return Err(Error::StartNotBuilt("libcontainer")),
        };
        drop((status_w, launch_init));
        let pidfd = crate::sys::pidfd_open(pid)?;
        Ok((pid, [launch_daemon, status_r, pidfd]))
    }

    /// The direct start ([`crate::direct`]): the blueprint is read from the bundle and checked first. The init's
    /// loopback is raised by the init itself. Registered only once it waits, so a failure is cleaned up by
    /// [`Self::cleanup_failed`] (the cgroup leaves; the clone is already reaped).
    fn start_direct(
        &mut self,
        id: &str,
        bundle: &std::path::Path,
        init: &InitExecutor,
    ) -> Result<Pid> {
        let path = bundle.join("config.json");
        let spec = oci_spec::runtime::Spec::load(&path)
            .map_err(|source| StartError::ReadSpec { path, source })?;
        let mut blueprint = Blueprint::from_spec(&spec, &self.config.cgroups.cgroups_path(id))?;
        blueprint.outlives_helper = init.outlives_helper;
        let pid = crate::direct::start(id, &blueprint, &self.config.cgroups, init)?;
        self.running.insert(
            id.to_owned(),
            Running {
                #[cfg(feature = "libcontainer")]
                container: None,
                pid,
                kept: init.outlives_helper,
            },
        );
        Ok(pid)
    }

    /// libcontainer's create and start ([`super::youki`]), and the loopback raised from the helper.
    #[cfg(feature = "libcontainer")]
    fn start_libcontainer(
        &mut self,
        id: &str,
        bundle: PathBuf,
        executor: InitExecutor,
    ) -> Result<Pid> {
        let (container, pid) = super::youki::create(&self.config.state_root, id, bundle, executor)?;
        // Registered first, so a failure below is cleaned up like any created container.
        let running = self.running.entry(id.to_owned()).insert_entry(Running {
            container: Some(container),
            pid,
            kept: false,
        });
        crate::sys::bring_up_loopback(pid)?;
        match running.into_mut().container.as_mut() {
            Some(c) => super::youki::start(c)?,
            None => return Err(Error::NoPid),
        }
        Ok(pid)
    }

    /// Kills the init (if it still runs), reaps it, and removes the cgroup leaf and libcontainer's state
    /// directory. Returns the first step that failed.
    ///
    /// libcontainer's `Container::delete` is not used here: what it does for a container like ours (no hooks, no
    /// Intel RDT) is exactly those two removals, but on cgroup v1 it first builds a cgroup manager, which reads
    /// `/proc/self/mountinfo` once per controller: twelve reads of a file that grows with every container's
    /// mounts, the largest single cost of the helper per container. `cleanup_failed` keeps using it: a container
    /// that failed half-way may be in any state.
    fn remove(&mut self, id: &str) -> Option<String> {
        let Some(r) = self.running.remove(id) else {
            return Some("no such container".into());
        };
        // Our unreaped child: the pid is still this init's, alive or a zombie. Once it is a zombie, its pid
        // namespace is empty (the kernel kills and waits for the rest before the init's exit completes).
        let _ = nix::sys::signal::kill(r.pid, Signal::SIGKILL);
        let mut error = waitid(Id::Pid(r.pid), WaitPidFlag::WEXITED | WaitPidFlag::WNOWAIT)
            .err()
            .map(|e| format!("waiting for the init failed: {e}"));
        if let Err(e) = waitpid(r.pid, None) {
            error.get_or_insert_with(|| format!("reaping the init failed: {e}"));
        }
        if let Err(e) = self.config.cgroups.remove_leaf(id) {
            error.get_or_insert_with(|| Chain(&e).to_string());
        }
        let dir = self.config.state_root.join(id);
        if let Err(e) = std::fs::remove_dir_all(&dir) {
            if e.kind() != std::io::ErrorKind::NotFound {
                error.get_or_insert_with(|| format!("removing {} failed: {e}", dir.display()));
            }
        }
        error
    }

    /// Removes everything of a container that failed to be created or started.
    fn cleanup_failed(&mut self, id: &str) {
        let dir = self.config.state_root.join(id);
        let pid = match self.running.remove(id) {
            Some(r) => {
                let _ = nix::sys::signal::kill(r.pid, Signal::SIGKILL);
                let _ = waitid(Id::Pid(r.pid), WaitPidFlag::WEXITED | WaitPidFlag::WNOWAIT);
                #[cfg(feature = "libcontainer")]
                if let Some(mut c) = r.container {
                    super::youki::delete_failed(id, &mut c);
                }
                Some(r.pid)
            }
            #[cfg(feature = "libcontainer")]
            None if dir.exists() => super::youki::delete_half_created(id, &dir),
            None => None,
        };
        if let Some(p) = pid {
            let _ = waitpid(p, None);
        }
        if let Err(e) = self.config.cgroups.remove_leaf(id) {
            tracing::error!(%id, error = %Chain(&e), "cgroup of a failed container not removed");
        }
        if dir.exists() {
            let _ = std::fs::remove_dir_all(&dir);
        }
    }

    fn shutdown(&mut self) {
        // A kept container outlives us: its init is reparented when we exit, and a later daemon adopts it.
        self.running.retain(|_, r| !r.kept);
        for r in self.running.values() {
            let _ = nix::sys::signal::kill(r.pid, Signal::SIGKILL);
        }
        let ids: Vec<String> = self.running.keys().cloned().collect();
        for id in ids {
            if let Some(e) = self.remove(&id) {
                tracing::error!(%id, error = %e, "removing a container at shutdown failed");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_start_missing_from_the_build_is_a_typed_refusal() {
        assert!(StartMethod::Direct.ensure_built().is_ok());
        let libcontainer = StartMethod::Libcontainer.ensure_built();
        if cfg!(feature = "libcontainer") {
            assert!(libcontainer.is_ok());
        } else {
            match libcontainer {
                Err(e @ Error::StartNotBuilt("libcontainer")) => assert_eq!(
                    e.to_string(),
                    "This build has no libcontainer start; rebuild with --features libcontainer"
                ),
                other => panic!("{other:?}"),
            }
        }
        // The names are the configuration's.
        for m in [StartMethod::Direct, StartMethod::Libcontainer] {
            assert_eq!(
                serde_json::to_value(m).ok(),
                Some(serde_json::Value::String(m.to_string()))
            );
        }
    }
}

//! The helper process: the only place containers are created, started, signalled, waited for and deleted.
//!
//! libcontainer forks and runs Rust code in the child, which is only sound in a single-threaded process, so the
//! daemon forks this helper before it starts its async runtime ([`spawn_helper`]). The helper is a plain poll loop
//! over the daemon socket and a `signalfd` for `SIGCHLD`. Containers' init processes are its children; it signals
//! them only while they are unreaped, so a pid can never be reused under it, and it deletes a container while its
//! init is still a zombie (libcontainer then sees it stopped and never signals a pid by itself).
//!
//! [`HelperClient`] is the daemon's side: requests go out with their file descriptors, events come back routed
//! by container id.

use std::collections::HashMap;
use std::io::Read;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use libcontainer::container::builder::ContainerBuilder;
use libcontainer::container::Container;
use libcontainer::syscall::syscall::SyscallType;
use nix::fcntl::OFlag;
use nix::poll::{PollFd, PollFlags, PollTimeout};
use nix::sys::signal::{SigSet, SigmaskHow, Signal};
use nix::sys::signalfd::{SfdFlags, SignalFd};
use nix::sys::wait::{waitid, waitpid, Id, WaitPidFlag, WaitStatus};
use nix::unistd::{ForkResult, Pid};
use serde::{Deserialize, Serialize};
use tokio::io::unix::AsyncFd;
use tokio::sync::mpsc;

use crate::cgroups::{Cgroups, Usage};
use crate::error::{Error, Result};
use crate::init::{InitExecutor, ProgramExit, Report};
use crate::ipc;

/// A request from the daemon.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Request {
    /// Create a container from `<bundle>/config.json`; carries stdin, stdout and stderr as descriptors.
    Create {
        /// Container id (daemon-generated, unique).
        id: String,
        /// Bundle directory.
        bundle: PathBuf,
        /// The landlock policy of the program (it depends on the image).
        landlock: crate::landlock::Policy,
    },
    /// Let a created container's program run.
    Start {
        /// Container id.
        id: String,
    },
    /// Signal a container's init (SIGKILL ends the whole pid namespace).
    Kill {
        /// Container id.
        id: String,
        /// Signal number.
        signal: i32,
    },
    /// Kill every container, clean up and exit.
    Shutdown,
}

/// How the container's init process ended, as its parent saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind", content = "value")]
pub enum InitStatus {
    /// Exited with this code.
    Exited(i32),
    /// Killed by this signal.
    Signaled(i32),
}

/// An event from the helper about one container.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum Event {
    /// The container exists and waits for `Start`.
    Created {
        /// Container id.
        id: String,
        /// Host pid of its init.
        pid: i32,
    },
    /// The program is running.
    Started {
        /// Container id.
        id: String,
    },
    /// Creating or starting failed; whatever was created is already removed.
    Failed {
        /// Container id.
        id: String,
        /// Why.
        message: String,
    },
    /// The container's init ended. Usage was read from the cgroup before it was removed.
    Exited {
        /// Container id.
        id: String,
        /// How the program ended, if the init lived to report it.
        program: Option<ProgramExit>,
        /// The program never ran: a restriction (landlock, seccomp) could not be applied.
        setup_error: Option<String>,
        /// How the init ended.
        init: InitStatus,
        /// Cgroup usage; `None` with `usage_error` set when it could not be read.
        usage: Option<Usage>,
        /// Why usage is missing.
        usage_error: Option<String>,
        /// Wall-clock time from start to exit, microseconds.
        duration_us: u64,
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
            Self::Created { id, .. }
            | Self::Started { id }
            | Self::Failed { id, .. }
            | Self::Exited { id, .. }
            | Self::Removed { id, .. } => id,
        }
    }
}

/// What the helper needs to know, fixed at fork time.
#[derive(Debug, Clone)]
pub struct HelperConfig {
    /// libcontainer's state directory.
    pub state_root: PathBuf,
    /// The cgroup setup (usage and leftover removal).
    pub cgroups: Cgroups,
    /// The compiled seccomp profile every program gets.
    pub seccomp: crate::seccomp::Profile,
}

/// Forks the helper. Must be called while the process is still single-threaded (before the async runtime).
/// Returns the helper's pid and the daemon's end of the socket.
pub fn spawn_helper(config: HelperConfig) -> Result<(Pid, OwnedFd)> {
    let (daemon_end, helper_end) = ipc::pair()?;
    let parent = nix::unistd::getpid();
    // SAFETY: the caller guarantees the process is single-threaded, so the child may run arbitrary code.
    match unsafe { nix::unistd::fork() }.map_err(|e| Error::sys("fork helper", e))? {
        ForkResult::Child => {
            drop(daemon_end);
            let code = match crate::sys::set_parent_death_signal(Signal::SIGKILL) {
                // The daemon may have died between fork and prctl.
                Ok(()) if nix::unistd::getppid() == parent => match Helper::new(helper_end, config)
                {
                    Ok(mut h) => h.run(),
                    Err(e) => {
                        tracing::error!(error = %e, "helper failed to start");
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
    container: Container,
    pid: Pid,
    status: OwnedFd,
    started: Option<Instant>,
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
                while let Ok(Some(_)) = self.sigchld.read_signal() {}
                self.reap_exited();
            }
            if sock_ready {
                match ipc::recv(self.sock.as_fd(), &mut buf) {
                    Ok(Some((n, fds))) => match serde_json::from_slice::<Request>(&buf[..n]) {
                        Ok(Request::Shutdown) => {
                            self.shutdown();
                            return 0;
                        }
                        Ok(req) => self.handle(req, fds),
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

    fn send(&self, event: &Event) {
        match serde_json::to_vec(event) {
            Ok(bytes) => {
                if let Err(e) = ipc::send(self.sock.as_fd(), &bytes, &[]) {
                    tracing::debug!(error = %e, "helper could not send an event");
                }
            }
            Err(e) => tracing::error!(error = %e, "helper could not encode an event"),
        }
    }

    fn handle(&mut self, req: Request, fds: Vec<OwnedFd>) {
        match req {
            Request::Create {
                id,
                bundle,
                landlock,
            } => {
                let event = match self.create(&id, bundle, landlock, fds) {
                    Ok(pid) => Event::Created {
                        id,
                        pid: pid.as_raw(),
                    },
                    Err(e) => {
                        self.cleanup_failed(&id);
                        Event::Failed {
                            id,
                            message: e.to_string(),
                        }
                    }
                };
                self.send(&event);
            }
            Request::Start { id } => {
                let Some(r) = self.running.get_mut(&id) else {
                    self.send(&Event::Failed {
                        id,
                        message: "no such container".into(),
                    });
                    return;
                };
                let started = Instant::now();
                match r.container.start() {
                    Ok(()) => {
                        r.started = Some(started);
                        self.send(&Event::Started { id });
                    }
                    Err(e) => {
                        let message = format!("start failed: {e}");
                        self.cleanup_failed(&id);
                        self.send(&Event::Failed { id, message });
                    }
                }
            }
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
            Request::Shutdown => {}
        }
    }

    fn create(
        &mut self,
        id: &str,
        bundle: PathBuf,
        landlock: crate::landlock::Policy,
        fds: Vec<OwnedFd>,
    ) -> Result<Pid> {
        let [stdin, stdout, stderr]: [OwnedFd; 3] = fds.try_into().map_err(|v: Vec<OwnedFd>| {
            Error::Protocol(format!("create carries {} descriptors, not 3", v.len()))
        })?;
        let (status_r, status_w) = nix::unistd::pipe2(OFlag::O_CLOEXEC | OFlag::O_NONBLOCK)
            .map_err(|e| Error::sys("pipe2", e))?;
        let executor = InitExecutor {
            status_fd: status_w.as_raw_fd(),
            seccomp: self.config.seccomp.clone(),
            landlock,
        };
        let container = ContainerBuilder::new(id.to_owned(), SyscallType::default())
            .with_root_path(&self.config.state_root)
            .map_err(|e| Error::Container(e.to_string()))?
            .with_executor(executor)
            .with_stdin(stdin)
            .with_stdout(stdout)
            .with_stderr(stderr)
            .validate_id()
            .map_err(|e| Error::Container(e.to_string()))?
            .as_init(bundle)
            .with_systemd(false)
            .with_detach(true)
            .build()
            .map_err(|e| Error::Container(format!("create failed: {e}")))?;
        drop(status_w);
        let pid = container
            .pid()
            .ok_or_else(|| Error::Container("created container has no pid".into()))?;
        let running = Running {
            container,
            pid,
            status: status_r,
            started: None,
        };
        // Registered first, so a failure below is cleaned up like any created container.
        self.running.insert(id.to_owned(), running);
        crate::sys::bring_up_loopback(pid)?;
        Ok(pid)
    }

    /// Removes everything of a container that failed to be created or started.
    fn cleanup_failed(&mut self, id: &str) {
        let known = self.running.remove(id);
        let dir = self.config.state_root.join(id);
        let mut pid = known.as_ref().map(|r| r.pid);
        if let Some(mut r) = known {
            let _ = nix::sys::signal::kill(r.pid, Signal::SIGKILL);
            let _ = waitid(Id::Pid(r.pid), WaitPidFlag::WEXITED | WaitPidFlag::WNOWAIT);
            if let Err(e) = r.container.delete(true) {
                tracing::warn!(%id, error = %e, "delete of a failed container failed");
            }
        } else if dir.exists() {
            if let Ok(mut c) = Container::load(dir.clone()) {
                pid = c.pid();
                if let Some(p) = pid {
                    // Our own unreaped child if it exists at all.
                    let _ = nix::sys::signal::kill(p, Signal::SIGKILL);
                    let _ = waitid(Id::Pid(p), WaitPidFlag::WEXITED | WaitPidFlag::WNOWAIT);
                }
                if let Err(e) = c.delete(true) {
                    tracing::warn!(%id, error = %e, "delete of a half-created container failed");
                }
            }
        }
        if let Some(p) = pid {
            let _ = waitpid(p, None);
        }
        if let Err(e) = self.config.cgroups.remove_leaf(id) {
            tracing::error!(%id, error = %e, "cgroup of a failed container not removed");
        }
        if dir.exists() {
            let _ = std::fs::remove_dir_all(&dir);
        }
    }

    /// Handles every container whose init has exited (peeked with `WNOWAIT`, so still a zombie).
    fn reap_exited(&mut self) {
        let exited: Vec<(String, WaitStatus)> = self
            .running
            .iter()
            .filter_map(|(id, r)| {
                match waitid(
                    Id::Pid(r.pid),
                    WaitPidFlag::WEXITED | WaitPidFlag::WNOHANG | WaitPidFlag::WNOWAIT,
                ) {
                    Ok(WaitStatus::StillAlive) | Err(_) => None,
                    Ok(ws) => Some((id.clone(), ws)),
                }
            })
            .collect();
        for (id, ws) in exited {
            self.finish(&id, ws);
        }
    }

    fn finish(&mut self, id: &str, ws: WaitStatus) {
        let Some(mut r) = self.running.remove(id) else {
            return;
        };
        let duration_us = r
            .started
            .map(|s| s.elapsed().as_micros() as u64)
            .unwrap_or(0);
        let init = match ws {
            WaitStatus::Exited(_, c) => InitStatus::Exited(c),
            WaitStatus::Signaled(_, s, _) => InitStatus::Signaled(s as i32),
            _ => InitStatus::Signaled(Signal::SIGKILL as i32),
        };
        let mut record = String::new();
        let _ = std::fs::File::from(r.status).read_to_string(&mut record);
        let report = Report::decode(&record);
        let (usage, usage_error) = match self.config.cgroups.usage(id) {
            Ok(u) => (Some(u), None),
            Err(e) => (None, Some(e.to_string())),
        };
        self.send(&Event::Exited {
            id: id.to_owned(),
            program: report.exit,
            setup_error: report.setup_error,
            init,
            usage,
            usage_error,
            duration_us,
        });
        // Delete while the init is a zombie, then reap it.
        let mut error = r.container.delete(false).err().map(|e| e.to_string());
        if let Err(e) = waitpid(r.pid, None) {
            error.get_or_insert_with(|| format!("reaping the init failed: {e}"));
        }
        if let Err(e) = self.config.cgroups.remove_leaf(id) {
            error.get_or_insert_with(|| e.to_string());
        }
        self.send(&Event::Removed {
            id: id.to_owned(),
            error,
        });
    }

    fn shutdown(&mut self) {
        for r in self.running.values() {
            let _ = nix::sys::signal::kill(r.pid, Signal::SIGKILL);
        }
        let ids: Vec<String> = self.running.keys().cloned().collect();
        for id in ids {
            let Some(pid) = self.running.get(&id).map(|r| r.pid) else {
                continue;
            };
            match waitid(Id::Pid(pid), WaitPidFlag::WEXITED | WaitPidFlag::WNOWAIT) {
                Ok(ws) => self.finish(&id, ws),
                Err(e) => {
                    tracing::error!(%id, error = %e, "waiting for a killed container failed");
                    self.cleanup_failed(&id);
                }
            }
        }
    }
}

/// The daemon's handle on the helper.
#[derive(Clone)]
pub struct HelperClient {
    inner: Arc<Inner>,
}

struct Inner {
    sock: AsyncFd<OwnedFd>,
    routes: Mutex<HashMap<String, mpsc::UnboundedSender<Event>>>,
    alive: AtomicBool,
    /// A `Shutdown` was sent: the helper's exit is expected.
    stopping: AtomicBool,
    pid: Pid,
}

impl HelperClient {
    /// Wraps the daemon's end of the helper socket; must be called inside a tokio runtime (spawns the reader).
    pub fn new(sock: OwnedFd, pid: Pid) -> Result<Self> {
        nix::fcntl::fcntl(
            sock.as_raw_fd(),
            nix::fcntl::FcntlArg::F_SETFL(OFlag::O_NONBLOCK),
        )
        .map_err(|e| Error::sys("fcntl(O_NONBLOCK)", e))?;
        // SAFETY: `sock` is an OwnedFd moved into the AsyncFd: it stays open and is the same descriptor for the
        // AsyncFd's whole lifetime, and `as_raw_fd` of an OwnedFd always returns it.
        let sock =
            unsafe { AsyncFd::register(sock) }.map_err(|e| Error::io("helper socket", e.into()))?;
        let inner = Arc::new(Inner {
            sock,
            routes: Mutex::new(HashMap::new()),
            alive: AtomicBool::new(true),
            stopping: AtomicBool::new(false),
            pid,
        });
        tokio::spawn(read_events(inner.clone()));
        Ok(Self { inner })
    }

    /// The helper's pid.
    pub fn pid(&self) -> Pid {
        self.inner.pid
    }

    /// False once the helper has gone away.
    pub fn is_alive(&self) -> bool {
        self.inner.alive.load(Ordering::SeqCst)
    }

    /// Routes the events of container `id` to the returned receiver until [`Self::unsubscribe`]. The receiver ends
    /// (returns `None`) if the helper dies.
    pub fn subscribe(&self, id: &str) -> mpsc::UnboundedReceiver<Event> {
        let (tx, rx) = mpsc::unbounded_channel();
        if self.is_alive() {
            lock(&self.inner.routes).insert(id.to_owned(), tx);
        }
        rx
    }

    /// Stops routing events of `id`.
    pub fn unsubscribe(&self, id: &str) {
        lock(&self.inner.routes).remove(id);
    }

    /// Sends a request with descriptors (duplicated into the helper by the kernel; the caller may close its own).
    pub async fn request(&self, req: &Request, fds: &[BorrowedFd<'_>]) -> Result<()> {
        if !self.is_alive() {
            return Err(Error::HelperGone);
        }
        if matches!(req, Request::Shutdown) {
            self.inner.stopping.store(true, Ordering::SeqCst);
        }
        let bytes = serde_json::to_vec(req).map_err(|e| Error::Protocol(e.to_string()))?;
        loop {
            let mut guard = self
                .inner
                .sock
                .writable()
                .await
                .map_err(|e| Error::io("helper socket", e))?;
            match guard.try_io(|s| {
                ipc::send(s.get_ref().as_fd(), &bytes, fds).map_err(std::io::Error::from)
            }) {
                Ok(Ok(())) => return Ok(()),
                Ok(Err(e))
                    if e.raw_os_error() == Some(libc::EPIPE)
                        || e.raw_os_error() == Some(libc::ECONNRESET) =>
                {
                    return Err(Error::HelperGone)
                }
                Ok(Err(e)) => return Err(Error::io("helper socket", e)),
                Err(_would_block) => continue,
            }
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

async fn read_events(inner: Arc<Inner>) {
    let mut buf = vec![0u8; ipc::MAX_MESSAGE];
    loop {
        let mut guard = match inner.sock.readable().await {
            Ok(g) => g,
            Err(e) => {
                tracing::error!(error = %e, "helper socket failed");
                break;
            }
        };
        let res = guard
            .try_io(|s| ipc::recv(s.get_ref().as_fd(), &mut buf).map_err(std::io::Error::from));
        match res {
            Err(_would_block) => continue,
            Ok(Ok(Some((n, _fds)))) => match serde_json::from_slice::<Event>(&buf[..n]) {
                Ok(event) => {
                    let tx = lock(&inner.routes).get(event.id()).cloned();
                    match tx {
                        Some(tx) => {
                            let _ = tx.send(event);
                        }
                        None => tracing::debug!(?event, "helper event for an unknown container"),
                    }
                }
                Err(e) => tracing::error!(error = %e, "malformed event from the helper"),
            },
            Ok(Ok(None)) => {
                if inner.stopping.load(Ordering::SeqCst) {
                    tracing::info!("the container helper stopped");
                } else {
                    tracing::error!("the container helper exited unexpectedly");
                }
                break;
            }
            Ok(Err(e)) => {
                tracing::error!(error = %e, "reading from the helper failed");
                break;
            }
        }
    }
    inner.alive.store(false, Ordering::SeqCst);
    lock(&inner.routes).clear();
}

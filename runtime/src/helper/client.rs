//! The daemon's handle on the helper: requests go out, events come back routed by container id.

use std::collections::HashMap;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use nix::fcntl::OFlag;
use nix::unistd::Pid;
use tokio::io::unix::AsyncFd;
use tokio::sync::{mpsc, watch};

use super::proto::{Event, Request};
use crate::error::{Error, Result};
use crate::ipc;

pub use crate::error::HelperError;

/// A container whose init waits for the launch message, with the daemon's descriptors.
#[derive(Debug)]
pub struct Created {
    /// Host pid of the init (for logs; signal through `pidfd`).
    pub pid: i32,
    /// The daemon's end of the launch channel ([`crate::launch::send`]).
    pub launch: OwnedFd,
    /// Read end of the init's status pipe: the program's end record, then end of file when the init is gone.
    pub status: OwnedFd,
    /// A pidfd of the init ([`crate::sys::pidfd_send_signal`]).
    pub pidfd: OwnedFd,
}

type Route = mpsc::UnboundedSender<(Event, Vec<OwnedFd>)>;

/// The daemon's handle on the helper.
#[derive(Clone)]
pub struct HelperClient {
    inner: Arc<Inner>,
}

struct Inner {
    sock: AsyncFd<OwnedFd>,
    routes: Mutex<HashMap<String, Route>>,
    /// True until the helper has gone away; [`HelperClient::gone`] waits on it.
    alive: watch::Sender<bool>,
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
            alive: watch::Sender::new(true),
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
        *self.inner.alive.borrow()
    }

    /// Resolves once the helper has gone away (at once if it has).
    pub async fn gone(&self) {
        let mut alive = self.inner.alive.subscribe();
        // The sender lives in `inner`, which this client holds: the wait ends only by the value.
        let _ = alive.wait_for(|alive| !alive).await;
    }

    /// Creates and starts a container; its init then waits for the launch message. On failure the helper has
    /// already removed whatever was created.
    pub async fn create(
        &self,
        id: &str,
        bundle: PathBuf,
        landlock: crate::landlock::Policy,
        warm: Option<crate::launch::Launch>,
    ) -> Result<Created> {
        self.create_with(id, bundle, landlock, warm, false).await
    }

    /// [`Self::create`] for a container that outlives the helper and the daemon (`keep`, see
    /// [`Request::Create`]): nothing but its removal ends it.
    pub async fn create_kept(
        &self,
        id: &str,
        bundle: PathBuf,
        landlock: crate::landlock::Policy,
    ) -> Result<Created> {
        self.create_with(id, bundle, landlock, None, true).await
    }

    async fn create_with(
        &self,
        id: &str,
        bundle: PathBuf,
        landlock: crate::landlock::Policy,
        warm: Option<crate::launch::Launch>,
        keep: bool,
    ) -> Result<Created> {
        let answer = self
            .ask(
                id,
                &Request::Create {
                    id: id.to_owned(),
                    bundle,
                    landlock,
                    warm,
                    keep,
                },
            )
            .await?;
        match answer {
            Some((Event::Created { pid, .. }, fds)) => {
                let [launch, status, pidfd]: [OwnedFd; 3] = fds
                    .try_into()
                    .map_err(|v: Vec<OwnedFd>| HelperError::Descriptors(v.len()))?;
                Ok(Created {
                    pid,
                    launch,
                    status,
                    pidfd,
                })
            }
            Some((Event::Failed { message, .. }, _)) => {
                Err(HelperError::CreateFailed { message }.into())
            }
            Some((other, _)) => Err(HelperError::Unexpected {
                request: "create",
                event: format!("{other:?}"),
            }
            .into()),
            None => Err(Error::HelperGone),
        }
    }

    /// Kills (if needed), deletes and reaps a container and removes its cgroups. `Ok(Some(step))` names a cleanup
    /// step that failed.
    pub async fn remove(&self, id: &str) -> Result<Option<String>> {
        let answer = self.ask(id, &Request::Remove { id: id.to_owned() }).await?;
        match answer {
            Some((Event::Removed { error, .. }, _)) => Ok(error),
            Some((other, _)) => Err(HelperError::Unexpected {
                request: "remove",
                event: format!("{other:?}"),
            }
            .into()),
            None => Err(Error::HelperGone),
        }
    }

    /// Asks the helper to signal a container's init by id (fire and forget).
    pub async fn kill(&self, id: &str, signal: i32) -> Result<()> {
        self.request(&Request::Kill {
            id: id.to_owned(),
            signal,
        })
        .await
    }

    /// Asks the helper to kill and remove every container and exit.
    pub async fn shutdown(&self) -> Result<()> {
        self.inner.stopping.store(true, Ordering::SeqCst);
        self.request(&Request::Shutdown).await
    }

    /// Sends a request about container `id` and waits for the helper's answer about it (`None`: the helper died).
    async fn ask(&self, id: &str, req: &Request) -> Result<Option<(Event, Vec<OwnedFd>)>> {
        let mut rx = self.subscribe(id);
        let sent = self.request(req).await;
        let answer = match sent {
            Ok(()) => Ok(rx.recv().await),
            Err(e) => Err(e),
        };
        self.unsubscribe(id);
        answer
    }

    fn subscribe(&self, id: &str) -> mpsc::UnboundedReceiver<(Event, Vec<OwnedFd>)> {
        let (tx, rx) = mpsc::unbounded_channel();
        if self.is_alive() {
            lock(&self.inner.routes).insert(id.to_owned(), tx);
        }
        rx
    }

    fn unsubscribe(&self, id: &str) {
        lock(&self.inner.routes).remove(id);
    }

    async fn request(&self, req: &Request) -> Result<()> {
        if !self.is_alive() {
            return Err(Error::HelperGone);
        }
        let bytes = serde_json::to_vec(req).map_err(HelperError::Encode)?;
        loop {
            let mut guard = self
                .inner
                .sock
                .writable()
                .await
                .map_err(|e| Error::io("helper socket", e))?;
            match guard.try_io(|s| {
                ipc::send(s.get_ref().as_fd(), &bytes, &[]).map_err(std::io::Error::from)
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
            Ok(Ok(Some((n, fds)))) => match serde_json::from_slice::<Event>(&buf[..n]) {
                Ok(event) => {
                    let tx = lock(&inner.routes).get(event.id()).cloned();
                    match tx {
                        Some(tx) => {
                            let _ = tx.send((event, fds));
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
    inner.alive.send_replace(false);
    lock(&inner.routes).clear();
}

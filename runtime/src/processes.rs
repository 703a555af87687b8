//! The daemon's side of a serving init ([`crate::init::serve`]): starts programs in a long-lived container,
//! learns their pids and their ends, and signals them.
//!
//! One reader task owns the channel's incoming side: it matches each answer to the oldest request still waiting
//! (the init answers in order) and hands each program's end to whoever waits for it. Requests are sent one at a
//! time under a lock (so their order is the answers' order), on the blocking pool: a frozen init (a paused
//! sandbox) reads nothing, and a send into its full buffer waits there rather than on the async threads.

use std::collections::{HashMap, VecDeque};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::sync::{Arc, Mutex};

use nix::sys::signal::Signal;
use nix::sys::socket::MsgFlags;
use tokio::io::unix::AsyncFd;
use tokio::sync::{oneshot, watch};

use crate::init::serve::{
    EXITED, LIST, LISTED, NO_SUCH_PROCESS, REFUSED, RUNNING, SIGNAL, SIGNALLED, STARTED, SYNC,
    SYNCED,
};
use crate::init::ProgramExit;
use crate::launch::Launch;

/// Why a request to the serving init failed.
#[derive(Debug, thiserror::Error)]
pub enum ProcessError {
    /// The init refused the launch (the program could not be started: its reason).
    #[error("{0}")]
    Refused(String),
    /// The container has ended (or its init stopped answering).
    #[error("the sandbox's container has ended")]
    Gone,
    /// The request could not be sent.
    #[error("cannot send to the sandbox's init")]
    Send(#[source] crate::Error),
}

/// A started program.
#[derive(Debug)]
pub struct Started {
    /// Its pid in the container's pid namespace.
    pub pid: i32,
    /// Its end, once it has ended (`Signal(SIGKILL)` when the whole container ended first).
    pub exit: watch::Receiver<Option<ProgramExit>>,
}

/// A running program as a serving init lists it ([`Processes::list`]).
#[derive(Debug)]
pub struct Running {
    /// Its pid in the container's pid namespace.
    pub pid: i32,
    /// Where the init holds the daemon's ends of its stdin, stdout and stderr (`-1`: not held), for
    /// `pidfd_getfd(2)`.
    pub held: [i32; 3],
    /// Its end, once it has ended.
    pub exit: watch::Receiver<Option<ProgramExit>>,
}

/// An answer of the init.
#[derive(Debug)]
enum Answer {
    Started(i32, watch::Receiver<Option<ProgramExit>>),
    Refused(String),
    Signalled(bool),
    Listed(Vec<Running>),
    Synced,
}

#[derive(Default)]
struct State {
    /// Requests sent and not answered yet, oldest first.
    waiting: VecDeque<oneshot::Sender<Answer>>,
    /// The running programs' ends.
    ends: HashMap<i32, watch::Sender<Option<ProgramExit>>>,
    /// The channel is closed: nothing more will be answered.
    closed: bool,
    /// The programs listed so far in the answer to a `list` being read.
    listing: Vec<Running>,
    /// A new daemon's synchronisation: answers are dropped until `synced` with this token.
    syncing: Option<String>,
}

/// The programs of one serving container.
pub struct Processes {
    sock: Arc<OwnedFd>,
    /// Held while a request is sent and queued, so the queue's order is the channel's.
    sending: tokio::sync::Mutex<()>,
    state: Arc<Mutex<State>>,
    reader: tokio::task::JoinHandle<()>,
    /// Dropping shuts the channel down (ending the container's programs) unless [`Self::leave`] was called.
    shut_down_on_drop: std::sync::atomic::AtomicBool,
}

impl Processes {
    /// Serves the init at the other end of `sock`, a launch channel whose serving launch was sent. Must be called
    /// within a tokio runtime.
    pub fn new(sock: OwnedFd) -> std::io::Result<Self> {
        let sock = Arc::new(sock);
        // Reads use MSG_DONTWAIT: the descriptor itself stays blocking for the sends.
        // SAFETY: the descriptor is kept open by the Arc inside `ReadSide` for as long as the AsyncFd lives, and
        // is never replaced: it stays the same open file while registered.
        let readable = unsafe {
            AsyncFd::register_with_interest(ReadSide(sock.clone()), tokio::io::Interest::READABLE)
        }
        .map_err(std::io::Error::from)?;
        let state = Arc::new(Mutex::new(State::default()));
        let reader = tokio::spawn(read(readable, state.clone()));
        Ok(Self {
            sock,
            sending: tokio::sync::Mutex::new(()),
            state,
            reader,
            shut_down_on_drop: std::sync::atomic::AtomicBool::new(true),
        })
    }

    /// Takes over the channel of a kept serving init from a daemon that is gone (a copy of the daemon's end the
    /// init held): answers meant for that daemon are skipped, the ends the init reported meanwhile are kept for
    /// [`Self::list`]'s programs.
    pub async fn adopt(sock: OwnedFd) -> Result<Self, ProcessError> {
        let processes =
            Self::new(sock).map_err(|e| ProcessError::Send(crate::Error::io("channel", e)))?;
        let token = format!("{}", crate::init::monotonic_ns());
        lock(&processes.state).syncing = Some(token.clone());
        let text = format!("{SYNC}{token}");
        match processes.request_text(text).await? {
            Answer::Synced => Ok(processes),
            _ => Err(ProcessError::Gone),
        }
    }

    /// The programs running now, with where the init holds their pipes (a kept serving init).
    pub async fn list(&self) -> Result<Vec<Running>, ProcessError> {
        match self.request_text(LIST.to_owned()).await? {
            Answer::Listed(running) => Ok(running),
            Answer::Refused(why) => Err(ProcessError::Refused(why)),
            _ => Err(ProcessError::Gone),
        }
    }

    /// Leaves the channel open for a later daemon (live restore): dropping it then ends nothing.
    pub fn leave(&self) {
        self.shut_down_on_drop
            .store(false, std::sync::atomic::Ordering::SeqCst);
    }

    /// Starts `launch` (its program, arguments, environment and directory) with `stdio`. `held`: the daemon's
    /// ends of the program's pipes (stdin's write end, stdout's and stderr's read ends), for a kept serving init to
    /// hold until the program ends.
    pub async fn start(
        &self,
        launch: &Launch,
        stdio: [BorrowedFd<'_>; 3],
        held: Option<[BorrowedFd<'_>; 3]>,
    ) -> Result<Started, ProcessError> {
        let owned = |fds: [BorrowedFd<'_>; 3]| -> Result<[OwnedFd; 3], ProcessError> {
            let [a, b, c] = fds.map(|fd| fd.try_clone_to_owned());
            Ok([
                a.map_err(io_error)?,
                b.map_err(io_error)?,
                c.map_err(io_error)?,
            ])
        };
        let stdio = owned(stdio)?;
        let held = held.map(owned).transpose()?;
        let mut launch = launch.clone();
        launch.keep = held.is_some();
        let answer = self
            .request(move |sock| {
                let [a, b, c] = &stdio;
                let kept: Vec<BorrowedFd<'_>> = held.iter().flatten().map(|f| f.as_fd()).collect();
                crate::launch::send_keeping(sock, &launch, [a.as_fd(), b.as_fd(), c.as_fd()], &kept)
            })
            .await?;
        match answer {
            Answer::Started(pid, exit) => Ok(Started { pid, exit }),
            Answer::Refused(why) => Err(ProcessError::Refused(why)),
            _ => Err(ProcessError::Gone),
        }
    }

    /// Sends `signal` to a running program; `Ok(false)` when `pid` is not one.
    pub async fn signal(&self, pid: i32, signal: Signal) -> Result<bool, ProcessError> {
        let text = format!("{SIGNAL}{pid} {}", signal as i32);
        match self.request_text(text).await? {
            Answer::Signalled(delivered) => Ok(delivered),
            Answer::Refused(why) => Err(ProcessError::Refused(why)),
            _ => Err(ProcessError::Gone),
        }
    }

    /// Whether the channel is closed (the container ended).
    pub fn closed(&self) -> bool {
        lock(&self.state).closed
    }

    /// [`Self::request`] of a request that is only `text`.
    async fn request_text(&self, text: String) -> Result<Answer, ProcessError> {
        self.request(move |sock| {
            crate::ipc::send(sock, text.as_bytes(), &[]).map_err(|e| crate::Error::sys("send", e))
        })
        .await
    }

    /// Sends one request (on the blocking pool) and waits for its answer.
    async fn request(
        &self,
        send: impl FnOnce(BorrowedFd<'_>) -> crate::Result<()> + Send + 'static,
    ) -> Result<Answer, ProcessError> {
        let _order = self.sending.lock().await;
        let (tx, rx) = oneshot::channel();
        {
            let mut state = lock(&self.state);
            if state.closed {
                return Err(ProcessError::Gone);
            }
            state.waiting.push_back(tx);
        }
        let sock = self.sock.clone();
        let sent = tokio::task::spawn_blocking(move || send(sock.as_fd()))
            .await
            .unwrap_or_else(|e| Err(crate::Error::io("send", std::io::Error::other(e))));
        if let Err(e) = sent {
            // Ours is the newest request, and unsent: no answer will come for it.
            lock(&self.state).waiting.pop_back();
            return Err(ProcessError::Send(e));
        }
        drop(_order);
        rx.await.map_err(|_| ProcessError::Gone)
    }
}

/// Dropping it ends the container's programs: the channel is shut down (the init sees its end at once, whoever
/// else holds a copy of the descriptor), and the init kills everything in the container and exits.
impl Drop for Processes {
    fn drop(&mut self) {
        if self
            .shut_down_on_drop
            .load(std::sync::atomic::Ordering::SeqCst)
        {
            let _ =
                nix::sys::socket::shutdown(self.sock.as_raw_fd(), nix::sys::socket::Shutdown::Both);
        }
        self.reader.abort();
    }
}

/// The channel as the reactor watches it (a shared descriptor: the sends use it too).
struct ReadSide(Arc<OwnedFd>);

impl AsRawFd for ReadSide {
    fn as_raw_fd(&self) -> std::os::fd::RawFd {
        self.0.as_raw_fd()
    }
}

/// Reads the init's datagrams until the channel closes.
async fn read(sock: AsyncFd<ReadSide>, state: Arc<Mutex<State>>) {
    let mut buf = [0u8; 256];
    loop {
        let Ok(mut guard) = sock.readable().await else {
            break;
        };
        let got = guard.try_io(|s| {
            nix::sys::socket::recv(s.get_ref().as_raw_fd(), &mut buf, MsgFlags::MSG_DONTWAIT)
                .map_err(std::io::Error::from)
        });
        let n = match got {
            Ok(Ok(0)) | Ok(Err(_)) => break,
            Ok(Ok(n)) => n,
            Err(_would_block) => continue,
        };
        let Ok(text) = std::str::from_utf8(&buf[..n]) else {
            continue;
        };
        handle(&state, text);
    }
    let mut state = lock(&state);
    state.closed = true;
    state.waiting.clear();
    for (_, end) in state.ends.drain() {
        end.send_replace(Some(ProgramExit::Signal(Signal::SIGKILL as i32)));
    }
}

/// Acts on one datagram of the init.
fn handle(state: &Mutex<State>, text: &str) {
    let mut state = lock(state);
    if let Some(rest) = text.strip_prefix(EXITED) {
        let Some((pid, record)) = rest.split_once(' ') else {
            return;
        };
        let (Ok(pid), Some(exit)) = (pid.parse::<i32>(), ProgramExit::decode(record)) else {
            return;
        };
        if let Some(end) = state.ends.remove(&pid) {
            end.send_replace(Some(exit));
        }
        return;
    }
    if let Some(token) = state.syncing.clone() {
        // Answers for a daemon that is gone, until ours.
        if text.strip_prefix(SYNCED) == Some(token.as_str()) {
            state.syncing = None;
            if let Some(waiter) = state.waiting.pop_front() {
                let _ = waiter.send(Answer::Synced);
            }
        }
        return;
    }
    if let Some(rest) = text.strip_prefix(RUNNING) {
        let mut it = rest.split(' ').map(|n| n.parse::<i32>());
        if let (Some(Ok(pid)), Some(Ok(a)), Some(Ok(b)), Some(Ok(c))) =
            (it.next(), it.next(), it.next(), it.next())
        {
            let exit = state
                .ends
                .entry(pid)
                .or_insert_with(|| watch::channel(None).0)
                .subscribe();
            state.listing.push(Running {
                pid,
                held: [a, b, c],
                exit,
            });
        }
        return;
    }
    let answer = if text == LISTED {
        Answer::Listed(std::mem::take(&mut state.listing))
    } else if text.starts_with(SYNCED) {
        Answer::Synced
    } else if let Some(started) = text.strip_prefix(STARTED) {
        let pid = started.split(' ').next().unwrap_or_default();
        match pid.parse::<i32>() {
            Ok(pid) => {
                let (tx, rx) = watch::channel(None);
                state.ends.insert(pid, tx);
                Answer::Started(pid, rx)
            }
            Err(_) => Answer::Refused(format!("malformed answer {text:?}")),
        }
    } else if let Some(why) = text.strip_prefix(REFUSED) {
        Answer::Refused(why.to_owned())
    } else if text == SIGNALLED {
        Answer::Signalled(true)
    } else if text == NO_SUCH_PROCESS {
        Answer::Signalled(false)
    } else {
        Answer::Refused(format!("malformed answer {text:?}"))
    };
    if let Some(waiter) = state.waiting.pop_front() {
        let _ = waiter.send(answer);
    }
}

fn io_error(e: std::io::Error) -> ProcessError {
    ProcessError::Send(crate::Error::io("stdio", e))
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

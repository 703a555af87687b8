//! What a kept agent run's init holds for the daemon, so that a daemon killed or upgraded while the agent runs
//! can take the run back (live restore).
//!
//! A kept launch ([`crate::launch::Launch::keep`]) hands the init three descriptors besides the program's stdio:
//! the listener of the agent's control socket, the listener of the keeper's own socket (a `SOCK_SEQPACKET` socket
//! in the sandbox's directory on the host, out of the agent's reach), and the read end of its status pipe. A daemon
//! connects to the keeper's socket and hands the init the agent's control connection once the agent connected
//! ([`hand`]). The init never reads or writes any of them: it only holds them, so they outlive the daemon with what
//! is queued in them (the agent's lines the daemon has not read, the init's exit record), and the agent blocks on a
//! full socket rather than losing a line.
//!
//! It holds them at fixed descriptor numbers ([`CONTROL_FD`], [`STATUS_FD`], [`CONN_FD`]), where the next daemon
//! takes copies with `pidfd_getfd(2)` ([`collect`]): that needs nothing from the init, so it works while the
//! container is frozen (a paused agent stays paused through a restart). A new keeper connection replaces the
//! previous one.
//!
//! When the program has ended and no daemon is connected, the init kills what is left of the container and waits
//! up to [`LINGER`] for a daemon to connect (after collecting), and then ends as usual.

use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::sys::socket::{accept4, SockFlag};
use nix::unistd::Pid;

use crate::ipc;

/// How long an init whose program ended waits for a daemon to collect its exit record.
pub const LINGER: Duration = Duration::from_secs(600);
/// How often children are reaped while nothing else wakes the keeper.
const REAP_INTERVAL_MS: u16 = 100;
/// The message that hands the init the agent's control connection.
pub const CONN: &[u8] = b"conn";
/// Where the init holds the control socket's listener.
pub const CONTROL_FD: RawFd = 60;
/// Where the init holds the status pipe's read end.
pub const STATUS_FD: RawFd = 61;
/// Where the init holds the agent's control connection, once a daemon handed it over.
pub const CONN_FD: RawFd = 62;

/// The keeper's listener and the daemon connected now.
pub(crate) struct Keeper {
    listener: OwnedFd,
    /// The held descriptors, at their fixed numbers.
    held: Vec<OwnedFd>,
    daemon: Option<OwnedFd>,
}

/// `dup3(fd, at, O_CLOEXEC)`: `fd` moved to number `at`.
pub(super) fn hold_at(fd: OwnedFd, at: RawFd) -> Option<OwnedFd> {
    // SAFETY: dup3 takes two descriptor numbers and a flags word; the init's own descriptors are all below the
    // fixed numbers (stdio, the status pipe, the launch channel and what the launch carried), so `at` replaces
    // nothing but an earlier held copy.
    let moved = unsafe { libc::dup3(fd.as_raw_fd(), at, libc::O_CLOEXEC) };
    if moved != at {
        return None;
    }
    drop(fd);
    // SAFETY: `at` is the new descriptor dup3 made; nothing else owns it.
    Some(unsafe { OwnedFd::from_raw_fd(at) })
}

impl Keeper {
    /// From the kept launch's descriptors, in their order: control listener, keeper listener, status read end.
    /// `None` when they cannot be held at their numbers (`sandbox.nofile` under 64).
    pub(crate) fn new(kept: Vec<OwnedFd>) -> Option<Keeper> {
        let [control, listener, status]: [OwnedFd; 3] = kept.try_into().ok()?;
        let _ = nix::fcntl::fcntl(
            listener.as_raw_fd(),
            nix::fcntl::FcntlArg::F_SETFL(nix::fcntl::OFlag::O_NONBLOCK),
        );
        let held = vec![hold_at(control, CONTROL_FD)?, hold_at(status, STATUS_FD)?];
        Some(Keeper {
            listener,
            held,
            daemon: None,
        })
    }

    /// Serves daemons until `reaped` (called on every wake-up: it reaps the children that ended) reports the
    /// program's end; returns that report.
    pub(crate) fn run_until<T>(
        &mut self,
        program: Pid,
        mut reaped: impl FnMut() -> Option<T>,
    ) -> T {
        // Without a pidfd (it cannot fail for our own unreaped child) the keeper still ends: it reaps on a timer.
        let pidfd = crate::sys::pidfd_open(program).ok();
        loop {
            if let Some(exit) = reaped() {
                return exit;
            }
            self.serve(pidfd.as_ref(), PollTimeout::from(REAP_INTERVAL_MS));
        }
    }

    /// After the program's end (the exit record is on the status pipe): with a daemon connected, nothing more to
    /// do (it holds its own copies); without one, ends what is left of the container (`reap` reaps what ended) and
    /// waits up to `linger` for a daemon to connect and collect the descriptors.
    pub(crate) fn hand_over(mut self, linger: Duration, mut reap: impl FnMut()) {
        // Notice a daemon that went away (or came) while the program ended.
        self.settle();
        if self.daemon.is_some() {
            return;
        }
        // As pid 1 of the container's namespace: every other process there, which no daemon would ever stop.
        // SAFETY: kill(2) with pid -1 signals every process this one may signal: in its pid namespace, all but
        // itself. Nothing outside the namespace is visible to it.
        unsafe { libc::kill(-1, libc::SIGKILL) };
        let deadline = Instant::now() + linger;
        loop {
            // A daemon connects after it collected what the init holds; a link a dead one left queued is not one.
            self.settle();
            if self.daemon.is_some() {
                return;
            }
            // The killed processes, reaped as they end.
            reap();
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return;
            }
            let ms = left.as_millis().min(1000) as u16;
            self.serve(None, PollTimeout::from(ms));
        }
    }

    /// Takes every queued connection and message without waiting: the daemon left connected is alive.
    fn settle(&mut self) {
        // Bounded: a connection queued per earlier daemon, and a message or a hang-up of each.
        for _ in 0..64 {
            if !self.serve(None, PollTimeout::ZERO) {
                return;
            }
        }
    }

    /// One wait of at most `timeout` for a daemon connecting, the connected one's message, or the program's end;
    /// whether a daemon connected or the connected one sent something (or hung up).
    fn serve(&mut self, pidfd: Option<&OwnedFd>, timeout: PollTimeout) -> bool {
        let (accept, message) = {
            let mut fds = vec![PollFd::new(self.listener.as_fd(), PollFlags::POLLIN)];
            if let Some(d) = &self.daemon {
                fds.push(PollFd::new(d.as_fd(), PollFlags::POLLIN));
            }
            if let Some(p) = pidfd {
                fds.push(PollFd::new(p.as_fd(), PollFlags::POLLIN));
            }
            match poll(&mut fds, timeout) {
                Ok(_) | Err(Errno::EINTR) => {}
                Err(_) => return false,
            }
            let ready = |f: &PollFd| f.revents().is_some_and(|r| !r.is_empty());
            (ready(&fds[0]), self.daemon.is_some() && ready(&fds[1]))
        };
        if message {
            self.read_daemon();
        }
        if accept {
            self.accept_daemon();
        }
        accept || message
    }

    fn accept_daemon(&mut self) {
        let Ok(raw) = accept4(self.listener.as_raw_fd(), SockFlag::SOCK_CLOEXEC) else {
            return;
        };
        // SAFETY: accept4 returned a new descriptor that nothing else owns.
        let daemon = unsafe { OwnedFd::from_raw_fd(raw) };
        self.daemon = Some(daemon);
    }

    fn read_daemon(&mut self) {
        let Some(d) = &self.daemon else { return };
        let mut buf = [0u8; 16];
        match ipc::recv(d.as_fd(), &mut buf) {
            Ok(Some((n, mut fds))) if &buf[..n] == CONN && fds.len() == 1 => {
                if self.held.len() > 2 {
                    // The earlier connection's number is taken over by the new one (dup3 closes it).
                    let _ = self.held.pop().map(std::os::fd::IntoRawFd::into_raw_fd);
                }
                if let Some(conn) = fds.pop().and_then(|c| hold_at(c, CONN_FD)) {
                    self.held.push(conn);
                }
            }
            // Anything else from a daemon is ignored; its descriptors are closed.
            Ok(Some(_)) | Err(Errno::EINTR) | Err(Errno::EAGAIN) => {}
            Ok(None) | Err(_) => self.daemon = None,
        }
    }
}

/// The daemon's side: the keeper's listener at `path` (a `SOCK_SEQPACKET` socket only root may connect to), handed
/// to the init with the launch. A stale socket file is replaced.
pub fn listen(path: &std::path::Path) -> crate::Result<OwnedFd> {
    use nix::sys::socket::{bind, listen as listen_on, Backlog};
    let (sock, addr) = socket_for(path, SockFlag::SOCK_CLOEXEC)?;
    let _ = std::fs::remove_file(path);
    bind(sock.as_raw_fd(), &addr).map_err(|e| crate::Error::sys("bind(keeper)", e))?;
    std::fs::set_permissions(path, std::os::unix::fs::PermissionsExt::from_mode(0o600))
        .map_err(|e| crate::Error::io(path, e))?;
    listen_on(&sock, Backlog::new(16).unwrap_or(Backlog::MAXCONN))
        .map_err(|e| crate::Error::sys("listen(keeper)", e))?;
    Ok(sock)
}

/// What a daemon collects from a kept run's init.
#[derive(Debug)]
pub struct Collected {
    /// The control socket's listener.
    pub control: OwnedFd,
    /// The status pipe's read end.
    pub status: OwnedFd,
    /// The agent's control connection, if a daemon handed one over.
    pub conn: Option<OwnedFd>,
}

/// The daemon's side: copies of what the init behind `pidfd` holds (`pidfd_getfd(2)`: the init need not run).
pub fn collect(pidfd: std::os::fd::BorrowedFd<'_>) -> crate::Result<Collected> {
    let get = |fd: RawFd| crate::sys::pidfd_getfd(pidfd, fd);
    let control = get(CONTROL_FD).map_err(|e| crate::Error::sys("pidfd_getfd(control)", e))?;
    let status = get(STATUS_FD).map_err(|e| crate::Error::sys("pidfd_getfd(status)", e))?;
    let conn = match get(CONN_FD) {
        Ok(c) => Some(c),
        Err(Errno::EBADF) => None,
        Err(e) => return Err(crate::Error::sys("pidfd_getfd(connection)", e)),
    };
    Ok(Collected {
        control,
        status,
        conn,
    })
}

/// The daemon's side: a link to the init's keeper at `path` (for [`hand`]; an init whose program ended ends once
/// a daemon connected). Never waits for the init: a frozen one has not accepted the earlier daemons' links, and
/// once its backlog is full this fails with `EAGAIN` instead of blocking.
pub fn connect(path: &std::path::Path) -> crate::Result<OwnedFd> {
    use nix::sys::socket::connect as connect_to;
    let (sock, addr) = socket_for(path, SockFlag::SOCK_CLOEXEC | SockFlag::SOCK_NONBLOCK)?;
    connect_to(sock.as_raw_fd(), &addr).map_err(|e| crate::Error::sys("connect(keeper)", e))?;
    Ok(sock)
}

/// A `SOCK_SEQPACKET` socket with `flags`, and the address of `path`.
fn socket_for(
    path: &std::path::Path,
    flags: SockFlag,
) -> crate::Result<(OwnedFd, nix::sys::socket::UnixAddr)> {
    use nix::sys::socket::{socket, AddressFamily, SockType, UnixAddr};
    let sock = socket(AddressFamily::Unix, SockType::SeqPacket, flags, None)
        .map_err(|e| crate::Error::sys("socket(keeper)", e))?;
    let addr = UnixAddr::new(path).map_err(|e| crate::Error::sys("keeper socket path", e))?;
    Ok((sock, addr))
}

/// The daemon's side: hands the init the agent's control connection to hold.
pub fn hand(link: &OwnedFd, conn: std::os::fd::BorrowedFd<'_>) -> crate::Result<()> {
    ipc::send(link.as_fd(), CONN, &[conn]).map_err(|e| crate::Error::sys("send to the keeper", e))
}

//! The relayed warm interpreter's output. An interpreter that cannot take descriptors over a socket (node) keeps
//! the stdout and stderr pipes it started with; after the launch the init copies what arrives on them to the
//! launch's pipes, and closes each of the launch's pipes when its own reaches end of file (the program and
//! everything it started closed it), as the daemon would see with the program writing to it directly.
//!
//! The init stays single-threaded: one `poll` over the two pipes and a pidfd of the program, which is readable
//! once the program ended. Every child that ended is reaped on each wake-up, and at least every
//! [`REAP_INTERVAL_MS`], so orphans do not pile up as zombies. Once the program is reaped, what is still in the
//! pipes is copied and the relay ends (a process the program left behind dies with the init, as with a forked
//! program). A full launch pipe blocks the copy, which holds the program back as a full pipe would.

use std::os::fd::{AsFd, AsRawFd, OwnedFd};

use nix::errno::Errno;
use nix::fcntl::{fcntl, FcntlArg, OFlag};
use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::unistd::Pid;

/// How often children are reaped while nothing else wakes the relay.
const REAP_INTERVAL_MS: u16 = 100;
const CHUNK: usize = 64 << 10;

/// The interpreter's stdout and stderr (read ends) and the launch's (write ends).
pub(crate) struct Relay {
    from: [Option<OwnedFd>; 2],
    to: [Option<OwnedFd>; 2],
    /// One copy buffer for the relay's life (not one per wake-up).
    buf: Vec<u8>,
}

impl Relay {
    pub(crate) fn new(from: [OwnedFd; 2], to: [OwnedFd; 2]) -> Relay {
        let [a, b] = from;
        let [c, d] = to;
        Relay {
            from: [Some(a), Some(b)],
            to: [Some(c), Some(d)],
            buf: vec![0u8; CHUNK],
        }
    }

    /// Relays until `reaped` (called on every wake-up: it reaps the children that ended) reports the program's end,
    /// then copies what is left of its output; returns that report.
    pub(crate) fn run_until<T>(mut self, program: Pid, mut reaped: impl FnMut() -> Option<T>) -> T {
        for fd in self.from.iter().flatten() {
            let _ = fcntl(fd.as_raw_fd(), FcntlArg::F_SETFL(OFlag::O_NONBLOCK));
        }
        // Without a pidfd (it cannot fail for our own unreaped child) the relay still ends: it reaps on a timer.
        let pidfd = crate::sys::pidfd_open(program).ok();
        loop {
            if let Some(exit) = reaped() {
                for i in 0..2 {
                    self.copy(i);
                }
                return exit;
            }
            let mut fds: Vec<PollFd<'_>> = Vec::with_capacity(3);
            let mut which = Vec::with_capacity(3);
            if let Some(p) = &pidfd {
                fds.push(PollFd::new(p.as_fd(), PollFlags::POLLIN));
                which.push(None);
            }
            for (i, fd) in self.from.iter().enumerate() {
                if let Some(fd) = fd {
                    fds.push(PollFd::new(fd.as_fd(), PollFlags::POLLIN));
                    which.push(Some(i));
                }
            }
            match poll(&mut fds, PollTimeout::from(REAP_INTERVAL_MS)) {
                Ok(_) | Err(Errno::EINTR) => {}
                // Cannot happen with valid descriptors; reaping on each turn keeps the relay from hanging.
                Err(_) => continue,
            }
            let ready: Vec<usize> = fds
                .iter()
                .zip(&which)
                .filter(|(fd, _)| fd.revents().is_some_and(|r| !r.is_empty()))
                .filter_map(|(_, i)| *i)
                .collect();
            drop(fds);
            for i in ready {
                self.copy(i);
            }
        }
    }

    /// Copies what is in pipe `i` now; at end of file, closes it and the launch's pipe.
    fn copy(&mut self, i: usize) {
        let (Some(from), Some(to)) = (&self.from[i], &self.to[i]) else {
            return;
        };
        loop {
            match nix::unistd::read(from.as_raw_fd(), &mut self.buf) {
                Ok(0) => break,
                Ok(n) => {
                    if write_all(to, &self.buf[..n]).is_err() {
                        // The daemon closed its end: nothing more can be delivered.
                        break;
                    }
                }
                Err(Errno::EINTR) => continue,
                Err(_) => return,
            }
        }
        self.from[i] = None;
        self.to[i] = None;
    }
}

/// Writes all of `bytes`, waiting for room when `fd` is non-blocking and full.
pub(crate) fn write_all(fd: &OwnedFd, mut bytes: &[u8]) -> nix::Result<()> {
    while !bytes.is_empty() {
        match nix::unistd::write(fd, bytes) {
            Ok(n) => bytes = &bytes[n..],
            Err(Errno::EINTR) => {}
            Err(Errno::EAGAIN) => {
                let mut fds = [PollFd::new(fd.as_fd(), PollFlags::POLLOUT)];
                match poll(&mut fds, PollTimeout::NONE) {
                    Ok(_) | Err(Errno::EINTR) => {}
                    Err(e) => return Err(e),
                }
            }
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Copies all of `from` (read from offset 0, its offset untouched) into `to` at the same offsets.
pub(crate) fn copy_file(from: &OwnedFd, to: &OwnedFd) -> nix::Result<()> {
    let mut buf = vec![0u8; CHUNK];
    let mut offset: i64 = 0;
    loop {
        let n = match nix::sys::uio::pread(from, &mut buf, offset) {
            Ok(0) => return Ok(()),
            Ok(n) => n,
            Err(Errno::EINTR) => continue,
            Err(e) => return Err(e),
        };
        let mut done = 0;
        while done < n {
            match nix::sys::uio::pwrite(to, &buf[done..n], offset + done as i64) {
                Ok(k) => done += k,
                Err(Errno::EINTR) => {}
                Err(e) => return Err(e),
            }
        }
        offset += n as i64;
    }
}

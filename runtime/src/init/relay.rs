//! The relayed warm interpreter's output. An interpreter that cannot take descriptors over a socket (node) keeps
//! the stdout and stderr pipes it started with; after the launch the init copies what arrives on them to the
//! launch's pipes, and closes each of the launch's pipes when its own reaches end of file (the program and
//! everything it started closed it), as the daemon would see with the program writing to it directly.
//!
//! The init stays single-threaded: the pipes are polled with the program's end ([`super::ending::watch`]). Once the
//! program is reaped, what is still in the pipes is copied and the relay ends (a process the program left behind
//! dies with the init, as with a forked program); once the interpreter reported its end and nothing else is left,
//! what it wrote is copied and the launch's pipes are closed at once. A full launch pipe blocks the copy, which
//! holds the program back as a full pipe would.

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};

use nix::errno::Errno;
use nix::fcntl::{fcntl, FcntlArg, OFlag};
use nix::poll::{poll, PollFd, PollFlags, PollTimeout};

const CHUNK: usize = 64 << 10;

/// The interpreter's stdout and stderr (read ends) and the launch's (write ends).
pub(crate) struct Relay {
    from: [Option<OwnedFd>; 2],
    to: [Option<OwnedFd>; 2],
    /// One copy buffer for the relay's life (not one per wake-up).
    buf: Vec<u8>,
}

impl Relay {
    /// The interpreter's pipes are made non-blocking: a copy takes what is there and returns.
    pub(crate) fn new(from: [OwnedFd; 2], to: [OwnedFd; 2]) -> Relay {
        for fd in &from {
            let _ = fcntl(fd.as_raw_fd(), FcntlArg::F_SETFL(OFlag::O_NONBLOCK));
        }
        let [a, b] = from;
        let [c, d] = to;
        Relay {
            from: [Some(a), Some(b)],
            to: [Some(c), Some(d)],
            buf: vec![0u8; CHUNK],
        }
    }

    /// The interpreter's pipes still open, by index.
    pub(crate) fn open(&self) -> impl Iterator<Item = (usize, BorrowedFd<'_>)> {
        self.from
            .iter()
            .enumerate()
            .filter_map(|(i, fd)| fd.as_ref().map(|fd| (i, fd.as_fd())))
    }

    /// After the program was reaped: copies what is left (a pipe that some process the program left still holds
    /// is copied up to what is in it).
    pub(crate) fn finish(mut self) {
        for i in 0..2 {
            self.copy(i);
        }
    }

    /// After the interpreter reported its end with nothing else left in the container: copies what it wrote (its
    /// writes are done) and closes the launch's pipes without waiting for its exit to close its own ends.
    pub(crate) fn finish_reported(mut self) {
        for i in 0..2 {
            self.copy(i);
            self.from[i] = None;
            self.to[i] = None;
        }
    }

    /// Copies what is in pipe `i` now; at end of file, closes it and the launch's pipe.
    pub(crate) fn copy(&mut self, i: usize) {
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

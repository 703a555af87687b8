//! The program's stdio: stdin as a memfd holding the whole input, stdout and stderr as pipes read as the program
//! writes, chunked without splitting UTF-8 and counted against the output limit to the byte.

use std::os::fd::{AsRawFd, OwnedFd};

use protocol::{OutputChunk, ServerMessage, Utf8Chunker};
use tokio::io::AsyncReadExt;
use tracing::{error, warn};

/// Bytes read from a pipe at once; also the largest output chunk sent.
const READ_CHUNK: usize = 64 * 1024;

pub(super) struct Stdio {
    pub stdin: OwnedFd,
    pub stdout_r: OwnedFd,
    pub stdout_w: OwnedFd,
    pub stderr_r: OwnedFd,
    pub stderr_w: OwnedFd,
}

pub(super) fn make_stdio(input: &[u8]) -> nix::Result<Stdio> {
    use nix::fcntl::OFlag;
    let memfd = nix::sys::memfd::memfd_create(
        c"sandboxd-stdin",
        nix::sys::memfd::MemFdCreateFlag::MFD_CLOEXEC,
    )?;
    let mut written = 0;
    while written < input.len() {
        written += nix::unistd::write(&memfd, &input[written..])?;
    }
    nix::unistd::lseek(memfd.as_raw_fd(), 0, nix::unistd::Whence::SeekSet)?;
    let (stdout_r, stdout_w) = nix::unistd::pipe2(OFlag::O_CLOEXEC)?;
    let (stderr_r, stderr_w) = nix::unistd::pipe2(OFlag::O_CLOEXEC)?;
    Ok(Stdio {
        stdin: memfd,
        stdout_r,
        stdout_w,
        stderr_r,
        stderr_w,
    })
}

/// The program's stdout and stderr: read, chunked without splitting UTF-8, counted against the output limit.
pub(super) struct Streams {
    id: String,
    pipes: [Option<tokio::net::unix::pipe::Receiver>; 2],
    chunkers: [Utf8Chunker; 2],
    bufs: [Vec<u8>; 2],
    /// Raw bytes accepted for sending, per stream (stdout, stderr).
    pub sent: [u64; 2],
    limit: u64,
    pub truncated: bool,
}

impl Streams {
    pub fn new(id: &str, stdout: OwnedFd, stderr: OwnedFd, limit: u64) -> Self {
        let open = |fd: OwnedFd| match tokio::net::unix::pipe::Receiver::from_owned_fd(fd) {
            Ok(p) => Some(p),
            Err(e) => {
                error!(error = %e, "cannot watch an output pipe");
                None
            }
        };
        Self {
            id: id.to_owned(),
            pipes: [open(stdout), open(stderr)],
            chunkers: [Utf8Chunker::new(), Utf8Chunker::new()],
            bufs: [vec![0; READ_CHUNK], vec![0; READ_CHUNK]],
            sent: [0, 0],
            limit,
            truncated: false,
        }
    }

    /// Both pipes reached end of file (or were closed).
    pub fn done(&self) -> bool {
        self.pipes.iter().all(Option::is_none)
    }

    fn message(&self, which: usize, chunk: protocol::Chunk) -> ServerMessage {
        let c = OutputChunk::new(self.id.clone(), chunk);
        if which == 0 {
            ServerMessage::Stdout(c)
        } else {
            ServerMessage::Stderr(c)
        }
    }

    /// Stops reading both pipes; returns what the chunkers still held.
    pub fn close(&mut self) -> Vec<ServerMessage> {
        let mut out = Vec::new();
        for which in 0..2 {
            self.pipes[which] = None;
            if let Some(c) = self.chunkers[which].finish() {
                out.push(self.message(which, c));
            }
        }
        out
    }

    /// Waits for output on either pipe. Returns the messages to send and whether the output limit was crossed
    /// (then only the bytes up to the limit are in the messages, and reading stops).
    pub async fn read(&mut self) -> (Vec<ServerMessage>, bool) {
        let [out_pipe, err_pipe] = &mut self.pipes;
        let [out_buf, err_buf] = &mut self.bufs;
        let (which, res) = tokio::select! {
            r = read_pipe(out_pipe, out_buf) => (0, r),
            r = read_pipe(err_pipe, err_buf) => (1, r),
        };
        let n = match res {
            Ok(n) => n,
            Err(e) => {
                warn!(error = %e, stream = which, "reading program output failed");
                0
            }
        };
        if n == 0 {
            self.pipes[which] = None;
            let flushed = self.chunkers[which].finish();
            return (
                flushed
                    .map(|c| vec![self.message(which, c)])
                    .unwrap_or_default(),
                false,
            );
        }
        let room = self.limit.saturating_sub(self.sent[0] + self.sent[1]);
        let take = (n as u64).min(room) as usize;
        let over = take < n;
        self.sent[which] += take as u64;
        let mut msgs = Vec::new();
        if take > 0 {
            let bytes = self.bufs[which][..take].to_vec();
            if let Some(c) = self.chunkers[which].push(&bytes) {
                msgs.push(self.message(which, c));
            }
        }
        if over {
            self.truncated = true;
            msgs.extend(self.close());
        }
        (msgs, over)
    }
}

async fn read_pipe(
    pipe: &mut Option<tokio::net::unix::pipe::Receiver>,
    buf: &mut [u8],
) -> std::io::Result<usize> {
    match pipe {
        Some(p) => p.read(buf).await,
        None => std::future::pending().await,
    }
}

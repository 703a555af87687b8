//! The control connection's bytes, kept on the state disk from the moment they are read until their lines are
//! processed (live restore). A daemon killed between reading a line and processing it would otherwise lose it: the
//! socket has given it up, and the next daemon cannot read it again.
//!
//! Every chunk read from the agent's connection is appended to `control.spool` in the sandbox's directory before
//! the decoder sees it, and after each processed line its end (an offset in the connection's byte stream) is
//! written to `control.offset` (8 bytes, one `pwrite`). The spool starts with the stream offset of its first byte.
//! The next daemon decodes the spooled bytes past the processed offset first, then goes on reading the connection.
//! Once the spool holds more than [`COMPACT`] bytes, what is not processed yet (the lines read ahead, at most a read
//! and a line) is written to a new spool that replaces it by a rename: the spool never holds much more than that, an
//! agent that writes without newlines included (the decoder says when it skips such bytes).
//!
//! A chunk is appended before the socket gives it up: it is looked at first (`MSG_PEEK`), appended, and only then
//! taken (a read of exactly those bytes, there already). A daemon that dies between the append and the take leaves
//! the chunk both in the spool and in the socket: the next daemon processes its lines twice, never none (a thread
//! preempted between a plain read and its append, on a loaded host, lost a line in CI).

use std::fs::File;
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, ReadBuf};
use tracing::warn;

/// The spooled bytes, after the stream offset of the first (8 bytes, little-endian).
const SPOOL: &str = "control.spool";
/// How far lines are processed (a stream offset, 8 bytes, little-endian).
const OFFSETS: &str = "control.offset";
/// A spool past this size is cut down to its unprocessed bytes.
const COMPACT: u64 = 256 << 10;
/// The spool's header: the stream offset of its first byte.
const HEADER: u64 = 8;

struct State {
    dir: PathBuf,
    file: File,
    offsets: File,
    /// Stream offset of the spool's first byte.
    base: u64,
    /// Stream offset after the last byte spooled.
    written: u64,
    /// A write failed: said once.
    failed: bool,
}

/// A run's spool.
pub(super) struct Spool(Mutex<State>);

impl Spool {
    /// A new run's spool: empty, at stream offset 0.
    pub(super) fn create(dir: &Path) -> std::io::Result<Arc<Spool>> {
        let file = new_spool(dir, 0, &[])?;
        let offsets = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(dir.join(OFFSETS))?;
        offsets.write_all_at(&0u64.to_le_bytes(), 0)?;
        Ok(Arc::new(Spool(Mutex::new(State {
            dir: dir.to_owned(),
            file,
            offsets,
            base: 0,
            written: 0,
            failed: false,
        }))))
    }

    /// The spool a previous daemon left: it, the spooled bytes not processed yet (to decode first) and the stream
    /// offset they start at.
    pub(super) fn reopen(dir: &Path) -> std::io::Result<(Arc<Spool>, Vec<u8>, u64)> {
        // Left positioned at its end (by the read of the rest), where appends go.
        let mut file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(dir.join(SPOOL))?;
        let offsets = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(dir.join(OFFSETS))?;
        let mut raw = [0u8; 8];
        file.read_exact_at(&mut raw, 0)?;
        let base = u64::from_le_bytes(raw);
        let processed = match offsets.read_exact_at(&mut raw, 0) {
            Ok(()) => u64::from_le_bytes(raw),
            Err(_) => base,
        };
        let len = file.seek(SeekFrom::End(0))?.saturating_sub(HEADER);
        let written = base + len;
        let start = processed.clamp(base, written);
        let mut rest = Vec::new();
        file.seek(SeekFrom::Start(HEADER + (start - base)))?;
        file.read_to_end(&mut rest)?;
        let spool = Spool(Mutex::new(State {
            dir: dir.to_owned(),
            file,
            offsets,
            base,
            written,
            failed: false,
        }));
        Ok((Arc::new(spool), rest, start))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Appends bytes just read from the connection.
    fn append(&self, bytes: &[u8]) {
        let mut s = self.lock();
        match s.file.write_all(bytes) {
            Ok(()) => s.written += bytes.len() as u64,
            Err(e) => s.fail(e),
        }
    }

    /// Every byte up to stream offset `end` is processed.
    pub(super) fn processed(&self, end: u64) {
        let mut s = self.lock();
        if let Err(e) = s.offsets.write_all_at(&end.to_le_bytes(), 0) {
            s.fail(e);
            return;
        }
        if s.written - s.base > COMPACT {
            if let Err(e) = s.compact(end) {
                s.fail(e);
            }
        }
    }
}

impl State {
    /// Replaces the spool with one holding only what is past `end`.
    fn compact(&mut self, end: u64) -> std::io::Result<()> {
        let end = end.clamp(self.base, self.written);
        let mut rest = vec![0u8; (self.written - end) as usize];
        self.file
            .read_exact_at(&mut rest, HEADER + (end - self.base))?;
        self.file = new_spool(&self.dir, end, &rest)?;
        self.base = end;
        Ok(())
    }

    fn fail(&mut self, e: std::io::Error) {
        if !self.failed {
            self.failed = true;
            warn!(error = %e, "the control spool cannot be written: lines read when the daemon dies may be lost");
        }
    }
}

/// Writes a spool starting at stream offset `base` holding `bytes` (a temporary file renamed into place), open for
/// appending.
fn new_spool(dir: &Path, base: u64, bytes: &[u8]) -> std::io::Result<File> {
    let tmp = dir.join(format!("{SPOOL}.new"));
    // Written at its position, which stays at the end: reads are `pread`s.
    let mut f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&tmp)?;
    f.write_all(&base.to_le_bytes())?;
    f.write_all(bytes)?;
    std::fs::rename(&tmp, dir.join(SPOOL))?;
    Ok(f)
}

/// A byte stream whose next bytes can be looked at before they are taken.
pub(super) trait Peek: Unpin {
    /// Copies what can be read now into `buf` without taking it; pending until something can be read; nothing
    /// copied at the end of the stream.
    fn poll_peek(
        &mut self,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>>;

    /// Takes the `n` bytes the last peek copied (they are there already: nothing else reads the stream).
    fn take(&mut self, n: usize) -> std::io::Result<()>;
}

impl Peek for tokio::net::unix::OwnedReadHalf {
    fn poll_peek(
        &mut self,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        use std::os::fd::AsRawFd;
        let stream: &tokio::net::UnixStream = self.as_ref();
        loop {
            std::task::ready!(stream.poll_read_ready(cx))?;
            let unfilled = buf.initialize_unfilled();
            let peeked = stream.try_io(tokio::io::Interest::READABLE, || {
                // SAFETY: recv writes at most `unfilled.len()` bytes into `unfilled`, which outlives the call.
                let n = unsafe {
                    libc::recv(
                        stream.as_raw_fd(),
                        unfilled.as_mut_ptr().cast(),
                        unfilled.len(),
                        libc::MSG_PEEK | libc::MSG_DONTWAIT,
                    )
                };
                usize::try_from(n).map_err(|_| std::io::Error::last_os_error())
            });
            match peeked {
                Ok(n) => {
                    buf.advance(n);
                    return Poll::Ready(Ok(()));
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
                Err(e) => return Poll::Ready(Err(e)),
            }
        }
    }

    fn take(&mut self, mut n: usize) -> std::io::Result<()> {
        let stream: &tokio::net::UnixStream = self.as_ref();
        let mut scratch = [0u8; 8192];
        while n > 0 {
            let k = n.min(scratch.len());
            match stream.try_read(&mut scratch[..k])? {
                0 => return Err(std::io::ErrorKind::UnexpectedEof.into()),
                got => n -= got,
            }
        }
        Ok(())
    }
}

/// A slice (for tests): peeking copies, taking advances.
impl Peek for &[u8] {
    fn poll_peek(
        &mut self,
        _: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let n = self.len().min(buf.remaining());
        buf.put_slice(&self[..n]);
        Poll::Ready(Ok(()))
    }

    fn take(&mut self, n: usize) -> std::io::Result<()> {
        *self = &self[n.min(self.len())..];
        Ok(())
    }
}

/// A reader whose every chunk goes to the spool before the stream gives it up ([`Peek`]).
pub(super) struct Spooled<R> {
    inner: R,
    spool: Arc<Spool>,
}

impl<R> Spooled<R> {
    pub(super) fn new(inner: R, spool: Arc<Spool>) -> Self {
        Self { inner, spool }
    }
}

impl<R: Peek> AsyncRead for Spooled<R> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        std::task::ready!(self.inner.poll_peek(cx, buf))?;
        let n = buf.filled().len() - before;
        if n > 0 {
            let this = &mut *self;
            this.spool.append(&buf.filled()[before..]);
            if let Err(e) = this.inner.take(n) {
                buf.set_filled(before);
                return Poll::Ready(Err(e));
            }
        }
        Poll::Ready(Ok(()))
    }
}

#[cfg(test)]
mod tests {
    use tokio::io::AsyncReadExt;

    use super::*;

    #[tokio::test]
    async fn unprocessed_bytes_come_back_and_processed_ones_do_not() {
        let t = tempfile::tempdir().unwrap();
        let spool = Spool::create(t.path()).unwrap();
        let mut r = Spooled::new(&b"one\ntwo\nthr"[..], spool.clone());
        let mut got = Vec::new();
        r.read_to_end(&mut got).await.unwrap();
        spool.processed(4);
        drop((r, spool));
        let (spool, rest, start) = Spool::reopen(t.path()).unwrap();
        assert_eq!((rest.as_slice(), start), (&b"two\nthr"[..], 4));
        // Going on past the compaction size, with the last bytes not processed: only they are kept.
        spool.append(&vec![b'x'; COMPACT as usize]);
        spool.append(b"tail");
        let end = 11 + COMPACT;
        spool.processed(end);
        let size = std::fs::metadata(t.path().join(SPOOL)).unwrap().len();
        assert_eq!(size, HEADER + 4, "cut down to the unprocessed bytes");
        spool.append(b"more");
        drop(spool);
        let (_, rest, start) = Spool::reopen(t.path()).unwrap();
        assert_eq!((rest.as_slice(), start), (&b"tailmore"[..], end));
        // A new run starts empty.
        Spool::create(t.path()).unwrap();
        let (_, rest, start) = Spool::reopen(t.path()).unwrap();
        assert_eq!((rest.len(), start), (0, 0));
    }
}

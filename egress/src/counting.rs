//! The proxy's counters, and the upstream stream wrapper that counts bytes and enforces the byte limit.

use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// Counters shared by every connection of one proxy.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub(crate) connections: AtomicU64,
    pub(crate) upstream_connections: AtomicU64,
    pub(crate) refused: AtomicU64,
    pub(crate) bytes_sent: AtomicU64,
    pub(crate) bytes_received: AtomicU64,
    /// Sent plus received, the quantity the limit bounds.
    pub(crate) bytes_total: AtomicU64,
}

impl Counters {
    /// Whether the byte limit is used up.
    pub(crate) fn exhausted(&self, limit: Option<u64>) -> bool {
        limit.is_some_and(|l| self.bytes_total.load(Ordering::Relaxed) >= l)
    }

    /// Adds `n` bytes; false when the total now exceeds the limit.
    fn add(&self, n: usize, limit: Option<u64>, direction: &AtomicU64) -> bool {
        let n = n as u64;
        direction.fetch_add(n, Ordering::Relaxed);
        let total = self.bytes_total.fetch_add(n, Ordering::Relaxed) + n;
        limit.is_none_or(|l| total <= l)
    }
}

fn limit_error() -> io::Error {
    io::Error::new(
        io::ErrorKind::ConnectionAborted,
        "egress byte limit reached",
    )
}

/// A stream to the outside whose bytes are counted; once the proxy's total exceeds the limit every read and write
/// fails, which closes the connection it belongs to.
pub(crate) struct Counted<S> {
    inner: S,
    counters: Arc<Counters>,
    limit: Option<u64>,
}

impl<S> Counted<S> {
    pub(crate) fn new(inner: S, counters: Arc<Counters>, limit: Option<u64>) -> Counted<S> {
        Counted {
            inner,
            counters,
            limit,
        }
    }
}

impl<S> Counted<S> {
    /// How many more bytes may cross, or the limit error when none may.
    fn budget(&self) -> io::Result<usize> {
        match self.limit {
            Some(l) => match l.saturating_sub(self.counters.bytes_total.load(Ordering::Relaxed)) {
                0 => Err(limit_error()),
                left => Ok(usize::try_from(left).unwrap_or(usize::MAX)),
            },
            None => Ok(usize::MAX),
        }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Counted<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let budget = match self.budget() {
            Ok(budget) => budget,
            Err(e) => return Poll::Ready(Err(e)),
        };
        // Never read past the limit: the read is cut to what is left of it.
        let max = buf.remaining().min(budget);
        let this = &mut *self;
        let mut limited = ReadBuf::new(buf.initialize_unfilled_to(max));
        match Pin::new(&mut this.inner).poll_read(cx, &mut limited) {
            Poll::Ready(Ok(())) => {
                let n = limited.filled().len();
                if this
                    .counters
                    .add(n, this.limit, &this.counters.bytes_received)
                {
                    buf.advance(n);
                    Poll::Ready(Ok(()))
                } else {
                    // Another connection of the proxy used the budget meanwhile.
                    Poll::Ready(Err(limit_error()))
                }
            }
            other => other,
        }
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Counted<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let allowed = match self.budget() {
            Ok(budget) => buf.len().min(budget),
            Err(e) => return Poll::Ready(Err(e)),
        };
        // Never send past the limit: a write is cut to what is left of it.
        let this = &mut *self;
        match Pin::new(&mut this.inner).poll_write(cx, &buf[..allowed]) {
            Poll::Ready(Ok(n)) => {
                this.counters.add(n, None, &this.counters.bytes_sent);
                Poll::Ready(Ok(n))
            }
            other => other,
        }
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

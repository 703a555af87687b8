//! The proxy's counters, and the upstream stream wrapper that counts bytes and enforces the byte limit.

use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// Where a proxy records how many bytes (sent plus received) it may have spent in all, before it spends them: a
/// proxy made again after a crash from [`Ledger::spent`] then never counts fewer bytes than were exchanged.
pub trait Reserve: Send + Sync + 'static {
    /// Records `total` as the bytes spent so far at most. Called with a proxy-wide lock held, from inside a
    /// read or write of a connection: it should be a small synchronous write. An error refuses the bytes (the
    /// connection is closed as by the byte limit).
    fn reserve(&self, total: u64) -> io::Result<()>;
}

/// A proxy's byte limit kept across proxies ([`crate::Proxy::with_ledger`]): what an earlier proxy reserved counts
/// as spent, and bytes are reserved `chunk` at a time (a read or write moves at most what is reserved: the bytes
/// recorded are never more than a chunk above the bytes moved, reads and writes under way aside).
#[derive(Clone)]
pub struct Ledger {
    /// Bytes an earlier proxy reserved: spent before this one starts.
    pub spent: u64,
    /// Bytes reserved at a time.
    pub chunk: u64,
    /// Where reservations are recorded.
    pub reserve: Arc<dyn Reserve>,
}

impl std::fmt::Debug for Ledger {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ledger")
            .field("spent", &self.spent)
            .field("chunk", &self.chunk)
            .finish_non_exhaustive()
    }
}

/// Claims on the reserved bytes: a read or write claims what it may move before it moves it, and gives back what
/// it did not move once it returns, so the bytes moved never pass the bytes recorded.
#[derive(Debug)]
struct Reservations {
    ledger: Ledger,
    /// Bytes recorded with [`Reserve::reserve`].
    reserved: AtomicU64,
    /// Bytes moved, plus the claims of reads and writes under way: never above `reserved`.
    claimed: AtomicU64,
    /// One reservation at a time.
    reserving: std::sync::Mutex<()>,
}

/// Counters shared by every connection of one proxy.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub(crate) connections: AtomicU64,
    pub(crate) upstream_connections: AtomicU64,
    pub(crate) refused: AtomicU64,
    pub(crate) bytes_sent: AtomicU64,
    pub(crate) bytes_received: AtomicU64,
    /// Sent plus received, the quantity the limit bounds (with a ledger, starting from what was spent before).
    pub(crate) bytes_total: AtomicU64,
    reservations: Option<Reservations>,
}

impl Counters {
    /// Counters whose bytes are reserved in `ledger` before they are moved, starting from its `spent`.
    pub(crate) fn with_ledger(ledger: Ledger) -> Counters {
        let spent = ledger.spent;
        Counters {
            bytes_total: AtomicU64::new(spent),
            reservations: Some(Reservations {
                ledger,
                reserved: AtomicU64::new(spent),
                claimed: AtomicU64::new(spent),
                reserving: std::sync::Mutex::new(()),
            }),
            ..Counters::default()
        }
    }

    /// Whether the bytes are reserved in a ledger.
    pub(crate) fn has_ledger(&self) -> bool {
        self.reservations.is_some()
    }

    /// Claims up to `want` bytes for one read or write (`want` itself without a ledger), reserving more first when
    /// the reservation is used up; at most `limit` in all.
    fn claim(&self, want: usize, limit: Option<u64>) -> io::Result<usize> {
        let Some(r) = &self.reservations else {
            return Ok(want);
        };
        let want = want as u64;
        let mut waits = 0;
        loop {
            let claimed = r.claimed.load(Ordering::Acquire);
            let reserved = r.reserved.load(Ordering::Acquire);
            if claimed < reserved || want == 0 {
                let granted = want.min(reserved.saturating_sub(claimed));
                if r.claimed
                    .compare_exchange(
                        claimed,
                        claimed + granted,
                        Ordering::AcqRel,
                        Ordering::Acquire,
                    )
                    .is_ok()
                {
                    return Ok(usize::try_from(granted).unwrap_or(usize::MAX));
                }
                continue;
            }
            let _one = r.reserving.lock().unwrap_or_else(|p| p.into_inner());
            let reserved = r.reserved.load(Ordering::Acquire);
            if r.claimed.load(Ordering::Acquire) < reserved {
                continue; // another reservation came first
            }
            let next = reserved.saturating_add(r.ledger.chunk.max(1));
            let next = limit.map_or(next, |l| next.min(l));
            if next <= reserved {
                // At the limit. What other reads and writes claimed and have not moved yet comes back when their
                // poll returns (a claim lasts one poll): wait for that a little before calling the limit reached.
                if self.bytes_total.load(Ordering::Acquire) < reserved && waits < MAX_WAITS {
                    waits += 1;
                    drop(_one);
                    std::thread::yield_now();
                    continue;
                }
                return Err(limit_error());
            }
            // A small synchronous write, at most once a chunk: a worker thread of a multi-threaded runtime hands
            // its other tasks over while it waits.
            let reserve = || r.ledger.reserve.reserve(next);
            match tokio::runtime::Handle::try_current().map(|h| h.runtime_flavor()) {
                Ok(tokio::runtime::RuntimeFlavor::MultiThread) => {
                    tokio::task::block_in_place(reserve)
                }
                _ => reserve(),
            }?;
            r.reserved.store(next, Ordering::Release);
        }
    }

    /// Gives back the part of a claim that was not moved.
    fn unclaim(&self, n: usize) {
        if let (Some(r), true) = (&self.reservations, n > 0) {
            r.claimed.fetch_sub(n as u64, Ordering::AcqRel);
        }
    }

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

/// How often a claim at the limit waits for the claims of other reads and writes under way to come back.
const MAX_WAITS: u32 = 64;

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
        // Never read past the limit: the read is cut to what is left of it, and to what it could claim.
        let max = buf.remaining().min(budget);
        let this = &mut *self;
        let claimed = match this.counters.claim(max, this.limit) {
            Ok(c) => c,
            Err(e) => return Poll::Ready(Err(e)),
        };
        let mut limited = ReadBuf::new(buf.initialize_unfilled_to(claimed));
        let polled = Pin::new(&mut this.inner).poll_read(cx, &mut limited);
        let n = match &polled {
            Poll::Ready(Ok(())) => limited.filled().len(),
            _ => 0,
        };
        this.counters.unclaim(claimed - n);
        match polled {
            Poll::Ready(Ok(())) => {
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
        // Never send past the limit: a write is cut to what is left of it, and to what it could claim.
        let this = &mut *self;
        let claimed = match this.counters.claim(allowed, this.limit) {
            Ok(c) => c,
            Err(e) => return Poll::Ready(Err(e)),
        };
        let polled = Pin::new(&mut this.inner).poll_write(cx, &buf[..claimed]);
        let n = match &polled {
            Poll::Ready(Ok(n)) => *n,
            _ => 0,
        };
        this.counters.unclaim(claimed - n);
        match polled {
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

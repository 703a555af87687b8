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

/// A ledger's state: what is recorded in it so far.
#[derive(Debug)]
struct Reservations {
    ledger: Ledger,
    /// Bytes recorded with [`Reserve::reserve`]: what claims may reach.
    reserved: AtomicU64,
    /// One reservation at a time.
    reserving: std::sync::Mutex<()>,
}

/// Counters shared by every connection of one proxy.
///
/// The byte limit is a reservation: a read or write claims what it may move before it moves it (never more than
/// the limit less the bytes moved and claimed by every other connection), and gives back what it did not move once
/// it returns. Connections together thus never move more than the limit, however many there are.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub(crate) connections: AtomicU64,
    pub(crate) upstream_connections: AtomicU64,
    pub(crate) refused: AtomicU64,
    pub(crate) bytes_sent: AtomicU64,
    pub(crate) bytes_received: AtomicU64,
    /// Sent plus received, the quantity the limit bounds (with a ledger, starting from what was spent before).
    pub(crate) bytes_total: AtomicU64,
    /// Bytes moved, plus the claims of reads and writes under way: never above the limit, nor above what the
    /// ledger recorded.
    claimed: AtomicU64,
    reservations: Option<Reservations>,
}

impl Counters {
    /// Counters whose bytes are reserved in `ledger` before they are moved, starting from its `spent`.
    pub(crate) fn with_ledger(ledger: Ledger) -> Counters {
        let spent = ledger.spent;
        Counters {
            bytes_total: AtomicU64::new(spent),
            claimed: AtomicU64::new(spent),
            reservations: Some(Reservations {
                ledger,
                reserved: AtomicU64::new(spent),
                reserving: std::sync::Mutex::new(()),
            }),
            ..Counters::default()
        }
    }

    /// Whether the bytes are reserved in a ledger.
    pub(crate) fn has_ledger(&self) -> bool {
        self.reservations.is_some()
    }

    /// Claims up to `want` bytes for one read or write, at most `limit` moved and claimed in all (and, with a
    /// ledger, at most what it recorded, recording more first when that is used up). The claim lasts one poll:
    /// [`Counters::unclaim`] gives back what was not moved.
    fn claim(&self, want: usize, limit: Option<u64>) -> io::Result<usize> {
        let want = want as u64;
        let mut waits = 0;
        loop {
            let claimed = self.claimed.load(Ordering::Acquire);
            let ceiling = match &self.reservations {
                Some(r) => r.reserved.load(Ordering::Acquire),
                None => limit.unwrap_or(u64::MAX),
            };
            if claimed < ceiling || want == 0 {
                let granted = want.min(ceiling.saturating_sub(claimed));
                if self
                    .claimed
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
            if let Some(r) = &self.reservations {
                if self.reserve_more(r, limit)? {
                    continue;
                }
            }
            // At the limit. What other reads and writes claimed and have not moved yet comes back when their poll
            // returns: wait for that a little before calling the limit reached.
            if self.bytes_total.load(Ordering::Acquire) < ceiling && waits < MAX_WAITS {
                waits += 1;
                std::thread::yield_now();
                continue;
            }
            return Err(limit_error());
        }
    }

    /// Records a chunk more in the ledger, unless another claim did meanwhile; false when the limit is reserved.
    fn reserve_more(&self, r: &Reservations, limit: Option<u64>) -> io::Result<bool> {
        let _one = r.reserving.lock().unwrap_or_else(|p| p.into_inner());
        let reserved = r.reserved.load(Ordering::Acquire);
        if self.claimed.load(Ordering::Acquire) < reserved {
            return Ok(true); // another reservation came first
        }
        let next = reserved.saturating_add(r.ledger.chunk.max(1));
        let next = limit.map_or(next, |l| next.min(l));
        if next <= reserved {
            return Ok(false);
        }
        // A small synchronous write, at most once a chunk: a worker thread of a multi-threaded runtime hands its
        // other tasks over while it waits.
        let reserve = || r.ledger.reserve.reserve(next);
        match tokio::runtime::Handle::try_current().map(|h| h.runtime_flavor()) {
            Ok(tokio::runtime::RuntimeFlavor::MultiThread) => tokio::task::block_in_place(reserve),
            _ => reserve(),
        }?;
        r.reserved.store(next, Ordering::Release);
        Ok(true)
    }

    /// Gives back the part of a claim that was not moved.
    fn unclaim(&self, n: usize) {
        if n > 0 {
            self.claimed.fetch_sub(n as u64, Ordering::AcqRel);
        }
    }

    /// Whether the byte limit is used up.
    pub(crate) fn exhausted(&self, limit: Option<u64>) -> bool {
        limit.is_some_and(|l| self.bytes_total.load(Ordering::Relaxed) >= l)
    }

    /// Adds `n` moved bytes (claimed before they moved).
    fn add(&self, n: usize, direction: &AtomicU64) {
        let n = n as u64;
        direction.fetch_add(n, Ordering::Relaxed);
        self.bytes_total.fetch_add(n, Ordering::AcqRel);
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

impl<S: AsyncRead + Unpin> AsyncRead for Counted<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        // Never read past the limit: the read is cut to what it could claim.
        let this = &mut *self;
        let claimed = match this.counters.claim(buf.remaining(), this.limit) {
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
        if n > 0 {
            this.counters.add(n, &this.counters.bytes_received);
            buf.advance(n);
        }
        polled
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Counted<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        // Never send past the limit: a write is cut to what it could claim.
        let this = &mut *self;
        let claimed = match this.counters.claim(buf.len(), this.limit) {
            Ok(c) => c,
            Err(e) => return Poll::Ready(Err(e)),
        };
        let polled = Pin::new(&mut this.inner).poll_write(cx, &buf[..claimed]);
        let n = match &polled {
            Poll::Ready(Ok(n)) => *n,
            _ => 0,
        };
        this.counters.unclaim(claimed - n);
        if n > 0 {
            this.counters.add(n, &this.counters.bytes_sent);
        }
        polled
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Barrier;
    use std::time::Duration;

    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    /// An upstream that holds each read and write for `hold` before it completes (so concurrent connections are
    /// all inside one at once), moves at most `max` bytes each, and counts what it moved.
    struct Slow {
        moved: Arc<AtomicU64>,
        max: usize,
        hold: Duration,
    }

    impl Slow {
        fn hold(&self, len: usize) -> usize {
            std::thread::sleep(self.hold);
            let n = len.min(self.max);
            self.moved.fetch_add(n as u64, Ordering::SeqCst);
            n
        }
    }

    impl AsyncWrite for Slow {
        fn poll_write(
            self: Pin<&mut Self>,
            _: &mut Context<'_>,
            buf: &[u8],
        ) -> Poll<io::Result<usize>> {
            Poll::Ready(Ok(self.hold(buf.len())))
        }
        fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
            Poll::Ready(Ok(()))
        }
        fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
            Poll::Ready(Ok(()))
        }
    }

    impl AsyncRead for Slow {
        fn poll_read(
            self: Pin<&mut Self>,
            _: &mut Context<'_>,
            buf: &mut ReadBuf<'_>,
        ) -> Poll<io::Result<()>> {
            let n = self.hold(buf.remaining());
            buf.put_slice(&vec![b'x'; n]);
            Poll::Ready(Ok(()))
        }
    }

    struct Unrecorded;

    impl Reserve for Unrecorded {
        fn reserve(&self, _: u64) -> io::Result<()> {
            Ok(())
        }
    }

    const LIMIT: u64 = 10_000;
    const CONNECTIONS: usize = 4;
    /// Long enough for every connection to be inside its first read or write while the others are.
    const HOLD: Duration = Duration::from_millis(100);

    /// `CONNECTIONS` connections of one proxy, each on a thread of its own, start moving `LIMIT` bytes at the same
    /// moment through an upstream that takes `max` bytes per read or write, each after `hold`; returns the bytes the
    /// upstream moved and the bytes the counters counted.
    fn concurrently(counters: Counters, reading: bool, max: usize, hold: Duration) -> (u64, u64) {
        let counters = Arc::new(counters);
        let moved = Arc::new(AtomicU64::new(0));
        let start = Arc::new(Barrier::new(CONNECTIONS));
        let threads: Vec<_> = (0..CONNECTIONS)
            .map(|_| {
                let upstream = Slow {
                    moved: moved.clone(),
                    max,
                    hold,
                };
                let mut counted = Counted::new(upstream, counters.clone(), Some(LIMIT));
                let start = start.clone();
                std::thread::spawn(move || {
                    let runtime = tokio::runtime::Builder::new_current_thread()
                        .build()
                        .unwrap();
                    start.wait();
                    let mut buf = vec![0u8; LIMIT as usize];
                    // Until the limit stops it (the error is what a connection past the limit gets).
                    runtime.block_on(async {
                        loop {
                            let r = match reading {
                                true => counted.read(&mut buf).await,
                                false => counted.write(&buf).await,
                            };
                            if r.is_err() {
                                break;
                            }
                        }
                    });
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        let counted = counters.bytes_total.load(Ordering::SeqCst) - counters.spent();
        (moved.load(Ordering::SeqCst), counted)
    }

    impl Counters {
        fn spent(&self) -> u64 {
            self.reservations.as_ref().map_or(0, |r| r.ledger.spent)
        }
    }

    fn ledgered() -> Counters {
        Counters::with_ledger(Ledger {
            spent: 0,
            chunk: 4096,
            reserve: Arc::new(Unrecorded),
        })
    }

    #[test]
    fn concurrent_writers_never_exceed_the_limit_together() {
        for (name, counters) in [("no ledger", Counters::default()), ("ledger", ledgered())] {
            let (moved, counted) = concurrently(counters, false, usize::MAX, HOLD);
            assert!(
                moved <= LIMIT,
                "{name}: {moved} bytes sent through a {LIMIT}-byte limit"
            );
            assert_eq!(moved, counted, "{name}");
        }
    }

    #[test]
    fn concurrent_readers_never_exceed_the_limit_together() {
        for (name, counters) in [("no ledger", Counters::default()), ("ledger", ledgered())] {
            let (moved, counted) = concurrently(counters, true, usize::MAX, HOLD);
            assert!(
                moved <= LIMIT,
                "{name}: {moved} bytes read through a {LIMIT}-byte limit"
            );
            assert_eq!(moved, counted, "{name}");
        }
    }

    /// Each write claims what is left and the upstream takes 1000 bytes of it: the rest goes back, and the limit is
    /// used to the byte by the connections together.
    #[test]
    fn what_a_write_did_not_send_is_given_back() {
        let (moved, counted) =
            concurrently(Counters::default(), false, 1000, Duration::from_millis(5));
        assert_eq!((moved, counted), (LIMIT, LIMIT));
    }
}

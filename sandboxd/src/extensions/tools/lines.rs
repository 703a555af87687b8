//! Request lines from the tool socket, read as bytes and held within the execution's memory budget.
//!
//! A line is collected byte for byte (never decoded here: a line that is not UTF-8 is still one line, which the
//! broker answers with `invalid`). Its buffer is charged to the execution's [`Budget`] as it grows, and the
//! [`Lease`] that holds the bytes travels with the request until its reply is written. A line that does not fit
//! in what is left of the budget is read to its end and dropped ([`Frame::OverBudget`]); a line longer than
//! `max_line_bytes` is read on to its end (or twice the limit) without being kept and ends the connection
//! ([`Frame::TooLong`]). Besides leases, a connection holds one read buffer of [`CHUNK`] bytes.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use tokio::io::{AsyncRead, AsyncReadExt};

/// The read buffer of one connection, bytes.
pub const CHUNK: usize = 8 << 10;

/// The bytes one execution's broker may hold at once (`tools.max_memory_bytes`), shared by its connections.
#[derive(Clone)]
pub struct Budget(Arc<Inner>);

struct Inner {
    used: AtomicUsize,
    max: usize,
}

impl Budget {
    /// A budget of `max` bytes.
    pub fn new(max: usize) -> Self {
        Self(Arc::new(Inner {
            used: AtomicUsize::new(0),
            max,
        }))
    }

    /// The budget, bytes.
    pub fn max(&self) -> usize {
        self.0.max
    }

    /// Bytes held now.
    #[cfg(test)]
    pub fn used(&self) -> usize {
        self.0.used.load(Ordering::Relaxed)
    }

    /// A lease of no bytes yet.
    pub fn lease(&self) -> Lease {
        Lease {
            budget: self.clone(),
            bytes: 0,
        }
    }
}

/// Bytes taken from a [`Budget`]; given back when dropped.
pub struct Lease {
    budget: Budget,
    bytes: usize,
}

impl Lease {
    /// Takes `n` more bytes; `false`, and nothing taken, when that would go over the budget.
    pub fn grow(&mut self, n: usize) -> bool {
        let inner = &self.budget.0;
        let taken = inner
            .used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                used.checked_add(n).filter(|total| *total <= inner.max)
            });
        if taken.is_ok() {
            self.bytes += n;
        }
        taken.is_ok()
    }

    /// Gives back all but `n` bytes (no-op if it holds fewer).
    pub fn shrink_to(&mut self, n: usize) {
        if n < self.bytes {
            self.budget
                .0
                .used
                .fetch_sub(self.bytes - n, Ordering::AcqRel);
            self.bytes = n;
        }
    }

    /// The bytes held.
    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.shrink_to(0);
    }
}

/// What a connection sent next.
pub enum Frame {
    /// A line (without its newline) and the lease holding its bytes.
    Line(Vec<u8>, Lease),
    /// A line that did not fit in the budget; read to its end and dropped.
    OverBudget,
    /// A line longer than the limit; the rest of the connection is not read.
    TooLong,
}

/// The lines of one connection.
pub struct Lines<R> {
    read: R,
    chunk: Box<[u8]>,
    start: usize,
    end: usize,
    max_line: usize,
    budget: Budget,
}

impl<R: AsyncRead + Unpin> Lines<R> {
    /// Lines from `read`, at most `max_line` bytes each, held within `budget`.
    pub fn new(read: R, max_line: usize, budget: Budget) -> Self {
        Self {
            read,
            chunk: vec![0; CHUNK].into_boxed_slice(),
            start: 0,
            end: 0,
            max_line,
            budget,
        }
    }

    /// The next line; `None` at the end of the stream (a last line without its newline is dropped: nobody is
    /// left to read its reply).
    pub async fn next(&mut self) -> std::io::Result<Option<Frame>> {
        let mut line = Vec::new();
        let mut lease = self.budget.lease();
        let mut len = 0usize;
        let mut over = false;
        loop {
            if self.start == self.end {
                let n = self.read.read(&mut self.chunk).await?;
                if n == 0 {
                    return Ok(None);
                }
                (self.start, self.end) = (0, n);
            }
            let newline = self.chunk[self.start..self.end]
                .iter()
                .position(|b| *b == b'\n');
            let take = newline.unwrap_or(self.end - self.start);
            len += take;
            let too_long = len > self.max_line;
            if !over && !too_long && reserve(&mut line, &mut lease, take, self.max_line) {
                line.extend_from_slice(&self.chunk[self.start..self.start + take]);
            } else if !over {
                // Not kept: give back what the line held.
                over = true;
                line = Vec::new();
                lease = self.budget.lease();
            }
            self.start += take + usize::from(newline.is_some());
            if too_long {
                // Read on to the end of the line (at most as much again), so that a sender blocked writing it
                // reads the reply.
                if newline.is_some() || len > self.max_line.saturating_mul(2) {
                    return Ok(Some(Frame::TooLong));
                }
            } else if newline.is_some() {
                return Ok(Some(if over {
                    Frame::OverBudget
                } else {
                    Frame::Line(line, lease)
                }));
            }
        }
    }
}

/// Makes room for `more` bytes in `line`, growing its capacity by doubling (up to `max`) and charging every byte of
/// capacity to `lease`; `false` when the budget has no room.
fn reserve(line: &mut Vec<u8>, lease: &mut Lease, more: usize, max: usize) -> bool {
    let need = line.len() + more;
    if need <= line.capacity() {
        return true;
    }
    let want = need.max(line.capacity() * 2).min(max).max(need);
    if !lease.grow(want.saturating_sub(lease.bytes())) {
        return false;
    }
    line.reserve_exact(want - line.len());
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn frames(
        input: &[u8],
        max_line: usize,
        budget: &Budget,
    ) -> Vec<Result<Vec<u8>, &'static str>> {
        let mut lines = Lines::new(input, max_line, budget.clone());
        let mut out = Vec::new();
        while let Some(frame) = lines.next().await.unwrap() {
            out.push(match frame {
                Frame::Line(l, lease) => {
                    assert!(lease.bytes() >= l.len());
                    Ok(l)
                }
                Frame::OverBudget => Err("over"),
                Frame::TooLong => {
                    out.push(Err("long"));
                    break;
                }
            });
        }
        out
    }

    #[tokio::test]
    async fn lines_are_bytes_and_held_within_the_budget() {
        let budget = Budget::new(100);
        let input = [&b"a\n\xff\xfe\n"[..], &[b'x'; 150], b"\nb\n"].concat();
        let got = frames(&input, 1000, &budget).await;
        assert_eq!(
            got,
            vec![
                Ok(b"a".to_vec()),
                Ok(b"\xff\xfe".to_vec()),
                Err("over"),
                Ok(b"b".to_vec())
            ]
        );
        assert_eq!(budget.used(), 0, "every lease was given back");
        let budget = Budget::new(1 << 20);
        let got = frames(&[&[b'y'; 2000][..], b"\nz\n"].concat(), 1000, &budget).await;
        assert_eq!(got, vec![Err("long")]);
        // Read to its end: nothing of the line is left to read.
        let input = [&[b'y'; 1500][..], b"\nz\n"].concat();
        let mut lines = Lines::new(&input[..], 1000, budget.clone());
        assert!(matches!(lines.next().await.unwrap(), Some(Frame::TooLong)));
        assert!(matches!(lines.next().await.unwrap(), Some(Frame::Line(l, _)) if l == b"z"));
        // An endless line is cut off after twice the limit.
        let mut endless = Lines::new(&[b'y'; 100_000][..], 1000, budget.clone());
        assert!(matches!(
            endless.next().await.unwrap(),
            Some(Frame::TooLong)
        ));
        assert!(
            !endless.read.is_empty(),
            "read to the end of an endless line"
        );
        assert_eq!(budget.used(), 0);
    }

    #[test]
    fn leases_never_go_over_and_give_back() {
        let budget = Budget::new(10);
        let mut a = budget.lease();
        assert!(a.grow(6));
        let mut b = budget.lease();
        assert!(!b.grow(5));
        assert!(b.grow(4));
        a.shrink_to(1);
        assert!(b.grow(5));
        assert_eq!(budget.used(), 10);
        drop(a);
        drop(b);
        assert_eq!(budget.used(), 0);
    }
}

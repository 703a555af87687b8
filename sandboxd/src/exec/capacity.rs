//! Admission control: at most `max_concurrent` executions run, at most `max_queue` wait, the rest are refused at
//! once. A running execution holds a [`Slot`], whose index also picks the host uid its container root maps to, so
//! two concurrent executions never share a host uid.

use std::sync::{Arc, Mutex};

use std::collections::VecDeque;

use tokio::sync::oneshot;

/// What [`Capacity::admit`] decided.
pub enum Admission {
    /// A slot is free: run now.
    Run(Slot),
    /// Wait for a slot (the execution is queued).
    Queued(Ticket),
    /// No slot and the queue is full.
    Overloaded,
}

struct State {
    free: Vec<usize>,
    /// Queued executions, oldest first: a freed slot is handed to the front one.
    waiters: VecDeque<(u64, oneshot::Sender<usize>)>,
    next_ticket: u64,
    shutting_down: bool,
}

/// The shared counters.
#[derive(Clone)]
pub struct Capacity {
    state: Arc<Mutex<State>>,
    max_concurrent: usize,
    max_queue: usize,
}

impl Capacity {
    /// A capacity of `max_concurrent` slots and `max_queue` waiting places.
    pub fn new(max_concurrent: usize, max_queue: usize) -> Self {
        Self {
            state: Arc::new(Mutex::new(State {
                free: (0..max_concurrent).rev().collect(),
                waiters: VecDeque::new(),
                next_ticket: 0,
                shutting_down: false,
            })),
            max_concurrent,
            max_queue,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Decides at once: run, queue, or refuse. The decision and the counters change together, so a burst of
    /// `max_concurrent + max_queue + k` requests refuses exactly `k`.
    pub fn admit(&self) -> Admission {
        let mut s = self.lock();
        if s.shutting_down {
            return Admission::Overloaded;
        }
        // Queued executions go first: a new one may not overtake them.
        if s.waiters.is_empty() {
            if let Some(i) = s.free.pop() {
                return Admission::Run(Slot {
                    index: i,
                    capacity: self.clone(),
                });
            }
        }
        if s.waiters.len() < self.max_queue {
            let id = s.next_ticket;
            s.next_ticket += 1;
            let (tx, rx) = oneshot::channel();
            s.waiters.push_back((id, tx));
            Admission::Queued(Ticket {
                capacity: self.clone(),
                id,
                rx: Some(rx),
            })
        } else {
            Admission::Overloaded
        }
    }

    /// Executions running now.
    pub fn active(&self) -> usize {
        let s = self.lock();
        self.max_concurrent - s.free.len()
    }

    /// Executions waiting now.
    pub fn queued(&self) -> usize {
        self.lock().waiters.len()
    }

    /// Refuse everything from now on (daemon shutdown); queued tickets are woken and get no slot.
    pub fn close(&self) {
        let mut s = self.lock();
        s.shutting_down = true;
        s.waiters.clear();
    }

    /// A slot came free: the oldest waiter that is still there gets it, else it goes back to the pool.
    fn release(&self, mut index: usize) {
        let mut s = self.lock();
        while let Some((_, tx)) = s.waiters.pop_front() {
            match tx.send(index) {
                Ok(()) => return,
                // That waiter is gone (cancelled): try the next one.
                Err(i) => index = i,
            }
        }
        s.free.push(index);
    }
}

/// A running execution's claim; freed on drop (after the execution's cleanup).
#[derive(Debug)]
pub struct Slot {
    index: usize,
    capacity: Capacity,
}

impl std::fmt::Debug for Capacity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Capacity")
            .field("active", &self.active())
            .field("queued", &self.queued())
            .finish()
    }
}

impl Slot {
    /// Slot number, `0..max_concurrent`.
    pub fn index(&self) -> usize {
        self.index
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.capacity.release(self.index);
    }
}

/// A queued execution's place; dropping it (cancel, disconnect) leaves the queue.
pub struct Ticket {
    capacity: Capacity,
    id: u64,
    rx: Option<oneshot::Receiver<usize>>,
}

impl Ticket {
    /// Waits for a slot, in arrival order; `None` if the daemon shuts down first.
    pub async fn wait(mut self) -> Option<Slot> {
        let rx = self.rx.as_mut()?;
        let index = rx.await.ok()?;
        self.rx = None;
        Some(Slot {
            index,
            capacity: self.capacity.clone(),
        })
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        let Some(mut rx) = self.rx.take() else { return };
        // Leave the queue; a slot handed over in the meantime goes to the next waiter.
        self.capacity
            .lock()
            .waiters
            .retain(|(id, _)| *id != self.id);
        if let Ok(index) = rx.try_recv() {
            self.capacity.release(index);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn burst_refuses_exactly_the_surplus() {
        let c = Capacity::new(2, 3);
        let mut runs = vec![];
        let mut tickets = vec![];
        let mut refused = 0;
        for _ in 0..8 {
            match c.admit() {
                Admission::Run(s) => runs.push(s),
                Admission::Queued(t) => tickets.push(t),
                Admission::Overloaded => refused += 1,
            }
        }
        assert_eq!((runs.len(), tickets.len(), refused), (2, 3, 3));
        assert_eq!((c.active(), c.queued()), (2, 3));
        let mut idx: Vec<_> = runs.iter().map(|s| s.index()).collect();
        idx.sort();
        assert_eq!(idx, [0, 1]);
        drop(runs.pop());
        let t = tickets.remove(0);
        let slot = t.wait().await.unwrap();
        assert_eq!((c.active(), c.queued()), (2, 2));
        drop(slot);
        drop(tickets);
        assert_eq!((c.active(), c.queued()), (1, 0));
    }

    #[tokio::test]
    async fn queued_executions_get_slots_in_arrival_order() {
        let c = Capacity::new(1, 8);
        let Admission::Run(s) = c.admit() else {
            panic!()
        };
        let mut waits = Vec::new();
        for _ in 0..5 {
            let Admission::Queued(t) = c.admit() else {
                panic!()
            };
            waits.push(tokio::spawn(t.wait()));
        }
        let mut slot = s;
        for (n, w) in waits.into_iter().enumerate() {
            drop(slot);
            slot = w
                .await
                .unwrap()
                .unwrap_or_else(|| panic!("waiter {n} got no slot"));
            assert_eq!(c.queued(), 4 - n);
        }
        drop(slot);
        assert_eq!((c.active(), c.queued()), (0, 0));
    }

    #[tokio::test]
    async fn a_cancelled_waiter_passes_its_turn_on() {
        let c = Capacity::new(1, 4);
        let Admission::Run(s) = c.admit() else {
            panic!()
        };
        let Admission::Queued(first) = c.admit() else {
            panic!()
        };
        let Admission::Queued(second) = c.admit() else {
            panic!()
        };
        drop(first);
        assert_eq!(c.queued(), 1);
        drop(s);
        let slot = second.wait().await.unwrap();
        assert_eq!((c.active(), c.queued()), (1, 0));
        drop(slot);
        assert_eq!(c.active(), 0);
    }

    #[tokio::test]
    async fn queued_work_is_not_overtaken_and_close_wakes_waiters() {
        let c = Capacity::new(1, 1);
        let Admission::Run(s) = c.admit() else {
            panic!()
        };
        let Admission::Queued(t) = c.admit() else {
            panic!()
        };
        drop(s);
        // The freed slot went to the queued execution: a newcomer does not run before it.
        assert!(!matches!(c.admit(), Admission::Run(_)));
        let slot = t.wait().await.unwrap();
        let Admission::Queued(t2) = c.admit() else {
            panic!()
        };
        let w2 = tokio::spawn(t2.wait());
        c.close();
        assert!(w2.await.unwrap().is_none());
        drop(slot);
        assert!(matches!(c.admit(), Admission::Overloaded));
    }
}

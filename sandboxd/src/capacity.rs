//! Admission control: at most `max_concurrent` executions run, at most `max_queue` wait, the rest are refused at
//! once. A running execution holds a [`Slot`], whose index also picks the host uid its container root maps to, so
//! two concurrent executions never share a host uid.

use std::sync::{Arc, Mutex};

use tokio::sync::Notify;

/// What [`Capacity::admit`] decided.
pub enum Admission {
    /// A slot is free: run now.
    Run(Slot),
    /// Wait for a slot (the execution is queued).
    Queued(Ticket),
    /// No slot and the queue is full.
    Overloaded,
}

#[derive(Debug)]
struct State {
    free: Vec<usize>,
    queued: usize,
    shutting_down: bool,
}

/// The shared counters.
#[derive(Debug, Clone)]
pub struct Capacity {
    state: Arc<Mutex<State>>,
    notify: Arc<Notify>,
    max_concurrent: usize,
    max_queue: usize,
}

impl Capacity {
    /// A capacity of `max_concurrent` slots and `max_queue` waiting places.
    pub fn new(max_concurrent: usize, max_queue: usize) -> Self {
        Self {
            state: Arc::new(Mutex::new(State {
                free: (0..max_concurrent).rev().collect(),
                queued: 0,
                shutting_down: false,
            })),
            notify: Arc::new(Notify::new()),
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
        if s.queued == 0 {
            if let Some(i) = s.free.pop() {
                return Admission::Run(Slot {
                    index: i,
                    capacity: self.clone(),
                });
            }
        }
        if s.queued < self.max_queue {
            s.queued += 1;
            Admission::Queued(Ticket {
                capacity: self.clone(),
                done: false,
            })
        } else {
            Admission::Overloaded
        }
    }

    /// Executions running now.
    pub fn active(&self) -> usize {
        self.max_concurrent - self.lock().free.len()
    }

    /// Executions waiting now.
    pub fn queued(&self) -> usize {
        self.lock().queued
    }

    /// Refuse everything from now on (daemon shutdown); queued tickets are woken and get no slot.
    pub fn close(&self) {
        self.lock().shutting_down = true;
        self.notify.notify_waiters();
    }
}

/// A running execution's claim; freed on drop (after the execution's cleanup).
#[derive(Debug)]
pub struct Slot {
    index: usize,
    capacity: Capacity,
}

impl Slot {
    /// Slot number, `0..max_concurrent`.
    pub fn index(&self) -> usize {
        self.index
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.capacity.lock().free.push(self.index);
        self.capacity.notify.notify_waiters();
    }
}

/// A queued execution's place; dropping it (cancel, disconnect) leaves the queue.
pub struct Ticket {
    capacity: Capacity,
    done: bool,
}

impl Ticket {
    /// Waits for a slot; `None` if the daemon shuts down first.
    pub async fn wait(mut self) -> Option<Slot> {
        loop {
            let notified = self.capacity.notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            {
                let mut s = self.capacity.lock();
                if s.shutting_down {
                    return None;
                }
                if let Some(i) = s.free.pop() {
                    s.queued -= 1;
                    self.done = true;
                    return Some(Slot {
                        index: i,
                        capacity: self.capacity.clone(),
                    });
                }
            }
            notified.await;
        }
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        if !self.done {
            self.capacity.lock().queued -= 1;
            // A slot freed while we held the queue back may now go to a newcomer.
            self.capacity.notify.notify_waiters();
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
    async fn queued_work_is_not_overtaken_and_close_wakes_waiters() {
        let c = Capacity::new(1, 1);
        let Admission::Run(s) = c.admit() else {
            panic!()
        };
        let Admission::Queued(t) = c.admit() else {
            panic!()
        };
        drop(s);
        // A slot is free but one execution is queued: a newcomer must not jump the queue.
        assert!(matches!(c.admit(), Admission::Overloaded));
        let waiter = tokio::spawn(t.wait());
        let slot = waiter.await.unwrap().unwrap();
        let Admission::Queued(t2) = c.admit() else {
            panic!()
        };
        let w2 = tokio::spawn(t2.wait());
        c.close();
        assert!(w2.await.unwrap().is_none());
        drop(slot);
    }
}

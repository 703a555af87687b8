//! The executions in flight on one connection: the connection registers each `execute` here, routes `cancel` and
//! `tool_result` to it by id, and drops every entry when it closes (each execution then sees its client gone). An
//! execution holds its [`Registration`] and leaves the registry right before its terminal message.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use tokio::sync::watch;
use tracing::debug;

/// Sent by the connection to a running execution.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Control {
    /// Keep going.
    Run,
    /// The client asked to cancel.
    Cancel,
}

/// The executions in flight on one connection, by id. An execution removes itself right before it sends its
/// terminal message, so a client that saw the result may reuse the id at once.
type Entries = HashMap<String, (u64, watch::Sender<Control>, crate::extensions::tools::Inbox)>;

/// One connection's executions in flight: cancels and `tool_result`s are routed to them by id.
#[derive(Clone, Default)]
pub struct Registry {
    inner: Arc<Mutex<Entries>>,
    next: Arc<AtomicU64>,
}

impl Registry {
    fn lock(&self) -> std::sync::MutexGuard<'_, Entries> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Registers `id`; `None` if it is already in flight.
    pub fn register(&self, id: &str) -> Option<(Registration, watch::Receiver<Control>)> {
        let mut map = self.lock();
        if map.contains_key(id) {
            return None;
        }
        let token = self.next.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = watch::channel(Control::Run);
        let inbox = crate::extensions::tools::Inbox::default();
        map.insert(id.to_owned(), (token, tx, inbox.clone()));
        Some((
            Registration {
                registry: self.clone(),
                id: id.to_owned(),
                token,
                inbox,
            },
            rx,
        ))
    }

    /// Cancels `id`: `Some(true)` if it was running, `Some(false)` if already cancelling, `None` if unknown.
    pub fn cancel(&self, id: &str) -> Option<bool> {
        let map = self.lock();
        let (_, tx, _) = map.get(id)?;
        Some(tx.send_if_modified(|c| {
            let first = *c != Control::Cancel;
            *c = Control::Cancel;
            first
        }))
    }

    /// Hands a `tool_result` to its execution's broker. One for an execution or call no longer waiting is dropped:
    /// it races with the execution's end, and an `error` with that id would be a second terminal message.
    pub fn tool_result(&self, result: protocol::ToolResult) {
        let inbox = self
            .lock()
            .get(&result.id)
            .map(|(_, _, inbox)| inbox.clone());
        let (id, call_id) = (result.id.clone(), result.call_id.clone());
        if !inbox.is_some_and(|inbox| inbox.deliver(result)) {
            debug!(%id, %call_id, "tool_result for no waiting call; dropped");
        }
    }

    /// Drops every control sender: each execution sees its client gone.
    pub fn disconnect(&self) {
        self.lock().clear();
    }
}

/// An execution's entry in its connection's registry.
pub struct Registration {
    registry: Registry,
    id: String,
    token: u64,
    inbox: crate::extensions::tools::Inbox,
}

impl Registration {
    /// Where the connection delivers this execution's `tool_result`s.
    pub fn tool_inbox(&self) -> crate::extensions::tools::Inbox {
        self.inbox.clone()
    }

    /// Leaves the registry (idempotent; a newer execution with the same id is left alone).
    pub fn release(&self) {
        let mut map = self.registry.lock();
        if map.get(&self.id).is_some_and(|(t, _, _)| *t == self.token) {
            map.remove(&self.id);
        }
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        self.release();
    }
}

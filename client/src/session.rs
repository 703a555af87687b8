//! What a connection's handle, its driver task and its executions share: the live link's writer queue, the
//! executions in flight, the pings waiting for a `pong`, and the status. [`crate::connection`] drives it,
//! [`crate::execution`] cancels and answers tool calls through it; neither needs the other.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex, MutexGuard};

use protocol::{CancelRequest, ClientMessage, Pong, ServerEnvelope};
use tokio::sync::{mpsc, oneshot, watch, Notify};
use tokio_tungstenite::tungstenite::Message;

use crate::config::ConnectOptions;
use crate::error::ClientError;

/// Where a connection is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConnectionStatus {
    /// Connected; executions and pings may be sent.
    Connected,
    /// The link dropped; the driver is on retry `attempt` of the backoff schedule.
    Reconnecting {
        /// The retry under way (1-based).
        attempt: u32,
    },
    /// Every retry failed; the connection stays down (a pool replaces it).
    Failed,
    /// Closed by its owner.
    Closed,
}

/// Closes the connection when the last [`Connection`] clone goes.
pub(crate) struct Handle {
    pub(crate) shared: Arc<Shared>,
}

impl Drop for Handle {
    fn drop(&mut self) {
        self.shared.close();
    }
}

/// The frame for a client message.
pub(crate) fn encode(message: &ClientMessage) -> Result<Message, ClientError> {
    serde_json::to_string(message)
        .map(Message::text)
        .map_err(|e| ClientError::Config(format!("cannot encode a {}: {e}", message.type_name())))
}

/// An execution in flight, as the reader sees it.
pub(crate) struct Pending {
    pub(crate) events: mpsc::Sender<ServerEnvelope>,
    pub(crate) fail: oneshot::Sender<ClientError>,
    /// Whether its `ack` arrived (an `error` without `id` can only concern an execution not acked yet).
    pub(crate) acked: bool,
    /// Tells this execution apart from a later one with the same id.
    pub(crate) token: u64,
}

impl Pending {
    /// Ends the execution with `error`: it reaches the consumer after the events already buffered.
    pub(crate) fn fail(self, error: ClientError) {
        let _ = self.fail.send(error);
        drop(self.events);
    }
}

/// The current link: where the writer takes frames from.
pub(crate) struct Link {
    pub(crate) out: mpsc::Sender<Message>,
}

#[derive(Default)]
pub(crate) struct State {
    pub(crate) link: Option<Link>,
    /// Incremented at every new link; an execution only ever talks to the link it was sent on.
    pub(crate) generation: u64,
    pub(crate) pending: HashMap<String, Pending>,
    /// Waiters for `pong`, in the order their pings were sent.
    pub(crate) pings: VecDeque<oneshot::Sender<Pong>>,
    pub(crate) closed: bool,
    /// Set when the retries are used up.
    pub(crate) failed: bool,
}

impl State {
    /// The writer queue of the live link, or why there is none.
    pub(crate) fn sender(&self, shared: &Shared) -> Result<mpsc::Sender<Message>, ClientError> {
        if self.closed {
            return Err(ClientError::Closed);
        }
        if self.failed {
            return Err(ClientError::disconnected(
                "the connection gave up reconnecting",
            ));
        }
        match &self.link {
            Some(link) => Ok(link.out.clone()),
            None => Err(ClientError::disconnected(match *shared.status.borrow() {
                ConnectionStatus::Reconnecting { attempt } => {
                    format!("not connected (reconnecting, retry {attempt})")
                }
                _ => "not connected".to_owned(),
            })),
        }
    }
}

/// What the handle, the driver and the executions share.
pub(crate) struct Shared {
    pub(crate) options: Arc<ConnectOptions>,
    pub(crate) state: Mutex<State>,
    pub(crate) close: Notify,
    pub(crate) status: watch::Sender<ConnectionStatus>,
    pub(crate) next_token: AtomicU64,
}

impl Shared {
    pub(crate) fn lock(&self) -> MutexGuard<'_, State> {
        // Nothing panics while holding the lock; recover the state rather than propagate a poison.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn set_status(&self, status: ConnectionStatus) {
        self.status.send_replace(status);
    }

    /// Makes `out` the live link; returns its generation.
    pub(crate) fn install_link(&self, out: mpsc::Sender<Message>) -> u64 {
        let generation = {
            let mut st = self.lock();
            st.generation += 1;
            st.link = Some(Link { out });
            st.generation
        };
        self.set_status(ConnectionStatus::Connected);
        generation
    }

    /// Drops the live link and fails everything that was waiting on it.
    pub(crate) fn link_lost(&self, error: impl Fn() -> ClientError) {
        let (pending, pings) = {
            let mut st = self.lock();
            st.link = None;
            (
                std::mem::take(&mut st.pending),
                std::mem::take(&mut st.pings),
            )
        };
        for (_, p) in pending {
            p.fail(error());
        }
        drop(pings);
    }

    pub(crate) fn close(&self) {
        let link = {
            let mut st = self.lock();
            if st.closed {
                return;
            }
            st.closed = true;
            st.link.take()
        };
        // Let the writer send a close frame before it stops.
        if let Some(link) = link {
            let _ = link.out.try_send(Message::Close(None));
        }
        self.close.notify_one();
    }

    pub(crate) fn is_closed(&self) -> bool {
        self.lock().closed
    }

    /// Takes execution `id` out of the connection, if it is still the one with `token`.
    pub(crate) fn forget(&self, id: &str, token: u64) -> bool {
        let mut st = self.lock();
        if st.pending.get(id).is_some_and(|p| p.token == token) {
            st.pending.remove(id);
            true
        } else {
            false
        }
    }

    /// Sends `cancel` for `id` on link `generation`, without waiting (best effort: if the writer queue is full, a
    /// task sends it).
    pub(crate) fn cancel_soon(&self, id: &str, generation: u64) {
        let out = {
            let st = self.lock();
            match &st.link {
                Some(link) if st.generation == generation => link.out.clone(),
                _ => return,
            }
        };
        let Ok(frame) = encode(&ClientMessage::Cancel(CancelRequest::new(id))) else {
            return;
        };
        match out.try_send(frame) {
            Ok(()) => {}
            Err(mpsc::error::TrySendError::Full(frame)) => {
                if let Ok(rt) = tokio::runtime::Handle::try_current() {
                    rt.spawn(async move {
                        let _ = out.send(frame).await;
                    });
                }
            }
            Err(mpsc::error::TrySendError::Closed(_)) => {}
        }
    }

    /// Sends `tool_result` on link `generation` and waits until it is queued.
    pub(crate) async fn tool_result(
        &self,
        result: protocol::ToolResult,
        generation: u64,
    ) -> Result<(), ClientError> {
        self.send_on(generation, &ClientMessage::ToolResult(result))
            .await
    }

    /// Sends `cancel` for `id` on link `generation` and waits until it is queued.
    pub(crate) async fn cancel(&self, id: &str, generation: u64) -> Result<(), ClientError> {
        self.send_on(generation, &ClientMessage::Cancel(CancelRequest::new(id)))
            .await
    }

    /// Sends `message` on link `generation` (only that one: a message about an execution means nothing on a later
    /// link) and waits until it is queued.
    async fn send_on(&self, generation: u64, message: &ClientMessage) -> Result<(), ClientError> {
        let out = {
            let st = self.lock();
            match &st.link {
                Some(link) if st.generation == generation => link.out.clone(),
                _ => {
                    return Err(ClientError::disconnected(
                        "the connection the execution was sent on is gone",
                    ))
                }
            }
        };
        let frame = encode(message)?;
        out.send(frame).await.map_err(|_| {
            ClientError::disconnected(format!(
                "the connection closed before the {} was sent",
                message.type_name()
            ))
        })
    }
}

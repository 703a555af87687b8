//! Every call agent sandboxes make into the container helper (`runtime::helper`), in one place: create and start a
//! container, signal it, wait for its exit and its removal. The helper's API is being reworked; only this file
//! needs adapting.

use std::os::fd::BorrowedFd;
use std::path::Path;
use std::time::Duration;

use runtime::helper::{Event, HelperClient, InitStatus, Request};
use runtime::init::ProgramExit;
use tokio::sync::mpsc;

/// How an agent's container ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Exit {
    /// The agent exited with this code.
    Code(i32),
    /// The agent was killed by this signal.
    Signal(i32),
}

impl Exit {
    /// `exit N` or `signal SIGX`.
    pub fn describe(self) -> String {
        match self {
            Self::Code(c) => format!("exit status {c}"),
            Self::Signal(s) => format!("killed by {}", crate::engine::signal_name(s)),
        }
    }
}

/// A created container and the helper's events about it.
pub struct Container {
    helper: HelperClient,
    cid: String,
    events: mpsc::UnboundedReceiver<Event>,
    /// The helper has a container to remove (wait for `Removed`).
    created: bool,
}

impl Container {
    /// Creates container `cid` from `<bundle>/config.json` with `stdio` (stdin, stdout, stderr). On error nothing
    /// is left in the helper.
    pub async fn create(
        helper: &HelperClient,
        cid: &str,
        bundle: &Path,
        landlock: runtime::landlock::Policy,
        stdio: [BorrowedFd<'_>; 3],
    ) -> Result<Self, String> {
        let events = helper.subscribe(cid);
        let mut c = Self {
            helper: helper.clone(),
            cid: cid.to_owned(),
            events,
            created: false,
        };
        let req = Request::Create {
            id: cid.to_owned(),
            bundle: bundle.to_owned(),
            landlock,
        };
        if let Err(e) = helper.request(&req, &stdio).await {
            helper.unsubscribe(cid);
            return Err(format!("cannot reach the container helper: {e}"));
        }
        match c.events.recv().await {
            Some(Event::Created { .. }) => {
                c.created = true;
                Ok(c)
            }
            Some(Event::Failed { message, .. }) => {
                helper.unsubscribe(cid);
                Err(format!("cannot create the container: {message}"))
            }
            other => {
                helper.unsubscribe(cid);
                Err(format!("unexpected helper event {other:?}"))
            }
        }
    }

    /// Lets the program run. On error the caller kills the container ([`signal`]) and waits for [`Self::removed`].
    pub async fn start(&mut self) -> Result<(), String> {
        let req = Request::Start {
            id: self.cid.clone(),
        };
        if let Err(e) = self.helper.request(&req, &[]).await {
            return Err(format!("cannot reach the container helper: {e}"));
        }
        loop {
            match self.events.recv().await {
                Some(Event::Started { .. }) => return Ok(()),
                Some(Event::Failed { message, .. }) => {
                    self.created = false;
                    return Err(format!("cannot start the container: {message}"));
                }
                Some(Event::Exited { .. }) => return Err("the container exited at start".into()),
                Some(_) => continue,
                None => return Err("the container helper died".into()),
            }
        }
    }

    /// Waits for the container's exit; `None` when the helper died.
    pub async fn exited(&mut self) -> Option<Option<Exit>> {
        loop {
            match self.events.recv().await {
                Some(Event::Exited { program, init, .. }) => {
                    return Some(match (program, init) {
                        (Some(ProgramExit::Code(c)), _) => Some(Exit::Code(c)),
                        (Some(ProgramExit::Signal(s)), _) => Some(Exit::Signal(s)),
                        (None, InitStatus::Signaled(s)) => Some(Exit::Signal(s)),
                        (None, InitStatus::Exited(_)) => None,
                    })
                }
                Some(Event::Removed { .. }) | Some(Event::Failed { .. }) => {
                    self.created = false;
                    return Some(None);
                }
                Some(_) => continue,
                None => return None,
            }
        }
    }

    /// Waits (at most 30 s) until the helper removed the container, then stops routing its events.
    pub async fn removed(mut self) {
        if self.created {
            let wait = async {
                loop {
                    match self.events.recv().await {
                        Some(Event::Removed { error, .. }) => {
                            if let Some(e) = error {
                                tracing::error!(container = %self.cid, error = %e, "container removal reported an error");
                            }
                            return;
                        }
                        Some(Event::Failed { .. }) | None => return,
                        Some(_) => continue,
                    }
                }
            };
            if tokio::time::timeout(Duration::from_secs(30), wait)
                .await
                .is_err()
            {
                tracing::error!(container = %self.cid, "container not removed within 30 s");
            }
        }
        self.helper.unsubscribe(&self.cid);
    }
}

/// Sends `signal` to container `cid`'s init (SIGKILL ends the whole container).
pub async fn signal(helper: &HelperClient, cid: &str, signal: i32) -> Result<(), String> {
    helper
        .request(
            &Request::Kill {
                id: cid.to_owned(),
                signal,
            },
            &[],
        )
        .await
        .map_err(|e| format!("cannot reach the container helper: {e}"))
}

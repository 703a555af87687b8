//! The helper process: the only place containers are created and deleted.
//!
//! Starting a container clones the helper and runs Rust code in the clone (the direct start and libcontainer alike),
//! which is only sound in a single-threaded process, so the
//! daemon forks this helper before it starts its async runtime ([`spawn_helper`]). Three parts, one per side:
//! - [`proto`]: the messages, one JSON document per `SOCK_SEQPACKET` datagram with descriptors attached;
//! - [`child`]: the helper process itself, a plain poll loop over the daemon socket and a `signalfd` for
//!   `SIGCHLD`. Containers' init processes are its children; it signals them only while they are unreaped, so a
//!   pid can never be reused under it, and it deletes a container while its init is still a zombie (libcontainer
//!   then sees it stopped and never signals a pid by itself);
//! - [`client`]: the daemon's side, an async request/answer API routed by container id;
//! - `youki` (with the `libcontainer` cargo feature): youki's libcontainer as a second start, for comparison.
//!
//! A container is created *and started* in one request: its init then waits on the launch channel
//! ([`crate::launch`]). The helper hands the daemon the launch channel, the status pipe and a pidfd of the init, so
//! everything that is on an execution's critical path (launching, signalling, learning how the program ended) is
//! between the daemon and the container; the helper only creates, reaps and deletes, off that path.

pub mod child;
pub mod client;
pub mod proto;
#[cfg(feature = "libcontainer")]
mod youki;

pub use child::{spawn_helper, HelperConfig, StartMethod};
pub use client::{Created, HelperClient, HelperError};
pub use proto::{Event, Request};

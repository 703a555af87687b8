//! Containers for sandboxd.
//!
//! Every execution runs in a fresh container created by sandboxd's own start ([`direct`]; youki's `libcontainer`
//! is the alternative): new pid, mount, ipc, uts, net, cgroup and user namespaces, cgroup limits (v1 or v2), an ephemeral root built from an image, and a tiny
//! init ([`init`]) that reaps orphans and reports how the program ended.
//!
//! Containers are never created by the multi-threaded daemon itself. [`helper::spawn_helper`] forks a
//! single-threaded helper process before the async runtime starts; the daemon talks to it over a `SOCK_SEQPACKET`
//! socket ([`ipc`]) with [`helper::HelperClient`], passing the program's stdio as file descriptors.
//!
//! Module map, one kernel mechanism per module: [`cgroups`] (limits, usage, leftovers), [`rootfs`] (host image,
//! per-execution scratch), [`spec`] (the OCI runtime spec of an execution), [`direct`] (the container start:
//! clone, mounts, privileges), [`init`] (the executor run as pid 1),
//! [`helper`] (container lifecycle in the helper process), [`processes`] (the daemon's side of a serving init), [`sys`]
//! (the few raw syscalls, each with its `SAFETY`).

pub mod artifacts;
pub mod btrfs;
pub mod caps;
pub mod cgroups;
pub mod direct;
pub mod error;
pub mod helper;
pub mod idmap;
pub mod init;
pub mod ipc;
pub mod landlock;
pub mod launch;
pub mod processes;
pub mod rootfs;
pub mod seccomp;
pub mod spec;
pub mod sys;
pub mod tree;

pub use error::{Error, Result};

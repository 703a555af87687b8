//! The launch channel: how a container that was created ahead of time learns what to run.
//!
//! Every container is created and started with no program: its init ([`crate::init`]) blocks on one end of a
//! `SOCK_SEQPACKET` socket pair, and the daemon holds the other end. When an execution takes the container, the
//! daemon sends one message with the program's stdin, stdout and stderr attached as `SCM_RIGHTS`, and a fourth
//! descriptor, a memfd holding the [`Launch`] itself (arguments and environment can be as large as
//! `execve` allows, far more than one datagram carries); the init forks the program with the first three as
//! descriptors 0, 1 and 2. The helper process is not involved, so starting a
//! program never waits behind another container's creation. The daemon closing its end without sending anything
//! tells an idle init to exit.

use std::io::{Read, Seek, SeekFrom};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::ipc;

pub use crate::error::LaunchError;

/// The largest launch (arguments and environment; the code itself travels as a file). `execve` refuses more than
/// a quarter of the stack limit anyway.
pub const MAX_LAUNCH: usize = 64 << 20;
/// The datagram that carries the descriptors.
const MESSAGE: &[u8] = b"launch";

/// What the init runs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Launch {
    /// Program (absolute path in the container) and arguments.
    pub args: Vec<String>,
    /// `KEY=VALUE` environment.
    pub env: Vec<String>,
    /// Hand the launch to the interpreter the init started ahead of time ([`crate::init::InitExecutor::warm`])
    /// instead of forking a new program; an init without one forks the program as usual.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub warm: bool,
    /// Set on an interpreter to start ahead of time that cannot take descriptors (node): the init gives it the
    /// launch alone, through a stream socket (until end of file), and relays its stdout and stderr to the launch's
    /// ([`crate::init`]).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub relay: bool,
    /// An agent run that outlives the daemon: the launch carries [`KEPT`] more descriptors (the control socket's
    /// listener, the keeper's listener, the status pipe's read end) that the init keeps for a later daemon
    /// ([`crate::init::keeper`]).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub keep: bool,
    /// The program's working directory (absolute, in the container); the init's own when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cwd: Option<String>,
    /// Turns the init into a process server ([`crate::init::serve`]): it runs no program of this launch, but stays,
    /// starts a program for each further launch on the channel, reports each one's pid and end, and signals them
    /// on request, until the channel closes. A long-lived sandbox that runs many processes in one container.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub serve: bool,
}

impl Launch {
    /// A plain launch: the program `args` (absolute path, then its arguments) with its `env`, every flag off, in
    /// the init's working directory. A launch with flags sets them over it (`Launch { keep: true,
    /// ..Launch::program(args, env) }`).
    pub fn program(args: Vec<String>, env: Vec<String>) -> Self {
        Self {
            args,
            env,
            warm: false,
            relay: false,
            keep: false,
            cwd: None,
            serve: false,
        }
    }
}

/// Descriptors a [`Launch::keep`] launch carries after the payload.
pub const KEPT: usize = 3;

/// What the init received: the launch, the program's stdio, and the [`KEPT`] descriptors of a kept run (empty
/// otherwise).
pub type Received = (Launch, [OwnedFd; 3], Vec<OwnedFd>);

/// Sends `launch` with the program's stdin, stdout and stderr. Never blocks for long: the init is waiting and the
/// datagram is tiny. A gone init is `Error::Sys` with `EPIPE`/`ECONNRESET`/`ECONNREFUSED`.
pub fn send(sock: BorrowedFd<'_>, launch: &Launch, stdio: [BorrowedFd<'_>; 3]) -> Result<()> {
    send_keeping(sock, launch, stdio, &[])
}

/// [`send`] with the descriptors a [`Launch::keep`] launch hands the init (exactly [`KEPT`] of them, in order).
pub fn send_keeping(
    sock: BorrowedFd<'_>,
    launch: &Launch,
    stdio: [BorrowedFd<'_>; 3],
    kept: &[BorrowedFd<'_>],
) -> Result<()> {
    let expected = if launch.keep { KEPT } else { 0 };
    if kept.len() != expected {
        return Err(LaunchError::Descriptors(kept.len()).into());
    }
    let bytes = serde_json::to_vec(launch).map_err(LaunchError::Encode)?;
    send_payload(sock, &bytes, stdio, kept)
}

/// Sends a waiting python interpreter its launch (`sandboxd`'s `warm/python.py` reads it): the same message and
/// descriptors as [`send`], with a payload python splits without importing a parser (`json` and the `re` it
/// imports cost a waiting interpreter about 8 ms of CPU): the count of arguments, then the arguments and the
/// environment, each string ended by a NUL. A string holding a NUL, which `execve` would refuse, is
/// [`LaunchError::Nul`], so the launch gets a plain start and that refusal.
pub fn send_strings(
    sock: BorrowedFd<'_>,
    launch: &Launch,
    stdio: [BorrowedFd<'_>; 3],
) -> Result<()> {
    let mut bytes = format!("{}\0", launch.args.len()).into_bytes();
    for s in launch.args.iter().chain(&launch.env) {
        if s.contains('\0') {
            return Err(LaunchError::Nul.into());
        }
        bytes.extend_from_slice(s.as_bytes());
        bytes.push(0);
    }
    send_payload(sock, &bytes, stdio, &[])
}

/// Sends `bytes` in a memfd after the program's stdio and `kept`.
fn send_payload(
    sock: BorrowedFd<'_>,
    bytes: &[u8],
    stdio: [BorrowedFd<'_>; 3],
    kept: &[BorrowedFd<'_>],
) -> Result<()> {
    if bytes.len() > MAX_LAUNCH {
        return Err(LaunchError::TooLarge { max: MAX_LAUNCH }.into());
    }
    let payload = nix::sys::memfd::memfd_create(
        c"sandboxd-launch",
        nix::sys::memfd::MemFdCreateFlag::MFD_CLOEXEC,
    )
    .map_err(|e| Error::sys("memfd_create", e))?;
    let mut written = 0;
    while written < bytes.len() {
        written += nix::unistd::write(&payload, &bytes[written..])
            .map_err(|e| Error::sys("write launch", e))?;
    }
    let [a, b, c] = stdio;
    let mut fds = vec![a, b, c, payload.as_fd()];
    fds.extend_from_slice(kept);
    ipc::send(sock, MESSAGE, &fds).map_err(|e| Error::sys("send launch", e))
}

/// Receives the launch (blocking; retried on `EINTR`). `Ok(None)`: the daemon closed the channel.
pub fn recv(sock: BorrowedFd<'_>) -> Result<Option<Received>> {
    let mut buf = [0u8; 64];
    let (n, fds) = loop {
        match ipc::recv(sock, &mut buf) {
            Ok(Some(m)) => break m,
            Ok(None) => return Ok(None),
            Err(nix::Error::EINTR) => continue,
            Err(e) => return Err(Error::sys("receive launch", e)),
        }
    };
    parse(&buf[..n], fds).map(Some)
}

/// Reads a launch from the datagram `message` and the descriptors it carried (what [`send_keeping`] sent).
pub fn parse(message: &[u8], fds: Vec<OwnedFd>) -> Result<Received> {
    let count = fds.len();
    if count != 4 && count != 4 + KEPT {
        return Err(LaunchError::Descriptors(count).into());
    }
    let mut fds = fds.into_iter();
    let mut next = || fds.next().ok_or(LaunchError::Descriptors(count));
    let (stdin, stdout, stderr, payload) = (next()?, next()?, next()?, next()?);
    let kept: Vec<OwnedFd> = fds.collect();
    if message != MESSAGE {
        return Err(LaunchError::Malformed.into());
    }
    let mut bytes = Vec::new();
    let mut file = std::fs::File::from(payload);
    file.seek(SeekFrom::Start(0))
        .and_then(|_| file.take(MAX_LAUNCH as u64 + 1).read_to_end(&mut bytes))
        .map_err(|e| Error::io("launch payload", e))?;
    let launch = decode(&bytes)?;
    if launch.keep != (kept.len() == KEPT) {
        return Err(LaunchError::Descriptors(count).into());
    }
    Ok((launch, [stdin, stdout, stderr], kept))
}

/// Whether a datagram is a launch (the serving init's channel carries other requests too).
pub fn is_launch(message: &[u8]) -> bool {
    message == MESSAGE
}

/// Decodes and checks the payload [`recv`] read from the memfd: at most [`MAX_LAUNCH`] bytes of JSON, an
/// absolute program path (none for a serving launch) and working directory.
pub fn decode(bytes: &[u8]) -> Result<Launch> {
    if bytes.len() > MAX_LAUNCH {
        return Err(LaunchError::TooLarge { max: MAX_LAUNCH }.into());
    }
    let launch: Launch = serde_json::from_slice(bytes).map_err(LaunchError::Decode)?;
    if !launch.serve && launch.args.first().is_none_or(|a| !a.starts_with('/')) {
        return Err(LaunchError::RelativeProgram.into());
    }
    if launch.cwd.as_ref().is_some_and(|c| !c.starts_with('/')) {
        return Err(LaunchError::RelativeDirectory.into());
    }
    Ok(launch)
}

#[cfg(test)]
mod tests {
    use std::io::{Read, Write};
    use std::os::fd::AsFd;

    use super::*;

    #[test]
    fn launch_and_stdio_arrive_together() {
        let (a, b) = ipc::pair().unwrap();
        let (r, w) = nix::unistd::pipe().unwrap();
        let launch = Launch::program(
            vec!["/bin/sh".into(), "/sandbox/main.sh".into()],
            vec!["A=1".into()],
        );
        send(a.as_fd(), &launch, [w.as_fd(), w.as_fd(), w.as_fd()]).unwrap();
        drop(w);
        let (got, [_, out, _], kept) = recv(b.as_fd()).unwrap().unwrap();
        assert!(kept.is_empty());
        assert_eq!(got, launch);
        std::fs::File::from(out).write_all(b"x").unwrap();
        let mut s = String::new();
        // Two more copies of the write end are still open in the received array's dropped elements: gone now.
        std::fs::File::from(r).read_to_string(&mut s).unwrap();
        assert_eq!(s, "x");
    }

    #[test]
    fn a_launch_larger_than_a_datagram_arrives_whole() {
        let (a, b) = ipc::pair().unwrap();
        let (_r, w) = nix::unistd::pipe().unwrap();
        let launch = Launch::program(
            vec!["/bin/true".into()],
            vec![format!("HUGE={}", "e".repeat(4 << 20))],
        );
        send(a.as_fd(), &launch, [w.as_fd(), w.as_fd(), w.as_fd()]).unwrap();
        let (got, _, _) = recv(b.as_fd()).unwrap().unwrap();
        assert_eq!(got, launch);
    }

    #[test]
    fn a_kept_launch_carries_its_three_descriptors_and_only_then() {
        let (a, b) = ipc::pair().unwrap();
        let (_r, w) = nix::unistd::pipe().unwrap();
        let stdio = [w.as_fd(), w.as_fd(), w.as_fd()];
        let kept = Launch {
            keep: true,
            ..Launch::program(vec!["/bin/true".into()], vec![])
        };
        send_keeping(a.as_fd(), &kept, stdio, &[w.as_fd(), w.as_fd(), w.as_fd()]).unwrap();
        let (got, _, fds) = recv(b.as_fd()).unwrap().unwrap();
        assert_eq!((got, fds.len()), (kept.clone(), KEPT));
        assert!(
            send(a.as_fd(), &kept, stdio).is_err(),
            "kept without its descriptors"
        );
        let plain = Launch {
            keep: false,
            ..kept
        };
        assert!(
            send_keeping(a.as_fd(), &plain, stdio, &[w.as_fd(), w.as_fd(), w.as_fd()]).is_err()
        );
        // A launch whose flag and descriptors disagree is refused by the init too.
        let bytes = serde_json::to_vec(&plain).unwrap();
        let payload =
            nix::sys::memfd::memfd_create(c"t", nix::sys::memfd::MemFdCreateFlag::MFD_CLOEXEC)
                .unwrap();
        nix::unistd::write(&payload, &bytes).unwrap();
        ipc::send(
            a.as_fd(),
            MESSAGE,
            &[
                w.as_fd(),
                w.as_fd(),
                w.as_fd(),
                payload.as_fd(),
                w.as_fd(),
                w.as_fd(),
                w.as_fd(),
            ],
        )
        .unwrap();
        assert!(recv(b.as_fd()).is_err());
    }

    #[test]
    fn an_interpreter_gets_its_strings_after_their_count_and_none_with_a_nul() {
        let (a, b) = ipc::pair().unwrap();
        let (_r, w) = nix::unistd::pipe().unwrap();
        let stdio = [w.as_fd(), w.as_fd(), w.as_fd()];
        let launch = Launch::program(
            vec![
                "/usr/bin/python3".into(),
                "/sandbox/main.py".into(),
                "é".into(),
            ],
            vec!["A=1".into(), "B=".into()],
        );
        send_strings(a.as_fd(), &launch, stdio).unwrap();
        let mut buf = [0u8; 64];
        let (n, fds) = ipc::recv(b.as_fd(), &mut buf).unwrap().unwrap();
        assert_eq!((&buf[..n], fds.len()), (MESSAGE, 4));
        let mut payload = String::new();
        let mut file = std::fs::File::from(fds.into_iter().nth(3).unwrap());
        file.seek(SeekFrom::Start(0)).unwrap();
        file.read_to_string(&mut payload).unwrap();
        assert_eq!(
            payload,
            "3\0/usr/bin/python3\0/sandbox/main.py\0é\0A=1\0B=\0"
        );
        let nul = Launch::program(vec!["/bin/sh".into()], vec!["A=\0".into()]);
        let err = send_strings(a.as_fd(), &nul, stdio).unwrap_err();
        assert!(err.to_string().contains("NUL"), "{err}");
    }

    #[test]
    fn a_closed_channel_is_none_and_bad_launches_are_refused() {
        let (a, b) = ipc::pair().unwrap();
        let (_r, w) = nix::unistd::pipe().unwrap();
        let relative = Launch::program(vec!["sh".into()], vec![]);
        send(a.as_fd(), &relative, [w.as_fd(), w.as_fd(), w.as_fd()]).unwrap();
        assert!(recv(b.as_fd()).is_err());
        ipc::send(a.as_fd(), MESSAGE, &[w.as_fd()]).unwrap();
        assert!(recv(b.as_fd()).is_err(), "one descriptor instead of four");
        drop(a);
        assert!(recv(b.as_fd()).unwrap().is_none());
    }
}

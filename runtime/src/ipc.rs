//! Messages between the daemon and the helper: one JSON document per `SOCK_SEQPACKET` datagram, with file
//! descriptors attached as `SCM_RIGHTS`. Seqpacket keeps message boundaries, so neither side needs framing, and a
//! descriptor always travels with the message it belongs to.

use std::io::IoSlice;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};

use nix::sys::socket::{self, ControlMessage, ControlMessageOwned, MsgFlags, SockFlag, SockType};

use crate::error::{Error, Result};

/// The largest message either side sends. Requests carry paths and ids, never payloads.
pub const MAX_MESSAGE: usize = 64 * 1024;
/// The most descriptors one message carries (a kept launch: stdio, its payload and three kept descriptors).
pub const MAX_FDS: usize = 8;

/// A connected pair of close-on-exec seqpacket sockets.
pub fn pair() -> Result<(OwnedFd, OwnedFd)> {
    socket::socketpair(
        socket::AddressFamily::Unix,
        SockType::SeqPacket,
        None,
        SockFlag::SOCK_CLOEXEC,
    )
    .map_err(|e| Error::sys("socketpair(SOCK_SEQPACKET)", e))
}

/// Sends one message with descriptors. `EAGAIN` is returned as is for non-blocking callers.
pub fn send(sock: BorrowedFd<'_>, payload: &[u8], fds: &[BorrowedFd<'_>]) -> nix::Result<()> {
    let raw: Vec<RawFd> = fds.iter().map(|f| f.as_raw_fd()).collect();
    let iov = [IoSlice::new(payload)];
    let cmsgs = if raw.is_empty() {
        vec![]
    } else {
        vec![ControlMessage::ScmRights(&raw)]
    };
    let sent = socket::sendmsg::<()>(sock.as_raw_fd(), &iov, &cmsgs, MsgFlags::MSG_NOSIGNAL, None)?;
    if sent != payload.len() {
        return Err(nix::Error::EMSGSIZE);
    }
    Ok(())
}

/// Receives one message. `Ok(None)` is end of stream (the peer closed). Received descriptors are close-on-exec.
/// A truncated message or descriptor list is an error: a message is never half-read.
pub fn recv(sock: BorrowedFd<'_>, buf: &mut [u8]) -> nix::Result<Option<(usize, Vec<OwnedFd>)>> {
    let mut cmsg = nix::cmsg_space!([RawFd; MAX_FDS]);
    let mut iov = [std::io::IoSliceMut::new(buf)];
    let msg = socket::recvmsg::<()>(
        sock.as_raw_fd(),
        &mut iov,
        Some(&mut cmsg),
        MsgFlags::MSG_CMSG_CLOEXEC,
    )?;
    let mut fds = Vec::new();
    for c in msg.cmsgs()? {
        if let ControlMessageOwned::ScmRights(list) = c {
            for fd in list {
                // SAFETY: SCM_RIGHTS just installed this descriptor in our table; nothing else owns it yet.
                fds.push(unsafe { OwnedFd::from_raw_fd(fd) });
            }
        }
    }
    if msg
        .flags
        .intersects(MsgFlags::MSG_TRUNC | MsgFlags::MSG_CTRUNC)
    {
        return Err(nix::Error::EMSGSIZE);
    }
    let n = msg.bytes;
    if n == 0 && fds.is_empty() {
        return Ok(None);
    }
    Ok(Some((n, fds)))
}

#[cfg(test)]
mod tests {
    use std::io::{Read, Write};
    use std::os::fd::AsFd;

    use super::*;

    #[test]
    fn message_and_descriptors_travel_together() {
        let (a, b) = pair().unwrap();
        let (r, w) = nix::unistd::pipe().unwrap();
        send(a.as_fd(), b"{\"op\":\"x\"}", &[w.as_fd()]).unwrap();
        drop(w);
        let mut buf = vec![0u8; MAX_MESSAGE];
        let (n, mut fds) = recv(b.as_fd(), &mut buf).unwrap().unwrap();
        assert_eq!(&buf[..n], b"{\"op\":\"x\"}");
        assert_eq!(fds.len(), 1);
        let mut w2 = std::fs::File::from(fds.remove(0));
        w2.write_all(b"through").unwrap();
        drop(w2);
        let mut s = String::new();
        std::fs::File::from(r).read_to_string(&mut s).unwrap();
        assert_eq!(s, "through");
        drop(a);
        assert!(recv(b.as_fd(), &mut buf).unwrap().is_none());
    }

    #[test]
    fn oversized_message_is_refused_not_truncated() {
        let (a, b) = pair().unwrap();
        send(a.as_fd(), &[b'x'; 100], &[]).unwrap();
        let mut small = [0u8; 10];
        assert_eq!(
            recv(b.as_fd(), &mut small).unwrap_err(),
            nix::Error::EMSGSIZE
        );
    }
}

//! The first request head of a client connection, checked with httparse (the parser hyper itself uses) before
//! hyper serves the connection: hyper answers a head it cannot parse with a bare `400` of its own, where the proxy
//! answers with its typed refusal ([`Refusal::Malformed`]), counted and logged like the others.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};

use crate::error::Refusal;
use crate::shared::refusal_text;

/// Bytes read looking for the end of the first head; a longer head is left to hyper (which bounds it itself).
/// Each read parses what came so far again, as hyper does: this bounds that work too.
const MAX_HEAD: usize = 16 * 1024;
/// Headers parsed; more are left to hyper (its own limit is 100).
const MAX_HEADERS: usize = 100;

/// What the start of a client connection held.
#[derive(Debug)]
pub(crate) enum First {
    /// Bytes to serve with hyper: a head httparse accepted, or one it could not finish (too long, too many headers,
    /// or cut short by the client), which hyper then judges.
    Serve(Vec<u8>),
    /// A head that is not HTTP/1.x: refused without hyper.
    Malformed(Refusal),
    /// The client closed without sending anything.
    Closed,
}

/// Reads from `client` until the first request head is complete, or known to be malformed.
pub(crate) async fn read_first<R: AsyncRead + Unpin>(client: &mut R) -> io::Result<First> {
    let mut read = Vec::with_capacity(4096);
    loop {
        read.reserve(4096);
        if client.read_buf(&mut read).await? == 0 {
            return Ok(match read.is_empty() {
                true => First::Closed,
                false => First::Serve(read),
            });
        }
        let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
        let mut request = httparse::Request::new(&mut headers);
        match request.parse(&read) {
            Ok(httparse::Status::Complete(_)) => {
                let target = request.path.unwrap_or_default();
                if http::Uri::try_from(target).is_err() {
                    return Ok(First::Malformed(Refusal::Malformed(
                        "invalid request target",
                    )));
                }
                return Ok(First::Serve(read));
            }
            Ok(httparse::Status::Partial) if read.len() < MAX_HEAD => {}
            Ok(httparse::Status::Partial) | Err(httparse::Error::TooManyHeaders) => {
                return Ok(First::Serve(read))
            }
            Err(e) => return Ok(First::Malformed(Refusal::Malformed(reason(e)))),
        }
    }
}

fn reason(e: httparse::Error) -> &'static str {
    match e {
        httparse::Error::Token => "not an HTTP/1.x request line (invalid method or target)",
        httparse::Error::Version => "not an HTTP/1.x request line (invalid HTTP version)",
        httparse::Error::HeaderName => "invalid header name",
        httparse::Error::HeaderValue => "invalid header value",
        httparse::Error::NewLine => "invalid line ending",
        httparse::Error::Status | httparse::Error::TooManyHeaders => "invalid request head",
    }
}

/// Sends the refusal's response (as [`crate::shared::Shared::refuse`] words it) to `client` and closes it.
pub(crate) async fn answer<W: AsyncWrite + Unpin>(
    client: &mut W,
    refusal: &Refusal,
) -> io::Result<()> {
    let body = refusal_text(refusal);
    let status = refusal.status();
    let response = format!(
        "HTTP/1.1 {} {}\r\ncontent-type: text/plain\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        status.as_str(),
        status.canonical_reason().unwrap_or(""),
        body.len(),
    );
    client.write_all(response.as_bytes()).await?;
    client.shutdown().await
}

/// A stream whose first reads return bytes already read from it.
pub(crate) struct Rewind<S> {
    read: Vec<u8>,
    at: usize,
    inner: S,
}

impl<S> Rewind<S> {
    pub(crate) fn new(read: Vec<u8>, inner: S) -> Rewind<S> {
        Rewind { read, at: 0, inner }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Rewind<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        if this.at < this.read.len() {
            let n = buf.remaining().min(this.read.len() - this.at);
            buf.put_slice(&this.read[this.at..this.at + n]);
            this.at += n;
            if this.at == this.read.len() {
                this.read = Vec::new();
                this.at = 0;
            }
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut this.inner).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Rewind<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn first(bytes: &[u8]) -> First {
        read_first(&mut &bytes[..]).await.unwrap()
    }

    #[tokio::test]
    async fn a_head_is_checked_and_kept_whole_for_hyper() {
        let request = b"GET http://a.test/ HTTP/1.1\r\nHost: a.test\r\n\r\nbody";
        assert!(matches!(first(request).await, First::Serve(read) if read == request));
        // Cut short, or too many headers: hyper judges it.
        assert!(matches!(
            first(b"GET http://a.test/ HTT").await,
            First::Serve(_)
        ));
        let many = format!(
            "GET / HTTP/1.1\r\n{}\r\n",
            "a: b\r\n".repeat(MAX_HEADERS + 1)
        );
        assert!(matches!(first(many.as_bytes()).await, First::Serve(_)));
        assert!(matches!(first(b"").await, First::Closed));
    }

    #[tokio::test]
    async fn a_head_that_is_not_http_is_refused_with_its_reason() {
        for (bytes, reason) in [
            (&b"THIS IS NOT HTTP\r\n\r\n"[..], "invalid HTTP version"),
            (b"\x16\x03\x01\x02\x00\x01", "invalid method or target"),
            (b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", "invalid HTTP version"),
            (
                b"GET / HTTP/1.1\r\nbad header: x\r\n\r\n",
                "invalid header name",
            ),
            (
                b"GET http://[::1/ HTTP/1.1\r\n\r\n",
                "invalid request target",
            ),
        ] {
            match first(bytes).await {
                First::Malformed(Refusal::Malformed(r)) => {
                    assert!(r.contains(reason), "{bytes:?}: {r}")
                }
                other => panic!("{bytes:?}: {other:?}"),
            }
        }
    }

    #[tokio::test]
    async fn rewind_reads_what_was_read_first() {
        let mut stream = Rewind::new(b"abc".to_vec(), &b"def"[..]);
        let mut all = String::new();
        stream.read_to_string(&mut all).await.unwrap();
        assert_eq!(all, "abcdef");
    }
}

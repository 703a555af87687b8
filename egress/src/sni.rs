//! Reading the SNI of a TLS ClientHello without terminating TLS: rustls's `Acceptor` parses the bytes the client
//! sent; the same bytes are then forwarded unchanged.

use std::io::{self, Cursor};

use rustls::server::Acceptor;
use tokio::io::{AsyncRead, AsyncReadExt};

/// A ClientHello bigger than this is refused (rustls itself bounds a handshake message well below it).
const MAX_HELLO: usize = 64 * 1024;

/// What the start of a tunnel held.
#[derive(Debug)]
pub(crate) enum Hello {
    /// A complete ClientHello and its SNI (lower-cased, trailing dot removed), with every byte read so far.
    Tls { sni: Option<String>, bytes: Vec<u8> },
    /// Not a TLS ClientHello, or the client closed before one was complete, with every byte read so far.
    NotTls { bytes: Vec<u8> },
}

/// Reads from `client` until a whole ClientHello has arrived.
pub(crate) async fn read_client_hello<R: AsyncRead + Unpin>(client: &mut R) -> io::Result<Hello> {
    let mut acceptor = Acceptor::default();
    let mut bytes = Vec::new();
    let mut chunk = vec![0u8; 4096];
    loop {
        let n = client.read(&mut chunk).await?;
        if n == 0 || bytes.len() + n > MAX_HELLO {
            bytes.extend_from_slice(&chunk[..n]);
            return Ok(Hello::NotTls { bytes });
        }
        bytes.extend_from_slice(&chunk[..n]);
        let mut cursor = Cursor::new(&chunk[..n]);
        while (cursor.position() as usize) < n {
            match acceptor.read_tls(&mut cursor) {
                Ok(0) | Err(_) => return Ok(Hello::NotTls { bytes }),
                Ok(_) => {}
            }
        }
        match acceptor.accept() {
            Ok(Some(accepted)) => {
                let sni = accepted.client_hello().server_name().map(|s| {
                    let s = s.strip_suffix('.').unwrap_or(s);
                    s.to_ascii_lowercase()
                });
                return Ok(Hello::Tls { sni, bytes });
            }
            Ok(None) => continue,
            Err(_) => return Ok(Hello::NotTls { bytes }),
        }
    }
}

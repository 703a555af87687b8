//! Writing through tokio (no blocking write on the runtime): one-line reasons on stderr, flushed writes.

use tokio::io::{AsyncWrite, AsyncWriteExt};

/// Writes one line to stderr (through tokio: no blocking write on the runtime).
pub(crate) async fn say(line: String) {
    let mut err = tokio::io::stderr();
    let _ = err
        .write_all(format!("sandboxctl: {line}\n").as_bytes())
        .await;
    let _ = err.flush().await;
}

pub(crate) async fn write_flush<W: AsyncWrite + Unpin>(
    w: &mut W,
    bytes: &[u8],
) -> std::io::Result<()> {
    w.write_all(bytes).await?;
    w.flush().await
}

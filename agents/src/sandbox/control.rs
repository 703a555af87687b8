//! The control channel of a run: the agent connects to `/sandbox/control.sock`, gets its brief line and then the
//! commands (`resolve`, `inject_context`, `update_brief`, `shutdown`), and writes its events and state as JSON
//! lines. Lines are framed by tokio-util's [`LinesCodec`] with a maximum of `agents.max_line_bytes`: a longer line
//! is never kept; the codec discards it up to its newline, a `control_line_too_long` warning goes out, and the next
//! line is read as usual. A line that is not UTF-8 or not JSON is dropped with a `malformed_event` warning.
//!
//! Reading and processing are two tasks with one line in flight between them, so a slow upload slows the reading
//! (backpressure) but never the supervisor.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use agent_api::{error_event, parse_agent_line, AgentLine, AgentStatus};
use futures_util::StreamExt;
use nix::sys::signal::Signal;
use runtime::error::Chain;
use runtime::init::ProgramExit;
use serde_json::Value;
use tokio::io::AsyncWriteExt;
use tokio::sync::mpsc;
use tokio_util::bytes::BytesMut;
use tokio_util::codec::{Decoder, FramedRead, LinesCodec, LinesCodecError};
use tracing::{warn, Instrument};

use super::Sandbox;
use crate::container::{Ended, RunContainer};

/// How long a dropped control connection may precede the container's exit before the run counts as crashed and
/// is killed.
const EOF_GRACE: Duration = Duration::from_millis(500);
/// How long after the container's exit its last lines may still be read and processed (uploads included) before
/// the run ends without them (also what a descriptor leaked past the exit costs).
const DRAIN_GRACE: Duration = Duration::from_secs(5);

impl Sandbox {
    /// Serves the run until the container has exited and the control connection's last line is processed (or
    /// never opened, or [`DRAIN_GRACE`] past the exit). A connection that drops while the agent keeps running kills
    /// the container and is the crash reason.
    pub(super) async fn watch_run(
        self: &Arc<Self>,
        c: &dyn RunContainer,
        listener: tokio::net::UnixListener,
        brief_line: String,
        commands_rx: mpsc::Receiver<String>,
        run_id: &str,
        killing: &AtomicBool,
    ) -> RunEnd {
        let (processed_tx, mut processed_rx) = mpsc::channel::<()>(1);
        let mut commands_rx = Some(commands_rx);
        let mut connected = false;
        let mut helpers: Vec<tokio::task::JoinHandle<()>> = Vec::new();
        let mut ended: Option<Ended> = None;
        let mut crash = None;
        let mut eof = false;
        let mut eof_deadline: Option<tokio::time::Instant> = None;
        let mut drain_deadline: Option<tokio::time::Instant> = None;
        loop {
            if ended.is_some() && (eof || !connected) {
                break;
            }
            tokio::select! {
                end = c.ended(), if ended.is_none() => {
                    ended = Some(end);
                    drain_deadline = Some(tokio::time::Instant::now() + DRAIN_GRACE);
                }
                acc = listener.accept(), if !connected => match acc {
                    Ok((stream, _)) => {
                        connected = true;
                        let (r, w) = stream.into_split();
                        // One line in flight: the reader waits while the processor works (backpressure).
                        let (line_tx, line_rx) = mpsc::channel::<Incoming>(1);
                        let max = self.host.settings.agents.max_line_bytes;
                        helpers.push(tokio::spawn(read_lines(r, line_tx, max)));
                        helpers.push(tokio::spawn(self.clone().process_lines(
                            run_id.to_owned(), line_rx, processed_tx.clone(),
                        ).in_current_span()));
                        if let Some(rx) = commands_rx.take() {
                            helpers.push(tokio::spawn(write_lines(w, brief_line.clone(), rx)));
                        }
                    }
                    Err(e) => warn!(error = %e, "control socket accept failed"),
                },
                _ = processed_rx.recv(), if connected && !eof => {
                    eof = true;
                    if ended.is_none() && !killing.load(Ordering::SeqCst) {
                        eof_deadline = Some(tokio::time::Instant::now() + EOF_GRACE);
                    }
                }
                _ = sleep_until(eof_deadline), if eof_deadline.is_some() && ended.is_none() => {
                    eof_deadline = None;
                    crash.get_or_insert_with(|| "the control connection dropped while the agent kept running".into());
                    c.signal(Signal::SIGKILL);
                }
                _ = sleep_until(drain_deadline), if drain_deadline.is_some() => {
                    // The container is gone but its last lines are still being read or processed (a slow upload,
                    // a leaked descriptor): the run ends without them.
                    warn!("the agent's last control lines were not all processed in time");
                    break;
                }
            }
        }
        for h in helpers {
            h.abort();
        }
        RunEnd {
            // The loop ends only once the container has ended.
            ended: ended.unwrap_or(Ended {
                exit: ProgramExit::Signal(libc::SIGKILL),
                setup_error: None,
            }),
            crash,
        }
    }

    /// Turns the agent's lines into events one at a time, artifact uploads included; says when the connection's
    /// last line is processed.
    async fn process_lines(
        self: Arc<Self>,
        run_id: String,
        mut lines: mpsc::Receiver<Incoming>,
        processed: mpsc::Sender<()>,
    ) {
        while let Some(msg) = lines.recv().await {
            match msg {
                Incoming::Line(line) => self.handle_line(&run_id, line.as_bytes()).await,
                Incoming::NotUtf8 => self.malformed(&run_id, "the line is not UTF-8"),
                Incoming::TooLong => {
                    let max = self.host.settings.agents.max_line_bytes;
                    self.hub.emit(
                        &run_id,
                        error_event(
                            &self.agent_id,
                            "warning",
                            &format!(
                                "A control line of more than {max} bytes was skipped: over agents.max_line_bytes"
                            ),
                            true,
                            Some("control_line_too_long"),
                            "internal",
                        ),
                    );
                }
                Incoming::Eof => break,
            }
        }
        let _ = processed.send(()).await;
    }

    fn malformed(&self, run_id: &str, why: &str) {
        let why: String = why.chars().take(200).collect();
        self.hub.emit(
            run_id,
            error_event(
                &self.agent_id,
                "warning",
                &format!("Malformed control line dropped: {why}"),
                true,
                Some("malformed_event"),
                "internal",
            ),
        );
    }

    async fn handle_line(&self, run_id: &str, bytes: &[u8]) {
        match parse_agent_line(bytes) {
            Err(why) => self.malformed(run_id, &why),
            Ok(AgentLine::State {
                checkpoint,
                conversation_summary,
            }) => {
                self.shared().checkpoint = Some((checkpoint, conversation_summary));
            }
            Ok(AgentLine::Event(mut event)) => {
                let kind = event
                    .get("type")
                    .and_then(Value::as_str)
                    .unwrap_or_default()
                    .to_owned();
                if kind == "decision" {
                    if let Some(d) = event.get("decisionId").and_then(Value::as_str) {
                        let mut sh = self.shared();
                        sh.pending_decisions.insert(d.to_owned());
                        if sh.status == Some(AgentStatus::Running) {
                            sh.status = Some(AgentStatus::WaitingOnHuman);
                        }
                    }
                }
                let mut failure = None;
                if kind == "artifact" {
                    let written = event
                        .get("uri")
                        .and_then(Value::as_str)
                        .and_then(|uri| self.written_volume(uri));
                    match self.upload_artifact(&mut event).await {
                        Ok(()) => {
                            if event.contains_key("contentHash") {
                                self.shared().uploads += 1;
                            }
                        }
                        Err(e) => failure = Some(e),
                    }
                    if let Some((volumes, volume, path)) = written {
                        let uploaded = failure.is_none() && event.contains_key("contentHash");
                        volumes
                            .record_artifact(&volume, &self.id, path, uploaded)
                            .await;
                    }
                }
                self.hub.emit(run_id, event);
                if let Some(e) = failure {
                    self.hub.emit(
                        run_id,
                        error_event(
                            &self.agent_id,
                            "medium",
                            &format!("Artifact not uploaded: {}", Chain(&e)),
                            true,
                            Some("artifact_upload_failed"),
                            "tool",
                        ),
                    );
                }
            }
        }
    }
}

/// How a run's watch ended.
pub(super) struct RunEnd {
    /// How the container ended.
    pub ended: Ended,
    /// Why sandboxd stopped the run, if it did.
    pub crash: Option<String>,
}

/// What the reader hands the processor.
#[derive(Debug, PartialEq, Eq)]
enum Incoming {
    /// A line, without its line ending.
    Line(String),
    /// A line that is not UTF-8 (dropped).
    NotUtf8,
    /// A line over the limit (skipped by the codec up to its newline).
    TooLong,
    /// The connection's end.
    Eof,
}

/// [`LinesCodec`] with a maximum line length whose refusals are items, not errors: a [`FramedRead`] ends its
/// stream after a decoder error, and the run must go on after a long or non-UTF-8 line.
struct ControlCodec(LinesCodec);

impl ControlCodec {
    fn new(max: u64) -> Self {
        Self(LinesCodec::new_with_max_length(
            usize::try_from(max).unwrap_or(usize::MAX),
        ))
    }

    fn item(r: Result<Option<String>, LinesCodecError>) -> std::io::Result<Option<Incoming>> {
        match r {
            Ok(line) => Ok(line.map(Incoming::Line)),
            Err(LinesCodecError::MaxLineLengthExceeded) => Ok(Some(Incoming::TooLong)),
            // The line was consumed before its UTF-8 check.
            Err(LinesCodecError::Io(e)) if e.kind() == std::io::ErrorKind::InvalidData => {
                Ok(Some(Incoming::NotUtf8))
            }
            Err(LinesCodecError::Io(e)) => Err(e),
        }
    }
}

impl Decoder for ControlCodec {
    type Item = Incoming;
    type Error = std::io::Error;

    fn decode(&mut self, buf: &mut BytesMut) -> std::io::Result<Option<Incoming>> {
        Self::item(self.0.decode(buf))
    }

    fn decode_eof(&mut self, buf: &mut BytesMut) -> std::io::Result<Option<Incoming>> {
        Self::item(self.0.decode_eof(buf))
    }
}

/// Reads the agent's lines (at most `max` bytes each) and hands them to the processor one at a time; empty lines
/// are skipped. A read error ends the connection as its end does.
async fn read_lines<R: tokio::io::AsyncRead + Unpin + Send>(
    r: R,
    tx: mpsc::Sender<Incoming>,
    max: u64,
) {
    let mut lines = FramedRead::new(r, ControlCodec::new(max));
    while let Some(Ok(item)) = lines.next().await {
        let item = match item {
            Incoming::Line(l) => {
                let l = l.trim_end_matches(['\r', '\n']);
                if l.is_empty() {
                    continue;
                }
                Incoming::Line(l.to_owned())
            }
            other => other,
        };
        if tx.send(item).await.is_err() {
            return;
        }
    }
    let _ = tx.send(Incoming::Eof).await;
}

async fn write_lines(
    mut w: tokio::net::unix::OwnedWriteHalf,
    first: String,
    mut rx: mpsc::Receiver<String>,
) {
    if w.write_all(first.as_bytes()).await.is_err() {
        return;
    }
    while let Some(l) = rx.recv().await {
        if w.write_all(l.as_bytes()).await.is_err() {
            return;
        }
    }
}

async fn sleep_until(at: Option<tokio::time::Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What the reader hands on for `input` with lines of at most `max` bytes.
    async fn read(input: &[u8], max: u64) -> Vec<Incoming> {
        let (tx, mut rx) = mpsc::channel(1);
        let reader = tokio::spawn(read_lines(std::io::Cursor::new(input.to_vec()), tx, max));
        let mut got = Vec::new();
        while let Some(item) = rx.recv().await {
            got.push(item);
        }
        reader.await.unwrap();
        got
    }

    fn line(s: &str) -> Incoming {
        Incoming::Line(s.to_owned())
    }

    #[tokio::test]
    async fn a_line_of_the_maximum_is_read_and_a_longer_one_skipped_to_its_newline() {
        let got = read(b"12345678\n123456789\nok\n", 8).await;
        assert_eq!(
            got,
            [
                line("12345678"),
                Incoming::TooLong,
                line("ok"),
                Incoming::Eof
            ]
        );
        // Far longer than the maximum: skipped whole, in however many reads it takes, and reported once.
        let mut long = vec![b'x'; 100_000];
        long.extend_from_slice(b"\nafter\n");
        assert_eq!(
            read(&long, 8).await,
            [Incoming::TooLong, line("after"), Incoming::Eof]
        );
    }

    #[tokio::test]
    async fn line_endings_empty_lines_and_bad_utf8() {
        let got = read(b"a\r\n\n\r\nb\xff\nc\nlast", 8).await;
        assert_eq!(
            got,
            [
                line("a"),
                Incoming::NotUtf8,
                line("c"),
                // A last line without its newline is still a line.
                line("last"),
                Incoming::Eof
            ]
        );
        // An overlong last line without a newline is skipped too.
        assert_eq!(
            read(b"ok\n0123456789", 8).await,
            [line("ok"), Incoming::TooLong, Incoming::Eof]
        );
    }
}

//! The control channel of a run: the agent connects to `/sandbox/control.sock`, gets its brief line and then the
//! commands (`resolve`, `inject_context`, `update_brief`, `shutdown`), and writes its events and state as JSON
//! lines. Lines are framed by tokio-util's [`LinesCodec`] with a maximum of `agents.max_line_bytes`: a longer line
//! is never kept; the codec discards it up to its newline, a `control_line_too_long` warning goes out, and the next
//! line is read as usual. A line that is not UTF-8 or not JSON is dropped with a `malformed_event` warning, and so
//! is a valid one that is not the agent's to write (`vet`): a lifecycle event, another agent's event, an error
//! with one of sandboxd's error codes, a decision id over [`MAX_DECISION_ID_BYTES`] or past
//! [`MAX_PENDING_DECISIONS`]. What sandboxd fills in after an artifact's upload is never taken from the agent.
//!
//! Reading and processing are two tasks with one line in flight between them, so a slow upload slows the reading
//! (backpressure) but never the supervisor.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use agent_api::{error_codes, error_event, parse_agent_line, AgentLine, AgentStatus};
use futures_util::StreamExt;
use nix::sys::signal::Signal;
use runtime::error::Chain;
use runtime::init::ProgramExit;
use serde_json::{Map, Value};
use tokio::io::AsyncWriteExt;
use tokio::sync::mpsc;
use tokio_util::bytes::BytesMut;
use tokio_util::codec::{Decoder, FramedRead, LinesCodec, LinesCodecError};
use tracing::{warn, Instrument};

use super::spool::{Spool, Spooled};
use super::Sandbox;
use containers::agent::{Ended, RunContainer};

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
    #[allow(clippy::too_many_arguments)]
    pub(super) async fn watch_run(
        self: &Arc<Self>,
        c: &dyn RunContainer,
        listener: tokio::net::UnixListener,
        first: First,
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
        let First {
            pre,
            brief: brief_line,
            mut spool,
        } = first;
        // An adopted run's agent connected to an earlier daemon (its brief went out then, unless `brief_line` says
        // otherwise).
        if let Some(stream) = pre {
            connected = true;
            let me = self.clone();
            let after: AfterFirst = match brief_line.is_empty() {
                true => None,
                false => Some(Box::new(move || me.persist_connected())),
            };
            let conn = (stream, brief_line.clone(), spool.take());
            self.serve_connection(
                conn,
                (commands_rx.take(), after),
                run_id,
                &processed_tx,
                &mut helpers,
            );
        }
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
                        // A kept run's init holds the connection too, for a daemon after this one; once the brief is
                        // out, the record says so.
                        let after_brief: AfterFirst = match c.hold(std::os::fd::AsFd::as_fd(&stream)) {
                            Ok(()) => {
                                let me = self.clone();
                                Some(Box::new(move || me.persist_connected()))
                            }
                            Err(e) => {
                                warn!(error = %Chain(&e), "the run's init cannot hold the control connection: it ends with this daemon");
                                self.forget_kept();
                                None
                            }
                        };
                        let conn = (stream, brief_line.clone(), spool.take());
                        self.serve_connection(conn, (commands_rx.take(), after_brief), run_id, &processed_tx, &mut helpers);
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

    /// Reads and processes the agent's lines from the connection (after what its spool holds unprocessed), and
    /// writes the first line and then the commands to it.
    fn serve_connection(
        self: &Arc<Self>,
        (stream, first, spool): (tokio::net::UnixStream, String, Option<SpoolStart>),
        (commands_rx, after_first): (Option<mpsc::Receiver<String>>, AfterFirst),
        run_id: &str,
        processed_tx: &mpsc::Sender<()>,
        helpers: &mut Vec<tokio::task::JoinHandle<()>>,
    ) {
        let (r, w) = stream.into_split();
        let (reader, start, spool): (Box<dyn tokio::io::AsyncRead + Unpin + Send>, u64, _) =
            match spool {
                Some((sp, rest, start)) => {
                    let spooled = Spooled::new(r, sp.clone());
                    let reader =
                        tokio::io::AsyncReadExt::chain(std::io::Cursor::new(rest), spooled);
                    (Box::new(reader), start, Some(sp))
                }
                None => (Box::new(r), 0, None),
            };
        // One line in flight: the reader waits while the processor works (backpressure).
        let (line_tx, line_rx) = mpsc::channel::<(Incoming, u64)>(1);
        let max = self.host.settings.agents.max_line_bytes;
        helpers.push(tokio::spawn(read_lines(reader, line_tx, (max, start))));
        helpers.push(tokio::spawn(
            self.clone()
                .process_lines(run_id.to_owned(), (line_rx, spool), processed_tx.clone())
                .in_current_span(),
        ));
        if let Some(rx) = commands_rx {
            helpers.push(tokio::spawn(write_lines(w, (first, after_first), rx)));
        }
    }

    /// Turns the agent's lines into events one at a time, artifact uploads included; says when the connection's
    /// last line is processed.
    async fn process_lines(
        self: Arc<Self>,
        run_id: String,
        (mut lines, spool): (mpsc::Receiver<(Incoming, u64)>, Option<Arc<Spool>>),
        processed: mpsc::Sender<()>,
    ) {
        while let Some((msg, end)) = lines.recv().await {
            if matches!(msg, Incoming::Eof) {
                break;
            }
            let changed = self.process_one(&run_id, msg).await;
            // The line is not read again by a daemon after this one (written right after its event, so only a
            // death in between repeats it), and what it changed (status, decisions, checkpoint) is kept for it.
            if let Some(spool) = &spool {
                spool.processed(end);
            }
            // The record is blocking file I/O (bounded: a checkpoint of a line and the pending decisions' ids), done
            // on a blocking thread; the next line waits for it, so writes never pile up behind a flooding agent.
            if changed {
                let me = self.clone();
                if let Err(e) = tokio::task::spawn_blocking(move || me.persist()).await {
                    warn!(error = %e, "the sandbox's record was not written");
                }
            }
        }
        let _ = processed.send(()).await;
    }

    /// Processes one item; whether it changed the sandbox's state (what its record keeps).
    async fn process_one(&self, run_id: &str, msg: Incoming) -> bool {
        match msg {
            Incoming::Line(line) => return self.handle_line(run_id, line.as_bytes()).await,
            Incoming::NotUtf8 => self.malformed(run_id, "the line is not UTF-8"),
            Incoming::TooLong => {
                let max = self.host.settings.agents.max_line_bytes;
                self.hub.emit(
                    run_id,
                    error_event(
                        &self.agent_id,
                        "warning",
                        &format!(
                            "A control line of more than {max} bytes was skipped: over agents.max_line_bytes"
                        ),
                        true,
                        Some(error_codes::CONTROL_LINE_TOO_LONG),
                        "internal",
                    ),
                );
            }
            Incoming::Eof | Incoming::Skipped => {}
        }
        false
    }

    fn malformed(&self, run_id: &str, why: &str) {
        let why: String = why.chars().take(200).collect();
        self.warn_dropped_line(run_id, &format!("Malformed control line dropped: {why}"));
    }

    /// A valid line that is not the agent's to write, dropped: reported as a malformed one is.
    fn refused(&self, run_id: &str, why: &Refused) {
        self.warn_dropped_line(run_id, &format!("Control line refused: {why}"));
    }

    fn warn_dropped_line(&self, run_id: &str, message: &str) {
        self.hub.emit(
            run_id,
            error_event(
                &self.agent_id,
                "warning",
                message,
                true,
                Some(error_codes::MALFORMED_EVENT),
                "internal",
            ),
        );
    }

    /// `id` is pending (the agent waits on the gateway), unless [`MAX_PENDING_DECISIONS`] others are already.
    fn add_pending(&self, id: &str) -> Result<(), Refused> {
        let mut sh = self.shared();
        if sh.pending_decisions.len() >= MAX_PENDING_DECISIONS && !sh.pending_decisions.contains(id)
        {
            return Err(Refused::TooManyDecisions);
        }
        sh.pending_decisions.insert(id.to_owned());
        if sh.status == Some(AgentStatus::Running) {
            sh.status = Some(AgentStatus::WaitingOnHuman);
        }
        Ok(())
    }

    /// Handles one line; whether it changed the sandbox's state (a checkpoint, a decision).
    pub(super) async fn handle_line(&self, run_id: &str, bytes: &[u8]) -> bool {
        match parse_agent_line(bytes) {
            Err(why) => {
                self.malformed(run_id, &why);
                false
            }
            Ok(AgentLine::State {
                checkpoint,
                conversation_summary,
            }) => {
                self.shared().checkpoint = Some((checkpoint, conversation_summary));
                true
            }
            Ok(AgentLine::Event(mut event)) => {
                let stray_uri = match vet(&mut event, &self.agent_id) {
                    Ok(stray) => stray,
                    Err(why) => {
                        self.refused(run_id, &why);
                        return false;
                    }
                };
                let kind = event
                    .get("type")
                    .and_then(Value::as_str)
                    .unwrap_or_default()
                    .to_owned();
                let mut changed = false;
                if kind == "decision" {
                    if let Some(d) = event.get("decisionId").and_then(Value::as_str) {
                        if let Err(why) = self.add_pending(d) {
                            self.refused(run_id, &why);
                            return false;
                        }
                        changed = true;
                    }
                }
                let mut failure = stray_uri.map(|e| e.to_string());
                if kind == "artifact" && failure.is_none() {
                    failure = self.extract_artifact(&mut event).await;
                }
                self.hub.emit(run_id, event);
                if let Some(why) = failure {
                    self.hub.emit(
                        run_id,
                        error_event(
                            &self.agent_id,
                            "medium",
                            &format!("Artifact not uploaded: {why}"),
                            true,
                            Some(error_codes::ARTIFACT_UPLOAD_FAILED),
                            "tool",
                        ),
                    );
                }
                changed
            }
        }
    }

    /// Uploads the file an artifact event names and rewrites the event ([`Self::upload_artifact`]), and records
    /// it when it lies on a volume; why it was not uploaded, if it was not.
    async fn extract_artifact(&self, event: &mut Map<String, Value>) -> Option<String> {
        let written = event
            .get("uri")
            .and_then(Value::as_str)
            .and_then(|uri| self.written_volume(uri));
        let mut failure = None;
        match self.upload_artifact(event).await {
            // Only an upload sets `contentHash` (the agent's own was removed).
            Ok(()) => {
                if event.contains_key("contentHash") {
                    self.shared().uploads += 1;
                }
            }
            Err(e) => failure = Some(Chain(&e).to_string()),
        }
        if let Some((volumes, volume, path)) = written {
            let uploaded = failure.is_none() && event.contains_key("contentHash");
            volumes
                .record_artifact(&volume, &self.id, path, uploaded)
                .await;
        }
        failure
    }
}

/// The longest `decisionId` an agent may write, bytes: the pending ones are kept (in memory and in the record)
/// until the gateway resolves them.
pub const MAX_DECISION_ID_BYTES: usize = 256;
/// Decisions pending at once; another one is refused until the gateway resolves one.
pub const MAX_PENDING_DECISIONS: usize = 1000;

/// Why a valid event line is not the agent's to write (it is dropped, with a `malformed_event` warning).
#[derive(Debug, thiserror::Error)]
enum Refused {
    /// Only sandboxd says how a run starts, stops or ends.
    #[error("A lifecycle event is sandboxd's own")]
    Lifecycle,
    /// The event names another agent.
    #[error("The agentId {got:?} is not this sandbox's agent ({own})")]
    AgentId {
        /// What the line says (the first 64 characters).
        got: String,
        /// The sandbox's agent.
        own: String,
    },
    /// An error event with one of [`error_codes::RESERVED`].
    #[error("The errorCode {0} is sandboxd's own")]
    ReservedCode(&'static str),
    /// A `decisionId` over [`MAX_DECISION_ID_BYTES`].
    #[error("A decisionId of {0} bytes is over {MAX_DECISION_ID_BYTES}")]
    DecisionIdTooLong(usize),
    /// [`MAX_PENDING_DECISIONS`] are pending.
    #[error("{MAX_PENDING_DECISIONS} decisions are pending already, the most an agent may have")]
    TooManyDecisions,
}

/// An artifact's `uri` that is neither a path to upload nor absent (removed from the event).
#[derive(Debug, thiserror::Error)]
#[error("Its uri {0:?} is not a path under /workspace (only sandboxd's upload gives an artifact a backend uri)")]
struct NotASandboxPath(String);

/// Checks an agent's event against what only sandboxd may say (lifecycle events, another agent's name, sandboxd's
/// error codes, an over-long decision id), and takes out of an artifact what sandboxd fills in after an upload:
/// `contentHash`, `sizeBytes`, `provenance.sourcePath`, and a `uri` that is not an absolute path (returned; an
/// absolute one is the upload's to take or refuse).
fn vet(event: &mut Map<String, Value>, agent_id: &str) -> Result<Option<NotASandboxPath>, Refused> {
    let kind = event
        .get("type")
        .and_then(Value::as_str)
        .unwrap_or_default();
    if kind == "lifecycle" {
        return Err(Refused::Lifecycle);
    }
    let named = event
        .get("agentId")
        .and_then(Value::as_str)
        .unwrap_or_default();
    if named != agent_id {
        return Err(Refused::AgentId {
            got: named.chars().take(64).collect(),
            own: agent_id.to_owned(),
        });
    }
    let field = |name: &str| event.get(name).and_then(Value::as_str);
    match kind {
        "error" => {
            match field("errorCode").and_then(|c| error_codes::RESERVED.iter().find(|r| **r == c)) {
                Some(code) => Err(Refused::ReservedCode(code)),
                None => Ok(None),
            }
        }
        "decision" => match field("decisionId").map(str::len) {
            Some(n) if n > MAX_DECISION_ID_BYTES => Err(Refused::DecisionIdTooLong(n)),
            _ => Ok(None),
        },
        "artifact" => {
            event.remove("contentHash");
            event.remove("sizeBytes");
            if let Some(Value::Object(p)) = event.get_mut("provenance") {
                p.remove("sourcePath");
            }
            match event.get("uri") {
                Some(Value::String(uri)) if uri.starts_with('/') => Ok(None),
                None => Ok(None),
                Some(uri) => {
                    let uri = uri.as_str().map_or_else(|| uri.to_string(), str::to_owned);
                    let uri = uri.chars().take(128).collect();
                    event.remove("uri");
                    Ok(Some(NotASandboxPath(uri)))
                }
            }
        }
        _ => Ok(None),
    }
}

/// Called once the first line (the brief) is written.
type AfterFirst = Option<Box<dyn FnOnce() + Send>>;

/// A run's spool ([`Spool`]), the spooled bytes not processed yet, and the stream offset they start at.
pub(super) type SpoolStart = (Arc<Spool>, Vec<u8>, u64);

/// How a run's control channel starts.
pub(super) struct First {
    /// The agent's connection, when it connected to an earlier daemon (an adopted run).
    pub pre: Option<tokio::net::UnixStream>,
    /// The first line to write (the brief; empty when it went out already).
    pub brief: String,
    /// The spool (live restore).
    pub spool: Option<SpoolStart>,
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
    /// More of such a line skipped (nothing to process: its bytes are consumed, for the spool).
    Skipped,
    /// The connection's end.
    Eof,
}

/// [`LinesCodec`] with a maximum line length whose refusals are items, not errors: a [`FramedRead`] ends its
/// stream after a decoder error, and the run must go on after a long or non-UTF-8 line.
/// It counts the bytes it consumed: an item's end in the connection's byte stream (for the spool).
struct ControlCodec {
    lines: LinesCodec,
    /// Stream offset after the bytes consumed so far.
    consumed: u64,
}

impl ControlCodec {
    fn new(max: u64, start: u64) -> Self {
        Self {
            lines: LinesCodec::new_with_max_length(usize::try_from(max).unwrap_or(usize::MAX)),
            consumed: start,
        }
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
        let before = buf.len();
        let r = self.lines.decode(buf);
        let consumed = (before - buf.len()) as u64;
        self.consumed += consumed;
        // The inner codec consumes bytes without a line only while it skips a long one: said, so the spool
        // learns they are done with.
        match r {
            Ok(None) if consumed > 0 => Ok(Some(Incoming::Skipped)),
            r => Self::item(r),
        }
    }

    fn decode_eof(&mut self, buf: &mut BytesMut) -> std::io::Result<Option<Incoming>> {
        let before = buf.len();
        let r = self.lines.decode_eof(buf);
        self.consumed += (before - buf.len()) as u64;
        Self::item(r)
    }
}

/// Reads the agent's lines (at most `max` bytes each) and hands them to the processor one at a time; empty lines
/// are skipped. A read error ends the connection as its end does.
/// Each item goes with its end in the connection's byte stream, which starts at stream offset `start`.
async fn read_lines<R: tokio::io::AsyncRead + Unpin + Send>(
    r: R,
    tx: mpsc::Sender<(Incoming, u64)>,
    (max, start): (u64, u64),
) {
    let mut lines = FramedRead::new(r, ControlCodec::new(max, start));
    while let Some(Ok(item)) = lines.next().await {
        let end = lines.decoder().consumed;
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
        if tx.send((item, end)).await.is_err() {
            return;
        }
    }
    let end = lines.decoder().consumed;
    let _ = tx.send((Incoming::Eof, end)).await;
}

/// The control connection's write half, which never shuts the connection down.
///
/// Tokio's write half shuts the socket's write side down when dropped, and that reaches the agent as an end of
/// file whatever else holds the socket: the run's init holds it for a later daemon (live restore), and a daemon
/// that stops (its tasks dropped at exit) must leave the agent its connection, as a killed one does. Dropped, this
/// only closes the daemon's descriptor once the read half is gone too.
struct KeepOpen(Option<tokio::net::unix::OwnedWriteHalf>);

impl Drop for KeepOpen {
    fn drop(&mut self) {
        if let Some(w) = self.0.take() {
            w.forget();
        }
    }
}

/// Writes `first` (then calls `after_first`), then each command.
async fn write_lines(
    w: tokio::net::unix::OwnedWriteHalf,
    (first, after_first): (String, AfterFirst),
    mut rx: mpsc::Receiver<String>,
) {
    let mut keep = KeepOpen(Some(w));
    let Some(w) = keep.0.as_mut() else {
        return;
    };
    if w.write_all(first.as_bytes()).await.is_err() {
        return;
    }
    if let Some(f) = after_first {
        f();
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
        read_from(input, max, 0)
            .await
            .into_iter()
            .filter(|(i, _)| *i != Incoming::Skipped)
            .map(|(i, _)| i)
            .collect()
    }

    /// What the reader hands on, with each item's end in the stream, for a stream that starts at `start`.
    async fn read_from(input: &[u8], max: u64, start: u64) -> Vec<(Incoming, u64)> {
        let (tx, mut rx) = mpsc::channel(1);
        let input = std::io::Cursor::new(input.to_vec());
        let reader = tokio::spawn(read_lines(input, tx, (max, start)));
        let mut got = Vec::new();
        while let Some(item) = rx.recv().await {
            got.push(item);
        }
        reader.await.unwrap();
        got
    }

    #[tokio::test]
    async fn each_item_ends_where_its_bytes_end_in_the_stream() {
        let got = read_from(
            b"12345678
123456789

ok
",
            8,
            100,
        )
        .await;
        assert_eq!(
            got,
            [
                (line("12345678"), 109),
                // Reported as soon as the line is over the maximum, before its rest is skipped.
                (Incoming::TooLong, 109),
                // The rest of the long line and the empty line are consumed before "ok".
                (line("ok"), 123),
                (Incoming::Eof, 123)
            ]
        );
        // A long line skipped over many reads: its bytes are said consumed as they go (the spool drops them).
        let mut long = vec![b'x'; 100_000];
        long.extend_from_slice(b"\nafter\n");
        let got = read_from(&long, 8, 0).await;
        let skipped: Vec<u64> = got
            .iter()
            .filter(|(i, _)| *i == Incoming::Skipped)
            .map(|(_, end)| *end)
            .collect();
        assert!(
            skipped.len() > 1 && skipped.windows(2).all(|w| w[0] < w[1]),
            "{skipped:?}"
        );
        assert!(skipped.last().is_some_and(|&e| e > 90_000), "{skipped:?}");
        assert_eq!(got[got.len() - 2], (line("after"), 100_007));
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

    /// The daemon's side of a control connection ends (its writer's task is dropped, as at a daemon's stop) while
    /// another process holds the socket (the run's init, for live restore): the agent gets no end of file.
    #[tokio::test]
    async fn a_writer_that_ends_leaves_the_connection_open_for_its_other_holders() {
        use tokio::io::AsyncReadExt;
        let (daemon, agent) = std::os::unix::net::UnixStream::pair().unwrap();
        let init = daemon.try_clone().unwrap();
        daemon.set_nonblocking(true).unwrap();
        let (r, w) = tokio::net::UnixStream::from_std(daemon)
            .unwrap()
            .into_split();
        let (tx, rx) = mpsc::channel(1);
        let writer = tokio::spawn(write_lines(w, ("brief\n".into(), None), rx));
        tx.send("command\n".into()).await.unwrap();
        drop(tx);
        writer.await.unwrap();
        drop(r);
        agent.set_nonblocking(true).unwrap();
        let mut agent = tokio::net::UnixStream::from_std(agent).unwrap();
        let mut lines = [0; 14];
        agent.read_exact(&mut lines).await.unwrap();
        assert_eq!(&lines, b"brief\ncommand\n");
        let mut got = [0; 64];
        let more = tokio::time::timeout(Duration::from_millis(200), agent.read(&mut got)).await;
        assert!(more.is_err(), "the agent read {more:?}: an end of file");
        drop(init);
        let end = tokio::time::timeout(Duration::from_secs(5), agent.read(&mut got)).await;
        assert_eq!(end.unwrap().unwrap(), 0, "the last holder's close ends it");
    }
}

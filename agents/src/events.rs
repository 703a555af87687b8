//! A sandbox's event pipeline: stamping (UUID v7 `sourceEventId`, monotonic `sourceSequence`,
//! `sourceOccurredAt`, `runId`), the rolling on-disk log behind `POST /replay`, and the queue a gateway's
//! `WS /events` drains. The budgets ([`Budgets`]) are from `agents:` in the configuration.
//!
//! Every event is logged before it is queued. The queue holds at most [`Budgets::queue_events`] events and
//! [`Budgets::queue_bytes`] of them (each counts its JSON plus [`QUEUED_OVERHEAD`]), none older than
//! [`DISCONNECTED_BUFFER_MS`] while no gateway is connected (what aged is dropped at the next event, or when a
//! gateway connects); over a budget, low-priority events go first (else the oldest). Dropped events stay in the log, so
//! a gateway that sees a sequence gap replays them. How many were dropped is counted exactly and told in a warning
//! `ErrorEvent` (`events_dropped`): while a gateway is connected at most one a second as drops happen, and in any
//! case as soon as a gateway has drained the queue, so the count arrives without the agent emitting again. No
//! warning is queued while no gateway is connected (it would only take the place of an event).
//!
//! The log is two segment files of half of [`Budgets::replay_bytes`] each: when the current one would grow past
//! its half, the older one is deleted and the current one becomes the older, so the newest half of the budget is
//! always on disk. [`Hub::replay`] reads it line by line from descriptors opened under the hub's lock, so a
//! replay neither holds the lock nor the log in memory.

use std::collections::VecDeque;
use std::fs;
use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use agent_api::{
    error_event, is_low_priority, AdapterEvent, SequenceRange, DISCONNECTED_BUFFER_MS,
};
use serde_json::{Map, Value};
use tokio::sync::watch;

pub use crate::config::AGENT_QUEUED_OVERHEAD as QUEUED_OVERHEAD;
use crate::config::{
    AGENT_STAMP_BYTES, DEFAULT_AGENT_MAX_LINE_BYTES, DEFAULT_AGENT_QUEUE_BYTES,
    DEFAULT_AGENT_QUEUE_EVENTS, DEFAULT_AGENT_REPLAY_BYTES,
};
/// A newer gateway connection replaced this one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("A newer gateway connection replaced this one")]
pub struct Replaced;

/// A replay's answer goes out in chunks of about this size.
const REPLAY_CHUNK: usize = 64 << 10;

/// The budgets of one sandbox's events.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Budgets {
    /// Bytes queued for the gateway.
    pub queue_bytes: u64,
    /// Events queued for the gateway.
    pub queue_events: usize,
    /// Bytes of the on-disk log (two halves).
    pub replay_bytes: u64,
    /// Largest stamped event; a larger one is replaced by an `ErrorEvent`.
    pub max_event_bytes: u64,
}

impl Budgets {
    /// The budgets of `agents:` in the configuration.
    pub fn from_config(a: &crate::config::AgentsConfig) -> Self {
        Self {
            queue_bytes: a.queue_bytes,
            queue_events: a.queue_events,
            replay_bytes: a.replay_bytes,
            max_event_bytes: a.max_line_bytes.saturating_add(AGENT_STAMP_BYTES),
        }
    }
}

impl Default for Budgets {
    fn default() -> Self {
        Self {
            queue_bytes: DEFAULT_AGENT_QUEUE_BYTES,
            queue_events: DEFAULT_AGENT_QUEUE_EVENTS,
            replay_bytes: DEFAULT_AGENT_REPLAY_BYTES,
            max_event_bytes: DEFAULT_AGENT_MAX_LINE_BYTES + AGENT_STAMP_BYTES,
        }
    }
}

/// One queued event: its JSON, whether it may be dropped first, when it was queued.
struct Queued {
    json: Arc<str>,
    low: bool,
    at: Instant,
}

impl Queued {
    fn cost(&self) -> u64 {
        self.json.len() as u64 + QUEUED_OVERHEAD
    }
}

struct Inner {
    next_seq: u64,
    queue: VecDeque<Queued>,
    /// What the queue costs ([`Queued::cost`] summed).
    queued_bytes: u64,
    /// Generation of the connected gateway; `None` while none is.
    gateway: Option<u64>,
    generations: u64,
    /// Events dropped and not told yet.
    dropped: u64,
    /// When events were last dropped.
    last_drop: Option<Instant>,
    /// When the last `events_dropped` warning was queued.
    last_warning: Option<Instant>,
    /// The run of the latest event (for a warning queued when the queue drains).
    run_id: String,
    log: Log,
}

struct Log {
    dir: PathBuf,
    /// Bytes a segment may reach.
    segment_bytes: u64,
    /// First sequence of the older segment, if there is one.
    older_first: Option<u64>,
    /// First sequence of the current segment, how many events and bytes it holds.
    current_first: u64,
    current_len: u64,
    current_bytes: u64,
    file: Option<fs::File>,
}

impl Log {
    fn older(&self) -> PathBuf {
        self.dir.join("older.jsonl")
    }

    fn current(&self) -> PathBuf {
        self.dir.join("current.jsonl")
    }

    fn append(&mut self, seq: u64, json: &str) -> std::io::Result<()> {
        let size = json.len() as u64 + 1;
        if self.current_len > 0 && self.current_bytes + size > self.segment_bytes {
            self.file = None;
            fs::rename(self.current(), self.older())?;
            self.older_first = Some(self.current_first);
            self.current_len = 0;
            self.current_bytes = 0;
        }
        if self.current_len == 0 {
            self.current_first = seq;
        }
        let file = match &mut self.file {
            Some(f) => f,
            None => self.file.insert(
                fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(self.current())?,
            ),
        };
        let mut line = Vec::with_capacity(json.len() + 1);
        line.extend_from_slice(json.as_bytes());
        line.push(b'\n');
        file.write_all(&line)?;
        self.current_len += 1;
        self.current_bytes += size;
        Ok(())
    }

    /// Takes up the segments on disk (a last line without its newline is cut off); the last sequence logged.
    fn recover(&mut self) -> std::io::Result<Option<u64>> {
        let scan = |path: &Path| -> std::io::Result<Option<(u64, u64, u64, u64)>> {
            let bytes = match fs::read(path) {
                Ok(b) => b,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
                Err(e) => return Err(e),
            };
            let whole = bytes.iter().rposition(|&b| b == b'\n').map_or(0, |i| i + 1);
            if whole < bytes.len() {
                fs::OpenOptions::new()
                    .write(true)
                    .open(path)?
                    .set_len(whole as u64)?;
            }
            let seq = |line: &[u8]| {
                serde_json::from_slice::<LoggedSequence>(line)
                    .map(|l| l.source_sequence)
                    .map_err(std::io::Error::other)
            };
            let mut lines = bytes[..whole]
                .split(|&b| b == b'\n')
                .filter(|l| !l.is_empty());
            let Some(first) = lines.next() else {
                return Ok(None);
            };
            let first = seq(first)?;
            let (mut last, mut len) = (first, 1);
            for l in lines {
                last = seq(l)?;
                len += 1;
            }
            Ok(Some((first, last, len, whole as u64)))
        };
        let older = scan(&self.older())?;
        let current = scan(&self.current())?;
        self.older_first = older.map(|(first, ..)| first);
        if let Some((first, _, len, bytes)) = current {
            self.current_first = first;
            self.current_len = len;
            self.current_bytes = bytes;
        }
        Ok(current.or(older).map(|(_, last, ..)| last))
    }

    /// The first sequence still on disk (`last + 1` when nothing is).
    fn first_available(&self, last: u64) -> u64 {
        match (self.older_first, self.current_len) {
            (Some(f), _) => f,
            (None, 0) => last + 1,
            (None, _) => self.current_first,
        }
    }

    /// The segments that may hold `from..`, opened now (a later roll renames or deletes the names, not what these
    /// descriptors read).
    fn open_from(&self, from: u64) -> std::io::Result<Vec<fs::File>> {
        let mut files = Vec::with_capacity(2);
        let older_needed = self.older_first.is_some() && from < self.current_first;
        let paths = [
            older_needed.then(|| self.older()),
            (self.current_len > 0).then(|| self.current()),
        ];
        for path in paths.into_iter().flatten() {
            match fs::File::open(&path) {
                Ok(f) => files.push(f),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(e),
            }
        }
        Ok(files)
    }
}

/// A `POST /replay` answer being read from the log: [`Replay::write`] streams it as the JSON of a
/// `ReplayResponse` (`{"lastSequence", "evicted"?, "events": [...]}`).
pub struct Replay {
    files: Vec<fs::File>,
    from: u64,
    to: u64,
    evicted: Option<SequenceRange>,
    last_sequence: u64,
}

/// Just the sequence of a logged event (the rest of the line is skipped, not kept).
#[derive(serde::Deserialize)]
struct LoggedSequence {
    #[serde(rename = "sourceSequence")]
    source_sequence: u64,
}

impl Replay {
    /// Writes the answer in chunks of about 64 KiB (`REPLAY_CHUNK`, one event line more at most) to `out`, which
    /// returns `false` when the reader has gone; reads one line at a time.
    pub fn write(self, mut out: impl FnMut(Vec<u8>) -> bool) -> std::io::Result<()> {
        let mut chunk = format!("{{\"lastSequence\":{}", self.last_sequence).into_bytes();
        if let Some(ev) = &self.evicted {
            chunk.extend_from_slice(b",\"evicted\":");
            serde_json::to_writer(&mut chunk, ev).map_err(std::io::Error::other)?;
        }
        chunk.extend_from_slice(b",\"events\":[");
        let mut first = true;
        let mut line = Vec::new();
        'files: for f in self.files {
            let mut reader = std::io::BufReader::new(f);
            loop {
                line.clear();
                // A line without its newline is being written: it is past `to`, whose events were all complete
                // when the files were opened.
                if reader.read_until(b'\n', &mut line)? == 0 || line.last() != Some(&b'\n') {
                    break;
                }
                line.pop();
                let seq = serde_json::from_slice::<LoggedSequence>(&line)
                    .map_err(std::io::Error::other)?
                    .source_sequence;
                if seq > self.to {
                    break 'files;
                }
                if seq < self.from {
                    continue;
                }
                if !first {
                    chunk.push(b',');
                }
                first = false;
                chunk.extend_from_slice(&line);
                if chunk.len() >= REPLAY_CHUNK && !out(std::mem::take(&mut chunk)) {
                    return Ok(());
                }
            }
        }
        chunk.extend_from_slice(b"]}");
        out(chunk);
        Ok(())
    }
}

/// The event pipeline of one sandbox.
pub struct Hub {
    inner: Mutex<Inner>,
    /// Bumped on every change a gateway writer must look at (new event, new gateway).
    changed: watch::Sender<u64>,
    agent_id: String,
    budgets: Budgets,
    /// Age after which a buffered event is dropped while no gateway is connected.
    max_age: Duration,
}

impl Hub {
    /// A hub logging under `dir` (created), with the default budgets.
    #[cfg(test)]
    pub fn new(dir: PathBuf, agent_id: &str) -> std::io::Result<Arc<Self>> {
        Self::with_budgets(dir, agent_id, Budgets::default())
    }

    /// A hub that goes on with the log a previous daemon left under `dir` (live restore): the next event gets the
    /// sequence after the last one logged, and replay serves the logged ones. A line cut short by the crash is
    /// removed first.
    pub fn reopen(dir: PathBuf, agent_id: &str, budgets: Budgets) -> std::io::Result<Arc<Self>> {
        let hub = Self::with_budgets(dir, agent_id, budgets)?;
        {
            let mut inner = hub.lock();
            let last = inner.log.recover()?;
            inner.next_seq = last.map_or(1, |l| l + 1);
        }
        Ok(hub)
    }

    /// A hub logging under `dir` (created); `agent_id` names the agent in sandboxd's own warnings.
    pub fn with_budgets(
        dir: PathBuf,
        agent_id: &str,
        budgets: Budgets,
    ) -> std::io::Result<Arc<Self>> {
        fs::create_dir_all(&dir)?;
        Ok(Arc::new(Self {
            inner: Mutex::new(Inner {
                next_seq: 1,
                queue: VecDeque::new(),
                queued_bytes: 0,
                gateway: None,
                generations: 0,
                dropped: 0,
                last_drop: None,
                last_warning: None,
                run_id: String::new(),
                log: Log {
                    dir,
                    segment_bytes: budgets.replay_bytes / 2,
                    older_first: None,
                    current_first: 1,
                    current_len: 0,
                    current_bytes: 0,
                    file: None,
                },
            }),
            changed: watch::channel(0).0,
            agent_id: agent_id.to_owned(),
            budgets,
            max_age: Duration::from_millis(DISCONNECTED_BUFFER_MS),
        }))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Stamps, logs and queues an event payload; returns its sequence.
    pub fn emit(&self, run_id: &str, event: Map<String, Value>) -> u64 {
        let mut inner = self.lock();
        if inner.run_id != run_id {
            inner.run_id = run_id.to_owned();
        }
        let seq = self.push(&mut inner, run_id, event);
        let now = Instant::now();
        let mut dropped = self.expire(&mut inner, now);
        while inner.queued_bytes > self.budgets.queue_bytes
            || inner.queue.len() > self.budgets.queue_events
        {
            let i = inner.queue.iter().position(|q| q.low).unwrap_or(0);
            Self::remove(&mut inner, i);
            dropped += 1;
        }
        if dropped > 0 {
            Self::note_dropped(&mut inner, dropped, now);
            // With a gateway connected, at most one warning a second, so the warnings cannot flood the queue
            // themselves; without one, the count waits for the next gateway to drain the queue.
            let due = inner
                .last_warning
                .is_none_or(|t| now.duration_since(t) >= Duration::from_secs(1));
            if inner.gateway.is_some() && due {
                self.warn_dropped(&mut inner, now);
            }
        }
        drop(inner);
        self.changed.send_modify(|n| *n += 1);
        seq
    }

    /// Counts `n` events dropped at `now` (told in the next `events_dropped` warning).
    fn note_dropped(inner: &mut Inner, n: u64, now: Instant) {
        inner.dropped += n;
        inner.last_drop = Some(now);
    }

    /// While no gateway is connected, drops the events older than [`Self::max_age`]; how many (not counted yet).
    fn expire(&self, inner: &mut Inner, now: Instant) -> u64 {
        let mut dropped = 0;
        if inner.gateway.is_none() {
            while inner
                .queue
                .front()
                .is_some_and(|q| now.duration_since(q.at) > self.max_age)
            {
                Self::remove(inner, 0);
                dropped += 1;
            }
        }
        dropped
    }

    fn remove(inner: &mut Inner, i: usize) {
        if let Some(q) = inner.queue.remove(i) {
            inner.queued_bytes -= q.cost();
        }
    }

    /// Queues the `events_dropped` warning with the exact count not told yet.
    fn warn_dropped(&self, inner: &mut Inner, now: Instant) {
        let n = std::mem::take(&mut inner.dropped);
        inner.last_warning = Some(now);
        let warning = error_event(
            &self.agent_id,
            "warning",
            &format!(
                "{n} events dropped: the gateway did not keep up or was not connected (low-priority events go first); POST /replay recovers them"
            ),
            true,
            Some("events_dropped"),
            "internal",
        );
        let run_id = inner.run_id.clone();
        self.push(inner, &run_id, warning);
    }

    fn push(&self, inner: &mut Inner, run_id: &str, event: Map<String, Value>) -> u64 {
        let seq = inner.next_seq;
        inner.next_seq += 1;
        let low = is_low_priority(&event);
        let mut ev = AdapterEvent {
            source_event_id: uuid::Uuid::now_v7().to_string(),
            source_sequence: seq,
            source_occurred_at: protocol::now_ts(),
            run_id: run_id.to_owned(),
            event,
        };
        let mut json = match serde_json::to_string(&ev) {
            Ok(s) => s,
            Err(e) => {
                tracing::error!(error = %e, "event not serializable");
                return seq;
            }
        };
        if json.len() as u64 > self.budgets.max_event_bytes {
            // Re-encoding can grow a line (`1e15` becomes `1000000000000000.0`): the budget holds anyway.
            let kind = ev.event.get("type").and_then(Value::as_str).unwrap_or("?");
            ev.event = error_event(
                &self.agent_id,
                "warning",
                &format!(
                    "A {kind:.32} event of {} bytes was dropped: over agents.max_line_bytes",
                    json.len()
                ),
                true,
                Some("control_line_too_long"),
                "internal",
            );
            json = serde_json::to_string(&ev).unwrap_or_default();
        }
        if let Err(e) = inner.log.append(seq, &json) {
            tracing::error!(error = %e, seq, "cannot append to the event log");
        }
        let q = Queued {
            json: json.into(),
            low,
            at: Instant::now(),
        };
        inner.queued_bytes += q.cost();
        inner.queue.push_back(q);
        seq
    }

    /// The last sequence emitted (0 before the first).
    pub fn last_sequence(&self) -> u64 {
        self.lock().next_seq - 1
    }

    /// Events waiting for a gateway.
    pub fn pending(&self) -> usize {
        self.lock().queue.len()
    }

    /// Bytes waiting for a gateway (what counts against `agents.queue_bytes`).
    #[cfg(test)]
    pub fn pending_bytes(&self) -> u64 {
        self.lock().queued_bytes
    }

    /// Whether events were dropped in the last minute.
    pub fn dropping(&self) -> bool {
        self.lock()
            .last_drop
            .is_some_and(|t| t.elapsed() < Duration::from_secs(60))
    }

    /// A gateway connects; the previous one (if any) is told to stop. Returns its generation.
    pub fn attach(&self) -> u64 {
        let mut inner = self.lock();
        // What aged while no gateway was connected and no event came to drop it is dropped now (and counted).
        let now = Instant::now();
        let expired = self.expire(&mut inner, now);
        if expired > 0 {
            Self::note_dropped(&mut inner, expired, now);
        }
        inner.generations += 1;
        let g = inner.generations;
        inner.gateway = Some(g);
        drop(inner);
        self.changed.send_modify(|n| *n += 1);
        g
    }

    /// The sandbox is being removed: the connected gateway (if any) is told to stop.
    pub fn close(&self) {
        self.lock().gateway = None;
        self.changed.send_modify(|n| *n += 1);
    }

    /// The gateway of generation `g` is gone.
    pub fn detach(&self, g: u64) {
        let mut inner = self.lock();
        if inner.gateway == Some(g) {
            inner.gateway = None;
        }
    }

    /// The next event for gateway `g`: `Ok(Some(json))`, `Ok(None)` when none is queued, [`Replaced`] when a
    /// newer gateway replaced `g`. Once the queue is drained, drops not told yet are told (the warning comes next).
    pub fn next(&self, g: u64) -> Result<Option<Arc<str>>, Replaced> {
        let mut inner = self.lock();
        if inner.gateway != Some(g) {
            return Err(Replaced);
        }
        if inner.queue.is_empty() && inner.dropped > 0 {
            self.warn_dropped(&mut inner, Instant::now());
        }
        let q = inner.queue.pop_front();
        if let Some(q) = &q {
            inner.queued_bytes -= q.cost();
        }
        Ok(q.map(|q| q.json))
    }

    /// Waits for a change (new event or new gateway).
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.changed.subscribe()
    }

    /// `POST /replay`: the range's events still in the log, and the evicted part, to be read by
    /// [`Replay::write`] (blocking reads). The range must not be inverted (the route refuses that).
    pub fn replay(&self, range: SequenceRange) -> std::io::Result<Replay> {
        let inner = self.lock();
        let last = inner.next_seq - 1;
        let to = range.to_sequence.min(last);
        let from = range.from_sequence.max(1);
        let mut replay = Replay {
            files: Vec::new(),
            from,
            to,
            evicted: None,
            last_sequence: last,
        };
        if from > to {
            return Ok(replay);
        }
        let first = inner.log.first_available(last);
        replay.evicted = (from < first).then(|| SequenceRange {
            from_sequence: from,
            to_sequence: to.min(first - 1),
        });
        if to >= first {
            replay.files = inner.log.open_from(from.max(first))?;
        }
        Ok(replay)
    }
}

#[cfg(test)]
mod tests {
    use agent_api::{lifecycle_event, ReplayResponse};

    use super::*;

    /// Events `from..=to` as `POST /replay` answers them.
    fn replayed(hub: &Hub, from: u64, to: u64) -> ReplayResponse {
        hub.replay(SequenceRange {
            from_sequence: from,
            to_sequence: to,
        })
        .unwrap()
        .collect()
    }

    impl Replay {
        /// The whole answer, parsed (which also checks that the streamed JSON is a `ReplayResponse`).
        fn collect(self) -> ReplayResponse {
            let mut out = Vec::new();
            self.write(|c| {
                out.extend_from_slice(&c);
                true
            })
            .unwrap();
            serde_json::from_slice(&out).unwrap()
        }
    }

    fn status(i: u64) -> Map<String, Value> {
        let mut m = Map::new();
        m.insert("type".into(), "status".into());
        m.insert("agentId".into(), "a".into());
        m.insert("message".into(), format!("m{i}").into());
        m
    }

    fn drain(hub: &Hub, g: u64) -> Vec<AdapterEvent> {
        let mut out = Vec::new();
        while let Ok(Some(j)) = hub.next(g) {
            out.push(serde_json::from_str(&j).unwrap());
        }
        out
    }

    #[test]
    fn stamps_are_monotonic_uuid_v7_and_replay_returns_exact_ranges() {
        let dir = tempfile::tempdir().unwrap();
        let hub = Hub::new(dir.path().join("ev"), "a").unwrap();
        for i in 0..10 {
            assert_eq!(hub.emit("r1", status(i)), i + 1);
        }
        let g = hub.attach();
        let got = drain(&hub, g);
        assert_eq!(got.len(), 10);
        for (i, e) in got.iter().enumerate() {
            assert_eq!(e.source_sequence, i as u64 + 1);
            let id = uuid::Uuid::parse_str(&e.source_event_id).unwrap();
            assert_eq!(id.get_version_num(), 7);
            assert_eq!(e.run_id, "r1");
        }
        let r = replayed(&hub, 3, 5);
        assert_eq!(r.events, got[2..5].to_vec());
        assert_eq!((r.evicted, r.last_sequence), (None, 10));
        // Past the end: answered up to the last sequence.
        let r = replayed(&hub, 9, 50);
        assert_eq!(r.events.len(), 2);
    }

    #[test]
    fn a_reopened_log_goes_on_with_the_next_sequence_and_replays_across_both_daemons() {
        let dir = tempfile::tempdir().unwrap();
        let ev = dir.path().join("ev");
        let first = Hub::with_budgets(ev.clone(), "a", small()).unwrap();
        // Enough to roll the log once: both segments are taken up again.
        for i in 0..400 {
            first.emit("r1", status(i));
        }
        let last = first.last_sequence();
        drop(first);
        // A crash in the middle of a line: the half line is cut off.
        let mut f = fs::OpenOptions::new()
            .append(true)
            .open(ev.join("current.jsonl"))
            .unwrap();
        f.write_all(b"{\"sourceSequence\":99").unwrap();
        drop(f);
        let hub = Hub::reopen(ev.clone(), "a", small()).unwrap();
        assert_eq!(hub.emit("r2", status(0)), last + 1, "no gap, no repeat");
        let r = replayed(&hub, last - 2, last + 1);
        let seqs: Vec<u64> = r.events.iter().map(|e| e.source_sequence).collect();
        assert_eq!(seqs, vec![last - 2, last - 1, last, last + 1]);
        assert_eq!(r.last_sequence, last + 1);
        // An empty directory starts at 1.
        let fresh = Hub::reopen(dir.path().join("none"), "a", small()).unwrap();
        assert_eq!(fresh.emit("r", status(0)), 1);
    }

    /// Small budgets: 64 KiB of queue (and 1000 events), 64 KiB of log, 16 KiB events.
    fn small() -> Budgets {
        Budgets {
            queue_bytes: 64 << 10,
            queue_events: 1000,
            replay_bytes: 64 << 10,
            max_event_bytes: 16 << 10,
        }
    }

    #[test]
    fn the_log_keeps_the_newest_half_of_its_bytes_and_names_the_evicted_range() {
        let dir = tempfile::tempdir().unwrap();
        let hub = Hub::with_budgets(dir.path().join("ev"), "a", small()).unwrap();
        let g = hub.attach();
        let last = 2000;
        for i in 0..last {
            hub.emit("r", status(i));
            let _ = drain(&hub, g);
        }
        assert!(dir_bytes(&dir.path().join("ev")) <= 64 << 10);
        let r = replayed(&hub, 1, last);
        let first = r.events[0].source_sequence;
        assert_eq!(
            r.evicted,
            Some(SequenceRange {
                from_sequence: 1,
                to_sequence: first - 1
            })
        );
        let kept: usize = r
            .events
            .iter()
            .map(|e| serde_json::to_string(e).unwrap().len() + 1)
            .sum();
        assert!(kept >= 32 << 10, "{kept} bytes kept");
        assert_eq!(r.events.last().unwrap().source_sequence, last);
        let seqs: Vec<u64> = r.events.iter().map(|e| e.source_sequence).collect();
        assert!(seqs.windows(2).all(|w| w[1] == w[0] + 1));
        // A range starting in the current segment reads only that one, and a range wholly gone is all evicted.
        let r = replayed(&hub, last - 1, last);
        assert_eq!((r.events.len(), r.evicted), (2, None));
        let r = replayed(&hub, 1, 2);
        assert!(r.events.is_empty());
        assert_eq!(r.evicted.unwrap().to_sequence, 2);
    }

    #[test]
    fn an_event_over_the_budget_is_replaced_by_a_warning() {
        let dir = tempfile::tempdir().unwrap();
        let hub = Hub::with_budgets(dir.path().join("ev"), "agent-1", small()).unwrap();
        let seq = hub.emit("r", padded(0, 20 << 10));
        let g = hub.attach();
        let got = drain(&hub, g);
        assert_eq!(got.len(), 1);
        assert_eq!(got[0].source_sequence, seq);
        assert_eq!(got[0].event["errorCode"], "control_line_too_long");
        assert_eq!(got[0].event["agentId"], "agent-1");
    }

    #[test]
    fn a_slow_gateway_loses_low_priority_events_first_with_a_warning() {
        let dir = tempfile::tempdir().unwrap();
        let budgets = Budgets {
            replay_bytes: 1 << 20,
            ..small()
        };
        let hub = Hub::with_budgets(dir.path().join("ev"), "a", budgets).unwrap();
        let g = hub.attach();
        hub.emit("r", lifecycle_event("a", "started", None));
        for i in 0..1000 {
            hub.emit("r", status(i));
        }
        assert!(hub.pending_bytes() <= 64 << 10);
        let got = drain(&hub, g);
        assert_eq!(
            got[0].event["type"], "lifecycle",
            "the high-priority event was kept"
        );
        let warnings: Vec<_> = got.iter().filter(|e| e.event["type"] == "error").collect();
        assert!(!warnings.is_empty());
        assert_eq!(warnings[0].event["severity"], "warning");
        assert_eq!(warnings[0].event["errorCode"], "events_dropped");
        // Every event is delivered or counted, and everything is still in the log.
        let counted: u64 = warnings.iter().map(|w| count(w)).sum();
        let last = hub.last_sequence();
        assert_eq!(counted + (got.len() - warnings.len()) as u64, 1001);
        let r = replayed(&hub, 1, last);
        assert_eq!(r.events.len() as u64, last);
    }

    #[test]
    fn without_a_gateway_old_events_leave_the_buffer_but_not_the_log() {
        let dir = tempfile::tempdir().unwrap();
        let mut hub = Hub::new(dir.path().join("ev"), "a").unwrap();
        Arc::get_mut(&mut hub).unwrap().max_age = Duration::from_millis(50);
        for i in 0..10 {
            hub.emit("r", status(i));
        }
        assert_eq!(hub.pending(), 10);
        std::thread::sleep(Duration::from_millis(80));
        hub.emit("r", status(10));
        let g = hub.attach();
        let got = drain(&hub, g);
        // The new event and the warning about the 10 expired ones.
        assert_eq!(got.len(), 2, "{got:?}");
        assert_eq!(got[0].source_sequence, 11);
        assert_eq!(got[1].event["errorCode"], "events_dropped");
        assert!(got[1].event["message"]
            .as_str()
            .unwrap()
            .starts_with("10 events dropped"));
        assert_eq!(replayed(&hub, 1, 10).events.len(), 10);
    }

    #[test]
    fn without_a_gateway_the_queue_keeps_its_budget() {
        let dir = tempfile::tempdir().unwrap();
        let hub = Hub::with_budgets(dir.path().join("ev"), "a", small()).unwrap();
        for i in 0..1500 {
            hub.emit("r", status(i));
        }
        let event = hub.lock().queue.back().unwrap().cost();
        assert!(hub.pending_bytes() <= 64 << 10);
        assert!(hub.pending_bytes() > (64 << 10) - event);
        // A newer gateway replaces an older one.
        let g1 = hub.attach();
        let g2 = hub.attach();
        assert!(hub.next(g1).is_err());
        assert!(hub.next(g2).unwrap().is_some());
        hub.detach(g1);
        assert!(hub.next(g2).is_ok());
    }

    #[test]
    fn without_a_gateway_the_queue_holds_1000_events_and_counts_the_dropped_ones() {
        let dir = tempfile::tempdir().unwrap();
        let hub = Hub::new(dir.path().join("ev"), "a").unwrap();
        hub.emit("r", lifecycle_event("a", "started", None));
        for i in 0..10_000 {
            hub.emit("r", status(i));
        }
        // Small events: far within agents.queue_bytes, the count is the bound.
        assert!(hub.pending_bytes() < 4 << 20);
        assert_eq!(hub.pending(), 1000);
        let g = hub.attach();
        let got = drain(&hub, g);
        assert_eq!(got[0].event["type"], "lifecycle", "low priority goes first");
        // The newest are kept, the oldest dropped; every event is delivered or counted.
        assert_eq!(got[got.len() - 2].source_sequence, 10_001);
        let warning = got.last().unwrap();
        assert_eq!(warning.event["errorCode"], "events_dropped");
        assert_eq!(count(warning) + got.len() as u64 - 1, 10_001);
    }

    #[test]
    fn a_gateway_that_connects_late_gets_no_event_older_than_the_age_limit() {
        let dir = tempfile::tempdir().unwrap();
        let mut hub = Hub::new(dir.path().join("ev"), "a").unwrap();
        Arc::get_mut(&mut hub).unwrap().max_age = Duration::from_millis(50);
        for i in 0..10 {
            hub.emit("r", status(i));
        }
        std::thread::sleep(Duration::from_millis(80));
        // Nothing emitted since: the gateway still gets only the count.
        let g = hub.attach();
        let got = drain(&hub, g);
        assert_eq!(got.len(), 1, "{got:#?}");
        assert_eq!(got[0].event["errorCode"], "events_dropped");
        assert_eq!(count(&got[0]), 10);
    }

    /// The count of an `events_dropped` warning.
    fn count(w: &AdapterEvent) -> u64 {
        let m = w.event["message"].as_str().unwrap();
        m.split(' ').next().unwrap().parse().unwrap()
    }

    fn padded(i: u64, pad: usize) -> Map<String, Value> {
        let mut m = status(i);
        m.insert("message".into(), format!("m{i} {}", "p".repeat(pad)).into());
        m
    }

    fn dir_bytes(dir: &std::path::Path) -> u64 {
        fs::read_dir(dir)
            .unwrap()
            .flatten()
            .map(|e| e.metadata().unwrap().len())
            .sum()
    }

    #[test]
    fn without_a_gateway_the_queue_is_bounded_in_bytes() {
        let dir = tempfile::tempdir().unwrap();
        let hub = Hub::new(dir.path().join("ev"), "a").unwrap();
        for i in 0..300 {
            hub.emit("r", padded(i, 64 << 10));
        }
        // 4 MiB (agents.queue_bytes) of 64 KiB events.
        assert!(
            hub.pending() as u64 * (64 << 10) <= 4 << 20,
            "{} events of 64 KiB queued",
            hub.pending()
        );
    }

    #[test]
    fn the_log_rolls_by_bytes_and_keeps_the_newest_half() {
        let dir = tempfile::tempdir().unwrap();
        let hub = Hub::new(dir.path().join("ev"), "a").unwrap();
        let g = hub.attach();
        for i in 0..800 {
            hub.emit("r", padded(i, 64 << 10));
            let _ = drain(&hub, g);
        }
        // 32 MiB (agents.replay_bytes) on disk at most, the newest 16 MiB always there.
        let on_disk = dir_bytes(&dir.path().join("ev"));
        assert!(on_disk <= 32 << 20, "{on_disk} bytes on disk");
        let r = replayed(&hub, 1, 800);
        assert!(
            r.events.len() as u64 * (64 << 10) >= 16 << 20,
            "{}",
            r.events.len()
        );
        assert_eq!(r.events.last().unwrap().source_sequence, 800);
    }

    #[test]
    fn a_drop_count_is_exact_and_arrives_when_the_queue_drains() {
        let dir = tempfile::tempdir().unwrap();
        let hub = Hub::new(dir.path().join("ev"), "a").unwrap();
        for i in 0..1500 {
            hub.emit("r", padded(i, 4 << 10));
        }
        let g = hub.attach();
        let got = drain(&hub, g);
        let (warnings, events): (Vec<_>, Vec<_>) = got
            .iter()
            .partition(|e| e.event.get("errorCode") == Some(&Value::from("events_dropped")));
        let counted: u64 = warnings.iter().map(|w| count(w)).sum();
        assert_eq!(warnings.len(), 1, "{warnings:?}");
        assert_eq!(counted + events.len() as u64, 1500);
        // Delivered last, after every queued event.
        assert_eq!(got.last().unwrap().event["errorCode"], "events_dropped");
    }
}

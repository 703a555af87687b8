//! A sandbox's event pipeline: stamping (UUID v7 `sourceEventId`, monotonic `sourceSequence`,
//! `sourceOccurredAt`, `runId`), the rolling on-disk log behind `POST /replay`, and the queue a gateway's
//! `WS /events` drains.
//!
//! Every event is logged before it is queued. The queue holds at most [`DISCONNECTED_BUFFER_EVENTS`] events (none
//! older than [`DISCONNECTED_BUFFER_MS`]) while no gateway is connected and [`CONNECTED_QUEUE_EVENTS`] while one is;
//! over the bound, low-priority events go first (else the oldest), and a warning `ErrorEvent` says how many were
//! dropped. Dropped events stay in the log, so a gateway that sees a sequence gap replays them.
//!
//! The log is two segment files of [`SEGMENT`] events each: when the current one is full the older one is deleted
//! and the current one becomes the older, so at least the last [`REPLAY_LOG_EVENTS`] events are always on disk.

use std::collections::VecDeque;
use std::fs;
use std::io::{BufRead, Write};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use protocol::agent::{
    error_event, is_low_priority, AdapterEvent, ReplayResponse, SequenceRange,
    CONNECTED_QUEUE_EVENTS, DISCONNECTED_BUFFER_EVENTS, DISCONNECTED_BUFFER_MS, REPLAY_LOG_EVENTS,
};
use serde_json::{Map, Value};
use tokio::sync::watch;

/// Events per log segment.
pub const SEGMENT: u64 = REPLAY_LOG_EVENTS;

/// One queued event: its JSON, whether it may be dropped first, when it was queued.
struct Queued {
    json: Arc<str>,
    low: bool,
    at: Instant,
}

struct Inner {
    next_seq: u64,
    queue: VecDeque<Queued>,
    /// Generation of the connected gateway; `None` while none is.
    gateway: Option<u64>,
    generations: u64,
    /// Events dropped since the last warning.
    dropped: u64,
    /// When events were last dropped.
    last_drop: Option<Instant>,
    log: Log,
}

struct Log {
    dir: PathBuf,
    /// First sequence of the older segment, if there is one.
    older_first: Option<u64>,
    /// First sequence of the current segment and how many events it holds.
    current_first: u64,
    current_len: u64,
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
        if self.current_len >= SEGMENT {
            self.file = None;
            fs::rename(self.current(), self.older())?;
            self.older_first = Some(self.current_first);
            self.current_first = seq;
            self.current_len = 0;
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
        Ok(())
    }

    /// The first sequence still on disk (`last + 1` when nothing is).
    fn first_available(&self, last: u64) -> u64 {
        match (self.older_first, self.current_len) {
            (Some(f), _) => f,
            (None, 0) => last + 1,
            (None, _) => self.current_first,
        }
    }

    fn read(&self, from: u64, to: u64) -> std::io::Result<Vec<AdapterEvent>> {
        let mut out = Vec::new();
        for path in [self.older(), self.current()] {
            let f = match fs::File::open(&path) {
                Ok(f) => f,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                Err(e) => return Err(e),
            };
            for line in std::io::BufReader::new(f).lines() {
                let line = line?;
                let ev: AdapterEvent =
                    serde_json::from_str(&line).map_err(std::io::Error::other)?;
                if (from..=to).contains(&ev.source_sequence) {
                    out.push(ev);
                }
            }
        }
        Ok(out)
    }
}

/// The event pipeline of one sandbox.
pub struct Hub {
    inner: Mutex<Inner>,
    /// Bumped on every change a gateway writer must look at (new event, new gateway).
    changed: watch::Sender<u64>,
    agent_id: String,
    /// Age after which a buffered event is dropped while no gateway is connected.
    max_age: Duration,
}

impl Hub {
    /// A hub logging under `dir` (created).
    pub fn new(dir: PathBuf, agent_id: &str) -> std::io::Result<Arc<Self>> {
        fs::create_dir_all(&dir)?;
        Ok(Arc::new(Self {
            inner: Mutex::new(Inner {
                next_seq: 1,
                queue: VecDeque::new(),
                gateway: None,
                generations: 0,
                dropped: 0,
                last_drop: None,
                log: Log {
                    dir,
                    older_first: None,
                    current_first: 1,
                    current_len: 0,
                    file: None,
                },
            }),
            changed: watch::channel(0).0,
            agent_id: agent_id.to_owned(),
            max_age: Duration::from_millis(DISCONNECTED_BUFFER_MS),
        }))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Stamps, logs and queues an event payload; returns its sequence.
    pub fn emit(&self, run_id: &str, event: Map<String, Value>) -> u64 {
        let mut inner = self.lock();
        let seq = self.push(&mut inner, run_id, event);
        let now = Instant::now();
        let cap = if inner.gateway.is_some() {
            CONNECTED_QUEUE_EVENTS
        } else {
            DISCONNECTED_BUFFER_EVENTS
        };
        let mut dropped = 0u64;
        if inner.gateway.is_none() {
            let max_age = self.max_age;
            while inner
                .queue
                .front()
                .is_some_and(|q| now.duration_since(q.at) > max_age)
            {
                inner.queue.pop_front();
                dropped += 1;
            }
        }
        while inner.queue.len() > cap {
            match inner.queue.iter().position(|q| q.low) {
                Some(i) => {
                    inner.queue.remove(i);
                }
                None => {
                    inner.queue.pop_front();
                }
            }
            dropped += 1;
        }
        if dropped > 0 {
            inner.dropped += dropped;
            // At most one warning a second, so the warnings cannot flood the queue themselves.
            let due = inner
                .last_drop
                .is_none_or(|t| now.duration_since(t) >= Duration::from_secs(1));
            if due {
                let n = std::mem::take(&mut inner.dropped);
                inner.last_drop = Some(now);
                let warning = error_event(
                    &self.agent_id,
                    "warning",
                    &format!(
                        "{n} events dropped: the gateway did not keep up (low-priority events go first); POST /replay recovers them"
                    ),
                    true,
                    Some("events_dropped"),
                    "internal",
                );
                self.push(&mut inner, run_id, warning);
            }
        }
        drop(inner);
        self.changed.send_modify(|n| *n += 1);
        seq
    }

    fn push(&self, inner: &mut Inner, run_id: &str, event: Map<String, Value>) -> u64 {
        let seq = inner.next_seq;
        inner.next_seq += 1;
        let low = is_low_priority(&event);
        let ev = AdapterEvent {
            source_event_id: uuid::Uuid::now_v7().to_string(),
            source_sequence: seq,
            source_occurred_at: protocol::now_ts(),
            run_id: run_id.to_owned(),
            event,
        };
        let json: Arc<str> = match serde_json::to_string(&ev) {
            Ok(s) => s.into(),
            Err(e) => {
                tracing::error!(error = %e, "event not serializable");
                return seq;
            }
        };
        if let Err(e) = inner.log.append(seq, &json) {
            tracing::error!(error = %e, seq, "cannot append to the event log");
        }
        inner.queue.push_back(Queued {
            json,
            low,
            at: Instant::now(),
        });
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

    /// Whether events were dropped in the last minute.
    pub fn dropping(&self) -> bool {
        self.lock()
            .last_drop
            .is_some_and(|t| t.elapsed() < Duration::from_secs(60))
    }

    /// A gateway connects; the previous one (if any) is told to stop. Returns its generation.
    pub fn attach(&self) -> u64 {
        let mut inner = self.lock();
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

    /// The next event for gateway `g`: `Ok(Some(json))`, `Ok(None)` when none is queued, `Err(())` when a newer
    /// gateway replaced `g`.
    pub fn next(&self, g: u64) -> Result<Option<Arc<str>>, ()> {
        let mut inner = self.lock();
        if inner.gateway != Some(g) {
            return Err(());
        }
        Ok(inner.queue.pop_front().map(|q| q.json))
    }

    /// Waits for a change (new event or new gateway).
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.changed.subscribe()
    }

    /// `POST /replay`: the range's events still in the log, and the evicted part.
    pub fn replay(&self, range: SequenceRange) -> std::io::Result<ReplayResponse> {
        let inner = self.lock();
        let last = inner.next_seq - 1;
        let to = range.to_sequence.min(last);
        let from = range.from_sequence.max(1);
        if from > to {
            return Ok(ReplayResponse {
                events: Vec::new(),
                evicted: None,
                last_sequence: last,
            });
        }
        let first = inner.log.first_available(last);
        let evicted = (from < first).then(|| SequenceRange {
            from_sequence: from,
            to_sequence: to.min(first - 1),
        });
        let events = if to >= first {
            inner.log.read(from.max(first), to)?
        } else {
            Vec::new()
        };
        Ok(ReplayResponse {
            events,
            evicted,
            last_sequence: last,
        })
    }
}

#[cfg(test)]
mod tests {
    use protocol::agent::lifecycle_event;

    use super::*;

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
        let r = hub
            .replay(SequenceRange {
                from_sequence: 3,
                to_sequence: 5,
            })
            .unwrap();
        assert_eq!(r.events, got[2..5].to_vec());
        assert_eq!((r.evicted, r.last_sequence), (None, 10));
        // Past the end: answered up to the last sequence.
        let r = hub
            .replay(SequenceRange {
                from_sequence: 9,
                to_sequence: 50,
            })
            .unwrap();
        assert_eq!(r.events.len(), 2);
    }

    #[test]
    fn the_log_keeps_at_least_the_last_5000_and_names_the_evicted_range() {
        let dir = tempfile::tempdir().unwrap();
        let hub = Hub::new(dir.path().join("ev"), "a").unwrap();
        let g = hub.attach();
        for i in 0..(2 * SEGMENT + 10) {
            hub.emit("r", status(i));
            let _ = drain(&hub, g);
        }
        let last = 2 * SEGMENT + 10;
        let r = hub
            .replay(SequenceRange {
                from_sequence: 1,
                to_sequence: last,
            })
            .unwrap();
        let first = r.events[0].source_sequence;
        assert_eq!(
            r.evicted,
            Some(SequenceRange {
                from_sequence: 1,
                to_sequence: first - 1
            })
        );
        assert!(r.events.len() as u64 >= REPLAY_LOG_EVENTS);
        assert_eq!(r.events.last().unwrap().source_sequence, last);
        let seqs: Vec<u64> = r.events.iter().map(|e| e.source_sequence).collect();
        assert!(seqs.windows(2).all(|w| w[1] == w[0] + 1));
    }

    #[test]
    fn a_slow_gateway_loses_low_priority_events_first_with_a_warning() {
        let dir = tempfile::tempdir().unwrap();
        let hub = Hub::new(dir.path().join("ev"), "a").unwrap();
        let g = hub.attach();
        hub.emit("r", lifecycle_event("a", "started", None));
        for i in 0..(CONNECTED_QUEUE_EVENTS as u64 + 50) {
            hub.emit("r", status(i));
        }
        let got = drain(&hub, g);
        assert!(got.len() <= CONNECTED_QUEUE_EVENTS + 1);
        assert_eq!(
            got[0].event["type"], "lifecycle",
            "the high-priority event was kept"
        );
        let warning = got
            .iter()
            .find(|e| e.event["type"] == "error")
            .expect("a warning ErrorEvent");
        assert_eq!(warning.event["severity"], "warning");
        assert_eq!(warning.event["errorCode"], "events_dropped");
        // Everything is still in the log.
        let last = hub.last_sequence();
        let r = hub
            .replay(SequenceRange {
                from_sequence: 1,
                to_sequence: last,
            })
            .unwrap();
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
        assert_eq!(
            hub.replay(SequenceRange {
                from_sequence: 1,
                to_sequence: 10
            })
            .unwrap()
            .events
            .len(),
            10
        );
    }

    #[test]
    fn without_a_gateway_1000_events_are_buffered() {
        let dir = tempfile::tempdir().unwrap();
        let hub = Hub::new(dir.path().join("ev"), "a").unwrap();
        for i in 0..1500 {
            hub.emit("r", status(i));
        }
        assert!(hub.pending() <= DISCONNECTED_BUFFER_EVENTS + 1);
        assert!(hub.pending() >= DISCONNECTED_BUFFER_EVENTS);
        // A newer gateway replaces an older one.
        let g1 = hub.attach();
        let g2 = hub.attach();
        assert!(hub.next(g1).is_err());
        assert!(hub.next(g2).unwrap().is_some());
        hub.detach(g1);
        assert!(hub.next(g2).is_ok());
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
        let r = hub
            .replay(SequenceRange {
                from_sequence: 1,
                to_sequence: 800,
            })
            .unwrap();
        assert!(r.events.len() as u64 * (64 << 10) >= 16 << 20, "{}", r.events.len());
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
        let counted: u64 = warnings
            .iter()
            .map(|w| {
                let m = w.event["message"].as_str().unwrap();
                m.split(' ').next().unwrap().parse::<u64>().unwrap()
            })
            .sum();
        assert_eq!(warnings.len(), 1, "{warnings:?}");
        assert_eq!(counted + events.len() as u64, 1500);
        // Delivered last, after every queued event.
        assert_eq!(got.last().unwrap().event["errorCode"], "events_dropped");
    }
}

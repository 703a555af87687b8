//! The suite's own reading of server messages. Everything is judged on the raw JSON against the spec's words,
//! written out here, rather than through a lenient deserializer: a field the spec requires must really be there.

use std::time::Instant;

use base64::engine::general_purpose::STANDARD;
use base64::Engine;
use serde_json::Value;

/// The message types a server sends (spec section 4).
pub const SERVER_TYPES: &[&str] = &[
    "ack", "status", "stdout", "stderr", "result", "error", "pong",
];
/// Every `status` value (spec section 4).
pub const STATUSES: &[&str] = &[
    "running",
    "completed",
    "failed",
    "timeout",
    "oom",
    "cancelled",
];
/// Every `result.reason` (spec section 4).
pub const REASONS: &[&str] = &[
    "exited",
    "signaled",
    "timeout",
    "oom",
    "output_limit",
    "cancelled",
];
/// The languages FSP/1 names (spec section 3).
pub const LANGUAGES: &[&str] = &["python", "javascript", "shell", "elixir"];
/// The six limits, in the spec's order (spec section 3).
pub const LIMIT_NAMES: &[&str] = &[
    "timeout_ms",
    "memory_mb",
    "cpu_shares",
    "max_output_bytes",
    "pids_max",
    "disk_mb",
];

/// The spec's error table (section 4): each code and whether it is retryable. Written out here, not taken from
/// the protocol crate, so that a wrong table there cannot make a wrong server pass.
pub const ERROR_TABLE: &[(&str, bool)] = &[
    ("INVALID_REQUEST", false),
    ("LANGUAGE_NOT_SUPPORTED", false),
    ("UNKNOWN_EXECUTION", false),
    ("TIMEOUT", false),
    ("OOM", false),
    ("OUTPUT_LIMIT", false),
    ("SANDBOX_OVERLOADED", true),
    ("INTERNAL_ERROR", true),
    ("NETWORK_ERROR", true),
];

/// Whether `code` is retryable per the spec's table; `None` for a code the spec does not define.
pub fn spec_retryable(code: &str) -> Option<bool> {
    ERROR_TABLE
        .iter()
        .find(|(c, _)| *c == code)
        .map(|(_, r)| *r)
}

/// Checks `ts`: UTC ISO 8601 with milliseconds, e.g. `2025-12-27T11:30:00.000Z` (`+00:00` is accepted for `Z`).
pub fn check_ts(ts: &str) -> Result<(), String> {
    let bad = || Err(format!("ts {ts:?} is not UTC ISO 8601 with milliseconds"));
    let (body, _) = if let Some(b) = ts.strip_suffix('Z') {
        (b, ())
    } else if let Some(b) = ts.strip_suffix("+00:00") {
        (b, ())
    } else {
        return bad();
    };
    let b = body.as_bytes();
    if b.len() != 23 {
        return bad();
    }
    let digits = |r: std::ops::Range<usize>| b[r].iter().all(u8::is_ascii_digit);
    let shape = digits(0..4)
        && b[4] == b'-'
        && digits(5..7)
        && b[7] == b'-'
        && digits(8..10)
        && b[10] == b'T'
        && digits(11..13)
        && b[13] == b':'
        && digits(14..16)
        && b[16] == b':'
        && digits(17..19)
        && b[19] == b'.'
        && digits(20..23);
    if !shape {
        return bad();
    }
    let num = |r: std::ops::Range<usize>| body[r].parse::<u32>().unwrap_or(99);
    let (mo, d, h, mi, s) = (num(5..7), num(8..10), num(11..13), num(14..16), num(17..19));
    if !(1..=12).contains(&mo) || !(1..=31).contains(&d) || h > 23 || mi > 59 || s > 60 {
        return bad();
    }
    Ok(())
}

/// Checks the envelope of a server message (spec section 2): a JSON object with `"v": 1`, a `type` the spec
/// defines, and a `ts` in the spec's form.
pub fn check_envelope(raw: &Value) -> Result<(), String> {
    let Some(obj) = raw.as_object() else {
        return Err(format!("not a JSON object: {raw}"));
    };
    match obj.get("v") {
        Some(v) if v.as_u64() == Some(1) => {}
        other => return Err(format!("\"v\" is {other:?}, not 1: {}", short(raw))),
    }
    match obj.get("type").and_then(Value::as_str) {
        Some(t) if SERVER_TYPES.contains(&t) => {}
        other => {
            return Err(format!(
                "\"type\" {other:?} is not one of {SERVER_TYPES:?}: {}",
                short(raw)
            ))
        }
    }
    match obj.get("ts").and_then(Value::as_str) {
        Some(ts) => check_ts(ts).map_err(|e| format!("{e}: {}", short(raw))),
        None => Err(format!("no string \"ts\": {}", short(raw))),
    }
}

/// A JSON value shortened for messages.
pub fn short(v: &Value) -> String {
    let mut s = v.to_string();
    if s.len() > 400 {
        let mut cut = 400;
        while !s.is_char_boundary(cut) {
            cut -= 1;
        }
        s.truncate(cut);
        s.push_str("...");
    }
    s
}

/// One server message as received.
#[derive(Debug, Clone)]
pub struct Msg {
    /// The JSON object.
    pub raw: Value,
    /// When it arrived.
    pub at: Instant,
}

impl Msg {
    /// `type`, or `""`.
    pub fn kind(&self) -> &str {
        self.raw["type"].as_str().unwrap_or("")
    }

    /// `id`, when it is a string.
    pub fn id(&self) -> Option<&str> {
        self.raw.get("id").and_then(Value::as_str)
    }

    /// Whether the message is about execution `id`.
    pub fn is_for(&self, id: &str) -> bool {
        self.id() == Some(id)
    }

    /// `status` of a status message.
    pub fn status(&self) -> Option<&str> {
        if self.kind() == "status" {
            self.raw["status"].as_str()
        } else {
            None
        }
    }

    /// `code` of an error.
    pub fn code(&self) -> Option<&str> {
        if self.kind() == "error" {
            self.raw["code"].as_str()
        } else {
            None
        }
    }

    /// Whether this ends execution `id`: its `result`, or an `error` echoing `id`.
    pub fn ends(&self, id: &str) -> bool {
        self.is_for(id) && matches!(self.kind(), "result" | "error")
    }

    /// A short label: `ack`, `status:running`, `error:INVALID_REQUEST`, `stdout`.
    pub fn label(&self) -> String {
        match self.kind() {
            "status" => format!("status:{}", self.status().unwrap_or("?")),
            "error" => format!("error:{}", self.code().unwrap_or("?")),
            k => k.to_owned(),
        }
    }

    /// The bytes a `stdout`/`stderr` message carries (base64 decoded when `encoding` is `base64`).
    pub fn output_bytes(&self) -> Result<Vec<u8>, String> {
        let data = self.raw["data"]
            .as_str()
            .ok_or_else(|| format!("output without a string \"data\": {}", short(&self.raw)))?;
        match self.raw.get("encoding") {
            None | Some(Value::Null) => Ok(data.as_bytes().to_vec()),
            Some(Value::String(e)) if e == "utf8" => Ok(data.as_bytes().to_vec()),
            Some(Value::String(e)) if e == "base64" => STANDARD
                .decode(data)
                .map_err(|e| format!("base64 output does not decode ({e}): {}", short(&self.raw))),
            Some(other) => Err(format!("unknown output encoding {other}")),
        }
    }

    /// Whether the output chunk is base64-encoded.
    pub fn is_base64(&self) -> bool {
        self.raw["encoding"] == "base64"
    }
}

/// Checks an `error` message: `code` as expected, `retryable` a boolean equal to the spec's table, a non-empty
/// `message`, and `id` echoed (or absent when `id` is `None`).
pub fn check_error(raw: &Value, code: &str, id: Option<&str>) -> Result<(), String> {
    if raw["type"] != "error" {
        return Err(format!("expected an error {code}, got {}", short(raw)));
    }
    if raw["code"] != code {
        return Err(format!(
            "expected error code {code}, got {}: {}",
            raw["code"],
            short(raw)
        ));
    }
    check_error_fields(raw)?;
    match (id, raw.get("id")) {
        (Some(want), Some(Value::String(got))) if got == want => Ok(()),
        (Some(want), _) => Err(format!(
            "the error does not echo the request's id {want:?}: {}",
            short(raw)
        )),
        (None, None) => Ok(()),
        (None, Some(_)) => Err(format!(
            "an error about a frame with no usable id must have none: {}",
            short(raw)
        )),
    }
}

/// Checks the fields every `error` has: a `code` from the spec's table, `retryable` as that table says, and a
/// non-empty string `message`.
pub fn check_error_fields(raw: &Value) -> Result<(), String> {
    let code = raw["code"]
        .as_str()
        .ok_or_else(|| format!("error without a string code: {}", short(raw)))?;
    let Some(want) = spec_retryable(code) else {
        return Err(format!(
            "error code {code:?} is not in the spec's table: {}",
            short(raw)
        ));
    };
    match raw.get("retryable") {
        Some(Value::Bool(r)) if *r == want => {}
        other => {
            return Err(format!(
                "{code} must carry \"retryable\": {want} (spec section 4 table), got {other:?}: {}",
                short(raw)
            ))
        }
    }
    match raw["message"].as_str() {
        Some(m) if !m.is_empty() => Ok(()),
        _ => Err(format!("error without a message: {}", short(raw))),
    }
}

/// Everything one execution produced, in arrival order.
#[derive(Debug, Clone)]
pub struct Exec {
    /// The execution id.
    pub id: String,
    /// Its messages.
    pub msgs: Vec<Msg>,
    /// When its `execute` was sent.
    pub sent: Instant,
}

impl Exec {
    /// An empty collection for `id`.
    pub fn new(id: &str, sent: Instant) -> Exec {
        Exec {
            id: id.to_owned(),
            msgs: Vec::new(),
            sent,
        }
    }

    /// Whether the terminal message arrived.
    pub fn done(&self) -> bool {
        self.msgs.last().is_some_and(|m| m.ends(&self.id))
    }

    /// Labels of the messages, runs of the same output stream folded (`stdout*`).
    pub fn labels(&self) -> Vec<String> {
        let mut out: Vec<String> = Vec::new();
        for m in &self.msgs {
            let l = m.label();
            if matches!(l.as_str(), "stdout" | "stderr") {
                let folded = format!("{l}*");
                if out.last() == Some(&folded) {
                    continue;
                }
                out.push(folded);
            } else {
                out.push(l);
            }
        }
        out
    }

    /// Every `status` value in order.
    pub fn statuses(&self) -> Vec<String> {
        self.msgs
            .iter()
            .filter_map(|m| m.status().map(str::to_owned))
            .collect()
    }

    /// The terminal status (not `running`), if one arrived.
    pub fn terminal_status(&self) -> Option<String> {
        self.statuses().into_iter().find(|s| s != "running")
    }

    /// The `result` JSON.
    pub fn result(&self) -> Option<&Value> {
        self.msgs
            .iter()
            .find(|m| m.kind() == "result")
            .map(|m| &m.raw)
    }

    /// The `error` JSON.
    pub fn error(&self) -> Option<&Value> {
        self.msgs
            .iter()
            .find(|m| m.kind() == "error")
            .map(|m| &m.raw)
    }

    /// The `ack` JSON.
    pub fn ack(&self) -> Option<&Value> {
        self.msgs.iter().find(|m| m.kind() == "ack").map(|m| &m.raw)
    }

    /// The decoded bytes of one stream (`stdout` or `stderr`).
    pub fn output(&self, stream: &str) -> Result<Vec<u8>, String> {
        let mut out = Vec::new();
        for m in self.msgs.iter().filter(|m| m.kind() == stream) {
            out.extend(m.output_bytes()?);
        }
        Ok(out)
    }

    /// Stdout, decoded.
    pub fn stdout(&self) -> Result<Vec<u8>, String> {
        self.output("stdout")
    }

    /// Stderr, decoded.
    pub fn stderr(&self) -> Result<Vec<u8>, String> {
        self.output("stderr")
    }

    /// Stdout as text (lossy), or the decoding error.
    pub fn stdout_text(&self) -> String {
        match self.stdout() {
            Ok(b) => String::from_utf8_lossy(&b).into_owned(),
            Err(e) => format!("<{e}>"),
        }
    }

    /// The chunks of one stream.
    pub fn chunks(&self, stream: &str) -> Vec<&Msg> {
        self.msgs.iter().filter(|m| m.kind() == stream).collect()
    }

    /// The result's `exit_code` as sent (`Some(Value::Null)` for null, `None` when absent).
    pub fn exit_code(&self) -> Option<&Value> {
        self.result().and_then(|r| r.get("exit_code"))
    }

    /// The result's `reason`.
    pub fn reason(&self) -> Option<&str> {
        self.result().and_then(|r| r["reason"].as_str())
    }

    /// A description for failure messages.
    pub fn dump(&self) -> String {
        let mut s = format!("execution {:?}: {:?}", self.id, self.labels());
        if let Some(r) = self.result() {
            s.push_str(&format!("; result {}", short(r)));
        }
        if let Some(e) = self.error() {
            s.push_str(&format!("; error {}", short(e)));
        }
        let shorten = |b: Result<Vec<u8>, String>| match b {
            Ok(b) => {
                let t = String::from_utf8_lossy(&b).into_owned();
                if t.len() > 300 {
                    format!(
                        "{:?}... ({} bytes)",
                        t.chars().take(300).collect::<String>(),
                        b.len()
                    )
                } else {
                    format!("{t:?}")
                }
            }
            Err(e) => e,
        };
        s.push_str(&format!(
            "; stdout {}; stderr {}",
            shorten(self.stdout()),
            shorten(self.stderr())
        ));
        s
    }

    /// Checks the order of spec sections 4 and 5: every message carries the id; exactly one terminal message,
    /// last. Ending in `error`: either the error alone (refused), or after the `ack` with no terminal status.
    /// Ending in `result`: `ack` first and once; `status:running` at most once, right after the ack (it may be
    /// missing only when the execution was cancelled before it started); output only while running; exactly one
    /// terminal status, right before the result.
    pub fn check_sequence(&self) -> Result<(), String> {
        let labels: Vec<String> = self.msgs.iter().map(Msg::label).collect();
        let fail = |why: &str| Err(format!("{why} (spec sections 4, 5): {}", self.dump()));
        if self.msgs.is_empty() {
            return fail("no messages");
        }
        if self.msgs.iter().any(|m| !m.is_for(&self.id)) {
            return fail("a message without the execution's id");
        }
        let ends: Vec<usize> = (0..self.msgs.len())
            .filter(|&i| self.msgs[i].ends(&self.id))
            .collect();
        if ends != [self.msgs.len() - 1] {
            return fail("exactly one terminal message (result or error), and it is the last");
        }
        // A tool_call (extension tool_calls) only comes while the program runs, like its output.
        let is_output = |l: &str| l == "stdout" || l == "stderr" || l == "tool_call";
        let running: Vec<usize> = (0..labels.len())
            .filter(|&i| labels[i] == "status:running")
            .collect();
        let terminal: Vec<usize> = (0..labels.len())
            .filter(|&i| labels[i].starts_with("status:") && labels[i] != "status:running")
            .collect();
        let last = self.msgs.len() - 1;
        if self.msgs[last].kind() == "error" {
            if last == 0 {
                return Ok(());
            }
            if labels[0] != "ack" {
                return fail("an error after other messages must follow an ack");
            }
            if !terminal.is_empty() {
                return fail("an execution that ends with an error has no terminal status");
            }
            if running.len() > 1 {
                return fail("status:running at most once");
            }
            for (i, l) in labels.iter().enumerate() {
                if is_output(l) && (running.is_empty() || i < running[0]) {
                    return fail("output only after status:running");
                }
            }
            return Ok(());
        }
        if labels[0] != "ack" {
            return fail("ack first");
        }
        if labels.iter().filter(|l| *l == "ack").count() != 1 {
            return fail("ack exactly once");
        }
        if running.len() > 1 {
            return fail("status:running exactly once");
        }
        if terminal.len() != 1 {
            return fail("exactly one terminal status");
        }
        if terminal[0] != last - 1 {
            return fail("the result right after the terminal status");
        }
        match running.first() {
            Some(&r) if r != 1 => return fail("status:running right after the ack"),
            Some(_) => {}
            None if labels[terminal[0]] == "status:cancelled" && terminal[0] == 1 => {}
            None => return fail("status:running before the terminal status"),
        }
        for (i, l) in labels.iter().enumerate() {
            if is_output(l) && (running.is_empty() || i < running[0] || i > terminal[0]) {
                return fail("output only between status:running and the terminal status");
            }
        }
        Ok(())
    }

    /// Checks the fields of the `result` (spec section 4): `exit_code` present (integer or null), `duration_ms` a
    /// non-negative integer, `resource_usage` with integer `peak_memory_mb` and `cpu_time_ms`; and the sandboxd
    /// additions, when present: `reason` one of the spec's, `stdout_bytes`/`stderr_bytes` equal to the bytes
    /// delivered, `truncated` a boolean.
    pub fn check_result_fields(&self) -> Result<(), String> {
        let Some(r) = self.result() else {
            return Err(format!("no result: {}", self.dump()));
        };
        match r.get("exit_code") {
            Some(Value::Null) => {}
            Some(v) if v.as_i64().is_some() => {}
            other => {
                return Err(format!(
                    "result.exit_code must be present, an integer or null; got {other:?}: {}",
                    short(r)
                ))
            }
        }
        if r["duration_ms"].as_u64().is_none() {
            return Err(format!(
                "result.duration_ms must be a non-negative integer: {}",
                short(r)
            ));
        }
        for f in ["peak_memory_mb", "cpu_time_ms"] {
            if r["resource_usage"][f].as_u64().is_none() {
                return Err(format!(
                    "result.resource_usage.{f} must be a non-negative integer: {}",
                    short(r)
                ));
            }
        }
        if let Some(reason) = r.get("reason") {
            if !reason.as_str().is_some_and(|s| REASONS.contains(&s)) {
                return Err(format!("result.reason {reason} is not one of {REASONS:?}"));
            }
        }
        for (field, stream) in [("stdout_bytes", "stdout"), ("stderr_bytes", "stderr")] {
            if let Some(v) = r.get(field) {
                let got = self.output(stream)?.len() as u64;
                if v.as_u64() != Some(got) {
                    return Err(format!(
                        "result.{field} is {v} but {got} bytes of {stream} were delivered: {}",
                        short(r)
                    ));
                }
            }
        }
        if let Some(t) = r.get("truncated") {
            if !t.is_boolean() {
                return Err(format!("result.truncated must be a boolean: {}", short(r)));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn exec(msgs: &[Value]) -> Exec {
        let now = Instant::now();
        Exec {
            id: "a".into(),
            msgs: msgs
                .iter()
                .map(|raw| Msg {
                    raw: raw.clone(),
                    at: now,
                })
                .collect(),
            sent: now,
        }
    }

    #[test]
    fn timestamps() {
        assert!(check_ts("2025-12-27T11:30:00.000Z").is_ok());
        assert!(check_ts("2025-12-27T11:30:00.000+00:00").is_ok());
        for bad in [
            "...",
            "2025-12-27T11:30:00Z",
            "2025-12-27T11:30:00.0000Z",
            "2025-13-27T11:30:00.000Z",
            "2025-12-27 11:30:00.000Z",
            "2025-12-27T11:30:00.000+02:00",
        ] {
            assert!(check_ts(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn sequences() {
        let ack = json!({"type": "ack", "id": "a"});
        let run = json!({"type": "status", "id": "a", "status": "running"});
        let out = json!({"type": "stdout", "id": "a", "data": "x"});
        let done = json!({"type": "status", "id": "a", "status": "completed"});
        let cancelled = json!({"type": "status", "id": "a", "status": "cancelled"});
        let res = json!({"type": "result", "id": "a", "exit_code": 0});
        let err = json!({"type": "error", "id": "a", "code": "INVALID_REQUEST"});
        assert!(exec(&[
            ack.clone(),
            run.clone(),
            out.clone(),
            done.clone(),
            res.clone()
        ])
        .check_sequence()
        .is_ok());
        assert!(exec(std::slice::from_ref(&err)).check_sequence().is_ok());
        assert!(exec(&[ack.clone(), cancelled.clone(), res.clone()])
            .check_sequence()
            .is_ok());
        assert!(exec(&[ack.clone(), run.clone(), out.clone(), err.clone()])
            .check_sequence()
            .is_ok());
        // Result before the terminal status, no ack, output after the end, two terminal statuses.
        assert!(exec(&[ack.clone(), run.clone(), res.clone(), done.clone()])
            .check_sequence()
            .is_err());
        assert!(exec(&[run.clone(), done.clone(), res.clone()])
            .check_sequence()
            .is_err());
        assert!(exec(&[
            ack.clone(),
            run.clone(),
            done.clone(),
            out.clone(),
            res.clone()
        ])
        .check_sequence()
        .is_err());
        assert!(exec(&[
            ack.clone(),
            run.clone(),
            done.clone(),
            cancelled,
            res.clone()
        ])
        .check_sequence()
        .is_err());
        assert!(exec(&[ack.clone(), done, res]).check_sequence().is_err());
    }

    #[test]
    fn errors_are_judged_by_the_spec_table() {
        let e = json!({"type": "error", "id": "x", "code": "SANDBOX_OVERLOADED", "message": "full", "retryable": true});
        assert!(check_error(&e, "SANDBOX_OVERLOADED", Some("x")).is_ok());
        assert!(check_error(&e, "SANDBOX_OVERLOADED", None).is_err());
        let e = json!({"type": "error", "code": "UNKNOWN_EXECUTION", "message": "no", "retryable": true});
        assert!(check_error(&e, "UNKNOWN_EXECUTION", None).is_err());
        assert_eq!(ERROR_TABLE.len(), 9);
    }
}

//! The request lines code in a sandbox writes to the tool socket (`tool_calls` extension), split and parsed as
//! sandboxd/src/tools.rs does: lines as tokio's `LinesCodec` yields them (split at `\n`, a trailing `\r` dropped,
//! UTF-8), each parsed with `serde_json::from_str` into the broker's request type. That type is private to the
//! sandboxd binary crate, so [`Request`] below is a copy of it (keep the two equal); what the broker then builds
//! from a call is the protocol's `tool_call`, which is fuzzed as is.
//!
//! Properties: never panics; a call the broker would forward (its arguments an object, as `Shared::call`
//! requires) becomes a `tool_call` frame that parses back to the same message.
#![no_main]

use libfuzzer_sys::fuzz_target;
use protocol::{encode_with_ts, parse_server_message, ServerMessage, ToolCall};
use serde::Deserialize;
use serde_json::Value;

/// A request line from the sandbox: a copy of `Request` in sandboxd/src/tools.rs.
#[derive(Deserialize)]
#[serde(tag = "op", rename_all = "lowercase", deny_unknown_fields)]
#[allow(
    dead_code,
    reason = "a copy of the daemon's type: every field is parsed, not all are read here"
)]
enum Request {
    Call {
        name: String,
        #[serde(default)]
        args: Option<Value>,
        #[serde(default)]
        timeout_ms: Option<u64>,
    },
    Return {
        #[serde(default)]
        value: Value,
    },
}

fn handle(line: &str) {
    let Ok(request) = serde_json::from_str::<Request>(line) else {
        return;
    };
    let Request::Call {
        name,
        args,
        timeout_ms,
    } = request
    else {
        return;
    };
    let args = args.unwrap_or_else(|| serde_json::json!({}));
    if !args.is_object() {
        return;
    }
    let per_call = 30_000;
    let timeout_ms = timeout_ms
        .filter(|t| *t > 0)
        .map_or(per_call, |t: u64| t.min(per_call));
    let sent = ServerMessage::ToolCall(ToolCall {
        id: "exec_1".to_owned(),
        call_id: "c1".to_owned(),
        name,
        args,
        timeout_ms: Some(timeout_ms),
    });
    let frame = encode_with_ts(&sent, "2025-12-27T11:30:00.000Z");
    match parse_server_message(&frame) {
        Ok(back) => assert_eq!(back, sent, "{frame}"),
        Err(e) => panic!("tool_call frame does not parse back: {e}\n{frame}"),
    }
}

fuzz_target!(|data: &[u8]| {
    for line in data.split(|b| *b == b'\n') {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        // LinesCodec refuses a line that is not UTF-8 (and the broker then ends the connection).
        let Ok(line) = std::str::from_utf8(line) else {
            return;
        };
        handle(line);
    }
});

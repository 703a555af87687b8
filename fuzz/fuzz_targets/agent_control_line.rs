//! The control channel an agent writes to sandboxd, split and parsed as agents/src/sandbox/control.rs does
//! (`read_lines`: split at `\n`, trailing `\n`/`\r` dropped, empty lines skipped; `handle_line`:
//! `agent_api::parse_agent_line`, then the `type` and `decisionId` of an event are read). An accepted event
//! is stamped into an `AdapterEvent` and journaled as agents/src/events.rs does (one
//! `serde_json::to_string` line, read back with `serde_json::from_str`).
//!
//! Properties: never panics; an accepted event passes `validate_event`, and its journal line reads back to the
//! same `AdapterEvent`.
#![no_main]

use libfuzzer_sys::fuzz_target;
use agent_api::{is_low_priority, parse_agent_line, validate_event, AdapterEvent, AgentLine};
use serde_json::Value;

fn handle(line: &[u8], seq: u64) {
    let Ok(parsed) = parse_agent_line(line) else {
        return;
    };
    let event = match parsed {
        AgentLine::State {
            checkpoint,
            conversation_summary,
        } => {
            let _ = (checkpoint, conversation_summary);
            return;
        }
        AgentLine::Event(event) => event,
    };
    if let Err(e) = validate_event(&event) {
        panic!("accepted event fails validate_event: {e}");
    }
    let kind = event
        .get("type")
        .and_then(Value::as_str)
        .unwrap_or_default();
    if kind == "decision" {
        let _ = event.get("decisionId").and_then(Value::as_str);
    }
    let _ = is_low_priority(&event);
    let ev = AdapterEvent {
        source_event_id: "0190a0a0-0000-7000-8000-000000000000".to_owned(),
        source_sequence: seq,
        source_occurred_at: "2025-12-27T11:30:00.000Z".to_owned(),
        run_id: "run_1".to_owned(),
        event,
    };
    let journal = match serde_json::to_string(&ev) {
        Ok(j) => j,
        Err(e) => panic!("event does not serialise: {e}"),
    };
    assert!(
        !journal.contains('\n'),
        "journal line with a newline: {journal}"
    );
    match serde_json::from_str::<AdapterEvent>(&journal) {
        Ok(back) => assert_eq!(back, ev, "{journal}"),
        Err(e) => panic!("journal line does not read back: {e}\n{journal}"),
    }
}

fuzz_target!(|data: &[u8]| {
    let mut seq = 0;
    for line in data.split(|b| *b == b'\n') {
        let mut line = line;
        while let Some(rest) = line.strip_suffix(b"\r") {
            line = rest;
        }
        if line.is_empty() {
            continue;
        }
        seq += 1;
        handle(line, seq);
    }
});

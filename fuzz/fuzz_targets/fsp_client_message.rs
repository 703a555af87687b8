//! FSP/1 client frames, parsed as the server parses them: `protocol::parse_client_message` on the text of a
//! WebSocket frame (sandboxd/src/fsp/connection.rs; a text frame is UTF-8, so the input is fuzzed as `&str`).
//!
//! Properties: the parser never panics; a refusal becomes an `error` frame that parses back as that error; an
//! accepted message serialises to a frame that parses back to the same message, and an accepted `execute` passes
//! `ExecuteRequest::validate` (the check a client may run before sending) and resolves its limits.
#![no_main]

use libfuzzer_sys::fuzz_target;
use protocol::{
    encode_with_ts, parse_client_message, parse_server_message, ClientMessage, CpuCores, Limits,
    ServerMessage,
};

/// Maximums no request exceeds, so resolving only refuses zeros.
const NO_MAX: Limits = Limits {
    timeout_ms: u64::MAX,
    memory_mb: u64::MAX,
    cpu_shares: u64::MAX,
    max_output_bytes: u64::MAX,
    pids_max: u64::MAX,
    disk_mb: u64::MAX,
    cpu_cores: Some(CpuCores::from_const(f64::MAX)),
};

fuzz_target!(|text: &str| {
    let message = match parse_client_message(text) {
        Ok(m) => m,
        Err(e) => {
            let sent = ServerMessage::from(e);
            let frame = encode_with_ts(&sent, "2025-12-27T11:30:00.000Z");
            match parse_server_message(&frame) {
                Ok(back) => assert_eq!(back, sent, "error frame {frame}"),
                Err(e) => panic!("error frame does not parse back: {e}\nframe: {frame}"),
            }
            return;
        }
    };
    if let ClientMessage::Execute(req) = &message {
        if let Err(e) = req.validate() {
            panic!("accepted execute fails its own validation: {e:?}");
        }
        let _ = req.resolve_limits(&NO_MAX);
        let _ = req.resolve_tool_timeout(600_000);
    }
    let frame = match serde_json::to_string(&message) {
        Ok(f) => f,
        Err(e) => panic!("accepted message does not serialise: {e}"),
    };
    match parse_client_message(&frame) {
        Ok(again) => assert_eq!(again, message, "re-parse of {frame}"),
        Err(e) => panic!("re-serialised message refused: {e:?}\nframe: {frame}"),
    }
});

//! The request lines code in a sandbox writes to the tool socket (`tool_calls` extension), split and parsed as
//! sandboxd/src/extensions/tools.rs does: lines are bytes split at `\n` (any bytes: a line that is not UTF-8 gets an
//! `invalid` reply), each parsed by `protocol::parse_tool_request`, the daemon's own parser; what the broker then
//! builds from a call is the protocol's `tool_call` with the arguments kept as JSON text.
//!
//! Properties: never panics; a call becomes a `tool_call` frame that parses back to the same name, timeout and
//! arguments (as a JSON value equal to the one in the line).
#![no_main]

use libfuzzer_sys::fuzz_target;
use protocol::{
    encode_with_ts, parse_server_message, parse_tool_request, ServerMessage, ToolCall, ToolRequest,
};
use serde_json::Value;

fn handle(line: &[u8]) {
    let Ok(ToolRequest::Call {
        name,
        args,
        timeout_ms,
    }) = parse_tool_request(line)
    else {
        return;
    };
    let per_call = 30_000;
    let timeout_ms = timeout_ms
        .filter(|t| *t > 0)
        .map_or(per_call, |t: u64| t.min(per_call));
    let want: Value = serde_json::from_str(args.get()).expect("raw arguments are JSON");
    assert!(
        want.is_object(),
        "arguments {} are not an object",
        args.get()
    );
    let sent = ServerMessage::ToolCall(ToolCall::raw(
        "exec_1".to_owned(),
        "c1".to_owned(),
        name.clone(),
        args,
        Some(timeout_ms),
    ));
    let frame = encode_with_ts(&sent, "2025-12-27T11:30:00.000Z");
    match parse_server_message(&frame) {
        Ok(ServerMessage::ToolCall(back)) => {
            assert_eq!(
                (back.name.as_str(), back.timeout_ms, &back.args),
                (name.as_str(), Some(timeout_ms), &want),
                "{frame}"
            );
        }
        Ok(other) => panic!("tool_call frame parses back as {other:?}\n{frame}"),
        Err(e) => panic!("tool_call frame does not parse back: {e}\n{frame}"),
    }
}

fuzz_target!(|data: &[u8]| {
    for line in data.split(|b| *b == b'\n') {
        handle(line);
    }
});

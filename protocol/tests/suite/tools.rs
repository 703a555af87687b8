//! The `tool_calls` extension (`docs/spec/tool-calls.md`): its examples, copied literally, parse and encode as the
//! profile says; every refusal names its field.

use protocol::{
    encode_with_ts, parse_client_message, parse_server_envelope, ClientMessage, ErrorCode,
    ExecuteRequest, Language, RequestedLimits, ServerMessage, ToolCall, ToolResult, ToolSpec,
    SANDBOXD_EXTENSIONS,
};
use serde_json::{json, Value};

use super::{invalid, refused};

/// `tool-calls.md`, the `execute` example.
const DOC_EXECUTE: &str = r#"{"v":1,"type":"execute","id":"exec_t1","ts":"...","language":"python",
 "code":"text = read_file('notes.txt')\nlen(text)",
 "limits":{"timeout_ms":30000,"memory_mb":256},
 "tools":[{"name":"read_file","description":"Read a file of the project",
           "schema":{"type":"object","properties":{"path":{"type":"string"}},"required":["path"]}}],
 "tool_timeout_ms":10000}"#;

/// `tool-calls.md`, the `tool_call` example.
const DOC_TOOL_CALL: &str = r#"{"v":1,"type":"tool_call","id":"exec_t1","call_id":"c1","name":"read_file",
 "args":{"path":"notes.txt"},"timeout_ms":10000,"ts":"2026-01-20T12:34:56.000Z"}"#;

/// `tool-calls.md`, the two `tool_result` examples.
const DOC_RESULT_OK: &str = r#"{"v":1,"type":"tool_result","id":"exec_t1","call_id":"c1","ts":"...","ok":true,"result":"hello\n"}"#;
const DOC_RESULT_ERR: &str = r#"{"v":1,"type":"tool_result","id":"exec_t1","call_id":"c1","ts":"...","ok":false,"error":"no such file"}"#;

/// `tool-calls.md`, the `result` example.
const DOC_RESULT: &str = r#"{"v":1,"type":"result","id":"exec_t1","exit_code":0,"duration_ms":41,
 "resource_usage":{"peak_memory_mb":9,"cpu_time_ms":30},"reason":"exited","stdout_bytes":0,"stderr_bytes":0,
 "truncated":false,"tool_calls":1,"return_value":6,"ts":"2026-01-20T12:34:56.100Z"}"#;

fn execute_with(extra: Value) -> String {
    let mut v: Value = serde_json::from_str(DOC_EXECUTE).unwrap();
    for (k, x) in extra.as_object().unwrap() {
        if x.is_null() {
            v.as_object_mut().unwrap().remove(k);
        } else {
            v[k] = x.clone();
        }
    }
    v.to_string()
}

#[test]
fn the_execute_example_parses() {
    let Ok(ClientMessage::Execute(req)) = parse_client_message(DOC_EXECUTE) else {
        panic!("{DOC_EXECUTE}");
    };
    assert_eq!(req.tools.len(), 1);
    assert_eq!(req.tools[0].name, "read_file");
    assert_eq!(req.tools[0].parameters(), ["path"]);
    assert_eq!(req.tool_timeout_ms, Some(10_000));
    assert_eq!(req.resolve_tool_timeout(60_000), Ok(10_000));
    let e = req.resolve_tool_timeout(5_000).unwrap_err();
    assert_eq!(e.code, ErrorCode::InvalidRequest);
    assert!(
        e.message.contains("tool_timeout_ms") && e.message.contains("5000"),
        "{e:?}"
    );
}

#[test]
fn the_tool_call_example_parses_and_encodes_the_same() {
    let env = parse_server_envelope(DOC_TOOL_CALL).unwrap();
    let ServerMessage::ToolCall(call) = &env.message else {
        panic!("{env:?}");
    };
    assert_eq!(
        call,
        &ToolCall {
            id: "exec_t1".into(),
            call_id: "c1".into(),
            name: "read_file".into(),
            args: json!({"path": "notes.txt"}),
            raw_args: None,
            timeout_ms: Some(10_000),
        }
    );
    assert!(env.message.id() == Some("exec_t1") && !env.message.is_terminal());
    let encoded: Value = serde_json::from_str(&encode_with_ts(&env.message, &env.ts)).unwrap();
    assert_eq!(
        encoded,
        serde_json::from_str::<Value>(DOC_TOOL_CALL).unwrap()
    );
    // Arguments kept as text are written out as they are.
    let raw: Box<serde_json::value::RawValue> =
        serde_json::from_str(r#"{"path": "notes.txt"}"#).unwrap();
    let kept = ServerMessage::ToolCall(ToolCall::raw(
        call.id.clone(),
        call.call_id.clone(),
        call.name.clone(),
        protocol::RawArgs::object(&raw).unwrap(),
        call.timeout_ms,
    ));
    let text = encode_with_ts(&kept, &env.ts);
    assert!(text.contains(r#""args":{"path": "notes.txt"}"#), "{text}");
    assert_eq!(serde_json::from_str::<Value>(&text).unwrap(), encoded);
}

#[test]
fn the_tool_result_examples_parse_and_round_trip() {
    for (text, ok) in [(DOC_RESULT_OK, true), (DOC_RESULT_ERR, false)] {
        let Ok(ClientMessage::ToolResult(r)) = parse_client_message(text) else {
            panic!("{text}");
        };
        assert_eq!(
            (r.id.as_str(), r.call_id.as_str(), r.ok),
            ("exec_t1", "c1", ok)
        );
        let again = serde_json::to_string(&ClientMessage::ToolResult(r.clone())).unwrap();
        assert_eq!(
            serde_json::from_str::<Value>(&again).unwrap(),
            serde_json::from_str::<Value>(text).unwrap()
        );
    }
    let built = ToolResult::failure("exec_t1", "c1", "no such file");
    let text = serde_json::to_string(&ClientMessage::ToolResult(built)).unwrap();
    assert!(
        matches!(parse_client_message(&text), Ok(ClientMessage::ToolResult(r)) if r.error.as_deref() == Some("no such file"))
    );
}

#[test]
fn the_result_example_carries_count_and_return_value() {
    let env = parse_server_envelope(DOC_RESULT).unwrap();
    let ServerMessage::Result(r) = &env.message else {
        panic!("{env:?}");
    };
    assert_eq!(
        (r.tool_calls, r.return_value.as_deref()),
        (Some(1), Some(&json!(6)))
    );
    let encoded: Value = serde_json::from_str(&encode_with_ts(&env.message, &env.ts)).unwrap();
    assert_eq!(encoded, serde_json::from_str::<Value>(DOC_RESULT).unwrap());
}

#[test]
fn the_extension_is_advertised() {
    assert!(SANDBOXD_EXTENSIONS.contains(&"tool_calls"));
}

#[test]
fn a_request_built_in_rust_round_trips() {
    let mut req = ExecuteRequest::new(
        "exec_t2",
        Language::Javascript,
        "return 1",
        RequestedLimits::new(1000, 64),
    );
    req.tools = vec![
        ToolSpec::new("grep"),
        ToolSpec {
            description: Some("d".into()),
            schema: Some(json!({})),
            ..ToolSpec::new("bash")
        },
    ];
    req.tool_timeout_ms = Some(5);
    let text = serde_json::to_string(&ClientMessage::Execute(req.clone())).unwrap();
    assert!(matches!(parse_client_message(&text), Ok(ClientMessage::Execute(back)) if back == req));
    // Without tools the fields stay off the wire.
    let plain = ExecuteRequest::new(
        "exec_t3",
        Language::Python,
        "1",
        RequestedLimits::new(1000, 64),
    );
    let text = serde_json::to_string(&ClientMessage::Execute(plain)).unwrap();
    assert!(!text.contains("tool"), "{text}");
}

#[test]
fn bad_tools_are_refused_naming_the_field() {
    let id = Some("exec_t1");
    let long = "a".repeat(65);
    let cases = [
        (
            json!({"tools": [{"name": "a"}, {"name": "a"}]}),
            "tools[1].name",
        ),
        (json!({"tools": [{"name": ""}]}), "tools[0].name"),
        (json!({"tools": [{"name": "9lives"}]}), "tools[0].name"),
        (json!({"tools": [{"name": "rm-rf"}]}), "tools[0].name"),
        (json!({"tools": [{"name": long}]}), "tools[0].name"),
        (json!({"tools": [{"name": "class"}]}), "reserved"),
        (json!({"tools": [{"name": "call"}]}), "reserved"),
        (
            json!({"tools": [{"name": "a", "schema": "x"}]}),
            "tools[0].schema",
        ),
        (
            json!({"tools": [{"name": "a", "description": "x".repeat(4097)}]}),
            "tools[0].description",
        ),
        (json!({"tools": [{"name": "a", "version": 2}]}), "tools[0]"),
        (json!({"tools": [{"nome": "a"}]}), "tools[0]"),
        (json!({"tools": "read_file"}), "tools"),
        (
            json!({"tools": (0..65).map(|i| json!({"name": format!("t{i}")})).collect::<Vec<_>>()}),
            "at most 64",
        ),
        (json!({"tool_timeout_ms": 0}), "tool_timeout_ms"),
        (json!({"tool_timeout_ms": "fast"}), "tool_timeout_ms"),
        (json!({"tools": null}), "tool_timeout_ms"),
        (json!({"language": "shell"}), "tools"),
    ];
    for (extra, needle) in cases {
        invalid(&execute_with(extra), id, needle);
    }
}

#[test]
fn bad_tool_results_are_refused_naming_the_field() {
    let base =
        |extra: &str| format!(r#"{{"v":1,"type":"tool_result","id":"exec_t1","ts":"..."{extra}}}"#);
    let id = Some("exec_t1");
    invalid(&base(r#","ok":true"#), id, "call_id");
    invalid(&base(r#","call_id":"c 1","ok":true"#), id, "call_id");
    invalid(&base(r#","call_id":"c1""#), id, "ok");
    invalid(&base(r#","call_id":"c1","ok":false"#), id, "error");
    invalid(
        &base(r#","call_id":"c1","ok":true,"error":"x""#),
        id,
        "error",
    );
    invalid(
        &base(r#","call_id":"c1","ok":false,"error":"x","result":1"#),
        id,
        "result",
    );
    invalid(&base(r#","call_id":"c1","ok":true,"extra":1"#), id, "extra");
    invalid(
        &base(r#","call_id":"c1","ok":false,"error":{"m":1}"#),
        id,
        "error",
    );
    // No usable id: refused without one.
    refused(
        r#"{"v":1,"type":"tool_result","ts":"...","call_id":"c1","ok":true}"#,
        ErrorCode::InvalidRequest,
        None,
    );
}

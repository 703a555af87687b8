//! Client messages built in Rust serialize to a wire form the parser accepts unchanged.

use std::collections::BTreeMap;

use protocol::{
    parse_client_message, ArtifactsRequest, CancelRequest, ClientMessage, ExecuteRequest,
    FileEncoding, FileSpec, Language, PingRequest, RequestedLimits,
};
use serde_json::{json, Value};

fn full_request() -> ExecuteRequest {
    let mut req = ExecuteRequest::new(
        "exec_rt",
        Language::Shell,
        "cat in.txt",
        RequestedLimits::new(5000, 128),
    );
    req.stdin = Some("input\n".into());
    req.env = BTreeMap::from([("A".into(), "1".into()), ("B".into(), "x=y".into())]);
    req.limits.pids_max = Some(32);
    req.files = vec![
        FileSpec {
            path: "in.txt".into(),
            content: "héllo".into(),
            encoding: FileEncoding::Utf8,
        },
        FileSpec {
            path: "bin/data".into(),
            content: "AAEC".into(),
            encoding: FileEncoding::Base64,
        },
    ];
    req.artifacts = Some(ArtifactsRequest {
        paths: vec!["out/**".into()],
        types: Some(BTreeMap::from([("out/**".into(), "log_bundle".into())])),
    });
    req.limits.cpu_cores = protocol::CpuCores::new(0.5);
    req.traceparent = Some("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".into());
    req
}

#[test]
fn execute_round_trips() {
    let req = full_request();
    req.validate().unwrap();
    protocol::parse_ts(&req.ts).unwrap();
    let msg = ClientMessage::Execute(req);
    let text = serde_json::to_string(&msg).unwrap();
    assert!(
        text.starts_with(r#"{"v":1,"type":"execute","id":"exec_rt","ts":""#),
        "{text}"
    );
    assert_eq!(parse_client_message(&text).unwrap(), msg);
    let value: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(
        value["limits"],
        json!({"timeout_ms":5000,"memory_mb":128,"pids_max":32,"cpu_cores":0.5})
    );
    assert_eq!(
        value["traceparent"],
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    );
    assert_eq!(
        value["files"][1],
        json!({"path":"bin/data","content":"AAEC","encoding":"base64"})
    );
}

#[test]
fn minimal_execute_omits_empty_optionals() {
    let req = ExecuteRequest::new(
        "e",
        Language::Elixir,
        "IO.puts 1",
        RequestedLimits::new(1, 1),
    );
    let value = serde_json::to_value(ClientMessage::Execute(req)).unwrap();
    let keys: Vec<&str> = value
        .as_object()
        .unwrap()
        .keys()
        .map(String::as_str)
        .collect();
    let mut want = vec!["v", "type", "id", "ts", "language", "code", "limits"];
    want.sort_unstable();
    let mut keys = keys;
    keys.sort_unstable();
    assert_eq!(keys, want);
}

#[test]
fn cancel_and_ping_round_trip() {
    for msg in [
        ClientMessage::Cancel(CancelRequest::new("exec_rt")),
        ClientMessage::Ping(PingRequest::new()),
    ] {
        let text = serde_json::to_string(&msg).unwrap();
        assert_eq!(parse_client_message(&text).unwrap(), msg, "{text}");
    }
}

#[test]
fn validate_catches_what_a_client_builds_wrong() {
    let mut req = full_request();
    req.files.push(FileSpec {
        path: "in.txt".into(),
        content: String::new(),
        encoding: FileEncoding::Utf8,
    });
    let err = req.validate().unwrap_err();
    assert!(err.message.contains("files[2].path"), "{}", err.message);
    let mut req = full_request();
    req.id = "no spaces allowed".into();
    assert_eq!(req.validate().unwrap_err().id, None);
}

/// Found by fuzzing (fuzz/ target `tool_request_line`): a number too large for an integer was parsed to an f64
/// one bit away from the nearest one, so the value sandboxd relays (a `tool_call`'s args, a `tool_result`) was
/// not the value it was sent: re-encoded and parsed again it changed.
#[test]
fn numbers_in_relayed_values_survive_a_round_trip() {
    for number in [
        "240400000000000000000000000000000001403121483905207864",
        "1088888888888888888888888888888888888888888888888888888824",
    ] {
        let text = format!(
            r#"{{"v":1,"type":"tool_result","id":"exec_1","ts":"...","call_id":"c1","ok":true,"result":{{"q":{number}}}}}"#
        );
        let msg = parse_client_message(&text).unwrap();
        let again = parse_client_message(&serde_json::to_string(&msg).unwrap()).unwrap();
        assert_eq!(again, msg, "{number}");
    }
}

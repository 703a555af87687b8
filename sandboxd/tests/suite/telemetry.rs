//! Traces (config `telemetry`): a daemon exporting to an in-process OTLP/HTTP receiver, whose requests are decoded
//! with the `opentelemetry-proto` types; the span tree of one execution, under the caller's `traceparent`.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::State;
use axum::routing::post;
use axum::Router;
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::any_value::Value as AnyValue;
use opentelemetry_proto::tonic::common::v1::KeyValue;
use opentelemetry_proto::tonic::trace::v1::status::StatusCode;
use opentelemetry_proto::tonic::trace::v1::Span;
use prost::Message;
use serde_json::json;

use super::harness::{privileged, wait_until, with, Client, Daemon, DaemonOpts};
use super::tools::{exec_tools, run_answering, READS_AND_A_FAILED_CALL};

/// What the receiver got: the spans, and the resource attributes they came with.
#[derive(Clone, Default)]
struct Received(Arc<Mutex<(Vec<Span>, Vec<KeyValue>)>>);

async fn export(State(got): State<Received>, body: Bytes) -> Vec<u8> {
    let req = ExportTraceServiceRequest::decode(body).expect("an OTLP protobuf export request");
    let mut got = got.0.lock().unwrap();
    for rs in req.resource_spans {
        if let Some(r) = rs.resource {
            got.1.extend(r.attributes);
        }
        for ss in rs.scope_spans {
            got.0.extend(ss.spans);
        }
    }
    ExportTraceServiceResponse::default().encode_to_vec()
}

/// An OTLP/HTTP receiver on a free loopback port: its base URL and what it receives.
async fn receiver() -> (String, Received) {
    let got = Received::default();
    let app = Router::new()
        .route("/v1/traces", post(export))
        .with_state(got.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (url, got)
}

fn attr(span_or_resource: &[KeyValue], key: &str) -> Option<String> {
    span_or_resource
        .iter()
        .find(|kv| kv.key == key)
        .and_then(|kv| kv.value.as_ref()?.value.clone())
        .map(|v| match v {
            AnyValue::StringValue(s) => s,
            AnyValue::IntValue(i) => i.to_string(),
            other => format!("{other:?}"),
        })
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[tokio::test]
async fn an_execution_and_its_tool_calls_are_spans_under_the_callers_traceparent() {
    let Some(_g) =
        privileged("an_execution_and_its_tool_calls_are_spans_under_the_callers_traceparent").await
    else {
        return;
    };
    let (url, got) = receiver().await;
    let d = Daemon::start(DaemonOpts {
        extra_config: Some(json!({"telemetry": {
            "otlp_endpoint": url,
            "resource_attributes": {"deployment.environment": "test"},
        }})),
        ..DaemonOpts::default()
    })
    .await;
    let mut c = Client::connect(&d).await;
    let (trace_id, caller) = ("4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7");
    let code = format!(
        "import os\n{READS_AND_A_FAILED_CALL}{}",
        r#"
os.makedirs("out", exist_ok=True)
open("out/n.txt", "w").write(str(len(a) + len(b)))
return len(a) + len(b)
"#
    );
    let exec = with(
        exec_tools("traced", "python", &code, &["read_file", "boom"]),
        json!({"traceparent": format!("00-{trace_id}-{caller}-01"), "artifacts": {"paths": ["out/**"]}}),
    );
    let (run, calls) = run_answering(&mut c, exec, |call| match call.name.as_str() {
        "read_file" => Some(Ok(json!("x".repeat(1000)))),
        _ => Some(Err("no".into())),
    })
    .await;
    assert_eq!(calls.len(), 3, "{}", run.dump());

    // The batch processor sends every few seconds.
    let spans = wait_until("the execution's spans", Duration::from_secs(30), || {
        let got = got.clone();
        async move {
            let got = got.0.lock().unwrap();
            let mine: Vec<Span> = got
                .0
                .iter()
                .filter(|s| hex(&s.trace_id) == trace_id)
                .cloned()
                .collect();
            let tools = mine.iter().filter(|s| s.name == "tool_call").count();
            let roots = mine
                .iter()
                .filter(|s| attr(&s.attributes, "id").as_deref() == Some("traced"))
                .count();
            if tools == 3 && roots == 1 && mine.iter().any(|s| s.name == "artifacts") {
                Ok(mine)
            } else {
                Err(format!(
                    "{} spans of the trace so far: {:?}",
                    mine.len(),
                    mine.iter().map(|s| &s.name).collect::<Vec<_>>()
                ))
            }
        }
    })
    .await;
    assert_execution_tree(&spans, caller);
    let agent_caller = "00f067aa0ba902b8";
    let request = agent_request_span(&d, &got, trace_id, agent_caller).await;
    assert_eq!(hex(&request.parent_span_id), agent_caller);
    assert_eq!(
        attr(&request.attributes, "path").as_deref(),
        Some("/sandboxes/none/health")
    );
    let resource = got.0.lock().unwrap().1.clone();
    assert_eq!(attr(&resource, "service.name").as_deref(), Some("sandboxd"));
    assert_eq!(
        attr(&resource, "deployment.environment").as_deref(),
        Some("test")
    );
}

/// The execution's span is the caller's child; its slot's span, the phases and the tool calls are below it.
fn assert_execution_tree(spans: &[Span], caller: &str) {
    let names: Vec<&str> = spans.iter().map(|s| s.name.as_str()).collect();
    eprintln!("spans of the trace: {names:?}");
    let one = |pred: &dyn Fn(&Span) -> bool, what: &str| -> Span {
        let found: Vec<&Span> = spans.iter().filter(|s| pred(s)).collect();
        assert_eq!(found.len(), 1, "one {what} span: {names:?}");
        found[0].clone()
    };
    // The execution's span is the caller's child.
    let root = one(
        &|s| attr(&s.attributes, "id").as_deref() == Some("traced"),
        "execution",
    );
    assert_eq!(root.name, "execution");
    assert_eq!(
        hex(&root.parent_span_id),
        caller,
        "the parent is the traceparent's span"
    );
    // Below it, the execution in its slot, and its phases below that.
    let slot = one(
        &|s| s.name == "execution" && s.parent_span_id == root.span_id,
        "slot",
    );
    let take = one(&|s| s.name == "container_take", "container_take");
    let launch = one(&|s| s.name == "launch", "launch");
    let ran = one(&|s| s.name == "run", "run");
    for phase in [&take, &launch, &ran] {
        assert_eq!(
            phase.parent_span_id, slot.span_id,
            "{} under the execution",
            phase.name
        );
    }
    let artifacts = one(&|s| s.name == "artifacts", "artifacts");
    assert_eq!(
        artifacts.parent_span_id, ran.span_id,
        "artifacts are collected at the end of the run"
    );
    // One span per tool call, children of the execution, with the tool, the bytes and the outcome.
    let mut tools: Vec<&Span> = spans.iter().filter(|s| s.name == "tool_call").collect();
    tools.sort_by_key(|s| s.start_time_unix_nano);
    let seen: Vec<(Option<String>, Option<String>)> = tools
        .iter()
        .map(|s| (attr(&s.attributes, "tool"), attr(&s.attributes, "outcome")))
        .collect();
    let want = |t: &str, o: &str| (Some(t.to_owned()), Some(o.to_owned()));
    assert_eq!(
        seen,
        [
            want("read_file", "ok"),
            want("read_file", "ok"),
            want("boom", "tool_error")
        ]
    );
    for t in &tools {
        assert_eq!(
            t.parent_span_id, slot.span_id,
            "tool calls are children of the execution"
        );
        assert!(t.end_time_unix_nano >= t.start_time_unix_nano);
        assert!(attr(&t.attributes, "args_bytes").is_some(), "{t:?}");
    }
    let ok_bytes: u64 = attr(&tools[0].attributes, "result_bytes")
        .unwrap()
        .parse()
        .unwrap();
    assert!(ok_bytes > 1000, "the result's bytes: {ok_bytes}");
    assert_eq!(
        tools[2].status.as_ref().map(|s| s.code),
        Some(StatusCode::Error as i32),
        "a failed call is an error span"
    );
}

/// Sends an agent endpoint request with a traceparent naming `caller`; the span the receiver gets for it.
async fn agent_request_span(d: &Daemon, got: &Received, trace_id: &str, caller: &str) -> Span {
    // An agent endpoint's request span follows the traceparent header too (whatever the answer).
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", d.port))
        .await
        .unwrap();
    let head = format!(
        "GET /sandboxes/none/health HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {}\r\n\
         traceparent: 00-{trace_id}-{caller}-01\r\nConnection: close\r\n\r\n",
        d.token()
    );
    tokio::io::AsyncWriteExt::write_all(&mut s, head.as_bytes())
        .await
        .unwrap();
    let mut answer = Vec::new();
    tokio::io::AsyncReadExt::read_to_end(&mut s, &mut answer)
        .await
        .unwrap();
    wait_until("the agent request's span", Duration::from_secs(30), || {
        let got = got.clone();
        async move {
            let got = got.0.lock().unwrap();
            got.0
                .iter()
                .find(|s| s.name == "agent_request" && hex(&s.trace_id) == trace_id)
                .cloned()
                .ok_or_else(|| "not yet".to_owned())
        }
    })
    .await
}

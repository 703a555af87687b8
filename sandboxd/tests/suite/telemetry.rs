//! Traces (config `telemetry`): a daemon exporting to an in-process OTLP/HTTP receiver, whose requests are decoded
//! with the `opentelemetry-proto` types; the span tree of one execution, under the caller's `traceparent`.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::State;
use axum::routing::post;
use axum::Router;
use opentelemetry_proto::tonic::collector::metrics::v1::{
    ExportMetricsServiceRequest, ExportMetricsServiceResponse,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::any_value::Value as AnyValue;
use opentelemetry_proto::tonic::common::v1::KeyValue;
use opentelemetry_proto::tonic::metrics::v1::metric::Data;
use opentelemetry_proto::tonic::metrics::v1::Metric;
use opentelemetry_proto::tonic::trace::v1::status::StatusCode;
use opentelemetry_proto::tonic::trace::v1::Span;
use prost::Message;
use serde_json::json;

use super::harness::{privileged, wait_until, with, Client, Daemon, DaemonOpts};
use super::tools::{exec_tools, run_answering, READS_AND_A_FAILED_CALL};

/// What the receiver got: the spans, and the resource attributes they came with.
#[derive(Clone, Default)]
struct Received(Arc<Mutex<(Vec<Span>, Vec<KeyValue>)>>, Metrics);

impl Received {
    /// The spans received so far of trace `trace_id` (hex).
    fn trace(&self, trace_id: &str) -> Vec<Span> {
        let got = self.0.lock().unwrap();
        got.0
            .iter()
            .filter(|s| hex(&s.trace_id) == trace_id)
            .cloned()
            .collect()
    }
}

/// The metrics of the latest export (cumulative: each export has every series).
#[derive(Clone, Default)]
struct Metrics(Arc<Mutex<Vec<Metric>>>);

async fn export_metrics(State(got): State<Received>, body: Bytes) -> Vec<u8> {
    let req = ExportMetricsServiceRequest::decode(body).expect("an OTLP protobuf metrics request");
    let metrics: Vec<Metric> = req
        .resource_metrics
        .into_iter()
        .flat_map(|rm| rm.scope_metrics)
        .flat_map(|sm| sm.metrics)
        .collect();
    if !metrics.is_empty() {
        *got.1 .0.lock().unwrap() = metrics;
    }
    ExportMetricsServiceResponse::default().encode_to_vec()
}

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
        .route("/v1/metrics", post(export_metrics))
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
            "metrics_interval_ms": 200,
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
            let mine = got.trace(trace_id);
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
    assert_otlp_metrics(&got).await;
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

/// One agent endpoint request with the daemon's token and a `traceparent` header: status and JSON body.
async fn traced_http(
    d: &Daemon,
    method: &str,
    path: &str,
    body: &serde_json::Value,
    traceparent: &str,
) -> (u16, serde_json::Value) {
    let extra = format!("traceparent: {traceparent}\r\n");
    super::images::agent_http_with(d, method, path, body, &extra).await
}

/// An agent sandbox's life is spans under the callers' traceparents: each endpoint's request span has its
/// lifecycle span below it (create, spawn, pause, resume, kill, destroy), the run is a span under its spawn that
/// ends with how the run ended, and the gateway's event connection is a span with the events it was sent.
#[tokio::test]
async fn an_agent_sandboxs_lifecycle_and_event_delivery_are_spans() {
    let Some(_g) = privileged("an_agent_sandboxs_lifecycle_and_event_delivery_are_spans").await
    else {
        return;
    };
    let (url, got) = receiver().await;
    let d = Daemon::start(DaemonOpts {
        extra_config: Some(json!({"telemetry": {"otlp_endpoint": url}})),
        ..DaemonOpts::default()
    })
    .await;
    let trace_id = "5bf92f3577b34da6a3ce929d0e0e4737";
    let (id, seen) = agent_lifecycle(&d, trace_id).await;
    let names = [
        "agent_create",
        "agent_events",
        "agent_spawn",
        "agent_pause",
        "agent_resume",
        "agent_kill",
        "agent_destroy",
    ];
    let spans = wait_until("the agent's spans", Duration::from_secs(30), || {
        let got = got.clone();
        async move {
            let mine = got.trace(trace_id);
            let have = |n: &str| mine.iter().any(|s| s.name == n);
            let runs = mine.iter().filter(|s| s.name == "agent").count();
            if names.iter().all(|n| have(n)) && runs == 2 {
                Ok(mine)
            } else {
                Err(format!(
                    "{:?}",
                    mine.iter().map(|s| &s.name).collect::<Vec<_>>()
                ))
            }
        }
    })
    .await;
    let by_id = |id: &[u8]| spans.iter().find(|s| s.span_id == id);
    // The caller of the request a span was made in.
    let caller = |span: &Span| -> String {
        let request = by_id(&span.parent_span_id)
            .unwrap_or_else(|| panic!("{}'s parent is not in the trace", span.name));
        assert_eq!(request.name, "agent_request", "{}", span.name);
        hex(&request.parent_span_id)
    };
    // Each lifecycle span's parent is its request's span, whose parent is that step's caller.
    for (i, name) in names.iter().enumerate() {
        let want = format!("{:016x}", i + 1);
        let span = spans
            .iter()
            .find(|s| s.name == *name && caller(s) == want)
            .unwrap_or_else(|| panic!("no {name} under caller {want}"));
        assert_eq!(
            attr(&span.attributes, "sandbox").as_deref(),
            Some(id.as_str()),
            "{name}"
        );
    }
    // The runs: each under its spawn; the killed one is not an error, the one that failed is a crash.
    for (spawned_by, outcome, error) in [(3, "killed", false), (8, "crashed", true)] {
        let run = spans
            .iter()
            .find(|s| {
                s.name == "agent" && attr(&s.attributes, "outcome").as_deref() == Some(outcome)
            })
            .unwrap_or_else(|| panic!("no {outcome} run"));
        let spawn = by_id(&run.parent_span_id).expect("the run's spawn");
        assert_eq!(spawn.name, "agent_spawn");
        assert_eq!(caller(spawn), format!("{spawned_by:016x}"), "{outcome}");
        assert_eq!(
            run.status.as_ref().map(|s| s.code) == Some(StatusCode::Error as i32),
            error,
            "{outcome}: {:?}",
            run.status
        );
    }
    // The gateway was sent what it read (started, paused, resumed, killed, ...).
    let events = spans.iter().find(|s| s.name == "agent_events").unwrap();
    let delivered: usize = attr(&events.attributes, "delivered")
        .unwrap()
        .parse()
        .unwrap();
    assert!(
        delivered >= seen.len() && seen.len() >= 4,
        "{delivered} {seen:?}"
    );
}

/// The sum of a counter's points whose attributes include every one of `with`; for a histogram, the sum of its
/// observations.
fn total(m: &Metric, with: &[(&str, &str)]) -> u64 {
    let matches = |attrs: &[KeyValue]| {
        with.iter()
            .all(|(k, v)| attr(attrs, k).as_deref() == Some(*v))
    };
    match &m.data {
        Some(Data::Sum(s)) => s
            .data_points
            .iter()
            .filter(|p| matches(&p.attributes))
            .map(|p| match p.value {
                Some(opentelemetry_proto::tonic::metrics::v1::number_data_point::Value::AsInt(
                    i,
                )) => i as u64,
                _ => 0,
            })
            .sum(),
        Some(Data::Histogram(h)) => h
            .data_points
            .iter()
            .filter(|p| matches(&p.attributes))
            .map(|p| p.sum.unwrap_or(0.0) as u64)
            .sum(),
        _ => 0,
    }
}

/// A metric's name, the attributes its points must have, and the least total (see [`total`]).
type Want = (&'static str, &'static [(&'static str, &'static str)], u64);

/// The traced execution's observations reached the OTLP receiver too (beyond the start-up self-test's one
/// execution per language, which makes no tool call): its end, its three tool calls by tool and outcome with their
/// latency, and its tool calls and the bytes its tools returned, per execution.
async fn assert_otlp_metrics(got: &Received) {
    let wants: [Want; 6] = [
        (
            "sandboxd.executions",
            &[("language", "python"), ("reason", "exited")],
            2,
        ),
        (
            "sandboxd.tool_calls",
            &[("tool", "read_file"), ("outcome", "ok")],
            2,
        ),
        (
            "sandboxd.tool_calls",
            &[("tool", "boom"), ("outcome", "tool_error")],
            1,
        ),
        (
            "sandboxd.execution.tool_calls",
            &[("language", "python")],
            3,
        ),
        // Two results of 1000 characters and their JSON.
        (
            "sandboxd.execution.tool_result_bytes",
            &[("language", "python")],
            2000,
        ),
        (
            "sandboxd.execution.output_bytes",
            &[("language", "python")],
            1,
        ),
    ];
    wait_until("the metrics export", Duration::from_secs(30), || {
        let got = got.clone();
        async move {
            let metrics = got.1 .0.lock().unwrap().clone();
            let missing: Vec<String> = wants
                .iter()
                .filter(|(name, with, n)| {
                    !metrics.iter().any(|m| m.name == *name && total(m, with) >= *n)
                })
                .map(|(name, with, n)| format!("{name} {with:?} >= {n}"))
                .collect();
            // The latencies: one observation per call (a histogram's count).
            let latencies = metrics.iter().any(|m| {
                m.name == "sandboxd.tool_call.duration"
                    && matches!(&m.data, Some(Data::Histogram(h))
                        if h.data_points.iter().any(|p| attr(&p.attributes, "tool").as_deref() == Some("read_file") && p.count == 2))
            });
            if missing.is_empty() && latencies {
                Ok(())
            } else {
                Err(format!(
                    "missing {missing:?} (tool latencies: {latencies}) in {:?}",
                    metrics.iter().map(|m| &m.name).collect::<Vec<_>>()
                ))
            }
        }
    })
    .await;
}

/// Drives an agent sandbox through its life, each step's request under caller span `n` of `trace_id`
/// (0000000000000001 for create, ...2 for the event stream, and so on): create, events, spawn, pause, resume,
/// kill, a spawn that fails on its own (8, its health polled with 9), delete (7). The sandbox's id and the events
/// the gateway read.
async fn agent_lifecycle(d: &Daemon, trace_id: &str) -> (String, Vec<String>) {
    use futures_util::StreamExt;
    use tokio_tungstenite::tungstenite::client::IntoClientRequest;
    let tp = |n: u8| format!("00-{trace_id}-{:016x}-01", n);
    let sandbox = json!({
        "workspaceRequirements": {"resourceLimits": {"memoryMb": 256, "diskMb": 16}},
        "bootstrap": {"backendUrl": "http://127.0.0.1:9", "backendToken": "t", "agentId": "a",
                      "tokenExpiresAt": "2099-01-01T00:00:00Z",
                      "artifactUploadEndpoint": "http://127.0.0.1:9/api/artifacts"},
    });
    let (status, created) = traced_http(d, "POST", "/sandboxes", &sandbox, &tp(1)).await;
    assert_eq!(status, 201, "{created}");
    let id = created["id"].as_str().unwrap().to_owned();
    let mut req = format!("ws://127.0.0.1:{}/sandboxes/{id}/events", d.port)
        .into_client_request()
        .unwrap();
    for (k, v) in [
        ("authorization", format!("Bearer {}", d.token())),
        ("traceparent", tp(2)),
    ] {
        req.headers_mut().insert(k, v.parse().unwrap());
    }
    let (mut ws, _) = tokio_tungstenite::connect_async(req).await.unwrap();
    let brief = json!({"agentId": "a", "providerConfig": {"command": ["/bin/sleep", "60"]}});
    let path = |op: &str| format!("/sandboxes/{id}/{op}");
    let (status, h) = traced_http(d, "POST", &path("spawn"), &brief, &tp(3)).await;
    assert_eq!(status, 200, "{h}");
    let (status, state) = traced_http(d, "POST", &path("pause"), &json!({}), &tp(4)).await;
    assert_eq!(status, 200, "{state}");
    let (status, h) = traced_http(d, "POST", &path("resume"), &state, &tp(5)).await;
    assert_eq!(status, 200, "{h}");
    let (status, k) = traced_http(d, "POST", &path("kill"), &json!({"grace": false}), &tp(6)).await;
    assert_eq!(status, 200, "{k}");
    // The gateway reads the events up to the kill's, then goes away.
    let mut seen = Vec::new();
    while !seen.iter().any(|e: &String| e.contains("\"killed\"")) {
        let m = tokio::time::timeout(Duration::from_secs(30), ws.next())
            .await
            .expect("events up to the kill")
            .expect("the stream stays open")
            .unwrap();
        seen.push(m.into_text().unwrap().to_string());
    }
    drop(ws);
    // A run that fails on its own is a crash.
    let brief = json!({"agentId": "a", "providerConfig": {"command": ["/bin/false"]}});
    let (status, h) = traced_http(d, "POST", &path("spawn"), &brief, &tp(8)).await;
    assert_eq!(status, 200, "{h}");
    wait_until("the second run's end", Duration::from_secs(30), || async {
        let (_, health) = traced_http(d, "GET", &path("health"), &json!({}), &tp(9)).await;
        match health["agentStatus"].as_str() {
            Some("error") => Ok(()),
            _ => Err(health.to_string()),
        }
    })
    .await;
    let (status, _) =
        traced_http(d, "DELETE", &format!("/sandboxes/{id}"), &json!({}), &tp(7)).await;
    assert_eq!(status, 204);

    (id, seen)
}

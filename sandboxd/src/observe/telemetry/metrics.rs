//! The execute_code design's metrics through OTLP as well (`telemetry.metrics_interval_ms`): executions by language
//! and reason (timeouts among them) with their duration, tool calls per execution, the bytes an execution
//! returned and the bytes its tools returned into it, tool calls by tool and outcome with their latency, and
//! `error` messages by code. The same observations as the Prometheus series of [`crate::observe::metrics`], which calls
//! in here; recorded into `opentelemetry_sdk` instruments whose periodic reader sends them (cumulative) as
//! OTLP/HTTP protobuf to `<otlp_endpoint>/v1/metrics`. Without an endpoint nothing is set up and each call here
//! is one atomic load.

use std::sync::OnceLock;
use std::time::Duration;

use opentelemetry::metrics::{Counter, Histogram, Meter, MeterProvider as _};
use opentelemetry::KeyValue;
use opentelemetry_otlp::MetricExporter;
use opentelemetry_sdk::metrics::{PeriodicReader, SdkMeterProvider};
use opentelemetry_sdk::Resource;

/// The instruments, set when metrics are exported.
static INSTRUMENTS: OnceLock<Instruments> = OnceLock::new();
/// The provider that owns the periodic reader, for [`flush`].
static PROVIDER: OnceLock<SdkMeterProvider> = OnceLock::new();

/// One instrument per series of the design.
struct Instruments {
    executions: Counter<u64>,
    duration: Histogram<f64>,
    tool_calls_per_execution: Histogram<u64>,
    output_bytes: Histogram<u64>,
    tool_result_bytes: Histogram<u64>,
    tool_calls: Counter<u64>,
    tool_call_duration: Histogram<f64>,
    errors: Counter<u64>,
}

/// `n` boundaries from `first`, each `factor` times the last (the Prometheus histograms' buckets).
fn exponential(first: f64, factor: f64, n: usize) -> Vec<f64> {
    std::iter::successors(Some(first), |b| Some(b * factor))
        .take(n)
        .collect()
}

impl Instruments {
    fn new(meter: &Meter) -> Self {
        let seconds = || exponential(0.001, 2.0, 19);
        let bytes = || exponential(64.0, 4.0, 12);
        Self {
            executions: meter
                .u64_counter("sandboxd.executions")
                .with_description("Executions ended, by language and reason")
                .build(),
            duration: meter
                .f64_histogram("sandboxd.execution.duration")
                .with_unit("s")
                .with_description("Arrival to the last message, by language")
                .with_boundaries(seconds())
                .build(),
            tool_calls_per_execution: meter
                .u64_histogram("sandboxd.execution.tool_calls")
                .with_description("Tool calls of one execution, by language")
                .with_boundaries(
                    std::iter::once(0.0)
                        .chain(exponential(1.0, 2.0, 14))
                        .collect(),
                )
                .build(),
            output_bytes: meter
                .u64_histogram("sandboxd.execution.output_bytes")
                .with_unit("By")
                .with_description(
                    "What an execution returned to the client: stdout, stderr, return value",
                )
                .with_boundaries(bytes())
                .build(),
            tool_result_bytes: meter
                .u64_histogram("sandboxd.execution.tool_result_bytes")
                .with_unit("By")
                .with_description("What an execution's tools returned into it")
                .with_boundaries(bytes())
                .build(),
            tool_calls: meter
                .u64_counter("sandboxd.tool_calls")
                .with_description("Tool calls, by tool and outcome")
                .build(),
            tool_call_duration: meter
                .f64_histogram("sandboxd.tool_call.duration")
                .with_unit("s")
                .with_description("Tool call to its reply, by tool")
                .with_boundaries(seconds())
                .build(),
            errors: meter
                .u64_counter("sandboxd.errors")
                .with_description("error messages sent, by code")
                .build(),
        }
    }
}

/// Starts the periodic export through `exporter` every `interval`.
pub(super) fn start(exporter: MetricExporter, resource: Resource, interval: Duration) {
    let provider = SdkMeterProvider::builder()
        .with_reader(
            PeriodicReader::builder(exporter)
                .with_interval(interval)
                .build(),
        )
        .with_resource(resource)
        .build();
    let _ = INSTRUMENTS.set(Instruments::new(&provider.meter("sandboxd")));
    let _ = PROVIDER.set(provider);
}

/// Sends what was recorded since the last export and stops the reader.
pub(super) fn flush() {
    if let Some(p) = PROVIDER.get() {
        if let Err(e) = p.shutdown() {
            tracing::warn!(error = %e, "cannot flush the metric exporter");
        }
    }
}

/// An execution of `language` sent its last message after `took`, ending for `reason` (`error` without a result).
pub fn execution_ended(language: &str, reason: &str, took: Duration) {
    if let Some(i) = INSTRUMENTS.get() {
        let language = KeyValue::new("language", language.to_owned());
        i.executions.add(
            1,
            &[language.clone(), KeyValue::new("reason", reason.to_owned())],
        );
        i.duration.record(took.as_secs_f64(), &[language]);
    }
}

/// An execution of `language` concluded with a result: its tool calls and bytes.
pub fn execution_concluded(
    language: &str,
    tool_calls: u64,
    output_bytes: u64,
    tool_result_bytes: u64,
) {
    if let Some(i) = INSTRUMENTS.get() {
        let attrs = [KeyValue::new("language", language.to_owned())];
        i.tool_calls_per_execution.record(tool_calls, &attrs);
        i.output_bytes.record(output_bytes, &attrs);
        i.tool_result_bytes.record(tool_result_bytes, &attrs);
    }
}

/// A tool call got its reply after `took` (`tool`: the bounded label of [`crate::observe::metrics`]).
pub fn tool_call(tool: &str, outcome: &str, took: Duration) {
    if let Some(i) = INSTRUMENTS.get() {
        let tool = KeyValue::new("tool", tool.to_owned());
        i.tool_calls.add(
            1,
            &[tool.clone(), KeyValue::new("outcome", outcome.to_owned())],
        );
        i.tool_call_duration.record(took.as_secs_f64(), &[tool]);
    }
}

/// An `error` message with `code` was sent.
pub fn error_sent(code: &str) {
    if let Some(i) = INSTRUMENTS.get() {
        i.errors.add(1, &[KeyValue::new("code", code.to_owned())]);
    }
}

//! Traces: the daemon's `tracing` spans exported as OpenTelemetry spans over OTLP (config `telemetry:`), through
//! `tracing-opentelemetry`, so one instrumentation feeds both the log and the traces; and the design's metrics
//! over the same endpoint ([`metrics`]).
//!
//! Off by default: without `telemetry.otlp_endpoint` no layer is installed ([`layer`] gives `None`), and a
//! request's `traceparent` is not even parsed. On, the spans of an execution (its `execution` span, with
//! `queue_wait`, `container_take`, `launch`, `run` and `artifacts` below it, and one `tool_call` span per call
//! of its code) are batched and sent as OTLP/HTTP protobuf to `<otlp_endpoint>/v1/traces`. A W3C `traceparent`
//! (in `execute`, or a header on the agent endpoints) makes them children of the caller's span
//! ([`set_parent`]).
//!
//! The exporter is `opentelemetry-otlp` with `opentelemetry-http`'s hyper client (hyper is linked anyway), not
//! gRPC (tonic's transport) nor reqwest (url and the ICU crates): the build stays lighter. The SDK's batch
//! processor runs on its own thread and the hyper client needs a tokio reactor, so [`OnRuntime`] hands each
//! request to the daemon's runtime once [`set_runtime`] has been called.

use std::collections::BTreeMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;
use std::time::Duration;

use opentelemetry::propagation::TextMapPropagator;
use opentelemetry::trace::TracerProvider as _;
use opentelemetry::KeyValue;
use opentelemetry_http::{Bytes, HttpClient, HttpError, Request, Response};
use opentelemetry_otlp::{Protocol, WithExportConfig, WithHttpConfig};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{BatchSpanProcessor, Sampler, SdkTracer, SdkTracerProvider};
use opentelemetry_sdk::Resource;
use serde::Deserialize;
use tracing_opentelemetry::{OpenTelemetryLayer, OpenTelemetrySpanExt};
use tracing_subscriber::Registry;

pub mod metrics;

/// How long one export may take.
const EXPORT_TIMEOUT: Duration = Duration::from_secs(10);

/// `telemetry:` in the daemon's configuration.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TelemetryConfig {
    /// Base URL of the OTLP/HTTP receiver, e.g. `http://127.0.0.1:4318` (spans go to `/v1/traces` under it);
    /// `None`: no traces.
    pub otlp_endpoint: Option<String>,
    /// The OTLP transport.
    pub protocol: OtlpProtocol,
    /// Fraction of new traces recorded, 0 to 1; a span whose caller sampled (or dropped) its trace follows it.
    pub sampling_ratio: f64,
    /// Attributes of the `sandboxd` resource, e.g. `deployment.environment: prod`.
    pub resource_attributes: BTreeMap<String, String>,
    /// How often the metrics ([`metrics`]) are sent to `<otlp_endpoint>/v1/metrics`, in milliseconds; 0: traces
    /// only.
    pub metrics_interval_ms: u64,
}

impl Default for TelemetryConfig {
    fn default() -> Self {
        Self {
            otlp_endpoint: None,
            protocol: OtlpProtocol::HttpProtobuf,
            sampling_ratio: 1.0,
            resource_attributes: BTreeMap::new(),
            metrics_interval_ms: 60_000,
        }
    }
}

/// `telemetry.protocol`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
pub enum OtlpProtocol {
    /// OTLP over HTTP with protobuf bodies (the only one built in).
    #[serde(rename = "http/protobuf")]
    HttpProtobuf,
}

impl TelemetryConfig {
    /// The ratio is within 0 to 1 and the endpoint an `http://` URL; the key that is wrong and why.
    pub fn validate(&self) -> Result<(), (&'static str, String)> {
        if !(0.0..=1.0).contains(&self.sampling_ratio) {
            return Err(("telemetry.sampling_ratio", "must be between 0 and 1".into()));
        }
        if self.metrics_interval_ms != 0 && self.metrics_interval_ms < 100 {
            return Err((
                "telemetry.metrics_interval_ms",
                "must be 0 (no metrics export) or at least 100".into(),
            ));
        }
        if let Some(e) = &self.otlp_endpoint {
            let uri: hyper::Uri = e
                .parse()
                .map_err(|err| ("telemetry.otlp_endpoint", format!("{err}")))?;
            if uri.scheme_str() != Some("http") || uri.host().is_none() {
                return Err((
                    "telemetry.otlp_endpoint",
                    "must be an http:// URL (no TLS is built in: use a local collector)".into(),
                ));
            }
        }
        Ok(())
    }
}

/// Traces could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum TelemetryError {
    /// The OTLP exporter refused its configuration.
    #[error("Cannot build the OTLP exporter")]
    Exporter(#[source] opentelemetry_otlp::ExporterBuildError),
}

/// The layer that turns spans into OpenTelemetry spans.
pub type OtelLayer = OpenTelemetryLayer<Registry, SdkTracer>;

/// Whether spans are exported (a layer was made).
static ENABLED: AtomicBool = AtomicBool::new(false);
/// The daemon's runtime, where the exporter's requests run.
static RUNTIME: OnceLock<tokio::runtime::Handle> = OnceLock::new();
/// The provider that owns the batch processor, for [`flush`].
static PROVIDER: OnceLock<SdkTracerProvider> = OnceLock::new();

/// Starts the export: the metrics' periodic reader (unless `metrics_interval_ms` is 0) and the tracing layer to
/// install; `None` when no endpoint is configured.
pub fn start(config: &TelemetryConfig) -> Result<Option<OtelLayer>, TelemetryError> {
    let Some(endpoint) = &config.otlp_endpoint else {
        return Ok(None);
    };
    let base = endpoint.trim_end_matches('/');
    let base = base.strip_suffix("/v1/traces").unwrap_or(base);
    let url = format!("{base}/v1/traces");
    if config.metrics_interval_ms > 0 {
        let exporter = opentelemetry_otlp::MetricExporter::builder()
            .with_http()
            .with_protocol(Protocol::HttpBinary)
            .with_endpoint(format!("{base}/v1/metrics"))
            .with_timeout(EXPORT_TIMEOUT)
            .with_http_client(client())
            .build()
            .map_err(TelemetryError::Exporter)?;
        metrics::start(
            exporter,
            resource(config),
            Duration::from_millis(config.metrics_interval_ms),
        );
    }
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_protocol(Protocol::HttpBinary)
        .with_endpoint(url)
        .with_timeout(EXPORT_TIMEOUT)
        .with_http_client(client())
        .build()
        .map_err(TelemetryError::Exporter)?;
    let provider = SdkTracerProvider::builder()
        .with_span_processor(BatchSpanProcessor::builder(exporter).build())
        .with_sampler(Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(
            config.sampling_ratio,
        ))))
        .with_resource(resource(config))
        .build();
    let layer = tracing_opentelemetry::layer().with_tracer(provider.tracer("sandboxd"));
    let _ = PROVIDER.set(provider);
    ENABLED.store(true, Ordering::Relaxed);
    Ok(Some(layer))
}

/// The exporters' HTTP client.
fn client() -> OnRuntime {
    OnRuntime(opentelemetry_http::hyper::HyperClient::with_default_connector(EXPORT_TIMEOUT, None))
}

/// The `sandboxd` resource with the configured attributes.
fn resource(config: &TelemetryConfig) -> Resource {
    Resource::builder()
        .with_service_name("sandboxd")
        .with_attributes(
            config
                .resource_attributes
                .iter()
                .map(|(k, v)| KeyValue::new(k.clone(), v.clone())),
        )
        .build()
}

/// Sends the spans still batched and the metrics recorded since the last export, and stops the exporters; while
/// the runtime of [`set_runtime`] still runs.
pub fn flush() {
    metrics::flush();
    if let Some(p) = PROVIDER.get() {
        if let Err(e) = p.shutdown() {
            tracing::warn!(error = %e, "cannot flush the trace exporter");
        }
    }
}

/// The daemon's runtime is up: exports may run on it from now on.
pub fn set_runtime(handle: tokio::runtime::Handle) {
    let _ = RUNTIME.set(handle);
}

/// Makes `span` a child of the caller's span named by a W3C `traceparent`. Nothing when traces are off or the
/// value names no valid span.
pub fn set_parent(span: &tracing::Span, traceparent: &str) {
    if !ENABLED.load(Ordering::Relaxed) {
        return;
    }
    let carrier =
        std::collections::HashMap::from([("traceparent".to_owned(), traceparent.to_owned())]);
    let cx = TraceContextPropagator::new().extract(&carrier);
    // An invalid traceparent extracts to an empty context: the span starts its own trace.
    let _ = span.set_parent(cx);
}

/// The hyper client, run on the daemon's runtime: the batch processor's thread has no reactor of its own.
#[derive(Debug, Clone)]
struct OnRuntime(opentelemetry_http::hyper::HyperClient);

impl HttpClient for OnRuntime {
    fn send_bytes<'a, 'b>(
        &'a self,
        request: Request<Bytes>,
    ) -> Pin<Box<dyn Future<Output = Result<Response<Bytes>, HttpError>> + Send + 'b>>
    where
        'a: 'b,
        Self: 'b,
    {
        let inner = self.0.clone();
        Box::pin(async move {
            let runtime = RUNTIME
                .get()
                .ok_or("the daemon's runtime has not started")?;
            runtime
                .spawn(async move { inner.send_bytes(request).await })
                .await?
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn off_by_default_and_validated() {
        let c = TelemetryConfig::default();
        assert!(start(&c).unwrap().is_none());
        assert!(c.validate().is_ok());
        let bad = TelemetryConfig {
            sampling_ratio: 1.5,
            ..TelemetryConfig::default()
        };
        assert_eq!(bad.validate().unwrap_err().0, "telemetry.sampling_ratio");
        let tls = TelemetryConfig {
            otlp_endpoint: Some("https://collector:4318".into()),
            ..TelemetryConfig::default()
        };
        assert_eq!(tls.validate().unwrap_err().0, "telemetry.otlp_endpoint");
    }
}

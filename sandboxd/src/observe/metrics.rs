//! Prometheus metrics: `GET /metrics` (OpenMetrics text, `prometheus-client`), behind the same bearer token as the
//! other endpoints, on the main listener and, when `metrics_listen` is set, on a separate one.
//!
//! One process-wide [`Metrics`] ([`get`]). The engine reports an execution's phases through a few one-line calls
//! ([`ExecutionTimer::begin`], [`ExecutionTimer::slot_acquired`], [`ExecutionTimer::ended_without_slot`],
//! [`created`], [`exited`], [`finished`]); the phases of an execution that holds a slot are keyed by its container id. Queue depth and slots
//! in use are read from the engine's admission control when scraped, so they are never stale.
//!
//! Series (all prefixed `sandboxd_`):
//!
//! | name | type | labels | what |
//! |---|---|---|---|
//! | `executions_total` | counter | `language`, `reason` | executions that ended: a `result` reason (`exited`, `signaled`, `timeout`, `oom`, `output_limit`, `cancelled`), or `error` (ended with an `error` message), or `overloaded` (refused at admission) |
//! | `queue_wait_seconds` | histogram | `language` | arrival to slot |
//! | `create_seconds` | histogram | `language` | slot to container created (scratch, bundle, container start) |
//! | `run_seconds` | histogram | `language` | program start to exit (`status: running` to the end of the program) |
//! | `total_seconds` | histogram | `language` | arrival to the last message of the execution |
//! | `queue_depth` | gauge | | executions waiting for a slot |
//! | `slots_in_use` | gauge | | executions holding a slot |
//! | `slots` | gauge | | `capacity.max_concurrent` |
//! | `pool_size` | gauge | | pre-created containers ready to launch (the warm pool, read at scrape time) |
//! | `artifacts_stored_bytes` | gauge | | bytes of artifact blobs in the store |
//! | `leftovers_found_total` | counter | `kind` (`cgroup`, `state`, `mount`) | what a previous instance left behind, found (and removed) at start |
//! | `start_time_seconds` | gauge | | Unix time the daemon started |
//! | `execution_tool_calls` | histogram | `language` | tool calls forwarded per execution that ended with a result (0 without tools) |
//! | `execution_output_bytes` | histogram | `language` | bytes an execution returned to the client: stdout, stderr and the return value's JSON |
//! | `execution_tool_result_bytes` | histogram | `language` | bytes of the tool results the code received inside the sandbox, per execution |
//! | `tool_calls_total` | counter | `tool`, `outcome` (`ok` or the error code the code saw: `not_allowed`, `timeout`, `tool_error`, `invalid`, `limit`, `closed`) | tool calls made from inside executions |
//! | `tool_call_seconds` | histogram | `tool` | a tool call's time from its request to its reply |
//! | `errors_total` | counter | `code` | `error` messages sent to clients, by code |
//!
//! The `tool` label is the tool's name for the first [`MAX_TOOL_SERIES`] names seen and `_other` after that
//! (names come from clients); a call of a tool the request did not list is `_unlisted`.

use std::collections::HashMap;
use std::path::Path;
use std::sync::atomic::{AtomicI64, AtomicU64};
use std::sync::{Arc, LazyLock, Mutex};
use std::time::{Duration, Instant, SystemTime};

use axum::extract::State;
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing;
use axum::Router;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;
use protocol::{ErrorCode, Language, Reason};

/// Distinct tool names given their own `tool` label; later ones share `_other`.
pub const MAX_TOOL_SERIES: usize = 256;

/// The content type of the OpenMetrics text format (Prometheus scrapes it natively).
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// What a scrape reads from the daemon at that moment (admission control and the pool), so it is never stale.
#[derive(Debug, Clone, Copy, Default)]
pub struct Gauges {
    /// Executions waiting for a slot.
    pub queue_depth: usize,
    /// Executions holding a slot.
    pub slots_in_use: usize,
    /// `capacity.max_concurrent`.
    pub slots: usize,
    /// Ready containers in the warm pool.
    pub pool_size: usize,
}

/// The daemon as `/metrics` sees it: the gauges read at scrape time and the bearer tokens it accepts. The engine
/// implements it; this module does not depend on the engine (which reports into this one).
pub trait Source: Send + Sync + 'static {
    /// The gauges, read now.
    fn gauges(&self) -> Gauges;
    /// Accepted bearer tokens.
    fn tokens(&self) -> &[String];
}

/// `language` and `reason` of an ended execution.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct EndLabels {
    language: String,
    reason: String,
}

/// `language` of a latency observation.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct LangLabels {
    language: String,
}

/// `kind` of a start-up leftover.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KindLabels {
    kind: String,
}

/// `tool` and `outcome` of a tool call.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ToolOutcomeLabels {
    tool: String,
    outcome: String,
}

/// `tool` of a tool call's latency.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ToolLabels {
    tool: String,
}

/// `code` of an `error` message.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CodeLabels {
    code: String,
}

/// A histogram per language.
type PerLanguage = Family<LangLabels, Histogram, fn() -> Histogram>;

/// 0, then 1 to 8192 doubling: tool calls per execution (`tools.max_calls` is 10000 by default).
fn count_histogram() -> Histogram {
    Histogram::new(std::iter::once(0.0).chain(exponential_buckets(1.0, 2.0, 14)))
}

/// 64 B to 256 MiB, quadrupling: what an execution returns, and what its tools returned into it.
fn bytes_histogram() -> Histogram {
    Histogram::new(exponential_buckets(64.0, 4.0, 12))
}

/// What one execution's tool calls added up to, and what it returned to the client.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ExecutionBytes {
    /// Tool calls forwarded to the client.
    pub tool_calls: u64,
    /// Bytes of the tool results the code received.
    pub tool_result_bytes: u64,
    /// Bytes returned to the client: stdout, stderr and the return value's JSON.
    pub output_bytes: u64,
}

/// 1 ms to ~4.4 min, doubling: covers a queue wait of nothing up to the largest default timeout.
fn latency_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.001, 2.0, 19))
}

/// What is known of an execution that holds a slot.
#[derive(Debug)]
struct Phases {
    language: &'static str,
    arrived: Instant,
    slot: Instant,
    reason: Option<&'static str>,
}

/// Every series of the daemon, and the registry that encodes them.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    executions: Family<EndLabels, Counter>,
    queue_wait: PerLanguage,
    create: PerLanguage,
    run: PerLanguage,
    total: PerLanguage,
    queue_depth: Gauge,
    slots_in_use: Gauge,
    slots: Gauge,
    pool_size: Gauge,
    artifacts_bytes: Gauge<i64, AtomicI64>,
    leftovers: Family<KindLabels, Counter>,
    start_time: Gauge<f64, AtomicU64>,
    execution_tool_calls: PerLanguage,
    execution_output_bytes: PerLanguage,
    execution_tool_result_bytes: PerLanguage,
    tool_calls: Family<ToolOutcomeLabels, Counter>,
    tool_call_seconds: Family<ToolLabels, Histogram, fn() -> Histogram>,
    errors: Family<CodeLabels, Counter>,
    tool_names: Mutex<std::collections::HashSet<String>>,
    in_slot: Mutex<HashMap<String, Phases>>,
}

static METRICS: LazyLock<Metrics> = LazyLock::new(Metrics::new);

/// The daemon's metrics.
pub fn get() -> &'static Metrics {
    &METRICS
}

impl Metrics {
    fn new() -> Self {
        let mut registry = Registry::with_prefix("sandboxd");
        let m = Self {
            executions: Family::default(),
            queue_wait: Family::new_with_constructor(latency_histogram),
            create: Family::new_with_constructor(latency_histogram),
            run: Family::new_with_constructor(latency_histogram),
            total: Family::new_with_constructor(latency_histogram),
            queue_depth: Gauge::default(),
            slots_in_use: Gauge::default(),
            slots: Gauge::default(),
            pool_size: Gauge::default(),
            artifacts_bytes: Gauge::default(),
            leftovers: Family::default(),
            start_time: Gauge::default(),
            execution_tool_calls: Family::new_with_constructor(count_histogram),
            execution_output_bytes: Family::new_with_constructor(bytes_histogram),
            execution_tool_result_bytes: Family::new_with_constructor(bytes_histogram),
            tool_calls: Family::default(),
            tool_call_seconds: Family::new_with_constructor(latency_histogram),
            errors: Family::default(),
            tool_names: Mutex::new(std::collections::HashSet::new()),
            in_slot: Mutex::new(HashMap::new()),
            registry: Registry::default(),
        };
        registry.register(
            "executions",
            "Executions that ended, by language and reason (result reason, error, overloaded)",
            m.executions.clone(),
        );
        registry.register(
            "queue_wait_seconds",
            "Time from arrival to getting an execution slot",
            m.queue_wait.clone(),
        );
        registry.register(
            "create_seconds",
            "Time from getting a slot to the container being created",
            m.create.clone(),
        );
        registry.register(
            "run_seconds",
            "Time from the program's start to its exit",
            m.run.clone(),
        );
        registry.register(
            "total_seconds",
            "Time from arrival to the execution's last message",
            m.total.clone(),
        );
        registry.register(
            "queue_depth",
            "Executions waiting for a slot",
            m.queue_depth.clone(),
        );
        registry.register(
            "slots_in_use",
            "Executions holding a slot",
            m.slots_in_use.clone(),
        );
        registry.register(
            "slots",
            "Execution slots (capacity.max_concurrent)",
            m.slots.clone(),
        );
        registry.register(
            "pool_size",
            "Pre-created containers ready to launch",
            m.pool_size.clone(),
        );
        registry.register(
            "artifacts_stored_bytes",
            "Bytes of artifact blobs in the store",
            m.artifacts_bytes.clone(),
        );
        registry.register(
            "leftovers_found",
            "What a previous instance left behind, found and removed at start, by kind",
            m.leftovers.clone(),
        );
        registry.register(
            "start_time_seconds",
            "Unix time the daemon started",
            m.start_time.clone(),
        );
        m.register_tool_series(&mut registry);
        let now = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .unwrap_or_default();
        m.start_time.set(now.as_secs_f64());
        Self { registry, ..m }
    }

    /// The per-execution tool and byte series, the tool calls' series and the errors.
    fn register_tool_series(&self, registry: &mut Registry) {
        registry.register(
            "execution_tool_calls",
            "Tool calls forwarded per execution that ended with a result",
            self.execution_tool_calls.clone(),
        );
        registry.register(
            "execution_output_bytes",
            "Bytes an execution returned to the client: stdout, stderr and the return value",
            self.execution_output_bytes.clone(),
        );
        registry.register(
            "execution_tool_result_bytes",
            "Bytes of the tool results the code received inside the sandbox, per execution",
            self.execution_tool_result_bytes.clone(),
        );
        registry.register(
            "tool_calls",
            "Tool calls made from inside executions, by tool and outcome (ok or the error code)",
            self.tool_calls.clone(),
        );
        registry.register(
            "tool_call_seconds",
            "Time from a tool call's request to its reply, by tool",
            self.tool_call_seconds.clone(),
        );
        registry.register(
            "errors",
            "Error messages sent to clients, by code",
            self.errors.clone(),
        );
    }

    fn count(&self, language: &str, reason: &str) {
        self.executions
            .get_or_create(&EndLabels {
                language: language.to_owned(),
                reason: reason.to_owned(),
            })
            .inc();
    }

    fn observe(family: &PerLanguage, language: &str, d: Duration) {
        family
            .get_or_create(&LangLabels {
                language: language.to_owned(),
            })
            .observe(d.as_secs_f64());
    }

    fn phases(&self) -> std::sync::MutexGuard<'_, HashMap<String, Phases>> {
        self.in_slot.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Sets the bytes of artifact blobs in the store (the collector's count).
    pub fn set_artifacts_bytes(&self, bytes: u64) {
        self.artifacts_bytes
            .set(i64::try_from(bytes).unwrap_or(i64::MAX));
    }

    /// A new blob of `bytes` entered the artifact store.
    pub fn artifact_stored(&self, bytes: u64) {
        self.artifacts_bytes
            .inc_by(i64::try_from(bytes).unwrap_or(i64::MAX));
    }

    /// Something a previous instance left behind was found at start.
    pub fn leftover(&self, kind: &str) {
        self.leftovers
            .get_or_create(&KindLabels {
                kind: kind.to_owned(),
            })
            .inc();
    }

    /// The `tool` label of `name` (see [`bounded_label`]).
    fn tool_label(&self, name: &str) -> String {
        let mut names = self.tool_names.lock().unwrap_or_else(|p| p.into_inner());
        bounded_label(&mut names, name, MAX_TOOL_SERIES)
    }

    /// The exposition text, with the admission and pool gauges as given (read at scrape time).
    pub fn encode(&self, now: Gauges) -> Result<String, std::fmt::Error> {
        let gauge = |n: usize| i64::try_from(n).unwrap_or(i64::MAX);
        self.queue_depth.set(gauge(now.queue_depth));
        self.slots_in_use.set(gauge(now.slots_in_use));
        self.slots.set(gauge(now.slots));
        self.pool_size.set(gauge(now.pool_size));
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry)?;
        Ok(out)
    }
}

/// An execution from its arrival until it gets a slot (or ends without one).
#[derive(Debug)]
pub struct ExecutionTimer {
    language: &'static str,
    arrived: Instant,
}

impl ExecutionTimer {
    /// An execution arrived.
    pub fn begin(language: Language) -> Self {
        Self {
            language: language.as_str(),
            arrived: Instant::now(),
        }
    }

    /// The execution got slot-bound container id `cid`: its queue wait is observed, and its phases are tracked
    /// under `cid` until [`finished`].
    pub fn slot_acquired(self, cid: &str) {
        let m = get();
        let now = Instant::now();
        Metrics::observe(&m.queue_wait, self.language, now - self.arrived);
        m.phases().insert(
            cid.to_owned(),
            Phases {
                language: self.language,
                arrived: self.arrived,
                slot: now,
                reason: None,
            },
        );
    }

    /// The execution ended without ever getting a slot: `overloaded`, `cancelled` (while queued) or `error`.
    pub fn ended_without_slot(self, reason: &'static str) {
        let m = get();
        m.count(self.language, reason);
        Metrics::observe(&m.total, self.language, self.arrived.elapsed());
    }
}

/// Container `cid` was created.
pub fn created(cid: &str) {
    let m = get();
    if let Some(p) = m.phases().get(cid) {
        Metrics::observe(&m.create, p.language, p.slot.elapsed());
    }
}

/// Container `cid`'s program ended after running for `ran`, for `reason`.
pub fn exited(cid: &str, reason: Reason, ran: Duration) {
    let m = get();
    if let Some(p) = m.phases().get_mut(cid) {
        Metrics::observe(&m.run, p.language, ran);
        p.reason = Some(reason.as_str());
    }
}

/// Container `cid`'s execution sent its last message: counted by its reason (`error` if it never got one).
pub fn finished(cid: &str) {
    let m = get();
    let Some(p) = m.phases().remove(cid) else {
        return;
    };
    let (reason, took) = (p.reason.unwrap_or("error"), p.arrived.elapsed());
    m.count(p.language, reason);
    Metrics::observe(&m.total, p.language, took);
    crate::observe::telemetry::metrics::execution_ended(p.language, reason, took);
}

/// `name` itself if it is among the first `max` names seen (remembered in `seen`), `_other` after.
fn bounded_label(seen: &mut std::collections::HashSet<String>, name: &str, max: usize) -> String {
    if seen.contains(name) || seen.len() < max {
        seen.insert(name.to_owned());
        return name.to_owned();
    }
    "_other".into()
}

/// Execution `key` concluded with a result: its tool calls and bytes are observed under its language.
pub fn concluded(key: &str, bytes: ExecutionBytes) {
    let m = get();
    let Some(language) = m.phases().get(key).map(|p| p.language) else {
        return;
    };
    let labels = LangLabels {
        language: language.to_owned(),
    };
    let observe = |f: &PerLanguage, v: u64| f.get_or_create(&labels).observe(v as f64);
    observe(&m.execution_tool_calls, bytes.tool_calls);
    observe(&m.execution_output_bytes, bytes.output_bytes);
    observe(&m.execution_tool_result_bytes, bytes.tool_result_bytes);
    crate::observe::telemetry::metrics::execution_concluded(
        language,
        bytes.tool_calls,
        bytes.output_bytes,
        bytes.tool_result_bytes,
    );
}

/// A tool call from inside an execution got its reply after `took`: `outcome` is `ok` or the error code the code
/// saw. `tool` is `None` for a tool the request did not list.
pub fn tool_call(tool: Option<&str>, outcome: &str, took: Duration) {
    let m = get();
    let tool = tool.map_or_else(|| "_unlisted".to_owned(), |t| m.tool_label(t));
    m.tool_calls
        .get_or_create(&ToolOutcomeLabels {
            tool: tool.clone(),
            outcome: outcome.to_owned(),
        })
        .inc();
    crate::observe::telemetry::metrics::tool_call(&tool, outcome, took);
    m.tool_call_seconds
        .get_or_create(&ToolLabels { tool })
        .observe(took.as_secs_f64());
}

/// An `error` message with `code` was sent to a client.
pub fn error_sent(code: ErrorCode) {
    crate::observe::telemetry::metrics::error_sent(code.as_str());
    get()
        .errors
        .get_or_create(&CodeLabels {
            code: code.as_str().to_owned(),
        })
        .inc();
}

/// Counts the mounts below `dir` (a previous instance's execution mounts would be there).
pub fn count_leftover_mounts(dir: &Path) {
    let Ok(text) = std::fs::read_to_string("/proc/self/mountinfo") else {
        return;
    };
    for line in text.lines() {
        // Field 5 is the mount point (octal-escaped; the state directory's path has no spaces to escape).
        if let Some(point) = line.split(' ').nth(4) {
            if Path::new(point).starts_with(dir) {
                get().leftover("mount");
            }
        }
    }
}

/// What the `/metrics` handler needs.
#[derive(Clone)]
struct MetricsState {
    source: Arc<dyn Source>,
}

/// `GET /metrics`, bearer-authenticated like every other endpoint.
pub fn router(source: Arc<dyn Source>) -> Router {
    Router::new()
        .route("/metrics", routing::get(metrics))
        .with_state(MetricsState { source })
}

async fn metrics(State(state): State<MetricsState>, headers: HeaderMap) -> Response {
    if !crate::auth::authorized(&headers, state.source.tokens()) {
        return (StatusCode::UNAUTHORIZED, "unauthorized\n").into_response();
    }
    match get().encode(state.source.gauges()) {
        Ok(text) => ([(header::CONTENT_TYPE, CONTENT_TYPE)], text).into_response(),
        Err(e) => {
            tracing::error!(error = %e, "cannot encode the metrics");
            (
                StatusCode::INTERNAL_SERVER_ERROR,
                "cannot encode the metrics\n",
            )
                .into_response()
        }
    }
}

/// Serves `/metrics` alone on `addr` until `stop` resolves.
pub async fn serve_separately(
    source: Arc<dyn Source>,
    addr: std::net::SocketAddr,
    stop: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<tokio::task::JoinHandle<std::io::Result<()>>> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    tracing::info!(addr = %listener.local_addr()?, "metrics listening");
    let app = router(source);
    Ok(tokio::spawn(async move {
        axum::serve(listener, app)
            .with_graceful_shutdown(stop)
            .await
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_execution_is_counted_once_by_its_reason_with_every_phase_observed() {
        // The counters are global and other unit tests run executions at the same time (the engine's, on shell):
        // elixir is a language no other unit test runs, so its count is this test's alone.
        let cid = "metrics-unit-1";
        let t = ExecutionTimer::begin(Language::Elixir);
        t.slot_acquired(cid);
        created(cid);
        exited(cid, Reason::Timeout, Duration::from_millis(30));
        concluded(
            cid,
            ExecutionBytes {
                tool_calls: 3,
                tool_result_bytes: 5000,
                output_bytes: 20,
            },
        );
        finished(cid);
        finished(cid); // a second call finds nothing and counts nothing
        concluded(cid, ExecutionBytes::default()); // nor does a conclusion after the end
        let labels = EndLabels {
            language: "elixir".into(),
            reason: "timeout".into(),
        };
        assert_eq!(get().executions.get_or_create(&labels).get(), 1);
        assert!(get().phases().get(cid).is_none());
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &get().registry).unwrap();
        for series in [
            "sandboxd_executions_total{language=\"elixir\",reason=\"timeout\"} 1",
            "sandboxd_queue_wait_seconds_count{language=\"elixir\"}",
            "sandboxd_create_seconds_count{language=\"elixir\"}",
            "sandboxd_run_seconds_count{language=\"elixir\"}",
            "sandboxd_total_seconds_count{language=\"elixir\"}",
            "sandboxd_execution_tool_calls_count{language=\"elixir\"} 1",
            "sandboxd_execution_tool_calls_sum{language=\"elixir\"} 3.0",
            // 3 calls: above the 2 bucket, within the 4 bucket.
            "sandboxd_execution_tool_calls_bucket{le=\"2.0\",language=\"elixir\"} 0",
            "sandboxd_execution_tool_calls_bucket{le=\"4.0\",language=\"elixir\"} 1",
            "sandboxd_execution_tool_result_bytes_sum{language=\"elixir\"} 5000.0",
            "sandboxd_execution_output_bytes_sum{language=\"elixir\"} 20.0",
            "sandboxd_execution_output_bytes_count{language=\"elixir\"} 1",
            "sandboxd_pool_size 0",
        ] {
            assert!(text.contains(series), "{series} missing from:\n{text}");
        }
    }

    /// Every series the sample dashboard and `docs/operations.md` name is one the daemon exposes.
    #[test]
    fn the_dashboard_and_the_operations_guide_name_only_exposed_series() {
        // Labelled families appear once they have a child: give each one.
        let cid = "metrics-unit-3";
        ExecutionTimer::begin(Language::Javascript).slot_acquired(cid);
        created(cid);
        exited(cid, Reason::Exited, Duration::from_millis(1));
        concluded(cid, ExecutionBytes::default());
        finished(cid);
        get().leftover("unit-test");
        tool_call(Some("unit_drift"), "ok", Duration::ZERO);
        error_sent(ErrorCode::InternalError);
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &get().registry).unwrap();
        let operations = include_str!("../../../docs/operations.md");
        let metrics_section = operations
            .split("## Metrics")
            .nth(1)
            .and_then(|s| s.split("\n## ").next())
            .expect("docs/operations.md has a Metrics section");
        let docs = [
            include_str!("../../../docs/grafana-dashboard.json"),
            metrics_section,
        ];
        let mut checked = 0;
        for doc in docs {
            for (i, _) in doc.match_indices("sandboxd_") {
                let name: String = doc[i..]
                    .chars()
                    .take_while(|c| c.is_ascii_lowercase() || *c == '_')
                    .collect();
                let base = ["_bucket", "_sum", "_count", "_total"]
                    .iter()
                    .find_map(|s| name.strip_suffix(s))
                    .unwrap_or(&name);
                if base == "sandboxd_" {
                    continue; // the prefix in prose
                }
                assert!(
                    text.contains(&format!("# TYPE {base} ")),
                    "{name} is not exposed:\n{text}"
                );
                checked += 1;
            }
        }
        assert!(
            checked > 20,
            "only {checked} series names found in the docs"
        );
    }

    #[test]
    fn tool_calls_and_errors_are_counted_with_bounded_labels() {
        tool_call(Some("unit_tool"), "ok", Duration::from_millis(3));
        tool_call(Some("unit_tool"), "timeout", Duration::from_millis(40));
        tool_call(None, "not_allowed", Duration::ZERO);
        error_sent(ErrorCode::LanguageNotSupported);
        let text = get().encode(Gauges::default()).unwrap();
        for series in [
            "sandboxd_tool_calls_total{tool=\"unit_tool\",outcome=\"ok\"} 1",
            "sandboxd_tool_calls_total{tool=\"unit_tool\",outcome=\"timeout\"} 1",
            "sandboxd_tool_call_seconds_count{tool=\"unit_tool\"} 2",
            "sandboxd_tool_call_seconds_sum{tool=\"unit_tool\"} 0.043",
            "sandboxd_tool_calls_total{tool=\"_unlisted\",outcome=\"not_allowed\"}",
            "sandboxd_errors_total{code=\"LANGUAGE_NOT_SUPPORTED\"} 1",
        ] {
            assert!(text.contains(series), "{series} missing from:\n{text}");
        }
        // Names come from clients: past the bound they share one label.
        let mut seen = std::collections::HashSet::new();
        for name in ["a", "b", "a"] {
            assert_eq!(bounded_label(&mut seen, name, 2), name);
        }
        assert_eq!(bounded_label(&mut seen, "c", 2), "_other");
        assert_eq!(bounded_label(&mut seen, "b", 2), "b");
    }

    #[test]
    fn an_execution_without_a_result_counts_as_error() {
        let cid = "metrics-unit-2";
        ExecutionTimer::begin(Language::Python).slot_acquired(cid);
        finished(cid);
        ExecutionTimer::begin(Language::Python).ended_without_slot("overloaded");
        for reason in ["error", "overloaded"] {
            let labels = EndLabels {
                language: "python".into(),
                reason: reason.into(),
            };
            assert_eq!(get().executions.get_or_create(&labels).get(), 1, "{reason}");
        }
    }
}

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
use protocol::{Language, Reason};

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

type Latency = Family<LangLabels, Histogram, fn() -> Histogram>;

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
    queue_wait: Latency,
    create: Latency,
    run: Latency,
    total: Latency,
    queue_depth: Gauge,
    slots_in_use: Gauge,
    slots: Gauge,
    pool_size: Gauge,
    artifacts_bytes: Gauge<i64, AtomicI64>,
    leftovers: Family<KindLabels, Counter>,
    start_time: Gauge<f64, AtomicU64>,
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
        let now = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .unwrap_or_default();
        m.start_time.set(now.as_secs_f64());
        Self { registry, ..m }
    }

    fn count(&self, language: &str, reason: &str) {
        self.executions
            .get_or_create(&EndLabels {
                language: language.to_owned(),
                reason: reason.to_owned(),
            })
            .inc();
    }

    fn observe(family: &Latency, language: &str, d: Duration) {
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
    m.count(p.language, p.reason.unwrap_or("error"));
    Metrics::observe(&m.total, p.language, p.arrived.elapsed());
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
        finished(cid);
        finished(cid); // a second call finds nothing and counts nothing
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
            "sandboxd_pool_size 0",
        ] {
            assert!(text.contains(series), "{series} missing from:\n{text}");
        }
    }

    /// Every series the sample dashboard and the README name is one the daemon exposes.
    #[test]
    fn the_dashboard_and_the_readme_name_only_exposed_series() {
        // Labelled families appear once they have a child: give each one.
        let cid = "metrics-unit-3";
        ExecutionTimer::begin(Language::Javascript).slot_acquired(cid);
        created(cid);
        exited(cid, Reason::Exited, Duration::from_millis(1));
        finished(cid);
        get().leftover("unit-test");
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &get().registry).unwrap();
        let readme = include_str!("../../README.md");
        let metrics_section = readme
            .split("## Metrics")
            .nth(1)
            .and_then(|s| s.split("\n## ").next())
            .expect("README has a Metrics section");
        let docs = [
            include_str!("../../docs/grafana-dashboard.json"),
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

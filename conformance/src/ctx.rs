//! What every case gets: the run's configuration, what the server announced in its first `pong`, helpers to
//! connect and build requests within the server's limits, and scenarios shared by several cases (run once).

use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{json, Value};
use tokio::sync::OnceCell;

use crate::client::{upgrade, Conn, Upgrade};
use crate::msgs;
use crate::observed::{CapacityObs, Posture};
use crate::stop::Stop;
use crate::wire::{short, Exec, LIMIT_NAMES};

/// How the suite is run.
#[derive(Debug, Clone)]
pub struct RunConfig {
    /// `ws://HOST:PORT/ws`.
    pub endpoint: String,
    /// A bearer token the endpoint accepts.
    pub token: String,
    /// SHOULD failures are failures.
    pub strict: bool,
    /// Multiplies every deadline of the suite (not the spec's own time bounds).
    pub timeout_scale: f64,
    /// An allowlist entry the endpoint's operator allows (extension `network`, e.g. `pypi.org:443`); without one
    /// the cases that need an accepted `network` request are skipped.
    pub network_allow: Option<String>,
}

/// What the server announced in the `pong` answering the suite's first `ping`.
#[derive(Debug, Clone, Default)]
pub struct ServerInfo {
    /// The whole pong.
    pub pong: Value,
    /// `capabilities.languages`, when announced.
    pub languages: Option<Vec<String>>,
    /// `capabilities.max_limits`, when announced.
    pub max_limits: Option<BTreeMap<String, u64>>,
    /// `capabilities.extensions`, when announced.
    pub extensions: Option<Vec<String>>,
    /// `capabilities.isolation`, when announced.
    pub isolation: Option<Value>,
}

impl ServerInfo {
    /// Reads the announcements of a pong (missing or malformed parts stay `None`; P.4.18 judges the form).
    pub fn from_pong(pong: Value) -> ServerInfo {
        let caps = &pong["capabilities"];
        let strings = |v: &Value| -> Option<Vec<String>> {
            v.as_array().map(|a| {
                a.iter()
                    .filter_map(|s| s.as_str().map(str::to_owned))
                    .collect()
            })
        };
        let max_limits = caps["max_limits"].as_object().map(|o| {
            o.iter()
                .filter_map(|(k, v)| v.as_u64().map(|n| (k.clone(), n)))
                .collect()
        });
        ServerInfo {
            languages: strings(&caps["languages"]),
            extensions: strings(&caps["extensions"]),
            isolation: caps.get("isolation").filter(|v| v.is_object()).cloned(),
            max_limits,
            pong,
        }
    }
}

/// A shared execution scenario, run at most once.
type Scenario = Arc<OnceCell<Result<Exec, Stop>>>;

/// The shared context of a run.
pub struct Ctx {
    /// The configuration.
    pub cfg: RunConfig,
    /// What the server announced.
    pub server: ServerInfo,
    nonce: String,
    seq: AtomicU64,
    execs: Mutex<HashMap<&'static str, Scenario>>,
    pub(crate) capacity: OnceCell<Result<CapacityObs, Stop>>,
    pub(crate) posture: OnceCell<Result<Posture, Stop>>,
}

/// The usual limits of a case's execution (lowered to the server's maximums when those are smaller).
pub const TIMEOUT_MS: u64 = 30_000;
/// See [`TIMEOUT_MS`].
pub const MEMORY_MB: u64 = 128;

impl Ctx {
    /// Connects once to learn what the server announces, and builds the context.
    pub async fn new(cfg: RunConfig) -> Result<Ctx, String> {
        let mut ctx = Ctx {
            cfg,
            server: ServerInfo::default(),
            nonce: format!(
                "{:06x}",
                std::process::id() ^ (now_nanos() as u32 & 0xff_ffff)
            ),
            seq: AtomicU64::new(0),
            execs: Mutex::new(HashMap::new()),
            capacity: OnceCell::new(),
            posture: OnceCell::new(),
        };
        let mut conn = ctx.connect().await.map_err(|s| s.message().to_owned())?;
        let pong = conn.ping(ctx.secs(10)).await.map_err(|s| {
            format!(
                "the server did not answer the suite's first ping: {}",
                s.message()
            )
        })?;
        ctx.server = ServerInfo::from_pong(pong.raw);
        conn.close().await;
        Ok(ctx)
    }

    /// A context that never connects (for `--dry-run` and unit tests).
    pub fn offline(cfg: RunConfig, server: ServerInfo) -> Ctx {
        Ctx {
            cfg,
            server,
            nonce: "offline".into(),
            seq: AtomicU64::new(0),
            execs: Mutex::new(HashMap::new()),
            capacity: OnceCell::new(),
            posture: OnceCell::new(),
        }
    }

    /// `d` multiplied by `--timeout-scale`.
    pub fn scaled(&self, d: Duration) -> Duration {
        d.mul_f64(self.cfg.timeout_scale.max(0.01))
    }

    /// `n` seconds, scaled.
    pub fn secs(&self, n: u64) -> Duration {
        self.scaled(Duration::from_secs(n))
    }

    /// How long to wait for the end of an execution whose timeout is `timeout_ms`.
    pub fn end_within(&self, timeout_ms: u64) -> Duration {
        self.scaled(Duration::from_millis(timeout_ms) + Duration::from_secs(15))
    }

    /// A fresh execution id with `tag` in it, unique in this run.
    pub fn id(&self, tag: &str) -> String {
        let n = self.seq.fetch_add(1, Ordering::Relaxed);
        format!("{tag}-{}-{n}", self.nonce)
    }

    /// A fresh marker of digits, for process command lines and file names.
    pub fn marker(&self) -> String {
        let n = self.seq.fetch_add(1, Ordering::Relaxed);
        format!("{}{:04}", now_nanos() % 1_000_000_000, n % 10_000)
    }

    /// Opens a connection with the run's token.
    pub async fn connect(&self) -> Result<Conn, Stop> {
        match upgrade(
            &self.cfg.endpoint,
            Some(&self.cfg.token),
            &[],
            self.secs(10),
        )
        .await?
        {
            Upgrade::Open(mut c) => {
                c.deadline = self.secs(10);
                Ok(*c)
            }
            Upgrade::Refused { status, body } => Err(Stop::Harness(format!(
                "the endpoint refused the upgrade with the token given (HTTP {status}: {})",
                body.chars().take(200).collect::<String>()
            ))),
        }
    }

    /// Whether the server announced `lang` (`None`: it announced no language list).
    pub fn has_language(&self, lang: &str) -> Option<bool> {
        self.server
            .languages
            .as_ref()
            .map(|l| l.iter().any(|x| x == lang))
    }

    /// `shell`, unless the server's language list leaves it out (then the case is skipped).
    pub fn shell(&self) -> Result<&'static str, Stop> {
        match self.has_language("shell") {
            Some(false) => Err(Stop::Skip(
                "shell is not in pong.capabilities.languages".into(),
            )),
            _ => Ok("shell"),
        }
    }

    /// `python`, when the server announces it (the case is skipped otherwise).
    pub fn python(&self) -> Result<&'static str, Stop> {
        match self.has_language("python") {
            Some(true) => Ok("python"),
            Some(false) => Err(Stop::Skip(
                "python is not in pong.capabilities.languages".into(),
            )),
            None => Err(Stop::Skip(
                "the server announces no pong.capabilities.languages".into(),
            )),
        }
    }

    /// Whether the server announced extension `name` (`None`: no extension list).
    pub fn extension(&self, name: &str) -> Option<bool> {
        self.server
            .extensions
            .as_ref()
            .map(|l| l.iter().any(|x| x == name))
    }

    /// The server's maximum of `limit`, when announced.
    pub fn max_limit(&self, limit: &str) -> Option<u64> {
        self.server
            .max_limits
            .as_ref()
            .and_then(|m| m.get(limit).copied())
    }

    /// `want`, lowered to the server's maximum of `limit` when that is smaller.
    pub fn fit(&self, limit: &str, want: u64) -> u64 {
        self.max_limit(limit).map_or(want, |m| want.min(m))
    }

    /// An `execute` with the usual limits.
    pub fn exec(&self, id: &str, lang: &str, code: &str) -> Value {
        msgs::execute(
            id,
            lang,
            code,
            self.fit("timeout_ms", TIMEOUT_MS),
            self.fit("memory_mb", MEMORY_MB),
        )
    }

    /// An `execute` with the usual limits and `extra` merged in (see [`msgs::with`]).
    pub fn exec_with(&self, id: &str, lang: &str, code: &str, extra: Value) -> Value {
        msgs::with(self.exec(id, lang, code), extra)
    }

    /// Sends `exec` (an `execute` with the usual limits) on `conn` and collects it to its end.
    pub async fn run(&self, conn: &mut Conn, exec: &Value) -> Result<Exec, Stop> {
        conn.run(exec, self.end_within(TIMEOUT_MS)).await
    }

    /// The server's `isolation` announcement.
    pub fn isolation(&self) -> Option<&Value> {
        self.server.isolation.as_ref()
    }

    /// The endpoint's host and port (for the network probe).
    pub fn endpoint_host_port(&self) -> (String, u16) {
        let url = self.cfg.endpoint.as_str();
        let (rest, default_port) = if let Some(r) = url.strip_prefix("wss://") {
            (r, 443)
        } else {
            (url.strip_prefix("ws://").unwrap_or(url), 80)
        };
        let authority = rest.split('/').next().unwrap_or(rest);
        if let Some(v6) = authority.strip_prefix('[') {
            let (host, tail) = v6.split_once(']').unwrap_or((v6, ""));
            let port = tail
                .strip_prefix(':')
                .and_then(|p| p.parse().ok())
                .unwrap_or(default_port);
            return (host.to_owned(), port);
        }
        match authority.rsplit_once(':') {
            Some((h, p)) => (h.to_owned(), p.parse().unwrap_or(default_port)),
            None => (authority.to_owned(), default_port),
        }
    }

    /// Runs the execution scenario `key` once per run (several cases judge the same execution) and returns it.
    pub async fn scenario<F, Fut>(&self, key: &'static str, make: F) -> Result<Exec, Stop>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<Exec, Stop>>,
    {
        let cell = {
            let mut map = self.execs.lock().unwrap_or_else(|p| p.into_inner());
            map.entry(key).or_default().clone()
        };
        cell.get_or_init(make).await.clone()
    }

    /// Polls `pong.load` on `conn` until it equals `want` (active, queued) or the deadline passes.
    pub async fn wait_load(
        &self,
        conn: &mut Conn,
        want: (u64, u64),
        within: Duration,
    ) -> Result<(), Stop> {
        let start = std::time::Instant::now();
        loop {
            let pong = conn.ping(self.secs(5)).await?;
            let load = load_of(&pong.raw);
            if load == Some(want) {
                return Ok(());
            }
            if start.elapsed() > within {
                return Err(Stop::Fail(format!(
                    "pong.load stayed {} for {within:?}, expected active_executions {} and queue_depth {}",
                    short(&pong.raw["load"]),
                    want.0,
                    want.1
                )));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// `(active_executions, queue_depth)` of a pong.
pub fn load_of(pong: &Value) -> Option<(u64, u64)> {
    Some((
        pong["load"]["active_executions"].as_u64()?,
        pong["load"]["queue_depth"].as_u64()?,
    ))
}

/// The limits object with every limit at the server's maximum (`None` when the maximums are not announced).
pub fn max_limits_json(ctx: &Ctx) -> Option<Value> {
    let mut o = serde_json::Map::new();
    for name in LIMIT_NAMES {
        o.insert((*name).to_owned(), json!(ctx.max_limit(name)?));
    }
    Some(Value::Object(o))
}

fn now_nanos() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ctx(url: &str) -> Ctx {
        Ctx::offline(
            RunConfig {
                endpoint: url.into(),
                token: "t".into(),
                strict: false,
                timeout_scale: 1.0,
                network_allow: None,
            },
            ServerInfo::default(),
        )
    }

    #[test]
    fn endpoints() {
        assert_eq!(
            ctx("ws://127.0.0.1:7070/ws").endpoint_host_port(),
            ("127.0.0.1".into(), 7070)
        );
        assert_eq!(
            ctx("ws://example.org/ws").endpoint_host_port(),
            ("example.org".into(), 80)
        );
        assert_eq!(
            ctx("wss://[::1]:9/ws").endpoint_host_port(),
            ("::1".into(), 9)
        );
    }

    #[test]
    fn ids_are_valid_and_unique() {
        let c = ctx("ws://x/ws");
        let a = c.id("P.3.1");
        assert_ne!(a, c.id("P.3.1"));
        assert!(protocol::is_valid_id(&a), "{a}");
        assert!(c.marker().bytes().all(|b| b.is_ascii_digit()));
    }
}

//! What a connection is opened with ([`ConnectOptions`]), how it reconnects ([`Backoff`]) and per-execution
//! options ([`ExecOptions`]).

use std::sync::Arc;
use std::time::Duration;

use tokio_tungstenite::tungstenite::client::IntoClientRequest;

use crate::auth::Auth;
use crate::error::ClientError;
use crate::tls;

/// The local daemon's default endpoint.
pub const DEFAULT_URL: &str = "ws://127.0.0.1:7070/ws";
/// The local daemon's default token file.
pub const DEFAULT_TOKEN_FILE: &str = "/var/lib/sandboxd/token";
/// Default time to open a connection (TCP, TLS and the WebSocket upgrade), as in the original design
/// (`docs/spec/fsp-v1.md`, Appendix A).
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Default largest WebSocket message accepted from the server (the daemon's default `max_frame_bytes`).
pub const DEFAULT_MAX_MESSAGE_BYTES: usize = 16 << 20;
/// Default slack of the client deadline over the execution's own `timeout_ms`.
pub const DEFAULT_DEADLINE_GRACE: Duration = Duration::from_secs(10);

/// Reconnect schedule of a connection whose link dropped: the first retry at once, then exponential backoff
/// from [`initial`](Self::initial) doubling up to [`max`](Self::max), at most [`max_retries`](Self::max_retries)
/// retries. Then the connection gives up ([`ConnectionStatus::Failed`](crate::ConnectionStatus::Failed)) and a
/// pool replaces it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backoff {
    /// Delay before the second retry.
    pub initial: Duration,
    /// Longest delay between two retries.
    pub max: Duration,
    /// Retries before giving up.
    pub max_retries: u32,
}

impl Backoff {
    /// The original design's schedule (`docs/spec/fsp-v1.md`, Appendix A): at once, then 100 ms, 200 ms, ... up
    /// to 30 s; 10 retries.
    pub const DEFAULT: Backoff = Backoff {
        initial: Duration::from_millis(100),
        max: Duration::from_secs(30),
        max_retries: 10,
    };

    /// The delay before retry `retry` (1-based): zero for the first, then `initial * 2^(retry - 2)`, capped at
    /// `max`.
    pub fn delay(&self, retry: u32) -> Duration {
        if retry <= 1 {
            return Duration::ZERO;
        }
        let factor = 1u32.checked_shl(retry - 2).unwrap_or(u32::MAX);
        self.initial.saturating_mul(factor).min(self.max)
    }
}

impl Default for Backoff {
    fn default() -> Self {
        Self::DEFAULT
    }
}

/// How to reach a sandboxd and what to do when the connection drops. Used by
/// [`Connection::connect`](crate::Connection::connect) and, through [`PoolBuilder`](crate::PoolBuilder), by every
/// pooled connection.
#[derive(Debug, Clone)]
pub struct ConnectOptions {
    pub(crate) url: String,
    pub(crate) auth: Auth,
    pub(crate) tls: Option<Arc<rustls::ClientConfig>>,
    pub(crate) connect_timeout: Duration,
    pub(crate) backoff: Backoff,
    pub(crate) max_message_bytes: usize,
    pub(crate) deadline_grace: Duration,
}

impl ConnectOptions {
    /// Options for `url` (`ws://` or `wss://`, e.g. [`DEFAULT_URL`]) with no token and the defaults.
    pub fn new(url: impl Into<String>) -> Self {
        ConnectOptions {
            url: url.into(),
            auth: Auth::None,
            tls: None,
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            backoff: Backoff::DEFAULT,
            max_message_bytes: DEFAULT_MAX_MESSAGE_BYTES,
            deadline_grace: DEFAULT_DEADLINE_GRACE,
        }
    }

    /// The endpoint.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// A static bearer token.
    pub fn token(mut self, token: impl Into<String>) -> Self {
        self.auth = Auth::token(token);
        self
    }

    /// How to authenticate (static token or a provider asked on every connection attempt).
    pub fn auth(mut self, auth: Auth) -> Self {
        self.auth = auth;
        self
    }

    /// The rustls configuration for `wss://` (default: webpki roots, ring provider). Build it with the re-exported
    /// [`rustls`], e.g. to trust a private CA.
    pub fn tls_config(mut self, config: Arc<rustls::ClientConfig>) -> Self {
        self.tls = Some(config);
        self
    }

    /// Time to open a connection: TCP, TLS and the WebSocket upgrade (default 5 s).
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// The reconnect schedule (default [`Backoff::DEFAULT`]).
    pub fn backoff(mut self, backoff: Backoff) -> Self {
        self.backoff = backoff;
        self
    }

    /// Largest WebSocket message accepted from the server (default 16 MiB); a larger one breaks the connection.
    pub fn max_message_bytes(mut self, bytes: usize) -> Self {
        self.max_message_bytes = bytes;
        self
    }

    /// Slack of the default client deadline over the execution's `timeout_ms` (default 10 s); see
    /// [`ExecOptions`].
    pub fn deadline_grace(mut self, grace: Duration) -> Self {
        self.deadline_grace = grace;
        self
    }

    /// Whether the endpoint is `wss://`.
    pub(crate) fn is_tls(&self) -> bool {
        self.url
            .get(..6)
            .is_some_and(|s| s.eq_ignore_ascii_case("wss://"))
    }

    /// Checks the URL and fills in the default TLS configuration for `wss://`.
    pub(crate) fn validated(mut self) -> Result<Arc<ConnectOptions>, ClientError> {
        let lower = self.url.to_ascii_lowercase();
        if !lower.starts_with("ws://") && !lower.starts_with("wss://") {
            return Err(ClientError::Config(format!(
                "URL {:?} must start with ws:// or wss://",
                self.url
            )));
        }
        self.url
            .as_str()
            .into_client_request()
            .map_err(|e| ClientError::Config(format!("URL {:?}: {e}", self.url)))?;
        if self.connect_timeout.is_zero() {
            return Err(ClientError::Config(
                "connect_timeout must be above zero".into(),
            ));
        }
        if self.is_tls() && self.tls.is_none() {
            self.tls = Some(tls::default_config()?);
        }
        Ok(Arc::new(self))
    }
}

/// When the client gives up on an execution.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
enum DeadlineSetting {
    /// `limits.timeout_ms` + the connection's deadline grace, counted from sending and counted again from
    /// `status: running` (so time spent queued on the server does not eat into the program's time).
    #[default]
    Default,
    /// This long after sending, whatever happens.
    After(Duration),
    /// None: wait for the server's terminal message however long it takes.
    Never,
}

/// Per-execution options. The client deadline, when it passes, sends `cancel` and fails the execution with
/// [`ClientError::Timeout`]; the daemon kills the program. By default it is `limits.timeout_ms` plus the
/// connection's [`deadline_grace`](ConnectOptions::deadline_grace), counted from sending the `execute` and again
/// from `status: running`: the daemon's own `timeout_ms` normally ends the execution first (as a `result` with
/// status `timeout`), and the client deadline catches a server that does not.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ExecOptions {
    deadline: DeadlineSetting,
}

impl ExecOptions {
    /// The defaults.
    pub fn new() -> Self {
        Self::default()
    }

    /// Give up (cancel, [`ClientError::Timeout`]) this long after sending the `execute`.
    pub fn deadline(mut self, after: Duration) -> Self {
        self.deadline = DeadlineSetting::After(after);
        self
    }

    /// No client deadline.
    pub fn no_deadline(mut self) -> Self {
        self.deadline = DeadlineSetting::Never;
        self
    }

    /// The deadline counted from sending, and the one counted again from `status: running`, for an execution
    /// with `timeout_ms`.
    pub(crate) fn deadlines(
        &self,
        timeout_ms: u64,
        grace: Duration,
    ) -> (Option<Duration>, Option<Duration>) {
        match self.deadline {
            DeadlineSetting::Default => {
                let d = Duration::from_millis(timeout_ms).saturating_add(grace);
                (Some(d), Some(d))
            }
            DeadlineSetting::After(d) => (Some(d), None),
            DeadlineSetting::Never => (None, None),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_schedule_is_the_original_designs() {
        let b = Backoff::DEFAULT;
        let delays: Vec<u64> = (1..=b.max_retries)
            .map(|r| b.delay(r).as_millis() as u64)
            .collect();
        assert_eq!(
            delays,
            [0, 100, 200, 400, 800, 1600, 3200, 6400, 12_800, 25_600]
        );
        assert_eq!(b.delay(11), Duration::from_secs(30));
        assert_eq!(b.delay(40), Duration::from_secs(30));
        assert_eq!(b.delay(u32::MAX), Duration::from_secs(30));
    }

    #[test]
    fn urls_are_checked() {
        assert!(ConnectOptions::new("ws://127.0.0.1:7070/ws")
            .validated()
            .is_ok());
        let tls = ConnectOptions::new("wss://sandbox.example.com/ws")
            .validated()
            .unwrap();
        assert!(tls.tls.is_some());
        for bad in ["http://x/ws", "127.0.0.1:7070", "ws://"] {
            let err = ConnectOptions::new(bad).validated().unwrap_err();
            assert!(matches!(err, ClientError::Config(_)), "{bad}: {err}");
        }
    }

    #[test]
    fn deadlines() {
        let g = Duration::from_secs(10);
        assert_eq!(
            ExecOptions::new().deadlines(5000, g),
            (Some(Duration::from_secs(15)), Some(Duration::from_secs(15)))
        );
        assert_eq!(
            ExecOptions::new()
                .deadline(Duration::from_secs(1))
                .deadlines(5000, g),
            (Some(Duration::from_secs(1)), None)
        );
        assert_eq!(
            ExecOptions::new().no_deadline().deadlines(5000, g),
            (None, None)
        );
    }
}

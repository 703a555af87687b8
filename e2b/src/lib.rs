//! E2B's API on sandboxd (`docs/spec/e2b-compat.md`): the unchanged `e2b` SDKs (Python and JavaScript) pointed at
//! a facade listener with `E2B_API_URL` and `E2B_SANDBOX_URL` drive sandboxd's sandboxes.
//!
//! - [`api`]: the control plane (`POST /v2/sandboxes`, `GET /sandboxes/{id}`, list, kill, timeout, connect,
//!   pause), `X-API-KEY` checked against the daemon's tokens.
//! - [`envd`]: the sandbox plane, routed by `E2b-Sandbox-Id`: envd's Connect RPCs (`process.Process`,
//!   `filesystem.Filesystem`), `/files` and `/health`, each call checked against the sandbox's own access token.
//! - [`connect`]: the Connect protocol's JSON codec: envelopes, unary and server-stream answers, error codes.
//! - [`contexts`]: stateful code contexts (`e2b-code-interpreter`'s `run_code`): a kernel process per context
//!   inside the sandbox, python, javascript and bash.
//! - [`files`]: file calls resolved beneath the sandbox's own root, never the host's.
//! - [`engine`]: what the facade needs from the daemon: live sandboxes that run many processes.
//! - [`config`]: the `e2b:` configuration block.
//! - [`fleet`]: many nodes behind one URL: forwarding by sandbox id, placement, lists across the nodes.
//! - [`listing`]: `GET /v2/sandboxes`' filters, order and page tokens, shared by the nodes of a fleet.
//! - [`reply`]: E2B's JSON answers and its error form.
//! - [`sandboxes`]: the engine on the agents' container seam, one long-lived container per sandbox whose init
//!   serves process launches.

pub mod api;
pub mod config;
pub mod connect;
pub mod contexts;
pub mod engine;
pub mod envd;
pub mod files;
pub mod fleet;
pub mod listing;
pub mod reply;
pub mod router;
pub mod sandboxes;

pub use router::router;

/// The `envdVersion` the facade advertises: the SDK turns its features on by it (`docs/spec/e2b-compat.md`).
pub const ENVD_VERSION: &str = "0.5.7";

/// `bytes` random bytes as lowercase hex: sandbox ids' suffixes, access tokens (32 bytes), context ids.
pub(crate) fn random_hex(bytes: usize) -> String {
    use rand::RngCore;
    let mut buf = vec![0u8; bytes];
    rand::thread_rng().fill_bytes(&mut buf);
    buf.iter().map(|b| format!("{b:02x}")).collect()
}

/// A mutex's guard, also after a panic while it was held (the data guarded stays consistent step by step).
pub(crate) fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The header that names the sandbox of a sandbox-plane request.
pub const SANDBOX_ID_HEADER: &str = "e2b-sandbox-id";

/// What the facade serves from: the daemon's engine and its settings.
#[derive(Clone)]
pub struct Facade {
    /// The sandboxes.
    pub engine: std::sync::Arc<dyn engine::Engine>,
    /// Whether an `X-API-KEY` value is accepted (the daemon's tokens).
    pub api_key: std::sync::Arc<dyn Fn(&str) -> bool + Send + Sync>,
    /// The largest `POST /files` request, in bytes of file content written (after gzip decoding); past it the
    /// answer is 413.
    pub max_upload_bytes: u64,
    /// The other nodes whose sandboxes this listener serves too; `None`: this node alone.
    pub fleet: Option<std::sync::Arc<fleet::Fleet>>,
}

impl std::fmt::Debug for Facade {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Facade")
            .field("max_upload_bytes", &self.max_upload_bytes)
            .finish_non_exhaustive()
    }
}

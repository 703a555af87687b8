//! What scenarios shared by several cases observed ([`CapacityObs`], [`Posture`]): plain data, memoised in the
//! [`crate::ctx::Ctx`] and read by the cases. Defined here so that the context does not depend on the cases.

use std::time::Duration;

use serde_json::Value;

use crate::stop::Stop;

/// What the capacity scenario observed.
#[derive(Debug, Clone)]
pub struct CapacityObs {
    /// Executions that ran at once.
    pub max_concurrent: u64,
    /// Executions acknowledged beyond those.
    pub max_queue: u64,
    /// The `SANDBOX_OVERLOADED` error (or whatever refused the saturating execute), with its execute's id.
    pub refusal: Option<(String, Value)>,
    /// Time from sending the refused execute to its refusal.
    pub refusal_latency: Duration,
    /// P.6.4: whether pong.load matched what was observed.
    pub load_truthful: Result<String, String>,
    /// P.6.5.
    pub queued_started: Result<String, Stop>,
    /// P.6.8.
    pub retry_accepted: Result<String, Stop>,
    /// P.6.6.
    pub queued_cancel: Result<String, Stop>,
    /// P.6.7.
    pub load_back: Result<String, String>,
    /// P.6.10: which queued execution started first.
    pub queue_order: Option<String>,
}

/// What the probes reported.
#[derive(Debug, Clone, Default)]
pub struct Posture {
    /// The shell probe's report, or why there is none.
    pub shell: Option<Result<Value, String>>,
    /// The python probe's report, or why there is none.
    pub python: Option<Result<Value, String>>,
    /// Two reports of the same probe from executions that ran at the same time (for namespace freshness).
    pub pair: Option<(Value, Value)>,
}

impl Posture {
    /// The first report available (python first: it reports more).
    pub fn any(&self) -> Result<&Value, Stop> {
        if let Some(v) = [&self.python, &self.shell]
            .into_iter()
            .flatten()
            .flatten()
            .next()
        {
            return Ok(v);
        }
        let why: Vec<String> = [&self.python, &self.shell]
            .into_iter()
            .flatten()
            .filter_map(|r| r.as_ref().err().cloned())
            .collect();
        Err(Stop::Harness(format!("no probe reported: {why:?}")))
    }
}

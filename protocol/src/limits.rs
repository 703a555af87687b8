//! Resource limits: what `execute` asks for, the defaults, and the limits in effect (spec section 3).
//!
//! A requested value above the server's maximum is refused, never clamped, and so is 0.

use std::hash::{Hash, Hasher};

use serde::{Deserialize, Serialize};

use crate::error::RequestError;

/// The limits in effect for one execution (sent in `ack.limits`), or a server's maximums (`pong`'s
/// `capabilities.max_limits`). Every value is at least 1.
///
/// Unknown fields are ignored when parsing, as a client must tolerate fields a server adds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Limits {
    /// Wall-clock time before the execution is killed with status `timeout`.
    pub timeout_ms: u64,
    /// Memory limit of the execution's cgroup, in MiB.
    pub memory_mb: u64,
    /// Relative CPU weight.
    pub cpu_shares: u64,
    /// Bytes of stdout and stderr together before the execution is killed (`output_limit`).
    pub max_output_bytes: u64,
    /// Maximum number of processes and threads.
    pub pids_max: u64,
    /// Size of the writable scratch space, in MiB.
    pub disk_mb: u64,
    /// Hard CPU limit, in cores (a CFS quota; extension `cpu_cores`). Absent from a server without the extension.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu_cores: Option<CpuCores>,
}

/// A hard CPU limit in cores, e.g. `0.5` for half of one core: a finite number of at least [`CpuCores::MIN`].
///
/// On the wire a plain JSON number; a value out of range is refused when parsed.
#[derive(Debug, Clone, Copy, PartialEq, PartialOrd, Serialize, Deserialize)]
#[serde(try_from = "f64", into = "f64")]
pub struct CpuCores(f64);

impl CpuCores {
    /// The smallest limit: 1 ms of CPU time per 100 ms period, the kernel's smallest CFS quota.
    pub const MIN: f64 = 0.01;

    /// `cores` if it is a finite number of at least [`Self::MIN`].
    pub fn new(cores: f64) -> Option<Self> {
        (cores.is_finite() && cores >= Self::MIN).then_some(Self(cores))
    }

    /// `cores` unchecked, for constants; the caller keeps it finite and at least [`Self::MIN`].
    pub const fn from_const(cores: f64) -> Self {
        Self(cores)
    }

    /// The number of cores.
    pub const fn get(self) -> f64 {
        self.0
    }
}

impl TryFrom<f64> for CpuCores {
    type Error = String;

    fn try_from(cores: f64) -> Result<Self, String> {
        Self::new(cores)
            .ok_or_else(|| format!("must be a number of cores of at least {}", Self::MIN))
    }
}

impl From<CpuCores> for f64 {
    fn from(c: CpuCores) -> f64 {
        c.0
    }
}

impl std::fmt::Display for CpuCores {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

// Never NaN (refused on construction), so equality is reflexive; 0.0 and -0.0 are refused too, so equal values
// have equal bits.
impl Eq for CpuCores {}

impl Hash for CpuCores {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.0.to_bits().hash(state);
    }
}

/// Defaults for the limits `execute` may leave out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct LimitDefaults {
    /// Default [`Limits::cpu_shares`].
    pub cpu_shares: u64,
    /// Default [`Limits::max_output_bytes`] (1 MiB).
    pub max_output_bytes: u64,
    /// Default [`Limits::pids_max`].
    pub pids_max: u64,
    /// Default [`Limits::disk_mb`].
    pub disk_mb: u64,
}

impl Limits {
    /// The spec's defaults for the optional limits. `timeout_ms` and `memory_mb` have none: they are required.
    pub const DEFAULTS: LimitDefaults = LimitDefaults {
        cpu_shares: 512,
        max_output_bytes: 1024 * 1024,
        pids_max: 64,
        disk_mb: 64,
    };

    /// Every limit's wire name, in declaration order: the integer limits of [`Self::entries`], then `cpu_cores`.
    pub const NAMES: [&'static str; 7] = [
        "timeout_ms",
        "memory_mb",
        "cpu_shares",
        "max_output_bytes",
        "pids_max",
        "disk_mb",
        "cpu_cores",
    ];

    /// Sets the integer limit named `name` (a wire name) to `value`; `false` if no integer limit has that name.
    pub fn set(&mut self, name: &str, value: u64) -> bool {
        let field = match name {
            "timeout_ms" => &mut self.timeout_ms,
            "memory_mb" => &mut self.memory_mb,
            "cpu_shares" => &mut self.cpu_shares,
            "max_output_bytes" => &mut self.max_output_bytes,
            "pids_max" => &mut self.pids_max,
            "disk_mb" => &mut self.disk_mb,
            _ => return false,
        };
        *field = value;
        true
    }

    /// Each integer limit with its wire name, in declaration order (every limit but `cpu_cores`).
    pub const fn entries(&self) -> [(&'static str, u64); 6] {
        let n = Self::NAMES;
        [
            (n[0], self.timeout_ms),
            (n[1], self.memory_mb),
            (n[2], self.cpu_shares),
            (n[3], self.max_output_bytes),
            (n[4], self.pids_max),
            (n[5], self.disk_mb),
        ]
    }
}

/// The `limits` object of an `execute`. Unknown fields are refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields, expecting = "a limits object")]
pub struct RequestedLimits {
    /// Required wall-clock limit in milliseconds.
    pub timeout_ms: u64,
    /// Required memory limit in MiB.
    pub memory_mb: u64,
    /// CPU weight; default [`LimitDefaults::cpu_shares`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu_shares: Option<u64>,
    /// Output limit (stdout and stderr together); default [`LimitDefaults::max_output_bytes`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_output_bytes: Option<u64>,
    /// Process limit; default [`LimitDefaults::pids_max`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pids_max: Option<u64>,
    /// Scratch space in MiB; default [`LimitDefaults::disk_mb`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disk_mb: Option<u64>,
    /// Hard CPU limit in cores (extension `cpu_cores`); default the server's maximum.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu_cores: Option<CpuCores>,
}

impl RequestedLimits {
    /// Only the two required limits; the rest take their defaults.
    pub const fn new(timeout_ms: u64, memory_mb: u64) -> Self {
        RequestedLimits {
            timeout_ms,
            memory_mb,
            cpu_shares: None,
            max_output_bytes: None,
            pids_max: None,
            disk_mb: None,
            cpu_cores: None,
        }
    }

    /// The limits in effect: defaults filled in, then every value checked against `max`.
    ///
    /// Refuses 0 and any value above its maximum (naming the limit and the maximum); never clamps. `cpu_cores`
    /// defaults to `max.cpu_cores`; a `max` without one (a server that does not enforce it) refuses a request
    /// that asks for it rather than ignoring it.
    pub fn resolve(&self, max: &Limits) -> Result<Limits, LimitError> {
        let defaults = Limits::DEFAULTS;
        let limits = Limits {
            timeout_ms: self.timeout_ms,
            memory_mb: self.memory_mb,
            cpu_shares: self.cpu_shares.unwrap_or(defaults.cpu_shares),
            max_output_bytes: self.max_output_bytes.unwrap_or(defaults.max_output_bytes),
            pids_max: self.pids_max.unwrap_or(defaults.pids_max),
            disk_mb: self.disk_mb.unwrap_or(defaults.disk_mb),
            cpu_cores: self.cpu_cores.or(max.cpu_cores),
        };
        for ((limit, value), (_, max)) in limits.entries().into_iter().zip(max.entries()) {
            if value == 0 {
                return Err(LimitError::Zero { limit });
            }
            if value > max {
                return Err(LimitError::AboveMaximum { limit, value, max });
            }
        }
        match (limits.cpu_cores, max.cpu_cores) {
            (Some(value), Some(max)) if value > max => {
                Err(LimitError::CoresAboveMaximum { value, max })
            }
            (Some(_), None) => Err(LimitError::NotEnforced { limit: "cpu_cores" }),
            _ => Ok(limits),
        }
    }
}

/// A requested limit the server refuses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum LimitError {
    /// The limit is 0.
    #[error("Field limits.{limit} must be greater than 0")]
    Zero {
        /// Wire name of the limit, e.g. `memory_mb`.
        limit: &'static str,
    },
    /// The limit is above the server's configured maximum.
    #[error("Field limits.{limit} {value} exceeds the maximum {max}")]
    AboveMaximum {
        /// Wire name of the limit, e.g. `memory_mb`.
        limit: &'static str,
        /// The requested value, or the default when the request left the limit out.
        value: u64,
        /// The server's maximum.
        max: u64,
    },
    /// `cpu_cores` is above the server's configured maximum.
    #[error("Field limits.cpu_cores {value} exceeds the maximum {max}")]
    CoresAboveMaximum {
        /// The requested value.
        value: CpuCores,
        /// The server's maximum.
        max: CpuCores,
    },
    /// The server has no maximum for the limit: it does not enforce it.
    #[error("Field limits.{limit} is not enforced by this server")]
    NotEnforced {
        /// Wire name of the limit.
        limit: &'static str,
    },
}

impl LimitError {
    /// Wire name of the refused limit.
    pub const fn limit(&self) -> &'static str {
        match self {
            LimitError::Zero { limit }
            | LimitError::AboveMaximum { limit, .. }
            | LimitError::NotEnforced { limit } => limit,
            LimitError::CoresAboveMaximum { .. } => "cpu_cores",
        }
    }

    /// The `INVALID_REQUEST` error for the execution `id`.
    pub fn into_request_error(self, id: &str) -> RequestError {
        RequestError::invalid(Some(id.to_owned()), self.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MAX: Limits = Limits {
        timeout_ms: 60_000,
        memory_mb: 1024,
        cpu_shares: 1024,
        max_output_bytes: 8 * 1024 * 1024,
        pids_max: 256,
        disk_mb: 512,
        cpu_cores: Some(CpuCores::from_const(2.0)),
    };

    #[test]
    fn resolve_fills_defaults() {
        let limits = RequestedLimits::new(30_000, 256).resolve(&MAX).unwrap();
        assert_eq!(
            limits,
            Limits {
                timeout_ms: 30_000,
                memory_mb: 256,
                cpu_shares: 512,
                max_output_bytes: 1_048_576,
                pids_max: 64,
                disk_mb: 64,
                cpu_cores: MAX.cpu_cores,
            }
        );
        let exact = RequestedLimits {
            timeout_ms: MAX.timeout_ms,
            memory_mb: MAX.memory_mb,
            cpu_shares: Some(MAX.cpu_shares),
            max_output_bytes: Some(MAX.max_output_bytes),
            pids_max: Some(MAX.pids_max),
            disk_mb: Some(MAX.disk_mb),
            cpu_cores: MAX.cpu_cores,
        };
        assert_eq!(exact.resolve(&MAX).unwrap(), MAX);
    }

    #[test]
    fn resolve_refuses_above_maximum_without_clamping() {
        let err = RequestedLimits::new(30_000, 4096)
            .resolve(&MAX)
            .unwrap_err();
        assert_eq!(
            err,
            LimitError::AboveMaximum {
                limit: "memory_mb",
                value: 4096,
                max: 1024
            }
        );
        assert_eq!(
            err.to_string(),
            "Field limits.memory_mb 4096 exceeds the maximum 1024"
        );
        let req = RequestedLimits {
            pids_max: Some(257),
            ..RequestedLimits::new(1, 1)
        };
        assert_eq!(req.resolve(&MAX).unwrap_err().limit(), "pids_max");
        // A default above a small maximum is refused too: the client did not ask for less.
        let small = Limits { disk_mb: 32, ..MAX };
        let err = RequestedLimits::new(1, 1).resolve(&small).unwrap_err();
        assert_eq!(
            err.to_string(),
            "Field limits.disk_mb 64 exceeds the maximum 32"
        );
    }

    #[test]
    fn resolve_refuses_zero() {
        let cases: [(RequestedLimits, &str); 6] = [
            (RequestedLimits::new(0, 1), "timeout_ms"),
            (RequestedLimits::new(1, 0), "memory_mb"),
            (
                RequestedLimits {
                    cpu_shares: Some(0),
                    ..RequestedLimits::new(1, 1)
                },
                "cpu_shares",
            ),
            (
                RequestedLimits {
                    max_output_bytes: Some(0),
                    ..RequestedLimits::new(1, 1)
                },
                "max_output_bytes",
            ),
            (
                RequestedLimits {
                    pids_max: Some(0),
                    ..RequestedLimits::new(1, 1)
                },
                "pids_max",
            ),
            (
                RequestedLimits {
                    disk_mb: Some(0),
                    ..RequestedLimits::new(1, 1)
                },
                "disk_mb",
            ),
        ];
        for (req, name) in cases {
            let err = req.resolve(&MAX).unwrap_err();
            assert_eq!(err, LimitError::Zero { limit: name });
            assert_eq!(
                err.to_string(),
                format!("Field limits.{name} must be greater than 0")
            );
            let req_err = err.into_request_error("exec_1");
            assert_eq!(req_err.id.as_deref(), Some("exec_1"));
            assert_eq!(req_err.code, crate::ErrorCode::InvalidRequest);
        }
    }

    #[test]
    fn cpu_cores_defaults_to_the_maximum_and_is_refused_above_it() {
        let half: RequestedLimits =
            serde_json::from_str(r#"{"timeout_ms":1,"memory_mb":1,"cpu_cores":0.5}"#).unwrap();
        let limits = half.resolve(&MAX).unwrap();
        assert_eq!(limits.cpu_cores.map(CpuCores::get), Some(0.5));
        assert_eq!(
            serde_json::to_value(limits).unwrap()["cpu_cores"],
            serde_json::json!(0.5)
        );
        let default = RequestedLimits::new(1, 1).resolve(&MAX).unwrap();
        assert_eq!(default.cpu_cores, MAX.cpu_cores);
        let over = RequestedLimits {
            cpu_cores: CpuCores::new(2.5),
            ..RequestedLimits::new(1, 1)
        };
        let err = over.resolve(&MAX).unwrap_err();
        assert_eq!(err.limit(), "cpu_cores");
        assert_eq!(
            err.to_string(),
            "Field limits.cpu_cores 2.5 exceeds the maximum 2"
        );
        // A server without a maximum does not enforce the limit: asking for it is refused, leaving it out is not.
        let plain = Limits {
            cpu_cores: None,
            ..MAX
        };
        assert_eq!(
            over.resolve(&plain).unwrap_err(),
            LimitError::NotEnforced { limit: "cpu_cores" }
        );
        assert_eq!(
            RequestedLimits::new(1, 1)
                .resolve(&plain)
                .unwrap()
                .cpu_cores,
            None
        );
    }

    #[test]
    fn cpu_cores_below_the_kernel_minimum_does_not_parse() {
        for bad in ["0", "-1", "0.001"] {
            let json = format!(r#"{{"timeout_ms":1,"memory_mb":1,"cpu_cores":{bad}}}"#);
            let err = serde_json::from_str::<RequestedLimits>(&json).unwrap_err();
            assert!(err.to_string().contains("at least 0.01"), "{bad}: {err}");
        }
        assert_eq!(CpuCores::new(0.01).map(CpuCores::get), Some(0.01));
        assert_eq!(CpuCores::new(f64::NAN), None);
        // An old server's ack has no cpu_cores.
        let ack: Limits = serde_json::from_str(
            r#"{"timeout_ms":1,"memory_mb":1,"cpu_shares":2,"max_output_bytes":1,"pids_max":1,"disk_mb":1}"#,
        )
        .unwrap();
        assert_eq!(ack.cpu_cores, None);
    }
}

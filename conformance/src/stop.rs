//! [`Stop`]: why a case stopped without passing. A leaf module: the framework, the context and the client all
//! speak it, and none of them needs the others for it.

/// Why a case stopped without passing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Stop {
    /// The implementation does not do what the case checks.
    Fail(String),
    /// The case does not apply to this implementation.
    Skip(String),
    /// The suite could not carry out the case.
    Harness(String),
}

impl Stop {
    /// The explanation.
    pub fn message(&self) -> &str {
        match self {
            Stop::Fail(m) | Stop::Skip(m) | Stop::Harness(m) => m,
        }
    }
}

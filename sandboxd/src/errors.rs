//! Error chains: an error and every `source()` under it, as one line, for logs and `INTERNAL_ERROR` messages.
//!
//! Typed errors here follow the house rule that a message does not repeat its source; whoever shows an error to a
//! person (a log line, the wire message of an `INTERNAL_ERROR`, the daemon's exit message) shows the whole chain.

use std::error::Error;
use std::fmt;

/// Displays an error followed by each of its sources, separated by `": "`.
pub struct Chain<'a>(pub &'a (dyn Error + 'a));

impl fmt::Display for Chain<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)?;
        let mut next = self.0.source();
        while let Some(e) = next {
            write!(f, ": {e}")?;
            next = e.source();
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("Outer")]
    struct Outer(#[source] std::io::Error);

    #[test]
    fn every_source_is_shown_in_order() {
        let e = Outer(std::io::Error::other("inner"));
        assert_eq!(Chain(&e).to_string(), "Outer: inner");
    }
}

//! The languages an `execute` may ask for (spec section 3).

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// A language FSP/1 knows. Whether this server can run it is the daemon's decision (`pong.capabilities`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Language {
    /// `python`
    Python,
    /// `javascript`
    Javascript,
    /// `shell`
    Shell,
    /// `elixir`
    Elixir,
}

impl Language {
    /// Every language FSP/1 names, in the spec's order.
    pub const ALL: [Language; 4] = [
        Language::Python,
        Language::Javascript,
        Language::Shell,
        Language::Elixir,
    ];

    /// The wire spelling, e.g. `python`.
    pub const fn as_str(self) -> &'static str {
        match self {
            Language::Python => "python",
            Language::Javascript => "javascript",
            Language::Shell => "shell",
            Language::Elixir => "elixir",
        }
    }
}

impl fmt::Display for Language {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Language {
    type Err = UnknownLanguage;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Language::ALL
            .into_iter()
            .find(|l| l.as_str() == s)
            .ok_or_else(|| UnknownLanguage(s.to_owned()))
    }
}

/// A language name FSP/1 does not know.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("Unknown language {0:?}")]
pub struct UnknownLanguage(pub String);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for lang in Language::ALL {
            assert_eq!(lang.as_str().parse::<Language>().unwrap(), lang);
            assert_eq!(serde_json::to_string(&lang).unwrap(), format!("\"{lang}\""));
        }
        assert_eq!(
            "Python".parse::<Language>(),
            Err(UnknownLanguage("Python".into()))
        );
        assert_eq!(
            "rust".parse::<Language>().unwrap_err().to_string(),
            "Unknown language \"rust\""
        );
    }
}

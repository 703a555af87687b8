//! Allowlist entries (`pypi.org:443`, `*.pythonhosted.org:443`, `api.example.com`), their normalisation, matching
//! and the operator's bound (`allow_max`).

use std::fmt;
use std::net::IpAddr;

use thiserror::Error;

/// The ports an entry without a port allows.
pub const DEFAULT_PORTS: [u16; 2] = [443, 80];

/// Why an allowlist entry was refused. Every variant names the entry as it was written.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum AllowlistError {
    /// The entry is an IP address: only names are listed, so the proxy resolves them itself.
    #[error("Allowlist entry `{0}` is an IP literal; list a host name")]
    IpLiteral(String),
    /// The port is not a number from 1 to 65535.
    #[error("Allowlist entry `{0}` has an invalid port")]
    BadPort(String),
    /// `*` appears other than as a whole first label (`*.example.com`).
    #[error("Allowlist entry `{0}` has a wildcard other than a leading `*.`")]
    BadWildcard(String),
    /// The host is not a valid DNS name after IDNA processing.
    #[error("Allowlist entry `{0}` is not a valid host name")]
    BadHost(String),
    /// The entry is wider than every entry of the operator's bound.
    #[error("Allowlist entry `{0}` is not covered by the operator's allow_max")]
    NotCovered(String),
}

/// A host pattern: one name, or every name strictly below a suffix.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HostPattern {
    /// Exactly this (normalised, ASCII, lower-case) name.
    Exact(String),
    /// One or more labels below this suffix, never the suffix itself.
    Subdomains(String),
}

impl HostPattern {
    /// Whether a normalised host name matches.
    pub fn matches(&self, host: &str) -> bool {
        match self {
            HostPattern::Exact(name) => host == name,
            HostPattern::Subdomains(suffix) => is_strictly_below(host, suffix),
        }
    }

    /// Whether every name this pattern matches is also matched by `wider`.
    fn within(&self, wider: &HostPattern) -> bool {
        match (self, wider) {
            (HostPattern::Exact(a), HostPattern::Exact(b)) => a == b,
            (HostPattern::Exact(a), HostPattern::Subdomains(s)) => is_strictly_below(a, s),
            (HostPattern::Subdomains(_), HostPattern::Exact(_)) => false,
            (HostPattern::Subdomains(a), HostPattern::Subdomains(s)) => {
                a == s || is_strictly_below(a, s)
            }
        }
    }
}

fn is_strictly_below(host: &str, suffix: &str) -> bool {
    host.len() > suffix.len() + 1
        && host.ends_with(suffix)
        && host.as_bytes()[host.len() - suffix.len() - 1] == b'.'
}

/// One parsed entry: a host pattern and the ports it allows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    /// The hosts this entry allows.
    pub host: HostPattern,
    /// The ports this entry allows (443 and 80 when the entry named none).
    pub ports: Vec<u16>,
}

impl Entry {
    /// Parses one entry (`host`, `host:port`, `*.suffix` or `*.suffix:port`).
    pub fn parse(entry: &str) -> Result<Entry, AllowlistError> {
        let bad_host = || AllowlistError::BadHost(entry.to_string());
        if entry.starts_with('[') || entry.parse::<IpAddr>().is_ok() {
            return Err(AllowlistError::IpLiteral(entry.to_string()));
        }
        let (host, ports) = match entry.rsplit_once(':') {
            Some((host, port)) => {
                let port = port
                    .parse::<u16>()
                    .ok()
                    .filter(|p| *p != 0 && port.bytes().all(|b| b.is_ascii_digit()))
                    .ok_or_else(|| AllowlistError::BadPort(entry.to_string()))?;
                (host, vec![port])
            }
            None => (entry, DEFAULT_PORTS.to_vec()),
        };
        let (wildcard, name) = match host.strip_prefix("*.") {
            Some(rest) => (true, rest),
            None => (false, host),
        };
        if name.contains('*') {
            return Err(AllowlistError::BadWildcard(entry.to_string()));
        }
        let name = normalise_entry_host(name).map_err(|e| match e {
            HostError::IpLiteral => AllowlistError::IpLiteral(entry.to_string()),
            HostError::Invalid => bad_host(),
        })?;
        let host = if wildcard {
            HostPattern::Subdomains(name)
        } else {
            HostPattern::Exact(name)
        };
        Ok(Entry { host, ports })
    }

    /// Whether this entry allows `host` (normalised) on `port`.
    pub fn allows(&self, host: &str, port: u16) -> bool {
        self.ports.contains(&port) && self.host.matches(host)
    }

    fn within(&self, wider: &Entry) -> bool {
        self.host.within(&wider.host) && self.ports.iter().all(|p| wider.ports.contains(p))
    }
}

impl fmt::Display for Entry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.host {
            HostPattern::Exact(name) => f.write_str(name)?,
            HostPattern::Subdomains(suffix) => write!(f, "*.{suffix}")?,
        }
        let ports: Vec<String> = self.ports.iter().map(u16::to_string).collect();
        write!(f, ":{}", ports.join(","))
    }
}

/// A parsed allowlist. The empty list allows nothing.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Allowlist {
    entries: Vec<Entry>,
}

impl Allowlist {
    /// Parses every entry; the first bad one is the error.
    pub fn parse<S: AsRef<str>>(entries: &[S]) -> Result<Allowlist, AllowlistError> {
        let entries = entries
            .iter()
            .map(|e| Entry::parse(e.as_ref()))
            .collect::<Result<_, _>>()?;
        Ok(Allowlist { entries })
    }

    /// Parses a requested list and checks every entry lies within an entry of the operator's bound `allow_max`.
    pub fn parse_within<S: AsRef<str>>(
        entries: &[S],
        allow_max: &Allowlist,
    ) -> Result<Allowlist, AllowlistError> {
        for raw in entries {
            let entry = Entry::parse(raw.as_ref())?;
            // A port-less entry stands for 443 and 80: each port must be covered, possibly by different entries.
            let covered = entry.ports.iter().all(|port| {
                let one = Entry {
                    host: entry.host.clone(),
                    ports: vec![*port],
                };
                allow_max.entries.iter().any(|max| one.within(max))
            });
            if !covered {
                return Err(AllowlistError::NotCovered(raw.as_ref().to_string()));
            }
        }
        Allowlist::parse(entries)
    }

    /// The parsed entries.
    pub fn entries(&self) -> &[Entry] {
        &self.entries
    }

    /// Whether a normalised host name on `port` is allowed.
    pub fn allows(&self, host: &str, port: u16) -> bool {
        self.entries.iter().any(|e| e.allows(host, port))
    }
}

/// Why a host name (of an entry or a request) was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum HostError {
    /// An IPv4 or IPv6 literal, or a name whose last label is numeric (which resolvers read as IPv4).
    IpLiteral,
    /// Not a valid DNS name.
    Invalid,
}

fn normalise_entry_host(name: &str) -> Result<String, HostError> {
    let name = name.strip_suffix('.').unwrap_or(name);
    if name.is_empty() || name.parse::<IpAddr>().is_ok() {
        return Err(if name.is_empty() {
            HostError::Invalid
        } else {
            HostError::IpLiteral
        });
    }
    let ascii = idna::domain_to_ascii_strict(name).map_err(|_| HostError::Invalid)?;
    check_ascii_name(&ascii)?;
    Ok(ascii)
}

/// Normalises a host name from a request (CONNECT authority, absolute URI, Host header): trailing dot removed,
/// lower-cased; non-ASCII and IP literals refused (a client sends IDNs as punycode).
pub(crate) fn normalise_request_host(host: &str) -> Result<String, HostError> {
    if host.starts_with('[') || host.parse::<IpAddr>().is_ok() {
        return Err(HostError::IpLiteral);
    }
    let host = host.strip_suffix('.').unwrap_or(host);
    if host.is_empty() || !host.is_ascii() {
        return Err(HostError::Invalid);
    }
    let lower = host.to_ascii_lowercase();
    check_ascii_name(&lower)?;
    Ok(lower)
}

fn check_ascii_name(name: &str) -> Result<(), HostError> {
    if name.len() > 253 {
        return Err(HostError::Invalid);
    }
    let mut last = "";
    for label in name.split('.') {
        let ok = !label.is_empty()
            && label.len() <= 63
            && !label.starts_with('-')
            && !label.ends_with('-')
            && label
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-');
        if !ok {
            return Err(HostError::Invalid);
        }
        last = label;
    }
    // `127.1`, `0x7f.1` and the like: inet_aton forms that some resolvers turn into addresses.
    let numeric = last.bytes().all(|b| b.is_ascii_digit())
        || (last.starts_with("0x") && last[2..].bytes().all(|b| b.is_ascii_hexdigit()));
    if numeric {
        return Err(HostError::IpLiteral);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn list(entries: &[&str]) -> Allowlist {
        Allowlist::parse(entries).unwrap()
    }

    #[test]
    fn entries_parse_with_default_ports() {
        let l = list(&["pypi.org:443", "*.pythonhosted.org:443", "API.Example.com."]);
        assert_eq!(l.entries()[0].to_string(), "pypi.org:443");
        assert_eq!(l.entries()[1].to_string(), "*.pythonhosted.org:443");
        assert_eq!(l.entries()[2].to_string(), "api.example.com:443,80");
        assert!(l.allows("api.example.com", 80));
        assert!(l.allows("api.example.com", 443));
        assert!(!l.allows("api.example.com", 8443));
        assert!(!l.allows("pypi.org", 80));
    }

    #[test]
    fn wildcard_matches_one_or_more_labels_never_the_apex() {
        let l = list(&["*.pythonhosted.org:443"]);
        assert!(l.allows("files.pythonhosted.org", 443));
        assert!(l.allows("a.b.pythonhosted.org", 443));
        assert!(!l.allows("pythonhosted.org", 443));
        assert!(!l.allows("evilpythonhosted.org", 443));
        let both = list(&["*.pythonhosted.org:443", "pythonhosted.org:443"]);
        assert!(both.allows("pythonhosted.org", 443));
    }

    #[test]
    fn idna_entries_become_punycode() {
        let l = list(&["Bücher.example"]);
        assert!(l.allows("xn--bcher-kva.example", 443));
    }

    #[test]
    fn bad_entries_name_the_entry() {
        let cases: &[(&str, AllowlistError)] = &[
            (
                "1.2.3.4:443",
                AllowlistError::IpLiteral("1.2.3.4:443".into()),
            ),
            ("[::1]:443", AllowlistError::IpLiteral("[::1]:443".into())),
            ("::1", AllowlistError::IpLiteral("::1".into())),
            ("127.1", AllowlistError::IpLiteral("127.1".into())),
            ("10.0.0.1", AllowlistError::IpLiteral("10.0.0.1".into())),
            ("host:0", AllowlistError::BadPort("host:0".into())),
            ("host:+80", AllowlistError::BadPort("host:+80".into())),
            ("host:65536", AllowlistError::BadPort("host:65536".into())),
            ("*", AllowlistError::BadWildcard("*".into())),
            ("a.*.com", AllowlistError::BadWildcard("a.*.com".into())),
            ("*foo.com", AllowlistError::BadWildcard("*foo.com".into())),
            ("", AllowlistError::BadHost("".into())),
            ("a..b", AllowlistError::BadHost("a..b".into())),
            (
                "exa mple.com",
                AllowlistError::BadHost("exa mple.com".into()),
            ),
        ];
        for (entry, want) in cases {
            assert_eq!(Allowlist::parse(&[*entry]).unwrap_err(), *want, "{entry}");
            assert!(want.to_string().contains(&format!("`{entry}`")));
        }
    }

    #[test]
    fn allow_max_refuses_wider_lists() {
        let max = list(&["*.pythonhosted.org:443", "pypi.org", "api.example.com:443"]);
        assert!(
            Allowlist::parse_within(&["pypi.org:443", "files.pythonhosted.org:443"], &max).is_ok()
        );
        assert!(Allowlist::parse_within(&["*.a.pythonhosted.org:443", "pypi.org"], &max).is_ok());
        let refused: &[&str] = &[
            "pythonhosted.org:443",
            "*.org:443",
            "files.pythonhosted.org:80",
            "api.example.com",
            "*.api.example.com:443",
            "other.example.com:443",
        ];
        for entry in refused {
            assert_eq!(
                Allowlist::parse_within(&["pypi.org", entry], &max).unwrap_err(),
                AllowlistError::NotCovered(entry.to_string())
            );
        }
        assert_eq!(
            Allowlist::parse_within(&["1.2.3.4"], &max).unwrap_err(),
            AllowlistError::IpLiteral("1.2.3.4".into())
        );
    }

    #[test]
    fn request_hosts_normalise() {
        assert_eq!(normalise_request_host("PyPI.org.").unwrap(), "pypi.org");
        assert_eq!(
            normalise_request_host("127.0.0.1"),
            Err(HostError::IpLiteral)
        );
        assert_eq!(normalise_request_host("[::1]"), Err(HostError::IpLiteral));
        assert_eq!(normalise_request_host("0x7f.1"), Err(HostError::IpLiteral));
        assert_eq!(
            normalise_request_host("bücher.example"),
            Err(HostError::Invalid)
        );
        assert_eq!(
            normalise_request_host("a_b.example"),
            Err(HostError::Invalid)
        );
    }
}

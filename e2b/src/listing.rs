//! `GET /v2/sandboxes`' filters and pages: one order every node shares (start time, then id), so that a page token
//! is a position in it and the pages of several nodes merge ([`crate::fleet`]).

use std::collections::BTreeMap;
use std::time::{SystemTime, UNIX_EPOCH};

use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine as _;
use time::format_description::well_known::Rfc3339;
use time::OffsetDateTime;

use crate::engine::{SandboxInfo, SandboxState};

/// The page size of `GET /v2/sandboxes` when none is asked for.
pub const DEFAULT_LIST_LIMIT: usize = 100;

/// The largest page `GET /v2/sandboxes` serves.
pub const MAX_LIST_LIMIT: usize = 1000;

/// What `GET /v2/sandboxes` filters and pages by.
#[derive(Debug, Default, PartialEq)]
pub struct ListQuery {
    /// Every pair must match the sandbox's metadata.
    pub metadata: BTreeMap<String, String>,
    /// The states wanted (both when empty).
    pub states: Vec<SandboxState>,
    /// Only sandboxes of this template.
    pub template: Option<String>,
    /// Only sandboxes started after this time.
    pub started_after: Option<SystemTime>,
    /// Newest first.
    pub descending: bool,
    /// The page size.
    pub limit: usize,
    /// Where the previous page stopped: (start time in ns since the epoch, id).
    pub after: Option<(u128, String)>,
}

/// Reads `GET /v2/sandboxes`' query: `metadata` (itself url-encoded `k=v&...`), `state` (comma list), `template`,
/// `startedAfter`, `order`, `limit`, `nextToken`. Unknown parameters are ignored.
pub fn parse_list_query(query: &str) -> Result<ListQuery, String> {
    // E2B's API lists the newest first unless asked otherwise.
    let mut out = ListQuery {
        limit: DEFAULT_LIST_LIMIT,
        descending: true,
        ..ListQuery::default()
    };
    for (key, value) in form_urlencoded::parse(query.as_bytes()) {
        match key.as_ref() {
            "metadata" => {
                for (k, v) in form_urlencoded::parse(value.as_bytes()) {
                    out.metadata.insert(k.into_owned(), v.into_owned());
                }
            }
            "state" => {
                for name in value.split(',').map(str::trim).filter(|s| !s.is_empty()) {
                    let state = match name {
                        "running" => SandboxState::Running,
                        "paused" => SandboxState::Paused,
                        other => return Err(format!("Unknown state {other}")),
                    };
                    if !out.states.contains(&state) {
                        out.states.push(state);
                    }
                }
            }
            "template" => out.template = Some(value.into_owned()),
            "startedAfter" => {
                let at = OffsetDateTime::parse(&value, &Rfc3339)
                    .map_err(|_| "startedAfter must be an RFC 3339 time".to_owned())?;
                out.started_after = Some(at.into());
            }
            "order" => {
                out.descending = match value.to_ascii_lowercase().as_str() {
                    "asc" => false,
                    "desc" => true,
                    _ => return Err("order must be asc or desc".to_owned()),
                }
            }
            "limit" => {
                out.limit = match value.parse::<usize>() {
                    Ok(n) if (1..=MAX_LIST_LIMIT).contains(&n) => n,
                    _ => return Err(format!("limit must be from 1 to {MAX_LIST_LIMIT}")),
                }
            }
            "nextToken" => out.after = Some(decode_token(&value)?),
            _ => {}
        }
    }
    Ok(out)
}

/// A sandbox's place in the listing order: its start time (ns since the epoch), then its id.
fn sort_key(info: &SandboxInfo) -> (u128, String) {
    let nanos = info
        .started_at
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_nanos();
    (nanos, info.id.clone())
}

/// The opaque `x-next-token` for a page that ended at `key`.
fn encode_token(key: &(u128, String)) -> String {
    URL_SAFE_NO_PAD.encode(format!("{}:{}", key.0, key.1))
}

/// Reads a token from [`encode_token`].
fn decode_token(token: &str) -> Result<(u128, String), String> {
    let bad = || "Invalid nextToken".to_owned();
    let raw = URL_SAFE_NO_PAD.decode(token.trim()).map_err(|_| bad())?;
    let text = String::from_utf8(raw).map_err(|_| bad())?;
    let (nanos, id) = text.split_once(':').ok_or_else(bad)?;
    Ok((nanos.parse().map_err(|_| bad())?, id.to_owned()))
}

/// One page of the sandboxes matching `query`, and the token of the next page when there is one.
pub fn list_page(
    mut sandboxes: Vec<SandboxInfo>,
    query: &ListQuery,
) -> (Vec<SandboxInfo>, Option<String>) {
    sandboxes.retain(|info| {
        query
            .metadata
            .iter()
            .all(|(k, v)| info.metadata.get(k) == Some(v))
            && (query.states.is_empty() || query.states.contains(&info.state))
            && query.template.as_ref().is_none_or(|t| *t == info.template)
            && query.started_after.is_none_or(|at| info.started_at > at)
    });
    let mut keyed: Vec<((u128, String), SandboxInfo)> =
        sandboxes.into_iter().map(|i| (sort_key(&i), i)).collect();
    keyed.sort_by(|a, b| a.0.cmp(&b.0));
    if query.descending {
        keyed.reverse();
    }
    if let Some(after) = &query.after {
        keyed.retain(|(key, _)| {
            if query.descending {
                key < after
            } else {
                key > after
            }
        });
    }
    let more = keyed.len() > query.limit;
    keyed.truncate(query.limit);
    let token = if more {
        keyed.last().map(|(key, _)| encode_token(key))
    } else {
        None
    };
    (keyed.into_iter().map(|(_, info)| info).collect(), token)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn list_query_metadata_and_state() {
        let q =
            parse_list_query("metadata=a%3D1%26b%3Dx%2By&state=running%2Cpaused&limit=2").unwrap();
        assert_eq!(q.metadata.get("a").map(String::as_str), Some("1"));
        assert_eq!(q.metadata.get("b").map(String::as_str), Some("x y"));
        assert_eq!(q.states, vec![SandboxState::Running, SandboxState::Paused]);
        assert_eq!(q.limit, 2);
        assert!(parse_list_query("state=dead").is_err());
        assert!(parse_list_query("limit=0").is_err());
        assert!(parse_list_query("nextToken=%%%").is_err());
    }

    #[test]
    fn token_round_trip() {
        let key = (123_u128, "sbx:1".to_owned());
        assert_eq!(decode_token(&encode_token(&key)).unwrap(), key);
    }
}

//! The envelope every FSP/1 message carries: `v`, `type`, `ts` and, on execution messages, `id` (spec section 2).

use time::format_description::BorrowedFormatItem;
use time::macros::format_description;
use time::{OffsetDateTime, PrimitiveDateTime, UtcOffset};

/// The protocol version this crate speaks and sends in `v`.
pub const PROTOCOL_VERSION: u64 = 1;

/// Every `v` the server accepts; sent back as `supported_versions` when a client uses another one.
pub const SUPPORTED_VERSIONS: &[u64] = &[PROTOCOL_VERSION];

/// The longest execution id, in bytes (ids are ASCII, so also in characters).
pub const MAX_ID_LEN: usize = 128;

/// The wire form of `ts`: UTC, ISO 8601, milliseconds, `Z`.
const TS_FORMAT: &[BorrowedFormatItem<'static>] =
    format_description!("[year]-[month]-[day]T[hour]:[minute]:[second].[subsecond digits:3]Z");

/// Whether `id` is a usable execution id: 1 to [`MAX_ID_LEN`] characters of `[A-Za-z0-9_.:-]`.
pub fn is_valid_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= MAX_ID_LEN
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b':' | b'-'))
}

/// The current time as an FSP timestamp, e.g. `2025-12-27T11:30:00.000Z`.
pub fn now_ts() -> String {
    format_ts(OffsetDateTime::now_utc())
}

/// Formats `at` (converted to UTC) as an FSP timestamp `YYYY-MM-DDTHH:MM:SS.mmmZ`, truncating to milliseconds.
pub fn format_ts(at: OffsetDateTime) -> String {
    let at = at.checked_to_offset(UtcOffset::UTC).unwrap_or(at);
    format!(
        "{:04}-{:02}-{:02}T{:02}:{:02}:{:02}.{:03}Z",
        at.year(),
        u8::from(at.month()),
        at.day(),
        at.hour(),
        at.minute(),
        at.second(),
        at.millisecond()
    )
}

/// Parses an FSP timestamp in the exact form [`format_ts`] produces.
pub fn parse_ts(ts: &str) -> Result<OffsetDateTime, TimestampError> {
    PrimitiveDateTime::parse(ts, TS_FORMAT)
        .map(PrimitiveDateTime::assume_utc)
        .map_err(|source| TimestampError {
            value: ts.to_owned(),
            source,
        })
}

/// A timestamp that is not UTC ISO 8601 with milliseconds.
#[derive(Debug, thiserror::Error)]
#[error("Invalid timestamp {value:?}: expected UTC YYYY-MM-DDTHH:MM:SS.mmmZ")]
pub struct TimestampError {
    /// The refused text.
    pub value: String,
    /// What the parser found wrong.
    #[source]
    pub source: time::error::Parse,
}

#[cfg(test)]
mod tests {
    use time::macros::datetime;

    use super::*;

    #[test]
    fn ids() {
        assert!(is_valid_id("exec_a1"));
        assert!(is_valid_id("a.b:c-d_E9"));
        assert!(is_valid_id(&"x".repeat(MAX_ID_LEN)));
        assert!(!is_valid_id(&"x".repeat(MAX_ID_LEN + 1)));
        assert!(!is_valid_id(""));
        for bad in ["a b", "a/b", "é", "a\0", "a\n", "a*", "a\"b"] {
            assert!(!is_valid_id(bad), "{bad:?}");
        }
    }

    #[test]
    fn timestamps() {
        assert_eq!(
            format_ts(datetime!(2025-12-27 11:30:00.0004 UTC)),
            "2025-12-27T11:30:00.000Z"
        );
        assert_eq!(
            format_ts(datetime!(2026-01-02 03:04:05.678_9 UTC)),
            "2026-01-02T03:04:05.678Z"
        );
        // Converted to UTC.
        assert_eq!(
            format_ts(datetime!(2026-01-02 03:04:05.1 +02:00)),
            "2026-01-02T01:04:05.100Z"
        );
        let now = now_ts();
        let parsed = parse_ts(&now).unwrap();
        assert_eq!(format_ts(parsed), now);
        assert_eq!(
            parse_ts("2025-12-27T11:30:00.000Z").unwrap(),
            datetime!(2025-12-27 11:30:00 UTC)
        );
        for bad in [
            "...",
            "2025-12-27T11:30:00Z",
            "2025-12-27T11:30:00.000",
            "2025-12-27 11:30:00.000Z",
        ] {
            let err = parse_ts(bad).unwrap_err();
            assert!(err.to_string().starts_with("Invalid timestamp"), "{err}");
        }
    }
}

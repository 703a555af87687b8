mod client_round_trip;
mod refusals;
mod server_encoding;
mod spec_examples;
mod tools;

use protocol::{parse_client_message, ErrorCode, RequestError};

/// Parses `text`, which must be refused, and checks the code and echoed id.
pub fn refused(text: &str, code: ErrorCode, id: Option<&str>) -> RequestError {
    let err = parse_client_message(text).expect_err(text);
    assert_eq!(err.code, code, "{text} -> {err:?}");
    assert_eq!(err.id.as_deref(), id, "{text} -> {err:?}");
    let first = err.message.chars().next().unwrap();
    assert!(
        first.is_uppercase(),
        "message must start with a capital letter: {:?}",
        err.message
    );
    err
}

/// Like [`refused`] with `INVALID_REQUEST`, also checking that the message contains `needle`.
pub fn invalid(text: &str, id: Option<&str>, needle: &str) -> RequestError {
    let err = refused(text, ErrorCode::InvalidRequest, id);
    assert!(
        err.message.contains(needle),
        "{text}: message {:?} does not name {needle:?}",
        err.message
    );
    err
}

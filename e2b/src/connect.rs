//! The Connect protocol with its JSON codec, over HTTP/1.1, as envd's clients speak it (connectrpc 0.12 in the
//! Python SDK, connect-web in the JavaScript one).
//!
//! - A unary request is a plain JSON body; its answer is 200 `application/json`, or an error status from
//!   [`Code::http_status`] with `{"code","message"}`.
//! - A server-stream request is exactly one envelope (flag byte 0, 4-byte big-endian length, JSON); its answer is
//!   200 `application/connect+json`, one envelope (flag 0) per message flushed as written, then the end-of-stream
//!   envelope (flag 2) holding `{}` or `{"error":{"code","message"}}`. An error before the first message is such a
//!   stream with only the end-of-stream envelope, as connect-go answers.
//! - Messages are proto3 JSON read leniently ([`field`] and its siblings): camelCase or snake_case keys, an int64
//!   as a number or a string, an enum by name or number.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::fmt;

use axum::body::Body;
use axum::http::header::{CONTENT_ENCODING, CONTENT_TYPE};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use base64::Engine as _;
use bytes::{BufMut, Bytes, BytesMut};
use http_body_util::BodyExt;
use serde_json::{json, Map, Value};
use tokio::sync::mpsc;

/// The largest request body read for one RPC (unary message or stream envelope), in bytes.
pub const MAX_REQUEST_BYTES: usize = 64 << 20;

/// The content type of a Connect stream with the JSON codec.
pub const STREAM_CONTENT_TYPE: &str = "application/connect+json";

/// The content type of a unary Connect call with the JSON codec.
pub const UNARY_CONTENT_TYPE: &str = "application/json";

/// The envelope flag of an ordinary message.
pub const FLAG_MESSAGE: u8 = 0;

/// The envelope flag of a compressed message (refused: compression is never negotiated).
pub const FLAG_COMPRESSED: u8 = 1;

/// The envelope flag of the end-of-stream message.
pub const FLAG_END_STREAM: u8 = 2;

/// How many messages a stream buffers before its writer waits for the client.
const STREAM_BUFFER: usize = 16;

/// A Connect error code (the snake_case names of the protocol).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Code {
    /// The operation was canceled, typically by the caller.
    Canceled,
    /// Unknown error.
    Unknown,
    /// The request is invalid regardless of the system's state.
    InvalidArgument,
    /// The deadline expired before the operation completed.
    DeadlineExceeded,
    /// The requested entity (process, file, sandbox) was not found.
    NotFound,
    /// The entity the caller tried to create exists already.
    AlreadyExists,
    /// The caller may not do this.
    PermissionDenied,
    /// A resource (a limit, the disk) is exhausted.
    ResourceExhausted,
    /// The system is not in the state the operation needs.
    FailedPrecondition,
    /// The operation was aborted (a concurrency conflict).
    Aborted,
    /// A value is out of its valid range.
    OutOfRange,
    /// The operation is not implemented here.
    Unimplemented,
    /// An invariant broke: a server bug or an unexpected host failure.
    Internal,
    /// The service is unavailable right now; a retry may work.
    Unavailable,
    /// Data was lost or corrupted.
    DataLoss,
    /// The caller did not authenticate.
    Unauthenticated,
}

impl Code {
    /// The code's name on the wire (`not_found`).
    pub fn as_str(self) -> &'static str {
        match self {
            Code::Canceled => "canceled",
            Code::Unknown => "unknown",
            Code::InvalidArgument => "invalid_argument",
            Code::DeadlineExceeded => "deadline_exceeded",
            Code::NotFound => "not_found",
            Code::AlreadyExists => "already_exists",
            Code::PermissionDenied => "permission_denied",
            Code::ResourceExhausted => "resource_exhausted",
            Code::FailedPrecondition => "failed_precondition",
            Code::Aborted => "aborted",
            Code::OutOfRange => "out_of_range",
            Code::Unimplemented => "unimplemented",
            Code::Internal => "internal",
            Code::Unavailable => "unavailable",
            Code::DataLoss => "data_loss",
            Code::Unauthenticated => "unauthenticated",
        }
    }

    /// The HTTP status of a unary error with this code (the Connect protocol's table).
    pub fn http_status(self) -> StatusCode {
        match self {
            // 499 "Client Closed Request" is not a registered status; from_u16 accepts any 3-digit number.
            Code::Canceled => StatusCode::from_u16(499).unwrap_or(StatusCode::REQUEST_TIMEOUT),
            Code::Unknown | Code::Internal | Code::DataLoss => StatusCode::INTERNAL_SERVER_ERROR,
            Code::InvalidArgument | Code::FailedPrecondition | Code::OutOfRange => {
                StatusCode::BAD_REQUEST
            }
            Code::DeadlineExceeded => StatusCode::GATEWAY_TIMEOUT,
            Code::NotFound => StatusCode::NOT_FOUND,
            Code::AlreadyExists | Code::Aborted => StatusCode::CONFLICT,
            Code::PermissionDenied => StatusCode::FORBIDDEN,
            Code::ResourceExhausted => StatusCode::TOO_MANY_REQUESTS,
            Code::Unimplemented => StatusCode::NOT_IMPLEMENTED,
            Code::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
            Code::Unauthenticated => StatusCode::UNAUTHORIZED,
        }
    }
}

impl fmt::Display for Code {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A Connect error: a code and a message for the caller.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{code}: {message}")]
pub struct ConnectError {
    /// The code.
    pub code: Code,
    /// The message shown to the caller.
    pub message: String,
}

impl ConnectError {
    /// An error with this code and message.
    pub fn new(code: Code, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
        }
    }

    /// `invalid_argument`.
    pub fn invalid_argument(message: impl Into<String>) -> Self {
        Self::new(Code::InvalidArgument, message)
    }

    /// `not_found`.
    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(Code::NotFound, message)
    }

    /// `unimplemented`.
    pub fn unimplemented(message: impl Into<String>) -> Self {
        Self::new(Code::Unimplemented, message)
    }

    /// `internal`.
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(Code::Internal, message)
    }

    /// The error as JSON: `{"code":"not_found","message":"..."}`.
    pub fn to_json(&self) -> Value {
        json!({ "code": self.code.as_str(), "message": self.message })
    }

    /// The answer to a streaming call that fails before its first message: HTTP 200 `application/connect+json`
    /// with only the end-of-stream envelope holding the error (what connect-go sends).
    pub fn into_stream_response(self) -> Response {
        let body = end_of_stream(Some(&self));
        stream_headers(Response::new(Body::from(body)))
    }
}

/// A unary error: the status from [`Code::http_status`] and the JSON body `{"code","message"}`.
impl IntoResponse for ConnectError {
    fn into_response(self) -> Response {
        let mut response = (self.code.http_status(), self.to_json().to_string()).into_response();
        response
            .headers_mut()
            .insert(CONTENT_TYPE, HeaderValue::from_static(UNARY_CONTENT_TYPE));
        response
    }
}

/// Why a request body could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BodyError {
    /// It is longer than the limit.
    #[error("The request body is larger than {limit} bytes")]
    TooLarge {
        /// The limit, in bytes.
        limit: usize,
    },
    /// The connection failed while it was read.
    #[error("Reading the request body failed: {0}")]
    Read(String),
}

impl From<BodyError> for ConnectError {
    fn from(err: BodyError) -> Self {
        match err {
            BodyError::TooLarge { .. } => {
                ConnectError::new(Code::ResourceExhausted, err.to_string())
            }
            BodyError::Read(_) => ConnectError::new(Code::Canceled, err.to_string()),
        }
    }
}

/// Reads a whole request body, refusing one longer than `limit` bytes.
pub async fn read_body(body: Body, limit: usize) -> Result<Bytes, BodyError> {
    match http_body_util::Limited::new(body, limit).collect().await {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(err)
            if err
                .downcast_ref::<http_body_util::LengthLimitError>()
                .is_some() =>
        {
            Err(BodyError::TooLarge { limit })
        }
        Err(err) => Err(BodyError::Read(err.to_string())),
    }
}

/// Why a stream request's envelope is malformed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EnvelopeError {
    /// Fewer than the 5 bytes of an envelope's prefix.
    #[error("The request has {0} bytes, less than an envelope's 5-byte prefix")]
    Short(usize),
    /// A flag other than 0 (a compressed or end-of-stream envelope in a request).
    #[error(
        "The request envelope has flags {0:#04x}; only uncompressed messages (0x00) are accepted"
    )]
    Flags(u8),
    /// The declared length does not match the bytes that follow (a cut or a second envelope).
    #[error("The request envelope declares {declared} bytes but {actual} follow; exactly one envelope is expected")]
    Length {
        /// The length in the prefix.
        declared: usize,
        /// The bytes after the prefix.
        actual: usize,
    },
}

impl From<EnvelopeError> for ConnectError {
    fn from(err: EnvelopeError) -> Self {
        ConnectError::invalid_argument(err.to_string())
    }
}

/// The payload of a stream request's body, which must be exactly one uncompressed envelope.
pub fn decode_envelope(body: &[u8]) -> Result<&[u8], EnvelopeError> {
    let (prefix, payload) = match body.split_first_chunk::<5>() {
        Some(split) => split,
        None => return Err(EnvelopeError::Short(body.len())),
    };
    let [flags, len @ ..] = *prefix;
    if flags != FLAG_MESSAGE {
        return Err(EnvelopeError::Flags(flags));
    }
    let declared = u32::from_be_bytes(len) as usize;
    if declared != payload.len() {
        return Err(EnvelopeError::Length {
            declared,
            actual: payload.len(),
        });
    }
    Ok(payload)
}

/// One envelope: the flag byte, the payload's length (4 bytes, big-endian), the payload.
pub fn encode_envelope(flags: u8, payload: &[u8]) -> Bytes {
    let mut out = BytesMut::with_capacity(5 + payload.len());
    out.put_u8(flags);
    // A message is built from bounded output chunks; a payload past 4 GiB cannot occur, and saturating keeps the
    // frame well-formed-looking rather than wrapping.
    out.put_u32(u32::try_from(payload.len()).unwrap_or(u32::MAX));
    out.put_slice(payload);
    out.freeze()
}

/// The end-of-stream envelope: `{}` on success, `{"error":{"code","message"}}` on failure.
pub fn end_of_stream(error: Option<&ConnectError>) -> Bytes {
    let payload = match error {
        None => json!({}),
        Some(err) => json!({ "error": err.to_json() }),
    };
    encode_envelope(FLAG_END_STREAM, payload.to_string().as_bytes())
}

/// A message's JSON: an object (an empty payload is the empty message `{}`).
pub fn decode_json(payload: &[u8]) -> Result<Value, ConnectError> {
    if payload.iter().all(u8::is_ascii_whitespace) {
        return Ok(Value::Object(Map::new()));
    }
    match serde_json::from_slice::<Value>(payload) {
        Ok(value @ Value::Object(_)) => Ok(value),
        Ok(_) => Err(ConnectError::invalid_argument(
            "The request message is not a JSON object",
        )),
        Err(err) => Err(ConnectError::invalid_argument(format!(
            "The request message is not valid JSON: {err}"
        ))),
    }
}

/// Refuses a codec or compression the facade does not speak. `stream` picks the header names of streams.
fn check_encoding(headers: &HeaderMap, stream: bool) -> Result<(), ConnectError> {
    if let Some(content_type) = header_str(headers, CONTENT_TYPE.as_str()) {
        let content_type = content_type.to_ascii_lowercase();
        if content_type.contains("proto") {
            return Err(ConnectError::unimplemented(format!(
                "The codec of {content_type} is not served: only JSON"
            )));
        }
    }
    let encoding_header = if stream {
        "connect-content-encoding"
    } else {
        CONTENT_ENCODING.as_str()
    };
    if let Some(encoding) = header_str(headers, encoding_header) {
        if !encoding.trim().eq_ignore_ascii_case("identity") {
            return Err(ConnectError::unimplemented(format!(
                "The compression {encoding} is not served: only identity"
            )));
        }
    }
    Ok(())
}

/// A header's value as text, if present and visible ASCII.
pub fn header_str<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    headers.get(name).and_then(|v| v.to_str().ok())
}

/// Reads a unary request: its codec checked, its body bounded, its JSON message.
pub async fn read_unary(headers: &HeaderMap, body: Body) -> Result<Value, ConnectError> {
    check_encoding(headers, false)?;
    let bytes = read_body(body, MAX_REQUEST_BYTES).await?;
    decode_json(&bytes)
}

/// Reads a server-stream request: its codec checked, its body bounded, exactly one envelope, its JSON message.
pub async fn read_stream(headers: &HeaderMap, body: Body) -> Result<Value, ConnectError> {
    check_encoding(headers, true)?;
    let bytes = read_body(body, MAX_REQUEST_BYTES + 5).await?;
    decode_json(decode_envelope(&bytes)?)
}

/// Whether a request is a streaming Connect call (by its content type), so its errors take the stream's form.
pub fn is_stream_request(headers: &HeaderMap) -> bool {
    header_str(headers, CONTENT_TYPE.as_str()).is_some_and(|ct| {
        ct.trim()
            .to_ascii_lowercase()
            .starts_with("application/connect+")
    })
}

/// A unary success: 200 `application/json` with the message.
pub fn unary_ok(message: &Value) -> Response {
    let mut response = (StatusCode::OK, message.to_string()).into_response();
    response
        .headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static(UNARY_CONTENT_TYPE));
    response
}

/// Marks a response as a Connect stream.
fn stream_headers(mut response: Response) -> Response {
    *response.status_mut() = StatusCode::OK;
    response
        .headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static(STREAM_CONTENT_TYPE));
    response
}

/// The client closed a stream (it went away, or dropped the response).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("The client closed the stream")]
pub struct StreamClosed;

/// The writing end of a streaming answer: each message goes out as one envelope as soon as it is sent.
#[derive(Debug)]
pub struct StreamWriter {
    tx: mpsc::Sender<Bytes>,
}

impl StreamWriter {
    /// Sends one message; waits while the client is slow.
    pub async fn send(&self, message: &Value) -> Result<(), StreamClosed> {
        let frame = encode_envelope(FLAG_MESSAGE, message.to_string().as_bytes());
        self.tx.send(frame).await.map_err(|_| StreamClosed)
    }

    /// Ends the stream with its end-of-stream envelope (`{}`, or the error). A client that went away is ignored.
    pub async fn finish(self, result: Result<(), ConnectError>) {
        let _ = self.tx.send(end_of_stream(result.err().as_ref())).await;
    }

    /// Resolves when the client has gone away.
    pub async fn closed(&self) {
        self.tx.closed().await;
    }
}

/// A streaming answer (HTTP 200, `application/connect+json`) and the writer that feeds it.
pub fn stream_response() -> (StreamWriter, Response) {
    let (tx, mut rx) = mpsc::channel::<Bytes>(STREAM_BUFFER);
    let stream = futures_util::stream::poll_fn(move |cx| {
        rx.poll_recv(cx).map(|frame| frame.map(Ok::<_, Infallible>))
    });
    let response = stream_headers(Response::new(Body::from_stream(stream)));
    (StreamWriter { tx }, response)
}

/// `name` as snake_case (`modifiedTime` → `modified_time`).
fn snake_case(name: &str) -> String {
    let mut out = String::with_capacity(name.len() + 4);
    for c in name.chars() {
        if c.is_ascii_uppercase() {
            out.push('_');
            out.push(c.to_ascii_lowercase());
        } else {
            out.push(c);
        }
    }
    out
}

/// A field of a proto3 JSON message by its camelCase name, or its snake_case spelling; `null` counts as absent.
pub fn field<'a>(message: &'a Value, camel: &str) -> Option<&'a Value> {
    let object = message.as_object()?;
    let found = match object.get(camel) {
        Some(value) => Some(value),
        None => object.get(&snake_case(camel)),
    };
    found.filter(|v| !v.is_null())
}

/// A message-typed field (an object), if set.
pub fn message_field<'a>(
    message: &'a Value,
    camel: &str,
) -> Result<Option<&'a Value>, ConnectError> {
    match field(message, camel) {
        None => Ok(None),
        Some(value @ Value::Object(_)) => Ok(Some(value)),
        Some(_) => Err(ConnectError::invalid_argument(format!(
            "{camel} must be an object"
        ))),
    }
}

/// A string field, if set.
pub fn string_field(message: &Value, camel: &str) -> Result<Option<String>, ConnectError> {
    match field(message, camel) {
        None => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(_) => Err(ConnectError::invalid_argument(format!(
            "{camel} must be a string"
        ))),
    }
}

/// A bool field, if set.
pub fn bool_field(message: &Value, camel: &str) -> Result<Option<bool>, ConnectError> {
    match field(message, camel) {
        None => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(_) => Err(ConnectError::invalid_argument(format!(
            "{camel} must be a bool"
        ))),
    }
}

/// An integer field, if set: a JSON number (integral) or a decimal string, as proto3 JSON writes int64.
pub fn int_field(message: &Value, camel: &str) -> Result<Option<i64>, ConnectError> {
    let invalid = || ConnectError::invalid_argument(format!("{camel} must be an integer"));
    match field(message, camel) {
        None => Ok(None),
        Some(Value::Number(n)) => match n.as_i64() {
            Some(i) => Ok(Some(i)),
            // 5.0 is an integer in proto3 JSON.
            None => match n.as_f64() {
                Some(f) if f.fract() == 0.0 && f.abs() < 9.0e15 => Ok(Some(f as i64)),
                _ => Err(invalid()),
            },
        },
        Some(Value::String(s)) => s.trim().parse::<i64>().map(Some).map_err(|_| invalid()),
        Some(_) => Err(invalid()),
    }
}

/// An enum field, if set: its name (one of `values`, pairs of name and number) or its number.
pub fn enum_field(
    message: &Value,
    camel: &str,
    values: &[(&str, i64)],
) -> Result<Option<i64>, ConnectError> {
    match field(message, camel) {
        None => Ok(None),
        Some(Value::String(s)) => {
            match values.iter().find(|(name, _)| name == s) {
                Some((_, number)) => Ok(Some(*number)),
                None => s.trim().parse::<i64>().map(Some).map_err(|_| {
                    ConnectError::invalid_argument(format!("{camel}: unknown value {s}"))
                }),
            }
        }
        Some(_) => int_field(message, camel),
    }
}

/// A `map<string, string>` field (empty when unset).
pub fn string_map_field(
    message: &Value,
    camel: &str,
) -> Result<BTreeMap<String, String>, ConnectError> {
    match field(message, camel) {
        None => Ok(BTreeMap::new()),
        Some(Value::Object(map)) => map
            .iter()
            .map(|(k, v)| match v {
                Value::String(s) => Ok((k.clone(), s.clone())),
                _ => Err(ConnectError::invalid_argument(format!(
                    "{camel}.{k} must be a string"
                ))),
            })
            .collect(),
        Some(_) => Err(ConnectError::invalid_argument(format!(
            "{camel} must be an object"
        ))),
    }
}

/// A `repeated string` field (empty when unset).
pub fn string_list_field(message: &Value, camel: &str) -> Result<Vec<String>, ConnectError> {
    match field(message, camel) {
        None => Ok(Vec::new()),
        Some(Value::Array(items)) => items
            .iter()
            .map(|v| match v {
                Value::String(s) => Ok(s.clone()),
                _ => Err(ConnectError::invalid_argument(format!(
                    "{camel} must hold strings"
                ))),
            })
            .collect(),
        Some(_) => Err(ConnectError::invalid_argument(format!(
            "{camel} must be a list"
        ))),
    }
}

/// A `bytes` field (base64, standard or URL-safe alphabet, padded or not), if set.
pub fn bytes_field(message: &Value, camel: &str) -> Result<Option<Vec<u8>>, ConnectError> {
    use base64::engine::general_purpose::{STANDARD, STANDARD_NO_PAD, URL_SAFE, URL_SAFE_NO_PAD};
    let Some(text) = string_field(message, camel)? else {
        return Ok(None);
    };
    let text = text.trim();
    [STANDARD, STANDARD_NO_PAD, URL_SAFE, URL_SAFE_NO_PAD]
        .iter()
        .find_map(|engine| engine.decode(text).ok())
        .map(Some)
        .ok_or_else(|| ConnectError::invalid_argument(format!("{camel} is not valid base64")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn envelope_round_trip() {
        let frame = encode_envelope(FLAG_MESSAGE, br#"{"a":1}"#);
        assert_eq!(&frame[..5], &[0, 0, 0, 0, 7]);
        assert_eq!(decode_envelope(&frame), Ok(&br#"{"a":1}"#[..]));
    }

    #[test]
    fn malformed_envelopes_are_invalid_argument() {
        assert_eq!(decode_envelope(&[0, 0, 0]), Err(EnvelopeError::Short(3)));
        assert_eq!(
            decode_envelope(&[1, 0, 0, 0, 0]),
            Err(EnvelopeError::Flags(1))
        );
        assert_eq!(
            decode_envelope(&[0, 0, 0, 0, 3, b'{', b'}']),
            Err(EnvelopeError::Length {
                declared: 3,
                actual: 2
            })
        );
        let two = [encode_envelope(0, b"{}"), encode_envelope(0, b"{}")].concat();
        assert!(matches!(
            decode_envelope(&two),
            Err(EnvelopeError::Length { .. })
        ));
        let err: ConnectError = EnvelopeError::Short(0).into();
        assert_eq!(err.code, Code::InvalidArgument);
    }

    #[test]
    fn end_of_stream_bytes() {
        assert_eq!(&end_of_stream(None)[..], b"\x02\x00\x00\x00\x02{}");
        let err = ConnectError::not_found("x");
        let eos = end_of_stream(Some(&err));
        assert_eq!(eos[0], FLAG_END_STREAM);
        let v: Value = serde_json::from_slice(&eos[5..]).unwrap();
        assert_eq!(v, json!({"error":{"code":"not_found","message":"x"}}));
    }

    #[test]
    fn status_table() {
        assert_eq!(Code::NotFound.http_status(), StatusCode::NOT_FOUND);
        assert_eq!(
            Code::Unimplemented.http_status(),
            StatusCode::NOT_IMPLEMENTED
        );
        assert_eq!(Code::Canceled.http_status().as_u16(), 499);
        assert_eq!(
            Code::ResourceExhausted.http_status(),
            StatusCode::TOO_MANY_REQUESTS
        );
        assert_eq!(Code::FailedPrecondition.as_str(), "failed_precondition");
    }

    #[test]
    fn lenient_fields() {
        let m = json!({"exit_code": "5", "modifiedTime": null, "signal": "SIGNAL_SIGKILL", "n": 9, "f": 2.0,
                       "data": "aGk"});
        assert_eq!(int_field(&m, "exitCode").unwrap(), Some(5));
        assert_eq!(field(&m, "modifiedTime"), None);
        let names = [("SIGNAL_UNSPECIFIED", 0), ("SIGNAL_SIGKILL", 9)];
        assert_eq!(enum_field(&m, "signal", &names).unwrap(), Some(9));
        assert_eq!(enum_field(&m, "n", &names).unwrap(), Some(9));
        assert!(enum_field(&json!({"s": "SIGNAL_NOPE"}), "s", &names).is_err());
        assert_eq!(int_field(&m, "f").unwrap(), Some(2));
        assert_eq!(bytes_field(&m, "data").unwrap(), Some(b"hi".to_vec()));
        assert!(int_field(&json!({"a": "x"}), "a").is_err());
    }

    #[test]
    fn json_payloads() {
        assert_eq!(decode_json(b"").unwrap(), json!({}));
        assert_eq!(decode_json(b"[1]").unwrap_err().code, Code::InvalidArgument);
        assert_eq!(decode_json(b"{").unwrap_err().code, Code::InvalidArgument);
    }

    #[tokio::test]
    async fn body_limit_is_typed() {
        let err = read_body(Body::from(vec![0u8; 10]), 4).await.unwrap_err();
        assert_eq!(err, BodyError::TooLarge { limit: 4 });
        assert_eq!(ConnectError::from(err).code, Code::ResourceExhausted);
    }
}

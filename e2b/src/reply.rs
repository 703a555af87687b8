//! E2B's answers: JSON bodies, and the error form every refusal takes (`{"code":<status>,"message":...}` with
//! `Should-Retry: false`, so the SDK never retries a permanent refusal); and the `X-API-KEY` check, which both the
//! control plane and the fleet's forwarding make.

use std::time::SystemTime;

use axum::http::header::CONTENT_TYPE;
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};
use time::format_description::well_known::Rfc3339;
use time::OffsetDateTime;

/// The header that tells the SDK not to retry (it retries 429/502/503/504 otherwise).
pub const SHOULD_RETRY: HeaderName = HeaderName::from_static("should-retry");

/// An E2B error answer: `{"code":<status>,"message":...}` as JSON, with `Should-Retry: false`.
pub fn error_response(status: StatusCode, message: &str) -> Response {
    let body = json!({ "code": status.as_u16(), "message": message });
    let mut response = json_response(status, &body);
    response
        .headers_mut()
        .insert(SHOULD_RETRY, HeaderValue::from_static("false"));
    response
}

/// A JSON answer with this status.
pub fn json_response(status: StatusCode, body: &Value) -> Response {
    let mut response = (status, body.to_string()).into_response();
    response
        .headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    response
}

/// A time as RFC 3339 (`2026-01-02T03:04:05.123456789Z`).
pub fn rfc3339(at: SystemTime) -> String {
    OffsetDateTime::from(at)
        .format(&Rfc3339)
        .unwrap_or_else(|_| "1970-01-01T00:00:00Z".to_owned())
}

/// Why a control-plane call's `X-API-KEY` is refused (401).
#[derive(Debug, thiserror::Error)]
pub enum KeyRefusal {
    /// No `X-API-KEY`.
    #[error("Missing X-API-KEY header")]
    Missing,
    /// An `X-API-KEY` the daemon does not accept.
    #[error("Invalid API key")]
    Wrong,
}

impl IntoResponse for KeyRefusal {
    fn into_response(self) -> Response {
        error_response(StatusCode::UNAUTHORIZED, &self.to_string())
    }
}

/// Checks a call's `X-API-KEY` against the daemon's tokens.
pub fn check_api_key(facade: &crate::Facade, headers: &HeaderMap) -> Result<(), KeyRefusal> {
    match headers.get("x-api-key").and_then(|v| v.to_str().ok()) {
        None => Err(KeyRefusal::Missing),
        Some(key) if !(facade.api_key)(key) => Err(KeyRefusal::Wrong),
        Some(_) => Ok(()),
    }
}

//! Bearer-token authentication, shared by `/ws`, `/artifacts`, `/metrics` and the agent routes.

use axum::http::HeaderMap;

/// Constant-time check of `Authorization: Bearer <token>` against every configured token.
pub(crate) fn authorized(headers: &HeaderMap, tokens: &[String]) -> bool {
    let Some(given) = headers
        .get(axum::http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
    else {
        return false;
    };
    accepted(given, tokens)
}

/// Whether `given` is one of the configured tokens (also the E2B API's `X-API-KEY`). Compares against all of them
/// without stopping early, so timing says nothing about which one was close.
pub(crate) fn accepted(given: &str, tokens: &[String]) -> bool {
    tokens.iter().fold(false, |ok, t| {
        constant_time_eq::constant_time_eq(given.as_bytes(), t.as_bytes()) | ok
    })
}

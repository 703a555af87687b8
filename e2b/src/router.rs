//! One listener for both planes: the control plane ([`crate::api`], `/sandboxes`, `/v2/sandboxes`) and the sandbox
//! plane ([`crate::envd`], `/files`, `/health`, `/process.Process/*`, `/filesystem.Filesystem/*`). Their paths do
//! not collide, so `E2B_API_URL` and `E2B_SANDBOX_URL` may both name it. Whatever is not served answers 501 with
//! `Should-Retry: false` (a Connect `unimplemented` for RPC paths), never a bare 404, which the SDK would read as
//! "not found".

use axum::extract::Request;

use axum::response::{IntoResponse, Response};

use axum::Router;

use crate::api::ApiError;
use crate::connect::{is_stream_request, ConnectError};
use crate::Facade;

/// The facade's HTTP service: the control plane and the sandbox plane on one router, with the 501 fallbacks.
pub fn router(facade: Facade) -> Router {
    let mut routes = Router::new()
        .merge(crate::api::routes(facade.clone()))
        .merge(crate::envd::routes())
        .merge(crate::contexts::routes(Default::default()));
    if facade.fleet.is_some() {
        routes = routes.merge(crate::fleet::routes());
    }
    routes
        .fallback(fallback)
        .method_not_allowed_fallback(fallback)
        .layer(axum::middleware::from_fn_with_state(
            facade.clone(),
            crate::fleet::route,
        ))
        .layer(axum::middleware::map_response(close_after_refusal))
        .with_state(facade)
}

/// A refusal may be sent before the request's body is read (an unknown sandbox, a wrong token), and hyper then
/// closes the connection after the answer: `Connection: close` says so, so that the SDK's pool opens a new
/// connection for its next call instead of writing into this one (a broken pipe, which the SDK does not retry).
async fn close_after_refusal(mut response: Response) -> Response {
    if response.status().is_client_error() || response.status().is_server_error() {
        response.headers_mut().insert(
            axum::http::header::CONNECTION,
            axum::http::HeaderValue::from_static("close"),
        );
    }
    response
}

/// Whether a path names a Connect RPC: `/<package>.<Service>/<Method>`.
fn is_rpc_path(path: &str) -> bool {
    let mut parts = path.trim_start_matches('/').split('/');
    let (Some(service), Some(method), None) = (parts.next(), parts.next(), parts.next()) else {
        return false;
    };
    let word = |s: &str| {
        !s.is_empty()
            && s.chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '.')
    };
    service.contains('.') && word(service) && word(method)
}

/// Anything not served: a Connect `unimplemented` for RPC paths (in the stream's form for streaming calls), 501
/// `{"code":501,"message":...}` with `Should-Retry: false` for the rest.
async fn fallback(request: Request) -> Response {
    let path = request.uri().path().to_owned();
    if is_rpc_path(&path) {
        let err = ConnectError::unimplemented(format!(
            "{} is not supported by sandboxd",
            path.trim_start_matches('/')
        ));
        if is_stream_request(request.headers()) {
            return err.into_stream_response();
        }
        return err.into_response();
    }
    ApiError::not_supported(request.method(), &path).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rpc_paths() {
        assert!(is_rpc_path("/process.Process/Start"));
        assert!(is_rpc_path("/foo.v1.Bar/Baz"));
        assert!(!is_rpc_path("/sandboxes/abc"));
        assert!(!is_rpc_path("/templates"));
        assert!(!is_rpc_path("/a.b/c/d"));
    }
}

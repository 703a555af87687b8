//! Authentication: a static bearer token, or a [`TokenProvider`] consulted on every connect and reconnect (the original
//! design's token manager, `docs/spec/fsp-v1.md` Appendix A), so a rotated token is picked up by the next connection.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use crate::error::BoxError;

/// The future a [`TokenProvider`] returns.
pub type TokenFuture<'a> = Pin<Box<dyn Future<Output = Result<String, BoxError>> + Send + 'a>>;

/// Hands out the current bearer token. Asked once per connection attempt (first connect, every reconnect, every
/// new pooled connection), never per message.
///
/// A closure `Fn() -> impl Future<Output = Result<String, BoxError>>` is a provider:
///
/// ```
/// use std::sync::Arc;
/// use client::{Auth, BoxError};
///
/// let current = Arc::new(std::sync::Mutex::new(String::from("token-1")));
/// let shared = current.clone();
/// let auth = Auth::provider(move || {
///     let token = shared.lock().map(|t| t.clone()).map_err(|_| BoxError::from("lock poisoned"));
///     async move { token }
/// });
/// // A refresher elsewhere replaces the token; the next (re)connect uses it.
/// *current.lock().unwrap() = String::from("token-2");
/// # drop(auth);
/// ```
pub trait TokenProvider: Send + Sync + 'static {
    /// The token to send as `Authorization: Bearer <token>` now.
    fn token(&self) -> TokenFuture<'_>;
}

impl<F, Fut> TokenProvider for F
where
    F: Fn() -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<String, BoxError>> + Send + 'static,
{
    fn token(&self) -> TokenFuture<'_> {
        Box::pin(self())
    }
}

/// How a client authenticates at the WebSocket upgrade.
#[derive(Clone, Default)]
pub enum Auth {
    /// No `Authorization` header (for servers that do not ask for one).
    #[default]
    None,
    /// The same token on every connection.
    Static(String),
    /// Asked on every connection attempt.
    Provider(Arc<dyn TokenProvider>),
}

impl Auth {
    /// A static token.
    pub fn token(token: impl Into<String>) -> Self {
        Auth::Static(token.into())
    }

    /// A provider asked on every connection attempt.
    pub fn provider(provider: impl TokenProvider) -> Self {
        Auth::Provider(Arc::new(provider))
    }

    /// The token for the next connection attempt, if any.
    pub(crate) async fn current(&self) -> Result<Option<String>, BoxError> {
        match self {
            Auth::None => Ok(None),
            Auth::Static(t) => Ok(Some(t.clone())),
            Auth::Provider(p) => p.token().await.map(Some),
        }
    }
}

impl fmt::Debug for Auth {
    // Never print a token.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Auth::None => f.write_str("Auth::None"),
            Auth::Static(_) => f.write_str("Auth::Static(<redacted>)"),
            Auth::Provider(_) => f.write_str("Auth::Provider(..)"),
        }
    }
}

impl From<String> for Auth {
    fn from(token: String) -> Self {
        Auth::Static(token)
    }
}

impl From<&str> for Auth {
    fn from(token: &str) -> Self {
        Auth::Static(token.to_owned())
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU32, Ordering};

    use super::*;

    #[tokio::test]
    async fn a_provider_is_asked_every_time() {
        let calls = Arc::new(AtomicU32::new(0));
        let c = calls.clone();
        let auth = Auth::provider(move || {
            let n = c.fetch_add(1, Ordering::SeqCst) + 1;
            async move { Ok(format!("token-{n}")) }
        });
        assert_eq!(auth.current().await.unwrap().as_deref(), Some("token-1"));
        assert_eq!(auth.current().await.unwrap().as_deref(), Some("token-2"));
        assert_eq!(calls.load(Ordering::SeqCst), 2);
        assert_eq!(format!("{auth:?}"), "Auth::Provider(..)");
        assert_eq!(
            format!("{:?}", Auth::token("secret")),
            "Auth::Static(<redacted>)"
        );
    }
}

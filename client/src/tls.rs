//! rustls client configurations for `wss://` and `https://`, always with the ring provider chosen explicitly (so
//! nothing depends on a process-wide default provider being installed).

use std::sync::Arc;

use rustls::pki_types::CertificateDer;
use rustls::{ClientConfig, RootCertStore};

use crate::error::ClientError;

/// The default: the Mozilla roots shipped in `webpki-roots`.
pub fn default_config() -> Result<Arc<ClientConfig>, ClientError> {
    let mut roots = RootCertStore::empty();
    roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
    config_with_roots(roots)
}

/// A configuration that trusts exactly `roots`.
pub fn config_with_roots(roots: RootCertStore) -> Result<Arc<ClientConfig>, ClientError> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| ClientError::Config(format!("TLS: {e}")))?
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok(Arc::new(config))
}

/// A configuration that trusts the given DER certificates (e.g. a private CA, or a self-signed server
/// certificate in tests).
pub fn config_trusting(
    certs: impl IntoIterator<Item = CertificateDer<'static>>,
) -> Result<Arc<ClientConfig>, ClientError> {
    let mut roots = RootCertStore::empty();
    for cert in certs {
        roots
            .add(cert)
            .map_err(|e| ClientError::Config(format!("TLS root certificate: {e}")))?;
    }
    config_with_roots(roots)
}

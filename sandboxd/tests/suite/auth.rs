//! The upgrade: bearer token (401 before the upgrade) and `X-Protocol-Version` (400 naming the supported
//! versions) (spec section 1).

use serde_json::Value;
use tokio_tungstenite::tungstenite;

use super::harness::{privileged, Client, Daemon, DaemonOpts};

/// The HTTP status and body of a refused upgrade.
async fn refused_upgrade(
    url: &str,
    token: Option<&str>,
    headers: &[(&'static str, &str)],
) -> (u16, String) {
    match Client::try_connect(url, token, headers).await {
        Ok(_) => panic!("the upgrade was accepted (token {token:?}, headers {headers:?})"),
        Err(tungstenite::Error::Http(resp)) => (
            resp.status().as_u16(),
            String::from_utf8_lossy(resp.body().as_deref().unwrap_or_default()).into_owned(),
        ),
        Err(other) => panic!("expected an HTTP refusal of the upgrade, got {other:?}"),
    }
}

#[tokio::test]
async fn missing_or_wrong_token_is_refused_with_401() {
    let Some(_g) = privileged("missing_or_wrong_token_is_refused_with_401").await else {
        return;
    };
    let d = Daemon::start(DaemonOpts::default()).await;
    let url = d.url();
    let good = d.token().to_owned();
    // Same length as the real token, last character changed; a prefix; a longer one; empty.
    let mut near = good.clone();
    near.pop();
    near.push(if good.ends_with('0') { '1' } else { '0' });
    let prefix = good[..good.len() - 1].to_owned();
    let longer = format!("{good}x");
    for token in [
        None,
        Some("wrong-token-0123456789"),
        Some(near.as_str()),
        Some(prefix.as_str()),
        Some(longer.as_str()),
        Some(""),
    ] {
        let (code, body) = refused_upgrade(&url, token, &[]).await;
        assert_eq!(code, 401, "token {token:?}: {body}");
        assert!(!body.contains(&good), "nothing is revealed: {body}");
    }
    // Not `Bearer`.
    let basic = format!("Basic {good}");
    let (code, _) = refused_upgrade(&url, None, &[("Authorization", &basic)]).await;
    assert_eq!(code, 401);
    // Auth comes first: a bad token with a bad version is still 401, and reveals no versions.
    let (code, body) = refused_upgrade(&url, None, &[("X-Protocol-Version", "2")]).await;
    assert_eq!(code, 401, "{body}");
    assert!(
        !body.contains("supported"),
        "a refused client learns nothing else: {body}"
    );

    // The right token works.
    let mut c = Client::connect(&d).await;
    c.assert_usable().await;
}

#[tokio::test]
async fn protocol_version_header() {
    let Some(_g) = privileged("protocol_version_header").await else {
        return;
    };
    let d = Daemon::start(DaemonOpts::default()).await;
    let url = d.url();
    for v in ["2", "0", "abc", "1.1"] {
        let (code, body) =
            refused_upgrade(&url, Some(d.token()), &[("X-Protocol-Version", v)]).await;
        assert_eq!(code, 400, "X-Protocol-Version {v}: {body}");
        assert!(
            body.contains("supported") && body.contains('1'),
            "the 400 body names the supported versions: {body:?}"
        );
        if let Ok(json) = serde_json::from_str::<Value>(&body) {
            assert_eq!(json["supported_versions"], serde_json::json!([1]), "{body}");
        }
    }
    let mut c = Client::try_connect(&url, Some(d.token()), &[("X-Protocol-Version", "1")])
        .await
        .expect("X-Protocol-Version: 1 is accepted");
    c.assert_usable().await;
}

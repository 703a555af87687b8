//! The JSON bodies of the agent-sandbox HTTP routes (`POST /sandboxes` and the adapter-shim commands), read as
//! agents/src/routes.rs `body()` reads them: an all-whitespace body is `{}`, otherwise
//! `serde_path_to_error::deserialize` over `serde_json::Deserializer::from_slice` (no check for trailing bytes,
//! as there). The first input byte picks the route's request type, the rest is the body.
//!
//! Properties: never panics; the refusal message the route builds from the error formats; an accepted request
//! re-serialises to JSON that parses back to the same value.
#![no_main]

use std::fmt::Debug;

use libfuzzer_sys::fuzz_target;
use agent_api::{
    AgentBrief, ContextInjection, CreateSandboxRequest, KillRequest, ReplayRequest, ResolveRequest,
    SerializedAgentState, UpdateBriefRequest,
};
use serde::de::DeserializeOwned;
use serde::Serialize;

/// routes.rs `Empty`: the body of `POST /pause`.
#[derive(Debug, PartialEq, serde::Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
struct Empty {}

/// routes.rs `body()` without the size limit (axum's, before parsing).
fn body<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, String> {
    let bytes: &[u8] = if bytes.iter().all(u8::is_ascii_whitespace) {
        b"{}"
    } else {
        bytes
    };
    let de = &mut serde_json::Deserializer::from_slice(bytes);
    serde_path_to_error::deserialize(de).map_err(|e| {
        let path = e.path().to_string();
        format!("Malformed request body at {path}: {}", e.into_inner())
    })
}

fn check<T: DeserializeOwned + Serialize + PartialEq + Debug>(bytes: &[u8]) {
    let Ok(req) = body::<T>(bytes) else {
        return;
    };
    let json = match serde_json::to_vec(&req) {
        Ok(j) => j,
        Err(e) => panic!("accepted body does not serialise: {e}"),
    };
    match body::<T>(&json) {
        Ok(again) => assert_eq!(again, req, "{}", String::from_utf8_lossy(&json)),
        Err(e) => panic!(
            "re-serialised body refused: {e}\n{}",
            String::from_utf8_lossy(&json)
        ),
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((route, bytes)) = data.split_first() else {
        return;
    };
    match route % 9 {
        0 => check::<CreateSandboxRequest>(bytes),
        1 => check::<AgentBrief>(bytes),
        2 => check::<Empty>(bytes),
        3 => check::<SerializedAgentState>(bytes),
        4 => check::<KillRequest>(bytes),
        5 => check::<ResolveRequest>(bytes),
        6 => check::<ContextInjection>(bytes),
        7 => check::<UpdateBriefRequest>(bytes),
        _ => check::<ReplayRequest>(bytes),
    }
});

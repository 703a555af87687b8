//! What the runtime decodes from another process: the helper's requests (read by the helper,
//! runtime/src/helper/child.rs) and events (read by the daemon, runtime/src/helper/client.rs), one JSON document per
//! seqpacket datagram of at most `ipc::MAX_MESSAGE` bytes; the launch payload an init reads from its memfd
//! (`runtime::launch::decode`); and the status-pipe record an init and its program write
//! (`runtime::init::Report::decode`, on the text read with `String::from_utf8_lossy`). The first input byte picks
//! the decoder, the rest is the message.
//!
//! Properties: never panics; an accepted message re-encodes to one that decodes to the same value (a launch
//! still with an absolute program); a decoded exit record re-encodes to itself.
#![no_main]

use libfuzzer_sys::fuzz_target;
use runtime::helper::{Event, Request};
use runtime::init::{ProgramExit, Report};
use runtime::{ipc, launch};
use serde::de::DeserializeOwned;
use serde::Serialize;

/// Decodes one datagram as the receiving side does and checks the round trip through the sending side's encoding.
fn datagram<T: DeserializeOwned + Serialize>(bytes: &[u8]) {
    if bytes.len() > ipc::MAX_MESSAGE {
        return;
    }
    let Ok(message) = serde_json::from_slice::<T>(bytes) else {
        return;
    };
    let (Ok(wire), Ok(value)) = (serde_json::to_vec(&message), serde_json::to_value(&message))
    else {
        panic!("a decoded message does not encode");
    };
    match serde_json::from_slice::<T>(&wire).map(|m| serde_json::to_value(&m)) {
        Ok(Ok(again)) => assert_eq!(again, value, "{}", String::from_utf8_lossy(&wire)),
        _ => panic!(
            "re-encoded message refused: {}",
            String::from_utf8_lossy(&wire)
        ),
    }
}

fn launch_payload(bytes: &[u8]) {
    let Ok(l) = launch::decode(bytes) else {
        return;
    };
    assert!(l.args.first().is_some_and(|a| a.starts_with('/')));
    let wire = match serde_json::to_vec(&l) {
        Ok(w) => w,
        Err(e) => panic!("launch does not encode: {e}"),
    };
    match launch::decode(&wire) {
        Ok(again) => assert_eq!(again, l),
        Err(e) => panic!("re-encoded launch refused: {e}"),
    }
}

fn status_record(bytes: &[u8]) {
    let text = String::from_utf8_lossy(bytes);
    let report = Report::decode(&text);
    if let Some(exit) = report.exit {
        assert_eq!(ProgramExit::decode(&exit.encode()), Some(exit));
    }
    if let Some(exit) = ProgramExit::decode(&text) {
        assert_eq!(ProgramExit::decode(&exit.encode()), Some(exit));
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((which, bytes)) = data.split_first() else {
        return;
    };
    match which % 4 {
        0 => datagram::<Request>(bytes),
        1 => datagram::<Event>(bytes),
        2 => launch_payload(bytes),
        _ => status_record(bytes),
    }
});

//! FSP/1 client messages as JSON, written out by hand rather than serialized from the protocol crate's types: a
//! test or a conformance case can then send what no well-typed client would (an unknown language, a missing
//! field, a wrong type) by merging changes in with [`with`], and a misspelling in the protocol crate's serde
//! attributes is not copied into the messages that test it.

use serde_json::{json, Value};

/// The current time as an FSP timestamp (UTC, milliseconds).
pub fn ts() -> String {
    protocol::now_ts()
}

/// A `ping`.
pub fn ping() -> Value {
    json!({"v": 1, "type": "ping", "ts": ts()})
}

/// A `cancel` of `id`.
pub fn cancel(id: &str) -> Value {
    json!({"v": 1, "type": "cancel", "id": id, "ts": ts()})
}

/// An `execute` with the two required limits.
pub fn execute(id: &str, language: &str, code: &str, timeout_ms: u64, memory_mb: u64) -> Value {
    json!({
        "v": 1, "type": "execute", "id": id, "ts": ts(),
        "language": language, "code": code,
        "limits": {"timeout_ms": timeout_ms, "memory_mb": memory_mb},
    })
}

/// `base` with `extra` merged in (see [`merge`]).
pub fn with(mut base: Value, extra: Value) -> Value {
    merge(&mut base, extra);
    base
}

/// Merges `extra` into `base`: objects recursively; a `null` in `extra` removes the key; anything else replaces.
pub fn merge(base: &mut Value, extra: Value) {
    match (base, extra) {
        (Value::Object(b), Value::Object(e)) => {
            for (k, v) in e {
                if v.is_null() {
                    b.remove(&k);
                } else {
                    match b.get_mut(&k) {
                        Some(slot) if slot.is_object() && v.is_object() => merge(slot, v),
                        _ => {
                            b.insert(k, v);
                        }
                    }
                }
            }
        }
        (b, e) => *b = e,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merging() {
        let e = with(
            execute("a", "shell", "x", 1, 2),
            json!({"limits": {"memory_mb": null, "pids_max": 3}, "code": null}),
        );
        assert_eq!(e["limits"], json!({"timeout_ms": 1, "pids_max": 3}));
        assert!(e.get("code").is_none());
        assert_eq!(with(json!({"a": 1}), json!([2])), json!([2]));
    }

    #[test]
    fn messages() {
        let p = ping();
        assert_eq!(
            (p["v"].as_u64(), p["type"].as_str()),
            (Some(1), Some("ping"))
        );
        assert!(protocol::parse_ts(p["ts"].as_str().unwrap()).is_ok());
        assert_eq!(cancel("x")["id"], "x");
        let e = execute("a", "python", "print(1)", 5, 64);
        assert_eq!(e["language"], "python");
        assert_eq!(e["limits"], json!({"timeout_ms": 5, "memory_mb": 64}));
    }
}

//! Every refusal of spec sections 2 and 3: the code, whether the id is echoed, and that the message names the field.

use protocol::{
    parse_client_message, ClientMessage, ErrorCode, ExecuteRequest, Limits, MAX_ID_LEN,
};
use serde_json::{json, Map, Value};

use super::{invalid, refused};

const ID: Option<&str> = Some("exec_1");

/// A valid `execute` with only the required fields.
fn execute() -> Map<String, Value> {
    let value = json!({"v":1,"type":"execute","id":"exec_1","ts":"2026-01-20T12:34:56.000Z","language":"python",
                       "code":"print(1)","limits":{"timeout_ms":1000,"memory_mb":64}});
    value.as_object().unwrap().clone()
}

/// The base `execute` changed by `edit`, as text.
fn execute_with(edit: impl FnOnce(&mut Map<String, Value>)) -> String {
    let mut obj = execute();
    edit(&mut obj);
    Value::Object(obj).to_string()
}

fn parse_execute(text: &str) -> ExecuteRequest {
    match parse_client_message(text) {
        Ok(ClientMessage::Execute(req)) => req,
        other => panic!("{text}: {other:?}"),
    }
}

#[test]
fn base_execute_is_accepted() {
    let req = parse_execute(&execute_with(|_| {}));
    assert_eq!(req.limits.timeout_ms, 1000);
    assert!(
        req.env.is_empty()
            && req.files.is_empty()
            && req.stdin.is_none()
            && req.artifacts.is_none()
    );
}

#[test]
fn not_an_object() {
    for text in ["[1,2]", "[]", "\"execute\"", "42", "null", "true"] {
        let err = invalid(text, None, "JSON object");
        assert_eq!(err.supported_versions, None);
    }
    // Not even a usable id is read from a non-object.
    invalid(
        r#"[{"v":1,"type":"ping","id":"exec_1","ts":"..."}]"#,
        None,
        "got an array",
    );
}

#[test]
fn invalid_json() {
    for text in [
        "",
        "{",
        r#"{"v":1,"#,
        "{'v':1}",
        r#"{"v":1}x"#,
        "\u{feff}{}",
    ] {
        invalid(text, None, "Invalid JSON");
    }
}

#[test]
fn version() {
    let missing = invalid(&execute_with(|o| drop(o.remove("v"))), ID, "v");
    assert_eq!(missing.supported_versions, Some(vec![1]));
    for v in [json!(2), json!(0), json!(-1), json!(u64::MAX)] {
        let err = invalid(
            &execute_with(|o| drop(o.insert("v".into(), v.clone()))),
            ID,
            "supported versions: [1]",
        );
        assert_eq!(err.supported_versions, Some(vec![1]), "v={v}");
    }
    for v in [json!("1"), json!(1.5), json!(null), json!([1])] {
        let err = invalid(
            &execute_with(|o| drop(o.insert("v".into(), v.clone()))),
            ID,
            "Field v",
        );
        assert_eq!(err.supported_versions, Some(vec![1]), "v={v}");
    }
    // Without a usable id there is none to echo.
    let err = invalid(r#"{"v":2,"type":"ping","ts":"..."}"#, None, "v");
    assert_eq!(err.supported_versions, Some(vec![1]));
    // The version is checked before the type.
    invalid(
        r#"{"v":2,"type":"launch","id":"exec_1","ts":"..."}"#,
        ID,
        "version 2",
    );
}

#[test]
fn message_type() {
    invalid(
        &execute_with(|o| drop(o.remove("type"))),
        ID,
        "Missing field type",
    );
    let err = invalid(
        &execute_with(|o| drop(o.insert("type".into(), json!("launch")))),
        ID,
        "\"launch\"",
    );
    assert!(err.message.contains("type"), "{}", err.message);
    // Server message types are not client message types.
    invalid(
        r#"{"v":1,"type":"ack","id":"exec_1","ts":"..."}"#,
        ID,
        "\"ack\"",
    );
    invalid(
        r#"{"v":1,"type":"Execute","id":"exec_1","ts":"..."}"#,
        ID,
        "\"Execute\"",
    );
    invalid(r#"{"v":1,"type":7,"ts":"..."}"#, None, "Field type");
}

#[test]
fn timestamp() {
    invalid(
        &execute_with(|o| drop(o.remove("ts"))),
        ID,
        "Missing field ts",
    );
    invalid(
        &execute_with(|o| drop(o.insert("ts".into(), json!(1)))),
        ID,
        "Field ts",
    );
    invalid(r#"{"v":1,"type":"ping"}"#, None, "Missing field ts");
    invalid(
        r#"{"v":1,"type":"cancel","id":"exec_1"}"#,
        ID,
        "Missing field ts",
    );
}

#[test]
fn missing_fields_are_named() {
    for field in ["language", "code", "limits"] {
        let err = invalid(&execute_with(|o| drop(o.remove(field))), ID, field);
        assert_eq!(err.message, format!("Missing field {field}"));
    }
    for field in ["timeout_ms", "memory_mb"] {
        let text = execute_with(|o| drop(o["limits"].as_object_mut().unwrap().remove(field)));
        let err = invalid(&text, ID, &format!("limits.{field}"));
        assert_eq!(err.message, format!("Missing field limits.{field}"));
    }
    invalid(
        &execute_with(|o| drop(o.insert("files".into(), json!([{"path":"a"}])))),
        ID,
        "files[0].content",
    );
    invalid(
        &execute_with(|o| drop(o.insert("artifacts".into(), json!({})))),
        ID,
        "artifacts.paths",
    );
}

#[test]
fn wrong_types_name_the_path() {
    let text = execute_with(|o| {
        drop(
            o["limits"]
                .as_object_mut()
                .unwrap()
                .insert("timeout_ms".into(), json!("x")),
        )
    });
    let err = invalid(&text, ID, "limits.timeout_ms");
    assert_eq!(
        err.message,
        r#"Field limits.timeout_ms: invalid type: string "x", expected u64"#
    );
    let cases = [
        ("code", json!(1), "Field code"),
        ("stdin", json!(1), "Field stdin"),
        ("env", json!({"K": 1}), "Field env.K"),
        ("env", json!([]), "Field env"),
        (
            "limits",
            json!({"timeout_ms": -1, "memory_mb": 1}),
            "Field limits.timeout_ms",
        ),
        (
            "limits",
            json!({"timeout_ms": 1.5, "memory_mb": 1}),
            "Field limits.timeout_ms",
        ),
        (
            "limits",
            json!({"timeout_ms": 1, "memory_mb": 1, "pids_max": "64"}),
            "Field limits.pids_max",
        ),
        (
            "limits",
            json!("fast"),
            "Field limits: invalid type: string \"fast\", expected a limits object",
        ),
        (
            "files",
            json!([{"path": 1, "content": ""}]),
            "Field files[0].path",
        ),
        (
            "files",
            json!([{"path": "a", "content": ""}, {"path": "b", "content": "", "encoding": "hex"}]),
            "Field files[1].encoding",
        ),
        (
            "artifacts",
            json!({"paths": "out/**"}),
            "Field artifacts.paths",
        ),
    ];
    for (field, value, needle) in cases {
        invalid(
            &execute_with(|o| drop(o.insert(field.into(), value.clone()))),
            ID,
            needle,
        );
    }
    // A language that is not a string is malformed, not unsupported.
    invalid(
        &execute_with(|o| drop(o.insert("language".into(), json!(3)))),
        ID,
        "Field language",
    );
    invalid(
        &execute_with(|o| drop(o.insert("language".into(), json!(null)))),
        ID,
        "Field language",
    );
}

#[test]
fn nulls_of_optional_fields_mean_absent() {
    let text = execute_with(|o| {
        for field in ["stdin", "env", "files", "artifacts"] {
            o.insert(field.into(), Value::Null);
        }
        o["limits"]
            .as_object_mut()
            .unwrap()
            .insert("cpu_shares".into(), Value::Null);
    });
    let req = parse_execute(&text);
    assert_eq!(req.limits.cpu_shares, None);
}

#[test]
fn unknown_fields_in_execute_are_refused() {
    let err = invalid(
        &execute_with(|o| drop(o.insert("foo".into(), json!(1)))),
        ID,
        "foo",
    );
    assert_eq!(
        err.message,
        "Unknown field foo; expected one of language, code, stdin, env, limits, files, artifacts, tools, tool_timeout_ms, warm, traceparent, network, mounts, snapshot"
    );
    let text = execute_with(|o| {
        drop(
            o["limits"]
                .as_object_mut()
                .unwrap()
                .insert("cpu_quota".into(), json!(1)),
        )
    });
    let err = invalid(&text, ID, "limits.cpu_quota");
    assert!(
        err.message
            .starts_with("Unknown field limits.cpu_quota; expected one of timeout_ms"),
        "{}",
        err.message
    );
    let files = json!([{"path":"a","content":"","mode":"0755"}]);
    let err = invalid(
        &execute_with(|o| drop(o.insert("files".into(), files.clone()))),
        ID,
        "files[0].mode",
    );
    assert_eq!(
        err.message,
        "Unknown field files[0].mode; expected one of path, content, encoding"
    );
    let artifacts = json!({"paths":["out/**"],"max_files":3});
    let err = invalid(
        &execute_with(|o| drop(o.insert("artifacts".into(), artifacts.clone()))),
        ID,
        "max_files",
    );
    assert_eq!(
        err.message,
        "Unknown field artifacts.max_files; expected paths or types"
    );
}

#[test]
fn unknown_fields_in_cancel_and_ping_are_ignored() {
    let cancel =
        parse_client_message(r#"{"v":1,"type":"cancel","id":"exec_1","ts":"...","reason":"user"}"#);
    assert!(matches!(cancel, Ok(ClientMessage::Cancel(c)) if c.id == "exec_1"));
    let ping =
        parse_client_message(r#"{"v":1,"type":"ping","ts":"...","nonce":5,"id":"not usable!"}"#);
    assert!(matches!(ping, Ok(ClientMessage::Ping(_))));
}

#[test]
fn bad_ids() {
    let long = "x".repeat(MAX_ID_LEN + 1);
    for id in [
        json!(long),
        json!("exec 1"),
        json!("exec/1"),
        json!(""),
        json!("é"),
        json!(12),
        json!(null),
    ] {
        let err = invalid(
            &execute_with(|o| drop(o.insert("id".into(), id.clone()))),
            None,
            "Field id",
        );
        assert!(err.message.contains("128"), "{}", err.message);
        let cancel = json!({"v":1,"type":"cancel","id":id,"ts":"..."}).to_string();
        invalid(&cancel, None, "Field id");
    }
    invalid(
        &execute_with(|o| drop(o.remove("id"))),
        None,
        "Missing field id",
    );
    invalid(
        r#"{"v":1,"type":"cancel","ts":"..."}"#,
        None,
        "Missing field id",
    );
    let max = "x".repeat(MAX_ID_LEN);
    assert_eq!(
        parse_execute(&execute_with(|o| drop(
            o.insert("id".into(), json!(max.clone()))
        )))
        .id,
        max
    );
    // An unusable id is never echoed, even in later errors.
    invalid(
        &execute_with(|o| drop(o.insert("id".into(), json!("bad id"))))
            .replace("\"v\":1", "\"v\":9"),
        None,
        "v",
    );
}

#[test]
fn unknown_language_is_not_supported() {
    for language in ["rust", "Python", ""] {
        let text = execute_with(|o| drop(o.insert("language".into(), json!(language))));
        let err = refused(&text, ErrorCode::LanguageNotSupported, ID);
        assert!(
            err.message.contains(&format!("{language:?}")),
            "{}",
            err.message
        );
        assert!(!err.retryable());
    }
}

#[test]
fn limits_above_the_maximum_or_zero() {
    let max = Limits {
        timeout_ms: 60_000,
        memory_mb: 1024,
        cpu_shares: 1024,
        max_output_bytes: 4 << 20,
        pids_max: 128,
        disk_mb: 256,
        cpu_cores: protocol::CpuCores::new(1.5),
    };
    let text = execute_with(|o| {
        drop(
            o["limits"]
                .as_object_mut()
                .unwrap()
                .insert("memory_mb".into(), json!(4096)),
        )
    });
    let req = parse_execute(&text);
    let err = req.resolve_limits(&max).unwrap_err();
    assert_eq!(err.id.as_deref(), Some("exec_1"));
    assert_eq!(err.code, ErrorCode::InvalidRequest);
    assert_eq!(
        err.message,
        "Field limits.memory_mb 4096 exceeds the maximum 1024"
    );

    for limit in [
        "timeout_ms",
        "memory_mb",
        "cpu_shares",
        "max_output_bytes",
        "pids_max",
        "disk_mb",
    ] {
        let text = execute_with(|o| {
            drop(
                o["limits"]
                    .as_object_mut()
                    .unwrap()
                    .insert(limit.into(), json!(0)),
            )
        });
        let err = parse_execute(&text).resolve_limits(&max).unwrap_err();
        assert_eq!(
            err.message,
            format!("Field limits.{limit} must be greater than 0")
        );
        assert_eq!(err.id.as_deref(), Some("exec_1"));

        let over = max
            .entries()
            .into_iter()
            .find(|(name, _)| *name == limit)
            .unwrap()
            .1
            + 1;
        let text = execute_with(|o| {
            drop(
                o["limits"]
                    .as_object_mut()
                    .unwrap()
                    .insert(limit.into(), json!(over)),
            )
        });
        let err = parse_execute(&text).resolve_limits(&max).unwrap_err();
        assert!(err.message.contains(&format!(
            "limits.{limit} {over} exceeds the maximum {}",
            over - 1
        )));
    }
    let effective = parse_execute(&execute_with(|_| {}))
        .resolve_limits(&max)
        .unwrap();
    assert_eq!(
        (
            effective.cpu_shares,
            effective.max_output_bytes,
            effective.pids_max
        ),
        (512, 1 << 20, 64)
    );
    assert_eq!(effective.cpu_cores, max.cpu_cores);
    let text = execute_with(|o| {
        drop(
            o["limits"]
                .as_object_mut()
                .unwrap()
                .insert("cpu_cores".into(), json!(1.75)),
        )
    });
    let err = parse_execute(&text).resolve_limits(&max).unwrap_err();
    assert_eq!(
        err.message,
        "Field limits.cpu_cores 1.75 exceeds the maximum 1.5"
    );
    // Below the kernel's smallest quota is not a number of cores at all: refused when parsed, naming the field.
    let text = execute_with(|o| {
        drop(
            o["limits"]
                .as_object_mut()
                .unwrap()
                .insert("cpu_cores".into(), json!(0)),
        )
    });
    let err = parse_client_message(&text).unwrap_err();
    assert_eq!(err.code, ErrorCode::InvalidRequest);
    assert!(err.message.contains("limits.cpu_cores"), "{}", err.message);
    assert!(err.message.contains("at least 0.01"), "{}", err.message);
}

#[test]
fn file_paths_must_stay_inside() {
    let cases = [
        ("..", "`..`"),
        ("../x", "`..`"),
        ("/etc/passwd", "absolute"),
        ("a/../../b", "`..`"),
        ("", "empty"),
        ("./a", "`.`"),
        ("a//b", "empty component"),
        ("a/", "empty component"),
        ("a\u{0}b", "NUL"),
    ];
    for (path, why) in cases {
        let files = json!([{"path":"ok.txt","content":""}, {"path":path,"content":"x"}]);
        let err = invalid(
            &execute_with(|o| drop(o.insert("files".into(), files.clone()))),
            ID,
            "files[1].path",
        );
        assert!(err.message.contains(why), "{path:?}: {}", err.message);
        assert!(
            err.message.starts_with("Field files[1].path: path "),
            "{path:?}: {}",
            err.message
        );
    }
    let too_long = "a/".repeat(2048) + "b";
    let files = json!([{"path":too_long,"content":""}]);
    invalid(
        &execute_with(|o| drop(o.insert("files".into(), files.clone()))),
        ID,
        "files[0].path",
    );
}

#[test]
fn file_collisions() {
    let cases = [
        (
            json!(["a", "b", "a"]),
            "files[2].path: duplicate of files[0].path",
        ),
        (json!(["a", "a/b"]), "files[1].path"),
        (json!(["a/b", "a"]), "files[1].path"),
        (json!(["x/y/z", "x/y"]), "files[1].path"),
        (json!(["x/y", "x/y/z/w"]), "files[1].path"),
    ];
    for (paths, needle) in cases {
        let files: Vec<Value> = paths
            .as_array()
            .unwrap()
            .iter()
            .map(|p| json!({"path":p,"content":""}))
            .collect();
        invalid(
            &execute_with(|o| drop(o.insert("files".into(), json!(files)))),
            ID,
            needle,
        );
    }
    // Siblings and shared directories are fine.
    let files =
        json!([{"path":"a/b","content":""},{"path":"a/c","content":""},{"path":"ab","content":""}]);
    assert_eq!(
        parse_execute(&execute_with(|o| drop(
            o.insert("files".into(), files.clone())
        )))
        .files
        .len(),
        3
    );
}

#[test]
fn file_content() {
    let files = json!([{"path":"a.bin","content":"not base64!","encoding":"base64"}]);
    let err = invalid(
        &execute_with(|o| drop(o.insert("files".into(), files.clone()))),
        ID,
        "files[0].content",
    );
    assert!(
        err.message
            .starts_with("Field files[0].content: content is not valid base64: "),
        "{}",
        err.message
    );
    let files = json!([{"path":"a.bin","content":"AP8=","encoding":"base64"},{"path":"t","content":"é\u{0}"}]);
    let req = parse_execute(&execute_with(|o| {
        drop(o.insert("files".into(), files.clone()))
    }));
    assert_eq!(req.files[0].decoded().unwrap(), [0x00, 0xFF]);
    assert_eq!(req.files[1].decoded().unwrap(), "é\0".as_bytes());
}

#[test]
fn env_and_code() {
    let cases = [
        (json!({"A=B": "1"}), "env.A=B"),
        (json!({"": "1"}), "env.:"),
        (json!({"A\u{0}": "1"}), "env.A\\0"),
        (json!({"A": "1\u{0}"}), "env.A"),
    ];
    for (env, needle) in cases {
        invalid(
            &execute_with(|o| drop(o.insert("env".into(), env.clone()))),
            ID,
            needle,
        );
    }
    let req = parse_execute(&execute_with(|o| {
        drop(o.insert("env".into(), json!({"PATH_EXTRA": "a=b"})))
    }));
    assert_eq!(req.env["PATH_EXTRA"], "a=b");
    invalid(
        &execute_with(|o| drop(o.insert("code".into(), json!("a\u{0}b")))),
        ID,
        "Field code",
    );
    // NUL is fine in stdin: it is written to a pipe.
    assert!(parse_execute(&execute_with(|o| drop(
        o.insert("stdin".into(), json!("\u{0}"))
    )))
    .stdin
    .is_some());
}

#[test]
fn artifact_globs() {
    for (glob, needle) in [
        ("../x", "`..`"),
        ("/abs/**", "absolute"),
        ("", "empty"),
        ("out/../../x", "`..`"),
    ] {
        let artifacts = json!({"paths":["ok/**", glob]});
        let err = invalid(
            &execute_with(|o| drop(o.insert("artifacts".into(), artifacts.clone()))),
            ID,
            "artifacts.paths[1]",
        );
        assert!(err.message.contains(needle), "{glob:?}: {}", err.message);
    }
    let artifacts = json!({"paths":["out/**"],"types":{"other/**":"patch"}});
    invalid(
        &execute_with(|o| drop(o.insert("artifacts".into(), artifacts.clone()))),
        ID,
        "artifacts.types.other/**",
    );
    let artifacts = json!({"paths":["out/**"],"types":{"out/**":""}});
    invalid(
        &execute_with(|o| drop(o.insert("artifacts".into(), artifacts.clone()))),
        ID,
        "artifacts.types.out/**",
    );
    let artifacts = json!({"paths":["out/**","*.md"],"types":{"out/**":"test_report"}});
    let req = parse_execute(&execute_with(|o| {
        drop(o.insert("artifacts".into(), artifacts.clone()))
    }));
    assert_eq!(
        req.artifacts.unwrap().types.unwrap()["out/**"],
        "test_report"
    );
}

#[test]
fn traceparent_must_be_w3c() {
    let good = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let text = execute_with(|o| drop(o.insert("traceparent".into(), json!(good))));
    assert_eq!(parse_execute(&text).traceparent.as_deref(), Some(good));
    for bad in [
        "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
        "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
        "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
        "",
    ] {
        let text = execute_with(|o| drop(o.insert("traceparent".into(), json!(bad))));
        let err = parse_client_message(&text).unwrap_err();
        assert_eq!(err.code, ErrorCode::InvalidRequest, "{bad}");
        assert!(
            err.message.starts_with("Field traceparent"),
            "{bad}: {}",
            err.message
        );
        assert_eq!(err.id.as_deref(), Some("exec_1"));
    }
}

#[test]
fn mounts_stay_under_the_working_directory_and_apart() {
    let m = |v: &str, p: &str| json!({"volume": v, "path": p});
    let with = |mounts: Value, files: Value| {
        execute_with(|o| {
            o.insert("mounts".into(), mounts);
            o.insert("files".into(), files);
        })
    };
    let ok = parse_execute(&with(
        json!([m("vol-a", "/workspace/data"), {"volume": "vol-b", "path": "/workspace/ref/x", "read_only": true}]),
        json!([{"path": "data2/f", "content": ""}]),
    ));
    assert_eq!(ok.mounts.len(), 2);
    assert_eq!(
        (ok.mounts[0].relative(), ok.mounts[1].read_only),
        ("data", true)
    );
    let cases = [
        (
            json!([m("vol-a", "/workspace")]),
            json!([]),
            "mounts[0].path",
        ),
        (json!([m("vol-a", "/etc")]), json!([]), "mounts[0].path"),
        (
            json!([m("vol-a", "/workspace/../etc")]),
            json!([]),
            "mounts[0].path",
        ),
        (
            json!([m("", "/workspace/a")]),
            json!([]),
            "mounts[0].volume",
        ),
        (
            json!([m("a/b", "/workspace/a")]),
            json!([]),
            "mounts[0].volume",
        ),
        (
            json!([m("vol-a", "/workspace/a"), m("vol-b", "/workspace/a/b")]),
            json!([]),
            "mounts[1]",
        ),
        (
            json!([m("vol-a", "/workspace/a"), m("vol-a", "/workspace/b")]),
            json!([]),
            "mounts[1]",
        ),
        (
            json!([m("vol-a", "/workspace/a")]),
            json!([{"path": "a/f", "content": ""}]),
            "files",
        ),
        (
            json!((0..9)
                .map(|i| m(&format!("v{i}"), &format!("/workspace/{i}")))
                .collect::<Vec<_>>()),
            json!([]),
            "mounts",
        ),
        (
            json!([{"volume": "v", "path": "/workspace/a", "extra": 1}]),
            json!([]),
            "mounts[0]",
        ),
    ];
    for (mounts, files, field) in cases {
        invalid(&with(mounts.clone(), files), ID, field);
    }
}

#[test]
fn a_snapshot_is_an_id_and_not_with_mounts() {
    let ok = parse_execute(&execute_with(|o| {
        o.insert("snapshot".into(), json!("snap-0123abcd"));
    }));
    assert_eq!(ok.snapshot.as_deref(), Some("snap-0123abcd"));
    for snapshot in [json!(""), json!("snap/../x"), json!("a b")] {
        invalid(
            &execute_with(|o| drop(o.insert("snapshot".into(), snapshot.clone()))),
            ID,
            "Field snapshot",
        );
    }
    invalid(
        &execute_with(|o| {
            o.insert("snapshot".into(), json!("snap-1"));
            o.insert(
                "mounts".into(),
                json!([{"volume": "vol-a", "path": "/workspace/data"}]),
            );
        }),
        ID,
        "not with snapshot",
    );
}

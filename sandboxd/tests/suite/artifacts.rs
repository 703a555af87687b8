//! Artifacts (`docs/spec/artifact-manifest.md`): collected after the program ends, stored by sha256, served at
//! `GET /artifacts/sha256/<hex>` with the bearer token, listed in `result.artifacts` with what was skipped and why.

use std::time::Duration;

use protocol::ExecStatus;
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use protocol::Limits;

use super::harness::{exec_json, privileged, with, Client, Daemon, DaemonOpts, MAX_LIMITS};

/// `GET` (or `HEAD`) with the bearer token: status, headers (lowercased names), body.
async fn fetch(
    d: &Daemon,
    method: &str,
    path: &str,
    token: Option<&str>,
) -> (u16, Vec<(String, String)>, Vec<u8>) {
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", d.port))
        .await
        .unwrap();
    let auth = token
        .map(|t| format!("Authorization: Bearer {t}\r\n"))
        .unwrap_or_default();
    s.write_all(
        format!("{method} {path} HTTP/1.1\r\nHost: x\r\n{auth}Connection: close\r\n\r\n")
            .as_bytes(),
    )
    .await
    .unwrap();
    let mut buf = Vec::new();
    tokio::time::timeout(Duration::from_secs(30), s.read_to_end(&mut buf))
        .await
        .expect("HTTP response in time")
        .unwrap();
    let split = buf
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("header end");
    let head = String::from_utf8_lossy(&buf[..split]).into_owned();
    let mut lines = head.lines();
    let code = lines
        .next()
        .unwrap()
        .split_whitespace()
        .nth(1)
        .unwrap()
        .parse()
        .unwrap();
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect();
    (code, headers, buf[split + 4..].to_vec())
}

fn header<'a>(headers: &'a [(String, String)], name: &str) -> Option<&'a str> {
    headers
        .iter()
        .find(|(k, _)| k == name)
        .map(|(_, v)| v.as_str())
}

fn manifest(c: &super::harness::Collected) -> Value {
    c.result_raw()["artifacts"].clone()
}

fn by_path<'a>(m: &'a Value, path: &str) -> &'a Value {
    m["artifacts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|a| a["path"] == path)
        .unwrap_or_else(|| panic!("{path} not in {m:#}"))
}

fn skipped(m: &Value) -> Vec<(String, String)> {
    let mut v: Vec<_> = m["skipped"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| {
            (
                s["path"].as_str().unwrap().to_owned(),
                s["reason"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    v.sort();
    v
}

fn blob_count(state_dir: &std::path::Path) -> usize {
    std::fs::read_dir(state_dir.join("artifacts/sha256"))
        .unwrap()
        .filter(|e| e.as_ref().unwrap().file_name().len() == 64)
        .count()
}

/// Four files under out/ (markdown, binary, the same text twice) and one outside it.
const PYTHON_ARTIFACTS: &str = "import os\nos.makedirs('out/sub', exist_ok=True)\n\
                                open('out/report.md','w').write('# Report\\n\\nall good\\n')\n\
                                open('out/sub/data.bin','wb').write(bytes(range(256))*40)\n\
                                open('out/same-a.txt','w').write('twice\\n')\nopen('out/same-b.txt','w').write('twice\\n')\n\
                                open('ignored.txt','w').write('not matched')\n";
/// One text file, and its sha256 as computed inside the sandbox.
const SHELL_ARTIFACT: &str =
    "mkdir -p out && seq 1 5000 > out/numbers.txt && sha256sum out/numbers.txt";

#[tokio::test]
async fn python_and_shell_files_come_back_with_their_sha256_and_download_identically() {
    let Some(_g) =
        privileged("python_and_shell_files_come_back_with_their_sha256_and_download_identically")
            .await
    else {
        return;
    };
    let d = Daemon::start(DaemonOpts::default()).await;
    let mut c = Client::connect(&d).await;
    let run = c
        .run_completed(with(
            exec_json("py", "python", PYTHON_ARTIFACTS, 30_000, 128),
            json!({"artifacts": {"paths": ["out/**"]}}),
        ))
        .await;
    let m = manifest(&run);
    assert_manifest_names_the_execution(&m, &run);
    python_artifacts_are_listed_and_download_identically(&d, &m).await;
    // The same content twice is stored once: three distinct contents, three blobs.
    assert_eq!(blob_count(&d.state_dir), 3);

    let hex = the_checksum_is_what_sha256sum_says_inside(&d, &mut c).await;
    downloads_need_the_token_and_a_stored_hash(&d, &hex).await;
}

/// The manifest of execution `py` has an id and the environment fingerprint of its `result`.
fn assert_manifest_names_the_execution(m: &Value, run: &super::harness::Collected) {
    assert_eq!(m["execution_id"], "py");
    assert!(m["manifest_id"].as_str().unwrap().starts_with("am_"));
    assert!(m["environment_fingerprint"]
        .as_str()
        .unwrap()
        .starts_with("sha256:"));
    assert_eq!(
        m["environment_fingerprint"],
        run.result_raw()["environment_fingerprint"]
    );
}

/// The files of [`PYTHON_ARTIFACTS`] under out/ are in manifest `m` with their sha256, size and type, `GET` returns
/// them byte-identical and `HEAD` gives their length; text gets a preview, binary content does not.
async fn python_artifacts_are_listed_and_download_identically(d: &Daemon, m: &Value) {
    let expected: [(&str, Vec<u8>, &str); 4] = [
        (
            "out/report.md",
            b"# Report\n\nall good\n".to_vec(),
            "text/markdown",
        ),
        (
            "out/sub/data.bin",
            (0..=255u8).collect::<Vec<_>>().repeat(40),
            "application/octet-stream",
        ),
        ("out/same-a.txt", b"twice\n".to_vec(), "text/plain"),
        ("out/same-b.txt", b"twice\n".to_vec(), "text/plain"),
    ];
    assert_eq!(m["artifacts"].as_array().unwrap().len(), 4, "{m:#}");
    for (path, content, mime) in &expected {
        let a = by_path(m, path);
        let hex = format!("{:x}", Sha256::digest(content));
        assert_eq!(a["checksum"], format!("sha256:{hex}"), "{path}");
        assert_eq!(a["ref"], format!("artifact://sha256/{hex}"));
        assert_eq!(a["size_bytes"], content.len());
        assert_eq!(a["mime_type"], *mime, "{path}");
        assert_eq!(a["type"], "file");
        let (code, headers, body) = fetch(
            d,
            "GET",
            &format!("/artifacts/sha256/{hex}"),
            Some(d.token()),
        )
        .await;
        assert_eq!(code, 200);
        assert_eq!(&body, content, "{path} downloads byte-identical");
        assert_eq!(header(&headers, "content-type"), Some(*mime));
        let (code, headers, body) = fetch(
            d,
            "HEAD",
            &format!("/artifacts/sha256/{hex}"),
            Some(d.token()),
        )
        .await;
        assert_eq!((code, body.len()), (200, 0));
        assert_eq!(
            header(&headers, "content-length"),
            Some(content.len().to_string().as_str())
        );
    }
    assert_eq!(
        by_path(m, "out/report.md")["preview"],
        "# Report\n\nall good\n"
    );
    assert!(
        by_path(m, "out/sub/data.bin").get("preview").is_none(),
        "no preview of binary content"
    );
}

/// Shell: the checksum equals what sha256sum says inside the sandbox, and so does the download's. Returns the hash.
async fn the_checksum_is_what_sha256sum_says_inside(d: &Daemon, c: &mut Client) -> String {
    let run = c
        .run(with(
            exec_json("sh", "shell", SHELL_ARTIFACT, 30_000, 64),
            json!({"artifacts": {"paths": ["out/*.txt"]}}),
        ))
        .await;
    let inside = run.stdout_text();
    let hex = inside.split_whitespace().next().unwrap();
    let m = manifest(&run);
    let a = by_path(&m, "out/numbers.txt");
    assert_eq!(a["checksum"], format!("sha256:{hex}"));
    let (code, _, body) = fetch(
        d,
        "GET",
        &format!("/artifacts/sha256/{hex}"),
        Some(d.token()),
    )
    .await;
    assert_eq!(code, 200);
    assert_eq!(format!("{:x}", Sha256::digest(&body)), hex);
    hex.to_owned()
}

/// Auth and bad references: the stored blob `hex` without a token or with a wrong one is 401; a hash not stored
/// and a path escaping the store are 404.
async fn downloads_need_the_token_and_a_stored_hash(d: &Daemon, hex: &str) {
    let (code, _, _) = fetch(d, "GET", &format!("/artifacts/sha256/{hex}"), None).await;
    assert_eq!(code, 401);
    let (code, _, _) = fetch(
        d,
        "GET",
        &format!("/artifacts/sha256/{hex}"),
        Some("wrong-token-0123456789"),
    )
    .await;
    assert_eq!(code, 401);
    let (code, _, _) = fetch(
        d,
        "GET",
        &format!("/artifacts/sha256/{}", "0".repeat(64)),
        Some(d.token()),
    )
    .await;
    assert_eq!(code, 404);
    let (code, _, _) = fetch(
        d,
        "GET",
        "/artifacts/sha256/..%2f..%2fetc%2fpasswd",
        Some(d.token()),
    )
    .await;
    assert_eq!(code, 404);
}

#[tokio::test]
async fn symlinks_fifos_huge_sparse_files_and_ten_thousand_files_follow_the_spec() {
    let Some(_g) =
        privileged("symlinks_fifos_huge_sparse_files_and_ten_thousand_files_follow_the_spec").await
    else {
        return;
    };
    let d = Daemon::start(DaemonOpts {
        max_limits: Limits {
            disk_mb: 1100,
            ..MAX_LIMITS
        },
        ..DaemonOpts::default()
    })
    .await;
    let mut c = Client::connect(&d).await;
    let py = "import os\nos.makedirs('out', exist_ok=True)\n\
              os.symlink('/etc/passwd', 'out/passwd-link')\nos.mkfifo('out/fifo')\n\
              f = open('out/sparse', 'wb'); f.truncate(1 << 30); f.close()\n\
              open('out/ok.txt', 'w').write('ok')\n";
    let run = c.run_completed(with(
            exec_json("odd", "python", py, 30_000, 128),
            json!({"limits": {"timeout_ms": 30000, "memory_mb": 128, "disk_mb": 1100}, "artifacts": {"paths": ["out/**"]}}),
        )).await;
    let m = manifest(&run);
    let found: Vec<_> = m["artifacts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a["path"].as_str().unwrap())
        .collect();
    assert_eq!(found, ["out/ok.txt"]);
    assert_eq!(
        skipped(&m),
        [
            ("out/fifo".into(), "fifo".into()),
            ("out/passwd-link".into(), "symlink".into()),
            ("out/sparse".into(), "too_large".into()),
        ]
    );

    // 10 000 tiny files: the first 64 (by path) are collected, the rest are counted as dropped, and the manifest
    // stays bounded.
    let py = "import os\nos.makedirs('many', exist_ok=True)\n\
              for i in range(10000):\n    open(f'many/f{i:05}', 'w').write(str(i))\n";
    let run = c
        .run_completed(with(
            exec_json("many", "python", py, 60_000, 256),
            json!({"artifacts": {"paths": ["many/*"]}}),
        ))
        .await;
    let m = manifest(&run);
    let arts = m["artifacts"].as_array().unwrap();
    assert_eq!(arts.len(), 64);
    assert_eq!(arts[0]["path"], "many/f00000");
    assert_eq!(m["dropped"]["by_reason"]["count_limit"], 9936);
    assert_eq!(
        m["skipped"].as_array().unwrap().len() as u64
            + m["dropped"]["not_listed"].as_u64().unwrap(),
        9936
    );
    assert!(m.to_string().len() < 256 * 1024, "manifest bounded");
}

#[tokio::test]
async fn cancelled_executions_collect_nothing_and_the_store_survives_a_restart() {
    let Some(_g) =
        privileged("cancelled_executions_collect_nothing_and_the_store_survives_a_restart").await
    else {
        return;
    };
    let d = Daemon::start(DaemonOpts::default()).await;
    let state_dir = d.state_dir.clone();
    let token = d.token().to_owned();
    let mut c = Client::connect(&d).await;
    let run = c
        .run(with(
            exec_json(
                "keep",
                "shell",
                "mkdir -p out && echo persistent > out/p.txt",
                30_000,
                64,
            ),
            json!({"artifacts": {"paths": ["out/p.txt"]}}),
        ))
        .await;
    let hex = format!("{:x}", Sha256::digest(b"persistent\n"));
    assert_eq!(
        by_path(&manifest(&run), "out/p.txt")["checksum"],
        format!("sha256:{hex}")
    );

    // A timed-out execution still reports its files; a cancelled one reports none.
    let run = c
        .run(with(
            exec_json(
                "slow",
                "shell",
                "mkdir -p out && echo partial > out/t.txt && sleep 30",
                500,
                64,
            ),
            json!({"artifacts": {"paths": ["out/*"]}}),
        ))
        .await;
    assert_eq!(run.terminal_status(), Some(ExecStatus::Timeout));
    assert_eq!(manifest(&run)["artifacts"][0]["path"], "out/t.txt");
    c.send_json(&with(
        exec_json(
            "gone",
            "shell",
            "mkdir -p out && echo x > out/x && echo ready && sleep 30",
            30_000,
            64,
        ),
        json!({"artifacts": {"paths": ["out/*"]}}),
    ))
    .await;
    c.observe("ready", super::harness::stdout_contains("gone", "ready"))
        .await;
    c.send_json(&super::harness::cancel_json("gone")).await;
    let run = c.collect("gone").await;
    assert_eq!(run.terminal_status(), Some(ExecStatus::Cancelled));
    assert!(
        run.result_raw().get("artifacts").is_none(),
        "cancelled: nothing collected"
    );
    drop(c);
    // Stop the first daemon but keep its directory (it owns the state dir's tempdir).
    let mut first = d;
    first.signal(nix::sys::signal::Signal::SIGTERM);
    assert!(first
        .wait_exit(Duration::from_secs(20))
        .is_some_and(|s| s.success()));

    // A new daemon on the same state directory serves what the old one stored.
    let d = Daemon::start(DaemonOpts {
        state_dir: Some(state_dir),
        ..DaemonOpts::default()
    })
    .await;
    let (code, _, body) = fetch(
        &d,
        "GET",
        &format!("/artifacts/sha256/{hex}"),
        Some(d.token()),
    )
    .await;
    assert_eq!(
        (code, body.as_slice()),
        (200, &b"persistent\n"[..]),
        "token was {token}"
    );
}

#[tokio::test]
async fn malformed_artifact_requests_are_refused() {
    let Some(_g) = privileged("malformed_artifact_requests_are_refused").await else {
        return;
    };
    let d = Daemon::start(DaemonOpts::default()).await;
    let mut c = Client::connect(&d).await;
    for (id, artifacts) in [
        ("up", json!({"paths": ["../x"]})),
        ("abs", json!({"paths": ["/etc/*"]})),
        ("glob", json!({"paths": ["out/[z-a]"]})),
        ("field", json!({"paths": ["x"], "bogus": 1})),
    ] {
        let run = c
            .run(with(
                exec_json(id, "shell", "true", 5_000, 64),
                json!({"artifacts": artifacts}),
            ))
            .await;
        let err = run.raw.last().expect("a terminal message");
        assert_eq!(err["type"], "error", "{id}: {}", run.dump());
        assert_eq!(err["code"], "INVALID_REQUEST", "{id}");
        assert!(
            err["message"].as_str().unwrap().contains("artifacts"),
            "{id}: {err}"
        );
    }
}

/// A daemon whose config has `artifacts.upload` set to `upload` (the harness's standard config has no such key).
async fn upload_daemon(parent: &str, upload: Value) -> Daemon {
    let token = format!("upload-token-{:016x}", rand::random::<u64>());
    Daemon::launch_on_free_port(|port| {
        let dir = tempfile::tempdir().unwrap();
        let state_dir = dir.path().join("state");
        let config = json!({
            "listen": format!("127.0.0.1:{port}"),
            "state_dir": state_dir,
            "auth": {"tokens": [token]},
            "sandbox": {"cgroup_parent": parent, "uid_base": 910_000},
            "artifacts": {"upload": upload},
        });
        let config_path = dir.path().join("config.yaml");
        std::fs::write(&config_path, config.to_string()).unwrap();
        super::harness::Launch {
            args: vec!["--config".into(), config_path.display().to_string()],
            port,
            token: token.clone(),
            dir,
            state_dir,
            cgroup_parent: parent.to_owned(),
            uid_base: 910_000,
            max_concurrent: 8,
            pool_size: 8,
        }
    })
    .await
}

/// With an upload endpoint configured, every artifact is POSTed eagerly with its hash; the endpoint's
/// `backendUri` replaces the ref; a failing endpoint is retried, and an endpoint that never answers is reported on
/// the artifact while the content stays downloadable from the daemon.
#[tokio::test]
async fn artifacts_upload_eagerly_with_retries_and_report_failures() {
    let Some(_g) = privileged("artifacts_upload_eagerly_with_retries_and_report_failures").await
    else {
        return;
    };
    let (backend_port, received) = flaky_upload_backend().await;
    let parent = format!("sandboxd-test-{}-upload", std::process::id());
    let _cg = super::harness::CgroupParentGuard(parent.clone());
    let dead_port = super::harness::free_port();
    a_failed_upload_is_retried_and_the_backend_uri_becomes_the_ref(
        &parent,
        backend_port,
        &received,
    )
    .await;
    an_upload_that_never_succeeds_is_reported_and_kept_locally(&parent, dead_port).await;
}

/// Requests an upload backend received, in full.
type Received = std::sync::Arc<std::sync::Mutex<Vec<String>>>;

/// The backend: fails the first request, then answers with a URI; records what it received. Returns its port.
async fn flaky_upload_backend() -> (u16, Received) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let backend_port = listener.local_addr().unwrap().port();
    let received = Received::default();
    let rec = received.clone();
    tokio::spawn(async move {
        let mut n = 0;
        loop {
            let Ok((mut s, _)) = listener.accept().await else {
                return;
            };
            n += 1;
            let text = read_one_request(&mut s).await;
            rec.lock().unwrap().push(text.clone());
            let answer = if n == 1 {
                "HTTP/1.1 500 Internal Server Error\r\ncontent-length: 0\r\nconnection: close\r\n\r\n".to_owned()
            } else {
                let hash = text
                    .lines()
                    .find_map(|l| l.strip_prefix("content-hash: sha256:"))
                    .unwrap_or("none")
                    .trim()
                    .to_owned();
                let body = format!(r#"{{"backendUri":"backend://blobs/{hash}"}}"#);
                format!(
                    "HTTP/1.1 200 OK\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                    body.len()
                )
            };
            let _ = s.write_all(answer.as_bytes()).await;
        }
    });
    (backend_port, received)
}

/// Reads headers and the body (Content-Length) of one request.
async fn read_one_request(s: &mut tokio::net::TcpStream) -> String {
    let mut buf = vec![0u8; 1 << 20];
    let mut got = Vec::new();
    loop {
        let k = s.read(&mut buf).await.unwrap_or(0);
        if k == 0 {
            break;
        }
        got.extend_from_slice(&buf[..k]);
        let text = String::from_utf8_lossy(&got).to_string();
        if let Some((head, body)) = text.split_once("\r\n\r\n") {
            let len: usize = head
                .lines()
                .find_map(|l| {
                    l.to_ascii_lowercase()
                        .strip_prefix("content-length:")
                        .map(|v| v.trim().parse().unwrap())
                })
                .unwrap_or(0);
            if body.len() >= len {
                break;
            }
        }
    }
    String::from_utf8_lossy(&got).to_string()
}

/// Against the flaky backend: the artifact is uploaded on the second attempt with the backend's token, and its ref
/// is the backend's URI.
async fn a_failed_upload_is_retried_and_the_backend_uri_becomes_the_ref(
    parent: &str,
    backend_port: u16,
    received: &Received,
) {
    let d = upload_daemon(parent, json!({"url": format!("http://127.0.0.1:{backend_port}/upload"), "token": "backend-secret", "attempts": 3, "backoff_ms": 10})).await;
    let mut c = Client::connect(&d).await;
    let run = c
        .run(with(
            exec_json(
                "up",
                "shell",
                "mkdir -p out && printf 'upload me' > out/u.txt",
                30_000,
                64,
            ),
            json!({"artifacts": {"paths": ["out/*"]}}),
        ))
        .await;
    let hex = format!("{:x}", Sha256::digest(b"upload me"));
    let m = manifest(&run);
    let a = by_path(&m, "out/u.txt");
    assert_eq!(a["ref"], format!("backend://blobs/{hex}"), "{m:#}");
    assert_eq!(a["uploaded"], true);
    assert_eq!(a["checksum"], format!("sha256:{hex}"));
    let got = received.lock().unwrap().clone();
    assert_eq!(got.len(), 2, "one failure, one retry");
    assert!(got[1].contains("authorization: Bearer backend-secret"));
    assert!(got[1].ends_with("upload me"));
}

/// An endpoint nobody answers (`dead_port`): every attempt fails, the failure is reported, nothing is dropped.
async fn an_upload_that_never_succeeds_is_reported_and_kept_locally(parent: &str, dead_port: u16) {
    let d = upload_daemon(parent, json!({"url": format!("http://127.0.0.1:{dead_port}/upload"), "token": "x", "attempts": 2, "backoff_ms": 10})).await;
    let mut c = Client::connect(&d).await;
    let run = c
        .run(with(
            exec_json(
                "down",
                "shell",
                "mkdir -p out && printf 'kept locally' > out/k.txt",
                30_000,
                64,
            ),
            json!({"artifacts": {"paths": ["out/*"]}}),
        ))
        .await;
    assert_eq!(run.terminal_status(), Some(ExecStatus::Completed));
    let m = manifest(&run);
    let a = by_path(&m, "out/k.txt");
    let hex = format!("{:x}", Sha256::digest(b"kept locally"));
    assert_eq!(a["ref"], format!("artifact://sha256/{hex}"));
    assert!(
        a["upload_error"]
            .as_str()
            .unwrap()
            .starts_with("2 attempts failed"),
        "{a}"
    );
    assert_eq!(m["upload_failures"], 1);
    let (code, _, body) = fetch(
        &d,
        "GET",
        &format!("/artifacts/sha256/{hex}"),
        Some(d.token()),
    )
    .await;
    assert_eq!((code, body.as_slice()), (200, &b"kept locally"[..]));
}

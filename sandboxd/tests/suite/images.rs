//! OCI images: an image built here from Debian's static busybox, packed and imported with the
//! `sandboxd images` CLI, then used for executions: overlay root, whiteouts across layers, setuid neutralised,
//! image `Env`, writes confined to the execution, `disk_mb` bounding the overlay, the environment fingerprint in
//! `ack` and `result`; tampered blobs refused; the start failing closed on a missing image or interpreter; and the
//! images of `images/build.sh` (when given) running FSP executions.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use nix::sys::signal::Signal;
use protocol::{ExecStatus, Language};
use serde_json::{json, Value};

use super::harness::{
    cannot_run, cgroup_parent_dirs, exec_json, privileged, run_until_exit, wait_until, with,
    Client, Daemon, DaemonOpts, Guard, SANDBOXD,
};

/// Debian's busybox-static, if present and really static (no program interpreter).
fn static_busybox() -> Result<Vec<u8>, String> {
    let bytes = std::fs::read("/bin/busybox")
        .map_err(|e| format!("/bin/busybox: {e} (apt-get install busybox-static)"))?;
    let head = &bytes[..bytes.len().min(8192)];
    if head.windows(7).any(|w| w == b"/lib64/" || w == b"/lib/ld") {
        return Err("/bin/busybox is dynamically linked (install busybox-static)".into());
    }
    Ok(bytes)
}

/// A tar entry: (path, kind, mode, content or link target).
enum Entry<'a> {
    Dir(&'a str, u32),
    File(&'a str, u32, &'a [u8]),
    Symlink(&'a str, &'a str),
}

fn write_tar(path: &Path, entries: &[Entry<'_>]) {
    let mut b = tar::Builder::new(std::fs::File::create(path).unwrap());
    for e in entries {
        let mut h = tar::Header::new_ustar();
        h.set_mtime(1_700_000_000);
        h.set_uid(0);
        h.set_gid(0);
        match e {
            Entry::Dir(p, mode) => {
                h.set_entry_type(tar::EntryType::Directory);
                h.set_mode(*mode);
                h.set_size(0);
                b.append_data(&mut h, p, std::io::empty()).unwrap();
            }
            Entry::File(p, mode, data) => {
                h.set_entry_type(tar::EntryType::Regular);
                h.set_mode(*mode);
                h.set_size(data.len() as u64);
                b.append_data(&mut h, p, *data).unwrap();
            }
            Entry::Symlink(p, target) => {
                h.set_entry_type(tar::EntryType::Symlink);
                h.set_mode(0o777);
                h.set_size(0);
                b.append_link(&mut h, p, target).unwrap();
            }
        }
    }
    b.into_inner().unwrap();
}

fn sandboxd(args: &[&str]) -> std::process::Output {
    Command::new(SANDBOXD)
        .args(args)
        .env_remove("SANDBOXD_TOKEN")
        .output()
        .unwrap()
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// A two-layer busybox image as an OCI layout under `dir`; returns the layout path.
fn busybox_layout(dir: &Path, busybox: &[u8]) -> PathBuf {
    let applets = ["cat", "ls", "stat", "mkdir", "id", "grep", "dd", "head"];
    let mut l1 = vec![
        Entry::Dir("bin", 0o755),
        Entry::File("bin/busybox", 0o755, busybox),
        Entry::Symlink("bin/sh", "busybox"),
        Entry::File("bin/suid-copy", 0o4755, b"#!/bin/sh\necho hi\n"),
        Entry::Dir("etc", 0o755),
        Entry::File("etc/passwd", 0o644, b"root:x:0:0:root:/:/bin/sh\n"),
        Entry::File("etc/removed", 0o644, b"layer 1 only\n"),
        Entry::Dir("var", 0o755),
        Entry::Dir("var/tmp", 0o1777),
        // proc, dev, sys and tmp exist; workspace and sandbox do not (the runtime creates them in the upper layer).
        Entry::Dir("proc", 0o555),
        Entry::Dir("dev", 0o755),
        Entry::Dir("sys", 0o555),
        Entry::Dir("tmp", 0o1777),
    ];
    let links: Vec<String> = applets.iter().map(|a| format!("bin/{a}")).collect();
    for l in &links {
        l1.push(Entry::Symlink(l, "busybox"));
    }
    let l2 = [
        Entry::File("etc/.wh.removed", 0o644, b""),
        Entry::File("bin/layer2", 0o644, b"from layer 2\n"),
    ];
    write_tar(&dir.join("l1.tar"), &l1);
    write_tar(&dir.join("l2.tar"), &l2);
    let out = dir.join("oci");
    let l1 = dir.join("l1.tar").display().to_string();
    let l2 = dir.join("l2.tar").display().to_string();
    let o = sandboxd(&[
        "images",
        "pack",
        "--rootfs",
        &l1,
        "--rootfs",
        &l2,
        "--out",
        out.to_str().unwrap(),
        "--compression",
        "gzip",
        "--env",
        "PATH=/bin",
        "--env",
        "FOO=from-image",
        "--cmd",
        "/bin/sh",
    ]);
    assert!(o.status.success(), "pack: {}", text(&o.stderr));
    out
}

/// `sandboxd --state-dir STATE_DIR images import LAYOUT --name NAME`.
fn import_cmd(state_dir: &Path, layout: &Path, name: &str) -> std::process::Output {
    sandboxd(&[
        "--state-dir",
        state_dir.to_str().unwrap(),
        "images",
        "import",
        layout.to_str().unwrap(),
        "--name",
        name,
    ])
}

/// Imports `layout` as `name` into `state_dir` with the CLI; returns the manifest digest it printed.
fn import(state_dir: &Path, layout: &Path, name: &str) -> String {
    let o = import_cmd(state_dir, layout, name);
    let stdout = text(&o.stdout);
    assert!(o.status.success(), "import: {stdout}{}", text(&o.stderr));
    let digest = stdout
        .split_whitespace()
        .find(|w| w.starts_with("sha256:"))
        .unwrap_or_else(|| panic!("no digest in {stdout:?}"))
        .to_owned();
    digest
}

/// A scratch directory the containers' unprivileged uids can traverse (state_dir lives in it).
fn open_tempdir() -> tempfile::TempDir {
    let d = tempfile::Builder::new()
        .prefix("sandboxd-images-")
        .tempdir()
        .unwrap();
    std::fs::set_permissions(
        d.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();
    d
}

/// For a privileged test: the busybox image packed and imported as `bb` into a fresh state directory. Returns the
/// guard, the scratch directory (keep it alive), the state directory and the manifest digest.
pub(super) async fn imported_busybox(
    test: &str,
) -> Option<(Guard, tempfile::TempDir, PathBuf, String)> {
    let guard = privileged(test).await?;
    let busybox = match static_busybox() {
        Ok(b) => b,
        Err(reason) => {
            cannot_run(test, &reason);
            return None;
        }
    };
    let dir = open_tempdir();
    let layout = busybox_layout(dir.path(), &busybox);
    let state_dir = dir.path().join("state");
    let digest = import(&state_dir, &layout, "bb");
    Some((guard, dir, state_dir, digest))
}

/// What an execution sees of the busybox image: its `Env`, the whiteout of layer 2, a file of layer 2, the mode
/// of a setuid file, a write to the overlay, the image's files read-only, and the mount points made.
const IMAGE_VIEW_SCRIPT: &str = r#"
echo "foo=$FOO"
test -e /etc/removed && echo removed-visible || echo removed-hidden
cat /bin/layer2
stat -c %a /bin/suid-copy
echo secret > /var/tmp/marker && cat /var/tmp/marker
(echo x >> /bin/busybox) 2>/dev/null && echo image-writable || echo image-readonly
test -d /workspace && test -d /sandbox && echo mount-points-made
"#;
/// Whether the marker [`IMAGE_VIEW_SCRIPT`] wrote is still there.
const MARKER_CHECK: &str = "test -e /var/tmp/marker && echo leaked || echo clean";
/// Six files of 1 MiB in /var/tmp. Files of 1 MiB each stay under RLIMIT_FSIZE (also disk_mb): the tmpfs runs out
/// first.
const FILL_THE_OVERLAY: &str =
    "for i in 1 2 3 4 5 6; do dd if=/dev/zero of=/var/tmp/f$i bs=1048576 count=1 2>&1 || break; done";

#[tokio::test]
async fn busybox_image_runs_on_a_fresh_overlay_per_execution() {
    let Some((_g, _dir, state_dir, digest)) =
        imported_busybox("busybox_image_runs_on_a_fresh_overlay_per_execution").await
    else {
        return;
    };
    let d = busybox_shell_daemon(&state_dir, &digest).await;
    let mut c = Client::connect(&d).await;
    assert_only_the_configured_images_and_languages(&d, &mut c, &digest).await;

    let fp_shell = the_shell_sees_the_image_and_names_it(&mut c, &digest).await;
    the_next_execution_gets_a_fresh_overlay(&mut c, &state_dir).await;
    disk_mb_bounds_the_overlay(&mut c).await;
    python_on_the_host_image_has_another_fingerprint(&mut c, &fp_shell).await;

    // A language that is not configured is not supported, even though the host could run it.
    c.send_json(&exec_json("js-1", "javascript", "1", 20_000, 64))
        .await;
    let (e, _) = c.take_error().await;
    assert_eq!(e.code, protocol::ErrorCode::LanguageNotSupported);

    images_rm_waits_for_the_daemon(c, d, &state_dir);
}

/// A daemon running `shell` on the imported busybox image `bb` and `python` on the host.
async fn busybox_shell_daemon(state_dir: &Path, digest: &str) -> Daemon {
    Daemon::start(DaemonOpts {
        state_dir: Some(state_dir.to_owned()),
        extra_config: Some(json!({
            "images": {"bb": {"digest": digest}},
            "languages": {
                "shell": {"image": "bb", "command": ["/bin/sh"]},
                "python": {"image": "host", "command": ["/usr/bin/python3"]},
            },
        })),
        ..DaemonOpts::default()
    })
    .await
}

/// `/healthz` names each language's image, and `pong` lists exactly the configured languages.
async fn assert_only_the_configured_images_and_languages(d: &Daemon, c: &mut Client, digest: &str) {
    let (code, health) = d.healthz().await;
    assert_eq!(code, 200);
    assert_eq!(
        health["images"]["shell"],
        json!({"image": "bb", "digest": digest}),
        "{health}"
    );
    assert_eq!(health["images"]["python"]["image"], "host", "{health}");
    let caps = c.ping().await.capabilities.expect("capabilities");
    assert_eq!(
        caps.languages,
        [Language::Python, Language::Shell],
        "pong lists exactly the configured languages"
    );
}

/// [`IMAGE_VIEW_SCRIPT`] sees the image; `ack` and `result` agree on the environment and name the image by its
/// manifest digest. Returns the environment fingerprint.
async fn the_shell_sees_the_image_and_names_it(c: &mut Client, digest: &str) -> Value {
    let r = c
        .run_completed(exec_json("bb-1", "shell", IMAGE_VIEW_SCRIPT, 20_000, 64))
        .await;
    assert_eq!(
        r.stdout_text(),
        "foo=from-image\nremoved-hidden\nfrom layer 2\n755\nsecret\nimage-readonly\nmount-points-made\n",
        "image Env, whiteout of layer 2, setuid dropped, writes to the overlay, image files read-only\n{}",
        r.dump()
    );
    // The environment: ack and result agree and name the image by its manifest digest.
    let ack = r
        .raw
        .iter()
        .find(|v| v["type"] == "ack")
        .cloned()
        .expect("ack");
    let res = r.result_raw().clone();
    assert_eq!(ack["environment"]["image"], "bb", "{ack}");
    assert_eq!(ack["environment"]["image_digest"], digest, "{ack}");
    assert!(ack["environment"]["seccomp_profile"]
        .as_str()
        .is_some_and(|s| s.starts_with("sha256:")));
    assert_eq!(
        ack["environment"]["sandboxd_version"],
        env!("CARGO_PKG_VERSION")
    );
    assert_eq!(ack["environment"], res["environment"]);
    assert_eq!(
        ack["environment_fingerprint"],
        res["environment_fingerprint"]
    );
    let fp_shell = res["environment_fingerprint"].clone();
    assert!(fp_shell.as_str().is_some_and(|s| s.starts_with("sha256:")));
    fp_shell
}

/// The next execution gets a fresh overlay: the marker is gone, and it never reached the layer cache.
async fn the_next_execution_gets_a_fresh_overlay(c: &mut Client, state_dir: &Path) {
    let r = c
        .run(exec_json("bb-2", "shell", MARKER_CHECK, 20_000, 64))
        .await;
    assert_eq!(r.stdout_text(), "clean\n", "{}", r.dump());
    let layers = state_dir.join("images/oci/layers");
    for l in std::fs::read_dir(&layers).unwrap().flatten() {
        assert!(
            !l.path().join("var/tmp/marker").exists(),
            "a write reached the layer cache {}",
            l.path().display()
        );
    }
}

/// disk_mb bounds what the overlay's upper layer can hold.
async fn disk_mb_bounds_the_overlay(c: &mut Client) {
    let r = c
        .run(with(
            exec_json("bb-3", "shell", FILL_THE_OVERLAY, 20_000, 64),
            json!({"limits": {"disk_mb": 4}}),
        ))
        .await;
    let out = r.stdout_text();
    assert!(
        out.contains("error writing '/var/tmp/f") && out.contains("No space left on device"),
        "{}",
        r.dump()
    );
}

/// Python on the host image in the same daemon: another image, another fingerprint than `fp_shell`.
async fn python_on_the_host_image_has_another_fingerprint(c: &mut Client, fp_shell: &Value) {
    let r = c
        .run(exec_json("py-1", "python", "print(1)", 20_000, 64))
        .await;
    assert_eq!(r.stdout_text(), "1\n", "{}", r.dump());
    let res = r.result_raw();
    assert_eq!(res["environment"]["image"], "host");
    assert!(res["environment"]["image_digest"]
        .as_str()
        .is_some_and(|s| s.starts_with("host:sha256:")));
    assert_ne!(&res["environment_fingerprint"], fp_shell);
}

/// `images rm` is refused while the daemon holds the store, and removes the layers once it has stopped.
fn images_rm_waits_for_the_daemon(c: Client, d: Daemon, state_dir: &Path) {
    let rm = || {
        sandboxd(&[
            "--state-dir",
            state_dir.to_str().unwrap(),
            "images",
            "rm",
            "bb",
        ])
    };
    let o = rm();
    assert!(!o.status.success());
    assert!(text(&o.stderr).contains("in use"), "{}", text(&o.stderr));
    drop(c);
    drop(d);
    let o = rm();
    assert!(o.status.success(), "{}", text(&o.stderr));
    assert_eq!(
        std::fs::read_dir(state_dir.join("images/oci/layers"))
            .unwrap()
            .count(),
        0,
        "layers removed"
    );
}

#[tokio::test]
async fn a_tampered_blob_is_refused_and_named() {
    // Verification happens before anything is unpacked; no root needed for that part.
    let dir = open_tempdir();
    write_tar(
        &dir.path().join("l.tar"),
        &[Entry::File("hello", 0o644, b"hello world\n")],
    );
    let out = dir.path().join("oci");
    let o = sandboxd(&[
        "images",
        "pack",
        "--rootfs",
        dir.path().join("l.tar").to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let manifest: Value = {
        let index: Value =
            serde_json::from_slice(&std::fs::read(out.join("index.json")).unwrap()).unwrap();
        let m = index["manifests"][0]["digest"].as_str().unwrap().to_owned();
        let hex = m.trim_start_matches("sha256:");
        serde_json::from_slice(&std::fs::read(out.join("blobs/sha256").join(hex)).unwrap()).unwrap()
    };
    let layer = manifest["layers"][0]["digest"].as_str().unwrap().to_owned();
    let blob = out
        .join("blobs/sha256")
        .join(layer.trim_start_matches("sha256:"));
    let mut bytes = std::fs::read(&blob).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0x20;
    std::fs::write(&blob, &bytes).unwrap();

    let state = dir.path().join("state");
    let o = import_cmd(&state, &out, "tampered");
    let stderr = text(&o.stderr);
    assert!(!o.status.success(), "a tampered image is refused");
    assert!(
        stderr.contains(&layer) && stderr.contains("modified or is corrupt"),
        "the error names the blob: {stderr}"
    );
    let o = sandboxd(&["--state-dir", state.to_str().unwrap(), "images", "list"]);
    assert!(o.status.success());
    assert_eq!(text(&o.stdout), "", "nothing was recorded");
    for sub in ["layers", "tmp", "refs"] {
        assert_eq!(
            std::fs::read_dir(state.join("images/oci").join(sub))
                .unwrap()
                .count(),
            0,
            "{sub} is empty"
        );
    }
}

/// A config file for a daemon that is expected to refuse to start.
fn refused_config(dir: &Path, state_dir: &Path, extra: Value) -> PathBuf {
    let n = std::process::id();
    let mut config = json!({
        "listen": "127.0.0.1:1",
        "state_dir": state_dir,
        "auth": {"tokens": ["a-token-that-is-long-enough"]},
        "sandbox": {"cgroup_parent": format!("sandboxd-test-images-{n}"), "uid_base": 3_900_000},
    });
    for (k, v) in extra.as_object().unwrap() {
        config[k] = v.clone();
    }
    let p = dir.join("refused.yaml");
    std::fs::write(&p, serde_json::to_string(&config).unwrap()).unwrap();
    p
}

#[tokio::test]
async fn the_start_fails_closed_when_an_image_cannot_run_its_language() {
    let Some((_g, dir, state_dir, digest)) =
        imported_busybox("the_start_fails_closed_when_an_image_cannot_run_its_language").await
    else {
        return;
    };
    let wrong_pin = format!("sha256:{}", "0".repeat(64));
    for (extra, needles) in [
        (
            json!({"images": {"nope": {}}, "languages": {"shell": {"image": "nope", "command": ["/bin/sh"]}}}),
            vec!["images.nope", "no image named \"nope\""],
        ),
        (
            json!({"images": {"bb": {}}, "languages": {"python": {"image": "bb", "command": ["/usr/bin/python3"]}}}),
            vec![
                "languages.python",
                "/usr/bin/python3",
                "not found in the image",
            ],
        ),
        (
            json!({"images": {"bb": {}}, "languages": {"shell": {"image": "bb", "command": ["/etc/passwd"]}}}),
            vec!["languages.shell", "not an executable regular file"],
        ),
        (
            json!({"images": {"bb": {"digest": wrong_pin}}, "languages": {"shell": {"image": "bb", "command": ["/bin/sh"]}}}),
            vec!["pins", digest.as_str()],
        ),
    ] {
        let cfg = refused_config(dir.path(), &state_dir, extra.clone());
        let (status, stderr) = run_until_exit(&cfg, Duration::from_secs(20)).await;
        assert!(!status.success(), "{extra} must not start: {stderr}");
        for n in needles {
            assert!(stderr.contains(n), "{extra}: stderr names {n:?}: {stderr}");
        }
        // A refused start leaves no cgroup behind.
        let parent = format!("sandboxd-test-images-{}", std::process::id());
        assert_eq!(
            cgroup_parent_dirs(&parent),
            Vec::<PathBuf>::new(),
            "{extra}"
        );
    }
}

/// The images `images/build.sh` makes (`SANDBOXD_TEST_IMAGES=shell=DIR,python=DIR`; `.ci/run` sets it): imported
/// and used for FSP executions. The conformance suite also runs against them in `.ci/run`.
#[tokio::test]
async fn recipe_images_run_fsp_executions() {
    let test = "recipe_images_run_fsp_executions";
    let Some(_g) = privileged(test).await else {
        return;
    };
    let Ok(spec) = std::env::var("SANDBOXD_TEST_IMAGES") else {
        // On CI this fails: .ci/run builds the images and sets it.
        return cannot_run(
            test,
            "SANDBOXD_TEST_IMAGES is not set (images/build.sh shell python; then SANDBOXD_TEST_IMAGES=shell=images/out/shell/oci,python=images/out/python/oci)",
        );
    };
    let dir = open_tempdir();
    let state_dir = dir.path().join("state");
    let mut languages = serde_json::Map::new();
    let mut images = serde_json::Map::new();
    for item in spec.split(',').filter(|s| !s.is_empty()) {
        let (lang, layout) = item
            .split_once('=')
            .unwrap_or_else(|| panic!("SANDBOXD_TEST_IMAGES item {item:?} is not lang=DIR"));
        let command = match lang {
            "shell" => "/bin/sh",
            "python" => "/usr/bin/python3",
            "javascript" => "/usr/bin/node",
            "elixir" => "/usr/bin/elixir",
            other => panic!("unknown language {other}"),
        };
        let layout = std::fs::canonicalize(layout).unwrap();
        // Imported at start from the config's `layout` (the CLI path is covered above).
        images.insert(lang.into(), json!({"layout": layout}));
        languages.insert(lang.into(), json!({"image": lang, "command": [command]}));
    }
    let d = Daemon::start(DaemonOpts {
        state_dir: Some(state_dir),
        extra_config: Some(json!({"images": images, "languages": languages})),
        ..DaemonOpts::default()
    })
    .await;
    let mut c = Client::connect(&d).await;
    for lang in languages.keys() {
        let (code, want): (&str, &str) = match lang.as_str() {
            "shell" => (
                "read x; echo \"got $x\"; ls / >/dev/null; busybox true && echo busybox-ok; exit 3",
                "got hi\nbusybox-ok\n",
            ),
            "python" => (
                "import sys, json, hashlib, sqlite3, ssl\nprint(json.dumps({'in': sys.stdin.read().strip()}))\nsys.exit(3)",
                "{\"in\": \"hi\"}\n",
            ),
            "javascript" => (
                "const d = require('fs').readFileSync(0, 'utf8').trim(); console.log('got ' + d); process.exit(3)",
                "got hi\n",
            ),
            _ => ("IO.puts(\"got \" <> String.trim(IO.read(:eof))); System.halt(3)", "got hi\n"),
        };
        let r = c
            .run(with(
                exec_json(&format!("{lang}-1"), lang, code, 60_000, 256),
                json!({"stdin": "hi\n"}),
            ))
            .await;
        assert_eq!(r.stdout_text(), want, "{lang}: {}", r.dump());
        assert!(
            r.stderr().is_empty(),
            "{lang}: the interpreter starts silently: {}",
            r.dump()
        );
        assert_eq!(r.result().exit_code, Some(3), "{lang}: {}", r.dump());
        assert_eq!(
            r.result_raw()["environment"]["image"],
            lang.as_str(),
            "{}",
            r.dump()
        );
        // Timeouts and OOM behave on the image as on the host.
        let r = c
            .run(exec_json(
                &format!("{lang}-t"),
                lang,
                match lang.as_str() {
                    "shell" => "while :; do :; done",
                    "python" => "while True: pass",
                    "javascript" => "for(;;){}",
                    _ => "Stream.repeatedly(fn -> 1 end) |> Stream.run()",
                },
                1_500,
                256,
            ))
            .await;
        assert_eq!(
            r.terminal_status(),
            Some(ExecStatus::Timeout),
            "{lang}: {}",
            r.dump()
        );
        if lang == "python" {
            let r = c
                .run(exec_json(
                    "python-oom",
                    "python",
                    "x = bytearray(512 << 20)",
                    20_000,
                    64,
                ))
                .await;
            assert_eq!(r.terminal_status(), Some(ExecStatus::Oom), "{}", r.dump());
        }
    }
    c.assert_usable().await;
}

/// An agent sandbox's event stream.
pub(super) type AgentEvents =
    tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>;

/// The next lifecycle event on `ws` (others skipped): its action and the whole event.
pub(super) async fn next_action(ws: &mut AgentEvents) -> (String, Value) {
    use futures_util::StreamExt;
    loop {
        let m = tokio::time::timeout(Duration::from_secs(30), ws.next())
            .await
            .expect("an event within 30 s")
            .unwrap()
            .unwrap();
        let v: Value = serde_json::from_str(m.to_text().unwrap()).unwrap();
        if let Some(a) = v["event"]["action"].as_str() {
            return (a.to_owned(), v);
        }
    }
}

/// Sandbox `id`'s event stream (`/sandboxes/<id>/events`), with the daemon's token.
pub(super) async fn agent_events(d: &Daemon, id: &str) -> AgentEvents {
    use tokio_tungstenite::tungstenite::client::IntoClientRequest;
    let mut req = format!("ws://127.0.0.1:{}/sandboxes/{id}/events", d.port)
        .into_client_request()
        .unwrap();
    req.headers_mut().insert(
        "authorization",
        format!("Bearer {}", d.token()).parse().unwrap(),
    );
    tokio_tungstenite::connect_async(req).await.unwrap().0
}

/// One HTTP/1.1 request with the daemon's token (`Connection: close`): status and JSON body.
pub(super) async fn agent_http(d: &Daemon, method: &str, path: &str, body: &Value) -> (u16, Value) {
    agent_http_with(d, method, path, body, "").await
}

/// [`agent_http`] with more header lines (`extra`: each line ending in `\r\n`).
pub(super) async fn agent_http_with(
    d: &Daemon,
    method: &str,
    path: &str,
    body: &Value,
    extra: &str,
) -> (u16, Value) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", d.port))
        .await
        .unwrap();
    let body = body.to_string();
    let req = format!(
        "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {}\r\n{extra}Content-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        d.token(),
        body.len()
    );
    s.write_all(req.as_bytes()).await.unwrap();
    let mut out = Vec::new();
    s.read_to_end(&mut out).await.unwrap();
    let text = String::from_utf8_lossy(&out).into_owned();
    let (head, rest) = text.split_once("\r\n\r\n").unwrap();
    let status = head.split_whitespace().nth(1).unwrap().parse().unwrap();
    (status, serde_json::from_str(rest).unwrap_or(Value::Null))
}

/// A new agent sandbox on the busybox image `bb` with `mounts` (agent `a`, a backend nobody serves); its id.
async fn bb_agent_sandbox(d: &Daemon, mounts: Value) -> String {
    let (status, created) = agent_http(
        d,
        "POST",
        "/sandboxes",
        &json!({
            "workspaceRequirements": {"baseImage": "bb", "resourceLimits": {"memoryMb": 128, "diskMb": 16},
                                      "mounts": mounts},
            "bootstrap": {"backendUrl": "http://127.0.0.1:9", "backendToken": "t", "agentId": "a",
                          "tokenExpiresAt": "2099-01-01T00:00:00Z",
                          "artifactUploadEndpoint": "http://127.0.0.1:9/api/artifacts"},
        }),
    )
    .await;
    assert_eq!(status, 201, "{created}");
    created["id"].as_str().unwrap().to_owned()
}

/// An agent sandbox on an OCI image: each run's agent (a busybox shell) runs on the sandbox's overlay
/// root, and `/workspace` outlives the container: the second run sees the first run's file. Removal leaves nothing.
#[tokio::test]
async fn agent_sandbox_on_an_oci_image_keeps_its_workspace_across_runs() {
    let Some((_g, _dir, state_dir, digest)) =
        imported_busybox("agent_sandbox_on_an_oci_image_keeps_its_workspace_across_runs").await
    else {
        return;
    };
    let d = Daemon::start(DaemonOpts {
        state_dir: Some(state_dir.clone()),
        extra_config: Some(json!({
            "images": {"bb": {"digest": digest}},
            "languages": {"shell": {"image": "bb", "command": ["/bin/sh"]}},
            "agents": {"max_sandboxes": 4},
        })),
        ..DaemonOpts::default()
    })
    .await;
    let id = bb_agent_sandbox(&d, json!([])).await;
    let mut ws = agent_events(&d, &id).await;
    let mut next_action = async || next_action(&mut ws).await;
    for script in [
        "busybox test -e /bin/layer2 && echo run1 > /workspace/f && exit 0; exit 5",
        "test \"$(cat /workspace/f)\" = run1 && exit 0; exit 7",
    ] {
        let (status, h) = agent_http(
            &d,
            "POST",
            &format!("/sandboxes/{id}/spawn"),
            &json!({"agentId": "a", "providerConfig": {"command": ["/bin/sh", "-c", script]}}),
        )
        .await;
        assert_eq!(status, 200, "{h}");
        assert_eq!(next_action().await.0, "started");
        let (action, v) = next_action().await;
        assert_eq!(action, "session_end", "the agent did not exit 0: {v}");
    }
    let (status, _) = agent_http(&d, "DELETE", &format!("/sandboxes/{id}"), &json!({})).await;
    assert_eq!(status, 204);
    let left: Vec<_> = std::fs::read_dir(state_dir.join("agents"))
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .collect();
    assert!(left.is_empty(), "{left:?}");
    wait_until(
        "nothing but the pool's ready containers to be left",
        Duration::from_secs(15),
        || d.leftovers(),
    )
    .await;
}

/// The busybox agent of [`oci_agent_keeps_its_files_across_restarts`]: it wrote `before.txt` at its start in
/// `/workspace` and in its volume (`/workspace/data`); every 50 ms it writes a counter to `hb` in both and, when it
/// reads all four files back, the counter to `read.ok`.
const OCI_AGENT_LOOP: &str = r#"echo kept > /workspace/before.txt && echo kept > /workspace/data/before.txt
n=0
while :; do
  n=$((n+1))
  ok=1
  for d in /workspace /workspace/data; do
    echo $n > $d/hb.new && busybox mv $d/hb.new $d/hb || ok=0
    [ "$(cat $d/hb)" = $n ] && [ "$(cat $d/before.txt)" = kept ] || ok=0
  done
  [ $ok = 1 ] && echo $n > /workspace/read.ok
  busybox usleep 50000
done"#;

/// What the agent of container `cid` last read back ([`OCI_AGENT_LOOP`]), seen through its own root.
fn oci_agent_reads(d: &Daemon, cid: &str) -> Result<u64, String> {
    let procs = format!("/sys/fs/cgroup/pids/{}/{cid}/cgroup.procs", d.cgroup_parent);
    let procs = std::fs::read_to_string(&procs)
        .or_else(|_| {
            std::fs::read_to_string(format!(
                "/sys/fs/cgroup/{}/{cid}/cgroup.procs",
                d.cgroup_parent
            ))
        })
        .map_err(|e| format!("{procs}: {e}"))?;
    let mut seen = Vec::new();
    for pid in procs.lines() {
        let file = format!("/proc/{pid}/root/workspace/read.ok");
        match std::fs::read_to_string(&file) {
            Ok(s) => return s.trim().parse().map_err(|e| format!("{file}: {s:?}: {e}")),
            Err(e) => seen.push(format!("{file}: {e}")),
        }
    }
    Err(format!("no process of {cid} reads its workspace: {seen:?}"))
}

/// An agent sandbox on an OCI image, with live restore, keeps its files across a SIGKILL and a SIGTERM restart:
/// the running agent goes on writing `/workspace` and its volume and reading back what it wrote before the
/// restarts (seen through its own root).
#[tokio::test]
async fn oci_agent_keeps_its_files_across_restarts() {
    let Some((_g, _dir, state_dir, digest)) =
        imported_busybox("oci_agent_keeps_its_files_across_restarts").await
    else {
        return;
    };
    let mut d = Daemon::start(DaemonOpts {
        state_dir: Some(state_dir.clone()),
        extra_config: Some(json!({
            "images": {"bb": {"digest": digest}},
            "languages": {"shell": {"image": "bb", "command": ["/bin/sh"]}},
            "agents": {"max_sandboxes": 2, "live_restore": true},
        })),
        ..DaemonOpts::default()
    })
    .await;
    let (status, volume) = agent_http(&d, "POST", "/volumes", &json!({"sizeMb": 16})).await;
    if status != 201 {
        cannot_run(
            "oci_agent_keeps_its_files_across_restarts",
            &format!("this host has no volumes (mkfs.ext4 and loop devices): {volume}"),
        );
        return;
    }
    let mounts = json!([{"volume": volume["id"], "path": "/workspace/data"}]);
    let id = bb_agent_sandbox(&d, mounts).await;
    let (status, h) = agent_http(
        &d,
        "POST",
        &format!("/sandboxes/{id}/spawn"),
        &json!({"agentId": "a", "providerConfig": {"command": ["/bin/sh", "-c", OCI_AGENT_LOOP]}}),
    )
    .await;
    assert_eq!(status, 200, "{h}");
    let cid = format!("{id}-1");
    let reads_on = async |d: &Daemon, after: u64, what: &str| {
        wait_until(what, Duration::from_secs(15), || async {
            match oci_agent_reads(d, &cid)? {
                n if n > after + 5 => Ok(n),
                n => Err(format!("read back {n} times")),
            }
        })
        .await
    };
    let mut n = reads_on(&d, 0, "the agent to read its files").await;
    for how in [Signal::SIGKILL, Signal::SIGTERM] {
        if how == Signal::SIGKILL {
            d.kill_hard();
        } else {
            d.signal(how);
            assert!(d.wait_exit(Duration::from_secs(30)).is_some(), "stopped");
        }
        d.restart().await;
        let log = d.log();
        assert!(log.contains("taken back (running)"), "{how}: {log}");
        n = reads_on(&d, n, &format!("the agent to read its files after {how}")).await;
    }
    let (status, _) = agent_http(&d, "DELETE", &format!("/sandboxes/{id}"), &json!({})).await;
    assert_eq!(status, 204);
    let path = format!("/volumes/{}", volume["id"].as_str().unwrap());
    let (status, _) = agent_http(&d, "DELETE", &path, &json!({})).await;
    assert_eq!(status, 204);
}

//! Snapshots of agent sandboxes on an OCI image keep what the sandbox's runs wrote into its root (the overlay's
//! upper layer) besides `/workspace`: a sandbox started from one, or a fork, starts with it on the same image, owned
//! by its own root; a change there does not reach the snapshot; another image is refused. Run on
//! both workspace stores (the snapshot's workspace copied on the tmpfs store, a btrfs snapshot on the other).

use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::time::Duration;

use serde_json::{json, Value};

use super::harness::{wait_until, Daemon, DaemonOpts};
use super::images::{agent_events, agent_http, imported_busybox, next_action};

/// `POST /sandboxes` on image `bb` (or from `snapshot`, on its image): the new sandbox's id.
async fn create(d: &Daemon, snapshot: Option<&str>) -> String {
    let mut body = create_body();
    if let Some(s) = snapshot {
        body["fromSnapshot"] = json!(s);
    } else {
        body["workspaceRequirements"]["baseImage"] = json!("bb");
    }
    let (status, created) = agent_http(d, "POST", "/sandboxes", &body).await;
    assert_eq!(status, 201, "{created}");
    created["id"].as_str().unwrap().to_owned()
}

fn create_body() -> Value {
    json!({
        "workspaceRequirements": {"resourceLimits": {"memoryMb": 128, "diskMb": 32}},
        "bootstrap": {"backendUrl": "http://127.0.0.1:9", "backendToken": "t", "agentId": "a",
                      "tokenExpiresAt": "2099-01-01T00:00:00Z",
                      "artifactUploadEndpoint": "http://127.0.0.1:9/api/artifacts"},
    })
}

/// Runs `script` as the agent of sandbox `id` (its one run) and asserts it exits 0.
async fn run(d: &Daemon, id: &str, script: &str) {
    let mut ws = agent_events(d, id).await;
    let (status, h) = agent_http(
        d,
        "POST",
        &format!("/sandboxes/{id}/spawn"),
        &json!({"agentId": "a", "providerConfig": {"command": ["/bin/sh", "-c", script]}}),
    )
    .await;
    assert_eq!(status, 200, "{h}");
    let actions = [next_action(&mut ws).await, next_action(&mut ws).await];
    assert_eq!(actions[0].0, "started", "{actions:?}");
    assert_eq!(
        actions[1].0, "session_end",
        "{id}: the agent did not exit 0: {actions:?}"
    );
}

async fn snapshot(d: &Daemon, id: &str) -> Value {
    let (status, s) = agent_http(d, "POST", &format!("/sandboxes/{id}/snapshot"), &json!({})).await;
    assert_eq!(status, 201, "{s}");
    s
}

async fn delete(d: &Daemon, path: &str) {
    let (status, body) = agent_http(d, "DELETE", path, &json!({})).await;
    assert_eq!(status, 204, "DELETE {path}: {body}");
}

#[tokio::test]
async fn a_snapshot_keeps_the_roots_layer_and_a_sandbox_from_it_starts_with_it() {
    let test = "a_snapshot_keeps_the_roots_layer_and_a_sandbox_from_it_starts_with_it";
    let Some((_g, _dir, state_dir, digest)) = imported_busybox(test).await else {
        return;
    };
    for store in ["tmpfs", "btrfs"] {
        eprintln!("{test}: agents.workspace_store {store}");
        let d = Daemon::start(DaemonOpts {
            state_dir: Some(state_dir.clone()),
            extra_config: Some(json!({
                "images": {"bb": {"digest": digest}},
                "languages": {"shell": {"image": "bb", "command": ["/bin/sh"]},
                              "python": {"image": "host", "command": ["/usr/bin/python3"]}},
                "agents": {"max_sandboxes": 4, "max_snapshots": 4, "disk_mb": 32,
                           "workspace_store": store, "workspace_store_mb": 1024},
            })),
            ..DaemonOpts::default()
        })
        .await;
        root_layers_on(&d, &state_dir).await;
    }
}

async fn root_layers_on(d: &Daemon, state_dir: &Path) {
    let a = create(d, None).await;
    run(
        d,
        &a,
        "mkdir /var/tmp/d && echo one > /var/tmp/d/f && echo ws > /workspace/w && exit 0; exit 9",
    )
    .await;
    let s1 = snapshot(d, &a).await;
    let s1_id = s1["id"].as_str().unwrap().to_owned();
    // var, var/tmp (copied up from the image), var/tmp/d and its file; none of the runtime's mount points.
    assert_eq!(s1["root"]["files"], 4, "{s1}");
    assert!(
        s1["root"]["digest"]
            .as_str()
            .unwrap()
            .starts_with("sha256:"),
        "{s1}"
    );
    let layer = state_dir.join("snapshots").join(&s1_id).join("root");
    let md = |p: &str| std::fs::symlink_metadata(layer.join(p)).unwrap();
    assert_eq!(
        std::fs::read_to_string(layer.join("var/tmp/d/f")).unwrap(),
        "one\n"
    );
    assert_eq!(
        (md("var/tmp/d/f").uid(), md("var/tmp/d").uid()),
        (0, 0),
        "the sandbox's root is 0"
    );
    assert_eq!(
        (md("var/tmp").uid(), md("var/tmp").mode() & 0o7777),
        (65534, 0o1777)
    );
    for left_out in ["workspace", "sandbox", "tmp", "proc", "dev"] {
        assert!(!layer.join(left_out).exists(), "{left_out} is in the layer");
    }

    // From the snapshot: the root's files there, owned by the new sandbox's root, and changed there only.
    let b = create(d, Some(&s1_id)).await;
    run(
        d,
        &b,
        r#"test "$(cat /var/tmp/d/f)" = one && test "$(stat -c %u /var/tmp/d/f)" = 0 &&
           test "$(cat /workspace/w)" = ws && echo two > /var/tmp/d/f && echo new > /var/tmp/g && exit 0; exit 9"#,
    )
    .await;
    let (status, fork) =
        agent_http(d, "POST", &format!("/sandboxes/{b}/fork"), &create_body()).await;
    assert_eq!(status, 201, "{fork}");
    assert_eq!(fork["snapshot"]["root"]["files"], 5, "{fork}");
    let c = fork["sandbox"]["id"].as_str().unwrap().to_owned();
    run(
        d,
        &c,
        r#"test "$(cat /var/tmp/d/f)" = two && test "$(cat /var/tmp/g)" = new && exit 0; exit 9"#,
    )
    .await;
    assert_eq!(
        std::fs::read_to_string(layer.join("var/tmp/d/f")).unwrap(),
        "one\n"
    );

    // A snapshot with a root layer runs on its image only.
    let mut other = create_body();
    other["fromSnapshot"] = json!(s1_id);
    other["workspaceRequirements"]["baseImage"] = json!("host");
    let (status, refused) = agent_http(d, "POST", "/sandboxes", &other).await;
    assert_eq!(status, 409, "{refused}");
    assert!(
        refused
            .to_string()
            .contains("root layer of image \\\"bb\\\""),
        "{refused}"
    );

    for id in [&c, &b, &a] {
        delete(d, &format!("/sandboxes/{id}")).await;
    }
    let s2 = fork["snapshot"]["id"].as_str().unwrap();
    for id in [s2, s1_id.as_str()] {
        // A fork's snapshot on the btrfs store is recorded once its digest is computed.
        wait_until("the snapshot's digest", Duration::from_secs(15), || async {
            let (_, s) = agent_http(d, "GET", &format!("/snapshots/{id}"), &json!({})).await;
            match s["digest"].as_str().is_some_and(|d| !d.is_empty()) {
                true => Ok(()),
                false => Err(s.to_string()),
            }
        })
        .await;
        delete(d, &format!("/snapshots/{id}")).await;
    }
    let left: Vec<_> = ["snapshots", "agents"]
        .iter()
        .flat_map(|d| std::fs::read_dir(state_dir.join(d)).unwrap().flatten())
        .map(|e| e.path())
        .collect();
    assert!(left.is_empty(), "{left:?}");
}

//! A sandbox on fakes (no container, no backend over the network: uploads answer a made-up `artifact://` URI) fed
//! control lines directly: what an agent's lines may change (pending decisions, the record) and what reaches the
//! gateway of them (sandboxd's own events and the fields it fills in cannot be written by the agent).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::Arc;

use agent_api::{AdapterEvent, SandboxBootstrap};
use serde_json::{json, Map, Value};
use sha2::Digest;

use super::{Parts, Sandbox, SandboxLimits};
use crate::backend::Backend;
use crate::config::AgentsConfig;
use crate::events::{Budgets, Hub};
use crate::host::{Containers, Host, Settings, WorkspaceError, WorkspaceRequest};
use crate::test_host::{Bearer, DirStore, FakeUploads};
use containers::agent::{BoxFuture, LongLivedError, RunContainer, RunPlan, Workspace};

const AGENT: &str = "agent-1";

/// A workspace that is a plain directory; it has no runs.
struct DirWorkspace(PathBuf);

impl Workspace for DirWorkspace {
    fn dir(&self) -> &Path {
        &self.0
    }

    fn workspace(&self) -> PathBuf {
        self.0.join("workspace")
    }

    fn host_id(&self) -> u32 {
        nix::unistd::getuid().as_raw()
    }

    fn root_upper(&self) -> Option<PathBuf> {
        None
    }

    fn write_inputs(
        &self,
        _name: &str,
        _content: &[u8],
        _files: &[runtime::rootfs::InputFile],
    ) -> runtime::Result<()> {
        Ok(())
    }

    fn create_run<'a>(
        &'a self,
        _plan: RunPlan<'a>,
    ) -> BoxFuture<'a, Result<Arc<dyn RunContainer>, LongLivedError>> {
        Box::pin(async { Err(LongLivedError::Create("no runs in these tests".into())) })
    }

    fn remove(&self) -> BoxFuture<'_, ()> {
        Box::pin(async {})
    }
}

/// No images, no workspaces (the sandbox is assembled by hand).
struct NoContainers;

impl Containers for NoContainers {
    fn image_environment(&self, _image: &str) -> Option<BTreeMap<String, String>> {
        None
    }

    fn create_workspace<'a>(
        &'a self,
        req: WorkspaceRequest<'a>,
    ) -> BoxFuture<'a, Result<Arc<dyn Workspace>, WorkspaceError>> {
        let image = req.image.to_owned();
        Box::pin(async move { Err(WorkspaceError::NoImage(image)) })
    }
}

/// A sandbox of agent `agent-1` with a connected gateway.
struct Rig {
    sb: Arc<Sandbox>,
    gateway: u64,
    uploads: Arc<FakeUploads>,
    dir: tempfile::TempDir,
}

impl Rig {
    fn new(live_restore: bool) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let sb_dir = dir.path().join("sb");
        std::fs::create_dir_all(sb_dir.join("workspace")).unwrap();
        std::fs::create_dir_all(dir.path().join("store")).unwrap();
        let uploads = Arc::new(FakeUploads::default());
        let host = Host {
            settings: Arc::new(Settings {
                agents: AgentsConfig {
                    live_restore,
                    ..AgentsConfig::default()
                },
                state_dir: dir.path().to_owned(),
                max_artifact_bytes: 1 << 20,
                listen: "127.0.0.1:1".parse().unwrap(),
            }),
            containers: Arc::new(NoContainers),
            store: Arc::new(DirStore(dir.path().join("store"))),
            uploads: uploads.clone(),
            auth: Arc::new(Bearer(None)),
            network: None,
            disks: None,
            snapshots: Err("no snapshots in these tests".into()),
            cow: None,
        };
        let bootstrap: SandboxBootstrap = serde_json::from_value(json!({
            "agentId": AGENT,
            "backendUrl": "http://127.0.0.1:9",
            "backendToken": "secret",
            "tokenExpiresAt": "2099-01-01T00:00:00Z",
            "artifactUploadEndpoint": "http://127.0.0.1:9/api/artifacts",
        }))
        .unwrap();
        let backend = Backend::new(bootstrap, 1, uploads.clone());
        let hub = Hub::with_budgets(sb_dir.join("events"), AGENT, Budgets::default()).unwrap();
        let gateway = hub.attach();
        let limits = SandboxLimits {
            cpu_cores: protocol::CpuCores::from_const(1.0),
            memory_mb: 64,
            disk_mb: 64,
            timeout_ms: 60_000,
        };
        let sb = Sandbox::new(Parts {
            id: "sb-1".into(),
            agent_id: AGENT.into(),
            limits,
            template: agent_api::AgentTemplate::default(),
            image: "host".into(),
            backend,
            hub,
            workspace: Arc::new(DirWorkspace(sb_dir)),
            network: None,
            volumes: None,
            from_snapshot: None,
            cow: false,
            host,
        });
        Self {
            sb,
            gateway,
            uploads,
            dir,
        }
    }

    /// Processes `line` as the agent's; whether it changed the sandbox's state.
    async fn line(&self, line: Value) -> bool {
        let bytes = serde_json::to_vec(&line).unwrap();
        self.sb.handle_line("r1", &bytes).await
    }

    /// The event payloads the gateway got since the last call.
    fn events(&self) -> Vec<Map<String, Value>> {
        let mut out = Vec::new();
        while let Some(json) = self.sb.hub.next(self.gateway).unwrap() {
            out.push(serde_json::from_str::<AdapterEvent>(&json).unwrap().event);
        }
        out
    }

    fn pending(&self) -> usize {
        self.sb.shared().pending_decisions.len()
    }
}

fn decision(id: &str) -> Value {
    json!({"type": "decision", "agentId": AGENT, "subtype": "tool_approval", "decisionId": id})
}

/// Asserts that `got` is exactly one refusal warning (`malformed_event`) whose message contains `why`.
#[track_caller]
fn refused(got: &[Map<String, Value>], why: &str) {
    assert_eq!(got.len(), 1, "{got:#?}");
    assert_eq!(got[0]["type"], "error", "{got:#?}");
    assert_eq!(got[0]["errorCode"], "malformed_event", "{got:#?}");
    assert_eq!(got[0]["severity"], "warning");
    assert_eq!(got[0]["agentId"], AGENT);
    let message = got[0]["message"].as_str().unwrap();
    assert!(message.contains(why), "{message:?} lacks {why:?}");
}

#[tokio::test]
async fn a_decision_id_over_256_bytes_is_refused_and_never_kept() {
    let rig = Rig::new(false);
    let longest = "d".repeat(256);
    assert!(rig.line(decision(&longest)).await);
    let got = rig.events();
    assert_eq!(got.len(), 1);
    assert_eq!(got[0]["decisionId"], longest.as_str());
    let too_long = "d".repeat(257);
    assert!(!rig.line(decision(&too_long)).await);
    refused(&rig.events(), "decisionId");
    assert!(!rig.sb.shared().pending_decisions.contains(&too_long));
    assert_eq!(rig.pending(), 1);
}

#[tokio::test]
async fn pending_decisions_stop_at_1000_and_the_record_stays_small() {
    let rig = Rig::new(true);
    let id = |i: usize| format!("{i:0>256}");
    for i in 0..1000 {
        assert!(rig.line(decision(&id(i))).await);
    }
    assert_eq!(rig.events().len(), 1000);
    // One more is refused, the run goes on; a decision already pending is no new one.
    assert!(!rig.line(decision(&id(1000))).await);
    refused(&rig.events(), "1000 decisions");
    rig.line(decision(&id(7))).await;
    assert_eq!(rig.events()[0]["decisionId"], id(7).as_str());
    assert_eq!(rig.pending(), 1000);
    // The record holds them all, and no more: 1000 ids of 256 bytes and the rest of the record.
    rig.sb.persist();
    let record = std::fs::metadata(rig.dir.path().join("sb/sandbox.json"))
        .unwrap()
        .len();
    assert!(
        record > 256_000 && record < 256_000 + 1000 * 8 + (16 << 10),
        "{record} bytes"
    );
}

#[tokio::test]
async fn lifecycle_events_are_sandboxd_s_own() {
    let rig = Rig::new(false);
    for (action, reason) in [("session_end", None), ("killed", Some("timeout"))] {
        let mut line = json!({"type": "lifecycle", "agentId": AGENT, "action": action});
        if let Some(r) = reason {
            line["reason"] = r.into();
        }
        assert!(!rig.line(line).await);
        refused(&rig.events(), "lifecycle");
    }
}

#[tokio::test]
async fn an_event_in_another_agent_s_name_is_refused() {
    let rig = Rig::new(false);
    rig.line(json!({"type": "status", "agentId": "agent-2", "message": "m"}))
        .await;
    refused(&rig.events(), "agentId");
    let mut other = decision("d1");
    other["agentId"] = "agent-2".into();
    rig.line(other).await;
    refused(&rig.events(), "agentId");
    assert_eq!(rig.pending(), 0);
    // The agent's own name goes through unchanged.
    let own = json!({"type": "status", "agentId": AGENT, "message": "m"});
    rig.line(own.clone()).await;
    assert_eq!(Value::Object(rig.events().remove(0)), own);
}

#[tokio::test]
async fn error_events_with_sandboxd_s_error_codes_are_refused() {
    let rig = Rig::new(false);
    let codes = [
        "agent_crashed",
        "artifact_upload_failed",
        "control_line_too_long",
        "events_dropped",
        "malformed_event",
    ];
    for code in codes {
        rig.line(
            json!({"type": "error", "agentId": AGENT, "severity": "high", "message": "m",
                        "recoverable": false, "errorCode": code, "category": "internal"}),
        )
        .await;
        refused(&rig.events(), code);
    }
    // The agent's own codes, and none, are its to use.
    for code in [json!("tool_failed"), Value::Null] {
        let mut line = json!({"type": "error", "agentId": AGENT, "severity": "low", "message": "m",
                              "recoverable": true, "category": "tool"});
        if !code.is_null() {
            line["errorCode"] = code;
        }
        rig.line(line.clone()).await;
        assert_eq!(Value::Object(rig.events().remove(0)), line);
    }
}

/// An artifact as an agent writes it, with `uri` and the fields sandboxd fills in after an upload.
fn artifact(uri: &str) -> Value {
    json!({"type": "artifact", "agentId": AGENT, "artifactId": "a1", "name": "n", "kind": "document",
           "workstream": "w", "status": "draft", "qualityScore": 1,
           "provenance": {"createdBy": AGENT, "createdAt": "2026-01-01T00:00:00Z", "sourcePath": "src/forged.rs"},
           "uri": uri, "contentHash": "0".repeat(64), "sizeBytes": 12345})
}

#[tokio::test]
async fn an_agent_cannot_name_a_backend_uri_or_a_content_hash() {
    let rig = Rig::new(false);
    for uri in ["artifact://project-123/agent-456/report.md", "report.md"] {
        rig.line(artifact(uri)).await;
        let got = rig.events();
        assert_eq!(got.len(), 2, "{got:#?}");
        let a = &got[0];
        assert_eq!(a["artifactId"], "a1");
        for field in ["uri", "contentHash", "sizeBytes"] {
            assert!(a.get(field).is_none(), "{field} forwarded: {a:#?}");
        }
        assert!(a["provenance"].get("sourcePath").is_none(), "{a:#?}");
        assert_eq!(a["provenance"]["createdBy"], AGENT);
        assert_eq!(got[1]["errorCode"], "artifact_upload_failed");
        assert!(got[1]["message"].as_str().unwrap().contains("/workspace"));
    }
    // Without a uri: nothing uploaded, nothing counted as extracted.
    let mut no_uri = artifact("");
    no_uri.as_object_mut().unwrap().remove("uri");
    rig.line(no_uri).await;
    let got = rig.events();
    assert_eq!(got.len(), 1, "{got:#?}");
    assert!(got[0].get("contentHash").is_none(), "{got:#?}");
    assert_eq!(rig.uploads.0.load(Ordering::SeqCst), 0);
    assert_eq!(rig.sb.shared().uploads, 0);
}

#[tokio::test]
async fn an_uploaded_artifact_carries_what_sandboxd_measured() {
    let rig = Rig::new(false);
    std::fs::write(rig.dir.path().join("sb/workspace/a.txt"), b"A").unwrap();
    rig.line(artifact("/workspace/a.txt")).await;
    let got = rig.events();
    assert_eq!(got.len(), 1, "{got:#?}");
    let hash = format!("{:x}", sha2::Sha256::digest(b"A"));
    let a = &got[0];
    assert_eq!(a["uri"], format!("artifact://backend/{hash}").as_str());
    assert_eq!(a["contentHash"], hash.as_str());
    assert_eq!(a["sizeBytes"], 1);
    assert_eq!(a["provenance"]["sourcePath"], "/workspace/a.txt");
    assert_eq!(a["provenance"]["createdBy"], AGENT);
    assert_eq!(rig.uploads.0.load(Ordering::SeqCst), 1);
    assert_eq!(rig.sb.shared().uploads, 1);
}

//! What the benches share: a free loopback port for a daemon, its `/healthz`, and an agent sandbox request.

use std::io::{Read, Write};
use std::net::TcpListener;
use std::time::Duration;

use serde_json::Value;

/// A loopback port free right now (the daemon binds it next).
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// The daemon's `/healthz` on `port`, or `None` until it answers 200.
pub fn healthz(port: u16) -> Option<Value> {
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
    s.write_all(b"GET /healthz HTTP/1.0\r\n\r\n").ok()?;
    let mut r = String::new();
    let _ = s.read_to_string(&mut r);
    if !(r.starts_with("HTTP/1.0 200") || r.starts_with("HTTP/1.1 200")) {
        return None;
    }
    serde_json::from_str(r.split("\r\n\r\n").nth(1)?).ok()
}

/// A daemon process this bench started: SIGTERM (it drains and removes its containers) and reaped when dropped.
/// (The soak bench stops its daemon its own way, checking the drain.)
#[allow(dead_code)]
pub struct Stopped(pub std::process::Child);

#[allow(dead_code)]
impl Stopped {
    /// The daemon's pid.
    pub fn pid(&self) -> i32 {
        self.0.id() as i32
    }
}

impl Drop for Stopped {
    fn drop(&mut self) {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(self.pid()),
            nix::sys::signal::Signal::SIGTERM,
        );
        let _ = self.0.wait();
    }
}

/// A `POST /sandboxes` body for benches: the fake agent of the client suite as the template's command, an hour's
/// lifetime, `disk_mb` of workspace, a backend nobody answers.
#[allow(dead_code)]
pub fn agent_request(disk_mb: u64) -> agent_api::CreateSandboxRequest {
    serde_json::from_value(serde_json::json!({
        "workspaceRequirements": {
            "mounts": [], "capabilities": [],
            "resourceLimits": {"cpuCores": 1, "memoryMb": 256, "diskMb": disk_mb, "timeoutMs": 3_600_000}
        },
        "bootstrap": {
            "backendUrl": "http://127.0.0.1:9",
            "backendToken": "bench",
            "tokenExpiresAt": "2099-01-01T00:00:00Z",
            "agentId": "bench-agent",
            "artifactUploadEndpoint": "http://127.0.0.1:9/api/artifacts",
        },
        "template": {
            "command": ["/usr/bin/python3", "/workspace/fake_agent.py"],
            "files": [{"path": "fake_agent.py", "content": include_str!("../../../client/tests/agents/fake_agent.py")}],
        }
    }))
    .unwrap()
}

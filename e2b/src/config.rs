//! The `e2b:` block of sandboxd's configuration (the daemon's `Config` embeds it; its checks run with the rest).

use std::net::SocketAddr;
use std::path::PathBuf;

use serde::Deserialize;

/// `e2b:`
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct E2bConfig {
    /// The facade's own listener (control plane and sandbox plane); absent: no facade.
    pub listen: Option<SocketAddr>,
    /// The image of template `base`.
    pub base_image: String,
    /// The image of template `code-interpreter-v1` (`e2b-code-interpreter`'s default); `None`: `base_image`. An
    /// image with numpy, pandas and matplotlib gives `run_code` its rich results (`images/build.sh
    /// code-interpreter`). Like every image a sandbox uses, one a language is configured with.
    pub code_interpreter_image: Option<String>,
    /// Memory of a sandbox, MiB.
    pub memory_mb: u64,
    /// CPU cores a sandbox reports.
    pub cpu_count: u32,
    /// Size of a sandbox's home (`/workspace`) + `/tmp` tmpfs, MiB.
    pub disk_mb: u64,
    /// Processes and threads of a sandbox.
    pub pids_max: u64,
    /// The largest `POST /files` upload, MiB.
    pub max_upload_mb: u64,
    /// The nodes this listener serves with (`docs/spec/e2b-compat.md`, "On a fleet"); absent: this node alone.
    pub fleet: Option<FleetConfig>,
}

/// `e2b.fleet:` the E2B listeners of a fleet serve each other's sandboxes: a sandbox id names its node, a request
/// that lands on another node is forwarded to it, creates are placed on the least loaded node, lists span them all.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct FleetConfig {
    /// This node's name, unique in the fleet and stable across restarts (a sandbox id carries a digest of it);
    /// absent: `$SANDBOXD_NODE_NAME`, else the host name.
    #[serde(default)]
    pub node: Option<String>,
    /// A file holding the fleet's shared secret (at least 16 bytes, surrounding white space ignored): node-to-node
    /// calls carry it, never a user's API key.
    pub secret_file: PathBuf,
    /// The E2B listeners of the fleet as `host:port` (this node's own may be among them).
    #[serde(default)]
    pub peers: Vec<String>,
    /// A DNS name whose addresses are the fleet's nodes, as `name:port` (a Kubernetes headless Service), resolved
    /// again at every refresh.
    #[serde(default)]
    pub peers_dns: Option<String>,
    /// How often the nodes are asked again who they are and how many sandboxes they hold, ms.
    #[serde(default = "default_refresh_ms")]
    pub refresh_ms: u64,
}

fn default_refresh_ms() -> u64 {
    2000
}

impl Default for E2bConfig {
    fn default() -> Self {
        Self {
            listen: None,
            base_image: "host".into(),
            code_interpreter_image: None,
            memory_mb: 512,
            cpu_count: 1,
            disk_mb: 1024,
            pids_max: 512,
            max_upload_mb: 1024,
            fleet: None,
        }
    }
}

impl E2bConfig {
    /// What is wrong with it: `(key, reason)`.
    pub fn check(&self) -> Result<(), (&'static str, String)> {
        for (key, value) in [
            ("e2b.memory_mb", self.memory_mb),
            ("e2b.cpu_count", u64::from(self.cpu_count)),
            ("e2b.disk_mb", self.disk_mb),
            ("e2b.pids_max", self.pids_max),
            ("e2b.max_upload_mb", self.max_upload_mb),
        ] {
            if value == 0 {
                return Err((key, "must be positive".into()));
            }
        }
        if self.base_image.is_empty() {
            return Err(("e2b.base_image", "must name an image".into()));
        }
        if let Some(fleet) = &self.fleet {
            if fleet.peers.is_empty() && fleet.peers_dns.is_none() {
                return Err(("e2b.fleet", "needs peers or peers_dns".into()));
            }
            if fleet.refresh_ms == 0 {
                return Err(("e2b.fleet.refresh_ms", "must be positive".into()));
            }
            if let Some(node) = &fleet.node {
                if node.is_empty() || node.len() > 253 {
                    return Err(("e2b.fleet.node", "must be 1 to 253 bytes".into()));
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fleet(yaml: &str) -> Result<(), (&'static str, String)> {
        let config: E2bConfig = serde_yaml_ng::from_str(yaml).unwrap();
        config.check()
    }

    #[test]
    fn a_fleet_needs_somewhere_to_find_its_nodes() {
        assert_eq!(
            fleet("fleet: {secret_file: /s}").unwrap_err().0,
            "e2b.fleet"
        );
        assert!(fleet("fleet: {secret_file: /s, peers: [\"10.0.0.1:3000\"]}").is_ok());
        assert!(fleet("fleet: {secret_file: /s, peers_dns: \"sandboxd:3000\"}").is_ok());
        assert_eq!(
            fleet("fleet: {secret_file: /s, peers_dns: \"a:1\", refresh_ms: 0}")
                .unwrap_err()
                .0,
            "e2b.fleet.refresh_ms"
        );
        assert_eq!(
            fleet("fleet: {secret_file: /s, peers_dns: \"a:1\", node: \"\"}")
                .unwrap_err()
                .0,
            "e2b.fleet.node"
        );
        assert!(serde_yaml_ng::from_str::<E2bConfig>("fleet: {peers: []}").is_err());
    }
}

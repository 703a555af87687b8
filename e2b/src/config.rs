//! The `e2b:` block of sandboxd's configuration (the daemon's `Config` embeds it; its checks run with the rest).

use std::net::SocketAddr;

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
        Ok(())
    }
}

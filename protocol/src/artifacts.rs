//! The artifact manifest (`docs/spec/artifact-manifest.md`): what a `result` carries under `artifacts` when the
//! request asked for files, and what the server keeps under the manifest id.
//!
//! The `result` message keeps `artifacts` as a JSON value so a client reads any server's manifest; sandboxd builds
//! this type and serialises it there, and a client may read it back with [`ArtifactManifest::from_value`].

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// The manifest of one execution's artifacts.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ArtifactManifest {
    /// `am_` and a unique suffix; the name it is stored under.
    pub manifest_id: String,
    /// The execution the files came from.
    pub execution_id: String,
    /// When the manifest was made (protocol timestamp).
    pub generated_at: String,
    /// The environment fingerprint of the execution (the same as its `result`'s).
    pub environment_fingerprint: String,
    /// The files collected, in path order.
    pub artifacts: Vec<Artifact>,
    /// Files that matched but were not collected, with why (at most a bounded number listed).
    pub skipped: Vec<SkippedArtifact>,
    /// Present when more files were skipped than listed, or the walk stopped early.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dropped: Option<DroppedArtifacts>,
    /// Present when an eager upload was configured and some uploads failed: how many.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub upload_failures: Option<u64>,
}

/// One collected file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Artifact {
    /// The artifact type (`file` unless the request mapped the matching glob to another type).
    #[serde(rename = "type")]
    pub artifact_type: String,
    /// Path relative to the working directory.
    pub path: String,
    /// Where to fetch it: `artifact://sha256/<hex>` (the server's store), or the URI an upload returned.
    #[serde(rename = "ref")]
    pub reference: String,
    /// `sha256:<hex>` of the content.
    pub checksum: String,
    /// Size in bytes.
    pub size_bytes: u64,
    /// Content type, from the name or else the first bytes.
    pub mime_type: String,
    /// The first bytes as text, when they are text.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub preview: Option<String>,
    /// True once an eager upload succeeded (`reference` is then the upload's URI).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uploaded: Option<bool>,
    /// Why the eager upload failed (the content stays in the server's store).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub upload_error: Option<String>,
}

impl Artifact {
    /// The hex digest of the content (`checksum` without its `sha256:`), if it has that form.
    pub fn sha256_hex(&self) -> Option<&str> {
        self.checksum.strip_prefix("sha256:")
    }
}

/// A file that matched but was not collected.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SkippedArtifact {
    /// Path relative to the working directory.
    pub path: String,
    /// Why: `symlink`, `fifo`, `socket`, `device`, `not_regular`, `too_large`, `count_limit`, `total_limit`,
    /// `unreadable`.
    pub reason: String,
}

/// What the `skipped` list leaves out.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DroppedArtifacts {
    /// Skipped files per reason, listed or not.
    pub by_reason: BTreeMap<String, u64>,
    /// Skipped files not in the `skipped` list.
    pub not_listed: u64,
    /// Whether the walk of the working directory stopped early.
    pub walk_truncated: bool,
}

impl ArtifactManifest {
    /// The manifest as the JSON value a `result` carries.
    pub fn to_value(&self) -> Value {
        // A struct of strings, numbers, booleans, lists and string-keyed maps always serialises.
        serde_json::to_value(self).unwrap_or(Value::Null)
    }

    /// Reads a manifest from a `result`'s `artifacts` value.
    pub fn from_value(value: Value) -> Result<Self, serde_json::Error> {
        serde_json::from_value(value)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn optional_fields_are_left_out_and_names_follow_the_spec() {
        let m = ArtifactManifest {
            manifest_id: "am_1".into(),
            execution_id: "e1".into(),
            generated_at: "2026-11-23T00:00:00.000Z".into(),
            environment_fingerprint: "sha256:00".into(),
            artifacts: vec![Artifact {
                artifact_type: "file".into(),
                path: "out.txt".into(),
                reference: "artifact://sha256/ab".into(),
                checksum: "sha256:ab".into(),
                size_bytes: 3,
                mime_type: "text/plain".into(),
                preview: Some("hi\n".into()),
                uploaded: None,
                upload_error: None,
            }],
            skipped: vec![SkippedArtifact {
                path: "link".into(),
                reason: "symlink".into(),
            }],
            dropped: None,
            upload_failures: None,
        };
        let v = m.to_value();
        assert_eq!(
            v,
            serde_json::json!({
                "manifest_id": "am_1",
                "execution_id": "e1",
                "generated_at": "2026-11-23T00:00:00.000Z",
                "environment_fingerprint": "sha256:00",
                "artifacts": [{
                    "type": "file", "path": "out.txt", "ref": "artifact://sha256/ab", "checksum": "sha256:ab",
                    "size_bytes": 3, "mime_type": "text/plain", "preview": "hi\n"
                }],
                "skipped": [{"path": "link", "reason": "symlink"}]
            })
        );
        assert_eq!(ArtifactManifest::from_value(v).unwrap(), m);
        assert_eq!(m.artifacts[0].sha256_hex(), Some("ab"));
    }
}

//! OCI images for sandboxd: import and verify an image layout, unpack its layers once into a cache shared by every
//! image that has them, and pack a root filesystem into a layout.
//!
//! - [`layout`] reads an OCI image layout (`oci-layout`, `index.json`, `blobs/sha256/…`) with `oci-spec` and
//!   verifies the sha256 and size of every blob it uses before using it.
//! - [`unpack`] turns one layer (tar, tar+gzip, tar+zstd) into a directory in overlayfs' format (whiteouts as 0/0
//!   character devices, opaque directories as `trusted.overlay.opaque`), refusing anything that could reach outside
//!   the layer or smuggle privilege in.
//! - [`store`] keeps imported images under a root directory (`<state_dir>/images/oci` in sandboxd): a record per
//!   name, one directory per layer digest, shared by every image that has the layer.
//! - [`pack`] writes a single-layer OCI layout from a root filesystem tar (the `images/` recipes and the tests).
//!
//! This crate knows nothing of containers. What an execution gets from it is a list of directories
//! ([`ImageStore::lower_dirs`], top layer first) and the image's run configuration; the container runtime mounts
//! those directories as the read-only lowers of an overlay root. The one thing the two share is [`MOUNT_POINTS`],
//! the names the runtime mounts over, which every layer must hold as directories if it holds them at all.

#[cfg(test)]
mod hostile_tests;
pub mod layout;
pub mod pack;
pub mod store;
pub mod unpack;

use std::path::PathBuf;

pub use store::{ImageStore, StoredImage};

/// Top-level directories the container runtime mounts over in every container. An image may hold them as empty
/// directories or not at all; a symlink or a file there is refused (a mount must never follow a path the image
/// controls). sandboxd's tests check that this is the runtime's own list (`runtime::rootfs::IMAGE_MOUNT_POINTS`).
pub const MOUNT_POINTS: &[&str] = &["proc", "dev", "sys", "tmp", "workspace", "sandbox"];

/// Why an image or one of its layers was refused.
#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    /// The directory is not a usable OCI image layout.
    #[error("not a usable OCI image layout: {0}")]
    Layout(String),
    /// A blob is missing, has the wrong size or the wrong digest.
    #[error("blob {digest}: {reason}")]
    Blob {
        /// `sha256:<hex>` as the referring descriptor names it.
        digest: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A layer holds something the unpacker refuses, or cannot be read.
    #[error("layer {digest}: {entry}: {reason}")]
    Layer {
        /// The layer's digest.
        digest: String,
        /// The tar entry (path as written in the archive), or `archive` for the archive as a whole.
        entry: String,
        /// Why it was refused.
        reason: String,
    },
    /// No image by that name in the store.
    #[error("no image named {0:?} (import one with `sandboxd images import DIR --name NAME`)")]
    NotFound(String),
    /// The image name is not acceptable.
    #[error("invalid image name {0:?}: use 1-64 characters of [a-z0-9._-], starting with a letter or digit (\"host\" is reserved)")]
    InvalidName(String),
    /// The store is in use by a running daemon and the operation would pull layers from under it.
    #[error("the image store {0} is in use (by a running sandboxd or an import); stop it first")]
    Busy(PathBuf),
    /// A filesystem operation failed.
    #[error("I/O error on {}", .path.display())]
    Io {
        /// The path it happened on.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
}

impl ImageError {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Self::Io {
            path: path.into(),
            source,
        }
    }
}

/// Result alias of this crate.
pub type Result<T, E = ImageError> = std::result::Result<T, E>;

/// A validated `sha256:<64 hex>` digest; `hex()` is safe to use as a file name.
#[derive(
    Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize, serde::Deserialize,
)]
#[serde(try_from = "String", into = "String")]
pub struct Sha256(String);

impl Sha256 {
    /// Parses `sha256:<64 lowercase hex>`; anything else (other algorithms, upper case, path characters) is refused.
    pub fn parse(s: &str) -> Option<Self> {
        let hex = s.strip_prefix("sha256:")?;
        (hex.len() == 64
            && hex
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)))
        .then(|| Self(s.to_owned()))
    }

    /// The digest of `bytes`.
    pub fn of(bytes: &[u8]) -> Self {
        use sha2::Digest;
        Self::from_hasher(sha2::Sha256::new_with_prefix(bytes))
    }

    /// The digest a hasher has accumulated.
    pub fn from_hasher(h: sha2::Sha256) -> Self {
        use sha2::Digest;
        Self(format!("sha256:{:x}", h.finalize()))
    }

    /// The 64 hex characters.
    pub fn hex(&self) -> &str {
        &self.0["sha256:".len()..]
    }

    /// `sha256:<hex>`.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Display for Sha256 {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// A string that is not `sha256:<64 lowercase hex>`.
#[derive(Debug, thiserror::Error)]
#[error("Not a sha256 digest: {0:?}")]
pub struct InvalidDigest(pub String);

impl TryFrom<String> for Sha256 {
    type Error = InvalidDigest;
    fn try_from(s: String) -> std::result::Result<Self, InvalidDigest> {
        Self::parse(&s).ok_or(InvalidDigest(s))
    }
}

impl From<Sha256> for String {
    fn from(d: Sha256) -> String {
        d.0
    }
}

/// How a layer blob is compressed, from its media type.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Compression {
    /// Plain tar.
    None,
    /// tar+gzip.
    Gzip,
    /// tar+zstd.
    Zstd,
}

impl Compression {
    /// From an OCI or Docker layer media type; `None` for anything that is not a layer this runtime can unpack.
    pub fn from_media_type(media_type: &str) -> Option<Self> {
        match media_type {
            "application/vnd.oci.image.layer.v1.tar" => Some(Self::None),
            "application/vnd.oci.image.layer.v1.tar+gzip"
            | "application/vnd.docker.image.rootfs.diff.tar.gzip" => Some(Self::Gzip),
            "application/vnd.oci.image.layer.v1.tar+zstd" => Some(Self::Zstd),
            _ => None,
        }
    }

    /// The OCI media type.
    pub fn media_type(self) -> &'static str {
        match self {
            Self::None => "application/vnd.oci.image.layer.v1.tar",
            Self::Gzip => "application/vnd.oci.image.layer.v1.tar+gzip",
            Self::Zstd => "application/vnd.oci.image.layer.v1.tar+zstd",
        }
    }
}

/// Image names: what `--name` and the config's `images.<name>` accept.
pub fn valid_name(name: &str) -> bool {
    name != "host"
        && (1..=64).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"._-".contains(&b))
        && name.as_bytes()[0].is_ascii_alphanumeric()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn digests_and_names_are_strict() {
        let ok = format!("sha256:{}", "a".repeat(64));
        assert_eq!(Sha256::parse(&ok).map(|d| d.hex().len()), Some(64));
        for bad in [
            "sha256:".to_owned(),
            format!("sha256:{}", "A".repeat(64)),
            format!("sha512:{}", "a".repeat(64)),
            format!("sha256:{}/..", "a".repeat(61)),
        ] {
            assert!(Sha256::parse(&bad).is_none(), "{bad}");
        }
        assert_eq!(
            Sha256::of(b"").hex(),
            "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
        );
        for good in ["python", "py3.11", "shell-busybox", "0x"] {
            assert!(valid_name(good), "{good}");
        }
        for bad in [
            "",
            "host",
            "Python",
            "../x",
            "a/b",
            ".hidden",
            &"x".repeat(65),
        ] {
            assert!(!valid_name(bad), "{bad}");
        }
    }
}

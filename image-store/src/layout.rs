//! Reading an OCI image layout: `oci-layout`, `index.json`, then the manifest, config and layer blobs under
//! `blobs/sha256/`. Every blob is checked against its descriptor (size, then sha256 of the bytes actually parsed or
//! unpacked) before anything uses it; a mismatch names the blob.

use std::fs::File;
use std::io::{self, Read};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use oci_spec::image::{Descriptor, ImageConfiguration, ImageIndex, ImageManifest, MediaType};
use oci_spec::OciSpecError;

use super::{Compression, ImageError, Result, Sha256};

/// Manifests, indexes and configs are small; a larger one is refused rather than read into memory.
const MAX_JSON_BLOB: u64 = 4 << 20;

/// A layer as the manifest and the config describe it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct LayerRef {
    /// Digest of the blob (compressed as stored).
    pub digest: Sha256,
    /// Size of the blob.
    pub size: u64,
    /// How the blob is compressed.
    pub compression: Compression,
    /// Digest of the uncompressed tar (the config's `rootfs.diff_ids`).
    pub diff_id: Sha256,
}

/// What the runtime takes from the image config.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct RunConfig {
    /// `Env`, `KEY=VALUE`.
    pub env: Vec<String>,
    /// `Entrypoint` (informational: executions run the language's configured command).
    pub entrypoint: Vec<String>,
    /// `Cmd` (informational).
    pub cmd: Vec<String>,
}

/// An image whose manifest and config were read and verified; layers are verified by [`verify_blob`] or while
/// unpacking.
#[derive(Debug, Clone)]
pub struct Layout {
    /// The layout directory.
    pub dir: PathBuf,
    /// Digest of the manifest: the image's identity.
    pub manifest_digest: Sha256,
    /// Digest of the config blob.
    pub config_digest: Sha256,
    /// Layers, bottom first.
    pub layers: Vec<LayerRef>,
    /// From the config.
    pub run: RunConfig,
}

/// The OCI architecture name of this build's target.
pub fn native_arch() -> &'static str {
    match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        other => other,
    }
}

/// Path of a blob in a layout.
pub fn blob_path(dir: &Path, digest: &Sha256) -> PathBuf {
    dir.join("blobs/sha256").join(digest.hex())
}

/// Opens a blob (a regular file, not a symlink) and checks its size.
pub fn open_blob(dir: &Path, digest: &Sha256, size: u64) -> Result<File> {
    let path = blob_path(dir, digest);
    let blob_err = |reason: String| ImageError::Blob {
        digest: digest.to_string(),
        reason,
    };
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(&path)
        .map_err(|e| blob_err(format!("cannot open {}: {e}", path.display())))?;
    let meta = file
        .metadata()
        .map_err(|e| blob_err(format!("cannot stat {}: {e}", path.display())))?;
    if !meta.is_file() {
        return Err(blob_err(format!(
            "{} is not a regular file",
            path.display()
        )));
    }
    if meta.len() != size {
        return Err(blob_err(format!(
            "size is {} bytes, the descriptor says {size}",
            meta.len()
        )));
    }
    Ok(file)
}

/// Reads the whole blob, checking size and digest.
pub fn verify_blob(dir: &Path, digest: &Sha256, size: u64) -> Result<()> {
    let mut file = open_blob(dir, digest, size)?;
    let mut hashing = HashingReader::new(&mut file);
    io::copy(&mut hashing, &mut io::sink()).map_err(|e| ImageError::Blob {
        digest: digest.to_string(),
        reason: format!("read: {e}"),
    })?;
    hashing.check(digest)
}

/// Reads a small JSON blob after checking its size and digest.
fn read_json_blob(dir: &Path, digest: &Sha256, size: u64) -> Result<Vec<u8>> {
    if size > MAX_JSON_BLOB {
        return Err(ImageError::Blob {
            digest: digest.to_string(),
            reason: format!("{size} bytes is too large for a manifest or config"),
        });
    }
    let file = open_blob(dir, digest, size)?;
    let mut bytes = Vec::with_capacity(size as usize);
    // A file that grows after the size check is read no further than one byte past it (and then fails the digest).
    file.take(size + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| ImageError::Blob {
            digest: digest.to_string(),
            reason: format!("read: {e}"),
        })?;
    let actual = Sha256::of(&bytes);
    if &actual != digest {
        return Err(ImageError::Blob {
            digest: digest.to_string(),
            reason: format!("content has digest {actual} (the blob was modified or is corrupt)"),
        });
    }
    Ok(bytes)
}

/// Reads `oci-layout` or `index.json`: a regular file (no symlink, FIFO or device), at most [`MAX_JSON_BLOB`].
fn read_small_file(path: &Path) -> Result<Vec<u8>> {
    let err = |e: String| ImageError::Layout(format!("{}: {e}", path.display()));
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(path)
        .map_err(|e| err(e.to_string()))?;
    let meta = file.metadata().map_err(|e| err(e.to_string()))?;
    if !meta.is_file() {
        return Err(err("not a regular file".into()));
    }
    if meta.len() > MAX_JSON_BLOB {
        return Err(err(format!("{} bytes is too large", meta.len())));
    }
    let mut bytes = Vec::new();
    file.take(MAX_JSON_BLOB + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| err(e.to_string()))?;
    Ok(bytes)
}

fn descriptor_digest(d: &Descriptor) -> Result<Sha256> {
    let s = d.digest().to_string();
    Sha256::parse(&s).ok_or_else(|| {
        ImageError::Layout(format!(
            "descriptor digest {s:?} is not sha256 (only sha256 blobs are supported)"
        ))
    })
}

/// Reads the JSON blob `desc` describes and parses it with `parse`: its digest and the document, `what` naming the
/// document when it does not parse.
fn read_described<T>(
    dir: &Path,
    desc: &Descriptor,
    what: &str,
    parse: impl FnOnce(io::Cursor<Vec<u8>>) -> std::result::Result<T, OciSpecError>,
) -> Result<(Sha256, T)> {
    let digest = descriptor_digest(desc)?;
    let bytes = read_json_blob(dir, &digest, desc.size())?;
    let parsed = parse(io::Cursor::new(bytes)).map_err(|e| ImageError::Blob {
        digest: digest.to_string(),
        reason: format!("not {what}: {e}"),
    })?;
    Ok((digest, parsed))
}

/// Checks `oci-layout` and finds the manifest's descriptor in `index.json` (through at most one nested index).
fn manifest_descriptor(dir: &Path) -> Result<Descriptor> {
    let header_path = dir.join("oci-layout");
    let header = read_small_file(&header_path)?;
    let header: serde_json::Value = serde_json::from_slice(&header)
        .map_err(|e| ImageError::Layout(format!("{}: {e}", header_path.display())))?;
    if header.get("imageLayoutVersion").and_then(|v| v.as_str()) != Some("1.0.0") {
        return Err(ImageError::Layout(format!(
            "{}: imageLayoutVersion is not 1.0.0",
            header_path.display()
        )));
    }
    let index_path = dir.join("index.json");
    let index = ImageIndex::from_reader(&read_small_file(&index_path)?[..])
        .map_err(|e| ImageError::Layout(format!("{}: {e}", index_path.display())))?;
    let mut manifest_desc = pick_manifest(index.manifests(), "index.json")?;
    if *manifest_desc.media_type() == MediaType::ImageIndex {
        let (digest, nested) = read_described(
            dir,
            &manifest_desc,
            "an image index",
            ImageIndex::from_reader,
        )?;
        manifest_desc = pick_manifest(nested.manifests(), digest.as_str())?;
        if *manifest_desc.media_type() == MediaType::ImageIndex {
            return Err(ImageError::Layout(
                "indexes nested more than one level deep are not supported".into(),
            ));
        }
    }
    Ok(manifest_desc)
}

/// Reads and verifies the layout at `dir`: `oci-layout`, `index.json`, the manifest for linux on this machine's
/// architecture (through at most one nested index), its config; checks every layer's descriptor against the
/// config. Layer blobs themselves are not read here.
pub fn open(dir: &Path) -> Result<Layout> {
    let manifest_desc = manifest_descriptor(dir)?;
    let (manifest_digest, manifest) = read_described(
        dir,
        &manifest_desc,
        "an image manifest",
        ImageManifest::from_reader,
    )?;
    let (config_digest, config) = read_described(
        dir,
        manifest.config(),
        "an image config",
        ImageConfiguration::from_reader,
    )?;
    if config.os().to_string() != "linux" {
        return Err(ImageError::Layout(format!(
            "the image is for {}, not linux",
            config.os()
        )));
    }
    if config.architecture().to_string() != native_arch() {
        return Err(ImageError::Layout(format!(
            "the image is for {}, this machine runs {}",
            config.architecture(),
            native_arch()
        )));
    }
    let diff_ids = config.rootfs().diff_ids();
    if diff_ids.len() != manifest.layers().len() {
        return Err(ImageError::Layout(format!(
            "the manifest has {} layers, the config's rootfs.diff_ids {}",
            manifest.layers().len(),
            diff_ids.len()
        )));
    }
    if manifest.layers().is_empty() {
        return Err(ImageError::Layout("the image has no layers".into()));
    }
    let mut layers = Vec::with_capacity(diff_ids.len());
    for (desc, diff_id) in manifest.layers().iter().zip(diff_ids) {
        let digest = descriptor_digest(desc)?;
        let media_type = desc.media_type().to_string();
        let compression = Compression::from_media_type(&media_type).ok_or_else(|| {
            ImageError::Layout(format!(
                "layer {digest} has media type {media_type}, which is not a tar, tar+gzip or tar+zstd layer"
            ))
        })?;
        let diff_id = Sha256::parse(diff_id).ok_or_else(|| {
            ImageError::Layout(format!("diff_id {diff_id:?} is not a sha256 digest"))
        })?;
        layers.push(LayerRef {
            digest,
            size: desc.size(),
            compression,
            diff_id,
        });
    }
    let run = config
        .config()
        .as_ref()
        .map(|c| RunConfig {
            env: c.env().clone().unwrap_or_default(),
            entrypoint: c.entrypoint().clone().unwrap_or_default(),
            cmd: c.cmd().clone().unwrap_or_default(),
        })
        .unwrap_or_default();
    Ok(Layout {
        dir: dir.to_path_buf(),
        manifest_digest,
        config_digest,
        layers,
        run,
    })
}

/// The manifest (or nested index) for linux on this architecture; a single entry without a platform is taken.
fn pick_manifest(list: &[Descriptor], whose: &str) -> Result<Descriptor> {
    let usable: Vec<&Descriptor> = list
        .iter()
        .filter(|d| {
            matches!(
                d.media_type(),
                MediaType::ImageManifest | MediaType::ImageIndex
            )
        })
        .collect();
    let matching: Vec<&&Descriptor> = usable
        .iter()
        .filter(|d| match d.platform() {
            Some(p) => {
                p.os().to_string() == "linux" && p.architecture().to_string() == native_arch()
            }
            None => true,
        })
        .collect();
    match (usable.len(), matching.first()) {
        (0, _) => Err(ImageError::Layout(format!(
            "{whose} lists no image manifest"
        ))),
        (_, Some(d)) => Ok((**d).clone()),
        (_, None) => Err(ImageError::Layout(format!(
            "{whose} has no manifest for linux/{}",
            native_arch()
        ))),
    }
}

/// Hashes what passes through; [`HashingReader::check`] compares with the expected digest.
pub struct HashingReader<R> {
    inner: R,
    hasher: sha2::Sha256,
}

impl<R: Read> HashingReader<R> {
    /// Wraps `inner`.
    pub fn new(inner: R) -> Self {
        Self {
            inner,
            hasher: <sha2::Sha256 as sha2::Digest>::new(),
        }
    }

    /// The digest of everything read so far.
    pub fn digest(self) -> Sha256 {
        Sha256::from_hasher(self.hasher)
    }

    /// Fails with a blob error naming `expected` unless everything read so far has that digest.
    pub fn check(self, expected: &Sha256) -> Result<()> {
        let actual = self.digest();
        if &actual == expected {
            Ok(())
        } else {
            Err(ImageError::Blob {
                digest: expected.to_string(),
                reason: format!(
                    "content has digest {actual} (the blob was modified or is corrupt)"
                ),
            })
        }
    }
}

impl<R: Read> Read for HashingReader<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        sha2::Digest::update(&mut self.hasher, &buf[..n]);
        Ok(n)
    }
}

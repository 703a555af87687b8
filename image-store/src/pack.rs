//! Writing an OCI image layout from root filesystem tars, one layer per tar. Deterministic: the same tars and
//! options give the same blobs and the same manifest digest (gzip headers carry no time, `created` comes from
//! `SOURCE_DATE_EPOCH`).

use std::fs;
use std::io::{self, BufReader, Write};
use std::path::{Path, PathBuf};

use super::layout::{native_arch, HashingReader};
use super::{Compression, ImageError, Result, Sha256};

/// What goes into the config besides the layers.
#[derive(Debug, Clone)]
pub struct PackOptions {
    /// How every layer is compressed.
    pub compression: Compression,
    /// `Env`.
    pub env: Vec<String>,
    /// `Cmd`.
    pub cmd: Vec<String>,
    /// `created`, seconds since the epoch (`SOURCE_DATE_EPOCH`); none leaves the field out.
    pub created: Option<i64>,
}

impl Default for PackOptions {
    fn default() -> Self {
        Self {
            compression: Compression::Gzip,
            env: vec!["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin".into()],
            cmd: Vec::new(),
            created: None,
        }
    }
}

/// Writes a layout at `out` (created if needed) with the tars in `layers` (bottom first) as layers. Returns the
/// manifest digest.
pub fn pack(out: &Path, layers: &[PathBuf], opts: &PackOptions) -> Result<Sha256> {
    let blobs = out.join("blobs/sha256");
    fs::create_dir_all(&blobs).map_err(|e| ImageError::io(&blobs, e))?;
    let mut descs = Vec::new();
    let mut diff_ids = Vec::new();
    for tar in layers {
        let (digest, size, diff_id) = write_layer(&blobs, tar, opts.compression)?;
        descs.push(serde_json::json!({
            "mediaType": opts.compression.media_type(),
            "digest": digest.as_str(),
            "size": size,
        }));
        diff_ids.push(diff_id.to_string());
    }
    let mut config = serde_json::json!({
        "architecture": native_arch(),
        "os": "linux",
        "config": { "Env": opts.env, "Cmd": opts.cmd },
        "rootfs": { "type": "layers", "diff_ids": diff_ids },
    });
    if let Some(t) = opts.created {
        let ts = time::OffsetDateTime::from_unix_timestamp(t)
            .ok()
            .and_then(|d| {
                d.format(&time::format_description::well_known::Rfc3339)
                    .ok()
            })
            .ok_or_else(|| ImageError::Layout(format!("SOURCE_DATE_EPOCH {t} is out of range")))?;
        config["created"] = ts.into();
    }
    let (config_digest, config_size) = write_json_blob(&blobs, &config)?;
    let manifest = serde_json::json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {
            "mediaType": "application/vnd.oci.image.config.v1+json",
            "digest": config_digest.as_str(),
            "size": config_size,
        },
        "layers": descs,
    });
    let (manifest_digest, manifest_size) = write_json_blob(&blobs, &manifest)?;
    let index = serde_json::json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": [{
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "digest": manifest_digest.as_str(),
            "size": manifest_size,
            "platform": { "architecture": native_arch(), "os": "linux" },
        }],
    });
    write_file(&out.join("index.json"), &to_json(&index)?)?;
    write_file(
        &out.join("oci-layout"),
        br#"{"imageLayoutVersion":"1.0.0"}"#,
    )?;
    Ok(manifest_digest)
}

fn to_json(v: &serde_json::Value) -> Result<Vec<u8>> {
    serde_json::to_vec(v).map_err(|e| ImageError::Layout(format!("cannot encode JSON: {e}")))
}

fn write_file(path: &Path, bytes: &[u8]) -> Result<()> {
    fs::write(path, bytes).map_err(|e| ImageError::io(path, e))
}

fn write_json_blob(blobs: &Path, v: &serde_json::Value) -> Result<(Sha256, u64)> {
    let bytes = to_json(v)?;
    let digest = Sha256::of(&bytes);
    write_file(&blobs.join(digest.hex()), &bytes)?;
    Ok((digest, bytes.len() as u64))
}

/// Counts and hashes what is written through it.
struct HashingWriter<W> {
    inner: W,
    hasher: sha2::Sha256,
    written: u64,
}

impl<W: Write> Write for HashingWriter<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.inner.write(buf)?;
        sha2::Digest::update(&mut self.hasher, &buf[..n]);
        self.written += n as u64;
        Ok(n)
    }
    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

/// Compresses `tar` into a blob; returns (blob digest, blob size, diff_id).
fn write_layer(
    blobs: &Path,
    tar: &Path,
    compression: Compression,
) -> Result<(Sha256, u64, Sha256)> {
    let tmp = blobs.join(format!(".layer.{}.tmp", std::process::id()));
    let input = fs::File::open(tar).map_err(|e| ImageError::io(tar, e))?;
    let mut reader = HashingReader::new(BufReader::with_capacity(1 << 20, input));
    let file = fs::File::create(&tmp).map_err(|e| ImageError::io(&tmp, e))?;
    let mut w = HashingWriter {
        inner: io::BufWriter::with_capacity(1 << 20, file),
        hasher: <sha2::Sha256 as sha2::Digest>::new(),
        written: 0,
    };
    let io_err = |e: io::Error| ImageError::io(tar, e);
    match compression {
        Compression::None => {
            io::copy(&mut reader, &mut w).map_err(io_err)?;
        }
        Compression::Gzip => {
            // GzBuilder with no mtime and no file name: the header is the same every time.
            let mut enc = flate2::GzBuilder::new().write(&mut w, flate2::Compression::default());
            io::copy(&mut reader, &mut enc).map_err(io_err)?;
            enc.finish().map_err(io_err)?;
        }
        Compression::Zstd => {
            let mut enc = zstd::stream::write::Encoder::new(&mut w, 12).map_err(io_err)?;
            enc.include_checksum(true).map_err(io_err)?;
            io::copy(&mut reader, &mut enc).map_err(io_err)?;
            enc.finish().map_err(io_err)?;
        }
    }
    // Anything the copy left unread (none) would not be in diff_id either; read to the end to be sure.
    io::copy(&mut reader, &mut io::sink()).map_err(io_err)?;
    w.flush().map_err(|e| ImageError::io(&tmp, e))?;
    let size = w.written;
    let digest = Sha256::from_hasher(w.hasher);
    let diff_id = reader.digest();
    let dest = blobs.join(digest.hex());
    fs::rename(&tmp, &dest).map_err(|e| ImageError::io(&dest, e))?;
    Ok((digest, size, diff_id))
}

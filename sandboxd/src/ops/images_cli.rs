//! `sandboxd images …`: import, list and remove stored images, and pack a root filesystem tar into an OCI layout.

use std::path::PathBuf;

use anyhow::Context;
use image_store::pack::PackOptions;
use image_store::{Compression, ImageStore};

use crate::config::Config;

/// The `images` subcommands.
#[derive(clap::Subcommand, Debug)]
pub enum ImagesCommand {
    /// Verify an OCI image layout (every blob's size and sha256), unpack its layers and record it as NAME.
    Import {
        /// The layout directory (holding `oci-layout`, `index.json`, `blobs/`).
        dir: PathBuf,
        /// Name for `images.<name>` and `languages.<lang>.image`.
        #[arg(long)]
        name: String,
    },
    /// List stored images.
    List,
    /// Forget an image and remove the layers no other image uses (refused while a daemon uses the store).
    Rm {
        /// The image's name.
        name: String,
    },
    /// Write an OCI image layout with one layer per root filesystem tar (bottom first).
    Pack {
        /// Root filesystem tar; repeat for more layers.
        #[arg(long, required = true)]
        rootfs: Vec<PathBuf>,
        /// Output layout directory.
        #[arg(long)]
        out: PathBuf,
        /// Layer compression.
        #[arg(long, value_enum, default_value = "zstd")]
        compression: CompressionArg,
        /// The config's `Cmd` (repeat for arguments).
        #[arg(long)]
        cmd: Vec<String>,
        /// An `Env` entry, KEY=VALUE (repeatable; default PATH only).
        #[arg(long)]
        env: Vec<String>,
    },
}

/// `--compression`.
#[derive(Clone, Copy, Debug, clap::ValueEnum)]
pub enum CompressionArg {
    /// Plain tar.
    None,
    /// gzip.
    Gzip,
    /// zstd.
    Zstd,
}

/// Runs one subcommand.
pub fn run(config: &Config, command: &ImagesCommand) -> anyhow::Result<()> {
    let store = || ImageStore::open(&config.state_dir.join("images/oci"));
    match command {
        ImagesCommand::Import { dir, name } => {
            let r = store()?
                .import(dir, name)
                .with_context(|| format!("image {} refused", dir.display()))?;
            println!(
                "imported {name} {} ({} layers: {} unpacked, {} cached; {:.1} MB unpacked; verify {} ms, unpack {} ms)",
                r.image.manifest_digest,
                r.image.layers.len(),
                r.layers_unpacked,
                r.layers_cached,
                r.image.unpacked_bytes as f64 / 1e6,
                r.verify.as_millis(),
                r.unpack.as_millis()
            );
            if r.stats.setid_dropped > 0 {
                println!(
                    "note: dropped the setuid/setgid bit of {} files",
                    r.stats.setid_dropped
                );
            }
        }
        ImagesCommand::List => {
            for i in store()?.list()? {
                println!(
                    "{}\t{}\t{} layers\t{:.1} MB",
                    i.name,
                    i.manifest_digest,
                    i.layers.len(),
                    i.unpacked_bytes as f64 / 1e6
                );
            }
        }
        ImagesCommand::Rm { name } => {
            let removed = store()?.remove(name)?;
            println!("removed {name} ({removed} layers no longer used)");
        }
        ImagesCommand::Pack {
            rootfs,
            out,
            compression,
            cmd,
            env,
        } => {
            let mut opts = PackOptions {
                compression: match compression {
                    CompressionArg::None => Compression::None,
                    CompressionArg::Gzip => Compression::Gzip,
                    CompressionArg::Zstd => Compression::Zstd,
                },
                cmd: cmd.clone(),
                created: match std::env::var("SOURCE_DATE_EPOCH") {
                    Ok(v) => Some(v.trim().parse().context("SOURCE_DATE_EPOCH")?),
                    Err(_) => None,
                },
                ..PackOptions::default()
            };
            if !env.is_empty() {
                opts.env = env.clone();
            }
            let digest = image_store::pack::pack(out, rootfs, &opts)?;
            println!("{} {digest}", out.display());
        }
    }
    Ok(())
}

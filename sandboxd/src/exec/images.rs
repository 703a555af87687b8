//! Which image and interpreter each language runs on, resolved once at start-up from `images:` and `languages:`.
//!
//! The embedded `host` image needs no setup; OCI images come from the store (`sandboxd images import`) or are
//! imported at start from `images.<name>.layout`. Every configured interpreter is checked inside its image before
//! the daemon serves: a language whose image cannot run it stops the start (fail closed), so `pong`'s
//! `capabilities.languages` lists exactly what works.

use std::collections::BTreeMap;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{bail, Context};
use image_store::{ImageError, ImageStore, Sha256, StoredImage};
use protocol::Language;
use runtime::landlock::Policy;
use runtime::rootfs::{HostImage, RootSource, Scratch};
use tracing::info;

use crate::config::Config;
use containers::image::{LanguageRuntime, RootImage, RootKind};

/// The code file's name per language.
pub fn file_name(lang: Language) -> &'static str {
    match lang {
        Language::Python => "main.py",
        Language::Javascript => "main.js",
        Language::Shell => "main.sh",
        Language::Elixir => "main.exs",
    }
}

/// The languages the daemon offers, each with its image and interpreter.
pub type Languages = BTreeMap<Language, LanguageRuntime>;

/// Resolves every language. `run_dir` (the daemon's private tmpfs) is where OCI images are probed.
pub fn resolve(
    config: &Config,
    host: HostImage,
    landlock_abi: i32,
    run_dir: &Path,
) -> anyhow::Result<(Languages, Option<image_store::store::StoreLock>)> {
    let host_image = host_root_image(host, landlock_abi);
    match &config.languages {
        // No `languages:`: what the host image can run.
        None => Ok((host_languages(&host_image)?, None)),
        Some(languages) => {
            configured_languages(config, languages, &host_image, landlock_abi, run_dir)
        }
    }
}

/// The host image: its read-only bind mounts, the code directory and `/proc` are what landlock lets a program read.
fn host_root_image(host: HostImage, landlock_abi: i32) -> Arc<RootImage> {
    let mut read_only: Vec<PathBuf> = host
        .binds
        .iter()
        .filter(|b| b.readonly)
        .map(|b| b.destination.clone())
        .collect();
    read_only.push(runtime::rootfs::CODE_DIR.into());
    read_only.push("/proc".into());
    Arc::new(RootImage {
        name: "host".into(),
        digest: host_digest(),
        kind: RootKind::Host(host),
        landlock: Policy::for_execution(landlock_abi, read_only),
        env: Vec::new(),
        preload: Vec::new(),
    })
}

fn host_of(image: &RootImage) -> &HostImage {
    match &image.kind {
        RootKind::Host(host) => host,
        RootKind::Oci { .. } => unreachable!("built by host_root_image"),
    }
}

/// Every language whose interpreter the host image holds.
fn host_languages(host_image: &Arc<RootImage>) -> anyhow::Result<Languages> {
    let table: [(Language, &[&str]); 4] = [
        (Language::Python, &["/usr/bin/python3"]),
        (Language::Javascript, &["node", "nodejs"]),
        (Language::Shell, &["/bin/sh"]),
        (Language::Elixir, &["elixir"]),
    ];
    let mut out = BTreeMap::new();
    for (lang, candidates) in table {
        match host_of(host_image).find_program(candidates) {
            Some(program) => {
                info!(language = lang.as_str(), program, "language available");
                out.insert(
                    lang,
                    LanguageRuntime {
                        image: host_image.clone(),
                        command: vec![program],
                        file_name: file_name(lang),
                        warm: None,
                    },
                );
            }
            None => info!(
                language = lang.as_str(),
                "language not available in the host image"
            ),
        }
    }
    if out.is_empty() {
        bail!("the host image can run no language (no /usr/bin/python3, node, /bin/sh)");
    }
    Ok(out)
}

/// The configured languages. Each OCI image is opened once, with one probe mount that also checks every
/// interpreter configured on it; the store stays locked (shared) while the daemon runs.
fn configured_languages(
    config: &Config,
    languages: &BTreeMap<Language, crate::config::LanguageConfig>,
    host_image: &Arc<RootImage>,
    landlock_abi: i32,
    run_dir: &Path,
) -> anyhow::Result<(Languages, Option<image_store::store::StoreLock>)> {
    let mut on_image: BTreeMap<&str, Vec<(Language, &str)>> = BTreeMap::new();
    for (lang, l) in languages {
        if l.image != "host" {
            on_image
                .entry(l.image.as_str())
                .or_default()
                .push((*lang, l.command[0].as_str()));
        }
    }
    let mut lock = None;
    let mut oci: BTreeMap<&str, Arc<RootImage>> = BTreeMap::new();
    if !on_image.is_empty() {
        let store = ImageStore::open(&config.state_dir.join("images/oci"))?;
        lock = Some(store.lock_shared()?);
        for (name, programs) in &on_image {
            let img = load(&store, config, name, programs, landlock_abi, run_dir)?;
            oci.insert(name, Arc::new(img));
        }
    }
    let mut out = BTreeMap::new();
    for (lang, l) in languages {
        let program = &l.command[0];
        let image = if l.image == "host" {
            if host_of(host_image).find_program(&[program]).as_deref() != Some(program.as_str()) {
                bail!("languages.{lang}: {program} is not an executable file in the host image");
            }
            host_image.clone()
        } else {
            oci[l.image.as_str()].clone()
        };
        info!(
            language = lang.as_str(),
            image = image.name,
            digest = image.digest,
            command = ?l.command,
            "language available"
        );
        out.insert(
            *lang,
            LanguageRuntime {
                image,
                command: l.command.clone(),
                file_name: file_name(*lang),
                warm: None,
            },
        );
    }
    Ok((out, lock))
}

/// The host image's identity: it is not content-addressed, so the best handle is the distribution release.
fn host_digest() -> String {
    let release = std::fs::read("/etc/os-release").unwrap_or_default();
    format!("host:{}", Sha256::of(&release))
}

/// Finds (importing when configured) the image `name`, checks that it can run `programs` and works out its
/// landlock policy.
fn load(
    store: &ImageStore,
    config: &Config,
    name: &str,
    programs: &[(Language, &str)],
    landlock_abi: i32,
    run_dir: &Path,
) -> anyhow::Result<RootImage> {
    let cfg = config.images.get(name).cloned().unwrap_or_default();
    let stored: StoredImage = match &cfg.layout {
        Some(dir) => {
            let wanted = image_store::layout::open(dir)
                .with_context(|| format!("images.{name}.layout {}", dir.display()))?;
            // A pinned image that does not match is refused before anything of it is unpacked.
            if let Some(pin) = &cfg.digest {
                if wanted.manifest_digest.as_str() != pin {
                    bail!(
                        "images.{name}.digest pins {pin}, the layout {} holds {}",
                        dir.display(),
                        wanted.manifest_digest
                    );
                }
            }
            match store.get(name) {
                Ok(s) if s.manifest_digest == wanted.manifest_digest => s,
                // Not there, another image of that name, or a layer gone: import from the layout.
                Ok(_) | Err(ImageError::NotFound(_)) | Err(ImageError::Layout(_)) => {
                    let r = store
                        .import(dir, name)
                        .with_context(|| format!("images.{name}: import of {}", dir.display()))?;
                    info!(
                        image = name,
                        digest = %r.image.manifest_digest,
                        verify_ms = r.verify.as_millis() as u64,
                        unpack_ms = r.unpack.as_millis() as u64,
                        "image imported"
                    );
                    r.image
                }
                Err(e) => return Err(e).with_context(|| format!("images.{name}")),
            }
        }
        None => store.get(name).with_context(|| format!("images.{name}"))?,
    };
    if let Some(pin) = &cfg.digest {
        if stored.manifest_digest.as_str() != pin {
            bail!(
                "images.{name}.digest pins {pin}, the store holds {}",
                stored.manifest_digest
            );
        }
    }
    let lowers = store.lower_dirs(&stored);
    // The interpreters must run in the image; its own top-level directories become writable (into the
    // execution's overlay upper layer).
    let top_dirs = probe(run_dir, &lowers, |root| {
        for (lang, program) in programs {
            check_program(root, program).map_err(|e| {
                std::io::Error::other(format!("languages.{lang}: image {name}: {program}: {e}"))
            })?;
        }
        let mut dirs = Vec::new();
        for e in std::fs::read_dir(root)?.flatten() {
            let n = e.file_name().to_string_lossy().into_owned();
            let skip = ["proc", "sys", "dev", "sandbox"].contains(&n.as_str());
            if !skip && e.file_type().is_ok_and(|t| t.is_dir()) {
                dirs.push(PathBuf::from("/").join(n));
            }
        }
        Ok(dirs)
    })
    .with_context(|| format!("images.{name}"))?;
    let env = stored
        .run
        .env
        .iter()
        .filter_map(|kv| {
            kv.split_once('=')
                .map(|(k, v)| (k.to_owned(), v.to_owned()))
        })
        .collect();
    Ok(RootImage {
        name: name.to_owned(),
        digest: stored.manifest_digest.to_string(),
        kind: RootKind::Oci { lowers },
        landlock: Policy::for_image(landlock_abi, top_dirs),
        env,
        preload: cfg.preload,
    })
}

/// Mounts the image's overlay root the way an execution gets it and runs `f` on the merged directory.
fn probe<T>(
    run_dir: &Path,
    lowers: &[PathBuf],
    f: impl FnOnce(&Path) -> std::io::Result<T>,
) -> anyhow::Result<T> {
    static SEQ: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let id = format!(
        "probe-{}",
        SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    );
    let mut scratch = Scratch::create(run_dir, &id, 1 << 20, 0, RootSource::Overlay(lowers))
        .context("cannot mount the image's overlay root")?;
    let r = f(&scratch.rootfs());
    scratch.remove()?;
    Ok(r?)
}

/// The program must be an executable regular file inside the image (symlinks resolved within the image's root).
fn check_program(root: &Path, program: &str) -> std::io::Result<()> {
    use nix::fcntl::{OFlag, OpenHow, ResolveFlag};
    let dir = std::fs::File::open(root)?;
    let how = OpenHow::new()
        .flags(OFlag::O_PATH | OFlag::O_CLOEXEC)
        .resolve(ResolveFlag::RESOLVE_IN_ROOT | ResolveFlag::RESOLVE_NO_MAGICLINKS);
    let fd = nix::fcntl::openat2(dir.as_raw_fd(), program, how)
        .map_err(|e| std::io::Error::other(format!("not found in the image ({e})")))?;
    // SAFETY: openat2 returned a new descriptor that nothing else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let st = nix::sys::stat::fstat(fd.as_raw_fd()).map_err(std::io::Error::from)?;
    let is_file = st.st_mode & libc::S_IFMT == libc::S_IFREG;
    // Image files belong to a uid the container does not map: only the "other" execute bit counts.
    if !is_file || st.st_mode & 0o001 == 0 {
        return Err(std::io::Error::other(
            "not an executable regular file in the image",
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    /// The store refuses layers whose runtime mount points are not directories; the runtime checks the same names
    /// on the mounted overlay. The two crates do not depend on each other, so the lists are kept equal here.
    #[test]
    fn the_store_guards_the_mount_points_the_runtime_mounts_over() {
        assert_eq!(
            image_store::MOUNT_POINTS,
            runtime::rootfs::IMAGE_MOUNT_POINTS
        );
    }
}

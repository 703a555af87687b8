//! What the overlay root adds to an execution's set-up: `Scratch::create` + `remove` with the shared host root
//! (one tmpfs, the input files, the code) against the same with an overlay root over image layers (plus the
//! overlay mount, its mount-point checks and its unmount), interleaved in one run. Needs root.
//!
//! `cargo bench -p sandboxd-runtime --bench overlay` (set `SANDBOXD_BENCH_LAYERS=dir1:dir2…`, top first, to measure
//! real unpacked layers, e.g. those of `<state_dir>/images/oci/layers/`).
#![allow(clippy::expect_used)]

use std::path::PathBuf;
use std::time::{Duration, Instant};

use runtime::rootfs::{InputFile, RootSource, Scratch};

const ROUNDS: usize = 400;

fn median(v: &mut [Duration]) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn p95(v: &mut [Duration]) -> Duration {
    v.sort();
    v[v.len() * 95 / 100]
}

fn main() {
    if !test_support::require_root("overlay bench", "mounts") {
        return;
    }
    // Our mounts stay in a mount namespace of our own.
    runtime::rootfs::unshare_mount_namespace().expect("private mount namespace");
    let dir = tempfile::tempdir().expect("tempdir");
    let run_dir = dir.path().join("run");
    std::fs::create_dir(&run_dir).expect("run dir");
    let layers: Vec<PathBuf> = match std::env::var("SANDBOXD_BENCH_LAYERS") {
        Ok(v) => v.split(':').map(PathBuf::from).collect(),
        Err(_) => {
            // Three synthetic layers shaped like a small distribution image.
            (0..3)
                .map(|i| {
                    let l = dir.path().join(format!("layer{i}"));
                    for d in [
                        "usr/bin", "usr/lib", "etc", "var/tmp", "proc", "dev", "sys", "tmp",
                    ] {
                        std::fs::create_dir_all(l.join(d)).expect("layer dir");
                    }
                    for f in 0..200 {
                        std::fs::write(l.join(format!("usr/lib/f{i}-{f}")), b"x").expect("file");
                    }
                    l
                })
                .collect()
        }
    };
    let files = [InputFile {
        path: "data/in.txt".into(),
        content: vec![b'x'; 4096],
    }];
    let mut shared = Vec::with_capacity(ROUNDS);
    let mut overlay = Vec::with_capacity(ROUNDS);
    for i in 0..ROUNDS {
        for (root, out) in [
            (RootSource::Shared, &mut shared),
            (RootSource::Overlay(&layers), &mut overlay),
        ] {
            let t = Instant::now();
            let mut s = Scratch::create(
                &run_dir,
                &format!("b{i}-{}", out.len()),
                64 << 20,
                1_000_000,
                root,
            )
            .expect("scratch");
            s.inputs()
                .write("main.py", b"print(1)\n", &files)
                .expect("inputs");
            s.remove().expect("remove");
            out.push(t.elapsed());
        }
    }
    let (ms, mo) = (median(&mut shared), median(&mut overlay));
    println!(
        "scratch set-up + teardown, {ROUNDS} rounds interleaved, {} lower layers",
        layers.len()
    );
    println!(
        "  shared root : median {:>7.1} us  p95 {:>7.1} us",
        ms.as_secs_f64() * 1e6,
        p95(&mut shared).as_secs_f64() * 1e6
    );
    println!(
        "  overlay root: median {:>7.1} us  p95 {:>7.1} us",
        mo.as_secs_f64() * 1e6,
        p95(&mut overlay).as_secs_f64() * 1e6
    );
    println!(
        "  overlay adds: {:.1} us per execution (median difference), ratio {:.2}",
        (mo.as_secs_f64() - ms.as_secs_f64()) * 1e6,
        mo.as_secs_f64() / ms.as_secs_f64()
    );
}

//! What the client's benches share: their runtime and their percentiles.

use std::future::Future;

/// The `p`th percentile of sorted samples.
pub fn percentile<T: Copy>(sorted: &[T], p: usize) -> T {
    sorted[(sorted.len() * p / 100).min(sorted.len() - 1)]
}

/// Runs `bench` on a two-worker runtime (the machine the figures come from has two cores).
pub fn block_on(bench: impl Future<Output = ()>) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(bench);
}

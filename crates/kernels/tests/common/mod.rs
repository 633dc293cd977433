//! Helpers the GPU test files share: which GPUs to use (or why the test is skipped), the seed,
//! and running a closure on every rank's thread.

use std::time::SystemTime;

use epflow_kernels::{GpuRank, device_count};

/// The first `need` GPUs, or `None` after printing why `test` is skipped.
pub(crate) fn gpus(need: usize, test: &str) -> Option<Vec<usize>> {
    let n = device_count();
    if n < need {
        eprintln!("SKIPPED {test}: needs {need} GPUs, this machine has {n}");
        return None;
    }
    Some((0..need).collect())
}

/// `EPFLOW_TEST_SEED`, else the clock (print it so a failure can be replayed).
pub(crate) fn seed() -> u64 {
    std::env::var("EPFLOW_TEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).map_or(1, |d| d.as_nanos() as u64))
}

/// Runs `f` on every rank, each on its own thread; results in rank order.
pub(crate) fn on_ranks<R: Send>(ranks: &[GpuRank], f: impl Fn(&GpuRank) -> R + Sync) -> Vec<R> {
    std::thread::scope(|s| {
        let hs: Vec<_> = ranks.iter().map(|r| s.spawn(|| f(r))).collect();
        hs.into_iter().map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p))).collect()
    })
}

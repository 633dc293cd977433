//! Frees held back while two ranks of a group share one GPU (one CUDA context).
//!
//! `cuMemFree` and `cuMemFreeHost` wait until the device's running kernels end. When two ranks
//! drive one GPU, a running kernel can be the peer's receive, spinning for a send this rank has
//! not launched yet: a free between this rank's operations then stalls both ranks until the
//! operation times out (issue 70, `benches/STATUS.md`, "Two ranks on one GPU"). So while a
//! context is shared, freed buffers are parked here instead, reused by later allocations of the
//! same size (a steady loop of operations allocates the same sizes again), and freed when the
//! context's last sharing rank is dropped, when no operation of the group can be running.
//!
//! Parked memory is bounded by [`MAX_PARKED_BYTES`] per context: past it a buffer is freed at
//! once, as without sharing (rare: a loop whose sizes never repeat).
//!
//! A parked buffer is reused without the device-wide wait `cuMemFree` does: its owner must have
//! dropped it only once no queued kernel reads it any more (epflow's own buffers are given back
//! after their operations' events; a caller's tensor after the streams that read it passed it,
//! as `docs/running-on-gpus.md` says).

use std::collections::HashMap;
use std::sync::{Arc, LazyLock, Mutex, MutexGuard};

use std::ffi::c_void;

use cudarc::driver::{CudaContext, sys};

use super::context::bind;

/// Bytes of freed memory a shared context keeps at most before freeing again.
pub(crate) const MAX_PARKED_BYTES: usize = 2 << 30;

/// One freed allocation: device memory, or mapped pinned host memory (its host address and
/// its device mapping).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Parked {
    /// A `cuMemAlloc` allocation.
    Device { ptr: u64, bytes: usize },
    /// A `cuMemHostAlloc` allocation.
    Host { host: usize, device: u64, bytes: usize },
}

impl Parked {
    fn bytes(&self) -> usize {
        match *self {
            Parked::Device { bytes, .. } | Parked::Host { bytes, .. } => bytes,
        }
    }
}

/// A context's sharing ranks and its parked allocations.
#[derive(Debug, Default)]
struct Shared {
    ranks: usize,
    parked: Vec<Parked>,
    parked_bytes: usize,
}

/// Shared contexts by their `CUcontext` address.
fn contexts() -> MutexGuard<'static, HashMap<usize, Shared>> {
    static CONTEXTS: LazyLock<Mutex<HashMap<usize, Shared>>> = LazyLock::new(Mutex::default);
    CONTEXTS.lock().unwrap_or_else(|e| e.into_inner())
}

fn key(ctx: &CudaContext) -> usize {
    ctx.cu_ctx() as usize
}

/// Held by each rank that shares its GPU with another rank of its group (`RankShared`'s last
/// field, so dropped after the rank's own memory): while one lives, frees in its context are
/// parked. The last one to go frees what was parked.
#[derive(Debug)]
pub(crate) struct SharedContext {
    ctx: Arc<CudaContext>,
}

impl SharedContext {
    /// Registers one more rank sharing `ctx`'s device.
    pub(crate) fn join(ctx: &Arc<CudaContext>) -> Self {
        contexts().entry(key(ctx)).or_default().ranks += 1;
        SharedContext { ctx: Arc::clone(ctx) }
    }
}

impl Drop for SharedContext {
    fn drop(&mut self) {
        let k = key(&self.ctx);
        let parked = {
            let mut all = contexts();
            let Some(s) = all.get_mut(&k) else { return };
            s.ranks -= 1;
            if s.ranks > 0 {
                return;
            }
            all.remove(&k).map(|s| s.parked).unwrap_or_default()
        };
        // Outside the lock: frees of other contexts go on meanwhile.
        free_parked(&self.ctx, &parked);
    }
}

/// Frees allocations of `ctx` now (`cuMemFree` / `cuMemFreeHost`: each waits for the device's
/// running kernels). Each must be unused by the device and freed once: dropped buffers, whose
/// owners synchronize the device before dropping what kernels may still use, or parked ones.
pub(super) fn free_parked(ctx: &CudaContext, all: &[Parked]) {
    if all.is_empty() || bind(ctx).is_err() {
        return;
    }
    for a in all {
        match *a {
            // SAFETY: an allocation of `cuMemAlloc` in this context, freed once (its buffer
            // was dropped, or it leaves the parked list here).
            Parked::Device { ptr, .. } => drop(unsafe { sys::cuMemFree_v2(ptr) }),
            // SAFETY: an allocation of `cuMemHostAlloc` in this context, freed once (as above).
            Parked::Host { host, .. } => drop(unsafe { sys::cuMemFreeHost(host as *mut c_void) }),
        }
    }
}

/// Parks `a` if `ctx` is shared and the bound allows; false: the caller frees it now.
pub(crate) fn park(ctx: &CudaContext, a: Parked) -> bool {
    park_in(&mut contexts(), key(ctx), a)
}

/// A parked allocation of `ctx` of exactly `bytes`, of the kind `host` says, taken for reuse.
pub(crate) fn reuse(ctx: &CudaContext, bytes: usize, host: bool) -> Option<Parked> {
    reuse_in(&mut contexts(), key(ctx), bytes, host)
}

fn park_in(all: &mut HashMap<usize, Shared>, k: usize, a: Parked) -> bool {
    match all.get_mut(&k) {
        Some(s) if s.ranks > 0 && s.parked_bytes + a.bytes() <= MAX_PARKED_BYTES => {
            s.parked_bytes += a.bytes();
            s.parked.push(a);
            true
        }
        _ => false,
    }
}

fn reuse_in(all: &mut HashMap<usize, Shared>, k: usize, bytes: usize, host: bool) -> Option<Parked> {
    let s = all.get_mut(&k)?;
    let i = s.parked.iter().position(|p| p.bytes() == bytes && matches!(p, Parked::Host { .. }) == host)?;
    let p = s.parked.swap_remove(i);
    s.parked_bytes -= bytes;
    Some(p)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_shared_contexts_park_and_reuse_is_by_exact_size_and_kind() {
        let mut all = HashMap::new();
        let dev = |ptr, bytes| Parked::Device { ptr, bytes };
        assert!(!park_in(&mut all, 1, dev(0x1000, 64)), "an unshared context frees at once");
        all.insert(1, Shared { ranks: 2, ..Shared::default() });
        assert!(park_in(&mut all, 1, dev(0x1000, 64)));
        assert!(park_in(&mut all, 1, Parked::Host { host: 0x2000, device: 0x3000, bytes: 64 }));
        assert!(!park_in(&mut all, 2, dev(0x4000, 64)), "another context is not shared");
        assert_eq!(reuse_in(&mut all, 1, 128, false), None);
        assert_eq!(reuse_in(&mut all, 1, 64, false), Some(dev(0x1000, 64)));
        assert_eq!(reuse_in(&mut all, 1, 64, false), None, "taken once");
        assert_eq!(reuse_in(&mut all, 1, 64, true), Some(Parked::Host { host: 0x2000, device: 0x3000, bytes: 64 }));
        assert_eq!(all[&1].parked_bytes, 0);
        assert!(park_in(&mut all, 1, dev(0x5000, MAX_PARKED_BYTES)));
        assert!(!park_in(&mut all, 1, dev(0x6000, 1)), "over the bound: freed at once");
    }
}

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
//!
//! Memory from a rank's [`LocalAllocator`] is parked alike ([`Parked::Local`]): its free may be
//! `cudaFree`, which waits as `cuMemFree` does. It is reused only for an allocation of the same
//! size from the same allocator, and given back to that allocator (never to `cuMemFree`).

use std::collections::HashMap;
use std::sync::{Arc, LazyLock, Mutex, MutexGuard};

use std::ffi::c_void;

use cudarc::driver::{CudaContext, sys};

use super::context::bind;
use super::local::{self, LocalAllocator};

/// Bytes of freed memory a shared context keeps at most before freeing again.
pub(crate) const MAX_PARKED_BYTES: usize = 2 << 30;

/// One freed allocation: device memory, mapped pinned host memory (its host address and its
/// device mapping), or device memory of a caller's allocator.
#[derive(Clone, Debug)]
pub(crate) enum Parked {
    /// A `cuMemAlloc` allocation.
    Device { ptr: u64, bytes: usize },
    /// A `cuMemHostAlloc` allocation.
    Host { host: usize, device: u64, bytes: usize },
    /// An allocation of `allocator`, given back to it.
    Local { ptr: u64, bytes: usize, allocator: Arc<dyn LocalAllocator> },
}

/// The kind of allocation [`reuse`] looks for.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Want<'a> {
    /// [`Parked::Device`].
    Device,
    /// [`Parked::Host`].
    Host,
    /// [`Parked::Local`] of this very allocator.
    Local(&'a Arc<dyn LocalAllocator>),
}

impl Parked {
    fn bytes(&self) -> usize {
        match *self {
            Parked::Device { bytes, .. } | Parked::Host { bytes, .. } | Parked::Local { bytes, .. } => bytes,
        }
    }

    /// The device address (of the mapping, for host memory).
    pub(crate) fn device_ptr(&self) -> u64 {
        match *self {
            Parked::Device { ptr, .. } | Parked::Local { ptr, .. } => ptr,
            Parked::Host { device, .. } => device,
        }
    }

    /// Whether this is an allocation of the kind `want` names.
    fn is(&self, want: Want<'_>) -> bool {
        match (self, want) {
            (Parked::Device { .. }, Want::Device) | (Parked::Host { .. }, Want::Host) => true,
            (Parked::Local { allocator, .. }, Want::Local(a)) => same_allocator(allocator, a),
            _ => false,
        }
    }
}

/// Whether `a` and `b` are one allocator (the same object; vtables are not compared).
fn same_allocator(a: &Arc<dyn LocalAllocator>, b: &Arc<dyn LocalAllocator>) -> bool {
    std::ptr::addr_eq(Arc::as_ptr(a), Arc::as_ptr(b))
}

impl PartialEq for Parked {
    fn eq(&self, other: &Self) -> bool {
        match (self, other) {
            (Parked::Device { ptr: a, bytes: x }, Parked::Device { ptr: b, bytes: y }) => (a, x) == (b, y),
            (Parked::Host { host: a, device: c, bytes: x }, Parked::Host { host: b, device: d, bytes: y }) => {
                (a, c, x) == (b, d, y)
            }
            (Parked::Local { ptr: a, bytes: x, allocator: p }, Parked::Local { ptr: b, bytes: y, allocator: q }) => {
                (a, x) == (b, y) && same_allocator(p, q)
            }
            _ => false,
        }
    }
}

impl Eq for Parked {}

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
/// running kernels; [`Parked::Local`]: its allocator's free). Each must be unused by the device
/// and freed once: dropped buffers, whose owners synchronize the device before dropping what
/// kernels may still use, or parked ones.
pub(super) fn free_parked(ctx: &CudaContext, all: &[Parked]) {
    if !all.is_empty() {
        free_each(bind(ctx).is_ok(), all);
    }
}

/// [`free_parked`]'s frees, `bound`: whether the allocations' context is bound to this thread
/// (if not, only [`Parked::Local`] ones are given back; the others stay allocated).
fn free_each(bound: bool, all: &[Parked]) {
    for a in all {
        match a {
            // SAFETY: an allocation of `cuMemAlloc` in this context (bound), freed once (its
            // buffer was dropped, or it leaves the parked list here).
            Parked::Device { ptr, .. } if bound => drop(unsafe { sys::cuMemFree_v2(*ptr) }),
            // SAFETY: an allocation of `cuMemHostAlloc` in this context (bound), freed once (as
            // above).
            Parked::Host { host, .. } if bound => drop(unsafe { sys::cuMemFreeHost(*host as *mut c_void) }),
            // Given back even if the context could not be bound: the allocator's memory is its
            // own to account for.
            Parked::Local { ptr, allocator, .. } => local::release(allocator, *ptr),
            Parked::Device { .. } | Parked::Host { .. } => {}
        }
    }
}

/// Parks `a` if `ctx` is shared and the bound allows; else hands it back: the caller frees it
/// now.
pub(crate) fn park(ctx: &CudaContext, a: Parked) -> Result<(), Parked> {
    park_in(&mut contexts(), key(ctx), a)
}

/// A parked allocation of `ctx` of exactly `bytes`, of the kind `want` says, taken for reuse.
pub(crate) fn reuse(ctx: &CudaContext, bytes: usize, want: Want<'_>) -> Option<Parked> {
    reuse_in(&mut contexts(), key(ctx), bytes, want)
}

fn park_in(all: &mut HashMap<usize, Shared>, k: usize, a: Parked) -> Result<(), Parked> {
    match all.get_mut(&k) {
        Some(s) if s.ranks > 0 && s.parked_bytes + a.bytes() <= MAX_PARKED_BYTES => {
            s.parked_bytes += a.bytes();
            s.parked.push(a);
            Ok(())
        }
        _ => Err(a),
    }
}

fn reuse_in(all: &mut HashMap<usize, Shared>, k: usize, bytes: usize, want: Want<'_>) -> Option<Parked> {
    let s = all.get_mut(&k)?;
    let i = s.parked.iter().position(|p| p.bytes() == bytes && p.is(want))?;
    let p = s.parked.swap_remove(i);
    s.parked_bytes -= bytes;
    Some(p)
}

#[cfg(test)]
mod tests {
    use super::super::local::tests::Fake;
    use super::*;

    #[test]
    fn only_shared_contexts_park_and_reuse_is_by_exact_size_and_kind() {
        let mut all = HashMap::new();
        let dev = |ptr, bytes| Parked::Device { ptr, bytes };
        assert_eq!(park_in(&mut all, 1, dev(0x1000, 64)), Err(dev(0x1000, 64)), "an unshared context frees at once");
        all.insert(1, Shared { ranks: 2, ..Shared::default() });
        assert_eq!(park_in(&mut all, 1, dev(0x1000, 64)), Ok(()));
        assert_eq!(park_in(&mut all, 1, Parked::Host { host: 0x2000, device: 0x3000, bytes: 64 }), Ok(()));
        assert!(park_in(&mut all, 2, dev(0x4000, 64)).is_err(), "another context is not shared");
        assert_eq!(reuse_in(&mut all, 1, 128, Want::Device), None);
        assert_eq!(reuse_in(&mut all, 1, 64, Want::Device), Some(dev(0x1000, 64)));
        assert_eq!(reuse_in(&mut all, 1, 64, Want::Device), None, "taken once");
        assert_eq!(
            reuse_in(&mut all, 1, 64, Want::Host),
            Some(Parked::Host { host: 0x2000, device: 0x3000, bytes: 64 })
        );
        assert_eq!(all[&1].parked_bytes, 0);
        assert_eq!(park_in(&mut all, 1, dev(0x5000, MAX_PARKED_BYTES)), Ok(()));
        assert_eq!(park_in(&mut all, 1, dev(0x6000, 1)), Err(dev(0x6000, 1)), "over the bound: freed at once");
    }

    #[test]
    fn local_allocations_park_apart_and_go_back_to_their_own_allocator() {
        let (fa, fb) = (Fake::starting_at(0x1_0000, 0x100), Fake::starting_at(0x2_0000, 0x100));
        let (a, b): (Arc<dyn LocalAllocator>, Arc<dyn LocalAllocator>) = (fa.clone(), fb.clone());
        let local = |ptr, bytes, allocator: &Arc<dyn LocalAllocator>| Parked::Local {
            ptr,
            bytes,
            allocator: Arc::clone(allocator),
        };
        let mut all = HashMap::new();
        all.insert(1, Shared { ranks: 2, ..Shared::default() });
        assert_eq!(park_in(&mut all, 1, local(0x1_0000, 512, &a)), Ok(()));
        assert_eq!(park_in(&mut all, 1, Parked::Device { ptr: 0x9000, bytes: 512 }), Ok(()));
        assert_eq!(all[&1].parked_bytes, 1024);
        assert_eq!(reuse_in(&mut all, 1, 512, Want::Local(&b)), None, "another allocator's memory is not reused");
        assert_eq!(reuse_in(&mut all, 1, 256, Want::Local(&a)), None, "nor another size");
        let got = reuse_in(&mut all, 1, 512, Want::Local(&a)).expect("reused");
        assert_eq!(got, local(0x1_0000, 512, &a));
        assert_eq!(got.device_ptr(), 0x1_0000);
        assert_ne!(got, local(0x1_0000, 512, &b), "the same address of another allocator is another allocation");
        assert_eq!(reuse_in(&mut all, 1, 512, Want::Device), Some(Parked::Device { ptr: 0x9000, bytes: 512 }));
        assert_eq!(all[&1].parked_bytes, 0);
        // Freed, each goes back to its own allocator (never to cuMemFree: no context is bound
        // here, so a driver free would not even be tried).
        let dev = Parked::Device { ptr: 0x9000, bytes: 64 };
        free_each(false, &[local(0x1_0100, 64, &a), dev, local(0x2_0000, 64, &b), local(0x1_0200, 64, &a)]);
        assert_eq!((fa.freed(), fb.freed()), (vec![0x1_0100, 0x1_0200], vec![0x2_0000]));
    }
}

//! A caller's allocator for a rank's local scratch ([`LocalAllocator`]): device memory only this
//! rank's kernels touch (handle memory, output buffer sets, the NCCL transport's staging, counter
//! words), never memory peers map. Receive regions, exchange regions and signal pages stay
//! `cuMemAlloc`: peers in other processes open them with CUDA IPC, which exports whole
//! `cuMemAlloc` allocations only.
//!
//! The allocator is given when the rank is made (`GpuWorld::join_over_with_allocator`); the
//! NCCL EP C API builds one from a group config's `alloc_fn` / `free_fn`.

use std::sync::Arc;

use epflow_core::Error;

/// The alignment every allocation of a [`LocalAllocator`] must have, in bytes: the kernels' arrays
/// inside a buffer are placed at 256-byte offsets from its start (`cudaMalloc` aligns to 256 or
/// more).
pub const LOCAL_ALIGN: u64 = 256;

/// Where a rank's local scratch comes from instead of `cuMemAlloc` / `cuMemFree`.
///
/// epflow zeroes what [`LocalAllocator::allocate`] returns (`cuMemsetD8`) before using it, and
/// calls [`LocalAllocator::free`] once per allocation when the buffer is dropped: after every
/// kernel that used it has finished (the rule every epflow buffer is dropped under). While
/// another rank of the group shares the GPU in this process, a dropped buffer is parked and
/// reused for an allocation of the same size from the same allocator instead, and given back
/// when the last such rank goes (as `cuMemAlloc` memory is: a free may wait for the device's
/// running kernels, among them a peer's receive waiting for this rank). Both are called with the
/// rank's CUDA context bound to the calling thread, from any thread (a handle's memory may be
/// dropped by one of epflow's threads).
///
/// # Safety
///
/// epflow's kernels read and write what `allocate` returns, so an implementation must return
/// (or fail): the device address of at least `bytes` bytes of device memory that kernels of the
/// rank's CUDA context can read and write, aligned to [`LOCAL_ALIGN`] (checked: a misaligned
/// address is given back and refused; so is 0), and used by nothing else until it is passed to
/// `free`.
pub unsafe trait LocalAllocator: Send + Sync + std::fmt::Debug {
    /// Allocates `bytes` (at least 1) of device memory; returns its device address.
    fn allocate(&self, bytes: usize) -> Result<u64, Error>;

    /// Frees `ptr`, an address `allocate` returned, once. A failure is logged (a drop cannot
    /// return it).
    fn free(&self, ptr: u64) -> Result<(), Error>;
}

/// Allocates `bytes` from `allocator`, checked ([`check_allocation`]): a refused address is given
/// back first.
pub(crate) fn allocate(allocator: &Arc<dyn LocalAllocator>, bytes: usize) -> Result<u64, Error> {
    let ptr = allocator.allocate(bytes)?;
    check_allocation(ptr, bytes).inspect_err(|_| {
        if ptr != 0 {
            release(allocator, ptr);
        }
    })?;
    Ok(ptr)
}

/// Refuses an allocation of `bytes` at `ptr` that epflow cannot use: 0, or not aligned to
/// [`LOCAL_ALIGN`].
pub(crate) fn check_allocation(ptr: u64, bytes: usize) -> Result<(), Error> {
    if ptr == 0 {
        return Err(Error::Backend(format!("the local allocator returned a null address for {bytes} B")));
    }
    if ptr % LOCAL_ALIGN != 0 {
        return Err(Error::Backend(format!(
            "the local allocator returned {ptr:#x} for {bytes} B, not aligned to {LOCAL_ALIGN} bytes"
        )));
    }
    Ok(())
}

/// Gives `ptr` back to `allocator`, logging a failure.
pub(crate) fn release(allocator: &Arc<dyn LocalAllocator>, ptr: u64) {
    if let Err(e) = allocator.free(ptr) {
        tracing::warn!("the local allocator failed to free {ptr:#x}: {e}");
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use std::sync::Mutex;

    use super::*;

    /// An allocator that hands out fake addresses (never touched: no GPU here) and records its
    /// calls.
    #[derive(Debug, Default)]
    pub(crate) struct Fake {
        /// The next address `allocate` returns, and how far it moves on.
        pub(crate) next: Mutex<(u64, u64)>,
        pub(crate) allocated: Mutex<Vec<(u64, usize)>>,
        pub(crate) freed: Mutex<Vec<u64>>,
    }

    impl Fake {
        pub(crate) fn starting_at(ptr: u64, step: u64) -> Arc<Self> {
            Arc::new(Fake { next: Mutex::new((ptr, step)), ..Fake::default() })
        }

        pub(crate) fn freed(&self) -> Vec<u64> {
            self.freed.lock().unwrap().clone()
        }
    }

    // SAFETY: test only: its addresses reach no kernel (the tests make no CUDA call).
    unsafe impl LocalAllocator for Fake {
        fn allocate(&self, bytes: usize) -> Result<u64, Error> {
            let mut next = self.next.lock().unwrap();
            let ptr = next.0;
            next.0 += next.1;
            self.allocated.lock().unwrap().push((ptr, bytes));
            Ok(ptr)
        }

        fn free(&self, ptr: u64) -> Result<(), Error> {
            self.freed.lock().unwrap().push(ptr);
            if ptr == 0xbad00 { Err(Error::Backend("refused".into())) } else { Ok(()) }
        }
    }

    #[test]
    fn allocations_are_checked_and_refused_ones_given_back() {
        let good = Fake::starting_at(0x1000, 0x100);
        let a: Arc<dyn LocalAllocator> = good.clone();
        assert_eq!(allocate(&a, 64).unwrap(), 0x1000);
        assert_eq!(allocate(&a, 64).unwrap(), 0x1100);
        assert!(good.freed().is_empty());

        let misaligned = Fake::starting_at(0x2010, 0x100);
        let a: Arc<dyn LocalAllocator> = misaligned.clone();
        let e = allocate(&a, 32).unwrap_err();
        assert!(matches!(&e, Error::Backend(m) if m.contains("0x2010") && m.contains("256")), "{e}");
        assert_eq!(misaligned.freed(), vec![0x2010], "a refused address goes back to its allocator");

        let null = Fake::starting_at(0, 0);
        let a: Arc<dyn LocalAllocator> = null.clone();
        let e = allocate(&a, 8).unwrap_err();
        assert!(matches!(&e, Error::Backend(m) if m.contains("null address for 8 B")), "{e}");
        assert!(null.freed().is_empty(), "0 is not given back");
    }

    #[test]
    fn a_failed_free_is_logged_not_raised() {
        let fake = Fake::starting_at(0xbad00, 0);
        let a: Arc<dyn LocalAllocator> = fake.clone();
        release(&a, 0xbad00);
        assert_eq!(fake.freed(), vec![0xbad00]);
        assert_eq!(check_allocation(0x100, 1), Ok(()));
        assert!(check_allocation(0x180, 1).is_err());
    }
}

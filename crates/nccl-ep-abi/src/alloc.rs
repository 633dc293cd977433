//! `ncclEpAllocConfig_t`: the group config's `alloc_fn` / `free_fn` as the group's rank's local
//! allocator ([`LocalAllocator`]). As in NVIDIA's library, they serve local device scratch only:
//! handle memory, the output buffer sets, NCCL staging, counter words (see
//! `epflow_kernels::GpuWorld::join_over_with_allocator`); the memory peers map (receive regions,
//! signal pages) stays `cuMemAlloc`, since CUDA IPC exports whole `cuMemAlloc` allocations. Both
//! null: `cuMemAlloc` / `cuMemFree` (what `cudaMalloc` / `cudaFree` call).

use std::ffi::c_void;
use std::sync::Arc;

use epflow_core::Error;
use epflow_kernels::device::LocalAllocator;
use nccl_ep_sys as ep;

use crate::status::{Fail, Res};

/// `ncclEpAllocFn_t`, present.
type AllocFn = unsafe extern "C" fn(*mut *mut c_void, usize, *mut c_void) -> ep::CudaError;
/// `ncclEpFreeFn_t`, present.
type FreeFn = unsafe extern "C" fn(*mut c_void, *mut c_void) -> ep::CudaError;

/// The caller's `alloc_fn` / `free_fn` and the `context` passed to both.
#[derive(Debug)]
pub(crate) struct CallerAllocator {
    alloc_fn: AllocFn,
    free_fn: FreeFn,
    /// `ncclEpAllocConfig_t.context`, as an address (the caller's, never dereferenced here).
    context: usize,
}

/// The allocator `c` names: `None` when both functions are null; refused (`ncclInvalidUsage`)
/// when only one is.
pub(crate) fn caller_allocator(c: &ep::NcclEpAllocConfig) -> Res<Option<Arc<dyn LocalAllocator>>> {
    match (c.alloc_fn, c.free_fn) {
        (None, None) => Ok(None),
        (Some(alloc_fn), Some(free_fn)) => {
            Ok(Some(Arc::new(CallerAllocator { alloc_fn, free_fn, context: c.context as usize })))
        }
        _ => Err(Fail::usage("config.alloc: give both alloc_fn and free_fn, or neither")),
    }
}

// SAFETY: `nccl_ep.h`'s contract for `alloc_fn`: on `cudaSuccess` it stores the address of
// `size` bytes of device memory of the group's device, for the library alone until `free_fn`
// gets it back (a null address is refused below, a misaligned one by epflow-kernels). The
// function pointers and the context stay valid while the group and its handles live (the C
// caller's side of the contract), and `free_fn` may be called from any thread (documented in
// docs/c-cpp-python.md).
unsafe impl LocalAllocator for CallerAllocator {
    fn allocate(&self, bytes: usize) -> Result<u64, Error> {
        let mut ptr: *mut c_void = std::ptr::null_mut();
        // SAFETY: the caller's `alloc_fn`, called as `nccl_ep.h` declares it: a writable out
        // pointer, the size, and the config's context.
        let rc = unsafe { (self.alloc_fn)(&mut ptr, bytes, self.context as *mut c_void) };
        if rc != 0 {
            return Err(Error::Backend(format!("config.alloc.alloc_fn returned cudaError_t {rc} for {bytes} B")));
        }
        if ptr.is_null() {
            return Err(Error::Backend(format!(
                "config.alloc.alloc_fn returned cudaSuccess and a null address for {bytes} B"
            )));
        }
        Ok(ptr as u64)
    }

    fn free(&self, ptr: u64) -> Result<(), Error> {
        // SAFETY: the caller's `free_fn`, called as `nccl_ep.h` declares it, once, with an
        // address its `alloc_fn` returned and the config's context.
        let rc = unsafe { (self.free_fn)(ptr as *mut c_void, self.context as *mut c_void) };
        if rc != 0 {
            return Err(Error::Backend(format!("config.alloc.free_fn returned cudaError_t {rc} for {ptr:#x}")));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use super::*;

    /// What the fake functions saw: (kind, address, size, context).
    static CALLS: Mutex<Vec<(&str, usize, usize, usize)>> = Mutex::new(Vec::new());

    fn calls_with(context: usize) -> Vec<(&'static str, usize, usize, usize)> {
        CALLS.lock().unwrap().iter().filter(|c| c.3 == context).copied().collect()
    }

    /// Hands out `0x10000 + size`, except for size 7 (cudaErrorMemoryAllocation, 2) and size 9
    /// (success and NULL).
    unsafe extern "C" fn fake_alloc(ptr: *mut *mut c_void, size: usize, context: *mut c_void) -> ep::CudaError {
        CALLS.lock().unwrap().push(("alloc", 0, size, context as usize));
        let (rc, at) = match size {
            7 => (2, 0x5eed),
            9 => (0, 0),
            _ => (0, 0x10000 + size),
        };
        // SAFETY: test only: `ptr` is the out pointer `CallerAllocator::allocate` passes.
        unsafe { *ptr = at as *mut c_void };
        rc
    }

    /// Frees anything but `0xdead` (cudaErrorInvalidValue, 1).
    unsafe extern "C" fn fake_free(ptr: *mut c_void, context: *mut c_void) -> ep::CudaError {
        CALLS.lock().unwrap().push(("free", ptr as usize, 0, context as usize));
        if ptr as usize == 0xdead { 1 } else { 0 }
    }

    fn config(context: usize) -> ep::NcclEpAllocConfig {
        ep::NcclEpAllocConfig { alloc_fn: Some(fake_alloc), free_fn: Some(fake_free), context: context as *mut c_void }
    }

    #[test]
    fn the_callers_functions_are_called_with_its_context_and_their_errors_carry_the_code() {
        let a = caller_allocator(&config(0xc0)).unwrap().expect("an allocator");
        assert_eq!(a.allocate(4096).unwrap(), 0x10000 + 4096);
        assert_eq!(a.free(0x11000), Ok(()));
        let e = a.allocate(7).unwrap_err();
        assert_eq!(e, Error::Backend("config.alloc.alloc_fn returned cudaError_t 2 for 7 B".into()));
        let e = a.allocate(9).unwrap_err();
        assert!(matches!(&e, Error::Backend(m) if m.contains("cudaSuccess and a null address for 9 B")), "{e}");
        let e = a.free(0xdead).unwrap_err();
        assert_eq!(e, Error::Backend("config.alloc.free_fn returned cudaError_t 1 for 0xdead".into()));
        assert_eq!(
            calls_with(0xc0),
            vec![
                ("alloc", 0, 4096, 0xc0),
                ("free", 0x11000, 0, 0xc0),
                ("alloc", 0, 7, 0xc0),
                ("alloc", 0, 9, 0xc0),
                ("free", 0xdead, 0, 0xc0)
            ]
        );
        // An allocation error reaches the C caller as ncclUnhandledCudaError.
        assert_eq!(Fail::from(a.allocate(7).unwrap_err()).code, ep::NCCL_UNHANDLED_CUDA_ERROR);
    }

    #[test]
    fn both_functions_or_neither() {
        assert!(caller_allocator(&ep::NcclEpAllocConfig::default()).unwrap().is_none());
        let only_alloc = ep::NcclEpAllocConfig { free_fn: None, ..config(0xc1) };
        let only_free = ep::NcclEpAllocConfig { alloc_fn: None, ..config(0xc1) };
        for c in [only_alloc, only_free] {
            assert_eq!(caller_allocator(&c).err().map(|e| e.code), Some(ep::NCCL_INVALID_USAGE));
        }
        assert!(calls_with(0xc1).is_empty(), "checking a config calls neither function");
    }
}

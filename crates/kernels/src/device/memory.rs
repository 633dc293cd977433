//! Device and pinned host memory with RAII. Device buffers come from `cuMemAlloc` (not the
//! stream-ordered pool) so that peers (peer access, CUDA IPC) can map them; a rank's local
//! scratch may come from a caller's [`LocalAllocator`] instead.

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::{CudaContext, sys};
use epflow_core::Error;

use super::context::{bind, cuda};
use super::local::{self, LocalAllocator};
use super::parked::{self, Parked, Want, free_parked};

/// Waits for the context's legacy (NULL) stream: `cuMemsetD8` and pageable `cuMemcpyHtoD` may
/// return before the device has finished them, and epflow's own streams are non-blocking (they do
/// not wait for the legacy stream), so every such call is followed by this.
pub(crate) fn finish_legacy_stream(ctx: &CudaContext) -> Result<(), Error> {
    bind(ctx)?;
    // SAFETY: synchronizes the legacy stream of the bound context; no pointer is passed.
    unsafe { sys::cuStreamSynchronize(std::ptr::null_mut()) }.result().map_err(|e| cuda("synchronize", e))
}

/// Zero-filled device memory of one context, freed on drop: `cuMemFree`, or the free of the
/// [`LocalAllocator`] it came from ([`DeviceBuffer::zeroed_with`]).
#[derive(Debug)]
pub struct DeviceBuffer {
    ptr: u64,
    bytes: usize,
    ctx: Arc<CudaContext>,
    /// The allocator the memory came from; `None`: `cuMemAlloc`.
    allocator: Option<Arc<dyn LocalAllocator>>,
}

impl DeviceBuffer {
    /// Allocates `bytes` (at least 1) with `cuMemAlloc` and zeroes them.
    pub fn zeroed(ctx: &Arc<CudaContext>, bytes: usize) -> Result<Self, Error> {
        Self::zeroed_with(ctx, bytes, None)
    }

    /// Allocates `bytes` (at least 1) from `allocator` (`None`: `cuMemAlloc`, as
    /// [`DeviceBuffer::zeroed`]) and zeroes them (`cuMemsetD8`). For local scratch only: memory
    /// of an allocator cannot be shared with peers in other processes (CUDA IPC exports whole
    /// `cuMemAlloc` allocations).
    pub fn zeroed_with(
        ctx: &Arc<CudaContext>,
        bytes: usize,
        allocator: Option<&Arc<dyn LocalAllocator>>,
    ) -> Result<Self, Error> {
        bind(ctx)?;
        let bytes = bytes.max(1);
        let want = allocator.map_or(Want::Device, Want::Local);
        let ptr = match (parked::reuse(ctx, bytes, want), allocator) {
            (Some(p), _) => p.device_ptr(),
            (None, Some(a)) => local::allocate(a, bytes)?,
            (None, None) => {
                let mut ptr: sys::CUdeviceptr = 0;
                // SAFETY: `ptr` is a valid out pointer; the context is bound to this thread.
                unsafe { sys::cuMemAlloc_v2(&mut ptr, bytes) }
                    .result()
                    .map_err(|e| cuda(&format!("allocate {bytes} B"), e))?;
                ptr
            }
        };
        // From here the buffer owns the memory: an error below frees it.
        let buf = DeviceBuffer { ptr, bytes, ctx: Arc::clone(ctx), allocator: allocator.map(Arc::clone) };
        // SAFETY: `ptr` points to `bytes` bytes of device memory this context's work may write:
        // just allocated (`cuMemAlloc`, or an allocator, whose contract says so:
        // `LocalAllocator`'s Safety) or parked unused.
        unsafe { sys::cuMemsetD8_v2(ptr, 0, bytes) }.result().map_err(|e| cuda("zero memory", e))?;
        finish_legacy_stream(ctx)?;
        Ok(buf)
    }

    /// The allocator the memory came from (`None`: `cuMemAlloc`).
    pub fn allocator(&self) -> Option<&Arc<dyn LocalAllocator>> {
        self.allocator.as_ref()
    }

    /// The device address.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// The size in bytes.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// The context that owns it.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// Copies `src` into the buffer at byte `offset`; the data is on the device when this returns.
    pub fn write<T: Copy>(&self, offset: usize, src: &[T]) -> Result<(), Error> {
        let n = std::mem::size_of_val(src);
        if offset + n > self.bytes {
            return Err(Error::Backend(format!("write of {n} B at {offset} past a {} B buffer", self.bytes)));
        }
        // The range [offset, offset + n) lies inside the allocation (checked above).
        copy_from_host(&self.ctx, self.ptr + offset as u64, src)
    }

    /// Copies the buffer's bytes at `offset` into `dst` (synchronous; synchronize the streams
    /// that write the range first).
    pub fn read(&self, offset: usize, dst: &mut [u8]) -> Result<(), Error> {
        let n = std::mem::size_of_val(dst);
        if offset.checked_add(n).is_none_or(|end| end > self.bytes) {
            return Err(Error::Backend(format!("read of {n} B at {offset} past a {} B buffer", self.bytes)));
        }
        // The range [offset, offset + n) lies inside the allocation (checked above).
        copy_to_host(&self.ctx, self.ptr + offset as u64, dst)
    }
}

impl Drop for DeviceBuffer {
    /// Frees the memory, or parks it while another rank shares the context (`parked.rs`). Its
    /// owner drops it only once no kernel uses it any more: `cuMemFree` waits for the kernels
    /// running at the time, not for those still queued, and parked memory is reused with no
    /// wait at all, so every owner already ensures that (after its operations' events, or a
    /// synchronize). Memory of a [`LocalAllocator`] is given back to it under the same rule
    /// (whose free, a caching allocator's, may hand it to the next user at once), and parked
    /// alike (its free may be `cudaFree`, which waits as `cuMemFree` does).
    fn drop(&mut self) {
        let a = match self.allocator.take() {
            Some(allocator) => Parked::Local { ptr: self.ptr, bytes: self.bytes, allocator },
            None => Parked::Device { ptr: self.ptr, bytes: self.bytes },
        };
        if let Err(a) = parked::park(&self.ctx, a) {
            free_parked(&self.ctx, std::slice::from_ref(&a));
        }
    }
}

/// Copies `n` bytes from device address `src` to `dst` (synchronous).
pub(crate) fn copy_to_host<T: Copy>(ctx: &CudaContext, src: u64, dst: &mut [T]) -> Result<(), Error> {
    bind(ctx)?;
    let n = std::mem::size_of_val(dst);
    // SAFETY: `dst` is valid for n bytes; the caller passes a device range of at least n bytes.
    unsafe { sys::cuMemcpyDtoH_v2(dst.as_mut_ptr() as *mut c_void, src, n) }
        .result()
        .map_err(|e| cuda("copy to host", e))
}

/// Copies `src` to device address `dst` (synchronous: on the device when this returns).
pub(crate) fn copy_from_host<T: Copy>(ctx: &Arc<CudaContext>, dst: u64, src: &[T]) -> Result<(), Error> {
    bind(ctx)?;
    let n = std::mem::size_of_val(src);
    // SAFETY: `src` is valid for n bytes; the caller passes a device range of at least n bytes.
    unsafe { sys::cuMemcpyHtoD_v2(dst, src.as_ptr() as *const c_void, n) }
        .result()
        .map_err(|e| cuda("copy to device", e))?;
    finish_legacy_stream(ctx)
}

/// Pinned host memory mapped into the device's address space (the GPU writes it directly; the
/// host reads it without a copy). Zeroed at allocation.
#[derive(Debug)]
pub(crate) struct PinnedBuffer {
    host: *mut c_void,
    device: u64,
    bytes: usize,
    ctx: Arc<CudaContext>,
}

// SAFETY: the buffer is plain pinned memory; all access goes through volatile reads/writes of
// whole words, and the pointer itself is not tied to a thread.
unsafe impl Send for PinnedBuffer {}
// SAFETY: as above; concurrent readers only perform volatile loads.
unsafe impl Sync for PinnedBuffer {}

impl PinnedBuffer {
    /// Allocates `bytes` of portable, device-mapped pinned memory.
    pub(crate) fn zeroed(ctx: &Arc<CudaContext>, bytes: usize) -> Result<Self, Error> {
        bind(ctx)?;
        let bytes = bytes.max(8).next_multiple_of(8);
        if let Some(Parked::Host { host, device, .. }) = parked::reuse(ctx, bytes, Want::Host) {
            let host = host as *mut c_void;
            // SAFETY: a parked allocation of `bytes` writable bytes, no longer used by anyone.
            unsafe { std::ptr::write_bytes(host as *mut u8, 0, bytes) };
            return Ok(PinnedBuffer { host, device, bytes, ctx: Arc::clone(ctx) });
        }
        let mut host: *mut c_void = std::ptr::null_mut();
        let flags = sys::CU_MEMHOSTALLOC_PORTABLE | sys::CU_MEMHOSTALLOC_DEVICEMAP;
        // SAFETY: `host` is a valid out pointer; the context is bound.
        unsafe { sys::cuMemHostAlloc(&mut host, bytes, flags) }
            .result()
            .map_err(|e| cuda("allocate pinned memory", e))?;
        let mut device: sys::CUdeviceptr = 0;
        // SAFETY: `host` was just allocated with DEVICEMAP; `device` is a valid out pointer.
        let mapped = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut device, host, 0) }.result();
        let buf = PinnedBuffer { host, device, bytes, ctx: Arc::clone(ctx) };
        mapped.map_err(|e| cuda("map pinned memory", e))?;
        // SAFETY: `host` points to `bytes` writable bytes.
        unsafe { std::ptr::write_bytes(host as *mut u8, 0, bytes) };
        Ok(buf)
    }

    /// Its size in bytes (a multiple of 8).
    pub(crate) fn bytes(&self) -> usize {
        self.bytes
    }

    /// The device address of the mapping.
    pub(crate) fn device_ptr(&self) -> u64 {
        self.device
    }

    /// Reads word `i` (a `u64`), as the device last wrote it.
    pub(crate) fn read_u64(&self, i: usize) -> u64 {
        assert!(i < self.bytes / 8, "pinned read out of range");
        // SAFETY: index checked; the memory is mapped and aligned to 8; volatile because the
        // device writes it concurrently.
        unsafe { std::ptr::read_volatile((self.host as *const u64).add(i)) }
    }

    /// Writes word `i` (a `u64`; the device sees it in kernels launched afterwards).
    pub(crate) fn write_u64(&self, i: usize, v: u64) {
        assert!(i < self.bytes / 8, "pinned write out of range");
        // SAFETY: index checked; a volatile aligned word write of memory the device may read.
        unsafe { std::ptr::write_volatile((self.host as *mut u64).add(i), v) };
    }

    /// Writes `v` from the start (the device sees it in kernels launched afterwards).
    pub(crate) fn write_i32s(&self, v: &[i32]) {
        assert!(v.len() * 4 <= self.bytes, "pinned write out of range");
        for (i, &x) in v.iter().enumerate() {
            // SAFETY: range checked; volatile element writes of memory the device may read.
            unsafe { std::ptr::write_volatile((self.host as *mut i32).add(i), x) };
        }
    }

    /// Writes `v` as the `i`-th `i32` (the device sees it in kernels launched afterwards).
    pub(crate) fn write_i32_at(&self, i: usize, v: i32) {
        assert!((i + 1) * 4 <= self.bytes, "pinned write out of range");
        // SAFETY: range checked; a volatile element write of memory the device may read.
        unsafe { std::ptr::write_volatile((self.host as *mut i32).add(i), v) };
    }

    /// Reads `n` consecutive `i32`s from the start.
    pub(crate) fn read_i32s(&self, n: usize) -> Vec<i32> {
        assert!(n * 4 <= self.bytes, "pinned read out of range");
        // SAFETY: range checked; volatile element reads of device-written memory.
        (0..n).map(|i| unsafe { std::ptr::read_volatile((self.host as *const i32).add(i)) }).collect()
    }
}

impl Drop for PinnedBuffer {
    fn drop(&mut self) {
        let a = Parked::Host { host: self.host as usize, device: self.device, bytes: self.bytes };
        if let Err(a) = parked::park(&self.ctx, a) {
            free_parked(&self.ctx, std::slice::from_ref(&a));
        }
    }
}

//! NVLink peers: peer access between the contexts of one process, and CUDA IPC mappings of
//! another process's allocations (one process per GPU).

use std::sync::Arc;

use cudarc::driver::{CudaContext, sys};
use epflow_core::Error;

use crate::device::{bind, cuda};

/// The CUDA IPC handle of the allocation at `ptr` (a `cuMemAlloc` base).
pub(crate) fn ipc_export(ptr: u64) -> Result<[u8; 64], Error> {
    let mut h = std::mem::MaybeUninit::<sys::CUipcMemHandle>::uninit();
    // SAFETY: valid out pointer; `ptr` is the base of a live cuMemAlloc allocation.
    unsafe { sys::cuIpcGetMemHandle(h.as_mut_ptr(), ptr) }.result().map_err(|e| cuda("export IPC handle", e))?;
    // SAFETY: initialized by the successful call above.
    let h = unsafe { h.assume_init() };
    Ok(h.reserved.map(|c| c as u8))
}

/// A peer process's allocation mapped into this one; unmapped on drop.
#[derive(Debug)]
pub(crate) struct IpcMapping {
    pub(crate) ptr: u64,
    ctx: Arc<CudaContext>,
}

impl IpcMapping {
    pub(crate) fn open(ctx: &Arc<CudaContext>, handle: &[u8]) -> Result<Self, Error> {
        bind(ctx)?;
        let mut reserved = [0 as std::ffi::c_char; 64];
        for (r, &b) in reserved.iter_mut().zip(handle) {
            *r = b as std::ffi::c_char;
        }
        let h = sys::CUipcMemHandle { reserved };
        let mut ptr: sys::CUdeviceptr = 0;
        let flags = sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32;
        // SAFETY: valid out pointer; the handle bytes came from cuIpcGetMemHandle in a peer process.
        unsafe { sys::cuIpcOpenMemHandle_v2(&mut ptr, h, flags) }
            .result()
            .map_err(|e| cuda("open a peer's IPC handle", e))?;
        Ok(IpcMapping { ptr, ctx: Arc::clone(ctx) })
    }
}

impl Drop for IpcMapping {
    fn drop(&mut self) {
        if bind(&self.ctx).is_ok() {
            // SAFETY: closes the mapping opened in `open`, once; the device is idle (the rank's
            // streams were synchronized when it was dropped).
            let _ = unsafe { sys::cuIpcCloseMemHandle(self.ptr) };
        }
    }
}

/// Enables peer access for every `(i, j)` of `pairs` (indices into `devices`).
pub(crate) fn enable_peer_access(
    devices: &[usize],
    ctxs: &[Arc<CudaContext>],
    pairs: &[(usize, usize)],
) -> Result<(), Error> {
    for &(i, j) in pairs {
        let (a, b) = (&ctxs[i], &ctxs[j]);
        {
            if devices[i] == devices[j] {
                continue;
            }
            bind(a)?;
            let mut can = 0i32;
            // SAFETY: valid out pointer and device handles of live contexts.
            unsafe { sys::cuDeviceCanAccessPeer(&mut can, a.cu_device(), b.cu_device()) }
                .result()
                .map_err(|e| cuda("query peer access", e))?;
            if can == 0 {
                return Err(Error::Unsupported(format!(
                    "device {} cannot access device {}'s memory (no NVLink/P2P path); the NVLink kernels need it",
                    devices[i], devices[j]
                )));
            }
            // SAFETY: `b` is a live context; the current context is `a`.
            match unsafe { sys::cuCtxEnablePeerAccess(b.cu_ctx(), 0) } {
                sys::CUresult::CUDA_SUCCESS | sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED => {}
                e => return Err(cuda("enable peer access", cudarc::driver::DriverError(e))),
            }
        }
    }
    Ok(())
}

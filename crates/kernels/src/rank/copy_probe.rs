//! [`GpuRank::sm_copy`]: a copy with SM loads and stores between two device buffers, local or on
//! a peer GPU of the group (a probe of the NVLink ceiling of SM stores, which the high-throughput
//! kernels' sending warps use; `examples/nvlink_ceiling --sms`).

use cudarc::driver::{CudaStream, LaunchConfig, PushKernelArg};
use epflow_core::Error;

use super::GpuRank;
use crate::device::{DeviceBuffer, cuda};

/// Threads per block of `ep_sm_copy` (its `__launch_bounds__`).
const SM_COPY_BLOCK: u32 = 512;

impl GpuRank {
    /// Copies `bytes` (a multiple of 16) from `src` to `dst` at byte `dst_offset`, with `blocks`
    /// blocks of 512 threads of SM loads and stores (each warp 4 KB at a time, 8 vectors in
    /// flight per lane), enqueued on `stream` (of this rank's context); returns once enqueued.
    /// `src` is this rank's; `dst` is this rank's or a peer's of the same group (peer access
    /// is enabled between the group's GPUs). Errors: a range outside a buffer, a size that is
    /// not a multiple of 16, `src` on another device; CUDA failures.
    ///
    /// # Safety
    ///
    /// `dst` must be this rank's or a peer's of the same group (another GPU's memory without
    /// peer access faults the kernel); `src` and `dst` must stay allocated until the copy is done
    /// (synchronize `stream` before dropping either), and nothing else may write the destination
    /// range meanwhile.
    pub unsafe fn sm_copy(
        &self,
        stream: &CudaStream,
        dst: &DeviceBuffer,
        dst_offset: usize,
        src: &DeviceBuffer,
        bytes: usize,
        blocks: u32,
    ) -> Result<(), Error> {
        if bytes % 16 != 0 || bytes > src.bytes() || dst_offset.checked_add(bytes).is_none_or(|end| end > dst.bytes()) {
            return Err(Error::Unsupported(format!(
                "sm_copy: {bytes} B (a multiple of 16) at offset {dst_offset} does not fit a {} B source and a {} B destination",
                src.bytes(),
                dst.bytes()
            )));
        }
        if !std::sync::Arc::ptr_eq(src.context(), &self.shared.ctx) {
            return Err(Error::Unsupported("sm_copy: the source must be this rank's buffer".into()));
        }
        let (d, s, n) = (dst.ptr() + dst_offset as u64, src.ptr(), bytes as u64);
        let cfg =
            LaunchConfig { grid_dim: (blocks.max(1), 1, 1), block_dim: (SM_COPY_BLOCK, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: the arguments match `ep_sm_copy(u64, u64, u64)`; both ranges lie inside live
        // allocations (checked above), the destination is this GPU's or a peer's of the group,
        // which enabled peer access between its GPUs; the caller keeps both alive until the copy
        // is done (this function's contract).
        unsafe { stream.launch_builder(&self.shared.functions.sm_copy).arg(&d).arg(&s).arg(&n).launch(cfg) }
            .map_err(|e| cuda("launch sm_copy", e))?;
        Ok(())
    }
}

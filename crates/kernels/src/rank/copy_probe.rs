//! [`GpuRank::sm_copy`] and [`GpuRank::tma_copy`]: copies between two device buffers, local or on
//! a peer GPU of the group, with SM loads and stores (as the high-throughput kernels' sending
//! warps do) or with bulk asynchronous copies of the Tensor Memory Accelerator: probes of the
//! NVLink ceiling of each (`examples/nvlink_ceiling --sms`, `--tma`).

use cudarc::driver::sys::CUfunction_attribute;
use cudarc::driver::{CudaStream, LaunchConfig, PushKernelArg};
use epflow_core::Error;

use super::GpuRank;
use crate::device::{DeviceBuffer, cuda};

/// Threads per block of `ep_sm_copy` (its `__launch_bounds__`).
const SM_COPY_BLOCK: u32 = 512;
/// The most shared-memory buffers `ep_tma_copy` takes (its `TMA_MAX_STAGES`).
const TMA_MAX_STAGES: u32 = 32;

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
        self.check_copy("sm_copy", dst, dst_offset, src, bytes)?;
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

    /// Copies `bytes` (a multiple of 16) from `src` to `dst` at byte `dst_offset` with `blocks`
    /// blocks whose one issuing thread each moves chunks of `chunk` bytes (a multiple of 16)
    /// global -> shared -> global with the Tensor Memory Accelerator's bulk copies, through
    /// `stages` (2..=32) shared-memory buffers (`chunk * stages` bytes of
    /// dynamic shared memory per block, at most the device's opt-in limit, 227 KB on H100 /
    /// H200), keeping `stages - 1` loads ahead of its stores. Enqueued on `stream`; returns
    /// once enqueued. Needs sm_90 or later. Errors and safety as [`GpuRank::sm_copy`], plus a
    /// `chunk` or `stages` out of range.
    ///
    /// # Safety
    ///
    /// As [`GpuRank::sm_copy`].
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn tma_copy(
        &self,
        stream: &CudaStream,
        dst: &DeviceBuffer,
        dst_offset: usize,
        src: &DeviceBuffer,
        bytes: usize,
        blocks: u32,
        chunk: u32,
        stages: u32,
    ) -> Result<(), Error> {
        self.check_copy("tma_copy", dst, dst_offset, src, bytes)?;
        if chunk == 0 || chunk % 16 != 0 || !(2..=TMA_MAX_STAGES).contains(&stages) {
            return Err(Error::Unsupported(format!(
                "tma_copy: chunks of {chunk} B (a multiple of 16) through {stages} stages (2..={TMA_MAX_STAGES})"
            )));
        }
        let smem = chunk.checked_mul(stages).filter(|&b| b <= i32::MAX as u32).ok_or_else(|| {
            Error::Unsupported(format!("tma_copy: {stages} stages of {chunk} B overflow shared memory"))
        })?;
        let f = &self.shared.functions.tma_copy;
        f.set_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem as i32)
            .map_err(|e| cuda("tma_copy: shared memory", e))?;
        let (d, s, n) = (dst.ptr() + dst_offset as u64, src.ptr(), bytes as u64);
        let cfg = LaunchConfig { grid_dim: (blocks.max(1), 1, 1), block_dim: (32, 1, 1), shared_mem_bytes: smem };
        // SAFETY: the arguments match `ep_tma_copy(u64, u64, u64, u32, u32)`; both ranges lie
        // inside live allocations (checked above) and are 16-byte aligned (allocations are
        // 256-byte aligned, offsets and sizes multiples of 16); the destination is this GPU's or a
        // peer's of the group; the caller keeps both alive until the copy is done.
        unsafe { stream.launch_builder(f).arg(&d).arg(&s).arg(&n).arg(&chunk).arg(&stages).launch(cfg) }
            .map_err(|e| cuda("launch tma_copy", e))?;
        Ok(())
    }

    /// The checks both probes share: sizes, ranges and the source's device.
    fn check_copy(
        &self,
        what: &str,
        dst: &DeviceBuffer,
        dst_offset: usize,
        src: &DeviceBuffer,
        bytes: usize,
    ) -> Result<(), Error> {
        if bytes % 16 != 0
            || dst_offset % 16 != 0
            || bytes > src.bytes()
            || dst_offset.checked_add(bytes).is_none_or(|end| end > dst.bytes())
        {
            return Err(Error::Unsupported(format!(
                "{what}: {bytes} B (a multiple of 16) at offset {dst_offset} (a multiple of 16) does not fit a {} B source and a {} B destination",
                src.bytes(),
                dst.bytes()
            )));
        }
        if !std::sync::Arc::ptr_eq(src.context(), &self.shared.ctx) {
            return Err(Error::Unsupported(format!("{what}: the source must be this rank's buffer")));
        }
        Ok(())
    }
}

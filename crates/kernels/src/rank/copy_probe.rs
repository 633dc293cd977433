//! [`GpuRank::sm_copy`] and [`GpuRank::tma_copy`]: copies between two device buffers, local or on
//! a peer GPU of the group, with SM loads and stores (as the high-throughput kernels' sending
//! warps do) or with bulk asynchronous copies of the Tensor Memory Accelerator: probes of the
//! NVLink ceiling of each (`examples/nvlink_ceiling --sms`, `--tma`).

use cudarc::driver::sys::CUfunction_attribute;
use cudarc::driver::{CudaStream, LaunchConfig, PushKernelArg};
use epflow_core::Error;

use super::GpuRank;
use crate::device::{DeviceBuffer, cuda};
use crate::params::TMA_MAX_STAGES;

/// Threads per block of `ep_sm_copy` (its `__launch_bounds__`).
const SM_COPY_BLOCK: u32 = 512;

/// One copy of the probes: `bytes` (a multiple of 16) of `src`, this rank's buffer, into `dst`,
/// this rank's or a peer's of the same group, at byte `dst_offset` (a multiple of 16).
#[derive(Clone, Copy, Debug)]
pub struct CopyRange<'a> {
    /// Where the bytes go.
    pub dst: &'a DeviceBuffer,
    /// Byte offset in `dst`.
    pub dst_offset: usize,
    /// Where they come from (from its start).
    pub src: &'a DeviceBuffer,
    /// How many.
    pub bytes: usize,
}

/// How each block of [`GpuRank::tma_copy`] moves its chunks: `chunk` bytes (a multiple of 16) at
/// a time through `stages` (2..=32) shared-memory buffers, `chunk * stages` bytes of dynamic
/// shared memory per block (at most the device's opt-in limit, 227 KB on H100 / H200).
#[derive(Clone, Copy, Debug)]
pub struct BulkStages {
    /// Bytes per bulk copy.
    pub chunk: u32,
    /// Shared-memory buffers per block.
    pub stages: u32,
}

impl GpuRank {
    /// Copies `copy` with `blocks` blocks of 512 threads of SM loads and stores (each warp 4 KB
    /// at a time, 8 vectors in flight per lane), enqueued on `stream` (of this rank's context);
    /// returns once enqueued. Peer access is enabled between the group's GPUs. Errors: a range
    /// outside a buffer, a size or offset that is not a multiple of 16, a source on another
    /// device; CUDA failures.
    ///
    /// # Safety
    ///
    /// `copy.dst` must be this rank's or a peer's of the same group (another GPU's memory without
    /// peer access faults the kernel); both buffers must stay allocated until the copy is done
    /// (synchronize `stream` before dropping either), and nothing else may write the destination
    /// range meanwhile.
    pub unsafe fn sm_copy(&self, stream: &CudaStream, copy: CopyRange<'_>, blocks: u32) -> Result<(), Error> {
        let (d, s, n) = self.check_copy("sm_copy", copy)?;
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

    /// As [`GpuRank::sm_copy`], with the work balanced between the blocks: each warp takes the
    /// next 16 KB piece of the copy from `counter` (this rank's buffer of at least 8 bytes, set to
    /// zero on `stream` first), so a block the memory system serves faster copies more.
    ///
    /// # Safety
    ///
    /// As [`GpuRank::sm_copy`]; `counter` must also stay allocated until the copy is done, and
    /// no other copy may use it meanwhile.
    pub unsafe fn sm_copy_balanced(
        &self,
        stream: &CudaStream,
        copy: CopyRange<'_>,
        blocks: u32,
        counter: &DeviceBuffer,
    ) -> Result<(), Error> {
        let (d, s, n) = self.check_copy("sm_copy_balanced", copy)?;
        if counter.bytes() < 8 || !std::sync::Arc::ptr_eq(counter.context(), &self.shared.ctx) {
            return Err(Error::Unsupported("sm_copy_balanced: the counter must be 8 bytes of this rank's".into()));
        }
        let ctr = counter.ptr();
        let cfg =
            LaunchConfig { grid_dim: (blocks.max(1), 1, 1), block_dim: (SM_COPY_BLOCK, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: the counter word lies inside a live allocation of this rank's (checked above);
        // the memset is ordered on `stream` before the launch that reads it. The launch's
        // arguments match `ep_sm_copy_balanced(u64, u64, u64, u64)`; the ranges are checked
        // above, and the caller keeps the buffers alive until the copy is done.
        unsafe {
            cudarc::driver::sys::cuMemsetD32Async(ctr, 0, 2, stream.cu_stream())
                .result()
                .map_err(|e| cuda("clear sm_copy_balanced's counter", e))?;
            stream.launch_builder(&self.shared.functions.sm_copy_balanced).arg(&d).arg(&s).arg(&n).arg(&ctr).launch(cfg)
        }
        .map_err(|e| cuda("launch sm_copy_balanced", e))?;
        Ok(())
    }

    /// Copies `copy` with `blocks` blocks whose one issuing thread each moves chunks global ->
    /// shared -> global with the Tensor Memory Accelerator's bulk copies, as `shape` says,
    /// keeping `stages - 1` loads ahead of its stores. Enqueued on `stream`; returns once
    /// enqueued. Needs sm_90 or later. Errors as [`GpuRank::sm_copy`], plus a chunk or a stage
    /// count out of range.
    ///
    /// # Safety
    ///
    /// As [`GpuRank::sm_copy`].
    pub unsafe fn tma_copy(
        &self,
        stream: &CudaStream,
        copy: CopyRange<'_>,
        blocks: u32,
        shape: BulkStages,
    ) -> Result<(), Error> {
        let (d, s, n) = self.check_copy("tma_copy", copy)?;
        let BulkStages { chunk, stages } = shape;
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
        let cfg = LaunchConfig { grid_dim: (blocks.max(1), 1, 1), block_dim: (32, 1, 1), shared_mem_bytes: smem };
        // SAFETY: the arguments match `ep_tma_copy(u64, u64, u64, u32, u32)`; both ranges lie
        // inside live allocations (checked above) and are 16-byte aligned (allocations are
        // 256-byte aligned, offsets and sizes multiples of 16); the destination is this GPU's or a
        // peer's of the group; the caller keeps both alive until the copy is done.
        unsafe { stream.launch_builder(f).arg(&d).arg(&s).arg(&n).arg(&chunk).arg(&stages).launch(cfg) }
            .map_err(|e| cuda("launch tma_copy", e))?;
        Ok(())
    }

    /// The checks both probes share (sizes, ranges, the source's device); the destination
    /// address, the source address and the byte count.
    fn check_copy(&self, what: &str, c: CopyRange<'_>) -> Result<(u64, u64, u64), Error> {
        let CopyRange { dst, dst_offset, src, bytes } = c;
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
        Ok((dst.ptr() + dst_offset as u64, src.ptr(), bytes as u64))
    }
}

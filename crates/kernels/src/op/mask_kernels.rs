//! The one-thread mask kernels of `ll.cu` (`MaskParams`), launched over a rank's shared state:
//! what `GpuRank`'s masking (`rank/mask.rs`) runs, and [`spread_mask`], by which an operation
//! masks the NCCL peers whose pairs it revoked at its deadline.

use cudarc::driver::{CudaStream, LaunchConfig, PushKernelArg};
use epflow_core::Error;
use epflow_core::protocol::Channel;

use crate::device::{bind, cuda};
use crate::params::MaskParams;
use crate::state::shared::{RankShared, peer_array};

/// The mask kernels' parameters of the rank of `s` (its pages, its peers' signal pages).
pub(crate) fn mask_params(s: &RankShared) -> MaskParams {
    MaskParams {
        signals: s.mem.signals.ptr(),
        status: s.mem.status.device_ptr(),
        peer_signals: peer_array(&s.peers().signals),
        timeout_ns: s.device_timeout_ns(),
        rank: s.rank as i32,
        num_ranks: s.num_ranks as i32,
        ..MaskParams::default()
    }
}

/// Enqueues one thread of `f` (a kernel of `ll.cu` taking a `MaskParams`) with `m` on
/// `stream`, of the context of `s`.
pub(crate) fn launch(
    s: &RankShared,
    f: &cudarc::driver::CudaFunction,
    m: MaskParams,
    stream: &CudaStream,
    what: &str,
) -> Result<(), Error> {
    bind(&s.ctx)?;
    let mut b = stream.launch_builder(f);
    b.arg(&m);
    let cfg = LaunchConfig { grid_dim: (1, 1, 1), block_dim: (1, 1, 1), shared_mem_bytes: 0 };
    // SAFETY: `m` matches `struct MaskParams` of ll.cu byte for byte (params.rs tests); every
    // address in it is this rank's signal page, its mapped status page or a peer's mapped
    // signal page, all alive as long as the rank, which frees its memory only after
    // synchronizing its context (`RankMemory`'s drop; the kernels end by their deadline).
    unsafe { b.launch(cfg) }.map_err(|e| cuda(what, e))?;
    Ok(())
}

/// Runs one thread of `f` with `m` on the handle stream of `s` and waits for it.
pub(crate) fn run(s: &RankShared, f: &cudarc::driver::CudaFunction, m: MaskParams, what: &str) -> Result<(), Error> {
    let stream = &s.streams[Channel::Handle.index()];
    launch(s, f, m, stream, what)?;
    stream.synchronize().map_err(|e| cuda(what, e))
}

/// Masks the ranks of `bits` on the rank of `s` (`ep_mask_spread`: its own word, and its NVLink
/// peers'), waited for: how an operation masks the NCCL peers whose pair it revoked at its
/// deadline (`transport/nccl_pairs.rs`). On a stream of its own, so no handle build queued on
/// the handle stream holds it up.
pub(crate) fn spread_mask(s: &RankShared, bits: u64) -> Result<(), Error> {
    let what = "mask the peers of revoked NCCL pairs";
    bind(&s.ctx)?;
    let stream = s.ctx.new_stream().map_err(|e| cuda(what, e))?;
    let m = MaskParams { bits, ..mask_params(s) };
    launch(s, &s.functions.mask_spread, m, &stream, what)?;
    stream.synchronize().map_err(|e| cuda(what, e))
}

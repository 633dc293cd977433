//! API v2's `overflow_policy` `NCCL_EP_OVERFLOW_DROP` on high-throughput flat handles.
//!
//! A high-throughput group's `max_recv_tokens_per_rank` (`B`) is the number of rows a flat
//! dispatch output must hold. When a routing sends a rank `N > B` rows:
//!
//! - AUTO / TRAP: the dispatch is refused (`ncclInvalidArgument`, the output is smaller than `N`
//!   rows) where NVIDIA's library traps the device.
//! - DROP: the rank keeps its first `B` rows in the flat order (source rank, then the source's
//!   token order: the rows NVIDIA's scan keeps too) and drops the rest. The dispatch runs into
//!   the handle's own `N`-row buffers ([`Overflow`]) and its first `B` rows are copied into the
//!   caller's outputs; the combine reads the caller's `B` rows of expert outputs and zeros for
//!   the dropped rows, so a dropped row adds nothing to its source token's sum.
//!
//! What the handle reports for such a routing: `recv_total_counter` the true `N` (NVIDIA's
//! meaning: callers compare it with `B` to see the drop), `expert_counters` the rows per local
//! expert of all `N` rows (NVIDIA's count only the kept rows: epflow's receiver learns which
//! experts a row carries only from the rows themselves). Expert-major handles on a DROP group
//! are refused when they are made.

use std::sync::Arc;

use cudarc::driver::CudaStream;
use epflow_core::{DType, TensorDesc, TensorTag};
use epflow_kernels::{DeviceTensor, GpuRank};

use crate::last_use::LastUse;
use crate::status::Res;

/// The rows a flat handle keeps of the `received` rows a routing sends it, with a receive
/// budget of `budget` rows: `Some(budget)` when `drop` is on and the routing overflows it,
/// `None` when every row is kept (or, without `drop`, when the dispatch will be refused).
pub(crate) fn kept_rows(received: usize, budget: usize, drop: bool) -> Option<usize> {
    (drop && received > budget).then_some(budget)
}

/// One overflowing routing's buffers: the flat dispatch's `N` rows land here, and the combine
/// reads its `N` rows from here (the caller's `B` first, zeros after).
pub(crate) struct Overflow {
    /// The last copy or combine on a caller's stream that used these buffers (dropped first:
    /// waits for it).
    last_use: LastUse,
    /// `B`: the rows kept.
    pub(crate) kept: usize,
    /// The dispatch's rows, `[N x H]` BF16.
    pub(crate) tokens: DeviceTensor,
    /// The dispatch's weights, `[N x K]` f32.
    pub(crate) weights: DeviceTensor,
    /// The dispatch's local expert ids, `[N x K]` int64.
    pub(crate) idx: DeviceTensor,
    /// The combine's input, `[N x H]` BF16: rows `B..N` stay zero.
    pub(crate) combine_in: DeviceTensor,
    /// The backward combine's weights, `[N x K]` f32: rows `B..N` stay zero.
    pub(crate) combine_weights: DeviceTensor,
}

impl Overflow {
    /// The buffers of a routing sending `received` rows of top-k `top_k` and hidden `hidden`,
    /// `kept` of which stay (the handle's memory: from the group's `alloc_fn` when it has one).
    pub(crate) fn new(rank: &GpuRank, received: usize, kept: usize, top_k: usize, hidden: usize) -> Res<Self> {
        let zeros = |tag, dtype, shape: &[usize]| rank.local_zeros(TensorDesc::contiguous(tag, dtype, shape));
        Ok(Overflow {
            last_use: LastUse::new("an overflow buffer"),
            kept,
            tokens: zeros(TensorTag::Tokens, DType::Bf16, &[received, hidden])?,
            weights: zeros(TensorTag::TopkWeights, DType::F32, &[received, top_k])?,
            idx: zeros(TensorTag::TopkIdx, DType::I64, &[received, top_k])?,
            combine_in: zeros(TensorTag::Tokens, DType::Bf16, &[received, hidden])?,
            combine_weights: zeros(TensorTag::TopkWeights, DType::F32, &[received, top_k])?,
        })
    }

    /// Before a dispatch or combine of the handle on `stream` uses these buffers: `stream` waits
    /// for the last use enqueued on another stream (a no-op on the same one).
    pub(crate) fn wait_on(&self, stream: &Arc<CudaStream>) -> Res<()> {
        self.last_use.wait_on(stream)
    }

    /// After the dispatch into these buffers, on `stream`: the first `B` rows of each `(own,
    /// caller)` pair copied to the caller's address (each holding at least `B` rows of `own`'s
    /// row): [`Self::tokens`] (a forwarded dispatch: its token and scale rows,
    /// `Forwarded::split`) and, forward, [`Self::weights`] and [`Self::idx`].
    pub(crate) fn keep_dispatched(
        &self,
        rank: &GpuRank,
        stream: &Arc<CudaStream>,
        outputs: &[(&DeviceTensor, u64)],
    ) -> Res<()> {
        for &(own, caller) in outputs {
            copy_rows(rank, stream, own, own.ptr(), caller, self.kept)?;
        }
        self.used_on(stream)
    }

    /// Before the combine, on `stream`: the caller's `B` rows of expert outputs `tokens` (and,
    /// backward, of `weights`) copied into [`Self::combine_in`] (and
    /// [`Self::combine_weights`]), whose dropped rows stay zero. The caller records
    /// [`Self::used_on`] once the combine that reads them is enqueued.
    pub(crate) fn take_combine_inputs(
        &self,
        rank: &GpuRank,
        stream: &Arc<CudaStream>,
        tokens: u64,
        weights: Option<u64>,
    ) -> Res<()> {
        copy_rows(rank, stream, &self.combine_in, tokens, self.combine_in.ptr(), self.kept)?;
        if let Some(w) = weights {
            copy_rows(rank, stream, &self.combine_weights, w, self.combine_weights.ptr(), self.kept)?;
        }
        Ok(())
    }

    /// Records the buffers' last use on `stream`, after the work just enqueued there (the
    /// copies, and a combine's send that reads [`Self::combine_in`]).
    pub(crate) fn used_on(&self, stream: &Arc<CudaStream>) -> Res<()> {
        self.last_use.record(stream)
    }
}

/// The first `rows` rows at `src` copied to `dst`, on `stream`: one of them is `own`'s memory,
/// the other the caller's, both of `own`'s row.
fn copy_rows(rank: &GpuRank, stream: &Arc<CudaStream>, own: &DeviceTensor, src: u64, dst: u64, rows: usize) -> Res<()> {
    let d = own.desc();
    let mut shape = d.shape.clone();
    shape[0] = rows;
    let view = |ptr| {
        // SAFETY: `ptr` is `own`'s memory or a caller tensor that every caller checked holds at
        // least `rows` rows of `own`'s row (nccl_ep.h's contract keeps it valid while the
        // operation runs).
        unsafe { DeviceTensor::from_raw(ptr, own.device(), TensorDesc::contiguous(d.tag, d.dtype, &shape)) }
    };
    rank.copy_on(stream, &view(src), &view(dst))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_drop_keeps_a_prefix_and_only_of_an_overflowing_routing() {
        assert_eq!(kept_rows(12, 8, true), Some(8));
        assert_eq!(kept_rows(8, 8, true), None, "exactly the budget: nothing dropped");
        assert_eq!(kept_rows(3, 8, true), None);
        assert_eq!(kept_rows(12, 8, false), None, "TRAP: the dispatch is refused instead");
        assert_eq!(kept_rows(0, 0, true), None);
    }
}

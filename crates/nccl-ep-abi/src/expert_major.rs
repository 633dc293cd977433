//! High-throughput `NCCL_EP_LAYOUT_EXPERT_MAJOR` on epflow's flat layout: the dispatch runs
//! flat into the handle's memory, then the rows are scattered into the caller's expert zones
//! (`GpuRank::expert_major_*`, in the caller's stream order); the combine sums each received
//! row's slots back into a flat input first. The handle's counters report the padded zones, as
//! NCCL EP's do: `expert_counters` the padded count per local expert, `expert_offsets` each
//! zone's first slot, `recv_total_counter` the slots in all. BF16 rows or forwarded ones
//! (`NCCL_EP_DISP_QUANT_FWD`: the token and scale rows scattered alike). The backward pass
//! (NCCL EP's): a backward dispatch scatters gradients into the slots the forward dispatch
//! numbered, and a backward combine takes the zones' gradients with one weight gradient per
//! slot (`[S]`), summed and gathered back per entry before the flat backward combine. A combine
//! or backward dispatch before any forward dispatch on the handle is refused: the slots are
//! numbered from the forward dispatch's rows.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use cudarc::driver::CudaStream;
use epflow_core::{DType, TensorDesc, TensorTag};
use epflow_kernels::{DeviceTensor, ExpertMajorPlan, GpuRank};
use nccl_ep_sys as ep;

use crate::last_use::LastUse;
use crate::status::{Fail, Res};

/// The alignment of a handle's expert zones when `layout` of an `algorithm` group is
/// high-throughput expert-major (`None` for every other layout): `config`'s
/// `dispatch_output_per_expert_alignment` (0 or 1: none; else a power of two).
pub(crate) fn alignment_of(
    algorithm: epflow_core::Algorithm,
    layout: ep::NcclEpLayout,
    config: Option<&ep::NcclEpHandleConfig>,
) -> Res<Option<usize>> {
    if algorithm != epflow_core::Algorithm::HighThroughput || layout != ep::NCCL_EP_LAYOUT_EXPERT_MAJOR {
        return Ok(None);
    }
    let a = config.map_or(0, |c| c.dispatch_output_per_expert_alignment);
    if a > 1 && !a.is_power_of_two() {
        return Err(Fail::arg(format!("config.dispatch_output_per_expert_alignment is {a}: 0, 1 or a power of two")));
    }
    Ok(Some(a))
}

/// One high-throughput expert-major handle's zones and the flat outputs they are built from.
pub(crate) struct ExpertMajor {
    /// The last scatter or reduce enqueued on a caller's stream (dropped first: the buffers
    /// are freed only after it).
    last_use: LastUse,
    pub(crate) plan: ExpertMajorPlan,
    /// The flat dispatch's outputs: tokens `[N x H]` BF16, weights `[N x K]` f32, local expert
    /// indices `[N x K]` int64.
    pub(crate) tokens: DeviceTensor,
    pub(crate) weights: DeviceTensor,
    pub(crate) idx: DeviceTensor,
    /// The flat combine's input, `[N x H]` BF16, summed from the caller's slots.
    pub(crate) combine_in: DeviceTensor,
    /// The flat backward combine's weight gradients, `[N x K]` f32, gathered from the slots'.
    pub(crate) combine_weights: DeviceTensor,
    /// Whether a forward dispatch numbered the slots (enqueued: the stream order does the rest).
    numbered: AtomicBool,
}

impl ExpertMajor {
    /// The zones of a handle receiving `rows` rows of top-k `top_k` and hidden `hidden`,
    /// `counts[e]` to local expert `e`, aligned to `alignment`; its memory allocated here (the
    /// handle's memory: from the group's `alloc_fn` when it has one).
    pub(crate) fn new(
        rank: &GpuRank,
        counts: &[i32],
        rows: usize,
        top_k: usize,
        hidden: usize,
        alignment: usize,
    ) -> Res<Self> {
        let plan = rank.expert_major_plan(counts, rows, top_k, alignment)?;
        let zeros = |tag, dtype, shape: &[usize]| rank.local_zeros(TensorDesc::contiguous(tag, dtype, shape));
        Ok(ExpertMajor {
            tokens: zeros(TensorTag::Tokens, DType::Bf16, &[rows, hidden])?,
            weights: zeros(TensorTag::TopkWeights, DType::F32, &[rows, top_k])?,
            idx: zeros(TensorTag::TopkIdx, DType::I64, &[rows, top_k])?,
            combine_in: zeros(TensorTag::Tokens, DType::Bf16, &[rows, hidden])?,
            combine_weights: zeros(TensorTag::TopkWeights, DType::F32, &[rows, top_k])?,
            numbered: AtomicBool::new(false),
            plan,
            last_use: LastUse::new("an expert-major buffer"),
        })
    }

    /// After the flat dispatch into [`Self::tokens`], [`Self::weights`] and [`Self::idx`]: the
    /// caller's `out_weights` (`[S]` f32) filled, and each pair's caller rows from the flat
    /// rows, on `stream`. `rows`: (flat `[N x W]`, caller's `[S x W]`) BF16, `(Self::tokens,
    /// out)` for a BF16 dispatch; a forwarded one's token and scale rows as BF16 pairs of bytes
    /// (`Forwarded::split`).
    pub(crate) fn scatter(
        &self,
        rank: &GpuRank,
        stream: &Arc<CudaStream>,
        rows: &[(&DeviceTensor, &DeviceTensor)],
        out_weights: &DeviceTensor,
    ) -> Res<()> {
        rank.expert_major_slots_on(stream, &self.plan, &self.idx)?;
        self.numbered.store(true, Ordering::Release);
        for (flat, out) in rows {
            // Each pass writes the same weights (and zeroes the zones' padding of its rows).
            rank.expert_major_scatter_on(stream, &self.plan, flat, out, Some((&self.weights, out_weights)))?;
        }
        self.used_on(stream)
    }

    /// After a backward dispatch into [`Self::tokens`]: the gradients scattered into the
    /// caller's `out` (`[S x H]` BF16) at the slots the forward dispatch numbered, padding
    /// zeroed, on `stream`.
    pub(crate) fn scatter_gradients(&self, rank: &GpuRank, stream: &Arc<CudaStream>, out: &DeviceTensor) -> Res<()> {
        self.require_numbered()?;
        rank.expert_major_scatter_on(stream, &self.plan, &self.tokens, out, None)?;
        self.used_on(stream)
    }

    /// Before the flat combine: [`Self::combine_in`] summed from the caller's expert outputs `y`
    /// (`[S x H]` BF16, the dispatch's zones) and, backward, [`Self::combine_weights`]
    /// gathered from the slots' weight gradients `slot_weights` (`[S]` f32), on `stream`.
    pub(crate) fn reduce(
        &self,
        rank: &GpuRank,
        stream: &Arc<CudaStream>,
        y: &DeviceTensor,
        slot_weights: Option<&DeviceTensor>,
    ) -> Res<()> {
        self.require_numbered()?;
        rank.expert_major_reduce_on(stream, &self.plan, y, &self.combine_in)?;
        if let Some(w) = slot_weights {
            rank.expert_major_weights_on(stream, &self.plan, w, &self.combine_weights)?;
        }
        self.used_on(stream)
    }

    /// `ncclInvalidUsage` until a forward dispatch on the handle numbered the slots (a combine
    /// or backward dispatch reads the zones through them).
    pub(crate) fn require_numbered(&self) -> Res<()> {
        if self.numbered.load(Ordering::Acquire) {
            return Ok(());
        }
        Err(Fail::usage(
            "no forward dispatch on this high-throughput expert-major handle yet: its slots are numbered from the forward dispatch's rows (dispatch forward first, after each ncclEpUpdateHandle)",
        ))
    }

    /// Records the buffers' last use on `stream`, after the work just enqueued there (the
    /// scatter or reduce kernels, and a combine's send that reads [`Self::combine_in`]).
    pub(crate) fn used_on(&self, stream: &Arc<CudaStream>) -> Res<()> {
        self.last_use.record(stream)
    }

    /// Before a dispatch or combine of the handle on `stream` uses these buffers: `stream` waits
    /// for the last use enqueued on another stream (a no-op on the same one).
    pub(crate) fn wait_on(&self, stream: &Arc<CudaStream>) -> Res<()> {
        self.last_use.wait_on(stream)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use epflow_core::Algorithm::{HighThroughput as Ht, LowLatency as Ll};

    #[test]
    fn only_high_throughput_expert_major_has_zones_and_their_alignment_is_checked() {
        let cfg = |a| ep::NcclEpHandleConfig { dispatch_output_per_expert_alignment: a, ..Default::default() };
        assert_eq!(alignment_of(Ht, ep::NCCL_EP_LAYOUT_EXPERT_MAJOR, None), Ok(Some(0)));
        assert_eq!(alignment_of(Ht, ep::NCCL_EP_LAYOUT_EXPERT_MAJOR, Some(&cfg(64))), Ok(Some(64)));
        assert_eq!(alignment_of(Ht, ep::NCCL_EP_LAYOUT_FLAT, Some(&cfg(64))), Ok(None));
        assert_eq!(alignment_of(Ll, ep::NCCL_EP_LAYOUT_EXPERT_MAJOR, Some(&cfg(64))), Ok(None));
        let e = alignment_of(Ht, ep::NCCL_EP_LAYOUT_EXPERT_MAJOR, Some(&cfg(48))).unwrap_err();
        assert_eq!(e.code, ep::NCCL_INVALID_ARGUMENT);
        assert!(e.message.contains("dispatch_output_per_expert_alignment"), "{}", e.message);
    }
}

//! A rank's NCCL transport ([`NcclShared`]): its communicators (of the whole group, or a pair
//! per peer under rank masking), which peers use them, and the staging memory NCCL moves.

use std::sync::Arc;

use cudarc::driver::CudaContext;
use epflow_core::Error;

use super::nccl::{NcclComms, exchange_row_words};
use super::nccl_pairs::NcclPairs;
use crate::device::{DeviceBuffer, LocalAllocator, PinnedBuffer};
use crate::layout::BufferLayout;

/// A rank's NCCL transport: its communicators, which peers use them, and its staging memory.
#[derive(Debug)]
pub(crate) struct NcclShared {
    /// The communicators of the whole group ([`NcclComms::none`] under rank masking).
    pub comms: NcclComms,
    /// Under rank masking: a communicator per pair of ranks, so a dead peer stalls only its
    /// own exchanges (`transport/nccl_pairs.rs`).
    pub pairs: Option<NcclPairs>,
    /// Bit `r`: rank `r` is reached through NCCL.
    pub mask: u32,
    /// Low-latency: per buffer set, the dispatch staging (`[R x M]` messages).
    pub disp_out: Vec<DeviceBuffer>,
    /// Low-latency: per buffer set, the combine staging (`[R x M*K]` rows).
    pub comb_out: Vec<DeviceBuffer>,
    /// Low-latency: per buffer set, the combine rows NCCL delivers (`[M*K]` rows).
    pub comb_in: Vec<DeviceBuffer>,
    /// Low-latency: per buffer set, rows per NCCL source for combine (`[R]` int32, mapped).
    pub counts: Vec<PinnedBuffer>,
    /// High-throughput: the count exchange's messages and what arrives (`[R x words + 2]`).
    pub handle_msgs: DeviceBuffer,
    pub handle_out: DeviceBuffer,
}

impl NcclShared {
    /// Allocates what `layout` needs for the peers in `mask` (staging NCCL moves, never mapped
    /// by peers: from `local` when given).
    pub(crate) fn new(
        ctx: &Arc<CudaContext>,
        layout: &BufferLayout,
        (comms, pairs): (NcclComms, Option<NcclPairs>),
        mask: u32,
        num_ranks: usize,
        local: Option<&Arc<dyn LocalAllocator>>,
    ) -> Result<Self, Error> {
        let zeroed = |bytes: usize| DeviceBuffer::zeroed_with(ctx, bytes, local);
        let per_set =
            |sets: usize, bytes: usize| (0..sets).map(|_| zeroed(bytes.max(1))).collect::<Result<Vec<_>, _>>();
        let mut s = NcclShared {
            comms,
            pairs,
            mask,
            disp_out: Vec::new(),
            comb_out: Vec::new(),
            comb_in: Vec::new(),
            counts: Vec::new(),
            handle_msgs: zeroed(8)?,
            handle_out: zeroed(8)?,
        };
        match layout {
            BufferLayout::Ll(l) => {
                s.disp_out = per_set(l.sets, l.dispatch_recv_set_bytes())?;
                s.comb_out = per_set(l.sets, num_ranks * l.combine_recv_set_bytes())?;
                s.comb_in = per_set(l.sets, l.combine_recv_set_bytes())?;
                s.counts = (0..l.sets).map(|_| PinnedBuffer::zeroed(ctx, num_ranks * 4)).collect::<Result<_, _>>()?;
            }
            BufferLayout::Ht(h) => {
                let bytes = num_ranks * exchange_row_words(h.exchange_words()) * 4;
                s.handle_msgs = zeroed(bytes)?;
                s.handle_out = zeroed(bytes)?;
            }
        }
        Ok(s)
    }

    /// Whether rank `r` is reached through NCCL.
    pub(crate) fn via_nccl(&self, r: usize) -> bool {
        self.mask >> r & 1 == 1
    }

    /// The peers reached through NCCL, ascending.
    pub(crate) fn peers(&self, num_ranks: usize) -> impl Iterator<Item = usize> + '_ {
        (0..num_ranks).filter(|&r| self.via_nccl(r))
    }
}

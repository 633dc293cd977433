//! API v2's `recv_topk_idx_kind` GLOBAL: epflow's kernels write the receiving rank's local
//! expert ids into a dispatch's `outputs.topk_idx`; for GLOBAL they become global ones
//! (`rank * L + local`, `-1` kept) on the caller's stream right after the receive, before anything
//! the caller enqueues later.

use std::sync::Arc;

use cudarc::driver::CudaStream;
use epflow_kernels::{DeviceTensor, GpuRank};

use crate::status::Res;

/// The rewrite of one dispatch's received ids, enqueued after its receive.
#[derive(Debug)]
pub(crate) struct Globalize {
    /// The caller's `outputs.topk_idx`, the rows epflow writes (`[rows x K]`, int32 or int64).
    pub(crate) ids: DeviceTensor,
    /// Low-latency rank-major: `layout_info.src_rank_counters` and `M`, the rows per source; only
    /// the received rows of each source's block change. `None`: every row of `ids` is live.
    pub(crate) counts: Option<(DeviceTensor, usize)>,
    /// This rank times its local experts.
    pub(crate) offset: i64,
}

impl Globalize {
    /// Enqueues the rewrite on `stream` (after the work enqueued there so far).
    pub(crate) fn enqueue(&self, rank: &GpuRank, stream: &Arc<CudaStream>) -> Res<()> {
        let counts = self.counts.as_ref().map(|(c, per_source)| (c, *per_source));
        rank.globalize_expert_ids_on(stream, &self.ids, counts, self.offset)?;
        Ok(())
    }
}

//! Host routing handles.

use std::sync::{Arc, OnceLock};

use crate::routing::{HtRecvLayout, LlRecvLayout, Routing, SendPlan};

/// A routing handle on the host backend: one rank's validated `topk_idx`, its send plan, and
/// the receive layouts learnt by collectives. Cheap to clone; serves one forward
/// dispatch/combine pair and, for high-throughput, the backward pair.
#[derive(Clone, Debug)]
pub struct HostHandle(pub(crate) Arc<HandleInner>);

#[derive(Debug)]
pub(crate) struct HandleInner {
    pub(crate) group_id: u64,
    pub(crate) routing: Routing,
    pub(crate) plan: SendPlan,
    /// High-throughput: what this rank receives, from the handle's count exchange.
    pub(crate) ht: Option<HtRecvLayout>,
    /// Low-latency: what this rank received, set when a dispatch on this handle completes.
    pub(crate) ll: OnceLock<LlRecvLayout>,
}

impl HostHandle {
    /// `B`, tokens this rank routes.
    pub fn num_tokens(&self) -> usize {
        self.0.routing.num_tokens()
    }

    /// `K`.
    pub fn top_k(&self) -> usize {
        self.0.routing.top_k()
    }

    /// The validated routing.
    pub fn routing(&self) -> &Routing {
        &self.0.routing
    }

    /// High-throughput: `N`, the rows this rank will receive (NCCL EP's
    /// `ncclEpHandleGetNumRecvTokens`). `None` for low-latency handles.
    pub fn num_recv_tokens(&self) -> Option<usize> {
        self.0.ht.as_ref().map(HtRecvLayout::num_rows)
    }

    /// High-throughput: tokens this rank will receive per local expert (`[L]`).
    pub fn recv_expert_counts(&self) -> Option<&[i32]> {
        self.0.ht.as_ref().map(HtRecvLayout::expert_counts)
    }

    /// Low-latency: the receive layout of the completed dispatch on this handle.
    pub fn ll_layout(&self) -> Option<&LlRecvLayout> {
        self.0.ll.get()
    }

    /// High-throughput: the receive layout.
    pub fn ht_layout(&self) -> Option<&HtRecvLayout> {
        self.0.ht.as_ref()
    }
}

//! Host routing handles.

use std::sync::{Arc, Mutex};

use crate::handle::{HandleCore, RoutingHandle};
use crate::routing::{HtRecvLayout, LlRecvLayout, RankRecvLayout, SendPlan};

/// A routing handle on the host backend: one rank's validated routing, its send plan, and the
/// receive layouts learnt by collectives. Cheap to clone. It serves any number of
/// dispatch/combine pairs (forward and, for high-throughput, backward); a combine pairs with
/// the latest completed dispatch (of either pass in high-throughput, [`crate::handle`]).
#[derive(Clone, Debug)]
pub struct HostHandle(pub(crate) Arc<HostHandleState>);

#[derive(Debug)]
pub(crate) struct HostHandleState {
    pub(crate) core: HandleCore,
    pub(crate) plan: SendPlan,
    /// High-throughput: what this rank receives, from the handle's count exchange.
    pub(crate) ht: Option<HtRecvLayout>,
    /// Low-latency: what this rank received in the latest completed dispatch on this handle,
    /// with that dispatch's number.
    pub(crate) ll: Mutex<Option<(u64, Arc<LlRecvLayout>)>>,
    /// Low-latency rank-major: the same, per source rank.
    pub(crate) rank_major: Mutex<Option<(u64, Arc<RankRecvLayout>)>>,
}

impl HostHandle {
    pub(crate) fn new(core: HandleCore, plan: SendPlan, ht: Option<HtRecvLayout>) -> Self {
        HostHandle(Arc::new(HostHandleState { core, plan, ht, ll: Mutex::new(None), rank_major: Mutex::new(None) }))
    }

    /// Low-latency: the receive layout of the latest completed dispatch on this handle.
    pub fn ll_layout(&self) -> Option<Arc<LlRecvLayout>> {
        self.ll_layout_with_seq().map(|(_, l)| l)
    }

    /// The latest low-latency receive layout with the number of its dispatch.
    pub(crate) fn ll_layout_with_seq(&self) -> Option<(u64, Arc<LlRecvLayout>)> {
        self.0.ll.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Records the layout dispatch `seq` received (kept if no later dispatch recorded one).
    pub(crate) fn set_ll_layout(&self, seq: u64, layout: LlRecvLayout) {
        let mut ll = self.0.ll.lock().unwrap_or_else(|e| e.into_inner());
        if ll.as_ref().is_none_or(|(s, _)| *s < seq) {
            *ll = Some((seq, Arc::new(layout)));
        }
    }

    /// Low-latency rank-major: the receive layout of the latest completed dispatch on this
    /// handle, with the number of its dispatch.
    pub fn rank_major_layout(&self) -> Option<(u64, Arc<RankRecvLayout>)> {
        self.0.rank_major.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Records the rank-major layout dispatch `seq` received (kept if no later dispatch
    /// recorded one).
    pub(crate) fn set_rank_major_layout(&self, seq: u64, layout: RankRecvLayout) {
        let mut rm = self.0.rank_major.lock().unwrap_or_else(|e| e.into_inner());
        if rm.as_ref().is_none_or(|(s, _)| *s < seq) {
            *rm = Some((seq, Arc::new(layout)));
        }
    }

    /// High-throughput: the receive layout.
    pub fn ht_layout(&self) -> Option<&HtRecvLayout> {
        self.0.ht.as_ref()
    }
}

impl RoutingHandle for HostHandle {
    fn core(&self) -> &HandleCore {
        &self.0.core
    }
}

//! What every backend's routing handle shares: the validated routing, the group it belongs to,
//! the collective that created it (high-throughput), and the dispatches that completed on it:
//! the facts that decide what a combine on the handle pairs with ([`crate::stamp`]).
//!
//! ## Reuse
//!
//! A handle may serve any number of dispatch/combine pairs, one after the other (`epflow bench`
//! reuses one): a low-latency combine pairs with the **latest dispatch on the handle that
//! completed before the combine started**. A high-throughput combine sends along the handle's
//! rows, which both passes share: it needs a completed dispatch of either pass on the handle, so
//! a backward combine may follow the forward pair directly (NCCL EP's cached mode). Ranks that
//! pair differently (one reuses a handle while a peer routes anew, or two handles combined in
//! swapped order) get [`crate::Error::PeerMismatch`] from the combine, never another dispatch's
//! rows.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::config::Algorithm;
use crate::error::ValidationError;
use crate::ops::{Layout, Pass, RecvRows};
use crate::routing::Routing;
use crate::stamp::{Pairing, Stamp};

/// The backend-independent part of a routing handle.
#[derive(Debug)]
pub struct HandleCore {
    group_id: u64,
    /// `(B, K)`.
    shape: (usize, usize),
    /// The validated routing, where the host holds it (`None` for handles built on a device).
    routing: Option<Routing>,
    algorithm: Algorithm,
    layout: Layout,
    creation: Option<u64>,
    /// High-throughput: `N` and the rows per local expert, from handle creation (set once,
    /// possibly after the handle was handed out: [`RecvRows::Bound`]).
    recv: OnceLock<(usize, Vec<i32>)>,
    /// High-throughput [`RecvRows::Bound`]: the rows of the handle's received tensors.
    recv_bound: Option<usize>,
    /// Per pass (forward, backward): 1 + the number of the latest completed dispatch; 0 = none.
    last_dispatch: [AtomicU64; 2],
    /// 1 + the mask epoch ([`crate::mask`]) in which the latest dispatch started; 0 = none.
    mask_epoch: AtomicU64,
}

fn pass_index(pass: Pass) -> usize {
    match pass {
        Pass::Forward => 0,
        Pass::Backward => 1,
    }
}

impl HandleCore {
    /// A handle of group `group_id` for `routing`; `creation` is the number of the collective
    /// that created it (high-throughput handle creation; `None` for low-latency handles, which
    /// are built locally).
    pub fn new(group_id: u64, routing: Routing, algorithm: Algorithm, creation: Option<u64>) -> Self {
        let shape = (routing.num_tokens(), routing.top_k());
        HandleCore::with_shape(group_id, shape, Some(routing), algorithm, creation)
    }

    /// A handle of group `group_id` whose routing of `num_tokens x top_k` was validated on a
    /// device and stays there (a high-throughput handle built by kernels): the host never sees
    /// `topk_idx`, and [`HandleCore::routing`] is `None`.
    pub fn on_device(
        group_id: u64,
        num_tokens: usize,
        top_k: usize,
        algorithm: Algorithm,
        creation: Option<u64>,
    ) -> Self {
        HandleCore::with_shape(group_id, (num_tokens, top_k), None, algorithm, creation)
    }

    fn with_shape(
        group_id: u64,
        shape: (usize, usize),
        routing: Option<Routing>,
        algorithm: Algorithm,
        creation: Option<u64>,
    ) -> Self {
        HandleCore {
            group_id,
            shape,
            routing,
            algorithm,
            layout: Layout::ExpertMajor,
            creation,
            recv: OnceLock::new(),
            recv_bound: None,
            last_dispatch: Default::default(),
            mask_epoch: AtomicU64::new(0),
        }
    }

    /// With the low-latency receive layout `layout` (validated by the backend: high-throughput
    /// handles stay expert-major).
    pub fn with_layout(mut self, layout: Layout) -> Self {
        self.layout = layout;
        self
    }

    /// The receive layout of low-latency operations on this handle.
    pub fn layout(&self) -> Layout {
        self.layout
    }

    /// With what handle creation learnt (high-throughput): `num_recv` rows this rank receives,
    /// `expert_counts` of them per local expert (`[L]`).
    pub fn with_recv(self, num_recv: usize, expert_counts: Vec<i32>) -> Self {
        self.set_recv(num_recv, expert_counts);
        self
    }

    /// Sets what handle creation learnt (see [`HandleCore::with_recv`]); a handle created in
    /// stream order learns it when its creation completes. The first value stays: later calls
    /// do nothing.
    pub fn set_recv(&self, num_recv: usize, expert_counts: Vec<i32>) {
        let _ = self.recv.set((num_recv, expert_counts));
    }

    /// With received tensors of `bound` rows whatever `N` is ([`RecvRows::Bound`]; the backend
    /// computed `bound` from the config).
    pub fn with_recv_bound(mut self, bound: usize) -> Self {
        self.recv_bound = Some(bound);
        self
    }

    /// The rows of the handle's received tensors ([`RecvRows`]).
    pub fn recv_rows_kind(&self) -> RecvRows {
        if self.recv_bound.is_some() { RecvRows::Bound } else { RecvRows::Exact }
    }

    /// High-throughput: the rows of the handle's received tensors: the bound
    /// ([`RecvRows::Bound`]), else `N` once known.
    pub fn recv_rows(&self) -> Option<usize> {
        self.recv_bound.or_else(|| self.recv.get().map(|r| r.0))
    }

    /// The group that created the handle.
    pub fn group_id(&self) -> u64 {
        self.group_id
    }

    /// The validated routing, where the host holds it; `None` for a handle built on a device
    /// (the GPU backend's high-throughput handles over NVLink), whose routing never leaves it.
    pub fn routing(&self) -> Option<&Routing> {
        self.routing.as_ref()
    }

    /// `B`.
    pub fn num_tokens(&self) -> usize {
        self.shape.0
    }

    /// `K`.
    pub fn top_k(&self) -> usize {
        self.shape.1
    }

    /// The number of the handle creation that made it (high-throughput).
    pub fn creation(&self) -> Option<u64> {
        self.creation
    }

    /// [`ValidationError::ForeignHandle`] unless the handle belongs to group `group_id`.
    pub fn check_group(&self, group_id: u64) -> Result<(), ValidationError> {
        if self.group_id == group_id {
            Ok(())
        } else {
            Err(ValidationError::ForeignHandle { handle_group: self.group_id, group: group_id })
        }
    }

    /// Records that a dispatch on this handle starts in mask epoch `epoch` ([`crate::mask`]).
    pub fn record_mask_epoch(&self, epoch: u64) {
        self.mask_epoch.store(epoch + 1, Ordering::Release);
    }

    /// The mask epoch in which the latest dispatch on this handle started, if any.
    pub fn mask_epoch(&self) -> Option<u64> {
        self.mask_epoch.load(Ordering::Acquire).checked_sub(1)
    }

    /// Records that dispatch `seq` (of `pass`) produced its outputs on this handle. The latest
    /// number wins, whatever order completions are recorded in.
    pub fn record_dispatch(&self, pass: Pass, seq: u64) {
        self.last_dispatch[pass_index(pass)].fetch_max(seq + 1, Ordering::AcqRel);
    }

    /// The number of the latest completed dispatch of `pass` on this handle.
    pub fn last_dispatch(&self, pass: Pass) -> Option<u64> {
        self.last_dispatch[pass_index(pass)].load(Ordering::Acquire).checked_sub(1)
    }

    fn pairing(&self, dispatch: u64) -> Pairing {
        match (self.algorithm, self.creation) {
            (Algorithm::HighThroughput, Some(h)) => Pairing::Handle(h),
            (Algorithm::HighThroughput, None) => Pairing::None,
            (Algorithm::LowLatency, _) => Pairing::Dispatch(dispatch),
        }
    }

    /// The stamp of a dispatch of `pass` on this handle.
    pub fn dispatch_stamp(&self, pass: Pass) -> Stamp {
        let pairing = match self.algorithm {
            Algorithm::LowLatency => Pairing::None,
            Algorithm::HighThroughput => self.pairing(0),
        };
        Stamp::new(self.top_k(), pass, pairing).with_layout(self.layout)
    }

    /// The stamp of a combine of `pass` pairing with dispatch `dispatch` (see
    /// [`HandleCore::combine_dispatch`]).
    pub fn combine_stamp(&self, pass: Pass, dispatch: u64) -> Stamp {
        Stamp::new(self.top_k(), pass, self.pairing(dispatch)).with_layout(self.layout)
    }

    /// The dispatch a combine of `pass` started now pairs with: the latest completed one of the
    /// same pass (low-latency), or of either pass (high-throughput, whose rows are the handle's),
    /// or [`ValidationError::CombineBeforeDispatch`].
    pub fn combine_dispatch(&self, pass: Pass) -> Result<u64, ValidationError> {
        let latest = match self.algorithm {
            Algorithm::LowLatency => self.last_dispatch(pass),
            Algorithm::HighThroughput => self.last_dispatch(Pass::Forward).max(self.last_dispatch(Pass::Backward)),
        };
        latest.ok_or(ValidationError::CombineBeforeDispatch)
    }
}

/// What users, the async runtime and the validation need of any backend's handle (in
/// `epflow::prelude`).
pub trait RoutingHandle: Clone + Send + Sync + 'static {
    /// The backend-independent part.
    fn core(&self) -> &HandleCore;
    /// High-throughput: `N`, the rows this rank receives (NCCL EP's
    /// `ncclEpHandleGetNumRecvTokens`), known once the handle exists. `None` for low-latency
    /// handles.
    ///
    /// A handle created in stream order with [`RecvRows::Bound`] learns it when its creation
    /// completes (await the creation's completion first); `None` until then.
    fn num_recv_tokens(&self) -> Option<usize> {
        self.core().recv.get().map(|r| r.0)
    }
    /// High-throughput: rows this rank receives per local expert (`[L]`); like
    /// [`RoutingHandle::num_recv_tokens`], `None` until handle creation completed.
    fn recv_expert_counts(&self) -> Option<&[i32]> {
        self.core().recv.get().map(|r| r.1.as_slice())
    }
    /// High-throughput: the rows of the tensors operations on the handle receive (dispatch
    /// outputs, combine inputs): `N`, or the group's bound for a [`RecvRows::Bound`] handle.
    fn recv_rows(&self) -> Option<usize> {
        self.core().recv_rows()
    }
    /// `B`, tokens this rank routes.
    fn num_tokens(&self) -> usize {
        self.core().num_tokens()
    }
    /// `K`.
    fn top_k(&self) -> usize {
        self.core().top_k()
    }
    /// The validated routing, where the host holds it: `None` for handles built on a device
    /// (see [`HandleCore::routing`]).
    fn routing(&self) -> Option<&Routing> {
        self.core().routing()
    }
    /// The receive layout of low-latency operations on the handle.
    fn layout(&self) -> Layout {
        self.core().layout()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn core(algorithm: Algorithm, creation: Option<u64>) -> HandleCore {
        HandleCore::new(7, Routing::new(vec![0, 1, 2, 3], 2, 2, 4).unwrap(), algorithm, creation)
    }

    #[test]
    fn combine_pairs_with_the_latest_completed_dispatch() {
        let h = core(Algorithm::LowLatency, None);
        assert_eq!(h.combine_dispatch(Pass::Forward), Err(ValidationError::CombineBeforeDispatch));
        h.record_dispatch(Pass::Forward, 4);
        h.record_dispatch(Pass::Forward, 2); // completed later, started earlier: 4 stays
        assert_eq!(h.combine_dispatch(Pass::Forward), Ok(4));
        assert_eq!(h.combine_stamp(Pass::Forward, 4), Stamp::new(2, Pass::Forward, Pairing::Dispatch(4)));
        assert_eq!(h.dispatch_stamp(Pass::Forward), Stamp::new(2, Pass::Forward, Pairing::None));
        assert_eq!(h.combine_dispatch(Pass::Backward), Err(ValidationError::CombineBeforeDispatch));
        assert_eq!(h.check_group(8), Err(ValidationError::ForeignHandle { handle_group: 7, group: 8 }));
        // The layout travels in every stamp: peers on handles of other layouts disagree.
        let rm = core(Algorithm::LowLatency, None).with_layout(Layout::RankMajor);
        assert_eq!(rm.dispatch_stamp(Pass::Forward).layout, Layout::RankMajor);
        assert_ne!(rm.dispatch_stamp(Pass::Forward), h.dispatch_stamp(Pass::Forward));
    }

    #[derive(Clone)]
    struct Handle(std::sync::Arc<HandleCore>);

    impl RoutingHandle for Handle {
        fn core(&self) -> &HandleCore {
            &self.0
        }
    }

    #[test]
    fn high_throughput_handles_know_what_they_receive() {
        let h = Handle(std::sync::Arc::new(core(Algorithm::HighThroughput, Some(0)).with_recv(5, vec![3, 4])));
        assert_eq!((h.num_recv_tokens(), h.recv_expert_counts()), (Some(5), Some(&[3, 4][..])));
        assert_eq!((h.num_tokens(), h.top_k()), (2, 2));
        let l = Handle(std::sync::Arc::new(core(Algorithm::LowLatency, None)));
        assert_eq!((l.num_recv_tokens(), l.recv_expert_counts()), (None, None));
    }

    #[test]
    fn bound_handles_have_bound_rows_and_learn_n_once() {
        let h = Handle(std::sync::Arc::new(core(Algorithm::HighThroughput, Some(0)).with_recv_bound(8)));
        assert_eq!((h.recv_rows(), h.num_recv_tokens(), h.core().recv_rows_kind()), (Some(8), None, RecvRows::Bound));
        h.core().set_recv(5, vec![3, 2]);
        h.core().set_recv(6, vec![6, 0]);
        assert_eq!((h.recv_rows(), h.num_recv_tokens(), h.recv_expert_counts()), (Some(8), Some(5), Some(&[3, 2][..])));
        let e = Handle(std::sync::Arc::new(core(Algorithm::HighThroughput, Some(1))));
        assert_eq!((e.recv_rows(), e.core().recv_rows_kind()), (None, RecvRows::Exact));
        e.core().set_recv(4, vec![4, 0]);
        assert_eq!(e.recv_rows(), Some(4));
    }

    #[test]
    fn high_throughput_stamps_name_the_handle() {
        let h = core(Algorithm::HighThroughput, Some(3));
        h.record_dispatch(Pass::Forward, 0);
        assert_eq!(h.dispatch_stamp(Pass::Backward), Stamp::new(2, Pass::Backward, Pairing::Handle(3)));
        assert_eq!(h.combine_stamp(Pass::Forward, 0), Stamp::new(2, Pass::Forward, Pairing::Handle(3)));
    }

    #[test]
    fn a_high_throughput_combine_pairs_with_a_dispatch_of_either_pass() {
        let h = core(Algorithm::HighThroughput, Some(3));
        for pass in [Pass::Forward, Pass::Backward] {
            assert_eq!(h.combine_dispatch(pass), Err(ValidationError::CombineBeforeDispatch));
        }
        h.record_dispatch(Pass::Forward, 5);
        assert_eq!(h.combine_dispatch(Pass::Backward), Ok(5));
        h.record_dispatch(Pass::Backward, 6);
        assert_eq!(h.combine_dispatch(Pass::Forward), Ok(6));
        // Low-latency has one pass: a backward combine never pairs.
        let l = core(Algorithm::LowLatency, None);
        l.record_dispatch(Pass::Forward, 1);
        assert_eq!(l.combine_dispatch(Pass::Backward), Err(ValidationError::CombineBeforeDispatch));
    }
}

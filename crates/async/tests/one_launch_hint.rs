//! The driver tells a backend when the complete half will follow the send at once
//! (`PendingOp::will_complete_at_once`, which lets the GPU backend run both halves as one
//! launch): for an operation awaited directly, and never for a staged one (`send_only`), whose
//! complete half comes later, nor for one completed in stream order.

mod common;

use std::sync::{Arc, Mutex};

use epflow_async::Group;
use epflow_core::backend::{Backend, HandleCreation, OpId, OpOutput, PendingOp, Probe, RankCore};
use epflow_core::handle::{HandleCore, RoutingHandle};
use epflow_core::ops::{CombineInputs, CombineOptions, DispatchInputs, DispatchOptions};
use epflow_core::protocol::{Channel, SlotGuard};
use epflow_core::routing::Routing;
use epflow_core::{Algorithm, GroupConfig, HostTensor, Result, bf16};

use common::tokio_rt;

/// What each operation was told before its send: (sequence number, told to complete at once).
type Log = Arc<Mutex<Vec<(u64, bool)>>>;

/// A one-rank backend whose operations complete at once and log the hint.
#[derive(Debug)]
struct Recording {
    core: RankCore,
    log: Log,
}

#[derive(Clone, Debug)]
struct RecHandle(Arc<HandleCore>);

impl RoutingHandle for RecHandle {
    fn core(&self) -> &HandleCore {
        &self.0
    }
    fn num_recv_tokens(&self) -> Option<usize> {
        None
    }
    fn recv_expert_counts(&self) -> Option<&[i32]> {
        None
    }
}

#[derive(Debug)]
struct RecOp {
    seq: u64,
    at_once: bool,
    sent: bool,
    log: Log,
}

impl PendingOp for RecOp {
    type Stream = ();
    type Output = OpOutput<RecHandle, (), ()>;
    fn id(&self) -> OpId {
        OpId { rank: 0, channel: Channel::Dispatch, seq: self.seq }
    }
    fn needs_slot(&self) -> bool {
        false
    }
    fn poll_send_ready(&mut self) -> Result<bool> {
        Ok(true)
    }
    fn send(&mut self, _: Option<SlotGuard>) -> Result<()> {
        self.sent = true;
        self.log.lock().unwrap().push((self.seq, self.at_once));
        Ok(())
    }
    fn is_sent(&self) -> bool {
        self.sent
    }
    fn cancel(&mut self) {}
    fn will_complete_at_once(&mut self) {
        assert!(!self.sent, "told after its send");
        self.at_once = true;
    }
    fn start_complete(&mut self) -> Result<()> {
        Ok(())
    }
    fn poll_complete(&mut self) -> Result<bool> {
        Ok(true)
    }
    fn finish(self) -> Result<Self::Output> {
        Ok(OpOutput::Dispatch(()))
    }
    fn complete_on(&mut self, _: &(), _: epflow_core::backend::StreamOrder) -> Result<Option<Self::Output>> {
        Ok(Some(OpOutput::Dispatch(())))
    }
    fn send_probe(&self) -> Box<dyn Probe> {
        Box::new(|| true)
    }
    fn complete_probe(&self) -> Box<dyn Probe> {
        Box::new(|| true)
    }
    fn waiting_for(&self) -> String {
        String::new()
    }
}

impl Backend for Recording {
    type Stream = ();
    type Tensor = HostTensor;
    type Handle = RecHandle;
    type DispatchOutput = ();
    type CombineOutput = ();
    type Op = RecOp;

    fn core(&self) -> &RankCore {
        &self.core
    }
    fn start_handle(
        &self,
        idx: &HostTensor,
        _opts: &epflow_core::ops::HandleOptions,
    ) -> Result<HandleCreation<RecHandle, RecOp>> {
        let routing = Routing::new(idx.as_i64().unwrap().to_vec(), 1, 1, 4)?;
        let core = HandleCore::new(self.core.group_id(), routing, Algorithm::LowLatency, None);
        Ok(HandleCreation::Ready(RecHandle(Arc::new(core))))
    }
    fn start_dispatch(&self, _: &RecHandle, _: DispatchInputs<'_, HostTensor>, _: &DispatchOptions) -> Result<RecOp> {
        let seq = self.core.next_seq(Channel::Dispatch);
        Ok(RecOp { seq, at_once: false, sent: false, log: Arc::clone(&self.log) })
    }
    fn start_combine(&self, _: &RecHandle, _: CombineInputs<'_, HostTensor>, _: &CombineOptions) -> Result<RecOp> {
        unreachable!("the test dispatches only")
    }
}

#[test]
fn only_operations_awaited_directly_are_told_to_complete_at_once() {
    let rt = tokio_rt();
    let log = Log::default();
    let g = Group::new(Recording {
        core: RankCore::new(0, 1, 991, GroupConfig::low_latency(4, 1, 8)),
        log: Arc::clone(&log),
    });
    let x = HostTensor::tokens(1, 8, vec![bf16::ONE; 8]);
    let idx = HostTensor::topk_idx(1, 1, vec![0]);
    rt.block_on(async {
        let h = g.create_handle(&idx).await.unwrap();
        // #0: awaited directly.
        g.dispatch(&h, DispatchInputs::new(&x)).await.unwrap();
        // #1: staged; its complete half is awaited later.
        let staged = g.dispatch(&h, DispatchInputs::new(&x)).send_only().await.unwrap();
        staged.await.unwrap();
        // #2: staged, then completed in stream order.
        let staged = g.dispatch(&h, DispatchInputs::new(&x)).send_only().await.unwrap();
        drop(staged.complete_on(&()).await.unwrap());
        // #3: awaited directly again.
        g.dispatch(&h, DispatchInputs::new(&x)).await.unwrap();
    });
    assert_eq!(*log.lock().unwrap(), vec![(0, true), (1, false), (2, false), (3, true)]);
}

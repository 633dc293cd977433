//! [`Stub`]: a one-rank backend for tests of the driver itself. Handles are built locally,
//! every operation is ready at once, and [`StubHooks`] sees its send (with whether it was told
//! to complete at once) and its finish.

use std::sync::Arc;

use epflow_core::backend::{Backend, HandleCreation, OpId, OpOutput, PendingOp, Probe, RankCore, StreamOrder};
use epflow_core::handle::{HandleCore, RoutingHandle};
use epflow_core::ops::{CombineInputs, CombineOptions, DispatchInputs, DispatchOptions, HandleOptions};
use epflow_core::protocol::{Channel, SlotGuard};
use epflow_core::routing::Routing;
use epflow_core::{Algorithm, GroupConfig, HostTensor, Result};

/// What a test observes of the stub's operations.
pub(crate) trait StubHooks: std::fmt::Debug + Send + Sync + 'static {
    /// Operation `seq` of `channel` sent; `at_once`: it was told to complete at once first.
    fn sent(&self, channel: Channel, seq: u64, at_once: bool) {
        let _ = (channel, seq, at_once);
    }
    /// Operation `seq` of `channel` is finishing (may panic: a stand-in for a backend bug).
    fn finishing(&self, channel: Channel, seq: u64) {
        let _ = (channel, seq);
    }
}

/// The stub backend (rank 0 of 1, 4 experts, 1 token, hidden 8).
#[derive(Debug)]
pub(crate) struct Stub<H: StubHooks> {
    core: RankCore,
    hooks: Arc<H>,
}

impl<H: StubHooks> Stub<H> {
    /// Group `group_id`'s only rank, reporting to `hooks`.
    pub(crate) fn new(group_id: u64, hooks: Arc<H>) -> Self {
        Stub { core: RankCore::new(0, 1, group_id, GroupConfig::low_latency(4, 1, 8)), hooks }
    }

    fn op(&self, channel: Channel) -> StubOp<H> {
        StubOp {
            channel,
            seq: self.core.next_seq(channel),
            at_once: false,
            sent: false,
            hooks: Arc::clone(&self.hooks),
        }
    }
}

/// A handle of the stub.
#[derive(Clone, Debug)]
pub(crate) struct StubHandle(Arc<HandleCore>);

impl RoutingHandle for StubHandle {
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

/// An operation of the stub.
#[derive(Debug)]
pub(crate) struct StubOp<H: StubHooks> {
    channel: Channel,
    seq: u64,
    at_once: bool,
    sent: bool,
    hooks: Arc<H>,
}

impl<H: StubHooks> PendingOp for StubOp<H> {
    type Stream = ();
    type Output = OpOutput<StubHandle, (), ()>;
    fn id(&self) -> OpId {
        OpId { rank: 0, channel: self.channel, seq: self.seq }
    }
    fn needs_slot(&self) -> bool {
        false
    }
    fn poll_send_ready(&mut self) -> Result<bool> {
        Ok(true)
    }
    fn send(&mut self, _: Option<SlotGuard>) -> Result<()> {
        self.sent = true;
        self.hooks.sent(self.channel, self.seq, self.at_once);
        Ok(())
    }
    fn is_sent(&self) -> bool {
        self.sent
    }
    fn cancel(&mut self) {}
    fn will_complete_at_once(&mut self) {
        assert!(!self.sent, "told to complete at once after its send");
        self.at_once = true;
    }
    fn start_complete(&mut self) -> Result<()> {
        Ok(())
    }
    fn poll_complete(&mut self) -> Result<bool> {
        Ok(true)
    }
    fn finish(self) -> Result<Self::Output> {
        self.hooks.finishing(self.channel, self.seq);
        Ok(match self.channel {
            Channel::Combine => OpOutput::Combine(()),
            _ => OpOutput::Dispatch(()),
        })
    }
    fn complete_on(&mut self, _: &(), _: StreamOrder) -> Result<Option<Self::Output>> {
        self.hooks.finishing(self.channel, self.seq);
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

impl<H: StubHooks> Backend for Stub<H> {
    type Stream = ();
    type Tensor = HostTensor;
    type Handle = StubHandle;
    type DispatchOutput = ();
    type CombineOutput = ();
    type Op = StubOp<H>;

    fn core(&self) -> &RankCore {
        &self.core
    }
    fn start_handle(&self, idx: &HostTensor, _opts: &HandleOptions) -> Result<HandleCreation<StubHandle, StubOp<H>>> {
        let routing = Routing::new(idx.as_i64().unwrap().to_vec(), 1, 1, 4)?;
        let core = HandleCore::new(self.core.group_id(), routing, Algorithm::LowLatency, None);
        Ok(HandleCreation::Ready(StubHandle(Arc::new(core))))
    }
    fn start_dispatch(
        &self,
        _: &StubHandle,
        _: DispatchInputs<'_, HostTensor>,
        _: &DispatchOptions,
    ) -> Result<StubOp<H>> {
        Ok(self.op(Channel::Dispatch))
    }
    fn start_combine(&self, _: &StubHandle, _: CombineInputs<'_, HostTensor>, _: &CombineOptions) -> Result<StubOp<H>> {
        Ok(self.op(Channel::Combine))
    }
}

//! A high-throughput handle being built on the device ([`crate::ht::device`]): its memory, where
//! its arrays lie, and the mapped words its receive kernel writes for the host
//! ([`crate::state::ht_result`]); what the operation finishes into.

use std::sync::{Arc, OnceLock};

use cudarc::driver::CudaEvent;
use epflow_core::handle::HandleCore;
use epflow_core::{Algorithm, Error, ValidationError};

use crate::device::{DeviceBuffer, PinnedBuffer};
use crate::state::handle::{GpuHandle, HandleOffsets, HtHandleInfo, StreamCreation};
use crate::state::ht_result::{RESULT_BUILT, RESULT_HEAD, RESULT_N, invalid_routing_in};
use crate::state::shared::RankShared;

/// A handle being built on the device: its memory, where the arrays lie, and the mapped words
/// the receive kernel writes for the host.
#[derive(Debug)]
pub(crate) struct DevicePlan {
    num_tokens: usize,
    top_k: usize,
    tokens_per_channel: usize,
    off: HandleOffsets,
    mem: Option<DeviceBuffer>,
    result: Option<PinnedBuffer>,
    /// `RecvRows::Bound`: the rows of the handle's received tensors.
    recv_bound: Option<usize>,
}

impl DevicePlan {
    /// The plan of a `num_tokens x top_k` routing in `mem`, its arrays at `off`, the kernels'
    /// words for the host in `result` (its "built" word zeroed here, before the launch);
    /// `recv_bound`: the received rows of a `RecvRows::Bound` handle.
    pub(crate) fn new(
        num_tokens: usize,
        top_k: usize,
        tokens_per_channel: usize,
        off: HandleOffsets,
        mem: DeviceBuffer,
        result: PinnedBuffer,
        recv_bound: Option<usize>,
    ) -> Self {
        result.write_u64(RESULT_BUILT, 0);
        DevicePlan { num_tokens, top_k, tokens_per_channel, off, mem: Some(mem), result: Some(result), recv_bound }
    }

    /// The routing's first invalid entry, as [`epflow_core::routing::Routing::new`] would name it
    /// (read after the kernels completed).
    pub(crate) fn invalid_routing(&self, num_experts: usize) -> Option<ValidationError> {
        invalid_routing_in(self.result.as_ref()?, self.top_k, num_experts)
    }

    /// Whether the plan kernel reported creation `seq` built: its mapped word, written once every
    /// block is done with the plan's arrays (before the kernel ends), so the handle may be
    /// handed out then.
    pub(crate) fn built(&self, seq: u64) -> bool {
        self.result.as_ref().is_some_and(|r| r.read_u64(RESULT_BUILT) == seq + 1)
    }

    /// Whether the handle's received tensors have the bound's rows (`RecvRows::Bound`): only
    /// then may it be handed out before the device built it.
    pub(crate) fn has_bound(&self) -> bool {
        self.recv_bound.is_some()
    }

    fn core(&self, s: &RankShared, seq: u64) -> HandleCore {
        let core = HandleCore::on_device(s.group_id, self.num_tokens, self.top_k, Algorithm::HighThroughput, Some(seq));
        match self.recv_bound {
            Some(b) => core.with_recv_bound(b),
            None => core,
        }
    }

    fn info(&self) -> HtHandleInfo {
        HtHandleInfo {
            tokens_per_channel: self.tokens_per_channel,
            off: self.off,
            send_blocks: Vec::new(),
            recv_blocks: Vec::new(),
            total_send: 0,
        }
    }

    /// The handle, handed out before the device built it (stream-ordered creation `seq`, whose
    /// kernels end at `built`): it keeps the mapped result, which its operations and the
    /// creation's verdict read.
    pub(crate) fn stream_handle(
        &mut self,
        s: &Arc<RankShared>,
        seq: u64,
        built: Arc<CudaEvent>,
    ) -> Result<GpuHandle, Error> {
        let (mem, result) = match (self.mem.take(), self.result.take()) {
            (Some(m), Some(r)) => (m, r),
            _ => return Err(Error::Backend("a device-built handle handed out twice".into())),
        };
        let local = s.layout.ht("a high-throughput handle")?.local_experts;
        let creation = StreamCreation {
            seq,
            built,
            result: Some(result),
            results_pool: Arc::clone(&s.plan_results),
            local,
            failed: OnceLock::new(),
        };
        Ok(GpuHandle::in_stream_order(self.core(s, seq), mem, &s.handle_pool, self.info(), creation))
    }

    /// The handle the kernels built (after they completed with every source's message).
    pub(crate) fn finish(mut self, s: &Arc<RankShared>, seq: u64) -> Result<GpuHandle, Error> {
        let (mem, result) = match (self.mem.take(), self.result.take()) {
            (Some(m), Some(r)) => (m, r),
            _ => return Err(Error::Backend("a device-built handle finished twice".into())),
        };
        let local = s.layout.ht("a high-throughput handle")?.local_experts;
        let num_recv = result.read_u64(RESULT_N) as usize;
        let counts: Vec<i32> = (0..local).map(|l| result.read_u64(RESULT_HEAD + l) as i32).collect();
        s.plan_results.lock().unwrap_or_else(|e| e.into_inner()).push(result);
        let core = self.core(s, seq).with_recv(num_recv, counts);
        Ok(GpuHandle::new(core, mem, &s.handle_pool, Some(self.info()), None, None))
    }

    /// Gives the memory back to the pools (the operation failed or was cancelled).
    pub(crate) fn recycle(&mut self, s: &RankShared) {
        if let Some(m) = self.mem.take() {
            s.handle_pool.lock().unwrap_or_else(|e| e.into_inner()).push(m);
        }
        if let Some(r) = self.result.take() {
            s.plan_results.lock().unwrap_or_else(|e| e.into_inner()).push(r);
        }
    }
}

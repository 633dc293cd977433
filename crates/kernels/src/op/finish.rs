//! What a finished [`GpuOp`] produces: the outcome the device reported (errors, cancelled and
//! mismatched peers) and the output tensors, views into the buffer set or the cached outputs.

use epflow_core::handle::RoutingHandle;
use std::any::Any;
use std::sync::Arc;

use epflow_core::backend::{OpOutput, PendingOp};
use epflow_core::ops::{CombineOutputs, CountsLocation, DispatchOptions, DispatchOutputs};
use epflow_core::protocol::op_label;
use epflow_core::stamp::Stamp;
use epflow_core::validate::{OpContext, dispatch_output_descs};
use epflow_core::{Algorithm, DType, Error, TensorDesc, TensorTag};

use super::{GpuOp, GpuOpKind, GpuOpOutput, Launch};
use crate::device::{DeviceTensor, Lease};
use crate::outputs::{GpuCombineOutput, GpuDispatchOutput, SetLease};
use crate::params::status;
use crate::state::handle::GpuHandle;
use crate::state::ht_exchange::{finish_handle, received_messages, recycle_exchange};

/// What the device reported about one operation's peers.
struct Outcome {
    cancelled: u32,
    mismatched: u32,
    /// Rank masking: the sources the operation skipped (this rank's own bit: the group masked it).
    absent: u32,
    /// The stamp of the lowest mismatched peer.
    theirs: Stamp,
}

impl GpuOp {
    /// The first error the device reported on this rank, as an [`Error`]. A high-throughput
    /// mismatch is not one: the operation that saw it reports it when it finishes, and poisons
    /// the group.
    pub(super) fn device_error(&self) -> Option<Error> {
        self.shared.device_error(self.label())
    }

    /// Whether the device may have finished this operation as far as its outcome word tells:
    /// for a low-latency operation whose receive was enqueued, whether its block 0 published
    /// this operation's outcome (mapped host memory, read without a driver call; written once
    /// every source arrived, a few µs before the kernel ends); `true` for
    /// everything else (the completion event decides).
    pub(super) fn outcome_published(&self) -> bool {
        if !matches!(self.launch, Launch::Ll(_)) || !self.completing || self.uses_nccl() {
            return true;
        }
        let word = self.shared.mem.status.read_u64(status::outcome(self.chan(), self.set()));
        word >> 32 == self.seq + 1
    }

    /// The peers that cancelled or mismatched this operation (0 if the word is another
    /// operation's).
    fn outcome(&self) -> Outcome {
        let st = &self.shared.mem.status;
        let (chan, set) = (self.chan(), self.set());
        let word = st.read_u64(status::outcome(chan, set));
        let ours = word >> 32 == self.seq + 1;
        let (cancelled, absent, mismatched) = if ours {
            ((word & 0xff) as u32, ((word >> 8) & 0xff) as u32, ((word >> 16) & 0xffff) as u32)
        } else {
            (0, 0, 0)
        };
        let theirs = Stamp::decode(if mismatched != 0 { st.read_u64(status::stamp(chan, set)) } else { 0 });
        Outcome { cancelled, mismatched, absent, theirs }
    }

    /// The host saw this low-latency operation finish: later operations on its handle need not
    /// wait for it on the device.
    fn settle_row_map(&self) {
        match &self.kind {
            Some(GpuOpKind::Dispatch { handle, .. }) => {
                let mut map = handle.row_map();
                if map.writer == Some(self.seq) {
                    map.writer_event = None;
                }
            }
            Some(GpuOpKind::Combine { handle, .. }) => {
                if let Some(n) = self.reader {
                    let mut map = handle.row_map();
                    map.readers_done = map.readers_done.max(n);
                }
            }
            _ => {}
        }
    }

    fn view(&self, ptr: u64, desc: TensorDesc, lease: &Arc<SetLease>) -> DeviceTensor {
        let keep = self.shared.clone() as Arc<dyn Any + Send + Sync>;
        DeviceTensor::leased(ptr, self.shared.device, desc, keep, Arc::clone(lease) as Arc<dyn Lease>)
    }

    /// The lease of this low-latency operation's buffer set, for its outputs. The operation keeps
    /// a share until it is dropped, so the set is not reused before its verdict is read.
    fn set_lease(&mut self) -> Arc<SetLease> {
        let lease = SetLease::new(&self.shared.events, self.state.take_slot());
        self.lease = Some(Arc::clone(&lease));
        lease
    }

    /// What the peers reported about this operation: a cancellation, or a mismatch (a
    /// high-throughput mismatch also poisons the group: the two ranks' rings disagree).
    pub(super) fn peer_verdict(&self) -> Result<(), Error> {
        let outcome = self.outcome();
        let me = self.shared.rank;
        if (outcome.absent >> me) & 1 == 1 {
            return Err(Error::RankMasked { op: self.label(), rank: me });
        }
        if outcome.cancelled != 0 {
            return Err(Error::PeerCancelled { op: self.label(), peer: outcome.cancelled.trailing_zeros() as usize });
        }
        if outcome.mismatched != 0 {
            let e = Error::PeerMismatch {
                op: self.label(),
                peer: outcome.mismatched.trailing_zeros() as usize,
                ours: self.stamp,
                theirs: outcome.theirs,
            };
            if matches!(self.launch, super::Launch::Ht(_)) {
                self.shared.poison.poison(format!("{e} (the high-throughput rings of the two ranks disagree)"));
            }
            return Err(e);
        }
        Ok(())
    }

    /// After a stream-ordered completion's outputs were handed out and the device finished: the
    /// peers' verdict (the row map settles too).
    pub(super) fn stream_verdict(&mut self) -> Result<(), Error> {
        self.settle_row_map();
        match &self.kind {
            Some(GpuOpKind::HtStreamHandle(h)) => {
                let h = h.clone();
                let verdict = self.stream_handle_verdict(&h);
                if let Err(e) = &verdict {
                    h.set_creation_error(e);
                }
                verdict
            }
            Some(GpuOpKind::HtDispatch { handle, .. } | GpuOpKind::HtCombine { handle, .. }) => {
                let handle = handle.clone();
                self.peer_verdict()?;
                handle.check_built(&self.label())
            }
            Some(GpuOpKind::Dispatch { handle, .. }) => {
                let handle = handle.clone();
                self.routing_verdict(&handle)?;
                self.peer_verdict()
            }
            _ => self.peer_verdict(),
        }
    }

    /// A low-latency dispatch on a handle created in stream order: the routing as the device
    /// judged it (the handle's kernel, or the dispatches that read it; its first invalid entry is
    /// this rank's error; the peers received the sanitized rows). `Ok` for every other handle.
    fn routing_verdict(&self, handle: &GpuHandle) -> Result<(), Error> {
        match handle.ll_invalid_routing(self.shared.config.num_experts) {
            Some(e) => Err(e.into()),
            None => Ok(()),
        }
    }

    /// A handle created in stream order, once its kernels ended: this rank's routing as the
    /// device judged it, the peers' verdict, and what it receives.
    fn stream_handle_verdict(&self, h: &GpuHandle) -> Result<(), Error> {
        if let Some(e) = h.creation_invalid_routing(self.shared.config.num_experts) {
            return Err(e.into());
        }
        self.peer_verdict()?;
        if h.settle_recv() {
            Ok(())
        } else {
            Err(Error::Backend(format!("{}: the device did not build the handle", self.label())))
        }
    }

    /// The outputs of an operation whose kernels are enqueued but may not have run
    /// (stream-ordered completion): a low-latency one's, a high-throughput dispatch's or
    /// combine's, or a handle built on the device.
    pub(super) fn stream_outputs(&mut self) -> Result<GpuOpOutput, Error> {
        let (channel, seq) = (self.channel, self.seq);
        let twice = move || Error::Backend(format!("{} finished twice", op_label(channel, seq)));
        match &mut self.kind {
            Some(GpuOpKind::Dispatch { handle, opts }) => {
                let (handle, opts) = (handle.clone(), *opts);
                Ok(OpOutput::Dispatch(self.ll_dispatch(&handle, opts)?))
            }
            Some(GpuOpKind::Combine { handle, .. }) => {
                let handle = handle.clone();
                Ok(OpOutput::Combine(self.ll_combine(&handle)))
            }
            Some(GpuOpKind::HtDeviceHandle(_)) => {
                let Some(GpuOpKind::HtDeviceHandle(mut plan)) = self.kind.take() else { unreachable!() };
                let built = self.work.done().cloned().ok_or_else(|| Error::Backend("no completion event".into()))?;
                let h = plan.stream_handle(&self.shared, self.seq, built)?;
                self.kind = Some(GpuOpKind::HtStreamHandle(h.clone()));
                Ok(OpOutput::Handle(h))
            }
            Some(GpuOpKind::HtDispatch { handle, pass, outputs }) => {
                let (outputs, _) = *outputs.take().ok_or_else(twice)?;
                handle.0.core.record_dispatch(*pass, self.seq);
                let ctx = Arc::clone(&self.shared.ctx);
                Ok(OpOutput::Dispatch(GpuDispatchOutput { outputs, host_counts: None, elapsed: None, ctx }))
            }
            Some(GpuOpKind::HtCombine { outputs, .. }) => {
                let outputs = outputs.take().ok_or_else(twice)?;
                let ctx = Arc::clone(&self.shared.ctx);
                Ok(OpOutput::Combine(GpuCombineOutput { outputs, elapsed: None, ctx }))
            }
            _ => Err(Error::Backend(format!("{} cannot complete in stream order", self.label()))),
        }
    }

    /// The result of a finished operation, from what it is.
    pub(super) fn finish_kind(&mut self) -> Result<GpuOpOutput, Error> {
        self.settle_row_map();
        let mut kind = self.kind.take();
        // A count exchange: read what arrived, and give the staging buffers back.
        let received = match &mut kind {
            Some(GpuOpKind::HtHandle { bufs, .. }) => bufs.take().map(|b| {
                let r = received_messages(&self.shared, &b, self.seq);
                recycle_exchange(&self.shared, b);
                r
            }),
            _ => None,
        };
        // A handle built on the device: its routing was validated there (an invalid one went
        // out as a cancellation); on any failure its memory goes back to the pools.
        let invalid = match &mut kind {
            Some(GpuOpKind::HtDeviceHandle(plan)) => {
                let invalid = plan.invalid_routing(self.shared.config.num_experts);
                let cancelled = self.state.is_cancelled() || self.refused.is_some();
                if invalid.is_some() || cancelled {
                    plan.recycle(&self.shared);
                }
                invalid
            }
            _ => None,
        };
        if let Some(e) = self.refused.take() {
            return Err(e);
        }
        if self.state.is_cancelled() {
            return Ok(OpOutput::Cancelled);
        }
        if let Some(e) = invalid {
            return Err(e.into());
        }
        if let Some(GpuOpKind::Dispatch { handle, .. }) = &kind {
            self.routing_verdict(handle)?;
        }
        self.peer_verdict()?;
        let elapsed = self.work.timing(!matches!(self.launch, super::Launch::Ll(_)));
        let ctx = Arc::clone(&self.shared.ctx);
        match kind {
            Some(GpuOpKind::HtHandle { routing, plan, recv_bound, .. }) => {
                let received = received.ok_or_else(|| Error::Backend("count exchange without buffers".into()))??;
                Ok(OpOutput::Handle(finish_handle(&self.shared, self.seq, routing, &plan, &received, recv_bound)?))
            }
            Some(GpuOpKind::HtDeviceHandle(plan)) => {
                Ok(OpOutput::Handle(plan.finish(&self.shared, self.seq)?.with_creation_time(elapsed)))
            }
            Some(GpuOpKind::Dispatch { handle, opts }) => Ok(OpOutput::Dispatch(self.ll_dispatch(&handle, opts)?)),
            Some(GpuOpKind::Combine { handle, .. }) => Ok(OpOutput::Combine(self.ll_combine(&handle))),
            Some(GpuOpKind::HtDispatch { handle, pass, outputs: Some(boxed) }) => {
                handle.check_built(&self.label())?;
                let (outputs, host_counts) = *boxed;
                // Host counters: the handle's (known now, also for one created in stream order).
                let host_counts = host_counts.map(|_| handle.recv_expert_counts().unwrap_or_default().to_vec());
                handle.0.core.record_dispatch(pass, self.seq);
                Ok(OpOutput::Dispatch(GpuDispatchOutput { outputs, host_counts, elapsed, ctx }))
            }
            Some(GpuOpKind::HtCombine { handle, outputs: Some(outputs) }) => {
                handle.check_built(&self.label())?;
                Ok(OpOutput::Combine(GpuCombineOutput { outputs, elapsed, ctx }))
            }
            Some(GpuOpKind::Cancellation) => Ok(OpOutput::Cancelled),
            _ => Err(Error::Backend(format!("{} finished twice", op_label(self.channel, self.seq)))),
        }
    }

    fn ll_dispatch(&mut self, handle: &GpuHandle, opts: DispatchOptions) -> Result<GpuDispatchOutput, Error> {
        let s = Arc::clone(&self.shared);
        debug_assert_eq!(s.config.algorithm, Algorithm::LowLatency);
        let l = s.layout.ll("low-latency dispatch")?;
        let set = self.set();
        let lease = self.set_lease();
        // The shapes of the handle's layout (expert-major or rank-major), as validation has them.
        let descs = dispatch_output_descs(&OpContext::new(&s.config, s.num_ranks, handle), &opts);
        // Every view in the caller's memory: the set is read by nothing after this operation.
        let in_caller = self.targets.is_some_and(|t| {
            (descs.scales.is_none() || t.scales.is_some())
                && (descs.topk_weights.is_none() || t.topk_weights.is_some())
                && (descs.topk_idx.is_none() || t.topk_idx.is_some())
                && t.counts.is_some()
        });
        let t = self.targets.unwrap_or_default();
        let topk = s.mem.disp_topk[set].ptr();
        let at = |target: Option<u64>, own: u64| target.unwrap_or(own);
        let tokens = self.view(at(self.targets.map(|t| t.tokens), s.mem.disp_out[set].ptr()), descs.tokens, &lease);
        let scales = descs.scales.map(|d| self.view(at(t.scales, s.mem.disp_scales[set].ptr()), d, &lease));
        let topk_weights = descs.topk_weights.map(|d| self.view(at(t.topk_weights, topk), d, &lease));
        let idx = topk + (l.rank_major_topk_entries() * 4) as u64;
        let topk_idx = descs.topk_idx.map(|d| self.view(at(t.topk_idx, idx), d, &lease));
        let n = descs.counts.as_ref().map_or(0, |d| d.shape[0]);
        let counts = self.view(
            at(t.counts, s.mem.disp_counts[set].ptr()),
            TensorDesc::contiguous(TensorTag::RecvExpertCountsDevice, DType::I32, &[n]),
            &lease,
        );
        let host_counts = (opts.counts_location == CountsLocation::Host).then(|| s.mem.host_counts[set].read_i32s(n));
        if let (Some(n), Some(info)) = (&s.nccl, &handle.0.ll_nccl) {
            // What each NCCL source dispatched here: the rows combine sends it back.
            let counts = n.counts[set].read_i32s(s.num_ranks);
            let mut rows = info.send_rows.lock().unwrap_or_else(|e| e.into_inner());
            for d in n.peers(s.num_ranks) {
                rows[d] = counts[d].max(0) as usize;
            }
        }
        if let (true, Some(done)) = (in_caller, self.work.done()) {
            lease.fence_with(done, self.work.done_stream());
        }
        handle.0.core.record_dispatch(opts.pass, self.seq);
        Ok(GpuDispatchOutput {
            outputs: DispatchOutputs { tokens, scales, topk_weights, topk_idx, counts: Some(counts) },
            host_counts,
            elapsed: self.work.timing(false),
            ctx: Arc::clone(&s.ctx),
        })
    }

    fn ll_combine(&mut self, handle: &GpuHandle) -> GpuCombineOutput {
        let s = Arc::clone(&self.shared);
        let set = self.set();
        let lease = self.set_lease();
        let tokens = self.view(
            self.targets.map_or(s.mem.comb_out[set].ptr(), |t| t.tokens),
            TensorDesc::contiguous(TensorTag::Tokens, DType::Bf16, &[handle.num_tokens(), s.config.hidden]),
            &lease,
        );
        let masked = s.config.rank_masking.then(|| {
            let desc = TensorDesc::contiguous(TensorTag::MaskedEntries, DType::I32, &[handle.num_tokens()]);
            let ptr = self.targets.map_or(Some(s.mem.comb_masked[set].ptr()), |t| t.masked);
            ptr.map(|p| self.view(p, desc, &lease))
        });
        // The caller's memory holds every view (NCCL EP's tensors): see `ll_dispatch`.
        if let (true, Some(done)) = (self.targets.is_some(), self.work.done()) {
            lease.fence_with(done, self.work.done_stream());
        }
        GpuCombineOutput {
            outputs: CombineOutputs { tokens, topk_weights: None, masked: masked.flatten() },
            elapsed: self.work.timing(false),
            ctx: Arc::clone(&s.ctx),
        }
    }
}

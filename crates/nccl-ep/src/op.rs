//! One NCCL EP operation ([`NcclEpOp`]) and what it returns.

use std::sync::Arc;

use cudarc::driver::CudaStream;
use std::sync::atomic::Ordering;
use std::time::Duration;

use epflow_core::backend::{OpId, OpOutput, OpState, PendingOp, Probe};
use epflow_core::handle::RoutingHandle;
use epflow_core::ops::{CombineOutputs, CountsLocation, DispatchOptions, DispatchOutputs};
use epflow_core::protocol::{Channel, SlotGuard};
use epflow_core::{Algorithm, DType, Error, TensorDesc, TensorTag};
use epflow_kernels::{DeviceTensor, StreamWork};
use nccl_ep_sys as ep;

use crate::group::{Shared, cuda};
use crate::handle::{Desc, NcclEpHandle};

/// Dispatch outputs, views into the buffer set they hold until dropped. Low-latency: tokens
/// `[L x R*M x H]` (arrival order inside an expert, see the module docs) and counts `[L]`.
/// High-throughput: tokens `[N x H]`, top-k weights `[N x K]` and local expert indices
/// `[N x K]` (NCCL EP's compact form, see the module docs), counts `[L]`.
#[derive(Debug)]
pub struct NcclEpDispatchOutput {
    outputs: DispatchOutputs<DeviceTensor>,
    host_counts: Option<Vec<i32>>,
    elapsed: Option<(Duration, Duration)>,
    _slot: Option<SlotGuard>,
}

impl NcclEpDispatchOutput {
    /// The received tokens (`[L x R*M x H]` low-latency, `[N x H]` high-throughput).
    pub fn tokens(&self) -> &DeviceTensor {
        &self.outputs.tokens
    }
    /// Rows per local expert `[L]`, on the device.
    pub fn counts(&self) -> Option<&DeviceTensor> {
        self.outputs.counts.as_ref()
    }
    /// The counts on the host, when asked for with [`CountsLocation::Host`].
    pub fn host_counts(&self) -> Option<&[i32]> {
        self.host_counts.as_deref()
    }
    /// All outputs.
    pub fn outputs(&self) -> &DispatchOutputs<DeviceTensor> {
        &self.outputs
    }
    /// (send half, complete half) device time, with timing on.
    pub fn elapsed_halves(&self) -> Option<(Duration, Duration)> {
        self.elapsed
    }
}

/// Combine outputs: `[B x H]` BF16, a view into the buffer set it holds until dropped.
#[derive(Debug)]
pub struct NcclEpCombineOutput {
    outputs: CombineOutputs<DeviceTensor>,
    elapsed: Option<(Duration, Duration)>,
    _slot: Option<SlotGuard>,
}

impl NcclEpCombineOutput {
    /// The combined tokens `[B x H]`.
    pub fn tokens(&self) -> &DeviceTensor {
        &self.outputs.tokens
    }
    /// (send half, complete half) device time, with timing on.
    pub fn elapsed_halves(&self) -> Option<(Duration, Duration)> {
        self.elapsed
    }
}

/// What an NCCL EP operation is.
pub(crate) enum NcclEpOpKind {
    Dispatch { opts: DispatchOptions },
    Combine,
}

/// One NCCL EP operation. Low-latency: `send` issues the `send_only` call and `start_complete`
/// `ncclEpComplete`. High-throughput (no `send_only` in NCCL EP 0.1): `send` issues the whole
/// call, which returns once this rank's rows have arrived (NCCL EP reads the receive count back
/// on the host), and the complete half only records the completion event.
pub struct NcclEpOp {
    pub(crate) shared: Arc<Shared>,
    pub(crate) handle: NcclEpHandle,
    pub(crate) channel: Channel,
    pub(crate) seq: u64,
    pub(crate) order: u64,
    pub(crate) set: usize,
    pub(crate) kind: NcclEpOpKind,
    /// Input waits, timing and completion events; keeps the inputs alive.
    pub(crate) work: StreamWork,
    /// The inputs' device addresses, in `kind`'s order (tokens, then weights).
    pub(crate) inputs: Vec<u64>,
    /// Boxed so the descriptors NCCL EP saw keep their addresses until `ncclEpComplete`.
    #[allow(clippy::vec_box)]
    pub(crate) descs: Vec<Box<Desc>>,
    pub(crate) state: OpState,
    pub(crate) completing: bool,
    /// High-throughput dispatch: the addresses of the `[R*M x K]` weights and indices NCCL EP
    /// wrote (set when issued).
    pub(crate) topk_out: Option<(u64, u64)>,
}

impl std::fmt::Debug for NcclEpOp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclEpOp")
            .field("channel", &self.channel)
            .field("seq", &self.seq)
            .field("sent", &self.state.is_sent())
            .finish_non_exhaustive()
    }
}

/// The output of an NCCL EP operation.
pub type NcclEpOpOutput = OpOutput<NcclEpHandle, NcclEpDispatchOutput, NcclEpCombineOutput>;

impl NcclEpOp {
    fn ht(&self) -> bool {
        self.shared.config.algorithm == Algorithm::HighThroughput
    }

    fn elapsed(&self) -> Option<(Duration, Duration)> {
        self.work.elapsed(false)
    }

    /// Issues the dispatch or combine (`send_only` for low-latency).
    fn issue(&mut self) -> Result<(), Error> {
        let s = Arc::clone(&self.shared);
        let (h, l, m, r) = (s.config.hidden, s.config.local_experts(s.num_ranks), s.max_tokens, s.num_ranks);
        let b = self.handle.0.core.num_tokens();
        let k = self.handle.0.core.top_k();
        let set = &s.sets[self.set];
        let raw = self.handle.0.raw;
        let ht = self.ht();
        match self.kind {
            NcclEpOpKind::Dispatch { .. } => {
                let mut x = Desc::new(ep::NCCL_BFLOAT16, self.inputs[0], &[b, h]);
                let mut inputs = ep::NcclEpDispatchInputs { tokens: x.ptr(), ..Default::default() };
                let mut outputs = ep::NcclEpDispatchOutputs::default();
                let mut info = ep::NcclEpLayoutInfo::default();
                let mut cfg = ep::NcclEpDispatchConfig::default();
                let mut descs = vec![];
                if ht {
                    let (wp, ip) = set.topk(&s.ctx, s.device, r * m, k)?;
                    self.topk_out = Some((wp, ip));
                    let mut w = Desc::new(ep::NCCL_FLOAT32, self.inputs[1], &[b, k]);
                    let mut out = Desc::new(ep::NCCL_BFLOAT16, set.tokens.ptr(), &[r * m, h]);
                    let mut ow = Desc::new(ep::NCCL_FLOAT32, wp, &[r * m, k]);
                    let mut oi = Desc::new(ep::NCCL_INT64, ip, &[r * m, k]);
                    inputs.topk_weights = w.ptr();
                    outputs = ep::NcclEpDispatchOutputs {
                        tokens: out.ptr(),
                        topk_weights: ow.ptr(),
                        topk_idx: oi.ptr(),
                        ..outputs
                    };
                    descs.extend([w, out, ow, oi]);
                } else {
                    let mut out = Desc::new(ep::NCCL_BFLOAT16, set.tokens.ptr(), &[l, r * m, h]);
                    let mut counts = Desc::new(ep::NCCL_INT32, set.counts.ptr(), &[l]);
                    outputs.tokens = out.ptr();
                    info.expert_counters = counts.ptr();
                    cfg.send_only = 1;
                    descs.extend([out, counts]);
                }
                let info_ptr: *const ep::NcclEpLayoutInfo = if ht { std::ptr::null() } else { &info };
                // SAFETY: every descriptor addresses live device memory of this rank with the sizes
                // given (inputs kept by this operation, outputs in its buffer set, held by its
                // slot); the structs carry their size and magic; ordered on the rank's stream.
                let rc = unsafe { (s.lib.dispatch)(raw, &inputs, &outputs, info_ptr, &cfg, s.raw_stream()) };
                self.descs.push(x);
                self.descs.extend(descs);
                s.check("ncclEpDispatch", rc)
            }
            NcclEpOpKind::Combine => {
                let mut out = Desc::new(ep::NCCL_BFLOAT16, set.combined.ptr(), &[b, h]);
                let mut outputs = ep::NcclEpCombineOutputs { tokens: out.ptr(), ..Default::default() };
                let mut cfg = ep::NcclEpCombineConfig::default();
                let mut x = if ht {
                    self.handle.ht()?;
                    let n = self.handle.num_recv_tokens().unwrap_or(0);
                    Desc::new(ep::NCCL_BFLOAT16, self.inputs[0], &[n, h])
                } else {
                    let mut w = Desc::new(ep::NCCL_FLOAT32, self.inputs[1], &[b, k]);
                    outputs.topk_weights = w.ptr();
                    cfg.send_only = 1;
                    self.descs.push(w);
                    Desc::new(ep::NCCL_BFLOAT16, self.inputs[0], &[l, r * m, h])
                };
                let inputs = ep::NcclEpCombineInputs { tokens: x.ptr(), ..Default::default() };
                // SAFETY: as for dispatch.
                let rc = unsafe { (s.lib.combine)(raw, &inputs, &outputs, &cfg, s.raw_stream()) };
                self.descs.extend([x, out]);
                s.check("ncclEpCombine", rc)
            }
        }
    }

    fn finish_dispatch(&mut self, opts: DispatchOptions) -> Result<NcclEpDispatchOutput, Error> {
        let s = Arc::clone(&self.shared);
        let set = &s.sets[self.set];
        let (outputs, host_counts) = if let Ok(recv) = self.handle.ht() {
            let (n, k, h) = (self.handle.num_recv_tokens().unwrap_or(0), self.handle.top_k(), s.config.hidden);
            let (wp, ip) =
                self.topk_out.ok_or_else(|| Error::Backend("dispatch finished before it was issued".into()))?;
            let view = |ptr, tag, dtype, shape: &[usize]| {
                // SAFETY: the first rows of this set's buffers (allocated for `R*M` rows, at least
                // `N`), alive as long as the rank; the output holds the set's slot, so nothing
                // writes them until it is dropped.
                unsafe { DeviceTensor::from_raw(ptr, s.device, TensorDesc::contiguous(tag, dtype, shape)) }
            };
            let outputs = DispatchOutputs {
                tokens: view(set.tokens.ptr(), TensorTag::Tokens, DType::Bf16, &[n, h]),
                scales: None,
                topk_weights: Some(view(wp, TensorTag::TopkWeights, DType::F32, &[n, k])),
                topk_idx: Some(view(ip, TensorTag::TopkIdx, DType::I64, &[n, k])),
                counts: Some(recv.counts.clone()),
            };
            let host = (opts.counts_location == CountsLocation::Host)
                .then(|| self.handle.recv_expert_counts().unwrap_or_default().to_vec());
            (outputs, host)
        } else {
            let host = if opts.counts_location == CountsLocation::Host {
                Some(set.counts.download(&s.ctx)?.as_i32().unwrap_or_default().to_vec())
            } else {
                None
            };
            let outputs = DispatchOutputs {
                tokens: set.tokens.clone(),
                scales: None,
                topk_weights: None,
                topk_idx: None,
                counts: Some(set.counts.clone()),
            };
            (outputs, host)
        };
        self.handle.0.core.record_dispatch(epflow_core::ops::Pass::Forward, self.seq);
        Ok(NcclEpDispatchOutput { outputs, host_counts, elapsed: self.elapsed(), _slot: self.state.take_slot() })
    }

    fn finish_combine(&mut self) -> Result<NcclEpCombineOutput, Error> {
        let s = &self.shared;
        let b = self.handle.0.core.num_tokens();
        let desc = TensorDesc::contiguous(TensorTag::Tokens, DType::Bf16, &[b, s.config.hidden]);
        // SAFETY: the first `b` rows of the set's `[M x H]` buffer, alive as long as the rank; the
        // output holds the buffer set's slot, as the GPU backend's outputs do.
        let tokens = unsafe { DeviceTensor::from_raw(s.sets[self.set].combined.ptr(), s.device, desc) };
        Ok(NcclEpCombineOutput {
            outputs: CombineOutputs { tokens, topk_weights: None, masked: None },
            elapsed: self.elapsed(),
            _slot: self.state.take_slot(),
        })
    }
}

impl Drop for NcclEpOp {
    /// An operation dropped unfinished (an error path) waits for its device work, bounded by
    /// NCCL EP's own device timeout, so nothing it uses is freed under a kernel.
    fn drop(&mut self) {
        if self.state.is_sent() {
            self.work.synchronize();
        }
    }
}

impl PendingOp for NcclEpOp {
    type Output = NcclEpOpOutput;
    /// NCCL EP's operations order after a caller's stream ([`PendingOp::order_after`]); they do
    /// not complete in stream order (its outputs are not leased: await the staged operation).
    type Stream = Arc<CudaStream>;

    fn order_after(&mut self, stream: &Arc<CudaStream>) -> Result<(), Error> {
        if self.state.is_sent() {
            return Err(Error::Backend(format!("{} was already sent: too late to order it", self.label())));
        }
        self.work.order_after(stream)
    }

    fn id(&self) -> OpId {
        OpId { rank: self.shared.rank, channel: self.channel, seq: self.seq }
    }

    fn needs_slot(&self) -> bool {
        true
    }

    fn poll_send_ready(&mut self) -> Result<bool, Error> {
        Ok(self.state.is_sent() || self.shared.turn.load(Ordering::Acquire) == self.order)
    }

    fn send(&mut self, slot: Option<SlotGuard>) -> Result<(), Error> {
        if self.state.is_sent() {
            return Ok(());
        }
        let s = Arc::clone(&self.shared);
        let result: Result<(), Error> = (|| {
            self.work.begin_send(s.timing.load(Ordering::Relaxed))?;
            // A cancelled operation still runs: NCCL EP has no cancellation marker, and the peers
            // wait for this rank's messages. Its inputs are still alive (held by the operation).
            self.issue()?;
            self.work.end_send()
        })();
        s.turn.store(self.order + 1, Ordering::Release);
        result?;
        self.state.mark_sent(slot);
        Ok(())
    }

    fn is_sent(&self) -> bool {
        self.state.is_sent()
    }

    fn cancel(&mut self) {
        self.state.cancel();
    }

    fn start_complete(&mut self) -> Result<(), Error> {
        if self.completing {
            return Ok(());
        }
        let s = Arc::clone(&self.shared);
        s.ctx.bind_to_thread().map_err(|e| cuda("bind context", e))?;
        if !self.ht() {
            let cfg = ep::NcclEpCompleteConfig::default();
            // SAFETY: completes the staged operation this handle just issued, on the same stream;
            // the descriptors it saw are still held by this operation.
            let rc = unsafe { (s.lib.complete)(self.handle.0.raw, &cfg, s.raw_stream()) };
            s.check("ncclEpComplete", rc)?;
        }
        self.work.end_complete()?;
        self.completing = true;
        Ok(())
    }

    fn poll_complete(&mut self) -> Result<bool, Error> {
        self.work.is_complete()
    }

    fn finish(mut self) -> Result<NcclEpOpOutput, Error> {
        if self.state.is_cancelled() {
            return Ok(OpOutput::Cancelled);
        }
        match self.kind {
            NcclEpOpKind::Dispatch { opts } => Ok(OpOutput::Dispatch(self.finish_dispatch(opts)?)),
            NcclEpOpKind::Combine => Ok(OpOutput::Combine(self.finish_combine()?)),
        }
    }

    fn send_probe(&self) -> Box<dyn Probe> {
        let (shared, order) = (Arc::clone(&self.shared), self.order);
        Box::new(move || shared.turn.load(Ordering::Acquire) == order)
    }

    fn complete_probe(&self) -> Box<dyn Probe> {
        let (ctx, done) = (Arc::clone(&self.shared.ctx), self.work.done().cloned());
        Box::new(move || match &done {
            Some(e) => ctx.bind_to_thread().is_err() || e.try_is_complete().unwrap_or(true),
            None => true,
        })
    }

    fn traffic(&self) -> (u64, u64) {
        let b = self.handle.0.core.num_tokens() as u64;
        (b * self.shared.config.hidden as u64 * 2, b)
    }

    fn waiting_for(&self) -> String {
        if self.state.is_sent() {
            "NCCL EP to complete (the peers' data)".into()
        } else {
            "its turn to send (an earlier operation of this rank has not been sent yet)".into()
        }
    }
}

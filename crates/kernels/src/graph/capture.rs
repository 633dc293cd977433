//! Recording a step: [`GpuRank::capture`] and the [`GpuCapture`] its closure issues operations
//! through.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use cudarc::driver::{CudaStream, sys};
use epflow_core::graph::StepCounts;
use epflow_core::handle::RoutingHandle;
use epflow_core::ops::{
    CombineInputs, CombineOptions, CountsLocation, DispatchInputs, DispatchOptions, DispatchOutputs,
};
use epflow_core::protocol::Channel;
use epflow_core::stamp::{Pairing, Stamp};
use epflow_core::validate::{validate_combine_inputs, validate_dispatch_inputs};
use epflow_core::{Algorithm, Error, ValidationError};

use super::{CapturedOp, GpuStep, StepMemory};
use crate::compile::ll_kernels::LlKernel;
use crate::device::{DeviceTensor, bind, cuda};
use crate::ll::start::{combine_params, dispatch_params};
use crate::op::launch_ll_kernel;
use crate::outputs::OutputTargets;
use crate::params::LlParams;
use crate::rank::GpuRank;
use crate::state::handle::GpuHandle;

/// Numbers the steps of the process (a handle belongs to one).
static NEXT_STEP: AtomicU64 = AtomicU64::new(1);

/// The send half of a captured operation, whose complete half is not captured yet
/// ([`GpuCapture::complete_dispatch`], [`GpuCapture::complete_combine`]). Every send half must
/// be completed before the capture ends.
#[derive(Debug)]
#[must_use = "complete the half before the capture ends"]
pub struct CapturedSend {
    channel: Channel,
    p: LlParams,
    handle: GpuHandle,
}

/// What a step's closure records through ([`GpuRank::capture`]): low-latency operations on
/// handles of captured steps ([`GpuRank::graph_handle`]), enqueued on the capture stream
/// ([`GpuCapture::stream`]) in the order they are issued. Other work (the router, the experts)
/// goes on the same stream, or on streams forked from it and joined back before the closure
/// returns. Nothing runs during the capture: each replay runs it all.
#[derive(Debug)]
pub struct GpuCapture<'r> {
    pub(super) rank: &'r GpuRank,
    pub(super) stream: Arc<CudaStream>,
    pub(super) mem: Arc<StepMemory>,
    pub(super) step: u64,
    pub(super) counts: StepCounts,
    pub(super) ops: Vec<CapturedOp>,
    pub(super) handles: Vec<GpuHandle>,
    pub(super) keep: Vec<DeviceTensor>,
    open: usize,
    /// The last complete half (or one-launch operation) captured: its channel and place.
    last: Option<(Channel, u64)>,
    /// Whether an operation was captured as one cooperative kernel (both halves): then every
    /// replay keeps to its channels' one-launch order ([`crate::state::shared::RankShared::last_launch`]).
    pub(super) one_launched: bool,
}

/// Ends a capture however the closure leaves (error or panic), so the stream is usable after.
struct Capturing<'s>(&'s Arc<CudaStream>, bool);

impl Drop for Capturing<'_> {
    fn drop(&mut self) {
        if !self.1 {
            // The capture is abandoned: its graph is discarded.
            let _ = self.0.end_capture(sys::CUgraphInstantiate_flags(0));
        }
    }
}

impl GpuRank {
    /// Captures one step on `stream` (of this rank's context; not capturing yet): `f` issues
    /// the step's low-latency operations through the [`GpuCapture`] (on handles of
    /// [`GpuRank::graph_handle`]) and enqueues any other work on [`GpuCapture::stream`]. The
    /// step is a CUDA graph; replay it with [`epflow_core::graph::StepBackend::launch_step`]
    /// (or `epflow_async::Group::replay`) as often as needed, on every rank in the same order
    /// of operations. [`epflow_core::graph`] has the rules.
    ///
    /// Not collective: ranks capture on their own, in any order. Errors: the group is
    /// high-throughput or has NCCL peers ([`Error::Unsupported`]); an operation's arguments are
    /// invalid (the error of the eager operation); a send half is left without its complete
    /// half; CUDA refused the capture.
    ///
    /// ```no_run
    /// # fn example(rank: &epflow_kernels::GpuRank, topk: &epflow_kernels::DeviceTensor,
    /// #            x: &epflow_kernels::DeviceTensor, w: &epflow_kernels::DeviceTensor) -> epflow_core::Result<()> {
    /// use epflow_core::backend::Probe;
    /// use epflow_core::graph::{PendingReplay, StepBackend};
    /// use epflow_core::ops::{CombineInputs, CombineOptions, DispatchInputs, DispatchOptions, HandleOptions};
    ///
    /// let h = rank.graph_handle(topk, &HandleOptions::default())?; // before the capture
    /// let stream = rank.context().new_stream().map_err(|e| epflow_core::Error::Backend(e.to_string()))?;
    /// let step = rank.capture(&stream, |cap| {
    ///     let d = cap.dispatch(&h, DispatchInputs::new(x), &DispatchOptions::default())?;
    ///     // Experts go here, enqueued on `cap.stream()`; identity experts: combine `d.tokens`.
    ///     cap.combine(&h, CombineInputs::new(&d.tokens).with_weights(w), &CombineOptions::default())?;
    ///     Ok(())
    /// })?;
    /// // Every decode step: refill `topk`, `x`, `w`, then replay (async: `group.replay(&step).await`).
    /// let replay = rank.launch_step(&step)?;
    /// let done = replay.probe();
    /// while !done.ready() {
    ///     std::hint::spin_loop();
    /// }
    /// replay.finish()?;
    /// let y = h.graph_combine_output().expect("a graph handle"); // [B x H], this replay's
    /// # let _ = y; Ok(()) }
    /// ```
    pub fn capture(
        &self,
        stream: &Arc<CudaStream>,
        f: impl FnOnce(&mut GpuCapture<'_>) -> Result<(), Error>,
    ) -> Result<GpuStep, Error> {
        self.core.poison().check()?;
        let s = &self.shared;
        if s.config.algorithm != Algorithm::LowLatency {
            return Err(Error::Unsupported("captured steps hold low-latency operations only".into()));
        }
        if s.nccl.is_some() {
            return Err(Error::Unsupported(
                "captured steps need every peer over NVLink (this rank reaches some through NCCL)".into(),
            ));
        }
        if !Arc::ptr_eq(stream.context(), &s.ctx) {
            return Err(Error::Unsupported("the capture stream belongs to another CUDA context".into()));
        }
        let mem = Arc::new(StepMemory::new(s)?);
        bind(&s.ctx)?;
        stream
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(|e| cuda("begin capture", e))?;
        let mut guard = Capturing(stream, false);
        let mut cap = GpuCapture {
            rank: self,
            stream: Arc::clone(stream),
            mem,
            step: NEXT_STEP.fetch_add(1, Ordering::Relaxed),
            counts: StepCounts::default(),
            ops: Vec::new(),
            handles: Vec::new(),
            keep: Vec::new(),
            open: 0,
            last: None,
            one_launched: false,
        };
        let recorded = f(&mut cap).and_then(|()| {
            if cap.open != 0 {
                return Err(Error::Unsupported(format!(
                    "{} captured send half(s) have no complete half: complete each before the capture ends",
                    cap.open
                )));
            }
            let last = cap.last.ok_or_else(|| Error::Unsupported("the capture holds no operation".into()))?;
            guard.1 = true;
            let graph = stream
                .end_capture(sys::CUgraphInstantiate_flags(0))
                .map_err(|e| cuda("end capture (was other work left on a forked stream?)", e))?
                .ok_or_else(|| Error::Unsupported("the capture recorded nothing".into()))?;
            cap.mem.set_advance(cap.counts, last)?;
            graph.upload().map_err(|e| cuda("upload the step", e))?;
            Ok(graph)
        });
        let graph = match recorded {
            Ok(graph) => graph,
            Err(e) => {
                // The step is not made: its handles are free for another capture.
                for h in &cap.handles {
                    if let Some(g) = h.graph() {
                        *g.step.lock().unwrap_or_else(|e| e.into_inner()) = None;
                    }
                }
                return Err(e);
            }
        };
        Ok(GpuStep::new(cap, graph))
    }
}

impl GpuCapture<'_> {
    /// The capture stream: enqueue the step's other work here (or fork from it and join back).
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Dispatch on `h` (a handle of [`GpuRank::graph_handle`]), both halves. Returns the
    /// handle's dispatch outputs (fixed buffers, written by every replay). `opts` must keep the
    /// counts on the device.
    pub fn dispatch(
        &mut self,
        h: &GpuHandle,
        inputs: DispatchInputs<'_, DeviceTensor>,
        opts: &DispatchOptions,
    ) -> Result<DispatchOutputs<DeviceTensor>, Error> {
        if !self.one_launch() {
            let half = self.dispatch_send(h, inputs, opts)?;
            return self.complete_dispatch(half);
        }
        let p = self.record_dispatch(h, inputs, opts)?;
        launch_ll_kernel(&self.rank.shared, LlKernel::DispatchOne, p, &self.stream)?;
        self.last = Some((Channel::Dispatch, p.seq));
        self.one_launched = true;
        Ok(h.graph().ok_or_else(not_graph_handle)?.dispatched.clone())
    }

    /// The send half of a dispatch on `h`; capture its complete half later
    /// ([`GpuCapture::complete_dispatch`]), e.g. after another micro-batch's work.
    pub fn dispatch_send(
        &mut self,
        h: &GpuHandle,
        inputs: DispatchInputs<'_, DeviceTensor>,
        opts: &DispatchOptions,
    ) -> Result<CapturedSend, Error> {
        let p = self.record_dispatch(h, inputs, opts)?;
        launch_ll_kernel(&self.rank.shared, LlKernel::DispatchSend, p, &self.stream)?;
        self.open += 1;
        Ok(CapturedSend { channel: Channel::Dispatch, p, handle: h.clone() })
    }

    /// Checks and numbers a captured dispatch on `h`; returns its kernel parameters.
    fn record_dispatch(
        &mut self,
        h: &GpuHandle,
        inputs: DispatchInputs<'_, DeviceTensor>,
        opts: &DispatchOptions,
    ) -> Result<LlParams, Error> {
        let g = self.claim(h)?;
        if opts.counts_location != CountsLocation::Device {
            return Err(Error::Unsupported("a captured dispatch keeps its counts on the device".into()));
        }
        if self.ops.iter().any(|o| o.channel == Channel::Dispatch && o.handle == self.handle_index(h)) {
            return Err(Error::Unsupported("a handle of captured steps dispatches once per step".into()));
        }
        let s = &self.rank.shared;
        let valid = validate_dispatch_inputs(&self.rank.core.op_context(h), opts, &inputs)?;
        self.keep.extend(valid.tensors().into_iter().cloned());
        let offset = self.counts.add_dispatch();
        let targets = g.dispatch_targets();
        let (mut p, _, stamp) = dispatch_params(s, offset, h, &valid, opts, Some(&targets), None)?;
        self.number(&mut p, Channel::Dispatch);
        // The routing of each replay comes from the caller's buffer, sanitized by the send.
        p.topk_src = g.topk.ptr();
        p.route_report = g.report.device_ptr();
        self.ops.push(CapturedOp { channel: Channel::Dispatch, offset, stamp, handle: self.handle_index(h) });
        Ok(p)
    }

    /// The complete half of a captured dispatch: returns the handle's dispatch outputs.
    pub fn complete_dispatch(&mut self, half: CapturedSend) -> Result<DispatchOutputs<DeviceTensor>, Error> {
        self.complete(&half, Channel::Dispatch, LlKernel::DispatchRecv)?;
        let g = half.handle.graph().ok_or_else(not_graph_handle)?;
        Ok(g.dispatched.clone())
    }

    /// Combine on `h`, both halves: pairs with the dispatch on `h` captured before it in this
    /// step. Returns the handle's combine output `[B x H]` (a fixed buffer).
    pub fn combine(
        &mut self,
        h: &GpuHandle,
        inputs: CombineInputs<'_, DeviceTensor>,
        opts: &CombineOptions,
    ) -> Result<DeviceTensor, Error> {
        if !self.one_launch() {
            let half = self.combine_send(h, inputs, opts)?;
            return self.complete_combine(half);
        }
        let p = self.record_combine(h, inputs, opts)?;
        launch_ll_kernel(&self.rank.shared, LlKernel::CombineOne, p, &self.stream)?;
        self.last = Some((Channel::Combine, p.seq));
        self.one_launched = true;
        Ok(h.graph().ok_or_else(not_graph_handle)?.combined.clone())
    }

    /// The send half of a combine on `h`; capture its complete half later
    /// ([`GpuCapture::complete_combine`]).
    pub fn combine_send(
        &mut self,
        h: &GpuHandle,
        inputs: CombineInputs<'_, DeviceTensor>,
        opts: &CombineOptions,
    ) -> Result<CapturedSend, Error> {
        let p = self.record_combine(h, inputs, opts)?;
        launch_ll_kernel(&self.rank.shared, LlKernel::CombineSend, p, &self.stream)?;
        self.open += 1;
        Ok(CapturedSend { channel: Channel::Combine, p, handle: h.clone() })
    }

    /// Checks and numbers a captured combine on `h`; returns its kernel parameters.
    fn record_combine(
        &mut self,
        h: &GpuHandle,
        inputs: CombineInputs<'_, DeviceTensor>,
        opts: &CombineOptions,
    ) -> Result<LlParams, Error> {
        let g = self.claim(h)?;
        let index = self.handle_index(h);
        let paired = self
            .ops
            .iter()
            .rev()
            .find(|o| o.channel == Channel::Dispatch && o.handle == index)
            .map(|o| o.offset)
            .ok_or(ValidationError::CombineBeforeDispatch)?;
        if self.ops.iter().any(|o| o.channel == Channel::Combine && o.handle == index) {
            return Err(Error::Unsupported("a handle of captured steps combines once per step".into()));
        }
        let s = &self.rank.shared;
        let valid = validate_combine_inputs(&self.rank.core.op_context(h), opts, &inputs)?;
        self.keep.extend(valid.tensors().into_iter().cloned());
        let offset = self.counts.add_combine();
        let stamp = Stamp::new(h.top_k(), opts.pass, Pairing::Captured(paired)).with_layout(h.layout());
        let targets = OutputTargets { tokens: g.combined.ptr(), ..OutputTargets::default() };
        let (mut p, _) = combine_params(s, offset, h, stamp, &valid, Some(&targets))?;
        self.number(&mut p, Channel::Combine);
        self.ops.push(CapturedOp { channel: Channel::Combine, offset, stamp, handle: index });
        Ok(p)
    }

    /// The complete half of a captured combine: returns the handle's combine output.
    pub fn complete_combine(&mut self, half: CapturedSend) -> Result<DeviceTensor, Error> {
        self.complete(&half, Channel::Combine, LlKernel::CombineRecv)?;
        let g = half.handle.graph().ok_or_else(not_graph_handle)?;
        Ok(g.combined.clone())
    }

    fn complete(&mut self, half: &CapturedSend, channel: Channel, which: LlKernel) -> Result<(), Error> {
        if half.channel != channel {
            return Err(Error::Unsupported(format!("a captured {} half completed as a {channel}", half.channel)));
        }
        launch_ll_kernel(&self.rank.shared, which, half.p, &self.stream)?;
        self.open -= 1;
        self.last = Some((channel, half.p.seq));
        Ok(())
    }

    /// Checks that `h` is a handle of captured steps of this group, free or already this
    /// step's, and takes it for this step.
    fn claim<'h>(&mut self, h: &'h GpuHandle) -> Result<&'h super::GraphHandle, Error> {
        self.rank.core.check_handle(h)?;
        let g = h.graph().ok_or_else(not_graph_handle)?;
        let mut owner = g.step.lock().unwrap_or_else(|e| e.into_inner());
        match *owner {
            Some(step) if step != self.step => {
                return Err(Error::Unsupported(format!(
                    "this handle belongs to captured step {step}: a handle of captured steps serves one step"
                )));
            }
            Some(_) => {}
            None => {
                *owner = Some(self.step);
                self.handles.push(h.clone());
            }
        }
        Ok(g)
    }

    fn handle_index(&self, h: &GpuHandle) -> usize {
        self.handles.iter().position(|x| Arc::ptr_eq(&x.0, &h.0)).unwrap_or(usize::MAX)
    }

    /// Whether a synchronous captured operation is one cooperative kernel (both halves), as
    /// the eager synchronous form is where the rank allows it (`RankShared::one_launch`;
    /// `EPFLOW_GRAPH_ONE_LAUNCH=0` keeps two kernels).
    fn one_launch(&self) -> bool {
        self.rank.shared.one_launch && self.rank.shared.config.tuning().graph_one_launch
    }

    /// Makes `p` a captured operation of `channel`: its number is its offset plus the step's
    /// base on the device; its failures go to the step's word.
    fn number(&self, p: &mut LlParams, channel: Channel) {
        p.seq_base = self.mem.bases.ptr() + 8 * channel.index() as u64;
        p.verdict = self.mem.failure.device_ptr();
        p.set = 0;
        p.cancelled = 0;
    }
}

fn not_graph_handle() -> Error {
    Error::Unsupported(
        "captured operations take handles of captured steps (GpuRank::graph_handle), not eager handles".into(),
    )
}

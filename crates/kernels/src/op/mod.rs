//! [`GpuOp`]: one GPU operation as a [`PendingOp`]. Low-latency: the send half is one kernel
//! launch, the complete half another; in the synchronous form and in a whole operation
//! completed in stream order ([`PendingOp::will_complete_at_once`]) both halves are one
//! cooperative launch when the rank can (see [`GpuOp::one_launch`]). High-throughput dispatch
//! and combine, and the count exchange of handle creation, are one launch each (the send half),
//! whose end is the completion. A CUDA event after the last launch is the completion signal.
//!
//! The lifecycle lives here; [`launch`] holds the launches (with their geometry,
//! [`ll_geometry`] and [`ht_geometry`]), [`finish`] the output assembly, [`mask_kernels`] the
//! one-thread mask kernels (ranks' masking, and an operation's after it revoked NCCL pairs).

mod finish;
pub(crate) mod ht_geometry;
mod launch;
pub(crate) mod ll_geometry;
pub(crate) mod mask_kernels;

pub(crate) use launch::{launch_ll_kernel, launch_ll_kernel_as};

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use cudarc::driver::CudaStream;
use epflow_core::backend::{OpId, OpOutput, OpState, PendingOp, Probe, StreamOrder};
use epflow_core::ops::{CombineOutputs, DispatchOptions, DispatchOutputs, Pass};
use epflow_core::protocol::{Channel, SlotGuard};
use epflow_core::routing::{ChannelPlan, Routing};
use epflow_core::stamp::Stamp;
use epflow_core::{Error, ValidationError};

pub(crate) use launch::Launch;

use crate::compile::ll_kernels::LlKernel;

use crate::device::cache::CachedBuffer;
use crate::device::host_steps::Steps;
use crate::device::{DeviceTensor, StreamFence, StreamWork, bind, cuda, stream_id};
use crate::outputs::{GpuCombineOutput, GpuDispatchOutput, OutputTargets, SetLease};
use crate::state::handle::GpuHandle;
use crate::state::shared::{ExchangeBuffers, RankShared};
use crate::transport::nccl::Xfer;
use crate::transport::nccl_pairs::PairExchange;

/// A high-throughput dispatch's output tensors and, when asked for, its counters on the host.
pub(crate) type HtDispatchOutputs = (DispatchOutputs<DeviceTensor>, Option<Vec<i32>>);

/// What the operation is, and what it produces when it finishes.
#[derive(Debug)]
pub(crate) enum GpuOpKind {
    /// Low-latency dispatch.
    Dispatch { handle: GpuHandle, opts: DispatchOptions },
    /// Low-latency combine, pairing with dispatch `paired` on `handle`.
    Combine { handle: GpuHandle, paired: u64 },
    /// The count exchange that creates a high-throughput handle (plan built on the host);
    /// `recv_bound`: the received rows of a `RecvRows::Bound` handle.
    HtHandle { routing: Routing, plan: ChannelPlan, bufs: Option<ExchangeBuffers>, recv_bound: Option<usize> },
    /// A high-throughput handle built on the device (`ep_ht_plan`).
    HtDeviceHandle(Box<crate::state::ht_plan::DevicePlan>),
    /// A handle built on the device and handed out in stream order before it was built
    /// (`complete_on`): its verdict settles it.
    HtStreamHandle(GpuHandle),
    /// High-throughput dispatch.
    HtDispatch { handle: GpuHandle, pass: Pass, outputs: Option<Box<HtDispatchOutputs>> },
    /// High-throughput combine.
    HtCombine { handle: GpuHandle, outputs: Option<CombineOutputs<DeviceTensor>> },
    /// A cancellation only (this rank's arguments failed validation): no result.
    Cancellation,
}

/// The output of a GPU operation.
pub type GpuOpOutput = OpOutput<GpuHandle, GpuDispatchOutput, GpuCombineOutput>;

/// One operation of one GPU rank.
pub struct GpuOp {
    shared: Arc<RankShared>,
    channel: Channel,
    seq: u64,
    stamp: Stamp,
    launch: Launch,
    /// High-throughput outputs to fill with the debug byte before the kernel, if one is set.
    fill: Option<(u64, usize)>,
    kind: Option<GpuOpKind>,
    work: StreamWork,
    state: OpState,
    completing: bool,
    /// Why the operation went out as a cancellation when it was sent.
    refused: Option<Error>,
    /// Low-latency: the buffer set, leased to the outputs; the operation's share keeps it until
    /// the operation is dropped (its verdict read).
    lease: Option<Arc<SetLease>>,
    /// Low-latency: an event after the send half (what a stream-ordered receive waits for).
    sent: Option<Arc<cudarc::driver::CudaEvent>>,
    /// Low-latency combine: its number among the readers of its handle's row map.
    reader: Option<u64>,
    /// NCCL exchange issued after the send kernel (low-latency with NCCL peers) or as the
    /// operation (high-throughput over NCCL).
    xfers: Vec<Xfer>,
    /// Under rank masking, a low-latency operation's exchanges with its NCCL peers, one per
    /// pair (still pending at the host deadline: the peer died, see
    /// `GpuOp::revoke_stalled_exchanges`).
    pair_exchanges: Vec<PairExchange>,
    /// `mask_missing` revoked pairs of this operation (it does once: a second deadline is a
    /// timeout).
    revoked: bool,
    /// Staging the NCCL exchange reads or writes, kept until the operation is dropped (even when
    /// cancelled: the peers still exchange with it).
    scratch: Vec<CachedBuffer>,
    /// Low-latency: caller-owned memory the outputs are written into (their views address it).
    targets: Option<OutputTargets>,
    /// The complete half follows the send at once, on the same stream (the synchronous form,
    /// or a whole operation in stream order).
    at_once: bool,
    /// Low-latency: the caller's stream the send half was ordered after
    /// ([`PendingOp::order_after`]); a one-launch kernel runs there.
    caller: Option<Arc<CudaStream>>,
    /// Both halves went out as one launch.
    one_launched: bool,
    /// Completion polls that found the outcome word not yet published (see
    /// [`GpuOp::outcome_published`]).
    quiet_polls: u32,
    /// The host saw the operation's device work end (its completion event), or, for a handle
    /// built on the device, the built word its plan kernel writes once every block is done with
    /// the plan: nothing the operation keeps alive is read or written on the device any more,
    /// so dropping it waits for nothing.
    finished_on_device: bool,
    /// `EPFLOW_HOST_STEPS`: the complete half of a high-throughput operation or handle, from
    /// its end events through the wait to the finished result ([`GpuOp::complete_step`]).
    complete_steps: Steps,
}

impl std::fmt::Debug for GpuOp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuOp")
            .field("op", &self.label())
            .field("sent", &self.state.is_sent())
            .field("completing", &self.completing)
            .finish()
    }
}

impl GpuOp {
    /// Operation `seq` of `channel` on `shared`'s stream of that channel, reading `inputs`.
    pub(crate) fn new(
        shared: Arc<RankShared>,
        channel: Channel,
        seq: u64,
        stamp: Stamp,
        launch: Launch,
        kind: GpuOpKind,
        inputs: &[&DeviceTensor],
    ) -> Self {
        let work = StreamWork::new(&shared.ctx, &shared.streams[channel.index()], inputs)
            .with_events(&shared.events, &shared.timed_events);
        GpuOp {
            shared,
            channel,
            seq,
            stamp,
            launch,
            fill: None,
            kind: Some(kind),
            work,
            state: OpState::default(),
            completing: false,
            refused: None,
            lease: None,
            sent: None,
            pair_exchanges: Vec::new(),
            revoked: false,
            reader: None,
            xfers: Vec::new(),
            scratch: Vec::new(),
            targets: None,
            at_once: false,
            caller: None,
            one_launched: false,
            quiet_polls: 0,
            finished_on_device: false,
            complete_steps: Steps::inert(),
        }
    }

    /// Low-latency: the caller-owned memory the kernels write the outputs into (see
    /// [`crate::GpuRank::start_dispatch_into`]).
    pub(crate) fn set_targets(&mut self, targets: Option<OutputTargets>) {
        self.targets = targets;
    }

    /// Runs the send half (and, for high-throughput operations, the whole operation) on
    /// `stream` instead of the rank's stream of the channel: a caller's stream, so the
    /// operation is ordered after the caller's earlier work there without events. Before the
    /// send only; `stream` must belong to the rank's context.
    pub fn send_on(&mut self, stream: &Arc<CudaStream>) -> Result<(), Error> {
        if self.state.is_sent() {
            return Err(Error::Backend(format!("{} was already sent: too late to move it", self.label())));
        }
        self.work.set_stream(stream);
        Ok(())
    }

    /// A cancellation: it takes part in collective `seq` of `channel` without data.
    pub(crate) fn cancellation(shared: Arc<RankShared>, channel: Channel, seq: u64, launch: Launch) -> Self {
        let stamp = Stamp::new(0, Pass::Forward, epflow_core::stamp::Pairing::None);
        let mut op = GpuOp::new(shared, channel, seq, stamp, launch, GpuOpKind::Cancellation, &[]);
        op.state.cancel();
        op
    }

    /// The NCCL exchange of this operation (see [`crate::transport::nccl`]).
    pub(crate) fn set_xfers(&mut self, xfers: Vec<Xfer>) {
        self.xfers = xfers;
    }

    /// Keeps `buf` alive as long as the operation; its launches wait for the fences of the
    /// buffer's previous readers first.
    pub(crate) fn keep_scratch(&mut self, mut buf: CachedBuffer) {
        self.work.wait_fences(buf.take_fences());
        self.scratch.push(buf);
    }

    /// Marks `(ptr, bytes)` as this operation's outputs, filled with the rank's debug byte (if
    /// [`crate::GpuRank::fill_output_buffers`] set one) before the kernel runs.
    pub(crate) fn set_fill(&mut self, fill: (u64, usize)) {
        self.fill = Some(fill);
    }

    /// Before its launches, the operation's stream waits for `event` (recorded on stream
    /// `stream_id`) unless it runs on that stream: what a handle built in stream order asks
    /// (`GpuHandle::ll_built_after`).
    pub(crate) fn order_after_event(&mut self, event: Arc<cudarc::driver::CudaEvent>, stream_id: usize) {
        self.work.order_after_event(event, stream_id);
    }

    /// The operation's completion event follows `event` too ([`StreamWork::join_before_done`]).
    pub(crate) fn join_before_done(&mut self, event: Arc<cudarc::driver::CudaEvent>) {
        self.work.join_before_done(event);
    }

    /// Before its launches, the operation's stream waits for `fences` (of memory it writes).
    pub(crate) fn wait_fences(&mut self, fences: Vec<Arc<cudarc::driver::CudaEvent>>) {
        self.work.wait_fences(fences);
    }

    fn uses_nccl(&self) -> bool {
        !self.xfers.is_empty()
    }

    fn chan(&self) -> usize {
        self.channel.index()
    }

    /// The buffer set whose outcome word the kernels write.
    fn set(&self) -> usize {
        match &self.launch {
            Launch::Ll(p) => p.set as usize,
            Launch::Ht(_)
            | Launch::Exchange(_)
            | Launch::HtPlan(_)
            | Launch::NcclHt { .. }
            | Launch::NcclExchange { .. } => (self.seq % 2) as usize,
        }
    }

    /// Low-latency combine: the row map must still be the one of the paired dispatch; if a
    /// later dispatch rewrote it, the operation goes out as a cancellation (so the peers fail
    /// cleanly) and finishes with [`ValidationError::HandleRewritten`]. Otherwise the stream
    /// waits on the device for the paired dispatch's receive (unless the host saw it finish).
    /// Returns the handle to record this reader on, if any.
    fn claim_row_map(&mut self) -> Result<Option<GpuHandle>, Error> {
        let Some(GpuOpKind::Combine { handle, paired }) = &self.kind else { return Ok(None) };
        if self.state.is_cancelled() || !matches!(self.launch, Launch::Ll(_)) {
            return Ok(None);
        }
        let (handle, paired) = (handle.clone(), *paired);
        let (writer, event, writer_stream) = {
            let map = handle.row_map();
            (map.writer, map.writer_event.clone(), map.writer_stream)
        };
        if writer != Some(paired) {
            let rewritten_by = writer.unwrap_or(paired);
            self.refused = Some(ValidationError::HandleRewritten { paired, rewritten_by }.into());
            self.cancel_inputs();
            return Ok(None);
        }
        if let Some(ev) = event {
            wait_unless_same(self.work.stream(), &ev, writer_stream, "wait for the paired dispatch")?;
        }
        Ok(Some(handle))
    }

    /// After a combine's send kernel: records the handle's reader event (the next dispatch
    /// receive on the handle waits for it); returns this reader's number.
    fn record_reader(&self, handle: &GpuHandle, after: Option<&Arc<cudarc::driver::CudaEvent>>) -> Result<u64, Error> {
        let mut map = handle.row_map();
        let event = match after {
            // Recorded on this stream right after the reads already (a one-launch combine's
            // completion event): a second event there would only add a step to the stream.
            Some(e) => Arc::clone(e),
            None => {
                let e = match &map.reader_own {
                    Some(e) => Arc::clone(e),
                    None => {
                        let e = Arc::new(self.shared.ctx.new_event(None).map_err(|e| cuda("create event", e))?);
                        map.reader_own = Some(Arc::clone(&e));
                        e
                    }
                };
                e.record(self.work.stream()).map_err(|e| cuda("record event", e))?;
                e
            }
        };
        map.reader_event = Some(event);
        map.reader_stream = stream_id(self.work.stream());
        map.readers_sent += 1;
        Ok(map.readers_sent)
    }

    /// Whether the complete half can run in a caller's stream order without the host: a
    /// low-latency operation with data (not a cancellation, no NCCL peers: their row counts are
    /// read on the host), whose counters stay on the device; a high-throughput dispatch or
    /// combine over NVLink (one kernel, launched at the send) with its counters on the device;
    /// a high-throughput handle built on the device with `RecvRows::Bound`.
    fn stream_orderable(&self) -> bool {
        let host_counts = matches!(
            &self.kind,
            Some(GpuOpKind::Dispatch { opts, .. }) if opts.counts_location == epflow_core::ops::CountsLocation::Host
        );
        let ht_host_counts =
            matches!(&self.kind, Some(GpuOpKind::HtDispatch { outputs: Some(o), .. }) if o.1.is_some());
        let kernels = match (&self.launch, &self.kind) {
            (Launch::Ll(_), Some(GpuOpKind::Dispatch { .. } | GpuOpKind::Combine { .. })) => !host_counts,
            (Launch::Ht(_), Some(GpuOpKind::HtDispatch { .. } | GpuOpKind::HtCombine { .. })) => !ht_host_counts,
            // A handle built on the device whose received tensors do not depend on N.
            (Launch::HtPlan(_), Some(GpuOpKind::HtDeviceHandle(plan))) => plan.has_bound(),
            _ => false,
        };
        kernels && !self.state.is_cancelled() && self.refused.is_none() && !self.uses_nccl()
    }

    /// Whether this operation runs both low-latency halves as one cooperative launch: the
    /// synchronous form (or a whole operation in stream order) was asked for, it carries data
    /// to and from NVLink peers only (an NCCL exchange runs between the halves), and the rank
    /// allows it ([`crate::state::shared::RankShared::one_launch`]). Decided at the send.
    fn one_launch(&self) -> bool {
        self.at_once
            && self.shared.one_launch
            && matches!(self.launch, Launch::Ll(_))
            && matches!(self.kind, Some(GpuOpKind::Dispatch { .. } | GpuOpKind::Combine { .. }))
            && !self.state.is_cancelled()
            && self.refused.is_none()
            && !self.uses_nccl()
    }

    /// `EPFLOW_HOST_STEPS`: charges the time since the previous step of a high-throughput
    /// complete half to step `i`: 0 its end events, 1 the wait until the host saw it complete,
    /// 2 the finished result (a handle's, or a dispatch's or combine's).
    fn complete_step(&mut self, i: usize) {
        const HANDLE: [&str; 3] = [
            "complete: high-throughput handle end events",
            "complete: high-throughput handle wait until seen done",
            "complete: high-throughput handle finish",
        ];
        const OP: [&str; 3] = [
            "complete: high-throughput end events",
            "complete: high-throughput wait until seen done",
            "complete: high-throughput finish",
        ];
        let names = if matches!(self.launch, Launch::HtPlan(_)) { &HANDLE } else { &OP };
        self.complete_steps.step(names[i]);
    }

    fn cancel_inputs(&mut self) {
        if self.state.cancel() {
            self.work.release_inputs();
        }
    }
}

impl Drop for GpuOp {
    /// An operation dropped before its completion was observed (an error path; the async runtime
    /// finishes abandoned operations instead) waits for its own device work, bounded by the
    /// device-side timeout, so the inputs it keeps alive are never freed while a kernel reads them.
    /// One whose end the host saw (`finished_on_device`) waits for nothing.
    fn drop(&mut self) {
        if !self.state.is_sent() || self.finished_on_device || bind(&self.shared.ctx).is_err() {
            return;
        }
        if self.uses_nccl() || matches!(self.launch, Launch::NcclExchange { .. }) {
            // An NCCL kernel waits for its peers without a deadline of its own. Dropping an
            // unfinished operation is an error path (a timeout, a failed launch): grant a tenth
            // of the group's timeout, then abort the communicators so the stream can drain
            // (under rank masking, revoke the channel's: the group goes on without the peer).
            let grace = (self.shared.config.timeout / 10).max(Duration::from_millis(100));
            let deadline = std::time::Instant::now() + grace;
            // The completion event, or (complete half never started) one recorded now.
            let probe = self.work.done().cloned().or_else(|| self.work.record_now().ok());
            let idle = || probe.as_ref().is_none_or(|e| e.try_is_complete().unwrap_or(true));
            while !idle() && std::time::Instant::now() < deadline {
                std::thread::sleep(Duration::from_micros(200));
            }
            if !self.pair_exchanges.is_empty() {
                // Under rank masking: a group timeout more for the peers (a live one posts its
                // side within it), then revoke the pairs that stalled (their transfers began
                // and did not end); a timeout more (a send kernel before them ends by its
                // device deadline), then every pair still pending. The receive ends by its
                // device deadline once every pair's exchange ended or was revoked.
                let wait = |limit: Duration| {
                    let until = std::time::Instant::now() + limit;
                    while !idle() && std::time::Instant::now() < until {
                        std::thread::sleep(Duration::from_micros(200));
                    }
                };
                for even_unstarted in [false, true] {
                    wait(self.shared.config.timeout);
                    if !idle() {
                        let _ = self.revoke_stalled_exchanges(even_unstarted);
                    }
                }
            } else if !idle() {
                if let Some(n) = &self.shared.nccl {
                    n.comms.abort();
                }
            }
        }
        self.work.synchronize();
    }
}

impl GpuOp {
    /// Under rank masking, the exchanges with NCCL peers that have not ended (the peer died:
    /// NCCL waits for it without a deadline): revokes those pairs and masks their peers at
    /// once, so the receive kernel, which runs once every pair's exchange ended, skips them
    /// (`transport/nccl_pairs.rs`): every channel's pair with such a peer goes.
    /// `even_unstarted`: also the exchanges whose send kernel has not ended (a dropped
    /// operation's last resort). `Ok(true)`:
    /// an exchange was pending (its pair revoked, now or by another operation); `Ok(false)`:
    /// nothing was (no masking, no NCCL peer, or every exchange ended).
    fn revoke_stalled_exchanges(&self, even_unstarted: bool) -> Result<bool, Error> {
        let Some(pairs) = self.shared.nccl.as_ref().and_then(|n| n.pairs.as_ref()) else { return Ok(false) };
        let stalled = |x: &PairExchange| if even_unstarted { x.pending() } else { x.stalled() };
        let pending = |x: &&PairExchange| stalled(x) && pairs.current(self.chan(), x);
        let dead = self.pair_exchanges.iter().filter(pending).fold(0u64, |m, x| m | 1 << x.peer);
        if dead == 0 {
            return Ok(false);
        }
        for peer in (0..self.shared.num_ranks).filter(|&p| dead >> p & 1 == 1) {
            pairs.revoke_peer(peer);
        }
        // A rank its peers masked does not spread masks of its own (its exchanges stall because
        // the others skip it), as the kernels' spread does not.
        if (self.shared.mask_mirror() >> self.shared.rank) & 1 == 0 {
            mask_kernels::spread_mask(&self.shared, dead)?;
        }
        Ok(true)
    }

    /// The outputs of a stream-ordered completion, ready after `done`, `stream` a consumer.
    fn stream_outputs_after(
        &mut self,
        done: &Arc<cudarc::driver::CudaEvent>,
        stream: &Arc<CudaStream>,
    ) -> Result<GpuOpOutput, Error> {
        let mut out = self.stream_outputs()?;
        match &mut out {
            OpOutput::Dispatch(d) => d.ready_after(done),
            OpOutput::Combine(c) => c.ready_after(done),
            _ => {}
        }
        record_output_stream(&out, stream);
        Ok(out)
    }
}

/// Makes `on` wait for `event`, recorded on the stream `recorded_on` ([`stream_id`]); nothing
/// when that is `on` itself (stream order already has it).
pub(crate) fn wait_unless_same(
    on: &CudaStream,
    event: &cudarc::driver::CudaEvent,
    recorded_on: usize,
    what: &str,
) -> Result<(), Error> {
    if stream_id(on) == recorded_on {
        return Ok(());
    }
    on.wait(event).map_err(|e| cuda(what, e))
}

/// Runs `launch`, which enqueues a kernel of channel `chan` on `on` and returns an event after
/// it, in the channel's order on the device ([`RankShared::last_launch`]): `on` first waits for
/// the channel's last such kernel when that ran on another stream, and the new kernel becomes the
/// last one. The channel's lock is held through the launch; `what` names the wait in errors.
pub(crate) fn in_channel_order(
    s: &RankShared,
    chan: usize,
    on: &CudaStream,
    what: &str,
    launch: impl FnOnce() -> Result<Arc<cudarc::driver::CudaEvent>, Error>,
) -> Result<Arc<cudarc::driver::CudaEvent>, Error> {
    in_channels_order(s, &[chan], on, what, launch)
}

/// [`in_channel_order`] for a launch that runs kernels of every channel of `chans` (a captured
/// step's replay), given in ascending order: their locks are taken in that order (an operation
/// takes one channel's, so no two callers wait for each other) and held through the launch, `on`
/// waits for each channel's last kernel, and the new work becomes the last one of each. Nothing
/// becomes the last one when `launch` fails.
pub(crate) fn in_channels_order(
    s: &RankShared,
    chans: &[usize],
    on: &CudaStream,
    what: &str,
    launch: impl FnOnce() -> Result<Arc<cudarc::driver::CudaEvent>, Error>,
) -> Result<Arc<cudarc::driver::CudaEvent>, Error> {
    let mut lasts: Vec<_> = chans.iter().map(|&c| s.last_launch[c].lock().unwrap_or_else(|e| e.into_inner())).collect();
    for f in lasts.iter().filter_map(|l| l.as_ref()) {
        wait_unless_same(on, &f.event, f.stream, what)?;
    }
    let done = launch()?;
    for last in &mut lasts {
        **last = Some(StreamFence { event: Arc::clone(&done), stream: stream_id(on) });
    }
    Ok(done)
}

/// Declares `stream` a consumer of the outputs in `out`.
fn record_output_stream(out: &GpuOpOutput, stream: &Arc<CudaStream>) {
    match out {
        OpOutput::Dispatch(d) => d.record_stream(stream),
        OpOutput::Combine(c) => c.record_stream(stream),
        _ => {}
    }
}

impl PendingOp for GpuOp {
    type Output = GpuOpOutput;
    type Stream = Arc<CudaStream>;

    fn id(&self) -> OpId {
        OpId { rank: self.shared.rank, channel: self.channel, seq: self.seq }
    }

    fn needs_slot(&self) -> bool {
        matches!(self.launch, Launch::Ll(_)) && !matches!(self.kind, Some(GpuOpKind::Cancellation))
    }

    /// At the host deadline, under rank masking with NCCL peers: revokes the pairs whose
    /// exchange has not ended and masks their peers (`GpuOp::revoke_stalled_exchanges`); the
    /// caller then waits again (once per operation).
    fn mask_missing(&mut self) -> Result<bool, Error> {
        if self.revoked {
            return Ok(false);
        }
        self.revoked = self.revoke_stalled_exchanges(false)?;
        Ok(self.revoked)
    }

    fn poll_send_ready(&mut self) -> Result<bool, Error> {
        Ok(self.state.is_sent() || self.shared.turns[self.chan()].load(Ordering::Acquire) == self.seq)
    }

    fn send(&mut self, mut slot: Option<SlotGuard>) -> Result<(), Error> {
        if self.state.is_sent() {
            return Ok(());
        }
        let s = Arc::clone(&self.shared);
        let mut steps = Steps::start();
        if let (true, Some(caller)) = (self.one_launch(), self.caller.take()) {
            // A whole operation in stream order: its one kernel runs on the caller's stream
            // itself, not on the channel's behind an event of the caller's and with the caller's
            // stream waiting for its end (two waits between streams on the device, measured at
            // 0.5-1 us of a combine: benches/NOTES.md item 93).
            self.work.set_stream(&caller);
        }
        let result = (|| {
            self.work.begin_send(s.timing.load(Ordering::Relaxed) && !self.state.is_cancelled())?;
            steps.step("send: bind, input waits, fences, start event");
            let reader = self.claim_row_map()?;
            steps.step("send: row map claim");
            match self.launch {
                Launch::Ll(_) if self.one_launch() => {
                    // Both halves: the kernel writes the buffer set, so it waits for the set's
                    // previous consumers first (the fences the slot carries).
                    let which = if self.chan() == 0 { LlKernel::DispatchOne } else { LlKernel::CombineOne };
                    let fences = slot.as_mut().map(SlotGuard::take_fences).unwrap_or_default();
                    let on = Arc::clone(self.work.stream());
                    // One channel's one-launch grids never overlap (see `RankShared::last_launch`):
                    // behind the previous one if it ran on another stream.
                    let chan = self.chan();
                    let done =
                        in_channel_order(&s, chan, &on, "order after the channel's last one-launch kernel", || {
                            self.launch_completing(&on, which, fences, &mut steps)
                        })?;
                    self.one_launched = true;
                    self.completing = true;
                    if let Some(h) = reader {
                        self.reader = Some(self.record_reader(&h, Some(&done))?);
                    }
                    steps.step("send: reader event");
                    // `launch_completing` marked the end of the send half.
                    return Ok(());
                }
                Launch::Ll(_) => {
                    let which = if self.chan() == 0 { LlKernel::DispatchSend } else { LlKernel::CombineSend };
                    let on = Arc::clone(self.work.stream());
                    self.launch_ll(which, &on)?;
                    steps.step(which.step_name());
                    if let Some(h) = reader {
                        self.reader = Some(self.record_reader(&h, None)?);
                    }
                    if self.uses_nccl() {
                        // Kept even when a later pair fails: the stream waits for the earlier.
                        let mut out = Vec::new();
                        let issued = self.issue_xfers(&mut out);
                        self.pair_exchanges = out;
                        issued?;
                    }
                    // A receive completed on a caller's stream waits for this event: the end of
                    // this operation's send half, not of whatever is enqueued later.
                    if !self.state.is_cancelled() {
                        self.sent = Some(self.work.record_now()?);
                    }
                }
                _ => {
                    self.launch_single()?;
                    steps.step(match self.launch {
                        Launch::HtPlan(_) => "send: high-throughput handle launch",
                        _ => "send: launch",
                    });
                }
            }
            self.work.end_send()
        })();
        // The turn passes on even if the launch failed, so later operations are not stuck
        // behind this one (the group is poisoned by the error anyway).
        s.turns[self.chan()].store(self.seq + 1, Ordering::Release);
        result?;
        self.state.mark_sent(slot);
        Ok(())
    }

    fn is_sent(&self) -> bool {
        self.state.is_sent()
    }

    fn cancel(&mut self) {
        self.cancel_inputs();
    }

    fn will_complete_at_once(&mut self) {
        self.at_once = true;
    }

    fn start_complete(&mut self) -> Result<(), Error> {
        if self.completing {
            return Ok(());
        }
        bind(&self.shared.ctx)?;
        if matches!(self.launch, Launch::Ll(_)) {
            let on = Arc::clone(self.work.stream());
            self.launch_recv(&on)?;
        } else {
            self.complete_steps = Steps::start();
            self.work.end_complete_after_send()?;
            self.complete_step(0);
        }
        self.completing = true;
        Ok(())
    }

    fn poll_complete(&mut self) -> Result<bool, Error> {
        if let Some(e) = self.device_error() {
            return Err(e);
        }
        // A handle built on the device: done once its built word reads this creation (mapped
        // memory, no driver call; a few µs before the kernel ends). A failed creation never
        // writes it: the completion event decides then, asked every 16th poll.
        if let Some(GpuOpKind::HtDeviceHandle(plan)) = &self.kind {
            if plan.built(self.seq) {
                self.finished_on_device = true;
                self.complete_step(1);
                return Ok(true);
            }
            self.quiet_polls = self.quiet_polls.wrapping_add(1);
            if self.quiet_polls % 16 != 0 {
                return Ok(false);
            }
        }
        // Until the receive's block 0 published the outcome word (once every source arrived)
        // its kernel cannot have ended: skip the driver call (fewer driver calls; benches/NOTES.md item 40 measured no
        // change in the launches beside it). Every 16th poll asks the driver anyway, so a path
        // that never publishes (none known) still completes.
        if !self.outcome_published() {
            self.quiet_polls = self.quiet_polls.wrapping_add(1);
            if self.quiet_polls % 16 != 0 {
                return Ok(false);
            }
        }
        let done = self.work.is_complete()?;
        if done {
            self.finished_on_device = true;
            self.complete_step(1);
        }
        Ok(done)
    }

    fn finish(mut self) -> Result<GpuOpOutput, Error> {
        if let Some(e) = self.device_error() {
            return Err(e);
        }
        let out = self.finish_kind();
        self.complete_step(2);
        // (Inert but for a high-throughput complete half: `start_complete` starts it.)
        let mut steps = std::mem::replace(&mut self.complete_steps, Steps::inert());
        drop(self);
        steps.step("complete: high-throughput drop of the finished operation");
        out
    }

    /// Orders this operation's send half after the work enqueued on the caller's stream so far;
    /// before the send only. A high-throughput kernel (dispatch, combine, a handle built on the
    /// device) then simply runs on that stream (no event between the streams; the channel's
    /// previous kernel, if it ran elsewhere, is waited for at the launch), and so does a
    /// low-latency operation sent as one launch; others make their stream wait for an event
    /// there.
    fn order_after(&mut self, stream: &Arc<CudaStream>) -> Result<(), Error> {
        if self.state.is_sent() {
            return Err(Error::Backend(format!("{} was already sent: too late to order it", self.label())));
        }
        if matches!(self.launch, Launch::Ht(_) | Launch::HtPlan(_)) {
            self.work.set_stream(stream);
            return Ok(());
        }
        // Low-latency: the channel's stream waits for the caller's, unless the send finds that
        // both halves go out as one launch, which then runs on the caller's stream itself.
        if matches!(self.launch, Launch::Ll(_)) {
            self.caller = Some(Arc::clone(stream));
        }
        self.work.order_after(stream)
    }

    /// Low-latency operations with data complete in `stream`'s order without the host
    /// ([`StreamOrder`] says where the receive kernel runs); the outputs are views into the buffer
    /// set, `stream` a consumer. Every other operation (high-throughput, NCCL peers, counters on
    /// the host, cancellations) completes on its own stream and returns once the host saw it
    /// finish, with `stream` waiting for it: same semantics, not the same overlap.
    fn complete_on(&mut self, stream: &Arc<CudaStream>, order: StreamOrder) -> Result<Option<GpuOpOutput>, Error> {
        bind(&self.shared.ctx)?;
        if !self.stream_orderable() {
            self.start_complete()?;
            if !self.poll_complete()? {
                return Ok(None);
            }
            if let Some(e) = self.device_error() {
                return Err(e);
            }
            let out = self.finish_kind()?;
            if let Some(done) = self.work.done() {
                stream.wait(done).map_err(|e| cuda("order the caller's stream", e))?;
            }
            record_output_stream(&out, stream);
            return Ok(Some(out));
        }
        if !matches!(self.launch, Launch::Ll(_)) {
            // High-throughput: the one kernel (or the handle's kernels) went out at the send;
            // the caller's stream waits for its completion event.
            self.start_complete()?;
            let done = self.work.done().cloned().ok_or_else(|| Error::Backend("no completion event".into()))?;
            wait_unless_same(stream, &done, stream_id(self.work.stream()), "order the caller's stream")?;
            return self.stream_outputs_after(&done, stream).map(Some);
        }
        if self.one_launched {
            // Both halves ran as one launch on the operation's stream (the caller's, for a send
            // issued with `send_on`).
            let done =
                self.work.done().cloned().ok_or_else(|| Error::Backend("one launch without its event".into()))?;
            wait_unless_same(stream, &done, stream_id(self.work.stream()), "order the caller's stream")?;
            return self.stream_outputs_after(&done, stream).map(Some);
        }
        if self.completing {
            return Err(Error::Backend(format!("{} is already completing", self.label())));
        }
        let recv_stream = match order {
            StreamOrder::OnStream => {
                // The receive follows the send half of the same operation (on the same stream,
                // stream order has it).
                if stream_id(stream) != stream_id(self.work.stream()) {
                    let sent = match &self.sent {
                        Some(e) => Arc::clone(e),
                        None => self.work.record_now()?,
                    };
                    stream.wait(&sent).map_err(|e| cuda("order after the send half", e))?;
                }
                Arc::clone(stream)
            }
            StreamOrder::Ordered => Arc::clone(self.work.stream()),
        };
        let done = self.launch_recv(&recv_stream)?;
        self.completing = true;
        if order == StreamOrder::Ordered {
            stream.wait(&done).map_err(|e| cuda("order the caller's stream", e))?;
        }
        self.stream_outputs_after(&done, stream).map(Some)
    }

    fn verdict(&mut self) -> Result<(), Error> {
        if let Some(e) = self.device_error() {
            return Err(e);
        }
        self.stream_verdict()
    }

    fn send_probe(&self) -> Box<dyn Probe> {
        let (shared, chan, seq) = (Arc::clone(&self.shared), self.chan(), self.seq);
        Box::new(move || shared.turns[chan].load(Ordering::Acquire) == seq)
    }

    fn complete_probe(&self) -> Box<dyn Probe> {
        let shared = Arc::clone(&self.shared);
        let done = self.work.done().cloned();
        Box::new(move || {
            if shared.mem.status.read_u64(crate::params::status::ERROR) != 0 {
                return true;
            }
            match &done {
                Some(e) => crate::device::event_done(&shared.ctx, e),
                None => true,
            }
        })
    }

    fn traffic(&self) -> (u64, u64) {
        let (tokens, hidden) = match &self.launch {
            Launch::Ll(p) => (p.num_tokens as u64, p.hidden as u64),
            Launch::Ht(p) => (p.num_tokens as u64, p.hidden as u64),
            Launch::NcclHt { p, .. } => (p.num_tokens as u64, p.hidden as u64),
            Launch::Exchange(_) | Launch::HtPlan(_) | Launch::NcclExchange { .. } => (0, 0),
        };
        (tokens * hidden * 2, tokens)
    }

    fn waiting_for(&self) -> String {
        if !self.state.is_sent() {
            format!(
                "its turn to send ({} #{} has not been sent yet)",
                self.channel,
                self.shared.turns[self.chan()].load(Ordering::Acquire)
            )
        } else if let (Some(n), true) = (&self.shared.nccl, self.uses_nccl()) {
            let peers: Vec<String> = self
                .xfers
                .iter()
                .map(|x| x.peer)
                .filter(|&p| p != self.shared.rank)
                .map(|p| format!("rank {p}"))
                .collect::<std::collections::BTreeSet<_>>()
                .into_iter()
                .collect();
            let nvlink = (0..self.shared.num_ranks).filter(|&r| !n.via_nccl(r)).count() > 1;
            format!(
                "the NCCL exchange with {}{}",
                peers.join(", "),
                if nvlink { " or the device (NVLink peers' data or credits)" } else { "" }
            )
        } else {
            "the device to finish (the peers' data or credits)".into()
        }
    }
}

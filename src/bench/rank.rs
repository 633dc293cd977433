//! What the benchmark loop needs of a backend ([`BenchRank`], [`DeviceClock`]) and the loop's
//! settings ([`LoopPlan`]).

use std::borrow::Cow;
use std::time::Duration;

use epflow_core::backend::Backend;
use epflow_core::ops::{CombineOutputs, DispatchOutputs, Layout};
use epflow_core::scenario::Scenario;
use epflow_core::verify::Report;
use epflow_core::{Error, HostTensor};

use super::stats::RankTimes;

/// What a backend adds to [`Backend`] so the benchmark can drive it.
pub(crate) trait BenchRank {
    /// The backend.
    type B: Backend;
    /// The backend of this rank.
    fn backend(&self) -> &Self::B;
    /// Puts a host tensor where the backend reads its inputs.
    fn upload(&self, t: &HostTensor) -> Result<<Self::B as Backend>::Tensor, Error>;
    /// Dispatch outputs as host tensors (for validation).
    fn dispatch_to_host<'a>(
        &self,
        out: &'a <Self::B as Backend>::DispatchOutput,
    ) -> Result<Cow<'a, DispatchOutputs<HostTensor>>, Error>;
    /// Combine outputs as host tensors (for validation).
    fn combine_to_host<'a>(
        &self,
        out: &'a <Self::B as Backend>::CombineOutput,
    ) -> Result<Cow<'a, CombineOutputs<HostTensor>>, Error>;
    /// The combine input of identity experts: each expert returns its dispatched rows (FP8
    /// rows dequantized to BF16).
    fn identity_experts<'a>(
        &self,
        out: &'a <Self::B as Backend>::DispatchOutput,
    ) -> Result<Cow<'a, <Self::B as Backend>::Tensor>, Error>
    where
        <Self::B as Backend>::Tensor: Clone;
    /// Waits until every rank reaches this point.
    fn barrier(&self);
    /// Runs `f` and measures it on the host clock.
    fn timed<T>(&self, f: impl FnOnce() -> Result<T, Error>) -> Result<(T, Duration), Error> {
        let start = std::time::Instant::now();
        let v = f()?;
        Ok((v, start.elapsed()))
    }
    /// The device's own measurement of a dispatch as (send half, complete half): CUDA events
    /// before the send half, between the halves and after the complete half. When the backend
    /// has one, their sum replaces the host clock's time.
    fn dispatch_time(&self, _out: &<Self::B as Backend>::DispatchOutput) -> Option<(Duration, Duration)> {
        None
    }
    /// The device's own measurement of a combine; see [`BenchRank::dispatch_time`].
    fn combine_time(&self, _out: &<Self::B as Backend>::CombineOutput) -> Option<(Duration, Duration)> {
        None
    }
    /// The device's own measurement of a handle's awaited creation (CUDA events before its
    /// kernels and after them), when the backend has one (high-throughput handles on GPUs).
    fn handle_time(&self, _h: &<Self::B as Backend>::Handle) -> Option<Duration> {
        None
    }
    /// `--graph`: captures dispatch + combine of `sc` as one step and times `plan`'s replays
    /// (device time each); the first replay's combine is checked against `want` when given.
    /// `None`: the backend captures no steps.
    fn graph_replays(
        &self,
        _sc: &Scenario,
        _plan: &LoopPlan,
        _want: Option<&[epflow_core::bf16]>,
    ) -> Option<Result<(RankTimes, Option<Report>), Error>> {
        None
    }
    /// Turns the operations' own timing events (the eager loop's device times) on or off: a
    /// loop timed by a [`DeviceClock`] keeps them off the stream it measures. The default
    /// does nothing (no events to record).
    fn set_op_timing(&self, _on: bool) {}
    /// A stream of this rank to order a `--fresh-routing` training step on (stream-ordered
    /// handle creation, dispatch and combine); `None`: the backend has no stream-ordered
    /// operations (NCCL EP's), the step is only timed as blocking operations.
    fn step_stream(&self) -> Option<<Self::B as Backend>::Stream> {
        None
    }
    /// Before a stream-ordered step: keeps `stream` busy for `busy` (a spin kernel standing
    /// for the previous layer's compute, so the host enqueues the step while the device works,
    /// as in training), then (every peer on NVLink) the ranks meet on the device, so that their
    /// spins, enqueued at different host times, do not end apart; then starts a device clock
    /// there. Collective (every rank calls it alike); `None` where there is no device.
    fn start_device_clock(
        &self,
        _stream: &<Self::B as Backend>::Stream,
        _busy: Duration,
    ) -> Result<Option<Box<dyn DeviceClock>>, Error> {
        Ok(None)
    }
    /// Whether dispatch leaves rows in arrival order (NCCL EP: inside a low-latency expert, and
    /// across a high-throughput receive, whose top-k entries it also writes compactly), so
    /// validation finds each expected row by its content instead of by its position.
    fn rows_in_arrival_order(&self) -> bool {
        false
    }
}

/// A device clock on a stream (CUDA events): started behind the work enqueued there,
/// stopped behind the work enqueued until [`DeviceClock::stop`].
pub(crate) trait DeviceClock {
    /// Marks the end of the first part (a step's handle creation, a queued pair's dispatch) on
    /// the clock's stream.
    fn lap(&mut self) -> Result<(), Error>;
    /// Marks the end on the stream the clock started on.
    fn stop(&mut self) -> Result<(), Error>;
    /// Microseconds from the start to the end, and to the lap (after the stream reached the
    /// end).
    fn elapsed_us(&self) -> Result<(f64, f64), Error>;
    /// Whether the stream has already passed the start (the work ahead of it is done): asked
    /// once everything timed is enqueued, `true` means the device waited for the host.
    fn started(&self) -> Result<bool, Error>;
}

/// Settings of the loop.
pub(crate) struct LoopPlan {
    pub warmup: usize,
    pub iters: usize,
    pub staged: bool,
    /// Low-latency receive layout of the handle.
    pub layout: Layout,
    /// `--fresh-routing`: high-throughput, every iteration is a training step on a new routing
    /// (handle, forward pair, backward pair); low-latency, every `--queued` pair runs on a new
    /// routing, its handle built in the stream's order; `masked` entries of each routing are -1.
    pub fresh_routing: Option<usize>,
    /// Low-latency `--graph`: also time replays of a captured dispatch + combine step.
    pub graph: bool,
    /// Low-latency `--queued`: also time dispatch and combine enqueued ahead of the device.
    pub queued: bool,
}

impl LoopPlan {
    /// The loop the flags ask for.
    pub(crate) fn from_args(args: &crate::cli::BenchArgs) -> Self {
        LoopPlan {
            warmup: args.warmup,
            iters: args.iters,
            staged: args.staged,
            layout: args.layout.layout(),
            fresh_routing: args.fresh_routing.then_some(args.masked),
            graph: args.graph,
            queued: args.queued,
        }
    }
}

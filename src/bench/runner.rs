//! The per-rank benchmark loop, generic over the backend.

use std::borrow::Cow;
use std::time::Duration;

use epflow_core::backend::{
    Backend, blocking_combine, blocking_combine_on, blocking_dispatch, blocking_dispatch_on, blocking_handle,
    blocking_handle_on, blocking_handle_with,
};
use epflow_core::handle::RoutingHandle;
use epflow_core::ops::{
    CombineInputs, CombineOptions, CombineOutputs, DispatchInputs, DispatchOptions, DispatchOutputs, HandleOptions,
    Layout, Pass, RecvRows,
};
use epflow_core::reference::{HtDispatchResult, LlDispatchResult, RankMajorDispatchResult};
use epflow_core::scenario::{Scenario, rank_major_identity_expert_outputs};
use epflow_core::verify::{
    Report, Tolerance, check_bf16, check_ht_dispatch, check_ll_dispatch, check_rank_major_dispatch, ht_rows_by_content,
    ll_rows_by_content,
};
use epflow_core::workload::{RoutingKind, RoutingSpec, random_topk_idx};
use epflow_core::{Algorithm, Error, HostData, HostTensor};

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
    /// A stream of this rank to order a `--fresh-routing` training step on (stream-ordered
    /// handle creation, dispatch and combine); `None`: the backend has no stream-ordered
    /// operations (NCCL EP's), the step is only timed as blocking operations.
    fn step_stream(&self) -> Option<<Self::B as Backend>::Stream> {
        None
    }
    /// Before a stream-ordered step: keeps `stream` busy for `busy` (a spin kernel standing
    /// for the previous layer's compute, so the host enqueues the step while the device works,
    /// as in training) and starts a device clock behind it; `None` where there is no device.
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

/// The spin before a stream-ordered step ([`BenchRank::start_device_clock`]): longer than the
/// host takes to enqueue the step, shorter than the step.
const STEP_LEAD: Duration = Duration::from_micros(300);

/// The reference results of the benchmark's scenario.
pub(crate) enum References {
    Ll { dispatch: Vec<LlDispatchResult>, combine: Vec<Vec<epflow_core::bf16>> },
    RankMajor { dispatch: Vec<RankMajorDispatchResult>, combine: Vec<Vec<epflow_core::bf16>> },
    Ht { dispatch: Vec<HtDispatchResult>, combine: Vec<Vec<epflow_core::bf16>> },
}

/// What one rank measured.
pub(crate) struct RankResult {
    /// High-throughput: handle creation (the collective count exchange), host clock.
    pub handle: RankTimes,
    pub dispatch: RankTimes,
    pub combine: RankTimes,
    pub total: RankTimes,
    /// Device times (us) of the dispatch send half, dispatch complete half, combine send half,
    /// combine complete half, when the backend measures them.
    pub halves: [Vec<f64>; 4],
    pub dispatch_check: Option<Report>,
    pub combine_check: Option<Report>,
    /// `--graph`: device time (us) of each replay of the captured dispatch + combine step.
    pub graph: RankTimes,
    /// `--fresh-routing`: the training step in stream order (host clock from the barrier to
    /// the last verdict).
    pub stream_step: RankTimes,
    /// `--fresh-routing`: the same step's device time (CUDA events around it, the host
    /// enqueueing it behind a spin).
    pub stream_step_device: RankTimes,
    /// `--fresh-routing`: the device time of the step's handle creation (from the step's start
    /// to after the plan kernels).
    pub stream_handle_device: RankTimes,
    /// Low-latency `--queued`: device time of the dispatch and of the combine, enqueued in
    /// stream order behind a spin kernel ([`queued_pairs`]).
    pub queued: [RankTimes; 2],
    /// Where `dispatch` and `combine` are device times: the host clock around the same
    /// blocking dispatch and combine (until the host saw each finish), as ep_bench's
    /// host-observed figures; empty otherwise.
    pub host_clock: [RankTimes; 2],
}

/// Settings of the loop.
pub(crate) struct LoopPlan {
    pub warmup: usize,
    pub iters: usize,
    pub staged: bool,
    /// Low-latency receive layout of the handle.
    pub layout: Layout,
    /// High-throughput `--fresh-routing`: every iteration is a training step on a new routing
    /// (handle, forward pair, backward pair); `masked` entries of each routing are -1.
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

/// Distinct routings a `--fresh-routing` run cycles through (uploaded before timing; each
/// iteration still builds its handle from scratch).
const FRESH_ROUTINGS: usize = 8;

/// The [`FRESH_ROUTINGS`] routings of this rank a `--fresh-routing` run cycles through (uniform,
/// `masked` entries -1), uploaded.
fn fresh_routings<R: BenchRank>(r: &R, sc: &Scenario, masked: usize) -> Result<Vec<<R::B as Backend>::Tensor>, Error> {
    let b = r.backend();
    let (rank, cfg) = (b.rank(), b.config());
    let num_tokens = sc.ranks[rank].num_tokens;
    let spec = RoutingSpec {
        num_tokens,
        top_k: sc.top_k,
        num_experts: cfg.num_experts,
        num_ranks: sc.num_ranks,
        masked,
        kind: RoutingKind::Uniform,
    };
    (0..FRESH_ROUTINGS)
        .map(|i| {
            let idx = random_topk_idx(&spec, 0xf7e5_0000 ^ i as u64, rank);
            r.upload(&HostTensor::topk_idx(num_tokens, sc.top_k, idx))
        })
        .collect()
}

/// `--fresh-routing`: per iteration, a handle for a new routing, then the forward dispatch and
/// combine (identity experts) and the backward dispatch and combine on that handle, each
/// behind a barrier. Returns the handle times and the forward dispatch, forward combine and
/// whole-step times.
fn fresh_routing_steps<R: BenchRank>(
    r: &R,
    sc: &Scenario,
    plan: &LoopPlan,
    masked: usize,
    inputs: DispatchInputs<'_, <R::B as Backend>::Tensor>,
) -> Result<(RankTimes, [RankTimes; 3]), Error>
where
    <R::B as Backend>::Tensor: Clone,
{
    let b = r.backend();
    let rank = b.rank();
    let routings = fresh_routings(r, sc, masked)?;
    // Backward: the BF16 tokens stand for the output gradients.
    let grads = r.upload(&sc.tokens(rank))?;
    let (fwd_d, fwd_c) = (DispatchOptions::default(), CombineOptions::default());
    let bwd_d = DispatchOptions { pass: Pass::Backward, ..DispatchOptions::default() };
    let bwd_c = CombineOptions { pass: Pass::Backward };
    let (mut handle_times, mut times) =
        (RankTimes::default(), [RankTimes::default(), RankTimes::default(), RankTimes::default()]);
    for i in 0..plan.warmup + plan.iters {
        r.barrier();
        let (h, th) = r.timed(|| blocking_handle(b, &routings[i % FRESH_ROUTINGS]))?;
        let n = h.num_recv_tokens().unwrap_or(0);
        r.barrier();
        let (d, td) = r.timed(|| blocking_dispatch(b, &h, inputs, &fwd_d, false))?;
        let experts = r.identity_experts(&d)?;
        r.barrier();
        let (c, tc) = r.timed(|| blocking_combine(b, &h, CombineInputs::new(&experts), &fwd_c, false))?;
        drop(c);
        drop(experts);
        drop(d);
        let weight_grads = r.upload(&HostTensor::topk_weights(n, sc.top_k, vec![0.5; n * sc.top_k]))?;
        r.barrier();
        let (gd, tbd) = r.timed(|| blocking_dispatch(b, &h, DispatchInputs::new(&grads), &bwd_d, false))?;
        let rows = r.identity_experts(&gd)?;
        r.barrier();
        let (gc, tbc) =
            r.timed(|| blocking_combine(b, &h, CombineInputs::new(&*rows).with_weights(&weight_grads), &bwd_c, false))?;
        drop(gc);
        drop(rows);
        drop(gd);
        if i >= plan.warmup {
            handle_times.samples_us.push(th.as_secs_f64() * 1e6);
            for (t, v) in times.iter_mut().zip([td, tc, th + td + tc + tbd + tbc]) {
                t.samples_us.push(v.as_secs_f64() * 1e6);
            }
        }
    }
    Ok((handle_times, times))
}

/// `--fresh-routing` in stream order, as a trainer enqueues a layer's communication: per
/// iteration (after a barrier), a `RecvRows::Bound` handle for a new routing created in stream
/// order, the forward dispatch, the forward combine, the backward dispatch and the backward
/// combine on that handle, each enqueued on `stream` behind the previous one with no host wait
/// in between (the host never learns `N` first); then every verdict. Returns the host time
/// from the barrier to the last verdict and, where the backend has a device clock, the device
/// time of the five operations: the host enqueues them behind a spin kernel (the previous
/// layer's compute in a trainer), so the device does not wait for the host's launches. The
/// forward combine sends the dispatched rows back (BF16; for FP8 a kept `[bound x H]` BF16
/// buffer stands for the experts' outputs, ordered after the dispatch through `stream`).
fn stream_ordered_steps<R: BenchRank>(
    r: &R,
    sc: &Scenario,
    plan: &LoopPlan,
    masked: usize,
    inputs: DispatchInputs<'_, <R::B as Backend>::Tensor>,
    stream: &<R::B as Backend>::Stream,
) -> Result<[RankTimes; 3], Error>
where
    <R::B as Backend>::Tensor: Clone,
{
    let b = r.backend();
    let (rank, cfg) = (b.rank(), b.config());
    let routings = fresh_routings(r, sc, masked)?;
    let bound = epflow_core::validate::recv_bound(cfg, b.num_ranks());
    let h = cfg.hidden;
    let grads = r.upload(&sc.tokens(rank))?;
    let weight_grads = r.upload(&HostTensor::topk_weights(bound, sc.top_k, vec![0.5; bound * sc.top_k]))?;
    let kept = match cfg.dispatch_dtype.is_fp8() {
        true => Some(r.upload(&HostTensor::tokens(bound, h, vec![epflow_core::bf16::ZERO; bound * h]))?),
        false => None,
    };
    let hopts = HandleOptions::default().with_recv_rows(RecvRows::Bound);
    let bwd_d = DispatchOptions { pass: Pass::Backward, ..DispatchOptions::default() };
    let bwd_c = CombineOptions { pass: Pass::Backward };
    let (mut times, mut device, mut handle_device) = (RankTimes::default(), RankTimes::default(), RankTimes::default());
    for i in 0..plan.warmup + plan.iters {
        r.barrier();
        let start = std::time::Instant::now();
        let mut clock = r.start_device_clock(stream, STEP_LEAD)?;
        let (handle, created) = blocking_handle_on(b, &routings[i % FRESH_ROUTINGS], &hopts, stream)?;
        if let Some(c) = clock.as_mut() {
            c.lap()?;
        }
        let (d, ds) = blocking_dispatch_on(b, &handle, inputs, &DispatchOptions::default(), stream)?;
        // BF16 rows: the identity experts borrow them (FP8 ones would be dequantized on the host).
        let experts = match &kept {
            Some(k) => Cow::Borrowed(k),
            None => r.identity_experts(&d)?,
        };
        let (c, cs) =
            blocking_combine_on(b, &handle, CombineInputs::new(&*experts), &CombineOptions::default(), stream)?;
        let (gd, gds) = blocking_dispatch_on(b, &handle, DispatchInputs::new(&grads), &bwd_d, stream)?;
        let rows = r.identity_experts(&gd)?;
        let (gc, gcs) =
            blocking_combine_on(b, &handle, CombineInputs::new(&*rows).with_weights(&weight_grads), &bwd_c, stream)?;
        if let Some(c) = clock.as_mut() {
            c.stop()?;
        }
        if let Some(c) = created {
            c.settle()?;
        }
        for settle in [ds, cs, gds, gcs] {
            settle.settle()?;
        }
        let t = start.elapsed();
        drop((c, gc, experts, rows));
        drop((d, gd));
        if i >= plan.warmup {
            times.samples_us.push(t.as_secs_f64() * 1e6);
            if let Some(c) = &clock {
                let (total, handle) = c.elapsed_us()?;
                device.samples_us.push(total);
                handle_device.samples_us.push(handle);
            }
        }
    }
    Ok([times, device, handle_device])
}

/// The spin ahead of a `--queued` pair: far longer than the host takes to enqueue a dispatch
/// and a combine (tens of microseconds each; the warning below says when it was not).
const QUEUED_LEAD: Duration = Duration::from_millis(1);

/// Low-latency `--queued`: per iteration (after a barrier), the dispatch and the combine
/// enqueued on `stream` in stream order (each a whole operation: one launch on GPUs), behind a
/// spin kernel, so that the device reaches them with both already queued and never waits for
/// the host's launches; then both verdicts. Returns the device time of the dispatch (from the
/// end of the spin to after it) and of the combine (from there to after the combine): the
/// operations' own device time and the gap between the kernels, what NCCL EP's CUPTI kernel
/// column counts without the gaps. The combine's input is `fixed` (rank-major sums, or a kept
/// buffer standing for an FP8 dispatch's experts), else the identity experts' view of the
/// dispatched rows; `weights` are the combine's top-k weights (expert-major). Empty times where
/// the backend has no device clock.
fn queued_pairs<R: BenchRank>(
    r: &R,
    plan: &LoopPlan,
    stream: &<R::B as Backend>::Stream,
    handle: &<R::B as Backend>::Handle,
    inputs: DispatchInputs<'_, <R::B as Backend>::Tensor>,
    fixed: Option<&<R::B as Backend>::Tensor>,
    weights: Option<&<R::B as Backend>::Tensor>,
) -> Result<[RankTimes; 2], Error>
where
    <R::B as Backend>::Tensor: Clone,
{
    let b = r.backend();
    let (dopts, copts) = (DispatchOptions::default(), CombineOptions::default());
    let mut times = [RankTimes::default(), RankTimes::default()];
    let mut late = 0;
    // Host time (us) to enqueue the clock, the dispatch and the combine, per timed iteration.
    let mut enqueue: [Vec<f64>; 3] = Default::default();
    for i in 0..plan.warmup + plan.iters {
        r.barrier();
        let t0 = std::time::Instant::now();
        let Some(mut clock) = r.start_device_clock(stream, QUEUED_LEAD)? else {
            if b.rank() == 0 {
                eprintln!("note: --queued: this backend has no device clock (GPU backend only)");
            }
            return Ok(Default::default());
        };
        let t1 = std::time::Instant::now();
        let (d, ds) = blocking_dispatch_on(b, handle, inputs, &dopts, stream)?;
        clock.lap()?;
        let t2 = std::time::Instant::now();
        let y = match fixed {
            Some(t) => Cow::Borrowed(t),
            None => r.identity_experts(&d)?,
        };
        let mut cin = CombineInputs::new(&*y);
        if let Some(w) = weights {
            cin = cin.with_weights(w);
        }
        let (c, cs) = blocking_combine_on(b, handle, cin, &copts, stream)?;
        clock.stop()?;
        let was_late = clock.started()?;
        let t3 = std::time::Instant::now();
        ds.settle()?;
        cs.settle()?;
        let (total, disp) = clock.elapsed_us()?;
        drop((c, y));
        drop(d);
        if i >= plan.warmup {
            times[0].samples_us.push(disp);
            times[1].samples_us.push(total - disp);
            late += usize::from(was_late);
            for (v, (a, z)) in enqueue.iter_mut().zip([(t0, t1), (t1, t2), (t2, t3)]) {
                v.push((z - a).as_secs_f64() * 1e6);
            }
        }
    }
    if late > 0 {
        let med = |v: &mut Vec<f64>| {
            v.sort_by(f64::total_cmp);
            v.get(v.len() / 2).copied().unwrap_or(0.0)
        };
        let [c, d, k] = &mut enqueue;
        eprintln!(
            "warning: --queued, rank {}: in {late} of {} iterations the device reached the pair before the host had \
             enqueued it (those times include the host's lag); host enqueue medians: clock {:.1} us, dispatch {:.1} \
             us, combine {:.1} us, lead {} us",
            b.rank(),
            plan.iters,
            med(c),
            med(d),
            med(k),
            QUEUED_LEAD.as_micros()
        );
    }
    Ok(times)
}

/// Runs this rank's part: handle, optional validation round, warm-up, timed iterations.
pub(crate) fn run_rank<R: BenchRank>(
    r: &R,
    sc: &Scenario,
    refs: Option<&References>,
    plan: &LoopPlan,
) -> Result<RankResult, Error>
where
    <R::B as Backend>::Tensor: Clone,
{
    let b = r.backend();
    let rank = b.rank();
    let cfg = b.config().clone();
    let idx = r.upload(&sc.topk_idx(rank))?;
    let handle = blocking_handle_with(b, &idx, &HandleOptions::with_layout(plan.layout))?;
    let ht = cfg.algorithm == Algorithm::HighThroughput;
    let rank_major = plan.layout == Layout::RankMajor;
    let weights = r.upload(&sc.weights(rank))?;
    let (tokens, scales) = match (ht, sc.tokens_fp8(rank)) {
        (true, Some((q, s))) => (r.upload(&q)?, Some(r.upload(&s)?)),
        _ => (r.upload(&sc.tokens(rank))?, None),
    };
    let mut inputs = DispatchInputs::new(&tokens);
    if ht || rank_major {
        inputs = inputs.with_weights(&weights);
    }
    if let Some(s) = &scales {
        inputs = inputs.with_scales(s);
    }
    let dopts = DispatchOptions::default();
    let copts = CombineOptions::default();
    let staged = plan.staged && !ht;
    let rows_per_expert = sc.num_ranks * cfg.fixed_max_tokens().unwrap_or(0);

    let dispatch = || blocking_dispatch(b, &handle, inputs, &dopts, staged);
    let combine = |experts: &<R::B as Backend>::Tensor| -> Result<_, Error> {
        let mut cin = CombineInputs::new(experts);
        if !ht && !rank_major {
            cin = cin.with_weights(&weights);
        }
        blocking_combine(b, &handle, cin, &copts, staged)
    };

    // Rank-major combine input: the identity experts' pre-reduced sums of one dispatch, computed
    // here and uploaded once (as a server's experts write into a fixed buffer).
    let rank_major_sums = |host: &DispatchOutputs<HostTensor>| -> Result<<R::B as Backend>::Tensor, Error> {
        let sums = rank_major_identity_expert_outputs(
            host.tokens.data(),
            host.scales.as_ref().and_then(HostTensor::as_f32),
            host.topk_weights.as_ref().and_then(HostTensor::as_f32).unwrap_or_default(),
            host.topk_idx.as_ref().and_then(HostTensor::as_i32).unwrap_or_default(),
            host.counts.as_ref().and_then(HostTensor::as_i32).unwrap_or_default(),
            cfg.fixed_max_tokens().unwrap_or(0),
            cfg.hidden,
            sc.top_k,
        );
        r.upload(&sums)
    };
    let mut rank_major_input = None;

    let (mut dispatch_check, mut combine_check) = (None, None);
    if let Some(refs) = refs {
        r.barrier();
        let d = dispatch()?;
        let host = r.dispatch_to_host(&d)?;
        let scales_f32 = host.scales.as_ref().and_then(HostTensor::as_f32);
        let counts = host.counts.as_ref().and_then(HostTensor::as_i32).unwrap_or_default();
        let (drep, want) = match refs {
            References::RankMajor { dispatch, combine } => {
                let got_w = host.topk_weights.as_ref().and_then(HostTensor::as_f32).unwrap_or_default();
                let got_i = host.topk_idx.as_ref().and_then(HostTensor::as_i32).unwrap_or_default();
                let m = cfg.fixed_max_tokens().unwrap_or(0);
                let rep = check_rank_major_dispatch(
                    &dispatch[rank],
                    cfg.hidden,
                    m,
                    sc.top_k,
                    host.tokens.data(),
                    scales_f32,
                    got_w,
                    got_i,
                    counts,
                );
                (rep, &combine[rank])
            }
            References::Ll { dispatch, combine } => {
                let arranged = match (r.rows_in_arrival_order(), host.tokens.as_bf16()) {
                    (true, Some(got)) => {
                        Some(HostData::Bf16(ll_rows_by_content(&dispatch[rank], rows_per_expert, cfg.hidden, got)))
                    }
                    _ => None,
                };
                let tokens = arranged.as_ref().unwrap_or(host.tokens.data());
                (
                    check_ll_dispatch(&dispatch[rank], cfg.hidden, rows_per_expert, tokens, scales_f32, counts),
                    &combine[rank],
                )
            }
            References::Ht { dispatch, combine } => {
                let want = &dispatch[rank];
                let got_w = host.topk_weights.as_ref().and_then(HostTensor::as_f32).unwrap_or_default();
                let got_i = host.topk_idx.as_ref().and_then(HostTensor::as_i64).unwrap_or_default();
                let arranged = match (r.rows_in_arrival_order(), host.tokens.as_bf16()) {
                    (true, Some(got)) => Some(ht_rows_by_content(want, cfg.hidden, got, got_w, got_i)),
                    _ => None,
                };
                let rep = match arranged {
                    Some((t, w, i)) => check_ht_dispatch(want, &HostData::Bf16(t), scales_f32, &w, &i, counts),
                    None => check_ht_dispatch(want, host.tokens.data(), scales_f32, got_w, got_i, counts),
                };
                (rep, &combine[rank])
            }
        };
        let experts = if rank_major {
            let sums = rank_major_sums(&host)?;
            rank_major_input = Some(sums.clone());
            Cow::Owned(sums)
        } else {
            r.identity_experts(&d)?
        };
        drop(host);
        let c = combine(&experts)?;
        let chost = r.combine_to_host(&c)?;
        // Rank-major sums in one order on every backend: bit-exact.
        let tol = if rank_major { Tolerance::Exact } else { Tolerance::OneUlp };
        let crep = check_bf16("combine", want, chost.tokens.as_bf16().unwrap_or_default(), tol);
        dispatch_check = Some(drep.context(&format!("rank {rank} dispatch")));
        combine_check = Some(crep.context(&format!("rank {rank} combine")));
    }

    if rank_major && rank_major_input.is_none() {
        r.barrier();
        let d = dispatch()?;
        rank_major_input = Some(rank_major_sums(&*r.dispatch_to_host(&d)?)?);
    }

    if let (true, Some(masked)) = (ht, plan.fresh_routing) {
        let (handle, [mut d, mut c, t]) = fresh_routing_steps(r, sc, plan, masked, inputs)?;
        let [stream_step, stream_step_device, stream_handle_device] = match (r.step_stream(), cfg.fixed_max_tokens()) {
            (Some(s), Some(_)) => stream_ordered_steps(r, sc, plan, masked, inputs, &s)?,
            _ => Default::default(),
        };
        d.bytes = bench_bytes(sc, &cfg, rank, b.num_ranks()).unwrap_or(0);
        c.bytes = d.bytes;
        let halves = Default::default();
        let graph = RankTimes::default();
        return Ok(RankResult {
            handle,
            dispatch: d,
            combine: c,
            total: t,
            halves,
            dispatch_check,
            combine_check,
            graph,
            stream_step,
            stream_step_device,
            stream_handle_device,
            queued: Default::default(),
            host_clock: Default::default(),
        });
    }

    let mut times = [RankTimes::default(), RankTimes::default(), RankTimes::default()];
    let mut host_clock = [RankTimes::default(), RankTimes::default()];
    let mut halves: [Vec<f64>; 4] = Default::default();
    for i in 0..plan.warmup + plan.iters {
        if i == plan.warmup && rank == 0 {
            // `EPFLOW_HOST_STEPS` counts the timed iterations only: the warm-up's first launch of
            // each kernel loads it (milliseconds), which once made the dispatch's launch look
            // ~15 µs slow in a mean over a few hundred (benches/NOTES.md item 42).
            epflow_kernels::device::host_steps::take();
        }
        r.barrier();
        let (d, td_host) = r.timed(dispatch)?;
        let dh = r.dispatch_time(&d);
        let td = dh.map_or(td_host, |(a, b)| a + b);
        let experts = match &rank_major_input {
            Some(t) => Cow::Borrowed(t),
            None => r.identity_experts(&d)?,
        };
        r.barrier();
        let (c, tc_host) = r.timed(|| combine(&experts))?;
        let ch = r.combine_time(&c);
        let tc = ch.map_or(tc_host, |(a, b)| a + b);
        drop(c);
        drop(experts);
        drop(d);
        if i >= plan.warmup {
            for (t, v) in times.iter_mut().zip([td, tc, td + tc]) {
                t.samples_us.push(v.as_secs_f64() * 1e6);
            }
            for (t, (v, device)) in host_clock.iter_mut().zip([(td_host, dh.is_some()), (tc_host, ch.is_some())]) {
                if device {
                    t.samples_us.push(v.as_secs_f64() * 1e6);
                }
            }
            for (h, v) in halves.iter_mut().zip([dh.map(|x| x.0), dh.map(|x| x.1), ch.map(|x| x.0), ch.map(|x| x.1)]) {
                if let Some(v) = v {
                    h.push(v.as_secs_f64() * 1e6);
                }
            }
        }
    }
    let mut queued = [RankTimes::default(), RankTimes::default()];
    if plan.queued && !ht {
        match r.step_stream() {
            Some(stream) => {
                // An FP8 dispatch's identity experts are dequantized once, outside the timing.
                let kept = match (&rank_major_input, cfg.dispatch_dtype.is_fp8()) {
                    (None, true) => Some(r.identity_experts(&dispatch()?)?.into_owned()),
                    _ => None,
                };
                let fixed = rank_major_input.as_ref().or(kept.as_ref());
                let w = (!rank_major).then_some(&weights);
                queued = queued_pairs(r, plan, &stream, &handle, inputs, fixed, w)?;
            }
            None => eprintln!("note: --queued: this backend has no streams to enqueue on (GPU backend only)"),
        }
    }
    // High-throughput handles are collective (a count exchange): time their creation too.
    let mut handle_times = RankTimes::default();
    if ht {
        for _ in 0..HANDLE_SAMPLES {
            r.barrier();
            let (h, t) = r.timed(|| blocking_handle(b, &idx))?;
            drop(h);
            handle_times.samples_us.push(t.as_secs_f64() * 1e6);
        }
    }
    let mut graph = RankTimes::default();
    if plan.graph && !ht {
        let want = refs.and_then(|refs| match refs {
            References::Ll { combine, .. } | References::RankMajor { combine, .. } => Some(&combine[rank][..]),
            References::Ht { .. } => None,
        });
        match r.graph_replays(sc, plan, want) {
            Some(res) => {
                let (g, check) = res?;
                graph = g;
                if let (Some(check), Some(c)) = (check, combine_check.as_mut()) {
                    c.merge(check.context(&format!("rank {rank} graph replay combine")));
                }
            }
            None => eprintln!("note: --graph: this backend captures no steps (GPU backend only)"),
        }
    }
    let bytes = bench_bytes(sc, &cfg, rank, b.num_ranks()).unwrap_or(0);
    let [mut d, mut c, mut t] = times;
    d.bytes = bytes;
    c.bytes = bytes;
    t.bytes = 2 * bytes;
    Ok(RankResult {
        handle: handle_times,
        dispatch: d,
        combine: c,
        total: t,
        halves,
        dispatch_check,
        combine_check,
        graph,
        stream_step: RankTimes::default(),
        stream_step_device: RankTimes::default(),
        stream_handle_device: RankTimes::default(),
        queued,
        host_clock,
    })
}

/// High-throughput handle creations timed per rank.
pub(crate) const HANDLE_SAMPLES: usize = 20;

/// ep_bench's byte count for a rank: low-latency, valid selections x H x 2; high-throughput,
/// tokens received x H x 2.
fn bench_bytes(sc: &Scenario, cfg: &epflow_core::GroupConfig, rank: usize, num_ranks: usize) -> Option<u64> {
    let h = cfg.hidden as u64;
    match cfg.algorithm {
        Algorithm::LowLatency => Some(sc.valid_selections(rank) as u64 * h * 2),
        Algorithm::HighThroughput => {
            let routings = sc.routings().ok()?;
            let l = cfg.local_experts(num_ranks);
            let received: usize = routings
                .iter()
                .map(|ro| {
                    (0..ro.num_tokens())
                        .filter(|&t| (0..ro.top_k()).any(|k| ro.expert(t, k).is_some_and(|e| e / l == rank)))
                        .count()
                })
                .sum();
            Some(received as u64 * h * 2)
        }
    }
}

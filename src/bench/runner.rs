//! The per-rank benchmark loop, generic over the backend.

use std::borrow::Cow;

use epflow_core::backend::{Backend, blocking_combine, blocking_dispatch, blocking_handle_with};
use epflow_core::ops::{
    CombineInputs, CombineOptions, DispatchInputs, DispatchOptions, DispatchOutputs, HandleOptions, Layout,
};
use epflow_core::reference::{HtDispatchResult, LlDispatchResult, RankMajorDispatchResult};
use epflow_core::scenario::{Scenario, rank_major_identity_expert_outputs};
use epflow_core::verify::{
    Report, Tolerance, check_bf16, check_ht_dispatch, check_ll_dispatch, check_rank_major_dispatch, ht_rows_by_content,
    ll_rows_by_content,
};
use epflow_core::{Algorithm, Error, HostData, HostTensor};

use super::queued::queued_pairs;
use super::rank::{BenchRank, LoopPlan};
use super::stats::RankTimes;
use super::training::{fresh_routing_steps, fresh_routings, stream_ordered_steps};

/// The reference results of the benchmark's scenario.
pub(crate) enum References {
    Ll { dispatch: Vec<LlDispatchResult>, combine: Vec<Vec<epflow_core::bf16>> },
    RankMajor { dispatch: Vec<RankMajorDispatchResult>, combine: Vec<Vec<epflow_core::bf16>> },
    Ht { dispatch: Vec<HtDispatchResult>, combine: Vec<Vec<epflow_core::bf16>> },
}

/// What one rank measured.
#[derive(Default)]
pub(crate) struct RankResult {
    /// Handle creation, host clock: high-throughput, the collective count exchange; low-latency,
    /// the local routing plan and its upload.
    pub handle: RankTimes,
    /// The same creations' device time, where the backend measures it ([`BenchRank::handle_time`]).
    pub handle_device: RankTimes,
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
    // High-throughput refuses rank-major (`config_from_args`): its handles get the default options.
    let handle_opts = HandleOptions::with_layout(plan.layout);
    let handle = blocking_handle_with(b, &idx, &handle_opts)?;
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
        let ([handle, handle_device], [mut d, mut c, t]) = fresh_routing_steps(r, sc, plan, masked, inputs)?;
        let [stream_step, stream_step_device, stream_handle_device] = match (r.step_stream(), cfg.fixed_max_tokens()) {
            (Some(s), Some(_)) => stream_ordered_steps(r, sc, plan, masked, inputs, &s)?,
            _ => Default::default(),
        };
        d.bytes = bench_bytes(sc, &cfg, rank, b.num_ranks()).unwrap_or(0);
        c.bytes = d.bytes;
        return Ok(RankResult {
            handle,
            handle_device,
            dispatch: d,
            combine: c,
            total: t,
            dispatch_check,
            combine_check,
            stream_step,
            stream_step_device,
            stream_handle_device,
            ..Default::default()
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
                // --fresh-routing: a new routing per pair, its handle built in the stream's order.
                let routings = plan.fresh_routing.map(|masked| fresh_routings(r, sc, masked)).transpose()?;
                let fresh = routings.as_deref().map(|t| (t, &handle_opts));
                queued = queued_pairs(r, plan, &stream, &handle, inputs, fixed, w, fresh)?;
            }
            None => eprintln!("note: --queued: this backend has no streams to enqueue on (GPU backend only)"),
        }
    }
    // Handle creation, timed too: high-throughput handles are collective (a count exchange),
    // low-latency ones local (on GPUs one kernel the host waits for, `ll/handle.rs`), made with
    // the bench's layout.
    let (mut handle_times, mut handle_device) = (RankTimes::default(), RankTimes::default());
    for _ in 0..HANDLE_SAMPLES {
        r.barrier();
        let (h, t) = r.timed(|| blocking_handle_with(b, &idx, &handle_opts))?;
        handle_times.samples_us.push(t.as_secs_f64() * 1e6);
        if let Some(dt) = r.handle_time(&h) {
            handle_device.samples_us.push(dt.as_secs_f64() * 1e6);
        }
        drop(h);
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
        handle_device,
        dispatch: d,
        combine: c,
        total: t,
        halves,
        dispatch_check,
        combine_check,
        graph,
        queued,
        host_clock,
        ..Default::default()
    })
}

/// Handle creations timed per rank.
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

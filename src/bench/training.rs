//! `--fresh-routing`: training steps of one MoE layer on a new routing every iteration, awaited
//! operation by operation, and the same step enqueued in stream order.

use std::borrow::Cow;
use std::time::Duration;

use epflow_core::backend::{
    Backend, blocking_combine, blocking_combine_on, blocking_dispatch, blocking_dispatch_on, blocking_handle,
    blocking_handle_on,
};
use epflow_core::handle::RoutingHandle;
use epflow_core::ops::{CombineInputs, CombineOptions, DispatchInputs, DispatchOptions, HandleOptions, Pass, RecvRows};
use epflow_core::scenario::Scenario;
use epflow_core::workload::{RoutingKind, RoutingSpec, random_topk_idx};
use epflow_core::{Error, HostTensor};

use super::rank::{BenchRank, LoopPlan};
use super::stats::RankTimes;

/// The spin before a stream-ordered step ([`BenchRank::start_device_clock`]): longer than the
/// host takes to enqueue the step, shorter than the step.
const STEP_LEAD: Duration = Duration::from_micros(300);

/// Distinct routings a `--fresh-routing` run cycles through (uploaded before timing; each
/// iteration still builds its handle from scratch).
const FRESH_ROUTINGS: usize = 8;

/// The [`FRESH_ROUTINGS`] routings of this rank a `--fresh-routing` run cycles through (uniform,
/// `masked` entries -1), uploaded.
pub(super) fn fresh_routings<R: BenchRank>(
    r: &R,
    sc: &Scenario,
    masked: usize,
) -> Result<Vec<<R::B as Backend>::Tensor>, Error> {
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
/// behind a barrier. Returns the handle times (host clock, and device time where the backend
/// measures it) and the forward dispatch, forward combine and whole-step times.
pub(super) fn fresh_routing_steps<R: BenchRank>(
    r: &R,
    sc: &Scenario,
    plan: &LoopPlan,
    masked: usize,
    inputs: DispatchInputs<'_, <R::B as Backend>::Tensor>,
) -> Result<([RankTimes; 2], [RankTimes; 3]), Error>
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
    let bwd_c = CombineOptions { pass: Pass::Backward, ..Default::default() };
    let (mut handle_times, mut times) = ([RankTimes::default(), RankTimes::default()], <[RankTimes; 3]>::default());
    for i in 0..plan.warmup + plan.iters {
        r.barrier();
        let (h, th) = r.timed(|| blocking_handle(b, &routings[i % FRESH_ROUTINGS]))?;
        let n = h.num_recv_tokens().unwrap_or(0);
        let th_device = r.handle_time(&h);
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
            handle_times[0].samples_us.push(th.as_secs_f64() * 1e6);
            if let Some(dt) = th_device {
                handle_times[1].samples_us.push(dt.as_secs_f64() * 1e6);
            }
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
pub(super) fn stream_ordered_steps<R: BenchRank>(
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
    let bwd_c = CombineOptions { pass: Pass::Backward, ..Default::default() };
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

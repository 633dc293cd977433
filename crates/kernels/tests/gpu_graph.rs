//! Captured low-latency steps (CUDA graphs) on GPUs against the CPU reference: a step of
//! dispatch + combine captured once, replayed with fresh inputs written into its buffers before
//! every replay, outputs poisoned before every replay, both layouts, BF16 and FP8; replays mixed
//! with eager operations; an invalid routing inside a replay; a peer that stops replaying; the
//! capture rules' errors. Without enough GPUs every test prints SKIPPED and passes.
//! `EPFLOW_TEST_DEVICES=0,0` runs two ranks on one GPU (a functional check).
//! `EPFLOW_GPU_ITERS` sets the replays of the long test (default 200).

use std::time::{Duration, Instant};

use epflow_core::backend::{Backend, blocking_dispatch, blocking_handle_with};
use epflow_core::graph::{PendingReplay, StepBackend};
use epflow_core::ops::{CombineInputs, CombineOptions, DispatchInputs, DispatchOptions, HandleOptions, Layout};
use epflow_core::scenario::Scenario;
use epflow_core::verify::Report;
use epflow_core::workload::RoutingKind;
use epflow_core::{DispatchDtype, Error, GroupConfig, HostTensor, ValidationError};
use epflow_kernels::{DeviceTensor, GpuHandle, GpuRank, GpuReplay, GpuStep, GpuWorld};

mod common;
use common::{LlRound, check_ll_round, eager_ll_round, gpus, on_ranks, seed, shared_gpu_sms};

/// Most tokens per rank of the groups here (a power of two: the expert-major outputs
/// `[L x R*M x H]` are downloaded after every replay).
const M: usize = 128;

fn config(devices: &[usize], hidden: usize, experts: usize, dtype: DispatchDtype) -> GroupConfig {
    config_m(devices, hidden, experts, dtype, M)
}

fn config_m(devices: &[usize], hidden: usize, experts: usize, dtype: DispatchDtype, m: usize) -> GroupConfig {
    GroupConfig::low_latency(experts, m, hidden)
        .with_dispatch_dtype(dtype)
        .with_max_top_k(16)
        .with_max_sms(shared_gpu_sms(devices))
}

/// Waits for a replay (spinning with short sleeps: tests need no reactor) and returns its
/// verdict.
fn settle(replay: GpuReplay) -> Result<(), Error> {
    let probe = replay.probe();
    while !probe.ready() {
        std::thread::sleep(Duration::from_micros(50));
    }
    replay.finish()
}

/// One micro-batch's buffers in a captured step: its inputs (refilled before every replay) and
/// its handle (which owns the outputs).
struct Side {
    topk: DeviceTensor,
    x: DeviceTensor,
    w: DeviceTensor,
    y: DeviceTensor,
    handle: GpuHandle,
}

impl Side {
    /// Buffers shaped after rank `rank`'s part of `sc`, and a handle of `layout` on them.
    fn new(rank: &GpuRank, sc: &Scenario, layout: Layout) -> Result<Self, Error> {
        let r = rank.rank();
        let topk = rank.upload(&sc.topk_idx(r))?;
        let x = rank.upload(&sc.tokens(r))?;
        let w = rank.upload(&sc.weights(r))?;
        let y = rank.upload(&expert_outputs(sc, r, layout))?;
        let handle = rank.graph_handle(&topk, &HandleOptions::with_layout(layout))?;
        Ok(Side { topk, x, w, y, handle })
    }

    /// The dispatch inputs of `layout` (rank-major sends the weights with the tokens).
    fn dispatch_inputs(&self, layout: Layout) -> DispatchInputs<'_, DeviceTensor> {
        match layout {
            Layout::RankMajor => DispatchInputs::new(&self.x).with_weights(&self.w),
            Layout::ExpertMajor => DispatchInputs::new(&self.x),
        }
    }

    /// The combine inputs of `layout` (expert-major applies the weights in combine).
    fn combine_inputs(&self, layout: Layout) -> CombineInputs<'_, DeviceTensor> {
        match layout {
            Layout::RankMajor => CombineInputs::new(&self.y),
            Layout::ExpertMajor => CombineInputs::new(&self.y).with_weights(&self.w),
        }
    }
}

/// One rank's captured step of one micro-batch, and its buffers.
struct Captured {
    side: Side,
    step: GpuStep,
}

/// The expert outputs identity experts would return for rank `r` of `sc` (from the reference).
fn expert_outputs(sc: &Scenario, r: usize, layout: Layout) -> HostTensor {
    sc.ll_reference_expert_outputs(r, layout).expect("a valid scenario")
}

fn max_tokens(sc: &Scenario) -> usize {
    sc.config.fixed_max_tokens().unwrap_or(M)
}

/// Captures dispatch + combine on `rank`, with buffers shaped after `sc` (expert-major: the
/// staged form, rank-major: the synchronous one).
fn capture(rank: &GpuRank, sc: &Scenario, layout: Layout) -> Result<Captured, Error> {
    let side = Side::new(rank, sc, layout)?;
    let stream = rank.context().new_stream().map_err(|e| Error::Backend(format!("new stream: {e}")))?;
    let step = rank.capture(&stream, |cap| {
        let dopts = DispatchOptions::default();
        match layout {
            Layout::RankMajor => drop(cap.dispatch(&side.handle, side.dispatch_inputs(layout), &dopts)?),
            Layout::ExpertMajor => {
                // Staged: the complete half captured apart from the send half.
                let half = cap.dispatch_send(&side.handle, side.dispatch_inputs(layout), &dopts)?;
                cap.complete_dispatch(half)?;
            }
        }
        cap.combine(&side.handle, side.combine_inputs(layout), &CombineOptions::default())?;
        Ok(())
    })?;
    Ok(Captured { side, step })
}

/// Writes `sc`'s inputs for rank `r` into the step's buffers and poisons its outputs.
fn refill(rank: &GpuRank, c: &Side, sc: &Scenario, layout: Layout) -> Result<(), Error> {
    let (r, ctx) = (rank.rank(), rank.context());
    c.topk.copy_from_host(ctx, &sc.topk_idx(r))?;
    c.x.copy_from_host(ctx, &sc.tokens(r))?;
    c.w.copy_from_host(ctx, &sc.weights(r))?;
    c.y.copy_from_host(ctx, &expert_outputs(sc, r, layout))?;
    let d = c.handle.graph_dispatch_outputs().expect("graph handle");
    for t in [Some(&d.tokens), d.scales.as_ref(), d.topk_weights.as_ref(), d.topk_idx.as_ref(), d.counts.as_ref()]
        .into_iter()
        .flatten()
        .chain(c.handle.graph_combine_output())
    {
        t.fill_bytes(ctx, 0xA5)?;
    }
    Ok(())
}

/// Checks the step's outputs on rank `r` against `sc`'s reference.
fn check(rank: &GpuRank, c: &Side, sc: &Scenario, layout: Layout) -> Result<(Report, Report), Error> {
    let (r, ctx) = (rank.rank(), rank.context());
    let d = c.handle.graph_dispatch_outputs().expect("graph handle");
    let get = |t: Option<&DeviceTensor>| t.map(|t| t.download(ctx)).transpose();
    let rank_major = match layout {
        Layout::RankMajor => {
            Some((get(d.topk_weights.as_ref())?.expect("weights"), get(d.topk_idx.as_ref())?.expect("idx")))
        }
        Layout::ExpertMajor => None,
    };
    let got = LlRound {
        tokens: d.tokens.download(ctx)?,
        scales: get(d.scales.as_ref())?,
        counts: get(d.counts.as_ref())?.expect("counts"),
        rank_major,
        combined: c.handle.graph_combine_output().expect("graph handle").download(ctx)?,
    };
    Ok(check_ll_round(sc, r, layout, max_tokens(sc), &got))
}

/// `replays` replays on `devices` for each of `shapes` (tokens per rank, top-k) and both
/// layouts, with fresh inputs each (every 7th expert-major one preceded by an eager round, so the
/// step rebases); every output checked.
fn replay_world(devices: &[usize], cfg: &GroupConfig, base: u64, replays: u64, shapes: &[(usize, usize)]) {
    let ranks = GpuWorld::create(devices, cfg.clone()).expect("create GPU group");
    let (hidden, experts, dtype) = (cfg.hidden, cfg.num_experts, cfg.dispatch_dtype);
    for &(tokens, top_k) in shapes {
        for layout in [Layout::ExpertMajor, Layout::RankMajor] {
            let scenario = |i: u64| {
                let s = base.wrapping_add(i * 7919 + tokens as u64 * 31 + top_k as u64);
                let kind = if i % 5 == 4 { RoutingKind::Skewed } else { RoutingKind::Uniform };
                Scenario::generate(cfg.clone(), devices.len(), &vec![tokens; devices.len()], top_k, kind, 3, s)
            };
            let what = format!(
                "R={} H={hidden} E={experts} {dtype:?} tokens={tokens} top_k={top_k} {}",
                devices.len(),
                layout.name()
            );
            let t = Instant::now();
            let first = scenario(0);
            on_ranks(&ranks, |rank| {
                let c = capture(rank, &first, layout).expect("capture");
                for i in 0..replays {
                    let sc = scenario(i);
                    if i % 7 == 6 && layout == Layout::ExpertMajor {
                        let e = eager_ll_round(rank, &sc).expect("eager round");
                        assert!(e.ok(), "{what} replay {i}: {e:?}");
                    }
                    refill(rank, &c.side, &sc, layout).expect("refill");
                    settle(rank.launch_step(&c.step).expect("launch")).expect("replay");
                    let (d, y) = check(rank, &c.side, &sc, layout).expect("check");
                    assert!(d.ok() && y.ok(), "{what} replay {i} seed {base}: {d:?} {y:?}");
                    if (i + 1) % 1000 == 0 && rank.rank() == 0 {
                        eprintln!("  {what}: {} replays checked", i + 1);
                    }
                }
                assert_eq!(c.step.replays(), replays);
            });
            eprintln!("ok: {what}: {replays} replays ({:.1} s)", t.elapsed().as_secs_f64());
        }
    }
}

#[test]
fn graph_replays_match_reference_on_1_and_2_gpus() {
    let base = seed();
    eprintln!("seed {base}");
    for n in [1usize, 2] {
        let Some(devices) = gpus(n, &format!("graph_replays_match_reference ({n} GPUs)")) else { continue };
        for (h, e, dt) in [
            (7168usize, 32usize, DispatchDtype::Bf16),
            (7168, 32, DispatchDtype::Fp8 { round_scales: true }),
            (2048, 64, DispatchDtype::Fp8 { round_scales: false }),
        ] {
            replay_world(&devices, &config(&devices, h, e, dt), base, 12, &[(1, 8), (M, 8), (33, 16)]);
        }
    }
}

/// The replay target: `EPFLOW_GPU_ITERS` (default 200) replays with fresh inputs, both layouts,
/// on 2 GPUs where there are (else 1).
#[test]
fn graph_many_replays_with_fresh_inputs() {
    let base = seed();
    eprintln!("seed {base}");
    let iters: u64 = std::env::var("EPFLOW_GPU_ITERS").ok().and_then(|s| s.parse().ok()).unwrap_or(200);
    let n = if gpus(2, "graph_many_replays (2 GPUs)").is_some() { 2 } else { 1 };
    let Some(devices) = gpus(n, "graph_many_replays") else { return };
    let cfg = config_m(&devices, 2048, 16, DispatchDtype::Bf16, 32);
    replay_world(&devices, &cfg, base, iters, &[(32, 8)]);
}

/// Two micro-batches in one step, their halves interleaved as an overlapping server issues them
/// (both dispatch sends, both receives, both combine sends, both receives), one expert-major and
/// one rank-major; each checked against its own reference every replay.
#[test]
fn graph_two_micro_batches_interleaved_in_one_step() {
    let Some(devices) = gpus(2, "graph_two_micro_batches").or_else(|| gpus(1, "graph_two_micro_batches")) else {
        return;
    };
    let base = seed();
    eprintln!("seed {base}");
    let cfg = config(&devices, 2048, 32, DispatchDtype::Bf16);
    let ranks = GpuWorld::create(&devices, cfg.clone()).expect("create GPU group");
    let n = devices.len();
    let sc = |i: u64, tokens: usize| {
        Scenario::generate(cfg.clone(), n, &vec![tokens; n], 8, RoutingKind::Uniform, 3, base.wrapping_add(i))
    };
    let (la, lb) = (Layout::ExpertMajor, Layout::RankMajor);
    on_ranks(&ranks, |rank| {
        let (a, b) = (Side::new(rank, &sc(0, 24), la).expect("a"), Side::new(rank, &sc(1, 9), lb).expect("b"));
        let stream = rank.context().new_stream().expect("stream");
        let (dopts, copts) = (DispatchOptions::default(), CombineOptions::default());
        let step = rank
            .capture(&stream, |cap| {
                let da = cap.dispatch_send(&a.handle, a.dispatch_inputs(la), &dopts)?;
                let db = cap.dispatch_send(&b.handle, b.dispatch_inputs(lb), &dopts)?;
                cap.complete_dispatch(da)?;
                cap.complete_dispatch(db)?;
                let ca = cap.combine_send(&a.handle, a.combine_inputs(la), &copts)?;
                let cb = cap.combine_send(&b.handle, b.combine_inputs(lb), &copts)?;
                cap.complete_combine(ca)?;
                cap.complete_combine(cb)?;
                Ok(())
            })
            .expect("capture");
        assert_eq!((step.counts().dispatches, step.counts().combines), (2, 2));
        for i in 0..20u64 {
            let (sa, sb) = (sc(2 * i + 10, 24), sc(2 * i + 11, 9));
            refill(rank, &a, &sa, la).expect("refill a");
            refill(rank, &b, &sb, lb).expect("refill b");
            settle(rank.launch_step(&step).expect("launch")).expect("replay");
            for (side, s, l) in [(&a, &sa, la), (&b, &sb, lb)] {
                let (d, y) = check(rank, side, s, l).expect("check");
                assert!(d.ok() && y.ok(), "{} replay {i} seed {base}: {d:?} {y:?}", l.name());
            }
        }
    });
}

/// An out-of-range expert in one rank's buffer: that rank's replay reports it (the row's
/// entries from there on dropped), the peers' replays succeed, the group stays usable.
#[test]
fn graph_invalid_routing_fails_the_replay_and_spares_the_group() {
    let Some(devices) = gpus(2, "graph_invalid_routing").or_else(|| gpus(1, "graph_invalid_routing")) else { return };
    let base = seed();
    let cfg = config(&devices, 2048, 64, DispatchDtype::Bf16);
    let ranks = GpuWorld::create(&devices, cfg.clone()).expect("create GPU group");
    let sc =
        |s| Scenario::generate(cfg.clone(), devices.len(), &vec![16; devices.len()], 4, RoutingKind::Uniform, 3, s);
    let results = on_ranks(&ranks, |rank| {
        let c = capture(rank, &sc(base), Layout::ExpertMajor).expect("capture");
        let mut bad = sc(base + 1).topk_idx(rank.rank()).as_i64().unwrap_or_default().to_vec();
        if rank.rank() == 0 {
            bad[5 * 4 + 2] = 64;
        }
        c.side.topk.copy_from_host(rank.context(), &HostTensor::topk_idx(16, 4, bad)).expect("write");
        let first = settle(rank.launch_step(&c.step).expect("launch"));
        let good = sc(base + 2);
        refill(rank, &c.side, &good, Layout::ExpertMajor).expect("refill");
        settle(rank.launch_step(&c.step).expect("launch")).expect("the group stays usable");
        let (d, y) = check(rank, &c.side, &good, Layout::ExpertMajor).expect("check");
        assert!(d.ok() && y.ok(), "after the invalid replay: {d:?} {y:?}");
        first
    });
    match &results[0] {
        Err(Error::Validation(ValidationError::ExpertIndexOutOfRange { token: 5, k: 2, index: 64, .. })) => {}
        other => panic!("rank 0: {other:?}"),
    }
    for (r, res) in results.iter().enumerate().skip(1) {
        assert!(res.is_ok(), "rank {r}: {res:?}");
    }
}

/// Rank 0 replays its step where rank 1 runs the same collectives eagerly: the dispatches agree
/// (same stamp), the combines do not (a captured combine pairs with its step's dispatch): rank 0's
/// replay fails with the peer's mismatch and poisons its group, rank 1's combine names it too.
#[test]
fn graph_replay_against_an_eager_peer_is_a_mismatch() {
    let Some(devices) = gpus(2, "graph_replay_against_eager") else { return };
    let cfg = config(&devices, 2048, 64, DispatchDtype::Bf16);
    let ranks = GpuWorld::create(&devices, cfg.clone()).expect("create GPU group");
    let sc = Scenario::generate(cfg.clone(), 2, &[8, 8], 4, RoutingKind::Uniform, 3, seed());
    let results = on_ranks(&ranks, |rank| {
        if rank.rank() == 0 {
            let c = capture(rank, &sc, Layout::ExpertMajor).expect("capture");
            refill(rank, &c.side, &sc, Layout::ExpertMajor).expect("refill");
            return settle(rank.launch_step(&c.step).expect("launch"));
        }
        eager_ll_round(rank, &sc).map(drop)
    });
    assert!(matches!(results[0], Err(Error::PeerMismatch { peer: 1, .. })), "rank 0: {:?}", results[0]);
    assert!(matches!(results[1], Err(Error::PeerMismatch { peer: 0, .. })), "rank 1: {:?}", results[1]);
    assert!(rank_poisoned(&ranks[0]));
}

/// Rank 1 captures but never replays: rank 0's replay times out, poisons the group, and
/// returns within twice the timeout; the rank's later launches fail fast.
#[test]
fn graph_peer_that_stops_replaying_times_out_without_hanging() {
    let Some(devices) = gpus(2, "graph_peer_stops") else { return };
    let cfg = config(&devices, 2048, 64, DispatchDtype::Bf16).with_timeout(Duration::from_secs(2));
    let ranks = GpuWorld::create(&devices, cfg.clone()).expect("create GPU group");
    let sc = Scenario::generate(cfg.clone(), 2, &[8, 8], 4, RoutingKind::Uniform, 3, seed());
    let results = on_ranks(&ranks, |rank| {
        let c = capture(rank, &sc, Layout::ExpertMajor).expect("capture");
        if rank.rank() == 1 {
            return Ok(Duration::ZERO);
        }
        let t = Instant::now();
        let verdict = settle(rank.launch_step(&c.step).expect("launch"));
        let after = t.elapsed();
        assert!(matches!(rank.launch_step(&c.step), Err(Error::Poisoned { .. })));
        verdict.map(|()| after)
    });
    match &results[0] {
        Err(Error::Timeout { .. }) => {}
        other => panic!("rank 0: {other:?}"),
    }
    assert!(rank_poisoned(&ranks[0]));
}

fn rank_poisoned(rank: &GpuRank) -> bool {
    rank.core().poison().is_poisoned()
}

/// The capture rules' errors, on one GPU.
#[test]
fn graph_capture_rules_are_errors() {
    let Some(devices) = gpus(1, "graph_capture_rules") else { return };
    let cfg = config(&devices, 2048, 64, DispatchDtype::Bf16);
    let ranks = GpuWorld::create(&devices, cfg.clone()).expect("create GPU group");
    let rank = &ranks[0];
    let sc = Scenario::generate(cfg.clone(), 1, &[8], 4, RoutingKind::Uniform, 3, seed());
    let stream = rank.context().new_stream().unwrap();
    let topk = rank.upload(&sc.topk_idx(0)).unwrap();
    let x = rank.upload(&sc.tokens(0)).unwrap();
    let w = rank.upload(&sc.weights(0)).unwrap();
    let eager = blocking_handle_with(rank, &topk, &HandleOptions::default()).unwrap();
    let graph = rank.graph_handle(&topk, &HandleOptions::default()).unwrap();
    let dopts = DispatchOptions::default();
    // An eager handle in a capture.
    let e = rank.capture(&stream, |cap| cap.dispatch(&eager, DispatchInputs::new(&x), &dopts).map(drop)).unwrap_err();
    assert!(matches!(e, Error::Unsupported(ref m) if m.contains("graph_handle")), "{e}");
    // A graph handle in an eager operation.
    let e = rank.start_dispatch(&graph, DispatchInputs::new(&x), &dopts).unwrap_err();
    assert!(matches!(e, Error::Unsupported(ref m) if m.contains("captured steps")), "{e}");
    // A combine before its dispatch.
    let y = rank.upload(&expert_outputs(&sc, 0, Layout::ExpertMajor)).unwrap();
    let e = rank
        .capture(&stream, |cap| {
            cap.combine(&graph, CombineInputs::new(&y).with_weights(&w), &CombineOptions::default()).map(drop)
        })
        .unwrap_err();
    assert!(matches!(e, Error::Validation(ValidationError::CombineBeforeDispatch)), "{e}");
    // A send half left open.
    let e = rank
        .capture(&stream, |cap| {
            let _half = cap.dispatch_send(&graph, DispatchInputs::new(&x), &dopts)?;
            Ok(())
        })
        .unwrap_err();
    assert!(matches!(e, Error::Unsupported(ref m) if m.contains("complete half")), "{e}");
    // The stream is usable after failed captures, and the rank still works eagerly.
    let out = blocking_dispatch(rank, &eager, DispatchInputs::new(&x), &dopts, false).unwrap();
    let want = sc.ll_dispatch_reference().unwrap()[0].counts();
    assert_eq!(out.to_host().unwrap().counts.unwrap().as_i32().unwrap(), &want[..]);
    // A high-throughput group captures nothing.
    let ht = GpuWorld::create(&devices, GroupConfig::high_throughput(64, 2048)).expect("ht group");
    let e = ht[0].capture(&stream, |_| Ok(())).unwrap_err();
    assert!(matches!(e, Error::Unsupported(_)), "{e}");
    let e = ht[0].graph_handle(&topk, &HandleOptions::default()).unwrap_err();
    assert!(matches!(e, Error::Unsupported(_)), "{e}");
}

/// One process per GPU (`EPFLOW_TEST_SEED=<n> epflow launch -n N -- gpu_graph
/// graph_one_process_per_gpu`): every process joins the group, captures its step and replays it
/// with fresh inputs, both layouts, each replay checked against the reference.
#[test]
fn graph_one_process_per_gpu() {
    let Some((env, comm, base)) = common::launched("graph_one_process_per_gpu") else { return };
    let n = env.world_size;
    let iters: u64 = std::env::var("EPFLOW_GPU_ITERS").ok().and_then(|s| s.parse().ok()).unwrap_or(200);
    let cfg = GroupConfig::low_latency(16, 32, 2048).with_max_top_k(16);
    let rank = GpuWorld::join(&comm, cfg.clone()).expect("join the GPU group");
    for layout in [Layout::ExpertMajor, Layout::RankMajor] {
        let scenario = |i: u64| {
            Scenario::generate(cfg.clone(), n, &vec![32; n], 8, RoutingKind::Uniform, 3, base.wrapping_add(i * 7919))
        };
        let c = capture(&rank, &scenario(0), layout).expect("capture");
        for i in 0..iters {
            let sc = scenario(i);
            refill(&rank, &c.side, &sc, layout).expect("refill");
            settle(rank.launch_step(&c.step).expect("launch")).expect("replay");
            let (d, y) = check(&rank, &c.side, &sc, layout).expect("check");
            assert!(d.ok() && y.ok(), "rank {} of {n}, {} replay {i}: {d:?} {y:?}", env.rank, layout.name());
        }
        epflow_kernels::setup::bootstrap::barrier(&comm).expect("barrier");
        eprintln!("ok: rank {} of {n}, one process per GPU, {}: {iters} replays", env.rank, layout.name());
    }
}

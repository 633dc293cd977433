//! Low-latency rank-major layout on GPUs against the CPU reference (one process driving 2 or 4
//! GPUs, NVLink and NCCL transports; one process per GPU under `epflow launch`). Without enough
//! GPUs every test prints SKIPPED and passes. `EPFLOW_TEST_DEVICES=0,0` runs two ranks on one GPU
//! (a functional check).
//!
//! Inputs are fresh random data every round (seed printed; `EPFLOW_TEST_SEED` replays), outputs
//! are poisoned before every operation; dispatch (tokens, scales, weights, local expert indices,
//! per-source counts) and combine must match the reference bit for bit. Top-k runs to the
//! library's limit of 16, on both layouts.

use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::CudaStream;

use epflow_core::backend::{
    Backend, blocking_combine, blocking_combine_on, blocking_dispatch, blocking_dispatch_on, blocking_handle_on,
    blocking_handle_with,
};
use epflow_core::ops::{CombineInputs, CombineOptions, DispatchInputs, DispatchOptions, HandleOptions, Layout};
use epflow_core::scenario::{Scenario, rank_major_identity_expert_outputs};
use epflow_core::verify::{Report, Tolerance, check_bf16, check_ll_dispatch, check_rank_major_dispatch};
use epflow_core::workload::RoutingKind;
use epflow_core::{DispatchDtype, Error, GroupConfig, HostTensor};
use epflow_kernels::{DeviceTensor, GpuHandle, GpuRank, GpuWorld, Transport};

mod common;
use common::{
    World, counts_across, for_each_world, gpus, launched, nccl_gpus, on_ranks, seed, shared_gpu_sms, uneven_tokens,
};

/// One dispatch + identity experts + combine on `rank`, on a handle of `layout`.
fn round(rank: &GpuRank, sc: &Scenario, layout: Layout, staged: bool) -> Result<(Report, Report), Error> {
    rank.fill_output_buffers(0xA5)?;
    let idx = rank.upload(&sc.topk_idx(rank.rank()))?;
    let handle = blocking_handle_with(rank, &idx, &HandleOptions::with_layout(layout))?;
    round_on(rank, sc, layout, &handle, How::Awaited { staged })
}

/// How a round's operations run: awaited (staged or not), or completed in a stream's order
/// (`blocking_*_on`, each settled before its outputs are read).
#[derive(Clone, Copy)]
enum How<'a> {
    Awaited { staged: bool },
    OnStream(&'a Arc<CudaStream>),
}

/// [`round`] on `handle` (of `layout`, made from `sc`'s routing of this rank), its operations
/// run as `how` says.
fn round_on(
    rank: &GpuRank,
    sc: &Scenario,
    layout: Layout,
    handle: &GpuHandle,
    how: How,
) -> Result<(Report, Report), Error> {
    let r = rank.rank();
    let (h, m, k) = (sc.config.hidden, sc.config.fixed_max_tokens().unwrap_or(0), sc.top_k);
    let handle = handle.clone();
    let dispatch = |inputs: DispatchInputs<'_, DeviceTensor>, dopts: &DispatchOptions| match how {
        How::Awaited { staged } => blocking_dispatch(rank, &handle, inputs, dopts, staged),
        How::OnStream(s) => {
            let (out, settle) = blocking_dispatch_on(rank, &handle, inputs, dopts, s)?;
            settle.settle()?;
            Ok(out)
        }
    };
    let combine = |inputs: CombineInputs<'_, DeviceTensor>, copts: &CombineOptions| match how {
        How::Awaited { staged } => blocking_combine(rank, &handle, inputs, copts, staged),
        How::OnStream(s) => {
            let (out, settle) = blocking_combine_on(rank, &handle, inputs, copts, s)?;
            settle.settle()?;
            Ok(out)
        }
    };
    let x = rank.upload(&sc.tokens(r))?;
    let w = rank.upload(&sc.weights(r))?;
    let dopts = DispatchOptions::default();
    let copts = CombineOptions::default();
    match layout {
        Layout::RankMajor => {
            let refs = sc.ll_rank_major_reference().unwrap();
            let want = sc.ll_rank_major_combine_identity_reference(&refs).unwrap();
            let out = dispatch(DispatchInputs::new(&x).with_weights(&w), &dopts)?;
            let host = out.to_host()?;
            let scales = host.scales.as_ref().and_then(HostTensor::as_f32);
            let got_w = host.topk_weights.as_ref().and_then(HostTensor::as_f32).unwrap_or_default();
            let got_i = host.topk_idx.as_ref().and_then(HostTensor::as_i32).unwrap_or_default();
            let counts = host.counts.as_ref().and_then(HostTensor::as_i32).unwrap_or_default();
            let d = check_rank_major_dispatch(&refs[r], h, m, k, host.tokens.data(), scales, got_w, got_i, counts);
            let sums = rank_major_identity_expert_outputs(host.tokens.data(), scales, got_w, got_i, counts, m, h, k);
            let sums = rank.upload(&sums)?;
            drop(out);
            let y = combine(CombineInputs::new(&sums), &copts)?;
            let c =
                check_bf16("combine", &want[r], y.to_host()?.tokens.as_bf16().unwrap_or_default(), Tolerance::Exact);
            Ok((d.context(&format!("rank {r} dispatch")), c.context(&format!("rank {r} combine"))))
        }
        Layout::ExpertMajor => {
            let refs = sc.ll_dispatch_reference().unwrap();
            let want = sc.ll_combine_identity_reference(&refs).unwrap();
            let out = dispatch(DispatchInputs::new(&x), &dopts)?;
            let host = out.to_host()?;
            let counts = host.counts.as_ref().and_then(HostTensor::as_i32).unwrap_or_default().to_vec();
            let scales = host.scales.as_ref().and_then(HostTensor::as_f32);
            let d = check_ll_dispatch(&refs[r], h, sc.num_ranks * m, host.tokens.data(), scales, &counts);
            let experts = match out.scales() {
                Some(s) => rank.dequantize_fp8(out.tokens(), s)?,
                None => out.tokens().clone(),
            };
            let y = combine(CombineInputs::new(&experts).with_weights(&w), &copts)?;
            let c =
                check_bf16("combine", &want[r], y.to_host()?.tokens.as_bf16().unwrap_or_default(), Tolerance::Exact);
            Ok((d.context(&format!("rank {r} dispatch")), c.context(&format!("rank {r} combine"))))
        }
    }
}

fn check_world(
    devices: &[usize],
    hidden: usize,
    experts: usize,
    dtype: DispatchDtype,
    base: u64,
    transport: &Transport,
) {
    let max_tokens = 256;
    // Ranks sharing a GPU get the library's SM bound (`GpuWorld::create`), not one of the test's.
    let config = GroupConfig::low_latency(experts, max_tokens, hidden).with_dispatch_dtype(dtype).with_max_top_k(16);
    let ranks = GpuWorld::create_with(devices, config.clone(), transport.clone()).expect("create GPU group");
    let mut round_no = 0u64;
    // 1 and 7 tokens: every rank's dispatch goes out as tagged messages; 40: the last rank's 21
    // only (one receive takes both forms); 128 and 256: none.
    for tokens in [1usize, 7, 40, 128, 256] {
        for top_k in [1usize, 4, 8, 10, 16] {
            let kinds: &[RoutingKind] = if tokens == 128 && top_k == 4 {
                &[RoutingKind::Uniform, RoutingKind::SingleRank(1 % devices.len()), RoutingKind::Skewed]
            } else {
                &[RoutingKind::Uniform]
            };
            for &kind in kinds {
                for layout in [Layout::RankMajor, Layout::ExpertMajor] {
                    // Expert-major K <= 8 is gpu_ll.rs's.
                    if layout == Layout::ExpertMajor && top_k <= 8 {
                        continue;
                    }
                    round_no += 1;
                    let s = base.wrapping_add(round_no * 7919);
                    let per_rank = uneven_tokens(devices.len(), tokens);
                    let sc =
                        Scenario::generate(config.clone(), devices.len(), &per_rank, top_k, kind, 10.min(tokens), s);
                    let staged = round_no % 2 == 0;
                    for (d, c) in on_ranks(&ranks, |rank| round(rank, &sc, layout, staged).expect("round")) {
                        let what = format!(
                            "{} R={} H={hidden} E={experts} {dtype:?} tokens={tokens} top_k={top_k} {kind:?} staged={staged} {transport:?} seed={s}",
                            layout.name(),
                            devices.len()
                        );
                        assert!(d.ok() && d.checked > 0, "{what}: {d:?}");
                        assert!(c.ok(), "{what}: {c:?}");
                    }
                }
            }
        }
    }
}

const WORLDS: &[World] = &[
    (2048, 64, DispatchDtype::Bf16),
    (7168, 256, DispatchDtype::Bf16),
    (7168, 256, DispatchDtype::Fp8 { round_scales: true }),
    (4096, 64, DispatchDtype::Fp8 { round_scales: false }),
];

#[test]
fn rank_major_matches_reference_on_1_2_and_4_gpus() {
    let base = seed();
    eprintln!("seed {base}");
    for_each_world("rank_major_matches_reference", &[1, 2, 4], gpus, WORLDS, |devices, (h, e, dt)| {
        check_world(devices, h, e, dt, base, &Transport::Auto)
    });
}

/// A group whose `max_tokens` is above what a compacted dispatch can announce (16383): its
/// rank-major messages keep their tokens' slots (the form captured steps and NCCL peers use),
/// checked eagerly here, staged and not, uneven token counts.
#[test]
fn rank_major_above_the_compaction_bound_matches_reference() {
    let n = epflow_kernels::device_count().min(2);
    let Some(devices) = gpus(n.max(2), "rank_major_above_the_compaction_bound") else { return };
    let base = seed();
    eprintln!("seed {base}");
    let config = GroupConfig::low_latency(16, 16384, 256).with_max_top_k(16);
    let ranks = GpuWorld::create(&devices, config.clone()).expect("create GPU group");
    for (i, (tokens, top_k)) in [(40usize, 8usize), (300, 4), (129, 16)].into_iter().enumerate() {
        let s = base.wrapping_add(i as u64 * 7919);
        let per_rank = uneven_tokens(devices.len(), tokens);
        let sc = Scenario::generate(config.clone(), devices.len(), &per_rank, top_k, RoutingKind::Uniform, 10, s);
        let staged = i % 2 == 1;
        for (d, c) in on_ranks(&ranks, |rank| round(rank, &sc, Layout::RankMajor, staged).expect("round")) {
            let what = format!("M=16384 tokens={tokens} top_k={top_k} staged={staged} seed={s}");
            assert!(d.ok() && d.checked > 0, "{what}: {d:?}");
            assert!(c.ok(), "{what}: {c:?}");
        }
        eprintln!("ok: M=16384 tokens={tokens} top_k={top_k} staged={staged}");
    }
}

/// Experts of [`handle_world`]'s group.
const HANDLE_EXPERTS: usize = 16;

/// The two-GPU group of the handle tests (M = 2048, so a handle spans two of the kernel's tiles
/// of 1024 tokens; H = 1024, [`HANDLE_EXPERTS`] experts, top-k up to 16), its config and the
/// seed (printed); `None` (SKIPPED printed) without two GPUs.
fn handle_world(test: &str) -> Option<(Vec<GpuRank>, GroupConfig, u64)> {
    let devices = gpus(2, test)?;
    let base = seed();
    eprintln!("seed {base}");
    let config = GroupConfig::low_latency(HANDLE_EXPERTS, 2048, 1024).with_max_top_k(16);
    let ranks = GpuWorld::create(&devices, config.clone()).expect("create GPU group");
    Some((ranks, config, base))
}

/// Handles built on the device (`ep_ll_handle`, over NVLink): an invalid `topk_idx` is refused
/// at creation with the error the host's checks give (`Routing::new`: the first invalid entry in
/// row-major order, a second one later in the tensor), on both layouts, in the block's first tile
/// of 1024 tokens and in the second; then rounds on valid handles of more than 1024 tokens per
/// rank (the send slots numbered over two tiles) match the reference bit for bit, staged and not.
#[test]
fn device_built_handles_refuse_what_the_host_refuses_and_span_tiles() {
    let Some((ranks, config, base)) = handle_world("device_built_handles") else { return };
    let (experts, k) = (HANDLE_EXPERTS, 8usize);
    let sc = Scenario::generate(config.clone(), 2, &[1500, 1100], k, RoutingKind::Uniform, 0, base);
    // (token, k, what the entry becomes): above E, below -1, a repeat of the row's slot 0.
    let cases: [(usize, usize, Option<i64>); 6] = [
        (0, 3, Some(experts as i64)),
        (5, 0, Some(-2)),
        (7, 6, None),
        (1030, 2, Some(i64::MAX)),
        (1090, 7, None),
        (1050, 1, Some(-5)),
    ];
    on_ranks(&ranks, |rank| {
        let r = rank.rank();
        let good = sc.topk_idx(r).as_i64().expect("int64 topk_idx").to_vec();
        let tokens = good.len() / k;
        for (i, &(t, slot, value)) in cases.iter().enumerate() {
            let mut idx = good.clone();
            let v = value.unwrap_or(idx[t * k]);
            idx[t * k + slot] = v;
            // A second invalid entry after the first: the first is the one named.
            idx[(t + 3) * k + 1] = -7;
            let want = epflow_core::routing::Routing::new(idx.clone(), tokens, k, experts).expect_err("invalid");
            let dev = rank.upload(&HostTensor::topk_idx(tokens, k, idx)).expect("upload");
            for layout in [Layout::RankMajor, Layout::ExpertMajor] {
                let got = blocking_handle_with(rank, &dev, &HandleOptions::with_layout(layout))
                    .expect_err("an invalid routing makes no handle");
                assert_eq!(got, Error::Validation(want.clone()), "rank {r} case {i} {layout:?}");
            }
        }
        for (i, layout) in [Layout::RankMajor, Layout::ExpertMajor, Layout::RankMajor].into_iter().enumerate() {
            let (d, c) = round(rank, &sc, layout, i == 2).expect("round");
            assert!(d.ok() && d.checked > 0, "rank {r} {layout:?} seed={base}: {d:?}");
            assert!(c.ok(), "rank {r} {layout:?} seed={base}: {c:?}");
        }
    });
    eprintln!("ok: device-built handles, 1500 / 1100 tokens");
}

/// Handles created in a stream's order (`blocking_handle_on`: the handle at once, nothing
/// waiting on the host; by default the dispatches read `topk_idx`, with
/// `EPFLOW_LL_STREAM_HANDLE=kernel` a kernel on the caller's stream builds the handle), each
/// from a `topk_idx` written on that stream behind a 2 ms spin, so that every operation not
/// ordered after it reads the wrong routing: operations awaited on the channels' streams, and
/// completed on the caller's stream, both layouts, 1500 / 1100 and 40 / 7 tokens, three rounds
/// per handle (by default the second launches the kernel that the third reads), match the
/// reference bit for bit. A handle dropped before the work ahead of it ran gives its memory
/// back only after it (the next handle reuses it). An invalid entry on rank 1 fails rank 1's
/// three dispatches on the handle at their verdicts with the host's error, while rank 0 receives
/// rank 1's sanitized rows (the entries from the row's first invalid one on masked); the group
/// goes on.
#[test]
fn handles_in_stream_order_match_reference() {
    let Some((ranks, config, base)) = handle_world("handles_in_stream_order") else { return };
    let (experts, k) = (HANDLE_EXPERTS, 8usize);
    let spin = Duration::from_millis(2);
    for (i, tokens) in [[1500usize, 1100], [40, 7]].into_iter().enumerate() {
        let sc = Scenario::generate(config.clone(), 2, &tokens, k, RoutingKind::Uniform, 3, base + i as u64);
        on_ranks(&ranks, |rank| {
            let r = rank.rank();
            let stream = rank.context().new_stream().expect("stream");
            let idx = rank.upload(&sc.topk_idx(r)).expect("upload");
            let b = tokens[r];
            // The routing is written on `stream` behind a spin, into a tensor of zeros (every
            // entry expert 0): a dispatch not ordered after it would route every token to rank 0.
            let written_late = || {
                let zeros = rank.upload(&HostTensor::topk_idx(b, k, vec![0; b * k])).expect("upload");
                rank.delay_on(&stream, spin).expect("spin");
                let ready = rank.copy_on(&stream, &idx, &zeros).expect("copy");
                zeros.ready_after(ready)
            };
            for (j, layout) in [Layout::RankMajor, Layout::ExpertMajor].into_iter().enumerate() {
                let opts = HandleOptions::with_layout(layout);
                // Dropped before the work ahead of it ran: the next handle takes its memory.
                rank.delay_on(&stream, spin).expect("spin");
                drop(blocking_handle_on(rank, &idx, &opts, &stream).expect("handle"));
                for (n, how) in [How::Awaited { staged: j == 1 }, How::OnStream(&stream)].into_iter().enumerate() {
                    rank.fill_output_buffers(0xA5).expect("fill");
                    let late = written_late();
                    let (h, created) = blocking_handle_on(rank, &late, &opts, &stream).expect("handle");
                    assert!(created.is_none(), "a low-latency handle has no creation to settle");
                    // Three rounds on the handle: the first two read the caller's routing, the
                    // second launches the kernel that the third reads (compacted, rank-major).
                    for round in 0..3 {
                        rank.fill_output_buffers(0xA5).expect("fill");
                        let (d, c) = round_on(rank, &sc, layout, &h, how).expect("round");
                        let what = format!(
                            "rank {r} tokens={tokens:?} {layout:?} form {n} round {round} seed={}",
                            base + i as u64
                        );
                        assert!(d.ok() && d.checked > 0, "{what}: {d:?}");
                        assert!(c.ok(), "{what}: {c:?}");
                    }
                }
            }
        });
        eprintln!("ok: handles in stream order, {tokens:?} tokens");
    }
    // Rank 1 routes token 3's slot 2 to expert E; rank 0 must see entries 2.. of that row masked.
    let sc = Scenario::generate(config.clone(), 2, &[40, 30], k, RoutingKind::Uniform, 0, base + 7);
    let mut bad = sc.topk_idx(1).as_i64().expect("int64").to_vec();
    bad[3 * k + 2] = experts as i64;
    let want = epflow_core::routing::Routing::new(bad.clone(), 30, k, experts).expect_err("invalid");
    let mut seen = sc.clone();
    let mut sanitized = bad.clone();
    sanitized[3 * k + 2..4 * k].fill(-1);
    seen.ranks[1].topk_idx = sanitized;
    let refs = seen.ll_rank_major_reference().expect("reference");
    on_ranks(&ranks, |rank| {
        let r = rank.rank();
        let stream = rank.context().new_stream().expect("stream");
        let idx = if r == 1 { HostTensor::topk_idx(30, k, bad.clone()) } else { sc.topk_idx(0) };
        let idx = rank.upload(&idx).expect("upload");
        let opts = HandleOptions::with_layout(Layout::RankMajor);
        rank.fill_output_buffers(0xA5).expect("fill");
        let (h, _) = blocking_handle_on(rank, &idx, &opts, &stream).expect("handed out before the kernel ran");
        let x = rank.upload(&seen.tokens(r)).expect("upload");
        let w = rank.upload(&seen.weights(r)).expect("upload");
        // Three dispatches on the handle: by default the third reads what the handle's kernel
        // built from the routing (sanitized), and still fails with the first one's error.
        for n in 0..3 {
            rank.fill_output_buffers(0xA5).expect("fill");
            let inputs = DispatchInputs::new(&x).with_weights(&w);
            let got = blocking_dispatch(rank, &h, inputs, &DispatchOptions::default(), false);
            match r {
                1 => assert_eq!(got.expect_err("rank 1's routing is invalid"), Error::Validation(want.clone())),
                _ => {
                    let host = got.expect("rank 0's dispatch").to_host().expect("to host");
                    let scales = host.scales.as_ref().and_then(HostTensor::as_f32);
                    let got_w = host.topk_weights.as_ref().and_then(HostTensor::as_f32).unwrap_or_default();
                    let got_i = host.topk_idx.as_ref().and_then(HostTensor::as_i32).unwrap_or_default();
                    let counts = host.counts.as_ref().and_then(HostTensor::as_i32).unwrap_or_default();
                    let (hid, m) = (config.hidden, 2048);
                    let d = check_rank_major_dispatch(
                        &refs[0],
                        hid,
                        m,
                        k,
                        host.tokens.data(),
                        scales,
                        got_w,
                        got_i,
                        counts,
                    );
                    assert!(d.ok() && d.checked > 0, "dispatch {n}: rank 0 received rank 1's sanitized rows: {d:?}");
                }
            }
        }
        assert!(!rank.core().poison().is_poisoned());
        let (d, c) = round(rank, &sc, Layout::RankMajor, false).expect("the group goes on");
        assert!(d.ok() && c.ok(), "rank {r}: {d:?} {c:?}");
    });
    eprintln!("ok: an invalid routing in stream order fails its rank's dispatch");
}

#[test]
fn rank_major_over_nccl_matches_reference() {
    let base = seed();
    eprintln!("seed {base}");
    let Some(devices) = nccl_gpus(2, "rank_major_over_nccl") else { return };
    for &(h, e, dt) in &WORLDS[1..3] {
        let t = Instant::now();
        check_world(&devices, h, e, dt, base, &Transport::Nccl);
        eprintln!("ok: NCCL 2 GPUs H={h} E={e} {dt:?} ({:.1} s)", t.elapsed().as_secs_f64());
    }
}

/// `EPFLOW_GPU_ITERS` (default 10,000) staged rounds with a fresh routing and handle each, and
/// token counts that change every round (tagged and fenced combines in turn), every combine
/// checked; dispatch checked in full every 1,000th round.
#[test]
fn rank_major_many_staged_iterations_with_fresh_routing() {
    let n = epflow_kernels::device_count().min(4);
    let Some(devices) = gpus(n.max(2), "rank_major_many_staged_iterations") else { return };
    if shared_gpu_sms(&devices).is_some() {
        // Each iteration frees its tensors; cuMemFree waits for the whole device, which on a
        // shared GPU includes the other rank's receive, waiting for this rank's next send.
        eprintln!("SKIPPED rank_major_many_staged_iterations: needs a GPU per rank");
        return;
    }
    let iters: u64 = std::env::var("EPFLOW_GPU_ITERS").ok().and_then(|s| s.parse().ok()).unwrap_or(10_000);
    let (hidden, experts, max_tokens, top_k) = (2048, 64, 128, 8);
    let config = GroupConfig::low_latency(experts, max_tokens, hidden);
    let ranks = GpuWorld::create(&devices, config.clone()).expect("create GPU group");
    let base = seed();
    eprintln!("seed {base}, {iters} iterations on {} ranks", devices.len());
    let start = Instant::now();
    let mismatches: Vec<u64> = on_ranks(&ranks, |rank| {
        let r = rank.rank();
        let mut bad = 0u64;
        for it in 0..iters {
            // A rank-major combine of at most 32 tokens takes its rows tagged.
            let per_rank = counts_across(it, devices.len(), 32, max_tokens);
            let sc = Scenario::generate(
                config.clone(),
                devices.len(),
                &per_rank,
                top_k,
                RoutingKind::Uniform,
                10,
                base ^ (it * 0x9e37_79b9),
            );
            let idx = rank.upload(&sc.topk_idx(r)).unwrap();
            let h = blocking_handle_with(rank, &idx, &HandleOptions::with_layout(Layout::RankMajor)).unwrap();
            let (x, w) = (rank.upload(&sc.tokens(r)).unwrap(), rank.upload(&sc.weights(r)).unwrap());
            let inputs = DispatchInputs::new(&x).with_weights(&w);
            let out = blocking_dispatch(rank, &h, inputs, &DispatchOptions::default(), true).unwrap();
            let host = out.to_host().unwrap();
            let got_w = host.topk_weights.as_ref().and_then(HostTensor::as_f32).unwrap();
            let got_i = host.topk_idx.as_ref().and_then(HostTensor::as_i32).unwrap();
            let counts = host.counts.as_ref().and_then(HostTensor::as_i32).unwrap();
            if it % 1000 == 0 {
                let refs = sc.ll_rank_major_reference().unwrap();
                let rep = check_rank_major_dispatch(
                    &refs[r],
                    hidden,
                    max_tokens,
                    top_k,
                    host.tokens.data(),
                    None,
                    got_w,
                    got_i,
                    counts,
                );
                bad += rep.mismatched;
            }
            let sums = rank_major_identity_expert_outputs(
                host.tokens.data(),
                None,
                got_w,
                got_i,
                counts,
                max_tokens,
                hidden,
                top_k,
            );
            let sums = rank.upload(&sums).unwrap();
            drop(out);
            let y = blocking_combine(rank, &h, CombineInputs::new(&sums), &CombineOptions::default(), true).unwrap();
            let want = identity_combine(&sc, r, experts / devices.len());
            let rep = check_bf16("combine", &want, y.to_host().unwrap().tokens.as_bf16().unwrap(), Tolerance::Exact);
            if !rep.ok() {
                eprintln!("iteration {it} rank {r}: {rep:?}");
            }
            bad += rep.mismatched;
        }
        bad
    });
    eprintln!(
        "{iters} staged iterations in {:.1} s, mismatches per rank {mismatches:?}",
        start.elapsed().as_secs_f64()
    );
    assert!(mismatches.iter().all(|&m| m == 0), "{mismatches:?}");
}

/// Tagged dispatch messages and combine rows carry the operation's number as a 32-bit tag, which
/// wraps every 2^32 operations of a channel (`sends_tagged`, `op_tag` and `EP_TAG_TOKENS` in
/// `ll_tagged.cuh`: nothing is cleared per operation, the last operations of a buffer set before
/// the wrap clear its tagged areas). Rounds first run at operation numbers 0.., leaving their
/// messages and rows in the tagged areas; every rank is then renumbered to just below the wrap,
/// and rounds cross it until their tags are the first rounds' again, on the same buffer sets: a
/// tagged area left uncleared would hand them the first rounds' data. Both layouts, synchronous
/// and staged, every dispatch and combine tagged, against the reference bit for bit.
#[test]
fn tagged_messages_across_the_tag_wrap() {
    rounds_across_a_renumbering("tagged_messages_across_the_tag_wrap", (1u64 << 32) - 6, 16);
}

/// `renumber_operations` straight past the wrap skips the operations that clear the tagged areas
/// there, so it clears them itself: rounds at operation numbers 0.. leave their messages and rows
/// in the tagged areas, every rank jumps to 2^32, and the rounds from there carry the first
/// rounds' tags again, on the same buffer sets, with other data.
#[test]
fn renumbering_past_the_tag_wrap_clears_the_tagged_areas() {
    rounds_across_a_renumbering("renumbering_past_the_tag_wrap_clears_the_tagged_areas", 1u64 << 32, 8);
}

/// The tag-wrap tests: rounds at operation numbers 0..8 (one dispatch and one combine each), then
/// every rank renumbered to `jump`, then `after` rounds from there (`tagged_round`).
fn rounds_across_a_renumbering(test: &str, jump: u64, after: u64) {
    let Some(devices) = gpus(2, test) else { return };
    let config = GroupConfig::low_latency(64, 32, 2048);
    let ranks = GpuWorld::create(&devices, config.clone()).expect("create GPU group");
    let base = seed();
    eprintln!("{test}: operations 0..8, then {jump}.., seed {base}");
    let rounds: Vec<u64> = (0..8).chain((0..after).map(|i| jump + i)).collect();
    for (i, &op) in rounds.iter().enumerate() {
        if op == jump {
            on_ranks(&ranks, |rank| rank.renumber_operations(jump).expect("renumber"));
        }
        tagged_round(&ranks, &config, base, i, op);
    }
}

/// Round `i` of the tag-wrap tests, at operation number `op` of both channels: its layout, token
/// counts and staging follow the operation's tag, so that a round after the wrap meets the one
/// before it with the same tag on the same buffer set in the same form, with other data (the
/// seed follows the round). Checked against the reference bit for bit.
fn tagged_round(ranks: &[GpuRank], config: &GroupConfig, base: u64, i: usize, op: u64) {
    let tag = (op as u32).wrapping_add(1).max(1) as usize;
    let layout = if tag % 2 == 0 { Layout::RankMajor } else { Layout::ExpertMajor };
    // At most 32 tokens: tagged dispatches; K = 4 on 2 ranks: tagged combines up to 16 tokens.
    let per_rank = [1 + (tag * 5) % 16, 1 + (tag * 3) % 16];
    let sc = Scenario::generate(config.clone(), 2, &per_rank, 4, RoutingKind::Uniform, 3, base.wrapping_add(i as u64));
    let staged = tag % 3 == 0;
    for (d, c) in on_ranks(ranks, |rank| round(rank, &sc, layout, staged).expect("round")) {
        let what = format!("round {i} (operation {op}, tag {tag}) {} staged={staged}", layout.name());
        assert!(d.ok() && d.checked > 0, "{what}: {d:?}");
        assert!(c.ok(), "{what}: {c:?}");
    }
}

/// Rank-major combine of identity experts for rank `r`, computed from its own inputs: per token,
/// over the ranks reached in first-entry order, `acc += bf16(fma chain of w[k] * x over that
/// rank's entries)`.
fn identity_combine(sc: &Scenario, r: usize, local: usize) -> Vec<epflow_core::bf16> {
    use epflow_core::bf16;
    let (h, k) = (sc.config.hidden, sc.top_k);
    let inp = &sc.ranks[r];
    let mut out = vec![bf16::ZERO; inp.num_tokens * h];
    for t in 0..inp.num_tokens {
        let idx = &inp.topk_idx[t * k..(t + 1) * k];
        let mut ranks: Vec<i64> = Vec::new();
        for &e in idx.iter().filter(|&&e| e >= 0) {
            if !ranks.contains(&(e / local as i64)) {
                ranks.push(e / local as i64);
            }
        }
        for c in 0..h {
            let x = inp.tokens[t * h + c].to_f32();
            let mut acc = 0f32;
            for &d in &ranks {
                let mut part = 0f32;
                for (j, &e) in idx.iter().enumerate() {
                    if e >= 0 && e / local as i64 == d {
                        part = inp.weights[t * k + j].mul_add(x, part);
                    }
                }
                acc += bf16::from_f32(part).to_f32();
            }
            out[t * h + c] = bf16::from_f32(acc);
        }
    }
    out
}

/// A rank that never joins: the others' rank-major dispatch times out within the bound, naming
/// it, and the group is poisoned.
#[test]
fn rank_major_absent_rank_times_out_without_hanging() {
    let Some(devices) = gpus(2, "rank_major_absent_rank_times_out") else { return };
    let timeout = Duration::from_secs(2);
    let config = GroupConfig::low_latency(16, 32, 2048).with_timeout(timeout).with_max_sms(shared_gpu_sms(&devices));
    let ranks = GpuWorld::create(&devices, config.clone()).expect("create GPU group");
    let sc = Scenario::generate(config, devices.len(), &[32], 4, RoutingKind::Uniform, 0, seed());
    let last = devices.len() - 1;
    let results = on_ranks(&ranks, |rank| {
        let r = rank.rank();
        if r == last {
            return None;
        }
        let idx = rank.upload(&sc.topk_idx(r)).unwrap();
        let h = blocking_handle_with(rank, &idx, &HandleOptions::with_layout(Layout::RankMajor)).unwrap();
        let (x, w) = (rank.upload(&sc.tokens(r)).unwrap(), rank.upload(&sc.weights(r)).unwrap());
        let t = Instant::now();
        let inputs = DispatchInputs::new(&x).with_weights(&w);
        let err = blocking_dispatch(rank, &h, inputs, &DispatchOptions::default(), true).unwrap_err();
        Some((err, t.elapsed()))
    });
    for res in results.into_iter().take(last) {
        let (err, took) = res.unwrap();
        eprintln!("{err} after {took:?}");
        assert!(
            matches!(err, Error::Timeout { ref waiting_for, .. } if waiting_for.contains(&format!("rank {last}"))),
            "{err}"
        );
        assert!(took < timeout + Duration::from_secs(2), "{took:?}");
    }
}

/// Small 1- and 2-rank runs for compute-sanitizer (memcheck, racecheck) on the rank-major
/// kernels: synchronous rounds (one launch) and staged ones (two); 16 and 9 tokens (tagged
/// messages), then 40 and 33 (plain, compacted).
#[test]
fn rank_major_sanitizer_config() {
    for n in [1usize, 2] {
        let Some(devices) = gpus(n, &format!("rank_major_sanitizer_config ({n} GPUs)")) else { continue };
        rank_major_sanitizer_rounds(&devices, 16, 9);
        rank_major_sanitizer_rounds(&devices, 40, 33);
    }
}

fn rank_major_sanitizer_rounds(devices: &[usize], first: usize, others: usize) {
    let per_rank: Vec<usize> = (0..devices.len()).map(|r| if r == 0 { first } else { others }).collect();
    for dtype in [DispatchDtype::Bf16, DispatchDtype::Fp8 { round_scales: false }] {
        let config = GroupConfig::low_latency(16, first, 1024)
            .with_dispatch_dtype(dtype)
            .with_max_top_k(16)
            .with_max_sms(shared_gpu_sms(devices));
        let ranks = GpuWorld::create(devices, config.clone()).expect("create GPU group");
        for i in 0..3u64 {
            let k = [4usize, 10, 16][i as usize];
            let sc =
                Scenario::generate(config.clone(), devices.len(), &per_rank, k, RoutingKind::Uniform, 3, seed() + i);
            for (d, c) in on_ranks(&ranks, |rank| round(rank, &sc, Layout::RankMajor, i % 2 == 1).expect("round")) {
                assert!(d.ok() && c.ok(), "{d:?} {c:?}");
            }
        }
    }
}

/// One process per GPU: run under `epflow launch -n N -- gpu_rank_major rank_major_one_process_per_gpu`
/// with the same `EPFLOW_TEST_SEED` in every process. Each process checks its own rank.
#[test]
fn rank_major_one_process_per_gpu() {
    let Some((env, comm, base)) = launched("rank_major_one_process_per_gpu") else { return };
    let n = env.world_size;
    for &(hidden, experts, dtype) in WORLDS {
        let config = GroupConfig::low_latency(experts, 256, hidden).with_dispatch_dtype(dtype).with_max_top_k(16);
        let rank = GpuWorld::join(&comm, config.clone()).expect("join the GPU group");
        let mut round_no = 0u64;
        for tokens in [1usize, 7, 128, 256] {
            for top_k in [1usize, 8, 16] {
                round_no += 1;
                let s = base.wrapping_add(round_no * 7919);
                let per_rank = uneven_tokens(n, tokens);
                let kind = if round_no % 5 == 0 { RoutingKind::SingleRank(0) } else { RoutingKind::Uniform };
                let sc = Scenario::generate(config.clone(), n, &per_rank, top_k, kind, 10.min(tokens), s);
                let (d, c) = round(&rank, &sc, Layout::RankMajor, round_no % 2 == 0).expect("round");
                let what = format!(
                    "rank {} of {n}: H={hidden} E={experts} {dtype:?} tokens={tokens} top_k={top_k} {kind:?} seed={s}",
                    env.rank
                );
                assert!(d.ok(), "{what}: {d:?}");
                assert!(c.ok(), "{what}: {c:?}");
            }
        }
        epflow_kernels::setup::bootstrap::barrier(&comm).expect("barrier");
        drop(rank);
        eprintln!("ok: rank {} of {n}, one process per GPU, rank-major H={hidden} E={experts} {dtype:?}", env.rank);
    }
}

/// `GpuRank::globalize_expert_ids_on` (NCCL EP API v2's `recv_topk_idx_kind` GLOBAL) against a
/// CPU reference, on every rank of the two-GPU handle group (two ranks on one GPU with
/// `EPFLOW_TEST_DEVICES=0,0`): random int32 and int64 ids with `-1`s, in rank-major blocks of
/// `M` rows per source with random per-source counts (rows past a count keep their stale values)
/// and with no counts (every row live); each rank's offset is its rank times 8 plus 3.
#[test]
fn global_expert_ids_gain_the_rank_offset_on_live_rows_only() {
    use epflow_core::tensor::{HostData, TensorTag};
    let Some((ranks, _, base)) = handle_world("global_expert_ids_gain_the_rank_offset_on_live_rows_only") else {
        return;
    };
    on_ranks(&ranks, |rank| {
        let r = rank.rank();
        let mut rng = base.wrapping_add(r as u64 * 0x9E37_79B9) | 1;
        let mut next = move || {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng
        };
        let stream = rank.context().new_stream().expect("stream");
        let (sources, m, k) = (4usize, 37usize, 8usize);
        let rows = sources * m;
        let offset = (r * 8 + 3) as i64;
        for wide in [false, true] {
            for with_counts in [true, false] {
                let ids: Vec<i64> =
                    (0..rows * k).map(|_| if next() % 4 == 0 { -1 } else { (next() % 16) as i64 }).collect();
                let counts: Vec<i32> = (0..sources).map(|_| (next() % (m as u64 + 1)) as i32).collect();
                let data = if wide {
                    HostData::I64(ids.clone())
                } else {
                    HostData::I32(ids.iter().map(|&v| v as i32).collect())
                };
                let dev = rank.upload(&HostTensor::new(TensorTag::TopkIdx, &[rows, k], data)).expect("upload");
                let c = rank
                    .upload(&HostTensor::new(
                        TensorTag::RecvExpertCountsDevice,
                        &[sources],
                        HostData::I32(counts.clone()),
                    ))
                    .expect("upload");
                let counted = with_counts.then_some((&c, m));
                rank.globalize_expert_ids_on(&stream, &dev, counted, offset).expect("globalize");
                stream.synchronize().expect("sync");
                let host = dev.download(rank.context()).expect("download");
                let got: Vec<i64> = match (host.as_i64(), host.as_i32()) {
                    (Some(v), _) => v.to_vec(),
                    (_, Some(v)) => v.iter().map(|&x| i64::from(x)).collect(),
                    _ => panic!("ids came back as {:?}", host.desc().dtype),
                };
                for (i, (&g, &v)) in got.iter().zip(&ids).enumerate() {
                    let row = i / k;
                    let live = !with_counts || (row % m) < counts[row / m] as usize;
                    let want = if live && v >= 0 { v + offset } else { v };
                    assert_eq!(g, want, "rank {r} wide={wide} counts={with_counts} entry {i} (row {row}), seed {base}");
                }
            }
        }
        // Refused: a float tensor, and counts that do not cover the rows.
        let w = rank.upload(&HostTensor::new(TensorTag::TopkWeights, &[2, 2], HostData::F32(vec![0.0; 4]))).unwrap();
        assert!(rank.globalize_expert_ids_on(&stream, &w, None, 1).is_err());
        let ids = rank.upload(&HostTensor::topk_idx(6, 2, vec![0; 12])).unwrap();
        let c =
            rank.upload(&HostTensor::new(TensorTag::RecvExpertCountsDevice, &[4], HostData::I32(vec![1; 4]))).unwrap();
        assert!(rank.globalize_expert_ids_on(&stream, &ids, Some((&c, 2)), 1).is_err(), "4 sources x 2 rows != 6");
    });
    eprintln!("ok: global expert ids, {} ranks", ranks.len());
}

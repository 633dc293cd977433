//! Low-latency dispatch/combine on GPUs against the CPU reference (one process driving 1, 2 or 4
//! GPUs; synchronous rounds run as one launch per operation, staged rounds as two). Without enough GPUs every test prints SKIPPED and passes: CI has no GPU; these run on
//! the device machines (`scripts/device-pack.sh`).
//!
//! Inputs are fresh random data for every round (seed printed; `EPFLOW_TEST_SEED` replays),
//! outputs are poisoned before every operation, and both dispatch (payload, scales, counters) and
//! combine must match the reference bit for bit.

use std::time::{Duration, Instant};

use epflow_core::backend::{blocking_combine, blocking_dispatch, blocking_handle};
use epflow_core::ops::{CombineInputs, CombineOptions, DispatchInputs, DispatchOptions};
use epflow_core::scenario::Scenario;
use epflow_core::verify::{Report, Tolerance, check_bf16, check_ll_dispatch};
use epflow_core::workload::RoutingKind;
use epflow_core::{DispatchDtype, Error, GroupConfig, HostTensor, bf16};
use epflow_kernels::{GpuRank, GpuWorld, Transport, device_count};

mod common;
use common::{World, counts_across, for_each_world, gpus, launched, nccl_gpus, on_ranks, seed, uneven_tokens};

/// One dispatch + identity experts + combine on every rank; returns (dispatch, combine) reports.
fn round(
    rank: &GpuRank,
    sc: &Scenario,
    refs: &[epflow_core::reference::LlDispatchResult],
    want: &[Vec<bf16>],
    staged: bool,
) -> Result<(Report, Report), Error> {
    let r = epflow_core::backend::Backend::rank(rank);
    rank.fill_output_buffers(0xA5)?;
    let idx = rank.upload(&sc.topk_idx(r))?;
    let h = blocking_handle(rank, &idx)?;
    let x = rank.upload(&sc.tokens(r))?;
    let out = blocking_dispatch(rank, &h, DispatchInputs::new(&x), &DispatchOptions::default(), staged)?;
    let host = out.to_host()?;
    let rows = sc.num_ranks * sc.config.fixed_max_tokens().unwrap_or(0);
    let counts = host.counts.as_ref().and_then(HostTensor::as_i32).unwrap_or_default().to_vec();
    let d = check_ll_dispatch(
        &refs[r],
        sc.config.hidden,
        rows,
        host.tokens.data(),
        host.scales.as_ref().and_then(HostTensor::as_f32),
        &counts,
    );
    let experts = match out.scales() {
        Some(s) => rank.dequantize_fp8(out.tokens(), s)?,
        None => out.tokens().clone(),
    };
    let w = rank.upload(&sc.weights(r))?;
    let y =
        blocking_combine(rank, &h, CombineInputs::new(&experts).with_weights(&w), &CombineOptions::default(), staged)?;
    let yh = y.to_host()?;
    let c = check_bf16("combine", &want[r], yh.tokens.as_bf16().unwrap_or_default(), Tolerance::Exact);
    Ok((d.context(&format!("rank {r} dispatch")), c.context(&format!("rank {r} combine"))))
}

fn check_world(
    devices: &[usize],
    hidden: usize,
    experts: usize,
    dtype: DispatchDtype,
    base_seed: u64,
    transport: &Transport,
) {
    let max_tokens = 256;
    // Ranks sharing a GPU (`EPFLOW_TEST_DEVICES=0,0,1,1`) get the library's SM bound
    // (`GpuWorld::create`), not one of the test's.
    let config = GroupConfig::low_latency(experts, max_tokens, hidden).with_dispatch_dtype(dtype);
    let ranks = GpuWorld::create_with(devices, config.clone(), transport.clone()).expect("create GPU group");
    let mut round_no = 0u64;
    // 1 and 7 tokens: every rank's dispatch goes out as tagged messages; 40: the last rank's 21
    // only (one receive takes both forms); 128 and 256: none.
    for tokens in [1usize, 7, 40, 128, 256] {
        for top_k in [1usize, 4, 8] {
            let kinds: &[RoutingKind] = if tokens == 128 && top_k == 4 {
                &[RoutingKind::Uniform, RoutingKind::SingleRank(1 % devices.len())]
            } else {
                &[RoutingKind::Uniform]
            };
            for &kind in kinds {
                round_no += 1;
                let s = base_seed.wrapping_add(round_no * 7919);
                let per_rank = uneven_tokens(devices.len(), tokens);
                let sc = Scenario::generate(config.clone(), devices.len(), &per_rank, top_k, kind, 10.min(tokens), s);
                let refs = sc.ll_dispatch_reference().unwrap();
                let want = sc.ll_combine_identity_reference(&refs).unwrap();
                let staged = round_no % 2 == 0;
                for (d, c) in on_ranks(&ranks, |rank| round(rank, &sc, &refs, &want, staged).expect("round")) {
                    let what = format!(
                        "R={} H={hidden} E={experts} {dtype:?} tokens={tokens} top_k={top_k} {kind:?} staged={staged} \
                         {transport:?} seed={s}",
                        devices.len()
                    );
                    assert!(d.ok(), "{what}: {d:?}");
                    assert!(c.ok(), "{what}: {c:?}");
                }
            }
        }
    }
}

#[test]
fn ll_matches_reference_on_1_2_and_4_gpus() {
    let base = seed();
    eprintln!("seed {base}");
    let worlds: &[World] = &[
        (2048, 8, DispatchDtype::Bf16),
        (4096, 64, DispatchDtype::Fp8 { round_scales: false }),
        (7168, 256, DispatchDtype::Bf16),
        (7168, 256, DispatchDtype::Fp8 { round_scales: true }),
        (2048, 64, DispatchDtype::Bf16),
        (4096, 256, DispatchDtype::Fp8 { round_scales: false }),
    ];
    for_each_world("ll_matches_reference", &[1, 2, 4], gpus, worlds, |devices, (h, e, dt)| {
        check_world(devices, h, e, dt, base, &Transport::Auto)
    });
}

/// The same rounds with every exchange between distinct ranks over NCCL (`Transport::Nccl`).
#[test]
fn ll_over_nccl_matches_reference_on_2_and_4_gpus() {
    let base = seed();
    eprintln!("seed {base}");
    let worlds: &[World] = &[
        (7168, 256, DispatchDtype::Bf16),
        (7168, 256, DispatchDtype::Fp8 { round_scales: true }),
        (2048, 64, DispatchDtype::Fp8 { round_scales: false }),
    ];
    for_each_world("ll_over_nccl", &[2, 4], nccl_gpus, worlds, |devices, (h, e, dt)| {
        check_world(devices, h, e, dt, base, &Transport::Nccl)
    });
}

/// Two declared "hosts" of 2 GPUs: NVLink inside each, NCCL between them (run with
/// `NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1` to force NCCL onto its socket transport).
#[test]
fn ll_hierarchical_two_hosts_matches_reference() {
    let Some(devices) = nccl_gpus(4, "ll_hierarchical_two_hosts") else { return };
    let base = seed();
    eprintln!("seed {base}");
    let split = Transport::split_hosts(4, 2).expect("split");
    for (h, e, dt) in [(7168, 256, DispatchDtype::Bf16), (4096, 64, DispatchDtype::Fp8 { round_scales: false })] {
        let t = Instant::now();
        check_world(&devices, h, e, dt, base, &split);
        eprintln!("ok: 2 hosts x 2 GPUs H={h} E={e} {dt:?} ({:.1} s)", t.elapsed().as_secs_f64());
    }
}

/// The combine of identity experts, computed directly: out[t] = bf16(fma chain over valid k of
/// w[t][k] * x[t]).
fn identity_combine(tokens: &[bf16], idx: &[i64], w: &[f32], hidden: usize, top_k: usize) -> Vec<bf16> {
    let b = tokens.len() / hidden;
    let mut out = Vec::with_capacity(tokens.len());
    for t in 0..b {
        for c in 0..hidden {
            let x = tokens[t * hidden + c].to_f32();
            let mut acc = 0f32;
            for k in 0..top_k {
                if idx[t * top_k + k] >= 0 {
                    acc = w[t * top_k + k].mul_add(x, acc);
                }
            }
            out.push(bf16::from_f32(acc));
        }
    }
    out
}

/// `EPFLOW_GPU_ITERS` (default 10,000) staged rounds with a fresh routing and handle each, and
/// token counts that change every round (tagged and fenced combines in turn), every combine
/// checked.
#[test]
fn ll_many_staged_iterations_with_fresh_routing() {
    let n = device_count().min(4);
    let Some(devices) = gpus(n.max(2), "ll_many_staged_iterations") else { return };
    let iters: u64 = std::env::var("EPFLOW_GPU_ITERS").ok().and_then(|s| s.parse().ok()).unwrap_or(10_000);
    let (hidden, experts, max_tokens, top_k) = (2048, 64, 128, 8);
    let config = GroupConfig::low_latency(experts, max_tokens, hidden);
    let ranks = GpuWorld::create(&devices, config.clone()).expect("create GPU group");
    let base = seed();
    eprintln!("seed {base}, {iters} iterations on {} GPUs", devices.len());
    let start = Instant::now();
    let mismatches: Vec<u64> = on_ranks(&ranks, |rank| {
        let r = epflow_core::backend::Backend::rank(rank);
        let mut bad = 0u64;
        for it in 0..iters {
            // An expert-major combine of at most 32 x R / K tokens takes its rows tagged.
            let per_rank = counts_across(it, devices.len(), 32 * devices.len() / top_k, max_tokens);
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
            let h = blocking_handle(rank, &idx).unwrap();
            let x = rank.upload(&sc.tokens(r)).unwrap();
            let out = blocking_dispatch(rank, &h, DispatchInputs::new(&x), &DispatchOptions::default(), true).unwrap();
            if it % 1000 == 0 {
                let refs = sc.ll_dispatch_reference().unwrap();
                let host = out.to_host().unwrap();
                let rep = check_ll_dispatch(
                    &refs[r],
                    hidden,
                    devices.len() * max_tokens,
                    host.tokens.data(),
                    None,
                    host.counts.as_ref().unwrap().as_i32().unwrap(),
                );
                bad += rep.mismatched;
            }
            let w = rank.upload(&sc.weights(r)).unwrap();
            let y = blocking_combine(
                rank,
                &h,
                CombineInputs::new(out.tokens()).with_weights(&w),
                &CombineOptions::default(),
                true,
            )
            .unwrap();
            let got = y.to_host().unwrap();
            let want =
                identity_combine(&sc.ranks[r].tokens, &sc.ranks[r].topk_idx, &sc.ranks[r].weights, hidden, top_k);
            let rep = check_bf16("combine", &want, got.tokens.as_bf16().unwrap(), Tolerance::Exact);
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

#[test]
fn ll_absent_rank_times_out_without_hanging() {
    absent_rank_times_out(&Transport::Auto);
}

/// Over NCCL the peer's missing `ncclRecv` leaves NCCL's kernel waiting: the operation still
/// fails at its deadline, and dropping it aborts the communicators.
#[test]
fn ll_over_nccl_absent_rank_times_out_without_hanging() {
    absent_rank_times_out(&Transport::Nccl);
}

fn absent_rank_times_out(transport: &Transport) {
    let pick = if *transport == Transport::Nccl { nccl_gpus } else { gpus };
    let Some(devices) = pick(2, &format!("ll_absent_rank_times_out ({transport:?})")) else { return };
    let timeout = Duration::from_secs(2);
    let config = GroupConfig::low_latency(16, 32, 2048).with_timeout(timeout);
    let ranks = GpuWorld::create_with(&devices, config.clone(), transport.clone()).expect("create GPU group");
    // Over NCCL, cleaning up the failed operation takes one more device deadline (its receive
    // kernel waits for the arrival word that never came).
    let slack = if *transport == Transport::Nccl { timeout + Duration::from_secs(2) } else { Duration::from_secs(2) };
    let sc = Scenario::generate(config, devices.len(), &[32], 4, RoutingKind::Uniform, 0, seed());
    let last = devices.len() - 1;
    let results = on_ranks(&ranks, |rank| {
        let r = epflow_core::backend::Backend::rank(rank);
        if r == last {
            return None;
        }
        let idx = rank.upload(&sc.topk_idx(r)).unwrap();
        let h = blocking_handle(rank, &idx).unwrap();
        let x = rank.upload(&sc.tokens(r)).unwrap();
        let t = Instant::now();
        let err = blocking_dispatch(rank, &h, DispatchInputs::new(&x), &DispatchOptions::default(), true).unwrap_err();
        let again =
            blocking_dispatch(rank, &h, DispatchInputs::new(&x), &DispatchOptions::default(), false).unwrap_err();
        Some((err, t.elapsed(), again))
    });
    for (r, res) in results.into_iter().enumerate().take(last) {
        let (err, took, again) = res.unwrap();
        eprintln!("rank {r}: {err} after {took:?}; then: {again}");
        assert!(
            matches!(err, Error::Timeout { ref waiting_for, .. } if waiting_for.contains(&format!("rank {last}"))),
            "{err}"
        );
        assert!(took < timeout + slack, "{took:?}");
        assert!(matches!(again, Error::Poisoned { .. }), "{again}");
    }
}

/// `GpuRank::meet_on`: a rank's stream passes its meeting only once every rank came to it, meeting
/// after meeting (rank 0 comes 200 ms late each time, behind a spin kernel).
#[test]
fn ll_meeting_holds_every_rank_until_the_last_comes() {
    let Some(devices) = gpus(2, "ll_meeting_holds_every_rank_until_the_last_comes") else { return };
    let config = GroupConfig::low_latency(16, 32, 2048);
    let ranks = GpuWorld::create(&devices, config).expect("create GPU group");
    let late = Duration::from_millis(200);
    let timed = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
    for meeting in 1..=3 {
        // Enqueued one rank after the other from this thread: rank 0's spin is ahead of rank
        // 1's meeting by far less than `late`.
        let mut waits = Vec::new();
        for rank in &ranks {
            let stream = rank.stream(epflow_core::protocol::Channel::Dispatch);
            if epflow_core::backend::Backend::rank(rank) == 0 {
                rank.delay_on(stream, late).expect("spin");
            }
            let (a, b) = (rank.context().new_event(timed).unwrap(), rank.context().new_event(timed).unwrap());
            a.record(stream).unwrap();
            rank.meet_on(stream).expect("meet");
            b.record(stream).unwrap();
            waits.push((a, b));
        }
        let (a, b) = &waits[1];
        b.synchronize().unwrap();
        let waited = Duration::from_secs_f32(a.elapsed_ms(b).unwrap() / 1e3);
        eprintln!("meeting {meeting}: rank 1 waited {waited:?} for rank 0");
        assert!(waited > late * 3 / 4 && waited < late * 3, "{waited:?}");
        waits[0].1.synchronize().unwrap();
    }
}

/// A rank that never comes to a meeting: the others' meeting kernels give up at the deadline and
/// their next operation fails with a timeout naming the meeting; nothing hangs.
#[test]
fn ll_meeting_without_a_rank_times_out() {
    let Some(devices) = gpus(2, "ll_meeting_without_a_rank_times_out") else { return };
    let timeout = Duration::from_secs(2);
    let config = GroupConfig::low_latency(16, 32, 2048).with_timeout(timeout);
    let ranks = GpuWorld::create(&devices, config.clone()).expect("create GPU group");
    let sc = Scenario::generate(config, devices.len(), &[32], 4, RoutingKind::Uniform, 0, seed());
    let rank = &ranks[1];
    let t = Instant::now();
    let stream = rank.stream(epflow_core::protocol::Channel::Dispatch);
    rank.meet_on(stream).expect("meet");
    stream.synchronize().expect("the meeting ends at its deadline");
    let met = t.elapsed();
    let idx = rank.upload(&sc.topk_idx(1)).unwrap();
    let h = blocking_handle(rank, &idx).unwrap();
    let x = rank.upload(&sc.tokens(1)).unwrap();
    let err = blocking_dispatch(rank, &h, DispatchInputs::new(&x), &DispatchOptions::default(), false).unwrap_err();
    eprintln!("gave up after {met:?}; then {err}");
    assert!(met > timeout / 2 && met < timeout + Duration::from_secs(1), "{met:?}");
    assert!(
        matches!(err, Error::Timeout { ref waiting_for, .. } if waiting_for.contains("rank 0 to come to meeting #1")),
        "{err}"
    );
}

/// A small 2-GPU run for compute-sanitizer (memcheck, racecheck).
#[test]
fn ll_sanitizer_config() {
    for n in [1usize, 2] {
        let Some(devices) = gpus(n, &format!("ll_sanitizer_config ({n} GPUs)")) else { continue };
        sanitizer_rounds(&devices);
    }
}

/// Small synchronous (one launch) and staged (two launches) rounds, BF16 and FP8.
fn sanitizer_rounds(devices: &[usize]) {
    let per_rank: Vec<usize> = (0..devices.len()).map(|r| if r == 0 { 16 } else { 9 }).collect();
    for dtype in [DispatchDtype::Bf16, DispatchDtype::Fp8 { round_scales: false }] {
        let config = GroupConfig::low_latency(16, 16, 1024).with_dispatch_dtype(dtype);
        let ranks = GpuWorld::create(devices, config.clone()).expect("create GPU group");
        for i in 0..3 {
            let sc =
                Scenario::generate(config.clone(), devices.len(), &per_rank, 4, RoutingKind::Uniform, 3, seed() + i);
            let refs = sc.ll_dispatch_reference().unwrap();
            let want = sc.ll_combine_identity_reference(&refs).unwrap();
            for (d, c) in on_ranks(&ranks, |rank| round(rank, &sc, &refs, &want, i % 2 == 1).expect("round")) {
                assert!(d.ok() && c.ok(), "{d:?} {c:?}");
            }
        }
    }
}

/// `GpuRank::ll_launch_costs` (`epflow diag launch`) times every low-latency kernel as a device
/// no-op, and leaves the group as it found it: synchronous and staged rounds right after still
/// match the reference.
#[test]
fn ll_launch_costs_time_every_kernel_and_change_nothing() {
    let Some(devices) = gpus(1, "ll_launch_costs") else { return };
    let config = GroupConfig::low_latency(16, 16, 1024);
    let ranks = GpuWorld::create(&devices, config.clone()).expect("create GPU group");
    let costs = ranks[0].ll_launch_costs(1, 20).expect("launch costs");
    let names: Vec<&str> = costs.iter().map(|c| c.kernel).collect();
    assert_eq!(
        names,
        [
            "ep_ll_dispatch_send",
            "ep_ll_dispatch_recv",
            "ep_ll_dispatch_kernel",
            "ep_ll_combine_send",
            "ep_ll_combine_recv",
            "ep_ll_combine_kernel"
        ]
    );
    for c in &costs {
        for us in [c.idle_us, c.queued_us, c.after_wait_us, c.after_unobserved_wait_us, c.after_pending_wait_us] {
            assert!(us.is_finite() && us > 0.0, "{c:?}");
        }
        eprintln!(
            "{}: {:.2} us idle, {:.2} us queued, {:.2} us after a wait",
            c.kernel, c.idle_us, c.queued_us, c.after_wait_us
        );
    }
    assert!(ranks[0].ll_launch_costs(1, 0).is_err());
    for i in 0..2 {
        let sc = Scenario::generate(config.clone(), 1, &[16], 4, RoutingKind::Uniform, 3, seed() + i);
        let refs = sc.ll_dispatch_reference().unwrap();
        let want = sc.ll_combine_identity_reference(&refs).unwrap();
        let (d, c) = round(&ranks[0], &sc, &refs, &want, i == 1).expect("round");
        assert!(d.ok() && c.ok(), "{d:?} {c:?}");
    }
}

/// One process per GPU: run under `epflow launch -n N -- gpu_ll ll_one_process_per_gpu` with the
/// same `EPFLOW_TEST_SEED` in every process. Each process checks its own rank.
#[test]
fn ll_one_process_per_gpu() {
    let Some((env, comm, base)) = launched("ll_one_process_per_gpu") else { return };
    let worlds: &[(usize, usize, DispatchDtype)] = &[
        (2048, 8, DispatchDtype::Bf16),
        (7168, 256, DispatchDtype::Bf16),
        (7168, 256, DispatchDtype::Fp8 { round_scales: true }),
        (4096, 64, DispatchDtype::Fp8 { round_scales: false }),
    ];
    let n = env.world_size;
    for &(hidden, experts, dtype) in worlds {
        let config = GroupConfig::low_latency(experts, 256, hidden).with_dispatch_dtype(dtype);
        let rank = GpuWorld::join(&comm, config.clone()).expect("join the GPU group");
        let mut round_no = 0u64;
        for tokens in [1usize, 7, 128, 256] {
            for top_k in [1usize, 4, 8] {
                round_no += 1;
                let s = base.wrapping_add(round_no * 7919);
                let per_rank = uneven_tokens(n, tokens);
                let kind = if round_no % 5 == 0 { RoutingKind::SingleRank(0) } else { RoutingKind::Uniform };
                let sc = Scenario::generate(config.clone(), n, &per_rank, top_k, kind, 10.min(tokens), s);
                let refs = sc.ll_dispatch_reference().unwrap();
                let want = sc.ll_combine_identity_reference(&refs).unwrap();
                let (d, c) = round(&rank, &sc, &refs, &want, round_no % 2 == 0).expect("round");
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
        eprintln!("ok: rank {} of {n}, one process per GPU, H={hidden} E={experts} {dtype:?}", env.rank);
    }
}

/// A BF16 group's dispatch asking for FP8 per call (`DispatchOptions::dtype`, NCCL EP API v2's
/// `DS_FP8E3M4`), into caller memory poisoned first: tokens, scales and counts bit for bit
/// against the reference of an FP8 group, with and without power-of-two scales, staged and not;
/// then the combine of identity experts over the dequantized rows, exact against the FP8
/// group's combine reference. The same handle then dispatches BF16 again, checked. Without
/// caller targets for the scales the per-call FP8 dispatch is refused. Two ranks (on one GPU
/// with `EPFLOW_TEST_DEVICES=0,0`).
#[test]
fn ll_fp8_per_call_into_caller_memory_matches_an_fp8_group() {
    use epflow_core::backend::Backend;
    use epflow_core::scenario::ll_identity_expert_outputs;
    let Some(devices) = gpus(2, "ll_fp8_per_call_into_caller_memory") else { return };
    let (hidden, experts, max_tokens, top_k) = (1024, 16, 64, 4);
    let bf16_group = GroupConfig::low_latency(experts, max_tokens, hidden);
    let ranks = GpuWorld::create(&devices, bf16_group.clone()).expect("create GPU group");
    let base = seed();
    eprintln!("seed {base}");
    let rows = devices.len() * max_tokens;
    for (i, dtype) in
        [DispatchDtype::Fp8 { round_scales: false }, DispatchDtype::Fp8 { round_scales: true }].into_iter().enumerate()
    {
        for staged in [false, true] {
            let s = base.wrapping_add(i as u64 * 31 + u64::from(staged));
            let fp8_group = bf16_group.clone().with_dispatch_dtype(dtype);
            let sc = Scenario::generate(fp8_group, devices.len(), &[max_tokens, 23], top_k, RoutingKind::Uniform, 5, s);
            let bf = Scenario::generate(
                bf16_group.clone(),
                devices.len(),
                &[max_tokens, 23],
                top_k,
                RoutingKind::Uniform,
                5,
                s,
            );
            let refs = sc.ll_dispatch_reference().unwrap();
            let combine_ref = sc.ll_combine_identity_reference(&refs).unwrap();
            let bf_refs = bf.ll_dispatch_reference().unwrap();
            let what = format!("{dtype:?} staged={staged} seed={s}");
            on_ranks(&ranks, |rank| {
                let r = rank.rank();
                let idx = rank.upload(&sc.topk_idx(r)).unwrap();
                let h = blocking_handle(rank, &idx).unwrap();
                let x = rank.upload(&sc.tokens(r)).unwrap();
                let opts = DispatchOptions { dtype: Some(dtype), ..Default::default() };
                let out = dispatch_into_poisoned(rank, &h, &x, &opts, staged).expect("per-call FP8 dispatch");
                let counts = out.counts.as_ref().unwrap().as_i32().unwrap().to_vec();
                let scales = out.scales.as_ref().and_then(HostTensor::as_f32);
                assert!(scales.is_some(), "rank {r} {what}: no scales");
                let d = check_ll_dispatch(&refs[r], hidden, rows, out.tokens.data(), scales, &counts);
                assert!(d.ok() && d.checked > 0, "rank {r} {what}: dispatch {d:?}");
                let experts = ll_identity_expert_outputs(out.tokens.data(), scales, &counts, rows, hidden);
                let experts = rank.upload(&experts).unwrap();
                let w = rank.upload(&sc.weights(r)).unwrap();
                let y = blocking_combine(
                    rank,
                    &h,
                    CombineInputs::new(&experts).with_weights(&w),
                    &CombineOptions::default(),
                    true,
                )
                .unwrap();
                let c = check_bf16(
                    "combine",
                    &combine_ref[r],
                    y.to_host().unwrap().tokens.as_bf16().unwrap(),
                    Tolerance::Exact,
                );
                assert!(c.ok(), "rank {r} {what}: combine {c:?}");
                // The next dispatch of the same group is BF16 again (into epflow's buffers).
                let out =
                    blocking_dispatch(rank, &h, DispatchInputs::new(&x), &DispatchOptions::default(), true).unwrap();
                let host = out.to_host().unwrap();
                let d = check_ll_dispatch(
                    &bf_refs[r],
                    hidden,
                    rows,
                    host.tokens.data(),
                    None,
                    host.counts.as_ref().unwrap().as_i32().unwrap(),
                );
                assert!(d.ok() && d.checked > 0, "rank {r} {what}: BF16 dispatch after FP8 {d:?}");
                // Its combine pairs with it (a dispatch is always followed by its combine).
                let bf_counts = host.counts.as_ref().unwrap().as_i32().unwrap();
                let experts = rank
                    .upload(&ll_identity_expert_outputs(host.tokens.data(), None, bf_counts, rows, hidden))
                    .unwrap();
                let cin = CombineInputs::new(&experts).with_weights(&w);
                drop(out);
                blocking_combine(rank, &h, cin, &CombineOptions::default(), true).unwrap();
            });
            eprintln!("ok: per-call FP8, {what}");
        }
    }
    // Into epflow's own buffers (no scales there): refused on every rank, then the group goes on.
    on_ranks(&ranks, |rank| {
        let idx = rank.upload(&HostTensor::topk_idx(1, 1, vec![0])).unwrap();
        let h = blocking_handle(rank, &idx).unwrap();
        let x = rank.upload(&HostTensor::tokens(1, hidden, vec![bf16::ZERO; hidden])).unwrap();
        let opts = DispatchOptions { dtype: Some(DispatchDtype::Fp8 { round_scales: false }), ..Default::default() };
        let e = rank.start_dispatch(&h, DispatchInputs::new(&x), &opts).map(drop).unwrap_err().to_string();
        assert!(e.contains("caller's tensors with scales"), "{e}");
    });
}

/// One dispatch of `x` on `h` into caller buffers poisoned with 0xA5 (tokens, and scales and
/// counts where the descriptors have them), run to its end (`staged`: send, then complete);
/// the outputs copied to the host.
fn dispatch_into_poisoned(
    rank: &GpuRank,
    h: &epflow_kernels::GpuHandle,
    x: &epflow_kernels::DeviceTensor,
    opts: &DispatchOptions,
    staged: bool,
) -> Result<epflow_core::ops::DispatchOutputs<HostTensor>, Error> {
    dispatch_into_poisoned_inputs(rank, h, DispatchInputs::new(x), opts, staged)
}

/// [`dispatch_into_poisoned`] of any inputs.
fn dispatch_into_poisoned_inputs(
    rank: &GpuRank,
    h: &epflow_kernels::GpuHandle,
    inputs: DispatchInputs<'_, epflow_kernels::DeviceTensor>,
    opts: &DispatchOptions,
    staged: bool,
) -> Result<epflow_core::ops::DispatchOutputs<HostTensor>, Error> {
    use epflow_core::backend::{Backend, OpOutput, complete_blocking, run_blocking, send_blocking};
    use epflow_core::protocol::Channel;
    use epflow_kernels::OutputTargets;
    use epflow_kernels::device::DeviceBuffer;
    let descs = rank.dispatch_output_descs(h, opts);
    let alloc = |d: &epflow_core::TensorDesc| -> Result<DeviceBuffer, Error> {
        let b = DeviceBuffer::zeroed(rank.context(), d.size_bytes().max(1))?;
        b.write(0, &vec![0xA5u8; d.size_bytes()])?;
        Ok(b)
    };
    let tokens = alloc(&descs.tokens)?;
    let scales = descs.scales.as_ref().map(alloc).transpose()?;
    let counts = descs.counts.as_ref().map(alloc).transpose()?;
    let into = OutputTargets {
        tokens: tokens.ptr(),
        scales: scales.as_ref().map(DeviceBuffer::ptr),
        counts: counts.as_ref().map(DeviceBuffer::ptr),
        ..OutputTargets::default()
    };
    // SAFETY: every address is a buffer of this rank's device holding the tensor its descriptor
    // describes; the buffers live until this function returns, after the operation completed.
    let op = unsafe { rank.start_dispatch_into(h, inputs, opts, &into)? };
    let out = if staged {
        let op = send_blocking(op, rank.slot_pool(Channel::Dispatch), rank.poison(), rank.config().timeout)?;
        complete_blocking(op, rank.poison(), rank.config().timeout)?
    } else {
        run_blocking(op, rank.slot_pool(Channel::Dispatch), rank.poison(), rank.config().timeout)?
    };
    match out {
        OpOutput::Dispatch(d) => d.to_host(),
        _ => Err(Error::Backend("dispatch returned another output".into())),
    }
}

/// A group made with `GroupConfig::caller_outputs` (as `libnccl_ep.so` makes them) holds no
/// dispatch output sets: its memory is smaller by exactly `sets x [L x R*M x H]` BF16 than the
/// same config's without. Dispatches into poisoned caller memory (staged and not) match the
/// reference bit for bit, and their combines are exact; a dispatch without targets is refused
/// with a message naming the setting, and the group goes on. Two ranks (on one GPU with
/// `EPFLOW_TEST_DEVICES=0,0`) or one.
#[test]
fn ll_group_with_caller_outputs_keeps_none_and_stays_exact() {
    use epflow_core::backend::Backend;
    use epflow_core::scenario::ll_identity_expert_outputs;
    let name = "ll_group_with_caller_outputs";
    let Some(devices) = gpus(2, name).or_else(|| gpus(1, name)) else { return };
    let (hidden, experts, max_tokens, top_k) = (1024, 16, 64, 4);
    let own = GroupConfig::low_latency(experts, max_tokens, hidden);
    let config = own.clone().with_caller_outputs(true);
    let ranks = GpuWorld::create(&devices, config.clone()).expect("create GPU group");
    let n = devices.len();
    let own_bytes = GpuWorld::create(&devices, own).expect("create GPU group")[0].device_memory_bytes();
    let saved = config.buffer_sets * (experts / n) * n * max_tokens * hidden * 2;
    assert_eq!(own_bytes - ranks[0].device_memory_bytes(), saved, "the dispatch output sets are not held");
    let base = seed();
    eprintln!("seed {base}");
    let rows = n * max_tokens;
    for (i, staged) in [false, true, false].into_iter().enumerate() {
        let s = base.wrapping_add(i as u64);
        let tokens: Vec<usize> = (0..n).map(|r| if r == 0 { max_tokens } else { 23 }).collect();
        let sc = Scenario::generate(config.clone(), n, &tokens, top_k, RoutingKind::Uniform, 5, s);
        let refs = sc.ll_dispatch_reference().unwrap();
        let want = sc.ll_combine_identity_reference(&refs).unwrap();
        on_ranks(&ranks, |rank| {
            let r = rank.rank();
            let idx = rank.upload(&sc.topk_idx(r)).unwrap();
            let h = blocking_handle(rank, &idx).unwrap();
            let x = rank.upload(&sc.tokens(r)).unwrap();
            let out = dispatch_into_poisoned(rank, &h, &x, &DispatchOptions::default(), staged).expect("dispatch");
            let counts = out.counts.as_ref().unwrap().as_i32().unwrap().to_vec();
            let d = check_ll_dispatch(&refs[r], hidden, rows, out.tokens.data(), None, &counts);
            assert!(d.ok() && d.checked > 0, "rank {r} staged={staged} seed={s}: dispatch {d:?}");
            let experts =
                rank.upload(&ll_identity_expert_outputs(out.tokens.data(), None, &counts, rows, hidden)).unwrap();
            let w = rank.upload(&sc.weights(r)).unwrap();
            let y = blocking_combine(
                rank,
                &h,
                CombineInputs::new(&experts).with_weights(&w),
                &CombineOptions::default(),
                staged,
            )
            .unwrap();
            let c = check_bf16("combine", &want[r], y.to_host().unwrap().tokens.as_bf16().unwrap(), Tolerance::Exact);
            assert!(c.ok(), "rank {r} staged={staged} seed={s}: combine {c:?}");
        });
        eprintln!("ok: caller outputs, staged={staged} seed={s}");
    }
    // Without targets: refused on every rank, naming the setting; then the group goes on.
    on_ranks(&ranks, |rank| {
        let idx = rank.upload(&HostTensor::topk_idx(1, 1, vec![0])).unwrap();
        let h = blocking_handle(rank, &idx).unwrap();
        let x = rank.upload(&HostTensor::tokens(1, hidden, vec![bf16::ZERO; hidden])).unwrap();
        let e = rank.start_dispatch(&h, DispatchInputs::new(&x), &DispatchOptions::default()).map(drop).unwrap_err();
        assert!(e.to_string().contains("caller_outputs"), "{e}");
        let out = dispatch_into_poisoned(rank, &h, &x, &DispatchOptions::default(), false)
            .expect("dispatch after the refusal");
        assert_eq!(out.counts.as_ref().unwrap().as_i32().unwrap()[0], i32::from(rank.rank() == 0) * n as i32);
    });
}

/// Forwarded rows (`DispatchDtype::Forwarded`, NCCL EP API v2's FWD recipe): every token's
/// payload bytes and scale bytes reach every expert's output rows unchanged, into poisoned
/// caller memory, in the rows a BF16 dispatch of the same routing gives. The oracle is the
/// reference of a BF16 dispatch whose rows are the payload and scale bytes side by side
/// (`(token_bytes + scale_bytes) / 2` channels): each output row's bytes, tokens then scales,
/// must equal that row. Rounds with many tokens (plain messages) and few (tagged), staged and
/// not; then the dispatch's combine (zero expert outputs: exact zeros). A forwarded dispatch into
/// epflow's own buffers is refused. Two ranks (on one GPU with `EPFLOW_TEST_DEVICES=0,0`) or one.
#[test]
fn ll_forwarded_rows_arrive_unchanged() {
    use epflow_core::backend::Backend;
    use epflow_core::{HostData, TensorTag};
    let name = "ll_forwarded_rows";
    let Some(devices) = gpus(2, name).or_else(|| gpus(1, name)) else { return };
    let (hidden, experts, max_tokens, top_k) = (1024, 16, 64, 4);
    let config = GroupConfig::low_latency(experts, max_tokens, hidden);
    let ranks = GpuWorld::create(&devices, config.clone()).expect("create GPU group");
    let n = devices.len();
    let rows = n * max_tokens;
    let base = seed();
    eprintln!("seed {base}");
    // FP8-like payloads with fp32 scales per 128 bytes, packed-FP4-like ones with a byte per 16
    // values, and a payload filling the whole BF16 row.
    for (i, (tb, sb)) in [(1024usize, 32usize), (512, 64), (2032, 16)].into_iter().enumerate() {
        let packed = (tb + sb) / 2;
        let oracle = GroupConfig::low_latency(experts, max_tokens, packed);
        let dtype = DispatchDtype::Forwarded { token_bytes: tb, scale_bytes: sb };
        for (j, (tokens, staged)) in
            [(max_tokens, false), (5, true), (max_tokens, true), (3, false)].into_iter().enumerate()
        {
            let s = base.wrapping_add((i * 8 + j) as u64);
            let per_rank: Vec<usize> = (0..n).map(|r| if r == 0 { tokens } else { tokens.min(7) }).collect();
            let sc = Scenario::generate(oracle.clone(), n, &per_rank, top_k, RoutingKind::Uniform, 0, s);
            let refs = sc.ll_dispatch_reference().unwrap();
            let what = format!("tb={tb} sb={sb} tokens={tokens} staged={staged} seed={s}");
            on_ranks(&ranks, |rank| {
                let r = rank.rank();
                let b = sc.ranks[r].num_tokens;
                // Each packed BF16 row's bytes: its first tb bytes are the payload, the rest the scales.
                let bytes: Vec<u8> = sc.ranks[r].tokens.iter().flat_map(|v| v.to_bits().to_le_bytes()).collect();
                let (mut pay, mut sca) = (Vec::new(), Vec::new());
                for row in bytes.chunks(tb + sb) {
                    pay.extend_from_slice(&row[..tb]);
                    sca.extend_from_slice(&row[tb..]);
                }
                let x = rank.upload(&HostTensor::new(TensorTag::Tokens, &[b, tb], HostData::U8(pay))).unwrap();
                let xs = rank.upload(&HostTensor::new(TensorTag::Scales, &[b, sb], HostData::U8(sca))).unwrap();
                let idx = rank.upload(&sc.topk_idx(r)).unwrap();
                let h = blocking_handle(rank, &idx).unwrap();
                let opts = DispatchOptions { dtype: Some(dtype), ..Default::default() };
                let inputs = DispatchInputs::new(&x).with_scales(&xs);
                let out = dispatch_into_poisoned_inputs(rank, &h, inputs, &opts, staged).expect("forwarded dispatch");
                let counts = out.counts.as_ref().unwrap().as_i32().unwrap().to_vec();
                let (got_t, got_s) = (out.tokens.as_u8().unwrap(), out.scales.as_ref().unwrap().as_u8().unwrap());
                assert_eq!(
                    (got_t.len(), got_s.len()),
                    (config.local_experts(n) * rows * tb, config.local_experts(n) * rows * sb)
                );
                // Rows side by side again, as the oracle's BF16 rows.
                let mut joined = Vec::with_capacity(got_t.len() / tb * packed);
                for (t, sc_row) in got_t.chunks(tb).zip(got_s.chunks(sb)) {
                    for pair in t.chunks(2).chain(sc_row.chunks(2)) {
                        joined.push(bf16::from_bits(u16::from_le_bytes([pair[0], pair[1]])));
                    }
                }
                let d = check_ll_dispatch(&refs[r], packed, rows, &HostData::Bf16(joined), None, &counts);
                assert!(d.ok(), "rank {r} {what}: {d:?}");
                // The dispatch's combine (zero expert outputs, any weights): zeros.
                let l = config.local_experts(n);
                let zeros = HostData::Bf16(vec![bf16::ZERO; l * rows * hidden]);
                let zeros = rank.upload(&HostTensor::new(TensorTag::Tokens, &[l, rows, hidden], zeros)).unwrap();
                let w = rank.upload(&sc.weights(r)).unwrap();
                let y = blocking_combine(
                    rank,
                    &h,
                    CombineInputs::new(&zeros).with_weights(&w),
                    &CombineOptions::default(),
                    staged,
                )
                .unwrap();
                let y = y.to_host().unwrap();
                assert!(
                    y.tokens.as_bf16().unwrap().iter().all(|v| *v == bf16::ZERO),
                    "rank {r} {what}: combine not zero"
                );
            });
            eprintln!("ok: forwarded rows, {what}");
        }
    }
    // Into epflow's own buffers (no scale rows there): refused on every rank.
    on_ranks(&ranks, |rank| {
        let idx = rank.upload(&HostTensor::topk_idx(1, 1, vec![0])).unwrap();
        let h = blocking_handle(rank, &idx).unwrap();
        let x = rank.upload(&HostTensor::new(TensorTag::Tokens, &[1, 1024], HostData::U8(vec![1; 1024]))).unwrap();
        let xs = rank.upload(&HostTensor::new(TensorTag::Scales, &[1, 32], HostData::U8(vec![2; 32]))).unwrap();
        let opts = DispatchOptions {
            dtype: Some(DispatchDtype::Forwarded { token_bytes: 1024, scale_bytes: 32 }),
            ..Default::default()
        };
        let e = rank.start_dispatch(&h, DispatchInputs::new(&x).with_scales(&xs), &opts).map(drop).unwrap_err();
        assert!(e.to_string().contains("caller's tensors with scales"), "{e}");
    });
}

/// NVFP4 combine (`CombineQuant::Nvfp4`): the expert outputs travel as E2M1 codes with E4M3
/// block scales under each row's global scale, and the sums equal the CPU reference of the same
/// quantization bit for bit (`Scenario::ll_combine_reference_of`), in both layouts, one launch
/// and staged; at 1 and 5 tokens the BF16 combine would take tagged rows (the NVFP4 kernels send
/// them plain); hidden 2064 has neither 256-channel pieces nor 64-channel receive pieces.
#[test]
fn ll_nvfp4_combine_matches_the_reference() {
    use epflow_core::backend::Backend;
    use epflow_core::dtype::CombineQuant;
    use epflow_core::ops::{HandleOptions, Layout};
    use epflow_core::scenario::nvfp4_global_scales;
    let name = "ll_nvfp4_combine";
    let Some(devices) = gpus(2, name).or_else(|| gpus(1, name)) else { return };
    let n = devices.len();
    let base = seed();
    eprintln!("seed {base}");
    for (i, (hidden, experts, max_tokens, top_k)) in [(7168, 32, 128, 8), (2064, 16, 32, 4)].into_iter().enumerate() {
        let config = GroupConfig::low_latency(experts, max_tokens, hidden);
        let ranks = GpuWorld::create(&devices, config.clone()).expect("create GPU group");
        for layout in [Layout::ExpertMajor, Layout::RankMajor] {
            for (j, (tokens, staged)) in
                [(max_tokens, false), (1, false), (5, true), (max_tokens, true)].into_iter().enumerate()
            {
                let s = base.wrapping_add((i * 16 + j) as u64);
                let per_rank: Vec<usize> = (0..n).map(|r| if r == 0 { tokens } else { tokens.min(3) }).collect();
                let sc = Scenario::generate(config.clone(), n, &per_rank, top_k, RoutingKind::Uniform, 0, s);
                let inputs: Vec<HostTensor> =
                    (0..n).map(|r| sc.ll_reference_expert_outputs(r, layout).unwrap()).collect();
                let want = sc.ll_combine_reference_of(layout, &inputs, CombineQuant::Nvfp4, false).unwrap();
                let what = format!("H={hidden} {layout:?} tokens={tokens} staged={staged} seed={s}");
                on_ranks(&ranks, |rank| {
                    let r = rank.rank();
                    let idx = rank.upload(&sc.topk_idx(r)).unwrap();
                    let h = epflow_core::backend::blocking_handle_with(rank, &idx, &HandleOptions::with_layout(layout))
                        .unwrap();
                    let (x, w) = (rank.upload(&sc.tokens(r)).unwrap(), rank.upload(&sc.weights(r)).unwrap());
                    let dinputs = DispatchInputs::new(&x);
                    let dinputs = if layout == Layout::RankMajor { dinputs.with_weights(&w) } else { dinputs };
                    drop(blocking_dispatch(rank, &h, dinputs, &DispatchOptions::default(), staged).unwrap());
                    let experts = rank.upload(&inputs[r]).unwrap();
                    let g = rank.upload(&nvfp4_global_scales(&inputs[r])).unwrap();
                    let cin = CombineInputs::new(&experts).with_global_scales(&g);
                    let cin = if layout == Layout::RankMajor { cin } else { cin.with_weights(&w) };
                    let opts = CombineOptions { quant: CombineQuant::Nvfp4, ..Default::default() };
                    let y = blocking_combine(rank, &h, cin, &opts, staged).expect("NVFP4 combine").to_host().unwrap();
                    let c = check_bf16("nvfp4 combine", &want[r], y.tokens.as_bf16().unwrap(), Tolerance::Exact);
                    assert!(c.ok() && (c.checked > 0 || sc.ranks[r].num_tokens == 0), "rank {r} {what}: {c:?}");
                });
                eprintln!("ok: NVFP4 combine, {what}");
            }
        }
    }
}

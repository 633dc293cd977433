//! High-throughput dispatch/combine on GPUs (forward and backward) against the CPU reference,
//! one process driving 1, 2 or 4 GPUs (`EPFLOW_TEST_DEVICES=0,0`: two ranks sharing one GPU).
//! Without enough GPUs every test prints SKIPPED and passes: CI has no GPU; these run on the
//! device machines (`scripts/device-pack.sh`). Handles are built on the device over NVLink
//! (`EPFLOW_HT_HANDLE=host` runs the same tests on host-built ones).
//!
//! Inputs are fresh random data for every round (seed printed; `EPFLOW_TEST_SEED` replays),
//! outputs are poisoned before every operation, and every output must match the reference bit
//! for bit: received rows (and FP8 scales), weights, local indices, counts, the combined tokens
//! and the backward weight gradients.

use epflow_core::handle::RoutingHandle;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::CudaStream;
use epflow_core::backend::{
    Backend, OpOutput, blocking_combine, blocking_combine_on, blocking_dispatch, blocking_dispatch_on, blocking_handle,
    blocking_handle_on, run_blocking,
};
use epflow_core::ops::{
    CombineInputs, CombineOptions, CountsLocation, DispatchInputs, DispatchOptions, DispatchOutputs, HandleOptions,
    Pass, RecvRows,
};
use epflow_core::protocol::Channel;
use epflow_core::reference::{HtDispatchResult, ht_combine, ht_dispatch_backward};
use epflow_core::scenario::{Scenario, ht_identity_rows};
use epflow_core::verify::{Report, Tolerance, check_bf16, check_exact, check_ht_dispatch};
use epflow_core::workload::{RoutingKind, random_weights};
use epflow_core::{DispatchDtype, Error, GroupConfig, HostTensor, MaxTokens, TensorDesc, bf16};
use epflow_kernels::device::DeviceBuffer;
use epflow_kernels::{
    BulkStages, CopyRange, DeviceTensor, GpuHandle, GpuRank, GpuWorld, OutputTargets, Transport, device_count,
};

mod common;
use common::{TimedBarrier, gpus, nccl_gpus, on_ranks, seed, shared_gpu_sms, uneven_tokens};

/// The references of one round: forward dispatch and combine of identity experts, backward
/// dispatch of the tokens as gradients, and backward combine of those rows with random weight
/// gradients; `cached_combine`: a backward combine of the identity experts' rows right after the
/// forward pair (NCCL EP's cached mode).
struct Refs {
    fwd: Vec<HtDispatchResult>,
    fwd_combine: Vec<Vec<bf16>>,
    cached_combine: Vec<(Vec<bf16>, Option<Vec<f32>>)>,
    bwd_dispatch: Vec<Vec<bf16>>,
    weight_grads: Vec<Vec<f32>>,
    bwd_combine: Vec<(Vec<bf16>, Option<Vec<f32>>)>,
}

fn references(sc: &Scenario, seed: u64) -> Refs {
    let fwd = sc.ht_dispatch_reference().unwrap();
    let fwd_combine = sc.ht_combine_identity_reference(&fwd).unwrap();
    let routings = sc.routings().unwrap();
    let grads: Vec<&[bf16]> = sc.ranks.iter().map(|r| r.tokens.as_slice()).collect();
    let bwd_dispatch = ht_dispatch_backward(&sc.config, &routings, &grads);
    let weight_grads: Vec<Vec<f32>> =
        fwd.iter().enumerate().map(|(d, f)| random_weights(f.layout.num_rows(), sc.top_k, seed ^ 0x5eed, d)).collect();
    let outs: Vec<&[bf16]> = bwd_dispatch.iter().map(Vec::as_slice).collect();
    let wg: Vec<&[f32]> = weight_grads.iter().map(Vec::as_slice).collect();
    let bwd_combine = ht_combine(&sc.config, &routings, &outs, Some(&wg));
    let rows = ht_identity_rows(&fwd, sc.config.hidden);
    let rows: Vec<&[bf16]> = rows.iter().map(|r| &r[..]).collect();
    let cached_combine = ht_combine(&sc.config, &routings, &rows, Some(&wg));
    Refs { fwd, fwd_combine, cached_combine, bwd_dispatch, weight_grads, bwd_combine }
}

/// A rank's forward dispatch inputs on its device: tokens (BF16, or FP8 with their scales) and
/// top-k weights.
struct ForwardInputs {
    x: epflow_kernels::DeviceTensor,
    w: epflow_kernels::DeviceTensor,
    scales: Option<epflow_kernels::DeviceTensor>,
}

impl ForwardInputs {
    fn upload(rank: &GpuRank, sc: &Scenario) -> Result<Self, Error> {
        let r = rank.rank();
        let w = rank.upload(&sc.weights(r))?;
        let (x, scales) = match sc.tokens_fp8(r) {
            Some((q, s)) => (rank.upload(&q)?, Some(rank.upload(&s)?)),
            None => (rank.upload(&sc.tokens(r))?, None),
        };
        Ok(ForwardInputs { x, w, scales })
    }

    fn inputs(&self) -> DispatchInputs<'_, epflow_kernels::DeviceTensor> {
        let inputs = DispatchInputs::new(&self.x).with_weights(&self.w);
        match &self.scales {
            Some(s) => inputs.with_scales(s),
            None => inputs,
        }
    }
}

/// One forward and one backward dispatch/combine pair on one handle; returns the reports.
/// `combines`: every rank waits there, once its combine inputs exist, before the first combine
/// (a combine reads its peers' expert outputs in place, and compute-sanitizer flags reads of
/// memory allocated after the reading kernel was launched, though the GPU reaches it), and again
/// before the backward dispatch (see there).
fn round(
    rank: &GpuRank,
    sc: &Scenario,
    refs: &Refs,
    counts_on_host: bool,
    combines: &TimedBarrier,
) -> Result<Vec<Report>, Error> {
    let r = rank.rank();
    rank.fill_output_buffers(0xA5)?;
    let idx = rank.upload(&sc.topk_idx(r))?;
    let h = blocking_handle(rank, &idx)?;
    let want = &refs.fwd[r];
    let n = want.layout.num_rows();
    let mut reports =
        vec![check_exact("num_recv_tokens", &[n], &[h.num_recv_tokens().unwrap_or(usize::MAX)], |a, b| a == b)];
    reports.push(check_exact(
        "recv_expert_counts",
        want.layout.expert_counts(),
        h.recv_expert_counts().unwrap_or_default(),
        |a, b| a == b,
    ));

    // Forward dispatch.
    let fwd = ForwardInputs::upload(rank, sc)?;
    let inputs = fwd.inputs();
    let opts = DispatchOptions {
        counts_location: if counts_on_host { CountsLocation::Host } else { CountsLocation::Device },
        ..DispatchOptions::default()
    };
    let out = blocking_dispatch(rank, &h, inputs, &opts, false)?;
    let host = out.to_host()?;
    let counts = host.counts.as_ref().and_then(HostTensor::as_i32).unwrap_or_default();
    reports.push(check_ht_dispatch(
        want,
        host.tokens.data(),
        host.scales.as_ref().and_then(HostTensor::as_f32),
        host.topk_weights.as_ref().and_then(HostTensor::as_f32).unwrap_or_default(),
        host.topk_idx.as_ref().and_then(HostTensor::as_i64).unwrap_or_default(),
        counts,
    ));
    if counts_on_host {
        reports.push(check_exact(
            "host counts",
            want.layout.expert_counts(),
            out.host_counts().unwrap_or_default(),
            |a, b| a == b,
        ));
    }

    // Forward combine of identity experts.
    let experts = match out.scales() {
        Some(s) => rank.dequantize_fp8(out.tokens(), s)?,
        None => out.tokens().clone(),
    };
    let wg = rank.upload(&HostTensor::topk_weights(n, sc.top_k, refs.weight_grads[r].clone()))?;
    if !combines.wait(Duration::from_secs(60)) {
        return Err(Error::Backend(format!("rank {r}: a peer never reached the combines")));
    }
    let y = blocking_combine(rank, &h, CombineInputs::new(&experts), &CombineOptions::default(), false)?;
    let yh = y.to_host()?;
    reports.push(check_bf16(
        "forward combine",
        &refs.fwd_combine[r],
        yh.tokens.as_bf16().unwrap_or_default(),
        Tolerance::Exact,
    ));

    // NCCL EP's cached mode: a backward combine of the same rows right after the forward pair,
    // with no backward dispatch in between.
    let copts = CombineOptions { pass: Pass::Backward, ..Default::default() };
    let cy = blocking_combine(rank, &h, CombineInputs::new(&experts).with_weights(&wg), &copts, false)?.to_host()?;
    let (want_x, want_w) = &refs.cached_combine[r];
    reports.push(check_bf16(
        "cached backward combine",
        want_x,
        cy.tokens.as_bf16().unwrap_or_default(),
        Tolerance::Exact,
    ));
    reports.push(check_exact(
        "cached backward weight gradients",
        want_w.as_deref().unwrap_or_default(),
        cy.topk_weights.as_ref().and_then(HostTensor::as_f32).unwrap_or_default(),
        |a: f32, b: f32| a.to_bits() == b.to_bits(),
    ));
    drop((y, experts, out));

    // Backward dispatch: the tokens (BF16) as output gradients. Every rank frees and allocates
    // before any rank launches it: ranks that share a GPU share its context, and a free there
    // (`cuMemFree` of a large block) waits for the whole device, so a rank freeing while a peer
    // of its GPU already spins in the dispatch for its rows would wait for that peer's timeout.
    let g = rank.upload(&sc.tokens(r))?;
    if !combines.wait(Duration::from_secs(60)) {
        return Err(Error::Backend(format!("rank {r}: a peer never reached the backward dispatch")));
    }
    let bwd = DispatchOptions { pass: Pass::Backward, ..DispatchOptions::default() };
    let gd = blocking_dispatch(rank, &h, DispatchInputs::new(&g), &bwd, false)?;
    let gdh = gd.to_host()?;
    reports.push(check_bf16(
        "backward dispatch",
        &refs.bwd_dispatch[r],
        gdh.tokens.as_bf16().unwrap_or_default(),
        Tolerance::Exact,
    ));

    // Backward combine of those rows with weight gradients [N x K].
    let gy = blocking_combine(rank, &h, CombineInputs::new(gd.tokens()).with_weights(&wg), &copts, false)?;
    check_backward_combine(&mut reports, &refs.bwd_combine[r], &gy.to_host()?);
    Ok(reports.into_iter().map(|rep| rep.context(&format!("rank {r}"))).collect())
}

/// The backward combine's tokens and weight gradients against `want`, bit for bit.
fn check_backward_combine(
    reports: &mut Vec<Report>,
    want: &(Vec<bf16>, Option<Vec<f32>>),
    got: &epflow_core::ops::CombineOutputs<HostTensor>,
) {
    let (want_x, want_w) = want;
    reports.push(check_bf16("backward combine", want_x, got.tokens.as_bf16().unwrap_or_default(), Tolerance::Exact));
    reports.push(check_exact(
        "backward weight gradients",
        want_w.as_deref().unwrap_or_default(),
        got.topk_weights.as_ref().and_then(HostTensor::as_f32).unwrap_or_default(),
        |a: f32, b: f32| a.to_bits() == b.to_bits(),
    ));
}

fn check_world(
    devices: &[usize],
    hidden: usize,
    experts: usize,
    dtype: DispatchDtype,
    cases: &[(usize, usize, RoutingKind, usize)],
    base: u64,
    transport: &Transport,
) {
    let config =
        GroupConfig::high_throughput(experts, hidden).with_dispatch_dtype(dtype).with_max_sms(shared_gpu_sms(devices));
    // The group's top-k bound, raised to the cases' largest.
    let max_top_k = cases.iter().map(|c| c.1).fold(config.max_top_k, usize::max);
    let config = config.with_max_top_k(max_top_k);
    let ranks = GpuWorld::create_with(devices, config.clone(), transport.clone()).expect("create GPU group");
    for (i, &(tokens, top_k, kind, masked)) in cases.iter().enumerate() {
        let s = base.wrapping_add(i as u64 * 7919);
        let per_rank = uneven_tokens(devices.len(), tokens);
        let sc = Scenario::generate(config.clone(), devices.len(), &per_rank, top_k, kind, masked.min(tokens), s);
        let t = Instant::now();
        let refs = references(&sc, s);
        let reference_s = t.elapsed().as_secs_f64();
        let t = Instant::now();
        let combines = TimedBarrier::new(ranks.len());
        let all = on_ranks(&ranks, |rank| round(rank, &sc, &refs, i % 2 == 1, &combines).expect("round"));
        let what = format!(
            "R={} H={hidden} E={experts} {dtype:?} tokens={tokens} top_k={top_k} {kind:?} masked={masked} {transport:?} \
             seed={s}",
            devices.len()
        );
        for rep in all.into_iter().flatten() {
            assert!(rep.ok(), "{what}: {rep:?}");
        }
        eprintln!("ok: {what} ({:.2} s; CPU reference {reference_s:.2} s)", t.elapsed().as_secs_f64());
    }
}

#[test]
fn ht_matches_reference_on_1_2_and_4_gpus() {
    let base = seed();
    eprintln!("seed {base}");
    let skewed = RoutingKind::Skewed;
    let uniform = RoutingKind::Uniform;
    for n in [1usize, 2, 4] {
        let Some(devices) = gpus(n, &format!("ht_matches_reference ({n} GPUs)")) else { continue };
        let bf16_cases = [
            (1, 8, uniform, 0),
            (100, 8, uniform, 10),
            (100, 8, skewed, 10),
            (4096, 8, uniform, 10),
            (4096, 8, skewed, 10),
            // Every token to the last rank's experts (on one GPU: its own).
            (100, 4, RoutingKind::SingleRank(n - 1), 0),
            (16384, 8, uniform, 10),
        ];
        check_world(&devices, 7168, 256, DispatchDtype::Bf16, &bf16_cases, base, &Transport::Auto);
        let fp8_cases = [(1, 8, uniform, 0), (100, 8, skewed, 10), (4096, 8, uniform, 10), (16384, 8, skewed, 10)];
        check_world(
            &devices,
            7168,
            256,
            DispatchDtype::Fp8 { round_scales: false },
            &fp8_cases,
            base ^ 1,
            &Transport::Auto,
        );
        check_world(
            &devices,
            2048,
            64,
            DispatchDtype::Fp8 { round_scales: true },
            &[(100, 6, uniform, 5)],
            base ^ 2,
            &Transport::Auto,
        );
        check_world(
            &devices,
            1024,
            8,
            DispatchDtype::Bf16,
            &[(37, 2, uniform, 3), (0, 2, uniform, 0)],
            base ^ 3,
            &Transport::Auto,
        );
        // Top-k the mark kernel unrolls exactly (10) and only to its bound (3, 16).
        check_world(
            &devices,
            1024,
            64,
            DispatchDtype::Bf16,
            &[(100, 3, uniform, 5), (200, 10, skewed, 7), (50, 16, uniform, 0)],
            base ^ 5,
            &Transport::Auto,
        );
        // More experts (6000 per rank) than a mark block counts in shared memory
        // (`HT_MARK_HIST` = 4096 in ht_handle.cuh): each counts in its global slot. The last
        // case has so many tokens that `ht::geometry::mark_blocks` caps the mark blocks (their
        // slots, blocks x experts words, would pass 2^18) and each loops over several passes of
        // 256 tokens: every rank, the last one too (`uneven_tokens` gives it half), has more
        // than cap x 256 tokens.
        let cap = (1usize << 18) / (6000 * n);
        check_world(
            &devices,
            1024,
            6000 * n,
            DispatchDtype::Bf16,
            &[(300, 8, uniform, 5), (100, 8, skewed, 0), (2 * cap * 256 + 600, 8, uniform, 5)],
            base ^ 4,
            &Transport::Auto,
        );
    }
}

/// A forward dispatch on `h` into caller memory (each buffer poisoned first), run to its end;
/// the outputs on the host.
fn dispatch_into_caller_memory(
    rank: &GpuRank,
    h: &GpuHandle,
    inputs: DispatchInputs<'_, DeviceTensor>,
) -> Result<DispatchOutputs<HostTensor>, Error> {
    dispatch_into_caller_memory_with(rank, h, inputs, &DispatchOptions::default())
}

/// [`dispatch_into_caller_memory`] with `opts`.
fn dispatch_into_caller_memory_with(
    rank: &GpuRank,
    h: &GpuHandle,
    inputs: DispatchInputs<'_, DeviceTensor>,
    opts: &DispatchOptions,
) -> Result<DispatchOutputs<HostTensor>, Error> {
    let descs = rank.dispatch_output_descs(h, opts);
    let alloc = |d: &TensorDesc| -> Result<DeviceBuffer, Error> {
        let b = DeviceBuffer::zeroed(rank.context(), d.size_bytes().max(1))?;
        b.write(0, &vec![0xA5u8; d.size_bytes()])?;
        Ok(b)
    };
    let tokens = alloc(&descs.tokens)?;
    let scales = descs.scales.as_ref().map(alloc).transpose()?;
    let weights = descs.topk_weights.as_ref().map(alloc).transpose()?;
    let idx = descs.topk_idx.as_ref().map(alloc).transpose()?;
    let into = OutputTargets {
        tokens: tokens.ptr(),
        scales: scales.as_ref().map(DeviceBuffer::ptr),
        topk_weights: weights.as_ref().map(DeviceBuffer::ptr),
        topk_idx: idx.as_ref().map(DeviceBuffer::ptr),
        ..OutputTargets::default()
    };
    // SAFETY: every address is a buffer of this rank's device holding the tensor its descriptor
    // describes; the buffers live until this function returns, after the operation completed.
    let op = unsafe { rank.start_dispatch_into(h, inputs, opts, &into)? };
    match run_blocking(op, rank.slot_pool(Channel::Dispatch), rank.poison(), rank.config().timeout)? {
        OpOutput::Dispatch(d) => d.to_host(),
        _ => Err(Error::Backend("dispatch returned another output".into())),
    }
}

/// Direct dispatch (one process: sources write rows straight into a receiver's own outputs)
/// beside receivers whose outputs are in caller memory (their sources fall back to the rings),
/// in one group and in turn (each rank's outputs in caller memory or not, operation after
/// operation, so ring positions run on across both paths): rows, scales, weights, indices and
/// counts against the reference, bit for bit.
#[test]
fn ht_direct_and_ring_receivers_in_one_group() {
    let Some(devices) = gpus(2, "ht_direct_and_ring_receivers_in_one_group") else { return };
    let base = seed();
    eprintln!("seed {base}");
    for dtype in [DispatchDtype::Bf16, DispatchDtype::Fp8 { round_scales: false }] {
        let config =
            GroupConfig::high_throughput(256, 7168).with_dispatch_dtype(dtype).with_max_sms(shared_gpu_sms(&devices));
        let ranks = GpuWorld::create(&devices, config.clone()).expect("create GPU group");
        let cases = [(4096, RoutingKind::Uniform), (100, RoutingKind::Skewed), (1, RoutingKind::Uniform)];
        for (i, &(tokens, kind)) in cases.iter().enumerate() {
            // Bit r: rank r's outputs are in caller memory.
            for caller in [0b01u32, 0b10, 0b11, 0b00, 0b01] {
                let s = base.wrapping_add((i * 8 + caller as usize) as u64 * 7919);
                let sc = Scenario::generate(config.clone(), 2, &[tokens, tokens / 2 + 1], 8, kind, tokens.min(10), s);
                let want = sc.ht_dispatch_reference().unwrap();
                let reports = on_ranks(&ranks, |rank| {
                    let r = rank.rank();
                    rank.fill_output_buffers(0xA5).expect("poison");
                    let idx = rank.upload(&sc.topk_idx(r)).expect("upload");
                    let h = blocking_handle(rank, &idx).expect("handle");
                    let fwd = ForwardInputs::upload(rank, &sc).expect("inputs");
                    let host = if caller >> r & 1 == 1 {
                        dispatch_into_caller_memory(rank, &h, fwd.inputs())
                    } else {
                        blocking_dispatch(rank, &h, fwd.inputs(), &DispatchOptions::default(), false)
                            .and_then(|o| o.to_host())
                    }
                    .expect("dispatch");
                    check_ht_dispatch(
                        &want[r],
                        host.tokens.data(),
                        host.scales.as_ref().and_then(HostTensor::as_f32),
                        host.topk_weights.as_ref().and_then(HostTensor::as_f32).unwrap_or_default(),
                        host.topk_idx.as_ref().and_then(HostTensor::as_i64).unwrap_or_default(),
                        host.counts.as_ref().and_then(HostTensor::as_i32).unwrap_or_default(),
                    )
                    .context(&format!("rank {r}"))
                });
                for rep in reports {
                    assert!(
                        rep.ok(),
                        "{dtype:?} tokens={tokens} {kind:?} caller memory mask {caller:#b} seed={s}: {rep:?}"
                    );
                }
            }
            eprintln!("ok: {dtype:?} tokens={tokens} {kind:?}");
        }
    }
}

/// Byte `j` of row `t` of rank `src`'s forwarded tokens (`salt` 0) or scales (`salt` 1): a
/// pattern every rank can compute for any source, fresh per `seed`.
fn forwarded_byte(seed: u64, salt: u64, src: usize, t: usize, j: usize) -> u8 {
    let mut x = seed ^ (salt << 60) ^ ((src as u64) << 48) ^ ((t as u64) << 20) ^ j as u64;
    x ^= x >> 33;
    x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
    (x >> 29) as u8
}

/// Forwarded rows (`DispatchDtype::Forwarded`, NCCL EP API v2's FWD recipe) in a
/// high-throughput BF16 group: every received row's `token_bytes` and `scale_bytes` are the
/// source's bytes (opaque: FP8, packed FP4, anything), bit for bit, in the reference's flat
/// order, with the weights, local indices and counts of the reference; outputs in epflow's
/// buffers and in caller memory (poisoned first), several row sizes and routings.
#[test]
fn ht_forwarded_rows_arrive_bit_exact() {
    use epflow_core::{HostData, TensorTag};
    let Some(devices) = gpus(2, "ht_forwarded_rows_arrive_bit_exact") else { return };
    let base = seed();
    eprintln!("seed {base}");
    let hidden = 512;
    let config = GroupConfig::high_throughput(64, hidden).with_max_sms(shared_gpu_sms(&devices));
    let ranks = GpuWorld::create(&devices, config.clone()).expect("create GPU group");
    // (token_bytes, scale_bytes): FP8 rows with fp32 scales per 128, packed FP4 with a byte per
    // 16 values, the whole BF16 row.
    let sizes = [(hidden, 16), (hidden / 2, hidden / 16), (2 * hidden - 16, 16)];
    let cases = [(300usize, RoutingKind::Uniform), (64, RoutingKind::Skewed), (1, RoutingKind::Uniform)];
    for (i, &(tb, sb)) in sizes.iter().enumerate() {
        for (j, &(tokens, kind)) in cases.iter().enumerate() {
            for caller in [false, true] {
                let s = base.wrapping_add((i * 16 + j * 2 + usize::from(caller)) as u64 * 7919);
                let counts = [tokens, tokens / 3 + 1];
                let sc = Scenario::generate(config.clone(), 2, &counts, 4, kind, tokens.min(8), s);
                let want = sc.ht_dispatch_reference().unwrap();
                let dtype = DispatchDtype::Forwarded { token_bytes: tb, scale_bytes: sb };
                let reports = on_ranks(&ranks, |rank| {
                    let r = rank.rank();
                    let b = counts[r];
                    rank.fill_output_buffers(0xA5).expect("poison");
                    let idx = rank.upload(&sc.topk_idx(r)).expect("upload");
                    let h = blocking_handle(rank, &idx).expect("handle");
                    let bytes = |salt, w: usize| (0..b * w).map(|q| forwarded_byte(s, salt, r, q / w, q % w)).collect();
                    let x = rank.upload(&HostTensor::new(TensorTag::Tokens, &[b, tb], HostData::U8(bytes(0, tb))));
                    let xs = rank.upload(&HostTensor::new(TensorTag::Scales, &[b, sb], HostData::U8(bytes(1, sb))));
                    let (x, xs) = (x.expect("upload"), xs.expect("upload"));
                    let w = rank.upload(&sc.weights(r)).expect("upload");
                    let inputs = DispatchInputs::new(&x).with_weights(&w).with_scales(&xs);
                    let opts = DispatchOptions { dtype: Some(dtype), ..DispatchOptions::default() };
                    let host = if caller {
                        dispatch_into_caller_memory_with(rank, &h, inputs, &opts)
                    } else {
                        blocking_dispatch(rank, &h, inputs, &opts, false).and_then(|o| o.to_host())
                    }
                    .expect("dispatch");
                    let rows = want[r].layout.rows();
                    let expect = |salt, w: usize| -> Vec<u8> {
                        rows.iter()
                            .flat_map(|row| {
                                (0..w)
                                    .map(move |q| forwarded_byte(s, salt, row.src_rank as usize, row.token as usize, q))
                            })
                            .collect()
                    };
                    let got_tokens = host.tokens.as_u8().unwrap_or_default().to_vec();
                    let got_scales = host.scales.as_ref().and_then(HostTensor::as_u8).unwrap_or_default().to_vec();
                    let reports = [
                        check_exact("forwarded token rows", &expect(0, tb), &got_tokens, |a, b| a == b),
                        check_exact("forwarded scale rows", &expect(1, sb), &got_scales, |a, b| a == b),
                        check_exact(
                            "topk_weights",
                            &want[r].topk_weights,
                            host.topk_weights.as_ref().and_then(HostTensor::as_f32).unwrap_or_default(),
                            |a, b| a.to_bits() == b.to_bits(),
                        ),
                        check_exact(
                            "topk_idx",
                            &want[r].topk_idx,
                            host.topk_idx.as_ref().and_then(HostTensor::as_i64).unwrap_or_default(),
                            |a, b| a == b,
                        ),
                        check_exact(
                            "counts",
                            want[r].layout.expert_counts(),
                            host.counts.as_ref().and_then(HostTensor::as_i32).unwrap_or_default(),
                            |a, b| a == b,
                        ),
                    ];
                    reports.into_iter().map(|rep| rep.context(&format!("rank {r}"))).collect::<Vec<_>>()
                });
                for rep in reports.into_iter().flatten() {
                    assert!(
                        rep.ok(),
                        "forwarded {tb}+{sb} bytes tokens={tokens} {kind:?} caller memory {caller} seed={s}: {rep:?}"
                    );
                }
            }
            eprintln!("ok: forwarded {tb}+{sb} bytes, tokens={tokens} {kind:?}");
        }
    }
}

/// A view of `t`'s memory that epflow counts as caller memory (`DeviceTensor::from_raw`): a
/// combine reading it sends its rows through the rings instead of letting peers pull them.
fn as_caller_memory(t: &DeviceTensor) -> DeviceTensor {
    // SAFETY: `t`'s memory holds `t.desc()` on `t.device()`; the callers keep `t` alive until
    // every operation reading the view has completed (they block on each).
    unsafe { DeviceTensor::from_raw(t.ptr(), t.device(), t.desc().clone()) }
}

/// Pull combine (one process: a token's rank reads its copies in place from the expert side's
/// output) beside ranks whose expert outputs are caller memory (their rows go through the
/// rings), in one group and in turn: the forward combine and the backward combine with weight
/// gradients against the reference, bit for bit, each rank's inputs in caller memory or not,
/// operation after operation.
#[test]
fn ht_pull_and_ring_combine_in_one_group() {
    let Some(devices) = gpus(2, "ht_pull_and_ring_combine_in_one_group") else { return };
    let base = seed();
    eprintln!("seed {base}");
    let config = GroupConfig::high_throughput(256, 7168).with_max_sms(shared_gpu_sms(&devices));
    let ranks = GpuWorld::create(&devices, config.clone()).expect("create GPU group");
    let cases = [(4096, RoutingKind::Uniform), (100, RoutingKind::Skewed), (1, RoutingKind::Uniform)];
    for (i, &(tokens, kind)) in cases.iter().enumerate() {
        // Bit r: rank r's expert outputs and weight gradients are caller memory.
        for caller in [0b01u32, 0b10, 0b11, 0b00, 0b01] {
            let s = base.wrapping_add((i * 8 + caller as usize) as u64 * 104_729);
            let sc = Scenario::generate(config.clone(), 2, &[tokens, tokens / 2 + 1], 8, kind, tokens.min(10), s);
            let refs = references(&sc, s);
            let reports = on_ranks(&ranks, |rank| -> Result<Vec<Report>, Error> {
                let r = rank.rank();
                rank.fill_output_buffers(0xA5)?;
                let idx = rank.upload(&sc.topk_idx(r))?;
                let h = blocking_handle(rank, &idx)?;
                let fwd = ForwardInputs::upload(rank, &sc)?;
                let out = blocking_dispatch(rank, &h, fwd.inputs(), &DispatchOptions::default(), false)?;
                let caller_mem = caller >> r & 1 == 1;
                let experts = if caller_mem { as_caller_memory(out.tokens()) } else { out.tokens().clone() };
                let y = blocking_combine(rank, &h, CombineInputs::new(&experts), &CombineOptions::default(), false)?;
                let mut reports = vec![check_bf16(
                    "forward combine",
                    &refs.fwd_combine[r],
                    y.to_host()?.tokens.as_bf16().unwrap_or_default(),
                    Tolerance::Exact,
                )];
                let n = refs.fwd[r].layout.num_rows();
                let wg = rank.upload(&HostTensor::topk_weights(n, sc.top_k, refs.weight_grads[r].clone()))?;
                let wg = if caller_mem { as_caller_memory(&wg) } else { wg.clone() };
                let copts = CombineOptions { pass: Pass::Backward, ..Default::default() };
                let cy = blocking_combine(rank, &h, CombineInputs::new(&experts).with_weights(&wg), &copts, false)?;
                check_backward_combine(&mut reports, &refs.cached_combine[r], &cy.to_host()?);
                Ok(reports.into_iter().map(|rep| rep.context(&format!("rank {r}"))).collect())
            });
            for rep in reports.into_iter().flat_map(|r| r.expect("round")) {
                assert!(rep.ok(), "tokens={tokens} {kind:?} caller memory mask {caller:#b} seed={s}: {rep:?}");
            }
        }
        eprintln!("ok: tokens={tokens} {kind:?}");
    }
}

/// The same rounds over NCCL (`Transport::Nccl`: handle exchange, dispatch and combine).
#[test]
fn ht_over_nccl_matches_reference_on_2_and_4_gpus() {
    let base = seed();
    eprintln!("seed {base}");
    let (skewed, uniform) = (RoutingKind::Skewed, RoutingKind::Uniform);
    for n in [2usize, 4] {
        let Some(devices) = nccl_gpus(n, &format!("ht_over_nccl ({n} GPUs)")) else { continue };
        let bf16_cases =
            [(1, 8, uniform, 0), (100, 8, skewed, 10), (4096, 8, uniform, 10), (100, 4, RoutingKind::SingleRank(1), 0)];
        check_world(&devices, 7168, 256, DispatchDtype::Bf16, &bf16_cases, base, &Transport::Nccl);
        let fp8_cases = [(100, 8, skewed, 10), (4096, 8, uniform, 10)];
        check_world(
            &devices,
            7168,
            256,
            DispatchDtype::Fp8 { round_scales: false },
            &fp8_cases,
            base ^ 1,
            &Transport::Nccl,
        );
        check_world(
            &devices,
            1024,
            8,
            DispatchDtype::Bf16,
            &[(37, 2, uniform, 3), (0, 2, uniform, 0)],
            base ^ 3,
            &Transport::Nccl,
        );
    }
}

/// Two declared "hosts" of 2 GPUs (high-throughput runs entirely over NCCL then; run with
/// `NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1` to force NCCL onto its socket transport).
#[test]
fn ht_hierarchical_two_hosts_matches_reference() {
    let Some(devices) = nccl_gpus(4, "ht_hierarchical_two_hosts") else { return };
    let base = seed();
    eprintln!("seed {base}");
    let split = Transport::split_hosts(4, 2).expect("split");
    let cases = [(100, 8, RoutingKind::Skewed, 10), (4096, 8, RoutingKind::Uniform, 10)];
    check_world(&devices, 7168, 256, DispatchDtype::Bf16, &cases, base, &split);
    check_world(&devices, 7168, 256, DispatchDtype::Fp8 { round_scales: true }, &cases, base ^ 1, &split);
}

#[test]
fn ht_many_iterations_with_fresh_routing() {
    let n = device_count().min(4);
    let Some(devices) = gpus(n.max(2), "ht_many_iterations") else { return };
    let iters: u64 = std::env::var("EPFLOW_GPU_ITERS").ok().and_then(|s| s.parse().ok()).unwrap_or(1000);
    let (hidden, experts, top_k) = (2048, 64, 8);
    let config = GroupConfig::high_throughput(experts, hidden).with_max_sms(shared_gpu_sms(&devices));
    let ranks = GpuWorld::create(&devices, config.clone()).expect("create GPU group");
    let base = seed();
    eprintln!("seed {base}, {iters} iterations on {} GPUs", devices.len());
    let start = Instant::now();
    for it in 0..iters {
        let tokens = [300usize, 97, 512, 1][(it % 4) as usize];
        let kind = if it % 3 == 0 { RoutingKind::Skewed } else { RoutingKind::Uniform };
        let s = base ^ (it * 0x9e37_79b9);
        let sc =
            Scenario::generate(config.clone(), devices.len(), &[tokens, 200, 64, 256], top_k, kind, 10.min(tokens), s);
        let refs = references(&sc, s);
        let combines = TimedBarrier::new(ranks.len());
        let all = on_ranks(&ranks, |rank| round(rank, &sc, &refs, it % 2 == 0, &combines).expect("round"));
        for rep in all.into_iter().flatten() {
            assert!(rep.ok(), "iteration {it} seed {s}: {rep:?}");
        }
    }
    eprintln!("{iters} iterations, 0 mismatches ({:.1} s)", start.elapsed().as_secs_f64());
}

/// A small 1- and 2-GPU configuration for compute-sanitizer (memcheck, racecheck): handles
/// built on the device, forward and backward, BF16 and FP8, uneven and empty ranks.
#[test]
fn ht_sanitizer_config() {
    for n in [1usize, 2] {
        let Some(devices) = gpus(n, &format!("ht_sanitizer_config ({n} GPUs)")) else { continue };
        let base = seed();
        let cases = [(37, 4, RoutingKind::Uniform, 3), (5, 2, RoutingKind::Skewed, 1), (0, 2, RoutingKind::Uniform, 0)];
        check_world(&devices, 1024, 8, DispatchDtype::Bf16, &cases, base, &Transport::Auto);
        let fp8 = DispatchDtype::Fp8 { round_scales: false };
        check_world(&devices, 1024, 8, fp8, &cases[..2], base ^ 1, &Transport::Auto);
    }
}

/// An invalid routing on one rank (an expert out of range, then one chosen twice): that rank's
/// handle creation fails with the validation error the host would name, its peers' with
/// `PeerCancelled` at once (the device-built handle validates on the device and cancels the
/// exchange), and the group stays usable: a full round on a valid routing follows.
#[test]
fn ht_invalid_routing_fails_creation_and_spares_the_group() {
    let base = seed();
    for n in [1usize, 2] {
        let Some(devices) = gpus(n, &format!("ht_invalid_routing ({n} GPUs)")) else { continue };
        let (hidden, experts, top_k, tokens) = (1024usize, 16usize, 4usize, 40usize);
        let config = GroupConfig::high_throughput(experts, hidden).with_max_sms(shared_gpu_sms(&devices));
        let ranks = GpuWorld::create(&devices, config.clone()).expect("create GPU group");
        let sc = Scenario::generate(config.clone(), n, &[tokens], top_k, RoutingKind::Uniform, 0, base);
        let bad_rank = n - 1;
        let cases: [(usize, usize, i64, epflow_core::ValidationError); 2] = [
            (
                3,
                1,
                experts as i64 + 5,
                epflow_core::ValidationError::ExpertIndexOutOfRange {
                    token: 3,
                    k: 1,
                    index: experts as i64 + 5,
                    num_experts: experts,
                },
            ),
            (
                7,
                2,
                -2,
                epflow_core::ValidationError::ExpertIndexOutOfRange { token: 7, k: 2, index: -2, num_experts: experts },
            ),
        ];
        for (token, k, value, want) in cases {
            let results = on_ranks(&ranks, |rank| {
                let mut idx = sc.ranks[rank.rank()].topk_idx.clone();
                if rank.rank() == bad_rank {
                    idx[token * top_k + k] = value;
                }
                let t = rank.upload(&HostTensor::topk_idx(tokens, top_k, idx))?;
                blocking_handle(rank, &t).map(|_| ())
            });
            for (r, res) in results.into_iter().enumerate() {
                match res {
                    Err(Error::Validation(e)) if r == bad_rank => assert_eq!(e, want, "rank {r}"),
                    Err(Error::PeerCancelled { peer, .. }) if r != bad_rank => assert_eq!(peer, bad_rank),
                    other => panic!("rank {r}: {other:?} (want {want:?} on rank {bad_rank})"),
                }
            }
        }
        // An expert chosen twice in one row: the earlier slot is named.
        let results = on_ranks(&ranks, |rank| {
            let mut idx = sc.ranks[rank.rank()].topk_idx.clone();
            if rank.rank() == bad_rank {
                let e = idx[5 * top_k];
                idx[5 * top_k + 3] = e;
            }
            let t = rank.upload(&HostTensor::topk_idx(tokens, top_k, idx))?;
            blocking_handle(rank, &t).map(|_| ())
        });
        let first = sc.ranks[bad_rank].topk_idx[5 * top_k];
        match &results[bad_rank] {
            Err(Error::Validation(epflow_core::ValidationError::DuplicateExpert {
                token,
                expert,
                first_k,
                second_k,
            })) => {
                assert_eq!((*token, *expert as i64, *first_k, *second_k), (5, first, 0, 3));
            }
            other => panic!("rank {bad_rank}: {other:?}"),
        }
        // The group is not poisoned: a full round on valid routing.
        let refs = references(&sc, base);
        let combines = TimedBarrier::new(ranks.len());
        let all = on_ranks(&ranks, |rank| round(rank, &sc, &refs, false, &combines).expect("round after refusals"));
        for rep in all.into_iter().flatten() {
            assert!(rep.ok(), "{n} GPUs, after refusals: {rep:?}");
        }
        eprintln!("ok: ht_invalid_routing on {n} GPUs");
    }
}

/// One training step in stream order on a fresh routing (issue 17): a `RecvRows::Bound` handle
/// created in stream order, the forward dispatch, the forward combine of identity experts
/// (BF16: the dispatch output itself), the backward dispatch and the backward combine, all
/// enqueued on `stream` before anything is settled or any `N` is known on the host; then every
/// verdict, and the first `N` rows of each received tensor and the combined outputs against the
/// reference. Outputs are poisoned first.
fn stream_step(rank: &GpuRank, sc: &Scenario, refs: &Refs, stream: &Arc<CudaStream>) -> Result<Vec<Report>, Error> {
    let r = rank.rank();
    rank.fill_output_buffers(0xA5)?;
    let idx = rank.upload(&sc.topk_idx(r))?;
    let opts = HandleOptions::default().with_recv_rows(RecvRows::Bound);
    let (h, created) = blocking_handle_on(rank, &idx, &opts, stream)?;
    let rows = h.recv_rows().unwrap_or(0);
    let bf16_tokens = sc.tokens_fp8(r).is_none();
    let fwd_inputs = ForwardInputs::upload(rank, sc)?;
    let inputs = fwd_inputs.inputs();
    let want = &refs.fwd[r];
    let n = want.layout.num_rows();
    let mut wg = refs.weight_grads[r].clone();
    wg.resize(rows * sc.top_k, 0.0);
    let wg = rank.upload(&HostTensor::topk_weights(rows, sc.top_k, wg))?;
    let g = rank.upload(&sc.tokens(r))?;
    // Everything enqueued, nothing settled.
    let (out, ds) = blocking_dispatch_on(rank, &h, inputs, &DispatchOptions::default(), stream)?;
    let fwd = if bf16_tokens {
        Some(blocking_combine_on(rank, &h, CombineInputs::new(out.tokens()), &CombineOptions::default(), stream)?)
    } else {
        None
    };
    let bwd = DispatchOptions { pass: Pass::Backward, ..DispatchOptions::default() };
    let (gd, gds) = blocking_dispatch_on(rank, &h, DispatchInputs::new(&g), &bwd, stream)?;
    let copts = CombineOptions { pass: Pass::Backward, ..Default::default() };
    let (gy, gys) = blocking_combine_on(rank, &h, CombineInputs::new(gd.tokens()).with_weights(&wg), &copts, stream)?;
    if let Some(c) = created {
        c.settle()?;
    }
    ds.settle()?;
    let mut reports = vec![
        check_exact(
            "received rows (the bound)",
            &[sc.num_ranks * sc.config.fixed_max_tokens().unwrap_or(0)],
            &[rows],
            |a, b| a == b,
        ),
        check_exact("num_recv_tokens", &[n], &[h.num_recv_tokens().unwrap_or(usize::MAX)], |a, b| a == b),
    ];
    let host = out.to_host()?;
    let h_cols = sc.config.hidden;
    let tokens = match host.tokens.data() {
        epflow_core::HostData::Bf16(v) => epflow_core::HostData::Bf16(v[..n * h_cols].to_vec()),
        epflow_core::HostData::Fp8(v) => epflow_core::HostData::Fp8(v[..n * h_cols].to_vec()),
        other => other.clone(),
    };
    let cols = sc.config.scale_cols();
    let scales_h = host.scales.as_ref().and_then(HostTensor::as_f32).map(|s| &s[..n * cols]);
    let k = sc.top_k;
    reports.push(check_ht_dispatch(
        want,
        &tokens,
        scales_h,
        &host.topk_weights.as_ref().and_then(HostTensor::as_f32).unwrap_or_default()[..n * k],
        &host.topk_idx.as_ref().and_then(HostTensor::as_i64).unwrap_or_default()[..n * k],
        host.counts.as_ref().and_then(HostTensor::as_i32).unwrap_or_default(),
    ));
    if let Some((y, ys)) = fwd {
        ys.settle()?;
        let yh = y.to_host()?;
        reports.push(check_bf16(
            "forward combine",
            &refs.fwd_combine[r],
            yh.tokens.as_bf16().unwrap_or_default(),
            Tolerance::Exact,
        ));
    }
    gds.settle()?;
    gys.settle()?;
    let gdh = gd.to_host()?;
    reports.push(check_bf16(
        "backward dispatch",
        &refs.bwd_dispatch[r],
        &gdh.tokens.as_bf16().unwrap_or_default()[..n * h_cols],
        Tolerance::Exact,
    ));
    check_backward_combine(&mut reports, &refs.bwd_combine[r], &gy.to_host()?);
    Ok(reports.into_iter().map(|rep| rep.context(&format!("rank {r}"))).collect())
}

/// Issue 17: training steps in stream order with a fresh routing and a fresh `RecvRows::Bound`
/// handle each, BF16 and FP8, uniform and skewed routing, uneven token counts (a rank with 1),
/// `EPFLOW_GPU_ITERS` steps per dtype (default 200): 0 mismatches.
#[test]
fn ht_stream_ordered_steps_with_fresh_handles() {
    let n = device_count().min(4);
    let Some(devices) = gpus(n.max(2), "ht_stream_ordered_steps") else { return };
    let iters: u64 = std::env::var("EPFLOW_GPU_ITERS").ok().and_then(|s| s.parse().ok()).unwrap_or(200);
    let (hidden, experts, top_k, max_tokens) = (2048, 64, 8, 512);
    let base = seed();
    for dtype in [DispatchDtype::Bf16, DispatchDtype::Fp8 { round_scales: false }] {
        let config = GroupConfig::high_throughput(experts, hidden)
            .with_dispatch_dtype(dtype)
            .with_max_tokens(MaxTokens::Fixed(max_tokens))
            .with_max_sms(shared_gpu_sms(&devices));
        let ranks = GpuWorld::create(&devices, config.clone()).expect("create GPU group");
        let streams: Vec<Arc<CudaStream>> = ranks.iter().map(|r| r.context().new_stream().expect("stream")).collect();
        eprintln!("seed {base}, {iters} stream-ordered steps on {} GPUs, {dtype:?}", devices.len());
        let start = Instant::now();
        for it in 0..iters {
            let tokens = [300usize, 97, 512, 1][(it % 4) as usize];
            let kind = if it % 3 == 0 { RoutingKind::Skewed } else { RoutingKind::Uniform };
            let s = base ^ (it * 0x9e37_79b9) ^ 0x17;
            let sc = Scenario::generate(
                config.clone(),
                devices.len(),
                &[tokens, 200, 1, 256],
                top_k,
                kind,
                10.min(tokens),
                s,
            );
            let refs = references(&sc, s);
            let all = on_ranks(&ranks, |rank| stream_step(rank, &sc, &refs, &streams[rank.rank()]).expect("step"));
            for rep in all.into_iter().flatten() {
                assert!(rep.ok(), "{dtype:?} step {it} seed {s}: {rep:?}");
            }
        }
        eprintln!("ok: {iters} stream-ordered steps, {dtype:?}, 0 mismatches ({:.1} s)", start.elapsed().as_secs_f64());
    }
}

/// A stream-ordered creation that fails on the device (an invalid routing on the last rank):
/// the handles were handed out and a dispatch and combine enqueued on them on every rank; the
/// plan kernels leave an empty plan, so those move nothing and end (no hang); the creation's
/// verdict names the error (the invalid entry on that rank, `PeerCancelled` elsewhere), the
/// operations on the handle fail, and the group is poisoned (outputs had been handed out).
#[test]
fn ht_stream_ordered_failed_creation_moves_nothing() {
    let Some(devices) = gpus(2, "ht_stream_ordered_failed_creation") else { return };
    let (hidden, experts, top_k, tokens) = (1024usize, 16usize, 4usize, 40usize);
    let config = GroupConfig::high_throughput(experts, hidden)
        .with_max_tokens(MaxTokens::Fixed(64))
        .with_max_sms(shared_gpu_sms(&devices));
    let ranks = GpuWorld::create(&devices, config.clone()).expect("create GPU group");
    let n = devices.len();
    let sc = Scenario::generate(config.clone(), n, &[tokens], top_k, RoutingKind::Uniform, 0, seed());
    let bad_rank = n - 1;
    let start = Instant::now();
    let results = on_ranks(&ranks, |rank| {
        let stream = rank.context().new_stream().expect("stream");
        let mut idx = sc.ranks[rank.rank()].topk_idx.clone();
        if rank.rank() == bad_rank {
            idx[3 * top_k + 1] = experts as i64 + 5;
        }
        let t = rank.upload(&HostTensor::topk_idx(tokens, top_k, idx)).expect("upload");
        let opts = HandleOptions::default().with_recv_rows(RecvRows::Bound);
        let (h, created) = blocking_handle_on(rank, &t, &opts, &stream).expect("handed out");
        let (x, w) = (rank.upload(&sc.tokens(0)).expect("x"), rank.upload(&sc.weights(0)).expect("w"));
        let inputs = DispatchInputs::new(&x).with_weights(&w);
        let (d, ds) = blocking_dispatch_on(rank, &h, inputs, &DispatchOptions::default(), &stream).expect("enqueued");
        let (_c, cs) =
            blocking_combine_on(rank, &h, CombineInputs::new(d.tokens()), &CombineOptions::default(), &stream)
                .expect("enqueued");
        let created = created.expect("a collective").settle();
        (created, ds.settle(), cs.settle(), rank.poison().is_poisoned())
    });
    for (r, (created, d, c, poisoned)) in results.into_iter().enumerate() {
        match &created {
            Err(Error::Validation(epflow_core::ValidationError::ExpertIndexOutOfRange { token: 3, k: 1, .. }))
                if r == bad_rank => {}
            Err(Error::PeerCancelled { peer, .. }) if r != bad_rank && *peer == bad_rank => {}
            other => panic!("rank {r}: creation {other:?}"),
        }
        assert!(d.is_err() && c.is_err(), "rank {r}: dispatch {d:?}, combine {c:?}");
        assert!(poisoned, "rank {r}: not poisoned");
    }
    eprintln!("ok: failed stream-ordered creation, every rank done in {:.2} s", start.elapsed().as_secs_f64());
}

/// A peer that never creates its handle while this rank creates one in stream order and
/// enqueues a dispatch on it (timeout 2 s): the creation times out on the device and leaves an
/// empty plan, the dispatch on it times out waiting for the absent peer, both verdicts are
/// errors within the bound (two timeouts, one after the other), the group is poisoned, and
/// nothing hangs.
#[test]
fn ht_stream_ordered_creation_with_an_absent_peer_times_out() {
    let Some(devices) = gpus(2, "ht_stream_ordered_absent_peer") else { return };
    let timeout = std::time::Duration::from_secs(2);
    let config = GroupConfig::high_throughput(16, 1024)
        .with_max_tokens(MaxTokens::Fixed(64))
        .with_max_sms(shared_gpu_sms(&devices))
        .with_timeout(timeout);
    let ranks = GpuWorld::create(&devices[..2], config.clone()).expect("create GPU group");
    let sc = Scenario::generate(config, 2, &[40], 4, RoutingKind::Uniform, 0, seed());
    let rank = &ranks[0];
    let stream = rank.context().new_stream().expect("stream");
    let start = Instant::now();
    let t = rank.upload(&sc.topk_idx(0)).expect("upload");
    let opts = HandleOptions::default().with_recv_rows(RecvRows::Bound);
    let (h, created) = blocking_handle_on(rank, &t, &opts, &stream).expect("handed out");
    let (x, w) = (rank.upload(&sc.tokens(0)).expect("x"), rank.upload(&sc.weights(0)).expect("w"));
    let inputs = DispatchInputs::new(&x).with_weights(&w);
    let dispatched = blocking_dispatch_on(rank, &h, inputs, &DispatchOptions::default(), &stream);
    let created = created.expect("a collective").settle();
    let d = dispatched.and_then(|(_, ds)| ds.settle());
    let took = start.elapsed();
    eprintln!("absent peer: creation {created:?}, dispatch {d:?}, after {took:?}");
    assert!(matches!(created, Err(Error::Timeout { .. })), "creation: {created:?}");
    assert!(d.is_err(), "dispatch: {d:?}");
    assert!(took < 3 * timeout, "took {took:?} with a {timeout:?} timeout");
    assert!(rank.poison().is_poisoned(), "not poisoned");
}

/// What the copy-probe tests share: a group of 2 GPUs, `BYTES` of patterned data on GPU 0, a
/// destination on GPU 0 and one on GPU 1 (4 KB longer: the copies go to offset 4096), a stream.
struct CopyProbe {
    ranks: Vec<GpuRank>,
    data: Vec<u8>,
    src: DeviceBuffer,
    local: DeviceBuffer,
    peer: DeviceBuffer,
    stream: Arc<CudaStream>,
}

impl CopyProbe {
    /// Not a multiple of a warp's 4 KB nor of a bulk copy's chunk.
    const BYTES: usize = (3 << 20) + 16 * 37;

    fn new(test: &str) -> Option<Self> {
        let devices = gpus(2, test)?;
        let ranks = GpuWorld::create(&devices, GroupConfig::high_throughput(16, 1024)).expect("group");
        let data: Vec<u8> = (0..Self::BYTES).map(|i| (i * 131 + (i >> 9)) as u8).collect();
        let src = DeviceBuffer::zeroed(ranks[0].context(), Self::BYTES).expect("src");
        src.write(0, &data).expect("upload");
        let local = DeviceBuffer::zeroed(ranks[0].context(), Self::BYTES + 4096).expect("local");
        let peer = DeviceBuffer::zeroed(ranks[1].context(), Self::BYTES + 4096).expect("peer");
        let stream = ranks[0].context().new_stream().expect("stream");
        Some(CopyProbe { ranks, data, src, local, peer, stream })
    }

    /// `bytes` of the source into `dst` at `dst_offset`.
    fn range<'a>(&'a self, dst: &'a DeviceBuffer, dst_offset: usize, bytes: usize) -> CopyRange<'a> {
        CopyRange { dst, dst_offset, src: &self.src, bytes }
    }

    /// Poisons `dst`, runs `copy` (which enqueues a copy of `src` to `dst` at 4096 on the stream),
    /// then checks that exactly the copied range holds the data.
    fn check(&self, dst: &DeviceBuffer, what: &str, copy: impl FnOnce()) {
        dst.write(0, &vec![0xa5u8; Self::BYTES + 4096]).expect("poison");
        copy();
        self.stream.synchronize().expect("sync");
        let mut back = vec![0u8; Self::BYTES + 4096];
        dst.read(0, &mut back).expect("read back");
        assert!(back[..4096].iter().all(|&b| b == 0xa5), "{what}: bytes before the range written");
        assert!(back[4096..] == self.data[..], "{what}: the copied bytes differ");
    }
}

/// `GpuRank::sm_copy` (the SM-store probe of `examples/nvlink_ceiling --sms`) moves exactly its
/// bytes, into this GPU's buffer and into a peer's, at an offset, with any block count; a range
/// outside a buffer is refused.
#[test]
fn sm_copy_moves_the_bytes() {
    let Some(t) = CopyProbe::new("sm_copy_moves_the_bytes") else { return };
    let bytes = CopyProbe::BYTES;
    for (dst, blocks) in [(&t.local, 1u32), (&t.peer, 7), (&t.peer, 132)] {
        t.check(dst, &format!("{blocks} blocks"), || {
            // SAFETY: both buffers live past `check`'s synchronize; nothing else writes `dst`.
            unsafe { t.ranks[0].sm_copy(&t.stream, t.range(dst, 4096, bytes), blocks) }.expect("sm_copy");
        });
    }
    // SAFETY: refused before any launch (the range does not fit).
    let err = unsafe { t.ranks[0].sm_copy(&t.stream, t.range(&t.local, 8192, bytes), 4) };
    assert!(matches!(err, Err(Error::Unsupported(m)) if m.contains("does not fit")));
}

/// `GpuRank::sm_copy_balanced` (the probe of `examples/nvlink_ceiling --balanced`) moves exactly
/// its bytes, into this GPU's buffer and into a peer's, at an offset, with a partial last piece,
/// for any block count, and again with the same counter (cleared at each launch); a counter of
/// the peer's is refused.
#[test]
fn sm_copy_balanced_moves_the_bytes() {
    let Some(t) = CopyProbe::new("sm_copy_balanced_moves_the_bytes") else { return };
    let bytes = CopyProbe::BYTES;
    let counter = DeviceBuffer::zeroed(t.ranks[0].context(), 8).expect("counter");
    for (dst, blocks) in [(&t.local, 1u32), (&t.peer, 7), (&t.peer, 132), (&t.local, 64)] {
        t.check(dst, &format!("{blocks} blocks, balanced"), || {
            // SAFETY: the buffers and the counter live past `check`'s synchronize; nothing else
            // writes `dst` or uses the counter.
            unsafe { t.ranks[0].sm_copy_balanced(&t.stream, t.range(dst, 4096, bytes), blocks, &counter) }
                .expect("sm_copy_balanced");
        });
    }
    let theirs = DeviceBuffer::zeroed(t.ranks[1].context(), 8).expect("peer counter");
    // SAFETY: refused before any launch (the counter is not this rank's).
    let err = unsafe { t.ranks[0].sm_copy_balanced(&t.stream, t.range(&t.local, 4096, bytes), 4, &theirs) };
    assert!(matches!(err, Err(Error::Unsupported(m)) if m.contains("counter")));
}

/// `GpuRank::tma_copy` (the bulk-copy probe of `examples/nvlink_ceiling --tma`) moves exactly its
/// bytes, into this GPU's buffer and into a peer's, at an offset, with a partial last chunk, any
/// block count and any stage count; chunks and stages out of range are refused.
#[test]
fn tma_copy_moves_the_bytes() {
    let Some(t) = CopyProbe::new("tma_copy_moves_the_bytes") else { return };
    let bytes = CopyProbe::BYTES;
    for (dst, blocks, chunk, stages) in
        [(&t.local, 1u32, 14336u32, 14u32), (&t.peer, 7, 4096, 2), (&t.peer, 132, 28672, 7)]
    {
        t.check(dst, &format!("{blocks} blocks, {stages} x {chunk} B"), || {
            // SAFETY: both buffers live past `check`'s synchronize; nothing else writes `dst`.
            unsafe { t.ranks[0].tma_copy(&t.stream, t.range(dst, 4096, bytes), blocks, BulkStages { chunk, stages }) }
                .expect("tma_copy");
        });
    }
    for (chunk, stages) in [(4100u32, 4u32), (4096, 1), (4096, 33)] {
        // SAFETY: refused before any launch (chunk or stages out of range).
        let err =
            unsafe { t.ranks[0].tma_copy(&t.stream, t.range(&t.local, 0, 4096), 2, BulkStages { chunk, stages }) };
        assert!(matches!(err, Err(Error::Unsupported(m)) if m.contains("stages")), "{chunk} B x {stages}");
    }
}

/// NCCL EP's high-throughput expert-major layout over flat outputs (`ExpertMajorPlan`, the
/// `ep_em_*` kernels) against a CPU reference, on one GPU: random flat rows, weights and local
/// expert ids (some `-1`, experts distinct per row), zones aligned to 1 and to 4 slots. Every
/// zone holds its expert's rows in flat order with their weights, its padding is zero (the
/// outputs are poisoned first), and the reduce back gives each row the BF16 of the fp32 sum of
/// its slots (here copies of the row). The backward pass's pieces: the scatter without weights
/// moves the same rows, and the slots' weights gathered back give every entry its weight (0
/// where no local expert).
#[test]
fn expert_major_layout_matches_the_reference() {
    use epflow_core::{DType, HostData, TensorDesc, TensorTag};
    let Some(device) = common::one_gpu("expert_major_layout_matches_the_reference") else { return };
    let base = seed();
    eprintln!("seed {base}");
    let config = GroupConfig::high_throughput(32, 256);
    let ranks = GpuWorld::create(&[device], config).expect("create GPU group");
    let rank = &ranks[0];
    let stream = rank.context().new_stream().expect("stream");
    let mut rng = base | 1;
    let mut next = move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    for (n, k, l, h, alignment) in [(300usize, 4usize, 8usize, 256usize, 1usize), (77, 8, 16, 200, 4), (0, 2, 4, 64, 4)]
    {
        let tokens: Vec<bf16> = (0..n * h).map(|_| bf16::from_f32((next() % 2001) as f32 / 1000.0 - 1.0)).collect();
        let weights: Vec<f32> = (0..n * k).map(|_| (next() % 1000) as f32 / 1000.0).collect();
        let mut idx = vec![-1i64; n * k];
        for row in idx.chunks_mut(k) {
            let mut experts: Vec<i64> = (0..l as i64).collect();
            for slot in row.iter_mut() {
                if next() % 3 == 0 {
                    continue;
                }
                let e = experts.swap_remove((next() % experts.len() as u64) as usize);
                *slot = e;
            }
        }
        let mut counts = vec![0i32; l];
        for &e in idx.iter().filter(|&&e| e >= 0) {
            counts[e as usize] += 1;
        }
        let plan = rank.expert_major_plan(&counts, n, k, alignment).expect("plan");
        let t = rank.upload(&HostTensor::new(TensorTag::Tokens, &[n, h], HostData::Bf16(tokens.clone()))).unwrap();
        let w = rank.upload(&HostTensor::new(TensorTag::TopkWeights, &[n, k], HostData::F32(weights.clone()))).unwrap();
        let i = rank.upload(&HostTensor::topk_idx(n, k, idx.clone())).unwrap();
        let slots = plan.total + 3;
        let poison = |dtype, shape: &[usize]| {
            let d =
                DeviceTensor::zeros(rank.context(), device, TensorDesc::contiguous(TensorTag::Tokens, dtype, shape))
                    .expect("alloc");
            let bytes = d.desc().size_bytes();
            // SAFETY: `d` holds `bytes` bytes of this device; synchronous memset.
            unsafe { cudarc::driver::sys::cuMemsetD8_v2(d.ptr(), 0xA5, bytes) }.result().expect("poison");
            d
        };
        let out = poison(DType::Bf16, &[slots, h]);
        let out_w = poison(DType::F32, &[slots]);
        rank.expert_major_slots_on(&stream, &plan, &i).expect("slots");
        rank.expert_major_scatter_on(&stream, &plan, &t, &out, Some((&w, &out_w))).expect("scatter");
        // The backward pass: gradients scattered without weights (the poison stays), and the
        // weight gradients of the slots gathered back per entry.
        let out2 = poison(DType::Bf16, &[slots, h]);
        rank.expert_major_scatter_on(&stream, &plan, &t, &out2, None).expect("scatter without weights");
        let w_back = poison(DType::F32, &[n.max(1), k]);
        let w_back = if n == 0 {
            w_back
        } else {
            let d = TensorDesc::contiguous(TensorTag::TopkWeights, DType::F32, &[n, k]);
            // SAFETY: a view of `w_back`'s first n x k floats, which it holds; `w_back` lives
            // until the end of the loop body, after the stream synchronized.
            let v = unsafe { DeviceTensor::from_raw(w_back.ptr(), device, d) };
            rank.expert_major_weights_on(&stream, &plan, &out_w, &v).expect("gather weights");
            w_back
        };
        let back = DeviceTensor::zeros(
            rank.context(),
            device,
            TensorDesc::contiguous(TensorTag::Tokens, DType::Bf16, &[n, h]),
        )
        .expect("alloc");
        rank.expert_major_reduce_on(&stream, &plan, &out, &back).expect("reduce");
        stream.synchronize().expect("sync");
        let got = out.download(rank.context()).unwrap();
        let got = got.as_bf16().unwrap();
        let got_w = out_w.download(rank.context()).unwrap();
        let got_w = got_w.as_f32().unwrap();
        let got2 = out2.download(rank.context()).unwrap();
        assert_eq!(got2.as_bf16().unwrap(), got, "the scatter without weights moves the same rows");
        let back_w = w_back.download(rank.context()).unwrap();
        let back_w = back_w.as_f32().unwrap();
        for (j, &e) in idx.iter().enumerate() {
            let want = if e >= 0 { weights[j] } else { 0.0 };
            assert_eq!(back_w[j].to_bits(), want.to_bits(), "entry {j}: the gathered weight gradient");
        }
        let what = format!("N={n} K={k} L={l} H={h} alignment={alignment} seed={base}");
        let mut off = 0usize;
        for e in 0..l {
            let rows: Vec<(usize, usize)> = (0..n * k).filter(|&j| idx[j] == e as i64).map(|j| (j / k, j)).collect();
            assert_eq!(plan.counts[e], rows.len() as i64, "{what}: expert {e} count");
            assert_eq!(plan.offsets[e], off as i64, "{what}: expert {e} offset");
            for (s, &(row, j)) in rows.iter().enumerate() {
                let slot = off + s;
                assert_eq!(
                    &got[slot * h..(slot + 1) * h],
                    &tokens[row * h..(row + 1) * h],
                    "{what}: expert {e} slot {s}"
                );
                assert_eq!(got_w[slot].to_bits(), weights[j].to_bits(), "{what}: expert {e} slot {s} weight");
            }
            let padded = plan.padded[e] as usize;
            assert_eq!(padded, rows.len().div_ceil(alignment.max(1)) * alignment.max(1), "{what}: expert {e} zone");
            for slot in off + rows.len()..off + padded {
                assert!(got[slot * h..(slot + 1) * h].iter().all(|v| v.to_bits() == 0), "{what}: pad slot {slot}");
                assert_eq!(got_w[slot], 0.0, "{what}: pad slot {slot} weight");
            }
            off += padded;
        }
        assert_eq!(plan.total, off, "{what}: total");
        let back = back.download(rank.context()).unwrap();
        let back = back.as_bf16().unwrap();
        for row in 0..n {
            let m = idx[row * k..(row + 1) * k].iter().filter(|&&e| e >= 0).count();
            for c in 0..h {
                let x = tokens[row * h + c].to_f32();
                let want = bf16::from_f32((0..m).fold(0f32, |acc, _| acc + x));
                assert_eq!(back[row * h + c].to_bits(), want.to_bits(), "{what}: reduced row {row} col {c}");
            }
        }
        eprintln!("ok: expert-major layout, {what}");
    }
}

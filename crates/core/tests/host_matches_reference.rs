//! The host backend against the CPU reference: R in {1, 2, 4, 8}, low-latency and
//! high-throughput, BF16 and FP8, synchronous and staged. Dispatch must match bit for bit,
//! combine within one BF16 ulp.

use epflow_core::handle::RoutingHandle;
use epflow_core::host::{HostRank, HostWorld};
use epflow_core::ops::{CombineInputs, CombineOptions, DispatchInputs, DispatchOptions, HandleOptions, Pass, RecvRows};
use epflow_core::reference;
use epflow_core::scenario::{Scenario, identity_rows, ll_identity_expert_outputs};
use epflow_core::verify::{Report, Tolerance, check_bf16, check_ht_dispatch, check_ll_dispatch};
use epflow_core::workload::{RoutingKind, random_tokens};
use epflow_core::{DispatchDtype, GroupConfig, HostData, HostTensor, MaxTokens, bf16};

const HIDDEN: usize = 256;
const EXPERTS: usize = 32;
const TOP_K: usize = 4;
const MAX_TOKENS: usize = 24;

fn dtypes() -> [DispatchDtype; 3] {
    [DispatchDtype::Bf16, DispatchDtype::Fp8 { round_scales: false }, DispatchDtype::Fp8 { round_scales: true }]
}

/// Uneven token counts, including a rank with none.
fn tokens_per_rank(r: usize) -> Vec<usize> {
    [MAX_TOKENS, 17, 0, 5, 24, 1, 9, 13].into_iter().take(r).collect()
}

fn assert_ok(report: Report, what: &str) {
    assert!(report.ok(), "{what}: {} of {} mismatched; first: {:?}", report.mismatched, report.checked, report.first);
    assert!(report.checked > 0 || what.contains("empty"), "{what}: nothing was compared");
}

fn ll_round(rank: &HostRank, sc: &Scenario, staged: bool) -> (Report, Report) {
    ll_round_with(rank, sc, staged, DispatchOptions::default())
}

/// [`ll_round`] with dispatch options `opts`; the scenario's config is the reference's.
fn ll_round_with(rank: &HostRank, sc: &Scenario, staged: bool, opts: DispatchOptions) -> (Report, Report) {
    let r = rank.rank();
    let refs = sc.ll_dispatch_reference().unwrap();
    let combine_ref = sc.ll_combine_identity_reference(&refs).unwrap();
    let handle = rank.create_handle(&sc.topk_idx(r)).unwrap();
    let x = sc.tokens(r);
    let inputs = DispatchInputs::new(&x);
    let out = if staged {
        rank.dispatch_send(&handle, inputs, &opts).unwrap().complete().unwrap()
    } else {
        rank.dispatch(&handle, inputs, &opts).unwrap()
    };
    let rows = sc.num_ranks * MAX_TOKENS;
    let scales = out.scales().and_then(HostTensor::as_f32);
    let counts = out.counts().unwrap().to_vec();
    let d =
        check_ll_dispatch(&refs[r], HIDDEN, rows, out.tokens().data(), scales, &counts).context(&format!("rank {r}"));
    let experts = ll_identity_expert_outputs(out.tokens().data(), scales, &counts, rows, HIDDEN);
    drop(out);
    let w = sc.weights(r);
    let cin = CombineInputs::new(&experts).with_weights(&w);
    let copts = CombineOptions::default();
    let y = if staged {
        rank.combine_send(&handle, cin, &copts).unwrap().complete().unwrap()
    } else {
        rank.combine(&handle, cin, &copts).unwrap()
    };
    let c = check_bf16("combine", &combine_ref[r], y.tokens().as_bf16().unwrap(), Tolerance::OneUlp);
    (d, c.context(&format!("rank {r}")))
}

#[test]
fn low_latency_matches_reference() {
    for num_ranks in [1, 2, 4, 8] {
        for dtype in dtypes() {
            for staged in [false, true] {
                let config = GroupConfig::low_latency(EXPERTS, MAX_TOKENS, HIDDEN).with_dispatch_dtype(dtype);
                let sc = Scenario::generate(
                    config.clone(),
                    num_ranks,
                    &tokens_per_rank(num_ranks),
                    TOP_K,
                    RoutingKind::Uniform,
                    6,
                    42 + num_ranks as u64,
                );
                let reports = HostWorld::run(num_ranks, config, |rank| ll_round(rank, &sc, staged)).unwrap();
                for (d, c) in reports {
                    let what = format!("LL R={num_ranks} {dtype:?} staged={staged}");
                    assert_ok(d, &format!("{what} dispatch"));
                    if sc.ranks.iter().any(|r| r.num_tokens > 0) {
                        assert!(c.ok(), "{what} combine: {c:?}");
                    }
                }
            }
        }
    }
}

/// A BF16 group's dispatch asking for FP8 per call (`DispatchOptions::dtype`) matches the
/// reference of an FP8 group bit for bit (tokens and scales), with and without power-of-two
/// scales, staged and not; an FP8 group cannot dispatch BF16 per call, nor a high-throughput
/// group FP8, nor a hidden size off the 128-channel scale blocks.
#[test]
fn low_latency_fp8_per_call_matches_an_fp8_group() {
    for num_ranks in [1, 2, 4] {
        for dtype in [DispatchDtype::Fp8 { round_scales: false }, DispatchDtype::Fp8 { round_scales: true }] {
            for staged in [false, true] {
                let bf16_group = GroupConfig::low_latency(EXPERTS, MAX_TOKENS, HIDDEN);
                let fp8_group = bf16_group.clone().with_dispatch_dtype(dtype);
                let sc = Scenario::generate(
                    fp8_group,
                    num_ranks,
                    &tokens_per_rank(num_ranks),
                    TOP_K,
                    RoutingKind::Uniform,
                    6,
                    77 + num_ranks as u64,
                );
                let opts = DispatchOptions { dtype: Some(dtype), ..Default::default() };
                let reports =
                    HostWorld::run(num_ranks, bf16_group, |rank| ll_round_with(rank, &sc, staged, opts)).unwrap();
                for (d, c) in reports {
                    let what = format!("LL R={num_ranks} per-call {dtype:?} staged={staged}");
                    assert_ok(d, &format!("{what} dispatch"));
                    if sc.ranks.iter().any(|r| r.num_tokens > 0) {
                        assert!(c.ok(), "{what} combine: {c:?}");
                    }
                }
            }
        }
    }
    let refused = |config: GroupConfig, dtype: DispatchDtype, pass: Pass| {
        let x = HostTensor::tokens(2, config.hidden, vec![bf16::ZERO; 2 * config.hidden]);
        let idx = HostTensor::topk_idx(2, 1, vec![0, 1]);
        let w = HostTensor::topk_weights(2, 1, vec![1.0; 2]);
        HostWorld::run(1, config, move |rank| {
            let handle = rank.create_handle(&idx).unwrap();
            let mut inputs = DispatchInputs::new(&x);
            if rank.config().algorithm == epflow_core::Algorithm::HighThroughput && pass == Pass::Forward {
                inputs = inputs.with_weights(&w);
            }
            let opts = DispatchOptions { dtype: Some(dtype), pass, ..Default::default() };
            rank.dispatch(&handle, inputs, &opts).map(drop).unwrap_err().to_string()
        })
        .unwrap()
        .remove(0)
    };
    let fp8 = DispatchDtype::Fp8 { round_scales: false };
    let e = refused(
        GroupConfig::low_latency(EXPERTS, MAX_TOKENS, HIDDEN).with_dispatch_dtype(fp8),
        DispatchDtype::Bf16,
        Pass::Forward,
    );
    assert!(e.contains("dispatch dtype bf16") && e.contains("FP8 group"), "{e}");
    let e = refused(GroupConfig::high_throughput(EXPERTS, HIDDEN), fp8, Pass::Forward);
    assert!(e.contains("dispatch dtype fp8") && e.contains("high-throughput"), "{e}");
    let e = refused(GroupConfig::low_latency(EXPERTS, MAX_TOKENS, 200), fp8, Pass::Forward);
    assert!(e.contains("multiple of 128"), "{e}");
    // Asking for the type the pass has anyway is accepted: BF16 for a backward dispatch of an FP8
    // high-throughput group.
    let ht_fp8 = GroupConfig::high_throughput(EXPERTS, HIDDEN).with_dispatch_dtype(fp8);
    let ok = HostWorld::run(1, ht_fp8, |rank| {
        let handle = rank.create_handle(&HostTensor::topk_idx(2, 1, vec![0, 1])).unwrap();
        let g = HostTensor::tokens(2, HIDDEN, vec![bf16::ZERO; 2 * HIDDEN]);
        let opts = DispatchOptions { dtype: Some(DispatchDtype::Bf16), pass: Pass::Backward, ..Default::default() };
        rank.dispatch(&handle, DispatchInputs::new(&g), &opts).map(drop).map_err(|e| e.to_string())
    })
    .unwrap();
    assert_eq!(ok, vec![Ok(())]);
}

#[test]
fn low_latency_routing_to_one_rank_and_skew() {
    for kind in [RoutingKind::SingleRank(1), RoutingKind::Skewed] {
        let config = GroupConfig::low_latency(EXPERTS, MAX_TOKENS, HIDDEN);
        let sc = Scenario::generate(config.clone(), 4, &[MAX_TOKENS], TOP_K, kind, 3, 9);
        for (d, c) in HostWorld::run(4, config, |rank| ll_round(rank, &sc, true)).unwrap() {
            assert_ok(d, &format!("{kind:?} dispatch"));
            assert_ok(c, &format!("{kind:?} combine"));
        }
    }
}

/// The first `n` rows (of `cols` elements) of `d`: what a [`RecvRows::Bound`] output holds
/// beyond its bound rows is not compared.
fn head(d: &HostData, n: usize, cols: usize) -> HostData {
    let e = n * cols;
    match d {
        HostData::Bf16(v) => HostData::Bf16(v[..e].to_vec()),
        HostData::F32(v) => HostData::F32(v[..e].to_vec()),
        HostData::I32(v) => HostData::I32(v[..e].to_vec()),
        HostData::I64(v) => HostData::I64(v[..e].to_vec()),
        HostData::Fp8(v) => HostData::Fp8(v[..e].to_vec()),
        HostData::U8(v) => HostData::U8(v[..e].to_vec()),
    }
}

/// `rows` rows of `cols` values: `v` (whole rows), then zeros.
fn padded<T: Copy + Default>(mut v: Vec<T>, rows: usize, cols: usize) -> Vec<T> {
    v.resize(rows * cols, T::default());
    v
}

fn ht_round(rank: &HostRank, sc: &Scenario, recv_rows: RecvRows) -> Vec<(String, Report)> {
    let r = rank.rank();
    let h = HIDDEN;
    let refs = sc.ht_dispatch_reference().unwrap();
    let routings = sc.routings().unwrap();
    let opts = HandleOptions::default().with_recv_rows(recv_rows);
    let handle = rank.create_handle_with(&sc.topk_idx(r), &opts).unwrap();
    let n = handle.num_recv_tokens().unwrap();
    assert_eq!(n, refs[r].layout.num_rows(), "rank {r}: receive count from the handle");
    assert_eq!(handle.recv_expert_counts().unwrap(), refs[r].layout.expert_counts());
    // The rows of received tensors: N, or the group's bound R x M.
    let rows = handle.recv_rows().unwrap();
    let bound = sc.num_ranks * MAX_TOKENS;
    assert_eq!(rows, if recv_rows == RecvRows::Bound { bound } else { n }, "rank {r}: received rows");
    let mut reports = Vec::new();

    // Forward dispatch.
    let w = sc.weights(r);
    let bf = sc.tokens(r);
    let fp8 = sc.tokens_fp8(r);
    let inputs = match &fp8 {
        Some((q, s)) => DispatchInputs::new(q).with_weights(&w).with_scales(s),
        None => DispatchInputs::new(&bf).with_weights(&w),
    };
    let out = rank.dispatch(&handle, inputs, &DispatchOptions::default()).unwrap();
    assert_eq!(out.tokens().desc().shape[0], rows, "rank {r}: dispatch output rows");
    let cols = sc.config.scale_cols();
    let scales = out.scales().map(|s| head(s.data(), n, cols));
    reports.push((
        "forward dispatch".into(),
        check_ht_dispatch(
            &refs[r],
            &head(out.tokens().data(), n, h),
            scales.as_ref().and_then(|s| if let HostData::F32(v) = s { Some(v.as_slice()) } else { None }),
            &out.topk_weights().unwrap().as_f32().unwrap()[..n * TOP_K],
            &out.topk_idx().unwrap().as_i64().unwrap()[..n * TOP_K],
            out.counts().unwrap(),
        ),
    ));

    // Forward combine of identity experts.
    let experts = HostTensor::tokens(rows, h, padded(identity_rows(&refs[r].tokens, h), rows, h));
    let y = rank.combine(&handle, CombineInputs::new(&experts), &CombineOptions::default()).unwrap();
    let want = sc.ht_combine_identity_reference(&refs).unwrap();
    reports.push((
        "forward combine".into(),
        check_bf16("combine", &want[r], y.tokens().as_bf16().unwrap(), Tolerance::OneUlp),
    ));

    // Weight gradients: twice the received weights (any values work; these are deterministic).
    let wg: Vec<Vec<f32>> = refs.iter().map(|d| d.topk_weights.iter().map(|v| v * 2.0 + 0.25).collect()).collect();
    let wg_t = HostTensor::topk_weights(rows, TOP_K, padded(wg[r].clone(), rows, TOP_K));
    let wrefs: Vec<&[f32]> = wg.iter().map(Vec::as_slice).collect();
    let copts = CombineOptions { pass: Pass::Backward, ..Default::default() };

    // NCCL EP's cached mode: a backward combine right after the forward pair, with no backward
    // dispatch (a high-throughput combine pairs with the handle's rows, of either pass).
    let cached = rank.combine(&handle, CombineInputs::new(&experts).with_weights(&wg_t), &copts).unwrap();
    let rows: Vec<Vec<bf16>> = refs.iter().map(|d| identity_rows(&d.tokens, h)).collect();
    let want_cached = reference::ht_combine(&sc.config, &routings, &grefs_rows(&rows), Some(&wrefs));
    reports.push((
        "backward combine after a forward dispatch".into(),
        check_bf16("grads", &want_cached[r].0, cached.tokens().as_bf16().unwrap(), Tolerance::OneUlp),
    ));
    let mut cw = Report::default();
    let got_w = cached.topk_weights().unwrap().as_f32().unwrap();
    cw.merge(epflow_core::verify::check_exact("weight grads", want_cached[r].1.as_ref().unwrap(), got_w, |a, b| {
        a.to_bits() == b.to_bits()
    }));
    reports.push(("backward combine after a forward dispatch, weights".into(), cw));
    // Results hold their buffer set (two per channel): give these back.
    drop((y, cached));

    // Backward: output gradients go out, input and weight gradients come back.
    let grads: Vec<Vec<bf16>> =
        sc.ranks.iter().enumerate().map(|(i, ri)| random_tokens(ri.num_tokens, h, 777, i)).collect();
    let g = HostTensor::tokens(sc.ranks[r].num_tokens, h, grads[r].clone());
    let bopts = DispatchOptions { pass: Pass::Backward, ..Default::default() };
    let gout = rank.dispatch(&handle, DispatchInputs::new(&g), &bopts).unwrap();
    let grefs: Vec<&[bf16]> = grads.iter().map(Vec::as_slice).collect();
    let want_bwd = reference::ht_dispatch_backward(&sc.config, &routings, &grefs);
    reports.push((
        "backward dispatch".into(),
        check_bf16("grads", &want_bwd[r], &gout.tokens().as_bf16().unwrap()[..n * h], Tolerance::Exact),
    ));

    let gy = rank.combine(&handle, CombineInputs::new(gout.tokens()).with_weights(&wg_t), &copts).unwrap();
    let want_c = reference::ht_combine(&sc.config, &routings, &grefs_rows(&want_bwd), Some(&wrefs));
    reports.push((
        "backward combine".into(),
        check_bf16("grads", &want_c[r].0, gy.tokens().as_bf16().unwrap(), Tolerance::OneUlp),
    ));
    let got_w = gy.topk_weights().unwrap().as_f32().unwrap();
    let want_w = want_c[r].1.as_ref().unwrap();
    let mut wr = Report::default();
    wr.merge(epflow_core::verify::check_exact("weight grads", want_w, got_w, |a, b| a.to_bits() == b.to_bits()));
    reports.push(("backward combine weights".into(), wr));
    reports.into_iter().map(|(w, rep)| (w, rep.context(&format!("rank {r}")))).collect()
}

fn grefs_rows(v: &[Vec<bf16>]) -> Vec<&[bf16]> {
    v.iter().map(Vec::as_slice).collect()
}

#[test]
fn high_throughput_matches_reference() {
    for num_ranks in [1, 2, 4, 8] {
        for dtype in dtypes() {
            for max_tokens in [MaxTokens::Auto, MaxTokens::Fixed(MAX_TOKENS)] {
                let config = GroupConfig::high_throughput(EXPERTS, HIDDEN)
                    .with_dispatch_dtype(dtype)
                    .with_max_tokens(max_tokens);
                let kind = if num_ranks == 4 { RoutingKind::Skewed } else { RoutingKind::Uniform };
                let sc = Scenario::generate(
                    config.clone(),
                    num_ranks,
                    &tokens_per_rank(num_ranks),
                    TOP_K,
                    kind,
                    6,
                    7 * num_ranks as u64,
                );
                // A bound needs a fixed max_tokens_per_rank (`RecvRows::Bound` is refused otherwise).
                let recv_rows: &[RecvRows] = match max_tokens {
                    MaxTokens::Auto => &[RecvRows::Exact],
                    MaxTokens::Fixed(_) => &[RecvRows::Exact, RecvRows::Bound],
                };
                for &rows in recv_rows {
                    for reports in HostWorld::run(num_ranks, config.clone(), |rank| ht_round(rank, &sc, rows)).unwrap()
                    {
                        for (what, rep) in reports {
                            assert!(rep.ok(), "HT R={num_ranks} {dtype:?} {max_tokens:?} {rows:?} {what}: {rep:?}");
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn many_staged_rounds_with_fresh_routing_stay_correct() {
    let config = GroupConfig::low_latency(EXPERTS, MAX_TOKENS, HIDDEN);
    let scenarios: Vec<Scenario> = (0..40)
        .map(|i| {
            Scenario::generate(config.clone(), 4, &[MAX_TOKENS, 3, 11, 24], TOP_K, RoutingKind::Uniform, 4, 1000 + i)
        })
        .collect();
    HostWorld::run(4, config, |rank| {
        for sc in &scenarios {
            let (d, c) = ll_round(rank, sc, true);
            assert_ok(d, "dispatch");
            assert_ok(c, "combine");
        }
    })
    .unwrap();
}

/// A training step in stream order (`blocking_handle_on` and friends, what
/// `HandleFuture::complete_on` / `OpFuture::complete_on` do in async): a `RecvRows::Bound`
/// handle on a fresh routing each step, the forward pair and the backward pair enqueued before
/// anything is settled, then every verdict; the first N rows of each received tensor and the
/// combined tokens against the reference.
#[test]
fn stream_ordered_training_steps_with_fresh_routing() {
    use epflow_core::backend::{blocking_combine_on, blocking_dispatch_on, blocking_handle_on};
    use epflow_core::host::HostStream;
    for num_ranks in [1, 2, 4] {
        let config = GroupConfig::high_throughput(EXPERTS, HIDDEN).with_max_tokens(MaxTokens::Fixed(MAX_TOKENS));
        for step in 0..4u64 {
            let sc = Scenario::generate(
                config.clone(),
                num_ranks,
                &tokens_per_rank(num_ranks),
                TOP_K,
                RoutingKind::Uniform,
                3,
                1000 + 31 * step + num_ranks as u64,
            );
            let refs = sc.ht_dispatch_reference().unwrap();
            let want = sc.ht_combine_identity_reference(&refs).unwrap();
            let routings = sc.routings().unwrap();
            let grads: Vec<&[bf16]> = sc.ranks.iter().map(|r| r.tokens.as_slice()).collect();
            let want_bwd = reference::ht_dispatch_backward(&sc.config, &routings, &grads);
            let wg: Vec<Vec<f32>> = refs.iter().map(|d| vec![0.5; d.layout.num_rows() * TOP_K]).collect();
            let wrefs: Vec<&[f32]> = wg.iter().map(Vec::as_slice).collect();
            let want_c = reference::ht_combine(&sc.config, &routings, &grefs_rows(&want_bwd), Some(&wrefs));
            let reports = HostWorld::run(num_ranks, config.clone(), |rank| {
                let r = rank.rank();
                let (h, s) = (HIDDEN, HostStream);
                let opts = HandleOptions::default().with_recv_rows(RecvRows::Bound);
                let (handle, created) = blocking_handle_on(rank, &sc.topk_idx(r), &opts, &s).unwrap();
                let rows = handle.recv_rows().unwrap();
                let (x, w) = (sc.tokens(r), sc.weights(r));
                let (d, ds) = blocking_dispatch_on(
                    rank,
                    &handle,
                    DispatchInputs::new(&x).with_weights(&w),
                    &Default::default(),
                    &s,
                )
                .unwrap();
                let (y, ys) =
                    blocking_combine_on(rank, &handle, CombineInputs::new(d.tokens()), &Default::default(), &s)
                        .unwrap();
                let bopts = DispatchOptions { pass: Pass::Backward, ..Default::default() };
                let (gd, gds) = blocking_dispatch_on(rank, &handle, DispatchInputs::new(&x), &bopts, &s).unwrap();
                let wg_t = HostTensor::topk_weights(rows, TOP_K, padded(wg[r].clone(), rows, TOP_K));
                let copts = CombineOptions { pass: Pass::Backward, ..Default::default() };
                let (gy, gys) =
                    blocking_combine_on(rank, &handle, CombineInputs::new(gd.tokens()).with_weights(&wg_t), &copts, &s)
                        .unwrap();
                for settle in [ds, ys, gds, gys] {
                    settle.settle().unwrap();
                }
                if let Some(c) = created {
                    c.settle().unwrap();
                }
                let n = handle.num_recv_tokens().unwrap();
                assert_eq!((n, rows), (refs[r].layout.num_rows(), num_ranks * MAX_TOKENS));
                let mut rep = check_bf16("combine", &want[r], y.tokens().as_bf16().unwrap(), Tolerance::OneUlp);
                rep.merge(check_bf16(
                    "backward dispatch",
                    &want_bwd[r],
                    &gd.tokens().as_bf16().unwrap()[..n * h],
                    Tolerance::Exact,
                ));
                rep.merge(check_bf16(
                    "backward combine",
                    &want_c[r].0,
                    gy.tokens().as_bf16().unwrap(),
                    Tolerance::OneUlp,
                ));
                rep
            })
            .unwrap();
            for rep in reports {
                assert!(rep.ok() && rep.checked > 0, "R={num_ranks} step {step}: {rep:?}");
            }
        }
    }
}

/// Forwarded rows (`DispatchDtype::Forwarded`, NCCL EP API v2's FWD recipe) are validated
/// alike on every backend: forward dispatch of a BF16 group only, both row sizes
/// positive multiples of 16 fitting the group's BF16 row, opaque bytes with their scale rows.
/// The host backend then refuses them by name (they are a GPU backend's: `gpu_ll`).
#[test]
fn forwarded_rows_are_validated_and_the_host_backend_refuses_them() {
    let fwd = |token_bytes, scale_bytes| DispatchDtype::Forwarded { token_bytes, scale_bytes };
    let attempt = |config: GroupConfig, dtype: DispatchDtype, tb: usize, sb: usize, with_scales: bool| {
        let x = HostTensor::new(epflow_core::TensorTag::Tokens, &[2, tb], epflow_core::HostData::U8(vec![7; 2 * tb]));
        let s = HostTensor::new(epflow_core::TensorTag::Scales, &[2, sb], epflow_core::HostData::U8(vec![9; 2 * sb]));
        let w = HostTensor::topk_weights(2, 1, vec![1.0; 2]);
        HostWorld::run(1, config, move |rank| {
            let handle = rank.create_handle(&HostTensor::topk_idx(2, 1, vec![0, 1])).unwrap();
            let mut inputs = DispatchInputs::new(&x);
            if with_scales {
                inputs = inputs.with_scales(&s);
            }
            if rank.config().algorithm == epflow_core::Algorithm::HighThroughput {
                inputs = inputs.with_weights(&w);
            }
            let opts = DispatchOptions { dtype: Some(dtype), ..Default::default() };
            rank.dispatch(&handle, inputs, &opts).map(drop).unwrap_err().to_string()
        })
        .unwrap()
        .remove(0)
    };
    let ll = GroupConfig::low_latency(EXPERTS, MAX_TOKENS, HIDDEN);
    let (tb, sb) = (HIDDEN, 32);
    let e = attempt(ll.clone(), fwd(tb, sb), tb, sb, true);
    assert!(e.contains("GPU backend"), "valid forwarded rows reach the host backend's refusal: {e}");
    let e = attempt(ll.clone(), fwd(tb, sb), tb, sb, false);
    assert!(e.contains("scale row"), "{e}");
    let e = attempt(ll.clone(), fwd(tb, 24), tb, 24, true);
    assert!(e.contains("multiples of 16"), "{e}");
    let e = attempt(ll.clone(), fwd(2 * HIDDEN, 16), 2 * HIDDEN, 16, true);
    assert!(e.contains("2 x hidden"), "{e}");
    let e = attempt(ll.clone(), fwd(tb, sb), tb + 16, sb, true);
    assert!(e.contains("token_bytes"), "a token row of another size: {e}");
    let fp8 = ll.with_dispatch_dtype(DispatchDtype::Fp8 { round_scales: false });
    let e = attempt(fp8, fwd(tb, sb), tb, sb, true);
    assert!(e.contains("FP8 group"), "{e}");
    // High-throughput forward dispatch forwards rows too (`[N x token_bytes]` received).
    let ht = GroupConfig::high_throughput(EXPERTS, HIDDEN);
    let e = attempt(ht.clone(), fwd(tb, sb), tb, sb, true);
    assert!(e.contains("GPU backend"), "valid high-throughput forwarded rows reach the host backend's refusal: {e}");
    let e = attempt(ht.clone(), fwd(tb, sb), tb, sb, false);
    assert!(e.contains("scale row"), "{e}");
    let e = attempt(ht.clone(), fwd(tb, sb), tb, sb + 16, true);
    assert!(e.contains("scale_bytes"), "a scale row of another size: {e}");
    let e = attempt(ht, fwd(2 * HIDDEN, 16), 2 * HIDDEN, 16, true);
    assert!(e.contains("2 x hidden"), "{e}");
}

//! Low-latency rank-major layout on the host backend against its CPU reference: R in
//! {1, 2, 4, 8}, BF16 and FP8, synchronous and staged, top-k 1 to 16, masked entries, routing
//! to one rank, skew, uneven token counts (a rank with none). Dispatch (tokens, scales, weights,
//! local expert indices, per-source counts) and combine must match bit for bit.

use epflow_core::host::{HostRank, HostWorld};
use epflow_core::ops::{CombineInputs, CombineOptions, DispatchInputs, DispatchOptions, HandleOptions, Layout};
use epflow_core::scenario::{Scenario, rank_major_identity_expert_outputs};
use epflow_core::verify::{Report, Tolerance, check_bf16, check_rank_major_dispatch};
use epflow_core::workload::RoutingKind;
use epflow_core::{DispatchDtype, Error, GroupConfig, HostTensor, ValidationError, bf16};

const HIDDEN: usize = 256;
const EXPERTS: usize = 32;
const MAX_TOKENS: usize = 24;

fn rank_major() -> HandleOptions {
    HandleOptions::with_layout(Layout::RankMajor)
}

fn assert_ok(report: Report, what: &str) {
    assert!(report.ok(), "{what}: {} of {} mismatched; first: {:?}", report.mismatched, report.checked, report.first);
}

fn round(rank: &HostRank, sc: &Scenario, staged: bool) -> (Report, Report) {
    let r = rank.rank();
    let refs = sc.ll_rank_major_reference().unwrap();
    let want = sc.ll_rank_major_combine_identity_reference(&refs).unwrap();
    let handle = rank.create_handle_with(&sc.topk_idx(r), &rank_major()).unwrap();
    let (x, w) = (sc.tokens(r), sc.weights(r));
    let inputs = DispatchInputs::new(&x).with_weights(&w);
    let opts = DispatchOptions::default();
    let out = if staged {
        rank.dispatch_send(&handle, inputs, &opts).unwrap().complete().unwrap()
    } else {
        rank.dispatch(&handle, inputs, &opts).unwrap()
    };
    let k = sc.top_k;
    let scales = out.scales().and_then(HostTensor::as_f32);
    let weights = out.topk_weights().and_then(HostTensor::as_f32).unwrap();
    let idx = out.topk_idx().and_then(HostTensor::as_i32).unwrap();
    let counts = out.counts().unwrap().to_vec();
    assert_eq!(out.tokens().desc().shape, vec![sc.num_ranks * MAX_TOKENS, HIDDEN]);
    assert_eq!(counts.len(), sc.num_ranks);
    let d =
        check_rank_major_dispatch(&refs[r], HIDDEN, MAX_TOKENS, k, out.tokens().data(), scales, weights, idx, &counts)
            .context(&format!("rank {r}"));
    let sums =
        rank_major_identity_expert_outputs(out.tokens().data(), scales, weights, idx, &counts, MAX_TOKENS, HIDDEN, k);
    drop(out);
    let cin = CombineInputs::new(&sums);
    let copts = CombineOptions::default();
    let y = if staged {
        rank.combine_send(&handle, cin, &copts).unwrap().complete().unwrap()
    } else {
        rank.combine(&handle, cin, &copts).unwrap()
    };
    let c = check_bf16("combine", &want[r], y.tokens().as_bf16().unwrap(), Tolerance::Exact);
    (d, c.context(&format!("rank {r}")))
}

#[test]
fn rank_major_matches_reference() {
    let dtypes =
        [DispatchDtype::Bf16, DispatchDtype::Fp8 { round_scales: false }, DispatchDtype::Fp8 { round_scales: true }];
    for num_ranks in [1usize, 2, 4, 8] {
        for (i, dtype) in dtypes.into_iter().enumerate() {
            for top_k in [1usize, 4, 10, 16] {
                let staged = (i + top_k) % 2 == 0;
                let config =
                    GroupConfig::low_latency(EXPERTS, MAX_TOKENS, HIDDEN).with_dispatch_dtype(dtype).with_max_top_k(16);
                let tokens: Vec<usize> = [MAX_TOKENS, 17, 0, 5, 24, 1, 9, 13].into_iter().take(num_ranks).collect();
                let seed = 7 * num_ranks as u64 + top_k as u64;
                let sc = Scenario::generate(config.clone(), num_ranks, &tokens, top_k, RoutingKind::Uniform, 5, seed);
                let mut checked = (0, 0);
                for (d, c) in HostWorld::run(num_ranks, config, |rank| round(rank, &sc, staged)).unwrap() {
                    let what = format!("R={num_ranks} {dtype:?} K={top_k} staged={staged}");
                    checked = (checked.0 + d.checked, checked.1 + c.checked);
                    assert_ok(d, &format!("{what} dispatch"));
                    assert_ok(c, &format!("{what} combine"));
                }
                assert!(checked.0 > 0 && checked.1 > 0, "nothing compared: {checked:?}");
            }
        }
    }
}

#[test]
fn rank_major_routing_to_one_rank_and_skew() {
    for kind in [RoutingKind::SingleRank(1), RoutingKind::Skewed] {
        let config = GroupConfig::low_latency(EXPERTS, MAX_TOKENS, HIDDEN);
        let sc = Scenario::generate(config.clone(), 4, &[MAX_TOKENS, 7], 8, kind, 3, 11);
        for (d, c) in HostWorld::run(4, config, |rank| round(rank, &sc, true)).unwrap() {
            assert_ok(d, &format!("{kind:?} dispatch"));
            assert_ok(c, &format!("{kind:?} combine"));
        }
    }
}

/// How far rank-major results are from expert-major ones on the same inputs (identity experts,
/// positive weights): the extra BF16 rounding of each rank's partial sum. The bound documented
/// in `epflow_core::reference::rank_major` (one ulp per rank reached, plus the final rounding).
#[test]
fn rank_major_differs_from_expert_major_by_the_documented_rounding() {
    let (num_ranks, top_k) = (8, 8);
    let config = GroupConfig::low_latency(EXPERTS, MAX_TOKENS, HIDDEN);
    let sc = Scenario::generate(config, num_ranks, &[MAX_TOKENS], top_k, RoutingKind::Uniform, 0, 5);
    let em = sc.ll_combine_identity_reference(&sc.ll_dispatch_reference().unwrap()).unwrap();
    let rm = sc.ll_rank_major_combine_identity_reference(&sc.ll_rank_major_reference().unwrap()).unwrap();
    let (mut worst, mut differing, mut total) = (0u16, 0usize, 0usize);
    for (a, b) in em.iter().flatten().zip(rm.iter().flatten()) {
        total += 1;
        let ulps = if a.is_sign_negative() == b.is_sign_negative() {
            a.to_bits().abs_diff(b.to_bits())
        } else {
            a.to_bits().wrapping_add(b.to_bits()) & 0x7fff
        };
        if ulps > 0 {
            differing += 1;
        }
        worst = worst.max(ulps);
    }
    eprintln!("rank-major vs expert-major: {differing} of {total} values differ, at most {worst} BF16 ulps");
    assert!(total > 0);
    assert!(worst <= 1 + top_k as u16, "{worst} ulps");
}

#[test]
fn rank_major_arguments_are_checked() {
    let config = GroupConfig::low_latency(EXPERTS, MAX_TOKENS, HIDDEN);
    let sc = Scenario::generate(config.clone(), 2, &[4], 2, RoutingKind::Uniform, 0, 3);
    let errs = HostWorld::run(2, config, |rank| {
        let r = rank.rank();
        let (x, w) = (sc.tokens(r), sc.weights(r));
        let h = rank.create_handle_with(&sc.topk_idx(r), &rank_major()).unwrap();
        // Rank-major dispatch needs the weights (the expert side applies them).
        let missing = rank.dispatch(&h, DispatchInputs::new(&x), &DispatchOptions::default()).unwrap_err();
        let out = rank.dispatch(&h, DispatchInputs::new(&x).with_weights(&w), &DispatchOptions::default()).unwrap();
        let rows = HostTensor::tokens(2 * MAX_TOKENS, HIDDEN, vec![bf16::ZERO; 2 * MAX_TOKENS * HIDDEN]);
        drop(out);
        // Rank-major combine refuses weights: they were applied already.
        let extra =
            rank.combine(&h, CombineInputs::new(&rows).with_weights(&w), &CombineOptions::default()).unwrap_err();
        (missing, extra)
    })
    .unwrap();
    for (missing, extra) in errs {
        assert!(
            matches!(
                missing,
                Error::Validation(ValidationError::MissingTensor { tensor: "dispatch input topk_weights", .. })
            ),
            "{missing}"
        );
        assert!(
            matches!(
                extra,
                Error::Validation(ValidationError::UnexpectedTensor { tensor: "combine input topk_weights", .. })
            ),
            "{extra}"
        );
    }
    // High-throughput handles are flat.
    let ht = GroupConfig::high_throughput(EXPERTS, HIDDEN);
    let sc = Scenario::generate(ht.clone(), 1, &[4], 2, RoutingKind::Uniform, 0, 3);
    let e = HostWorld::run(1, ht, |rank| rank.create_handle_with(&sc.topk_idx(0), &rank_major()).unwrap_err()).unwrap();
    assert!(matches!(e[0], Error::Validation(ValidationError::UnsupportedForAlgorithm { .. })), "{}", e[0]);
}

/// Ranks whose handles have different layouts get a mismatch naming the layout, never rows laid
/// out for the other.
#[test]
fn peers_on_different_layouts_disagree() {
    let config = GroupConfig::low_latency(EXPERTS, MAX_TOKENS, HIDDEN);
    let sc = Scenario::generate(config.clone(), 2, &[6], 4, RoutingKind::Uniform, 0, 13);
    let results = HostWorld::run(2, config, |rank| {
        let r = rank.rank();
        let (x, w) = (sc.tokens(r), sc.weights(r));
        let opts = if r == 0 { rank_major() } else { HandleOptions::default() };
        let h = rank.create_handle_with(&sc.topk_idx(r), &opts).unwrap();
        let inputs = if r == 0 { DispatchInputs::new(&x).with_weights(&w) } else { DispatchInputs::new(&x) };
        rank.dispatch(&h, inputs, &DispatchOptions::default()).map(|_| ())
    })
    .unwrap();
    for r in results {
        match r {
            Err(Error::PeerMismatch { ours, theirs, .. }) => assert_ne!(ours.layout, theirs.layout),
            other => panic!("expected a layout mismatch, got {other:?}"),
        }
    }
}

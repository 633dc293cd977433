//! What the masking and rejoin tests share: the group, each iteration's inputs, and one
//! checked round of dispatch and combine against the reference of the group without the masked
//! ranks.

#![allow(dead_code)]

use std::time::{Duration, Instant};

use epflow_core::host::HostRank;
use epflow_core::mask::RankSet;
use epflow_core::ops::{CombineInputs, CombineOptions, DispatchInputs, DispatchOptions, HandleOptions, Layout};
use epflow_core::scenario::Scenario;
use epflow_core::verify::{Report, Tolerance, check_bf16, check_exact, check_ll_dispatch, check_rank_major_dispatch};
use epflow_core::workload::RoutingKind;
use epflow_core::{GroupConfig, HostTensor};

pub(crate) const RANKS: usize = 4;
pub(crate) const EXPERTS: usize = 16;
pub(crate) const MAX_TOKENS: usize = 8;
pub(crate) const HIDDEN: usize = 128;
pub(crate) const TOP_K: usize = 4;
/// Long enough that a live rank on a loaded 2-core CI machine is never taken for a dead one.
pub(crate) const TIMEOUT: Duration = Duration::from_secs(1);

pub(crate) fn config() -> GroupConfig {
    GroupConfig::low_latency(EXPERTS, MAX_TOKENS, HIDDEN).with_rank_masking(true).with_timeout(TIMEOUT)
}

/// Iteration `i`'s inputs: a fresh seed, uneven token counts, both layouts in turn.
pub(crate) fn scenario(i: u64) -> (Scenario, Layout) {
    let tokens = [MAX_TOKENS, 5, 1, 7];
    let sc = Scenario::generate(config(), RANKS, &tokens, TOP_K, RoutingKind::Uniform, 1, 1000 + i);
    (sc, if i % 2 == 0 { Layout::ExpertMajor } else { Layout::RankMajor })
}

pub(crate) fn assert_ok(report: Report, what: &str) {
    assert!(report.ok(), "{what}: {} of {} mismatched; first: {:?}", report.mismatched, report.checked, report.first);
}

/// One dispatch and combine of rank `rank` on iteration `i`'s inputs, checked against the
/// reference of the group without `masked` (identity experts; the combine input comes from the
/// reference, so a wrong dispatch cannot hide a wrong combine). Returns how long it took.
pub(crate) fn round(rank: &HostRank, i: u64, masked: &RankSet) -> Duration {
    let start = Instant::now();
    let r = rank.rank();
    let (full, layout) = scenario(i);
    let sc = full.without_ranks(masked);
    let what = format!("iteration {i} ({layout:?}) rank {r} masked {masked:?}");
    let handle = rank.create_handle_with(&full.topk_idx(r), &HandleOptions::with_layout(layout)).unwrap();
    let (x, w) = (full.tokens(r), full.weights(r));
    // Rank-major dispatch carries the weights (the expert side applies them); expert-major
    // combine takes them.
    let rank_major = layout == Layout::RankMajor;
    let inputs = if rank_major { DispatchInputs::new(&x).with_weights(&w) } else { DispatchInputs::new(&x) };
    let out = rank.dispatch(&handle, inputs, &DispatchOptions::default()).unwrap();
    let counts = out.counts().unwrap().to_vec();
    let report = match layout {
        Layout::ExpertMajor => {
            let refs = sc.ll_dispatch_reference().unwrap();
            check_ll_dispatch(&refs[r], HIDDEN, RANKS * MAX_TOKENS, out.tokens().data(), None, &counts)
        }
        Layout::RankMajor => {
            let refs = sc.ll_rank_major_reference().unwrap();
            let weights = out.topk_weights().and_then(HostTensor::as_f32).unwrap();
            let idx = out.topk_idx().and_then(HostTensor::as_i32).unwrap();
            check_rank_major_dispatch(
                &refs[r],
                HIDDEN,
                MAX_TOKENS,
                TOP_K,
                out.tokens().data(),
                None,
                weights,
                idx,
                &counts,
            )
        }
    };
    assert_ok(report, &format!("{what}: dispatch"));
    drop(out);
    let expert_out = sc.ll_reference_expert_outputs(r, layout).unwrap();
    let want = match layout {
        Layout::ExpertMajor => sc.ll_combine_identity_reference(&sc.ll_dispatch_reference().unwrap()).unwrap(),
        Layout::RankMajor => {
            sc.ll_rank_major_combine_identity_reference(&sc.ll_rank_major_reference().unwrap()).unwrap()
        }
    };
    let cin =
        if rank_major { CombineInputs::new(&expert_out) } else { CombineInputs::new(&expert_out).with_weights(&w) };
    let y = rank.combine(&handle, cin, &CombineOptions::default()).unwrap();
    assert_ok(check_bf16("combine", &want[r], y.tokens().as_bf16().unwrap(), Tolerance::Exact), &what);
    let lost = full.masked_entries(r, masked);
    assert_ok(check_exact("masked entries", &lost, y.masked().unwrap(), |a, b| a == b), &what);
    start.elapsed()
}

//! Ranks that disagree about a collective (another top-k, another handle, combines in another
//! order, a rank whose arguments fail validation) get typed errors at once, never a panic, a
//! hang, wrong rows or a poisoned group; a handle reused while peers route anew pairs each
//! combine with its latest dispatch, bit-exact against the reference.

use std::time::{Duration, Instant};

use epflow_core::handle::RoutingHandle;
use epflow_core::host::{HostRank, HostWorld};
use epflow_core::ops::{CombineInputs, CombineOptions, DispatchInputs, DispatchOptions, Pass};
use epflow_core::scenario::{Scenario, ll_identity_expert_outputs};
use epflow_core::stamp::{Pairing, Stamp};
use epflow_core::verify::{Tolerance, check_bf16, check_ll_dispatch};
use epflow_core::workload::RoutingKind;
use epflow_core::{Error, GroupConfig, HostTensor, MaxTokens, ValidationError, bf16};

const H: usize = 128;
const E: usize = 8;
const M: usize = 6;
/// Every disagreement must be reported long before this (the peers' timeout).
const TIMEOUT: Duration = Duration::from_secs(5);
const PROMPT: Duration = Duration::from_secs(1);

fn ll() -> GroupConfig {
    GroupConfig::low_latency(E, M, H).with_timeout(TIMEOUT)
}

fn idx(rank: usize, b: usize, k: usize) -> HostTensor {
    HostTensor::topk_idx(b, k, (0..b * k).map(|i| ((i + rank * 3) % E) as i64).collect())
}

fn tokens(b: usize, fill: f32) -> HostTensor {
    HostTensor::tokens(b, H, vec![bf16::from_f32(fill); b * H])
}

fn weights(b: usize, k: usize) -> HostTensor {
    HostTensor::topk_weights(b, k, vec![0.5; b * k])
}

/// One low-latency round of `sc` on `rank`, checked against the reference (dispatch bit for bit,
/// combine within one BF16 ulp, as every host test does).
fn exact_round(rank: &HostRank, sc: &Scenario) {
    let r = rank.rank();
    let refs = sc.ll_dispatch_reference().unwrap();
    let combine_ref = sc.ll_combine_identity_reference(&refs).unwrap();
    let h = rank.create_handle(&sc.topk_idx(r)).unwrap();
    let out = rank.dispatch(&h, DispatchInputs::new(&sc.tokens(r)), &DispatchOptions::default()).unwrap();
    let rows = sc.num_ranks * M;
    let counts = out.counts().unwrap().to_vec();
    let d = check_ll_dispatch(&refs[r], H, rows, out.tokens().data(), None, &counts);
    assert!(d.ok(), "rank {r} dispatch: {d:?}");
    let experts = ll_identity_expert_outputs(out.tokens().data(), None, &counts, rows, H);
    drop(out);
    let w = sc.weights(r);
    let y = rank.combine(&h, CombineInputs::new(&experts).with_weights(&w), &CombineOptions::default()).unwrap();
    let c = check_bf16("combine", &combine_ref[r], y.tokens().as_bf16().unwrap(), Tolerance::OneUlp);
    assert!(c.ok(), "rank {r} combine: {c:?}");
}

#[test]
fn combines_of_two_handles_in_swapped_order_fail_with_a_mismatch_and_the_group_goes_on() {
    // Two handles of different B and K; rank 0 combines them in dispatch order, rank 1 swapped.
    let sc = Scenario::generate(ll(), 2, &[M, 4], 2, RoutingKind::Uniform, 1, 9);
    HostWorld::run(2, ll(), |rank| {
        let r = rank.rank();
        let h1 = rank.create_handle(&idx(r, 3, 2)).unwrap();
        let h2 = rank.create_handle(&idx(r, 5, 4)).unwrap();
        // Expert outputs: the received rows (the outputs themselves are dropped, freeing their sets).
        let run = |h, b, fill| {
            rank.dispatch(h, DispatchInputs::new(&tokens(b, fill)), &DispatchOptions::default())
                .unwrap()
                .tokens()
                .clone()
        };
        let (e1, e2) = (run(&h1, 3, 1.0), run(&h2, 5, 2.0));
        let (w1, w2) = (weights(3, 2), weights(5, 4));
        let mut order = vec![(&h1, &e1, &w1), (&h2, &e2, &w2)];
        if r == 1 {
            order.reverse();
        }
        for (i, (h, e, w)) in order.into_iter().enumerate() {
            let t = Instant::now();
            let err = rank.combine(h, CombineInputs::new(e).with_weights(w), &CombineOptions::default()).unwrap_err();
            assert!(t.elapsed() < PROMPT, "rank {r}: the mismatch took {:?}", t.elapsed());
            let Error::PeerMismatch { peer, ours, theirs, .. } = &err else { panic!("rank {r}: {err}") };
            assert_eq!(*peer, 1 - r);
            let mine = if (i == 0) == (r == 0) { (2, 0) } else { (4, 1) };
            assert_eq!(*ours, Stamp::new(mine.0, Pass::Forward, Pairing::Dispatch(mine.1)), "{err}");
            assert_ne!(ours, theirs);
            assert!(err.to_string().contains("pairing with dispatch"), "{err}");
        }
        assert!(!rank.is_poisoned(), "a mismatch is handled cleanly");
        exact_round(rank, &sc);
    })
    .unwrap();
}

#[test]
fn a_reused_handle_pairs_each_combine_with_its_latest_dispatch() {
    // Rank 0 keeps its first handle; ranks 1 and 2 route anew every round. Every round must
    // match the reference of that round's routings, bit for bit.
    const R: usize = 3;
    const E3: usize = 12;
    let config = GroupConfig::low_latency(E3, M, H).with_timeout(TIMEOUT);
    let first = Scenario::generate(config.clone(), R, &[M, 5, 3], 3, RoutingKind::Uniform, 2, 100);
    let rounds: Vec<Scenario> = (0..4)
        .map(|i| {
            let mut sc = Scenario::generate(config.clone(), R, &[M, 5, 3], 3, RoutingKind::Uniform, 2, 100 + i);
            sc.ranks[0].topk_idx = first.ranks[0].topk_idx.clone();
            sc
        })
        .collect();
    HostWorld::run(R, config, |rank| {
        let r = rank.rank();
        let kept = rank.create_handle(&first.topk_idx(r)).unwrap();
        for (i, sc) in rounds.iter().enumerate() {
            let refs = sc.ll_dispatch_reference().unwrap();
            let combine_ref = sc.ll_combine_identity_reference(&refs).unwrap();
            let h = if r == 0 { kept.clone() } else { rank.create_handle(&sc.topk_idx(r)).unwrap() };
            let out = rank.dispatch(&h, DispatchInputs::new(&sc.tokens(r)), &DispatchOptions::default()).unwrap();
            let counts = out.counts().unwrap().to_vec();
            let d = check_ll_dispatch(&refs[r], H, R * M, out.tokens().data(), None, &counts);
            assert!(d.ok(), "round {i} rank {r} dispatch: {d:?}");
            let experts = ll_identity_expert_outputs(out.tokens().data(), None, &counts, R * M, H);
            drop(out);
            let w = sc.weights(r);
            let y =
                rank.combine(&h, CombineInputs::new(&experts).with_weights(&w), &CombineOptions::default()).unwrap();
            let c = check_bf16("combine", &combine_ref[r], y.tokens().as_bf16().unwrap(), Tolerance::OneUlp);
            assert!(c.ok(), "round {i} rank {r} combine: {c:?}");
        }
    })
    .unwrap();
}

fn ht(k_max: usize) -> GroupConfig {
    GroupConfig::high_throughput(E, H).with_max_top_k(k_max).with_timeout(TIMEOUT)
}

#[test]
fn high_throughput_ranks_with_different_top_k_fail_at_handle_creation() {
    HostWorld::run(2, ht(4), |rank| {
        let r = rank.rank();
        let k = if r == 0 { 2 } else { 3 };
        let t = Instant::now();
        let err = rank.create_handle(&idx(r, 4, k)).unwrap_err();
        assert!(t.elapsed() < PROMPT);
        assert!(matches!(err, Error::PeerMismatch { peer, .. } if peer == 1 - r), "rank {r}: {err}");
        assert!(err.to_string().contains("top-k 2") && err.to_string().contains("top-k 3"), "{err}");
        assert!(!rank.is_poisoned());
    })
    .unwrap();
}

#[test]
fn high_throughput_dispatches_on_different_handles_fail_with_a_mismatch() {
    HostWorld::run(2, ht(2), |rank| {
        let r = rank.rank();
        let h0 = rank.create_handle(&idx(r, 4, 2)).unwrap();
        let h1 = rank.create_handle(&idx(r, 3, 2)).unwrap();
        let (h, b) = if r == 0 { (&h0, 4) } else { (&h1, 3) };
        let (x, w) = (tokens(b, 1.0), weights(b, 2));
        let err = rank.dispatch(h, DispatchInputs::new(&x).with_weights(&w), &DispatchOptions::default()).unwrap_err();
        let Error::PeerMismatch { ours, theirs, .. } = &err else { panic!("rank {r}: {err}") };
        assert_eq!(ours.pairing, Pairing::Handle(r as u64));
        assert_eq!(theirs.pairing, Pairing::Handle(1 - r as u64));
        // Both ranks on handle 0 now: fine.
        let (x, w) = (tokens(4, 1.0), weights(4, 2));
        let out = rank.dispatch(&h0, DispatchInputs::new(&x).with_weights(&w), &DispatchOptions::default()).unwrap();
        assert_eq!(out.tokens().shape()[0], h0.num_recv_tokens().unwrap());
    })
    .unwrap();
}

#[test]
fn high_throughput_combine_needs_a_dispatch() {
    HostWorld::run(2, ht(2), |rank| {
        let r = rank.rank();
        let h = rank.create_handle(&idx(r, 4, 2)).unwrap();
        let n = h.num_recv_tokens().unwrap();
        let y = tokens(n, 1.0);
        let err = rank.combine(&h, CombineInputs::new(&y), &CombineOptions::default()).unwrap_err();
        assert_eq!(err, Error::Validation(ValidationError::CombineBeforeDispatch));
        // The peer's combine saw this rank's cancellation at once; so for a backward one.
        let bwd = CombineOptions { pass: Pass::Backward, ..Default::default() };
        let gw = HostTensor::topk_weights(n, 2, vec![0.0; n * 2]);
        let err = rank.combine(&h, CombineInputs::new(&y).with_weights(&gw), &bwd).unwrap_err();
        assert_eq!(err, Error::Validation(ValidationError::CombineBeforeDispatch));
        // After a forward dispatch, combines of both passes pair with the handle's rows (the
        // values are checked in host_matches_reference).
        let (x, w) = (tokens(4, 1.0), weights(4, 2));
        drop(rank.dispatch(&h, DispatchInputs::new(&x).with_weights(&w), &DispatchOptions::default()).unwrap());
        assert!(rank.combine(&h, CombineInputs::new(&y).with_weights(&gw), &bwd).is_ok());
        assert!(rank.combine(&h, CombineInputs::new(&y), &CombineOptions::default()).is_ok());
    })
    .unwrap();
}

#[test]
fn a_rank_whose_arguments_fail_validation_cancels_instead_of_stalling_its_peers() {
    let config = GroupConfig::low_latency(12, M, H).with_max_tokens(MaxTokens::Fixed(M)).with_timeout(TIMEOUT);
    HostWorld::run(3, config, |rank| {
        let r = rank.rank();
        let h = rank.create_handle(&idx(r, 4, 2)).unwrap();
        let t = Instant::now();
        // Rank 1 passes tokens of the wrong width; the others wait for it.
        let x = if r == 1 { HostTensor::tokens(4, H / 2, vec![bf16::ONE; 4 * H / 2]) } else { tokens(4, 1.0) };
        let err = rank.dispatch(&h, DispatchInputs::new(&x), &DispatchOptions::default()).unwrap_err();
        assert!(t.elapsed() < PROMPT, "rank {r} waited {:?}", t.elapsed());
        if r == 1 {
            assert!(matches!(err, Error::Validation(_)), "{err}");
        } else {
            assert_eq!(err, Error::PeerCancelled { op: "dispatch #0".into(), peer: 1 });
        }
        // A combine with a foreign handle also cancels.
        let other = HostWorld::create(1, GroupConfig::low_latency(E, M, H)).unwrap().pop().unwrap();
        let foreign = other.create_handle(&idx(0, 4, 2)).unwrap();
        let out = rank.dispatch(&h, DispatchInputs::new(&tokens(4, 1.0)), &DispatchOptions::default()).unwrap();
        let y = out.tokens().clone();
        drop(out);
        let hh = if r == 2 { &foreign } else { &h };
        let err = rank.combine(hh, CombineInputs::new(&y).with_weights(&weights(4, 2)), &CombineOptions::default());
        match r {
            2 => assert!(matches!(err, Err(Error::Validation(ValidationError::ForeignHandle { .. })))),
            _ => assert_eq!(err.unwrap_err(), Error::PeerCancelled { op: "combine #0".into(), peer: 2 }),
        }
        assert!(!rank.is_poisoned());
    })
    .unwrap();
}

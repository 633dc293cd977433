//! GPU ranks that disagree about a collective get typed errors at once, never wrong rows or a
//! hang (issue 21 on the GPU backend): stamps checked on the device, handles reused while peers
//! route anew, validation failures that cancel, a handle's rows rewritten under a combine.
//! Two GPUs; SKIPPED without them.

use std::time::{Duration, Instant};

use epflow_core::backend::{
    Backend, HandleCreation, OpOutput, blocking_combine, blocking_dispatch, blocking_handle, run_blocking,
};
use epflow_core::handle::RoutingHandle;
use epflow_core::ops::{CombineInputs, CombineOptions, DispatchInputs, DispatchOptions};
use epflow_core::protocol::Channel;
use epflow_core::scenario::Scenario;
use epflow_core::stamp::Pairing;
use epflow_core::verify::{Tolerance, check_bf16, check_ll_dispatch};
use epflow_core::workload::RoutingKind;
use epflow_core::{Error, GroupConfig, HostTensor, MaxTokens, ValidationError};
use epflow_kernels::{GpuHandle, GpuRank, GpuWorld};

mod common;
use common::{gpus, on_ranks, seed};

const H: usize = 2048;
const E: usize = 16;
const M: usize = 32;
const TIMEOUT: Duration = Duration::from_secs(4);
/// Every disagreement is reported long before the timeout.
const PROMPT: Duration = Duration::from_secs(1);

fn ll() -> GroupConfig {
    GroupConfig::low_latency(E, M, H).with_timeout(TIMEOUT)
}

fn world(test: &str, config: &GroupConfig) -> Option<Vec<GpuRank>> {
    let devices = gpus(2, test)?;
    Some(GpuWorld::create(&devices, config.clone()).expect("GPU group"))
}

/// A low-latency round of `sc` on `rank` with handle `h`: dispatch and identity-expert combine
/// against the reference, bit for bit.
fn exact_round(rank: &GpuRank, sc: &Scenario, h: &GpuHandle) {
    let r = rank.rank();
    let refs = sc.ll_dispatch_reference().unwrap();
    let want = sc.ll_combine_identity_reference(&refs).unwrap();
    rank.fill_output_buffers(0xA5).unwrap();
    let x = rank.upload(&sc.tokens(r)).unwrap();
    let out = blocking_dispatch(rank, h, DispatchInputs::new(&x), &DispatchOptions::default(), true).unwrap();
    let host = out.to_host().unwrap();
    let counts = host.counts.as_ref().and_then(HostTensor::as_i32).unwrap().to_vec();
    let d = check_ll_dispatch(&refs[r], H, 2 * M, host.tokens.data(), None, &counts);
    assert!(d.ok(), "rank {r} dispatch: {d:?}");
    let w = rank.upload(&sc.weights(r)).unwrap();
    let cin = CombineInputs::new(out.tokens()).with_weights(&w);
    let y = blocking_combine(rank, h, cin, &CombineOptions::default(), true).unwrap();
    let c = check_bf16("combine", &want[r], y.to_host().unwrap().tokens.as_bf16().unwrap(), Tolerance::Exact);
    assert!(c.ok(), "rank {r} combine: {c:?}");
}

fn handle(rank: &GpuRank, sc: &Scenario) -> GpuHandle {
    blocking_handle(rank, &rank.upload(&sc.topk_idx(rank.rank())).unwrap()).unwrap()
}

#[test]
fn gpu_ll_swapped_combines_fail_with_a_mismatch_and_the_group_goes_on() {
    let Some(ranks) = world("gpu_ll_swapped_combines", &ll()) else { return };
    let s = seed();
    eprintln!("seed {s}");
    let a = Scenario::generate(ll(), 2, &[M, 20], 2, RoutingKind::Uniform, 3, s);
    let b = Scenario::generate(ll(), 2, &[9, M], 4, RoutingKind::Uniform, 3, s + 1);
    let after = Scenario::generate(ll(), 2, &[M, 17], 8, RoutingKind::Uniform, 3, s + 2);
    on_ranks(&ranks, |rank| {
        let r = rank.rank();
        let (ha, hb) = (handle(rank, &a), handle(rank, &b));
        let mut experts = Vec::new();
        for (h, sc) in [(&ha, &a), (&hb, &b)] {
            let x = rank.upload(&sc.tokens(r)).unwrap();
            let out = blocking_dispatch(rank, h, DispatchInputs::new(&x), &DispatchOptions::default(), false).unwrap();
            experts.push((out.tokens().duplicate(rank.context()).unwrap(), rank.upload(&sc.weights(r)).unwrap()));
        }
        let order = if r == 0 { [0, 1] } else { [1, 0] };
        for i in order {
            let h = [&ha, &hb][i];
            let (e, w) = &experts[i];
            let t = Instant::now();
            let staged = i == 0;
            let err =
                blocking_combine(rank, h, CombineInputs::new(e).with_weights(w), &CombineOptions::default(), staged)
                    .unwrap_err();
            assert!(t.elapsed() < PROMPT, "rank {r}: {:?}", t.elapsed());
            let Error::PeerMismatch { ours, theirs, .. } = &err else { panic!("rank {r}: {err}") };
            assert_eq!(ours.pairing, Pairing::Dispatch(i as u64), "{err}");
            assert_ne!(ours, theirs, "{err}");
            eprintln!("rank {r}: {err}");
        }
        assert!(!rank.core().poison().is_poisoned());
        exact_round(rank, &after, &handle(rank, &after));
    });
}

#[test]
fn gpu_ll_reused_handle_pairs_each_combine_with_its_latest_dispatch() {
    let Some(ranks) = world("gpu_ll_reused_handle", &ll()) else { return };
    let s = seed();
    eprintln!("seed {s}");
    let first = Scenario::generate(ll(), 2, &[M, 21], 8, RoutingKind::Uniform, 4, s);
    let rounds: Vec<Scenario> = (1..=4)
        .map(|i| {
            let mut sc = Scenario::generate(ll(), 2, &[M, 21], 8, RoutingKind::Uniform, 4, s + i);
            sc.ranks[0].topk_idx = first.ranks[0].topk_idx.clone();
            sc
        })
        .collect();
    on_ranks(&ranks, |rank| {
        let kept = handle(rank, &first);
        for sc in &rounds {
            let h = if rank.rank() == 0 { kept.clone() } else { handle(rank, sc) };
            exact_round(rank, sc, &h);
        }
    });
}

#[test]
fn gpu_ll_validation_failure_cancels_the_collective() {
    let Some(ranks) = world("gpu_ll_validation_failure", &ll()) else { return };
    let sc = Scenario::generate(ll(), 2, &[M, 12], 4, RoutingKind::Uniform, 2, seed());
    on_ranks(&ranks, |rank| {
        let r = rank.rank();
        let h = handle(rank, &sc);
        let good = rank.upload(&sc.tokens(r)).unwrap();
        let bad = rank.upload(&HostTensor::tokens(1, H, vec![epflow_core::bf16::ONE; H])).unwrap();
        let x = if r == 1 { &bad } else { &good };
        let t = Instant::now();
        let err = blocking_dispatch(rank, &h, DispatchInputs::new(x), &DispatchOptions::default(), true).unwrap_err();
        assert!(t.elapsed() < PROMPT, "rank {r} waited {:?}", t.elapsed());
        match r {
            1 => assert!(matches!(err, Error::Validation(ValidationError::TokenCountMismatch { .. })), "{err}"),
            _ => assert_eq!(err, Error::PeerCancelled { op: "dispatch #0".into(), peer: 1 }),
        }
        assert!(!rank.core().poison().is_poisoned());
        exact_round(rank, &sc, &h);
    });
}

#[test]
fn gpu_ll_combine_refuses_rows_a_later_dispatch_rewrote() {
    let Some(ranks) = world("gpu_ll_handle_rewritten", &ll()) else { return };
    let sc = Scenario::generate(ll(), 2, &[M, 30], 8, RoutingKind::Uniform, 2, seed());
    on_ranks(&ranks, |rank| {
        let r = rank.rank();
        let h = handle(rank, &sc);
        let x = rank.upload(&sc.tokens(r)).unwrap();
        let w = rank.upload(&sc.weights(r)).unwrap();
        let first = blocking_dispatch(rank, &h, DispatchInputs::new(&x), &DispatchOptions::default(), false).unwrap();
        let e = first.tokens().duplicate(rank.context()).unwrap();
        drop(first);
        // A combine pairing with dispatch #0 is created, then dispatch #1 rewrites the handle's
        // rows before the combine is sent.
        let combine =
            rank.start_combine(&h, CombineInputs::new(&e).with_weights(&w), &CombineOptions::default()).unwrap();
        drop(blocking_dispatch(rank, &h, DispatchInputs::new(&x), &DispatchOptions::default(), false).unwrap());
        let cfg = rank.config();
        let err = run_blocking(combine, rank.slot_pool(Channel::Combine), rank.poison(), cfg.timeout).unwrap_err();
        assert_eq!(err, Error::Validation(ValidationError::HandleRewritten { paired: 0, rewritten_by: 1 }), "rank {r}");
        // The next combine pairs with dispatch #1 and is exact.
        let out = blocking_dispatch(rank, &h, DispatchInputs::new(&x), &DispatchOptions::default(), false).unwrap();
        let refs = sc.ll_dispatch_reference().unwrap();
        let want = sc.ll_combine_identity_reference(&refs).unwrap();
        let y = blocking_combine(
            rank,
            &h,
            CombineInputs::new(out.tokens()).with_weights(&w),
            &CombineOptions::default(),
            false,
        )
        .unwrap();
        let c = check_bf16("combine", &want[r], y.to_host().unwrap().tokens.as_bf16().unwrap(), Tolerance::Exact);
        assert!(c.ok(), "rank {r}: {c:?}");
    });
}

#[test]
fn gpu_ht_dispatches_on_different_handles_fail_promptly_and_poison() {
    let config = GroupConfig::high_throughput(E, H).with_max_tokens(MaxTokens::Fixed(256)).with_timeout(TIMEOUT);
    let Some(ranks) = world("gpu_ht_mismatch", &config) else { return };
    let a = Scenario::generate(config.clone(), 2, &[256, 200], 4, RoutingKind::Uniform, 0, seed());
    let b = Scenario::generate(config.clone(), 2, &[100, 256], 4, RoutingKind::Uniform, 0, seed() + 1);
    on_ranks(&ranks, |rank| {
        let r = rank.rank();
        let create = |sc: &Scenario| match rank
            .start_handle(&rank.upload(&sc.topk_idx(r)).unwrap(), &Default::default())
            .unwrap()
        {
            HandleCreation::Collective(op) => {
                let cfg = rank.config();
                match run_blocking(op, rank.slot_pool(Channel::Handle), rank.poison(), cfg.timeout).unwrap() {
                    OpOutput::Handle(h) => h,
                    _ => panic!("no handle"),
                }
            }
            HandleCreation::Ready(h) => h,
        };
        let (ha, hb) = (create(&a), create(&b));
        let (h, sc) = if r == 0 { (&ha, &a) } else { (&hb, &b) };
        let x = rank.upload(&sc.tokens(r)).unwrap();
        let w = rank.upload(&sc.weights(r)).unwrap();
        let t = Instant::now();
        let err =
            blocking_dispatch(rank, h, DispatchInputs::new(&x).with_weights(&w), &DispatchOptions::default(), false)
                .unwrap_err();
        eprintln!("rank {r}: {err} after {:?}", t.elapsed());
        assert!(t.elapsed() < PROMPT, "rank {r} waited {:?}", t.elapsed());
        // The report names the peer's handle: its stamp word, written without a fence, is read
        // once it agrees with the arrival word (`ht_publish_mask`).
        let Error::PeerMismatch { ours, theirs, .. } = &err else { panic!("rank {r}: {err}") };
        let other = if r == 0 { &hb } else { &ha };
        assert_eq!(ours.pairing, Pairing::Handle(h.core().creation().expect("created")), "{err}");
        assert_eq!(theirs.pairing, Pairing::Handle(other.core().creation().expect("created")), "{err}");
        assert!(rank.core().poison().is_poisoned(), "the rings disagree: the group is poisoned");
    });
}

/// A high-throughput combine whose inputs fail validation on one rank: that rank's combine fails
/// with the validation error, its peer's with `PeerCancelled` at once, nothing is poisoned, and
/// a full round follows bit for bit. On one process the peer's pairs are pulled (the valid
/// rank offers its expert outputs in place) and the cancelled rank's are not: both paths end.
#[test]
fn gpu_ht_combine_validation_failure_cancels_the_collective() {
    let config = GroupConfig::high_throughput(E, H).with_max_tokens(MaxTokens::Fixed(256)).with_timeout(TIMEOUT);
    let Some(ranks) = world("gpu_ht_combine_validation_failure", &config) else { return };
    let sc = Scenario::generate(config.clone(), 2, &[256, 200], 4, RoutingKind::Uniform, 0, seed());
    let refs = sc.ht_dispatch_reference().unwrap();
    let want = sc.ht_combine_identity_reference(&refs).unwrap();
    on_ranks(&ranks, |rank| {
        let r = rank.rank();
        let h = handle(rank, &sc);
        let x = rank.upload(&sc.tokens(r)).unwrap();
        let w = rank.upload(&sc.weights(r)).unwrap();
        let dispatch = || {
            blocking_dispatch(rank, &h, DispatchInputs::new(&x).with_weights(&w), &DispatchOptions::default(), false)
                .unwrap()
        };
        let out = dispatch();
        let bad = rank.upload(&HostTensor::tokens(1, H, vec![epflow_core::bf16::ONE; H])).unwrap();
        let experts = if r == 1 { &bad } else { out.tokens() };
        let t = Instant::now();
        let err =
            blocking_combine(rank, &h, CombineInputs::new(experts), &CombineOptions::default(), false).unwrap_err();
        assert!(t.elapsed() < PROMPT, "rank {r} waited {:?}", t.elapsed());
        match r {
            1 => assert!(matches!(err, Error::Validation(_)), "{err}"),
            _ => assert!(matches!(err, Error::PeerCancelled { peer: 1, .. }), "{err}"),
        }
        assert!(!rank.core().poison().is_poisoned());
        drop(out);
        rank.fill_output_buffers(0xA5).unwrap();
        let out = dispatch();
        let y =
            blocking_combine(rank, &h, CombineInputs::new(out.tokens()), &CombineOptions::default(), false).unwrap();
        let c = check_bf16("combine", &want[r], y.to_host().unwrap().tokens.as_bf16().unwrap(), Tolerance::Exact);
        assert!(c.ok(), "rank {r} combine after the cancelled one: {c:?}");
    });
}

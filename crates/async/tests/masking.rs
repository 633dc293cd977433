//! Rank masking through the async API: a rank stops calling; the survivors' awaited
//! operations go on without it (the driver masks at the timeout instead of poisoning), their
//! mask-event streams report it, the results match the reference without it (staged and
//! synchronous), and after `unmask_all` (awaited on every rank) the full group is exact again.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{E, H, K, M, on_tokio_ranks};
use epflow_async::Group;
use epflow_core::backend::Backend;
use epflow_core::host::HostRank;
use epflow_core::mask::RankSet;
use epflow_core::ops::{CombineInputs, DispatchInputs};
use epflow_core::scenario::Scenario;
use epflow_core::verify::{Tolerance, check_bf16, check_exact, check_ll_dispatch};
use epflow_core::workload::RoutingKind;
use epflow_core::{Error, GroupConfig};
use futures::StreamExt;
use tokio::sync::Barrier;

const RANKS: usize = 4;
/// Long enough that a live rank on a loaded 2-core CI machine is never taken for a dead one.
const TIMEOUT: Duration = Duration::from_secs(1);

fn config() -> GroupConfig {
    GroupConfig::low_latency(E, M, H).with_rank_masking(true).with_timeout(TIMEOUT)
}

/// One expert-major dispatch and combine (staged when `staged`) against the reference of the
/// group without `masked`.
async fn round(g: &Group<HostRank>, seed: u64, masked: &RankSet, staged: bool) {
    let r = g.rank();
    let full = Scenario::generate(config(), RANKS, &[M, 3, 6, 2], K, RoutingKind::Uniform, 1, seed);
    let sc = full.without_ranks(masked);
    let h = g.create_handle(&full.topk_idx(r)).await.unwrap();
    let x = full.tokens(r);
    let out = if staged {
        g.dispatch(&h, DispatchInputs::new(&x)).send_only().await.unwrap().await.unwrap()
    } else {
        g.dispatch(&h, DispatchInputs::new(&x)).await.unwrap()
    };
    let refs = sc.ll_dispatch_reference().unwrap();
    let rep = check_ll_dispatch(&refs[r], H, RANKS * M, out.tokens().data(), None, out.counts().unwrap());
    assert!(rep.ok(), "seed {seed} rank {r} dispatch: {rep:?}");
    drop(out);
    let y = sc.ll_reference_expert_outputs(r, epflow_core::ops::Layout::ExpertMajor).unwrap();
    let w = full.weights(r);
    let f = g.combine(&h, CombineInputs::new(&y).with_weights(&w));
    let out = if staged { f.send_only().await.unwrap().await.unwrap() } else { f.await.unwrap() };
    let want = sc.ll_combine_identity_reference(&refs).unwrap();
    let rep = check_bf16("combine", &want[r], out.tokens().as_bf16().unwrap(), Tolerance::Exact);
    assert!(rep.ok(), "seed {seed} rank {r} combine: {rep:?}");
    let lost = full.masked_entries(r, masked);
    assert!(check_exact("masked", &lost, out.masked().unwrap(), |a, b| a == b).ok(), "seed {seed} rank {r}");
}

#[test]
fn awaited_operations_mask_a_silent_rank_and_report_it() {
    let dead = 1;
    let gone = RankSet::from_ranks([dead], RANKS).unwrap();
    let back = Arc::new(Barrier::new(RANKS));
    on_tokio_ranks(RANKS, config(), back, move |g, back| async move {
        let me = g.rank();
        let none = RankSet::new();
        let mut events = g.mask_events();
        round(&g, 1, &none, false).await;
        if me != dead {
            let t = Instant::now();
            round(&g, 2, &gone, true).await;
            assert!(t.elapsed() < 3 * TIMEOUT, "rank {me}: {:?}", t.elapsed());
            let e = tokio::time::timeout(Duration::from_secs(5), events.next()).await.unwrap().unwrap();
            assert_eq!((e.added, e.unmasked), (gone, false));
            for seed in 3..40 {
                round(&g, seed, &gone, seed % 2 == 0).await;
            }
            assert!(!g.is_poisoned());
        }
        back.wait().await;
        if me == dead {
            let sc = Scenario::generate(config(), RANKS, &[M], K, RoutingKind::Uniform, 0, 9);
            let h = g.create_handle(&sc.topk_idx(me)).await.unwrap();
            let x = sc.tokens(me);
            assert!(matches!(g.dispatch(&h, DispatchInputs::new(&x)).await, Err(Error::RankMasked { .. })));
        }
        g.unmask_all().await.unwrap();
        let e = tokio::time::timeout(Duration::from_secs(5), events.next()).await.unwrap().unwrap();
        assert!(e.unmasked && e.now.ranks.is_empty() && e.now.epoch == 1, "{e:?}");
        for seed in 100..110 {
            round(&g, seed, &none, seed % 2 == 1).await;
        }
        // The application masks a rank without waiting for a timeout (once every rank is
        // done with its operations: a rank masked mid-operation loses its result); every rank
        // sees it.
        back.wait().await;
        if me == 0 {
            g.mask(2).unwrap();
        }
        let e = tokio::time::timeout(Duration::from_secs(5), events.next()).await.unwrap().unwrap();
        assert_eq!(e.added.to_vec(), vec![2]);
    });
}

/// Issue 70 item 2 on the host backend (the GPU twin is `gpu_stream_order`'s
/// `a_late_masked_peer_learns_it_in_stream_order`): a rank that comes late, after the others
/// masked it, learns it from its stream-ordered operation (`RankMasked`, at the call or from the
/// `Completion`), the group is not poisoned, its next operation is refused alike, and after
/// `unmask_all` the full group is exact again.
#[test]
fn a_late_rank_completing_in_stream_order_learns_it_is_masked() {
    let late = 2;
    let gone = RankSet::from_ranks([late], RANKS).unwrap();
    let back = Arc::new(Barrier::new(RANKS));
    on_tokio_ranks(RANKS, config(), back, move |g, back| async move {
        let me = g.rank();
        let none = RankSet::new();
        round(&g, 1, &none, true).await;
        if me != late {
            for seed in 2..5 {
                round(&g, seed, &gone, true).await;
            }
        }
        back.wait().await;
        if me == late {
            let sc = Scenario::generate(config(), RANKS, &[M], K, RoutingKind::Uniform, 0, 9);
            let h = g.create_handle(&sc.topk_idx(me)).await.unwrap();
            let x = sc.tokens(me);
            let stream = &epflow_core::host::HostStream;
            match g.dispatch(&h, DispatchInputs::new(&x)).after(stream).complete_on(stream).await {
                Ok((_, done)) => assert!(matches!(done.await, Err(Error::RankMasked { .. }))),
                Err(e) => assert!(matches!(e, Error::RankMasked { .. }), "{e}"),
            }
            assert!(!g.is_poisoned());
            let again = g.dispatch(&h, DispatchInputs::new(&x)).after(stream).complete_on(stream).await;
            assert!(matches!(again, Err(Error::RankMasked { .. })), "{:?}", again.err());
        }
        back.wait().await;
        g.unmask_all().await.unwrap();
        for seed in 100..104 {
            round(&g, seed, &none, seed % 2 == 1).await;
        }
    });
}

/// Issue 64 item 3: `Group::mask` of a rank outside a 4-rank group — 4, 1024 (past what a
/// `RankSet` holds) or `usize::MAX` — is `Error::RankOutOfRange` and masks nothing, on every
/// rank; a rank inside the group is masked everywhere.
#[test]
fn masking_a_rank_outside_the_group_is_a_typed_error() {
    let groups = common::groups(RANKS, config());
    for rank in [4, 1024, usize::MAX] {
        assert_eq!(groups[0].mask(rank), Err(Error::RankOutOfRange { op: "mask".into(), rank, limit: RANKS }));
        assert_eq!(
            groups[0].mask(rank).unwrap_err().to_string(),
            format!("mask: rank {rank} is out of range: the ranks are 0..4")
        );
        for g in &groups {
            assert!(g.masked_ranks().ranks.is_empty(), "rank {}: {:?}", g.rank(), g.masked_ranks());
        }
    }
    // The backend's own entry refuses a set naming a rank outside the group as well.
    let outside = RankSet::from_ranks([1, 5], 8).unwrap();
    assert_eq!(
        groups[1].backend().mask_ranks(&outside),
        Err(Error::RankOutOfRange { op: "mask_ranks".into(), rank: 5, limit: RANKS })
    );
    groups[1].mask(3).unwrap();
    for g in &groups {
        assert_eq!(g.masked_ranks().ranks.to_vec(), vec![3], "rank {}", g.rank());
        assert!(!g.is_poisoned());
    }
}

/// Elastic rejoin through the async API ([`epflow_core::mask`], "Rejoining"): rank 1's group is
/// dropped (its process died); the survivors mask it and serve without it; a replacement made
/// through the rendezvous awaits `rejoin` while the survivors await `admit`; then the whole
/// group is exact again, on any executor (here `futures`' block_on on plain threads).
#[test]
fn a_dead_rank_is_replaced_through_the_async_api() {
    use epflow_core::host::HostWorld;
    let dead = 1;
    let gone = RankSet::from_ranks([dead], RANKS).unwrap();
    let none = RankSet::new();
    let groups: Vec<Group<HostRank>> =
        HostWorld::create(RANKS, config()).unwrap().into_iter().map(Group::new).collect();
    let rendezvous = groups[0].backend().rendezvous();
    let survivors: Vec<Group<HostRank>> = std::thread::scope(|s| {
        let hs: Vec<_> = groups
            .into_iter()
            .map(|g| {
                let none = &none;
                s.spawn(move || {
                    futures::executor::block_on(round(&g, 31, none, false));
                    (g.rank() != dead).then_some(g)
                })
            })
            .collect();
        hs.into_iter().filter_map(|h| h.join().unwrap()).collect()
    });
    survivors[0].mask(dead).unwrap();
    let replacement = Group::new(rendezvous.replace(dead, &config()).unwrap());
    let meeting = Duration::from_secs(10);
    std::thread::scope(|s| {
        for g in &survivors {
            let (gone, none) = (&gone, &none);
            s.spawn(move || {
                futures::executor::block_on(async {
                    round(g, 32, gone, true).await;
                    g.admit(&[dead], meeting).await.unwrap();
                    round(g, 33, none, true).await;
                })
            });
        }
        let (g, none) = (&replacement, &none);
        s.spawn(move || {
            futures::executor::block_on(async {
                g.rejoin(meeting).await.unwrap();
                round(g, 33, none, true).await;
            })
        });
    });
    assert!(survivors.iter().chain([&replacement]).all(|g| g.masked_ranks().ranks.is_empty()));
}

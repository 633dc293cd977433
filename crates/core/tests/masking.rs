//! Rank masking on the host backend ([`epflow_core::mask`]): a rank stops calling mid-run; the
//! survivors' next operation completes after the timeout (no poison, no hang), and every later
//! operation — expert-major and rank-major, fresh random inputs each time, over 1,000
//! iterations — matches the reference computed without the masked rank's experts, with the
//! per-token counts of the entries it lost. Then the rank comes back: its first operation is
//! refused (`RankMasked`), every rank calls `unmask_all`, and results are bit-exact with the full
//! group again. Plus: the rules of the mask agreement as a property test, and the refusals.

use std::sync::Barrier;
use std::time::Duration;

use epflow_core::backend::Backend;
use epflow_core::host::HostWorld;
use epflow_core::mask::{RankSet, SharedMask, detect};
use epflow_core::ops::{CombineInputs, CombineOptions, DispatchInputs, DispatchOptions, HandleOptions, Layout};
use epflow_core::scenario::Scenario;
use epflow_core::{ConfigError, Error, GroupConfig};
use proptest::prelude::*;

mod common;
use common::{EXPERTS, HIDDEN, MAX_TOKENS, RANKS, TIMEOUT, config, round, scenario};

#[test]
fn survivors_serve_without_a_rank_that_stopped_then_welcome_it_back() {
    const BEFORE: u64 = 20;
    const MASKED: u64 = 1000;
    const AFTER: u64 = 20;
    let dead = 3;
    let gone = RankSet::from_ranks([dead], RANKS).unwrap();
    let none = RankSet::new();
    let survivors_done = Barrier::new(RANKS);
    let results = HostWorld::run(RANKS, config(), |rank| {
        let me = rank.rank();
        for i in 0..BEFORE {
            round(rank, i, &none);
        }
        let mut first_masked = Duration::ZERO;
        if me != dead {
            // The rank stopped calling: the next operation waits for it until the timeout,
            // masks it, and completes without it.
            first_masked = round(rank, BEFORE, &gone);
            assert_eq!(rank.masked_ranks().ranks, gone);
            for i in BEFORE + 1..BEFORE + MASKED {
                round(rank, i, &gone);
            }
            assert!(!rank.is_poisoned());
        }
        survivors_done.wait();
        if me == dead {
            // Back: the group masked it, so it must not wait for peers that no longer wait for it.
            assert!(rank.masked_ranks().ranks.contains(dead));
            let h = rank.create_handle(&scenario(0).0.topk_idx(me)).unwrap();
            let x = scenario(0).0.tokens(me);
            match rank.dispatch(&h, DispatchInputs::new(&x), &DispatchOptions::default()) {
                Err(Error::RankMasked { rank, .. }) => assert_eq!(rank, dead),
                other => panic!("a masked rank's dispatch must be refused, got {:?}", other.map(|_| ())),
            }
        }
        rank.unmask_all().unwrap();
        assert_eq!(rank.masked_ranks().ranks, none);
        assert_eq!(rank.masked_ranks().epoch, 1);
        for i in 0..AFTER {
            round(rank, 5000 + i, &none);
        }
        first_masked
    })
    .unwrap();
    for (r, took) in results.into_iter().enumerate().filter(|&(r, _)| r != dead) {
        // Not a performance claim (those are `moe_serving --kill-rank`'s): a bound that a hang
        // or a second timeout would break.
        assert!(took >= TIMEOUT && took < 3 * TIMEOUT, "rank {r}: the masking round took {took:?}");
    }
}

/// A live rank whose wait reaches its deadline just as its peers mask it (a slow rank under
/// CPU load): at the deadline nothing is missing any more, and the operation ends in
/// `RankMasked`, not in a `Timeout` that waits for "data from ranks []" and poisons the group.
#[test]
fn a_rank_masked_at_its_deadline_ends_in_rank_masked() {
    use epflow_core::backend::PendingOp;
    let world = HostWorld::create(2, config()).unwrap();
    let (sc, _) = scenario(3);
    let rank = &world[1];
    let handle = rank.create_handle_with(&sc.topk_idx(1), &HandleOptions::default()).unwrap();
    let x = sc.tokens(1);
    let mut op = rank.start_dispatch(&handle, DispatchInputs::new(&x), &DispatchOptions::default()).unwrap();
    assert!(op.poll_send_ready().unwrap());
    op.send(None).unwrap();
    op.start_complete().unwrap();
    // Rank 0 never sends: the wait would time out. Before that, rank 0 masks rank 1.
    assert!(!op.poll_complete().unwrap());
    world[0].mask_ranks(&RankSet::from_ranks([1], 2).unwrap()).unwrap();
    assert!(op.mask_missing().unwrap(), "nothing is missing after the mask: check again");
    assert!(op.poll_complete().unwrap());
    match op.finish() {
        Err(Error::RankMasked { rank: 1, .. }) => {}
        other => panic!("expected RankMasked, got {other:?}"),
    }
}

#[test]
fn a_mask_set_by_one_rank_spares_the_others_their_timeout() {
    let results = HostWorld::run(RANKS, config().with_timeout(Duration::from_secs(20)), |rank| {
        if rank.rank() == 0 {
            rank.mask_ranks(&RankSet::from_ranks([2], RANKS).unwrap()).unwrap();
        }
        if rank.rank() == 2 {
            return Duration::ZERO;
        }
        // Ranks 1 and 3 may start before rank 0 has masked: they stop waiting when it does.
        round(rank, 7, &RankSet::from_ranks([2], RANKS).unwrap())
    })
    .unwrap();
    assert!(results.iter().all(|&t| t < Duration::from_secs(10)), "{results:?}");
}

#[test]
fn combines_after_unmask_need_a_fresh_dispatch_and_groups_without_masking_refuse() {
    HostWorld::run(2, config(), |rank| {
        let (sc, _) = scenario(1);
        let sc = Scenario { num_ranks: 2, ranks: sc.ranks[..2].to_vec(), ..sc };
        let r = rank.rank();
        let h = rank.create_handle(&sc.topk_idx(r)).unwrap();
        let x = sc.tokens(r);
        drop(rank.dispatch(&h, DispatchInputs::new(&x), &DispatchOptions::default()).unwrap());
        let y = sc.ll_reference_expert_outputs(r, Layout::ExpertMajor).unwrap();
        rank.unmask_all().unwrap();
        let w = sc.weights(r);
        match rank.combine(&h, CombineInputs::new(&y).with_weights(&w), &CombineOptions::default()) {
            Err(Error::StaleMaskEpoch { dispatched: 0, now: 1, .. }) => {}
            other => panic!("expected StaleMaskEpoch, got {:?}", other.map(|_| ())),
        }
    })
    .unwrap();
    let plain = HostWorld::create(2, GroupConfig::low_latency(EXPERTS, MAX_TOKENS, HIDDEN)).unwrap();
    assert!(matches!(plain[0].unmask_all(), Err(Error::Unsupported(_))));
    assert!(matches!(plain[0].mask_ranks(&RankSet::from_ranks([1], RANKS).unwrap()), Err(Error::Unsupported(_))));
    assert!(plain[0].masked_ranks().ranks.is_empty());
    let ht = GroupConfig::high_throughput(EXPERTS, HIDDEN).with_rank_masking(true);
    assert_eq!(ht.validate(2), Err(ConfigError::MaskingNeedsLowLatency));
}

proptest! {
    /// Any order of detections (rank `me` gives up on `target`) and application masks: the
    /// survivors' words end equal (they agree), each contains every rank a survivor detected,
    /// every masked rank's own word names it (it learns it), and no rank that was masked when it
    /// detected masked anyone.
    #[test]
    fn survivors_agree_on_the_mask(events in prop::collection::vec((0usize..6, 0usize..6, any::<bool>()), 1..40)) {
        let words: Vec<SharedMask> = (0..6).map(|_| SharedMask::default()).collect();
        let mut expected = RankSet::new();
        for &(me, target, by_app) in &events {
            let set = RankSet::from_ranks([target], 6).unwrap();
            if by_app {
                epflow_core::mask::spread(&words, &set);
                expected.insert(target).unwrap();
            } else {
                let was_masked = words[me].contains(me);
                let masked = detect(&words, me, &set);
                prop_assert_eq!(masked, !was_masked);
                if masked {
                    expected.insert(target).unwrap();
                }
            }
        }
        for (r, w) in words.iter().enumerate() {
            prop_assert_eq!(w.load(), expected, "rank {}", r);
        }
        for r in expected.iter() {
            prop_assert!(words[r].contains(r));
        }
    }
}

/// Issue 64 item 3: on the host backend, a mask naming a rank outside a 4-rank group — 4,
/// 1024 or `usize::MAX` — is `Error::RankOutOfRange` before it reaches a `RankSet` (which
/// holds ranks up to `MAX_RANKS` only) and masks nothing; valid masks still work.
#[test]
fn masks_of_ranks_outside_the_group_are_typed_errors() {
    let ranks = HostWorld::create(RANKS, config()).unwrap();
    for rank in [4, 1024, usize::MAX] {
        assert_eq!(
            RankSet::from_ranks([rank], ranks[0].num_ranks()),
            Err(Error::RankOutOfRange { op: "RankSet::from_ranks".into(), rank, limit: RANKS })
        );
    }
    let mut set = RankSet::new();
    assert_eq!(
        set.insert(usize::MAX),
        Err(Error::RankOutOfRange { op: "RankSet::insert".into(), rank: usize::MAX, limit: 1024 })
    );
    set.insert(4).unwrap();
    assert_eq!(
        ranks[0].mask_ranks(&set),
        Err(Error::RankOutOfRange { op: "mask_ranks".into(), rank: 4, limit: RANKS })
    );
    assert!(ranks.iter().all(|r| r.masked_ranks().ranks.is_empty()));
    ranks[0].mask_ranks(&RankSet::from_ranks([1, 2], RANKS).unwrap()).unwrap();
    assert!(ranks.iter().all(|r| r.masked_ranks().ranks.to_vec() == [1, 2]));
}

//! Elastic rejoin on the host backend ([`epflow_core::mask`], "Rejoining"): a rank's thread ends
//! (its `HostRank` dropped, as a process dies), the survivors mask it and serve on, a
//! replacement made through the world's rendezvous joins their meeting, and the whole group is
//! bit-exact with the reference again: 100 times in a row, a different rank each time, with the
//! process's memory flat. Plus the refusals (typed, nothing changed) and the meetings that a
//! participant misses (typed timeouts, no poison, no hang).

use std::thread;
use std::time::{Duration, Instant};

use epflow_core::backend::Backend;
use epflow_core::host::{HostRank, HostWorld};
use epflow_core::mask::RankSet;
use epflow_core::{Error, GroupConfig, RejoinRefusal};

mod common;
use common::{EXPERTS, HIDDEN, MAX_TOKENS, RANKS, config, round};

/// The tests of this file one at a time: each keeps 4 rank threads busy, and on a 2-core machine
/// two at once could hold a live rank past the group's 1 s timeout (its peers would mask it),
/// and would share the process's resident memory, which the 100-cycle test watches.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner())
}

/// How long an admission waits for its participants here.
const MEETING: Duration = Duration::from_secs(10);

fn set(ranks: &[usize]) -> RankSet {
    RankSet::from_ranks(ranks.iter().copied(), RANKS).unwrap()
}

/// Resident memory of this process, in bytes (Linux; 0 elsewhere).
fn resident_bytes() -> usize {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let kb = status.lines().find_map(|l| l.strip_prefix("VmRSS:")).and_then(|v| v.split_whitespace().next());
    kb.and_then(|v| v.parse::<usize>().ok()).map_or(0, |kb| kb * 1024)
}

/// The admission of `replacement` on `survivors` (each admits it, it rejoins, all at once),
/// then `then` on every one of them; the results in the survivors' order, the replacement's
/// last.
fn admit_all<R: Send>(survivors: &[HostRank], replacement: &HostRank, then: impl Fn(&HostRank) -> R + Sync) -> Vec<R> {
    let joining = set(&[replacement.rank()]);
    thread::scope(|s| {
        let hs: Vec<_> = survivors
            .iter()
            .chain([replacement])
            .map(|rank| {
                let (joining, then) = (&joining, &then);
                s.spawn(move || {
                    if std::ptr::eq(rank, replacement) {
                        rank.rejoin(MEETING).unwrap();
                    } else {
                        rank.admit(joining, MEETING).unwrap();
                    }
                    then(rank)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// One kill-and-rejoin cycle: every rank serves a full round (checked); `victim`'s thread ends;
/// a survivor masks it; the survivors serve a round without it (checked against the reference
/// without its experts); a replacement made through the rendezvous rejoins while the survivors
/// admit it; every rank serves a full round again (checked bit-exact).
fn cycle(ranks: Vec<HostRank>, victim: usize, i: u64) -> Vec<HostRank> {
    let none = RankSet::new();
    let gone = set(&[victim]);
    let rendezvous = ranks[0].rendezvous();
    // A full round; the victim's thread then ends, dropping its rank.
    let survivors: Vec<HostRank> = thread::scope(|s| {
        let hs: Vec<_> = ranks
            .into_iter()
            .map(|rank| {
                let none = &none;
                s.spawn(move || {
                    round(&rank, 3 * i, none);
                    (rank.rank() != victim).then_some(rank)
                })
            })
            .collect();
        hs.into_iter().filter_map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(survivors.len(), RANKS - 1);
    // The server learns the process is gone (an exit, a health check) and masks it.
    survivors[0].mask_ranks(&gone).unwrap();
    let replacement = rendezvous.replace(victim, &config()).unwrap();
    let mut all: Vec<HostRank> = thread::scope(|s| {
        let mut hs: Vec<_> = survivors
            .into_iter()
            .map(|rank| {
                let (gone, none) = (&gone, &none);
                s.spawn(move || {
                    round(&rank, 3 * i + 1, gone);
                    rank.admit(gone, MEETING).unwrap();
                    round(&rank, 3 * i + 2, none);
                    rank
                })
            })
            .collect();
        let none = &none;
        hs.push(s.spawn(move || {
            replacement.rejoin(MEETING).unwrap();
            round(&replacement, 3 * i + 2, none);
            replacement
        }));
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    all.sort_by_key(HostRank::rank);
    for r in &all {
        assert!(!r.is_poisoned());
        assert!(r.masked_ranks().ranks.is_empty(), "rank {} still masks {:?}", r.rank(), r.masked_ranks().ranks);
    }
    all
}

#[test]
fn a_dead_rank_is_replaced_100_times_and_every_full_round_is_bit_exact() {
    let _serial = one_at_a_time();
    const CYCLES: u64 = 100;
    let start = Instant::now();
    let mut ranks = HostWorld::create(RANKS, config()).unwrap();
    let mut warm = 0;
    for i in 0..CYCLES {
        ranks = cycle(ranks, (i as usize * 3 + 1) % RANKS, i);
        if i == 9 {
            warm = resident_bytes();
        }
    }
    let grown = resident_bytes().saturating_sub(warm);
    // Not a memory claim: a bound a leak of one rank per cycle (its buffers, its cells' messages)
    // would pass long before cycle 100.
    assert!(grown < 16 << 20, "resident memory grew by {grown} B over {} cycles", CYCLES - 10);
    let epochs: Vec<u64> = ranks.iter().map(|r| r.masked_ranks().epoch).collect();
    assert!(epochs.iter().all(|&e| e == CYCLES), "every rank took part in every admission: {epochs:?}");
    eprintln!(
        "ok: {CYCLES} kill-and-rejoin cycles on {RANKS} ranks in {:.1} s, resident memory +{} KiB after cycle 10",
        start.elapsed().as_secs_f64(),
        grown >> 10
    );
}

#[test]
fn replacements_are_refused_with_typed_errors_and_nothing_changes() {
    let _serial = one_at_a_time();
    let mut ranks = HostWorld::create(RANKS, config()).unwrap();
    let rv = ranks[0].rendezvous();
    let refused = |r: Result<HostRank, Error>| match r {
        Err(Error::RejoinRefused { why, .. }) => why,
        other => panic!("expected RejoinRefused, got {:?}", other.map(|r| r.rank())),
    };
    // Rank 2 is alive.
    assert_eq!(refused(rv.replace(2, &config())), RejoinRefusal::StillAlive);
    assert!(matches!(rv.replace(4, &config()), Err(Error::RankOutOfRange { rank: 4, .. })));
    // Rank 2 died, but nobody masked it.
    drop(ranks.remove(2));
    assert_eq!(refused(rv.replace(2, &config())), RejoinRefusal::NotMasked);
    ranks[0].mask_ranks(&set(&[2])).unwrap();
    // Another config.
    let other = config().with_timeout(Duration::from_secs(3));
    assert!(matches!(refused(rv.replace(2, &other)), RejoinRefusal::ConfigMismatch(_)));
    // Two replacements for one rank.
    let first = rv.replace(2, &config()).unwrap();
    assert_eq!(refused(rv.replace(2, &config())), RejoinRefusal::AlreadyJoining);
    // Before it joined, its operations are refused; a rank that is no replacement cannot rejoin;
    // a survivor cannot admit a rank that is not masked, nor itself.
    assert!(first.masked_ranks().ranks.contains(2));
    let (sc, _) = common::scenario(0);
    let h = first.create_handle(&sc.topk_idx(2)).unwrap();
    let x = sc.tokens(2);
    let d = first.dispatch(&h, epflow_core::ops::DispatchInputs::new(&x), &Default::default());
    assert!(matches!(d, Err(Error::RankMasked { rank: 2, .. })), "{:?}", d.map(|_| ()));
    assert!(matches!(ranks[0].rejoin(MEETING), Err(Error::Unsupported(_))));
    assert!(matches!(
        ranks[0].admit(&set(&[1]), MEETING),
        Err(Error::RejoinRefused { rank: 1, why: RejoinRefusal::NotMasked })
    ));
    assert!(matches!(ranks[0].admit(&set(&[0, 2]), MEETING), Err(Error::Unsupported(_))));
    // The first replacement goes away: another may be made.
    drop(first);
    let second = rv.replace(2, &config()).unwrap();
    assert_eq!(second.rank(), 2);
    assert!(ranks.iter().all(|r| !r.is_poisoned() && r.masked_ranks().ranks == set(&[2])));
    // Without rank masking a rank can neither be masked nor replaced.
    let plain = HostWorld::create(2, GroupConfig::low_latency(EXPERTS, MAX_TOKENS, HIDDEN)).unwrap();
    let prv = plain[0].rendezvous();
    drop(plain);
    let r = prv.replace(1, &GroupConfig::low_latency(EXPERTS, MAX_TOKENS, HIDDEN));
    assert!(matches!(r, Err(Error::RejoinRefused { rank: 1, why: RejoinRefusal::MaskingOff })));
}

/// A replacement that dies before its meeting: the survivors' admission times out naming it,
/// the group is not poisoned, the rank stays masked and the survivors serve on without it; a
/// second replacement then joins.
#[test]
fn a_replacement_that_dies_half_way_leaves_the_survivors_serving() {
    let _serial = one_at_a_time();
    let mut ranks = HostWorld::create(RANKS, config()).unwrap();
    let rv = ranks[0].rendezvous();
    drop(ranks.remove(3));
    ranks[0].mask_ranks(&set(&[3])).unwrap();
    drop(rv.replace(3, &config()).unwrap());
    let short = Duration::from_millis(300);
    thread::scope(|s| {
        for rank in &ranks {
            s.spawn(move || {
                match rank.admit(&set(&[3]), short) {
                    Err(Error::Timeout { waiting_for, .. }) => assert!(waiting_for.contains("[3]"), "{waiting_for}"),
                    other => panic!("expected a timeout naming rank 3, got {other:?}"),
                }
                assert!(!rank.is_poisoned());
                assert!(rank.masked_ranks().ranks.contains(3));
                round(rank, 11, &set(&[3]));
            });
        }
    });
    let second = rv.replace(3, &config()).unwrap();
    let epochs = admit_all(&ranks, &second, |rank| {
        round(rank, 12, &RankSet::new());
        rank.masked_ranks().epoch
    });
    assert!(epochs.iter().all(|&e| e == epochs[0]), "{epochs:?}");
}

/// A survivor that dies during the meeting: the others and the replacement time out naming it
/// (no poison); once it is masked too, they meet again without it and serve, the replacement
/// included.
#[test]
fn a_survivor_that_dies_during_the_meeting_is_named_and_left_out_next_time() {
    let _serial = one_at_a_time();
    let mut ranks = HostWorld::create(RANKS, config()).unwrap();
    let rv = ranks[0].rendezvous();
    drop(ranks.remove(3));
    ranks[0].mask_ranks(&set(&[3])).unwrap();
    let replacement = rv.replace(3, &config()).unwrap();
    let short = Duration::from_millis(300);
    // Rank 2 never comes to the meeting (it dies).
    let dead = ranks.remove(2);
    thread::scope(|s| {
        for rank in ranks.iter().chain([&replacement]) {
            s.spawn(move || match rank.rank() {
                3 => assert!(matches!(rank.rejoin(short), Err(Error::Timeout { .. }))),
                _ => match rank.admit(&set(&[3]), short) {
                    Err(Error::Timeout { waiting_for, .. }) => assert!(waiting_for.contains('2'), "{waiting_for}"),
                    other => panic!("expected a timeout naming rank 2, got {other:?}"),
                },
            });
        }
    });
    drop(dead);
    ranks[0].mask_ranks(&set(&[2])).unwrap();
    assert!(ranks.iter().all(|r| !r.is_poisoned()));
    admit_all(&ranks, &replacement, |rank| {
        assert_eq!(rank.masked_ranks().ranks, set(&[2]));
        round(rank, 21, &set(&[2]));
    });
}

/// A dead rank whose staged operation was left to finish in the background (a `HostStaged`
/// dropped unfinished runs on until the group's timeout): its replacement is refused until that
/// operation has ended, so nothing of the old rank touches the reset cells.
#[test]
fn a_replacement_waits_for_the_old_ranks_detached_operations() {
    let _serial = one_at_a_time();
    let mut ranks = HostWorld::create(RANKS, config()).unwrap();
    let rv = ranks[0].rendezvous();
    let (sc, _) = common::scenario(5);
    let dead = ranks.remove(3);
    let h = dead.create_handle(&sc.topk_idx(3)).unwrap();
    let x = sc.tokens(3);
    // Its peers never take part: the dispatch waits for them in the background after the drop.
    drop(dead.dispatch_send(&h, epflow_core::ops::DispatchInputs::new(&x), &Default::default()).unwrap());
    drop(dead);
    match rv.replace(3, &config()) {
        Err(Error::RejoinRefused { why: RejoinRefusal::OldOperationsRunning, .. }) => {}
        other => panic!("expected OldOperationsRunning, got {:?}", other.map(|r| r.rank())),
    }
    // Once masked, the old operation ends (a masked rank waits for no one), and a replacement
    // can be made.
    ranks[0].mask_ranks(&set(&[3])).unwrap();
    let start = Instant::now();
    let replacement = loop {
        match rv.replace(3, &config()) {
            Ok(r) => break r,
            Err(Error::RejoinRefused { why: RejoinRefusal::OldOperationsRunning, .. })
                if start.elapsed() < 3 * common::TIMEOUT =>
            {
                thread::sleep(Duration::from_millis(5))
            }
            Err(e) => panic!("replace: {e}"),
        }
    };
    admit_all(&ranks, &replacement, |rank| {
        round(rank, 31, &RankSet::new());
    });
}

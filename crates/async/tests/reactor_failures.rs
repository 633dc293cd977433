//! The reactor survives what goes wrong on its thread: a probe that panics, a detached
//! operation that panics while it is finished, an abandoned staged operation whose peer
//! disagrees. The operation concerned fails (its group poisoned where the protocol is unknown),
//! every other wait goes on, and no wait outlives its deadline.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use epflow_async::Group;
use epflow_async::reactor::{WaitOutcome, reactor_stats, wait_for};
use epflow_core::ops::{CombineInputs, DispatchInputs};
use epflow_core::protocol::Channel;
use epflow_core::{Error, HostTensor, bf16};

use common::stub::{Stub, StubHooks};
use common::{checked, groups, ll_round, tokio_rt};

#[test]
fn a_panicking_probe_fails_its_wait_and_the_reactor_goes_on() {
    let before = reactor_stats();
    let rt = tokio_rt();
    let outcome = rt.block_on(wait_for(|| -> bool { panic!("probe bug") }, Duration::from_secs(5)));
    assert_eq!(outcome, WaitOutcome::Failed);
    let after = reactor_stats();
    assert!(after.panics > before.panics && after.alive, "{before:?} -> {after:?}");
    // Other waits are still served: a full round, checked against the reference.
    let c = checked(2, 3);
    rt.block_on(async {
        let gs = groups(2, common::config());
        futures::future::try_join_all(gs.iter().map(|g| ll_round(g, &c, true))).await.unwrap();
    });
    // A timeout too large for the clock is "practically never", not an overflow.
    let ready = rt.block_on(wait_for(|| true, Duration::MAX));
    assert_eq!(ready, WaitOutcome::Ready);
}

#[test]
fn a_dropped_staged_combine_whose_peer_pairs_differently_fails_the_peer_at_once() {
    // The reported case: two low-latency handles of different B and K, combined in swapped
    // order, rank 0 dropping its staged combine after the send half. The reactor finishes
    // rank 0's side; rank 1 gets a typed error long before the group's 2 s timeout.
    let config = common::config().with_timeout(Duration::from_secs(2));
    let rt = tokio_rt();
    let before = reactor_stats();
    rt.block_on(async {
        let gs = groups(2, config);
        let tasks = gs.into_iter().map(|g| {
            tokio::spawn(async move {
                let r = g.rank();
                let idx = |b: usize, k: usize| {
                    HostTensor::topk_idx(b, k, (0..b * k).map(|i| ((i * 5 + r) % common::E) as i64).collect())
                };
                let h1 = g.create_handle(&idx(3, 2)).await?;
                let h2 = g.create_handle(&idx(5, 4)).await?;
                let mut experts = Vec::new();
                for (h, b) in [(&h1, 3), (&h2, 5)] {
                    let out = g.dispatch(h, DispatchInputs::new(&common::tokens(b, 1.0))).await?;
                    experts.push(out.tokens().clone());
                }
                let w = [HostTensor::topk_weights(3, 2, vec![0.5; 6]), HostTensor::topk_weights(5, 4, vec![0.5; 20])];
                let (first, second) = if r == 0 { (0, 1) } else { (1, 0) };
                let hs = [&h1, &h2];
                let t = Instant::now();
                let staged = g
                    .combine(hs[first], CombineInputs::new(&experts[first]).with_weights(&w[first]))
                    .send_only()
                    .await?;
                if r == 0 {
                    drop(staged);
                } else {
                    let err = staged.await.unwrap_err();
                    assert!(matches!(err, Error::PeerMismatch { peer: 0, .. }), "{err}");
                    assert!(t.elapsed() < Duration::from_millis(500), "rank 1 waited {:?}", t.elapsed());
                }
                // The second combine mismatches too, and neither group is poisoned.
                let err = g
                    .combine(hs[second], CombineInputs::new(&experts[second]).with_weights(&w[second]))
                    .await
                    .unwrap_err();
                assert!(matches!(err, Error::PeerMismatch { .. }), "{err}");
                assert!(!g.is_poisoned());
                Ok::<_, Error>(())
            })
        });
        for t in tasks.collect::<Vec<_>>() {
            t.await.unwrap().unwrap();
        }
    });
    let after = reactor_stats();
    assert!(after.alive && after.panics == before.panics, "{before:?} -> {after:?}");
}

/// Operations that panic when finished: a stand-in for a backend bug.
#[derive(Debug)]
struct PanicOnFinish;

impl StubHooks for PanicOnFinish {
    fn finishing(&self, channel: Channel, seq: u64) {
        panic!("finish bug in {} #{seq}", channel.name())
    }
}

fn faulty(group_id: u64) -> Group<Stub<PanicOnFinish>> {
    Group::new(Stub::new(group_id, Arc::new(PanicOnFinish)))
}

#[test]
fn a_panic_while_finishing_fails_the_operation_and_poisons_only_its_group() {
    let rt = tokio_rt();
    let x = HostTensor::tokens(1, 8, vec![bf16::ONE; 8]);
    let idx = HostTensor::topk_idx(1, 1, vec![0]);
    // Awaited: the caller gets Error::Internal, not an unwinding task.
    let g = faulty(901);
    let h = rt.block_on(g.create_handle(&idx)).unwrap();
    let err = rt.block_on(g.dispatch(&h, DispatchInputs::new(&x))).unwrap_err();
    assert!(matches!(&err, Error::Internal { message, .. } if message.contains("finish bug")), "{err}");
    assert!(g.is_poisoned());
    // Dropped before it ran: the reactor finishes it, catches the panic, poisons that group only.
    let before = reactor_stats();
    let g = faulty(902);
    drop(g.dispatch(&h, DispatchInputs::new(&x)));
    let t = Instant::now();
    while !g.is_poisoned() && t.elapsed() < Duration::from_secs(2) {
        std::thread::sleep(Duration::from_millis(1));
    }
    assert!(g.is_poisoned(), "the abandoned operation's panic went unreported");
    let after = reactor_stats();
    assert!(after.alive && after.panics > before.panics, "{before:?} -> {after:?}");
    // A healthy group on the same reactor still works.
    let c = checked(2, 4);
    rt.block_on(async {
        let gs = groups(2, common::config());
        futures::future::try_join_all(gs.iter().map(|g| ll_round(g, &c, false))).await.unwrap();
    });
}

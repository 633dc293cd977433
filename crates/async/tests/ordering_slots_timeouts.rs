//! Per-rank order across tasks, waiting for buffer sets, timeouts and poisoning.

mod common;

use std::sync::Arc;
use std::task::Context;
use std::time::{Duration, Instant};

use common::{H, assert_dispatch, checked, groups, on_tokio_ranks, tokio_rt};
use epflow_async::Group;
use epflow_core::host::HostRank;
use epflow_core::ops::DispatchInputs;
use epflow_core::{Error, GroupConfig};
use futures::FutureExt;

/// Operations created in one order and awaited from different tasks in another keep the
/// creation order: each result matches its own scenario.
#[test]
fn ops_created_in_order_complete_correctly_from_other_tasks() {
    let cs: Arc<Vec<_>> = Arc::new((0..6).map(|i| checked(4, 100 + i)).collect());
    on_tokio_ranks(4, common::config(), cs, |g, cs| async move {
        let r = g.rank();
        for pair in cs.chunks(2) {
            let (a, b) = (&pair[0], &pair[1]);
            let (ha, hb) =
                (g.create_handle(&a.sc.topk_idx(r)).await.unwrap(), g.create_handle(&b.sc.topk_idx(r)).await.unwrap());
            let (xa, xb) = (a.sc.tokens(r), b.sc.tokens(r));
            // Created A then B: A is dispatch #n, B #n+1 on every rank.
            let fa = g.dispatch(&ha, DispatchInputs::new(&xa));
            let fb = g.dispatch(&hb, DispatchInputs::new(&xb));
            // Await B first, on another task, and A afterwards here.
            let tb = tokio::spawn(fb);
            tokio::time::sleep(Duration::from_millis(1)).await;
            let oa = fa.await.unwrap();
            let ob = tb.await.unwrap().unwrap();
            assert_dispatch(a, r, 4, &oa);
            assert_dispatch(b, r, 4, &ob);
        }
    });
}

/// More staged dispatches than buffer sets: the extra one waits (it is provably pending while
/// the outputs holding its set are alive), then completes correctly once they are dropped.
#[test]
fn extra_op_waits_for_a_free_buffer_set() {
    let cs: Arc<Vec<_>> = Arc::new((0..3).map(|i| checked(4, 200 + i)).collect());
    on_tokio_ranks(4, common::config(), cs, |g, cs| async move {
        let r = g.rank();
        let mut hs = Vec::new();
        for c in cs.iter() {
            hs.push(g.create_handle(&c.sc.topk_idx(r)).await.unwrap());
        }
        let xs: Vec<_> = cs.iter().map(|c| c.sc.tokens(r)).collect();
        let s0 = g.dispatch(&hs[0], DispatchInputs::new(&xs[0])).send_only().await.unwrap();
        let s1 = g.dispatch(&hs[1], DispatchInputs::new(&xs[1])).send_only().await.unwrap();
        let o0 = s0.await.unwrap();
        let o1 = s1.await.unwrap();
        let mut third = g.dispatch(&hs[2], DispatchInputs::new(&xs[2])).send_only();
        let waker = futures::task::noop_waker();
        for _ in 0..3 {
            assert!(third.poll_unpin(&mut Context::from_waker(&waker)).is_pending(), "set 0 is still held by o0");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert_dispatch(&cs[0], r, 4, &o0);
        drop(o0);
        let freed = Instant::now();
        let o2 = third.await.unwrap().await.unwrap();
        // Liveness, not speed: the freed set and the peers' data must wake the op, long
        // before its deadline (a stale wait used to sleep until it).
        let took = freed.elapsed();
        assert!(took < common::config().timeout / 2, "rank {r}: third op took {took:?} after its set was freed");
        assert_dispatch(&cs[1], r, 4, &o1);
        assert_dispatch(&cs[2], r, 4, &o2);
    });
}

/// One rank never calls: the others fail with a timeout within the bound, then fast with
/// "group poisoned" saying why.
#[test]
fn absent_rank_times_out_then_poisoned() {
    let timeout = Duration::from_millis(250);
    let c = checked(4, 300);
    let gs: Vec<Group<HostRank>> = groups(4, common::config().with_timeout(timeout));
    tokio_rt().block_on(async {
        let waits = gs.iter().take(3).map(|g| async {
            let r = g.rank();
            let h = g.create_handle(&c.sc.topk_idx(r)).await.unwrap();
            let x = c.sc.tokens(r);
            let start = Instant::now();
            let err = g.dispatch(&h, DispatchInputs::new(&x)).await.unwrap_err();
            let took = start.elapsed();
            assert!(matches!(&err, Error::Timeout { waiting_for, .. } if waiting_for.contains("[3]")), "{err}");
            assert!(took >= timeout && took < timeout + Duration::from_millis(400), "{took:?}");
            let start = Instant::now();
            let again = g.dispatch(&h, DispatchInputs::new(&x)).await.unwrap_err();
            assert!(start.elapsed() < Duration::from_millis(50));
            assert!(matches!(&again, Error::Poisoned { reason } if reason.contains("timed out")), "{again}");
            assert!(g.is_poisoned());
        });
        futures::future::join_all(waits).await;
    });
}

/// A high-throughput group refuses staged execution with a typed error.
#[test]
fn high_throughput_refuses_send_only() {
    let gs = groups(1, GroupConfig::high_throughput(4, H));
    let idx = epflow_core::HostTensor::topk_idx(1, 1, vec![0]);
    let out = futures::executor::block_on(async {
        let h = gs[0].create_handle(&idx).await.unwrap();
        let x = common::tokens(1, 1.0);
        match gs[0].dispatch(&h, DispatchInputs::new(&x)).send_only().await {
            Ok(_) => panic!("staged HT accepted"),
            Err(e) => e,
        }
    });
    assert!(matches!(out, Error::Validation(_)), "{out}");
}

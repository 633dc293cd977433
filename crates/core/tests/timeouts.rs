//! A rank that never joins a collective makes the others fail with a timeout error within the
//! configured bound, and the group is poisoned afterwards. Nothing hangs.

use std::time::{Duration, Instant};

use epflow_core::host::HostWorld;
use epflow_core::ops::{DispatchInputs, DispatchOptions};
use epflow_core::scenario::Scenario;
use epflow_core::workload::RoutingKind;
use epflow_core::{Error, GroupConfig};

#[test]
fn absent_rank_times_out_then_group_is_poisoned() {
    let timeout = Duration::from_millis(300);
    let config = GroupConfig::low_latency(16, 8, 128).with_timeout(timeout);
    let sc = Scenario::generate(config.clone(), 4, &[8], 2, RoutingKind::Uniform, 0, 5);
    let results = HostWorld::run(4, config, |rank| {
        if rank.rank() == 3 {
            return None; // never joins
        }
        let handle = rank.create_handle(&sc.topk_idx(rank.rank())).unwrap();
        let x = sc.tokens(rank.rank());
        let start = Instant::now();
        let err = rank.dispatch(&handle, DispatchInputs::new(&x), &DispatchOptions::default()).unwrap_err();
        let took = start.elapsed();
        let again = rank.dispatch(&handle, DispatchInputs::new(&x), &DispatchOptions::default()).unwrap_err();
        Some((err, took, again))
    })
    .unwrap();
    for (rank, res) in results.into_iter().enumerate().take(3) {
        let (err, took, again) = res.unwrap();
        match &err {
            Error::Timeout { rank: r, waiting_for, after, .. } => {
                assert_eq!(*r, rank);
                assert!(waiting_for.contains("[3]"), "{waiting_for}");
                assert_eq!(*after, timeout);
            }
            other => panic!("rank {rank}: expected a timeout, got {other}"),
        }
        assert!(took >= timeout && took < timeout + Duration::from_millis(500), "rank {rank} took {took:?}");
        assert!(matches!(again, Error::Poisoned { ref reason } if reason.contains("timed out")), "{again}");
    }
}

#[test]
fn high_throughput_handle_creation_times_out_too() {
    let timeout = Duration::from_millis(200);
    let config = GroupConfig::high_throughput(8, 128).with_timeout(timeout);
    let sc = Scenario::generate(config.clone(), 2, &[4], 2, RoutingKind::Uniform, 0, 5);
    let results =
        HostWorld::run(2, config, |rank| (rank.rank() == 0).then(|| rank.create_handle(&sc.topk_idx(0)).unwrap_err()))
            .unwrap();
    assert!(matches!(results[0], Some(Error::Timeout { .. })), "{:?}", results[0]);
}

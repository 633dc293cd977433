//! With nothing pending the reactor parks: its polling loop stops turning. (Its own test binary,
//! so no other test's operations are pending in the process.)

mod common;

use std::time::Duration;

use common::{checked, groups, ll_round};

/// Rounds run at most until the reactor has decided a wait: an operation that is already done
/// when first polled never reaches it (seen on a loaded machine), which would leave nothing to
/// park after.
const MAX_ROUNDS: usize = 100;

#[test]
fn reactor_parks_after_work_is_done() {
    let c = checked(2, 5);
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let gs = groups(2, common::config());
    let mut done = epflow_async::reactor::reactor_stats();
    for _ in 0..MAX_ROUNDS {
        rt.block_on(async {
            futures::future::join_all(gs.iter().map(|g| ll_round(g, &c, true)))
                .await
                .into_iter()
                .collect::<Result<Vec<_>, _>>()
                .unwrap();
        });
        done = epflow_async::reactor::reactor_stats();
        if done.completed > 0 {
            break;
        }
    }
    assert!(done.completed > 0, "the reactor decided no waits in {MAX_ROUNDS} rounds: {done:?}");
    std::thread::sleep(Duration::from_millis(50));
    let a = epflow_async::reactor::reactor_stats();
    std::thread::sleep(Duration::from_millis(200));
    let b = epflow_async::reactor::reactor_stats();
    assert!(b.loops - a.loops <= 1, "the reactor kept polling with nothing pending: {a:?} -> {b:?}");
}

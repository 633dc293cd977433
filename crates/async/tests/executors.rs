//! The async API works under tokio's current-thread and multi-thread runtimes and under a plain
//! `futures::executor::block_on`, with results equal to the CPU reference.

mod common;

use common::{checked, groups, ll_round};

#[test]
fn tokio_current_thread_all_ranks_on_one_thread() {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let c = checked(4, 11);
    rt.block_on(async {
        let gs = groups(4, common::config());
        let rounds = gs.iter().map(|g| async {
            for staged in [false, true, true] {
                ll_round(g, &c, staged).await.unwrap()
            }
        });
        futures::future::join_all(rounds).await;
    });
}

#[test]
fn tokio_multi_thread_ranks_as_tasks() {
    let c = std::sync::Arc::new(checked(4, 12));
    common::on_tokio_ranks(4, common::config(), c, |g, c| async move {
        for staged in [true, false, true] {
            ll_round(&g, &c, staged).await.unwrap();
        }
    });
}

#[test]
fn futures_block_on_one_thread_per_rank() {
    let c = checked(4, 13);
    std::thread::scope(|s| {
        for g in groups(4, common::config()) {
            let c = &c;
            s.spawn(move || {
                futures::executor::block_on(async {
                    for staged in [true, false] {
                        ll_round(&g, c, staged).await.unwrap()
                    }
                })
            });
        }
    });
}

//! Dropping futures at every await point, at random, over thousands of iterations: the peers
//! get a result or a `PeerCancelled` error (never a hang), and every later operation is correct.

mod common;

use std::sync::Arc;
use std::task::Context;

use common::{Checked, H, M, checked, ll_round};
use epflow_async::Group;
use epflow_core::Error;
use epflow_core::host::HostRank;
use epflow_core::ops::{CombineInputs, DispatchInputs};
use epflow_core::scenario::ll_identity_expert_outputs;
use epflow_core::verify::{Tolerance, check_bf16};
use futures::FutureExt;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

const ITERATIONS: usize = 2000;

/// Where to drop the operation.
#[derive(Clone, Copy, Debug)]
enum Action {
    /// Drop the future without polling it.
    BeforePoll,
    /// Poll it once (it may or may not have sent), then drop it.
    AfterOnePoll,
    /// Run the send half, then drop the `Staged`.
    AfterSend,
    /// Run the send half, poll the complete half once, then drop it.
    MidComplete,
    /// Run it to the end.
    Complete,
}

fn pick(rng: &mut SmallRng) -> Action {
    match rng.random_range(0..8) {
        0 => Action::BeforePoll,
        1 => Action::AfterOnePoll,
        2 => Action::AfterSend,
        3 => Action::MidComplete,
        _ => Action::Complete,
    }
}

fn poll_once<F: std::future::Future + Unpin>(f: &mut F) -> bool {
    let waker = futures::task::noop_waker();
    f.poll_unpin(&mut Context::from_waker(&waker)).is_ready()
}

/// Runs `fut` (an `OpFuture`) up to `action`; returns its result if it ran to the end.
async fn act<T>(fut: epflow_async::OpFuture<HostRank, T>, action: Action) -> Option<Result<T, Error>> {
    match action {
        Action::BeforePoll => None,
        Action::AfterOnePoll => {
            let mut f = fut.send_only();
            let _ = poll_once(&mut f);
            None
        }
        Action::AfterSend => {
            let _staged = fut.send_only().await.ok()?;
            None
        }
        Action::MidComplete => {
            let mut staged = fut.send_only().await.ok()?;
            let _ = poll_once(&mut staged);
            None
        }
        Action::Complete => Some(match fut.send_only().await {
            Ok(staged) => staged.await,
            Err(e) => Err(e),
        }),
    }
}

fn ok_or_peer_cancelled<T>(r: Result<T, Error>) -> Option<T> {
    match r {
        Ok(v) => Some(v),
        Err(Error::PeerCancelled { .. }) => None,
        Err(e) => panic!("unexpected error after a peer's cancellation: {e}"),
    }
}

async fn rank_loop(g: Group<HostRank>, cs: Arc<Vec<Checked>>) {
    let r = g.rank();
    let mut rng = SmallRng::seed_from_u64(r as u64 * 7919 + 1);
    let rows = g.num_ranks() * M;
    let mut outcomes = [0usize; 3];
    for it in 0..ITERATIONS {
        let c = &cs[it % cs.len()];
        let handle = g.create_handle(&c.sc.topk_idx(r)).await.unwrap();
        let x = c.sc.tokens(r);

        // Dispatch with a random cancellation point on every rank.
        let action = pick(&mut rng);
        if let Some(res) = act(g.dispatch(&handle, DispatchInputs::new(&x)), action).await {
            match ok_or_peer_cancelled(res) {
                Some(out) => {
                    common::assert_dispatch(c, r, g.num_ranks(), &out);
                    outcomes[0] += 1;
                }
                None => outcomes[1] += 1,
            }
        }

        // A full dispatch, then combine with a random cancellation point.
        let out = g.dispatch(&handle, DispatchInputs::new(&x)).await.unwrap();
        let experts = ll_identity_expert_outputs(out.tokens().data(), None, out.counts().unwrap(), rows, H);
        drop(out);
        let w = c.sc.weights(r);
        let action = pick(&mut rng);
        if let Some(res) = act(g.combine(&handle, CombineInputs::new(&experts).with_weights(&w)), action).await {
            if let Some(y) = ok_or_peer_cancelled(res) {
                let rep = check_bf16("combine", &c.combine[r], y.tokens().as_bf16().unwrap(), Tolerance::OneUlp);
                assert!(rep.ok(), "iteration {it} rank {r}: {rep:?}");
                outcomes[2] += 1;
            }
        }

        // Everything after a cancellation is still correct.
        ll_round(&g, c, it % 2 == 0).await.unwrap();
    }
    assert!(outcomes[0] > 0 && outcomes[1] > 0, "rank {r}: both outcomes must occur: {outcomes:?}");
}

#[test]
fn random_drops_at_every_await_point_keep_later_ops_correct() {
    let cs: Arc<Vec<Checked>> = Arc::new((0..8).map(|i| checked(4, 900 + i)).collect());
    common::on_tokio_ranks(4, common::config(), cs, rank_loop);
}

//! Helpers shared by the async tests: one low-latency round through the async API, checked
//! against the CPU reference.
#![allow(dead_code)]

pub(crate) mod stub;

use epflow_async::Group;
use std::future::Future;
use std::sync::Arc;

use epflow_core::host::{HostDispatchOutput, HostRank, HostWorld};
use epflow_core::ops::{CombineInputs, DispatchInputs};
use epflow_core::reference::LlDispatchResult;
use epflow_core::scenario::{Scenario, ll_identity_expert_outputs};
use epflow_core::verify::{Tolerance, check_bf16, check_ll_dispatch};
use epflow_core::workload::RoutingKind;
use epflow_core::{GroupConfig, HostTensor, Result, bf16};

pub(crate) const H: usize = 128;
pub(crate) const E: usize = 16;
pub(crate) const K: usize = 4;
pub(crate) const M: usize = 8;

pub(crate) fn config() -> GroupConfig {
    GroupConfig::low_latency(E, M, H)
}

pub(crate) fn groups(num_ranks: usize, config: GroupConfig) -> Vec<Group<HostRank>> {
    HostWorld::create(num_ranks, config).unwrap().into_iter().map(Group::new).collect()
}

/// A scenario with its references.
pub(crate) struct Checked {
    pub sc: Scenario,
    pub dispatch: Vec<LlDispatchResult>,
    pub combine: Vec<Vec<bf16>>,
}

pub(crate) fn checked(num_ranks: usize, seed: u64) -> Checked {
    let sc = Scenario::generate(config(), num_ranks, &[M, 5, 0, 7], K, RoutingKind::Uniform, 3, seed);
    let dispatch = sc.ll_dispatch_reference().unwrap();
    let combine = sc.ll_combine_identity_reference(&dispatch).unwrap();
    Checked { sc, dispatch, combine }
}

/// One dispatch + identity experts + combine, staged or not; asserts both against the reference.
pub(crate) async fn ll_round(g: &Group<HostRank>, c: &Checked, staged: bool) -> Result<()> {
    let r = g.rank();
    let handle = g.create_handle(&c.sc.topk_idx(r)).await?;
    let x = c.sc.tokens(r);
    let out = if staged {
        g.dispatch(&handle, DispatchInputs::new(&x)).send_only().await?.await?
    } else {
        g.dispatch(&handle, DispatchInputs::new(&x)).await?
    };
    let rows = g.num_ranks() * M;
    assert_dispatch(c, r, g.num_ranks(), &out);
    let counts = out.counts().unwrap().to_vec();
    let experts = ll_identity_expert_outputs(out.tokens().data(), None, &counts, rows, H);
    drop(out);
    let w = c.sc.weights(r);
    let y = if staged {
        g.combine(&handle, CombineInputs::new(&experts).with_weights(&w)).send_only().await?.await?
    } else {
        g.combine(&handle, CombineInputs::new(&experts).with_weights(&w)).await?
    };
    let rep = check_bf16("combine", &c.combine[r], y.tokens().as_bf16().unwrap(), Tolerance::OneUlp);
    assert!(rep.ok(), "rank {r} combine: {rep:?}");
    Ok(())
}

/// `tokens` as a tensor of `rows` tokens.
pub(crate) fn tokens(rows: usize, fill: f32) -> HostTensor {
    HostTensor::tokens(rows, H, vec![bf16::from_f32(fill); rows * H])
}

/// A multi-thread tokio runtime with 4 workers, timers and I/O on.
pub(crate) fn tokio_rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(4).enable_all().build().unwrap()
}

/// Runs `f` for every rank of a fresh world of `num_ranks` ranks, each as a task of a
/// multi-thread tokio runtime, and waits for all of them (a panic in any fails the test).
pub(crate) fn on_tokio_ranks<D, F, Fut>(num_ranks: usize, config: GroupConfig, data: Arc<D>, f: F)
where
    D: Send + Sync + 'static,
    F: Fn(Group<HostRank>, Arc<D>) -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    tokio_rt().block_on(async {
        let tasks: Vec<_> =
            groups(num_ranks, config).into_iter().map(|g| tokio::spawn(f(g, Arc::clone(&data)))).collect();
        for t in tasks {
            t.await.unwrap();
        }
    });
}

/// Asserts that rank `r`'s dispatch outputs equal the reference of `c` bit for bit.
pub(crate) fn assert_dispatch(c: &Checked, r: usize, num_ranks: usize, out: &HostDispatchOutput) {
    let rep = check_ll_dispatch(&c.dispatch[r], H, num_ranks * M, out.tokens().data(), None, out.counts().unwrap());
    assert!(rep.ok(), "rank {r}: {rep:?}");
}

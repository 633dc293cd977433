//! The stream-ordered API on the host backend (which completes on the host, so the semantics
//! can be checked anywhere): `after`, `complete_on` / `complete_ordered` and their
//! `Completion`, buffer-set waits, cancellation, timeouts, the fast completion mode, and
//! `pipeline::run_on_streams` against `pipeline::run`.

mod common;

use std::sync::Arc;
use std::task::Context;
use std::time::{Duration, Instant};

use common::{H, M, assert_dispatch, checked, groups, on_tokio_ranks, tokio_rt};
use epflow_async::completion::wait_with;
use epflow_async::pipeline::{self, StepInput};
use epflow_async::reactor::WaitOutcome;
use epflow_async::{CompletionMode, Group};
use epflow_core::backend::StreamOrder;
use epflow_core::host::{HostCombineOutput, HostDispatchOutput, HostRank, HostStream};
use epflow_core::ops::{CombineInputs, DispatchInputs};
use epflow_core::scenario::{Scenario, ll_identity_expert_outputs};
use epflow_core::verify::{Tolerance, check_bf16};
use epflow_core::workload::RoutingKind;
use epflow_core::{Error, HostTensor};
use futures::FutureExt;

/// Dispatch and combine completed in stream order (both placements) give the reference outputs,
/// and their completions resolve to `Ok`.
#[test]
fn complete_on_matches_the_reference() {
    let cs: Arc<Vec<_>> = Arc::new((0..4).map(|i| checked(4, 700 + i)).collect());
    on_tokio_ranks(4, common::config(), cs, |g, cs| async move {
        let r = g.rank();
        for (i, c) in cs.iter().enumerate() {
            let order = if i % 2 == 0 { StreamOrder::OnStream } else { StreamOrder::Ordered };
            let h = g.create_handle(&c.sc.topk_idx(r)).await.unwrap();
            let x = c.sc.tokens(r);
            let staged = g.dispatch(&h, DispatchInputs::new(&x)).after(&HostStream).send_only().await.unwrap();
            let (out, done) = staged.complete_with(&HostStream, order).await.unwrap();
            assert_dispatch(c, r, 4, &out);
            let counts = out.counts().unwrap().to_vec();
            let experts = ll_identity_expert_outputs(out.tokens().data(), None, &counts, 4 * M, H);
            drop(out);
            let w = c.sc.weights(r);
            let staged = g.combine(&h, CombineInputs::new(&experts).with_weights(&w)).send_only().await.unwrap();
            let (y, done_y) = staged.complete_on(&HostStream).await.unwrap();
            let rep = check_bf16("combine", &c.combine[r], y.tokens().as_bf16().unwrap(), Tolerance::OneUlp);
            assert!(rep.ok(), "rank {r} round {i}: {rep:?}");
            done.await.unwrap();
            done_y.await.unwrap();
        }
    });
}

/// `Group::create_handle_on` on a backend without a device (the default `start_handle_on`):
/// the handle is built at once, its completion is done, and the round on it gives the reference
/// outputs; an invalid routing is refused at creation, as `create_handle` refuses it.
#[test]
fn create_handle_on_builds_at_once_without_a_device() {
    let cs: Arc<Vec<_>> = Arc::new((0..2).map(|i| checked(4, 900 + i)).collect());
    on_tokio_ranks(4, common::config(), cs, |g, cs| async move {
        let r = g.rank();
        let opts = epflow_core::ops::HandleOptions::default();
        for (i, c) in cs.iter().enumerate() {
            let (h, created) = g.create_handle_on(&c.sc.topk_idx(r), &opts, &HostStream).await.unwrap();
            created.await.unwrap();
            let x = c.sc.tokens(r);
            let (out, done) = g.dispatch(&h, DispatchInputs::new(&x)).complete_on(&HostStream).await.unwrap();
            assert_dispatch(c, r, 4, &out);
            let counts = out.counts().unwrap().to_vec();
            let experts = ll_identity_expert_outputs(out.tokens().data(), None, &counts, 4 * M, H);
            drop(out);
            let w = c.sc.weights(r);
            let (y, done_y) =
                g.combine(&h, CombineInputs::new(&experts).with_weights(&w)).complete_on(&HostStream).await.unwrap();
            let rep = check_bf16("combine", &c.combine[r], y.tokens().as_bf16().unwrap(), Tolerance::OneUlp);
            assert!(rep.ok(), "rank {r} round {i}: {rep:?}");
            done.await.unwrap();
            done_y.await.unwrap();
        }
        let mut bad = cs[0].sc.topk_idx(r);
        match bad.data_mut() {
            epflow_core::HostData::I64(v) if !v.is_empty() => v[0] = -3,
            _ => return, // a rank without tokens has no entry to spoil
        }
        let err = g.create_handle_on(&bad, &opts, &HostStream).await.unwrap_err();
        assert_eq!(err, g.create_handle(&bad).await.unwrap_err());
        assert!(matches!(err, Error::Validation(_)), "{err}");
    });
}

/// Stream-ordered outputs hold their buffer set like awaited ones: with two sets, a third
/// dispatch waits until the first outputs are dropped, then completes correctly.
#[test]
fn stream_ordered_outputs_hold_their_buffer_set() {
    let cs: Arc<Vec<_>> = Arc::new((0..3).map(|i| checked(4, 800 + i)).collect());
    on_tokio_ranks(4, common::config(), cs, |g, cs| async move {
        let r = g.rank();
        let mut hs = Vec::new();
        for c in cs.iter() {
            hs.push(g.create_handle(&c.sc.topk_idx(r)).await.unwrap());
        }
        let xs: Vec<HostTensor> = cs.iter().map(|c| c.sc.tokens(r)).collect();
        let s0 = g.dispatch(&hs[0], DispatchInputs::new(&xs[0])).send_only().await.unwrap();
        let s1 = g.dispatch(&hs[1], DispatchInputs::new(&xs[1])).send_only().await.unwrap();
        let (o0, _) = s0.complete_on(&HostStream).await.unwrap();
        let (o1, _) = s1.complete_ordered(&HostStream).await.unwrap();
        let mut third = g.dispatch(&hs[2], DispatchInputs::new(&xs[2])).send_only();
        let waker = futures::task::noop_waker();
        for _ in 0..3 {
            assert!(third.poll_unpin(&mut Context::from_waker(&waker)).is_pending(), "set 0 is held by o0");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert_dispatch(&cs[0], r, 4, &o0);
        drop(o0);
        let (o2, done) = third.await.unwrap().complete_on(&HostStream).await.unwrap();
        assert_dispatch(&cs[1], r, 4, &o1);
        assert_dispatch(&cs[2], r, 4, &o2);
        done.await.unwrap();
    });
}

/// An operation ordered after a stream but dropped before it was sent goes out as a
/// cancellation: the peers' stream-ordered completion fails with `PeerCancelled`, and the next
/// operation on every rank is correct.
#[test]
fn dropping_a_stream_ordered_op_before_its_send_cancels_it() {
    let cs: Arc<Vec<_>> = Arc::new(vec![checked(4, 900), checked(4, 901)]);
    on_tokio_ranks(4, common::config(), cs, |g, cs| async move {
        let r = g.rank();
        let h = g.create_handle(&cs[0].sc.topk_idx(r)).await.unwrap();
        let x = cs[0].sc.tokens(r);
        let op = g.dispatch(&h, DispatchInputs::new(&x)).after(&HostStream);
        if r == 2 {
            drop(op);
        } else {
            let staged = op.send_only().await.unwrap();
            match staged.complete_on(&HostStream).await {
                Err(Error::PeerCancelled { peer: 2, .. }) => {}
                Err(e) => panic!("rank {r}: {e}"),
                Ok(_) => panic!("rank {r}: a cancelled collective produced outputs"),
            }
        }
        let h = g.create_handle(&cs[1].sc.topk_idx(r)).await.unwrap();
        let x = cs[1].sc.tokens(r);
        let (out, done) =
            g.dispatch(&h, DispatchInputs::new(&x)).send_only().await.unwrap().complete_on(&HostStream).await.unwrap();
        assert_dispatch(&cs[1], r, 4, &out);
        done.await.unwrap();
    });
}

/// Outputs dropped before anything read them release their set; the next operations are
/// correct.
#[test]
fn outputs_dropped_unread_release_their_set() {
    let cs: Arc<Vec<_>> = Arc::new((0..5).map(|i| checked(4, 950 + i)).collect());
    on_tokio_ranks(4, common::config(), cs, |g, cs| async move {
        let r = g.rank();
        for c in cs.iter() {
            let h = g.create_handle(&c.sc.topk_idx(r)).await.unwrap();
            let x = c.sc.tokens(r);
            let staged = g.dispatch(&h, DispatchInputs::new(&x)).send_only().await.unwrap();
            let (out, done) = staged.complete_on(&HostStream).await.unwrap();
            drop(out);
            drop(done);
        }
        let c = &cs[4];
        let h = g.create_handle(&c.sc.topk_idx(r)).await.unwrap();
        let x = c.sc.tokens(r);
        let out = g.dispatch(&h, DispatchInputs::new(&x)).await.unwrap();
        assert_dispatch(c, r, 4, &out);
    });
}

/// A rank that never takes part: stream-ordered completion times out like the awaited form,
/// then the group is poisoned.
#[test]
fn stream_ordered_completion_times_out() {
    let timeout = Duration::from_millis(250);
    let c = checked(4, 990);
    let gs: Vec<Group<HostRank>> = groups(4, common::config().with_timeout(timeout));
    tokio_rt().block_on(async {
        let waits = gs.iter().take(3).map(|g| async {
            let r = g.rank();
            let h = g.create_handle(&c.sc.topk_idx(r)).await.unwrap();
            let x = c.sc.tokens(r);
            let start = Instant::now();
            let staged = g.dispatch(&h, DispatchInputs::new(&x)).send_only().await.unwrap();
            let err = staged.complete_on(&HostStream).await.expect_err("a timeout");
            let took = start.elapsed();
            assert!(matches!(&err, Error::Timeout { .. }), "{err}");
            assert!(took >= timeout && took < timeout + Duration::from_millis(400), "{took:?}");
            assert!(g.is_poisoned());
        });
        futures::future::join_all(waits).await;
    });
}

/// Fast mode: the same results, and `wait_with` sees a condition without the reactor while
/// spinning, times out when it never holds.
#[test]
fn fast_completion_mode_gives_the_same_results() {
    let cs: Arc<Vec<_>> = Arc::new((0..3).map(|i| checked(4, 1000 + i)).collect());
    let gs: Vec<Group<HostRank>> = groups(4, common::config())
        .into_iter()
        .map(|g| g.with_completion_mode(CompletionMode::spin_for(Duration::from_micros(200))))
        .collect();
    assert!(matches!(gs[0].completion_mode(), CompletionMode::Spin { .. }));
    tokio_rt().block_on(async {
        let work = gs.iter().map(|g| {
            let cs = Arc::clone(&cs);
            async move {
                for c in cs.iter() {
                    common::ll_round(g, c, true).await.unwrap();
                }
            }
        });
        futures::future::join_all(work).await;
        let spin = CompletionMode::spin_for(Duration::from_millis(50));
        let t = Instant::now();
        assert_eq!(
            wait_with(spin, move || t.elapsed() > Duration::from_micros(300), Duration::from_secs(1)).await,
            WaitOutcome::Ready
        );
        let never = wait_with(spin, || false, Duration::from_millis(80)).await;
        assert_eq!(never, WaitOutcome::TimedOut);
    });
}

/// `pipeline::run_on_streams` on host "streams" gives the same outputs as `pipeline::run` and
/// the serial run, with 1, 2 and 3 micro-batches in flight.
#[test]
fn run_on_streams_equals_run_and_serial() {
    pipelines_agree(common::config(), |depth| common::config().with_buffer_sets(depth.max(2)));
}

/// The same for a high-throughput group (prefill), whose operations have no send-only form: the
/// pipelines run each whole when they issue it.
#[test]
fn high_throughput_pipelines_equal_serial() {
    use epflow_core::{GroupConfig, MaxTokens};
    let ht = || GroupConfig::high_throughput(common::E, H).with_max_tokens(MaxTokens::Fixed(M));
    pipelines_agree(ht(), |depth| ht().with_buffer_sets(depth.max(2)));
}

/// Runs `4 * depth` chained steps of identity experts (serial, `run`, `run_on_streams`) on 4
/// ranks of `config_for(depth)`, routing drawn from `routing`, and asserts the last outputs of
/// every micro-batch are bit-identical across the three.
fn pipelines_agree(routing: epflow_core::GroupConfig, config_for: impl Fn(usize) -> epflow_core::GroupConfig) {
    for depth in [1usize, 2, 3] {
        let steps = 4 * depth;
        let mut results = Vec::new();
        for mode in 0..3 {
            let gs = groups(4, config_for(depth));
            let routing = &routing;
            // One thread per rank: a high-throughput handle is a collective, and `input` waits for it.
            let outs: Vec<Vec<u16>> = std::thread::scope(|scope| {
                let work = gs.iter().map(|g| {
                    scope.spawn(move || {
                        tokio_rt().block_on(async move {
                            let r = g.rank();
                            let input = |i: usize, prev: Option<HostCombineOutput>| {
                                let sc = Scenario::generate(
                                    routing.clone(),
                                    4,
                                    &[M],
                                    common::K,
                                    RoutingKind::Uniform,
                                    2,
                                    2000 + i as u64,
                                );
                                let handle = futures::executor::block_on(g.create_handle(&sc.topk_idx(r)))?;
                                let tokens = match prev {
                                    Some(p) => p.tokens().clone(),
                                    None => sc.tokens(r),
                                };
                                // Bounded activations: weights of 1/K.
                                let w = HostTensor::topk_weights(M, common::K, vec![0.25; M * common::K]);
                                Ok(StepInput { handle, tokens, weights: w, dispatch_options: Default::default() })
                            };
                            let mut last: Vec<u16> = Vec::new();
                            let sink = |_, out: HostCombineOutput| {
                                last.extend(out.tokens().as_bf16().unwrap().iter().map(|v| v.to_bits()))
                            };
                            let expert = async |_, d: &HostDispatchOutput| Ok(d.tokens().clone());
                            match mode {
                                0 => pipeline::run_serial(g, steps, depth, input, expert, sink).await.unwrap(),
                                1 => pipeline::run(g, steps, depth, input, expert, sink).await.unwrap(),
                                _ => {
                                    let lanes = vec![HostStream; depth];
                                    let expert =
                                        async |_, _: &HostStream, d: &HostDispatchOutput| Ok(d.tokens().clone());
                                    pipeline::run_on_streams(
                                        g,
                                        steps,
                                        &lanes,
                                        StreamOrder::OnStream,
                                        input,
                                        expert,
                                        sink,
                                    )
                                    .await
                                    .unwrap()
                                }
                            };
                            last
                        })
                    })
                });
                work.collect::<Vec<_>>().into_iter().map(|h| h.join().expect("rank thread")).collect()
            });
            results.push(outs);
        }
        assert!(results[0].iter().all(|r| !r.is_empty()), "depth {depth}: no outputs");
        assert_eq!(results[0], results[1], "depth {depth}: pipelined differs from serial");
        assert_eq!(results[0], results[2], "depth {depth}: stream-ordered differs from serial");
    }
}

/// High-throughput in stream order: a `RecvRows::Bound` handle from `HandleFuture::complete_on`
/// (with `after`), then the forward and backward pairs through `OpFuture::complete_on`, all
/// enqueued before any completion is awaited; the combined tokens and the first `N` rows of the
/// backward dispatch match the reference, and `N` is known once the creation's completion
/// resolved.
#[test]
fn high_throughput_training_step_in_stream_order() {
    use epflow_core::handle::RoutingHandle;
    use epflow_core::ops::{CombineOptions, DispatchOptions, HandleOptions, Pass, RecvRows};
    use epflow_core::{GroupConfig, MaxTokens, reference};
    let (ranks, m) = (4, 24);
    let config = GroupConfig::high_throughput(32, H).with_max_tokens(MaxTokens::Fixed(m));
    let scs: Arc<Vec<Scenario>> = Arc::new(
        (0..3)
            .map(|i| Scenario::generate(config.clone(), ranks, &[m, 17, 0, 5], 4, RoutingKind::Uniform, 2, 900 + i))
            .collect(),
    );
    on_tokio_ranks(ranks, config, scs, |g, scs| async move {
        let r = g.rank();
        for (i, sc) in scs.iter().enumerate() {
            let refs = sc.ht_dispatch_reference().unwrap();
            let want = sc.ht_combine_identity_reference(&refs).unwrap();
            let routings = sc.routings().unwrap();
            let grads: Vec<&[epflow_core::bf16]> = sc.ranks.iter().map(|x| x.tokens.as_slice()).collect();
            let want_bwd = reference::ht_dispatch_backward(&sc.config, &routings, &grads);
            let opts = HandleOptions::default().with_recv_rows(RecvRows::Bound);
            let idx = sc.topk_idx(r);
            let (h, created) =
                g.create_handle_with(&idx, &opts).after(&HostStream).complete_on(&HostStream).await.unwrap();
            let rows = h.recv_rows().unwrap();
            assert_eq!(rows, ranks * m);
            let (x, w) = (sc.tokens(r), sc.weights(r));
            let (d, dd) =
                g.dispatch(&h, DispatchInputs::new(&x).with_weights(&w)).complete_on(&HostStream).await.unwrap();
            let (y, yd) = g.combine(&h, CombineInputs::new(d.tokens())).complete_on(&HostStream).await.unwrap();
            let bwd = DispatchOptions { pass: Pass::Backward, ..DispatchOptions::default() };
            let (gd, gdd) = g.dispatch_with(&h, DispatchInputs::new(&x), &bwd).complete_on(&HostStream).await.unwrap();
            let wg = HostTensor::topk_weights(rows, 4, vec![0.25; rows * 4]);
            let copts = CombineOptions { pass: Pass::Backward, ..Default::default() };
            let (_gy, gyd) = g
                .combine_with(&h, CombineInputs::new(gd.tokens()).with_weights(&wg), &copts)
                .complete_on(&HostStream)
                .await
                .unwrap();
            for done in [created, dd, yd, gdd, gyd] {
                done.await.unwrap();
            }
            let n = h.num_recv_tokens().unwrap();
            assert_eq!(n, refs[r].layout.num_rows(), "rank {r} round {i}");
            let rep = check_bf16("combine", &want[r], y.tokens().as_bf16().unwrap(), Tolerance::OneUlp);
            assert!(rep.ok(), "rank {r} round {i}: {rep:?}");
            let got = &gd.tokens().as_bf16().unwrap()[..n * H];
            let rep = check_bf16("backward dispatch", &want_bwd[r], got, Tolerance::Exact);
            assert!(rep.ok(), "rank {r} round {i}: {rep:?}");
        }
    });
}

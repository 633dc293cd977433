//! The async runtime driving the GPU backend: staged dispatch/combine futures on a tokio
//! runtime, two GPUs, results equal to the CPU reference. Skipped (loudly) without 2 GPUs.

use epflow::Group;
use epflow::core::ops::{CombineInputs, DispatchInputs};
use epflow::core::scenario::Scenario;
use epflow::core::verify::{Tolerance, check_bf16, check_ht_dispatch, check_ll_dispatch};
use epflow::core::workload::RoutingKind;
use epflow::core::{GroupConfig, HostTensor};
use epflow_kernels::{GpuRank, GpuWorld, Transport, driver};

/// Two GPU ranks as async groups and a 2-worker tokio runtime, or `None` (printing SKIPPED)
/// without 2 GPUs.
fn two_gpu_groups(
    config: &GroupConfig,
    test: &str,
    transport: &Transport,
) -> Option<(Vec<Group<GpuRank>>, tokio::runtime::Runtime)> {
    let n = driver::device_count();
    if n < 2 {
        eprintln!("SKIPPED {test}: needs 2 GPUs, this machine has {n}");
        return None;
    }
    let groups = GpuWorld::create_with(&[0, 1], config.clone(), transport.clone())
        .expect("GPU group")
        .into_iter()
        .map(Group::new)
        .collect();
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    Some((groups, rt))
}

#[test]
fn staged_futures_on_gpus_match_the_reference() {
    staged_futures(&Transport::Auto);
}

/// The same futures with every exchange over NCCL.
#[test]
fn staged_futures_over_nccl_match_the_reference() {
    staged_futures(&Transport::Nccl);
}

fn staged_futures(transport: &Transport) {
    let config = GroupConfig::low_latency(32, 64, 2048);
    let Some((groups, rt)) = two_gpu_groups(&config, &format!("staged_futures_on_gpus ({transport:?})"), transport)
    else {
        return;
    };
    rt.block_on(async {
        for round in 0..20u64 {
            let sc = Scenario::generate(config.clone(), 2, &[64, 41], 8, RoutingKind::Uniform, 5, 77 + round);
            let refs = sc.ll_dispatch_reference().unwrap();
            let want = sc.ll_combine_identity_reference(&refs).unwrap();
            let work = groups.iter().map(|g| {
                let (sc, refs, want) = (&sc, &refs, &want);
                async move {
                    let r = g.rank();
                    let b = g.backend();
                    let idx = b.upload(&sc.topk_idx(r)).unwrap();
                    let h = g.create_handle(&idx).await.unwrap();
                    let x = b.upload(&sc.tokens(r)).unwrap();
                    let staged = g.dispatch(&h, DispatchInputs::new(&x)).send_only().await.unwrap();
                    let out = staged.await.unwrap();
                    let host = out.to_host().unwrap();
                    let rep = check_ll_dispatch(
                        &refs[r],
                        2048,
                        2 * 64,
                        host.tokens.data(),
                        None,
                        host.counts.as_ref().unwrap().as_i32().unwrap(),
                    );
                    assert!(rep.ok(), "round {round} rank {r}: {rep:?}");
                    let w = b.upload(&sc.weights(r)).unwrap();
                    let y = g
                        .combine(&h, CombineInputs::new(out.tokens()).with_weights(&w))
                        .send_only()
                        .await
                        .unwrap()
                        .await
                        .unwrap();
                    let got = y.to_host().unwrap();
                    let rep = check_bf16("combine", &want[r], got.tokens.as_bf16().unwrap(), Tolerance::Exact);
                    assert!(rep.ok(), "round {round} rank {r}: {rep:?}");
                    let _ = HostTensor::topk_idx(0, 1, vec![]);
                }
            });
            futures::future::join_all(work).await;
        }
    });
}

/// High-throughput through the futures: the collective handle creation (count exchange) and
/// synchronous dispatch/combine, on 2 GPUs, equal to the reference; `send_only` is refused.
#[test]
fn high_throughput_futures_on_gpus_match_the_reference() {
    high_throughput_futures(&Transport::Auto);
}

/// The same over NCCL (count exchange, dispatch and combine all NCCL grouped send/recv).
#[test]
fn high_throughput_futures_over_nccl_match_the_reference() {
    high_throughput_futures(&Transport::Nccl);
}

fn high_throughput_futures(transport: &Transport) {
    let config = GroupConfig::high_throughput(32, 2048);
    let Some((groups, rt)) =
        two_gpu_groups(&config, &format!("high_throughput_futures_on_gpus ({transport:?})"), transport)
    else {
        return;
    };
    rt.block_on(async {
        for round in 0..20u64 {
            let sc = Scenario::generate(config.clone(), 2, &[300, 41], 8, RoutingKind::Skewed, 5, 91 + round);
            let refs = sc.ht_dispatch_reference().unwrap();
            let want = sc.ht_combine_identity_reference(&refs).unwrap();
            let work = groups.iter().map(|g| {
                let (sc, refs, want) = (&sc, &refs, &want);
                async move {
                    let r = g.rank();
                    let b = g.backend();
                    let idx = b.upload(&sc.topk_idx(r)).unwrap();
                    let h = g.create_handle(&idx).await.unwrap();
                    assert_eq!(h.num_recv_tokens(), Some(refs[r].layout.num_rows()));
                    let x = b.upload(&sc.tokens(r)).unwrap();
                    let w = b.upload(&sc.weights(r)).unwrap();
                    let staged = g.dispatch(&h, DispatchInputs::new(&x).with_weights(&w)).send_only().await;
                    assert!(staged.is_err(), "high-throughput has no staged form");
                    let out = g.dispatch(&h, DispatchInputs::new(&x).with_weights(&w)).await.unwrap();
                    let host = out.to_host().unwrap();
                    let rep = check_ht_dispatch(
                        &refs[r],
                        host.tokens.data(),
                        None,
                        host.topk_weights.as_ref().and_then(HostTensor::as_f32).unwrap(),
                        host.topk_idx.as_ref().and_then(HostTensor::as_i64).unwrap(),
                        host.counts.as_ref().and_then(HostTensor::as_i32).unwrap(),
                    );
                    assert!(rep.ok(), "round {round} rank {r}: {rep:?}");
                    let y = g.combine(&h, CombineInputs::new(out.tokens())).await.unwrap();
                    let got = y.to_host().unwrap();
                    let rep = check_bf16("combine", &want[r], got.tokens.as_bf16().unwrap(), Tolerance::Exact);
                    assert!(rep.ok(), "round {round} rank {r}: {rep:?}");
                }
            });
            futures::future::join_all(work).await;
        }
    });
}

/// NVIDIA's NCCL EP behind the same futures: staged dispatch (`send_only`) whose awaited half is
/// `ncclEpComplete`, then staged combine, on 2 GPUs. Dispatch rows are matched to the reference
/// by content (NCCL EP keeps arrival order inside an expert); counts must be equal and combine
/// within one BF16 ulp. Skipped (loudly) without 2 GPUs or without `libnccl_ep`.
#[test]
fn staged_futures_over_nccl_ep_match_the_reference() {
    let config = GroupConfig::low_latency(32, 64, 2048);
    on_nccl_ep_ranks(&config, "staged_futures_over_nccl_ep", |g| current_thread(nccl_ep_rounds(g, &config)));
}

/// High-throughput on NCCL EP (flat layout) behind the same futures, on 2 GPUs: the receive
/// count from handle creation, rows and their top-k entries matched to the reference by
/// content (NCCL EP writes the entries compactly), counts equal, combine within one BF16 ulp.
#[test]
fn high_throughput_futures_over_nccl_ep_match_the_reference() {
    let config = GroupConfig::high_throughput(32, 2048).with_max_tokens(epflow::core::MaxTokens::Fixed(300));
    on_nccl_ep_ranks(&config, "high_throughput_futures_over_nccl_ep", |g| {
        current_thread(nccl_ep_ht_rounds(g, &config))
    });
}

/// Runs `f` to completion on a `current_thread` runtime of this thread.
fn current_thread(f: impl std::future::Future<Output = ()>) {
    tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(f);
}

/// Creates an NCCL EP world on GPUs 0 and 1 and runs `rounds` for each rank on its own thread
/// (NCCL EP calls may block until every rank makes the same call). Skips loudly without 2 GPUs
/// or without the library.
fn on_nccl_ep_ranks(
    config: &GroupConfig,
    test: &str,
    rounds: impl Fn(&Group<epflow::runtime::nccl_ep::NcclEpRank>) + Sync,
) {
    use epflow::runtime::nccl_ep::NcclEpWorld;
    let n = driver::device_count();
    if n < 2 {
        eprintln!("SKIPPED {test}: needs 2 GPUs, this machine has {n}");
        return;
    }
    let ranks = match NcclEpWorld::create(&[0, 1], config.clone()) {
        Ok(r) => r,
        Err(epflow::core::Error::Unsupported(why)) if why.starts_with("NCCL EP:") => {
            eprintln!("SKIPPED {test}: {why}");
            return;
        }
        Err(e) => panic!("NCCL EP group: {e}"),
    };
    eprintln!("NCCL EP: {:?}", ranks[0].library());
    let groups: Vec<_> = ranks.into_iter().map(Group::new).collect();
    std::thread::scope(|scope| {
        for g in &groups {
            let rounds = &rounds;
            scope.spawn(move || rounds(g));
        }
    });
}

async fn nccl_ep_ht_rounds(g: &Group<epflow::runtime::nccl_ep::NcclEpRank>, config: &GroupConfig) {
    use epflow::core::verify::ht_rows_by_content;
    for round in 0..10u64 {
        let sc = Scenario::generate(config.clone(), 2, &[300, 41], 8, RoutingKind::Skewed, 5, 191 + round);
        let refs = sc.ht_dispatch_reference().unwrap();
        let want = sc.ht_combine_identity_reference(&refs).unwrap();
        let r = g.rank();
        let b = g.backend();
        let idx = b.upload(&sc.topk_idx(r)).unwrap();
        let h = g.create_handle(&idx).await.unwrap();
        assert_eq!(h.num_recv_tokens(), Some(refs[r].layout.num_rows()), "round {round} rank {r}");
        assert_eq!(h.recv_expert_counts(), Some(refs[r].layout.expert_counts()), "round {round} rank {r}");
        let x = b.upload(&sc.tokens(r)).unwrap();
        let w = b.upload(&sc.weights(r)).unwrap();
        let out = g.dispatch(&h, DispatchInputs::new(&x).with_weights(&w)).await.unwrap();
        let o = out.outputs();
        let down = |t: Option<&epflow_kernels::DeviceTensor>| t.unwrap().download(b.context()).unwrap();
        let (tokens, tw, ti) = (down(Some(&o.tokens)), down(o.topk_weights.as_ref()), down(o.topk_idx.as_ref()));
        let counts = down(o.counts.as_ref());
        let (t, tw, ti) =
            ht_rows_by_content(&refs[r], 2048, tokens.as_bf16().unwrap(), tw.as_f32().unwrap(), ti.as_i64().unwrap());
        let rep =
            check_ht_dispatch(&refs[r], &epflow::core::HostData::Bf16(t), None, &tw, &ti, counts.as_i32().unwrap());
        assert!(rep.ok(), "round {round} rank {r}: {rep:?}");
        let y = g.combine(&h, CombineInputs::new(out.tokens())).await.unwrap();
        let got = y.tokens().download(b.context()).unwrap();
        let rep = check_bf16("combine", &want[r], got.as_bf16().unwrap(), Tolerance::OneUlp);
        assert!(rep.ok(), "round {round} rank {r}: {rep:?}");
        eprintln!("ht round {round} rank {r}: dispatch and combine match (max |diff| {:e})", rep.max_abs_diff);
    }
}

async fn nccl_ep_rounds(g: &Group<epflow::runtime::nccl_ep::NcclEpRank>, config: &GroupConfig) {
    use epflow::core::verify::ll_rows_by_content;
    for round in 0..10u64 {
        let sc = Scenario::generate(config.clone(), 2, &[64, 41], 8, RoutingKind::Uniform, 5, 177 + round);
        let refs = sc.ll_dispatch_reference().unwrap();
        let want = sc.ll_combine_identity_reference(&refs).unwrap();
        let r = g.rank();
        let b = g.backend();
        let idx = b.upload(&sc.topk_idx(r)).unwrap();
        let h = g.create_handle(&idx).await.unwrap();
        let x = b.upload(&sc.tokens(r)).unwrap();
        let staged = g.dispatch(&h, DispatchInputs::new(&x)).send_only().await.unwrap();
        let out = staged.await.unwrap();
        let tokens = out.tokens().download(b.context()).unwrap();
        let counts = out.counts().unwrap().download(b.context()).unwrap();
        let arranged = ll_rows_by_content(&refs[r], 2 * 64, 2048, tokens.as_bf16().unwrap());
        let rep = check_ll_dispatch(
            &refs[r],
            2048,
            2 * 64,
            &epflow::core::HostData::Bf16(arranged),
            None,
            counts.as_i32().unwrap(),
        );
        assert!(rep.ok(), "round {round} rank {r}: {rep:?}");
        let w = b.upload(&sc.weights(r)).unwrap();
        let y =
            g.combine(&h, CombineInputs::new(out.tokens()).with_weights(&w)).send_only().await.unwrap().await.unwrap();
        let got = y.tokens().download(b.context()).unwrap();
        let rep = check_bf16("combine", &want[r], got.as_bf16().unwrap(), Tolerance::OneUlp);
        assert!(rep.ok(), "round {round} rank {r}: {rep:?}");
        eprintln!("round {round} rank {r}: dispatch and combine match (max |diff| {:e})", rep.max_abs_diff);
    }
}

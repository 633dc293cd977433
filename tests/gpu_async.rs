//! The async runtime driving the GPU backend: staged dispatch/combine futures on a tokio
//! runtime, two GPUs, results equal to the CPU reference. Skipped (loudly) without 2 GPUs.

use epflow::Group;
use epflow::core::handle::RoutingHandle;
use epflow::core::ops::{CombineInputs, DispatchInputs};
use epflow::core::scenario::Scenario;
use epflow::core::verify::{Tolerance, check_bf16, check_ht_dispatch, check_ll_dispatch};
use epflow::core::workload::RoutingKind;
use epflow::core::{GroupConfig, HostTensor};
use epflow_kernels::{GpuRank, GpuWorld, Transport, device_count};

/// Two GPU ranks as async groups and a 2-worker tokio runtime, or `None` (printing SKIPPED)
/// without 2 GPUs.
fn two_gpu_groups(
    config: &GroupConfig,
    test: &str,
    transport: &Transport,
) -> Option<(Vec<Group<GpuRank>>, tokio::runtime::Runtime)> {
    // `EPFLOW_TEST_DEVICES=0,0`: two ranks on one GPU (a functional check on a 1-GPU machine;
    // NCCL takes a GPU per rank, so the NCCL variants skip there).
    let devices: Vec<usize> = match std::env::var("EPFLOW_TEST_DEVICES") {
        Ok(list) => list.split(',').filter_map(|d| d.trim().parse().ok()).collect(),
        Err(_) => vec![0, 1],
    };
    let n = device_count();
    if devices.len() != 2 || n == 0 || devices.iter().any(|&d| d >= n) {
        eprintln!("SKIPPED {test}: needs 2 GPUs (or EPFLOW_TEST_DEVICES naming 2 ranks), this machine has {n}");
        return None;
    }
    if devices[0] == devices[1] && !matches!(transport, Transport::Auto) {
        eprintln!("SKIPPED {test}: NCCL needs a GPU per rank, and {devices:?} names one twice");
        return None;
    }
    let groups = GpuWorld::create_with(&devices, config.clone(), transport.clone())
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

/// High-throughput in a caller's stream order through the async API: a `RecvRows::Bound`
/// handle from `HandleFuture::complete_on` (odd rounds: `Group::create_handle_on`), then
/// dispatch and combine through
/// `OpFuture::complete_on` on the same stream, before any completion is awaited (NVLink and
/// NCCL: over NCCL the handle is built on the host and the futures resolve once it exists).
#[test]
fn high_throughput_in_stream_order_on_gpus_matches_the_reference() {
    for transport in [Transport::Auto, Transport::Nccl] {
        ht_stream_ordered_futures(&transport);
    }
}

fn ht_stream_ordered_futures(transport: &Transport) {
    use epflow::core::ops::{HandleOptions, RecvRows};
    let config = GroupConfig::high_throughput(32, 2048).with_max_tokens(epflow::core::MaxTokens::Fixed(300));
    let test = format!("high_throughput_in_stream_order ({transport:?})");
    let Some((groups, rt)) = two_gpu_groups(&config, &test, transport) else { return };
    rt.block_on(async {
        for round in 0..20u64 {
            let sc = Scenario::generate(config.clone(), 2, &[300, 41], 8, RoutingKind::Skewed, 5, 191 + round);
            let refs = sc.ht_dispatch_reference().unwrap();
            let want = sc.ht_combine_identity_reference(&refs).unwrap();
            let work = groups.iter().map(|g| {
                let (sc, refs, want) = (&sc, &refs, &want);
                async move {
                    let r = g.rank();
                    let b = g.backend();
                    let stream = b.context().new_stream().unwrap();
                    let idx = b.upload(&sc.topk_idx(r)).unwrap();
                    let opts = HandleOptions::default().with_recv_rows(RecvRows::Bound);
                    // Odd rounds through `create_handle_on` (the same, ordered after `stream`).
                    let (h, created) = if round % 2 == 1 {
                        g.create_handle_on(&idx, &opts, &stream).await.unwrap()
                    } else {
                        g.create_handle_with(&idx, &opts).complete_on(&stream).await.unwrap()
                    };
                    assert_eq!(h.recv_rows(), Some(600));
                    let x = b.upload(&sc.tokens(r)).unwrap();
                    let w = b.upload(&sc.weights(r)).unwrap();
                    let inputs = DispatchInputs::new(&x).with_weights(&w);
                    let (out, dd) = g.dispatch(&h, inputs).after(&stream).complete_on(&stream).await.unwrap();
                    let (y, yd) = g
                        .combine(&h, CombineInputs::new(out.tokens()))
                        .after(&stream)
                        .complete_on(&stream)
                        .await
                        .unwrap();
                    for done in [created, dd, yd] {
                        done.await.unwrap();
                    }
                    let n = refs[r].layout.num_rows();
                    assert_eq!(h.num_recv_tokens(), Some(n));
                    let host = out.to_host().unwrap();
                    let tokens = match host.tokens.data() {
                        epflow::core::HostData::Bf16(v) => epflow::core::HostData::Bf16(v[..n * 2048].to_vec()),
                        other => other.clone(),
                    };
                    let rep = check_ht_dispatch(
                        &refs[r],
                        &tokens,
                        None,
                        &host.topk_weights.as_ref().and_then(HostTensor::as_f32).unwrap()[..n * 8],
                        &host.topk_idx.as_ref().and_then(HostTensor::as_i64).unwrap()[..n * 8],
                        host.counts.as_ref().and_then(HostTensor::as_i32).unwrap(),
                    );
                    assert!(rep.ok(), "{transport:?} round {round} rank {r}: {rep:?}");
                    let got = y.to_host().unwrap();
                    let rep = check_bf16("combine", &want[r], got.tokens.as_bf16().unwrap(), Tolerance::Exact);
                    assert!(rep.ok(), "{transport:?} round {round} rank {r}: {rep:?}");
                }
            });
            futures::future::join_all(work).await;
        }
    });
    eprintln!("ok: high-throughput in stream order ({transport:?}), 20 rounds");
}

//! The NCCL EP backend behind epflow's futures, on 2 GPUs, and its stream-ordered handles, on
//! one GPU or two, against the CPU reference. Runs on a GPU machine with NVIDIA's `libnccl_ep`
//! (NCCL EP 0.1, built from NCCL 2.30.7) and that NCCL first on the library path; prints SKIPPED
//! (and passes) without the GPUs or without the library.

use epflow_async::Group;
use epflow_core::GroupConfig;
use epflow_core::handle::RoutingHandle;
use epflow_core::ops::{CombineInputs, DispatchInputs};
use epflow_core::scenario::Scenario;
use epflow_core::verify::{Tolerance, check_bf16, check_ht_dispatch, check_ll_dispatch};
use epflow_core::workload::RoutingKind;
use epflow_kernels::device_count;

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
    let config = GroupConfig::high_throughput(32, 2048).with_max_tokens(epflow_core::MaxTokens::Fixed(300));
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
fn on_nccl_ep_ranks(config: &GroupConfig, test: &str, rounds: impl Fn(&Group<epflow_nccl_ep::NcclEpRank>) + Sync) {
    use epflow_nccl_ep::NcclEpWorld;
    let n = device_count();
    if n < 2 {
        eprintln!("SKIPPED {test}: needs 2 GPUs, this machine has {n}");
        return;
    }
    let ranks = match NcclEpWorld::create(&[0, 1], config.clone()) {
        Ok(r) => r,
        Err(epflow_core::Error::Unsupported(why)) if why.starts_with("NCCL EP:") => {
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

async fn nccl_ep_ht_rounds(g: &Group<epflow_nccl_ep::NcclEpRank>, config: &GroupConfig) {
    use epflow_core::verify::ht_rows_by_content;
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
            check_ht_dispatch(&refs[r], &epflow_core::HostData::Bf16(t), None, &tw, &ti, counts.as_i32().unwrap());
        assert!(rep.ok(), "round {round} rank {r}: {rep:?}");
        let y = g.combine(&h, CombineInputs::new(out.tokens())).await.unwrap();
        let got = y.tokens().download(b.context()).unwrap();
        let rep = check_bf16("combine", &want[r], got.as_bf16().unwrap(), Tolerance::OneUlp);
        assert!(rep.ok(), "round {round} rank {r}: {rep:?}");
        eprintln!("ht round {round} rank {r}: dispatch and combine match (max |diff| {:e})", rep.max_abs_diff);
    }
}

async fn nccl_ep_rounds(g: &Group<epflow_nccl_ep::NcclEpRank>, config: &GroupConfig) {
    use epflow_core::verify::ll_rows_by_content;
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
            &epflow_core::HostData::Bf16(arranged),
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

/// `NcclEpStreamHandle` (what `moe_serving --backend nccl-ep` drives): one handle per rank,
/// its routing replaced in place every round (`ncclEpUpdateHandle`), dispatch and combine in a
/// stream's order into the test's tensors, nothing awaited until the round's end. Ten rounds of
/// fresh routings and token counts on every GPU of the machine (one or two): rows matched to the
/// reference by content, counts equal, the combine of identity experts within one BF16 ulp.
/// Skipped (loudly) without a GPU or without `libnccl_ep`.
#[test]
fn stream_ordered_handles_match_the_reference() {
    use epflow_core::verify::ll_rows_by_content;
    use epflow_core::{DType, TensorDesc, TensorTag};
    use epflow_kernels::DeviceTensor;
    use epflow_nccl_ep::NcclEpWorld;
    let test = "stream_ordered_handles_match_the_reference";
    let n = device_count().min(2);
    if n == 0 {
        eprintln!("SKIPPED {test}: no GPU");
        return;
    }
    let devices: Vec<usize> = (0..n).collect();
    let (experts, m, h, k) = (32usize, 64usize, 2048usize, 8usize);
    let config = GroupConfig::low_latency(experts, m, h);
    let ranks = match NcclEpWorld::create(&devices, config.clone()) {
        Ok(r) => r,
        Err(epflow_core::Error::Unsupported(why)) if why.starts_with("NCCL EP:") => {
            eprintln!("SKIPPED {test}: {why}");
            return;
        }
        Err(e) => panic!("NCCL EP group: {e}"),
    };
    let (l, rows) = (experts / n, n * m);
    std::thread::scope(|scope| {
        for rank in &ranks {
            let (config, devices) = (&config, &devices);
            scope.spawn(move || {
                let r = epflow_core::backend::Backend::rank(rank);
                let (ctx, dev) = (rank.context(), devices[r]);
                let stream = ctx.new_stream().expect("stream");
                let zeros = |tag, dtype, shape: &[usize]| {
                    DeviceTensor::zeros(ctx, dev, TensorDesc::contiguous(tag, dtype, shape)).expect("alloc")
                };
                let handle = rank.stream_handle(k).expect("ncclEpInitHandle");
                let recv = zeros(TensorTag::Tokens, DType::Bf16, &[l, rows, h]);
                let counts = zeros(TensorTag::RecvExpertCountsDevice, DType::I32, &[l]);
                for round in 0..10u64 {
                    let tokens: Vec<usize> = (0..n).map(|q| if q + 1 == n { 41 + round as usize } else { m }).collect();
                    let sc = Scenario::generate(config.clone(), n, &tokens, k, RoutingKind::Uniform, 5, 303 + round);
                    let refs = sc.ll_dispatch_reference().unwrap();
                    let want = sc.ll_combine_identity_reference(&refs).unwrap();
                    let idx = rank.upload(&sc.topk_idx(r)).unwrap();
                    let x = rank.upload(&sc.tokens(r)).unwrap();
                    let w = rank.upload(&sc.weights(r)).unwrap();
                    let out = zeros(TensorTag::Tokens, DType::Bf16, &[tokens[r], h]);
                    handle.route_on(&idx, &stream).expect("ncclEpUpdateHandle");
                    handle.dispatch_on(&x, &recv, &counts, &stream).expect("ncclEpDispatch");
                    // Identity experts: the received rows go back as they came.
                    handle.combine_on(&recv, &w, &out, &stream).expect("ncclEpCombine");
                    stream.synchronize().expect("sync");
                    let got_rows = recv.download(ctx).unwrap();
                    let got_counts = counts.download(ctx).unwrap();
                    let arranged = ll_rows_by_content(&refs[r], rows, h, got_rows.as_bf16().unwrap());
                    let rep = check_ll_dispatch(
                        &refs[r],
                        h,
                        rows,
                        &epflow_core::HostData::Bf16(arranged),
                        None,
                        got_counts.as_i32().unwrap(),
                    );
                    assert!(rep.ok(), "round {round} rank {r}: {rep:?}");
                    let got = out.download(ctx).unwrap();
                    let rep = check_bf16("combine", &want[r], got.as_bf16().unwrap(), Tolerance::OneUlp);
                    assert!(rep.ok(), "round {round} rank {r}: {rep:?}");
                }
                eprintln!("rank {r}: 10 stream-ordered rounds match the reference");
            });
        }
    });
}

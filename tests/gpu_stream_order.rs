//! Stream-ordered completion on GPUs: buffer sets are released in the consumers' stream order.
//!
//! Every iteration dispatches fresh random tokens with fresh routing, completes the dispatch in
//! a caller's stream order, and consumes the outputs *slowly* (a spin kernel, then a copy into a
//! snapshot) on a consumer stream before dropping them; then the same for the combine. With two
//! buffer sets, the operation two iterations later reuses the set while the consumer may still be
//! spinning: only the fences the dropped outputs left keep its receive from overwriting what the
//! consumer has not copied yet. The snapshots are checked bit for bit against the CPU reference.
//!
//! Iterations cycle through three placements: `complete_ordered` (the receive on the group's
//! stream, the consumer on the caller's), `complete_on` with the consumer on a *second* stream
//! declared with `record_stream`, and the whole operation in the caller's stream order
//! (`OpFuture::complete_on`: send and receive in one launch) with the consumer on the caller's.
//! Every other iteration's handle is built in the caller's stream order too
//! (`Group::create_handle_on`: in the caller's stream order, no host wait).
//! Skipped (loudly) without 2 GPUs (`EPFLOW_TEST_DEVICES=0,0` runs two ranks on one GPU, a
//! functional check); `EPFLOW_GPU_ITERS` sets the count (default 1000). The one-process-per-GPU variant runs under
//! `epflow launch -n 2 -- gpu_stream_order stream_order_one_process_per_gpu` with the same
//! `EPFLOW_TEST_SEED` in every process.
//!
//! `unawaited_completions_with_per_round_frees_stay_correct` is issue 70's adversarial client:
//! whole operations completed in stream order whose completions are never awaited, with every
//! round's memory freed before the next, each round checked bit for bit.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use cudarc::driver::CudaStream;
use epflow::Group;
use epflow::core::mask::RankSet;
use epflow::core::ops::{CombineInputs, DispatchInputs, HandleOptions};
use epflow::core::reference::LlDispatchResult;
use epflow::core::scenario::Scenario;
use epflow::core::verify::{Tolerance, check_bf16, check_ll_dispatch};
use epflow::core::workload::RoutingKind;
use epflow::core::{DType, Error, GroupConfig, TensorDesc, TensorTag, bf16};
use epflow_kernels::{DeviceTensor, GpuRank, GpuWorld, device_count};

const HIDDEN: usize = 2048;
const EXPERTS: usize = 32;
const MAX_TOKENS: usize = 64;
const TOP_K: usize = 8;
/// Snapshots in flight before the oldest is checked (more than the buffer sets).
const LAG: usize = 4;

fn config() -> GroupConfig {
    GroupConfig::low_latency(EXPERTS, MAX_TOKENS, HIDDEN).with_buffer_sets(2)
}

fn seed() -> u64 {
    std::env::var("EPFLOW_TEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).map_or(1, |d| d.as_nanos() as u64))
}

/// One iteration's snapshot buffers, and what they must hold.
struct Snapshot {
    dispatch: DeviceTensor,
    counts: DeviceTensor,
    /// Combine outputs of 41 and of 64 tokens (the two batch sizes).
    combine: [DeviceTensor; 2],
    it: u64,
    want: Option<(LlDispatchResult, Vec<bf16>)>,
    /// Events after the copies into the snapshot (waited for before it is read).
    copied: Vec<Arc<cudarc::driver::CudaEvent>>,
}

/// Identity experts: combine returns `sum_k w[t][k] * x[t]` over the token's valid slots.
fn identity_combine(tokens: &[bf16], idx: &[i64], w: &[f32]) -> Vec<bf16> {
    let mut out = Vec::with_capacity(tokens.len());
    for t in 0..tokens.len() / HIDDEN {
        for c in 0..HIDDEN {
            let x = tokens[t * HIDDEN + c].to_f32();
            let mut acc = 0f32;
            for k in 0..TOP_K {
                if idx[t * TOP_K + k] >= 0 {
                    acc = w[t * TOP_K + k].mul_add(x, acc);
                }
            }
            out.push(bf16::from_f32(acc));
        }
    }
    out
}

/// Downloads and checks one snapshot; returns the mismatched values.
fn check(rank: &GpuRank, s: &Snapshot, n: usize) -> u64 {
    let Some((refs, want)) = &s.want else { return 0 };
    for e in &s.copied {
        e.synchronize().expect("wait for the snapshot copies");
    }
    let ctx = rank.context();
    let counts = s.counts.download(ctx).expect("download counts");
    let tokens = s.dispatch.download(ctx).expect("download dispatch snapshot");
    let d = check_ll_dispatch(refs, HIDDEN, n * MAX_TOKENS, tokens.data(), None, counts.as_i32().unwrap_or_default());
    let y = s.combine[usize::from(want.len() / HIDDEN == MAX_TOKENS)].download(ctx).expect("download combine snapshot");
    let c = check_bf16("combine", want, y.as_bf16().unwrap_or_default(), Tolerance::Exact);
    if !d.ok() || !c.ok() {
        eprintln!("iteration {} rank {}: dispatch {d:?} combine {c:?}", s.it, rank.device());
    }
    d.mismatched + c.mismatched
}

/// The delayed-consumer loop on one rank of an `n`-rank group; returns the mismatches.
async fn delayed_consumer(g: &Group<GpuRank>, n: usize, iters: u64, base: u64) -> u64 {
    let rank = g.backend();
    let r = g.rank();
    let ctx = Arc::clone(rank.context());
    let caller: Arc<CudaStream> = ctx.new_stream().expect("stream");
    let second: Arc<CudaStream> = ctx.new_stream().expect("stream");
    let l = EXPERTS / n;
    let desc = |shape: &[usize], dt| TensorDesc::contiguous(TensorTag::Tokens, dt, shape);
    let zeros = |d: TensorDesc| DeviceTensor::zeros(&ctx, rank.device(), d).expect("alloc");
    let mut ring: VecDeque<Snapshot> = VecDeque::new();
    let mut free: Vec<Snapshot> = (0..LAG + 1)
        .map(|_| Snapshot {
            dispatch: zeros(desc(&[l, n * MAX_TOKENS, HIDDEN], DType::Bf16)),
            counts: zeros(TensorDesc::contiguous(TensorTag::RecvExpertCountsDevice, DType::I32, &[l])),
            combine: [zeros(desc(&[41, HIDDEN], DType::Bf16)), zeros(desc(&[MAX_TOKENS, HIDDEN], DType::Bf16))],
            it: 0,
            want: None,
            copied: Vec::new(),
        })
        .collect();
    let mut bad = 0;
    let mut inputs = Vec::new();
    for it in 0..iters {
        let tokens: Vec<usize> = (0..n).map(|q| if (q as u64 + it) % 3 == 0 { 41 } else { MAX_TOKENS }).collect();
        let sc = Scenario::generate(
            config(),
            n,
            &tokens,
            TOP_K,
            RoutingKind::Uniform,
            5,
            base ^ it.wrapping_mul(0x9e37_79b9),
        );
        let mut snap = free.pop().expect("a free snapshot");
        snap.it = it;
        let refs = sc.ll_dispatch_reference().expect("reference");
        let me = &sc.ranks[r];
        let want = identity_combine(&me.tokens, &me.topk_idx, &me.weights);
        snap.want = Some((refs.into_iter().nth(r).expect("rank reference"), want));
        let idx = rank.upload(&sc.topk_idx(r)).expect("upload");
        // Every other handle in the caller's stream order (no host wait).
        let h = if it % 2 == 1 {
            g.create_handle_on(&idx, &HandleOptions::default(), &caller).await.map(|(h, _)| h)
        } else {
            g.create_handle(&idx).await
        }
        .expect("handle");
        let x = rank.upload(&sc.tokens(r)).expect("upload");
        let w = rank.upload(&sc.weights(r)).expect("upload");
        // Freed only at the end: cuMemFree waits for the whole device, which would also wait for
        // receives queued ahead that need the peers' next sends.
        inputs.push((idx, x.clone(), w.clone()));
        // A consumer 20-120 us slow, varying.
        let delay = Duration::from_micros(20 + (it.wrapping_mul(2_654_435_761) >> 7) % 100);
        let (ordered, whole) = (it % 3 == 0, it % 3 == 2);
        let consumer = if ordered || whole { &caller } else { &second };
        let (d, _done) = if whole {
            g.dispatch(&h, DispatchInputs::new(&x)).after(&caller).complete_on(&caller).await.expect("dispatch")
        } else if ordered {
            let staged = g.dispatch(&h, DispatchInputs::new(&x)).send_only().await.expect("dispatch send");
            staged.complete_ordered(&caller).await.expect("dispatch complete")
        } else {
            let staged = g.dispatch(&h, DispatchInputs::new(&x)).send_only().await.expect("dispatch send");
            let out = staged.complete_on(&caller).await.expect("dispatch complete");
            out.0.record_stream(&second);
            out
        };
        rank.delay_on(consumer, delay).expect("delay");
        snap.copied.clear();
        snap.copied.push(rank.copy_on(consumer, d.tokens(), &snap.dispatch).expect("copy"));
        snap.copied.push(rank.copy_on(consumer, d.counts().expect("counts"), &snap.counts).expect("copy"));
        let combine = g.combine(&h, CombineInputs::new(d.tokens()).with_weights(&w)).after(&caller);
        let (y, _done) = if whole {
            let out = combine.complete_on(&caller).await.expect("combine");
            drop(d);
            out
        } else if ordered {
            let combine = combine.send_only().await.expect("combine send");
            drop(d);
            combine.complete_ordered(&caller).await.expect("combine complete")
        } else {
            let combine = combine.send_only().await.expect("combine send");
            drop(d);
            let out = combine.complete_on(&caller).await.expect("combine complete");
            out.0.record_stream(&second);
            out
        };
        rank.delay_on(consumer, delay).expect("delay");
        let full = sc.ranks[r].tokens.len() / HIDDEN == MAX_TOKENS;
        snap.copied.push(rank.copy_on(consumer, y.tokens(), &snap.combine[usize::from(full)]).expect("copy"));
        drop(y);
        ring.push_back(snap);
        if ring.len() > LAG {
            let s = ring.pop_front().expect("oldest");
            bad += check(rank, &s, n);
            free.push(s);
        }
    }
    for s in ring {
        bad += check(rank, &s, n);
    }
    // Every operation done (the peers' too, for the frees below).
    caller.synchronize().expect("synchronize");
    second.synchronize().expect("synchronize");
    drop(inputs);
    bad
}

fn iters() -> u64 {
    std::env::var("EPFLOW_GPU_ITERS").ok().and_then(|s| s.parse().ok()).unwrap_or(1000)
}

/// The devices of `EPFLOW_TEST_DEVICES` (default `0,1`; `0,0` runs two ranks on one GPU, a
/// functional check on a 1-GPU machine), or `None`, with a loud skip of `test`, when this machine
/// lacks one of them.
fn test_devices(test: &str) -> Option<Vec<usize>> {
    let devices: Vec<usize> = match std::env::var("EPFLOW_TEST_DEVICES") {
        Ok(list) => list.split(',').map(|d| d.trim().parse().expect("EPFLOW_TEST_DEVICES: e.g. 0,0")).collect(),
        Err(_) => vec![0, 1],
    };
    let n = device_count();
    if devices.iter().any(|&d| d >= n) {
        eprintln!("SKIPPED {test}: needs devices {devices:?}, this machine has {n} GPUs");
        return None;
    }
    Some(devices)
}

/// Runs `work(group, ranks)` for every rank of a group on `devices`, each rank on a thread of
/// its own with a current-thread runtime; returns each rank's mismatches.
fn on_rank_threads<F>(devices: &[usize], cfg: GroupConfig, work: F) -> Vec<u64>
where
    F: AsyncFn(&Group<GpuRank>, usize) -> u64 + Sync,
{
    // Ranks sharing a GPU must leave each other SMs (their kernels wait for each other): the
    // library bounds such groups itself (`GpuWorld::create`).
    let groups: Vec<Group<GpuRank>> =
        GpuWorld::create(devices, cfg).expect("GPU group").into_iter().map(Group::new).collect();
    let ranks = devices.len();
    let work = &work;
    std::thread::scope(|s| {
        let hs: Vec<_> = groups
            .iter()
            .map(|g| {
                s.spawn(move || {
                    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
                    rt.block_on(work(g, ranks))
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p))).collect()
    })
}

#[test]
fn delayed_consumers_never_see_a_reused_buffer_set() {
    let Some(devices) = test_devices("delayed_consumers_never_see_a_reused_buffer_set") else { return };
    let (iters, base) = (iters(), seed());
    eprintln!("seed {base}, {iters} iterations on devices {devices:?}");
    let start = Instant::now();
    let bad = on_rank_threads(&devices, config(), async |g, ranks| delayed_consumer(g, ranks, iters, base).await);
    eprintln!(
        "{iters} stream-ordered iterations with delayed consumers in {:.1} s, mismatches per rank {bad:?}",
        start.elapsed().as_secs_f64()
    );
    assert!(bad.iter().all(|&b| b == 0), "{bad:?}");
}

/// Issue 70's adversarial client: `rounds` rounds of whole operations completed in the caller's
/// stream order (`OpFuture::complete_on`) whose `Completion`s are dropped at once, never
/// awaited, with every round's inputs, handle and outputs freed before the next (with two ranks
/// on one GPU those frees are parked, `kernels/src/device/parked.rs`). Each round's combine is
/// checked bit for bit against identity experts; returns the mismatches.
async fn unawaited_rounds(g: &Group<GpuRank>, n: usize, rounds: u64, base: u64) -> u64 {
    let caller: Arc<CudaStream> = g.backend().context().new_stream().expect("stream");
    let mut bad = 0;
    for it in 0..rounds {
        bad += stream_round(g, n, &config(), &caller, base ^ it.wrapping_mul(0x51ed), &RankSet::new()).await;
    }
    bad
}

/// One round of [`unawaited_rounds`] with `seed` on a group made with `cfg`, whose `masked`
/// ranks are out (their experts' entries contribute nothing to the combine); a masked rank
/// itself must not call it. Returns the mismatched values.
async fn stream_round(
    g: &Group<GpuRank>,
    n: usize,
    cfg: &GroupConfig,
    caller: &Arc<CudaStream>,
    seed: u64,
    masked: &RankSet,
) -> u64 {
    let rank = g.backend();
    let r = g.rank();
    let tokens: Vec<usize> = (0..n).map(|q| if (q as u64 + seed) % 2 == 0 { 41 } else { MAX_TOKENS }).collect();
    let sc = Scenario::generate(cfg.clone(), n, &tokens, TOP_K, RoutingKind::Uniform, 5, seed);
    let me = &sc.ranks[r];
    let per_rank = (EXPERTS / n) as i64;
    let live: Vec<i64> =
        me.topk_idx.iter().map(|&e| if e >= 0 && masked.contains((e / per_rank) as usize) { -1 } else { e }).collect();
    let want = identity_combine(&me.tokens, &live, &me.weights);
    let idx = rank.upload(&sc.topk_idx(r)).expect("upload");
    let x = rank.upload(&sc.tokens(r)).expect("upload");
    let w = rank.upload(&sc.weights(r)).expect("upload");
    let h = g.create_handle(&idx).await.unwrap_or_else(|e| panic!("seed {seed}: handle: {e}"));
    let (d, done) = g
        .dispatch(&h, DispatchInputs::new(&x))
        .after(caller)
        .complete_on(caller)
        .await
        .unwrap_or_else(|e| panic!("seed {seed}: dispatch: {e}"));
    drop(done);
    let (y, done) = g
        .combine(&h, CombineInputs::new(d.tokens()).with_weights(&w))
        .after(caller)
        .complete_on(caller)
        .await
        .unwrap_or_else(|e| panic!("seed {seed}: combine: {e}"));
    drop(done);
    drop(d);
    caller.synchronize().expect("synchronize");
    let got = y.tokens().download(rank.context()).expect("download combine");
    let c = check_bf16("combine", &want, got.as_bf16().unwrap_or_default(), Tolerance::Exact);
    if !c.ok() {
        eprintln!("seed {seed} rank {r}: combine {c:?}");
    }
    // Everything of this round is freed here, while the peer may already be in its next.
    drop((y, h, idx, x, w));
    c.mismatched
}

/// Issue 70 item 2: completions never awaited, and per-round frees, do not poison the group.
#[test]
fn unawaited_completions_with_per_round_frees_stay_correct() {
    let Some(devices) = test_devices("unawaited_completions_with_per_round_frees_stay_correct") else { return };
    let (rounds, base) = (iters().min(200), seed());
    let start = Instant::now();
    let bad = on_rank_threads(&devices, config(), async |g, ranks| unawaited_rounds(g, ranks, rounds, base).await);
    eprintln!(
        "seed {base}: {rounds} rounds with unawaited completions and per-round frees on devices {devices:?} in {:.1} s, mismatches per rank {bad:?}",
        start.elapsed().as_secs_f64()
    );
    assert!(bad.iter().all(|&b| b == 0), "{bad:?}");
}

/// Issue 70 item 2, the late masked peer: with rank masking, rank 1 stays away while the others
/// complete a round in stream order; they mask it at their device deadline and go on without
/// it (their combine exact without rank 1's experts). Then rank 1 comes: its stream-ordered
/// dispatch hands out outputs, and its `Completion` says `RankMasked` without poisoning the
/// group; its next operation is refused with `RankMasked` at the call. After `unmask_all` on
/// every rank, full rounds are exact again.
#[test]
fn a_late_masked_peer_learns_it_in_stream_order() {
    let Some(devices) = test_devices("a_late_masked_peer_learns_it_in_stream_order") else { return };
    let base = seed();
    let late = 1;
    let cfg = config().with_rank_masking(true).with_timeout(Duration::from_millis(1000));
    let n = devices.len();
    if n < 2 {
        eprintln!("SKIPPED a_late_masked_peer_learns_it_in_stream_order: needs two ranks (EPFLOW_TEST_DEVICES=0,0)");
        return;
    }
    let gone = RankSet::from_ranks([late], n).expect("rank set");
    let meet = std::sync::Barrier::new(n);
    let start = Instant::now();
    let bad = on_rank_threads(&devices, cfg.clone(), async |g, n| {
        let caller: Arc<CudaStream> = g.backend().context().new_stream().expect("stream");
        let none = RankSet::new();
        let mut bad = stream_round(g, n, &cfg, &caller, base, &none).await;
        meet.wait();
        if g.rank() != late {
            // The late rank's share never comes: masked at the device deadline.
            for i in 1..4 {
                bad += stream_round(g, n, &cfg, &caller, base ^ i, &gone).await;
            }
            assert!(!g.is_poisoned(), "rank {}: a survivor's group poisoned", g.rank());
        }
        meet.wait();
        if g.rank() == late {
            let sc = Scenario::generate(cfg.clone(), n, &vec![MAX_TOKENS; n], TOP_K, RoutingKind::Uniform, 5, base);
            let r = g.rank();
            let idx = g.backend().upload(&sc.topk_idx(r)).expect("upload");
            let x = g.backend().upload(&sc.tokens(r)).expect("upload");
            let h = g.create_handle(&idx).await.expect("handle");
            match g.dispatch(&h, DispatchInputs::new(&x)).after(&caller).complete_on(&caller).await {
                // Handed out before the device decided; the completion has the verdict.
                Ok((d, done)) => {
                    let verdict = done.await;
                    assert!(matches!(verdict, Err(Error::RankMasked { .. })), "late rank's completion: {verdict:?}");
                    drop(d);
                }
                Err(e) => assert!(matches!(e, Error::RankMasked { .. }), "late rank's dispatch: {e}"),
            }
            assert!(!g.is_poisoned(), "the masked rank's group must stay whole for unmask_all");
            let again = g.dispatch(&h, DispatchInputs::new(&x)).after(&caller).complete_on(&caller).await;
            assert!(matches!(again, Err(Error::RankMasked { .. })), "late rank's next operation: {:?}", again.err());
            drop((h, idx, x));
            caller.synchronize().expect("synchronize");
        }
        meet.wait();
        g.unmask_all().await.unwrap_or_else(|e| panic!("rank {}: unmask_all: {e}", g.rank()));
        for i in 10..14 {
            bad += stream_round(g, n, &cfg, &caller, base ^ i, &none).await;
        }
        bad
    });
    eprintln!(
        "seed {base}: late masked peer on devices {devices:?} in {:.1} s, mismatches per rank {bad:?}",
        start.elapsed().as_secs_f64()
    );
    assert!(bad.iter().all(|&b| b == 0), "{bad:?}");
}

/// One process per GPU (see the module docs).
#[test]
fn stream_order_one_process_per_gpu() {
    let env = match epflow_kernels::setup::bootstrap::LaunchEnv::from_env() {
        Ok(Some(env)) => env,
        Ok(None) => {
            eprintln!("SKIPPED stream_order_one_process_per_gpu: not started by `epflow launch`");
            return;
        }
        Err(e) => panic!("bad launch environment: {e}"),
    };
    let comm = env.communicator().expect("NCCL communicator");
    let base: u64 = std::env::var("EPFLOW_TEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .expect("set EPFLOW_TEST_SEED in every process");
    let g = Group::new(GpuWorld::join(&comm, config()).expect("join the GPU group"));
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    let iters = iters();
    let bad = rt.block_on(delayed_consumer(&g, env.world_size, iters, base));
    assert_eq!(bad, 0, "rank {}: {bad} mismatched values", env.rank);
    eprintln!("ok: rank {} of {}, {iters} stream-ordered iterations, one process per GPU", env.rank, env.world_size);
    epflow_kernels::setup::bootstrap::barrier(&comm).expect("barrier");
}

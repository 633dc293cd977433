//! Rank masking on GPUs ([`epflow_core::mask`]) against the CPU reference: the last rank of the
//! group stops calling; the survivors' next operation completes after the device deadline
//! (timed and printed), with no poison; every later operation, both layouts, two launches and
//! one, fresh inputs each time and outputs poisoned first, matches the reference computed without
//! the stopped rank's experts, with the per-token counts of lost entries. The stopped rank comes
//! back: its first operation is refused (`RankMasked`); every rank runs `unmask_all`; the full
//! group is bit-exact again. `masking_one_process_per_gpu` (under `epflow launch`) kills a
//! rank's process instead. Without enough GPUs every test prints SKIPPED and passes.
//! `EPFLOW_TEST_DEVICES=0,0` (or `0,0,0`) runs the ranks on one GPU (a functional check).
//! `EPFLOW_GPU_ITERS` sets the masked iterations (default 200), `EPFLOW_MASK_TIMEOUT_MS` the
//! group timeout (default 2000), `EPFLOW_MASK_STAGED` = `all`/`none` which operations are
//! staged, `EPFLOW_MASK_REJOIN=0` stops before `unmask_all` (for racecheck).

use std::sync::Barrier;
use std::time::{Duration, Instant};

use epflow_core::backend::{Backend, blocking_combine, blocking_dispatch, blocking_handle_with};
use epflow_core::mask::RankSet;
use epflow_core::ops::{CombineInputs, CombineOptions, DispatchInputs, DispatchOptions, HandleOptions, Layout};
use epflow_core::scenario::Scenario;
use epflow_core::verify::{Report, Tolerance, check_bf16, check_exact, check_ll_dispatch, check_rank_major_dispatch};
use epflow_core::workload::RoutingKind;
use epflow_core::{Error, GroupConfig, HostTensor};
use epflow_kernels::{DeviceTensor, GpuRank, GpuWorld};

mod common;
use common::{gpus, on_ranks, seed, shared_gpu_sms};

const M: usize = 32;
const H: usize = 1024;
const K: usize = 4;
/// The group timeout: `EPFLOW_MASK_TIMEOUT_MS` (the sanitizer's runs need a long one), else 2 s.
fn timeout() -> Duration {
    let ms = std::env::var("EPFLOW_MASK_TIMEOUT_MS").ok().and_then(|s| s.parse().ok()).unwrap_or(2000);
    Duration::from_millis(ms)
}

/// Which operations run staged (send half, then complete half): `EPFLOW_MASK_STAGED` = `all`,
/// `none`, else every third.
fn staged(i: u64) -> bool {
    match std::env::var("EPFLOW_MASK_STAGED").as_deref() {
        Ok("all") => true,
        Ok("none") => false,
        _ => i % 3 == 0,
    }
}

/// Ranks sharing a GPU split its SMs: every rank may have a dispatch and a combine receive
/// spinning for its peers (one block per SM), and their senders must still find room: 16 SMs
/// per kernel (at 32, two ranks' four receives took 128 of an H100's 132 SMs, and a sender
/// starved until the deadline masked its rank).
fn config(devices: &[usize]) -> GroupConfig {
    let sms = shared_gpu_sms(devices).map(|s| s / 2);
    GroupConfig::low_latency(8 * devices.len(), M, H).with_rank_masking(true).with_timeout(timeout()).with_max_sms(sms)
}

fn assert_ok(report: Report, what: &str) {
    assert!(report.ok(), "{what}: {} of {} mismatched; first: {:?}", report.mismatched, report.checked, report.first);
}

/// A rank's input buffers, allocated once and refilled every round: with ranks in one process
/// on one GPU, `cuMemFree` (and at times `cuMemAlloc`) waits for every kernel of the context,
/// among them a peer's receive spinning for this rank's send, which then starts only at that
/// receive's deadline (and the peer masks this rank). Servers allocate once too.
struct Bufs {
    topk: DeviceTensor,
    x: DeviceTensor,
    w: DeviceTensor,
    y: [DeviceTensor; 2],
}

impl Bufs {
    fn new(rank: &GpuRank, sc: &Scenario) -> Bufs {
        let r = rank.rank();
        let up = |t: &HostTensor| rank.upload(t).unwrap();
        let y = [Layout::ExpertMajor, Layout::RankMajor].map(|l| up(&sc.ll_reference_expert_outputs(r, l).unwrap()));
        Bufs { topk: up(&sc.topk_idx(r)), x: up(&sc.tokens(r)), w: up(&sc.weights(r)), y }
    }
}

/// One dispatch and combine of `rank` on `full`'s inputs, checked against the reference of the
/// group without `masked`; the combine input comes from that reference. Returns how long the
/// dispatch took.
fn round(rank: &GpuRank, b: &Bufs, full: &Scenario, masked: &RankSet, layout: Layout, staged: bool) -> Duration {
    let r = rank.rank();
    let sc = full.without_ranks(masked);
    let what = format!("rank {r} {layout:?} staged={staged} masked={masked:?}");
    rank.fill_output_buffers(0xA5).unwrap();
    let ctx = rank.context();
    b.topk.copy_from_host(ctx, &full.topk_idx(r)).unwrap();
    b.x.copy_from_host(ctx, &full.tokens(r)).unwrap();
    b.w.copy_from_host(ctx, &full.weights(r)).unwrap();
    let (x, w) = (&b.x, &b.w);
    let h = blocking_handle_with(rank, &b.topk, &HandleOptions::with_layout(layout)).unwrap();
    let rm = layout == Layout::RankMajor;
    let inputs = if rm { DispatchInputs::new(x).with_weights(w) } else { DispatchInputs::new(x) };
    let t = Instant::now();
    let out = blocking_dispatch(rank, &h, inputs, &DispatchOptions::default(), staged).unwrap();
    let took = t.elapsed();
    if took > Duration::from_millis(200) {
        eprintln!("{what}: dispatch {} took {took:?}", if staged { "(staged)" } else { "" });
    }
    let host = out.to_host().unwrap();
    let counts = host.counts.as_ref().and_then(HostTensor::as_i32).unwrap();
    let report = if rm {
        let refs = sc.ll_rank_major_reference().unwrap();
        let weights = host.topk_weights.as_ref().and_then(HostTensor::as_f32).unwrap();
        let idx = host.topk_idx.as_ref().and_then(HostTensor::as_i32).unwrap();
        check_rank_major_dispatch(&refs[r], H, M, K, host.tokens.data(), None, weights, idx, counts)
    } else {
        let n = full.num_ranks;
        check_ll_dispatch(&sc.ll_dispatch_reference().unwrap()[r], H, n * M, host.tokens.data(), None, counts)
    };
    assert_ok(report, &format!("{what}: dispatch"));
    drop(out);
    let y = &b.y[usize::from(rm)];
    y.copy_from_host(ctx, &sc.ll_reference_expert_outputs(r, layout).unwrap()).unwrap();
    let cin = if rm { CombineInputs::new(y) } else { CombineInputs::new(y).with_weights(w) };
    let out = blocking_combine(rank, &h, cin, &CombineOptions::default(), staged).unwrap().to_host().unwrap();
    let want = if rm {
        sc.ll_rank_major_combine_identity_reference(&sc.ll_rank_major_reference().unwrap()).unwrap()
    } else {
        sc.ll_combine_identity_reference(&sc.ll_dispatch_reference().unwrap()).unwrap()
    };
    assert_ok(check_bf16("combine", &want[r], out.tokens.as_bf16().unwrap(), Tolerance::Exact), &what);
    let lost = full.masked_entries(r, masked);
    let got = out.masked.as_ref().and_then(HostTensor::as_i32).unwrap();
    assert_ok(check_exact("masked entries", &lost, got, |a, b| a == b), &what);
    took
}

fn scenario(config: &GroupConfig, n: usize, seed: u64) -> Scenario {
    let tokens: Vec<usize> = [M, 17, 1, 30, 9, 24, 5, 12].into_iter().take(n).collect();
    Scenario::generate(config.clone(), n, &tokens, K, RoutingKind::Uniform, 1, seed)
}

fn survivors_go_on(n: usize) {
    let test = format!("gpu_masking ({n} ranks)");
    let Some(devices) = gpus(n, &test) else { return };
    let iters: u64 = std::env::var("EPFLOW_GPU_ITERS").ok().and_then(|s| s.parse().ok()).unwrap_or(200);
    let base = seed();
    eprintln!("{test}: seed {base} (EPFLOW_TEST_SEED replays it), {iters} masked iterations");
    let config = config(&devices);
    let ranks = GpuWorld::create(&devices, config.clone()).unwrap();
    let dead = n - 1;
    let gone = RankSet::from_ranks([dead], n).unwrap();
    let none = RankSet::new();
    let back = Barrier::new(n);
    let layout_of = |i: u64| if i % 2 == 0 { Layout::ExpertMajor } else { Layout::RankMajor };
    let took = on_ranks(&ranks, |rank| {
        let me = rank.rank();
        let bufs = Bufs::new(rank, &scenario(&config, n, base));
        for i in 0..4 {
            round(rank, &bufs, &scenario(&config, n, base + i), &none, layout_of(i), staged(i));
        }
        let mut first = Duration::ZERO;
        if me != dead {
            first = round(rank, &bufs, &scenario(&config, n, base + 4), &gone, Layout::ExpertMajor, false);
            for i in 5..5 + iters {
                round(rank, &bufs, &scenario(&config, n, base + i), &gone, layout_of(i), staged(i));
            }
            assert_eq!(rank.masked_ranks().ranks, gone, "rank {me}");
            assert!(!rank.poison().is_poisoned());
        }
        back.wait();
        if me == dead {
            // Back, once the survivors are done (and idle: with ranks in one process a
            // synchronous copy waits for every kernel of the GPU, and a rejoin kernel spins
            // until its peers come): the group masked it.
            let h = blocking_handle_with(rank, &bufs.topk, &HandleOptions::default()).unwrap();
            match blocking_dispatch(rank, &h, DispatchInputs::new(&bufs.x), &DispatchOptions::default(), false) {
                Err(Error::RankMasked { rank, .. }) => assert_eq!(rank, dead),
                other => panic!("a masked rank's dispatch must be refused, got {:?}", other.map(|_| ())),
            }
        }
        back.wait();
        if std::env::var("EPFLOW_MASK_REJOIN").is_ok_and(|v| v == "0") {
            // compute-sanitizer's racecheck runs kernels one at a time: the ranks' rejoin kernels,
            // which meet on the device, cannot meet in one process there.
            return first;
        }
        rank.unmask_all().unwrap();
        assert_eq!(rank.masked_ranks().ranks, none);
        for i in 0..6 {
            round(rank, &bufs, &scenario(&config, n, base + 10_000 + i), &none, layout_of(i), staged(i + 2));
        }
        first
    });
    for (r, t) in took.iter().enumerate().filter(|&(r, _)| r != dead) {
        eprintln!("{test}: rank {r}'s first operation without rank {dead} took {t:?} (timeout {:?})", timeout());
        assert!(*t < timeout() + Duration::from_millis(500), "rank {r}: {t:?}");
    }
    eprintln!("ok: {test}");
}

#[test]
fn survivors_of_two_go_on() {
    survivors_go_on(2);
}

#[test]
fn survivors_of_three_go_on() {
    survivors_go_on(3);
}

/// Rank masking over NCCL (`Transport::Nccl`), in one process, two ranks (on one GPU with NCCL
/// 2.30 and `NCCL_MULTI_RANK_GPU_ENABLE=1`): see [`nccl_cycles`].
#[test]
fn masking_over_nccl_revokes_and_a_newcomer_rejoins() {
    let test = "masking_over_nccl_revokes_and_a_newcomer_rejoins";
    let Some(devices) = common::nccl_gpus(2, test) else { return };
    nccl_cycles(test, &devices, epflow_kernels::Transport::Nccl);
}

/// The same with NVLink inside a "host" and NCCL across (`Transport::Hierarchical`, ranks 0 and
/// 1 on one, rank 2 on the other), three ranks: rank 1 dies; rank 0 masks it over NVLink (at
/// the device deadline), rank 2 over NCCL (its pair with rank 1 revoked at the host deadline);
/// rank 0's exchange with rank 2 is untouched; the newcomer maps rank 0's memory (by address,
/// one process) and makes a new pair with rank 2.
#[test]
fn masking_over_nvlink_and_nccl_revokes_and_a_newcomer_rejoins() {
    let test = "masking_over_nvlink_and_nccl_revokes_and_a_newcomer_rejoins";
    let Some(devices) = common::nccl_gpus(3, test) else { return };
    nccl_cycles(test, &devices, epflow_kernels::Transport::Hierarchical { hosts: vec![0, 0, 1] });
}

/// Eight ranks over NCCL (`Transport::Nccl`), the most a GPU group of one host may have: each
/// rank holds 3 x 7 pair communicators. On one GPU (`EPFLOW_TEST_DEVICES=0,0,0,0,0,0,0,0`,
/// NCCL 2.30, `NCCL_MULTI_RANK_GPU_ENABLE=1`) it is a functional check, and it prints what the
/// pairs cost: the group's set-up time and device memory, the seven survivors' first operation
/// without rank 1 (each revokes its own pairs with it) and their `admit`: see [`nccl_cycles`].
#[test]
fn masking_over_nccl_at_eight_ranks() {
    let test = "masking_over_nccl_at_eight_ranks";
    let Some(devices) = common::nccl_gpus(8, test) else { return };
    nccl_cycles(test, &devices, epflow_kernels::Transport::Nccl);
}

/// Kill-and-rejoin cycles of rank 1 in a group of `devices.len()` ranks with NCCL peers, in one
/// process. Each cycle: full rounds bit-exact; rank 1's thread stops calling (and drops its
/// rank after the survivors' next operation); a survivor that reaches it over NCCL waits in
/// NCCL until the host deadline, then that pair's communicator is revoked and rank 1 masked
/// (one over NVLink masks it at the device deadline); the first operation without it is timed
/// (under the timeout plus 0.5 s, no error, no poison); masked rounds match the reference
/// without rank 1, and no channel reaches rank 1 any more (`nccl_reachable`); `unmask_all` is
/// refused (a masked NCCL peer comes back through a rejoin). In the first cycle a newcomer that joins with another transport (NVLink only) is
/// refused on every rank and changes nothing. Then a new rank takes rank 1's place
/// (`GpuWorld::rejoin_with` over a TCP meeting, the survivors' `admit`, which make new pairs
/// with it), every channel reaches every NCCL peer again, and full rounds are bit-exact. `EPFLOW_TEST_REJOIN_CYCLES`
/// cycles (default 2), `EPFLOW_GPU_ITERS` rounds per phase (default 20).
fn nccl_cycles(test: &str, devices: &[usize], transport: epflow_kernels::Transport) {
    let n = devices.len();
    let cycles: u64 = std::env::var("EPFLOW_TEST_REJOIN_CYCLES").ok().and_then(|s| s.parse().ok()).unwrap_or(2);
    let iters: u64 = std::env::var("EPFLOW_GPU_ITERS").ok().and_then(|s| s.parse().ok()).unwrap_or(20);
    let base = seed();
    eprintln!("{test}: seed {base} (EPFLOW_TEST_SEED replays it), {cycles} cycles, {iters} rounds per phase");
    let config = config(devices);
    let local = LocalMeetings::new(devices);
    let (meeting, barrier) = (|me| local.meeting(me), || local.barrier());
    let dead = 1;
    let (none, gone) = (RankSet::new(), RankSet::from_ranks([dead], n).unwrap());
    let (ranks, made, taken) = device_memory_taken(devices, || {
        GpuWorld::create_with(devices, config.clone(), transport.clone()).expect("world with NCCL peers")
    });
    let buffers: u64 = ranks.iter().map(|r| r.device_memory_bytes() as u64).sum();
    let pairs: u32 = ranks.iter().map(|r| 3 * r.nccl_peers().count_ones()).sum::<u32>() / 2;
    eprintln!(
        "{test}: {n} ranks made in {made:?} with {pairs} pair communicators; device memory taken {} MiB ({} MiB epflow's buffers, the rest NCCL's)",
        taken >> 20,
        buffers >> 20
    );
    // Each rank reaches its NCCL peers, on every channel, through a pair communicator each.
    assert!(ranks.iter().all(|r| r.nccl_reachable() == Some([r.nccl_peers(); 3])));
    let (config, none, gone, transport) = (&config, &none, &gone, &transport);
    on_owned_ranks(ranks, |rank| {
        let me = rank.rank();
        let mut rank = Some(rank);
        for cycle in 0..cycles {
            let from = base + cycle * 10_000;
            let r = rank.take().expect("a live rank");
            let b = full_rounds_first(&r, config, from, iters, &barrier);
            let used = if me == dead {
                // This rank stops calling. Its memory goes once the survivors' first operation
                // without it is over (in one process a free waits for every kernel of the GPU,
                // among them the survivors' waiting for this rank).
                barrier();
                drop((b, r));
                if cycle == 0 {
                    let nvlink = epflow_kernels::Transport::NvLink;
                    match GpuWorld::rejoin_with(&meeting(me), config.clone(), nvlink) {
                        Err(Error::Unsupported(m)) => assert!(m.contains("transport"), "{m}"),
                        other => {
                            panic!("a newcomer with another transport must be refused, got {:?}", other.map(|_| ()))
                        }
                    }
                }
                let t = Instant::now();
                let fresh = GpuWorld::rejoin_with(&meeting(me), config.clone(), transport.clone()).expect("rejoin");
                eprintln!("{test}: cycle {cycle}: rank {me}'s replacement rejoined in {:?}", t.elapsed());
                assert_eq!(fresh.nccl_reachable(), Some([fresh.nccl_peers(); 3]));
                let b = full_rounds_first(&fresh, config, from + 5000, iters, &barrier);
                rank = Some(fresh);
                b
            } else {
                let stall = timed_rounds(&r, &b, config, from + 100, 1, gone)[0];
                barrier();
                timed_rounds(&r, &b, config, from + 101, iters, gone);
                assert_eq!(r.masked_ranks().ranks, *gone, "rank {me}");
                assert!(!r.poison().is_poisoned());
                // A survivor that reached rank 1 over NCCL revoked its pairs with it.
                let left = r.nccl_peers() & !(1 << dead);
                assert_eq!(r.nccl_reachable(), Some([left; 3]), "rank {me}: pairs with the dead rank");
                match r.unmask_all() {
                    Err(Error::Unsupported(m)) => assert!(m.contains("rejoin"), "{m}"),
                    other => panic!("unmask_all with NCCL peers must be refused, got {other:?}"),
                }
                if cycle == 0 {
                    match r.admit(&meeting(me)) {
                        Err(Error::Unsupported(m)) => assert!(m.contains("transport"), "{m}"),
                        other => panic!("a newcomer with another transport must be refused, got {other:?}"),
                    }
                    assert_eq!(r.masked_ranks().ranks, *gone, "rank {me}");
                    assert!(!r.poison().is_poisoned());
                    timed_rounds(&r, &b, config, from + 200, 2, gone);
                }
                let t = Instant::now();
                assert_eq!(r.admit(&meeting(me)).expect("admit"), *gone);
                let admit = t.elapsed();
                assert!(r.masked_ranks().ranks.is_empty());
                assert_eq!(r.nccl_reachable(), Some([r.nccl_peers(); 3]));
                barrier();
                timed_rounds(&r, &b, config, from + 5000, iters, none);
                barrier();
                eprintln!(
                    "{test}: cycle {cycle}: rank {me}: first operation without rank {dead} took {stall:?} (timeout {:?}), admit {admit:?}, {iters} masked and {iters} full rounds bit-exact",
                    timeout()
                );
                assert!(stall < timeout() + Duration::from_millis(500), "rank {me}: {stall:?}");
                rank = Some(r);
                b
            };
            barrier();
            drop(used);
        }
    });
    eprintln!("ok: {test}: {cycles} cycles of kill, revoke and rejoin with NCCL peers, every round bit-exact");
}

/// Runs `make` and measures it: its wall time, and the free memory it took from the GPUs of
/// `devices` ([`epflow_kernels::FreeMemory`]), in bytes.
fn device_memory_taken<T>(devices: &[usize], make: impl FnOnce() -> T) -> (T, Duration, u64) {
    let memory = epflow_kernels::FreeMemory::of(devices).expect("the GPUs' contexts");
    let before = memory.bytes().expect("free memory");
    let t = Instant::now();
    let made = make();
    let took = t.elapsed();
    (made, took, before.saturating_sub(memory.bytes().expect("free memory")))
}

/// The async `Group::admit` of GPU ranks (`Backend::admit`) refuses before any meeting: a rank
/// that is not masked ([`Error::RejoinRefused`]); no rank asked; without a meeting source; a set
/// that leaves a masked rank out (a GPU meeting admits every masked rank at once). The source
/// given at the end fails the test if a meeting is asked for.
#[test]
fn admit_refuses_before_any_meeting() {
    use epflow_core::RejoinRefusal;
    let Some(devices) = gpus(2, "admit_refuses_before_any_meeting") else { return };
    let ranks = GpuWorld::create(&devices, config(&devices)).expect("world");
    let r0 = &ranks[0];
    let wait = Duration::from_secs(1);
    let set = |v: &[usize]| RankSet::from_ranks(v.iter().copied(), devices.len()).unwrap();
    let err = Backend::admit(r0, &set(&[1]), wait).unwrap_err();
    assert!(matches!(err, Error::RejoinRefused { rank: 1, why: RejoinRefusal::NotMasked }), "{err}");
    Backend::mask_ranks(r0, &set(&[1])).expect("mask rank 1");
    let err = Backend::admit(r0, &RankSet::new(), wait).unwrap_err();
    assert!(matches!(&err, Error::Unsupported(m) if m.contains("no rank to admit")), "{err}");
    let err = Backend::admit(r0, &set(&[1]), wait).unwrap_err();
    assert!(matches!(&err, Error::Unsupported(m) if m.contains("set_meeting_source")), "{err}");
    r0.set_meeting_source(std::sync::Arc::new(|_| panic!("no meeting may be asked for")));
    if devices.len() > 2 {
        let err = Backend::admit(r0, &set(&[2]), wait).unwrap_err();
        assert!(matches!(err, Error::RejoinRefused { rank: 2, why: RejoinRefusal::NotMasked }), "{err}");
    }
    let err = Backend::rejoin(r0, wait).unwrap_err();
    assert!(matches!(&err, Error::Unsupported(m) if m.contains("GpuWorld::rejoin")), "{err}");
    eprintln!(
        "ok: admit refused for an unmasked rank, an empty set and without a source; rejoin points to GpuWorld::rejoin"
    );
}

/// One process per GPU, a process that dies: run under `epflow launch -n N -- gpu_masking
/// masking_one_process_per_gpu` with the same `EPFLOW_TEST_SEED` in every process. After four
/// full rounds and a barrier, the last rank's process exits on the spot (`std::process::exit`,
/// no destructors: its GPU context goes with the process, as in a crash; exit status 0 so that
/// `epflow launch` leaves the survivors running). The survivors' next operation completes at the
/// device deadline (timed, printed, and held to the timeout + 500 ms), then `EPFLOW_GPU_ITERS`
/// (default 1,000) operations, both layouts, staged and not, match the reference computed
/// without the dead rank's experts, with no poison.
#[test]
fn masking_one_process_per_gpu() {
    let Some((env, comm, base)) = common::launched("masking_one_process_per_gpu") else { return };
    let n = env.world_size;
    let me = env.rank;
    let iters: u64 = std::env::var("EPFLOW_GPU_ITERS").ok().and_then(|s| s.parse().ok()).unwrap_or(1000);
    let config = GroupConfig::low_latency(8 * n, M, H).with_rank_masking(true).with_timeout(timeout());
    let rank = GpuWorld::join(&comm, config.clone()).expect("join the GPU group");
    let dead = n - 1;
    let gone = RankSet::from_ranks([dead], n).unwrap();
    let none = RankSet::new();
    let layout_of = |i: u64| if i % 2 == 0 { Layout::ExpertMajor } else { Layout::RankMajor };
    let bufs = Bufs::new(&rank, &scenario(&config, n, base));
    for i in 0..4 {
        round(&rank, &bufs, &scenario(&config, n, base + i), &none, layout_of(i), staged(i));
    }
    epflow_kernels::setup::bootstrap::barrier(&comm).expect("barrier");
    if me == dead {
        eprintln!("rank {me}: process exits now");
        std::process::exit(0);
    }
    let first = round(&rank, &bufs, &scenario(&config, n, base + 4), &gone, Layout::ExpertMajor, false);
    eprintln!("rank {me}: first operation without rank {dead} took {first:?} (timeout {:?})", timeout());
    let t = Instant::now();
    for i in 5..5 + iters {
        round(&rank, &bufs, &scenario(&config, n, base + i), &gone, layout_of(i), staged(i));
        if i % 250 == 0 {
            eprintln!("rank {me}: {} masked iterations, {:?}", i - 4, t.elapsed());
        }
    }
    assert_eq!(rank.masked_ranks().ranks, gone, "rank {me}");
    assert!(!rank.poison().is_poisoned());
    assert!(first < timeout() + Duration::from_millis(500), "rank {me}: {first:?}");
    eprintln!("ok: rank {me} of {n}: {iters} masked iterations after rank {dead}'s process exited, 0 mismatches");
}

/// Wall times of `rounds` rounds of `rank` from scenario `from` on (masking `masked`), checked.
fn timed_rounds(
    rank: &GpuRank,
    b: &Bufs,
    config: &GroupConfig,
    from: u64,
    rounds: u64,
    masked: &RankSet,
) -> Vec<Duration> {
    let n = rank.num_ranks();
    let layout_of = |i: u64| if i % 2 == 0 { Layout::ExpertMajor } else { Layout::RankMajor };
    (from..from + rounds)
        .map(|i| {
            let t = Instant::now();
            round(rank, b, &scenario(config, n, i), masked, layout_of(i), staged(i));
            t.elapsed()
        })
        .collect()
}

fn median_us(mut v: Vec<Duration>) -> f64 {
    v.sort();
    v.get(v.len() / 2).map_or(0.0, |d| d.as_secs_f64() * 1e6)
}

/// A replacement process takes a dead rank's place (`GpuWorld::rejoin` in it, the async
/// `Group::admit` in the survivor, its meetings from `GpuRank::set_meeting_source`), the
/// processes joined over the TCP bootstrap (so two may share one GPU).
/// Started by hand, one process per role, two ranks (`scripts/device-run-rejoin.sh`):
/// `EPFLOW_TEST_REJOIN=survivor` (`RANK=0`), `victim` (`RANK=1`: four full rounds, then its
/// process exits on the spot with status 3), then, once it is gone, `newcomer` (`RANK=1`). Or by
/// `epflow launch -n 2 --restarts 1 --master-addr 127.0.0.1`, which starts rank 1 again when
/// its victim fails (`EPFLOW_REJOIN=1`: the newcomer). `MASTER_ADDR` and `MASTER_PORT` are the
/// group's rendezvous, `EPFLOW_TEST_REJOIN_PORT` (or the launch's `EPFLOW_MEETING_PORT`) the
/// meeting's, `EPFLOW_TEST_DEVICES`' entry (or `LOCAL_RANK`) the device, `EPFLOW_TEST_SEED` the same in every process, `EPFLOW_GPU_ITERS`
/// the rounds per phase (default 50). The survivor times its first operation without rank 1
/// (the stall), runs the masked rounds against the reference without rank 1, admits the
/// newcomer (timed), then both run full rounds bit-exact; the survivor prints each phase's
/// median round. `EPFLOW_TEST_TRANSPORT=nccl` joins every process over `Transport::Nccl` (its
/// pairs' communicators over the TCP bootstrap; two processes on one GPU need NCCL 2.30 and
/// `NCCL_MULTI_RANK_GPU_ENABLE=1`): no device meetings then (they are written over NVLink), and
/// the survivor also checks that its pairs with rank 1 were revoked and remade. Without either
/// role source it prints SKIPPED and passes.
#[test]
fn rejoin_over_tcp() {
    use std::sync::Arc;

    use epflow_kernels::setup::bootstrap::Bootstrap;
    use epflow_kernels::setup::tcp_bootstrap::{TcpBootstrap, TcpLinks};
    let var = |k: &str| std::env::var(k).unwrap_or_else(|_| panic!("{k} is not set"));
    let num = |k: &str| var(k).parse::<usize>().unwrap_or_else(|_| panic!("{k} is not a number"));
    let launched = epflow_core::tuning::Environment::get().meeting_port;
    let role = match (std::env::var("EPFLOW_TEST_REJOIN"), launched) {
        (Ok(role), _) => role,
        // Under `epflow launch --restarts 1`: rank 1's first process is the victim (it fails, so
        // the launcher starts it again), its second the newcomer.
        (Err(_), Some(_)) if epflow_kernels::setup::meeting::rejoining() => "newcomer".into(),
        (Err(_), Some(_)) => (if num("RANK") == 1 { "victim" } else { "survivor" }).into(),
        (Err(_), None) => {
            eprintln!(
                "SKIPPED rejoin_over_tcp: neither EPFLOW_TEST_REJOIN nor `epflow launch --restarts` (scripts/device-run-rejoin.sh starts it)"
            );
            return;
        }
    };
    if epflow_kernels::device_count() == 0 {
        eprintln!("SKIPPED rejoin_over_tcp ({role}): no GPU on this machine");
        return;
    }
    let (me, n) = (num("RANK"), num("WORLD_SIZE"));
    // The device: `EPFLOW_TEST_DEVICES`' entry for this rank (`0,0` shares GPU 0), else LOCAL_RANK.
    let device = std::env::var("EPFLOW_TEST_DEVICES")
        .ok()
        .and_then(|l| l.split(',').nth(me).and_then(|d| d.trim().parse().ok()))
        .unwrap_or_else(|| num("LOCAL_RANK"));
    let meet_port = launched.unwrap_or_else(|| num("EPFLOW_TEST_REJOIN_PORT") as u16);
    let (addr, port) = (var("MASTER_ADDR"), num("MASTER_PORT") as u16);
    let base: u64 = var("EPFLOW_TEST_SEED").parse().expect("EPFLOW_TEST_SEED");
    let iters: u64 = std::env::var("EPFLOW_GPU_ITERS").ok().and_then(|s| s.parse().ok()).unwrap_or(50);
    assert_eq!(n, 2, "rejoin_over_tcp runs two ranks");
    let over_nccl = match std::env::var("EPFLOW_TEST_TRANSPORT").as_deref() {
        Ok("nccl") => true,
        Ok("nvlink") | Err(_) => false,
        Ok(other) => panic!("EPFLOW_TEST_TRANSPORT={other}: nccl or nvlink"),
    };
    let transport = if over_nccl { epflow_kernels::Transport::Nccl } else { epflow_kernels::Transport::Auto };
    let config = GroupConfig::low_latency(8 * n, M, H).with_rank_masking(true).with_timeout(timeout());
    let (none, gone) = (RankSet::new(), RankSet::from_ranks([1], n).unwrap());
    let wait = Duration::from_secs(120);
    // The rejoin meetings: the launch's (`launch_meetings`), or a TCP bootstrap on the port given.
    let meetings: epflow_kernels::setup::meeting::MeetingSource = match launched {
        Some(_) => {
            let launch =
                epflow_kernels::setup::bootstrap::LaunchEnv::from_env().expect("launch env").expect("launched");
            epflow_kernels::setup::meeting::launch_meetings(&launch, device).expect("a meeting port")
        }
        None => {
            let addr = addr.clone();
            Arc::new(move |wait| {
                let links = TcpLinks::connect(me, n, &addr, meet_port, wait)?;
                Ok(Box::new(TcpBootstrap::new(links, device)?) as Box<dyn Bootstrap + Send>)
            })
        }
    };
    let after = base + 1000;
    // Device meetings (`meet_on`, collective): three before the kill, two after the rejoin; a
    // newcomer that did not take the survivors' count over would leave the survivor waiting.
    let meet = |rank: &GpuRank, times: usize| {
        if over_nccl {
            return;
        }
        let stream = rank.context().new_stream().expect("stream");
        for _ in 0..times {
            rank.meet_on(&stream).expect("meet_on");
        }
        stream.synchronize().expect("meetings");
    };
    match role.as_str() {
        "survivor" | "victim" => {
            let boot =
                TcpBootstrap::new(TcpLinks::connect(me, n, &addr, port, wait).expect("connect"), device).unwrap();
            let rank = GpuWorld::join_over(&boot, config.clone(), transport.clone()).expect("join");
            let b = Bufs::new(&rank, &scenario(&config, n, base));
            let before = timed_rounds(&rank, &b, &config, base, 4, &none);
            meet(&rank, 3);
            epflow_kernels::setup::bootstrap::Bootstrap::all_gather_bytes(&boot, &[1]).expect("barrier");
            if role == "victim" {
                // A crash: no destructors, a failure status (`epflow launch --restarts` starts
                // the rank again on it).
                eprintln!("rank {me}: process exits now");
                std::process::exit(3);
            }
            let stall = timed_rounds(&rank, &b, &config, base + 4, 1, &gone)[0];
            eprintln!("rank {me}: first operation without rank 1 took {stall:?} (timeout {:?})", timeout());
            let during = timed_rounds(&rank, &b, &config, base + 5, iters, &gone);
            if over_nccl {
                // Every channel's pair with the dead rank was revoked at the first deadline.
                assert_eq!(rank.nccl_reachable(), Some([0; 3]), "rank {me}: pairs with the dead rank");
            }
            // The server's form: the async `Group::admit`, whose meetings come from the rank's
            // meeting source (a TCP bootstrap on the meeting port).
            rank.set_meeting_source(Arc::clone(&meetings));
            let group = epflow_async::Group::new(rank);
            let rank = group.backend();
            let t = Instant::now();
            futures::executor::block_on(group.admit(&[1], wait)).expect("admit");
            let admit = t.elapsed();
            assert!(rank.masked_ranks().ranks.is_empty());
            if over_nccl {
                assert_eq!(
                    rank.nccl_reachable(),
                    Some([rank.nccl_peers(); 3]),
                    "rank {me}: new pairs with the newcomer"
                );
            }
            meet(rank, 2);
            let full = timed_rounds(rank, &b, &config, after, iters, &none);
            eprintln!(
                "ok: rank {me}: rounds before {:.0} us, masked {:.0} us, after the rejoin {:.0} us (medians; {iters} masked and {iters} full rounds bit-exact); first masked operation {stall:?}, admit {admit:?} (from its call, the newcomer's start included)",
                median_us(before),
                median_us(during),
                median_us(full.clone())
            );
            assert!(!rank.poison().is_poisoned());
        }
        "newcomer" => {
            let t = Instant::now();
            let rank =
                GpuWorld::rejoin_with(&*meetings(wait).expect("meeting"), config.clone(), transport).expect("rejoin");
            let joined = t.elapsed();
            let b = Bufs::new(&rank, &scenario(&config, n, after));
            meet(&rank, 2);
            let full = timed_rounds(&rank, &b, &config, after, iters, &none);
            eprintln!(
                "ok: rank {me} (newcomer{}): rejoined in {joined:?}, {iters} full rounds bit-exact, median {:.0} us",
                if over_nccl { ", over NCCL" } else { ", two device meetings with the survivor" },
                median_us(full)
            );
        }
        other => panic!("EPFLOW_TEST_REJOIN={other}: survivor, victim or newcomer"),
    }
}

/// What the in-process rejoin tests share: rejoin meetings of the group's ranks over TCP on a
/// free localhost port, and a barrier of the ranks' threads, each wait bounded by a minute.
struct LocalMeetings {
    devices: Vec<usize>,
    port: u16,
    step: common::TimedBarrier,
}

impl LocalMeetings {
    const WAIT: Duration = Duration::from_secs(60);

    fn new(devices: &[usize]) -> Self {
        let port = std::net::TcpListener::bind(("127.0.0.1", 0)).and_then(|l| l.local_addr()).expect("a port").port();
        LocalMeetings { devices: devices.to_vec(), port, step: common::TimedBarrier::new(devices.len()) }
    }

    /// Rank `me`'s end of the next meeting.
    fn meeting(&self, me: usize) -> epflow_kernels::setup::tcp_bootstrap::TcpBootstrap {
        use epflow_kernels::setup::tcp_bootstrap::{TcpBootstrap, TcpLinks};
        let links = TcpLinks::connect(me, self.devices.len(), "127.0.0.1", self.port, Self::WAIT).expect("meeting");
        TcpBootstrap::new(links, self.devices[me]).expect("meeting bootstrap")
    }

    fn barrier(&self) {
        assert!(self.step.wait(Self::WAIT), "a rank did not reach the barrier within {:?}", Self::WAIT);
    }
}

/// A kill-and-rejoin cycle's start in the in-process tests: `r`'s buffers, then `iters` full
/// rounds from scenario `from` checked against the reference, every rank's thread past them
/// (`barrier` before and after).
fn full_rounds_first(r: &GpuRank, config: &GroupConfig, from: u64, iters: u64, barrier: &dyn Fn()) -> Bufs {
    let b = Bufs::new(r, &scenario(config, r.num_ranks(), from));
    barrier();
    timed_rounds(r, &b, config, from, iters, &RankSet::new());
    barrier();
    b
}

/// Runs `f` on every rank, each on a thread of its own that owns the rank (it may drop it and
/// take a new one), and re-raises the first panic that is not a barrier timeout: a rank that
/// fails leaves the others waiting at the next barrier, and their timeouts are not the cause.
fn on_owned_ranks(ranks: Vec<GpuRank>, f: impl Fn(GpuRank) + Sync) {
    let panics: Vec<Box<dyn std::any::Any + Send>> = std::thread::scope(|s| {
        let threads: Vec<_> = ranks.into_iter().map(|rank| s.spawn(|| f(rank))).collect();
        threads.into_iter().filter_map(|t| t.join().err()).collect()
    });
    let text = |p: &Box<dyn std::any::Any + Send>| {
        p.downcast_ref::<String>().cloned().or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
    };
    let barrier = |p: &Box<dyn std::any::Any + Send>| text(p).is_some_and(|t| t.contains("did not reach the barrier"));
    let first = panics.iter().position(|p| !barrier(p)).unwrap_or(0);
    if let Some(p) = panics.into_iter().nth(first) {
        std::panic::resume_unwind(p);
    }
}

/// The replacement is a new rank of the same process (a thread of a server that drives every
/// rank): `GpuWorld::create` makes the group; each cycle the last rank's thread drops its rank
/// (its memory stays with the survivors' view until the meeting lets it go), the survivors time
/// their first operation without it and run masked rounds against the reference, then a new
/// rank of this process takes its place (`GpuWorld::rejoin` over a TCP meeting on localhost,
/// the survivors' `GpuRank::admit`) and every rank runs full rounds bit-exact. The newcomer
/// reaches the survivors' memory by address, not CUDA IPC (a process cannot open its own
/// handles). `EPFLOW_TEST_REJOIN_CYCLES` kill-and-rejoin cycles (default 3); `EPFLOW_GPU_ITERS`
/// rounds per phase (default 20). Prints per cycle the stall, the admission time and the
/// device's free memory.
#[test]
fn rejoin_in_one_process() {
    let test = "rejoin_in_one_process";
    let Some(devices) = gpus(2, test) else { return };
    let n = devices.len();
    let cycles: u64 = std::env::var("EPFLOW_TEST_REJOIN_CYCLES").ok().and_then(|s| s.parse().ok()).unwrap_or(3);
    let iters: u64 = std::env::var("EPFLOW_GPU_ITERS").ok().and_then(|s| s.parse().ok()).unwrap_or(20);
    let base = seed();
    eprintln!("{test}: seed {base} (EPFLOW_TEST_SEED replays it), {cycles} cycles, {iters} rounds per phase");
    let config = config(&devices);
    let local = LocalMeetings::new(&devices);
    let (meeting, barrier) = (|me| local.meeting(me), || local.barrier());
    let dead = n - 1;
    let (none, gone) = (RankSet::new(), RankSet::from_ranks([dead], n).unwrap());
    let ranks = GpuWorld::create(&devices, config.clone()).expect("world");
    let ctx = std::sync::Arc::clone(ranks[0].context());
    let (config, none, gone, ctx) = (&config, &none, &gone, &ctx);
    on_owned_ranks(ranks, |rank| {
        let me = rank.rank();
        let mut rank = Some(rank);
        let mut first_free = None;
        for cycle in 0..cycles {
            let from = base + cycle * 10_000;
            let r = rank.take().expect("a live rank");
            let b = full_rounds_first(&r, config, from, iters, &barrier);
            let used = if me == dead {
                // This rank's "process" dies: its rank and buffers go.
                drop((b, r));
                let t = Instant::now();
                let fresh = GpuWorld::rejoin(&meeting(me), config.clone()).expect("rejoin");
                eprintln!("{test}: cycle {cycle}: rank {me}'s replacement rejoined in {:?}", t.elapsed());
                // Its buffers before any rank runs on (a peer's kernel spinning for
                // this rank would hold up an allocation in a shared context).
                let b = full_rounds_first(&fresh, config, from + 5000, iters, &barrier);
                rank = Some(fresh);
                b
            } else {
                let stall = timed_rounds(&r, &b, config, from + 100, 1, gone)[0];
                timed_rounds(&r, &b, config, from + 101, iters, gone);
                assert_eq!(r.masked_ranks().ranks, *gone, "rank {me}");
                let t = Instant::now();
                assert_eq!(r.admit(&meeting(me)).expect("admit"), *gone);
                let admit = t.elapsed();
                assert!(r.masked_ranks().ranks.is_empty());
                barrier();
                timed_rounds(&r, &b, config, from + 5000, iters, none);
                barrier();
                let (free, _) = ctx.mem_get_info().expect("cuMemGetInfo");
                eprintln!(
                    "{test}: cycle {cycle}: rank {me}: first operation without rank {dead} took {stall:?} (timeout {:?}), admit {admit:?}, {iters} masked and {iters} full rounds bit-exact; device free memory {} MiB",
                    timeout(),
                    free >> 20
                );
                assert!(stall < timeout() + Duration::from_millis(500), "rank {me}: {stall:?}");
                assert!(!r.poison().is_poisoned());
                // No cycle may keep a replaced rank's memory: the device's free memory
                // stays within half a rank's group memory of the first cycle's.
                match first_free {
                    None => first_free = Some(free),
                    Some(first) => assert!(
                        free + r.device_memory_bytes() / 2 >= first,
                        "cycle {cycle}: free memory {} MiB, {} MiB after cycle 0 (a rank's group memory: {} MiB)",
                        free >> 20,
                        first >> 20,
                        r.device_memory_bytes() >> 20
                    ),
                }
                rank = Some(r);
                b
            };
            // Buffers go once every rank is done with the cycle's rounds.
            barrier();
            drop(used);
        }
    });
    eprintln!("ok: {test}: {cycles} cycles of kill and rejoin in one process, every round bit-exact");
}

/// Bad rejoins on GPUs, with the newcomer a new rank of the same process (cheap to set up):
/// after rank 1's thread drops its rank, (1) a replacement with another config is refused on
/// both sides (`Error::RejoinRefused` with `ConfigMismatch`), (2) a replacement that dies after
/// it reached the meeting (it drops its end at once) makes the survivor's `admit` fail, not
/// hang. After each, the survivor still has rank 1 masked, is not poisoned, and its masked
/// rounds match the reference; (3) then a good replacement rejoins and every rank runs full
/// rounds bit-exact, and a step the survivor captured before the rejoin is refused (its kernels
/// hold the replaced rank's addresses).
#[test]
fn bad_rejoins_in_one_process_change_nothing() {
    use epflow_core::RejoinRefusal;
    let test = "bad_rejoins_in_one_process_change_nothing";
    let Some(devices) = gpus(2, test) else { return };
    let n = devices.len();
    let iters: u64 = std::env::var("EPFLOW_GPU_ITERS").ok().and_then(|s| s.parse().ok()).unwrap_or(10);
    let base = seed();
    eprintln!("{test}: seed {base} (EPFLOW_TEST_SEED replays it)");
    let config = config(&devices);
    let other = config.clone().with_buffer_sets(config.buffer_sets + 1);
    let local = LocalMeetings::new(&devices);
    let (meeting, barrier) = (|me| local.meeting(me), || local.barrier());
    let dead = n - 1;
    let (none, gone) = (RankSet::new(), RankSet::from_ranks([dead], n).unwrap());
    let ranks = GpuWorld::create(&devices, config.clone()).expect("world");
    let (config, other, none, gone) = (&config, &other, &none, &gone);
    on_owned_ranks(ranks, |rank| {
        let me = rank.rank();
        let b = Bufs::new(&rank, &scenario(config, n, base));
        // The survivor captures a step now (the other rank idle at the barrier): after
        // the rejoin its kernels would address the replaced rank's memory.
        barrier();
        let captured = (me != dead).then(|| {
            let stream = rank.context().new_stream().expect("stream");
            let h = rank.graph_handle(&b.topk, &HandleOptions::default()).expect("graph handle");
            rank.capture(&stream, |cap| {
                cap.dispatch(&h, DispatchInputs::new(&b.x), &DispatchOptions::default()).map(drop)
            })
            .expect("capture")
        });
        barrier();
        timed_rounds(&rank, &b, config, base, iters, none);
        barrier();
        if me == dead {
            drop((b, rank));
            let err = GpuWorld::rejoin(&meeting(me), other.clone()).map(drop).unwrap_err();
            assert!(matches!(err, Error::RejoinRefused { rank: 1, why: RejoinRefusal::ConfigMismatch(_) }), "{err}");
            barrier();
            // A replacement that dies on reaching the meeting.
            drop(meeting(me));
            barrier();
            let fresh = GpuWorld::rejoin(&meeting(me), config.clone()).expect("rejoin");
            let b = Bufs::new(&fresh, &scenario(config, n, base + 500));
            barrier();
            timed_rounds(&fresh, &b, config, base + 500, iters, none);
            barrier();
        } else {
            timed_rounds(&rank, &b, config, base + 100, iters, gone);
            let err = rank.admit(&meeting(me)).unwrap_err();
            assert!(matches!(err, Error::RejoinRefused { rank: 1, why: RejoinRefusal::ConfigMismatch(_) }), "{err}");
            let still = |what: &str, from: u64| {
                assert_eq!(rank.masked_ranks().ranks, *gone, "{what}");
                assert!(!rank.poison().is_poisoned(), "{what}");
                timed_rounds(&rank, &b, config, from, 2, gone);
            };
            still("after the refused config", base + 200);
            barrier();
            let err = rank.admit(&meeting(me)).unwrap_err();
            eprintln!("{test}: a replacement that died at the meeting: the survivor's admit failed with: {err}");
            still("after the dead replacement", base + 300);
            barrier();
            assert_eq!(rank.admit(&meeting(me)).expect("admit"), *gone);
            let step = captured.expect("the survivor's captured step");
            match epflow_core::graph::StepBackend::launch_step(&rank, &step) {
                Err(Error::Unsupported(m)) if m.contains("captured before a rank of the group was replaced") => {}
                other => {
                    panic!("a step captured before the rejoin must be refused, got {:?}", other.map(drop))
                }
            }
            barrier();
            timed_rounds(&rank, &b, config, base + 500, iters, none);
            barrier();
        }
    });
    eprintln!(
        "ok: {test}: another config refused on both sides, a dead replacement failed the admit, nothing changed; then a good one rejoined bit-exact"
    );
}

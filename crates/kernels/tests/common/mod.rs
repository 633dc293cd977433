//! Helpers the GPU test files share: which GPUs to use (or why the test is skipped), the seed,
//! running a closure on every rank's thread, and a barrier between those threads.

use std::sync::{Condvar, Mutex};
use std::time::{Duration, SystemTime};

use epflow_kernels::{GpuRank, device_count};

/// The first `need` GPUs, or `None` after printing why `test` is skipped.
/// `EPFLOW_TEST_DEVICES` (e.g. `0,0`: two ranks on one GPU, a functional check only) replaces
/// them when it names `need` devices.
pub(crate) fn gpus(need: usize, test: &str) -> Option<Vec<usize>> {
    if let Ok(list) = std::env::var("EPFLOW_TEST_DEVICES") {
        let devices: Vec<usize> = list.split(',').filter_map(|d| d.trim().parse().ok()).collect();
        if devices.len() == need && device_count() > 0 {
            eprintln!("{test}: ranks on devices {devices:?} (EPFLOW_TEST_DEVICES)");
            return Some(devices);
        }
        eprintln!("SKIPPED {test}: EPFLOW_TEST_DEVICES={list} does not name {need} devices");
        return None;
    }
    let n = device_count();
    if n < need {
        eprintln!("SKIPPED {test}: needs {need} GPUs, this machine has {n}");
        return None;
    }
    Some((0..need).collect())
}

/// The GPU of a one-rank test: the first device `EPFLOW_TEST_DEVICES` names (so that `0,0` runs
/// it too), else GPU 0; `None` after printing why `test` is skipped.
#[allow(dead_code)]
pub(crate) fn one_gpu(test: &str) -> Option<usize> {
    if device_count() == 0 {
        eprintln!("SKIPPED {test}: no GPU");
        return None;
    }
    let first = std::env::var("EPFLOW_TEST_DEVICES")
        .ok()
        .and_then(|list| list.split(',').next().and_then(|d| d.trim().parse().ok()));
    Some(first.unwrap_or(0))
}

/// [`gpus`] for a test over NCCL, whose communicators take one GPU per rank unless NCCL is 2.30
/// or later and `NCCL_MULTI_RANK_GPU_ENABLE=1` is set: `None`, after printing why, when
/// `EPFLOW_TEST_DEVICES` names one GPU twice without that (the group would be refused).
#[allow(dead_code)]
pub(crate) fn nccl_gpus(need: usize, test: &str) -> Option<Vec<usize>> {
    let devices = gpus(need, test)?;
    let multi_rank = std::env::var("NCCL_MULTI_RANK_GPU_ENABLE").is_ok_and(|v| v.trim() == "1")
        && cudarc::nccl::result::get_nccl_version().is_ok_and(|v| v >= 23000);
    if shared_gpu_sms(&devices).is_some() && !multi_rank {
        eprintln!(
            "SKIPPED {test}: NCCL needs a GPU per rank (NCCL 2.30 takes several with NCCL_MULTI_RANK_GPU_ENABLE=1), and {devices:?} names one twice"
        );
        return None;
    }
    Some(devices)
}

/// One configuration a matrix test runs: hidden size, experts, dispatch type.
pub(crate) type World = (usize, usize, epflow_core::DispatchDtype);

/// Runs `check(devices, world)` for every world on each GPU count of `counts`, the devices
/// picked by `pick` ([`gpus`], or [`nccl_gpus`] over NCCL; a count it refuses is skipped, with
/// the reason printed), printing each world's time.
#[allow(dead_code)]
pub(crate) fn for_each_world(
    test: &str,
    counts: &[usize],
    pick: fn(usize, &str) -> Option<Vec<usize>>,
    worlds: &[World],
    check: impl Fn(&[usize], World),
) {
    for &n in counts {
        let Some(devices) = pick(n, &format!("{test} ({n} GPUs)")) else { continue };
        for &world in worlds {
            let t = std::time::Instant::now();
            check(&devices, world);
            let (h, e, dt) = world;
            eprintln!("ok: {test}, {n} GPUs H={h} E={e} {dt:?} ({:.1} s)", t.elapsed().as_secs_f64());
        }
    }
}

/// `EPFLOW_TEST_SEED`, else the clock (print it so a failure can be replayed).
pub(crate) fn seed() -> u64 {
    std::env::var("EPFLOW_TEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).map_or(1, |d| d.as_nanos() as u64))
}

/// Runs `f` on every rank, each on its own thread; results in rank order.
pub(crate) fn on_ranks<R: Send>(ranks: &[GpuRank], f: impl Fn(&GpuRank) -> R + Sync) -> Vec<R> {
    std::thread::scope(|s| {
        let hs: Vec<_> = ranks.iter().map(|r| s.spawn(|| f(r))).collect();
        hs.into_iter().map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p))).collect()
    })
}

/// Uneven token counts for `ranks` ranks: every rank routes `tokens`, the last `tokens / 2 + 1`.
#[allow(dead_code)]
pub(crate) fn uneven_tokens(ranks: usize, tokens: usize) -> Vec<usize> {
    (0..ranks).map(|r| if r + 1 == ranks { tokens / 2 + 1 } else { tokens }).collect()
}

/// The SM bound for a group on `devices`: when ranks share a GPU (`EPFLOW_TEST_DEVICES=0,0`), each
/// kernel takes at most 32 SMs, so one rank's spinning receive never starves the other rank's
/// send; `None` otherwise.
#[allow(dead_code)]
pub(crate) fn shared_gpu_sms(devices: &[usize]) -> Option<usize> {
    let mut sorted = devices.to_vec();
    sorted.sort_unstable();
    sorted.dedup();
    (sorted.len() < devices.len()).then_some(32)
}

/// The launch environment of a one-process-per-GPU test (`epflow launch -n N -- <test> <name>`):
/// its NCCL communicator and the seed every process shares (`EPFLOW_TEST_SEED`, required), or
/// `None` after printing why `test` is skipped (not started by `epflow launch`).
#[allow(dead_code)]
pub(crate) fn launched(test: &str) -> Option<(epflow_kernels::setup::bootstrap::LaunchEnv, cudarc::nccl::Comm, u64)> {
    let env = match epflow_kernels::setup::bootstrap::LaunchEnv::from_env() {
        Ok(Some(env)) => env,
        Ok(None) => {
            eprintln!("SKIPPED {test}: not started by `epflow launch`");
            return None;
        }
        Err(e) => panic!("bad launch environment: {e}"),
    };
    let comm = env.communicator().expect("NCCL communicator");
    let base: u64 = std::env::var("EPFLOW_TEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .expect("set EPFLOW_TEST_SEED in every process");
    Some((env, comm, base))
}

/// Token counts of round `it` of a soak on `ranks` ranks, on both sides of `threshold` (the most
/// tokens whose combine takes tagged rows): in turn at most `threshold` and above it, up to
/// `max_tokens`, so each rank's combine area sees both kinds of operation.
#[allow(dead_code)]
pub(crate) fn counts_across(it: u64, ranks: usize, threshold: usize, max_tokens: usize) -> Vec<usize> {
    (0..ranks as u64)
        .map(|r| {
            let v = it.wrapping_mul(7).wrapping_add(r * 13) as usize;
            if (it + r) % 2 == 0 { 1 + v % threshold } else { threshold + 1 + v % (max_tokens - threshold) }
        })
        .collect()
}

/// A barrier between the rank threads of `on_ranks` whose wait gives up after a timeout, so a
/// rank that failed before reaching it fails the test instead of hanging its peers.
#[allow(dead_code)] // not every test file uses it
pub(crate) struct TimedBarrier {
    ranks: usize,
    /// Threads waiting, and the generation (bumped when all arrive).
    state: Mutex<(usize, u64)>,
    all_here: Condvar,
}

#[allow(dead_code)]
impl TimedBarrier {
    pub(crate) fn new(ranks: usize) -> Self {
        TimedBarrier { ranks, state: Mutex::new((0, 0)), all_here: Condvar::new() }
    }

    /// Waits until every rank arrived (true) or `timeout` passed (false).
    pub(crate) fn wait(&self, timeout: Duration) -> bool {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let generation = s.1;
        s.0 += 1;
        if s.0 == self.ranks {
            *s = (0, generation + 1);
            self.all_here.notify_all();
            return true;
        }
        let (_s, waited) =
            self.all_here.wait_timeout_while(s, timeout, |s| s.1 == generation).unwrap_or_else(|e| e.into_inner());
        !waited.timed_out()
    }
}

/// What one low-latency round wrote on a rank, downloaded: the dispatch's tokens, FP8 scales,
/// counts and (rank-major) received weights and ids, and the combine's `[B x H]` tokens.
#[allow(dead_code)]
pub(crate) struct LlRound {
    pub(crate) tokens: epflow_core::HostTensor,
    pub(crate) scales: Option<epflow_core::HostTensor>,
    pub(crate) counts: epflow_core::HostTensor,
    pub(crate) rank_major: Option<(epflow_core::HostTensor, epflow_core::HostTensor)>,
    pub(crate) combined: epflow_core::HostTensor,
}

/// Checks rank `r`'s round against `sc`'s reference with identity experts (`m` tokens per rank
/// in the group's layout): the dispatch's outputs, then the combine's, bit for bit.
#[allow(dead_code)]
pub(crate) fn check_ll_round(
    sc: &epflow_core::scenario::Scenario,
    r: usize,
    layout: epflow_core::ops::Layout,
    m: usize,
    got: &LlRound,
) -> (epflow_core::verify::Report, epflow_core::verify::Report) {
    use epflow_core::HostTensor;
    use epflow_core::ops::Layout;
    use epflow_core::verify::{Tolerance, check_bf16, check_ll_dispatch, check_rank_major_dispatch};
    let (h, k) = (sc.config.hidden, sc.top_k);
    let scales = got.scales.as_ref().and_then(HostTensor::as_f32);
    let counts = got.counts.as_i32().unwrap_or_default();
    let (dr, want) = match (layout, &got.rank_major) {
        (Layout::RankMajor, Some((w, i))) => {
            let refs = sc.ll_rank_major_reference().unwrap();
            let want = sc.ll_rank_major_combine_identity_reference(&refs).unwrap();
            let (gw, gi) = (w.as_f32().unwrap_or_default(), i.as_i32().unwrap_or_default());
            (check_rank_major_dispatch(&refs[r], h, m, k, got.tokens.data(), scales, gw, gi, counts), want)
        }
        (Layout::RankMajor, None) => panic!("a rank-major round without its received weights and ids"),
        (Layout::ExpertMajor, _) => {
            let refs = sc.ll_dispatch_reference().unwrap();
            let want = sc.ll_combine_identity_reference(&refs).unwrap();
            (check_ll_dispatch(&refs[r], h, sc.num_ranks * m, got.tokens.data(), scales, counts), want)
        }
    };
    let cr = check_bf16("combine", &want[r], got.combined.as_bf16().unwrap_or_default(), Tolerance::Exact);
    (dr.context(&format!("rank {r} dispatch")), cr.context(&format!("rank {r} combine")))
}

/// An eager expert-major dispatch + combine of rank `rank` on a handle of its own, with the
/// reference's identity-expert outputs, checked against `sc`'s combine reference.
#[allow(dead_code)]
pub(crate) fn eager_ll_round(
    rank: &GpuRank,
    sc: &epflow_core::scenario::Scenario,
) -> Result<epflow_core::verify::Report, epflow_core::Error> {
    use epflow_core::backend::{Backend, blocking_combine, blocking_dispatch, blocking_handle};
    use epflow_core::ops::{CombineInputs, CombineOptions, DispatchInputs, DispatchOptions, Layout};
    use epflow_core::verify::{Tolerance, check_bf16};
    let r = rank.rank();
    let idx = rank.upload(&sc.topk_idx(r))?;
    let handle = blocking_handle(rank, &idx)?;
    let x = rank.upload(&sc.tokens(r))?;
    let w = rank.upload(&sc.weights(r))?;
    let refs = sc.ll_dispatch_reference().unwrap();
    let want = sc.ll_combine_identity_reference(&refs).unwrap();
    let y = rank.upload(&sc.ll_reference_expert_outputs(r, Layout::ExpertMajor).expect("a valid scenario"))?;
    drop(blocking_dispatch(rank, &handle, DispatchInputs::new(&x), &DispatchOptions::default(), false)?);
    let out =
        blocking_combine(rank, &handle, CombineInputs::new(&y).with_weights(&w), &CombineOptions::default(), true)?;
    let got = out.to_host()?.tokens;
    Ok(check_bf16("eager combine", &want[r], got.as_bf16().unwrap_or_default(), Tolerance::Exact))
}

//! `epflow bench`: dispatch and combine timings with ep_bench's flags, byte accounting and
//! output, plus a validation verdict against the CPU reference.

mod gpu;
mod host;
mod multi;
mod nccl_ep;
mod queued;
pub(crate) mod rank;
pub(crate) mod runner;
mod setup_cost;
pub(crate) mod stats;
mod training;

use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use epflow_core::config::MAX_TOP_K;
use epflow_core::host::HostWorld;
use epflow_core::scenario::Scenario;
use epflow_core::verify::Report;
use epflow_core::workload::RoutingKind;
use epflow_core::{DispatchDtype, GroupConfig, MaxTokens};

use crate::cli::{AlgorithmArg, BackendArg, BenchArgs, DtypeArg, LayoutArg};
use epflow_kernels::Transport;
use rank::LoopPlan;
use runner::{RankResult, References, run_rank};
use stats::{BenchReport, OpSummary, Validation};

/// A barrier whose waiters spin (yielding now and then): ranks leave it within a microsecond of
/// each other, as ep_bench's MPI barrier lets them, so launch skew does not inflate the times.
pub(crate) struct SpinBarrier {
    n: usize,
    arrived: AtomicUsize,
    generation: AtomicUsize,
}

impl SpinBarrier {
    fn new(n: usize) -> Self {
        SpinBarrier { n, arrived: AtomicUsize::new(0), generation: AtomicUsize::new(0) }
    }

    /// Waits until all `n` threads have called `wait`.
    pub(crate) fn wait(&self) {
        let generation = self.generation.load(Ordering::Acquire);
        if self.arrived.fetch_add(1, Ordering::AcqRel) + 1 == self.n {
            self.arrived.store(0, Ordering::Relaxed);
            self.generation.fetch_add(1, Ordering::Release);
            return;
        }
        let mut spins = 0u32;
        while self.generation.load(Ordering::Acquire) == generation {
            spins = spins.wrapping_add(1);
            if spins % 256 == 0 {
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
    }
}

/// Why the benchmark stopped.
#[derive(Debug)]
pub(crate) enum BenchError {
    /// Bad flags or an invalid configuration: exit code 2.
    Usage(String),
    /// A failure while running: exit code 1.
    Run(String),
}

/// Runs `epflow bench`; exit code 0 on success, 1 on a failure or a failed validation, 2 on bad
/// flags.
pub(crate) fn main(args: &BenchArgs) -> ExitCode {
    let args = &resolve_algorithm(args);
    let result = run(args);
    // `EPFLOW_HOST_STEPS=1`: the host time of each step of the operations' sends (all ranks).
    for line in epflow_kernels::device::host_steps::report() {
        eprintln!("{line}");
    }
    match result {
        Ok(None) => ExitCode::SUCCESS,
        Ok(Some(report)) => {
            if args.json {
                println!("{}", serde_json::to_string_pretty(&report).unwrap_or_default());
            } else {
                report.print_text();
            }
            match &report.validation {
                Some(v) if !v.passed => ExitCode::from(1),
                _ => ExitCode::SUCCESS,
            }
        }
        Err(BenchError::Usage(msg)) => {
            eprintln!("error: {msg}");
            ExitCode::from(2)
        }
        Err(BenchError::Run(msg)) => {
            eprintln!("error: {msg}");
            ExitCode::from(1)
        }
    }
}

/// `--algorithm auto` made concrete: low-latency up to [`epflow_core::config::HT_MIN_TOKENS`]
/// tokens per rank, high-throughput from there (see [`epflow_core::Algorithm::for_tokens`]).
pub(crate) fn resolve_algorithm(args: &BenchArgs) -> BenchArgs {
    let mut out = args.clone();
    if args.algorithm == AlgorithmArg::Auto {
        let tokens = args.tokens.unwrap_or(128);
        out.tokens = Some(tokens);
        out.algorithm = match epflow_core::Algorithm::for_tokens(tokens) {
            epflow_core::Algorithm::LowLatency => AlgorithmArg::Ll,
            epflow_core::Algorithm::HighThroughput => AlgorithmArg::Ht,
        };
        eprintln!("note: --algorithm auto: {tokens} tokens per rank -> {}", out.algorithm.name());
    }
    out
}

/// The group config the flags describe, checked for `ranks` ranks.
pub(crate) fn config_from_args(args: &BenchArgs, ranks: usize) -> Result<(GroupConfig, usize), BenchError> {
    let tokens = args.tokens.unwrap_or(match args.algorithm {
        AlgorithmArg::Ll | AlgorithmArg::Auto => 128,
        AlgorithmArg::Ht => 4096,
    });
    if tokens == 0 {
        return Err(BenchError::Usage("--tokens must be at least 1".into()));
    }
    if args.iters == 0 {
        return Err(BenchError::Usage("--iters must be at least 1".into()));
    }
    if args.round_scales && args.dtype != DtypeArg::Fp8 {
        return Err(BenchError::Usage("--round-scales needs --dtype fp8".into()));
    }
    if args.staged && args.algorithm == AlgorithmArg::Ht {
        return Err(BenchError::Usage("--staged is for --algorithm ll: high-throughput runs synchronously".into()));
    }
    if args.layout == LayoutArg::RankMajor && args.algorithm == AlgorithmArg::Ht {
        return Err(BenchError::Usage("--layout rank-major is for --algorithm ll: high-throughput is flat".into()));
    }
    if args.graph && (args.algorithm == AlgorithmArg::Ht || args.backend == BackendArg::NcclEp) {
        return Err(BenchError::Usage(
            "--graph captures epflow's low-latency operations: it needs --algorithm ll on an epflow backend".into(),
        ));
    }
    if args.queued && (args.algorithm == AlgorithmArg::Ht || args.backend == BackendArg::NcclEp) {
        return Err(BenchError::Usage(
            "--queued times epflow's low-latency operations in stream order: it needs --algorithm ll on an epflow backend"
                .into(),
        ));
    }
    if args.fresh_routing && args.algorithm != AlgorithmArg::Ht && !args.queued {
        return Err(BenchError::Usage(
            "--fresh-routing with --algorithm ll needs --queued: each queued pair then runs on a new routing, its \
             handle built in the stream's order ahead of the dispatch"
                .into(),
        ));
    }
    if args.rank_masking && args.backend == BackendArg::NcclEp {
        return Err(BenchError::Usage(
            "--rank-masking is epflow's: the nccl-ep backend runs NVIDIA's library without it".into(),
        ));
    }
    if args.layout == LayoutArg::RankMajor && args.backend == BackendArg::NcclEp {
        return Err(BenchError::Usage(
            "--layout rank-major runs on epflow's backends; the nccl-ep backend is expert-major".into(),
        ));
    }
    let dtype = match args.dtype {
        DtypeArg::Bf16 => DispatchDtype::Bf16,
        DtypeArg::Fp8 => DispatchDtype::Fp8 { round_scales: args.round_scales },
    };
    let top_k_error = || {
        BenchError::Usage(format!(
            "--top-k ({}) must be between 1 and --experts ({}), at most {MAX_TOP_K}",
            args.top_k, args.experts
        ))
    };
    if args.top_k == 0 || args.top_k > MAX_TOP_K {
        return Err(top_k_error());
    }
    let config = match args.algorithm {
        AlgorithmArg::Ll | AlgorithmArg::Auto => GroupConfig::low_latency(args.experts, tokens, args.hidden),
        // --fresh-routing also times the step in stream order, whose handles size received
        // tensors by the bound R x max_tokens_per_rank (RecvRows::Bound).
        AlgorithmArg::Ht if args.fresh_routing => {
            GroupConfig::high_throughput(args.experts, args.hidden).with_max_tokens(MaxTokens::Fixed(tokens))
        }
        AlgorithmArg::Ht => GroupConfig::high_throughput(args.experts, args.hidden),
    }
    .with_dispatch_dtype(dtype)
    .with_max_sms(args.max_sms)
    // The group's top-k bound sizes the low-latency combine buffers: the default 8, or --top-k.
    .with_max_top_k(args.top_k.max(8))
    .with_timeout(Duration::from_millis(args.timeout_ms))
    .with_rank_masking(args.rank_masking);
    config.validate(ranks).map_err(|e| BenchError::Usage(format!("invalid configuration: {e}")))?;
    if args.top_k > args.experts {
        return Err(top_k_error());
    }
    Ok((config, tokens))
}

/// Refuses (exit code 2) a run whose host memory (the scenario's inputs and references, and on
/// the host backend every rank's buffers filled to capacity) exceeds this machine's memory,
/// before any of it is allocated.
pub(crate) fn check_host_memory(
    args: &BenchArgs,
    config: &GroupConfig,
    ranks: usize,
    tokens: usize,
    host_backend: bool,
) -> Result<(), BenchError> {
    let p = |xs: &[usize]| xs.iter().fold(1u128, |acc, &x| acc.saturating_mul(x as u128));
    let (h, k) = (config.hidden, args.top_k);
    // Tokens, weights and routing per rank, plus the FP8 copy.
    let inputs = p(&[ranks, tokens]).saturating_mul(p(&[3, h]).saturating_add(p(&[12, k])));
    // Dispatch references hold every received (token, expert) row; combine references [B x H].
    let references = if args.validate { p(&[ranks, tokens, k + 1, 2, h]) } else { 0 };
    let buffers = if host_backend {
        let bounded = config.clone().with_max_tokens(MaxTokens::Fixed(tokens));
        p(&[ranks]).saturating_mul(bounded.buffer_bytes_per_rank(ranks))
    } else {
        0
    };
    let needed = inputs.saturating_add(references).saturating_add(buffers);
    let available = epflow_core::host::memory::physical_memory();
    if needed <= available {
        return Ok(());
    }
    let b = |x: u128| epflow_core::error::human_bytes(x);
    Err(BenchError::Usage(format!(
        "this run needs {} of host memory ({} of inputs, {} of references{}), more than this machine has ({}); lower --tokens, --hidden or --ranks",
        b(needed),
        b(inputs),
        b(references),
        if host_backend {
            format!(", {} of host-backend buffers for {ranks} ranks", b(buffers))
        } else {
            String::new()
        },
        b(available)
    )))
}

fn run(args: &BenchArgs) -> Result<Option<BenchReport>, BenchError> {
    if let Some(env) =
        epflow_kernels::setup::bootstrap::LaunchEnv::from_env().map_err(|e| BenchError::Usage(e.to_string()))?
    {
        return multi::run(args, &env);
    }
    run_single_process(args).map(Some)
}

fn run_single_process(args: &BenchArgs) -> Result<BenchReport, BenchError> {
    let gpus = epflow_kernels::device_count();
    let use_gpu = match args.backend {
        BackendArg::Host => false,
        BackendArg::Gpu if gpus == 0 => {
            return Err(BenchError::Usage("--backend gpu: no CUDA device found on this machine".into()));
        }
        BackendArg::Nccl if gpus == 0 => {
            return Err(BenchError::Usage("--backend nccl: no CUDA device found on this machine".into()));
        }
        BackendArg::NcclEp if gpus == 0 => {
            return Err(BenchError::Usage("--backend nccl-ep: no CUDA device found on this machine".into()));
        }
        BackendArg::Gpu | BackendArg::Nccl | BackendArg::NcclEp => true,
        BackendArg::Auto => gpus > 0,
    };
    if args.hosts.is_some() && !use_gpu {
        return Err(BenchError::Usage("--hosts needs the GPU backend".into()));
    }
    let (ranks, devices) = ranks_and_devices(args, use_gpu, gpus)?;
    let (mut config, tokens) = config_from_args(args, ranks)?;
    check_host_memory(args, &config, ranks, tokens, !use_gpu)?;
    if args.backend == BackendArg::NcclEp {
        // NCCL EP sizes every buffer from a fixed bound, high-throughput too.
        config = config.with_max_tokens(MaxTokens::Fixed(tokens));
    }
    let sc =
        Scenario::generate(config.clone(), ranks, &[tokens], args.top_k, RoutingKind::Uniform, args.masked, args.seed);
    let refs = if args.validate { Some(references(&sc, args.layout.layout())?) } else { None };
    let plan = LoopPlan::from_args(args);
    let barrier = Arc::new(SpinBarrier::new(ranks));
    let mut setup = None;
    let (backend, device, memory, results) = if args.backend == BackendArg::NcclEp {
        if args.hosts.is_some() {
            return Err(BenchError::Usage("--hosts splits the gpu backend; drop --backend nccl-ep".into()));
        }
        let world = epflow_nccl_ep::NcclEpWorld::create(&devices, config.clone())
            .map_err(|e| BenchError::Run(e.to_string()))?;
        let (path, version) = world.first().map(|r| r.library()).unwrap_or_default();
        let device = format!(
            "{ranks} x {}, one process, {version} ({path})",
            world.first().and_then(|r| r.context().name().ok()).unwrap_or_default()
        );
        let benches: Vec<_> = world
            .into_iter()
            .map(|rank| {
                rank.set_timing(true);
                let b = Arc::clone(&barrier);
                nccl_ep::NcclEpBench { rank, wait: move || b.wait() }
            })
            .collect();
        ("nccl-ep", device, None, run_ranks(benches, &sc, refs.as_ref(), &plan)?)
    } else if use_gpu {
        let transport = transport_from_args(args, ranks)?;
        let label = match &transport {
            Transport::Nccl => "nccl",
            Transport::Hierarchical { .. } => "gpu+nccl",
            _ => "gpu",
        };
        let (world, cost) = setup_cost::measure(
            &devices,
            || {
                epflow_kernels::GpuWorld::create_with(&devices, config.clone(), transport)
                    .map_err(|e| BenchError::Run(e.to_string()))
            },
            |world| world.iter().map(|r| r.device_memory_bytes() as u64).sum(),
        )?;
        setup = Some(cost);
        let memory = world.first().map(|r| r.device_memory_bytes() as u64);
        let name = world.first().and_then(|r| r.context().name().ok()).unwrap_or_default();
        let benches: Vec<_> = world
            .into_iter()
            .map(|rank| {
                rank.set_timing(true);
                let b = Arc::clone(&barrier);
                gpu::GpuBench::new(rank, move || b.wait())
            })
            .collect();
        (label, format!("{ranks} x {name}, one process"), memory, run_ranks(benches, &sc, refs.as_ref(), &plan)?)
    } else {
        let world = HostWorld::create(ranks, config.clone()).map_err(|e| BenchError::Usage(e.to_string()))?;
        let benches: Vec<host::HostBench> =
            world.into_iter().map(|rank| host::HostBench { rank, barrier: Arc::clone(&barrier) }).collect();
        ("host", "cpu (host backend)".to_string(), None, run_ranks(benches, &sc, refs.as_ref(), &plan)?)
    };
    let mut report = summarise(args, &config, backend, &device, ranks, tokens, results);
    report.device_memory_bytes_per_rank = memory;
    report.setup = setup;
    Ok(report)
}

/// The rank count and each rank's GPU in one process, from `--ranks` and `--devices`: `--ranks`
/// defaults to the GPUs named, else to every GPU (the host backend: 4); without `--devices`
/// rank `r` runs on GPU `r`.
fn ranks_and_devices(args: &BenchArgs, use_gpu: bool, gpus: usize) -> Result<(usize, Vec<usize>), BenchError> {
    let Some(devices) = &args.devices else {
        let ranks = args.ranks.unwrap_or(if use_gpu { gpus } else { 4 });
        if use_gpu && ranks > gpus {
            return Err(BenchError::Usage(format!(
                "--ranks {ranks}: this machine has {gpus} GPUs (--devices puts several ranks on one)"
            )));
        }
        return Ok((ranks, (0..ranks).collect()));
    };
    if !use_gpu {
        return Err(BenchError::Usage("--devices places GPU ranks: it needs a GPU backend".into()));
    }
    if let Some(r) = args.ranks.filter(|&r| r != devices.len()) {
        return Err(BenchError::Usage(format!(
            "--ranks {r} but --devices names {} GPUs (one per rank)",
            devices.len()
        )));
    }
    if let Some(d) = devices.iter().find(|&&d| d >= gpus) {
        return Err(BenchError::Usage(format!(
            "--devices names GPU {d}: this machine has {gpus} GPUs (0 to {})",
            gpus.saturating_sub(1)
        )));
    }
    Ok((devices.len(), devices.clone()))
}

/// The transport `--backend` and `--hosts` ask for.
pub(crate) fn transport_from_args(args: &BenchArgs, ranks: usize) -> Result<Transport, BenchError> {
    match (args.backend, args.hosts) {
        (BackendArg::Nccl, Some(_)) => {
            Err(BenchError::Usage("--hosts splits the gpu backend; drop --backend nccl".into()))
        }
        (BackendArg::Nccl, None) => Ok(Transport::Nccl),
        (_, Some(h)) => Transport::split_hosts(ranks, h).map_err(|e| BenchError::Usage(e.to_string())),
        (_, None) => Ok(Transport::Auto),
    }
}

/// Runs every rank on its own thread.
fn run_ranks<R: rank::BenchRank + Send + Sync>(
    benches: Vec<R>,
    sc: &Scenario,
    refs: Option<&References>,
    plan: &LoopPlan,
) -> Result<Vec<RankResult>, BenchError>
where
    <R::B as epflow_core::backend::Backend>::Tensor: Clone,
{
    use epflow_core::backend::Backend;
    let results: Vec<Result<RankResult, epflow_core::Error>> = std::thread::scope(|s| {
        let handles: Vec<_> = benches.iter().map(|b| s.spawn(move || run_rank(b, sc, refs, plan))).collect();
        handles.into_iter().map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p))).collect()
    });
    // With --rank-masking an operation that waited past --timeout-ms masked its peer: say so, or
    // a failed validation (the masked ranks' share is missing) would look like a wrong kernel.
    for (r, b) in benches.iter().enumerate() {
        let masked = b.backend().masked_ranks();
        if !masked.ranks.is_empty() {
            eprintln!(
                "note: rank {r} masked ranks {:?} during the run (an operation waited for them past --timeout-ms); \
                 the outputs lack their share",
                masked.ranks.iter().collect::<Vec<_>>()
            );
        }
    }
    results.into_iter().collect::<Result<_, _>>().map_err(|e| BenchError::Run(e.to_string()))
}

pub(crate) fn references(sc: &Scenario, layout: epflow_core::ops::Layout) -> Result<References, BenchError> {
    let err = |e: epflow_core::ValidationError| BenchError::Run(format!("reference: {e}"));
    Ok(match sc.config.algorithm {
        epflow_core::Algorithm::LowLatency if layout == epflow_core::ops::Layout::RankMajor => {
            let dispatch = sc.ll_rank_major_reference().map_err(err)?;
            let combine = sc.ll_rank_major_combine_identity_reference(&dispatch).map_err(err)?;
            References::RankMajor { dispatch, combine }
        }
        epflow_core::Algorithm::LowLatency => {
            let dispatch = sc.ll_dispatch_reference().map_err(err)?;
            let combine = sc.ll_combine_identity_reference(&dispatch).map_err(err)?;
            References::Ll { dispatch, combine }
        }
        epflow_core::Algorithm::HighThroughput => {
            let dispatch = sc.ht_dispatch_reference().map_err(err)?;
            let combine = sc.ht_combine_identity_reference(&dispatch).map_err(err)?;
            References::Ht { dispatch, combine }
        }
    })
}

pub(crate) fn summarise(
    args: &BenchArgs,
    config: &GroupConfig,
    backend: &str,
    device: &str,
    ranks: usize,
    tokens: usize,
    results: Vec<RankResult>,
) -> BenchReport {
    let validation = args.validate.then(|| {
        let (mut d, mut c) = (Report::default(), Report::default());
        for r in &results {
            d.merge(r.dispatch_check.clone().unwrap_or_default());
            c.merge(r.combine_check.clone().unwrap_or_default());
        }
        Validation {
            passed: d.ok() && c.ok() && d.checked > 0,
            dispatch_checked: d.checked,
            dispatch_mismatched: d.mismatched,
            combine_checked: c.checked,
            combine_mismatched: c.mismatched,
            combine_max_abs_diff: c.max_abs_diff,
            first_mismatch: d.first.or(c.first),
        }
    });
    let halves: Vec<f64> = (0..4)
        .map(|i| {
            let all: Vec<f64> = results.iter().flat_map(|r| r.halves[i].iter().copied()).collect();
            if all.is_empty() { 0.0 } else { all.iter().sum::<f64>() / all.len() as f64 }
        })
        .collect();
    let collect = |f: fn(&RankResult) -> &stats::RankTimes| -> Vec<stats::RankTimes> {
        results.iter().map(|r| f(r).clone()).collect()
    };
    // A summary of what some rank measured (`None` when no rank has a sample).
    let measured = |f: fn(&RankResult) -> &stats::RankTimes| -> Option<OpSummary> {
        results.iter().any(|r| !f(r).samples_us.is_empty()).then(|| OpSummary::from_ranks(&collect(f)))
    };
    BenchReport {
        algorithm: args.algorithm.name(),
        backend: backend.into(),
        device: device.into(),
        ranks,
        tokens,
        hidden: config.hidden,
        top_k: args.top_k,
        experts: config.num_experts,
        dtype: if config.dispatch_dtype.is_fp8() { "fp8" } else { "bf16" },
        staged: args.staged,
        layout: args.layout.layout().name(),
        warmup: args.warmup,
        iters: args.iters,
        seed: args.seed,
        dispatch: OpSummary::from_ranks(&collect(|r| &r.dispatch)),
        combine: OpSummary::from_ranks(&collect(|r| &r.combine)),
        total: OpSummary::from_ranks(&collect(|r| &r.total)),
        validation,
        device_memory_bytes_per_rank: None,
        setup: None,
        rank_masking: args.rank_masking,
        halves_us: (halves.iter().any(|&h| h > 0.0)).then(|| [halves[0], halves[1], halves[2], halves[3]]),
        fresh_routing: args.fresh_routing && args.algorithm == AlgorithmArg::Ht,
        queued_fresh_routing: args.fresh_routing && args.algorithm != AlgorithmArg::Ht,
        graph: measured(|r| &r.graph),
        stream_step: measured(|r| &r.stream_step),
        stream_step_device: measured(|r| &r.stream_step_device),
        stream_handle_device: measured(|r| &r.stream_handle_device),
        queued: results.iter().any(|r| !r.queued[0].samples_us.is_empty()).then(|| {
            [OpSummary::from_ranks(&collect(|r| &r.queued[0])), OpSummary::from_ranks(&collect(|r| &r.queued[1]))]
        }),
        host_clock: results.iter().any(|r| !r.host_clock[0].samples_us.is_empty()).then(|| {
            [
                OpSummary::from_ranks(&collect(|r| &r.host_clock[0])),
                OpSummary::from_ranks(&collect(|r| &r.host_clock[1])),
            ]
        }),
        handle: measured(|r| &r.handle),
        handle_device: measured(|r| &r.handle_device),
    }
}

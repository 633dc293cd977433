//! Two-batch overlap: a model of `--layers` MoE layers, two micro-batches in flight. While one
//! micro-batch's experts compute, the other's combine and next dispatch communicate.
//!
//! - `--backend host` (the default without GPUs): 4 ranks on the host backend; the expert function
//!   has a known cost (a timer, as GPU work would: it does not hold the CPU).
//! - `--backend gpu` (the default with GPUs): one rank per GPU (up to 4) in this process; each
//!   expert is a BF16 GEMM (cuBLAS) over the rows it received, on a compute stream of its own,
//!   repeated to match the communication time.
//!
//! Either way the expert cost is calibrated to the measured communication time per step, so that
//! compute and communication take similar time. The example runs the same steps serially and
//! pipelined, checks that both give bit-identical outputs, and prints the overlap efficiency
//! `(serial - pipelined) / min(total communication, total compute)`.
//!
//! ```sh
//! cargo run --release --example two_batch_overlap [-- --backend host|gpu --layers 16]
//! ```

use std::time::Duration;

use epflow::Group;
use epflow::core::host::{HostCombineOutput, HostDispatchOutput, HostRank, HostWorld};
use epflow::core::workload::{RoutingKind, RoutingSpec, random_tokens, random_topk_idx, random_weights};
use epflow::core::{GroupConfig, HostTensor, Result, bf16};
use epflow::runtime::pipeline::{self, PipelineStats, StepInput};

const RANKS: usize = 4;
const EXPERTS: usize = 32;
const TOKENS: usize = 64;
const HIDDEN: usize = 2048;
const TOP_K: usize = 4;
const DEPTH: usize = 2;

fn arg_str(name: &str) -> Option<String> {
    let args: Vec<String> = std::env::args().collect();
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).cloned()
}

fn arg(name: &str, default: usize) -> usize {
    arg_str(name).and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// Step `i`'s inputs on rank `r`: fresh routing per step; tokens from the previous layer's
/// combine output of the same micro-batch, or random for the first layer.
fn step_input(g: &Group<HostRank>, i: usize, prev: Option<HostCombineOutput>) -> Result<StepInput<HostRank>> {
    let r = g.rank();
    let spec = RoutingSpec {
        num_tokens: TOKENS,
        top_k: TOP_K,
        num_experts: EXPERTS,
        num_ranks: RANKS,
        masked: 2,
        kind: RoutingKind::Uniform,
    };
    let idx = HostTensor::topk_idx(TOKENS, TOP_K, random_topk_idx(&spec, 1000 + i as u64, r));
    let handle = futures::executor::block_on(g.create_handle(&idx))?;
    let tokens = match prev {
        Some(out) => out.tokens().clone(),
        None => HostTensor::tokens(TOKENS, HIDDEN, random_tokens(TOKENS, HIDDEN, 7 + i as u64, r)),
    };
    // Weights summing to ~1 per token keep activations bounded across layers.
    let w: Vec<f32> = random_weights(TOKENS, TOP_K, 3 + i as u64, r).iter().map(|v| v / TOP_K as f32).collect();
    Ok(StepInput {
        handle,
        tokens,
        weights: HostTensor::topk_weights(TOKENS, TOP_K, w),
        dispatch_options: Default::default(),
    })
}

/// The synthetic expert: identity outputs, after `cost` of (timer) compute.
async fn expert(cost: Duration, received: &HostDispatchOutput) -> Result<HostTensor> {
    if !cost.is_zero() {
        tokio::time::sleep(cost).await;
    }
    Ok(received.tokens().clone())
}

async fn run_rank(
    g: Group<HostRank>,
    steps: usize,
    cost: Duration,
    pipelined: bool,
) -> Result<(PipelineStats, Vec<bf16>)> {
    let mut last = Vec::new();
    let input = |i, prev| step_input(&g, i, prev);
    let exp = async move |_, d: &HostDispatchOutput| expert(cost, d).await;
    let sink = |_, out: HostCombineOutput| last.extend_from_slice(out.tokens().as_bf16().unwrap_or_default());
    let stats = if pipelined {
        pipeline::run(&g, steps, DEPTH, input, exp, sink).await?
    } else {
        pipeline::run_serial(&g, steps, DEPTH, input, exp, sink).await?
    };
    Ok((stats, last))
}

/// Runs every rank as a task; returns the slowest rank's stats and every rank's final outputs.
async fn run_world(steps: usize, cost: Duration, pipelined: bool) -> Result<(PipelineStats, Vec<Vec<bf16>>)> {
    let config = GroupConfig::low_latency(EXPERTS, TOKENS, HIDDEN);
    let groups = HostWorld::create(RANKS, config)?.into_iter().map(Group::new);
    let tasks: Vec<_> = groups.map(|g| tokio::spawn(run_rank(g, steps, cost, pipelined))).collect();
    let mut worst = PipelineStats::default();
    let mut outs = Vec::new();
    for t in tasks {
        let (s, out) = t.await.map_err(|e| epflow::core::Error::Backend(e.to_string()))??;
        if s.wall > worst.wall {
            worst = s;
        }
        outs.push(out);
    }
    Ok((worst, outs))
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn main() -> Result<()> {
    let gpus = epflow::kernels::device_count();
    let backend = arg_str("--backend").unwrap_or_else(|| if gpus >= 2 { "gpu".into() } else { "host".into() });
    match backend.as_str() {
        "gpu" => gpu::main(arg("--layers", 16), gpus.min(4)),
        "host" => host_main(),
        other => Err(epflow::core::Error::Unsupported(format!("--backend {other}: use host or gpu"))),
    }
}

/// Prints the comparison; fails if the pipelined outputs differ from the serial ones.
fn report(what: &str, serial: &PipelineStats, piped: &PipelineStats, identical: bool) -> Result<()> {
    let hidden = serial.wall.saturating_sub(piped.wall);
    let efficiency = hidden.as_secs_f64() / serial.comm.min(serial.compute).as_secs_f64();
    println!("  {what}");
    println!(
        "  serial:    {:8.2} ms  (communication {:.2} ms, compute {:.2} ms)",
        ms(serial.wall),
        ms(serial.comm),
        ms(serial.compute)
    );
    println!("  pipelined: {:8.2} ms", ms(piped.wall));
    println!("  overlap efficiency (serial - pipelined) / min(comm, compute): {efficiency:.3}");
    println!("  outputs of serial and pipelined runs bit-identical: {identical}");
    if identical { Ok(()) } else { Err(epflow::core::Error::Backend("pipelined outputs differ from serial".into())) }
}

fn host_main() -> Result<()> {
    let layers = arg("--layers", 16);
    let steps = layers * DEPTH;
    let rt =
        tokio::runtime::Builder::new_multi_thread().worker_threads(RANKS).enable_all().build().expect("tokio runtime");
    rt.block_on(async {
        // Calibrate: communication time per step with free experts.
        let (cal, _) = run_world(steps, Duration::ZERO, false).await?;
        let cost = cal.comm / steps as u32;
        println!(
            "two-batch overlap, host backend: {RANKS} ranks, {layers} layers x {DEPTH} micro-batches = {steps} steps"
        );
        println!("  {TOKENS} tokens/micro-batch, hidden {HIDDEN}, top-k {TOP_K}, {EXPERTS} experts");
        println!("  expert cost per step: {:.3} ms (= measured communication per step)", ms(cost));
        let (serial, out_s) = run_world(steps, cost, false).await?;
        let (piped, out_p) = run_world(steps, cost, true).await?;
        report("host backend, timer experts", &serial, &piped, out_s == out_p)
    })
}

/// The GPU version: per-expert GEMMs on a compute stream of each rank.
mod gpu {
    use std::sync::Arc;
    use std::time::Duration;

    use epflow::Group;
    use epflow::core::ops::{CountsLocation, DispatchOptions};
    use epflow::core::protocol::Channel;
    use epflow::core::workload::{RoutingKind, RoutingSpec, random_tokens, random_topk_idx, random_weights};
    use epflow::core::{DType, GroupConfig, HostTensor, Result, TensorDesc, TensorTag, bf16};
    use epflow::kernels::compute::ExpertGemm;
    use epflow::kernels::{DeviceTensor, GpuCombineOutput, GpuDispatchOutput, GpuHandle, GpuRank, GpuWorld};
    use epflow::runtime::pipeline::{self, PipelineStats, StepInput};
    use epflow::runtime::reactor::{WaitOutcome, wait_for};

    use super::{DEPTH, report};

    const EXPERTS: usize = 32;
    const TOKENS: usize = 128;
    const HIDDEN: usize = 2048;
    const TOP_K: usize = 8;

    /// The communication kernels may use this many SMs; the GEMMs get the rest.
    const COMM_SMS: usize = 48;

    /// One step's inputs, prepared before the timed runs (routing, weights, and the buffer the
    /// previous layer's output is copied into).
    struct Prepared {
        handle: GpuHandle,
        tokens: DeviceTensor,
        weights: DeviceTensor,
    }

    /// One rank with its expert weights, GEMM stream, two expert-output buffers (steps
    /// alternate between them) and every step's prepared inputs.
    struct Rank {
        g: Group<GpuRank>,
        gemm: ExpertGemm,
        w: DeviceTensor,
        out: [DeviceTensor; 2],
        steps: Vec<Prepared>,
    }

    fn err(e: impl std::fmt::Debug) -> epflow::core::Error {
        epflow::core::Error::Backend(format!("{e:?}"))
    }

    fn setup(g: Group<GpuRank>, steps: usize) -> Result<Rank> {
        let rank = g.backend();
        let ctx = Arc::clone(rank.context());
        let r = g.rank();
        // Weights scaled so that activations keep their magnitude from layer to layer.
        let scale = (3.0 / HIDDEN as f32).sqrt() / 2.0;
        let w: Vec<bf16> =
            random_tokens(HIDDEN, HIDDEN, 99, r).iter().map(|v| bf16::from_f32(v.to_f32() * scale)).collect();
        let w = rank.upload(&HostTensor::tokens(HIDDEN, HIDDEN, w))?;
        let l = EXPERTS / g.num_ranks();
        let desc = TensorDesc::contiguous(TensorTag::Tokens, DType::Bf16, &[l, g.num_ranks() * TOKENS, HIDDEN]);
        let out =
            [DeviceTensor::zeros(&ctx, rank.device(), desc.clone())?, DeviceTensor::zeros(&ctx, rank.device(), desc)?];
        let gemm = ExpertGemm::new(ctx.new_stream().map_err(err)?)?;
        let spec = RoutingSpec {
            num_tokens: TOKENS,
            top_k: TOP_K,
            num_experts: EXPERTS,
            num_ranks: g.num_ranks(),
            masked: 2,
            kind: RoutingKind::Uniform,
        };
        let steps = (0..steps)
            .map(|i| {
                let idx =
                    rank.upload(&HostTensor::topk_idx(TOKENS, TOP_K, random_topk_idx(&spec, 1000 + i as u64, r)))?;
                let handle = futures::executor::block_on(g.create_handle(&idx))?;
                let tokens =
                    rank.upload(&HostTensor::tokens(TOKENS, HIDDEN, random_tokens(TOKENS, HIDDEN, 7 + i as u64, r)))?;
                let wk: Vec<f32> =
                    random_weights(TOKENS, TOP_K, 3 + i as u64, r).iter().map(|v| v / TOP_K as f32).collect();
                let weights = rank.upload(&HostTensor::topk_weights(TOKENS, TOP_K, wk))?;
                Ok(Prepared { handle, tokens, weights })
            })
            .collect::<Result<_>>()?;
        Ok(Rank { g, gemm, w, out, steps })
    }

    /// Step `i`'s inputs; a later layer's tokens are the previous layer's output, copied on the
    /// combine stream (so the next combine cannot overwrite its buffer set first) and awaited by
    /// the dispatch on the device, not on the host.
    fn step_input(rk: &Rank, i: usize, prev: Option<GpuCombineOutput>) -> Result<StepInput<GpuRank>> {
        let p = &rk.steps[i];
        let tokens = match prev {
            Some(out) => {
                let ev = rk.g.backend().copy_on_stream(Channel::Combine, out.tokens(), &p.tokens)?;
                p.tokens.clone().ready_after(ev)
            }
            None => p.tokens.clone(),
        };
        let dispatch_options = DispatchOptions { counts_location: CountsLocation::Host, ..Default::default() };
        Ok(StepInput { handle: p.handle.clone(), tokens, weights: p.weights.clone(), dispatch_options })
    }

    /// The expert: `reps` rounds of per-expert GEMMs into the step's output buffer (0: a copy
    /// of the input, for calibration), awaited through the reactor.
    async fn expert(rk: &Rank, i: usize, reps: usize, d: &GpuDispatchOutput) -> Result<DeviceTensor> {
        let rank = rk.g.backend();
        if reps == 0 {
            // Calibration: a copy into a preallocated buffer (an allocation per step would
            // synchronize the device through cuMemFree and inflate the communication times).
            let y = &rk.out[i % 2];
            let ev = rank.copy_on_stream(Channel::Dispatch, d.tokens(), y)?;
            let ctx = Arc::clone(rank.context());
            let probe = move || ctx.bind_to_thread().is_err() || ev.try_is_complete().unwrap_or(true);
            if wait_for(probe, Duration::from_secs(10)).await == WaitOutcome::TimedOut {
                return Err(err("copy did not finish in 10 s"));
            }
            return Ok(y.clone());
        }
        let counts = d.host_counts().ok_or_else(|| err("no host counters"))?.to_vec();
        let y = &rk.out[i % 2];
        let mut last = None;
        for _ in 0..reps {
            last = Some(rk.gemm.per_expert(d.tokens(), &rk.w, y, &counts)?);
        }
        if let Some(ev) = last {
            let ev = Arc::new(ev);
            let ctx = Arc::clone(rank.context());
            let probe = move || ctx.bind_to_thread().is_err() || ev.try_is_complete().unwrap_or(true);
            if wait_for(probe, Duration::from_secs(10)).await == WaitOutcome::TimedOut {
                return Err(err("expert GEMMs did not finish in 10 s"));
            }
        }
        Ok(y.clone())
    }

    async fn run_rank(rk: &Rank, steps: usize, reps: usize, pipelined: bool) -> Result<(PipelineStats, Vec<bf16>)> {
        let g = &rk.g;
        let mut last = Vec::new();
        let input = |i, prev| step_input(rk, i, prev);
        let exp = async |i, d: &GpuDispatchOutput| expert(rk, i, reps, d).await;
        let sink = |_, out: GpuCombineOutput| {
            if let Ok(t) = out.to_host() {
                last.extend_from_slice(t.tokens.as_bf16().unwrap_or_default());
            }
        };
        let stats = if pipelined {
            pipeline::run(g, steps, DEPTH, input, exp, sink).await?
        } else {
            pipeline::run_serial(g, steps, DEPTH, input, exp, sink).await?
        };
        Ok((stats, last))
    }

    /// Runs every rank at once, each on its own executor thread; returns the slowest rank's
    /// stats and every rank's final outputs.
    fn run_all(ranks: &[Rank], steps: usize, reps: usize, pipelined: bool) -> Result<(PipelineStats, Vec<Vec<bf16>>)> {
        let results: Vec<Result<(PipelineStats, Vec<bf16>)>> = std::thread::scope(|s| {
            let hs: Vec<_> = ranks
                .iter()
                .map(|rk| {
                    s.spawn(move || {
                        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().map_err(err)?;
                        rt.block_on(run_rank(rk, steps, reps, pipelined))
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p))).collect()
        });
        let mut worst = PipelineStats::default();
        let mut outs = Vec::new();
        for r in results {
            let (s, o) = r?;
            if s.wall > worst.wall {
                worst = s;
            }
            outs.push(o);
        }
        Ok((worst, outs))
    }

    pub(crate) fn main(layers: usize, gpus: usize) -> Result<()> {
        if gpus < 2 {
            return Err(epflow::core::Error::Unsupported(format!(
                "--backend gpu needs 2 GPUs, this machine has {gpus}"
            )));
        }
        let steps = layers * DEPTH;
        let config = GroupConfig::low_latency(EXPERTS, TOKENS, HIDDEN).with_max_sms(Some(COMM_SMS));
        let devices: Vec<usize> = (0..gpus).collect();
        let ranks: Vec<Rank> = GpuWorld::create(&devices, config)?
            .into_iter()
            .map(|r| setup(Group::new(r), steps))
            .collect::<Result<_>>()?;
        // Warm up (kernel compile, cuBLAS heuristics), then calibrate: communication per step
        // with copy experts, compute per step of one GEMM round.
        run_all(&ranks, steps.min(4), 1, false)?;
        let (comm, _) = run_all(&ranks, steps, 0, false)?;
        let (one, _) = run_all(&ranks, steps, 1, false)?;
        let comm_step = comm.comm.as_secs_f64() / steps as f64;
        let gemm_step = one.compute.as_secs_f64() / steps as f64;
        let reps = ((comm_step / gemm_step).round() as usize).max(1);
        println!(
            "two-batch overlap, GPU backend: {gpus} GPUs, {layers} layers x {DEPTH} micro-batches = {steps} steps"
        );
        println!(
            "  {TOKENS} tokens/micro-batch, hidden {HIDDEN}, top-k {TOP_K}, {EXPERTS} experts, BF16; communication on at most {COMM_SMS} SMs"
        );
        println!(
            "  communication per step {:.1} us; one round of per-expert GEMMs {:.1} us; expert = {reps} rounds",
            comm_step * 1e6,
            gemm_step * 1e6
        );
        let (serial, out_s) = run_all(&ranks, steps, reps, false)?;
        let (piped, out_p) = run_all(&ranks, steps, reps, true)?;
        report("GPU backend, cuBLAS experts", &serial, &piped, out_s == out_p)
    }
}

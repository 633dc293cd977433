//! Two-batch overlap: a model of `--layers` MoE layers, `--micro-batches` (2 by default, up to
//! the group's buffer sets) in flight. While one micro-batch's experts compute, the others'
//! combine and next dispatch communicate.
//!
//! - `--backend host` (the default without GPUs): 4 ranks on the host backend; the expert function
//!   has a known cost (a timer, as GPU work would: it does not hold the CPU).
//! - `--backend gpu` (the default with GPUs): one rank per GPU (up to 8) in this process. Each
//!   expert is a padded strided-batched BF16 GEMM (cuBLAS) over the `[L x R*M x H]` receive
//!   layout, repeated to match the communication time, on the micro-batch's own stream. The
//!   pipelined run is stream-ordered (`pipeline::run_on_streams`): the host enqueues ahead and no
//!   step downloads counts. `--order on-stream|ordered` picks where the receive kernels run
//!   (on the micro-batch's stream after its earlier work, or on the communication streams);
//!   `--awaited` also times `pipeline::run` (completions awaited on the host); `--runs N`
//!   repeats the comparison and prints the median.
//!
//! Either way the expert cost is calibrated to the measured communication time per step, so that
//! compute and communication take similar time. The example runs the same steps serially
//! (everything awaited on the host) and pipelined, checks that both give bit-identical outputs,
//! and prints the overlap efficiency `(serial - pipelined) / min(total communication, total
//! compute)`.
//!
//! ```sh
//! cargo run --release --example two_batch_overlap [-- --backend host|gpu --layers 16 --micro-batches 2|3]
//! ```

use std::time::Duration;

use epflow::Group;
use epflow::core::backend::StreamOrder;
use epflow::core::host::{HostCombineOutput, HostDispatchOutput, HostRank, HostStream, HostWorld};
use epflow::core::workload::{RoutingKind, RoutingSpec, random_tokens, random_topk_idx, random_weights};
use epflow::core::{GroupConfig, HostTensor, Result, bf16};
use epflow::runtime::pipeline::{self, PipelineStats, StepInput};

const RANKS: usize = 4;
const EXPERTS: usize = 32;
const TOKENS: usize = 64;
const HIDDEN: usize = 2048;
const TOP_K: usize = 4;

#[path = "common/flags.rs"]
mod flags;

use flags::{BackendKind, OrderFlag};

/// Two-batch overlap: serial against pipelined MoE layers, bit-identical outputs and the overlap
/// efficiency. Bounds: `--layers` 1..=1024, `--micro-batches` 1..=8, `--runs` 1..=1000,
/// `--devices` at most 8 entries.
#[derive(Debug, clap::Parser)]
#[command(name = "two_batch_overlap")]
struct Flags {
    /// `gpu` (the default with 2+ GPUs or `--devices`) or `host`.
    #[arg(long, value_enum)]
    backend: Option<BackendKind>,
    /// MoE layers per micro-batch.
    #[arg(long, default_value_t = 16, value_parser = flags::int_in(1usize, 1024))]
    layers: usize,
    /// Micro-batches in flight.
    #[arg(long, default_value_t = 2, value_parser = flags::int_in(1usize, 8))]
    micro_batches: usize,
    /// (GPU) Where the receive kernels run.
    #[arg(long, value_enum, default_value_t = OrderFlag::OnStream)]
    order: OrderFlag,
    /// (GPU) The device of each rank, e.g. `0,1` (`0,0`: two ranks on one GPU, a functional
    /// check only).
    #[arg(long, value_parser = flags::devices)]
    devices: Option<flags::Devices>,
    /// (GPU) Repeats of the comparison; the median is printed.
    #[arg(long, default_value_t = 1, value_parser = flags::int_in(1usize, 1000))]
    runs: usize,
    /// (GPU) Also time `pipeline::run` (completions awaited on the host).
    #[arg(long)]
    awaited: bool,
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

/// How a host run completes its operations.
#[derive(Clone, Copy, Debug, PartialEq)]
enum HostMode {
    Serial,
    Pipelined,
    /// `pipeline::run_on_streams` with host "streams": the same semantics as `Pipelined`.
    Streams,
}

async fn run_rank(
    g: Group<HostRank>,
    steps: usize,
    depth: usize,
    cost: Duration,
    mode: HostMode,
) -> Result<(PipelineStats, Vec<bf16>)> {
    let mut last = Vec::new();
    let input = |i, prev| step_input(&g, i, prev);
    let exp = async move |_, d: &HostDispatchOutput| expert(cost, d).await;
    let sink = |_, out: HostCombineOutput| last.extend_from_slice(out.tokens().as_bf16().unwrap_or_default());
    let stats = match mode {
        HostMode::Pipelined => pipeline::run(&g, steps, depth, input, exp, sink).await?,
        HostMode::Serial => pipeline::run_serial(&g, steps, depth, input, exp, sink).await?,
        HostMode::Streams => {
            let lanes = vec![HostStream; depth];
            let exp = async move |_, _: &HostStream, d: &HostDispatchOutput| expert(cost, d).await;
            pipeline::run_on_streams(&g, steps, &lanes, StreamOrder::OnStream, input, exp, sink).await?
        }
    };
    Ok((stats, last))
}

/// Runs every rank as a task; returns the slowest rank's stats and every rank's final outputs.
async fn run_world(
    steps: usize,
    depth: usize,
    cost: Duration,
    mode: HostMode,
) -> Result<(PipelineStats, Vec<Vec<bf16>>)> {
    let config = GroupConfig::low_latency(EXPERTS, TOKENS, HIDDEN).with_buffer_sets(depth.max(2));
    let groups = HostWorld::create(RANKS, config)?.into_iter().map(Group::new);
    let tasks: Vec<_> = groups.map(|g| tokio::spawn(run_rank(g, steps, depth, cost, mode))).collect();
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
    let f = <Flags as clap::Parser>::parse();
    let gpus = epflow::kernels::device_count();
    let backend =
        f.backend.unwrap_or(if gpus >= 2 || f.devices.is_some() { BackendKind::Gpu } else { BackendKind::Host });
    match backend {
        BackendKind::Gpu => gpu::main(gpu::Args {
            layers: f.layers,
            devices: f.devices.map_or_else(|| (0..gpus.min(8)).collect(), |d| d.0),
            depth: f.micro_batches,
            order: f.order.stream_order(),
            runs: f.runs,
            awaited: f.awaited,
        }),
        BackendKind::Host => host_main(f.layers, f.micro_batches),
    }
}

/// Prints the comparison and returns the overlap efficiency; fails if the pipelined outputs
/// differ from the serial ones.
fn report(what: &str, serial: &PipelineStats, piped: &PipelineStats, identical: bool) -> Result<f64> {
    let hidden = serial.wall.saturating_sub(piped.wall);
    // Nothing to hide when either side took no measurable time: no overlap to speak of.
    let hideable = serial.comm.min(serial.compute).as_secs_f64();
    let efficiency = if hideable > 0.0 { hidden.as_secs_f64() / hideable } else { 0.0 };
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
    if piped.wall > serial.wall {
        println!("  WARNING: pipelined was slower than serial");
    }
    if identical {
        Ok(efficiency)
    } else {
        Err(epflow::core::Error::Backend("pipelined outputs differ from serial".into()))
    }
}

fn host_main(layers: usize, depth: usize) -> Result<()> {
    let steps = layers * depth;
    let rt =
        tokio::runtime::Builder::new_multi_thread().worker_threads(RANKS).enable_all().build().expect("tokio runtime");
    rt.block_on(async {
        // Calibrate: communication time per step with free experts.
        let (cal, _) = run_world(steps, depth, Duration::ZERO, HostMode::Serial).await?;
        let cost = cal.comm / steps as u32;
        println!(
            "two-batch overlap, host backend: {RANKS} ranks, {layers} layers x {depth} micro-batches = {steps} steps"
        );
        println!("  {TOKENS} tokens/micro-batch, hidden {HIDDEN}, top-k {TOP_K}, {EXPERTS} experts");
        println!("  expert cost per step: {:.3} ms (= measured communication per step)", ms(cost));
        let (serial, out_s) = run_world(steps, depth, cost, HostMode::Serial).await?;
        let (piped, out_p) = run_world(steps, depth, cost, HostMode::Pipelined).await?;
        report("host backend, timer experts", &serial, &piped, out_s == out_p)?;
        let (streamed, out_o) = run_world(steps, depth, cost, HostMode::Streams).await?;
        println!(
            "  stream-ordered API (pipeline::run_on_streams): {:8.2} ms, outputs bit-identical: {}",
            ms(streamed.wall),
            out_o == out_s
        );
        if out_o != out_s {
            return Err(epflow::core::Error::Backend("stream-ordered outputs differ from serial".into()));
        }
        Ok(())
    })
}

/// The GPU version: padded expert GEMMs on one stream per micro-batch, stream-ordered.
mod gpu {
    use std::sync::Arc;
    use std::time::Duration;

    use cudarc::driver::CudaStream;
    use epflow::Group;
    use epflow::core::backend::StreamOrder;
    use epflow::core::workload::{RoutingKind, RoutingSpec, random_tokens, random_topk_idx, random_weights};
    use epflow::core::{DType, GroupConfig, HostTensor, Result, TensorDesc, TensorTag, bf16};
    use epflow::kernels::compute::ExpertGemm;
    use epflow::kernels::{DeviceTensor, GpuCombineOutput, GpuDispatchOutput, GpuHandle, GpuRank, GpuWorld};
    use epflow::runtime::pipeline::{self, PipelineStats, StepInput};
    use epflow::runtime::reactor::{WaitOutcome, wait_for};

    use super::{ms, report};

    const EXPERTS: usize = 32;
    const TOKENS: usize = 128;
    const HIDDEN: usize = 2048;
    const TOP_K: usize = 8;

    /// The communication kernels use at most this many SMs (fewer with more micro-batches in
    /// flight: `compute::comm_sms`); the GEMMs get the rest.
    const COMM_SMS: usize = 48;

    /// How a run completes its operations.
    #[derive(Clone, Copy, Debug, PartialEq)]
    enum Mode {
        /// One step after the other, every operation and expert awaited on the host.
        Serial,
        /// `pipeline::run`: overlapped, completions awaited on the host.
        Awaited,
        /// `pipeline::run_on_streams`: overlapped, completed in stream order.
        Streams(StreamOrder),
    }

    /// One step's inputs, prepared before the timed runs (routing, first-layer tokens, weights).
    struct Prepared {
        handle: GpuHandle,
        tokens: DeviceTensor,
        weights: DeviceTensor,
    }

    /// One rank with its expert weights, one GEMM stream and expert-output buffer per
    /// micro-batch, and every step's prepared inputs.
    struct Rank {
        g: Group<GpuRank>,
        gemms: Vec<ExpertGemm>,
        streams: Vec<Arc<CudaStream>>,
        w: DeviceTensor,
        out: Vec<DeviceTensor>,
        steps: Vec<Prepared>,
    }

    fn err(e: impl std::fmt::Debug) -> epflow::core::Error {
        epflow::core::Error::Backend(format!("{e:?}"))
    }

    fn setup(g: Group<GpuRank>, steps: usize, depth: usize) -> Result<Rank> {
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
        // Every step's routing, handle, tokens and weights, and one expert output per micro-batch.
        let per_step = (rank.handle_memory_bytes() + TOKENS * TOP_K * 12 + TOKENS * HIDDEN * 2) as u128;
        super::flags::check_device_memory(
            &ctx,
            || format!("rank {r}: {steps} steps' inputs and {depth} expert outputs"),
            steps as u128 * per_step + (depth * desc.size_bytes()) as u128,
        )?;
        let out = (0..depth).map(|_| DeviceTensor::zeros(&ctx, rank.device(), desc.clone())).collect::<Result<_>>()?;
        let streams: Vec<Arc<CudaStream>> = (0..depth).map(|_| ctx.new_stream().map_err(err)).collect::<Result<_>>()?;
        let gemms = streams.iter().map(|s| ExpertGemm::new(Arc::clone(s))).collect::<Result<_>>()?;
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
        Ok(Rank { g, gemms, streams, w, out, steps })
    }

    /// Step `i`'s inputs; a later layer's tokens are the previous layer's combine output itself
    /// (a view that holds its buffer set until the dispatch has read it, ready in its stream's
    /// order).
    fn step_input(rk: &Rank, i: usize, prev: Option<GpuCombineOutput>) -> StepInput<GpuRank> {
        let p = &rk.steps[i];
        let tokens = match prev {
            Some(out) => out.tokens().clone(),
            None => p.tokens.clone(),
        };
        StepInput { handle: p.handle.clone(), tokens, weights: p.weights.clone(), dispatch_options: Default::default() }
    }

    /// Enqueues the expert of step `i` on its micro-batch's stream: `reps` rounds of the padded
    /// GEMM (no counts needed), or (0 rounds, for calibration) the received tokens themselves.
    fn enqueue_expert(rk: &Rank, i: usize, reps: usize, d: &GpuDispatchOutput) -> Result<Option<DeviceTensor>> {
        if reps == 0 {
            return Ok(None);
        }
        let m = i % rk.gemms.len();
        let y = &rk.out[m];
        let mut last = None;
        for _ in 0..reps {
            last = Some(rk.gemms[m].padded(d.tokens(), &rk.w, y)?);
        }
        Ok(Some(y.clone().ready_after(Arc::new(last.ok_or_else(|| err("no GEMM"))?))))
    }

    /// The expert, awaited on the host through the reactor (serial and awaited runs).
    async fn awaited_expert(rk: &Rank, i: usize, reps: usize, d: &GpuDispatchOutput) -> Result<DeviceTensor> {
        let Some(y) = enqueue_expert(rk, i, reps, d)? else { return Ok(d.tokens().clone()) };
        if let Some(ev) = y.ready_event().cloned() {
            let ctx = Arc::clone(rk.g.backend().context());
            let probe = move || ctx.bind_to_thread().is_err() || ev.try_is_complete().unwrap_or(true);
            if wait_for(probe, Duration::from_secs(10)).await == WaitOutcome::TimedOut {
                return Err(err("expert GEMMs did not finish in 10 s"));
            }
        }
        Ok(y)
    }

    async fn run_rank(rk: &Rank, steps: usize, reps: usize, mode: Mode) -> Result<(PipelineStats, Vec<bf16>)> {
        let g = &rk.g;
        let depth = rk.streams.len();
        let mut last = Vec::new();
        let input = |i, prev| Ok(step_input(rk, i, prev));
        let sink = |_, out: GpuCombineOutput| {
            if let Ok(t) = out.to_host() {
                last.extend_from_slice(t.tokens.as_bf16().unwrap_or_default());
            }
        };
        let stats = match mode {
            Mode::Serial => {
                let exp = async |i, d: &GpuDispatchOutput| awaited_expert(rk, i, reps, d).await;
                pipeline::run_serial(g, steps, depth, input, exp, sink).await?
            }
            Mode::Awaited => {
                let exp = async |i, d: &GpuDispatchOutput| awaited_expert(rk, i, reps, d).await;
                pipeline::run(g, steps, depth, input, exp, sink).await?
            }
            Mode::Streams(order) => {
                let exp = async |i, _: &Arc<CudaStream>, d: &GpuDispatchOutput| {
                    Ok(enqueue_expert(rk, i, reps, d)?.unwrap_or_else(|| d.tokens().clone()))
                };
                pipeline::run_on_streams(g, steps, &rk.streams, order, input, exp, sink).await?
            }
        };
        Ok((stats, last))
    }

    /// Runs every rank at once, each on its own executor thread; returns the slowest rank's
    /// stats and every rank's final outputs.
    fn run_all(ranks: &[Rank], steps: usize, reps: usize, mode: Mode) -> Result<(PipelineStats, Vec<Vec<bf16>>)> {
        let results: Vec<Result<(PipelineStats, Vec<bf16>)>> = std::thread::scope(|s| {
            let hs: Vec<_> = ranks
                .iter()
                .map(|rk| {
                    s.spawn(move || {
                        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().map_err(err)?;
                        rt.block_on(run_rank(rk, steps, reps, mode))
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

    /// What the command line asks for.
    pub(crate) struct Args {
        pub(crate) layers: usize,
        /// The device of each rank (`--devices 0,0` puts two ranks on one GPU: a functional
        /// check only, their kernels share its SMs).
        pub(crate) devices: Vec<usize>,
        pub(crate) depth: usize,
        pub(crate) order: StreamOrder,
        pub(crate) runs: usize,
        pub(crate) awaited: bool,
    }

    pub(crate) fn main(a: Args) -> Result<()> {
        let (layers, depth) = (a.layers, a.depth);
        let gpus = a.devices.len();
        if gpus < 2 {
            return Err(epflow::core::Error::Unsupported(format!(
                "--backend gpu needs 2 ranks, this machine has {gpus} GPUs (--devices 0,0 runs two on one, for checks)"
            )));
        }
        let steps = layers * depth;
        let max_sms = epflow::kernels::compute::comm_sms_for(&a.devices, depth, COMM_SMS)?;
        let config = GroupConfig::low_latency(EXPERTS, TOKENS, HIDDEN)
            .with_max_sms(Some(max_sms))
            .with_buffer_sets(depth.max(2));
        let ranks: Vec<Rank> = GpuWorld::create(&a.devices, config)?
            .into_iter()
            .map(|r| setup(Group::new(r), steps, depth))
            .collect::<Result<_>>()?;
        // Warm up (kernel compile, cuBLAS heuristics), then calibrate: communication per step
        // with identity experts, compute per step of one GEMM round.
        run_all(&ranks, steps.min(4), 1, Mode::Serial)?;
        run_all(&ranks, steps.min(4), 1, Mode::Streams(a.order))?;
        let (comm, _) = run_all(&ranks, steps, 0, Mode::Serial)?;
        let (one, _) = run_all(&ranks, steps, 1, Mode::Serial)?;
        let comm_step = comm.comm.as_secs_f64() / steps as f64;
        let gemm_step = one.compute.as_secs_f64() / steps as f64;
        let reps = ((comm_step / gemm_step).round() as usize).max(1);
        println!(
            "two-batch overlap, GPU backend: {gpus} GPUs, {layers} layers x {depth} micro-batches = {steps} steps"
        );
        println!(
            "  {TOKENS} tokens/micro-batch, hidden {HIDDEN}, top-k {TOP_K}, {EXPERTS} experts, BF16; communication on at most {max_sms} SMs"
        );
        println!(
            "  communication per step {:.1} us; one padded GEMM round {:.1} us; expert = {reps} rounds; pipelined: stream-ordered, {:?}",
            comm_step * 1e6,
            gemm_step * 1e6,
            a.order
        );
        let mut effs = Vec::new();
        for run in 0..a.runs {
            let (serial, out_s) = run_all(&ranks, steps, reps, Mode::Serial)?;
            let (piped, out_p) = run_all(&ranks, steps, reps, Mode::Streams(a.order))?;
            let what =
                format!("run {}/{}: GPU backend, cuBLAS experts, stream-ordered ({:?})", run + 1, a.runs, a.order);
            effs.push(report(&what, &serial, &piped, out_s == out_p)?);
            if a.awaited {
                let (aw, out_a) = run_all(&ranks, steps, reps, Mode::Awaited)?;
                println!(
                    "  pipelined with host-awaited completions (pipeline::run): {:8.2} ms, outputs bit-identical: {}",
                    ms(aw.wall),
                    out_a == out_s
                );
            }
        }
        if effs.len() > 1 {
            let mut sorted = effs.clone();
            sorted.sort_by(f64::total_cmp);
            let list: Vec<String> = effs.iter().map(|e| format!("{e:.3}")).collect();
            println!(
                "overlap efficiency over {} runs: median {:.3}, min {:.3} ({})",
                effs.len(),
                sorted[sorted.len() / 2],
                sorted[0],
                list.join(", ")
            );
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `--layers 0` (it divided by zero) and other bad flags are usage errors (exit code 2).
    #[test]
    fn bad_flags_are_usage_errors() {
        use clap::Parser;
        for bad in [
            &["--layers", "0"][..],
            &["--layers", "x"],
            &["--micro-batches", "9"],
            &["--runs", "0"],
            &["--order", "sideways"],
            &["--devices", "0,0,0,0,0,0,0,0,0"],
            &["--bogus"],
        ] {
            let argv = std::iter::once("two_batch_overlap").chain(bad.iter().copied());
            let e = Flags::try_parse_from(argv).expect_err("accepted");
            assert_eq!(e.exit_code(), 2, "{bad:?}: {e}");
        }
        let f = Flags::try_parse_from(["two_batch_overlap", "--layers", "1", "--devices", "0,0"]).expect("valid");
        assert_eq!((f.layers, f.devices), (1, Some(flags::Devices(vec![0, 0]))));
    }

    /// One layer of two micro-batches on the host backend: serial and pipelined outputs agree.
    #[test]
    fn one_layer_on_the_host() {
        host_main(1, 2).expect("host run");
    }
}

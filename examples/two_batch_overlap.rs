//! Two-batch overlap on the host backend: 4 ranks, a model of `--layers` MoE layers, two
//! micro-batches in flight. While one micro-batch's experts compute, the other's combine and
//! next dispatch communicate.
//!
//! The expert function has a known cost (a timer, as GPU work would: it does not hold the CPU),
//! calibrated to the measured communication time per step so that compute and communication take
//! similar time. The example runs the same steps serially and pipelined, checks that both give
//! bit-identical outputs, and prints the overlap efficiency
//! `(serial - pipelined) / min(total communication, total compute)`.
//!
//! ```sh
//! cargo run --release --example two_batch_overlap
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

fn arg(name: &str, default: usize) -> usize {
    let args: Vec<String> = std::env::args().collect();
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).and_then(|v| v.parse().ok()).unwrap_or(default)
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
    Ok(StepInput { handle, tokens, weights: HostTensor::topk_weights(TOKENS, TOP_K, w) })
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
        let identical = out_s == out_p;
        let hidden = serial.wall.saturating_sub(piped.wall);
        let efficiency = hidden.as_secs_f64() / serial.comm.min(serial.compute).as_secs_f64();
        println!(
            "  serial:    {:8.2} ms  (communication {:.2} ms, compute {:.2} ms)",
            ms(serial.wall),
            ms(serial.comm),
            ms(serial.compute)
        );
        println!("  pipelined: {:8.2} ms", ms(piped.wall));
        println!("  overlap efficiency (serial - pipelined) / min(comm, compute): {efficiency:.3}");
        println!("  outputs of serial and pipelined runs bit-identical: {identical}");
        if !identical {
            return Err(epflow::core::Error::Backend("pipelined outputs differ from serial".into()));
        }
        Ok(())
    })
}

//! `moe_serving --model NAME` (GPU): the preset's first `--layers` layers (router, attention
//! stand-in, SwiGLU experts, shared expert: `epflow::moe::gpu`) on `--batch` tokens per rank
//! per micro-batch (or each batch of `--sweep-batch`), closed loop, every operation in stream
//! order. For each batch it measures, per layer step of one micro-batch (CUDA events):
//!
//! - communication alone (dispatch and combine with identity experts, one micro-batch);
//! - compute alone (attention stand-in, router, experts and shared expert, no communication);
//! - serial (the whole layer, one micro-batch in flight) and pipelined (`--micro-batches`
//!   in flight), and the overlap efficiency `(serial - pipelined) / min(comm, compute)`;
//! - tokens/s over all ranks, micro-batch latency p50/p99 (all layers), the GPU busy fraction
//!   (the union of the micro-batches' device intervals over the run), and the host enqueue
//!   time per layer;
//! - router and experts against the same GEMMs timed alone in cuBLAS (padded shapes), and
//!   against per-expert GEMMs at the counts received (the shapes a host-synchronised layer
//!   would run).
//!
//! `--prefill-tokens N,...` measures prefill instead: a high-throughput group, each micro-batch
//! `N` tokens per rank, the experts as grouped GEMMs at the counts each handle brings to the host
//! (`Lane::forward_grouped`'s path; the host waits for each handle, as DeepEP's normal mode
//! does, while the other micro-batches' work runs). The cuBLAS comparison is decode's only.
//!
//! `--backend nccl-ep` (decode) also runs the same layer with its dispatch and combine on NVIDIA's
//! NCCL EP, in lane 0's stream order (`NcclEpStreamHandle`: `ncclEpUpdateHandle`,
//! `ncclEpDispatch`, `ncclEpCombine` on the lane's stream, nothing awaited on the host), one
//! micro-batch in flight (NCCL EP 0.1's limit), and prints epflow's tokens/s over NCCL EP's;
//! with `--check` it compares NCCL EP's serial outputs with epflow's.
//!
//! `--check` first runs `--steps` micro-batches serially and pipelined and fails unless every
//! output is bit-identical. `--json FILE` writes every figure, `--svg FILE` draws tokens/s
//! against the batch for each setting; with `--sweep-batch` the crossover (the smallest batch
//! from which more than one micro-batch in flight serves more tokens/s) is named.

use std::collections::BTreeMap;
use std::collections::VecDeque;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use cudarc::driver::{CudaEvent, CudaStream};
use epflow::Group;
use epflow::core::backend::StreamOrder;
use epflow::core::handle::RoutingHandle;
use epflow::core::ops::{CombineInputs, DispatchInputs, HandleOptions};
use epflow::core::workload::random_tokens;
use epflow::core::{Error, GroupConfig, HostTensor, MaxTokens, Result};
use epflow::kernels::{DeviceTensor, GpuCombineOutput, GpuRank, GpuWorld};
use epflow::moe::gpu::{GpuMoeModel, GroupedInputs, Lane, LayerSteps, ModelOptions};
use epflow::moe::{ModelPreset, weights::bytes_per_rank};
use epflow::runtime::pipeline::{self, StepInput};

/// Token sets per lane (a micro-batch `mb` starts from set `mb % POOL`).
const POOL: usize = 4;
/// Communication kernels use at most this many SMs (`compute::comm_sms` with the lanes).
const COMM_SMS: usize = 48;

/// What `--model` runs.
#[derive(Clone, Debug)]
pub(crate) struct ModelArgs {
    pub preset: ModelPreset,
    pub attention: bool,
    /// Batches (tokens per rank per micro-batch) to measure.
    pub batches: Vec<usize>,
    /// Micro-batches per measurement.
    pub steps: usize,
    pub json: Option<PathBuf>,
    pub svg: Option<PathBuf>,
    pub seed: u64,
    /// Replay the layer's compute pieces as CUDA graphs (`Lane::with_graphs`).
    pub graphs: bool,
    /// `--prefill-tokens`: `batches` are prefill micro-batches (high-throughput, grouped
    /// experts) instead of decode ones (low-latency, padded experts).
    pub prefill: bool,
    /// `--layer-graphs`: decode also with each layer captured whole ([`LayerSteps`]).
    pub layer_graphs: bool,
    /// `--backend nccl-ep`: decode also with the dispatch and combine on NVIDIA's NCCL EP (one
    /// micro-batch in flight, its limit), the layer's compute unchanged.
    pub nccl_ep: bool,
}

fn err(e: impl std::fmt::Debug) -> Error {
    Error::Backend(format!("{e:?}"))
}

/// One (batch, micro-batches) measurement.
#[derive(Clone, Debug, serde::Serialize)]
struct Point {
    batch: usize,
    micro_batches: usize,
    /// Per layer step of one micro-batch, µs.
    comm_us: f64,
    compute_us: f64,
    serial_us: f64,
    pipelined_us: f64,
    efficiency: f64,
    tokens_per_s: f64,
    p50_ms: f64,
    p99_ms: f64,
    busy: f64,
    enqueue_us_per_layer: f64,
    enqueue: Enqueue,
}

/// Host time per layer step, µs, by part (the dispatch's and combine's own enqueueing are not
/// in it: `epflow bench` measures them).
#[derive(Clone, Copy, Debug, Default, serde::Serialize)]
struct Enqueue {
    before_dispatch_us: f64,
    handle_us: f64,
    experts_us: f64,
    after_combine_us: f64,
    /// `--layer-graphs`: the whole layer's replay (its dispatch and combine included), and the
    /// first layer's copy of the micro-batch's tokens into the graphs' input.
    replay_us: f64,
    /// `--layer-graphs`: the median layer's replay, and the slowest (a launch that blocks
    /// because the device's queue is full shows here, not in the median).
    replay_p50_us: f64,
    replay_max_us: f64,
}

impl Enqueue {
    /// The host's time per layer step by part, from the lanes' times `t` and the handle's (or
    /// the NCCL EP calls') `handle_s` seconds over `steps` layer steps.
    fn from_lanes(t: &epflow::moe::gpu::LaneTimes, handle_s: f64, steps: f64) -> Self {
        let us = |d: f64| d / steps * 1e6;
        Enqueue {
            before_dispatch_us: us(t.before_dispatch.as_secs_f64()),
            handle_us: us(handle_s),
            experts_us: us(t.experts.as_secs_f64()),
            after_combine_us: us(t.after_combine.as_secs_f64()),
            ..Enqueue::default()
        }
    }

    fn total(&self) -> f64 {
        self.before_dispatch_us + self.handle_us + self.experts_us + self.after_combine_us + self.replay_us
    }
}

/// Router + experts against cuBLAS alone, per layer, µs.
#[derive(Clone, Debug, serde::Serialize)]
struct GemmCheck {
    batch: usize,
    router_experts_us: f64,
    cublas_padded_us: f64,
    cublas_exact_counts_us: f64,
    ratio_to_padded: f64,
    ratio_to_exact: f64,
    tokens_per_expert: f64,
    rows_per_expert: usize,
}

#[derive(Debug, serde::Serialize)]
struct Report {
    model: String,
    /// `decode` or `prefill`.
    phase: &'static str,
    ranks: usize,
    devices: Vec<usize>,
    device: String,
    layers: usize,
    attention: bool,
    compute_graphs: bool,
    order: String,
    points: Vec<Point>,
    gemms: Vec<GemmCheck>,
    crossover_batch: Option<usize>,
    checked_micro_batches: Option<usize>,
    /// `--layer-graphs`: the same settings with each layer replayed as one CUDA graph (host
    /// enqueue: the replays, dispatch and combine included).
    layer_graph_points: Vec<Point>,
    /// `--layer-graphs --check`: micro-batch outputs of the layer graphs bit-identical to the
    /// stream-ordered serial ones.
    layer_graph_checked: Option<usize>,
    /// `--layer-graphs`: the captures that failed (the run then fails after writing this).
    layer_graph_errors: Vec<String>,
    /// `--backend nccl-ep`: the library the dispatch and combine ran on (path and version).
    nccl_ep_library: Option<String>,
    /// `--backend nccl-ep`: one micro-batch in flight with NVIDIA's dispatch and combine.
    nccl_ep_points: Vec<Point>,
    /// `--backend nccl-ep --check`: per batch, how NCCL EP's serial outputs compare with
    /// epflow's (bit-identical micro-batches, and the largest difference).
    nccl_ep_check: Vec<NcclEpCheck>,
}

/// `--backend nccl-ep --check`: NCCL EP's serial outputs against epflow's, one batch.
#[derive(serde::Serialize, Clone, Debug)]
struct NcclEpCheck {
    batch: usize,
    micro_batches: usize,
    bit_identical: usize,
    /// The largest |NCCL EP - epflow| over every output value, over the largest |epflow value|.
    max_rel_diff: f64,
}

/// `--backend nccl-ep`: NVIDIA's handle and the lane's buffers its dispatch and combine write.
struct NcclEpLayer {
    handle: epflow::nccl_ep::NcclEpStreamHandle,
    /// `[L x R*M x H]` BF16: the dispatch's rows, the experts' input.
    recv: DeviceTensor,
    /// `[L]` int32: rows per local expert.
    counts: DeviceTensor,
    /// `[B x H]` BF16: the combine's output.
    combined: DeviceTensor,
}

/// A rank's state for one batch size.
struct RankRun<'a> {
    g: &'a Group<GpuRank>,
    model: &'a GpuMoeModel,
    lanes: &'a [Lane],
    inputs: &'a [DeviceTensor],
    layers: usize,
    /// Prefill: high-throughput operations, grouped experts.
    prefill: bool,
}

/// Expert inputs a real dispatch delivered, copied (to time the compute alone): decode's padded
/// `[L x R*M x H]` tokens and counts, or prefill's `N` rows with their top-k and counts.
struct ExpertInputs {
    tokens: DeviceTensor,
    counts: DeviceTensor,
    /// Prefill: the received top-k indices and weights.
    grouped: Option<(DeviceTensor, DeviceTensor)>,
}

/// Micro-batch timing marks (device events), by micro-batch number.
#[derive(Default)]
struct Marks {
    start: BTreeMap<u64, Arc<CudaEvent>>,
    end: BTreeMap<u64, Arc<CudaEvent>>,
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    if v.is_empty() { f64::NAN } else { v[v.len() / 2] }
}

fn percentile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() { f64::NAN } else { sorted[((sorted.len() as f64 * q) as usize).min(sorted.len() - 1)] }
}

fn secs(a: &CudaEvent, b: &CudaEvent) -> f64 {
    let _ = b.synchronize();
    a.elapsed_ms(b).map(|ms| f64::from(ms) / 1e3).unwrap_or(f64::NAN)
}

impl RankRun<'_> {
    /// Runs `rounds * m` micro-batches through every layer with `m` in flight (stream order).
    /// Returns the device marks, the final outputs' digests if `digest`, and the host enqueue
    /// time per layer step.
    async fn pipelined(
        &self,
        m: usize,
        rounds: usize,
        order: StreamOrder,
        digest: bool,
    ) -> Result<(Marks, BTreeMap<u64, Vec<u16>>, Enqueue)> {
        let layers = self.layers;
        let lanes = &self.lanes[..m];
        let streams: Vec<Arc<CudaStream>> = lanes.iter().map(|l| Arc::clone(l.stream())).collect();
        lanes.iter().for_each(Lane::reset_times);
        let marks = Mutex::new(Marks::default());
        let outs = Mutex::new(BTreeMap::new());
        let place = |i: usize| {
            let (lane, layer, round) = (i % m, (i / m) % layers, i / (m * layers));
            (lane, layer, (round * m + lane) as u64)
        };
        let host = Mutex::new(0f64);
        // Prefill: each step's per-expert counts, which its handle brought to the host.
        let counts: Mutex<BTreeMap<usize, Vec<i32>>> = Mutex::default();
        // A micro-batch's last combine: the shared expert's add, its end mark, its digest.
        let finish = |lane: usize, mb: u64, out: GpuCombineOutput| -> Result<()> {
            let l = &lanes[lane];
            let y = l.after_combine(self.model, &out)?;
            marks.lock().unwrap_or_else(|p| p.into_inner()).end.insert(mb, l.record()?);
            if digest {
                l.stream().synchronize().map_err(err)?;
                let h = y.download(self.g.backend().context())?;
                let bits = h.as_bf16().ok_or_else(|| err("output not BF16"))?.iter().map(|v| v.to_bits()).collect();
                outs.lock().unwrap_or_else(|p| p.into_inner()).insert(mb, bits);
            }
            Ok(())
        };
        let input = |i: usize, prev: Option<GpuCombineOutput>| -> Result<StepInput<GpuRank>> {
            let (lane, layer, mb) = place(i);
            let l = &lanes[lane];
            let x = match (layer, prev) {
                (0, prev) => {
                    // The lane's previous micro-batch ends here (its last layer's output).
                    if let Some(out) = prev {
                        finish(lane, mb - m as u64, out)?;
                    }
                    marks.lock().unwrap_or_else(|p| p.into_inner()).start.insert(mb, l.record()?);
                    self.inputs[lane * POOL + mb as usize % POOL].clone()
                }
                (_, Some(out)) => l.after_combine(self.model, &out)?,
                (_, None) => return Err(Error::Backend("a later layer without its input".into())),
            };
            let routed = l.before_dispatch(self.model, layer, &x)?;
            let t = Instant::now();
            let (handle, _created) = futures::executor::block_on(self.g.create_handle_on(
                &routed.topk_idx,
                &HandleOptions::default(),
                l.stream(),
            ))?;
            *host.lock().unwrap_or_else(|p| p.into_inner()) += t.elapsed().as_secs_f64();
            if self.prefill {
                let c = handle.recv_expert_counts().ok_or_else(|| err("a prefill handle without counts"))?.to_vec();
                counts.lock().unwrap_or_else(|p| p.into_inner()).insert(i, c);
            }
            Ok(StepInput {
                handle,
                tokens: routed.tokens,
                weights: routed.topk_weights,
                dispatch_options: Default::default(),
            })
        };
        let sink_err: Mutex<Option<Error>> = Mutex::default();
        let sink = |i: usize, out: GpuCombineOutput| {
            let (lane, _, mb) = place(i);
            if let Err(e) = finish(lane, mb, out) {
                sink_err.lock().unwrap_or_else(|p| p.into_inner()).get_or_insert(e);
            }
        };
        let expert = async |i: usize, _: &Arc<CudaStream>, d: &epflow::kernels::GpuDispatchOutput| {
            let (lane, layer, _) = place(i);
            if self.prefill {
                let c = counts.lock().unwrap_or_else(|p| p.into_inner()).remove(&i);
                let c = c.ok_or_else(|| err("a prefill step without its counts"))?;
                lanes[lane].experts_grouped(self.model, layer, d, &c)
            } else {
                lanes[lane].experts(self.model, layer, d)
            }
        };
        pipeline::run_on_streams(self.g, rounds * m * layers, &streams, order, input, expert, sink).await?;
        if let Some(e) = sink_err.into_inner().unwrap_or_else(|p| p.into_inner()) {
            return Err(e);
        }
        // Host time per layer step, by part: the lanes' (before_dispatch, experts,
        // after_combine) and the handle's creation in stream order.
        let steps = (rounds * m * layers) as f64;
        let t = lanes.iter().map(Lane::times).fold(epflow::moe::gpu::LaneTimes::default(), |a, b| {
            epflow::moe::gpu::LaneTimes {
                before_dispatch: a.before_dispatch + b.before_dispatch,
                experts: a.experts + b.experts,
                after_combine: a.after_combine + b.after_combine,
                layers: a.layers + b.layers,
            }
        });
        let enqueue = Enqueue::from_lanes(&t, host.into_inner().unwrap_or_else(|p| p.into_inner()), steps);
        Ok((
            marks.into_inner().unwrap_or_else(|p| p.into_inner()),
            outs.into_inner().unwrap_or_else(|p| p.into_inner()),
            enqueue,
        ))
    }

    /// [`RankRun::pipelined`] with every layer replayed whole from `steps` (one per lane, see
    /// [`LayerSteps`]): `rounds * m` micro-batches through every layer with `m` in flight, in
    /// the same order of collectives (round, layer, lane) and on the same token sets. The host
    /// time counted is each replay's launch and layer 0's copy of the tokens in.
    async fn pipelined_steps(
        &self,
        steps: &[LayerSteps],
        m: usize,
        rounds: usize,
        digest: bool,
    ) -> Result<(Marks, BTreeMap<u64, Vec<u16>>, Enqueue)> {
        // The lanes' scratch is the graphs' too: the stream-ordered layers run before must be done.
        for l in self.lanes {
            l.stream().synchronize().map_err(err)?;
        }
        let mut marks = Marks::default();
        let mut outs = BTreeMap::new();
        let mut host = Vec::with_capacity(rounds * m * self.layers);
        // Verdicts awaited once this many replays are behind: the host runs ahead by about two
        // rounds and no further.
        let mut pending = VecDeque::new();
        let ahead = 2 * m * self.layers;
        for round in 0..rounds {
            for layer in 0..self.layers {
                for (lane, s) in steps.iter().enumerate().take(m) {
                    let mb = (round * m + lane) as u64;
                    if layer == 0 {
                        marks.start.insert(mb, s.record()?);
                    }
                    let step = s.step(layer).ok_or_else(|| err("a layer without its step"))?;
                    let t = Instant::now();
                    if layer == 0 {
                        s.load_input(&self.inputs[lane * POOL + mb as usize % POOL])?;
                    }
                    pending.push_back(self.g.replay(step));
                    host.push(t.elapsed().as_secs_f64() * 1e6);
                    if layer + 1 == self.layers {
                        marks.end.insert(mb, s.record()?);
                        if digest {
                            s.stream().synchronize().map_err(err)?;
                            let h = s.output().download(self.g.backend().context())?;
                            let bits = h.as_bf16().ok_or_else(|| err("output not BF16"))?.iter().map(|v| v.to_bits());
                            outs.insert(mb, bits.collect());
                        }
                    }
                    while pending.len() > ahead {
                        pending.pop_front().ok_or_else(|| err("no replay"))?.await?;
                    }
                }
            }
        }
        for r in pending {
            r.await?;
        }
        let replay_us = host.iter().sum::<f64>() / host.len().max(1) as f64;
        let replay_max_us = host.iter().copied().fold(0.0, f64::max);
        let replay_p50_us = median(&mut host);
        Ok((marks, outs, Enqueue { replay_us, replay_p50_us, replay_max_us, ..Enqueue::default() }))
    }

    /// `--backend nccl-ep`: `rounds` micro-batches through every layer on lane 0, one in flight,
    /// with the dispatch and combine on NVIDIA's library in the lane's stream order
    /// (`ncclEpUpdateHandle`, `ncclEpDispatch`, `ncclEpCombine`), the rest of the layer as in
    /// [`RankRun::pipelined`] and on the same token sets. Returns what it returns (the handle's
    /// host time is the three NCCL EP calls').
    fn nccl_ep_serial(
        &self,
        ep: &NcclEpLayer,
        rounds: usize,
        digest: bool,
    ) -> Result<(Marks, BTreeMap<u64, Vec<u16>>, Enqueue)> {
        let l = &self.lanes[0];
        l.reset_times();
        let (mut marks, mut outs, mut comm_host) = (Marks::default(), BTreeMap::new(), 0f64);
        for mb in 0..rounds as u64 {
            marks.start.insert(mb, l.record()?);
            let mut x = self.inputs[mb as usize % POOL].clone();
            for layer in 0..self.layers {
                let routed = l.before_dispatch(self.model, layer, &x)?;
                let t = Instant::now();
                ep.handle.route_on(&routed.topk_idx, l.stream())?;
                ep.handle.dispatch_on(&routed.tokens, &ep.recv, &ep.counts, l.stream())?;
                comm_host += t.elapsed().as_secs_f64();
                let y = l.experts_on(self.model, layer, &ep.recv, &ep.counts)?;
                let t = Instant::now();
                ep.handle.combine_on(&y, &routed.topk_weights, &ep.combined, l.stream())?;
                comm_host += t.elapsed().as_secs_f64();
                x = l.after_combine_tokens(self.model, &ep.combined)?;
            }
            marks.end.insert(mb, l.record()?);
            if digest {
                l.stream().synchronize().map_err(err)?;
                let h = x.download(self.g.backend().context())?;
                let bits = h.as_bf16().ok_or_else(|| err("output not BF16"))?.iter().map(|v| v.to_bits()).collect();
                outs.insert(mb, bits);
            }
        }
        let enqueue = Enqueue::from_lanes(&l.times(), comm_host, (rounds * self.layers) as f64);
        Ok((marks, outs, enqueue))
    }

    /// Communication alone: one micro-batch, fixed routing, identity experts; seconds per
    /// layer step.
    async fn comm_alone(&self, steps: usize) -> Result<f64> {
        let l = &self.lanes[0];
        let x = &self.inputs[0];
        let routed = l.before_dispatch(self.model, 0, x)?;
        l.stream().synchronize().map_err(err)?;
        let ctx = self.g.backend().context();
        let (idx, w) = (routed.topk_idx.duplicate(ctx)?, routed.topk_weights.duplicate(ctx)?);
        // The shared expert's join of that call is taken here, so the lane stays balanced.
        let _ = l.after_combine_tokens(self.model, x)?;
        let handle = self.g.create_handle(&idx).await?;
        let streams = [Arc::clone(l.stream())];
        let input = |_: usize, _: Option<GpuCombineOutput>| -> Result<StepInput<GpuRank>> {
            Ok(StepInput {
                handle: handle.clone(),
                tokens: x.clone(),
                weights: w.clone(),
                dispatch_options: Default::default(),
            })
        };
        let expert =
            async |_: usize, _: &Arc<CudaStream>, d: &epflow::kernels::GpuDispatchOutput| Ok(d.tokens().clone());
        let t0 = l.record()?;
        pipeline::run_on_streams(self.g, steps, &streams, StreamOrder::OnStream, input, expert, |_, _| ()).await?;
        let t1 = l.record()?;
        Ok(secs(&t0, &t1) / steps as f64)
    }

    /// One awaited layer step on input 0: the expert inputs and device counts a real dispatch
    /// delivers (copied), and the counts on the host.
    async fn captured_expert_inputs(&self) -> Result<(ExpertInputs, Vec<i32>)> {
        let l = &self.lanes[0];
        let routed = l.before_dispatch(self.model, 0, &self.inputs[0])?;
        l.stream().synchronize().map_err(err)?;
        let ctx = self.g.backend().context();
        let (idx, weights) = (routed.topk_idx.duplicate(ctx)?, routed.topk_weights.duplicate(ctx)?);
        let _ = l.after_combine_tokens(self.model, &self.inputs[0])?;
        let handle = self.g.create_handle(&idx).await?;
        let inputs = DispatchInputs::new(&routed.tokens);
        let inputs = if self.prefill { inputs.with_weights(&weights) } else { inputs };
        let d = self.g.dispatch(&handle, inputs).await?;
        let counts = d.counts().ok_or_else(|| err("no device counts"))?.duplicate(ctx)?;
        let host = counts.download(ctx)?.as_i32().map(<[i32]>::to_vec).unwrap_or_default();
        let tokens = d.tokens().duplicate(ctx)?;
        let grouped = if self.prefill {
            let idx = d.topk_idx().ok_or_else(|| err("no received top-k"))?.duplicate(ctx)?;
            let weights = d.topk_weights().ok_or_else(|| err("no received weights"))?.duplicate(ctx)?;
            Some((idx, weights))
        } else {
            None
        };
        let captured = ExpertInputs { tokens, counts, grouped };
        let combine = CombineInputs::new(d.tokens());
        let combine = if self.prefill { combine } else { combine.with_weights(&weights) };
        let c = self.g.combine(&handle, combine).await?;
        drop((d, c));
        Ok((captured, host))
    }

    /// Compute alone on lane 0: every layer's attention stand-in, router, shared expert,
    /// experts (on captured inputs) and the shared expert's add; seconds per layer step.
    fn compute_alone(&self, steps: usize, captured: &ExpertInputs, host_counts: &[i32]) -> Result<f64> {
        let l = &self.lanes[0];
        let t0 = l.record()?;
        for s in 0..steps {
            let layer = s % self.layers;
            let x = &self.inputs[s % POOL];
            let r = l.before_dispatch(self.model, layer, x)?;
            let (tokens, counts) = (&captured.tokens, &captured.counts);
            let y = match &captured.grouped {
                None => l.experts_on(self.model, layer, tokens, counts)?,
                Some((topk_idx, topk_weights)) => {
                    let inputs = GroupedInputs { tokens, topk_idx, topk_weights, counts, host_counts };
                    l.experts_grouped_on(self.model, layer, &inputs)?
                }
            };
            drop(y);
            let _ = l.after_combine_tokens(self.model, &r.tokens.clone())?;
        }
        let t1 = l.record()?;
        Ok(secs(&t0, &t1) / steps as f64)
    }

    /// Router + experts, and the same GEMMs in cuBLAS alone (padded, then at the received
    /// counts), medians over `reps` per layer, seconds.
    fn gemm_check(
        &self,
        reps: usize,
        expert_in: &DeviceTensor,
        counts: &DeviceTensor,
        host_counts: &[i32],
    ) -> Result<(f64, f64, f64)> {
        let l = &self.lanes[0];
        let x = &self.inputs[0];
        let time = |f: &dyn Fn() -> Result<()>| -> Result<f64> {
            f()?;
            let mut v = Vec::with_capacity(reps);
            for _ in 0..reps {
                let a = l.record()?;
                f()?;
                let b = l.record()?;
                v.push(secs(&a, &b));
            }
            Ok(median(&mut v))
        };
        let ours = time(&|| l.router_and_experts(self.model, 0, x, expert_in, counts))?;
        let padded = time(&|| l.gemms_alone(self.model, 0, x, expert_in, None))?;
        let exact = time(&|| l.gemms_alone(self.model, 0, x, expert_in, Some(host_counts)))?;
        Ok((ours, padded, exact))
    }
}

/// What a batch's points share: communication and compute alone (seconds per layer step).
struct Measured {
    batch: usize,
    ranks: usize,
    layers: usize,
    comm: f64,
    compute: f64,
}

impl Measured {
    /// The point of `m` in flight over `rounds` rounds from its device marks; `serial_step`
    /// (seconds per layer step) is set by the `m == 1` point, which comes first.
    fn point(&self, m: usize, rounds: usize, marks: &Marks, enqueue: Enqueue, serial_step: &mut f64) -> Result<Point> {
        let first = marks.start.values().next().ok_or_else(|| err("no marks"))?;
        let mut intervals = Vec::new();
        let mut latencies = Vec::new();
        for (mb, s) in &marks.start {
            let e = marks.end.get(mb).ok_or_else(|| err("a micro-batch without its end"))?;
            let (t0, t1) = (secs(first, s), secs(first, e));
            intervals.push((t0, t1));
            latencies.push(t1 - t0);
        }
        let wall = intervals.iter().map(|i| i.1).fold(0.0, f64::max);
        let busy = super::union(&mut intervals) / wall.max(1e-12);
        latencies.sort_by(f64::total_cmp);
        let per_step = wall / (rounds * m * self.layers) as f64;
        if m == 1 {
            *serial_step = per_step;
        }
        let micro = (rounds * m) as f64;
        Ok(Point {
            batch: self.batch,
            micro_batches: m,
            comm_us: self.comm * 1e6,
            compute_us: self.compute * 1e6,
            serial_us: *serial_step * 1e6,
            pipelined_us: per_step * 1e6,
            efficiency: (*serial_step - per_step) / self.comm.min(self.compute).max(1e-12),
            tokens_per_s: micro * self.batch as f64 * self.ranks as f64 / wall.max(1e-12),
            p50_ms: percentile(&latencies, 0.5) * 1e3,
            p99_ms: percentile(&latencies, 0.99) * 1e3,
            busy,
            enqueue_us_per_layer: enqueue.total(),
            enqueue,
        })
    }
}

/// Device bytes one rank needs beyond the weights: lanes and token sets.
fn scratch_bytes(p: &ModelPreset, ranks: usize, batch: usize, lanes: usize, attention: bool, prefill: bool) -> u128 {
    let lane = if prefill {
        Lane::bytes(p, ranks, batch, 0, attention) + Lane::grouped_bytes(p, ranks, ranks * batch)
    } else {
        Lane::bytes(p, ranks, batch, ranks * batch, attention)
    };
    lanes as u128 * (lane + (POOL * batch * p.hidden * 2) as u128)
}

/// What rank `r` measured for one batch.
struct RankFigures {
    points: Vec<Point>,
    layer_graph_points: Vec<Point>,
    layer_graph_checked: Option<usize>,
    layer_graph_error: Option<String>,
    /// Decode only: router + experts against cuBLAS alone.
    gemm: Option<GemmCheck>,
    checked: Option<usize>,
    /// `--backend nccl-ep`: one micro-batch in flight on NVIDIA's dispatch and combine.
    nccl_ep_point: Option<Point>,
    nccl_ep_check: Option<NcclEpCheck>,
}

#[allow(clippy::too_many_arguments)]
fn measure_rank(
    g: &Group<GpuRank>,
    a: &super::Args,
    m_args: &ModelArgs,
    batch: usize,
    lanes_n: usize,
    nccl_ep: Option<&epflow::nccl_ep::NcclEpRank>,
) -> Result<RankFigures> {
    let p = m_args.preset;
    let ranks = g.num_ranks();
    let r = g.rank();
    let local = p.num_experts / ranks;
    let nccl_ep_bytes = (local * ranks * batch * p.hidden * 2 + batch * p.hidden * 2 + local * 4) as u128;
    let reserve = scratch_bytes(&p, ranks, batch, lanes_n, m_args.attention, m_args.prefill)
        + if m_args.layer_graphs { lanes_n as u128 * LayerSteps::bytes(&p, ranks, batch, a.layers) } else { 0 }
        + if nccl_ep.is_some() { nccl_ep_bytes } else { 0 };
    let opts = ModelOptions { seed: m_args.seed, layers: a.layers, attention: m_args.attention };
    let model = GpuMoeModel::new(g.backend(), p, opts, reserve)?;
    let lane = || -> Result<Lane> {
        if m_args.prefill {
            Lane::new(&model, batch, 0)?.with_grouped_experts(&model, ranks * batch)?.with_graphs(m_args.graphs)
        } else {
            Lane::new(&model, batch, ranks * batch)?.with_graphs(m_args.graphs)
        }
    };
    let lanes: Vec<Lane> = (0..lanes_n).map(|_| lane()).collect::<Result<_>>()?;
    let inputs: Vec<DeviceTensor> = (0..lanes_n * POOL)
        .map(|i| {
            g.backend().upload(&HostTensor::tokens(
                batch,
                p.hidden,
                random_tokens(batch, p.hidden, 1000 + (i % POOL) as u64, r),
            ))
        })
        .collect::<Result<_>>()?;
    let run = RankRun { g, model: &model, lanes: &lanes, inputs: &inputs, layers: a.layers, prefill: m_args.prefill };
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().map_err(err)?;
    rt.block_on(async {
        let steps = m_args.steps;
        // Warm-up: NVRTC, cuBLAS heuristics, the buffer sets.
        run.pipelined(lanes_n, 1, a.order, false).await?;
        // `--layer-graphs`: each lane's layers captured whole, once the eager warm-up loaded
        // every kernel and nothing of the lanes runs.
        let mut layer_graph_error = None;
        let layer_steps: Vec<LayerSteps> = if m_args.layer_graphs {
            for l in &lanes {
                l.stream().synchronize().map_err(err)?;
            }
            // A capture that fails leaves the group whole: the stream-ordered figures go on, and
            // the run fails at its end, naming it.
            match lanes.iter().map(|l| l.capture_layers(&model, g.backend(), a.layers)).collect::<Result<Vec<_>>>() {
                Ok(steps) => {
                    run.pipelined_steps(&steps, lanes_n, 1, false).await?;
                    steps
                }
                Err(e) => {
                    eprintln!("[moe_serving] rank {r}, batch {batch}: --layer-graphs: the capture failed: {e}");
                    layer_graph_error = Some(format!("batch {batch}: {e}"));
                    Vec::new()
                }
            }
        } else {
            Vec::new()
        };
        let (mut checked, mut layer_graph_checked, mut serial_outputs) = (None, None, None);
        if a.check {
            let rounds = steps.div_ceil(lanes_n);
            let (_, piped, _) = run.pipelined(lanes_n, rounds, a.order, true).await?;
            let (_, serial, _) = run.pipelined(1, rounds * lanes_n, a.order, true).await?;
            let same = |what: &str, other: &BTreeMap<u64, Vec<u16>>| {
                if *other == serial {
                    return Ok(());
                }
                let differ = other.iter().filter(|(k, v)| serial.get(k) != Some(v)).count();
                Err(Error::Backend(format!(
                    "rank {r}: {differ} of {} micro-batch outputs differ between {what} and serial",
                    other.len()
                )))
            };
            same(&format!("{lanes_n} in flight"), &piped)?;
            checked = Some(piped.len());
            if !layer_steps.is_empty() {
                let (_, graphs, _) = run.pipelined_steps(&layer_steps, lanes_n, rounds, true).await?;
                same(&format!("{lanes_n} in flight with layer graphs"), &graphs)?;
                layer_graph_checked = Some(graphs.len());
            }
            serial_outputs = Some(serial);
        }
        let comm = run.comm_alone(steps * a.layers).await?;
        let (captured, host_counts) = run.captured_expert_inputs().await?;
        let compute = run.compute_alone(steps * a.layers, &captured, &host_counts)?;
        let gemm = match &captured.grouped {
            None => {
                let (ours, padded, exact) = run.gemm_check(20, &captured.tokens, &captured.counts, &host_counts)?;
                let local = host_counts.len().max(1);
                Some(GemmCheck {
                    batch,
                    router_experts_us: ours * 1e6,
                    cublas_padded_us: padded * 1e6,
                    cublas_exact_counts_us: exact * 1e6,
                    ratio_to_padded: ours / padded,
                    ratio_to_exact: ours / exact,
                    tokens_per_expert: host_counts.iter().map(|&c| f64::from(c)).sum::<f64>() / local as f64,
                    rows_per_expert: ranks * batch,
                })
            }
            Some(_) => None,
        };
        let mut points = Vec::new();
        let mut serial_step = f64::NAN;
        let mut settings = a.micro_batches.clone();
        if !settings.contains(&1) {
            settings.insert(0, 1);
        }
        let measured = Measured { batch, ranks, layers: a.layers, comm, compute };
        for &m in &settings {
            let rounds = steps.div_ceil(m);
            let (marks, _, enqueue) = run.pipelined(m, rounds, a.order, false).await?;
            points.push(measured.point(m, rounds, &marks, enqueue, &mut serial_step)?);
        }
        let mut layer_graph_points = Vec::new();
        let mut serial_step = f64::NAN;
        for &m in settings.iter().filter(|_| !layer_steps.is_empty()) {
            let rounds = steps.div_ceil(m);
            let (marks, _, enqueue) = run.pipelined_steps(&layer_steps, m, rounds, false).await?;
            layer_graph_points.push(measured.point(m, rounds, &marks, enqueue, &mut serial_step)?);
        }
        // `--backend nccl-ep`: the same layer, one micro-batch in flight, NVIDIA's dispatch and
        // combine in lane 0's stream order.
        let (mut nccl_ep_point, mut nccl_ep_check) = (None, None);
        if let Some(er) = nccl_ep {
            for l in &lanes {
                l.stream().synchronize().map_err(err)?;
            }
            let (ctx, dev) = (g.backend().context(), g.backend().device());
            let zeros = |dtype, tag, shape: &[usize]| {
                DeviceTensor::zeros(ctx, dev, epflow::core::TensorDesc::contiguous(tag, dtype, shape))
            };
            use epflow::core::{DType, TensorTag};
            let ep = NcclEpLayer {
                handle: er.stream_handle(p.top_k)?,
                recv: zeros(DType::Bf16, TensorTag::Tokens, &[local, ranks * batch, p.hidden])?,
                counts: zeros(DType::I32, TensorTag::RecvExpertCountsDevice, &[local])?,
                combined: zeros(DType::Bf16, TensorTag::Tokens, &[batch, p.hidden])?,
            };
            run.nccl_ep_serial(&ep, 1, false)?;
            if let Some(serial) = &serial_outputs {
                let (_, theirs, _) = run.nccl_ep_serial(&ep, serial.len(), true)?;
                nccl_ep_check = Some(compare_outputs(batch, serial, &theirs)?);
            }
            let (marks, _, enqueue) = run.nccl_ep_serial(&ep, steps, false)?;
            let mut serial_step = f64::NAN;
            nccl_ep_point = Some(measured.point(1, steps, &marks, enqueue, &mut serial_step)?);
            lanes[0].stream().synchronize().map_err(err)?;
        }
        if let Some((graphs, failed)) = lanes.iter().filter_map(Lane::graph_counts).reduce(|a, b| (a.0 + b.0, a.1 + b.1)) {
            if failed > 0 || r == 0 {
                eprintln!("[moe_serving] rank {r}, batch {batch}: {graphs} layer pieces replayed as CUDA graphs, {failed} call by call (their capture failed)");
            }
        }
        Ok(RankFigures {
            points,
            layer_graph_points,
            layer_graph_checked,
            layer_graph_error,
            gemm,
            checked,
            nccl_ep_point,
            nccl_ep_check,
        })
    })
}

/// `--backend nccl-ep --check`: NCCL EP's serial outputs against epflow's, micro-batch by
/// micro-batch (BF16 bits).
fn compare_outputs(
    batch: usize,
    ours: &BTreeMap<u64, Vec<u16>>,
    theirs: &BTreeMap<u64, Vec<u16>>,
) -> Result<NcclEpCheck> {
    let f = |b: u16| f64::from(f32::from_bits(u32::from(b) << 16));
    let (mut identical, mut max_diff, mut max_val) = (0, 0f64, 0f64);
    for (mb, a) in ours {
        let b = theirs.get(mb).ok_or_else(|| err(format!("NCCL EP: micro-batch {mb} has no output")))?;
        if a == b {
            identical += 1;
        }
        for (&x, &y) in a.iter().zip(b) {
            max_val = max_val.max(f(x).abs());
            max_diff = max_diff.max((f(x) - f(y)).abs());
        }
    }
    Ok(NcclEpCheck {
        batch,
        micro_batches: ours.len(),
        bit_identical: identical,
        max_rel_diff: max_diff / max_val.max(f64::MIN_POSITIVE),
    })
}

fn device_name(device: usize) -> String {
    cudarc::driver::CudaContext::new(device).and_then(|c| c.name()).unwrap_or_else(|_| format!("GPU {device}"))
}

/// `--model`: the measurements for every batch, the table, the JSON and the chart.
pub(crate) fn main(a: &super::Args, m_args: &ModelArgs) -> Result<()> {
    let devices: Vec<usize> = a.devices.clone().unwrap_or_else(|| vec![0]);
    let ranks = devices.len();
    let p = m_args.preset;
    p.check(ranks)?;
    let lanes_n = a.micro_batches.iter().copied().max().unwrap_or(1).max(1);
    let shared_gpu = devices.iter().any(|d| devices.iter().filter(|x| *x == d).count() > 1);
    if m_args.nccl_ep && shared_gpu {
        return Err(Error::Unsupported(format!(
            "--backend nccl-ep: NCCL takes one GPU per rank of a communicator, and --devices {devices:?} names one twice"
        )));
    }
    let phase = if m_args.prefill { "prefill" } else { "decode" };
    println!(
        "moe_serving --model {} ({phase}): {ranks} rank(s) on GPUs {devices:?} ({}){}, {} layers, attention stand-in {}, compute {}, weights {:.2} GiB per layer per rank, {} micro-batches per measurement, receive kernels {:?}",
        p.name,
        device_name(devices[0]),
        if shared_gpu { " [ranks share a GPU: a functional check, not a performance figure]" } else { "" },
        a.layers,
        if m_args.attention { "on" } else { "off" },
        if m_args.graphs { "replayed as CUDA graphs" } else { "enqueued call by call" },
        bytes_per_rank(&p, ranks) as f64 / (1u64 << 30) as f64,
        m_args.steps,
        a.order
    );
    let mut points = Vec::new();
    let (mut layer_graph_points, mut layer_graph_checked, mut layer_graph_errors) = (Vec::new(), None, Vec::new());
    let mut gemms = Vec::new();
    let mut checked = None;
    let (mut nccl_ep_points, mut nccl_ep_check, mut nccl_ep_library) = (Vec::new(), Vec::new(), None);
    if m_args.nccl_ep && a.micro_batches.iter().any(|&m| m > 1) {
        println!(
            "  NCCL EP: one micro-batch in flight only. NCCL EP 0.1 keeps one low-latency buffer per group and a double-buffer index per handle, so two micro-batches in flight on two streams would write the same half of it; {} in flight are measured on epflow alone",
            a.micro_batches.iter().filter(|&&m| m > 1).map(ToString::to_string).collect::<Vec<_>>().join(", ")
        );
    }
    for &batch in &m_args.batches {
        let started = Instant::now();
        let sets = lanes_n.max(2);
        let comm_sms = epflow::kernels::compute::comm_sms_for(&devices, sets, COMM_SMS)?;
        let config = if m_args.prefill {
            GroupConfig::high_throughput(p.num_experts, p.hidden).with_max_tokens(MaxTokens::Fixed(batch))
        } else {
            GroupConfig::low_latency(p.num_experts, batch, p.hidden)
        };
        let config = config.with_max_top_k(p.top_k).with_max_sms(Some(comm_sms)).with_buffer_sets(sets);
        // `--backend nccl-ep`: NVIDIA's group beside epflow's, for the same batch.
        let nccl_ep_ranks = if m_args.nccl_ep {
            let ranks = epflow::nccl_ep::NcclEpWorld::create(&devices, config.clone())?;
            if let Some(r) = ranks.first() {
                let (path, version) = r.library();
                nccl_ep_library.get_or_insert_with(|| format!("{path} ({version})"));
            }
            ranks
        } else {
            Vec::new()
        };
        let groups: Vec<Group<GpuRank>> = GpuWorld::create(&devices, config)?.into_iter().map(Group::new).collect();
        let figures: Vec<Result<RankFigures>> = std::thread::scope(|s| {
            let hs: Vec<_> = groups
                .iter()
                .enumerate()
                .map(|(r, g)| {
                    let ep = nccl_ep_ranks.get(r);
                    s.spawn(move || measure_rank(g, a, m_args, batch, lanes_n, ep))
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p))).collect()
        });
        let figures = figures.into_iter().collect::<Result<Vec<_>>>()?;
        // Rank 0's figures (every rank runs the same steps; the slowest sets the pace).
        let f = figures.into_iter().next().ok_or_else(|| err("no rank"))?;
        if let Some(n) = f.checked {
            checked = Some(checked.unwrap_or(0) + n);
            println!("  batch {batch}: {n} micro-batch outputs with {lanes_n} in flight bit-identical to serial");
        }
        if let Some(gm) = &f.gemm {
            println!(
                "  batch {batch:4}: router+experts {:.1} us; cuBLAS alone {:.1} us padded ({:.2}x), {:.1} us at the received counts ({:.2}x; {:.1} tokens per expert of {} rows)",
                gm.router_experts_us,
                gm.cublas_padded_us,
                gm.ratio_to_padded,
                gm.cublas_exact_counts_us,
                gm.ratio_to_exact,
                gm.tokens_per_expert,
                gm.rows_per_expert
            );
        }
        if let Some(n) = f.layer_graph_checked {
            layer_graph_checked = Some(layer_graph_checked.unwrap_or(0) + n);
            println!(
                "  batch {batch}: {n} micro-batch outputs with {lanes_n} in flight, layer graphs, bit-identical to serial"
            );
        }
        for (pt, how) in
            f.points.iter().map(|p| (p, "")).chain(f.layer_graph_points.iter().map(|p| (p, " [layer graphs]")))
        {
            println!(
                "  batch {batch:4}, {} in flight{how}: comm {:.1} us, compute {:.1} us, serial {:.1} us, pipelined {:.1} us per layer step; efficiency {:.2}; {:.0} tokens/s; latency p50 {:.2} ms p99 {:.2} ms; GPU busy {:.1} %; host enqueue {:.1} us per layer (router/attention/shared {:.1}, handle {:.1}, experts {:.1}, add {:.1}, whole-layer replay {:.1}, median {:.1}, max {:.1})",
                pt.micro_batches,
                pt.comm_us,
                pt.compute_us,
                pt.serial_us,
                pt.pipelined_us,
                pt.efficiency,
                pt.tokens_per_s,
                pt.p50_ms,
                pt.p99_ms,
                pt.busy * 100.0,
                pt.enqueue_us_per_layer,
                pt.enqueue.before_dispatch_us,
                pt.enqueue.handle_us,
                pt.enqueue.experts_us,
                pt.enqueue.after_combine_us,
                pt.enqueue.replay_us,
                pt.enqueue.replay_p50_us,
                pt.enqueue.replay_max_us
            );
        }
        if let Some(pt) = &f.nccl_ep_point {
            let best = f.points.iter().max_by(|x, y| x.tokens_per_s.total_cmp(&y.tokens_per_s));
            let one = f.points.iter().find(|x| x.micro_batches == 1);
            println!(
                "  batch {batch:4}, 1 in flight [NCCL EP]: {:.0} tokens/s; latency p50 {:.2} ms p99 {:.2} ms; GPU busy {:.1} %; host enqueue {:.1} us per layer (router/attention/shared {:.1}, NCCL EP update+dispatch+combine {:.1}, experts {:.1}, add {:.1})",
                pt.tokens_per_s,
                pt.p50_ms,
                pt.p99_ms,
                pt.busy * 100.0,
                pt.enqueue_us_per_layer,
                pt.enqueue.before_dispatch_us,
                pt.enqueue.handle_us,
                pt.enqueue.experts_us,
                pt.enqueue.after_combine_us
            );
            if let (Some(one), Some(best)) = (one, best) {
                println!(
                    "  batch {batch:4}: epflow / NCCL EP, tokens/s: {:.3}x with 1 in flight each; {:.3}x epflow's best ({} in flight) against NCCL EP's (1)",
                    one.tokens_per_s / pt.tokens_per_s,
                    best.tokens_per_s / pt.tokens_per_s,
                    best.micro_batches
                );
            }
        }
        if let Some(c) = &f.nccl_ep_check {
            println!(
                "  batch {batch}: NCCL EP's serial outputs against epflow's: {} of {} micro-batches bit-identical, largest difference {:.2e} of the largest value",
                c.bit_identical, c.micro_batches, c.max_rel_diff
            );
        }
        nccl_ep_points.extend(f.nccl_ep_point.clone());
        nccl_ep_check.extend(f.nccl_ep_check.clone());
        eprintln!("[moe_serving] batch {batch} measured in {:.1} s", started.elapsed().as_secs_f64());
        points.extend(f.points);
        layer_graph_points.extend(f.layer_graph_points);
        layer_graph_errors.extend(f.layer_graph_error);
        gemms.extend(f.gemm);
    }
    let crossover = crossover(&points);
    if m_args.batches.len() > 1 {
        print_sweep(&points);
        match crossover {
            Some(b) => {
                println!("  crossover: from batch {b} on, more than one micro-batch in flight serves more tokens/s")
            }
            None => println!("  crossover: none in this sweep (one micro-batch in flight was never beaten for good)"),
        }
    }
    let report = Report {
        model: p.name.into(),
        phase,
        ranks,
        device: device_name(devices[0]),
        devices,
        layers: a.layers,
        attention: m_args.attention,
        compute_graphs: m_args.graphs,
        order: format!("{:?}", a.order),
        points,
        gemms,
        crossover_batch: crossover,
        checked_micro_batches: checked,
        layer_graph_points,
        layer_graph_checked,
        layer_graph_errors,
        nccl_ep_library,
        nccl_ep_points,
        nccl_ep_check,
    };
    if let Some(path) = &m_args.json {
        std::fs::write(path, serde_json::to_string_pretty(&report).map_err(err)?)
            .map_err(|e| Error::Backend(format!("{}: {e}", path.display())))?;
        println!("  figures written to {}", path.display());
    }
    if let Some(path) = &m_args.svg {
        chart(path, &report).map_err(|e| Error::Backend(format!("{}: {e}", path.display())))?;
        println!("  chart written to {}", path.display());
    }
    if !report.layer_graph_errors.is_empty() {
        return Err(Error::Backend(format!("--layer-graphs: {}", report.layer_graph_errors.join("; "))));
    }
    Ok(())
}

/// The smallest batch from which, at every larger batch of the sweep, the best setting with
/// more than one micro-batch in flight beats one.
fn crossover(points: &[Point]) -> Option<usize> {
    let mut by_batch: BTreeMap<usize, (f64, f64)> = BTreeMap::new();
    for p in points {
        let e = by_batch.entry(p.batch).or_insert((0.0, 0.0));
        if p.micro_batches == 1 {
            e.0 = p.tokens_per_s;
        } else {
            e.1 = e.1.max(p.tokens_per_s);
        }
    }
    let mut found = None;
    for (&b, &(one, more)) in by_batch.iter().rev() {
        if more > one { found = Some(b) } else { break }
    }
    found
}

fn print_sweep(points: &[Point]) {
    let settings: Vec<usize> = {
        let mut s: Vec<usize> = points.iter().map(|p| p.micro_batches).collect();
        s.sort_unstable();
        s.dedup();
        s
    };
    let header: Vec<String> = settings.iter().map(|m| format!("{m} in flight")).collect();
    println!("  tokens/s by batch (tokens per rank per micro-batch):");
    println!("    {:>6} | {}", "batch", header.iter().map(|h| format!("{h:>12}")).collect::<Vec<_>>().join(" | "));
    let mut batches: Vec<usize> = points.iter().map(|p| p.batch).collect();
    batches.dedup();
    for b in batches {
        let row: Vec<String> = settings
            .iter()
            .map(|&m| {
                points
                    .iter()
                    .find(|p| p.batch == b && p.micro_batches == m)
                    .map_or("-".into(), |p| format!("{:12.0}", p.tokens_per_s))
            })
            .collect();
        println!("    {b:>6} | {}", row.join(" | "));
    }
}

fn chart(path: &std::path::Path, r: &Report) -> std::result::Result<(), Box<dyn std::error::Error>> {
    use plotters::prelude::*;
    let root = SVGBackend::new(path, (960, 600)).into_drawing_area();
    root.fill(&WHITE)?;
    let min_b = r.points.iter().map(|p| p.batch).min().unwrap_or(1) as f64;
    let max_b = (r.points.iter().map(|p| p.batch).max().unwrap_or(2) as f64).max(min_b * 2.0);
    let max_y = r.points.iter().map(|p| p.tokens_per_s).fold(0.0, f64::max) * 1.1;
    let title = format!("{} {}: {} layers on {} rank(s), {}", r.model, r.phase, r.layers, r.ranks, r.device);
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(80)
        .build_cartesian_2d((min_b..max_b).log_scale(), 0f64..max_y.max(1.0))?;
    chart.configure_mesh().x_desc("tokens per rank per micro-batch").y_desc("tokens/s (all ranks)").draw()?;
    let mut settings: Vec<usize> = r.points.iter().map(|p| p.micro_batches).collect();
    settings.sort_unstable();
    settings.dedup();
    for (i, m) in settings.into_iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        let line: Vec<(f64, f64)> =
            r.points.iter().filter(|p| p.micro_batches == m).map(|p| (p.batch as f64, p.tokens_per_s)).collect();
        chart
            .draw_series(LineSeries::new(line.clone(), color.stroke_width(2)))?
            .label(format!("{m} in flight"))
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2)));
        chart.draw_series(line.iter().map(|&p| Circle::new(p, 4, color.filled())))?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE)
        .border_style(BLACK)
        .draw()?;
    root.present()?;
    Ok(())
}

#[cfg(test)]
mod model_tests {
    use super::*;

    fn point(batch: usize, micro_batches: usize, tokens_per_s: f64) -> Point {
        Point {
            batch,
            micro_batches,
            comm_us: 0.0,
            compute_us: 0.0,
            serial_us: 0.0,
            pipelined_us: 0.0,
            efficiency: 0.0,
            tokens_per_s,
            p50_ms: 0.0,
            p99_ms: 0.0,
            busy: 0.0,
            enqueue_us_per_layer: 0.0,
            enqueue: Enqueue::default(),
        }
    }

    /// `--backend nccl-ep --check`'s comparison: identical micro-batches are counted, the
    /// largest difference is relative to the largest epflow value, and a missing micro-batch is
    /// an error.
    #[test]
    fn nccl_ep_outputs_are_compared_micro_batch_by_micro_batch() {
        let bits = |v: &[f32]| v.iter().map(|x| (x.to_bits() >> 16) as u16).collect::<Vec<u16>>();
        let ours: BTreeMap<u64, Vec<u16>> = [(0, bits(&[1.0, -2.0])), (1, bits(&[4.0, 0.5]))].into();
        let same = compare_outputs(8, &ours, &ours.clone()).unwrap();
        assert_eq!((same.batch, same.micro_batches, same.bit_identical, same.max_rel_diff), (8, 2, 2, 0.0));
        let theirs: BTreeMap<u64, Vec<u16>> = [(0, bits(&[1.0, -2.0])), (1, bits(&[4.0, 1.5]))].into();
        let c = compare_outputs(8, &ours, &theirs).unwrap();
        assert_eq!(c.bit_identical, 1);
        assert!((c.max_rel_diff - 0.25).abs() < 1e-12, "{}", c.max_rel_diff);
        let short: BTreeMap<u64, Vec<u16>> = [(0, bits(&[1.0, -2.0]))].into();
        assert!(compare_outputs(8, &ours, &short).is_err());
    }

    /// The crossover is the smallest batch from which more in flight wins at every larger batch.
    #[test]
    fn crossover_is_where_overlap_wins_for_good() {
        let sweep = |rows: &[(usize, f64, f64)]| {
            let pts: Vec<Point> = rows.iter().flat_map(|&(b, one, two)| [point(b, 1, one), point(b, 2, two)]).collect();
            crossover(&pts)
        };
        assert_eq!(sweep(&[(8, 10.0, 8.0), (16, 20.0, 19.0), (64, 50.0, 60.0), (128, 90.0, 120.0)]), Some(64));
        assert_eq!(
            sweep(&[(8, 10.0, 11.0), (16, 20.0, 19.0), (64, 50.0, 60.0)]),
            Some(64),
            "a win below a loss does not count"
        );
        assert_eq!(sweep(&[(8, 10.0, 11.0), (16, 20.0, 21.0)]), Some(8));
        assert_eq!(sweep(&[(8, 10.0, 9.0), (16, 20.0, 19.0)]), None);
    }
}

//! [`Lane`]: one micro-batch's streams and scratch, and the layer's stream-ordered parts.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use cudarc::driver::{CudaEvent, CudaStream};
use epflow_async::{Completion, Group, OpFuture};
use epflow_core::ops::{CombineInputs, DispatchInputs, HandleOptions};
use epflow_core::{DType, Error, Result, TensorDesc, TensorTag};
use epflow_kernels::{DeviceTensor, GpuCombineOutput, GpuDispatchOutput, GpuHandle, GpuRank};

use super::blas::{Blas, Gemm};
use super::cuda;
use super::graphs::{GraphCache, Key, Target};
use super::grouped::{GroupedInputs, GroupedScratch};
use super::model::{DeviceLayer, GpuMoeModel};

/// What [`Lane::before_dispatch`] produced, in the lane stream's order: the tokens to dispatch
/// (`[B x H]` BF16) and the router's `topk_idx` (`[B x K]` int64) and `topk_weights` (`[B x K]`
/// FP32), in the lane's memory (rewritten by its next layer).
#[derive(Clone, Debug)]
pub struct Routed {
    /// The tokens the dispatch sends.
    pub tokens: DeviceTensor,
    /// The router's choices.
    pub topk_idx: DeviceTensor,
    /// The router's weights (the combine's).
    pub topk_weights: DeviceTensor,
}

/// The host time spent enqueueing on a lane, summed over calls, by part.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct LaneTimes {
    /// In [`Lane::before_dispatch`]: attention stand-in, router, shared expert.
    pub before_dispatch: Duration,
    /// In [`Lane::experts`] / [`Lane::experts_on`].
    pub experts: Duration,
    /// In [`Lane::after_combine`] / [`Lane::after_combine_tokens`].
    pub after_combine: Duration,
    /// Layers begun ([`Lane::before_dispatch`] calls).
    pub layers: u64,
}

impl LaneTimes {
    /// The three parts together.
    pub fn enqueue(&self) -> Duration {
        self.before_dispatch + self.experts + self.after_combine
    }
}

/// One layer's output from [`Lane::forward`]: `[B x H]` BF16, ready in the lane stream's
/// order, and the completions of its dispatch and combine (each resolves with the operation's
/// verdict once the device has run it; await them before trusting the output on the host).
#[derive(Debug)]
pub struct LayerStep {
    /// The layer's output.
    pub output: DeviceTensor,
    /// The handle creation's, dispatch's and combine's completions.
    pub completions: Vec<Completion>,
}

/// The shared expert's scratch: `gate_up` output `[B x 2Fs]`, activation `[B x Fs]`, output
/// `[B x H]`.
#[derive(Debug)]
pub(super) struct SharedScratch {
    gu: DeviceTensor,
    act: DeviceTensor,
    pub(super) y: DeviceTensor,
}

/// One micro-batch's lane: its stream (every part of the layer is enqueued there), a side stream
/// for the shared expert (overlapping the dispatch), cuBLAS on both, and the scratch of one
/// layer for `B` tokens. A lane runs one layer at a time, in stream order; several lanes (one
/// per micro-batch in flight) overlap on the device.
#[derive(Debug)]
pub struct Lane {
    stream: Arc<CudaStream>,
    side: Arc<CudaStream>,
    blas: Blas,
    side_blas: Blas,
    tokens: usize,
    rows_per_expert: usize,
    attention: Vec<DeviceTensor>,
    logits: DeviceTensor,
    pub(super) topk_idx: DeviceTensor,
    pub(super) topk_weights: DeviceTensor,
    pub(super) shared: Option<SharedScratch>,
    gu: DeviceTensor,
    act: DeviceTensor,
    pub(super) y: DeviceTensor,
    pub(super) out: DeviceTensor,
    shared_done: Mutex<Option<Arc<CudaEvent>>>,
    /// The shared expert's fork (recorded on the lane's stream, waited for by the side stream)
    /// and join (the other way round), recorded again each layer: a wait takes the record
    /// current when it is enqueued.
    fork: CudaEvent,
    join: Arc<CudaEvent>,
    /// The layer's compute pieces as CUDA graphs ([`Lane::with_graphs`]), with cuBLAS on the
    /// capture stream for the lane's stream's pieces and for the side stream's (each with a
    /// workspace of its own, as the lane's and the side stream's are: their graphs may run at
    /// the same time); `None`: enqueued call by call.
    graphs: Option<(GraphCache, Blas, Blas)>,
    /// Grouped experts over high-throughput dispatches ([`Lane::with_grouped_experts`]).
    grouped: Option<GroupedScratch>,
    device: usize,
    /// Host nanoseconds per part: before_dispatch, experts, after_combine.
    enqueue_ns: [AtomicU64; 3],
    layers: AtomicU64,
}

/// The parts [`LaneTimes`] counts.
#[derive(Clone, Copy)]
enum Part {
    Before = 0,
    Experts = 1,
    After = 2,
}

fn tensor(m: &GpuMoeModel, tag: TensorTag, dtype: DType, shape: &[usize]) -> Result<DeviceTensor> {
    DeviceTensor::zeros(&m.ctx, m.device, TensorDesc::contiguous(tag, dtype, shape))
}

impl Lane {
    /// Device bytes of one lane's scratch (four cuBLAS workspaces counted, for a lane with
    /// graphs) for `tokens` tokens per micro-batch on a group of
    /// `ranks` ranks whose dispatch delivers `rows_per_expert` rows per local expert (`R * M`).
    pub fn bytes(
        preset: &crate::ModelPreset,
        ranks: usize,
        tokens: usize,
        rows_per_expert: usize,
        attention: bool,
    ) -> u128 {
        let (h, e, k, f) =
            (preset.hidden as u128, preset.num_experts as u128, preset.top_k as u128, preset.expert_ffn as u128);
        let (b, c, l) = (tokens as u128, rows_per_expert as u128, (preset.num_experts / ranks.max(1)) as u128);
        let attn: u128 = if attention { preset.attention.iter().map(|&(_, n)| 2 * b * n as u128).sum() } else { 0 };
        let fs = (preset.shared_experts * preset.shared_ffn) as u128;
        let shared = 2 * b * (3 * fs + h);
        attn + 4 * b * e
            + 12 * b * k
            + shared
            + 2 * l * c * (3 * f + h)
            + 2 * b * h
            + 2 * super::blas::WORKSPACE_BYTES as u128
    }

    /// A lane of `model` for micro-batches of `tokens` tokens, whose dispatch outputs hold
    /// `rows_per_expert` rows per local expert (the group's `R * max_tokens_per_rank`).
    pub fn new(model: &GpuMoeModel, tokens: usize, rows_per_expert: usize) -> Result<Self> {
        let p = &model.preset;
        let (h, e, k, f) = (p.hidden, p.num_experts, p.top_k, p.expert_ffn);
        let local = e / model.ranks;
        let stream = model.ctx.new_stream().map_err(|x| cuda("create stream", x))?;
        let side = model.ctx.new_stream().map_err(|x| cuda("create stream", x))?;
        let bf = |shape: &[usize]| tensor(model, TensorTag::Tokens, DType::Bf16, shape);
        let attention = if model.attention {
            p.attention.iter().map(|&(_, n)| bf(&[tokens, n])).collect::<Result<_>>()?
        } else {
            Vec::new()
        };
        let shared = if p.shared_experts > 0 {
            let fs = p.shared_ffn;
            Some(SharedScratch { gu: bf(&[tokens, 2 * fs])?, act: bf(&[tokens, fs])?, y: bf(&[tokens, h])? })
        } else {
            None
        };
        Ok(Lane {
            blas: Blas::new(&stream, model.device)?,
            side_blas: Blas::new(&side, model.device)?,
            tokens,
            rows_per_expert,
            attention,
            logits: tensor(model, TensorTag::Tokens, DType::F32, &[tokens, e])?,
            topk_idx: tensor(model, TensorTag::TopkIdx, DType::I64, &[tokens, k])?,
            topk_weights: tensor(model, TensorTag::TopkWeights, DType::F32, &[tokens, k])?,
            shared,
            gu: bf(&[local, rows_per_expert, 2 * f])?,
            act: bf(&[local, rows_per_expert, f])?,
            y: bf(&[local, rows_per_expert, h])?,
            out: bf(&[tokens, h])?,
            shared_done: Mutex::new(None),
            fork: model.ctx.new_event(None).map_err(|x| cuda("create event", x))?,
            join: Arc::new(model.ctx.new_event(None).map_err(|x| cuda("create event", x))?),
            graphs: None,
            grouped: None,
            device: model.device,
            enqueue_ns: [AtomicU64::new(0), AtomicU64::new(0), AtomicU64::new(0)],
            layers: AtomicU64::new(0),
            stream,
            side,
        })
    }

    /// Records each piece of the layer's compute (router and attention stand-in, shared expert,
    /// experts) the first time it runs on given inputs as a CUDA graph, and replays it after:
    /// one launch where the pieces cost one cuBLAS call per GEMM. The graphs are keyed by the
    /// layer and the input addresses (a lane sees few: its token sets and the group's buffer
    /// sets); the outputs are bit-identical to the call-by-call path's.
    pub fn with_graphs(mut self, on: bool) -> Result<Self> {
        self.graphs = None;
        if on {
            let capture = self.stream.context().new_stream().map_err(|x| cuda("create stream", x))?;
            let (main, side) = (Blas::new(&capture, self.device)?, Blas::new(&capture, self.device)?);
            self.graphs = Some((GraphCache::new(capture), main, side));
        }
        Ok(self)
    }

    /// Device bytes of [`Lane::with_grouped_experts`]'s scratch for at most `rows` received
    /// rows on a group of `ranks` ranks.
    pub fn grouped_bytes(preset: &crate::ModelPreset, ranks: usize, rows: usize) -> u128 {
        GroupedScratch::bytes(preset, ranks, rows)
    }

    /// Gives the lane the scratch of grouped experts over high-throughput dispatches of at most
    /// `rows` received rows (the group's `R * max_tokens_per_rank`): [`Lane::experts_grouped`]
    /// and [`Lane::forward_grouped`] (prefill). Such a lane is usually made with
    /// `rows_per_expert = 0` in [`Lane::new`] (no padded low-latency scratch).
    pub fn with_grouped_experts(mut self, model: &GpuMoeModel, rows: usize) -> Result<Self> {
        self.grouped = Some(GroupedScratch::new(model, rows)?);
        Ok(self)
    }

    /// With [`Lane::with_graphs`]: the pieces captured as CUDA graphs so far, and those whose
    /// capture failed (they run call by call; a warning names each).
    pub fn graph_counts(&self) -> Option<(usize, usize)> {
        self.graphs.as_ref().map(|(g, _, _)| g.counts())
    }

    /// Runs a piece of the layer: `enqueue(stream, blas)` directly on `stream` with `blas` (the
    /// lane's stream or its side stream, and its cuBLAS), or through the lane's graph of `key`
    /// (captured with `enqueue(capture stream, capture_blas)`, launched on `stream`).
    fn run(&self, on_side: bool, key: Key, enqueue: impl Fn(&Arc<CudaStream>, &Blas) -> Result<()>) -> Result<()> {
        let (stream, blas) = if on_side { (&self.side, &self.side_blas) } else { (&self.stream, &self.blas) };
        match &self.graphs {
            None => enqueue(stream, blas),
            Some((cache, main, side)) => {
                let idle = || {
                    self.stream.synchronize().map_err(|x| cuda("wait for the lane", x))?;
                    self.side.synchronize().map_err(|x| cuda("wait for the lane", x))
                };
                let capture_blas = if on_side { side } else { main };
                cache.run(stream, key, idle, |target| match target {
                    Target::Lane => enqueue(stream, blas),
                    Target::Capture => enqueue(cache.capture_stream(), capture_blas),
                })
            }
        }
    }

    /// The lane's stream: every part of its layers is enqueued there.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The router's output of the lane's latest layer: `topk_idx` `[B x K]` int64 and
    /// `topk_weights` `[B x K]` FP32, in the lane stream's order.
    pub fn routing(&self) -> (&DeviceTensor, &DeviceTensor) {
        (&self.topk_idx, &self.topk_weights)
    }

    /// Tokens per micro-batch (`B`).
    pub fn tokens(&self) -> usize {
        self.tokens
    }

    /// The host time spent enqueueing so far.
    pub fn times(&self) -> LaneTimes {
        let ns = |p: Part| Duration::from_nanos(self.enqueue_ns[p as usize].load(Ordering::Relaxed));
        LaneTimes {
            before_dispatch: ns(Part::Before),
            experts: ns(Part::Experts),
            after_combine: ns(Part::After),
            layers: self.layers.load(Ordering::Relaxed),
        }
    }

    /// Clears [`Lane::times`].
    pub fn reset_times(&self) {
        self.enqueue_ns.iter().for_each(|n| n.store(0, Ordering::Relaxed));
        self.layers.store(0, Ordering::Relaxed);
    }

    fn timed<T>(&self, part: Part, f: impl FnOnce() -> Result<T>) -> Result<T> {
        let t = Instant::now();
        let out = f();
        self.enqueue_ns[part as usize].fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
        out
    }

    fn wait_ready(&self, t: &DeviceTensor) -> Result<()> {
        if let Some(e) = t.ready_event() {
            self.stream.wait(e).map_err(|x| cuda("wait for input", x))?;
        }
        Ok(())
    }

    fn check_tokens(&self, model: &GpuMoeModel, x: &DeviceTensor, what: &str) -> Result<()> {
        let d = x.desc();
        if d.dtype != DType::Bf16 || d.shape != [self.tokens, model.preset.hidden] || x.device() != model.device {
            return Err(Error::Unsupported(format!(
                "{what}: BF16 [{} x {}] on device {} expected, got {:?} {:?} on device {}",
                self.tokens,
                model.preset.hidden,
                model.device,
                d.dtype,
                d.shape,
                x.device()
            )));
        }
        Ok(())
    }

    /// The part before the dispatch of layer `layer`, enqueued on the lane's stream (after `x`'s
    /// ready event, if any): the attention stand-in (if the model runs it), the router (gate
    /// GEMM into FP32 logits, then the top-k kernel), and the shared expert on the side stream
    /// (forked from the lane's stream here, joined in [`Lane::after_combine`]). `x` is `[B x H]`
    /// BF16 and must stay unchanged until the dispatch has read it.
    pub fn before_dispatch(&self, model: &GpuMoeModel, layer: usize, x: &DeviceTensor) -> Result<Routed> {
        self.timed(Part::Before, || {
            self.check_tokens(model, x, "the layer's input")?;
            let w = model
                .layers
                .get(layer)
                .ok_or_else(|| Error::Unsupported(format!("layer {layer}: the model holds {}", model.layers.len())))?;
            self.layers.fetch_add(1, Ordering::Relaxed);
            self.wait_ready(x)?;
            // The attention stand-in's last output, or the input itself, is what is routed,
            // dispatched and given to the shared expert.
            let tokens = self.routed_tokens(x);
            let key = Key { part: 0, layer, inputs: (x.ptr(), 0) };
            self.run(false, key, |stream, blas| self.enqueue_router(model, w, x, stream, blas))?;
            // Shared expert on the side stream, overlapping the dispatch.
            if self.shared.is_some() && w.shared.is_some() {
                self.fork.record(&self.stream).map_err(|x| cuda("record event", x))?;
                self.side.wait(&self.fork).map_err(|x| cuda("wait for event", x))?;
                let key = Key { part: 1, layer, inputs: (tokens.ptr(), 0) };
                self.run(true, key, |stream, blas| self.enqueue_shared_expert(model, w, &tokens, stream, blas))?;
                self.join.record(&self.side).map_err(|x| cuda("record event", x))?;
                *self.shared_done.lock().unwrap_or_else(|p| p.into_inner()) = Some(Arc::clone(&self.join));
            }
            Ok(Routed { tokens, topk_idx: self.topk_idx.clone(), topk_weights: self.topk_weights.clone() })
        })
    }

    /// The routed experts of layer `layer` on a dispatch's outputs (`[L x R*M x H]`, completed
    /// in this lane's stream order), enqueued on the lane's stream: `gate_up` as one
    /// strided-batched GEMM over every expert's `R*M` rows, the SwiGLU activation for the rows
    /// each expert received (its count read on the device), `down` likewise. Returns the
    /// expert outputs in the dispatch's layout (the lane's memory, rewritten by its next
    /// layer), ready in the lane's stream order: order their reader after the lane's stream (as
    /// the combine of [`Lane::forward`] and of `pipeline::run_on_streams` is).
    pub fn experts(&self, model: &GpuMoeModel, layer: usize, d: &GpuDispatchOutput) -> Result<DeviceTensor> {
        let counts =
            d.counts().ok_or_else(|| Error::Unsupported("experts: the dispatch returned no device counts".into()))?;
        self.experts_on(model, layer, d.tokens(), counts)
    }

    /// [`Lane::experts`] on expert inputs `x` (`[L x R*M x H]` BF16) and device counts
    /// (`[L]` int32) of any origin (a dispatch's, or a copy kept to time the compute alone).
    pub fn experts_on(
        &self,
        model: &GpuMoeModel,
        layer: usize,
        x: &DeviceTensor,
        counts: &DeviceTensor,
    ) -> Result<DeviceTensor> {
        self.timed(Part::Experts, || {
            let w = model.layers.get(layer).ok_or_else(|| {
                Error::Unsupported(format!("layer {layer}: the model holds {}", model.layers.len()))
            })?;
            let p = &model.preset;
            let (h, local) = (p.hidden, p.num_experts / model.ranks);
            if x.desc().dtype != DType::Bf16 || x.desc().shape != [local, self.rows_per_expert, h] {
                return Err(Error::Unsupported(format!(
                    "experts: BF16 inputs [{local} x {} x {h}] expected (an expert-major low-latency group), got {:?} {:?}",
                    self.rows_per_expert,
                    x.desc().dtype,
                    x.desc().shape
                )));
            }
            if counts.desc().dtype != DType::I32 || counts.desc().shape != [local] {
                return Err(Error::Unsupported(format!(
                    "experts: int32 counts [{local}] expected, got {:?} {:?}",
                    counts.desc().dtype,
                    counts.desc().shape
                )));
            }
            self.wait_ready(x)?;
            let key = Key { part: 2, layer, inputs: (x.ptr(), counts.ptr()) };
            self.run(false, key, |stream, blas| self.enqueue_experts(model, w, x, counts, stream, blas))?;
            Ok(self.y.clone())
        })
    }

    /// The routed experts of layer `layer` on a high-throughput dispatch's outputs (`N` rows,
    /// completed in this lane's stream order), enqueued on the lane's stream: each local
    /// expert's rows gathered contiguously (in row order), `gate_up` and `down` as cuBLAS
    /// grouped GEMMs at `counts` rows per expert (the handle's
    /// [`epflow_core::handle::RoutingHandle::recv_expert_counts`]: a handle created with
    /// [`epflow_core::ops::RecvRows::Exact`] knows them on the host), SwiGLU between, then per
    /// received row the weighted sum of its local experts' outputs,
    /// `bf16(fma chain over k of w[k] * y_k)`: `[N x H]` BF16, the combine's input, in the
    /// lane's memory (rewritten by its next grouped call), ready in the lane stream's order.
    /// Needs [`Lane::with_grouped_experts`]; never replayed as a graph (the shapes follow the
    /// counts).
    pub fn experts_grouped(
        &self,
        model: &GpuMoeModel,
        layer: usize,
        d: &GpuDispatchOutput,
        counts: &[i32],
    ) -> Result<DeviceTensor> {
        let missing = |what: &str| {
            Error::Unsupported(format!(
                "grouped experts: the dispatch returned no {what} (a high-throughput forward dispatch with weights is needed)"
            ))
        };
        let inputs = GroupedInputs {
            tokens: d.tokens(),
            topk_idx: d.topk_idx().ok_or_else(|| missing("top-k indices"))?,
            topk_weights: d.topk_weights().ok_or_else(|| missing("top-k weights"))?,
            counts: d.counts().ok_or_else(|| missing("device counts"))?,
            host_counts: counts,
        };
        self.experts_grouped_on(model, layer, &inputs)
    }

    /// [`Lane::experts_grouped`] on inputs of any origin (a dispatch's, or copies kept to time
    /// the compute alone).
    pub fn experts_grouped_on(
        &self,
        model: &GpuMoeModel,
        layer: usize,
        inputs: &GroupedInputs<'_>,
    ) -> Result<DeviceTensor> {
        self.timed(Part::Experts, || {
            let scratch = self.grouped.as_ref().ok_or_else(|| {
                Error::Unsupported(
                    "grouped experts: this lane has no grouped scratch (Lane::with_grouped_experts)".into(),
                )
            })?;
            let w = model
                .layers
                .get(layer)
                .ok_or_else(|| Error::Unsupported(format!("layer {layer}: the model holds {}", model.layers.len())))?;
            for t in [inputs.tokens, inputs.topk_idx, inputs.topk_weights, inputs.counts] {
                self.wait_ready(t)?;
            }
            scratch.run(model, w, &self.stream, &self.blas, inputs)
        })
    }

    /// The router and the routed experts of layer `layer` alone, on the lane's stream: the
    /// gate GEMM and top-k on `x` (`[B x H]`), then [`Lane::experts_on`] on `expert_in` and
    /// `counts`. What [`Lane::gemms_alone`] is compared with.
    pub fn router_and_experts(
        &self,
        model: &GpuMoeModel,
        layer: usize,
        x: &DeviceTensor,
        expert_in: &DeviceTensor,
        counts: &DeviceTensor,
    ) -> Result<()> {
        self.check_tokens(model, x, "the router's input")?;
        let w = &model.layers[layer.min(model.layers.len() - 1)];
        self.route(model, w, &self.stream, &self.blas, x.ptr())?;
        self.experts_on(model, layer, expert_in, counts).map(drop)
    }

    /// What layer input `x` routes, dispatches and gives the shared expert: the attention
    /// stand-in's last output, or `x` itself without one.
    pub(super) fn routed_tokens(&self, x: &DeviceTensor) -> DeviceTensor {
        self.attention.last().cloned().unwrap_or_else(|| x.clone())
    }

    /// The part of layer `w` before its dispatch that reads `x` (`[B x H]`), enqueued on
    /// `stream` with `blas`: the attention stand-in (GEMM j reads the first k_j columns of the
    /// previous output), then the router on [`Lane::routed_tokens`].
    pub(super) fn enqueue_router(
        &self,
        model: &GpuMoeModel,
        w: &DeviceLayer,
        x: &DeviceTensor,
        stream: &CudaStream,
        blas: &Blas,
    ) -> Result<()> {
        let p = &model.preset;
        let (mut input, mut ld) = (x.ptr(), p.hidden);
        for (wt, (out, &(kj, nj))) in w.attention.iter().zip(self.attention.iter().zip(p.attention)) {
            blas.gemm(&Gemm { ldx: ld, ..Gemm::plain(self.tokens, kj, nj) }, input, wt.ptr(), out.ptr())?;
            (input, ld) = (out.ptr(), nj);
        }
        self.route(model, w, stream, blas, self.routed_tokens(x).ptr())
    }

    /// The shared expert of `w` on `tokens` (`[B x H]`) into the lane's shared scratch, enqueued
    /// on `stream` with `blas`: `gate_up`, SwiGLU, `down`. Nothing without a shared expert.
    pub(super) fn enqueue_shared_expert(
        &self,
        model: &GpuMoeModel,
        w: &DeviceLayer,
        tokens: &DeviceTensor,
        stream: &CudaStream,
        blas: &Blas,
    ) -> Result<()> {
        let (Some(s), Some((gu, down))) = (&self.shared, &w.shared) else { return Ok(()) };
        let (b, h, fs) = (self.tokens, model.preset.hidden, model.preset.shared_ffn);
        blas.gemm(&Gemm::plain(b, h, 2 * fs), tokens.ptr(), gu.ptr(), s.gu.ptr())?;
        model.kernels.swiglu(stream, s.gu.ptr(), s.act.ptr(), None, 1, b, fs)?;
        blas.gemm(&Gemm::plain(b, fs, h), s.act.ptr(), down.ptr(), s.y.ptr())
    }

    /// The padded experts of `w` on expert inputs `x` (`[L x R*M x H]`) and device `counts`
    /// (`[L]`) into the lane's expert output (`[L x R*M x H]`), enqueued on `stream` with `blas`:
    /// `gate_up` as one strided-batched GEMM, SwiGLU for the rows each expert received, `down`.
    pub(super) fn enqueue_experts(
        &self,
        model: &GpuMoeModel,
        w: &DeviceLayer,
        x: &DeviceTensor,
        counts: &DeviceTensor,
        stream: &CudaStream,
        blas: &Blas,
    ) -> Result<()> {
        let p = &model.preset;
        let (h, f, local, c) = (p.hidden, p.expert_ffn, p.num_experts / model.ranks, self.rows_per_expert);
        blas.gemm(&Gemm::per_expert(local, c, h, 2 * f), x.ptr(), w.gate_up.ptr(), self.gu.ptr())?;
        model.kernels.swiglu(stream, self.gu.ptr(), self.act.ptr(), Some(counts.ptr()), local, c, f)?;
        blas.gemm(&Gemm::per_expert(local, c, f, h), self.act.ptr(), w.down.ptr(), self.y.ptr())
    }

    /// The router of `w` on `tokens` (`[B x H]` BF16 at that address), enqueued on `stream`
    /// with `blas`: the gate GEMM into the lane's FP32 logits, then the top-k kernel into its
    /// `topk_idx` and `topk_weights`.
    fn route(&self, model: &GpuMoeModel, w: &DeviceLayer, stream: &CudaStream, blas: &Blas, tokens: u64) -> Result<()> {
        let p = &model.preset;
        let (b, h, e) = (self.tokens, p.hidden, p.num_experts);
        blas.gemm(&Gemm { fp32_out: true, ..Gemm::plain(b, h, e) }, tokens, w.gate.ptr(), self.logits.ptr())?;
        model.kernels.router_topk(
            stream,
            self.logits.ptr(),
            b,
            e,
            p.top_k,
            p.scoring,
            self.topk_idx.ptr(),
            self.topk_weights.ptr(),
        )
    }

    /// The same GEMMs as [`Lane::router_and_experts`], cuBLAS alone (no top-k, no
    /// activation): the gate GEMM, then `gate_up` and `down` over every expert's padded
    /// `R*M` rows (`rows: None`), or, with `rows: Some(counts)`, one GEMM pair per expert over
    /// the rows it received (the counts on the host: the shapes a host-synchronised layer runs).
    pub fn gemms_alone(
        &self,
        model: &GpuMoeModel,
        layer: usize,
        x: &DeviceTensor,
        expert_in: &DeviceTensor,
        rows: Option<&[i32]>,
    ) -> Result<()> {
        self.check_tokens(model, x, "the router's input")?;
        let w = &model.layers[layer.min(model.layers.len() - 1)];
        let p = &model.preset;
        let (b, h, e, f) = (self.tokens, p.hidden, p.num_experts, p.expert_ffn);
        let local = e / model.ranks;
        let c = self.rows_per_expert;
        self.blas.gemm(&Gemm { fp32_out: true, ..Gemm::plain(b, h, e) }, x.ptr(), w.gate.ptr(), self.logits.ptr())?;
        match rows {
            None => {
                self.blas.gemm(
                    &Gemm::per_expert(local, c, h, 2 * f),
                    expert_in.ptr(),
                    w.gate_up.ptr(),
                    self.gu.ptr(),
                )?;
                self.blas.gemm(&Gemm::per_expert(local, c, f, h), self.act.ptr(), w.down.ptr(), self.y.ptr())
            }
            Some(rows) => {
                if rows.len() != local || rows.iter().any(|&r| r < 0 || r as usize > c) {
                    return Err(Error::Unsupported(format!("gemms_alone: {local} counts in 0..={c} expected")));
                }
                for (l, &n) in rows.iter().enumerate().filter(|(_, n)| **n > 0) {
                    let at = |t: &DeviceTensor, row: usize| t.ptr() + 2 * (l * c * row) as u64;
                    let wgu = w.gate_up.ptr() + 2 * (l * h * 2 * f) as u64;
                    let wd = w.down.ptr() + 2 * (l * f * h) as u64;
                    self.blas.gemm(&Gemm::plain(n as usize, h, 2 * f), at(expert_in, h), wgu, at(&self.gu, 2 * f))?;
                    self.blas.gemm(&Gemm::plain(n as usize, f, h), at(&self.act, f), wd, at(&self.y, h))?;
                }
                Ok(())
            }
        }
    }

    /// An event recorded on the lane's stream now (for timing).
    pub fn record(&self) -> Result<Arc<CudaEvent>> {
        let ctx = self.stream.context();
        let e = ctx
            .new_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(|x| cuda("create event", x))?;
        e.record(&self.stream).map_err(|x| cuda("record event", x))?;
        Ok(Arc::new(e))
    }

    /// The part after the combine: with a shared expert, its output added to the combined tokens
    /// (`bf16(combined + shared)`) into the lane's output buffer; without, the combined tokens
    /// themselves. Enqueued on the lane's stream; the result (`[B x H]`) is ready in its order,
    /// and the lane's output buffer is rewritten by its next layer with a shared expert.
    pub fn after_combine(&self, model: &GpuMoeModel, combined: &GpuCombineOutput) -> Result<DeviceTensor> {
        self.after_combine_tokens(model, combined.tokens())
    }

    /// [`Lane::after_combine`] on combined tokens `c` (`[B x H]` BF16) of any origin.
    pub fn after_combine_tokens(&self, model: &GpuMoeModel, c: &DeviceTensor) -> Result<DeviceTensor> {
        self.timed(Part::After, || {
            self.check_tokens(model, c, "the combined tokens")?;
            let done = self.shared_done.lock().unwrap_or_else(|p| p.into_inner()).take();
            let Some(s) = &self.shared else { return Ok(c.clone()) };
            self.wait_ready(c)?;
            let join = done.ok_or_else(|| Error::Backend("after_combine without before_dispatch".into()))?;
            self.stream.wait(&join).map_err(|x| cuda("wait for the shared expert", x))?;
            let n = (self.tokens * model.preset.hidden) as u64;
            model.kernels.add(&self.stream, c.ptr(), s.y.ptr(), self.out.ptr(), n)?;
            Ok(self.out.clone())
        })
    }

    /// The whole layer `layer` on `x` (`[B x H]` BF16), in the lane's stream order, with no
    /// host wait: [`Lane::before_dispatch`], a low-latency handle created in stream order
    /// ([`Group::create_handle_on`]), the dispatch ordered after the lane's stream and
    /// completed on it, [`Lane::experts`], the combine likewise, [`Lane::after_combine`].
    /// Every rank of the group calls it for the same layer in the same order.
    pub async fn forward(
        &self,
        model: &GpuMoeModel,
        group: &Group<GpuRank>,
        layer: usize,
        x: &DeviceTensor,
    ) -> Result<LayerStep> {
        self.layer(model, group, layer, x, false).await
    }

    /// The whole layer `layer` on `x` (`[B x H]` BF16) over a high-throughput group (prefill):
    /// [`Lane::before_dispatch`], a handle created in the lane stream's order with exact
    /// received rows (it resolves once the handle exists: the host waits for this lane's
    /// router and the count exchange, as DeepEP's normal mode does, while other lanes' work
    /// runs), the dispatch with the router's weights ordered after the lane's stream and
    /// completed on it, [`Lane::experts_grouped`] at the handle's counts, the combine likewise,
    /// [`Lane::after_combine`]. Every rank of the group calls it for the same layer in the same
    /// order. Needs [`Lane::with_grouped_experts`] for the group's `R * max_tokens_per_rank`
    /// rows.
    pub async fn forward_grouped(
        &self,
        model: &GpuMoeModel,
        group: &Group<GpuRank>,
        layer: usize,
        x: &DeviceTensor,
    ) -> Result<LayerStep> {
        self.layer(model, group, layer, x, true).await
    }

    /// [`Lane::forward`] (padded experts, the router's weights applied by the combine) or
    /// [`Lane::forward_grouped`] (`grouped`: the weights travel with the dispatch and the
    /// experts apply them).
    async fn layer(
        &self,
        model: &GpuMoeModel,
        group: &Group<GpuRank>,
        layer: usize,
        x: &DeviceTensor,
        grouped: bool,
    ) -> Result<LayerStep> {
        use epflow_core::handle::RoutingHandle;
        let r = self.before_dispatch(model, layer, x)?;
        let (handle, created): (GpuHandle, Completion) =
            group.create_handle_on(&r.topk_idx, &HandleOptions::default(), &self.stream).await?;
        let counts = if grouped {
            let c = handle.recv_expert_counts();
            Some(c.ok_or_else(|| Error::Unsupported("grouped experts need a high-throughput group".into()))?.to_vec())
        } else {
            None
        };
        let inputs = DispatchInputs::new(&r.tokens);
        let inputs = if grouped { inputs.with_weights(&r.topk_weights) } else { inputs };
        let (received, dispatched) = self.in_stream_order(group.dispatch(&handle, inputs), grouped).await?;
        let y = match &counts {
            Some(c) => self.experts_grouped(model, layer, &received, c)?,
            None => self.experts(model, layer, &received)?,
        };
        drop(received);
        let inputs = CombineInputs::new(&y);
        let inputs = if grouped { inputs } else { inputs.with_weights(&r.topk_weights) };
        let (combined, done) = self.in_stream_order(group.combine(&handle, inputs), grouped).await?;
        let output = self.after_combine(model, &combined)?;
        Ok(LayerStep { output, completions: vec![created, dispatched, done] })
    }

    /// `op` ordered after the lane's stream and completed on it: its send half, then its
    /// receive on the stream (low-latency), or, `whole` (high-throughput, which has no send-only
    /// form), the whole operation in the stream's order.
    async fn in_stream_order<T>(&self, op: OpFuture<GpuRank, T>, whole: bool) -> Result<(T, Completion)> {
        let op = op.after(&self.stream);
        if whole { op.complete_on(&self.stream).await } else { op.send_only().await?.complete_on(&self.stream).await }
    }
}

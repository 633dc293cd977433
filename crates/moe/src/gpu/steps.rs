//! A lane's decode layers captured whole ([`Lane::capture_layers`]): one CUDA graph per layer
//! holding the attention stand-in, the router, the shared expert (a branch of the graph), the
//! low-latency dispatch, the experts, the combine and the shared expert's add, replayed with
//! one launch per layer (`Group::replay`). The host enqueues a layer with one graph launch
//! (and the replay's bookkeeping) instead of the router's, the handle's, the dispatch's, the
//! experts', the combine's and the add's: what keeps its enqueue time per layer small.
//!
//! The graphs read fixed buffers: layer 0 reads the steps' input buffer (the caller copies each
//! micro-batch's tokens in with [`LayerSteps::load_input`]), layer `l + 1` reads layer `l`'s
//! output; the router writes the lane's `topk_idx`, which the captured dispatch and combine read
//! through a handle of captured steps per layer ([`GpuRank::graph_handle`]).

use std::sync::Arc;

use cudarc::driver::{CudaEvent, CudaStream};
use epflow_core::ops::{CombineInputs, CombineOptions, DispatchInputs, DispatchOptions, HandleOptions};
use epflow_core::{DType, Error, Result};
use epflow_kernels::{DeviceTensor, GpuHandle, GpuRank, GpuStep};

use super::blas::{Blas, WORKSPACE_BYTES};
use super::cuda;
use super::lane::Lane;
use super::model::GpuMoeModel;

/// A lane's first `layers` decode layers captured as steps, one per layer (see the module
/// docs). Replays run on [`LayerSteps::stream`], one after another; every rank replays the same
/// layers in the same order as its peers (collectives). The lane's scratch is the steps'
/// scratch: do not run the lane's other methods while replays are on the device.
pub struct LayerSteps {
    stream: Arc<CudaStream>,
    input: DeviceTensor,
    output: DeviceTensor,
    steps: Vec<GpuStep>,
    _handles: Vec<GpuHandle>,
    /// cuBLAS on the capture stream and on the shared expert's branch (their workspaces are in
    /// the graphs), the branch's stream and its fork and join events.
    _keep: (Blas, Blas, Arc<CudaStream>, CudaEvent, CudaEvent),
}

impl std::fmt::Debug for LayerSteps {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LayerSteps").field("layers", &self.steps.len()).finish()
    }
}

impl LayerSteps {
    /// Device bytes of [`Lane::capture_layers`] for `layers` layers of `preset` on a group of
    /// `ranks` ranks, `tokens` tokens per micro-batch (each layer's handle owns one dispatch's
    /// outputs, `[L x R*M x H]`, and one combine's): on top of the lane's own.
    pub fn bytes(preset: &crate::ModelPreset, ranks: usize, tokens: usize, layers: usize) -> u128 {
        let (h, l) = (preset.hidden as u128, (preset.num_experts / ranks.max(1)) as u128);
        let (b, c) = (tokens as u128, (ranks * tokens) as u128);
        let per_layer = 2 * l * c * h + 4 * l + 2 * b * h + 8 * l * c + (1 << 20);
        layers as u128 * per_layer + 2 * b * h + 2 * WORKSPACE_BYTES as u128
    }

    /// The stream the replays run on: order the input's refill and the output's readers on it.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The step of layer `layer` (replay it with `Group::replay`).
    pub fn step(&self, layer: usize) -> Option<&GpuStep> {
        self.steps.get(layer)
    }

    /// The layers captured.
    pub fn layers(&self) -> usize {
        self.steps.len()
    }

    /// The last layer's output, `[B x H]` BF16, rewritten by every replay of that layer.
    pub fn output(&self) -> &DeviceTensor {
        &self.output
    }

    /// Copies micro-batch tokens `x` (`[B x H]` BF16 on the lane's device) into the buffer layer
    /// 0 reads, in the steps stream's order (after `x`'s ready event, if it has one). `x` must
    /// stay unchanged until the copy has run.
    pub fn load_input(&self, x: &DeviceTensor) -> Result<()> {
        if x.desc().shape != self.input.desc().shape
            || x.desc().dtype != DType::Bf16
            || x.device() != self.input.device()
        {
            return Err(Error::Unsupported(format!(
                "load_input: BF16 {:?} on device {} expected, got {:?} {:?} on device {}",
                self.input.desc().shape,
                self.input.device(),
                x.desc().dtype,
                x.desc().shape,
                x.device()
            )));
        }
        if let Some(e) = x.ready_event() {
            self.stream.wait(e).map_err(|e| cuda("wait for the input", e))?;
        }
        self.stream.context().bind_to_thread().map_err(|e| cuda("bind context", e))?;
        let bytes = x.desc().shape.iter().product::<usize>() * 2;
        // SAFETY: both buffers are live BF16 tensors of `bytes` bytes on this stream's device
        // (shapes checked above), `self.input` owned by the steps; the copy is enqueued on the
        // steps stream, ahead of the replays that read it.
        unsafe { cudarc::driver::result::memcpy_dtod_async(self.input.ptr(), x.ptr(), bytes, self.stream.cu_stream()) }
            .map_err(|e| cuda("copy the micro-batch's tokens in", e))
    }

    /// An event recorded on the steps stream now (for timing).
    pub fn record(&self) -> Result<Arc<CudaEvent>> {
        let e = self
            .stream
            .context()
            .new_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(|x| cuda("create event", x))?;
        e.record(&self.stream).map_err(|x| cuda("record event", x))?;
        Ok(Arc::new(e))
    }
}

impl Lane {
    /// Captures the first `layers` decode layers of `model` on this lane as steps of `rank`
    /// (one CUDA graph per layer, see [`LayerSteps`]), each computing what [`Lane::forward`]
    /// computes, bit for bit: the attention stand-in, the router into the lane's `topk_idx` and
    /// `topk_weights`, the shared expert on a branch, the dispatch, the padded experts, the
    /// combine with the router's weights, the shared expert's add.
    ///
    /// Call it after the lane has run its layers once eagerly (that loads every kernel the
    /// graphs hold; CUDA's lazy loading refuses a first load inside a capture), with no work
    /// of the lane on the device. Not collective (each rank captures on its own); the replays
    /// are. Needs a low-latency expert-major group whose peers are all reached over NVLink.
    pub fn capture_layers(&self, model: &GpuMoeModel, rank: &GpuRank, layers: usize) -> Result<LayerSteps> {
        if layers == 0 || layers > model.layers.len() {
            return Err(Error::Unsupported(format!("capture_layers: 1..={} layers, not {layers}", model.layers.len())));
        }
        let ctx = self.stream().context();
        let stream = ctx.new_stream().map_err(|x| cuda("create stream", x))?;
        let side = ctx.new_stream().map_err(|x| cuda("create stream", x))?;
        let (main_blas, side_blas) = (Blas::new(&stream, model.device)?, Blas::new(&side, model.device)?);
        let fork = ctx.new_event(None).map_err(|x| cuda("create event", x))?;
        let join = ctx.new_event(None).map_err(|x| cuda("create event", x))?;
        let (b, h) = (self.tokens(), model.preset.hidden);
        let input = DeviceTensor::zeros(ctx, model.device, self.out.desc().clone())?;
        let (mut steps, mut handles) = (Vec::with_capacity(layers), Vec::with_capacity(layers));
        let mut x = input.clone();
        for w in model.layers.iter().take(layers) {
            let handle = rank.graph_handle(&self.topk_idx, &HandleOptions::default())?;
            let combined = handle.graph_combine_output().cloned().ok_or_else(|| cuda("graph handle", "no output"))?;
            let output = if self.shared.is_some() { self.out.clone() } else { combined.clone() };
            let step = rank.capture(&stream, |cap| {
                let s = cap.stream().clone();
                let tokens = self.routed_tokens(&x);
                self.enqueue_router(model, w, &x, &s, &main_blas)?;
                let shared = self.shared.as_ref().filter(|_| w.shared.is_some());
                if shared.is_some() {
                    fork.record(&s).map_err(|e| cuda("fork the shared expert", e))?;
                    side.wait(&fork).map_err(|e| cuda("fork the shared expert", e))?;
                    self.enqueue_shared_expert(model, w, &tokens, &side, &side_blas)?;
                    join.record(&side).map_err(|e| cuda("join the shared expert", e))?;
                }
                // Send and receive halves, not one cooperative kernel: a replay holding one waits
                // for the channel's previous one-launch kernel (another lane's whole replay), and
                // the lanes would not overlap.
                let sent = cap.dispatch_send(&handle, DispatchInputs::new(&tokens), &DispatchOptions::default())?;
                let d = cap.complete_dispatch(sent)?;
                let counts = d.counts.as_ref().ok_or_else(|| {
                    Error::Unsupported("capture_layers: the dispatch returned no device counts".into())
                })?;
                self.enqueue_experts(model, w, &d.tokens, counts, &s, &main_blas)?;
                let inputs = CombineInputs::new(&self.y).with_weights(&self.topk_weights);
                let sent = cap.combine_send(&handle, inputs, &CombineOptions::default())?;
                let y = cap.complete_combine(sent)?;
                if let Some(sc) = shared {
                    s.wait(&join).map_err(|e| cuda("join the shared expert", e))?;
                    model.kernels.add(&s, y.ptr(), sc.y.ptr(), output.ptr(), (b * h) as u64)?;
                }
                Ok(())
            })?;
            steps.push(step);
            handles.push(handle);
            x = output;
        }
        Ok(LayerSteps {
            stream,
            input,
            output: x,
            steps,
            _handles: handles,
            _keep: (main_blas, side_blas, side, fork, join),
        })
    }
}

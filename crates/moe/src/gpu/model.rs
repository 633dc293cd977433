//! [`GpuMoeModel`]: a preset's first layers on one rank, with weights drawn on the device.

use std::sync::Arc;

use cudarc::driver::CudaContext;
use epflow_core::error::human_bytes;
use epflow_core::{DType, Error, Result, TensorDesc, TensorTag};
use epflow_kernels::{DeviceTensor, GpuRank};

use super::cuda;
use super::kernels::{MAX_ROUTER_EXPERTS, MoeKernels};
use crate::preset::ModelPreset;
use crate::weights::{self, Matrix, Part, bytes_per_rank};

/// How a [`GpuMoeModel`] is built.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ModelOptions {
    /// The weights' seed (every rank and the CPU reference draw the same weights from it).
    pub seed: u64,
    /// Layers: the preset's first `layers` (1 up to the preset's count).
    pub layers: usize,
    /// Run the attention stand-in ([`ModelPreset::attention`]) before each layer's router.
    pub attention: bool,
}

/// One layer's weights on the device (row-major BF16).
#[derive(Debug)]
pub(crate) struct DeviceLayer {
    /// The router's gate `[H x E]`.
    pub gate: DeviceTensor,
    /// The local experts' `gate_up`, `[L x H x 2F]`.
    pub gate_up: DeviceTensor,
    /// The local experts' `down`, `[L x F x H]`.
    pub down: DeviceTensor,
    /// The shared expert's `gate_up` `[H x 2Fs]` and `down` `[Fs x H]`.
    pub shared: Option<(DeviceTensor, DeviceTensor)>,
    /// The attention stand-in's weights, `[k x n]` each.
    pub attention: Vec<DeviceTensor>,
}

/// The first layers of a preset on one rank of a group: rank `r` of `R` holds the gate, the
/// shared expert and the attention stand-in of every layer, and routed experts
/// `r * L .. (r + 1) * L` (`L = E / R`), the same values [`crate::weights::LayerWeights::generate`]
/// gives on the host.
#[derive(Debug)]
pub struct GpuMoeModel {
    pub(crate) preset: ModelPreset,
    pub(crate) rank: usize,
    pub(crate) ranks: usize,
    pub(crate) attention: bool,
    pub(crate) ctx: Arc<CudaContext>,
    pub(crate) device: usize,
    pub(crate) kernels: MoeKernels,
    pub(crate) layers: Vec<DeviceLayer>,
}

/// Bytes of one layer's attention stand-in weights.
pub(crate) fn attention_bytes(preset: &ModelPreset) -> u128 {
    preset.attention.iter().map(|&(k, n)| 2 * (k * n) as u128).sum()
}

/// The device's free memory, in bytes.
pub(crate) fn free_memory(ctx: &Arc<CudaContext>) -> Result<u128> {
    ctx.bind_to_thread().map_err(|e| cuda("bind context", e))?;
    let (free, _) = cudarc::driver::result::mem_get_info().map_err(|e| cuda("query free memory", e))?;
    Ok(free as u128)
}

fn bf16_tensor(ctx: &Arc<CudaContext>, device: usize, shape: &[usize]) -> Result<DeviceTensor> {
    DeviceTensor::zeros(ctx, device, TensorDesc::contiguous(TensorTag::Tokens, DType::Bf16, shape))
}

impl GpuMoeModel {
    /// The weights of `opts.layers` layers of `preset` for `rank`'s place in its group, drawn on
    /// its device (synchronously). `reserve` bytes are kept free for what the caller allocates
    /// next (the lanes' scratch: [`super::Lane::bytes`]). Errors: shapes the kernels do not
    /// take, more layers than the preset has, or weights that do not fit the device's free
    /// memory (naming the bytes needed).
    pub fn new(rank: &GpuRank, preset: ModelPreset, opts: ModelOptions, reserve: u128) -> Result<Self> {
        let ranks = epflow_core::backend::Backend::num_ranks(rank);
        let me = epflow_core::backend::Backend::rank(rank);
        preset.check(ranks)?;
        if opts.layers == 0 || opts.layers > preset.layers {
            return Err(Error::Unsupported(format!(
                "model {}: {} layers asked, it has 1..={}",
                preset.name, opts.layers, preset.layers
            )));
        }
        if preset.num_experts > MAX_ROUTER_EXPERTS {
            return Err(Error::Unsupported(format!(
                "model {}: {} experts, the router kernel takes at most {MAX_ROUTER_EXPERTS}",
                preset.name, preset.num_experts
            )));
        }
        let ctx = Arc::clone(rank.context());
        let per_layer = bytes_per_rank(&preset, ranks) + if opts.attention { attention_bytes(&preset) } else { 0 };
        let need = per_layer * opts.layers as u128 + reserve;
        let free = free_memory(&ctx)?;
        if need > free {
            return Err(Error::Unsupported(format!(
                "model {} on rank {me} of {ranks}: {} layers of weights ({} each) and {} of scratch need {}, the GPU has {} free (use fewer --layers or more ranks)",
                preset.name,
                opts.layers,
                human_bytes(per_layer),
                human_bytes(reserve),
                human_bytes(need),
                human_bytes(free)
            )));
        }
        let kernels = MoeKernels::load(&ctx)?;
        let device = rank.device();
        let stream = ctx.new_stream().map_err(|e| cuda("create stream", e))?;
        let (h, e, f) = (preset.hidden, preset.num_experts, preset.expert_ffn);
        let local = e / ranks;
        let fill = |t: &DeviceTensor, offset: usize, n: usize, key: u64, fan_in: usize| {
            kernels.fill(&stream, t.ptr() + 2 * offset as u64, n as u64, key, weights::scale(fan_in))
        };
        let mut layers = Vec::with_capacity(opts.layers);
        for layer in 0..opts.layers {
            let gate = bf16_tensor(&ctx, device, &[h, e])?;
            fill(&gate, 0, h * e, weights::key(opts.seed, layer, Part::Gate, Matrix::First), h)?;
            let gate_up = bf16_tensor(&ctx, device, &[local, h, 2 * f])?;
            let down = bf16_tensor(&ctx, device, &[local, f, h])?;
            for l in 0..local {
                let part = Part::Expert(me * local + l);
                fill(&gate_up, l * h * 2 * f, h * 2 * f, weights::key(opts.seed, layer, part, Matrix::First), h)?;
                fill(&down, l * f * h, f * h, weights::key(opts.seed, layer, part, Matrix::Down), f)?;
            }
            let shared = if preset.shared_experts > 0 {
                let fs = preset.shared_ffn;
                let (gu, d) = (bf16_tensor(&ctx, device, &[h, 2 * fs])?, bf16_tensor(&ctx, device, &[fs, h])?);
                fill(&gu, 0, h * 2 * fs, weights::key(opts.seed, layer, Part::Shared, Matrix::First), h)?;
                fill(&d, 0, fs * h, weights::key(opts.seed, layer, Part::Shared, Matrix::Down), fs)?;
                Some((gu, d))
            } else {
                None
            };
            let mut attention = Vec::new();
            if opts.attention {
                for (j, &(k, n)) in preset.attention.iter().enumerate() {
                    let w = bf16_tensor(&ctx, device, &[k, n])?;
                    // Keys apart from the experts' (part ids from 2 up): 1 << 40 plus the GEMM.
                    let key = weights::key(opts.seed ^ (1 << 40) ^ j as u64, layer, Part::Gate, Matrix::First);
                    fill(&w, 0, k * n, key, k)?;
                    attention.push(w);
                }
            }
            layers.push(DeviceLayer { gate, gate_up, down, shared, attention });
        }
        stream.synchronize().map_err(|e| cuda("draw weights", e))?;
        Ok(GpuMoeModel { preset, rank: me, ranks, attention: opts.attention, ctx, device, kernels, layers })
    }

    /// The preset.
    pub fn preset(&self) -> &ModelPreset {
        &self.preset
    }

    /// The router's top-k of `logits` (`[B x E]` FP32 on this device) by this model's scoring,
    /// synchronously: `topk_idx` `[B x K]` int64 and `topk_weights` `[B x K]` FP32 (the
    /// kernel the layer runs after its gate GEMM; for checks against
    /// [`crate::reference::top_k`] and [`crate::reference::weights_of`]).
    pub fn route_logits(&self, logits: &DeviceTensor) -> Result<(DeviceTensor, DeviceTensor)> {
        let (e, k) = (self.preset.num_experts, self.preset.top_k);
        let d = logits.desc();
        if d.dtype != DType::F32 || d.shape.len() != 2 || d.shape[1] != e || logits.device() != self.device {
            return Err(Error::Unsupported(format!(
                "route_logits: FP32 [B x {e}] on device {} expected, got {:?} {:?}",
                self.device, d.dtype, d.shape
            )));
        }
        let b = d.shape[0];
        let idx = DeviceTensor::zeros(
            &self.ctx,
            self.device,
            TensorDesc::contiguous(TensorTag::TopkIdx, DType::I64, &[b, k]),
        )?;
        let w = DeviceTensor::zeros(
            &self.ctx,
            self.device,
            TensorDesc::contiguous(TensorTag::TopkWeights, DType::F32, &[b, k]),
        )?;
        let stream = self.ctx.new_stream().map_err(|x| cuda("create stream", x))?;
        if let Some(ev) = logits.ready_event() {
            stream.wait(ev).map_err(|x| cuda("wait for logits", x))?;
        }
        self.kernels.router_topk(&stream, logits.ptr(), b, e, k, self.preset.scoring, idx.ptr(), w.ptr())?;
        stream.synchronize().map_err(|x| cuda("router top-k", x))?;
        Ok((idx, w))
    }

    /// This rank's place in its group.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Layers held.
    pub fn layers(&self) -> usize {
        self.layers.len()
    }

    /// Whether the attention stand-in runs.
    pub fn attention(&self) -> bool {
        self.attention
    }

    /// The device context.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }
}

//! Grouped experts over a high-throughput dispatch's rows (prefill): each local expert's rows
//! gathered contiguously, one cuBLAS grouped GEMM per projection at the counts handle creation
//! brought to the host, and the weighted sum of each received row's local experts, which the
//! high-throughput combine takes.
//!
//! The padded layout of the low-latency path computes every expert's `R*M` rows: at prefill
//! sizes (thousands of tokens per rank) that is hundreds of times the work. A high-throughput
//! handle created with [`epflow_core::ops::RecvRows::Exact`] knows each expert's count on the
//! host (DeepEP's normal mode and SGLang's prefill read the same counts), so the GEMMs run at
//! those shapes.

use epflow_core::{DType, Error, Result, TensorDesc, TensorTag};
use epflow_kernels::DeviceTensor;

use super::blas::{Blas, Grouped};
use super::model::{DeviceLayer, GpuMoeModel};

/// What [`super::Lane::experts_grouped_on`] computes on: a high-throughput dispatch's outputs
/// (`N` rows) and the per-expert counts, on the device and on the host.
#[derive(Clone, Copy, Debug)]
pub struct GroupedInputs<'a> {
    /// Received tokens `[N x H]` BF16.
    pub tokens: &'a DeviceTensor,
    /// Received top-k local expert indices `[N x K]` int64 (-1: not on this rank).
    pub topk_idx: &'a DeviceTensor,
    /// Received top-k weights `[N x K]` FP32.
    pub topk_weights: &'a DeviceTensor,
    /// Rows per local expert `[L]` int32, on the device (the dispatch's counts).
    pub counts: &'a DeviceTensor,
    /// The same counts on the host ([`epflow_core::handle::RoutingHandle::recv_expert_counts`]).
    pub host_counts: &'a [i32],
}

/// A lane's scratch for grouped experts over at most `rows` received rows.
#[derive(Debug)]
pub(crate) struct GroupedScratch {
    rows: usize,
    positions: usize,
    /// Gathered expert inputs `[P x H]`, `gate_up` outputs `[P x 2F]`, activations `[P x F]`,
    /// expert outputs `[P x H]`, for `P` positions (row, local expert).
    xe: DeviceTensor,
    gu: DeviceTensor,
    act: DeviceTensor,
    y: DeviceTensor,
    /// Per position, its received row (`[P]` int32); per (row, k), its position (`[rows x K]`).
    row_of: DeviceTensor,
    pos_of: DeviceTensor,
    /// The weighted sums `[rows x H]` BF16: the combine's input.
    out: DeviceTensor,
    /// The grouped GEMMs' device pointer arrays (3 per expert, for each projection).
    arrays: [DeviceTensor; 2],
}

/// Positions (row, local expert) of at most `rows` received rows: each row has at most
/// `min(K, L)` local experts.
fn positions(preset: &crate::ModelPreset, ranks: usize, rows: usize) -> usize {
    rows * preset.top_k.min(preset.num_experts / ranks.max(1))
}

impl GroupedScratch {
    /// Device bytes of the scratch for at most `rows` received rows.
    pub(crate) fn bytes(preset: &crate::ModelPreset, ranks: usize, rows: usize) -> u128 {
        let (h, f, k) = (preset.hidden as u128, preset.expert_ffn as u128, preset.top_k as u128);
        let (p, n, l) =
            (positions(preset, ranks, rows) as u128, rows as u128, (preset.num_experts / ranks.max(1)) as u128);
        2 * p * (2 * h + 3 * f) + 4 * p + 4 * n * k + 2 * n * h + 2 * 24 * l
    }

    pub(crate) fn new(model: &GpuMoeModel, rows: usize) -> Result<Self> {
        let p = &model.preset;
        let (h, f, k) = (p.hidden, p.expert_ffn, p.top_k);
        if h % 8 != 0 {
            return Err(Error::Unsupported(format!("grouped experts: hidden {h} is not a multiple of 8")));
        }
        let local = p.num_experts / model.ranks;
        let positions = positions(p, model.ranks, rows);
        let t = |dtype: DType, shape: &[usize]| {
            DeviceTensor::zeros(&model.ctx, model.device, TensorDesc::contiguous(TensorTag::Tokens, dtype, shape))
        };
        Ok(GroupedScratch {
            rows,
            positions,
            xe: t(DType::Bf16, &[positions, h])?,
            gu: t(DType::Bf16, &[positions, 2 * f])?,
            act: t(DType::Bf16, &[positions, f])?,
            y: t(DType::Bf16, &[positions, h])?,
            row_of: t(DType::I32, &[positions])?,
            pos_of: t(DType::I32, &[rows, k])?,
            out: t(DType::Bf16, &[rows, h])?,
            arrays: [t(DType::I64, &[3 * local])?, t(DType::I64, &[3 * local])?],
        })
    }

    /// Enqueues the experts of `w` on `inputs` on `stream` (with `blas`, bound to it) and
    /// returns the weighted sums `[N x H]` (the scratch's memory, rewritten by the lane's next
    /// grouped call), ready in `stream`'s order.
    pub(crate) fn run(
        &self,
        model: &GpuMoeModel,
        w: &DeviceLayer,
        stream: &cudarc::driver::CudaStream,
        blas: &Blas,
        inputs: &GroupedInputs<'_>,
    ) -> Result<DeviceTensor> {
        let p = &model.preset;
        let (h, f, k) = (p.hidden, p.expert_ffn, p.top_k);
        let local = p.num_experts / model.ranks;
        let n = inputs.tokens.desc().shape.first().copied().unwrap_or(0);
        let want = |t: &DeviceTensor, dtype: DType, shape: &[usize], what: &str| {
            if t.desc().dtype != dtype || t.desc().shape != shape || !t.desc().is_contiguous() {
                return Err(Error::Unsupported(format!(
                    "grouped experts: {what}: contiguous {dtype:?} {shape:?} expected, got {:?} {:?}",
                    t.desc().dtype,
                    t.desc().shape
                )));
            }
            Ok(())
        };
        want(inputs.tokens, DType::Bf16, &[n, h], "received tokens")?;
        want(inputs.topk_idx, DType::I64, &[n, k], "received top-k indices")?;
        want(inputs.topk_weights, DType::F32, &[n, k], "received top-k weights")?;
        want(inputs.counts, DType::I32, &[local], "per-expert counts")?;
        let counts = inputs.host_counts;
        let total: i64 = counts.iter().map(|&c| i64::from(c)).sum();
        if counts.len() != local || counts.iter().any(|&c| c < 0) || total as usize > self.positions || n > self.rows {
            return Err(Error::Unsupported(format!(
                "grouped experts: {n} rows and {total} (row, expert) pairs over {} host counts; this lane holds {} rows, {} pairs, {local} experts",
                counts.len(),
                self.rows,
                self.positions
            )));
        }
        let kr = &model.kernels;
        kr.ht_slots(
            stream,
            inputs.topk_idx.ptr(),
            n,
            k,
            inputs.counts.ptr(),
            local,
            self.positions,
            self.row_of.ptr(),
            self.pos_of.ptr(),
        )?;
        let total = total as usize;
        kr.ht_gather(stream, inputs.tokens.ptr(), self.row_of.ptr(), total, h, self.xe.ptr())?;
        // One group per expert that received rows: its block of positions and its weights.
        let (mut m, mut starts, mut experts) = (Vec::new(), Vec::new(), Vec::new());
        let mut at = 0u64;
        for (e, &c) in counts.iter().enumerate() {
            if c > 0 {
                m.push(c);
                starts.push(at);
                experts.push(e as u64);
            }
            at += c as u64;
        }
        let addrs =
            |base: u64, row: usize, at: &[u64]| at.iter().map(|&i| base + 2 * i * row as u64).collect::<Vec<_>>();
        let gate_up = Grouped {
            m: &m,
            k: h,
            n: 2 * f,
            x: &addrs(self.xe.ptr(), h, &starts),
            w: &addrs(w.gate_up.ptr(), h * 2 * f, &experts),
            y: &addrs(self.gu.ptr(), 2 * f, &starts),
        };
        blas.gemm_grouped(stream, &gate_up, &self.arrays[0])?;
        kr.swiglu(stream, self.gu.ptr(), self.act.ptr(), None, 1, total, f)?;
        let down = Grouped {
            m: &m,
            k: f,
            n: h,
            x: &addrs(self.act.ptr(), f, &starts),
            w: &addrs(w.down.ptr(), f * h, &experts),
            y: &addrs(self.y.ptr(), h, &starts),
        };
        blas.gemm_grouped(stream, &down, &self.arrays[1])?;
        kr.ht_reduce(
            stream,
            self.y.ptr(),
            inputs.topk_idx.ptr(),
            inputs.topk_weights.ptr(),
            self.pos_of.ptr(),
            n,
            k,
            h,
            self.out.ptr(),
        )?;
        self.out.leading_rows(n)
    }
}

//! NCCL EP's high-throughput expert-major layout over epflow's flat one: each local expert's
//! received rows in a zone of its own (a row that reaches several local experts is copied into
//! each), zones padded to an alignment and zero-filled, one weight per slot; and the way back,
//! each received row's slots summed into the flat combine's input. Built on the device from a
//! flat dispatch's outputs, in a stream's order (`util.cu`: `ep_em_*`). Within a zone the rows
//! keep the flat order (source rank, then source token). The backward pass reuses the slots a
//! forward dispatch numbered: gradients scattered alike, weight gradients gathered back per entry.

use std::sync::Arc;

use cudarc::driver::{CudaStream, PushKernelArg};
use epflow_core::{DType, Error, TensorDesc, TensorTag};

use super::{GpuRank, util_launch};
use crate::device::{DeviceTensor, cuda};

/// The zones of one high-throughput handle's expert-major outputs: from the rows each local
/// expert receives (the handle's counts), each zone's padded size and first slot, and the slot
/// of every received entry once [`GpuRank::expert_major_slots_on`] numbered them.
#[derive(Debug)]
pub struct ExpertMajorPlan {
    /// Rows received per local expert (`[L]`, the handle's counts).
    pub counts: Vec<i64>,
    /// Each zone's size: the count rounded up to the alignment.
    pub padded: Vec<i64>,
    /// Each zone's first slot: the exclusive prefix sum of `padded`.
    pub offsets: Vec<i64>,
    /// Slots in all: the sum of `padded`.
    pub total: usize,
    rows: usize,
    top_k: usize,
    /// `counts`, `padded` and `offsets` on the device (`[3 x L]` int64).
    zones: DeviceTensor,
    /// The slot of every received entry (`[N x K]` int32, `-1`: no local expert).
    pos_of: DeviceTensor,
}

impl ExpertMajorPlan {
    /// Rows of the flat layout (`N`).
    pub fn rows(&self) -> usize {
        self.rows
    }

    fn zone(&self, i: u64) -> u64 {
        self.zones.ptr() + i * self.counts.len() as u64 * 8
    }
}

/// `value` rounded up to a multiple of `alignment` (0 and 1: no rounding).
fn align(value: i64, alignment: usize) -> i64 {
    let a = alignment as i64;
    if a <= 1 { value } else { (value + a - 1) / a * a }
}

impl GpuRank {
    /// The plan of a handle whose flat dispatch delivers `rows` rows of top-k `top_k`, `counts[e]`
    /// of them to local expert `e`, with zones aligned to `alignment` slots (0 or 1: none; else
    /// a power of two). Allocates its device memory here.
    pub fn expert_major_plan(
        &self,
        counts: &[i32],
        rows: usize,
        top_k: usize,
        alignment: usize,
    ) -> Result<ExpertMajorPlan, Error> {
        if alignment > 1 && !alignment.is_power_of_two() {
            return Err(Error::Unsupported(format!("expert-major alignment {alignment}: 0, 1 or a power of two")));
        }
        let counts: Vec<i64> = counts.iter().map(|&c| i64::from(c.max(0))).collect();
        let padded: Vec<i64> = counts.iter().map(|&c| align(c, alignment)).collect();
        let offsets: Vec<i64> = padded.iter().scan(0i64, |acc, &p| Some(std::mem::replace(acc, *acc + p))).collect();
        let total = padded.iter().sum::<i64>() as usize;
        let l = counts.len();
        let host: Vec<i64> = counts.iter().chain(&padded).chain(&offsets).copied().collect();
        let zones = DeviceTensor::upload_with(
            &self.shared.ctx,
            self.shared.device,
            &epflow_core::HostTensor::new(
                TensorTag::TopkIdx,
                &[3, l.max(1)],
                epflow_core::HostData::I64(if l == 0 { vec![0; 3] } else { host }),
            ),
            self.local_allocator(),
        )?;
        let pos_of =
            self.local_zeros(TensorDesc::contiguous(TensorTag::TopkIdx, DType::I32, &[rows.max(1), top_k.max(1)]))?;
        Ok(ExpertMajorPlan { counts, padded, offsets, total, rows, top_k, zones, pos_of })
    }

    /// Numbers the slots of a flat dispatch's entries, on `stream` after `idx`'s producers:
    /// `idx` is its `[N x K]` int64 local expert indices (`-1`: none here).
    pub fn expert_major_slots_on(
        &self,
        stream: &Arc<CudaStream>,
        plan: &ExpertMajorPlan,
        idx: &DeviceTensor,
    ) -> Result<(), Error> {
        let (n, k) = (plan.rows, plan.top_k);
        idx.expect_shape("expert_major_slots_on's idx", DType::I64, &[n, k])?;
        self.read_on(stream, idx, None)?;
        // SAFETY: `pos_of` holds `N x K` int32 of this context (allocated by the plan); ordered
        // on `stream`.
        unsafe { cudarc::driver::sys::cuMemsetD8Async(plan.pos_of.ptr(), 0xff, n * k * 4, stream.cu_stream()) }
            .result()
            .map_err(|e| cuda("clear the expert-major slots", e))?;
        let l = plan.counts.len();
        if l == 0 || n == 0 {
            return Ok(());
        }
        let cfg =
            cudarc::driver::LaunchConfig { grid_dim: (l as u32, 1, 1), block_dim: (512, 1, 1), shared_mem_bytes: 0 };
        let (ip, nn, kk, off, pp) = (idx.ptr(), n as i32, k as i32, plan.zone(2), plan.pos_of.ptr());
        // SAFETY: the arguments match `ep_em_slots(u64, int, int, u64, u64)`: `idx` holds N x K
        // int64 (checked), the offsets L int64 and `pos_of` N x K int32 (the plan's); 512
        // threads, a multiple of 32 (the kernel's warp sums); ordered on `stream`.
        unsafe {
            stream
                .launch_builder(&self.shared.functions.em_slots)
                .arg(&ip)
                .arg(&nn)
                .arg(&kk)
                .arg(&off)
                .arg(&pp)
                .launch(cfg)
        }
        .map_err(|e| cuda("launch ep_em_slots", e))?;
        Ok(())
    }

    /// The expert-major outputs from the flat ones, on `stream` after
    /// [`GpuRank::expert_major_slots_on`]: every received row of `tokens` (`[N x H]` BF16) into
    /// the slots of its entries, their weights (`weights`: the flat `[N x K]` fp32 weights and
    /// the `[S]` fp32 `out_weights`; `None` for a backward dispatch's gradients) one per slot,
    /// and the zones' padding zeroed. `out` (`[S x H]` BF16) and `out_weights` hold at least
    /// `plan.total` slots.
    pub fn expert_major_scatter_on(
        &self,
        stream: &Arc<CudaStream>,
        plan: &ExpertMajorPlan,
        tokens: &DeviceTensor,
        out: &DeviceTensor,
        weights: Option<(&DeviceTensor, &DeviceTensor)>,
    ) -> Result<(), Error> {
        let (n, k) = (plan.rows, plan.top_k);
        let h = tokens.desc().shape.get(1).copied().unwrap_or(0);
        tokens.expect_shape("expert_major_scatter_on's tokens", DType::Bf16, &[n, h])?;
        slots(out, "expert_major_scatter_on's out", DType::Bf16, plan.total, h)?;
        if let Some((w, ow)) = weights {
            w.expect_shape("expert_major_scatter_on's weights", DType::F32, &[n, k])?;
            slots(ow, "expert_major_scatter_on's out_weights", DType::F32, plan.total, 1)?;
        }
        self.read_on(stream, tokens, weights.map(|(w, _)| w))?;
        let (hh, kk, nn) = (h as i32, k as i32, n as i32);
        if n > 0 {
            let blocks = n.min(self.shared.num_sms as usize * 8) as u32;
            let cfg = util_launch(blocks);
            let (wp, ow) = weights.map_or((0, 0), |(w, ow)| (w.ptr(), ow.ptr()));
            let (tp, pp, op) = (tokens.ptr(), plan.pos_of.ptr(), out.ptr());
            // SAFETY: the arguments match `ep_em_scatter(u64, u64, u64, int, int, int, u64, u64)`;
            // the tensors' shapes were checked above (weights 0: none, the kernel skips them) and
            // every slot numbered is below `plan.total`, which `out` and `out_weights` hold;
            // ordered on `stream`.
            unsafe {
                stream
                    .launch_builder(&self.shared.functions.em_scatter)
                    .arg(&tp)
                    .arg(&wp)
                    .arg(&pp)
                    .arg(&nn)
                    .arg(&kk)
                    .arg(&hh)
                    .arg(&op)
                    .arg(&ow)
                    .launch(cfg)
            }
            .map_err(|e| cuda("launch ep_em_scatter", e))?;
        }
        if plan.padded != plan.counts {
            let l = plan.counts.len() as u32;
            let cfg = util_launch(l);
            let ow = weights.map_or(0, |(_, ow)| ow.ptr());
            let (op, off, cnt, pad) = (out.ptr(), plan.zone(2), plan.zone(0), plan.zone(1));
            // SAFETY: the arguments match `ep_em_pad(u64, u64, u64, u64, u64, int)`; the padding
            // slots lie below `plan.total` (checked above; weights 0: none); ordered on `stream`.
            unsafe {
                stream
                    .launch_builder(&self.shared.functions.em_pad)
                    .arg(&op)
                    .arg(&ow)
                    .arg(&off)
                    .arg(&cnt)
                    .arg(&pad)
                    .arg(&hh)
                    .launch(cfg)
            }
            .map_err(|e| cuda("launch ep_em_pad", e))?;
        }
        Ok(())
    }

    /// The flat combine input from expert-major expert outputs, on `stream`: row `n` of `out`
    /// (`[N x H]` BF16) is the BF16 of the fp32 sum, over its entries in top-k order, of their
    /// slots of `y` (`[S x H]` BF16, at least `plan.total` slots).
    pub fn expert_major_reduce_on(
        &self,
        stream: &Arc<CudaStream>,
        plan: &ExpertMajorPlan,
        y: &DeviceTensor,
        out: &DeviceTensor,
    ) -> Result<(), Error> {
        let n = plan.rows;
        let h = out.desc().shape.get(1).copied().unwrap_or(0);
        out.expect_shape("expert_major_reduce_on's out", DType::Bf16, &[n, h])?;
        slots(y, "expert_major_reduce_on's y", DType::Bf16, plan.total, h)?;
        self.read_on(stream, y, None)?;
        if n == 0 {
            return Ok(());
        }
        let blocks = n.min(self.shared.num_sms as usize * 8) as u32;
        let cfg = util_launch(blocks);
        let (yp, pp, nn, kk, hh, op) = (y.ptr(), plan.pos_of.ptr(), n as i32, plan.top_k as i32, h as i32, out.ptr());
        // SAFETY: the arguments match `ep_em_reduce(u64, u64, int, int, int, u64)`; `y` holds
        // every slot numbered (below `plan.total`, checked), `out` N x H; ordered on `stream`.
        unsafe {
            stream
                .launch_builder(&self.shared.functions.em_reduce)
                .arg(&yp)
                .arg(&pp)
                .arg(&nn)
                .arg(&kk)
                .arg(&hh)
                .arg(&op)
                .launch(cfg)
        }
        .map_err(|e| cuda("launch ep_em_reduce", e))?;
        Ok(())
    }

    /// A backward combine's flat weight gradients from expert-major ones, on `stream`: entry
    /// `(n, k)` of `out` (`[N x K]` fp32) is the gradient of its slot in `slot_weights` (`[S]`
    /// fp32, at least `plan.total`), 0 for an entry of no local expert. The slots are those a
    /// forward dispatch numbered ([`GpuRank::expert_major_slots_on`]).
    pub fn expert_major_weights_on(
        &self,
        stream: &Arc<CudaStream>,
        plan: &ExpertMajorPlan,
        slot_weights: &DeviceTensor,
        out: &DeviceTensor,
    ) -> Result<(), Error> {
        let (n, k) = (plan.rows, plan.top_k);
        out.expect_shape("expert_major_weights_on's out", DType::F32, &[n, k])?;
        slots(slot_weights, "expert_major_weights_on's slot_weights", DType::F32, plan.total, 1)?;
        self.read_on(stream, slot_weights, None)?;
        let entries = (n * k) as i64;
        if entries == 0 {
            return Ok(());
        }
        let blocks = (n * k).div_ceil(256).min(self.shared.num_sms as usize * 8) as u32;
        let cfg = util_launch(blocks);
        let (wp, pp, op) = (slot_weights.ptr(), plan.pos_of.ptr(), out.ptr());
        // SAFETY: the arguments match `ep_em_gather_weights(u64, u64, long long, u64)`;
        // `pos_of` and `out` hold N x K entries, every slot numbered is below `plan.total`, which
        // `slot_weights` holds (checked); ordered on `stream`.
        unsafe {
            stream
                .launch_builder(&self.shared.functions.em_gather_weights)
                .arg(&wp)
                .arg(&pp)
                .arg(&entries)
                .arg(&op)
                .launch(cfg)
        }
        .map_err(|e| cuda("launch ep_em_gather_weights", e))?;
        Ok(())
    }
}

/// Requires `t` to be `dtype` with at least `slots` rows of `row` elements (`[S x row]`, or `[S]`
/// for `row` 1).
fn slots(t: &DeviceTensor, what: &str, dtype: DType, slots: usize, row: usize) -> Result<(), Error> {
    let d = t.desc();
    let ok = match d.shape[..] {
        [s] => row == 1 && s >= slots,
        [s, r] => r == row && s >= slots,
        _ => false,
    };
    if d.dtype != dtype || !ok {
        return Err(Error::Unsupported(format!(
            "{what}: {dtype:?} with at least {slots} slots of {row} expected, got {:?} {:?}",
            d.dtype, d.shape
        )));
    }
    Ok(())
}

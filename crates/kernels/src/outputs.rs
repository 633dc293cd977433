//! Outputs of GPU operations: views into the group's buffer set, holding it (through a
//! [`SetLease`]) until the last view is dropped, or into cached memory of their own.
//!
//! Release in stream order: a stream declared as a consumer of the outputs
//! ([`GpuDispatchOutput::record_stream`], or the stream of a stream-ordered completion) gets an
//! event recorded on it when the last view goes; the memory's next writer waits for that event on
//! the device, so a buffer set the device may still read is never overwritten.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use cudarc::driver::{CudaContext, CudaEvent, CudaStream};
use epflow_core::ops::{CombineOutputs, DispatchOutputs};
use epflow_core::protocol::{Fence, SlotGuard};
use epflow_core::{Error, HostData, HostTensor};

use crate::device::consumers::Consumers;
use crate::device::{DeviceTensor, EventPool, Lease, OpTiming, StreamFence, copy_to_host};

/// Device memory the caller owns, which an operation writes its outputs into instead of its
/// buffer set (low-latency) or cached memory (high-throughput): NCCL EP's preallocated output
/// tensors. Addresses are of the rank's device; each must hold the tensor that
/// [`crate::GpuRank::dispatch_output_descs`] / [`crate::GpuRank::combine_output_descs`]
/// describe (high-throughput: at least those rows, with the same row length). `None` keeps that
/// output in epflow's memory.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct OutputTargets {
    /// The tokens.
    pub tokens: u64,
    /// FP8 scales.
    pub scales: Option<u64>,
    /// Top-k weights.
    pub topk_weights: Option<u64>,
    /// Top-k local expert indices.
    pub topk_idx: Option<u64>,
    /// Low-latency dispatch: the receive counters (per local expert, or per source rank for
    /// rank-major handles).
    pub counts: Option<u64>,
    /// Combine with rank masking: the per-token counts of entries on masked ranks, `[B]` int32
    /// (`None`: not written).
    pub masked: Option<u64>,
}

/// A low-latency buffer set on loan to an operation's outputs: the set is released when the
/// operation and every view of its outputs are gone, with a fence on each consumer stream.
#[derive(Debug)]
pub(crate) struct SetLease {
    slot: Mutex<Option<SlotGuard>>,
    consumers: Consumers,
    /// The operation's completion event, when no view reads the set (every output is in the
    /// caller's memory, NCCL EP's preallocated tensors): then nothing reads the set after the
    /// operation's kernels, and that event is the set's one fence, whatever streams consume the
    /// views (no event is recorded on them at the release).
    done: Mutex<Option<StreamFence>>,
}

impl SetLease {
    /// The lease of `slot`; its fences come from `events`.
    pub(crate) fn new(events: &Arc<EventPool>, slot: Option<SlotGuard>) -> Arc<Self> {
        Arc::new(SetLease { slot: Mutex::new(slot), consumers: Consumers::new(events), done: Mutex::new(None) })
    }

    /// No view reads the set: `done`, the operation's completion event (recorded on the stream
    /// `stream`, a [`crate::device::stream_id`]), fences its release.
    pub(crate) fn fence_with(&self, done: &Arc<CudaEvent>, stream: usize) {
        *self.done.lock().unwrap_or_else(|e| e.into_inner()) = Some(StreamFence { event: Arc::clone(done), stream });
    }
}

impl Lease for SetLease {
    fn add_consumer(&self, stream: &Arc<CudaStream>) {
        if self.done.lock().unwrap_or_else(|e| e.into_inner()).is_none() {
            self.consumers.add(stream);
        }
    }
}

impl Drop for SetLease {
    fn drop(&mut self) {
        let slot = self.slot.get_mut().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(mut slot) = slot {
            if let Some(done) = self.done.get_mut().unwrap_or_else(|e| e.into_inner()).take() {
                slot.fence(Arc::new(done) as Fence);
                return;
            }
            for f in self.consumers.stream_fences() {
                slot.fence(Arc::new(f) as Fence);
            }
        }
    }
}

/// Marks every view in `views` ready after `done` (outputs handed out before the device wrote
/// them: epflow operations reading them wait for it on the device, downloads on the host).
fn ready_views<'a>(views: impl IntoIterator<Item = &'a mut DeviceTensor>, done: &Arc<CudaEvent>) {
    for v in views {
        v.set_ready(Arc::clone(done));
    }
}

/// Declares `stream` a consumer of every view in `views`.
fn record_views<'a>(views: impl IntoIterator<Item = &'a DeviceTensor>, stream: &Arc<CudaStream>) {
    for v in views {
        v.record_stream(stream);
    }
}

/// Copies the first `counts[l]` rows of each expert `l` of an `[L x rows x width]` tensor.
fn rows_to_host(ctx: &CudaContext, t: &DeviceTensor, counts: &[i32]) -> Result<HostTensor, Error> {
    let d = t.desc();
    let (rows, width) = (d.shape[1], d.shape[2]);
    let esize = d.dtype.size_bytes();
    let mut bytes = vec![0u8; d.size_bytes()];
    for (l, &n) in counts.iter().enumerate() {
        let n = (n.max(0) as usize).min(rows);
        let off = l * rows * width * esize;
        copy_to_host(ctx, t.ptr() + off as u64, &mut bytes[off..off + n * width * esize])?;
    }
    let data = match d.dtype {
        epflow_core::DType::Fp8E4m3 => HostData::Fp8(bytes),
        epflow_core::DType::U8 => HostData::U8(bytes),
        epflow_core::DType::Bf16 => HostData::Bf16(
            bytes.chunks_exact(2).map(|c| epflow_core::bf16::from_bits(u16::from_le_bytes([c[0], c[1]]))).collect(),
        ),
        epflow_core::DType::F32 => {
            HostData::F32(bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect())
        }
        other => return Err(Error::Backend(format!("unexpected dtype {other} in dispatch output"))),
    };
    Ok(HostTensor::new(d.tag, &d.shape, data))
}

/// The outputs of a GPU dispatch: views into the dispatch buffer set they hold (low-latency), or
/// into memory of their own that returns to the rank's cache when the last view is dropped
/// (high-throughput).
#[derive(Debug)]
pub struct GpuDispatchOutput {
    pub(crate) outputs: DispatchOutputs<DeviceTensor>,
    pub(crate) host_counts: Option<Vec<i32>>,
    pub(crate) elapsed: Option<OpTiming>,
    pub(crate) ctx: Arc<CudaContext>,
}

impl GpuDispatchOutput {
    /// Marks the outputs ready after `done`.
    pub(crate) fn ready_after(&mut self, done: &Arc<CudaEvent>) {
        let o = &mut self.outputs;
        ready_views(
            [Some(&mut o.tokens), o.scales.as_mut(), o.topk_weights.as_mut(), o.topk_idx.as_mut(), o.counts.as_mut()]
                .into_iter()
                .flatten(),
            done,
        );
    }

    /// Declares that work enqueued on `stream` reads these outputs (torch's `record_stream`):
    /// when the last view is dropped, their memory is released in `stream`'s order. Outputs of
    /// a stream-ordered completion already count its stream.
    pub fn record_stream(&self, stream: &Arc<CudaStream>) {
        let o = &self.outputs;
        record_views(
            [Some(&o.tokens), o.scales.as_ref(), o.topk_weights.as_ref(), o.topk_idx.as_ref(), o.counts.as_ref()]
                .into_iter()
                .flatten(),
            stream,
        );
    }

    /// Received tokens: `[L x R*M x H]` (low-latency) or `[N x H]` (high-throughput), BF16 or
    /// FP8.
    pub fn tokens(&self) -> &DeviceTensor {
        &self.outputs.tokens
    }

    /// FP8 scales `[L x R*M x H/128]` or `[N x H/128]`.
    pub fn scales(&self) -> Option<&DeviceTensor> {
        self.outputs.scales.as_ref()
    }

    /// High-throughput forward: the received top-k weights `[N x K]` fp32 (0 where the expert is
    /// not on this rank).
    pub fn topk_weights(&self) -> Option<&DeviceTensor> {
        self.outputs.topk_weights.as_ref()
    }

    /// High-throughput forward: the received top-k indices `[N x K]` int64, as local expert
    /// indices, -1 where the expert is not on this rank.
    pub fn topk_idx(&self) -> Option<&DeviceTensor> {
        self.outputs.topk_idx.as_ref()
    }

    /// Per-local-expert counters `[L]` in device memory.
    pub fn counts(&self) -> Option<&DeviceTensor> {
        self.outputs.counts.as_ref()
    }

    /// The counters the device wrote to pinned host memory (with `CountsLocation::Host`).
    pub fn host_counts(&self) -> Option<&[i32]> {
        self.host_counts.as_deref()
    }

    /// Device time from before the send half to after the complete half (with timing on);
    /// waits until the device has finished the operation.
    pub fn elapsed(&self) -> Option<Duration> {
        self.elapsed_halves().map(|(a, b)| a + b)
    }

    /// Device times of the send half and of the complete half (with timing on); waits until
    /// the device has finished the operation.
    pub fn elapsed_halves(&self) -> Option<(Duration, Duration)> {
        self.elapsed.as_ref()?.halves()
    }

    /// All outputs as tensors.
    pub fn outputs(&self) -> &DispatchOutputs<DeviceTensor> {
        &self.outputs
    }

    /// Copies the outputs to the host (synchronous). Of low-latency `[L x R*M x H]` tokens (and
    /// scales) only each expert's first `counts[l]` rows are copied — the others are unspecified
    /// — into a zero-filled host tensor of the full shape; high-throughput outputs are copied
    /// whole.
    pub fn to_host(&self) -> Result<DispatchOutputs<HostTensor>, Error> {
        let o = &self.outputs;
        if o.tokens.desc().shape.len() == 2 {
            let down = |t: &Option<DeviceTensor>| t.as_ref().map(|t| t.download(&self.ctx)).transpose();
            return Ok(DispatchOutputs {
                tokens: o.tokens.download(&self.ctx)?,
                scales: down(&o.scales)?,
                topk_weights: down(&o.topk_weights)?,
                topk_idx: down(&o.topk_idx)?,
                counts: down(&o.counts)?,
            });
        }
        let counts_t = o
            .counts
            .as_ref()
            .ok_or_else(|| Error::Backend("dispatch output has no counters".into()))?
            .download(&self.ctx)?;
        let counts = counts_t.as_i32().unwrap_or_default().to_vec();
        let tokens = rows_to_host(&self.ctx, &o.tokens, &counts)?;
        let scales = o.scales.as_ref().map(|s| rows_to_host(&self.ctx, s, &counts)).transpose()?;
        Ok(DispatchOutputs { tokens, scales, topk_weights: None, topk_idx: None, counts: Some(counts_t) })
    }
}

/// The outputs of a GPU combine (views into the combine buffer set they hold, or high-throughput
/// memory of their own).
#[derive(Debug)]
pub struct GpuCombineOutput {
    pub(crate) outputs: CombineOutputs<DeviceTensor>,
    pub(crate) elapsed: Option<OpTiming>,
    pub(crate) ctx: Arc<CudaContext>,
}

impl GpuCombineOutput {
    /// Marks the outputs ready after `done`.
    pub(crate) fn ready_after(&mut self, done: &Arc<CudaEvent>) {
        let o = &mut self.outputs;
        ready_views([Some(&mut o.tokens), o.topk_weights.as_mut()].into_iter().flatten(), done);
    }

    /// Declares that work enqueued on `stream` reads these outputs (as
    /// [`GpuDispatchOutput::record_stream`]).
    pub fn record_stream(&self, stream: &Arc<CudaStream>) {
        let o = &self.outputs;
        record_views([Some(&o.tokens), o.topk_weights.as_ref(), o.masked.as_ref()].into_iter().flatten(), stream);
    }

    /// Tokens `[B x H]` BF16 in the original order.
    pub fn tokens(&self) -> &DeviceTensor {
        &self.outputs.tokens
    }

    /// High-throughput backward: the top-k weight gradients `[B x K]` fp32.
    pub fn topk_weights(&self) -> Option<&DeviceTensor> {
        self.outputs.topk_weights.as_ref()
    }

    /// Rank masking: per token, its top-k entries on masked ranks (they contributed zero),
    /// `[B]` int32 in device memory, written by the complete half ([`epflow_core::mask`]).
    pub fn masked(&self) -> Option<&DeviceTensor> {
        self.outputs.masked.as_ref()
    }

    /// Device time from before the send half to after the complete half (with timing on);
    /// waits until the device has finished the operation.
    pub fn elapsed(&self) -> Option<Duration> {
        self.elapsed_halves().map(|(a, b)| a + b)
    }

    /// Device times of the send half and of the complete half (with timing on); waits until
    /// the device has finished the operation.
    pub fn elapsed_halves(&self) -> Option<(Duration, Duration)> {
        self.elapsed.as_ref()?.halves()
    }

    /// Copies the outputs to the host (synchronous).
    pub fn to_host(&self) -> Result<CombineOutputs<HostTensor>, Error> {
        Ok(CombineOutputs {
            tokens: self.outputs.tokens.download(&self.ctx)?,
            topk_weights: self.outputs.topk_weights.as_ref().map(|t| t.download(&self.ctx)).transpose()?,
            masked: self.outputs.masked.as_ref().map(|t| t.download(&self.ctx)).transpose()?,
        })
    }
}

//! Host operation outputs, and the recycled buffers behind them. Outputs hold their buffer set
//! until dropped; then their buffers go back to the set for the next operation that uses it, so
//! steady-state operations allocate nothing large.

use std::sync::{Arc, Mutex, MutexGuard};

use half::bf16;
use half::vec::HalfBitsVecExt;

use super::mailbox::Staging;
use super::memory::check_host_alloc;
use crate::error::Result;
use crate::ops::{CombineOutputs, DispatchOutputs};
use crate::protocol::{Channel, SlotGuard};
use crate::tensor::{HostData, HostTensor, TensorDesc};

/// Recycled buffers of one rank.
#[derive(Debug)]
pub(crate) struct Buffers {
    sets: usize,
    /// Per (channel, set): output buffers given back by dropped outputs.
    outputs: Vec<Mutex<Vec<HostData>>>,
    /// Spare staging buffers.
    staging: Mutex<Vec<Staging>>,
    /// Spare fp32 accumulators.
    scratch: Mutex<Vec<Vec<f32>>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// At most this many spare buffers are kept per list.
const KEEP: usize = 8;

impl Buffers {
    pub(crate) fn new(sets: usize) -> Arc<Self> {
        Arc::new(Buffers {
            sets,
            outputs: (0..Channel::ALL.len() * sets).map(|_| Mutex::default()).collect(),
            staging: Mutex::default(),
            scratch: Mutex::default(),
        })
    }

    fn list(&self, channel: Channel, set: usize) -> &Mutex<Vec<HostData>> {
        &self.outputs[channel.index() * self.sets + set]
    }

    /// A buffer for `desc`: a recycled one of the same type and size if the set has one, else a
    /// new zero-filled one (zeroed pages are mapped lazily, so untouched rows cost no memory).
    /// Recycled buffers keep their old contents. Refuses a buffer larger than this machine's
    /// memory ([`crate::Error::OutOfMemory`]) instead of aborting.
    pub(crate) fn take_output(&self, channel: Channel, set: usize, desc: &TensorDesc) -> Result<HostData> {
        let mut list = lock(self.list(channel, set));
        match list.iter().position(|d| d.dtype() == desc.dtype && d.len() == desc.numel()) {
            Some(i) => Ok(list.swap_remove(i)),
            None => zeroed(desc),
        }
    }

    pub(crate) fn give_output(&self, channel: Channel, set: usize, data: HostData) {
        let mut list = lock(self.list(channel, set));
        if list.len() < KEEP && !data.is_empty() {
            list.push(data);
        }
    }

    /// An empty staging buffer (with the capacity of an earlier one).
    pub(crate) fn take_staging(&self) -> Staging {
        let mut s = lock(&self.staging).pop().unwrap_or_default();
        s.clear();
        s
    }

    pub(crate) fn give_staging(&self, s: Staging) {
        let mut list = lock(&self.staging);
        if list.len() < KEEP {
            list.push(s);
        }
    }

    /// `n` zeros.
    pub(crate) fn take_scratch(&self, n: usize) -> Vec<f32> {
        let mut v = lock(&self.scratch).pop().unwrap_or_default();
        v.clear();
        v.resize(n, 0.0);
        v
    }

    pub(crate) fn give_scratch(&self, v: Vec<f32>) {
        let mut list = lock(&self.scratch);
        if list.len() < KEEP {
            list.push(v);
        }
    }
}

/// A zero-filled buffer for `desc`, allocated with `calloc` semantics (pages are mapped when
/// first written), or [`crate::Error::OutOfMemory`] if it is larger than this machine's memory.
pub(crate) fn zeroed(desc: &TensorDesc) -> Result<HostData> {
    let bytes = (desc.numel() as u128).saturating_mul(desc.dtype.size_bytes() as u128);
    check_host_alloc(|| format!("a {:?} output of shape {:?}", desc.tag, desc.shape), bytes)?;
    let n = desc.numel();
    Ok(match desc.dtype {
        crate::DType::Bf16 => HostData::Bf16(vec![0u16; n].reinterpret_into::<bf16>()),
        crate::DType::F32 => HostData::F32(vec![0.0; n]),
        crate::DType::I32 => HostData::I32(vec![0; n]),
        crate::DType::I64 => HostData::I64(vec![0; n]),
        crate::DType::Fp8E4m3 => HostData::Fp8(vec![0; n]),
        crate::DType::U8 => HostData::U8(vec![0; n]),
    })
}

/// Where an output's buffers go back to.
#[derive(Debug)]
pub(crate) struct Recycle {
    pub(crate) buffers: Arc<Buffers>,
    pub(crate) channel: Channel,
    pub(crate) set: usize,
}

impl Recycle {
    fn give(&self, t: &mut HostTensor) {
        self.buffers.give_output(self.channel, self.set, t.take_data());
    }
}

/// The outputs of a host dispatch; they hold the dispatch buffer set until dropped.
#[derive(Debug)]
pub struct HostDispatchOutput {
    pub(crate) outputs: DispatchOutputs<HostTensor>,
    pub(crate) recycle: Recycle,
    pub(crate) _slot: Option<SlotGuard>,
}

impl HostDispatchOutput {
    /// Received tokens: `[L x R*M x H]` (LL), `[R*M x H]` (LL rank-major) or `[N x H]` (HT);
    /// BF16 or FP8.
    pub fn tokens(&self) -> &HostTensor {
        &self.outputs.tokens
    }

    /// FP8 scales (FP8 dispatch only).
    pub fn scales(&self) -> Option<&HostTensor> {
        self.outputs.scales.as_ref()
    }

    /// Received top-k weights `[N x K]` (HT forward) or `[R*M x K]` (LL rank-major).
    pub fn topk_weights(&self) -> Option<&HostTensor> {
        self.outputs.topk_weights.as_ref()
    }

    /// Received local expert indices, -1 where not local: `[N x K]` int64 (HT forward) or
    /// `[R*M x K]` int32 (LL rank-major).
    pub fn topk_idx(&self) -> Option<&HostTensor> {
        self.outputs.topk_idx.as_ref()
    }

    /// Receive counters: per local expert `[L]` (LL; HT forward), per source rank `[R]` (LL
    /// rank-major).
    pub fn counts(&self) -> Option<&[i32]> {
        self.outputs.counts.as_ref().and_then(HostTensor::as_i32)
    }

    /// All outputs as tensors.
    pub fn outputs(&self) -> &DispatchOutputs<HostTensor> {
        &self.outputs
    }
}

impl Drop for HostDispatchOutput {
    fn drop(&mut self) {
        let o = &mut self.outputs;
        self.recycle.give(&mut o.tokens);
        for t in [&mut o.scales, &mut o.topk_weights, &mut o.topk_idx].into_iter().flatten() {
            self.recycle.give(t);
        }
    }
}

/// The outputs of a host combine; they hold the combine buffer set until dropped.
#[derive(Debug)]
pub struct HostCombineOutput {
    pub(crate) outputs: CombineOutputs<HostTensor>,
    pub(crate) recycle: Recycle,
    pub(crate) _slot: Option<SlotGuard>,
}

impl HostCombineOutput {
    /// Tokens `[B x H]` BF16 in the original order.
    pub fn tokens(&self) -> &HostTensor {
        &self.outputs.tokens
    }

    /// Top-k weight gradients `[B x K]` (HT backward).
    pub fn topk_weights(&self) -> Option<&HostTensor> {
        self.outputs.topk_weights.as_ref()
    }

    /// Rank masking: per token, its top-k entries on masked ranks (they contributed zero),
    /// `[B]` ([`crate::mask`]). `None` in groups without rank masking.
    pub fn masked(&self) -> Option<&[i32]> {
        self.outputs.masked.as_ref().and_then(HostTensor::as_i32)
    }

    /// All outputs as tensors.
    pub fn outputs(&self) -> &CombineOutputs<HostTensor> {
        &self.outputs
    }
}

impl Drop for HostCombineOutput {
    fn drop(&mut self) {
        let o = &mut self.outputs;
        self.recycle.give(&mut o.tokens);
        for t in [&mut o.topk_weights, &mut o.masked].into_iter().flatten() {
            self.recycle.give(t);
        }
    }
}

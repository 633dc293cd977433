//! Host operation outputs. They hold their buffer set until dropped; the large low-latency
//! token buffers are recycled into the set for the next operation that uses it.

use std::sync::{Arc, Mutex};

use half::bf16;
use half::vec::HalfBitsVecExt;

use crate::ops::{CombineOutputs, DispatchOutputs};
use crate::protocol::SlotGuard;
use crate::tensor::{HostData, HostTensor, TensorDesc};

/// Per buffer set, the recycled low-latency token (and scale) buffers of one rank.
#[derive(Debug)]
pub(crate) struct BufferCache {
    sets: Vec<Mutex<(Option<HostData>, Option<HostData>)>>,
}

impl BufferCache {
    pub(crate) fn new(sets: usize) -> Arc<Self> {
        Arc::new(BufferCache { sets: (0..sets).map(|_| Mutex::new((None, None))).collect() })
    }

    /// A buffer for `desc` from set `set`: the recycled one if it fits, else a new zeroed one
    /// (zeroed pages are mapped lazily, so untouched rows cost no memory).
    pub(crate) fn take(&self, set: usize, desc: &TensorDesc, scales: bool) -> HostData {
        let mut slot = self.sets[set].lock().unwrap_or_else(|e| e.into_inner());
        let cached = if scales { slot.1.take() } else { slot.0.take() };
        match cached {
            Some(d) if d.dtype() == desc.dtype && d.len() == desc.numel() => d,
            _ => zeroed(desc),
        }
    }

    fn give_back(&self, set: usize, data: HostData, scales: bool) {
        let mut slot = self.sets[set].lock().unwrap_or_else(|e| e.into_inner());
        if scales {
            slot.1 = Some(data);
        } else {
            slot.0 = Some(data);
        }
    }
}

/// A zero-filled buffer for `desc`, allocated with `calloc` semantics.
pub(crate) fn zeroed(desc: &TensorDesc) -> HostData {
    let n = desc.numel();
    match desc.dtype {
        crate::DType::Bf16 => HostData::Bf16(vec![0u16; n].reinterpret_into::<bf16>()),
        crate::DType::F32 => HostData::F32(vec![0.0; n]),
        crate::DType::I32 => HostData::I32(vec![0; n]),
        crate::DType::I64 => HostData::I64(vec![0; n]),
        crate::DType::Fp8E4m3 => HostData::Fp8(vec![0; n]),
    }
}

/// Where a set's recycled buffers go back to.
#[derive(Debug)]
pub(crate) struct Recycle {
    pub(crate) cache: Arc<BufferCache>,
    pub(crate) set: usize,
}

/// The outputs of a host dispatch; they hold the dispatch buffer set until dropped.
#[derive(Debug)]
pub struct HostDispatchOutput {
    pub(crate) outputs: DispatchOutputs<HostTensor>,
    pub(crate) recycle: Option<Recycle>,
    pub(crate) _slot: Option<SlotGuard>,
}

impl HostDispatchOutput {
    /// Received tokens: `[L x R*M x H]` (LL) or `[N x H]` (HT); BF16 or FP8.
    pub fn tokens(&self) -> &HostTensor {
        &self.outputs.tokens
    }

    /// FP8 scales (FP8 dispatch only).
    pub fn scales(&self) -> Option<&HostTensor> {
        self.outputs.scales.as_ref()
    }

    /// Received top-k weights `[N x K]` (HT forward).
    pub fn topk_weights(&self) -> Option<&HostTensor> {
        self.outputs.topk_weights.as_ref()
    }

    /// Received local expert indices `[N x K]`, -1 where not local (HT forward).
    pub fn topk_idx(&self) -> Option<&HostTensor> {
        self.outputs.topk_idx.as_ref()
    }

    /// Per-local-expert receive counters `[L]` (LL; HT forward).
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
        if let Some(r) = &self.recycle {
            r.cache.give_back(r.set, self.outputs.tokens.take_data(), false);
            if let Some(s) = self.outputs.scales.as_mut() {
                r.cache.give_back(r.set, s.take_data(), true);
            }
        }
    }
}

/// The outputs of a host combine; they hold the combine buffer set until dropped.
#[derive(Debug)]
pub struct HostCombineOutput {
    pub(crate) outputs: CombineOutputs<HostTensor>,
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

    /// All outputs as tensors.
    pub fn outputs(&self) -> &CombineOutputs<HostTensor> {
        &self.outputs
    }
}

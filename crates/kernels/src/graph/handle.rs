//! Handles of captured steps: the routing comes from a `topk_idx` buffer that the caller refills
//! before every replay, and the outputs are fixed buffers the handle owns.

use std::sync::{Arc, Mutex};

use epflow_core::handle::HandleCore;
use epflow_core::ops::{CombineOptions, DispatchOptions, DispatchOutputs, HandleOptions};
use epflow_core::validate::{combine_output_descs, dispatch_output_descs, validate_handle_options};
use epflow_core::{Algorithm, Error, ValidationError};

use crate::device::{DeviceTensor, PinnedBuffer};
use crate::outputs::OutputTargets;
use crate::rank::GpuRank;
pub(crate) use crate::state::handle::GraphHandle;
use crate::state::handle::{GpuHandle, take_pooled};

impl GraphHandle {
    /// Where a dispatch on the handle writes.
    pub(crate) fn dispatch_targets(&self) -> OutputTargets {
        let d = &self.dispatched;
        OutputTargets {
            tokens: d.tokens.ptr(),
            scales: d.scales.as_ref().map(DeviceTensor::ptr),
            topk_weights: d.topk_weights.as_ref().map(DeviceTensor::ptr),
            topk_idx: d.topk_idx.as_ref().map(DeviceTensor::ptr),
            counts: d.counts.as_ref().map(DeviceTensor::ptr),
            masked: None,
        }
    }

    /// The validation error of replay `replay`'s first invalid row (lowest token), if it had
    /// one.
    pub(crate) fn invalid_entry(&self, replay: u64, num_experts: usize) -> Option<ValidationError> {
        crate::state::ll_report::invalid_row_in(&self.report, self.topk.desc().shape[0], replay, num_experts)
    }
}

impl GpuRank {
    /// A low-latency handle for captured steps ([`GpuRank::capture`]): `topk_idx` is a `[B x K]`
    /// int64 buffer on this rank's device that the caller refills before every replay (e.g. the
    /// router's output, itself captured); every replay's dispatch and combine on the handle use
    /// the routing it holds then. The handle owns its outputs: one dispatch's
    /// ([`GpuRank::dispatch_output_descs`] with default options) and one combine's `[B x H]`,
    /// overwritten by every replay.
    ///
    /// Nothing is read from `topk_idx` now: invalid entries are found on the device at each
    /// replay (see [`epflow_core::graph`]). Eager operations refuse the handle. Call it before
    /// the capture (it allocates memory, which a capture forbids).
    pub fn graph_handle(&self, topk_idx: &DeviceTensor, opts: &HandleOptions) -> Result<GpuHandle, Error> {
        self.core.poison().check()?;
        let s = &self.shared;
        if s.config.algorithm != Algorithm::LowLatency {
            return Err(Error::Unsupported("captured steps hold low-latency operations only".into()));
        }
        validate_handle_options(&s.config, opts)?;
        self.check_topk_tensor(topk_idx)?;
        let (b, k) = (topk_idx.desc().shape[0], topk_idx.desc().shape[1]);
        let l = s.layout.ll("a handle of captured steps")?;
        let mem = take_pooled(s, l.handle_bytes())?;
        let core = HandleCore::on_device(s.group_id, b, k, Algorithm::LowLatency, None).with_layout(opts.layout);
        let mut handle = GpuHandle::new(core, mem, &s.handle_pool, None, None, None);
        let ctx = self.core.op_context(&handle);
        let alloc = |d| DeviceTensor::zeros_with(&s.ctx, s.device, d, s.local_allocator.as_ref());
        let d = dispatch_output_descs(&ctx, &DispatchOptions::default());
        let dispatched = DispatchOutputs {
            tokens: alloc(d.tokens)?,
            scales: d.scales.map(alloc).transpose()?,
            topk_weights: d.topk_weights.map(alloc).transpose()?,
            topk_idx: d.topk_idx.map(alloc).transpose()?,
            counts: d.counts.map(alloc).transpose()?,
        };
        let combined = alloc(combine_output_descs(&ctx, &CombineOptions::default()).tokens)?;
        let graph = GraphHandle {
            topk: topk_idx.clone(),
            report: PinnedBuffer::zeroed(&s.ctx, (1 + 2 * b.max(1)) * 8)?,
            dispatched,
            combined,
            step: Mutex::new(None),
        };
        let state = Arc::get_mut(&mut handle.0)
            .ok_or_else(|| Error::Backend("a new handle is shared before it is returned".into()))?;
        state.graph = Some(graph);
        Ok(handle)
    }
}

impl GpuHandle {
    /// A handle of captured steps: the tensors its step's dispatch writes (`None` for other
    /// handles). Fixed buffers, overwritten by every replay.
    pub fn graph_dispatch_outputs(&self) -> Option<&DispatchOutputs<DeviceTensor>> {
        self.graph().map(|g| &g.dispatched)
    }

    /// A handle of captured steps: the tensor its step's combine writes, `[B x H]` BF16.
    pub fn graph_combine_output(&self) -> Option<&DeviceTensor> {
        self.graph().map(|g| &g.combined)
    }
}

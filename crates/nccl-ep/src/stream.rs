//! NVIDIA's low-latency dispatch and combine in the caller's stream order, the way a C++ layer
//! drives NCCL EP: one handle whose routing is replaced in place (`ncclEpInitHandle`, then
//! `ncclEpUpdateHandle` per step), and `ncclEpDispatch` / `ncclEpCombine` with both halves on
//! the caller's stream, into the caller's tensors. Nothing waits on the host. This is what
//! `moe_serving --backend nccl-ep` runs the MoE layer's communication on.
//!
//! NCCL EP 0.1 keeps one low-latency buffer per group and a double-buffer index per handle:
//! operations of two handles in flight at once (two micro-batches on two streams) would use
//! the same half of it. Drive one micro-batch at a time: every dispatch and combine of a
//! handle, in stream order, before another handle's.

use std::sync::{Arc, Mutex, PoisonError};

use cudarc::driver::CudaStream;
use epflow_core::{DType, Error};
use epflow_kernels::DeviceTensor;
use nccl_ep_sys as ep;

use crate::NcclEpRank;
use crate::group::Shared;
use crate::handle::Desc;

/// A low-latency expert-major handle of NVIDIA's library for routings given in a stream's
/// order ([`NcclEpRank::stream_handle`]). Every rank calls its methods in the same order (each
/// may be collective); each enqueues on the stream given and returns.
pub struct NcclEpStreamHandle {
    shared: Arc<Shared>,
    raw: ep::NcclEpHandle,
    top_k: usize,
    /// The routing's descriptor (`[B x K]` int64) and `B`, from the last [`Self::route_on`].
    routing: Mutex<Option<(Box<Desc>, usize)>>,
}

// SAFETY: the raw handle is used by one thread at a time (the methods take the routing lock for
// their whole call); the rest is thread-safe.
unsafe impl Send for NcclEpStreamHandle {}
// SAFETY: as above.
unsafe impl Sync for NcclEpStreamHandle {}

impl std::fmt::Debug for NcclEpStreamHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclEpStreamHandle").field("rank", &self.shared.rank).field("top_k", &self.top_k).finish()
    }
}

impl NcclEpRank {
    /// A low-latency, expert-major handle of top-k `top_k` whose routing is given later, in a
    /// stream's order ([`NcclEpStreamHandle::route_on`]): `ncclEpInitHandle`. Needs a
    /// low-latency group and a library that exports `ncclEpInitHandle` and `ncclEpUpdateHandle`
    /// (NCCL EP 0.1 of NCCL 2.30.7 does).
    pub fn stream_handle(&self, top_k: usize) -> Result<NcclEpStreamHandle, Error> {
        let s = &self.shared;
        if s.config.algorithm != epflow_core::Algorithm::LowLatency {
            return Err(Error::Unsupported("stream-ordered NCCL EP handles are low-latency".into()));
        }
        if top_k == 0 || top_k > s.config.max_top_k {
            return Err(Error::Unsupported(format!(
                "top_k {top_k}: 1 to {} (the group's max_top_k)",
                s.config.max_top_k
            )));
        }
        let init = s.lib.init_handle.ok_or_else(|| {
            Error::Unsupported(format!("{} has no ncclEpInitHandle (NCCL EP 0.1 of NCCL 2.30.7 has)", s.lib.path()))
        })?;
        if s.lib.update_handle.is_none() {
            return Err(Error::Unsupported(format!("{} has no ncclEpUpdateHandle", s.lib.path())));
        }
        s.ctx.bind_to_thread().map_err(|e| crate::group::cuda("bind context", e))?;
        let mut raw: ep::NcclEpHandle = std::ptr::null_mut();
        // SAFETY: valid out pointer, this rank's live group; no handle config, no caller memory
        // (the library allocates the handle's); not collective.
        let rc = unsafe {
            init(&mut raw, s.group, ep::NCCL_EP_LAYOUT_EXPERT_MAJOR, std::ptr::null(), top_k as _, std::ptr::null())
        };
        s.check("ncclEpInitHandle", rc)?;
        Ok(NcclEpStreamHandle { shared: Arc::clone(s), raw, top_k, routing: Mutex::new(None) })
    }
}

impl NcclEpStreamHandle {
    /// Gives the handle the routing `topk_idx` (`[B x K]` int64 on the rank's device, `B` at
    /// most the group's `max_tokens_per_rank`, `K` the handle's top-k), read in `stream`'s
    /// order: `ncclEpUpdateHandle`. NCCL EP reads `topk_idx` again in the dispatches and
    /// combines that follow, so it must stay unchanged until they ran.
    pub fn route_on(&self, topk_idx: &DeviceTensor, stream: &CudaStream) -> Result<(), Error> {
        let s = &self.shared;
        let d = topk_idx.desc();
        if d.dtype != DType::I64 || d.shape.len() != 2 || d.shape[1] != self.top_k || d.shape[0] > s.max_tokens {
            return Err(Error::Unsupported(format!(
                "route_on: int64 [B x {}] with B <= {} expected, got {:?} {:?}",
                self.top_k, s.max_tokens, d.dtype, d.shape
            )));
        }
        let update = s.lib.update_handle.ok_or_else(|| Error::Unsupported("no ncclEpUpdateHandle".into()))?;
        let mut routing = self.routing.lock().unwrap_or_else(PoisonError::into_inner);
        let b = d.shape[0];
        let mut desc = Desc::new(ep::NCCL_INT64, topk_idx.ptr(), &[b, self.top_k]);
        s.ctx.bind_to_thread().map_err(|e| crate::group::cuda("bind context", e))?;
        // SAFETY: this rank's live handle; the descriptor addresses `B x K` int64 of this device
        // (checked above) and lives in the handle until the next update; no layout info (the
        // low-latency contract); enqueued on the caller's live stream.
        let rc = unsafe { update(self.raw, desc.ptr(), std::ptr::null(), stream.cu_stream() as ep::CudaStream) };
        s.check("ncclEpUpdateHandle", rc)?;
        *routing = Some((desc, b));
        Ok(())
    }

    /// The dispatch of `x` (`[B x H]` BF16) on the routing of the last [`Self::route_on`],
    /// both halves enqueued on `stream`: the received rows into `out` (`[L x R*M x H]` BF16)
    /// and the rows per local expert into `counts` (`[L]` int32), NCCL EP's expert-major
    /// layout (an expert's rows in arrival order). Every tensor is ready in `stream`'s order
    /// and must stay allocated until the stream has passed the dispatch.
    pub fn dispatch_on(
        &self,
        x: &DeviceTensor,
        out: &DeviceTensor,
        counts: &DeviceTensor,
        stream: &CudaStream,
    ) -> Result<(), Error> {
        let s = &self.shared;
        let routing = self.routing.lock().unwrap_or_else(PoisonError::into_inner);
        let b =
            routing.as_ref().map(|r| r.1).ok_or_else(|| Error::Unsupported("dispatch_on before route_on".into()))?;
        let (h, l, rows) = (s.config.hidden, s.config.local_experts(s.num_ranks), s.num_ranks * s.max_tokens);
        x.expect_shape("dispatch_on's x", DType::Bf16, &[b, h])?;
        out.expect_shape("dispatch_on's out", DType::Bf16, &[l, rows, h])?;
        counts.expect_shape("dispatch_on's counts", DType::I32, &[l])?;
        let mut xd = Desc::new(ep::NCCL_BFLOAT16, x.ptr(), &[b, h]);
        let mut od = Desc::new(ep::NCCL_BFLOAT16, out.ptr(), &[l, rows, h]);
        let mut cd = Desc::new(ep::NCCL_INT32, counts.ptr(), &[l]);
        let inputs = ep::NcclEpDispatchInputs { tokens: xd.ptr(), ..Default::default() };
        let outputs = ep::NcclEpDispatchOutputs { tokens: od.ptr(), ..Default::default() };
        let info = ep::NcclEpLayoutInfo { expert_counters: cd.ptr(), ..Default::default() };
        let cfg = ep::NcclEpDispatchConfig::default();
        s.ctx.bind_to_thread().map_err(|e| crate::group::cuda("bind context", e))?;
        // SAFETY: this rank's live, routed handle; every descriptor addresses device memory of
        // this rank with the sizes given (checked above), kept by the caller until the stream
        // passed the dispatch; the structs carry their size and magic; enqueued on the caller's
        // live stream (both halves: `send_only` is 0).
        let rc = unsafe { (s.lib.dispatch)(self.raw, &inputs, &outputs, &info, &cfg, stream.cu_stream() as _) };
        s.check("ncclEpDispatch", rc)
    }

    /// The combine of expert outputs `y` (`[L x R*M x H]` BF16, the dispatch's layout) with the
    /// routing weights `weights` (`[B x K]` f32) into `out` (`[B x H]` BF16), both halves
    /// enqueued on `stream`, after this handle's dispatch. As [`Self::dispatch_on`] for the
    /// tensors.
    pub fn combine_on(
        &self,
        y: &DeviceTensor,
        weights: &DeviceTensor,
        out: &DeviceTensor,
        stream: &CudaStream,
    ) -> Result<(), Error> {
        let s = &self.shared;
        let routing = self.routing.lock().unwrap_or_else(PoisonError::into_inner);
        let b = routing.as_ref().map(|r| r.1).ok_or_else(|| Error::Unsupported("combine_on before route_on".into()))?;
        let (h, l, rows, k) =
            (s.config.hidden, s.config.local_experts(s.num_ranks), s.num_ranks * s.max_tokens, self.top_k);
        y.expect_shape("combine_on's y", DType::Bf16, &[l, rows, h])?;
        weights.expect_shape("combine_on's weights", DType::F32, &[b, k])?;
        out.expect_shape("combine_on's out", DType::Bf16, &[b, h])?;
        let mut yd = Desc::new(ep::NCCL_BFLOAT16, y.ptr(), &[l, rows, h]);
        let mut wd = Desc::new(ep::NCCL_FLOAT32, weights.ptr(), &[b, k]);
        let mut od = Desc::new(ep::NCCL_BFLOAT16, out.ptr(), &[b, h]);
        let inputs = ep::NcclEpCombineInputs { tokens: yd.ptr(), ..Default::default() };
        let outputs = ep::NcclEpCombineOutputs { tokens: od.ptr(), topk_weights: wd.ptr(), ..Default::default() };
        let cfg = ep::NcclEpCombineConfig::default();
        s.ctx.bind_to_thread().map_err(|e| crate::group::cuda("bind context", e))?;
        // SAFETY: as in `dispatch_on`, for the combine's descriptors.
        let rc = unsafe { (s.lib.combine)(self.raw, &inputs, &outputs, &cfg, stream.cu_stream() as _) };
        s.check("ncclEpCombine", rc)
    }
}

impl Drop for NcclEpStreamHandle {
    fn drop(&mut self) {
        let s = &self.shared;
        if s.ctx.bind_to_thread().is_ok() {
            // The handle's memory may still be read by work enqueued on the caller's streams:
            // wait for the device before NCCL EP frees it.
            let _ = s.ctx.synchronize();
            // SAFETY: this handle, destroyed once, after every use of it finished.
            let rc = unsafe { (s.lib.handle_destroy)(self.raw) };
            if rc != ep::NCCL_SUCCESS {
                tracing::warn!("NCCL EP: ncclEpHandleDestroy: {}", s.lib.error_string(rc));
            }
        }
    }
}

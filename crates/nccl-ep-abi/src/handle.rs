//! `ncclEpHandle_t`: a layout, a top-k, and the routing epflow built from the caller's
//! `topk_idx` (`ncclEpCreateHandle`, or `ncclEpInitHandle` then `ncclEpUpdateHandle`).
//!
//! epflow keeps a handle's routing in its own device memory: `ncclEpHandleMemSize` reports a
//! small size, and a caller's `handle_mem` is checked but not used. Low-latency over NVLink, as
//! in NCCL EP, the handle keeps the `topk_idx` address (of an int32 `topk_idx`, API v2's, the
//! int64 copy one small kernel widens on the caller's stream): creating or updating it
//! launches nothing else and waits for nothing on the host, and the dispatches on the handle
//! read and check the routing in the stream's order (the first two; a kernel beside the second
//! builds the handle's copy for the rest): keep the memory alive and unchanged while dispatches
//! on the handle may run, and call `ncclEpUpdateHandle` for a new routing. An invalid entry fails those
//! dispatches at their verdicts (the group's error, like a peer's failure) instead of the
//! creation. Otherwise (high-throughput, NCCL peers) the routing is read when the handle is
//! created or updated: the stream is synchronized first and the routing checked at once.

use std::sync::{Arc, Mutex};

use epflow_core::backend::{PendingOp, blocking_handle_on, blocking_handle_with};
use epflow_core::handle::RoutingHandle;
use epflow_core::ops::{HandleOptions, Layout};
use epflow_core::{Algorithm, DType, TensorDesc, TensorTag};
use epflow_kernels::{DeviceTensor, GpuHandle, GpuOp, NumberedSend};
use nccl_ep_sys as ep;

use crate::capture::refuse_capture;
use crate::check::{self, Tensor};
use crate::expert_major::ExpertMajor;
use crate::group::Group;
use crate::ids::Globalize;
use crate::overflow::{Overflow, kept_rows};
use crate::status::{Fail, Res, warn};

/// What `ncclEpHandleMemSize` reports: epflow does not place routing state in caller memory.
pub(crate) const HANDLE_MEM_BYTES: usize = 256;

/// One handle.
pub(crate) struct Handle {
    pub(crate) group: Arc<Group>,
    pub(crate) layout: Layout,
    /// `num_topk` of `ncclEpInitHandle`, or of the routing.
    top_k: Mutex<Option<usize>>,
    gpu: Mutex<Option<GpuHandle>>,
    /// An int32 `topk_idx` (API v2) and its int64 copy in epflow's memory, which the routing
    /// reads until the next `ncclEpUpdateHandle` or the handle's end (calls numbered on the
    /// device re-widen it before each dispatch: [`Handle::rewiden`]).
    widened: Mutex<Option<(DeviceTensor, DeviceTensor)>>,
    /// A `send_only` operation waiting for `ncclEpComplete`.
    pub(crate) staged: Mutex<Option<Staged>>,
    /// High-throughput `NCCL_EP_LAYOUT_EXPERT_MAJOR`: the zones' alignment (`None`: another
    /// layout).
    pub(crate) expert_major_alignment: Option<usize>,
    /// High-throughput expert-major: the zones of the current routing.
    expert_major: Mutex<Option<Arc<ExpertMajor>>>,
    /// High-throughput flat on a DROP group: the buffers of the current routing when it sends
    /// this rank more rows than `max_recv_tokens_per_rank` (`overflow.rs`; `None` otherwise).
    overflow: Mutex<Option<Arc<Overflow>>>,
}

/// A `send_only` dispatch or combine waiting for `ncclEpComplete`, and what follows its receive.
pub(crate) struct Staged {
    /// The operation.
    pub(crate) op: StagedOp,
    /// API v2's GLOBAL ids: rewritten after the receive.
    pub(crate) then: Option<Globalize>,
}

/// A staged operation, numbered on the host or on the device (`capture.rs`).
pub(crate) enum StagedOp {
    /// Numbered on the host: the group counts it in `eager_staged` until it completes.
    Eager(Box<GpuOp>),
    /// Numbered on the device.
    Numbered(Box<NumberedSend>),
}

impl std::fmt::Debug for Handle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Handle").field("layout", &self.layout).finish_non_exhaustive()
    }
}

/// epflow's layout of an NCCL EP layout, for `algorithm`.
pub(crate) fn layout_of(algorithm: Algorithm, layout: ep::NcclEpLayout) -> Res<Layout> {
    match (algorithm, layout) {
        (_, ep::NCCL_EP_LAYOUT_UNSET) => Err(Fail::arg("layout is NCCL_EP_LAYOUT_UNSET")),
        (Algorithm::LowLatency, ep::NCCL_EP_LAYOUT_EXPERT_MAJOR) => Ok(Layout::ExpertMajor),
        (Algorithm::LowLatency, ep::NCCL_EP_LAYOUT_RANK_MAJOR) => Ok(Layout::RankMajor),
        // Expert-major zones are built from the flat layout (`expert_major.rs`).
        (Algorithm::HighThroughput, ep::NCCL_EP_LAYOUT_FLAT | ep::NCCL_EP_LAYOUT_EXPERT_MAJOR) => {
            Ok(Layout::ExpertMajor)
        }
        (Algorithm::LowLatency, ep::NCCL_EP_LAYOUT_FLAT) => Err(Fail::usage(
            "NCCL_EP_LAYOUT_FLAT is a high-throughput layout; low-latency takes EXPERT_MAJOR or RANK_MAJOR",
        )),
        (Algorithm::HighThroughput, ep::NCCL_EP_LAYOUT_RANK_MAJOR) => {
            Err(Fail::usage("NCCL_EP_LAYOUT_RANK_MAJOR is a low-latency layout; high-throughput takes FLAT"))
        }
        (_, l) => Err(Fail::arg(format!("layout {l} is not an ncclEpLayout_t"))),
    }
}

/// Synchronizes the caller's stream (so what it wrote is visible to the host), refusing a
/// stream under CUDA graph capture.
pub(crate) fn sync_stream(stream: ep::CudaStream, what: &str) -> Res<()> {
    refuse_capture(stream, what)?;
    // SAFETY: the caller's live stream (or null, the legacy default stream).
    let rc = unsafe { cudarc::driver::sys::cuStreamSynchronize(stream as cudarc::driver::sys::CUstream) };
    rc.result().map_err(|e| Fail::from(epflow_core::Error::Backend(format!("CUDA: synchronize the stream: {e:?}"))))
}

/// Writes `values` into the caller's counter tensor `t` (int32 or int64, at least as many
/// elements), synchronously.
fn write_counts(t: &Tensor, values: &[i64], what: &str) -> Res<()> {
    if t.numel() < values.len() {
        return Err(Fail::arg(format!("{what}: {} elements, {} needed", t.numel(), values.len())));
    }
    let bytes: Vec<u8> = match t.datatype {
        ep::NCCL_INT32 => values.iter().flat_map(|&v| (v as i32).to_ne_bytes()).collect(),
        ep::NCCL_INT64 => values.iter().flat_map(|&v| v.to_ne_bytes()).collect(),
        _ => return Err(Fail::arg(format!("{what}: must be ncclInt32 or ncclInt64"))),
    };
    // SAFETY: `t.ptr` is the caller's device memory of at least `bytes.len()` bytes (checked
    // element count and type); a synchronous copy from a live host buffer.
    let rc = unsafe { cudarc::driver::sys::cuMemcpyHtoD_v2(t.ptr, bytes.as_ptr() as *const _, bytes.len()) };
    rc.result().map_err(|e| Fail::from(epflow_core::Error::Backend(format!("CUDA: write {what}: {e:?}"))))
}

impl Handle {
    /// A handle of `layout` with no routing yet (`ncclEpInitHandle`); `expert_major_alignment`:
    /// high-throughput expert-major, with its zones' alignment ([`crate::expert_major::alignment_of`]).
    /// Refuses high-throughput expert-major handles on a group whose `overflow_policy` is DROP
    /// (`overflow.rs` drops flat rows only).
    pub(crate) fn new(
        group: Arc<Group>,
        layout: Layout,
        top_k: Option<usize>,
        expert_major_alignment: Option<usize>,
    ) -> Res<Self> {
        if expert_major_alignment.is_some() && group.shape.drop_overflow {
            return Err(Fail::usage(
                "a high-throughput NCCL_EP_LAYOUT_EXPERT_MAJOR handle on a group with overflow_policy NCCL_EP_OVERFLOW_DROP is not implemented by epflow's NCCL EP library (use NCCL_EP_LAYOUT_FLAT, or overflow_policy AUTO or TRAP)",
            ));
        }
        Ok(Handle {
            group,
            layout,
            top_k: Mutex::new(top_k),
            gpu: Mutex::new(None),
            widened: Mutex::new(None),
            staged: Mutex::new(None),
            expert_major_alignment,
            expert_major: Mutex::new(None),
            overflow: Mutex::new(None),
        })
    }

    /// The handle's top-k: `ncclEpInitHandle`'s `num_topk`, or its routing's (`None` before
    /// either).
    pub(crate) fn top_k(&self) -> Option<usize> {
        *self.top_k.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// High-throughput flat on a DROP group: the current routing's overflow buffers, when it
    /// sends this rank more rows than the group's receive budget.
    pub(crate) fn overflow(&self) -> Option<Arc<Overflow>> {
        self.overflow.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// The rows this rank's outputs hold for the current routing: high-throughput, the rows
    /// received (expert-major: the zones' slots), after a drop the rows kept; low-latency, the
    /// rows of its receive buffers (`R x max_dispatch_tokens_per_rank`).
    pub(crate) fn output_rows(&self) -> Res<usize> {
        let s = &self.group.shape;
        if s.algorithm == Algorithm::LowLatency {
            return Ok(s.num_ranks * s.max_tokens);
        }
        if let Some(em) = self.expert_major()? {
            return Ok(em.plan.total);
        }
        if let Some(o) = self.overflow() {
            return Ok(o.kept);
        }
        Ok(self.gpu()?.num_recv_tokens().unwrap_or(0))
    }

    /// High-throughput expert-major: the current routing's zones (`ncclInvalidUsage` before
    /// `ncclEpUpdateHandle`); `None` for every other layout.
    pub(crate) fn expert_major(&self) -> Res<Option<Arc<ExpertMajor>>> {
        if self.expert_major_alignment.is_none() {
            return Ok(None);
        }
        let em = self.expert_major.lock().unwrap_or_else(|e| e.into_inner()).clone();
        em.map(Some).ok_or_else(|| Fail::usage("the handle has no routing yet: call ncclEpUpdateHandle first"))
    }

    /// The routing, or `ncclInvalidUsage` before `ncclEpUpdateHandle`.
    pub(crate) fn gpu(&self) -> Res<GpuHandle> {
        self.gpu
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
            .ok_or_else(|| Fail::usage("the handle has no routing yet: call ncclEpUpdateHandle first"))
    }

    /// `ncclEpUpdateHandle` (and the second half of `ncclEpCreateHandle`): builds the routing
    /// from `topk_idx` (`[B x K]`, int64, or int32 as NCCL EP API v2 allows, widened into
    /// epflow's memory on the caller's stream); high-throughput: collective (the count
    /// exchange), and fills the counters asked for in `info`.
    ///
    /// # Safety
    ///
    /// `topk_idx` and `info` are null or readable, as the C API requires; `stream` is the
    /// caller's live stream.
    pub(crate) unsafe fn update(
        &self,
        topk_idx: *const ep::NcclEpTensor,
        info: *const ep::NcclEpLayoutInfo,
        stream: ep::CudaStream,
    ) -> Res<()> {
        let g = &self.group;
        g.check()?;
        // SAFETY: forwarded contract.
        let t = unsafe { check::required_tensor(topk_idx, "topk_idx") }?;
        // SAFETY: forwarded contract.
        let info = unsafe { check::api_struct(info, "layout_info") }?;
        // `recv_topk_idx_kind` is read by the dispatch (as NCCL EP does), not here.
        let info = info.map(|i| i.check_v2_fields().map(|_| i.v1)).transpose()?;
        let int32 = match t.datatype {
            ep::NCCL_INT64 => false,
            ep::NCCL_INT32 => true,
            d => return Err(Fail::arg(format!("topk_idx: datatype {d}, expected ncclInt64 (or ncclInt32, API v2)"))),
        };
        if t.sizes.len() != 2 {
            return Err(Fail::arg(format!("topk_idx: sizes are {:?}, expected [num_tokens, top_k]", t.sizes)));
        }
        let (b, k) = (t.sizes[0], t.sizes[1]);
        g.shape.check_top_k(k)?;
        if b > g.shape.max_tokens {
            return Err(Fail::usage(format!(
                "topk_idx has {b} tokens, more than max_dispatch_tokens_per_rank ({})",
                g.shape.max_tokens
            )));
        }
        if let Some(want) = *self.top_k.lock().unwrap_or_else(|e| e.into_inner()) {
            if want != k {
                return Err(Fail::usage(format!("topk_idx has top_k {k}, the handle was initialised with {want}")));
            }
        }
        let ll = g.shape.algorithm == Algorithm::LowLatency;
        if ll {
            refuse_capture(stream, "ncclEpUpdateHandle")?;
        } else {
            sync_stream(stream, "ncclEpUpdateHandle")?;
        }
        // Settle earlier operations: a new routing replaces the handle's.
        g.settle(true)?;
        let dtype = if int32 { DType::I32 } else { DType::I64 };
        let desc = TensorDesc::contiguous(TensorTag::TopkIdx, dtype, &[b, k]);
        // SAFETY: the caller's device tensor of [b, k] int64 or int32 (checked), read here or,
        // low-latency, by the dispatches on the handle in the caller's stream's order (the C
        // API's contract keeps it alive and unchanged while the handle uses it).
        let dev = unsafe { DeviceTensor::from_raw(t.ptr, g.rank.device(), desc) };
        // int32: an int64 copy in epflow's memory, widened in the caller's stream order (no host
        // wait), kept by the handle while its routing may be read.
        let dev = if int32 {
            // SAFETY: the caller's live stream of this rank's device (the C API's contract).
            let on = unsafe { g.stream(stream) };
            let wide = g.rank.widen_i32_on(&on, &dev)?;
            *self.widened.lock().unwrap_or_else(|e| e.into_inner()) = Some((dev, wide.clone()));
            wide
        } else {
            *self.widened.lock().unwrap_or_else(|e| e.into_inner()) = None;
            dev
        };
        let opts = HandleOptions::with_layout(self.layout);
        let h = if ll {
            // SAFETY: the caller's live stream of this rank's device (the C API's contract).
            let on = unsafe { g.stream(stream) };
            // `topk_idx` is ready after the caller's work so far: the dispatches are ordered after
            // it anyway; a handle built on the host (NCCL peers) waits for this event.
            let ready = on.record_event(None).map_err(|e| {
                Fail::from(epflow_core::Error::Backend(format!("CUDA: record topk_idx's event: {e:?}")))
            })?;
            let dev = dev.ready_after(Arc::new(ready));
            blocking_handle_on(&g.rank, &dev, &opts, &on)?.0
        } else {
            blocking_handle_with(&g.rank, &dev, &opts)?
        };
        // High-throughput: the routing's own buffers (overflow rows, expert-major zones), kept
        // beside it only once every counter was written: a failure leaves the old routing and
        // its buffers together.
        let mut buffers = None;
        if g.shape.algorithm == Algorithm::HighThroughput {
            let raw = h.recv_expert_counts().unwrap_or_default();
            let n = h.num_recv_tokens().unwrap_or(0);
            let overflow = match kept_rows(n, g.shape.max_recv, g.shape.drop_overflow) {
                Some(kept) => {
                    warn(&format!(
                        "rank {}: this routing sends it {n} rows, more than max_recv_tokens_per_rank ({kept}): rows {kept}..{n} are dropped (overflow_policy NCCL_EP_OVERFLOW_DROP)",
                        g.shape.rank
                    ));
                    Some(Arc::new(Overflow::new(&g.rank, n, kept, k, g.shape.hidden)?))
                }
                None => None,
            };
            let mut zones = None;
            // Flat: the rows per local expert and `N`; expert-major: the padded zones, their
            // first slots and the slots in all (NCCL EP's meaning of the same counters).
            let (counts, offsets, total) = match self.expert_major_alignment {
                Some(a) => {
                    if raw.len() != g.shape.local_experts {
                        return Err(Fail::from(epflow_core::Error::Backend(format!(
                            "expert-major handle: {} per-expert counts for {} local experts",
                            raw.len(),
                            g.shape.local_experts
                        ))));
                    }
                    let em = ExpertMajor::new(&g.rank, raw, n, k, g.shape.hidden, a)?;
                    let p = (em.plan.padded.clone(), Some(em.plan.offsets.clone()), em.plan.total as i64);
                    zones = Some(Arc::new(em));
                    p
                }
                None => (raw.iter().map(|&c| i64::from(c)).collect(), None, n as i64),
            };
            if let Some(info) = info {
                // SAFETY: forwarded contract (the info's tensors are readable descriptors).
                if let Some(c) = unsafe { check::tensor(info.expert_counters, "layout_info.expert_counters") }? {
                    write_counts(&c, &counts, "layout_info.expert_counters")?;
                }
                if let Some(offsets) = &offsets {
                    // SAFETY: as above.
                    if let Some(c) = unsafe { check::tensor(info.expert_offsets, "layout_info.expert_offsets") }? {
                        write_counts(&c, offsets, "layout_info.expert_offsets")?;
                    }
                }
                // SAFETY: as above.
                if let Some(c) = unsafe { check::tensor(info.recv_total_counter, "layout_info.recv_total_counter") }? {
                    write_counts(&c, &[total], "layout_info.recv_total_counter")?;
                }
            }
            buffers = Some((overflow, zones));
        }
        if let Some((overflow, zones)) = buffers {
            *self.overflow.lock().unwrap_or_else(|e| e.into_inner()) = overflow;
            *self.expert_major.lock().unwrap_or_else(|e| e.into_inner()) = zones;
        }
        *self.top_k.lock().unwrap_or_else(|e| e.into_inner()) = Some(k);
        *self.gpu.lock().unwrap_or_else(|e| e.into_inner()) = Some(h);
        Ok(())
    }

    /// Calls numbered on the device: the int32 `topk_idx`'s int64 copy widened again on
    /// `stream` (captured, it runs at every replay, before the dispatch that reads it).
    pub(crate) fn rewiden(&self, stream: &cudarc::driver::CudaStream) -> Res<()> {
        if let Some((src, wide)) = &*self.widened.lock().unwrap_or_else(|e| e.into_inner()) {
            self.group.rank.widen_i32_into_on(stream, src, wide)?;
        }
        Ok(())
    }

    /// `ncclEpHandleDestroy`: completes a staged operation left behind (on the rank's stream, or
    /// for one numbered on the device on the legacy default stream), and lets the group read
    /// the verdicts.
    pub(crate) fn destroy(&self) -> Res<()> {
        let staged = self.staged.lock().unwrap_or_else(|e| e.into_inner()).take();
        let g = &self.group;
        match staged.map(|s| s.op) {
            Some(StagedOp::Eager(op)) => {
                let mut op = *op;
                crate::status::warn(
                    "ncclEpHandleDestroy: a send-only operation was never completed; completing it now",
                );
                g.eager_staged.fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
                op.start_complete()?;
                g.track(op);
            }
            Some(StagedOp::Numbered(send)) => {
                crate::status::warn(
                    "ncclEpHandleDestroy: a send-only operation was never completed; completing it now on the legacy default stream",
                );
                if let Ok(dn) = &g.numbering {
                    // SAFETY: null is the legacy default stream, always valid.
                    let st = unsafe { g.stream(std::ptr::null_mut()) };
                    g.rank.numbered_complete(dn, &send, &st)?;
                }
            }
            None => {}
        }
        g.settle(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layouts_map_per_algorithm() {
        use Algorithm::{HighThroughput as Ht, LowLatency as Ll};
        assert_eq!(layout_of(Ll, ep::NCCL_EP_LAYOUT_EXPERT_MAJOR), Ok(Layout::ExpertMajor));
        assert_eq!(layout_of(Ll, ep::NCCL_EP_LAYOUT_RANK_MAJOR), Ok(Layout::RankMajor));
        assert_eq!(layout_of(Ht, ep::NCCL_EP_LAYOUT_FLAT), Ok(Layout::ExpertMajor));
        assert_eq!(layout_of(Ht, ep::NCCL_EP_LAYOUT_EXPERT_MAJOR), Ok(Layout::ExpertMajor));
        let code = |a, l| layout_of(a, l).unwrap_err().code;
        assert_eq!(code(Ll, ep::NCCL_EP_LAYOUT_UNSET), ep::NCCL_INVALID_ARGUMENT);
        assert_eq!(code(Ll, 9), ep::NCCL_INVALID_ARGUMENT);
        assert_eq!(code(Ll, ep::NCCL_EP_LAYOUT_FLAT), ep::NCCL_INVALID_USAGE);
        assert_eq!(code(Ht, ep::NCCL_EP_LAYOUT_RANK_MAJOR), ep::NCCL_INVALID_USAGE);
    }
}

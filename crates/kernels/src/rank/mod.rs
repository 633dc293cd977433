//! [`GpuRank`]: one rank of a GPU group, and its [`Backend`] implementation: validation, then
//! the low-latency ([`crate::ll`]) or high-throughput ([`crate::ht`]) start of each operation.
//!
//! - `mask`: rank masking ([`epflow_core::mask`]): the host's view, `mask_ranks`, `unmask_all`.
//! - `rejoin`: a new process in place of a masked rank ([`GpuRank::admit`], [`GpuWorld::rejoin`]).
//! - `expert_major`: NCCL EP's high-throughput expert-major layout over the flat one
//!   ([`ExpertMajorPlan`]).

mod copy_probe;
mod expert_major;
pub use copy_probe::{BulkStages, CopyRange};
pub use expert_major::ExpertMajorPlan;
mod launch_cost;
pub use launch_cost::LaunchCost;
mod mask;
mod meet;
mod rejoin;

use std::sync::Arc;
use std::sync::atomic::Ordering;

use cudarc::driver::{CudaContext, CudaStream};
use epflow_core::backend::{Backend, HandleCreation, PendingOp, RankCore, detach};
use epflow_core::handle::{HandleCore, RoutingHandle};
use epflow_core::mask::{MaskedRanks, RankSet};
use epflow_core::ops::{
    CombineInputs, CombineOptions, DispatchInputs, DispatchOptions, HandleOptions, Layout, Pass, RecvRows,
};
use epflow_core::ops::{CombineOutputs, DispatchOutputs};
use epflow_core::protocol::{Channel, op_label};
use epflow_core::routing::{CombinePositions, ExpertPlacement, Routing, compacted_slots};
use epflow_core::validate::{
    check_topk_idx, combine_output_descs, dispatch_output_descs, recv_bound, routing_from_values,
    validate_combine_inputs, validate_dispatch_inputs, validate_handle_options,
};
use epflow_core::{Algorithm, Error, TensorDesc};

use crate::device::host_steps::Steps;
use crate::device::{DeviceTensor, bind, copy_to_host, cuda};
use crate::op::GpuOp;
use crate::outputs::OutputTargets;
use crate::params::{LL_COMPACT_MAX_ROWS, MAX_RANKS};
use crate::state::handle::{GpuHandle, LlNcclInfo, take_pooled};
use crate::state::shared::RankShared;
use crate::{ht, ll};

/// One rank of a GPU group. Every operation is collective: all ranks call it, in the same
/// order. Operations of one channel are sent in call order; dispatch and combine run on two
/// streams of their own ([`GpuRank::stream`]).
#[derive(Debug)]
pub struct GpuRank {
    pub(crate) shared: Arc<RankShared>,
    pub(crate) core: RankCore,
}

/// The launch of a `util.cu` kernel: `blocks` blocks of 256 threads, the block those kernels
/// are written for (each caller sizes the grid for its work).
fn util_launch(blocks: u32) -> cudarc::driver::LaunchConfig {
    cudarc::driver::LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 }
}
impl GpuRank {
    /// Connects this rank's NCCL communicators to every peer (collective; nothing without NCCL).
    pub(crate) fn connect_nccl(&self) -> Result<(), Error> {
        let s = &self.shared;
        match &s.nccl {
            // Pairs connect as they are made.
            Some(n) if n.pairs.is_none() => n.comms.connect(&s.ctx, &s.streams[0], s.rank, s.num_ranks),
            _ => Ok(()),
        }
    }

    /// Under rank masking, the NCCL peers each channel reaches now (dispatch, combine, handle;
    /// bit `r` = rank `r`): every NCCL peer at creation and after a rejoin, less those whose
    /// pair an operation revoked when they died (`transport/nccl_pairs.rs`). `None` without
    /// NCCL peers or without rank masking.
    pub fn nccl_reachable(&self) -> Option<[u32; 3]> {
        let pairs = self.shared.nccl.as_ref()?.pairs.as_ref()?;
        Some([0, 1, 2].map(|c| pairs.reachable(c)))
    }

    /// Which peers this rank reaches through NCCL (bit `r` = rank `r`; 0 = NVLink only).
    pub fn nccl_peers(&self) -> u32 {
        self.shared.nccl.as_ref().map_or(0, |n| n.mask)
    }

    /// The device this rank runs on.
    pub fn device(&self) -> usize {
        self.shared.device
    }

    /// The CUDA context of the device.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.shared.ctx
    }

    /// Where this rank's local scratch comes from ([`crate::GpuWorld::join_over_with_allocator`]);
    /// `None`: `cuMemAlloc`. [`GpuRank::local_zeros`] allocates from it.
    pub fn local_allocator(&self) -> Option<&Arc<dyn crate::device::LocalAllocator>> {
        self.shared.local_allocator.as_ref()
    }

    /// A zero-filled tensor of `desc` on this rank's device, in its local scratch memory
    /// ([`GpuRank::local_allocator`]): scratch of your own that belongs with the rank's (the
    /// NCCL EP C API's expert-major and overflow buffers).
    pub fn local_zeros(&self, desc: TensorDesc) -> Result<DeviceTensor, Error> {
        DeviceTensor::zeros_with(&self.shared.ctx, self.shared.device, desc, self.local_allocator())
    }

    /// The stream operations of `channel` run on: order your producers and consumers against it
    /// (or pass inputs with [`DeviceTensor::ready_after`]).
    pub fn stream(&self, channel: Channel) -> &Arc<CudaStream> {
        &self.shared.streams[channel.index()]
    }

    /// Device bytes the group holds on this rank.
    pub fn device_memory_bytes(&self) -> usize {
        self.shared.layout.total_bytes()
    }

    /// Device bytes each low-latency handle of this group holds on this rank (its `topk_idx`
    /// copy, send slots, row and return maps; fixed by the config). High-throughput handles are
    /// sized by their token counts when they are made: 0 here.
    pub fn handle_memory_bytes(&self) -> usize {
        match &self.shared.layout {
            crate::layout::BufferLayout::Ll(l) => l.handle_bytes(),
            crate::layout::BufferLayout::Ht(_) => 0,
        }
    }

    /// Records CUDA events around every operation, for [`GpuDispatchOutput::elapsed`](crate::GpuDispatchOutput::elapsed) (host-observed
    /// device time from before the send half to after the complete half).
    pub fn set_timing(&self, on: bool) {
        self.shared.timing.store(on, Ordering::Relaxed);
    }

    /// Overwrites every output buffer of every set with `byte` (a debugging aid: filled outputs
    /// show rows an operation failed to write). Waits for this rank's streams first.
    /// High-throughput groups allocate outputs per operation: from now on each is filled with
    /// `byte` before its kernel runs.
    pub fn fill_output_buffers(&self, byte: u8) -> Result<(), Error> {
        let s = &self.shared;
        s.output_fill.store(1 + u32::from(byte), Ordering::Relaxed);
        bind(&s.ctx)?;
        for st in &s.streams {
            st.synchronize().map_err(|e| cuda("synchronize", e))?;
        }
        let m = &s.mem;
        for b in m.disp_out.iter().chain(&m.disp_scales).chain(&m.disp_counts).chain(&m.disp_topk).chain(&m.comb_out) {
            // SAFETY: fills the whole allocation of a live buffer of this context; no kernel uses
            // it (the streams are idle).
            unsafe { cudarc::driver::sys::cuMemsetD8_v2(b.ptr(), byte, b.bytes()) }
                .result()
                .map_err(|e| cuda("fill", e))?;
        }
        Ok(())
    }

    /// Copies `src` into `dst` (same size) on the stream of `channel`, without a host wait;
    /// returns an event after the copy. Use `dst.ready_after(event)` as the input of a later
    /// operation: its send half waits for the copy on the device.
    #[deprecated(since = "0.1.0", note = "no caller needs it: use `copy_on(rank.stream(channel), src, dst)`")]
    pub fn copy_on_stream(
        &self,
        channel: Channel,
        src: &DeviceTensor,
        dst: &DeviceTensor,
    ) -> Result<Arc<cudarc::driver::CudaEvent>, Error> {
        self.copy_on(self.stream(channel), src, dst)
    }

    /// Copies `src` into `dst` (same size) on `stream` (of this rank's context), after both
    /// tensors' ready events, without a host wait; returns an event after the copy. If `src` is
    /// an epflow output, `stream` becomes one of its consumers (its buffer set is released in
    /// `stream`'s order).
    pub fn copy_on(
        &self,
        stream: &Arc<CudaStream>,
        src: &DeviceTensor,
        dst: &DeviceTensor,
    ) -> Result<Arc<cudarc::driver::CudaEvent>, Error> {
        if src.desc().size_bytes() != dst.desc().size_bytes() {
            return Err(Error::Unsupported(format!(
                "copy of {} B into {} B",
                src.desc().size_bytes(),
                dst.desc().size_bytes()
            )));
        }
        self.read_on(stream, src, Some(dst))?;
        // SAFETY: both are device ranges of `size_bytes` in this context (checked sizes); the
        // copy is ordered on `stream`, and `src` is kept from reuse until it passed.
        unsafe {
            cudarc::driver::sys::cuMemcpyDtoDAsync_v2(dst.ptr(), src.ptr(), src.desc().size_bytes(), stream.cu_stream())
        }
        .result()
        .map_err(|e| cuda("copy", e))?;
        self.event_on(stream)
    }

    /// Before work on `stream` that reads `src` (and writes `also`): binds this rank's context,
    /// orders `stream` after both tensors' ready events, and makes `stream` a consumer of `src`
    /// (an epflow output's buffer set is released in `stream`'s order).
    fn read_on(&self, stream: &Arc<CudaStream>, src: &DeviceTensor, also: Option<&DeviceTensor>) -> Result<(), Error> {
        bind(&self.shared.ctx)?;
        for e in [src.ready_event(), also.and_then(DeviceTensor::ready_event)].into_iter().flatten() {
            stream.wait(e).map_err(|e| cuda("wait for tensor", e))?;
        }
        src.record_stream(stream);
        Ok(())
    }

    /// A new event recorded on `stream` (of this rank's context) after the work enqueued so far.
    fn event_on(&self, stream: &CudaStream) -> Result<Arc<cudarc::driver::CudaEvent>, Error> {
        let ev = self.shared.ctx.new_event(None).map_err(|e| cuda("create event", e))?;
        ev.record(stream).map_err(|e| cuda("record event", e))?;
        Ok(Arc::new(ev))
    }

    /// An int64 copy of `src` (int32, any shape, on this rank's device), sign-extended (`-1`
    /// stays `-1`), widened on `stream` (of this rank's context) after `src`'s ready event, with
    /// no host wait: the result is ready after an event on `stream`. For int32 `topk_idx`
    /// (NCCL EP API v2's low-latency routing) where epflow's handles take int64.
    pub fn widen_i32_on(&self, stream: &Arc<CudaStream>, src: &DeviceTensor) -> Result<DeviceTensor, Error> {
        self.check_device(src, "widen_i32_on's input")?;
        if src.desc().dtype != epflow_core::DType::I32 {
            return Err(Error::Unsupported(format!("widen_i32_on takes int32, got {:?}", src.desc().dtype)));
        }
        let mut desc = src.desc().clone();
        desc.dtype = epflow_core::DType::I64;
        let out = self.local_zeros(desc)?;
        self.read_on(stream, src, None)?;
        self.launch_widen(stream, src, &out)?;
        Ok(out.ready_after(self.event_on(stream)?))
    }

    /// [`GpuRank::widen_i32_on`] into `dst` (int64, as many elements as `src`), with no
    /// allocation, event or wait: one kernel on `stream`, which may be capturing (operations
    /// numbered on the device re-widen a handle's int32 routing at every run).
    pub fn widen_i32_into_on(&self, stream: &CudaStream, src: &DeviceTensor, dst: &DeviceTensor) -> Result<(), Error> {
        self.check_device(src, "widen_i32_into_on's input")?;
        self.check_device(dst, "widen_i32_into_on's output")?;
        let (s, d) = (src.desc(), dst.desc());
        if s.dtype != epflow_core::DType::I32 || d.dtype != epflow_core::DType::I64 || s.numel() != d.numel() {
            return Err(Error::Unsupported(format!(
                "widen_i32_into_on takes int32 into int64 of as many elements, got {:?} {:?} into {:?} {:?}",
                s.dtype, s.shape, d.dtype, d.shape
            )));
        }
        bind(&self.shared.ctx)?;
        self.launch_widen(stream, src, dst)
    }

    /// `ep_widen_i32` from `src` (int32) into `out` (int64 of as many elements) on `stream`.
    fn launch_widen(&self, stream: &CudaStream, src: &DeviceTensor, out: &DeviceTensor) -> Result<(), Error> {
        let s = &self.shared;
        let n = src.desc().numel();
        if n > 0 {
            let blocks = n.div_ceil(256).clamp(1, s.num_sms as usize * 4) as u32;
            let cfg = util_launch(blocks);
            let (ip, op, nn) = (src.ptr(), out.ptr(), n as u64);
            use cudarc::driver::PushKernelArg;
            // SAFETY: the arguments match `ep_widen_i32(u64, u64, u64)`; `src` holds `n` int32
            // values and `out` `n` int64s (both checked by the callers, on this rank's device);
            // the kernel is ordered on `stream` after `src`'s producers, which keeps `src` from
            // reuse until it passed.
            unsafe { stream.launch_builder(&s.functions.widen_i32).arg(&ip).arg(&op).arg(&nn).launch(cfg) }
                .map_err(|e| cuda("launch widen", e))?;
        }
        Ok(())
    }

    /// Turns received local expert ids into global ones in place, on `stream` (of this rank's
    /// context) after `idx`'s ready event: every id `>= 0` of `idx` (`[rows x K]` int32 or int64,
    /// on this rank's device) gains `offset`, `-1` stays. With `counts` (`[S]` int32 and the rows
    /// per source, `S x rows_per_source = rows`), only the first `counts[s]` rows of source `s`'s
    /// block are changed (the others hold no token). For NCCL EP API v2's `recv_topk_idx_kind`
    /// GLOBAL, where the offset is this rank times its local experts.
    pub fn globalize_expert_ids_on(
        &self,
        stream: &Arc<CudaStream>,
        idx: &DeviceTensor,
        counts: Option<(&DeviceTensor, usize)>,
        offset: i64,
    ) -> Result<(), Error> {
        self.check_device(idx, "globalize_expert_ids_on's ids")?;
        let desc = idx.desc();
        let wide = match desc.dtype {
            epflow_core::DType::I32 => 0i32,
            epflow_core::DType::I64 => 1,
            d => {
                return Err(Error::Unsupported(format!("globalize_expert_ids_on takes int32 or int64 ids, got {d:?}")));
            }
        };
        let (rows, k) = match desc.shape[..] {
            [rows, k] => (rows, k),
            _ => {
                return Err(Error::Unsupported(format!(
                    "globalize_expert_ids_on takes [rows x K] ids, got {:?}",
                    desc.shape
                )));
            }
        };
        let (counts_ptr, per_source) = match counts {
            Some((c, per)) => {
                self.check_device(c, "globalize_expert_ids_on's counts")?;
                let sources = c.desc().numel();
                if c.desc().dtype != epflow_core::DType::I32 || per == 0 || sources * per != rows {
                    return Err(Error::Unsupported(format!(
                        "globalize_expert_ids_on: counts {:?} {:?} with {per} rows per source do not cover {rows} rows",
                        c.desc().dtype,
                        c.desc().shape
                    )));
                }
                (c.ptr(), per as u64)
            }
            None => (0, 1),
        };
        self.read_on(stream, idx, counts.map(|(c, _)| c))?;
        let n = rows * k;
        if n == 0 {
            return Ok(());
        }
        let blocks = n.div_ceil(256).clamp(1, self.shared.num_sms as usize * 4) as u32;
        let cfg = util_launch(blocks);
        let (ip, r, kk) = (idx.ptr(), rows as u64, k as i32);
        use cudarc::driver::PushKernelArg;
        // SAFETY: the arguments match `ep_globalize_expert_ids(u64, int, u64, int, u64, u64, long
        // long)`; `idx` holds `rows x k` values of the width `wide` names (its descriptor), and
        // `counts`, when given, `rows / per_source` int32s (checked above), both on this rank's
        // device; the kernel is ordered on `stream` after their producers.
        unsafe {
            stream
                .launch_builder(&self.shared.functions.globalize_ids)
                .arg(&ip)
                .arg(&wide)
                .arg(&r)
                .arg(&kk)
                .arg(&counts_ptr)
                .arg(&per_source)
                .arg(&offset)
                .launch(cfg)
        }
        .map_err(|e| cuda("launch globalize_expert_ids", e))?;
        Ok(())
    }

    /// Enqueues a one-thread kernel that holds `stream` for `delay` (a deliberately slow
    /// consumer, for tests and demonstrations of stream-ordered release).
    pub fn delay_on(&self, stream: &CudaStream, delay: std::time::Duration) -> Result<(), Error> {
        let s = &self.shared;
        bind(&s.ctx)?;
        let ns = delay.as_nanos().min(u128::from(u64::MAX)) as u64;
        let cfg = cudarc::driver::LaunchConfig { grid_dim: (1, 1, 1), block_dim: (1, 1, 1), shared_mem_bytes: 0 };
        let mut launch = stream.launch_builder(&s.functions.spin);
        cudarc::driver::PushKernelArg::arg(&mut launch, &ns);
        // SAFETY: `ep_spin` takes one u64 by value and touches no memory.
        unsafe { launch.launch(cfg) }.map_err(|e| cuda("launch spin", e))?;
        Ok(())
    }

    /// Copies a host tensor to this rank's device.
    pub fn upload(&self, t: &epflow_core::HostTensor) -> Result<DeviceTensor, Error> {
        DeviceTensor::upload(&self.shared.ctx, self.shared.device, t)
    }

    /// Dequantizes FP8 rows (`[rows x H]` + scales `[rows x H/128]`) into a new BF16 tensor
    /// (allocated here; see [`GpuRank::dequantize_fp8_into`] for a buffer kept across calls).
    pub fn dequantize_fp8(&self, q: &DeviceTensor, scales: &DeviceTensor) -> Result<DeviceTensor, Error> {
        let mut desc = q.desc().clone();
        desc.dtype = epflow_core::DType::Bf16;
        let out = DeviceTensor::zeros(&self.shared.ctx, self.shared.device, desc)?;
        self.dequantize_fp8_into(q, scales, &out)?;
        Ok(out)
    }

    /// Dequantizes FP8 rows (`[rows x H]` + scales `[rows x H/128]`) into `out`, a BF16 tensor of
    /// `q`'s shape on this rank's device, on the dispatch channel's stream; returns when done.
    /// The caller makes sure that no queued work still reads `out`. Errors: `out` of another
    /// shape, type or device; CUDA failures.
    pub fn dequantize_fp8_into(
        &self,
        q: &DeviceTensor,
        scales: &DeviceTensor,
        out: &DeviceTensor,
    ) -> Result<(), Error> {
        self.check_device(out, "dequantize output")?;
        if out.desc().dtype != epflow_core::DType::Bf16 || out.desc().shape != q.desc().shape {
            return Err(Error::Unsupported(format!(
                "dequantize_fp8_into: the output must be BF16 of shape {:?}, got {:?} {:?}",
                q.desc().shape,
                out.desc().dtype,
                out.desc().shape
            )));
        }
        let rows: usize = q.desc().shape[..q.desc().shape.len() - 1].iter().product();
        let h = self.shared.config.hidden;
        let stream = &self.shared.streams[0];
        let (qp, sp, op, r, hh) = (q.ptr(), scales.ptr(), out.ptr(), rows as u64, h as i32);
        let blocks = (self.shared.num_sms * 4).max(1);
        let cfg = util_launch(blocks);
        use cudarc::driver::PushKernelArg;
        // SAFETY: the arguments match `ep_dequant_fp8_rows(u64, u64, u64, u64, int)`; the three
        // buffers hold rows x H bytes, rows x H/128 floats and rows x H BF16 values (`out` was
        // checked to have `q`'s shape).
        unsafe {
            stream
                .launch_builder(&self.shared.functions.dequant_fp8)
                .arg(&qp)
                .arg(&sp)
                .arg(&op)
                .arg(&r)
                .arg(&hh)
                .launch(cfg)
        }
        .map_err(|e| cuda("launch dequantize", e))?;
        stream.synchronize().map_err(|e| cuda("dequantize", e))
    }

    /// Refuses a host-numbered low-latency operation (or step replay) once the rank numbers on
    /// the device ([`GpuRank::start_device_numbering`]).
    pub(crate) fn refuse_if_numbered(&self) -> Result<(), Error> {
        if self.shared.numbered.load(std::sync::atomic::Ordering::Acquire) {
            return Err(Error::Unsupported(
                "this rank numbers its low-latency operations on the device (GpuRank::start_device_numbering): use the numbered_* operations".into(),
            ));
        }
        Ok(())
    }

    pub(crate) fn check_device(&self, t: &DeviceTensor, what: &str) -> Result<(), Error> {
        if t.device() != self.shared.device {
            return Err(Error::Unsupported(format!(
                "{what} is on device {}, this rank runs on device {}",
                t.device(),
                self.shared.device
            )));
        }
        Ok(())
    }

    /// Takes the next sequence number of `channel` and runs `start` with it. If `start` fails
    /// (validation, a foreign handle, a failed allocation) the collective still goes ahead on
    /// this rank as a cancellation, in the background, so the peers fail at once with
    /// [`Error::PeerCancelled`] instead of waiting for their timeout. `handle` is the
    /// operation's handle (the cancellation uses it when it is this group's).
    fn collective(
        &self,
        channel: Channel,
        handle: Option<&GpuHandle>,
        pass: Pass,
        start: impl FnOnce(u64) -> Result<GpuOp, Error>,
    ) -> Result<GpuOp, Error> {
        self.core.poison().check()?;
        self.refuse_if_numbered()?;
        self.check_not_masked(channel)?;
        let seq = self.core.next_seq(channel);
        let result = start(seq);
        if result.is_err() {
            let own = handle.filter(|h| h.core().group_id() == self.core.group_id());
            match self.cancellation(channel, seq, own, pass) {
                Some(op) => detach(op, self.core.config().timeout, Arc::clone(self.core.poison())),
                None => tracing::warn!(
                    "{} #{seq} failed on rank {} before it was sent and cannot be cancelled without a usable handle: its peers will time out",
                    channel,
                    self.core.rank()
                ),
            }
        }
        result
    }

    /// A cancellation of collective `seq` of `channel`, if one can be built.
    fn cancellation(&self, channel: Channel, seq: u64, handle: Option<&GpuHandle>, pass: Pass) -> Option<GpuOp> {
        let s = &self.shared;
        match (s.config.algorithm, channel) {
            (Algorithm::LowLatency, _) => ll::start::cancellation(s, channel, seq, handle),
            (Algorithm::HighThroughput, Channel::Handle) => {
                let routing = Routing::new(Vec::new(), 0, 1, s.config.num_experts).ok()?;
                let mut op = ht::start::handle(s, seq, routing, None).ok()?;
                op.cancel();
                Some(op)
            }
            (Algorithm::HighThroughput, Channel::Dispatch) => {
                ht::start::dispatch(s, seq, handle?, None, &DispatchOptions { pass, ..Default::default() }, None).ok()
            }
            (Algorithm::HighThroughput, Channel::Combine) => {
                ht::start::combine(s, seq, handle?, None, &CombineOptions { pass, ..Default::default() }, None).ok()
            }
        }
    }

    /// Checks `topk_idx`'s device, its descriptor and its `K` (not its values).
    pub(crate) fn check_topk_tensor(&self, topk_idx: &DeviceTensor) -> Result<(), Error> {
        self.check_device(topk_idx, "topk_idx")?;
        let (_, top_k) = check_topk_idx(&self.shared.config, topk_idx)?;
        Routing::check_top_k(top_k, self.shared.config.num_experts)?;
        Ok(())
    }

    /// Copies `topk_idx` to the host (after its ready event) and validates it. `steps` times
    /// the wait, the copy and the validation (`EPFLOW_HOST_STEPS`).
    fn routing_of(&self, topk_idx: &DeviceTensor, steps: &mut Steps) -> Result<Routing, Error> {
        let s = &self.shared;
        // The descriptor first (nothing is read from a tensor that fails it), then the values.
        self.check_topk_tensor(topk_idx)?;
        let d = topk_idx.desc();
        if let Some(e) = topk_idx.ready_event() {
            e.synchronize().map_err(|e| cuda("wait for topk_idx", e))?;
        }
        steps.step("handle: checks, wait for topk_idx");
        let mut values = vec![0i64; d.numel()];
        copy_to_host(&s.ctx, topk_idx.ptr(), &mut values)?;
        steps.step("handle: copy topk_idx to the host");
        let routing = routing_from_values(&s.config, d, values)?;
        steps.step("handle: validate the routing");
        Ok(routing)
    }

    /// A low-latency handle built on the device (`ll::handle`): the options and `topk_idx`'s
    /// descriptor checked here, its values on the device; awaited ([`ll::handle::build`]) or,
    /// with `on`, in that stream's order ([`ll::handle::build_on`]). `EPFLOW_HOST_STEPS` times
    /// the checks and the steps of the build.
    fn ll_device_handle(
        &self,
        topk_idx: &DeviceTensor,
        opts: &HandleOptions,
        on: Option<&Arc<CudaStream>>,
    ) -> Result<GpuHandle, Error> {
        let s = &self.shared;
        let mut steps = Steps::start();
        validate_handle_options(&s.config, opts)?;
        self.check_topk_tensor(topk_idx)?;
        if on.is_some_and(|stream| stream.context().cu_ctx() != s.ctx.cu_ctx()) {
            return Err(Error::Unsupported(format!(
                "create_handle_on: the stream belongs to another context than this rank's (device {})",
                s.device
            )));
        }
        steps.step("handle: checks");
        match on {
            None => ll::handle::build(s, topk_idx, opts.layout, &mut steps),
            Some(stream) => ll::handle::build_on(s, topk_idx, opts.layout, stream, &mut steps),
        }
    }

    /// A low-latency handle built on the host (NCCL peers, or `EPFLOW_LL_HANDLE=host`; else
    /// [`ll::handle::build`] builds it on the device): the routing's copy in device memory, for
    /// NCCL peers where their combine rows land, and for a rank-major handle the slot of each
    /// dispatch message (compacted per destination; not for groups whose `max_tokens` exceeds
    /// `LL_COMPACT_MAX_ROWS`), written with the routing's copy in one host-to-device copy.
    /// `steps` times the buffer, the slots, the copy and the rest (`EPFLOW_HOST_STEPS`).
    fn ll_handle(&self, routing: Routing, layout: Layout, steps: &mut Steps) -> Result<GpuHandle, Error> {
        let s = &self.shared;
        let l = s.layout.ll("a low-latency handle")?;
        let mem = take_pooled(s, l.handle_bytes())?;
        steps.step("handle: take the handle's memory");
        let placement = ExpertPlacement::new(s.config.num_experts, s.num_ranks);
        let mut send_rows = None;
        if layout == Layout::RankMajor && l.max_tokens <= LL_COMPACT_MAX_ROWS {
            let (slots, counts) = compacted_slots(&routing, placement, l.max_tokens);
            let head = l.handle_head(routing.indices(), &slots);
            steps.step("handle: rank-major send slots");
            mem.write(0, &head)?;
            let mut rows = [0i32; MAX_RANKS];
            for (r, &c) in rows.iter_mut().zip(&counts) {
                *r = c as i32;
            }
            send_rows = Some(rows);
        } else {
            mem.write(0, routing.indices())?;
        }
        steps.step("handle: copy to the device");
        let ll_nccl = match &s.nccl {
            Some(n) => {
                let positions = CombinePositions::new(&routing, placement, n.mask, layout);
                mem.write(l.nccl_pos_offset(), &positions.pos)?;
                Some(LlNcclInfo {
                    recv_blocks: positions.blocks,
                    send_rows: std::sync::Mutex::new(vec![0; s.num_ranks]),
                })
            }
            None => None,
        };
        let core = HandleCore::new(s.group_id, routing, Algorithm::LowLatency, None).with_layout(layout);
        let handle = GpuHandle::new(core, mem, &s.handle_pool, None, ll_nccl, send_rows);
        steps.step("handle: NCCL positions, the handle");
        Ok(handle)
    }
}

impl Backend for GpuRank {
    type Stream = Arc<cudarc::driver::CudaStream>;
    type Tensor = DeviceTensor;
    type Handle = GpuHandle;
    type DispatchOutput = crate::outputs::GpuDispatchOutput;
    type CombineOutput = crate::outputs::GpuCombineOutput;
    type Op = GpuOp;

    fn core(&self) -> &RankCore {
        &self.core
    }

    fn masked_ranks(&self) -> MaskedRanks {
        self.mask_view()
    }

    fn mask_ranks(&self, ranks: &RankSet) -> Result<(), Error> {
        self.mask_ranks_now(ranks)
    }

    fn unmask_all(&self) -> Result<(), Error> {
        self.unmask_all_now()
    }

    /// Over a meeting from the rank's [`crate::setup::meeting::MeetingSource`]
    /// ([`GpuRank::set_meeting_source`]).
    fn admit(&self, ranks: &RankSet, timeout: std::time::Duration) -> Result<(), Error> {
        self.admit_from_source(ranks, timeout)
    }

    /// A GPU replacement is a new rank: it joins with [`crate::GpuWorld::rejoin`], which returns it.
    fn rejoin(&self, timeout: std::time::Duration) -> Result<(), Error> {
        let _ = timeout;
        Err(Error::Unsupported(
            "rejoin: a GPU replacement joins with GpuWorld::rejoin(meeting, config), which returns its rank".into(),
        ))
    }

    /// Low-latency over NVLink: the handle at once, its dispatches ordered after `stream`'s work
    /// so far and reading `topk_idx` themselves (`ll::handle::build_on`); otherwise
    /// [`Backend::start_handle`].
    fn start_handle_on(
        &self,
        topk_idx: &DeviceTensor,
        opts: &HandleOptions,
        stream: &Arc<CudaStream>,
    ) -> Result<HandleCreation<GpuHandle, GpuOp>, Error> {
        let s = &self.shared;
        if s.config.algorithm != Algorithm::LowLatency || !ll::handle::builds_on_device(s) {
            return self.start_handle(topk_idx, opts);
        }
        self.core.poison().check()?;
        Ok(HandleCreation::Ready(self.ll_device_handle(topk_idx, opts, Some(stream))?))
    }

    fn start_handle(
        &self,
        topk_idx: &DeviceTensor,
        opts: &HandleOptions,
    ) -> Result<HandleCreation<GpuHandle, GpuOp>, Error> {
        self.core.poison().check()?;
        match self.shared.config.algorithm {
            Algorithm::LowLatency => {
                if ll::handle::builds_on_device(&self.shared) {
                    return Ok(HandleCreation::Ready(self.ll_device_handle(topk_idx, opts, None)?));
                }
                let mut steps = Steps::start();
                validate_handle_options(&self.shared.config, opts)?;
                let routing = self.routing_of(topk_idx, &mut steps)?;
                Ok(HandleCreation::Ready(self.ll_handle(routing, opts.layout, &mut steps)?))
            }
            Algorithm::HighThroughput => {
                let op = self.collective(Channel::Handle, None, Pass::Forward, |seq| {
                    validate_handle_options(&self.shared.config, opts)?;
                    let bound = (opts.recv_rows == RecvRows::Bound)
                        .then(|| recv_bound(&self.shared.config, self.shared.num_ranks));
                    if ht::device::builds_on_device(&self.shared) {
                        // The descriptor here; the values on the device, which cancels the
                        // exchange (and fails this creation) if one is invalid.
                        let mut steps = Steps::start();
                        self.check_topk_tensor(topk_idx)?;
                        let op = ht::device::start(&self.shared, seq, topk_idx, bound);
                        steps.step("handle: high-throughput checks, memory, parameters");
                        return op;
                    }
                    // Not timed: the `handle: ...` steps are the low-latency handle's.
                    let routing = self.routing_of(topk_idx, &mut Steps::inert())?;
                    ht::start::handle(&self.shared, seq, routing, bound)
                })?;
                Ok(HandleCreation::Collective(op))
            }
        }
    }

    fn start_dispatch(
        &self,
        h: &GpuHandle,
        inputs: DispatchInputs<'_, DeviceTensor>,
        opts: &DispatchOptions,
    ) -> Result<GpuOp, Error> {
        self.dispatch_op(h, inputs, opts, None)
    }

    fn start_combine(
        &self,
        h: &GpuHandle,
        inputs: CombineInputs<'_, DeviceTensor>,
        opts: &CombineOptions,
    ) -> Result<GpuOp, Error> {
        self.combine_op(h, inputs, opts, None)
    }
}

/// Operations whose outputs go to caller-owned memory ([`OutputTargets`]).
impl GpuRank {
    /// The outputs a dispatch on `h` with `opts` produces: their shapes and types (what
    /// [`GpuRank::start_dispatch_into`]'s targets must hold).
    pub fn dispatch_output_descs(&self, h: &GpuHandle, opts: &DispatchOptions) -> DispatchOutputs<TensorDesc> {
        dispatch_output_descs(&self.core.op_context(h), opts)
    }

    /// The outputs a combine on `h` with `opts` produces.
    pub fn combine_output_descs(&self, h: &GpuHandle, opts: &CombineOptions) -> CombineOutputs<TensorDesc> {
        combine_output_descs(&self.core.op_context(h), opts)
    }

    /// [`Backend::start_dispatch`] writing the outputs into `into` instead of epflow's memory
    /// (the returned outputs are views of it). Drive the operation as any other (its send half,
    /// then its completion, e.g. [`epflow_core::backend::send_blocking`] and
    /// [`PendingOp::complete_on`]); [`GpuOp::send_on`] moves the send half to the caller's
    /// stream.
    ///
    /// # Safety
    ///
    /// Every address of `into` must be device memory of this rank's device that holds the
    /// tensor [`GpuRank::dispatch_output_descs`] describes for it (high-throughput: at least
    /// that many rows of that length), and stay valid, unread and unwritten by anyone else until
    /// the operation has completed on the device.
    pub unsafe fn start_dispatch_into(
        &self,
        h: &GpuHandle,
        inputs: DispatchInputs<'_, DeviceTensor>,
        opts: &DispatchOptions,
        into: &OutputTargets,
    ) -> Result<GpuOp, Error> {
        self.dispatch_op(h, inputs, opts, Some(into))
    }

    /// [`Backend::start_combine`] writing the outputs into `into` (see
    /// [`GpuRank::start_dispatch_into`]).
    ///
    /// # Safety
    ///
    /// As [`GpuRank::start_dispatch_into`], with [`GpuRank::combine_output_descs`].
    pub unsafe fn start_combine_into(
        &self,
        h: &GpuHandle,
        inputs: CombineInputs<'_, DeviceTensor>,
        opts: &CombineOptions,
        into: &OutputTargets,
    ) -> Result<GpuOp, Error> {
        self.combine_op(h, inputs, opts, Some(into))
    }

    fn dispatch_op(
        &self,
        h: &GpuHandle,
        inputs: DispatchInputs<'_, DeviceTensor>,
        opts: &DispatchOptions,
        into: Option<&OutputTargets>,
    ) -> Result<GpuOp, Error> {
        self.collective(Channel::Dispatch, Some(h), opts.pass, |seq| {
            self.core.check_handle(h)?;
            refuse_graph_handle(h)?;
            let valid = validate_dispatch_inputs(&self.core.op_context(h), opts, &inputs)?;
            for t in valid.tensors() {
                self.check_device(t, "a dispatch input")?;
            }
            self.core.note_dispatch_epoch(h.core());
            match self.shared.config.algorithm {
                Algorithm::LowLatency => ll::start::dispatch(&self.shared, seq, h, valid, opts, into),
                Algorithm::HighThroughput => ht::start::dispatch(&self.shared, seq, h, Some(valid), opts, into),
            }
        })
    }

    fn combine_op(
        &self,
        h: &GpuHandle,
        inputs: CombineInputs<'_, DeviceTensor>,
        opts: &CombineOptions,
        into: Option<&OutputTargets>,
    ) -> Result<GpuOp, Error> {
        self.collective(Channel::Combine, Some(h), opts.pass, |seq| {
            self.core.check_handle(h)?;
            refuse_graph_handle(h)?;
            let valid = validate_combine_inputs(&self.core.op_context(h), opts, &inputs)?;
            let paired = h.core().combine_dispatch(opts.pass)?;
            self.core.check_mask_epoch(h.core(), || op_label(Channel::Combine, seq))?;
            for t in valid.tensors() {
                self.check_device(t, "a combine input")?;
            }
            match self.shared.config.algorithm {
                Algorithm::LowLatency => ll::start::combine(&self.shared, seq, h, paired, valid, into),
                Algorithm::HighThroughput => ht::start::combine(&self.shared, seq, h, Some(valid), opts, into),
            }
        })
    }
}

/// Eager operations refuse handles of captured steps (their routing is the step's, refilled by
/// its replays).
fn refuse_graph_handle(h: &GpuHandle) -> Result<(), Error> {
    if h.is_graph_handle() {
        return Err(Error::Unsupported(
            "this handle belongs to captured steps (GpuRank::graph_handle): only their replays use it".into(),
        ));
    }
    Ok(())
}

//! [`GpuOp`]: one GPU operation as a [`PendingOp`]. Low-latency: the send half is one kernel
//! launch, the complete half another. High-throughput dispatch and combine, and the count
//! exchange of handle creation, are one launch each (the send half), whose end is the
//! completion. A CUDA event after the last launch is the completion signal.

use std::any::Any;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use cudarc::driver::{CudaEvent, LaunchConfig, PushKernelArg, sys};
use epflow_core::backend::{OpOutput, PendingOp, Probe};
use epflow_core::ops::{CombineOutputs, CountsLocation, DispatchOptions, DispatchOutputs, Pass};
use epflow_core::protocol::{Channel, SlotGuard, op_label};
use epflow_core::routing::Routing;
use epflow_core::{DType, Error, TensorDesc, TensorTag};

use crate::cache::CachedBuffer;
use crate::driver::{bind, cuda};
use crate::ht::{ExchangeBuffers, HtPlan, finish_handle, ht_grid, received_messages, recycle_exchange};
use crate::nccl::{Xfer, issue};
use crate::outputs::{GpuCombineOutput, GpuDispatchOutput};
use crate::params::{ExchangeParams, HtParams, LlParams, MAX_SETS, NcclHtParams};
use crate::rank::{GpuHandle, RankShared};
use crate::tensor::DeviceTensor;

/// A high-throughput dispatch's output tensors and, when asked for, its counters on the host.
pub(crate) type HtDispatchOutputs = (DispatchOutputs<DeviceTensor>, Option<Vec<i32>>);

/// The kernel parameters of an operation.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Launch {
    /// Low-latency: send and complete kernels.
    Ll(LlParams),
    /// High-throughput dispatch or combine: one kernel.
    Ht(HtParams),
    /// The count exchange of a high-throughput handle: one kernel.
    Exchange(ExchangeParams),
    /// High-throughput dispatch or combine over NCCL: pack (dispatch) or arrival word, the
    /// group, the arrival check, and for combine the reduction.
    NcclHt { p: NcclHtParams, reduce: bool },
    /// The count exchange over NCCL: messages up, the group, what arrived down.
    NcclExchange { row_bytes: usize },
}

/// What the operation is.
#[derive(Debug)]
pub(crate) enum Work {
    Dispatch { handle: GpuHandle, opts: DispatchOptions },
    Combine { handle: GpuHandle },
    HtHandle { routing: Routing, plan: HtPlan, bufs: Option<ExchangeBuffers> },
    HtDispatch { handle: GpuHandle, pass: Pass, outputs: Option<Box<HtDispatchOutputs>> },
    HtCombine { outputs: Option<CombineOutputs<DeviceTensor>> },
}

/// The output of a GPU operation.
pub type GpuOpOutput = OpOutput<GpuHandle, GpuDispatchOutput, GpuCombineOutput>;

/// One operation of one GPU rank.
pub struct GpuOp {
    shared: Arc<RankShared>,
    channel: Channel,
    seq: u64,
    launch: Launch,
    /// High-throughput outputs to fill with the poison byte before the kernel, if one is set.
    fill: Option<(u64, usize)>,
    work: Option<Work>,
    waits: Vec<Arc<CudaEvent>>,
    _keep: Vec<Arc<dyn Any + Send + Sync>>,
    sent: bool,
    cancelled: bool,
    completing: bool,
    slot: Option<SlotGuard>,
    done: Option<Arc<CudaEvent>>,
    timing: Option<(CudaEvent, CudaEvent, CudaEvent)>,
    /// NCCL exchange issued after the send kernel (low-latency with NCCL peers) or as the
    /// operation (high-throughput over NCCL).
    xfers: Vec<Xfer>,
    /// Staging the NCCL exchange reads or writes, kept until the operation is dropped (even when
    /// cancelled: the peers still exchange with it).
    scratch: Vec<CachedBuffer>,
}

impl std::fmt::Debug for GpuOp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuOp")
            .field("op", &self.label())
            .field("sent", &self.sent)
            .field("completing", &self.completing)
            .finish()
    }
}

/// Threads per block of the send kernels and the dispatch receive kernel.
const BLOCK_THREADS: u32 = 512;

impl GpuOp {
    pub(crate) fn new(
        shared: Arc<RankShared>,
        channel: Channel,
        seq: u64,
        launch: Launch,
        work: Work,
        inputs: &[&DeviceTensor],
    ) -> Self {
        GpuOp {
            shared,
            channel,
            seq,
            launch,
            fill: None,
            work: Some(work),
            waits: inputs.iter().filter_map(|t| t.ready_event().cloned()).collect(),
            _keep: inputs.iter().filter_map(|t| t.keep_alive()).collect(),
            sent: false,
            cancelled: false,
            completing: false,
            slot: None,
            done: None,
            timing: None,
            xfers: Vec::new(),
            scratch: Vec::new(),
        }
    }

    /// The NCCL exchange of this operation (see [`crate::nccl`]).
    pub(crate) fn set_xfers(&mut self, xfers: Vec<Xfer>) {
        self.xfers = xfers;
    }

    /// Keeps `buf` alive as long as the operation.
    pub(crate) fn keep_scratch(&mut self, buf: CachedBuffer) {
        self.scratch.push(buf);
    }

    fn uses_nccl(&self) -> bool {
        !self.xfers.is_empty()
    }

    /// Enqueues this operation's NCCL group on its stream.
    fn issue_xfers(&self) -> Result<(), Error> {
        let s = &self.shared;
        let n = s.nccl.as_ref().ok_or_else(|| Error::Backend("an NCCL exchange without NCCL".into()))?;
        issue(n.comms.comm(self.chan())?, &s.streams[self.chan()], &self.xfers)
    }

    fn chan(&self) -> usize {
        self.channel.index()
    }

    /// Marks `(ptr, bytes)` as this operation's outputs, filled with the rank's poison byte (if
    /// [`crate::GpuRank::fill_output_buffers`] set one) before the kernel runs.
    pub(crate) fn set_fill(&mut self, fill: (u64, usize)) {
        self.fill = Some(fill);
    }

    /// The buffer set whose cancellation word the kernels write.
    fn set(&self) -> usize {
        match &self.launch {
            Launch::Ll(p) => p.set as usize,
            Launch::Ht(_) | Launch::Exchange(_) | Launch::NcclHt { .. } | Launch::NcclExchange { .. } => {
                (self.seq % 2) as usize
            }
        }
    }

    /// Launches the one kernel of a high-throughput operation or count exchange.
    fn launch_single(&self) -> Result<(), Error> {
        let s = &self.shared;
        let stream = &s.streams[self.chan()];
        let cancelled = i32::from(self.cancelled);
        if let (Some((ptr, bytes)), false) = (self.fill, self.cancelled) {
            let byte = s.poison_outputs.load(Ordering::Relaxed);
            if byte != 0 {
                // SAFETY: `ptr` is the start of this operation's output buffer of at least
                // `bytes` bytes, alive as long as the operation; ordered on its stream.
                unsafe { sys::cuMemsetD8Async(ptr, (byte - 1) as u8, bytes, stream.cu_stream()) }
                    .result()
                    .map_err(|e| cuda("fill outputs", e))?;
            }
        }
        match self.launch {
            Launch::Ht(mut p) => {
                p.cancelled = cancelled;
                let f = if p.chan == 0 { &s.kernels.ht_dispatch } else { &s.kernels.ht_combine };
                let (grid, block) = ht_grid(&p);
                let cfg = LaunchConfig { grid_dim: (grid, 1, 1), block_dim: (block, 1, 1), shared_mem_bytes: 0 };
                // SAFETY: the kernel takes one `HtParams` by value, mirrored in params.rs; its
                // pointers address the group's rings and signal pages, the handle's arrays, the
                // outputs and the inputs, all kept alive by this operation.
                unsafe { stream.launch_builder(f).arg(&p).launch(cfg) }.map_err(|e| cuda("launch ht kernel", e))?;
            }
            Launch::Exchange(mut p) => {
                p.cancelled = cancelled;
                let cfg = LaunchConfig { grid_dim: (1, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
                // SAFETY: the kernel takes one `ExchangeParams` by value, mirrored in params.rs; its
                // pointers address the group's exchange regions and signal pages and this
                // operation's staging buffers.
                unsafe { stream.launch_builder(&s.kernels.ht_exchange).arg(&p).launch(cfg) }
                    .map_err(|e| cuda("launch count exchange", e))?;
            }
            Launch::NcclHt { mut p, reduce } => {
                p.cancelled = cancelled;
                let one = |f: &cudarc::driver::CudaFunction, grid: u32, block: u32, what: &str| {
                    let cfg = LaunchConfig { grid_dim: (grid, 1, 1), block_dim: (block, 1, 1), shared_mem_bytes: 0 };
                    // SAFETY: every kernel of nccl.cu takes one `NcclHtParams` by value, mirrored in
                    // params.rs; its pointers address the handle's arrays, the inputs, the outputs
                    // and the staging, all kept alive by this operation.
                    unsafe { stream.launch_builder(f).arg(&p).launch(cfg) }.map_err(|e| cuda(what, e))
                };
                let rows = (p.total_send.max(0) as u32).div_ceil(16);
                one(&s.kernels.nccl_ht_pack, rows.clamp(1, 2 * s.num_sms), 512, "launch NCCL pack")?;
                self.issue_xfers()?;
                one(&s.kernels.nccl_arrivals, 1, 32, "launch NCCL arrival check")?;
                if reduce && !self.cancelled {
                    let grid = (p.num_tokens.max(1) as u32).min(4 * s.num_sms);
                    one(&s.kernels.nccl_ht_reduce, grid, 256, "launch NCCL reduce")?;
                }
            }
            Launch::NcclExchange { row_bytes } => self.exchange_over_nccl(row_bytes)?,
            Launch::Ll(_) => return Err(Error::Backend("a low-latency operation has two launches".into())),
        }
        Ok(())
    }

    /// The count exchange over NCCL: this rank's messages (with the operation number, written
    /// at creation, and the cancellation flag) go to the device, every peer's row out, every peer's row in, and what
    /// arrived back to the host.
    fn exchange_over_nccl(&self, row_bytes: usize) -> Result<(), Error> {
        let s = &self.shared;
        let n = s.nccl.as_ref().ok_or_else(|| Error::Backend("an NCCL exchange without NCCL".into()))?;
        let Some(Work::HtHandle { bufs: Some(bufs), .. }) = &self.work else {
            return Err(Error::Backend("a count exchange without buffers".into()));
        };
        if self.cancelled {
            let words = row_bytes / 4;
            for d in 0..s.num_ranks {
                bufs.msgs.write_i32_at(d * words + words - 1, 1);
            }
        }
        let bytes = s.num_ranks * row_bytes;
        let stream = &s.streams[self.chan()];
        // SAFETY: both ranges hold `bytes` bytes (the pinned messages are mapped, so their device
        // address is valid for a copy); ordered on the handle stream.
        unsafe { sys::cuMemcpyAsync(n.handle_msgs.ptr(), bufs.msgs.device_ptr(), bytes, stream.cu_stream()) }
            .result()
            .map_err(|e| cuda("copy exchange messages", e))?;
        let xfers: Vec<Xfer> = (0..s.num_ranks)
            .map(|d| {
                let off = (d * row_bytes) as u64;
                Xfer {
                    peer: d,
                    send: (n.handle_msgs.ptr() + off, row_bytes),
                    recv: (n.handle_out.ptr() + off, row_bytes),
                }
            })
            .collect();
        issue(n.comms.comm(self.chan())?, stream, &xfers)?;
        // SAFETY: as above, into the mapped pinned buffer of what arrived.
        unsafe { sys::cuMemcpyAsync(bufs.out.device_ptr(), n.handle_out.ptr(), bytes, stream.cu_stream()) }
            .result()
            .map_err(|e| cuda("copy exchanged counts", e))
    }

    fn launch(&self, which: Kernel) -> Result<(), Error> {
        let s = &self.shared;
        let Launch::Ll(mut p) = self.launch else {
            return Err(Error::Backend("not a low-latency operation".into()));
        };
        p.cancelled = i32::from(self.cancelled);
        let sms = s.config.max_sms.map_or(s.num_sms, |m| (m as u32).min(s.num_sms)).max(1);
        let (b, r, k, m, h) =
            (p.num_tokens.max(1) as u32, p.num_ranks as u32, p.top_k as u32, p.max_tokens as u32, p.hidden as usize);
        // About 16 warps per SM when the work allows: enough bytes in flight for NVLink.
        let target_warps = sms * 16;
        let (f, grid, block) = match which {
            Kernel::DispatchSend => {
                p.chunks = row_chunks(h, target_warps / (b * r).max(1)) as i32;
                (&s.kernels.dispatch_send, (b * r * p.chunks as u32).div_ceil(16).clamp(1, sms), BLOCK_THREADS)
            }
            Kernel::DispatchRecv => {
                let payload = if p.fp8 != 0 { h } else { 2 * h };
                p.chunks = if payload % 64 == 0 { 4 } else { 1 };
                p.splits = (sms as i32 / p.num_local).clamp(1, 4);
                (&s.kernels.dispatch_recv, ((p.num_local * p.splits) as u32).min(sms), BLOCK_THREADS)
            }
            Kernel::CombineSend => {
                p.chunks = row_chunks(h, target_warps / (b * k).max(1)) as i32;
                let items = r * m * k * p.chunks as u32;
                (&s.kernels.combine_send, items.div_ceil(4 * 16).clamp(1, sms), BLOCK_THREADS)
            }
            Kernel::CombineRecv => {
                p.chunks = if h % 32 == 0 { 4 } else { 1 };
                let c = p.chunks as u32;
                (&s.kernels.combine_recv, (b.min((2 * sms / c).max(1)) * c).min((sms / c).max(1) * c), 256)
            }
        };
        let cfg = LaunchConfig { grid_dim: (grid, 1, 1), block_dim: (block, 1, 1), shared_mem_bytes: 0 };
        let stream = &s.streams[self.chan()];
        // SAFETY: every kernel takes one `LlParams` by value, mirrored byte for byte in params.rs;
        // its pointers address memory this operation keeps alive (the group's buffers, the
        // handle, and the inputs in `_keep`).
        unsafe { stream.launch_builder(f).arg(&p).launch(cfg) }.map_err(|e| cuda(&format!("launch {which:?}"), e))?;
        Ok(())
    }

    /// The first error the device reported on this rank, as an [`Error`].
    fn device_error(&self) -> Option<Error> {
        let w = self.shared.mem.status.read_u64(0);
        if w == 0 {
            return None;
        }
        let (code, peer, seq) = (w & 0xff, (w >> 8) & 0xff, w >> 16);
        let waiting_for = match code {
            1 => format!("data from rank {peer} (operation #{seq} of the channel)"),
            2 => format!(
                "buffer credits from rank {peer} (it has not consumed operation #{} of the channel)",
                seq.saturating_sub(self.shared.config.buffer_sets as u64)
            ),
            3 => format!("ring space at rank {peer} (it stopped receiving operation #{seq} of the channel)"),
            _ => format!("device error code {code}"),
        };
        Some(Error::Timeout {
            op: self.label(),
            rank: self.shared.rank,
            waiting_for,
            after: self.shared.config.timeout,
        })
    }

    /// (send half, complete half) device times; high-throughput operations are one launch, timed
    /// as the send half.
    fn elapsed(&self) -> Option<(Duration, Duration)> {
        let (a, m, b) = self.timing.as_ref()?;
        let d =
            |x: &CudaEvent, y: &CudaEvent| x.elapsed_ms(y).ok().map(|ms| Duration::from_secs_f64(f64::from(ms) / 1e3));
        if !matches!(self.launch, Launch::Ll(_)) {
            // One launch: all of it is the send half (nothing runs between `m` and `b`).
            return Some((d(a, m)?, Duration::ZERO));
        }
        Some((d(a, m)?, d(m, b)?))
    }

    fn view(&self, ptr: u64, desc: TensorDesc) -> DeviceTensor {
        DeviceTensor::view(ptr, self.shared.device, desc, self.shared.clone() as Arc<dyn Any + Send + Sync>)
    }

    fn finish_dispatch(&mut self, handle: &GpuHandle, opts: DispatchOptions) -> Result<GpuDispatchOutput, Error> {
        let s = &self.shared;
        let l = s.layout.ll("low-latency dispatch")?;
        let set = self.set();
        let rows = l.rows_per_expert();
        let dtype = if l.fp8 { DType::Fp8E4m3 } else { DType::Bf16 };
        let tokens = self.view(
            s.mem.disp_out[set].ptr(),
            TensorDesc::contiguous(TensorTag::Tokens, dtype, &[l.local_experts, rows, l.hidden]),
        );
        let scales = l.fp8.then(|| {
            self.view(
                s.mem.disp_scales[set].ptr(),
                TensorDesc::contiguous(TensorTag::Scales, DType::F32, &[l.local_experts, rows, l.hidden / 128]),
            )
        });
        let counts = self.view(
            s.mem.disp_counts[set].ptr(),
            TensorDesc::contiguous(TensorTag::RecvExpertCountsDevice, DType::I32, &[l.local_experts]),
        );
        let host_counts =
            (opts.counts_location == CountsLocation::Host).then(|| s.mem.host_counts[set].read_i32s(l.local_experts));
        if let (Some(n), Some(info)) = (&s.nccl, &handle.0.ll_nccl) {
            // What each NCCL source dispatched here: the rows combine sends it back.
            let counts = n.counts[set].read_i32s(s.num_ranks);
            let mut rows = info.send_rows.lock().unwrap_or_else(|e| e.into_inner());
            for d in n.peers(s.num_ranks) {
                rows[d] = counts[d].max(0) as usize;
            }
        }
        handle.0.core.record_dispatch(opts.pass, self.seq);
        Ok(GpuDispatchOutput {
            outputs: DispatchOutputs { tokens, scales, topk_weights: None, topk_idx: None, counts: Some(counts) },
            host_counts,
            elapsed: self.elapsed(),
            ctx: Arc::clone(&s.ctx),
            _slot: self.slot.take(),
        })
    }

    fn finish_combine(&mut self, handle: &GpuHandle) -> Result<GpuCombineOutput, Error> {
        let s = &self.shared;
        let set = self.set();
        let tokens = self.view(
            s.mem.comb_out[set].ptr(),
            TensorDesc::contiguous(TensorTag::Tokens, DType::Bf16, &[handle.num_tokens(), s.config.hidden]),
        );
        Ok(GpuCombineOutput {
            outputs: CombineOutputs { tokens, topk_weights: None },
            elapsed: self.elapsed(),
            ctx: Arc::clone(&s.ctx),
            _slot: self.slot.take(),
        })
    }
}

/// Into how many pieces to split a row of `hidden` channels so that about `want` warps share it:
/// the largest divisor of `hidden / 256` not above `want` (pieces stay multiples of 256 channels,
/// whole FP8 scale blocks and 16-byte vectors). 1 when `hidden` is not a multiple of 256.
pub(crate) fn row_chunks(hidden: usize, want: u32) -> u32 {
    if hidden % 256 != 0 {
        return 1;
    }
    let units = (hidden / 256) as u32;
    (1..=units.min(want.max(1))).rev().find(|c| units % c == 0).unwrap_or(1)
}

impl Drop for GpuOp {
    /// An operation dropped before its completion was observed (an error path; the async runtime
    /// finishes abandoned operations instead) waits for its own device work, bounded by the
    /// device-side timeout, so the inputs it keeps alive are never freed while a kernel reads them.
    fn drop(&mut self) {
        if !self.sent || bind(&self.shared.ctx).is_err() {
            return;
        }
        if self.uses_nccl() || matches!(self.launch, Launch::NcclExchange { .. }) {
            // An NCCL kernel waits for its peers without a deadline of its own. Dropping an
            // unfinished operation is an error path (a timeout, a failed launch): grant a tenth
            // of the group's timeout, then abort the communicators so the stream can drain.
            let stream = &self.shared.streams[self.chan()];
            let grace = (self.shared.config.timeout / 10).max(Duration::from_millis(100));
            let deadline = std::time::Instant::now() + grace;
            // The completion event, or (complete half never started) one recorded now.
            let probe = self.done.clone().or_else(|| {
                let e = stream.context().new_event(None).ok()?;
                e.record(stream).ok()?;
                Some(Arc::new(e))
            });
            let idle = || probe.as_ref().is_none_or(|e| e.try_is_complete().unwrap_or(true));
            while !idle() && std::time::Instant::now() < deadline {
                std::thread::sleep(Duration::from_micros(200));
            }
            if !idle() {
                if let Some(n) = &self.shared.nccl {
                    n.comms.abort();
                }
            }
        }
        let _ = match &self.done {
            Some(done) => done.synchronize(),
            None => self.shared.streams[self.chan()].synchronize(),
        };
    }
}

#[derive(Clone, Copy, Debug)]
enum Kernel {
    DispatchSend,
    DispatchRecv,
    CombineSend,
    CombineRecv,
}

impl PendingOp for GpuOp {
    type Output = GpuOpOutput;

    fn rank(&self) -> usize {
        self.shared.rank
    }

    fn channel(&self) -> Channel {
        self.channel
    }

    fn seq(&self) -> u64 {
        self.seq
    }

    fn needs_slot(&self) -> bool {
        matches!(self.launch, Launch::Ll(_))
    }

    fn poll_send_ready(&mut self) -> Result<bool, Error> {
        Ok(self.sent || self.shared.turns[self.chan()].load(Ordering::Acquire) == self.seq)
    }

    fn send(&mut self, slot: Option<SlotGuard>) -> Result<(), Error> {
        if self.sent {
            return Ok(());
        }
        let s = Arc::clone(&self.shared);
        bind(&s.ctx)?;
        let stream = &s.streams[self.chan()];
        for e in &self.waits {
            stream.wait(e).map_err(|e| cuda("wait for an input", e))?;
        }
        if s.timing.load(Ordering::Relaxed) && !self.cancelled {
            let a = s.ctx.new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT)).map_err(|e| cuda("create event", e))?;
            let m = s.ctx.new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT)).map_err(|e| cuda("create event", e))?;
            let b = s.ctx.new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT)).map_err(|e| cuda("create event", e))?;
            a.record(stream).map_err(|e| cuda("record event", e))?;
            self.timing = Some((a, m, b));
        }
        let result = match self.launch {
            Launch::Ll(_) => self
                .launch(if self.chan() == 0 { Kernel::DispatchSend } else { Kernel::CombineSend })
                .and_then(|()| if self.uses_nccl() { self.issue_xfers() } else { Ok(()) }),
            _ => self.launch_single(),
        };
        if let (Ok(()), Some((_, m, _))) = (&result, &self.timing) {
            m.record(stream).map_err(|e| cuda("record event", e))?;
        }
        // The turn passes on even if the launch failed, so later operations are not stuck
        // behind this one (the group is poisoned by the error anyway).
        s.turns[self.chan()].store(self.seq + 1, Ordering::Release);
        result?;
        self.slot = slot;
        self.sent = true;
        Ok(())
    }

    fn is_sent(&self) -> bool {
        self.sent
    }

    fn cancel(&mut self) {
        if !self.sent {
            self.cancelled = true;
            self._keep.clear();
        }
    }

    fn start_complete(&mut self) -> Result<(), Error> {
        if self.completing {
            return Ok(());
        }
        let s = Arc::clone(&self.shared);
        bind(&s.ctx)?;
        if matches!(self.launch, Launch::Ll(_)) {
            self.launch(if self.chan() == 0 { Kernel::DispatchRecv } else { Kernel::CombineRecv })?;
        }
        let stream = &s.streams[self.chan()];
        if let Some((_, _, b)) = &self.timing {
            b.record(stream).map_err(|e| cuda("record event", e))?;
        }
        let done = s.ctx.new_event(None).map_err(|e| cuda("create event", e))?;
        done.record(stream).map_err(|e| cuda("record event", e))?;
        self.done = Some(Arc::new(done));
        self.completing = true;
        Ok(())
    }

    fn poll_complete(&mut self) -> Result<bool, Error> {
        if let Some(e) = self.device_error() {
            return Err(e);
        }
        let Some(done) = &self.done else { return Ok(false) };
        bind(&self.shared.ctx)?;
        done.try_is_complete().map_err(|e| cuda("query completion", e))
    }

    fn finish(mut self) -> Result<GpuOpOutput, Error> {
        if let Some(e) = self.device_error() {
            return Err(e);
        }
        let word = self.shared.mem.status.read_u64(1 + self.chan() * MAX_SETS + self.set());
        let mask = if word >> 32 == self.seq + 1 { (word & 0xffff_ffff) as u32 } else { 0 };
        let mut work = self.work.take();
        // A count exchange: read what arrived, and give the staging buffers back.
        let received = match &mut work {
            Some(Work::HtHandle { bufs, .. }) => bufs.take().map(|b| {
                let r = received_messages(&self.shared, &b, self.seq);
                recycle_exchange(&self.shared, b);
                r
            }),
            _ => None,
        };
        if self.cancelled {
            return Ok(OpOutput::Cancelled);
        }
        if mask != 0 {
            return Err(Error::PeerCancelled { op: self.label(), peer: mask.trailing_zeros() as usize });
        }
        let elapsed = self.elapsed();
        match work {
            Some(Work::HtHandle { routing, plan, .. }) => {
                let received = received.ok_or_else(|| Error::Backend("count exchange without buffers".into()))??;
                Ok(OpOutput::Handle(finish_handle(&self.shared, self.seq, routing, &plan, &received)?))
            }
            Some(Work::Dispatch { handle, opts }) => Ok(OpOutput::Dispatch(self.finish_dispatch(&handle, opts)?)),
            Some(Work::Combine { handle }) => Ok(OpOutput::Combine(self.finish_combine(&handle)?)),
            Some(Work::HtDispatch { handle, pass, outputs: Some(boxed) }) => {
                let (outputs, host_counts) = *boxed;
                handle.0.core.record_dispatch(pass, self.seq);
                Ok(OpOutput::Dispatch(GpuDispatchOutput {
                    outputs,
                    host_counts,
                    elapsed,
                    ctx: Arc::clone(&self.shared.ctx),
                    _slot: None,
                }))
            }
            Some(Work::HtCombine { outputs: Some(outputs) }) => Ok(OpOutput::Combine(GpuCombineOutput {
                outputs,
                elapsed,
                ctx: Arc::clone(&self.shared.ctx),
                _slot: None,
            })),
            _ => Err(Error::Backend(format!("{} finished twice", op_label(self.channel, self.seq)))),
        }
    }

    fn send_probe(&self) -> Box<dyn Probe> {
        let (shared, chan, seq) = (Arc::clone(&self.shared), self.chan(), self.seq);
        Box::new(move || shared.turns[chan].load(Ordering::Acquire) == seq)
    }

    fn complete_probe(&self) -> Box<dyn Probe> {
        let shared = Arc::clone(&self.shared);
        let done = self.done.clone();
        Box::new(move || {
            if shared.mem.status.read_u64(0) != 0 {
                return true;
            }
            match &done {
                Some(e) => bind(&shared.ctx).is_err() || e.try_is_complete().unwrap_or(true),
                None => true,
            }
        })
    }

    fn traffic(&self) -> (u64, u64) {
        let (tokens, hidden) = match &self.launch {
            Launch::Ll(p) => (p.num_tokens as u64, p.hidden as u64),
            Launch::Ht(p) => (p.num_tokens as u64, p.hidden as u64),
            Launch::NcclHt { p, .. } => (p.num_tokens as u64, p.hidden as u64),
            Launch::Exchange(_) | Launch::NcclExchange { .. } => (0, 0),
        };
        (tokens * hidden * 2, tokens)
    }

    fn waiting_for(&self) -> String {
        if !self.sent {
            format!(
                "its turn to send ({} #{} has not been sent yet)",
                self.channel,
                self.shared.turns[self.chan()].load(Ordering::Acquire)
            )
        } else if let (Some(n), true) = (&self.shared.nccl, self.uses_nccl()) {
            let peers: Vec<String> = self
                .xfers
                .iter()
                .map(|x| x.peer)
                .filter(|&p| p != self.shared.rank)
                .map(|p| format!("rank {p}"))
                .collect::<std::collections::BTreeSet<_>>()
                .into_iter()
                .collect();
            let nvlink = (0..self.shared.num_ranks).filter(|&r| !n.via_nccl(r)).count() > 1;
            format!(
                "the NCCL exchange with {}{}",
                peers.join(", "),
                if nvlink { " or the device (NVLink peers' data or credits)" } else { "" }
            )
        } else {
            "the device to finish (the peers' data or credits)".into()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::row_chunks;

    #[test]
    fn rows_split_in_whole_256_channel_pieces() {
        assert_eq!(row_chunks(7168, 4), 4); // 28 units
        assert_eq!(row_chunks(7168, 5), 4);
        assert_eq!(row_chunks(7168, 1000), 28);
        assert_eq!(row_chunks(2048, 3), 2);
        assert_eq!(row_chunks(4096, 0), 1);
        assert_eq!(row_chunks(1000, 8), 1);
        assert_eq!(row_chunks(128, 8), 1);
    }
}

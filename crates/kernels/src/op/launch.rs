//! The launches of a [`GpuOp`]: its kernels (geometry decided by [`super::ll_geometry`] and
//! [`super::ht_geometry`]) and its NCCL groups, in stream order.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use cudarc::driver::{CudaEvent, CudaFunction, CudaStream, LaunchConfig, PushKernelArg, sys};
use epflow_core::Error;
use epflow_core::protocol::Fence;

use super::ht_geometry::{HT_PLAN_BLOCK, ht_grid};
use super::ll_geometry::ll_launch;
use super::{GpuOp, GpuOpKind, in_channel_order, wait_unless_same};
use crate::compile::ll_kernels::{Form, LlKernel};
use crate::device::host_steps::Steps;
use crate::device::{StreamFence, StreamWork, cuda, stream_id};
use crate::params::{ExchangeParams, HtParams, HtPlanParams, LlParams, NcclHtParams};
use crate::state::handle::GpuHandle;
use crate::state::shared::RankShared;
use crate::transport::nccl::{Xfer, issue};
use crate::transport::nccl_pairs::PairExchange;

/// The kernel parameters of an operation.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Launch {
    /// Low-latency: send and complete kernels.
    Ll(LlParams),
    /// High-throughput dispatch or combine: one kernel.
    Ht(HtParams),
    /// The count exchange of a high-throughput handle: one kernel.
    Exchange(ExchangeParams),
    /// A high-throughput handle built on the device: one kernel, its mark blocks (a thread per
    /// token), then a block per destination and the receive block.
    HtPlan(HtPlanParams),
    /// High-throughput dispatch or combine over NCCL: pack (dispatch) or arrival word, the
    /// group, the arrival check, and for combine the reduction.
    NcclHt { p: NcclHtParams, reduce: bool },
    /// The count exchange over NCCL: messages up, the group, what arrived down.
    NcclExchange { row_bytes: usize },
}

/// Launches `f` with its one parameter block `p` on `on`; `cooperative`: every block of the grid
/// is resident at once (the kernel's blocks wait for each other's work).
fn launch<P: cudarc::driver::DeviceRepr>(
    on: &CudaStream,
    f: &CudaFunction,
    p: &P,
    (grid, block): (u32, u32),
    cooperative: bool,
    what: impl FnOnce() -> String,
) -> Result<(), Error> {
    let cfg = LaunchConfig { grid_dim: (grid, 1, 1), block_dim: (block, 1, 1), shared_mem_bytes: 0 };
    let mut builder = on.launch_builder(f);
    builder.arg(p);
    // SAFETY: every epflow kernel takes one parameter block by value, mirrored byte for byte in
    // params.rs (`P` is the one of `f`); its pointers address the group's buffers, the handle's
    // memory, the outputs and the inputs, all kept alive by the operation that launches it.
    let launched = unsafe { if cooperative { builder.launch_cooperative(cfg) } else { builder.launch(cfg) } };
    launched.map_err(|e| cuda(&what(), e))?;
    Ok(())
}

/// Launches low-latency kernel `which` with parameters `p` (its geometry for this rank's SMs)
/// on `on`: an operation's, or a captured step's. The one-launch kernels go cooperative.
pub(crate) fn launch_ll_kernel(s: &RankShared, which: LlKernel, p: LlParams, on: &CudaStream) -> Result<(), Error> {
    launch_ll_kernel_as(s, which, p, on, which.is_one_launch())
}

/// [`launch_ll_kernel`] with the launch kind chosen by the caller: `cooperative: false` for a
/// one-launch kernel is only sound where its blocks need not wait for each other (a device no-op,
/// `rank/launch_cost.rs`).
pub(crate) fn launch_ll_kernel_as(
    s: &RankShared,
    which: LlKernel,
    mut p: LlParams,
    on: &CudaStream,
    cooperative: bool,
) -> Result<(), Error> {
    let sms = s.config.max_sms.map_or(s.num_sms, |m| (m as u32).min(s.num_sms)).max(1);
    let geometry = ll_launch(which, &mut p, sms);
    let f = &s.functions;
    let (fwd, nvfp4) = (p.fwd_token_bytes != 0, p.nvfp4 != 0);
    let k = match (which, which.form(&p)) {
        (LlKernel::CombineSend, _) if nvfp4 => &f.combine_nvfp4.send,
        (LlKernel::CombineRecv, _) if nvfp4 => &f.combine_nvfp4.recv,
        (LlKernel::CombineOne, _) if nvfp4 => &f.combine_nvfp4.one,
        (LlKernel::DispatchSend, _) if fwd => &f.dispatch_fwd.send,
        (LlKernel::DispatchRecv, _) if fwd => &f.dispatch_fwd.recv,
        (LlKernel::DispatchOne, Form::Tagged) if fwd => &f.dispatch_fwd.one_tagged,
        (LlKernel::DispatchOne, Form::Plain) if fwd => &f.dispatch_fwd.one,
        (LlKernel::DispatchSend, _) => &f.dispatch_send,
        (LlKernel::DispatchRecv, _) => &f.dispatch_recv,
        (LlKernel::CombineSend, _) => &f.combine_send,
        (LlKernel::CombineRecv, Form::Tagged) => &f.combine_recv_tagged,
        (LlKernel::CombineRecv, _) => &f.combine_recv,
        (LlKernel::DispatchOne, Form::Tagged) => &f.dispatch_one_tagged,
        (LlKernel::DispatchOne, Form::Plain) => &f.dispatch_one,
        (LlKernel::CombineOne, Form::Tagged) => &f.combine_one_tagged,
        (LlKernel::CombineOne, Form::Plain) => &f.combine_one,
    };
    launch(on, k, &p, geometry, cooperative, || format!("launch {which:?}"))
}

impl GpuOp {
    /// Enqueues this operation's NCCL exchange on its stream. Under rank masking (low-latency
    /// groups with NCCL peers) each unmasked peer's transfers go through that pair's own
    /// communicator and stream, masked peers' are left out; returns the pairs' exchanges
    /// (`transport/nccl_pairs.rs`), pushed onto `out` as they go out. Otherwise one NCCL
    /// group on the group's communicator.
    pub(super) fn issue_xfers(&self, out: &mut Vec<PairExchange>) -> Result<(), Error> {
        let s = &self.shared;
        let n = s.nccl.as_ref().ok_or_else(|| Error::Backend("an NCCL exchange without NCCL".into()))?;
        match &n.pairs {
            Some(pairs) => {
                let live = ((1u32 << s.num_ranks) - 1) & !(s.mask_mirror() as u32);
                pairs.issue(self.chan(), self.work.stream(), &self.xfers, live, out)
            }
            None => issue(n.comms.comm(self.chan())?, self.work.stream(), &self.xfers),
        }
    }

    fn launch_one<P: cudarc::driver::DeviceRepr>(
        &self,
        on: &CudaStream,
        f: &CudaFunction,
        p: &P,
        (grid, block): (u32, u32),
        what: &str,
    ) -> Result<(), Error> {
        launch(on, f, p, (grid, block), false, || what.to_string())
    }

    /// Launches the one kernel (or kernels and NCCL group) of a high-throughput operation or
    /// count exchange.
    pub(super) fn launch_single(&self) -> Result<(), Error> {
        // One channel's kernels in operation order on the device, whatever streams they run on
        // (a caller's, for an operation in stream order): behind the previous one if it ran on
        // another stream.
        in_channel_order(
            &self.shared,
            self.chan(),
            self.work.stream(),
            "order after the channel's last kernel",
            || {
                self.launch_kernels()?;
                self.work.record_now()
            },
        )?;
        Ok(())
    }

    /// The kernels of [`GpuOp::launch_single`].
    fn launch_kernels(&self) -> Result<(), Error> {
        let s = &self.shared;
        let cancelled = i32::from(self.state.is_cancelled());
        if let (Some((ptr, bytes)), false) = (self.fill, self.state.is_cancelled()) {
            let byte = s.output_fill.load(Ordering::Relaxed);
            if byte != 0 {
                // SAFETY: `ptr` is the start of this operation's output buffer of at least
                // `bytes` bytes, alive as long as the operation; ordered on its stream.
                unsafe { sys::cuMemsetD8Async(ptr, (byte - 1) as u8, bytes, self.work.stream().cu_stream()) }
                    .result()
                    .map_err(|e| cuda("fill outputs", e))?;
            }
        }
        let f = &s.functions;
        let on = self.work.stream();
        match self.launch {
            Launch::Ht(mut p) => {
                p.cancelled = cancelled;
                let k = if p.chan == 0 {
                    &f.ht_dispatch
                } else {
                    let min_bound = s.config.tuning().ht.combine_ranks.map_or(1, |n| n.clamp(1, 8));
                    f.ht_combine_for(p.num_ranks as usize, min_bound)
                };
                self.launch_one(on, k, &p, ht_grid(&p), "launch ht kernel")?;
            }
            Launch::Exchange(mut p) => {
                p.cancelled = cancelled;
                self.launch_one(on, &f.ht_exchange, &p, (1, 256), "launch count exchange")?;
            }
            Launch::HtPlan(mut p) => {
                p.cancelled = cancelled;
                // Under the handle channel's lock (`launch_single`): creations reach the device
                // in this order, and the counter's target follows only launches that went out.
                let launched = s.plan_marks_launched.load(Ordering::Relaxed);
                p.mark_target = launched + p.mark_blocks as u64;
                let grid = (p.mark_blocks + p.num_ranks + 1) as u32;
                self.launch_one(on, &f.ht_plan, &p, (grid, HT_PLAN_BLOCK), "launch the handle's plan")?;
                s.plan_marks_launched.store(p.mark_target, Ordering::Relaxed);
            }
            Launch::NcclHt { mut p, reduce } => {
                p.cancelled = cancelled;
                let rows = (p.total_send.max(0) as u32).div_ceil(16);
                self.launch_one(on, &f.nccl_ht_pack, &p, (rows.clamp(1, 2 * s.num_sms), 512), "launch NCCL pack")?;
                self.issue_xfers(&mut Vec::new())?;
                self.launch_one(on, &f.nccl_arrivals, &p, (1, 32), "launch NCCL arrival check")?;
                if reduce && !self.state.is_cancelled() {
                    let grid = (p.num_tokens.max(1) as u32).min(4 * s.num_sms);
                    self.launch_one(on, &f.nccl_ht_reduce, &p, (grid, 256), "launch NCCL reduce")?;
                }
            }
            Launch::NcclExchange { row_bytes } => self.exchange_over_nccl(row_bytes)?,
            Launch::Ll(_) => return Err(Error::Backend("a low-latency operation has two launches".into())),
        }
        Ok(())
    }

    /// The count exchange over NCCL: this rank's messages (with the operation number, written
    /// at creation, and the cancellation flag) go to the device, every peer's row out, every
    /// peer's row in, and what arrived back to the host.
    fn exchange_over_nccl(&self, row_bytes: usize) -> Result<(), Error> {
        let s = &self.shared;
        let n = s.nccl.as_ref().ok_or_else(|| Error::Backend("an NCCL exchange without NCCL".into()))?;
        let Some(GpuOpKind::HtHandle { bufs: Some(bufs), .. }) = &self.kind else {
            return Err(Error::Backend("a count exchange without buffers".into()));
        };
        if self.state.is_cancelled() {
            let words = row_bytes / 4;
            for d in 0..s.num_ranks {
                bufs.msgs.write_i32_at(d * words + words - 1, 1);
            }
        }
        let bytes = s.num_ranks * row_bytes;
        let stream = self.work.stream();
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

    /// Launches one kernel of a low-latency operation on `on` (its own stream, or a caller's for
    /// a stream-ordered receive).
    pub(super) fn launch_ll(&self, which: LlKernel, on: &CudaStream) -> Result<(), Error> {
        let Launch::Ll(mut p) = self.launch else {
            return Err(Error::Backend("not a low-latency operation".into()));
        };
        p.cancelled = i32::from(self.state.is_cancelled());
        if p.cancelled != 0 {
            // A cancelled operation no longer waits for its inputs (`release_inputs`): its send
            // must not load the caller's routing (it reads the handle's memory instead, and
            // writes nothing).
            p.topk_src = 0;
            p.route_report = 0;
        }
        launch_ll_kernel(&self.shared, which, p, on)
    }

    /// The complete half of a low-latency operation, on `on`, after the fences of the buffer set
    /// it writes (its previous outputs' consumers); returns the completion event.
    pub(super) fn launch_recv(&mut self, on: &Arc<CudaStream>) -> Result<Arc<CudaEvent>, Error> {
        let fences = self.state.take_fences();
        let which = if self.chan() == 0 { LlKernel::DispatchRecv } else { LlKernel::CombineRecv };
        self.launch_completing(on, which, fences, &mut Steps::start())
    }

    /// Launches `which`, a complete half or a one-launch kernel (then the end of the send half
    /// is marked after it too), on `on` after `fences` (of the buffer set it writes: its previous
    /// outputs' consumers); returns the completion event. A dispatch's receive writes the
    /// handle's row map, so it also waits (on the device) for the combines that read the previous
    /// map, and then becomes the map's writer.
    pub(super) fn launch_completing(
        &mut self,
        on: &Arc<CudaStream>,
        which: LlKernel,
        fences: Vec<Fence>,
        steps: &mut Steps,
    ) -> Result<Arc<CudaEvent>, Error> {
        // A fence recorded on `on` itself (the caller's stream, where the set's previous
        // operation completed) is already behind us in stream order: no wait for it. A plain
        // event is always waited for.
        let fences: Vec<Arc<CudaEvent>> = fences
            .into_iter()
            .filter_map(|f| match f.downcast::<StreamFence>() {
                Ok(f) => (f.stream != stream_id(on)).then(|| Arc::clone(&f.event)),
                Err(f) => f.downcast::<CudaEvent>().ok(),
            })
            .collect();
        StreamWork::wait_on(on, &fences)?;
        steps.step(if fences.is_empty() { "launch: no buffer-set fence" } else { "launch: buffer-set fence waits" });
        let handle = match (&self.kind, self.state.is_cancelled()) {
            (Some(GpuOpKind::Dispatch { handle, .. }), false) => Some(handle.clone()),
            _ => None,
        };
        let mut map = handle.as_ref().map(GpuHandle::row_map);
        if let Some(map) = &map {
            if let (true, Some(reader)) = (map.readers_sent != map.readers_done, &map.reader_event) {
                wait_unless_same(on, reader, map.reader_stream, "wait for the previous combine")?;
            }
        }
        steps.step("launch: row map wait");
        self.launch_ll(which, on)?;
        steps.step(which.step_name());
        if which.is_one_launch() {
            self.work.end_send()?;
        }
        let done = self.work.end_complete_on(on)?;
        steps.step("launch: end events");
        if let Some(map) = &mut map {
            map.writer = Some(self.seq);
            map.writer_event = Some(Arc::clone(&done));
            map.writer_stream = stream_id(on);
        }
        Ok(done)
    }
}

//! Low-latency handles built on the device. `ep_ll_handle` (`cuda/ll_handle.cuh`, one block, after
//! `topk_idx`'s ready event) copies and checks `topk_idx` into the handle's memory and, for a
//! rank-major handle whose dispatches compact, numbers each destination's tokens (the send
//! slots, `epflow_core::routing::compacted_slots` on the device) and counts them. Neither
//! `topk_idx` nor the slots cross to the host: the host-built handle (NCCL peers, whose combine
//! positions the host computes, or `EPFLOW_LL_HANDLE=host`) pays two synchronous copies through
//! pageable memory and the routing's checks on the CPU (benches/NOTES.md item 141).
//!
//! Two ways: [`build`] (an awaited creation) runs the kernel on the rank's handle stream and the
//! host waits for it alone, then reads a few mapped words: the first invalid entry (the
//! creation's error, as the host-built handle names it) and the messages per destination (the
//! arrival words' counts, `LlParams::send_rows`). That stream carries no operation of a
//! low-latency group; only a mask change's meeting (`unmask_all`, `rank/mask.rs`) waits for peers
//! there, bounded by the timeout. [`build_on`] (a creation in a stream's order,
//! `Backend::start_handle_on`) hands the handle out at once and launches nothing: its
//! dispatches read the caller's `topk_idx` themselves, as captured steps' do (`routed_entry` in
//! `ll_send.cuh`: each row sanitized in the send, the handle's copy written by the token's own
//! warp, an invalid row reported in the handle's mapped report), and send uncompacted messages,
//! the receive scanning their headers. That costs the kernel's ~4.5 µs of device time per routing
//! less, and 1-1.5 µs of receive at 128 tokens more (benches/NOTES.md item 149). A handle
//! dispatched again gets the kernel beside its second dispatch, on a stream of its own
//! (`stream_routing`; that dispatch's completion follows it), and its later dispatches send
//! compacted. `EPFLOW_LL_STREAM_HANDLE=kernel` enqueues the kernel on the caller's stream
//! instead, whose dispatches then wait for it on the device, read the counts from the handle,
//! and check its report at their verdicts.

use epflow_core::tuning::HandleBuilder;
use std::sync::{Arc, Mutex};

use cudarc::driver::{CudaEvent, CudaStream, PushKernelArg};
use epflow_core::Algorithm;
use epflow_core::Error;
use epflow_core::handle::{HandleCore, RoutingHandle};
use epflow_core::ops::Layout;
use epflow_core::protocol::Channel;

use crate::device::host_steps::Steps;
use crate::device::{DeviceBuffer, DeviceTensor, PinnedBuffer, bind, cuda, stream_id};
use crate::params::{LL_COMPACT_MAX_ROWS, MAX_RANKS};
use crate::state::handle::{GpuHandle, LlStreamBuilt, take_pooled};
use crate::state::shared::RankShared;

/// Words of the kernel's report before the per-destination counts: the first invalid entry,
/// its value, the earlier k it repeats (read by [`crate::state::ht_result::invalid_routing_in`]).
const REPORT_HEAD: usize = 3;

/// Threads of the kernel's block at most (`EP_LL_HANDLE_BLOCK`).
const MAX_BLOCK: usize = 1024;

/// Whether this rank builds its low-latency handles on the device: unless a peer is reached
/// over NCCL (the combine positions are computed on the host), or `EPFLOW_LL_HANDLE=host`
/// (read once per process) asks for the host-built handle, kept for comparison and as a fallback.
pub(crate) fn builds_on_device(s: &RankShared) -> bool {
    s.nccl.is_none() && s.config.tuning().ll_handle == HandleBuilder::Device
}

/// Whether a creation in a stream's order enqueues the handle's kernel (the group's
/// [`epflow_core::tuning::Tuning::ll_stream_handle_kernel`], `EPFLOW_LL_STREAM_HANDLE=kernel`)
/// rather than leaving the routing to the dispatches.
fn stream_order_kernel(s: &RankShared) -> bool {
    s.config.tuning().ll_stream_handle_kernel
}

/// The threads of the kernel's block for `tokens`: one per token up to [`MAX_BLOCK`] (more
/// tokens take several tiles), a multiple of 32.
fn block_threads(tokens: usize) -> u32 {
    tokens.clamp(1, MAX_BLOCK).next_multiple_of(32) as u32
}

/// A low-latency handle of `layout` for `topk_idx` (`[B x K]` int64 on this rank's device, its
/// descriptor and `K` already checked), built on the device. Blocks until the kernel has run:
/// the handle is ready when returned, and an invalid entry is this call's error
/// ([`epflow_core::ValidationError::ExpertIndexOutOfRange`] or
/// [`epflow_core::ValidationError::DuplicateExpert`], the
/// first in row-major order, as the host-built handle reports it). `steps` times the memory, the
/// launch and the wait (`EPFLOW_HOST_STEPS`).
pub(crate) fn build(
    s: &Arc<RankShared>,
    topk_idx: &DeviceTensor,
    layout: Layout,
    steps: &mut Steps,
) -> Result<GpuHandle, Error> {
    let (b, k) = (topk_idx.desc().shape[0], topk_idx.desc().shape[1]);
    let (mem, report, compact) = take_memory(s, layout)?;
    steps.step("handle: take the handle's memory");
    let built = launch(s, &s.streams[Channel::Handle.index()], topk_idx, &mem, &report, (b, k, compact), true);
    steps.step("handle: launch the kernel");
    let outcome = built.and_then(|()| read_report(s, &report, k, compact));
    steps.step("handle: wait for the kernel");
    s.plan_results.lock().unwrap_or_else(|e| e.into_inner()).push(report);
    let send_rows = match outcome {
        Ok(rows) => rows,
        Err(e) => {
            s.handle_pool.lock().unwrap_or_else(|e| e.into_inner()).push(mem);
            return Err(e);
        }
    };
    let core = HandleCore::on_device(s.group_id, b, k, Algorithm::LowLatency, None).with_layout(layout);
    Ok(GpuHandle::new(core, mem, &s.handle_pool, None, None, send_rows))
}

/// A handle created in `stream`'s order, handed out at once; nothing waits on the host. An event
/// on `stream` after `topk_idx`'s ready event (and after the handle's kernel, with
/// `EPFLOW_LL_STREAM_HANDLE=kernel`) is what its dispatches wait for on the device
/// (`GpuHandle::ll_built_after`: no wait on `stream` itself). Each dispatch checks the routing's
/// report at its verdict: an invalid entry makes each of this rank's dispatches on the handle
/// fail with the error [`build`] would have returned, while the peers receive the sanitized rows
/// (as with captured steps). `topk_idx` must stay unchanged until the handle's dispatches ran:
/// the first two read it, and the kernel the second launches (with the kernel at creation,
/// until that kernel has run).
pub(crate) fn build_on(
    s: &Arc<RankShared>,
    topk_idx: &DeviceTensor,
    layout: Layout,
    stream: &Arc<CudaStream>,
    steps: &mut Steps,
) -> Result<GpuHandle, Error> {
    if !stream_order_kernel(s) {
        return read_by_dispatches(s, topk_idx, layout, stream, steps);
    }
    let (b, k) = (topk_idx.desc().shape[0], topk_idx.desc().shape[1]);
    let (mem, report, compact) = take_memory(s, layout)?;
    steps.step("handle: take the handle's memory");
    let launched = launch(s, stream, topk_idx, &mem, &report, (b, k, compact), false);
    let recorded = launched.and_then(|()| record_after_kernel(s, stream));
    steps.step("handle: launch the kernel");
    let send_rows = compact.then_some([-1i32; MAX_RANKS]);
    handed_out(s, topk_idx, layout, stream, (mem, report), recorded, (None, send_rows))
}

/// The handle [`build_on`] hands out once its event is `recorded` on `stream`; with
/// `(topk_src, send_rows)` as [`LlStreamBuilt::topk_src`] and [`GpuHandle::new`]'s `send_rows`.
/// On an error the memory and the report go back to their pools (no kernel uses them:
/// `record_after_kernel` waited for one that may have been enqueued).
fn handed_out(
    s: &Arc<RankShared>,
    topk_idx: &DeviceTensor,
    layout: Layout,
    stream: &CudaStream,
    (mem, report): (DeviceBuffer, PinnedBuffer),
    recorded: Result<Arc<CudaEvent>, Error>,
    (topk_src, send_rows): (Option<u64>, Option<[i32; MAX_RANKS]>),
) -> Result<GpuHandle, Error> {
    let built = match recorded {
        Ok(e) => e,
        Err(e) => {
            s.plan_results.lock().unwrap_or_else(|e| e.into_inner()).push(report);
            s.handle_pool.lock().unwrap_or_else(|e| e.into_inner()).push(mem);
            return Err(e);
        }
    };
    let (b, k) = (topk_idx.desc().shape[0], topk_idx.desc().shape[1]);
    let built = LlStreamBuilt {
        built,
        stream: stream_id(stream),
        report: Some(report),
        report_pool: Arc::clone(&s.plan_results),
        topk: topk_idx.keep_alive(),
        topk_src,
        later: Mutex::default(),
    };
    let core = HandleCore::on_device(s.group_id, b, k, Algorithm::LowLatency, None).with_layout(layout);
    Ok(GpuHandle::ll_in_stream_order(core, mem, &s.handle_pool, send_rows, built))
}

/// [`build_on`] without a kernel: the handle's memory (its copy of the routing, written by its
/// dispatches' sends) and a report of invalid rows in the format of captured steps' (replay 0;
/// [`crate::state::ll_report::invalid_row_in`]), cleared here; an event on `stream` after `topk_idx`'s
/// ready event.
fn read_by_dispatches(
    s: &Arc<RankShared>,
    topk_idx: &DeviceTensor,
    layout: Layout,
    stream: &Arc<CudaStream>,
    steps: &mut Steps,
) -> Result<GpuHandle, Error> {
    let b = topk_idx.desc().shape[0];
    let (mem, report, _) = take_memory(s, layout)?;
    // No kernel uses the report now (a pooled one's last kernel ran before it was pooled); the
    // dispatches write a row's word only for an invalid row, and word 0 then.
    for w in 0..=b {
        report.write_u64(w, 0);
    }
    steps.step("handle: take the handle's memory");
    let ordered = order_after_topk(s, stream, topk_idx);
    let recorded = ordered.and_then(|()| s.events.record(stream).map_err(|e| cuda("record the handle's event", e)));
    steps.step("handle: order after topk_idx");
    handed_out(s, topk_idx, layout, stream, (mem, report), recorded, (Some(topk_idx.ptr()), None))
}

/// The dispatch (1-based) on a handle created in stream order without a kernel at which the
/// handle's kernel is launched for the later ones: a handle used once (a fresh routing per layer)
/// never pays it; the dispatches from the next on send compacted messages (~1.3 µs less receive
/// at 128 tokens, benches/NOTES.md item 125) from a copy and slots the kernel built beside the
/// launching dispatch, on the rank's stream for such builds (`RankShared::later_builds`).
const LATER_BUILD_AT: u32 = 2;

/// What a dispatch on a low-latency handle created in stream order without a kernel reads.
#[derive(Debug)]
pub(crate) enum StreamRouting {
    /// The caller's `topk_idx` and the report of invalid rows (`LlParams::topk_src`,
    /// `route_report`); `launched`: the event after the handle's kernel this dispatch launched
    /// beside itself, which its completion follows (the kernel reads the caller's `topk_idx`
    /// and writes the handle's copy: both within this dispatch's lifetime).
    Caller { topk: u64, report: u64, launched: Option<Arc<CudaEvent>> },
    /// The handle's copy, and with `compact` its slots and counts (`LlParams::send_slot`,
    /// `send_rows` -1), built by the kernel before `event` on the stream `stream`
    /// ([`crate::device::stream_id`]).
    Built { event: Arc<CudaEvent>, stream: usize, compact: bool },
}

/// The routing of the next dispatch on `h`: `None` for every handle but one created in stream
/// order without a kernel. Counts the dispatch; the [`LATER_BUILD_AT`]th launches the handle's
/// kernel on the rank's stream for such builds (after the creation's event, reading the caller's
/// `topk_idx`, which the dispatches read too: the copy it writes holds the values theirs do; that
/// dispatch's completion follows it), and the dispatches after it read what it built.
pub(crate) fn stream_routing(s: &Arc<RankShared>, h: &GpuHandle) -> Result<Option<StreamRouting>, Error> {
    let Some(b) = h.ll_stream() else { return Ok(None) };
    let (Some(topk), Some(report)) = (b.topk_src, b.report.as_ref()) else { return Ok(None) };
    let l = s.layout.ll("a low-latency dispatch")?;
    let compact = h.layout() == Layout::RankMajor && l.max_tokens <= LL_COMPACT_MAX_ROWS;
    let mut later = b.later.lock().unwrap_or_else(|e| e.into_inner());
    later.dispatches = later.dispatches.saturating_add(1);
    if let Some((event, _, stream)) = &later.built {
        return Ok(Some(StreamRouting::Built { event: Arc::clone(event), stream: *stream, compact }));
    }
    let mut launched = None;
    if later.dispatches == LATER_BUILD_AT {
        let on = s.later_build_stream()?;
        let kernel_report = take_report(s, report_bytes(s, l.max_tokens))?;
        let shape = (h.num_tokens(), h.top_k(), compact);
        let built = bind(&s.ctx)
            .and_then(|()| on.wait(&b.built).map_err(|e| cuda("order the handle's kernel", e)))
            .and_then(|()| launch_raw(s, &on, (topk, h.ptr()), &kernel_report, shape, false))
            .and_then(|()| record_after_kernel(s, &on));
        match built {
            Ok(event) => {
                launched = Some(Arc::clone(&event));
                later.built = Some((event, kernel_report, stream_id(&on)));
            }
            Err(e) => {
                s.plan_results.lock().unwrap_or_else(|e| e.into_inner()).push(kernel_report);
                return Err(e);
            }
        }
    }
    Ok(Some(StreamRouting::Caller { topk, report: report.device_ptr(), launched }))
}

/// A handle's memory, a report buffer, and whether its dispatches compact (rank-major, `M` at
/// most `LL_COMPACT_MAX_ROWS`).
fn take_memory(s: &RankShared, layout: Layout) -> Result<(DeviceBuffer, PinnedBuffer, bool), Error> {
    let l = s.layout.ll("a low-latency handle")?;
    let compact = layout == Layout::RankMajor && l.max_tokens <= LL_COMPACT_MAX_ROWS;
    let mem = take_pooled(s, l.handle_bytes())?;
    let report = take_report(s, report_bytes(s, l.max_tokens))?;
    Ok((mem, report, compact))
}

/// The bytes of every low-latency handle's report, so that the pool's reports serve both ways:
/// the kernel's (`REPORT_HEAD` words and one per rank) and the dispatches' (`1 + 2M` words).
fn report_bytes(s: &RankShared, max_tokens: usize) -> usize {
    (REPORT_HEAD + s.num_ranks).max(1 + 2 * max_tokens.max(1)) * 8
}

/// A mapped report of at least `bytes` from the rank's pool (`plan_results`), or a new one.
fn take_report(s: &RankShared, bytes: usize) -> Result<PinnedBuffer, Error> {
    let popped = s.plan_results.lock().unwrap_or_else(|e| e.into_inner()).pop();
    match popped {
        Some(p) if p.bytes() >= bytes => Ok(p),
        Some(p) => {
            s.plan_results.lock().unwrap_or_else(|e| e.into_inner()).push(p);
            PinnedBuffer::zeroed(&s.ctx, bytes)
        }
        None => PinnedBuffer::zeroed(&s.ctx, bytes),
    }
}

/// Enqueues `ep_ll_handle` on `stream` after `topk_idx`'s ready event, writing into `mem` (a
/// handle's memory) and `report` (its first word set to -1 first: the kernel writes the report
/// only for an invalid routing, and the counts only with `counts_to_host`); `shape`: `(B, K,
/// compact)`.
fn launch(
    s: &RankShared,
    stream: &CudaStream,
    topk_idx: &DeviceTensor,
    mem: &DeviceBuffer,
    report: &PinnedBuffer,
    shape: (usize, usize, bool),
    counts_to_host: bool,
) -> Result<(), Error> {
    order_after_topk(s, stream, topk_idx)?;
    launch_raw(s, stream, (topk_idx.ptr(), mem.ptr()), report, shape, counts_to_host)
}

/// Orders `stream` after `topk_idx`'s ready event, if it has one (this rank's context bound).
fn order_after_topk(s: &RankShared, stream: &CudaStream, topk_idx: &DeviceTensor) -> Result<(), Error> {
    bind(&s.ctx)?;
    if let Some(e) = topk_idx.ready_event() {
        stream.wait(e).map_err(|e| cuda("wait for topk_idx", e))?;
    }
    Ok(())
}

/// [`launch`] once `stream` is ordered after `topk_idx`: `(topk_in, mem)` are the device
/// addresses of `topk_idx` and of the handle's memory.
fn launch_raw(
    s: &RankShared,
    stream: &CudaStream,
    (topk_in, mem): (u64, u64),
    report: &PinnedBuffer,
    shape: (usize, usize, bool),
    counts_to_host: bool,
) -> Result<(), Error> {
    let (b, k, compact) = shape;
    let l = s.layout.ll("a low-latency handle")?;
    // No kernel uses the report now (a pooled one's last kernel ran before it was pooled).
    report.write_u64(0, u64::MAX);
    let (topk_out, report_ptr) = (mem, report.device_ptr());
    let slots = if compact { mem + l.send_slot_offset() as u64 } else { 0 };
    let local = s.config.num_experts / s.num_ranks;
    let ints =
        [b, k, s.config.num_experts, local, s.num_ranks, l.max_tokens, usize::from(counts_to_host)].map(|v| v as i32);
    let cfg =
        cudarc::driver::LaunchConfig { grid_dim: (1, 1, 1), block_dim: (block_threads(b), 1, 1), shared_mem_bytes: 0 };
    let mut builder = stream.launch_builder(&s.functions.ll_handle);
    builder.arg(&topk_in).arg(&topk_out).arg(&slots).arg(&report_ptr);
    for v in &ints {
        builder.arg(v);
    }
    // SAFETY: the arguments match `ep_ll_handle(u64, u64, u64, u64, int x 7)`; `topk_in` holds
    // B x K int64 on this device (its descriptor was checked) and stays alive until the kernel
    // ran (`build` waits for it within the caller's borrow; `build_on` and `stream_routing` keep
    // epflow's memory in the handle, and the caller's own is read in its stream's order); `mem`
    // holds the handle's B x K copy and, from `send_slot_offset`, R x M int32 slots and R counts
    // (`handle_bytes`); `report` holds at least 3 + R mapped words; neither goes back to its
    // pool before the kernel ran.
    unsafe { builder.launch(cfg) }.map_err(|e| cuda("launch ep_ll_handle", e))?;
    Ok(())
}

/// An event recorded on `stream` after the handle's kernel. If it cannot be recorded, the stream
/// is synchronized first (the kernel may be enqueued: the caller pools the memory and the report
/// after this returns).
fn record_after_kernel(s: &RankShared, stream: &CudaStream) -> Result<Arc<CudaEvent>, Error> {
    s.events.record(stream).map_err(|e| {
        if let Err(w) = stream.synchronize() {
            tracing::warn!("a low-latency handle: waiting for its kernel failed: {w:?}");
        }
        cuda("record the handle's event", e)
    })
}

/// Waits for the kernel (an event after it on the handle stream) and reads its report: the
/// routing's first invalid entry as the error, else (compacted) the messages per destination.
fn read_report(
    s: &RankShared,
    report: &PinnedBuffer,
    top_k: usize,
    compact: bool,
) -> Result<Option<[i32; MAX_RANKS]>, Error> {
    let done = record_after_kernel(s, &s.streams[Channel::Handle.index()])?;
    done.synchronize().map_err(|e| cuda("wait for ep_ll_handle", e))?;
    if let Some(e) = crate::state::ht_result::invalid_routing_in(report, top_k, s.config.num_experts) {
        return Err(Error::Validation(e));
    }
    if !compact {
        return Ok(None);
    }
    let mut rows = [0i32; MAX_RANKS];
    for (d, r) in rows.iter_mut().enumerate().take(s.num_ranks) {
        *r = report.read_u64(REPORT_HEAD + d) as i32;
    }
    Ok(Some(rows))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_block_covers_the_tokens_in_whole_warps_up_to_the_limit() {
        assert_eq!(block_threads(0), 32);
        assert_eq!(block_threads(1), 32);
        assert_eq!(block_threads(33), 64);
        assert_eq!(block_threads(128), 128);
        assert_eq!(block_threads(1024), 1024);
        assert_eq!(block_threads(5000), 1024);
    }
}

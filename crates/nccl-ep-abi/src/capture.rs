//! CUDA graph capture of low-latency calls: a caller may enqueue `ncclEpDispatch`,
//! `ncclEpCombine` and `ncclEpComplete` on a stream under `cudaStreamBeginCapture`, and launch
//! the graph as often as it likes (NCCL EP 0.1's decode pattern).
//!
//! Eager calls number their operations on the host, which never sees a `cudaGraphLaunch`. So
//! at the first call captured on a low-latency group, the group switches to numbering on the
//! device for good (epflow-kernels' `DeviceNumbering`): every later low-latency call, captured
//! or not, reads its number from device memory and its receive moves it on, in stream order.
//! The rules that brings (each refused with `ncclInvalidUsage` and a log line):
//! - the group's calls run in one order on the device: one stream, or streams the caller
//!   joins; a graph's replays are ordered with the eager calls the same way;
//! - a channel's send-only operations complete oldest first, at most two open per channel,
//!   and no synchronous call on a channel while a send-only one is open there;
//! - handles are created and updated outside a capture; each run of a dispatch reads the
//!   routing from the handle's `topk_idx` (refill it in place between replays; an int32 one is
//!   re-widened by a kernel captured before the dispatch);
//! - every peer over NVLink (not through NCCL), no `enable_mask`, low-latency only (a
//!   high-throughput dispatch reads its receive count on the host, as NCCL EP's does).
//!
//! Failures a replay meets on the device (a timeout, a peer's mismatch, an invalid top-k entry)
//! fail the group, and the next call returns them (or `ncclEpGetAsyncError` reports them).

use std::sync::Arc;
use std::sync::atomic::Ordering;

use cudarc::driver::sys::{
    CUstream, CUstreamCaptureMode, CUstreamCaptureStatus, cuStreamIsCapturing, cuThreadExchangeStreamCaptureMode,
};
use epflow_core::Algorithm;
use epflow_kernels::DeviceNumbering;
use nccl_ep_sys as ep;

use crate::group::Group;
use crate::status::{Fail, Res};

/// How a low-latency call of the group numbers its operation.
pub(crate) enum Mode {
    /// On the host (the group never had a call captured).
    Eager,
    /// On the device.
    Numbered(Arc<DeviceNumbering>),
}

/// This thread's stream-capture mode set to relaxed while it lives, then restored: CUDA calls
/// that a capture in the global mode forbids (an event query) are allowed on this thread.
struct RelaxedCalls(Option<CUstreamCaptureMode>);

impl RelaxedCalls {
    fn new() -> Self {
        let mut mode = CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED;
        // SAFETY: a valid in/out pointer to a mode; the call only swaps this thread's mode.
        let rc = unsafe { cuThreadExchangeStreamCaptureMode(&mut mode) };
        RelaxedCalls(rc.result().ok().map(|()| mode))
    }
}

impl Drop for RelaxedCalls {
    fn drop(&mut self) {
        if let Some(mut mode) = self.0.take() {
            // SAFETY: as in `new`: puts back the mode this thread had.
            let _ = unsafe { cuThreadExchangeStreamCaptureMode(&mut mode) };
        }
    }
}

/// The capture status of the caller's `stream`.
fn capture_status(stream: ep::CudaStream) -> Result<CUstreamCaptureStatus, cudarc::driver::DriverError> {
    let mut status = CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    // SAFETY: the caller's live stream (or null, the legacy default stream); a valid out pointer.
    let rc = unsafe { cuStreamIsCapturing(stream as CUstream, &mut status) };
    rc.result().map(|()| status)
}

/// `ncclInvalidUsage` while `stream` is being captured into a CUDA graph: handles are made
/// outside captures (dispatches and combines may be captured).
pub(crate) fn refuse_capture(stream: ep::CudaStream, what: &str) -> Res<()> {
    if matches!(capture_status(stream), Ok(s) if s != CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE) {
        return Err(Fail::usage(format!(
            "{what} on a stream under CUDA graph capture: create and update handles outside the capture (a captured dispatch reads the handle's topk_idx at every replay: refill it in place)"
        )));
    }
    Ok(())
}

/// Whether `stream` is capturing into a CUDA graph now; `ncclInvalidUsage` for a capture that
/// was invalidated.
pub(crate) fn capturing(stream: ep::CudaStream, what: &str) -> Res<bool> {
    let status = capture_status(stream).map_err(|e| {
        Fail::from(epflow_core::Error::Backend(format!("CUDA: {what}: is the stream capturing? {e:?}")))
    })?;
    match status {
        CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE => Ok(false),
        CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_ACTIVE => Ok(true),
        _ => Err(Fail::usage(format!("{what}: the stream's CUDA graph capture was invalidated"))),
    }
}

/// The mode of a call of `g` on `stream`: switches the group to numbering on the device at its
/// first captured low-latency call (waiting for its earlier operations' verdicts first).
pub(crate) fn mode(g: &Group, stream: ep::CudaStream, what: &str) -> Res<Mode> {
    let captured = capturing(stream, what)?;
    if g.shape.algorithm != Algorithm::LowLatency {
        if captured {
            return Err(Fail::usage(format!(
                "{what} on a stream under CUDA graph capture: a high-throughput call cannot be captured (it reads its receive counts on the host, as NCCL EP's does)"
            )));
        }
        return Ok(Mode::Eager);
    }
    let dn = match &g.numbering {
        Ok(dn) => dn,
        Err(why) if captured => {
            return Err(Fail::usage(format!("{what} on a stream under CUDA graph capture: {why}")));
        }
        Err(_) => return Ok(Mode::Eager),
    };
    if dn.started() {
        return Ok(Mode::Numbered(Arc::clone(dn)));
    }
    if !captured {
        return Ok(Mode::Eager);
    }
    if g.eager_staged.load(Ordering::Acquire) > 0 {
        return Err(Fail::usage(format!(
            "{what} on a stream under CUDA graph capture: a send-only operation issued before the capture waits for ncclEpComplete; complete it before capturing"
        )));
    }
    {
        // The verdicts of the operations before the capture are read first (so no operation
        // numbered on the device reuses their buffer sets' words before): waiting for them
        // queries their events, which a global-mode capture forbids this thread unless it
        // relaxes its own mode for the while.
        let _relaxed = RelaxedCalls::new();
        g.settle(true)?;
    }
    g.rank.start_device_numbering(dn)?;
    crate::status::info(&format!(
        "rank {}: a low-latency call was captured into a CUDA graph: the group numbers its operations on the device from now on",
        g.shape.rank
    ));
    Ok(Mode::Numbered(Arc::clone(dn)))
}

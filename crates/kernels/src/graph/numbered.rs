//! Low-latency operations numbered on the device, one by one: what lets a caller capture them
//! into a CUDA graph of its own (NCCL EP's C API: `cudaStreamBeginCapture`, calls,
//! `cudaStreamEndCapture`, then `cudaGraphLaunch` as often as it likes, which epflow never sees).
//!
//! Eager operations take their numbers on the host, and a captured step ([`super::GpuStep`])
//! advances its bases at the end of each replay, which epflow launches. Neither works for a
//! graph the caller launches. Here each channel's next number lives in device memory (the
//! rank's [`DeviceNumbering`] bases, laid out as a step's with `last` = `EP_NUMBERED_PER_OP`):
//! an operation's kernels read it when they start, and its receive (or one-launch kernel) adds
//! one when it ends (`advance_step` in `ll_receive.cuh`), in the stream's order. The host passes
//! only the rank's numbers when it switched ([`GpuRank::start_device_numbering`]) plus a send's
//! place among the channel's open sends, which is the same at every replay.
//!
//! Rules (refused with [`Error::Unsupported`] where the host can see them):
//! - once a rank numbers on the device, it never goes back: its eager host-numbered low-latency
//!   operations and step replays are refused;
//! - a channel's receives run in the order of its sends (complete the send halves oldest
//!   first), at most `buffer_sets` sends open per channel, and a synchronous operation only
//!   while none is open on its channel;
//! - every operation of the rank runs in one order on the device: one stream, or streams the
//!   caller joins (the bases are read and moved by the kernels in that order);
//! - every peer over NVLink, no rank masking.
//!
//! Failures: a peer's cancellation or mismatch goes to a mapped failure word, a timeout to the
//! status page, an invalid top-k entry to the handle's report; [`DeviceNumbering::check`]
//! reads them (the ABI calls it at every call).

use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, Weak};

use cudarc::driver::CudaStream;
use epflow_core::handle::RoutingHandle;
use epflow_core::ops::{CombineInputs, CombineOptions, CountsLocation, DispatchInputs, DispatchOptions};
use epflow_core::protocol::Channel;
use epflow_core::stamp::{Pairing, Stamp};
use epflow_core::validate::{validate_combine_inputs, validate_dispatch_inputs};
use epflow_core::{Algorithm, Error, ValidationError};

use super::StepMemory;
use crate::compile::ll_kernels::LlKernel;
use crate::device::{DeviceTensor, bind};
use crate::ll::handle::StreamRouting;
use crate::ll::start::{combine_params, dispatch_params};
use crate::op::launch_ll_kernel;
use crate::outputs::OutputTargets;
use crate::params::LlParams;
use crate::rank::GpuRank;
use crate::state::handle::{GpuHandle, GpuHandleState};
use crate::state::shared::RankShared;

/// `last` of bases numbered one by one (`EP_NUMBERED_PER_OP` in `ll_base.cuh`).
const PER_OP: u64 = u64::MAX;

/// A rank's device numbering ([`GpuRank::device_numbering`]): the bases its operations read
/// and move, the failure word, and the host's view of the open sends.
pub struct DeviceNumbering {
    shared: Arc<RankShared>,
    mem: StepMemory,
    state: Mutex<State>,
}

impl std::fmt::Debug for DeviceNumbering {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        f.debug_struct("DeviceNumbering").field("rank", &self.shared.rank).field("start", &st.start).finish()
    }
}

#[derive(Default)]
struct State {
    /// Per channel (dispatch, combine), the host's next number when the rank switched
    /// (`None`: it has not).
    start: Option<[u64; 2]>,
    /// Per channel, the send halves launched and not completed yet, oldest first.
    open: [VecDeque<u64>; 2],
    /// The next send half's id.
    next_id: u64,
    /// Handles dispatched since the switch (a combine needs one): weak references, so that a
    /// handle dropped since is never taken for a new one at the same address.
    dispatched: Vec<Weak<GpuHandleState>>,
}

impl State {
    /// Whether handle `h` was dispatched since the switch.
    fn has_dispatched(&self, h: &GpuHandle) -> bool {
        self.dispatched.iter().any(|w| std::ptr::eq(w.as_ptr(), Arc::as_ptr(&h.0)))
    }
}

/// The send half of an operation numbered on the device ([`GpuRank::numbered_dispatch_into`]
/// with `staged`): complete it with [`GpuRank::numbered_complete`], the channel's oldest first.
#[derive(Debug)]
#[must_use = "complete the send half (GpuRank::numbered_complete)"]
pub struct NumberedSend {
    channel: Channel,
    p: LlParams,
    id: u64,
}

impl NumberedSend {
    /// The channel of the operation.
    pub fn channel(&self) -> Channel {
        self.channel
    }
}

fn channel_index(c: Channel) -> usize {
    if c == Channel::Dispatch { 0 } else { 1 }
}

impl GpuRank {
    /// The device numbering of this rank (allocates 64 bytes of device memory and a mapped
    /// word; call it before any capture, which forbids allocations). Not started: the rank
    /// numbers on the host until [`GpuRank::start_device_numbering`]. Errors: the group is
    /// high-throughput, masks ranks, or has NCCL peers ([`Error::Unsupported`]).
    pub fn device_numbering(&self) -> Result<Arc<DeviceNumbering>, Error> {
        let s = &self.shared;
        if s.config.algorithm != Algorithm::LowLatency {
            return Err(Error::Unsupported("operations numbered on the device are low-latency only".into()));
        }
        if s.nccl.is_some() {
            return Err(Error::Unsupported(
                "operations numbered on the device need every peer over NVLink (this rank reaches some through NCCL)"
                    .into(),
            ));
        }
        if s.config.rank_masking {
            return Err(Error::Unsupported(
                "operations numbered on the device do not take rank masking (its rejoin numbers on the host)".into(),
            ));
        }
        let mem = StepMemory::new(s)?;
        mem.bases.write(6 * 8, &[PER_OP])?;
        Ok(Arc::new(DeviceNumbering { shared: Arc::clone(s), mem, state: Mutex::default() }))
    }

    /// Switches this rank to `dn` (once; later calls do nothing): from now on its low-latency
    /// operations are the `numbered_*` ones, counting on from the host's next numbers. Errors:
    /// `dn` is another rank's; an eager operation was started and not sent yet.
    pub fn start_device_numbering(&self, dn: &DeviceNumbering) -> Result<(), Error> {
        self.core.poison().check()?;
        let s = &self.shared;
        if !Arc::ptr_eq(&dn.shared, s) {
            return Err(Error::Unsupported("this device numbering belongs to another rank or group".into()));
        }
        let mut st = dn.state.lock().unwrap_or_else(|e| e.into_inner());
        if st.start.is_some() {
            return Ok(());
        }
        let mut start = [0; 2];
        for (i, c) in [Channel::Dispatch, Channel::Combine].into_iter().enumerate() {
            let next = self.core.peek_seq(c);
            if s.turns[c.index()].load(Ordering::Acquire) != next {
                return Err(Error::Unsupported(format!(
                    "{c} #{} was started but is not sent yet: send it before numbering on the device",
                    s.turns[c.index()].load(Ordering::Acquire)
                )));
            }
            start[i] = next;
        }
        st.start = Some(start);
        s.numbered.store(true, Ordering::Release);
        Ok(())
    }

    /// A low-latency dispatch numbered on the device, on `stream`, into the caller's `into` (as
    /// [`GpuRank::start_dispatch_into`]): both halves, or with `staged` the send half only,
    /// returned for [`GpuRank::numbered_complete`]. Capturable: nothing waits on the host. The
    /// routing is read from the `topk_idx` the handle was created from (a handle created in a
    /// stream's order over NVLink), by each run of the kernels; the counts stay on the device.
    ///
    /// # Safety
    ///
    /// As [`GpuRank::start_dispatch_into`]: `into` addresses device memory of this rank's
    /// device of the shapes [`GpuRank::dispatch_output_descs`] gives, alive while the kernels
    /// (and every replay of a graph holding them) may run.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn numbered_dispatch_into(
        &self,
        dn: &DeviceNumbering,
        h: &GpuHandle,
        inputs: DispatchInputs<'_, DeviceTensor>,
        opts: &DispatchOptions,
        into: &OutputTargets,
        stream: &CudaStream,
        staged: bool,
    ) -> Result<Option<NumberedSend>, Error> {
        let s = &self.shared;
        self.numbered_checks(dn, h)?;
        let opts = DispatchOptions { counts_location: CountsLocation::Device, ..*opts };
        let valid = validate_dispatch_inputs(&self.core.op_context(h), &opts, &inputs)?;
        for t in valid.tensors() {
            self.check_device(t, "a dispatch input")?;
        }
        let b = h.ll_stream().ok_or_else(not_stream_handle)?;
        let (Some(topk), Some(report)) = (b.topk_src, b.report.as_ref()) else { return Err(not_stream_handle()) };
        let routing = StreamRouting::Caller { topk, report: report.device_ptr(), launched: None };
        let mut st = dn.state.lock().unwrap_or_else(|e| e.into_inner());
        let offset = open_place(&st, Channel::Dispatch, staged, s.config.buffer_sets)?;
        let (mut p, _, _) = dispatch_params(s, 0, h, &valid, &opts, Some(into), Some(&routing))?;
        dn.number(&st, &mut p, Channel::Dispatch, offset)?;
        let sent = dn.launch(self, &mut st, Channel::Dispatch, p, stream, staged)?;
        st.dispatched.retain(|w| w.strong_count() > 0);
        if !st.has_dispatched(h) {
            st.dispatched.push(Arc::downgrade(&h.0));
        }
        Ok(sent)
    }

    /// A low-latency combine numbered on the device (see [`GpuRank::numbered_dispatch_into`]),
    /// into the caller's `into.tokens` `[B x H]`; it pairs with the handle's latest dispatch.
    /// Errors beside the dispatch's: no dispatch on `h` since the switch
    /// ([`ValidationError::CombineBeforeDispatch`]).
    ///
    /// # Safety
    ///
    /// As [`GpuRank::numbered_dispatch_into`], for [`GpuRank::combine_output_descs`].
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn numbered_combine_into(
        &self,
        dn: &DeviceNumbering,
        h: &GpuHandle,
        inputs: CombineInputs<'_, DeviceTensor>,
        opts: &CombineOptions,
        into: &OutputTargets,
        stream: &CudaStream,
        staged: bool,
    ) -> Result<Option<NumberedSend>, Error> {
        let s = &self.shared;
        self.numbered_checks(dn, h)?;
        let valid = validate_combine_inputs(&self.core.op_context(h), opts, &inputs)?;
        for t in valid.tensors() {
            self.check_device(t, "a combine input")?;
        }
        let mut st = dn.state.lock().unwrap_or_else(|e| e.into_inner());
        if !st.has_dispatched(h) {
            return Err(ValidationError::CombineBeforeDispatch.into());
        }
        let offset = open_place(&st, Channel::Combine, staged, s.config.buffer_sets)?;
        // Every rank numbers alike, so the pairing is the handle's latest dispatch on each.
        let stamp = Stamp::new(h.top_k(), opts.pass, Pairing::Captured(0)).with_layout(h.layout());
        let (mut p, _) = combine_params(s, 0, h, stamp, &valid, Some(into))?;
        dn.number(&st, &mut p, Channel::Combine, offset)?;
        dn.launch(self, &mut st, Channel::Combine, p, stream, staged)
    }

    /// Enqueues the receive of `send` on `stream`. Errors: `send` is not its channel's oldest
    /// open send half (nothing is enqueued; complete that one first).
    pub fn numbered_complete(
        &self,
        dn: &DeviceNumbering,
        send: &NumberedSend,
        stream: &CudaStream,
    ) -> Result<(), Error> {
        self.core.poison().check()?;
        let mut st = dn.state.lock().unwrap_or_else(|e| e.into_inner());
        let open = &mut st.open[channel_index(send.channel)];
        if open.front() != Some(&send.id) {
            return Err(Error::Unsupported(format!(
                "complete a channel's send halves in the order they were sent: an earlier {} is still open",
                send.channel
            )));
        }
        let mut p = send.p;
        // The receive runs once every earlier one of the channel moved the base past it.
        let start = st.start.ok_or_else(not_started)?[channel_index(send.channel)];
        p.seq = start;
        let which = if send.channel == Channel::Dispatch { LlKernel::DispatchRecv } else { LlKernel::CombineRecv };
        bind(&self.shared.ctx)?;
        launch_ll_kernel(&self.shared, which, p, stream)?;
        st.open[channel_index(send.channel)].pop_front();
        Ok(())
    }

    fn numbered_checks(&self, dn: &DeviceNumbering, h: &GpuHandle) -> Result<(), Error> {
        self.core.poison().check()?;
        self.core.check_handle(h)?;
        if h.is_graph_handle() {
            return Err(Error::Unsupported("a handle of captured steps serves only its step's replays".into()));
        }
        if !Arc::ptr_eq(&dn.shared, &self.shared) {
            return Err(Error::Unsupported("this device numbering belongs to another rank or group".into()));
        }
        dn.check(Some(h))
    }
}

/// A send's place among its channel's open sends (its number is the base plus it); refuses a
/// synchronous operation beside an open send, and more open sends than buffer sets.
fn open_place(st: &State, c: Channel, staged: bool, sets: usize) -> Result<u64, Error> {
    let open = st.open[channel_index(c)].len();
    if !staged && open > 0 {
        return Err(Error::Unsupported(format!(
            "a synchronous {c} while {open} send half(s) of the channel are open: complete them first (operations numbered on the device receive in order)"
        )));
    }
    if open >= sets {
        return Err(Error::Unsupported(format!(
            "{open} {c} send halves are open, as many as the group's buffer sets: complete the oldest first"
        )));
    }
    Ok(open as u64)
}

impl DeviceNumbering {
    /// Whether the rank switched to it ([`GpuRank::start_device_numbering`]).
    pub fn started(&self) -> bool {
        self.state.lock().unwrap_or_else(|e| e.into_inner()).start.is_some()
    }

    /// The send halves open on `channel`.
    pub fn open_sends(&self, channel: Channel) -> usize {
        self.state.lock().unwrap_or_else(|e| e.into_inner()).open[channel_index(channel)].len()
    }

    /// The failures the device reported so far, as the group's error (and the group poisoned):
    /// a timeout, a peer's cancellation or mismatch, and with `h` an invalid top-k entry of its
    /// routing. Reads mapped memory only: callable during a capture.
    pub fn check(&self, h: Option<&GpuHandle>) -> Result<(), Error> {
        let s = &self.shared;
        let fail = |e: Error| {
            s.poison.poison(e.to_string());
            Err(e)
        };
        if let Some(e) = s.device_error("an operation numbered on the device".into()) {
            return fail(e);
        }
        let word = self.mem.failure.read_u64(0);
        if word != 0 {
            return fail(super::failure_error(s, word, "numbered on the device", |_, _| None));
        }
        if let Some(v) = h.and_then(|h| h.ll_invalid_routing(s.config.num_experts)) {
            return fail(v.into());
        }
        Ok(())
    }

    /// Makes `p` an operation of `channel` numbered on the device at `offset` past the base.
    fn number(&self, st: &State, p: &mut LlParams, c: Channel, offset: u64) -> Result<(), Error> {
        let start = st.start.ok_or_else(not_started)?[channel_index(c)];
        p.seq = start + offset;
        p.seq_base = self.mem.bases.ptr() + 8 * channel_index(c) as u64;
        p.verdict = self.mem.failure.device_ptr();
        p.set = 0;
        p.cancelled = 0;
        Ok(())
    }

    /// Launches `p`'s kernels on `stream`: the send half only (returned, now open), or both
    /// (one cooperative kernel where the rank's captured steps use one).
    fn launch(
        &self,
        rank: &GpuRank,
        st: &mut State,
        c: Channel,
        p: LlParams,
        stream: &CudaStream,
        staged: bool,
    ) -> Result<Option<NumberedSend>, Error> {
        let s = &rank.shared;
        let (one, send, recv) = if c == Channel::Dispatch {
            (LlKernel::DispatchOne, LlKernel::DispatchSend, LlKernel::DispatchRecv)
        } else {
            (LlKernel::CombineOne, LlKernel::CombineSend, LlKernel::CombineRecv)
        };
        bind(&s.ctx)?;
        if staged {
            launch_ll_kernel(s, send, p, stream)?;
            let id = st.next_id;
            st.next_id += 1;
            st.open[channel_index(c)].push_back(id);
            return Ok(Some(NumberedSend { channel: c, p, id }));
        }
        if s.one_launch && s.config.tuning().graph_one_launch {
            launch_ll_kernel(s, one, p, stream)?;
        } else {
            launch_ll_kernel(s, send, p, stream)?;
            launch_ll_kernel(s, recv, p, stream)?;
        }
        Ok(None)
    }
}

fn not_started() -> Error {
    Error::Unsupported("this rank does not number on the device yet (GpuRank::start_device_numbering)".into())
}

fn not_stream_handle() -> Error {
    Error::Unsupported(
        "operations numbered on the device take a low-latency handle created in a stream's order (its routing read from the caller's topk_idx by each run)".into(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with_open(dispatch: usize, combine: usize) -> State {
        let mut st = State::default();
        st.open[0].extend(0..dispatch as u64);
        st.open[1].extend(0..combine as u64);
        st
    }

    #[test]
    fn a_send_takes_its_place_among_the_channels_open_sends() {
        assert_eq!(open_place(&with_open(0, 0), Channel::Dispatch, false, 2).unwrap(), 0);
        assert_eq!(open_place(&with_open(0, 0), Channel::Dispatch, true, 2).unwrap(), 0);
        assert_eq!(open_place(&with_open(1, 0), Channel::Dispatch, true, 2).unwrap(), 1);
        // The other channel's open sends do not count.
        assert_eq!(open_place(&with_open(0, 1), Channel::Dispatch, false, 2).unwrap(), 0);
        assert_eq!(open_place(&with_open(2, 1), Channel::Combine, true, 2).unwrap(), 1);
    }

    #[test]
    fn a_synchronous_operation_beside_an_open_send_and_too_many_sends_are_refused() {
        let e = open_place(&with_open(1, 0), Channel::Dispatch, false, 2).unwrap_err();
        assert!(matches!(e, Error::Unsupported(ref m) if m.contains("synchronous")), "{e:?}");
        let e = open_place(&with_open(0, 2), Channel::Combine, true, 2).unwrap_err();
        assert!(matches!(e, Error::Unsupported(ref m) if m.contains("buffer sets")), "{e:?}");
        assert_eq!(open_place(&with_open(0, 2), Channel::Combine, true, 3).unwrap(), 2);
    }
}

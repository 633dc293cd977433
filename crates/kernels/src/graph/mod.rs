//! Captured steps on GPUs: low-latency dispatches and combines (and the caller's own kernels)
//! recorded once as a CUDA graph and replayed every decode step ([`epflow_core::graph`] has the
//! contract and its rules).
//!
//! - `handle.rs`: handles of captured steps ([`GpuRank::graph_handle`]): the routing from a
//!   buffer the caller refills (each captured dispatch sanitizes it), fixed outputs, the report
//!   of invalid rows.
//! - `capture.rs`: [`GpuRank::capture`] and the [`GpuCapture`] its closure records through.
//! - `numbered.rs`: operations numbered on the device one by one ([`DeviceNumbering`]), which a
//!   caller may capture into graphs of its own (NCCL EP's C API).
//! - here: the [`GpuStep`], its launch ([`StepBackend::launch_step`]) and the [`GpuReplay`]
//!   in flight.
//!
//! ## On the device
//!
//! A captured operation's kernels take its place on its channel within the step as `seq`, and
//! the address of the channel's base in the step's device memory (`seq_base`); they add the two
//! when they start, and derive the buffer set from the sum. The last block of the step's last
//! operation adds the step's operations per channel to the bases (no node of its own). A launch
//! whose bases are not where the previous replay left them (eager operations or another step
//! took numbers in between, or it is the first) enqueues a one-thread rebase kernel before the
//! graph; replays launched back to back need nothing but `cuGraphLaunch`.

mod capture;
mod handle;
mod numbered;

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use cudarc::driver::{CudaEvent, CudaGraph, CudaStream};
use epflow_core::backend::Probe;
use epflow_core::graph::{PendingReplay, StepBackend, StepCounts};
use epflow_core::protocol::Channel;
use epflow_core::stamp::Stamp;
use epflow_core::{Error, Result};

pub use self::capture::{CapturedSend, GpuCapture};
pub(crate) use self::handle::GraphHandle;
pub use self::numbered::{DeviceNumbering, NumberedSend};
use crate::device::{DeviceBuffer, DeviceTensor, PinnedBuffer, bind, cuda, event_done};
use crate::op::in_channels_order;
use crate::params::status;
use crate::rank::GpuRank;
use crate::state::handle::GpuHandle;
use crate::state::shared::RankShared;

/// Words of a step's bases: `[dispatch, combine, replay, failed, dispatches, combines, last]`
/// (`advance_step` in `ll_receive.cuh`).
const BASES_WORDS: usize = 7;

/// A step's device state: the bases (device; see [`BASES_WORDS`]) and the failure word of its
/// operations (mapped host: the first operation a peer cancelled or mismatched,
/// `((seq + 1) << 20) | chan << 16 | mismatched << 8 | cancelled`).
#[derive(Debug)]
pub(crate) struct StepMemory {
    bases: DeviceBuffer,
    failure: PinnedBuffer,
}

impl StepMemory {
    fn new(s: &RankShared) -> Result<Self> {
        Ok(StepMemory { bases: s.local_zeroed(BASES_WORDS * 8)?, failure: PinnedBuffer::zeroed(&s.ctx, 8)? })
    }

    /// Tells the step's last operation to advance the bases after each replay: the step's
    /// operations per channel, and which operation is last (synchronous; after the capture).
    fn set_advance(&self, counts: StepCounts, last: (Channel, u64)) -> Result<()> {
        let last = ((last.0.index() as u64) << 32 | last.1) + 1;
        self.bases.write(4 * 8, &[counts.dispatches, counts.combines, last])
    }

    /// Enqueues `ep_graph_rebase` on `on`: sets the bases to `(dispatch, combine, replay)`.
    fn enqueue_rebase(&self, s: &RankShared, on: &CudaStream, (d, c, r): (u64, u64, u64)) -> Result<()> {
        let mut b = on.launch_builder(&s.functions.graph_rebase);
        let bases = self.bases.ptr();
        cudarc::driver::PushKernelArg::arg(&mut b, &bases);
        cudarc::driver::PushKernelArg::arg(&mut b, &d);
        cudarc::driver::PushKernelArg::arg(&mut b, &c);
        cudarc::driver::PushKernelArg::arg(&mut b, &r);
        let cfg = cudarc::driver::LaunchConfig { grid_dim: (1, 1, 1), block_dim: (1, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: the arguments match `ep_graph_rebase(u64, u64, u64, u64)`; `bases` holds the
        // step's words, alive as long as the step (which outlives its replays).
        unsafe { b.launch(cfg) }.map_err(|e| cuda("launch rebase", e))?;
        Ok(())
    }
}

/// One captured operation: its channel, its place there, its stamp, and its handle (index into
/// the step's handles).
#[derive(Clone, Copy, Debug)]
pub(crate) struct CapturedOp {
    channel: Channel,
    offset: u64,
    stamp: Stamp,
    handle: usize,
}

/// The CUDA graph of a step. `CudaGraph` holds raw driver handles: every use goes through the
/// step's mutex.
struct Graph(CudaGraph);

// SAFETY: a CUDA graph exec may be launched from any thread with its context bound; the step
// serializes every access (launch, destroy) behind a mutex.
unsafe impl Send for Graph {}

/// Where the step's bases were left, and how many replays were launched.
#[derive(Debug, Default)]
struct Launches {
    /// The bases after the last replay (`None`: never launched).
    next: Option<(u64, u64)>,
    replays: u64,
    last: Option<Arc<CudaEvent>>,
}

/// A captured step of one rank ([`GpuRank::capture`]): replay it with
/// [`StepBackend::launch_step`] or `epflow_async::Group::replay`. Replays run on the capture
/// stream, one after another; order the refills of its inputs and the reads of its outputs
/// against that stream. Dropping the step waits for its last replay to finish on the device.
pub struct GpuStep {
    shared: Arc<RankShared>,
    id: u64,
    stream: Arc<CudaStream>,
    graph: Mutex<Graph>,
    mem: Arc<StepMemory>,
    counts: StepCounts,
    ops: Arc<[CapturedOp]>,
    handles: Arc<[GpuHandle]>,
    _keep: Vec<DeviceTensor>,
    launches: Mutex<Launches>,
    /// Whether the step holds a one-launch (cooperative) kernel: its replays then keep to their
    /// channels' one-launch order.
    one_launched: bool,
    /// The rank's peers generation at capture (`RankShared::peers_generation`): the step's
    /// kernels hold the peers' addresses of that time.
    peers_generation: u64,
}

impl std::fmt::Debug for GpuStep {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuStep")
            .field("id", &self.id)
            .field("rank", &self.shared.rank)
            .field("dispatches", &self.counts.dispatches)
            .field("combines", &self.counts.combines)
            .finish()
    }
}

impl GpuStep {
    /// The step a finished capture recorded as `graph`.
    fn new(cap: GpuCapture<'_>, graph: CudaGraph) -> Self {
        GpuStep {
            shared: Arc::clone(&cap.rank.shared),
            id: cap.step,
            stream: cap.stream,
            graph: Mutex::new(Graph(graph)),
            mem: cap.mem,
            counts: cap.counts,
            ops: cap.ops.into(),
            handles: cap.handles.into(),
            _keep: cap.keep,
            launches: Mutex::default(),
            one_launched: cap.one_launched,
            peers_generation: cap.rank.shared.peers_generation.load(Ordering::Acquire),
        }
    }

    /// The step's number in this process.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// Its low-latency dispatches and combines per replay.
    pub fn counts(&self) -> StepCounts {
        self.counts
    }

    /// Replays launched so far.
    pub fn replays(&self) -> u64 {
        self.launches.lock().unwrap_or_else(|e| e.into_inner()).replays
    }
}

impl Drop for GpuStep {
    fn drop(&mut self) {
        let last = self.launches.lock().unwrap_or_else(|e| e.into_inner()).last.take();
        if let Some(e) = last {
            // The graph and its memory must outlive the replays on the device (whose waits all
            // have deadlines).
            if bind(&self.shared.ctx).is_ok() {
                let _ = e.synchronize();
            }
        }
    }
}

/// One replay in flight ([`StepBackend::launch_step`]).
pub struct GpuReplay {
    shared: Arc<RankShared>,
    event: Arc<CudaEvent>,
    mem: Arc<StepMemory>,
    ops: Arc<[CapturedOp]>,
    handles: Arc<[GpuHandle]>,
    step: u64,
    replay: u64,
    bases: (u64, u64),
}

impl std::fmt::Debug for GpuReplay {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.label())
    }
}

impl GpuReplay {
    /// The error of a failure word of the step's operations (a peer cancelled or mismatched).
    fn failure(&self, word: u64) -> Error {
        let label = format!("{} of step {}", self.label(), self.step);
        failure_error(&self.shared, word, &label, |channel, seq| {
            let base = if channel == Channel::Dispatch { self.bases.0 } else { self.bases.1 };
            self.ops.iter().find(|o| o.channel == channel && base + o.offset == seq).map(|o| o.stamp)
        })
    }
}

/// The error of a failure word of operations numbered on the device, captured in a step or
/// numbered one by one (`report_failure` in `ll_receive.cuh`: the first operation a peer
/// cancelled or mismatched). `label` says where the operation ran; `ours` gives this rank's
/// stamp of the operation (channel, number), when known.
pub(super) fn failure_error(
    s: &RankShared,
    word: u64,
    label: &str,
    ours: impl FnOnce(Channel, u64) -> Option<Stamp>,
) -> Error {
    let (seq, chan) = ((word >> 20).wrapping_sub(1), ((word >> 16) & 0xf) as usize);
    let (mismatched, cancelled) = ((word >> 8) & 0xff, word & 0xff);
    let channel = if chan == 0 { Channel::Dispatch } else { Channel::Combine };
    let op = format!("{channel} #{seq} ({label})");
    if cancelled != 0 {
        return Error::PeerCancelled { op, peer: cancelled.trailing_zeros() as usize };
    }
    let ours = ours(channel, seq).unwrap_or_else(|| Stamp::decode(0));
    let set = (seq % s.config.buffer_sets as u64) as usize;
    let theirs = Stamp::decode(s.mem.status.read_u64(status::stamp(chan, set)));
    Error::PeerMismatch { op, peer: mismatched.trailing_zeros() as usize, ours, theirs }
}

impl PendingReplay for GpuReplay {
    fn probe(&self) -> Box<dyn Probe> {
        let (ctx, event) = (Arc::clone(&self.shared.ctx), Arc::clone(&self.event));
        Box::new(move || event_done(&ctx, &event))
    }

    fn finish(self) -> Result<()> {
        let s = &self.shared;
        if let Some(e) = s.device_error(self.label()) {
            s.poison.poison(e.to_string());
            return Err(e);
        }
        let word = self.mem.failure.read_u64(0);
        if word != 0 {
            let e = self.failure(word);
            s.poison.poison(format!("{e} (captured work after it read its outputs)"));
            return Err(e);
        }
        for h in self.handles.iter() {
            if let Some(g) = h.graph() {
                if let Some(v) = g.invalid_entry(self.replay, s.config.num_experts) {
                    return Err(v.into());
                }
            }
        }
        Ok(())
    }

    fn label(&self) -> String {
        format!("replay {} of step {}", self.replay, self.step)
    }
}

impl StepBackend for GpuRank {
    type Step = GpuStep;
    type Replay = GpuReplay;

    fn launch_step(&self, step: &GpuStep) -> Result<GpuReplay> {
        self.core.poison().check()?;
        self.refuse_if_numbered()?;
        let s = &self.shared;
        if !Arc::ptr_eq(&step.shared, s) {
            return Err(Error::Unsupported(format!("step {} was captured by another rank or group", step.id)));
        }
        if step.peers_generation != s.peers_generation.load(Ordering::Acquire) {
            return Err(Error::Unsupported(format!(
                "step {} was captured before a rank of the group was replaced (a rejoin): its kernels hold the replaced rank's addresses; capture it again",
                step.id
            )));
        }
        let n = [step.counts.dispatches, step.counts.combines];
        let channels = [Channel::Dispatch, Channel::Combine];
        for (c, &count) in channels.iter().zip(&n) {
            let next = self.core.peek_seq(*c);
            let sent = s.turns[c.index()].load(Ordering::Acquire);
            if count > 0 && sent != next {
                return Err(Error::Unsupported(format!(
                    "{c} #{sent} was started before this replay but is not sent yet: await (or send) it first"
                )));
            }
        }
        let mut launches = step.launches.lock().unwrap_or_else(|e| e.into_inner());
        let graph = step.graph.lock().unwrap_or_else(|e| e.into_inner());
        let bases = (self.core.take_seqs(Channel::Dispatch, n[0]), self.core.take_seqs(Channel::Combine, n[1]));
        let replay = launches.replays;
        // A replay holding a one-launch kernel follows each channel's last one-launch (or
        // high-throughput) kernel on the device, and becomes it (`RankShared::last_launch`): a
        // one-launch grid of a channel never overlaps another of that channel, whatever streams
        // they run on. A replay of send and receive halves only (as staged eager operations)
        // overlaps them, and the replays of other steps (the lanes of a pipeline).
        let used: Vec<usize> =
            channels.iter().zip(&n).filter(|&(_, &count)| count > 0).map(|(c, _)| c.index()).collect();
        let launch = || {
            if launches.next != Some(bases) {
                step.mem.enqueue_rebase(s, &step.stream, (bases.0, bases.1, replay))?;
            }
            graph.0.launch().map_err(|e| cuda("launch the step", e))?;
            s.events.record(&step.stream).map_err(|e| cuda("record the replay", e))
        };
        let launched = bind(&s.ctx).and_then(|()| {
            if step.one_launched {
                in_channels_order(s, &used, &step.stream, "order after the channel's last one-launch kernel", launch)
            } else {
                launch()
            }
        });
        // The numbers are taken: the turns pass on even if the launch failed (the group is
        // poisoned then, and later operations must not wait for these).
        for (c, &count) in channels.iter().zip(&n) {
            let base = if *c == Channel::Dispatch { bases.0 } else { bases.1 };
            if count > 0 {
                s.turns[c.index()].store(base + count, Ordering::Release);
            }
        }
        let event = match launched {
            Ok(e) => e,
            Err(e) => {
                s.poison.poison(format!("replay {replay} of step {} failed to launch: {e}", step.id));
                return Err(e);
            }
        };
        launches.next = Some((bases.0 + n[0], bases.1 + n[1]));
        launches.replays += 1;
        launches.last = Some(Arc::clone(&event));
        Ok(GpuReplay {
            shared: Arc::clone(s),
            event,
            mem: Arc::clone(&step.mem),
            ops: Arc::clone(&step.ops),
            handles: Arc::clone(&step.handles),
            step: step.id,
            replay,
            bases,
        })
    }
}

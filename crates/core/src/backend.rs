//! What a backend implements so that a driver — the blocking loop here, or the async reactor of
//! `epflow-async` — can run its operations.
//!
//! Every operation is a [`PendingOp`]: a small state machine whose steps never block. A driver
//! runs it as: take the slot (if [`PendingOp::needs_slot`]) → wait for
//! [`PendingOp::poll_send_ready`] → [`PendingOp::send`] → [`PendingOp::start_complete`] → wait for
//! [`PendingOp::poll_complete`] → [`PendingOp::finish`]. Every wait is bounded by the group's
//! timeout; on expiry the driver poisons the group.
//!
//! If the caller abandons an operation before its send, the driver calls [`PendingOp::cancel`] and
//! still runs it to the end: the peers receive a cancellation marker instead of data (their
//! operation fails with [`Error::PeerCancelled`]) and this rank still consumes what the peers
//! sent, so every rank's next operation finds clean buffers.
//!
//! ## Stream-ordered completion
//!
//! Instead of waiting for the complete half on the host, a driver may call
//! [`PendingOp::complete_on`] with a caller's stream ([`Backend::Stream`]): the complete half is
//! ordered before everything enqueued on that stream afterwards ([`StreamOrder`] says where it
//! runs) and the outputs come back at once, ready in the stream's order. The operation's verdict
//! (a peer's cancellation or mismatch, a device timeout) is known only once its
//! [`PendingOp::complete_probe`] turns ready: [`PendingOp::verdict`]. A backend that completes on
//! the host (the host backend) returns no outputs until the operation is complete.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::config::GroupConfig;
use crate::error::{Error, Result};
use crate::handle::{HandleCore, RoutingHandle};
use crate::mask::{MaskedRanks, RankSet};
use crate::ops::{CombineInputs, CombineOptions, DispatchInputs, DispatchOptions, HandleOptions, TensorView};
use crate::protocol::{Channel, Poison, SlotGuard, SlotPool, deadline_after, op_label, wait_until};
use crate::validate::OpContext;

/// A cheap, thread-safe readiness check that a reactor thread can poll without owning the
/// operation. `true` means "worth polling the operation again": the condition holds, or the
/// operation has an error to report.
pub trait Probe: Send + Sync + 'static {
    /// Non-blocking readiness check.
    fn ready(&self) -> bool;
}

impl<F: Fn() -> bool + Send + Sync + 'static> Probe for F {
    fn ready(&self) -> bool {
        self()
    }
}

/// Which collective an operation is on which rank: every rank numbers the operations of each
/// channel alike, so `(channel, seq)` names the same collective everywhere.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct OpId {
    /// The rank running it.
    pub rank: usize,
    /// Its channel.
    pub channel: Channel,
    /// Its sequence number on the channel.
    pub seq: u64,
}

/// The lifecycle flags of an operation, the same for every backend: whether its send half went
/// out, whether it became a cancellation, and the buffer set it holds from its send until its
/// outputs are made.
#[derive(Debug, Default)]
pub struct OpState {
    sent: bool,
    cancelled: bool,
    slot: Option<SlotGuard>,
}

impl OpState {
    /// Whether the send half went out.
    pub fn is_sent(&self) -> bool {
        self.sent
    }

    /// Whether the operation is a cancellation (it sends, or sent, no data).
    pub fn is_cancelled(&self) -> bool {
        self.cancelled
    }

    /// Turns a not-yet-sent operation into a cancellation. Returns `true` if it did (the
    /// operation no longer reads its inputs); `false` once sent.
    pub fn cancel(&mut self) -> bool {
        if self.sent {
            return false;
        }
        self.cancelled = true;
        true
    }

    /// The send half went out; the operation holds `slot` (its buffer set) from now on.
    pub fn mark_sent(&mut self, slot: Option<SlotGuard>) {
        self.sent = true;
        self.slot = slot;
    }

    /// The held buffer set's index.
    pub fn slot_set(&self) -> Option<usize> {
        self.slot.as_ref().map(SlotGuard::set)
    }

    /// Hands the held buffer set to the outputs.
    pub fn take_slot(&mut self) -> Option<SlotGuard> {
        self.slot.take()
    }

    /// The fences the held set's previous holders left (see [`crate::protocol`]).
    pub fn take_fences(&mut self) -> Vec<crate::protocol::Fence> {
        self.slot.as_mut().map(SlotGuard::take_fences).unwrap_or_default()
    }
}

/// Where a stream-ordered complete half runs ([`PendingOp::complete_on`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum StreamOrder {
    /// On the caller's stream, after the work already enqueued there (DeepEP's receive hook): a
    /// receive that would wait for data does not hold SMs while the caller's earlier work (another
    /// micro-batch's experts, say) runs.
    #[default]
    OnStream,
    /// On the operation's own stream at once; the caller's stream waits for it. The receive may
    /// run (and wait) concurrently with the caller's earlier work.
    Ordered,
}

/// One operation of one rank, from creation to result. No method blocks.
pub trait PendingOp: Send + 'static {
    /// What the operation produces.
    type Output: Send + 'static;
    /// The streams stream-ordered completion orders against ([`Backend::Stream`]).
    type Stream: Send + Sync + 'static;

    /// Which collective it is, on which rank.
    fn id(&self) -> OpId;
    /// The rank running it.
    fn rank(&self) -> usize {
        self.id().rank
    }
    /// Its channel.
    fn channel(&self) -> Channel {
        self.id().channel
    }
    /// Its sequence number on the channel.
    fn seq(&self) -> u64 {
        self.id().seq
    }
    /// Whether its outputs live in a buffer set of the channel's [`SlotPool`].
    fn needs_slot(&self) -> bool;
    /// Whether the send half may be issued now (the receivers' credits). GPU backends check
    /// credits on the device and return `true`.
    fn poll_send_ready(&mut self) -> Result<bool>;
    /// Issues the send half. `slot` is the held buffer set when [`PendingOp::needs_slot`].
    fn send(&mut self, slot: Option<SlotGuard>) -> Result<()>;
    /// Whether [`PendingOp::send`] has run.
    fn is_sent(&self) -> bool;
    /// Turns a not-yet-sent operation into a cancellation: its inputs are no longer read and
    /// [`PendingOp::send`] sends a cancellation marker instead of data.
    fn cancel(&mut self);
    /// Says, before [`PendingOp::send`], that the complete half will start right after the send
    /// half, on the same stream, with no work of the caller's between them: the synchronous
    /// form, and a whole operation completed in stream order ([`complete_on_blocking`] on an
    /// operation not yet sent). A backend may then run both halves as one unit (the GPU backend:
    /// one kernel launch instead of two). [`PendingOp::start_complete`] (or
    /// [`PendingOp::complete_on`]) must still be called. The default ignores it.
    fn will_complete_at_once(&mut self) {}
    /// Starts the complete half (a GPU backend launches its receive kernel here). Calling it
    /// again does nothing.
    fn start_complete(&mut self) -> Result<()>;
    /// Whether the complete half has finished (data arrived, device work done).
    fn poll_complete(&mut self) -> Result<bool>;
    /// Produces the outputs. Call once [`PendingOp::poll_complete`] returned `true`.
    fn finish(self) -> Result<Self::Output>;
    /// Orders the send half after the work enqueued on `stream` so far (on the device: a GPU
    /// backend makes its stream wait for an event recorded there now; the host backend runs in
    /// program order and needs nothing). Call before [`PendingOp::send`].
    fn order_after(&mut self, stream: &Self::Stream) -> Result<()> {
        let _ = stream;
        Ok(())
    }
    /// Stream-ordered completion, after the send half (see the module docs): orders the complete
    /// half before the work enqueued on `stream` from now on and returns the outputs, valid in
    /// that order (`Ok(Some)`), without waiting for the device. `Ok(None)`: not yet (a backend
    /// that completes on the host; call again once [`PendingOp::complete_probe`] is ready). The
    /// default refuses.
    fn complete_on(&mut self, stream: &Self::Stream, order: StreamOrder) -> Result<Option<Self::Output>> {
        let _ = (stream, order);
        Err(Error::Unsupported(format!("{} cannot complete in stream order on this backend", self.label())))
    }
    /// After [`PendingOp::complete_on`] returned the outputs and [`PendingOp::complete_probe`]
    /// turned ready: what the device reported (the error [`PendingOp::finish`] would have
    /// returned), `Ok` if nothing went wrong.
    fn verdict(&mut self) -> Result<()> {
        Ok(())
    }
    /// A probe that turns true when [`PendingOp::poll_send_ready`] may return `true`.
    fn send_probe(&self) -> Box<dyn Probe>;
    /// A probe that turns true when [`PendingOp::poll_complete`] may return `true` (valid after
    /// [`PendingOp::start_complete`]).
    fn complete_probe(&self) -> Box<dyn Probe>;
    /// Bytes this rank's send half moves (for traces), and the tokens it carries.
    fn traffic(&self) -> (u64, u64) {
        (0, 0)
    }
    /// What the operation is waiting for, for timeout errors (e.g. `"data from ranks [3]"`).
    fn waiting_for(&self) -> String;
    /// A wait of this operation ran past the group's timeout. In a group with
    /// [`GroupConfig::rank_masking`], a backend whose driver detects dead ranks (the host
    /// backend) masks the ranks the operation waits for and returns `true`: the driver then
    /// waits again, and the operation completes without them. It also returns `true` when
    /// nothing is missing any more (it came, or the group masked the missing ranks or this
    /// rank after the wait's last look): the next check is then ready. `false` (the default, and GPU
    /// operations, whose kernels mask at their own deadline): the wait fails with
    /// [`Error::Timeout`].
    fn mask_missing(&mut self) -> Result<bool> {
        Ok(false)
    }
    /// A label like `"dispatch #3"`.
    fn label(&self) -> String {
        op_label(self.channel(), self.seq())
    }
}

/// The result of an operation: a handle, dispatch outputs or combine outputs.
#[derive(Debug)]
pub enum OpOutput<H, D, C> {
    /// From handle creation.
    Handle(H),
    /// From dispatch.
    Dispatch(D),
    /// From combine.
    Combine(C),
    /// From an operation that was cancelled before its send.
    Cancelled,
}

/// How a handle comes to be.
#[derive(Debug)]
pub enum HandleCreation<H, O> {
    /// Built locally, no communication (low-latency).
    Ready(H),
    /// A collective operation that exchanges counts (high-throughput).
    Collective(O),
}

/// What every backend's rank holds for the protocol: its place in the group, the config, the
/// poison flag, the buffer-set slots and the next sequence number of each channel.
#[derive(Debug)]
pub struct RankCore {
    rank: usize,
    num_ranks: usize,
    group_id: u64,
    config: GroupConfig,
    poison: Arc<Poison>,
    slots: [Arc<SlotPool>; 3],
    seqs: [AtomicU64; 3],
    mask_epoch: AtomicU64,
}

impl RankCore {
    /// Rank `rank` of `num_ranks` in group `group_id` (unique in the process), with `config`.
    pub fn new(rank: usize, num_ranks: usize, group_id: u64, config: GroupConfig) -> Self {
        let slots = Channel::ALL.map(|c| SlotPool::new(c, config.buffer_sets));
        RankCore {
            rank,
            num_ranks,
            group_id,
            config,
            poison: Arc::default(),
            slots,
            seqs: Default::default(),
            mask_epoch: AtomicU64::new(0),
        }
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Ranks in the group.
    pub fn num_ranks(&self) -> usize {
        self.num_ranks
    }

    /// The group's id (handles carry it).
    pub fn group_id(&self) -> u64 {
        self.group_id
    }

    /// The group config.
    pub fn config(&self) -> &GroupConfig {
        &self.config
    }

    /// The poison flag.
    pub fn poison(&self) -> &Arc<Poison> {
        &self.poison
    }

    /// The slots of `channel`.
    pub fn slot_pool(&self, channel: Channel) -> &Arc<SlotPool> {
        &self.slots[channel.index()]
    }

    /// Takes the next sequence number of `channel` (the collective's number on every rank).
    pub fn next_seq(&self, channel: Channel) -> u64 {
        self.seqs[channel.index()].fetch_add(1, Ordering::Relaxed)
    }

    /// Takes the next `n` sequence numbers of `channel` at once (a captured step's replay);
    /// returns the first.
    pub fn take_seqs(&self, channel: Channel, n: u64) -> u64 {
        self.seqs[channel.index()].fetch_add(n, Ordering::Relaxed)
    }

    /// The sequence number the next operation of `channel` will take.
    pub fn peek_seq(&self, channel: Channel) -> u64 {
        self.seqs[channel.index()].load(Ordering::Relaxed)
    }

    /// Moves every channel's next sequence number to `next` (`unmask_all`, with no operation in
    /// flight: the numbers every rank agreed on), and starts the next mask epoch.
    pub fn rejoin_at(&self, next: [u64; 3]) {
        for (s, n) in self.seqs.iter().zip(next) {
            s.store(n, Ordering::Relaxed);
        }
        self.mask_epoch.fetch_add(1, Ordering::AcqRel);
    }

    /// Starts a replacement rank at the group's mask `epoch` ([`crate::mask`], "Rejoining"):
    /// before its first admission, which moves every participant to the next epoch.
    pub fn set_mask_epoch(&self, epoch: u64) {
        self.mask_epoch.store(epoch, Ordering::Release);
    }

    /// The number of completed `unmask_all` calls ([`crate::mask`]).
    pub fn mask_epoch(&self) -> u64 {
        self.mask_epoch.load(Ordering::Acquire)
    }

    /// Records on `handle` that a dispatch starts in this mask epoch (see
    /// [`RankCore::check_mask_epoch`]).
    pub fn note_dispatch_epoch(&self, handle: &HandleCore) {
        handle.record_mask_epoch(self.mask_epoch());
    }

    /// Refuses a combine on `handle` if its last dispatch started before the last
    /// `unmask_all`: ranks that rejoined do not hold that dispatch ([`Error::StaleMaskEpoch`]).
    pub fn check_mask_epoch(&self, handle: &HandleCore, op: impl FnOnce() -> String) -> Result<()> {
        let now = self.mask_epoch();
        match handle.mask_epoch() {
            Some(dispatched) if dispatched != now => Err(Error::StaleMaskEpoch { op: op(), dispatched, now }),
            _ => Ok(()),
        }
    }

    /// Fails fast if the group is poisoned, or if `handle` belongs to another group.
    pub fn check_handle(&self, handle: &impl RoutingHandle) -> Result<()> {
        self.poison.check()?;
        handle.core().check_group(self.group_id)?;
        Ok(())
    }

    /// The sizes an operation on `handle` is checked against.
    pub fn op_context(&self, handle: &impl RoutingHandle) -> OpContext<'_> {
        OpContext::new(&self.config, self.num_ranks, handle)
    }
}

/// One rank of a group on some backend.
pub trait Backend: Send + Sync + 'static {
    /// The tensor type of inputs. epflow-async moves a clone of a handle's `topk_idx` to the
    /// thread that runs [`Backend::start_handle`], hence `Clone + Send + 'static`.
    type Tensor: TensorView + Clone + Send + 'static;
    /// A routing handle (cheap to clone).
    type Handle: RoutingHandle;
    /// Dispatch outputs (hold their buffer set until dropped).
    type DispatchOutput: Send + 'static;
    /// Combine outputs (hold their buffer set until dropped).
    type CombineOutput: Send + 'static;
    /// An operation in flight.
    type Op: PendingOp<Output = OpOutput<Self::Handle, Self::DispatchOutput, Self::CombineOutput>, Stream = Self::Stream>;
    /// The streams a caller orders its own work on, for stream-ordered completion (a CUDA stream
    /// on GPU backends; [`crate::host::HostStream`] on the host backend).
    type Stream: Send + Sync + 'static;

    /// The protocol state every backend shares.
    fn core(&self) -> &RankCore;
    /// This rank.
    fn rank(&self) -> usize {
        self.core().rank()
    }
    /// Ranks in the group.
    fn num_ranks(&self) -> usize {
        self.core().num_ranks()
    }
    /// The group config.
    fn config(&self) -> &GroupConfig {
        self.core().config()
    }
    /// The group's poison flag.
    fn poison(&self) -> &Arc<Poison> {
        self.core().poison()
    }
    /// The slots of a channel.
    fn slot_pool(&self, channel: Channel) -> &Arc<SlotPool> {
        self.core().slot_pool(channel)
    }
    /// This rank's view of the group's mask ([`crate::mask`]): empty, epoch 0, in a group
    /// without [`GroupConfig::rank_masking`].
    fn masked_ranks(&self) -> MaskedRanks {
        MaskedRanks { ranks: RankSet::new(), epoch: self.core().mask_epoch() }
    }
    /// Masks `ranks` on every rank, as a timeout would (an application's decision, e.g. from a
    /// health check): later operations skip them. Any rank may call it, alone; it returns once
    /// the bits are in every rank's word. Groups without rank masking refuse it; a rank outside
    /// the group is [`Error::RankOutOfRange`] (nothing is masked).
    fn mask_ranks(&self, ranks: &RankSet) -> Result<()> {
        let _ = ranks;
        Err(Error::Unsupported("mask_ranks needs a group with rank_masking".into()))
    }
    /// Clears the mask of every rank: a collective of every rank, the masked ones included,
    /// with no operation in flight on any of them ([`crate::mask`], "Recovery"). Blocks until
    /// every rank has arrived, or fails with [`Error::Timeout`] after the group's timeout.
    fn unmask_all(&self) -> Result<()> {
        Err(Error::Unsupported("unmask_all needs a group with rank_masking".into()))
    }
    /// A survivor's side of admitting replacements for the masked `ranks` ([`crate::mask`],
    /// "Rejoining"): a meeting of every unmasked rank and the replacements, with no operation in
    /// flight, within `timeout`. Every survivor calls it with the same `ranks`; each
    /// replacement calls [`Backend::rejoin`].
    fn admit(&self, ranks: &RankSet, timeout: Duration) -> Result<()> {
        let _ = (ranks, timeout);
        Err(Error::Unsupported("admitting a replacement rank is not supported by this backend yet".into()))
    }
    /// A replacement's side of [`Backend::admit`]: joins the survivors' meeting within
    /// `timeout`; afterwards the rank is a full member of the group.
    fn rejoin(&self, timeout: Duration) -> Result<()> {
        let _ = timeout;
        Err(Error::Unsupported("rejoining a running group is not supported by this backend yet".into()))
    }
    /// Validates `topk_idx` and creates a handle (collective for high-throughput).
    ///
    /// A high-throughput rank whose arguments fail validation still takes part in the
    /// collective, as a cancellation (its peers get [`Error::PeerCancelled`] at once instead of
    /// waiting for their timeout); so do dispatch and combine.
    ///
    /// `opts` chooses the handle's low-latency receive layout ([`crate::ops::Layout`]);
    /// [`crate::validate::validate_handle_options`] refuses what the group cannot do.
    fn start_handle(
        &self,
        topk_idx: &Self::Tensor,
        opts: &HandleOptions,
    ) -> Result<HandleCreation<Self::Handle, Self::Op>>;
    /// [`Backend::start_handle`] for a handle created in `stream`'s order: a backend that builds
    /// low-latency handles on its device may return [`HandleCreation::Ready`] at once, without
    /// the host waiting, and read `topk_idx` in `stream`'s order (in work it enqueues there, or
    /// in the handle's dispatches, ordered after `stream`'s work so far: the caller keeps
    /// `topk_idx` unchanged until they ran); an invalid `topk_idx` entry then becomes the error
    /// of this rank's dispatches on the handle (their verdicts) instead of this call's. The
    /// default is [`Backend::start_handle`].
    fn start_handle_on(
        &self,
        topk_idx: &Self::Tensor,
        opts: &HandleOptions,
        stream: &Self::Stream,
    ) -> Result<HandleCreation<Self::Handle, Self::Op>> {
        let _ = stream;
        self.start_handle(topk_idx, opts)
    }
    /// Validates and creates a dispatch (collective). Takes its sequence number now.
    fn start_dispatch(
        &self,
        handle: &Self::Handle,
        inputs: DispatchInputs<'_, Self::Tensor>,
        opts: &DispatchOptions,
    ) -> Result<Self::Op>;
    /// Validates and creates a combine (collective). Takes its sequence number now.
    fn start_combine(
        &self,
        handle: &Self::Handle,
        inputs: CombineInputs<'_, Self::Tensor>,
        opts: &CombineOptions,
    ) -> Result<Self::Op>;
}

/// The text of a caught panic payload.
pub fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "a panic with a non-text payload".to_string()
    }
}

/// Runs `f`, turning a panic into [`Error::Internal`] (about `op`) and poisoning the group: a
/// backend bug must fail its operation, not unwind through the caller or the reactor.
pub fn guarded<T>(poison: &Poison, op: impl FnOnce() -> String, f: impl FnOnce() -> Result<T>) -> Result<T> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(p) => {
            let e = Error::Internal { op: op(), message: panic_message(&*p) };
            poison.poison(e.to_string());
            Err(e)
        }
    }
}

fn timeout_error<O: PendingOp>(op: &O, after: Duration) -> Error {
    Error::Timeout { op: op.label(), rank: op.rank(), waiting_for: op.waiting_for(), after }
}

/// Waits (bounded by `timeout`) until `ready(op)`. At the deadline the operation may mask the
/// ranks it waits for ([`PendingOp::mask_missing`], rank masking): then it waits again, with a
/// fresh deadline (each `true` masked a rank that was not masked before, or found nothing
/// missing, which makes the next check ready: so this ends).
/// `Ok(false)`: timed out.
pub fn wait_masking<O: PendingOp>(
    op: &mut O,
    timeout: Duration,
    mut ready: impl FnMut(&mut O) -> Result<bool>,
) -> Result<bool> {
    loop {
        let deadline = deadline_after(Instant::now(), timeout);
        if wait_until(deadline, || ready(op))? {
            return Ok(true);
        }
        if !op.mask_missing()? {
            return Ok(false);
        }
    }
}

/// Blocking send half: takes the slot, waits for credits (bounded by `timeout`), sends, and
/// returns the operation ready for [`complete_blocking`].
///
/// When every buffer set is still held by earlier outputs it fails fast with
/// [`Error::SlotsBusy`]; the operation is then cancelled and run to its end on a background
/// thread, so the peers see a cancellation instead of waiting for data that never comes.
pub fn send_blocking<O: PendingOp>(
    mut op: O,
    slots: &Arc<SlotPool>,
    poison: &Arc<Poison>,
    timeout: Duration,
) -> Result<O> {
    poison.check()?;
    let slot = if op.needs_slot() {
        match slots.try_acquire(op.seq()) {
            Some(slot) => Some(slot),
            None => {
                op.cancel();
                detach(op, timeout, Arc::clone(poison));
                return Err(Error::SlotsBusy { channel: slots.channel().name(), buffer_sets: slots.sets() });
            }
        }
    } else {
        None
    };
    // The label is formatted only if a panic needs it (this path runs for every operation).
    let (channel, seq) = (op.channel(), op.seq());
    let label = || op_label(channel, seq);
    let ready = poison.track(guarded(poison, label, || wait_masking(&mut op, timeout, O::poll_send_ready)))?;
    if !ready {
        return poison.track(Err(timeout_error(&op, timeout)));
    }
    poison.track(guarded(poison, label, || op.send(slot)))?;
    Ok(op)
}

/// Blocking complete half: starts it, waits (bounded by `timeout`), finishes.
pub fn complete_blocking<O: PendingOp>(mut op: O, poison: &Poison, timeout: Duration) -> Result<O::Output> {
    let (channel, seq) = (op.channel(), op.seq());
    let label = || op_label(channel, seq);
    poison.track(guarded(poison, label, || op.start_complete()))?;
    let done = poison.track(guarded(poison, label, || wait_masking(&mut op, timeout, O::poll_complete)))?;
    if !done {
        return poison.track(Err(timeout_error(&op, timeout)));
    }
    poison.track(guarded(poison, label, || op.finish()))
}

/// Runs an operation to its result, blocking.
pub fn run_blocking<O: PendingOp>(
    mut op: O,
    slots: &Arc<SlotPool>,
    poison: &Arc<Poison>,
    timeout: Duration,
) -> Result<O::Output> {
    op.will_complete_at_once();
    let op = send_blocking(op, slots, poison, timeout)?;
    complete_blocking(op, poison, timeout)
}

/// Runs the rest of an abandoned operation on a background thread, dropping its outputs: the
/// send half if it has not been sent (as a cancellation, so call [`PendingOp::cancel`] first),
/// then the complete half. Each wait is bounded by `timeout`. If it cannot finish (a timeout, an
/// error, a panic), `poison` is poisoned with the reason: its peers may be left waiting for it.
pub fn detach<O: PendingOp>(op: O, timeout: Duration, poison: Arc<Poison>) {
    let label = op.label();
    let p = Arc::clone(&poison);
    let spawned = std::thread::Builder::new().name("epflow-detached".into()).spawn(move || {
        let label = op.label();
        let run = catch_unwind(AssertUnwindSafe(move || finish_abandoned(op, timeout)));
        let failure = match run {
            Ok(Ok(())) => return,
            Ok(Err(e)) => e.to_string(),
            Err(payload) => format!("internal error: {}", panic_message(&*payload)),
        };
        p.poison(format!("abandoned {label} could not finish: {failure}"));
    });
    if let Err(e) = spawned {
        poison.poison(format!("abandoned {label} could not be finished: no thread for it ({e})"));
    }
}

fn finish_abandoned<O: PendingOp>(mut op: O, timeout: Duration) -> Result<()> {
    if !op.is_sent() {
        if !wait_masking(&mut op, timeout, O::poll_send_ready)? {
            return Err(timeout_error(&op, timeout));
        }
        op.send(None)?;
    }
    // Its outputs are dropped: only a failure that leaves the protocol unknown matters (a
    // peer's cancellation or mismatch was handled cleanly).
    match complete_blocking(op, &Poison::default(), timeout) {
        Err(e) if e.poisons() => Err(e),
        _ => Ok(()),
    }
}

/// An operation whose outputs were handed out in stream order ([`complete_on_blocking`]): the
/// blocking counterpart of the async `Completion`. [`InStreamOrder::settle`] waits for the
/// device and returns the verdict; dropping it unsettled detaches the wait (a failure still
/// poisons the group).
pub struct InStreamOrder<O: PendingOp> {
    op: Option<O>,
    poison: Arc<Poison>,
    timeout: Duration,
}

impl<O: PendingOp> InStreamOrder<O> {
    /// Waits (bounded by the group's timeout) until the device has finished the operation, and
    /// returns its verdict. A failure poisons the group: work enqueued on the outputs read bad
    /// data.
    pub fn settle(mut self) -> Result<()> {
        let Some(mut op) = self.op.take() else { return Ok(()) };
        let result = settle_op(&mut op, self.timeout);
        if let Err(e) = &result {
            self.poison.poison(format!(
                "{}, completed in stream order, failed after its outputs were handed out: {e}",
                op.label()
            ));
        }
        result
    }
}

fn settle_op<O: PendingOp>(op: &mut O, timeout: Duration) -> Result<()> {
    let probe = op.complete_probe();
    if !wait_until(deadline_after(Instant::now(), timeout), || Ok(probe.ready()))? {
        return Err(timeout_error(op, timeout));
    }
    if !op.poll_complete()? {
        return Err(Error::Backend(format!("{}: completion probe ready, operation not complete", op.label())));
    }
    op.verdict()
}

impl<O: PendingOp> Drop for InStreamOrder<O> {
    fn drop(&mut self) {
        let Some(mut op) = self.op.take() else { return };
        let (poison, timeout) = (Arc::clone(&self.poison), self.timeout);
        let label = op.label();
        // The outputs are out: only the verdict is left, on a thread (never block a drop).
        let spawned = std::thread::Builder::new().name("epflow-settle".into()).spawn(move || {
            if let Err(e) = settle_op(&mut op, timeout) {
                poison.poison(format!("{label}, completed in stream order, failed: {e}"));
            }
        });
        if spawned.is_err() {
            self.poison.poison("no thread to settle an operation completed in stream order".to_string());
        }
    }
}

impl<O: PendingOp> std::fmt::Debug for InStreamOrder<O> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InStreamOrder").field("op", &self.op.as_ref().map(PendingOp::label)).finish()
    }
}

/// Blocking stream-ordered completion, as the async `complete_on` futures do: orders the
/// operation after the work enqueued on `stream` so far ([`PendingOp::order_after`]: the
/// producers of its inputs), sends it (slot, credits), then returns its outputs, usable by work
/// enqueued on `stream` from now on, as soon as the backend hands them out (the GPU backend: at
/// once, for the operations it can order on the device; others once they finished on the
/// host), and the operation to [`InStreamOrder::settle`]. An operation not yet sent is told
/// that its complete half follows at once ([`PendingOp::will_complete_at_once`]: the GPU
/// backend runs a low-latency one as one launch).
pub fn complete_on_blocking<O: PendingOp>(
    mut op: O,
    slots: &Arc<SlotPool>,
    poison: &Arc<Poison>,
    timeout: Duration,
    stream: &O::Stream,
    order: StreamOrder,
) -> Result<(O::Output, InStreamOrder<O>)> {
    let (channel, seq) = (op.channel(), op.seq());
    let label = || op_label(channel, seq);
    if !op.is_sent() {
        if let Err(e) = guarded(poison, label, || op.order_after(stream)) {
            // Not sent: the peers get a cancellation instead of waiting for data.
            op.cancel();
            detach(op, timeout, Arc::clone(poison));
            return Err(e);
        }
        // The complete half follows at once: both halves may go out as one unit.
        op.will_complete_at_once();
        op = send_blocking(op, slots, poison, timeout)?;
    }
    let deadline = deadline_after(Instant::now(), timeout);
    loop {
        if let Some(out) = poison.track(guarded(poison, label, || op.complete_on(stream, order)))? {
            return Ok((out, InStreamOrder { op: Some(op), poison: Arc::clone(poison), timeout }));
        }
        let probe = op.complete_probe();
        if !wait_until(deadline, || Ok(probe.ready()))? {
            return poison.track(Err(timeout_error(&op, timeout)));
        }
    }
}

/// A handle created in stream order, and its creation to settle (`None`: built at once).
pub type HandleInStreamOrder<B> = (<B as Backend>::Handle, Option<InStreamOrder<<B as Backend>::Op>>);

/// Creates a handle in `stream`'s order on any backend (see `Group::create_handle_on` in
/// epflow-async, [`Backend::start_handle_on`]): the handle, and the creation to settle (`None`:
/// a low-latency handle, built at once or enqueued on `stream`).
pub fn blocking_handle_on<B: Backend>(
    b: &B,
    topk_idx: &B::Tensor,
    opts: &HandleOptions,
    stream: &B::Stream,
) -> Result<HandleInStreamOrder<B>> {
    match b.start_handle_on(topk_idx, opts, stream)? {
        HandleCreation::Ready(h) => Ok((h, None)),
        HandleCreation::Collective(op) => {
            let pool = b.slot_pool(Channel::Handle);
            match complete_on_blocking(op, pool, b.poison(), b.config().timeout, stream, StreamOrder::Ordered)? {
                (OpOutput::Handle(h), settle) => Ok((h, Some(settle))),
                _ => Err(no_result("handle creation")),
            }
        }
    }
}

/// Dispatch in `stream`'s order on any backend, blocking until it is enqueued (see
/// [`complete_on_blocking`]).
pub fn blocking_dispatch_on<B: Backend>(
    b: &B,
    handle: &B::Handle,
    inputs: DispatchInputs<'_, B::Tensor>,
    opts: &DispatchOptions,
    stream: &B::Stream,
) -> Result<(B::DispatchOutput, InStreamOrder<B::Op>)> {
    let op = b.start_dispatch(handle, inputs, opts)?;
    let (pool, timeout) = (b.slot_pool(Channel::Dispatch), b.config().timeout);
    match complete_on_blocking(op, pool, b.poison(), timeout, stream, StreamOrder::Ordered)? {
        (OpOutput::Dispatch(d), settle) => Ok((d, settle)),
        _ => Err(no_result("dispatch")),
    }
}

/// Combine in `stream`'s order on any backend; see [`blocking_dispatch_on`].
pub fn blocking_combine_on<B: Backend>(
    b: &B,
    handle: &B::Handle,
    inputs: CombineInputs<'_, B::Tensor>,
    opts: &CombineOptions,
    stream: &B::Stream,
) -> Result<(B::CombineOutput, InStreamOrder<B::Op>)> {
    let op = b.start_combine(handle, inputs, opts)?;
    let (pool, timeout) = (b.slot_pool(Channel::Combine), b.config().timeout);
    match complete_on_blocking(op, pool, b.poison(), timeout, stream, StreamOrder::Ordered)? {
        (OpOutput::Combine(c), settle) => Ok((c, settle)),
        _ => Err(no_result("combine")),
    }
}

fn no_result(what: &str) -> Error {
    Error::Backend(format!("{what} was cancelled and has no result"))
}

/// Creates a handle on any backend, blocking (collective for high-throughput), with the default
/// options (expert-major).
pub fn blocking_handle<B: Backend>(b: &B, topk_idx: &B::Tensor) -> Result<B::Handle> {
    blocking_handle_with(b, topk_idx, &HandleOptions::default())
}

/// Creates a handle with `opts` on any backend, blocking.
pub fn blocking_handle_with<B: Backend>(b: &B, topk_idx: &B::Tensor, opts: &HandleOptions) -> Result<B::Handle> {
    match b.start_handle(topk_idx, opts)? {
        HandleCreation::Ready(h) => Ok(h),
        HandleCreation::Collective(op) => {
            match run_blocking(op, b.slot_pool(Channel::Handle), b.poison(), b.config().timeout)? {
                OpOutput::Handle(h) => Ok(h),
                _ => Err(no_result("handle creation")),
            }
        }
    }
}

fn run_maybe_staged<B: Backend>(
    b: &B,
    op: B::Op,
    channel: Channel,
    staged: bool,
) -> Result<<B::Op as PendingOp>::Output> {
    let timeout = b.config().timeout;
    if staged {
        let op = send_blocking(op, b.slot_pool(channel), b.poison(), timeout)?;
        complete_blocking(op, b.poison(), timeout)
    } else {
        run_blocking(op, b.slot_pool(channel), b.poison(), timeout)
    }
}

/// Dispatch on any backend, blocking; `staged` runs the send half and the complete half as two
/// steps (as `send_only` then complete would).
pub fn blocking_dispatch<B: Backend>(
    b: &B,
    handle: &B::Handle,
    inputs: DispatchInputs<'_, B::Tensor>,
    opts: &DispatchOptions,
    staged: bool,
) -> Result<B::DispatchOutput> {
    match run_maybe_staged(b, b.start_dispatch(handle, inputs, opts)?, Channel::Dispatch, staged)? {
        OpOutput::Dispatch(d) => Ok(d),
        _ => Err(no_result("dispatch")),
    }
}

/// Combine on any backend, blocking; see [`blocking_dispatch`].
pub fn blocking_combine<B: Backend>(
    b: &B,
    handle: &B::Handle,
    inputs: CombineInputs<'_, B::Tensor>,
    opts: &CombineOptions,
    staged: bool,
) -> Result<B::CombineOutput> {
    match run_maybe_staged(b, b.start_combine(handle, inputs, opts)?, Channel::Combine, staged)? {
        OpOutput::Combine(c) => Ok(c),
        _ => Err(no_result("combine")),
    }
}

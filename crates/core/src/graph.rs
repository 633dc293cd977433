//! Captured steps: low-latency work recorded once and replayed every decode step, as CUDA graphs
//! are in serving frameworks. The backend-independent contract; the GPU backend captures CUDA
//! graphs (`epflow_kernels::GpuRank::capture`), the host backend replays the recorded closure
//! ([`crate::host::HostRank::capture`]); both implement [`StepBackend`], and
//! `epflow_async::Group::replay` launches a replay and awaits its verdict.
//!
//! ## What a step is
//!
//! A step holds low-latency dispatches and combines (and, on GPUs, whatever else the caller
//! enqueued on the capture stream: the router, the experts). Its operations are numbered when
//! it is captured by their place on their channel (the `i`-th dispatch of the step, the `j`-th
//! combine). A replay takes, on every channel, as many consecutive sequence numbers as the step
//! has operations there ([`crate::backend::RankCore::take_seqs`]): dispatch `i` of the replay is
//! collective `base + i` of the dispatch channel, exactly as if it had been started eagerly at
//! that point. On GPUs the base lives in device memory and the step advances it on the device
//! at the end of every replay, so replays launched back to back need no host work at all.
//!
//! ## Rules (every backend enforces them with errors)
//!
//! - Only low-latency groups capture steps ([`crate::Error::Unsupported`] otherwise).
//! - A step's operations use the step's own handles (created inside the capture from a `topk_idx`
//!   buffer that the caller refills before each replay); eager operations refuse them, and
//!   captured operations refuse eager handles.
//! - A captured combine pairs with the latest dispatch of its handle captured before it in the
//!   same step ([`crate::ValidationError::CombineBeforeDispatch`] when there is none). Its stamp
//!   says so ([`crate::stamp::Pairing::Captured`]): a rank that runs an eager combine where its
//!   peers replay a captured one fails with a mismatch, not with wrong rows.
//! - Inputs and outputs are fixed buffers: the caller refills the inputs (and the `topk_idx`
//!   buffer) before each replay and reads the outputs after it; a replay overwrites the previous
//!   replay's outputs.
//! - Replays and eager operations mix freely on one group, in the same order on every rank. A
//!   replay is launched at once: every operation started before it on the rank must have been
//!   sent ([`crate::Error::Unsupported`] naming the unsent one otherwise, before any number is
//!   taken).
//! - An invalid `topk_idx` entry (outside `[-1, E)`, or an expert the row named before) cannot
//!   stop a replay already on the device: the row's entries from that one on are treated as `-1`
//!   by dispatch and combine alike (a defined result), and the replay resolves to the
//!   [`crate::ValidationError`] of the first such entry. The group stays usable.
//! - A device timeout or a peer's mismatch inside a replay fails it and poisons the group (work
//!   captured after the operation already read its outputs).

use crate::backend::{Backend, Probe};
use crate::error::Result;

/// One replay of a [`StepBackend::Step`] in flight.
pub trait PendingReplay: Send + 'static {
    /// Ready once the replay has finished on the device (or on the host threads).
    fn probe(&self) -> Box<dyn Probe>;
    /// The replay's verdict, once [`PendingReplay::probe`] is ready: `Ok`, the validation error
    /// of an invalid routing, or the error that poisoned the group.
    fn finish(self) -> Result<()>;
    /// For error messages: e.g. `"replay 12 of step 3"`.
    fn label(&self) -> String;
}

/// A backend that captures steps and replays them.
pub trait StepBackend: Backend {
    /// A captured step (bound to the rank that captured it).
    type Step: Send + Sync + 'static;
    /// A replay in flight.
    type Replay: PendingReplay;
    /// Launches one replay of `step` (collective: every rank launches the same step at the same
    /// place in its order of operations). Fails, taking no sequence number, if the group is
    /// poisoned, the step is another rank's, or an operation started before is not sent yet.
    fn launch_step(&self, step: &Self::Step) -> Result<Self::Replay>;
}

/// The number of operations per channel a step holds, and the place of each new one.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StepCounts {
    /// Dispatches.
    pub dispatches: u64,
    /// Combines.
    pub combines: u64,
}

impl StepCounts {
    /// The place of a new dispatch (and counts it).
    pub fn add_dispatch(&mut self) -> u64 {
        self.dispatches += 1;
        self.dispatches - 1
    }

    /// The place of a new combine (and counts it).
    pub fn add_combine(&mut self) -> u64 {
        self.combines += 1;
        self.combines - 1
    }
}

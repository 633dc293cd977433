//! Completions of stream-ordered operations, and how a waiting task learns that a condition
//! holds.
//!
//! - [`Completion`]: what [`crate::Staged::complete_on`] returns beside the outputs. The outputs
//!   are usable at once in the stream's order; the completion resolves when the device has
//!   finished the operation, with its verdict (a peer's cancellation or mismatch, a device
//!   timeout, this rank masked by the group). A reactor job watches every such operation: if
//!   it failed, its group is poisoned (work already enqueued on the outputs read bad data),
//!   whether or not anyone awaits the completion; a masked rank's group is not (rank masking's
//!   recovery needs it whole).
//! - [`CompletionMode`]: how a task waits for a condition: through the reactor thread (a
//!   cross-thread wake, no CPU spent while waiting), or by spinning on it first in the task for
//!   a bounded time (no wake in the path, at the cost of a busy executor thread).

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use epflow_core::backend::{Backend, PendingOp, Probe};
use epflow_core::{Error, Result};

use crate::reactor::{Job, WaitOutcome, wait_for};
use crate::sync::AtomicWaker;

/// How the tasks of a [`crate::Group`] wait for their operations' conditions (free buffer sets,
/// credits, completions).
///
/// - [`CompletionMode::Reactor`] (the default): the condition is registered with the reactor
///   thread, which polls it and wakes the task. The task's thread is free while it waits; the
///   wake costs a cross-thread hand-off (measured on the H200 host: 16 µs median, 195 µs p99
///   under load, `cargo bench --bench reactor`).
/// - [`CompletionMode::Spin`]: the task polls the condition itself for up to `budget` before it
///   falls back to the reactor. A condition that turns true within the budget is seen within
///   about a microsecond with no wake in between; the executor thread is busy for that time (one
///   core per spinning task). Right for latency-critical awaits of short operations (decode's
///   low-latency dispatch and combine, 10-60 µs) with a thread to spare per rank; wrong when
///   many tasks share few threads or the waits are long.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum CompletionMode {
    /// Wait through the reactor thread.
    #[default]
    Reactor,
    /// Spin in the task for up to `budget`, then wait through the reactor.
    Spin {
        /// The longest a task spins on one condition.
        budget: Duration,
    },
}

impl CompletionMode {
    /// Fast mode: spin for up to `budget` before falling back to the reactor.
    pub fn spin_for(budget: Duration) -> Self {
        CompletionMode::Spin { budget }
    }

    /// Spins on `probe` for the mode's budget; `true` if it turned ready meanwhile.
    pub(crate) fn spin(&self, probe: &dyn Probe) -> bool {
        let CompletionMode::Spin { budget } = *self else { return false };
        let start = Instant::now();
        loop {
            if probe.ready() {
                return true;
            }
            if start.elapsed() >= budget {
                return false;
            }
            std::hint::spin_loop();
        }
    }
}

/// Waits for `probe` as a group's operations do in `mode`: in fast mode the task polls it for up
/// to the budget first (no cross-thread wake if it turns ready meanwhile), then the reactor waits
/// for it ([`crate::reactor::wait_for`]) until `timeout` after the call.
pub async fn wait_with(mode: CompletionMode, probe: impl Probe, timeout: Duration) -> WaitOutcome {
    let start = Instant::now();
    if mode.spin(&probe) {
        return WaitOutcome::Ready;
    }
    wait_for(probe, timeout.saturating_sub(start.elapsed())).await
}

/// The shared state of one [`Completion`].
#[derive(Debug, Default)]
pub(crate) struct CompletionState {
    verdict: Mutex<Option<Result<()>>>,
    waker: AtomicWaker,
}

impl CompletionState {
    fn settle(&self, verdict: Result<()>) {
        *self.verdict.lock().unwrap_or_else(|e| e.into_inner()) = Some(verdict);
        self.waker.wake();
    }
}

/// Resolves when a stream-ordered operation has finished on the device, to its verdict:
/// `Ok(())`, or the error its outputs carry: they were computed from bad data, and the group is
/// poisoned, except for [`Error::RankMasked`] (the group masked this rank, see
/// [`epflow_core::mask`]: the outputs lack the peers' share, the group is not poisoned, and
/// `unmask_all` brings the rank back). Dropping it is fine: the operation is watched anyway.
#[derive(Debug)]
pub struct Completion {
    state: Arc<CompletionState>,
}

impl Completion {
    pub(crate) fn new() -> (Self, Arc<CompletionState>) {
        let state = Arc::new(CompletionState::default());
        (Completion { state: Arc::clone(&state) }, state)
    }

    /// A completion already settled with `Ok(())` (work that was done when it was handed out).
    pub(crate) fn done() -> Self {
        let (c, state) = Completion::new();
        state.settle(Ok(()));
        c
    }

    /// Whether the operation has finished (the verdict is in).
    pub fn is_done(&self) -> bool {
        self.state.verdict.lock().unwrap_or_else(|e| e.into_inner()).is_some()
    }
}

impl Future for Completion {
    type Output = Result<()>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<()>> {
        self.state.waker.register_by_ref(cx.waker());
        match self.state.verdict.lock().unwrap_or_else(|e| e.into_inner()).as_ref() {
            Some(v) => Poll::Ready(v.clone()),
            None => Poll::Pending,
        }
    }
}

/// The reactor job that watches a stream-ordered operation to its end: it waits for the
/// operation's completion probe (bounded by the group's timeout), takes the verdict, poisons the
/// group if it failed, and settles the [`Completion`]. The operation (and what it keeps alive)
/// is dropped then.
pub(crate) struct Watch<B: Backend> {
    pub(crate) backend: Arc<B>,
    pub(crate) op: Option<B::Op>,
    pub(crate) probe: Box<dyn Probe>,
    pub(crate) deadline: Instant,
    pub(crate) state: Arc<CompletionState>,
}

impl<B: Backend> Watch<B> {
    /// Settles the completion with `e`, poisoning the group unless `e` is
    /// [`Error::RankMasked`]: the group masked this rank, whose outputs are then incomplete (the
    /// completion says so), but the group itself is sound, the rank's later operations are
    /// refused with `RankMasked`, and `unmask_all` or a rejoin brings it back (which a poisoned
    /// group would refuse).
    fn fail(&mut self, e: Error) {
        let label = self.op.as_ref().map(PendingOp::label).unwrap_or_default();
        if !matches!(e, Error::RankMasked { .. }) {
            self.backend
                .poison()
                .poison(format!("{label}, completed in stream order, failed after its outputs were handed out: {e}"));
        }
        self.state.settle(Err(e));
        self.op = None;
    }
}

impl<B: Backend> Job for Watch<B> {
    fn step(&mut self) -> bool {
        let Some(op) = self.op.as_mut() else { return true };
        if !self.probe.ready() {
            if Instant::now() < self.deadline {
                return false;
            }
            let e = Error::Timeout {
                op: op.label(),
                rank: op.rank(),
                waiting_for: op.waiting_for(),
                after: self.backend.config().timeout,
            };
            self.fail(e);
            return true;
        }
        let verdict = op.poll_complete().and_then(|done| {
            if done {
                op.verdict()
            } else {
                Err(Error::Backend("completion probe ready, operation not complete".into()))
            }
        });
        match verdict {
            Ok(()) => {
                self.state.settle(Ok(()));
                self.op = None;
            }
            Err(e) => self.fail(e),
        }
        true
    }

    fn abandon(&mut self, why: &str) {
        self.fail(Error::Internal {
            op: self.op.as_ref().map(PendingOp::label).unwrap_or_default(),
            message: why.into(),
        });
    }
}

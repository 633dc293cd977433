//! [`OpDriver`]: runs one backend operation (a [`PendingOp`]) from the async side — slot, credits,
//! send, complete, finish — waiting through the reactor, with a deadline on every wait. When
//! dropped before the end it hands the operation to the reactor, which finishes it (as a
//! cancellation if it was not sent yet) so the collective protocol stays consistent.

use std::sync::Arc;
use std::task::{Context, Poll, ready};
use std::time::Instant;

use epflow_core::backend::{Backend, OpOutput, PendingOp, Probe, StreamOrder, guarded};
use epflow_core::protocol::{SlotGuard, deadline_after};
use epflow_core::{Error, Result};
use tracing::Span;

use crate::completion::{Completion, CompletionMode, Watch};
use crate::reactor::{Job, Registration, WaitOutcome, reactor};

type Output<B> = OpOutput<<B as Backend>::Handle, <B as Backend>::DispatchOutput, <B as Backend>::CombineOutput>;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Stage {
    /// Waiting for the operation's buffer set.
    Slot,
    /// Waiting for the receivers' credits.
    Credits,
    /// The send half is issued.
    Sent,
    /// The complete half is running.
    Completing,
    /// Finished, failed, or handed away.
    Done,
}

/// What one wait is for: names the condition in timeout errors, and keys the registration so
/// a wait is only resumed for the condition it was made for.
#[derive(Clone, Copy, PartialEq, Eq)]
enum WaitKind {
    Slot,
    Credits,
    Complete,
}

/// Drives one operation.
pub(crate) struct OpDriver<B: Backend> {
    backend: Arc<B>,
    op: Option<B::Op>,
    stage: Stage,
    slot: Option<SlotGuard>,
    /// The reactor registration of the wait in progress, with the condition it watches. A fast
    /// path can move the operation on while one is outstanding; it is then stale and replaced.
    wait: Option<(WaitKind, Registration)>,
    phase_start: Instant,
    send_span: Span,
    complete_span: Option<Span>,
    micro_batch: Option<u64>,
    mode: CompletionMode,
}

impl<B: Backend> OpDriver<B> {
    pub(crate) fn new(backend: Arc<B>, op: B::Op, mode: CompletionMode) -> Self {
        let (bytes, tokens) = op.traffic();
        let send_span = tracing::info_span!(
            "epflow_op",
            op = %op.label(),
            rank = op.rank(),
            stage = "send",
            tokens,
            bytes,
            micro_batch = tracing::field::Empty,
        );
        let stage = if op.needs_slot() { Stage::Slot } else { Stage::Credits };
        OpDriver {
            backend,
            op: Some(op),
            stage,
            slot: None,
            wait: None,
            phase_start: Instant::now(),
            send_span,
            complete_span: None,
            micro_batch: None,
            mode,
        }
    }

    pub(crate) fn backend_ref(&self) -> &B {
        &self.backend
    }

    /// Tags the operation's spans with a micro-batch index.
    pub(crate) fn set_micro_batch(&mut self, micro_batch: u64) {
        self.micro_batch = Some(micro_batch);
        self.send_span.record("micro_batch", micro_batch);
    }

    fn fail(&mut self, e: Error) -> Error {
        if e.poisons() {
            self.backend.poison().poison(e.to_string());
        }
        e
    }

    fn timeout_error(&mut self, kind: WaitKind) -> Error {
        let timeout = self.backend.config().timeout;
        let (label, rank, waiting_for) = match &self.op {
            Some(op) => (op.label(), op.rank(), op.waiting_for()),
            None => (String::from("operation"), self.backend.rank(), String::new()),
        };
        let waiting_for = match kind {
            WaitKind::Slot => "a free buffer set (earlier outputs of this kind are still alive)".to_string(),
            WaitKind::Credits | WaitKind::Complete => waiting_for,
        };
        let e = Error::Timeout { op: label, rank, waiting_for, after: timeout };
        self.stage = Stage::Done;
        self.fail(e)
    }

    /// Waits through the reactor until `probe` is ready; `Ok(())` means "check again".
    fn wait(
        &mut self,
        cx: &mut Context<'_>,
        kind: WaitKind,
        probe: impl FnOnce() -> Box<dyn Probe>,
    ) -> Poll<Result<()>> {
        let reg = match &mut self.wait {
            Some((k, reg)) if *k == kind => reg,
            wait => {
                let probe = probe();
                // Fast mode: the task watches the condition itself for a while first.
                if self.mode.spin(&*probe) {
                    return Poll::Ready(Ok(()));
                }
                let deadline = deadline_after(self.phase_start, self.backend.config().timeout);
                &mut wait.insert((kind, Registration::new(probe, deadline))).1
            }
        };
        let outcome = ready!(reg.poll(cx));
        self.wait = None;
        match outcome {
            WaitOutcome::Ready => Poll::Ready(Ok(())),
            WaitOutcome::TimedOut => {
                // Rank masking: the ranks this operation waits for are masked, and it goes on
                // without them (a fresh deadline for the check that follows).
                if kind != WaitKind::Slot {
                    match self.step(PendingOp::mask_missing) {
                        Ok(true) => {
                            self.phase_start = Instant::now();
                            return Poll::Ready(Ok(()));
                        }
                        Ok(false) => {}
                        Err(e) => {
                            self.stage = Stage::Done;
                            return Poll::Ready(Err(self.fail(e)));
                        }
                    }
                }
                Poll::Ready(Err(self.timeout_error(kind)))
            }
            WaitOutcome::Failed => {
                self.stage = Stage::Done;
                let r = reactor();
                let e = if r.is_dead() {
                    Error::ReactorDied { reason: r.death_reason() }
                } else {
                    Error::Internal { op: self.label(), message: "its readiness probe panicked".into() }
                };
                Poll::Ready(Err(self.fail(e)))
            }
        }
    }

    fn label(&self) -> String {
        self.op.as_ref().map(PendingOp::label).unwrap_or_else(|| "an operation".into())
    }

    /// Runs a step of the backend's operation, a panic becoming [`Error::Internal`] (and poison).
    fn step<T>(&mut self, f: impl FnOnce(&mut B::Op) -> Result<T>) -> Result<T> {
        let label = self.label();
        let backend = Arc::clone(&self.backend);
        let op = self.op_mut()?;
        guarded(backend.poison(), || label, || f(op))
    }

    fn op_mut(&mut self) -> Result<&mut B::Op> {
        self.op.as_mut().ok_or_else(|| Error::Backend("operation polled after it finished".into()))
    }

    /// Drives the operation until its send half is issued.
    pub(crate) fn poll_sent(&mut self, cx: &mut Context<'_>) -> Poll<Result<()>> {
        let span = self.send_span.clone();
        let _enter = span.enter();
        loop {
            if let Err(e) = self.backend.poison().check() {
                if matches!(self.stage, Stage::Slot | Stage::Credits) {
                    self.stage = Stage::Done;
                    return Poll::Ready(Err(e));
                }
            }
            match self.stage {
                Stage::Slot => {
                    let (seq, channel) = {
                        let op = self.op_mut()?;
                        (op.seq(), op.channel())
                    };
                    let pool = Arc::clone(self.backend.slot_pool(channel));
                    if let Some(guard) = pool.try_acquire(seq) {
                        self.slot = Some(guard);
                        self.stage = Stage::Credits;
                        self.phase_start = Instant::now();
                        continue;
                    }
                    ready!(self.wait(cx, WaitKind::Slot, || Box::new(pool.free_probe(seq))))?;
                }
                Stage::Credits => match self.step(|op| op.poll_send_ready()) {
                    Ok(true) => {
                        let slot = self.slot.take();
                        if let Err(e) = self.step(|op| op.send(slot)) {
                            self.stage = Stage::Done;
                            return Poll::Ready(Err(self.fail(e)));
                        }
                        tracing::debug!("send half issued");
                        self.stage = Stage::Sent;
                        return Poll::Ready(Ok(()));
                    }
                    Ok(false) => {
                        let probe = self.step(|op| Ok(op.send_probe()))?;
                        ready!(self.wait(cx, WaitKind::Credits, || probe))?;
                    }
                    Err(e) => {
                        self.stage = Stage::Done;
                        return Poll::Ready(Err(self.fail(e)));
                    }
                },
                Stage::Sent | Stage::Completing => return Poll::Ready(Ok(())),
                Stage::Done => return Poll::Ready(Err(Error::Backend("operation polled after it finished".into()))),
            }
        }
    }

    /// Drives the operation to its result. Not sent yet: the complete half follows the send at
    /// once (the synchronous form), which the backend is told.
    pub(crate) fn poll_done(&mut self, cx: &mut Context<'_>) -> Poll<Result<Output<B>>> {
        if matches!(self.stage, Stage::Slot | Stage::Credits) {
            if let Some(op) = self.op.as_mut() {
                op.will_complete_at_once();
            }
        }
        ready!(self.poll_sent(cx))?;
        if self.stage == Stage::Sent {
            let span = tracing::info_span!(
                parent: None,
                "epflow_op",
                op = %self.op.as_ref().map(PendingOp::label).unwrap_or_default(),
                rank = self.backend.rank(),
                stage = "complete",
                micro_batch = self.micro_batch,
            );
            span.follows_from(self.send_span.id());
            self.complete_span = Some(span);
            self.phase_start = Instant::now();
            self.stage = Stage::Completing;
            if let Err(e) = self.step(|op| op.start_complete()) {
                self.stage = Stage::Done;
                return Poll::Ready(Err(self.fail(e)));
            }
        }
        let span = self.complete_span.clone().unwrap_or_else(Span::none);
        let _enter = span.enter();
        loop {
            match self.step(|op| op.poll_complete()) {
                Ok(true) => {
                    let label = self.label();
                    let op = self.op.take().ok_or_else(|| Error::Backend("operation missing".into()))?;
                    self.stage = Stage::Done;
                    tracing::debug!("complete");
                    let backend = Arc::clone(&self.backend);
                    let out = guarded(backend.poison(), || label, || op.finish());
                    return Poll::Ready(out.map_err(|e| self.fail(e)));
                }
                Ok(false) => {
                    let probe = self.step(|op| Ok(op.complete_probe()))?;
                    ready!(self.wait(cx, WaitKind::Complete, || probe))?;
                }
                Err(e) => {
                    self.stage = Stage::Done;
                    return Poll::Ready(Err(self.fail(e)));
                }
            }
        }
    }
}

impl<B: Backend> OpDriver<B> {
    /// Orders the operation's send half after the work enqueued on `stream` so far (on the
    /// device). Call before it is sent.
    pub(crate) fn order_after(&mut self, stream: &B::Stream) -> Result<()> {
        self.step(|op| op.order_after(stream))
    }

    /// Drives the operation to its send half, then completes it in stream order on `stream`:
    /// the outputs at once (GPU backends) or once the data is in (the host backend), and a
    /// [`Completion`] a reactor job settles when the device has finished. Not sent yet, the
    /// backend is told that the complete half follows at once (one launch on GPUs).
    pub(crate) fn poll_complete_on(
        &mut self,
        cx: &mut Context<'_>,
        stream: &B::Stream,
        order: StreamOrder,
    ) -> Poll<Result<(Output<B>, Completion)>> {
        if matches!(self.stage, Stage::Slot | Stage::Credits) {
            // Not sent yet: the complete half follows the send in stream order at once.
            if let Some(op) = self.op.as_mut() {
                op.will_complete_at_once();
            }
        }
        ready!(self.poll_sent(cx))?;
        if self.stage == Stage::Sent {
            self.phase_start = Instant::now();
            self.stage = Stage::Completing;
        }
        loop {
            match self.step(|op| op.complete_on(stream, order)) {
                Ok(Some(output)) => {
                    let op = self.op.take().ok_or_else(|| Error::Backend("operation missing".into()))?;
                    self.stage = Stage::Done;
                    let probe = op.complete_probe();
                    let (completion, state) = Completion::new();
                    let deadline = deadline_after(Instant::now(), self.backend.config().timeout);
                    let watch = Watch { backend: Arc::clone(&self.backend), op: Some(op), probe, deadline, state };
                    reactor().detach(Box::new(watch));
                    tracing::debug!("completed in stream order");
                    return Poll::Ready(Ok((output, completion)));
                }
                Ok(None) => {
                    let probe = self.step(|op| Ok(op.complete_probe()))?;
                    ready!(self.wait(cx, WaitKind::Complete, || probe))?;
                }
                Err(e) => {
                    self.stage = Stage::Done;
                    return Poll::Ready(Err(self.fail(e)));
                }
            }
        }
    }
}

impl<B: Backend> Drop for OpDriver<B> {
    fn drop(&mut self) {
        self.wait = None;
        let Some(mut op) = self.op.take() else { return };
        if !op.is_sent() {
            // Nothing went out: the peers get a cancellation marker instead of data.
            op.cancel();
            self.slot = None;
        }
        tracing::debug!(parent: &self.send_span, "dropped before the end; finishing it in the background");
        let deadline = deadline_after(Instant::now(), self.backend.config().timeout);
        reactor().detach(Box::new(Detached { backend: Arc::clone(&self.backend), op: Some(op), deadline }));
    }
}

/// An abandoned operation the reactor finishes: send (a cancellation) if needed, complete,
/// drop the outputs. If it cannot finish by its deadline the group is poisoned.
struct Detached<B: Backend> {
    backend: Arc<B>,
    op: Option<B::Op>,
    deadline: Instant,
}

impl<B: Backend> Job for Detached<B> {
    fn abandon(&mut self, why: &str) {
        let label = self.op.as_ref().map(PendingOp::label).unwrap_or_default();
        self.backend.poison().poison(format!("abandoned {label} could not finish: {why}"));
        // Its device work (if any) is waited for when the operation is dropped.
        if let Some(op) = self.op.take() {
            let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || drop(op)));
        }
    }

    fn step(&mut self) -> bool {
        let Some(op) = self.op.as_mut() else { return true };
        let progressed = (|| -> Result<bool> {
            if !op.is_sent() {
                if !op.poll_send_ready()? {
                    return Ok(false);
                }
                op.send(None)?;
            }
            op.start_complete()?;
            op.poll_complete()
        })();
        match progressed {
            Ok(true) => {
                if let Some(op) = self.op.take() {
                    drop(op.finish());
                }
                true
            }
            Ok(false) if Instant::now() < self.deadline => false,
            // Rank masking: go on without the ranks it waits for.
            Ok(false) if matches!(op.mask_missing(), Ok(true)) => {
                self.deadline = deadline_after(Instant::now(), self.backend.config().timeout);
                false
            }
            Ok(false) => {
                let op = self.op.take();
                let (label, waiting) = op.as_ref().map(|o| (o.label(), o.waiting_for())).unwrap_or_default();
                self.backend
                    .poison()
                    .poison(format!("abandoned {label} could not finish: still waiting for {waiting}"));
                true
            }
            Err(e) => {
                if e.poisons() {
                    self.backend.poison().poison(e.to_string());
                }
                self.op = None;
                true
            }
        }
    }
}

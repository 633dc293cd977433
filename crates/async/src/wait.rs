//! The register / complete / wake protocol between a waiting future and the reactor thread.
//!
//! A [`WaitState`] starts `PENDING`. The reactor moves it once to `READY`, `TIMED_OUT` or `FAILED`
//! and then wakes the registered waker; the future may instead move it to `CANCELLED` when dropped, which
//! tells the reactor to forget it. The future always registers its waker *before* reading the
//! state, and the reactor always writes the state *before* waking, so a completion is never
//! missed: either the future reads the new state, or the wake comes after its registration.

use std::task::{Context, Poll};

use crate::sync::{AtomicU8, AtomicWaker, Ordering};

/// Not decided yet.
pub(crate) const PENDING: u8 = 0;
/// The probe turned true.
pub(crate) const READY: u8 = 1;
/// The deadline passed first.
pub(crate) const TIMED_OUT: u8 = 2;
/// The waiting future went away.
pub(crate) const CANCELLED: u8 = 3;
/// The probe panicked, or the reactor thread died: the condition can no longer be observed.
pub(crate) const FAILED: u8 = 4;

/// The shared state of one wait.
#[derive(Debug)]
pub(crate) struct WaitState {
    state: AtomicU8,
    waker: AtomicWaker,
}

impl WaitState {
    pub(crate) fn new() -> Self {
        WaitState { state: AtomicU8::new(PENDING), waker: AtomicWaker::new() }
    }

    /// Reactor side: decides the wait (`READY`, `TIMED_OUT` or `FAILED`) and wakes the future. Returns
    /// false if it was already decided or cancelled.
    pub(crate) fn complete(&self, outcome: u8) -> bool {
        let won = self.state.compare_exchange(PENDING, outcome, Ordering::AcqRel, Ordering::Acquire).is_ok();
        if won {
            self.waker.wake();
        }
        won
    }

    /// Reactor side: whether the future went away.
    pub(crate) fn is_cancelled(&self) -> bool {
        self.state.load(Ordering::Acquire) == CANCELLED
    }

    /// Future side: registers the waker, then reads the state.
    pub(crate) fn poll(&self, cx: &mut Context<'_>) -> Poll<u8> {
        self.waker.register_by_ref(cx.waker());
        match self.state.load(Ordering::Acquire) {
            PENDING => Poll::Pending,
            s => Poll::Ready(s),
        }
    }

    /// Future side: gives up the wait. Returns false if it had already been decided.
    pub(crate) fn cancel(&self) -> bool {
        self.state.compare_exchange(PENDING, CANCELLED, Ordering::AcqRel, Ordering::Acquire).is_ok()
    }
}

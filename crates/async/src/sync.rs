//! The synchronization primitives of the reactor protocol. The loom model in
//! `tests/loom_reactor.rs` compiles `wait.rs` and `inbox.rs` against loom's versions instead.

pub(crate) use std::sync::Mutex;
pub(crate) use std::sync::atomic::{AtomicU8, Ordering};
pub(crate) use std::thread::{Thread, park, park_timeout};

/// `futures`' atomic waker with the method names loom's has (`register_by_ref`), so the same
/// protocol source compiles against both.
#[derive(Debug, Default)]
pub(crate) struct AtomicWaker(futures::task::AtomicWaker);

impl AtomicWaker {
    pub(crate) fn new() -> Self {
        AtomicWaker(futures::task::AtomicWaker::new())
    }

    pub(crate) fn register_by_ref(&self, waker: &std::task::Waker) {
        self.0.register(waker);
    }

    pub(crate) fn wake(&self) {
        self.0.wake();
    }
}

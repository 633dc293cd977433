//! The completion reactor: one thread per process that polls every outstanding wait's probe
//! (CUDA event queries, host arrival flags, slot frees) and wakes the waiting task.
//!
//! While anything is pending it spins for [`SPIN`], then yields until [`YIELD`], then sleeps in
//! short steps; with nothing pending it parks (no CPU). It also runs *detached* operations —
//! ones whose future was dropped — to their end, so cancellation never leaves peers waiting.
//! It is independent of the executor: futures only register wakers with it.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use epflow_core::backend::Probe;

use crate::inbox::Inbox;
use crate::sync::Thread;
use crate::wait::{CANCELLED, READY, TIMED_OUT, WaitState};

/// How long the reactor spins after its last progress before it starts yielding.
pub const SPIN: Duration = Duration::from_millis(2);
/// How long after its last progress it keeps yielding before it sleeps between polls.
pub const YIELD: Duration = Duration::from_millis(20);
/// The sleep between polls after that.
pub const SLEEP: Duration = Duration::from_micros(50);

/// Work the reactor runs to its end on its own thread: a step never blocks; `true` = done.
pub(crate) trait Job: Send {
    fn step(&mut self) -> bool;
}

struct Waiter {
    probe: Box<dyn Probe>,
    deadline: Instant,
    state: Arc<WaitState>,
}

enum Work {
    Wait(Waiter),
    Job(Box<dyn Job>),
}

/// The process's reactor.
pub(crate) struct Reactor {
    inbox: Inbox<Work>,
    thread: Thread,
    loops: AtomicU64,
    completed: AtomicU64,
}

static REACTOR: OnceLock<Reactor> = OnceLock::new();

/// The reactor, started on first use.
pub(crate) fn reactor() -> &'static Reactor {
    REACTOR.get_or_init(|| {
        let handle = std::thread::Builder::new()
            .name("epflow-reactor".into())
            .spawn(|| run(REACTOR.wait()))
            .expect("epflow: cannot start the reactor thread");
        Reactor {
            inbox: Inbox::new(),
            thread: handle.thread().clone(),
            loops: AtomicU64::new(0),
            completed: AtomicU64::new(0),
        }
    })
}

impl Reactor {
    /// Watches `probe` until it is ready or `deadline` passes; the outcome lands in `state`.
    pub(crate) fn register(&self, probe: Box<dyn Probe>, deadline: Instant, state: Arc<WaitState>) {
        self.inbox.push(Work::Wait(Waiter { probe, deadline, state }), &self.thread);
    }

    /// Runs `job` to its end on the reactor thread.
    pub(crate) fn detach(&self, job: Box<dyn Job>) {
        self.inbox.push(Work::Job(job), &self.thread);
    }
}

/// Counters of the reactor thread, for tests and benchmarks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReactorStats {
    /// Iterations of its polling loop so far (stops growing while it is parked).
    pub loops: u64,
    /// Waits it has decided (ready or timed out) so far.
    pub completed: u64,
}

/// The reactor's counters (starts the reactor if needed).
pub fn reactor_stats() -> ReactorStats {
    let r = reactor();
    ReactorStats { loops: r.loops.load(Ordering::Relaxed), completed: r.completed.load(Ordering::Relaxed) }
}

fn run(r: &'static Reactor) {
    let mut waiters: Vec<Waiter> = Vec::new();
    let mut jobs: Vec<Box<dyn Job>> = Vec::new();
    let mut incoming: Vec<Work> = Vec::new();
    let mut last_progress = Instant::now();
    loop {
        r.loops.fetch_add(1, Ordering::Relaxed);
        if r.inbox.drain_into(&mut incoming) > 0 {
            for w in incoming.drain(..) {
                match w {
                    Work::Wait(w) => waiters.push(w),
                    Work::Job(j) => jobs.push(j),
                }
            }
            last_progress = Instant::now();
        }
        let now = Instant::now();
        let before = waiters.len() + jobs.len();
        waiters.retain(|w| {
            if w.state.is_cancelled() {
                return false;
            }
            let outcome = if w.probe.ready() {
                READY
            } else if now >= w.deadline {
                TIMED_OUT
            } else {
                return true;
            };
            if w.state.complete(outcome) {
                r.completed.fetch_add(1, Ordering::Relaxed);
            }
            false
        });
        jobs.retain_mut(|j| !j.step());
        if waiters.len() + jobs.len() < before {
            last_progress = now;
        }
        if waiters.is_empty() && jobs.is_empty() {
            r.inbox.wait(None);
            last_progress = Instant::now();
            continue;
        }
        let idle = now.saturating_duration_since(last_progress);
        if idle < SPIN {
            std::hint::spin_loop();
        } else if idle < YIELD {
            std::thread::yield_now();
        } else {
            r.inbox.wait(Some(SLEEP));
        }
    }
}

/// One registered wait, as the future that owns it sees it.
#[derive(Debug)]
pub(crate) struct Registration {
    state: Arc<WaitState>,
}

/// How a wait ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WaitOutcome {
    /// The probe turned true.
    Ready,
    /// The deadline passed first.
    TimedOut,
}

impl Registration {
    /// Starts watching `probe` until `deadline`.
    pub(crate) fn new(probe: Box<dyn Probe>, deadline: Instant) -> Self {
        let state = Arc::new(WaitState::new());
        reactor().register(probe, deadline, Arc::clone(&state));
        Registration { state }
    }

    pub(crate) fn poll(&self, cx: &mut Context<'_>) -> Poll<WaitOutcome> {
        match self.state.poll(cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(TIMED_OUT) => Poll::Ready(WaitOutcome::TimedOut),
            Poll::Ready(CANCELLED) => Poll::Ready(WaitOutcome::TimedOut),
            Poll::Ready(_) => Poll::Ready(WaitOutcome::Ready),
        }
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        self.state.cancel();
    }
}

/// A future that resolves when `probe` is ready or `timeout` has passed, whichever is first.
/// It is what every epflow operation awaits; exposed for custom device-side conditions.
#[derive(Debug)]
pub struct WaitFor {
    reg: Registration,
}

/// Waits for `probe` with the reactor (see [`WaitFor`]).
pub fn wait_for(probe: impl Probe, timeout: Duration) -> WaitFor {
    WaitFor { reg: Registration::new(Box::new(probe), Instant::now() + timeout) }
}

impl Future for WaitFor {
    type Output = WaitOutcome;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<WaitOutcome> {
        self.reg.poll(cx)
    }
}

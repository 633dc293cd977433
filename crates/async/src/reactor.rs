//! The completion reactor: one thread per process that polls every outstanding wait's probe
//! (CUDA event queries, host arrival flags, slot frees) and wakes the waiting task.
//!
//! While anything is pending it spins for [`SPIN`], then yields until [`YIELD`], then sleeps in
//! short steps; with nothing pending it parks (no CPU). It also runs *detached* operations —
//! ones whose future was dropped — to their end, so cancellation never leaves peers waiting.
//! It is independent of the executor: futures only register wakers with it.
//!
//! ## Failures
//!
//! A probe or a detached operation that panics is caught: that wait resolves to
//! [`WaitOutcome::Failed`] (the operation fails with [`epflow_core::Error::Internal`] and its
//! group is poisoned), and the reactor goes on serving every other wait. Should the thread die
//! all the same, every pending and later wait resolves to [`WaitOutcome::Failed`] (operations
//! fail with [`epflow_core::Error::ReactorDied`]): no wait outlives its deadline.
//! [`reactor_stats`] reports both.

use std::future::Future;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use epflow_core::backend::{Probe, panic_message};
use epflow_core::protocol::deadline_after;

use crate::inbox::Inbox;
use crate::sync::Thread;
use crate::wait::{CANCELLED, FAILED, READY, TIMED_OUT, WaitState};

/// How long the reactor spins after its last progress before it starts yielding.
pub const SPIN: Duration = Duration::from_millis(2);
/// How long after its last progress it keeps yielding before it sleeps between polls.
pub const YIELD: Duration = Duration::from_millis(20);
/// The sleep between polls after that.
pub const SLEEP: Duration = Duration::from_micros(50);

/// Work the reactor runs to its end on its own thread: a step never blocks; `true` = done.
pub(crate) trait Job: Send {
    fn step(&mut self) -> bool;
    /// The job cannot be run to its end (it panicked, or the reactor is going away): give its
    /// operation up and poison its group with `why`. Called at most once, then the job is dropped.
    fn abandon(&mut self, why: &str);
}

struct Waiter {
    probe: Box<dyn Probe>,
    deadline: Instant,
    state: Arc<WaitState>,
}

/// What reaches the reactor through its inbox.
enum Incoming {
    Wait(Waiter),
    Job(Box<dyn Job>),
}

/// The process's reactor.
pub(crate) struct Reactor {
    inbox: Inbox<Incoming>,
    thread: Thread,
    loops: AtomicU64,
    completed: AtomicU64,
    panics: AtomicU64,
    dead: AtomicBool,
    death: Mutex<Option<String>>,
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
            panics: AtomicU64::new(0),
            dead: AtomicBool::new(false),
            death: Mutex::new(None),
        }
    })
}

impl Reactor {
    /// Watches `probe` until it is ready or `deadline` passes; the outcome lands in `state`.
    pub(crate) fn register(&self, probe: Box<dyn Probe>, deadline: Instant, state: Arc<WaitState>) {
        self.inbox.push(Incoming::Wait(Waiter { probe, deadline, state: Arc::clone(&state) }), &self.thread);
        // Pushed after the thread's last drain: nobody will decide it (see `Dying`).
        if self.is_dead() {
            state.complete(FAILED);
        }
    }

    /// Runs `job` to its end on the reactor thread.
    pub(crate) fn detach(&self, mut job: Box<dyn Job>) {
        if self.is_dead() {
            job.abandon(&self.death_reason());
            return;
        }
        self.inbox.push(Incoming::Job(job), &self.thread);
    }

    /// Whether the reactor thread is gone.
    pub(crate) fn is_dead(&self) -> bool {
        self.dead.load(Ordering::SeqCst)
    }

    /// Why the reactor thread died.
    pub(crate) fn death_reason(&self) -> String {
        self.death.lock().unwrap_or_else(|e| e.into_inner()).clone().unwrap_or_else(|| "unknown".into())
    }
}

/// Counters of the reactor thread, for tests, benchmarks and health checks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReactorStats {
    /// Iterations of its polling loop so far (stops growing while it is parked).
    pub loops: u64,
    /// Waits it has decided (ready, timed out or failed) so far.
    pub completed: u64,
    /// Panics of probes and detached operations it caught (each failed its operation and
    /// poisoned its group).
    pub panics: u64,
    /// Whether the reactor thread is running. When it is not, every wait fails at once.
    pub alive: bool,
}

/// The reactor's counters (starts the reactor if needed).
pub fn reactor_stats() -> ReactorStats {
    let r = reactor();
    ReactorStats {
        loops: r.loops.load(Ordering::Relaxed),
        completed: r.completed.load(Ordering::Relaxed),
        panics: r.panics.load(Ordering::Relaxed),
        alive: !r.is_dead(),
    }
}

/// The reactor loop's state. If the thread unwinds out of the loop anyway, dropping it marks
/// the reactor dead and fails every wait and job it holds or that is still queued.
struct Dying {
    r: &'static Reactor,
    waiters: Vec<Waiter>,
    jobs: Vec<Box<dyn Job>>,
}

impl Drop for Dying {
    fn drop(&mut self) {
        let r = self.r;
        if !std::thread::panicking() {
            return;
        }
        *r.death.lock().unwrap_or_else(|e| e.into_inner()) = Some("its thread panicked".into());
        r.dead.store(true, Ordering::SeqCst);
        let mut queued = Vec::new();
        r.inbox.drain_into(&mut queued);
        for w in queued {
            match w {
                Incoming::Wait(w) => self.waiters.push(w),
                Incoming::Job(j) => self.jobs.push(j),
            }
        }
        for w in self.waiters.drain(..) {
            w.state.complete(FAILED);
        }
        for mut j in self.jobs.drain(..) {
            let _ = catch_unwind(AssertUnwindSafe(|| j.abandon("the epflow reactor thread died")));
        }
    }
}

/// Runs `f`, counting and swallowing a panic (`None`).
fn caught<T>(r: &Reactor, f: impl FnOnce() -> T) -> Option<T> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(v) => Some(v),
        Err(p) => {
            r.panics.fetch_add(1, Ordering::Relaxed);
            tracing::error!("epflow reactor: caught a panic: {}", panic_message(&*p));
            None
        }
    }
}

fn run(r: &'static Reactor) {
    let mut st = Dying { r, waiters: Vec::new(), jobs: Vec::new() };
    let mut incoming: Vec<Incoming> = Vec::new();
    let mut last_progress = Instant::now();
    loop {
        r.loops.fetch_add(1, Ordering::Relaxed);
        if r.inbox.drain_into(&mut incoming) > 0 {
            for w in incoming.drain(..) {
                match w {
                    Incoming::Wait(w) => st.waiters.push(w),
                    Incoming::Job(j) => st.jobs.push(j),
                }
            }
            last_progress = Instant::now();
        }
        let now = Instant::now();
        let before = st.waiters.len() + st.jobs.len();
        st.waiters.retain(|w| {
            if w.state.is_cancelled() {
                return false;
            }
            let outcome = match caught(r, || w.probe.ready()) {
                None => FAILED,
                Some(true) => READY,
                Some(false) if now >= w.deadline => TIMED_OUT,
                Some(false) => return true,
            };
            if w.state.complete(outcome) {
                r.completed.fetch_add(1, Ordering::Relaxed);
            }
            false
        });
        st.jobs.retain_mut(|j| match caught(r, || j.step()) {
            Some(done) => !done,
            None => {
                // A panicking job: its operation fails and its group is poisoned; the others go on.
                let _ = caught(r, || j.abandon("an internal error (a panic) while finishing it"));
                false
            }
        });
        if st.waiters.len() + st.jobs.len() < before {
            last_progress = now;
        }
        if st.waiters.is_empty() && st.jobs.is_empty() {
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
    /// The condition can no longer be observed: the probe panicked, or the reactor thread died
    /// ([`reactor_stats`] tells which).
    Failed,
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
            // Registered before the check: a death after it completes the state and wakes us.
            Poll::Pending if reactor().is_dead() => Poll::Ready(WaitOutcome::Failed),
            Poll::Pending => Poll::Pending,
            Poll::Ready(TIMED_OUT) => Poll::Ready(WaitOutcome::TimedOut),
            Poll::Ready(CANCELLED | FAILED) => Poll::Ready(WaitOutcome::Failed),
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

/// Waits for `probe` with the reactor (see [`WaitFor`]). A timeout too large for the clock
/// means "practically never".
pub fn wait_for(probe: impl Probe, timeout: Duration) -> WaitFor {
    WaitFor { reg: Registration::new(Box::new(probe), deadline_after(Instant::now(), timeout)) }
}

impl Future for WaitFor {
    type Output = WaitOutcome;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<WaitOutcome> {
        self.reg.poll(cx)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicBool;

    use super::*;

    struct FlagJob(Arc<AtomicBool>);

    impl Job for FlagJob {
        fn step(&mut self) -> bool {
            false
        }
        fn abandon(&mut self, _why: &str) {
            self.0.store(true, Ordering::SeqCst);
        }
    }

    fn outcome(state: &WaitState) -> Poll<u8> {
        state.poll(&mut Context::from_waker(futures::task::noop_waker_ref()))
    }

    #[test]
    fn a_dying_reactor_fails_every_wait_and_job_it_holds_or_has_queued() {
        // A reactor of its own (not the process's), whose loop state unwinds.
        let r: &'static Reactor = Box::leak(Box::new(Reactor {
            inbox: Inbox::new(),
            thread: std::thread::current(),
            loops: AtomicU64::new(0),
            completed: AtomicU64::new(0),
            panics: AtomicU64::new(0),
            dead: AtomicBool::new(false),
            death: Mutex::new(None),
        }));
        let (held, queued) = (Arc::new(WaitState::new()), Arc::new(WaitState::new()));
        let abandoned = Arc::new(AtomicBool::new(false));
        let far = Instant::now() + Duration::from_secs(3600);
        let unwound = catch_unwind(AssertUnwindSafe(|| {
            let _st = Dying {
                r,
                waiters: vec![Waiter { probe: Box::new(|| false), deadline: far, state: Arc::clone(&held) }],
                jobs: vec![Box::new(FlagJob(Arc::clone(&abandoned)))],
            };
            r.inbox.push(
                Incoming::Wait(Waiter { probe: Box::new(|| false), deadline: far, state: Arc::clone(&queued) }),
                &r.thread,
            );
            panic!("a bug in the reactor loop");
        }));
        assert!(unwound.is_err());
        assert!(r.is_dead());
        assert_eq!(r.death_reason(), "its thread panicked");
        assert_eq!(outcome(&held), Poll::Ready(FAILED));
        assert_eq!(outcome(&queued), Poll::Ready(FAILED));
        assert!(abandoned.load(Ordering::SeqCst));
        // Later registrations and jobs fail at once.
        let late = Arc::new(WaitState::new());
        r.register(Box::new(|| false), far, Arc::clone(&late));
        assert_eq!(outcome(&late), Poll::Ready(FAILED));
        let late_job = Arc::new(AtomicBool::new(false));
        r.detach(Box::new(FlagJob(Arc::clone(&late_job))));
        assert!(late_job.load(Ordering::SeqCst));
    }
}

//! A group's handle lane: one thread per rank that runs the host part of handle creations
//! ([`epflow_core::backend::Backend::start_handle`]) off the caller's thread, one after another
//! in this rank's call order.
//!
//! `start_handle` may block (the GPU backend waits for its low-latency handle kernel, NCCL EP
//! for `ncclEpCreateHandle`, a collective); run inline, an awaited creation would block the
//! executor's thread, and two ranks on one current-thread runtime would wait for each other
//! forever. On the lane the caller's thread goes on; the result comes back through a oneshot
//! channel (no tokio needed: any executor).
//!
//! The lane keeps the rank's order: creations run in call order, and an operation created on
//! the group while a creation is on the lane first waits for it ([`Lane::wait_idle`]), as it
//! waited when creations ran inline.

use std::sync::mpsc::{Sender, channel};
use std::sync::{Arc, Condvar, Mutex, PoisonError};

/// A job for the lane. It must not panic (callers catch panics inside it).
pub(crate) type Job = Box<dyn FnOnce() + Send>;

/// The lane of one [`crate::Group`] (shared by its clones). Its thread starts with the first job
/// and ends once the lane is dropped and the jobs queued before were run.
#[derive(Debug, Default)]
pub(crate) struct Lane {
    queue: Mutex<Option<Sender<Job>>>,
    state: Arc<State>,
}

/// Jobs submitted and not yet run, and the condition their end signals.
#[derive(Debug, Default)]
struct State {
    pending: Mutex<usize>,
    idle: Condvar,
}

impl State {
    fn finished_one(&self) {
        let mut n = self.pending.lock().unwrap_or_else(PoisonError::into_inner);
        *n = n.saturating_sub(1);
        if *n == 0 {
            self.idle.notify_all();
        }
    }
}

impl Lane {
    /// Runs `job` on the lane's thread after every job submitted before it. Where no thread
    /// can be started, runs it here, at once (the behaviour without a lane).
    pub(crate) fn submit(&self, job: Job) {
        let mut queue = self.queue.lock().unwrap_or_else(PoisonError::into_inner);
        if queue.is_none() {
            let (tx, rx) = channel::<Job>();
            let state = Arc::clone(&self.state);
            let started = std::thread::Builder::new().name("epflow-handles".into()).spawn(move || {
                for job in rx {
                    job();
                    state.finished_one();
                }
            });
            if started.is_err() {
                drop(queue);
                job();
                return;
            }
            *queue = Some(tx);
        }
        *self.state.pending.lock().unwrap_or_else(PoisonError::into_inner) += 1;
        if let Some(Err(std::sync::mpsc::SendError(job))) = queue.as_ref().map(|tx| tx.send(job)) {
            // The thread is gone (it cannot be: jobs do not panic); run it here, as without one.
            *queue = None;
            drop(queue);
            job();
            self.state.finished_one();
        }
    }

    /// Blocks until every job submitted so far has run; returns at once when none is pending.
    pub(crate) fn wait_idle(&self) {
        let mut n = self.state.pending.lock().unwrap_or_else(PoisonError::into_inner);
        while *n > 0 {
            n = self.state.idle.wait(n).unwrap_or_else(PoisonError::into_inner);
        }
    }
}

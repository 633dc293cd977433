//! Captured steps on the host backend ([`crate::graph`]): the step is the closure that issues
//! its operations, and each replay runs it again. There is no device to defer to, so a replay
//! runs inside [`StepBackend::launch_step`] (blocking, like the host backend's blocking
//! collectives: drive each rank from its own thread); the returned replay is already settled.

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use super::HostRank;
use crate::backend::{Backend, Probe};
use crate::config::Algorithm;
use crate::error::{Error, Result};
use crate::graph::{PendingReplay, StepBackend};

/// Numbers the steps of the process.
static NEXT_STEP: AtomicU64 = AtomicU64::new(1);

type StepFn = Box<dyn FnMut(&HostRank) -> Result<()> + Send>;

/// A step of the host backend ([`HostRank::capture`]).
pub struct HostStep {
    id: u64,
    group_id: u64,
    rank: usize,
    run: Mutex<StepFn>,
    replays: AtomicU64,
}

impl std::fmt::Debug for HostStep {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostStep").field("id", &self.id).field("replays", &self.replays).finish()
    }
}

impl HostStep {
    /// Replays launched so far.
    pub fn replays(&self) -> u64 {
        self.replays.load(Ordering::Relaxed)
    }
}

/// A finished host replay and its verdict.
#[derive(Debug)]
pub struct HostReplay {
    label: String,
    verdict: Result<()>,
}

impl PendingReplay for HostReplay {
    fn probe(&self) -> Box<dyn Probe> {
        Box::new(|| true)
    }

    fn finish(self) -> Result<()> {
        self.verdict
    }

    fn label(&self) -> String {
        self.label.clone()
    }
}

impl HostRank {
    /// Records a step: `run` issues the step's operations on the rank it is given (this one)
    /// and reads and writes the caller's buffers; every replay runs it again. Low-latency groups
    /// only ([`Error::Unsupported`] otherwise), as on GPUs. Not collective.
    pub fn capture(&self, run: impl FnMut(&HostRank) -> Result<()> + Send + 'static) -> Result<HostStep> {
        self.core().poison().check()?;
        if self.config().algorithm != Algorithm::LowLatency {
            return Err(Error::Unsupported("captured steps hold low-latency operations only".into()));
        }
        Ok(HostStep {
            id: NEXT_STEP.fetch_add(1, Ordering::Relaxed),
            group_id: self.core().group_id(),
            rank: self.rank(),
            run: Mutex::new(Box::new(run)),
            replays: AtomicU64::new(0),
        })
    }
}

impl StepBackend for HostRank {
    type Step = HostStep;
    type Replay = HostReplay;

    fn launch_step(&self, step: &HostStep) -> Result<HostReplay> {
        self.core().poison().check()?;
        if (step.group_id, step.rank) != (self.core().group_id(), self.rank()) {
            return Err(Error::Unsupported(format!("step {} was captured by another rank or group", step.id)));
        }
        let mut run = step.run.lock().unwrap_or_else(|e| e.into_inner());
        let replay = step.replays.fetch_add(1, Ordering::Relaxed);
        let verdict = run(self);
        Ok(HostReplay { label: format!("replay {replay} of step {}", step.id), verdict })
    }
}

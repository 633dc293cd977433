//! Replays of captured steps ([`epflow_core::graph`]): [`Group::replay`] launches one and
//! returns a [`ReplayFuture`] of its verdict, resolved through the reactor (or a spin, in
//! [`CompletionMode::Spin`]) like every other wait of the group.
//!
//! On the host backend a step is the closure every replay runs (each rank on its own thread: a
//! host replay runs inside the launch); on GPUs it is a CUDA graph
//! (`epflow_kernels::GpuRank::capture`), and the same loop refills its input buffers instead.
//!
//! ```
//! use std::sync::{Arc, Mutex};
//! use epflow_async::Group;
//! use epflow_core::host::HostWorld;
//! use epflow_core::ops::{CombineInputs, CombineOptions, DispatchInputs, DispatchOptions};
//! use epflow_core::{GroupConfig, HostTensor, bf16};
//!
//! let ranks = HostWorld::create(2, GroupConfig::low_latency(4, 2, 128)).unwrap();
//! std::thread::scope(|s| {
//!     for rank in ranks {
//!         s.spawn(move || {
//!             let g = Group::new(rank);
//!             // The caller's buffers: the tokens (refilled before each replay), the output.
//!             let x = Arc::new(Mutex::new(HostTensor::tokens(2, 128, vec![bf16::ONE; 256])));
//!             let y = Arc::new(Mutex::new(Vec::new()));
//!             let (xs, ys) = (Arc::clone(&x), Arc::clone(&y));
//!             let step = g
//!                 .backend()
//!                 .capture(move |rank| {
//!                     let idx = HostTensor::topk_idx(2, 2, vec![0, 2, 1, 3]); // one expert per rank
//!                     let w = HostTensor::topk_weights(2, 2, vec![0.5; 4]);
//!                     let handle = rank.create_handle(&idx)?;
//!                     let d = rank.dispatch(&handle, DispatchInputs::new(&xs.lock().unwrap()), &DispatchOptions::default())?;
//!                     let experts = d.tokens().clone(); // identity experts
//!                     let out = rank.combine(&handle, CombineInputs::new(&experts).with_weights(&w), &CombineOptions::default())?;
//!                     *ys.lock().unwrap() = out.tokens().as_bf16().unwrap().to_vec();
//!                     Ok(())
//!                 })
//!                 .unwrap();
//!             for v in [1.0f32, 2.0, 3.0] {
//!                 *x.lock().unwrap() = HostTensor::tokens(2, 128, vec![bf16::from_f32(v); 256]);
//!                 futures::executor::block_on(g.replay(&step)).unwrap();
//!                 assert!(y.lock().unwrap().iter().all(|o| o.to_f32() == v)); // 0.5 v + 0.5 v
//!             }
//!         });
//!     }
//! });
//! ```

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use epflow_core::graph::{PendingReplay, StepBackend};
use epflow_core::{Error, Result};

use crate::completion::{CompletionMode, wait_with};
use crate::group::Group;
use crate::reactor::WaitOutcome;

/// The verdict of one replay ([`Group::replay`]): `Ok` once the replay has finished, or its
/// error. The replay is launched when [`Group::replay`] is called; dropping the future does not
/// stop it (its failures still poison the group, seen by the next replay or operation).
#[must_use = "the replay runs anyway; await the future for its verdict"]
pub struct ReplayFuture {
    inner: Pin<Box<dyn Future<Output = Result<()>> + Send>>,
}

impl std::fmt::Debug for ReplayFuture {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ReplayFuture")
    }
}

impl Future for ReplayFuture {
    type Output = Result<()>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<()>> {
        self.inner.as_mut().poll(cx)
    }
}

impl<B: StepBackend> Group<B> {
    /// Launches one replay of `step` now (collective: every rank replays the same step at the
    /// same place in its order of operations) and returns the future of its verdict. The
    /// replay's inputs must be in their buffers, in the step's stream order, before it runs.
    ///
    /// Errors at once (nothing launched, no number taken): the group is poisoned, the step is
    /// another rank's, an operation started earlier is not sent yet. From the future: the
    /// [`epflow_core::ValidationError`] of an invalid `topk_idx` entry (the replay ran with
    /// that row's entries from there on dropped; the group stays usable), or a device timeout,
    /// a peer's cancellation or mismatch (the group is poisoned). The wait is bounded by twice
    /// the group's timeout (a captured operation that times out ends the step's other
    /// operations on this rank at once).
    pub fn replay(&self, step: &B::Step) -> ReplayFuture {
        self.after_creations();
        let launched = self.backend().launch_step(step);
        let (mode, timeout) = (self.completion_mode(), self.config().timeout.saturating_mul(2));
        let (poison, rank) = (std::sync::Arc::clone(self.backend().poison()), self.rank());
        ReplayFuture { inner: Box::pin(verdict(launched, mode, timeout, poison, rank)) }
    }
}

async fn verdict<R: PendingReplay>(
    launched: Result<R>,
    mode: CompletionMode,
    timeout: std::time::Duration,
    poison: std::sync::Arc<epflow_core::protocol::Poison>,
    rank: usize,
) -> Result<()> {
    let replay = launched?;
    let probe = replay.probe();
    match wait_with(mode, move || probe.ready(), timeout).await {
        WaitOutcome::Ready => replay.finish(),
        WaitOutcome::TimedOut => {
            let e = Error::Timeout {
                op: replay.label(),
                rank,
                waiting_for: "the replay to finish on the device".into(),
                after: timeout,
            };
            poison.poison(e.to_string());
            Err(e)
        }
        WaitOutcome::Failed => Err(Error::Backend(format!(
            "{}: the reactor can no longer observe the replay (see reactor_stats)",
            replay.label()
        ))),
    }
}

//! Rank masking on a [`Group`] ([`epflow_core::mask`]): the rank's view of the mask, masking a
//! rank, the `unmask_all` collective, admitting a replacement for a dead rank (`admit` /
//! `rejoin`), and a stream of mask events for a server task.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use epflow_core::backend::Backend;
use epflow_core::mask::{MaskEvent, MaskedRanks, RankSet};
use epflow_core::protocol::deadline_after;
use epflow_core::{Error, Result};
use futures::Stream;
use futures::channel::oneshot;

use crate::group::Group;
use crate::reactor::{Registration, WaitOutcome};

impl<B: Backend> Group<B> {
    /// This rank's view of the group's mask: the ranks it no longer sends to or waits for, and
    /// the number of `unmask_all` calls so far. In a group without
    /// [`epflow_core::GroupConfig::rank_masking`] it is always empty. On GPUs it is what this
    /// rank's kernels last saw: a rank masked by a peer shows once this rank's next operation
    /// ran ([`epflow_core::mask`]).
    pub fn masked_ranks(&self) -> MaskedRanks {
        self.backend().masked_ranks()
    }

    /// Masks `rank` on every rank of the group, as a timeout would: later operations skip it,
    /// and its own operations fail with [`Error::RankMasked`]. For a server that learnt
    /// otherwise that a rank is gone (a health check, a process exit) and does not want to
    /// wait for the timeout. Any rank may call it, alone; it returns once the bit is in every
    /// rank's word (GPU: after a one-thread kernel, synchronously).
    ///
    /// A `rank` outside the group (`rank >= num_ranks()`) is [`Error::RankOutOfRange`] and masks
    /// nothing.
    pub fn mask(&self, rank: usize) -> Result<()> {
        let set = RankSet::from_ranks([rank], self.num_ranks()).map_err(|e| match e {
            Error::RankOutOfRange { rank, limit, .. } => Error::RankOutOfRange { op: "mask".into(), rank, limit },
            e => e,
        })?;
        self.backend().mask_ranks(&set)
    }

    /// Clears the mask on every rank. A collective of **every** rank, the masked ones included,
    /// called with no operation in flight on any of them: the ranks meet, agree on where each
    /// channel goes on, reset their credits and masks, and meet again. Resolves when every rank
    /// has; fails with [`Error::Timeout`] (and poisons) if one does not come within the group's
    /// timeout. Afterwards results are bit-exact with the full group again; dispatch again on a
    /// handle before combining on it ([`Error::StaleMaskEpoch`]).
    ///
    /// It runs on a thread of its own (the meeting blocks), so awaiting it never blocks the
    /// executor.
    pub fn unmask_all(&self) -> UnmaskFuture {
        self.meeting("unmask_all", |b| b.unmask_all())
    }

    /// A survivor's side of admitting replacements for the masked `ranks` (dead processes
    /// whose replacements call [`Group::rejoin`]; [`epflow_core::mask`], "Rejoining"): every
    /// survivor calls it with the same ranks, with no operation in flight, when the server says
    /// so. Resolves once the replacements are full members, or fails with [`Error::Timeout`]
    /// naming who did not come within `timeout` (the group is not poisoned: a replacement that
    /// did not come stays masked and the survivors serve on). Refusals are
    /// [`Error::RejoinRefused`]. Backends without it answer [`Error::Unsupported`]. GPU ranks
    /// need a meeting source first (`GpuRank::set_meeting_source`), and admit every masked rank
    /// at once (`docs/surviving-a-dead-rank.md`).
    ///
    /// It runs on a thread of its own, so awaiting it never blocks the executor.
    pub fn admit(&self, ranks: &[usize], timeout: Duration) -> UnmaskFuture {
        let set = RankSet::from_ranks(ranks.iter().copied(), self.num_ranks());
        self.meeting("admit", move |b| b.admit(&set?, timeout))
    }

    /// A replacement's side of [`Group::admit`]: joins the survivors' meeting within `timeout`;
    /// afterwards this rank serves as a full member.
    pub fn rejoin(&self, timeout: Duration) -> UnmaskFuture {
        self.meeting("rejoin", move |b| b.rejoin(timeout))
    }

    /// Runs a blocking meeting of the backend on a thread of its own.
    fn meeting(&self, what: &'static str, f: impl FnOnce(&B) -> Result<()> + Send + 'static) -> UnmaskFuture {
        let (tx, rx) = oneshot::channel();
        let backend = Arc::clone(self.backend_arc());
        let spawned = std::thread::Builder::new().name(format!("epflow-{what}")).spawn(move || {
            let _ = tx.send(f(&backend));
        });
        UnmaskFuture { rx: spawned.ok().map(|_| rx), what }
    }

    /// The changes of this rank's view of the mask, as they are seen (each [`MaskEvent`] says
    /// which ranks were added, or that `unmask_all` ran). The stream starts from the view at
    /// the time of the call and never ends while the reactor runs; drop it to stop watching.
    pub fn mask_events(&self) -> MaskEvents<B> {
        let backend = Arc::clone(self.backend_arc());
        let seen = backend.masked_ranks();
        MaskEvents { backend, seen, wait: None }
    }
}

/// The future of [`Group::unmask_all`], [`Group::admit`] and [`Group::rejoin`].
#[derive(Debug)]
#[must_use = "a meeting does nothing visible unless awaited (it still runs)"]
pub struct UnmaskFuture {
    rx: Option<oneshot::Receiver<Result<()>>>,
    what: &'static str,
}

impl Future for UnmaskFuture {
    type Output = Result<()>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<()>> {
        let what = self.what;
        let Some(rx) = self.rx.as_mut() else {
            return Poll::Ready(Err(Error::Backend(format!("{what}: no thread could be started for it"))));
        };
        Pin::new(rx).poll(cx).map(|r| {
            r.unwrap_or_else(|_| Err(Error::Internal { op: what.into(), message: "its thread panicked".into() }))
        })
    }
}

/// The stream of [`Group::mask_events`].
pub struct MaskEvents<B: Backend> {
    backend: Arc<B>,
    seen: MaskedRanks,
    wait: Option<Registration>,
}

impl<B: Backend> std::fmt::Debug for MaskEvents<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MaskEvents").field("seen", &self.seen).finish()
    }
}

/// How long one registration with the reactor lasts before it is renewed (the stream has no
/// deadline of its own).
const WATCH: Duration = Duration::from_secs(3600);

impl<B: Backend> Stream for MaskEvents<B> {
    type Item = MaskEvent;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<MaskEvent>> {
        loop {
            let now = self.backend.masked_ranks();
            if let Some(event) = MaskEvent::between(&self.seen, &now) {
                self.seen = now;
                self.wait = None;
                return Poll::Ready(Some(event));
            }
            if self.wait.is_none() {
                let (backend, seen) = (Arc::clone(&self.backend), self.seen);
                let probe = Box::new(move || backend.masked_ranks() != seen);
                self.wait = Some(Registration::new(probe, deadline_after(Instant::now(), WATCH)));
            }
            let Some(reg) = self.wait.as_ref() else { continue };
            match reg.poll(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(WaitOutcome::Failed) => return Poll::Ready(None),
                Poll::Ready(WaitOutcome::Ready | WaitOutcome::TimedOut) => self.wait = None,
            }
        }
    }
}

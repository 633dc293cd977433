//! One channel's NCCL communicator and which ranks of the group are in it ([`ChannelComm`]).
//!
//! Without rank masking a channel keeps the communicator the group was made with. With rank
//! masking (low-latency groups with NCCL peers: every peer, or those on other hosts) its
//! members change. NVLink peers are masked through their signal pages as ever; NCCL peers
//! each survivor masks by itself:
//!
//! - **A peer dies.** NCCL's kernel waits for it without a deadline, before the receive kernel
//!   that would mask it. At the operation's host deadline the communicator is revoked
//!   (`ncclCommRevoke`, [`ChannelComm::revoke`]): its kernels end, the stream drains, and the
//!   receive kernel masks the ranks whose arrival words did not come (at its device deadline).
//! - **The channel's next operation** shrinks the communicator to the ranks the group has not
//!   masked ([`ChannelComm::fit`], `ncclCommShrink` with `NCCL_SHRINK_ABORT`, collective over
//!   them: every survivor shrinks at its next operation of the channel, so all must have masked
//!   the same ranks). A shrink that does not end within three group timeouts is an
//!   [`Error::Timeout`], never a hang. In the shrunk communicator the survivors are numbered in
//!   order; [`ChannelComm::peer`] translates.
//! - **A rejoin** ([`crate::GpuRank::admit`]) puts a communicator of the whole group, made over
//!   the rejoin meeting, in its place ([`ChannelComm::replace`]).
//!
//! An operation remembers the generation of the communicator it was issued on: a revoke for an
//! operation whose communicator was already replaced does nothing (the replacement aborted the
//! old one's operations).

use std::sync::Arc;
use std::sync::mpsc;
use std::time::Duration;

use cudarc::driver::CudaContext;
use cudarc::nccl::sys as nccl_sys;
use epflow_core::Error;

use cudarc::nccl::result::{comm_count, comm_user_rank};

use super::nccl::{nccl_err, warm_up};
use crate::device::bind;

/// `NCCL_SHRINK_ABORT` of `nccl.h`: abort the parent's outstanding operations, then shrink.
const NCCL_SHRINK_ABORT: i32 = 0x01;
/// `NCCL_REVOKE_DEFAULT` of `nccl.h`.
const NCCL_REVOKE_DEFAULT: i32 = 0x00;
/// A shrink waits this many group timeouts for the other survivors: they come to it at their
/// next operation of the channel, and a rank that masked the dead one over NVLink (at the
/// device deadline) gets there up to one timeout before one that waited for NCCL's host
/// deadline first.
const SHRINK_TIMEOUTS: u32 = 3;

/// A channel's communicator: the NCCL handle, each group rank's rank in it, and its state.
#[derive(Debug)]
pub(crate) struct ChannelComm {
    comm: nccl_sys::ncclComm_t,
    /// `ranks[r]`: group rank `r`'s rank in `comm`, or -1 (not a member).
    ranks: Vec<i32>,
    /// Counts the communicators this channel has had (0: the group's first).
    generation: u64,
    /// Its operations were revoked: it takes no more before a shrink.
    revoked: bool,
    /// A shrink did not end by its deadline: a thread still waits inside NCCL with `comm`, which
    /// is then neither used nor aborted here.
    lost: bool,
    /// Aborted (or handed to a thread that never came back): unusable.
    closed: bool,
}

/// A communicator address that may cross to the thread that waits in `ncclCommShrink`.
#[derive(Clone, Copy)]
struct CommPtr(nccl_sys::ncclComm_t);
// SAFETY: NCCL communicators may be used from any thread; the shrink thread is the only user of
// the parent while it runs (the channel's lock is held until it returns or is given up).
unsafe impl Send for CommPtr {}

impl ChannelComm {
    /// A communicator of every rank of a group of `num_ranks`, numbered as in the group.
    pub(crate) fn whole(comm: nccl_sys::ncclComm_t, num_ranks: usize) -> Self {
        ChannelComm {
            comm,
            ranks: (0..num_ranks as i32).collect(),
            generation: 0,
            revoked: false,
            lost: false,
            closed: false,
        }
    }

    /// A placeholder that holds no communicator (closed: takes nothing, aborts nothing).
    pub(crate) fn closed() -> Self {
        ChannelComm {
            comm: std::ptr::null_mut(),
            ranks: Vec::new(),
            generation: 0,
            revoked: false,
            lost: false,
            closed: true,
        }
    }

    /// The group ranks in the communicator (bit `r` = rank `r`).
    pub(crate) fn members(&self) -> u32 {
        self.ranks.iter().enumerate().filter(|(_, c)| **c >= 0).fold(0, |m, (r, _)| m | 1 << r)
    }

    /// Counts the communicators this channel has had.
    pub(crate) fn generation(&self) -> u64 {
        self.generation
    }

    /// The NCCL communicator, if it may take operations.
    pub(crate) fn comm(&self) -> Result<nccl_sys::ncclComm_t, Error> {
        if self.closed || self.lost {
            return Err(Error::Backend("the NCCL communicators were aborted after a timeout".into()));
        }
        if self.revoked {
            return Err(Error::Backend(
                "the channel's NCCL communicator was revoked after a timeout and not yet shrunk".into(),
            ));
        }
        Ok(self.comm)
    }

    /// Group rank `r`'s rank in the communicator.
    pub(crate) fn peer(&self, r: usize) -> Result<i32, Error> {
        match self.ranks.get(r) {
            Some(&c) if c >= 0 => Ok(c),
            _ => Err(Error::Backend(format!(
                "rank {r} is not in the channel's NCCL communicator (members {:#b}): it was masked",
                self.members()
            ))),
        }
    }

    /// Revokes the operations of generation `generation` (`ncclCommRevoke`): NCCL's kernels
    /// waiting for a dead peer end. Nothing if the communicator was replaced since (its
    /// operations were aborted then) or already revoked.
    pub(crate) fn revoke(&mut self, generation: u64) -> Result<(), Error> {
        if generation != self.generation || self.revoked || self.closed || self.lost {
            return Ok(());
        }
        // SAFETY: a live communicator of this channel (not closed or lost); revoking is local
        // and leaves it valid for a shrink or an abort.
        unsafe { nccl_sys::ncclCommRevoke(self.comm, NCCL_REVOKE_DEFAULT) }
            .result()
            .map_err(|e| nccl_err("ncclCommRevoke", e))?;
        self.revoked = true;
        tracing::warn!(generation, "NCCL: a channel's communicator revoked after its operation's deadline");
        Ok(())
    }

    /// Revoked, and no member masked in `live` yet: the revoked operation's receive has not
    /// masked the missing peers (it does at its device deadline). A shrink now would wait for
    /// them.
    pub(crate) fn revoked_before_a_mask(&self, live: u32) -> bool {
        self.revoked && !self.closed && !self.lost && self.members() & !live == 0
    }

    /// Makes the communicator hold exactly the members of `live` it holds (the group's
    /// unmasked ranks): if a member is masked, or it was revoked, shrinks it (collective over
    /// the ranks it keeps: see the module), waiting at most three `timeout`s. `ctx`: the rank's
    /// context, current on the shrinking thread.
    pub(crate) fn fit(&mut self, ctx: &Arc<CudaContext>, live: u32, timeout: Duration) -> Result<(), Error> {
        let members = self.members();
        if members & !live == 0 && !self.revoked {
            return Ok(());
        }
        if self.closed || self.lost {
            return self.comm().map(drop);
        }
        let exclude: Vec<i32> = (0..self.ranks.len())
            .filter(|&r| self.ranks[r] >= 0 && live >> r & 1 == 0)
            .map(|r| self.ranks[r])
            .collect();
        let parent = CommPtr(self.comm);
        let ctx = Arc::clone(ctx);
        let (tx, rx) = mpsc::channel();
        let mut list = exclude.clone();
        std::thread::Builder::new()
            .name("epflow-nccl-shrink".into())
            .spawn(move || {
                let parent = parent;
                let made = bind(&ctx).and_then(|()| {
                    let mut child: nccl_sys::ncclComm_t = std::ptr::null_mut();
                    // SAFETY: `parent` is a live communicator this thread alone uses until it
                    // returns; `list` holds `list.len()` ranks of it; `child` is a valid out
                    // pointer; a null config inherits the parent's.
                    unsafe {
                        nccl_sys::ncclCommShrink(
                            parent.0,
                            list.as_mut_ptr(),
                            list.len() as i32,
                            &mut child,
                            std::ptr::null_mut(),
                            NCCL_SHRINK_ABORT,
                        )
                    }
                    .result()
                    .map_err(|e| nccl_err("ncclCommShrink", e))?;
                    // Its pairs connect now, under this deadline: lazily, the first operation's
                    // `ncclGroupEnd` would block the host until every survivor issued one.
                    // SAFETY: `child` is the live communicator just made.
                    let (me, size) = unsafe { (comm_user_rank(child), comm_count(child)) };
                    let (me, size) = (
                        me.map_err(|e| nccl_err("ncclCommUserRank", e))?,
                        size.map_err(|e| nccl_err("ncclCommCount", e))?,
                    );
                    let stream = ctx
                        .new_stream()
                        .map_err(|e| crate::device::cuda("a stream to connect a shrunk communicator", e))?;
                    warm_up(&[child], &ctx, &stream, me as usize, size as usize)?;
                    Ok(CommPtr(child))
                });
                let _ = tx.send(made);
            })
            .map_err(|e| Error::Backend(format!("NCCL: no thread for ncclCommShrink: {e}")))?;
        match rx.recv_timeout(SHRINK_TIMEOUTS * timeout) {
            Ok(Ok(child)) => {
                // SAFETY: the parent is no longer used (its operations were aborted by the
                // shrink); aborting is local.
                let _ = unsafe { nccl_sys::ncclCommAbort(self.comm) };
                let mut next = 0;
                for c in self.ranks.iter_mut() {
                    if *c >= 0 && !exclude.contains(c) {
                        *c = next;
                        next += 1;
                    } else {
                        *c = -1;
                    }
                }
                self.comm = child.0;
                self.generation += 1;
                self.revoked = false;
                tracing::info!(members = format!("{:#b}", self.members()), "NCCL: a channel's communicator shrunk");
                Ok(())
            }
            Ok(Err(e)) => {
                self.revoked = true;
                Err(e)
            }
            Err(_) => {
                self.lost = true;
                Err(Error::Timeout {
                    op: "ncclCommShrink".into(),
                    rank: 0,
                    waiting_for: format!(
                        "the survivors {:#b} to shrink the channel's NCCL communicator (every survivor must have masked the same ranks)",
                        members & live
                    ),
                    after: SHRINK_TIMEOUTS * timeout,
                })
            }
        }
    }

    /// Puts `other` (a communicator of the whole group) in this one's place and returns the old
    /// one (aborted when dropped). The generation goes on counting.
    pub(crate) fn replace(&mut self, mut other: ChannelComm) -> ChannelComm {
        other.generation = self.generation + 1;
        std::mem::swap(self, &mut other);
        other
    }

    /// Aborts the communicator (local; ends its kernels). Idempotent.
    pub(crate) fn abort(&mut self) {
        if !self.closed && !self.lost {
            // SAFETY: a communicator this channel owns, aborted once (`closed` guards).
            let _ = unsafe { nccl_sys::ncclCommAbort(self.comm) };
        }
        self.closed = true;
    }
}

impl Drop for ChannelComm {
    fn drop(&mut self) {
        self.abort();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn members_and_peers_follow_the_ranks() {
        let mut c = ChannelComm::whole(std::ptr::null_mut(), 4);
        assert_eq!(c.members(), 0b1111);
        c.ranks = vec![0, -1, 1, -1];
        assert_eq!(c.members(), 0b0101);
        assert_eq!(c.peer(2).unwrap(), 1);
        assert!(c.peer(1).is_err());
        assert!(c.peer(9).is_err());
        // A closed communicator takes nothing, and a null one is never aborted.
        c.closed = true;
        assert!(c.comm().is_err());
    }
}

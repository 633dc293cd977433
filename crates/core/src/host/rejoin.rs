//! Replacing a dead rank of a running host world ([`crate::mask`], "Rejoining"): a rank thread
//! that exited is replaced by a new [`HostRank`] made through the world's [`HostRendezvous`],
//! which joins the survivors' meeting ([`crate::backend::Backend::rejoin`] /
//! [`crate::backend::Backend::admit`]). The survivors keep their ranks, handles and buffers.

use std::sync::Arc;
use std::time::Duration;

use super::HostWorldShared;
use super::mask::{Meeting, Unmask, meet_and_reset};
use super::outputs::Buffers;
use super::rank::HostRank;
use crate::backend::RankCore;
use crate::config::GroupConfig;
use crate::error::{Error, RejoinRefusal, Result};
use crate::mask::RankSet;

/// Where a rank of a host world stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Slot {
    /// Its `HostRank` exists.
    Live,
    /// Its `HostRank` was dropped (the rank's thread ended).
    Gone,
    /// A replacement was made and has not finished joining.
    Joining,
}

/// Where a replacement for a dead rank meets its world: the host model of a GPU group's
/// rendezvous (the TCP rendezvous or NCCL bootstrap it was made with). Any rank hands it out
/// ([`HostRank::rendezvous`]); it keeps the world's shared memory alive, not its ranks.
#[derive(Clone, Debug)]
pub struct HostRendezvous {
    world: Arc<HostWorldShared>,
}

impl HostRank {
    /// The world's rendezvous, where a replacement for a dead rank is made
    /// ([`HostRendezvous::replace`]).
    pub fn rendezvous(&self) -> HostRendezvous {
        HostRendezvous { world: Arc::clone(&self.world) }
    }
}

impl Drop for HostRank {
    fn drop(&mut self) {
        let mut slots = self.world.slots.lock().unwrap_or_else(|e| e.into_inner());
        slots[self.core.rank()] = Slot::Gone;
    }
}

/// The ranks that still serve: those whose own word does not mask them, `except` left out.
fn survivors(world: &HostWorldShared, except: usize) -> Vec<usize> {
    (0..world.num_ranks).filter(|&s| s != except && !world.masks.holds(s, s)).collect()
}

impl HostRendezvous {
    /// Ranks in the world.
    pub fn num_ranks(&self) -> usize {
        self.world.num_ranks
    }

    /// The world's config.
    pub fn config(&self) -> &GroupConfig {
        &self.world.config
    }

    /// A replacement for rank `rank`, whose old [`HostRank`] is gone and which the survivors
    /// have masked, made with `config` (the group's). Give it to a new thread, which calls
    /// [`crate::backend::Backend::rejoin`] while every survivor calls
    /// [`crate::backend::Backend::admit`]; until then its operations fail with
    /// [`Error::RankMasked`].
    ///
    /// Refused with [`Error::RejoinRefused`] (nothing changes) when the group has no rank
    /// masking, when the old rank still exists, when another replacement is joining, when no
    /// survivor has `rank` masked, or when `config` is not the group's; a rank outside the world
    /// is [`Error::RankOutOfRange`].
    pub fn replace(&self, rank: usize, config: &GroupConfig) -> Result<HostRank> {
        let w = &self.world;
        let refused = |why| Error::RejoinRefused { rank, why };
        if rank >= w.num_ranks {
            return Err(Error::RankOutOfRange { op: "replace".into(), rank, limit: w.num_ranks });
        }
        if !w.config.rank_masking {
            return Err(refused(RejoinRefusal::MaskingOff));
        }
        if *config != w.config {
            return Err(refused(RejoinRefusal::ConfigMismatch(format!(
                "the group's is {:?}, the replacement's {:?}",
                w.config, config
            ))));
        }
        let mut slots = w.slots.lock().unwrap_or_else(|e| e.into_inner());
        match slots[rank] {
            Slot::Live => return Err(refused(RejoinRefusal::StillAlive)),
            Slot::Joining => return Err(refused(RejoinRefusal::AlreadyJoining)),
            Slot::Gone => {}
        }
        let alive = survivors(w, rank);
        let Some(view) = alive.iter().map(|&s| w.masks.view(s)).find(|v| v.contains(rank)) else {
            return Err(refused(RejoinRefusal::NotMasked));
        };
        slots[rank] = Slot::Joining;
        // Its word says what the survivors' says, itself included: it neither sends nor waits
        // (its operations are refused) until the meeting takes it out.
        w.masks.word(rank).store(&view);
        let core = RankCore::new(rank, w.num_ranks, w.group_id, w.config.clone());
        core.set_mask_epoch(w.epoch.load(std::sync::atomic::Ordering::Acquire));
        Ok(HostRank { world: Arc::clone(w), core, buffers: Buffers::new(w.config.buffer_sets) })
    }
}

/// The ranks that meet when `joining` are admitted, as `view` (a survivor's mask word) sees the
/// group: every rank it does not mask, and the replacements.
fn meeting(world: &HostWorldShared, view: &RankSet, joining: &RankSet, timeout: Duration) -> Result<Meeting> {
    let n = world.num_ranks;
    let who = RankSet::from_ranks((0..n).filter(|&s| !view.contains(s) || joining.contains(s)), n)?;
    Ok(Meeting { what: "admit", who, unmask: Unmask::Ranks(*joining), timeout, poison: false })
}

/// A survivor's side of admitting the replacements for `ranks` (every survivor calls it with the
/// same `ranks`, with no operation in flight).
pub(crate) fn admit(rank: &HostRank, ranks: &RankSet, timeout: Duration) -> Result<()> {
    let (w, core) = (&rank.world, &rank.core);
    let me = core.rank();
    rank.check_masking("admit")?;
    ranks.check_range("admit", w.num_ranks)?;
    core.poison().check()?;
    if w.masks.holds(me, me) {
        return Err(Error::RankMasked { op: "admit".into(), rank: me });
    }
    if ranks.contains(me) {
        return Err(Error::Unsupported(format!(
            "admit: rank {me} cannot admit itself (a replacement calls rejoin; a masked live rank unmask_all)"
        )));
    }
    let view = w.masks.view(me);
    if let Some(r) = ranks.iter().find(|&r| !view.contains(r)) {
        return Err(Error::RejoinRefused { rank: r, why: RejoinRefusal::NotMasked });
    }
    meet_and_reset(w, core, &meeting(w, &view, ranks, timeout)?)
}

/// A replacement's side of the admission: meets the survivors, then serves as a full member.
pub(crate) fn rejoin(rank: &HostRank, timeout: Duration) -> Result<()> {
    let (w, core) = (&rank.world, &rank.core);
    let me = core.rank();
    rank.check_masking("rejoin")?;
    let joining = w.slots.lock().unwrap_or_else(|e| e.into_inner())[me] == Slot::Joining;
    if !joining {
        return Err(Error::Unsupported(format!(
            "rejoin: rank {me} is no replacement (HostRendezvous::replace makes one; a masked live rank calls unmask_all)"
        )));
    }
    // The survivors' view now (masks may have grown since the replacement was made), with this
    // rank in it until the meeting takes it out.
    let me_set = RankSet::from_ranks([me], w.num_ranks)?;
    let view = survivors(w, me).first().map_or_else(|| w.masks.view(me), |&s| w.masks.view(s)).union(&me_set);
    w.masks.word(me).store(&view);
    meet_and_reset(w, core, &meeting(w, &view, &me_set, timeout)?)?;
    w.slots.lock().unwrap_or_else(|e| e.into_inner())[me] = Slot::Live;
    Ok(())
}

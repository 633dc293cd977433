//! Replacing a dead rank of a running host world ([`crate::mask`], "Rejoining"): a rank thread
//! that exited is replaced by a new [`HostRank`] made through the world's [`HostRendezvous`],
//! which joins the survivors' meeting ([`crate::backend::Backend::rejoin`] /
//! [`crate::backend::Backend::admit`], in `mask.rs`). The survivors keep their ranks, handles
//! and buffers.

use std::sync::Arc;

use super::mask::survivors;
use super::outputs::Buffers;
use super::rank::HostRank;
use super::{HostWorldShared, Slot};
use crate::backend::RankCore;
use crate::config::GroupConfig;
use crate::error::{Error, RejoinRefusal, Result};

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
    /// masking, when the old rank still exists or its detached operations still run (they end
    /// by the group's timeout: try again), when another replacement is joining, when no
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
        if w.ops_alive[rank].load(std::sync::atomic::Ordering::Acquire) > 0 {
            return Err(refused(RejoinRefusal::OldOperationsRunning));
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

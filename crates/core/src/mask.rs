//! Rank masking: a low-latency group that survives a dead rank ([`GroupConfig::rank_masking`](crate::GroupConfig::rank_masking)).
//!
//! ## The rules
//!
//! - **Detection.** A wait of an operation (a peer's data, or a peer's buffer credit) that runs
//!   past the group's timeout does not poison the group: the ranks it waited for are *masked*.
//!   On the GPU backend the kernel does this itself at its device deadline (90 % of the
//!   timeout); on the host backend the driver does it at the timeout.
//! - **The operation that saw it completes with what arrived.** A masked source's data is not
//!   used, even if it arrived; a masked destination gets nothing. So every output is either
//!   exact or missing a masked rank's share, never stale:
//!   - dispatch: the rows from masked sources are absent (the expert side never sees them);
//!   - combine: each top-k entry whose expert lives on a masked rank contributes zero, and
//!     [`crate::ops::CombineOutputs::masked`] counts such entries per token (`[B]` int32). A
//!     token with a non-zero count has a partial result; the caller decides what to do with it
//!     (re-route to replicas, recompute, or serve it).
//! - **Later operations skip masked ranks**: no sends to them, no waits for them.
//! - **The masked rank learns it.** Every mask update also marks the masked rank in its own
//!   word, so its next operation fails with [`crate::Error::RankMasked`] instead of waiting for
//!   peers that no longer wait for it. The rule, on both backends: an operation ends in
//!   `RankMasked` when this rank's bit is in the mask the operation decided its absent ranks
//!   with (the host backend: when the rank takes its result; GPUs: when the receive kernel got
//!   past its waits), and an operation called after that is refused with it. An operation
//!   that decided before the bit came ends `Ok` with whole outputs: the peers had sent before
//!   they gave up on this rank; the next one is refused. A late rank's stream-ordered
//!   operation whose outputs were handed out before the device decided (GPUs) reports it
//!   through its `Completion`; that does not poison the group, so `unmask_all` or a rejoin
//!   brings the rank back.
//!
//! ## How the survivors agree
//!
//! Every rank holds its mask in peer-visible memory (a word of the GPU signal page; a
//! [`SharedMask`] on the host backend). A rank that masks `X` ORs `X` into its own word and into
//! every other rank's word, so one detection reaches everyone. Waits check the mask while they
//! wait: a survivor still waiting for `X` stops at once when a peer masks `X`, instead of running
//! into its own deadline. Bits are only ever added (OR), so two ranks that detect at once, or
//! detect different ranks, end with the same union. For a moment two survivors may disagree (one
//! has not yet seen the other's store): the lagging one at worst waits for `X` once more and
//! masks it itself (or sees the bit on its next check); operations never block on the
//! disagreement. Which survivors still used the data of `X` in the operation where it died is
//! the one thing that may differ between them; each output says so in its per-token counts.
//!
//! A rank's view ([`MaskedRanks`]) is what its own word says. On GPUs the host sees the word
//! through a mirror the rank's kernels write, so a mask set by a peer shows once this rank's
//! next operation has run (or after [`crate::backend::Backend::mask_ranks`]).
//!
//! ## Recovery
//!
//! `unmask_all` is a collective of **every** rank, the masked ones included, with no operation
//! in flight on any of them: the ranks meet (a barrier with the group's timeout), agree on the
//! next sequence number of each channel (the largest any rank reached), reset the buffer credits
//! to it, clear every mask word, and meet again. Afterwards the group is whole and results are
//! bit-exact with the full group again. The mask epoch ([`MaskedRanks::epoch`]) counts the
//! calls; a combine whose handle was dispatched in an earlier epoch is refused
//! ([`crate::Error::StaleMaskEpoch`]): dispatch again first.
//!
//! ## Rejoining
//!
//! A rank whose process died can be replaced while the survivors keep their group (the host
//! backend today; on GPUs the group is still rebuilt: every process, the restarted one
//! included, creates a new group, see `docs/surviving-a-dead-rank.md`).
//!
//! 1. The replacement is made for rank `r` through the group's rendezvous
//!    (`HostRank::rendezvous` then `HostRendezvous::replace`). It is refused, with
//!    [`crate::Error::RejoinRefused`] and nothing changed, when the group has no rank masking,
//!    when `r`'s old rank still exists or its detached operations still run (until the group's
//!    timeout), when another replacement for `r` is joining, when no survivor has `r` masked, or
//!    when the replacement's config is not the group's. Until it
//!    has joined, its own operations fail with [`crate::Error::RankMasked`].
//! 2. When the server says so, with no operation in flight, every survivor calls `admit(r)`
//!    and the replacement calls `rejoin`: a meeting of those ranks (the ranks still masked
//!    stay out), with a deadline. As in `unmask_all` they agree on the next sequence number of
//!    each channel, reset the credits of their cells to it, take `r` out of their mask words,
//!    advance the mask epoch, and meet again. The survivors keep their handles' memory; a
//!    combine on a handle dispatched before the admission is
//!    [`crate::Error::StaleMaskEpoch`].
//! 3. If a participant does not come within the deadline, every other one fails with
//!    [`crate::Error::Timeout`] naming it, and the group is not poisoned: if it was the
//!    replacement, `r` is masked again and the survivors serve on as before; if it was a
//!    survivor, it is masked by the next operation's timeout as any dead rank is.
//!
//! Afterwards the group is whole: results are bit-exact with the full group again.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::config::MAX_RANKS;
use crate::error::{Error, Result};

const WORDS: usize = MAX_RANKS.div_ceil(64);

/// A set of ranks (`0 .. MAX_RANKS`), as a bitmask.
///
/// A rank enters a set only through a range check ([`RankSet::insert`],
/// [`RankSet::from_ranks`]): a rank the set cannot hold, or one outside the group, is an
/// [`Error::RankOutOfRange`], never silently dropped.
#[derive(Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct RankSet {
    words: [u64; WORDS],
}

impl RankSet {
    /// The empty set.
    pub const fn new() -> Self {
        RankSet { words: [0; WORDS] }
    }

    /// The set of ranks whose bits are set in `bits` (ranks 0..64; the GPU mask word).
    pub const fn from_low_bits(bits: u64) -> Self {
        let mut words = [0; WORDS];
        words[0] = bits;
        RankSet { words }
    }

    /// Ranks 0..64 as bits (the GPU mask word; GPU groups have at most 8 ranks per host).
    pub const fn low_bits(&self) -> u64 {
        self.words[0]
    }

    /// Adds `rank`; a rank at or past [`MAX_RANKS`] (which no group has) is
    /// [`Error::RankOutOfRange`] and leaves the set as it was.
    pub fn insert(&mut self, rank: usize) -> Result<()> {
        if rank >= MAX_RANKS {
            return Err(Error::RankOutOfRange { op: "RankSet::insert".into(), rank, limit: MAX_RANKS });
        }
        self.words[rank / 64] |= 1 << (rank % 64);
        Ok(())
    }

    /// The set of `ranks` of a group of `num_ranks`: each is checked against `num_ranks` first,
    /// then against what a set holds ([`MAX_RANKS`]); the first out of range is
    /// [`Error::RankOutOfRange`].
    pub fn from_ranks(ranks: impl IntoIterator<Item = usize>, num_ranks: usize) -> Result<RankSet> {
        let mut s = RankSet::new();
        for rank in ranks {
            if rank >= num_ranks {
                return Err(Error::RankOutOfRange { op: "RankSet::from_ranks".into(), rank, limit: num_ranks });
            }
            s.insert(rank)?;
        }
        Ok(s)
    }

    /// The first rank of the set at or past `num_ranks`, as [`Error::RankOutOfRange`] of `op`:
    /// how a backend refuses a set naming ranks outside its group.
    pub fn check_range(&self, op: &str, num_ranks: usize) -> Result<()> {
        match self.iter().find(|&r| r >= num_ranks) {
            Some(rank) => Err(Error::RankOutOfRange { op: op.into(), rank, limit: num_ranks }),
            None => Ok(()),
        }
    }

    /// Whether `rank` is in the set.
    pub fn contains(&self, rank: usize) -> bool {
        rank < MAX_RANKS && self.words[rank / 64] >> (rank % 64) & 1 == 1
    }

    /// Whether the set is empty.
    pub fn is_empty(&self) -> bool {
        self.words.iter().all(|&w| w == 0)
    }

    /// Number of ranks in the set.
    pub fn len(&self) -> usize {
        self.words.iter().map(|w| w.count_ones() as usize).sum()
    }

    /// The union.
    pub fn union(&self, other: &RankSet) -> RankSet {
        let mut out = *self;
        for (o, w) in out.words.iter_mut().zip(&other.words) {
            *o |= w;
        }
        out
    }

    /// The ranks of `self` that are not in `other`.
    pub fn difference(&self, other: &RankSet) -> RankSet {
        let mut out = *self;
        for (o, w) in out.words.iter_mut().zip(&other.words) {
            *o &= !w;
        }
        out
    }

    /// The ranks, ascending.
    pub fn iter(&self) -> impl Iterator<Item = usize> + '_ {
        (0..MAX_RANKS).filter(|&r| self.contains(r))
    }

    /// The ranks, ascending.
    pub fn to_vec(&self) -> Vec<usize> {
        self.iter().collect()
    }
}

impl fmt::Debug for RankSet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_set().entries(self.iter()).finish()
    }
}

/// What one rank knows about the group's mask: the masked ranks and the number of completed
/// `unmask_all` calls.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct MaskedRanks {
    /// The ranks this rank no longer sends to or waits for (it may contain this rank itself:
    /// then the group masked it, and its operations fail with [`crate::Error::RankMasked`]).
    pub ranks: RankSet,
    /// How many times the group has run `unmask_all`.
    pub epoch: u64,
}

/// One change of a rank's view of the mask, as a server task sees it
/// (`epflow_async::Group::mask_events`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MaskEvent {
    /// The view after the change.
    pub now: MaskedRanks,
    /// Ranks masked since the previous event.
    pub added: RankSet,
    /// Whether the change was an `unmask_all` (then `added` is empty and `now.ranks` usually is).
    pub unmasked: bool,
}

impl MaskEvent {
    /// The event between two views, or `None` if they are equal.
    pub fn between(before: &MaskedRanks, now: &MaskedRanks) -> Option<MaskEvent> {
        (before != now).then(|| MaskEvent {
            now: *now,
            added: now.ranks.difference(&before.ranks),
            unmasked: now.epoch != before.epoch,
        })
    }
}

/// One rank's mask word in peer-visible memory (the host backend's model of the word in a GPU
/// rank's signal page): peers only ever OR bits into it, so concurrent detections merge.
#[derive(Debug, Default)]
pub struct SharedMask {
    words: [AtomicU64; WORDS],
}

impl SharedMask {
    /// The ranks set now (acquire).
    pub fn load(&self) -> RankSet {
        let mut s = RankSet::new();
        for (o, w) in s.words.iter_mut().zip(&self.words) {
            *o = w.load(Ordering::Acquire);
        }
        s
    }

    /// Whether `rank` is set now.
    pub fn contains(&self, rank: usize) -> bool {
        rank < MAX_RANKS && self.words[rank / 64].load(Ordering::Acquire) >> (rank % 64) & 1 == 1
    }

    /// ORs `ranks` in (release).
    pub fn add(&self, ranks: &RankSet) {
        for (w, &bits) in self.words.iter().zip(&ranks.words) {
            if bits != 0 {
                w.fetch_or(bits, Ordering::AcqRel);
            }
        }
    }

    /// Clears `ranks`' bits (release): only inside an admission's meeting ([`crate::mask`],
    /// "Rejoining"), between its two barriers.
    pub fn remove(&self, ranks: &RankSet) {
        for (w, &bits) in self.words.iter().zip(&ranks.words) {
            if bits != 0 {
                w.fetch_and(!bits, Ordering::AcqRel);
            }
        }
    }

    /// Stores `ranks` (release): a replacement rank's word, copied from a survivor's.
    pub fn store(&self, ranks: &RankSet) {
        for (w, &bits) in self.words.iter().zip(&ranks.words) {
            w.store(bits, Ordering::Release);
        }
    }

    /// Clears every bit (only inside `unmask_all`, between its two barriers).
    pub fn clear(&self) {
        self.words.iter().for_each(|w| w.store(0, Ordering::Release));
    }
}

/// Masks `ranks` in a world whose ranks' words are `words`: ORs them into every word, the
/// masked ranks' own included (so they learn it).
pub fn spread(words: &[SharedMask], ranks: &RankSet) {
    for w in words {
        w.add(ranks);
    }
}

/// Rank `me` gave up waiting for `ranks`: it masks them everywhere ([`spread`]), unless the
/// group has masked `me` already — a rank that finds itself masked masks no one, so a slow
/// rank that the survivors gave up on never masks the survivors back. Returns whether it
/// masked. The rule both backends follow (the GPU kernels' `spread_mask` in `ll_base.cuh`).
pub fn detect(words: &[SharedMask], me: usize, ranks: &RankSet) -> bool {
    if words.get(me).is_some_and(|w| w.contains(me)) || ranks.is_empty() {
        return false;
    }
    spread(words, ranks);
    true
}

/// The top-k rows of `topk_idx` (`[B x K]`, `-1` = no expert) with every entry whose expert
/// lives on a rank of `masked` replaced by `-1`: the routing a masked group serves. `local` is
/// the experts per rank.
pub fn without_masked_experts(topk_idx: &[i64], local: usize, masked: &RankSet) -> Vec<i64> {
    topk_idx.iter().map(|&e| if e >= 0 && masked.contains(e as usize / local.max(1)) { -1 } else { e }).collect()
}

/// Per token, how many of its top-k entries name an expert on a rank of `masked` (what
/// [`crate::ops::CombineOutputs::masked`] reports). `topk_idx` is `[B x K]`.
pub fn masked_entries(topk_idx: &[i64], top_k: usize, local: usize, masked: &RankSet) -> Vec<i32> {
    topk_idx
        .chunks(top_k.max(1))
        .map(|row| row.iter().filter(|&&e| e >= 0 && masked.contains(e as usize / local.max(1))).count() as i32)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rank_sets_hold_every_rank() {
        let mut s = RankSet::new();
        for r in [0, 63, 64, 1023] {
            s.insert(r).unwrap();
        }
        // Issue 64 item 3: a rank the set cannot hold is an error, not silently dropped.
        for r in [1024, 5000, usize::MAX] {
            assert_eq!(
                s.insert(r),
                Err(Error::RankOutOfRange { op: "RankSet::insert".into(), rank: r, limit: MAX_RANKS })
            );
        }
        assert_eq!(s.to_vec(), vec![0, 63, 64, 1023]);
        assert_eq!(s.len(), 4);
        assert_eq!(RankSet::from_low_bits(0b1010).to_vec(), vec![1, 3]);
        let t: RankSet = RankSet::from_ranks([3, 64], MAX_RANKS).unwrap();
        assert_eq!(s.difference(&t).to_vec(), vec![0, 63, 1023]);
        assert_eq!(RankSet::from_low_bits(0b1010).union(&t).to_vec(), vec![1, 3, 64]);
    }

    #[test]
    fn ranks_are_checked_against_the_group_before_the_set() {
        let four = RankSet::from_ranks([0, 3], 4).unwrap();
        assert_eq!(four.to_vec(), vec![0, 3]);
        for r in [4, 1024, usize::MAX] {
            assert_eq!(
                RankSet::from_ranks([1, r], 4),
                Err(Error::RankOutOfRange { op: "RankSet::from_ranks".into(), rank: r, limit: 4 })
            );
        }
        // A group larger than a set can hold still meets the set's bound.
        assert_eq!(
            RankSet::from_ranks([MAX_RANKS], usize::MAX),
            Err(Error::RankOutOfRange { op: "RankSet::insert".into(), rank: MAX_RANKS, limit: MAX_RANKS })
        );
        assert_eq!(four.check_range("mask_ranks", 4), Ok(()));
        assert_eq!(
            four.check_range("mask_ranks", 3),
            Err(Error::RankOutOfRange { op: "mask_ranks".into(), rank: 3, limit: 3 })
        );
        assert_eq!(
            Error::RankOutOfRange { op: "mask".into(), rank: 1024, limit: 4 }.to_string(),
            "mask: rank 1024 is out of range: the ranks are 0..4"
        );
    }

    #[test]
    fn masked_experts_and_counts() {
        // 4 ranks x 2 experts; rank 1 (experts 2, 3) masked.
        let masked: RankSet = RankSet::from_ranks([1], MAX_RANKS).unwrap();
        let topk = [0, 2, 3, -1, 7, 1];
        assert_eq!(without_masked_experts(&topk, 2, &masked), vec![0, -1, -1, -1, 7, 1]);
        assert_eq!(masked_entries(&topk, 3, 2, &masked), vec![2, 0]);
    }

    #[test]
    fn events_say_what_changed() {
        let a = MaskedRanks { ranks: RankSet::from_ranks([1], MAX_RANKS).unwrap(), epoch: 0 };
        let b = MaskedRanks { ranks: RankSet::from_ranks([1, 2], MAX_RANKS).unwrap(), epoch: 0 };
        assert_eq!(MaskEvent::between(&a, &a), None);
        let e = MaskEvent::between(&a, &b).unwrap();
        assert_eq!((e.added.to_vec(), e.unmasked), (vec![2], false));
        let c = MaskedRanks { ranks: RankSet::new(), epoch: 1 };
        assert!(MaskEvent::between(&b, &c).unwrap().unmasked);
    }
}

//! Rank masking on the host backend ([`crate::mask`]): every rank's mask word, and the meeting
//! board of `unmask_all`.

use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::HostWorldShared;
use crate::backend::RankCore;
use crate::error::{Error, Result};
use crate::mask::{RankSet, SharedMask, detect, spread};
use crate::protocol::{Channel, deadline_after};

/// The masks of a host world: one word per rank (the model of a word in each GPU rank's
/// peer-visible signal page), and where `unmask_all` meets.
#[derive(Debug)]
pub(crate) struct HostMasks {
    words: Vec<SharedMask>,
    board: Mutex<Board>,
    changed: Condvar,
}

/// Per rank: the epoch of the `unmask_all` it has posted its next sequence numbers for, and of
/// the one it has finished resetting for.
#[derive(Debug)]
struct Board {
    posted: Vec<(u64, [u64; 3])>,
    reset: Vec<u64>,
}

impl HostMasks {
    pub(crate) fn new(num_ranks: usize) -> Self {
        HostMasks {
            words: (0..num_ranks).map(|_| SharedMask::default()).collect(),
            board: Mutex::new(Board { posted: vec![(0, [0; 3]); num_ranks], reset: vec![0; num_ranks] }),
            changed: Condvar::new(),
        }
    }

    /// What `rank`'s word says now.
    pub(crate) fn view(&self, rank: usize) -> RankSet {
        self.words[rank].load()
    }

    /// Whether `rank`'s word holds `other`.
    pub(crate) fn holds(&self, rank: usize, other: usize) -> bool {
        self.words[rank].contains(other)
    }

    /// Whether `rank` neither sends to nor waits for `peer`: its word holds `peer`, or `rank`
    /// itself (a masked rank waits for no one; its operations end in `RankMasked`).
    pub(crate) fn skips(&self, rank: usize, peer: usize) -> bool {
        self.holds(rank, peer) || self.holds(rank, rank)
    }

    /// `rank`'s word, to read or set directly (a replacement's, from a survivor's).
    pub(crate) fn word(&self, rank: usize) -> &SharedMask {
        &self.words[rank]
    }

    /// Masks `ranks` in every rank's word ([`spread`]): an application's decision.
    pub(crate) fn mask(&self, ranks: &RankSet) {
        spread(&self.words, ranks);
    }

    /// Rank `me` gave up on `ranks` ([`detect`]); whether it masked them.
    pub(crate) fn detect(&self, me: usize, ranks: &RankSet) -> bool {
        detect(&self.words, me, ranks)
    }

    fn lock(&self) -> MutexGuard<'_, Board> {
        self.board.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Waits until `done(board)` or `deadline`; the ranks `missing(board)` names on timeout.
    fn meet<'a>(
        &'a self,
        mut board: MutexGuard<'a, Board>,
        deadline: Instant,
        missing: impl Fn(&Board) -> Vec<usize>,
    ) -> std::result::Result<MutexGuard<'a, Board>, Vec<usize>> {
        loop {
            let left = missing(&board);
            if left.is_empty() {
                return Ok(board);
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(left);
            }
            board = self.changed.wait_timeout(board, deadline - now).unwrap_or_else(|e| e.into_inner()).0;
        }
    }
}

/// What a meeting takes out of the mask words.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Unmask {
    /// Every bit (`unmask_all`).
    All,
    /// The admitted ranks' bits (an admission: the ranks still masked stay masked).
    Ranks(RankSet),
}

/// One epoch-advancing meeting of a host rank: `unmask_all`, or an admission of replacement
/// ranks ([`crate::mask`], "Recovery" and "Rejoining").
#[derive(Clone, Debug)]
pub(crate) struct Meeting {
    /// `"unmask_all"` or `"admit"` (error messages).
    pub what: &'static str,
    /// The ranks that meet, this one included.
    pub who: RankSet,
    /// What the meeting takes out of the mask words.
    pub unmask: Unmask,
    /// How long each of the two meetings may wait.
    pub timeout: Duration,
    /// Whether a timeout poisons the group (`unmask_all`); an admission that times out leaves
    /// the group as it was, the missing replacements masked again.
    pub poison: bool,
}

/// `unmask_all` of one host rank (see [`crate::mask`], "Recovery"): every rank meets.
pub(crate) fn unmask_all(world: &HostWorldShared, core: &RankCore) -> Result<()> {
    let who = RankSet::from_ranks(0..world.num_ranks, world.num_ranks)?;
    let m = Meeting { what: "unmask_all", who, unmask: Unmask::All, timeout: world.config.timeout, poison: true };
    meet_and_reset(world, core, &m)
}

/// One rank's part of meeting `m`: post this rank's next sequence numbers and meet the others;
/// take the largest of each channel; return every credit of this rank's cells up to it, drop
/// what is left in them, take `m.unmask` out of this rank's word, move to the next mask epoch;
/// meet again.
pub(crate) fn meet_and_reset(world: &HostWorldShared, core: &RankCore, m: &Meeting) -> Result<()> {
    let masks = &world.masks;
    let me = core.rank();
    let epoch = core.mask_epoch() + 1;
    let deadline = deadline_after(Instant::now(), m.timeout);
    let failed = |stage: &str, missing: Vec<usize>| {
        let e = Error::Timeout {
            op: format!("{} #{epoch}", m.what),
            rank: me,
            waiting_for: format!("ranks {missing:?} to {stage}"),
            after: m.timeout,
        };
        if m.poison {
            core.poison().poison(e.to_string());
        }
        e
    };
    let mut board = masks.lock();
    board.posted[me] = (epoch, Channel::ALL.map(|c| core.peek_seq(c)));
    masks.changed.notify_all();
    let board = masks
        .meet(board, deadline, |b| m.who.iter().filter(|&s| b.posted[s].0 < epoch).collect())
        .map_err(|missing| failed("arrive", missing))?;
    let next = Channel::ALL.map(|c| m.who.iter().map(|s| board.posted[s].1[c.index()]).max().unwrap_or(0));
    drop(board);

    // Nobody sends until everyone has passed the second meeting, so this rank's cells are quiet.
    let mb = &world.mailboxes;
    for c in Channel::ALL {
        for set_seq in next[c.index()]..next[c.index()] + mb.sets() as u64 {
            for src in 0..world.num_ranks {
                let cell = mb.cell(me, c, set_seq, src);
                drop(cell.take());
                cell.reset_credit(next[c.index()]);
            }
        }
    }
    match m.unmask {
        Unmask::All => masks.words[me].clear(),
        Unmask::Ranks(ranks) => masks.words[me].remove(&ranks),
    }
    core.rejoin_at(next);

    let mut board = masks.lock();
    board.reset[me] = epoch;
    masks.changed.notify_all();
    let met = masks.meet(board, deadline, |b| m.who.iter().filter(|&s| b.reset[s] < epoch).collect());
    if let Err(missing) = met {
        if let Unmask::Ranks(admitted) = m.unmask {
            // A replacement that did not come back is masked again everywhere.
            let gone = RankSet::from_ranks(missing.iter().copied().filter(|&r| admitted.contains(r)), world.num_ranks)?;
            masks.mask(&gone);
        }
        return Err(failed("finish", missing));
    }
    world.epoch.fetch_max(epoch, std::sync::atomic::Ordering::AcqRel);
    Ok(())
}

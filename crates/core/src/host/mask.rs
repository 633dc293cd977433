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

fn meet_timeout(core: &RankCore, epoch: u64, stage: &str, missing: Vec<usize>, after: Duration) -> Error {
    Error::Timeout {
        op: format!("unmask_all #{epoch}"),
        rank: core.rank(),
        waiting_for: format!("ranks {missing:?} to {stage}"),
        after,
    }
}

/// `unmask_all` of one host rank (see [`crate::mask`], "Recovery"): post this rank's next
/// sequence numbers and meet every rank; take the largest of each channel; return every credit
/// of this rank's cells up to it, drop what is left in them, clear this rank's word; meet again.
pub(crate) fn unmask_all(world: &HostWorldShared, core: &RankCore) -> Result<()> {
    let masks = &world.masks;
    let (me, r) = (core.rank(), world.num_ranks);
    let epoch = core.mask_epoch() + 1;
    let timeout = world.config.timeout;
    let deadline = deadline_after(Instant::now(), timeout);
    let mut board = masks.lock();
    board.posted[me] = (epoch, Channel::ALL.map(|c| core.peek_seq(c)));
    masks.changed.notify_all();
    let board = masks.meet(board, deadline, |b| (0..r).filter(|&s| b.posted[s].0 < epoch).collect()).map_err(|m| {
        let e = meet_timeout(core, epoch, "arrive", m, timeout);
        core.poison().poison(e.to_string());
        e
    })?;
    let next = Channel::ALL.map(|c| (0..r).map(|s| board.posted[s].1[c.index()]).max().unwrap_or(0));
    drop(board);

    // Nobody sends until everyone has passed the second meeting, so this rank's cells are quiet.
    let mb = &world.mailboxes;
    for c in Channel::ALL {
        for set_seq in next[c.index()]..next[c.index()] + mb.sets() as u64 {
            for src in 0..r {
                let cell = mb.cell(me, c, set_seq, src);
                drop(cell.take());
                cell.reset_credit(next[c.index()]);
            }
        }
    }
    masks.words[me].clear();
    core.rejoin_at(next);

    let mut board = masks.lock();
    board.reset[me] = epoch;
    masks.changed.notify_all();
    let board = masks.meet(board, deadline, |b| (0..r).filter(|&s| b.reset[s] < epoch).collect()).map_err(|m| {
        let e = meet_timeout(core, epoch, "reset", m, timeout);
        core.poison().poison(e.to_string());
        e
    })?;
    drop(board);
    Ok(())
}

//! Rank masking on the host backend ([`crate::mask`]): every rank's mask word, and the meetings
//! that move the group to its next mask epoch: `unmask_all`, and a survivor's `admit` or a
//! replacement's `rejoin` ("Rejoining").

use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::{HostWorldShared, Slot};
use crate::backend::RankCore;
use crate::error::{Error, RejoinRefusal, Result};
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
                mb.cell(me, c, set_seq, src).reset(next[c.index()]);
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

/// [`Error::Unsupported`] unless the world has rank masking.
fn check_masking(w: &HostWorldShared, what: &str) -> Result<()> {
    if w.config.rank_masking {
        Ok(())
    } else {
        Err(Error::Unsupported(format!("{what} needs a group with rank_masking (GroupConfig::with_rank_masking)")))
    }
}

/// The ranks that still serve: those whose own word does not mask them, `except` left out.
pub(crate) fn survivors(world: &HostWorldShared, except: usize) -> Vec<usize> {
    (0..world.num_ranks).filter(|&s| s != except && !world.masks.holds(s, s)).collect()
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
pub(crate) fn admit(w: &HostWorldShared, core: &RankCore, ranks: &RankSet, timeout: Duration) -> Result<()> {
    let me = core.rank();
    check_masking(w, "admit")?;
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
pub(crate) fn rejoin(w: &HostWorldShared, core: &RankCore, timeout: Duration) -> Result<()> {
    let me = core.rank();
    check_masking(w, "rejoin")?;
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

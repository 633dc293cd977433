//! A new process takes the place of a masked rank in a running low-latency group
//! ([`GpuWorld::rejoin`] in the newcomer, [`GpuRank::admit`] in every survivor), and the
//! survivors never rebuild their group. In a process that drives several ranks, the newcomer may
//! be a new rank of that process (a thread).
//!
//! The meeting runs over a bootstrap of its own that every rank of the group joins, the
//! newcomers at their ranks (e.g. a [`crate::setup::tcp_bootstrap::TcpBootstrap`] on a port the
//! server chose): the group's own bootstrap may be an NCCL communicator, which cannot take a new
//! process. Its rounds, in order:
//! 1. a record of each rank: survivor or newcomer, its host, the group's config (a fingerprint),
//!    a survivor's mask epoch, mask word and count of device meetings ([`GpuRank::meet_on`]).
//!    Every rank checks alike: every newcomer's rank is masked in every survivor's view and every
//!    masked rank has a newcomer; one host (unless the group has NCCL peers); one config; the
//!    survivors agree on the epoch and the
//!    meeting count (which the newcomer takes over, so that its next `meet_on` is theirs). A
//!    failure is [`Error::RejoinRefused`] (no rank masking, a rank not masked, another config)
//!    or [`Error::Unsupported`] (another host, survivors that disagree) on every rank, before
//!    anything changed;
//! 2. the rounds of [`GpuWorld::join_over`]: the newcomer joins as at creation (its memory, the
//!    survivors' mapped with CUDA IPC, or reached by address in one process); the survivors send
//!    what they sent then (their place, their NCCL peers, their memory's record), check that the
//!    NCCL peers pair up (the newcomer joined with the group's transport), make a pair
//!    communicator with each newcomer they reach over NCCL (`transport/nccl_pairs.rs`) and
//!    reach the newcomers' memory over NVLink;
//! 3. a fingerprint of every rank's buffer layout (the newcomer's GPU may not change it);
//! 4. the survivors put the newcomers' memory and NCCL pairs in place of the dead ranks' (no
//!    kernel addresses a masked rank) and let the dead ranks' memory go (their IPC mappings, or
//!    in one process the memory itself); a round makes sure every rank has before any kernel
//!    runs again;
//! 5. the newcomer takes the survivors' mask epoch, and every rank runs `unmask_all`: the ranks
//!    agree on the next operation numbers (the survivors'), reset every credit and the mask, and
//!    the newcomer numbers from there. On the device; with NCCL peers, whose pages are not
//!    mapped, over the meeting, each rank resetting its own page.
//!
//! A rank that dies or never comes makes the meeting's bootstrap time out on the others (naming
//! it); before step 4 the survivors go on as they were (still masked), during `unmask_all` the
//! group fails as `unmask_all` does.

use std::time::Duration;

use epflow_core::mask::RankSet;
use epflow_core::protocol::Channel;
use epflow_core::{Algorithm, Error, GroupConfig, RejoinRefusal};

use super::GpuRank;
use crate::setup::bootstrap::{Bootstrap, all_gather_u64};
use crate::setup::meeting::MeetingSource;
use crate::transport::host_id;
use crate::transport::nccl_pairs::{NcclPairs, pair_ctas, pair_ids};
use crate::transport::peer_memory::{exported, open_exported};
use crate::world::{GpuWorld, place_words};

/// A survivor's record.
const SURVIVOR: u64 = 1;
/// A newcomer's record.
const NEWCOMER: u64 = 2;
/// u64 words of a record: role, host, config fingerprint, mask epoch, mask word, meetings,
/// over NCCL.
const RECORD_WORDS: usize = 7;

/// What the meeting's first round tells every rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Record {
    role: u64,
    host: u64,
    config: u64,
    epoch: u64,
    masked: u64,
    /// The device meetings the rank has called ([`GpuRank::meet_on`]).
    meetings: u64,
    /// 1: the rank reaches peers over NCCL (a survivor's says whether the group spans hosts:
    /// then a newcomer may come on another host than the survivors, its transport checked by
    /// the masks it joins with).
    nccl: u64,
}

impl Record {
    fn words(self) -> [u64; RECORD_WORDS] {
        [self.role, self.host, self.config, self.epoch, self.masked, self.meetings, self.nccl]
    }

    fn from_words(w: &[u64]) -> Self {
        Record { role: w[0], host: w[1], config: w[2], epoch: w[3], masked: w[4], meetings: w[5], nccl: w[6] }
    }
}

/// What the meeting's first round settles: the newcomers, and the survivors' mask epoch and
/// meeting count (which the newcomers take over).
#[derive(Debug, PartialEq, Eq)]
struct Settled {
    newcomers: RankSet,
    epoch: u64,
    meetings: u64,
}

/// FNV-1a of `text`: fingerprints that every process of one build computes alike.
fn fingerprint(text: &str) -> u64 {
    text.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3))
}

/// The fingerprint of what every rank of a group must share.
fn config_fingerprint(c: &GroupConfig, ranks: usize) -> u64 {
    fingerprint(&format!(
        "{ranks} {:?} {} {} {:?} {:?} {} {} {}",
        c.algorithm,
        c.num_experts,
        c.hidden,
        c.max_tokens_per_rank,
        c.dispatch_dtype,
        c.buffer_sets,
        c.rank_masking,
        c.max_top_k
    ))
}

/// The meeting's first round: every rank's record, checked alike on every rank.
fn meet_records(meeting: &(impl Bootstrap + ?Sized), mine: Record) -> Result<Settled, Error> {
    let all = all_gather_u64(meeting, &mine.words())?;
    let records: Vec<Record> = all.chunks_exact(RECORD_WORDS).map(Record::from_words).collect();
    check_records(&records)
}

/// The checks of the records (every rank runs them on the same records, so every rank decides
/// alike).
fn check_records(records: &[Record]) -> Result<Settled, Error> {
    let refuse = |m: String| Err(Error::Unsupported(format!("rejoin: {m}")));
    let mut newcomers = RankSet::default();
    for (r, rec) in records.iter().enumerate() {
        match rec.role {
            NEWCOMER => newcomers.insert(r)?,
            SURVIVOR => {}
            other => return refuse(format!("rank {r} sent role {other}: not an epflow rejoin meeting")),
        }
    }
    let survivors: Vec<(usize, &Record)> = records.iter().enumerate().filter(|(_, r)| r.role == SURVIVOR).collect();
    let Some(&(first, lead)) = survivors.first() else {
        return refuse("no survivor came: every rank is a newcomer (create a new group instead)".into());
    };
    if newcomers.is_empty() {
        return refuse("no newcomer came: every rank is a survivor".into());
    }
    let newcomer = newcomers.iter().next().unwrap_or(0);
    for (r, rec) in records.iter().enumerate() {
        if rec.config != lead.config {
            let why = RejoinRefusal::ConfigMismatch(format!("rank {r}'s differs from rank {first}'s"));
            return Err(Error::RejoinRefused { rank: newcomer, why });
        }
        if rec.host != lead.host && lead.nccl == 0 {
            return refuse(format!(
                "rank {r} is on another host than rank {first}: a rejoin maps memory with CUDA IPC (one host)"
            ));
        }
    }
    for &(r, rec) in &survivors {
        if rec.epoch != lead.epoch {
            return refuse(format!(
                "survivors {first} and {r} are at different unmask epochs ({} and {})",
                lead.epoch, rec.epoch
            ));
        }
        if rec.meetings != lead.meetings {
            return refuse(format!(
                "survivors {first} and {r} have called meet_on {} and {} times (a collective: the same number on every rank)",
                lead.meetings, rec.meetings
            ));
        }
        if let Some(n) = newcomers.iter().find(|&n| rec.masked >> n & 1 == 0) {
            tracing::warn!(survivor = r, rank = n, "rejoin refused: the survivor has not masked the rank");
            return Err(Error::RejoinRefused { rank: n, why: RejoinRefusal::NotMasked });
        }
        if rec.masked != newcomers.low_bits() {
            let masked = RankSet::from_low_bits(rec.masked);
            return refuse(format!(
                "survivor {r} masks ranks {:?}, the newcomers are ranks {:?}: only a masked rank can be replaced, and every masked rank must be",
                masked.to_vec(),
                newcomers.to_vec()
            ));
        }
    }
    Ok(Settled { newcomers, epoch: lead.epoch, meetings: lead.meetings })
}

/// The meeting's layout round: every rank's buffer layout must be the survivors'.
fn meet_layouts(meeting: &(impl Bootstrap + ?Sized), rank: &GpuRank) -> Result<(), Error> {
    let mine = fingerprint(&format!("{:?}", rank.shared.layout));
    let all = all_gather_u64(meeting, &[mine])?;
    if let Some(r) = all.iter().position(|&f| f != all[0]) {
        return Err(Error::Unsupported(format!(
            "rejoin: rank {r}'s buffer layout differs from rank 0's (another GPU model, or another build)"
        )));
    }
    Ok(())
}

/// The meeting's retire round: every survivor has dropped the dead ranks' memory (or its
/// mappings) before any rank's `unmask_all` kernel runs. Dropping a rank's memory synchronizes
/// its context (`RankMemory`'s drop, even where ranks sharing a GPU park the frees themselves)
/// and `cuMemFree` waits for the context's running kernels: a peer's `unmask_all` spinning for
/// this rank would be one of them.
fn meet_retired(meeting: &(impl Bootstrap + ?Sized)) -> Result<(), Error> {
    all_gather_u64(meeting, &[0]).map(drop)
}

/// A survivor's side of the pair communicators the newcomer's join makes: the ids round, then
/// a pair with each newcomer of `make` (collective with it; bounded by
/// [`NcclPairs::setup_limit`], as the newcomer's side is).
fn pairs_with_newcomers(rank: &GpuRank, meeting: &(impl Bootstrap + ?Sized), make: u32) -> Result<NcclPairs, Error> {
    let s = &rank.shared;
    let ids = pair_ids(meeting, make)?;
    NcclPairs::init_within(&s.ctx, s.rank, s.num_ranks, ids, pair_ctas(&s.config), NcclPairs::setup_limit(&s.config))
}

/// Refuses a meeting bootstrap that is not this group's shape.
fn check_meeting(meeting: &(impl Bootstrap + ?Sized), rank: usize, ranks: usize) -> Result<(), Error> {
    if meeting.rank() != rank || meeting.world_size() != ranks {
        return Err(Error::Unsupported(format!(
            "rejoin: the meeting is rank {} of {}, the group's rank is {rank} of {ranks}",
            meeting.rank(),
            meeting.world_size()
        )));
    }
    Ok(())
}

impl GpuWorld {
    /// Takes the place of masked rank `meeting.rank()` in a running low-latency group whose
    /// survivors call [`GpuRank::admit`] on the same meeting (collective with them; see the
    /// module's rounds). `config` must be the group's (rank masking on). Returns this process's
    /// rank, numbering its operations from the survivors' next ones. Errors, on every rank
    /// alike: the rank is not masked, another config ([`Error::RejoinRefused`]); another host,
    /// another buffer layout ([`Error::Unsupported`]); a rank that does not come
    /// ([`Error::Timeout`] of the bootstrap, or of `unmask_all`).
    pub fn rejoin(meeting: &(impl Bootstrap + ?Sized), config: GroupConfig) -> Result<GpuRank, Error> {
        Self::rejoin_with(meeting, config, crate::Transport::Auto)
    }

    /// [`GpuWorld::rejoin`] into a group made with `transport` (the group's own): with NCCL
    /// peers (`Transport::Nccl`, or across hosts) the newcomer makes a pair communicator with
    /// each of them, which replaces the dead rank's (`transport/nccl_pairs.rs`); that set-up
    /// is bounded as the survivors' is ([`Error::Timeout`] after three group timeouts, at
    /// least 30 s, if a survivor fails between its rounds).
    pub fn rejoin_with(
        meeting: &(impl Bootstrap + ?Sized),
        config: GroupConfig,
        transport: crate::Transport,
    ) -> Result<GpuRank, Error> {
        let ranks = meeting.world_size();
        refuse_config(&config, meeting.rank())?;
        let config_print = config_fingerprint(&config, ranks);
        let nccl = u64::from(transport.nccl_mask(meeting.rank(), ranks, None)? != 0);
        let mine =
            Record { role: NEWCOMER, host: host_id(), config: config_print, epoch: 0, masked: 0, meetings: 0, nccl };
        let settled = meet_records(meeting, mine)?;
        let joined = GpuWorld::join_over(meeting, config, transport)?;
        meet_layouts(meeting, &joined)?;
        meet_retired(meeting)?;
        joined.core.set_mask_epoch(settled.epoch);
        joined.shared.meetings.store(settled.meetings, std::sync::atomic::Ordering::Relaxed);
        if joined.shared.nccl.is_some() {
            joined.unmask_all_over(meeting)?;
        } else {
            joined.unmask_all_now()?;
        }
        Ok(joined)
    }
}

impl GpuRank {
    /// Gives this rank the source of its rejoin meetings, so that `Group::admit` (which takes
    /// no bootstrap) can run [`GpuRank::admit`] on a new one.
    pub fn set_meeting_source(&self, source: MeetingSource) {
        self.shared.meeting_source.set(source);
    }

    /// `Backend::admit`: [`GpuRank::admit`] over a meeting from the rank's
    /// [`MeetingSource`]. A GPU meeting admits every masked rank at once (each needs its
    /// newcomer), so `ranks` must be this rank's masked set. Refused before any meeting: a
    /// poisoned group (its error), no rank masking or a rank not masked
    /// ([`Error::RejoinRefused`]), no meeting source, this rank masked itself, no rank asked, a
    /// masked rank left out ([`Error::Unsupported`]).
    pub(super) fn admit_from_source(&self, ranks: &RankSet, timeout: Duration) -> Result<(), Error> {
        self.core.poison().check()?;
        refuse_config(&self.shared.config, self.shared.rank)?;
        let masked = self.mask_view().ranks;
        if masked.contains(self.shared.rank) {
            return Err(Error::Unsupported(format!(
                "admit: rank {} is masked itself: survivors admit, a replacement joins with GpuWorld::rejoin",
                self.shared.rank
            )));
        }
        if ranks.is_empty() {
            return Err(Error::Unsupported("admit: no rank to admit".into()));
        }
        if let Some(rank) = ranks.iter().find(|&r| !masked.contains(r)) {
            return Err(Error::RejoinRefused { rank, why: RejoinRefusal::NotMasked });
        }
        if masked != *ranks {
            return Err(Error::Unsupported(format!(
                "admit: a GPU meeting admits every masked rank at once ({:?}), not {:?}",
                masked.to_vec(),
                ranks.to_vec()
            )));
        }
        let source = self.shared.meeting_source.get().ok_or_else(|| {
            Error::Unsupported(
                "admit: this GPU rank has no meeting source: call GpuRank::set_meeting_source (or GpuRank::admit with a meeting bootstrap)".into(),
            )
        })?;
        let meeting = source(timeout)?;
        self.admit(&*meeting).map(drop)
    }
}

/// Rejoins take low-latency groups with rank masking.
fn refuse_config(config: &GroupConfig, rank: usize) -> Result<(), Error> {
    if !config.rank_masking {
        return Err(Error::RejoinRefused { rank, why: RejoinRefusal::MaskingOff });
    }
    if config.algorithm != Algorithm::LowLatency {
        return Err(Error::Unsupported(
            "rejoin: low-latency groups only (high-throughput rings cannot skip a rank)".into(),
        ));
    }
    Ok(())
}

impl GpuRank {
    /// Admits the newcomers of `meeting` in place of this group's masked ranks (every survivor
    /// calls it, collective with the newcomers' [`GpuWorld::rejoin`]; see the module's rounds),
    /// with no operation of this rank in flight. Returns the admitted ranks. Until the meeting's
    /// last step nothing changes here that this rank's operations see: on an error before it
    /// this rank goes on as it was (if the retire round fails, the newcomers' addresses are
    /// already in place, but their ranks stay masked, so no kernel addresses them).
    /// Steps captured before it are refused afterwards (they hold the old addresses).
    pub fn admit(&self, meeting: &(impl Bootstrap + ?Sized)) -> Result<RankSet, Error> {
        self.core.poison().check()?;
        let s = &self.shared;
        refuse_config(&s.config, s.rank)?;
        check_meeting(meeting, s.rank, s.num_ranks)?;
        let mine = Record {
            role: SURVIVOR,
            host: host_id(),
            config: config_fingerprint(&s.config, s.num_ranks),
            epoch: self.core.mask_epoch(),
            masked: self.mask_view().ranks.low_bits(),
            meetings: s.meetings.load(std::sync::atomic::Ordering::Relaxed),
            nccl: u64::from(s.nccl.is_some()),
        };
        let newcomers = meet_records(meeting, mine)?.newcomers;
        // `GpuWorld::join_over`'s rounds, as this rank took part in them at creation.
        let ctx = &s.ctx;
        let places = all_gather_u64(meeting, &place_words(ctx)?)?;
        let masks = all_gather_u64(meeting, &[u64::from(s.nccl.as_ref().map_or(0, |n| n.mask))])?;
        // Checked as the newcomer's join checks it: the masks pair up (the newcomer chose the
        // group's transport), ranks share a GPU only where NCCL takes them.
        crate::world::check_transport(&masks, &places)?;
        // NCCL peers: a pair communicator with each newcomer among them, made as the newcomer
        // makes its pairs in its join, replaces the dead rank's (put in place after the layout
        // round, so a refused newcomer changes nothing here).
        let fresh = match &s.nccl {
            Some(n) => Some(pairs_with_newcomers(self, meeting, newcomers.low_bits() as u32 & n.mask)?),
            None => None,
        };
        let (_, mine) = exported(&s.mem)?;
        let all = meeting.all_gather_bytes(&mine)?;
        let mut peers = (*s.peers()).clone();
        // NCCL peers are never addressed (their slots stay this rank's own memory).
        let nvlink = |r: usize| s.nccl.as_ref().is_none_or(|n| !n.via_nccl(r));
        for r in newcomers.iter().filter(|&r| nvlink(r)) {
            let (ptrs, keep) = open_exported(ctx, &all, r)?;
            // The dead rank's memory (its mappings, or in one process the memory itself) goes
            // with the view it is replaced in.
            peers.keep[r] = keep;
            peers.disp_recv[r] = ptrs[0];
            peers.comb_recv[r] = ptrs[1];
            peers.exchange[r] = ptrs[2];
            peers.signals[r] = ptrs[3];
        }
        meet_layouts(meeting, self)?;
        // No kernel of this rank addresses a masked rank: the new addresses take effect with the
        // operations after `unmask_all`.
        drop(s.replace_peers(peers));
        if let (Some(fresh), Some(pairs)) = (fresh, s.nccl.as_ref().and_then(|n| n.pairs.as_ref())) {
            pairs.adopt(fresh);
        }
        meet_retired(meeting)?;
        if s.nccl.is_some() {
            self.unmask_all_over(meeting)?;
        } else {
            self.unmask_all_now()?;
        }
        tracing::info!(
            rank = s.rank,
            admitted = ?newcomers.to_vec(),
            next_dispatch = self.core.peek_seq(Channel::Dispatch),
            "rejoin: newcomers admitted"
        );
        Ok(newcomers)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(role: u64, masked: u64) -> Record {
        let meetings = if role == SURVIVOR { 5 } else { 0 };
        Record { role, host: 7, config: 9, epoch: 2, masked, meetings, nccl: 0 }
    }

    #[test]
    fn a_newcomer_at_the_masked_rank_is_admitted_and_takes_the_survivors_counts() {
        let settled = check_records(&[rec(SURVIVOR, 0b10), rec(NEWCOMER, 0), rec(SURVIVOR, 0b10)]).unwrap();
        assert_eq!((settled.newcomers.low_bits(), settled.epoch, settled.meetings), (0b10, 2, 5));
    }

    #[test]
    fn bad_meetings_are_refused_by_name() {
        let refused = |records: &[Record], needle: &str| match check_records(records) {
            Err(Error::Unsupported(m)) => assert!(m.contains(needle), "{m}"),
            other => panic!("expected a refusal naming {needle:?}, got {other:?}"),
        };
        // A rejoin while the rank is not masked.
        assert_eq!(
            check_records(&[rec(SURVIVOR, 0), rec(NEWCOMER, 0)]).unwrap_err(),
            Error::RejoinRefused { rank: 1, why: RejoinRefusal::NotMasked }
        );
        // A masked rank without a newcomer beside one with.
        refused(&[rec(SURVIVOR, 0b110), rec(NEWCOMER, 0), rec(SURVIVOR, 0b110)], "every masked rank");
        // A replacement with another config.
        let other = Record { config: 10, ..rec(NEWCOMER, 0) };
        assert!(matches!(
            check_records(&[rec(SURVIVOR, 0b10), other]),
            Err(Error::RejoinRefused { rank: 1, why: RejoinRefusal::ConfigMismatch(_) })
        ));
        let far = Record { host: 8, ..rec(NEWCOMER, 0) };
        refused(&[rec(SURVIVOR, 0b10), far], "another host");
        // A group with NCCL peers spans hosts: the newcomer may come on another one (the masks
        // it joins with are checked later).
        assert!(check_records(&[Record { nccl: 1, ..rec(SURVIVOR, 0b10) }, far]).is_ok());
        let late = Record { epoch: 3, ..rec(SURVIVOR, 0b10) };
        refused(&[rec(SURVIVOR, 0b10), rec(NEWCOMER, 0), late], "unmask epochs");
        let met = Record { meetings: 6, ..rec(SURVIVOR, 0b10) };
        refused(&[rec(SURVIVOR, 0b10), rec(NEWCOMER, 0), met], "meet_on");
        refused(&[rec(SURVIVOR, 0), rec(SURVIVOR, 0)], "no newcomer");
        refused(&[rec(NEWCOMER, 0), rec(NEWCOMER, 0)], "no survivor");
        refused(&[rec(SURVIVOR, 0b10), rec(5, 0)], "role 5");
    }

    #[test]
    fn config_fingerprints_tell_groups_apart() {
        let a = GroupConfig::low_latency(16, 32, 2048).with_rank_masking(true);
        assert_eq!(config_fingerprint(&a, 2), config_fingerprint(&a.clone(), 2));
        assert_ne!(config_fingerprint(&a, 2), config_fingerprint(&a, 4));
        assert_ne!(config_fingerprint(&a, 2), config_fingerprint(&GroupConfig::low_latency(16, 32, 4096), 2));
    }
}

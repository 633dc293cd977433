//! A communicator per pair of ranks ([`NcclPairs`]): how a low-latency group with rank masking
//! reaches its NCCL peers.
//!
//! With one communicator of the whole group, a dead peer stalls every transfer of the grouped
//! exchanges it is part of, and NCCL runs a group's peers in rounds: a live peer's transfers
//! wait behind the dead one's, on its side and on the survivors' (seen with three ranks, one
//! dead: the survivor that reached the dead rank over NVLink still stalled in NCCL, and its
//! exchange with the live NCCL peer came out partial when it was cut). So each pair of ranks
//! gets its own communicator for each channel, and each its own stream:
//!
//! - **An operation** orders each live NCCL peer's stream after its send kernel, enqueues that
//!   pair's transfers there, and orders its own stream after each pair's end
//!   ([`NcclPairs::issue`]). A dead peer stalls only its pair's stream.
//! - **At the host deadline** ([`crate::op`]'s `mask_missing`) the pairs whose exchange has
//!   not ended are revoked (`ncclCommRevoke`: their kernels end, the operation's stream goes
//!   on) and their peers masked at once, so the receive kernel does not wait for them. Every
//!   other pair's transfers ended whole before the receive kernel runs.
//! - **A masked peer's pair** takes no more transfers; a rejoin makes new pairs with the
//!   newcomer over its meeting ([`pair_ids`], [`NcclPairs::init`]) and puts them in place of
//!   the old ([`NcclPairs::adopt`]). Nothing is shrunk: the survivors' other pairs never change.
//!
//! In a pair's communicator the lower group rank is rank 0.

use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use cudarc::driver::{CudaContext, CudaEvent, CudaStream};
use cudarc::nccl::{result as nccl, sys as nccl_sys};
use epflow_core::{Error, GroupConfig};

use super::nccl::{Xfer, decode_ids, issue, nccl_err, new_ids, post};
use crate::device::{DeviceBuffer, bind, cuda};
use crate::setup::bootstrap::{Bootstrap, all_gather_u64};
use crate::setup::within::within;

/// `NCCL_REVOKE_DEFAULT` of `nccl.h`.
const NCCL_REVOKE_DEFAULT: i32 = 0x00;
/// An arrival pair's bytes (word and stamp): the last transfer of each peer's exchange.
const ARRIVAL_BYTES: usize = 16;
/// `NCCL_CONFIG_UNDEF_INT` of `nccl.h`: a config field NCCL fills with its default.
const NCCL_CONFIG_UNDEF_INT: i32 = i32::MIN;
/// `NCCL_API_MAGIC` of `nccl.h`.
const NCCL_API_MAGIC: u32 = 0xcafe_beef;
/// The `ncclConfig_t` layout cudarc's binding declares: NCCL 2.28's (`NCCL_VERSION(2, 28, 0)`);
/// a later NCCL reads it by this version and its size, filling later fields with defaults.
const NCCL_CONFIG_VERSION: u32 = 22800;
/// How long a revoked pair waits for its revoke to end before it is aborted or dropped
/// ([`Pair::settle`]); a revoke takes up to 500 ms (NCCL's proxy thread stops at its next poll).
const REVOKE_SETTLE: Duration = Duration::from_secs(10);

/// One pair's communicator on one channel, and the stream its transfers run on.
#[derive(Debug)]
struct Pair {
    comm: nccl_sys::ncclComm_t,
    stream: Arc<CudaStream>,
    /// Counts the pairs this slot has had (a revoke names the one it means).
    generation: u64,
    /// Its operations were revoked: it takes no more.
    revoked: bool,
    /// Aborted already (a revoke that failed), or left to a revoke that did not end: not
    /// aborted (again) when dropped.
    aborted: bool,
    /// The revoke's quiescence, running on a thread of its own ([`Pair::revoke`]): tells
    /// whether it had to abort the communicator when it ends.
    revoking: Option<mpsc::Receiver<bool>>,
}

/// A communicator handed to the thread that revokes it.
struct RevokedComm(nccl_sys::ncclComm_t);

// SAFETY: NCCL communicators may be used from any thread; the pair that owns it touches it
// again only after that thread said it is done (`Pair::settle`), or never.
unsafe impl Send for RevokedComm {}

impl RevokedComm {
    /// The communicator (a method, so a closure takes the whole `Send` wrapper).
    fn get(&self) -> nccl_sys::ncclComm_t {
        self.0
    }
}

impl Pair {
    /// Revokes the pair (`ncclCommRevoke`) on a thread of its own, or aborts it if that fails:
    /// either sets the communicator's abort flags first, so its kernels end at once, then waits
    /// for NCCL's proxy thread to stop, which notices at its next poll, up to 500 ms later
    /// (three channels' revokes in a row took 1.5 s on an H100). The operation waiting for the
    /// kernels need not wait for that.
    fn revoke(&mut self, rank: usize, peer: usize) {
        if self.revoked {
            return;
        }
        self.revoked = true;
        let comm = RevokedComm(self.comm);
        let (tx, rx) = mpsc::channel();
        let spawned = std::thread::Builder::new().name("epflow-nccl-revoke".into()).spawn(move || {
            // SAFETY: a live communicator of this pair, which touches it again only after this
            // thread says it is done; revoking is local and leaves it valid for an abort.
            let revoked = unsafe { nccl_sys::ncclCommRevoke(comm.get(), NCCL_REVOKE_DEFAULT) }.result();
            let aborted = if let Err(e) = revoked {
                // Its kernels must end all the same: abort it (local too).
                tracing::warn!(rank, peer, "NCCL: ncclCommRevoke failed ({:?}); aborting the pair", e.0);
                // SAFETY: as above; the pair marks it aborted when it reads this thread's word.
                let _ = unsafe { nccl::comm_abort(comm.get()) };
                true
            } else {
                false
            };
            let _ = tx.send(aborted);
        });
        match spawned {
            Ok(_) => self.revoking = Some(rx),
            Err(e) => {
                tracing::warn!(rank, peer, "NCCL: no thread to revoke a pair ({e}); aborting it");
                self.abort();
            }
        }
    }

    /// Waits for a revoke in progress to end, so the communicator can be aborted, at most
    /// [`REVOKE_SETTLE`]: a revoke still waiting for NCCL after that (its proxy thread kept by a
    /// peer's connections) is left to itself, its communicator never aborted nor freed (a
    /// leak, with a warning, rather than a rejoin that hangs).
    fn settle(&mut self) {
        let Some(done) = self.revoking.take() else { return };
        match done.recv_timeout(REVOKE_SETTLE) {
            Ok(aborted) => self.aborted |= aborted,
            // The revoke thread panicked: the communicator is as it left it, aborted below.
            Err(mpsc::RecvTimeoutError::Disconnected) => {}
            Err(mpsc::RecvTimeoutError::Timeout) => {
                tracing::warn!(
                    "NCCL: a pair's revoke did not end within {REVOKE_SETTLE:?}; its communicator is left as it is"
                );
                self.aborted = true;
            }
        }
    }

    /// Aborts the communicator (local; its kernels end) unless it was already.
    fn abort(&mut self) {
        self.settle();
        if !self.aborted {
            // SAFETY: a communicator this pair owns, aborted once (`aborted` guards), no revoke
            // of it running (`settle`).
            let _ = unsafe { nccl::comm_abort(self.comm) };
            self.aborted = true;
        }
    }
}

impl Drop for Pair {
    fn drop(&mut self) {
        self.abort();
    }
}

/// An exchange of one operation with one peer: the peer, its pair's generation, and events
/// before (the operation's send kernel) and after the pair's transfers.
#[derive(Clone, Debug)]
pub(crate) struct PairExchange {
    pub peer: usize,
    pub generation: u64,
    pub start: Arc<CudaEvent>,
    pub done: Arc<CudaEvent>,
}

impl PairExchange {
    /// Its transfers began (the send kernel before them ended) and have not ended: the peer
    /// has not posted its side.
    pub(crate) fn stalled(&self) -> bool {
        self.start.try_is_complete().unwrap_or(false) && self.pending()
    }

    /// Its transfers have not ended (begun or not).
    pub(crate) fn pending(&self) -> bool {
        !self.done.try_is_complete().unwrap_or(true)
    }
}

/// The pair communicators of one rank: `chans[c][p]`, channel `c` with peer `p`.
#[derive(Debug)]
pub(crate) struct NcclPairs {
    rank: usize,
    chans: [Mutex<Vec<Option<Pair>>>; 3],
}

// SAFETY: NCCL communicators may be used from any thread; a channel's pairs are used under its
// lock, one operation at a time.
unsafe impl Send for NcclPairs {}
// SAFETY: as above.
unsafe impl Sync for NcclPairs {}

/// What the ids round of [`pair_ids`] gives a rank: for each peer it makes a pair with, the
/// three ids (dispatch, combine, handle).
pub(crate) type PairIds = Vec<Option<[nccl_sys::ncclUniqueId; 3]>>;

/// The ids round over `boot` (collective): rank `a` draws the ids of every pair `(a, b)`,
/// `b > a`, in `make` (the peers this rank makes a pair with, bit `b` = rank `b`) and every
/// rank reads its pairs' ids from the lower rank of each. Both ranks of a pair must make it (at
/// a group's creation every rank makes all its NCCL pairs; at a rejoin, the pairs with a
/// newcomer); a pair one side does not make is an error on the other.
pub(crate) fn pair_ids(boot: &(impl Bootstrap + ?Sized), make: u32) -> Result<PairIds, Error> {
    let (rank, world) = (boot.rank(), boot.world_size());
    let mut mine = vec![0u64; world * 48];
    for b in (rank + 1..world).filter(|&b| make >> b & 1 == 1) {
        mine[b * 48..(b + 1) * 48].copy_from_slice(&new_ids()?);
    }
    let all = all_gather_u64(boot, &mine)?;
    (0..world)
        .map(|p| {
            if make >> p & 1 == 0 || p == rank {
                return Ok(None);
            }
            match pair_words(&all, rank, world, p) {
                Some(words) => Ok(Some(decode_ids(words))),
                None => Err(Error::Unsupported(format!(
                    "NCCL pairs: rank {} does not make a pair with rank {}: every rank must join with the group's transport",
                    rank.min(p),
                    rank.max(p)
                ))),
            }
        })
        .collect()
}

/// The 48 words of pair `(rank, p)` in the ids round's gathered words (`world` x `world` x 48:
/// rank `a`'s words for pair `(a, b)` at `a`'s row, column `b`), or `None` if its lower rank
/// drew none.
fn pair_words(all: &[u64], rank: usize, world: usize, p: usize) -> Option<&[u64]> {
    let (lo, hi) = (rank.min(p), rank.max(p));
    let words = &all[(lo * world + hi) * 48..(lo * world + hi + 1) * 48];
    words.iter().any(|&w| w != 0).then_some(words)
}

/// Ids for every pair of a group in one process: `masks[r]` the NCCL peers of rank `r`.
pub(crate) fn pair_ids_of_all(masks: &[u32]) -> Result<Vec<PairIds>, Error> {
    let n = masks.len();
    let mut out: Vec<PairIds> = (0..n).map(|_| vec![None; n]).collect();
    for a in 0..n {
        for b in (a + 1..n).filter(|&b| masks[a] >> b & 1 == 1) {
            let ids = decode_ids(&new_ids()?);
            out[a][b] = Some(ids);
            out[b][a] = Some(ids);
        }
    }
    Ok(out)
}

/// The most CTAs (NCCL channels) of each pair communicator `config` asks for
/// ([`epflow_core::tuning::Tuning::nccl_pair_ctas`], `EPFLOW_NCCL_PAIR_CTAS`, at most 64):
/// `None`, NCCL's own choice, unless set. Each channel a pair connects holds NCCL's buffers:
/// with NCCL's choice a pair of ranks on one H100 took about 850 MiB, the 84 pairs of eight
/// ranks 68 GiB (2026-12-07). The pairs' messages need a channel or two; a cap is not yet
/// measured on a GPU, so it is not the default.
pub(crate) fn pair_ctas(config: &GroupConfig) -> Option<i32> {
    config.tuning().nccl_pair_ctas.filter(|&n| n > 0).map(|n| n.min(64) as i32)
}

/// The config of a pair communicator with 1 to `max_ctas` CTAs (channels); every other field
/// is left for NCCL to fill, as `NCCL_CONFIG_INITIALIZER` leaves it.
fn pair_config(max_ctas: i32) -> nccl_sys::ncclConfig_t {
    let undef = NCCL_CONFIG_UNDEF_INT;
    nccl_sys::ncclConfig_t {
        size: std::mem::size_of::<nccl_sys::ncclConfig_t>(),
        magic: NCCL_API_MAGIC,
        version: NCCL_CONFIG_VERSION,
        blocking: undef,
        cgaClusterSize: undef,
        minCTAs: 1,
        maxCTAs: max_ctas.max(1),
        netName: std::ptr::null(),
        splitShare: undef,
        trafficClass: undef,
        commName: std::ptr::null(),
        collnetEnable: undef,
        CTAPolicy: undef,
        shrinkShare: undef,
        nvlsCTAs: undef,
        nChannelsPerNetPeer: undef,
        nvlinkCentricSched: undef,
    }
}

impl NcclPairs {
    /// No pairs yet (rank `rank` of `world`).
    fn empty(rank: usize, world: usize) -> Self {
        NcclPairs { rank, chans: std::array::from_fn(|_| Mutex::new((0..world).map(|_| None).collect())) }
    }

    /// Makes this rank's pair communicators with every peer `ids` names (collective with each
    /// peer: one NCCL group of every `ncclCommInitRank`, so no pair waits for another), each
    /// with a stream of `ctx` and at most `max_ctas` CTAs ([`pair_ctas`]; `None`: NCCL's
    /// choice), then connects them ([`NcclPairs::connect`]). `rank` of `world`.
    pub(crate) fn init(
        ctx: &Arc<CudaContext>,
        rank: usize,
        world: usize,
        ids: &PairIds,
        max_ctas: Option<i32>,
    ) -> Result<Self, Error> {
        let pairs = NcclPairs::make(ctx, rank, world, ids, max_ctas)?;
        pairs.connect(ctx)?;
        Ok(pairs)
    }

    /// [`NcclPairs::init`] on a thread of its own, waited for at most `limit` ([`within`]): a
    /// blocking NCCL call that waits for a peer that never comes (it died, or failed a round
    /// earlier) fails this rank with [`Error::Timeout`] instead of hanging it. Pairs made by
    /// then, or after, are aborted, so their connecting kernels end (one left spinning would
    /// hold up every later synchronization of the context); a thread still in NCCL's set-up is
    /// left behind.
    pub(crate) fn init_within(
        ctx: &Arc<CudaContext>,
        rank: usize,
        world: usize,
        ids: PairIds,
        max_ctas: Option<i32>,
        limit: Duration,
    ) -> Result<Self, Error> {
        let ctx = Arc::clone(ctx);
        let timeout = || Error::Timeout {
            op: "NCCL pair set-up".into(),
            rank,
            waiting_for: "every NCCL peer to make and connect its pair communicators".into(),
            after: limit,
        };
        let make = {
            let ctx = Arc::clone(&ctx);
            move || NcclPairs::make(&ctx, rank, world, &ids, max_ctas)
        };
        within("epflow-nccl-pairs", limit, timeout, make, move |pairs| pairs.connect(&ctx), NcclPairs::abort_all)
    }

    /// How long a rank gives the set-up of its pairs ([`NcclPairs::init_within`]) before it
    /// gives up: three group timeouts, at least 30 s (NCCL's own bootstrap takes seconds).
    pub(crate) fn setup_limit(config: &GroupConfig) -> Duration {
        (3 * config.timeout).max(Duration::from_secs(30))
    }

    /// [`NcclPairs::init`] without the connection.
    pub(crate) fn make(
        ctx: &Arc<CudaContext>,
        rank: usize,
        world: usize,
        ids: &PairIds,
        max_ctas: Option<i32>,
    ) -> Result<Self, Error> {
        bind(ctx)?;
        let pairs = NcclPairs::empty(rank, world);
        let wanted: Vec<(usize, [nccl_sys::ncclUniqueId; 3])> =
            ids.iter().enumerate().filter_map(|(p, i)| i.map(|i| (p, i))).collect();
        let mut comms = vec![[std::ptr::null_mut(); 3]; wanted.len()];
        nccl::group_start().map_err(|e| nccl_err("ncclGroupStart", e))?;
        let mut made = Ok(());
        for ((p, id), out) in wanted.iter().zip(comms.iter_mut()) {
            let me = i32::from(rank > *p);
            for c in 0..3 {
                let configured = max_ctas.map(|n| {
                    // NCCL checks and copies the config during the call.
                    let mut config = pair_config(n);
                    // SAFETY: `out[c]` is a valid out pointer; both ranks of the pair pass the
                    // same id, size 2 and distinct ranks; `config` is a complete `ncclConfig_t`
                    // of the version it names, alive through the call.
                    unsafe { nccl::comm_init_rank_config(&mut out[c], 2, id[c], me, &mut config) }
                });
                if let Some(Err(e)) = &configured {
                    // An NCCL that refuses the config (checked in the call, before any peer is
                    // met; the pair's other rank is refused alike): NCCL's own channel count.
                    tracing::warn!(rank, peer = p, "NCCL refused a pair's config ({:?}); made without it", e.0);
                }
                let r = match configured {
                    Some(Ok(status)) => Ok(status),
                    // SAFETY: as above, without a config.
                    _ => unsafe { nccl::comm_init_rank(&mut out[c], 2, id[c], me) },
                };
                made = made.and(r.map(drop).map_err(|e| nccl_err("ncclCommInitRank (pair)", e)));
            }
        }
        let end = nccl::group_end().map(drop).map_err(|e| nccl_err("ncclGroupEnd", e));
        made.and(end)?;
        for ((p, _), comm) in wanted.iter().zip(comms) {
            for (c, comm) in comm.into_iter().enumerate() {
                let stream = ctx.new_stream().map_err(|e| cuda("a stream for an NCCL pair", e))?;
                pairs.chan(c)[*p] =
                    Some(Pair { comm, stream, generation: 0, revoked: false, aborted: false, revoking: None });
            }
        }
        Ok(pairs)
    }

    fn chan(&self, chan: usize) -> std::sync::MutexGuard<'_, Vec<Option<Pair>>> {
        self.chans[chan].lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Connects every pair with one tiny exchange (NCCL connects lazily, blocking the host in
    /// `ncclGroupEnd` until the peer does too), all in one NCCL group on one stream, and waits.
    /// Collective with every peer.
    pub(crate) fn connect(&self, ctx: &Arc<CudaContext>) -> Result<(), Error> {
        let stream = ctx.new_stream().map_err(|e| cuda("a stream to connect NCCL pairs", e))?;
        let links: Vec<(usize, usize, nccl_sys::ncclComm_t)> = (0..3)
            .flat_map(|c| {
                let chan = self.chan(c);
                chan.iter()
                    .enumerate()
                    .filter_map(|(p, pair)| pair.as_ref().map(|x| (c, p, x.comm)))
                    .collect::<Vec<_>>()
            })
            .collect();
        let buf = DeviceBuffer::zeroed(ctx, 16 * links.len().max(1))?;
        nccl::group_start().map_err(|e| nccl_err("ncclGroupStart", e))?;
        let mut sent = Ok(());
        for (i, &(_, p, comm)) in links.iter().enumerate() {
            let peer = i32::from(p > self.rank);
            let x = Xfer {
                peer: peer as usize,
                send: (buf.ptr() + 16 * i as u64, 8),
                recv: (buf.ptr() + 16 * i as u64 + 8, 8),
            };
            sent = sent.and(post(comm, &stream, &x));
        }
        let end = nccl::group_end().map(drop).map_err(|e| nccl_err("ncclGroupEnd", e));
        sent.and(end)?;
        stream.synchronize().map_err(|e| cuda("connect NCCL pairs", e))
    }

    /// Enqueues `xfers` (group ranks as peers) of channel `chan`: for each peer in `live`,
    /// after the work on `stream` so far, on its pair's stream, and orders `stream` after each
    /// pair's transfers. Transfers with a peer not in `live` (masked), or whose pair was revoked
    /// (its peer is being masked: the receive kernel sees the bit), are left out. Each peer's
    /// transfers end with its arrival word (`RankShared::arrival_xfer`, 16 bytes), which goes
    /// in an NCCL group of its own after the data's: a pair's groups run in order on both
    /// sides, so an arrival that landed means the data did, even in an exchange cut by a
    /// revoke. Pushes each exchange onto `out` as soon as `stream` waits for it (also when a
    /// later one fails), for [`NcclPairs::revoke_peer`].
    pub(crate) fn issue(
        &self,
        chan: usize,
        stream: &CudaStream,
        xfers: &[Xfer],
        live: u32,
        out: &mut Vec<PairExchange>,
    ) -> Result<(), Error> {
        let pairs = self.chan(chan);
        let mut peers: Vec<usize> = xfers.iter().map(|x| x.peer).filter(|&p| live >> p & 1 == 1).collect();
        peers.dedup();
        if peers.is_empty() {
            return Ok(());
        }
        let start = Arc::new(stream.record_event(None).map_err(|e| cuda("record an NCCL exchange's start", e))?);
        for p in peers {
            let pair = match pairs.get(p) {
                Some(Some(pair)) if pair.revoked => continue,
                Some(Some(pair)) => pair,
                _ => return Err(Error::Backend(format!("rank {}: no NCCL pair with rank {p}", self.rank))),
            };
            let them = usize::from(p > self.rank);
            let mine: Vec<Xfer> = xfers.iter().filter(|x| x.peer == p).map(|x| Xfer { peer: them, ..*x }).collect();
            pair.stream.wait(&start).map_err(|e| cuda("order an NCCL pair after the send", e))?;
            match mine.split_last() {
                Some((arrival, data)) if arrival.send.1 == ARRIVAL_BYTES && arrival.recv.1 == ARRIVAL_BYTES => {
                    issue(pair.comm, &pair.stream, data)?;
                    issue(pair.comm, &pair.stream, std::slice::from_ref(arrival))?;
                }
                _ => issue(pair.comm, &pair.stream, &mine)?,
            }
            let done = Arc::new(pair.stream.record_event(None).map_err(|e| cuda("record an NCCL pair's end", e))?);
            stream.wait(&done).map_err(|e| cuda("order the operation after an NCCL pair", e))?;
            out.push(PairExchange { peer: p, generation: pair.generation, start: Arc::clone(&start), done });
        }
        Ok(())
    }

    /// Whether the pair of `exchange` is still the one it went to (not replaced by a rejoin
    /// since).
    pub(crate) fn current(&self, chan: usize, exchange: &PairExchange) -> bool {
        matches!(self.chan(chan).get(exchange.peer), Some(Some(p)) if p.generation == exchange.generation)
    }

    /// Revokes every channel's pair with `peer` ([`Pair::revoke`]: their kernels end at once,
    /// NCCL's quiescence runs on a thread of its own; a pair revoked already is left as it is;
    /// one whose revoke fails is aborted): the peer died, and no channel reaches it again before
    /// a rejoin makes new pairs.
    pub(crate) fn revoke_peer(&self, peer: usize) {
        for chan in 0..3 {
            if let Some(Some(pair)) = self.chan(chan).get_mut(peer) {
                pair.revoke(self.rank, peer);
            }
        }
        tracing::warn!(rank = self.rank, peer, "NCCL: the pairs with a peer revoked at an operation's deadline");
    }

    /// Aborts every pair (local; their kernels end), for a rejoin's set-up given up at its
    /// deadline while its pairs still connect. They take nothing after.
    pub(crate) fn abort_all(&self) {
        for c in 0..3 {
            for pair in self.chan(c).iter_mut().flatten() {
                pair.abort();
                pair.revoked = true;
            }
        }
    }

    /// Puts `other`'s pairs (made at a rejoin, with the newcomers) in place of this rank's with
    /// the same peers; the old ones are aborted. Generations go on counting.
    pub(crate) fn adopt(&self, other: NcclPairs) {
        for c in 0..3 {
            let mut mine = self.chan(c);
            let mut theirs = other.chan(c);
            for (p, slot) in theirs.iter_mut().enumerate() {
                if let Some(mut pair) = slot.take() {
                    pair.generation = mine[p].as_ref().map_or(0, |old| old.generation + 1);
                    mine[p] = Some(pair);
                }
            }
        }
    }

    /// The peers channel `chan` reaches now (a pair not revoked), bit `r` = rank `r`.
    pub(crate) fn reachable(&self, chan: usize) -> u32 {
        self.chan(chan)
            .iter()
            .enumerate()
            .filter(|(_, p)| p.as_ref().is_some_and(|p| !p.revoked))
            .fold(0, |m, (r, _)| m | 1 << r)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pair_config_caps_the_ctas_and_leaves_the_rest_to_nccl() {
        let c = pair_config(2);
        assert_eq!((c.magic, c.version, c.size), (0xcafe_beef, 22800, std::mem::size_of::<nccl_sys::ncclConfig_t>()));
        assert_eq!((c.minCTAs, c.maxCTAs), (1, 2));
        assert_eq!((c.blocking, c.splitShare, c.nChannelsPerNetPeer), (i32::MIN, i32::MIN, i32::MIN));
        assert!(c.netName.is_null() && c.commName.is_null());
        // Never below one CTA.
        assert_eq!(pair_config(0).maxCTAs, 1);
        let config = |v: Option<usize>| {
            let mut t = *GroupConfig::low_latency(8, 8, 128).tuning();
            t.nccl_pair_ctas = v;
            GroupConfig::low_latency(8, 8, 128).with_tuning(t)
        };
        assert_eq!(pair_ctas(&config(None)), None, "unset: NCCL's own choice");
        assert_eq!(pair_ctas(&config(Some(0))), None, "0: NCCL's own choice");
        assert_eq!(pair_ctas(&config(Some(1))), Some(1));
        assert_eq!(pair_ctas(&config(Some(4))), Some(4));
        assert_eq!(pair_ctas(&config(Some(1000))), Some(64));
    }

    #[test]
    fn an_empty_set_reaches_nobody() {
        let pairs = NcclPairs::empty(1, 4);
        assert_eq!((0..3).map(|c| pairs.reachable(c)).collect::<Vec<_>>(), vec![0, 0, 0]);
    }

    #[test]
    fn each_pair_reads_its_lower_ranks_words() {
        // Three ranks; rank 0 drew ids for (0, 2), rank 1 for (1, 2): words 10 + pair.
        let world = 3;
        let mut all = vec![0u64; world * world * 48];
        all[2 * 48..3 * 48].fill(12);
        all[world * 48 + 2 * 48..world * 48 + 3 * 48].fill(13);
        assert_eq!(pair_words(&all, 2, world, 0), Some(&[12u64; 48][..]));
        assert_eq!(pair_words(&all, 0, world, 2), Some(&[12u64; 48][..]));
        assert_eq!(pair_words(&all, 2, world, 1), Some(&[13u64; 48][..]));
        // Rank 0 drew nothing for (0, 1).
        assert_eq!(pair_words(&all, 1, world, 0), None);
    }
}

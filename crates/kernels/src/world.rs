//! Creating GPU groups: one process driving several GPUs (peer access between them), or one
//! process per GPU (CUDA IPC), with NCCL between ranks NVLink cannot reach ([`Transport`]).

use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};

use epflow_core::backend::RankCore;
use epflow_core::{Error, GroupConfig};

use crate::compile::Functions;
use crate::compute::{comm_sms, ranks_on_busiest_gpu};
use crate::device::cache::OutputCache;
use crate::device::{
    DeviceBuffer, EventPool, LocalAllocator, SharedContext, bind, context, cuda, pci_key, sm_count_of,
};
use crate::layout::BufferLayout;
use crate::op::ll_geometry::one_launch_threads;
use crate::rank::GpuRank;
use crate::setup::bootstrap::{self, Bootstrap};
use crate::state::shared::{Kept, Peers, RankMemory, RankShared};
use crate::transport::nccl::{NcclComms, decode_ids, new_ids};
use crate::transport::nccl_pairs::{NcclPairs, pair_ctas, pair_ids, pair_ids_of_all};
use crate::transport::nccl_shared::NcclShared;
use crate::transport::nvlink::enable_peer_access;
use crate::transport::peer_memory::{exported, open_exported};
use crate::transport::{Transport, host_id};

static NEXT_GROUP_ID: AtomicU64 = AtomicU64::new(1 << 32);

/// Creates GPU groups.
#[derive(Debug)]
pub struct GpuWorld;

impl GpuWorld {
    /// One process driving every device in `devices`: rank `r` runs on `devices[r]`. Every pair of
    /// devices must have peer access (NVLink). Give each rank to its own thread (or task).
    ///
    /// A device may be named twice (two ranks on one GPU: a functional setup for tests, over
    /// NVLink only; with no `max_sms` set, each kernel then takes at most SMs / ((buffer sets
    /// \+ 1) x ranks on the busiest GPU) for low-latency groups, SMs / (2 x ranks on the
    /// busiest GPU) for high-throughput ones, so the ranks' kernels fit beside each other). Such
    /// ranks share the
    /// device's CUDA context, where freeing device memory (`cuMemFree` of a large block, e.g.
    /// dropping a large [`DeviceTensor`](crate::device::DeviceTensor)) waits for every kernel on the
    /// device: if the other rank is inside a collective that waits for this one, both wait until
    /// the group's timeout. Free memory on such ranks only while no collective of theirs can be
    /// in flight (e.g. behind a barrier of their threads).
    pub fn create(devices: &[usize], config: GroupConfig) -> Result<Vec<GpuRank>, Error> {
        Self::create_with(devices, config, Transport::Auto)
    }

    /// [`GpuWorld::create`] with a chosen [`Transport`]: `Transport::Nccl` runs every exchange
    /// between distinct ranks over NCCL (peer access is not needed), `Transport::Hierarchical`
    /// declares "hosts" of ranks (NVLink inside one, NCCL across; a test of the cross-host path
    /// on one machine — set `NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1` to force NCCL onto its
    /// socket transport between them). The NCCL communicators connect before this returns.
    pub fn create_with(devices: &[usize], config: GroupConfig, transport: Transport) -> Result<Vec<GpuRank>, Error> {
        let num_ranks = devices.len();
        config.validate(num_ranks)?;
        // The group's tuning is taken now: its own, else the environment's.
        let config = config.clone().with_tuning(*config.tuning());
        // What the transport allows is decided before any device is touched.
        let masks = (0..num_ranks).map(|r| transport.nccl_mask(r, num_ranks, None)).collect::<Result<Vec<_>, _>>()?;
        refuse_unpaired_masks(&masks)?;
        let any_nccl = masks.iter().any(|&m| m != 0);
        refuse_masking_on_old_nccl(&config, any_nccl)?;
        refuse_nccl_on_a_shared_gpu(sharing_pair(devices), any_nccl)?;
        let ctxs = devices.iter().map(|&d| context(d)).collect::<Result<Vec<_>, _>>()?;
        let device_sms = ctxs.iter().map(|c| sm_count_of(c)).collect::<Result<Vec<_>, _>>()?;
        let min_sms = device_sms.into_iter().min().unwrap_or(1);
        let config = bounded_for_shared_gpus(config, ranks_on_busiest_gpu(devices), min_sms);
        let layout = BufferLayout::new(&config, num_ranks, min_sms)?;
        // Every rank is in this process: with peer access, kernels reach the memory peers
        // allocate, so high-throughput dispatches may write rows straight into their outputs
        // and combines read their expert outputs in place.
        let direct = !any_nccl && config.tuning().ht_direct;
        let layout = layout.for_transport(any_nccl).with_direct_access(direct);
        let nvlink_pairs: Vec<(usize, usize)> = (0..num_ranks)
            .flat_map(|a| (0..num_ranks).map(move |b| (a, b)))
            .filter(|&(a, b)| a != b && masks[a] >> b & 1 == 0)
            .collect();
        enable_peer_access(devices, &ctxs, &nvlink_pairs)?;
        let mut comms: Vec<Option<(NcclComms, Option<NcclPairs>)>> = if !any_nccl {
            Vec::new()
        } else if config.rank_masking {
            // A communicator per pair of ranks (`transport/nccl_pairs.rs`), each rank's made
            // on a thread of its own (every pair's two ranks at once).
            let (ids, ctas) = (pair_ids_of_all(&masks)?, pair_ctas(&config));
            std::thread::scope(|sc| {
                let joins: Vec<_> = (0..num_ranks)
                    .map(|r| {
                        let (ctx, ids) = (&ctxs[r], &ids[r]);
                        sc.spawn(move || NcclPairs::init(ctx, r, num_ranks, ids, ctas))
                    })
                    .collect();
                joins
                    .into_iter()
                    .map(|j| {
                        let pairs = j.join().unwrap_or_else(|_| Err(Error::Backend("NCCL pairs panicked".into())))?;
                        Ok(Some((NcclComms::none(), Some(pairs))))
                    })
                    .collect::<Result<Vec<_>, Error>>()
            })?
        } else {
            let comms = if sharing_pair(devices).is_some() {
                NcclComms::init_threads(&ctxs)?
            } else {
                NcclComms::init_all(devices)?
            };
            comms.into_iter().map(|c| Some((c, None))).collect()
        };
        comms.resize_with(num_ranks, || None);
        let group_id = NEXT_GROUP_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let mems = ctxs
            .iter()
            .map(|ctx| RankMemory::allocate(ctx, &layout, None).map(Arc::new))
            .collect::<Result<Vec<_>, _>>()?;
        let peers = || Peers {
            disp_recv: mems.iter().map(|m| m.disp_recv.ptr()).collect(),
            comb_recv: mems.iter().map(|m| m.comb_recv.ptr()).collect(),
            exchange: mems.iter().map(|m| m.exchange.ptr()).collect(),
            signals: mems.iter().map(|m| m.signals.ptr()).collect(),
            keep: mems.iter().map(|m| vec![Arc::clone(m) as Kept]).collect(),
        };
        let ranks = ctxs
            .iter()
            .zip(devices)
            .zip(comms)
            .enumerate()
            .map(|(rank, ((ctx, &device), comms))| {
                let shares_gpu = devices.iter().filter(|&&d| d == device).count() > 1;
                let place = Placement { rank, num_ranks, device, group_id, shares_gpu, local_allocator: None };
                let nccl = comms.map(|c| NcclShared::new(ctx, &layout, c, masks[rank], num_ranks, None)).transpose()?;
                build_rank(place, &config, layout, ctx, Arc::clone(&mems[rank]), peers(), nccl)
            })
            .collect::<Result<Vec<_>, _>>()?;
        // NCCL connects pairs lazily, blocking the host until the peer does too: connect every
        // pair now, one thread per rank, so operations never block.
        std::thread::scope(|sc| {
            let joins: Vec<_> = ranks.iter().map(|r| sc.spawn(move || r.connect_nccl())).collect();
            joins
                .into_iter()
                .try_for_each(|j| j.join().unwrap_or_else(|_| Err(Error::Backend("NCCL connect panicked".into()))))
        })?;
        Ok(ranks)
    }
}

impl GpuWorld {
    /// One process per GPU: joins this process's rank (`comm.rank()`) of a group over `comm`, an
    /// NCCL communicator of every rank on this host (see [`crate::setup::bootstrap`]).
    /// Collective: every rank calls it with the same config. The receive regions and signal
    /// pages are shared with CUDA IPC handles exchanged over `comm`. Call [`bootstrap::barrier`]
    /// before dropping the rank, so no peer still uses this process's memory.
    pub fn join(comm: &cudarc::nccl::Comm, config: GroupConfig) -> Result<GpuRank, Error> {
        Self::join_with(comm, config, Transport::Auto)
    }

    /// [`GpuWorld::join`] with a chosen [`Transport`]. With `Transport::Auto`, ranks on the same
    /// host (same kernel boot id, gathered over `comm`) use the NVLink kernels and ranks on other
    /// hosts NCCL; NCCL then picks its own transport per pair (NVLink/P2P, shared memory,
    /// InfiniBand or sockets: `NCCL_DEBUG=INFO` prints it).
    pub fn join_with(comm: &cudarc::nccl::Comm, config: GroupConfig, transport: Transport) -> Result<GpuRank, Error> {
        Self::join_over(comm, config, transport)
    }

    /// [`GpuWorld::join_with`] over any [`Bootstrap`]: an NCCL communicator the application
    /// made, say. Collective.
    pub fn join_over(
        comm: &(impl Bootstrap + ?Sized),
        config: GroupConfig,
        transport: Transport,
    ) -> Result<GpuRank, Error> {
        Self::join_over_with_allocator(comm, config, transport, None)
    }

    /// [`GpuWorld::join_over`] with the rank's local scratch from `allocator` (the NCCL EP C
    /// API's `alloc_fn` / `free_fn`, say): every device buffer only this rank's kernels touch
    /// (handle memory, the low-latency output buffer sets, NCCL staging, counter words;
    /// [`GpuRank::local_allocator`]). The memory peers map (receive regions, the exchange region,
    /// the signal page) stays `cuMemAlloc`: CUDA IPC exports whole `cuMemAlloc` allocations.
    /// `None`: everything from `cuMemAlloc`, as [`GpuWorld::join_over`]. Collective.
    pub fn join_over_with_allocator(
        comm: &(impl Bootstrap + ?Sized),
        config: GroupConfig,
        transport: Transport,
        allocator: Option<Arc<dyn LocalAllocator>>,
    ) -> Result<GpuRank, Error> {
        let (rank, num_ranks) = (comm.rank(), comm.world_size());
        config.validate(num_ranks)?;
        let config = config.clone().with_tuning(*config.tuning());
        let ctx = Arc::clone(comm.context());
        bind(&ctx)?;
        // Every rank's (host, GPU, SMs): ranks on one host with the same PCI location share a
        // GPU; the layout fits the GPU with the fewest SMs, so every rank builds the same one.
        let places = bootstrap::all_gather_u64(comm, &place_words(&ctx)?)?;
        let hosts: Vec<u64> = places.iter().step_by(3).copied().collect();
        let shares_gpu =
            (0..num_ranks).any(|r| r != rank && places[3 * r..3 * r + 2] == places[3 * rank..3 * rank + 2]);
        let device_sms = places.iter().skip(2).step_by(3).min().copied().unwrap_or(1) as usize;
        let gpus: Vec<&[u64]> = places.chunks(3).map(|p| &p[..2]).collect();
        let config = bounded_for_shared_gpus(config, ranks_on_busiest_gpu(&gpus), device_sms);
        let layout = BufferLayout::new(&config, num_ranks, device_sms)?;
        let mask = transport.nccl_mask(rank, num_ranks, Some(&hosts))?;
        // Every rank learns every mask (rank 0's ids serve the NCCL communicators).
        let masks = bootstrap::all_gather_u64(comm, &[u64::from(mask)])?;
        check_transport(&masks, &places)?;
        refuse_masking_on_old_nccl(&config, masks.iter().any(|&m| m != 0))?;
        let layout = layout.for_transport(masks.iter().any(|&m| m != 0));
        let nccl = if masks.iter().any(|&m| m != 0) {
            let parts = if config.rank_masking {
                // A communicator per pair of ranks (`transport/nccl_pairs.rs`): with every NCCL
                // peer (at a rejoin, the survivors make theirs with this newcomer alone), bounded
                // so a peer that never comes fails this rank instead of hanging it.
                let (ids, limit) = (pair_ids(comm, mask)?, NcclPairs::setup_limit(&config));
                let pairs = NcclPairs::init_within(&ctx, rank, num_ranks, ids, pair_ctas(&config), limit)?;
                (NcclComms::none(), Some(pairs))
            } else {
                let ids = if rank == 0 { new_ids()? } else { [0u64; 48] };
                let all = bootstrap::all_gather_u64(comm, &ids)?;
                (NcclComms::init_rank(&decode_ids(&all[..48]), rank, num_ranks)?, None)
            };
            Some(NcclShared::new(&ctx, &layout, parts, mask, num_ranks, allocator.as_ref())?)
        } else {
            None
        };
        let mem = Arc::new(RankMemory::allocate(&ctx, &layout, allocator.as_ref())?);
        let (own, mine) = exported(&mem)?;
        let all = comm.all_gather_bytes(&mine)?;
        let mut peers = Peers {
            disp_recv: Vec::new(),
            comb_recv: Vec::new(),
            exchange: Vec::new(),
            signals: Vec::new(),
            keep: Vec::new(),
        };
        for r in 0..num_ranks {
            // NCCL peers are never addressed (their slots point at this rank's own memory).
            let (ptrs, keep) = if r == rank {
                (own, vec![Arc::clone(&mem) as Kept])
            } else if mask >> r & 1 == 1 {
                (own, Vec::new())
            } else {
                open_exported(&ctx, &all, r)?
            };
            peers.keep.push(keep);
            peers.disp_recv.push(ptrs[0]);
            peers.comb_recv.push(ptrs[1]);
            peers.exchange.push(ptrs[2]);
            peers.signals.push(ptrs[3]);
        }
        let place = Placement {
            rank,
            num_ranks,
            device: ctx.ordinal(),
            group_id: NEXT_GROUP_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            shares_gpu,
            local_allocator: allocator,
        };
        let rank = build_rank(place, &config, layout, &ctx, mem, peers, nccl)?;
        rank.connect_nccl()?;
        Ok(rank)
    }
}

/// Where a rank sits in its group.
struct Placement {
    rank: usize,
    num_ranks: usize,
    device: usize,
    group_id: u64,
    /// Another rank of the group runs on the same GPU.
    shares_gpu: bool,
    /// Where its local scratch comes from (`None`: `cuMemAlloc`; [`RankShared::local_allocator`]).
    local_allocator: Option<Arc<dyn LocalAllocator>>,
}

/// The gathered NCCL masks must pair up (rank `a` reaches `b` over NCCL exactly when `b`
/// reaches `a` so: a rejoin's newcomer may have picked another transport than the group).
/// Under rank masking, NVLink peers are masked through their signal pages and NCCL peers
/// locally, each survivor by itself, when their pair's exchange stalls
/// (`transport/nccl_pairs.rs`). Every rank decides alike, so no one waits.
fn refuse_unpaired_masks<M: Copy + Into<u64>>(masks: &[M]) -> Result<(), Error> {
    let n = masks.len();
    let bit = |a: usize, b: usize| masks[a].into() >> b & 1;
    if let Some((a, b)) = (0..n).flat_map(|a| (0..n).map(move |b| (a, b))).find(|&(a, b)| bit(a, b) != bit(b, a)) {
        return Err(Error::Unsupported(format!(
            "rank {a} {} rank {b} over NCCL, rank {b} {} rank {a} so: every rank must join with the group's transport",
            if bit(a, b) == 1 { "reaches" } else { "does not reach" },
            if bit(b, a) == 1 { "reaches" } else { "does not reach" },
        )));
    }
    Ok(())
}

/// Rank masking with NCCL peers revokes pair communicators (`ncclCommRevoke`): NCCL 2.28 or
/// later. Every rank loads its own NCCL; a rank that refuses makes the others fail at their next
/// collective step.
fn refuse_masking_on_old_nccl(config: &GroupConfig, any_nccl: bool) -> Result<(), Error> {
    if !config.rank_masking || !any_nccl {
        return Ok(());
    }
    crate::setup::bootstrap::nccl_present()?;
    match cudarc::nccl::result::get_nccl_version() {
        Ok(v) if v >= 22800 => Ok(()),
        Ok(v) => Err(Error::Unsupported(format!(
            "rank_masking with NCCL peers needs NCCL 2.28 or later (ncclCommRevoke); this process loaded {}.{}.{}",
            v / 10000,
            v / 100 % 100,
            v % 100
        ))),
        Err(e) => Err(Error::Backend(format!("NCCL: ncclGetVersion: {:?}", e.0))),
    }
}

/// What a group joined over a bootstrap checks of its gathered NCCL masks and places (three
/// words per rank: host, PCI location, SMs), alike on every rank (a rejoin meeting checks the
/// same): masks that pair up, and NCCL on a shared GPU.
pub(crate) fn check_transport(masks: &[u64], places: &[u64]) -> Result<(), Error> {
    refuse_unpaired_masks(masks)?;
    let gpus: Vec<&[u64]> = places.chunks(3).map(|p| &p[..2]).collect();
    refuse_nccl_on_a_shared_gpu(sharing_pair(&gpus), masks.iter().any(|&m| m != 0))
}

/// The first two ranks (lower first) whose entries of `places` (a device, or a (host, PCI
/// location)) are equal: ranks sharing a GPU.
fn sharing_pair<T: PartialEq>(places: &[T]) -> Option<(usize, usize)> {
    (0..places.len()).find_map(|b| (0..b).find(|&a| places[a] == places[b]).map(|a| (a, b)))
}

/// The configuration a group runs with when `ranks_per_gpu` ranks share a GPU of `sms` SMs and
/// the caller set no `max_sms`: every kernel takes at most [`comm_sms`]`(sms, ranks_per_gpu,
/// lanes, sms)` SMs, so that the receives spinning for peers on the same GPU never hold every SM
/// that a peer's send, or the work queued before it on its stream, still needs (a full-GPU grid
/// on each rank hung the 4-ranks-on-2-GPUs rank-major test until its timeout, benches/NOTES.md
/// item 122). `lanes`, the receives one rank may have waiting at once: a low-latency group's
/// buffer sets (each set holds one operation of a channel in flight, and a pipeline runs one
/// lane per set; two ranks, two sets, 132 SMs: 22 each), one for high-throughput groups. With
/// one lane counted, two ranks' two lanes each held four receives of 33 SMs, all 132, and a
/// router GEMM queued before a send never started (`gpu_layer`'s interleaved lanes with
/// `EPFLOW_TEST_DEVICES=0,0`, 2026-12-06). Unchanged otherwise.
fn bounded_for_shared_gpus(config: GroupConfig, ranks_per_gpu: usize, sms: usize) -> GroupConfig {
    if ranks_per_gpu > 1 && config.max_sms.is_none() {
        let lanes = if config.algorithm == epflow_core::Algorithm::LowLatency { config.buffer_sets.max(1) } else { 1 };
        let bound = comm_sms(sms, ranks_per_gpu, lanes, sms);
        config.with_max_sms(Some(bound))
    } else {
        config
    }
}

/// NCCL communicators take one GPU per rank (`ncclCommInitAll` and `ncclCommInitRank` fail with
/// `ncclInvalidUsage` otherwise), unless NCCL is 2.30 or later and `NCCL_MULTI_RANK_GPU_ENABLE=1`
/// is set (then one process makes the communicators with a thread per rank,
/// [`NcclComms::init_threads`]). Otherwise a group that reaches any peer over NCCL cannot place
/// two ranks on one GPU. Every rank finds the same pair (from gathered places), so all refuse.
fn refuse_nccl_on_a_shared_gpu(shared: Option<(usize, usize)>, any_nccl: bool) -> Result<(), Error> {
    match shared {
        Some((a, b)) if any_nccl && !nccl_takes_ranks_sharing_a_gpu() => Err(Error::Unsupported(format!(
            "ranks {a} and {b} share a GPU, and this group reaches peers over NCCL, whose communicators take one \
             GPU per rank (NCCL 2.30 takes several with NCCL_MULTI_RANK_GPU_ENABLE=1): give each rank its own GPU, \
             or keep ranks sharing a GPU on NVLink only (Transport::Auto)"
        ))),
        _ => Ok(()),
    }
}

/// NCCL 2.30 or later, with `NCCL_MULTI_RANK_GPU_ENABLE=1`: a communicator may hold several
/// ranks of one GPU.
fn nccl_takes_ranks_sharing_a_gpu() -> bool {
    epflow_core::tuning::Environment::get().nccl_multi_rank_gpu
        && crate::setup::bootstrap::nccl_present().is_ok()
        && cudarc::nccl::result::get_nccl_version().is_ok_and(|v| v >= 23000)
}

/// This rank's words of the group's first all-gather: its host, its GPU's PCI location and the
/// GPU's SMs (ranks on one host with the same PCI location share a GPU).
pub(crate) fn place_words(ctx: &cudarc::driver::CudaContext) -> Result<[u64; 3], Error> {
    Ok([host_id(), pci_key(ctx)?, sm_count_of(ctx)? as u64])
}

/// Loads the kernels, creates the streams and assembles a rank around its memory and its view
/// of the peers'.
fn build_rank(
    place: Placement,
    config: &GroupConfig,
    layout: BufferLayout,
    ctx: &Arc<cudarc::driver::CudaContext>,
    mem: Arc<RankMemory>,
    mut peers: Peers,
    nccl: Option<NcclShared>,
) -> Result<GpuRank, Error> {
    if let Some(n) = &nccl {
        // NCCL peers get this rank's own signal page: what the kernels "send" them there is
        // carried by NCCL (see nccl.rs).
        for r in n.peers(place.num_ranks) {
            peers.signals[r] = mem.signals.ptr();
        }
    }
    bind(ctx)?;
    let functions = Functions::load(ctx)?;
    let streams = comm_streams(ctx)?;
    let local = place.local_allocator.as_ref();
    let null_handle = match &layout {
        BufferLayout::Ll(l) => Some(DeviceBuffer::zeroed_with(ctx, l.handle_bytes(), local)?),
        BufferLayout::Ht(_) => None,
    };
    let num_sms = sm_count_of(ctx)? as u32;
    // One launch per synchronous low-latency operation needs every block of its grid (at most
    // one per SM) resident at once, with room beside it for the other channel's (two per SM).
    let fits = |f: &cudarc::driver::CudaFunction, threads: u32| {
        f.occupancy_max_active_blocks_per_multiprocessor(threads, 0, None).is_ok_and(|n| n >= 2)
    };
    let allowed = config.tuning().one_launch;
    let one_launch = allowed
        && !place.shares_gpu
        && functions.one_launch().iter().all(|(f, form)| fits(f, one_launch_threads(*form)));
    let (events, timed_events) = (EventPool::new(ctx), EventPool::timed(ctx));
    let core = RankCore::new(place.rank, place.num_ranks, place.group_id, config.clone());
    let shared = Arc::new(RankShared {
        poison: Arc::clone(core.poison()),
        rank: place.rank,
        num_ranks: place.num_ranks,
        device: place.device,
        config: config.clone(),
        layout,
        group_id: place.group_id,
        ctx: Arc::clone(ctx),
        streams,
        later_builds: Mutex::default(),
        functions,
        mem,
        peers: RankShared::peers_cell(peers),
        peers_generation: AtomicU64::new(0),
        num_sms,
        handle_pool: Arc::new(Mutex::new(Vec::new())),
        null_handle,
        outputs: OutputCache::new(&events),
        events,
        timed_events,
        exchange_pool: Mutex::new(Vec::new()),
        plan_results: Arc::default(),
        output_fill: Default::default(),
        timing: Default::default(),
        one_launch,
        turns: Default::default(),
        last_launch: Default::default(),
        numbered: Default::default(),
        plan_marks_launched: Default::default(),
        meetings: Default::default(),
        meeting_source: Default::default(),
        nccl,
        local_allocator: place.local_allocator,
        shared_gpu: place.shares_gpu.then(|| SharedContext::join(ctx)),
    });
    Ok(GpuRank { shared, core })
}

/// The dispatch, combine and handle streams, at the device's highest priority: when compute and
/// communication kernels wait for SMs, communication blocks are scheduled first.
fn comm_streams(ctx: &Arc<cudarc::driver::CudaContext>) -> Result<[Arc<cudarc::driver::CudaStream>; 3], Error> {
    bind(ctx)?;
    let (_, greatest) =
        cudarc::driver::result::stream::get_priority_range().map_err(|e| cuda("stream priorities", e))?;
    let one = || ctx.new_stream_with_priority(greatest).map_err(|e| cuda("create stream", e));
    Ok([one()?, one()?, one()?])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn masks_that_do_not_pair_up_are_refused() {
        // Every pair over NCCL, or ranks 0 and 1 on NVLink and rank 2 across: both pair up.
        assert!(refuse_unpaired_masks(&[0b110u64, 0b101, 0b011]).is_ok());
        assert!(refuse_unpaired_masks(&[0b100u64, 0b100, 0b011]).is_ok());
        // A newcomer (rank 1) that joins on NVLink a group whose rank 0 reaches it over NCCL.
        let err = refuse_unpaired_masks(&[0b10u64, 0b00]).unwrap_err();
        assert!(matches!(&err, Error::Unsupported(m) if m.contains("rank 0 reaches rank 1 over NCCL")), "{err}");
    }

    #[test]
    fn sharing_pair_finds_the_first_two_ranks_on_one_gpu() {
        assert_eq!(sharing_pair(&[0, 1, 2, 3]), None);
        assert_eq!(sharing_pair(&[0, 0, 1, 1]), Some((0, 1)));
        assert_eq!(sharing_pair(&[3, 1, 2, 1, 3]), Some((1, 3)));
        let places: Vec<&[u64]> = vec![&[7, 1], &[7, 2], &[8, 1]];
        assert_eq!(sharing_pair(&places), None, "same PCI location on another host");
        let places: Vec<&[u64]> = vec![&[7, 1], &[8, 1], &[7, 1]];
        assert_eq!(sharing_pair(&places), Some((0, 2)));
    }

    #[test]
    fn groups_sharing_a_gpu_bound_their_kernels_sms() {
        assert_eq!(ranks_on_busiest_gpu(&[0, 1, 2, 3]), 1);
        assert_eq!(ranks_on_busiest_gpu(&[0, 0, 1, 1]), 2);
        assert_eq!(ranks_on_busiest_gpu(&[0, 1, 1, 1]), 3);
        let ll = GroupConfig::low_latency(16, 32, 2048);
        assert_eq!(bounded_for_shared_gpus(ll.clone(), 1, 132).max_sms, None, "no GPU shared");
        // Two buffer sets (the default): two receives per rank may wait at once, and a send.
        assert_eq!(bounded_for_shared_gpus(ll.clone(), 2, 132).max_sms, Some(22));
        assert_eq!(bounded_for_shared_gpus(ll.clone(), 4, 132).max_sms, Some(11));
        assert_eq!(bounded_for_shared_gpus(ll.clone().with_buffer_sets(3), 2, 132).max_sms, Some(16));
        let ht = GroupConfig::high_throughput(16, 2048);
        assert_eq!(bounded_for_shared_gpus(ht, 2, 132).max_sms, Some(33), "high-throughput: one lane");
        let chosen = ll.with_max_sms(Some(20));
        assert_eq!(bounded_for_shared_gpus(chosen, 2, 132).max_sms, Some(20), "the caller's bound stays");
    }

    #[test]
    fn a_group_over_nccl_with_a_shared_gpu_is_refused_before_any_device_is_touched() {
        // No GPU is needed: the refusal comes before the first context.
        let config = GroupConfig::low_latency(16, 32, 2048);
        let err = GpuWorld::create_with(&[0, 1, 2, 2], config.clone(), Transport::Nccl).unwrap_err();
        assert!(matches!(&err, Error::Unsupported(m) if m.contains("ranks 2 and 3 share a GPU")), "{err}");
        let split = Transport::split_hosts(4, 2).expect("split");
        let err = GpuWorld::create_with(&[0, 1, 0, 1], config, split).unwrap_err();
        assert!(matches!(&err, Error::Unsupported(m) if m.contains("ranks 0 and 2 share a GPU")), "{err}");
    }

    #[test]
    fn nccl_is_refused_only_when_ranks_share_a_gpu() {
        assert!(refuse_nccl_on_a_shared_gpu(None, true).is_ok());
        assert!(refuse_nccl_on_a_shared_gpu(Some((0, 1)), false).is_ok());
        let err = refuse_nccl_on_a_shared_gpu(Some((1, 3)), true).unwrap_err();
        assert!(matches!(&err, Error::Unsupported(m) if m.contains("ranks 1 and 3 share a GPU")), "{err}");
    }
}

//! What every operation of a rank shares: [`RankShared`] (streams, kernels, memory, the peers'
//! addresses, pools, the local allocator) and the rank's own device memory, [`RankMemory`].

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64};
use std::sync::{Arc, Mutex};

use cudarc::driver::{CudaContext, CudaStream};
use epflow_core::protocol::Poison;
use epflow_core::{Algorithm, Error, GroupConfig};

use crate::compile::Functions;
use crate::device::cache::OutputCache;
use crate::device::{DeviceBuffer, EventPool, LocalAllocator, PinnedBuffer, SharedContext, StreamFence, bind, cuda};
use crate::layout::BufferLayout;
use crate::params::{MAX_RANKS, SIGNAL_PAGE_BYTES, arrival_offset, status};
use crate::transport::nccl::Xfer;
use crate::transport::nccl_shared::NcclShared;

/// The memory of one rank. Peers map its receive regions, exchange region and signal page
/// (`cuMemAlloc`: CUDA IPC exports whole `cuMemAlloc` allocations); the rest is local scratch,
/// from the rank's [`LocalAllocator`] when it has one. Dropped only after every kernel of the
/// device is done.
#[derive(Debug)]
pub(crate) struct RankMemory {
    pub(crate) ctx: Arc<CudaContext>,
    pub(crate) disp_recv: DeviceBuffer,
    pub(crate) comb_recv: DeviceBuffer,
    /// High-throughput: the count-exchange region of handle creation (1 byte otherwise).
    pub(crate) exchange: DeviceBuffer,
    /// High-throughput: the mark counter of handles built on the device (one u64, zeroed: the
    /// mark blocks done over every creation, `ep_ht_plan`). Local.
    pub(crate) plan_marks: DeviceBuffer,
    pub(crate) signals: DeviceBuffer,
    pub(crate) status: PinnedBuffer,
    pub(crate) disp_out: Vec<DeviceBuffer>,
    pub(crate) disp_scales: Vec<DeviceBuffer>,
    pub(crate) disp_counts: Vec<DeviceBuffer>,
    pub(crate) host_counts: Vec<PinnedBuffer>,
    /// Rank-major dispatch: received weights then local expert indices, per set
    /// ([`crate::layout::LlLayout::rank_major_topk_bytes`]).
    pub(crate) disp_topk: Vec<DeviceBuffer>,
    pub(crate) comb_out: Vec<DeviceBuffer>,
    /// Rank masking: per set, the combine's per-token counts of entries on masked ranks `[M]`.
    pub(crate) comb_masked: Vec<DeviceBuffer>,
}

impl RankMemory {
    /// A rank's memory: receive regions and signal pages (peers map them); low-latency groups
    /// also get their output buffer sets (high-throughput outputs are allocated per operation).
    /// The local parts (the mark counter, the output sets) come from `local` when given.
    pub(crate) fn allocate(
        ctx: &Arc<CudaContext>,
        layout: &BufferLayout,
        local: Option<&Arc<dyn LocalAllocator>>,
    ) -> Result<Self, Error> {
        let per_set = |sets: usize, bytes: usize| {
            (0..sets).map(|_| DeviceBuffer::zeroed_with(ctx, bytes, local)).collect::<Result<Vec<_>, _>>()
        };
        let mut mem = RankMemory {
            ctx: Arc::clone(ctx),
            disp_recv: DeviceBuffer::zeroed(ctx, layout.dispatch_recv_bytes())?,
            comb_recv: DeviceBuffer::zeroed(ctx, layout.combine_recv_bytes())?,
            exchange: DeviceBuffer::zeroed(ctx, layout.exchange_bytes())?,
            plan_marks: DeviceBuffer::zeroed_with(ctx, 8, local)?,
            signals: DeviceBuffer::zeroed(ctx, SIGNAL_PAGE_BYTES)?,
            status: PinnedBuffer::zeroed(ctx, status::WORDS * 8)?,
            disp_out: Vec::new(),
            disp_scales: Vec::new(),
            disp_counts: Vec::new(),
            host_counts: Vec::new(),
            disp_topk: Vec::new(),
            comb_out: Vec::new(),
            comb_masked: Vec::new(),
        };
        let BufferLayout::Ll(l) = layout else { return Ok(mem) };
        let sets = l.sets;
        mem.disp_out = per_set(sets, l.dispatch_out_bytes())?;
        mem.disp_scales = per_set(sets, l.dispatch_scales_bytes())?;
        mem.disp_counts = per_set(sets, l.counts_len() * 4)?;
        mem.host_counts =
            (0..sets).map(|_| PinnedBuffer::zeroed(ctx, l.counts_len() * 4)).collect::<Result<Vec<_>, _>>()?;
        mem.disp_topk = per_set(sets, l.rank_major_topk_bytes())?;
        mem.comb_out = per_set(sets, l.combine_out_bytes())?;
        mem.comb_masked = per_set(sets, l.max_tokens.max(1) * 4)?;
        Ok(mem)
    }
}

impl Drop for RankMemory {
    fn drop(&mut self) {
        if bind(&self.ctx).is_ok() {
            let _ = self.ctx.synchronize();
        }
    }
}

/// The device addresses of every rank's receive regions and signal page, and per rank what
/// keeps them mapped (the peers' memory in one process; CUDA IPC mappings across processes):
/// `keep[r]` goes when rank `r`'s place is taken by another process.
#[derive(Clone)]
pub(crate) struct Peers {
    pub(crate) disp_recv: Vec<u64>,
    pub(crate) comb_recv: Vec<u64>,
    pub(crate) exchange: Vec<u64>,
    pub(crate) signals: Vec<u64>,
    pub(crate) keep: Vec<Vec<Kept>>,
}

/// Something kept alive while addresses into it are in use (a rank's memory, an IPC mapping).
pub(crate) type Kept = Arc<dyn std::any::Any + Send + Sync>;

impl std::fmt::Debug for Peers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Peers").field("ranks", &self.signals.len()).finish()
    }
}

/// The staging buffers of one count exchange, in mapped pinned host memory (the kernel reads
/// and writes them directly): this rank's messages and what it receives.
#[derive(Debug)]
pub(crate) struct ExchangeBuffers {
    pub(crate) msgs: PinnedBuffer,
    pub(crate) out: PinnedBuffer,
}

/// What every operation of a rank shares.
#[derive(Debug)]
pub(crate) struct RankShared {
    pub(crate) rank: usize,
    pub(crate) num_ranks: usize,
    pub(crate) device: usize,
    pub(crate) config: GroupConfig,
    pub(crate) layout: BufferLayout,
    pub(crate) group_id: u64,
    /// The group's poison flag (the rank's [`epflow_core::backend::RankCore`] holds the same).
    pub(crate) poison: Arc<Poison>,
    pub(crate) ctx: Arc<CudaContext>,
    /// One stream per channel (dispatch, combine, handle), so the channels never block each
    /// other (ranks may interleave operations of different channels differently).
    pub(crate) streams: [Arc<CudaStream>; 3],
    /// Low-latency handles created in stream order and dispatched again: the stream their
    /// kernel runs on (`ll::handle::stream_routing`), created at the first need. Its own, so
    /// that nothing of a caller's stream comes between the handle stream's work (a mask
    /// change's meeting, awaited handles) and the host.
    pub(crate) later_builds: Mutex<Option<Arc<CudaStream>>>,
    pub(crate) functions: Functions,
    pub(crate) mem: Arc<RankMemory>,
    /// Every rank's buffers as this process addresses them (index = rank), this one included;
    /// replaced as a whole when a process takes a masked rank's place (`rank/rejoin.rs`), so
    /// read it once per launch ([`RankShared::peers`]).
    pub(crate) peers: std::sync::RwLock<Arc<Peers>>,
    /// How many times [`RankShared::replace_peers`] ran: steps captured under another
    /// generation hold addresses of replaced ranks and are refused.
    pub(crate) peers_generation: AtomicU64,
    pub(crate) num_sms: u32,
    /// Handles' memory, recycled (local: from `local_allocator` when set).
    pub(crate) handle_pool: Arc<Mutex<Vec<DeviceBuffer>>>,
    /// Low-latency: a handle's worth of zeroed memory for cancellations that have no usable
    /// handle of their own (a foreign handle failed validation).
    pub(crate) null_handle: Option<DeviceBuffer>,
    /// Recycled CUDA events (completions, fences).
    pub(crate) events: Arc<EventPool>,
    /// Recycled CUDA events with timing (operations' timing events, with timing on).
    pub(crate) timed_events: Arc<EventPool>,
    /// High-throughput outputs, recycled when dropped.
    pub(crate) outputs: Arc<OutputCache>,
    /// High-throughput: staging buffers of the count exchange, recycled.
    pub(crate) exchange_pool: Mutex<Vec<ExchangeBuffers>>,
    /// The mapped words a handle built on the device reports in (a high-throughput plan's
    /// result, a low-latency handle kernel's report), recycled.
    pub(crate) plan_results: Arc<Mutex<Vec<PinnedBuffer>>>,
    /// High-throughput: 0, or 1 + the byte every output is filled with before its kernel runs
    /// ([`crate::GpuRank::fill_output_buffers`]).
    pub(crate) output_fill: AtomicU32,
    pub(crate) timing: AtomicBool,
    /// Whether synchronous low-latency operations may run as one cooperative launch: two
    /// blocks of the kernels fit on an SM (a grid takes at most one per SM, so the other
    /// channel's fits beside it), and no other rank of the group shares this GPU (its kernel
    /// could not run while this one's blocks wait for it). `EPFLOW_ONE_LAUNCH=0` turns
    /// it off.
    pub(crate) one_launch: bool,
    /// Per channel, the next operation allowed to send (sends go out in operation order).
    pub(crate) turns: [AtomicU64; 3],
    /// Per channel, the last kernel launched that must not overlap another of the channel (an
    /// event after it, with its stream): a high-throughput kernel (their ring positions follow
    /// each other), or a low-latency one-launch kernel (its cooperative grid, one block per SM,
    /// is sized to fit beside one grid of the other channel, not of its own). Such a kernel
    /// launched on another stream (a caller's, in stream order) waits for it; so does a
    /// captured step's replay (`graph/`) that holds a one-launch kernel, as a whole, for each
    /// channel it uses, and becomes it (a replay of send and receive halves only does not).
    pub(crate) last_launch: [Mutex<Option<StreamFence>>; 3],
    /// The rank numbers its low-latency operations on the device (`graph/numbered.rs`): its
    /// host-numbered ones are refused.
    pub(crate) numbered: std::sync::atomic::AtomicBool,
    /// Mark blocks of device-built high-throughput handles launched so far (the value the mark
    /// counter `mem.plan_marks` reaches once they ran); changed under the handle channel's
    /// `last_launch` lock, so in the order the kernels run.
    pub(crate) plan_marks_launched: AtomicU64,
    /// The meetings this rank has called ([`crate::GpuRank::meet_on`]): the next one's number
    /// is one more.
    pub(crate) meetings: AtomicU64,
    /// Where `Backend::admit` gets its rejoin meetings ([`crate::GpuRank::set_meeting_source`]).
    pub(crate) meeting_source: crate::setup::meeting::MeetingSourceSlot,
    /// The NCCL transport, when some peer uses it.
    pub(crate) nccl: Option<NcclShared>,
    /// Where the rank's local scratch comes from ([`RankShared::local_zeroed`]; `None`:
    /// `cuMemAlloc`): handle memory (the pool), the null handle, the mark counter and output
    /// sets of `mem`, NCCL staging, captured steps' bases and their handles' outputs,
    /// expert-major plans, int64 copies of int32 routings. Never memory peers map, nor the
    /// high-throughput output cache (in one-process groups peers read those outputs in place).
    pub(crate) local_allocator: Option<Arc<dyn LocalAllocator>>,
    /// Whether another rank of the group shares this GPU: then frees in its context are
    /// parked until the last such rank goes ([`crate::device::SharedContext`]). Last, so
    /// dropped after the rank's own memory.
    #[expect(dead_code, reason = "held for its drop")]
    pub(crate) shared_gpu: Option<SharedContext>,
}

impl RankShared {
    /// The first error the device reported on this rank (a timeout: the group must be
    /// poisoned), as the error of operation `op`. A high-throughput mismatch is not one: the
    /// operation that saw it reports it when it finishes, and poisons the group.
    pub(crate) fn device_error(&self, op: String) -> Option<Error> {
        let w = self.mem.status.read_u64(status::ERROR);
        if w == 0 || w & 0xff == status::MISMATCH {
            return None;
        }
        let (code, peer, seq) = (w & 0xff, (w >> 8) & 0xff, w >> 16);
        let waiting_for = match code {
            status::TIMEOUT_ARRIVAL => format!("data from rank {peer} (operation #{seq} of the channel)"),
            status::TIMEOUT_CREDIT => format!(
                "buffer credits from rank {peer} (it has not consumed operation #{} of the channel)",
                seq.saturating_sub(self.config.buffer_sets as u64)
            ),
            status::MEET_TIMEOUT => format!("rank {peer} to come to meeting #{seq} (GpuRank::meet_on)"),
            status::TIMEOUT_RING => {
                format!("ring space at rank {peer} (it stopped receiving operation #{seq} of the channel)")
            }
            _ => format!("device error code {code}"),
        };
        Some(Error::Timeout { op, rank: self.rank, waiting_for, after: self.config.timeout })
    }

    /// Rank masking: the mask word this rank's kernels last saw (bit `r` = rank `r`), read
    /// from the mapped status page.
    pub(crate) fn mask_mirror(&self) -> u64 {
        self.mem.status.read_u64(status::MASK)
    }

    /// The deadline of a wait on the device: 90 % of the group timeout, so the device reports
    /// its timeout (naming the peer) before the host's own deadline expires. Far from overflowing
    /// `%globaltimer` (the config bounds the timeout).
    pub(crate) fn device_timeout_ns(&self) -> u64 {
        u64::try_from(self.config.timeout.as_nanos()).unwrap_or(u64::MAX).min(1 << 62) / 10 * 9
    }

    /// The NCCL transport when this operation runs entirely over NCCL (high-throughput with
    /// any NCCL peer).
    pub(crate) fn nccl_all(&self) -> Option<&NcclShared> {
        self.nccl.as_ref().filter(|_| self.config.algorithm == Algorithm::HighThroughput)
    }

    /// The arrival exchange of channel `chan`'s buffer set `set` with NCCL peer `peer`: this
    /// rank's arrival pair (word and stamp) goes out, the peer's lands where the NVLink kernels
    /// expect it.
    pub(crate) fn arrival_xfer(&self, chan: usize, set: usize, peer: usize) -> Xfer {
        let page = self.mem.signals.ptr();
        Xfer {
            peer,
            send: (page + arrival_offset(chan, set, self.rank), 16),
            recv: (page + arrival_offset(chan, set, peer), 16),
        }
    }

    /// `bytes` of zeroed local scratch: from the rank's local allocator if it has one, else
    /// `cuMemAlloc`. Never for memory peers map.
    pub(crate) fn local_zeroed(&self, bytes: usize) -> Result<DeviceBuffer, Error> {
        DeviceBuffer::zeroed_with(&self.ctx, bytes, self.local_allocator.as_ref())
    }

    /// The stream of [`RankShared::later_builds`], created on the first call.
    pub(crate) fn later_build_stream(&self) -> Result<Arc<CudaStream>, Error> {
        let mut s = self.later_builds.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(stream) = &*s {
            return Ok(Arc::clone(stream));
        }
        let stream = self.ctx.new_stream().map_err(|e| cuda("create a stream", e))?;
        *s = Some(Arc::clone(&stream));
        Ok(stream)
    }

    /// This rank's receive region of the dispatch (`dispatch`) or combine channel, and every
    /// rank's, in rank order.
    pub(crate) fn recv_regions(&self, dispatch: bool) -> (u64, [u64; MAX_RANKS]) {
        let peers = self.peers();
        if dispatch {
            (self.mem.disp_recv.ptr(), peer_array(&peers.disp_recv))
        } else {
            (self.mem.comb_recv.ptr(), peer_array(&peers.comb_recv))
        }
    }

    /// Every rank's mapped memory now.
    pub(crate) fn peers(&self) -> Arc<Peers> {
        Arc::clone(&self.peers.read().unwrap_or_else(|e| e.into_inner()))
    }

    /// Replaces the view of the peers' memory (a process took a masked rank's place); returns
    /// the view it replaced, for the caller to drop when no peer's kernel can be waiting.
    pub(crate) fn replace_peers(&self, peers: Peers) -> Arc<Peers> {
        let mut view = self.peers.write().unwrap_or_else(|e| e.into_inner());
        self.peers_generation.fetch_add(1, std::sync::atomic::Ordering::AcqRel);
        std::mem::replace(&mut *view, Arc::new(peers))
    }

    /// The view of the peers' memory at creation.
    pub(crate) fn peers_cell(peers: Peers) -> std::sync::RwLock<Arc<Peers>> {
        std::sync::RwLock::new(Arc::new(peers))
    }
}

impl Drop for RankShared {
    fn drop(&mut self) {
        if bind(&self.ctx).is_ok() {
            let later = self.later_builds.get_mut().unwrap_or_else(|e| e.into_inner()).take();
            for s in self.streams.iter().chain(later.as_ref()) {
                let _ = s.synchronize();
            }
        }
    }
}

/// Copies per-rank device addresses into a kernel parameter array (`MAX_RANKS` entries).
pub(crate) fn peer_array(addrs: &[u64]) -> [u64; MAX_RANKS] {
    let mut out = [0u64; MAX_RANKS];
    let n = addrs.len().min(MAX_RANKS);
    out[..n].copy_from_slice(&addrs[..n]);
    out
}

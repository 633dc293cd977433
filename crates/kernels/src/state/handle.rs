//! [`GpuHandle`]: a routing handle of the GPU backend, its device memory, and what it learnt
//! from collectives (the high-throughput count exchange; the low-latency NCCL row counts).

use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::CudaEvent;
use epflow_core::Error;
use epflow_core::handle::{HandleCore, RoutingHandle};
use epflow_core::ops::DispatchOutputs;

use crate::device::cache::take_smallest;
use crate::device::{DeviceBuffer, DeviceTensor, OpTiming, PinnedBuffer};
use crate::params::MAX_RANKS;
use crate::state::shared::RankShared;

/// A routing handle on the GPU backend: the validated routing and its device memory (a copy
/// of `topk_idx`; low-latency: the row map dispatch writes for combine; high-throughput: the send
/// plan and the receive layout learnt by the count exchange). Cheap to clone. It serves any
/// number of dispatch/combine pairs; a combine pairs with the latest completed dispatch (of
/// either pass in high-throughput, [`epflow_core::handle`]).
#[derive(Clone, Debug)]
pub struct GpuHandle(pub(crate) Arc<GpuHandleState>);

/// What a [`GpuHandle`] holds.
#[derive(Debug)]
pub(crate) struct GpuHandleState {
    pub(crate) core: HandleCore,
    pub(crate) mem: Option<DeviceBuffer>,
    pub(crate) pool: Arc<Mutex<Vec<DeviceBuffer>>>,
    /// High-throughput handles: what the count exchange taught.
    pub(crate) ht: Option<HtHandleInfo>,
    /// Low-latency handles with NCCL peers: the combine rows to and from them.
    pub(crate) ll_nccl: Option<LlNcclInfo>,
    /// Low-latency: who writes and who reads the row map, on the device.
    pub(crate) row_map: Mutex<RowMap>,
    /// A handle of captured steps (`graph/`): its `topk_idx` buffer, outputs and report.
    pub(crate) graph: Option<GraphHandle>,
    /// A high-throughput handle handed out before its creation completed (stream order).
    pub(crate) creation: Option<StreamCreation>,
    /// A rank-major low-latency handle whose dispatches send their messages compacted: per
    /// destination, how many (the slots are in the handle's memory, `LlLayout::send_slot_offset`),
    /// or -1 where the kernels read them from the handle's memory (built in stream order).
    pub(crate) send_rows: Option<[i32; MAX_RANKS]>,
    /// A low-latency handle created in a stream's order, handed out before the device read its
    /// routing (`ll/handle.rs`).
    pub(crate) ll_stream: Option<LlStreamBuilt>,
    /// A high-throughput handle whose creation the host awaited, with timing on: the creation's
    /// timing events ([`GpuHandle::creation_elapsed`]).
    pub(crate) creation_time: Option<OpTiming>,
}

/// A low-latency handle created in a stream's order (`ll::handle::build_on`): what its
/// dispatches wait for, where the routing's invalid entries are reported (every dispatch on the
/// handle checks at its verdict), and what must outlive the kernel or the dispatches.
pub(crate) struct LlStreamBuilt {
    /// Recorded on `stream` after `topk_idx`'s ready event (and the handle's kernel, if any).
    pub(crate) built: Arc<CudaEvent>,
    /// The stream the handle was created on ([`crate::device::stream_id`]): work enqueued there
    /// later needs no wait.
    pub(crate) stream: usize,
    /// The mapped report of the kernel (`ll_handle.cuh`) or of the dispatches (`topk_src`);
    /// back to `report_pool` when the handle is dropped.
    pub(crate) report: Option<PinnedBuffer>,
    /// Where `report` goes back (the rank's `plan_results`).
    pub(crate) report_pool: Arc<Mutex<Vec<PinnedBuffer>>>,
    /// `topk_idx`'s memory (when epflow holds it), while the kernel or the dispatches may read it.
    pub(crate) topk: Option<Arc<dyn std::any::Any + Send + Sync>>,
    /// Without a kernel (`ll::handle::build_on`'s default): the caller's `topk_idx`, which the
    /// dispatches on the handle read (`LlParams::topk_src`), reporting invalid rows in `report`
    /// in the format of captured steps' (`ll::report::invalid_row_in`, replay 0), until the
    /// handle's kernel built it in `later` (`ll::handle::stream_routing`).
    pub(crate) topk_src: Option<u64>,
    /// With `topk_src`: the dispatches so far and the kernel launched for the later ones.
    pub(crate) later: Mutex<LaterBuild>,
}

/// A low-latency handle created in stream order without a kernel, reused: the kernel that
/// builds its copy and compacted slots once it is dispatched again (`ll::handle::stream_routing`).
#[derive(Default)]
pub(crate) struct LaterBuild {
    /// Dispatches started on the handle.
    pub(crate) dispatches: u32,
    /// The kernel's event, its own report (every entry it reads was already checked by the
    /// first dispatches; read by the verdicts) and the stream it ran on
    /// (`RankShared::later_builds`, [`crate::device::stream_id`]).
    pub(crate) built: Option<(Arc<CudaEvent>, PinnedBuffer, usize)>,
}

impl std::fmt::Debug for LlStreamBuilt {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LlStreamBuilt").field("stream", &self.stream).finish_non_exhaustive()
    }
}

/// A high-throughput handle handed out in stream order, before the device had built it
/// (`HandleFuture::complete_on` with `RecvRows::Bound`): what operations on it wait for, and
/// where the creation's outcome lies. The plan kernels leave an empty plan behind a failed
/// creation (`ht_handle.cuh`, `plan_empty`), so operations enqueued on it move nothing; each checks
/// the outcome when it finishes.
#[derive(Debug)]
pub(crate) struct StreamCreation {
    /// The creation's number on the handle channel.
    pub(crate) seq: u64,
    /// Recorded after the creation's kernels: every operation on the handle waits for it on
    /// the device before its kernel.
    pub(crate) built: Arc<CudaEvent>,
    /// The mapped words of the plan kernels (`ht::plan`), until the handle is dropped; then
    /// back to `results_pool`.
    pub(crate) result: Option<PinnedBuffer>,
    pub(crate) results_pool: Arc<Mutex<Vec<PinnedBuffer>>>,
    /// Local experts (the rows per local expert follow the result's head).
    pub(crate) local: usize,
    /// The creation's error, once its verdict was read (a reactor job reads it).
    pub(crate) failed: OnceLock<Error>,
}

impl StreamCreation {
    /// Whether the device built the handle (read once the kernels ended: after `built`).
    fn built_ok(&self) -> bool {
        self.result.as_ref().is_some_and(|r| r.read_u64(crate::state::ht_result::RESULT_BUILT) == self.seq + 1)
    }
}

/// What a handle of captured steps (`graph/`) holds beside an eager handle's memory.
#[derive(Debug)]
pub(crate) struct GraphHandle {
    /// The caller's `[B x K]` int64 `topk_idx` buffer, read by the step's dispatch send.
    pub(crate) topk: DeviceTensor,
    /// The report of invalid rows (mapped host, `1 + 2B` words; written by the captured
    /// dispatch's send, `routed_entry` in `ll_send.cuh`): `[0]` the last replay with one + 1; per
    /// token `t`, `[1 + t]` = (replay + 1) << 16 | (earlier k naming the same expert + 1) << 8 |
    /// the row's first invalid k, and `[1 + B + t]` its value.
    pub(crate) report: PinnedBuffer,
    /// The dispatch outputs (one dispatch per replay).
    pub(crate) dispatched: DispatchOutputs<DeviceTensor>,
    /// The combine output `[B x H]` BF16.
    pub(crate) combined: DeviceTensor,
    /// The step that captured the handle (a handle belongs to one step).
    pub(crate) step: Mutex<Option<u64>>,
}

/// What a low-latency handle knows about its NCCL peers.
#[derive(Debug)]
pub(crate) struct LlNcclInfo {
    /// Per rank, `(first row, rows)` of its combine rows here (from this rank's routing).
    pub(crate) recv_blocks: Vec<(usize, usize)>,
    /// Per rank, the rows this rank sends back to it in combine (what it dispatched here in the
    /// latest dispatch).
    pub(crate) send_rows: Mutex<Vec<usize>>,
}

/// What a high-throughput handle knows after its count exchange.
#[derive(Debug)]
pub(crate) struct HtHandleInfo {
    /// Tokens per channel on this rank.
    pub(crate) tokens_per_channel: usize,
    /// Byte offsets of the arrays in the handle's device memory.
    pub(crate) off: HandleOffsets,
    /// Per rank, `(first, rows)` of the block of the send plan that goes to it (host-built
    /// handles; the NCCL transport needs them. Empty for handles built on the device).
    pub(crate) send_blocks: Vec<(usize, usize)>,
    /// Per rank, `(first, rows)` of the block of the output that comes from it (host-built
    /// handles; empty for handles built on the device).
    pub(crate) recv_blocks: Vec<(usize, usize)>,
    /// Rows of the send plan, all destinations (host-built handles; 0 for device-built ones).
    pub(crate) total_send: usize,
}

/// Byte offsets of a high-throughput handle's arrays (see `HtParams` for their shapes).
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct HandleOffsets {
    pub(crate) send_list: usize,
    pub(crate) send_off: usize,
    pub(crate) recv_base: usize,
    pub(crate) recv_cnt: usize,
    pub(crate) copy_ord: usize,
    pub(crate) counts: usize,
    pub(crate) end: usize,
}

/// The device-side order of a low-latency handle's row map: each dispatch's receive kernel
/// writes it (on the dispatch stream), each combine's send kernel reads it (on the combine
/// stream). A writer waits for the readers enqueued before it; a reader waits for the writer of
/// the dispatch it pairs with, and refuses to run if a later dispatch has rewritten the map.
/// Waits the host has already seen complete (the operation finished) are skipped, so the awaited
/// forms pay nothing for this order.
#[derive(Debug, Default)]
pub(crate) struct RowMap {
    /// The dispatch whose receive kernel last wrote the map.
    pub(crate) writer: Option<u64>,
    /// An event after that receive kernel, until the host saw the dispatch finish.
    pub(crate) writer_event: Option<Arc<CudaEvent>>,
    /// The stream that receive kernel ran on (a combine sent on the same one needs no wait).
    pub(crate) writer_stream: usize,
    /// An event after the last combine send that read the map: the combine's completion event
    /// when it ran as one launch, else `reader_own`.
    pub(crate) reader_event: Option<Arc<CudaEvent>>,
    /// The map's own event, re-recorded after every combine send of two launches.
    pub(crate) reader_own: Option<Arc<CudaEvent>>,
    /// The stream of the last combine send recorded in `reader_event`.
    pub(crate) reader_stream: usize,
    /// Combine sends recorded so far, and the number of the last one the host saw finish:
    /// while they differ, a writer must wait for `reader_event`.
    pub(crate) readers_sent: u64,
    pub(crate) readers_done: u64,
}

impl LlStreamBuilt {
    /// The events after which nothing of the creation reads or writes the handle: `built`, and
    /// the later kernel's if one was launched.
    fn last_events(&self) -> Vec<Arc<CudaEvent>> {
        let later = self.later.lock().unwrap_or_else(|e| e.into_inner());
        std::iter::once(Arc::clone(&self.built)).chain(later.built.as_ref().map(|(e, ..)| Arc::clone(e))).collect()
    }

    /// Once the kernels have run: lets `topk_idx` go, and gives the reports and `mem` (the
    /// handle's memory) back to their pools.
    fn give_back(mut self, mem: Option<DeviceBuffer>, pool: &Mutex<Vec<DeviceBuffer>>) {
        self.topk = None;
        let later = self.later.get_mut().unwrap_or_else(|e| e.into_inner()).built.take();
        let reports = self.report.take().into_iter().chain(later.map(|(_, r, _)| r));
        self.report_pool.lock().unwrap_or_else(|e| e.into_inner()).extend(reports);
        if let Some(m) = mem {
            pool.lock().unwrap_or_else(|e| e.into_inner()).push(m);
        }
    }
}

impl Drop for GpuHandleState {
    fn drop(&mut self) {
        if let Some(b) = self.ll_stream.take() {
            // The kernel writes the memory and reads `topk_idx` and the report: they are reused
            // only after it. Usually it ran long ago (every operation on the handle ran after
            // it); a handle dropped unused may still wait behind its stream's work, which may
            // wait for peers: a thread waits then, never the drop (as `InStreamOrder`'s).
            let mem = self.mem.take();
            let events = b.last_events();
            let done = mem.as_ref().is_none_or(|m| events.iter().all(|e| crate::device::event_done(m.context(), e)));
            if done {
                b.give_back(mem, &self.pool);
                return;
            }
            let pool = Arc::clone(&self.pool);
            // Shared with the thread, so that a failed spawn leaves it here to wait inline.
            let left = Arc::new(Mutex::new(Some((b, mem))));
            let theirs = Arc::clone(&left);
            let wait_and_give_back = move |left: &Mutex<Option<(LlStreamBuilt, Option<DeviceBuffer>)>>| {
                let Some((b, mem)) = left.lock().unwrap_or_else(|e| e.into_inner()).take() else { return };
                if let Some(m) = &mem {
                    let _ = crate::device::bind(m.context());
                }
                for e in b.last_events() {
                    if let Err(e) = e.synchronize() {
                        tracing::warn!("a handle built in stream order: waiting for its kernel failed: {e:?}");
                    }
                }
                b.give_back(mem, &pool);
            };
            let wait = wait_and_give_back.clone();
            let spawned = std::thread::Builder::new().name("epflow-handle-drop".into()).spawn(move || wait(&theirs));
            if let Err(e) = spawned {
                tracing::warn!("a handle built in stream order: no thread to wait for its kernel ({e}): waiting here");
                wait_and_give_back(&left);
            }
            return;
        }
        if let Some(m) = self.mem.take() {
            self.pool.lock().unwrap_or_else(|e| e.into_inner()).push(m);
        }
        if let Some(c) = &mut self.creation {
            if let Some(r) = c.result.take() {
                c.results_pool.lock().unwrap_or_else(|e| e.into_inner()).push(r);
            }
        }
    }
}

impl GpuHandle {
    /// The captured-step part of the handle, if it is one (`GpuRank::graph_handle`).
    pub(crate) fn graph(&self) -> Option<&GraphHandle> {
        self.0.graph.as_ref()
    }

    /// Whether the handle is one of captured steps (`GpuRank::graph_handle`): only their
    /// replays use it.
    pub fn is_graph_handle(&self) -> bool {
        self.0.graph.is_some()
    }

    /// A handle around `core` with its device memory `mem` (from `pool`, where it returns);
    /// `send_rows`: a rank-major low-latency handle's compacted message counts per destination
    /// ([`GpuHandleState::send_rows`]); `None` where its dispatches do not compact (expert-major,
    /// `max_tokens` above `LL_COMPACT_MAX_ROWS`, captured steps' handles, high-throughput).
    pub(crate) fn new(
        core: HandleCore,
        mem: DeviceBuffer,
        pool: &Arc<Mutex<Vec<DeviceBuffer>>>,
        ht: Option<HtHandleInfo>,
        ll_nccl: Option<LlNcclInfo>,
        send_rows: Option<[i32; MAX_RANKS]>,
    ) -> Self {
        GpuHandle(Arc::new(GpuHandleState {
            core,
            mem: Some(mem),
            pool: Arc::clone(pool),
            ht,
            ll_nccl,
            row_map: Mutex::default(),
            graph: None,
            creation: None,
            send_rows,
            ll_stream: None,
            creation_time: None,
        }))
    }

    /// A high-throughput handle handed out before the device built it ([`StreamCreation`]).
    pub(crate) fn in_stream_order(
        core: HandleCore,
        mem: DeviceBuffer,
        pool: &Arc<Mutex<Vec<DeviceBuffer>>>,
        ht: HtHandleInfo,
        creation: StreamCreation,
    ) -> Self {
        GpuHandle(Arc::new(GpuHandleState {
            core,
            mem: Some(mem),
            pool: Arc::clone(pool),
            ht: Some(ht),
            ll_nccl: None,
            row_map: Mutex::default(),
            graph: None,
            creation: Some(creation),
            send_rows: None,
            ll_stream: None,
            creation_time: None,
        }))
    }

    /// A low-latency handle built on the device in a stream's order ([`LlStreamBuilt`]):
    /// `send_rows` as [`GpuHandle::new`]'s (-1 where the kernels read the counts).
    pub(crate) fn ll_in_stream_order(
        core: HandleCore,
        mem: DeviceBuffer,
        pool: &Arc<Mutex<Vec<DeviceBuffer>>>,
        send_rows: Option<[i32; MAX_RANKS]>,
        built: LlStreamBuilt,
    ) -> Self {
        GpuHandle(Arc::new(GpuHandleState {
            core,
            mem: Some(mem),
            pool: Arc::clone(pool),
            ht: None,
            ll_nccl: None,
            row_map: Mutex::default(),
            graph: None,
            creation: None,
            send_rows,
            ll_stream: Some(built),
            creation_time: None,
        }))
    }

    /// What a dispatch on a low-latency handle created in stream order is ordered after: the
    /// creation's event and its stream; `None` for every other handle.
    pub(crate) fn ll_built_after(&self) -> Option<(Arc<CudaEvent>, usize)> {
        self.0.ll_stream.as_ref().map(|b| (Arc::clone(&b.built), b.stream))
    }

    /// The routing's first invalid entry as the device found it on a low-latency handle created
    /// in stream order (its kernel, or the dispatch that just ended, which read the caller's
    /// `topk_idx`; read after that dispatch ended); `None` for a valid routing and for every
    /// other handle.
    pub(crate) fn ll_invalid_routing(&self, num_experts: usize) -> Option<epflow_core::ValidationError> {
        let b = self.0.ll_stream.as_ref()?;
        let r = b.report.as_ref()?;
        let (tokens, k) = (self.0.core.num_tokens(), self.0.core.top_k());
        if b.topk_src.is_none() {
            return crate::state::ht_result::invalid_routing_in(r, k, num_experts);
        }
        // The dispatches' report, then the later kernel's once it ran (dispatches ordered after
        // it read no report: a routing whose first dispatches were cancelled is judged there).
        crate::state::ll_report::invalid_row_in(r, tokens, 0, num_experts).or_else(|| {
            let later = b.later.lock().unwrap_or_else(|e| e.into_inner());
            let (event, kr, _) = later.built.as_ref()?;
            let ran = self.0.mem.as_ref().is_some_and(|m| crate::device::event_done(m.context(), event));
            if ran { crate::state::ht_result::invalid_routing_in(kr, k, num_experts) } else { None }
        })
    }

    /// A low-latency handle created in stream order: its creation's part.
    pub(crate) fn ll_stream(&self) -> Option<&LlStreamBuilt> {
        self.0.ll_stream.as_ref()
    }

    /// The event an operation on a handle created in stream order waits for (its creation's
    /// kernels); `None` for every other handle.
    pub(crate) fn built_event(&self) -> Option<Arc<CudaEvent>> {
        self.0.creation.as_ref().map(|c| Arc::clone(&c.built))
    }

    /// An operation on a handle created in stream order, finished: `Ok` if the device built
    /// the handle, else the creation's error (the operation ran on an empty plan and moved
    /// nothing). Also records `N` on the handle. Always `Ok` for other handles.
    pub(crate) fn check_built(&self, op: &str) -> Result<(), Error> {
        let Some(c) = &self.0.creation else { return Ok(()) };
        if c.built_ok() {
            self.settle_recv();
            return Ok(());
        }
        Err(c.failed.get().cloned().unwrap_or_else(|| {
            Error::Backend(format!(
                "{op} ran on the handle of creation #{}, which failed on the device (its completion has the reason; the group is poisoned): it moved nothing",
                c.seq
            ))
        }))
    }

    /// Records what a handle created in stream order receives (`N`, the rows per local expert)
    /// once the device built it; `false` if it has not (failed, or not finished).
    pub(crate) fn settle_recv(&self) -> bool {
        let Some(c) = &self.0.creation else { return true };
        let Some(r) = c.result.as_ref().filter(|_| c.built_ok()) else { return false };
        let head = crate::state::ht_result::RESULT_HEAD;
        let counts = (0..c.local).map(|l| r.read_u64(head + l) as i32).collect();
        self.0.core.set_recv(r.read_u64(crate::state::ht_result::RESULT_N) as usize, counts);
        true
    }

    /// The routing's first invalid entry as the device found it, for a handle created in stream
    /// order (read once its kernels ended).
    pub(crate) fn creation_invalid_routing(&self, num_experts: usize) -> Option<epflow_core::ValidationError> {
        let r = self.0.creation.as_ref()?.result.as_ref()?;
        crate::state::ht_result::invalid_routing_in(r, self.0.core.top_k(), num_experts)
    }

    /// Records the error of a handle creation in stream order (its verdict), for the
    /// operations on it.
    pub(crate) fn set_creation_error(&self, e: &Error) {
        if let Some(c) = &self.0.creation {
            let _ = c.failed.set(e.clone());
        }
    }

    /// The handle, its creation timed by `timing` (a creation the host awaited; `None`: timing
    /// was off). Only on a handle not yet shared.
    pub(crate) fn with_creation_time(mut self, timing: Option<OpTiming>) -> Self {
        if let Some(state) = Arc::get_mut(&mut self.0) {
            state.creation_time = timing;
        }
        self
    }

    /// Device time of this handle's creation, for a high-throughput handle whose creation was
    /// awaited with timing on ([`crate::GpuRank::set_timing`]): from a CUDA event recorded on
    /// the handle stream before the creation's kernel to one after it, so it includes the
    /// launch's own latency and any wait for the peers' messages.
    /// `None` for other handles (low-latency, created in stream order, timing off).
    pub fn creation_elapsed(&self) -> Option<std::time::Duration> {
        self.0.creation_time.as_ref()?.halves().map(|(send, complete)| send + complete)
    }

    /// The device address of the handle's memory.
    pub(crate) fn ptr(&self) -> u64 {
        self.0.mem.as_ref().map_or(0, DeviceBuffer::ptr)
    }

    /// The high-throughput part, or an error naming a low-latency handle.
    pub(crate) fn ht(&self) -> Result<&HtHandleInfo, Error> {
        self.0.ht.as_ref().ok_or_else(|| Error::Backend("a low-latency handle in a high-throughput operation".into()))
    }

    /// The row map's order (low-latency).
    pub(crate) fn row_map(&self) -> std::sync::MutexGuard<'_, RowMap> {
        self.0.row_map.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl RoutingHandle for GpuHandle {
    fn core(&self) -> &HandleCore {
        &self.0.core
    }
}

/// Takes the smallest buffer of at least `bytes` from the rank's handle pool, or allocates one
/// ([`RankShared::local_zeroed`]: from the rank's local allocator if it has one).
pub(crate) fn take_pooled(s: &RankShared, bytes: usize) -> Result<DeviceBuffer, Error> {
    match take_smallest(&s.handle_pool, bytes, DeviceBuffer::bytes) {
        Some(b) => Ok(b),
        None => s.local_zeroed(bytes),
    }
}

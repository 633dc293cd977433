//! [`GpuRank`]: one rank of a GPU group and its [`Backend`] implementation.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use cudarc::driver::{CudaContext, CudaStream};
use epflow_core::backend::{Backend, HandleCreation, RankCore};
use epflow_core::handle::{HandleCore, RoutingHandle};
use epflow_core::ops::{CombineInputs, CombineOptions, CountsLocation, DispatchInputs, DispatchOptions};
use epflow_core::protocol::Channel;
use epflow_core::routing::{ExpertPlacement, Routing};
use epflow_core::validate::{
    OpContext, check_topk_idx, routing_from_tensor, validate_combine_inputs, validate_dispatch_inputs,
};
use epflow_core::{Algorithm, DispatchDtype, Error, GroupConfig};

use crate::cache::OutputCache;
use crate::driver::{bind, cuda};
use crate::ht::{ExchangeBuffers, HtHandleInfo};
use crate::kernels::Kernels;
use crate::layout::Layout;
use crate::memory::{DeviceBuffer, PinnedBuffer, copy_to_host};
use crate::nccl::{NcclShared, Xfer, all_over_nccl, ll_combine_positions};
use crate::op::{GpuOp, Launch, Work};
use crate::outputs::{GpuCombineOutput, GpuDispatchOutput};
use crate::params::{LlParams, MAX_RANKS, MAX_SETS};
use crate::tensor::DeviceTensor;

/// The memory of one rank; peers map it. Dropped only after every kernel of the device is done.
#[derive(Debug)]
pub(crate) struct RankMemory {
    pub ctx: Arc<CudaContext>,
    pub disp_recv: DeviceBuffer,
    pub comb_recv: DeviceBuffer,
    /// High-throughput: the count-exchange region of handle creation (1 byte otherwise).
    pub exchange: DeviceBuffer,
    pub signals: DeviceBuffer,
    pub status: PinnedBuffer,
    pub disp_out: Vec<DeviceBuffer>,
    pub disp_scales: Vec<DeviceBuffer>,
    pub disp_counts: Vec<DeviceBuffer>,
    pub host_counts: Vec<PinnedBuffer>,
    pub comb_out: Vec<DeviceBuffer>,
}

impl Drop for RankMemory {
    fn drop(&mut self) {
        if bind(&self.ctx).is_ok() {
            let _ = self.ctx.synchronize();
        }
    }
}

/// The device addresses of every rank's receive regions and signal page, and what keeps them
/// mapped (the peers' memory in one process; CUDA IPC mappings across processes).
pub(crate) struct Peers {
    pub disp_recv: Vec<u64>,
    pub comb_recv: Vec<u64>,
    pub exchange: Vec<u64>,
    pub signals: Vec<u64>,
    pub _keep: Vec<Arc<dyn std::any::Any + Send + Sync>>,
}

impl std::fmt::Debug for Peers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Peers").field("ranks", &self.signals.len()).finish()
    }
}

/// What every operation of a rank shares.
#[derive(Debug)]
pub(crate) struct RankShared {
    pub rank: usize,
    pub num_ranks: usize,
    pub device: usize,
    pub config: GroupConfig,
    pub layout: Layout,
    pub group_id: u64,
    pub ctx: Arc<CudaContext>,
    /// One stream per channel (dispatch, combine, handle), so the channels never block each
    /// other (ranks may interleave operations of different channels differently).
    pub streams: [Arc<CudaStream>; 3],
    pub kernels: Kernels,
    pub mem: Arc<RankMemory>,
    /// Every rank's buffers as this process addresses them (index = rank), this one included.
    pub peers: Peers,
    pub num_sms: u32,
    pub handle_pool: Arc<Mutex<Vec<DeviceBuffer>>>,
    /// High-throughput outputs, recycled when dropped.
    pub outputs: Arc<OutputCache>,
    /// High-throughput: staging buffers of the count exchange, recycled.
    pub exchange_pool: Mutex<Vec<ExchangeBuffers>>,
    /// High-throughput: 0, or 1 + the byte every output is filled with before its kernel runs.
    pub poison_outputs: AtomicU32,
    pub timing: AtomicBool,
    /// Per channel, the next operation allowed to send (sends go out in operation order).
    pub turns: [AtomicU64; 3],
    /// The NCCL transport, when some peer uses it.
    pub nccl: Option<NcclShared>,
}

impl RankShared {
    /// The deadline of a wait on the device: 90 % of the group timeout, so the device reports
    /// its timeout (naming the peer) before the host's own deadline expires.
    pub fn device_timeout_ns(&self) -> u64 {
        (self.config.timeout.as_nanos() as u64).saturating_mul(9) / 10
    }

    /// The NCCL transport when this operation runs entirely over NCCL (high-throughput with
    /// any NCCL peer).
    pub fn nccl_all(&self) -> Option<&NcclShared> {
        self.nccl.as_ref().filter(|_| all_over_nccl(self.config.algorithm))
    }

    /// Byte offset of word `[array][set][rank]` in a signal page (`sig_at` of `common.cuh`).
    pub fn signal_offset(array: usize, set: usize, rank: usize) -> u64 {
        (((array * MAX_SETS + set) * MAX_RANKS + rank) * 8) as u64
    }

    /// The arrival-word exchange of channel `chan`'s buffer set `set` with NCCL peer `peer`:
    /// this rank's word goes out, the peer's lands where the NVLink kernels expect it.
    pub fn arrival_xfer(&self, chan: usize, set: usize, peer: usize) -> Xfer {
        let page = self.mem.signals.ptr();
        Xfer {
            peer,
            send: (page + Self::signal_offset(chan, set, self.rank), 8),
            recv: (page + Self::signal_offset(chan, set, peer), 8),
        }
    }

    /// This rank's receive region of the dispatch (`dispatch`) or combine channel, and every
    /// rank's, in rank order.
    pub fn recv_regions(&self, dispatch: bool) -> (u64, &[u64]) {
        if dispatch {
            (self.mem.disp_recv.ptr(), &self.peers.disp_recv)
        } else {
            (self.mem.comb_recv.ptr(), &self.peers.comb_recv)
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

impl Drop for RankShared {
    fn drop(&mut self) {
        if bind(&self.ctx).is_ok() {
            for s in &self.streams {
                let _ = s.synchronize();
            }
        }
    }
}

/// One rank of a GPU group. Every operation is collective: all ranks call it, in the same
/// order. Operations of one channel are sent in call order; dispatch and combine run on two
/// streams of their own ([`GpuRank::stream`]).
#[derive(Debug)]
pub struct GpuRank {
    pub(crate) shared: Arc<RankShared>,
    pub(crate) core: RankCore,
}

/// A routing handle on the GPU backend: the validated routing and its device memory (a copy
/// of `topk_idx`; low-latency: the row map dispatch writes for combine; high-throughput: the send
/// plan and the receive layout learnt by the count exchange).
#[derive(Clone, Debug)]
pub struct GpuHandle(pub(crate) Arc<HandleInner>);

#[derive(Debug)]
pub(crate) struct HandleInner {
    pub core: HandleCore,
    pub mem: Option<DeviceBuffer>,
    pub pool: Arc<Mutex<Vec<DeviceBuffer>>>,
    /// High-throughput handles: what the count exchange taught.
    pub ht: Option<HtHandleInfo>,
    /// Low-latency handles with NCCL peers: per rank, `(first row, rows)` of its combine rows
    /// here (from this rank's routing), and, once dispatch finished, the rows this rank sends
    /// back to each rank in combine (what that rank dispatched here).
    pub ll_nccl: Option<LlNcclInfo>,
}

/// What a low-latency handle knows about its NCCL peers.
#[derive(Debug)]
pub(crate) struct LlNcclInfo {
    pub recv_blocks: Vec<(usize, usize)>,
    pub send_rows: Mutex<Vec<usize>>,
}

impl Drop for HandleInner {
    fn drop(&mut self) {
        if let Some(m) = self.mem.take() {
            self.pool.lock().unwrap_or_else(|e| e.into_inner()).push(m);
        }
    }
}

impl GpuHandle {
    /// `B`.
    pub fn num_tokens(&self) -> usize {
        self.0.core.num_tokens()
    }

    /// `K`.
    pub fn top_k(&self) -> usize {
        self.0.core.top_k()
    }

    /// The validated routing.
    pub fn routing(&self) -> &Routing {
        self.0.core.routing()
    }

    /// High-throughput: `N`, the rows this rank receives (NCCL EP's
    /// `ncclEpHandleGetNumRecvTokens`), known once the handle exists. `None` for low-latency.
    pub fn num_recv_tokens(&self) -> Option<usize> {
        self.0.ht.as_ref().map(|h| h.num_recv)
    }

    /// High-throughput: rows this rank receives per local expert (`[L]`).
    pub fn recv_expert_counts(&self) -> Option<&[i32]> {
        self.0.ht.as_ref().map(|h| h.expert_counts.as_slice())
    }

    pub(crate) fn ptr(&self) -> u64 {
        self.0.mem.as_ref().map_or(0, DeviceBuffer::ptr)
    }
}

impl RoutingHandle for GpuHandle {
    fn core(&self) -> &HandleCore {
        &self.0.core
    }

    fn num_recv_tokens(&self) -> Option<usize> {
        GpuHandle::num_recv_tokens(self)
    }

    fn recv_expert_counts(&self) -> Option<&[i32]> {
        GpuHandle::recv_expert_counts(self)
    }
}

/// Takes the smallest pooled buffer of at least `bytes`, or allocates one.
pub(crate) fn take_pooled(
    ctx: &Arc<CudaContext>,
    pool: &Mutex<Vec<DeviceBuffer>>,
    bytes: usize,
) -> Result<DeviceBuffer, Error> {
    match crate::cache::take_smallest(pool, bytes) {
        Some(b) => Ok(b),
        None => DeviceBuffer::zeroed(ctx, bytes),
    }
}

impl GpuRank {
    /// Connects this rank's NCCL communicators to every peer (collective; nothing without NCCL).
    pub(crate) fn connect_nccl(&self) -> Result<(), Error> {
        let s = &self.shared;
        match &s.nccl {
            Some(n) => n.comms.connect(&s.ctx, &s.streams[0], s.rank, s.num_ranks),
            None => Ok(()),
        }
    }

    /// Which peers this rank reaches through NCCL (bit `r` = rank `r`; 0 = NVLink only).
    pub fn nccl_peers(&self) -> u32 {
        self.shared.nccl.as_ref().map_or(0, |n| n.mask)
    }

    /// The device this rank runs on.
    pub fn device(&self) -> usize {
        self.shared.device
    }

    /// The CUDA context of the device.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.shared.ctx
    }

    /// The stream operations of `channel` run on: order your producers and consumers against it
    /// (or pass inputs with [`DeviceTensor::ready_after`]).
    pub fn stream(&self, channel: Channel) -> &Arc<CudaStream> {
        &self.shared.streams[channel.index()]
    }

    /// Device bytes the group holds on this rank.
    pub fn device_memory_bytes(&self) -> usize {
        self.shared.layout.total_bytes()
    }

    /// Records CUDA events around every operation, for [`GpuDispatchOutput::elapsed`] (host-observed
    /// device time from before the send half to after the complete half).
    pub fn set_timing(&self, on: bool) {
        self.shared.timing.store(on, Ordering::Relaxed);
    }

    /// Overwrites every output buffer of every set with `byte` (a debugging aid: poisoned outputs
    /// show rows an operation failed to write). Waits for this rank's streams first.
    /// High-throughput groups allocate outputs per operation: from now on each is filled with
    /// `byte` before its kernel runs.
    pub fn fill_output_buffers(&self, byte: u8) -> Result<(), Error> {
        let s = &self.shared;
        s.poison_outputs.store(1 + u32::from(byte), Ordering::Relaxed);
        bind(&s.ctx)?;
        for st in &s.streams {
            st.synchronize().map_err(|e| cuda("synchronize", e))?;
        }
        let m = &s.mem;
        for b in m.disp_out.iter().chain(&m.disp_scales).chain(&m.disp_counts).chain(&m.comb_out) {
            // SAFETY: fills the whole allocation of a live buffer of this context; no kernel uses
            // it (the streams are idle).
            unsafe { cudarc::driver::sys::cuMemsetD8_v2(b.ptr(), byte, b.bytes()) }
                .result()
                .map_err(|e| cuda("fill", e))?;
        }
        Ok(())
    }

    /// Copies `src` into `dst` (same size) on the stream of `channel`, without a host wait;
    /// returns an event after the copy. Use `dst.ready_after(event)` as the input of a later
    /// operation: its send half waits for the copy on the device.
    pub fn copy_on_stream(
        &self,
        channel: Channel,
        src: &DeviceTensor,
        dst: &DeviceTensor,
    ) -> Result<Arc<cudarc::driver::CudaEvent>, Error> {
        if src.desc().size_bytes() != dst.desc().size_bytes() {
            return Err(Error::Unsupported(format!(
                "copy of {} B into {} B",
                src.desc().size_bytes(),
                dst.desc().size_bytes()
            )));
        }
        let s = &self.shared;
        bind(&s.ctx)?;
        let stream = self.stream(channel);
        for e in [src.ready_event(), dst.ready_event()].into_iter().flatten() {
            stream.wait(e).map_err(|e| cuda("wait for tensor", e))?;
        }
        // SAFETY: both are device ranges of `size_bytes` in this context (checked sizes); the
        // copy is ordered on `stream`.
        unsafe {
            cudarc::driver::sys::cuMemcpyDtoDAsync_v2(dst.ptr(), src.ptr(), src.desc().size_bytes(), stream.cu_stream())
        }
        .result()
        .map_err(|e| cuda("copy", e))?;
        let ev = s.ctx.new_event(None).map_err(|e| cuda("create event", e))?;
        ev.record(stream).map_err(|e| cuda("record event", e))?;
        Ok(Arc::new(ev))
    }

    /// Copies a host tensor to this rank's device.
    pub fn upload(&self, t: &epflow_core::HostTensor) -> Result<DeviceTensor, Error> {
        DeviceTensor::upload(&self.shared.ctx, self.shared.device, t)
    }

    /// Dequantizes FP8 rows (`[rows x H]` + scales `[rows x H/128]`) into a new BF16 tensor.
    pub fn dequantize_fp8(&self, q: &DeviceTensor, scales: &DeviceTensor) -> Result<DeviceTensor, Error> {
        let rows: usize = q.desc().shape[..q.desc().shape.len() - 1].iter().product();
        let h = self.shared.config.hidden;
        let mut desc = q.desc().clone();
        desc.dtype = epflow_core::DType::Bf16;
        let out = DeviceTensor::zeros(&self.shared.ctx, self.shared.device, desc)?;
        let stream = &self.shared.streams[0];
        let (qp, sp, op, r, hh) = (q.ptr(), scales.ptr(), out.ptr(), rows as u64, h as i32);
        let blocks = (self.shared.num_sms * 4).max(1);
        let cfg =
            cudarc::driver::LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        use cudarc::driver::PushKernelArg;
        // SAFETY: the arguments match `ep_dequant_fp8_rows(u64, u64, u64, u64, int)`; the three
        // buffers hold rows x H bytes, rows x H/128 floats and rows x H BF16 values.
        unsafe {
            stream
                .launch_builder(&self.shared.kernels.dequant_fp8)
                .arg(&qp)
                .arg(&sp)
                .arg(&op)
                .arg(&r)
                .arg(&hh)
                .launch(cfg)
        }
        .map_err(|e| cuda("launch dequantize", e))?;
        stream.synchronize().map_err(|e| cuda("dequantize", e))?;
        Ok(out)
    }

    pub(crate) fn check_handle(&self, h: &GpuHandle) -> Result<(), Error> {
        self.core.check_handle(h)
    }

    pub(crate) fn ctx_for(&self, h: &GpuHandle) -> OpContext<'_> {
        self.core.op_context(h)
    }

    pub(crate) fn check_device(&self, t: &DeviceTensor, what: &str) -> Result<(), Error> {
        if t.device() != self.shared.device {
            return Err(Error::Unsupported(format!(
                "{what} is on device {}, this rank runs on device {}",
                t.device(),
                self.shared.device
            )));
        }
        Ok(())
    }

    /// The parameters every low-latency kernel of `channel` shares.
    fn base_params(&self, channel: usize, h: &GpuHandle) -> Result<LlParams, Error> {
        let s = &self.shared;
        let l = s.layout.ll("a low-latency kernel")?;
        let mut p = LlParams {
            topk_idx: h.ptr(),
            row_of: h.ptr() + l.topk_copy_bytes() as u64,
            signals: s.mem.signals.ptr(),
            status: s.mem.status.device_ptr(),
            timeout_ns: s.device_timeout_ns(),
            rank: s.rank as i32,
            num_ranks: s.num_ranks as i32,
            max_tokens: l.max_tokens as i32,
            hidden: l.hidden as i32,
            top_k: h.top_k() as i32,
            num_local: l.local_experts as i32,
            num_tokens: h.num_tokens() as i32,
            num_sets: l.sets as i32,
            fp8: i32::from(l.fp8 && channel == 0),
            round_scales: i32::from(matches!(s.config.dispatch_dtype, DispatchDtype::Fp8 { round_scales: true })),
            splits: (s.num_sms as usize / l.local_experts).clamp(1, 4) as i32,
            ..LlParams::default()
        };
        let (own, peers) = s.recv_regions(channel == 0);
        p.own_recv = own;
        p.peer_recv = peer_array(peers);
        p.peer_signals = peer_array(&s.peers.signals);
        p.recv_set_bytes = if channel == 0 { l.dispatch_recv_set_bytes() } else { l.combine_recv_set_bytes() } as u64;
        p.msg_bytes = l.msg_bytes as u64;
        if let Some(n) = &s.nccl {
            p.nccl_mask = n.mask as i32;
            p.nccl_pack = h.ptr() + l.nccl_pack_offset() as u64;
            p.nccl_dest_bytes =
                if channel == 0 { l.max_tokens * l.msg_bytes } else { l.combine_recv_set_bytes() } as u64;
        }
        Ok(p)
    }

    /// Low-latency over NCCL: points `p` (of buffer set `set`) at the staging and returns the
    /// exchange NCCL runs after the send kernel (nothing without NCCL peers).
    fn ll_nccl_xfers(&self, p: &mut LlParams, h: &GpuHandle, set: usize, dispatch: bool) -> Result<Vec<Xfer>, Error> {
        let s = &self.shared;
        let Some(n) = &s.nccl else { return Ok(Vec::new()) };
        let l = s.layout.ll("a low-latency operation")?;
        let chan = usize::from(!dispatch);
        let mut xfers = Vec::new();
        if dispatch {
            p.nccl_out = n.disp_out[set].ptr();
            p.nccl_counts = n.counts[set].device_ptr();
            let region = l.max_tokens * l.msg_bytes;
            let recv = s.mem.disp_recv.ptr() + (set * l.dispatch_recv_set_bytes()) as u64;
            for d in n.peers(s.num_ranks) {
                let off = (d * region) as u64;
                xfers.push(Xfer { peer: d, send: (p.nccl_out + off, region), recv: (recv + off, region) });
                xfers.push(s.arrival_xfer(chan, set, d));
            }
        } else {
            let info = h.0.ll_nccl.as_ref().ok_or_else(|| Error::Backend("handle without NCCL positions".into()))?;
            p.nccl_out = n.comb_out[set].ptr();
            p.nccl_in = n.comb_in[set].ptr();
            p.nccl_pos = h.ptr() + l.nccl_pos_offset() as u64;
            let row = 2 * l.hidden;
            let send_rows = info.send_rows.lock().unwrap_or_else(|e| e.into_inner()).clone();
            for d in n.peers(s.num_ranks) {
                let (first, rows) = info.recv_blocks[d];
                xfers.push(Xfer {
                    peer: d,
                    send: (p.nccl_out + (d * l.combine_recv_set_bytes()) as u64, send_rows[d] * row),
                    recv: (p.nccl_in + (first * row) as u64, rows * row),
                });
                xfers.push(s.arrival_xfer(chan, set, d));
            }
        }
        Ok(xfers)
    }
}

impl Backend for GpuRank {
    type Tensor = DeviceTensor;
    type Handle = GpuHandle;
    type DispatchOutput = GpuDispatchOutput;
    type CombineOutput = GpuCombineOutput;
    type Op = GpuOp;

    fn core(&self) -> &RankCore {
        &self.core
    }

    fn start_handle(&self, topk_idx: &DeviceTensor) -> Result<HandleCreation<GpuHandle, GpuOp>, Error> {
        self.core.poison().check()?;
        self.check_device(topk_idx, "topk_idx")?;
        let s = &self.shared;
        let d = topk_idx.desc();
        // The descriptor first (nothing is read from a tensor that fails it), then the values.
        check_topk_idx(&s.config, d)?;
        if let Some(e) = topk_idx.ready_event() {
            e.synchronize().map_err(|e| cuda("wait for topk_idx", e))?;
        }
        let mut values = vec![0i64; d.numel()];
        copy_to_host(&s.ctx, topk_idx.ptr(), &mut values)?;
        let routing = routing_from_tensor(&s.config, d, &values)?;
        if s.config.algorithm == Algorithm::HighThroughput {
            return Ok(HandleCreation::Collective(self.ht_start_handle(routing)?));
        }
        let l = s.layout.ll("a low-latency handle")?;
        let mem = take_pooled(&s.ctx, &s.handle_pool, l.handle_bytes())?;
        mem.write(0, &values)?;
        let ll_nccl = match &s.nccl {
            Some(n) => {
                let placement = ExpertPlacement::new(s.config.num_experts, s.num_ranks);
                let (pos, recv_blocks) = ll_combine_positions(&routing, placement, n.mask);
                mem.write(l.nccl_pos_offset(), &pos)?;
                Some(LlNcclInfo { recv_blocks, send_rows: Mutex::new(vec![0; s.num_ranks]) })
            }
            None => None,
        };
        Ok(HandleCreation::Ready(GpuHandle(Arc::new(HandleInner {
            core: HandleCore::new(s.group_id, routing, Algorithm::LowLatency, None),
            mem: Some(mem),
            pool: Arc::clone(&s.handle_pool),
            ht: None,
            ll_nccl,
        }))))
    }

    fn start_dispatch(
        &self,
        h: &GpuHandle,
        inputs: DispatchInputs<'_, DeviceTensor>,
        opts: &DispatchOptions,
    ) -> Result<GpuOp, Error> {
        self.check_handle(h)?;
        validate_dispatch_inputs(&self.ctx_for(h), opts, &inputs)?;
        self.check_device(inputs.tokens, "dispatch input tokens")?;
        if self.shared.config.algorithm == Algorithm::HighThroughput {
            return self.ht_start_dispatch(h, inputs, opts);
        }
        let s = &self.shared;
        let mut p = self.base_params(0, h)?;
        p.x = inputs.tokens.ptr();
        let seq = self.core.next_seq(Channel::Dispatch);
        let set = (seq % s.config.buffer_sets as u64) as usize;
        p.seq = seq;
        p.set = set as i32;
        p.out = s.mem.disp_out[set].ptr();
        p.out_scales = s.mem.disp_scales[set].ptr();
        p.out_counts = s.mem.disp_counts[set].ptr();
        if opts.counts_location == CountsLocation::Host {
            p.host_counts = s.mem.host_counts[set].device_ptr();
        }
        let xfers = self.ll_nccl_xfers(&mut p, h, set, true)?;
        let mut op = GpuOp::new(
            Arc::clone(&self.shared),
            Channel::Dispatch,
            seq,
            Launch::Ll(p),
            Work::Dispatch { handle: h.clone(), opts: *opts },
            &[inputs.tokens],
        );
        op.set_xfers(xfers);
        Ok(op)
    }

    fn start_combine(
        &self,
        h: &GpuHandle,
        inputs: CombineInputs<'_, DeviceTensor>,
        opts: &CombineOptions,
    ) -> Result<GpuOp, Error> {
        self.check_handle(h)?;
        validate_combine_inputs(&self.ctx_for(h), opts, &inputs)?;
        h.0.core.combine_dispatch(opts.pass)?;
        if self.shared.config.algorithm == Algorithm::HighThroughput {
            return self.ht_start_combine(h, inputs, opts);
        }
        let weights = inputs.topk_weights.ok_or_else(|| Error::Backend("validated combine without weights".into()))?;
        self.check_device(inputs.tokens, "combine input tokens")?;
        self.check_device(weights, "combine input topk_weights")?;
        let s = &self.shared;
        let mut p = self.base_params(1, h)?;
        p.expert_out = inputs.tokens.ptr();
        p.weights = weights.ptr();
        let seq = self.core.next_seq(Channel::Combine);
        let set = (seq % s.config.buffer_sets as u64) as usize;
        p.seq = seq;
        p.set = set as i32;
        p.out = s.mem.comb_out[set].ptr();
        let xfers = self.ll_nccl_xfers(&mut p, h, set, false)?;
        let mut op = GpuOp::new(
            Arc::clone(&self.shared),
            Channel::Combine,
            seq,
            Launch::Ll(p),
            Work::Combine { handle: h.clone() },
            &[inputs.tokens, weights],
        );
        op.set_xfers(xfers);
        Ok(op)
    }
}

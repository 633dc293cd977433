//! High-throughput operations on the GPU backend: the send plan of a handle, the count exchange
//! that creates it (collective), and the dispatch and combine launches (`cuda/ht.cu`).
//!
//! ## Channels
//!
//! A rank's `B` tokens are split into `C` channels of `ceil(B / C)` consecutive tokens; channel
//! `c` of every rank runs on the `c`-th block pair of the kernel. The handle's send plan lists,
//! per destination, the tokens that have an expert there (ascending), cut by channel; the count
//! exchange tells every rank how many rows each (source, channel) sends it, hence where they go
//! in its `[N x H]` output (sorted by source rank, then token, as the reference says).

use std::sync::Arc;

use epflow_core::handle::HandleCore;
use epflow_core::ops::{
    CombineInputs, CombineOptions, CombineOutputs, CountsLocation, DispatchInputs, DispatchOptions, DispatchOutputs,
    Pass,
};
use epflow_core::protocol::{Channel, op_label};
use epflow_core::routing::{ExpertPlacement, Routing};
use epflow_core::{DType, Error, TensorDesc, TensorTag};

use crate::cache::CachedBuffer;
use crate::layout::{HT_BATCH, HT_ITEMS_PER_FENCE};
use crate::memory::PinnedBuffer;
use crate::nccl::{Xfer, exchange_row_words};
use crate::op::{GpuOp, Launch, Work};
use crate::params::{ExchangeParams, HtParams, NcclHtParams};
use crate::rank::{GpuHandle, GpuRank, HandleInner, RankShared, peer_array, take_pooled};
use crate::tensor::DeviceTensor;

/// What a high-throughput handle knows after its count exchange.
#[derive(Debug)]
pub(crate) struct HtHandleInfo {
    /// `N`.
    pub num_recv: usize,
    /// Rows received per local expert, `[L]`.
    pub expert_counts: Vec<i32>,
    /// Tokens per channel on this rank.
    pub tokens_per_channel: usize,
    /// Byte offsets of the arrays in the handle's device memory.
    pub off: HandleOffsets,
    /// Per rank, `(first, rows)` of the block of the send plan that goes to it.
    pub send_blocks: Vec<(usize, usize)>,
    /// Per rank, `(first, rows)` of the block of the output that comes from it.
    pub recv_blocks: Vec<(usize, usize)>,
    /// Rows of the send plan (all destinations).
    pub total_send: usize,
}

/// Byte offsets of a high-throughput handle's arrays (see [`HtParams`] for their shapes).
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct HandleOffsets {
    pub send_list: usize,
    pub send_off: usize,
    pub recv_base: usize,
    pub recv_cnt: usize,
    pub copy_ord: usize,
    pub counts: usize,
    pub end: usize,
}

/// The staging buffers of one count exchange, in mapped pinned host memory (the kernel reads
/// and writes them directly): this rank's messages and what it receives.
#[derive(Debug)]
pub(crate) struct ExchangeBuffers {
    pub msgs: PinnedBuffer,
    pub out: PinnedBuffer,
}

/// A rank's send plan by destination and channel, and the messages of its count exchange.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct HtPlan {
    /// Tokens per channel.
    pub tokens_per_channel: usize,
    /// Per destination, the tokens with an expert there, ascending; concatenated.
    pub send_list: Vec<i32>,
    /// `[R][C + 1]`: absolute offsets into `send_list` where each (destination, channel) starts
    /// (entry `C` is where the destination ends).
    pub send_off: Vec<i32>,
    /// `[B][R]`: index of token `t` among its channel's copies to rank `d`, or -1.
    pub copy_ord: Vec<i32>,
    /// `[R][C + L]`: to each rank, the rows per channel, then the selections per local expert.
    pub msgs: Vec<i32>,
}

impl HtPlan {
    /// The plan of `routing` with `channels` channels (the copies are
    /// [`epflow_core::routing::SendPlan`]'s, computed here without per-copy allocations:
    /// handle creation is on every batch's critical path).
    pub fn new(routing: &Routing, placement: ExpertPlacement, channels: usize) -> Self {
        let (b, r, l) = (routing.num_tokens(), placement.num_ranks, placement.local_experts());
        let tpc = b.div_ceil(channels).max(1);
        let words = channels + l;
        let mut per_dest: Vec<Vec<i32>> = vec![Vec::with_capacity(b); r];
        let mut msgs = vec![0i32; r * words];
        let mut hit = vec![false; r];
        for t in 0..b {
            for &e in routing.row(t) {
                if e < 0 {
                    continue;
                }
                let e = e as usize;
                let d = placement.owner(e);
                msgs[d * words + channels + placement.local_index(e)] += 1;
                hit[d] = true;
            }
            for (d, h) in hit.iter_mut().enumerate() {
                if std::mem::take(h) {
                    per_dest[d].push(t as i32);
                }
            }
        }
        let mut out = HtPlan {
            tokens_per_channel: tpc,
            send_list: Vec::with_capacity(per_dest.iter().map(Vec::len).sum()),
            send_off: Vec::with_capacity(r * (channels + 1)),
            copy_ord: vec![-1; b * r],
            msgs,
        };
        for (d, tokens) in per_dest.iter().enumerate() {
            let base = out.send_list.len();
            let mut c = 0;
            for (i, &t) in tokens.iter().enumerate() {
                let t = t as usize;
                while c * tpc <= t && c < channels {
                    out.send_off.push((base + i) as i32);
                    c += 1;
                }
                let first = out.send_off[d * (channels + 1) + c - 1] as usize;
                out.copy_ord[t * r + d] = (base + i - first) as i32;
            }
            out.send_list.extend_from_slice(tokens);
            while c <= channels {
                out.send_off.push((base + tokens.len()) as i32);
                c += 1;
            }
            for ch in 0..channels {
                let o = d * (channels + 1) + ch;
                out.msgs[d * words + ch] = out.send_off[o + 1] - out.send_off[o];
            }
        }
        out
    }
}

/// The receive layout of a rank from the messages it received (`[R][C + L]`):
/// (`recv_base [R][C]`, `recv_cnt [R][C]`, `N`, expert counts `[L]`).
pub(crate) fn receive_layout(
    received: &[i32],
    num_ranks: usize,
    channels: usize,
) -> (Vec<i32>, Vec<i32>, usize, Vec<i32>) {
    let words = received.len() / num_ranks.max(1);
    let l = words - channels;
    let mut base = Vec::with_capacity(num_ranks * channels);
    let mut cnt = Vec::with_capacity(num_ranks * channels);
    let mut counts = vec![0i32; l];
    let mut n = 0usize;
    for s in 0..num_ranks {
        let m = &received[s * words..(s + 1) * words];
        for &c in &m[..channels] {
            base.push(n as i32);
            cnt.push(c);
            n += c.max(0) as usize;
        }
        for (acc, &c) in counts.iter_mut().zip(&m[channels..]) {
            *acc += c;
        }
    }
    (base, cnt, n, counts)
}

fn push_i32s(bytes: &mut Vec<u8>, v: &[i32]) -> usize {
    let at = bytes.len().next_multiple_of(256);
    bytes.resize(at, 0);
    bytes.extend(v.iter().flat_map(|x| x.to_le_bytes()));
    at
}

/// Builds the handle once the count exchange has delivered `received`.
pub(crate) fn finish_handle(
    shared: &Arc<RankShared>,
    seq: u64,
    routing: Routing,
    plan: &HtPlan,
    received: &[i32],
) -> Result<GpuHandle, Error> {
    let layout = shared.layout.ht("a high-throughput handle")?;
    let c = layout.channels;
    let (recv_base, recv_cnt, num_recv, expert_counts) = receive_layout(received, shared.num_ranks, c);
    let mut bytes: Vec<u8> = routing.indices().iter().flat_map(|e| e.to_le_bytes()).collect();
    let off = HandleOffsets {
        send_list: push_i32s(&mut bytes, &plan.send_list),
        send_off: push_i32s(&mut bytes, &plan.send_off),
        recv_base: push_i32s(&mut bytes, &recv_base),
        recv_cnt: push_i32s(&mut bytes, &recv_cnt),
        copy_ord: push_i32s(&mut bytes, &plan.copy_ord),
        counts: push_i32s(&mut bytes, &expert_counts),
        end: bytes.len(),
    };
    let mem = take_pooled(&shared.ctx, &shared.handle_pool, off.end.max(1))?;
    mem.write(0, &bytes)?;
    Ok(GpuHandle(Arc::new(HandleInner {
        core: HandleCore::new(shared.group_id, routing, epflow_core::Algorithm::HighThroughput, Some(seq)),
        mem: Some(mem),
        pool: Arc::clone(&shared.handle_pool),
        ht: Some(HtHandleInfo {
            num_recv,
            expert_counts,
            tokens_per_channel: plan.tokens_per_channel,
            off,
            send_blocks: (0..shared.num_ranks)
                .map(|d| {
                    let first = plan.send_off[d * (c + 1)] as usize;
                    (first, plan.send_off[d * (c + 1) + c] as usize - first)
                })
                .collect(),
            recv_blocks: (0..shared.num_ranks)
                .map(|s| {
                    let rows: i32 = recv_cnt[s * c..(s + 1) * c].iter().map(|&x| x.max(0)).sum();
                    (recv_base[s * c] as usize, rows as usize)
                })
                .collect(),
            total_send: plan.send_list.len(),
        }),
        ll_nccl: None,
    })))
}

/// Where each output tensor of an operation lies in one cached buffer.
struct OutputPlan {
    descs: Vec<TensorDesc>,
    offsets: Vec<usize>,
    bytes: usize,
}

impl OutputPlan {
    fn new(descs: Vec<TensorDesc>) -> Self {
        let mut offsets = Vec::with_capacity(descs.len());
        let mut bytes = 0usize;
        for d in &descs {
            offsets.push(bytes);
            bytes = (bytes + d.size_bytes()).next_multiple_of(256);
        }
        OutputPlan { descs, offsets, bytes }
    }

    fn views(self, shared: &RankShared, buf: CachedBuffer) -> Vec<DeviceTensor> {
        let base = buf.ptr();
        let keep: Arc<dyn std::any::Any + Send + Sync> = Arc::new(buf);
        self.descs
            .into_iter()
            .zip(self.offsets)
            .map(|(d, o)| DeviceTensor::view(base + o as u64, shared.device, d, Arc::clone(&keep)))
            .collect()
    }
}

impl GpuRank {
    fn ht_params(&self, chan: Channel, h: &GpuHandle, seq: u64) -> Result<HtParams, Error> {
        let s = &self.shared;
        let l = s.layout.ht("a high-throughput operation")?;
        let info =
            h.0.ht.as_ref().ok_or_else(|| Error::Backend("a low-latency handle in a high-throughput group".into()))?;
        let base = h.ptr();
        let (own_ring, peer_rings) = s.recv_regions(chan == Channel::Dispatch);
        let p = HtParams {
            topk_idx: base,
            send_list: base + info.off.send_list as u64,
            send_off: base + info.off.send_off as u64,
            recv_base: base + info.off.recv_base as u64,
            recv_cnt: base + info.off.recv_cnt as u64,
            copy_ord: base + info.off.copy_ord as u64,
            own_ring,
            peer_ring: peer_array(peer_rings),
            peer_signals: peer_array(&s.peers.signals),
            signals: s.mem.signals.ptr(),
            status: s.mem.status.device_ptr(),
            seq,
            timeout_ns: s.device_timeout_ns(),
            slot_bytes: l.slot_bytes as u64,
            ring_bytes: l.ring_bytes() as u64,
            rank: s.rank as i32,
            num_ranks: s.num_ranks as i32,
            hidden: l.hidden as i32,
            top_k: h.top_k() as i32,
            num_local: l.local_experts as i32,
            num_tokens: h.num_tokens() as i32,
            channels: l.channels as i32,
            depth: l.depth as i32,
            warps_per_dest: l.warps_per_dest as i32,
            chan: chan.index() as i32,
            row_bytes: (2 * l.hidden) as i32,
            off_scales: l.off_scales as i32,
            off_weights: l.off_weights as i32,
            off_idx: l.off_idx as i32,
            tokens_per_channel: info.tokens_per_channel as i32,
            batch: HT_BATCH.min(l.depth) as i32,
            // A warp's group must fit in the ring behind the oldest unwritten item: (U - 1) W < depth.
            items_per_fence: HT_ITEMS_PER_FENCE.clamp(1, (l.depth - 1) / l.warps_per_dest + 1) as i32,
            ..HtParams::default()
        };
        Ok(p)
    }

    /// Starts the count exchange that creates a high-throughput handle.
    pub(crate) fn ht_start_handle(&self, routing: Routing) -> Result<GpuOp, Error> {
        let s = &self.shared;
        let l = s.layout.ht("a high-throughput handle")?;
        let placement = ExpertPlacement::new(s.config.num_experts, s.num_ranks);
        let plan = HtPlan::new(&routing, placement, l.channels);
        let words = l.exchange_words();
        // Over NCCL every row also carries the operation number and the cancellation flag.
        let row = if s.nccl_all().is_some() { exchange_row_words(words) } else { words };
        let bufs = match s.exchange_pool.lock().unwrap_or_else(|e| e.into_inner()).pop() {
            Some(b) => b,
            None => ExchangeBuffers {
                msgs: PinnedBuffer::zeroed(&s.ctx, s.num_ranks * row * 4)?,
                out: PinnedBuffer::zeroed(&s.ctx, s.num_ranks * row * 4)?,
            },
        };
        let seq = self.core.next_seq(Channel::Handle);
        let launch = if row == words {
            bufs.msgs.write_i32s(&plan.msgs);
            Launch::Exchange(ExchangeParams {
                msgs: bufs.msgs.device_ptr(),
                out: bufs.out.device_ptr(),
                own: s.mem.exchange.ptr(),
                signals: s.mem.signals.ptr(),
                status: s.mem.status.device_ptr(),
                seq,
                timeout_ns: s.device_timeout_ns(),
                rank: s.rank as i32,
                num_ranks: s.num_ranks as i32,
                words: words as i32,
                peer_region: peer_array(&s.peers.exchange),
                peer_signals: peer_array(&s.peers.signals),
                ..ExchangeParams::default()
            })
        } else {
            // Each row: the message, the operation number, the cancellation flag (set at send
            // time if the operation is cancelled).
            let mut msgs = vec![0i32; s.num_ranks * row];
            for (dst, src) in msgs.chunks_mut(row).zip(plan.msgs.chunks(words)) {
                dst[..words].copy_from_slice(src);
                dst[words] = (seq + 1) as i32;
            }
            bufs.msgs.write_i32s(&msgs);
            Launch::NcclExchange { row_bytes: row * 4 }
        };
        Ok(GpuOp::new(
            Arc::clone(&self.shared),
            Channel::Handle,
            seq,
            launch,
            Work::HtHandle { routing, plan, bufs: Some(bufs) },
            &[],
        ))
    }

    /// Starts a high-throughput dispatch (inputs already validated).
    pub(crate) fn ht_start_dispatch(
        &self,
        h: &GpuHandle,
        inputs: DispatchInputs<'_, DeviceTensor>,
        opts: &DispatchOptions,
    ) -> Result<GpuOp, Error> {
        let s = &self.shared;
        let descs = epflow_core::validate::dispatch_output_descs(&self.ctx_for(h), opts);
        let seq = self.core.next_seq(Channel::Dispatch);
        let mut p = self.ht_params(Channel::Dispatch, h, seq)?;
        let fp8 = descs.scales.is_some();
        p.fp8 = i32::from(fp8);
        p.backward = i32::from(opts.pass == Pass::Backward);
        if fp8 {
            p.row_bytes = s.config.hidden as i32;
        }
        p.x = inputs.tokens.ptr();
        p.x_scales = inputs.scales.map_or(0, DeviceTensor::ptr);
        p.weights = inputs.topk_weights.map_or(0, DeviceTensor::ptr);
        let mut inputs_kept = vec![inputs.tokens];
        for t in [inputs.scales, inputs.topk_weights].into_iter().flatten() {
            self.check_device(t, "a dispatch input")?;
            inputs_kept.push(t);
        }
        // Outputs: tokens, then the optional scales, weights and indices, in one cached buffer.
        let present: Vec<TensorDesc> =
            [Some(descs.tokens.clone()), descs.scales.clone(), descs.topk_weights.clone(), descs.topk_idx.clone()]
                .into_iter()
                .flatten()
                .collect();
        let plan = OutputPlan::new(present);
        let buf = s.outputs.take(plan.bytes)?;
        let fill = (buf.ptr(), plan.bytes);
        let mut views = plan.views(s, buf).into_iter();
        let tokens = views.next().ok_or_else(|| Error::Backend("no token output".into()))?;
        let scales = descs.scales.as_ref().and_then(|_| views.next());
        let topk_weights = descs.topk_weights.as_ref().and_then(|_| views.next());
        let topk_idx = descs.topk_idx.as_ref().and_then(|_| views.next());
        p.out = tokens.ptr();
        p.out_scales = scales.as_ref().map_or(0, DeviceTensor::ptr);
        p.out_weights = topk_weights.as_ref().map_or(0, DeviceTensor::ptr);
        p.out_idx = topk_idx.as_ref().map_or(0, DeviceTensor::ptr);
        let info = h.0.ht.as_ref().ok_or_else(|| Error::Backend("missing high-throughput handle info".into()))?;
        let counts = (opts.pass == Pass::Forward).then(|| {
            DeviceTensor::view(
                h.ptr() + info.off.counts as u64,
                s.device,
                TensorDesc::contiguous(TensorTag::RecvExpertCountsDevice, DType::I32, &[info.expert_counts.len()]),
                Arc::clone(&h.0) as Arc<dyn std::any::Any + Send + Sync>,
            )
        });
        let host_counts = (opts.pass == Pass::Forward && opts.counts_location == CountsLocation::Host)
            .then(|| info.expert_counts.clone());
        let over_nccl = s.nccl_all().map(|_| self.nccl_ht_dispatch(h, &p)).transpose()?;
        let outputs = DispatchOutputs { tokens, scales, topk_weights, topk_idx, counts };
        let launch = over_nccl.as_ref().map_or(Launch::Ht(p), |(np, _, _)| Launch::NcclHt { p: *np, reduce: false });
        let mut op = GpuOp::new(
            Arc::clone(&self.shared),
            Channel::Dispatch,
            seq,
            launch,
            Work::HtDispatch { handle: h.clone(), pass: opts.pass, outputs: Some(Box::new((outputs, host_counts))) },
            &inputs_kept,
        );
        if let Some((_, xfers, staging)) = over_nccl {
            op.set_xfers(xfers);
            op.keep_scratch(staging);
        }
        op.set_fill(fill);
        Ok(op)
    }

    /// Starts a high-throughput combine (inputs already validated).
    pub(crate) fn ht_start_combine(
        &self,
        h: &GpuHandle,
        inputs: CombineInputs<'_, DeviceTensor>,
        opts: &CombineOptions,
    ) -> Result<GpuOp, Error> {
        let s = &self.shared;
        let descs = epflow_core::validate::combine_output_descs(&self.ctx_for(h), opts);
        let seq = self.core.next_seq(Channel::Combine);
        let mut p = self.ht_params(Channel::Combine, h, seq)?;
        p.backward = i32::from(opts.pass == Pass::Backward);
        p.x = inputs.tokens.ptr();
        p.weights = inputs.topk_weights.map_or(0, DeviceTensor::ptr);
        let mut inputs_kept = vec![inputs.tokens];
        if let Some(w) = inputs.topk_weights {
            self.check_device(w, "combine input topk_weights")?;
            inputs_kept.push(w);
        }
        let present: Vec<TensorDesc> =
            [Some(descs.tokens.clone()), descs.topk_weights.clone()].into_iter().flatten().collect();
        let plan = OutputPlan::new(present);
        let buf = s.outputs.take(plan.bytes)?;
        let fill = (buf.ptr(), plan.bytes);
        let mut views = plan.views(s, buf).into_iter();
        let tokens = views.next().ok_or_else(|| Error::Backend("no token output".into()))?;
        let topk_weights = views.next();
        p.out = tokens.ptr();
        p.out_weights = topk_weights.as_ref().map_or(0, DeviceTensor::ptr);
        let over_nccl = s.nccl_all().map(|_| self.nccl_ht_combine(h, &p)).transpose()?;
        let launch = over_nccl.as_ref().map_or(Launch::Ht(p), |(np, _, _)| Launch::NcclHt { p: *np, reduce: true });
        let mut op = GpuOp::new(
            Arc::clone(&self.shared),
            Channel::Combine,
            seq,
            launch,
            Work::HtCombine { outputs: Some(CombineOutputs { tokens, topk_weights }) },
            &inputs_kept,
        );
        if let Some((_, xfers, staging)) = over_nccl {
            op.set_xfers(xfers);
            op.keep_scratch(staging);
        }
        op.set_fill(fill);
        Ok(op)
    }
}

/// Returns the staging buffers of a finished exchange to the pool.
pub(crate) fn recycle_exchange(shared: &RankShared, bufs: ExchangeBuffers) {
    shared.exchange_pool.lock().unwrap_or_else(|e| e.into_inner()).push(bufs);
}

/// Reads what exchange `seq` received (after its completion). Over NCCL, checks every row's
/// operation number and cancellation flag and strips them.
pub(crate) fn received_messages(shared: &RankShared, bufs: &ExchangeBuffers, seq: u64) -> Result<Vec<i32>, Error> {
    let l = shared.layout.ht("a count exchange")?;
    let words = l.exchange_words();
    if shared.nccl_all().is_none() {
        return Ok(bufs.out.read_i32s(shared.num_ranks * words));
    }
    let row = exchange_row_words(words);
    let all = bufs.out.read_i32s(shared.num_ranks * row);
    let mut out = Vec::with_capacity(shared.num_ranks * words);
    for (peer, r) in all.chunks(row).enumerate() {
        if r[words] != (seq + 1) as i32 {
            return Err(Error::Backend(format!(
                "count exchange #{seq}: rank {peer} sent the counts of operation #{}",
                i64::from(r[words]) - 1
            )));
        }
        if r[words + 1] != 0 {
            return Err(Error::PeerCancelled { op: op_label(Channel::Handle, seq), peer });
        }
        out.extend_from_slice(&r[..words]);
    }
    Ok(out)
}

/// The exchange of a high-throughput operation over NCCL: for every rank `d` and every array
/// `(send base, receive base, bytes per row)` with rows, the rows `send[d]` (`(first, rows)`) go
/// to `d` and the rows `recv[d]` come from it; then the arrival word of channel `chan`, set
/// `set`, with every other rank.
fn block_xfers(
    s: &RankShared,
    send: &[(usize, usize)],
    recv: &[(usize, usize)],
    arrays: &[(u64, u64, usize)],
    chan: usize,
    set: usize,
) -> Vec<Xfer> {
    let mut xfers = Vec::new();
    for d in 0..s.num_ranks {
        let ((first, n), (rfirst, rn)) = (send[d], recv[d]);
        for &(src, dst, w) in arrays.iter().filter(|a| a.2 > 0) {
            xfers.push(Xfer {
                peer: d,
                send: (src + (first * w) as u64, n * w),
                recv: (dst + (rfirst * w) as u64, rn * w),
            });
        }
        if d != s.rank {
            xfers.push(s.arrival_xfer(chan, set, d));
        }
    }
    xfers
}

impl GpuRank {
    /// The parameters every NCCL high-throughput kernel shares, from the NVLink ones.
    fn nccl_ht_params(&self, p: &HtParams, info: &HtHandleInfo) -> NcclHtParams {
        let s = &self.shared;
        NcclHtParams {
            topk_idx: p.topk_idx,
            send_list: p.send_list,
            send_off: p.send_off,
            copy_ord: p.copy_ord,
            signals: s.mem.signals.ptr(),
            status: s.mem.status.device_ptr(),
            seq: p.seq,
            rank: p.rank,
            num_ranks: p.num_ranks,
            hidden: p.hidden,
            top_k: p.top_k,
            num_local: p.num_local,
            num_tokens: p.num_tokens,
            channels: p.channels,
            tokens_per_channel: p.tokens_per_channel,
            fp8: p.fp8,
            backward: p.backward,
            chan: p.chan,
            set: (p.seq % 2) as i32,
            total_send: info.total_send as i32,
            row_bytes: p.row_bytes,
            ..NcclHtParams::default()
        }
    }

    /// Dispatch over NCCL: the kernel parameters, the exchange (each destination's block of the
    /// staging into its outputs, `p.out`, `p.out_scales`, `p.out_weights`, `p.out_idx`) and the
    /// staging.
    fn nccl_ht_dispatch(&self, h: &GpuHandle, p: &HtParams) -> Result<(NcclHtParams, Vec<Xfer>, CachedBuffer), Error> {
        let s = &self.shared;
        let info = h.0.ht.as_ref().ok_or_else(|| Error::Backend("missing high-throughput handle info".into()))?;
        let mut np = self.nccl_ht_params(p, info);
        let (k, rows) = (h.top_k(), info.total_send);
        let out = [p.out, p.out_scales, p.out_weights, p.out_idx];
        // Bytes per row of each staged array: tokens, scales, weights, indices (0 when absent).
        let widths = [
            p.row_bytes as usize,
            if p.fp8 != 0 { s.config.hidden / 128 * 4 } else { 0 },
            if out[2] != 0 { k * 4 } else { 0 },
            if out[3] != 0 { k * 8 } else { 0 },
        ];
        let mut offs = [0usize; 4];
        let mut total = 0usize;
        for (o, w) in offs.iter_mut().zip(widths) {
            *o = total;
            total = (total + rows * w).next_multiple_of(256);
        }
        let staging = s.outputs.take(total.max(256))?;
        let staged = offs.map(|o| staging.ptr() + o as u64);
        np.x = p.x;
        np.x_scales = p.x_scales;
        np.weights = p.weights;
        np.out = staged[0];
        np.out_scales = staged[1];
        np.out_weights = if out[2] != 0 { staged[2] } else { 0 };
        np.out_idx = if out[3] != 0 { staged[3] } else { 0 };
        let arrays: Vec<_> = (0..4).map(|a| (staged[a], out[a], widths[a])).collect();
        let xfers = block_xfers(s, &info.send_blocks, &info.recv_blocks, &arrays, 0, np.set as usize);
        Ok((np, xfers, staging))
    }

    /// Combine over NCCL: every source's rows go back to it, into a staging block per
    /// destination in send-plan order; the reduction then writes the outputs `p.out` (and
    /// `p.out_weights`, backward).
    fn nccl_ht_combine(&self, h: &GpuHandle, p: &HtParams) -> Result<(NcclHtParams, Vec<Xfer>, CachedBuffer), Error> {
        let s = &self.shared;
        let info = h.0.ht.as_ref().ok_or_else(|| Error::Backend("missing high-throughput handle info".into()))?;
        let mut np = self.nccl_ht_params(p, info);
        np.total_send = 0; // the pack kernel only writes the arrival word
        let (k, rows) = (h.top_k(), info.total_send);
        let backward = p.backward != 0;
        let widths = [2 * s.config.hidden, if backward { k * 4 } else { 0 }];
        let w_off = (rows * widths[0]).next_multiple_of(256);
        let staging = s.outputs.take((w_off + rows * widths[1]).max(256))?;
        np.input = staging.ptr();
        np.in_weights = staging.ptr() + w_off as u64;
        np.out = p.out;
        np.out_weights = p.out_weights;
        // Every source's rows go back to it: the blocks mirror dispatch's.
        let arrays = [(p.x, np.input, widths[0]), (p.weights, np.in_weights, widths[1])];
        let xfers = block_xfers(s, &info.recv_blocks, &info.send_blocks, &arrays, 1, np.set as usize);
        Ok((np, xfers, staging))
    }
}

/// The grid of a high-throughput kernel: `2 * C` blocks of 512 threads.
pub(crate) fn ht_grid(p: &HtParams) -> (u32, u32) {
    (2 * p.channels as u32, 512)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plan_splits_copies_by_destination_and_channel() {
        // 8 experts on 2 ranks (L = 4), 5 tokens, top-2, 2 channels of 3 tokens.
        let idx = vec![0, 5, 1, 2, 6, -1, 7, 4, -1, -1];
        let routing = Routing::new(idx, 5, 2, 8).unwrap();
        let plan = HtPlan::new(&routing, ExpertPlacement::new(8, 2), 2);
        assert_eq!(plan.tokens_per_channel, 3);
        // To rank 0: tokens 0, 1; to rank 1: tokens 0, 2, 3.
        assert_eq!(plan.send_list, vec![0, 1, 0, 2, 3]);
        assert_eq!(plan.send_off, vec![0, 2, 2, 2, 4, 5]);
        assert_eq!(plan.copy_ord, vec![0, 0, 1, -1, -1, 1, -1, 0, -1, -1]);
        // Messages: [rows c0, rows c1, selections of local experts 0..4].
        assert_eq!(&plan.msgs[..6], &[2, 0, 1, 1, 1, 0]);
        assert_eq!(&plan.msgs[6..], &[2, 1, 1, 1, 1, 1]);
        let (base, cnt, n, counts) = receive_layout(&[plan.msgs[6..].to_vec(), plan.msgs[6..].to_vec()].concat(), 2, 2);
        assert_eq!(cnt, vec![2, 1, 2, 1]);
        assert_eq!(base, vec![0, 2, 3, 5]);
        assert_eq!(n, 6);
        assert_eq!(counts, vec![2, 2, 2, 2]);
    }

    #[test]
    fn empty_and_tiny_plans() {
        let routing = Routing::new(vec![], 0, 2, 8).unwrap();
        let plan = HtPlan::new(&routing, ExpertPlacement::new(8, 4), 24);
        assert!(plan.send_list.is_empty());
        assert_eq!(plan.send_off.len(), 4 * 25);
        assert!(plan.send_off.iter().all(|&o| o == 0));
        let routing = Routing::new(vec![7, -1], 1, 2, 8).unwrap();
        let plan = HtPlan::new(&routing, ExpertPlacement::new(8, 4), 24);
        assert_eq!(plan.send_list, vec![0]);
        assert_eq!(plan.copy_ord, vec![-1, -1, -1, 0]);
        assert_eq!(plan.send_off[3 * 25], 0);
        assert_eq!(plan.send_off[3 * 25 + 1], 1);
    }
}

//! Starting high-throughput operations: the count exchange that creates a handle, and dispatch
//! and combine on a handle (their kernel parameters and outputs), over NVLink or NCCL.

use std::sync::Arc;

use epflow_core::config::FP8_BLOCK;
use epflow_core::handle::RoutingHandle;
use epflow_core::ops::{CombineOptions, CountsLocation, DispatchOptions, Pass};
use epflow_core::protocol::Channel;
use epflow_core::routing::{ChannelPlan, ExpertPlacement, Routing};
use epflow_core::stamp::{Pairing, Stamp};
use epflow_core::validate::{OpContext, ValidCombine, ValidDispatch, combine_output_descs, dispatch_output_descs};
use epflow_core::{DType, DispatchDtype, Error, TensorDesc, TensorTag};

use super::nccl::{nccl_combine, nccl_dispatch};
use cudarc::driver::CudaEvent;

use crate::device::PinnedBuffer;
use crate::device::cache::CachedBuffer;
use crate::device::{DeviceTensor, Lease};
use crate::op::{GpuOp, GpuOpKind, Launch};
use crate::outputs::OutputTargets;
use crate::params::{ExchangeParams, HtParams, NcclHtParams};
use crate::state::handle::GpuHandle;
use crate::state::shared::{ExchangeBuffers, RankShared, peer_array};
use crate::transport::nccl::Xfer;
use crate::transport::nccl::exchange_row_words;

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

    /// Views of the outputs in `buf`, which lease it (readers declared on them fence its
    /// reuse), and the fences of its previous readers, which the kernel writing it waits for.
    fn views(self, shared: &RankShared, mut buf: CachedBuffer) -> (Vec<DeviceTensor>, Vec<Arc<CudaEvent>>) {
        let base = buf.ptr();
        let fences = buf.take_fences();
        let buf = Arc::new(buf);
        let keep: Arc<dyn std::any::Any + Send + Sync> = buf.clone();
        let lease: Arc<dyn Lease> = buf;
        let views = self
            .descs
            .into_iter()
            .zip(self.offsets)
            .map(|(d, o)| {
                DeviceTensor::leased(base + o as u64, shared.device, d, Arc::clone(&keep), Arc::clone(&lease))
            })
            .collect();
        (views, fences)
    }
}

/// The parameters of a high-throughput kernel of `chan` on handle `h`, operation `seq`.
fn ht_params(s: &RankShared, chan: Channel, h: &GpuHandle, seq: u64, stamp: Stamp) -> Result<HtParams, Error> {
    let l = s.layout.ht("a high-throughput operation")?;
    let info = h.ht()?;
    let base = h.ptr();
    let (own_ring, peer_rings) = s.recv_regions(chan == Channel::Dispatch);
    Ok(HtParams {
        topk_idx: base,
        send_list: base + info.off.send_list as u64,
        send_off: base + info.off.send_off as u64,
        recv_base: base + info.off.recv_base as u64,
        recv_cnt: base + info.off.recv_cnt as u64,
        copy_ord: base + info.off.copy_ord as u64,
        own_ring,
        peer_ring: peer_rings,
        peer_signals: peer_array(&s.peers().signals),
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
        warps_per_dest: l.send_warps(chan) as i32,
        chan: chan.index() as i32,
        row_bytes: (2 * l.hidden) as i32,
        off_scales: l.off_scales as i32,
        off_weights: l.off_weights as i32,
        off_idx: l.off_idx as i32,
        tokens_per_channel: info.tokens_per_channel as i32,
        batch: l.batch as i32,
        // A warp's group must fit in the ring behind the oldest unwritten item: (U - 1) W < depth.
        items_per_fence: l.items_per_fence(chan).clamp(1, (l.depth - 1) / l.send_warps(chan) + 1) as i32,
        stamp: stamp.encode(),
        ..HtParams::default()
    })
}

/// The count exchange `seq` that creates a handle for `routing`; `recv_bound`: the received rows
/// of a `RecvRows::Bound` handle.
pub(crate) fn handle(
    s: &Arc<RankShared>,
    seq: u64,
    routing: Routing,
    recv_bound: Option<usize>,
) -> Result<GpuOp, Error> {
    let l = s.layout.ht("a high-throughput handle")?;
    let placement = ExpertPlacement::new(s.config.num_experts, s.num_ranks);
    let plan = ChannelPlan::new(&routing, placement, l.channels);
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
    let stamp = Stamp::new(routing.top_k(), Pass::Forward, Pairing::None);
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
            peer_region: peer_array(&s.peers().exchange),
            peer_signals: peer_array(&s.peers().signals),
            stamp: stamp.encode(),
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
    let kind = GpuOpKind::HtHandle { routing, plan, bufs: Some(bufs), recv_bound };
    Ok(GpuOp::new(Arc::clone(s), Channel::Handle, seq, stamp, launch, kind, &[]))
}

/// Dispatch `seq` on handle `h`; `inputs` validated, or `None` for a cancellation (this rank's
/// arguments failed validation: the collective still runs, without data).
pub(crate) fn dispatch(
    s: &Arc<RankShared>,
    seq: u64,
    h: &GpuHandle,
    inputs: Option<ValidDispatch<'_, DeviceTensor>>,
    opts: &DispatchOptions,
    into: Option<&OutputTargets>,
) -> Result<GpuOp, Error> {
    let ctx = OpContext::new(&s.config, s.num_ranks, h);
    let descs = dispatch_output_descs(&ctx, opts);
    let stamp = h.core().dispatch_stamp(opts.pass);
    let mut p = ht_params(s, Channel::Dispatch, h, seq, stamp)?;
    p.backward = i32::from(opts.pass == Pass::Backward);
    // Rows with scales: FP8 (H bytes and H/128 fp32 scales, the scales at the group's offset),
    // or forwarded (token_bytes of payload, then the scale row right behind it in the slot's
    // BF16 row, which holds both: validated).
    let forwarded = if opts.pass == Pass::Forward { opts.dtype.and_then(DispatchDtype::forwarded) } else { None };
    match forwarded {
        Some((token_bytes, scale_bytes)) => {
            if s.nccl_all().is_some() {
                return Err(Error::Unsupported(
                    "a forwarded high-throughput dispatch needs every peer over NVLink (the NCCL transport packs BF16 or FP8 rows)".into(),
                ));
            }
            let int =
                |v: usize| i32::try_from(v).map_err(|_| Error::Unsupported("forwarded rows above 2^31 bytes".into()));
            p.fp8 = 1;
            p.row_bytes = int(token_bytes)?;
            p.off_scales = int(token_bytes)?;
            p.scale_cols = int(scale_bytes / 4)?;
            p.stamp ^= forwarded_stamp_bits(token_bytes, scale_bytes);
        }
        None if descs.scales.is_some() => {
            p.fp8 = 1;
            p.row_bytes = s.config.hidden as i32;
            p.scale_cols = (s.config.hidden / FP8_BLOCK) as i32;
        }
        None => {}
    }
    if let Some(inputs) = inputs {
        p.x = inputs.tokens().ptr();
        if let ValidDispatch::Forward { weights, scales, .. } = inputs {
            p.weights = weights.ptr();
            p.x_scales = scales.map_or(0, DeviceTensor::ptr);
        }
    }
    // Outputs: tokens, then the optional scales, weights and indices, in one cached buffer.
    let t = into.copied().unwrap_or_default();
    let outputs = [
        (Some(descs.tokens.clone()), Some(t.tokens)),
        (descs.scales.clone(), t.scales),
        (descs.topk_weights.clone(), t.topk_weights),
        (descs.topk_idx.clone(), t.topk_idx),
    ];
    let ([tokens, scales, topk_weights, topk_idx], fill, fences, reused) = output_views(s, outputs, into.is_some())?;
    let tokens = tokens.ok_or_else(|| Error::Backend("no token output".into()))?;
    p.out = tokens.ptr();
    // Direct dispatch (`ht_send.cuh`, `ht_receive.cuh`): peers write this rank's outputs when
    // they are a cached buffer that served an earlier operation (caller memory may not be
    // reachable from peers, and a buffer allocated now may be newer than the peers' kernels
    // already running, which compute-sanitizer flags) and this rank takes the data (not
    // cancelled).
    let l = s.layout.ht("a high-throughput dispatch")?;
    p.direct = if l.direct { l.direct_min_rows as i32 } else { 0 };
    p.direct_mem = i32::from(l.direct && reused && inputs.is_some());
    p.helpers = if l.direct { l.direct_helpers as i32 } else { 0 };
    p.balanced = i32::from(l.direct && l.balanced);
    p.out_scales = scales.as_ref().map_or(0, DeviceTensor::ptr);
    p.out_weights = topk_weights.as_ref().map_or(0, DeviceTensor::ptr);
    p.out_idx = topk_idx.as_ref().map_or(0, DeviceTensor::ptr);
    let info = h.ht()?;
    let local = s.config.local_experts(s.num_ranks);
    let counts = (opts.pass == Pass::Forward).then(|| {
        DeviceTensor::view(
            h.ptr() + info.off.counts as u64,
            s.device,
            TensorDesc::contiguous(TensorTag::RecvExpertCountsDevice, DType::I32, &[local]),
            Arc::clone(&h.0) as Arc<dyn std::any::Any + Send + Sync>,
        )
    });
    // Host counters: the handle's, read when the operation finishes (a handle created in stream
    // order learns them then).
    let host_counts = (opts.pass == Pass::Forward && opts.counts_location == CountsLocation::Host).then(Vec::new);
    let over_nccl = s.nccl_all().map(|_| nccl_dispatch(s, h, &p)).transpose()?;
    let outputs = epflow_core::ops::DispatchOutputs { tokens, scales, topk_weights, topk_idx, counts };
    let launch = over_nccl.as_ref().map_or(Launch::Ht(p), |(np, _, _)| Launch::NcclHt { p: *np, reduce: false });
    let kind =
        GpuOpKind::HtDispatch { handle: h.clone(), pass: opts.pass, outputs: Some(Box::new((outputs, host_counts))) };
    let tensors = inputs.map(|i| i.tensors()).unwrap_or_default();
    let op = GpuOp::new(Arc::clone(s), Channel::Dispatch, seq, stamp, launch, kind, &tensors);
    Ok(assemble(op, over_nccl, fill, with_built(fences, h), inputs.is_none()))
}

/// What a forwarded dispatch adds to its device stamp (bits 48-63, which a dispatch's pairing
/// number never reaches): the row shape is per call, and a direct dispatch writes its rows into
/// the receiver's outputs only when their full stamps agree, so a sender whose rows are wider
/// than the receiver's (or that carries scales the receiver has no room for) never writes
/// there. Bit 63 set for every forwarded shape (a BF16 dispatch adds nothing); distinct shapes
/// differ in all but rare collisions of the low 15 bits.
fn forwarded_stamp_bits(token_bytes: usize, scale_bytes: usize) -> u64 {
    let shape = ((token_bytes / 16) as u64).wrapping_mul(131).wrapping_add((scale_bytes / 16) as u64);
    (0x8000 | (shape & 0x7fff)) << 48
}

/// Combine `seq` on handle `h`; `inputs` validated, or `None` for a cancellation.
pub(crate) fn combine(
    s: &Arc<RankShared>,
    seq: u64,
    h: &GpuHandle,
    inputs: Option<ValidCombine<'_, DeviceTensor>>,
    opts: &CombineOptions,
    into: Option<&OutputTargets>,
) -> Result<GpuOp, Error> {
    let ctx = OpContext::new(&s.config, s.num_ranks, h);
    let descs = combine_output_descs(&ctx, opts);
    let paired = h.core().last_dispatch(opts.pass).unwrap_or(0);
    let stamp = h.core().combine_stamp(opts.pass, paired);
    let mut p = ht_params(s, Channel::Combine, h, seq, stamp)?;
    p.backward = i32::from(opts.pass == Pass::Backward);
    // Pull combine (`ht_rings.cuh`): peers read this rank's expert outputs (and weight
    // gradients) in place when epflow allocated them (caller memory may not be reachable).
    let l = s.layout.ht("a high-throughput combine")?;
    if l.pull_combine {
        p.direct = l.direct_min_rows as i32;
    }
    if let Some(inputs) = inputs {
        p.x = inputs.tokens().ptr();
        p.weights = inputs.weights().map_or(0, DeviceTensor::ptr);
        p.direct_mem = i32::from(
            l.pull_combine && inputs.tokens().epflow_memory() && inputs.weights().is_none_or(|w| w.epflow_memory()),
        );
    }
    let t = into.copied().unwrap_or_default();
    let outputs = [(Some(descs.tokens.clone()), Some(t.tokens)), (descs.topk_weights.clone(), t.topk_weights)];
    let ([tokens, topk_weights], fill, fences, _) = output_views(s, outputs, into.is_some())?;
    let tokens = tokens.ok_or_else(|| Error::Backend("no token output".into()))?;
    p.out = tokens.ptr();
    p.out_weights = topk_weights.as_ref().map_or(0, DeviceTensor::ptr);
    let over_nccl = s.nccl_all().map(|_| nccl_combine(s, h, &p)).transpose()?;
    let launch = over_nccl.as_ref().map_or(Launch::Ht(p), |(np, _, _)| Launch::NcclHt { p: *np, reduce: true });
    let kind = GpuOpKind::HtCombine {
        handle: h.clone(),
        outputs: Some(epflow_core::ops::CombineOutputs { tokens, topk_weights, masked: None }),
    };
    let tensors = inputs.map(|i| i.tensors()).unwrap_or_default();
    let op = GpuOp::new(Arc::clone(s), Channel::Combine, seq, stamp, launch, kind, &tensors);
    Ok(assemble(op, over_nccl, fill, with_built(fences, h), inputs.is_none()))
}

/// The fences a kernel on `h` waits for: its outputs' memory's, and, on a handle created in
/// stream order, the creation's kernels (which write the plan it reads).
fn with_built(mut fences: Vec<Arc<CudaEvent>>, h: &GpuHandle) -> Vec<Arc<CudaEvent>> {
    fences.extend(h.built_event());
    fences
}

/// Output views (one per output asked for), the bytes to fill with the debug byte (if any), the
/// fences the writing kernel waits for, and whether they are a cached buffer that served an
/// earlier operation.
type Views<const N: usize> = ([Option<DeviceTensor>; N], Option<(u64, usize)>, Vec<Arc<CudaEvent>>, bool);

/// Views of the `outputs` that have a descriptor (each with the caller's address, if any): in
/// one cached buffer (with the bytes to fill in debug mode and the fences of its previous
/// readers), or, when `external`, at the caller's addresses, which the caller keeps alive and
/// fences (not over NCCL, whose staging the outputs are copied out of).
fn output_views<const N: usize>(
    s: &RankShared,
    outputs: [(Option<TensorDesc>, Option<u64>); N],
    external: bool,
) -> Result<Views<N>, Error> {
    if external && s.nccl_all().is_some() {
        return Err(Error::Unsupported("high-throughput outputs in caller memory over NCCL".into()));
    }
    let (present, addrs): (Vec<TensorDesc>, Vec<Option<u64>>) =
        outputs.iter().filter_map(|(d, a)| d.clone().map(|d| (d, *a))).unzip();
    let (views, fill, fences, reused) = if external {
        let keep: Arc<dyn std::any::Any + Send + Sync> = Arc::new(());
        let views = present
            .into_iter()
            .zip(addrs)
            .map(|(d, ptr)| {
                let ptr =
                    ptr.ok_or_else(|| Error::Unsupported(format!("no caller memory for the {:?} output", d.tag)))?;
                Ok(DeviceTensor::view(ptr, s.device, d, Arc::clone(&keep)))
            })
            .collect::<Result<Vec<_>, Error>>()?;
        (views, None, Vec::new(), false)
    } else {
        let plan = OutputPlan::new(present);
        let buf = s.outputs.take(plan.bytes)?;
        let (fill, reused) = ((buf.ptr(), plan.bytes), !buf.fresh());
        let (views, fences) = plan.views(s, buf);
        (views, Some(fill), fences, reused)
    };
    let mut views = views.into_iter();
    let slots = std::array::from_fn(|i| outputs[i].0.as_ref().and_then(|_| views.next()));
    Ok((slots, fill, fences, reused))
}

/// The last touches of a high-throughput operation: its NCCL exchange and staging (if any), the
/// outputs to fill in debug mode, the fences its outputs' memory carries, and the cancellation
/// (no validated inputs).
fn assemble(
    mut op: GpuOp,
    over_nccl: Option<(NcclHtParams, Vec<Xfer>, CachedBuffer)>,
    fill: Option<(u64, usize)>,
    fences: Vec<Arc<CudaEvent>>,
    cancelled: bool,
) -> GpuOp {
    if let Some((_, xfers, staging)) = over_nccl {
        op.set_xfers(xfers);
        op.keep_scratch(staging);
    }
    if let Some(fill) = fill {
        op.set_fill(fill);
    }
    op.wait_fences(fences);
    if cancelled {
        epflow_core::backend::PendingOp::cancel(&mut op);
    }
    op
}

#[cfg(test)]
mod tests {
    use super::forwarded_stamp_bits;

    #[test]
    fn forwarded_shapes_mark_the_stamp_above_any_pairing_number() {
        let (a, b) = (forwarded_stamp_bits(7168, 224), forwarded_stamp_bits(3584, 448));
        assert_ne!(a, b);
        for bits in [a, b, forwarded_stamp_bits(16, 16)] {
            assert_eq!(bits & ((1 << 48) - 1), 0, "the low 48 bits (the tag, small pairing numbers) stay");
            assert_ne!(bits >> 63, 0, "every forwarded shape differs from a BF16 dispatch's stamp");
        }
    }
}

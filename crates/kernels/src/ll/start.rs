//! Starting low-latency operations: the kernel parameters of a dispatch or combine on a
//! handle, the NCCL exchange with peers reached through NCCL, and cancellations.

use std::sync::Arc;

use epflow_core::handle::RoutingHandle;
use epflow_core::ops::{CountsLocation, DispatchOptions, Layout, Pass};
use epflow_core::protocol::Channel;
use epflow_core::stamp::Stamp;
use epflow_core::validate::{ValidCombine, ValidDispatch};
use epflow_core::{DispatchDtype, Error};

use crate::device::DeviceTensor;
use crate::ll::handle::StreamRouting;
use crate::op::{GpuOp, GpuOpKind, Launch};
use crate::outputs::OutputTargets;
use crate::params::{LL_TAG_TOKENS, LlParams, MAX_RANKS};
use crate::state::handle::GpuHandle;
use crate::state::shared::{RankShared, peer_array};
use crate::transport::nccl::Xfer;

/// The parameters every low-latency kernel of `channel` (0 dispatch, 1 combine) shares, for an
/// operation on handle memory at `handle_ptr` with `num_tokens` x `top_k` routing.
fn base_params(
    s: &RankShared,
    channel: usize,
    handle_ptr: u64,
    num_tokens: usize,
    top_k: usize,
    layout: Layout,
) -> Result<LlParams, Error> {
    let l = s.layout.ll("a low-latency kernel")?;
    let rank_major = layout == Layout::RankMajor;
    let mut p = LlParams {
        topk_idx: handle_ptr,
        row_of: handle_ptr + l.row_of_offset() as u64,
        signals: s.mem.signals.ptr(),
        status: s.mem.status.device_ptr(),
        timeout_ns: s.device_timeout_ns(),
        rank: s.rank as i32,
        num_ranks: s.num_ranks as i32,
        max_tokens: l.max_tokens as i32,
        hidden: l.hidden as i32,
        top_k: top_k as i32,
        num_local: l.local_experts as i32,
        num_tokens: num_tokens as i32,
        num_sets: l.sets as i32,
        fp8: i32::from(l.fp8 && channel == 0),
        round_scales: i32::from(matches!(s.config.dispatch_dtype, DispatchDtype::Fp8 { round_scales: true })),
        rank_major: i32::from(rank_major),
        masking: i32::from(s.config.rank_masking),
        ret_list: handle_ptr + l.return_list_offset() as u64,
        ret_count: handle_ptr + l.return_count_offset() as u64,
        trace: i32::from(trace_on()),
        tag_tokens: if s.config.rank_masking { 0 } else { tag_tokens(s).min(l.tag_capacity()) as i32 },
        tag_dispatch_tokens: if s.config.rank_masking {
            0
        } else {
            tag_dispatch_tokens(s).min(l.tag_capacity()) as i32
        },
        ..LlParams::default()
    };
    let (own, peers) = s.recv_regions(channel == 0);
    p.own_recv = own;
    p.peer_recv = peers;
    p.peer_signals = peer_array(&s.peers().signals);
    p.recv_set_bytes = if channel == 0 { l.dispatch_recv_set_bytes() } else { l.combine_recv_set_bytes() } as u64;
    p.msg_bytes = l.msg_bytes as u64;
    if let Some(n) = &s.nccl {
        p.nccl_mask = n.mask as i32;
        p.nccl_pack = handle_ptr + l.nccl_pack_offset() as u64;
        p.nccl_dest_bytes = if channel == 0 { l.max_tokens * l.msg_bytes } else { l.combine_recv_set_bytes() } as u64;
    }
    Ok(p)
}

/// Whether `EPFLOW_LL_TRACE=1` asks the low-latency kernels to print their phase times (read
/// once per process).
fn trace_on() -> bool {
    epflow_core::tuning::Environment::get().diagnostics.ll_trace
}

/// The most tokens for which this rank's rank-major combines take tagged rows (`tag_tokens` in
/// `LlParams`; expert-major combines fit `R / K` as many): `LL_TAG_TOKENS`, or the group's
/// [`epflow_core::tuning::Tuning::ll_tag_tokens`] (`EPFLOW_LL_TAG_TOKENS`; 0 turns tagged rows
/// off). Each token owner decides for its own combines and says so in its dispatch messages, so
/// ranks need not agree on it.
fn tag_tokens(s: &RankShared) -> usize {
    s.config.tuning().ll_tag_tokens.unwrap_or(LL_TAG_TOKENS)
}

/// The most tokens for which this rank's dispatches go out as tagged messages
/// (`tag_dispatch_tokens` in `LlParams`): `LL_TAG_TOKENS`, or the group's
/// [`epflow_core::tuning::Tuning::ll_tag_dispatch_tokens`] (`EPFLOW_LL_TAG_DISPATCH_TOKENS`; 0
/// turns them off). The sender decides and says so in its arrival word, so ranks need not agree
/// on it.
fn tag_dispatch_tokens(s: &RankShared) -> usize {
    s.config.tuning().ll_tag_dispatch_tokens.unwrap_or(LL_TAG_TOKENS)
}

/// Sets the sequence number and buffer set of operation `seq`.
fn number(s: &RankShared, p: &mut LlParams, seq: u64) -> usize {
    let set = (seq % s.config.buffer_sets as u64) as usize;
    p.seq = seq;
    p.set = set as i32;
    set
}

/// Low-latency over NCCL: points `p` (of buffer set `set`) at the staging and returns the
/// exchange NCCL runs after the send kernel (nothing without NCCL peers). Combine needs the
/// handle's NCCL positions (`None`: the exchange cannot be sized).
fn nccl_xfers(
    s: &RankShared,
    p: &mut LlParams,
    h: Option<&GpuHandle>,
    set: usize,
    dispatch: bool,
) -> Result<Vec<Xfer>, Error> {
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
        let info = h
            .and_then(|h| h.0.ll_nccl.as_ref())
            .ok_or_else(|| Error::Backend("a combine over NCCL needs its handle's NCCL positions".into()))?;
        p.nccl_out = n.comb_out[set].ptr();
        p.nccl_in = n.comb_in[set].ptr();
        p.nccl_pos = h.map_or(0, GpuHandle::ptr) + l.nccl_pos_offset() as u64;
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

/// The kernel parameters of dispatch `seq` of `inputs` on handle `h` (inputs validated), its
/// buffer set and its stamp; NCCL staging not yet set. `routing`: what a dispatch on a handle
/// created in stream order without a kernel reads (`ll::handle::stream_routing`).
pub(crate) fn dispatch_params(
    s: &RankShared,
    seq: u64,
    h: &GpuHandle,
    inputs: &ValidDispatch<'_, DeviceTensor>,
    opts: &DispatchOptions,
    into: Option<&OutputTargets>,
    routing: Option<&StreamRouting>,
) -> Result<(LlParams, usize, Stamp), Error> {
    let mut p = base_params(s, 0, h.ptr(), h.num_tokens(), h.top_k(), h.layout())?;
    // A per-call FP8 dispatch of a BF16 group (`DispatchOptions::dtype`): its messages (`H`
    // bytes and `H / 128` scales after the header) fit the group's BF16 message slots, and the
    // kernels read the message shape from `p.fp8`. The group's buffers hold no scales, so the
    // rows go to the caller's targets.
    let dtype = opts.dtype_in(s.config.dispatch_dtype);
    if dtype.is_fp8() && !s.config.dispatch_dtype.is_fp8() && into.and_then(|t| t.scales).is_none() {
        return Err(Error::Unsupported(
            "a per-call FP8 dispatch of a BF16 group writes into the caller's tensors with scales (start_dispatch_into): the group's buffers hold no scales".into(),
        ));
    }
    if into.is_none() && s.config.caller_outputs {
        return Err(Error::Unsupported(
            "this group keeps no dispatch outputs (GroupConfig::caller_outputs): dispatch into the caller's tensors (start_dispatch_into)".into(),
        ));
    }
    p.fp8 = i32::from(dtype.is_fp8());
    p.round_scales = i32::from(matches!(dtype, DispatchDtype::Fp8 { round_scales: true }));
    p.x = inputs.tokens().ptr();
    // Forwarded rows (validated: multiples of 16 that fit the BF16 payload) travel as the first
    // bytes of the BF16 messages, into the caller's tensors only.
    if let (Some((token_bytes, scale_bytes)), Some(scales)) = (dtype.forwarded(), inputs.scales()) {
        if into.and_then(|t| t.scales).is_none() {
            return Err(Error::Unsupported(
                "a forwarded dispatch writes into the caller's tensors with scales (start_dispatch_into): the group's buffers hold no scale rows".into(),
            ));
        }
        if s.nccl.is_some() {
            return Err(Error::Unsupported(
                "a forwarded dispatch needs every peer over NVLink (the NCCL transport packs BF16 or FP8 rows)".into(),
            ));
        }
        p.x_scales = scales.ptr();
        p.fwd_token_bytes =
            i32::try_from(token_bytes).map_err(|_| Error::Unsupported("token_bytes above 2^31".into()))?;
        p.fwd_scale_bytes =
            i32::try_from(scale_bytes).map_err(|_| Error::Unsupported("scale_bytes above 2^31".into()))?;
    }
    p.weights = inputs.weights().map_or(0, DeviceTensor::ptr);
    let set = number(s, &mut p, seq);
    p.out = s.mem.disp_out[set].ptr();
    let l = s.layout.ll("a low-latency dispatch")?;
    p.out_weights = s.mem.disp_topk[set].ptr();
    p.out_idx = p.out_weights + (l.rank_major_topk_entries() * 4) as u64;
    p.out_scales = s.mem.disp_scales[set].ptr();
    p.out_counts = s.mem.disp_counts[set].ptr();
    if opts.counts_location == CountsLocation::Host {
        p.host_counts = s.mem.host_counts[set].device_ptr();
    }
    if let Some(t) = into {
        p.out = t.tokens;
        p.out_scales = t.scales.unwrap_or(p.out_scales);
        p.out_weights = t.topk_weights.unwrap_or(p.out_weights);
        p.out_idx = t.topk_idx.unwrap_or(p.out_idx);
        p.out_counts = t.counts.unwrap_or(p.out_counts);
    }
    if let Some(rows) = h.0.send_rows {
        p.send_slot = h.ptr() + l.send_slot_offset() as u64;
        p.send_rows = rows;
    }
    match routing {
        // A handle created in stream order without a kernel: the send reads the caller's
        // routing, sanitizes it, writes the handle's copy and reports invalid rows.
        Some(StreamRouting::Caller { topk, report, .. }) => {
            p.topk_src = *topk;
            p.route_report = *report;
        }
        // Its kernel has built the copy (and the compacted slots and counts) since.
        Some(StreamRouting::Built { compact: true, .. }) => {
            p.send_slot = h.ptr() + l.send_slot_offset() as u64;
            p.send_rows = [-1; MAX_RANKS];
        }
        Some(StreamRouting::Built { compact: false, .. }) | None => {}
    }
    let stamp = h.core().dispatch_stamp(Pass::Forward);
    p.stamp = stamp.encode();
    Ok((p, set, stamp))
}

/// Dispatch `seq` of `inputs` on handle `h` (inputs validated).
pub(crate) fn dispatch(
    s: &Arc<RankShared>,
    seq: u64,
    h: &GpuHandle,
    inputs: ValidDispatch<'_, DeviceTensor>,
    opts: &DispatchOptions,
    into: Option<&OutputTargets>,
) -> Result<GpuOp, Error> {
    let routing = crate::ll::handle::stream_routing(s, h)?;
    let (mut p, set, stamp) = dispatch_params(s, seq, h, &inputs, opts, into, routing.as_ref())?;
    let xfers = nccl_xfers(s, &mut p, Some(h), set, true)?;
    let kind = GpuOpKind::Dispatch { handle: h.clone(), opts: *opts };
    let mut op = GpuOp::new(Arc::clone(s), Channel::Dispatch, seq, stamp, Launch::Ll(p), kind, &inputs.tensors());
    op.set_xfers(xfers);
    op.set_targets(into.copied());
    // A handle built in stream order: after its creation (the combine follows the dispatch),
    // or after the kernel that built it later.
    match routing {
        Some(StreamRouting::Built { event, stream, .. }) => op.order_after_event(event, stream),
        other => {
            if let Some((built, stream)) = h.ll_built_after() {
                op.order_after_event(built, stream);
            }
            if let Some(StreamRouting::Caller { launched: Some(kernel), .. }) = other {
                op.join_before_done(kernel);
            }
        }
    }
    Ok(op)
}

/// The kernel parameters of combine `seq` of `inputs` on handle `h` with `stamp` (inputs
/// validated), and its buffer set; NCCL staging not yet set.
pub(crate) fn combine_params(
    s: &RankShared,
    seq: u64,
    h: &GpuHandle,
    stamp: Stamp,
    inputs: &ValidCombine<'_, DeviceTensor>,
    into: Option<&OutputTargets>,
) -> Result<(LlParams, usize), Error> {
    let ValidCombine::LowLatency { expert_out, weights, global_scales } = inputs else {
        return Err(Error::Backend("a high-throughput combine in a low-latency group".into()));
    };
    let mut p = base_params(s, 1, h.ptr(), h.num_tokens(), h.top_k(), h.layout())?;
    p.expert_out = expert_out.ptr();
    p.weights = weights.map_or(0, DeviceTensor::ptr);
    // NVFP4 (validated: hidden a multiple of 16, the scales given): its own kernels, rows in
    // the BF16 slots' first bytes, over NVLink only.
    if let Some(g) = global_scales {
        if s.nccl.is_some() {
            return Err(Error::Unsupported(
                "an NVFP4 combine needs every peer over NVLink (the NCCL transport carries BF16 rows)".into(),
            ));
        }
        p.nvfp4 = 1;
        p.x_scales = g.ptr();
    }
    let set = number(s, &mut p, seq);
    p.out = into.map_or(s.mem.comb_out[set].ptr(), |t| t.tokens);
    if s.config.rank_masking {
        p.masked_out = into.map_or(Some(s.mem.comb_masked[set].ptr()), |t| t.masked).unwrap_or(0);
    }
    p.stamp = stamp.encode();
    Ok((p, set))
}

/// Combine `seq` of `inputs` on handle `h`, pairing with dispatch `paired` (inputs validated).
pub(crate) fn combine(
    s: &Arc<RankShared>,
    seq: u64,
    h: &GpuHandle,
    paired: u64,
    inputs: ValidCombine<'_, DeviceTensor>,
    into: Option<&OutputTargets>,
) -> Result<GpuOp, Error> {
    let stamp = h.core().combine_stamp(Pass::Forward, paired);
    let (mut p, set) = combine_params(s, seq, h, stamp, &inputs, into)?;
    let xfers = nccl_xfers(s, &mut p, Some(h), set, false)?;
    let kind = GpuOpKind::Combine { handle: h.clone(), paired };
    let mut op = GpuOp::new(Arc::clone(s), Channel::Combine, seq, stamp, Launch::Ll(p), kind, &inputs.tensors());
    op.set_xfers(xfers);
    op.set_targets(into.copied());
    Ok(op)
}

/// A cancellation of collective `seq` of `channel` (this rank's arguments failed validation).
/// It uses `h` if the handle is this group's, else the rank's zeroed handle memory; over NCCL a
/// combine cannot be cancelled without a usable handle (its exchange is sized by the handle),
/// and `None` is returned: the peers then time out.
pub(crate) fn cancellation(s: &Arc<RankShared>, channel: Channel, seq: u64, h: Option<&GpuHandle>) -> Option<GpuOp> {
    let dispatch = channel == Channel::Dispatch;
    let (ptr, k, layout) = match (h, &s.null_handle) {
        (Some(h), _) => (h.ptr(), h.top_k(), h.layout()),
        (None, Some(null)) => (null.ptr(), s.config.max_top_k, Layout::ExpertMajor),
        (None, None) => return None,
    };
    let mut p = base_params(s, usize::from(!dispatch), ptr, 0, k, layout).ok()?;
    let set = number(s, &mut p, seq);
    if dispatch {
        p.out = s.mem.disp_out[set].ptr();
        p.out_counts = s.mem.disp_counts[set].ptr();
    } else {
        p.out = s.mem.comb_out[set].ptr();
    }
    let xfers = nccl_xfers(s, &mut p, h, set, dispatch).ok()?;
    let mut op = GpuOp::cancellation(Arc::clone(s), channel, seq, Launch::Ll(p));
    op.set_xfers(xfers);
    Some(op)
}

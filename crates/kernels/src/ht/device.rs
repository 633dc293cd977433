//! High-throughput handles built on the device (over NVLink), in one launch of `ep_ht_plan` on the
//! handle stream: its mark blocks, a thread per token, validate each row, copy it into the
//! handle, mark the ranks it reaches and count selections per expert (each block into its own
//! slots, so nothing is zeroed first), then count themselves done on the rank's mark counter;
//! once it reaches the creation's target, a block per destination scans the marks into that
//! destination's send plan and sends it the count message, while one more block waits for every
//! source's message and builds the receive layout. Neither `topk_idx` nor the plan crosses to the
//! host: what the host learns (the first invalid entry, `N`, the rows per local expert) comes
//! back in a few words of mapped memory when the operation completes.
//!
//! The device plan is the host's ([`epflow_core::routing::ChannelPlan`]) with one difference: the
//! send list is strided, destination `d`'s tokens starting at `send_list[d * B]` (the offsets in
//! `send_off` stay absolute), so no block waits for another's count. The message format is the
//! count exchange's, so a rank building its handle on the host (`EPFLOW_HT_HANDLE=host`, or
//! over NCCL) and one building it on the device agree.

use epflow_core::tuning::HandleBuilder;
use std::sync::Arc;

use epflow_core::Error;
use epflow_core::ops::Pass;
use epflow_core::protocol::Channel;
use epflow_core::stamp::{Pairing, Stamp};

use crate::device::{DeviceTensor, PinnedBuffer};
use crate::op::ht_geometry::mark_blocks;
use crate::op::{GpuOp, GpuOpKind, Launch};
use crate::params::HtPlanParams;
use crate::state::handle::{HandleOffsets, take_pooled};
use crate::state::ht_plan::DevicePlan;
use crate::state::ht_result::RESULT_HEAD;
use crate::state::shared::{RankShared, peer_array};

/// Whether this rank builds its high-throughput handles on the device: over NVLink, unless
/// `EPFLOW_HT_HANDLE=host` asks for the host-built plan (kept for comparison and as a fallback).
pub(crate) fn builds_on_device(s: &RankShared) -> bool {
    s.nccl_all().is_none() && s.config.tuning().ht_handle == HandleBuilder::Device
}

/// The byte offsets of a device-built handle's arrays: the routing `[B x K]` i64, the strided
/// send list `[R x B]`, `send_off [R x (C + 1)]`, `recv_base`/`recv_cnt [R x C]`, `copy_ord
/// [B x R]`, the rows per local expert `[L]`, all i32; then the kernels' scratch: each of the `g`
/// mark blocks' selections per expert (`[g x R L]` i32) and first invalid entry (`[g]`), the send
/// blocks done (one i32), and the marks (`[B]` bytes).
fn device_offsets(b: usize, k: usize, r: usize, c: usize, l: usize, g: usize) -> (HandleOffsets, usize, usize) {
    let mut at = 0usize;
    let mut next = |bytes: usize| {
        let here = at.next_multiple_of(256);
        at = here + bytes;
        here
    };
    let _topk = next(b * k * 8);
    let off = HandleOffsets {
        send_list: next(r * b * 4),
        send_off: next(r * (c + 1) * 4),
        recv_base: next(r * c * 4),
        recv_cnt: next(r * c * 4),
        copy_ord: next(b * r * 4),
        counts: next(l * 4),
        end: 0,
    };
    let scratch = next((g * r * l + g + 1) * 4);
    let hits = next(b);
    (HandleOffsets { end: at, ..off }, scratch, hits)
}

/// Handle creation `seq` for `topk_idx` (`[B x K]` i64 on this rank's device, its descriptor
/// already checked), built on the device.
///
/// `recv_bound`: the received rows of a `RecvRows::Bound` handle (which may be handed out before
/// the device built it, `GpuOp::complete_on`).
pub(crate) fn start(
    s: &Arc<RankShared>,
    seq: u64,
    topk_idx: &DeviceTensor,
    recv_bound: Option<usize>,
) -> Result<GpuOp, Error> {
    let l = s.layout.ht("a high-throughput handle")?;
    let (b, k) = (topk_idx.desc().shape[0], topk_idx.desc().shape[1]);
    let (r, c, local) = (s.num_ranks, l.channels, l.local_experts);
    let tokens_per_channel = b.div_ceil(c.max(1)).max(1);
    let marks = mark_blocks(b, s.config.num_experts);
    let (off, scratch, hits) = device_offsets(b, k, r, c, local, marks);
    let mem = take_pooled(s, off.end.max(1))?;
    let result_bytes = (RESULT_HEAD + local) * 8;
    let result = match s.plan_results.lock().unwrap_or_else(|e| e.into_inner()).pop() {
        Some(p) if p.bytes() >= result_bytes => p,
        _ => PinnedBuffer::zeroed(&s.ctx, result_bytes)?,
    };
    let base = mem.ptr();
    let at = |o: usize| base + o as u64;
    let stamp = Stamp::new(k, Pass::Forward, Pairing::None);
    let p = HtPlanParams {
        topk_in: topk_idx.ptr(),
        topk: base,
        send_list: at(off.send_list),
        send_off: at(off.send_off),
        recv_base: at(off.recv_base),
        recv_cnt: at(off.recv_cnt),
        copy_ord: at(off.copy_ord),
        counts: at(off.counts),
        scratch: at(scratch),
        hits: at(hits),
        result: result.device_ptr(),
        own: s.mem.exchange.ptr(),
        signals: s.mem.signals.ptr(),
        status: s.mem.status.device_ptr(),
        peer_region: peer_array(&s.peers().exchange),
        peer_signals: peer_array(&s.peers().signals),
        seq,
        timeout_ns: s.device_timeout_ns(),
        stamp: stamp.encode(),
        marks: s.mem.plan_marks.ptr(),
        mark_target: 0,
        rank: s.rank as i32,
        num_ranks: r as i32,
        num_tokens: b as i32,
        top_k: k as i32,
        num_experts: s.config.num_experts as i32,
        num_local: local as i32,
        channels: c as i32,
        tokens_per_channel: tokens_per_channel as i32,
        words: l.exchange_words() as i32,
        cancelled: 0,
        mark_blocks: marks as i32,
        pad: 0,
    };
    let plan = DevicePlan::new(b, k, tokens_per_channel, off, mem, result, recv_bound);
    let kind = GpuOpKind::HtDeviceHandle(Box::new(plan));
    Ok(GpuOp::new(Arc::clone(s), Channel::Handle, seq, stamp, Launch::HtPlan(p), kind, &[topk_idx]))
}

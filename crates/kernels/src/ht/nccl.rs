//! High-throughput operations over NCCL (as soon as any peer is reached through NCCL): the
//! kernel parameters of the pack, arrival-check and reduce kernels (`cuda/nccl.cu`), and the
//! grouped exchange of each destination's block of rows.

use epflow_core::Error;
use epflow_core::handle::RoutingHandle;

use crate::device::cache::CachedBuffer;
use crate::params::{HtParams, NcclHtParams};
use crate::state::handle::{GpuHandle, HtHandleInfo};
use crate::state::shared::RankShared;
use crate::transport::nccl::Xfer;

/// The exchange of a high-throughput operation over NCCL: for every rank `d` and every array
/// `(send base, receive base, bytes per row)` with rows, the rows `send[d]` (`(first, rows)`) go
/// to `d` and the rows `recv[d]` come from it; then the arrival pair of channel `chan`, set
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

/// The parameters every NCCL high-throughput kernel shares, from the NVLink ones.
fn nccl_params(s: &RankShared, p: &HtParams, info: &HtHandleInfo) -> NcclHtParams {
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
        stamp: p.stamp,
        ..NcclHtParams::default()
    }
}

/// Dispatch over NCCL: the kernel parameters, the exchange (each destination's block of the
/// staging into its outputs, `p.out`, `p.out_scales`, `p.out_weights`, `p.out_idx`) and the
/// staging.
pub(crate) fn nccl_dispatch(
    s: &RankShared,
    h: &GpuHandle,
    p: &HtParams,
) -> Result<(NcclHtParams, Vec<Xfer>, CachedBuffer), Error> {
    let info = h.ht()?;
    let mut np = nccl_params(s, p, info);
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
pub(crate) fn nccl_combine(
    s: &RankShared,
    h: &GpuHandle,
    p: &HtParams,
) -> Result<(NcclHtParams, Vec<Xfer>, CachedBuffer), Error> {
    let info = h.ht()?;
    let mut np = nccl_params(s, p, info);
    np.total_send = 0; // the pack kernel only writes the arrival pair
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

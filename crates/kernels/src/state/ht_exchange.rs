//! The count exchange that creates a high-throughput handle: what arrived, and the handle built
//! from it (its send plan and receive layout encoded into device arrays).

use std::sync::Arc;

use epflow_core::handle::HandleCore;
use epflow_core::protocol::{Channel, op_label};
use epflow_core::routing::{ChannelPlan, ChannelReceive, Routing};
use epflow_core::{Algorithm, Error};

use crate::state::handle::{GpuHandle, HandleOffsets, HtHandleInfo, take_pooled};
use crate::state::shared::{ExchangeBuffers, RankShared};
use crate::transport::nccl::exchange_row_words;

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

fn push_i32s(bytes: &mut Vec<u8>, v: &[i32]) -> usize {
    let at = bytes.len().next_multiple_of(256);
    bytes.resize(at, 0);
    bytes.extend(v.iter().flat_map(|x| x.to_le_bytes()));
    at
}

/// Builds the handle of count exchange `seq` once it has delivered `received`: the routing,
/// the send plan and the receive layout, in one device buffer; `recv_bound`: the received rows
/// of a `RecvRows::Bound` handle.
pub(crate) fn finish_handle(
    shared: &Arc<RankShared>,
    seq: u64,
    routing: Routing,
    plan: &ChannelPlan,
    received: &[i32],
    recv_bound: Option<usize>,
) -> Result<GpuHandle, Error> {
    let layout = shared.layout.ht("a high-throughput handle")?;
    let (r, c) = (shared.num_ranks, layout.channels);
    let recv = ChannelReceive::from_messages(received, r, c);
    let mut bytes: Vec<u8> = routing.indices().iter().flat_map(|e| e.to_le_bytes()).collect();
    let off = HandleOffsets {
        send_list: push_i32s(&mut bytes, &plan.send_list),
        send_off: push_i32s(&mut bytes, &plan.send_off),
        recv_base: push_i32s(&mut bytes, &recv.recv_base),
        recv_cnt: push_i32s(&mut bytes, &recv.recv_cnt),
        copy_ord: push_i32s(&mut bytes, &plan.copy_ord),
        counts: push_i32s(&mut bytes, &recv.expert_counts),
        end: bytes.len(),
    };
    let mem = take_pooled(shared, off.end.max(1))?;
    mem.write(0, &bytes)?;
    let info = HtHandleInfo {
        tokens_per_channel: plan.tokens_per_channel,
        off,
        send_blocks: plan.send_blocks(r, c),
        recv_blocks: recv.recv_blocks(r, c),
        total_send: plan.send_list.len(),
    };
    let mut core = HandleCore::new(shared.group_id, routing, Algorithm::HighThroughput, Some(seq))
        .with_recv(recv.num_recv, recv.expert_counts);
    if let Some(b) = recv_bound {
        core = core.with_recv_bound(b);
    }
    Ok(GpuHandle::new(core, mem, &shared.handle_pool, Some(info), None, None))
}

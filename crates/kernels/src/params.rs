//! The kernels' by-value parameter blocks, mirrored byte for byte from `cuda/ll.cu`,
//! `cuda/ht.cu` and `cuda/nccl.cu`, and the layout of the signal and status pages they share.

use cudarc::driver::DeviceRepr;

/// Largest number of ranks the NVLink kernels handle.
pub const MAX_RANKS: usize = 8;
/// Message header bytes of a low-latency dispatch message.
pub const HDR_BYTES: usize = 128;
/// Buffer sets the signal page has room for.
pub const MAX_SETS: usize = 16;
/// `u64` arrays in the signal page, each `[set][rank]` (see `common.cuh`).
pub const SIG_ARRAYS: usize = 10;
/// Largest number of high-throughput channels (block pairs) of a kernel.
pub const HT_MAX_CHANNELS: usize = 64;
/// Largest number of sending warps per destination in the high-throughput kernels.
pub const HT_MAX_WARPS: usize = 16;
/// Words of the high-throughput ring counters after the arrays (see `ht.cu`): subtails
/// `[2][C][R][W]`, heads `[2][C][R]`, and the producer and consumer positions `[2][C][R][2]`.
pub const HT_COUNTER_WORDS: usize =
    2 * HT_MAX_CHANNELS * MAX_RANKS * HT_MAX_WARPS + 2 * HT_MAX_CHANNELS * MAX_RANKS * 5;
/// Bytes of a rank's signal page.
pub const SIGNAL_PAGE_BYTES: usize = (SIG_ARRAYS * MAX_SETS * MAX_RANKS + HT_COUNTER_WORDS) * 8;
/// Words of a rank's status page: the error word, then per (channel, set) the cancellation mask
/// (channels: dispatch, combine, handle).
pub const STATUS_WORDS: usize = 1 + 3 * MAX_SETS;

/// `struct LlParams` of `ll.cu`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct LlParams {
    pub x: u64,
    pub topk_idx: u64,
    pub weights: u64,
    pub row_of: u64,
    pub out: u64,
    pub out_scales: u64,
    pub out_counts: u64,
    pub host_counts: u64,
    pub expert_out: u64,
    pub signals: u64,
    pub status: u64,
    pub own_recv: u64,
    pub peer_recv: [u64; MAX_RANKS],
    pub peer_signals: [u64; MAX_RANKS],
    pub seq: u64,
    pub timeout_ns: u64,
    pub recv_set_bytes: u64,
    pub msg_bytes: u64,
    pub rank: i32,
    pub num_ranks: i32,
    pub max_tokens: i32,
    pub hidden: i32,
    pub top_k: i32,
    pub num_local: i32,
    pub num_tokens: i32,
    pub set: i32,
    pub num_sets: i32,
    pub fp8: i32,
    pub round_scales: i32,
    pub cancelled: i32,
    pub splits: i32,
    pub chunks: i32,
    /// Ranks reached through NCCL (bit `r` = rank `r`), see `nccl.rs`.
    pub nccl_mask: i32,
    pub pad: i32,
    pub nccl_out: u64,
    pub nccl_in: u64,
    pub nccl_pack: u64,
    pub nccl_counts: u64,
    pub nccl_pos: u64,
    pub nccl_dest_bytes: u64,
}

// SAFETY: `LlParams` is `repr(C)`, plain old data, and matches the CUDA struct's layout
// (checked by the tests below and by a static_assert in ll.cu).
unsafe impl DeviceRepr for LlParams {}

/// `struct HtParams` of `ht.cu`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct HtParams {
    pub x: u64,
    pub x_scales: u64,
    pub weights: u64,
    pub topk_idx: u64,
    pub send_list: u64,
    pub send_off: u64,
    pub recv_base: u64,
    pub recv_cnt: u64,
    pub copy_ord: u64,
    pub out: u64,
    pub out_scales: u64,
    pub out_weights: u64,
    pub out_idx: u64,
    pub own_ring: u64,
    pub signals: u64,
    pub status: u64,
    pub peer_ring: [u64; MAX_RANKS],
    pub peer_signals: [u64; MAX_RANKS],
    pub seq: u64,
    pub timeout_ns: u64,
    pub slot_bytes: u64,
    pub ring_bytes: u64,
    pub rank: i32,
    pub num_ranks: i32,
    pub hidden: i32,
    pub top_k: i32,
    pub num_local: i32,
    pub num_tokens: i32,
    pub channels: i32,
    pub depth: i32,
    pub warps_per_dest: i32,
    pub fp8: i32,
    pub backward: i32,
    pub cancelled: i32,
    pub chan: i32,
    pub row_bytes: i32,
    pub off_scales: i32,
    pub off_weights: i32,
    pub off_idx: i32,
    pub tokens_per_channel: i32,
    pub batch: i32,
    pub items_per_fence: i32,
}

// SAFETY: `HtParams` is `repr(C)`, plain old data, and matches the CUDA struct's layout
// (checked by the tests below and by a static_assert in ht.cu).
unsafe impl DeviceRepr for HtParams {}

/// `struct ExchangeParams` of `ht.cu`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct ExchangeParams {
    pub msgs: u64,
    pub out: u64,
    pub own: u64,
    pub signals: u64,
    pub status: u64,
    pub peer_region: [u64; MAX_RANKS],
    pub peer_signals: [u64; MAX_RANKS],
    pub seq: u64,
    pub timeout_ns: u64,
    pub rank: i32,
    pub num_ranks: i32,
    pub words: i32,
    pub cancelled: i32,
}

// SAFETY: `ExchangeParams` is `repr(C)`, plain old data, and matches the CUDA struct's layout
// (checked by the tests below and by a static_assert in ht.cu).
unsafe impl DeviceRepr for ExchangeParams {}

/// `struct NcclHtParams` of `nccl.cu`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct NcclHtParams {
    pub x: u64,
    pub x_scales: u64,
    pub weights: u64,
    pub topk_idx: u64,
    pub send_list: u64,
    pub send_off: u64,
    pub copy_ord: u64,
    pub out: u64,
    pub out_scales: u64,
    pub out_weights: u64,
    pub out_idx: u64,
    pub input: u64,
    pub in_weights: u64,
    pub signals: u64,
    pub status: u64,
    pub seq: u64,
    pub rank: i32,
    pub num_ranks: i32,
    pub hidden: i32,
    pub top_k: i32,
    pub num_local: i32,
    pub num_tokens: i32,
    pub channels: i32,
    pub tokens_per_channel: i32,
    pub fp8: i32,
    pub backward: i32,
    pub chan: i32,
    pub set: i32,
    pub cancelled: i32,
    pub total_send: i32,
    pub row_bytes: i32,
    pub pad: i32,
}

// SAFETY: `NcclHtParams` is `repr(C)`, plain old data, and matches the CUDA struct's layout
// (checked by the tests below and by a static_assert in nccl.cu).
unsafe impl DeviceRepr for NcclHtParams {}

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::{offset_of, size_of};

    #[test]
    fn ht_layouts_match_the_cuda_structs() {
        assert_eq!(size_of::<HtParams>(), 368);
        assert_eq!(offset_of!(HtParams, peer_ring), 128);
        assert_eq!(offset_of!(HtParams, seq), 256);
        assert_eq!(offset_of!(HtParams, rank), 288);
        assert_eq!(offset_of!(HtParams, batch), 360);
        assert_eq!(size_of::<ExchangeParams>(), 200);
        assert_eq!(offset_of!(ExchangeParams, seq), 168);
        assert_eq!(offset_of!(ExchangeParams, rank), 184);
    }

    #[test]
    fn nccl_layout_matches_the_cuda_struct() {
        assert_eq!(size_of::<NcclHtParams>(), 192);
        assert_eq!(offset_of!(NcclHtParams, input), 88);
        assert_eq!(offset_of!(NcclHtParams, seq), 120);
        assert_eq!(offset_of!(NcclHtParams, rank), 128);
        assert_eq!(offset_of!(NcclHtParams, cancelled), 176);
    }

    #[test]
    fn layout_matches_the_cuda_struct() {
        assert_eq!(size_of::<LlParams>(), 368);
        assert_eq!(offset_of!(LlParams, nccl_mask), 312);
        assert_eq!(offset_of!(LlParams, nccl_out), 320);
        assert_eq!(offset_of!(LlParams, nccl_dest_bytes), 360);
        assert_eq!(offset_of!(LlParams, peer_recv), 96);
        assert_eq!(offset_of!(LlParams, peer_signals), 160);
        assert_eq!(offset_of!(LlParams, seq), 224);
        assert_eq!(offset_of!(LlParams, msg_bytes), 248);
        assert_eq!(offset_of!(LlParams, rank), 256);
        assert_eq!(offset_of!(LlParams, splits), 304);
        assert_eq!(offset_of!(LlParams, chunks), 308);
    }
}

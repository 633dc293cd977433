//! The kernels' by-value parameter block, mirrored byte for byte from `cuda/ll.cu`.

use cudarc::driver::DeviceRepr;

/// Largest number of ranks the NVLink kernels handle.
pub const MAX_RANKS: usize = 8;
/// Message header bytes of a low-latency dispatch message.
pub const HDR_BYTES: usize = 128;
/// Buffer sets the signal page has room for.
pub const MAX_SETS: usize = 16;
/// `u64` arrays in the signal page (see `common.cuh`).
pub const SIG_ARRAYS: usize = 7;
/// Bytes of a rank's signal page.
pub const SIGNAL_PAGE_BYTES: usize = SIG_ARRAYS * MAX_SETS * MAX_RANKS * 8;
/// Words of a rank's status page: the error word, then per (channel, set) the cancellation mask.
pub const STATUS_WORDS: usize = 1 + 2 * MAX_SETS;

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
    pub pad: [i32; 2],
}

// SAFETY: `LlParams` is `repr(C)`, plain old data, and matches the CUDA struct's layout
// (checked by the tests below and by a static_assert in ll.cu).
unsafe impl DeviceRepr for LlParams {}

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::{offset_of, size_of};

    #[test]
    fn layout_matches_the_cuda_struct() {
        assert_eq!(size_of::<LlParams>(), 320);
        assert_eq!(offset_of!(LlParams, peer_recv), 96);
        assert_eq!(offset_of!(LlParams, peer_signals), 160);
        assert_eq!(offset_of!(LlParams, seq), 224);
        assert_eq!(offset_of!(LlParams, msg_bytes), 248);
        assert_eq!(offset_of!(LlParams, rank), 256);
        assert_eq!(offset_of!(LlParams, splits), 304);
        assert_eq!(offset_of!(LlParams, chunks), 308);
    }
}

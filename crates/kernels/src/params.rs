//! The kernels' by-value parameter blocks, mirrored byte for byte from `cuda/ll_base.cuh`,
//! `cuda/ll.cu`, `cuda/ht_rings.cuh`, `cuda/ht_handle.cuh` and `cuda/nccl.cu`, and the layout of
//! the signal and status pages they share.

use cudarc::driver::DeviceRepr;

/// Largest number of ranks the NVLink kernels handle.
pub(crate) const MAX_RANKS: usize = 8;
/// Message header bytes of a low-latency dispatch message.
pub(crate) const HDR_BYTES: usize = 128;
/// Buffer sets the signal page has room for.
pub(crate) const MAX_SETS: usize = 16;
/// Words of the arrival pairs at the start of the signal page: `[chan][set][rank]` x
/// (arrival word, stamp) (see `common.cuh`).
pub(crate) const ARRIVAL_WORDS: usize = 3 * MAX_SETS * MAX_RANKS * 2;
/// `u64` arrays after the arrival pairs, each `[set][rank]` (see `common.cuh`).
pub(crate) const SIG_ARRAYS: usize = 11;
/// Words of the arrival pairs and the arrays.
pub(crate) const SIG_ARRAY_WORDS: usize = ARRIVAL_WORDS + SIG_ARRAYS * MAX_SETS * MAX_RANKS;
/// Most tokens of a low-latency rank-major combine that may take tagged rows (flags in the
/// payload, `EP_TAG_TOKENS` in `ll_tagged.cuh`): the combine receive region has room for that many
/// tokens' tagged rows, R per token, per buffer set (see `LlLayout::combine_tagged_set_bytes`);
/// an expert-major combine fits `LL_TAG_TOKENS * R / K` tokens there. Also the most tokens of a
/// dispatch sent as tagged messages (`LlLayout::dispatch_tagged_set_bytes`).
/// The most shared-memory buffers `ep_tma_copy` takes (`TMA_MAX_STAGES` in `util.cu`).
pub(crate) const TMA_MAX_STAGES: u32 = 32;
pub(crate) const LL_TAG_TOKENS: usize = 32;
/// The largest `max_tokens` whose rank-major dispatches send their messages compacted
/// ([`LlParams::send_slot`]; `EP_COMPACT_MAX_ROWS` in `common.cuh`: the count travels in 14 bits
/// of the arrival word). Larger groups keep the messages at their tokens' slots.
pub(crate) const LL_COMPACT_MAX_ROWS: usize = 16383;
/// Largest number of high-throughput channels (block pairs) of a kernel.
pub(crate) const HT_MAX_CHANNELS: usize = 128;
/// Largest number of sending warps per destination in the high-throughput kernels.
pub(crate) const HT_MAX_WARPS: usize = 16;
/// Words of one direct-dispatch or pull-combine slot (`HT_DIRECT_SLOT` of `ht_rings.cuh`: five
/// tagged 64-bit values, two words each, padded).
pub(crate) const HT_DIRECT_SLOT: usize = 16;
/// Words of the high-throughput ring counters after the arrays (see `ht_rings.cuh`): subtails
/// `[2][C][R][W]`, heads `[2][C][R]`, the producer and consumer positions `[2][C][R][2]`, the
/// addresses of direct dispatch and pull combine `[2][C][R][HT_DIRECT_SLOT]` (`ht_direct`), the
/// direct dispatch's helper words `[C][R][W]` (`ht_helped`), the balanced direct dispatch's row
/// pools `[R][2][HT_POOL_WORDS]` (`ht_pool`).
pub(crate) const HT_COUNTER_WORDS: usize = 2 * HT_MAX_CHANNELS * MAX_RANKS * HT_MAX_WARPS
    + 2 * HT_MAX_CHANNELS * MAX_RANKS * 5
    + 2 * HT_MAX_CHANNELS * MAX_RANKS * HT_DIRECT_SLOT
    + HT_MAX_CHANNELS * MAX_RANKS * HT_MAX_WARPS
    + MAX_RANKS * 2 * HT_POOL_WORDS;
/// Words of a balanced direct dispatch's row pool per (destination, operation parity)
/// (`HT_POOL_WORDS` and `ht_pool` of `ht_rings.cuh`).
pub(crate) const HT_POOL_WORDS: usize = 4;
/// Bytes of a rank's signal page.
pub(crate) const SIGNAL_PAGE_BYTES: usize = (SIG_ARRAY_WORDS + HT_COUNTER_WORDS) * 8;

/// Byte offset of the arrival pair of channel `chan`, set `set`, source `rank` in a signal page
/// (`arrival_at` of `common.cuh`); the stamp follows 8 bytes later.
pub(crate) const fn arrival_offset(chan: usize, set: usize, rank: usize) -> u64 {
    (((chan * MAX_SETS + set) * MAX_RANKS + rank) * 2 * 8) as u64
}

/// The status page of a rank (pinned, mapped; `common.cuh` writes it): the first error, then per
/// (channel, set) the outcome word of its last completed operation, then per (channel, set) the
/// stamp of its lowest mismatched source (channels: dispatch, combine, handle).
pub(crate) mod status {
    use super::MAX_SETS;

    /// Words of the page.
    pub(crate) const WORDS: usize = REJOIN + 3;
    /// The mask word this rank's kernels last saw (rank masking; `EP_STATUS_MASK`).
    pub(crate) const MASK: usize = 1 + 6 * MAX_SETS;
    /// After `ep_mask_rejoin`: the next operation number of each channel (`EP_STATUS_REJOIN`).
    pub(crate) const REJOIN: usize = MASK + 1;
    /// The first error: `code | peer << 8 | seq << 16`, 0 for none.
    pub(crate) const ERROR: usize = 0;
    /// A source did not arrive in time.
    pub(crate) const TIMEOUT_ARRIVAL: u64 = 1;
    /// A destination did not return its credit in time.
    pub(crate) const TIMEOUT_CREDIT: u64 = 2;
    /// A destination stopped taking rows from its ring.
    pub(crate) const TIMEOUT_RING: u64 = 3;
    /// A high-throughput source's stamp disagreed (the rings' positions now disagree).
    pub(crate) const MISMATCH: u64 = 4;
    /// `unmask_all`: a rank did not come to the meeting in time (`peer` is the first missing).
    pub(crate) const REJOIN_TIMEOUT: u64 = 5;
    /// `GpuRank::meet_on`: a rank did not come to the meeting in time (`seq` is its number).
    pub(crate) const MEET_TIMEOUT: u64 = 6;

    /// The outcome word of (channel, set): `(seq + 1) << 32 | mismatched << 16 | absent << 8 |
    /// cancelled` (absent: the sources a masking group skipped).
    pub(crate) const fn outcome(chan: usize, set: usize) -> usize {
        1 + chan * MAX_SETS + set
    }

    /// The stamp of the lowest mismatched source of (channel, set).
    pub(crate) const fn stamp(chan: usize, set: usize) -> usize {
        1 + 3 * MAX_SETS + chan * MAX_SETS + set
    }
}

/// `struct LlParams` of `ll_base.cuh`.
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
    /// 1 for a rank-major handle ([`epflow_core::ops::Layout::RankMajor`]).
    pub rank_major: i32,
    pub nccl_out: u64,
    pub nccl_in: u64,
    pub nccl_pack: u64,
    pub nccl_counts: u64,
    pub nccl_pos: u64,
    pub nccl_dest_bytes: u64,
    /// What every rank must agree on ([`epflow_core::stamp::Stamp::encode`]).
    pub stamp: u64,
    /// Rank-major dispatch: the received weights `[R*M x K]` fp32.
    pub out_weights: u64,
    /// Rank-major dispatch: the received local expert indices `[R*M x K]` int32.
    pub out_idx: u64,
    /// Complete half: the pieces a received row is copied (dispatch) or summed (combine) in.
    pub recv_chunks: i32,
    /// 1: rank masking ([`epflow_core::mask`]).
    pub masking: i32,
    /// A captured operation: the device address of its channel's base in the step's bases
    /// (`seq` is then the operation's place in the step); 0 for operations the host numbers.
    pub seq_base: u64,
    /// A captured operation: the step's failure word (mapped host), or 0.
    pub verdict: u64,
    /// A captured dispatch: the caller's `[B x K]` int64 top-k buffer, sanitized row by row by
    /// the send (`routed_entry` in `ll_send.cuh`); 0 otherwise.
    pub topk_src: u64,
    /// A captured dispatch: the handle's report of invalid rows (mapped host).
    pub route_report: u64,
    /// A combine with masking: `[B]` int32, per token its top-k entries on absent ranks (or 0).
    pub masked_out: u64,
    /// The handle's return list: `[R x M x K]` int32, per source the entries `t * K + k` whose
    /// rows go back in combine, source `s`'s from `s * M * K` on (written by the dispatch
    /// receive, read by the combine send).
    pub ret_list: u64,
    /// The handle's return list counts: `[R]` int32, source `s`'s entries are
    /// `ret_list[s * M * K..][..count[s]]`.
    pub ret_count: u64,
    /// 1: `EPFLOW_LL_TRACE=1`, the kernels print block 0's phase times every 64th operation
    /// (`trace_at` in `ll_base.cuh`); a diagnostic.
    pub trace: i32,
    /// This rank's combine takes tagged rows (flags in the payload) from NVLink peers when it has
    /// at most this many tokens (rank-major) or `tag_tokens * R / K` (expert-major); 0: never;
    /// at most `LL_TAG_TOKENS` and `max_tokens` (see [`LlParams::tagged_rows`]). The token owner
    /// decides, and tells each destination in its dispatch messages.
    pub tag_tokens: i32,
    /// This rank's dispatch goes out as tagged messages (flags in the payload; `sends_tagged` in
    /// `ll_tagged.cuh`) when it has at most this many tokens and no NCCL peer; 0: never; at most
    /// `LL_TAG_TOKENS` and `max_tokens`. The sender decides; its arrival word tells each
    /// receiver.
    pub tag_dispatch_tokens: i32,
    /// A rank-major dispatch on a handle (not captured): the handle's `[R x M]` int32 of the
    /// slot each (destination, token)'s plain message takes there, its place among this rank's
    /// tokens routed to that destination, or -1 (see `LlLayout::send_slot_offset`); 0: messages
    /// at their tokens' slots. The receiver then copies slot `i` into output row `i` without
    /// reading headers first. Not for NCCL destinations (nor for this rank itself when it has
    /// any: its own arrival pair is the one NCCL carries to them). Tagged sends (`sends_tagged`)
    /// take the same slots in the tagged area, and send nothing for a token routed elsewhere.
    pub send_slot: u64,
    /// With `send_slot`: per destination, the messages it gets (its arrival word says so), or
    /// -1: the kernel reads them from the handle, right after the slots (`[R]` int32 at
    /// `send_slot + R * M * 4`, written by the handle's kernel): a handle built in stream order,
    /// whose counts the host never read (`ll/handle.rs`).
    pub send_rows: [i32; MAX_RANKS],
    /// A forwarded dispatch ([`epflow_core::DispatchDtype::Forwarded`], `fp8` 0): the caller's
    /// scale rows `[B x fwd_scale_bytes]` (the tokens are `x`, rows of `fwd_token_bytes`); both
    /// travel unchanged as the first `fwd_token_bytes + fwd_scale_bytes` bytes of the BF16
    /// message payload and land in `out` and `out_scales`. An NVFP4 combine (`nvfp4` 1): each
    /// expert output row's fp32 global scale. 0 otherwise.
    pub x_scales: u64,
    /// A forwarded dispatch: bytes of a token's payload row (a multiple of 16), else 0.
    pub fwd_token_bytes: i32,
    /// A forwarded dispatch: bytes of a token's scale row (a multiple of 16), else 0.
    pub fwd_scale_bytes: i32,
    /// 1: a combine that travels as NVFP4 ([`epflow_core::dtype::CombineQuant::Nvfp4`]; the
    /// `_nvfp4` kernels; its rows are never tagged), else 0.
    pub nvfp4: i32,
    /// Padding (the struct is 8-byte aligned).
    pub pad_nvfp4: i32,
}

/// `struct MaskParams` of `ll.cu` (`ep_mask_spread`, `ep_mask_rejoin`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct MaskParams {
    pub signals: u64,
    pub status: u64,
    pub peer_signals: [u64; MAX_RANKS],
    /// `ep_mask_spread`: the ranks to mask (bit `r` = rank `r`).
    pub bits: u64,
    /// `ep_mask_rejoin`: the number of this `unmask_all` (1, 2, ...).
    pub epoch: u64,
    /// `ep_mask_rejoin`: this rank's next operation number per channel.
    pub next: [u64; 3],
    pub timeout_ns: u64,
    pub rank: i32,
    pub num_ranks: i32,
}

// SAFETY: `MaskParams` is `repr(C)`, plain old data, and matches the CUDA struct's layout
// (checked by the tests below and by a static_assert in ll.cu).
unsafe impl DeviceRepr for MaskParams {}

// SAFETY: `LlParams` is `repr(C)`, plain old data, and matches the CUDA struct's layout
// (checked by the tests below and by a static_assert in ll_base.cuh).
unsafe impl DeviceRepr for LlParams {}

impl LlParams {
    /// Whether this rank's operation uses tagged combine rows: its dispatch asks for them, its
    /// combine receives them (then the `_tagged` combine kernels run). Rank-major: at most
    /// `tag_tokens` tokens; expert-major: at most `tag_tokens * R` rows of `K` per token (the
    /// tagged area's rows). Mirrors `wants_tagged` in `ll_tagged.cuh` field for field: the two must agree.
    pub(crate) fn tagged_rows(&self) -> bool {
        if self.nccl_mask != 0 || self.tag_tokens <= 0 || self.nvfp4 != 0 {
            return false;
        }
        if self.rank_major != 0 {
            self.num_tokens <= self.tag_tokens
        } else {
            self.num_tokens * self.top_k <= self.tag_tokens * self.num_ranks
        }
    }

    /// Whether this rank's dispatch goes out as tagged messages (then the one-launch form runs
    /// `ep_ll_dispatch_kernel_tagged`): no NCCL peer, at most `tag_dispatch_tokens` tokens and
    /// at most the tagged area's `min(LL_TAG_TOKENS, max_tokens)`. Mirrors `sends_tagged` in
    /// `ll_tagged.cuh` field for field: the two must agree.
    pub(crate) fn sends_tagged(&self) -> bool {
        self.nccl_mask == 0
            && self.tag_dispatch_tokens > 0
            && self.num_tokens <= self.tag_dispatch_tokens
            && self.num_tokens as usize <= LL_TAG_TOKENS.min(self.max_tokens.max(0) as usize)
    }
}

/// `struct HtParams` of `ht_rings.cuh`.
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
    /// What every rank must agree on ([`epflow_core::stamp::Stamp::encode`]).
    pub stamp: u64,
    /// 0, or the rows of a (source, channel) pair from which a dispatch writes them straight
    /// into the receiver's outputs and a combine reads them in place from the expert side's
    /// output (the same on every rank; `HtLayout::direct_min_rows`).
    pub direct: i32,
    /// With `direct`. Dispatch: 1 when this rank's outputs take direct writes in this operation
    /// (a cached output buffer that served an earlier operation, and not cancelled); 0 asks its
    /// sources for the ring. Combine: 1 when peers may read this rank's expert outputs (and
    /// weight gradients) in place (memory epflow allocated); 0 sends them through the rings.
    pub direct_mem: i32,
    /// Direct dispatch: warps of each receiving block that help send this rank's rows to each
    /// remote destination (`ht_help_direct`; `HtLayout::direct_helpers`), 0 for none. The same
    /// on every rank.
    pub helpers: i32,
    /// Direct dispatch: 1 when the rows for each destination are shared out between the warps
    /// of every channel as they go (`ht_pooled`; `HtLayout::balanced`), 0 for a fixed share per
    /// channel. The same on every rank.
    pub balanced: i32,
    /// A dispatch with scales (`fp8` 1): fp32 words of a token's scale row, `H / 128` for FP8
    /// rows, `scale_bytes / 4` for forwarded rows (`DispatchDtype::Forwarded`, which travel as
    /// `row_bytes` of payload and then the scale row at `off_scales`).
    pub scale_cols: i32,
    pub pad: i32,
}

// SAFETY: `HtParams` is `repr(C)`, plain old data, and matches the CUDA struct's layout
// (checked by the tests below and by a static_assert in ht_rings.cuh).
unsafe impl DeviceRepr for HtParams {}

/// `struct ExchangeParams` of `ht_handle.cuh`.
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
    /// What every rank must agree on (the top-k).
    pub stamp: u64,
}

// SAFETY: `ExchangeParams` is `repr(C)`, plain old data, and matches the CUDA struct's layout
// (checked by the tests below and by a static_assert in ht_handle.cuh).
unsafe impl DeviceRepr for ExchangeParams {}

/// `struct HtPlanParams` of `ht_handle.cuh`: a high-throughput handle built on the device (one
/// kernel: the mark blocks, a thread per token, then a block per destination and the receive
/// block).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct HtPlanParams {
    pub topk_in: u64,
    pub topk: u64,
    pub send_list: u64,
    pub send_off: u64,
    pub recv_base: u64,
    pub recv_cnt: u64,
    pub copy_ord: u64,
    pub counts: u64,
    pub scratch: u64,
    pub hits: u64,
    pub result: u64,
    pub own: u64,
    pub signals: u64,
    pub status: u64,
    pub peer_region: [u64; MAX_RANKS],
    pub peer_signals: [u64; MAX_RANKS],
    pub seq: u64,
    pub timeout_ns: u64,
    /// What every rank must agree on (the top-k).
    pub stamp: u64,
    /// The rank's mark counter (`RankMemory::plan_marks`).
    pub marks: u64,
    /// The counter's value once this creation's mark blocks are done (set at the launch).
    pub mark_target: u64,
    pub rank: i32,
    pub num_ranks: i32,
    pub num_tokens: i32,
    pub top_k: i32,
    pub num_experts: i32,
    pub num_local: i32,
    pub channels: i32,
    pub tokens_per_channel: i32,
    pub words: i32,
    pub cancelled: i32,
    /// The mark blocks, the plan kernel's first (`ht::geometry::mark_blocks`): each counts into
    /// its own scratch slots.
    pub mark_blocks: i32,
    pub pad: i32,
}

// SAFETY: `HtPlanParams` is `repr(C)`, plain old data, and matches the CUDA struct's layout
// (checked by the tests below and by a static_assert in ht_handle.cuh).
unsafe impl DeviceRepr for HtPlanParams {}

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
    /// What every rank must agree on ([`epflow_core::stamp::Stamp::encode`]).
    pub stamp: u64,
}

// SAFETY: `NcclHtParams` is `repr(C)`, plain old data, and matches the CUDA struct's layout
// (checked by the tests below and by a static_assert in nccl.cu).
unsafe impl DeviceRepr for NcclHtParams {}

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::{offset_of, size_of};

    #[test]
    fn tagged_dispatch_only_for_small_dispatches_over_nvlink() {
        let p = LlParams { num_tokens: 32, tag_dispatch_tokens: 32, max_tokens: 128, ..LlParams::default() };
        assert!(p.sends_tagged());
        assert!(LlParams { num_tokens: 0, ..p }.sends_tagged());
        assert!(!LlParams { num_tokens: 33, ..p }.sends_tagged());
        assert!(!LlParams { tag_dispatch_tokens: 8, num_tokens: 9, ..p }.sends_tagged());
        assert!(!LlParams { nccl_mask: 2, ..p }.sends_tagged());
        assert!(!LlParams { tag_dispatch_tokens: 0, num_tokens: 0, ..p }.sends_tagged());
        // Never past the tagged area's capacity, whatever the threshold says.
        assert!(!LlParams { tag_dispatch_tokens: 64, num_tokens: 40, ..p }.sends_tagged());
        assert!(!LlParams { max_tokens: 4, num_tokens: 5, ..p }.sends_tagged());
        // The combine's choice is separate.
        assert!(!LlParams { tag_tokens: 0, ..p }.tagged_rows());
        assert!(LlParams { tag_tokens: 0, ..p }.sends_tagged());
    }

    #[test]
    fn tagged_rows_only_for_small_combines_over_nvlink() {
        let p =
            LlParams { rank_major: 1, num_tokens: 32, tag_tokens: 32, num_ranks: 2, top_k: 8, ..LlParams::default() };
        assert!(p.tagged_rows());
        assert!(!LlParams { num_tokens: 33, ..p }.tagged_rows());
        assert!(!LlParams { nccl_mask: 2, ..p }.tagged_rows());
        assert!(!LlParams { tag_tokens: 0, num_tokens: 0, ..p }.tagged_rows());
        // Expert-major: K rows per token in the area's 32 x 2 rows.
        assert!(LlParams { rank_major: 0, num_tokens: 8, ..p }.tagged_rows());
        assert!(!LlParams { rank_major: 0, num_tokens: 9, ..p }.tagged_rows());
    }

    #[test]
    fn ht_layouts_match_the_cuda_structs() {
        assert_eq!(size_of::<HtParams>(), 400);
        assert_eq!(offset_of!(HtParams, helpers), 384);
        assert_eq!(offset_of!(HtParams, scale_cols), 392);
        assert_eq!(offset_of!(HtParams, stamp), 368);
        assert_eq!(offset_of!(HtParams, direct), 376);
        assert_eq!(offset_of!(HtParams, direct_mem), 380);
        assert_eq!(offset_of!(HtParams, peer_ring), 128);
        assert_eq!(offset_of!(HtParams, seq), 256);
        assert_eq!(offset_of!(HtParams, rank), 288);
        assert_eq!(offset_of!(HtParams, batch), 360);
        assert_eq!(size_of::<ExchangeParams>(), 208);
        assert_eq!(offset_of!(ExchangeParams, stamp), 200);
        assert_eq!(offset_of!(ExchangeParams, seq), 168);
        assert_eq!(offset_of!(ExchangeParams, rank), 184);
        assert_eq!(size_of::<HtPlanParams>(), 328);
        assert_eq!(offset_of!(HtPlanParams, peer_region), 112);
        assert_eq!(offset_of!(HtPlanParams, stamp), 256);
        assert_eq!(offset_of!(HtPlanParams, marks), 264);
        assert_eq!(offset_of!(HtPlanParams, rank), 280);
        assert_eq!(offset_of!(HtPlanParams, cancelled), 316);
        assert_eq!(offset_of!(HtPlanParams, mark_blocks), 320);
    }

    #[test]
    fn nccl_layout_matches_the_cuda_struct() {
        assert_eq!(size_of::<NcclHtParams>(), 200);
        assert_eq!(offset_of!(NcclHtParams, stamp), 192);
        assert_eq!(offset_of!(NcclHtParams, input), 88);
        assert_eq!(offset_of!(NcclHtParams, seq), 120);
        assert_eq!(offset_of!(NcclHtParams, rank), 128);
        assert_eq!(offset_of!(NcclHtParams, cancelled), 176);
    }

    #[test]
    fn signal_and_status_pages_match_common_cuh() {
        // EP_ARRIVAL_WORDS, EP_SIG_ARRAY_WORDS, EP_STATUS_STAMPS of common.cuh.
        assert_eq!(ARRIVAL_WORDS, 768);
        assert_eq!(SIG_ARRAY_WORDS, 768 + 11 * 16 * 8);
        assert_eq!(arrival_offset(1, 2, 3), ((16 + 2) * 8 + 3) * 16);
        assert_eq!(status::stamp(0, 0), 49);
        assert_eq!(status::outcome(2, 15), 48);
        assert_eq!(status::MASK, 97);
        assert_eq!(status::REJOIN, 98);
        assert_eq!(status::WORDS, 101);
    }

    #[test]
    fn layout_matches_the_cuda_struct() {
        assert_eq!(size_of::<LlParams>(), 536);
        assert_eq!(offset_of!(LlParams, x_scales), 512);
        assert_eq!(offset_of!(LlParams, fwd_token_bytes), 520);
        assert_eq!(offset_of!(LlParams, fwd_scale_bytes), 524);
        assert_eq!(offset_of!(LlParams, nvfp4), 528);
        assert_eq!(offset_of!(LlParams, send_slot), 472);
        assert_eq!(offset_of!(LlParams, send_rows), 480);
        assert_eq!(offset_of!(LlParams, trace), 456);
        assert_eq!(offset_of!(LlParams, tag_tokens), 460);
        assert_eq!(offset_of!(LlParams, tag_dispatch_tokens), 464);
        assert_eq!(offset_of!(LlParams, ret_list), 440);
        assert_eq!(offset_of!(LlParams, ret_count), 448);
        assert_eq!(offset_of!(LlParams, masking), 396);
        assert_eq!(offset_of!(LlParams, masked_out), 432);
        assert_eq!(size_of::<MaskParams>(), 136);
        assert_eq!(offset_of!(MaskParams, bits), 80);
        assert_eq!(offset_of!(MaskParams, next), 96);
        assert_eq!(offset_of!(MaskParams, rank), 128);
        assert_eq!(offset_of!(LlParams, seq_base), 400);
        assert_eq!(offset_of!(LlParams, verdict), 408);
        assert_eq!(offset_of!(LlParams, topk_src), 416);
        assert_eq!(offset_of!(LlParams, route_report), 424);
        assert_eq!(offset_of!(LlParams, recv_chunks), 392);
        assert_eq!(offset_of!(LlParams, stamp), 368);
        assert_eq!(offset_of!(LlParams, rank_major), 316);
        assert_eq!(offset_of!(LlParams, out_idx), 384);
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

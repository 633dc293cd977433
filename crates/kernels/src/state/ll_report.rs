//! The mapped report of invalid routing rows that a low-latency dispatch reading the caller's
//! `topk_idx` writes (`routed_entry` in `ll_send.cuh`): captured steps' dispatches
//! (`graph/handle.rs`) and the first dispatches on a handle created in stream order
//! (`ll/handle.rs`, `state/handle.rs`).

use epflow_core::ValidationError;

use crate::device::PinnedBuffer;

/// The first invalid row (lowest token) of `tokens` that a dispatch reading the caller's
/// `topk_idx` reported for `replay` (0 for eager dispatches) in `report` (`1 + 2B` mapped words,
/// `routed_entry` in `ll_send.cuh`: `[0]` replay + 1, per token `t` `[1 + t]` = (replay + 1) <<
/// 16 | (earlier k naming the same expert + 1) << 8 | k, `[1 + B + t]` the entry), as the
/// host's checks name it.
pub(crate) fn invalid_row_in(
    report: &PinnedBuffer,
    tokens: usize,
    replay: u64,
    num_experts: usize,
) -> Option<ValidationError> {
    if report.read_u64(0) != replay + 1 {
        return None;
    }
    let (token, w) = (0..tokens).map(|t| (t, report.read_u64(1 + t))).find(|(_, w)| w >> 16 == replay + 1)?;
    let (k, earlier) = ((w & 0xff) as usize, ((w >> 8) & 0xff) as i64 - 1);
    let value = report.read_u64(1 + tokens + token) as i64;
    Some(ValidationError::invalid_topk_entry(token, k, value, usize::try_from(earlier).ok(), num_experts))
}

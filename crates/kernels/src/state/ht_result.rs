//! The mapped words the plan kernels of a high-throughput handle built on the device write for the
//! host (`ep_ht_plan` in `ht_handle.cuh`): read by the creation ([`crate::ht`]'s plan) and, for a handle
//! handed out in stream order, by the operations on it ([`crate::state::handle`]).

use epflow_core::ValidationError;

use crate::device::PinnedBuffer;

/// Words of the mapped result before the rows per local expert: the first invalid entry, its
/// value, the earlier slot it repeats, `N`, and `seq + 1` once the handle is built.
pub(crate) const RESULT_HEAD: usize = 5;
/// The result's word holding `N`.
pub(crate) const RESULT_N: usize = 3;
/// The result's word the plan kernel sets to `seq + 1` once the handle is built (after every
/// array; zeroed before the launch).
pub(crate) const RESULT_BUILT: usize = 4;

/// The routing's first invalid entry in a plan's mapped `result`, as
/// [`epflow_core::routing::Routing::new`] would name it (read after the kernels completed). A
/// low-latency handle built on the device reports in the same three first words
/// (`ll/handle.rs`).
pub(crate) fn invalid_routing_in(r: &PinnedBuffer, top_k: usize, num_experts: usize) -> Option<ValidationError> {
    let pos = r.read_u64(0) as i64;
    if pos < 0 {
        return None;
    }
    let (token, k) = (pos as usize / top_k.max(1), pos as usize % top_k.max(1));
    let (value, first) = (r.read_u64(1) as i64, r.read_u64(2) as i64);
    Some(ValidationError::invalid_topk_entry(token, k, value, usize::try_from(first).ok(), num_experts))
}

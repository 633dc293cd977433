//! NVIDIA's test-only entry points (`nccl_ep_test_internal.h` of NVIDIA/nccl-extensions), so
//! that NVIDIA's own unit tests (`nccl_ep/tests`) link and run on this library. Not part of
//! NCCL EP's API: nothing but those tests should call them. That header declares them without
//! `extern "C"`, so NVIDIA's library exports them under their C++ (Itanium) names, and so does
//! this one (`ncclEpHandle_t` is `struct ncclEpHandle*`, `ncclEpGroup_t` `struct ncclEpGroup*`).
//!
//! What epflow can answer, it answers with NVIDIA's meaning: a handle's top-k, the group's
//! `max_dispatch_tokens_per_rank`, the ranks on this host, the local experts, and the rows a
//! high-throughput handle's outputs hold (after a DROP the rows kept; expert-major the zones'
//! slots). NVIDIA's internal state that epflow does not have (the sparse-to-dense map, the
//! low-latency combine's shared memory and warps) is reported as absent: NULL, `-1` or
//! `ncclInvalidUsage`, each with a log line, so that a test relying on it fails by name.

use std::ffi::{c_int, c_uint};

use epflow_core::Algorithm;
use nccl_ep_sys as ep;

use crate::api::{group, handle};
use crate::status::{Fail, entry, warn};

/// The symbols of this module's entry points (NVIDIA's C++ names), beside NCCL EP's 18 functions.
pub const NAMES: [&str; 9] = [
    "_Z37ncclEpHandle_test_getSparseToDenseMapP12ncclEpHandle",
    "_Z28ncclEpHandle_test_getNumTopkP12ncclEpHandle",
    "_Z37ncclEpHandle_test_getMaxTokensPerRankP12ncclEpHandle",
    "_Z34ncclEpHandle_test_getNRanksPerNodeP12ncclEpHandle",
    "_Z35ncclEpHandle_test_getExpertsPerRankP12ncclEpHandle",
    "_Z34ncclEpHandle_test_getNumRecvTokensP12ncclEpHandlePj",
    "_Z30ncclEpHandle_test_clearTopkIdxP12ncclEpHandle",
    "_Z34ncclEpGroup_test_setMaxDynamicSmemP11ncclEpGroupi",
    "_Z46ncclEpGroup_test_getLastLlCombineWarpsPerGroupP11ncclEpGroup",
];

/// An `int` answer about live handle `h`, or `-1` (logged) when `h` is not one.
fn handle_int(name: &str, h: ep::NcclEpHandle, answer: impl FnOnce(&crate::handle::Handle) -> usize) -> c_int {
    match handle(h) {
        Ok(h) => c_int::try_from(answer(&h)).unwrap_or(c_int::MAX),
        Err(f) => {
            warn(&format!("{name}: {}", f.message));
            -1
        }
    }
}

/// The handle's top-k (`-1` before its top-k is known).
#[unsafe(export_name = "_Z28ncclEpHandle_test_getNumTopkP12ncclEpHandle")]
pub extern "C" fn handle_num_topk(h: ep::NcclEpHandle) -> c_int {
    match handle(h) {
        Ok(h) => h.top_k().map_or(-1, |k| c_int::try_from(k).unwrap_or(c_int::MAX)),
        Err(f) => {
            warn(&format!("ncclEpHandle_test_getNumTopk: {}", f.message));
            -1
        }
    }
}

/// The group's `max_dispatch_tokens_per_rank`.
#[unsafe(export_name = "_Z37ncclEpHandle_test_getMaxTokensPerRankP12ncclEpHandle")]
pub extern "C" fn handle_max_tokens_per_rank(h: ep::NcclEpHandle) -> c_int {
    handle_int("ncclEpHandle_test_getMaxTokensPerRank", h, |h| h.group.shape.max_tokens)
}

/// The ranks of the group on this rank's host (reached over NVLink).
#[unsafe(export_name = "_Z34ncclEpHandle_test_getNRanksPerNodeP12ncclEpHandle")]
pub extern "C" fn handle_ranks_per_node(h: ep::NcclEpHandle) -> c_int {
    handle_int("ncclEpHandle_test_getNRanksPerNode", h, |h| {
        h.group.shape.num_ranks - h.group.rank.nccl_peers().count_ones() as usize
    })
}

/// The group's experts per rank (`L`).
#[unsafe(export_name = "_Z35ncclEpHandle_test_getExpertsPerRankP12ncclEpHandle")]
pub extern "C" fn handle_experts_per_rank(h: ep::NcclEpHandle) -> c_int {
    handle_int("ncclEpHandle_test_getExpertsPerRank", h, |h| h.group.shape.local_experts)
}

/// High-throughput: the rows the handle's dispatch outputs hold for its routing (flat: the
/// rows received, after a DROP the rows kept; expert-major: the zones' slots).
///
/// # Safety
///
/// `num_recv_tokens` is null or writable.
#[unsafe(export_name = "_Z34ncclEpHandle_test_getNumRecvTokensP12ncclEpHandlePj")]
pub unsafe extern "C" fn handle_num_recv_tokens(h: ep::NcclEpHandle, num_recv_tokens: *mut c_uint) -> ep::NcclResult {
    entry("ncclEpHandle_test_getNumRecvTokens", || {
        if num_recv_tokens.is_null() {
            return Err(Fail::arg("num_recv_tokens is NULL"));
        }
        let h = handle(h)?;
        if h.group.shape.algorithm != Algorithm::HighThroughput {
            return Err(Fail::usage("a high-throughput handle's count (this handle is low-latency)"));
        }
        let rows = c_uint::try_from(h.output_rows()?).map_err(|_| Fail::arg("more rows than an unsigned int"))?;
        // SAFETY: non-null and writable (the caller's contract).
        unsafe { *num_recv_tokens = rows };
        Ok(())
    })
}

/// NVIDIA's sparse-to-dense map: epflow has none (NULL, logged).
#[unsafe(export_name = "_Z37ncclEpHandle_test_getSparseToDenseMapP12ncclEpHandle")]
pub extern "C" fn handle_sparse_to_dense_map(_h: ep::NcclEpHandle) -> *const i32 {
    warn("ncclEpHandle_test_getSparseToDenseMap: NVIDIA's internal map; epflow's library has none (NULL)");
    std::ptr::null()
}

/// NVIDIA's handle forgets its `topk_idx` address: epflow's handles keep their routing in
/// their own memory, so there is nothing to forget (logged).
#[unsafe(export_name = "_Z30ncclEpHandle_test_clearTopkIdxP12ncclEpHandle")]
pub extern "C" fn handle_clear_topk_idx(_h: ep::NcclEpHandle) {
    warn("ncclEpHandle_test_clearTopkIdx: epflow's handles keep no caller topk_idx to clear (nothing done)");
}

/// NVIDIA's low-latency combine's shared-memory bound: epflow's kernels have no such knob
/// (`ncclInvalidUsage`).
#[unsafe(export_name = "_Z34ncclEpGroup_test_setMaxDynamicSmemP11ncclEpGroupi")]
pub extern "C" fn group_set_max_dynamic_smem(g: ep::NcclEpGroup, _max_dynamic_smem: c_int) -> ep::NcclResult {
    entry("ncclEpGroup_test_setMaxDynamicSmem", || {
        group(g)?;
        Err(Fail::usage("NVIDIA's low-latency combine's shared-memory bound: epflow's kernels have no such setting"))
    })
}

/// NVIDIA's low-latency combine's warps per group: epflow's kernels have none (`-1`, logged).
#[unsafe(export_name = "_Z46ncclEpGroup_test_getLastLlCombineWarpsPerGroupP11ncclEpGroup")]
pub extern "C" fn group_last_ll_combine_warps_per_group(_g: ep::NcclEpGroup) -> c_int {
    warn("ncclEpGroup_test_getLastLlCombineWarpsPerGroup: NVIDIA's kernel setting; epflow's has none (-1)");
    -1
}

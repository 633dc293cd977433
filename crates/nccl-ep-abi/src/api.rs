//! The exported C functions of `nccl_ep.h` (NCCL EP 0.1.0): each checks its pointers, runs its
//! body through `entry` (no panic crosses into C) and returns an `ncclResult_t`.
//!
//! `ncclEpGroup_t` and `ncclEpHandle_t` are tokens of the live groups and handles
//! (`live.rs`): every call looks its token up first, so a destroyed (or foreign) value is
//! `ncclInvalidArgument` with a log line, never memory read after it was freed. Collective calls
//! must be made by every rank in the same order, as NCCL EP requires.

use std::ffi::{c_int, c_uint};
use std::sync::Arc;

use epflow_core::{DType, HostData, HostTensor, TensorDesc, TensorTag};
use epflow_kernels::DeviceTensor;
use nccl_ep_sys as ep;

use crate::check;
use crate::expert_major::alignment_of;
use crate::group::Group;
use crate::handle::{HANDLE_MEM_BYTES, Handle, layout_of, sync_stream};
use crate::live::Registry;
use crate::status::{Fail, Res, entry, warn};

/// Marks this library as epflow's (see [`ep::EPFLOW_MARKER`]): NCCL EP's version code.
#[unsafe(export_name = "epflowNcclEpAbiVersion")]
pub static EPFLOW_NCCL_EP_ABI_VERSION: c_int = ep::NCCL_EP_VERSION_CODE;

/// The live groups, by the `ncclEpGroup_t` token handed out.
static GROUPS: Registry<Group> = Registry::new("group");
/// The live handles, by the `ncclEpHandle_t` token handed out.
static HANDLES: Registry<Handle> = Registry::new("handle");

/// The live group `g` (`ncclInvalidArgument` for NULL, a destroyed or a foreign value).
pub(crate) fn group(g: ep::NcclEpGroup) -> Res<Arc<Group>> {
    GROUPS.get(g.addr(), "ep_group")
}

/// The live handle `h`, whose group is live too.
pub(crate) fn handle(h: ep::NcclEpHandle) -> Res<Arc<Handle>> {
    let h = HANDLES.get(h.addr(), "handle")?;
    h.group.check_not_destroyed()?;
    Ok(h)
}

/// Runs `f`, an API call on handle `h`, with `h`'s group resolving the NCCL window tensors it
/// reads (`window.rs`).
fn within<R>(h: &Handle, f: impl FnOnce() -> R) -> R {
    crate::window::within(Arc::clone(&h.group) as Arc<dyn crate::window::WindowBase>, f)
}

/// Registers a new group and returns the `ncclEpGroup_t` the caller gets.
fn new_group(g: Arc<Group>) -> Res<ep::NcclEpGroup> {
    GROUPS.insert(g).map(std::ptr::without_provenance_mut)
}

/// Registers a new handle and returns the `ncclEpHandle_t` the caller gets.
fn new_handle(h: Handle) -> Res<ep::NcclEpHandle> {
    HANDLES.insert(Arc::new(h)).map(std::ptr::without_provenance_mut)
}

fn out_ptr<T>(p: *mut T, what: &str) -> Res<()> {
    if p.is_null() { Err(Fail::arg(format!("{what} is NULL"))) } else { Ok(()) }
}

/// `ncclEpGetVersion`: writes `NCCL_EP_VERSION_CODE` of the API this library implements
/// (0.1.0 = 100).
///
/// # Safety
///
/// `version` is null or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclEpGetVersion(version: *mut c_int) -> ep::NcclResult {
    entry("ncclEpGetVersion", || {
        out_ptr(version, "version")?;
        // SAFETY: non-null and writable (contract).
        unsafe { *version = ep::NCCL_EP_VERSION_CODE };
        Ok(())
    })
}

/// `ncclEpTensorAlloc`: a library-owned descriptor (no device memory; set `data`).
///
/// # Safety
///
/// See `nccl_ep.h`: `tensor` writable, `sizes` with `ndim` entries, `config` null or readable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclEpTensorAlloc(
    tensor: *mut *mut ep::NcclEpTensor,
    ndim: c_uint,
    datatype: ep::NcclDataType,
    sizes: *const usize,
    config: *const ep::NcclEpTensorAllocConfig,
) -> ep::NcclResult {
    // SAFETY: forwarded contract.
    entry("ncclEpTensorAlloc", || unsafe { crate::tensor::alloc(tensor, ndim, datatype, sizes, config) })
}

/// `ncclEpTensorDestroy`: frees a descriptor from `ncclEpTensorAlloc` (never its data).
///
/// # Safety
///
/// `tensor` is null or a descriptor from `ncclEpTensorAlloc`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclEpTensorDestroy(tensor: *mut ep::NcclEpTensor) -> ep::NcclResult {
    // SAFETY: forwarded contract.
    entry("ncclEpTensorDestroy", || unsafe { crate::tensor::destroy(tensor) })
}

/// `ncclEpCreateGroup` (collective over `comm`).
///
/// # Safety
///
/// `ep_group` writable, `comm` a live communicator, `config` null or readable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclEpCreateGroup(
    ep_group: *mut ep::NcclEpGroup,
    comm: ep::NcclComm,
    config: *const ep::NcclEpGroupConfig,
) -> ep::NcclResult {
    entry("ncclEpCreateGroup", || {
        out_ptr(ep_group, "ep_group")?;
        if comm.is_null() {
            return Err(Fail::arg("comm is NULL"));
        }
        // SAFETY: forwarded contract.
        let c = unsafe { check::required(config, "config") }?;
        let g = new_group(Group::create(comm, &c)?)?;
        // SAFETY: writable (checked non-null; contract).
        unsafe { *ep_group = g };
        Ok(())
    })
}

/// `ncclEpGroupDestroy` (collective): waits for the group's operations and for every rank. A
/// group destroyed already is `ncclInvalidArgument`; handles of a destroyed group refuse every
/// call but their destroy.
///
/// # Safety
///
/// No call on `ep_group` runs concurrently (any value is checked against the live groups).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclEpGroupDestroy(ep_group: ep::NcclEpGroup) -> ep::NcclResult {
    entry("ncclEpGroupDestroy", || {
        let g = GROUPS.remove(ep_group.addr(), "ep_group")?;
        g.mark_destroyed();
        if Arc::strong_count(&g) > 1 {
            warn("ncclEpGroupDestroy: handles of the group are still alive; destroy them first");
        }
        g.shut_down()
    })
}

/// `ncclEpHandleMemSize`: epflow keeps the handle's routing in its own memory; this reports a
/// small fixed size so callers that allocate `handle_mem` keep working.
///
/// # Safety
///
/// `ep_group` live; `config` null or readable; `size_out` writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclEpHandleMemSize(
    ep_group: ep::NcclEpGroup,
    layout: ep::NcclEpLayout,
    config: *const ep::NcclEpHandleConfig,
    size_out: *mut usize,
    num_topk: c_int,
) -> ep::NcclResult {
    entry("ncclEpHandleMemSize", || {
        let g = group(ep_group)?;
        out_ptr(size_out, "size_out")?;
        // SAFETY: forwarded contract.
        unsafe { check::api_struct(config, "config") }?;
        layout_of(g.shape.algorithm, layout)?;
        top_k_arg(&g, num_topk)?;
        // SAFETY: writable (checked; contract).
        unsafe { *size_out = HANDLE_MEM_BYTES };
        Ok(())
    })
}

/// `num_topk` of `ncclEpInitHandle`/`ncclEpHandleMemSize`: required (1..=16) for low-latency;
/// high-throughput may pass -1; at most the group config's `num_topk` (API v2) when set.
fn top_k_arg(g: &Group, num_topk: c_int) -> Res<Option<usize>> {
    match (g.shape.algorithm, num_topk) {
        (epflow_core::Algorithm::HighThroughput, k) if k <= 0 => Ok(None),
        (_, k) if k >= 1 && k as usize <= epflow_core::config::MAX_TOP_K => {
            g.shape.check_top_k(k as usize)?;
            Ok(Some(k as usize))
        }
        (_, k) => Err(Fail::arg(format!("num_topk is {k}: must be 1 to {}", epflow_core::config::MAX_TOP_K))),
    }
}

/// `ncclEpInitHandle`: a handle of `layout` with no routing yet.
///
/// # Safety
///
/// `handle` writable; `ep_group` live; `config` and `handle_mem` null or readable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclEpInitHandle(
    handle: *mut ep::NcclEpHandle,
    ep_group: ep::NcclEpGroup,
    layout: ep::NcclEpLayout,
    config: *const ep::NcclEpHandleConfig,
    num_topk: c_int,
    handle_mem: *const ep::NcclEpTensor,
) -> ep::NcclResult {
    entry("ncclEpInitHandle", || {
        out_ptr(handle, "handle")?;
        let g = group(ep_group)?;
        // SAFETY: forwarded contract.
        let cfg = unsafe { check::api_struct(config, "config") }?;
        // SAFETY: forwarded contract.
        if let Some(m) = unsafe { check::tensor(handle_mem, "handle_mem") }? {
            m.expect_type("handle_mem", ep::NCCL_UINT8)?;
            if m.numel() < HANDLE_MEM_BYTES {
                return Err(Fail::arg(format!(
                    "handle_mem has {} bytes, ncclEpHandleMemSize asks {HANDLE_MEM_BYTES}",
                    m.numel()
                )));
            }
        }
        let l = layout_of(g.shape.algorithm, layout)?;
        let em = alignment_of(g.shape.algorithm, layout, cfg.as_ref())?;
        let k = top_k_arg(&g, num_topk)?;
        let h = new_handle(Handle::new(Arc::clone(&g), l, k, em)?)?;
        // SAFETY: writable (checked; contract).
        unsafe { *handle = h };
        Ok(())
    })
}

/// `ncclEpUpdateHandle`: binds the routing `topk_idx` (int64 `[B x K]`); collective for
/// high-throughput. Synchronizes `stream` first.
///
/// # Safety
///
/// `handle` live; `topk_idx` and `layout_info` null or readable; `stream` live.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclEpUpdateHandle(
    handle: ep::NcclEpHandle,
    topk_idx: *const ep::NcclEpTensor,
    layout_info: *const ep::NcclEpLayoutInfo,
    stream: ep::CudaStream,
) -> ep::NcclResult {
    entry("ncclEpUpdateHandle", || {
        let h = self::handle(handle)?;
        // SAFETY: forwarded contract.
        within(&h, || unsafe { h.update(topk_idx, layout_info, stream) })
    })
}

/// `ncclEpCreateHandle`: `ncclEpInitHandle` then `ncclEpUpdateHandle`.
///
/// # Safety
///
/// As those two.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclEpCreateHandle(
    handle: *mut ep::NcclEpHandle,
    ep_group: ep::NcclEpGroup,
    layout: ep::NcclEpLayout,
    topk_idx: *const ep::NcclEpTensor,
    layout_info: *const ep::NcclEpLayoutInfo,
    config: *const ep::NcclEpHandleConfig,
    stream: ep::CudaStream,
) -> ep::NcclResult {
    entry("ncclEpCreateHandle", || {
        out_ptr(handle, "handle")?;
        let g = group(ep_group)?;
        // SAFETY: forwarded contract.
        let cfg = unsafe { check::api_struct(config, "config") }?;
        let l = layout_of(g.shape.algorithm, layout)?;
        let em = alignment_of(g.shape.algorithm, layout, cfg.as_ref())?;
        let h = Handle::new(Arc::clone(&g), l, None, em)?;
        // SAFETY: forwarded contract.
        within(&h, || unsafe { h.update(topk_idx, layout_info, stream) })?;
        let h = new_handle(h)?;
        // SAFETY: writable (checked; contract).
        unsafe { *handle = h };
        Ok(())
    })
}

/// `ncclEpHandleDestroy`: a handle destroyed already is `ncclInvalidArgument`. A handle whose
/// group was destroyed first is freed (with a log line).
///
/// # Safety
///
/// No call on `handle` runs concurrently (any value is checked against the live handles).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclEpHandleDestroy(handle: ep::NcclEpHandle) -> ep::NcclResult {
    entry("ncclEpHandleDestroy", || {
        let h = HANDLES.remove(handle.addr(), "handle")?;
        if h.group.check_not_destroyed().is_err() {
            warn("ncclEpHandleDestroy: the handle's group was destroyed before it; freeing the handle");
            return Ok(());
        }
        h.destroy()
    })
}

/// `ncclEpDispatch` (collective), in `stream`'s order.
///
/// # Safety
///
/// As `nccl_ep.h`: live handle and stream, readable structs, tensors of live device memory.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclEpDispatch(
    handle: ep::NcclEpHandle,
    inputs: *const ep::NcclEpDispatchInputs,
    outputs: *const ep::NcclEpDispatchOutputs,
    layout_info: *const ep::NcclEpLayoutInfo,
    config: *const ep::NcclEpDispatchConfig,
    stream: ep::CudaStream,
) -> ep::NcclResult {
    entry("ncclEpDispatch", || {
        let h = self::handle(handle)?;
        // SAFETY: forwarded contract.
        within(&h, || unsafe { crate::ops::dispatch(&h, inputs, outputs, layout_info, config, stream) })
    })
}

/// `ncclEpCombine` (collective), in `stream`'s order.
///
/// # Safety
///
/// As [`ncclEpDispatch`].
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclEpCombine(
    handle: ep::NcclEpHandle,
    inputs: *const ep::NcclEpCombineInputs,
    outputs: *const ep::NcclEpCombineOutputs,
    config: *const ep::NcclEpCombineConfig,
    stream: ep::CudaStream,
) -> ep::NcclResult {
    entry("ncclEpCombine", || {
        let h = self::handle(handle)?;
        // SAFETY: forwarded contract.
        within(&h, || unsafe { crate::ops::combine(&h, inputs, outputs, config, stream) })
    })
}

/// `ncclEpComplete`: the receive of a `send_only` operation, in `stream`'s order (a no-op when
/// none is pending).
///
/// # Safety
///
/// Live handle and stream; `config` null or readable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclEpComplete(
    handle: ep::NcclEpHandle,
    config: *const ep::NcclEpCompleteConfig,
    stream: ep::CudaStream,
) -> ep::NcclResult {
    entry("ncclEpComplete", || {
        let h = self::handle(handle)?;
        // SAFETY: forwarded contract.
        unsafe { crate::ops::complete_staged(&h, config, stream) }
    })
}

/// `ncclEpMaskQuery`: writes, per rank, 1 (active) or 0 (masked) into the caller's device
/// `int[nRanks]` `mask_status`, in `stream`'s order (it waits for the stream's earlier work, then
/// copies this rank's view of the mask). Needs `enable_mask`.
///
/// # Safety
///
/// `ep_group` live; `mask_status` a device pointer to `nRanks` ints on the group's GPU;
/// `stream` live.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclEpMaskQuery(
    ep_group: ep::NcclEpGroup,
    mask_status: *mut c_int,
    stream: ep::CudaStream,
) -> ep::NcclResult {
    entry("ncclEpMaskQuery", || {
        let g = group(ep_group)?;
        g.require_masking("ncclEpMaskQuery")?;
        out_ptr(mask_status, "mask_status")?;
        let status = g.mask_status();
        sync_stream(stream, "ncclEpMaskQuery")?;
        let desc = TensorDesc::contiguous(TensorTag::MaskedEntries, DType::I32, &[status.len()]);
        // SAFETY: `mask_status` holds `nRanks` ints on the group's GPU (contract).
        let out = unsafe { DeviceTensor::from_raw(mask_status as u64, g.rank.device(), desc.clone()) };
        let host = HostTensor::new(desc.tag, &desc.shape, HostData::I32(status));
        out.copy_from_host(g.rank.context(), &host).map_err(Fail::from)
    })
}

/// `ncclEpMaskUpdate`: masks, on every rank, the ranks at 0 in the host `int[nRanks]` `mask`
/// (1: active); later operations skip them. It acts at once (not in `stream`'s order). A masked
/// rank cannot be marked active again here (`ncclInvalidUsage`): `ncclEpMaskClean` does that.
/// Needs `enable_mask`.
///
/// # Safety
///
/// `ep_group` live; `mask` readable for `nRanks` ints.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclEpMaskUpdate(
    ep_group: ep::NcclEpGroup,
    mask: *const c_int,
    _stream: ep::CudaStream,
) -> ep::NcclResult {
    entry("ncclEpMaskUpdate", || {
        let g = group(ep_group)?;
        g.require_masking("ncclEpMaskUpdate")?;
        if mask.is_null() {
            return Err(Fail::arg("mask is NULL"));
        }
        // SAFETY: readable for nRanks ints (contract; checked non-null).
        let update = unsafe { std::slice::from_raw_parts(mask, g.shape.num_ranks) };
        g.mask_update(update)
    })
}

/// `ncclEpMaskClean`: clears the mask of every rank. In epflow it is a collective of **every**
/// rank of the group, the masked ones included (NCCL EP's is the survivors'), with no operation
/// in flight; it returns once all have met (or fails after the group's timeout), and the full
/// group is bit-exact again. It leaves the `ncclEpGetAsyncError` flag as it is. Needs
/// `enable_mask`.
///
/// # Safety
///
/// `ep_group` live; `stream` live.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclEpMaskClean(ep_group: ep::NcclEpGroup, stream: ep::CudaStream) -> ep::NcclResult {
    entry("ncclEpMaskClean", || {
        let g = group(ep_group)?;
        g.require_masking("ncclEpMaskClean")?;
        sync_stream(stream, "ncclEpMaskClean")?;
        g.mask_clean()
    })
}

/// `ncclEpGetAsyncError`: 1 once the group failed (a timeout, a failed peer; every later call
/// then returns `ncclRemoteError`), or with `enable_mask` once a timeout masked a rank, until
/// `ncclEpErrorClear`. Works without `enable_mask` too.
///
/// # Safety
///
/// `ep_group` live; `error_out` writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclEpGetAsyncError(ep_group: ep::NcclEpGroup, error_out: *mut c_int) -> ep::NcclResult {
    entry("ncclEpGetAsyncError", || {
        let g = group(ep_group)?;
        out_ptr(error_out, "error_out")?;
        // SAFETY: writable (checked; contract).
        unsafe { *error_out = g.async_error() };
        Ok(())
    })
}

/// `ncclEpErrorClear`: re-arms `ncclEpGetAsyncError` (a failed group stays failed, masked ranks
/// stay masked).
///
/// # Safety
///
/// `ep_group` live.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclEpErrorClear(ep_group: ep::NcclEpGroup) -> ep::NcclResult {
    entry("ncclEpErrorClear", || group(ep_group).map(|g| g.clear_error()))
}

//! The checks at the API boundary, as `nccl_ep.h` states them: every struct (each headed by
//! `size` and `magic`, [`ApiStruct`]) must have this
//! library's `sizeof` and its `magic` [`ep::NCCL_EP_MAGIC`]; tensors carry
//! [`ep::NCCL_EP_TENSOR_MAGIC`] (or [`crate::owned::DYNAMIC_MAGIC`] when
//! `ncclEpTensorAlloc` made them), a rank, a type, an address and sizes. Failures are
//! `ncclInvalidArgument`.

use std::ffi::c_uint;

use nccl_ep_sys as ep;

use crate::status::{Fail, Res};

/// A struct headed by `size` and `magic`, as the caller's header declares it: this library
/// reads it into [`ApiStruct::Read`] (the newest layout it knows), taking only the bytes the
/// caller's `size` covers and zero for the rest (NVIDIA's append-only rule).
pub(crate) trait ApiStruct: Sized {
    /// The C name, for messages.
    const NAME: &'static str;
    /// The newest layout this library reads (a `repr(C)` struct whose every field is valid when
    /// all zero: integers, raw pointers, `Option` of function pointers).
    type Read: Copy;
    /// The accepted `size`s, each with the bytes of the caller's struct that hold fields of
    /// [`ApiStruct::Read`] (smaller than the size where the layout ends in padding that a later
    /// layout gave a field: NCCL 2.31's 104-byte group config), oldest first.
    const LAYOUTS: &'static [(c_uint, usize, &'static str)];
}

macro_rules! api_structs {
    ($($t:ident => $name:literal, $read:ty, [$(($size:expr, $bytes:expr, $what:literal)),+]);* $(;)?) => {
        $(impl ApiStruct for ep::$t {
            const NAME: &'static str = $name;
            type Read = $read;
            const LAYOUTS: &'static [(c_uint, usize, &'static str)] = &[$(($size, $bytes, $what)),+];
        })*
    };
}

use crate::v2;

api_structs!(
    NcclEpGroupConfig => "ncclEpGroupConfig_t", v2::GroupConfig,
        [(96, 96, "API v1"), (104, 100, "NCCL 2.31 dev (API v1 + zero_copy)"), (112, 112, "API v2")];
    NcclEpLayoutInfo => "ncclEpLayoutInfo_t", v2::LayoutInfo, [(40, 40, "API v1"), (48, 48, "API v2")];
    NcclEpDispatchInputs => "ncclEpDispatchInputs_t", ep::NcclEpDispatchInputs, [(32, 32, "API v1 and v2")];
    NcclEpDispatchOutputs => "ncclEpDispatchOutputs_t", ep::NcclEpDispatchOutputs, [(40, 40, "API v1 and v2")];
    NcclEpCombineInputs => "ncclEpCombineInputs_t", v2::CombineInputs, [(24, 24, "API v1"), (32, 32, "API v2")];
    NcclEpCombineOutputs => "ncclEpCombineOutputs_t", ep::NcclEpCombineOutputs, [(24, 24, "API v1 and v2")];
    NcclEpHandleConfig => "ncclEpHandleConfig_t", ep::NcclEpHandleConfig, [(16, 16, "API v1 and v2")];
    NcclEpDispatchConfig => "ncclEpDispatchConfig_t", v2::DispatchConfig, [(20, 20, "API v1"), (24, 24, "API v2")];
    NcclEpCombineConfig => "ncclEpCombineConfig_t", v2::CombineConfig, [(16, 16, "API v1"), (20, 20, "API v2")];
    NcclEpCompleteConfig => "ncclEpCompleteConfig_t", ep::NcclEpCompleteConfig, [(8, 8, "API v1 and v2")];
    NcclEpTensorAllocConfig => "ncclEpTensorAllocConfig_t", ep::NcclEpTensorAllocConfig, [(8, 8, "API v1 and v2")];
);

/// Checks `size` and `magic` of the struct at `p` and reads it (see [`ApiStruct`]); `None` for
/// a null pointer (an optional argument: the caller decides whether null is allowed). A `size`
/// that is none of [`ApiStruct::LAYOUTS`] is `ncclInvalidArgument`, with the sizes accepted.
///
/// # Safety
///
/// `p` is null or points to a readable struct of its `size` bytes (the caller's struct, as the
/// C API requires).
pub(crate) unsafe fn api_struct<T: ApiStruct>(p: *const T, what: &str) -> Res<Option<T::Read>> {
    if p.is_null() {
        return Ok(None);
    }
    // SAFETY: the caller guarantees a readable struct; only its first 8 bytes (size and magic,
    // in every layout) are read before the size is known.
    let (size, magic) = unsafe { *(p as *const (c_uint, c_uint)) };
    let Some(&(_, bytes, _)) = T::LAYOUTS.iter().find(|l| l.0 == size) else {
        let known: Vec<String> = T::LAYOUTS.iter().map(|(s, _, v)| format!("{s} ({v})")).collect();
        return Err(Fail::arg(format!(
            "{what}: {}.size is {size}; this library reads sizes {} (built against another nccl_ep.h?)",
            T::NAME,
            known.join(", ")
        )));
    };
    if magic != ep::NCCL_EP_MAGIC {
        return Err(Fail::arg(format!(
            "{what}: {}.magic is {magic:#x}, not NCCL_EP_MAGIC ({:#x}): initialise it with its _INIT macro",
            T::NAME,
            ep::NCCL_EP_MAGIC
        )));
    }
    let bytes = bytes.min(std::mem::size_of::<T::Read>());
    let mut out = std::mem::MaybeUninit::<T::Read>::zeroed();
    // SAFETY: the caller's struct has `size >= bytes` readable bytes (a layout of that size);
    // `out` has room for `bytes` (clamped to its size) and does not overlap the caller's memory.
    unsafe { std::ptr::copy_nonoverlapping(p as *const u8, out.as_mut_ptr() as *mut u8, bytes) };
    // SAFETY: every field of `T::Read` is valid all-zero (the trait's contract), and the bytes
    // copied over the zeros are the caller's values of the same fields in the same layout.
    Ok(Some(unsafe { out.assume_init() }))
}

/// [`api_struct`] for a required argument: null is `ncclInvalidArgument`.
///
/// # Safety
///
/// As [`api_struct`].
pub(crate) unsafe fn required<T: ApiStruct>(p: *const T, what: &str) -> Res<T::Read> {
    // SAFETY: forwarded contract.
    unsafe { api_struct(p, what) }?.ok_or_else(|| Fail::arg(format!("{what} is NULL")))
}

/// A checked tensor descriptor: where the data is, its element type and its sizes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Tensor {
    /// Device address.
    pub(crate) ptr: u64,
    /// Element type (NCCL's code).
    pub(crate) datatype: ep::NcclDataType,
    /// Per-dimension sizes.
    pub(crate) sizes: Vec<usize>,
    /// Whether the storage is an NCCL window (`win_hdl`, `window.rs`), not `data`.
    pub(crate) windowed: bool,
}

/// The most dimensions a descriptor may have.
pub(crate) const MAX_DIMS: usize = 8;

impl Tensor {
    /// Elements.
    pub(crate) fn numel(&self) -> usize {
        self.sizes.iter().product()
    }

    /// Requires element type `want`.
    pub(crate) fn expect_type(&self, what: &str, want: ep::NcclDataType) -> Res<()> {
        if self.datatype != want {
            return Err(Fail::usage(format!(
                "{what}: data type is {}, expected {}",
                type_name(self.datatype),
                type_name(want)
            )));
        }
        Ok(())
    }

    /// Requires exactly these sizes.
    pub(crate) fn expect_sizes(&self, what: &str, want: &[usize]) -> Res<()> {
        if self.sizes != want {
            return Err(Fail::usage(format!("{what}: sizes are {:?}, expected {want:?}", self.sizes)));
        }
        Ok(())
    }
}

/// Requires a 16-byte aligned device address (rows move in 16-byte vectors).
pub(crate) fn aligned16(what: &str, ptr: u64) -> Res<()> {
    aligned(what, ptr, 16)
}

/// Requires a device address aligned to `bytes` (a power of two).
pub(crate) fn aligned(what: &str, ptr: u64, bytes: u64) -> Res<()> {
    if ptr % bytes != 0 {
        return Err(Fail::arg(format!("{what}: address {ptr:#x} is not {bytes}-byte aligned")));
    }
    Ok(())
}

/// NCCL's name of a data type.
pub(crate) fn type_name(t: ep::NcclDataType) -> &'static str {
    match t {
        ep::NCCL_INT8 => "ncclInt8",
        ep::NCCL_UINT8 => "ncclUint8",
        ep::NCCL_INT32 => "ncclInt32",
        ep::NCCL_UINT32 => "ncclUint32",
        ep::NCCL_INT64 => "ncclInt64",
        ep::NCCL_FLOAT16 => "ncclFloat16",
        ep::NCCL_FLOAT32 => "ncclFloat32",
        ep::NCCL_BFLOAT16 => "ncclBfloat16",
        ep::NCCL_FLOAT8_E4M3 => "ncclFloat8e4m3",
        ep::NCCL_FLOAT8_E5M2 => "ncclFloat8e5m2",
        ep::NCCL_FLOAT4X2 => "ncclFloat4x2",
        _ => "an unknown type",
    }
}

/// Bytes of one element of an NCCL data type (`None`: not one this library knows).
pub(crate) fn element_bytes(t: ep::NcclDataType) -> Option<usize> {
    match t {
        // `ncclFloat4x2` (API v2): a byte holds two FP4 values; sizes count bytes.
        ep::NCCL_INT8 | ep::NCCL_UINT8 | ep::NCCL_FLOAT8_E4M3 | ep::NCCL_FLOAT8_E5M2 | ep::NCCL_FLOAT4X2 => Some(1),
        ep::NCCL_FLOAT16 | ep::NCCL_BFLOAT16 => Some(2),
        ep::NCCL_INT32 | ep::NCCL_UINT32 | ep::NCCL_FLOAT32 => Some(4),
        ep::NCCL_INT64 => Some(8),
        _ => None,
    }
}

/// Checks the descriptor at `p`; `None` for null.
///
/// # Safety
///
/// `p` is null or points to a readable `ncclEpTensor_t` whose `sizes` (when non-null) has
/// `ndim` readable entries.
pub(crate) unsafe fn tensor(p: *const ep::NcclEpTensor, what: &str) -> Res<Option<Tensor>> {
    if p.is_null() {
        return Ok(None);
    }
    // SAFETY: the caller guarantees a readable descriptor (first the 8-byte header).
    let (size, magic) = unsafe { *(p as *const (c_uint, c_uint)) };
    let want = std::mem::size_of::<ep::NcclEpTensor>() as c_uint;
    if size != want {
        return Err(Fail::arg(format!("{what}: ncclEpTensor_t.size is {size}, expected {want}")));
    }
    if magic != ep::NCCL_EP_TENSOR_MAGIC && magic != crate::owned::DYNAMIC_MAGIC {
        return Err(Fail::arg(format!(
            "{what}: ncclEpTensor_t.magic is {magic:#x}: initialise it with NCCL_EP_TENSOR_INIT (or use ncclEpTensorAlloc)"
        )));
    }
    // SAFETY: size and magic match: a whole descriptor.
    let t = unsafe { &*p };
    let ndim = t.ndim as usize;
    if ndim == 0 || ndim > MAX_DIMS {
        return Err(Fail::arg(format!("{what}: ndim is {ndim}, must be 1 to {MAX_DIMS}")));
    }
    if t.sizes.is_null() {
        return Err(Fail::arg(format!("{what}: sizes is NULL")));
    }
    if magic == crate::owned::DYNAMIC_MAGIC && !crate::owned::sizes_intact(t) {
        return Err(Fail::arg(format!(
            "{what}: the sizes pointer of a tensor from ncclEpTensorAlloc was overwritten (write into its sizes array instead)"
        )));
    }
    if element_bytes(t.datatype).is_none() {
        return Err(Fail::arg(format!("{what}: datatype {} is not an NCCL data type", t.datatype)));
    }
    // SAFETY: non-null with `ndim` entries (the caller's contract).
    let sizes = unsafe { std::slice::from_raw_parts(t.sizes, ndim) }.to_vec();
    // An empty tensor (a zero extent) needs no storage: frameworks hand out null for it. A
    // window tensor (no `data`, a `win_hdl`) addresses its window at `win_offset` (`window.rs`).
    let empty = sizes.contains(&0);
    let (ptr, windowed) = match (t.data.is_null(), t.win_hdl.is_null()) {
        (false, _) => (t.data as u64, false),
        (true, false) if !empty => (crate::window::address(t.win_hdl, t.win_offset, what)?, true),
        (true, _) if empty => (0, !t.win_hdl.is_null()),
        _ => return Err(Fail::arg(format!("{what}: data is NULL (and no win_hdl)"))),
    };
    Ok(Some(Tensor { ptr, datatype: t.datatype, sizes, windowed }))
}

/// [`tensor`] for a required argument.
///
/// # Safety
///
/// As [`tensor`].
pub(crate) unsafe fn required_tensor(p: *const ep::NcclEpTensor, what: &str) -> Res<Tensor> {
    // SAFETY: forwarded contract.
    unsafe { tensor(p, what) }?.ok_or_else(|| Fail::arg(format!("{what} is NULL")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alignment_is_checked_to_the_asked_bytes() {
        assert!(aligned("s", 0x1004, 4).is_ok());
        assert_eq!(aligned("s", 0x1006, 4).unwrap_err().code, ep::NCCL_INVALID_ARGUMENT);
        let e = aligned16("outputs.scales", 0x1004).unwrap_err();
        assert!(e.message.contains("outputs.scales: address 0x1004 is not 16-byte aligned"), "{}", e.message);
        assert!(aligned16("t", 0x1010).is_ok());
    }

    #[test]
    fn api_v2_types_are_known_bytes() {
        // ncclFloat8e5m2 and API v2's ncclFloat4x2 (two FP4 values a byte) describe bytes.
        assert_eq!(element_bytes(ep::NCCL_FLOAT8_E5M2), Some(1));
        assert_eq!(element_bytes(ep::NCCL_FLOAT4X2), Some(1));
        assert_eq!(type_name(ep::NCCL_FLOAT4X2), "ncclFloat4x2");
        assert_eq!(element_bytes(13), None);
    }

    #[test]
    fn structs_need_size_and_magic() {
        let ok = ep::NcclEpDispatchConfig::default();
        // SAFETY: pointers to live structs of their size.
        unsafe {
            assert_eq!(api_struct(&ok, "config").unwrap().unwrap().v1.size, 20);
            assert!(api_struct(std::ptr::null::<ep::NcclEpDispatchConfig>(), "config").unwrap().is_none());
            let bad_size = ep::NcclEpDispatchConfig { size: 16, ..ok };
            let e = api_struct(&bad_size, "config").unwrap_err();
            assert_eq!(e.code, ep::NCCL_INVALID_ARGUMENT);
            assert!(
                e.message.contains("size is 16; this library reads sizes 20 (API v1), 24 (API v2)"),
                "{}",
                e.message
            );
            let bad_magic = ep::NcclEpDispatchConfig { magic: 0, ..ok };
            assert_eq!(api_struct(&bad_magic, "config").unwrap_err().code, ep::NCCL_INVALID_ARGUMENT);
            assert_eq!(
                required(std::ptr::null::<ep::NcclEpDispatchConfig>(), "config").unwrap_err().code,
                ep::NCCL_INVALID_ARGUMENT
            );
        }
    }

    /// The caller's bytes of a struct of `size`, the rest of a 128-byte buffer 0xAB (what a
    /// reader must not take).
    fn bytes_of<T>(value: &T, size: u32) -> [u64; 16] {
        let mut buf = [0xABAB_ABAB_ABAB_ABABu64; 16];
        // SAFETY: `value` is a live `T`; the buffer is 128 bytes, more than any T here.
        unsafe {
            std::ptr::copy_nonoverlapping(
                value as *const T as *const u8,
                buf.as_mut_ptr() as *mut u8,
                std::mem::size_of::<T>(),
            )
        };
        buf[0] = u64::from(size) | (u64::from(ep::NCCL_EP_MAGIC) << 32);
        buf
    }

    /// `value`'s first `size` bytes (the rest 0xAB) read as a `T` of that size.
    fn read_as<T: ApiStruct, V>(value: &V, size: u32) -> Res<Option<T::Read>> {
        let buf = bytes_of(value, size);
        // SAFETY: a live 128-byte buffer, larger than any size accepted, headed by size and magic.
        unsafe { api_struct(buf.as_ptr() as *const T, "s") }
    }

    #[test]
    fn every_group_config_size_is_read_up_to_its_size() {
        let v1 = ep::NcclEpGroupConfig { num_experts: 16, timeout_ns: 7, ..Default::default() };
        let full = v2::GroupConfig { v1, zero_copy: 2, overflow_policy: 1, num_topk: 8, padding_v2: [0; 4] };
        let read = |size: u32| read_as::<ep::NcclEpGroupConfig, _>(&full, size);
        let r = read(96).unwrap().unwrap();
        assert_eq!((r.v1.num_experts, r.v1.timeout_ns), (16, 7));
        assert_eq!((r.zero_copy, r.overflow_policy, r.num_topk), (0, 0, 0), "beyond v1: zero");
        // NCCL 2.31's 104 bytes: zero_copy, then padding (read as nothing).
        let r = read(104).unwrap().unwrap();
        assert_eq!((r.v1.num_experts, r.zero_copy, r.overflow_policy, r.num_topk), (16, 2, 0, 0));
        let r = read(112).unwrap().unwrap();
        assert_eq!((r.v1.num_experts, r.zero_copy, r.overflow_policy, r.num_topk), (16, 2, 1, 8));
        for bad in [0, 8, 88, 100, 108, 120, 128] {
            let e = read(bad).unwrap_err();
            assert_eq!(e.code, ep::NCCL_INVALID_ARGUMENT, "size {bad}");
            assert!(e.message.contains("96 (API v1), 104 (NCCL 2.31 dev"), "{}", e.message);
        }
    }

    #[test]
    fn every_v2_struct_size_is_read_up_to_its_size() {
        let t = 0x1000 as *mut ep::NcclEpTensor;
        let info = v2::LayoutInfo {
            v1: ep::NcclEpLayoutInfo { expert_counters: t, ..Default::default() },
            recv_topk_idx_kind: 2,
            padding_v2: [0; 4],
        };
        let r = |size| read_as::<ep::NcclEpLayoutInfo, _>(&info, size);
        assert_eq!(r(40).unwrap().map(|i| (i.v1.expert_counters, i.recv_topk_idx_kind)), Some((t, 0)));
        assert_eq!(r(48).unwrap().map(|i| (i.v1.expert_counters, i.recv_topk_idx_kind)), Some((t, 2)));
        assert_eq!(r(44).unwrap_err().code, ep::NCCL_INVALID_ARGUMENT);

        let cin = v2::CombineInputs { v1: ep::NcclEpCombineInputs { tokens: t, ..Default::default() }, scales: t };
        let r = |size| read_as::<ep::NcclEpCombineInputs, _>(&cin, size);
        assert_eq!(r(24).unwrap().map(|c| (c.v1.tokens, c.scales.is_null())), Some((t, true)));
        assert_eq!(r(32).unwrap().map(|c| (c.v1.tokens, c.scales)), Some((t, t)));
        assert_eq!(r(40).unwrap_err().code, ep::NCCL_INVALID_ARGUMENT);

        let dc =
            v2::DispatchConfig { v1: ep::NcclEpDispatchConfig { send_only: 1, ..Default::default() }, quant_recipe: 2 };
        let r = |size| read_as::<ep::NcclEpDispatchConfig, _>(&dc, size);
        assert_eq!(r(20).unwrap().map(|c| (c.v1.send_only, c.quant_recipe)), Some((1, 0)));
        assert_eq!(r(24).unwrap().map(|c| (c.v1.send_only, c.quant_recipe)), Some((1, 2)));
        assert_eq!(r(28).unwrap_err().code, ep::NCCL_INVALID_ARGUMENT);

        let cc =
            v2::CombineConfig { v1: ep::NcclEpCombineConfig { send_only: 1, ..Default::default() }, quant_recipe: 1 };
        let r = |size| read_as::<ep::NcclEpCombineConfig, _>(&cc, size);
        assert_eq!(r(16).unwrap().map(|c| (c.v1.send_only, c.quant_recipe)), Some((1, 0)));
        assert_eq!(r(20).unwrap().map(|c| (c.v1.send_only, c.quant_recipe)), Some((1, 1)));
        assert_eq!(r(12).unwrap_err().code, ep::NCCL_INVALID_ARGUMENT);
    }

    #[test]
    fn tensors_are_checked() {
        let mut dims = [4usize, 16];
        let mut byte = 0u8;
        let data = &mut byte as *mut u8 as *mut std::ffi::c_void;
        let good = ep::NcclEpTensor::new(ep::NCCL_BFLOAT16, data, &mut dims);
        // SAFETY: descriptors of live arrays.
        unsafe {
            let t = tensor(&good, "x").unwrap().unwrap();
            assert_eq!((t.sizes.clone(), t.numel()), (vec![4, 16], 64));
            assert!(t.expect_sizes("x", &[4, 16]).is_ok());
            assert_eq!(t.expect_type("x", ep::NCCL_FLOAT32).unwrap_err().code, ep::NCCL_INVALID_USAGE);
            for bad in [
                ep::NcclEpTensor { magic: 0, ..good },
                ep::NcclEpTensor { ndim: 0, ..good },
                ep::NcclEpTensor { ndim: 9, ..good },
                ep::NcclEpTensor { data: std::ptr::null_mut(), ..good },
                ep::NcclEpTensor { sizes: std::ptr::null_mut(), ..good },
                ep::NcclEpTensor { datatype: 99, ..good },
            ] {
                assert_eq!(tensor(&bad, "x").unwrap_err().code, ep::NCCL_INVALID_ARGUMENT, "{bad:?}");
            }
            assert_eq!(required_tensor(std::ptr::null(), "x").unwrap_err().code, ep::NCCL_INVALID_ARGUMENT);
        }
    }
}

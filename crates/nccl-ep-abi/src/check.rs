//! The checks at the API boundary, as `nccl_ep.h` states them: every struct (each headed by
//! `size` and `magic`, [`ApiStruct`]) must have this
//! library's `sizeof` and its `magic` [`ep::NCCL_EP_MAGIC`]; tensors carry
//! [`ep::NCCL_EP_TENSOR_MAGIC`] (or [`crate::owned::DYNAMIC_MAGIC`] when
//! `ncclEpTensorAlloc` made them), a rank, a type, an address and sizes. Failures are
//! `ncclInvalidArgument`.

use std::ffi::c_uint;

use nccl_ep_sys as ep;

use crate::status::{Fail, Res};

/// A struct headed by `size` and `magic`.
pub(crate) trait ApiStruct: Sized {
    /// The C name, for messages.
    const NAME: &'static str;
}

macro_rules! api_structs {
    ($($t:ident => $name:literal),* $(,)?) => {
        $(impl ApiStruct for ep::$t {
            const NAME: &'static str = $name;
        })*
    };
}

api_structs!(
    NcclEpGroupConfig => "ncclEpGroupConfig_t",
    NcclEpLayoutInfo => "ncclEpLayoutInfo_t",
    NcclEpDispatchInputs => "ncclEpDispatchInputs_t",
    NcclEpDispatchOutputs => "ncclEpDispatchOutputs_t",
    NcclEpCombineInputs => "ncclEpCombineInputs_t",
    NcclEpCombineOutputs => "ncclEpCombineOutputs_t",
    NcclEpHandleConfig => "ncclEpHandleConfig_t",
    NcclEpDispatchConfig => "ncclEpDispatchConfig_t",
    NcclEpCombineConfig => "ncclEpCombineConfig_t",
    NcclEpCompleteConfig => "ncclEpCompleteConfig_t",
    NcclEpTensorAllocConfig => "ncclEpTensorAllocConfig_t",
);

/// Checks `size` and `magic` of the struct at `p`; `None` for a null pointer (an optional
/// argument: the caller decides whether null is allowed).
///
/// # Safety
///
/// `p` is null or points to a readable `T` (the caller's struct, as the C API requires).
pub(crate) unsafe fn api_struct<'a, T: ApiStruct>(p: *const T, what: &str) -> Res<Option<&'a T>> {
    if p.is_null() {
        return Ok(None);
    }
    // SAFETY: the caller guarantees a readable `T`; only its first 8 bytes are read before the
    // size is known to match (so a smaller struct of an older header is not over-read).
    let (size, magic) = unsafe { *(p as *const (c_uint, c_uint)) };
    let want = std::mem::size_of::<T>() as c_uint;
    if size != want {
        return Err(Fail::arg(format!(
            "{what}: {}.size is {size}, this library's sizeof({}) is {want} (built against another nccl_ep.h?)",
            T::NAME,
            T::NAME
        )));
    }
    if magic != ep::NCCL_EP_MAGIC {
        return Err(Fail::arg(format!(
            "{what}: {}.magic is {magic:#x}, not NCCL_EP_MAGIC ({:#x}): initialise it with its _INIT macro",
            T::NAME,
            ep::NCCL_EP_MAGIC
        )));
    }
    // SAFETY: size and magic match: a whole `T` of this layout.
    Ok(Some(unsafe { &*p }))
}

/// [`api_struct`] for a required argument: null is `ncclInvalidArgument`.
///
/// # Safety
///
/// As [`api_struct`].
pub(crate) unsafe fn required<'a, T: ApiStruct>(p: *const T, what: &str) -> Res<&'a T> {
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
        _ => "an unknown type",
    }
}

/// Bytes of one element of an NCCL data type (`None`: not one this library knows).
pub(crate) fn element_bytes(t: ep::NcclDataType) -> Option<usize> {
    match t {
        ep::NCCL_INT8 | ep::NCCL_UINT8 | ep::NCCL_FLOAT8_E4M3 => Some(1),
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
    if !t.win_hdl.is_null() {
        return Err(Fail::usage(format!("{what}: NCCL window tensors are not supported; pass a device pointer")));
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
    // An empty tensor (a zero extent) needs no storage: frameworks hand out null for it.
    if t.data.is_null() && !sizes.contains(&0) {
        return Err(Fail::arg(format!("{what}: data is NULL")));
    }
    Ok(Some(Tensor { ptr: t.data as u64, datatype: t.datatype, sizes }))
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
    fn structs_need_size_and_magic() {
        let ok = ep::NcclEpDispatchConfig::default();
        // SAFETY: pointers to live structs.
        unsafe {
            assert!(api_struct(&ok, "config").unwrap().is_some());
            assert!(api_struct(std::ptr::null::<ep::NcclEpDispatchConfig>(), "config").unwrap().is_none());
            let bad_size = ep::NcclEpDispatchConfig { size: 16, ..ok };
            assert_eq!(api_struct(&bad_size, "config").unwrap_err().code, ep::NCCL_INVALID_ARGUMENT);
            let bad_magic = ep::NcclEpDispatchConfig { magic: 0, ..ok };
            assert_eq!(api_struct(&bad_magic, "config").unwrap_err().code, ep::NCCL_INVALID_ARGUMENT);
            assert_eq!(
                required(std::ptr::null::<ep::NcclEpDispatchConfig>(), "config").unwrap_err().code,
                ep::NCCL_INVALID_ARGUMENT
            );
        }
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

//! `ncclEpTensorAlloc` / `ncclEpTensorDestroy`: descriptors the library owns. As in NCCL EP 0.1,
//! only the descriptor and its `sizes` array are allocated; the caller sets `data` (device
//! memory stays the caller's). Such a descriptor carries [`DYNAMIC_MAGIC`], and the library
//! remembers its `sizes` pointer, so one whose `sizes` was replaced is refused.

use std::ffi::c_uint;

use nccl_ep_sys as ep;

use crate::check;
use crate::owned::{DYNAMIC_MAGIC, Owned, owner, sizes_intact};
use crate::status::{Fail, Res};

/// `ncclEpTensorAlloc`: a new descriptor of `ndim` dimensions of `datatype`, sizes copied from
/// `sizes`, `data` null.
///
/// # Safety
///
/// `out` is writable; `sizes` has `ndim` readable entries; `config` is null or readable.
pub(crate) unsafe fn alloc(
    out: *mut *mut ep::NcclEpTensor,
    ndim: c_uint,
    datatype: ep::NcclDataType,
    sizes: *const usize,
    config: *const ep::NcclEpTensorAllocConfig,
) -> Res<()> {
    // SAFETY: forwarded contract.
    unsafe { check::api_struct(config, "config") }?;
    if out.is_null() {
        return Err(Fail::arg("tensor (the output pointer) is NULL"));
    }
    if sizes.is_null() {
        return Err(Fail::arg("sizes is NULL"));
    }
    if ndim == 0 || ndim as usize > check::MAX_DIMS {
        return Err(Fail::arg(format!("ndim is {ndim}, must be 1 to {}", check::MAX_DIMS)));
    }
    if check::element_bytes(datatype).is_none() {
        return Err(Fail::arg(format!("datatype {datatype} is not an NCCL data type")));
    }
    // SAFETY: `ndim` readable entries (the caller's contract).
    let dims: Box<[usize]> = unsafe { std::slice::from_raw_parts(sizes, ndim as usize) }.into();
    let dims = Box::into_raw(dims) as *mut usize;
    let owned = Box::new(Owned {
        sizes_shadow: dims,
        public: ep::NcclEpTensor {
            size: std::mem::size_of::<ep::NcclEpTensor>() as c_uint,
            magic: DYNAMIC_MAGIC,
            ndim,
            datatype,
            data: std::ptr::null_mut(),
            win_hdl: std::ptr::null_mut(),
            win_offset: 0,
            sizes: dims,
        },
    });
    let owned = Box::into_raw(owned);
    // SAFETY: `out` is writable (checked non-null; the caller's contract); `owned` is live.
    unsafe { *out = &raw mut (*owned).public };
    Ok(())
}

/// `ncclEpTensorDestroy`: frees a descriptor from [`alloc`] (null is accepted).
///
/// # Safety
///
/// `t` is null or a descriptor from [`alloc`] not destroyed yet (or any readable descriptor,
/// which is refused).
pub(crate) unsafe fn destroy(t: *mut ep::NcclEpTensor) -> Res<()> {
    if t.is_null() {
        return Ok(());
    }
    // SAFETY: readable (the caller's contract).
    let public = unsafe { &*t };
    if public.magic != DYNAMIC_MAGIC || !sizes_intact(public) {
        return Err(Fail::arg("the tensor was not made by ncclEpTensorAlloc (or was already destroyed)"));
    }
    let owned = owner(t) as *mut Owned;
    // SAFETY: made by `alloc` (magic and shadow agree): both boxes are ours and are freed here,
    // once; destroying the same descriptor twice is the caller's bug, as with `free`.
    unsafe {
        let ndim = (*owned).public.ndim as usize;
        drop(Box::from_raw(std::ptr::slice_from_raw_parts_mut((*owned).sizes_shadow, ndim)));
        drop(Box::from_raw(owned));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alloc_checks_and_destroy_frees() {
        let dims = [3usize, 5, 7];
        let mut t: *mut ep::NcclEpTensor = std::ptr::null_mut();
        // SAFETY: valid pointers to live values.
        unsafe {
            alloc(&mut t, 3, ep::NCCL_BFLOAT16, dims.as_ptr(), std::ptr::null()).unwrap();
            let d = &mut *t;
            assert_eq!((d.ndim, d.magic, d.data.is_null()), (3, DYNAMIC_MAGIC, true));
            assert_eq!(std::slice::from_raw_parts(d.sizes, 3), &dims);
            let mut byte = 0u8;
            d.data = &mut byte as *mut u8 as *mut std::ffi::c_void;
            let c = check::tensor(t, "t").unwrap().unwrap();
            assert_eq!(c.sizes, dims);
            let mut other = [1usize, 1, 1];
            let kept = d.sizes;
            d.sizes = other.as_mut_ptr();
            assert_eq!(check::tensor(t, "t").unwrap_err().code, ep::NCCL_INVALID_ARGUMENT);
            d.sizes = kept;
            destroy(t).unwrap();
            destroy(std::ptr::null_mut()).unwrap();
            let zero = 0usize;
            assert!(alloc(&mut t, 0, ep::NCCL_BFLOAT16, &zero, std::ptr::null()).is_err());
            assert!(alloc(std::ptr::null_mut(), 1, ep::NCCL_BFLOAT16, &zero, std::ptr::null()).is_err());
            assert!(alloc(&mut t, 1, 99, &zero, std::ptr::null()).is_err());
            let bad = ep::NcclEpTensorAllocConfig { magic: 1, ..Default::default() };
            assert!(alloc(&mut t, 1, ep::NCCL_BFLOAT16, &zero, &bad).is_err());
            let mut dims = [2usize];
            let mut stat = ep::NcclEpTensor::new(ep::NCCL_FLOAT32, std::ptr::null_mut(), &mut dims);
            assert_eq!(destroy(&mut stat).unwrap_err().code, ep::NCCL_INVALID_ARGUMENT);
        }
    }
}

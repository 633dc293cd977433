//! The layout of the descriptors `ncclEpTensorAlloc` makes ([`crate::tensor`]): what the
//! checks of every descriptor ([`crate::check`]) need to recognise them, apart from allocating
//! and freeing them.

use std::ffi::c_uint;

use nccl_ep_sys as ep;

/// The `magic` of descriptors made by `ncclEpTensorAlloc` (NCCL EP's internal
/// `NCCL_EP_TENSOR_ALLOC_DYNAMIC`).
pub(crate) const DYNAMIC_MAGIC: c_uint = 0xBEEF_BEEF;

/// A library-owned descriptor: the public part the caller sees, behind the `sizes` pointer the
/// library gave it.
#[repr(C)]
pub(crate) struct Owned {
    pub(crate) sizes_shadow: *mut usize,
    pub(crate) public: ep::NcclEpTensor,
}

/// The `Owned` around a library-owned descriptor's public part.
pub(crate) fn owner(t: *const ep::NcclEpTensor) -> *const Owned {
    (t as *const u8).wrapping_sub(std::mem::offset_of!(Owned, public)) as *const Owned
}

/// Whether a [`DYNAMIC_MAGIC`] descriptor still has the `sizes` array it was given.
pub(crate) fn sizes_intact(t: &ep::NcclEpTensor) -> bool {
    // SAFETY: descriptors with DYNAMIC_MAGIC are only made by `tensor::alloc`, inside an `Owned`.
    unsafe { (*owner(t)).sizes_shadow == t.sizes }
}

//! Routing handles of the NCCL EP backend (`ncclEpCreateHandle`).

use std::sync::Arc;

use epflow_core::Error;
use epflow_core::handle::{HandleCore, RoutingHandle};
use epflow_kernels::DeviceTensor;
use nccl_ep_sys as ep;

use crate::group::Shared;

/// A tensor descriptor and the sizes it points to, kept together (NCCL EP reads both during
/// the calls that see the descriptor).
pub(crate) struct Desc {
    sizes: Box<[usize]>,
    t: ep::NcclEpTensor,
}

// SAFETY: a descriptor is plain data: device addresses and a pointer to its own boxed sizes; it
// is read only by the NCCL EP calls of the operation that owns it.
unsafe impl Send for Desc {}

impl Desc {
    pub(crate) fn new(dtype: ep::NcclDataType, ptr: u64, sizes: &[usize]) -> Box<Self> {
        let mut d =
            Box::new(Desc { sizes: sizes.into(), t: ep::NcclEpTensor::new(dtype, std::ptr::null_mut(), &mut []) });
        d.t = ep::NcclEpTensor::new(dtype, ptr as *mut _, &mut d.sizes);
        d
    }

    /// The descriptor, for as long as `self` lives.
    pub(crate) fn ptr(&mut self) -> *mut ep::NcclEpTensor {
        &mut self.t
    }
}

/// What high-throughput handle creation reports: NCCL EP writes the receive count and the
/// per-expert counts while it creates the handle (flat layout). `N` and the counts on the host
/// are in the handle's core ([`RoutingHandle::num_recv_tokens`]).
#[derive(Debug)]
pub(crate) struct HtRecv {
    /// The per-expert counts on the device (`[L]` int32), what dispatch outputs as its counts.
    pub counts: DeviceTensor,
}

pub(crate) struct NcclEpHandleState {
    pub shared: Arc<Shared>,
    pub raw: ep::NcclEpHandle,
    pub core: HandleCore,
    pub ht: Option<HtRecv>,
    pub _topk: DeviceTensor,
}

// SAFETY: the raw handle is used only inside operations issued in turn order.
unsafe impl Send for NcclEpHandleState {}
// SAFETY: as above.
unsafe impl Sync for NcclEpHandleState {}

impl Drop for NcclEpHandleState {
    fn drop(&mut self) {
        if self.shared.ctx.bind_to_thread().is_ok() {
            let _ = self.shared.stream.synchronize();
        }
        // SAFETY: created by ncclEpCreateHandle, destroyed once (a local call); every operation
        // using it holds this value, so none is in flight.
        let _ = unsafe { (self.shared.lib.handle_destroy)(self.raw) };
    }
}

/// A routing handle of the NCCL EP backend: `ncclEpCreateHandle` with the expert-major layout
/// (low-latency) or the flat layout (high-throughput).
#[derive(Clone)]
pub struct NcclEpHandle(pub(crate) Arc<NcclEpHandleState>);

impl std::fmt::Debug for NcclEpHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclEpHandle")
            .field("tokens", &self.0.core.num_tokens())
            .field("num_recv", &self.num_recv_tokens())
            .finish()
    }
}

impl NcclEpHandle {
    pub(crate) fn ht(&self) -> Result<&HtRecv, Error> {
        self.0.ht.as_ref().ok_or_else(|| Error::Backend("a low-latency handle in a high-throughput operation".into()))
    }
}

impl RoutingHandle for NcclEpHandle {
    fn core(&self) -> &HandleCore {
        &self.0.core
    }
}

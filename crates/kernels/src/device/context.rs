//! The CUDA driver, loaded at run time: availability checks and error conversion.

use std::sync::Arc;

use cudarc::driver::{CudaContext, DriverError};
use epflow_core::Error;

/// Whether the CUDA driver library can be loaded on this machine.
pub fn driver_present() -> bool {
    // SAFETY: only tries to open the shared library (and closes it); no CUDA call is made.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

/// Number of CUDA devices, 0 when the driver is absent or reports none (never panics).
pub fn device_count() -> usize {
    if !driver_present() {
        return 0;
    }
    CudaContext::device_count().map_or(0, |n| n.max(0) as usize)
}

/// Number of streaming multiprocessors of device `ordinal`.
pub fn sm_count(ordinal: usize) -> Result<usize, Error> {
    sm_count_of(&*context(ordinal)?)
}

/// Number of streaming multiprocessors of `ctx`'s device.
pub(crate) fn sm_count_of(ctx: &CudaContext) -> Result<usize, Error> {
    ctx.attribute(cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
        .map(|n| n.max(0) as usize)
        .map_err(|e| cuda("query SMs", e))
}

/// The PCI location of `ctx`'s device (domain, bus, device), as one number: two contexts with
/// the same key on one host drive the same GPU.
pub(crate) fn pci_key(ctx: &CudaContext) -> Result<u64, Error> {
    use cudarc::driver::sys::CUdevice_attribute as A;
    let get = |a| ctx.attribute(a).map(|v| v.max(0) as u64).map_err(|e| cuda("query the PCI location", e));
    Ok(get(A::CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID)? << 32
        | get(A::CU_DEVICE_ATTRIBUTE_PCI_BUS_ID)? << 8
        | get(A::CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID)?)
}

/// A [`epflow_core::Error::Backend`] for a failed driver call.
pub(crate) fn cuda(what: &str, e: DriverError) -> Error {
    Error::Backend(format!("CUDA: {what}: {e:?}"))
}

/// The primary context of device `ordinal` (the one the CUDA runtime uses), bound to the
/// calling thread.
pub fn context(ordinal: usize) -> Result<Arc<CudaContext>, Error> {
    if !driver_present() {
        return Err(Error::Unsupported("the CUDA driver (libcuda) is not installed on this machine".into()));
    }
    CudaContext::new(ordinal).map_err(|e| cuda(&format!("open device {ordinal}"), e))
}

/// The free memory of a set of GPUs, summed: what measures the device memory a step takes
/// (free memory before it minus after). It holds each GPU's primary context from
/// [`FreeMemory::of`] on, so a context made for the first reading is not counted as taken.
#[derive(Debug)]
pub struct FreeMemory {
    contexts: Vec<Arc<CudaContext>>,
}

impl FreeMemory {
    /// The distinct GPUs of `devices` (ordinals; repeats allowed, none needs no driver).
    pub fn of(devices: &[usize]) -> Result<FreeMemory, Error> {
        let mut distinct = devices.to_vec();
        distinct.sort_unstable();
        distinct.dedup();
        let contexts = distinct.into_iter().map(context).collect::<Result<_, _>>()?;
        Ok(FreeMemory { contexts })
    }

    /// How many distinct GPUs it reads.
    pub fn gpus(&self) -> usize {
        self.contexts.len()
    }

    /// Their free memory now (`cuMemGetInfo`), bytes, summed; binds each context to the calling
    /// thread in turn.
    pub fn bytes(&self) -> Result<u64, Error> {
        self.contexts.iter().try_fold(0u64, |sum, ctx| {
            bind(ctx)?;
            let (free, _) = ctx.mem_get_info().map_err(|e| cuda("cuMemGetInfo", e))?;
            Ok(sum + free as u64)
        })
    }
}

/// Binds `ctx` to the calling thread.
pub(crate) fn bind(ctx: &CudaContext) -> Result<(), Error> {
    ctx.bind_to_thread().map_err(|e| cuda("bind context", e))
}

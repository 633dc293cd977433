//! [`DeviceTensor`]: a tensor in device memory, as the GPU backend reads and writes them.

use std::any::Any;
use std::fmt;
use std::sync::Arc;

use cudarc::driver::{CudaEvent, CudaStream};
use epflow_core::ops::TensorView;
use epflow_core::{Error, HostData, HostTensor, TensorDesc};

use super::consumers::Lease;
use super::memory::{DeviceBuffer, copy_from_host, copy_to_host};

/// A tensor in the memory of one device: a descriptor, an address, what keeps the memory alive,
/// and optionally an event after which the data is ready (the GPU backend makes its stream wait
/// on it before reading). A view of an epflow output also holds the output's lease: the buffer
/// set (or cached buffer) is not written again until every view is dropped and the consumer
/// streams declared with [`DeviceTensor::record_stream`] have passed that point.
#[derive(Clone)]
pub struct DeviceTensor {
    desc: TensorDesc,
    ptr: u64,
    device: usize,
    keep: Option<Arc<dyn Any + Send + Sync>>,
    lease: Option<Arc<dyn Lease>>,
    ready: Option<Arc<CudaEvent>>,
    /// Whether epflow allocated the memory (`cuMemAlloc` in the device's context): then, in a
    /// one-process group, kernels of peer GPUs reach it (peer access covers every such
    /// allocation). Caller memory may come from allocators peer access does not cover.
    epflow_memory: bool,
}

impl fmt::Debug for DeviceTensor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeviceTensor")
            .field("desc", &self.desc)
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("device", &self.device)
            .finish()
    }
}

impl TensorView for DeviceTensor {
    fn desc(&self) -> &TensorDesc {
        &self.desc
    }
    fn storage_len(&self) -> Option<usize> {
        None
    }
}

impl DeviceTensor {
    /// Copies a host tensor to device `device` (synchronous), in memory this tensor owns.
    pub fn upload(ctx: &Arc<cudarc::driver::CudaContext>, device: usize, host: &HostTensor) -> Result<Self, Error> {
        Self::upload_with(ctx, device, host, None)
    }

    /// [`DeviceTensor::upload`] into memory of `allocator` (`None`: `cuMemAlloc`;
    /// [`DeviceBuffer::zeroed_with`]).
    pub fn upload_with(
        ctx: &Arc<cudarc::driver::CudaContext>,
        device: usize,
        host: &HostTensor,
        allocator: Option<&Arc<dyn super::LocalAllocator>>,
    ) -> Result<Self, Error> {
        let d = host.desc().clone();
        let buf = DeviceBuffer::zeroed_with(ctx, d.size_bytes(), allocator)?;
        match host.data() {
            HostData::Bf16(v) => buf.write(0, v)?,
            HostData::F32(v) => buf.write(0, v)?,
            HostData::I32(v) => buf.write(0, v)?,
            HostData::I64(v) => buf.write(0, v)?,
            HostData::Fp8(v) | HostData::U8(v) => buf.write(0, v)?,
        }
        Ok(Self::owning(d, device, buf))
    }

    /// A zero-filled tensor of `desc` on `device`.
    pub fn zeros(ctx: &Arc<cudarc::driver::CudaContext>, device: usize, desc: TensorDesc) -> Result<Self, Error> {
        Self::zeros_with(ctx, device, desc, None)
    }

    /// [`DeviceTensor::zeros`] in memory of `allocator` (`None`: `cuMemAlloc`;
    /// [`DeviceBuffer::zeroed_with`]): a rank's local scratch, such as
    /// [`crate::GpuRank::local_allocator`]'s.
    pub fn zeros_with(
        ctx: &Arc<cudarc::driver::CudaContext>,
        device: usize,
        desc: TensorDesc,
        allocator: Option<&Arc<dyn super::LocalAllocator>>,
    ) -> Result<Self, Error> {
        let buf = DeviceBuffer::zeroed_with(ctx, desc.size_bytes(), allocator)?;
        Ok(Self::owning(desc, device, buf))
    }

    /// A tensor of `desc` in `buf`, which epflow allocated and this tensor keeps. Memory of a
    /// caller's allocator is not `epflow_memory` (peer access may not cover it).
    fn owning(desc: TensorDesc, device: usize, buf: DeviceBuffer) -> Self {
        let ptr = buf.ptr();
        let epflow_memory = buf.allocator().is_none();
        DeviceTensor { desc, ptr, device, keep: Some(Arc::new(buf)), lease: None, ready: None, epflow_memory }
    }

    /// A view of memory someone else owns (a framework's tensor, say). Peers' kernels do not
    /// read it in place (a high-throughput combine sends its rows through the rings: the
    /// allocator may be one peer access does not cover).
    ///
    /// # Safety
    ///
    /// `ptr` must address at least `desc.size_bytes()` bytes of device memory of device
    /// `device`, laid out as `desc` says, valid until every operation that reads or writes this
    /// tensor has completed.
    pub unsafe fn from_raw(ptr: u64, device: usize, desc: TensorDesc) -> Self {
        DeviceTensor { desc, ptr, device, keep: None, lease: None, ready: None, epflow_memory: false }
    }

    /// A view into memory kept alive by `keep` (counted as caller memory: see
    /// [`DeviceTensor::epflow_memory`]).
    pub(crate) fn view(ptr: u64, device: usize, desc: TensorDesc, keep: Arc<dyn Any + Send + Sync>) -> Self {
        DeviceTensor { desc, ptr, device, keep: Some(keep), lease: None, ready: None, epflow_memory: false }
    }

    /// A view into leased output memory (kept alive by `keep`), which epflow allocated.
    pub(crate) fn leased(
        ptr: u64,
        device: usize,
        desc: TensorDesc,
        keep: Arc<dyn Any + Send + Sync>,
        lease: Arc<dyn Lease>,
    ) -> Self {
        DeviceTensor { desc, ptr, device, keep: Some(keep), lease: Some(lease), ready: None, epflow_memory: true }
    }

    /// A view of the first `rows` rows (outer dimension) of this tensor: the same memory, kept
    /// alive (and leased, and ready after the same event) as this tensor is. The layer of
    /// `epflow-moe` hands a combine the rows a dispatch delivered out of a buffer sized for the
    /// most it can deliver.
    pub fn leading_rows(&self, rows: usize) -> Result<Self, Error> {
        let d = &self.desc;
        if d.shape.is_empty() || rows > d.shape[0] {
            return Err(Error::Unsupported(format!("the first {rows} rows of a tensor of shape {:?}", d.shape)));
        }
        let mut desc = d.clone();
        desc.shape[0] = rows;
        Ok(DeviceTensor { desc, ..self.clone() })
    }

    /// Declares that work enqueued on `stream` (until this tensor's memory is released) reads
    /// it, as torch's `record_stream`: when the output it belongs to is dropped, its buffer set is
    /// released in `stream`'s order (the next writer waits for that work on the device). For
    /// tensors that are not epflow outputs it does nothing.
    pub fn record_stream(&self, stream: &Arc<CudaStream>) {
        if let Some(l) = &self.lease {
            l.add_consumer(stream);
        }
    }

    /// Whether epflow allocated this tensor's memory with `cuMemAlloc` ([`DeviceTensor::upload`],
    /// [`DeviceTensor::zeros`], an epflow output): in a one-process group, peers' kernels may
    /// read it in place (the pull combine of high-throughput). `from_raw` memory is not, nor
    /// memory of a caller's allocator ([`DeviceTensor::zeros_with`]).
    pub(crate) fn epflow_memory(&self) -> bool {
        self.epflow_memory
    }

    /// The output lease of this view, if it is one.
    pub(crate) fn lease(&self) -> Option<&Arc<dyn Lease>> {
        self.lease.as_ref()
    }

    /// A copy of this tensor in new memory of the same device (synchronous).
    pub fn duplicate(&self, ctx: &Arc<cudarc::driver::CudaContext>) -> Result<Self, Error> {
        if let Some(e) = &self.ready {
            e.synchronize().map_err(|e| super::context::cuda("wait for tensor", e))?;
        }
        let out = DeviceTensor::zeros(ctx, self.device, self.desc.clone())?;
        super::context::bind(ctx)?;
        // SAFETY: both ranges are `size_bytes` long device allocations of this context.
        unsafe { cudarc::driver::sys::cuMemcpyDtoD_v2(out.ptr, self.ptr, self.desc.size_bytes()) }
            .result()
            .map_err(|e| super::context::cuda("copy tensor", e))?;
        super::memory::finish_legacy_stream(ctx)?;
        Ok(out)
    }

    /// The same tensor, ready only after `event` (recorded on the producer's stream).
    pub fn ready_after(mut self, event: Arc<CudaEvent>) -> Self {
        self.ready = Some(event);
        self
    }

    /// Sets the ready event in place (see [`DeviceTensor::ready_after`]).
    pub(crate) fn set_ready(&mut self, event: Arc<CudaEvent>) {
        self.ready = Some(event);
    }

    /// The descriptor.
    pub fn desc(&self) -> &TensorDesc {
        &self.desc
    }

    /// `Error::Unsupported` naming `what` unless the tensor is `dtype` of exactly `shape`.
    pub fn expect_shape(&self, what: &str, dtype: epflow_core::DType, shape: &[usize]) -> Result<(), Error> {
        if self.desc.dtype != dtype || self.desc.shape != shape {
            return Err(Error::Unsupported(format!(
                "{what}: {dtype:?} {shape:?} expected, got {:?} {:?}",
                self.desc.dtype, self.desc.shape
            )));
        }
        Ok(())
    }

    /// The device address.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// The device ordinal.
    pub fn device(&self) -> usize {
        self.device
    }

    /// The event after which the data is ready, if one was set ([`DeviceTensor::ready_after`]).
    pub fn ready_event(&self) -> Option<&Arc<CudaEvent>> {
        self.ready.as_ref()
    }

    pub(crate) fn keep_alive(&self) -> Option<Arc<dyn Any + Send + Sync>> {
        self.keep.clone()
    }

    /// Fills every byte of the tensor with `byte`, synchronously (a debugging aid: poisoned
    /// outputs show rows an operation failed to write).
    pub fn fill_bytes(&self, ctx: &Arc<cudarc::driver::CudaContext>, byte: u8) -> Result<(), Error> {
        super::bind(ctx)?;
        // SAFETY: the tensor's range of `size_bytes` is device memory of `ctx` (it was allocated
        // or given with this descriptor); the fill is synchronous.
        unsafe { cudarc::driver::sys::cuMemsetD8_v2(self.ptr, byte, self.desc.size_bytes()) }
            .result()
            .map_err(|e| super::cuda("fill", e))?;
        super::memory::finish_legacy_stream(ctx)
    }

    /// Overwrites the tensor with `host` (same shape and type), synchronously: e.g. refills a
    /// captured step's input buffer between replays (after the previous replay finished).
    pub fn copy_from_host(&self, ctx: &Arc<cudarc::driver::CudaContext>, host: &HostTensor) -> Result<(), Error> {
        if host.desc().shape != self.desc.shape || host.desc().dtype != self.desc.dtype {
            return Err(Error::Unsupported(format!(
                "copy of a {:?} {:?} host tensor into a {:?} {:?} device tensor",
                host.desc().dtype,
                host.desc().shape,
                self.desc.dtype,
                self.desc.shape
            )));
        }
        match host.data() {
            HostData::Bf16(v) => copy_from_host(ctx, self.ptr, v),
            HostData::F32(v) => copy_from_host(ctx, self.ptr, v),
            HostData::I32(v) => copy_from_host(ctx, self.ptr, v),
            HostData::I64(v) => copy_from_host(ctx, self.ptr, v),
            HostData::Fp8(v) | HostData::U8(v) => copy_from_host(ctx, self.ptr, v),
        }
    }

    /// Copies the tensor to the host (synchronous; waits for the ready event first).
    pub fn download(&self, ctx: &cudarc::driver::CudaContext) -> Result<HostTensor, Error> {
        if let Some(e) = &self.ready {
            e.synchronize().map_err(|e| super::context::cuda("wait for tensor", e))?;
        }
        let n = self.desc.numel();
        fn read<T: Copy>(ctx: &cudarc::driver::CudaContext, ptr: u64, n: usize, zero: T) -> Result<Vec<T>, Error> {
            let mut v = vec![zero; n];
            copy_to_host(ctx, ptr, &mut v)?;
            Ok(v)
        }
        let data = match self.desc.dtype {
            epflow_core::DType::Bf16 => HostData::Bf16(read(ctx, self.ptr, n, epflow_core::bf16::ZERO)?),
            epflow_core::DType::F32 => HostData::F32(read(ctx, self.ptr, n, 0f32)?),
            epflow_core::DType::I32 => HostData::I32(read(ctx, self.ptr, n, 0i32)?),
            epflow_core::DType::I64 => HostData::I64(read(ctx, self.ptr, n, 0i64)?),
            epflow_core::DType::Fp8E4m3 => HostData::Fp8(read(ctx, self.ptr, n, 0u8)?),
            epflow_core::DType::U8 => HostData::U8(read(ctx, self.ptr, n, 0u8)?),
        };
        Ok(HostTensor::new(self.desc.tag, &self.desc.shape, data))
    }
}

//! Expert compute for examples and benchmarks (cuBLAS, BF16 with fp32 accumulation):
//!
//! - [`ExpertGemm::padded`]: one strided-batched GEMM over the whole padded `[L x R*M x H]`
//!   low-latency layout. It needs no counts, so nothing is read on the host: the stream-ordered
//!   path ([`crate::GpuDispatchOutput`] completed on the GEMM's stream) runs with no host sync.
//!   Rows past an expert's count hold stale data; their results are never read (combine reads
//!   only the rows dispatch delivered). It computes all `R*M` rows per expert: with `M` sized
//!   for the worst case that is more arithmetic than the rows received, the price of no sync.
//! - [`ExpertGemm::per_expert`]: one GEMM per expert over the rows it received, which needs the
//!   counts on the host.
//! - [`comm_sms`], [`comm_sms_for`]: how many SMs the communication kernels of a stream-ordered
//!   pipeline may take.

/// The `max_sms` for a low-latency group whose operations complete in stream order on `lanes`
/// streams, with `ranks_per_gpu` ranks sharing each of `sms` SMs: every lane can hold a receive
/// kernel waiting for its data while a send must still find SMs to run on (its peers' receives
/// wait for it), so `(lanes + 1) x max_sms` blocks per rank must fit. Capped at `cap`.
pub fn comm_sms(sms: usize, ranks_per_gpu: usize, lanes: usize, cap: usize) -> usize {
    (sms / (ranks_per_gpu.max(1) * (lanes + 1))).clamp(1, cap.max(1))
}

/// [`comm_sms`] for ranks on `devices` (one entry per rank; a device named twice holds two
/// ranks), from the SM count of the first.
pub fn comm_sms_for(devices: &[usize], lanes: usize, cap: usize) -> Result<usize, Error> {
    let first = *devices.first().ok_or_else(|| Error::Unsupported("no devices".into()))?;
    Ok(comm_sms(crate::device::sm_count(first)?, ranks_on_busiest_gpu(devices), lanes, cap))
}

/// The most ranks any one GPU holds, from one entry per rank naming its GPU (a device, or a
/// (host, PCI location)); 1 when none is shared.
pub(crate) fn ranks_on_busiest_gpu<T: PartialEq>(places: &[T]) -> usize {
    places.iter().map(|a| places.iter().filter(|b| *b == a).count()).max().unwrap_or(1)
}

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::cublas::CudaBlas;
use cudarc::cublas::sys::{cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType_t};
use cudarc::driver::{CudaEvent, CudaStream};
use epflow_core::{DType, Error};

use crate::device::DeviceTensor;
use crate::device::{bind, cuda};

/// cuBLAS on one stream.
#[derive(Debug)]
pub struct ExpertGemm {
    blas: CudaBlas,
    stream: Arc<CudaStream>,
}

fn blas_error(e: impl std::fmt::Debug) -> Error {
    Error::Backend(format!("cuBLAS: {e:?}"))
}

/// `(L, rows, H)` of BF16 `x`, `y` `[L x rows x H]` and `w` `[H x H]`, or why not.
fn check_shapes(x: &DeviceTensor, w: &DeviceTensor, y: &DeviceTensor) -> Result<(usize, usize, usize), Error> {
    let (xd, wd, yd) = (x.desc(), w.desc(), y.desc());
    let ok = xd.dtype == DType::Bf16
        && wd.dtype == DType::Bf16
        && yd.dtype == DType::Bf16
        && xd.shape.len() == 3
        && xd.shape == yd.shape
        && wd.shape == [xd.shape[2], xd.shape[2]]
        && xd.shape.iter().all(|&d| d <= i32::MAX as usize);
    if !ok {
        return Err(Error::Unsupported(format!(
            "expert GEMM needs BF16 x, y [L x rows x H] and w [H x H]; got x {:?} {}, w {:?} {}, y {:?} {}",
            xd.shape, xd.dtype, wd.shape, wd.dtype, yd.shape, yd.dtype
        )));
    }
    Ok((xd.shape[0], xd.shape[1], xd.shape[2]))
}

impl ExpertGemm {
    /// cuBLAS bound to `stream`.
    pub fn new(stream: Arc<CudaStream>) -> Result<Self, Error> {
        // SAFETY: only tries to open the shared library.
        if !unsafe { cudarc::cublas::sys::is_culib_present() } {
            return Err(Error::Unsupported(
                "cuBLAS (libcublas.so.13) not found: add the CUDA lib directory to LD_LIBRARY_PATH".into(),
            ));
        }
        Ok(ExpertGemm { blas: CudaBlas::new(Arc::clone(&stream)).map_err(blas_error)?, stream })
    }

    /// The stream the GEMMs run on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// For every local expert `l` and every row `j` of the padded layout, `y[l][j] = x[l][j] · w`
    /// (row-major BF16, fp32 accumulation), where `x` and `y` are `[L x R*M x H]` and `w` is
    /// `[H x H]`: one strided-batched GEMM enqueued on the stream (after `x`'s ready event, if
    /// any), which reads no counts. Returns an event recorded after it.
    pub fn padded(&self, x: &DeviceTensor, w: &DeviceTensor, y: &DeviceTensor) -> Result<CudaEvent, Error> {
        let (l, rows, h) = check_shapes(x, w, y)?;
        self.begin(x)?;
        self.gemm(x.ptr(), w, y.ptr(), rows, h, l)?;
        self.end()
    }

    /// For every local expert `l`, `y[l][0..rows[l]] = x[l][0..rows[l]] · w` (row-major BF16,
    /// fp32 accumulation), where `x` and `y` are `[L x R*M x H]` and `w` is `[H x H]`. Enqueues
    /// on the stream and returns an event recorded after the last GEMM.
    pub fn per_expert(
        &self,
        x: &DeviceTensor,
        w: &DeviceTensor,
        y: &DeviceTensor,
        rows: &[i32],
    ) -> Result<CudaEvent, Error> {
        let (l, per_expert, h) = check_shapes(x, w, y)?;
        if rows.len() != l || rows.iter().any(|&r| r < 0 || r as usize > per_expert) {
            return Err(Error::Unsupported(format!(
                "per-expert GEMM needs one count in 0..={per_expert} per expert ({l}); got {rows:?}"
            )));
        }
        self.begin(x)?;
        for (e, &n) in rows.iter().enumerate() {
            if n > 0 {
                let off = (e * per_expert * h * 2) as u64;
                self.gemm(x.ptr() + off, w, y.ptr() + off, n as usize, h, 1)?;
            }
        }
        self.end()
    }

    /// Binds the context; the stream waits for `x`'s ready event.
    fn begin(&self, x: &DeviceTensor) -> Result<(), Error> {
        bind(self.stream.context())?;
        if let Some(e) = x.ready_event() {
            self.stream.wait(e).map_err(|e| cuda("wait for input", e))?;
        }
        Ok(())
    }

    /// An event recorded after the GEMMs enqueued so far.
    fn end(&self) -> Result<CudaEvent, Error> {
        let ev = self.stream.context().new_event(None).map_err(|e| cuda("create event", e))?;
        ev.record(&self.stream).map_err(|e| cuda("record event", e))?;
        Ok(ev)
    }

    /// `batch` row-major BF16 GEMMs `Y[rows x h] = X[rows x h] · W[h x h]`, the `X` and `Y`
    /// blocks `rows * h` elements apart from `x` and `y`, `W` shared; fp32 accumulation.
    fn gemm(&self, x: u64, w: &DeviceTensor, y: u64, rows: usize, h: usize, batch: usize) -> Result<(), Error> {
        let (alpha, beta) = (1.0f32, 0.0f32);
        let stride = (rows * h) as i64;
        // Row-major Y = X · W is column-major Y^T = W^T · X^T.
        // SAFETY: the callers checked the shapes: from `x` and `y` lie `batch` blocks of
        // `rows x h` BF16 values `stride` apart, `w` holds h x h (stride 0: shared); alpha/beta
        // are host fp32 scalars (compute type 32F); the memory stays alive until the caller's
        // work on this stream is done (the caller keeps the tensors).
        unsafe {
            cudarc::cublas::result::gemm_strided_batched_ex(
                *self.blas.handle(),
                cublasOperation_t::CUBLAS_OP_N,
                cublasOperation_t::CUBLAS_OP_N,
                h as i32,
                rows as i32,
                h as i32,
                &alpha as *const f32 as *const c_void,
                w.ptr() as *const c_void,
                cudaDataType_t::CUDA_R_16BF,
                h as i32,
                0,
                x as *const c_void,
                cudaDataType_t::CUDA_R_16BF,
                h as i32,
                stride,
                &beta as *const f32 as *const c_void,
                y as *mut c_void,
                cudaDataType_t::CUDA_R_16BF,
                h as i32,
                stride,
                batch as i32,
                cublasComputeType_t::CUBLAS_COMPUTE_32F,
                cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(blas_error)
    }
}

#[cfg(test)]
mod tests {
    use super::comm_sms;

    #[test]
    fn comm_sms_leaves_room_for_every_lane_and_a_send() {
        assert_eq!(comm_sms(132, 1, 2, 48), 44);
        assert_eq!(comm_sms(132, 1, 3, 48), 33);
        assert_eq!(comm_sms(132, 2, 2, 48), 22);
        assert_eq!(comm_sms(132, 1, 1, 48), 48);
        assert_eq!(comm_sms(4, 2, 8, 48), 1);
        for (sms, per, lanes) in [(132, 1, 2), (132, 2, 3), (78, 1, 4)] {
            assert!(per * (lanes + 1) * comm_sms(sms, per, lanes, 48) <= sms);
        }
    }
}

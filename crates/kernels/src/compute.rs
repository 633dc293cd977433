//! Expert compute for examples and benchmarks: one BF16 GEMM per local expert (cuBLAS) over the
//! rows dispatch delivered to it.

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
        let (xd, wd, yd) = (x.desc(), w.desc(), y.desc());
        let ok = xd.dtype == DType::Bf16
            && wd.dtype == DType::Bf16
            && yd.dtype == DType::Bf16
            && xd.shape.len() == 3
            && xd.shape == yd.shape
            && wd.shape == [xd.shape[2], xd.shape[2]]
            && rows.len() == xd.shape[0]
            && rows.iter().all(|&r| r >= 0 && r as usize <= xd.shape[1]);
        if !ok {
            return Err(Error::Unsupported(format!(
                "per-expert GEMM needs BF16 x, y [L x rows x H], w [H x H] and at most `rows` rows per expert; got x {:?}, w {:?}, y {:?}, rows {rows:?}",
                xd.shape, wd.shape, yd.shape
            )));
        }
        let (per_expert, h) = (xd.shape[1], xd.shape[2]);
        bind(self.stream.context())?;
        if let Some(e) = x.ready_event() {
            self.stream.wait(e).map_err(|e| cuda("wait for input", e))?;
        }
        let (alpha, beta) = (1.0f32, 0.0f32);
        for (l, &n) in rows.iter().enumerate() {
            if n == 0 {
                continue;
            }
            let off = (l * per_expert * h * 2) as u64;
            // Row-major Y[n x h] = X[n x h] · W[h x h] is column-major Y^T = W^T · X^T.
            // SAFETY: shapes were checked above: X and Y hold `n` rows of `h` BF16 values at this
            // offset, W holds h x h; alpha/beta are host fp32 scalars (compute type 32F).
            unsafe {
                cudarc::cublas::result::gemm_ex(
                    *self.blas.handle(),
                    cublasOperation_t::CUBLAS_OP_N,
                    cublasOperation_t::CUBLAS_OP_N,
                    h as i32,
                    n,
                    h as i32,
                    &alpha as *const f32 as *const c_void,
                    w.ptr() as *const c_void,
                    cudaDataType_t::CUDA_R_16BF,
                    h as i32,
                    (x.ptr() + off) as *const c_void,
                    cudaDataType_t::CUDA_R_16BF,
                    h as i32,
                    &beta as *const f32 as *const c_void,
                    (y.ptr() + off) as *mut c_void,
                    cudaDataType_t::CUDA_R_16BF,
                    h as i32,
                    cublasComputeType_t::CUBLAS_COMPUTE_32F,
                    cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                )
            }
            .map_err(blas_error)?;
        }
        let ev = self.stream.context().new_event(None).map_err(|e| cuda("create event", e))?;
        ev.record(&self.stream).map_err(|e| cuda("record event", e))?;
        Ok(ev)
    }
}

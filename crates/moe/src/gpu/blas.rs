//! Row-major BF16 GEMMs with FP32 accumulation on one stream (cuBLAS, loaded at run time).

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::cublas::CudaBlas;
use cudarc::cublas::sys::{cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType_t};
use cudarc::driver::CudaStream;
use epflow_core::{DType, Error, Result, TensorDesc, TensorTag};
use epflow_kernels::DeviceTensor;

/// One (batched) row-major GEMM `Y[b] = X[b] · W[b]`: `X` `[m x k]` with row stride `ldx`,
/// `W` `[k x n]` (row stride `n`), `Y` `[m x n]` (row stride `n`), `batch` of them
/// `stride_x`, `stride_w`, `stride_y` elements apart (0: shared). Element counts, not bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Gemm {
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub ldx: usize,
    pub batch: usize,
    pub stride_x: usize,
    pub stride_w: usize,
    pub stride_y: usize,
    /// `Y` in FP32 (the router's logits) instead of BF16.
    pub fp32_out: bool,
}

impl Gemm {
    /// `Y [m x n] = X [m x k] · W [k x n]`, BF16 out, contiguous `X`.
    pub(crate) fn plain(m: usize, k: usize, n: usize) -> Gemm {
        Gemm { m, n, k, ldx: k, batch: 1, stride_x: 0, stride_w: 0, stride_y: 0, fp32_out: false }
    }

    /// The same GEMM per expert: `batch` blocks of `m` rows, each with its own `[k x n]` weight.
    pub(crate) fn per_expert(batch: usize, m: usize, k: usize, n: usize) -> Gemm {
        Gemm { m, n, k, ldx: k, batch, stride_x: m * k, stride_w: k * n, stride_y: m * n, fp32_out: false }
    }
}

/// Bytes of the workspace each [`Blas`] gives cuBLAS (Hopper's recommended 32 MiB): set once,
/// so that cuBLAS allocates nothing per call (and GEMMs can be captured in CUDA graphs).
pub(crate) const WORKSPACE_BYTES: usize = 32 << 20;

/// cuBLAS bound to one stream, with a workspace of its own.
#[derive(Debug)]
pub(crate) struct Blas {
    blas: CudaBlas,
    /// Kept alive as long as the handle.
    _workspace: DeviceTensor,
}

fn blas_error(e: impl std::fmt::Debug) -> Error {
    Error::Backend(format!("cuBLAS: {e:?}"))
}

impl Blas {
    /// cuBLAS on `stream` (of device `device`), or why not (the library missing).
    pub(crate) fn new(stream: &Arc<CudaStream>, device: usize) -> Result<Self> {
        // SAFETY: only tries to open the shared library.
        if !unsafe { cudarc::cublas::sys::is_culib_present() } {
            return Err(Error::Unsupported(
                "cuBLAS (libcublas.so.13) not found: add the CUDA lib directory to LD_LIBRARY_PATH".into(),
            ));
        }
        let blas = CudaBlas::new(Arc::clone(stream)).map_err(blas_error)?;
        let desc = TensorDesc::contiguous(TensorTag::Tokens, DType::Bf16, &[WORKSPACE_BYTES / 2]);
        let workspace = DeviceTensor::zeros(stream.context(), device, desc)?;
        // SAFETY: the handle is live; the workspace is WORKSPACE_BYTES of device memory of the
        // stream's context, kept alive in `Blas` beside the handle (dropped after it: fields
        // drop in order).
        unsafe {
            cudarc::cublas::sys::cublasSetWorkspace_v2(*blas.handle(), workspace.ptr() as *mut c_void, WORKSPACE_BYTES)
        }
        .result()
        .map_err(blas_error)?;
        Ok(Blas { blas, _workspace: workspace })
    }

    /// Enqueues `g` on the stream with `x`, `w`, `y` device addresses.
    ///
    /// The caller guarantees that `x`, `w` and `y` address the blocks `g` describes, in device
    /// memory of the stream's context that stays alive until the GEMM ran.
    pub(crate) fn gemm(&self, g: &Gemm, x: u64, w: u64, y: u64) -> Result<()> {
        if g.m == 0 || g.batch == 0 {
            return Ok(());
        }
        let fits = [g.m, g.n, g.k, g.ldx, g.batch].iter().all(|&d| d <= i32::MAX as usize)
            && [g.stride_x, g.stride_w, g.stride_y].iter().all(|&s| s <= i64::MAX as usize);
        if !fits || g.ldx < g.k {
            return Err(Error::Unsupported(format!("GEMM {g:?}: sizes out of range")));
        }
        let (alpha, beta) = (1.0f32, 0.0f32);
        let out = if g.fp32_out { cudaDataType_t::CUDA_R_32F } else { cudaDataType_t::CUDA_R_16BF };
        // Row-major Y = X · W is column-major Y^T = W^T · X^T.
        // SAFETY: the caller's addresses hold the blocks `g` describes (sizes checked to fit
        // cuBLAS's integer types above); alpha and beta are host FP32 scalars (compute type
        // 32F); the handle is bound to the caller's stream.
        unsafe {
            cudarc::cublas::result::gemm_strided_batched_ex(
                *self.blas.handle(),
                cublasOperation_t::CUBLAS_OP_N,
                cublasOperation_t::CUBLAS_OP_N,
                g.n as i32,
                g.m as i32,
                g.k as i32,
                &alpha as *const f32 as *const c_void,
                w as *const c_void,
                cudaDataType_t::CUDA_R_16BF,
                g.n as i32,
                g.stride_w as i64,
                x as *const c_void,
                cudaDataType_t::CUDA_R_16BF,
                g.ldx as i32,
                g.stride_x as i64,
                &beta as *const f32 as *const c_void,
                y as *mut c_void,
                out,
                g.n as i32,
                g.stride_y as i64,
                g.batch as i32,
                cublasComputeType_t::CUBLAS_COMPUTE_32F,
                cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(blas_error)
    }
}

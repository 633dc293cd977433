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

/// Row-major GEMMs of one shape but each group's own row count: `Y_g [m_g x n] = X_g [m_g x k]
/// · W_g [k x n]`, contiguous, BF16 in and out, FP32 accumulation; one cuBLAS grouped call
/// (`cublasGemmGroupedBatchedEx`, cuBLAS 12.5 on).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Grouped<'a> {
    /// Rows per group (`m_g > 0`).
    pub m: &'a [i32],
    pub k: usize,
    pub n: usize,
    /// Per group: the addresses of `X_g`, `W_g` and `Y_g`.
    pub x: &'a [u64],
    pub w: &'a [u64],
    pub y: &'a [u64],
}

impl Blas {
    /// Enqueues `g` on `stream` (the handle's stream). Its pointer arrays are copied in stream
    /// order into `arrays` (device memory of at least `3 * groups` u64, which the GEMM reads
    /// when it runs: a later call on the same stream may reuse it).
    ///
    /// The caller guarantees that the addresses hold the blocks `g` describes, in device memory
    /// of the stream's context that stays alive until the GEMM ran.
    pub(crate) fn gemm_grouped(&self, stream: &CudaStream, g: &Grouped<'_>, arrays: &DeviceTensor) -> Result<()> {
        let groups = g.m.len();
        if groups == 0 {
            return Ok(());
        }
        if g.x.len() != groups || g.w.len() != groups || g.y.len() != groups || arrays.desc().size_bytes() < 24 * groups
        {
            return Err(Error::Backend(format!("grouped GEMM: {groups} groups, arrays too short")));
        }
        if g.m.iter().any(|&m| m <= 0)
            || g.k > i32::MAX as usize
            || g.n > i32::MAX as usize
            || groups > i32::MAX as usize
        {
            return Err(Error::Unsupported(format!(
                "grouped GEMM of {groups} groups, k {}, n {}: out of range",
                g.k, g.n
            )));
        }
        // Row-major Y = X · W is column-major Y^T = W^T · X^T: A = W, B = X, C = Y.
        let host: Vec<u64> = g.w.iter().chain(g.x).chain(g.y).copied().collect();
        let bytes = std::mem::size_of_val(host.as_slice());
        // SAFETY: `arrays` holds at least `bytes` bytes of device memory (checked above); the
        // source is pageable host memory, which an async copy stages before it returns, so
        // `host` may be dropped after; the copy is ordered on `stream` after the work before it.
        unsafe {
            cudarc::driver::sys::cuMemcpyHtoDAsync_v2(
                arrays.ptr(),
                host.as_ptr() as *const c_void,
                bytes,
                stream.cu_stream(),
            )
        }
        .result()
        .map_err(|e| Error::Backend(format!("CUDA: copy GEMM pointers: {e:?}")))?;
        let (n, k) = (g.n as i32, g.k as i32);
        let ops = vec![cublasOperation_t::CUBLAS_OP_N; groups];
        let (ms, ns, ks) = (vec![n; groups], g.m.to_vec(), vec![k; groups]);
        let (lda, ldb, ldc) = (vec![n; groups], vec![k; groups], vec![n; groups]);
        let (alpha, beta) = (vec![1.0f32; groups], vec![0.0f32; groups]);
        let sizes = vec![1i32; groups];
        let (a, b, c) = (arrays.ptr(), arrays.ptr() + 8 * groups as u64, arrays.ptr() + 16 * groups as u64);
        // SAFETY: every host array holds `groups` entries; the device pointer arrays were copied
        // above in this stream's order; the caller's addresses hold the blocks described; alpha
        // and beta are host FP32 (compute type 32F, host pointer mode).
        unsafe {
            cudarc::cublas::sys::cublasGemmGroupedBatchedEx(
                *self.blas.handle(),
                ops.as_ptr(),
                ops.as_ptr(),
                ms.as_ptr(),
                ns.as_ptr(),
                ks.as_ptr(),
                alpha.as_ptr() as *const c_void,
                a as *const *const c_void,
                cudaDataType_t::CUDA_R_16BF,
                lda.as_ptr(),
                b as *const *const c_void,
                cudaDataType_t::CUDA_R_16BF,
                ldb.as_ptr(),
                beta.as_ptr() as *const c_void,
                c as *const *mut c_void,
                cudaDataType_t::CUDA_R_16BF,
                ldc.as_ptr(),
                groups as i32,
                sizes.as_ptr(),
                cublasComputeType_t::CUBLAS_COMPUTE_32F,
            )
        }
        .result()
        .map_err(blas_error)
    }
}

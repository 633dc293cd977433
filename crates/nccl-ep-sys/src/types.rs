//! The C types of `nccl_ep.h` (NCCL EP 0.1), with the NCCL and CUDA types they use. Layouts follow
//! the header on x86-64/aarch64 Linux (`unsigned long` is 64 bits).

use std::ffi::{c_int, c_uint, c_ulong, c_void};

/// `ncclResult_t` (0 = `ncclSuccess`).
pub type NcclResult = c_int;
/// `ncclSuccess`.
pub const NCCL_SUCCESS: NcclResult = 0;
/// `ncclUnhandledCudaError`: a CUDA call failed.
pub const NCCL_UNHANDLED_CUDA_ERROR: NcclResult = 1;
/// `ncclSystemError`: a system call failed (memory, threads).
pub const NCCL_SYSTEM_ERROR: NcclResult = 2;
/// `ncclInternalError`: a bug of the library.
pub const NCCL_INTERNAL_ERROR: NcclResult = 3;
/// `ncclInvalidArgument`: a null or malformed argument.
pub const NCCL_INVALID_ARGUMENT: NcclResult = 4;
/// `ncclInvalidUsage`: arguments well-formed, but not allowed here (a wrong sequence, an
/// unsupported combination).
pub const NCCL_INVALID_USAGE: NcclResult = 5;
/// `ncclRemoteError`: a peer failed.
pub const NCCL_REMOTE_ERROR: NcclResult = 6;
/// `ncclDataType_t`.
pub type NcclDataType = c_int;
/// `ncclInt8`.
pub const NCCL_INT8: NcclDataType = 0;
/// `ncclUint8`.
pub const NCCL_UINT8: NcclDataType = 1;
/// `ncclInt32`.
pub const NCCL_INT32: NcclDataType = 2;
/// `ncclUint32`.
pub const NCCL_UINT32: NcclDataType = 3;
/// `ncclInt64`.
pub const NCCL_INT64: NcclDataType = 4;
/// `ncclFloat16`.
pub const NCCL_FLOAT16: NcclDataType = 6;
/// `ncclFloat32`.
pub const NCCL_FLOAT32: NcclDataType = 7;
/// `ncclBfloat16`.
pub const NCCL_BFLOAT16: NcclDataType = 9;
/// `ncclFloat8e4m3`.
pub const NCCL_FLOAT8_E4M3: NcclDataType = 10;
/// `ncclFloat8e5m2`.
pub const NCCL_FLOAT8_E5M2: NcclDataType = 11;
/// `ncclFloat4x2` (two FP4 values per byte; NCCL EP API v2 defines it where NCCL does not).
pub const NCCL_FLOAT4X2: NcclDataType = 12;

/// `ncclComm_t` (opaque).
pub type NcclComm = *mut c_void;
/// `cudaStream_t` / `CUstream` (opaque).
pub type CudaStream = *mut c_void;
/// `cudaError_t` (0 = success).
pub type CudaError = c_int;

/// `ncclWindow_t` (opaque NCCL window handle).
pub type NcclWindow = *mut c_void;

/// `NCCL_EP_MAGIC`: the second field of every API struct but tensors.
pub const NCCL_EP_MAGIC: c_uint = 0xC00F_FFEE;
/// `NCCL_EP_TENSOR_MAGIC`: the second field of a caller-initialised tensor descriptor.
pub const NCCL_EP_TENSOR_MAGIC: c_uint = 0xCAFE_CAFE;
/// `NCCL_EP_API_VERSION`: the feature-set version a group config declares.
pub const NCCL_EP_API_VERSION: c_uint = 1;
/// `NCCL_EP_VERSION_CODE` of the release these types are: 0.1.0 (`MAJOR * 10000 + MINOR * 100 +
/// PATCH`).
pub const NCCL_EP_VERSION_CODE: c_int = 100;
/// `NCCL_EP_AUTO`: let the library choose (sizes, channels, QPs, SMs).
pub const NCCL_EP_AUTO: c_uint = 0;

/// `ncclEpAlgorithm_t`.
pub type NcclEpAlgorithm = c_int;
/// Low-latency.
pub const NCCL_EP_ALGO_LOW_LATENCY: NcclEpAlgorithm = 0;
/// High-throughput.
pub const NCCL_EP_ALGO_HIGH_THROUGHPUT: NcclEpAlgorithm = 1;

/// `ncclEpLayout_t`: the receive buffer layout of a handle.
pub type NcclEpLayout = c_int;
/// Unset (an error to pass).
pub const NCCL_EP_LAYOUT_UNSET: NcclEpLayout = 0;
/// Expert-major: LL tokens `[L, R * M, H]`; HT tokens grouped by expert.
pub const NCCL_EP_LAYOUT_EXPERT_MAJOR: NcclEpLayout = 1;
/// Rank-major (LL only): tokens `[R, M, H]` with weights and indices.
pub const NCCL_EP_LAYOUT_RANK_MAJOR: NcclEpLayout = 2;
/// Flat (HT only): tokens `[slots, H]` with weights and indices `[slots, K]`.
pub const NCCL_EP_LAYOUT_FLAT: NcclEpLayout = 3;

/// `ncclEpPassDir_t`.
pub type NcclEpPassDir = c_int;
/// Forward pass.
pub const NCCL_EP_FWD_PASS: NcclEpPassDir = 0;
/// Backward pass (high-throughput only).
pub const NCCL_EP_BWD_PASS: NcclEpPassDir = 1;

/// `ncclEpTensor_t`: an n-dimensional tensor description (the data stays where it is; the
/// caller owns `data` and `sizes`, which must outlive every call that sees the descriptor).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct NcclEpTensor {
    /// `sizeof(ncclEpTensor_t)`.
    pub size: c_uint,
    /// [`NCCL_EP_TENSOR_MAGIC`].
    pub magic: c_uint,
    /// Number of dimensions.
    pub ndim: c_uint,
    /// Element type.
    pub datatype: NcclDataType,
    /// Device address of the data.
    pub data: *mut c_void,
    /// NCCL window (null for plain device memory).
    pub win_hdl: NcclWindow,
    /// Byte offset within `win_hdl`.
    pub win_offset: u64,
    /// `[ndim]` sizes.
    pub sizes: *mut usize,
}

impl NcclEpTensor {
    /// A descriptor of `data` with the given sizes (`sizes` must outlive its use).
    pub fn new(datatype: NcclDataType, data: *mut c_void, sizes: &mut [usize]) -> Self {
        NcclEpTensor {
            size: std::mem::size_of::<Self>() as c_uint,
            magic: NCCL_EP_TENSOR_MAGIC,
            ndim: sizes.len() as c_uint,
            datatype,
            data,
            win_hdl: std::ptr::null_mut(),
            win_offset: 0,
            sizes: sizes.as_mut_ptr(),
        }
    }
}

/// `ncclEpTensorAllocConfig_t` (reserved: size and magic only).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct NcclEpTensorAllocConfig {
    /// `sizeof(ncclEpTensorAllocConfig_t)`.
    pub size: c_uint,
    /// [`NCCL_EP_MAGIC`].
    pub magic: c_uint,
}

impl Default for NcclEpTensorAllocConfig {
    fn default() -> Self {
        NcclEpTensorAllocConfig { size: std::mem::size_of::<Self>() as c_uint, magic: NCCL_EP_MAGIC }
    }
}

/// `ncclEpAllocFn_t`: `cudaError_t (*)(void** ptr, size_t size, void* context)`.
pub type NcclEpAllocFn = Option<unsafe extern "C" fn(*mut *mut c_void, usize, *mut c_void) -> CudaError>;
/// `ncclEpFreeFn_t`: `cudaError_t (*)(void* ptr, void* context)`.
pub type NcclEpFreeFn = Option<unsafe extern "C" fn(*mut c_void, *mut c_void) -> CudaError>;

/// `ncclEpAllocConfig_t` (all null: `cudaMalloc` / `cudaFree`).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct NcclEpAllocConfig {
    /// Device allocator, or null.
    pub alloc_fn: NcclEpAllocFn,
    /// Device free function, or null.
    pub free_fn: NcclEpFreeFn,
    /// Passed to both.
    pub context: *mut c_void,
}

impl Default for NcclEpAllocConfig {
    fn default() -> Self {
        NcclEpAllocConfig { alloc_fn: None, free_fn: None, context: std::ptr::null_mut() }
    }
}

/// `ncclEpGroupConfig_t`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct NcclEpGroupConfig {
    /// `sizeof(ncclEpGroupConfig_t)`.
    pub size: c_uint,
    /// [`NCCL_EP_MAGIC`].
    pub magic: c_uint,
    /// [`NCCL_EP_API_VERSION`].
    pub version: c_uint,
    /// [`NCCL_EP_ALGO_LOW_LATENCY`] or [`NCCL_EP_ALGO_HIGH_THROUGHPUT`].
    pub algorithm: NcclEpAlgorithm,
    /// Experts over the group.
    pub num_experts: c_uint,
    /// Most tokens any rank dispatches (required, the same on every rank).
    pub max_dispatch_tokens_per_rank: c_uint,
    /// Most tokens any rank receives (HT: required; LL: [`NCCL_EP_AUTO`] = `R * M`).
    pub max_recv_tokens_per_rank: c_uint,
    /// Upper bound of one token's bytes (dispatch and combine).
    pub max_token_bytes: c_uint,
    /// LL staging bytes ([`NCCL_EP_AUTO`]).
    pub rdma_buffer_size: c_ulong,
    /// Queue pairs per rank ([`NCCL_EP_AUTO`]).
    pub num_qp_per_rank: c_uint,
    /// Channels per rank ([`NCCL_EP_AUTO`]).
    pub num_channels: c_uint,
    /// Most SMs the kernels use ([`NCCL_EP_AUTO`]).
    pub max_num_sms: c_uint,
    /// Device allocator.
    pub alloc: NcclEpAllocConfig,
    /// Active-mask fault tolerance (LL).
    pub enable_mask: c_uint,
    /// GPU wait timeout in nanoseconds (0: the library's default, ~100 s).
    pub timeout_ns: u64,
}

impl Default for NcclEpGroupConfig {
    fn default() -> Self {
        NcclEpGroupConfig {
            size: std::mem::size_of::<Self>() as c_uint,
            magic: NCCL_EP_MAGIC,
            version: NCCL_EP_API_VERSION,
            algorithm: NCCL_EP_ALGO_LOW_LATENCY,
            num_experts: 0,
            max_dispatch_tokens_per_rank: 0,
            max_recv_tokens_per_rank: NCCL_EP_AUTO,
            max_token_bytes: 0,
            rdma_buffer_size: 0,
            num_qp_per_rank: NCCL_EP_AUTO,
            num_channels: NCCL_EP_AUTO,
            max_num_sms: NCCL_EP_AUTO,
            alloc: NcclEpAllocConfig::default(),
            enable_mask: 0,
            timeout_ns: 0,
        }
    }
}

/// Declares a `size`/`magic`-headed API struct with a [`Default`] that fills both.
macro_rules! api_struct {
    ($(#[$m:meta])* $name:ident { $($(#[$fm:meta])* $f:ident : $t:ty = $d:expr),* $(,)? }) => {
        $(#[$m])*
        #[repr(C)]
        #[derive(Clone, Copy, Debug)]
        pub struct $name {
            /// `sizeof` the struct.
            pub size: c_uint,
            /// [`NCCL_EP_MAGIC`].
            pub magic: c_uint,
            $($(#[$fm])* pub $f: $t,)*
        }

        impl Default for $name {
            fn default() -> Self {
                $name { size: std::mem::size_of::<Self>() as c_uint, magic: NCCL_EP_MAGIC, $($f: $d,)* }
            }
        }
    };
}

api_struct!(
    /// `ncclEpLayoutInfo_t`: counters a handle or a dispatch fills (all optional).
    NcclEpLayoutInfo {
        /// `[L]` int32: tokens received per local expert.
        expert_counters: *mut NcclEpTensor = std::ptr::null_mut(),
        /// `[R]` int32: tokens received per source rank (LL rank-major).
        src_rank_counters: *mut NcclEpTensor = std::ptr::null_mut(),
        /// `[L]` prefix sums (HT expert-major).
        expert_offsets: *mut NcclEpTensor = std::ptr::null_mut(),
        /// `[1]`: tokens received (HT, written at handle creation; flat layout unpadded).
        recv_total_counter: *mut NcclEpTensor = std::ptr::null_mut(),
    }
);

api_struct!(
    /// `ncclEpDispatchInputs_t`.
    NcclEpDispatchInputs {
        /// `[B, H]` tokens (required).
        tokens: *mut NcclEpTensor = std::ptr::null_mut(),
        /// `[B, K]` fp32 weights.
        topk_weights: *mut NcclEpTensor = std::ptr::null_mut(),
        /// Reserved.
        scales: *mut NcclEpTensor = std::ptr::null_mut(),
    }
);

api_struct!(
    /// `ncclEpDispatchOutputs_t`.
    NcclEpDispatchOutputs {
        /// Received tokens (required).
        tokens: *mut NcclEpTensor = std::ptr::null_mut(),
        /// Received weights (LL rank-major, HT).
        topk_weights: *mut NcclEpTensor = std::ptr::null_mut(),
        /// Reserved.
        scales: *mut NcclEpTensor = std::ptr::null_mut(),
        /// Received local expert indices (LL rank-major, HT flat).
        topk_idx: *mut NcclEpTensor = std::ptr::null_mut(),
    }
);

api_struct!(
    /// `ncclEpCombineInputs_t`.
    NcclEpCombineInputs {
        /// Expert outputs, shaped as the dispatch's received tokens (required).
        tokens: *mut NcclEpTensor = std::ptr::null_mut(),
        /// HT backward: `[N, K]` weight gradients.
        topk_weights: *mut NcclEpTensor = std::ptr::null_mut(),
    }
);

api_struct!(
    /// `ncclEpCombineOutputs_t`.
    NcclEpCombineOutputs {
        /// `[B, H]` combined tokens (required).
        tokens: *mut NcclEpTensor = std::ptr::null_mut(),
        /// LL expert-major: the weights applied; HT backward: weight gradients.
        topk_weights: *mut NcclEpTensor = std::ptr::null_mut(),
    }
);

api_struct!(
    /// `ncclEpHandleConfig_t`.
    NcclEpHandleConfig {
        /// HT expert-major: per-expert alignment in tokens.
        dispatch_output_per_expert_alignment: usize = 0,
    }
);

api_struct!(
    /// `ncclEpDispatchConfig_t`.
    NcclEpDispatchConfig {
        /// Non-zero: only start the transfers; `ncclEpComplete` finishes (LL only).
        send_only: c_uint = 0,
        /// Round FP8 scales up to powers of two.
        round_scales: c_uint = 0,
        /// Forward or backward (HT only).
        pass_direction: NcclEpPassDir = NCCL_EP_FWD_PASS,
    }
);

api_struct!(
    /// `ncclEpCombineConfig_t`.
    NcclEpCombineConfig {
        /// Non-zero: only start the transfers; `ncclEpComplete` finishes (LL only).
        send_only: c_uint = 0,
        /// Forward or backward (HT only).
        pass_direction: NcclEpPassDir = NCCL_EP_FWD_PASS,
    }
);

api_struct!(
    /// `ncclEpCompleteConfig_t` (reserved).
    NcclEpCompleteConfig {}
);

/// `struct ncclEpGroup` (opaque).
#[repr(C)]
#[derive(Debug)]
pub struct NcclEpGroupOpaque {
    _private: [u8; 0],
}

/// `ncclEpGroup_t`.
pub type NcclEpGroup = *mut NcclEpGroupOpaque;

/// `struct ncclEpHandle` (opaque).
#[repr(C)]
#[derive(Debug)]
pub struct NcclEpHandleOpaque {
    _private: [u8; 0],
}

/// `ncclEpHandle_t`.
pub type NcclEpHandle = *mut NcclEpHandleOpaque;

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::{offset_of, size_of};

    #[test]
    fn layouts_match_the_header() {
        assert_eq!(size_of::<NcclEpTensor>(), 48);
        assert_eq!(offset_of!(NcclEpTensor, data), 16);
        assert_eq!(offset_of!(NcclEpTensor, sizes), 40);
        assert_eq!(size_of::<NcclEpGroupConfig>(), 96);
        assert_eq!(offset_of!(NcclEpGroupConfig, rdma_buffer_size), 32);
        assert_eq!(offset_of!(NcclEpGroupConfig, max_num_sms), 48);
        assert_eq!(offset_of!(NcclEpGroupConfig, alloc), 56);
        assert_eq!(offset_of!(NcclEpGroupConfig, enable_mask), 80);
        assert_eq!(offset_of!(NcclEpGroupConfig, timeout_ns), 88);
        assert_eq!(size_of::<NcclEpLayoutInfo>(), 40);
        assert_eq!(size_of::<NcclEpDispatchInputs>(), 32);
        assert_eq!(size_of::<NcclEpDispatchOutputs>(), 40);
        assert_eq!(size_of::<NcclEpCombineInputs>(), 24);
        assert_eq!(size_of::<NcclEpHandleConfig>(), 16);
        assert_eq!(size_of::<NcclEpDispatchConfig>(), 20);
        assert_eq!(size_of::<NcclEpCombineConfig>(), 16);
        assert_eq!(size_of::<NcclEpCompleteConfig>(), 8);
        assert_eq!(size_of::<NcclEpTensorAllocConfig>(), 8);
    }

    #[test]
    fn defaults_carry_size_and_magic() {
        let c = NcclEpDispatchConfig::default();
        assert_eq!((c.size, c.magic), (20, NCCL_EP_MAGIC));
        let g = NcclEpGroupConfig::default();
        assert_eq!((g.size, g.magic, g.version), (96, NCCL_EP_MAGIC, NCCL_EP_API_VERSION));
        let mut dims = [4usize, 7168];
        let t = NcclEpTensor::new(NCCL_BFLOAT16, std::ptr::null_mut(), &mut dims);
        assert_eq!((t.size, t.magic, t.ndim), (48, NCCL_EP_TENSOR_MAGIC, 2));
    }
}

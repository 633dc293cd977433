//! The C types of `nccl_ep.h` (NCCL EP 0.1), with the NCCL and CUDA types they use. Layouts follow
//! the header on x86-64/aarch64 Linux (`unsigned long` is 64 bits).

use std::ffi::{c_int, c_uint, c_ulong, c_void};

/// `ncclResult_t` (0 = `ncclSuccess`).
pub type NcclResult = c_int;
/// `ncclSuccess`.
pub const NCCL_SUCCESS: NcclResult = 0;
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

/// `ncclComm_t` (opaque).
pub type NcclComm = *mut c_void;
/// `cudaStream_t` / `CUstream` (opaque).
pub type CudaStream = *mut c_void;
/// `cudaError_t` (0 = success).
pub type CudaError = c_int;

/// `ncclEpTensorTag_t`.
pub type NcclEpTensorTag = c_uint;
/// No tag.
pub const NCCL_EP_TENSOR_TAG_NONE: NcclEpTensorTag = 0;
/// Tokens.
pub const NCCL_EP_TENSOR_TAG_TOKENS: NcclEpTensorTag = 1;
/// Top-k expert indices.
pub const NCCL_EP_TENSOR_TAG_TOPK_IDX: NcclEpTensorTag = 2;
/// Top-k weights.
pub const NCCL_EP_TENSOR_TAG_TOPK_WEIGHTS: NcclEpTensorTag = 3;
/// FP8 scales.
pub const NCCL_EP_TENSOR_TAG_SCALES: NcclEpTensorTag = 4;
/// Tokens received per expert, device memory.
pub const NCCL_EP_TENSOR_TAG_RECV_EXPERT_COUNTER_DEVICE: NcclEpTensorTag = 5;
/// Tokens received per expert, pinned host memory.
pub const NCCL_EP_TENSOR_TAG_RECV_EXPERT_COUNTER_HOST: NcclEpTensorTag = 6;
/// Tokens per expert (low-latency local tensor).
pub const NCCL_EP_TENSOR_TAG_TOKENS_PER_EXPERTS: NcclEpTensorTag = 7;

/// `ncclEpTensorFlags_t`.
pub type NcclEpTensorFlags = c_int;
/// `NCCL_EP_TENSOR_FLAG_NONE`.
pub const NCCL_EP_TENSOR_FLAG_NONE: NcclEpTensorFlags = 0;

/// `ncclEpAlgorithm_t`.
pub type NcclEpAlgorithm = c_int;
/// Low-latency.
pub const NCCL_EP_ALGO_LOW_LATENCY: NcclEpAlgorithm = 0;
/// High-throughput.
pub const NCCL_EP_ALGO_HIGH_THROUGHPUT: NcclEpAlgorithm = 1;

/// `NCCL_EP_AUTO`: let the library choose (sizes, channels, QPs).
pub const NCCL_EP_AUTO: c_uint = 0;
/// The `version` the structs of NCCL EP 0.1 carry ("1.0.0").
pub const NCCL_EP_STRUCT_VERSION: c_uint = 1;

/// `ncclNDTensor_t`: an n-dimensional tensor description (the data stays where it is).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct NcclNdTensor {
    /// Structure version ([`NCCL_EP_STRUCT_VERSION`]).
    pub version: c_uint,
    /// Number of dimensions.
    pub ndim: c_uint,
    /// `[ndim]` sizes.
    pub sizes: *mut c_uint,
    /// `[ndim]` strides, in elements.
    pub strides: *mut c_uint,
    /// Element type.
    pub datatype: NcclDataType,
    /// Device (or pinned host) address of the data.
    pub data: *mut c_void,
    /// What the tensor holds (`NCCL_EP_TENSOR_TAG_*`).
    pub tag: c_uint,
    /// Flags ([`NCCL_EP_TENSOR_FLAG_NONE`]).
    pub flags: NcclEpTensorFlags,
}

/// `ncclEpGroupConfig_t`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NcclEpGroupConfig {
    /// Structure version ([`NCCL_EP_STRUCT_VERSION`]).
    pub version: c_uint,
    /// [`NCCL_EP_ALGO_LOW_LATENCY`] or [`NCCL_EP_ALGO_HIGH_THROUGHPUT`].
    pub algorithm: NcclEpAlgorithm,
    /// Experts over the group.
    pub num_experts: c_uint,
    /// Most tokens any rank dispatches (required by NCCL EP 0.1, also for high-throughput).
    pub max_tokens_per_rank: c_uint,
    /// Bytes of one token (buffer sizing).
    pub token_size_bytes: c_uint,
    /// RDMA buffer bytes ([`NCCL_EP_AUTO`]).
    pub rdma_buffer_size: c_ulong,
    /// Queue pairs per rank ([`NCCL_EP_AUTO`]).
    pub num_qp_per_rank: c_uint,
    /// Channels per rank, two SMs each in high-throughput ([`NCCL_EP_AUTO`]).
    pub num_channels: c_uint,
}

/// `ncclEpDispatchConfig_t`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NcclEpDispatchConfig {
    /// Round FP8 scales up to powers of two.
    pub round_scales: c_uint,
}

/// `struct ncclEpGroup` (opaque).
#[repr(C)]
pub struct NcclEpGroupOpaque {
    _private: [u8; 0],
}
/// `ncclEpGroup_t`.
pub type NcclEpGroup = *mut NcclEpGroupOpaque;

/// `struct ncclEpHandle` (opaque).
#[repr(C)]
pub struct NcclEpHandleOpaque {
    _private: [u8; 0],
}
/// `ncclEpHandle_t`.
pub type NcclEpHandle = *mut NcclEpHandleOpaque;

/// `ncclEpAllocFn_t`: `cudaError_t (*)(void** ptr, size_t size)`.
pub type NcclEpAllocFn = Option<unsafe extern "C" fn(*mut *mut c_void, usize) -> CudaError>;
/// `ncclEpFreeFn_t`: `cudaError_t (*)(void* ptr)`.
pub type NcclEpFreeFn = Option<unsafe extern "C" fn(*mut c_void) -> CudaError>;

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::{offset_of, size_of};

    #[test]
    fn layouts_match_the_header() {
        assert_eq!(size_of::<NcclNdTensor>(), 48);
        assert_eq!(offset_of!(NcclNdTensor, sizes), 8);
        assert_eq!(offset_of!(NcclNdTensor, datatype), 24);
        assert_eq!(offset_of!(NcclNdTensor, data), 32);
        assert_eq!(offset_of!(NcclNdTensor, tag), 40);
        assert_eq!(size_of::<NcclEpGroupConfig>(), 40);
        assert_eq!(offset_of!(NcclEpGroupConfig, rdma_buffer_size), 24);
        assert_eq!(offset_of!(NcclEpGroupConfig, num_channels), 36);
    }
}

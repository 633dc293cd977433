//! Element types of the tensors epflow reads and writes, and the type tokens travel in during
//! dispatch.

use std::fmt;

/// The element type of a tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    /// bfloat16: token activations and expert outputs.
    Bf16,
    /// IEEE binary32: top-k weights and FP8 scales.
    F32,
    /// 32-bit signed integer: per-expert receive counters.
    I32,
    /// 64-bit signed integer: top-k expert indices (`-1` = masked).
    I64,
    /// FP8 e4m3 (OCP "E4M3FN": bias 7, no infinities, max 448), one byte per element.
    Fp8E4m3,
    /// Bytes with no arithmetic meaning to epflow: the rows of a forwarded dispatch
    /// ([`DispatchDtype::Forwarded`]), whatever their elements are.
    U8,
}

impl DType {
    /// Size of one element in bytes.
    pub const fn size_bytes(self) -> usize {
        match self {
            DType::Fp8E4m3 | DType::U8 => 1,
            DType::Bf16 => 2,
            DType::F32 | DType::I32 => 4,
            DType::I64 => 8,
        }
    }

    /// Short lower-case name (`bf16`, `f32`, `i32`, `i64`, `fp8_e4m3`, `u8`).
    pub const fn name(self) -> &'static str {
        match self {
            DType::Bf16 => "bf16",
            DType::F32 => "f32",
            DType::I32 => "i32",
            DType::I64 => "i64",
            DType::Fp8E4m3 => "fp8_e4m3",
            DType::U8 => "u8",
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The element type tokens travel in during dispatch. Combine travels in BF16, or NVFP4
/// ([`CombineQuant`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DispatchDtype {
    /// BF16 in, BF16 out.
    Bf16,
    /// FP8 e4m3 with one fp32 scale per 128 channels (`scale = amax / 448`).
    ///
    /// Low-latency dispatch takes BF16 tokens and quantizes them on the fly; high-throughput
    /// dispatch takes tokens that are already FP8 together with their scales
    /// (see [`crate::fp8::quantize_bf16`]).
    Fp8 {
        /// Round every scale up to a power of two (exact rescaling, as DeepEP's `round_scale`).
        round_scales: bool,
    },
    /// Rows the caller already quantized, forwarded as bytes (NCCL EP API v2's
    /// `NCCL_EP_DISP_QUANT_FWD`): each token is `token_bytes` of payload ([`DType::U8`]
    /// `[B x token_bytes]`, e.g. FP8 or packed FP4 values) and `scale_bytes` of its scales
    /// (`[B x scale_bytes]`, in [`crate::ops::DispatchInputs::scales`]); the receiver gets both
    /// unchanged, in the layout's rows (low-latency: `[L x R*M x token_bytes]` and
    /// `[L x R*M x scale_bytes]` expert-major, `[R*M x ..]` rank-major; high-throughput:
    /// `[N x token_bytes]` and `[N x scale_bytes]`, with the top-k weights and indices as a BF16
    /// dispatch's). Nothing is converted. Per call only
    /// ([`crate::ops::DispatchOptions::dtype`]), forward dispatch of a BF16 group, on GPUs with
    /// every peer over NVLink (low-latency: into the caller's tensors): both sizes multiples of
    /// 16 and their sum at most the group's BF16 row, `2 x hidden` bytes.
    Forwarded {
        /// Bytes of a token's payload row.
        token_bytes: usize,
        /// Bytes of a token's scale row.
        scale_bytes: usize,
    },
}

impl DispatchDtype {
    /// Whether tokens travel as FP8.
    pub const fn is_fp8(self) -> bool {
        matches!(self, DispatchDtype::Fp8 { .. })
    }

    /// The row sizes of a forwarded dispatch, `(token_bytes, scale_bytes)`.
    pub const fn forwarded(self) -> Option<(usize, usize)> {
        match self {
            DispatchDtype::Forwarded { token_bytes, scale_bytes } => Some((token_bytes, scale_bytes)),
            _ => None,
        }
    }
}

/// How a combine's expert outputs travel ([`crate::ops::CombineOptions::quant`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum CombineQuant {
    /// As BF16, unchanged: the sum is exact to the CPU reference's definition.
    #[default]
    None,
    /// As NVFP4 ([`crate::nvfp4`]; NCCL EP API v2's `NCCL_EP_COMB_QUANT_NVFP4`): each expert
    /// output row is quantized to FP4 E2M1 with an E4M3 scale per 16 channels under the row's
    /// fp32 global scale, which the caller gives in [`crate::ops::CombineInputs::global_scales`]
    /// (`2688 / amax(|row|)`, 0 for an all-zero row: [`crate::nvfp4::global_scale`]); the
    /// receiver dequantizes and sums as for BF16. 3.6x fewer bytes at H = 7168; the error is
    /// [`crate::nvfp4`]'s. Low-latency forward combine only, `hidden` a multiple of 16, no NCCL
    /// peers on GPUs.
    Nvfp4,
}

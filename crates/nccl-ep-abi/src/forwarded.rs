//! API v2's `NCCL_EP_DISP_QUANT_FWD`: rows the caller quantized, forwarded as bytes by
//! epflow's low-latency dispatch (`epflow_core::DispatchDtype::Forwarded`).

use epflow_core::handle::RoutingHandle;
use epflow_core::{DType, TensorDesc, TensorTag};
use epflow_kernels::{DeviceTensor, GpuHandle};
use nccl_ep_sys as ep;

use crate::check::{self, Tensor};
use crate::group::{Group, device};
use crate::status::{Fail, Res};

/// A dispatch's pre-quantized rows (`NCCL_EP_DISP_QUANT_FWD`), checked as NCCL EP checks them:
/// `inputs.tokens` `[B, H_phys]` of fp32, fp16, bf16, fp8 (e4m3 or e5m2) or `ncclFloat4x2`,
/// `inputs.scales` `[B, S]` of fp32, fp16, bf16, fp8 or `ncclUint8`, each row a multiple of 16
/// bytes, both 16-byte aligned, together at most `max_token_bytes`.
pub(crate) struct Forwarded {
    /// The scales as bytes `[B x scale_bytes]`.
    pub(crate) scales: DeviceTensor,
    pub(crate) token_bytes: usize,
    /// Bytes of a scale row.
    pub(crate) scale_bytes: usize,
    /// `H_phys`: elements of a token row in its own type.
    pub(crate) token_elems: usize,
    /// `S`: elements of a scale row in its own type.
    pub(crate) scale_elems: usize,
}

impl Forwarded {
    /// Checks `x` (`inputs.tokens`) and `xs` (`inputs.scales`) of a dispatch on `gh`.
    pub(crate) fn check(g: &Group, gh: &GpuHandle, x: &Tensor, xs: &Tensor) -> Res<Self> {
        let b = gh.num_tokens();
        let token_size = match x.datatype {
            ep::NCCL_FLOAT32 => 4,
            ep::NCCL_FLOAT16 | ep::NCCL_BFLOAT16 => 2,
            ep::NCCL_FLOAT8_E4M3 | ep::NCCL_FLOAT8_E5M2 | ep::NCCL_FLOAT4X2 => 1,
            t => {
                return Err(Fail::arg(format!(
                    "inputs.tokens: data type {} cannot be forwarded (NCCL_EP_DISP_QUANT_FWD takes fp32, fp16, bf16, fp8 or ncclFloat4x2)",
                    check::type_name(t)
                )));
            }
        };
        let scale_size = match xs.datatype {
            ep::NCCL_FLOAT32 => 4,
            ep::NCCL_FLOAT16 | ep::NCCL_BFLOAT16 => 2,
            ep::NCCL_FLOAT8_E4M3 | ep::NCCL_FLOAT8_E5M2 | ep::NCCL_UINT8 => 1,
            t => {
                return Err(Fail::arg(format!(
                    "inputs.scales: data type {} cannot be forwarded (NCCL_EP_DISP_QUANT_FWD takes fp32, fp16, bf16, fp8 or ncclUint8)",
                    check::type_name(t)
                )));
            }
        };
        let row = |t: &Tensor, what: &str| match t.sizes[..] {
            [rows, cols] if rows == b && cols > 0 => Ok(cols),
            _ => Err(Fail::arg(format!("{what}: sizes are {:?}, expected [{b}, > 0]", t.sizes))),
        };
        let (token_elems, scale_elems) = (row(x, "inputs.tokens")?, row(xs, "inputs.scales")?);
        let (token_bytes, scale_bytes) = (token_elems * token_size, scale_elems * scale_size);
        if token_bytes % 16 != 0 || scale_bytes % 16 != 0 {
            return Err(Fail::arg(format!(
                "NCCL_EP_DISP_QUANT_FWD: token rows of {token_bytes} bytes and scale rows of {scale_bytes} bytes: each must be a multiple of 16"
            )));
        }
        let max = 2 * g.shape.hidden;
        if token_bytes + scale_bytes > max {
            return Err(Fail::arg(format!(
                "NCCL_EP_DISP_QUANT_FWD: a token row ({token_bytes} bytes) and its scales ({scale_bytes}) exceed config.max_token_bytes ({max})"
            )));
        }
        check::aligned16("inputs.tokens", x.ptr)?;
        check::aligned16("inputs.scales", xs.ptr)?;
        // The tokens as bytes `[B x token_bytes]` are made by the caller from `x`.
        Ok(Forwarded {
            scales: device(g, xs, TensorDesc::contiguous(TensorTag::Scales, DType::U8, &[b, scale_bytes])),
            token_bytes,
            scale_bytes,
            token_elems,
            scale_elems,
        })
    }
}

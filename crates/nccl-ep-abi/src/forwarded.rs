//! API v2's `NCCL_EP_DISP_QUANT_FWD`: rows the caller quantized, forwarded as bytes by
//! epflow's dispatch (`epflow_core::DispatchDtype::Forwarded`), low-latency and
//! high-throughput (flat, expert-major, after a DROP).

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
    /// The element types of `inputs.tokens` and `inputs.scales` (the outputs take them).
    pub(crate) token_type: ep::NcclDataType,
    pub(crate) scale_type: ep::NcclDataType,
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
            token_type: x.datatype,
            scale_type: xs.datatype,
            token_bytes,
            scale_bytes,
            token_elems,
            scale_elems,
        })
    }

    /// A high-throughput dispatch's outputs, checked as NCCL EP checks them
    /// (`ncclInvalidArgument`): `outputs.tokens` `[S, H_phys]` of the tokens' type and
    /// `outputs.scales` `[S, S_elems]` of the scales' type, the same `S`, at least `rows`, both
    /// 16-byte aligned, both NCCL windows or neither. Returns `S`.
    pub(crate) fn check_ht_outputs(&self, out: &Tensor, out_s: &Tensor, rows: usize) -> Res<usize> {
        let check = |t: &Tensor, what: &str, dtype, elems| -> Res<usize> {
            if t.datatype != dtype {
                return Err(Fail::arg(format!(
                    "{what}: data type is {}, expected {} (NCCL_EP_DISP_QUANT_FWD keeps the input's)",
                    check::type_name(t.datatype),
                    check::type_name(dtype)
                )));
            }
            match t.sizes[..] {
                [s, e] if e == elems && s >= rows => Ok(s),
                _ => Err(Fail::arg(format!("{what}: sizes are {:?}, expected [at least {rows}, {elems}]", t.sizes))),
            }
        };
        let s = check(out, "outputs.tokens", self.token_type, self.token_elems)?;
        let s_scales = check(out_s, "outputs.scales", self.scale_type, self.scale_elems)?;
        if s != s_scales {
            return Err(Fail::arg(format!(
                "outputs.tokens holds {s} rows and outputs.scales {s_scales}: NCCL_EP_DISP_QUANT_FWD takes the same capacity for both"
            )));
        }
        if out.windowed != out_s.windowed {
            return Err(Fail::arg(
                "outputs.tokens and outputs.scales: both NCCL windows (win_hdl) or neither (NCCL EP's high-throughput NCCL_EP_DISP_QUANT_FWD)",
            ));
        }
        check::aligned16("outputs.tokens", out.ptr)?;
        check::aligned16("outputs.scales", out_s.ptr)?;
        Ok(s)
    }

    /// Views of `buf`, a handle's own buffer of `rows` BF16 rows of `hidden` (`2 x hidden`
    /// bytes, at least `token_bytes + scale_bytes`: checked), as this dispatch's flat rows:
    /// the token rows `[rows x token_bytes]` from its start, then the scale rows
    /// `[rows x scale_bytes]`, both typed as BF16 pairs of bytes (the row copies and expert-major
    /// scatters move bytes).
    pub(crate) fn split(&self, buf: &DeviceTensor) -> (DeviceTensor, DeviceTensor) {
        let rows = buf.desc().shape.first().copied().unwrap_or(0);
        let view = |offset: usize, bytes: usize| {
            let desc = TensorDesc::contiguous(TensorTag::Tokens, DType::Bf16, &[rows, bytes / 2]);
            // SAFETY: `buf` holds `rows x 2 x hidden` bytes and `token_bytes + scale_bytes` is at
            // most `2 x hidden` (`check`), so both views lie inside it; the handle keeps `buf`
            // until every use of the views enqueued on a stream has completed (its `LastUse`).
            unsafe { DeviceTensor::from_raw(buf.ptr() + offset as u64, buf.device(), desc) }
        };
        (view(0, self.token_bytes), view(rows * self.token_bytes, self.scale_bytes))
    }

    /// The caller's `[S x token_bytes]` and `[S x scale_bytes]` outputs at `tokens` and
    /// `scales` as BF16 pairs of bytes (the expert-major scatter's rows).
    pub(crate) fn caller_views(&self, g: &Group, out: &Tensor, out_s: &Tensor, slots: usize) -> [DeviceTensor; 2] {
        let desc = |bytes: usize| TensorDesc::contiguous(TensorTag::Tokens, DType::Bf16, &[slots, bytes / 2]);
        [device(g, out, desc(self.token_bytes)), device(g, out_s, desc(self.scale_bytes))]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// FP8 rows of 16 bytes with 16 uint8 scales, as NVIDIA's test_quantization_recipe.
    fn fp8_rows() -> Forwarded {
        // SAFETY: a descriptor only: these tests never touch device memory.
        let scales = unsafe {
            DeviceTensor::from_raw(0x1000, 0, TensorDesc::contiguous(TensorTag::Scales, DType::U8, &[4, 16]))
        };
        Forwarded {
            scales,
            token_type: ep::NCCL_FLOAT8_E4M3,
            scale_type: ep::NCCL_UINT8,
            token_bytes: 16,
            scale_bytes: 16,
            token_elems: 16,
            scale_elems: 16,
        }
    }

    fn t(datatype: ep::NcclDataType, sizes: &[usize]) -> Tensor {
        Tensor { ptr: 0x2000, datatype, sizes: sizes.to_vec(), windowed: false }
    }

    /// High-throughput outputs as NCCL EP checks them: the five `HtScalesForwardRejects*` cases
    /// of NVIDIA's test_quantization_recipe are `ncclInvalidArgument`, and room for more rows
    /// than received is accepted.
    #[test]
    fn high_throughput_outputs_are_checked_as_nccl_ep_does() {
        let f = fp8_rows();
        let (e4m3, u8s) = (ep::NCCL_FLOAT8_E4M3, ep::NCCL_UINT8);
        assert_eq!(f.check_ht_outputs(&t(e4m3, &[64, 16]), &t(u8s, &[64, 16]), 64), Ok(64));
        assert_eq!(f.check_ht_outputs(&t(e4m3, &[70, 16]), &t(u8s, &[70, 16]), 64), Ok(70));
        let refused = [
            ("token width", t(e4m3, &[64, 32]), t(u8s, &[64, 16])),
            ("short capacity", t(e4m3, &[63, 16]), t(u8s, &[63, 16])),
            ("row capacities", t(e4m3, &[65, 16]), t(u8s, &[64, 16])),
            ("scale width", t(e4m3, &[64, 16]), t(u8s, &[64, 32])),
            ("token type", t(ep::NCCL_FLOAT8_E5M2, &[64, 16]), t(u8s, &[64, 16])),
            ("scale type", t(e4m3, &[64, 16]), t(ep::NCCL_FLOAT32, &[64, 16])),
            ("misaligned tokens", Tensor { ptr: 0x2001, ..t(e4m3, &[64, 16]) }, t(u8s, &[64, 16])),
            ("misaligned scales", t(e4m3, &[64, 16]), Tensor { ptr: 0x2004, ..t(u8s, &[64, 16]) }),
            ("half windows", Tensor { windowed: true, ..t(e4m3, &[64, 16]) }, t(u8s, &[64, 16])),
        ];
        for (what, out, out_s) in refused {
            let e = f.check_ht_outputs(&out, &out_s, 64).unwrap_err();
            assert_eq!(e.code, ep::NCCL_INVALID_ARGUMENT, "{what}: {}", e.message);
        }
    }

    /// A handle's `[N x H]` BF16 buffer holds the token rows from its start and the scale rows
    /// right after all of them.
    #[test]
    fn split_places_the_scale_rows_after_every_token_row() {
        let f = fp8_rows();
        // SAFETY: a descriptor only.
        let buf = unsafe {
            DeviceTensor::from_raw(0x10000, 0, TensorDesc::contiguous(TensorTag::Tokens, DType::Bf16, &[10, 64]))
        };
        let (tokens, scales) = f.split(&buf);
        assert_eq!((tokens.ptr(), tokens.desc().shape.clone()), (0x10000, vec![10, 8]));
        assert_eq!((scales.ptr(), scales.desc().shape.clone()), (0x10000 + 10 * 16, vec![10, 8]));
    }
}

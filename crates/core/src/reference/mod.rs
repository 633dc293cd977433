//! The CPU reference semantics of every operation, computed for a whole world at once
//! (all ranks' inputs in, all ranks' outputs out). Backends are checked against these.
//!
//! Arithmetic is defined exactly, so a backend can match bit for bit:
//!
//! - Dispatch copies bits. FP8 dispatch quantizes each row as [`crate::fp8`] describes.
//! - Low-latency combine: for each token, `acc = 0f32`, then for each valid `k` in ascending
//!   order `acc = fma(w[k], x_k, acc)` where `x_k` is the BF16 expert output (as fp32); the
//!   result is `acc` rounded to BF16 (nearest even). A token with no valid `k` gives 0.
//! - Low-latency rank-major: see [`rank_major`] (the expert side pre-reduces each row, combine
//!   adds one row per rank reached).
//! - High-throughput combine: `acc = 0f32`, then `acc += x_d` over the copies in ascending
//!   destination rank; rounded to BF16. Backward weight gradients: entry `k` is the value at
//!   slot `k` of the copy held by the rank that owns expert `topk_idx[k]` (0 where masked).
//!
//! [`within_bf16_rounding`] is the tolerance a backend that sums in another order must meet.

mod ht;
mod ll;
mod per_rank;
pub mod rank_major;

pub(crate) use per_rank::per_rank;

pub use ht::{HtDispatchResult, ht_combine, ht_dispatch, ht_dispatch_backward};
pub use ll::{ExpertRowFn, LlDispatchResult, ll_combine, ll_dispatch};
pub use rank_major::{
    RankMajorDispatchResult, RankRowFn, ll_combine_rank_major, ll_dispatch_rank_major, rank_major_expert_sum,
};

use half::bf16;

/// Token rows in the dispatch element type.
#[derive(Clone, Debug, PartialEq)]
pub enum Rows {
    /// BF16 rows, `rows x H`.
    Bf16(Vec<bf16>),
    /// FP8 rows, `rows x H` e4m3 bits, with `rows x H/128` scales.
    Fp8 {
        /// e4m3 bit patterns.
        q: Vec<u8>,
        /// fp32 scales.
        scales: Vec<f32>,
    },
}

impl Rows {
    /// Row `i` (of width `hidden`) as BF16 values in fp32: BF16 rows as they are, FP8 rows
    /// dequantized and rounded to BF16 (what an identity expert fed FP8 would return).
    pub fn row_as_bf16_f32(&self, i: usize, hidden: usize, out: &mut [f32]) {
        match self {
            Rows::Bf16(v) => {
                for (o, x) in out.iter_mut().zip(&v[i * hidden..(i + 1) * hidden]) {
                    *o = x.to_f32();
                }
            }
            Rows::Fp8 { q, scales } => {
                let cols = hidden / crate::config::FP8_BLOCK;
                for (c, o) in out.iter_mut().enumerate().take(hidden) {
                    let v =
                        crate::fp8::e4m3_to_f32(q[i * hidden + c]) * scales[i * cols + c / crate::config::FP8_BLOCK];
                    *o = bf16::from_f32(v).to_f32();
                }
            }
        }
    }

    /// Number of rows of width `hidden`.
    pub fn num_rows(&self, hidden: usize) -> usize {
        match self {
            Rows::Bf16(v) => v.len() / hidden.max(1),
            Rows::Fp8 { q, .. } => q.len() / hidden.max(1),
        }
    }

    /// The BF16 rows, if BF16.
    pub fn as_bf16(&self) -> Option<&[bf16]> {
        match self {
            Rows::Bf16(v) => Some(v),
            Rows::Fp8 { .. } => None,
        }
    }
}

/// Input tokens of one rank: BF16 rows, or FP8 rows with their scales.
#[derive(Clone, Copy, Debug)]
pub enum TokensRef<'a> {
    /// BF16 `[B x H]`.
    Bf16(&'a [bf16]),
    /// FP8 `[B x H]` with scales `[B x H/128]`.
    Fp8 {
        /// e4m3 bit patterns.
        q: &'a [u8],
        /// fp32 scales.
        scales: &'a [f32],
    },
}

/// `x` rounded to BF16, as fp32.
fn round_bf16(x: f32) -> bf16 {
    bf16::from_f32(x)
}

/// Whether `got` is within BF16 rounding of the exact value: `|got - exact| <=
/// 2^-8 * magnitude + ulp(exact)`, where `magnitude` is the sum of the absolute values of the
/// terms that were added (each term may have been rounded to BF16 once, then the result).
pub fn within_bf16_rounding(got: bf16, exact: f32, magnitude: f32) -> bool {
    let g = got.to_f32();
    if g.is_nan() || exact.is_nan() {
        return false;
    }
    let ulp = bf16_ulp(exact);
    (g - exact).abs() <= magnitude * 2f32.powi(-8) + ulp
}

/// The distance between `x` (rounded to BF16) and the next BF16 value away from zero.
pub fn bf16_ulp(x: f32) -> f32 {
    let b = bf16::from_f32(x.abs());
    let next = bf16::from_bits(b.to_bits() + 1);
    (next.to_f32() - b.to_f32()).abs()
}

/// Whether `a` and `b` differ by at most one BF16 ulp (adjacent or equal bit patterns of the same
/// sign, or both zero).
pub fn within_one_ulp(a: bf16, b: bf16) -> bool {
    if a.to_f32() == 0.0 && b.to_f32() == 0.0 {
        return true;
    }
    if a.is_sign_negative() != b.is_sign_negative() {
        return (a.to_f32() - b.to_f32()).abs() <= 2.0 * bf16_ulp(0.0);
    }
    a.to_bits().abs_diff(b.to_bits()) <= 1
}

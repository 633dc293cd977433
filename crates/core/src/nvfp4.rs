//! NVFP4: the low-latency combine's quantized transport ([`crate::dtype::CombineQuant::Nvfp4`],
//! NCCL EP API v2's `NCCL_EP_COMB_QUANT_NVFP4`).
//!
//! An expert-output row of `H` BF16 channels travels as FP4 E2M1 codes (1 sign, 2 exponent, 1
//! mantissa bit: ±{0, 0.5, 1, 1.5, 2, 3, 4, 6}), two per byte, with one FP8 E4M3 block scale per
//! 16 channels and the row's fp32 global scale `g`, which the caller computes (NVIDIA's contract:
//! `g = 2688 / amax(|row|)`, 0 for an all-zero row; [`global_scale`]; 2688 = 448 x 6, the largest
//! E4M3 times the largest E2M1). The receiver dequantizes and sums as the BF16 combine does.
//!
//! Every step is an IEEE fp32 operation, rounded to nearest even, so that the CPU reference
//! matches the GPU bit for bit. Per block of 16 channels `x_i`:
//!
//! ```text
//! A     = max |x_i|
//! sf    = e4m3((A / 6) * g)                 // saturating, as crate::fp8::f32_to_e4m3
//! s     = f32(sf)
//! enc   = s == 0 ? 0 : g / s
//! q_i   = e2m1(x_i * enc)                   // nearest, ties to even, saturating at ±6
//! dec   = (s == 0 || g == 0) ? 0 : s / g    // on the receiver
//! x'_i  = f32(q_i) * dec
//! ```
//!
//! `e2m1` rounds to the nearest code, ties to the even code (0.25 -> 0, 0.75 -> 1, 1.25 -> 1,
//! 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4), magnitudes above 6 and NaN give ±6, and the sign is
//! kept (-0 included). Code `c` of byte `j` of a row's codes is channel `2 j + c` (low nibble
//! first).
//!
//! **Error** ([`element_error_bound`]), for a finite `g >= 0`: when `A g / 6 >= 2^-6` (the block
//! scale is a normal E4M3 number; true for every block with `A >= amax / 28672` when
//! `g = 2688 / amax`) `|x'_i - x_i| <= A (1 + 2^-4) / 6 = 0.1771 A` (half the E2M1 spacing at
//! the top, 1, scaled back, with the block scale's rounding); otherwise `|x'_i - x_i| <= 1.5 A`.
//! A combined token's error is at most the sum over its rows of `|w_k|` times that, plus the BF16
//! rounding of the result.

use half::bf16;

use crate::fp8::{e4m3_to_f32, f32_to_e4m3};

/// Channels per block scale.
pub const BLOCK: usize = 16;
/// Largest E2M1 magnitude.
pub const E2M1_MAX: f32 = 6.0;
/// The numerator of NVIDIA's global scale, `448 x 6`: `g = 2688 / amax`.
pub const GLOBAL_SCALE_NUMERATOR: f32 = 2688.0;
/// Bytes of the row header that carries `g` (fp32, padded to 16 bytes for aligned loads).
pub const HEADER_BYTES: usize = 16;

/// E2M1 values by code (bit 3 the sign).
const E2M1_VALUES: [f32; 16] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0];

/// Converts an fp32 value to its 4-bit E2M1 code (see the module docs for the rounding).
pub fn f32_to_e2m1(x: f32) -> u8 {
    let a = x.abs();
    let magnitude = if a <= 0.25 {
        0
    } else if a < 0.75 {
        1
    } else if a <= 1.25 {
        2
    } else if a < 1.75 {
        3
    } else if a <= 2.5 {
        4
    } else if a < 3.5 {
        5
    } else if a <= 5.0 {
        6
    } else {
        7 // above 5, saturated past 6, and NaN
    };
    if x.is_sign_negative() { magnitude | 8 } else { magnitude }
}

/// The fp32 value of a 4-bit E2M1 code (its low 4 bits).
pub fn e2m1_to_f32(code: u8) -> f32 {
    E2M1_VALUES[(code & 15) as usize]
}

/// A row's global scale as NVIDIA's contract defines it: `2688 / max |x|`, 0 for an all-zero row.
pub fn global_scale(row: &[bf16]) -> f32 {
    let amax = row.iter().fold(0f32, |m, v| m.max(v.to_f32().abs()));
    if amax == 0.0 { 0.0 } else { GLOBAL_SCALE_NUMERATOR / amax }
}

/// Bytes of one row's codes and block scales: `hidden / 2` bytes of codes, then `hidden / 16`
/// block scales (what [`quantize_row`] writes, without the global scale).
pub const fn payload_bytes(hidden: usize) -> usize {
    hidden / 2 + hidden / BLOCK
}

/// Bytes of one row of `hidden` channels on the wire: the header, then [`payload_bytes`].
pub const fn row_bytes(hidden: usize) -> usize {
    HEADER_BYTES + payload_bytes(hidden)
}

/// The E4M3 block scale of a block whose largest magnitude is `amax`, under global scale `g`.
fn block_scale_code(amax: f32, g: f32) -> u8 {
    f32_to_e4m3((amax / E2M1_MAX) * g)
}

/// Quantizes one row (`hidden`, a multiple of 16, channels) under global scale `g`: `codes` gets
/// `hidden / 2` bytes, `scales` `hidden / 16` E4M3 codes.
///
/// # Panics
///
/// If `row.len()` is not a multiple of 16 or the outputs are shorter than that.
pub fn quantize_row(row: &[bf16], g: f32, codes: &mut [u8], scales: &mut [u8]) {
    assert!(row.len() % BLOCK == 0, "an NVFP4 row is whole blocks of {BLOCK}");
    for ((block, out), sf) in row.chunks_exact(BLOCK).zip(codes.chunks_exact_mut(BLOCK / 2)).zip(scales.iter_mut()) {
        let amax = block.iter().fold(0f32, |m, v| m.max(v.to_f32().abs()));
        *sf = block_scale_code(amax, g);
        let s = e4m3_to_f32(*sf);
        let enc = if s == 0.0 { 0.0 } else { g / s };
        for (byte, pair) in out.iter_mut().zip(block.chunks_exact(2)) {
            let lo = f32_to_e2m1(pair[0].to_f32() * enc);
            let hi = f32_to_e2m1(pair[1].to_f32() * enc);
            *byte = lo | (hi << 4);
        }
    }
}

/// Dequantizes one row's `codes` and `scales` (as [`quantize_row`] wrote them) under global
/// scale `g` into `out` (`2 codes.len()` values).
pub fn dequantize_row(codes: &[u8], scales: &[u8], g: f32, out: &mut [f32]) {
    for ((block, out), &sf) in codes.chunks_exact(BLOCK / 2).zip(out.chunks_exact_mut(BLOCK)).zip(scales) {
        let s = e4m3_to_f32(sf);
        let dec = if s == 0.0 || g == 0.0 { 0.0 } else { s / g };
        for (pair, &byte) in out.chunks_exact_mut(2).zip(block) {
            pair[0] = e2m1_to_f32(byte) * dec;
            pair[1] = e2m1_to_f32(byte >> 4) * dec;
        }
    }
}

/// The values the receiver sums for `row` under global scale `g`: quantized, then dequantized,
/// into `out` (`row.len()` values).
pub fn round_trip(row: &[bf16], g: f32, out: &mut [f32]) {
    let mut codes = vec![0u8; row.len() / 2];
    let mut scales = vec![0u8; row.len() / BLOCK];
    quantize_row(row, g, &mut codes, &mut scales);
    dequantize_row(&codes, &scales, g, out);
}

/// The documented bound on `|x'_i - x_i|` for each channel of `row` under global scale `g`
/// (finite, `>= 0`), into `out` (see the module docs).
pub fn element_error_bound(row: &[bf16], g: f32, out: &mut [f32]) {
    for (block, out) in row.chunks_exact(BLOCK).zip(out.chunks_exact_mut(BLOCK)) {
        let amax = block.iter().fold(0f32, |m, v| m.max(v.to_f32().abs()));
        let normal_scale = (amax / E2M1_MAX) * g >= 1.0 / 64.0;
        // (The last factor covers the fp32 roundings of enc, dec and the products.)
        let bound = if normal_scale { amax * (1.0 + 1.0 / 16.0) / E2M1_MAX * (1.0 + 1e-6) } else { 1.5 * amax };
        out.iter_mut().for_each(|b| *b = bound);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn e2m1_codes_round_to_nearest_with_ties_to_even_and_saturate() {
        let cases: &[(f32, f32)] = &[
            (0.0, 0.0),
            (0.2, 0.0),
            (0.25, 0.0),
            (0.26, 0.5),
            (0.75, 1.0),
            (0.74, 0.5),
            (1.25, 1.0),
            (1.3, 1.5),
            (1.75, 2.0),
            (2.5, 2.0),
            (2.6, 3.0),
            (3.5, 4.0),
            (3.4, 3.0),
            (5.0, 4.0),
            (5.1, 6.0),
            (6.0, 6.0),
            (1e9, 6.0),
            (f32::INFINITY, 6.0),
        ];
        for &(x, want) in cases {
            assert_eq!(e2m1_to_f32(f32_to_e2m1(x)), want, "{x}");
            assert_eq!(e2m1_to_f32(f32_to_e2m1(-x)), -want, "-{x}");
        }
        assert_eq!(f32_to_e2m1(-0.0), 8, "-0 keeps its sign");
        assert_eq!(e2m1_to_f32(f32_to_e2m1(f32::NAN)).abs(), 6.0);
        // Every code is its own value's code.
        for code in 0..16u8 {
            assert_eq!(f32_to_e2m1(e2m1_to_f32(code)), code, "{code}");
        }
    }

    #[test]
    fn a_row_of_exact_values_comes_back_exactly() {
        // One block whose amax is 6 under g = 2688 / 6 = 448: the block scale is e4m3(448) =
        // 448, enc = 1, dec = 1, and every value of the E2M1 grid is exact.
        let vals = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0, 0.0];
        let row: Vec<bf16> = vals.iter().map(|&v| bf16::from_f32(v)).collect();
        let g = global_scale(&row);
        assert_eq!(g, 448.0);
        let mut codes = [0u8; 8];
        let mut scales = [0u8; 1];
        quantize_row(&row, g, &mut codes, &mut scales);
        assert_eq!(e4m3_to_f32(scales[0]), 448.0);
        assert_eq!(codes[0], 0x10, "channel 0 in the low nibble, channel 1 (0.5) in the high");
        let mut out = [0f32; 16];
        dequantize_row(&codes, &scales, g, &mut out);
        assert_eq!(out.to_vec(), vals.to_vec());
        assert_eq!(row_bytes(7168), 16 + 3584 + 448);
    }

    #[test]
    fn zero_rows_and_zero_scales_give_zeros() {
        let row = vec![bf16::ZERO; 32];
        assert_eq!(global_scale(&row), 0.0);
        let mut out = vec![1f32; 32];
        round_trip(&row, 0.0, &mut out);
        assert!(out.iter().all(|&v| v == 0.0));
        // A non-zero row sent with g = 0 (a caller's mistake) also comes back as zeros, not NaN.
        let row: Vec<bf16> = (0..32).map(|i| bf16::from_f32(i as f32)).collect();
        round_trip(&row, 0.0, &mut out);
        assert!(out.iter().all(|&v| v == 0.0));
    }

    #[test]
    fn round_trips_stay_within_the_documented_bound() {
        // Rows of very different magnitudes, blocks of very different ranges within a row.
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
        };
        let hidden = 256;
        let (mut out, mut bound) = (vec![0f32; hidden], vec![0f32; hidden]);
        let mut worst = 0f32;
        for r in 0..200 {
            let magnitude = 10f32.powi(r % 9 - 4);
            let row: Vec<bf16> = (0..hidden)
                .map(|c| bf16::from_f32(next() * magnitude * if (c / 16) % 3 == 0 { 1e-3 } else { 1.0 }))
                .collect();
            let g = global_scale(&row);
            round_trip(&row, g, &mut out);
            element_error_bound(&row, g, &mut bound);
            for c in 0..hidden {
                let err = (out[c] - row[c].to_f32()).abs();
                assert!(err <= bound[c], "row {r} channel {c}: |{} - {}| > {}", out[c], row[c], bound[c]);
                let amax = row[c / 16 * 16..c / 16 * 16 + 16].iter().fold(0f32, |m, v| m.max(v.to_f32().abs()));
                if amax > 0.0 {
                    worst = worst.max(err / amax);
                }
            }
        }
        // The bound is not loose by much: some element comes near a sixth of its block's amax.
        assert!(worst > 0.1, "worst relative error {worst}");
    }
}

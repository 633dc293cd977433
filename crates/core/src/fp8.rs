//! FP8 e4m3 ("E4M3FN": 1 sign, 4 exponent bits with bias 7, 3 mantissa bits, no infinities,
//! largest finite value 448) and per-128-channel quantization.
//!
//! The conversions are written out here, not taken from a crate, so that the CPU reference
//! rounds exactly as the GPU's `cvt.rn.satfinite.e4m3x2.f32` does: round to nearest, ties to
//! even, directly from fp32; finite values past 448 and infinities saturate to ±448; NaN stays
//! NaN (`0x7f`).
//!
//! Quantization of a token row, per block of 128 channels (every step an IEEE fp32 operation):
//!
//! ```text
//! amax  = max(max |x_i|, 1e-4)          // the floor keeps all-zero blocks finite
//! scale = amax / 448                     // optionally rounded up to a power of two
//! q_i   = e4m3(x_i * (1 / scale))
//! ```
//!
//! and dequantization is `e4m3_to_f32(q_i) * scale`.

use half::bf16;

use crate::config::FP8_BLOCK;

/// Largest finite e4m3 value.
pub const E4M3_MAX: f32 = 448.0;
/// Smallest amax used to compute a scale (an all-zero block gets scale `1e-4 / 448`).
pub const AMAX_FLOOR: f32 = 1e-4;
/// The e4m3 NaN bit pattern produced for a NaN input (sign cleared).
pub const E4M3_NAN: u8 = 0x7f;

/// Converts an fp32 value to e4m3: round to nearest even, saturating to ±448.
pub fn f32_to_e4m3(x: f32) -> u8 {
    if x.is_nan() {
        return E4M3_NAN;
    }
    let sign: u8 = if x.is_sign_negative() { 0x80 } else { 0 };
    let a = x.abs().min(E4M3_MAX);
    // Smallest normal e4m3 value is 2^-6; below it the step is 2^-9.
    let magnitude = if a < 1.0 / 64.0 {
        // Exact in f64: a * 2^9 is a scaling by a power of two.
        (f64::from(a) * 512.0).round_ties_even() as u8 // 0..=8; 8 is the code of 2^-6.
    } else {
        let mut exp = ((a.to_bits() >> 23) & 0xff) as i32 - 127; // a is a normal f32 here.
        let pow2 = f32::from_bits(((exp + 127) as u32) << 23); // 2^exp, exp in [-6, 8].
        let mantissa = f64::from(a) / f64::from(pow2); // in [1, 2), exact.
        let mut q = (mantissa * 8.0).round_ties_even() as i32; // 8..=16
        if q == 16 {
            q = 8;
            exp += 1;
        }
        (((exp + 7) << 3) | (q - 8)) as u8
    };
    sign | magnitude
}

/// Converts an e4m3 bit pattern to fp32 (exact; `f32::NAN` for the NaN codes). A table lookup:
/// the CPU references dequantize every FP8 row they check.
pub fn e4m3_to_f32(bits: u8) -> f32 {
    E4M3_VALUES[bits as usize]
}

/// Every e4m3 code's fp32 value, built from the bits: a normal code `(1 + m/8) * 2^(e-7)` is
/// the fp32 with exponent `e - 7` and mantissa `m` in its top three bits; a subnormal `m * 2^-9`
/// the fp32 of that small integer times `2^-9`, normalized.
static E4M3_VALUES: [f32; 256] = e4m3_table();

const fn e4m3_table() -> [f32; 256] {
    let mut table = [0f32; 256];
    let mut code = 0usize;
    while code < 256 {
        let sign = if code & 0x80 != 0 { 0x8000_0000u32 } else { 0 };
        let exp = ((code >> 3) & 0x0f) as u32;
        let m = (code & 0x07) as u32;
        table[code] = if exp == 0x0f && m == 0x07 {
            f32::NAN
        } else if exp != 0 {
            f32::from_bits(sign | ((exp + 127 - 7) << 23) | (m << 20))
        } else if m == 0 {
            f32::from_bits(sign)
        } else {
            // m * 2^-9 with m in 1..=7: the leading bit of m is 2^p.
            let p = 31 - m.leading_zeros();
            f32::from_bits(sign | ((127 - 9 + p) << 23) | ((m - (1 << p)) << (23 - p)))
        };
        code += 1;
    }
    table
}

/// Rounds a positive finite `scale` up to the next power of two (unchanged if it is one).
pub fn round_scale_pow2(scale: f32) -> f32 {
    let bits = scale.to_bits();
    let mantissa = bits & 0x007f_ffff;
    let exp_bits = bits & 0x7f80_0000;
    if exp_bits == 0 || mantissa == 0 {
        // Powers of two stay; subnormal scales cannot come out of amax >= 1e-4.
        return scale;
    }
    f32::from_bits(exp_bits + 0x0080_0000)
}

/// The scale of one block from its absolute maximum.
pub fn block_scale(amax: f32, round_scales: bool) -> f32 {
    let scale = amax.max(AMAX_FLOOR) / E4M3_MAX;
    if round_scales { round_scale_pow2(scale) } else { scale }
}

/// Quantizes one row of `hidden` BF16 channels (a multiple of 128) into `out` (e4m3 bits,
/// `hidden` bytes) and `scales` (`hidden / 128` fp32 values).
pub fn quantize_row(row: &[bf16], round_scales: bool, out: &mut [u8], scales: &mut [f32]) {
    for ((block, out_block), scale_out) in
        row.chunks_exact(FP8_BLOCK).zip(out.chunks_exact_mut(FP8_BLOCK)).zip(scales.iter_mut())
    {
        let amax = block.iter().fold(0.0f32, |m, v| m.max(v.to_f32().abs()));
        let scale = block_scale(amax, round_scales);
        let inv = 1.0f32 / scale;
        for (q, v) in out_block.iter_mut().zip(block) {
            *q = f32_to_e4m3(v.to_f32() * inv);
        }
        *scale_out = scale;
    }
}

/// Quantizes `rows x hidden` BF16 tokens; returns (e4m3 bits `[rows x hidden]`,
/// scales `[rows x hidden/128]`). `hidden` must be a multiple of 128.
pub fn quantize_bf16(tokens: &[bf16], rows: usize, hidden: usize, round_scales: bool) -> (Vec<u8>, Vec<f32>) {
    let cols = hidden / FP8_BLOCK;
    let mut q = vec![0u8; rows * hidden];
    let mut s = vec![0f32; rows * cols];
    for r in 0..rows {
        quantize_row(
            &tokens[r * hidden..(r + 1) * hidden],
            round_scales,
            &mut q[r * hidden..(r + 1) * hidden],
            &mut s[r * cols..(r + 1) * cols],
        );
    }
    (q, s)
}

/// Dequantizes `rows x hidden` e4m3 values with their per-128 scales into fp32.
pub fn dequantize(q: &[u8], scales: &[f32], rows: usize, hidden: usize) -> Vec<f32> {
    let cols = hidden / FP8_BLOCK;
    let mut out = Vec::with_capacity(rows * hidden);
    for r in 0..rows {
        for c in 0..hidden {
            out.push(e4m3_to_f32(q[r * hidden + c]) * scales[r * cols + c / FP8_BLOCK]);
        }
    }
    out
}

/// Half the distance between neighbouring e4m3 values around `|v|` (a value in e4m3's range):
/// the largest error round-to-nearest can make there.
pub fn e4m3_half_step(v: f32) -> f32 {
    let a = v.abs();
    if a < 2f32.powi(-6) {
        2f32.powi(-10)
    } else {
        let exp = ((a.to_bits() >> 23) & 0xff) as i32 - 127;
        2f32.powi(exp - 4)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_values() {
        let cases: &[(f32, u8)] = &[
            (0.0, 0x00),
            (-0.0, 0x80),
            (1.0, 0x38),
            (-2.0, 0xc0),
            (448.0, 0x7e),
            (-448.0, 0xfe),
            (240.0, 0x77),
            (2f32.powi(-6), 0x08),
            (2f32.powi(-9), 0x01),
            (7.0 * 2f32.powi(-9), 0x07),
            (0.1, 0x1d),                  // 0.1 ~ 1.6 * 2^-4 -> 1.625 * 2^-4 = 0.1015625
            (std::f32::consts::PI, 0x45), // 3.25 = 1.625 * 2
        ];
        for &(x, bits) in cases {
            assert_eq!(f32_to_e4m3(x), bits, "encode {x}");
        }
        assert_eq!(e4m3_to_f32(0x1d), 0.1015625);
        assert_eq!(e4m3_to_f32(0x45), 3.25);
    }

    #[test]
    fn round_to_nearest_even_and_saturation() {
        // Ties between 1.0 (q=8) and 1.125 (q=9) go to the even 8; between 9 and 10 to 10.
        assert_eq!(f32_to_e4m3(1.0625), 0x38);
        assert_eq!(f32_to_e4m3(1.1875), 0x3a);
        // Just above a tie rounds up.
        assert_eq!(f32_to_e4m3(f32::from_bits(1.0625f32.to_bits() + 1)), 0x39);
        // Subnormal ties: 2^-10 is halfway between 0 and 2^-9 -> 0; 1.5 * 2^-9 -> 2 * 2^-9.
        assert_eq!(f32_to_e4m3(2f32.powi(-10)), 0x00);
        assert_eq!(f32_to_e4m3(1.5 * 2f32.powi(-9)), 0x02);
        // Rounding up across a binade: 15.5/16 * 2 rounds to 2.0.
        assert_eq!(f32_to_e4m3(1.96875), 0x40);
        // Between the largest subnormal and the smallest normal.
        assert_eq!(f32_to_e4m3(7.5 * 2f32.powi(-9)), 0x08);
        // Saturation: 464 would round to 480, infinities too; all become 448.
        for x in [449.0, 464.0, 500.0, 1e30, f32::INFINITY] {
            assert_eq!(f32_to_e4m3(x), 0x7e, "{x}");
            assert_eq!(f32_to_e4m3(-x), 0xfe, "-{x}");
        }
        assert_eq!(f32_to_e4m3(f32::NAN), E4M3_NAN);
        assert!(e4m3_to_f32(E4M3_NAN).is_nan());
    }

    /// The arithmetic definition of an e4m3 code's value.
    fn e4m3_by_arithmetic(bits: u8) -> f32 {
        let sign = if bits & 0x80 != 0 { -1.0f32 } else { 1.0 };
        let exp = i32::from((bits >> 3) & 0x0f);
        let mantissa = f32::from(bits & 0x07);
        if exp == 0x0f && bits & 0x07 == 0x07 {
            return f32::NAN;
        }
        let magnitude = if exp == 0 { mantissa * 2f32.powi(-9) } else { (1.0 + mantissa / 8.0) * 2f32.powi(exp - 7) };
        sign * magnitude
    }

    #[test]
    fn the_decode_table_is_the_arithmetic_definition() {
        for bits in 0u8..=255 {
            let (want, got) = (e4m3_by_arithmetic(bits), e4m3_to_f32(bits));
            assert_eq!(got.to_bits(), want.to_bits(), "code {bits:#04x}: {got} against {want}");
        }
        assert_eq!(e4m3_to_f32(0x80).to_bits(), (-0.0f32).to_bits());
        assert_eq!(e4m3_to_f32(0x01), 2f32.powi(-9));
        assert_eq!(e4m3_to_f32(0x87), -7.0 * 2f32.powi(-9));
    }

    /// The encoder as first written (`powi` for the powers of two), to hold the faster one to.
    fn f32_to_e4m3_by_powi(x: f32) -> u8 {
        if x.is_nan() {
            return E4M3_NAN;
        }
        let sign: u8 = if x.is_sign_negative() { 0x80 } else { 0 };
        let a = x.abs().min(E4M3_MAX);
        let magnitude = if a < 2f32.powi(-6) {
            (f64::from(a) * 512.0).round_ties_even() as u8
        } else {
            let mut exp = ((a.to_bits() >> 23) & 0xff) as i32 - 127;
            let mantissa = f64::from(a) / f64::from(2f32.powi(exp));
            let mut q = (mantissa * 8.0).round_ties_even() as i32;
            if q == 16 {
                q = 8;
                exp += 1;
            }
            (((exp + 7) << 3) | (q - 8)) as u8
        };
        sign | magnitude
    }

    #[test]
    fn the_encoder_matches_its_first_definition() {
        // Every 4099th fp32 bit pattern (all signs, exponents and many mantissas), and every
        // value within a few ulps of each e4m3 code and of each midpoint between neighbours.
        let mut xs: Vec<f32> = (0..=u32::MAX / 4099).map(|i| f32::from_bits(i * 4099)).collect();
        for bits in 0u8..=0x7e {
            let (v, next) = (e4m3_to_f32(bits), e4m3_to_f32(bits + 1));
            for c in [v, (v + next) / 2.0] {
                for d in -3i32..=3 {
                    let y = f32::from_bits((c.to_bits() as i32 + d).max(0) as u32);
                    xs.extend([y, -y]);
                }
            }
        }
        for x in xs {
            assert_eq!(f32_to_e4m3(x), f32_to_e4m3_by_powi(x), "{x} ({:#010x})", x.to_bits());
        }
    }

    #[test]
    fn every_code_round_trips() {
        for bits in 0u8..=255 {
            let v = e4m3_to_f32(bits);
            if v.is_nan() {
                assert_eq!(bits & 0x7f, 0x7f);
                continue;
            }
            assert_eq!(f32_to_e4m3(v), bits, "code {bits:#04x} = {v}");
        }
    }

    #[test]
    fn pow2_scales() {
        assert_eq!(round_scale_pow2(1.0), 1.0);
        assert_eq!(round_scale_pow2(0.75), 1.0);
        assert_eq!(round_scale_pow2(1.0001), 2.0);
        assert_eq!(round_scale_pow2(2f32.powi(-20) * 1.5), 2f32.powi(-19));
        assert_eq!(block_scale(448.0, false), 1.0);
        assert_eq!(block_scale(0.0, false), AMAX_FLOOR / 448.0);
    }
}

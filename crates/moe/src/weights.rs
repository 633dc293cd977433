//! Seeded random BF16 weights of one MoE layer, as one rank holds them: the router's gate and
//! the shared expert on every rank, the routed experts on the rank that owns them (expert `e`
//! on rank `e / L`). Every value depends only on the seed, the layer and the expert, so every
//! rank, and the CPU reference, draw the same weights.

use epflow_core::error::human_bytes;
use epflow_core::{Error, Result, bf16};

use crate::preset::ModelPreset;

/// One SwiGLU expert: `gate_up` `[H x 2F]` (columns `0..F` the gate, `F..2F` the up
/// projection) and `down` `[F x H]`, row-major BF16.
#[derive(Clone, Debug, PartialEq)]
pub struct ExpertWeights {
    /// `F`.
    pub ffn: usize,
    /// `[H x 2F]`.
    pub gate_up: Vec<bf16>,
    /// `[F x H]`.
    pub down: Vec<bf16>,
}

/// One layer's weights on one rank.
#[derive(Clone, Debug, PartialEq)]
pub struct LayerWeights {
    /// The router's gate `[H x E]`.
    pub gate: Vec<bf16>,
    /// The global id of `experts[0]`.
    pub first_expert: usize,
    /// The routed experts this rank owns (`L` of them; all `E` for the reference).
    pub experts: Vec<ExpertWeights>,
    /// The shared expert, if the model has one.
    pub shared: Option<ExpertWeights>,
}

/// What a weight is, for its seed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Part {
    /// The router's gate.
    Gate,
    /// Routed expert `e` (global id).
    Expert(usize),
    /// The shared expert.
    Shared,
}

/// Which matrix of an expert.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Matrix {
    /// The gate (the router's `[H x E]`) or an expert's `gate_up` `[H x 2F]`.
    First,
    /// An expert's `down` `[F x H]`.
    Down,
}

/// The generator's key of one matrix: every value of it is [`value`]`(key, i, scale)`.
pub fn key(seed: u64, layer: usize, part: Part, matrix: Matrix) -> u64 {
    let id = match part {
        Part::Gate => 0u64,
        Part::Shared => 1,
        Part::Expert(e) => 2 + e as u64,
    };
    let seed = if matrix == Matrix::Down { seed ^ 0x5555 } else { seed };
    seed ^ (layer as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ id << 20
}

/// splitmix64's finaliser.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Element `i` of the matrix with `key`: `bf16((u * 2 - 1) * scale)`, `u` uniform in `[0, 1)`
/// from 24 bits of `mix(key + i * golden)`. A counter-based generator: the GPU fills its weights
/// with the same function (`moe_fill_uniform`), value for value.
pub fn value(key: u64, i: u64, scale: f32) -> bf16 {
    let h = mix(key.wrapping_add(i.wrapping_mul(0x9e37_79b9_7f4a_7c15)));
    let u = (h >> 40) as f32 * (1.0 / 16_777_216.0);
    bf16::from_f32((u * 2.0 - 1.0) * scale)
}

/// The scale of a matrix whose rows are `fan_in` long: uniform in `[-s, s)` with
/// `s = sqrt(3 / fan_in)` has variance `1 / fan_in`, so activations keep their size.
pub fn scale(fan_in: usize) -> f32 {
    (3.0 / fan_in as f32).sqrt()
}

fn draw(seed: u64, layer: usize, part: Part, matrix: Matrix, n: usize, fan_in: usize) -> Vec<bf16> {
    let (k, s) = (key(seed, layer, part, matrix), scale(fan_in));
    (0..n as u64).map(|i| value(k, i, s)).collect()
}

fn expert(seed: u64, layer: usize, part: Part, hidden: usize, ffn: usize) -> ExpertWeights {
    let gate_up = draw(seed, layer, part, Matrix::First, hidden * 2 * ffn, hidden);
    let down = draw(seed, layer, part, Matrix::Down, ffn * hidden, ffn);
    ExpertWeights { ffn, gate_up, down }
}

impl LayerWeights {
    /// Layer `layer`'s weights on rank `rank` of `ranks` (`ranks = 1`: every expert, as the CPU
    /// reference holds them). Refused, with the bytes needed, when they exceed `available`
    /// bytes (the host's memory, or the GPU's free memory).
    pub fn generate(
        preset: &ModelPreset,
        seed: u64,
        layer: usize,
        rank: usize,
        ranks: usize,
        available: u128,
    ) -> Result<LayerWeights> {
        preset.check(ranks)?;
        check_fits(preset, ranks, available)?;
        let (h, e) = (preset.hidden, preset.num_experts);
        let local = e / ranks;
        let first_expert = rank * local;
        Ok(LayerWeights {
            gate: draw(seed, layer, Part::Gate, Matrix::First, h * e, h),
            first_expert,
            experts: (first_expert..first_expert + local)
                .map(|x| expert(seed, layer, Part::Expert(x), h, preset.expert_ffn))
                .collect(),
            shared: (preset.shared_experts > 0).then(|| expert(seed, layer, Part::Shared, h, preset.shared_ffn)),
        })
    }
}

/// Bytes of one layer's weights on each of `ranks` ranks: the gate, `E / R` routed experts and
/// the shared experts, BF16.
pub fn bytes_per_rank(preset: &ModelPreset, ranks: usize) -> u128 {
    let h = preset.hidden as u128;
    let gate = h * preset.num_experts as u128;
    let routed = (preset.num_experts / ranks.max(1)) as u128 * 3 * h * preset.expert_ffn as u128;
    let shared = preset.shared_experts as u128 * 3 * h * preset.shared_ffn as u128;
    2 * (gate + routed + shared)
}

/// `Err` naming the bytes needed when one layer's weights on each of `ranks` ranks exceed
/// `available` bytes.
pub fn check_fits(preset: &ModelPreset, ranks: usize, available: u128) -> Result<()> {
    let need = bytes_per_rank(preset, ranks);
    if need > available {
        return Err(Error::Unsupported(format!(
            "model {}: one layer's weights need {} per rank on {ranks} ranks, more than the {} available",
            preset.name,
            human_bytes(need),
            human_bytes(available)
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::preset::preset;

    #[test]
    fn ranks_draw_the_reference_s_weights_and_sizes_are_checked() {
        let p = preset("deepseek-v3").unwrap().scaled(64, 8, 2, 32);
        let all = LayerWeights::generate(&p, 7, 3, 0, 1, u128::MAX).unwrap();
        let r1 = LayerWeights::generate(&p, 7, 3, 1, 4, u128::MAX).unwrap();
        assert_eq!(r1.first_expert, 2);
        assert_eq!(r1.experts[..], all.experts[2..4]);
        assert_eq!((r1.gate == all.gate, r1.shared == all.shared), (true, true));
        assert_ne!(LayerWeights::generate(&p, 7, 4, 0, 1, u128::MAX).unwrap().gate, all.gate, "layers differ");
        // DeepSeek-V3's layer on 8 ranks: gate 3.5 MiB, 32 experts of 84 MiB, one shared.
        let d = preset("deepseek-v3").unwrap();
        assert_eq!(bytes_per_rank(&d, 8), 2 * (7168 * 256 + 33 * 3 * 7168 * 2048));
        let e = check_fits(&d, 8, 1 << 30).unwrap_err().to_string();
        assert!(e.contains("need 2.7") && e.contains("per rank on 8 ranks"), "{e}");
    }
}

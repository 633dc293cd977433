//! Seeded random BF16 weights of one MoE layer, as one rank holds them: the router's gate and
//! the shared expert on every rank, the routed experts on the rank that owns them (expert `e`
//! on rank `e / L`). Every value depends only on the seed, the layer and the expert, so every
//! rank, and the CPU reference, draw the same weights.

use epflow_core::error::human_bytes;
use epflow_core::{Error, Result, bf16};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

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
#[derive(Clone, Copy)]
enum Part {
    Gate,
    Expert(usize),
    Shared,
}

fn draw(seed: u64, layer: usize, part: Part, n: usize, scale: f32) -> Vec<bf16> {
    let id = match part {
        Part::Gate => 0u64,
        Part::Shared => 1,
        Part::Expert(e) => 2 + e as u64,
    };
    let mut rng = SmallRng::seed_from_u64(seed ^ (layer as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ id << 20);
    (0..n).map(|_| bf16::from_f32(rng.random_range(-1.0f32..1.0) * scale)).collect()
}

fn expert(seed: u64, layer: usize, part: Part, hidden: usize, ffn: usize) -> ExpertWeights {
    // Scaled so that activations keep their size through the layer.
    let gate_up = draw(seed, layer, part, hidden * 2 * ffn, (3.0 / hidden as f32).sqrt());
    let down = draw(seed ^ 0x5555, layer, part, ffn * hidden, (3.0 / ffn as f32).sqrt());
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
            gate: draw(seed, layer, Part::Gate, h * e, (3.0 / h as f32).sqrt()),
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

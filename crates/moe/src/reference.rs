//! The CPU reference of the MoE layer. Its arithmetic is the definition the layer is checked
//! against: FP32 accumulation in index order, BF16 where a GPU layer stores a tensor (the
//! router's weights stay FP32, as epflow's `topk_weights` are).
//!
//! - Router: `logits[e] = sum_c x[c] * gate[c][e]` (FP32); the `K` highest logits, ties to the
//!   lower expert id, highest first (softmax and sigmoid are monotone, so this is the top-k of
//!   the scores); weights: softmax `exp(l_k - l_0) / sum_j exp(l_j - l_0)` over the chosen
//!   (the softmax over all experts renormalised over the top-k), or sigmoid `s_k / sum_j s_j`
//!   times DeepSeek-V3's scale. The GPU router computes these same formulas from its own
//!   logits (cuBLAS sums in another order: its logits, and so near-ties, may differ).
//! - SwiGLU expert: `g, u = bf16(x * gate_up)` (`[2F]`, FP32 sums stored as BF16, as the GPU's
//!   GEMM stores them), `a = bf16(silu(g) * u)`, `y = bf16(a * down)`.
//! - Layer: the combine of epflow (`bf16(fma chain over k of w[k] * y_k)`, in `k` order), plus
//!   the shared expert's output: `bf16(f32(combined) + f32(shared))`.

use epflow_core::bf16;

use crate::preset::{ModelPreset, Scoring};
use crate::weights::{ExpertWeights, LayerWeights};

/// The router's decision for `B` tokens: `topk_idx` `[B x K]` int64 and `topk_weights` `[B x K]`
/// FP32, as epflow's dispatch and combine take them.
#[derive(Clone, Debug, PartialEq)]
pub struct Routing {
    /// `[B x K]` expert ids.
    pub topk_idx: Vec<i64>,
    /// `[B x K]` weights.
    pub topk_weights: Vec<f32>,
}

/// Routes `x` (`[B x H]`) with `gate` (`[H x E]`) as `preset` scores.
pub fn route(preset: &ModelPreset, x: &[bf16], gate: &[bf16]) -> Routing {
    let (h, e, k) = (preset.hidden, preset.num_experts, preset.top_k);
    let b = x.len() / h;
    let mut topk_idx = Vec::with_capacity(b * k);
    let mut topk_weights = Vec::with_capacity(b * k);
    let mut logits = vec![0f32; e];
    for t in 0..b {
        logits.iter_mut().for_each(|l| *l = 0.0);
        for (c, xc) in x[t * h..(t + 1) * h].iter().enumerate() {
            let xc = xc.to_f32();
            for (l, g) in logits.iter_mut().zip(&gate[c * e..(c + 1) * e]) {
                *l = xc.mul_add(g.to_f32(), *l);
            }
        }
        let chosen = top_k(&logits, k);
        let (w, scale) = weights_of(preset.scoring, &chosen.iter().map(|&i| logits[i]).collect::<Vec<_>>());
        for (&i, w) in chosen.iter().zip(w) {
            topk_idx.push(i as i64);
            topk_weights.push(w * scale);
        }
    }
    Routing { topk_idx, topk_weights }
}

/// The renormalised weights of the chosen logits (highest first), and the scale they are then
/// multiplied by: softmax `exp(l_k - l_0) / sum`, or sigmoid `s_k / sum` with DeepSeek-V3's
/// scale.
pub fn weights_of(scoring: Scoring, chosen: &[f32]) -> (Vec<f32>, f32) {
    let (s, scale): (Vec<f32>, f32) = match scoring {
        Scoring::Softmax => (chosen.iter().map(|l| (l - chosen[0]).exp()).collect(), 1.0),
        Scoring::SigmoidRenorm { scale } => (chosen.iter().map(|l| 1.0 / (1.0 + (-l).exp())).collect(), scale),
    };
    let sum: f32 = s.iter().sum();
    (s.iter().map(|v| v / sum).collect(), scale)
}

/// The indices of the `k` highest `scores`, highest first; equal scores (`-0.0` and `0.0`
/// included) go to the lower index, NaN is never chosen before a number.
pub fn top_k(scores: &[f32], k: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..scores.len()).collect();
    // A stable sort by descending score keeps equal scores in index order.
    // Numeric order: -0.0 and 0.0 are equal (a tie), as the GPU's comparison has them.
    order.sort_by(|&a, &b| match (scores[a].is_nan(), scores[b].is_nan()) {
        (false, false) => scores[b].partial_cmp(&scores[a]).unwrap_or(std::cmp::Ordering::Equal),
        (x, y) => x.cmp(&y),
    });
    order.truncate(k);
    order
}

/// SiLU in FP32.
pub fn silu(g: f32) -> f32 {
    g / (1.0 + (-g).exp())
}

/// One SwiGLU expert on the rows of `x` (`[N x H]`): `[N x H]` BF16.
pub fn swiglu(x: &[bf16], hidden: usize, w: &ExpertWeights) -> Vec<bf16> {
    let f = w.ffn;
    let rows = x.len() / hidden;
    let mut out = Vec::with_capacity(rows * hidden);
    let mut gu = vec![0f32; 2 * f];
    let mut act = vec![0f32; f];
    let mut y = vec![0f32; hidden];
    for r in 0..rows {
        gu.iter_mut().for_each(|v| *v = 0.0);
        for (c, xc) in x[r * hidden..(r + 1) * hidden].iter().enumerate() {
            let xc = xc.to_f32();
            for (v, wv) in gu.iter_mut().zip(&w.gate_up[c * 2 * f..(c + 1) * 2 * f]) {
                *v = xc.mul_add(wv.to_f32(), *v);
            }
        }
        gu.iter_mut().for_each(|v| *v = bf16::from_f32(*v).to_f32());
        for j in 0..f {
            act[j] = bf16::from_f32(silu(gu[j]) * gu[f + j]).to_f32();
        }
        y.iter_mut().for_each(|v| *v = 0.0);
        for (j, a) in act.iter().enumerate() {
            for (v, wv) in y.iter_mut().zip(&w.down[j * hidden..(j + 1) * hidden]) {
                *v = a.mul_add(wv.to_f32(), *v);
            }
        }
        out.extend(y.iter().map(|&v| bf16::from_f32(v)));
    }
    out
}

/// epflow's combine of one token: `bf16(fma chain over k of w[k] * rows[k])`.
pub fn combine_row(rows: &[&[bf16]], weights: &[f32], hidden: usize) -> Vec<f32> {
    let mut acc = vec![0f32; hidden];
    for (row, &w) in rows.iter().zip(weights) {
        for (a, v) in acc.iter_mut().zip(row.iter()) {
            *a = w.mul_add(v.to_f32(), *a);
        }
    }
    acc.iter().map(|&a| bf16::from_f32(a).to_f32()).collect()
}

/// The layer's output for `x` (`[B x H]`), with `weights` holding every expert (rank 0 of 1):
/// `[B x H]` BF16, and the routing it chose.
pub fn layer(preset: &ModelPreset, x: &[bf16], weights: &LayerWeights) -> (Vec<bf16>, Routing) {
    let (h, k) = (preset.hidden, preset.top_k);
    let routing = route(preset, x, &weights.gate);
    let shared = weights.shared.as_ref().map(|s| swiglu(x, h, s));
    let mut out = Vec::with_capacity(x.len());
    for t in 0..x.len() / h {
        let row = &x[t * h..(t + 1) * h];
        let ys: Vec<Vec<bf16>> = routing.topk_idx[t * k..(t + 1) * k]
            .iter()
            .map(|&e| swiglu(row, h, &weights.experts[e as usize - weights.first_expert]))
            .collect();
        let refs: Vec<&[bf16]> = ys.iter().map(Vec::as_slice).collect();
        let combined = combine_row(&refs, &routing.topk_weights[t * k..(t + 1) * k], h);
        match &shared {
            Some(s) => {
                out.extend(combined.iter().zip(&s[t * h..(t + 1) * h]).map(|(c, s)| bf16::from_f32(c + s.to_f32())))
            }
            None => out.extend(combined.iter().map(|&c| bf16::from_f32(c))),
        }
    }
    (out, routing)
}

/// The layer's output for `x` (`[B x H]`) as a prefill (high-throughput) group of `ranks`
/// ranks computes it, with `weights` holding every expert: each rank that holds one of a
/// token's experts reduces them, `bf16(fma chain over its k ascending of w[k] * y_k)`; the
/// high-throughput combine adds those partial sums in FP32 in ascending rank and rounds once;
/// then the shared expert is added as in [`layer`]. On one rank it is [`layer`]'s output.
pub fn layer_prefill(preset: &ModelPreset, x: &[bf16], weights: &LayerWeights, ranks: usize) -> (Vec<bf16>, Routing) {
    let (h, k) = (preset.hidden, preset.top_k);
    let local = preset.num_experts / ranks.max(1);
    let routing = route(preset, x, &weights.gate);
    let shared = weights.shared.as_ref().map(|s| swiglu(x, h, s));
    let mut out = Vec::with_capacity(x.len());
    for t in 0..x.len() / h {
        let row = &x[t * h..(t + 1) * h];
        let idx = &routing.topk_idx[t * k..(t + 1) * k];
        let w = &routing.topk_weights[t * k..(t + 1) * k];
        let mut acc = vec![0f32; h];
        for d in 0..ranks {
            let mine: Vec<usize> = (0..k).filter(|&j| idx[j] as usize / local == d).collect();
            if mine.is_empty() {
                continue;
            }
            let ys: Vec<Vec<bf16>> = mine
                .iter()
                .map(|&j| swiglu(row, h, &weights.experts[idx[j] as usize - weights.first_expert]))
                .collect();
            let refs: Vec<&[bf16]> = ys.iter().map(Vec::as_slice).collect();
            let ws: Vec<f32> = mine.iter().map(|&j| w[j]).collect();
            for (a, p) in acc.iter_mut().zip(combine_row(&refs, &ws, h)) {
                *a += p;
            }
        }
        match &shared {
            Some(s) => out.extend(
                acc.iter()
                    .zip(&s[t * h..(t + 1) * h])
                    .map(|(&c, s)| bf16::from_f32(bf16::from_f32(c).to_f32() + s.to_f32())),
            ),
            None => out.extend(acc.iter().map(|&c| bf16::from_f32(c))),
        }
    }
    (out, routing)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::preset::preset;

    #[test]
    fn top_k_breaks_ties_to_the_lower_expert() {
        assert_eq!(top_k(&[0.1, 0.5, 0.5, 0.2, 0.5], 2), vec![1, 2]);
        assert_eq!(top_k(&[0.3, 0.3, 0.3], 3), vec![0, 1, 2]);
        assert_eq!(top_k(&[0.0, 1.0, -1.0], 1), vec![1]);
        // -0.0 and 0.0 tie (found by the GPU test against the kernel's comparison).
        assert_eq!(top_k(&[1.25, -0.0, 0.0, -0.25], 2), vec![0, 1]);
        assert_eq!(top_k(&[f32::NAN, -1.0, 2.0], 3), vec![2, 1, 0]);
    }

    #[test]
    fn router_weights_follow_the_scoring() {
        let p = preset("qwen3-30b-a3b").unwrap().scaled(4, 4, 2, 8);
        // One token x = [1, 0, 0, 0]: the logits are the gate's first row.
        let x: Vec<bf16> = [1.0, 0.0, 0.0, 0.0].iter().map(|&v| bf16::from_f32(v)).collect();
        let mut gate = vec![bf16::ZERO; 16];
        for (e, l) in [0.0f32, 2.0, 1.0, 2.0].iter().enumerate() {
            gate[e] = bf16::from_f32(*l);
        }
        let r = route(&p, &x, &gate);
        assert_eq!(r.topk_idx, vec![1, 3], "a tie goes to the lower expert");
        assert_eq!(r.topk_weights, vec![0.5, 0.5]);
        let d = preset("deepseek-v3").unwrap().scaled(4, 4, 2, 8);
        let r = route(&d, &x, &gate);
        assert_eq!(r.topk_idx, vec![1, 3]);
        assert!((r.topk_weights[0] - 1.25).abs() < 1e-6, "{:?}", r.topk_weights);
    }

    #[test]
    fn swiglu_of_a_known_expert() {
        // H = 2, F = 1: g = x0 * 1, u = x1 * 2; y = a * [1, -1].
        let w = ExpertWeights {
            ffn: 1,
            gate_up: [1.0, 0.0, 0.0, 2.0].iter().map(|&v| bf16::from_f32(v)).collect(),
            down: [1.0, -1.0].iter().map(|&v| bf16::from_f32(v)).collect(),
        };
        let x: Vec<bf16> = [1.0, 3.0].iter().map(|&v| bf16::from_f32(v)).collect();
        let a = bf16::from_f32(silu(1.0) * 6.0).to_f32();
        assert_eq!(swiglu(&x, 2, &w), vec![bf16::from_f32(a), bf16::from_f32(-a)]);
    }
}

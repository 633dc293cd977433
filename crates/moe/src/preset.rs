//! Model presets with the shapes of real MoE models, for the layer and for `moe_serving --model`.

use epflow_core::{Error, Result};

/// How the router turns the gate's logits into top-k choices and weights.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Scoring {
    /// Softmax over all experts; the top-k probabilities renormalised to sum to 1 (Qwen3-MoE with
    /// `norm_topk_prob`; Mixtral's softmax over the top-k logits is the same function).
    Softmax,
    /// Sigmoid per expert; the top-k scores renormalised to sum to 1, then multiplied by
    /// `scale` (DeepSeek-V3's routed scaling factor, 2.5). DeepSeek-V3's expert groups and
    /// selection bias are not modelled: top-k is over all experts.
    SigmoidRenorm {
        /// The routed scaling factor.
        scale: f32,
    },
}

/// The shapes of one model's MoE layers.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ModelPreset {
    /// The name `moe_serving --model` takes.
    pub name: &'static str,
    /// `H`, the hidden size.
    pub hidden: usize,
    /// `E`, the routed experts per layer.
    pub num_experts: usize,
    /// `K`, the experts each token is routed to.
    pub top_k: usize,
    /// `F`, a routed expert's FFN width (the SwiGLU's intermediate size).
    pub expert_ffn: usize,
    /// Shared experts per layer (dense, on every token), each `shared_ffn` wide.
    pub shared_experts: usize,
    /// The shared expert's FFN width (0 without shared experts).
    pub shared_ffn: usize,
    /// MoE layers of the model.
    pub layers: usize,
    /// The router's scoring.
    pub scoring: Scoring,
    /// The attention stand-in (`moe_serving --attention proj`): the model's attention
    /// projection GEMMs on the token side, as a chain of `(k, n)`: GEMM `j` multiplies the first
    /// `k` columns of the previous output (the layer's input `[B x H]` for the first) by a
    /// `[k x n]` weight; the last `n` is `H`. It keeps the ratio of token-side compute to
    /// communication the model's. Qwen3-30B-A3B: QKV `[2048 x 5120]` (32 query heads, 4 KV
    /// heads of 128), O `[4096 x 2048]`; Mixtral: QKV `[4096 x 6144]`, O `[4096 x 4096]`;
    /// DeepSeek-V3 (MLA): the down projections `[7168 x 2112]` (q 1536 + kv 576), the query up
    /// projection `[1536 x 24576]`, O `[16384 x 7168]` (the kv up projection, 9 % of the
    /// attention weights, is left out).
    pub attention: &'static [(usize, usize)],
}

/// Every preset.
pub const PRESETS: [ModelPreset; 3] = [
    ModelPreset {
        name: "qwen3-30b-a3b",
        hidden: 2048,
        num_experts: 128,
        top_k: 8,
        expert_ffn: 768,
        shared_experts: 0,
        shared_ffn: 0,
        layers: 48,
        scoring: Scoring::Softmax,
        attention: &[(2048, 5120), (4096, 2048)],
    },
    ModelPreset {
        name: "mixtral-8x7b",
        hidden: 4096,
        num_experts: 8,
        top_k: 2,
        expert_ffn: 14336,
        shared_experts: 0,
        shared_ffn: 0,
        layers: 32,
        scoring: Scoring::Softmax,
        attention: &[(4096, 6144), (4096, 4096)],
    },
    ModelPreset {
        name: "deepseek-v3",
        hidden: 7168,
        num_experts: 256,
        top_k: 8,
        expert_ffn: 2048,
        shared_experts: 1,
        shared_ffn: 2048,
        layers: 58,
        scoring: Scoring::SigmoidRenorm { scale: 2.5 },
        attention: &[(7168, 2112), (1536, 24576), (16384, 7168)],
    },
];

/// The preset called `name`, or an error listing the names.
pub fn preset(name: &str) -> Result<ModelPreset> {
    PRESETS.iter().find(|p| p.name == name).copied().ok_or_else(|| {
        let names: Vec<&str> = PRESETS.iter().map(|p| p.name).collect();
        Error::Unsupported(format!("model {name:?}: the presets are {}", names.join(", ")))
    })
}

/// `[(H, 2H), (H, H)]` for the small hidden sizes tests use (up to 1024, in steps of 64); a
/// chain of one `(H, H)` GEMM otherwise.
fn small_attention(hidden: usize) -> &'static [(usize, usize)] {
    const CHAINS: [[(usize, usize); 2]; 16] = {
        let mut c = [[(0, 0); 2]; 16];
        let mut i = 0;
        while i < 16 {
            let h = 64 * (i + 1);
            c[i] = [(h, 2 * h), (h, h)];
            i += 1;
        }
        c
    };
    match CHAINS.iter().find(|c| c[1].0 == hidden) {
        Some(c) => c,
        None => &[],
    }
}

impl ModelPreset {
    /// A preset of the same kind with small shapes (for tests and the host backend): `hidden`,
    /// `num_experts`, `top_k`, `expert_ffn`, a shared expert of `expert_ffn` if this preset
    /// has one, and an attention stand-in `[H x 2H]`, `[H x H]`.
    pub fn scaled(&self, hidden: usize, num_experts: usize, top_k: usize, expert_ffn: usize) -> ModelPreset {
        ModelPreset {
            hidden,
            num_experts,
            top_k,
            expert_ffn,
            shared_ffn: if self.shared_experts > 0 { expert_ffn } else { 0 },
            attention: small_attention(hidden),
            ..*self
        }
    }

    /// Checks the shapes against a group of `ranks` ranks: experts divide evenly, top-k within
    /// the experts and epflow's `MAX_TOP_K`, every size positive.
    pub fn check(&self, ranks: usize) -> Result<()> {
        let bad = |why: String| Err(Error::Unsupported(format!("model {}: {why}", self.name)));
        if self.hidden == 0 || self.num_experts == 0 || self.top_k == 0 || self.expert_ffn == 0 || ranks == 0 {
            return bad("every size must be positive".into());
        }
        if self.num_experts % ranks != 0 {
            return bad(format!("{} experts do not divide over {ranks} ranks", self.num_experts));
        }
        if self.top_k > self.num_experts || self.top_k > epflow_core::config::MAX_TOP_K {
            return bad(format!(
                "top-k {} must be at most the experts ({}) and MAX_TOP_K ({})",
                self.top_k,
                self.num_experts,
                epflow_core::config::MAX_TOP_K
            ));
        }
        if self.shared_experts > 0 && self.shared_ffn == 0 {
            return bad("a shared expert needs a width".into());
        }
        let mut width = self.hidden;
        for &(k, n) in self.attention {
            if k == 0 || n == 0 || k > width {
                return bad(format!("attention GEMM ({k} x {n}) reads {k} of {width} columns"));
            }
            width = n;
        }
        if !self.attention.is_empty() && width != self.hidden {
            return bad(format!("the attention stand-in ends at width {width}, not H {}", self.hidden));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_have_the_models_shapes() {
        let q = preset("qwen3-30b-a3b").unwrap();
        assert_eq!((q.hidden, q.num_experts, q.top_k, q.expert_ffn, q.layers), (2048, 128, 8, 768, 48));
        let m = preset("mixtral-8x7b").unwrap();
        assert_eq!((m.hidden, m.num_experts, m.top_k, m.expert_ffn, m.layers), (4096, 8, 2, 14336, 32));
        let d = preset("deepseek-v3").unwrap();
        assert_eq!((d.hidden, d.num_experts, d.top_k, d.expert_ffn, d.layers), (7168, 256, 8, 2048, 58));
        assert_eq!((d.shared_experts, d.scoring), (1, Scoring::SigmoidRenorm { scale: 2.5 }));
        let e = preset("llama").unwrap_err().to_string();
        assert!(e.contains("qwen3-30b-a3b, mixtral-8x7b, deepseek-v3"), "{e}");
        for p in PRESETS {
            p.check(8).unwrap();
        }
        assert!(m.check(16).is_err(), "8 experts over 16 ranks");
    }
}

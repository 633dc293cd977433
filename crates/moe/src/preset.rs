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
    },
];

/// The preset called `name`, or an error listing the names.
pub fn preset(name: &str) -> Result<ModelPreset> {
    PRESETS.iter().find(|p| p.name == name).copied().ok_or_else(|| {
        let names: Vec<&str> = PRESETS.iter().map(|p| p.name).collect();
        Error::Unsupported(format!("model {name:?}: the presets are {}", names.join(", ")))
    })
}

impl ModelPreset {
    /// A preset of the same kind with small shapes (for tests and the host backend): `hidden`,
    /// `num_experts`, `top_k`, `expert_ffn`, and a shared expert of `expert_ffn` if this preset
    /// has one.
    pub fn scaled(&self, hidden: usize, num_experts: usize, top_k: usize, expert_ffn: usize) -> ModelPreset {
        ModelPreset {
            hidden,
            num_experts,
            top_k,
            expert_ffn,
            shared_ffn: if self.shared_experts > 0 { expert_ffn } else { 0 },
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

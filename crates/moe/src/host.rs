//! The MoE layer on epflow's host backend: the reference's router and SwiGLU experts around
//! epflow's real dispatch and combine, one [`Group`] per rank. Each rank holds the gate, the
//! shared expert and its own `L` routed experts ([`LayerWeights::generate`] with its rank); the
//! output is bit-identical to [`reference::layer`] on the whole model.
//!
//! Every rank calls [`HostMoeLayer::forward`] for the same layer in the same order (dispatch and
//! combine are collectives).

use epflow_async::Group;
use epflow_core::host::HostRank;
use epflow_core::ops::{CombineInputs, DispatchInputs};
use epflow_core::tensor::HostData;
use epflow_core::{Error, HostTensor, Result, bf16};

use crate::preset::ModelPreset;
use crate::reference::{self, Routing};
use crate::weights::LayerWeights;

/// One MoE layer of one rank.
#[derive(Debug)]
pub struct HostMoeLayer {
    preset: ModelPreset,
    weights: LayerWeights,
}

/// What [`HostMoeLayer::forward`] returns: the layer's output `[B x H]` BF16, the routing it
/// chose, and the tokens each local expert received (`[L]`, the dispatch's counts).
#[derive(Debug)]
pub struct LayerOutput {
    /// `[B x H]` BF16.
    pub tokens: HostTensor,
    /// The router's `topk_idx` and `topk_weights`.
    pub routing: Routing,
    /// Tokens per local expert.
    pub expert_counts: Vec<i32>,
}

impl HostMoeLayer {
    /// The layer of `preset` with this rank's `weights`.
    pub fn new(preset: ModelPreset, weights: LayerWeights) -> Self {
        HostMoeLayer { preset, weights }
    }

    /// Runs the layer on this rank's tokens `x` (`[B x H]` BF16, `B` at most the group's
    /// `max_tokens_per_rank`): route, dispatch, the local experts on the rows they received,
    /// combine with the router's weights, plus the shared expert on `x`.
    pub async fn forward(&self, group: &Group<HostRank>, x: &HostTensor) -> Result<LayerOutput> {
        let (h, k) = (self.preset.hidden, self.preset.top_k);
        let xs = x.as_bf16().ok_or_else(|| Error::Unsupported("the layer's input must be BF16 tokens".into()))?;
        if xs.len() % h != 0 {
            return Err(Error::Unsupported(format!("the layer's input is not [B x {h}]")));
        }
        let b = xs.len() / h;
        let routing = reference::route(&self.preset, xs, &self.weights.gate);
        let idx = HostTensor::topk_idx(b, k, routing.topk_idx.clone());
        let w = HostTensor::topk_weights(b, k, routing.topk_weights.clone());
        let handle = group.create_handle(&idx).await?;
        let received = group.dispatch(&handle, DispatchInputs::new(x)).await?;
        let counts =
            received.counts().ok_or_else(|| Error::Backend("the dispatch returned no counts".into()))?.to_vec();
        // The experts' outputs in the dispatch's layout `[L x R*M x H]`: expert `le`'s rows are
        // the first `counts[le]` of its block; the rest stay zero (combine reads none of them).
        let mut outputs = received.tokens().clone();
        let rows_per_expert = outputs.desc().shape.get(1).copied().unwrap_or(0);
        let input = received.tokens().as_bf16().ok_or_else(|| Error::Backend("received tokens not BF16".into()))?;
        let mut out = vec![bf16::ZERO; input.len()];
        for (le, &n) in counts.iter().enumerate() {
            let start = le * rows_per_expert * h;
            let rows = &input[start..start + n as usize * h];
            let y = reference::swiglu(rows, h, &self.weights.experts[le]);
            out[start..start + y.len()].copy_from_slice(&y);
        }
        *outputs.data_mut() = HostData::Bf16(out);
        let combined = group.combine(&handle, CombineInputs::new(&outputs).with_weights(&w)).await?;
        let c = combined.tokens().as_bf16().ok_or_else(|| Error::Backend("combined tokens not BF16".into()))?;
        let tokens = match &self.weights.shared {
            Some(s) => {
                let shared = reference::swiglu(xs, h, s);
                c.iter().zip(&shared).map(|(c, s)| bf16::from_f32(c.to_f32() + s.to_f32())).collect()
            }
            None => c.to_vec(),
        };
        Ok(LayerOutput { tokens: HostTensor::tokens(b, h, tokens), routing, expert_counts: counts })
    }
}

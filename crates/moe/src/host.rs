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

    /// `x` as BF16 `[B x H]` values, the router's choice for them, and its weights as a
    /// `[B x K]` tensor.
    fn route<'x>(&self, x: &'x HostTensor) -> Result<(&'x [bf16], Routing, HostTensor)> {
        let (h, k) = (self.preset.hidden, self.preset.top_k);
        let xs = x.as_bf16().ok_or_else(|| Error::Unsupported("the layer's input must be BF16 tokens".into()))?;
        if xs.len() % h != 0 {
            return Err(Error::Unsupported(format!("the layer's input is not [B x {h}]")));
        }
        let routing = reference::route(&self.preset, xs, &self.weights.gate);
        let w = HostTensor::topk_weights(xs.len() / h, k, routing.topk_weights.clone());
        Ok((xs, routing, w))
    }

    /// The combined tokens `c` plus the shared expert on `xs` (if the model has one):
    /// `bf16(f32(c) + f32(shared))`.
    fn with_shared(&self, xs: &[bf16], c: &HostTensor) -> Result<Vec<bf16>> {
        let c = c.as_bf16().ok_or_else(|| Error::Backend("combined tokens not BF16".into()))?;
        Ok(match &self.weights.shared {
            Some(s) => {
                let shared = reference::swiglu(xs, self.preset.hidden, s);
                c.iter().zip(&shared).map(|(c, s)| bf16::from_f32(c.to_f32() + s.to_f32())).collect()
            }
            None => c.to_vec(),
        })
    }

    /// Runs the layer on this rank's tokens `x` (`[B x H]` BF16, `B` at most the group's
    /// `max_tokens_per_rank`): route, dispatch, the local experts on the rows they received,
    /// combine with the router's weights, plus the shared expert on `x`.
    pub async fn forward(&self, group: &Group<HostRank>, x: &HostTensor) -> Result<LayerOutput> {
        let (h, k) = (self.preset.hidden, self.preset.top_k);
        let (xs, routing, w) = self.route(x)?;
        let b = xs.len() / h;
        let handle = group.create_handle(&HostTensor::topk_idx(b, k, routing.topk_idx.clone())).await?;
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
        let tokens = self.with_shared(xs, combined.tokens())?;
        Ok(LayerOutput { tokens: HostTensor::tokens(b, h, tokens), routing, expert_counts: counts })
    }

    /// The layer as prefill runs it, over a high-throughput group: route, dispatch with the
    /// router's weights (each rank receives a row per source token with a local expert, with
    /// its local top-k and weights), per received row the weighted sum of its local experts,
    /// `bf16(fma chain over k of w[k] * y_k)` (what the GPU's grouped experts compute), combine
    /// (which adds the ranks' sums), plus the shared expert on `x`. Equal to
    /// [`reference::layer_prefill`] bit for bit; `expert_counts` are the dispatch's.
    pub async fn forward_prefill(&self, group: &Group<HostRank>, x: &HostTensor) -> Result<LayerOutput> {
        let (h, k) = (self.preset.hidden, self.preset.top_k);
        let (xs, routing, w) = self.route(x)?;
        let b = xs.len() / h;
        let handle = group.create_handle(&HostTensor::topk_idx(b, k, routing.topk_idx.clone())).await?;
        let received = group.dispatch(&handle, DispatchInputs::new(x).with_weights(&w)).await?;
        let missing = |what: &str| Error::Backend(format!("the high-throughput dispatch returned no {what}"));
        let counts = received.counts().ok_or_else(|| missing("counts"))?.to_vec();
        let rows = received.tokens().as_bf16().ok_or_else(|| missing("BF16 tokens"))?;
        let ridx: Vec<i64> = match received.topk_idx().map(HostTensor::data) {
            Some(HostData::I64(v)) => v.clone(),
            Some(HostData::I32(v)) => v.iter().map(|&e| i64::from(e)).collect(),
            _ => return Err(missing("top-k indices")),
        };
        let rw = received.topk_weights().and_then(HostTensor::as_f32).ok_or_else(|| missing("top-k weights"))?;
        let n = rows.len() / h;
        let mut sums = Vec::with_capacity(n * h);
        for r in 0..n {
            let row = &rows[r * h..(r + 1) * h];
            let mine: Vec<usize> = (0..k).filter(|&j| ridx[r * k + j] >= 0).collect();
            let ys: Vec<Vec<bf16>> = mine
                .iter()
                .map(|&j| reference::swiglu(row, h, &self.weights.experts[ridx[r * k + j] as usize]))
                .collect();
            let refs: Vec<&[bf16]> = ys.iter().map(Vec::as_slice).collect();
            let ws: Vec<f32> = mine.iter().map(|&j| rw[r * k + j]).collect();
            sums.extend(reference::combine_row(&refs, &ws, h).into_iter().map(bf16::from_f32));
        }
        let combined = group.combine(&handle, CombineInputs::new(&HostTensor::tokens(n, h, sums))).await?;
        let tokens = self.with_shared(xs, combined.tokens())?;
        Ok(LayerOutput { tokens: HostTensor::tokens(b, h, tokens), routing, expert_counts: counts })
    }
}

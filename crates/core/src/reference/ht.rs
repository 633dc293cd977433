//! High-throughput reference: forward and backward dispatch and combine.

use half::bf16;

use super::{Rows, TokensRef, per_rank, round_bf16};
use crate::config::GroupConfig;
use crate::routing::{ExpertPlacement, HtRecvLayout, Routing, SendPlan};

/// What high-throughput forward dispatch delivers to one rank.
#[derive(Clone, Debug, PartialEq)]
pub struct HtDispatchResult {
    /// Where each of the `N` rows came from.
    pub layout: HtRecvLayout,
    /// The rows, `[N x H]` (and `[N x H/128]` scales for FP8).
    pub tokens: Rows,
    /// `[N x K]`: the source token's weight where its expert is local, 0 elsewhere.
    pub topk_weights: Vec<f32>,
    /// `[N x K]`: the local index of the source token's expert where local, -1 elsewhere.
    pub topk_idx: Vec<i64>,
}

fn layouts(config: &GroupConfig, routings: &[Routing]) -> Vec<HtRecvLayout> {
    let num_ranks = routings.len();
    let placement = ExpertPlacement::new(config.num_experts, num_ranks);
    let plans: Vec<SendPlan> = routings.iter().map(|r| SendPlan::new(r, placement)).collect();
    (0..num_ranks)
        .map(|d| {
            HtRecvLayout::from_received(
                placement.local_experts(),
                plans.iter().enumerate().map(|(s, p)| (s, p.copies_to(d))),
            )
        })
        .collect()
}

/// High-throughput forward dispatch over all ranks: `tokens[r]` are rank `r`'s `[B x H]` rows
/// (BF16, or FP8 with scales, as the config says) and `weights[r]` its `[B x K]` weights.
pub fn ht_dispatch(
    config: &GroupConfig,
    routings: &[Routing],
    tokens: &[TokensRef<'_>],
    weights: &[&[f32]],
) -> Vec<HtDispatchResult> {
    let num_ranks = routings.len();
    let placement = ExpertPlacement::new(config.num_experts, num_ranks);
    let h = config.hidden;
    let cols = config.scale_cols();
    let layouts = layouts(config, routings);
    per_rank(layouts.len(), |d| {
        let layout = layouts[d].clone();
        let n = layout.num_rows();
        let top_k = routings.first().map_or(0, Routing::top_k);
        let mut topk_weights = Vec::with_capacity(n * top_k);
        let mut topk_idx = Vec::with_capacity(n * top_k);
        let mut bf = Vec::new();
        let (mut q, mut scales) = (Vec::new(), Vec::new());
        for src in layout.rows() {
            let (s, t) = (src.src_rank as usize, src.token as usize);
            match tokens[s] {
                TokensRef::Bf16(x) => bf.extend_from_slice(&x[t * h..(t + 1) * h]),
                TokensRef::Fp8 { q: xq, scales: xs } => {
                    q.extend_from_slice(&xq[t * h..(t + 1) * h]);
                    scales.extend_from_slice(&xs[t * cols..(t + 1) * cols]);
                }
            }
            let r = &routings[s];
            for k in 0..r.top_k() {
                match r.expert(t, k) {
                    Some(e) if placement.owner(e) == d => {
                        topk_idx.push(placement.local_index(e) as i64);
                        topk_weights.push(weights[s][t * r.top_k() + k]);
                    }
                    _ => {
                        topk_idx.push(-1);
                        topk_weights.push(0.0);
                    }
                }
            }
        }
        let tokens = if config.dispatch_dtype.is_fp8() { Rows::Fp8 { q, scales } } else { Rows::Bf16(bf) };
        HtDispatchResult { layout, tokens, topk_weights, topk_idx }
    })
}

/// High-throughput backward dispatch: `grads[r]` (`[B x H]` BF16) to the same rows forward
/// dispatch filled. Returns each rank's `[N x H]`.
pub fn ht_dispatch_backward(config: &GroupConfig, routings: &[Routing], grads: &[&[bf16]]) -> Vec<Vec<bf16>> {
    let h = config.hidden;
    let layouts = layouts(config, routings);
    per_rank(layouts.len(), |d| {
        let layout = &layouts[d];
        let mut out = Vec::with_capacity(layout.num_rows() * h);
        for src in layout.rows() {
            let t = src.token as usize;
            out.extend_from_slice(&grads[src.src_rank as usize][t * h..(t + 1) * h]);
        }
        out
    })
}

/// High-throughput combine over all ranks: `expert_out[d]` is rank `d`'s `[N_d x H]`;
/// `weight_grads[d]`, in the backward pass, its `[N_d x K]`. Returns each rank's `[B x H]` and,
/// in the backward pass, `[B x K]`.
pub fn ht_combine(
    config: &GroupConfig,
    routings: &[Routing],
    expert_out: &[&[bf16]],
    weight_grads: Option<&[&[f32]]>,
) -> Vec<(Vec<bf16>, Option<Vec<f32>>)> {
    let num_ranks = routings.len();
    let placement = ExpertPlacement::new(config.num_experts, num_ranks);
    let h = config.hidden;
    // rows_of[s][t] = (destination, row) of each copy, in ascending destination.
    let mut rows_of: Vec<Vec<Vec<(usize, usize)>>> =
        routings.iter().map(|r| vec![Vec::new(); r.num_tokens()]).collect();
    for (d, layout) in layouts(config, routings).iter().enumerate() {
        for (i, src) in layout.rows().iter().enumerate() {
            rows_of[src.src_rank as usize][src.token as usize].push((d, i));
        }
    }
    per_rank(routings.len(), |s| {
        let routing = &routings[s];
        let b = routing.num_tokens();
        let k_n = routing.top_k();
        let mut out = vec![bf16::ZERO; b * h];
        let mut acc = vec![0f32; h];
        for t in 0..b {
            acc.iter_mut().for_each(|a| *a = 0.0);
            for &(d, i) in &rows_of[s][t] {
                for (a, v) in acc.iter_mut().zip(&expert_out[d][i * h..(i + 1) * h]) {
                    *a += v.to_f32();
                }
            }
            for (o, a) in out[t * h..(t + 1) * h].iter_mut().zip(&acc) {
                *o = round_bf16(*a);
            }
        }
        let w = weight_grads.map(|wg| {
            let mut w = vec![0f32; b * k_n];
            for t in 0..b {
                for k in 0..k_n {
                    let Some(e) = routing.expert(t, k) else { continue };
                    let owner = placement.owner(e);
                    let &(_, i) = rows_of[s][t].iter().find(|(d, _)| *d == owner).expect("owner holds a copy");
                    w[t * k_n + k] = wg[owner][i * k_n + k];
                }
            }
            w
        });
        (out, w)
    })
}

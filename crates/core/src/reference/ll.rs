//! Low-latency reference: expert-major dispatch and weighted combine.

use half::bf16;

use super::{Rows, round_bf16};
use crate::config::GroupConfig;
use crate::fp8;
use crate::routing::{ExpertPlacement, LlRecvLayout, Routing, SendPlan};

/// `expert_row(rank, local_expert, row, out)`: writes one expert-output row (BF16 values as fp32).
pub type ExpertRowFn<'a> = dyn Fn(usize, usize, usize, &mut [f32]) + 'a;

/// What low-latency dispatch delivers to one rank.
#[derive(Clone, Debug, PartialEq)]
pub struct LlDispatchResult {
    /// Where each row of each local expert came from.
    pub layout: LlRecvLayout,
    /// Per local expert, its `counts[l]` rows (compact: only the valid rows).
    pub experts: Vec<Rows>,
}

impl LlDispatchResult {
    /// Rows per local expert.
    pub fn counts(&self) -> Vec<i32> {
        self.layout.counts()
    }
}

/// Low-latency dispatch over all ranks: `routings[r]` and `tokens[r]` (`[B_r x H]`) are rank
/// `r`'s; returns each rank's received rows.
pub fn ll_dispatch(config: &GroupConfig, routings: &[Routing], tokens: &[&[bf16]]) -> Vec<LlDispatchResult> {
    let num_ranks = routings.len();
    let placement = ExpertPlacement::new(config.num_experts, num_ranks);
    let l = placement.local_experts();
    let h = config.hidden;
    let plans: Vec<SendPlan> = routings.iter().map(|r| SendPlan::new(r, placement)).collect();
    (0..num_ranks)
        .map(|dest| {
            let layout = LlRecvLayout::from_received(l, plans.iter().enumerate().map(|(s, p)| (s, p.copies_to(dest))));
            let experts = (0..l)
                .map(|le| {
                    let rows = layout.rows(le);
                    let mut data = Vec::with_capacity(rows.len() * h);
                    for src in rows {
                        let t = src.token as usize;
                        data.extend_from_slice(&tokens[src.src_rank as usize][t * h..(t + 1) * h]);
                    }
                    match config.dispatch_dtype {
                        // A group's type is never `Forwarded` (a per-call type of BF16 groups).
                        crate::DispatchDtype::Bf16 | crate::DispatchDtype::Forwarded { .. } => Rows::Bf16(data),
                        crate::DispatchDtype::Fp8 { round_scales } => {
                            let (q, scales) = fp8::quantize_bf16(&data, rows.len(), h, round_scales);
                            Rows::Fp8 { q, scales }
                        }
                    }
                })
                .collect();
            LlDispatchResult { layout, experts }
        })
        .collect()
}

/// Low-latency combine over all ranks.
///
/// `layouts[d]` is rank `d`'s dispatch layout; `expert_row(d, l, i, out)` writes row `i` of
/// local expert `l`'s output on rank `d` (BF16 values, as fp32) into `out` (`H` values);
/// `weights[s]` is rank `s`'s top-k weights `[B_s x K]`. Returns each rank's `[B x H]` tokens.
///
/// # Panics
///
/// If a layout misses a valid selection of `routings` (layouts must come from these routings).
pub fn ll_combine(
    config: &GroupConfig,
    routings: &[Routing],
    layouts: &[LlRecvLayout],
    expert_row: &ExpertRowFn<'_>,
    weights: &[&[f32]],
) -> Vec<Vec<bf16>> {
    let num_ranks = routings.len();
    let h = config.hidden;
    // location[s][t * K + k] = (local expert, row) of that selection on its owner (the owner
    // itself follows from the routing).
    let mut location: Vec<Vec<Option<(usize, usize)>>> =
        routings.iter().map(|r| vec![None; r.num_tokens() * r.top_k()]).collect();
    for layout in layouts {
        for le in 0..layout.local_experts() {
            for (i, src) in layout.rows(le).iter().enumerate() {
                let s = src.src_rank as usize;
                let k = routings[s].top_k();
                location[s][src.token as usize * k + src.k as usize] = Some((le, i));
            }
        }
    }
    let placement = ExpertPlacement::new(config.num_experts, num_ranks);
    routings
        .iter()
        .enumerate()
        .map(|(s, routing)| {
            let k_n = routing.top_k();
            let mut out = vec![bf16::ZERO; routing.num_tokens() * h];
            let mut acc = vec![0f32; h];
            let mut x = vec![0f32; h];
            for t in 0..routing.num_tokens() {
                acc.iter_mut().for_each(|a| *a = 0.0);
                for k in 0..k_n {
                    let Some(e) = routing.expert(t, k) else { continue };
                    let (le, i) = location[s][t * k_n + k].expect("every valid selection has a row");
                    expert_row(placement.owner(e), le, i, &mut x);
                    let w = weights[s][t * k_n + k];
                    for (a, v) in acc.iter_mut().zip(&x) {
                        *a = w.mul_add(*v, *a);
                    }
                }
                for (o, a) in out[t * h..(t + 1) * h].iter_mut().zip(&acc) {
                    *o = round_bf16(*a);
                }
            }
            out
        })
        .collect()
}

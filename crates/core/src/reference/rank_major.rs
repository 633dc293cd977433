//! Low-latency rank-major reference: dispatch a row per (source, token), the expert side's
//! pre-reduction, and combine's sum over the ranks a token reached.
//!
//! Arithmetic, exactly (backends match it bit for bit):
//!
//! - **Expert side** ([`rank_major_expert_sum`]): for a received row with local expert indices
//!   `idx[k]` and weights `w[k]`, `acc = 0f32`, then for each `k` in ascending order with
//!   `idx[k] >= 0`, `acc = fma(w[k], y_k, acc)` where `y_k` is expert `idx[k]`'s BF16 output (as
//!   fp32); the row is `acc` rounded to BF16.
//! - **Combine**: for each token, `acc = 0f32`, then over the ranks the token reached, in the
//!   order of each rank's first top-k entry, `acc += x_r` (the rank's BF16 row as fp32); the
//!   result is `acc` rounded to BF16. A token with no valid entry gives 0.
//!
//! Against expert-major (one fp32 chain over every `k`, rounded once) each rank's partial sum is
//! rounded to BF16 once more, and the terms are added in another order. The difference is at
//! most one BF16 rounding of each partial sum plus the final one:
//! `|rank_major - expert_major| <= (ranks reached + 1) * ulp(max partial magnitude)` in exact
//! arithmetic; `tests/host_matches_reference.rs` measures it.

use half::bf16;

use super::{Rows, round_bf16};
use crate::config::{DispatchDtype, GroupConfig};
use crate::fp8;
use crate::routing::{ExpertPlacement, RankRecvLayout, Routing, SendPlan};

/// What rank-major dispatch delivers to one rank.
#[derive(Clone, Debug, PartialEq)]
pub struct RankMajorDispatchResult {
    /// Where each row of each source came from.
    pub layout: RankRecvLayout,
    /// Per source rank, its `counts[s]` rows (compact: only the valid rows).
    pub sources: Vec<Rows>,
    /// Per source rank, `[counts[s] x K]` weights as the source sent them (every `k`).
    pub weights: Vec<Vec<f32>>,
    /// Per source rank, `[counts[s] x K]`: the local expert of each top-k entry, `-1` where the
    /// expert lives on another rank (or the entry is masked).
    pub idx: Vec<Vec<i32>>,
}

impl RankMajorDispatchResult {
    /// Rows per source rank (the `[R]` receive counters).
    pub fn counts(&self) -> Vec<i32> {
        self.layout.counts()
    }
}

/// Rank-major dispatch over all ranks: `routings[r]`, `tokens[r]` (`[B_r x H]`) and
/// `weights[r]` (`[B_r x K]`) are rank `r`'s.
pub fn ll_dispatch_rank_major(
    config: &GroupConfig,
    routings: &[Routing],
    tokens: &[&[bf16]],
    weights: &[&[f32]],
) -> Vec<RankMajorDispatchResult> {
    let num_ranks = routings.len();
    let placement = ExpertPlacement::new(config.num_experts, num_ranks);
    let h = config.hidden;
    let plans: Vec<SendPlan> = routings.iter().map(|r| SendPlan::new(r, placement)).collect();
    (0..num_ranks)
        .map(|dest| {
            let layout =
                RankRecvLayout::from_received(num_ranks, plans.iter().enumerate().map(|(s, p)| (s, p.copies_to(dest))));
            let mut sources = Vec::with_capacity(num_ranks);
            let (mut ws, mut is) = (Vec::with_capacity(num_ranks), Vec::with_capacity(num_ranks));
            for (s, plan) in plans.iter().enumerate() {
                let k_n = routings[s].top_k();
                let copies = plan.copies_to(dest);
                let mut data = Vec::with_capacity(copies.len() * h);
                let (mut w, mut idx) = (Vec::with_capacity(copies.len() * k_n), vec![-1i32; copies.len() * k_n]);
                for (i, c) in copies.iter().enumerate() {
                    let t = c.token as usize;
                    data.extend_from_slice(&tokens[s][t * h..(t + 1) * h]);
                    w.extend_from_slice(&weights[s][t * k_n..(t + 1) * k_n]);
                    for sel in &c.selections {
                        idx[i * k_n + sel.k as usize] = sel.local_expert as i32;
                    }
                }
                sources.push(match config.dispatch_dtype {
                    // A group's type is never `Forwarded` (a per-call type of BF16 groups).
                    DispatchDtype::Bf16 | DispatchDtype::Forwarded { .. } => Rows::Bf16(data),
                    DispatchDtype::Fp8 { round_scales } => {
                        let (q, scales) = fp8::quantize_bf16(&data, copies.len(), h, round_scales);
                        Rows::Fp8 { q, scales }
                    }
                });
                ws.push(w);
                is.push(idx);
            }
            RankMajorDispatchResult { layout, sources, weights: ws, idx: is }
        })
        .collect()
}

/// The expert side of one rank-major row: `out = bf16(sum over k ascending with idx[k] >= 0 of
/// fma(w[k], y_k, acc))`, where `expert(local_expert, y)` writes that expert's BF16 output for the
/// row (as fp32) into `y` (`H` values). `out` holds `H` values.
pub fn rank_major_expert_sum(
    idx: &[i32],
    weights: &[f32],
    expert: &mut dyn FnMut(usize, &mut [f32]),
    out: &mut [bf16],
) {
    let h = out.len();
    let mut acc = vec![0f32; h];
    let mut y = vec![0f32; h];
    for (&le, &w) in idx.iter().zip(weights) {
        if le < 0 {
            continue;
        }
        expert(le as usize, &mut y);
        for (a, v) in acc.iter_mut().zip(&y) {
            *a = w.mul_add(*v, *a);
        }
    }
    for (o, a) in out.iter_mut().zip(&acc) {
        *o = round_bf16(*a);
    }
}

/// `row(d, s, i, out)`: writes row `i` of source `s`'s block of rank `d`'s combine input (BF16
/// values as fp32) into `out` (`H` values).
pub type RankRowFn<'a> = dyn Fn(usize, usize, usize, &mut [f32]) + 'a;

/// Rank-major combine over all ranks: `layouts[d]` is rank `d`'s dispatch layout; returns each
/// rank's `[B x H]` tokens.
///
/// # Panics
///
/// If a layout misses a token that `routings` sends to it (layouts must come from these
/// routings).
pub fn ll_combine_rank_major(
    config: &GroupConfig,
    routings: &[Routing],
    layouts: &[RankRecvLayout],
    row: &RankRowFn<'_>,
) -> Vec<Vec<bf16>> {
    let num_ranks = routings.len();
    let h = config.hidden;
    let placement = ExpertPlacement::new(config.num_experts, num_ranks);
    routings
        .iter()
        .enumerate()
        .map(|(s, routing)| {
            // position[d][t] = row of token t in rank d's block for source s.
            let mut position = vec![vec![usize::MAX; routing.num_tokens()]; num_ranks];
            for (d, layout) in layouts.iter().enumerate() {
                for (i, src) in layout.rows(s).iter().enumerate() {
                    position[d][src.token as usize] = i;
                }
            }
            let mut out = vec![bf16::ZERO; routing.num_tokens() * h];
            let mut acc = vec![0f32; h];
            let mut x = vec![0f32; h];
            for t in 0..routing.num_tokens() {
                acc.iter_mut().for_each(|a| *a = 0.0);
                for d in ranks_reached(routing, placement, t) {
                    let i = position[d][t];
                    assert!(i != usize::MAX, "rank {d} has no row of token {t} from rank {s}");
                    row(d, s, i, &mut x);
                    for (a, v) in acc.iter_mut().zip(&x) {
                        *a += *v;
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

/// The ranks token `t` reached, in the order of their first top-k entry.
pub fn ranks_reached(routing: &Routing, placement: ExpertPlacement, t: usize) -> Vec<usize> {
    (0..routing.top_k()).filter_map(|k| routing.first_of_its_rank(placement, t, k)).collect()
}

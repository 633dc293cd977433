//! A whole world's inputs for one operation round, generated from a seed, with the reference
//! results they should produce. Used by `epflow bench --validate`, the tests and the examples.

use std::borrow::Cow;

use half::bf16;

use crate::config::{DispatchDtype, GroupConfig};
use crate::error::ValidationError;
use crate::fp8;
use crate::mask::{self, RankSet};
use crate::ops::Layout;
use crate::reference::{self, HtDispatchResult, LlDispatchResult, RankMajorDispatchResult, Rows, TokensRef};
use crate::routing::Routing;
use crate::tensor::HostTensor;
use crate::workload::{RoutingKind, RoutingSpec, random_tokens, random_topk_idx, random_weights};

/// One rank's inputs.
#[derive(Clone, Debug, PartialEq)]
pub struct RankInputs {
    /// `B`.
    pub num_tokens: usize,
    /// `[B x K]`.
    pub topk_idx: Vec<i64>,
    /// `[B x H]` BF16.
    pub tokens: Vec<bf16>,
    /// `[B x K]`.
    pub weights: Vec<f32>,
    /// `tokens` quantized (`[B x H]` e4m3, `[B x H/128]` scales) when the config dispatches FP8.
    pub fp8: Option<(Vec<u8>, Vec<f32>)>,
}

/// Every rank's inputs.
#[derive(Clone, Debug, PartialEq)]
pub struct Scenario {
    /// The group config.
    pub config: GroupConfig,
    /// `R`.
    pub num_ranks: usize,
    /// `K`.
    pub top_k: usize,
    /// Per rank.
    pub ranks: Vec<RankInputs>,
}

impl Scenario {
    /// Generates inputs: rank `r` routes `tokens_per_rank[r]` tokens (the last entry repeats if
    /// there are fewer entries than ranks).
    pub fn generate(
        config: GroupConfig,
        num_ranks: usize,
        tokens_per_rank: &[usize],
        top_k: usize,
        kind: RoutingKind,
        masked: usize,
        seed: u64,
    ) -> Self {
        let ranks = reference::per_rank(num_ranks, |r| {
            let b = tokens_per_rank.get(r).or(tokens_per_rank.last()).copied().unwrap_or(0);
            let spec = RoutingSpec { num_tokens: b, top_k, num_experts: config.num_experts, num_ranks, masked, kind };
            let tokens = random_tokens(b, config.hidden, seed, r);
            let fp8 = match config.dispatch_dtype {
                DispatchDtype::Fp8 { round_scales } => {
                    Some(fp8::quantize_bf16(&tokens, b, config.hidden, round_scales))
                }
                DispatchDtype::Bf16 | DispatchDtype::Forwarded { .. } => None,
            };
            RankInputs {
                num_tokens: b,
                topk_idx: random_topk_idx(&spec, seed, r),
                weights: random_weights(b, top_k, seed, r),
                tokens,
                fp8,
            }
        });
        Scenario { config, num_ranks, top_k, ranks }
    }

    /// The validated routings.
    pub fn routings(&self) -> Result<Vec<Routing>, ValidationError> {
        self.ranks
            .iter()
            .map(|r| Routing::new(r.topk_idx.clone(), r.num_tokens, self.top_k, self.config.num_experts))
            .collect()
    }

    /// Rank `r`'s `topk_idx` tensor.
    pub fn topk_idx(&self, r: usize) -> HostTensor {
        HostTensor::topk_idx(self.ranks[r].num_tokens, self.top_k, self.ranks[r].topk_idx.clone())
    }

    /// Rank `r`'s BF16 tokens.
    pub fn tokens(&self, r: usize) -> HostTensor {
        HostTensor::tokens(self.ranks[r].num_tokens, self.config.hidden, self.ranks[r].tokens.clone())
    }

    /// Rank `r`'s FP8 tokens and scales (FP8 configs).
    pub fn tokens_fp8(&self, r: usize) -> Option<(HostTensor, HostTensor)> {
        let b = self.ranks[r].num_tokens;
        let h = self.config.hidden;
        self.ranks[r]
            .fp8
            .as_ref()
            .map(|(q, s)| (HostTensor::tokens_fp8(b, h, q.clone()), HostTensor::scales(b, h / 128, s.clone())))
    }

    /// Rank `r`'s top-k weights.
    pub fn weights(&self, r: usize) -> HostTensor {
        HostTensor::topk_weights(self.ranks[r].num_tokens, self.top_k, self.ranks[r].weights.clone())
    }

    /// Valid `(token, k)` selections of rank `r` (ep_bench's low-latency byte count is this
    /// times `H * 2`).
    pub fn valid_selections(&self, r: usize) -> usize {
        self.ranks[r].topk_idx.iter().filter(|&&e| e >= 0).count()
    }

    /// Reference low-latency dispatch.
    pub fn ll_dispatch_reference(&self) -> Result<Vec<LlDispatchResult>, ValidationError> {
        let tokens: Vec<&[bf16]> = self.ranks.iter().map(|r| r.tokens.as_slice()).collect();
        Ok(reference::ll_dispatch(&self.config, &self.routings()?, &tokens))
    }

    /// Reference low-latency combine of identity experts (each expert returns its input; FP8
    /// inputs dequantized and rounded to BF16), weighted with each rank's weights.
    pub fn ll_combine_identity_reference(
        &self,
        dispatch: &[LlDispatchResult],
    ) -> Result<Vec<Vec<bf16>>, ValidationError> {
        let routings = self.routings()?;
        let layouts: Vec<_> = dispatch.iter().map(|d| d.layout.clone()).collect();
        let h = self.config.hidden;
        let weights: Vec<&[f32]> = self.ranks.iter().map(|r| r.weights.as_slice()).collect();
        let row = |d: usize, le: usize, i: usize, out: &mut [f32]| dispatch[d].experts[le].row_as_bf16_f32(i, h, out);
        Ok(reference::ll_combine(&self.config, &routings, &layouts, &row, &weights))
    }

    /// Reference low-latency rank-major dispatch.
    pub fn ll_rank_major_reference(&self) -> Result<Vec<RankMajorDispatchResult>, ValidationError> {
        let tokens: Vec<&[bf16]> = self.ranks.iter().map(|r| r.tokens.as_slice()).collect();
        let weights: Vec<&[f32]> = self.ranks.iter().map(|r| r.weights.as_slice()).collect();
        Ok(reference::ll_dispatch_rank_major(&self.config, &self.routings()?, &tokens, &weights))
    }

    /// Reference rank-major combine of identity experts: each received row, pre-reduced on the
    /// expert side with its weights ([`reference::rank_major_expert_sum`]; FP8 rows dequantized
    /// and rounded to BF16), summed over the ranks each token reached.
    pub fn ll_rank_major_combine_identity_reference(
        &self,
        dispatch: &[RankMajorDispatchResult],
    ) -> Result<Vec<Vec<bf16>>, ValidationError> {
        let routings = self.routings()?;
        let layouts: Vec<_> = dispatch.iter().map(|d| d.layout.clone()).collect();
        let (h, k) = (self.config.hidden, self.top_k);
        let row = |d: usize, s: usize, i: usize, out: &mut [f32]| {
            let r = &dispatch[d];
            let mut sum = vec![bf16::ZERO; h];
            let (idx, w) = (&r.idx[s][i * k..(i + 1) * k], &r.weights[s][i * k..(i + 1) * k]);
            identity_expert_sum(&r.sources[s], i, idx, w, &mut sum);
            for (o, v) in out.iter_mut().zip(&sum) {
                *o = v.to_f32();
            }
        };
        Ok(reference::ll_combine_rank_major(&self.config, &routings, &layouts, &row))
    }

    /// The low-latency combine input identity experts would give rank `rank` under `layout`,
    /// from the reference dispatch alone ([`ll_reference_expert_outputs`],
    /// [`rank_major_reference_expert_outputs`]): what a caller writes into a captured step's
    /// expert-output buffer before the replay that dispatches.
    pub fn ll_reference_expert_outputs(&self, rank: usize, layout: Layout) -> Result<HostTensor, ValidationError> {
        let (m, h) = (self.config.fixed_max_tokens().unwrap_or(0), self.config.hidden);
        Ok(match layout {
            Layout::ExpertMajor => {
                ll_reference_expert_outputs(&self.ll_dispatch_reference()?[rank], self.num_ranks * m, h)
            }
            Layout::RankMajor => {
                rank_major_reference_expert_outputs(&self.ll_rank_major_reference()?[rank], m, h, self.top_k)
            }
        })
    }

    /// Reference low-latency combine of the combine inputs `expert_out` (each rank's, in
    /// `layout`'s shape: `[L x R*M x H]` expert-major, `[R*M x H]` rank-major) travelling as
    /// `quant` says: BF16 rows as they are, or NVFP4 rows under the global scales
    /// [`nvfp4_global_scales`] gives ([`crate::nvfp4::round_trip`]), weighted with each rank's
    /// weights (expert-major) or summed (rank-major). `bound`: instead, each token's bound on
    /// the NVFP4 error, `sum |w_k| x` [`crate::nvfp4::element_error_bound`] (rank-major: the
    /// rows' bounds summed), before the output's BF16 rounding.
    pub fn ll_combine_reference_of(
        &self,
        layout: Layout,
        expert_out: &[HostTensor],
        quant: crate::dtype::CombineQuant,
        bound: bool,
    ) -> Result<Vec<Vec<bf16>>, ValidationError> {
        let routings = self.routings()?;
        let (h, m) = (self.config.hidden, self.config.fixed_max_tokens().unwrap_or(0));
        let nvfp4 = quant == crate::dtype::CombineQuant::Nvfp4;
        // Row `r` of rank d's combine input as the receiver sums it.
        let row = |d: usize, r: usize, out: &mut [f32]| {
            let x = &expert_out[d].as_bf16().unwrap_or_default()[r * h..(r + 1) * h];
            let g = crate::nvfp4::global_scale(x);
            match (nvfp4, bound) {
                (_, true) => crate::nvfp4::element_error_bound(x, g, out),
                (true, false) => crate::nvfp4::round_trip(x, g, out),
                (false, false) => out.iter_mut().zip(x).for_each(|(o, v)| *o = v.to_f32()),
            }
        };
        Ok(match layout {
            Layout::ExpertMajor => {
                let dispatch = self.ll_dispatch_reference()?;
                let layouts: Vec<_> = dispatch.into_iter().map(|d| d.layout).collect();
                let rows_per_expert = self.num_ranks * m;
                let abs: Vec<Vec<f32>> = self
                    .ranks
                    .iter()
                    .map(|r| r.weights.iter().map(|w| if bound { w.abs() } else { *w }).collect())
                    .collect();
                let weights: Vec<&[f32]> = abs.iter().map(Vec::as_slice).collect();
                let expert_row = |d: usize, le: usize, i: usize, out: &mut [f32]| row(d, le * rows_per_expert + i, out);
                reference::ll_combine(&self.config, &routings, &layouts, &expert_row, &weights)
            }
            Layout::RankMajor => {
                let dispatch = self.ll_rank_major_reference()?;
                let layouts: Vec<_> = dispatch.into_iter().map(|d| d.layout).collect();
                let rank_row = |d: usize, s: usize, i: usize, out: &mut [f32]| row(d, s * m + i, out);
                reference::ll_combine_rank_major(&self.config, &routings, &layouts, &rank_row)
            }
        })
    }

    /// The scenario a group with `masked` ranks serves ([`crate::mask`]): the masked ranks
    /// send nothing (every entry of theirs is `-1`), and every entry naming an expert on a
    /// masked rank is `-1`. Its references are what the survivors must produce.
    pub fn without_ranks(&self, masked: &RankSet) -> Scenario {
        let local = self.config.local_experts(self.num_ranks);
        let mut out = self.clone();
        for (r, inputs) in out.ranks.iter_mut().enumerate() {
            inputs.topk_idx = if masked.contains(r) {
                vec![-1; inputs.topk_idx.len()]
            } else {
                mask::without_masked_experts(&inputs.topk_idx, local, masked)
            };
        }
        out
    }

    /// Rank `r`'s per-token count of top-k entries on `masked` ranks (the combine's
    /// [`crate::ops::CombineOutputs::masked`]).
    pub fn masked_entries(&self, r: usize, masked: &RankSet) -> Vec<i32> {
        let local = self.config.local_experts(self.num_ranks);
        mask::masked_entries(&self.ranks[r].topk_idx, self.top_k, local, masked)
    }

    fn tokens_refs(&self) -> Vec<TokensRef<'_>> {
        self.ranks
            .iter()
            .map(|r| match &r.fp8 {
                Some((q, s)) => TokensRef::Fp8 { q, scales: s },
                None => TokensRef::Bf16(&r.tokens),
            })
            .collect()
    }

    /// Reference high-throughput forward dispatch.
    pub fn ht_dispatch_reference(&self) -> Result<Vec<HtDispatchResult>, ValidationError> {
        let weights: Vec<&[f32]> = self.ranks.iter().map(|r| r.weights.as_slice()).collect();
        Ok(reference::ht_dispatch(&self.config, &self.routings()?, &self.tokens_refs(), &weights))
    }

    /// Reference high-throughput forward combine of identity experts: each received row is
    /// returned as BF16 (FP8 rows dequantized and rounded).
    pub fn ht_combine_identity_reference(
        &self,
        dispatch: &[HtDispatchResult],
    ) -> Result<Vec<Vec<bf16>>, ValidationError> {
        let rows = ht_identity_rows(dispatch, self.config.hidden);
        let refs: Vec<&[bf16]> = rows.iter().map(|r| &r[..]).collect();
        Ok(reference::ht_combine(&self.config, &self.routings()?, &refs, None).into_iter().map(|(t, _)| t).collect())
    }
}

/// Every rank's identity-expert outputs of a high-throughput dispatch: BF16 rows as received
/// (borrowed, not copied), FP8 rows dequantized and rounded ([`identity_rows`], a thread per rank).
pub fn ht_identity_rows(dispatch: &[HtDispatchResult], hidden: usize) -> Vec<Cow<'_, [bf16]>> {
    reference::per_rank(dispatch.len(), |d| match dispatch[d].tokens.as_bf16() {
        Some(v) => Cow::Borrowed(v),
        None => Cow::Owned(identity_rows(&dispatch[d].tokens, hidden)),
    })
}

/// Rows as BF16: BF16 rows unchanged, FP8 rows dequantized and rounded.
pub fn identity_rows(rows: &reference::Rows, hidden: usize) -> Vec<bf16> {
    if let Some(v) = rows.as_bf16() {
        return v.to_vec();
    }
    let n = rows.num_rows(hidden);
    let mut out = Vec::with_capacity(n * hidden);
    let mut buf = vec![0f32; hidden];
    for i in 0..n {
        rows.row_as_bf16_f32(i, hidden, &mut buf);
        out.extend(buf.iter().map(|&v| bf16::from_f32(v)));
    }
    out
}

/// The NVFP4 global scales of a combine input `expert_out` (`[.. x H]` BF16): one fp32 per row,
/// [`crate::nvfp4::global_scale`], in the input's shape with a last dimension of 1.
pub fn nvfp4_global_scales(expert_out: &HostTensor) -> HostTensor {
    let shape = &expert_out.desc().shape;
    let h = shape.last().copied().unwrap_or(1).max(1);
    let x = expert_out.as_bf16().unwrap_or_default();
    let g: Vec<f32> = x.chunks_exact(h).map(crate::nvfp4::global_scale).collect();
    let mut gshape = shape.clone();
    if let Some(last) = gshape.last_mut() {
        *last = 1;
    }
    HostTensor::new(crate::TensorTag::Scales, &gshape, crate::tensor::HostData::F32(g))
}

/// Identity experts for low-latency combine: a dense `[L x rows_per_expert x H]` BF16 tensor
/// holding, in each expert's first `counts[l]` rows, that expert's dispatched rows (FP8 rows
/// dequantized and rounded to BF16). Other rows are zero.
pub fn ll_identity_expert_outputs(
    tokens: &crate::tensor::HostData,
    scales: Option<&[f32]>,
    counts: &[i32],
    rows_per_expert: usize,
    hidden: usize,
) -> HostTensor {
    use crate::tensor::HostData;
    let l = counts.len();
    let shape = [l, rows_per_expert, hidden];
    match tokens {
        HostData::Bf16(v) => HostTensor::new(crate::TensorTag::Tokens, &shape, HostData::Bf16(v.clone())),
        HostData::Fp8(q) => {
            let mut out = vec![bf16::ZERO; l * rows_per_expert * hidden];
            let cols = hidden / crate::config::FP8_BLOCK;
            let s = scales.unwrap_or_default();
            for (le, &n) in counts.iter().enumerate() {
                let base = le * rows_per_expert;
                let rows = Rows::Fp8 {
                    q: q[base * hidden..(base + n as usize) * hidden].to_vec(),
                    scales: s[base * cols..(base + n as usize) * cols].to_vec(),
                };
                out[base * hidden..(base + n as usize) * hidden].copy_from_slice(&identity_rows(&rows, hidden));
            }
            HostTensor::new(crate::TensorTag::Tokens, &shape, HostData::Bf16(out))
        }
        other => HostTensor::new(crate::TensorTag::Tokens, &shape, other.clone()),
    }
}

/// The identity experts' rank-major pre-reduction of row `i` of `rows` (every expert returns the
/// row, FP8 dequantized and rounded to BF16) with its top-k `idx` and `weights`, into `out`
/// (`H` values; [`reference::rank_major_expert_sum`]).
fn identity_expert_sum(rows: &Rows, i: usize, idx: &[i32], weights: &[f32], out: &mut [bf16]) {
    let mut x = vec![0f32; out.len()];
    rows.row_as_bf16_f32(i, out.len(), &mut x);
    reference::rank_major_expert_sum(idx, weights, &mut |_, y| y.copy_from_slice(&x), out);
}

/// Identity experts for rank-major combine: the `[R*M x H]` BF16 combine input computed from a
/// backend's rank-major dispatch outputs (`tokens` `[R*M x H]` BF16 or FP8 with `scales`,
/// `weights` and `idx` `[R*M x K]`, `counts` `[R]`): each source's first `counts[s]` rows are
/// pre-reduced as [`reference::rank_major_expert_sum`] defines, every expert returning the row
/// itself (FP8 dequantized and rounded to BF16). Other rows are zero.
#[allow(clippy::too_many_arguments)]
pub fn rank_major_identity_expert_outputs(
    tokens: &crate::tensor::HostData,
    scales: Option<&[f32]>,
    weights: &[f32],
    idx: &[i32],
    counts: &[i32],
    max_tokens: usize,
    hidden: usize,
    top_k: usize,
) -> HostTensor {
    use crate::tensor::HostData;
    let rows = counts.len() * max_tokens;
    let mut out = vec![bf16::ZERO; rows * hidden];
    let data = match tokens {
        HostData::Bf16(v) => Rows::Bf16(v.clone()),
        HostData::Fp8(q) => Rows::Fp8 { q: q.clone(), scales: scales.unwrap_or_default().to_vec() },
        _ => return HostTensor::new(crate::TensorTag::Tokens, &[rows, hidden], HostData::Bf16(out)),
    };
    for (s, &n) in counts.iter().enumerate() {
        for i in 0..(n.max(0) as usize).min(max_tokens) {
            let r = s * max_tokens + i;
            let (ri, rw) = (&idx[r * top_k..(r + 1) * top_k], &weights[r * top_k..(r + 1) * top_k]);
            identity_expert_sum(&data, r, ri, rw, &mut out[r * hidden..(r + 1) * hidden]);
        }
    }
    HostTensor::new(crate::TensorTag::Tokens, &[rows, hidden], HostData::Bf16(out))
}

/// Identity experts for a low-latency expert-major combine, computed from the reference
/// dispatch `d` alone (no backend output needed, e.g. to refill a captured step's expert-output
/// buffer before the replay that dispatches): `[L x rows_per_expert x H]` BF16, expert `l`'s
/// first `counts[l]` rows holding its received rows (FP8 dequantized), other rows zero.
pub fn ll_reference_expert_outputs(d: &LlDispatchResult, rows_per_expert: usize, hidden: usize) -> HostTensor {
    let l = d.experts.len();
    let mut out = vec![bf16::ZERO; l * rows_per_expert * hidden];
    for (le, rows) in d.experts.iter().enumerate() {
        let y = identity_rows(rows, hidden);
        let base = le * rows_per_expert * hidden;
        out[base..base + y.len()].copy_from_slice(&y);
    }
    HostTensor::new(crate::TensorTag::Tokens, &[l, rows_per_expert, hidden], crate::tensor::HostData::Bf16(out))
}

/// Identity experts for a rank-major combine, from the reference rank-major dispatch `d` alone:
/// `[R*M x H]` BF16, each source's received rows pre-reduced as
/// [`rank_major_identity_expert_outputs`] does, other rows zero.
pub fn rank_major_reference_expert_outputs(
    d: &RankMajorDispatchResult,
    max_tokens: usize,
    hidden: usize,
    top_k: usize,
) -> HostTensor {
    let rows = d.sources.len() * max_tokens;
    let mut out = vec![bf16::ZERO; rows * hidden];
    for (s, src) in d.sources.iter().enumerate() {
        for (i, r) in (s * max_tokens..).take(d.counts()[s].max(0) as usize).enumerate() {
            let (ri, rw) = (&d.idx[s][i * top_k..(i + 1) * top_k], &d.weights[s][i * top_k..(i + 1) * top_k]);
            identity_expert_sum(src, i, ri, rw, &mut out[r * hidden..(r + 1) * hidden]);
        }
    }
    HostTensor::new(crate::TensorTag::Tokens, &[rows, hidden], crate::tensor::HostData::Bf16(out))
}

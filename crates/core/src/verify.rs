//! Comparison of a backend's outputs with the reference, as a [`Report`].

use half::bf16;

use crate::reference::{HtDispatchResult, LlDispatchResult, RankMajorDispatchResult, Rows, within_one_ulp};
use crate::tensor::HostData;

/// The outcome of a comparison.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Report {
    /// Elements compared.
    pub checked: u64,
    /// Elements that differ beyond the tolerance.
    pub mismatched: u64,
    /// The first mismatch, described.
    pub first: Option<String>,
    /// Largest absolute difference seen (float comparisons).
    pub max_abs_diff: f64,
}

impl Report {
    /// Whether nothing mismatched.
    pub fn ok(&self) -> bool {
        self.mismatched == 0
    }

    fn record(&mut self, ok: bool, describe: impl FnOnce() -> String) {
        self.checked += 1;
        if !ok {
            self.mismatched += 1;
            if self.first.is_none() {
                self.first = Some(describe());
            }
        }
    }

    /// Adds `other`'s counts to this report.
    pub fn merge(&mut self, other: Report) {
        self.checked += other.checked;
        self.mismatched += other.mismatched;
        self.max_abs_diff = self.max_abs_diff.max(other.max_abs_diff);
        if self.first.is_none() {
            self.first = other.first;
        }
    }

    /// Prefixes the first mismatch with `context` (e.g. `"rank 2"`).
    pub fn context(mut self, context: &str) -> Self {
        self.first = self.first.map(|f| format!("{context}: {f}"));
        self
    }
}

/// How close BF16 results must be.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Tolerance {
    /// Identical bits.
    Exact,
    /// At most one BF16 ulp apart.
    OneUlp,
}

/// Compares BF16 values.
pub fn check_bf16(what: &str, expected: &[bf16], got: &[bf16], tol: Tolerance) -> Report {
    let mut r = Report::default();
    if expected.len() != got.len() {
        r.record(false, || format!("{what}: {} values, expected {}", got.len(), expected.len()));
        return r;
    }
    for (i, (e, g)) in expected.iter().zip(got).enumerate() {
        let ok = match tol {
            Tolerance::Exact => e.to_bits() == g.to_bits(),
            Tolerance::OneUlp => within_one_ulp(*e, *g),
        };
        r.max_abs_diff = r.max_abs_diff.max(f64::from((e.to_f32() - g.to_f32()).abs()));
        r.record(ok, || format!("{what}[{i}] = {g} (bits {:#06x}), expected {e} ({:#06x})", g.to_bits(), e.to_bits()));
    }
    r
}

/// Compares values bit for bit.
pub fn check_exact<T: PartialEq + std::fmt::Debug + Copy>(
    what: &str,
    expected: &[T],
    got: &[T],
    eq: fn(T, T) -> bool,
) -> Report {
    let mut r = Report::default();
    if expected.len() != got.len() {
        r.record(false, || format!("{what}: {} values, expected {}", got.len(), expected.len()));
        return r;
    }
    for (i, (&e, &g)) in expected.iter().zip(got).enumerate() {
        r.record(eq(e, g), || format!("{what}[{i}] = {g:?}, expected {e:?}"));
    }
    r
}

fn f32_bits_eq(a: f32, b: f32) -> bool {
    a.to_bits() == b.to_bits()
}

/// Compares the reference rows `want` (`n` of them) bit for bit with rows `base..base + n` of a
/// backend's tokens (and FP8 scales); `what` names the block in mismatch reports.
fn check_row_block(
    what: &str,
    want: &Rows,
    tokens: &HostData,
    scales: Option<&[f32]>,
    (base, n, hidden): (usize, usize, usize),
) -> Report {
    let cols = hidden / 128;
    let span = |w: usize| base * w..(base + n) * w;
    let mut r = Report::default();
    match (want, tokens) {
        (Rows::Bf16(want), HostData::Bf16(got)) => {
            r.merge(check_bf16(what, want, &got[span(hidden)], Tolerance::Exact));
        }
        (Rows::Fp8 { q, scales: ws }, HostData::Fp8(got)) => {
            r.merge(check_exact(&format!("{what} fp8"), q, &got[span(hidden)], |a, b| a == b));
            match scales {
                Some(s) => r.merge(check_exact(&format!("{what} scales"), ws, &s[span(cols)], f32_bits_eq)),
                None => r.record(false, || "FP8 dispatch returned no scales".into()),
            }
        }
        _ => r.record(false, || format!("{what}: output dtype {:?} does not match", tokens.dtype())),
    }
    r
}

/// Compares one rank's low-latency dispatch outputs with the reference: the counters, and bit
/// for bit every valid row (payload and FP8 scales) of the dense `[L x R*M x H]` tokens.
pub fn check_ll_dispatch(
    expected: &LlDispatchResult,
    hidden: usize,
    rows_per_expert: usize,
    tokens: &HostData,
    scales: Option<&[f32]>,
    counts: &[i32],
) -> Report {
    let mut r = check_exact("counts", &expected.counts(), counts, |a, b| a == b);
    if !r.ok() {
        return r;
    }
    for (le, rows) in expected.experts.iter().enumerate() {
        let block = (le * rows_per_expert, expected.layout.rows(le).len(), hidden);
        r.merge(check_row_block(&format!("expert {le}"), rows, tokens, scales, block));
    }
    r
}

/// Compares one rank's rank-major dispatch outputs with the reference: the `[R]` counters, bit
/// for bit every valid row of each source's block (`tokens` `[R*M x H]`, FP8 `scales`,
/// `weights` and local expert `idx` `[R*M x K]`), and `-1` in every `idx` entry of the rows
/// after each source's last (NCCL EP's sentinel).
#[allow(clippy::too_many_arguments)]
pub fn check_rank_major_dispatch(
    expected: &RankMajorDispatchResult,
    hidden: usize,
    max_tokens: usize,
    top_k: usize,
    tokens: &HostData,
    scales: Option<&[f32]>,
    weights: &[f32],
    idx: &[i32],
    counts: &[i32],
) -> Report {
    let mut r = check_exact("counts", &expected.counts(), counts, |a, b| a == b);
    if !r.ok() {
        return r;
    }
    for (s, rows) in expected.sources.iter().enumerate() {
        let (base, n) = (s * max_tokens, expected.layout.rows(s).len());
        r.merge(check_row_block(&format!("source {s}"), rows, tokens, scales, (base, n, hidden)));
        let span = base * top_k..(base + n) * top_k;
        r.merge(check_exact(&format!("source {s} weights"), &expected.weights[s], &weights[span.clone()], f32_bits_eq));
        r.merge(check_exact(&format!("source {s} idx"), &expected.idx[s], &idx[span], |a, b| a == b));
        let tail = &idx[(base + n) * top_k..(base + max_tokens) * top_k];
        r.merge(check_exact(&format!("source {s} idx after its rows"), &vec![-1; tail.len()], tail, |a, b| a == b));
    }
    r
}

/// For each `hidden`-wide row of `got`, the row of `want` equal to it bit for bit, each row of
/// `want` used at most once (rows are looked up by their first 8 values, then compared whole).
fn match_rows_by_content(want: &[bf16], got: &[bf16], hidden: usize) -> Vec<Option<usize>> {
    use std::collections::HashMap;
    let key = |row: &[bf16]| row.iter().take(8).fold(0u128, |k, v| (k << 16) | u128::from(v.to_bits()));
    let mut by_key: HashMap<u128, Vec<usize>> = HashMap::new();
    for (j, row) in want.chunks_exact(hidden).enumerate() {
        by_key.entry(key(row)).or_default().push(j);
    }
    got.chunks_exact(hidden)
        .map(|row| {
            let cands = by_key.get_mut(&key(row))?;
            let bits_eq =
                |j: &usize| want[j * hidden..(j + 1) * hidden].iter().zip(row).all(|(a, b)| a.to_bits() == b.to_bits());
            let pos = cands.iter().position(bits_eq)?;
            Some(cands.swap_remove(pos))
        })
        .collect()
}

/// Low-latency dispatch tokens of a backend that keeps arrival order inside an expert (NCCL EP,
/// `[L x R*M x H]` with gaps between source ranks), rearranged into epflow's order: every row
/// equal (bit for bit) to an expected row goes where the reference has it; an expected row not
/// found stays zero, so the comparison that follows reports it.
pub fn ll_rows_by_content(
    expected: &LlDispatchResult,
    rows_per_expert: usize,
    hidden: usize,
    got: &[bf16],
) -> Vec<bf16> {
    let mut out = vec![bf16::ZERO; got.len()];
    for (le, rows) in expected.experts.iter().enumerate() {
        let Rows::Bf16(want) = rows else { continue };
        let base = le * rows_per_expert * hidden;
        let slots = &got[base..base + rows_per_expert * hidden];
        for (slot, j) in slots.chunks_exact(hidden).zip(match_rows_by_content(want, slots, hidden)) {
            if let Some(j) = j {
                out[base + j * hidden..base + (j + 1) * hidden].copy_from_slice(slot);
            }
        }
    }
    out
}

/// High-throughput dispatch outputs of a backend that may deliver rows in another order and
/// writes each row's top-k entries compactly (NCCL EP's flat layout: the local experts in
/// ascending order with their weights, then `-1` / 0), rearranged into epflow's form: each row
/// goes where the reference has the equal row, and its entries go to the slots `k` whose
/// expected local index they carry. An entry with no such slot, or a row missing, leaves values
/// that the comparison that follows reports (`-2` indices, NaN weights, zero rows).
/// `got_*` are `[N x H]`, `[N x K]`, `[N x K]`; returns the three rearranged.
pub fn ht_rows_by_content(
    expected: &HtDispatchResult,
    hidden: usize,
    got_tokens: &[bf16],
    got_weights: &[f32],
    got_idx: &[i64],
) -> (Vec<bf16>, Vec<f32>, Vec<i64>) {
    let Rows::Bf16(want) = &expected.tokens else {
        return (got_tokens.to_vec(), got_weights.to_vec(), got_idx.to_vec());
    };
    let n = want.len() / hidden.max(1);
    let k = expected.topk_idx.len().checked_div(n).unwrap_or(0);
    let mut tokens = vec![bf16::ZERO; want.len()];
    let mut weights = vec![f32::NAN; n * k];
    let mut idx = vec![-2i64; n * k];
    for (i, j) in match_rows_by_content(want, got_tokens, hidden).into_iter().enumerate() {
        let Some(j) = j else { continue };
        tokens[j * hidden..(j + 1) * hidden].copy_from_slice(&got_tokens[i * hidden..(i + 1) * hidden]);
        let entries: Vec<(i64, f32)> = (0..k)
            .filter(|&kk| got_idx.get(i * k + kk).is_some_and(|&e| e >= 0))
            .map(|kk| (got_idx[i * k + kk], got_weights[i * k + kk]))
            .collect();
        let want_idx = &expected.topk_idx[j * k..(j + 1) * k];
        if entries.len() != want_idx.iter().filter(|&&e| e >= 0).count() {
            continue;
        }
        for (kk, &e) in want_idx.iter().enumerate() {
            let found = if e < 0 { Some((-1, 0.0)) } else { entries.iter().copied().find(|&(g, _)| g == e) };
            if let Some((g, w)) = found {
                idx[j * k + kk] = g;
                weights[j * k + kk] = w;
            }
        }
    }
    (tokens, weights, idx)
}

/// Compares one rank's high-throughput forward dispatch outputs with the reference.
pub fn check_ht_dispatch(
    expected: &HtDispatchResult,
    tokens: &HostData,
    scales: Option<&[f32]>,
    topk_weights: &[f32],
    topk_idx: &[i64],
    counts: &[i32],
) -> Report {
    let mut r = check_exact("counts", expected.layout.expert_counts(), counts, |a, b| a == b);
    r.merge(check_exact("topk_idx", &expected.topk_idx, topk_idx, |a, b| a == b));
    r.merge(check_exact("topk_weights", &expected.topk_weights, topk_weights, f32_bits_eq));
    match (&expected.tokens, tokens) {
        (Rows::Bf16(want), HostData::Bf16(got)) => r.merge(check_bf16("tokens", want, got, Tolerance::Exact)),
        (Rows::Fp8 { q, scales: ws }, HostData::Fp8(got)) => {
            r.merge(check_exact("tokens fp8", q, got, |a, b| a == b));
            r.merge(check_exact("scales", ws, scales.unwrap_or_default(), f32_bits_eq));
        }
        _ => r.record(false, || format!("tokens dtype {:?} does not match", tokens.dtype())),
    }
    r
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scenario::Scenario;
    use crate::workload::RoutingKind;
    use crate::{GroupConfig, HostData};

    /// NCCL EP's layout: an expert's rows in another order, with gaps; content matching puts
    /// them back, and a missing row is still reported.
    #[test]
    fn rows_found_by_content_in_any_order() {
        let (hidden, m) = (256, 16);
        let config = GroupConfig::low_latency(8, m, hidden);
        let sc = Scenario::generate(config, 2, &[16, 9], 4, RoutingKind::Uniform, 3, 5);
        let refs = sc.ll_dispatch_reference().unwrap();
        let (want, rpe) = (&refs[1], 2 * m);
        let mut got = vec![bf16::ZERO; want.experts.len() * rpe * hidden];
        for (le, rows) in want.experts.iter().enumerate() {
            let Rows::Bf16(data) = rows else { unreachable!() };
            // Reversed, after a gap of 3 empty rows.
            for (i, row) in data.chunks_exact(hidden).rev().enumerate() {
                let at = (le * rpe + 3 + i) * hidden;
                got[at..at + hidden].copy_from_slice(row);
            }
        }
        let counts = want.counts();
        let arranged = ll_rows_by_content(want, rpe, hidden, &got);
        let r = check_ll_dispatch(want, hidden, rpe, &HostData::Bf16(arranged), None, &counts);
        assert!(r.ok(), "{r:?}");
        // As laid out, the same rows fail the positional comparison.
        let r = check_ll_dispatch(want, hidden, rpe, &HostData::Bf16(got.clone()), None, &counts);
        assert!(!r.ok());
        // One row missing: reported.
        let le = counts.iter().position(|&c| c > 0).unwrap();
        got[(le * rpe + 3) * hidden] = bf16::from_f32(1234.0);
        let arranged = ll_rows_by_content(want, rpe, hidden, &got);
        let r = check_ll_dispatch(want, hidden, rpe, &HostData::Bf16(arranged), None, &counts);
        assert!(!r.ok());
    }

    /// NCCL EP's flat layout: rows in another order, top-k entries compact; rearranged, they
    /// pass; a wrong weight, a wrong expert or a missing row is still reported.
    #[test]
    fn ht_rows_found_by_content_with_compact_topk() {
        let hidden = 256;
        let config = GroupConfig::high_throughput(8, hidden);
        let sc = Scenario::generate(config.clone(), 2, &[16, 9], 4, RoutingKind::Uniform, 3, 7);
        let refs = sc.ht_dispatch_reference().unwrap();
        let want = &refs[0];
        let Rows::Bf16(rows) = &want.tokens else { unreachable!() };
        let (n, k) = (rows.len() / hidden, 4);
        assert!(n > 2);
        // Reversed rows; each row's entries compact, ascending by local expert.
        let (mut t, mut w, mut ix) = (Vec::new(), Vec::new(), Vec::new());
        for j in (0..n).rev() {
            t.extend_from_slice(&rows[j * hidden..(j + 1) * hidden]);
            let mut e: Vec<(i64, f32)> = (0..k)
                .filter(|&kk| want.topk_idx[j * k + kk] >= 0)
                .map(|kk| (want.topk_idx[j * k + kk], want.topk_weights[j * k + kk]))
                .collect();
            e.sort_by_key(|p| p.0);
            e.resize(k, (-1, 0.0));
            ix.extend(e.iter().map(|p| p.0));
            w.extend(e.iter().map(|p| p.1));
        }
        let check = |t: &[bf16], w: &[f32], ix: &[i64]| {
            let (t, w, ix) = ht_rows_by_content(want, hidden, t, w, ix);
            check_ht_dispatch(want, &HostData::Bf16(t), None, &w, &ix, want.layout.expert_counts())
        };
        assert!(check(&t, &w, &ix).ok());
        // As delivered, the positional comparison fails.
        let r = check_ht_dispatch(want, &HostData::Bf16(t.clone()), None, &w, &ix, want.layout.expert_counts());
        assert!(!r.ok());
        let mut w2 = w.clone();
        w2[0] += 1.0;
        assert!(!check(&t, &w2, &ix).ok());
        let mut ix2 = ix.clone();
        ix2[0] = (ix2[0] + 1) % 4;
        assert!(!check(&t, &w, &ix2).ok());
        let mut t2 = t.clone();
        t2[0] = bf16::from_f32(1234.0);
        assert!(!check(&t2, &w, &ix).ok());
    }
}

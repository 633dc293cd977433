//! Routing: validated `topk_idx`, where experts live, what each rank sends and what it receives.
//!
//! ## Placement
//!
//! Expert `e` lives on rank `e / L` as local expert `e % L` (`L = E / R`).
//!
//! ## Messages
//!
//! A rank sends **one copy per (token, destination rank)**: token `t` goes to every rank that
//! hosts at least one of its valid top-k experts, once, with the list of `(k, local expert)`
//! pairs it serves there. Copies to one destination are in ascending token order.
//!
//! ## Receive order (deterministic)
//!
//! - Low-latency: the rows of local expert `l` are every `(source rank s, token t)` routed to it,
//!   sorted by `s`, then `t`, packed from row 0. Row `i` of expert `l` is
//!   `output[l][i]`, for `i < counts[l]`; rows at and past `counts[l]` are unspecified.
//! - High-throughput: the `N` received rows are every `(s, t)` that has at least one expert on
//!   this rank, sorted by `s`, then `t`.

use crate::error::ValidationError;

/// Where experts live: `E` experts over `R` ranks, `L = E / R` each.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ExpertPlacement {
    /// `E`.
    pub num_experts: usize,
    /// `R`.
    pub num_ranks: usize,
}

impl ExpertPlacement {
    /// `E` experts over `R` ranks (`E` divisible by `R`, checked by the group config).
    pub fn new(num_experts: usize, num_ranks: usize) -> Self {
        ExpertPlacement { num_experts, num_ranks }
    }

    /// `L`, experts per rank.
    pub fn local_experts(&self) -> usize {
        self.num_experts / self.num_ranks
    }

    /// The rank hosting global expert `e`.
    pub fn owner(&self, expert: usize) -> usize {
        expert / self.local_experts()
    }

    /// The local index of global expert `e` on its owner.
    pub fn local_index(&self, expert: usize) -> usize {
        expert % self.local_experts()
    }

    /// The global index of local expert `local` of `rank`.
    pub fn global_index(&self, rank: usize, local: usize) -> usize {
        rank * self.local_experts() + local
    }
}

/// A validated `topk_idx` `[B x K]`: every entry in `[-1, E)`, no expert twice in one row.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Routing {
    num_tokens: usize,
    top_k: usize,
    idx: Vec<i64>,
}

impl Routing {
    /// Validates `idx` (`num_tokens x top_k`, row-major) against `num_experts`.
    ///
    /// The caller has checked that `idx.len() == num_tokens * top_k`.
    pub fn new(idx: Vec<i64>, num_tokens: usize, top_k: usize, num_experts: usize) -> Result<Self, ValidationError> {
        if top_k == 0 {
            return Err(ValidationError::ZeroTopK);
        }
        if top_k > num_experts {
            return Err(ValidationError::TopKExceedsExperts { top_k, num_experts });
        }
        debug_assert_eq!(idx.len(), num_tokens * top_k);
        for (token, row) in idx.chunks_exact(top_k).enumerate() {
            for (k, &index) in row.iter().enumerate() {
                if index < -1 || index >= num_experts as i64 {
                    return Err(ValidationError::ExpertIndexOutOfRange { token, k, index, num_experts });
                }
                if index >= 0 {
                    if let Some(first_k) = row[..k].iter().position(|&o| o == index) {
                        return Err(ValidationError::DuplicateExpert {
                            token,
                            expert: index as usize,
                            first_k,
                            second_k: k,
                        });
                    }
                }
            }
        }
        Ok(Routing { num_tokens, top_k, idx })
    }

    /// `B`.
    pub fn num_tokens(&self) -> usize {
        self.num_tokens
    }

    /// `K`.
    pub fn top_k(&self) -> usize {
        self.top_k
    }

    /// The raw indices, row-major `[B x K]`.
    pub fn indices(&self) -> &[i64] {
        &self.idx
    }

    /// The expert of token `t`, slot `k`, or `None` if masked.
    pub fn expert(&self, token: usize, k: usize) -> Option<usize> {
        let e = self.idx[token * self.top_k + k];
        (e >= 0).then_some(e as usize)
    }

    /// The row of token `t`.
    pub fn row(&self, token: usize) -> &[i64] {
        &self.idx[token * self.top_k..(token + 1) * self.top_k]
    }

    /// Number of valid (non-masked) `(token, k)` selections.
    pub fn valid_selections(&self) -> usize {
        self.idx.iter().filter(|&&e| e >= 0).count()
    }
}

/// One `(k, local expert)` pair a copy serves at its destination.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Selection {
    /// The top-k slot in the source token's row.
    pub k: u16,
    /// The local expert index at the destination.
    pub local_expert: u32,
}

/// One copy of a token for one destination rank.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TokenCopy {
    /// The token's row on the source rank.
    pub token: u32,
    /// The `(k, local expert)` pairs it serves there, in ascending `k`.
    pub selections: Vec<Selection>,
}

/// What one rank sends: per destination rank, its copies in ascending token order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SendPlan {
    per_dest: Vec<Vec<TokenCopy>>,
}

impl SendPlan {
    /// The plan of a rank with routing `routing`.
    pub fn new(routing: &Routing, placement: ExpertPlacement) -> Self {
        let mut per_dest: Vec<Vec<TokenCopy>> = vec![Vec::new(); placement.num_ranks];
        for t in 0..routing.num_tokens() {
            for k in 0..routing.top_k() {
                let Some(e) = routing.expert(t, k) else { continue };
                let dest = placement.owner(e);
                let sel = Selection { k: k as u16, local_expert: placement.local_index(e) as u32 };
                let copies = &mut per_dest[dest];
                match copies.last_mut() {
                    Some(c) if c.token == t as u32 => c.selections.push(sel),
                    _ => copies.push(TokenCopy { token: t as u32, selections: vec![sel] }),
                }
            }
        }
        SendPlan { per_dest }
    }

    /// The copies for `dest`, in ascending token order.
    pub fn copies_to(&self, dest: usize) -> &[TokenCopy] {
        &self.per_dest[dest]
    }

    /// Number of destination ranks.
    pub fn num_ranks(&self) -> usize {
        self.per_dest.len()
    }

    /// Total `(token, destination rank)` copies.
    pub fn num_copies(&self) -> usize {
        self.per_dest.iter().map(Vec::len).sum()
    }
}

/// Where one received row came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RowSource {
    /// The source rank.
    pub src_rank: u32,
    /// The token's row on the source rank.
    pub token: u32,
    /// The top-k slot that chose this expert (low-latency rows only; 0 in HT rows).
    pub k: u16,
}

/// The low-latency receive layout of one rank: for each local expert, its rows in order.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LlRecvLayout {
    rows: Vec<Vec<RowSource>>,
}

impl LlRecvLayout {
    /// Builds the layout from the copies received, visited in ascending source rank
    /// (`received[s]` = the copies rank `s` sent here, in its order).
    pub fn from_received<'a>(
        local_experts: usize,
        received: impl IntoIterator<Item = (usize, &'a [TokenCopy])>,
    ) -> Self {
        let mut rows = vec![Vec::new(); local_experts];
        for (src, copies) in received {
            for c in copies {
                for s in &c.selections {
                    rows[s.local_expert as usize].push(RowSource { src_rank: src as u32, token: c.token, k: s.k });
                }
            }
        }
        LlRecvLayout { rows }
    }

    /// Number of local experts.
    pub fn local_experts(&self) -> usize {
        self.rows.len()
    }

    /// The rows of local expert `l`.
    pub fn rows(&self, local_expert: usize) -> &[RowSource] {
        &self.rows[local_expert]
    }

    /// Rows per local expert (the `[L]` receive counters).
    pub fn counts(&self) -> Vec<i32> {
        self.rows.iter().map(|r| r.len() as i32).collect()
    }
}

/// The high-throughput receive layout of one rank.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct HtRecvLayout {
    rows: Vec<RowSource>,
    expert_counts: Vec<i32>,
}

impl HtRecvLayout {
    /// Builds the layout from the copies received, visited in ascending source rank.
    pub fn from_received<'a>(
        local_experts: usize,
        received: impl IntoIterator<Item = (usize, &'a [TokenCopy])>,
    ) -> Self {
        let mut rows = Vec::new();
        let mut expert_counts = vec![0i32; local_experts];
        for (src, copies) in received {
            for c in copies {
                rows.push(RowSource { src_rank: src as u32, token: c.token, k: 0 });
                for s in &c.selections {
                    expert_counts[s.local_expert as usize] += 1;
                }
            }
        }
        HtRecvLayout { rows, expert_counts }
    }

    /// `N`, rows received.
    pub fn num_rows(&self) -> usize {
        self.rows.len()
    }

    /// The received rows in order.
    pub fn rows(&self) -> &[RowSource] {
        &self.rows
    }

    /// Received tokens per local expert (`[L]`).
    pub fn expert_counts(&self) -> &[i32] {
        &self.expert_counts
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn validation_rules() {
        assert!(Routing::new(vec![0, 1, -1, 3], 2, 2, 4).is_ok());
        assert_eq!(Routing::new(vec![], 0, 0, 4), Err(ValidationError::ZeroTopK));
        assert!(matches!(Routing::new(vec![4, 0], 1, 2, 4), Err(ValidationError::ExpertIndexOutOfRange { .. })));
        assert!(matches!(Routing::new(vec![-2, 0], 1, 2, 4), Err(ValidationError::ExpertIndexOutOfRange { .. })));
        assert_eq!(
            Routing::new(vec![1, -1, 1], 1, 3, 4),
            Err(ValidationError::DuplicateExpert { token: 0, expert: 1, first_k: 0, second_k: 2 })
        );
        // Two masked entries are not duplicates.
        assert!(Routing::new(vec![-1, -1, 2], 1, 3, 4).is_ok());
    }

    #[test]
    fn one_copy_per_destination_rank() {
        // 8 experts on 4 ranks (L = 2). Token 0 -> experts 0, 1 (rank 0) and 5 (rank 2).
        let routing = Routing::new(vec![5, 0, 1, -1, 7, 6, -1, -1], 2, 4, 8).unwrap();
        let plan = SendPlan::new(&routing, ExpertPlacement::new(8, 4));
        assert_eq!(plan.num_copies(), 3);
        assert_eq!(
            plan.copies_to(0)[0].selections,
            vec![Selection { k: 1, local_expert: 0 }, Selection { k: 2, local_expert: 1 }]
        );
        assert_eq!(plan.copies_to(2)[0].selections, vec![Selection { k: 0, local_expert: 1 }]);
        assert_eq!(plan.copies_to(3)[0].token, 1);
        assert_eq!(plan.copies_to(3)[0].selections.len(), 2);
        assert!(plan.copies_to(1).is_empty());
    }
}

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
//!
//! ## Contents
//!
//! - [`Routing`], [`ExpertPlacement`], [`Selection`], [`TokenCopy`]: here.
//! - [`SendPlan`]: the copies a rank sends, per destination.
//! - [`LlRecvLayout`], [`HtRecvLayout`]: what a rank receives.
//! - [`ChannelPlan`], [`ChannelReceive`]: the same cut into the channels of the GPU
//!   high-throughput kernels, and the count-exchange messages that create a handle.
//! - [`CombinePositions`]: where low-latency combine rows from NCCL peers land.

mod channels;
mod combine_positions;
mod receive;
mod send_plan;

pub use channels::{ChannelPlan, ChannelReceive};
pub use combine_positions::CombinePositions;
pub use receive::{HtRecvLayout, LlRecvLayout, RankRecvLayout, RowSource};
pub use send_plan::{SendPlan, compacted_slots};

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
        Routing::check_top_k(top_k, num_experts)?;
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

    /// What [`Routing::new`] checks of `top_k` whatever the values: at least one slot, at most
    /// `num_experts` (a backend that checks the values elsewhere, on a device, checks this first).
    pub fn check_top_k(top_k: usize, num_experts: usize) -> Result<(), ValidationError> {
        if top_k == 0 {
            return Err(ValidationError::ZeroTopK);
        }
        if top_k > num_experts {
            return Err(ValidationError::TopKExceedsExperts { top_k, num_experts });
        }
        Ok(())
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

    /// The rank of entry `(t, k)` if it is that rank's first entry in token `t`'s row (the slot a
    /// rank-major combine returns the rank's pre-reduced row in); `None` for masked entries and
    /// later entries of a rank already reached.
    pub fn first_of_its_rank(&self, placement: ExpertPlacement, token: usize, k: usize) -> Option<usize> {
        let d = placement.owner(self.expert(token, k)?);
        (0..k).all(|j| self.expert(token, j).is_none_or(|e| placement.owner(e) != d)).then_some(d)
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
}

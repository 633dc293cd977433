//! [`CombinePositions`]: where a low-latency combine's rows from NCCL peers land on the source
//! rank. The expert side packs, per source, its `(token, k)` rows in ascending order and NCCL
//! moves exactly those rows; the source computes the same positions from its own routing.
//! Rank-major handles send one row per (token, rank reached), in the slot of the rank's first
//! top-k entry.

use super::{ExpertPlacement, Routing};
use crate::ops::Layout;

/// The packed combine rows of one rank's routing, for the peers in `mask`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CombinePositions {
    /// `[B x K]`: the row of `(token, k)` in the packed block when its expert lives on a rank of
    /// the mask, else -1. Blocks are in ascending rank, rows in ascending `(token, k)`.
    pub pos: Vec<i32>,
    /// Per rank, `(first row, rows)` of its block (`(0, 0)` for ranks outside the mask).
    pub blocks: Vec<(usize, usize)>,
}

impl CombinePositions {
    /// The positions of `routing`'s selections whose experts live on ranks of `mask` (bit `r` =
    /// rank `r`); for [`Layout::RankMajor`], only each rank's first entry of a token.
    pub fn new(routing: &Routing, placement: ExpertPlacement, mask: u32, layout: Layout) -> Self {
        let (b, k) = (routing.num_tokens(), routing.top_k());
        let r = placement.num_ranks;
        let in_mask = |d: usize| d < 32 && mask >> d & 1 == 1;
        // Whether entry (t, j) has a row of its own.
        let sends = |t: usize, j: usize| match layout {
            Layout::ExpertMajor => routing.expert(t, j).map(|e| placement.owner(e)),
            Layout::RankMajor => routing.first_of_its_rank(placement, t, j),
        };
        let mut counts = vec![0usize; r];
        for t in 0..b {
            for j in 0..k {
                if let Some(d) = sends(t, j) {
                    counts[d] += 1;
                }
            }
        }
        let mut blocks = vec![(0usize, 0usize); r];
        let mut next = 0usize;
        for d in 0..r {
            if in_mask(d) {
                blocks[d] = (next, counts[d]);
                next += counts[d];
            }
        }
        let mut fill: Vec<usize> = blocks.iter().map(|b| b.0).collect();
        let mut pos = vec![-1i32; b * k];
        for t in 0..b {
            for j in 0..k {
                let Some(d) = sends(t, j) else { continue };
                if in_mask(d) {
                    pos[t * k + j] = fill[d] as i32;
                    fill[d] += 1;
                }
            }
        }
        CombinePositions { pos, blocks }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn combine_positions_pack_per_peer_in_token_order() {
        // 8 experts on 4 ranks (L = 2). Rank 0 and 1 are NCCL peers.
        // t0: experts 5 (r2), 0 (r0), 1 (r0), -1;  t1: 2 (r1), 7 (r3), 0 (r0), 3 (r1).
        let routing = Routing::new(vec![5, 0, 1, -1, 2, 7, 0, 3], 2, 4, 8).unwrap();
        let p = CombinePositions::new(&routing, ExpertPlacement::new(8, 4), 0b0011, Layout::ExpertMajor);
        assert_eq!(p.blocks, vec![(0, 3), (3, 2), (0, 0), (0, 0)]);
        assert_eq!(p.pos, vec![-1, 0, 1, -1, 3, -1, 2, 4]);
        // Rank-major: a row per (token, rank), at the rank's first entry.
        let p = CombinePositions::new(&routing, ExpertPlacement::new(8, 4), 0b0011, Layout::RankMajor);
        assert_eq!(p.blocks, vec![(0, 2), (2, 1), (0, 0), (0, 0)]);
        assert_eq!(p.pos, vec![-1, 0, -1, -1, 2, -1, 1, -1]);
    }
}

//! [`SendPlan`]: the copies one rank sends, per destination rank.

use super::{ExpertPlacement, Routing, Selection, TokenCopy};

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

    /// Each copy's place among its destination's copies: `[R x stride]`, at `dest * stride +
    /// token` the index of `token`'s copy in [`SendPlan::copies_to`]`(dest)`, or -1 where
    /// `token` has no expert on `dest` (and for every token past the routing's). In the
    /// rank-major layout that is the copy's row among its source's rows at the destination. The
    /// GPU low-latency dispatch puts each message there, so that the receiver copies slot `i`
    /// into row `i` without a scan. `stride` must be at least the routing's tokens.
    pub fn compacted_slots(&self, stride: usize) -> Vec<i32> {
        let mut slots = vec![-1i32; self.per_dest.len() * stride];
        for (dest, copies) in self.per_dest.iter().enumerate() {
            for (i, c) in copies.iter().enumerate() {
                slots[dest * stride + c.token as usize] = i as i32;
            }
        }
        slots
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::routing::{ExpertPlacement, Routing, Selection};

    #[test]
    fn compacted_slots_number_each_destinations_tokens_in_order() {
        // 8 experts on 4 ranks (L = 2). Tokens: 0 -> ranks 2, 0; 1 -> rank 3; 2 -> nothing;
        // 3 -> ranks 0, 3.
        let routing = Routing::new(vec![5, 0, 7, -1, -1, -1, 1, 6], 4, 2, 8).unwrap();
        let plan = SendPlan::new(&routing, ExpertPlacement::new(8, 4));
        let slots = plan.compacted_slots(5);
        assert_eq!(&slots[0..5], &[0, -1, -1, 1, -1]);
        assert_eq!(&slots[5..10], &[-1; 5]);
        assert_eq!(&slots[10..15], &[0, -1, -1, -1, -1]);
        assert_eq!(&slots[15..20], &[-1, 0, -1, 1, -1]);
        // The slot of each copy is its place in `copies_to`.
        for dest in 0..4 {
            for (i, c) in plan.copies_to(dest).iter().enumerate() {
                assert_eq!(slots[dest * 5 + c.token as usize], i as i32);
            }
        }
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

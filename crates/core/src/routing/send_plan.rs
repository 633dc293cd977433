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
}

/// Each `(token, destination rank)` copy's place among its destination's copies, without
/// building a [`SendPlan`] (the host-built low-latency handle's; the GPU backend's kernel
/// `ep_ll_handle` numbers the routing's tokens alike on the device):
/// `[R x stride]`, at `dest * stride + token` the index of `token`'s copy in
/// [`SendPlan::copies_to`]`(dest)`, or -1 where `token` has no expert on `dest` (and for every
/// token past the routing's); and per destination, its number of copies. In the rank-major layout
/// a copy's place is its row among its source's rows at the destination: the GPU low-latency
/// dispatch puts each message there, so that the receiver copies slot `i` into row `i` without a
/// scan. `stride` must be at least the routing's tokens.
pub fn compacted_slots(routing: &Routing, placement: ExpertPlacement, stride: usize) -> (Vec<i32>, Vec<usize>) {
    let ranks = placement.num_ranks;
    let mut slots = vec![-1i32; ranks * stride];
    let mut counts = vec![0usize; ranks];
    // One 32-bit division per entry by a number worked out once (`ExpertPlacement::owner` works
    // out L each time, in 64 bits): 2x faster at 128 tokens x 8 (benches/NOTES.md item 142).
    // Experts are fewer than `MAX_EXPERTS` (2^15), so they and L fit in 32 bits.
    debug_assert!(u32::try_from(placement.num_experts).is_ok(), "experts beyond 32 bits");
    let local = placement.local_experts() as u32;
    for (t, row) in routing.indices().chunks_exact(routing.top_k()).enumerate() {
        for &e in row {
            // A routing holds -1 or an expert below E (validated): -1 is skipped here.
            let Ok(e) = u32::try_from(e) else { continue };
            let dest = (e / local) as usize;
            let at = &mut slots[dest * stride + t];
            if *at < 0 {
                *at = counts[dest] as i32;
                counts[dest] += 1;
            }
        }
    }
    (slots, counts)
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
        let placement = ExpertPlacement::new(8, 4);
        let (slots, counts) = compacted_slots(&routing, placement, 5);
        assert_eq!(&slots[0..5], &[0, -1, -1, 1, -1]);
        assert_eq!(&slots[5..10], &[-1; 5]);
        assert_eq!(&slots[10..15], &[0, -1, -1, -1, -1]);
        assert_eq!(&slots[15..20], &[-1, 0, -1, 1, -1]);
        assert_eq!(counts, vec![2, 0, 1, 2]);
    }

    #[test]
    fn compacted_slots_are_each_copys_place_in_the_send_plan() {
        // Random routings (two experts of a token on one rank, masked entries, uneven ranks).
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = |n: u64| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state % n
        };
        for _ in 0..50 {
            let (tokens, k, experts, ranks) =
                (1 + next(40) as usize, 1 + next(8) as usize, 16, [1, 2, 4, 8][next(4) as usize]);
            let mut idx = Vec::new();
            for _ in 0..tokens {
                let mut row: Vec<i64> = Vec::new();
                while row.len() < k {
                    let e = next(experts as u64 + 3) as i64 - 1;
                    if e >= experts as i64 || (e >= 0 && row.contains(&e)) {
                        continue;
                    }
                    row.push(e);
                }
                idx.extend(row);
            }
            let routing = Routing::new(idx, tokens, k, experts).unwrap();
            let placement = ExpertPlacement::new(experts, ranks);
            let plan = SendPlan::new(&routing, placement);
            let stride = tokens + 3;
            let (slots, counts) = compacted_slots(&routing, placement, stride);
            for dest in 0..ranks {
                let copies = plan.copies_to(dest);
                assert_eq!(counts[dest], copies.len());
                let mut want = vec![-1i32; stride];
                for (i, c) in copies.iter().enumerate() {
                    want[c.token as usize] = i as i32;
                }
                assert_eq!(&slots[dest * stride..(dest + 1) * stride], &want[..]);
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

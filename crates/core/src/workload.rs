//! Seeded random inputs in the style of NCCL EP's `ep_bench`: each token picks `K` distinct
//! experts, then a few random `(token, k)` entries are masked with `-1`.

use half::bf16;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

/// How tokens choose experts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RoutingKind {
    /// `K` distinct experts uniformly at random (ep_bench).
    Uniform,
    /// Half the tokens put expert 0 in slot 0 (a hot expert); the rest uniform.
    Skewed,
    /// Every token's experts all live on one rank (`K` must not exceed `L`).
    SingleRank(usize),
}

/// What to generate.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RoutingSpec {
    /// `B`.
    pub num_tokens: usize,
    /// `K`.
    pub top_k: usize,
    /// `E`.
    pub num_experts: usize,
    /// `R` (for [`RoutingKind::SingleRank`]).
    pub num_ranks: usize,
    /// How many random `(token, k)` entries to mask with `-1` (ep_bench masks 10).
    pub masked: usize,
    /// The expert choice.
    pub kind: RoutingKind,
}

fn rng(seed: u64, rank: usize, stream: u64) -> SmallRng {
    SmallRng::seed_from_u64(
        seed ^ (rank as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ stream.wrapping_mul(0xd1b5_4a32_d192_ed03),
    )
}

/// A random `topk_idx` `[B x K]` for `rank`, reproducible from `seed`.
pub fn random_topk_idx(spec: &RoutingSpec, seed: u64, rank: usize) -> Vec<i64> {
    let mut rng = rng(seed, rank, 1);
    let (b, k, e) = (spec.num_tokens, spec.top_k, spec.num_experts);
    let l = e / spec.num_ranks.max(1);
    let mut idx = Vec::with_capacity(b * k);
    let mut pool: Vec<i64> = Vec::new();
    for t in 0..b {
        pool.clear();
        match spec.kind {
            RoutingKind::SingleRank(r) => pool.extend((r * l..(r + 1) * l).map(|x| x as i64)),
            _ => pool.extend(0..e as i64),
        }
        // Partial Fisher-Yates: the first k of the pool become distinct random picks.
        let take = k.min(pool.len());
        for i in 0..take {
            let j = rng.random_range(i..pool.len());
            pool.swap(i, j);
        }
        if spec.kind == RoutingKind::Skewed && t % 2 == 0 {
            if let Some(p) = pool[..take].iter().position(|&x| x == 0) {
                pool.swap(0, p);
            } else {
                pool[0] = 0;
            }
        }
        idx.extend_from_slice(&pool[..take]);
        idx.extend(std::iter::repeat_n(-1, k - take));
    }
    if b > 0 && k > 0 {
        for _ in 0..spec.masked {
            let t = rng.random_range(0..b);
            let kk = rng.random_range(0..k);
            idx[t * k + kk] = -1;
        }
    }
    idx
}

/// Random BF16 tokens `[rows x hidden]` in `[-2, 2)`, reproducible from `seed`.
pub fn random_tokens(rows: usize, hidden: usize, seed: u64, rank: usize) -> Vec<bf16> {
    let mut rng = rng(seed, rank, 2);
    (0..rows * hidden).map(|_| bf16::from_f32(rng.random_range(-2.0f32..2.0))).collect()
}

/// Random positive top-k weights `[rows x top_k]` in `[1e-3, 1)`, reproducible from `seed`.
pub fn random_weights(rows: usize, top_k: usize, seed: u64, rank: usize) -> Vec<f32> {
    let mut rng = rng(seed, rank, 3);
    (0..rows * top_k).map(|_| rng.random_range(1e-3f32..1.0)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::routing::Routing;

    #[test]
    fn routings_are_valid_and_reproducible() {
        for kind in [RoutingKind::Uniform, RoutingKind::Skewed, RoutingKind::SingleRank(1)] {
            let spec = RoutingSpec { num_tokens: 64, top_k: 8, num_experts: 64, num_ranks: 4, masked: 10, kind };
            let a = random_topk_idx(&spec, 7, 2);
            assert_eq!(a, random_topk_idx(&spec, 7, 2));
            assert_ne!(a, random_topk_idx(&spec, 8, 2));
            assert!(Routing::new(a.clone(), 64, 8, 64).is_ok(), "{kind:?}");
            if let RoutingKind::SingleRank(r) = kind {
                assert!(a.iter().all(|&e| e < 0 || (e as usize) / 16 == r));
            }
        }
    }
}

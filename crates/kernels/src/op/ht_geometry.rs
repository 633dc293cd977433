//! Launch geometry of the high-throughput kernels: `2 * C` blocks of 512 threads, a sending and
//! a receiving block per channel.

use crate::params::HtParams;

/// Threads of a block of `ep_ht_plan` (`HT_PLAN_BLOCK` in `ht_handle.cuh`).
pub(crate) const HT_PLAN_BLOCK: u32 = 1024;

/// Tokens of a mark block of `ep_ht_plan` per pass (`HT_MARK_TOKENS` in `ht_handle.cuh`), one per
/// thread.
pub(crate) const HT_MARK_TOKENS: usize = 256;

/// At most this many scratch words of per-block selection counts (`mark blocks x experts`):
/// beyond it the mark blocks are capped and loop over the tokens.
const HT_MARK_SCRATCH_WORDS: usize = 1 << 18;

/// The mark blocks of `ep_ht_plan` for `tokens` tokens and `experts` experts: a thread per token,
/// unless the blocks' count slots (`experts` words each) would pass [`HT_MARK_SCRATCH_WORDS`].
pub(crate) fn mark_blocks(tokens: usize, experts: usize) -> usize {
    let cap = (HT_MARK_SCRATCH_WORDS / experts.max(1)).max(1);
    tokens.max(1).div_ceil(HT_MARK_TOKENS).min(cap)
}

/// Threads per block of the high-throughput kernels (`HT_BLOCK` of `ht_rings.cuh`).
const HT_BLOCK: u32 = 512;

/// The grid and block of a high-throughput kernel.
pub(crate) fn ht_grid(p: &HtParams) -> (u32, u32) {
    (2 * p.channels.max(1) as u32, HT_BLOCK)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_mark_thread_per_token_until_the_slots_are_capped() {
        assert_eq!(mark_blocks(0, 256), 1);
        assert_eq!(mark_blocks(4096, 256), 16);
        assert_eq!(mark_blocks(4097, 256), 17);
        // 12000 experts: 21 blocks of slots at most, looping over the tokens.
        assert_eq!(mark_blocks(16384, 12_000), 21);
        assert_eq!(mark_blocks(100, 1 << 20), 1);
    }

    #[test]
    fn a_block_pair_per_channel() {
        let p = HtParams { channels: 32, ..HtParams::default() };
        assert_eq!(ht_grid(&p), (64, 512));
    }
}

//! Launch geometry of the high-throughput kernels: `2 * C` blocks of 512 threads, a sending and
//! a receiving block per channel.

use crate::params::HtParams;

/// Threads of a block of `ep_ht_plan` (`HT_PLAN_BLOCK` in `ht_handle.cuh`).
pub(crate) const HT_PLAN_BLOCK: u32 = 1024;

/// Threads of a block of `ep_ht_plan_mark` (`HT_MARK_BLOCK` in `ht_handle.cuh`), one per token.
pub(crate) const HT_MARK_BLOCK: u32 = 256;

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
    fn a_block_pair_per_channel() {
        let p = HtParams { channels: 32, ..HtParams::default() };
        assert_eq!(ht_grid(&p), (64, 512));
    }
}

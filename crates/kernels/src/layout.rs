//! How big every buffer of a low-latency group is (pure arithmetic, checked on CI).

use epflow_core::config::FP8_BLOCK;
use epflow_core::{Error, GroupConfig};

use crate::params::{HDR_BYTES, MAX_RANKS};

/// Buffer sizes of one rank of a low-latency group.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LlLayout {
    /// `R`.
    pub num_ranks: usize,
    /// `M`.
    pub max_tokens: usize,
    /// `H`.
    pub hidden: usize,
    /// `L`.
    pub local_experts: usize,
    /// Buffer sets.
    pub sets: usize,
    /// Largest top-k.
    pub max_top_k: usize,
    /// Whether dispatch carries FP8.
    pub fp8: bool,
    /// Bytes of one dispatch message (header + payload), a multiple of 16.
    pub msg_bytes: usize,
}

impl LlLayout {
    /// The layout of `config` on `num_ranks` ranks (the config must be low-latency and valid).
    pub fn new(config: &GroupConfig, num_ranks: usize) -> Result<Self, Error> {
        let max_tokens = config
            .fixed_max_tokens()
            .ok_or_else(|| Error::Unsupported("the GPU low-latency kernels need a fixed max_tokens_per_rank".into()))?;
        if num_ranks > MAX_RANKS {
            return Err(Error::Unsupported(format!(
                "the NVLink kernels support up to {MAX_RANKS} ranks, not {num_ranks}"
            )));
        }
        let fp8 = config.dispatch_dtype.is_fp8();
        let h = config.hidden;
        let payload = if fp8 { h + 4 * (h / FP8_BLOCK) } else { 2 * h };
        Ok(LlLayout {
            num_ranks,
            max_tokens,
            hidden: h,
            local_experts: config.local_experts(num_ranks),
            sets: config.buffer_sets,
            max_top_k: config.max_top_k,
            fp8,
            msg_bytes: (HDR_BYTES + payload).next_multiple_of(16),
        })
    }

    /// Rows per expert of the dispatch output, `R * M`.
    pub fn rows_per_expert(&self) -> usize {
        self.num_ranks * self.max_tokens
    }

    /// Dispatch receive region, one set: a slot per (source rank, token).
    pub fn dispatch_recv_set_bytes(&self) -> usize {
        self.num_ranks * self.max_tokens * self.msg_bytes
    }

    /// Combine receive region, one set: a BF16 row per (token, k).
    pub fn combine_recv_set_bytes(&self) -> usize {
        self.max_tokens * self.max_top_k * self.hidden * 2
    }

    /// Dispatch output tokens, one set: `[L x R*M x H]`.
    pub fn dispatch_out_bytes(&self) -> usize {
        self.local_experts * self.rows_per_expert() * self.hidden * if self.fp8 { 1 } else { 2 }
    }

    /// Dispatch output scales, one set (FP8 only): `[L x R*M x H/128]` fp32.
    pub fn dispatch_scales_bytes(&self) -> usize {
        if self.fp8 { self.local_experts * self.rows_per_expert() * (self.hidden / FP8_BLOCK) * 4 } else { 0 }
    }

    /// Combine output, one set: `[M x H]` BF16.
    pub fn combine_out_bytes(&self) -> usize {
        self.max_tokens * self.hidden * 2
    }

    /// Per-handle device memory: the `topk_idx` copy `[M x K]` int64 and the row map
    /// `[R x M x K]` int32.
    pub fn handle_bytes(&self) -> usize {
        self.topk_copy_bytes() + self.num_ranks * self.max_tokens * self.max_top_k * 4
    }

    /// Offset of the row map inside a handle's memory.
    pub fn topk_copy_bytes(&self) -> usize {
        (self.max_tokens * self.max_top_k * 8).next_multiple_of(256)
    }

    /// Device bytes of the whole group on one rank (every set), excluding handles.
    pub fn total_bytes(&self) -> usize {
        let per_set = self.dispatch_recv_set_bytes()
            + self.combine_recv_set_bytes()
            + self.dispatch_out_bytes()
            + self.dispatch_scales_bytes()
            + self.local_experts * 4
            + self.combine_out_bytes();
        per_set * self.sets + crate::params::SIGNAL_PAGE_BYTES
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reference_config_fits_in_half_of_nccl_ep() {
        // NCCL EP's LL group took 2.39 GB per GPU at 128 tokens (4 GPUs) and 4.23 GB at 256.
        let l = LlLayout::new(&GroupConfig::low_latency(256, 128, 7168), 4).unwrap();
        assert_eq!(l.msg_bytes, 128 + 14336);
        assert_eq!(l.rows_per_expert(), 512);
        assert!(l.total_bytes() < 2_390_000_000 / 2, "{} B", l.total_bytes());
        let l256 = LlLayout::new(&GroupConfig::low_latency(256, 256, 7168), 4).unwrap();
        assert!(l256.total_bytes() < 4_230_000_000 / 2, "{} B", l256.total_bytes());
        let fp8 = LlLayout::new(
            &GroupConfig::low_latency(256, 128, 7168)
                .with_dispatch_dtype(epflow_core::DispatchDtype::Fp8 { round_scales: false }),
            4,
        )
        .unwrap();
        assert_eq!(fp8.msg_bytes, 128 + 7168 + 224);
        assert!(fp8.total_bytes() < l.total_bytes());
    }

    #[test]
    fn too_many_ranks_is_an_error() {
        assert!(LlLayout::new(&GroupConfig::low_latency(256, 128, 7168), 16).is_err());
    }
}

//! Group configuration: what every rank of an EP group agrees on at creation.

pub use crate::dtype::DispatchDtype;
use std::time::Duration;

use crate::error::ConfigError;
use crate::tuning::{Environment, Tuning};

/// Which EP algorithm a group runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Algorithm {
    /// Low-latency (decode): fixed-size expert-major receive buffers, staged send/complete.
    LowLatency,
    /// High-throughput (prefill, training): exact-size outputs, forward and backward passes,
    /// synchronous only.
    HighThroughput,
}

/// [`Algorithm::for_tokens`] picks high-throughput from this many tokens per rank.
///
/// Measured on 4 x H200 (H = 7168, K = 8, E = 256, BF16; `benches/NOTES.md`), counting the
/// high-throughput handle's count exchange (a new routing per batch): low-latency dispatch +
/// combine is faster up to 256 tokens per rank (200 µs against 206 µs at 256), high-throughput
/// from 512 (298 µs against 356 µs).
pub const HT_MIN_TOKENS: usize = 257;

impl Algorithm {
    /// The algorithm that moves `tokens_per_rank` tokens fastest: low-latency for decode-sized
    /// batches (below [`HT_MIN_TOKENS`]), high-throughput for prefill and training.
    pub const fn for_tokens(tokens_per_rank: usize) -> Self {
        if tokens_per_rank < HT_MIN_TOKENS { Algorithm::LowLatency } else { Algorithm::HighThroughput }
    }

    /// `"ll"` or `"ht"`.
    pub const fn short_name(self) -> &'static str {
        match self {
            Algorithm::LowLatency => "ll",
            Algorithm::HighThroughput => "ht",
        }
    }
}

/// The largest number of tokens any rank dispatches in one operation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MaxTokens {
    /// A fixed bound, the same on every rank. Required by [`Algorithm::LowLatency`].
    Fixed(usize),
    /// No bound (high-throughput only): creating a handle exchanges the token counts and the
    /// buffers are sized from them (NCCL EP's `NCCL_EP_AUTO`).
    Auto,
}

/// Channels per FP8 scale: one fp32 scale covers this many consecutive hidden channels.
pub const FP8_BLOCK: usize = 128;
/// The hidden size must be a multiple of this (16-byte vector accesses of BF16 rows).
pub const HIDDEN_ALIGN: usize = 8;
/// Largest number of ranks a group may have.
pub const MAX_RANKS: usize = 1024;
/// Largest number of buffer sets a group may have.
pub const MAX_BUFFER_SETS: usize = 16;
/// Largest `max_top_k` a group may have.
pub const MAX_TOP_K: usize = 16;
/// The default operation timeout.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(10);
/// The longest timeout a group may have (one day): every wait must end, and deadlines stay far
/// from overflowing.
pub const MAX_TIMEOUT: Duration = Duration::from_secs(24 * 3600);
/// The largest hidden size.
pub const MAX_HIDDEN: usize = 1 << 20;
/// The largest fixed `max_tokens_per_rank`.
pub const MAX_TOKENS_PER_RANK: usize = 1 << 24;
/// The most experts a group may have (low-latency messages carry local expert indices as 16-bit
/// integers).
pub const MAX_EXPERTS: usize = 1 << 15;
/// The most buffer memory one rank of a group may need (1 TiB, more than any GPU or host has):
/// configs above it are refused by [`GroupConfig::validate`], with the memory they would need.
pub const MAX_GROUP_BYTES: u128 = 1 << 40;

/// Configuration of an EP group. Every rank must create its group with an identical config.
///
/// Build one with [`GroupConfig::low_latency`] or [`GroupConfig::high_throughput`] and the
/// `with_*` methods; [`GroupConfig::validate`] checks it against a rank count.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct GroupConfig {
    /// Low-latency or high-throughput.
    pub algorithm: Algorithm,
    /// Total number of experts `E` over all ranks; rank `r` hosts experts `r*L .. (r+1)*L`.
    pub num_experts: usize,
    /// Largest number of tokens `M` any rank dispatches in one operation.
    pub max_tokens_per_rank: MaxTokens,
    /// Hidden size `H` (channels per token).
    pub hidden: usize,
    /// The element type of dispatched tokens.
    pub dispatch_dtype: DispatchDtype,
    /// Buffer sets per operation kind (default 2): how many dispatch results (and, separately,
    /// how many combine results) may be outstanding at once on a rank.
    pub buffer_sets: usize,
    /// The largest top-k any handle of the group will use (default 8, at most 16): it sizes the
    /// low-latency combine buffers (`max_tokens x max_top_k` rows per buffer set).
    pub max_top_k: usize,
    /// GPU backends: the most streaming multiprocessors a communication kernel may occupy.
    /// Bounding it leaves the rest of the GPU to overlapped compute. `None`: low-latency kernels
    /// use as many as help; high-throughput kernels use 64 (32 channels of a sending and a
    /// receiving SM; rounded down to an even number, at most 256 and at most the SMs of the
    /// group's smallest GPU). A GPU group whose ranks share a GPU takes `None` as SMs /
    /// ((buffer sets + 1) x ranks on the busiest GPU) when low-latency (each set may hold a
    /// waiting receive), SMs / (2 x ranks on the busiest GPU) when high-throughput, so that
    /// the ranks' kernels fit beside each other.
    pub max_sms: Option<usize>,
    /// Longest time any wait of an operation may take before it fails with
    /// [`crate::Error::Timeout`] and poisons the group (default 10 s).
    pub timeout: Duration,
    /// Low-latency only: a peer that misses the timeout is *masked* instead of poisoning the
    /// group (default off). The operation that waited for it completes with what arrived,
    /// every later operation skips it, and tokens whose experts live on a masked rank get a
    /// zero contribution, counted per token in [`crate::ops::CombineOutputs::masked`]. See
    /// [`crate::mask`] for the rules and the recovery steps.
    pub rank_masking: bool,
    /// GPU backends, low-latency: every dispatch writes into the caller's tensors
    /// (`start_dispatch_into`, captured steps), so the group allocates no dispatch output buffer
    /// sets (`S x [L x R*M x H]` tokens and their FP8 scales: 0.94 GB per rank at E = 256,
    /// M = 128, H = 7168 on one rank). A dispatch without targets is then refused with
    /// [`crate::Error::Unsupported`]. Default off. `libnccl_ep.so` turns it on: NCCL EP's
    /// callers always pass their output tensors.
    pub caller_outputs: bool,
    /// GPU backends: how the group runs ([`Tuning`]: kernel forms, handle builders, the
    /// high-throughput layout). `None` (the default): the environment's `EPFLOW_*` values,
    /// read once per process ([`crate::tuning::Environment::get`]), taken at group creation.
    pub tuning: Option<Tuning>,
}

impl GroupConfig {
    /// A low-latency config: BF16, 2 buffer sets, 10 s timeout.
    pub fn low_latency(num_experts: usize, max_tokens_per_rank: usize, hidden: usize) -> Self {
        GroupConfig {
            algorithm: Algorithm::LowLatency,
            num_experts,
            max_tokens_per_rank: MaxTokens::Fixed(max_tokens_per_rank),
            hidden,
            dispatch_dtype: DispatchDtype::Bf16,
            buffer_sets: 2,
            max_top_k: 8,
            max_sms: None,
            timeout: DEFAULT_TIMEOUT,
            rank_masking: false,
            caller_outputs: false,
            tuning: None,
        }
    }

    /// A high-throughput config with automatic max tokens: BF16, 2 buffer sets, 10 s timeout.
    pub fn high_throughput(num_experts: usize, hidden: usize) -> Self {
        GroupConfig {
            algorithm: Algorithm::HighThroughput,
            max_tokens_per_rank: MaxTokens::Auto,
            ..GroupConfig::low_latency(num_experts, 0, hidden)
        }
    }

    /// Replaces the max-tokens bound.
    pub fn with_max_tokens(mut self, max_tokens: MaxTokens) -> Self {
        self.max_tokens_per_rank = max_tokens;
        self
    }

    /// Replaces the dispatch element type.
    pub fn with_dispatch_dtype(mut self, dtype: DispatchDtype) -> Self {
        self.dispatch_dtype = dtype;
        self
    }

    /// Replaces the number of buffer sets.
    pub fn with_buffer_sets(mut self, buffer_sets: usize) -> Self {
        self.buffer_sets = buffer_sets;
        self
    }

    /// Replaces the largest top-k.
    pub fn with_max_top_k(mut self, max_top_k: usize) -> Self {
        self.max_top_k = max_top_k;
        self
    }

    /// Bounds the SMs a communication kernel may occupy (GPU backends).
    pub fn with_max_sms(mut self, max_sms: Option<usize>) -> Self {
        self.max_sms = max_sms;
        self
    }

    /// Replaces the operation timeout.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Turns rank masking on or off ([`GroupConfig::rank_masking`]; low-latency groups only).
    pub fn with_rank_masking(mut self, on: bool) -> Self {
        self.rank_masking = on;
        self
    }

    /// Turns [`GroupConfig::caller_outputs`] on or off.
    pub fn with_caller_outputs(mut self, on: bool) -> Self {
        self.caller_outputs = on;
        self
    }

    /// Sets the group's [`Tuning`] (over the environment's).
    pub fn with_tuning(mut self, tuning: Tuning) -> Self {
        self.tuning = Some(tuning);
        self
    }

    /// The group's [`Tuning`]: its own, else the environment's.
    pub fn tuning(&self) -> &Tuning {
        self.tuning.as_ref().unwrap_or(&Environment::get().tuning)
    }

    /// Local experts per rank, `L = E / R` (call after [`GroupConfig::validate`]).
    pub fn local_experts(&self, num_ranks: usize) -> usize {
        self.num_experts / num_ranks.max(1)
    }

    /// The fixed max-tokens bound, if any.
    pub fn fixed_max_tokens(&self) -> Option<usize> {
        match self.max_tokens_per_rank {
            MaxTokens::Fixed(m) => Some(m),
            MaxTokens::Auto => None,
        }
    }

    /// Number of FP8 scales per token row, `H / 128`.
    pub fn scale_cols(&self) -> usize {
        self.hidden / FP8_BLOCK
    }

    /// Checks the config for a group of `num_ranks` ranks.
    ///
    /// Every rule has its own [`ConfigError`] variant naming the field and the reason.
    pub fn validate(&self, num_ranks: usize) -> Result<(), ConfigError> {
        if num_ranks == 0 {
            return Err(ConfigError::ZeroRanks);
        }
        if num_ranks > MAX_RANKS {
            return Err(ConfigError::TooManyRanks { num_ranks, max: MAX_RANKS });
        }
        if self.num_experts == 0 {
            return Err(ConfigError::ZeroExperts);
        }
        if self.num_experts % num_ranks != 0 {
            return Err(ConfigError::ExpertsNotDivisible { num_experts: self.num_experts, num_ranks });
        }
        if self.hidden == 0 {
            return Err(ConfigError::ZeroHidden);
        }
        if self.hidden % HIDDEN_ALIGN != 0 {
            return Err(ConfigError::HiddenNotAligned { hidden: self.hidden, align: HIDDEN_ALIGN });
        }
        if self.dispatch_dtype.forwarded().is_some() {
            return Err(ConfigError::ForwardedGroupDtype);
        }
        if self.dispatch_dtype.is_fp8() && self.hidden % FP8_BLOCK != 0 {
            return Err(ConfigError::HiddenNotMultipleOfFp8Block { hidden: self.hidden, block: FP8_BLOCK });
        }
        match (self.algorithm, self.max_tokens_per_rank) {
            (_, MaxTokens::Fixed(0)) => return Err(ConfigError::ZeroMaxTokens),
            (Algorithm::LowLatency, MaxTokens::Auto) => return Err(ConfigError::LowLatencyNeedsFixedMaxTokens),
            _ => {}
        }
        if self.buffer_sets == 0 {
            return Err(ConfigError::ZeroBufferSets);
        }
        if self.buffer_sets > MAX_BUFFER_SETS {
            return Err(ConfigError::TooManyBufferSets { buffer_sets: self.buffer_sets, max: MAX_BUFFER_SETS });
        }
        if self.max_top_k == 0 || self.max_top_k > MAX_TOP_K {
            return Err(ConfigError::BadMaxTopK { max_top_k: self.max_top_k, limit: MAX_TOP_K });
        }
        if self.max_sms == Some(0) {
            return Err(ConfigError::ZeroMaxSms);
        }
        if self.timeout.is_zero() {
            return Err(ConfigError::ZeroTimeout);
        }
        if self.timeout > MAX_TIMEOUT {
            return Err(ConfigError::TimeoutTooLong { timeout: self.timeout, max: MAX_TIMEOUT });
        }
        if self.rank_masking && self.algorithm != Algorithm::LowLatency {
            return Err(ConfigError::MaskingNeedsLowLatency);
        }
        let too_large = |what: &'static str, value: usize, max: usize| {
            Err(ConfigError::TooLarge { what, detail: format!("{value} is more than the supported {max}") })
        };
        if self.hidden > MAX_HIDDEN {
            return too_large("hidden", self.hidden, MAX_HIDDEN);
        }
        if self.num_experts > MAX_EXPERTS {
            return too_large("num_experts", self.num_experts, MAX_EXPERTS);
        }
        if let MaxTokens::Fixed(m) = self.max_tokens_per_rank {
            if m > MAX_TOKENS_PER_RANK {
                return too_large("max_tokens_per_rank", m, MAX_TOKENS_PER_RANK);
            }
        }
        let bytes = self.buffer_bytes_per_rank(num_ranks);
        if bytes > MAX_GROUP_BYTES {
            return Err(ConfigError::TooLarge {
                what: "buffers per rank",
                detail: format!(
                    "this config needs {} of buffers on every rank (at most {} supported); lower max_tokens_per_rank, hidden or buffer_sets",
                    crate::error::human_bytes(bytes),
                    crate::error::human_bytes(MAX_GROUP_BYTES)
                ),
            });
        }
        Ok(())
    }

    /// The most buffer memory one rank of a group of `num_ranks` may use, in bytes: every
    /// buffer set's receive regions and outputs filled to their capacity (low-latency: `S`
    /// sets of `[L x R*M x H]` dispatch outputs and scales, `R x M` dispatch messages,
    /// `M x K` combine rows and `[M x H]` combine outputs; high-throughput with a fixed bound:
    /// one operation's `[R*M x H]` outputs with their weights, indices and scales); with
    /// [`GroupConfig::caller_outputs`] the low-latency dispatch outputs are the caller's and
    /// not counted. The GPU
    /// backend's layout is close to it; the host backend allocates lazily, so untouched rows
    /// cost nothing. Computed in 128 bits: no size wraps.
    pub fn buffer_bytes_per_rank(&self, num_ranks: usize) -> u128 {
        // Saturating 128-bit products: no size wraps into a small one.
        let p = |xs: &[usize]| xs.iter().fold(1u128, |acc, &x| acc.saturating_mul(x as u128));
        let r = num_ranks.max(1);
        let (h, k, sets) = (self.hidden, self.max_top_k, self.buffer_sets);
        let l = self.num_experts / r;
        let token_bytes = if self.dispatch_dtype.is_fp8() { p(&[h]) + p(&[h]) / 32 } else { p(&[2, h]) };
        match (self.algorithm, self.max_tokens_per_rank) {
            (Algorithm::LowLatency, MaxTokens::Fixed(m)) => {
                let dispatch_out = if self.caller_outputs { 0 } else { p(&[l, r, m]).saturating_mul(token_bytes) };
                let dispatch_out = dispatch_out.saturating_add(p(&[4, l]));
                let dispatch_recv = p(&[r, m]).saturating_mul(p(&[2, h]).saturating_add(128));
                let combine = p(&[m, k, 2, h]).saturating_add(p(&[m, 2, h]));
                p(&[sets]).saturating_mul(dispatch_out.saturating_add(dispatch_recv).saturating_add(combine))
            }
            (Algorithm::HighThroughput, MaxTokens::Fixed(m)) => {
                p(&[r, m]).saturating_mul(token_bytes.saturating_add(p(&[12, k])).saturating_add(p(&[2, h])))
            }
            (_, MaxTokens::Auto) => 0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_are_bounded_with_the_memory_they_need() {
        let huge = GroupConfig::low_latency(256, 1 << 24, 7168);
        let e = huge.validate(4).unwrap_err();
        assert!(matches!(e, ConfigError::TooLarge { what: "buffers per rank", .. }), "{e}");
        assert!(e.to_string().contains("TiB"), "{e}");
        assert!(matches!(
            GroupConfig::low_latency(256, 1 << 40, 7168).validate(4),
            Err(ConfigError::TooLarge { what: "max_tokens_per_rank", .. })
        ));
        assert!(matches!(
            GroupConfig::low_latency(256, 128, 1 << 30).validate(4),
            Err(ConfigError::TooLarge { what: "hidden", .. })
        ));
        assert_eq!(
            GroupConfig::low_latency(256, 128, 7168).with_timeout(Duration::MAX).validate(4),
            Err(ConfigError::TimeoutTooLong { timeout: Duration::MAX, max: MAX_TIMEOUT })
        );
        // usize::MAX sizes never wrap into small ones.
        let c = GroupConfig::low_latency(usize::MAX, usize::MAX, usize::MAX);
        assert!(c.buffer_bytes_per_rank(1) > MAX_GROUP_BYTES);
        // The reference config: about 1 GB per rank.
        let b = GroupConfig::low_latency(256, 128, 7168).buffer_bytes_per_rank(4);
        assert!((900 << 20..1200 << 20).contains(&b), "{b}");
        // Outputs in caller memory: the dispatch outputs ([L x R*M x H] BF16, two sets) are not
        // the group's.
        let c = GroupConfig::low_latency(256, 128, 7168);
        let own = c.buffer_bytes_per_rank(1);
        let caller = c.with_caller_outputs(true).buffer_bytes_per_rank(1);
        assert_eq!(own - caller, 2 * 256 * 128 * 7168 * 2);
    }

    #[test]
    fn forwarded_rows_are_a_per_call_type_not_a_groups() {
        let c = GroupConfig::low_latency(16, 8, 1024)
            .with_dispatch_dtype(DispatchDtype::Forwarded { token_bytes: 1024, scale_bytes: 32 });
        assert_eq!(c.validate(2), Err(ConfigError::ForwardedGroupDtype));
    }

    #[test]
    fn reference_configs_are_valid() {
        assert_eq!(GroupConfig::low_latency(256, 128, 7168).validate(4), Ok(()));
        assert_eq!(GroupConfig::high_throughput(256, 7168).validate(8), Ok(()));
        let fp8 =
            GroupConfig::low_latency(256, 128, 7168).with_dispatch_dtype(DispatchDtype::Fp8 { round_scales: true });
        assert_eq!(fp8.validate(2), Ok(()));
        assert_eq!(GroupConfig::low_latency(256, 128, 7168).local_experts(4), 64);
    }
}

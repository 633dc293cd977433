//! How big every buffer of a group is (pure arithmetic, checked on CI): a group's
//! [`BufferLayout`] is an [`LlLayout`] for low-latency groups, an [`HtLayout`] for
//! high-throughput ones. (Not to be confused with [`epflow_core::ops::Layout`], the receive
//! layout a handle chooses: expert- or rank-major.)

use epflow_core::config::FP8_BLOCK;
use epflow_core::protocol::Channel;
use epflow_core::tuning::HtTuning;
use epflow_core::{Algorithm, Error, GroupConfig};

use crate::params::{HDR_BYTES, HT_MAX_CHANNELS, HT_MAX_WARPS, LL_TAG_TOKENS, MAX_RANKS, SIGNAL_PAGE_BYTES};

/// The buffers of a group, by algorithm (their sizes and offsets; [`epflow_core::ops::Layout`]
/// is something else: a handle's expert- or rank-major receive layout).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum BufferLayout {
    /// Low-latency.
    Ll(LlLayout),
    /// High-throughput.
    Ht(HtLayout),
}

impl BufferLayout {
    /// The layout of `config` on `num_ranks` ranks (the config must be valid) whose GPUs have
    /// at least `device_sms` SMs each (a high-throughput kernel's blocks must all be resident:
    /// its channels are cut to `device_sms / 2` block pairs).
    pub(crate) fn new(config: &GroupConfig, num_ranks: usize, device_sms: usize) -> Result<Self, Error> {
        if num_ranks > MAX_RANKS {
            return Err(Error::Unsupported(format!(
                "the NVLink kernels support up to {MAX_RANKS} ranks, not {num_ranks}"
            )));
        }
        Ok(match config.algorithm {
            Algorithm::LowLatency => BufferLayout::Ll(LlLayout::new(config, num_ranks)?),
            Algorithm::HighThroughput => BufferLayout::Ht(HtLayout::new(config, num_ranks, device_sms)),
        })
    }

    /// The layout for a group whose high-throughput kernels reach their peers' memory (`direct`:
    /// every rank in one process, none over NCCL; `EPFLOW_HT_DIRECT=0` turns it off): dispatches
    /// write rows straight into the receivers' outputs ([`HtLayout::direct`], with its sending
    /// warps per peer), and combines read the expert outputs in place
    /// ([`HtLayout::pull_combine`], `EPFLOW_HT_PULL=0` turns that off).
    pub(crate) fn with_direct_access(self, direct: bool) -> Self {
        match self {
            BufferLayout::Ht(h) if direct && h.rings => BufferLayout::Ht(HtLayout {
                direct: true,
                pull_combine: h.when_direct.pull_combine,
                warps_per_dest: h.when_direct.warps_per_dest,
                direct_helpers: h.when_direct.direct_helpers,
                balanced: h.when_direct.balanced,
                ..h
            }),
            other => other,
        }
    }

    /// The layout for a group whose ranks reach some peers through NCCL (`any_nccl`):
    /// high-throughput then runs every exchange over NCCL, so its NVLink rings are not
    /// allocated. Low-latency mixes both per peer and keeps its buffers.
    pub(crate) fn for_transport(self, any_nccl: bool) -> Self {
        match self {
            BufferLayout::Ht(h) if any_nccl => BufferLayout::Ht(HtLayout { rings: false, ..h }),
            other => other,
        }
    }

    /// Device bytes of the whole group on one rank, excluding handles and (high-throughput)
    /// outputs.
    pub(crate) fn total_bytes(&self) -> usize {
        match self {
            BufferLayout::Ll(l) => l.total_bytes(),
            BufferLayout::Ht(h) => h.total_bytes(),
        }
    }

    /// The low-latency layout, or an error naming `what` for a high-throughput group.
    pub(crate) fn ll(&self, what: &str) -> Result<&LlLayout, Error> {
        match self {
            BufferLayout::Ll(l) => Ok(l),
            BufferLayout::Ht(_) => Err(Error::Backend(format!("{what} is low-latency only"))),
        }
    }

    /// The high-throughput layout, or an error naming `what` for a low-latency group.
    pub(crate) fn ht(&self, what: &str) -> Result<&HtLayout, Error> {
        match self {
            BufferLayout::Ht(h) => Ok(h),
            BufferLayout::Ll(_) => Err(Error::Backend(format!("{what} is high-throughput only"))),
        }
    }

    /// Dispatch receive region bytes (LL: every buffer set's plain part, then every set's tagged
    /// part, which ends the region: [`LlLayout::tagged_areas`]; HT: every ring).
    pub(crate) fn dispatch_recv_bytes(&self) -> usize {
        match self {
            BufferLayout::Ll(l) => {
                let (tagged_at, tagged) = l.tagged_areas(true);
                tagged_at + tagged
            }
            BufferLayout::Ht(h) => h.ring_region_bytes(),
        }
    }

    /// Combine receive region bytes (as [`BufferLayout::dispatch_recv_bytes`], the combine's parts).
    pub(crate) fn combine_recv_bytes(&self) -> usize {
        match self {
            BufferLayout::Ll(l) => {
                let (tagged_at, tagged) = l.tagged_areas(false);
                tagged_at + tagged
            }
            BufferLayout::Ht(h) => h.ring_region_bytes(),
        }
    }

    /// Bytes of the handle count-exchange region (high-throughput; 0 for low-latency).
    pub(crate) fn exchange_bytes(&self) -> usize {
        match self {
            BufferLayout::Ll(_) => 0,
            BufferLayout::Ht(h) => h.exchange_region_bytes(),
        }
    }
}

/// SMs a high-throughput kernel occupies when the config does not bound them
/// ([`GroupConfig::max_sms`]): 32 channels of a sending and a receiving block each, leaving half
/// of a 132-SM H100/H200 to compute. More SMs help a little (4 x H200, 4096 tokens: 48 SMs 533 us,
/// 96 SMs 503 us, 128 SMs 496 us per dispatch); fewer leave more to overlapped compute.
pub(crate) const DEFAULT_HT_SMS: usize = 64;
/// Ring slots per (channel, source, destination).
pub(crate) const HT_RING_DEPTH: usize = 64;
/// Items a sending warp of a dispatch writes between two system fences (and subtail updates).
/// (Measured on 4 x H200 at 48 SMs: 1 → 644 us, 2 → 565 us, 4 → 533 us for a 4096-token
/// dispatch; on 2 x H200 at 132 SMs 2 / 4 / 8 → 202-204 / 196-198 / 208-209 us, benches/NOTES.md
/// item 64.)
pub(crate) const HT_DISPATCH_ITEMS_PER_FENCE: usize = 4;
/// Items a sending warp of a combine writes between two system fences (2 x H200, 4096 tokens,
/// 132 SMs: 1 / 2 / 3 / 4 / 8 → 206-208 / 198-200 / 206 / 207-210 / 238 us; 64 SMs level at 2 and
/// 4, 270 at 1; item 64). Measured on 2 GPUs only.
pub(crate) const HT_COMBINE_ITEMS_PER_FENCE: usize = 2;
/// Items a receiving block takes from one ring per round (dispatch), and tokens it combines per
/// round (combine); at most the ring depth.
pub(crate) const HT_BATCH: usize = 16;
/// Direct dispatch (rows written into the receiver's outputs, [`HtLayout::direct`]) is used for a
/// (source, channel) pair carrying at least this many rows; fewer go through the ring, which
/// needs no round trip before the first row (the sender waits for the receiver's addresses).
/// 2 x H200, 132 SMs (benches/NOTES.md item 77): 4096 tokens (~60 rows per pair) 187-192 against
/// 198-202 us through the rings; 1 token, every pair direct, 22.3 against 17.6-18.0 us.
pub(crate) const HT_DIRECT_MIN_ROWS: usize = 8;

/// Sending warps per remote destination of a high-throughput dispatch on `num_ranks` ranks with
/// `channels` channels: `16 / R`, except 6 on 2 ranks with 64 channels (128 SMs) or more, or with
/// direct dispatch (`direct`); the rest of the block's 16 warps (`16 - W (R - 1)`, at least
/// `16 / R`) copy this rank's own rows (HBM to HBM, no ring). Measured on 2 x H200 at 4096 tokens
/// (benches/NOTES.md items 37, 60 and 77): 12 warps to the peer instead of 8 made the dispatch
/// slower (244 against 218 us at 64 SMs): more warps per ring wait longer for its in-order ready
/// prefix; at 132 SMs 6 warps are faster than 8 (196-198 against 204-205 us BF16, 118.5-119.1
/// against 121.9-124.9 FP8), at 64 SMs level (BF16) or slower (FP8), 4 slower at both. Direct,
/// at 64 SMs 6 warps 195-197 against 8 warps 205-206 us; at 132 SMs 4, 6 and 8 level (189-191),
/// 10 192, 12 201.
pub(crate) fn dispatch_send_warps(num_ranks: usize, channels: usize, direct: bool) -> usize {
    if num_ranks == 2 && (channels >= 64 || direct) {
        return 6;
    }
    (HT_MAX_WARPS / num_ranks.max(1)).max(1)
}

/// Warps of each receiving block that help a direct dispatch send to each remote destination
/// (`ht_help_direct` in `ht_send.cuh`): `EPFLOW_HT_DIRECT_HELPERS` (at most [`max_helpers`]),
/// else none. Measured on four pairs of H100s at 4096 tokens (benches/NOTES.md items 114, 116
/// and 118): at 64 SMs the dispatch took 192-197 us with 16 helpers on every pair, against
/// 196-204 us without on two pairs and 185-202 (medians 191 and 193) on the other two; at 96 and
/// 132 SMs helpers were 5-8 us slower; on a fifth pair 1.6 us slower in the mean (item 119). Off
/// by default for want of a gain (their stamp-mismatch path passes `gpu_disagreement`, item
/// 119). More than two ranks: not measured.
pub(crate) fn direct_helpers(t: &HtTuning, num_ranks: usize) -> usize {
    clamped(t.direct_helpers, 0, max_helpers(num_ranks)).unwrap_or(0)
}

/// The most channels of a kernel whose direct dispatch is balanced by default
/// ([`balanced_dispatch`]): 64 SMs.
pub(crate) const HT_BALANCED_MAX_CHANNELS: usize = 32;

/// Whether a direct dispatch on `channels` channels shares out each destination's rows as they go
/// ([`HtLayout::balanced`]): `EPFLOW_HT_BALANCED=0` or `=1`, else up to
/// [`HT_BALANCED_MAX_CHANNELS`]. Measured on 2 x H200 at 4096 tokens (benches/NOTES.md item
/// 154): at 64 SMs the dispatch's per-run medians went from 185.7-198.4 µs (per machine
/// 190.6-194.8) to 187.4-194.3 (188.6-191.3) on five machines; at 132 SMs two validated runs
/// took 193.6 and 194.6 µs against 185.1 for the fixed shares in the session before, not
/// measured side by side, so off there until it is.
pub(crate) fn balanced_dispatch(t: &HtTuning, channels: usize) -> bool {
    t.balanced.unwrap_or(channels <= HT_BALANCED_MAX_CHANNELS)
}

/// The most helping warps per remote destination a receiving block has: its 16 shared out.
fn max_helpers(num_ranks: usize) -> usize {
    if num_ranks <= 1 { 0 } else { HT_MAX_WARPS / (num_ranks - 1) }
}

/// Sending warps per remote destination of a high-throughput combine: `16 / R` (the block's
/// own-row warps idle: the receiver reads those rows in place). Measured on 2 x H200 (items 37
/// and 60): 16 warps to the one peer made the combine slower (292 against 221 us at 64 SMs), 4
/// faster only at 128 SMs (203 against 210 us), 6 slower at 64 SMs (229 against 226 us).
pub(crate) fn combine_send_warps(num_ranks: usize) -> usize {
    (HT_MAX_WARPS / num_ranks.max(1)).max(1)
}

/// A tuning override of the high-throughput layout ([`HtTuning`], from `EPFLOW_HT_<NAME>` or
/// the group's config) clamped to `[lo, hi]` (for measuring; the defaults are the measured
/// choice): the depth (ring slots, 16-1024), the receive batch (at most the depth), the items a
/// sending warp writes per fence (at most what fits in the ring), the sending warps per remote
/// destination (at most what the block's 16 leave: one own-copy warp for a dispatch), and the
/// rows of a (source, channel) pair from which a dispatch writes them directly (at least 1).
/// Every rank of a group must use the same values.
fn clamped(v: Option<usize>, lo: usize, hi: usize) -> Option<usize> {
    v.map(|v| v.clamp(lo, hi.max(lo)))
}

/// Sending warps per remote destination of a dispatch: `EPFLOW_HT_DISPATCH_WARPS` (at most
/// [`max_dispatch_warps`]), else [`dispatch_send_warps`].
fn dispatch_warps(t: &HtTuning, num_ranks: usize, channels: usize, direct: bool) -> usize {
    clamped(t.dispatch_warps, 1, max_dispatch_warps(num_ranks))
        .unwrap_or_else(|| dispatch_send_warps(num_ranks, channels, direct))
}

/// The most sending warps per remote destination a dispatch can have: one warp stays for the
/// rank's own rows.
fn max_dispatch_warps(num_ranks: usize) -> usize {
    if num_ranks <= 1 { HT_MAX_WARPS } else { (HT_MAX_WARPS - 1) / (num_ranks - 1) }
}

/// The most sending warps per remote destination a combine can have.
fn max_combine_warps(num_ranks: usize) -> usize {
    if num_ranks <= 1 { HT_MAX_WARPS } else { HT_MAX_WARPS / (num_ranks - 1) }
}

/// Buffer sizes of one rank of a high-throughput group. Every buffer is bounded by the config
/// alone — none grows with the number of tokens — because data moves through rings of fixed
/// depth; only the outputs of each operation are sized by its token counts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct HtLayout {
    /// `R`.
    pub num_ranks: usize,
    /// `H`.
    pub hidden: usize,
    /// `L`.
    pub local_experts: usize,
    /// Largest top-k.
    pub max_top_k: usize,
    /// Whether forward dispatch carries FP8.
    pub fp8: bool,
    /// Channels `C`: a kernel runs `2 * C` blocks (one sending, one receiving per channel).
    pub channels: usize,
    /// Slots per ring.
    pub depth: usize,
    /// Items a receiving block takes per source per round (dispatch) and tokens it combines per
    /// round (combine): [`HT_BATCH`], at most the depth.
    pub batch: usize,
    /// Items a sending warp of a dispatch writes between two system fences (and subtail
    /// updates): [`HT_DISPATCH_ITEMS_PER_FENCE`] (at most what fits in the ring, `ht::start`).
    pub items_per_fence: usize,
    /// The same for a combine: [`HT_COMBINE_ITEMS_PER_FENCE`].
    pub combine_items_per_fence: usize,
    /// Sending warps per remote destination of a dispatch (the block's other warps copy the rows
    /// for this rank itself): [`dispatch_send_warps`].
    pub warps_per_dest: usize,
    /// Sending warps per remote destination of a combine (the receiver reads this rank's own
    /// rows in place, so no warp copies them): [`combine_send_warps`].
    pub combine_warps_per_dest: usize,
    /// Whether dispatches write rows straight into the receivers' outputs (`direct` in
    /// `ht_send.cuh`; [`BufferLayout::with_direct_access`]): the same on every rank.
    pub direct: bool,
    /// Whether combines read the expert side's rows in place, over NVLink, rather than through
    /// the rings (pull combine in `ht_rings.cuh`, for the pairs a direct dispatch would take;
    /// only with `direct`): the same on every rank.
    pub pull_combine: bool,
    /// Rows of a (source, channel) pair from which a direct dispatch writes them into the
    /// receiver's outputs, and a pull combine reads them in place: [`HT_DIRECT_MIN_ROWS`].
    pub direct_min_rows: usize,
    /// Warps of each receiving block that help a direct dispatch send to each remote destination
    /// ([`direct_helpers`]; only with `direct`, 0 otherwise and by default): the same on every
    /// rank.
    pub direct_helpers: usize,
    /// Whether a direct dispatch shares out each destination's rows between the warps of every
    /// channel as they go, rather than a fixed share per channel (`ht_pooled` in `ht_send.cuh`;
    /// only with `direct`; [`balanced_dispatch`]: by default up to 64 SMs): the same on every
    /// rank.
    pub balanced: bool,
    /// Byte offset of the FP8 scales in a slot.
    pub off_scales: usize,
    /// Byte offset of the top-k weights in a slot.
    pub off_weights: usize,
    /// Byte offset of the local expert indices in a slot.
    pub off_idx: usize,
    /// Bytes of a slot (a multiple of 16).
    pub slot_bytes: usize,
    /// Whether the NVLink receive rings are allocated: not when the group runs high-throughput
    /// over NCCL (any peer reached through NCCL moves every exchange there; see
    /// [`BufferLayout::for_transport`]).
    pub rings: bool,
    /// What [`BufferLayout::with_direct_access`] sets, from the group's tuning.
    pub when_direct: WhenDirect,
}

/// The direct-access fields of an [`HtLayout`] as the group's tuning chose them (taken by
/// [`BufferLayout::with_direct_access`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct WhenDirect {
    pub pull_combine: bool,
    pub warps_per_dest: usize,
    pub direct_helpers: usize,
    pub balanced: bool,
}

impl HtLayout {
    /// The layout of `config` on `num_ranks` ranks (at most 8) on GPUs of `device_sms` SMs: one
    /// channel (a sending and a receiving block) per two of the config's SMs, at most half the
    /// GPU's (every block of a kernel must be resident: receiving blocks wait for sending ones)
    /// and at most [`HT_MAX_CHANNELS`].
    pub(crate) fn new(config: &GroupConfig, num_ranks: usize, device_sms: usize) -> Self {
        let h = config.hidden;
        let k = config.max_top_k;
        let fp8 = config.dispatch_dtype.is_fp8();
        let off_scales = 2 * h;
        let off_weights = (off_scales + if fp8 { 4 * (h / FP8_BLOCK) } else { 0 }).next_multiple_of(16);
        let off_idx = (off_weights + 4 * k).next_multiple_of(16);
        let sms = config.max_sms.unwrap_or(DEFAULT_HT_SMS).min(device_sms);
        let channels = (sms / 2).clamp(1, HT_MAX_CHANNELS);
        let tuning = config.tuning();
        let t = &tuning.ht;
        let depth = clamped(t.depth, 16, 1024).unwrap_or(HT_RING_DEPTH);
        HtLayout {
            num_ranks,
            hidden: h,
            local_experts: config.local_experts(num_ranks),
            max_top_k: k,
            fp8,
            channels,
            depth,
            batch: clamped(t.batch, 1, depth).unwrap_or(HT_BATCH.min(depth)),
            items_per_fence: clamped(t.dispatch_items_per_fence, 1, depth).unwrap_or(HT_DISPATCH_ITEMS_PER_FENCE),
            combine_items_per_fence: clamped(t.combine_items_per_fence, 1, depth).unwrap_or(HT_COMBINE_ITEMS_PER_FENCE),
            warps_per_dest: dispatch_warps(t, num_ranks, channels, false),
            combine_warps_per_dest: clamped(t.combine_warps, 1, max_combine_warps(num_ranks))
                .unwrap_or_else(|| combine_send_warps(num_ranks)),
            direct: false,
            pull_combine: false,
            direct_min_rows: clamped(t.direct_min_rows, 1, i32::MAX as usize).unwrap_or(HT_DIRECT_MIN_ROWS),
            direct_helpers: 0,
            balanced: false,
            off_scales,
            off_weights,
            off_idx,
            slot_bytes: (off_idx + 4 * k).next_multiple_of(16),
            rings: true,
            when_direct: WhenDirect {
                pull_combine: tuning.ht_pull,
                warps_per_dest: dispatch_warps(t, num_ranks, channels, true),
                direct_helpers: direct_helpers(t, num_ranks),
                balanced: balanced_dispatch(t, channels),
            },
        }
    }

    /// Sending warps per remote destination of a `chan` kernel (`HtParams::warps_per_dest`).
    pub(crate) fn send_warps(&self, chan: Channel) -> usize {
        if chan == Channel::Dispatch { self.warps_per_dest } else { self.combine_warps_per_dest }
    }

    /// Items a sending warp of a `chan` kernel writes per fence, before the ring's bound.
    pub(crate) fn items_per_fence(&self, chan: Channel) -> usize {
        if chan == Channel::Dispatch { self.items_per_fence } else { self.combine_items_per_fence }
    }

    /// Bytes of one ring.
    pub(crate) fn ring_bytes(&self) -> usize {
        self.depth * self.slot_bytes
    }

    /// Bytes of one channel kind's receive rings: one per (channel, source); 0 without rings.
    pub(crate) fn ring_region_bytes(&self) -> usize {
        if self.rings { self.channels * self.num_ranks * self.ring_bytes() } else { 0 }
    }

    /// `i32` words of one rank's count-exchange message to another: rows per channel, then
    /// selections per local expert of the receiver.
    pub(crate) fn exchange_words(&self) -> usize {
        self.channels + self.local_experts
    }

    /// Bytes of the count-exchange region: two sets of a message per source.
    pub(crate) fn exchange_region_bytes(&self) -> usize {
        2 * self.num_ranks * self.exchange_words() * 4
    }

    /// Device bytes of the group on one rank, excluding handles and outputs.
    pub(crate) fn total_bytes(&self) -> usize {
        2 * self.ring_region_bytes() + self.exchange_region_bytes() + SIGNAL_PAGE_BYTES
    }
}

/// Buffer sizes of one rank of a low-latency group.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct LlLayout {
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
    /// Whether the group holds dispatch output buffer sets (`!GroupConfig::caller_outputs`).
    pub own_outputs: bool,
    /// Bytes of one dispatch message (header + payload), a multiple of 16.
    pub msg_bytes: usize,
}

impl LlLayout {
    /// The layout of `config` on `num_ranks` ranks (the config must be low-latency and valid).
    pub(crate) fn new(config: &GroupConfig, num_ranks: usize) -> Result<Self, Error> {
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
        let local_experts = config.local_experts(num_ranks);
        // The kernels index rows and row-map entries with 32-bit integers.
        let rows = (local_experts as u128) * (num_ranks as u128) * (max_tokens as u128);
        let entries = (num_ranks as u128) * (max_tokens as u128) * (config.max_top_k as u128);
        if rows.max(entries) > i32::MAX as u128 {
            return Err(Error::Unsupported(format!(
                "{rows} expert rows and {entries} row-map entries per rank exceed the low-latency kernels' 32-bit indices: lower max_tokens_per_rank or the experts per rank"
            )));
        }
        if local_experts > i16::MAX as usize {
            return Err(Error::Unsupported(format!(
                "{local_experts} experts per rank: low-latency messages carry local expert indices as 16-bit integers"
            )));
        }
        let payload = if fp8 { h + 4 * (h / FP8_BLOCK) } else { 2 * h };
        Ok(LlLayout {
            num_ranks,
            max_tokens,
            hidden: h,
            local_experts,
            sets: config.buffer_sets,
            max_top_k: config.max_top_k,
            fp8,
            own_outputs: !config.caller_outputs,
            msg_bytes: (HDR_BYTES + payload).next_multiple_of(16),
        })
    }

    /// Rows per expert of the dispatch output, `R * M`.
    pub(crate) fn rows_per_expert(&self) -> usize {
        self.num_ranks * self.max_tokens
    }

    /// Dispatch receive region, one set: a slot per (source rank, token).
    pub(crate) fn dispatch_recv_set_bytes(&self) -> usize {
        self.num_ranks * self.max_tokens * self.msg_bytes
    }

    /// The dispatch's tagged area, one set (after every set's plain region): `tag_capacity()`
    /// tagged messages (`2 * msg_bytes`: every 4-byte word as an 8-byte pair {word, tag}) per
    /// source rank. Only tagged messages are written there; a set's tags grow from one operation
    /// to the next, and the operation before the 32-bit tag wraps clears it (see `sends_tagged`
    /// in `ll_tagged.cuh`).
    pub(crate) fn dispatch_tagged_set_bytes(&self) -> usize {
        self.tag_capacity() * self.num_ranks * 2 * self.msg_bytes
    }

    /// Combine receive region, one set: a BF16 row per (token, k).
    pub(crate) fn combine_recv_set_bytes(&self) -> usize {
        self.max_tokens * self.max_top_k * self.hidden * 2
    }

    /// Tokens whose rank-major combine rows fit the tagged area: `min(LL_TAG_TOKENS, M)`.
    pub(crate) fn tag_capacity(&self) -> usize {
        LL_TAG_TOKENS.min(self.max_tokens)
    }

    /// The combine's tagged area, one set (after every set's plain region): `tag_capacity() * R`
    /// tagged rows of 8-byte pairs of two BF16 channels and a tag (`4 H` bytes): rank-major, a
    /// row per (token, source rank); expert-major, per (token, k) for `tag_capacity() * R / K`
    /// tokens. Only tagged rows are ever written there; a set's tags grow from one operation to
    /// the next, and the operation before the 32-bit tag wraps clears it (see `EP_TAG_TOKENS` in
    /// `ll_tagged.cuh`).
    pub(crate) fn combine_tagged_set_bytes(&self) -> usize {
        self.tag_capacity() * self.num_ranks * self.hidden * 4
    }

    /// Where a channel's tagged areas lie in its receive region (`dispatch`: the dispatch's, else
    /// the combine's): (offset, bytes) of every set's, after every set's plain region.
    pub(crate) fn tagged_areas(&self, dispatch: bool) -> (usize, usize) {
        if dispatch {
            (self.sets * self.dispatch_recv_set_bytes(), self.sets * self.dispatch_tagged_set_bytes())
        } else {
            (self.sets * self.combine_recv_set_bytes(), self.sets * self.combine_tagged_set_bytes())
        }
    }

    /// Whether moving a channel from operation `from` to `to` without running the operations
    /// between (`GpuRank::renumber_operations`) skips one that clears its buffer set's tagged
    /// areas: with tag = operation + 1 as 32 bits (0 becoming 1; `op_tag` in `ll_tagged.cuh`),
    /// operation q clears them when its set's next operation, q + sets, has a tag no larger
    /// (`finish_receive` in `ll_receive.cuh`): the operations with q + 1 in [k 2^32 - sets,
    /// k 2^32 - 1] for some k >= 1, and with one set also q + 1 = k 2^32 (tag 1, as the next).
    /// Skipping one would leave rows whose tags come again.
    pub(crate) fn skips_a_tag_wrap_clear(&self, from: u64, to: u64) -> bool {
        if to <= from {
            return false;
        }
        let (wrap, sets) = (1u128 << 32, self.sets.max(1) as u128);
        // The clearing operations before wrap k: q in [k 2^32 - sets - 1, k 2^32 - last_below]
        // (one set: also q = k 2^32 - 1).
        let last_below = 2 - u128::from(sets == 1);
        // The first k whose clearing operations are not all below `from`.
        let k = (u128::from(from) + last_below).div_ceil(wrap).max(1);
        k * wrap - sets - 1 < u128::from(to)
    }

    /// Dispatch output tokens, one set: `[L x R*M x H]` (0 when the outputs are the caller's).
    pub(crate) fn dispatch_out_bytes(&self) -> usize {
        if !self.own_outputs {
            return 0;
        }
        self.local_experts * self.rows_per_expert() * self.hidden * if self.fp8 { 1 } else { 2 }
    }

    /// Dispatch output scales, one set (FP8 only): `[L x R*M x H/128]` fp32 (0 when the outputs
    /// are the caller's).
    pub(crate) fn dispatch_scales_bytes(&self) -> usize {
        if self.fp8 && self.own_outputs {
            self.local_experts * self.rows_per_expert() * (self.hidden / FP8_BLOCK) * 4
        } else {
            0
        }
    }

    /// Receive counters per set: `[L]` (expert-major) or `[R]` (rank-major) int32, whichever is
    /// longer.
    pub(crate) fn counts_len(&self) -> usize {
        self.local_experts.max(self.num_ranks)
    }

    /// Rank-major received weights `[R*M x K]` fp32 followed by local expert indices
    /// `[R*M x K]` int32, one set.
    pub(crate) fn rank_major_topk_bytes(&self) -> usize {
        2 * self.rank_major_topk_entries() * 4
    }

    /// `R*M*K`: entries of the rank-major weights (and of the indices).
    pub(crate) fn rank_major_topk_entries(&self) -> usize {
        self.rows_per_expert() * self.max_top_k
    }

    /// Combine output, one set: `[M x H]` BF16.
    pub(crate) fn combine_out_bytes(&self) -> usize {
        self.max_tokens * self.hidden * 2
    }

    /// Per-handle device memory: the `topk_idx` copy `[M x K]` int64, the rank-major send
    /// slots `[R x M]` int32 (`send_slot`; right after the copy, so the host writes both at
    /// once) and the tokens per destination `[R]` int32 (see `row_of_offset`), the row map
    /// `[R x M x K]` int32, for NCCL peers the combine pack map `[R x M x K]` and the combine
    /// positions `[M x K]` int32 (see `nccl.rs`), and the return list `[R x M x K]` int32 with
    /// its per-source counts `[R]` int32 (`ret_list` in `ll_base.cuh`).
    pub(crate) fn handle_bytes(&self) -> usize {
        self.return_count_offset() + (self.num_ranks * 4).next_multiple_of(256)
    }

    /// Offset of the rank-major send slots inside a handle's memory: per (destination, token)
    /// the slot of its dispatch message there, or -1 (`LlParams::send_slot`). Right after the
    /// `topk_idx` copy.
    pub(crate) fn send_slot_offset(&self) -> usize {
        self.topk_copy_bytes()
    }

    /// The start of a rank-major handle's memory as one host buffer, written with one copy: the
    /// routing's `values` (`[B x K]` int64, B <= M, little-endian as the device reads them),
    /// zeros up to [`Self::send_slot_offset`], then the send `slots` (`[R x M]` int32).
    pub(crate) fn handle_head(&self, values: &[i64], slots: &[i32]) -> Vec<u8> {
        debug_assert!(values.len() * 8 <= self.send_slot_offset() && slots.len() == self.num_ranks * self.max_tokens);
        let mut bytes = Vec::with_capacity(self.send_slot_offset() + slots.len() * 4);
        bytes.extend(values.iter().flat_map(|v| v.to_le_bytes()));
        bytes.resize(self.send_slot_offset(), 0);
        bytes.extend(slots.iter().flat_map(|v| v.to_le_bytes()));
        bytes
    }

    /// Offset of the row map inside a handle's memory: after the send slots and the tokens per
    /// destination, `[R]` int32 right after the slots (at `send_slot_offset + R * M * 4`),
    /// which the handle's kernel writes and a dispatch reads when the host has not
    /// (`LlParams::send_rows`).
    pub(crate) fn row_of_offset(&self) -> usize {
        self.send_slot_offset() + (self.num_ranks * (self.max_tokens + 1) * 4).next_multiple_of(256)
    }

    /// Offset of the return list inside a handle's memory.
    pub(crate) fn return_list_offset(&self) -> usize {
        self.nccl_pos_offset() + (self.max_tokens * self.max_top_k * 4).next_multiple_of(256)
    }

    /// Offset of the return list's per-source counts inside a handle's memory.
    pub(crate) fn return_count_offset(&self) -> usize {
        self.return_list_offset() + (self.num_ranks * self.max_tokens * self.max_top_k * 4).next_multiple_of(256)
    }

    /// Offset of the NCCL combine pack map inside a handle's memory.
    pub(crate) fn nccl_pack_offset(&self) -> usize {
        self.row_of_offset() + (self.num_ranks * self.max_tokens * self.max_top_k * 4).next_multiple_of(256)
    }

    /// Offset of the NCCL combine positions inside a handle's memory.
    pub(crate) fn nccl_pos_offset(&self) -> usize {
        self.nccl_pack_offset() + (self.num_ranks * self.max_tokens * self.max_top_k * 4).next_multiple_of(256)
    }

    /// Bytes of the `topk_idx` copy at the start of a handle's memory (rounded up to 256).
    pub(crate) fn topk_copy_bytes(&self) -> usize {
        (self.max_tokens * self.max_top_k * 8).next_multiple_of(256)
    }

    /// Device bytes of the whole group on one rank (every set), excluding handles.
    pub(crate) fn total_bytes(&self) -> usize {
        let per_set = self.dispatch_recv_set_bytes()
            + self.dispatch_tagged_set_bytes()
            + self.combine_recv_set_bytes()
            + self.combine_tagged_set_bytes()
            + self.dispatch_out_bytes()
            + self.dispatch_scales_bytes()
            + self.counts_len() * 4
            + self.rank_major_topk_bytes()
            + self.combine_out_bytes();
        per_set * self.sets + SIGNAL_PAGE_BYTES
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// SMs of an H100 or H200.
    const H200_SMS: usize = 132;

    /// `skips_a_tag_wrap_clear` against its definition, operation by operation, in windows around
    /// the first wraps (and over long jumps, where only the formula can answer).
    #[test]
    fn renumbering_knows_which_jumps_skip_a_tag_wrap_clear() {
        let op_tag = |seq: u64| ((seq.wrapping_add(1)) as u32).max(1);
        for sets in 1..=4usize {
            let mut l = LlLayout::new(&GroupConfig::low_latency(64, 32, 2048), 2).unwrap();
            l.sets = sets;
            let s = sets as u64;
            let clears = |q: u64| op_tag(q + s) <= op_tag(q);
            for base in [1u64 << 32, 2u64 << 32] {
                for from in base - 12..base + 6 {
                    for to in from..base + 8 {
                        let want = (from..to).any(clears);
                        assert_eq!(l.skips_a_tag_wrap_clear(from, to), want, "sets {sets}, {from}..{to}");
                    }
                }
            }
            let wrap = 1u64 << 32;
            // `tagged_messages_across_the_tag_wrap`'s jump lands before the clearing operations;
            // a jump past them, or from below one wrap to beyond the next, skips them.
            assert!(!l.skips_a_tag_wrap_clear(8, wrap - 6));
            assert!(l.skips_a_tag_wrap_clear(8, wrap));
            assert!(l.skips_a_tag_wrap_clear(wrap + 5, 3 * wrap));
            assert!(!l.skips_a_tag_wrap_clear(wrap + 5, 2 * wrap - 8));
            assert!(!l.skips_a_tag_wrap_clear(9, 9));
            assert!(!l.skips_a_tag_wrap_clear(9, 3));
        }
    }

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
    fn group_memory_counts_the_tagged_areas_and_stays_within_1_gb_at_the_issue_config() {
        // Issue 15: at most 1.0 GB per rank at 128 tokens on 2 ranks (H=7168, E=256, K=8).
        let config = GroupConfig::low_latency(256, 128, 7168).with_max_top_k(8);
        let l = LlLayout::new(&config, 2).unwrap();
        let layout = BufferLayout::Ll(l);
        let tagged = (l.dispatch_tagged_set_bytes() + l.combine_tagged_set_bytes()) * l.sets;
        assert_eq!(l.dispatch_tagged_set_bytes(), 32 * 2 * 2 * (128 + 14336));
        assert_eq!(l.combine_tagged_set_bytes(), 32 * 2 * 7168 * 4);
        assert!(layout.dispatch_recv_bytes() + layout.combine_recv_bytes() < l.total_bytes());
        assert!(l.total_bytes() > tagged);
        assert!(l.total_bytes() <= 1_000_000_000, "{} B", l.total_bytes());
    }

    #[test]
    fn handle_regions_follow_each_other_and_the_head_is_one_buffer() {
        for (ranks, m, k) in [(2usize, 128usize, 8usize), (8, 1, 16), (3, 7, 1)] {
            let l = LlLayout::new(&GroupConfig::low_latency(64, m, 1024).with_max_top_k(k), ranks).unwrap();
            let rmk = ranks * m * k * 4;
            // Each region starts at or after the end of the one before, 256-aligned.
            let regions = [
                (0, m * k * 8),
                // The slots, then the tokens per destination (`LlParams::send_rows`).
                (l.send_slot_offset(), ranks * (m + 1) * 4),
                (l.row_of_offset(), rmk),
                (l.nccl_pack_offset(), rmk),
                (l.nccl_pos_offset(), m * k * 4),
                (l.return_list_offset(), rmk),
                (l.return_count_offset(), ranks * 4),
            ];
            for w in regions.windows(2) {
                assert!(w[0].0 + w[0].1 <= w[1].0 && w[1].0 % 256 == 0, "{ranks} {m} {k}: {regions:?}");
            }
            let (last, len) = regions[regions.len() - 1];
            assert!(last + len <= l.handle_bytes());
            // The head: the routing, zeros, then the slots at their offset.
            let values: Vec<i64> = (0..(m * k) as i64).map(|v| v - 1).collect();
            let slots: Vec<i32> = (0..(ranks * m) as i32).map(|v| v * 3 - 2).collect();
            let head = l.handle_head(&values[..k], &slots);
            assert_eq!(head.len(), l.send_slot_offset() + ranks * m * 4);
            assert_eq!(&head[..8], &(-1i64).to_le_bytes());
            assert!(head[k * 8..l.send_slot_offset()].iter().all(|&b| b == 0));
            let at = l.send_slot_offset() + 4 * (ranks * m - 1);
            assert_eq!(&head[at..at + 4], &slots[ranks * m - 1].to_le_bytes());
        }
    }

    #[test]
    fn sizes_beyond_the_kernels_32_bit_indices_are_errors() {
        let big = GroupConfig::low_latency(8 * 4096, 1 << 20, 128);
        assert!(matches!(LlLayout::new(&big, 8), Err(Error::Unsupported(m)) if m.contains("32-bit")));
    }

    #[test]
    fn too_many_ranks_is_an_error() {
        assert!(LlLayout::new(&GroupConfig::low_latency(256, 128, 7168), 16).is_err());
        assert!(BufferLayout::new(&GroupConfig::high_throughput(256, 7168), 16, H200_SMS).is_err());
    }

    #[test]
    fn ht_buffers_do_not_depend_on_tokens() {
        let cfg = GroupConfig::high_throughput(256, 7168);
        let l = HtLayout::new(&cfg, 4, H200_SMS);
        assert_eq!(l.channels, DEFAULT_HT_SMS / 2);
        assert_eq!((l.warps_per_dest, l.combine_warps_per_dest), (4, 4));
        assert_eq!(l.slot_bytes, 14336 + 32 + 32);
        assert_eq!(l.exchange_words(), 32 + 64);
        // Rings for both channels, ~236 MB: a 4096- or 16384-token dispatch uses the same.
        assert!(l.total_bytes() < 250_000_000, "{} B", l.total_bytes());
        let l8 = HtLayout::new(&cfg, 8, H200_SMS);
        assert_eq!((l8.warps_per_dest, l8.combine_warps_per_dest), (2, 2));
        let l2 = HtLayout::new(&cfg, 2, H200_SMS);
        assert_eq!((l2.warps_per_dest, l2.combine_warps_per_dest), (8, 8));
        let wide = HtLayout::new(&cfg.clone().with_max_sms(Some(132)), 2, H200_SMS);
        assert_eq!((wide.channels, wide.warps_per_dest, wide.combine_warps_per_dest), (66, 6, 8));
        // Every remote warp count fits the subtail residues, and the warps fit the block.
        for (r, ch) in (1..=MAX_RANKS).flat_map(|r| [(r, 1), (r, 32), (r, HT_MAX_CHANNELS)]) {
            let (d, c) = (dispatch_send_warps(r, ch, false), combine_send_warps(r));
            assert!(d <= HT_MAX_WARPS && c <= HT_MAX_WARPS, "{r} ranks");
            assert!(r == 1 || (d * (r - 1) < HT_MAX_WARPS && c * (r - 1) <= HT_MAX_WARPS), "{r} ranks");
        }
        let fp8 = HtLayout::new(
            &cfg.clone().with_dispatch_dtype(epflow_core::DispatchDtype::Fp8 { round_scales: false }),
            4,
            H200_SMS,
        );
        assert_eq!(fp8.off_weights, 14336 + 224);
        // The channels: half the config's SMs, at most half the GPU's, at most HT_MAX_CHANNELS.
        assert_eq!(HtLayout::new(&cfg.clone().with_max_sms(Some(1000)), 2, H200_SMS).channels, 66);
        assert_eq!(HtLayout::new(&cfg.clone().with_max_sms(Some(1000)), 2, 1000).channels, HT_MAX_CHANNELS);
        assert_eq!(HtLayout::new(&cfg.clone().with_max_sms(Some(96)), 2, 78).channels, 39);
        assert_eq!(HtLayout::new(&cfg.clone().with_max_sms(Some(1)), 2, H200_SMS).channels, 1);
        // Over NCCL: no rings, a few kilobytes of exchange and signals.
        let BufferLayout::Ht(nccl) = BufferLayout::new(&cfg, 4, H200_SMS).unwrap().for_transport(true) else {
            unreachable!()
        };
        assert_eq!(nccl.ring_region_bytes(), 0);
        assert!(nccl.total_bytes() < 1 << 20, "{} B", nccl.total_bytes());
        let ll = BufferLayout::new(&GroupConfig::low_latency(256, 128, 7168), 4, H200_SMS).unwrap();
        assert_eq!(ll.for_transport(true), ll);
    }

    #[test]
    fn direct_access_needs_the_rings_and_takes_six_dispatch_warps_on_two_ranks() {
        use epflow_core::tuning::Tuning;
        // The defaults, whatever the environment says.
        let cfg = GroupConfig::high_throughput(256, 7168).with_tuning(Tuning::default());
        let ht = |l: BufferLayout| match l {
            BufferLayout::Ht(h) => h,
            BufferLayout::Ll(_) => unreachable!(),
        };
        let plain = ht(BufferLayout::new(&cfg, 2, H200_SMS).unwrap());
        assert!(!plain.direct && !plain.pull_combine);
        assert_eq!((plain.channels, plain.warps_per_dest), (32, 8));
        let direct = ht(BufferLayout::new(&cfg, 2, H200_SMS).unwrap().with_direct_access(true));
        assert!(direct.direct);
        // Pull combine is on unless turned off.
        assert!(direct.pull_combine);
        assert_eq!((direct.warps_per_dest, direct.combine_warps_per_dest), (6, 8));
        assert_eq!(direct.direct_min_rows, HT_DIRECT_MIN_ROWS);
        // Helpers only when asked for, at most the receiving block's 16 warps shared out.
        assert_eq!((plain.direct_helpers, direct.direct_helpers), (0, 0));
        // Balanced direct dispatch up to 64 SMs; never without direct writes.
        assert!(direct.balanced);
        let wide = cfg.clone().with_max_sms(Some(H200_SMS));
        let wide = ht(BufferLayout::new(&wide, 2, H200_SMS).unwrap().with_direct_access(true));
        assert_eq!((wide.channels, wide.balanced), (66, false));
        assert!(!plain.balanced);
        // The group's overrides (EPFLOW_HT_* by default), clamped to their ranges.
        let tuned = |ht: HtTuning, pull: bool| {
            let t = Tuning { ht, ht_pull: pull, ..Tuning::default() };
            let c = cfg.clone().with_tuning(t);
            match BufferLayout::new(&c, 2, H200_SMS).unwrap().with_direct_access(true) {
                BufferLayout::Ht(h) => h,
                BufferLayout::Ll(_) => unreachable!(),
            }
        };
        let over = HtTuning {
            direct_helpers: Some(100),
            balanced: Some(false),
            depth: Some(4),
            batch: Some(1000),
            dispatch_warps: Some(3),
            ..HtTuning::default()
        };
        let t = tuned(over, false);
        assert_eq!((t.direct_helpers, t.balanced, t.pull_combine), (16, false, false));
        assert_eq!((t.depth, t.batch, t.warps_per_dest), (16, 16, 3));
        assert_eq!((max_helpers(1), max_helpers(2), max_helpers(4), max_helpers(8)), (0, 16, 5, 2));
        // Four ranks keep 16 / R; over NCCL (no rings) nothing is direct; off stays off.
        assert_eq!(ht(BufferLayout::new(&cfg, 4, H200_SMS).unwrap().with_direct_access(true)).warps_per_dest, 4);
        let over_nccl = BufferLayout::new(&cfg, 2, H200_SMS).unwrap().for_transport(true).with_direct_access(true);
        assert!(!ht(over_nccl).direct && !ht(over_nccl).pull_combine);
        assert_eq!(ht(BufferLayout::new(&cfg, 2, H200_SMS).unwrap().with_direct_access(false)), plain);
        let ll = BufferLayout::new(&GroupConfig::low_latency(256, 128, 7168), 2, H200_SMS).unwrap();
        assert_eq!(ll.with_direct_access(true), ll);
    }
}

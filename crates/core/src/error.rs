//! Every error epflow returns. Anything a caller can pass in is answered with one of these,
//! never a panic.

use std::time::Duration;

use thiserror::Error;

use crate::dtype::DType;
use crate::stamp::Stamp;
use crate::tensor::TensorTag;

/// `bytes` in the largest binary unit that keeps a value of at least 1 (`"1.5 GiB"`).
pub fn human_bytes(bytes: u128) -> String {
    const UNITS: [&str; 7] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    let mut v = bytes as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 { format!("{bytes} B") } else { format!("{v:.1} {}", UNITS[u]) }
}

/// A [`crate::GroupConfig`] that cannot be used; each variant names the field and the reason.
#[derive(Clone, Debug, Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum ConfigError {
    /// Rank masking was asked for on a high-throughput group.
    #[error(
        "rank_masking is a low-latency option: high-throughput rings cannot skip a rank's rows, so a high-throughput group poisons on a timeout"
    )]
    MaskingNeedsLowLatency,
    /// The group has no ranks.
    #[error("num_ranks is 0: a group needs at least one rank")]
    ZeroRanks,
    /// More ranks than supported.
    #[error("num_ranks is {num_ranks}, more than the supported {max}")]
    TooManyRanks {
        /// Ranks asked for.
        num_ranks: usize,
        /// The limit.
        max: usize,
    },
    /// `num_experts` is 0.
    #[error("num_experts is 0: a group needs at least one expert per rank")]
    ZeroExperts,
    /// `num_experts` does not split evenly over the ranks.
    #[error(
        "num_experts ({num_experts}) is not divisible by the number of ranks ({num_ranks}): every rank must host the same number of experts"
    )]
    ExpertsNotDivisible {
        /// Experts asked for.
        num_experts: usize,
        /// Ranks in the group.
        num_ranks: usize,
    },
    /// `hidden` is 0.
    #[error("hidden is 0: tokens need at least one channel")]
    ZeroHidden,
    /// `hidden` is not a multiple of the vector width.
    #[error("hidden ({hidden}) is not a multiple of {align}: rows are moved in 16-byte vectors")]
    HiddenNotAligned {
        /// Hidden size asked for.
        hidden: usize,
        /// Required multiple.
        align: usize,
    },
    /// FP8 dispatch needs whole 128-channel scale blocks.
    #[error(
        "hidden ({hidden}) is not a multiple of {block}, which FP8 dispatch needs (one scale per {block} channels)"
    )]
    HiddenNotMultipleOfFp8Block {
        /// Hidden size asked for.
        hidden: usize,
        /// Channels per scale.
        block: usize,
    },
    /// The group's `dispatch_dtype` is [`crate::DispatchDtype::Forwarded`], which is per call.
    #[error("dispatch_dtype Forwarded is a per-call type (DispatchOptions::dtype) of a BF16 group, not a group's type")]
    ForwardedGroupDtype,
    /// `max_tokens_per_rank` is `Fixed(0)`.
    #[error("max_tokens_per_rank is 0: use a positive bound (or MaxTokens::Auto for high-throughput)")]
    ZeroMaxTokens,
    /// Low-latency needs a fixed bound to size its receive buffers.
    #[error("max_tokens_per_rank is Auto, but the low-latency algorithm needs a fixed bound to size its buffers")]
    LowLatencyNeedsFixedMaxTokens,
    /// `buffer_sets` is 0.
    #[error("buffer_sets is 0: at least one buffer set is needed")]
    ZeroBufferSets,
    /// Too many buffer sets.
    #[error("buffer_sets is {buffer_sets}, more than the supported {max}")]
    TooManyBufferSets {
        /// Buffer sets asked for.
        buffer_sets: usize,
        /// The limit.
        max: usize,
    },
    /// `max_top_k` outside `1..=limit`.
    #[error("max_top_k is {max_top_k}: it must be between 1 and {limit}")]
    BadMaxTopK {
        /// Asked for.
        max_top_k: usize,
        /// The limit.
        limit: usize,
    },
    /// `max_sms` is `Some(0)`.
    #[error("max_sms is 0: communication kernels need at least one SM (None lets them use all)")]
    ZeroMaxSms,
    /// A zero timeout would fail every operation.
    #[error("timeout is 0: every wait would fail at once")]
    ZeroTimeout,
    /// A timeout longer than [`crate::config::MAX_TIMEOUT`] (deadlines would overflow, and a
    /// wait that long is a hang).
    #[error("timeout is {timeout:?}, more than the supported {max:?}: every wait must end")]
    TimeoutTooLong {
        /// Asked for.
        timeout: Duration,
        /// The limit.
        max: Duration,
    },
    /// A size of the config is beyond what epflow supports (a dimension above its limit, or
    /// buffers larger than [`crate::config::MAX_GROUP_BYTES`] per rank).
    #[error("{what}: {detail}")]
    TooLarge {
        /// What is too large, e.g. `"hidden"` or `"buffers per rank"`.
        what: &'static str,
        /// The sizes involved (with the memory the config would need).
        detail: String,
    },
}

/// An operation's inputs or outputs do not match what the operation tables require.
/// `tensor` names the argument, e.g. `"dispatch input tokens"`.
#[derive(Clone, Debug, Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum ValidationError {
    /// Wrong number of dimensions.
    #[error("{tensor}: expected {expected} dimensions, got {got} (shape {shape:?})")]
    WrongNdim {
        /// Which argument.
        tensor: &'static str,
        /// Dimensions required.
        expected: usize,
        /// Dimensions passed.
        got: usize,
        /// The shape passed.
        shape: Vec<usize>,
    },
    /// Wrong element type.
    #[error("{tensor}: expected dtype {expected}, got {got}")]
    WrongDtype {
        /// Which argument.
        tensor: &'static str,
        /// Type required.
        expected: DType,
        /// Type passed.
        got: DType,
    },
    /// Wrong tensor tag.
    #[error("{tensor}: expected tag {expected:?}, got {got:?}")]
    WrongTag {
        /// Which argument.
        tensor: &'static str,
        /// Tag required.
        expected: TensorTag,
        /// Tag passed.
        got: TensorTag,
    },
    /// A dimension has the wrong size.
    #[error("{tensor}: dimension {dim} ({what}) must be {expected}, got {got}")]
    WrongDimSize {
        /// Which argument.
        tensor: &'static str,
        /// Index of the dimension.
        dim: usize,
        /// What the dimension means (`"hidden"`, `"top_k"`, ...).
        what: &'static str,
        /// Size required.
        expected: usize,
        /// Size passed.
        got: usize,
    },
    /// Two tensors disagree on the number of tokens.
    #[error("{tensor} has {got} token rows but {reference} has {expected}: they must describe the same tokens")]
    TokenCountMismatch {
        /// Which argument.
        tensor: &'static str,
        /// The argument it must agree with.
        reference: &'static str,
        /// Rows of the reference.
        expected: usize,
        /// Rows passed.
        got: usize,
    },
    /// A top-k index is outside `[-1, E)`.
    #[error("topk_idx[{token}][{k}] = {index} is outside [-1, {num_experts}): use -1 for \"no expert\"")]
    ExpertIndexOutOfRange {
        /// Token row.
        token: usize,
        /// Top-k slot.
        k: usize,
        /// The bad index.
        index: i64,
        /// Experts in the group.
        num_experts: usize,
    },
    /// One token names the same expert twice.
    #[error(
        "topk_idx[{token}] names expert {expert} twice (slots {first_k} and {second_k}): a token's experts must be distinct"
    )]
    DuplicateExpert {
        /// Token row.
        token: usize,
        /// The repeated expert.
        expert: usize,
        /// First slot naming it.
        first_k: usize,
        /// Second slot naming it.
        second_k: usize,
    },
    /// More tokens than the group's `max_tokens_per_rank`.
    #[error(
        "{tokens} tokens exceed max_tokens_per_rank ({max_tokens}) of this group: split the batch or raise the bound"
    )]
    TooManyTokens {
        /// Tokens passed.
        tokens: usize,
        /// The group's bound.
        max_tokens: usize,
    },
    /// `top_k` is 0.
    #[error("topk_idx has top_k = 0: every token needs at least one top-k slot")]
    ZeroTopK,
    /// `top_k` exceeds the group's `max_top_k`.
    #[error("top_k ({top_k}) exceeds the group's max_top_k ({max_top_k}): create the group with a larger max_top_k")]
    TopKExceedsGroupMax {
        /// Top-k passed.
        top_k: usize,
        /// The group's bound.
        max_top_k: usize,
    },
    /// `top_k` exceeds the number of experts.
    #[error("top_k ({top_k}) exceeds num_experts ({num_experts}): a token's experts must be distinct")]
    TopKExceedsExperts {
        /// Top-k passed.
        top_k: usize,
        /// Experts in the group.
        num_experts: usize,
    },
    /// Strides that are not row-major contiguous.
    #[error("{tensor}: strides {strides:?} are not row-major contiguous for shape {shape:?}")]
    NotContiguous {
        /// Which argument.
        tensor: &'static str,
        /// The shape.
        shape: Vec<usize>,
        /// The strides passed.
        strides: Vec<usize>,
    },
    /// The data does not hold as many elements as the descriptor says.
    #[error("{tensor}: holds {got} elements but its shape {shape:?} needs {expected}")]
    StorageSizeMismatch {
        /// Which argument.
        tensor: &'static str,
        /// The shape.
        shape: Vec<usize>,
        /// Elements the shape needs.
        expected: usize,
        /// Elements present.
        got: usize,
    },
    /// An argument the operation needs was not given.
    #[error("{tensor} is required here: {why}")]
    MissingTensor {
        /// Which argument.
        tensor: &'static str,
        /// Why it is needed.
        why: &'static str,
    },
    /// An argument was given that the operation does not take.
    #[error("{tensor} must not be given here: {why}")]
    UnexpectedTensor {
        /// Which argument.
        tensor: &'static str,
        /// Why it is not taken.
        why: &'static str,
    },
    /// A per-call dispatch type ([`crate::ops::DispatchOptions::dtype`]) the group cannot carry.
    #[error("dispatch dtype {asked}: {why}")]
    UnsupportedDispatchDtype {
        /// The type asked for (`bf16`, `fp8`).
        asked: &'static str,
        /// Why the group cannot carry it.
        why: &'static str,
    },
    /// A combine quantization ([`crate::ops::CombineOptions::quant`]) the group or the
    /// operation cannot carry.
    #[error("combine quant {asked}: {why}")]
    UnsupportedCombineQuant {
        /// The quantization asked for (`nvfp4`).
        asked: &'static str,
        /// Why it cannot be carried.
        why: &'static str,
    },
    /// An operation or option the group's algorithm does not support.
    #[error("{what} is not supported by the {algorithm} algorithm")]
    UnsupportedForAlgorithm {
        /// The operation or option.
        what: &'static str,
        /// `"low-latency"` or `"high-throughput"`.
        algorithm: &'static str,
    },
    /// [`crate::ops::RecvRows::Bound`] in a group without a fixed `max_tokens_per_rank`: there
    /// is no bound to size the received tensors by.
    #[error(
        "RecvRows::Bound sizes received tensors by R x max_tokens_per_rank, but this group's max_tokens_per_rank is Auto: create the group with a fixed max_tokens_per_rank, or use RecvRows::Exact"
    )]
    RecvRowsNeedFixedMaxTokens,
    /// The handle belongs to another group.
    #[error("the handle was created by group {handle_group} and cannot be used with group {group}")]
    ForeignHandle {
        /// Group id of the handle.
        handle_group: u64,
        /// Group id used.
        group: u64,
    },
    /// Combine was called on a handle with no completed dispatch (low-latency: no forward
    /// dispatch; high-throughput: none of either pass).
    #[error(
        "combine needs a completed dispatch on the same handle (it sends the expert outputs back along that dispatch's rows); call dispatch first"
    )]
    CombineBeforeDispatch,
    /// A low-latency combine would have sent its rows along a layout that a later dispatch on the
    /// same handle has since rewritten (GPU backends keep one row map per handle).
    #[error(
        "combine pairs with dispatch #{paired} on this handle, but dispatch #{rewritten_by} rewrote the handle's rows before the combine was sent: send a handle's combine before the next dispatch on it completes, or use a handle per micro-batch"
    )]
    HandleRewritten {
        /// The dispatch the combine pairs with.
        paired: u64,
        /// The later dispatch whose receive rewrote the handle's rows.
        rewritten_by: u64,
    },
}

impl ValidationError {
    /// The error of an invalid `topk_idx` entry found on a device (the host copy is never
    /// made): `topk_idx[token][k] = value`, a repeat of slot `earlier` when given (the value is
    /// then the repeated expert), else out of `[-1, num_experts)`.
    pub fn invalid_topk_entry(token: usize, k: usize, value: i64, earlier: Option<usize>, num_experts: usize) -> Self {
        match earlier {
            Some(first_k) => {
                ValidationError::DuplicateExpert { token, expert: value.max(0) as usize, first_k, second_k: k }
            }
            None => ValidationError::ExpertIndexOutOfRange { token, k, index: value, num_experts },
        }
    }
}

/// The runtime error of every epflow operation.
#[derive(Clone, Debug, Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum Error {
    /// The group config is invalid.
    #[error("invalid group config: {0}")]
    Config(#[from] ConfigError),
    /// The operation's arguments are invalid (nothing was sent).
    #[error("invalid arguments: {0}")]
    Validation(#[from] ValidationError),
    /// A wait ran past the group's timeout; the group is now poisoned.
    #[error("{op} on rank {rank} timed out after {after:?} waiting for {waiting_for}; the group is poisoned")]
    Timeout {
        /// The operation, e.g. `"dispatch #3"`.
        op: String,
        /// This rank.
        rank: usize,
        /// What it waited for, e.g. `"data from ranks [3]"`.
        waiting_for: String,
        /// How long it waited.
        after: Duration,
    },
    /// The group failed earlier; every later operation fails fast with the first reason.
    #[error("group poisoned: {reason}")]
    Poisoned {
        /// The first failure.
        reason: String,
    },
    /// A peer dropped its side of this collective before sending; the operation has no result.
    #[error("{op}: rank {peer} cancelled its side of this collective before sending, so there is no result")]
    PeerCancelled {
        /// The operation.
        op: String,
        /// The rank that cancelled.
        peer: usize,
    },
    /// Ranks called collectives in different orders.
    #[error("{op}: rank {peer} sent a {got} message; all ranks must call collectives in the same order")]
    OrderMismatch {
        /// This rank's operation.
        op: String,
        /// The peer.
        peer: usize,
        /// The kind of operation the peer ran.
        got: String,
    },
    /// The synchronous API found every buffer set of this kind still held by earlier outputs.
    #[error("all {buffer_sets} {channel} buffer sets hold results that are still alive: drop an earlier result first")]
    SlotsBusy {
        /// `"dispatch"` or `"combine"`.
        channel: &'static str,
        /// Buffer sets of the group.
        buffer_sets: usize,
    },
    /// A peer ran this collective with another top-k, pass, handle or paired dispatch (see
    /// [`crate::stamp`]). Nothing was exchanged: the data of that peer was skipped and every
    /// buffer released, so the group stays usable (on the GPU backend's high-throughput kernels,
    /// whose rings cannot skip a peer's rows, the group is poisoned as well).
    #[error(
        "{op}: rank {peer} called it with {theirs}, this rank with {ours}: all ranks must run each collective on matching handles and top-k"
    )]
    PeerMismatch {
        /// This rank's operation.
        op: String,
        /// The peer.
        peer: usize,
        /// This rank's side.
        ours: Stamp,
        /// The peer's side.
        theirs: Stamp,
    },
    /// An internal failure (a panic) while running an operation; the operation has no result
    /// and the group is poisoned. Please report it: no input should get here.
    #[error("internal error in {op}: {message}; the group is poisoned")]
    Internal {
        /// The operation.
        op: String,
        /// What failed.
        message: String,
    },
    /// The process's completion reactor thread is gone: no wait can be observed any more.
    #[error("the epflow reactor thread died ({reason}): no operation can complete; restart the process")]
    ReactorDied {
        /// Why, as far as known.
        reason: String,
    },
    /// An allocation larger than this machine's memory.
    #[error("{what} needs {} of host memory, more than this machine has ({})", human_bytes(*bytes), human_bytes(*available))]
    OutOfMemory {
        /// What was being allocated.
        what: String,
        /// Bytes asked for.
        bytes: u128,
        /// Physical memory plus swap.
        available: u128,
    },
    /// The group masked this rank (its peers stopped waiting for it: see [`crate::mask`]). It
    /// sends nothing and waits for nothing until every rank, this one included, has called
    /// `unmask_all`.
    #[error(
        "{op}: the group masked rank {rank} (a peer gave up waiting for it); call unmask_all on every rank to rejoin"
    )]
    RankMasked {
        /// The operation that was refused.
        op: String,
        /// This rank.
        rank: usize,
    },
    /// A combine whose handle's last dispatch ran before the group's last `unmask_all`: the
    /// ranks that rejoined do not hold that dispatch. Dispatch again on the handle.
    #[error(
        "{op}: the handle's last dispatch ran before the last unmask_all (mask epoch {dispatched}, now {now}); dispatch again before combining"
    )]
    StaleMaskEpoch {
        /// The combine.
        op: String,
        /// The mask epoch of the dispatch.
        dispatched: u64,
        /// The group's mask epoch now.
        now: u64,
    },
    /// A rank that is not in the group (or past what a [`crate::mask::RankSet`] holds): nothing
    /// was done.
    #[error("{op}: rank {rank} is out of range: the ranks are 0..{limit}")]
    RankOutOfRange {
        /// What was refused, e.g. `"mask"`.
        op: String,
        /// The rank asked for.
        rank: usize,
        /// The number of ranks of the group (or [`crate::config::MAX_RANKS`], what a
        /// [`crate::mask::RankSet`] holds).
        limit: usize,
    },
    /// A replacement for a rank was refused before anything changed ([`crate::mask`],
    /// "Rejoining"): the group goes on as it was.
    #[error("rejoin of rank {rank}: {why}")]
    RejoinRefused {
        /// The rank a replacement was asked for.
        rank: usize,
        /// Why not.
        why: RejoinRefusal,
    },
    /// This backend cannot do what was asked.
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// A failure inside the backend (driver, device, library).
    #[error("backend error: {0}")]
    Backend(String),
}

impl Error {
    /// Whether this error poisons the group (after it, every operation fails fast).
    pub fn poisons(&self) -> bool {
        matches!(
            self,
            Error::Timeout { .. }
                | Error::Backend(_)
                | Error::OrderMismatch { .. }
                | Error::Internal { .. }
                | Error::ReactorDied { .. }
        )
    }
}

/// Why a replacement for a rank was refused ([`Error::RejoinRefused`]).
#[derive(Clone, Debug, Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum RejoinRefusal {
    /// The group has no rank masking: a rank can neither be masked nor come back.
    #[error("the group has no rank masking (GroupConfig::with_rank_masking)")]
    MaskingOff,
    /// The rank's old process (host backend: its `HostRank`) still exists.
    #[error("the rank is still alive (its old rank has not been dropped)")]
    StillAlive,
    /// Operations of the rank's old process are still running (detached staged operations end
    /// by the group's timeout): try again after it.
    #[error("operations of the old rank are still finishing (they end within the group's timeout): try again")]
    OldOperationsRunning,
    /// Another replacement for the rank exists and has not finished joining or gone.
    #[error("another replacement for this rank is already joining")]
    AlreadyJoining,
    /// No survivor has the rank masked: a rank that only stopped calling comes back with
    /// `unmask_all`; a live one needs nothing.
    #[error("the group has not masked this rank")]
    NotMasked,
    /// The replacement's config is not the group's.
    #[error("the replacement's config differs from the group's: {0}")]
    ConfigMismatch(String),
}

/// `Result` with [`Error`](enum@Error).
pub type Result<T, E = Error> = std::result::Result<T, E>;

//! The arguments of each operation, generic over the tensor type of a backend
//! ([`HostTensor`] on the host backend, device tensors on the GPU).
//!
//! | algorithm | op | inputs | outputs |
//! |---|---|---|---|
//! | LL | dispatch | tokens `[B x H]` BF16 | tokens `[L x R*M x H]` (BF16, or FP8 + scales `[L x R*M x H/128]`), counts `[L]` |
//! | LL | combine | expert outputs `[L x R*M x H]` BF16, weights `[B x K]` | tokens `[B x H]` BF16 |
//! | LL rank-major | dispatch | tokens `[B x H]` BF16, weights `[B x K]` | tokens `[R*M x H]` (BF16, or FP8 + scales `[R*M x H/128]`), weights `[R*M x K]` fp32, local expert idx `[R*M x K]` int32, counts `[R]` |
//! | LL rank-major | combine | weighted expert sums `[R*M x H]` BF16 | tokens `[B x H]` BF16 |
//! | HT | dispatch (fwd) | tokens `[B x H]` (BF16, or FP8 + scales `[B x H/128]`), weights `[B x K]` | tokens `[N x H]` (+ scales `[N x H/128]`), weights `[N x K]`, idx `[N x K]`, counts `[L]` |
//! | HT | dispatch (bwd) | gradients `[B x H]` BF16 | `[N x H]` BF16 |
//! | HT | combine (fwd) | expert outputs `[N x H]` BF16 | `[B x H]` BF16 |
//! | HT | combine (bwd) | gradients `[N x H]` BF16, weight gradients `[N x K]` | `[B x H]` BF16, `[B x K]` |
//!
//! `topk_idx` is not an argument of dispatch: the handle holds it.

use crate::dtype::{CombineQuant, DispatchDtype};
use crate::tensor::{HostTensor, TensorDesc};

/// Forward or backward pass (high-throughput only; low-latency is forward only).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Pass {
    /// The forward pass.
    #[default]
    Forward,
    /// The backward pass: dispatch moves output gradients to the experts, combine brings input
    /// gradients (and top-k weight gradients) back.
    Backward,
}

/// How low-latency dispatch lays out what a rank receives (NCCL EP's `ncclEpLayout_t`), chosen
/// per handle ([`HandleOptions`]); every rank must use the same layout for the handles of one
/// collective (a disagreement fails with [`crate::Error::PeerMismatch`]).
///
/// | | expert-major (default) | rank-major |
/// |---|---|---|
/// | dispatch output | `[L x R*M x H]`: a row per (token, local expert) | `[R*M x H]`: a row per (source, token) with at least one local expert, rows of source `s` from `s*M` on, in token order |
/// | also | counts `[L]` | weights `[R*M x K]`, local expert per top-k entry `[R*M x K]` (`-1`: elsewhere), counts `[R]` |
/// | expert side | one output row per input row | one row per (source, token): `bf16(sum over local k ascending of fma(w_k, y_k, acc))` |
/// | combine input | `[L x R*M x H]` and the weights `[B x K]` | `[R*M x H]` only |
/// | combine sends | a row per (token, expert) | a row per (token, rank reached) |
///
/// Rank-major combine adds the rows of the ranks a token reached in fp32, in the order of each
/// rank's first top-k entry (NCCL EP's order), and rounds once to BF16. The per-rank partial sum is
/// rounded to BF16 on the expert side, so the result can differ from expert-major's single
/// rounding: [`crate::reference`] documents by how much.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Layout {
    /// A row per (token, local expert), grouped by expert.
    #[default]
    ExpertMajor,
    /// A row per (source rank, token), grouped by source; the expert side pre-reduces.
    RankMajor,
}

impl Layout {
    /// `"expert-major"` or `"rank-major"`.
    pub const fn name(self) -> &'static str {
        match self {
            Layout::ExpertMajor => "expert-major",
            Layout::RankMajor => "rank-major",
        }
    }
}

/// How many rows the received tensors of a high-throughput handle have: the dispatch outputs
/// (`[rows x H]` tokens, `[rows x K]` weights and indices, `[rows x H/128]` scales) and the
/// combine inputs (expert outputs, weight gradients).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum RecvRows {
    /// `N`, the rows this rank receives: handle creation must finish on the host before an
    /// operation on the handle can be started (its outputs are sized by `N`).
    #[default]
    Exact,
    /// The group's bound `R x max_tokens_per_rank` (a token reaches a rank at most once), so
    /// nothing waits for `N` on the host: a handle created in stream order is usable at once,
    /// and operations on it are enqueued behind its kernels on the device. Rows `N..` of a
    /// dispatch output are not written; rows `N..` of a combine input are not read. The cost is
    /// memory: at `R = 2`, `M = 4096`, `H = 7168` BF16 the token output is 117 MB instead of
    /// ~`N x 14 KB` (58.7 MB at uniform routing). Needs a fixed `max_tokens_per_rank`;
    /// high-throughput only (low-latency outputs are always sized by the bound).
    Bound,
}

/// Options of handle creation.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HandleOptions {
    /// The receive layout of low-latency operations on the handle (high-throughput handles are
    /// flat and refuse [`Layout::RankMajor`]).
    pub layout: Layout,
    /// High-throughput: the rows of the handle's received tensors ([`RecvRows`]).
    pub recv_rows: RecvRows,
}

impl HandleOptions {
    /// Options with `layout`.
    pub const fn with_layout(layout: Layout) -> Self {
        HandleOptions { layout, recv_rows: RecvRows::Exact }
    }

    /// These options with received tensors of `rows` rows (high-throughput, [`RecvRows`]).
    pub const fn with_recv_rows(mut self, rows: RecvRows) -> Self {
        self.recv_rows = rows;
        self
    }
}

/// Where the per-expert receive counters are written.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum CountsLocation {
    /// Device memory ([`crate::TensorTag::RecvExpertCountsDevice`]).
    #[default]
    Device,
    /// Host memory, pinned on GPU backends ([`crate::TensorTag::RecvExpertCountsHost`]).
    Host,
}

/// Anything with a tensor descriptor; `storage_len` is the number of elements actually
/// present when known (host tensors), so a short buffer is caught before use.
pub trait TensorView {
    /// The descriptor.
    fn desc(&self) -> &TensorDesc;
    /// Elements present, if known.
    fn storage_len(&self) -> Option<usize>;
}

impl TensorView for TensorDesc {
    fn desc(&self) -> &TensorDesc {
        self
    }
    fn storage_len(&self) -> Option<usize> {
        None
    }
}

impl TensorView for HostTensor {
    fn desc(&self) -> &TensorDesc {
        HostTensor::desc(self)
    }
    fn storage_len(&self) -> Option<usize> {
        Some(self.data().len())
    }
}

/// Inputs of dispatch.
#[derive(Debug)]
pub struct DispatchInputs<'a, T: ?Sized = HostTensor> {
    /// Tokens `[B x H]`.
    pub tokens: &'a T,
    /// Top-k weights `[B x K]` (high-throughput forward, low-latency rank-major).
    pub topk_weights: Option<&'a T>,
    /// FP8 scales `[B x H/128]` (high-throughput FP8 forward only).
    pub scales: Option<&'a T>,
}

impl<T: ?Sized> Clone for DispatchInputs<'_, T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T: ?Sized> Copy for DispatchInputs<'_, T> {}

impl<'a, T: ?Sized> DispatchInputs<'a, T> {
    /// Tokens only (low-latency, high-throughput backward).
    pub fn new(tokens: &'a T) -> Self {
        DispatchInputs { tokens, topk_weights: None, scales: None }
    }

    /// Adds top-k weights.
    pub fn with_weights(mut self, topk_weights: &'a T) -> Self {
        self.topk_weights = Some(topk_weights);
        self
    }

    /// Adds FP8 scales.
    pub fn with_scales(mut self, scales: &'a T) -> Self {
        self.scales = Some(scales);
        self
    }
}

/// Options of dispatch.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DispatchOptions {
    /// Forward or backward.
    pub pass: Pass,
    /// Where the counters go.
    pub counts_location: CountsLocation,
    /// The type this call's tokens travel in; `None`: the group's
    /// ([`crate::GroupConfig::dispatch_dtype`]). A low-latency group of BF16 may ask for
    /// [`DispatchDtype::Fp8`] per call: BF16 tokens in, FP8 e4m3 rows with one fp32 scale per 128
    /// channels out, exactly as an FP8 group's dispatch (NCCL EP API v2's
    /// `NCCL_EP_DISP_QUANT_DS_FP8E3M4`); `hidden` must be a multiple of 128. Every rank passes the
    /// same for one operation (it shapes the messages). An FP8 group cannot dispatch BF16 (its
    /// buffers hold FP8 messages), and high-throughput groups take their group's type. On GPUs a
    /// BF16 group's per-call FP8 dispatch writes into the caller's tensors (`start_dispatch_into`
    /// with scales): the group's own buffers hold no scales.
    pub dtype: Option<DispatchDtype>,
}

impl DispatchOptions {
    /// The type this dispatch's tokens travel in, in a group whose type is `group`
    /// ([`crate::GroupConfig::dispatch_dtype`]): [`Self::dtype`], else the group's; BF16 for the
    /// backward pass.
    pub fn dtype_in(&self, group: DispatchDtype) -> DispatchDtype {
        match self.pass {
            Pass::Backward => DispatchDtype::Bf16,
            Pass::Forward => self.dtype.unwrap_or(group),
        }
    }
}

/// Inputs of combine.
#[derive(Debug)]
pub struct CombineInputs<'a, T: ?Sized = HostTensor> {
    /// Expert outputs (`[L x R*M x H]` LL expert-major, `[R*M x H]` LL rank-major, `[N x H]` HT).
    pub tokens: &'a T,
    /// LL expert-major: the top-k weights `[B x K]` to apply; HT backward: weight gradients
    /// `[N x K]`; none otherwise.
    pub topk_weights: Option<&'a T>,
    /// With [`CombineQuant::Nvfp4`]: each expert output row's fp32 global scale, the tokens'
    /// shape with a last dimension of 1 (`[L x R*M x 1]` LL expert-major, `[R*M x 1]` LL
    /// rank-major); `2688 / amax(|row|)`, 0 for an all-zero row ([`crate::nvfp4::global_scale`]).
    /// None otherwise.
    pub global_scales: Option<&'a T>,
}

impl<T: ?Sized> Clone for CombineInputs<'_, T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T: ?Sized> Copy for CombineInputs<'_, T> {}

impl<'a, T: ?Sized> CombineInputs<'a, T> {
    /// Expert outputs only (high-throughput forward).
    pub fn new(tokens: &'a T) -> Self {
        CombineInputs { tokens, topk_weights: None, global_scales: None }
    }

    /// Adds top-k weights.
    pub fn with_weights(mut self, topk_weights: &'a T) -> Self {
        self.topk_weights = Some(topk_weights);
        self
    }

    /// Adds the rows' NVFP4 global scales ([`CombineInputs::global_scales`]).
    pub fn with_global_scales(mut self, global_scales: &'a T) -> Self {
        self.global_scales = Some(global_scales);
        self
    }
}

/// Options of combine.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CombineOptions {
    /// Forward or backward.
    pub pass: Pass,
    /// How the expert outputs travel: BF16 (the default) or NVFP4 (low-latency forward only).
    pub quant: CombineQuant,
}

/// The outputs of dispatch, as descriptors or tensors.
#[derive(Clone, Debug, PartialEq)]
pub struct DispatchOutputs<T> {
    /// Received tokens.
    pub tokens: T,
    /// FP8 scales (FP8 dispatch only).
    pub scales: Option<T>,
    /// Received top-k weights (HT forward `[N x K]`, LL rank-major `[R*M x K]`).
    pub topk_weights: Option<T>,
    /// Received top-k indices as local expert indices, `-1` where not local (HT forward
    /// `[N x K]` int64, LL rank-major `[R*M x K]` int32).
    pub topk_idx: Option<T>,
    /// Receive counters: per local expert `[L]` (LL expert-major; HT forward), per source rank
    /// `[R]` (LL rank-major).
    pub counts: Option<T>,
}

/// The outputs of combine, as descriptors or tensors.
#[derive(Clone, Debug, PartialEq)]
pub struct CombineOutputs<T> {
    /// Tokens `[B x H]` in the original order.
    pub tokens: T,
    /// Top-k weight gradients `[B x K]` (HT backward).
    pub topk_weights: Option<T>,
    /// Groups with rank masking ([`crate::GroupConfig::rank_masking`]): per token, the number
    /// of its top-k entries whose expert lives on a masked rank and so contributed zero, `[B]`
    /// int32 ([`crate::mask`]). `None` otherwise (and when a caller's own outputs leave it out).
    pub masked: Option<T>,
}

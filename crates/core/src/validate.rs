//! Checks of every operation's inputs and outputs against the operation tables in [`crate::ops`].
//!
//! Checks run in a fixed order per tensor (tag, dtype, number of dimensions, contiguity, each
//! dimension, storage size), so one bad argument always yields the same error variant.

use crate::config::{Algorithm, GroupConfig, MaxTokens};
use crate::dtype::{CombineQuant, DType, DispatchDtype};
use crate::error::ValidationError;
use crate::handle::RoutingHandle;
use crate::ops::{
    CombineInputs, CombineOptions, CombineOutputs, CountsLocation, DispatchInputs, DispatchOptions, DispatchOutputs,
    Layout, Pass, RecvRows, TensorView,
};
use crate::routing::Routing;
use crate::tensor::{TensorDesc, TensorTag};

/// The sizes an operation is checked against.
#[derive(Clone, Copy, Debug)]
pub struct OpContext<'a> {
    /// The group config.
    pub config: &'a GroupConfig,
    /// `R`.
    pub num_ranks: usize,
    /// `B`, tokens this rank routed (rows of the handle's `topk_idx`).
    pub num_tokens: usize,
    /// `K`.
    pub top_k: usize,
    /// High-throughput: the rows of received tensors, `N` or the bound of a
    /// [`crate::ops::RecvRows::Bound`] handle ([`RoutingHandle::recv_rows`]).
    pub num_recv: usize,
    /// The handle's low-latency receive layout.
    pub layout: Layout,
}

impl<'a> OpContext<'a> {
    /// The context of an operation on `handle` in a group of `num_ranks` with `config`.
    pub fn new(config: &'a GroupConfig, num_ranks: usize, handle: &impl RoutingHandle) -> Self {
        OpContext {
            config,
            num_ranks,
            num_tokens: handle.core().num_tokens(),
            top_k: handle.core().top_k(),
            num_recv: handle.recv_rows().unwrap_or(0),
            layout: handle.core().layout(),
        }
    }
}

impl OpContext<'_> {
    fn local_experts(&self) -> usize {
        self.config.local_experts(self.num_ranks)
    }

    /// `R * M` (low-latency rows per expert).
    fn ll_rows(&self) -> usize {
        self.num_ranks * self.config.fixed_max_tokens().unwrap_or(0)
    }

    fn algorithm_name(&self) -> &'static str {
        algorithm_name(self.config.algorithm)
    }
}

fn algorithm_name(a: Algorithm) -> &'static str {
    match a {
        Algorithm::LowLatency => "low-latency",
        Algorithm::HighThroughput => "high-throughput",
    }
}

/// Checks one tensor: tag, dtype, dimensions (`(size, meaning)` each), contiguity, storage.
pub fn check_tensor(
    name: &'static str,
    t: &(impl TensorView + ?Sized),
    tag: TensorTag,
    dtype: DType,
    dims: &[(usize, &'static str)],
) -> Result<(), ValidationError> {
    let d = t.desc();
    if d.tag != tag {
        return Err(ValidationError::WrongTag { tensor: name, expected: tag, got: d.tag });
    }
    if d.dtype != dtype {
        return Err(ValidationError::WrongDtype { tensor: name, expected: dtype, got: d.dtype });
    }
    if d.shape.len() != dims.len() {
        return Err(ValidationError::WrongNdim {
            tensor: name,
            expected: dims.len(),
            got: d.shape.len(),
            shape: d.shape.clone(),
        });
    }
    if !d.is_contiguous() {
        return Err(ValidationError::NotContiguous {
            tensor: name,
            shape: d.shape.clone(),
            strides: d.strides.clone(),
        });
    }
    for (dim, (&got, &(expected, what))) in d.shape.iter().zip(dims).enumerate() {
        if got != expected {
            return Err(ValidationError::WrongDimSize { tensor: name, dim, what, expected, got });
        }
    }
    check_storage(name, t)
}

fn check_storage(name: &'static str, t: &(impl TensorView + ?Sized)) -> Result<(), ValidationError> {
    let d = t.desc();
    match t.storage_len() {
        Some(got) if got != d.numel() => {
            Err(ValidationError::StorageSizeMismatch { tensor: name, shape: d.shape.clone(), expected: d.numel(), got })
        }
        _ => Ok(()),
    }
}

/// Checks a token-row tensor whose row count must agree with `reference`: rows first (as a
/// [`ValidationError::TokenCountMismatch`]), then the rest.
fn check_rows(
    name: &'static str,
    t: &(impl TensorView + ?Sized),
    tag: TensorTag,
    dtype: DType,
    rows: (usize, &'static str),
    cols: (usize, &'static str),
) -> Result<(), ValidationError> {
    let d = t.desc();
    if d.tag == tag && d.dtype == dtype && d.shape.len() == 2 && d.shape[0] != rows.0 {
        return Err(ValidationError::TokenCountMismatch {
            tensor: name,
            reference: rows.1,
            expected: rows.0,
            got: d.shape[0],
        });
    }
    check_tensor(name, t, tag, dtype, &[(rows.0, "tokens"), cols])
}

/// Checks a `topk_idx` tensor's descriptor (tag, dtype, shape, contiguity, storage, the group's
/// token and top-k bounds) without reading its values; returns `(B, K)`.
pub fn check_topk_idx(config: &GroupConfig, t: &(impl TensorView + ?Sized)) -> Result<(usize, usize), ValidationError> {
    const NAME: &str = "topk_idx";
    let d = t.desc();
    if d.tag != TensorTag::TopkIdx {
        return Err(ValidationError::WrongTag { tensor: NAME, expected: TensorTag::TopkIdx, got: d.tag });
    }
    if d.dtype != DType::I64 {
        return Err(ValidationError::WrongDtype { tensor: NAME, expected: DType::I64, got: d.dtype });
    }
    if d.shape.len() != 2 {
        return Err(ValidationError::WrongNdim {
            tensor: NAME,
            expected: 2,
            got: d.shape.len(),
            shape: d.shape.clone(),
        });
    }
    if !d.is_contiguous() {
        return Err(ValidationError::NotContiguous {
            tensor: NAME,
            shape: d.shape.clone(),
            strides: d.strides.clone(),
        });
    }
    check_storage(NAME, t)?;
    let (num_tokens, top_k) = (d.shape[0], d.shape[1]);
    if let MaxTokens::Fixed(max_tokens) = config.max_tokens_per_rank {
        if num_tokens > max_tokens {
            return Err(ValidationError::TooManyTokens { tokens: num_tokens, max_tokens });
        }
    }
    if top_k > config.max_top_k && top_k <= config.num_experts {
        return Err(ValidationError::TopKExceedsGroupMax { top_k, max_top_k: config.max_top_k });
    }
    Ok((num_tokens, top_k))
}

/// Checks a `topk_idx` tensor and its values; returns the validated routing.
///
/// Errors: those of [`check_topk_idx`], then the value errors of [`Routing::new`].
pub fn routing_from_tensor(
    config: &GroupConfig,
    t: &(impl TensorView + ?Sized),
    values: &[i64],
) -> Result<Routing, ValidationError> {
    routing_from_values(config, t, values.to_vec())
}

/// [`routing_from_tensor`] for values the caller owns (copied out of device memory): the routing
/// keeps them, with no copy. Errors: as [`routing_from_tensor`].
pub fn routing_from_values(
    config: &GroupConfig,
    t: &(impl TensorView + ?Sized),
    values: Vec<i64>,
) -> Result<Routing, ValidationError> {
    let (num_tokens, top_k) = check_topk_idx(config, t)?;
    if values.len() != num_tokens * top_k {
        return Err(ValidationError::StorageSizeMismatch {
            tensor: "topk_idx",
            shape: t.desc().shape.clone(),
            expected: num_tokens * top_k,
            got: values.len(),
        });
    }
    Routing::new(values, num_tokens, top_k, config.num_experts)
}

/// Dispatch inputs that passed validation, by what the operation does with them: a backend
/// matches on these instead of re-reading the optional fields of [`DispatchInputs`].
#[derive(Debug)]
pub enum ValidDispatch<'a, T: ?Sized> {
    /// Low-latency: BF16 tokens `[B x H]` (a forwarded dispatch: bytes `[B x token_bytes]`
    /// with their scale rows), and (rank-major) the top-k weights `[B x K]` that travel with
    /// them.
    LowLatency {
        /// Tokens.
        tokens: &'a T,
        /// Top-k weights (rank-major only).
        weights: Option<&'a T>,
        /// A forwarded dispatch's scale rows `[B x scale_bytes]` ([`DispatchDtype::Forwarded`]).
        scales: Option<&'a T>,
    },
    /// High-throughput forward: tokens `[B x H]` (BF16, or FP8 with their `[B x H/128]`
    /// scales; a forwarded dispatch: bytes `[B x token_bytes]` with their `[B x scale_bytes]`
    /// scale rows) and top-k weights `[B x K]`.
    Forward {
        /// Tokens.
        tokens: &'a T,
        /// Top-k weights.
        weights: &'a T,
        /// FP8 scales (FP8 groups), or a forwarded dispatch's scale rows.
        scales: Option<&'a T>,
    },
    /// High-throughput backward: gradients `[B x H]` BF16.
    Backward {
        /// Gradients.
        tokens: &'a T,
    },
}

impl<T: ?Sized> Clone for ValidDispatch<'_, T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T: ?Sized> Copy for ValidDispatch<'_, T> {}

impl<'a, T: ?Sized> ValidDispatch<'a, T> {
    /// The tokens (or gradients).
    pub fn tokens(&self) -> &'a T {
        match *self {
            ValidDispatch::LowLatency { tokens, .. }
            | ValidDispatch::Forward { tokens, .. }
            | ValidDispatch::Backward { tokens } => tokens,
        }
    }

    /// The scales that travel with the tokens (high-throughput FP8 forward, a low-latency
    /// forwarded dispatch).
    pub fn scales(&self) -> Option<&'a T> {
        match *self {
            ValidDispatch::Forward { scales, .. } | ValidDispatch::LowLatency { scales, .. } => scales,
            ValidDispatch::Backward { .. } => None,
        }
    }

    /// The top-k weights that travel with the tokens (high-throughput forward, low-latency
    /// rank-major).
    pub fn weights(&self) -> Option<&'a T> {
        match *self {
            ValidDispatch::Forward { weights, .. } => Some(weights),
            ValidDispatch::LowLatency { weights, .. } => weights,
            ValidDispatch::Backward { .. } => None,
        }
    }

    /// Every input tensor (what the operation reads).
    pub fn tensors(&self) -> Vec<&'a T> {
        match *self {
            ValidDispatch::Forward { tokens, weights, scales } => {
                [Some(tokens), Some(weights), scales].into_iter().flatten().collect()
            }
            ValidDispatch::LowLatency { tokens, weights, scales } => {
                [Some(tokens), weights, scales].into_iter().flatten().collect()
            }
            ValidDispatch::Backward { tokens } => vec![tokens],
        }
    }
}

/// Combine inputs that passed validation, by what the operation does with them.
#[derive(Debug)]
pub enum ValidCombine<'a, T: ?Sized> {
    /// Low-latency expert-major: expert outputs `[L x R*M x H]` and the top-k weights `[B x K]`
    /// applied as they arrive; rank-major: pre-reduced rows `[R*M x H]` and no weights.
    LowLatency {
        /// Expert outputs.
        expert_out: &'a T,
        /// Top-k weights (expert-major only).
        weights: Option<&'a T>,
        /// NVFP4 combine ([`CombineQuant::Nvfp4`]): the rows' global scales, the tokens'
        /// shape with a last dimension of 1.
        global_scales: Option<&'a T>,
    },
    /// High-throughput forward: pre-weighted expert outputs `[N x H]`.
    Forward {
        /// Expert outputs.
        expert_out: &'a T,
    },
    /// High-throughput backward: gradients `[N x H]` and weight gradients `[N x K]`.
    Backward {
        /// Gradients.
        grads: &'a T,
        /// Top-k weight gradients.
        weight_grads: &'a T,
    },
}

impl<T: ?Sized> Clone for ValidCombine<'_, T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T: ?Sized> Copy for ValidCombine<'_, T> {}

impl<'a, T: ?Sized> ValidCombine<'a, T> {
    /// The expert outputs (or gradients).
    pub fn tokens(&self) -> &'a T {
        match *self {
            ValidCombine::LowLatency { expert_out, .. } | ValidCombine::Forward { expert_out } => expert_out,
            ValidCombine::Backward { grads, .. } => grads,
        }
    }

    /// The weights that travel with the rows: low-latency top-k weights, backward weight
    /// gradients.
    pub fn weights(&self) -> Option<&'a T> {
        match *self {
            ValidCombine::LowLatency { weights, .. } => weights,
            ValidCombine::Backward { weight_grads, .. } => Some(weight_grads),
            ValidCombine::Forward { .. } => None,
        }
    }

    /// The NVFP4 global scales of a low-latency combine that travels as NVFP4.
    pub fn global_scales(&self) -> Option<&'a T> {
        match *self {
            ValidCombine::LowLatency { global_scales, .. } => global_scales,
            _ => None,
        }
    }

    /// Every input tensor (what the operation reads).
    pub fn tensors(&self) -> Vec<&'a T> {
        [Some(self.tokens()), self.weights(), self.global_scales()].into_iter().flatten().collect()
    }
}

/// Checks the inputs of dispatch; returns them as a [`ValidDispatch`].
pub fn validate_dispatch_inputs<'a, T: TensorView + ?Sized>(
    ctx: &OpContext<'_>,
    opts: &DispatchOptions,
    inputs: &DispatchInputs<'a, T>,
) -> Result<ValidDispatch<'a, T>, ValidationError> {
    let h = ctx.config.hidden;
    let b = ctx.num_tokens;
    const TOKENS: &str = "dispatch input tokens";
    const WEIGHTS: &str = "dispatch input topk_weights";
    const SCALES: &str = "dispatch input scales";
    check_dispatch_dtype(ctx, opts)?;
    match (ctx.config.algorithm, opts.pass) {
        (Algorithm::LowLatency, Pass::Backward) => {
            Err(ValidationError::UnsupportedForAlgorithm { what: "the backward pass", algorithm: ctx.algorithm_name() })
        }
        (Algorithm::LowLatency, Pass::Forward) => {
            match (opts.dtype.and_then(DispatchDtype::forwarded), inputs.scales) {
                (Some(rows), _) => {
                    forwarded_rows(inputs, b, rows)?;
                }
                (None, Some(_)) => {
                    return Err(ValidationError::UnexpectedTensor {
                        tensor: SCALES,
                        why: "low-latency dispatch takes BF16 tokens and quantizes them itself (or forwards rows: DispatchDtype::Forwarded)",
                    });
                }
                (None, None) => {
                    check_rows(TOKENS, inputs.tokens, TensorTag::Tokens, DType::Bf16, (b, "topk_idx"), (h, "hidden"))?
                }
            }
            let weights = match (ctx.layout, inputs.topk_weights) {
                (Layout::ExpertMajor, Some(_)) => {
                    return Err(ValidationError::UnexpectedTensor {
                        tensor: WEIGHTS,
                        why: "expert-major low-latency dispatch takes the weights at combine",
                    });
                }
                (Layout::ExpertMajor, None) => None,
                (Layout::RankMajor, None) => {
                    return Err(ValidationError::MissingTensor {
                        tensor: WEIGHTS,
                        why: "rank-major dispatch sends each token's weights to the expert side, which applies them",
                    });
                }
                (Layout::RankMajor, Some(w)) => {
                    check_rows(WEIGHTS, w, TensorTag::TopkWeights, DType::F32, (b, "topk_idx"), (ctx.top_k, "top_k"))?;
                    Some(w)
                }
            };
            Ok(ValidDispatch::LowLatency { tokens: inputs.tokens, weights, scales: inputs.scales })
        }
        (Algorithm::HighThroughput, Pass::Forward) => {
            let weights = inputs.topk_weights.ok_or(ValidationError::MissingTensor {
                tensor: WEIGHTS,
                why: "high-throughput forward dispatch sends each token's weights with it",
            })?;
            if let Some(rows) = opts.dtype.and_then(DispatchDtype::forwarded) {
                let s = forwarded_rows(inputs, b, rows)?;
                check_rows(
                    WEIGHTS,
                    weights,
                    TensorTag::TopkWeights,
                    DType::F32,
                    (b, "topk_idx"),
                    (ctx.top_k, "top_k"),
                )?;
                return Ok(ValidDispatch::Forward { tokens: inputs.tokens, weights, scales: Some(s) });
            }
            let fp8 = ctx.config.dispatch_dtype.is_fp8();
            let dtype = if fp8 { DType::Fp8E4m3 } else { DType::Bf16 };
            check_rows(TOKENS, inputs.tokens, TensorTag::Tokens, dtype, (b, "topk_idx"), (h, "hidden"))?;
            check_rows(WEIGHTS, weights, TensorTag::TopkWeights, DType::F32, (b, "topk_idx"), (ctx.top_k, "top_k"))?;
            match (fp8, inputs.scales) {
                (true, None) => Err(ValidationError::MissingTensor {
                    tensor: SCALES,
                    why: "FP8 high-throughput dispatch takes quantized tokens with their per-128 scales",
                }),
                (true, Some(s)) => {
                    check_rows(SCALES, s, TensorTag::Scales, DType::F32, (b, "topk_idx"), (h / 128, "hidden/128"))?;
                    Ok(ValidDispatch::Forward { tokens: inputs.tokens, weights, scales: Some(s) })
                }
                (false, Some(_)) => Err(ValidationError::UnexpectedTensor {
                    tensor: SCALES,
                    why: "the group dispatches BF16; scales belong to FP8 groups",
                }),
                (false, None) => Ok(ValidDispatch::Forward { tokens: inputs.tokens, weights, scales: None }),
            }
        }
        (Algorithm::HighThroughput, Pass::Backward) => {
            if inputs.topk_weights.is_some() {
                return Err(ValidationError::UnexpectedTensor {
                    tensor: WEIGHTS,
                    why: "backward dispatch moves gradients only; weight gradients come back through backward combine",
                });
            }
            if inputs.scales.is_some() {
                return Err(ValidationError::UnexpectedTensor { tensor: SCALES, why: "backward dispatch is BF16" });
            }
            check_rows(TOKENS, inputs.tokens, TensorTag::Tokens, DType::Bf16, (b, "topk_idx"), (h, "hidden"))?;
            Ok(ValidDispatch::Backward { tokens: inputs.tokens })
        }
    }
}

/// A forwarded dispatch's `b` token rows (`[b x token_bytes]` bytes) and scale rows (`[b x
/// scale_bytes]`, required), checked; returns the scales.
fn forwarded_rows<'a, T: TensorView + ?Sized>(
    inputs: &DispatchInputs<'a, T>,
    b: usize,
    (token_bytes, scale_bytes): (usize, usize),
) -> Result<&'a T, ValidationError> {
    const TOKENS: &str = "dispatch input tokens";
    const SCALES: &str = "dispatch input scales";
    let s = inputs.scales.ok_or(ValidationError::MissingTensor {
        tensor: SCALES,
        why: "a forwarded dispatch carries each token's scale row beside its payload",
    })?;
    check_rows(TOKENS, inputs.tokens, TensorTag::Tokens, DType::U8, (b, "topk_idx"), (token_bytes, "token_bytes"))?;
    check_rows(SCALES, s, TensorTag::Scales, DType::U8, (b, "topk_idx"), (scale_bytes, "scale_bytes"))?;
    Ok(s)
}

/// Refuses a per-call dispatch type ([`DispatchOptions::dtype`]) the group cannot carry: only a
/// low-latency BF16 group's forward dispatch may ask for FP8 (with `hidden` a multiple of 128);
/// asking for the type the group's pass has anyway is always accepted.
fn check_dispatch_dtype(ctx: &OpContext<'_>, opts: &DispatchOptions) -> Result<(), ValidationError> {
    let c = ctx.config;
    let Some(asked) = opts.dtype else { return Ok(()) };
    let name = match asked {
        DispatchDtype::Bf16 => "bf16",
        DispatchDtype::Fp8 { .. } => "fp8",
        DispatchDtype::Forwarded { .. } => "forwarded",
    };
    let refuse = |why| Err(ValidationError::UnsupportedDispatchDtype { asked: name, why });
    // The group's own type for this pass (the backward pass is BF16 in every group).
    let own = if opts.pass == Pass::Backward { DispatchDtype::Bf16 } else { c.dispatch_dtype };
    if let Some((token_bytes, scale_bytes)) = asked.forwarded() {
        return if opts.pass != Pass::Forward {
            refuse("only forward dispatch forwards rows (the backward pass moves BF16 gradients)")
        } else if own.is_fp8() {
            refuse("an FP8 group's messages hold FP8 rows; forward rows in a BF16 group")
        } else if token_bytes == 0 || scale_bytes == 0 || token_bytes % 16 != 0 || scale_bytes % 16 != 0 {
            refuse("token_bytes and scale_bytes must be positive multiples of 16 (rows move in 16-byte vectors)")
        } else if token_bytes.saturating_add(scale_bytes) > 2 * c.hidden {
            refuse("token_bytes + scale_bytes must fit the group's BF16 row, 2 x hidden bytes")
        } else {
            Ok(())
        };
    }
    match (asked.is_fp8(), own.is_fp8()) {
        (true, true) | (false, false) => Ok(()),
        (false, true) => refuse("an FP8 group's buffers hold FP8 messages; create a BF16 group to dispatch BF16"),
        (true, false) if c.algorithm != Algorithm::LowLatency || opts.pass != Pass::Forward => refuse(
            "only low-latency forward dispatch quantizes per call; high-throughput groups dispatch their group's type",
        ),
        (true, false) if c.hidden % crate::config::FP8_BLOCK != 0 => {
            refuse("FP8 rows carry one scale per 128 channels: hidden must be a multiple of 128")
        }
        (true, false) => Ok(()),
    }
}

/// The descriptors dispatch produces.
pub fn dispatch_output_descs(ctx: &OpContext<'_>, opts: &DispatchOptions) -> DispatchOutputs<TensorDesc> {
    let c = ctx.config;
    let (h, l, k) = (c.hidden, ctx.local_experts(), ctx.top_k);
    let counts_tag = match opts.counts_location {
        CountsLocation::Device => TensorTag::RecvExpertCountsDevice,
        CountsLocation::Host => TensorTag::RecvExpertCountsHost,
    };
    let counts = Some(TensorDesc::contiguous(counts_tag, DType::I32, &[l]));
    let fp8 = opts.dtype_in(c.dispatch_dtype).is_fp8();
    let token_dtype = if fp8 { DType::Fp8E4m3 } else { DType::Bf16 };
    let forwarded = if opts.pass == Pass::Forward { opts.dtype.and_then(DispatchDtype::forwarded) } else { None };
    match (c.algorithm, opts.pass) {
        (Algorithm::LowLatency, _) if forwarded.is_some() => {
            let (tb, sb) = forwarded.unwrap_or_default();
            let rows = ctx.ll_rows();
            let rm = ctx.layout == Layout::RankMajor;
            let shape = |w: usize| if rm { vec![rows, w] } else { vec![l, rows, w] };
            DispatchOutputs {
                tokens: TensorDesc::contiguous(TensorTag::Tokens, DType::U8, &shape(tb)),
                scales: Some(TensorDesc::contiguous(TensorTag::Scales, DType::U8, &shape(sb))),
                topk_weights: rm.then(|| TensorDesc::contiguous(TensorTag::TopkWeights, DType::F32, &[rows, k])),
                topk_idx: rm.then(|| TensorDesc::contiguous(TensorTag::TopkIdx, DType::I32, &[rows, k])),
                counts: if rm {
                    Some(TensorDesc::contiguous(counts_tag, DType::I32, &[ctx.num_ranks]))
                } else {
                    counts
                },
            }
        }
        (Algorithm::LowLatency, _) if ctx.layout == Layout::RankMajor => {
            let rows = ctx.ll_rows();
            DispatchOutputs {
                tokens: TensorDesc::contiguous(TensorTag::Tokens, token_dtype, &[rows, h]),
                scales: fp8.then(|| TensorDesc::contiguous(TensorTag::Scales, DType::F32, &[rows, h / 128])),
                topk_weights: Some(TensorDesc::contiguous(TensorTag::TopkWeights, DType::F32, &[rows, k])),
                topk_idx: Some(TensorDesc::contiguous(TensorTag::TopkIdx, DType::I32, &[rows, k])),
                counts: Some(TensorDesc::contiguous(counts_tag, DType::I32, &[ctx.num_ranks])),
            }
        }
        (Algorithm::LowLatency, _) => {
            let rows = ctx.ll_rows();
            DispatchOutputs {
                tokens: TensorDesc::contiguous(TensorTag::Tokens, token_dtype, &[l, rows, h]),
                scales: fp8.then(|| TensorDesc::contiguous(TensorTag::Scales, DType::F32, &[l, rows, h / 128])),
                topk_weights: None,
                topk_idx: None,
                counts,
            }
        }
        (Algorithm::HighThroughput, Pass::Forward) => {
            let n = ctx.num_recv;
            let (tokens, scales) = match forwarded {
                Some((tb, sb)) => (
                    TensorDesc::contiguous(TensorTag::Tokens, DType::U8, &[n, tb]),
                    Some(TensorDesc::contiguous(TensorTag::Scales, DType::U8, &[n, sb])),
                ),
                None => (
                    TensorDesc::contiguous(TensorTag::Tokens, token_dtype, &[n, h]),
                    fp8.then(|| TensorDesc::contiguous(TensorTag::Scales, DType::F32, &[n, h / 128])),
                ),
            };
            DispatchOutputs {
                tokens,
                scales,
                topk_weights: Some(TensorDesc::contiguous(TensorTag::TopkWeights, DType::F32, &[n, k])),
                topk_idx: Some(TensorDesc::contiguous(TensorTag::TopkIdx, DType::I64, &[n, k])),
                counts,
            }
        }
        (Algorithm::HighThroughput, Pass::Backward) => DispatchOutputs {
            tokens: TensorDesc::contiguous(TensorTag::Tokens, DType::Bf16, &[ctx.num_recv, h]),
            scales: None,
            topk_weights: None,
            topk_idx: None,
            counts: None,
        },
    }
}

fn check_against(
    name: &'static str,
    t: Option<&(impl TensorView + ?Sized)>,
    want: Option<&TensorDesc>,
    why_missing: &'static str,
    why_unexpected: &'static str,
) -> Result<(), ValidationError> {
    match (t, want) {
        (None, None) => Ok(()),
        (Some(_), None) => Err(ValidationError::UnexpectedTensor { tensor: name, why: why_unexpected }),
        (None, Some(_)) => Err(ValidationError::MissingTensor { tensor: name, why: why_missing }),
        (Some(t), Some(w)) => {
            let what: Vec<(usize, &'static str)> = w.shape.iter().map(|&n| (n, "size")).collect();
            check_tensor(name, t, w.tag, w.dtype, &what)
        }
    }
}

/// Checks caller-provided dispatch outputs against [`dispatch_output_descs`].
pub fn validate_dispatch_outputs<T: TensorView>(
    ctx: &OpContext<'_>,
    opts: &DispatchOptions,
    outputs: &DispatchOutputs<T>,
) -> Result<(), ValidationError> {
    let want = dispatch_output_descs(ctx, opts);
    check_against("dispatch output tokens", Some(&outputs.tokens), Some(&want.tokens), "", "")?;
    check_against(
        "dispatch output scales",
        outputs.scales.as_ref(),
        want.scales.as_ref(),
        "FP8 dispatch writes per-128 scales",
        "only FP8 dispatch writes scales",
    )?;
    check_against(
        "dispatch output topk_weights",
        outputs.topk_weights.as_ref(),
        want.topk_weights.as_ref(),
        "high-throughput forward and rank-major dispatch write the received weights",
        "only high-throughput forward and rank-major dispatch write weights",
    )?;
    check_against(
        "dispatch output topk_idx",
        outputs.topk_idx.as_ref(),
        want.topk_idx.as_ref(),
        "high-throughput forward and rank-major dispatch write the received local expert indices",
        "only high-throughput forward and rank-major dispatch write indices",
    )?;
    check_against(
        "dispatch output counts",
        outputs.counts.as_ref(),
        want.counts.as_ref(),
        "this dispatch writes receive counters",
        "backward dispatch writes no counters",
    )
}

/// The global scales of an NVFP4 combine, checked: given exactly when
/// [`CombineQuant::Nvfp4`] is asked, fp32 in the tokens' shape with a last dimension of 1;
/// NVFP4 only for a low-latency forward combine with `hidden` a multiple of 16.
fn check_combine_quant<'a, T: TensorView + ?Sized>(
    ctx: &OpContext<'_>,
    opts: &CombineOptions,
    inputs: &CombineInputs<'a, T>,
) -> Result<Option<&'a T>, ValidationError> {
    const SCALES: &str = "combine input global_scales";
    match opts.quant {
        CombineQuant::None => match inputs.global_scales {
            Some(_) => Err(ValidationError::UnexpectedTensor {
                tensor: SCALES,
                why: "global scales go with an NVFP4 combine (CombineOptions::quant = Nvfp4) only",
            }),
            None => Ok(None),
        },
        CombineQuant::Nvfp4 => {
            let why = match (ctx.config.algorithm, opts.pass) {
                (Algorithm::HighThroughput, _) => {
                    Some("a low-latency combine's transport (high-throughput combines are BF16)")
                }
                (_, Pass::Backward) => Some("the forward combine's transport only"),
                _ if ctx.config.hidden % crate::nvfp4::BLOCK != 0 => {
                    Some("hidden must be a multiple of 16 (one E4M3 block scale per 16 channels)")
                }
                _ => None,
            };
            if let Some(why) = why {
                return Err(ValidationError::UnsupportedCombineQuant { asked: "nvfp4", why });
            }
            let g = inputs.global_scales.ok_or(ValidationError::MissingTensor {
                tensor: SCALES,
                why: "an NVFP4 combine needs each expert output row's fp32 global scale (2688 / amax, 0 for a zero row)",
            })?;
            let rows = (ctx.ll_rows(), "ranks * max_tokens");
            if ctx.layout == Layout::RankMajor {
                check_tensor(SCALES, g, TensorTag::Scales, DType::F32, &[rows, (1, "1")])?;
            } else {
                check_tensor(
                    SCALES,
                    g,
                    TensorTag::Scales,
                    DType::F32,
                    &[(ctx.local_experts(), "local experts"), rows, (1, "1")],
                )?;
            }
            Ok(Some(g))
        }
    }
}

/// Checks the inputs of combine; returns them as a [`ValidCombine`].
pub fn validate_combine_inputs<'a, T: TensorView + ?Sized>(
    ctx: &OpContext<'_>,
    opts: &CombineOptions,
    inputs: &CombineInputs<'a, T>,
) -> Result<ValidCombine<'a, T>, ValidationError> {
    let h = ctx.config.hidden;
    const TOKENS: &str = "combine input tokens";
    const WEIGHTS: &str = "combine input topk_weights";
    let global_scales = check_combine_quant(ctx, opts, inputs)?;
    match (ctx.config.algorithm, opts.pass) {
        (Algorithm::LowLatency, Pass::Backward) => {
            Err(ValidationError::UnsupportedForAlgorithm { what: "the backward pass", algorithm: ctx.algorithm_name() })
        }
        (Algorithm::LowLatency, Pass::Forward) if ctx.layout == Layout::RankMajor => {
            let rows = (ctx.ll_rows(), "ranks * max_tokens");
            check_tensor(TOKENS, inputs.tokens, TensorTag::Tokens, DType::Bf16, &[rows, (h, "hidden")])?;
            if inputs.topk_weights.is_some() {
                return Err(ValidationError::UnexpectedTensor {
                    tensor: WEIGHTS,
                    why: "rank-major combine sums rows the expert side already weighted (dispatch sent it the weights)",
                });
            }
            Ok(ValidCombine::LowLatency { expert_out: inputs.tokens, weights: None, global_scales })
        }
        (Algorithm::LowLatency, Pass::Forward) => {
            let (l, rows) = (ctx.local_experts(), ctx.ll_rows());
            check_tensor(
                TOKENS,
                inputs.tokens,
                TensorTag::Tokens,
                DType::Bf16,
                &[(l, "local experts"), (rows, "ranks * max_tokens"), (h, "hidden")],
            )?;
            let w = inputs.topk_weights.ok_or(ValidationError::MissingTensor {
                tensor: WEIGHTS,
                why: "low-latency combine weights each expert output with its token's top-k weight",
            })?;
            check_rows(
                WEIGHTS,
                w,
                TensorTag::TopkWeights,
                DType::F32,
                (ctx.num_tokens, "topk_idx"),
                (ctx.top_k, "top_k"),
            )?;
            Ok(ValidCombine::LowLatency { expert_out: inputs.tokens, weights: Some(w), global_scales })
        }
        (Algorithm::HighThroughput, pass) => {
            let n = ctx.num_recv;
            check_rows(
                TOKENS,
                inputs.tokens,
                TensorTag::Tokens,
                DType::Bf16,
                (n, "the handle's receive rows"),
                (h, "hidden"),
            )?;
            match (pass, inputs.topk_weights) {
                (Pass::Forward, Some(_)) => Err(ValidationError::UnexpectedTensor {
                    tensor: WEIGHTS,
                    why: "forward high-throughput combine sums pre-weighted expert outputs",
                }),
                (Pass::Forward, None) => Ok(ValidCombine::Forward { expert_out: inputs.tokens }),
                (Pass::Backward, None) => Err(ValidationError::MissingTensor {
                    tensor: WEIGHTS,
                    why: "backward combine also brings the top-k weight gradients back",
                }),
                (Pass::Backward, Some(w)) => {
                    check_rows(
                        WEIGHTS,
                        w,
                        TensorTag::TopkWeights,
                        DType::F32,
                        (n, "the handle's receive rows"),
                        (ctx.top_k, "top_k"),
                    )?;
                    Ok(ValidCombine::Backward { grads: inputs.tokens, weight_grads: w })
                }
            }
        }
    }
}

/// The descriptors combine produces.
pub fn combine_output_descs(ctx: &OpContext<'_>, opts: &CombineOptions) -> CombineOutputs<TensorDesc> {
    let b = ctx.num_tokens;
    CombineOutputs {
        tokens: TensorDesc::contiguous(TensorTag::Tokens, DType::Bf16, &[b, ctx.config.hidden]),
        topk_weights: (ctx.config.algorithm == Algorithm::HighThroughput && opts.pass == Pass::Backward)
            .then(|| TensorDesc::contiguous(TensorTag::TopkWeights, DType::F32, &[b, ctx.top_k])),
        masked: ctx.config.rank_masking.then(|| TensorDesc::contiguous(TensorTag::MaskedEntries, DType::I32, &[b])),
    }
}

/// Checks caller-provided combine outputs against [`combine_output_descs`].
pub fn validate_combine_outputs<T: TensorView>(
    ctx: &OpContext<'_>,
    opts: &CombineOptions,
    outputs: &CombineOutputs<T>,
) -> Result<(), ValidationError> {
    let want = combine_output_descs(ctx, opts);
    check_against("combine output tokens", Some(&outputs.tokens), Some(&want.tokens), "", "")?;
    check_against(
        "combine output topk_weights",
        outputs.topk_weights.as_ref(),
        want.topk_weights.as_ref(),
        "backward combine writes the top-k weight gradients",
        "only high-throughput backward combine writes weights",
    )?;
    // Optional even with masking: a caller may leave the per-token counts out.
    if outputs.masked.is_some() || want.masked.is_none() {
        check_against(
            "combine output masked",
            outputs.masked.as_ref(),
            want.masked.as_ref(),
            "",
            "only groups with rank masking count masked entries",
        )?;
    }
    Ok(())
}

/// Checks handle options against the group: high-throughput handles are flat, so
/// [`Layout::RankMajor`] is low-latency only; [`RecvRows::Bound`] is high-throughput only (a
/// low-latency handle's outputs are always sized by the bound) and needs a fixed
/// `max_tokens_per_rank`.
pub fn validate_handle_options(config: &GroupConfig, opts: &crate::ops::HandleOptions) -> Result<(), ValidationError> {
    match (config.algorithm, opts.layout, opts.recv_rows) {
        (Algorithm::HighThroughput, Layout::RankMajor, _) => Err(ValidationError::UnsupportedForAlgorithm {
            what: "the rank-major layout",
            algorithm: algorithm_name(config.algorithm),
        }),
        (Algorithm::LowLatency, _, RecvRows::Bound) => Err(ValidationError::UnsupportedForAlgorithm {
            what: "RecvRows::Bound (low-latency outputs are always sized by the bound)",
            algorithm: algorithm_name(config.algorithm),
        }),
        (Algorithm::HighThroughput, _, RecvRows::Bound) if config.fixed_max_tokens().is_none() => {
            Err(ValidationError::RecvRowsNeedFixedMaxTokens)
        }
        _ => Ok(()),
    }
}

/// The rows of a [`RecvRows::Bound`] handle's received tensors in a group of `num_ranks` with
/// `config` (validated by [`validate_handle_options`]): `R x max_tokens_per_rank`.
pub fn recv_bound(config: &GroupConfig, num_ranks: usize) -> usize {
    num_ranks * config.fixed_max_tokens().unwrap_or(0)
}

/// Checks that staged (send-only) execution is allowed for the group's algorithm.
pub fn validate_staged(config: &GroupConfig) -> Result<(), ValidationError> {
    match config.algorithm {
        Algorithm::LowLatency => Ok(()),
        Algorithm::HighThroughput => Err(ValidationError::UnsupportedForAlgorithm {
            what: "staged (send-only) execution",
            algorithm: algorithm_name(config.algorithm),
        }),
    }
}

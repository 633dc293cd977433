//! A table of bad inputs, each answered by its own error variant (never a panic), with a
//! message that names what is wrong.

use epflow_core::handle::RoutingHandle;
use std::time::Duration;

use epflow_core::host::{HostHandle, HostRank, HostWorld};
use epflow_core::ops::{
    CombineInputs, CombineOptions, CombineOutputs, DispatchInputs, DispatchOptions, DispatchOutputs, HandleOptions,
    Pass, RecvRows,
};
use epflow_core::validate::{OpContext, validate_combine_outputs, validate_dispatch_outputs};
use epflow_core::{
    ConfigError, DType, DispatchDtype, Error, GroupConfig, HostData, HostTensor, MaxTokens, TensorDesc, TensorTag,
    ValidationError, bf16,
};

const H: usize = 128;
const E: usize = 8;
const K: usize = 2;
const M: usize = 4;

fn ll() -> GroupConfig {
    GroupConfig::low_latency(E, M, H)
}

fn ht(dtype: DispatchDtype) -> GroupConfig {
    GroupConfig::high_throughput(E, H).with_dispatch_dtype(dtype)
}

fn one_rank(config: GroupConfig) -> HostRank {
    HostWorld::create(1, config).unwrap().pop().unwrap()
}

fn idx(b: usize) -> HostTensor {
    HostTensor::topk_idx(b, K, (0..b * K).map(|i| (i % E) as i64).collect())
}

fn tokens(b: usize, h: usize) -> HostTensor {
    HostTensor::tokens(b, h, vec![bf16::ONE; b * h])
}

fn weights(b: usize, k: usize) -> HostTensor {
    HostTensor::topk_weights(b, k, vec![0.5; b * k])
}

fn handle_err(config: GroupConfig, t: HostTensor) -> Error {
    one_rank(config).create_handle(&t).unwrap_err()
}

fn ll_dispatch_err(
    inputs: impl for<'a> Fn(&'a HostTensor, &'a HostTensor) -> DispatchInputs<'a>,
    x: HostTensor,
    opts: DispatchOptions,
) -> Error {
    let rank = one_rank(ll());
    let h = rank.create_handle(&idx(3)).unwrap();
    let extra = weights(3, K);
    rank.dispatch(&h, inputs(&x, &extra), &opts).unwrap_err()
}

/// A low-latency rank and handle after one dispatch, so combine can be called.
fn ll_after_dispatch() -> (HostRank, HostHandle) {
    let rank = one_rank(ll());
    let h = rank.create_handle(&idx(3)).unwrap();
    drop(rank.dispatch(&h, DispatchInputs::new(&tokens(3, H)), &DispatchOptions::default()).unwrap());
    (rank, h)
}

fn ht_handle(config: GroupConfig) -> (HostRank, HostHandle) {
    let rank = one_rank(config);
    let h = rank.create_handle(&idx(3)).unwrap();
    (rank, h)
}

fn fp8_tokens(b: usize) -> HostTensor {
    HostTensor::tokens_fp8(b, H, vec![0x38; b * H])
}

type Case = (&'static str, Box<dyn Fn() -> Error>, fn(&Error) -> bool, &'static str);

/// The context of an operation of 3 tokens on a one-rank group of `config` that receives
/// `num_recv` rows (output checks).
fn three_tokens(config: &GroupConfig, num_recv: usize) -> OpContext<'_> {
    OpContext { config, num_ranks: 1, num_tokens: 3, top_k: K, num_recv, layout: Default::default() }
}

fn cfg(c: GroupConfig, ranks: usize) -> Error {
    Error::Config(c.validate(ranks).unwrap_err())
}

fn cases() -> Vec<Case> {
    use Error::{Config as C, Validation as V};
    use ValidationError as VE;
    vec![
        ("zero ranks", Box::new(|| cfg(ll(), 0)), |e| matches!(e, C(ConfigError::ZeroRanks)), "num_ranks"),
        (
            "too many ranks",
            Box::new(|| cfg(GroupConfig::low_latency(4096, 4, H), 2048)),
            |e| matches!(e, C(ConfigError::TooManyRanks { .. })),
            "num_ranks",
        ),
        (
            "zero experts",
            Box::new(|| cfg(GroupConfig::low_latency(0, M, H), 1)),
            |e| matches!(e, C(ConfigError::ZeroExperts)),
            "num_experts",
        ),
        (
            "experts not divisible",
            Box::new(|| cfg(GroupConfig::low_latency(7, M, H), 4)),
            |e| matches!(e, C(ConfigError::ExpertsNotDivisible { num_experts: 7, num_ranks: 4 })),
            "divisible",
        ),
        (
            "zero hidden",
            Box::new(|| cfg(GroupConfig::low_latency(E, M, 0), 1)),
            |e| matches!(e, C(ConfigError::ZeroHidden)),
            "hidden",
        ),
        (
            "hidden not aligned",
            Box::new(|| cfg(GroupConfig::low_latency(E, M, 100), 1)),
            |e| matches!(e, C(ConfigError::HiddenNotAligned { hidden: 100, .. })),
            "hidden",
        ),
        (
            "fp8 hidden not multiple of 128",
            Box::new(|| {
                cfg(
                    GroupConfig::low_latency(E, M, 136).with_dispatch_dtype(DispatchDtype::Fp8 { round_scales: false }),
                    1,
                )
            }),
            |e| matches!(e, C(ConfigError::HiddenNotMultipleOfFp8Block { hidden: 136, .. })),
            "128",
        ),
        (
            "zero max tokens",
            Box::new(|| cfg(GroupConfig::low_latency(E, 0, H), 1)),
            |e| matches!(e, C(ConfigError::ZeroMaxTokens)),
            "max_tokens_per_rank",
        ),
        (
            "LL with auto max tokens",
            Box::new(|| cfg(ll().with_max_tokens(MaxTokens::Auto), 1)),
            |e| matches!(e, C(ConfigError::LowLatencyNeedsFixedMaxTokens)),
            "low-latency",
        ),
        (
            "zero buffer sets",
            Box::new(|| cfg(ll().with_buffer_sets(0), 1)),
            |e| matches!(e, C(ConfigError::ZeroBufferSets)),
            "buffer_sets",
        ),
        (
            "too many buffer sets",
            Box::new(|| cfg(ll().with_buffer_sets(99), 1)),
            |e| matches!(e, C(ConfigError::TooManyBufferSets { .. })),
            "buffer_sets",
        ),
        (
            "max_top_k of zero",
            Box::new(|| cfg(ll().with_max_top_k(0), 1)),
            |e| matches!(e, C(ConfigError::BadMaxTopK { max_top_k: 0, .. })),
            "max_top_k",
        ),
        (
            "top_k above the group's max_top_k",
            Box::new(|| handle_err(ll().with_max_top_k(1), idx(2))),
            |e| matches!(e, V(VE::TopKExceedsGroupMax { top_k: 2, max_top_k: 1 })),
            "max_top_k",
        ),
        (
            "max_sms of zero",
            Box::new(|| cfg(ll().with_max_sms(Some(0)), 1)),
            |e| matches!(e, C(ConfigError::ZeroMaxSms)),
            "max_sms",
        ),
        (
            "zero timeout",
            Box::new(|| cfg(ll().with_timeout(Duration::ZERO), 1)),
            |e| matches!(e, C(ConfigError::ZeroTimeout)),
            "timeout",
        ),
        (
            "topk_idx with weights tag",
            Box::new(|| handle_err(ll(), idx(2).with_tag(TensorTag::TopkWeights))),
            |e| matches!(e, V(VE::WrongTag { tensor: "topk_idx", .. })),
            "tag",
        ),
        (
            "topk_idx as int32",
            Box::new(|| handle_err(ll(), HostTensor::new(TensorTag::TopkIdx, &[2, K], HostData::I32(vec![0; 4])))),
            |e| matches!(e, V(VE::WrongDtype { expected: DType::I64, got: DType::I32, .. })),
            "i64",
        ),
        (
            "topk_idx 1-D",
            Box::new(|| handle_err(ll(), HostTensor::new(TensorTag::TopkIdx, &[4], HostData::I64(vec![0; 4])))),
            |e| matches!(e, V(VE::WrongNdim { expected: 2, got: 1, .. })),
            "dimensions",
        ),
        (
            "topk_idx strided",
            Box::new(|| handle_err(ll(), idx(2).with_strides(&[4, 1]))),
            |e| matches!(e, V(VE::NotContiguous { .. })),
            "contiguous",
        ),
        (
            "topk_idx short storage",
            Box::new(|| handle_err(ll(), HostTensor::new(TensorTag::TopkIdx, &[3, K], HostData::I64(vec![0; 5])))),
            |e| matches!(e, V(VE::StorageSizeMismatch { expected: 6, got: 5, .. })),
            "holds 5",
        ),
        (
            "more tokens than max_tokens",
            Box::new(|| handle_err(ll(), idx(M + 1))),
            |e| matches!(e, V(VE::TooManyTokens { tokens: 5, max_tokens: 4 })),
            "max_tokens_per_rank",
        ),
        (
            "expert index past E",
            Box::new(|| handle_err(ll(), HostTensor::topk_idx(1, K, vec![0, E as i64]))),
            |e| matches!(e, V(VE::ExpertIndexOutOfRange { index: 8, .. })),
            "outside",
        ),
        (
            "expert index below -1",
            Box::new(|| handle_err(ll(), HostTensor::topk_idx(1, K, vec![-2, 0]))),
            |e| matches!(e, V(VE::ExpertIndexOutOfRange { index: -2, .. })),
            "-1",
        ),
        (
            "duplicate expert",
            Box::new(|| handle_err(ll(), HostTensor::topk_idx(1, K, vec![3, 3]))),
            |e| matches!(e, V(VE::DuplicateExpert { expert: 3, .. })),
            "twice",
        ),
        (
            "top_k of zero",
            Box::new(|| handle_err(ll(), HostTensor::topk_idx(2, 0, vec![]))),
            |e| matches!(e, V(VE::ZeroTopK)),
            "top_k",
        ),
        (
            "top_k above E",
            Box::new(|| handle_err(ll().with_max_top_k(16), HostTensor::topk_idx(1, E + 1, vec![-1; E + 1]))),
            |e| matches!(e, V(VE::TopKExceedsExperts { .. })),
            "top_k",
        ),
        (
            "LL tokens as f32",
            Box::new(|| {
                ll_dispatch_err(
                    |x, _| DispatchInputs::new(x),
                    HostTensor::new(TensorTag::Tokens, &[3, H], HostData::F32(vec![0.0; 3 * H])),
                    DispatchOptions::default(),
                )
            }),
            |e| matches!(e, V(VE::WrongDtype { expected: DType::Bf16, .. })),
            "bf16",
        ),
        (
            "LL tokens wrong hidden",
            Box::new(|| ll_dispatch_err(|x, _| DispatchInputs::new(x), tokens(3, 2 * H), DispatchOptions::default())),
            |e| matches!(e, V(VE::WrongDimSize { what: "hidden", expected: H, .. })),
            "hidden",
        ),
        (
            "LL tokens rows != topk_idx rows",
            Box::new(|| ll_dispatch_err(|x, _| DispatchInputs::new(x), tokens(2, H), DispatchOptions::default())),
            |e| matches!(e, V(VE::TokenCountMismatch { expected: 3, got: 2, .. })),
            "token rows",
        ),
        (
            "LL tokens with scales tag",
            Box::new(|| {
                ll_dispatch_err(
                    |x, _| DispatchInputs::new(x),
                    tokens(3, H).with_tag(TensorTag::Scales),
                    DispatchOptions::default(),
                )
            }),
            |e| matches!(e, V(VE::WrongTag { expected: TensorTag::Tokens, .. })),
            "tag",
        ),
        (
            "LL tokens 3-D",
            Box::new(|| {
                ll_dispatch_err(
                    |x, _| DispatchInputs::new(x),
                    HostTensor::new(TensorTag::Tokens, &[1, 3, H], HostData::Bf16(vec![bf16::ONE; 3 * H])),
                    DispatchOptions::default(),
                )
            }),
            |e| matches!(e, V(VE::WrongNdim { expected: 2, got: 3, .. })),
            "dimensions",
        ),
        (
            "LL dispatch given weights",
            Box::new(|| {
                ll_dispatch_err(|x, w| DispatchInputs::new(x).with_weights(w), tokens(3, H), DispatchOptions::default())
            }),
            |e| matches!(e, V(VE::UnexpectedTensor { tensor: "dispatch input topk_weights", .. })),
            "combine",
        ),
        (
            "LL dispatch given scales",
            Box::new(|| {
                ll_dispatch_err(|x, w| DispatchInputs::new(x).with_scales(w), tokens(3, H), DispatchOptions::default())
            }),
            |e| matches!(e, V(VE::UnexpectedTensor { tensor: "dispatch input scales", .. })),
            "quantizes",
        ),
        (
            "LL backward pass",
            Box::new(|| {
                ll_dispatch_err(
                    |x, _| DispatchInputs::new(x),
                    tokens(3, H),
                    DispatchOptions { pass: Pass::Backward, ..Default::default() },
                )
            }),
            |e| matches!(e, V(VE::UnsupportedForAlgorithm { .. })),
            "backward",
        ),
        (
            "LL combine before dispatch",
            Box::new(|| {
                let rank = one_rank(ll());
                let h = rank.create_handle(&idx(3)).unwrap();
                let x = HostTensor::new(TensorTag::Tokens, &[E, M, H], HostData::Bf16(vec![bf16::ONE; E * M * H]));
                rank.combine(&h, CombineInputs::new(&x).with_weights(&weights(3, K)), &CombineOptions::default())
                    .unwrap_err()
            }),
            |e| matches!(e, V(VE::CombineBeforeDispatch)),
            "dispatch first",
        ),
        (
            "LL combine without weights",
            Box::new(|| {
                let (rank, h) = ll_after_dispatch();
                let x = HostTensor::new(TensorTag::Tokens, &[E, M, H], HostData::Bf16(vec![bf16::ONE; E * M * H]));
                rank.combine(&h, CombineInputs::new(&x), &CombineOptions::default()).unwrap_err()
            }),
            |e| matches!(e, V(VE::MissingTensor { tensor: "combine input topk_weights", .. })),
            "weight",
        ),
        (
            "LL combine expert outputs with too few rows",
            Box::new(|| {
                let (rank, h) = ll_after_dispatch();
                let x = HostTensor::new(
                    TensorTag::Tokens,
                    &[E, M - 1, H],
                    HostData::Bf16(vec![bf16::ONE; E * (M - 1) * H]),
                );
                rank.combine(&h, CombineInputs::new(&x).with_weights(&weights(3, K)), &CombineOptions::default())
                    .unwrap_err()
            }),
            |e| matches!(e, V(VE::WrongDimSize { dim: 1, expected: 4, got: 3, .. })),
            "ranks * max_tokens",
        ),
        (
            "LL combine weights with wrong top_k",
            Box::new(|| {
                let (rank, h) = ll_after_dispatch();
                let x = HostTensor::new(TensorTag::Tokens, &[E, M, H], HostData::Bf16(vec![bf16::ONE; E * M * H]));
                rank.combine(&h, CombineInputs::new(&x).with_weights(&weights(3, K + 1)), &CombineOptions::default())
                    .unwrap_err()
            }),
            |e| matches!(e, V(VE::WrongDimSize { what: "top_k", .. })),
            "top_k",
        ),
        (
            "handle from another group",
            Box::new(|| {
                let a = one_rank(ll());
                let b = one_rank(ll());
                let h = b.create_handle(&idx(3)).unwrap();
                a.dispatch(&h, DispatchInputs::new(&tokens(3, H)), &DispatchOptions::default()).unwrap_err()
            }),
            |e| matches!(e, V(VE::ForeignHandle { .. })),
            "group",
        ),
        (
            "HT forward dispatch without weights",
            Box::new(|| {
                let (rank, h) = ht_handle(ht(DispatchDtype::Bf16));
                rank.dispatch(&h, DispatchInputs::new(&tokens(3, H)), &DispatchOptions::default()).unwrap_err()
            }),
            |e| matches!(e, V(VE::MissingTensor { tensor: "dispatch input topk_weights", .. })),
            "weights",
        ),
        (
            "HT FP8 dispatch without scales",
            Box::new(|| {
                let (rank, h) = ht_handle(ht(DispatchDtype::Fp8 { round_scales: false }));
                let (x, w) = (fp8_tokens(3), weights(3, K));
                rank.dispatch(&h, DispatchInputs::new(&x).with_weights(&w), &DispatchOptions::default()).unwrap_err()
            }),
            |e| matches!(e, V(VE::MissingTensor { tensor: "dispatch input scales", .. })),
            "scales",
        ),
        (
            "HT FP8 dispatch given BF16 tokens",
            Box::new(|| {
                let (rank, h) = ht_handle(ht(DispatchDtype::Fp8 { round_scales: false }));
                let (x, w) = (tokens(3, H), weights(3, K));
                rank.dispatch(&h, DispatchInputs::new(&x).with_weights(&w), &DispatchOptions::default()).unwrap_err()
            }),
            |e| matches!(e, V(VE::WrongDtype { expected: DType::Fp8E4m3, got: DType::Bf16, .. })),
            "fp8",
        ),
        (
            "HT BF16 dispatch given scales",
            Box::new(|| {
                let (rank, h) = ht_handle(ht(DispatchDtype::Bf16));
                let (x, w, s) = (tokens(3, H), weights(3, K), HostTensor::scales(3, 1, vec![1.0; 3]));
                rank.dispatch(&h, DispatchInputs::new(&x).with_weights(&w).with_scales(&s), &DispatchOptions::default())
                    .unwrap_err()
            }),
            |e| matches!(e, V(VE::UnexpectedTensor { tensor: "dispatch input scales", .. })),
            "FP8",
        ),
        (
            "HT FP8 scales with wrong columns",
            Box::new(|| {
                let (rank, h) = ht_handle(ht(DispatchDtype::Fp8 { round_scales: false }));
                let (x, w, s) = (fp8_tokens(3), weights(3, K), HostTensor::scales(3, 2, vec![1.0; 6]));
                rank.dispatch(&h, DispatchInputs::new(&x).with_weights(&w).with_scales(&s), &DispatchOptions::default())
                    .unwrap_err()
            }),
            |e| matches!(e, V(VE::WrongDimSize { what: "hidden/128", .. })),
            "hidden/128",
        ),
        (
            "HT staged dispatch",
            Box::new(|| {
                let (rank, h) = ht_handle(ht(DispatchDtype::Bf16));
                let (x, w) = (tokens(3, H), weights(3, K));
                rank.dispatch_send(&h, DispatchInputs::new(&x).with_weights(&w), &DispatchOptions::default())
                    .map(|_| ())
                    .unwrap_err()
            }),
            |e| matches!(e, V(VE::UnsupportedForAlgorithm { what: "staged (send-only) execution", .. })),
            "staged",
        ),
        (
            "HT backward dispatch given weights",
            Box::new(|| {
                let (rank, h) = ht_handle(ht(DispatchDtype::Bf16));
                let (x, w) = (tokens(3, H), weights(3, K));
                rank.dispatch(
                    &h,
                    DispatchInputs::new(&x).with_weights(&w),
                    &DispatchOptions { pass: Pass::Backward, ..Default::default() },
                )
                .unwrap_err()
            }),
            |e| matches!(e, V(VE::UnexpectedTensor { tensor: "dispatch input topk_weights", .. })),
            "gradients",
        ),
        (
            "HT forward combine given weights",
            Box::new(|| {
                let (rank, h) = ht_handle(ht(DispatchDtype::Bf16));
                let n = h.num_recv_tokens().unwrap();
                let (x, w) = (tokens(n, H), weights(n, K));
                rank.combine(&h, CombineInputs::new(&x).with_weights(&w), &CombineOptions::default()).unwrap_err()
            }),
            |e| matches!(e, V(VE::UnexpectedTensor { tensor: "combine input topk_weights", .. })),
            "pre-weighted",
        ),
        (
            "HT backward combine without weights",
            Box::new(|| {
                let (rank, h) = ht_handle(ht(DispatchDtype::Bf16));
                let x = tokens(h.num_recv_tokens().unwrap(), H);
                rank.combine(&h, CombineInputs::new(&x), &CombineOptions { pass: Pass::Backward, ..Default::default() })
                    .unwrap_err()
            }),
            |e| matches!(e, V(VE::MissingTensor { tensor: "combine input topk_weights", .. })),
            "weight gradients",
        ),
        (
            "HT combine rows != receive count",
            Box::new(|| {
                let (rank, h) = ht_handle(ht(DispatchDtype::Bf16));
                let x = tokens(h.num_recv_tokens().unwrap() + 1, H);
                rank.combine(&h, CombineInputs::new(&x), &CombineOptions::default()).unwrap_err()
            }),
            |e| matches!(e, V(VE::TokenCountMismatch { reference: "the handle's receive rows", .. })),
            "receive rows",
        ),
        (
            "LL dispatch outputs without counts",
            Box::new(|| {
                let c = ll();
                let ctx = three_tokens(&c, 0);
                let outs = DispatchOutputs {
                    tokens: TensorDesc::contiguous(TensorTag::Tokens, DType::Bf16, &[E, M, H]),
                    scales: None,
                    topk_weights: None,
                    topk_idx: None,
                    counts: None,
                };
                Error::Validation(validate_dispatch_outputs(&ctx, &DispatchOptions::default(), &outs).unwrap_err())
            }),
            |e| matches!(e, V(VE::MissingTensor { tensor: "dispatch output counts", .. })),
            "counters",
        ),
        (
            "HT dispatch outputs with int32 topk_idx",
            Box::new(|| {
                let c = ht(DispatchDtype::Bf16);
                let ctx = three_tokens(&c, 3);
                let outs = DispatchOutputs {
                    tokens: TensorDesc::contiguous(TensorTag::Tokens, DType::Bf16, &[3, H]),
                    scales: None,
                    topk_weights: Some(TensorDesc::contiguous(TensorTag::TopkWeights, DType::F32, &[3, K])),
                    topk_idx: Some(TensorDesc::contiguous(TensorTag::TopkIdx, DType::I32, &[3, K])),
                    counts: Some(TensorDesc::contiguous(TensorTag::RecvExpertCountsHost, DType::I32, &[E])),
                };
                let opts =
                    DispatchOptions { counts_location: epflow_core::ops::CountsLocation::Host, ..Default::default() };
                Error::Validation(validate_dispatch_outputs(&ctx, &opts, &outs).unwrap_err())
            }),
            |e| matches!(e, V(VE::WrongDtype { tensor: "dispatch output topk_idx", .. })),
            "i64",
        ),
        (
            "LL combine outputs with weights",
            Box::new(|| {
                let c = ll();
                let ctx = three_tokens(&c, 0);
                let outs = CombineOutputs {
                    tokens: TensorDesc::contiguous(TensorTag::Tokens, DType::Bf16, &[3, H]),
                    topk_weights: Some(TensorDesc::contiguous(TensorTag::TopkWeights, DType::F32, &[3, K])),
                    masked: None,
                };
                Error::Validation(validate_combine_outputs(&ctx, &CombineOptions::default(), &outs).unwrap_err())
            }),
            |e| matches!(e, V(VE::UnexpectedTensor { tensor: "combine output topk_weights", .. })),
            "backward",
        ),
        (
            "more outstanding dispatches than buffer sets",
            Box::new(|| {
                let rank = one_rank(ll());
                let h = rank.create_handle(&idx(3)).unwrap();
                let x = tokens(3, H);
                let _a = rank.dispatch(&h, DispatchInputs::new(&x), &DispatchOptions::default()).unwrap();
                let _b = rank.dispatch(&h, DispatchInputs::new(&x), &DispatchOptions::default()).unwrap();
                rank.dispatch(&h, DispatchInputs::new(&x), &DispatchOptions::default()).unwrap_err()
            }),
            |e| matches!(e, Error::SlotsBusy { channel: "dispatch", buffer_sets: 2 }),
            "drop an earlier result",
        ),
        (
            "received rows by the bound on a low-latency handle",
            Box::new(|| {
                let opts = HandleOptions::default().with_recv_rows(RecvRows::Bound);
                one_rank(ll()).create_handle_with(&idx(3), &opts).unwrap_err()
            }),
            |e| matches!(e, V(VE::UnsupportedForAlgorithm { .. })),
            "RecvRows::Bound",
        ),
        (
            "received rows by the bound without a fixed max_tokens_per_rank",
            Box::new(|| {
                let opts = HandleOptions::default().with_recv_rows(RecvRows::Bound);
                one_rank(ht(DispatchDtype::Bf16)).create_handle_with(&idx(3), &opts).unwrap_err()
            }),
            |e| matches!(e, V(VE::RecvRowsNeedFixedMaxTokens)),
            "fixed max_tokens_per_rank",
        ),
        (
            "a combine input of N rows on a handle whose received tensors have the bound's",
            Box::new(|| {
                let opts = HandleOptions::default().with_recv_rows(RecvRows::Bound);
                let rank = one_rank(ht(DispatchDtype::Bf16).with_max_tokens(MaxTokens::Fixed(M)));
                let h = rank.create_handle_with(&idx(3), &opts).unwrap();
                let (x, w) = (tokens(3, H), weights(3, K));
                let d = rank.dispatch(&h, DispatchInputs::new(&x).with_weights(&w), &DispatchOptions::default());
                assert_eq!(d.unwrap().tokens().desc().shape, vec![M, H]);
                rank.combine(&h, CombineInputs::new(&tokens(3, H)), &CombineOptions::default()).unwrap_err()
            }),
            |e| matches!(e, V(VE::TokenCountMismatch { expected: M, got: 3, .. })),
            "receive rows",
        ),
    ]
}

#[test]
fn every_bad_input_has_its_own_error() {
    let cases = cases();
    assert!(cases.len() >= 30, "only {} cases", cases.len());
    let mut variants = std::collections::BTreeSet::new();
    for (name, make, matches, mentions) in &cases {
        let err = make();
        assert!(matches(&err), "{name}: unexpected error {err:?}");
        let msg = err.to_string();
        assert!(msg.contains(mentions), "{name}: message {msg:?} should mention {mentions:?}");
        variants.insert(format!("{err:?}").split(['{', '(']).take(2).collect::<Vec<_>>().join("("));
    }
    assert!(variants.len() >= 30, "only {} distinct variants: {variants:?}", variants.len());
}

#[test]
fn a_rank_keeps_working_after_rejected_inputs() {
    // A rejected call must not consume a sequence number: the next valid one still works.
    let rank = one_rank(ll());
    let h = rank.create_handle(&idx(3)).unwrap();
    assert!(rank.dispatch(&h, DispatchInputs::new(&tokens(2, H)), &DispatchOptions::default()).is_err());
    let out = rank.dispatch(&h, DispatchInputs::new(&tokens(3, H)), &DispatchOptions::default()).unwrap();
    assert_eq!(out.counts().unwrap().iter().sum::<i32>(), 6);
}

/// `routing_from_values` (the GPU backend's path, values copied out of device memory) answers
/// as `routing_from_tensor` does: the same routing, the same errors.
#[test]
fn routing_from_values_answers_as_routing_from_tensor() {
    use epflow_core::validate::{routing_from_tensor, routing_from_values};
    let config = ll();
    let good = idx(3);
    let values = good.as_i64().unwrap().to_vec();
    assert_eq!(
        routing_from_values(&config, &good, values.clone()).unwrap(),
        routing_from_tensor(&config, &good, &values).unwrap()
    );
    // An expert out of range, a duplicate in a row, and values of the wrong count.
    for bad in [vec![0, E as i64, 1, 2, 3, 4], vec![0, 1, 2, 2, 3, 4], vec![0, 1, 2, 3]] {
        let by_values = routing_from_values(&config, &good, bad.clone()).unwrap_err();
        assert_eq!(by_values, routing_from_tensor(&config, &good, &bad).unwrap_err());
    }
}

//! The NVFP4 low-latency combine (`CombineQuant::Nvfp4`) on the host backend: bit for bit equal
//! to the CPU reference of the same quantization, within the documented error of the BF16
//! combine, in both layouts, synchronous and staged, R in {1, 2, 4}; and its validation.

use epflow_core::dtype::CombineQuant;
use epflow_core::host::{HostRank, HostWorld};
use epflow_core::ops::{CombineInputs, CombineOptions, DispatchInputs, DispatchOptions, HandleOptions, Layout};
use epflow_core::scenario::{Scenario, nvfp4_global_scales};
use epflow_core::verify::{Report, Tolerance, check_bf16};
use epflow_core::workload::RoutingKind;
use epflow_core::{Error, GroupConfig, HostData, HostTensor, TensorTag, ValidationError, bf16};

const HIDDEN: usize = 256;
const EXPERTS: usize = 32;
const TOP_K: usize = 4;
const MAX_TOKENS: usize = 24;

fn nvfp4() -> CombineOptions {
    CombineOptions { quant: CombineQuant::Nvfp4, ..Default::default() }
}

/// One round on `rank`: dispatch, the reference dispatch's identity expert outputs (equal to the
/// backend's, which the other suites check) as the combine input, NVFP4 combine. Returns the
/// combined tokens.
fn round(rank: &HostRank, sc: &Scenario, layout: Layout, staged: bool) -> Vec<bf16> {
    let r = rank.rank();
    let handle = rank.create_handle_with(&sc.topk_idx(r), &HandleOptions::with_layout(layout)).unwrap();
    let (x, w) = (sc.tokens(r), sc.weights(r));
    let inputs = DispatchInputs::new(&x).with_weights(&w);
    let inputs = if layout == Layout::RankMajor { inputs } else { DispatchInputs::new(&x) };
    drop(rank.dispatch(&handle, inputs, &DispatchOptions::default()).unwrap());
    let experts = sc.ll_reference_expert_outputs(r, layout).unwrap();
    let g = nvfp4_global_scales(&experts);
    let cin = CombineInputs::new(&experts).with_global_scales(&g);
    let cin = if layout == Layout::RankMajor { cin } else { cin.with_weights(&w) };
    let y = if staged {
        rank.combine_send(&handle, cin, &nvfp4()).unwrap().complete().unwrap()
    } else {
        rank.combine(&handle, cin, &nvfp4()).unwrap()
    };
    y.tokens().as_bf16().unwrap().to_vec()
}

#[test]
fn nvfp4_combine_matches_its_reference_and_stays_within_the_documented_error() {
    for num_ranks in [1usize, 2, 4] {
        for layout in [Layout::ExpertMajor, Layout::RankMajor] {
            for staged in [false, true] {
                let config = GroupConfig::low_latency(EXPERTS, MAX_TOKENS, HIDDEN);
                let tokens: Vec<usize> = [MAX_TOKENS, 17, 0, 5].into_iter().take(num_ranks).collect();
                let seed = 31 * num_ranks as u64 + staged as u64;
                let sc = Scenario::generate(config.clone(), num_ranks, &tokens, TOP_K, RoutingKind::Uniform, 4, seed);
                let what = format!("R={num_ranks} {layout:?} staged={staged}");
                let inputs: Vec<HostTensor> =
                    (0..num_ranks).map(|r| sc.ll_reference_expert_outputs(r, layout).unwrap()).collect();
                let want = sc.ll_combine_reference_of(layout, &inputs, CombineQuant::Nvfp4, false).unwrap();
                let exact = sc.ll_combine_reference_of(layout, &inputs, CombineQuant::None, false).unwrap();
                let bound = sc.ll_combine_reference_of(layout, &inputs, CombineQuant::Nvfp4, true).unwrap();
                let got = HostWorld::run(num_ranks, config, |rank| round(rank, &sc, layout, staged)).unwrap();
                let (mut compared, mut differing) = (0usize, 0usize);
                for (r, y) in got.iter().enumerate() {
                    let report: Report = check_bf16("nvfp4 combine", &want[r], y, Tolerance::Exact);
                    assert!(report.ok(), "{what} rank {r}: {report:?}");
                    for ((g, e), b) in y.iter().zip(&exact[r]).zip(&bound[r]) {
                        let (g, e, b) = (g.to_f32(), e.to_f32(), b.to_f32());
                        // The bound before the BF16 roundings of both results (and of the bound).
                        let slack = (e.abs() + b) * (1.0 / 128.0);
                        assert!((g - e).abs() <= b * 1.01 + slack, "{what} rank {r}: |{g} - {e}| > {b}");
                        compared += 1;
                        differing += usize::from(g != e);
                    }
                }
                if tokens.iter().any(|&t| t > 0) {
                    assert!(compared > 0 && differing > 0, "{what}: {differing} of {compared} changed by NVFP4");
                }
            }
        }
    }
}

#[test]
fn nvfp4_combine_validation() {
    let config = GroupConfig::low_latency(EXPERTS, MAX_TOKENS, HIDDEN);
    let sc = Scenario::generate(config.clone(), 2, &[MAX_TOKENS], TOP_K, RoutingKind::Uniform, 0, 3);
    let errors = HostWorld::run(2, config, |rank| {
        let r = rank.rank();
        let handle = rank.create_handle(&sc.topk_idx(r)).unwrap();
        let (x, w) = (sc.tokens(r), sc.weights(r));
        drop(rank.dispatch(&handle, DispatchInputs::new(&x), &DispatchOptions::default()).unwrap());
        let experts = sc.ll_reference_expert_outputs(r, Layout::ExpertMajor).unwrap();
        let g = nvfp4_global_scales(&experts);
        let cin = CombineInputs::new(&experts).with_weights(&w);
        let missing = rank.combine(&handle, cin, &nvfp4()).unwrap_err();
        let unexpected = rank.combine(&handle, cin.with_global_scales(&g), &CombineOptions::default()).unwrap_err();
        let flat = HostTensor::new(TensorTag::Scales, &[g.shape().iter().product()], HostData::F32(vec![1.0; 1]));
        let wrong_shape = rank.combine(&handle, cin.with_global_scales(&flat), &nvfp4()).unwrap_err();
        // The group still works: a valid NVFP4 combine after the refusals.
        let ok = rank.combine(&handle, cin.with_global_scales(&g), &nvfp4()).is_ok();
        (missing, unexpected, wrong_shape, ok)
    })
    .unwrap();
    for (missing, unexpected, wrong_shape, ok) in errors {
        assert!(matches!(missing, Error::Validation(ValidationError::MissingTensor { .. })), "{missing}");
        assert!(matches!(unexpected, Error::Validation(ValidationError::UnexpectedTensor { .. })), "{unexpected}");
        assert!(matches!(wrong_shape, Error::Validation(_)), "{wrong_shape}");
        assert!(ok, "a valid NVFP4 combine after the refusals");
    }

    // High-throughput combines and hidden sizes off the 16-channel blocks are refused by name.
    let ht = GroupConfig::high_throughput(EXPERTS, 8 * 16);
    let ht_sc = Scenario::generate(ht.clone(), 1, &[16], TOP_K, RoutingKind::Uniform, 0, 5);
    let err = HostWorld::run(1, ht, |rank| {
        let handle = rank.create_handle(&ht_sc.topk_idx(0)).unwrap();
        let (x, w) = (ht_sc.tokens(0), ht_sc.weights(0));
        let out =
            rank.dispatch(&handle, DispatchInputs::new(&x).with_weights(&w), &DispatchOptions::default()).unwrap();
        let g = HostTensor::new(
            TensorTag::Scales,
            &[out.tokens().shape()[0], 1],
            HostData::F32(vec![1.0; out.tokens().shape()[0]]),
        );
        rank.combine(&handle, CombineInputs::new(out.tokens()).with_global_scales(&g), &nvfp4()).unwrap_err()
    })
    .unwrap();
    assert!(matches!(err[0], Error::Validation(ValidationError::UnsupportedCombineQuant { .. })), "{}", err[0]);
    let odd = GroupConfig::low_latency(EXPERTS, MAX_TOKENS, 136);
    let odd_sc = Scenario::generate(odd.clone(), 1, &[4], TOP_K, RoutingKind::Uniform, 0, 5);
    let err = HostWorld::run(1, odd, |rank| {
        let handle = rank.create_handle(&odd_sc.topk_idx(0)).unwrap();
        let (x, w) = (odd_sc.tokens(0), odd_sc.weights(0));
        drop(rank.dispatch(&handle, DispatchInputs::new(&x), &DispatchOptions::default()).unwrap());
        let experts = odd_sc.ll_reference_expert_outputs(0, Layout::ExpertMajor).unwrap();
        let g = nvfp4_global_scales(&experts);
        rank.combine(&handle, CombineInputs::new(&experts).with_weights(&w).with_global_scales(&g), &nvfp4())
            .unwrap_err()
    })
    .unwrap();
    assert!(matches!(err[0], Error::Validation(ValidationError::UnsupportedCombineQuant { .. })), "{}", err[0]);
}

//! The MoE layer on the host backend (4 ranks, small shapes of each preset's kind, fresh random
//! tokens, uneven token counts) against the CPU reference of the whole model: bit-identical
//! outputs and routings, and expert counts that add up to the routed (token, expert) pairs. The
//! same for prefill over a high-throughput group ([`HostMoeLayer::forward_prefill`] against
//! [`reference::layer_prefill`]), on 4 ranks and on 1 (where it equals the decode reference).

use epflow_async::Group;
use epflow_core::host::HostWorld;
use epflow_core::workload::random_tokens;
use epflow_core::{GroupConfig, HostTensor, MaxTokens};
use epflow_moe::host::HostMoeLayer;
use epflow_moe::{LayerWeights, preset, reference};

const RANKS: usize = 4;

fn run(model: &str, hidden: usize, experts: usize, top_k: usize, ffn: usize, seed: u64) {
    let p = preset(model).unwrap().scaled(hidden, experts, top_k, ffn);
    let max_tokens = 16;
    let tokens = [16, 5, 1, 11];
    let config = GroupConfig::low_latency(experts, max_tokens, hidden).with_max_top_k(top_k);
    let groups: Vec<Group<_>> = HostWorld::create(RANKS, config).unwrap().into_iter().map(Group::new).collect();
    let full = LayerWeights::generate(&p, seed, 0, 0, 1, u128::MAX).unwrap();
    let inputs: Vec<HostTensor> = (0..RANKS)
        .map(|r| HostTensor::tokens(tokens[r], hidden, random_tokens(tokens[r], hidden, seed + 100, r)))
        .collect();
    let outs = futures::executor::block_on(futures::future::join_all(groups.iter().zip(&inputs).map(|(g, x)| {
        let layer = HostMoeLayer::new(p, LayerWeights::generate(&p, seed, 0, g.rank(), RANKS, u128::MAX).unwrap());
        async move { layer.forward(g, x).await }
    })));
    let mut routed = 0;
    let mut received = 0;
    for (r, out) in outs.into_iter().enumerate() {
        let out = out.unwrap_or_else(|e| panic!("{model} rank {r}: {e}"));
        let (want, routing) = reference::layer(&p, inputs[r].as_bf16().unwrap(), &full);
        assert_eq!(out.routing, routing, "{model} rank {r}: routing");
        let got = out.tokens.as_bf16().unwrap();
        let diff = got.iter().zip(&want).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
        assert_eq!(diff, 0, "{model} rank {r}: {diff} of {} values differ from the reference", want.len());
        assert!(got.iter().any(|v| v.to_f32() != 0.0), "{model} rank {r}: all zeros");
        routed += routing.topk_idx.len();
        received += out.expert_counts.iter().sum::<i32>() as usize;
    }
    assert_eq!(received, routed, "{model}: every routed (token, expert) pair reached its expert once");
}

#[test]
fn softmax_router_without_shared_expert_matches_the_reference() {
    run("qwen3-30b-a3b", 128, 16, 4, 64, 11);
}

#[test]
fn sigmoid_router_with_shared_expert_matches_the_reference() {
    run("deepseek-v3", 128, 8, 3, 32, 23);
}

#[test]
fn few_experts_top_2_matches_the_reference() {
    run("mixtral-8x7b", 64, 4, 2, 96, 37);
}

/// Prefill over a high-throughput group of `ranks` ranks against [`reference::layer_prefill`]
/// (bit-identical), and on one rank against [`reference::layer`] too.
fn run_prefill(model: &str, hidden: usize, experts: usize, top_k: usize, ffn: usize, seed: u64, ranks: usize) {
    let p = preset(model).unwrap().scaled(hidden, experts, top_k, ffn);
    let tokens = [24, 7, 1, 19];
    let config =
        GroupConfig::high_throughput(experts, hidden).with_max_tokens(MaxTokens::Fixed(24)).with_max_top_k(top_k);
    let groups: Vec<Group<_>> = HostWorld::create(ranks, config).unwrap().into_iter().map(Group::new).collect();
    let full = LayerWeights::generate(&p, seed, 0, 0, 1, u128::MAX).unwrap();
    let inputs: Vec<HostTensor> = (0..ranks)
        .map(|r| HostTensor::tokens(tokens[r], hidden, random_tokens(tokens[r], hidden, seed + 200, r)))
        .collect();
    let outs = futures::executor::block_on(futures::future::join_all(groups.iter().zip(&inputs).map(|(g, x)| {
        let layer = HostMoeLayer::new(p, LayerWeights::generate(&p, seed, 0, g.rank(), ranks, u128::MAX).unwrap());
        async move { layer.forward_prefill(g, x).await }
    })));
    let (mut routed, mut received) = (0, 0);
    for (r, out) in outs.into_iter().enumerate() {
        let out = out.unwrap_or_else(|e| panic!("{model} prefill rank {r}: {e}"));
        let x = inputs[r].as_bf16().unwrap();
        let (want, routing) = reference::layer_prefill(&p, x, &full, ranks);
        assert_eq!(out.routing, routing, "{model} prefill rank {r}: routing");
        let got = out.tokens.as_bf16().unwrap();
        let diff = got.iter().zip(&want).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
        assert_eq!(diff, 0, "{model} prefill rank {r} of {ranks}: {diff} of {} values differ", want.len());
        if ranks == 1 {
            assert_eq!(want, reference::layer(&p, x, &full).0, "{model}: one rank's prefill is the decode reference");
        }
        routed += routing.topk_idx.len();
        received += out.expert_counts.iter().sum::<i32>() as usize;
    }
    assert_eq!(received, routed, "{model} prefill: every routed (token, expert) pair reached its expert once");
}

#[test]
fn prefill_over_high_throughput_matches_its_reference() {
    for ranks in [4, 1] {
        run_prefill("qwen3-30b-a3b", 128, 16, 4, 64, 41, ranks);
        run_prefill("deepseek-v3", 128, 8, 3, 32, 43, ranks);
        run_prefill("mixtral-8x7b", 64, 4, 2, 96, 47, ranks);
    }
}

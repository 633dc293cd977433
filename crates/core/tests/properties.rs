//! Property tests over random configs, run through the host backend.

use epflow_core::fp8;
use epflow_core::host::HostWorld;
use epflow_core::ops::{CombineInputs, CombineOptions, DispatchInputs, DispatchOptions, Pass};
use epflow_core::reference::within_bf16_rounding;
use epflow_core::scenario::{Scenario, ll_identity_expert_outputs};
use epflow_core::workload::RoutingKind;
use epflow_core::{GroupConfig, HostTensor, bf16};
use proptest::prelude::*;

#[derive(Debug, Clone)]
struct Case {
    ranks: usize,
    local_experts: usize,
    top_k: usize,
    hidden: usize,
    max_tokens: usize,
    tokens: Vec<usize>,
    masked: usize,
    seed: u64,
}

fn case() -> impl Strategy<Value = Case> {
    (1usize..=8, 1usize..=4, prop::sample::select(vec![8usize, 16, 128, 256]), 1usize..=12, 0usize..=6, any::<u64>())
        .prop_flat_map(|(ranks, local_experts, hidden, max_tokens, masked, seed)| {
            let e = ranks * local_experts;
            (1..=e.min(8), prop::collection::vec(0..=max_tokens, ranks)).prop_map(move |(top_k, tokens)| Case {
                ranks,
                local_experts,
                top_k,
                hidden,
                max_tokens,
                tokens,
                masked,
                seed,
            })
        })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    /// Dispatch, identity experts, combine: every token comes back as sum(w) * x (within BF16
    /// rounding); the per-expert counts add up to the valid selections.
    #[test]
    fn ll_identity_round_trip(c in case()) {
        let config = GroupConfig::low_latency(c.ranks * c.local_experts, c.max_tokens, c.hidden);
        let sc = Scenario::generate(config.clone(), c.ranks, &c.tokens, c.top_k, RoutingKind::Uniform, c.masked, c.seed);
        let rows = c.ranks * c.max_tokens;
        let results = HostWorld::run(c.ranks, config, |rank| {
            let r = rank.rank();
            let handle = rank.create_handle(&sc.topk_idx(r)).unwrap();
            let x = sc.tokens(r);
            let out = rank.dispatch(&handle, DispatchInputs::new(&x), &DispatchOptions::default()).unwrap();
            let counts: i32 = out.counts().unwrap().iter().sum();
            let experts = ll_identity_expert_outputs(out.tokens().data(), None, out.counts().unwrap(), rows, c.hidden);
            let w = sc.weights(r);
            let y = rank.combine(&handle, CombineInputs::new(&experts).with_weights(&w), &CombineOptions::default()).unwrap();
            (counts, y.tokens().as_bf16().unwrap().to_vec())
        }).unwrap();
        let total_counts: i32 = results.iter().map(|(n, _)| n).sum();
        let valid: usize = (0..c.ranks).map(|r| sc.valid_selections(r)).sum();
        prop_assert_eq!(total_counts as usize, valid);
        for (r, (_, y)) in results.iter().enumerate() {
            let inp = &sc.ranks[r];
            for t in 0..inp.num_tokens {
                let sum_w: f64 = (0..c.top_k)
                    .filter(|&k| inp.topk_idx[t * c.top_k + k] >= 0)
                    .map(|k| f64::from(inp.weights[t * c.top_k + k]))
                    .sum();
                for ch in 0..c.hidden {
                    let x = f64::from(inp.tokens[t * c.hidden + ch].to_f32());
                    let exact = (sum_w * x) as f32;
                    let got = y[t * c.hidden + ch];
                    prop_assert!(within_bf16_rounding(got, exact, (sum_w * x.abs()) as f32),
                        "rank {} token {} ch {}: got {} want {}", r, t, ch, got, exact);
                }
            }
        }
    }

    /// High-throughput forward then backward: backward dispatch of x lands where forward
    /// dispatch put x; backward combine of those rows with the received weights returns
    /// n_dest(t) * x and the original weights (0 where masked).
    #[test]
    fn ht_forward_backward_round_trip(c in case()) {
        let config = GroupConfig::high_throughput(c.ranks * c.local_experts, c.hidden);
        let sc = Scenario::generate(config.clone(), c.ranks, &c.tokens, c.top_k, RoutingKind::Uniform, c.masked, c.seed);
        let results = HostWorld::run(c.ranks, config, |rank| {
            let r = rank.rank();
            let handle = rank.create_handle(&sc.topk_idx(r)).unwrap();
            let (x, w) = (sc.tokens(r), sc.weights(r));
            let fwd = rank.dispatch(&handle, DispatchInputs::new(&x).with_weights(&w), &DispatchOptions::default()).unwrap();
            let bwd = rank.dispatch(&handle, DispatchInputs::new(&x), &DispatchOptions { pass: Pass::Backward, ..Default::default() }).unwrap();
            let same_rows = fwd.tokens() == bwd.tokens();
            let back = rank.combine(
                &handle,
                CombineInputs::new(bwd.tokens()).with_weights(fwd.topk_weights().unwrap()),
                &CombineOptions { pass: Pass::Backward, ..Default::default() },
            ).unwrap();
            (same_rows, back.tokens().as_bf16().unwrap().to_vec(), back.topk_weights().unwrap().as_f32().unwrap().to_vec())
        }).unwrap();
        let l = c.local_experts;
        for (r, (same_rows, y, w)) in results.iter().enumerate() {
            prop_assert!(same_rows);
            let inp = &sc.ranks[r];
            for t in 0..inp.num_tokens {
                let row = &inp.topk_idx[t * c.top_k..(t + 1) * c.top_k];
                let mut dests: Vec<i64> = row.iter().filter(|&&e| e >= 0).map(|&e| e / l as i64).collect();
                dests.sort_unstable();
                dests.dedup();
                for ch in 0..c.hidden {
                    let x = inp.tokens[t * c.hidden + ch].to_f32();
                    prop_assert_eq!(y[t * c.hidden + ch], bf16::from_f32(dests.len() as f32 * x));
                }
                for k in 0..c.top_k {
                    let want = if row[k] >= 0 { inp.weights[t * c.top_k + k] } else { 0.0 };
                    prop_assert_eq!(w[t * c.top_k + k].to_bits(), want.to_bits());
                }
            }
        }
    }

    /// FP8 quantize then dequantize: each value is within half an e4m3 step (at its scale) of
    /// the original, plus fp32 rounding of the two multiplications.
    #[test]
    fn fp8_error_is_bounded_by_the_e4m3_step(
        vals in prop::collection::vec(-1.0f32..1.0, 256),
        exp in -20i32..20,
        round_scales in any::<bool>(),
    ) {
        let x: Vec<bf16> = vals.iter().map(|v| bf16::from_f32(v * 2f32.powi(exp))).collect();
        let (q, s) = fp8::quantize_bf16(&x, 2, 128, round_scales);
        let back = fp8::dequantize(&q, &s, 2, 128);
        for (i, (orig, got)) in x.iter().zip(&back).enumerate() {
            let scale = s[i / 128];
            let v = orig.to_f32();
            let bound = scale * fp8::e4m3_half_step(v / scale) * (1.0 + 2f32.powi(-20)) + v.abs() * 2f32.powi(-22);
            prop_assert!((got - v).abs() <= bound, "x={} got={} scale={} bound={}", v, got, scale, bound);
        }
    }
}

#[test]
fn fp8_host_tensors_survive_a_round_trip() {
    // A quick non-random check that FP8 dispatch output dequantizes close to its input.
    let config = GroupConfig::low_latency(4, 2, 128)
        .with_dispatch_dtype(epflow_core::DispatchDtype::Fp8 { round_scales: false });
    let out = HostWorld::run(1, config, |rank| {
        let h = rank.create_handle(&HostTensor::topk_idx(2, 1, vec![0, 0])).unwrap();
        let x = HostTensor::tokens(2, 128, (0..256).map(|i| bf16::from_f32(i as f32 / 100.0 - 1.0)).collect());
        let o = rank.dispatch(&h, DispatchInputs::new(&x), &DispatchOptions::default()).unwrap();
        let deq =
            fp8::dequantize(&o.tokens().as_fp8().unwrap()[..256], &o.scales().unwrap().as_f32().unwrap()[..2], 2, 128);
        (x.as_bf16().unwrap().to_vec(), deq)
    })
    .unwrap();
    let (x, deq) = &out[0];
    for (a, b) in x.iter().zip(deq) {
        assert!((a.to_f32() - b).abs() <= a.to_f32().abs() / 16.0 + 2f32.powi(-10) * 0.01);
    }
}

mod plans {
    use epflow_core::ops::Layout;
    use epflow_core::routing::{ChannelPlan, ChannelReceive, CombinePositions, ExpertPlacement, Routing, SendPlan};
    use epflow_core::workload::{RoutingKind, RoutingSpec, random_topk_idx};
    use proptest::prelude::*;

    fn routings(ranks: usize, l: usize, k: usize, tokens: &[usize], seed: u64) -> Vec<Routing> {
        (0..ranks)
            .map(|r| {
                let spec = RoutingSpec {
                    num_tokens: tokens[r],
                    top_k: k,
                    num_experts: ranks * l,
                    num_ranks: ranks,
                    masked: 3,
                    kind: RoutingKind::Uniform,
                };
                Routing::new(random_topk_idx(&spec, seed, r), tokens[r], k, ranks * l).unwrap()
            })
            .collect()
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

        /// The channel plan holds exactly the send plan's copies, cut into channels of
        /// consecutive tokens; the count exchange of every rank's plan gives each receiver the
        /// rows and expert counts the send plans say.
        #[test]
        fn channel_plans_follow_the_send_plans(
            ranks in 1usize..=8, l in 1usize..=4, channels in 1usize..=9, seed in any::<u64>(),
            tokens in prop::collection::vec(0usize..=40, 8),
        ) {
            let k = (ranks * l).min(4);
            let placement = ExpertPlacement::new(ranks * l, ranks);
            let rs = routings(ranks, l, k, &tokens, seed);
            let plans: Vec<ChannelPlan> = rs.iter().map(|r| ChannelPlan::new(r, placement, channels)).collect();
            let sends: Vec<SendPlan> = rs.iter().map(|r| SendPlan::new(r, placement)).collect();
            let words = channels + l;
            for (s, (cp, sp)) in plans.iter().zip(&sends).enumerate() {
                let tpc = cp.tokens_per_channel;
                for (d, (first, n)) in cp.send_blocks(ranks, channels).into_iter().enumerate() {
                    let tokens: Vec<i32> = sp.copies_to(d).iter().map(|c| c.token as i32).collect();
                    prop_assert_eq!(&cp.send_list[first..first + n], tokens.as_slice(), "rank {} to {}", s, d);
                    for c in 0..channels {
                        let (a, b) = (cp.send_off[d * (channels + 1) + c] as usize, cp.send_off[d * (channels + 1) + c + 1] as usize);
                        prop_assert!(cp.send_list[a..b].iter().all(|&t| t as usize / tpc == c));
                        prop_assert_eq!(cp.msgs[d * words + c] as usize, b - a);
                        for (i, &t) in cp.send_list[a..b].iter().enumerate() {
                            prop_assert_eq!(cp.copy_ord[t as usize * ranks + d] as usize, i);
                        }
                    }
                }
            }
            for d in 0..ranks {
                let received: Vec<i32> = plans.iter().flat_map(|p| p.msgs[d * words..(d + 1) * words].to_vec()).collect();
                let recv = ChannelReceive::from_messages(&received, ranks, channels);
                let copies: usize = sends.iter().map(|p| p.copies_to(d).len()).sum();
                prop_assert_eq!(recv.num_recv, copies);
                let selections: usize = sends.iter().flat_map(|p| p.copies_to(d)).map(|c| c.selections.len()).sum();
                prop_assert_eq!(recv.expert_counts.iter().sum::<i32>() as usize, selections);
                let blocks = recv.recv_blocks(ranks, channels);
                for (s, (_, rows)) in blocks.iter().enumerate() {
                    prop_assert_eq!(*rows, sends[s].copies_to(d).len());
                }
            }
        }

        /// Combine positions number every selection to a rank of the mask once (rank-major: each
        /// rank's first selection of a token), in blocks per rank sized by those selections.
        #[test]
        fn combine_positions_are_a_numbering_per_block(
            ranks in 1usize..=8, l in 1usize..=4, mask in any::<u32>(), seed in any::<u64>(), b in 0usize..=30,
            rank_major in any::<bool>(),
        ) {
            let k = (ranks * l).min(5);
            let placement = ExpertPlacement::new(ranks * l, ranks);
            let r = &routings(ranks, l, k, &[b; 8], seed)[0];
            let layout = if rank_major { Layout::RankMajor } else { Layout::ExpertMajor };
            let p = CombinePositions::new(r, placement, mask, layout);
            let mut seen = vec![false; p.pos.len()];
            for t in 0..b {
                for j in 0..k {
                    let pos = p.pos[t * k + j];
                    let owner = |i: usize| r.expert(t, i).map(|e| placement.owner(e));
                    let repeated = rank_major && (0..j).any(|i| owner(i).is_some() && owner(i) == owner(j));
                    match owner(j) {
                        Some(d) if mask >> d & 1 == 1 && !repeated => {
                            let (first, n) = p.blocks[d];
                            prop_assert!((first..first + n).contains(&(pos as usize)));
                            prop_assert!(!std::mem::replace(&mut seen[pos as usize], true));
                        }
                        _ => prop_assert_eq!(pos, -1),
                    }
                }
            }
        }
    }
}

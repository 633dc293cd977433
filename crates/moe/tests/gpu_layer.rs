//! The MoE layer on GPUs against the CPU reference (skipped, saying so, without a GPU).
//!
//! - The router's top-k kernel on logits full of ties: indices equal to
//!   [`reference::top_k`]'s, weights within 1e-6 of [`reference::weights_of`]'s.
//! - The whole layer (router, handle in stream order, dispatch, SwiGLU experts, combine,
//!   shared expert) on small shapes of each preset's kind, against [`reference::layer`]: the
//!   routing equal wherever the CPU's logits are not within 1e-3 of a tie (cuBLAS sums in
//!   another order), and every output value within the BF16 tolerance
//!   `|got - want| <= (|want| + rms(want)) / 64`.
//! - The same layer over a high-throughput group (prefill: [`Lane::forward_grouped`], grouped
//!   experts at the handle's counts), against [`reference::layer_prefill`] (the ranks' partial
//!   sums rounded before the combine adds them) with the same tolerance.
//! - Micro-batches through two layers on two lanes, interleaved on the device, their compute
//!   replayed from CUDA graphs, bit-identical to the same micro-batches run one after another on
//!   one lane enqueueing call by call (`EPFLOW_GPU_ITERS` micro-batches, default 50; 500 makes
//!   the 1,000 layer steps of the issue).
//! - The same micro-batches through layers captured whole ([`Lane::capture_layers`]: one CUDA
//!   graph per layer with its dispatch and combine), two lanes replayed interleaved,
//!   bit-identical to the stream-ordered layer on one lane.
//!
//! Ranks: one on GPU 0, or `EPFLOW_TEST_DEVICES` (e.g. `0,0`: two ranks sharing GPU 0, a
//! functional check).

use std::sync::Arc;

use epflow_async::Group;
use epflow_core::workload::random_tokens;
use epflow_core::{GroupConfig, HostTensor, MaxTokens, TensorTag, bf16};
use epflow_kernels::{DeviceTensor, GpuRank, GpuWorld, device_count};
use epflow_moe::gpu::{GpuMoeModel, Lane, ModelOptions};
use epflow_moe::{LayerWeights, ModelPreset, preset, reference};

/// The devices of the ranks, or `None` after printing why `test` is skipped.
fn devices(test: &str) -> Option<Vec<usize>> {
    if device_count() == 0 {
        eprintln!("SKIPPED {test}: no GPU");
        return None;
    }
    match std::env::var("EPFLOW_TEST_DEVICES") {
        Ok(list) => Some(list.split(',').filter_map(|d| d.trim().parse().ok()).collect()),
        Err(_) => Some(vec![0]),
    }
}

fn seed() -> u64 {
    std::env::var("EPFLOW_TEST_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or_else(|| {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(1, |d| d.as_nanos() as u64)
    })
}

fn world(devices: &[usize], p: &ModelPreset, tokens: usize, sets: usize) -> Vec<Group<GpuRank>> {
    let config =
        GroupConfig::low_latency(p.num_experts, tokens, p.hidden).with_max_top_k(p.top_k).with_buffer_sets(sets);
    GpuWorld::create(devices, config).expect("group").into_iter().map(Group::new).collect()
}

/// A high-throughput group (prefill) for at most `tokens` tokens per rank.
fn ht_world(devices: &[usize], p: &ModelPreset, tokens: usize) -> Vec<Group<GpuRank>> {
    let config = GroupConfig::high_throughput(p.num_experts, p.hidden)
        .with_max_tokens(MaxTokens::Fixed(tokens))
        .with_max_top_k(p.top_k);
    GpuWorld::create(devices, config).expect("high-throughput group").into_iter().map(Group::new).collect()
}

/// Which path a layer test runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Path {
    /// Low-latency dispatch, padded experts ([`Lane::forward`]).
    Decode,
    /// High-throughput dispatch, grouped experts ([`Lane::forward_grouped`]).
    Prefill,
}

fn on_ranks<R: Send>(groups: &[Group<GpuRank>], f: impl Fn(&Group<GpuRank>) -> R + Sync) -> Vec<R> {
    std::thread::scope(|s| {
        let hs: Vec<_> = groups.iter().map(|g| s.spawn(|| f(g))).collect();
        hs.into_iter().map(|h| h.join().expect("rank thread")).collect()
    })
}

fn sync(lane: &Lane) {
    lane.stream().synchronize().expect("lane stream");
}

fn download(t: &DeviceTensor, ctx: &Arc<cudarc::driver::CudaContext>) -> HostTensor {
    t.download(ctx).expect("download")
}

/// `EPFLOW_GPU_ITERS` (micro-batches of the multi-lane tests), default 50.
fn gpu_iters() -> usize {
    std::env::var("EPFLOW_GPU_ITERS").ok().and_then(|s| s.parse().ok()).unwrap_or(50)
}

/// Four `[b x H]` token sets of rank `g.rank()` on its device.
fn token_sets(g: &Group<GpuRank>, p: &ModelPreset, b: usize, seed: u64) -> Vec<DeviceTensor> {
    let r = g.rank();
    (0..4)
        .map(|i| g.backend().upload(&HostTensor::tokens(b, p.hidden, random_tokens(b, p.hidden, seed + i, r))).unwrap())
        .collect()
}

/// One rank's micro-batch outputs, in order.
type Outputs = Vec<Vec<bf16>>;

/// Every rank's `(got, want)` micro-batch outputs, `iters` of each, bit for bit.
fn assert_bit_identical(outs: Vec<(Outputs, Outputs)>, iters: usize, what: &str) {
    for (r, (got, want)) in outs.into_iter().enumerate() {
        assert_eq!(got.len(), iters);
        for (i, (a, s)) in got.iter().zip(&want).enumerate() {
            let diff = a.iter().zip(s).filter(|(x, y)| x.to_bits() != y.to_bits()).count();
            assert_eq!(diff, 0, "rank {r} micro-batch {i}: {diff} values differ between {what}");
        }
    }
}

#[test]
fn router_top_k_matches_the_reference_ties_included() {
    let Some(devices) = devices("router_top_k_matches_the_reference_ties_included") else { return };
    let seed = seed();
    eprintln!("seed {seed}");
    for (model, experts, k) in [("qwen3-30b-a3b", 128, 8), ("deepseek-v3", 256, 8), ("mixtral-8x7b", 8, 2)] {
        let p = preset(model).unwrap().scaled(64, experts, k, 32);
        let g = &world(&devices[..1], &p, 8, 2)[0];
        let m = GpuMoeModel::new(g.backend(), p, ModelOptions { seed, layers: 1, attention: false }, 0).unwrap();
        let b = 97;
        // Logits in steps of 1/4 in [-2, 2): ties everywhere.
        let x = random_tokens(b, experts, seed, 0);
        let mut logits: Vec<f32> = x.iter().map(|v| (v.to_f32() * 8.0).round() / 4.0).collect();
        // Token 0: its two highest are -0.0 (expert 3) and 0.0 (expert 1), a tie.
        logits[..experts]
            .iter_mut()
            .enumerate()
            .for_each(|(e, l)| *l = [-1.0, 0.0, -1.0, -0.0][e % 4] - (e / 4) as f32);
        let t = HostTensor::new(TensorTag::Tokens, &[b, experts], epflow_core::HostData::F32(logits.clone()));
        let (idx, w) = m.route_logits(&g.backend().upload(&t).unwrap()).unwrap();
        let ctx = g.backend().context();
        let (idx, w) = (download(&idx, ctx), download(&w, ctx));
        let (idx, w) = (idx.as_i64().unwrap(), w.as_f32().unwrap());
        let mut ties = 0;
        for t in 0..b {
            let row = &logits[t * experts..(t + 1) * experts];
            let want = reference::top_k(row, k);
            let got: Vec<usize> = idx[t * k..(t + 1) * k].iter().map(|&i| i as usize).collect();
            assert_eq!(got, want, "{model} token {t}: top-{k} of {row:?}");
            ties += usize::from(want.windows(2).any(|p| row[p[0]] == row[p[1]]));
            let (ww, scale) = reference::weights_of(p.scoring, &want.iter().map(|&i| row[i]).collect::<Vec<_>>());
            for (j, (&g, wv)) in w[t * k..(t + 1) * k].iter().zip(ww).enumerate() {
                assert!(
                    (g - wv * scale).abs() <= 1e-6 * (wv * scale).abs().max(1.0),
                    "{model} token {t} entry {j}: {g} vs {}",
                    wv * scale
                );
            }
        }
        assert!(ties > 0, "{model}: the logits hold ties ({ties} tokens with a tie in their top-k)");
        eprintln!("ok: {model} router top-{k} of {experts} on {b} tokens, {ties} with tied choices");
    }
}

/// Runs one layer on every rank and checks it against the reference.
fn layer_against_reference(path: Path, model: &str, hidden: usize, experts: usize, k: usize, ffn: usize) {
    let test = format!("layer_matches_the_reference ({model}, {path:?})");
    let Some(devices) = devices(&test) else { return };
    let seed = seed();
    let p = preset(model).unwrap().scaled(hidden, experts, k, ffn);
    let ranks = devices.len();
    let b = if path == Path::Prefill { 200 } else { 24 };
    let groups = if path == Path::Prefill { ht_world(&devices, &p, b) } else { world(&devices, &p, b, 2) };
    let full = LayerWeights::generate(&p, seed, 0, 0, 1, u128::MAX).unwrap();
    let results = on_ranks(&groups, |g| {
        let r = g.rank();
        let m = GpuMoeModel::new(g.backend(), p, ModelOptions { seed, layers: 1, attention: false }, 0).unwrap();
        let x = HostTensor::tokens(b, hidden, random_tokens(b, hidden, seed + 7, r));
        let xd = g.backend().upload(&x).unwrap();
        let (lane, step) = match path {
            Path::Decode => {
                let lane = Lane::new(&m, b, ranks * b).unwrap();
                let step = futures::executor::block_on(lane.forward(&m, g, 0, &xd)).unwrap();
                (lane, step)
            }
            Path::Prefill => {
                let lane = Lane::new(&m, b, 0).unwrap().with_grouped_experts(&m, ranks * b).unwrap();
                let step = futures::executor::block_on(lane.forward_grouped(&m, g, 0, &xd)).unwrap();
                (lane, step)
            }
        };
        for c in step.completions {
            futures::executor::block_on(c).unwrap();
        }
        sync(&lane);
        let ctx = g.backend().context();
        let (idx, _) = lane.routing();
        (x, download(&step.output, ctx), download(idx, ctx))
    });
    let (mut checked, mut near_ties, mut worst) = (0, 0, 0f32);
    for (r, (x, out, idx)) in results.into_iter().enumerate() {
        let xs = x.as_bf16().unwrap();
        let (want, routing) = match path {
            Path::Decode => reference::layer(&p, xs, &full),
            Path::Prefill => reference::layer_prefill(&p, xs, &full, ranks),
        };
        let got = out.as_bf16().unwrap();
        let idx = idx.as_i64().unwrap();
        let rms = (want.iter().map(|v| v.to_f32().powi(2)).sum::<f32>() / want.len() as f32).sqrt();
        assert!(rms > 0.0, "{model} rank {r}: the reference output is all zeros");
        for t in 0..b {
            // The CPU's logits of this token: is its k-th choice within 1e-3 of the next?
            let row = &xs[t * hidden..(t + 1) * hidden];
            let logits: Vec<f32> = (0..experts)
                .map(|e| {
                    row.iter()
                        .enumerate()
                        .fold(0f32, |acc, (c, v)| v.to_f32().mul_add(full.gate[c * experts + e].to_f32(), acc))
                })
                .collect();
            let order = reference::top_k(&logits, (k + 1).min(experts));
            let close = order.len() > k && (logits[order[k - 1]] - logits[order[k]]).abs() < 1e-3;
            let same = idx[t * k..(t + 1) * k] == routing.topk_idx[t * k..(t + 1) * k];
            if close {
                near_ties += 1;
                if !same {
                    continue;
                }
            }
            assert!(
                same,
                "{model} rank {r} token {t}: routed to {:?}, the reference {:?}",
                &idx[t * k..(t + 1) * k],
                &routing.topk_idx[t * k..(t + 1) * k]
            );
            for c in 0..hidden {
                let (g, w) = (got[t * hidden + c].to_f32(), want[t * hidden + c].to_f32());
                let err = (g - w).abs();
                worst = worst.max(err / (w.abs() + rms));
                assert!(err <= (w.abs() + rms) / 64.0, "{model} rank {r} token {t} column {c}: {g} vs {w} (rms {rms})");
            }
            checked += 1;
        }
    }
    assert!(checked >= ranks * b - near_ties && checked > 0);
    eprintln!(
        "ok: {test} on {ranks} rank(s): {checked} tokens checked, {near_ties} near-ties, worst error {worst:.2e} x (|want| + rms)"
    );
}

#[test]
fn layer_matches_the_reference() {
    layer_against_reference(Path::Decode, "qwen3-30b-a3b", 256, 16, 4, 128);
    layer_against_reference(Path::Decode, "deepseek-v3", 256, 16, 4, 64);
    layer_against_reference(Path::Decode, "mixtral-8x7b", 128, 4, 2, 256);
}

#[test]
fn prefill_layer_matches_the_reference() {
    layer_against_reference(Path::Prefill, "qwen3-30b-a3b", 256, 16, 4, 128);
    layer_against_reference(Path::Prefill, "deepseek-v3", 256, 16, 4, 64);
    layer_against_reference(Path::Prefill, "mixtral-8x7b", 128, 4, 2, 256);
}

#[test]
fn interleaved_lanes_with_graphs_are_bit_identical_to_one_eager_lane() {
    let Some(devices) = devices("interleaved_lanes_with_graphs_are_bit_identical_to_one_eager_lane") else { return };
    let seed = seed();
    let iters = gpu_iters();
    let p = preset("deepseek-v3").unwrap().scaled(256, 16, 4, 64);
    let (b, layers, ranks) = (16, 2, devices.len());
    let groups = world(&devices, &p, b, 2);
    let outs = on_ranks(&groups, |g| {
        let m = GpuMoeModel::new(g.backend(), p, ModelOptions { seed, layers, attention: true }, 0).unwrap();
        // Two lanes replaying their compute as CUDA graphs, one enqueueing it call by call.
        let lanes = [
            Lane::new(&m, b, ranks * b).unwrap().with_graphs(true).unwrap(),
            Lane::new(&m, b, ranks * b).unwrap().with_graphs(true).unwrap(),
        ];
        let eager = Lane::new(&m, b, ranks * b).unwrap();
        let inputs = token_sets(g, &p, b, seed);
        let ctx = g.backend().context();
        let run = |lanes: &[&Lane]| -> Vec<Vec<bf16>> {
            let mut finals = Vec::new();
            for chunk in (0..iters).collect::<Vec<_>>().chunks(lanes.len()) {
                // Layer by layer, the chunk's micro-batches interleaved on their lanes.
                let mut xs: Vec<DeviceTensor> = chunk.iter().map(|&i| inputs[i % inputs.len()].clone()).collect();
                let mut completions = Vec::new();
                for layer in 0..layers {
                    for (j, x) in xs.iter_mut().enumerate() {
                        let step = futures::executor::block_on(lanes[j].forward(&m, g, layer, x)).unwrap();
                        completions.extend(step.completions);
                        *x = step.output;
                    }
                }
                for c in completions {
                    futures::executor::block_on(c).unwrap();
                }
                for (j, x) in xs.iter().enumerate() {
                    sync(lanes[j]);
                    finals.push(download(x, ctx).as_bf16().unwrap().to_vec());
                }
            }
            finals
        };
        (run(&[&lanes[0], &lanes[1]]), run(&[&eager]))
    });
    assert_bit_identical(outs, iters, "two lanes and one");
    eprintln!(
        "ok: {iters} micro-batches x {layers} layers on {ranks} rank(s): two interleaved lanes bit-identical to one"
    );
}

/// [`Lane::capture_layers`]: two lanes' layers captured whole (router, shared expert branch,
/// dispatch, experts, combine, add: one CUDA graph per layer) and replayed interleaved are
/// bit-identical to the same micro-batches through [`Lane::forward`] on one lane, one after
/// another (`EPFLOW_GPU_ITERS` micro-batches, default 50).
#[test]
fn layers_captured_whole_are_bit_identical_to_the_stream_ordered_layer() {
    let Some(devices) = devices("layers_captured_whole_are_bit_identical_to_the_stream_ordered_layer") else {
        return;
    };
    let seed = seed();
    let iters = gpu_iters();
    let p = preset("deepseek-v3").unwrap().scaled(256, 16, 4, 64);
    let (b, layers, ranks) = (16, 2, devices.len());
    let groups = world(&devices, &p, b, 2);
    let outs = on_ranks(&groups, |g| {
        let m = GpuMoeModel::new(g.backend(), p, ModelOptions { seed, layers, attention: true }, 0).unwrap();
        let eager = Lane::new(&m, b, ranks * b).unwrap();
        let lanes = [Lane::new(&m, b, ranks * b).unwrap(), Lane::new(&m, b, ranks * b).unwrap()];
        let inputs = token_sets(g, &p, b, seed);
        let ctx = g.backend().context();
        // One lane, stream-ordered, one micro-batch after another (this also loads every kernel
        // the captures hold).
        let mut serial = Vec::new();
        for i in 0..iters {
            let mut x = inputs[i % inputs.len()].clone();
            for layer in 0..layers {
                let step = futures::executor::block_on(eager.forward(&m, g, layer, &x)).unwrap();
                for c in step.completions {
                    futures::executor::block_on(c).unwrap();
                }
                x = step.output;
            }
            sync(&eager);
            serial.push(download(&x, ctx).as_bf16().unwrap().to_vec());
        }
        let steps: Vec<_> = lanes.iter().map(|l| l.capture_layers(&m, g.backend(), layers).unwrap()).collect();
        let mut captured = Vec::new();
        for chunk in (0..iters).collect::<Vec<_>>().chunks(steps.len()) {
            for (s, &i) in steps.iter().zip(chunk) {
                s.load_input(&inputs[i % inputs.len()]).unwrap();
            }
            let mut replays = Vec::new();
            for layer in 0..layers {
                for s in steps.iter().take(chunk.len()) {
                    replays.push(g.replay(s.step(layer).unwrap()));
                }
            }
            for r in replays {
                futures::executor::block_on(r).unwrap();
            }
            for s in steps.iter().take(chunk.len()) {
                s.stream().synchronize().unwrap();
                captured.push(download(s.output(), ctx).as_bf16().unwrap().to_vec());
            }
        }
        (captured, serial)
    });
    assert_bit_identical(outs, iters, "the layer graphs and the layer");
    eprintln!(
        "ok: {iters} micro-batches x {layers} layers on {ranks} rank(s): layers captured whole, two lanes interleaved, bit-identical to the stream-ordered layer"
    );
}

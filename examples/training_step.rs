//! A training step's MoE communication in stream order (high-throughput): every layer routes
//! anew, creates its handle in stream order (`RecvRows::Bound`: no operation waits for `N` on the
//! host), and enqueues the forward dispatch, the forward combine, the backward dispatch and the
//! backward combine on one stream before any completion is awaited. Then every completion, and
//! the forward combine's outputs against the CPU reference (identity experts: each expert
//! returns its rows; the backward pair sends the tokens out again as output gradients and their
//! rows back with weight gradients).
//!
//! - `--backend gpu` (the default with 2 GPUs or more): one rank per GPU (up to 8), the kernels
//!   on a stream of each rank's.
//! - `--backend host`: 4 ranks on the host backend (same semantics; completes on the host).
//!
//! ```sh
//! cargo run --release --example training_step [-- --backend host|gpu --layers 8 --tokens 1024]
//! ```

use std::time::Instant;

use epflow::Group;
use epflow::core::backend::Backend;
use epflow::core::handle::RoutingHandle;
use epflow::core::host::{HostRank, HostStream, HostWorld};
use epflow::core::ops::{
    CombineInputs, CombineOptions, DispatchInputs, DispatchOptions, HandleOptions, Pass, RecvRows,
};
use epflow::core::scenario::Scenario;
use epflow::core::verify::{Tolerance, check_bf16};
use epflow::core::workload::RoutingKind;
use epflow::core::{Error, GroupConfig, HostTensor, MaxTokens, Result, bf16};
use epflow::kernels::{DeviceTensor, GpuRank, GpuWorld};

const EXPERTS: usize = 64;
const HIDDEN: usize = 2048;
const TOP_K: usize = 8;

#[path = "common/flags.rs"]
mod flags;

use flags::BackendKind;

/// A training step's MoE communication in stream order, checked against the CPU reference.
/// Bounds: `--layers` 1..=1024, `--tokens` 1..=65536 per rank (the memory a layer needs is
/// checked first); the top-k is 8 of 64 experts (`MAX_TOP_K` is 16), H 2048.
#[derive(Debug, clap::Parser)]
#[command(name = "training_step")]
struct Flags {
    /// `gpu` (the default with 2+ GPUs) or `host`.
    #[arg(long, value_enum)]
    backend: Option<BackendKind>,
    /// Layers, each with a fresh routing and handle.
    #[arg(long, default_value_t = 8, value_parser = flags::int_in(1usize, 1024))]
    layers: usize,
    /// Tokens per rank.
    #[arg(long, default_value_t = 1024, value_parser = flags::int_in(1usize, 65_536))]
    tokens: usize,
}

/// Bytes one layer's tensors take on one of `ranks` ranks, at most: the tokens, and per pass
/// up to every rank's tokens received and sent back (`[R*B x H]` BF16, forward and backward,
/// dispatch and combine).
fn layer_bytes(ranks: usize, tokens: usize) -> u128 {
    (tokens * HIDDEN * 2) as u128 * (1 + 4 * ranks) as u128
}

/// What the step needs of a backend beyond [`Backend`]: tensors up, combined tokens down, a
/// stream to order the step on.
trait Side: Backend {
    fn up(&self, t: &HostTensor) -> Result<Self::Tensor>;
    fn tokens_of(d: &Self::DispatchOutput) -> &Self::Tensor;
    fn combined(&self, out: &Self::CombineOutput) -> Result<Vec<bf16>>;
    fn step_stream(&self) -> Result<Self::Stream>;
}

impl Side for HostRank {
    fn up(&self, t: &HostTensor) -> Result<HostTensor> {
        Ok(t.clone())
    }
    fn tokens_of(d: &epflow::core::host::HostDispatchOutput) -> &HostTensor {
        d.tokens()
    }
    fn combined(&self, out: &epflow::core::host::HostCombineOutput) -> Result<Vec<bf16>> {
        Ok(out.tokens().as_bf16().unwrap_or_default().to_vec())
    }
    fn step_stream(&self) -> Result<HostStream> {
        Ok(HostStream)
    }
}

impl Side for GpuRank {
    fn up(&self, t: &HostTensor) -> Result<DeviceTensor> {
        self.upload(t)
    }
    fn tokens_of(d: &epflow::kernels::GpuDispatchOutput) -> &DeviceTensor {
        d.tokens()
    }
    fn combined(&self, out: &epflow::kernels::GpuCombineOutput) -> Result<Vec<bf16>> {
        Ok(out.to_host()?.tokens.as_bf16().unwrap_or_default().to_vec())
    }
    fn step_stream(&self) -> Result<std::sync::Arc<cudarc::driver::CudaStream>> {
        self.context().new_stream().map_err(|e| Error::Backend(format!("new stream: {e}")))
    }
}

/// One rank's inputs of a layer, on its device: the routing, the tokens and their weights, and
/// the weight gradients of the backward combine (`rows x K`, `rows` the handle's received rows).
struct LayerInputs<T> {
    idx: T,
    x: T,
    w: T,
    wg: T,
    rows: usize,
}

fn upload<B: Side>(b: &B, sc: &Scenario, r: usize, rows: usize) -> Result<LayerInputs<B::Tensor>> {
    Ok(LayerInputs {
        idx: b.up(&sc.topk_idx(r))?,
        x: b.up(&sc.tokens(r))?,
        w: b.up(&sc.weights(r))?,
        wg: b.up(&HostTensor::topk_weights(rows, sc.top_k, vec![0.5; rows * sc.top_k]))?,
        rows,
    })
}

/// One rank's layer: the five operations enqueued in stream order, then their completions.
/// Returns the forward and backward combine outputs.
async fn layer<B: Side>(
    g: &Group<B>,
    inp: &LayerInputs<B::Tensor>,
    stream: &B::Stream,
) -> Result<(B::CombineOutput, B::CombineOutput)> {
    let opts = HandleOptions::default().with_recv_rows(RecvRows::Bound);
    let (h, built) = g.create_handle_with(&inp.idx, &opts).after(stream).complete_on(stream).await?;
    if h.recv_rows() != Some(inp.rows) {
        return Err(Error::Backend(format!("received rows {:?}, the bound is {}", h.recv_rows(), inp.rows)));
    }
    let fwd = DispatchInputs::new(&inp.x).with_weights(&inp.w);
    let (d, dd) = g.dispatch(&h, fwd).after(stream).complete_on(stream).await?;
    // Identity experts: the dispatched rows go straight back (a real layer computes here, on
    // `stream`, reading the counts on the device).
    let (y, yd) = g.combine(&h, CombineInputs::new(B::tokens_of(&d))).after(stream).complete_on(stream).await?;
    let bwd = DispatchOptions { pass: Pass::Backward, ..DispatchOptions::default() };
    let (gd, gdd) = g.dispatch_with(&h, DispatchInputs::new(&inp.x), &bwd).after(stream).complete_on(stream).await?;
    let copts = CombineOptions { pass: Pass::Backward, ..Default::default() };
    let grads = CombineInputs::new(B::tokens_of(&gd)).with_weights(&inp.wg);
    let (gy, gyd) = g.combine_with(&h, grads, &copts).after(stream).complete_on(stream).await?;
    for done in [built, dd, yd, gdd, gyd] {
        done.await?;
    }
    Ok((y, gy))
}

fn run<B: Side>(groups: Vec<Group<B>>, config: &GroupConfig, layers: usize, tokens: usize) -> Result<()> {
    let n = groups.len();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(n.max(2))
        .enable_all()
        .build()
        .map_err(|e| Error::Backend(format!("tokio runtime: {e}")))?;
    let streams = groups.iter().map(|g| g.backend().step_stream()).collect::<Result<Vec<_>>>()?;
    for l in 0..layers {
        // Uneven token counts: the last rank routes half.
        let per_rank: Vec<usize> = (0..n).map(|r| if r + 1 == n { tokens / 2 } else { tokens }).collect();
        let sc = Scenario::generate(config.clone(), n, &per_rank, TOP_K, RoutingKind::Uniform, 10, 0x5eed + l as u64);
        let refs = sc.ht_dispatch_reference()?;
        let want = sc.ht_combine_identity_reference(&refs)?;
        // Inputs go up before the clock starts and outputs come down after it stops: the figure
        // is the layer's communication, from the first enqueue to the last completion.
        let rows = n * tokens;
        let inputs =
            groups.iter().enumerate().map(|(r, g)| upload(g.backend(), &sc, r, rows)).collect::<Result<Vec<_>>>()?;
        let start = Instant::now();
        let outs = rt.block_on(futures::future::join_all(
            groups.iter().zip(&inputs).zip(&streams).map(|((g, inp), s)| layer(g, inp, s)),
        ));
        let took = start.elapsed();
        for (r, out) in outs.into_iter().enumerate() {
            let (y, _gy) = out?;
            let y = groups[r].backend().combined(&y)?;
            let rep = check_bf16("forward combine", &want[r], &y, Tolerance::OneUlp);
            if !rep.ok() {
                return Err(Error::Backend(format!("layer {l}, rank {r}: {rep:?}")));
            }
        }
        println!(
            "layer {l}: handle + forward pair + backward pair on {n} ranks in {:.0} us (host clock, first enqueue to \
             last completion), forward combine PASSED",
            took.as_secs_f64() * 1e6
        );
    }
    println!(
        "{layers} layers, a fresh routing and handle each, every operation enqueued before any completion was awaited"
    );
    Ok(())
}

fn main() -> Result<()> {
    let f = <Flags as clap::Parser>::parse();
    let gpus = epflow::kernels::device_count();
    let backend = f.backend.unwrap_or(if gpus >= 2 { BackendKind::Gpu } else { BackendKind::Host });
    let (layers, tokens) = (f.layers, f.tokens);
    let config = GroupConfig::high_throughput(EXPERTS, HIDDEN).with_max_tokens(MaxTokens::Fixed(tokens));
    match backend {
        BackendKind::Gpu => {
            let devices: Vec<usize> = (0..gpus.min(8)).collect();
            if devices.len() < 2 {
                return Err(Error::Unsupported(format!("--backend gpu needs 2 GPUs, this machine has {gpus}")));
            }
            let ranks = GpuWorld::create(&devices, config.clone())?;
            for rk in &ranks {
                flags::check_device_memory(
                    rk.context(),
                    || format!("GPU {}: a layer of {tokens} tokens per rank", rk.device()),
                    layer_bytes(devices.len(), tokens),
                )?;
            }
            run(ranks.into_iter().map(Group::new).collect(), &config, layers, tokens)
        }
        BackendKind::Host => {
            epflow::core::host::memory::check_host_alloc(
                || format!("a layer of {tokens} tokens on each of 4 ranks"),
                4 * layer_bytes(4, tokens),
            )?;
            let groups = HostWorld::create(4, config.clone())?.into_iter().map(Group::new).collect();
            run(groups, &config, layers, tokens)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A bad flag is a usage error (exit code 2), never the default silently.
    #[test]
    fn bad_flags_are_usage_errors() {
        use clap::Parser;
        for bad in
            [&["--layers", "abc"][..], &["--layers", "0"], &["--tokens", "1e9"], &["--tokens", "0"], &["--bogus"]]
        {
            let argv = std::iter::once("training_step").chain(bad.iter().copied());
            let e = Flags::try_parse_from(argv).expect_err("accepted");
            assert_eq!(e.exit_code(), 2, "{bad:?}: {e}");
        }
        let f = Flags::try_parse_from(["training_step", "--layers", "3"]).expect("valid");
        assert_eq!((f.layers, f.tokens), (3, 1024));
    }

    /// Two layers on the host backend (4 ranks, uneven tokens): every forward combine matches
    /// the reference (`run` returns an error otherwise).
    #[test]
    fn layers_in_stream_order_match_the_reference() {
        let config = GroupConfig::high_throughput(EXPERTS, HIDDEN).with_max_tokens(MaxTokens::Fixed(64));
        let groups = HostWorld::create(4, config.clone()).unwrap().into_iter().map(Group::new).collect();
        run(groups, &config, 2, 64).unwrap();
    }
}

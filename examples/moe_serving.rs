//! MoE serving: the shape our users run. A tokio program per rank receives requests at a
//! configurable rate, batches them into micro-batches of `--batch` tokens (padded, as a CUDA-graph
//! server pads), and runs each micro-batch through `--layers` MoE layers (router top-k → dispatch
//! → expert GEMMs → combine), with `--micro-batches` of them in flight.
//!
//! - `--backend gpu` (the default with 2+ GPUs, or with `--ranks`): one rank per GPU of the host (from one), one tokio runtime
//!   per rank. Operations complete in stream order (`pipeline::run_on_streams`, one stream per
//!   micro-batch), the experts are padded strided-batched BF16 GEMMs (cuBLAS) that need no host
//!   counts, so the host only enqueues.
//! - `--backend host` (the default otherwise): 4 ranks on the host backend; an expert is a timer
//!   (it sleeps on tokio's blocking pool, so it does not hold the rank's thread), then identity.
//! - `--backend nccl-ep` (with `--model`, decode): the GPU backend's figures and, beside them,
//!   the same layer with its dispatch and combine on NVIDIA's NCCL EP (`model.rs`).
//!
//! The expert cost is calibrated to the measured communication time per step (`--expert-scale`
//! multiplies it). The router is simulated: each layer has a pool of top-k routings drawn once,
//! and micro-batch `b` uses the pool entry its number selects (tokens too), so a micro-batch's
//! outputs depend on its number only.
//!
//! Requests arrive as a Poisson process at `--rate` requests/s (over all ranks) for `--seconds`,
//! each `--request-tokens` tokens. When the time is up no new micro-batch starts; the ones in
//! flight finish. Printed: tokens/s, request latency p50/p99 (arrival → its micro-batch's last
//! combine done), and the GPU busy fraction (time with a micro-batch in flight on the device).
//! A progress line prints every second. `--micro-batches 1,2` runs each setting in turn with the
//! same calibration and prints the throughput ratio. `--check` re-runs the served micro-batches
//! serially (`pipeline::run_serial`) and fails unless every output is bit-identical.
//!
//! ```sh
//! cargo run --release --example moe_serving -- --micro-batches 1,2 --rate 100000 --seconds 5
//! ```
//!
//! `--kill-rank R --at SECONDS` (a single `--micro-batches` setting): rank `R` stops calling at
//! `SECONDS` (it leaves the example's scheduling votes, as a dead process would drop out of a
//! server's coordinator). The group runs with rank masking (`GroupConfig::with_rank_masking`,
//! timeout `--kill-timeout` ms, default 500): the survivors' next operation masks it and they keep
//! serving. The run reports the throughput before and after, the longest stall of the
//! survivors, and the requests affected (a token of theirs had a top-k entry on the dead rank:
//! the combine's per-token `masked` counts):
//!
//! ```text
//! cargo run --release --example moe_serving -- --kill-rank 3 --at 2 --seconds 5
//! ```
//!
//! `--rejoin-at T` goes on: the killed rank's process is gone (its group is dropped), and at `T`
//! seconds a replacement rejoins while the survivors admit it at their next scheduling vote
//! (`Group::admit`). On the host backend the replacement is made through the group's rendezvous
//! (`Group::rejoin`); on GPUs it is a new rank of the example's process (`GpuWorld::rejoin`,
//! meeting the survivors over TCP on localhost), which makes its routing pool again. The run
//! reports the survivors' throughput before the kill, while masked and after the rejoin, their
//! longest stall, and how long the admission took; with `--check`, every micro-batch served
//! after the rejoin is checked bit-exact against a serial rerun of the full group:
//!
//! ```text
//! cargo run --release --example moe_serving -- --kill-rank 3 --at 1 --rejoin-at 2 --seconds 4 --check
//! ```
//!
//! `--model NAME` (GPU, 1 or more ranks; one by default) runs a model's real layers instead of
//! timer-sized experts (`epflow::moe::gpu`: attention stand-in, router, SwiGLU experts, shared
//! expert), closed loop, and measures communication, compute, serial and pipelined steps, the
//! overlap efficiency, tokens/s, latency, the GPU busy fraction and the host enqueue per layer,
//! over `--sweep-batch` batches with the crossover named (`moe_serving/model.rs`;
//! `docs/serving.md`):
//!
//! ```text
//! cargo run --release --example moe_serving -- --model qwen3-30b-a3b --micro-batches 1,2,3 --sweep-batch 8,64,512 --check
//! ```
//!
//! `--graph` (GPU, 1 or more ranks) measures decode-step latency instead: `--layers` layers of
//! dispatch → expert GEMMs (`--expert-scale 0`: identity experts) → combine on `--batch` tokens
//! per rank, each layer's output feeding the next, first awaited operation by operation (eager),
//! then captured once as a CUDA graph (every layer's routing read from a buffer the router
//! would refill) and replayed. It prints both medians, their ratio, and whether the two paths'
//! final outputs agree bit for bit:
//!
//! ```text
//! cargo run --release --example moe_serving -- --graph --layers 16 --batch 8 --rounds 200
//! ```

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::time::{Duration, Instant};

use epflow::Group;
use epflow::core::backend::{Backend, StreamOrder};
use epflow::core::{Error, Result};
use epflow::runtime::pipeline::{self, StepInput};

#[path = "common/flags.rs"]
mod flags;
#[path = "moe_serving/model.rs"]
mod model;

use flags::OrderFlag;

/// `--backend`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum BackendKind {
    /// One rank per GPU of the host (up to 8), or per `--devices` entry.
    Gpu,
    /// Four ranks on the host backend.
    Host,
    /// With `--model`, decode: the GPU backend's figures, and beside them the same layer with
    /// its dispatch and combine on NVIDIA's NCCL EP (`libnccl_ep.so` from `NCCL_EP_LIB` or the
    /// library path, after its NCCL), one micro-batch in flight.
    NcclEp,
}

/// Routings (and first-layer token sets) drawn once per layer and reused by number.
const POOL: usize = 8;

/// The most layers a run takes (each holds `POOL` routings per rank; the memory they need is
/// also checked before they are made).
const MAX_LAYERS: usize = 1024;
/// The most tokens per rank per micro-batch (`--batch`).
const MAX_BATCH: usize = 65_536;
/// The longest run, in seconds (`--seconds`).
const MAX_SECONDS: f64 = 86_400.0;

/// MoE serving: requests arrive, are batched into micro-batches and served through MoE layers
/// with several micro-batches in flight. Bounds: `--micro-batches` 1..=8 each, `--batch`
/// 1..=65536 tokens, `--layers` 1..=1024, `--seconds` up to 86400, `--rate` up to 1e9
/// requests/s, `--expert-scale` 0..=1000, `--kill-timeout` 1..=86400000 ms; memory is checked
/// (host or GPU) before anything is allocated. The host backend runs 4 ranks, top-k 4 of 16
/// experts (`MAX_TOP_K` is 16); the GPU backend runs top-k 8 of 32 experts, H 2048.
#[derive(Clone, Debug, clap::Parser)]
#[command(name = "moe_serving")]
struct Flags {
    /// `gpu` (the default with 2+ GPUs, `--devices` or `--graph` on a GPU), `host`, or
    /// `nccl-ep` (with `--model`: also the same layer on NVIDIA's NCCL EP, in the same run).
    #[arg(long, value_enum)]
    backend: Option<BackendKind>,
    /// Requests per second over all ranks (Poisson arrivals), in (0, 1e9].
    #[arg(long, default_value_t = 20_000.0, value_parser = flags::positive_up_to(1e9))]
    rate: f64,
    /// How long requests arrive, in seconds, in (0, 86400].
    #[arg(long, default_value_t = 5.0, value_parser = flags::positive_up_to(MAX_SECONDS))]
    seconds: f64,
    /// MoE layers per micro-batch, 1..=1024 (default 4; 8 with `--model`, at most its layers).
    #[arg(long, value_parser = flags::int_in(1usize, MAX_LAYERS))]
    layers: Option<usize>,
    /// (GPU) Run a model's real layers instead of timer-sized experts, closed loop, and measure
    /// communication, compute, serial and pipelined steps: `qwen3-30b-a3b`, `mixtral-8x7b` or
    /// `deepseek-v3`.
    #[arg(long)]
    model: Option<String>,
    /// With `--model`: the attention stand-in per layer (the model's attention projection GEMMs
    /// on the token side), or none.
    #[arg(long, value_enum, default_value_t = Attention::Proj)]
    attention: Attention,
    /// With `--model`: measure each of these batches (tokens per rank per micro-batch), e.g.
    /// `8,16,32,64,128,256,512`, and name the crossover.
    #[arg(long, value_delimiter = ',', value_parser = flags::int_in(1usize, MAX_BATCH))]
    sweep_batch: Vec<usize>,
    /// With `--model`: measure prefill instead of decode, at each of these token counts per rank
    /// per micro-batch (e.g. `4096`): high-throughput dispatch and combine, the experts as
    /// grouped GEMMs at the counts each handle brings to the host.
    #[arg(long, value_delimiter = ',', value_parser = flags::int_in(1usize, MAX_BATCH))]
    prefill_tokens: Vec<usize>,
    /// With `--model`: micro-batches per measurement, 1..=100000.
    #[arg(long, default_value_t = 64, value_parser = flags::int_in(1usize, 100_000))]
    steps: usize,
    /// With `--model`: write every figure to this JSON file.
    #[arg(long)]
    json: Option<std::path::PathBuf>,
    /// With `--model`: draw tokens/s against the batch (one line per `--micro-batches` setting)
    /// into this SVG file.
    #[arg(long)]
    svg: Option<std::path::PathBuf>,
    /// GPU ranks, one per GPU from GPU 0, 1..=8 (`--devices` names them instead; with `--model`
    /// the default is 1).
    #[arg(long, value_parser = flags::int_in(1usize, 8))]
    ranks: Option<usize>,
    /// With `--model`: enqueue the layer's compute call by call instead of replaying each piece
    /// (router and attention, shared expert, experts) as a CUDA graph.
    #[arg(long)]
    eager_compute: bool,
    /// With `--model`, decode: also run every setting with each layer captured whole (router,
    /// shared expert, dispatch, experts, combine: one CUDA graph per layer and lane, replayed
    /// with one launch), beside the stream-ordered layer, in the same run; `--check` compares
    /// its outputs with the stream-ordered serial ones.
    #[arg(long)]
    layer_graphs: bool,
    /// With `--model`: the weights' seed.
    #[arg(long, default_value_t = 7)]
    seed: u64,
    /// Micro-batches in flight, a comma-separated list of settings run in turn, each 1..=8.
    #[arg(long, value_delimiter = ',', default_value = "2", value_parser = flags::int_in(1usize, 8))]
    micro_batches: Vec<usize>,
    /// Tokens per rank per micro-batch (padded), 1..=65536; default 128 on GPUs, 32 on the host.
    #[arg(long, value_parser = flags::int_in(1usize, MAX_BATCH))]
    batch: Option<usize>,
    /// Tokens per request, 1..=`--batch`.
    #[arg(long, default_value_t = 8, value_parser = flags::int_in(1usize, MAX_BATCH))]
    request_tokens: usize,
    /// Micro-batch rounds per chunk between scheduling votes (or `--graph` timed steps),
    /// 1..=1000000.
    #[arg(long, default_value_t = 8, value_parser = flags::int_in(1usize, 1_000_000))]
    rounds: usize,
    /// The expert cost as a multiple of the measured communication per step, 0..=1000 (0:
    /// identity experts).
    #[arg(long, default_value_t = 1.0, value_parser = flags::finite_in(0.0, 1000.0))]
    expert_scale: f64,
    /// Where the receive kernels run.
    #[arg(long, value_enum, default_value_t = OrderFlag::OnStream)]
    order: OrderFlag,
    /// Re-run the served micro-batches serially and fail unless every output is bit-identical.
    #[arg(long)]
    check: bool,
    /// No progress lines.
    #[arg(long)]
    quiet: bool,
    /// The device of each GPU rank, e.g. `0,1` (`0,0`: two ranks on one GPU, a functional check
    /// only), at most 8.
    #[arg(long, value_parser = flags::devices)]
    devices: Option<flags::Devices>,
    /// (GPU) Decode-step latency instead of serving: eager against one captured CUDA graph.
    #[arg(long)]
    graph: bool,
    /// Rank `R` stops calling at `--at` seconds (rank masking on); a rank of the group.
    #[arg(long, value_parser = flags::int_in(0usize, 1023))]
    kill_rank: Option<usize>,
    /// When `--kill-rank` stops, in seconds from the start, within `--seconds` (default 1).
    #[arg(long, requires = "kill_rank", value_parser = flags::finite_in(0.0, MAX_SECONDS))]
    at: Option<f64>,
    /// With `--kill-rank`: the killed rank's process is replaced at this many seconds from the
    /// start (after `--at`, within `--seconds`), and rejoins the running group.
    #[arg(long, requires = "kill_rank", value_parser = flags::finite_in(0.0, MAX_SECONDS))]
    rejoin_at: Option<f64>,
    /// The group timeout with `--kill-rank`, in ms (after it a rank that stopped calling is
    /// masked), 1..=86400000.
    #[arg(long, default_value_t = 500, value_parser = flags::int_in(1u64, 86_400_000))]
    kill_timeout: u64,
    /// How long a rank waits at a scheduling vote for the others, in seconds, in (0, 86400]:
    /// past it the run stops with an error naming the ranks that did not vote.
    #[arg(long, default_value_t = 30.0, value_parser = flags::positive_up_to(MAX_SECONDS))]
    vote_timeout: f64,
}

/// `--attention`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum Attention {
    /// The model's attention projection GEMMs.
    Proj,
    /// None.
    Off,
}

/// The command line, checked.
#[derive(Clone, Debug)]
struct Args {
    /// `--model NAME` and its flags.
    model: Option<model::ModelArgs>,
    backend: String,
    rate: f64,
    seconds: f64,
    layers: usize,
    micro_batches: Vec<usize>,
    batch: usize,
    request_tokens: usize,
    rounds: usize,
    expert_scale: f64,
    order: StreamOrder,
    check: bool,
    quiet: bool,
    /// `--devices 0,0`: the device of each GPU rank (two on one GPU is a functional check only).
    devices: Option<Vec<usize>>,
    /// `--graph` (GPU): decode-step latency instead of serving: every layer's dispatch, expert
    /// GEMM and combine awaited one after another (eager), then the whole step as one captured
    /// CUDA graph replayed.
    graph: bool,
    /// `--kill-rank R --at SECONDS`: rank `R` stops calling at `SECONDS` (rank masking on).
    kill: Option<(usize, f64)>,
    /// `--rejoin-at SECONDS`: the killed rank's replacement rejoins then.
    rejoin_at: Option<f64>,
    /// `--kill-timeout` ms: the group timeout with `--kill-rank` (after it the dead rank is masked).
    kill_timeout: Duration,
    /// `--vote-timeout`: the deadline of every scheduling vote.
    vote_timeout: Duration,
}

impl Args {
    /// Parses `argv` (the program name first). `--help` and every bad flag come back as clap's
    /// error, which prints usage (exit code 0) or the error (exit code 2).
    fn parse(argv: &[String]) -> std::result::Result<Args, clap::Error> {
        use clap::{CommandFactory, Parser};
        let f = Flags::try_parse_from(argv)?;
        let invalid = |msg: String| Flags::command().error(clap::error::ErrorKind::ValueValidation, msg);
        let gpus = epflow::kernels::device_count();
        let backend = f.backend.unwrap_or({
            if gpus >= 2 || ((f.graph || f.model.is_some() || f.ranks.is_some()) && gpus >= 1) || f.devices.is_some() {
                BackendKind::Gpu
            } else {
                BackendKind::Host
            }
        });
        let gpu = backend != BackendKind::Host;
        let nccl_ep = backend == BackendKind::NcclEp;
        if nccl_ep && (f.model.is_none() || !f.prefill_tokens.is_empty()) {
            return Err(invalid(
                "--backend nccl-ep measures decode layers of a --model (NCCL EP's low-latency mode); leave out --prefill-tokens".into(),
            ));
        }
        let batch = f.batch.unwrap_or(if gpu { 128 } else { 32 });
        let model = match &f.model {
            None => {
                if !f.sweep_batch.is_empty()
                    || !f.prefill_tokens.is_empty()
                    || f.json.is_some()
                    || f.svg.is_some()
                    || f.eager_compute
                    || f.layer_graphs
                {
                    return Err(invalid(
                        "--sweep-batch, --prefill-tokens, --json, --svg, --eager-compute and --layer-graphs go with --model"
                            .into(),
                    ));
                }
                None
            }
            Some(name) => {
                let preset = epflow::moe::preset(name).map_err(|e| invalid(e.to_string()))?;
                if gpus == 0 || f.backend == Some(BackendKind::Host) {
                    return Err(invalid(format!(
                        "--model runs the layers on GPUs ({gpus} found); the host backend serves timer experts (leave out --model)"
                    )));
                }
                if f.graph || f.kill_rank.is_some() {
                    return Err(invalid("--model goes without --graph and --kill-rank".into()));
                }
                if f.layers.is_some_and(|l| l > preset.layers) {
                    return Err(invalid(format!("--layers: {} has {} layers", preset.name, preset.layers)));
                }
                if f.layer_graphs && (!f.prefill_tokens.is_empty() || f.eager_compute) {
                    return Err(invalid(
                        "--layer-graphs captures decode layers (leave out --prefill-tokens and --eager-compute)".into(),
                    ));
                }
                if !f.prefill_tokens.is_empty() && (!f.sweep_batch.is_empty() || f.batch.is_some()) {
                    return Err(invalid(
                        "--prefill-tokens names the prefill micro-batches: leave out --batch and --sweep-batch".into(),
                    ));
                }
                let batches = match (&f.prefill_tokens[..], &f.sweep_batch[..]) {
                    ([], []) => vec![batch],
                    ([], sweep) => sweep.to_vec(),
                    (prefill, _) => prefill.to_vec(),
                };
                Some(model::ModelArgs {
                    preset,
                    attention: f.attention == Attention::Proj,
                    batches,
                    prefill: !f.prefill_tokens.is_empty(),
                    steps: f.steps,
                    json: f.json.clone(),
                    svg: f.svg.clone(),
                    seed: f.seed,
                    graphs: !f.eager_compute,
                    layer_graphs: f.layer_graphs,
                    nccl_ep,
                })
            }
        };
        let devices = match (&f.devices, f.ranks) {
            (Some(_), Some(_)) => return Err(invalid("give --ranks or --devices, not both".into())),
            (Some(d), None) => Some(d.0.clone()),
            (None, Some(n)) if n > gpus => {
                return Err(invalid(format!(
                    "--ranks {n}: this machine has {gpus} GPUs (--devices 0,0 runs two ranks on one GPU, a functional check)"
                )));
            }
            (None, Some(n)) => Some((0..n).collect()),
            (None, None) if model.is_some() => Some(vec![0]),
            (None, None) => None,
        };
        let layers = f.layers.unwrap_or(if model.is_some() { 8 } else { 4 });
        if f.graph && !gpu {
            return Err(invalid("--graph captures CUDA graphs: it needs --backend gpu".into()));
        }
        let ranks = match (gpu, &devices) {
            (false, _) => host::RANKS,
            (true, Some(d)) => d.len(),
            (true, None) => gpus.min(8),
        };
        let kill = match f.kill_rank {
            None => None,
            Some(r) => {
                let at = f.at.unwrap_or(1.0);
                if r >= ranks {
                    return Err(invalid(format!(
                        "--kill-rank {r}: the group has {ranks} ranks (0..={})",
                        ranks.max(1) - 1
                    )));
                }
                if f.graph || (f.check && f.rejoin_at.is_none()) || f.micro_batches.len() != 1 || at >= f.seconds {
                    return Err(invalid(
                        "--kill-rank needs one --micro-batches setting, no --graph, no --check (unless --rejoin-at), and --at within --seconds"
                            .into(),
                    ));
                }
                if let Some(t) = f.rejoin_at {
                    if t <= at || t >= f.seconds {
                        return Err(invalid(format!(
                            "--rejoin-at {t}: after --at ({at}) and within --seconds ({})",
                            f.seconds
                        )));
                    }
                }
                Some((r, at))
            }
        };
        if !f.graph && f.request_tokens > batch {
            return Err(invalid(format!("--request-tokens {} must be in 1..=--batch ({batch})", f.request_tokens)));
        }
        Ok(Args {
            model,
            backend: match backend {
                BackendKind::Gpu | BackendKind::NcclEp => "gpu".into(),
                BackendKind::Host => "host".into(),
            },
            rate: f.rate,
            seconds: f.seconds,
            layers,
            micro_batches: f.micro_batches,
            batch,
            request_tokens: f.request_tokens,
            rounds: f.rounds,
            expert_scale: f.expert_scale,
            order: f.order.stream_order(),
            check: f.check,
            quiet: f.quiet,
            devices,
            graph: f.graph,
            kill,
            rejoin_at: f.rejoin_at,
            kill_timeout: Duration::from_millis(f.kill_timeout),
            vote_timeout: Duration::from_secs_f64(f.vote_timeout),
        })
    }

    /// Host bytes the routing pools and token sets of `ranks` ranks take (`handle` bytes per
    /// handle), checked before they are made.
    fn pool_bytes(&self, ranks: usize, hidden: usize, top_k: usize, handle: usize) -> u128 {
        let per_route = (self.batch * top_k * (8 + 4)) as u128 + handle as u128;
        let routes = (self.layers * POOL) as u128 * per_route;
        let tokens = (POOL * self.batch * hidden * 2) as u128;
        ranks as u128 * (routes + tokens)
    }

    /// The group config with rank masking on and the kill timeout, under `--kill-rank`.
    fn masking(&self, config: epflow::core::GroupConfig) -> epflow::core::GroupConfig {
        match self.kill {
            Some(_) => config.with_rank_masking(true).with_timeout(self.kill_timeout),
            None => config,
        }
    }
}

/// One request: when it arrived and how many tokens it brings.
#[derive(Clone, Copy, Debug)]
struct Request {
    arrival: Instant,
    tokens: usize,
}

/// A point in time on a rank: host-observed, or a device event (read after the run).
enum Mark {
    Host(Instant),
    Device(Arc<cudarc::driver::CudaEvent>),
}

/// What a backend brings to the server: the group, one stream per micro-batch lane, step inputs
/// by micro-batch number, the expert, marks and output digests.
trait Engine {
    /// The backend.
    type B: Backend;
    /// The rank's group (`Err` while its process is dead, `--rejoin-at`).
    fn group(&self) -> Result<Arc<Group<Self::B>>>;
    fn lanes(&self) -> &[<Self::B as Backend>::Stream];
    /// `--rejoin-at`: the rank's process dies: its group is dropped.
    fn die(&self) -> Result<()>;
    /// `--rejoin-at`: a replacement for the dead rank is made (host: through the group's
    /// rendezvous, retried until the survivors have masked the rank; GPU: a new rank meeting the
    /// survivors over TCP), within `timeout`, and rejoins the group while the survivors admit it.
    fn replace(&self, timeout: Duration) -> impl Future<Output = Result<()>>;
    /// Step inputs of micro-batch `mb` at `layer`; `prev` is its previous layer's output.
    fn input(
        &self,
        mb: u64,
        layer: usize,
        prev: Option<<Self::B as Backend>::CombineOutput>,
    ) -> Result<StepInput<Self::B>>;
    /// The expert of one step on lane `lane`: stream-ordered (enqueued), or awaited.
    fn expert(
        &self,
        lane: usize,
        d: &<Self::B as Backend>::DispatchOutput,
        awaited: bool,
    ) -> impl Future<Output = Result<<Self::B as Backend>::Tensor>>;
    /// Sets the expert cost: `scale` times one step's communication `comm`.
    fn calibrate(&self, comm: Duration, scale: f64) -> Result<String>;
    /// Now, in lane `lane`'s order.
    fn mark(&self, lane: usize) -> Result<Mark>;
    /// Seconds from the start mark to `m` (after the run).
    fn seconds(&self, start: &Mark, m: &Mark) -> f64;
    /// A digest of a final output (downloads it).
    fn digest(&self, out: &<Self::B as Backend>::CombineOutput) -> Result<u64>;
    /// Rank masking: per token of a combine output, its top-k entries on masked ranks
    /// (downloads them).
    fn masked(&self, out: &<Self::B as Backend>::CombineOutput) -> Result<Vec<i32>>;
}

/// FNV-1a over 16-bit words.
fn fnv(words: impl Iterator<Item = u16>) -> u64 {
    words.fold(0xcbf2_9ce4_8422_2325u64, |h, w| (h ^ u64::from(w)).wrapping_mul(0x0100_0000_01b3))
}

/// The decision every rank takes together at a chunk boundary.
#[derive(Debug)]
struct Votes {
    state: Mutex<VoteState>,
    changed: tokio::sync::Notify,
    /// How long a rank waits for the others' votes (`--vote-timeout`).
    deadline: Duration,
}

/// The votes so far: per round the highest vote (0 stop, 1 idle, 2 run, 3 admit the
/// replacement) and the ranks that cast one (a bit each), the ranks that still vote (a bit each)
/// and from which round each votes (a replacement from the round after its admission), and the
/// admission (its round and the chunks served before it).
#[derive(Debug)]
struct VoteState {
    rounds: Vec<(usize, u64)>,
    voters: u64,
    from_round: [usize; 64],
    admission: Option<(usize, usize)>,
}

/// A vote: stop serving.
const STOP: usize = 0;
/// A vote: nothing queued.
const IDLE: usize = 1;
/// A vote: serve a chunk.
const RUN: usize = 2;
/// A vote: admit the replacement of the dead rank (`--rejoin-at`).
const ADMIT: usize = 3;

impl VoteState {
    /// The ranks that vote in `round` and have not voted in it.
    fn missing(&self, round: usize) -> Vec<usize> {
        let voted = self.rounds.get(round).map_or(0, |r| r.1);
        (0..64).filter(|&r| self.voters & !voted & (1 << r) != 0 && self.from_round[r] <= round).collect()
    }
}

impl Votes {
    /// Votes of `ranks` ranks (at most 64), each wait bounded by `deadline`.
    fn new(ranks: usize, deadline: Duration) -> Self {
        assert!(ranks <= 64, "the example's votes hold up to 64 ranks");
        let voters = if ranks == 64 { u64::MAX } else { (1u64 << ranks) - 1 };
        let state = VoteState { rounds: Vec::new(), voters, from_round: [0; 64], admission: None };
        Votes { state: Mutex::new(state), changed: Default::default(), deadline }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, VoteState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Rank `rank`'s `vote` for round `round`; returns the highest vote once every rank that
    /// still votes has voted, or an error naming the missing ranks after the deadline.
    async fn decide(&self, rank: usize, round: usize, vote: usize) -> Result<usize> {
        {
            let mut st = self.lock();
            if st.rounds.len() <= round {
                st.rounds.resize(round + 1, (0, 0));
            }
            let v = &mut st.rounds[round];
            *v = (v.0.max(vote), v.1 | 1 << rank);
        }
        self.changed.notify_waiters();
        let deadline = tokio::time::Instant::now() + self.deadline;
        loop {
            // Created before the check: a change after it still wakes this wait.
            let changed = self.changed.notified();
            {
                let st = self.lock();
                if st.missing(round).is_empty() {
                    return Ok(st.rounds[round].0);
                }
            }
            if tokio::time::timeout_at(deadline, changed).await.is_err() {
                return Err(Error::Backend(format!(
                    "rank {rank}: scheduling vote {round}: ranks {:?} did not vote within {:?} (--vote-timeout)",
                    self.lock().missing(round),
                    self.deadline
                )));
            }
        }
    }

    /// Rank `rank` stops voting (it stopped calling, was masked, or failed); the others no
    /// longer wait for it. Leaving twice is harmless.
    fn leave(&self, rank: usize) {
        self.lock().voters &= !(1 << rank);
        self.changed.notify_waiters();
    }

    /// Whether rank `rank` still votes.
    fn votes(&self, rank: usize) -> bool {
        self.lock().voters >> rank & 1 == 1
    }

    /// The survivors decided to admit the replacement in `round`, after `chunks` chunks (each
    /// survivor says so; the first one counts, the others say the same).
    fn note_admission(&self, round: usize, chunks: usize) {
        self.lock().admission.get_or_insert((round, chunks));
        self.changed.notify_waiters();
    }

    /// The replacement waits for the survivors' admission vote: its round and chunks.
    async fn admission(&self, rank: usize) -> Result<(usize, usize)> {
        let deadline = tokio::time::Instant::now() + self.deadline;
        loop {
            let changed = self.changed.notified();
            if let Some(a) = self.lock().admission {
                return Ok(a);
            }
            if tokio::time::timeout_at(deadline, changed).await.is_err() {
                return Err(Error::Backend(format!(
                    "rank {rank}: the survivors did not vote to admit its replacement within {:?} (--vote-timeout)",
                    self.deadline
                )));
            }
        }
    }

    /// The replacement of `rank` votes again from round `from` on.
    fn join(&self, rank: usize, from: usize) {
        let mut st = self.lock();
        st.voters |= 1 << rank;
        st.from_round[rank] = from;
        drop(st);
        self.changed.notify_waiters();
    }
}

/// A rank's seat in the votes: leaves them when dropped, whichever way `serve` returns.
struct Seat<'a> {
    votes: &'a Votes,
    rank: usize,
}

impl Drop for Seat<'_> {
    fn drop(&mut self) {
        self.votes.leave(self.rank);
    }
}

/// One served micro-batch: its number, start and end marks, and the requests it carried.
type Batch = (u64, Mark, Mark, Vec<Request>);

/// What one rank's run produced: how it served, how many arrivals it dropped, and (with
/// `--check`) the serial run's digests.
type RankResult = Result<(Served, usize, Option<BTreeMap<u64, u64>>)>;

/// What one rank's serving run produced.
#[derive(Default)]
struct Served {
    /// The micro-batches served.
    batches: Vec<Batch>,
    /// Digests of final outputs (with `--check`).
    digests: BTreeMap<u64, u64>,
    /// Chunks run.
    chunks: usize,
    /// Requests still queued at the end.
    left: usize,
    /// Requests whose tokens lost a top-k entry to a masked rank (`--kill-rank`).
    affected: usize,
    /// The start mark, and the host's clock when it was taken.
    start: Option<(Mark, Instant)>,
    /// Why this rank stopped early, if its peers masked it (a live but slow rank).
    masked_out: Option<String>,
    /// `--rejoin-at`: the admission of the dead rank's replacement (on a survivor) or its
    /// rejoin (on the replacement).
    rejoin: Option<Rejoined>,
    /// `--rejoin-at`: why the admission failed on this survivor (it served on, masked).
    admission_failed: Option<String>,
}

/// When the group was whole again (`--rejoin-at`).
#[derive(Clone, Copy, Debug)]
struct Rejoined {
    /// Chunks served before it: later micro-batches are served by the whole group.
    chunk: usize,
    /// When the meeting began and how long it took (host clock).
    began: Instant,
    took: Duration,
}

/// The arrivals of one rank: a thread that sends requests (Poisson, `rate` per second) until
/// `until`. At most 65,536 wait; more are dropped (and counted).
fn arrivals(rate: f64, tokens: usize, until: Instant, seed: u64) -> (mpsc::Receiver<Request>, Arc<AtomicUsize>) {
    let (tx, rx) = mpsc::sync_channel(65_536);
    let dropped = Arc::new(AtomicUsize::new(0));
    let d = Arc::clone(&dropped);
    std::thread::spawn(move || {
        let mut state = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        let mut next = Instant::now();
        while next < until {
            let now = Instant::now();
            while next <= now && next < until {
                if tx.try_send(Request { arrival: next, tokens }).is_err() {
                    d.fetch_add(1, Ordering::Relaxed);
                }
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                let u = ((state >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
                next += Duration::from_secs_f64(-u.ln() / rate);
            }
            std::thread::sleep(next.saturating_duration_since(Instant::now()).min(Duration::from_millis(1)));
        }
    });
    (rx, dropped)
}

/// Micro-batch numbering inside a chunk: step `i` → (lane, layer, micro-batch number).
fn place(i: usize, m: usize, layers: usize, chunk_base: u64) -> (usize, usize, u64) {
    let (lane, layer, round) = (i % m, (i / m) % layers, i / (m * layers));
    (lane, layer, chunk_base + (round * m + lane) as u64)
}

/// When a rank stops serving: `until` (every rank), or `kill_at` (`--kill-rank`: this rank
/// stops calling then, and its peers mask it).
#[derive(Clone, Copy)]
struct Stop {
    until: Instant,
    kill_at: Option<Instant>,
    /// `--rejoin-at`: the dead rank, and when its replacement rejoins.
    rejoin: Option<(usize, Instant)>,
}

/// Serves on one rank with `m` micro-batches in flight until the time is up.
async fn serve<E: Engine>(
    e: &E,
    a: &Args,
    m: usize,
    votes: &Votes,
    queue: &mpsc::Receiver<Request>,
    stop: Stop,
    progress: Option<&AtomicUsize>,
) -> Result<Served> {
    let Stop { until, mut kill_at, rejoin } = stop;
    let rank = e.group()?.rank();
    // Whichever way this returns (killed, masked, failed), the other ranks stop waiting for
    // this rank's votes.
    let _seat = Seat { votes, rank };
    let layers = a.layers;
    let steps = m * layers * a.rounds;
    let per_chunk = (m * a.rounds) as u64;
    let mut served = Served { start: Some((e.mark(0)?, Instant::now())), ..Default::default() };
    let mut backlog: Vec<Request> = Vec::new();
    let mut round = 0;
    let mut last_print = Instant::now();
    let started = Instant::now();
    loop {
        while let Ok(r) = queue.try_recv() {
            backlog.push(r);
        }
        if kill_at.is_some_and(|k| Instant::now() >= k) {
            // This rank stops calling: its peers will mask it (its seat leaves the votes).
            let Some((_, at)) = rejoin else { return Ok(served) };
            // `--rejoin-at`: its process dies, and a replacement rejoins at `at`, once the
            // survivors voted to admit it; it serves from their next round on.
            votes.leave(rank);
            e.die()?;
            kill_at = None;
            tokio::time::sleep_until(at.into()).await;
            let (admitted, chunks) = votes.admission(rank).await?;
            // A voter again from the round after the admission (before the meeting ends, so
            // that the survivors' next round waits for this rank's vote).
            round = admitted + 1;
            votes.join(rank, round);
            let began = Instant::now();
            e.replace(a.vote_timeout).await?;
            served.rejoin = Some(Rejoined { chunk: chunks, began, took: began.elapsed() });
            served.chunks = chunks;
            continue;
        }
        let now = Instant::now();
        let admit = rejoin.filter(|&(dead, at)| {
            rank != dead
                && now >= at
                && served.rejoin.is_none()
                && served.admission_failed.is_none()
                && !votes.votes(dead)
        });
        let vote = if now >= until {
            STOP
        } else if admit.is_some() {
            ADMIT
        } else if backlog.is_empty() {
            IDLE
        } else {
            RUN
        };
        let decided = votes.decide(rank, round, vote).await?;
        round += 1;
        if decided == STOP {
            break;
        }
        if decided == IDLE {
            tokio::time::sleep(Duration::from_micros(200)).await;
            continue;
        }
        if decided == ADMIT {
            // Every survivor admits the replacement (masking the dead rank first, if no
            // operation has yet), with no operation in flight.
            let dead = rejoin.map_or(rank, |r| r.0);
            votes.note_admission(round - 1, served.chunks);
            let g = e.group()?;
            g.mask(dead)?;
            let began = Instant::now();
            match g.admit(&[dead], a.vote_timeout).await {
                Ok(()) => served.rejoin = Some(Rejoined { chunk: served.chunks, began, took: began.elapsed() }),
                // The replacement did not come: it stays masked, and the survivors serve on.
                Err(x) => {
                    served.admission_failed = Some(format!("rank {rank}: the admission of rank {dead} failed: {x}"))
                }
            }
            continue;
        }
        let base = served.chunks as u64 * per_chunk;
        let open: Mutex<BTreeMap<u64, (Mark, Vec<Request>)>> = Mutex::default();
        let finished: Mutex<Vec<Batch>> = Mutex::default();
        let digests: Mutex<BTreeMap<u64, u64>> = Mutex::default();
        // `--kill-rank`: per micro-batch, which tokens lost an entry to a masked rank.
        let lost: Mutex<BTreeMap<u64, Vec<bool>>> = Mutex::default();
        let affected = AtomicUsize::new(0);
        let note_masked = |mb: u64, out: &<E::B as Backend>::CombineOutput| -> Result<()> {
            if a.kill.is_some() {
                let m = e.masked(out)?;
                let mut l = lost.lock().unwrap_or_else(|x| x.into_inner());
                let row = l.entry(mb).or_insert_with(|| vec![false; m.len()]);
                row.iter_mut().zip(&m).for_each(|(r, &c)| *r |= c > 0);
            }
            Ok(())
        };
        let finish = |mb: u64, lane: usize, out: &<E::B as Backend>::CombineOutput| -> Result<()> {
            let end = e.mark(lane)?;
            if a.check {
                digests.lock().unwrap_or_else(|x| x.into_inner()).insert(mb, e.digest(out)?);
            }
            note_masked(mb, out)?;
            if let Some((start, reqs)) = open.lock().unwrap_or_else(|x| x.into_inner()).remove(&mb) {
                // A request is affected if one of its tokens lost an entry in any layer.
                if let Some(row) = lost.lock().unwrap_or_else(|x| x.into_inner()).remove(&mb) {
                    let mut first = 0;
                    for q in &reqs {
                        if row.get(first..first + q.tokens).is_some_and(|t| t.iter().any(|&x| x)) {
                            affected.fetch_add(1, Ordering::Relaxed);
                        }
                        first += q.tokens;
                    }
                }
                finished.lock().unwrap_or_else(|x| x.into_inner()).push((mb, start, end, reqs));
            }
            Ok(())
        };
        let backlog_cell = Mutex::new(std::mem::take(&mut backlog));
        let input = |i: usize, prev: Option<<E::B as Backend>::CombineOutput>| {
            let (lane, layer, mb) = place(i, m, layers, base);
            if layer > 0 {
                if let Some(out) = &prev {
                    note_masked(mb, out)?;
                }
                return e.input(mb, layer, prev);
            }
            if let Some(out) = &prev {
                finish(mb - m as u64, lane, out)?;
            }
            // A new micro-batch: whole requests, up to the batch size, padded.
            let mut q = backlog_cell.lock().unwrap_or_else(|x| x.into_inner());
            while let Ok(r) = queue.try_recv() {
                q.push(r);
            }
            let mut take = 0;
            let mut tokens = 0;
            while take < q.len() && tokens + q[take].tokens <= a.batch {
                tokens += q[take].tokens;
                take += 1;
            }
            let reqs: Vec<Request> = q.drain(..take).collect();
            open.lock().unwrap_or_else(|x| x.into_inner()).insert(mb, (e.mark(lane)?, reqs));
            e.input(mb, 0, None)
        };
        let sink_err: Mutex<Option<Error>> = Mutex::default();
        let sink = |i: usize, out: <E::B as Backend>::CombineOutput| {
            let (lane, _, mb) = place(i, m, layers, base);
            if let Err(x) = finish(mb, lane, &out) {
                sink_err.lock().unwrap_or_else(|p| p.into_inner()).get_or_insert(x);
            }
        };
        let lanes = &e.lanes()[..m];
        let expert = async |i: usize, _: &<E::B as Backend>::Stream, d: &<E::B as Backend>::DispatchOutput| {
            e.expert(i % m, d, false).await
        };
        match pipeline::run_on_streams(&*e.group()?, steps, lanes, a.order, input, expert, sink).await {
            Ok(_) => {}
            // A live rank its peers gave up on (it missed the group timeout, e.g. under CPU
            // load): it stops serving cleanly, and its seat leaves the votes.
            Err(Error::RankMasked { op, .. }) => {
                served.masked_out = Some(format!(
                    "rank {rank} was masked by its peers during {op} at {:.2} s (it missed the {} ms group timeout); it stopped serving",
                    started.elapsed().as_secs_f64(),
                    a.kill_timeout.as_millis()
                ));
                break;
            }
            Err(x) => return Err(x),
        }
        if let Some(x) = sink_err.into_inner().unwrap_or_else(|p| p.into_inner()) {
            return Err(x);
        }
        backlog = backlog_cell.into_inner().unwrap_or_else(|x| x.into_inner());
        served.batches.extend(finished.into_inner().unwrap_or_else(|x| x.into_inner()));
        served.digests.extend(digests.into_inner().unwrap_or_else(|x| x.into_inner()));
        served.chunks += 1;
        served.affected += affected.into_inner();
        if let Some(p) = progress {
            let done: usize = served.batches.iter().map(|b| b.3.len()).sum();
            p.store(done, Ordering::Relaxed);
            if !a.quiet && last_print.elapsed() >= Duration::from_secs(1) {
                last_print = Instant::now();
                eprintln!(
                    "[moe_serving] {:5.1} s: rank 0 served {done} requests in {} micro-batches, {} waiting",
                    started.elapsed().as_secs_f64(),
                    served.batches.len(),
                    backlog.len()
                );
            }
        }
    }
    while queue.try_recv().is_ok() {
        served.left += 1;
    }
    served.left += backlog.len();
    Ok(served)
}

/// Runs the served `chunks` again, one step at a time (`pipeline::run_serial`), and returns the
/// digests of every micro-batch's final output.
async fn serial_digests<E: Engine>(
    e: &E,
    a: &Args,
    m: usize,
    chunks: std::ops::Range<usize>,
) -> Result<BTreeMap<u64, u64>> {
    let layers = a.layers;
    let steps = m * layers * a.rounds;
    let mut digests = BTreeMap::new();
    for c in chunks {
        let base = (c * m * a.rounds) as u64;
        let found: Mutex<Vec<(u64, Result<u64>)>> = Mutex::default();
        let input = |i: usize, prev: Option<<E::B as Backend>::CombineOutput>| {
            let (_, layer, mb) = place(i, m, layers, base);
            if layer == 0 {
                if let Some(out) = &prev {
                    found.lock().unwrap_or_else(|x| x.into_inner()).push((mb - m as u64, e.digest(out)));
                }
                return e.input(mb, 0, None);
            }
            e.input(mb, layer, prev)
        };
        let sink = |i: usize, out: <E::B as Backend>::CombineOutput| {
            let (_, _, mb) = place(i, m, layers, base);
            found.lock().unwrap_or_else(|x| x.into_inner()).push((mb, e.digest(&out)));
        };
        let expert = async |i: usize, d: &<E::B as Backend>::DispatchOutput| e.expert(i % m, d, true).await;
        pipeline::run_serial(&*e.group()?, steps, m, input, expert, sink).await?;
        for (mb, d) in found.into_inner().unwrap_or_else(|x| x.into_inner()) {
            digests.insert(mb, d?);
        }
    }
    Ok(digests)
}

/// Communication per step with free experts (awaited, serial), for calibration.
async fn comm_per_step<E: Engine>(e: &E, a: &Args) -> Result<Duration> {
    e.calibrate(Duration::ZERO, 0.0)?;
    let steps = a.layers * 4;
    let input = |i: usize, prev| e.input(i as u64 / a.layers as u64, i % a.layers, prev);
    let expert = async |_, d: &<E::B as Backend>::DispatchOutput| e.expert(0, d, true).await;
    let g = e.group()?;
    pipeline::run_serial(&g, steps, 1, input, expert, |_, _| ()).await?;
    let stats = pipeline::run_serial(&g, steps, 1, input, expert, |_, _| ()).await?;
    Ok(stats.comm / steps as u32)
}

/// The figures of one setting, over every rank.
struct Report {
    tokens_per_s: f64,
    p50: f64,
    p99: f64,
    busy: f64,
    requests: usize,
    left: usize,
    dropped: usize,
}

fn percentile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    sorted[((sorted.len() as f64 * q) as usize).min(sorted.len() - 1)]
}

/// Runs every rank (one thread and tokio runtime each) through calibration, serving with each
/// `--micro-batches` setting, and (with `--check`) the serial comparison.
fn run<E: Engine + Sync>(engines: &[E], a: &Args) -> Result<Vec<(usize, Report)>> {
    let ranks = engines.len();
    let rt = || {
        tokio::runtime::Builder::new_current_thread().enable_all().build().map_err(|x| Error::Backend(x.to_string()))
    };
    // Calibration: every rank measures; the slowest rank's figure sets every expert's cost.
    let comm: Vec<Result<Duration>> = std::thread::scope(|s| {
        let hs: Vec<_> = engines.iter().map(|e| s.spawn(move || rt()?.block_on(comm_per_step(e, a)))).collect();
        hs.into_iter().map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p))).collect()
    });
    let comm = comm.into_iter().collect::<Result<Vec<_>>>()?.into_iter().max().unwrap_or_default();
    let mut what = String::new();
    for e in engines {
        what = e.calibrate(comm, a.expert_scale)?;
    }
    println!(
        "moe_serving, {} backend: {ranks} ranks, {} layers, batch {} tokens, requests of {} tokens at {} req/s for {} s",
        a.backend, a.layers, a.batch, a.request_tokens, a.rate, a.seconds
    );
    println!("  communication per step {:.1} us; expert: {what}", comm.as_secs_f64() * 1e6);
    let mut reports = Vec::new();
    for &m in &a.micro_batches {
        let until = Instant::now() + Duration::from_secs_f64(a.seconds);
        let votes = Votes::new(ranks, a.vote_timeout);
        let progress = AtomicUsize::new(0);
        let t0 = Instant::now();
        let results: Vec<RankResult> = std::thread::scope(|s| {
            let hs: Vec<_> = engines
                .iter()
                .enumerate()
                .map(|(r, e)| {
                    let (votes, progress) = (&votes, &progress);
                    s.spawn(move || {
                        let (rx, dropped) = arrivals(a.rate / ranks as f64, a.request_tokens, until, 17 + r as u64);
                        let rt = rt()?;
                        let at = |secs: f64| until - Duration::from_secs_f64(a.seconds - secs);
                        let kill_at = a.kill.filter(|&(k, _)| k == r).map(|(_, t)| at(t));
                        let rejoin = a.kill.zip(a.rejoin_at).map(|((dead, _), t)| (dead, at(t)));
                        let served = rt.block_on(serve(
                            e,
                            a,
                            m,
                            votes,
                            &rx,
                            Stop { until, kill_at, rejoin },
                            (r == 0).then_some(progress),
                        ))?;
                        // With `--rejoin-at`, the chunks the whole group served after the rejoin.
                        let from = served.rejoin.map_or(0, |j| j.chunk);
                        let serial = if a.check {
                            Some(rt.block_on(serial_digests(e, a, m, from..served.chunks))?)
                        } else {
                            None
                        };
                        Ok((served, dropped.load(Ordering::Relaxed), serial))
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p))).collect()
        });
        let wall = t0.elapsed().as_secs_f64();
        let mut latencies = Vec::new();
        let (mut tokens, mut requests, mut left, mut dropped, mut busy) = (0usize, 0usize, 0usize, 0usize, 0.0f64);
        let mut serving_wall = 0.0f64;
        // `--kill-rank`: the survivors' tokens finished before and after the kill, their
        // longest gap between two finished micro-batches after it, and the affected requests.
        let (mut before, mut after, mut stall, mut affected) = (0usize, 0usize, 0.0f64, 0usize);
        // `--rejoin-at`: the survivors' tokens while the rank was masked and after its
        // replacement rejoined, the admission window (seconds on the survivors' clock), and the
        // replacement's tokens after it.
        let (mut masked_tokens, mut admission, mut replacement_tokens) = (0usize, (f64::MAX, 0.0f64), 0usize);
        // Every rank's reasons first: a rank its peers masked explains another's outputs.
        for (served, _, _) in results.iter().flatten() {
            for why in served.masked_out.iter().chain(&served.admission_failed) {
                println!("  {why}");
            }
        }
        for (r, (res, e)) in results.into_iter().zip(engines).enumerate() {
            let (served, drop_count, serial) = res?;
            if let Some((dead, at)) = a.kill {
                let (start, start_host) =
                    served.start.as_ref().ok_or_else(|| Error::Backend("no start mark".into()))?;
                let window = served.rejoin.map(|j| {
                    let began = j.began.saturating_duration_since(*start_host).as_secs_f64();
                    (began, began + j.took.as_secs_f64())
                });
                if r == dead {
                    if let Some((_, done)) = window {
                        replacement_tokens += served
                            .batches
                            .iter()
                            .filter(|b| e.seconds(start, &b.2) >= done)
                            .map(|b| b.3.iter().map(|q| q.tokens).sum::<usize>())
                            .sum::<usize>();
                    }
                }
                if r != dead {
                    let mut ends = Vec::with_capacity(served.batches.len());
                    if let Some((began, done)) = window {
                        admission = (admission.0.min(began), admission.1.max(done));
                    }
                    for b in &served.batches {
                        let (end, t) = (e.seconds(start, &b.2), b.3.iter().map(|q| q.tokens).sum::<usize>());
                        match window {
                            _ if end < at => before += t,
                            Some((began, _)) if end < began => masked_tokens += t,
                            _ => after += t,
                        }
                        ends.push(end);
                    }
                    ends.sort_by(f64::total_cmp);
                    let later: Vec<f64> = ends.iter().copied().filter(|&x| x >= at).collect();
                    let gap = ends.windows(2).filter(|w| w[1] >= at).map(|w| w[1] - w[0]).fold(0.0, f64::max);
                    stall = stall.max(gap.max(later.first().map_or(0.0, |f| f - at)));
                    affected += served.affected;
                }
            }
            let (start, start_host) = served.start.as_ref().ok_or_else(|| Error::Backend("no start mark".into()))?;
            let mut intervals: Vec<(f64, f64)> = Vec::new();
            let mut end_max = 0.0f64;
            for (_, s_mark, e_mark, reqs) in &served.batches {
                let (s0, s1) = (e.seconds(start, s_mark), e.seconds(start, e_mark));
                intervals.push((s0, s1));
                end_max = end_max.max(s1);
                for q in reqs {
                    tokens += q.tokens;
                    requests += 1;
                    // Both ends on the rank's clock: seconds since its start mark.
                    let arrival = q.arrival.saturating_duration_since(*start_host).as_secs_f64();
                    latencies.push((s1 - arrival).max(0.0));
                }
            }
            serving_wall = serving_wall.max(end_max);
            busy += union(&mut intervals) / end_max.max(1e-9);
            left += served.left;
            dropped += drop_count;
            if let Some(serial) = serial {
                // With `--rejoin-at`: the micro-batches the whole group served after the rejoin.
                let first = served.rejoin.map_or(0, |j| (j.chunk * m * a.rounds) as u64);
                let whole: BTreeMap<u64, u64> = served.digests.range(first..).map(|(&k, &v)| (k, v)).collect();
                if serial != whole {
                    return Err(Error::Backend(format!(
                        "rank {r}: served outputs differ from the serial run's ({} vs {} micro-batches)",
                        whole.len(),
                        serial.len()
                    )));
                }
                let what = if served.rejoin.is_some() { " (every one served after the rejoin)" } else { "" };
                println!("  rank {r}: {} micro-batch outputs bit-identical to the serial run's{what}", serial.len());
            }
        }
        if let (Some((dead, at)), Some(_)) = (a.kill, a.rejoin_at) {
            let (began, done) = admission;
            println!(
                "  rank {dead} stopped at {at:.1} s; its replacement rejoined at {done:.2} s (the admission meeting took {:.1} ms): survivors served {:.0} tokens/s before, {:.0} while it was masked, {:.0} after the rejoin (the replacement {:.0} more); longest stall after the kill {:.1} ms (timeout {} ms); {affected} requests affected",
                (done - began) * 1e3,
                before as f64 / at.max(1e-9),
                masked_tokens as f64 / (began - at).max(1e-9),
                after as f64 / (serving_wall - done).max(1e-9),
                replacement_tokens as f64 / (serving_wall - done).max(1e-9),
                stall * 1e3,
                a.kill_timeout.as_millis(),
            );
        } else if let Some((dead, at)) = a.kill {
            let masked = engines
                .iter()
                .map(|e| e.group().map(|g| g.masked_ranks().ranks.to_vec()))
                .collect::<Result<Vec<_>>>()?;
            println!(
                "  rank {dead} stopped at {at:.1} s: survivors served {:.0} tokens/s before, {:.0} tokens/s after; longest stall after it {:.1} ms (timeout {} ms); {affected} requests affected (a token lost a top-k entry); masked ranks seen by each rank {masked:?}",
                before as f64 / at.max(1e-9),
                after as f64 / (serving_wall - at).max(1e-9),
                stall * 1e3,
                a.kill_timeout.as_millis(),
            );
        }
        latencies.sort_by(f64::total_cmp);
        let report = Report {
            tokens_per_s: tokens as f64 / serving_wall.max(1e-9),
            p50: percentile(&latencies, 0.5) * 1e3,
            p99: percentile(&latencies, 0.99) * 1e3,
            busy: busy / ranks as f64,
            requests,
            left,
            dropped,
        };
        println!(
            "  micro-batches {m}: {:.0} tokens/s, request latency p50 {:.2} ms p99 {:.2} ms, {} busy {:.0} %, {} requests served, {} left queued, {} dropped (wall {:.2} s)",
            report.tokens_per_s,
            report.p50,
            report.p99,
            if a.backend == "gpu" { "GPU" } else { "ranks" },
            report.busy * 100.0,
            report.requests,
            report.left,
            report.dropped,
            wall
        );
        reports.push((m, report));
    }
    if let (Some((1, one)), true) = (reports.first(), reports.len() > 1) {
        for (m, r) in &reports[1..] {
            println!(
                "  throughput with {m} micro-batches in flight / with 1: {:.2}x",
                r.tokens_per_s / one.tokens_per_s
            );
        }
    }
    Ok(reports)
}

/// The total length of the union of `intervals`.
fn union(intervals: &mut [(f64, f64)]) -> f64 {
    intervals.sort_by(|x, y| x.0.total_cmp(&y.0));
    let (mut total, mut cur): (f64, Option<(f64, f64)>) = (0.0, None);
    for &(s, e) in intervals.iter() {
        cur = match cur {
            Some((cs, ce)) if s <= ce => Some((cs, ce.max(e))),
            Some((cs, ce)) => {
                total += ce - cs;
                Some((s, e))
            }
            None => Some((s, e)),
        };
    }
    total + cur.map_or(0.0, |(s, e)| e - s)
}

fn main() {
    let argv: Vec<String> = std::env::args().collect();
    // `--help` prints usage and exits 0; a bad flag prints the error and exits 2.
    let a = Args::parse(&argv).unwrap_or_else(|e| e.exit());
    let result = match a.backend.as_str() {
        "gpu" if a.model.is_some() => a.model.as_ref().map_or(Ok(()), |m| model::main(&a, m)),
        "gpu" if a.graph => gpu::decode_latency(&a),
        "gpu" => gpu::main(&a).map(|_| ()),
        "host" => host::main(&a).map(|_| ()),
        other => Err(Error::Unsupported(format!("--backend {other}: use gpu or host"))),
    };
    if let Err(e) = result {
        eprintln!("moe_serving: {e}");
        std::process::exit(1);
    }
}

/// The host backend: timer experts.
mod host {
    use std::sync::{Arc, Mutex, RwLock};
    use std::time::Duration;

    use epflow::Group;
    use epflow::core::RejoinRefusal;
    use epflow::core::host::{HostCombineOutput, HostDispatchOutput, HostRank, HostRendezvous, HostStream, HostWorld};
    use epflow::core::workload::{RoutingKind, RoutingSpec, random_tokens, random_topk_idx, random_weights};
    use epflow::core::{Error, GroupConfig, HostTensor, Result};
    use epflow::runtime::pipeline::StepInput;

    use super::{Args, Engine, Mark, POOL, Report, fnv};

    pub(crate) const RANKS: usize = 4;
    const EXPERTS: usize = 16;
    const HIDDEN: usize = 512;
    const TOP_K: usize = 4;

    pub(crate) struct HostEngine {
        /// `None` while the rank's process is dead (`--rejoin-at`).
        g: RwLock<Option<Arc<Group<HostRank>>>>,
        /// Where a replacement for this rank is made.
        rendezvous: HostRendezvous,
        rank: usize,
        lanes: Vec<HostStream>,
        /// Per layer: handles and weights of the routing pool.
        routes: Vec<Vec<(epflow::core::host::HostHandle, HostTensor)>>,
        tokens: Vec<HostTensor>,
        cost: Mutex<Duration>,
    }

    impl Engine for HostEngine {
        type B = HostRank;

        fn group(&self) -> Result<Arc<Group<HostRank>>> {
            let g = self.g.read().unwrap_or_else(|e| e.into_inner());
            g.clone().ok_or_else(|| Error::Backend(format!("rank {}: its process is dead", self.rank)))
        }

        fn lanes(&self) -> &[HostStream] {
            &self.lanes
        }

        fn die(&self) -> Result<()> {
            let g = self.g.write().unwrap_or_else(|e| e.into_inner()).take();
            match g.map(Arc::try_unwrap) {
                // The last reference: the group and its rank go, as a dead process's would.
                Some(Ok(g)) => {
                    drop(g);
                    Ok(())
                }
                Some(Err(_)) => Err(Error::Backend(format!("rank {}: its group is still in use", self.rank))),
                None => Err(Error::Backend(format!("rank {}: already dead", self.rank))),
            }
        }

        async fn replace(&self, timeout: Duration) -> Result<()> {
            let deadline = std::time::Instant::now() + timeout;
            let config = self.rendezvous.config().clone();
            let rank = loop {
                match self.rendezvous.replace(self.rank, &config) {
                    Ok(r) => break r,
                    // The survivors have not masked it yet (they do at their admission vote), or
                    // operations of the dead process still run out their timeout.
                    Err(Error::RejoinRefused {
                        why: RejoinRefusal::NotMasked | RejoinRefusal::OldOperationsRunning,
                        ..
                    }) if std::time::Instant::now() < deadline => tokio::time::sleep(Duration::from_millis(1)).await,
                    Err(e) => return Err(e),
                }
            };
            let g = Arc::new(Group::new(rank));
            g.rejoin(deadline.saturating_duration_since(std::time::Instant::now())).await?;
            *self.g.write().unwrap_or_else(|e| e.into_inner()) = Some(g);
            Ok(())
        }

        fn input(&self, mb: u64, layer: usize, prev: Option<HostCombineOutput>) -> Result<StepInput<HostRank>> {
            let (handle, weights) = self.routes[layer][(mb as usize * 7 + layer) % POOL].clone();
            let tokens = match prev {
                Some(out) if layer > 0 => out.tokens().clone(),
                _ => self.tokens[mb as usize % POOL].clone(),
            };
            Ok(StepInput { handle, tokens, weights, dispatch_options: Default::default() })
        }

        async fn expert(&self, _lane: usize, d: &HostDispatchOutput, _awaited: bool) -> Result<HostTensor> {
            let cost = *self.cost.lock().unwrap_or_else(|e| e.into_inner());
            if !cost.is_zero() {
                tokio::task::spawn_blocking(move || std::thread::sleep(cost))
                    .await
                    .map_err(|e| Error::Backend(e.to_string()))?;
            }
            Ok(d.tokens().clone())
        }

        fn calibrate(&self, comm: Duration, scale: f64) -> Result<String> {
            let cost = comm.mul_f64(scale);
            *self.cost.lock().unwrap_or_else(|e| e.into_inner()) = cost;
            Ok(format!("a {:.1} us timer, then identity", cost.as_secs_f64() * 1e6))
        }

        fn mark(&self, _lane: usize) -> Result<Mark> {
            Ok(Mark::Host(std::time::Instant::now()))
        }

        fn seconds(&self, start: &Mark, m: &Mark) -> f64 {
            match (start, m) {
                (Mark::Host(s), Mark::Host(t)) => t.saturating_duration_since(*s).as_secs_f64(),
                _ => 0.0,
            }
        }

        fn digest(&self, out: &HostCombineOutput) -> Result<u64> {
            let t = out.tokens().as_bf16().ok_or_else(|| Error::Backend("tokens not BF16".into()))?;
            Ok(fnv(t.iter().map(|v| v.to_bits())))
        }

        fn masked(&self, out: &HostCombineOutput) -> Result<Vec<i32>> {
            Ok(out.masked().map(<[i32]>::to_vec).unwrap_or_default())
        }
    }

    /// The host world's engines for `a` (`buffer_sets` at least the largest `--micro-batches`).
    pub(crate) fn engines(a: &Args) -> Result<Vec<HostEngine>> {
        let sets = a.micro_batches.iter().copied().max().unwrap_or(2).max(2);
        // A host handle keeps its routing plan and receive layouts: about 48 bytes per entry.
        let pool = a.pool_bytes(RANKS, HIDDEN, TOP_K, a.batch * TOP_K * 48);
        epflow::core::host::memory::check_host_alloc(
            || format!("{} layers x {POOL} routings and token sets of {} tokens on {RANKS} ranks", a.layers, a.batch),
            pool,
        )?;
        let config = a.masking(GroupConfig::low_latency(EXPERTS, a.batch, HIDDEN).with_buffer_sets(sets));
        let spec = RoutingSpec {
            num_tokens: a.batch,
            top_k: TOP_K,
            num_experts: EXPERTS,
            num_ranks: RANKS,
            masked: 0,
            kind: RoutingKind::Uniform,
        };
        HostWorld::create(RANKS, config)?
            .into_iter()
            .map(|rank| {
                let g = Group::new(rank);
                let r = g.rank();
                let routes = (0..a.layers)
                    .map(|layer| {
                        (0..POOL)
                            .map(|p| {
                                let seed = (layer * POOL + p) as u64;
                                let idx = HostTensor::topk_idx(a.batch, TOP_K, random_topk_idx(&spec, 500 + seed, r));
                                let h = futures::executor::block_on(g.create_handle(&idx))?;
                                let w: Vec<f32> = random_weights(a.batch, TOP_K, 900 + seed, r)
                                    .iter()
                                    .map(|v| v / TOP_K as f32)
                                    .collect();
                                Ok((h, HostTensor::topk_weights(a.batch, TOP_K, w)))
                            })
                            .collect::<Result<Vec<_>>>()
                    })
                    .collect::<Result<Vec<_>>>()?;
                let tokens = (0..POOL)
                    .map(|p| HostTensor::tokens(a.batch, HIDDEN, random_tokens(a.batch, HIDDEN, 70 + p as u64, r)))
                    .collect();
                let lanes = vec![HostStream; 8];
                let rendezvous = g.backend().rendezvous();
                Ok(HostEngine {
                    g: RwLock::new(Some(Arc::new(g))),
                    rendezvous,
                    rank: r,
                    lanes,
                    routes,
                    tokens,
                    cost: Mutex::new(Duration::ZERO),
                })
            })
            .collect()
    }

    pub(crate) fn main(a: &Args) -> Result<Vec<(usize, Report)>> {
        super::run(&engines(a)?, a)
    }
}

/// The GPU backend: padded GEMM experts on one stream per micro-batch.
mod gpu {
    use std::sync::{Arc, Mutex, RwLock};
    use std::time::Duration;

    use cudarc::driver::{CudaContext, CudaStream, sys};
    use epflow::Group;
    use epflow::core::workload::{RoutingKind, RoutingSpec, random_tokens, random_topk_idx, random_weights};
    use epflow::core::{DType, Error, GroupConfig, HostTensor, Result, TensorDesc, TensorTag, bf16};
    use epflow::kernels::compute::ExpertGemm;
    use epflow::kernels::setup::tcp_bootstrap::{TcpBootstrap, TcpLinks};
    use epflow::kernels::{DeviceTensor, GpuCombineOutput, GpuDispatchOutput, GpuHandle, GpuRank, GpuWorld};
    use epflow::runtime::pipeline::StepInput;
    use epflow::runtime::reactor::{WaitOutcome, wait_for};

    use super::{Args, Engine, Mark, POOL, Report, fnv};

    const EXPERTS: usize = 32;
    const HIDDEN: usize = 2048;
    const TOP_K: usize = 8;
    /// Communication kernels use at most this many SMs (fewer with more micro-batches in flight:
    /// `compute::comm_sms`); the GEMMs get the rest.
    const COMM_SMS: usize = 48;

    pub(crate) struct GpuEngine {
        /// The rank's group and its routings (`None` while its process is dead, `--rejoin-at`).
        live: RwLock<Option<Arc<Live>>>,
        /// How a replacement for this rank is made (`--rejoin-at`).
        seat: Seat,
        ctx: Arc<CudaContext>,
        lanes: Vec<Arc<CudaStream>>,
        gemms: Vec<ExpertGemm>,
        w: DeviceTensor,
        /// One expert output buffer per lane.
        out: Vec<DeviceTensor>,
        tokens: Vec<DeviceTensor>,
        reps: Mutex<usize>,
    }

    /// What a rank's process holds of its group: the group, and per layer the handles and
    /// weights of its routing pool (made by the group's rank).
    struct Live {
        g: Arc<Group<GpuRank>>,
        routes: Vec<Vec<(GpuHandle, DeviceTensor)>>,
    }

    /// A rank's place in the group, for its replacement: the group's config, the rank's device,
    /// the routings' spec and batch, and the port of the rejoin meetings on this host.
    #[derive(Clone)]
    struct Seat {
        config: GroupConfig,
        rank: usize,
        device: usize,
        spec: RoutingSpec,
        layers: usize,
        port: u16,
    }

    impl Seat {
        /// Rank `self.rank`'s end of a rejoin meeting: a TCP bootstrap of every rank of the group
        /// on localhost (`port`), whoever reaches it first waiting for the others up to `wait`.
        fn meeting(&self, wait: Duration) -> Result<TcpBootstrap> {
            let links = TcpLinks::connect(self.rank, self.spec.num_ranks, "127.0.0.1", self.port, wait)?;
            TcpBootstrap::new(links, self.device)
        }

        /// The group of `rank` (this seat's), its meetings from this seat, and its routing pool.
        fn live(&self, rank: GpuRank) -> Result<Live> {
            let seat = self.clone();
            rank.set_meeting_source(Arc::new(move |wait| {
                Ok(Box::new(seat.meeting(wait)?) as Box<dyn epflow::kernels::setup::bootstrap::Bootstrap + Send>)
            }));
            let g = Group::new(rank);
            let (rk, r, batch) = (g.backend(), self.rank, self.spec.num_tokens);
            let routes = (0..self.layers)
                .map(|layer| {
                    (0..POOL)
                        .map(|p| {
                            let seed = (layer * POOL + p) as u64;
                            let idx = HostTensor::topk_idx(batch, TOP_K, random_topk_idx(&self.spec, 500 + seed, r));
                            let h = futures::executor::block_on(g.create_handle(&rk.upload(&idx)?))?;
                            let wk: Vec<f32> =
                                random_weights(batch, TOP_K, 900 + seed, r).iter().map(|v| v / TOP_K as f32).collect();
                            Ok((h, rk.upload(&HostTensor::topk_weights(batch, TOP_K, wk))?))
                        })
                        .collect::<Result<Vec<_>>>()
                })
                .collect::<Result<Vec<_>>>()?;
            Ok(Live { g: Arc::new(g), routes })
        }
    }

    /// Rank `r`'s expert weights `[H x H]` BF16, scaled so activations keep their size.
    fn expert_weights(rk: &GpuRank, r: usize) -> Result<DeviceTensor> {
        let scale = (3.0 / HIDDEN as f32).sqrt() / 2.0;
        let w: Vec<bf16> =
            random_tokens(HIDDEN, HIDDEN, 99, r).iter().map(|v| bf16::from_f32(v.to_f32() * scale)).collect();
        rk.upload(&HostTensor::tokens(HIDDEN, HIDDEN, w))
    }

    fn err(e: impl std::fmt::Debug) -> Error {
        Error::Backend(format!("{e:?}"))
    }

    impl GpuEngine {
        /// The rank's group and routings, while its process lives.
        fn live(&self) -> Result<Arc<Live>> {
            let live = self.live.read().unwrap_or_else(|e| e.into_inner());
            live.clone().ok_or_else(|| Error::Backend(format!("rank {}: its process is dead", self.seat.rank)))
        }

        fn enqueue(&self, lane: usize, d: &GpuDispatchOutput, reps: usize) -> Result<DeviceTensor> {
            let y = &self.out[lane];
            let mut last = None;
            for _ in 0..reps {
                last = Some(self.gemms[lane].padded(d.tokens(), &self.w, y)?);
            }
            Ok(y.clone().ready_after(Arc::new(last.ok_or_else(|| err("no GEMM"))?)))
        }
    }

    impl Engine for GpuEngine {
        type B = GpuRank;

        fn group(&self) -> Result<Arc<Group<GpuRank>>> {
            Ok(Arc::clone(&self.live()?.g))
        }

        fn die(&self) -> Result<()> {
            let live = self.live.write().unwrap_or_else(|e| e.into_inner()).take();
            let rank = self.seat.rank;
            let Some(live) = live else { return Err(Error::Backend(format!("rank {rank}: already dead"))) };
            let Live { g, routes } =
                Arc::try_unwrap(live).map_err(|_| Error::Backend(format!("rank {rank}: its group is still in use")))?;
            // The last references: the routings' handles, then the group and its rank go, as a
            // dead process's would (its memory stays mapped in the survivors' view until the
            // rejoin meeting lets it go).
            drop(routes);
            drop(Arc::try_unwrap(g).map_err(|_| Error::Backend(format!("rank {rank}: its group is still in use")))?);
            Ok(())
        }

        async fn replace(&self, timeout: Duration) -> Result<()> {
            // A new rank of this process takes the dead one's place: it meets the survivors
            // (admitting it at their vote) over the seat's meeting port, then makes its routing
            // pool before it votes (the survivors wait at the vote, with no kernel running that
            // an allocation here would wait for).
            let seat = self.seat.clone();
            let rank = tokio::task::spawn_blocking(move || -> Result<Live> {
                let meeting = seat.meeting(timeout)?;
                seat.live(GpuWorld::rejoin(&meeting, seat.config.clone())?)
            })
            .await
            .map_err(err)??;
            *self.live.write().unwrap_or_else(|e| e.into_inner()) = Some(Arc::new(rank));
            Ok(())
        }

        fn lanes(&self) -> &[Arc<CudaStream>] {
            &self.lanes
        }

        fn input(&self, mb: u64, layer: usize, prev: Option<GpuCombineOutput>) -> Result<StepInput<GpuRank>> {
            let (handle, weights) = self.live()?.routes[layer][(mb as usize * 7 + layer) % POOL].clone();
            let tokens = match prev {
                Some(out) if layer > 0 => out.tokens().clone(),
                _ => self.tokens[mb as usize % POOL].clone(),
            };
            Ok(StepInput { handle, tokens, weights, dispatch_options: Default::default() })
        }

        async fn expert(&self, lane: usize, d: &GpuDispatchOutput, awaited: bool) -> Result<DeviceTensor> {
            let reps = *self.reps.lock().unwrap_or_else(|e| e.into_inner());
            if reps == 0 {
                return Ok(d.tokens().clone());
            }
            let y = self.enqueue(lane, d, reps)?;
            if awaited {
                if let Some(ev) = y.ready_event().cloned() {
                    let ctx = Arc::clone(&self.ctx);
                    let probe = move || ctx.bind_to_thread().is_err() || ev.try_is_complete().unwrap_or(true);
                    if wait_for(probe, Duration::from_secs(10)).await == WaitOutcome::TimedOut {
                        return Err(err("expert GEMMs did not finish in 10 s"));
                    }
                }
            }
            Ok(y)
        }

        fn calibrate(&self, comm: Duration, scale: f64) -> Result<String> {
            if scale == 0.0 || comm.is_zero() {
                *self.reps.lock().unwrap_or_else(|e| e.into_inner()) = 0;
                return Ok("identity".into());
            }
            // Time one padded GEMM round on lane 0 with CUDA events (median of 20).
            let stream = &self.lanes[0];
            let x = &self.out[0];
            let mut times = Vec::new();
            for _ in 0..21 {
                let (a, b) = (
                    self.ctx.new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT)).map_err(err)?,
                    self.ctx.new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT)).map_err(err)?,
                );
                a.record(stream).map_err(err)?;
                self.gemms[0].padded(x, &self.w, &self.out[1 % self.out.len()])?;
                b.record(stream).map_err(err)?;
                b.synchronize().map_err(err)?;
                times.push(a.elapsed_ms(&b).map_err(err)? as f64 / 1e3);
            }
            times.sort_by(f64::total_cmp);
            let one = times[times.len() / 2];
            let reps = ((comm.as_secs_f64() * scale / one).round() as usize).max(1);
            *self.reps.lock().unwrap_or_else(|e| e.into_inner()) = reps;
            Ok(format!("{reps} rounds of the padded GEMM ({:.1} us each)", one * 1e6))
        }

        fn mark(&self, lane: usize) -> Result<Mark> {
            let e = self.ctx.new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT)).map_err(err)?;
            e.record(&self.lanes[lane]).map_err(err)?;
            Ok(Mark::Device(Arc::new(e)))
        }

        fn seconds(&self, start: &Mark, m: &Mark) -> f64 {
            match (start, m) {
                (Mark::Device(s), Mark::Device(t)) => {
                    let _ = t.synchronize();
                    s.elapsed_ms(t).map(|ms| f64::from(ms) / 1e3).unwrap_or(0.0)
                }
                _ => 0.0,
            }
        }

        fn digest(&self, out: &GpuCombineOutput) -> Result<u64> {
            let t = out.to_host()?;
            let v = t.tokens.as_bf16().ok_or_else(|| err("tokens not BF16"))?;
            Ok(fnv(v.iter().map(|x| x.to_bits())))
        }

        fn masked(&self, out: &GpuCombineOutput) -> Result<Vec<i32>> {
            match out.masked() {
                Some(m) => Ok(m.download(&self.ctx)?.as_i32().map(<[i32]>::to_vec).unwrap_or_default()),
                None => Ok(Vec::new()),
            }
        }
    }

    /// `--graph`: decode-step latency, eager against a captured step, per rank on its own thread;
    /// rank 0 prints.
    pub(crate) fn decode_latency(a: &Args) -> Result<()> {
        use epflow::core::graph::StepCounts;
        use epflow::core::ops::{CombineInputs, CombineOptions, DispatchInputs, DispatchOptions, HandleOptions};

        let devices: Vec<usize> = match &a.devices {
            Some(d) => d.clone(),
            None => (0..epflow::kernels::device_count().min(8)).collect(),
        };
        let ranks = devices.len();
        if ranks == 0 {
            return Err(Error::Unsupported("--graph needs a GPU".into()));
        }
        let comm = epflow::kernels::compute::comm_sms_for(&devices, 2, COMM_SMS)?;
        let config = GroupConfig::low_latency(EXPERTS, a.batch, HIDDEN).with_max_sms(Some(comm));
        let spec = RoutingSpec {
            num_tokens: a.batch,
            top_k: TOP_K,
            num_experts: EXPERTS,
            num_ranks: ranks,
            masked: 0,
            kind: RoutingKind::Uniform,
        };
        let barrier = super::flags::TimedBarrier::new(ranks);
        let world = GpuWorld::create(&devices, config)?;
        let results = std::thread::scope(|s| {
            let hs: Vec<_> = world
                .into_iter()
                .map(|rank| {
                    let barrier = &barrier;
                    let spec = &spec;
                    s.spawn(move || -> Result<(Vec<f64>, Vec<f64>, bool, StepCounts)> {
                        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().map_err(err)?;
                        let g = Group::new(rank);
                        let r = g.rank();
                        let rk = g.backend();
                        let ctx = Arc::clone(rk.context());
                        let l = EXPERTS / ranks;
                        let desc =
                            TensorDesc::contiguous(TensorTag::Tokens, DType::Bf16, &[l, ranks * a.batch, HIDDEN]);
                        // Per layer: a routing, weights, an eager and a captured handle, a GEMM output.
                        let per_layer =
                            (a.batch * TOP_K * 12 + 2 * rk.handle_memory_bytes() + desc.size_bytes()) as u128;
                        super::flags::check_device_memory(
                            &ctx,
                            || format!("rank {r}: {} layers of routings, handles and expert outputs", a.layers),
                            a.layers as u128 * per_layer + (HIDDEN * HIDDEN * 2 + 2 * desc.size_bytes()) as u128,
                        )?;
                        let w = expert_weights(rk, r)?;
                        let x0 =
                            rk.upload(&HostTensor::tokens(a.batch, HIDDEN, random_tokens(a.batch, HIDDEN, 70, r)))?;
                        let mut topk = Vec::new();
                        let mut weights = Vec::new();
                        for layer in 0..a.layers {
                            let idx = random_topk_idx(spec, 500 + layer as u64, r);
                            topk.push(rk.upload(&HostTensor::topk_idx(a.batch, TOP_K, idx))?);
                            let wk: Vec<f32> = random_weights(a.batch, TOP_K, 900 + layer as u64, r)
                                .iter()
                                .map(|v| v / TOP_K as f32)
                                .collect();
                            weights.push(rk.upload(&HostTensor::topk_weights(a.batch, TOP_K, wk))?);
                        }
                        let gemm_on = |stream: &Arc<CudaStream>| ExpertGemm::new(Arc::clone(stream));
                        let identity = a.expert_scale == 0.0;
                        // Eager: every operation awaited in turn, the GEMM on the lane stream.
                        let lane = ctx.new_stream().map_err(err)?;
                        let lane_gemm = gemm_on(&lane)?;
                        let y = DeviceTensor::zeros(&ctx, rk.device(), desc.clone())?;
                        let handles = rt.block_on(async {
                            let mut hs = Vec::new();
                            for t in &topk {
                                hs.push(g.create_handle(t).await?);
                            }
                            Ok::<_, Error>(hs)
                        })?;
                        let eager_step = || -> Result<u64> {
                            rt.block_on(async {
                                let mut x = x0.clone();
                                for (layer, h) in handles.iter().enumerate() {
                                    let d = g.dispatch(h, DispatchInputs::new(&x)).await?;
                                    let experts = if identity {
                                        d.tokens().clone()
                                    } else {
                                        let ev = lane_gemm.padded(d.tokens(), &w, &y)?;
                                        y.clone().ready_after(Arc::new(ev))
                                    };
                                    let c = g
                                        .combine(h, CombineInputs::new(&experts).with_weights(&weights[layer]))
                                        .await?;
                                    x = c.tokens().clone();
                                }
                                let host = x.download(&ctx)?;
                                Ok(fnv(host.as_bf16().unwrap_or_default().iter().map(|v| v.to_bits())))
                            })
                        };
                        // Graph: the same step captured once.
                        let cap_stream = ctx.new_stream().map_err(err)?;
                        let cap_gemm = gemm_on(&cap_stream)?;
                        let ys = (0..a.layers)
                            .map(|_| DeviceTensor::zeros(&ctx, rk.device(), desc.clone()))
                            .collect::<Result<Vec<_>>>()?;
                        let ghandles = topk
                            .iter()
                            .map(|t| rk.graph_handle(t, &HandleOptions::default()))
                            .collect::<Result<Vec<_>>>()?;
                        let mut last = None;
                        let step = rk.capture(&cap_stream, |cap| {
                            let mut x = x0.clone();
                            for (layer, h) in ghandles.iter().enumerate() {
                                let d = cap.dispatch(h, DispatchInputs::new(&x), &DispatchOptions::default())?;
                                let experts = if identity {
                                    d.tokens
                                } else {
                                    cap_gemm.padded(&d.tokens, &w, &ys[layer])?;
                                    ys[layer].clone()
                                };
                                let cin = CombineInputs::new(&experts).with_weights(&weights[layer]);
                                x = cap.combine(h, cin, &CombineOptions::default())?;
                            }
                            last = Some(x);
                            Ok(())
                        })?;
                        let out = last.ok_or_else(|| err("empty step"))?;
                        let replay = || -> Result<u64> {
                            rt.block_on(g.replay(&step))?;
                            let host = out.download(&ctx)?;
                            Ok(fnv(host.as_bf16().unwrap_or_default().iter().map(|v| v.to_bits())))
                        };
                        let (eager_digest, graph_digest) = (eager_step()?, replay()?);
                        let time = |f: &dyn Fn() -> Result<()>| -> Result<Vec<f64>> {
                            let mut v = Vec::new();
                            for i in 0..a.rounds + 10 {
                                barrier.wait(Duration::from_secs(60))?;
                                let t = std::time::Instant::now();
                                f()?;
                                if i >= 10 {
                                    v.push(t.elapsed().as_secs_f64() * 1e6);
                                }
                            }
                            v.sort_by(f64::total_cmp);
                            Ok(v)
                        };
                        // Both timed with the final output's download and digest, as a server reads it.
                        let eager = time(&|| eager_step().map(drop))?;
                        let graph = time(&|| replay().map(drop))?;
                        Ok((eager, graph, eager_digest == graph_digest, step.counts()))
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p))).collect::<Vec<_>>()
        });
        let mut all = Vec::new();
        for r in results {
            all.push(r?);
        }
        let (eager, graph, same, counts) = &all[0];
        let med = |v: &[f64]| v[v.len() / 2];
        let agree = all.iter().all(|r| r.2);
        println!(
            "moe_serving --graph: {ranks} rank(s), {} layers, {} tokens/rank, H={HIDDEN} E={EXPERTS} K={TOP_K}, experts: {}; {} dispatches + {} combines per step",
            a.layers,
            a.batch,
            if a.expert_scale == 0.0 { "identity" } else { "one padded GEMM per layer" },
            counts.dispatches,
            counts.combines
        );
        println!(
            "decode step (host clock, rank 0, {} steps after 10 warm-up): eager median {:.1} us (p90 {:.1}), graph median {:.1} us (p90 {:.1}): graph / eager = {:.2}",
            eager.len(),
            med(eager),
            eager[eager.len() * 9 / 10],
            med(graph),
            graph[graph.len() * 9 / 10],
            med(graph) / med(eager)
        );
        println!(
            "final outputs of the two paths identical on every rank: {}",
            if agree && *same { "yes" } else { "NO" }
        );
        if !agree {
            return Err(err("the captured step's output differs from the eager step's"));
        }
        Ok(())
    }

    pub(crate) fn main(a: &Args) -> Result<Vec<(usize, Report)>> {
        let devices: Vec<usize> = match &a.devices {
            Some(d) => d.clone(),
            None => (0..epflow::kernels::device_count().min(8)).collect(),
        };
        let gpus = devices.len();
        if gpus < 1 {
            return Err(Error::Unsupported(
                "--backend gpu needs a GPU (--devices 0,0 runs two ranks on one, for checks)".into(),
            ));
        }
        let sets = a.micro_batches.iter().copied().max().unwrap_or(2).max(2);
        let comm = epflow::kernels::compute::comm_sms_for(&devices, sets, COMM_SMS)?;
        let config = a.masking(
            GroupConfig::low_latency(EXPERTS, a.batch, HIDDEN).with_max_sms(Some(comm)).with_buffer_sets(sets),
        );
        let spec = RoutingSpec {
            num_tokens: a.batch,
            top_k: TOP_K,
            num_experts: EXPERTS,
            num_ranks: gpus,
            masked: 0,
            kind: RoutingKind::Uniform,
        };
        // `--rejoin-at`: the rejoin meetings' port on this host (any free one).
        let port = match a.rejoin_at {
            Some(_) => std::net::TcpListener::bind(("127.0.0.1", 0)).and_then(|l| l.local_addr()).map_err(err)?.port(),
            None => 0,
        };
        let engines = GpuWorld::create(&devices, config.clone())?
            .into_iter()
            .map(|rank| {
                let r = epflow::core::backend::Backend::rank(&rank);
                let ctx = Arc::clone(rank.context());
                let l = EXPERTS / gpus;
                let desc = TensorDesc::contiguous(TensorTag::Tokens, DType::Bf16, &[l, gpus * a.batch, HIDDEN]);
                let need = a.pool_bytes(1, HIDDEN, TOP_K, rank.handle_memory_bytes())
                    + (sets * desc.size_bytes() + HIDDEN * HIDDEN * 2) as u128;
                super::flags::check_device_memory(
                    &ctx,
                    || format!("rank {r}: {} layers x {POOL} routings, token sets and {sets} expert outputs", a.layers),
                    need,
                )?;
                let w = expert_weights(&rank, r)?;
                let out =
                    (0..sets).map(|_| DeviceTensor::zeros(&ctx, rank.device(), desc.clone())).collect::<Result<_>>()?;
                let lanes: Vec<Arc<CudaStream>> =
                    (0..sets).map(|_| ctx.new_stream().map_err(err)).collect::<Result<_>>()?;
                let gemms = lanes.iter().map(|s| ExpertGemm::new(Arc::clone(s))).collect::<Result<_>>()?;
                let tokens = (0..POOL)
                    .map(|p| {
                        rank.upload(&HostTensor::tokens(
                            a.batch,
                            HIDDEN,
                            random_tokens(a.batch, HIDDEN, 70 + p as u64, r),
                        ))
                    })
                    .collect::<Result<_>>()?;
                let seat = Seat { config: config.clone(), rank: r, device: devices[r], spec, layers: a.layers, port };
                let live = seat.live(rank)?;
                Ok(GpuEngine {
                    live: RwLock::new(Some(Arc::new(live))),
                    seat,
                    ctx,
                    lanes,
                    gemms,
                    w,
                    out,
                    tokens,
                    reps: Mutex::new(0),
                })
            })
            .collect::<Result<Vec<_>>>()?;
        super::run(&engines, a)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Parses `extra` after the program name.
    fn parse(extra: &[&str]) -> std::result::Result<Args, clap::Error> {
        let v: Vec<String> = std::iter::once("moe_serving").chain(extra.iter().copied()).map(String::from).collect();
        Args::parse(&v)
    }

    fn args(extra: &[&str]) -> Args {
        parse(&[&["--backend", "host"][..], extra].concat()).expect("arguments")
    }

    /// A few seconds of serving on the host backend, 1 and 2 micro-batches in flight: every
    /// request's micro-batch output equals the serial run's, bit for bit, and requests were served.
    #[test]
    fn serving_matches_the_serial_run() {
        let a = args(&[
            "--seconds",
            "1.5",
            "--rate",
            "2000",
            "--layers",
            "2",
            "--rounds",
            "2",
            "--micro-batches",
            "1,2",
            "--check",
            "--quiet",
        ]);
        let reports = host::main(&a).expect("serving");
        assert_eq!(reports.len(), 2);
        for (m, r) in &reports {
            assert!(r.requests > 0, "{m} micro-batches served nothing");
            assert!(r.tokens_per_s > 0.0 && r.p50.is_finite() && r.p99 >= r.p50, "{m}: bad figures");
        }
    }

    #[test]
    fn bad_arguments_are_refused() {
        let v = parse;
        assert!(v(&["--micro-batches", "0"]).is_err());
        assert!(v(&["--micro-batches", "9"]).is_err());
        assert!(v(&["--rate", "abc"]).is_err());
        assert!(v(&["--request-tokens", "1000", "--batch", "32"]).is_err());
        assert!(v(&["--order", "sideways"]).is_err());
        assert!(v(&["--backend", "host", "--graph"]).is_err());
    }

    /// `--model` and its flags: an unknown model names the presets; the host backend, `--graph`,
    /// too many layers, and the model's flags without `--model` are refused (exit code 2).
    #[test]
    fn model_flags_are_checked() {
        let e = parse(&["--model", "llama"]).expect_err("an unknown model");
        assert!(e.to_string().contains("qwen3-30b-a3b, mixtral-8x7b, deepseek-v3"), "{e}");
        for bad in [
            &["--backend", "host", "--model", "qwen3-30b-a3b"][..],
            &["--model", "qwen3-30b-a3b", "--graph"],
            &["--model", "mixtral-8x7b", "--layers", "33"],
            &["--sweep-batch", "8,16"],
            &["--backend", "host", "--json", "x.json"],
            &["--prefill-tokens", "4096"],
            &["--model", "qwen3-30b-a3b", "--prefill-tokens", "0"],
            &["--model", "qwen3-30b-a3b", "--sweep-batch", "0"],
            &["--model", "qwen3-30b-a3b", "--steps", "0"],
            &["--model", "qwen3-30b-a3b", "--attention", "flash"],
            &["--eager-compute", "--backend", "host"],
            &["--ranks", "1", "--devices", "0"],
            &["--ranks", "9"],
            &["--backend", "nccl-ep"],
            &["--backend", "nccl-ep", "--model", "qwen3-30b-a3b", "--prefill-tokens", "1024"],
        ] {
            let e = parse(bad).err().unwrap_or_else(|| panic!("{bad:?} accepted"));
            assert_eq!(e.exit_code(), 2, "{bad:?}: {e}");
        }
    }

    /// Bad numbers are usage errors (exit code 2), never a panic or a silent default; `--help`
    /// prints usage (exit code 0).
    #[test]
    fn bad_numbers_are_usage_errors() {
        let parse = |x: &[&str]| parse(&[&["--backend", "host"][..], x].concat());
        for bad in [
            &["--rate", "nan"][..],
            &["--rate", "inf"],
            &["--rate", "0"],
            &["--seconds", "nan"],
            &["--seconds", "1e30"],
            &["--expert-scale", "nan"],
            &["--expert-scale", "-1"],
            &["--layers", "1e9"],
            &["--layers", "0"],
            &["--layers", "1025"],
            &["--batch", "0"],
            &["--kill-timeout", "0"],
            &["--vote-timeout", "nan"],
            &["--kill-rank", "7"],
            &["--kill-rank", "4"],
            &["--kill-rank", "1", "--at", "9", "--seconds", "5"],
            &["--at", "1"],
            &["--bogus"],
        ] {
            let e = parse(bad).err().unwrap_or_else(|| panic!("{bad:?} accepted"));
            assert_eq!(e.exit_code(), 2, "{bad:?}: {e}");
        }
        let help = parse(&["--help"]).expect_err("--help is not a run");
        assert_eq!(help.kind(), clap::error::ErrorKind::DisplayHelp);
        assert_eq!(help.exit_code(), 0);
        assert!(help.to_string().contains("--kill-timeout"), "{help}");
        let ok = parse(&["--kill-rank", "3", "--at", "0.5", "--seconds", "1"]).expect("valid");
        assert_eq!(ok.kill, Some((3, 0.5)));
    }

    /// A one-second host run with rank `dead` killed and `extra` flags, under a 60 s watchdog
    /// (a hang fails the test): the number of settings reported, or the error.
    /// Held for writing by the test that keeps every core busy, for reading by the tests that
    /// check outputs bit-exact under a short group timeout: starved of CPU beside it, a live rank
    /// misses the timeout, its peers mask it (as they should), and the outputs then differ from
    /// the full group's (a CI run on 2 cores, 2026-12-07).
    static CPU_LOAD: std::sync::RwLock<()> = std::sync::RwLock::new(());

    fn killed_run(dead: &str, extra: &[&str]) -> std::result::Result<usize, String> {
        let common = ["--kill-rank", dead, "--seconds", "1", "--rate", "4000", "--layers", "2", "--rounds", "2"];
        let a = args(&[&common[..], &["--vote-timeout", "20", "--quiet"], extra].concat());
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(host::main(&a).map(|r| r.len()).map_err(|e| e.to_string()));
        });
        rx.recv_timeout(Duration::from_secs(60)).unwrap_or_else(|_| Err(format!("rank {dead} killed: the run hung")))
    }

    /// The soak's short form (`scripts/soak-kill-rank.sh` runs 200): `--kill-rank` runs with
    /// every core kept busy by spinning threads, and a short mask timeout so that live ranks
    /// get masked too. Each run must end (a watchdog fails the test after 60 s), and end well:
    /// a live rank its peers masked stops cleanly instead of leaving them waiting at a vote.
    #[test]
    fn kill_rank_under_cpu_load_never_hangs() {
        let _alone = CPU_LOAD.write().unwrap_or_else(|e| e.into_inner());
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
        let spinners: Vec<_> = (0..cores)
            .map(|_| {
                let stop = Arc::clone(&stop);
                std::thread::spawn(move || {
                    let mut x = 0u64;
                    while !stop.load(Ordering::Relaxed) {
                        x = std::hint::black_box(x.wrapping_mul(6364136223846793005).wrapping_add(1));
                    }
                })
            })
            .collect();
        for (i, timeout) in ["200", "500", "100"].into_iter().enumerate() {
            let result = killed_run(&(i + 1).to_string(), &["--at", "0.4", "--kill-timeout", timeout]);
            assert_eq!(result, Ok(1), "run {i} (--kill-timeout {timeout})");
        }
        stop.store(true, Ordering::Relaxed);
        spinners.into_iter().for_each(|t| t.join().expect("spinner"));
    }

    /// `--rejoin-at` (issue 68): the killed rank's process is dropped and its replacement
    /// rejoins the running group; with `--check`, every micro-batch the whole group served after
    /// the rejoin matches a serial rerun bit for bit (the run fails otherwise), on every rank,
    /// the replacement included. Three runs, a different rank each time, under a watchdog.
    #[test]
    fn a_killed_rank_rejoins_and_the_group_is_bit_exact_after() {
        let _no_load = CPU_LOAD.read().unwrap_or_else(|e| e.into_inner());
        for (i, dead) in ["1", "3", "0"].into_iter().enumerate() {
            let result = killed_run(dead, &["--at", "0.3", "--rejoin-at", "0.6", "--kill-timeout", "200", "--check"]);
            assert_eq!(result, Ok(1), "run {i} (rank {dead} killed and replaced)");
        }
        for bad in [
            &["--kill-rank", "1", "--at", "0.5", "--rejoin-at", "0.4", "--seconds", "1"][..],
            &["--kill-rank", "1", "--at", "0.5", "--rejoin-at", "2", "--seconds", "1"],
            &["--rejoin-at", "0.5"],
        ] {
            let e =
                parse(&[&["--backend", "host"][..], bad].concat()).err().unwrap_or_else(|| panic!("{bad:?} accepted"));
            assert_eq!(e.exit_code(), 2, "{bad:?}: {e}");
        }
    }

    /// `--rejoin-at` on GPUs: a new rank of the process takes the killed one's place
    /// (`GpuWorld::rejoin`) and, with `--check`, every micro-batch served after the rejoin is
    /// bit-exact on every rank. Two ranks: on two GPUs, or on GPU 0 twice (a functional check);
    /// `EPFLOW_TEST_DEVICES` names them. Without a GPU it prints SKIPPED and passes.
    #[test]
    fn a_killed_gpu_rank_rejoins_and_the_group_is_bit_exact_after() {
        let gpus = epflow::kernels::device_count();
        if gpus == 0 {
            eprintln!("SKIPPED a_killed_gpu_rank_rejoins_and_the_group_is_bit_exact_after: no GPU");
            return;
        }
        let devices =
            std::env::var("EPFLOW_TEST_DEVICES").unwrap_or_else(|_| (if gpus > 1 { "0,1" } else { "0,0" }).into());
        let run = "--backend gpu --kill-rank 1 --at 1 --rejoin-at 2 --seconds 3 --rate 4000 --layers 2 --rounds 2 --vote-timeout 60 --check";
        let a =
            parse(&[&run.split(' ').collect::<Vec<_>>()[..], &["--devices", &devices]].concat()).expect("arguments");
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(gpu::main(&a).map(|r| r.len()).map_err(|e| e.to_string()));
        });
        let result = rx.recv_timeout(Duration::from_secs(180)).unwrap_or_else(|_| Err("the run hung".into()));
        assert_eq!(result, Ok(1), "devices {devices}");
    }

    fn block_on<T>(f: impl Future<Output = T>) -> T {
        tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime").block_on(f)
    }

    /// A rank that leaves (killed, or masked by slower-than-timeout peers) lets the others'
    /// vote end; one that neither votes nor leaves ends it with an error naming it, at the
    /// deadline, instead of a hang.
    #[test]
    fn votes_end_when_a_rank_leaves_or_at_the_deadline() {
        let votes = Votes::new(3, Duration::from_secs(20));
        let decided = block_on(async {
            let leaver = async {
                tokio::time::sleep(Duration::from_millis(20)).await;
                drop(Seat { votes: &votes, rank: 2 });
            };
            let (a, b, ()) = futures::join!(votes.decide(0, 0, 1), votes.decide(1, 0, 2), leaver);
            (a.expect("rank 0"), b.expect("rank 1"))
        });
        assert_eq!(decided, (2, 2));
        // Rank 2 is gone for good: the next round needs only ranks 0 and 1.
        let next = block_on(async { futures::join!(votes.decide(0, 1, 0), votes.decide(1, 1, 0)) });
        assert_eq!((next.0.expect("rank 0"), next.1.expect("rank 1")), (0, 0));

        let stuck = Votes::new(2, Duration::from_millis(100));
        let t = Instant::now();
        let e = block_on(stuck.decide(0, 0, 2)).expect_err("rank 1 never votes");
        assert!(e.to_string().contains("ranks [1] did not vote"), "{e}");
        assert!(t.elapsed() < Duration::from_secs(10));
    }

    #[test]
    fn union_of_intervals() {
        assert_eq!(union(&mut [(0.0, 1.0), (0.5, 2.0), (3.0, 4.0)]), 3.0);
        assert_eq!(union(&mut []), 0.0);
    }
}

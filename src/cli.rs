//! Command-line arguments of the `epflow` binary.

use clap::{Parser, Subcommand, ValueEnum};

/// epflow: async expert-parallel dispatch/combine for MoE models.
#[derive(Debug, Parser)]
#[command(name = "epflow", version, about)]
pub(crate) struct Cli {
    /// What to run.
    #[command(subcommand)]
    pub command: Command,
}

/// The subcommands.
#[derive(Debug, Subcommand)]
pub(crate) enum Command {
    /// Benchmark dispatch and combine (flags and output modelled on NCCL EP's ep_bench).
    Bench(BenchArgs),
    /// Compile every CUDA kernel with NVRTC (no GPU needed) and report the result.
    #[command(alias = "kernels")]
    Compile(CompileArgs),
    /// Start N processes on this host, one per GPU, with RANK, WORLD_SIZE, LOCAL_RANK and the
    /// NCCL unique id (EPFLOW_NCCL_ID) in their environment.
    ///
    /// -n is 1 to 8 processes per host (the most ranks a GPU group may have), --nnodes 1 to
    /// 1024, and -n x --nnodes at most 1024 ranks; out of range, nothing is started (exit code 2).
    Launch(LaunchArgs),
    /// Diagnostics on one GPU.
    #[command(subcommand)]
    Diag(DiagCommand),
    /// Summarize NCCL EP `ep_bench` runs (one output file per run) of a baseline library and of
    /// epflow's `libnccl_ep.so`: per case, kernel and host-observed means, runs with a whole-run
    /// rank offset, baseline / epflow ratios, and the runs that met `--targets`.
    ///
    /// Every value read must be a finite number: a run with NaN or inf is an error naming the
    /// file, line and field, and is left out. Exit code 1 when a run's validation failed or a run
    /// was left out so, 2 on bad flags or when a side has no usable run.
    EpBenchReport(EpBenchReportArgs),
    /// Draw `epflow bench --json` runs (epflow's and `--backend nccl-ep`'s) as one SVG: latency
    /// against tokens per rank, a line per backend, layout and operation.
    Chart(ChartArgs),
}

/// `epflow chart` flags.
#[derive(Clone, Debug, clap::Args)]
pub(crate) struct ChartArgs {
    /// `epflow bench --json` output files (one or more runs each), all from one setup (device
    /// and rank count).
    #[arg(required = true, num_args = 1..)]
    pub files: Vec<std::path::PathBuf>,
    /// The SVG file to write.
    #[arg(long)]
    pub svg: std::path::PathBuf,
    /// Which of each run's figures to draw.
    #[arg(long, value_enum, default_value_t = ChartMetric::Median)]
    pub metric: ChartMetric,
    /// The chart's title (default: the metric and the setup).
    #[arg(long)]
    pub title: Option<String>,
}

/// The figure `epflow chart` draws per run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(crate) enum ChartMetric {
    /// The median over iterations (`median_us`).
    Median,
    /// The mean over iterations and ranks (`avg_us`, as ep_bench reports).
    Avg,
}

/// `epflow ep-bench-report` flags.
#[derive(Clone, Debug, clap::Args)]
pub(crate) struct EpBenchReportArgs {
    /// The baseline's `ep_bench` output files (NVIDIA's `libnccl_ep.so`), one per run.
    #[arg(long, num_args = 1.., required = true)]
    pub baseline: Vec<std::path::PathBuf>,
    /// epflow's `ep_bench` output files (the same program on epflow's `libnccl_ep.so`), one per
    /// run.
    #[arg(long, num_args = 1.., required = true)]
    pub ours: Vec<std::path::PathBuf>,
    /// A run whose two ranks' kernel averages (ep_bench's kernel `min` / `max`) are this many
    /// microseconds apart or more, in dispatch or combine, counts as an offset run.
    #[arg(long, default_value_t = 3.0)]
    pub offset_us: f64,
    /// epflow's kernel targets, `[LAYOUT:]TOKENS:DISPATCH/COMBINE` in µs, comma-separated (e.g.
    /// `rank-major:1:10/10,rank-major:128:20/22`; without a layout, for every layout): the runs
    /// whose means met both are counted.
    #[arg(long)]
    pub targets: Option<String>,
}

/// `epflow diag` subcommands.
#[derive(Clone, Debug, Subcommand)]
pub(crate) enum DiagCommand {
    /// The host time of launching each low-latency kernel alone, as a device no-op (GPU idle, and
    /// back to back, and after waits for another stream's event): what a launch costs by itself
    /// (benches/NOTES.md item 42).
    Launch(DiagLaunchArgs),
    /// Real low-latency operations on one GPU in several sequences (pairs, dispatches alone,
    /// combines alone, after host sleeps, and no-op launches right after them), with each
    /// launch's host time: what the operations around a launch add to it (benches/NOTES.md
    /// item 42). Same flags as `launch`.
    Ops(DiagLaunchArgs),
    /// Every `EPFLOW_*` knob: its value in this environment (or unset), its default and meaning,
    /// and the tuning a new group takes from them (no GPU needed).
    Env,
}

/// `epflow diag launch` flags.
#[derive(Clone, Debug, clap::Args)]
pub(crate) struct DiagLaunchArgs {
    /// The GPU.
    #[arg(long, default_value_t = 0)]
    pub device: usize,
    /// Tokens per rank the grids are sized for.
    #[arg(long, default_value_t = 1)]
    pub tokens: usize,
    /// Launches timed per kernel and mode.
    #[arg(long, default_value_t = 500)]
    pub iters: usize,
    /// Hidden size of the group (its kernels' geometry).
    #[arg(long, default_value_t = 7168)]
    pub hidden: usize,
    /// Experts of the group.
    #[arg(long, default_value_t = 256)]
    pub experts: usize,
}

/// `epflow launch` flags.
///
/// Bounds: `-n` is 1 to [`epflow_kernels::MAX_GPU_RANKS`] (8) processes per host, `--nnodes` 1 to
/// [`epflow_core::config::MAX_RANKS`] (1024) hosts, `--node-rank` below `--nnodes`, and the whole
/// job (`-n` x `--nnodes`) at most `MAX_RANKS` ranks. A value out of range is an error (exit
/// code 2) and nothing is started.
#[derive(Clone, Debug, clap::Args)]
pub(crate) struct LaunchArgs {
    /// Number of processes on this host (one per GPU), 1 to 8 (the most ranks a GPU group may
    /// have, `epflow_kernels::MAX_GPU_RANKS`).
    #[arg(short = 'n', long = "nprocs", value_parser = parse_nprocs)]
    pub nprocs: usize,
    /// Hosts in the job (with --master-addr; each host runs its own `epflow launch`), 1 to 1024;
    /// -n x --nnodes is at most 1024 ranks (`epflow_core::config::MAX_RANKS`).
    #[arg(long, default_value_t = 1, value_parser = parse_nnodes)]
    pub nnodes: usize,
    /// This host's index among --nnodes, below --nnodes (its processes get RANK = node_rank *
    /// nprocs + i).
    #[arg(long, default_value_t = 0)]
    pub node_rank: usize,
    /// Rank 0's host: the processes find each other over TCP (MASTER_ADDR, as torchrun sets it)
    /// instead of an id made here; needed with --nnodes > 1 [default: $MASTER_ADDR].
    #[arg(long)]
    pub master_addr: Option<String>,
    /// Rank 0's TCP port for the rendezvous [default: $MASTER_PORT, else 29500].
    #[arg(long)]
    pub master_port: Option<u16>,
    /// Restarts (one host, --nnodes 1): a rank's process that fails (a non-zero exit status or
    /// a signal) while others still run is started again, at most this many times, with
    /// EPFLOW_REJOIN=1 and EPFLOW_RESTART=<its count>, while the others keep running, so that it
    /// rejoins the running group (GpuWorld::rejoin); every process gets EPFLOW_MEETING_PORT
    /// (--master-port + 1) for the rejoin meetings. 0: a failed rank stops the others.
    #[arg(long, default_value_t = 0)]
    pub restarts: usize,
    /// The command each process runs, after `--`.
    #[arg(trailing_var_arg = true, required = true, allow_hyphen_values = true)]
    pub command: Vec<String>,
}

/// `epflow compile` flags.
#[derive(Clone, Debug, clap::Args)]
pub(crate) struct CompileArgs {
    /// Target architecture [default: the first GPU's, else sm_90].
    #[arg(long)]
    pub arch: Option<String>,
    /// Also write each module's CUBIN to this folder, as `<module>-<arch>.cubin` (for
    /// `cuobjdump --dump-resource-usage`: registers, spills and shared memory per kernel).
    #[arg(long, value_name = "DIR")]
    pub cubin_dir: Option<std::path::PathBuf>,
}

/// Which algorithm to benchmark.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(crate) enum AlgorithmArg {
    /// Low-latency.
    Ll,
    /// High-throughput.
    Ht,
    /// Low-latency up to 256 tokens per rank, high-throughput above (measured crossover on 4 x H200).
    Auto,
}

impl AlgorithmArg {
    /// `"ll"`, `"ht"` or `"auto"`.
    pub(crate) fn name(self) -> &'static str {
        match self {
            AlgorithmArg::Ll => "ll",
            AlgorithmArg::Ht => "ht",
            AlgorithmArg::Auto => "auto",
        }
    }
}

/// Dispatch element type.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(crate) enum DtypeArg {
    /// BF16.
    Bf16,
    /// FP8 e4m3 with per-128-channel scales.
    Fp8,
}

/// Low-latency receive layout (NCCL EP's `ncclEpLayout_t`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(crate) enum LayoutArg {
    /// A row per (token, local expert): `[L x R*M x H]`; combine applies the weights.
    #[value(name = "expert-major")]
    ExpertMajor,
    /// A row per (source rank, token): `[R*M x H]` with the weights; the expert side
    /// pre-reduces and combine sends one row per (token, rank reached).
    #[value(name = "rank-major")]
    RankMajor,
}

impl LayoutArg {
    /// The layout.
    pub(crate) fn layout(self) -> epflow_core::ops::Layout {
        match self {
            LayoutArg::ExpertMajor => epflow_core::ops::Layout::ExpertMajor,
            LayoutArg::RankMajor => epflow_core::ops::Layout::RankMajor,
        }
    }
}

/// Which backend runs the benchmark.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(crate) enum BackendArg {
    /// The GPU backend when GPUs are present, else the host backend.
    Auto,
    /// The host backend: every rank a thread of this process, on host memory.
    Host,
    /// The GPU backend: NVLink kernels, one process driving every GPU.
    Gpu,
    /// The GPU backend with every exchange between distinct ranks over NCCL grouped send/recv
    /// (the multi-node engine; needs libnccl ≥ 2.28 on the library path).
    Nccl,
    /// NVIDIA's NCCL EP (`libnccl_ep`, NCCL EP 0.1) through epflow's backend trait: low-latency
    /// and high-throughput, BF16, one process driving every GPU (`NCCL_EP_LIB` or the library
    /// path).
    #[value(name = "nccl-ep")]
    NcclEp,
}

/// `epflow bench` flags.
#[derive(Clone, Debug, clap::Args)]
pub(crate) struct BenchArgs {
    /// Algorithm.
    #[arg(long, value_enum, default_value = "ll")]
    pub algorithm: AlgorithmArg,
    /// Tokens per rank, 1 to 16777216 (`MAX_TOKENS_PER_RANK`) [default: 128 for ll and auto,
    /// 4096 for ht].
    #[arg(long)]
    pub tokens: Option<usize>,
    /// Hidden size: a multiple of 8 (of 128 with --dtype fp8), at most 1048576 (`MAX_HIDDEN`).
    #[arg(long, default_value_t = 7168)]
    pub hidden: usize,
    /// Experts per token, 1 to 16 (`MAX_TOP_K`) and at most --experts.
    #[arg(long = "top-k", default_value_t = 8)]
    pub top_k: usize,
    /// Total experts: a multiple of the ranks, at most 32768 (`MAX_EXPERTS`).
    #[arg(long, default_value_t = 256)]
    pub experts: usize,
    /// Ranks, 1 to 1024 (`MAX_RANKS`; 8 on the gpu backend, `MAX_GPU_RANKS`) [default: the GPUs
    /// present (gpu backend), else 4].
    #[arg(long)]
    pub ranks: Option<usize>,
    /// Warm-up iterations.
    #[arg(long, default_value_t = 10)]
    pub warmup: usize,
    /// Timed iterations.
    #[arg(long, default_value_t = 50)]
    pub iters: usize,
    /// Check the outputs against the CPU reference.
    #[arg(long)]
    pub validate: bool,
    /// Dispatch element type.
    #[arg(long, value_enum, default_value = "bf16")]
    pub dtype: DtypeArg,
    /// With --dtype fp8: round scales up to powers of two.
    #[arg(long)]
    pub round_scales: bool,
    /// Low-latency: time the staged form (send half, then complete half).
    #[arg(long)]
    pub staged: bool,
    /// Low-latency receive layout. Rank-major times combine on the dispatched rows themselves
    /// (the same bytes as the experts' pre-reduced sums); --validate checks it on true sums.
    #[arg(long, value_enum, default_value = "expert-major")]
    pub layout: LayoutArg,
    /// Backend.
    #[arg(long, value_enum, default_value = "auto")]
    pub backend: BackendArg,
    /// Seed of the random routing and tokens.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Random (token, k) entries masked with -1 per rank, as ep_bench does.
    #[arg(long, default_value_t = 10)]
    pub masked: usize,
    /// GPU backend: declare this many "hosts" of consecutive ranks (NVLink inside each, NCCL
    /// between them), to run the cross-host path on one machine [default: 1].
    #[arg(long)]
    pub hosts: Option<usize>,
    /// GPU backend: the most SMs a communication kernel may use [default: all that help].
    #[arg(long)]
    pub max_sms: Option<usize>,
    /// GPU backend, one process: the GPU of each rank, comma-separated. A GPU named twice
    /// holds two ranks, which time-slice it (a functional check, and a way to measure set-up
    /// costs on one GPU); over NCCL that needs NCCL 2.30 or later with
    /// NCCL_MULTI_RANK_GPU_ENABLE=1 [default: 0, 1, ..., a rank per GPU].
    #[arg(long, value_delimiter = ',', num_args = 1..)]
    pub devices: Option<Vec<usize>>,
    /// Low-latency: make the group with rank masking (`GroupConfig::with_rank_masking`), so
    /// that a dead rank would be masked instead of poisoning the group. No rank is masked: the
    /// figures are what being able to costs (the fenced rows masking uses, and with NCCL peers
    /// a communicator per pair of ranks, whose set-up time and memory the report shows).
    #[arg(long)]
    pub rank_masking: bool,
    /// Operation timeout in milliseconds.
    #[arg(long, default_value_t = 10_000)]
    pub timeout_ms: u64,
    /// High-throughput: every iteration is one training step of a layer on a new routing: a new
    /// handle, the forward dispatch and combine, then the backward pair on the same handle. The
    /// handle time is reported beside dispatch and combine, and the whole step instead of D+C.
    /// Low-latency, with `--queued`: each queued pair runs on a new routing, its handle created
    /// in the stream's order ahead of the dispatch (a decode step's routing per layer; the queued
    /// dispatch's device time then includes reading the routing, or with
    /// `EPFLOW_LL_STREAM_HANDLE=kernel` the handle's kernel).
    #[arg(long)]
    pub fresh_routing: bool,
    /// Low-latency on GPUs: also capture dispatch + combine as one CUDA graph step and time its
    /// replays (device time, CUDA events around each replay) beside the eager operations.
    #[arg(long)]
    pub graph: bool,
    /// Low-latency on GPUs: also time dispatch and combine queued ahead of the device: each
    /// iteration enqueues the pair in stream order (one launch each) behind a 1 ms spin
    /// kernel, so the device never waits for the host's launches; device time from CUDA events
    /// between them (the kernels and the gaps between them: comparable to NCCL EP's CUPTI
    /// kernel column, not to the eager or host-observed times).
    #[arg(long)]
    pub queued: bool,
    /// Print one JSON object instead of the text report.
    #[arg(long)]
    pub json: bool,
}

/// `-n`: 1 to [`epflow_kernels::MAX_GPU_RANKS`] processes on this host.
fn parse_nprocs(s: &str) -> Result<usize, String> {
    let max = epflow_kernels::MAX_GPU_RANKS;
    match s.parse::<usize>() {
        Ok(0) => Err("-n must be at least 1".into()),
        Ok(n) if n <= max => Ok(n),
        _ => Err(format!(
            "-n is 1 to {max} processes per host (epflow_kernels::MAX_GPU_RANKS: the most ranks a GPU group may have)"
        )),
    }
}

/// `--nnodes`: 1 to [`epflow_core::config::MAX_RANKS`] hosts.
fn parse_nnodes(s: &str) -> Result<usize, String> {
    let max = epflow_core::config::MAX_RANKS;
    match s.parse::<usize>() {
        Ok(n) if (1..=max).contains(&n) => Ok(n),
        _ => Err(format!(
            "--nnodes is 1 to {max} hosts (epflow_core::config::MAX_RANKS: the most ranks a group may have)"
        )),
    }
}

//! Every `EPFLOW_*` environment variable of the libraries, in one typed place, read once per
//! process ([`Environment::get`]). No other library code reads the environment for an `EPFLOW_*`
//! name (a test of the `epflow` crate checks it).
//!
//! - [`Tuning`]: how the GPU backend runs (kernel forms, handle builders, the high-throughput
//!   layout). Settable per group with [`crate::GroupConfig::with_tuning`]; the environment is
//!   only the default, taken when a group is created ([`crate::GroupConfig::tuning`]).
//! - [`Diagnostics`]: what the libraries print or record for measuring; per process.
//! - [`Paths`]: where kernels are compiled from and cached; per process.
//! - [`Environment::nccl_id`] and [`Environment::abi_timeout_ms`]: set-up values.
//!
//! [`KNOBS`] lists every name with its default and meaning; `docs/tuning-and-diagnostics.md`
//! holds the same table for readers (a test keeps them together).

use std::path::PathBuf;
use std::sync::OnceLock;

/// Who builds routing handles of one algorithm.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum HandleBuilder {
    /// A kernel on the device (the default where the transport allows it).
    #[default]
    Device,
    /// The host (kept to compare, and as a fallback): `EPFLOW_LL_HANDLE=host`,
    /// `EPFLOW_HT_HANDLE=host`.
    Host,
}

/// Overrides of the high-throughput layout (`None`: the measured default). The GPU backend
/// clamps each to its range; every rank of a group must use the same values.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct HtTuning {
    /// `EPFLOW_HT_DEPTH`: ring slots per (channel, source), 16-1024.
    pub depth: Option<usize>,
    /// `EPFLOW_HT_BATCH`: rows a receiving block takes per batch, at most the depth.
    pub batch: Option<usize>,
    /// `EPFLOW_HT_DISPATCH_ITEMS_PER_FENCE`: rows a dispatch's sending warp writes per fence.
    pub dispatch_items_per_fence: Option<usize>,
    /// `EPFLOW_HT_COMBINE_ITEMS_PER_FENCE`: the same for combine.
    pub combine_items_per_fence: Option<usize>,
    /// `EPFLOW_HT_DISPATCH_WARPS`: sending warps per remote destination of a dispatch.
    pub dispatch_warps: Option<usize>,
    /// `EPFLOW_HT_COMBINE_WARPS`: sending warps per remote destination of a combine.
    pub combine_warps: Option<usize>,
    /// `EPFLOW_HT_DIRECT_MIN_ROWS`: the rows of a (source, channel) pair from which a dispatch
    /// writes them directly.
    pub direct_min_rows: Option<usize>,
    /// `EPFLOW_HT_DIRECT_HELPERS`: receiving blocks' warps per peer that help a direct dispatch.
    pub direct_helpers: Option<usize>,
    /// `EPFLOW_HT_BALANCED` (`0` / `1`): a direct dispatch's rows taken from a shared counter.
    pub balanced: Option<bool>,
    /// `EPFLOW_HT_COMBINE_RANKS`: the smallest rank bound of the combine kernel, 1-8.
    pub combine_ranks: Option<usize>,
}

/// How the GPU backend runs a group: the environment's values by default
/// ([`Environment::get`]), or a group's own ([`crate::GroupConfig::with_tuning`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Tuning {
    /// `EPFLOW_ONE_LAUNCH` (default on; `0` off): synchronous low-latency operations as one
    /// cooperative launch where the GPU fits it and no other rank shares the GPU.
    pub one_launch: bool,
    /// `EPFLOW_GRAPH_ONE_LAUNCH` (default on; `0` off): the same inside captured steps.
    pub graph_one_launch: bool,
    /// `EPFLOW_LL_HANDLE` (`host`): who builds awaited low-latency handles.
    pub ll_handle: HandleBuilder,
    /// `EPFLOW_LL_STREAM_HANDLE=kernel`: a low-latency handle created in a stream's order
    /// enqueues the handle kernel at creation (default: its dispatches read the routing).
    pub ll_stream_handle_kernel: bool,
    /// `EPFLOW_LL_TAG_TOKENS`: the most tokens for which a combine takes tagged rows (`None`:
    /// the backend's default; 0 turns them off).
    pub ll_tag_tokens: Option<usize>,
    /// `EPFLOW_LL_TAG_DISPATCH_TOKENS`: the same for dispatch messages.
    pub ll_tag_dispatch_tokens: Option<usize>,
    /// `EPFLOW_HT_HANDLE` (`host`): who builds high-throughput handles.
    pub ht_handle: HandleBuilder,
    /// `EPFLOW_HT_DIRECT` (default on; `0` off): direct dispatch in one-process groups.
    pub ht_direct: bool,
    /// `EPFLOW_HT_PULL` (default on; `0` off): the pull combine of direct groups.
    pub ht_pull: bool,
    /// The high-throughput layout's overrides.
    pub ht: HtTuning,
    /// `EPFLOW_NCCL_PAIR_CTAS`: the most CTAs (NCCL channels, `ncclConfig_t::maxCTAs`) of each
    /// communicator a rank-masking group makes per pair of NCCL peers (`None` or 0: NCCL's own
    /// choice).
    pub nccl_pair_ctas: Option<usize>,
}

impl Default for Tuning {
    /// The measured defaults (what an empty environment gives).
    fn default() -> Self {
        Tuning {
            one_launch: true,
            graph_one_launch: true,
            ll_handle: HandleBuilder::Device,
            ll_stream_handle_kernel: false,
            ll_tag_tokens: None,
            ll_tag_dispatch_tokens: None,
            ht_handle: HandleBuilder::Device,
            ht_direct: true,
            ht_pull: true,
            ht: HtTuning::default(),
            nccl_pair_ctas: None,
        }
    }
}

/// What the libraries print or record for measuring (per process).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Diagnostics {
    /// `EPFLOW_LL_TRACE=1`: every 64th low-latency operation prints phase times from the GPU.
    pub ll_trace: bool,
    /// `EPFLOW_HOST_STEPS=1`: host time of each step of sends, creations and completions.
    pub host_steps: bool,
    /// `EPFLOW_ABI_PROFILE=1`: `libnccl_ep.so`'s host time per dispatch and combine by phase.
    pub abi_profile: bool,
    /// `EPFLOW_ABI_STAMPS=<folder>`: with the profile on, every call's stamps, per rank.
    pub abi_stamps: Option<PathBuf>,
}

/// Where kernels come from and go (per process).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Paths {
    /// `EPFLOW_KERNEL_SOURCE_DIR`: kernel files that replace the built-in sources.
    pub kernel_source_dir: Option<PathBuf>,
    /// `EPFLOW_KERNEL_CACHE`: where compiled kernels are cached.
    pub kernel_cache: Option<PathBuf>,
    /// `EPFLOW_CUDA_INCLUDE`: where NVRTC finds `cuda_bf16.h` and `cuda_fp8.h`.
    pub cuda_include: Option<PathBuf>,
}

/// Every `EPFLOW_*` value of the process's environment (and the C API's `NCCL_EP_TIMEOUT_MS`, and
/// NCCL's `NCCL_MULTI_RANK_GPU_ENABLE`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Environment {
    /// The default [`Tuning`] of new groups.
    pub tuning: Tuning,
    /// The diagnostics.
    pub diagnostics: Diagnostics,
    /// The kernels' paths.
    pub paths: Paths,
    /// `EPFLOW_NCCL_ID`: the NCCL unique id `epflow launch` hands its processes (256 hex
    /// digits); checked where it is used.
    pub nccl_id: Option<String>,
    /// `EPFLOW_REJOIN=1`: `epflow launch --restarts` started this process again in place of its
    /// rank's failed one; it takes the rank's place in the running group (`GpuWorld::rejoin`).
    pub rejoin: bool,
    /// `EPFLOW_MEETING_PORT`: the TCP port of the rejoin meetings `epflow launch --restarts`
    /// gives every process (ignored unless a port number, 1-65535).
    pub meeting_port: Option<u16>,
    /// `NCCL_MULTI_RANK_GPU_ENABLE=1` (NCCL's own switch, 2.30 on): NCCL communicators may hold
    /// several ranks of one GPU, so groups over NCCL may place ranks on a shared GPU.
    pub nccl_multi_rank_gpu: bool,
    /// `NCCL_EP_TIMEOUT_MS`: the C API's operation timeout, over `config.timeout_ns` (NCCL EP's
    /// name; ignored unless a positive integer).
    pub abi_timeout_ms: Option<u64>,
    /// The knobs of [`KNOBS`] that are set, with their values as given (`epflow diag env`
    /// prints them).
    pub set: Vec<(&'static str, String)>,
}

/// One knob: its name, default and meaning (the table of `docs/tuning-and-diagnostics.md`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Knob {
    /// The environment variable.
    pub name: &'static str,
    /// Its default, in words.
    pub default: &'static str,
    /// What it does.
    pub meaning: &'static str,
}

const fn knob(name: &'static str, default: &'static str, meaning: &'static str) -> Knob {
    Knob { name, default, meaning }
}

/// Every environment variable [`Environment`] reads.
pub const KNOBS: &[Knob] = &[
    knob("EPFLOW_ONE_LAUNCH", "on; 0 off", "synchronous low-latency operations as one cooperative launch"),
    knob("EPFLOW_GRAPH_ONE_LAUNCH", "on; 0 off", "the same for synchronous operations inside a captured step"),
    knob("EPFLOW_LL_HANDLE", "device; host", "who builds awaited low-latency handles"),
    knob("EPFLOW_LL_STREAM_HANDLE", "dispatch; kernel", "a stream-ordered low-latency handle enqueues its kernel"),
    knob("EPFLOW_LL_TAG_TOKENS", "32; 0 off", "the most tokens for which a combine takes tagged rows"),
    knob("EPFLOW_LL_TAG_DISPATCH_TOKENS", "32; 0 off", "the same for dispatch messages"),
    knob("EPFLOW_HT_HANDLE", "device; host", "who builds high-throughput handles"),
    knob("EPFLOW_HT_DIRECT", "on; 0 off", "direct dispatch in one-process groups"),
    knob("EPFLOW_HT_PULL", "on; 0 off", "pull combine in direct groups"),
    knob("EPFLOW_HT_DEPTH", "64; 16-1024", "ring slots per (channel, source)"),
    knob("EPFLOW_HT_BATCH", "16", "rows a receiving block takes per batch"),
    knob("EPFLOW_HT_DISPATCH_ITEMS_PER_FENCE", "4", "rows a dispatch's sending warp writes per fence"),
    knob("EPFLOW_HT_COMBINE_ITEMS_PER_FENCE", "2", "rows a combine's sending warp writes per fence"),
    knob("EPFLOW_HT_DISPATCH_WARPS", "by rank count", "sending warps per remote destination of a dispatch"),
    knob("EPFLOW_HT_COMBINE_WARPS", "16 / R", "sending warps per remote destination of a combine"),
    knob("EPFLOW_HT_DIRECT_MIN_ROWS", "8", "rows of a (source, channel) pair from which a dispatch writes directly"),
    knob("EPFLOW_HT_DIRECT_HELPERS", "0", "receiving blocks' warps per peer that help a direct dispatch"),
    knob("EPFLOW_HT_BALANCED", "on up to 64 SMs; 0 / 1", "a direct dispatch's rows from a shared counter"),
    knob("EPFLOW_HT_COMBINE_RANKS", "1; 1-8", "the smallest rank bound of the combine kernel"),
    knob(
        "EPFLOW_NCCL_PAIR_CTAS",
        "NCCL's own; a number caps it",
        "the most CTAs of each NCCL pair communicator (rank masking)",
    ),
    knob("EPFLOW_LL_TRACE", "off; 1", "low-latency phase times printed from the GPU"),
    knob("EPFLOW_HOST_STEPS", "off; 1", "host time of each step of sends, creations and completions"),
    knob("EPFLOW_ABI_PROFILE", "off; 1", "libnccl_ep.so's host time per dispatch and combine"),
    knob("EPFLOW_ABI_STAMPS", "unset; a folder", "with the profile: every call's stamps, per rank"),
    knob("EPFLOW_KERNEL_SOURCE_DIR", "unset", "kernel files that replace the built-in sources"),
    knob("EPFLOW_KERNEL_CACHE", "~/.cache/epflow/kernels", "where compiled kernels are cached"),
    knob("EPFLOW_CUDA_INCLUDE", "$CUDA_HOME/include, ...", "where NVRTC finds the CUDA headers"),
    knob("EPFLOW_NCCL_ID", "unset; epflow launch sets it", "the NCCL unique id for one process per GPU"),
    knob("EPFLOW_REJOIN", "unset; epflow launch --restarts sets 1", "this process replaces its rank's failed one"),
    knob("EPFLOW_MEETING_PORT", "unset; epflow launch --restarts sets it", "the TCP port of the rejoin meetings"),
    knob("NCCL_EP_TIMEOUT_MS", "unset", "the C API's operation timeout, over config.timeout_ns"),
    knob("NCCL_MULTI_RANK_GPU_ENABLE", "unset; 1 (NCCL 2.30 on)", "groups over NCCL may put ranks on one GPU"),
];

impl Environment {
    /// The process's environment, read at the first call and kept (later changes to the
    /// environment are not seen).
    pub fn get() -> &'static Environment {
        static ENV: OnceLock<Environment> = OnceLock::new();
        ENV.get_or_init(|| Environment::from_vars(|k| std::env::var(k).ok()))
    }

    /// The values `get` gives for each name (e.g. `|k| std::env::var(k).ok()`). Unparsable
    /// numbers count as unset; switches are on unless `0` (or off unless `1`), as the table says.
    pub fn from_vars(get: impl Fn(&str) -> Option<String>) -> Environment {
        let var = |k: &str| get(k).map(|v| v.trim().to_string()).filter(|v| !v.is_empty());
        let on_unless_zero = |k: &str| var(k).is_none_or(|v| v != "0");
        let is = |k: &str, want: &str| var(k).is_some_and(|v| v == want);
        let num = |k: &str| var(k).and_then(|v| v.parse::<usize>().ok());
        let builder = |k: &str| if is(k, "host") { HandleBuilder::Host } else { HandleBuilder::Device };
        let path = |k: &str| var(k).map(PathBuf::from);
        let ht = HtTuning {
            depth: num("EPFLOW_HT_DEPTH"),
            batch: num("EPFLOW_HT_BATCH"),
            dispatch_items_per_fence: num("EPFLOW_HT_DISPATCH_ITEMS_PER_FENCE"),
            combine_items_per_fence: num("EPFLOW_HT_COMBINE_ITEMS_PER_FENCE"),
            dispatch_warps: num("EPFLOW_HT_DISPATCH_WARPS"),
            combine_warps: num("EPFLOW_HT_COMBINE_WARPS"),
            direct_min_rows: num("EPFLOW_HT_DIRECT_MIN_ROWS"),
            direct_helpers: num("EPFLOW_HT_DIRECT_HELPERS"),
            balanced: num("EPFLOW_HT_BALANCED").map(|v| v != 0),
            combine_ranks: num("EPFLOW_HT_COMBINE_RANKS"),
        };
        let abi_profile = is("EPFLOW_ABI_PROFILE", "1");
        Environment {
            tuning: Tuning {
                one_launch: on_unless_zero("EPFLOW_ONE_LAUNCH"),
                graph_one_launch: on_unless_zero("EPFLOW_GRAPH_ONE_LAUNCH"),
                ll_handle: builder("EPFLOW_LL_HANDLE"),
                ll_stream_handle_kernel: is("EPFLOW_LL_STREAM_HANDLE", "kernel"),
                ll_tag_tokens: num("EPFLOW_LL_TAG_TOKENS"),
                ll_tag_dispatch_tokens: num("EPFLOW_LL_TAG_DISPATCH_TOKENS"),
                ht_handle: builder("EPFLOW_HT_HANDLE"),
                ht_direct: on_unless_zero("EPFLOW_HT_DIRECT"),
                ht_pull: on_unless_zero("EPFLOW_HT_PULL"),
                ht,
                nccl_pair_ctas: num("EPFLOW_NCCL_PAIR_CTAS"),
            },
            diagnostics: Diagnostics {
                ll_trace: is("EPFLOW_LL_TRACE", "1"),
                host_steps: is("EPFLOW_HOST_STEPS", "1"),
                abi_profile,
                abi_stamps: path("EPFLOW_ABI_STAMPS").filter(|_| abi_profile),
            },
            paths: Paths {
                kernel_source_dir: path("EPFLOW_KERNEL_SOURCE_DIR"),
                kernel_cache: path("EPFLOW_KERNEL_CACHE"),
                cuda_include: path("EPFLOW_CUDA_INCLUDE"),
            },
            nccl_id: var("EPFLOW_NCCL_ID"),
            rejoin: is("EPFLOW_REJOIN", "1"),
            meeting_port: var("EPFLOW_MEETING_PORT").and_then(|v| v.parse::<u16>().ok()).filter(|&p| p > 0),
            set: KNOBS.iter().filter_map(|k| get(k.name).map(|v| (k.name, v))).collect(),
            nccl_multi_rank_gpu: is("NCCL_MULTI_RANK_GPU_ENABLE", "1"),
            abi_timeout_ms: var("NCCL_EP_TIMEOUT_MS").and_then(|v| v.parse::<u64>().ok()).filter(|&ms| ms > 0),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &[(&str, &str)]) -> Environment {
        let pairs: Vec<(String, String)> = pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        Environment::from_vars(|k| pairs.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone()))
    }

    #[test]
    fn an_empty_environment_gives_the_defaults() {
        let e = env(&[]);
        assert_eq!(e, Environment::default());
        assert_eq!(e.tuning, Tuning::default());
        assert!(e.tuning.one_launch && e.tuning.ht_direct && e.tuning.ht_pull);
    }

    #[test]
    fn every_knob_is_read() {
        let e = env(&[
            ("EPFLOW_ONE_LAUNCH", "0"),
            ("EPFLOW_GRAPH_ONE_LAUNCH", " 0 "),
            ("EPFLOW_LL_HANDLE", "host"),
            ("EPFLOW_LL_STREAM_HANDLE", "kernel"),
            ("EPFLOW_LL_TAG_TOKENS", "0"),
            ("EPFLOW_LL_TAG_DISPATCH_TOKENS", "16"),
            ("EPFLOW_HT_HANDLE", "host"),
            ("EPFLOW_HT_DIRECT", "0"),
            ("EPFLOW_HT_PULL", "0"),
            ("EPFLOW_HT_DEPTH", "128"),
            ("EPFLOW_HT_BATCH", "8"),
            ("EPFLOW_HT_DISPATCH_ITEMS_PER_FENCE", "2"),
            ("EPFLOW_HT_COMBINE_ITEMS_PER_FENCE", "3"),
            ("EPFLOW_HT_DISPATCH_WARPS", "5"),
            ("EPFLOW_HT_COMBINE_WARPS", "7"),
            ("EPFLOW_HT_DIRECT_MIN_ROWS", "9"),
            ("EPFLOW_HT_DIRECT_HELPERS", "4"),
            ("EPFLOW_HT_BALANCED", "1"),
            ("EPFLOW_HT_COMBINE_RANKS", "8"),
            ("EPFLOW_NCCL_PAIR_CTAS", "4"),
            ("EPFLOW_LL_TRACE", "1"),
            ("EPFLOW_HOST_STEPS", "1"),
            ("EPFLOW_ABI_PROFILE", "1"),
            ("EPFLOW_ABI_STAMPS", "/tmp/stamps"),
            ("EPFLOW_KERNEL_SOURCE_DIR", "/src"),
            ("EPFLOW_KERNEL_CACHE", "/cache"),
            ("EPFLOW_CUDA_INCLUDE", "/inc"),
            ("EPFLOW_NCCL_ID", "ab12"),
            ("EPFLOW_REJOIN", "1"),
            ("EPFLOW_MEETING_PORT", "29501"),
            ("NCCL_EP_TIMEOUT_MS", "250"),
            ("NCCL_MULTI_RANK_GPU_ENABLE", "1"),
        ]);
        let t = e.tuning;
        assert!(!t.one_launch && !t.graph_one_launch && !t.ht_direct && !t.ht_pull && t.ll_stream_handle_kernel);
        assert_eq!((t.ll_handle, t.ht_handle), (HandleBuilder::Host, HandleBuilder::Host));
        assert_eq!((t.ll_tag_tokens, t.ll_tag_dispatch_tokens), (Some(0), Some(16)));
        let want = HtTuning {
            depth: Some(128),
            batch: Some(8),
            dispatch_items_per_fence: Some(2),
            combine_items_per_fence: Some(3),
            dispatch_warps: Some(5),
            combine_warps: Some(7),
            direct_min_rows: Some(9),
            direct_helpers: Some(4),
            balanced: Some(true),
            combine_ranks: Some(8),
        };
        assert_eq!(t.ht, want);
        assert_eq!(t.nccl_pair_ctas, Some(4));
        let d = &e.diagnostics;
        assert!(d.ll_trace && d.host_steps && d.abi_profile);
        assert_eq!(d.abi_stamps, Some(PathBuf::from("/tmp/stamps")));
        assert_eq!(e.paths.kernel_source_dir, Some(PathBuf::from("/src")));
        assert_eq!(e.paths.kernel_cache, Some(PathBuf::from("/cache")));
        assert_eq!(e.paths.cuda_include, Some(PathBuf::from("/inc")));
        assert_eq!(e.nccl_id.as_deref(), Some("ab12"));
        assert!(e.rejoin);
        assert_eq!(e.meeting_port, Some(29501));
        assert_eq!(e.abi_timeout_ms, Some(250));
        assert!(e.nccl_multi_rank_gpu);
        assert_eq!(e.set.len(), KNOBS.len(), "every knob was set");
        assert!(e.set.contains(&("EPFLOW_HT_DEPTH", "128".to_string())));
        // Every name of the table changes something (the table and the reader agree).
        for k in KNOBS {
            let base: &[(&str, &str)] =
                if k.name == "EPFLOW_ABI_PROFILE" { &[] } else { &[("EPFLOW_ABI_PROFILE", "1")] };
            let read = ["0", "1", "7", "host", "kernel", "/x"]
                .iter()
                .any(|v| env(&[base, &[(k.name, *v)]].concat()) != env(base));
            assert!(read, "{} is not read", k.name);
        }
    }

    #[test]
    fn bad_values_count_as_unset() {
        let e = env(&[
            ("EPFLOW_HT_DEPTH", "deep"),
            ("EPFLOW_ONE_LAUNCH", "no"),
            ("NCCL_EP_TIMEOUT_MS", "0"),
            ("EPFLOW_ABI_STAMPS", "/tmp/x"),
            ("EPFLOW_KERNEL_CACHE", "  "),
        ]);
        assert_eq!(e.tuning.ht.depth, None);
        assert!(e.tuning.one_launch, "only 0 turns a default-on switch off");
        assert_eq!(e.abi_timeout_ms, None);
        assert_eq!(e.diagnostics.abi_stamps, None, "stamps need the profile on");
        assert_eq!(e.paths.kernel_cache, None);
    }
}

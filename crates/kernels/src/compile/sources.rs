//! The CUDA C sources, kept as `.cu` files in this crate and compiled at run time.

/// One NVRTC compilation unit and the kernels it defines.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KernelModule {
    /// Short name (also the cache file prefix).
    pub name: &'static str,
    /// The `.cu` file.
    pub body: &'static str,
    /// The `extern "C"` kernels it defines.
    pub kernels: &'static [&'static str],
}

/// Device helpers shared by every module (prepended to each).
pub const COMMON: &str = include_str!("../cuda/common.cuh");

/// Low-latency dispatch and combine.
pub const LL: KernelModule = KernelModule {
    name: "ll",
    body: include_str!("../cuda/ll.cu"),
    kernels: &[
        "ep_ll_dispatch_send",
        "ep_ll_dispatch_recv",
        "ep_ll_dispatch_kernel",
        "ep_ll_combine_send",
        "ep_ll_combine_recv",
        "ep_ll_combine_kernel",
        "ep_graph_rebase",
        "ep_mask_spread",
        "ep_mask_rejoin",
    ],
};

/// High-throughput dispatch and combine, the count exchange of handle creation, and the handle
/// built on the device (plan and receive layout).
pub const HT: KernelModule = KernelModule {
    name: "ht",
    body: include_str!("../cuda/ht.cu"),
    kernels: &[
        "ep_ht_dispatch_kernel",
        "ep_ht_combine_kernel",
        "ep_ht_combine_kernel_4ranks",
        "ep_ht_combine_kernel_2ranks",
        "ep_ht_exchange",
        "ep_ht_plan_mark",
        "ep_ht_plan",
    ],
};

/// The kernels around NCCL's grouped send/recv (the NCCL transport, `nccl.rs`).
pub const NCCL: KernelModule = KernelModule {
    name: "nccl",
    body: include_str!("../cuda/nccl.cu"),
    kernels: &["ep_nccl_ht_pack", "ep_nccl_arrivals", "ep_nccl_ht_reduce"],
};

/// Small utilities (FP8 dequantization; a spin kernel that holds a stream, for tests).
pub const UTIL: KernelModule =
    KernelModule { name: "util", body: include_str!("../cuda/util.cu"), kernels: &["ep_dequant_fp8_rows", "ep_spin"] };

/// Every module.
pub const ALL: &[KernelModule] = &[LL, HT, NCCL, UTIL];

impl KernelModule {
    /// The full source NVRTC compiles: the common helpers, then the module.
    pub fn source(&self) -> String {
        format!("{COMMON}\n{}", self.body)
    }
}

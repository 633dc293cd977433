//! The CUDA C sources, kept as `.cu` files in this crate and compiled at run time.

use std::path::{Path, PathBuf};

use epflow_core::Error;

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
        "ep_ll_dispatch_kernel_tagged",
        "ep_ll_combine_send",
        "ep_ll_combine_recv",
        "ep_ll_combine_recv_tagged",
        "ep_ll_combine_kernel",
        "ep_ll_combine_kernel_tagged",
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
pub const UTIL: KernelModule = KernelModule {
    name: "util",
    body: include_str!("../cuda/util.cu"),
    kernels: &["ep_dequant_fp8_rows", "ep_spin", "ep_sm_copy"],
};

/// Every module.
pub const ALL: &[KernelModule] = &[LL, HT, NCCL, UTIL];

impl KernelModule {
    /// The full source NVRTC compiles: the common helpers, then the module.
    pub fn source(&self) -> String {
        format!("{COMMON}\n{}", self.body)
    }

    /// The source as [`KernelModule::source`], with `dir/common.cuh` and `dir/<name>.cu`
    /// replacing the built-in files where they exist (`EPFLOW_KERNEL_SOURCE_DIR`, see
    /// [`source_override_dir`]). Errors name a file that exists but cannot be read.
    pub fn source_from(&self, dir: Option<&Path>) -> Result<String, Error> {
        let Some(dir) = dir else { return Ok(self.source()) };
        let read = |file: &str, builtin: &'static str| -> Result<String, Error> {
            let path = dir.join(file);
            if !path.exists() {
                return Ok(builtin.to_string());
            }
            std::fs::read_to_string(&path)
                .map_err(|e| Error::Unsupported(format!("EPFLOW_KERNEL_SOURCE_DIR: {}: {e}", path.display())))
        };
        Ok(format!("{}\n{}", read("common.cuh", COMMON)?, read(&format!("{}.cu", self.name), self.body)?))
    }
}

/// `EPFLOW_KERNEL_SOURCE_DIR`: a folder of `.cu` files (`ll.cu`, `ht.cu`, `nccl.cu`, `util.cu`,
/// `common.cuh`) that replace the built-in ones at run time, for kernel work without rebuilding
/// the library (each missing file keeps the built-in one). The kernels must keep their names and
/// parameter blocks. A development tool: unset in production.
pub fn source_override_dir() -> Option<PathBuf> {
    std::env::var_os("EPFLOW_KERNEL_SOURCE_DIR").filter(|v| !v.is_empty()).map(PathBuf::from)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_override_folder_replaces_only_the_files_it_holds() {
        let dir = std::env::temp_dir().join(format!("epflow-src-override-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("ll.cu"), "// replaced ll\n").unwrap();
        let ll = LL.source_from(Some(&dir)).unwrap();
        assert!(ll.starts_with(COMMON) && ll.ends_with("// replaced ll\n"), "ll keeps common.cuh, takes the file");
        assert_eq!(HT.source_from(Some(&dir)).unwrap(), HT.source(), "no ht.cu there: the built-in one");
        assert_eq!(LL.source_from(None).unwrap(), LL.source());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

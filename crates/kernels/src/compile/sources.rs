//! The CUDA C sources, kept as `.cu` files in this crate and compiled at run time.

use std::path::{Path, PathBuf};

use epflow_core::Error;

/// One NVRTC compilation unit and the kernels it defines.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KernelModule {
    /// Short name (also the cache file prefix).
    pub name: &'static str,
    /// Its files as (file name, text), compiled in this order after `common.cuh` as one unit:
    /// one `.cu` file, or (low-latency) `.cuh` parts before it.
    pub files: &'static [(&'static str, &'static str)],
    /// The `extern "C"` kernels it defines.
    pub kernels: &'static [&'static str],
}

/// Device helpers shared by every module (prepended to each).
pub const COMMON: &str = include_str!("../cuda/common.cuh");

/// Low-latency dispatch and combine, and low-latency handles built on the device.
pub const LL: KernelModule = KernelModule {
    name: "ll",
    files: &[
        ("ll_base.cuh", include_str!("../cuda/ll_base.cuh")),
        ("ll_tagged.cuh", include_str!("../cuda/ll_tagged.cuh")),
        ("ll_send.cuh", include_str!("../cuda/ll_send.cuh")),
        ("ll_receive.cuh", include_str!("../cuda/ll_receive.cuh")),
        ("ll_combine.cuh", include_str!("../cuda/ll_combine.cuh")),
        ("ll.cu", include_str!("../cuda/ll.cu")),
        ("ll_handle.cuh", include_str!("../cuda/ll_handle.cuh")),
    ],
    kernels: &[
        "ep_ll_dispatch_send",
        "ep_ll_dispatch_recv",
        "ep_ll_dispatch_kernel",
        "ep_ll_dispatch_kernel_tagged",
        "ep_ll_dispatch_send_fwd",
        "ep_ll_dispatch_recv_fwd",
        "ep_ll_dispatch_kernel_fwd",
        "ep_ll_dispatch_kernel_tagged_fwd",
        "ep_ll_combine_send",
        "ep_ll_combine_recv",
        "ep_ll_combine_recv_tagged",
        "ep_ll_combine_kernel",
        "ep_ll_combine_kernel_tagged",
        "ep_ll_combine_send_nvfp4",
        "ep_ll_combine_recv_nvfp4",
        "ep_ll_combine_kernel_nvfp4",
        "ep_graph_rebase",
        "ep_mask_spread",
        "ep_mask_rejoin",
        "ep_meet",
        "ep_ll_handle",
    ],
};

/// High-throughput dispatch and combine, the count exchange of handle creation, and the handle
/// built on the device (plan and receive layout).
pub const HT: KernelModule = KernelModule {
    name: "ht",
    files: &[
        ("ht_rings.cuh", include_str!("../cuda/ht_rings.cuh")),
        ("ht_send.cuh", include_str!("../cuda/ht_send.cuh")),
        ("ht_receive.cuh", include_str!("../cuda/ht_receive.cuh")),
        ("ht.cu", include_str!("../cuda/ht.cu")),
        ("ht_handle.cuh", include_str!("../cuda/ht_handle.cuh")),
    ],
    kernels: &[
        "ep_ht_dispatch_kernel",
        "ep_ht_combine_kernel",
        "ep_ht_combine_kernel_4ranks",
        "ep_ht_combine_kernel_2ranks",
        "ep_ht_exchange",
        "ep_ht_plan",
    ],
};

/// The kernels around NCCL's grouped send/recv (the NCCL transport, `nccl.rs`).
pub const NCCL: KernelModule = KernelModule {
    name: "nccl",
    files: &[("nccl.cu", include_str!("../cuda/nccl.cu"))],
    kernels: &["ep_nccl_ht_pack", "ep_nccl_arrivals", "ep_nccl_ht_reduce"],
};

/// Small utilities (FP8 dequantization; int32 to int64 widening; global expert ids; the
/// high-throughput expert-major layout's permutation; a spin kernel that holds a stream, for
/// tests; the copy probes).
pub const UTIL: KernelModule = KernelModule {
    name: "util",
    files: &[("util.cu", include_str!("../cuda/util.cu"))],
    kernels: &[
        "ep_dequant_fp8_rows",
        "ep_widen_i32",
        "ep_globalize_expert_ids",
        "ep_em_slots",
        "ep_em_scatter",
        "ep_em_pad",
        "ep_em_reduce",
        "ep_em_gather_weights",
        "ep_spin",
        "ep_sm_copy",
        "ep_sm_copy_balanced",
        "ep_tma_copy",
    ],
};

/// Every module.
pub const ALL: &[KernelModule] = &[LL, HT, NCCL, UTIL];

impl KernelModule {
    /// The module's own text: its files, in order.
    pub fn body(&self) -> String {
        self.files.iter().map(|(_, text)| *text).collect()
    }

    /// The full source NVRTC compiles: the common helpers, then the module's files.
    pub fn source(&self) -> String {
        format!("{COMMON}\n{}", self.body())
    }

    /// The source as [`KernelModule::source`], with `dir/common.cuh` and each of the module's
    /// files in `dir` replacing the built-in one where it exists (`EPFLOW_KERNEL_SOURCE_DIR`,
    /// see [`source_override_dir`]). Errors name a file that exists but cannot be read.
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
        let mut src = read("common.cuh", COMMON)?;
        src.push('\n');
        for (file, text) in self.files {
            src.push_str(&read(file, text)?);
        }
        Ok(src)
    }
}

/// `EPFLOW_KERNEL_SOURCE_DIR`: a folder of kernel files (`common.cuh`, the low-latency parts
/// `ll_base.cuh`, `ll_tagged.cuh`, `ll_send.cuh`, `ll_receive.cuh`, `ll_combine.cuh`, `ll.cu` and
/// `ll_handle.cuh`,
/// the high-throughput parts `ht_rings.cuh`, `ht_send.cuh`, `ht_receive.cuh`, `ht.cu` and
/// `ht_handle.cuh`, `nccl.cu`, `util.cu`) that replace the built-in ones at run time, for kernel
/// work without rebuilding the library (each missing file keeps the built-in one, so a part
/// replaced must still fit the parts around it; a whole unit in one `ll.cu` or `ht.cu` goes with
/// empty `.cuh` parts). The kernels must keep their names and parameter blocks. A development tool:
/// unset in production.
pub fn source_override_dir() -> Option<PathBuf> {
    epflow_core::tuning::Environment::get().paths.kernel_source_dir.clone()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The value of `#define name <value>` in `source`.
    fn define(source: &str, name: &str) -> usize {
        let prefix = format!("#define {name} ");
        let line = source.lines().find_map(|l| l.strip_prefix(&prefix)).unwrap_or_else(|| panic!("no {name}"));
        line.trim().parse().unwrap_or_else(|_| panic!("{name}: {line}"))
    }

    #[test]
    fn limits_match_the_cuda_defines() {
        use crate::params::*;
        assert_eq!(define(COMMON, "EP_MAX_RANKS"), MAX_RANKS);
        assert_eq!(define(COMMON, "EP_MAX_SETS"), MAX_SETS);
        assert_eq!(define(COMMON, "EP_COMPACT_MAX_ROWS"), LL_COMPACT_MAX_ROWS);
        assert_eq!(define(&LL.body(), "EP_TAG_TOKENS"), LL_TAG_TOKENS);
        assert_eq!(define(&HT.body(), "HT_MAX_CHANNELS"), HT_MAX_CHANNELS);
        assert_eq!(define(&HT.body(), "HT_MAX_WARPS"), HT_MAX_WARPS);
        assert_eq!(define(&HT.body(), "HT_DIRECT_SLOT"), HT_DIRECT_SLOT);
        assert_eq!(define(&UTIL.body(), "TMA_MAX_STAGES"), TMA_MAX_STAGES as usize);
    }

    #[test]
    fn an_override_folder_replaces_only_the_files_it_holds() {
        let dir = std::env::temp_dir().join(format!("epflow-src-override-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("ll.cu"), "// replaced ll\n").unwrap();
        std::fs::write(dir.join("ll_send.cuh"), "// replaced send\n").unwrap();
        let ll = LL.source_from(Some(&dir)).unwrap();
        assert!(ll.starts_with(COMMON) && ll.contains("// replaced ll\n"), "ll keeps common.cuh, takes the file");
        let handle = LL.files[6].1;
        assert!(ll.ends_with(&format!("// replaced ll\n{handle}")), "the part after ll.cu stays after it");
        let (base, tagged) = (LL.files[0].1, LL.files[1].1);
        assert!(ll.contains(&format!("{base}{tagged}// replaced send\n")), "the parts stay in order");
        assert!(!ll.contains(LL.files[2].1) && ll.contains(LL.files[3].1), "only the files present are replaced");
        assert_eq!(
            HT.source_from(Some(&dir)).unwrap(),
            HT.source(),
            "no high-throughput file there: the built-in ones"
        );
        assert_eq!(LL.source_from(None).unwrap(), LL.source());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

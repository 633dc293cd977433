//! `epflow compile`: compile every CUDA kernel with NVRTC (CI runs this without a GPU).

use std::process::ExitCode;

use epflow_kernels::compile::{nvrtc, sources};
use epflow_kernels::device_count;

use crate::cli::CompileArgs;

/// Compiles every module for `--arch` (default: the first GPU's, else sm_90), with the files of
/// `EPFLOW_KERNEL_SOURCE_DIR` replacing the built-in ones (as the library does at run time);
/// exit code 1 if one fails, 2 without NVRTC or the CUDA headers.
pub(crate) fn main(args: &CompileArgs) -> ExitCode {
    let arch = match &args.arch {
        Some(a) => a.clone(),
        None if device_count() > 0 => {
            match cudarc::driver::CudaContext::new(0)
                .map_err(|e| format!("{e:?}"))
                .and_then(|c| epflow_kernels::device_arch(&c).map_err(|e| e.to_string()))
            {
                Ok(a) => a,
                Err(e) => {
                    eprintln!("error: {e}");
                    return ExitCode::from(1);
                }
            }
        }
        None => "sm_90".into(),
    };
    if !nvrtc::nvrtc_present() {
        eprintln!("error: NVRTC (libnvrtc.so.13) not found: add its directory to LD_LIBRARY_PATH");
        return ExitCode::from(2);
    }
    let Some(include) = nvrtc::cuda_include_dir() else {
        eprintln!("error: CUDA headers not found: set EPFLOW_CUDA_INCLUDE or CUDA_HOME");
        return ExitCode::from(2);
    };
    let overrides = sources::source_override_dir();
    if let Some(dir) = &overrides {
        println!("kernel sources from {} where present (EPFLOW_KERNEL_SOURCE_DIR)", dir.display());
    }
    let mut failed = false;
    // epflow's modules, then the MoE layer's (epflow-moe).
    for m in sources::ALL.iter().chain([&epflow_moe::gpu::MOE]) {
        let t = std::time::Instant::now();
        let files = m.files.iter().map(|(f, _)| *f).collect::<Vec<_>>().join(" + ");
        let compiled = m
            .source_from(overrides.as_deref())
            .and_then(|src| nvrtc::compile_uncached(m.name, &src, &nvrtc::options(&arch, &include)));
        match compiled {
            Ok(cubin) => {
                println!(
                    "compiled {files} for {arch}: {} B CUBIN, kernels {:?} ({} ms)",
                    cubin.len(),
                    m.kernels,
                    t.elapsed().as_millis()
                );
                if let Some(dir) = &args.cubin_dir {
                    let path = dir.join(format!("{}-{arch}.cubin", m.name));
                    if let Err(e) = std::fs::create_dir_all(dir).and_then(|()| std::fs::write(&path, &cubin)) {
                        eprintln!("FAILED to write {}: {e}", path.display());
                        failed = true;
                    }
                }
            }
            Err(e) => {
                eprintln!("FAILED {files} for {arch}: {e}");
                failed = true;
            }
        }
    }
    if failed { ExitCode::from(1) } else { ExitCode::SUCCESS }
}

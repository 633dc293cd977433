//! Run-time compilation of the CUDA sources with NVRTC, cached on disk by source hash and
//! architecture.
//!
//! NVRTC 13 does not bundle the CUDA headers: the include directory is taken from
//! `EPFLOW_CUDA_INCLUDE`, then `$CUDA_HOME/include`, `$CUDA_PATH/include`, `/usr/local/cuda/include`.
//! The cache directory is `EPFLOW_KERNEL_CACHE`, else `$XDG_CACHE_HOME/epflow/kernels`, else
//! `~/.cache/epflow/kernels`; a cache that cannot be written is skipped, never an error.
//! `EPFLOW_KERNEL_SOURCE_DIR` replaces the built-in sources with a folder's
//! ([`super::sources::source_override_dir`]).

use std::ffi::{CStr, CString, c_char};
use std::path::PathBuf;

use epflow_core::Error;

use super::sources::KernelModule;

/// Whether the NVRTC library can be loaded on this machine.
pub fn nvrtc_present() -> bool {
    // SAFETY: only tries to open the shared library (and closes it); no NVRTC call is made.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

/// Where the CUDA headers (`cuda_bf16.h`, `cuda_fp8.h`) are.
pub fn cuda_include_dir() -> Option<PathBuf> {
    let candidates = [
        epflow_core::tuning::Environment::get().paths.cuda_include.clone(),
        std::env::var_os("CUDA_HOME").map(|p| PathBuf::from(p).join("include")),
        std::env::var_os("CUDA_PATH").map(|p| PathBuf::from(p).join("include")),
        Some(PathBuf::from("/usr/local/cuda/include")),
    ];
    candidates.into_iter().flatten().find(|p| p.join("cuda_fp8.h").exists())
}

fn cache_dir() -> Option<PathBuf> {
    if let Some(p) = &epflow_core::tuning::Environment::get().paths.kernel_cache {
        return Some(p.clone());
    }
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))?;
    Some(base.join("epflow").join("kernels"))
}

/// FNV-1a, 64 bits: a hash that is stable across Rust versions, for cache keys.
fn fnv1a(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for part in parts {
        for &b in *part {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
        h ^= 0xff;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// The NVRTC options for `arch` (e.g. `"sm_90"`).
pub fn options(arch: &str, include: &std::path::Path) -> Vec<String> {
    vec![format!("--gpu-architecture={arch}"), "-std=c++17".into(), format!("--include-path={}", include.display())]
}

fn nvrtc_error(what: &str, e: impl std::fmt::Debug) -> Error {
    Error::Backend(format!("NVRTC: {what}: {e:?}"))
}

/// Compiles `module` to a CUBIN for `arch`, from the disk cache when possible.
pub fn compile(module: &KernelModule, arch: &str) -> Result<Vec<u8>, Error> {
    if !nvrtc_present() {
        return Err(Error::Unsupported(
            "NVRTC (libnvrtc.so.13) is not installed; add the CUDA 13 lib directory to LD_LIBRARY_PATH".into(),
        ));
    }
    let include = cuda_include_dir().ok_or_else(|| {
        Error::Unsupported("CUDA headers not found: set EPFLOW_CUDA_INCLUDE or CUDA_HOME (cuda_fp8.h is needed)".into())
    })?;
    let overrides = super::sources::source_override_dir();
    if let Some(dir) = &overrides {
        tracing::warn!(dir = %dir.display(), module = module.name, "EPFLOW_KERNEL_SOURCE_DIR: kernel sources from a folder");
    }
    let src = module.source_from(overrides.as_deref())?;
    let opts = options(arch, &include);
    let key = fnv1a(&[src.as_bytes(), opts.join(" ").as_bytes(), nvrtc_version().as_bytes()]);
    let path = cache_dir().map(|d| d.join(format!("{}-{arch}-{key:016x}.cubin", module.name)));
    if let Some(bytes) = path.as_ref().and_then(|p| std::fs::read(p).ok()) {
        return Ok(bytes);
    }
    let cubin = compile_uncached(module.name, &src, &opts)?;
    if let Some(p) = &path {
        if let Some(dir) = p.parent() {
            let _ = std::fs::create_dir_all(dir);
        }
        let tmp = p.with_extension(format!("tmp{}", std::process::id()));
        if std::fs::write(&tmp, &cubin).is_ok() {
            let _ = std::fs::rename(&tmp, p);
        }
    }
    Ok(cubin)
}

fn nvrtc_version() -> String {
    let (mut major, mut minor) = (0i32, 0i32);
    // SAFETY: valid out pointers; the library is present (checked by the caller).
    match unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) }.result() {
        Ok(()) => format!("{major}.{minor}"),
        Err(_) => String::new(),
    }
}

/// Compiles without the cache; the error carries NVRTC's log.
pub fn compile_uncached(name: &str, src: &str, opts: &[String]) -> Result<Vec<u8>, Error> {
    use cudarc::nvrtc::{result as nr, sys as ns};
    let csrc = CString::new(src).map_err(|e| nvrtc_error("source", e))?;
    let cname = CString::new(format!("{name}.cu")).map_err(|e| nvrtc_error("name", e))?;
    let prog = nr::create_program(&csrc, Some(cname.as_c_str())).map_err(|e| nvrtc_error("create program", e))?;
    // SAFETY: `prog` is a live program created above; the options are valid C strings.
    let compiled = unsafe { nr::compile_program(prog, opts) };
    if let Err(e) = compiled {
        // SAFETY: `prog` is live; the log buffer NVRTC returns is NUL-terminated.
        let log = unsafe { nr::get_program_log(prog) }.unwrap_or_default();
        let log = if log.is_empty() {
            String::new()
        } else {
            // SAFETY: `log` comes from NVRTC and ends with NUL (empty vectors are handled above).
            unsafe { CStr::from_ptr(log.as_ptr()) }.to_string_lossy().into_owned()
        };
        // SAFETY: destroys the program created above, once.
        let _ = unsafe { nr::destroy_program(prog) };
        return Err(Error::Backend(format!("NVRTC failed to compile {name}.cu ({e:?}):\n{log}")));
    }
    let mut size = 0usize;
    // SAFETY: `prog` compiled successfully; `size` is a valid out pointer.
    unsafe { ns::nvrtcGetCUBINSize(prog, &mut size) }.result().map_err(|e| nvrtc_error("CUBIN size", e))?;
    let mut buf = vec![0u8; size];
    // SAFETY: `buf` holds exactly the `size` bytes NVRTC asked for.
    unsafe { ns::nvrtcGetCUBIN(prog, buf.as_mut_ptr() as *mut c_char) }
        .result()
        .map_err(|e| nvrtc_error("CUBIN", e))?;
    // SAFETY: destroys the program created above, once.
    let _ = unsafe { nr::destroy_program(prog) };
    if buf.is_empty() {
        return Err(Error::Backend(format!(
            "NVRTC produced no CUBIN for {name}.cu (is the architecture a real sm_XX?)"
        )));
    }
    Ok(buf)
}

//! [`NcclEp`]: `libnccl_ep.so` opened at run time, every entry point of `nccl_ep.h` resolved,
//! the version checked.

use std::ffi::{OsStr, OsString, c_char, c_int};

use crate::types::*;

/// What this crate binds: NCCL EP 0.1, as shipped with the NCCL 2.30 series.
pub const SUPPORTED: &str = "NCCL EP 0.1 (NCCL 2.30 series)";

/// The symbol epflow's own `libnccl_ep.so` (the NCCL EP C API on epflow's kernels) exports
/// besides NCCL EP's functions: an `int` holding NCCL EP's version code. [`NcclEp::load`]
/// refuses a library that has it, so epflow's NCCL EP backend never runs on epflow itself.
pub const EPFLOW_MARKER: &str = "epflowNcclEpAbiVersion";

/// File names tried when `NCCL_EP_LIB` is not set (through the dynamic loader's search path).
const DEFAULT_NAMES: &[&str] = &["libnccl_ep.so", "libnccl_ep.so.0"];

/// Why the library could not be used.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// No library under the default names.
    #[error(
        "NCCL EP library not found (tried {tried}): {reason}. Build it from NVIDIA/nccl contrib/nccl_ep and set \
         NCCL_EP_LIB to the path of libnccl_ep.so, or add its directory to LD_LIBRARY_PATH"
    )]
    NotFound {
        /// The names tried.
        tried: String,
        /// The loader's message for the last one.
        reason: String,
    },
    /// An explicit path (`NCCL_EP_LIB` or [`NcclEp::load_from`]) could not be opened.
    #[error("{source_name}={path}: cannot load it: {reason}")]
    Open {
        /// Where the path came from (`NCCL_EP_LIB`, or `path`).
        source_name: &'static str,
        /// The path.
        path: String,
        /// The loader's message.
        reason: String,
    },
    /// The library lacks an entry point of the supported API.
    #[error("{path} is not an {SUPPORTED} library: it has no `{symbol}`")]
    MissingSymbol {
        /// The library.
        path: String,
        /// The missing function.
        symbol: &'static str,
    },
    /// The library is epflow's own NCCL EP C API (it exports [`EPFLOW_MARKER`]): benchmarking
    /// it as NVIDIA's would compare epflow with itself.
    #[error(
        "{path} is epflow's own libnccl_ep.so (it exports `{EPFLOW_MARKER}`), not NVIDIA's NCCL EP: put NVIDIA's \
         build first on the library path, or set NCCL_EP_LIB to its libnccl_ep.so"
    )]
    IsEpflow {
        /// The library.
        path: String,
    },
    /// The library is another version.
    #[error("{path}: {found}; epflow's NCCL EP backend supports {SUPPORTED}")]
    UnsupportedVersion {
        /// The library.
        path: String,
        /// What was found.
        found: String,
    },
}

/// `ncclEpCreateGroup` (collective over the communicator).
pub type CreateGroupFn = unsafe extern "C" fn(*mut NcclEpGroup, NcclComm, *const NcclEpGroupConfig) -> NcclResult;
/// `ncclEpGroupDestroy`.
pub type GroupDestroyFn = unsafe extern "C" fn(NcclEpGroup) -> NcclResult;
/// `ncclEpCreateHandle` (may be collective: every rank, same order).
pub type CreateHandleFn = unsafe extern "C" fn(
    *mut NcclEpHandle,
    NcclEpGroup,
    NcclEpLayout,
    *const NcclEpTensor,
    *const NcclEpLayoutInfo,
    *const NcclEpHandleConfig,
    CudaStream,
) -> NcclResult;
/// `ncclEpInitHandle`: a handle's memory without a routing (not collective).
pub type InitHandleFn = unsafe extern "C" fn(
    *mut NcclEpHandle,
    NcclEpGroup,
    NcclEpLayout,
    *const NcclEpHandleConfig,
    c_int,
    *const NcclEpTensor,
) -> NcclResult;
/// `ncclEpUpdateHandle`: a new routing for a handle (may be collective: every rank, same order).
pub type UpdateHandleFn =
    unsafe extern "C" fn(NcclEpHandle, *const NcclEpTensor, *const NcclEpLayoutInfo, CudaStream) -> NcclResult;
/// `ncclEpHandleDestroy`.
pub type HandleDestroyFn = unsafe extern "C" fn(NcclEpHandle) -> NcclResult;
/// `ncclEpDispatch` (collective).
pub type DispatchFn = unsafe extern "C" fn(
    NcclEpHandle,
    *const NcclEpDispatchInputs,
    *const NcclEpDispatchOutputs,
    *const NcclEpLayoutInfo,
    *const NcclEpDispatchConfig,
    CudaStream,
) -> NcclResult;
/// `ncclEpCombine` (collective).
pub type CombineFn = unsafe extern "C" fn(
    NcclEpHandle,
    *const NcclEpCombineInputs,
    *const NcclEpCombineOutputs,
    *const NcclEpCombineConfig,
    CudaStream,
) -> NcclResult;
/// `ncclEpComplete`: finishes a staged (`send_only`) low-latency dispatch or combine.
pub type CompleteFn = unsafe extern "C" fn(NcclEpHandle, *const NcclEpCompleteConfig, CudaStream) -> NcclResult;
/// `ncclGetVersion` / `ncclEpGetVersion`: `MAJOR * 10000 + MINOR * 100 + PATCH`.
pub type GetVersionFn = unsafe extern "C" fn(*mut c_int) -> NcclResult;
/// `ncclGetErrorString`.
pub type GetErrorStringFn = unsafe extern "C" fn(NcclResult) -> *const c_char;

/// The loaded library. The function pointers stay valid while this value lives; calling them is
/// `unsafe`, with the contracts of `nccl_ep.h` (every call collective where the header says so).
pub struct NcclEp {
    /// `ncclEpCreateGroup`.
    pub create_group: CreateGroupFn,
    /// `ncclEpGroupDestroy`.
    pub group_destroy: GroupDestroyFn,
    /// `ncclEpCreateHandle`.
    pub create_handle: CreateHandleFn,
    /// `ncclEpInitHandle`, where the library has it.
    pub init_handle: Option<InitHandleFn>,
    /// `ncclEpUpdateHandle`, where the library has it.
    pub update_handle: Option<UpdateHandleFn>,
    /// `ncclEpHandleDestroy`.
    pub handle_destroy: HandleDestroyFn,
    /// `ncclEpDispatch`.
    pub dispatch: DispatchFn,
    /// `ncclEpCombine`.
    pub combine: CombineFn,
    /// `ncclEpComplete`.
    pub complete: CompleteFn,
    /// `ncclGetErrorString` of the NCCL it runs on, when found.
    pub get_error_string: Option<GetErrorStringFn>,
    path: String,
    version: String,
    _lib: libloading::Library,
    _nccl: Option<libloading::Library>,
}

impl std::fmt::Debug for NcclEp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclEp").field("path", &self.path).field("version", &self.version).finish()
    }
}

fn open(name: &OsStr) -> Result<libloading::Library, String> {
    // SAFETY: loading a shared library runs its initializers; NCCL's and NCCL EP's only set up
    // their own state.
    unsafe { libloading::Library::new(name) }.map_err(|e| e.to_string())
}

/// NCCL itself, loaded globally first (as NCCL EP's own Python wrapper does) so libnccl_ep finds
/// NCCL's symbols even when it was not linked against it; absent is fine.
fn preload_nccl() -> Option<libloading::Library> {
    #[cfg(unix)]
    {
        use libloading::os::unix::{Library, RTLD_GLOBAL, RTLD_NOW};
        for name in ["libnccl.so.2", "libnccl.so"] {
            // SAFETY: as in `open`.
            if let Ok(l) = unsafe { Library::open(Some(name), RTLD_NOW | RTLD_GLOBAL) } {
                return Some(l.into());
            }
        }
    }
    None
}

/// `MAJOR.MINOR.PATCH` of a version code.
fn split(code: c_int) -> (c_int, c_int, c_int) {
    (code / 10000, code % 10000 / 100, code % 100)
}

fn symbol<T: Copy>(lib: &libloading::Library, name: &'static str, path: &str) -> Result<T, LoadError> {
    // SAFETY: `T` is the function pointer type `nccl_ep.h` declares for `name`.
    unsafe { lib.get::<T>(name) }
        .map(|s| *s)
        .map_err(|_| LoadError::MissingSymbol { path: path.to_string(), symbol: name })
}

fn optional<T: Copy>(libs: &[Option<&libloading::Library>], name: &str) -> Option<T> {
    // SAFETY: `T` is the function pointer type of `name` in NCCL's or NCCL EP's headers.
    libs.iter().flatten().find_map(|l| unsafe { l.get::<T>(name) }.ok().map(|s| *s))
}

impl NcclEp {
    /// Loads the library from `NCCL_EP_LIB` if set, else `libnccl_ep.so` from the library path.
    pub fn load() -> Result<Self, LoadError> {
        Self::load_with(std::env::var_os("NCCL_EP_LIB"))
    }

    /// [`NcclEp::load`] with the value of `NCCL_EP_LIB` given (`None`: not set).
    pub fn load_with(nccl_ep_lib: Option<OsString>) -> Result<Self, LoadError> {
        let nccl = preload_nccl();
        if let Some(p) = nccl_ep_lib {
            let lib = open(&p).map_err(|reason| LoadError::Open {
                source_name: "NCCL_EP_LIB",
                path: p.to_string_lossy().into(),
                reason,
            })?;
            return Self::from_library(lib, p.to_string_lossy().into(), nccl);
        }
        let mut reason = String::new();
        for name in DEFAULT_NAMES {
            match open(OsStr::new(name)) {
                Ok(lib) => return Self::from_library(lib, (*name).into(), nccl),
                Err(e) => reason = e,
            }
        }
        Err(LoadError::NotFound { tried: DEFAULT_NAMES.join(", "), reason })
    }

    /// Loads the library at `path`.
    pub fn load_from(path: impl AsRef<OsStr>) -> Result<Self, LoadError> {
        let p = path.as_ref();
        let lib = open(p).map_err(|reason| LoadError::Open {
            source_name: "path",
            path: p.to_string_lossy().into(),
            reason,
        })?;
        Self::from_library(lib, p.to_string_lossy().into(), preload_nccl())
    }

    fn from_library(
        lib: libloading::Library,
        path: String,
        nccl: Option<libloading::Library>,
    ) -> Result<Self, LoadError> {
        if optional::<*const c_int>(&[Some(&lib)], EPFLOW_MARKER).is_some() {
            return Err(LoadError::IsEpflow { path });
        }
        let version = check_version(&lib, nccl.as_ref(), &path)?;
        Ok(NcclEp {
            create_group: symbol(&lib, "ncclEpCreateGroup", &path)?,
            group_destroy: symbol(&lib, "ncclEpGroupDestroy", &path)?,
            create_handle: symbol(&lib, "ncclEpCreateHandle", &path)?,
            init_handle: optional(&[Some(&lib)], "ncclEpInitHandle"),
            update_handle: optional(&[Some(&lib)], "ncclEpUpdateHandle"),
            handle_destroy: symbol(&lib, "ncclEpHandleDestroy", &path)?,
            dispatch: symbol(&lib, "ncclEpDispatch", &path)?,
            combine: symbol(&lib, "ncclEpCombine", &path)?,
            complete: symbol(&lib, "ncclEpComplete", &path)?,
            get_error_string: optional(&[Some(&lib), nccl.as_ref()], "ncclGetErrorString"),
            path,
            version,
            _lib: lib,
            _nccl: nccl,
        })
    }

    /// Where the library was loaded from.
    pub fn path(&self) -> &str {
        &self.path
    }

    /// The version found, e.g. `"NCCL EP 0.1.0"` or `"NCCL 2.30.7 (NCCL EP 0.1)"`.
    pub fn version(&self) -> &str {
        &self.version
    }

    /// NCCL's message for `code`, or the number.
    pub fn error_string(&self, code: NcclResult) -> String {
        match self.get_error_string {
            Some(f) => {
                // SAFETY: ncclGetErrorString returns a static NUL-terminated string for any code.
                let p = unsafe { f(code) };
                if p.is_null() {
                    format!("NCCL error {code}")
                } else {
                    // SAFETY: non-null, NUL-terminated, static (see above).
                    unsafe { std::ffi::CStr::from_ptr(p) }.to_string_lossy().into_owned()
                }
            }
            None => format!("NCCL error {code}"),
        }
    }
}

/// NCCL EP versions with `ncclEpGetVersion` must be 0.1.x; NCCL EP 0.1 builds without it are
/// judged by the NCCL they run on, which must be 2.30.x.
fn check_version(
    lib: &libloading::Library,
    nccl: Option<&libloading::Library>,
    path: &str,
) -> Result<String, LoadError> {
    let unsupported = |found: String| LoadError::UnsupportedVersion { path: path.to_string(), found };
    let call = |f: GetVersionFn| {
        let mut code: c_int = 0;
        // SAFETY: both functions write one int through the pointer.
        let r = unsafe { f(&mut code) };
        (r == NCCL_SUCCESS).then_some(code)
    };
    if let Some(f) = optional::<GetVersionFn>(&[Some(lib)], "ncclEpGetVersion") {
        let code = call(f).ok_or_else(|| unsupported("ncclEpGetVersion failed".into()))?;
        let (ma, mi, pa) = split(code);
        if (ma, mi) != (0, 1) {
            return Err(unsupported(format!("NCCL EP {ma}.{mi}.{pa}")));
        }
        return Ok(format!("NCCL EP {ma}.{mi}.{pa}"));
    }
    let f = optional::<GetVersionFn>(&[Some(lib), nccl], "ncclGetVersion").ok_or_else(|| {
        unsupported("neither ncclEpGetVersion nor ncclGetVersion found: cannot tell the version".into())
    })?;
    let code = call(f).ok_or_else(|| unsupported("ncclGetVersion failed".into()))?;
    let (ma, mi, pa) = split(code);
    if (ma, mi) != (2, 30) {
        return Err(unsupported(format!("NCCL {ma}.{mi}.{pa} (NCCL EP 0.1 ships with NCCL 2.30)")));
    }
    Ok(format!("NCCL {ma}.{mi}.{pa} (NCCL EP 0.1)"))
}

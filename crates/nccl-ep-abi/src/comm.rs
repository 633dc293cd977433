//! The caller's `ncclComm_t` as epflow's [`Bootstrap`]: who this rank is, its device, and an
//! all-gather of bytes, through the NCCL the application itself loaded.
//!
//! The communicator belongs to one copy of libnccl; handing it to another copy would crash. So
//! NCCL's functions are looked up first among the symbols the process already has (an
//! application linked with `-lnccl`), then in an already loaded `libnccl.so.2`
//! (`RTLD_NOLOAD`: a Python binding's private copy), and only then by loading `libnccl.so.2`.

use std::ffi::{c_int, c_void};
use std::sync::Arc;

use cudarc::driver::CudaContext;
use epflow_core::Error;
use epflow_kernels::setup::bootstrap::Bootstrap;
use nccl_ep_sys as ep;

type CountFn = unsafe extern "C" fn(ep::NcclComm, *mut c_int) -> ep::NcclResult;
type AllGatherFn = unsafe extern "C" fn(
    *const c_void,
    *mut c_void,
    usize,
    ep::NcclDataType,
    ep::NcclComm,
    ep::CudaStream,
) -> ep::NcclResult;

type WinUserPtrFn = unsafe extern "C" fn(ep::NcclComm, ep::NcclWindow, *mut *mut c_void) -> ep::NcclResult;

/// The NCCL functions a group's bootstrap calls, and `ncclWinGetUserPtr` (NCCL 2.28 and later)
/// for window tensors.
struct Nccl {
    count: CountFn,
    user_rank: CountFn,
    cu_device: CountFn,
    all_gather: AllGatherFn,
    win_user_ptr: Option<WinUserPtrFn>,
    _lib: libloading::Library,
}

fn resolve(lib: libloading::Library) -> Option<Nccl> {
    // SAFETY: the types are those of nccl.h (ncclCommCount, ncclCommUserRank, ncclCommCuDevice:
    // `ncclResult_t f(const ncclComm_t, int*)`; ncclAllGather).
    unsafe {
        Some(Nccl {
            count: *lib.get::<CountFn>(b"ncclCommCount\0").ok()?,
            user_rank: *lib.get::<CountFn>(b"ncclCommUserRank\0").ok()?,
            cu_device: *lib.get::<CountFn>(b"ncclCommCuDevice\0").ok()?,
            all_gather: *lib.get::<AllGatherFn>(b"ncclAllGather\0").ok()?,
            // `ncclResult_t ncclWinGetUserPtr(ncclComm_t, ncclWindow_t, void**)`.
            win_user_ptr: lib.get::<WinUserPtrFn>(b"ncclWinGetUserPtr\0").ok().map(|f| *f),
            _lib: lib,
        })
    }
}

fn load() -> Result<Nccl, Error> {
    use libloading::os::unix::{Library, RTLD_LOCAL, RTLD_NOW};
    const RTLD_NOLOAD: c_int = 0x4;
    if let Some(n) = resolve(Library::this().into()) {
        return Ok(n);
    }
    for name in ["libnccl.so.2", "libnccl.so"] {
        // SAFETY: RTLD_NOLOAD only returns a library that is already loaded (no initializer runs).
        if let Ok(l) = unsafe { Library::open(Some(name), RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD) } {
            if let Some(n) = resolve(l.into()) {
                return Ok(n);
            }
        }
    }
    for name in ["libnccl.so.2", "libnccl.so"] {
        // SAFETY: loading NCCL runs its initializers, which set up its own state only.
        if let Ok(l) = unsafe { libloading::Library::new(name) } {
            if let Some(n) = resolve(l) {
                return Ok(n);
            }
        }
    }
    Err(Error::Unsupported("NCCL (libnccl.so.2) is not loaded in this process and cannot be found".into()))
}

/// The caller's communicator: the rank, size and device it reports, and all-gathers over it
/// on a stream of this library's own.
pub(crate) struct CallerComm {
    nccl: Nccl,
    comm: ep::NcclComm,
    rank: usize,
    size: usize,
    ctx: Arc<CudaContext>,
}

impl std::fmt::Debug for CallerComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CallerComm").field("rank", &self.rank).field("size", &self.size).finish()
    }
}

fn nccl_call(what: &str, rc: ep::NcclResult) -> Result<(), Error> {
    if rc == ep::NCCL_SUCCESS {
        Ok(())
    } else {
        Err(Error::Backend(format!("NCCL: {what} returned {rc} ({})", crate::status::code_name(rc))))
    }
}

impl CallerComm {
    /// Reads rank, size and device of `comm` (the caller's live communicator).
    pub(crate) fn new(comm: ep::NcclComm) -> Result<Self, Error> {
        let nccl = load()?;
        let (mut rank, mut size, mut dev) = (0, 0, 0);
        // SAFETY: `comm` is the caller's live communicator (the API's contract); out pointers are
        // valid.
        unsafe {
            nccl_call("ncclCommUserRank", (nccl.user_rank)(comm, &mut rank))?;
            nccl_call("ncclCommCount", (nccl.count)(comm, &mut size))?;
            nccl_call("ncclCommCuDevice", (nccl.cu_device)(comm, &mut dev))?;
        }
        let ctx = epflow_kernels::device::context(dev.max(0) as usize)?;
        Ok(CallerComm { nccl, comm, rank: rank.max(0) as usize, size: size.max(0) as usize, ctx })
    }

    /// The device address of window `win`'s local buffer (`ncclWinGetUserPtr`).
    pub(crate) fn window_base(&self, win: ep::NcclWindow) -> crate::status::Res<u64> {
        use crate::status::Fail;
        let f = self.nccl.win_user_ptr.ok_or_else(|| {
            Fail::usage(
                "an NCCL window tensor needs ncclWinGetUserPtr (NCCL 2.28 or later); this process's NCCL has none",
            )
        })?;
        let mut base = std::ptr::null_mut();
        // SAFETY: `comm` is the caller's live communicator and `win` the caller's window handle
        // (nccl_ep.h's contract for `win_hdl`); `base` is writable.
        let rc = unsafe { f(self.comm, win, &mut base) };
        if rc != ep::NCCL_SUCCESS {
            return Err(Fail {
                code: rc,
                message: format!("ncclWinGetUserPtr returned {rc} for the tensor's win_hdl"),
            });
        }
        Ok(base as u64)
    }
}

impl Bootstrap for CallerComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.size
    }

    fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    fn all_gather_bytes(&self, mine: &[u8]) -> Result<Vec<u8>, Error> {
        let cuda = |what: &str, e: cudarc::driver::DriverError| Error::Backend(format!("CUDA: {what}: {e:?}"));
        self.ctx.bind_to_thread().map_err(|e| cuda("bind context", e))?;
        let stream = self.ctx.new_stream().map_err(|e| cuda("create stream", e))?;
        let send = stream.clone_htod(mine).map_err(|e| cuda("gather buffer", e))?;
        let mut recv = stream.alloc_zeros::<u8>(mine.len() * self.size).map_err(|e| cuda("gather buffer", e))?;
        {
            use cudarc::driver::{DevicePtr, DevicePtrMut};
            let (s, _sg) = send.device_ptr(&stream);
            let (r, _rg) = recv.device_ptr_mut(&stream);
            // SAFETY: `s` holds `mine.len()` bytes and `r` `size` times that, both on this
            // device; ncclUint8 = 1; ordered on `stream`, which is synchronized below.
            let rc = unsafe {
                (self.nccl.all_gather)(
                    s as *const c_void,
                    r as *mut c_void,
                    mine.len(),
                    ep::NCCL_UINT8,
                    self.comm,
                    stream.cu_stream() as ep::CudaStream,
                )
            };
            nccl_call("ncclAllGather", rc)?;
        }
        stream.clone_dtoh(&recv).map_err(|e| cuda("gather", e))
    }
}

// SAFETY: the communicator is only used from the thread that calls the API (NCCL's rule for
// a communicator: one thread at a time), which the group's mutex enforces.
unsafe impl Send for CallerComm {}
// SAFETY: as above: every use goes through the group's mutex.
unsafe impl Sync for CallerComm {}

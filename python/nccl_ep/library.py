"""Loading ``libnccl_ep.so`` and :class:`NCCLLibrary`, whose methods are NCCL EP's 18 C functions.

Where the library comes from, first match wins:

1. ``EPFLOW_LIB``: the path of a ``libnccl_ep.so`` (epflow's, e.g.
   ``target/release/libnccl_ep.so``), or of a directory holding one. When it is set and does not
   load, nothing else is tried: the variable names the library the caller wants.
2. ``$NCCL_HOME/lib/libnccl_ep.so`` (as NVIDIA's binding).
3. ``libnccl_ep.so`` / ``libnccl_ep.so.0`` by name: the dynamic loader's search
   (``LD_LIBRARY_PATH``, the ``ldconfig`` cache).

Before it, NCCL itself (``libnccl.so.2``) is loaded with ``RTLD_GLOBAL`` when it can be found, so
that the communicator the caller makes with it and the one the EP library uses are the same copy
of NCCL (NVIDIA's EP library links against NCCL's symbols; epflow's looks them up in the
process). NCCL comes from ``EPFLOW_NCCL_LIB`` (a path), the EP library's own directory,
``$NCCL_HOME/lib``, the loader's search, or the ``nvidia-nccl`` wheel that PyTorch installs. Not
finding it is not an error: epflow's library loads NCCL itself when a group is created.

Error convention: every :class:`NCCLLibrary` method raises :class:`NcclEpError` (carrying the
``ncclResult_t`` code and its name) when the C function returns anything but ``ncclSuccess``,
and returns the function's output parameters. ``NCCLLibrary.raw`` holds the bare ctypes
functions (``argtypes``/``restype`` set), which return the code as an int and take every
argument, NULL pointers included.
"""

import ctypes
import ctypes.util
import os
import types
import warnings
from dataclasses import dataclass
from typing import Any, List, Optional

from .constants import ncclResult_t, result_name
from .structs import (
    _TensorPtr,
    cudaStream_t,
    ncclComm_t,
    ncclEpCombineConfig_t,
    ncclEpCombineInputs_t,
    ncclEpCombineOutputs_t,
    ncclEpCompleteConfig_t,
    ncclEpDispatchConfig_t,
    ncclEpDispatchInputs_t,
    ncclEpDispatchOutputs_t,
    ncclEpGroup_t,
    ncclEpGroupConfig_t,
    ncclEpHandle_t,
    ncclEpHandleConfig_t,
    ncclEpLayoutInfo_t,
    ncclEpTensor_t,
    ncclEpTensorAllocConfig_t,
    ncclUniqueId,
)

ncclResult = ctypes.c_int
_P = ctypes.POINTER

EP_LIBRARY_NAMES = ("libnccl_ep.so", "libnccl_ep.so.0")
NCCL_LIBRARY_NAMES = ("libnccl.so.2", "libnccl.so")
#: The symbol only epflow's ``libnccl_ep.so`` exports (the NCCL EP version code it implements).
EPFLOW_MARKER = "epflowNcclEpAbiVersion"


class NcclEpError(RuntimeError):
    """A C function returned a code other than ``ncclSuccess``.

    Attributes: ``code`` (an :class:`ncclResult_t`, or the int when NCCL has no such code),
    ``name`` (``"ncclInvalidArgument"`` ...), ``function`` (the C function's name). The library
    logs why on standard error (epflow's: ``NCCL EP (epflow) WARN ...``).
    """

    def __init__(self, function, code):
        try:
            code = ncclResult_t(code)
        except ValueError:
            code = int(code)
        self.code = code
        self.name = result_name(code)
        self.function = function
        super().__init__("%s failed: %s (%d)" % (function, self.name, int(code)))


class LibraryNotFoundError(RuntimeError):
    """``libnccl_ep.so`` could not be found or loaded; the message says where it was looked
    for."""


@dataclass
class Function:
    """One C function: its name, ``restype`` and ``argtypes``."""

    name: str
    restype: Any
    argtypes: List[Any]


#: The 18 functions of ``nccl_ep.h`` (NCCL EP 0.1.0; unchanged in API version 2).
EP_FUNCTIONS = [
    Function("ncclEpGetVersion", ncclResult, [_P(ctypes.c_int)]),
    Function(
        "ncclEpTensorAlloc",
        ncclResult,
        [_P(_TensorPtr), ctypes.c_uint, ctypes.c_int, _P(ctypes.c_size_t), _P(ncclEpTensorAllocConfig_t)],
    ),
    Function("ncclEpTensorDestroy", ncclResult, [_TensorPtr]),
    Function("ncclEpCreateGroup", ncclResult, [_P(ncclEpGroup_t), ncclComm_t, _P(ncclEpGroupConfig_t)]),
    Function("ncclEpGroupDestroy", ncclResult, [ncclEpGroup_t]),
    Function(
        "ncclEpHandleMemSize",
        ncclResult,
        [ncclEpGroup_t, ctypes.c_int, _P(ncclEpHandleConfig_t), _P(ctypes.c_size_t), ctypes.c_int],
    ),
    Function(
        "ncclEpInitHandle",
        ncclResult,
        [_P(ncclEpHandle_t), ncclEpGroup_t, ctypes.c_int, _P(ncclEpHandleConfig_t), ctypes.c_int, _TensorPtr],
    ),
    Function("ncclEpUpdateHandle", ncclResult, [ncclEpHandle_t, _TensorPtr, _P(ncclEpLayoutInfo_t), cudaStream_t]),
    Function(
        "ncclEpCreateHandle",
        ncclResult,
        [
            _P(ncclEpHandle_t),
            ncclEpGroup_t,
            ctypes.c_int,
            _TensorPtr,
            _P(ncclEpLayoutInfo_t),
            _P(ncclEpHandleConfig_t),
            cudaStream_t,
        ],
    ),
    Function("ncclEpHandleDestroy", ncclResult, [ncclEpHandle_t]),
    Function(
        "ncclEpDispatch",
        ncclResult,
        [
            ncclEpHandle_t,
            _P(ncclEpDispatchInputs_t),
            _P(ncclEpDispatchOutputs_t),
            _P(ncclEpLayoutInfo_t),
            _P(ncclEpDispatchConfig_t),
            cudaStream_t,
        ],
    ),
    Function(
        "ncclEpCombine",
        ncclResult,
        [ncclEpHandle_t, _P(ncclEpCombineInputs_t), _P(ncclEpCombineOutputs_t), _P(ncclEpCombineConfig_t), cudaStream_t],
    ),
    Function("ncclEpComplete", ncclResult, [ncclEpHandle_t, _P(ncclEpCompleteConfig_t), cudaStream_t]),
    Function("ncclEpMaskQuery", ncclResult, [ncclEpGroup_t, ctypes.c_void_p, cudaStream_t]),
    Function("ncclEpMaskUpdate", ncclResult, [ncclEpGroup_t, _P(ctypes.c_int), cudaStream_t]),
    Function("ncclEpMaskClean", ncclResult, [ncclEpGroup_t, cudaStream_t]),
    Function("ncclEpGetAsyncError", ncclResult, [ncclEpGroup_t, _P(ctypes.c_int)]),
    Function("ncclEpErrorClear", ncclResult, [ncclEpGroup_t]),
]

#: The functions of NCCL itself (``libnccl.so.2``) that this package uses to make a
#: communicator.
NCCL_FUNCTIONS = [
    Function("ncclGetVersion", ncclResult, [_P(ctypes.c_int)]),
    Function("ncclGetErrorString", ctypes.c_char_p, [ncclResult]),
    Function("ncclGetUniqueId", ncclResult, [_P(ncclUniqueId)]),
    Function("ncclCommInitRank", ncclResult, [_P(ncclComm_t), ctypes.c_int, ncclUniqueId, ctypes.c_int]),
    Function("ncclCommDestroy", ncclResult, [ncclComm_t]),
    Function("ncclCommCount", ncclResult, [ncclComm_t, _P(ctypes.c_int)]),
    Function("ncclCommUserRank", ncclResult, [ncclComm_t, _P(ctypes.c_int)]),
    Function("ncclCommCuDevice", ncclResult, [ncclComm_t, _P(ctypes.c_int)]),
]


# --- finding the libraries ------------------------------------------------------------------


def _dlopen(path_or_name, mode=ctypes.DEFAULT_MODE):
    """``ctypes.CDLL`` or ``None``, with the loader's message in ``_dlopen.last_error``."""
    try:
        return ctypes.CDLL(path_or_name, mode=mode)
    except OSError as e:
        _dlopen.last_error = str(e)
        return None


_dlopen.last_error = ""


def _ep_candidates():
    """``(candidates, explicit)``: where to look for ``libnccl_ep.so``, in order; ``explicit``
    when ``EPFLOW_LIB`` chose one and nothing else may be tried."""
    lib = os.environ.get("EPFLOW_LIB")
    if lib:
        if os.path.isdir(lib):
            return [os.path.join(lib, n) for n in EP_LIBRARY_NAMES], True
        return [lib], True
    out = []
    home = os.environ.get("NCCL_HOME")
    if home:
        out += [os.path.join(home, "lib", n) for n in EP_LIBRARY_NAMES]
    out += list(EP_LIBRARY_NAMES)
    found = ctypes.util.find_library("nccl_ep")
    if found and found not in out:
        out.append(found)
    return out, False


def _nvidia_wheel_dirs():
    """``lib`` directories of the ``nvidia-nccl-cu*`` wheel (``nvidia.nccl`` is a namespace
    package: its ``__path__``, not ``__file__``)."""
    try:
        import nvidia.nccl  # type: ignore

        return [os.path.join(p, "lib") for p in list(nvidia.nccl.__path__)]
    except Exception:
        return []


def _nccl_candidates(ep_path):
    out = []
    explicit = os.environ.get("EPFLOW_NCCL_LIB")
    if explicit:
        out.append(explicit)
    if ep_path and os.path.sep in ep_path:
        d = os.path.dirname(os.path.abspath(ep_path))
        out += [os.path.join(d, n) for n in NCCL_LIBRARY_NAMES]
    home = os.environ.get("NCCL_HOME")
    if home:
        out += [os.path.join(home, "lib", n) for n in NCCL_LIBRARY_NAMES]
    out += list(NCCL_LIBRARY_NAMES)
    for d in _nvidia_wheel_dirs():
        out += [os.path.join(d, n) for n in NCCL_LIBRARY_NAMES]
    return out


def _loadable(candidate):
    """Whether to try ``candidate``: a bare name goes to the loader; a path must exist."""
    return os.path.sep not in candidate or os.path.exists(candidate)


def find_nccl_ep_library():
    """The first ``libnccl_ep.so`` candidate that exists (a path) or a bare name for the
    loader, per this module's search order; ``None`` when no path candidate exists and the
    search is explicit (``EPFLOW_LIB``)."""
    cands, explicit = _ep_candidates()
    for c in cands:
        if _loadable(c):
            return c
    return None if explicit else cands[-1]


class _Loaded:
    """What :func:`load` found: the EP library, NCCL (or ``None``) and their paths."""

    def __init__(self, ep, ep_path, nccl, nccl_path):
        self.ep, self.ep_path, self.nccl, self.nccl_path = ep, ep_path, nccl, nccl_path


_cache = {}


def load(so_file=None):
    """Loads NCCL (``RTLD_GLOBAL``, when found) and then the EP library, ``so_file`` or the
    one this module's search order finds. Cached per path; raises
    :class:`LibraryNotFoundError` naming every place tried."""
    if so_file is not None:
        cands, explicit = [so_file], True
    else:
        cands, explicit = _ep_candidates()
    tried = []
    for cand in cands:
        if cand in _cache:
            return _cache[cand]
        if not _loadable(cand):
            tried.append("%s (no such file)" % cand)
            continue
        nccl, nccl_path = _load_nccl(cand)
        ep = _dlopen(cand)
        if ep is None:
            tried.append("%s (%s)" % (cand, _dlopen.last_error))
            continue
        if not hasattr(ep, "ncclEpCreateGroup"):
            tried.append("%s (loaded, but it does not export ncclEpCreateGroup)" % cand)
            continue
        loaded = _Loaded(ep, _resolved_path(ep, cand), nccl, nccl_path)
        _cache[cand] = loaded
        return loaded
    if so_file is not None:
        how = "so_file=%s" % so_file
    elif explicit:
        how = "EPFLOW_LIB=%s" % os.environ.get("EPFLOW_LIB")
    else:
        how = "EPFLOW_LIB unset; NCCL_HOME=%s" % (os.environ.get("NCCL_HOME") or "unset")
    raise LibraryNotFoundError(
        "NCCL EP library not found (%s). Tried: %s. Set EPFLOW_LIB to epflow's libnccl_ep.so "
        "(cargo build -p epflow-nccl-ep-abi writes target/debug/libnccl_ep.so), set NCCL_HOME, or put its "
        "directory on LD_LIBRARY_PATH." % (how, "; ".join(tried) or "nothing")
    )


_nccl_global = [None, None]


def _load_nccl(ep_path):
    """Loads ``libnccl.so.2`` with ``RTLD_GLOBAL`` once per process (first one found)."""
    if _nccl_global[0] is not None:
        return tuple(_nccl_global)
    for cand in _nccl_candidates(ep_path):
        if not _loadable(cand):
            continue
        lib = _dlopen(cand, mode=ctypes.RTLD_GLOBAL)
        if lib is not None and hasattr(lib, "ncclCommInitRank"):
            _nccl_global[:] = [lib, _resolved_path(lib, cand)]
            break
    return tuple(_nccl_global)


def _resolved_path(lib, fallback):
    """The file a loaded library came from (``dladdr`` of one of its symbols), else
    ``fallback``."""
    try:

        class _DlInfo(ctypes.Structure):
            _fields_ = [
                ("dli_fname", ctypes.c_char_p),
                ("dli_fbase", ctypes.c_void_p),
                ("dli_sname", ctypes.c_char_p),
                ("dli_saddr", ctypes.c_void_p),
            ]

        libdl = ctypes.CDLL(None)
        dladdr = libdl.dladdr
        dladdr.argtypes = [ctypes.c_void_p, ctypes.POINTER(_DlInfo)]
        dladdr.restype = ctypes.c_int
        sym = getattr(lib, "ncclEpGetVersion", None) or getattr(lib, "ncclGetVersion")
        info = _DlInfo()
        if dladdr(ctypes.cast(sym, ctypes.c_void_p), ctypes.byref(info)) and info.dli_fname:
            return os.path.realpath(info.dli_fname.decode())
    except Exception:
        pass
    return fallback


# --- argument helpers -----------------------------------------------------------------------


def stream_handle(stream):
    """A ``cudaStream_t`` from ``stream``: ``None``/0 (the legacy default stream), an int, a
    ``ctypes.c_void_p``, or an object with ``cuda_stream`` (``torch.cuda.Stream``) or ``ptr``
    (CuPy)."""
    if stream is None:
        return None
    if isinstance(stream, int):
        return stream
    if isinstance(stream, ctypes.c_void_p):
        return stream.value
    for attr in ("cuda_stream", "ptr", "handle"):
        v = getattr(stream, attr, None)
        if isinstance(v, int):
            return v
    raise TypeError("not a CUDA stream: %r (pass an int, None, or a torch.cuda.Stream)" % (stream,))


def _handle_value(h, what):
    if h is None:
        return None
    if isinstance(h, ctypes.c_void_p):
        return h.value
    if isinstance(h, int):
        return h
    v = getattr(h, "_as_parameter_", None)
    if isinstance(v, int):
        return v
    raise TypeError("%s must be an int address, a ctypes.c_void_p or None, not %r" % (what, h))


# --- the library ----------------------------------------------------------------------------


class NCCLLibrary:
    """NCCL EP's C API: one method per C function, named as the C function.

    ``NCCLLibrary()`` loads the library this module's search order finds (``EPFLOW_LIB``,
    ``$NCCL_HOME/lib``, the library path), ``NCCLLibrary(path)`` a given one. Methods raise
    :class:`NcclEpError` on failure and return the C function's output parameters (a group or
    handle as an int address). ``self.raw.<name>`` is the bare ctypes function, returning the
    ``ncclResult_t`` as an int. Methods taking a struct accept the struct, ``None`` (NULL), or,
    for append-only structs, any version of it (``ncclEpGroupConfig_v2_t`` for
    ``ncclEpGroupConfig_t``): the library reads its ``size``.

    NCCL's own communicator functions (``ncclGetUniqueId``, ``ncclCommInitRank`` ...) are
    methods too when ``libnccl.so.2`` was found (:attr:`nccl_path`); see
    :attr:`have_nccl`.
    """

    exported_functions = EP_FUNCTIONS
    nccl_functions = NCCL_FUNCTIONS

    def __init__(self, so_file: Optional[str] = None):
        """Loads NCCL (``RTLD_GLOBAL``, when found) and the EP library ``so_file`` (default:
        the search order of :mod:`nccl_ep.library`). Raises :class:`LibraryNotFoundError`."""
        loaded = load(so_file)
        self.lib = loaded.ep
        #: The file the EP library was loaded from.
        self.so_file = loaded.ep_path
        self.nccl_lib = loaded.nccl
        #: The NCCL library loaded with ``RTLD_GLOBAL`` (or ``None``).
        self.nccl_path = loaded.nccl_path
        raw = {}
        for f in EP_FUNCTIONS:
            fn = getattr(self.lib, f.name)
            fn.restype = f.restype
            fn.argtypes = f.argtypes
            raw[f.name] = fn
        if self.nccl_lib is not None:
            for f in NCCL_FUNCTIONS:
                fn = getattr(self.nccl_lib, f.name, None)
                if fn is not None:
                    fn.restype = f.restype
                    fn.argtypes = f.argtypes
                    raw[f.name] = fn
        #: The bare ctypes functions (return codes, NULL allowed), by C name.
        self.raw = types.SimpleNamespace(**raw)
        self._funcs = raw

    def __repr__(self):
        return "NCCLLibrary(%r, epflow=%s, nccl=%r)" % (self.so_file, self.is_epflow, self.nccl_path)

    # -- about the library

    @property
    def is_epflow(self) -> bool:
        """Whether the loaded library is epflow's (it exports ``epflowNcclEpAbiVersion``)."""
        return hasattr(self.lib, EPFLOW_MARKER)

    @property
    def epflow_abi_version(self) -> Optional[int]:
        """epflow's marker: the NCCL EP version code its library implements (``None`` for
        another library)."""
        if not self.is_epflow:
            return None
        return ctypes.c_int.in_dll(self.lib, EPFLOW_MARKER).value

    @property
    def have_nccl(self) -> bool:
        """Whether NCCL's own functions (communicator creation) are available."""
        return "ncclCommInitRank" in self._funcs

    def check(self, function: str, code: int) -> None:
        """Raises :class:`NcclEpError` for ``function`` unless ``code`` is ``ncclSuccess``."""
        if code != ncclResult_t.ncclSuccess:
            raise NcclEpError(function, code)

    def _call(self, name, *args):
        self.check(name, self._funcs[name](*args))

    # -- the 18 functions of nccl_ep.h

    def ncclEpGetVersion(self) -> int:
        """``ncclEpGetVersion``: the library's ``NCCL_EP_VERSION_CODE`` (0.1.0 is 100)."""
        v = ctypes.c_int()
        self._call("ncclEpGetVersion", ctypes.byref(v))
        return v.value

    def ncclEpTensorAlloc(self, ndim: int, datatype: int, sizes, config=None):
        """``ncclEpTensorAlloc``: a library-owned descriptor of ``ndim`` dimensions of
        ``datatype`` with ``sizes`` (a sequence of ``ndim`` ints). Returns a
        ``POINTER(ncclEpTensor_t)``; set ``.contents.data`` to the device memory, and free it
        with :meth:`ncclEpTensorDestroy`."""
        arr = (ctypes.c_size_t * max(len(sizes), 1))(*[int(s) for s in sizes])
        out = _TensorPtr()
        self._call("ncclEpTensorAlloc", ctypes.byref(out), ndim, int(datatype), arr, config)
        return out

    def ncclEpTensorDestroy(self, tensor) -> None:
        """``ncclEpTensorDestroy``: frees a descriptor from :meth:`ncclEpTensorAlloc` (``None``
        is accepted), never its data."""
        self._call("ncclEpTensorDestroy", tensor)

    def ncclEpCreateGroup(self, comm, config) -> int:
        """``ncclEpCreateGroup`` (collective over ``comm``, an ``ncclComm_t`` of the NCCL this
        process loaded): returns the ``ncclEpGroup_t`` as an int."""
        g = ncclEpGroup_t()
        self._call("ncclEpCreateGroup", ctypes.byref(g), _handle_value(comm, "comm"), config)
        return g.value

    def ncclEpGroupDestroy(self, ep_group) -> None:
        """``ncclEpGroupDestroy`` (collective): destroy the group's handles first."""
        self._call("ncclEpGroupDestroy", _handle_value(ep_group, "ep_group"))

    def ncclEpHandleMemSize(self, ep_group, layout: int, config=None, num_topk: int = -1) -> int:
        """``ncclEpHandleMemSize``: bytes a caller-provided ``handle_mem`` needs."""
        n = ctypes.c_size_t()
        self._call(
            "ncclEpHandleMemSize", _handle_value(ep_group, "ep_group"), int(layout), config, ctypes.byref(n), num_topk
        )
        return n.value

    def ncclEpInitHandle(self, ep_group, layout: int, config=None, num_topk: int = -1, handle_mem=None) -> int:
        """``ncclEpInitHandle``: a handle of ``layout`` with no routing yet (bind one with
        :meth:`ncclEpUpdateHandle`); ``num_topk`` is required for low-latency, -1 for
        high-throughput. Returns the ``ncclEpHandle_t`` as an int."""
        h = ncclEpHandle_t()
        self._call(
            "ncclEpInitHandle", ctypes.byref(h), _handle_value(ep_group, "ep_group"), int(layout), config, num_topk, handle_mem
        )
        return h.value

    def ncclEpUpdateHandle(self, handle, topk_idx, layout_info=None, stream=None) -> None:
        """``ncclEpUpdateHandle``: binds the routing ``topk_idx`` (an :class:`ncclEpTensor_t`,
        ``[num_tokens, top_k]`` int64); collective for high-throughput. Keep ``topk_idx``'s
        memory alive and unchanged while operations on the handle may run."""
        self._call(
            "ncclEpUpdateHandle", _handle_value(handle, "handle"), topk_idx, layout_info, stream_handle(stream)
        )

    def ncclEpCreateHandle(self, ep_group, layout: int, topk_idx, layout_info=None, config=None, stream=None) -> int:
        """``ncclEpCreateHandle``: :meth:`ncclEpInitHandle` then :meth:`ncclEpUpdateHandle`.
        High-throughput: ``layout_info.recv_total_counter`` receives the number of tokens this
        rank will receive. Returns the ``ncclEpHandle_t`` as an int."""
        h = ncclEpHandle_t()
        self._call(
            "ncclEpCreateHandle",
            ctypes.byref(h),
            _handle_value(ep_group, "ep_group"),
            int(layout),
            topk_idx,
            layout_info,
            config,
            stream_handle(stream),
        )
        return h.value

    def ncclEpHandleDestroy(self, handle) -> None:
        """``ncclEpHandleDestroy``."""
        self._call("ncclEpHandleDestroy", _handle_value(handle, "handle"))

    def ncclEpDispatch(self, handle, inputs, outputs, layout_info=None, config=None, stream=None) -> None:
        """``ncclEpDispatch`` (collective), in ``stream``'s order: ``inputs``
        (:class:`ncclEpDispatchInputs_t`) to ``outputs`` (:class:`ncclEpDispatchOutputs_t`);
        low-latency needs ``layout_info`` counters (expert-major: ``expert_counters``,
        rank-major: ``src_rank_counters``). With ``config.send_only`` call
        :meth:`ncclEpComplete` before reading the outputs."""
        self._call(
            "ncclEpDispatch",
            _handle_value(handle, "handle"),
            inputs,
            outputs,
            layout_info,
            config,
            stream_handle(stream),
        )

    def ncclEpCombine(self, handle, inputs, outputs, config=None, stream=None) -> None:
        """``ncclEpCombine`` (collective), in ``stream``'s order: expert outputs ``inputs``
        (:class:`ncclEpCombineInputs_t`) back to ``outputs.tokens`` ``[num_tokens, hidden]`` in
        the original token order."""
        self._call(
            "ncclEpCombine", _handle_value(handle, "handle"), inputs, outputs, config, stream_handle(stream)
        )

    def ncclEpComplete(self, handle, config=None, stream=None) -> None:
        """``ncclEpComplete``: the receive half of a ``send_only`` dispatch or combine, in
        ``stream``'s order."""
        self._call("ncclEpComplete", _handle_value(handle, "handle"), config, stream_handle(stream))

    def ncclEpMaskQuery(self, ep_group, mask_status, stream=None) -> None:
        """``ncclEpMaskQuery``: writes 1 (active) or 0 (masked) per rank into ``mask_status``,
        a device address of ``nRanks`` ints (needs ``enable_mask``)."""
        self._call(
            "ncclEpMaskQuery", _handle_value(ep_group, "ep_group"), mask_status, stream_handle(stream)
        )

    def ncclEpMaskUpdate(self, ep_group, mask, stream=None) -> None:
        """``ncclEpMaskUpdate``: ``mask`` is a host sequence of ``nRanks`` ints (1 active, 0
        masked) or a ctypes ``int*`` (needs ``enable_mask``)."""
        if mask is not None and not isinstance(mask, (ctypes.Array, ctypes._Pointer)):
            mask = (ctypes.c_int * len(mask))(*[int(m) for m in mask])
        self._call("ncclEpMaskUpdate", _handle_value(ep_group, "ep_group"), mask, stream_handle(stream))

    def ncclEpMaskClean(self, ep_group, stream=None) -> None:
        """``ncclEpMaskClean``: clears the mask of every rank (collective; needs
        ``enable_mask``)."""
        self._call("ncclEpMaskClean", _handle_value(ep_group, "ep_group"), stream_handle(stream))

    def ncclEpGetAsyncError(self, ep_group) -> int:
        """``ncclEpGetAsyncError``: 1 once the group saw an asynchronous error (a timeout, a
        masked or failed peer), else 0."""
        v = ctypes.c_int()
        self._call("ncclEpGetAsyncError", _handle_value(ep_group, "ep_group"), ctypes.byref(v))
        return v.value

    def ncclEpErrorClear(self, ep_group) -> None:
        """``ncclEpErrorClear``: re-arms :meth:`ncclEpGetAsyncError`."""
        self._call("ncclEpErrorClear", _handle_value(ep_group, "ep_group"))

    # -- NCCL's own functions (when libnccl.so.2 was found)

    def _nccl(self, name):
        fn = self._funcs.get(name)
        if fn is None:
            raise LibraryNotFoundError(
                "%s needs NCCL (libnccl.so.2), which was not found: set EPFLOW_NCCL_LIB to its path, "
                "NCCL_HOME, or LD_LIBRARY_PATH" % name
            )
        return fn

    def _nccl_call(self, name, *args):
        code = self._nccl(name)(*args)
        if code != ncclResult_t.ncclSuccess:
            raise NcclEpError(name, code)

    def ncclGetVersion(self) -> int:
        """NCCL's ``ncclGetVersion``: ``NCCL_VERSION_CODE`` of the loaded NCCL (2.30.7 is
        23007)."""
        v = ctypes.c_int()
        self._nccl_call("ncclGetVersion", ctypes.byref(v))
        return v.value

    def ncclGetErrorString(self, code: int) -> str:
        """NCCL's ``ncclGetErrorString``: NCCL's text for a result code."""
        return self._nccl("ncclGetErrorString")(int(code)).decode(errors="replace")

    def ncclGetUniqueId(self) -> ncclUniqueId:
        """NCCL's ``ncclGetUniqueId``: the id rank 0 makes and hands to every rank."""
        uid = ncclUniqueId()
        self._nccl_call("ncclGetUniqueId", ctypes.byref(uid))
        return uid

    def ncclCommInitRank(self, nranks: int, unique_id: ncclUniqueId, rank: int) -> int:
        """NCCL's ``ncclCommInitRank`` on the current CUDA device: returns the ``ncclComm_t``
        as an int."""
        comm = ncclComm_t()
        self._nccl_call("ncclCommInitRank", ctypes.byref(comm), nranks, unique_id, rank)
        return comm.value

    def ncclCommDestroy(self, comm) -> None:
        """NCCL's ``ncclCommDestroy``."""
        self._nccl_call("ncclCommDestroy", _handle_value(comm, "comm"))

    def ncclCommCount(self, comm) -> int:
        """NCCL's ``ncclCommCount``: the number of ranks."""
        v = ctypes.c_int()
        self._nccl_call("ncclCommCount", _handle_value(comm, "comm"), ctypes.byref(v))
        return v.value

    def ncclCommUserRank(self, comm) -> int:
        """NCCL's ``ncclCommUserRank``: this rank."""
        v = ctypes.c_int()
        self._nccl_call("ncclCommUserRank", _handle_value(comm, "comm"), ctypes.byref(v))
        return v.value

    def ncclCommCuDevice(self, comm) -> int:
        """NCCL's ``ncclCommCuDevice``: the CUDA device of the communicator."""
        v = ctypes.c_int()
        self._nccl_call("ncclCommCuDevice", _handle_value(comm, "comm"), ctypes.byref(v))
        return v.value


def _probe():
    """``(HAVE_NCCL_EP, message)`` at import: loads the library (without raising)."""
    try:
        lib = load()
    except LibraryNotFoundError as e:
        return False, str(e)
    except Exception as e:  # a broken library: still no exception at import
        return False, "NCCL EP library failed to load: %s" % e
    return True, "NCCL EP library: %s (NCCL: %s)" % (lib.ep_path, lib.nccl_path or "not found")


HAVE_NCCL_EP, NCCL_EP_LOAD_MESSAGE = _probe()
if not HAVE_NCCL_EP and not os.environ.get("NCCL_EP_PY_QUIET"):
    warnings.warn(NCCL_EP_LOAD_MESSAGE, RuntimeWarning, stacklevel=2)

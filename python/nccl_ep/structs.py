"""ctypes mirrors of every struct of ``nccl_ep.h``: API version 1 (NCCL EP 0.1.0, what epflow's
``libnccl_ep.so`` implements), NCCL 2.31's dev-branch group config, and API version 2 (NVIDIA
nccl-extensions).

Constructing a struct fills its header the way the C ``*_INIT`` macros do: ``size`` is
``sizeof`` of that very class, ``magic`` is :data:`NCCL_EP_MAGIC` (tensors:
:data:`NCCL_EP_TENSOR_MAGIC`) and a group config's ``version`` is the API version of its layout;
keyword arguments set fields::

    cfg = ncclEpGroupConfig_t(algorithm=NCCL_EP_ALGO_LOW_LATENCY, num_experts=8,
                              max_dispatch_tokens_per_rank=128, max_token_bytes=2 * 7168)

NCCL EP's structs are append-only: a v2 struct is the v1 struct with fields added at its end.
Here each v2 class is a subclass of its v1 class, so a v2 struct is accepted wherever the v1 one
is (``ncclEpGroupConfig_v2_t`` passes as a ``const ncclEpGroupConfig_t*``) and the library tells
the two apart by ``size``, as in C. :mod:`nccl_ep.v2` gives the v2 classes under their C names.

Fields that point to tensor descriptors accept an :class:`ncclEpTensor_t` (stored as a pointer to
it, which keeps it alive), ``None`` (NULL) or a ctypes pointer.
"""

import ctypes

from .constants import (
    NCCL_EP_API_VERSION_1,
    NCCL_EP_API_VERSION_2,
    NCCL_EP_MAGIC,
    NCCL_EP_TENSOR_MAGIC,
    DATATYPE_BYTES,
    ncclDataType_t,
)

c_uint = ctypes.c_uint
c_int = ctypes.c_int

#: C ``typedef``s of the API as ctypes types (opaque handles are ``void*``).
ncclComm_t = ctypes.c_void_p
ncclWindow_t = ctypes.c_void_p
cudaStream_t = ctypes.c_void_p
ncclEpGroup_t = ctypes.c_void_p
ncclEpHandle_t = ctypes.c_void_p
cudaError_t = ctypes.c_int
#: ``cudaError_t (*)(void** ptr, size_t size, void* context)``.
ncclEpAllocFn_t = ctypes.CFUNCTYPE(cudaError_t, ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_void_p)
#: ``cudaError_t (*)(void* ptr, void* context)``.
ncclEpFreeFn_t = ctypes.CFUNCTYPE(cudaError_t, ctypes.c_void_p, ctypes.c_void_p)


class ncclUniqueId(ctypes.Structure):
    """NCCL's ``ncclUniqueId`` (128 opaque bytes), passed by value to ``ncclCommInitRank``."""

    _fields_ = [("internal", ctypes.c_char * 128)]


class _Fields(ctypes.Structure):
    """A struct that refuses to set a name that is not one of its fields (a typo would
    otherwise create a Python attribute the C side never sees), and stores a tensor descriptor
    given to a pointer field as a pointer to it."""

    def __setattr__(self, name, value):
        if not name.startswith("_"):
            ftype = _field_type(type(self), name)
            if ftype is None:
                raise AttributeError("%s has no field %r" % (type(self).__name__, name))
            if isinstance(value, ctypes.Structure) and issubclass(ftype, ctypes._Pointer):
                if not isinstance(value, ftype._type_):
                    raise TypeError(
                        "%s.%s points to %s, not %s" % (type(self).__name__, name, ftype._type_.__name__, type(value).__name__)
                    )
                value = ctypes.pointer(value)
            elif isinstance(value, int) and not isinstance(value, bool) and issubclass(ftype, ctypes._Pointer):
                value = ctypes.cast(ctypes.c_void_p(value), ftype)
        super().__setattr__(name, value)

    def fields(self):
        """The struct's fields as a ``{name: value}`` dict (pointers as integer addresses,
        0 for NULL), for printing and comparison."""
        out = {}
        for name, ftype in _all_fields(type(self)):
            v = getattr(self, name)
            if isinstance(v, (ctypes._Pointer, ctypes._CFuncPtr)):
                v = ctypes.cast(v, ctypes.c_void_p).value or 0
            elif isinstance(v, ctypes.Array):
                v = list(v)
            elif isinstance(v, ctypes.Structure) and hasattr(v, "fields"):
                v = v.fields()
            out[name] = v
        return out

    def __repr__(self):
        return "%s(%s)" % (type(self).__name__, ", ".join("%s=%r" % kv for kv in self.fields().items()))


def _all_fields(cls):
    """Every ``(name, type)`` of ``cls`` and of its base structs, in memory order."""
    chain = [c for c in reversed(cls.__mro__) if "_fields_" in c.__dict__]
    return [f[:2] for c in chain for f in c.__dict__["_fields_"]]


def _field_type(cls, name):
    for n, t in _all_fields(cls):
        if n == name:
            return t
    return None


def field_offsets(cls):
    """``{field: byte offset}`` of struct class ``cls`` (base-class fields included)."""
    out = {}
    for c in reversed(cls.__mro__):
        if "_fields_" not in c.__dict__:
            continue
        for f in c.__dict__["_fields_"]:
            out[f[0]] = getattr(c, f[0]).offset
    return out


class _ApiStruct(_Fields):
    """A struct headed by ``size`` and ``magic`` (every API struct but the tensor and the
    allocator config)."""

    #: ``magic`` written by the constructor.
    _magic_ = NCCL_EP_MAGIC
    #: The API version of this layout (the v2 subclasses say 2).
    api_version = NCCL_EP_API_VERSION_1

    def __init__(self, **fields):
        """Fills ``size`` (``sizeof`` this class) and ``magic`` as the C ``*_INIT`` macro, then
        sets the keyword ``fields``."""
        super().__init__()
        self.size = ctypes.sizeof(type(self))
        self.magic = self._magic_
        for name, value in fields.items():
            setattr(self, name, value)


# --- the tensor descriptor ------------------------------------------------------------------


class ncclEpTensor_t(_Fields):
    """``ncclEpTensor_t``: an N-dimensional tensor of device memory (48 bytes).

    ``ncclEpTensor_t(data, datatype, shape)`` makes the descriptor that ``NCCL_EP_TENSOR_INIT``
    plus field assignments make in C: ``size``/``magic`` filled, ``sizes`` pointing to an array
    this object keeps alive. ``data`` is a device address (an int, e.g. ``torch.Tensor.data_ptr()``);
    the memory stays the caller's and must outlive every call that uses the descriptor.
    """

    _fields_ = [
        ("size", c_uint),
        ("magic", c_uint),
        ("ndim", c_uint),
        ("datatype", c_int),
        ("data", ctypes.c_void_p),
        ("win_hdl", ncclWindow_t),
        ("win_offset", ctypes.c_uint64),
        ("sizes", ctypes.POINTER(ctypes.c_size_t)),
    ]

    def __init__(self, data=None, datatype=None, shape=None, **fields):
        """``data``: device address (int or None); ``datatype``: an :class:`ncclDataType_t`;
        ``shape``: per-dimension sizes (sets ``ndim`` and ``sizes``); other keyword arguments
        set fields directly."""
        super().__init__()
        self.size = ctypes.sizeof(ncclEpTensor_t)
        self.magic = NCCL_EP_TENSOR_MAGIC
        if data is not None:
            self.data = data
        if datatype is not None:
            self.datatype = int(datatype)
        if shape is not None:
            self.set_shape(shape)
        for name, value in fields.items():
            setattr(self, name, value)

    def set_shape(self, shape):
        """Sets ``ndim`` and ``sizes`` to ``shape`` (the array is owned by this object)."""
        dims = [int(d) for d in shape]
        if any(d < 0 for d in dims):
            raise ValueError("negative dimension in shape %r" % (shape,))
        arr = (ctypes.c_size_t * len(dims))(*dims)
        self._sizes_keepalive = arr
        self.ndim = len(dims)
        self.sizes = ctypes.cast(arr, ctypes.POINTER(ctypes.c_size_t))

    @property
    def shape(self):
        """The sizes as a tuple (empty when ``sizes`` is NULL)."""
        if not self.sizes:
            return ()
        return tuple(self.sizes[i] for i in range(self.ndim))

    @property
    def numel(self):
        """Number of elements (product of the sizes)."""
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self):
        """Bytes of the data (``numel`` times the element size of ``datatype``)."""
        return self.numel * DATATYPE_BYTES[ncclDataType_t(self.datatype)]


_TensorPtr = ctypes.POINTER(ncclEpTensor_t)


class ncclEpTensorAllocConfig_t(_ApiStruct):
    """``ncclEpTensorAllocConfig_t`` (8 bytes): reserved options of ``ncclEpTensorAlloc``."""

    _fields_ = [("size", c_uint), ("magic", c_uint)]


class ncclEpAllocConfig_t(_Fields):
    """``ncclEpAllocConfig_t`` (24 bytes, inside the group config): an optional device memory
    allocator for the group's local scratch (both functions or neither). Keep the
    ``ncclEpAllocFn_t``/``ncclEpFreeFn_t`` objects alive until the group and its handles are
    destroyed: epflow's library calls ``free_fn`` up to then, possibly from a thread of its own."""

    _fields_ = [("alloc_fn", ncclEpAllocFn_t), ("free_fn", ncclEpFreeFn_t), ("context", ctypes.c_void_p)]


# --- API version 1 (NCCL EP 0.1.0) ----------------------------------------------------------


class ncclEpGroupConfig_t(_ApiStruct):
    """``ncclEpGroupConfig_t`` of API version 1 (96 bytes); the constructor sets
    ``version = 1``."""

    _fields_ = [
        ("size", c_uint),
        ("magic", c_uint),
        ("version", c_uint),
        ("algorithm", c_int),
        ("num_experts", c_uint),
        ("max_dispatch_tokens_per_rank", c_uint),
        ("max_recv_tokens_per_rank", c_uint),
        ("max_token_bytes", c_uint),
        ("rdma_buffer_size", ctypes.c_ulong),
        ("num_qp_per_rank", c_uint),
        ("num_channels", c_uint),
        ("max_num_sms", c_uint),
        ("alloc", ncclEpAllocConfig_t),
        ("enable_mask", c_uint),
        ("timeout_ns", ctypes.c_uint64),
    ]

    def __init__(self, **fields):
        """As the C ``NCCL_EP_GROUP_CONFIG_INIT``: ``size``, ``magic`` and ``version`` (the API
        version of this layout) filled; keyword ``fields`` set."""
        fields.setdefault("version", self.api_version)
        super().__init__(**fields)


class ncclEpLayoutInfo_t(_ApiStruct):
    """``ncclEpLayoutInfo_t`` of API version 1 (40 bytes): the counter tensors of a handle or
    dispatch."""

    _fields_ = [
        ("size", c_uint),
        ("magic", c_uint),
        ("expert_counters", _TensorPtr),
        ("src_rank_counters", _TensorPtr),
        ("expert_offsets", _TensorPtr),
        ("recv_total_counter", _TensorPtr),
    ]


class ncclEpDispatchInputs_t(_ApiStruct):
    """``ncclEpDispatchInputs_t`` (32 bytes, the same in v1 and v2)."""

    _fields_ = [
        ("size", c_uint),
        ("magic", c_uint),
        ("tokens", _TensorPtr),
        ("topk_weights", _TensorPtr),
        ("scales", _TensorPtr),
    ]


class ncclEpDispatchOutputs_t(_ApiStruct):
    """``ncclEpDispatchOutputs_t`` (40 bytes, the same in v1 and v2)."""

    _fields_ = [
        ("size", c_uint),
        ("magic", c_uint),
        ("tokens", _TensorPtr),
        ("topk_weights", _TensorPtr),
        ("scales", _TensorPtr),
        ("topk_idx", _TensorPtr),
    ]


class ncclEpCombineInputs_t(_ApiStruct):
    """``ncclEpCombineInputs_t`` of API version 1 (24 bytes)."""

    _fields_ = [("size", c_uint), ("magic", c_uint), ("tokens", _TensorPtr), ("topk_weights", _TensorPtr)]


class ncclEpCombineOutputs_t(_ApiStruct):
    """``ncclEpCombineOutputs_t`` (24 bytes, the same in v1 and v2)."""

    _fields_ = [("size", c_uint), ("magic", c_uint), ("tokens", _TensorPtr), ("topk_weights", _TensorPtr)]


class ncclEpHandleConfig_t(_ApiStruct):
    """``ncclEpHandleConfig_t`` (16 bytes, the same in v1 and v2)."""

    _fields_ = [("size", c_uint), ("magic", c_uint), ("dispatch_output_per_expert_alignment", ctypes.c_size_t)]


class ncclEpDispatchConfig_t(_ApiStruct):
    """``ncclEpDispatchConfig_t`` of API version 1 (20 bytes)."""

    _fields_ = [
        ("size", c_uint),
        ("magic", c_uint),
        ("send_only", c_uint),
        ("round_scales", c_uint),
        ("pass_direction", c_int),
    ]


class ncclEpCombineConfig_t(_ApiStruct):
    """``ncclEpCombineConfig_t`` of API version 1 (16 bytes)."""

    _fields_ = [("size", c_uint), ("magic", c_uint), ("send_only", c_uint), ("pass_direction", c_int)]


class ncclEpCompleteConfig_t(_ApiStruct):
    """``ncclEpCompleteConfig_t`` (8 bytes): reserved options of ``ncclEpComplete``."""

    _fields_ = [("size", c_uint), ("magic", c_uint)]


# --- NCCL 2.31 dev branch: API version 1 with zero_copy --------------------------------------


class ncclEpGroupConfig_dev_t(ncclEpGroupConfig_t):
    """NVIDIA/nccl's dev-branch (2.31) ``ncclEpGroupConfig_t``: version 1 plus ``zero_copy``
    (104 bytes with its tail padding), still ``version = 1``."""

    _fields_ = [("zero_copy", c_int)]


# --- API version 2 (NVIDIA nccl-extensions) --------------------------------------------------


class ncclEpGroupConfig_v2_t(ncclEpGroupConfig_t):
    """``ncclEpGroupConfig_t`` of API version 2 (112 bytes): ``zero_copy``,
    ``overflow_policy``, ``num_topk``; the constructor sets ``version = 2``."""

    api_version = NCCL_EP_API_VERSION_2
    _fields_ = [
        ("zero_copy", c_int),
        ("overflow_policy", c_int),
        ("num_topk", c_uint),
        ("padding_v2", ctypes.c_ubyte * 4),
    ]


class ncclEpLayoutInfo_v2_t(ncclEpLayoutInfo_t):
    """``ncclEpLayoutInfo_t`` of API version 2 (48 bytes): ``recv_topk_idx_kind``."""

    api_version = NCCL_EP_API_VERSION_2
    _fields_ = [("recv_topk_idx_kind", c_int), ("padding_v2", ctypes.c_ubyte * 4)]


class ncclEpCombineInputs_v2_t(ncclEpCombineInputs_t):
    """``ncclEpCombineInputs_t`` of API version 2 (32 bytes): ``scales`` (NVFP4 combine)."""

    api_version = NCCL_EP_API_VERSION_2
    _fields_ = [("scales", _TensorPtr)]


class ncclEpDispatchConfig_v2_t(ncclEpDispatchConfig_t):
    """``ncclEpDispatchConfig_t`` of API version 2 (24 bytes): ``quant_recipe``
    (:class:`ncclEpDispQuant_t`)."""

    api_version = NCCL_EP_API_VERSION_2
    _fields_ = [("quant_recipe", c_int)]


class ncclEpCombineConfig_v2_t(ncclEpCombineConfig_t):
    """``ncclEpCombineConfig_t`` of API version 2 (20 bytes): ``quant_recipe``
    (:class:`ncclEpCombQuant_t`)."""

    api_version = NCCL_EP_API_VERSION_2
    _fields_ = [("quant_recipe", c_int)]


#: C name -> class, API version 1 (the 13 structs of NCCL EP 0.1.0's header).
STRUCTS_V1 = {
    "ncclEpTensor_t": ncclEpTensor_t,
    "ncclEpTensorAllocConfig_t": ncclEpTensorAllocConfig_t,
    "ncclEpAllocConfig_t": ncclEpAllocConfig_t,
    "ncclEpGroupConfig_t": ncclEpGroupConfig_t,
    "ncclEpLayoutInfo_t": ncclEpLayoutInfo_t,
    "ncclEpDispatchInputs_t": ncclEpDispatchInputs_t,
    "ncclEpDispatchOutputs_t": ncclEpDispatchOutputs_t,
    "ncclEpCombineInputs_t": ncclEpCombineInputs_t,
    "ncclEpCombineOutputs_t": ncclEpCombineOutputs_t,
    "ncclEpHandleConfig_t": ncclEpHandleConfig_t,
    "ncclEpDispatchConfig_t": ncclEpDispatchConfig_t,
    "ncclEpCombineConfig_t": ncclEpCombineConfig_t,
    "ncclEpCompleteConfig_t": ncclEpCompleteConfig_t,
}

#: C name -> class, API version 2 (the v1 classes where v2 did not change the struct).
STRUCTS_V2 = dict(
    STRUCTS_V1,
    ncclEpGroupConfig_t=ncclEpGroupConfig_v2_t,
    ncclEpLayoutInfo_t=ncclEpLayoutInfo_v2_t,
    ncclEpCombineInputs_t=ncclEpCombineInputs_v2_t,
    ncclEpDispatchConfig_t=ncclEpDispatchConfig_v2_t,
    ncclEpCombineConfig_t=ncclEpCombineConfig_v2_t,
)


def structs_for(api_version):
    """The ``{C name: class}`` table of API version ``api_version`` (1 or 2)."""
    if api_version == NCCL_EP_API_VERSION_1:
        return dict(STRUCTS_V1)
    if api_version == NCCL_EP_API_VERSION_2:
        return dict(STRUCTS_V2)
    raise ValueError("NCCL EP API version %r: this package knows 1 and 2" % (api_version,))

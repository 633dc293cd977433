"""Enums and constants of NCCL EP's C API (``nccl_ep.h``), with NCCL's own types.

Every enum is an :class:`enum.IntEnum` named as its C ``typedef`` (``ncclResult_t``,
``ncclEpAlgorithm_t``, ...), and every enumerator is also exported at module level under its C
name (``ncclInvalidArgument``, ``NCCL_EP_ALGO_LOW_LATENCY``, ...), so code written against the C
header reads the same in Python. Values are those of NCCL 2.30.7's ``nccl.h``, NCCL EP 0.1.0's
``nccl_ep.h`` (API version 1, what epflow's ``libnccl_ep.so`` implements) and NVIDIA
nccl-extensions' ``nccl_ep.h`` (API version 2) for the v2 additions.
"""

import enum

# --- versions -------------------------------------------------------------------------------

NCCL_EP_MAJOR = 0
NCCL_EP_MINOR = 1
NCCL_EP_PATCH = 0
#: ``NCCL_EP_MAJOR * 10000 + NCCL_EP_MINOR * 100 + NCCL_EP_PATCH`` (0.1.0 = 100); what
#: ``ncclEpGetVersion`` reports.
NCCL_EP_VERSION_CODE = NCCL_EP_MAJOR * 10000 + NCCL_EP_MINOR * 100 + NCCL_EP_PATCH
#: The API version of NCCL EP 0.1.0, which epflow's library implements (``config.version``).
NCCL_EP_API_VERSION_1 = 1
#: The API version of NVIDIA nccl-extensions' ``nccl_ep`` (append-only v2 structs).
NCCL_EP_API_VERSION_2 = 2
#: The API version this package's default structs (``ncclEpGroupConfig_t`` ...) follow.
NCCL_EP_API_VERSION = NCCL_EP_API_VERSION_1

#: ``magic`` of every API struct (``NCCL_EP_MAGIC``).
NCCL_EP_MAGIC = 0xC00FFFEE
#: ``magic`` of a caller-initialised tensor descriptor (``NCCL_EP_TENSOR_MAGIC``).
NCCL_EP_TENSOR_MAGIC = 0xCAFECAFE
#: "Let the library choose" for sizes, counts and policies (``NCCL_EP_AUTO``).
NCCL_EP_AUTO = 0

#: ``NCCL_UNIQUE_ID_BYTES`` of ``nccl.h``.
NCCL_UNIQUE_ID_BYTES = 128


class ncclResult_t(enum.IntEnum):
    """NCCL's result codes (``nccl.h`` of NCCL 2.30.7; ``ncclTimeout`` is 8)."""

    ncclSuccess = 0
    ncclUnhandledCudaError = 1
    ncclSystemError = 2
    ncclInternalError = 3
    ncclInvalidArgument = 4
    ncclInvalidUsage = 5
    ncclRemoteError = 6
    ncclInProgress = 7
    ncclTimeout = 8
    ncclNumResults = 9


class ncclDataType_t(enum.IntEnum):
    """NCCL's data types (the aliases ``ncclChar``, ``ncclInt``, ``ncclHalf``, ``ncclFloat``,
    ``ncclDouble`` are enum aliases of the same values)."""

    ncclInt8 = 0
    ncclChar = 0
    ncclUint8 = 1
    ncclInt32 = 2
    ncclInt = 2
    ncclUint32 = 3
    ncclInt64 = 4
    ncclUint64 = 5
    ncclFloat16 = 6
    ncclHalf = 6
    ncclFloat32 = 7
    ncclFloat = 7
    ncclFloat64 = 8
    ncclDouble = 8
    ncclBfloat16 = 9
    ncclFloat8e4m3 = 10
    ncclFloat8e5m2 = 11
    #: NCCL's reserved type 12 (two packed FP4 values per byte), which NCCL EP v2 uses only to
    #: forward pre-quantized tokens (``NCCL_EP_DISP_QUANT_FWD``).
    ncclFloat4x2 = 12


#: Bytes per element of each data type (``ncclFloat4x2``: one byte holds two values).
DATATYPE_BYTES = {
    ncclDataType_t.ncclInt8: 1,
    ncclDataType_t.ncclUint8: 1,
    ncclDataType_t.ncclInt32: 4,
    ncclDataType_t.ncclUint32: 4,
    ncclDataType_t.ncclInt64: 8,
    ncclDataType_t.ncclUint64: 8,
    ncclDataType_t.ncclFloat16: 2,
    ncclDataType_t.ncclFloat32: 4,
    ncclDataType_t.ncclFloat64: 8,
    ncclDataType_t.ncclBfloat16: 2,
    ncclDataType_t.ncclFloat8e4m3: 1,
    ncclDataType_t.ncclFloat8e5m2: 1,
    ncclDataType_t.ncclFloat4x2: 1,
}


class ncclEpAlgorithm_t(enum.IntEnum):
    """``ncclEpGroupConfig_t.algorithm``."""

    NCCL_EP_ALGO_LOW_LATENCY = 0
    NCCL_EP_ALGO_HIGH_THROUGHPUT = 1


class ncclEpLayout_t(enum.IntEnum):
    """The dispatch output layout of a handle. Low-latency: EXPERT_MAJOR, RANK_MAJOR;
    high-throughput: FLAT (and EXPERT_MAJOR in NVIDIA's library)."""

    NCCL_EP_LAYOUT_UNSET = 0
    NCCL_EP_LAYOUT_EXPERT_MAJOR = 1
    NCCL_EP_LAYOUT_RANK_MAJOR = 2
    NCCL_EP_LAYOUT_FLAT = 3


class ncclEpPassDir_t(enum.IntEnum):
    """Forward or backward pass (high-throughput dispatch and combine)."""

    NCCL_EP_FWD_PASS = 0
    NCCL_EP_BWD_PASS = 1


class ncclEpZeroCopyMode_t(enum.IntEnum):
    """API v2 ``ncclEpGroupConfig_t.zero_copy`` (and the NCCL 2.31 dev branch's)."""

    NCCL_EP_ZERO_COPY_AUTO = 0
    NCCL_EP_ZERO_COPY_OFF = 1
    NCCL_EP_ZERO_COPY_ON = 2


class ncclEpOverflowPolicy_t(enum.IntEnum):
    """API v2 ``ncclEpGroupConfig_t.overflow_policy`` (high-throughput receive overflow)."""

    NCCL_EP_OVERFLOW_AUTO = 0
    NCCL_EP_OVERFLOW_TRAP = 1
    NCCL_EP_OVERFLOW_DROP = 2


class ncclEpExpertIdKind_t(enum.IntEnum):
    """API v2 ``ncclEpLayoutInfo_t.recv_topk_idx_kind``: local or global expert ids."""

    NCCL_EP_EXPERT_ID_AUTO = 0
    NCCL_EP_EXPERT_ID_LOCAL = 1
    NCCL_EP_EXPERT_ID_GLOBAL = 2


class ncclEpDispQuant_t(enum.IntEnum):
    """API v2 ``ncclEpDispatchConfig_t.quant_recipe``."""

    NCCL_EP_DISP_QUANT_NONE = 0
    NCCL_EP_DISP_QUANT_FWD = 1
    NCCL_EP_DISP_QUANT_DS_FP8E3M4 = 2


class ncclEpCombQuant_t(enum.IntEnum):
    """API v2 ``ncclEpCombineConfig_t.quant_recipe``."""

    NCCL_EP_COMB_QUANT_NONE = 0
    NCCL_EP_COMB_QUANT_NVFP4 = 1


#: Every enum of this module, for export and for the tests.
ENUMS = (
    ncclResult_t,
    ncclDataType_t,
    ncclEpAlgorithm_t,
    ncclEpLayout_t,
    ncclEpPassDir_t,
    ncclEpZeroCopyMode_t,
    ncclEpOverflowPolicy_t,
    ncclEpExpertIdKind_t,
    ncclEpDispQuant_t,
    ncclEpCombQuant_t,
)


def result_name(code):
    """NCCL's name of result code ``code`` (``4`` -> ``"ncclInvalidArgument"``); an unknown
    code gives ``"ncclResult(<code>)"``."""
    try:
        return ncclResult_t(code).name
    except ValueError:
        return "ncclResult(%d)" % int(code)


def _export_enumerators(namespace):
    """Puts every enumerator of :data:`ENUMS` into ``namespace`` under its C name (the first
    name of each value wins for aliases, then the aliases themselves)."""
    for e in ENUMS:
        for name, member in e.__members__.items():
            namespace.setdefault(name, member)


_export_enumerators(globals())

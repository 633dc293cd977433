"""``nccl_ep``: a pure-ctypes Python binding of NCCL EP's C API (``nccl_ep.h``), for epflow's
drop-in ``libnccl_ep.so`` (and NVIDIA's library of the same API).

- :data:`HAVE_NCCL_EP`: whether the library loaded at import (:data:`NCCL_EP_LOAD_MESSAGE` says
  which, or why not; importing never raises for a missing library).
- :class:`NCCLLibrary`: its methods are the 18 C functions; they raise :class:`NcclEpError`
  (``.code``, ``.name``) on failure; ``NCCLLibrary().raw`` has the bare functions, which return
  the ``ncclResult_t``.
- The enums and constants under their C names (:mod:`nccl_ep.constants`), and a ctypes struct
  for every struct (:mod:`nccl_ep.structs`; API version 2 in :mod:`nccl_ep.v2`).
- :mod:`nccl_ep.torch_ep`: dispatch/combine on PyTorch tensors (imports torch when used).

The library is found through ``EPFLOW_LIB`` (a path), ``$NCCL_HOME/lib/libnccl_ep.so`` or the
library path, after ``libnccl.so.2`` is loaded with ``RTLD_GLOBAL``; see
:mod:`nccl_ep.library`.
"""

from ._version import __version__
from .constants import *  # noqa: F401,F403
from .constants import ENUMS, DATATYPE_BYTES, result_name  # noqa: F401
from .structs import (  # noqa: F401
    STRUCTS_V1,
    STRUCTS_V2,
    cudaStream_t,
    field_offsets,
    ncclComm_t,
    ncclEpAllocConfig_t,
    ncclEpAllocFn_t,
    ncclEpCombineConfig_t,
    ncclEpCombineConfig_v2_t,
    ncclEpCombineInputs_t,
    ncclEpCombineInputs_v2_t,
    ncclEpCombineOutputs_t,
    ncclEpCompleteConfig_t,
    ncclEpDispatchConfig_t,
    ncclEpDispatchConfig_v2_t,
    ncclEpDispatchInputs_t,
    ncclEpDispatchOutputs_t,
    ncclEpFreeFn_t,
    ncclEpGroup_t,
    ncclEpGroupConfig_dev_t,
    ncclEpGroupConfig_t,
    ncclEpGroupConfig_v2_t,
    ncclEpHandle_t,
    ncclEpHandleConfig_t,
    ncclEpLayoutInfo_t,
    ncclEpLayoutInfo_v2_t,
    ncclEpTensor_t,
    ncclEpTensorAllocConfig_t,
    ncclUniqueId,
    structs_for,
)
from .library import (  # noqa: F401
    EP_FUNCTIONS,
    HAVE_NCCL_EP,
    NCCL_EP_LOAD_MESSAGE,
    LibraryNotFoundError,
    NCCLLibrary,
    NcclEpError,
    find_nccl_ep_library,
    stream_handle,
)
from . import v2  # noqa: F401

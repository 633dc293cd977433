"""NCCL EP API version 2 (NVIDIA nccl-extensions' ``nccl_ep.h``): its structs under their C
names, for code written against that header::

    from nccl_ep import v2
    cfg = v2.ncclEpGroupConfig_t(num_experts=8, overflow_policy=v2.NCCL_EP_OVERFLOW_DROP)
    assert cfg.size == 112 and cfg.version == 2

epflow's ``libnccl_ep.so`` reads every struct of API version 1, NCCL 2.31's 104-byte group config
and API version 2 up to its ``size`` (the fields a size does not cover are zero). It implements
the dispatch recipes ``DS_FP8E3M4`` and ``FWD`` and the ``NVFP4`` combine in low-latency groups
(on Hopper too: epflow's NVFP4 conversions are its own), GLOBAL expert ids, int32
``topk_idx`` and ``NCCL_EP_OVERFLOW_DROP`` on high-throughput flat handles; the v2 features it
does not implement (zero copy, the quantized recipes in high-throughput groups, DROP with
high-throughput expert-major handles) return ``ncclInvalidUsage`` with a log line naming the
field.
"""

from .constants import *  # noqa: F401,F403  (the enums are the same in both versions)
from .constants import NCCL_EP_API_VERSION_2 as NCCL_EP_API_VERSION  # noqa: F401
from .structs import STRUCTS_V2 as _S

ncclEpTensor_t = _S["ncclEpTensor_t"]
ncclEpTensorAllocConfig_t = _S["ncclEpTensorAllocConfig_t"]
ncclEpAllocConfig_t = _S["ncclEpAllocConfig_t"]
ncclEpGroupConfig_t = _S["ncclEpGroupConfig_t"]
ncclEpLayoutInfo_t = _S["ncclEpLayoutInfo_t"]
ncclEpDispatchInputs_t = _S["ncclEpDispatchInputs_t"]
ncclEpDispatchOutputs_t = _S["ncclEpDispatchOutputs_t"]
ncclEpCombineInputs_t = _S["ncclEpCombineInputs_t"]
ncclEpCombineOutputs_t = _S["ncclEpCombineOutputs_t"]
ncclEpHandleConfig_t = _S["ncclEpHandleConfig_t"]
ncclEpDispatchConfig_t = _S["ncclEpDispatchConfig_t"]
ncclEpCombineConfig_t = _S["ncclEpCombineConfig_t"]
ncclEpCompleteConfig_t = _S["ncclEpCompleteConfig_t"]
